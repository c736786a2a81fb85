// SPDX-License-Identifier: MIT
// Grouped-query attention (§8) and the attention layer that owns its projections.
//
// One code path serves three variants: with G = H_q / H_kv query heads per key/value head,
//   H_kv = H_q       multi-head attention (§7, G = 1)
//   1 < H_kv < H_q   grouped-query attention (§8)
//   H_kv = 1         multi-query attention (G = H_q)
// are the same GroupedQueryAttention with a different config. Query head i reads key/value head
// ⌊i / G⌋ through apex::sdpa's views; K and V are never repeated or copied per group.
//
//   x [B*S, d] ─┬─ x·W_Q ─▶ Q [B*S, H_q·d_h]  ─(RoPE)─┐
//               ├─ x·W_K ─▶ K [B*S, H_kv·d_h] ─(RoPE)─┼─▶ multi_head_attention ─▶ out [B*S, d]
//               └─ x·W_V ─▶ V [B*S, H_kv·d_h] ────────┘    (sdpa per head, concat, ·W_O)
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cached_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/paged_cache.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// The head counts of grouped-query attention: H_q query heads sharing H_kv key/value heads.
struct HeadCounts {
  Index num_q_heads = 0;   ///< H_q
  Index num_kv_heads = 0;  ///< H_kv, a divisor of H_q
};

/// The key/value head that query head i uses (§8.2): ⌊i / G⌋ with G = H_q / H_kv, so each group
/// of G consecutive query heads shares one key/value head. §8.4: H_q = 4, H_kv = 2 gives
/// 0, 0, 1, 1. Throws unless 1 ≤ H_kv, H_kv divides H_q and 0 ≤ i < H_q.
inline Index kv_head_for(const HeadCounts& heads, Index query_head) {
  detail::check_head_counts(heads.num_q_heads, heads.num_kv_heads, "gqa");
  APEX_CHECK(query_head >= 0 && query_head < heads.num_q_heads,
             "[gqa] query_head (" << query_head << ") must be in [0, num_q_heads) = [0, "
                                  << heads.num_q_heads << ")");
  return query_head / (heads.num_q_heads / heads.num_kv_heads);
}

/// KV-cache size relative to multi-head attention with H_q heads (§8.3): H_kv / H_q.
/// H_q = 128: GQA with 8 KV heads gives 0.0625 (16× smaller), MQA 1/128 = 0.0078125.
inline double kv_cache_ratio(const HeadCounts& heads) {
  detail::check_head_counts(heads.num_q_heads, heads.num_kv_heads, "gqa");
  return static_cast<double>(heads.num_kv_heads) / static_cast<double>(heads.num_q_heads);
}

/// Parameters of a grouped-query attention layer: W_Q [d, H_q·d_h], W_K and W_V
/// [d, H_kv·d_h], W_O [H_q·d_h, d]; d·d_h·(2·H_q + 2·H_kv) in all. With H_kv = H_q this is
/// mha_parameter_count (§7.3). No biases. Throws std::invalid_argument on a negative argument
/// or a count beyond 64 bits.
// The arguments follow the formula's order; gqa_parameter_count(GqaConfig) is the swap-proof form.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
inline std::int64_t gqa_parameter_count(std::int64_t d_model, std::int64_t num_q_heads,
                                        std::int64_t num_kv_heads, std::int64_t head_dim) {
  const char* op = "gqa_parameter_count";
  // One statement each, so that the first failing product is the one reported.
  const std::int64_t q_and_o =
      detail::checked_product({2, d_model, num_q_heads, head_dim}, op, "2*d*H_q*d_h");
  const std::int64_t k_and_v =
      detail::checked_product({2, d_model, num_kv_heads, head_dim}, op, "2*d*H_kv*d_h");
  return detail::checked_sum(q_and_o, k_and_v, op, "2*d*H_q*d_h + 2*d*H_kv*d_h");
}

/// Shape of a GroupedQueryAttention layer.
struct GqaConfig {
  Index d_model = 0;       ///< d, the width of x and of the output
  Index num_q_heads = 0;   ///< H_q
  Index num_kv_heads = 0;  ///< H_kv, a divisor of H_q (H_q: MHA, 1: MQA)
  Index head_dim = 0;      ///< d_h

  /// G = H_q / H_kv, query heads per key/value head. Throws unless the head counts are valid
  /// (so that a default config never divides by zero).
  Index group_size() const {
    detail::check_head_counts(num_q_heads, num_kv_heads, "gqa");
    return num_q_heads / num_kv_heads;
  }
  /// H_q and H_kv.
  HeadCounts heads() const { return {num_q_heads, num_kv_heads}; }
  /// Multi-head attention (§7): H_kv = H_q.
  static GqaConfig multi_head(Index d_model, Index num_heads, Index head_dim) {
    return {d_model, num_heads, num_heads, head_dim};
  }
  /// Multi-query attention: one key/value head shared by every query head.
  static GqaConfig multi_query(Index d_model, Index num_q_heads, Index head_dim) {
    return {d_model, num_q_heads, 1, head_dim};
  }
};

/// Parameter count of a layer with this config (see the overload above).
inline std::int64_t gqa_parameter_count(const GqaConfig& config) {
  return gqa_parameter_count(config.d_model, config.num_q_heads, config.num_kv_heads,
                             config.head_dim);
}

/// QK-norm (as Qwen 3, OLMo 2 and Gemma 3 use it): an RMSNorm (§3.2) of every query head and
/// every key head over its d_h features, after the projection and before RoPE, with one γ for
/// all query heads and one for all key heads.
template <class Weight>
struct QkNorm {
  Vector<Weight> q_gamma;  ///< [d_h]
  Vector<Weight> k_gamma;  ///< [d_h]
  double eps = 1e-6;       ///< ε of both norms
};

/// The projection matrices of a GroupedQueryAttention layer, applied as x·W (x on the left),
/// stored as Weight (the layer's scalar type, Eigen::half or Eigen::bfloat16), with the layer's
/// optional sinks and QK-norm.
template <class Weight>
struct GqaWeights {
  RowMatrix<Weight> w_q;  ///< [d, H_q·d_h]
  RowMatrix<Weight> w_k;  ///< [d, H_kv·d_h]
  RowMatrix<Weight> w_v;  ///< [d, H_kv·d_h]
  RowMatrix<Weight> w_o;  ///< [H_q·d_h, d]
  /// Attention sinks (gpt-oss), one logit per query head [H_q], or empty for none: each joins
  /// its head's softmax denominator in every attention of the layer (SdpaParams::sinks). Few
  /// values, kept in double whatever Weight is.
  std::vector<double> sinks;
  /// QK-norm of the queries and keys, or unset for none.
  std::optional<QkNorm<Weight>> qk_norm;
};

/// The same weights stored as W: widened exactly, or rounded once to nearest even (converted).
/// The sinks are copied as they are; the QK-norm's γ are converted like the matrices.
template <class W, class Weight>
GqaWeights<W> converted_weights(const GqaWeights<Weight>& w) {
  std::optional<QkNorm<W>> qk_norm;
  if (w.qk_norm) {
    qk_norm = QkNorm<W>{converted<W>(w.qk_norm->q_gamma), converted<W>(w.qk_norm->k_gamma),
                        w.qk_norm->eps};
  }
  return {
      converted<W>(w.w_q), converted<W>(w.w_k), converted<W>(w.w_v), converted<W>(w.w_o), w.sinks,
      std::move(qk_norm)};
}

namespace detail {

/// The config's own preconditions, and that every size the layer forms from it fits in 64 bits:
/// the widths H_q·d_h and H_kv·d_h and the weight count d·d_h·(2·H_q + 2·H_kv), which bounds
/// every weight's element count. (Whether that many weights fit in memory is the allocator's
/// business; a wrapped width would instead build a layer of the wrong shape.)
inline void check_gqa_config(const GqaConfig& c) {
  APEX_CHECK(c.d_model >= 1, "[gqa] d_model (" << c.d_model << ") must be >= 1");
  APEX_CHECK(c.head_dim >= 1, "[gqa] head_dim (" << c.head_dim << ") must be >= 1");
  check_head_counts(c.num_q_heads, c.num_kv_heads, "gqa");
  checked_product(c.num_q_heads, c.head_dim, "gqa", "num_q_heads*head_dim");
  const std::int64_t q_and_o = checked_product({2, c.d_model, c.num_q_heads, c.head_dim}, "gqa",
                                               "weight count 2*d_model*num_q_heads*head_dim");
  const std::int64_t k_and_v = checked_product({2, c.d_model, c.num_kv_heads, c.head_dim}, "gqa",
                                               "weight count 2*d_model*num_kv_heads*head_dim");
  checked_sum(q_and_o, k_and_v, "gqa",
              "weight count d_model*head_dim*(2*num_q_heads + 2*num_kv_heads)");
}

}  // namespace detail

/// An attention layer with H_q query heads and H_kv key/value heads (§7, §8) that owns its
/// projections W_Q, W_K, W_V, W_O. Multi-head attention is the config H_kv = H_q
/// (GqaConfig::multi_head) and multi-query attention H_kv = 1: there is one implementation.
///
/// forward() attends within the block it is given (a prompt). forward_cached() is the decoding
/// form: it attends a chunk of new tokens against a cache the caller owns (a KvCache for full
/// attention, a SlidingWindowCache for a windowed layer) and appends the chunk to it.
/// The layer is immutable after construction; forward and forward_cached are const, and may run
/// from several threads at once on different caches.
///
/// Scalar (float or double) is the type the layer computes in and takes and returns x in; Weight
/// is the type its four matrices are stored in: Scalar, or Eigen::half / Eigen::bfloat16 for half
/// the bytes, widened as each product reads them (detail/matmul.hpp), so that a decoding step,
/// which reads every weight once per token, moves half as much. The layer then computes exactly
/// what a Scalar layer holding the rounded weights computes (with_weights converts).
template <class Scalar, class Weight = Scalar>
class GroupedQueryAttention {
 public:
  /// An empty layer: no weights and a zero config, as a moved-from layer is; every use of it
  /// throws std::invalid_argument.
  GroupedQueryAttention() = default;
  /// Takes ownership of the weights; throws if the config is invalid (H_kv must divide H_q) or
  /// any weight does not have the shape documented in GqaWeights.
  GroupedQueryAttention(const GqaConfig& config, GqaWeights<Weight> weights)
      : config_(config), weights_(std::move(weights)) {
    detail::require_supported_scalar<Scalar>();
    detail::require_weight_type<Scalar, Weight>();
    detail::check_gqa_config(config);
    const Index d = config.d_model;
    const Index q_width = config.num_q_heads * config.head_dim;
    const Index kv_width = config.num_kv_heads * config.head_dim;
    detail::check_weight_shape(weights_.w_q, d, q_width, "gqa", "w_q",
                               "[d_model, num_q_heads*head_dim]");
    detail::check_weight_shape(weights_.w_k, d, kv_width, "gqa", "w_k",
                               "[d_model, num_kv_heads*head_dim]");
    detail::check_weight_shape(weights_.w_v, d, kv_width, "gqa", "w_v",
                               "[d_model, num_kv_heads*head_dim]");
    detail::check_weight_shape(weights_.w_o, q_width, d, "gqa", "w_o",
                               "[num_q_heads*head_dim, d_model]");
    detail::check_head_values(weights_.sinks, config.num_q_heads, "gqa", "sinks");
    if (const auto& norm = weights_.qk_norm) {
      APEX_CHECK(norm->q_gamma.size() == config.head_dim && norm->k_gamma.size() == config.head_dim,
                 "[gqa] qk_norm gamma lengths (" << norm->q_gamma.size() << ", "
                                                 << norm->k_gamma.size() << ") must be head_dim "
                                                 << config.head_dim);
      APEX_CHECK(std::isfinite(norm->eps) && norm->eps > 0.0,
                 "[gqa] qk_norm eps (" << norm->eps << ") must be positive and finite");
    }
  }

  /// A layer with random weights for examples and tests: every entry of a [rows, cols] weight is
  /// drawn from N(0, 1/rows) (fan-in scaling, so activations keep their scale), in the order
  /// W_Q, W_K, W_V, W_O, from a std::mt19937_64 seeded with `seed` (each drawn in double and
  /// rounded once to Weight).
  static GroupedQueryAttention random(const GqaConfig& config, std::uint64_t seed) {
    detail::check_gqa_config(config);
    detail::checked_product(gqa_parameter_count(config), static_cast<std::int64_t>(sizeof(Weight)),
                            "gqa", "weight bytes");
    std::mt19937_64 rng(seed);
    const Index d = config.d_model;
    const Index q_width = config.num_q_heads * config.head_dim;
    const Index kv_width = config.num_kv_heads * config.head_dim;
    GqaWeights<Weight> w;
    w.w_q = detail::random_weight<Weight>(d, q_width, rng);
    w.w_k = detail::random_weight<Weight>(d, kv_width, rng);
    w.w_v = detail::random_weight<Weight>(d, kv_width, rng);
    w.w_o = detail::random_weight<Weight>(q_width, d, rng);
    return GroupedQueryAttention(config, std::move(w));
  }

  /// The configuration the layer was built with (checked at construction).
  const GqaConfig& config() const { return config_; }
  /// The projections W_Q, W_K, W_V, W_O, read-only (shapes as in GqaWeights).
  const GqaWeights<Weight>& weights() const { return weights_; }
  /// Number of weights, d·d_h·(2·H_q + 2·H_kv) (gqa_parameter_count).
  std::int64_t parameter_count() const { return gqa_parameter_count(config()); }
  /// Bytes of the weights: parameter_count()·sizeof(Weight).
  std::int64_t weight_bytes() const {
    return parameter_count() * static_cast<std::int64_t>(sizeof(Weight));
  }

  /// The same layer with its weights stored as W (Scalar, Eigen::half or Eigen::bfloat16):
  /// widened exactly or rounded once to nearest even. Allocates the new weights.
  template <class W>
  GroupedQueryAttention<Scalar, W> with_weights() const {
    check_constructed();
    return GroupedQueryAttention<Scalar, W>(config(), converted_weights<W>(weights_));
  }

  /// The projections of §8.2 with RoPE (§4) on Q and K when params.rope is set:
  ///   Q = RoPE(x·W_Q), K = RoPE(x·W_K), V = x·W_V, row b*S + s at position offset + s,
  /// and, with a QK-norm, every head of Q and K RMS-normalised before RoPE.
  /// x: [B*S, d] (B blocks of S rows) -> q [B*S, H_q·d_h], k and v [B*S, H_kv·d_h], heads side
  /// by side. Allocates the three results.
  template <class Derived>
  ProjectedQkv<Scalar> project(const Eigen::MatrixBase<Derived>& x, Index batch,
                               const AttentionLayerParams<Scalar>& params = {}) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[gqa] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    check_input(xr, batch, params);
    return project_checked(xr, batch, params);
  }

  /// The layer's forward pass (§7.2, §8.2):
  ///   head_i = softmax(scale · Q_i K_gᵀ + mask) V_g,  g = ⌊i / G⌋,
  ///   out = Concat(head_0, …, head_{H_q−1}) · W_O,
  /// with Q, K, V from project() (RoPE on Q and K if params.rope is set) and attention by
  /// apex::sdpa on token-major views of the projections (no copy, no repeated K/V).
  ///   x: [B*S, d], B blocks of S rows; mask: for S queries against S keys (positions relative to
  ///   each block unless mask.positions sets offsets); out: [B*S, d].
  /// Every check runs before out is written. out may be x itself (x is fully consumed by the
  /// projections first). Allocates Q, K, V and the [B*S, H_q·d_h] concatenation.
  template <class Derived>
  void forward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
               const AttentionLayerParams<Scalar>& params, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[gqa] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    check_input(xr, batch, params);
    detail::attention_layer_forward<Scalar>(
        xr, batch, attention_heads(), mask, attention_params(params),
        [&] { return project_checked(xr, batch, params); }, weights_.w_o, out, "gqa");
  }

  /// Value-returning forward: a new [B*S, d] matrix.
  template <class Derived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<Derived>& x, Index batch,
                            const AttentionMask<Scalar>& mask = {},
                            const AttentionLayerParams<Scalar>& params = {}) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward(x, batch, mask, params, out);
    return out;
  }

  /// An empty full cache for this layer: K and V of H_kv heads of d_h, `capacity` tokens,
  /// stored as Storage (Scalar, or Eigen::half / Eigen::bfloat16 for half the bytes):
  /// layer.make_cache<Eigen::half>(batch, capacity).
  template <class Storage = Scalar>
  KvCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    return KvCache<Scalar, Storage>({batch, config().num_kv_heads, config().head_dim, capacity});
  }

  /// An empty sliding-window cache for this layer: the last `window` tokens, stored as Storage.
  template <class Storage = Scalar>
  SlidingWindowCache<Scalar, Storage> make_window_cache(Index batch, Index window) const {
    check_constructed();
    return SlidingWindowCache<Scalar, Storage>(
        {batch, config().num_kv_heads, config().head_dim, window});
  }

  /// Decoding with a full cache (§7.4, §8): the forward pass of a chunk of n new tokens per
  /// sequence at absolute positions [p, p + n), p = params.position_offset, against every token
  /// the cache holds. Projects the chunk (RoPE at positions p … p + n − 1), appends its K and V
  /// to the cache, then
  ///   head_i = softmax(scale · Q_i K_gᵀ + mask) V_g over keys [0, p + n),  out = Concat · W_O
  /// with apex::sdpa reading the cache in place (no copy, no repeated K/V).
  ///   x: [B*n, d] with B = cache.batch() (B blocks of n rows, n >= 1)
  ///   mask: the position rule (causal, window, prefix) with its offsets unset: the queries are
  ///     positions [p, p + n) and the keys [0, p + n). A bidirectional prefix must lie inside
  ///     the first chunk.
  ///   params: position_offset must equal cache.next_position() (never backwards, never
  ///     skipping); RoPE table, scale and soft-cap as for forward().
  ///   cache: num_kv_heads and head_dim of this layer, room for n more tokens (a full cache
  ///     throws, see KvCache) -> out: [B*n, d].
  /// Fed the tokens of a sequence in any chunks, it computes what forward() computes on the whole
  /// sequence. Every check runs before the cache or out is written: on error both are unchanged.
  /// out may be x itself. Allocates the projections and the [B*n, H_q·d_h] concatenation.
  /// A 16-bit cache (Storage Eigen::half or Eigen::bfloat16) holds each chunk's own projected K
  /// and V rounded once, and the attention reads them as stored: it equals forward() on the K
  /// and V the cache stored. A chunk's projection may differ from the whole sequence's in
  /// float's last bit (another product), so a stored value may be one 16-bit step from a
  /// rounding of forward()'s.
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params, KvCache<Scalar, Storage>& cache,
                      RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[gqa] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    const Index n = check_cached(xr, mask, params, cache, cache.size(), out);
    cache.check_room(n);
    const Index batch = cache.batch();
    const ProjectedQkv<Scalar> p = project_checked(xr, batch, params);
    cache.append(p.k_heads(), p.v_heads(), params.position_offset);
    AttentionMask<Scalar> positions;
    positions.positions = mask;
    positions.positions.query_offset = params.position_offset;
    multi_head_attention(p.q_heads(), cache.keys(), cache.values(), positions,
                         attention_params(params), weights_.w_o, out);
  }

  /// Decoding with a sliding-window cache (§10): as the KvCache form, but the cache holds only
  /// the last W tokens. The chunk attends to what the cache holds and to itself
  /// (sdpa_with_window_cache: one pass over the ring's runs and the chunk), then its K and V are
  /// appended, evicting the oldest. mask must be causal with a window of at most W (the layer's
  /// §10 window); the cache's memory stays 2·B·H_kv·W·d_h scalars however long the sequence.
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// projections, the concatenation and, for a 16-bit cache, the chunk's rounded K and V (see
  /// sdpa_with_window_cache).
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params,
                      SlidingWindowCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[gqa] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    const Index n = check_cached(xr, mask, params, cache, cache.size(), out);
    detail::check_window_rule(mask, cache.window(), "gqa");
    const Index batch = cache.batch();
    const ProjectedQkv<Scalar> p = project_checked(xr, batch, params);
    const Index h_q = config().num_q_heads;
    const Index d_h = config().head_dim;
    RowMatrix<Scalar> concat(xr.rows(), h_q * d_h);
    sdpa_with_window_cache<Scalar, Storage>(
        p.q_heads(), p.k_heads(), p.v_heads(), mask, attention_params(params), cache,
        HeadsView<Scalar>::token_major(concat.data(), {batch, h_q, n, d_h}));
    cache.append(p.k_heads(), p.v_heads(), params.position_offset);
    detail::matmul<Scalar>(concat, weights_.w_o, out);
  }

  /// Decoding many sequences of a paged cache in one step (§8 and §10 for each): rows [cu[i],
  /// cu[i + 1]) of x are the next tokens of sequence ids[i], at positions cache.length(ids[i]) + s.
  /// The rows of every sequence are projected together (one product per weight), each rotated at
  /// its own position; each sequence's K and V are appended to its pages, then every sequence
  /// attends over its held tokens under rules[i] (rules[0] for all when it has one entry) in one
  /// sdpa_paged call, and the result is projected by W_O.
  ///   x: [T, d]; cu_seqlens: N + 1 row offsets; ids: N distinct live sequences; rules: position
  ///   masks with their offsets unset (the positions are the cache's); params: RoPE table
  ///   covering every new position, scale and soft-cap, position_offset 0 (unused)
  ///   -> out: [T, d].
  /// A sequence fed its tokens this way, in any chunks, gets what forward_cached gets, to the
  /// rounding of the other order of its key blocks. A window layer's caller may then forget the
  /// pages its window has passed (forget_before). Every check runs before the cache or out is
  /// written: on error both are unchanged. out may be x itself.
  /// Allocates the projections, the positions and the [T, H_q·d_h] concatenation.
  template <class Derived, class Storage>
  void forward_paged(const Eigen::MatrixBase<Derived>& x, const std::vector<Index>& cu_seqlens,
                     const std::vector<SequenceId>& ids, const std::vector<PositionMask>& rules,
                     const AttentionLayerParams<Scalar>& params,
                     PagedKvCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "[gqa] x must have the layer's scalar type");
    const ConstRowRef<Scalar> xr(x.derived());
    check_constructed();
    // The rows are many sequences': their positions are checked per sequence below.
    detail::check_layer_input<Scalar>(xr, 1, config().d_model, nullptr, 0, "gqa");
    detail::check_rope_head_dim(params.rope, config().head_dim, "the layer's head_dim", "gqa");
    APEX_CHECK(params.position_offset == 0, "[gqa] params.position_offset ("
                                                << params.position_offset
                                                << ") must be 0: the paged cache gives positions");
    APEX_CHECK(
        cache.num_kv_heads() == config().num_kv_heads && cache.head_dim() == config().head_dim,
        "[gqa] cache num_kv_heads (" << cache.num_kv_heads() << ") and head_dim ("
                                     << cache.head_dim() << ") must equal the layer's ("
                                     << config().num_kv_heads << ", " << config().head_dim << ")");
    APEX_CHECK(out.rows() == xr.rows() && out.cols() == config().d_model,
               "[gqa] out shape [" << out.rows() << ", " << out.cols() << "] must be [T, d] = ["
                                   << xr.rows() << ", " << config().d_model << "]");
    const SdpaParams attention = attention_params(params);
    const Index rows = xr.rows(), h_q = config().num_q_heads, d_h = config().head_dim;
    detail::check_sdpa(detail::shape_only_view<const Scalar>({1, h_q, rows, d_h}),
                       detail::shape_only_view<const Scalar>({1, config().num_kv_heads, 0, d_h}),
                       detail::shape_only_view<const Scalar>({1, config().num_kv_heads, 0, d_h}),
                       AttentionMask<Scalar>{}, attention,
                       detail::shape_only_view<Scalar>({1, h_q, rows, d_h}), {}, "gqa");
    const Vector<Index> positions =
        detail::paged_step_positions(rows, cu_seqlens, ids, rules, cache, params.rope, "gqa");
    const ProjectedQkv<Scalar> p = project_at(xr, {0, 1, &positions}, params);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index first = cu_seqlens[i], n = cu_seqlens[i + 1] - first;
      cache.append(ids[i], p.k_heads().middle_rows(first, n), p.v_heads().middle_rows(first, n));
    }
    RowMatrix<Scalar> concat(rows, h_q * d_h);
    sdpa_paged(p.q_heads(), cu_seqlens, cache, ids, rules, attention,
               HeadsView<Scalar>::token_major(concat.data(), {1, h_q, rows, d_h}));
    detail::matmul<Scalar>(concat, weights_.w_o, out);
  }

  /// Value-returning forward_cached (either cache): a new [B*n, d] matrix.
  template <class Derived, class Cache>
  RowMatrix<Scalar> forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                   const AttentionLayerParams<Scalar>& params, Cache& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_cached(x, mask, params, cache, out);
    return out;
  }

  /// The heads of the layer's attention (H_q, H_kv, d_qk, d_v): every head is d_h wide.
  detail::LayerHeads attention_heads() const {
    return {config().num_q_heads, config().num_kv_heads, config().head_dim, config().head_dim};
  }

 private:
  /// Throws for an empty (default-constructed or moved-from) layer.
  void check_constructed() const {
    detail::check_constructed(config().d_model >= 1, "gqa", "layer");
  }

  /// The attention parameters of a call, with the layer's sinks.
  SdpaParams attention_params(const AttentionLayerParams<Scalar>& params) const {
    return detail::with_layer_sinks(params.attention, weights_.sinks, "gqa");
  }

  void check_input(const ConstRowRef<Scalar>& x, Index batch,
                   const AttentionLayerParams<Scalar>& params) const {
    check_constructed();
    detail::check_layer_input(x, batch, config().d_model, params.rope, params.position_offset,
                              "gqa");
    detail::check_rope_head_dim(params.rope, config().head_dim, "the layer's head_dim", "gqa");
  }

  /// The checks shared by both cached forms (the cache's own checks come from the caller):
  /// returns n, the new tokens per sequence. `held` is the number of keys the cache holds.
  template <class Cache>
  Index check_cached(const ConstRowRef<Scalar>& x, const PositionMask& mask,
                     const AttentionLayerParams<Scalar>& params, const Cache& cache, Index held,
                     const RowRef<Scalar>& out) const {
    const Index batch = cache.batch();
    // Positions first: params.position_offset must be the cache's next position, which also keeps
    // the layer's own position arithmetic below far from overflow.
    detail::check_cached_rule(mask, params.position_offset, cache.next_position(), x.rows() / batch,
                              "gqa");
    check_input(x, batch, params);
    APEX_CHECK(
        cache.num_kv_heads() == config().num_kv_heads && cache.head_dim() == config().head_dim,
        "[gqa] cache num_kv_heads ("
            << cache.num_kv_heads() << ") and head_dim (" << cache.head_dim()
            << ") must equal the layer's num_kv_heads (" << config().num_kv_heads
            << ") and head_dim (" << config().head_dim << ")");
    const Index n = x.rows() / batch;
    const detail::LayerHeads heads = attention_heads();
    AttentionMask<Scalar> positions;
    positions.positions = mask;
    positions.positions.query_offset = params.position_offset;
    positions.positions.key_offset = params.position_offset - held;
    detail::check_sdpa(
        detail::shape_only_view<const Scalar>({batch, heads.num_q_heads, n, heads.qk_dim}),
        detail::shape_only_view<const Scalar>({batch, heads.num_kv_heads, held + n, heads.qk_dim}),
        detail::shape_only_view<const Scalar>({batch, heads.num_kv_heads, held + n, heads.v_dim}),
        positions, attention_params(params),
        detail::shape_only_view<Scalar>({batch, heads.num_q_heads, n, heads.v_dim}), {}, "gqa");
    APEX_CHECK(out.rows() == x.rows() && out.cols() == config().d_model,
               "[gqa] out shape [" << out.rows() << ", " << out.cols() << "] must be [B*n, d] = ["
                                   << x.rows() << ", " << config().d_model << "]");
    return n;
  }

  ProjectedQkv<Scalar> project_checked(const ConstRowRef<Scalar>& x, Index batch,
                                       const AttentionLayerParams<Scalar>& params) const {
    return project_at(x, {params.position_offset, batch, nullptr}, params);
  }

  /// The projections with every row rotated at its position `at` (QK-norm first).
  ProjectedQkv<Scalar> project_at(const ConstRowRef<Scalar>& x, const detail::RowPositions& at,
                                  const AttentionLayerParams<Scalar>& params) const {
    ProjectedQkv<Scalar> p = detail::empty_projection<Scalar>(at.batch, attention_heads());
    p.q = detail::matmul<Scalar>(x, weights_.w_q);
    p.k = detail::matmul<Scalar>(x, weights_.w_k);
    p.v = detail::matmul<Scalar>(x, weights_.w_v);
    if (const auto& norm = weights_.qk_norm) {
      normalize_heads(norm->q_gamma, norm->eps, p.q);
      normalize_heads(norm->k_gamma, norm->eps, p.k);
    }
    if (params.rope != nullptr) {
      detail::apply_rope_at(*params.rope, at, p.q);
      detail::apply_rope_at(*params.rope, at, p.k);
    }
    return p;
  }

  /// RMSNorm of every d_h-wide head of x [rows, H·d_h] (heads side by side), in place.
  void normalize_heads(const Vector<Weight>& gamma, double eps, RowMatrix<Scalar>& x) const {
    const Index d_h = config().head_dim;
    Eigen::Map<RowMatrix<Scalar>> heads(x.data(), x.size() / d_h, d_h);
    rms_norm(heads, gamma, RmsNormParams{eps}, heads);
  }

  detail::ResetOnMove<GqaConfig> config_;  // a moved-from layer is an empty one
  GqaWeights<Weight> weights_;
};

}  // namespace apex
