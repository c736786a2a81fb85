// SPDX-License-Identifier: MIT
// Multi-head latent attention (§9): keys and values are decompressed from a small latent c_kv,
// queries from a latent c_q, and position enters through separate, rotated "decoupled RoPE"
// features concatenated to every query and key head.
//
//   x [B*S, d] ─ ·W_DKV ─▶ c_kv [B*S, d_kv] ─┬─ ·W_UK ─▶ K      [B*S, H_kv·d_h] ─┐
//              │                              └─ ·W_UV ─▶ V      [B*S, H_kv·d_h] ─┼───────┐
//              ├ ·W_DQ ─▶ c_q [B*S, d_q] ──── ·W_UQ ────▶ Q      [B*S, H_q·d_h]  ─┼─┐     │
//              ├ ·W_QR ─▶ RoPE ─────────────────────────▶ Q_rope [B*S, H_q·d_r]  ─┼─┤     │
//              └ ·W_KR ─▶ RoPE ─────────────────────────▶ K_rope [B*S, H_kr·d_r] ─┘ │     │
//                                                                                   ▼     ▼
//   per head:  Q_final = [Q_h ‖ Q_rope,h]            (d_h + d_r)      sdpa, then Concat · W_O
//              K_final = [K_g ‖ K_rope,g or K_rope,0] (d_h + d_r)     -> out [B*S, d]
//              V_g                                    (d_h)
//
// Departures from and additions to the document (SEED-NOTES.md, §9.2 - §9.4):
//   - softmax scale 1/√(d_h + d_r), the width of Q_final and K_final (apex::sdpa's default);
//   - H_kr, the number of K_rope heads, is H_kv as §9.3 writes it (the default) or 1, one K_rope
//     head shared by every head as DeepSeek-V2/V3 do;
//   - the cache: §9.4 counts only c_kv (d_kv values per token), but K_rope is computed from x,
//     not from c_kv, so a decoder must cache it too: d_kv + H_kr·d_r values per token. Both
//     figures are available, under names that say which is which.
//
// Decoding against a LatentCache (kv_cache.hpp) comes in two exact forms:
//   naive     (forward_cached): decompress K = c_kv·W_UK and V = c_kv·W_UV for every cached
//             token, then attend as forward() does. The oracle, and the cheaper path for long
//             chunks such as a prompt.
//   absorbed  (forward_absorbed, after absorb_mla_weights): with g the key head of query head h,
//               q_h·k_j = q_h·(c_kv,j W_UK,g) = (q_h W_UK,gᵀ)·c_kv,j          (W_UK into the query)
//               Σ_j p_j v_j = Σ_j p_j c_kv,j W_UV,g = (Σ_j p_j c_kv,j) W_UV,g   (W_UV into the
//               output)
//             so every query head attends straight to the cached rows [c_kv ‖ K_rope] with the
//             query [q_h W_UK,gᵀ ‖ q_rope,h] (d_kv + d_r wide) and values c_kv: one apex::sdpa call
//             whose single key/value head is shared by all H_q query heads. Nothing is
//             decompressed; the cost per cached token is O(H_q·d_kv) instead of the naive
//             O(H_kv·d_h·d_kv) decompression, which is what makes MLA decoding cheap.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cache_memory.hpp>
#include <apex/cached_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/paged_cache.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// Shape of a MultiHeadLatentAttention layer (§9.2, §9.3, §9.5).
struct MlaConfig {
  Index d_model = 0;       ///< d
  Index d_q = 0;           ///< width of the query latent c_q
  Index d_kv = 0;          ///< width of the key/value latent c_kv
  Index num_q_heads = 0;   ///< H_q
  Index num_kv_heads = 0;  ///< H_kv, a divisor of H_q
  Index head_dim = 0;      ///< d_h, the content part of every query/key head and the value width
  Index rope_dim = 0;      ///< d_r, the decoupled-RoPE part of every query/key head (even)
  /// H_kr, the number of K_rope heads: 0 (the default) means num_kv_heads, one K_rope head per
  /// key head as §9.3 writes it; 1 means one K_rope head shared by every head (DeepSeek-V2/V3).
  Index num_rope_key_heads = 0;

  /// H_kr with the default resolved.
  Index rope_key_heads() const {
    return num_rope_key_heads == 0 ? num_kv_heads : num_rope_key_heads;
  }
  /// d_h + d_r, the width of Q_final and K_final.
  Index qk_dim() const { return head_dim + rope_dim; }
};

namespace detail {

inline void check_mla_config(const MlaConfig& c) {
  APEX_CHECK(c.d_model >= 1, "[mla] d_model (" << c.d_model << ") must be >= 1");
  APEX_CHECK(c.d_q >= 1, "[mla] d_q (" << c.d_q << ") must be >= 1");
  APEX_CHECK(c.d_kv >= 1, "[mla] d_kv (" << c.d_kv << ") must be >= 1");
  APEX_CHECK(c.head_dim >= 1, "[mla] head_dim (" << c.head_dim << ") must be >= 1");
  APEX_CHECK(
      c.rope_dim >= 2 && c.rope_dim % 2 == 0,
      "[mla] rope_dim d_r (" << c.rope_dim << ") must be even and at least 2 (RoPE rotates pairs)");
  check_head_counts(c.num_q_heads, c.num_kv_heads, "mla");
  APEX_CHECK(c.num_rope_key_heads == 0 || c.num_rope_key_heads == 1 ||
                 c.num_rope_key_heads == c.num_kv_heads,
             "[mla] num_rope_key_heads ("
                 << c.num_rope_key_heads << ") must be 1 (one shared K_rope head) or num_kv_heads ("
                 << c.num_kv_heads << ") (0 also means num_kv_heads)");
  // Every size the layer forms from the config must fit in 64 bits: the widths of the heads
  // side by side (H·d_h, H·d_r; H_kv <= H_q and H_kr <= H_q, so the query side bounds them), the
  // head width d_h + d_r, the cached row d_kv + H_kr·d_r, MHA's 2·H_q·d_h of the cache ratios,
  // and the weight count (mla_parameter_count), which bounds every weight's element count.
  const char* op = "mla";
  checked_product({2, c.num_q_heads, c.head_dim}, op, "2*num_q_heads*head_dim");
  checked_product(c.num_q_heads, c.rope_dim, op, "num_q_heads*rope_dim");
  checked_sum(c.head_dim, c.rope_dim, op, "head_dim + rope_dim");
  checked_sum(c.d_kv, checked_product(c.rope_key_heads(), c.rope_dim, op, "H_kr*rope_dim"), op,
              "d_kv + H_kr*rope_dim");
  const std::int64_t counts[] = {
      checked_product(c.d_model, c.d_kv, op, "W_DKV count d_model*d_kv"),
      checked_product({2, c.d_kv, c.num_kv_heads, c.head_dim}, op,
                      "W_UK + W_UV count 2*d_kv*num_kv_heads*head_dim"),
      checked_product(c.d_model, c.d_q, op, "W_DQ count d_model*d_q"),
      checked_product({c.d_q, c.num_q_heads, c.head_dim}, op,
                      "W_UQ count d_q*num_q_heads*head_dim"),
      checked_product({c.d_model, c.num_q_heads, c.rope_dim}, op,
                      "W_QR count d_model*num_q_heads*rope_dim"),
      checked_product({c.d_model, c.rope_key_heads(), c.rope_dim}, op,
                      "W_KR count d_model*H_kr*rope_dim"),
      checked_product({c.num_q_heads, c.head_dim, c.d_model}, op,
                      "W_O count num_q_heads*head_dim*d_model"),
  };
  std::int64_t total = 0;
  for (const std::int64_t n : counts) total = checked_sum(total, n, op, "weight count");
  (void)total;  // only its check matters here
}

}  // namespace detail

/// One weight matrix of an MLA layer, for printing the §9.5 table.
struct MlaMatrixShape {
  std::string name;     ///< "W_DKV", "W_UK", ...
  Index rows = 0;       ///< input width: the matrix is applied as x·W with x [tokens, rows]
  Index cols = 0;       ///< output width
  std::string purpose;  ///< §9.5's "Purpose" column
  /// Number of weights, rows·cols.
  std::int64_t count() const { return static_cast<std::int64_t>(rows) * cols; }
};

/// The weights of an MLA layer with their shapes (§9.5), in the document's order:
///   W_DKV [d, d_kv], W_UK [d_kv, H_kv·d_h], W_UV [d_kv, H_kv·d_h], W_DQ [d, d_q],
///   W_UQ [d_q, H_q·d_h], W_QR [d, H_q·d_r], W_KR [d, H_kr·d_r], W_O [H_q·d_h, d].
/// (§9.5 writes W_KR as [d, H_kv·d_r], which is the default H_kr = H_kv.) Throws on an invalid
/// config. Allocates the vector.
inline std::vector<MlaMatrixShape> mla_parameter_table(const MlaConfig& c) {
  detail::check_mla_config(c);
  const Index d = c.d_model;
  return {
      {"W_DKV", d, c.d_kv, "Compress to KV latent"},
      {"W_UK", c.d_kv, c.num_kv_heads * c.head_dim, "Decompress to K"},
      {"W_UV", c.d_kv, c.num_kv_heads * c.head_dim, "Decompress to V"},
      {"W_DQ", d, c.d_q, "Compress to Q latent"},
      {"W_UQ", c.d_q, c.num_q_heads * c.head_dim, "Decompress to Q"},
      {"W_QR", d, c.num_q_heads * c.rope_dim, "Q RoPE projection"},
      {"W_KR", d, c.rope_key_heads() * c.rope_dim, "K RoPE projection"},
      {"W_O", c.num_q_heads * c.head_dim, d, "Output projection"},
  };
}

/// Total parameters of an MLA layer (§9.5): the sum of mla_parameter_table's counts. No biases.
/// Throws on an invalid config, including one whose count does not fit in 64 bits.
inline std::int64_t mla_parameter_count(const MlaConfig& c) {
  std::int64_t total = 0;
  // The config check has bounded the sum; the checked sum states it.
  for (const MlaMatrixShape& m : mla_parameter_table(c)) {
    total = detail::checked_sum(total, m.count(), "mla", "weight count");
  }
  return total;
}

/// KV-cache values per token and layer as §9.4 counts them: only c_kv, d_kv values.
/// This undercounts: see mla_cache_values_per_token.
inline std::int64_t mla_cache_values_per_token_document(const MlaConfig& c) {
  detail::check_mla_config(c);
  return c.d_kv;
}

/// KV-cache values per token and layer that a decoder actually has to keep: c_kv and the
/// rotated K_rope, d_kv + H_kr·d_r. K_rope = RoPE(x·W_KR) comes from x, not from c_kv, so it
/// cannot be recomputed from the cached latent (SEED-NOTES.md, §9.4).
inline std::int64_t mla_cache_values_per_token(const MlaConfig& c) {
  detail::check_mla_config(c);  // which includes that d_kv + H_kr·d_r fits
  return static_cast<std::int64_t>(c.d_kv) +
         static_cast<std::int64_t>(c.rope_key_heads()) * c.rope_dim;
}

/// §9.4's ratio to multi-head attention with H_q heads of d_h (2·H_q·d_h values per token):
/// d_kv / (2·H_q·d_h), c_kv only. APEX-1 Large: 512 / 32768 = 1.5625% (§9.4 rounds to 1.6%).
inline double mla_cache_ratio_document(const MlaConfig& c) {
  return static_cast<double>(mla_cache_values_per_token_document(c)) /
         static_cast<double>(kv_cache_values_per_token(c.num_q_heads, c.head_dim));
}

/// The true ratio to multi-head attention with H_q heads of d_h: (d_kv + H_kr·d_r) / (2·H_q·d_h).
inline double mla_cache_ratio(const MlaConfig& c) {
  return static_cast<double>(mla_cache_values_per_token(c)) /
         static_cast<double>(kv_cache_values_per_token(c.num_q_heads, c.head_dim));
}

/// The weight matrices of an MLA layer, applied as x·W (x on the left); shapes as in
/// mla_parameter_table, stored as Weight (the layer's scalar type, Eigen::half or
/// Eigen::bfloat16).
template <class Weight>
struct MlaWeights {
  RowMatrix<Weight> w_dkv;  ///< [d, d_kv]
  RowMatrix<Weight> w_uk;   ///< [d_kv, H_kv·d_h]
  RowMatrix<Weight> w_uv;   ///< [d_kv, H_kv·d_h]
  RowMatrix<Weight> w_dq;   ///< [d, d_q]
  RowMatrix<Weight> w_uq;   ///< [d_q, H_q·d_h]
  RowMatrix<Weight> w_qr;   ///< [d, H_q·d_r]
  RowMatrix<Weight> w_kr;   ///< [d, H_kr·d_r]
  RowMatrix<Weight> w_o;    ///< [H_q·d_h, d]
  /// Attention sinks (gpt-oss), one logit per query head [H_q], or empty for none: each joins
  /// its head's softmax denominator on every path (naive and absorbed, SdpaParams::sinks). Few
  /// values, kept in double whatever Weight is.
  std::vector<double> sinks;
};

/// The same weights stored as W: widened exactly, or rounded once to nearest even (converted).
template <class W, class Weight>
MlaWeights<W> converted_weights(const MlaWeights<Weight>& w) {
  return {converted<W>(w.w_dkv), converted<W>(w.w_uk), converted<W>(w.w_uv),
          converted<W>(w.w_dq),  converted<W>(w.w_uq), converted<W>(w.w_qr),
          converted<W>(w.w_kr),  converted<W>(w.w_o),  w.sinks};
}

/// How absorb_mla_weights treats one side of the absorption.
///   kFactored   keep the two factors and apply them in turn at run time (q̃_h = (c_q W_UQ,h)
///               W_UK,gᵀ; out = Concat(o_h W_UV,g) W_O): nothing new is stored;
///   kMultiplied store their product (W_UQ,h W_UK,gᵀ: [d_q, d_kv] per head; W_UV,g W_O,h:
///               [d_kv, d] per head), one product at run time;
///   kAuto       whichever costs fewer multiply-adds per token: query side multiplied iff
///               d_q·d_kv <= d_h·(d_q + d_kv), output side iff d_kv·d <= d_h·(d_kv + d).
/// With the usual d_kv > d_h (APEX-1 Large: d_kv = 512, d_h = 128) both products are larger than
/// their factors, so kAuto keeps them factored; the products pay off when d_kv is small.
enum class MlaFold { kAuto, kFactored, kMultiplied };

/// Parameters of absorb_mla_weights.
struct MlaAbsorbParams {
  MlaFold query = MlaFold::kAuto;   ///< W_UK into the query side
  MlaFold output = MlaFold::kAuto;  ///< W_UV into the output side
};

/// What absorbed MLA decoding needs beyond the layer's own weights: the folded products where
/// absorb_mla_weights chose to multiply (an empty matrix means "factored: use W_UQ and W_UK, or
/// W_UV and W_O, in turn"). Computed once per layer at load time, stored as the layer's Weight.
template <class Weight>
struct MlaAbsorbedWeights {
  MlaConfig config;              ///< the config of the layer they were folded from
  RowMatrix<Weight> w_q_latent;  ///< [d_q, H_q·d_kv], block h = W_UQ,h · W_UK,gᵀ; or empty
  RowMatrix<Weight> w_o_latent;  ///< [H_q·d_kv, d], row block h = W_UV,g · W_O,h; or empty

  /// True when the query side was folded into w_q_latent; false: apply W_UQ, then W_UKᵀ.
  bool query_multiplied() const { return w_q_latent.size() != 0; }
  /// True when the output side was folded into w_o_latent; false: apply W_UV, then W_O.
  bool output_multiplied() const { return w_o_latent.size() != 0; }
};

/// Which MLA decoding path a caller wants (AttentionStack's DecodeOptions).
///   kNaive     decompress K and V of the whole cache, then attend (forward_cached)
///   kAbsorbed  attend to the latent rows directly (forward_absorbed)
///   kAuto      mla_cheaper_path for the chunk length
enum class MlaPath { kAuto, kNaive, kAbsorbed };

/// The cheaper exact path for n new tokens per sequence, counting the attention's multiply-adds
/// per cached token: naive 2·d_kv·H_kv·d_h (decompressing K and V) + n·H_q·(2·d_h + d_r),
/// absorbed n·H_q·(2·d_kv + H_kr·d_r). The cache length cancels, so the answer depends on n
/// alone: absorbed for single tokens and short chunks, naive for prompts (APEX-1 Large with
/// H_kr = 1: absorbed up to n = 10).
inline MlaPath mla_cheaper_path(const MlaConfig& c, Index new_tokens) {
  detail::check_mla_config(c);
  APEX_CHECK(new_tokens >= 1,
             "[mla] new_tokens (" << new_tokens << ") must be >= 1 (tokens per sequence)");
  const double n = static_cast<double>(new_tokens);
  const double h_q = static_cast<double>(c.num_q_heads);
  const double d_kv = static_cast<double>(c.d_kv);
  const double d_h = static_cast<double>(c.head_dim);
  const double d_r = static_cast<double>(c.rope_dim);
  const double naive =
      2.0 * d_kv * static_cast<double>(c.num_kv_heads) * d_h + n * h_q * (2.0 * d_h + d_r);
  const double absorbed = n * h_q * (2.0 * d_kv + static_cast<double>(c.rope_key_heads()) * d_r);
  return absorbed <= naive ? MlaPath::kAbsorbed : MlaPath::kNaive;
}

template <class Scalar, class Weight = Scalar>
class MultiHeadLatentAttention;

/// A multi-head latent attention layer (§9) that owns its eight weight matrices. The attention
/// itself is apex::sdpa on the decompressed heads (d_qk = d_h + d_r, d_v = d_h), grouped when
/// H_kv < H_q, followed by W_O: the same multi_head_attention as every other layer.
///
/// forward() decompresses K and V for the whole block, which is the right computation for a
/// prompt. The latent's benefit is in what a decoder caches (c_kv and K_rope, a LatentCache):
/// forward_cached() decodes against it naively (decompressing the cache at every call) and
/// forward_absorbed() with the folded weights of absorb_mla_weights (decompressing nothing).
/// The layer is immutable after construction; its members are const and may run from several
/// threads at once (on different caches).
///
/// Scalar (float or double) is the type the layer computes in; Weight the type its matrices
/// (and its absorbed weights) are stored in: Scalar, or Eigen::half / Eigen::bfloat16, widened
/// as each product reads them, exactly as for GroupedQueryAttention.
template <class Scalar, class Weight>
class MultiHeadLatentAttention {
 public:
  /// An empty layer: no weights and a zero config, as a moved-from layer is; every use of it
  /// throws std::invalid_argument.
  MultiHeadLatentAttention() = default;
  /// Takes ownership of the weights; throws if the config is invalid (H_kv must divide H_q, d_r
  /// even, H_kr ∈ {1, H_kv}) or any weight does not have its §9.5 shape.
  MultiHeadLatentAttention(const MlaConfig& config, MlaWeights<Weight> weights)
      : config_(config), weights_(std::move(weights)) {
    detail::require_supported_scalar<Scalar>();
    detail::require_weight_type<Scalar, Weight>();
    const std::vector<MlaMatrixShape> table = mla_parameter_table(config);
    const RowMatrix<Weight>* const matrices[] = {&weights_.w_dkv, &weights_.w_uk, &weights_.w_uv,
                                                 &weights_.w_dq,  &weights_.w_uq, &weights_.w_qr,
                                                 &weights_.w_kr,  &weights_.w_o};
    for (std::size_t i = 0; i < table.size(); ++i) {
      const RowMatrix<Weight>& w = *matrices[i];
      APEX_CHECK(w.rows() == table[i].rows && w.cols() == table[i].cols,
                 "[mla] " << table[i].name << " shape [" << w.rows() << ", " << w.cols()
                          << "] must be [" << table[i].rows << ", " << table[i].cols << "]");
    }
    detail::check_head_values(weights_.sinks, config.num_q_heads, "mla", "sinks");
  }

  /// A layer with random weights for examples and tests: every entry of a [rows, cols] weight is
  /// drawn from N(0, 1/rows) (fan-in scaling), in the order of mla_parameter_table, from a
  /// std::mt19937_64 seeded with `seed` (each drawn in double and rounded once to Weight).
  static MultiHeadLatentAttention random(const MlaConfig& config, std::uint64_t seed) {
    const std::vector<MlaMatrixShape> table = mla_parameter_table(config);
    detail::checked_product(mla_parameter_count(config), static_cast<std::int64_t>(sizeof(Weight)),
                            "mla", "weight bytes");
    std::mt19937_64 rng(seed);
    MlaWeights<Weight> w;
    RowMatrix<Weight>* const matrices[] = {&w.w_dkv, &w.w_uk, &w.w_uv, &w.w_dq,
                                           &w.w_uq,  &w.w_qr, &w.w_kr, &w.w_o};
    for (std::size_t i = 0; i < table.size(); ++i) {
      *matrices[i] = detail::random_weight<Weight>(table[i].rows, table[i].cols, rng);
    }
    return MultiHeadLatentAttention(config, std::move(w));
  }

  /// The configuration the layer was built with (checked at construction).
  const MlaConfig& config() const { return config_; }
  /// The eight weight matrices, read-only (shapes as in mla_parameter_table).
  const MlaWeights<Weight>& weights() const { return weights_; }
  /// Number of weights, the §9.5 total (mla_parameter_count).
  std::int64_t parameter_count() const { return mla_parameter_count(config()); }
  /// Bytes of the weights: parameter_count()·sizeof(Weight).
  std::int64_t weight_bytes() const {
    return parameter_count() * static_cast<std::int64_t>(sizeof(Weight));
  }

  /// The same layer with its weights stored as W (Scalar, Eigen::half or Eigen::bfloat16):
  /// widened exactly or rounded once to nearest even. Allocates the new weights; absorbed weights
  /// are folded anew from them (absorb_mla_weights).
  template <class W>
  MultiHeadLatentAttention<Scalar, W> with_weights() const {
    check_constructed();
    return MultiHeadLatentAttention<Scalar, W>(config(), converted_weights<W>(weights_));
  }

  /// Compression, decompression and decoupled RoPE (§9.2, §9.3), everything before attention:
  ///   c_kv = x·W_DKV, K = c_kv·W_UK, V = c_kv·W_UV, c_q = x·W_DQ, Q = c_q·W_UQ,
  ///   Q_rope = RoPE(x·W_QR), K_rope = RoPE(x·W_KR)   (row b*S + s at position offset + s),
  ///   Q_final[:, head h] = [Q_h ‖ Q_rope,h],  K_final[:, head g] = [K_g ‖ K_rope,g]
  /// (K_rope,0 for every g when H_kr = 1). params.rope is required: a table with
  /// head_dim = d_r.
  ///   x: [B*S, d] -> q = Q_final [B*S, H_q·(d_h+d_r)], k = K_final [B*S, H_kv·(d_h+d_r)],
  ///      v = V [B*S, H_kv·d_h], heads side by side.
  /// Allocates the results and the intermediates (c_kv, c_q, Q, K, Q_rope, K_rope).
  template <class Derived>
  ProjectedQkv<Scalar> decompress(const Eigen::MatrixBase<Derived>& x, Index batch,
                                  const AttentionLayerParams<Scalar>& params) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[mla] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    check_input(xr, batch, params);
    return decompress_checked(xr, batch, params);
  }

  /// The layer's forward pass (§9):
  ///   out = Concat_h softmax(Q_final,h K_final,gᵀ / √(d_h + d_r) + mask) V_g · W_O,
  ///   g = h / (H_q / H_kv), with Q_final, K_final, V from decompress().
  /// The softmax scale defaults to 1/√(d_h + d_r) (params.attention.scale overrides it).
  ///   x: [B*S, d], B blocks of S rows; mask: for S queries against S keys; out: [B*S, d].
  /// Every check runs before out is written. out may be x itself. Allocates what decompress
  /// allocates and the [B*S, H_q·d_h] concatenation.
  template <class Derived>
  void forward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
               const AttentionLayerParams<Scalar>& params, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[mla] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    check_input(xr, batch, params);
    detail::attention_layer_forward<Scalar>(
        xr, batch, attention_heads(), mask, attention_params(params),
        [&] { return decompress_checked(xr, batch, params); }, weights_.w_o, out, "mla");
  }

  /// Value-returning forward: a new [B*S, d] matrix.
  template <class Derived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<Derived>& x, Index batch,
                            const AttentionMask<Scalar>& mask,
                            const AttentionLayerParams<Scalar>& params) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward(x, batch, mask, params, out);
    return out;
  }

  /// An empty latent cache for this layer: c_kv and K_rope of `capacity` tokens, stored as
  /// Storage (Scalar, or Eigen::half / Eigen::bfloat16 for half the bytes).
  template <class Storage = Scalar>
  LatentCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    return LatentCache<Scalar, Storage>(
        {batch, config().d_kv, config().rope_key_heads(), config().rope_dim, capacity});
  }

  /// Naive decoding (§9, the oracle of forward_absorbed): the forward pass of a chunk of n new
  /// tokens per sequence at absolute positions [p, p + n), p = params.position_offset. Appends
  /// the chunk's c_kv = x·W_DKV and K_rope = RoPE(x·W_KR) to the cache, decompresses K and V of
  /// every cached token (K = c_kv·W_UK, V = c_kv·W_UV, K_final = [K ‖ K_rope]) and attends:
  ///   out = Concat_h softmax(Q_final,h K_final,gᵀ / √(d_h + d_r) + mask) V_g · W_O
  /// over keys [0, p + n), exactly what forward() computes for these rows of the sequence.
  ///   x: [B*n, d], B = cache.batch(); mask: position rule with offsets unset (a prefix must lie
  ///   inside the first chunk); params: rope required, position_offset = cache.next_position();
  ///   cache: this layer's d_kv, H_kr, d_r, room for n more tokens -> out: [B*n, d].
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// decompressed K and V of the whole cache ([B·(p+n), H_kv·(d_h + d_r)] and [B·(p+n), H_kv·d_h])
  /// besides the chunk's projections: O(cache) work and memory per call, the cost that
  /// forward_absorbed avoids. A 16-bit cache holds c_kv and K_rope rounded once; they are
  /// widened as they are decompressed.
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params,
                      LatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[mla] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    const Index n = check_cached(xr, mask, params, cache, /*absorbed=*/false, out);
    const Index batch = cache.batch();
    const Index h_kv = config().num_kv_heads;
    const Index h_kr = config().rope_key_heads();
    const Index d_h = config().head_dim;
    const Index d_r = config().rope_dim;
    const Index d_qk = config().qk_dim();

    const RowMatrix<Scalar> q = final_queries(xr, batch, params);
    append_latents(xr, batch, params, cache);
    const Index len = cache.size();
    RowMatrix<Scalar> k(batch * len, h_kv * d_qk);
    RowMatrix<Scalar> v(batch * len, h_kv * d_h);
    RowMatrix<Scalar> k_content;
    for (Index b = 0; b < batch; ++b) {
      const auto c_kv = widened<Scalar>(cache.latent().head(b, 0));  // [len, d_kv]
      k_content = detail::matmul<Scalar>(c_kv, weights_.w_uk);
      detail::matmul<Scalar>(c_kv, weights_.w_uv, v.middleRows(b * len, len));
      for (Index g = 0; g < h_kv; ++g) {
        k.block(b * len, g * d_qk, len, d_h) = k_content.middleCols(g * d_h, d_h);
        k.block(b * len, g * d_qk + d_h, len, d_r) =
            cache.rope_keys().head(b, h_kr == 1 ? 0 : g).template cast<Scalar>();
      }
    }
    AttentionMask<Scalar> positions;
    positions.positions = mask;
    positions.positions.query_offset = params.position_offset;
    multi_head_attention(
        HeadsView<const Scalar>::token_major(q.data(), {batch, config().num_q_heads, n, d_qk}),
        HeadsView<const Scalar>::token_major(k.data(), {batch, h_kv, len, d_qk}),
        HeadsView<const Scalar>::token_major(v.data(), {batch, h_kv, len, d_h}), positions,
        attention_params(params), weights_.w_o, out);
  }

  /// Absorbed decoding (§9 with W_UK folded into the query side and W_UV into the output side,
  /// see the top of this header): the same result as forward_cached, without decompressing
  /// anything. For the chunk's rows:
  ///   q̃_h  = Q_h W_UK,gᵀ  (d_kv)           (Q_h = c_q W_UQ,h, or c_q·W_q_latent,h when folded)
  ///   q_h' = [q̃_h ‖ Q_rope,h]  against keys [c_kv ‖ K_rope] (the cache's rows) and values c_kv,
  ///   o_h  = softmax(q_h'·keysᵀ / √(d_h + d_r) + mask) c_kv               (d_kv)
  ///   out  = Concat_h (o_h W_UV,g) · W_O     (or Concat_h o_h · W_o_latent when folded)
  /// One apex::sdpa call: a single key/value head of width d_kv + H_kr·d_r read once for all
  /// H_q query heads. When H_kr = H_kv > 1 the cached row holds every group's K_rope, and query
  /// head h carries its Q_rope in the slot of its group and zeros elsewhere (exact; it costs
  /// (H_kr − 1)·d_r multiply-adds per score and no extra memory). The softmax scale is
  /// params.attention.scale or 1/√(d_h + d_r), as in forward().
  ///   absorbed: absorb_mla_weights(*this) (computed once, at load time)
  ///   other arguments, checks and aliasing as for forward_cached.
  /// Allocates the chunk's projections, its [B*n, H_q·(d_kv + H_kr·d_r)] queries and
  /// [B*n, H_q·d_kv] attention output: O(chunk) memory, nothing proportional to the cache.
  /// A 16-bit cache's rows are read as stored, widened by sdpa.
  template <class Derived, class Storage>
  void forward_absorbed(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                        const AttentionLayerParams<Scalar>& params,
                        const MlaAbsorbedWeights<Weight>& absorbed,
                        LatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const;

  /// Absorbed decoding of many sequences of a paged latent cache in one step: rows [cu[i],
  /// cu[i + 1]) of x are the next tokens of sequence ids[i], at positions cache.length(ids[i]) +
  /// s. As forward_absorbed for each sequence, with the rows of all of them projected together
  /// (each rotated at its own position), each sequence's latent rows appended to its pages and
  /// one sdpa_paged call over every sequence's held rows.
  ///   x: [T, d]; cu_seqlens: N + 1 row offsets; ids: N distinct live sequences; rules: position
  ///   masks with their offsets unset; params: RoPE table (required) covering every new
  ///   position, position_offset 0; absorbed: absorb_mla_weights(*this) -> out: [T, d].
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// projections, the positions, the [T, H_q·(d_kv + H_kr·d_r)] queries and the [T, H_q·d_kv]
  /// attention output.
  template <class Derived, class Storage>
  void forward_paged(const Eigen::MatrixBase<Derived>& x, const std::vector<Index>& cu_seqlens,
                     const std::vector<SequenceId>& ids, const std::vector<PositionMask>& rules,
                     const AttentionLayerParams<Scalar>& params,
                     const MlaAbsorbedWeights<Weight>& absorbed,
                     PagedLatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[mla] x must have the layer's scalar type");
    check_constructed();
    check_absorbed(absorbed);
    const ConstRowRef<Scalar> xr(x.derived());
    APEX_CHECK(params.rope != nullptr,
               "[mla] params.rope (null) must be a RoPE table with head_dim = rope_dim ("
                   << config().rope_dim << "): decoupled RoPE (§9.3) always applies");
    detail::check_rope_head_dim(params.rope, config().rope_dim, "rope_dim d_r", "mla");
    // The rows are many sequences': their positions are checked per sequence below.
    detail::check_layer_input<Scalar>(xr, 1, config().d_model, nullptr, 0, "mla");
    APEX_CHECK(params.position_offset == 0, "[mla] params.position_offset ("
                                                << params.position_offset
                                                << ") must be 0: the paged cache gives positions");
    const Index width = config().d_kv + config().rope_key_heads() * config().rope_dim;
    APEX_CHECK(cache.latent_dim() == config().d_kv && cache.row_dim() == width,
               "[mla] cache latent_dim (" << cache.latent_dim() << ") and row_dim ("
                                          << cache.row_dim() << ") must be the layer's d_kv ("
                                          << config().d_kv << ") and d_kv + H_kr·d_r (" << width
                                          << ")");
    APEX_CHECK(out.rows() == xr.rows() && out.cols() == config().d_model,
               "[mla] out shape [" << out.rows() << ", " << out.cols() << "] must be [T, d] = ["
                                   << xr.rows() << ", " << config().d_model << "]");
    const SdpaParams attention = attention_params(params);
    const Index rows = xr.rows(), h_q = config().num_q_heads, d_kv = config().d_kv;
    detail::check_sdpa(detail::shape_only_view<const Scalar>({1, h_q, rows, width}),
                       detail::shape_only_view<const Scalar>({1, 1, 0, width}),
                       detail::shape_only_view<const Scalar>({1, 1, 0, d_kv}),
                       AttentionMask<Scalar>{}, attention,
                       detail::shape_only_view<Scalar>({1, h_q, rows, d_kv}), {}, "mla");
    const Vector<Index> positions =
        detail::paged_step_positions(rows, cu_seqlens, ids, rules, cache, params.rope, "mla");
    const detail::RowPositions at{0, 1, &positions};
    const RowMatrix<Scalar> q = absorbed_queries(xr, at, params, absorbed);
    const RowMatrix<Scalar> latent = latent_rows(xr, at, params);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index first = cu_seqlens[i];
      cache.append(ids[i], latent.middleRows(first, cu_seqlens[i + 1] - first));
    }
    RowMatrix<Scalar> o_latent(rows, h_q * d_kv);
    sdpa_paged(HeadsView<const Scalar>::token_major(q.data(), {1, h_q, rows, width}), cu_seqlens,
               cache, ids, rules, attention,
               HeadsView<Scalar>::token_major(o_latent.data(), {1, h_q, rows, d_kv}));
    absorbed_output(o_latent, absorbed, out);
  }

  /// Value-returning forward_cached: a new [B*n, d] matrix.
  template <class Derived, class Storage>
  RowMatrix<Scalar> forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                   const AttentionLayerParams<Scalar>& params,
                                   LatentCache<Scalar, Storage>& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_cached(x, mask, params, cache, out);
    return out;
  }

  /// Value-returning forward_absorbed: a new [B*n, d] matrix.
  template <class Derived, class Storage>
  RowMatrix<Scalar> forward_absorbed(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                     const AttentionLayerParams<Scalar>& params,
                                     const MlaAbsorbedWeights<Weight>& absorbed,
                                     LatentCache<Scalar, Storage>& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_absorbed(x, mask, params, absorbed, cache, out);
    return out;
  }

  /// The heads of the layer's attention (H_q, H_kv, d_qk, d_v): queries and keys are
  /// [content ‖ rope], d_h + d_r wide; values d_h wide.
  detail::LayerHeads attention_heads() const {
    return {config().num_q_heads, config().num_kv_heads, config().qk_dim(), config().head_dim};
  }

 private:
  /// Throws for an empty (default-constructed or moved-from) layer.
  void check_constructed() const {
    detail::check_constructed(config().d_model >= 1, "mla", "layer");
  }

  void check_input(const ConstRowRef<Scalar>& x, Index batch,
                   const AttentionLayerParams<Scalar>& params) const {
    check_constructed();
    APEX_CHECK(params.rope != nullptr,
               "[mla] params.rope (null) must be a RoPE table with head_dim = rope_dim ("
                   << config().rope_dim << "): decoupled RoPE (§9.3) always applies");
    detail::check_rope_head_dim(params.rope, config().rope_dim, "rope_dim d_r", "mla");
    detail::check_layer_input(x, batch, config().d_model, params.rope, params.position_offset,
                              "mla");
  }

  /// The checks shared by both cached forms, the cache's room included; returns n, the new
  /// tokens per sequence. The attention is checked at the shapes it will have: queries and keys
  /// d_h + d_r wide with H_kv key heads (naive), or d_kv + H_kr·d_r wide with one key head whose
  /// values are d_kv wide (absorbed).
  template <class Cache>
  Index check_cached(const ConstRowRef<Scalar>& x, const PositionMask& mask,
                     const AttentionLayerParams<Scalar>& params, const Cache& cache, bool absorbed,
                     const RowRef<Scalar>& out) const {
    const Index batch = cache.batch();
    // Positions first: params.position_offset must be the cache's next position, which also keeps
    // the layer's own position arithmetic below far from overflow.
    detail::check_cached_rule(mask, params.position_offset, cache.next_position(), x.rows() / batch,
                              "mla");
    check_input(x, batch, params);
    APEX_CHECK(cache.latent_dim() == config().d_kv &&
                   cache.rope_heads() == config().rope_key_heads() &&
                   cache.rope_dim() == config().rope_dim,
               "[mla] cache latent_dim, rope_heads, rope_dim ("
                   << cache.latent_dim() << ", " << cache.rope_heads() << ", " << cache.rope_dim()
                   << ") must equal the layer's d_kv, H_kr, d_r (" << config().d_kv << ", "
                   << config().rope_key_heads() << ", " << config().rope_dim << ")");
    const Index n = x.rows() / batch;
    cache.check_room(n);
    const Index keys = cache.size() + n;
    const Index qk_dim = absorbed ? cache.row_width() : config().qk_dim();
    const Index kv_heads = absorbed ? 1 : config().num_kv_heads;
    const Index v_dim = absorbed ? config().d_kv : config().head_dim;
    AttentionMask<Scalar> positions;
    positions.positions = mask;
    positions.positions.query_offset = params.position_offset;
    const SdpaParams attention = attention_params(params);
    detail::check_sdpa(
        detail::shape_only_view<const Scalar>({batch, config().num_q_heads, n, qk_dim}),
        detail::shape_only_view<const Scalar>({batch, kv_heads, keys, qk_dim}),
        detail::shape_only_view<const Scalar>({batch, kv_heads, keys, v_dim}), positions, attention,
        detail::shape_only_view<Scalar>({batch, config().num_q_heads, n, v_dim}), {}, "mla");
    APEX_CHECK(out.rows() == x.rows() && out.cols() == config().d_model,
               "[mla] out shape [" << out.rows() << ", " << out.cols() << "] must be [B*n, d] = ["
                                   << x.rows() << ", " << config().d_model << "]");
    return n;
  }

  /// Throws unless `absorbed` was folded from a layer of this shape (absorb_mla_weights).
  void check_absorbed(const MlaAbsorbedWeights<Weight>& absorbed) const {
    const MlaConfig& c = config();
    const MlaConfig& a = absorbed.config;
    APEX_CHECK(a.d_model == c.d_model && a.d_q == c.d_q && a.d_kv == c.d_kv &&
                   a.num_q_heads == c.num_q_heads && a.num_kv_heads == c.num_kv_heads &&
                   a.head_dim == c.head_dim && a.rope_dim == c.rope_dim &&
                   a.rope_key_heads() == c.rope_key_heads(),
               "[mla] absorbed weights were folded from a layer of another shape: use "
               "absorb_mla_weights(this layer)");
    // H_q·d_kv is not among the sizes the config check bounds (it bounds H_q·d_h).
    const Index latent = detail::checked_product(c.num_q_heads, c.d_kv, "mla", "H_q*d_kv");
    APEX_CHECK(!absorbed.query_multiplied() ||
                   (absorbed.w_q_latent.rows() == c.d_q && absorbed.w_q_latent.cols() == latent),
               "[mla] absorbed w_q_latent shape ["
                   << absorbed.w_q_latent.rows() << ", " << absorbed.w_q_latent.cols()
                   << "] must be [d_q, H_q*d_kv] = [" << c.d_q << ", " << latent << "] (or empty)");
    APEX_CHECK(
        !absorbed.output_multiplied() ||
            (absorbed.w_o_latent.rows() == latent && absorbed.w_o_latent.cols() == c.d_model),
        "[mla] absorbed w_o_latent shape ["
            << absorbed.w_o_latent.rows() << ", " << absorbed.w_o_latent.cols()
            << "] must be [H_q*d_kv, d] = [" << latent << ", " << c.d_model << "] (or empty)");
  }

  /// The absorbed queries of forward_absorbed, [B*n, H_q·(d_kv + H_kr·d_r)]: per head
  /// [q̃_h ‖ 0 … Q_rope,h … 0], q̃_h = Q_h W_UK,gᵀ, the rope part in the slot of head h's K_rope.
  /// Throws (before allocating) when their size does not fit in 64 bits.
  RowMatrix<Scalar> absorbed_queries(const ConstRowRef<Scalar>& x, const detail::RowPositions& at,
                                     const AttentionLayerParams<Scalar>& params,
                                     const MlaAbsorbedWeights<Weight>& absorbed) const {
    const MlaConfig& c = config();
    const Index h_q = c.num_q_heads;
    const Index group = h_q / c.num_kv_heads;
    const Index d_h = c.head_dim;
    const Index d_r = c.rope_dim;
    const Index d_kv = c.d_kv;
    const Index width = d_kv + c.rope_key_heads() * d_r;  // of a cached row and a query head
    const Index q_width =
        detail::checked_product(h_q, width, "mla", "absorbed query width H_q*(d_kv + H_kr*d_r)");
    detail::checked_product({x.rows(), q_width, static_cast<Index>(sizeof(Scalar))}, "mla",
                            "absorbed query bytes B*n*H_q*(d_kv + H_kr*d_r)");
    RowMatrix<Scalar> q = RowMatrix<Scalar>::Zero(x.rows(), q_width);
    const RowMatrix<Scalar> c_q = detail::matmul<Scalar>(x, weights_.w_dq);
    if (absorbed.query_multiplied()) {
      const RowMatrix<Scalar> q_latent = detail::matmul<Scalar>(c_q, absorbed.w_q_latent);
      for (Index h = 0; h < h_q; ++h) {
        q.middleCols(h * width, d_kv) = q_latent.middleCols(h * d_kv, d_kv);
      }
    } else {
      // q̃ for the G heads of group g of token t: [G, d_h] (contiguous in Q's row) · W_UK,gᵀ.
      const RowMatrix<Scalar> q_content = detail::matmul<Scalar>(c_q, weights_.w_uq);
      for (Index t = 0; t < x.rows(); ++t) {
        for (Index g = 0; g < c.num_kv_heads; ++g) {
          const Eigen::Map<const RowMatrix<Scalar>> q_group(
              q_content.row(t).data() + g * group * d_h, group, d_h);
          detail::RowMap<Scalar> target(q.row(t).data() + g * group * width, group, d_kv,
                                        Eigen::OuterStride<>(width));
          detail::matmul_transposed<Scalar>(q_group, weights_.w_uk.middleCols(g * d_h, d_h),
                                            target);
        }
      }
    }
    RowMatrix<Scalar> q_rope = detail::matmul<Scalar>(x, weights_.w_qr);
    detail::apply_rope_at(*params.rope, at, q_rope);
    for (Index h = 0; h < h_q; ++h) {
      const Index slot = c.rope_key_heads() == 1 ? 0 : h / group;
      q.middleCols(h * width + d_kv + slot * d_r, d_r) = q_rope.middleCols(h * d_r, d_r);
    }
    return q;
  }

  /// out = Concat_h (o_h W_UV,g) · W_O, or Concat_h o_h · W_o_latent when folded, from the
  /// latent attention outputs o_latent [B*n, H_q·d_kv].
  void absorbed_output(const RowMatrix<Scalar>& o_latent,
                       const MlaAbsorbedWeights<Weight>& absorbed, RowRef<Scalar> out) const {
    if (absorbed.output_multiplied()) {
      detail::matmul<Scalar>(o_latent, absorbed.w_o_latent, out);
      return;
    }
    const MlaConfig& c = config();
    const Index group = c.num_q_heads / c.num_kv_heads;
    const Index d_h = c.head_dim;
    const Index d_kv = c.d_kv;
    // o_h W_UV,g for the G heads of group g of token t: [G, d_kv] · W_UV,g -> [G, d_h].
    RowMatrix<Scalar> concat(o_latent.rows(), c.num_q_heads * d_h);
    for (Index t = 0; t < o_latent.rows(); ++t) {
      for (Index g = 0; g < c.num_kv_heads; ++g) {
        const Eigen::Map<const RowMatrix<Scalar>> o_group(o_latent.row(t).data() + g * group * d_kv,
                                                          group, d_kv);
        Eigen::Map<RowMatrix<Scalar>> target(concat.row(t).data() + g * group * d_h, group, d_h);
        detail::matmul<Scalar>(o_group, weights_.w_uv.middleCols(g * d_h, d_h), target);
      }
    }
    detail::matmul<Scalar>(concat, weights_.w_o, out);
  }

  /// 1/√(d_h + d_r): the default softmax scale of the layer, whatever width its keys are read at.
  double mla_softmax_scale() const {
    return 1.0 / std::sqrt(static_cast<double>(config().qk_dim()));
  }

  /// The attention parameters of a call: the layer's sinks, and the scale 1/√(d_h + d_r) unless
  /// params.attention sets one (the absorbed path reads keys of another width).
  SdpaParams attention_params(const AttentionLayerParams<Scalar>& params) const {
    SdpaParams attention = detail::with_layer_sinks(params.attention, weights_.sinks, "mla");
    if (!attention.scale) attention.scale = mla_softmax_scale();
    return attention;
  }

  /// Q_final = [c_q·W_UQ ‖ RoPE(x·W_QR)] per head: [B*n, H_q·(d_h + d_r)].
  RowMatrix<Scalar> final_queries(const ConstRowRef<Scalar>& x, Index batch,
                                  const AttentionLayerParams<Scalar>& params) const {
    const Index h_q = config().num_q_heads;
    const Index d_h = config().head_dim;
    const Index d_r = config().rope_dim;
    const Index d_qk = config().qk_dim();
    const RowMatrix<Scalar> c_q = detail::matmul<Scalar>(x, weights_.w_dq);
    const RowMatrix<Scalar> q_content = detail::matmul<Scalar>(c_q, weights_.w_uq);
    RowMatrix<Scalar> q_rope = detail::matmul<Scalar>(x, weights_.w_qr);
    detail::apply_rope_per_batch(*params.rope, params.position_offset, batch, q_rope);
    RowMatrix<Scalar> q(x.rows(), h_q * d_qk);
    for (Index h = 0; h < h_q; ++h) {
      q.middleCols(h * d_qk, d_h) = q_content.middleCols(h * d_h, d_h);
      q.middleCols(h * d_qk + d_h, d_r) = q_rope.middleCols(h * d_r, d_r);
    }
    return q;
  }

  /// The cached rows of the chunk, [rows, d_kv + H_kr·d_r] = [c_kv ‖ K_rope] with c_kv = x·W_DKV
  /// and K_rope = RoPE(x·W_KR), every row rotated at its position `at`.
  RowMatrix<Scalar> latent_rows(const ConstRowRef<Scalar>& x, const detail::RowPositions& at,
                                const AttentionLayerParams<Scalar>& params) const {
    const Index d_kv = config().d_kv;
    RowMatrix<Scalar> k_rope = detail::matmul<Scalar>(x, weights_.w_kr);
    detail::apply_rope_at(*params.rope, at, k_rope);
    RowMatrix<Scalar> rows(x.rows(), d_kv + k_rope.cols());
    detail::matmul<Scalar>(x, weights_.w_dkv, rows.leftCols(d_kv));
    rows.rightCols(k_rope.cols()) = k_rope;
    return rows;
  }

  /// Appends the chunk's latent_rows to the cache (checked).
  template <class Storage>
  void append_latents(const ConstRowRef<Scalar>& x, Index batch,
                      const AttentionLayerParams<Scalar>& params,
                      LatentCache<Scalar, Storage>& cache) const {
    cache.append(latent_rows(x, {params.position_offset, batch, nullptr}, params),
                 params.position_offset);
  }

  ProjectedQkv<Scalar> decompress_checked(const ConstRowRef<Scalar>& x, Index batch,
                                          const AttentionLayerParams<Scalar>& params) const {
    const Index rows = x.rows();
    const Index h_q = config().num_q_heads;
    const Index h_kv = config().num_kv_heads;
    const Index h_kr = config().rope_key_heads();
    const Index d_h = config().head_dim;
    const Index d_r = config().rope_dim;
    const Index d_qk = config().qk_dim();

    ProjectedQkv<Scalar> p = detail::empty_projection<Scalar>(batch, attention_heads());
    if (rows == 0) {
      // No tokens: the projections are empty, with null data that must not be cut into blocks.
      p.q.resize(0, h_q * d_qk);
      p.k.resize(0, h_kv * d_qk);
      p.v.resize(0, h_kv * d_h);
      return p;
    }

    // Keys and values from the latent (§9.2).
    const RowMatrix<Scalar> c_kv = detail::matmul<Scalar>(x, weights_.w_dkv);
    const RowMatrix<Scalar> k_content = detail::matmul<Scalar>(c_kv, weights_.w_uk);
    p.v = detail::matmul<Scalar>(c_kv, weights_.w_uv);
    // Queries from their own latent (§9.2).
    const RowMatrix<Scalar> c_q = detail::matmul<Scalar>(x, weights_.w_dq);
    const RowMatrix<Scalar> q_content = detail::matmul<Scalar>(c_q, weights_.w_uq);
    // Decoupled RoPE features straight from x (§9.3).
    RowMatrix<Scalar> q_rope = detail::matmul<Scalar>(x, weights_.w_qr);
    RowMatrix<Scalar> k_rope = detail::matmul<Scalar>(x, weights_.w_kr);
    detail::apply_rope_per_batch(*params.rope, params.position_offset, batch, q_rope);
    detail::apply_rope_per_batch(*params.rope, params.position_offset, batch, k_rope);

    // [content ‖ rope] per head. The copies are O(rows · width), small next to the products.
    p.q.resize(rows, h_q * d_qk);
    for (Index h = 0; h < h_q; ++h) {
      p.q.middleCols(h * d_qk, d_h) = q_content.middleCols(h * d_h, d_h);
      p.q.middleCols(h * d_qk + d_h, d_r) = q_rope.middleCols(h * d_r, d_r);
    }
    p.k.resize(rows, h_kv * d_qk);
    for (Index g = 0; g < h_kv; ++g) {
      const Index rope_head = h_kr == 1 ? 0 : g;
      p.k.middleCols(g * d_qk, d_h) = k_content.middleCols(g * d_h, d_h);
      p.k.middleCols(g * d_qk + d_h, d_r) = k_rope.middleCols(rope_head * d_r, d_r);
    }
    return p;
  }

  detail::ResetOnMove<MlaConfig> config_;  // a moved-from layer is an empty one
  MlaWeights<Weight> weights_;
};

/// Folds MLA's decompression matrices into the query and output sides for absorbed decoding
/// (§9; see the top of this header and MultiHeadLatentAttention::forward_absorbed). With
/// G = H_q / H_kv and g = h / G the key head of query head h:
///   query side  (W_UK into the query):   W_q_latent,h = W_UQ,h · W_UK,gᵀ      [d_q, d_kv]
///   output side (W_UV into the output):  W_o_latent,h = W_UV,g · W_O,h        [d_kv, d]
/// where W_UQ,h, W_UK,g, W_UV,g are the d_h columns of head h (g) and W_O,h the d_h rows of head
/// h. Each side is multiplied or kept factored as params says (MlaFold). Products are formed in
/// double from the stored weights and rounded once to the layer's Weight. Apply once per layer
/// at load time; the result stays valid as long as the layer's weights (it does not refer to the
/// layer). Allocates the products: H_q·d_q·d_kv and H_q·d_kv·d weights when multiplied, nothing
/// when factored.
template <class Scalar, class Weight>
MlaAbsorbedWeights<Weight> absorb_mla_weights(const MultiHeadLatentAttention<Scalar, Weight>& layer,
                                              const MlaAbsorbParams& params = {}) {
  detail::require_supported_scalar<Scalar>();
  const MlaConfig& c = layer.config();
  const MlaWeights<Weight>& w = layer.weights();
  const Index h_q = c.num_q_heads;
  const Index group = h_q / c.num_kv_heads;
  const Index d_h = c.head_dim;
  const Index d_kv = c.d_kv;
  const Index d = c.d_model;
  // Costs in double: d_q·d_kv is not among the sizes the config check bounds.
  const auto choose = [](MlaFold fold, double multiplied_cost, double factored_cost) {
    return fold == MlaFold::kMultiplied ||
           (fold == MlaFold::kAuto && multiplied_cost <= factored_cost);
  };
  const auto real = [](Index n) { return static_cast<double>(n); };
  MlaAbsorbedWeights<Weight> result;
  result.config = c;
  const bool multiply_query =
      choose(params.query, real(c.d_q) * real(d_kv), real(d_h) * (real(c.d_q) + real(d_kv)));
  const bool multiply_output =
      choose(params.output, real(d_kv) * real(d), real(d_h) * (real(d_kv) + real(d)));
  // The products are new matrices: check their sizes before allocating either.
  const auto bytes = static_cast<Index>(sizeof(Weight));
  if (multiply_query) {
    detail::checked_product({c.d_q, h_q, d_kv, bytes}, "mla", "w_q_latent bytes d_q*H_q*d_kv");
  }
  if (multiply_output) {
    detail::checked_product({h_q, d_kv, d, bytes}, "mla", "w_o_latent bytes H_q*d_kv*d");
  }
  if (multiply_query) {
    const RowMatrix<double> w_uq = converted<double>(w.w_uq);
    const RowMatrix<double> w_uk = converted<double>(w.w_uk);
    result.w_q_latent.resize(c.d_q, h_q * d_kv);
    for (Index h = 0; h < h_q; ++h) {
      const Index g = h / group;
      result.w_q_latent.middleCols(h * d_kv, d_kv) =
          converted<Weight>(detail::matmul_transposed<double>(w_uq.middleCols(h * d_h, d_h),
                                                              w_uk.middleCols(g * d_h, d_h)));
    }
  }
  if (multiply_output) {
    const RowMatrix<double> w_uv = converted<double>(w.w_uv);
    const RowMatrix<double> w_o = converted<double>(w.w_o);
    result.w_o_latent.resize(h_q * d_kv, d);
    for (Index h = 0; h < h_q; ++h) {
      const Index g = h / group;
      result.w_o_latent.middleRows(h * d_kv, d_kv) = converted<Weight>(
          detail::matmul<double>(w_uv.middleCols(g * d_h, d_h), w_o.middleRows(h * d_h, d_h)));
    }
  }
  return result;
}

template <class Scalar, class Weight>
template <class Derived, class Storage>
void MultiHeadLatentAttention<Scalar, Weight>::forward_absorbed(
    const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
    const AttentionLayerParams<Scalar>& params, const MlaAbsorbedWeights<Weight>& absorbed,
    LatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
  static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                "[mla] x must have the layer's scalar type");
  check_constructed();
  check_absorbed(absorbed);
  const ConstRowRef<Scalar> xr(x.derived());
  const Index n = check_cached(xr, mask, params, cache, /*absorbed=*/true, out);
  const Index batch = cache.batch();
  const Index h_q = config().num_q_heads;
  const Index d_kv = config().d_kv;
  const RowMatrix<Scalar> q =
      absorbed_queries(xr, {params.position_offset, batch, nullptr}, params, absorbed);
  append_latents(xr, batch, params, cache);

  // One key/value head shared by all H_q query heads: keys [c_kv ‖ K_rope], values c_kv.
  RowMatrix<Scalar> o_latent(xr.rows(), h_q * d_kv);
  AttentionMask<Scalar> positions;
  positions.positions = mask;
  positions.positions.query_offset = params.position_offset;
  const SdpaParams attention = attention_params(params);
  sdpa(HeadsView<const Scalar>::token_major(q.data(), {batch, h_q, n, cache.row_width()}),
       cache.rows(), cache.latent(), positions, attention,
       HeadsView<Scalar>::token_major(o_latent.data(), {batch, h_q, n, d_kv}));
  absorbed_output(o_latent, absorbed, out);
}

}  // namespace apex
