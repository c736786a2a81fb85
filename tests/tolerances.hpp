// SPDX-License-Identifier: MIT
// The tolerances of the attention tests, one table per scalar type: the only place they are set.
//
// In every comparison the expected side is computed in double from the very same (already
// rounded) inputs, so a tolerance bounds the arithmetic of the code under test alone. u is the
// unit roundoff: 2^-24 ≈ 6e-8 in float, 2^-53 ≈ 1.1e-16 in double. A wrong mask, head, position,
// scale or merge weight moves results by 1e-3 or more, far above every value below.
//
// What each entry bounds, and why it has its value:
//
// kAttention    One attention call (apex::sdpa, apex::reference::sdpa, the tiled kernel with any
//               blocks) against the plain loop of reference/attention.hpp or the double oracle,
//               normwise: max |out − ref| ≤ tol · max |ref| over a whole [B, H, S_q, d_v] output,
//               and for the log-sum-exp ≤ tol · max(1, max |lse|) (an absolute error δ in a log is
//               a relative error δ in the sum it stands for). Scores are dot products of up to
//               192 terms, then an exp each and sums of up to 5000 terms, each step a few units of
//               the last place: 1e-5 ≈ 170 u in float, 1e-12 ≈ 10^4 u in double.
//               sdpa_test, sdpa_fast_test.
// kAttentionRow The same, row by row and absolute, for outputs of size O(1) (values drawn from
//               N(0, 1) are averaged, so |out| ≲ 4): 10 · kAttention, the normwise bound times
//               the largest such output. sdpa_fast_test's poisoned-input tests.
// kWindowCache  Attention over a sliding-window cache (the ring's runs and the chunk as key
//               segments of one pass) against the plain loop over the whole history, normwise
//               against max(1, max |ref|). Problems are small, at most W + n = 17 keys of width 5:
//               a 5-term dot product, an exp and a 17-term weighted sum, about 30 u: 2e-6 in
//               float, 1e-13 in double. cached_attention_test.
// kShortChain   Per element, |actual − expected| ≤ tol · max(1, |expected|), for outputs that are a
//               short chain: dot products of at most 16 terms, one softmax over at most 9 keys and
//               one more product of at most 12 terms (W_O or a projection). The classical bound
//               n · u · Σ|terms| is ≲ 16 · u · 4: 4e-6 in float, 7e-15 in double, held at 1e-14.
//               mha_test; the §8.4 projections and heads of gqa_test; in decode_test, how far
//               a chunk's projection (16 terms, then RoPE's two) may lie from the whole
//               sequence's before a 16-bit cache rounds it (see kDecode).
// kGqaLayer     Per element as kShortChain, for the whole GQA layer: the projection (≤ 16 terms),
//               RoPE, scores of 6 terms, a softmax over ≤ 7 keys, the weighted sum and W_O (≤ 36
//               terms): ≲ 36 · u · 3, 6e-6 in float and 1.2e-14 in double, held at 2e-14.
//               gqa_test.
// kMlaLayer     Per element as kShortChain, for the whole MLA layer: two chained projections
//               (x W_DKV then W_UK, ≤ 14 terms), RoPE, scores of d_h + d_r = 9 terms, a softmax
//               over ≤ 7 keys, the weighted sum and W_O (≤ 20 terms): ≲ 20 · u · 4 ≈ 5e-6 in float
//               and 1e-14 in double, with room for the chain: 8e-6 and 2e-14. mla_test.
// kDecode       Decoding token by token against one forward pass of the same layer, row by row:
//               |Δ| ≤ tol · max |row|. Both sides run in the scalar type under test and sum in
//               different orders (key blocks, partial softmaxes merged through their statistics,
//               absorbed MLA's (q W_UKᵀ)·c for q·(c W_UK)) over up to 1000 keys: a few hundred
//               float ulps, well inside 1e-4; 1e-11 in double. decode_test. With a 16-bit
//               cache the oracle attends over the K and V the cache stored (checked bit for bit
//               against it), not over a rounding of the forward pass's: a projection of two
//               rows and one of 2000 are different products (Eigen's kernels by row count, FMA
//               where the target has it) and may differ in float's last bit, which now and then
//               decides a rounding, so a stored element may be a whole 16-bit step (up to 2^-7
//               relative in bfloat16) from round(forward's). In a -march=native AVX-512 build
//               such steps moved bfloat16 rows by 1.8e-4 of their maximum: not the arithmetic
//               this bound is for, so it is checked apart (each stored value a rounding of a
//               value within kShortChain of the forward pass's), and this bound is not widened
//               for it.
// kAbsorbedMla  Absorbed against naive MLA: the same attention with its products associated
//               differently, O(1) values through at most three chained products of ≤ 16 terms:
//               tens of ulps, 2e-5 in float, 1e-12 in double. decode_test.
// kBackward    The gradients of sdpa_backward (dq, dk, dv, d_bias, d_sinks) against the plain
//               backward loop of reference/attention_backward.hpp, normwise: max |g − ref| ≤
//               tol · max(1, max |ref|) over a whole gradient (O(1) inputs from N(0, 1), so a
//               gradient much smaller than 1 is a cancellation, ds = p(dp − D), whose error is
//               that of the O(1) terms). The chain is the forward's (scores, an exp per weight)
//               plus dp = do·v, D = do·o from the rounded output, and sums over the keys or the
//               queries and the group's heads: the same length as kAttention's, so its value.
//               Measured on sdpa_backward_test's problems (≤ 30 keys): 7 u in float, 9 u in
//               double. sdpa_backward_test.
// kIndexer      The lightning indexer's queries, keys and scores (indexer.hpp) against the plain
//               loops of reference/indexer.hpp, normwise against max(1, max |ref|): projections
//               of up to 64 terms, LayerNorm, RoPE's two terms, a Hadamard transform of up to
//               128 terms (7 butterfly levels), then dot products of d_I <= 128 terms and a
//               weighted sum over H_I <= 16 heads: a chain as long as kAttention's, so its value.
//               indexer_test.
#pragma once

namespace apex::testing {

template <class Scalar>
struct Tolerances;

template <>
struct Tolerances<float> {
  static constexpr double kAttention = 1e-5;  // ≈ 170 u
  static constexpr double kAttentionRow = 10.0 * kAttention;
  static constexpr double kWindowCache = 2e-6;  // ≈ 33 u
  static constexpr double kShortChain = 4e-6;   // 16 · u · 4
  static constexpr double kGqaLayer = 6e-6;     // 36 · u · 3
  static constexpr double kMlaLayer = 8e-6;     // 20 · u · 4 ≈ 5e-6, and room for the chain
  static constexpr double kDecode = 1e-4;       // a few hundred u, with room
  static constexpr double kAbsorbedMla = 2e-5;  // tens of u
  static constexpr double kBackward = 1e-5;     // ≈ 170 u, as kAttention
  static constexpr double kIndexer = 1e-5;      // ≈ 170 u, as kAttention
};

template <>
struct Tolerances<double> {
  static constexpr double kAttention = 1e-12;  // ≈ 10^4 u
  static constexpr double kAttentionRow = 10.0 * kAttention;
  static constexpr double kWindowCache = 1e-13;
  static constexpr double kShortChain = 1e-14;  // 16 · u · 4 ≈ 7e-15
  static constexpr double kGqaLayer = 2e-14;    // 36 · u · 3 ≈ 1.2e-14
  static constexpr double kMlaLayer = 2e-14;    // 20 · u · 4 ≈ 1e-14, and room for the chain
  static constexpr double kDecode = 1e-11;
  static constexpr double kAbsorbedMla = 1e-12;
  static constexpr double kBackward = 1e-12;
  static constexpr double kIndexer = 1e-12;
};

}  // namespace apex::testing
