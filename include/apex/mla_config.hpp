// SPDX-License-Identifier: MIT
// The shape and the weights of a multi-head latent attention layer (§9.2 - §9.5): the config
// MultiHeadLatentAttention (mla.hpp) is built from, its §9.5 weight table and parameter count,
// what its KV cache holds per token (§9.4, both the document's figure and the true one), and the
// weights it owns.
#pragma once

#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <cstdint>
#include <string>
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

}  // namespace apex
