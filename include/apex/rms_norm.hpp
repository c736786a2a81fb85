// SPDX-License-Identifier: MIT
// RMSNorm (§3): each token's features divided by their root mean square, then scaled by γ.
//
//   x   [tokens, d]  ──►  out[t, j] = x[t, j] / sqrt(mean_j(x[t, :]²) + ε) · γ[j]
//   γ   [d]
//
// The kernel makes two passes over a row: the sum of squares, then the scaled write. A row is
// at most a few tens of kilobytes, so the second pass reads it from L1/L2 and the memory
// traffic is one read of x and one write of out; the second pass prefetches the next row, so
// that the reads of one row and the writes of the one before overlap. Rows are spread over threads
// statically.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

namespace apex {

/// Parameters of RMSNorm. The default is the document's (§3.2).
struct RmsNormParams {
  /// ε added to the mean square under the square root; must be positive and finite.
  double eps = 1e-6;
};

namespace detail {

/// Sum of squares of x[0 .. n), accumulated in Acc. Sixteen independent partial sums give the
/// compiler independent vector accumulators without reassociating one long sum (which it may
/// not do without -ffast-math), and fix the order of additions so that the result does not
/// depend on which thread computes the row.
template <class Acc, class Scalar>
Acc rms_sum_squares(const Scalar* x, Index n) {
  constexpr Index kLanes = 16;
  Acc partial[kLanes] = {};
  Index j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (Index l = 0; l < kLanes; ++l) {
      const Acc v = static_cast<Acc>(x[j + l]);
      partial[l] += v * v;
    }
  }
  for (Index l = 0; l < kLanes && j + l < n; ++l) {
    const Acc v = static_cast<Acc>(x[j + l]);
    partial[l] += v * v;
  }
  for (Index width = kLanes / 2; width > 0; width /= 2) {
    for (Index l = 0; l < width; ++l) partial[l] += partial[l + width];
  }
  return partial[0];
}

/// Elements of T in one block of the scaled write (4 cache lines), and in one cache line.
template <class T>
constexpr Index kRmsBlock = 256 / static_cast<Index>(sizeof(T));
template <class T>
constexpr Index kRmsLine = 64 / static_cast<Index>(sizeof(T));

/// Asks for the cache lines of next[j0 .. min(n, j0 + kRmsBlock)) (nothing when next is null):
/// the scaled write of a row prefetches the next row a block at a time, so that reading it
/// overlaps the writes instead of following them (RMSNorm 4096 × 4096 in float, 2 threads,
/// Intel Xeon: 0.61 → 0.87 of a plain copy loop's bandwidth in a first measurement; 0.72 →
/// 1.16 of BM_StreamCopy in the benchmark).
template <class TX>
APEX_ALWAYS_INLINE void rms_prefetch_block(const TX* next, Index j0, Index n) {
  if (next == nullptr) return;
  for (Index j = 0; j < kRmsBlock<TX> && j0 + j < n; j += kRmsLine<TX>) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(next + j0 + j);  // measured faster here than Eigen's _mm_prefetch
#else
    Eigen::internal::prefetch(next + j0 + j);
#endif
  }
}

/// y[j] = x[j] · inv · γ[j], formed in Acc and rounded once to the output type (round_to),
/// prefetching the row `next`. Separate versions for distinct and identical input/output rows
/// let the compiler vectorise both without run-time alias checks (γ never overlaps the output:
/// rms_norm checks it).
template <class Acc, class TX, class TG, class TO>
void rms_scale_row(const TX* __restrict x, const TG* __restrict gamma, Acc inv, TO* __restrict y,
                   Index n, const TX* next) {
  for (Index j0 = 0; j0 < n; j0 += kRmsBlock<TX>) {
    rms_prefetch_block(next, j0, n);
    const Index end = std::min(n, j0 + kRmsBlock<TX>);
    for (Index j = j0; j < end; ++j) {
      y[j] = round_to<TO>(static_cast<Acc>(x[j]) * inv * static_cast<Acc>(gamma[j]));
    }
  }
}

template <class Acc, class TG, class TO>
void rms_scale_row_in_place(TO* __restrict y, const TG* __restrict gamma, Acc inv, Index n,
                            const TO* next) {
  for (Index j0 = 0; j0 < n; j0 += kRmsBlock<TO>) {
    rms_prefetch_block(next, j0, n);
    const Index end = std::min(n, j0 + kRmsBlock<TO>);
    for (Index j = j0; j < end; ++j) {
      y[j] = round_to<TO>(static_cast<Acc>(y[j]) * inv * static_cast<Acc>(gamma[j]));
    }
  }
}

/// y = x · inv · γ, in place when x and y are the same row; `next` is the row after x, or null.
template <class TX, class TG, class TO>
void rms_scale(const TX* x, const TG* gamma, double inv, TO* y, Index n, const TX* next) {
  if constexpr (std::is_same_v<TX, TO>) {
    if (x == y) {
      rms_scale_row_in_place<double>(y, gamma, inv, n, next);
      return;
    }
  }
  rms_scale_row<double>(x, gamma, inv, y, n, next);
}

/// Double rows whose squares overflow (|x| ≳ 1e154) or whose mean square and ε are both so
/// small that squares lose digits to underflow. The row is rescaled by 2^-k, where 2^k is the
/// binade of max|x| (exact), so that every scaled square lies in [0, 4):
///   RMS² = 2^(2k) · (mean((x·2^-k)²) + ε·2^(-2k)),   out = (x·2^-k) / sqrt(…) · γ.
/// Slower (scalbn per element, one extra pass) but only taken for such rows.
template <class TG, class TO>
void rms_norm_row_rescaled(const double* x, const TG* gamma, double eps, TO* y, Index n) {
  double max_abs = 0.0;
  for (Index j = 0; j < n; ++j) max_abs = std::max(max_abs, std::abs(x[j]));
  const double count = static_cast<double>(n);
  if (!(max_abs > 0.0) || !std::isfinite(max_abs)) {
    // Zero rows, infinities: the formula as written (an infinity gives NaN, as it would in
    // any implementation of x / RMS(x)).
    const double inv = 1.0 / std::sqrt(rms_sum_squares<double>(x, n) / count + eps);
    for (Index j = 0; j < n; ++j) y[j] = round_to<TO>(x[j] * inv * static_cast<double>(gamma[j]));
    return;
  }
  const int k = std::ilogb(max_abs);
  double scaled_sum = 0.0;
  for (Index j = 0; j < n; ++j) {
    const double v = std::scalbn(x[j], -k);
    scaled_sum += v * v;
  }
  const double scaled_eps = std::scalbn(eps, -2 * k);
  if (std::isfinite(scaled_eps)) {
    const double inv = 1.0 / std::sqrt(scaled_sum / count + scaled_eps);
    for (Index j = 0; j < n; ++j) {
      y[j] = round_to<TO>(std::scalbn(x[j], -k) * inv * static_cast<double>(gamma[j]));
    }
  } else {
    // ε exceeds every square by a factor of more than 1e307: RMS = sqrt(ε) to double precision.
    const double inv = 1.0 / std::sqrt(eps);
    for (Index j = 0; j < n; ++j) y[j] = round_to<TO>(x[j] * inv * static_cast<double>(gamma[j]));
  }
}

/// One row of RMSNorm. x and y are either the same row or do not overlap. Rows of float or of a
/// 16-bit type are widened to double: their squares are exact there and cannot overflow or
/// underflow (|x| ≤ 3.4e38 → x² ≤ 1.2e77; |x| ≥ 1.4e-45 → x² ≥ 2e-90), so one double pass is
/// exact up to the rounding of the sum, and the output is formed in double and rounded once.
/// `next` is the row after x (prefetched while y is written), or null.
template <class TX, class TG, class TO>
void rms_norm_row(const TX* x, const TG* gamma, double eps, TO* y, Index n, const TX* next) {
  const double count = static_cast<double>(n);
  if constexpr (!std::is_same_v<TX, double>) {
    rms_scale(x, gamma, 1.0 / std::sqrt(rms_sum_squares<double>(x, n) / count + eps), y, n, next);
  } else {
    const double mean_square = rms_sum_squares<double>(x, n) / count;
    // Common case: the sum is finite and RMS² ≥ 2^-900, so squares that underflowed (each off
    // by < 2^-1074) cannot matter and 1/RMS ≤ 2^450 cannot overflow. A NaN sum gives NaN rows.
    if (std::isnan(mean_square) || (std::isfinite(mean_square) && mean_square + eps >= 0x1p-900)) {
      rms_scale(x, gamma, 1.0 / std::sqrt(mean_square + eps), y, n, next);
    } else {
      rms_norm_row_rescaled(x, gamma, eps, y, n);
    }
  }
}

/// Whether two row-major views (first element, rows, columns, row stride, each of its own type)
/// share memory. Empty views share nothing.
template <class A, class B>
bool rms_ranges_overlap(const A* a, Index a_rows, Index a_cols, Index a_stride, const B* b,
                        Index b_rows, Index b_cols, Index b_stride) {
  if (a_rows == 0 || a_cols == 0 || b_rows == 0 || b_cols == 0) return false;
  const auto* a_begin = reinterpret_cast<const unsigned char*>(a);
  const auto* b_begin = reinterpret_cast<const unsigned char*>(b);
  const auto* a_end = reinterpret_cast<const unsigned char*>(a + (a_rows - 1) * a_stride + a_cols);
  const auto* b_end = reinterpret_cast<const unsigned char*>(b + (b_rows - 1) * b_stride + b_cols);
  const std::less<const unsigned char*> less;
  return less(a_begin, b_end) && less(b_begin, a_end);
}

}  // namespace detail

/// RMSNorm over the last dimension (§3.2):
///   out[t, :] = x[t, :] / sqrt(mean(x[t, :]²) + ε) · γ.
/// x: [tokens, d], gamma: [d] (any vector expression), out: [tokens, d] (a row-major matrix,
/// Map, Ref or block of one with contiguous rows, written in place). Each may have its own
/// storage type, float, double, Eigen::half or Eigen::bfloat16 (storage.hpp): for example
/// bfloat16 rows with a float γ written as float.
/// In place is allowed: out may be x itself (the same rows); any other overlap of out with x,
/// or of out with gamma, is rejected.
/// Accuracy: float and 16-bit rows accumulate the squares in double, so values near the float
/// maximum do not overflow and values near 1e-20 keep all their digits; the output is formed in
/// double and rounded once to out's type. Double rows whose squares would overflow or underflow
/// are rescaled by a power of two (exact) before squaring; ordinary rows take the plain two-pass
/// loop.
/// Allocates nothing when x is row-major with contiguous rows and gamma is a contiguous
/// vector (otherwise Eigen::Ref copies the input). Threads over rows (detail::parallel_for);
/// each row's result is independent of the thread count.
template <class Derived, class GammaDerived, class OutDerived>
void rms_norm(const Eigen::MatrixBase<Derived>& x, const Eigen::MatrixBase<GammaDerived>& gamma,
              const RmsNormParams& params, const Eigen::MatrixBase<OutDerived>& out_) {
  using TX = typename Derived::Scalar;
  using TG = typename GammaDerived::Scalar;
  using TO = typename OutDerived::Scalar;
  detail::require_storage_type<TX>();
  detail::require_storage_type<TG>();
  detail::require_storage_type<TO>();
  static_assert(GammaDerived::IsVectorAtCompileTime, "[rms_norm] gamma must be a vector");
  // The output is written through a Ref to its storage (Eigen's idiom for output parameters
  // that may be temporaries, such as blocks and maps).
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TX> xr(x.derived());
  const Index tokens = xr.rows();
  const Index d = xr.cols();
  APEX_CHECK(std::isfinite(params.eps) && params.eps > 0.0,
             "[rms_norm] eps (" << params.eps << ") must be positive and finite");
  APEX_CHECK(gamma.size() == d,
             "[rms_norm] gamma length (" << gamma.size() << ") must equal d (" << d << ")");
  APEX_CHECK(out.rows() == tokens && out.cols() == d,
             "[rms_norm] out (" << out.rows() << " x " << out.cols() << ") must be " << tokens
                                << " x " << d << " like x");
  const ConstVectorRef<TG> g(gamma.derived());

  bool in_place = false;
  if constexpr (std::is_same_v<TX, TO>) {
    in_place = out.data() == xr.data() && out.outerStride() == xr.outerStride();
  }
  APEX_CHECK(in_place || !detail::rms_ranges_overlap(xr.data(), tokens, d, xr.outerStride(),
                                                     out.data(), tokens, d, out.outerStride()),
             "[rms_norm] out must either be x itself (in place) or not overlap x");
  APEX_CHECK(
      !detail::rms_ranges_overlap(g.data(), 1, d, d, out.data(), tokens, d, out.outerStride()),
      "[rms_norm] gamma must not overlap out");

  // Below ~32K elements a parallel region costs more than it saves.
  const Index min_parallel_rows = std::max<Index>(2, (Index{1} << 15) / std::max<Index>(d, 1));
  const double eps = params.eps;
  detail::parallel_for(
      tokens,
      [&](Index t) {
        const TX* row = xr.data() + t * xr.outerStride();
        detail::rms_norm_row(row, g.data(), eps, out.data() + t * out.outerStride(), d,
                             t + 1 < tokens ? row + xr.outerStride() : nullptr);
      },
      min_parallel_rows);
}

/// RMSNorm (§3.2) returning a new [tokens, d] matrix of x's type; see the overload above.
template <class Derived, class GammaDerived>
RowMatrix<typename Derived::Scalar> rms_norm(const Eigen::MatrixBase<Derived>& x,
                                             const Eigen::MatrixBase<GammaDerived>& gamma,
                                             const RmsNormParams& params = {}) {
  using Scalar = typename Derived::Scalar;
  detail::require_storage_type<Scalar>();
  RowMatrix<Scalar> out(x.rows(), x.cols());
  rms_norm(x, gamma, params, out);
  return out;
}

}  // namespace apex
