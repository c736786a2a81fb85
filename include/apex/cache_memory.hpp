// SPDX-License-Identifier: MIT
// What KV caches cost (§7.4, §8.3, §9.4, §10.3): values per token, bytes per layer, and the
// documents' comparison of MHA, GQA, MQA, sliding windows and MLA. Formulas on sizes only: they
// need no weights and no cache, so they can be evaluated for APEX-1 Large. Every product is
// checked, since the dimensions are the user's and a wrapped size is worse than an error.
#pragma once

#include <apex/config.hpp>
#include <apex/kv_format.hpp>
#include <apex/kv_quant.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace apex {

/// Values stored in the KV cache per token and per layer: K and V, num_kv_heads heads of
/// head_dim each, 2·H_kv·d_h (§7.4 with H_kv = H_q; §8.3, §9.4 for fewer heads).
/// Throws std::invalid_argument on a negative argument or a count beyond 64 bits.
inline std::int64_t kv_cache_values_per_token(std::int64_t num_kv_heads, std::int64_t head_dim) {
  return detail::checked_product({2, num_kv_heads, head_dim}, "kv_cache_values_per_token",
                                 "2*H_kv*d_h");
}

namespace detail {

/// kv_cache_bytes with the operation named in its messages (`op`), for the functions that
/// evaluate it on their own arguments.
inline std::int64_t checked_kv_cache_bytes(std::int64_t batch, std::int64_t seq,
                                           std::int64_t num_kv_heads, std::int64_t head_dim,
                                           std::int64_t bytes_per_value, const char* op) {
  return checked_product({2, batch, seq, num_kv_heads, head_dim, bytes_per_value}, op,
                         "2*B*S*H_kv*d_h*bytes");
}

}  // namespace detail

/// Bytes of the KV cache of one layer (§7.4): 2·B·S·H_kv·d_h·bytes_per_value, K and V.
/// Note: §7.4 prints "4 GB per layer" for 128K tokens, 128 heads of 128, FP16; that is K
/// alone. K and V take 2 × 131072 × 128 × 128 × 2 bytes = 8 GiB (SEED-NOTES.md).
/// Throws std::invalid_argument on a negative argument or a size beyond 64 bits.
inline std::int64_t kv_cache_bytes(std::int64_t batch, std::int64_t seq, std::int64_t num_kv_heads,
                                   std::int64_t head_dim, std::int64_t bytes_per_value) {
  return detail::checked_kv_cache_bytes(batch, seq, num_kv_heads, head_dim, bytes_per_value,
                                        "kv_cache_bytes");
}

/// Bytes of the KV cache of one layer whose rows are stored in format F (kv_format.hpp, e.g.
/// Eigen::half or BlockQ8_0): 2·B·S·H_kv·bytes(a row of d_h values). Throws unless d_h is a whole
/// number of F's blocks, on a negative argument or on a size beyond 64 bits.
template <class F>
// The arguments follow §7.4's product 2·B·S·H_kv·d_h in its order, as the other form's do.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
std::int64_t kv_cache_bytes(std::int64_t batch, std::int64_t seq, std::int64_t num_kv_heads,
                            std::int64_t head_dim) {
  const char* op = "kv_cache_bytes";
  APEX_CHECK(head_dim >= 0, "[" << op << "] head_dim (" << head_dim << ") must not be negative");
  detail::check_row_values<F>(head_dim, op, "head_dim");
  const std::int64_t row = KvFormat<F>::bytes(KvFormat<F>::elements(head_dim));
  return detail::checked_product({2, batch, seq, num_kv_heads, row}, op, "2*B*S*H_kv*row bytes");
}

// ---------------------------------------------------------------------------------------------
// Memory (§7.4, §8.3, §9.4, §10.3)
// ---------------------------------------------------------------------------------------------

/// Bytes of a sliding-window cache after `context` tokens: 2·B·min(S, W)·H_kv·d_h·bytes — the
/// full-cache formula of §7.4 with S capped at W. Throws on a negative argument or overflow.
inline std::int64_t sliding_window_cache_bytes(std::int64_t batch, std::int64_t context,
                                               std::int64_t window, std::int64_t num_kv_heads,
                                               std::int64_t head_dim,
                                               std::int64_t bytes_per_value) {
  APEX_CHECK(context >= 0 && window >= 0, "[sliding_window_cache_bytes] context ("
                                              << context << ") and window (" << window
                                              << ") must be >= 0");
  return detail::checked_kv_cache_bytes(batch, std::min(context, window), num_kv_heads, head_dim,
                                        bytes_per_value, "sliding_window_cache_bytes");
}

/// Bytes of a latent cache (§9.4) after `context` tokens: B·S·(d_kv + H_kr·d_r)·bytes. With
/// rope_heads = 0 it is §9.4's count (c_kv only), which undercounts what a decoder keeps.
/// Throws on a negative argument or overflow.
// The arguments follow §9.4's product B·S·(d_kv + H_kr·d_r)·bytes in its order; the structured
// forms are LatentCacheShape and cache_comparison.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
inline std::int64_t latent_cache_bytes(std::int64_t batch, std::int64_t context,
                                       std::int64_t latent_dim, std::int64_t rope_heads,
                                       std::int64_t rope_dim, std::int64_t bytes_per_value) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const char* op = "latent_cache_bytes";
  const std::int64_t width =
      detail::checked_sum(latent_dim, detail::checked_product(rope_heads, rope_dim, op, "H_kr*d_r"),
                          op, "d_kv + H_kr*d_r");
  return detail::checked_product({batch, context, width, bytes_per_value}, op,
                                 "B*S*(d_kv + H_kr*d_r)*bytes");
}

/// The dimensions the §7.4 / §8.3 / §9.4 / §10.3 cache comparisons are made at. No defaults: the
/// documents give APEX-1 Large's H_q = 128, H_kv = 8, d_h = 128, d_kv = 512, W = 4096 and a 128K
/// context, but no d_r (their range is 32–64).
struct CacheComparisonParams {
  Index num_q_heads = 0;      ///< H_q (the MHA baseline caches H_q heads)
  Index num_kv_heads = 0;     ///< H_kv of GQA
  Index head_dim = 0;         ///< d_h
  Index latent_dim = 0;       ///< d_kv of MLA
  Index rope_dim = 0;         ///< d_r of MLA's decoupled RoPE
  Index rope_heads = 0;       ///< H_kr, MLA's K_rope heads (H_kv as §9.3 writes it, or 1)
  Index window = 0;           ///< W of the sliding-window layers
  Index context = 0;          ///< S, tokens cached
  Index batch = 1;            ///< B
  Index bytes_per_value = 2;  ///< 2 for FP16 / BF16 as §7.4 assumes, 4 for float
};

/// One row of the cache comparison.
struct CacheComparisonRow {
  std::string method;                 ///< "MHA", "GQA", "MQA", "MLA (as §9.4 counts)", ...
  std::string cached;                 ///< what is stored per token
  std::int64_t values_per_token = 0;  ///< per layer and sequence (window layers: while filling)
  std::int64_t bytes_per_layer = 0;   ///< at the given context and batch
  double relative = 0.0;              ///< bytes_per_layer / the MHA row's
};

/// The §7.4, §8.3 and §9.4 tables (and the §10.3 sliding window) for one set of dimensions, one
/// layer each, relative to multi-head attention with H_q heads:
///   MHA                   K + V, H_q heads           2·H_q·d_h per token   (§7.4, §8.3)
///   GQA                   K + V, H_kv heads          2·H_kv·d_h            (§8.3, §9.4)
///   MQA                   K + V, one head            2·d_h                 (§8.3)
///   GQA + window          K + V, H_kv heads, last W  2·H_kv·d_h, min(S, W) tokens (§10.3)
///   MLA (as §9.4 counts)  c_kv only                  d_kv                  (§9.4)
///   MLA                   c_kv + K_rope              d_kv + H_kr·d_r       (what is cached)
/// §7.4 prints "4 GB per layer" for the MHA row at 128K, FP16; the row is 8 GiB (K and V), and
/// §9.4's 1.6% is 1.5625% for c_kv alone (SEED-NOTES.md). Allocates the rows.
inline std::vector<CacheComparisonRow> cache_comparison(const CacheComparisonParams& p) {
  APEX_CHECK(p.num_q_heads >= 1 && p.num_kv_heads >= 1 && p.head_dim >= 1 && p.latent_dim >= 1 &&
                 p.rope_dim >= 1 && p.rope_heads >= 1 && p.window >= 1 && p.context >= 1 &&
                 p.batch >= 1 && p.bytes_per_value >= 1,
             "[cache_comparison] every dimension must be >= 1 (H_q "
                 << p.num_q_heads << ", H_kv " << p.num_kv_heads << ", d_h " << p.head_dim
                 << ", d_kv " << p.latent_dim << ", d_r " << p.rope_dim << ", H_kr " << p.rope_heads
                 << ", W " << p.window << ", S " << p.context << ", B " << p.batch << ", bytes "
                 << p.bytes_per_value << ")");
  const char* op = "cache_comparison";
  const auto kv_bytes = [&](std::int64_t heads, std::int64_t tokens) {
    return detail::checked_kv_cache_bytes(p.batch, tokens, heads, p.head_dim, p.bytes_per_value,
                                          op);
  };
  const auto kv_values = [&](std::int64_t heads) {
    return detail::checked_product({2, heads, p.head_dim}, op, "2*H*d_h");
  };
  const std::int64_t mha = kv_bytes(p.num_q_heads, p.context);
  const auto row = [&](std::string method, std::string cached, std::int64_t values,
                       std::int64_t bytes) {
    return CacheComparisonRow{std::move(method), std::move(cached), values, bytes,
                              static_cast<double>(bytes) / static_cast<double>(mha)};
  };
  const std::string kv_heads = std::to_string(p.num_kv_heads);
  const std::int64_t latent_values = detail::checked_sum(
      p.latent_dim, detail::checked_product(p.rope_heads, p.rope_dim, op, "H_kr*d_r"), op,
      "d_kv + H_kr*d_r");
  return {
      row("MHA", "K + V, " + std::to_string(p.num_q_heads) + " heads", kv_values(p.num_q_heads),
          mha),
      row("GQA", "K + V, " + kv_heads + " heads", kv_values(p.num_kv_heads),
          kv_bytes(p.num_kv_heads, p.context)),
      row("MQA", "K + V, 1 head", kv_values(1), kv_bytes(1, p.context)),
      row("GQA + window", "K + V, " + kv_heads + " heads, last " + std::to_string(p.window),
          kv_values(p.num_kv_heads), kv_bytes(p.num_kv_heads, std::min(p.context, p.window))),
      row("MLA (as §9.4 counts)", "c_kv only", p.latent_dim,
          detail::checked_product({p.batch, p.context, p.latent_dim, p.bytes_per_value}, op,
                                  "B*S*d_kv*bytes")),
      row("MLA", "c_kv + K_rope (" + std::to_string(p.rope_heads) + " heads)", latent_values,
          detail::checked_product({p.batch, p.context, latent_values, p.bytes_per_value}, op,
                                  "B*S*(d_kv + H_kr*d_r)*bytes")),
  };
}

/// The comparison of cache_comparison along the other axis, bits per value, for the same
/// dimensions: one layer's GQA cache (H_kv heads) and MLA cache (c_kv + K_rope) in each K/V
/// format, relative to the MHA row of cache_comparison at p.bytes_per_value:
///   GQA, FP16 / q8_0 / q4_0 / fp8 e4m3   2·H_kv heads of d_h in the format (fp8: a float scale
///                                        per 128 values)
///   MLA, FP16                            d_kv + H_kr·d_r values of 2 bytes
///   MLA, fp8 (FlashMLA's layout)         c_kv in e4m3 with a float scale per 128 values, K_rope
///                                        kept in bfloat16: d_kv + 4·d_kv/128 + 2·H_kr·d_r bytes
///                                        (656 at d_kv = 512, H_kr·d_r = 64)
/// Throws as cache_comparison does, and unless d_h and d_kv are multiples of 128 (the blocks of
/// the formats compared). Allocates the rows.
inline std::vector<CacheComparisonRow> quantized_cache_comparison(const CacheComparisonParams& p) {
  const char* op = "quantized_cache_comparison";
  const std::int64_t mha = cache_comparison(p).front().bytes_per_layer;  // checks p
  detail::check_row_values<BlockFp8E4m3<128>>(p.head_dim, op, "head_dim");
  detail::check_row_values<BlockFp8E4m3<128>>(p.latent_dim, op, "latent_dim");
  const auto row = [&](std::string method, std::string cached, std::int64_t values,
                       std::int64_t bytes) {
    return CacheComparisonRow{std::move(method), std::move(cached), values, bytes,
                              static_cast<double>(bytes) / static_cast<double>(mha)};
  };
  const std::int64_t gqa_values =
      detail::checked_product({2, p.num_kv_heads, p.head_dim}, op, "2*H_kv*d_h");
  const std::string heads = "K + V, " + std::to_string(p.num_kv_heads) + " heads, ";
  const auto gqa = [&](const char* name, std::int64_t bytes) {
    return row(std::string("GQA, ") + name, heads + name, gqa_values, bytes);
  };
  const std::int64_t rope = detail::checked_product(p.rope_heads, p.rope_dim, op, "H_kr*d_r");
  const std::int64_t latent_values = detail::checked_sum(p.latent_dim, rope, op, "d_kv + H_kr*d_r");
  const std::int64_t fp8_row_bytes = detail::checked_sum(
      KvFormat<BlockFp8E4m3<128>>::bytes(p.latent_dim / 128), 2 * rope, op, "latent row bytes");
  const auto tokens = [&](std::int64_t row_bytes) {
    return detail::checked_product({p.batch, p.context, row_bytes}, op, "B*S*row bytes");
  };
  return {
      gqa("FP16", kv_cache_bytes<Eigen::half>(p.batch, p.context, p.num_kv_heads, p.head_dim)),
      gqa("q8_0", kv_cache_bytes<BlockQ8_0>(p.batch, p.context, p.num_kv_heads, p.head_dim)),
      gqa("q4_0", kv_cache_bytes<BlockQ4_0>(p.batch, p.context, p.num_kv_heads, p.head_dim)),
      gqa("fp8 e4m3",
          kv_cache_bytes<BlockFp8E4m3<128>>(p.batch, p.context, p.num_kv_heads, p.head_dim)),
      row("MLA, FP16", "c_kv + K_rope", latent_values,
          tokens(detail::checked_product(latent_values, 2, op, "latent row bytes"))),
      row("MLA, fp8 (FlashMLA)", "c_kv e4m3, K_rope bf16", latent_values, tokens(fp8_row_bytes)),
  };
}

}  // namespace apex
