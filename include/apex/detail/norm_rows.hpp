// SPDX-License-Identifier: MIT
// The row kernels of the norms around attention (rms_norm.hpp, layer_norm.hpp): a row's
// statistics in double in a fixed order, the write pass out = z·γ' + β rounded once, the
// rescaled path of double rows whose squares overflow or underflow, the fused residual add, and
// the threaded loop over rows. Users include the public headers, not this one.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

namespace apex {

namespace detail {

/// Σ term(j) for j in [0, n), accumulated in Acc. Sixteen independent partial sums give the
/// compiler independent vector accumulators without reassociating one long sum (which it may
/// not do without -ffast-math), and fix the order of additions so that the result does not
/// depend on which thread computes the row.
template <class Acc, class Term>
Acc lane_sum(Index n, const Term& term) {
  constexpr Index kLanes = 16;
  Acc partial[kLanes] = {};
  Index j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (Index l = 0; l < kLanes; ++l) partial[l] += term(j + l);
  }
  for (Index l = 0; l < kLanes && j + l < n; ++l) partial[l] += term(j + l);
  for (Index width = kLanes / 2; width > 0; width /= 2) {
    for (Index l = 0; l < width; ++l) partial[l] += partial[l + width];
  }
  return partial[0];
}

/// Sum of squares of x[0 .. n), accumulated in Acc (lane_sum's order).
template <class Acc, class Scalar>
Acc rms_sum_squares(const Scalar* x, Index n) {
  return lane_sum<Acc>(n, [x](Index j) {
    const Acc v = static_cast<Acc>(x[j]);
    return v * v;
  });
}

/// Elements of T in one block of a row's write pass (4 cache lines), and in one cache line.
template <class T>
constexpr Index kNormBlock = 256 / static_cast<Index>(sizeof(T));
template <class T>
constexpr Index kNormLine = 64 / static_cast<Index>(sizeof(T));

/// Asks for the cache lines of row[begin .. end) (nothing when row is null).
template <class T>
APEX_ALWAYS_INLINE void prefetch_elements(const T* row, Index begin, Index end) {
  if (row == nullptr) return;
  for (Index j = begin; j < end; j += kNormLine<T>) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(row + j);  // measured faster here than Eigen's _mm_prefetch
#else
    Eigen::internal::prefetch(row + j);
#endif
  }
}

/// The rows that the next row's first pass reads (one for a norm, x and residual for a fused
/// add + norm; null when there is none). A row's write pass asks for them a block at a time,
/// so that reading them overlaps the writes instead of following them (RMSNorm 4096 × 4096 in
/// float, 2 threads, Intel Xeon: 0.72 → 1.16 of BM_StreamCopy's bandwidth).
template <class TA, class TB = TA>
struct NextRows {
  const TA* a = nullptr;
  const TB* b = nullptr;
  APEX_ALWAYS_INLINE void prefetch(Index begin, Index end) const {
    prefetch_elements(a, begin, end);
    prefetch_elements(b, begin, end);
  }
};

/// What multiplies the normalised value: nothing, γ or 1 + γ.
enum class NormScale { kNone, kGamma, kOnePlusGamma };

/// The formula of a norm's write, as compile-time flags:
///   z = (x − mean) · inv   (Centered: LayerNorm)   or   z = x · inv   (RMSNorm),
///   out = z · γ' + β       (γ' per Scale; β added when Shift).
template <bool Centered, NormScale Scale, bool Shift>
struct NormForm {
  static constexpr bool kCentered = Centered;
  static constexpr NormScale kScale = Scale;
  static constexpr bool kShift = Shift;
};

/// out = z · γ'[j] + β[j] in double, per Form (g or b unused, and may be null, when unset).
template <class Form, class TG, class TB>
APEX_ALWAYS_INLINE double norm_affine(double z, const TG* g, const TB* b, Index j) {
  double v = z;
  if constexpr (Form::kScale == NormScale::kGamma) v = z * static_cast<double>(g[j]);
  if constexpr (Form::kScale == NormScale::kOnePlusGamma) {
    v = z * (1.0 + static_cast<double>(g[j]));
  }
  if constexpr (Form::kShift) v += static_cast<double>(b[j]);
  return v;
}

/// z_j of one element (NormForm), in double.
template <class Form, class T>
APEX_ALWAYS_INLINE double norm_z(T x, double mean, double inv) {
  if constexpr (Form::kCentered) {
    return (static_cast<double>(x) - mean) * inv;
  } else {
    return static_cast<double>(x) * inv;
  }
}

/// y[j] = norm_affine(norm_z(x[j])) formed in double and rounded once to the output type
/// (round_to), prefetching `next`. Separate versions for distinct and identical input/output
/// rows let the compiler vectorise both without run-time alias checks (γ and β never overlap
/// the output: the public functions check it).
template <class Form, class TX, class TG, class TB, class TO, class Next>
void norm_write_row(const TX* __restrict x, const TG* __restrict g, const TB* __restrict b,
                    double mean, double inv, TO* __restrict y, Index n, const Next& next) {
  for (Index j0 = 0; j0 < n; j0 += kNormBlock<TX>) {
    const Index end = std::min(n, j0 + kNormBlock<TX>);
    next.prefetch(j0, end);
    for (Index j = j0; j < end; ++j) {
      y[j] = round_to<TO>(norm_affine<Form>(norm_z<Form>(x[j], mean, inv), g, b, j));
    }
  }
}

template <class Form, class TG, class TB, class TO, class Next>
void norm_write_row_in_place(const TG* __restrict g, const TB* __restrict b, double mean,
                             double inv, TO* __restrict y, Index n, const Next& next) {
  for (Index j0 = 0; j0 < n; j0 += kNormBlock<TO>) {
    const Index end = std::min(n, j0 + kNormBlock<TO>);
    next.prefetch(j0, end);
    for (Index j = j0; j < end; ++j) {
      y[j] = round_to<TO>(norm_affine<Form>(norm_z<Form>(y[j], mean, inv), g, b, j));
    }
  }
}

/// The write pass, in place when x and y are the same row.
template <class Form, class TX, class TG, class TB, class TO, class Next>
void norm_write(const TX* x, const TG* g, const TB* b, double mean, double inv, TO* y, Index n,
                const Next& next) {
  if constexpr (std::is_same_v<TX, TO>) {
    if (x == y) {
      norm_write_row_in_place<Form>(g, b, mean, inv, y, n, next);
      return;
    }
  }
  norm_write_row<Form>(x, g, b, mean, inv, y, n, next);
}

/// A row's mean (0 when not centred) and mean square about it, in double, in a fixed order.
/// LayerNorm's is taken about x[0] (so that a constant row has exactly its value as mean, and a
/// large common offset cancels before it is summed), biased (divided by n, as PyTorch's
/// LayerNorm): one pass for float and 16-bit rows, two (mean, then squared deviations) for
/// double rows, whose result must carry double's precision.
struct NormStats {
  double mean = 0.0;
  double var = 0.0;
};

/// Σ(x − c) and Σ(x − c)² of x[0 .. n), in lane_sum's order, in one pass (two arrays of
/// partial sums, so that both vectorise).
struct ShiftedMoments {
  double sum = 0.0;
  double squares = 0.0;
};

template <class TX>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (row, length, shift), one caller
ShiftedMoments shifted_moments(const TX* x, Index n, double shift) {
  constexpr Index kLanes = 16;
  double sum[kLanes] = {};
  double squares[kLanes] = {};
  const auto add = [&](Index j, Index l) {
    const double d = static_cast<double>(x[j + l]) - shift;
    sum[l] += d;
    squares[l] += d * d;
  };
  Index j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (Index l = 0; l < kLanes; ++l) add(j, l);
  }
  for (Index l = 0; l < kLanes && j + l < n; ++l) add(j, l);
  for (Index width = kLanes / 2; width > 0; width /= 2) {
    for (Index l = 0; l < width; ++l) {
      sum[l] += sum[l + width];
      squares[l] += squares[l + width];
    }
  }
  return {sum[0], squares[0]};
}

template <bool kCentered, class TX>
NormStats norm_stats(const TX* x, Index n) {
  const double count = static_cast<double>(n);
  if constexpr (!kCentered) {
    return {0.0, rms_sum_squares<double>(x, n) / count};
  } else {
    const double shift = static_cast<double>(x[0]);
    if constexpr (!std::is_same_v<TX, double>) {
      // Float and 16-bit rows: one pass, var = mean(d²) − mean(d)², d = x − x[0]. Its relative
      // error is about ε_double · mean(d²)/var ≤ ε_double · n (x[0] is one of the row's values,
      // so (x[0] − μ)² ≤ n·var), far below float's ε for any row length apex sees.
      const ShiftedMoments m = shifted_moments(x, n, shift);
      const double offset = m.sum / count;
      const double var = m.squares / count - offset * offset;
      // Rounding can leave a tiny negative for a (nearly) constant row; a NaN (from ∞ − ∞ or a
      // NaN in the row) stays NaN, so the whole row is NaN as with two passes.
      return {shift + offset, var < 0.0 ? 0.0 : var};
    } else {
      // Double rows: two passes (the mean about x[0], then the squared deviations from it).
      const double offset =
          lane_sum<double>(n, [&](Index j) { return static_cast<double>(x[j]) - shift; });
      const double mean = shift + offset / count;
      const double squares = lane_sum<double>(n, [&](Index j) {
        const double dev = static_cast<double>(x[j]) - mean;
        return dev * dev;
      });
      return {mean, squares / count};
    }
  }
}

/// How norm_row_rescaled treats a double row: scaled (RowScaling), as written (zeros,
/// infinities, NaNs: the formula gives 0, or NaN as any implementation of x / RMS(x) or of
/// (x − mean) / σ would), or, centred, constant (x − mean = 0: out = β).
enum class RowKind { kScaled, kAsWritten, kConstant };

/// u_j = x_j·2^-k, where 2^k is the binade of max|x| (exact, |u| < 2), so that no sum overflows;
/// a centred row's deviations from the mean of u are scaled again by 2^-m, the binade of their
/// maximum, so that every scaled deviation e has |e| < 2 and the largest is in [1, 2).
struct RowScaling {
  int k = 0;
  double mean = 0.0;  // of u; 0 when not centred
  int m = 0;
};

template <bool kCentered>
RowKind row_scaling(const double* x, Index n, RowScaling& s) {
  double max_abs = 0.0;
  bool has_nan = false;
  for (Index j = 0; j < n; ++j) {
    has_nan = has_nan || std::isnan(x[j]);
    max_abs = std::max(max_abs, std::abs(x[j]));
  }
  if (has_nan || !(max_abs > 0.0) || !std::isfinite(max_abs)) return RowKind::kAsWritten;
  s.k = std::ilogb(max_abs);
  if constexpr (kCentered) {
    const double shift = std::scalbn(x[0], -s.k);
    const double offset =
        lane_sum<double>(n, [&](Index j) { return std::scalbn(x[j], -s.k) - shift; });
    s.mean = shift + offset / static_cast<double>(n);
    double max_dev = 0.0;
    for (Index j = 0; j < n; ++j) {
      max_dev = std::max(max_dev, std::abs(std::scalbn(x[j], -s.k) - s.mean));
    }
    if (max_dev == 0.0) return RowKind::kConstant;
    s.m = std::ilogb(max_dev);
  }
  return RowKind::kScaled;
}

/// Double rows whose statistics overflow (|x| ≳ 1e154) or whose mean square (about the mean,
/// for LayerNorm) and ε are both so small that squares lose digits to underflow. With the
/// scaled deviations e of RowScaling (e = u for RMSNorm):
///   var = 2^(2(k+m)) · mean(e²),   z = e / sqrt(mean(e²) + ε·2^(-2(k+m))).
/// Slower (scalbn per element, extra passes) but only taken for such rows.
template <class Form, class TG, class TB, class TO>
void norm_row_rescaled(const double* x, const TG* g, const TB* b, double eps, TO* y, Index n) {
  RowScaling s;
  const RowKind kind = row_scaling<Form::kCentered>(x, n, s);
  if (kind == RowKind::kAsWritten) {
    const NormStats stats = norm_stats<Form::kCentered>(x, n);
    norm_write<Form>(x, g, b, stats.mean, 1.0 / std::sqrt(stats.var + eps), y, n,
                     NextRows<double>{});
    return;
  }
  if (kind == RowKind::kConstant) {  // ε·2^(-2(k+m)) below could underflow to 0 here
    for (Index j = 0; j < n; ++j) y[j] = round_to<TO>(norm_affine<Form>(0.0, g, b, j));
    return;
  }
  const auto scaled = [&](Index j) {
    if constexpr (Form::kCentered) {
      return std::scalbn(std::scalbn(x[j], -s.k) - s.mean, -s.m);
    } else {
      return std::scalbn(x[j], -s.k);
    }
  };
  double scaled_sum = 0.0;
  for (Index j = 0; j < n; ++j) {
    const double v = scaled(j);
    scaled_sum += v * v;
  }
  const double scaled_eps = std::scalbn(eps, -2 * (s.k + s.m));
  if (std::isfinite(scaled_eps)) {
    const double inv = 1.0 / std::sqrt(scaled_sum / static_cast<double>(n) + scaled_eps);
    for (Index j = 0; j < n; ++j) y[j] = round_to<TO>(norm_affine<Form>(scaled(j) * inv, g, b, j));
  } else {
    // ε exceeds every square by a factor of more than 1e307: σ = sqrt(ε) to double precision.
    const double inv = 1.0 / std::sqrt(eps);
    for (Index j = 0; j < n; ++j) {
      const double dev = Form::kCentered ? std::scalbn(scaled(j), s.k + s.m) : x[j];
      y[j] = round_to<TO>(norm_affine<Form>(dev * inv, g, b, j));
    }
  }
}

/// One row of a norm (Form): x[0 .. n) → y[0 .. n). x and y are either the same row or do not
/// overlap. Rows of float or of a 16-bit type are widened to double: their squares (and their
/// deviations' squares) are exact there, or nearly, and can neither overflow nor underflow
/// (|x| ≤ 3.4e38 → x² ≤ 1.2e77; a nonzero deviation of a float from a double mean exceeds
/// 2^-180), so the plain passes are exact up to the rounding of the sums, and the output is
/// formed in double and rounded once. `next` is prefetched while y is written.
template <class Form, class TX, class TG, class TB, class TO, class Next>
void norm_row(const TX* x, const TG* g, const TB* b, double eps, TO* y, Index n, const Next& next) {
  if (n == 0) return;
  const NormStats s = norm_stats<Form::kCentered>(x, n);
  if constexpr (std::is_same_v<TX, double>) {
    // Common case: the statistics are finite and var + ε ≥ 2^-900, so squares that underflowed
    // (each off by < 2^-1074) cannot matter and 1/σ ≤ 2^450 cannot overflow. Otherwise
    // (including NaN, which may come from overflow as well as from a NaN input) rescale.
    if (!(std::isfinite(s.var) && s.var + eps >= 0x1p-900)) {
      norm_row_rescaled<Form>(x, g, b, eps, y, n);
      return;
    }
  }
  norm_write<Form>(x, g, b, s.mean, 1.0 / std::sqrt(s.var + eps), y, n, next);
}

/// Below ~32K elements a parallel region costs more than it saves.
inline Index norm_min_parallel_rows(Index d) {
  return std::max<Index>(2, (Index{1} << 15) / std::max<Index>(d, 1));
}

/// Calls row(t, y) for every row t of x, y = out.data() + t · out's row stride, threaded over
/// rows (norm_min_parallel_rows): the loop of norm_rows and add_norm_rows.
template <class TX, class TO, class Row>
void for_each_norm_row(const ConstRowRef<TX>& x, RowRef<TO>& out, const Row& row) {
  parallel_for(
      x.rows(), [&](Index t) { row(t, out.data() + t * out.outerStride()); },
      norm_min_parallel_rows(x.cols()));
}

/// out = norm(x) row by row (Form), threaded over rows. g and b as norm_affine.
template <class Form, class TX, class TG, class TB, class TO>
void norm_rows(const ConstRowRef<TX>& x, const TG* g, const TB* b, double eps, RowRef<TO>& out) {
  for_each_norm_row(x, out, [&](Index t, TO* y) {
    const TX* row = x.data() + t * x.outerStride();
    const NextRows<TX> next{t + 1 < x.rows() ? row + x.outerStride() : nullptr};
    norm_row<Form>(row, g, b, eps, y, x.cols(), next);
  });
}

/// r[j] ← r[j] + x[j], rounded once to TR. For one storage type this is what `r += x` computes
/// (float and double add in their own type; Eigen adds half and bfloat16 in float and rounds
/// the sum once, and float's 24 bits are at least 2p + 2 for p = 11 and 8, so that rounding twice
/// is innocuous: the sum is the correctly rounded one); for mixed types the sum is formed in
/// double and rounded once (round_to).
template <class TX, class TR>
void add_row(const TX* __restrict x, TR* __restrict r, Index n) {
  using Acc = std::conditional_t<std::is_same_v<TX, TR>, compute_t<TR>, double>;
  for (Index j = 0; j < n; ++j) {
    r[j] = round_to<TR>(static_cast<Acc>(static_cast<Acc>(r[j]) + static_cast<Acc>(x[j])));
  }
}

/// residual ← residual + x, then out = norm(residual) row by row, threaded over rows: each row
/// is added, then normalised from the rounded sum while it is in cache, so that the result is
/// bit for bit that of the two steps and memory is crossed once (read x and residual, write
/// residual and out).
template <class Form, class TX, class TR, class TG, class TB, class TO>
void add_norm_rows(const ConstRowRef<TX>& x, RowRef<TR>& residual, const TG* g, const TB* b,
                   double eps, RowRef<TO>& out) {
  for_each_norm_row(x, out, [&](Index t, TO* y) {
    const TX* x_row = x.data() + t * x.outerStride();
    TR* r_row = residual.data() + t * residual.outerStride();
    add_row(x_row, r_row, x.cols());
    const bool last = t + 1 == x.rows();
    const NextRows<TX, TR> next{last ? nullptr : x_row + x.outerStride(),
                                last ? nullptr : r_row + residual.outerStride()};
    norm_row<Form>(static_cast<const TR*>(r_row), g, b, eps, y, x.cols(), next);
  });
}

// ---- Checks shared by the norms (rms_norm, add_rms_norm, layer_norm, add_layer_norm) ----

/// The bytes of a row-major view (first element, rows, columns, row stride); empty for an
/// empty view.
struct ByteSpan {
  const unsigned char* begin = nullptr;
  const unsigned char* end = nullptr;
};

template <class T>
ByteSpan rows_span(const T* data, Index rows, Index cols, Index stride) {
  if (rows == 0 || cols == 0) return {};
  return {reinterpret_cast<const unsigned char*>(data),
          reinterpret_cast<const unsigned char*>(data + (rows - 1) * stride + cols)};
}

/// A RowRef's bytes, and a contiguous vector's.
template <class M>
ByteSpan matrix_span(const M& m) {
  return rows_span(m.data(), m.rows(), m.cols(), m.outerStride());
}
template <class V>
ByteSpan vector_span(const V& v) {
  return rows_span(v.data(), 1, v.size(), v.size());
}

/// Whether two spans share memory. Empty spans share nothing.
inline bool spans_overlap(ByteSpan a, ByteSpan b) {
  if (a.begin == a.end || b.begin == b.end) return false;
  const std::less<const unsigned char*> less;
  return less(a.begin, b.end) && less(b.begin, a.end);
}

inline void check_norm_eps(const char* op, double eps) {
  APEX_CHECK(std::isfinite(eps) && eps > 0.0,
             "[" << op << "] eps (" << eps << ") must be positive and finite");
}

inline void check_norm_vector_length(const char* op, const char* name, Index size, Index d) {
  APEX_CHECK(size == d,
             "[" << op << "] " << name << " length (" << size << ") must equal d (" << d << ")");
}

/// A [tokens, d] view written by a norm (out, residual) must have x's shape.
template <class TX, class TW>
void check_norm_shape(const char* op, const char* name, const ConstRowRef<TX>& x,
                      const RowRef<TW>& w) {
  APEX_CHECK(w.rows() == x.rows() && w.cols() == x.cols(),
             "[" << op << "] " << name << " (" << w.rows() << " x " << w.cols() << ") must be "
                 << x.rows() << " x " << x.cols() << " like x");
}

/// out is x itself (the same rows, in place) or does not overlap it.
template <class TX, class TO>
void check_norm_out_vs_x(const char* op, const ConstRowRef<TX>& x, const RowRef<TO>& out) {
  bool in_place = false;
  if constexpr (std::is_same_v<TX, TO>) {
    in_place = out.data() == x.data() && out.outerStride() == x.outerStride();
  }
  APEX_CHECK(in_place || !spans_overlap(matrix_span(x), matrix_span(out)),
             "[" << op << "] out must either be x itself (in place) or not overlap x");
}

/// Two views that must not share memory (what is read and what is written).
inline void check_norm_disjoint(const char* op, const char* a_name, ByteSpan a, const char* b_name,
                                ByteSpan b) {
  APEX_CHECK(!spans_overlap(a, b), "[" << op << "] " << a_name << " must not overlap " << b_name);
}

/// The checks of the four norms, in one order, so that a call with several faults reports the
/// same one whichever norm it is: ε; the lengths of the parameter vectors; the shapes of residual
/// (the add_ norms; null for the others) and of out; out against x; residual against x and out;
/// the parameter vectors against out, then against residual. `vectors` checks its own
/// (RmsNormVectors, LayerNormVectors): check_lengths(op, d), check_disjoint(op, name, written).
/// Allocates nothing.
template <class Vectors, class TX, class TO, class TR = TO>
void check_norm_call(const char* op, double eps, const Vectors& vectors, const ConstRowRef<TX>& x,
                     const RowRef<TO>& out, const RowRef<TR>* residual = nullptr) {
  check_norm_eps(op, eps);
  vectors.check_lengths(op, x.cols());
  if (residual != nullptr) check_norm_shape(op, "residual", x, *residual);
  check_norm_shape(op, "out", x, out);
  check_norm_out_vs_x(op, x, out);
  const ByteSpan out_span = matrix_span(out);
  if (residual != nullptr) {
    const ByteSpan r_span = matrix_span(*residual);
    check_norm_disjoint(op, "residual", r_span, "x", matrix_span(x));
    check_norm_disjoint(op, "out", out_span, "residual", r_span);
  }
  vectors.check_disjoint(op, "out", out_span);
  if (residual != nullptr) vectors.check_disjoint(op, "residual", matrix_span(*residual));
}

/// require_storage_type of each of a norm's element types.
template <class... T>
constexpr void require_storage_types() {
  (require_storage_type<T>(), ...);
}

/// The value-returning overloads of the norms: a new [tokens, d] matrix of x's type, written by
/// write(out) (the overload that takes out).
template <class Derived, class Write>
RowMatrix<typename Derived::Scalar> new_norm_output(const Eigen::MatrixBase<Derived>& x,
                                                    const Write& write) {
  using Scalar = typename Derived::Scalar;
  require_storage_type<Scalar>();
  RowMatrix<Scalar> out(x.rows(), x.cols());
  write(out);
  return out;
}

}  // namespace detail

}  // namespace apex
