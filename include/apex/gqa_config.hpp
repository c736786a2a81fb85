// SPDX-License-Identifier: MIT
// The shape and the weights of a grouped-query attention layer (§7, §8): the head counts and
// which key/value head a query head reads, the parameter count, the config GroupedQueryAttention
// (gqa.hpp) is built from, and the weights it owns (projections, sinks, QK-norm).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <cstdint>
#include <optional>
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

}  // namespace apex
