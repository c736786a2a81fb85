// SPDX-License-Identifier: MIT
// The softmax of attention, in the one place it is written: the running statistics of a row while
// its keys stream past (update), the normalisation at the end (finish), and the merge of partial
// results over disjoint sets of keys (merge_rows). The tiled kernel, split-key decoding, the
// caches' multi-run attention and apex::merge_attention all use these three functions and no
// other softmax arithmetic; a new term of the softmax (an attention sink) belongs here.
//
// STATISTICS. For the scores s_j of the keys that take part in a row (allowed, and s_j > -inf):
//   m = max_j s_j,   l = Σ_j exp(s_j − m)  (1 <= l <= number of keys),   lse = m + log l.
// A row in which no key takes part has m = -inf, l = 0 (lse = -inf). A row with a NaN score
// among its keys, or a +inf one (its weight would be inf − inf), has m = l = NaN.
//
// PARTICIPATION. A key takes part in a row when the mask allows it and its score is not -inf.
// The value of a key that takes part reaches the row even when its weight exp(s_j − m)
// underflows to 0 (so a NaN or ±inf value makes the row's output non-finite, as the plain
// formula does); the value of a key that takes no part never reaches it. update() therefore
// writes the weight of a key that takes no part as -0.0 and every other weight as exp(s − m) >=
// +0.0, and the value update adds only keys whose weight does not have the sign bit set when a
// block's values are not all finite.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/storage.hpp>

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

// Not part of the public API: (count, width) and (scratch, scratch) pairs of internal helpers with
// one caller each. NOLINTBEGIN(bugprone-easily-swappable-parameters)
namespace apex::detail {

/// The softmax statistics (m, l) of one row; the default is a row in which no key took part.
template <class C>
struct SoftmaxStats {
  C max = -std::numeric_limits<C>::infinity();
  C sum = C(0);
};

/// Whether a row's statistics are finite, or those of a row in which no key took part.
template <class C>
bool finite_stats(const SoftmaxStats<C>& stats) {
  return std::isfinite(stats.sum) &&
         (std::isfinite(stats.max) || stats.max == -std::numeric_limits<C>::infinity());
}

/// max_j s_j of n > 0 scores, NaN when one is NaN.
template <class C>
APEX_ALWAYS_INLINE C block_maximum(const C* s, Index n, const FloatKernels* simd) {
  if constexpr (std::is_same_v<C, float>) {
    if (simd != nullptr) return simd->max_of(s, n);
  }
  return Eigen::Map<const Eigen::Array<C, 1, Eigen::Dynamic>>(s, n)
      .template maxCoeff<Eigen::PropagateNaN>();
}

/// exp_weights, then the sum of the weights (with Eigen, a separate pass measured faster than
/// summing in exp's).
template <class C>
APEX_ALWAYS_INLINE C exp_and_sum(C* s, Index n, C max, bool& hidden, const FloatKernels* simd) {
  if constexpr (std::is_same_v<C, float>) {
    if (simd != nullptr) return simd->exp_sum(s, n, max, hidden);
  }
  exp_weights(s, n, max, hidden);
  return Eigen::Map<const Eigen::Array<C, 1, Eigen::Dynamic>>(s, n).sum();
}

/// Folds one block of a row's scores into its running statistics (the online softmax):
///   m' = max(m, max_j s_j),  s_j <- exp(s_j − m') (−0.0 where s_j = -inf),
///   α = exp(m − m'),         l <- α·l + Σ_j s_j,   m <- m'
/// and returns α, the factor by which the row's running Σ_j exp(s_j − m)·v_j must be multiplied
/// (exactly 1 when the maximum did not move). On return `s` holds the block's weights, and
/// `hidden` is set when some key of the block takes no part in the row. A NaN score, now or
/// earlier, makes the row NaN; its weights are then all −0.0 (nothing is added). The maximum, the
/// exponentials and their sum run on apex's own kernels where `simd` gives them (float), else on
/// Eigen's.
///   s: n scores, -inf for keys that take no part.
template <class C>
APEX_ALWAYS_INLINE C softmax_update(SoftmaxStats<C>& row, C* s, Index n, bool& hidden,
                                    const FloatKernels* simd = nullptr) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  const C block_max = n == 0 ? kNegInf : block_maximum(s, n, simd);
  const C new_max = std::isnan(block_max) || std::isnan(row.max)
                        ? std::numeric_limits<C>::quiet_NaN()
                        : std::max(row.max, block_max);
  if (std::isnan(new_max) || new_max == kNegInf) {
    // A NaN row (its result is NaN whatever comes), or no key so far: nothing is added.
    Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>(s, n).setConstant(C(-0.0));
    if (std::isnan(new_max)) row = {new_max, new_max};
    hidden = hidden || n > 0;
    return C(1);
  }
  const C block_sum = exp_and_sum(s, n, new_max, hidden, simd);
  const C alpha = row.max == new_max ? C(1) : std::exp(row.max - new_max);
  row.sum = alpha * row.sum + block_sum;
  row.max = new_max;
  return alpha;
}

/// THE SINK. An attention sink is one more logit of a row whose value is zero (gpt-oss): it
/// joins the softmax's denominator and adds nothing to the output,
///   out = Σ_j e^(s_j) v_j / (e^sink + Σ_j e^(s_j)).
/// In statistics, the row (m, l) becomes M = max(m, sink), L = l·e^(m − M) + e^(sink − M), and
/// lse = M + log L includes the sink. A row in which no key took part gets (sink, 1): its output
/// is zeros. A sink of -inf is no sink (e^-inf = 0) and changes nothing, bit for bit. A sink is
/// added once per row, at its end (softmax_finish) or at the end of the merge of its parts
/// (merge_rows), never to a part.
template <class C>
SoftmaxStats<C> with_sink(const SoftmaxStats<C>& row, C sink) {
  if (sink == -std::numeric_limits<C>::infinity()) return row;
  if (!(row.sum > C(0))) return {sink, C(1)};
  const C max = std::max(row.max, sink);
  return {max, row.sum * std::exp(row.max - max) + std::exp(sink - max)};
}

/// The end of a row: out = acc·e^(m − M) / L for the statistics (M, L) of the row with its sink
/// (with_sink; without one, out = acc / l), which are returned. A NaN row is written as NaN, a
/// row in which no key took part (l not > 0) as zeros, with the default statistics or (sink, 1).
///   acc: the d_v running Σ_j exp(s_j − m)·v_j; out: d_v elements of type T (rounded once);
///   sink: -inf for none.
template <class C, class T>
SoftmaxStats<C> softmax_finish(const SoftmaxStats<C>& row, const C* acc, Index d_v, T* out,
                               C sink = -std::numeric_limits<C>::infinity()) {
  if (std::isnan(row.max) || std::isnan(row.sum)) {
    std::fill(out, out + d_v, static_cast<T>(std::numeric_limits<C>::quiet_NaN()));
    return {std::numeric_limits<C>::quiet_NaN(), std::numeric_limits<C>::quiet_NaN()};
  }
  const SoftmaxStats<C> total = with_sink(row, sink);
  if (!(row.sum > C(0))) {
    std::fill(out, out + d_v, T(0));
    return total;
  }
  const C inverse = (total.max == row.max ? C(1) : std::exp(row.max - total.max)) / total.sum;
  for (Index c = 0; c < d_v; ++c) out[c] = round_to<T>(acc[c] * inverse);
  return total;
}

/// lse = m + log l of a row's statistics (-inf for a row without keys, NaN for a NaN row),
/// formed in double and rounded once.
template <class C>
double log_sum_exp(const SoftmaxStats<C>& row) {
  if (std::isnan(row.max) || std::isnan(row.sum)) return std::numeric_limits<double>::quiet_NaN();
  if (!(row.sum > C(0))) return -std::numeric_limits<double>::infinity();
  return static_cast<double>(row.max) + std::log(static_cast<double>(row.sum));
}

/// One part of a row, for merge_rows: its normalised output (d_v elements of type T, read as C)
/// and its statistics.
template <class T, class C>
struct PartRow {
  const T* out = nullptr;
  SoftmaxStats<C> stats;
};

/// The element type T of the parts that part_at returns.
template <class PartAt>
using T_of = std::remove_const_t<
    std::remove_pointer_t<decltype(std::declval<const PartAt&>()(Index{0}).out)>>;

/// THE MERGE OF PARTIAL RESULTS. A row's keys split into disjoint parts c = 0 .. n−1, each with
/// its normalised output o_c and statistics (m_c, l_c); the row over all of them is
///   M = max_c m_c,  w_c = l_c·exp(m_c − M),  L = Σ_c w_c,  o = Σ_c w_c·o_c / L,  stats (M, L)
/// (and lse = M + log L). Carrying (m_c, l_c) instead of lse_c keeps the merge exact at any
/// logit size: m_c − M is a difference of two scores, exact or nearly so, where lse_c = m_c +
/// log l_c would have rounded log l_c away beside a large m_c (by 1e4 in float, by 1e30 in
/// double). A part known only by its lse is the part (m = lse, l = 1).
/// Rules, in this order:
///   - a part whose m is NaN (a NaN row) makes the row NaN: o and both statistics;
///   - a part whose m is -inf (no key of it took part) is skipped, whatever its o holds;
///   - if every part is skipped, no key took part: o = 0 and the default statistics;
///   - every other part is weighted, even by a w_c that underflows to 0, so that a NaN or ±inf
///     in o_c reaches the row exactly as it would in one pass over all the keys (PARTICIPATION).
/// A sink (-inf: none) is the row's once: it joins as one more part of zero output with the
/// statistics (sink, 1), after the NaN rule, so the parts themselves must not hold it.
/// The parts are combined in the order given, into `acc` (d_v values of C), and only then written
/// to `out`: out may be the output of any one part (in place). Where some part is weighted, acc
/// keeps Σ_c w_c·o_c on return (the decode scheduler checks it for overflow).
///   part_at(c) -> PartRow<T, C>; out: d_v elements of type U; weights: room for `parts` values.
template <class C, class PartAt, class U>
SoftmaxStats<C> merge_rows(Index parts, Index d_v, const PartAt& part_at, U* out, C* weights,
                           C* acc, C sink = -std::numeric_limits<C>::infinity()) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  C max = kNegInf;
  for (Index c = 0; c < parts; ++c) {
    const C m = part_at(c).stats.max;
    if (std::isnan(m)) {
      std::fill(out, out + d_v, static_cast<U>(std::numeric_limits<C>::quiet_NaN()));
      return {m, m};
    }
    max = std::max(max, m);
  }
  max = std::max(max, sink);
  if (max == kNegInf) {
    std::fill(out, out + d_v, U(0));
    return {};
  }
  C total = sink == kNegInf ? C(0) : std::exp(sink - max);
  for (Index c = 0; c < parts; ++c) {
    const SoftmaxStats<C> s = part_at(c).stats;
    weights[c] = s.max == kNegInf ? C(0) : s.sum * std::exp(s.max - max);
    total += weights[c];
  }
  auto sum = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>(acc, d_v);
  sum.setZero();
  for (Index c = 0; c < parts; ++c) {
    const auto part = part_at(c);
    if (part.stats.max == kNegInf) continue;
    sum +=
        weights[c] * Eigen::Map<const Eigen::Array<T_of<PartAt>, Eigen::Dynamic, 1>>(part.out, d_v)
                         .template cast<C>();
  }
  const C inverse = C(1) / total;
  for (Index col = 0; col < d_v; ++col) out[col] = round_to<U>(acc[col] * inverse);
  return {max, total};
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
