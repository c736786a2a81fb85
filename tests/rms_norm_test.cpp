// SPDX-License-Identifier: MIT
// Tests for §3: RMSNorm, against the long-double reference loop and the document's example;
// Gemma's (1 + γ) convention; the fused residual add + RMSNorm against the two steps it fuses.
#include <apex/rms_norm.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "finite_differences.hpp"
#include "reference/rms_norm.hpp"
#include "test_util.hpp"

namespace rms_norm_test {
namespace {

using apex::Index;
using apex::RmsNormParams;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

// Inputs x: uniform in [-2, 2).
template <class Scalar>
RowMatrix<Scalar> random_input(Index tokens, Index d, std::uint32_t seed) {
  return random_matrix<Scalar>(tokens, d, seed, -2.0, 2.0);
}

// γ: magnitudes uniform in [0.5, 1.5), every third one negative.
template <class Scalar>
Vector<Scalar> random_gamma(Index d, std::uint32_t seed) {
  Vector<Scalar> g = random_matrix<Scalar>(d, 1, seed, 0.5, 1.5);
  for (Index j = 0; j < d; j += 3) g(j) = -g(j);
  return g;
}

// Tolerance, relative to each reference element (outputs are compared element by element).
// float: the squares are summed in double and the output is formed in double and rounded
//   once, so each element is within half an ulp of the exact value; two ulps leave room for
//   the double-precision steps before the rounding.
// double: the sum of d squares has a relative error of at most d·u (here d ≤ 300, so about
//   3e-14), which reaches the output halved by the square root, plus a few roundings.
template <class Scalar>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kRel = 2 * std::numeric_limits<float>::epsilon();
};
template <>
struct Tolerance<double> {
  static constexpr double kRel = 1e-13;
};

template <class Scalar>
void expect_matches(const RowMatrix<Scalar>& actual, const RowMatrix<double>& expected) {
  apex::testing::expect_near_elementwise(actual, expected, Tolerance<Scalar>::kRel, 0.0);
}

template <class Scalar>
RowMatrix<double> reference(const RowMatrix<Scalar>& x, const Vector<Scalar>& gamma, double eps) {
  return apex::reference::rms_norm(x.template cast<double>(), gamma.template cast<double>(), eps);
}

TEST(RmsNorm, S3_4_WorkedExample) {
  RowMatrix<double> x(1, 4);
  x << 2.0, -1.0, 0.5, 1.5;
  const Vector<double> gamma = Vector<double>::Ones(4);
  const RowMatrix<double> out = apex::rms_norm(x, gamma);  // ε = 1e-6 by default

  // The values §3.4 prints, to its four decimals.
  const double printed[] = {1.4606, -0.7303, 0.3651, 1.0954};
  for (Index j = 0; j < 4; ++j) EXPECT_NEAR(out(0, j), printed[j], 0.5e-4) << j;

  // The exact formula: mean(x²) = 7.5 / 4 = 1.875, RMS = √(1.875 + 1e-6).
  const double rms = std::sqrt(1.875 + 1e-6);
  for (Index j = 0; j < 4; ++j) {
    EXPECT_NEAR(out(0, j), x(0, j) / rms, 4 * std::numeric_limits<double>::epsilon()) << j;
  }
  // §3.4's check: mean(output²) ≈ 1 (exactly 1.875 / 1.875001).
  EXPECT_NEAR(out.squaredNorm() / 4, 1.875 / (1.875 + 1e-6), 1e-15);

  // And in float.
  const RowMatrix<float> out_f =
      apex::rms_norm(RowMatrix<float>(x.cast<float>()), Vector<float>(Vector<float>::Ones(4)));
  for (Index j = 0; j < 4; ++j) {
    EXPECT_FLOAT_EQ(out_f(0, j), static_cast<float>(x(0, j) / rms)) << j;
  }
}

template <class Scalar>
class RmsNormTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RmsNormTyped, Scalars, apex::testing::ScalarName);

struct Shape {
  Index tokens, d;
};
// Single rows, widths that are not multiples of the 16-wide accumulation, and enough rows to
// be split over threads.
const Shape kShapes[] = {{1, 1},   {1, 7},    {1, 16},  {3, 13},    {2, 17},
                         {17, 33}, {64, 100}, {5, 255}, {300, 129}, {1, 300}};

TYPED_TEST(RmsNormTyped, MeanSquareOfOutputIsOneUpToEps) {
  using Scalar = TypeParam;
  // With γ = 1, mean(out²) = ms / (ms + ε) where ms = mean(x²): 1 up to ε/ms.
  for (const double eps : {1e-6, 1e-2}) {
    const RowMatrix<Scalar> x = random_input<Scalar>(20, 96, 1);
    const RowMatrix<Scalar> out =
        apex::rms_norm(x, Vector<Scalar>(Vector<Scalar>::Ones(96)), RmsNormParams{eps});
    for (Index t = 0; t < x.rows(); ++t) {
      const double ms = x.row(t).template cast<double>().squaredNorm() / 96.0;
      const double out_ms = out.row(t).template cast<double>().squaredNorm() / 96.0;
      EXPECT_NEAR(out_ms, ms / (ms + eps), 8 * Tolerance<Scalar>::kRel) << "row " << t;
      EXPECT_GT(std::abs(1.0 - out_ms), 0.1 * eps / ms) << "ε must lower the mean square";
    }
  }
}

TYPED_TEST(RmsNormTyped, MatchesReferenceOnRandomShapes) {
  using Scalar = TypeParam;
  std::uint32_t seed = 10;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    const RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, ++seed);
    const Vector<Scalar> ones = Vector<Scalar>::Ones(s.d);
    const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, ++seed);
    expect_matches<Scalar>(apex::rms_norm(x, ones), reference(x, ones, 1e-6));
    RowMatrix<Scalar> out(s.tokens, s.d);
    apex::rms_norm(x, gamma, RmsNormParams{0.25}, out);
    expect_matches<Scalar>(out, reference(x, gamma, 0.25));
  }
}

TYPED_TEST(RmsNormTyped, InPlace) {
  using Scalar = TypeParam;
  std::uint32_t seed = 40;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, ++seed);
    const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, ++seed);
    const RowMatrix<double> expected = reference(x, gamma, 1e-6);
    const RowMatrix<Scalar> out_of_place = apex::rms_norm(x, gamma);
    apex::rms_norm(x, gamma, {}, x);
    expect_matches<Scalar>(x, expected);
    EXPECT_EQ(x, out_of_place) << "in place must give the same bits as out of place";
  }
}

TYPED_TEST(RmsNormTyped, InPlaceOnAColumnBlock) {
  using Scalar = TypeParam;
  // Normalise the middle 37 features of wider rows in place; the rest must be untouched.
  RowMatrix<Scalar> wide = random_input<Scalar>(9, 50, 60);
  const RowMatrix<Scalar> before = wide;
  const Vector<Scalar> gamma = random_gamma<Scalar>(37, 61);
  auto block = wide.middleCols(5, 37);
  apex::rms_norm(block, gamma, {}, block);
  expect_matches<Scalar>(RowMatrix<Scalar>(wide.middleCols(5, 37)),
                         reference(RowMatrix<Scalar>(before.middleCols(5, 37)), gamma, 1e-6));
  EXPECT_EQ(wide.leftCols(5), before.leftCols(5));
  EXPECT_EQ(wide.rightCols(8), before.rightCols(8));
}

TYPED_TEST(RmsNormTyped, AcceptsColumnMajorInputAndGammaExpressions) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = random_input<Scalar>(6, 21, 70);
  const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> x_col = x;
  const Eigen::Matrix<Scalar, 1, Eigen::Dynamic> gamma_row = random_gamma<Scalar>(21, 71);
  const Vector<Scalar> gamma = gamma_row.transpose();
  const RowMatrix<Scalar> expected = apex::rms_norm(x, gamma);
  EXPECT_EQ(apex::rms_norm(x_col, gamma), expected);
  EXPECT_EQ(apex::rms_norm(x, gamma_row), expected);
  EXPECT_EQ(apex::rms_norm(x, gamma_row * Scalar(2)), apex::rms_norm(x, Vector<Scalar>(gamma * 2)));
  // A row of a row-major matrix as γ.
  RowMatrix<Scalar> gammas(2, 21);
  gammas.row(0).setZero();
  gammas.row(1) = gamma_row;
  EXPECT_EQ(apex::rms_norm(x, gammas.row(1)), expected);
}

TYPED_TEST(RmsNormTyped, RowsAreIndependentOfBatching) {
  using Scalar = TypeParam;
  // Many rows run on several threads; each row must give exactly what it gives alone.
  const RowMatrix<Scalar> x = random_input<Scalar>(257, 200, 80);
  const Vector<Scalar> gamma = random_gamma<Scalar>(200, 81);
  const RowMatrix<Scalar> all = apex::rms_norm(x, gamma);
  for (Index t = 0; t < x.rows(); t += 17) {
    const RowMatrix<Scalar> one = apex::rms_norm(x.row(t), gamma);
    ASSERT_EQ(one, all.row(t)) << "row " << t;
  }
}

TYPED_TEST(RmsNormTyped, ZeroRowGivesZeros) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = RowMatrix<Scalar>::Zero(2, 9);
  const RowMatrix<Scalar> out = apex::rms_norm(x, random_gamma<Scalar>(9, 90));
  EXPECT_TRUE((out.array() == Scalar(0)).all());
}

TYPED_TEST(RmsNormTyped, RejectsBadInputBeforeWriting) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = random_input<Scalar>(3, 5, 100);
  const Vector<Scalar> gamma = Vector<Scalar>::Ones(5);
  RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(3, 5, Scalar(-7));
  const auto untouched = [&] { return (out.array() == Scalar(-7)).all(); };

  expect_invalid([&] { apex::rms_norm(x, gamma, RmsNormParams{0.0}, out); },
                 {"[rms_norm] eps (0)", "positive"});
  expect_invalid([&] { apex::rms_norm(x, gamma, RmsNormParams{-1e-6}, out); },
                 {"[rms_norm] eps (-1e-06)"});
  expect_invalid(
      [&] {
        apex::rms_norm(x, gamma, RmsNormParams{std::numeric_limits<double>::infinity()}, out);
      },
      {"[rms_norm] eps (inf)", "finite"});
  expect_invalid(
      [&] {
        apex::rms_norm(x, gamma, RmsNormParams{std::numeric_limits<double>::quiet_NaN()}, out);
      },
      {"[rms_norm] eps (nan)"});
  EXPECT_TRUE(untouched());

  const Vector<Scalar> short_gamma = Vector<Scalar>::Ones(4);
  expect_invalid([&] { apex::rms_norm(x, short_gamma, {}, out); },
                 {"[rms_norm] gamma length (4)", "d (5)"});
  EXPECT_TRUE(untouched());

  RowMatrix<Scalar> wrong_rows = RowMatrix<Scalar>::Constant(2, 5, Scalar(-7));
  expect_invalid([&] { apex::rms_norm(x, gamma, {}, wrong_rows); },
                 {"[rms_norm] out (2 x 5)", "3 x 5"});
  EXPECT_TRUE((wrong_rows.array() == Scalar(-7)).all());
  RowMatrix<Scalar> wrong_cols = RowMatrix<Scalar>::Constant(3, 6, Scalar(-7));
  expect_invalid([&] { apex::rms_norm(x, gamma, {}, wrong_cols); },
                 {"[rms_norm] out (3 x 6)", "3 x 5"});
  EXPECT_TRUE((wrong_cols.array() == Scalar(-7)).all());
}

TYPED_TEST(RmsNormTyped, RejectsPartialOverlap) {
  using Scalar = TypeParam;
  RowMatrix<Scalar> buffer = random_input<Scalar>(4, 6, 110);
  const RowMatrix<Scalar> before = buffer;
  const Vector<Scalar> gamma = Vector<Scalar>::Ones(5);
  // x = columns 0..4, out = columns 1..5 of the same rows: overlapping but not identical.
  expect_invalid([&] { apex::rms_norm(buffer.leftCols(5), gamma, {}, buffer.rightCols(5)); },
                 {"[rms_norm] out must either be x itself"});
  // γ inside the output.
  RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(4, 5, Scalar(-7));
  expect_invalid([&] { apex::rms_norm(buffer.leftCols(5), out.row(2), {}, out); },
                 {"[rms_norm] gamma must not overlap out"});
  EXPECT_EQ(buffer, before);
  EXPECT_TRUE((out.array() == Scalar(-7)).all());
}

// Extremes. A row c·v with c a power of two has the exact answer v / sqrt(mean(v²) + ε/c²),
// whatever c is; v = [2, -1, 0.5, 1.5] (the §3.4 row) has mean(v²) = 1.875.

TEST(RmsNorm, FloatNearTheMaximumDoesNotOverflow) {
  RowMatrix<float> x(2, 4);
  x << 3e38f, -3e38f, 1e38f, 2e38f,               //
      0x1p126f, -0x1p125f, 0x1p124f, 0x1.8p125f;  // 2^125 · [2, -1, 0.5, 1.5]
  const Vector<float> gamma = Vector<float>::Ones(4);
  const RowMatrix<float> out = apex::rms_norm(x, gamma);
  ASSERT_TRUE(out.allFinite());
  expect_matches<float>(out, reference(x, gamma, 1e-6));
  const float v[] = {2.0f, -1.0f, 0.5f, 1.5f};
  for (Index j = 0; j < 4; ++j) {
    EXPECT_FLOAT_EQ(out(1, j), static_cast<float>(v[j] / std::sqrt(1.875))) << j;
  }
}

TEST(RmsNorm, FloatNear1e20KeepsItsDigits) {
  // x² ≈ 1e-40 is a float denormal with only ~3 significant digits; a float accumulation
  // would be off by ~1e-3 relative. ε is chosen below x² so that the squares matter.
  RowMatrix<float> x(2, 5);
  x << 1e-20f, -2.5e-20f, 3.3e-20f, 0.7e-20f, -1.9e-20f,  //
      1.3e-20f, 2.1e-20f, -0.9e-20f, 1.7e-20f, 3.1e-20f;
  const Vector<float> gamma = random_gamma<float>(5, 120);
  for (const double eps : {1e-45, 1e-41, 1e-6}) {
    SCOPED_TRACE(eps);
    expect_matches<float>(apex::rms_norm(x, gamma, RmsNormParams{eps}), reference(x, gamma, eps));
  }
}

TEST(RmsNorm, DoubleSquaresThatOverflow) {
  // 2^1000 · v: the squares (~2^2002) overflow double; ε/c² vanishes.
  RowMatrix<double> x(1, 4);
  x << 0x1p1001, -0x1p1000, 0x1p999, 0x1.8p1000;
  const RowMatrix<double> out = apex::rms_norm(x, Vector<double>(Vector<double>::Ones(4)));
  const double v[] = {2.0, -1.0, 0.5, 1.5};
  for (Index j = 0; j < 4; ++j) EXPECT_DOUBLE_EQ(out(0, j), v[j] / std::sqrt(1.875)) << j;

  // Near the double maximum, with γ ≠ 1.
  RowMatrix<double> big(1, 3);
  big << 1.7e308, -1.0e308, 3.0e307;
  Vector<double> gamma(3);
  gamma << 0.5, 2.0, -1.0;
  const RowMatrix<double> out_big = apex::rms_norm(big, gamma);
  const double rms = 1e308 * std::sqrt((1.7 * 1.7 + 1.0 + 0.3 * 0.3) / 3.0);
  EXPECT_NEAR(out_big(0, 0), 1.7e308 / rms * 0.5, 1e-15);
  EXPECT_NEAR(out_big(0, 1), -1.0e308 / rms * 2.0, 1e-15);
  EXPECT_NEAR(out_big(0, 2), 3.0e307 / rms * -1.0, 1e-15);
}

TEST(RmsNorm, DoubleSquaresThatUnderflow) {
  // x = 2^-530 · v: the squares (~2^-1060) are denormals and keep only a few significant bits.
  // With ε = 2^-1074 (the smallest positive double) the exact answer is
  // v / sqrt(mean(v²) + 2^-1074 / 2^-1060) = v / sqrt(mean(v²) + 2^-14), computable in the
  // ordinary double range.
  const double v[] = {1.1, -0.7, 0.3, 1.9};
  RowMatrix<double> x(1, 4);
  double mean_v2 = 0.0;
  for (Index j = 0; j < 4; ++j) {
    x(0, j) = std::ldexp(v[j], -530);
    mean_v2 += v[j] * v[j] / 4;
  }
  const double eps = std::numeric_limits<double>::denorm_min();
  const RowMatrix<double> out =
      apex::rms_norm(x, Vector<double>(Vector<double>::Ones(4)), RmsNormParams{eps});
  for (Index j = 0; j < 4; ++j) {
    const double expected = v[j] / std::sqrt(mean_v2 + 0x1p-14);
    EXPECT_NEAR(out(0, j), expected, Tolerance<double>::kRel * std::abs(expected)) << j;
  }
  // Denormal inputs themselves, and a tiny ε that dominates: RMS = sqrt(ε).
  RowMatrix<double> tiny(1, 2);
  tiny << 4e-320, -1e-320;
  const RowMatrix<double> out_tiny =
      apex::rms_norm(tiny, Vector<double>(Vector<double>::Ones(2)), RmsNormParams{1e-300});
  EXPECT_NEAR(out_tiny(0, 0) / (4e-320 / 1e-150), 1.0, 1e-12);
  EXPECT_NEAR(out_tiny(0, 1) / (-1e-320 / 1e-150), 1.0, 1e-12);
}

TEST(RmsNorm, DoubleExtremesMatchTheLongDoubleReference) {
  if (!apex::reference::rms_reference_has_extended_range()) {
    GTEST_SKIP() << "long double has the range of double here";
  }
  RowMatrix<double> x(5, 6);
  x << 1e300, -3e299, 1e-300, 2e300, 0.0, -7e299,       // squares overflow
      1e-170, -3e-171, 2e-170, 5e-175, 0.0, 1.5e-170,   // squares underflow
      3e-160, 1e-300, -2e-161, 7e-320, 1e-162, 4e-160,  // mixed, with a denormal
      1.0, 1e-200, -1e200, 1e-300, 3.0, 1e100,          // one huge element
      0.1, 0.2, -0.3, 0.4, 0.5, -0.6;                   // ordinary
  const Vector<double> gamma = random_gamma<double>(6, 130);
  for (const double eps : {1e-6, 1e-320, 1e-200}) {
    SCOPED_TRACE(eps);
    const RowMatrix<double> out = apex::rms_norm(x, gamma, RmsNormParams{eps});
    ASSERT_TRUE(out.allFinite());
    expect_matches<double>(out, apex::reference::rms_norm(x, gamma, eps));
  }
}

TEST(RmsNorm, NonFiniteInputPropagates) {
  RowMatrix<double> x(2, 3);
  x << 1.0, std::numeric_limits<double>::quiet_NaN(), 2.0,  //
      1.0, 2.0, 3.0;
  const RowMatrix<double> out = apex::rms_norm(x, Vector<double>(Vector<double>::Ones(3)));
  EXPECT_TRUE(std::isnan(out(0, 0)));
  EXPECT_TRUE(out.row(1).allFinite()) << "a NaN in one row must not leak into another";
}

// ---------------------------------------------------------------------------------------------
// 16-bit rows (Eigen::half, Eigen::bfloat16): read as stored, computed in double, written in the
// caller's type
// ---------------------------------------------------------------------------------------------

template <class T>
class RmsNorm16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(RmsNorm16Bit, SixteenBit, apex::testing::ScalarName);

TYPED_TEST(RmsNorm16Bit, FloatOutputMatchesTheReferenceOnTheStoredValues) {
  using T = TypeParam;
  const RowMatrix<float> x = random_input<float>(37, 300, 71);
  const RowMatrix<T> x16 = x.cast<T>();
  const Vector<float> gamma = random_gamma<float>(300, 72);
  RowMatrix<float> out(37, 300);
  apex::rms_norm(x16, gamma, RmsNormParams{1e-6}, out);
  expect_matches<float>(out, reference<float>(x16.template cast<float>(), gamma, 1e-6));
}

// A 16-bit output is the double result rounded once: bit for bit round_to of the double output,
// in place or not, with a 16-bit γ too.
TYPED_TEST(RmsNorm16Bit, SixteenBitOutputIsTheDoubleResultRoundedOnce) {
  using T = TypeParam;
  const RowMatrix<T> x16 = random_input<float>(9, 130, 73).cast<T>();
  const Vector<T> gamma16 = random_gamma<float>(130, 74).cast<T>();
  RowMatrix<double> wide(9, 130);
  apex::rms_norm(x16, gamma16, RmsNormParams{}, wide);
  RowMatrix<T> out16(9, 130);
  apex::rms_norm(x16, gamma16, RmsNormParams{}, out16);
  RowMatrix<T> in_place = x16;
  apex::rms_norm(in_place, gamma16, RmsNormParams{}, in_place);
  for (Index r = 0; r < 9; ++r) {
    for (Index c = 0; c < 130; ++c) {
      const auto want = Eigen::numext::bit_cast<std::uint16_t>(apex::round_to<T>(wide(r, c)));
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(out16(r, c)), want) << r << ", " << c;
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(in_place(r, c)), want) << r << ", " << c;
    }
  }
  // The value-returning form keeps x's type.
  const RowMatrix<T> returned = apex::rms_norm(x16, gamma16);
  EXPECT_TRUE((returned.array() == out16.array()).all());
}

TYPED_TEST(RmsNorm16Bit, RejectsBadInputBeforeWriting) {
  using T = TypeParam;
  const RowMatrix<T> x16 = random_input<float>(3, 8, 75).cast<T>();
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 8, 7.0f);
  expect_invalid([&] { apex::rms_norm(x16, Vector<float>::Ones(7), RmsNormParams{}, out); },
                 {"[rms_norm] gamma length (7)"});
  expect_invalid([&] { apex::rms_norm(x16, Vector<float>::Ones(8), RmsNormParams{0.0}, out); },
                 {"[rms_norm] eps (0)"});
  EXPECT_TRUE((out.array() == 7.0f).all());
}

// ---------------------------------------------------------------------------------------------
// Gemma's convention, out = x / RMS(x) · (1 + γ) (RmsNormGamma::kOnePlusGamma)
// ---------------------------------------------------------------------------------------------

using apex::RmsNormGamma;

RmsNormParams one_plus_gamma(double eps = 1e-6) {
  RmsNormParams params;
  params.eps = eps;
  params.scale = RmsNormGamma::kOnePlusGamma;
  return params;
}

// The reference of the (1 + γ) form: the plain loop of reference/rms_norm.hpp with γ' = 1 + γ
// formed in double (exact for the γ drawn here, |γ| ≥ 0.5).
template <class Scalar, class G>
RowMatrix<double> reference_one_plus(const RowMatrix<Scalar>& x, const Vector<G>& gamma,
                                     double eps) {
  const Vector<double> g = gamma.template cast<double>().array() + 1.0;
  return apex::reference::rms_norm(x.template cast<double>(), g, eps);
}

// Whether two matrices hold the same bits (same shape, contiguous storage).
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  static_assert(std::is_same_v<typename A::Scalar, typename B::Scalar>);
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(typename A::Scalar) * std::size_t(a.size())) == 0;
}

TYPED_TEST(RmsNormTyped, OnePlusGammaMatchesReference) {
  using Scalar = TypeParam;
  std::uint32_t seed = 200;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    const RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, ++seed);
    const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, ++seed);
    RowMatrix<Scalar> out(s.tokens, s.d);
    apex::rms_norm(x, gamma, one_plus_gamma(0.25), out);
    expect_matches<Scalar>(out, reference_one_plus(x, gamma, 0.25));
    // In place gives the same bits.
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): the call writes it
    RowMatrix<Scalar> in_place = x;
    apex::rms_norm(in_place, gamma, one_plus_gamma(0.25), in_place);
    EXPECT_TRUE(same_bits(in_place, out));
  }
}

TYPED_TEST(RmsNormTyped, DefaultScaleIsGammaUnchanged) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = random_input<Scalar>(33, 70, 210);
  const Vector<Scalar> gamma = random_gamma<Scalar>(70, 211);
  RmsNormParams explicit_gamma;
  explicit_gamma.scale = RmsNormGamma::kGamma;
  const RowMatrix<Scalar> by_default = apex::rms_norm(x, gamma);
  EXPECT_TRUE(same_bits(apex::rms_norm(x, gamma, explicit_gamma), by_default));
  expect_matches<Scalar>(by_default, reference(x, gamma, 1e-6));
  // The two conventions differ by exactly one in γ: a zero γ under (1 + γ) is a unit γ.
  const Vector<Scalar> zeros = Vector<Scalar>::Zero(70);
  const Vector<Scalar> ones = Vector<Scalar>::Ones(70);
  EXPECT_TRUE(same_bits(apex::rms_norm(x, zeros, one_plus_gamma()), apex::rms_norm(x, ones)));
}

TYPED_TEST(RmsNorm16Bit, OnePlusGammaIsTheDoubleResultRoundedOnce) {
  using T = TypeParam;
  const RowMatrix<T> x16 = random_input<float>(11, 140, 220).cast<T>();
  const Vector<T> gamma16 = random_gamma<float>(140, 221).cast<T>();
  RowMatrix<double> wide(11, 140);
  apex::rms_norm(x16, gamma16, one_plus_gamma(), wide);
  expect_matches<double>(wide, reference_one_plus<T>(x16, gamma16, 1e-6));
  RowMatrix<T> out16(11, 140);
  apex::rms_norm(x16, gamma16, one_plus_gamma(), out16);
  for (Index r = 0; r < 11; ++r) {
    for (Index c = 0; c < 140; ++c) {
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(out16(r, c)),
                Eigen::numext::bit_cast<std::uint16_t>(apex::round_to<T>(wide(r, c))))
          << r << ", " << c;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fused residual add + RMSNorm (add_rms_norm) against `residual += x; rms_norm(residual)`
// ---------------------------------------------------------------------------------------------

template <class T>
class AddRmsNorm : public ::testing::Test {};
using AllStorage = ::testing::Types<float, double, Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(AddRmsNorm, AllStorage, apex::testing::ScalarName);

// x, residual and γ of one storage type T (drawn in float, then rounded to T).
template <class T>
struct AddCase {
  RowMatrix<T> x, residual;
  Vector<T> gamma;
  AddCase(Index tokens, Index d, std::uint32_t seed)
      : x(random_input<float>(tokens, d, seed).cast<T>()),
        residual(random_input<float>(tokens, d, seed + 1).cast<T>()),
        gamma(random_gamma<float>(d, seed + 2).cast<T>()) {}
};

TYPED_TEST(AddRmsNorm, EqualsAddThenNormBitForBit) {
  using T = TypeParam;
  std::uint32_t seed = 300;
  for (const Shape& s : kShapes) {
    for (const RmsNormParams& params : {RmsNormParams{}, one_plus_gamma(0.25)}) {
      SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
      const AddCase<T> c(s.tokens, s.d, seed += 3);
      RowMatrix<T> two_step_residual = c.residual;
      two_step_residual += c.x;  // Eigen's own addition, rounded to T
      RowMatrix<T> two_step(s.tokens, s.d);
      apex::rms_norm(two_step_residual, c.gamma, params, two_step);

      RowMatrix<T> residual = c.residual;
      RowMatrix<T> out(s.tokens, s.d);
      apex::add_rms_norm(c.x, residual, c.gamma, params, out);
      EXPECT_TRUE(same_bits(residual, two_step_residual)) << "updated residual";
      EXPECT_TRUE(same_bits(out, two_step)) << "normalised output";

      // In place: out is x.
      RowMatrix<T> x = c.x;
      residual = c.residual;
      apex::add_rms_norm(x, residual, c.gamma, params, x);
      EXPECT_TRUE(same_bits(residual, two_step_residual));
      EXPECT_TRUE(same_bits(x, two_step));
    }
  }
}

TYPED_TEST(AddRmsNorm, BlocksValueFormAndFloatOutput) {
  using T = TypeParam;
  // residual is a column block of a wider stream, out a float matrix; the rest is untouched.
  const AddCase<T> c(9, 37, 330);
  RowMatrix<T> stream = random_input<float>(9, 50, 333).cast<T>();
  stream.middleCols(5, 37) = c.residual;
  const RowMatrix<T> before = stream;
  RowMatrix<T> expected_residual = c.residual;
  expected_residual += c.x;
  RowMatrix<float> out(9, 37);
  apex::add_rms_norm(c.x, stream.middleCols(5, 37), c.gamma, {}, out);
  EXPECT_TRUE(same_bits(RowMatrix<T>(stream.middleCols(5, 37)), expected_residual));
  EXPECT_TRUE(same_bits(RowMatrix<T>(stream.leftCols(5)), RowMatrix<T>(before.leftCols(5))));
  EXPECT_TRUE(same_bits(RowMatrix<T>(stream.rightCols(8)), RowMatrix<T>(before.rightCols(8))));
  RowMatrix<float> two_step(9, 37);
  apex::rms_norm(expected_residual, c.gamma, {}, two_step);
  EXPECT_TRUE(same_bits(out, two_step));

  // The value-returning form keeps x's type and updates the residual.
  RowMatrix<T> residual = c.residual;
  const RowMatrix<T> returned = apex::add_rms_norm(c.x, residual, c.gamma);
  EXPECT_TRUE(same_bits(residual, expected_residual));
  EXPECT_TRUE(same_bits(returned, apex::rms_norm(expected_residual, c.gamma)));
}

TEST(AddRmsNormMixed, SumIsRoundedOnceToTheResidualType) {
  // float x into a bfloat16 residual stream: r' = round_to<bfloat16>(r + x), the sum formed in
  // double (exact here), then the norm of r'.
  const RowMatrix<float> x = random_input<float>(6, 45, 340);
  const RowMatrix<Eigen::bfloat16> r0 = random_input<float>(6, 45, 341).cast<Eigen::bfloat16>();
  const Vector<float> gamma = random_gamma<float>(45, 342);
  RowMatrix<Eigen::bfloat16> expected_residual(6, 45);
  for (Index i = 0; i < x.size(); ++i) {
    expected_residual.data()[i] = apex::round_to<Eigen::bfloat16>(
        static_cast<double>(r0.data()[i]) + static_cast<double>(x.data()[i]));
  }
  // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): the call writes it
  RowMatrix<Eigen::bfloat16> residual = r0;
  RowMatrix<float> out(6, 45);
  apex::add_rms_norm(x, residual, gamma, {}, out);
  EXPECT_TRUE(same_bits(residual, expected_residual));
  RowMatrix<float> two_step(6, 45);
  apex::rms_norm(expected_residual, gamma, {}, two_step);
  EXPECT_TRUE(same_bits(out, two_step));
  expect_matches<float>(out, reference<float>(expected_residual.cast<float>(), gamma, 1e-6));
}

TEST(AddRmsNormDouble, ExtremeRowsTakeTheRescaledPathAsTheTwoStepsDo) {
  // Squares that overflow and that underflow: the fused call normalises the rounded sum through
  // the same rescaled path.
  RowMatrix<double> x(2, 4), r0(2, 4);
  x << 0x1p1000, -0x1p999, 0x1p998, 0x1.8p999,  //
      0x1p-531, -0x1p-532, 0x1p-530, 0x1p-533;
  r0 << 0x1p1000, -0x1p998, 0x1p999, 0x1p997,  //
      0x1p-530, 0x1p-533, -0x1p-531, 0x1p-532;
  const Vector<double> gamma = random_gamma<double>(4, 350);
  const RmsNormParams params{std::numeric_limits<double>::denorm_min()};
  RowMatrix<double> residual = r0;
  RowMatrix<double> out(2, 4);
  apex::add_rms_norm(x, residual, gamma, params, out);
  RowMatrix<double> expected_residual = r0 + x;
  EXPECT_TRUE(same_bits(residual, expected_residual));
  EXPECT_TRUE(same_bits(out, apex::rms_norm(expected_residual, gamma, params)));
  ASSERT_TRUE(out.allFinite());
}

// ---------------------------------------------------------------------------------------------
// The thread count does not change a bit
// ---------------------------------------------------------------------------------------------

// Runs `compute` on 1 and on 2 OpenMP threads and expects the same bits.
template <class Compute>
void expect_same_bits_on_1_and_2_threads(const Compute& compute) {
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = compute();
  omp_set_num_threads(2);
  const auto two = compute();
  omp_set_num_threads(saved);
  EXPECT_TRUE(same_bits(one, two));
#else
  (void)compute;
  GTEST_SKIP() << "built without OpenMP: one thread only";
#endif
}

TYPED_TEST(AddRmsNorm, ThreadCountDoesNotChangeResults) {
  using T = TypeParam;
  // 600 × 300: enough rows for rms_norm's parallel threshold (32K elements).
  const AddCase<T> c(600, 300, 360);
  expect_same_bits_on_1_and_2_threads([&] { return apex::rms_norm(c.x, c.gamma); });
  expect_same_bits_on_1_and_2_threads(
      [&] { return apex::rms_norm(c.x, c.gamma, one_plus_gamma()); });
  expect_same_bits_on_1_and_2_threads([&] {
    RowMatrix<T> residual = c.residual;
    RowMatrix<T> both(2 * c.x.rows(), c.x.cols());
    both.topRows(c.x.rows()) = apex::add_rms_norm(c.x, residual, c.gamma);
    both.bottomRows(c.x.rows()) = residual;
    return both;
  });
}

// ---------------------------------------------------------------------------------------------
// Bad input to add_rms_norm: rejected before anything is written
// ---------------------------------------------------------------------------------------------

TEST(AddRmsNormErrors, RejectsBadInputBeforeWriting) {
  const RowMatrix<float> x0 = random_input<float>(3, 5, 370);
  const RowMatrix<float> r0 = random_input<float>(3, 5, 371);
  const Vector<float> gamma = Vector<float>::Ones(5);
  RowMatrix<float> x = x0;
  RowMatrix<float> residual = r0;
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 5, -7.0f);
  const RowMatrix<float> out0 = out;
  const auto untouched = [&] {
    return same_bits(x, x0) && same_bits(residual, r0) && same_bits(out, out0);
  };

  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { apex::add_rms_norm(x, residual, gamma, RmsNormParams{0.0}, out); },
                 {"[add_rms_norm] eps (0)", "positive and finite"});
  expect_invalid([&] { apex::add_rms_norm(x, residual, gamma, RmsNormParams{-1.0}, out); },
                 {"[add_rms_norm] eps (-1)"});
  expect_invalid([&] { apex::add_rms_norm(x, residual, gamma, RmsNormParams{nan}, out); },
                 {"[add_rms_norm] eps (nan)"});
  EXPECT_TRUE(untouched());

  expect_invalid([&] { apex::add_rms_norm(x, residual, Vector<float>::Ones(6), {}, out); },
                 {"[add_rms_norm] gamma length (6)", "d (5)"});
  RowMatrix<float> short_residual = RowMatrix<float>::Constant(2, 5, 3.0f);
  expect_invalid([&] { apex::add_rms_norm(x, short_residual, gamma, {}, out); },
                 {"[add_rms_norm] residual (2 x 5)", "3 x 5 like x"});
  EXPECT_TRUE((short_residual.array() == 3.0f).all());
  RowMatrix<float> narrow_out = RowMatrix<float>::Constant(3, 4, 3.0f);
  expect_invalid([&] { apex::add_rms_norm(x, residual, gamma, {}, narrow_out); },
                 {"[add_rms_norm] out (3 x 4)", "3 x 5 like x"});
  EXPECT_TRUE((narrow_out.array() == 3.0f).all());
  EXPECT_TRUE(untouched());

  // Overlaps: out onto residual, residual onto x, γ inside residual or out, out partly onto x.
  expect_invalid([&] { apex::add_rms_norm(x, residual, gamma, {}, residual); },
                 {"[add_rms_norm] out must not overlap residual"});
  expect_invalid([&] { apex::add_rms_norm(x, x, gamma, {}, out); },
                 {"[add_rms_norm] residual must not overlap x"});
  expect_invalid([&] { apex::add_rms_norm(x, residual, residual.row(1), {}, out); },
                 {"[add_rms_norm] gamma must not overlap residual"});
  expect_invalid([&] { apex::add_rms_norm(x, residual, out.row(2), {}, out); },
                 {"[add_rms_norm] gamma must not overlap out"});
  RowMatrix<float> wide = RowMatrix<float>::Constant(3, 6, 3.0f);
  const RowMatrix<float> wide0 = wide;
  expect_invalid(
      [&] { apex::add_rms_norm(wide.leftCols(5), residual, gamma, {}, wide.rightCols(5)); },
      {"[add_rms_norm] out must either be x itself"});
  EXPECT_TRUE(same_bits(wide, wide0));
  EXPECT_TRUE(untouched());
}

TEST(RmsNormErrors, OnePlusGammaChecksAsBefore) {
  const RowMatrix<float> x = random_input<float>(3, 5, 380);
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 5, -7.0f);
  expect_invalid([&] { apex::rms_norm(x, Vector<float>::Ones(4), one_plus_gamma(), out); },
                 {"[rms_norm] gamma length (4)", "d (5)"});
  expect_invalid([&] { apex::rms_norm(x, Vector<float>::Ones(5), one_plus_gamma(0.0), out); },
                 {"[rms_norm] eps (0)"});
  EXPECT_TRUE((out.array() == -7.0f).all());
}

// ---- The backward pass ------------------------------------------------------------------------

TEST(RmsNormBackward, ReferenceMatchesFiniteDifferences) {
  RowMatrix<double> x = random_input<double>(3, 7, 500);
  Vector<double> gamma = random_gamma<double>(7, 501);
  const RowMatrix<double> d_out = random_input<double>(3, 7, 502);
  const double eps = 0.1;
  const auto loss = [&] {
    return (apex::reference::rms_norm(x, gamma, eps).array() * d_out.array()).sum();
  };
  const auto g = apex::reference::rms_norm_backward(x, gamma, eps, d_out);
  apex::testing::expect_matches_differences(x, g.dx, loss, "dx");
  apex::testing::expect_matches_differences(gamma, g.d_gamma, loss, "d_gamma");
}

// Each gradient is formed in double and rounded once: within Tolerance::kRel of the plain
// backward loop, relative above 1 and absolute below (dx cancels, g − z·mean(g∘z)).
TYPED_TEST(RmsNormTyped, BackwardMatchesReferenceOnRandomShapes) {
  using Scalar = TypeParam;
  std::uint32_t seed = 600;
  for (const Shape& s : kShapes) {
    for (const apex::RmsNormGamma scale :
         {apex::RmsNormGamma::kGamma, apex::RmsNormGamma::kOnePlusGamma}) {
      SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
      const RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, ++seed);
      const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, ++seed);
      const RowMatrix<Scalar> d_out = random_input<Scalar>(s.tokens, s.d, ++seed);
      RowMatrix<Scalar> d_x(s.tokens, s.d);
      Vector<Scalar> d_gamma(s.d);
      apex::rms_norm_backward(x, gamma, RmsNormParams{0.25, scale}, d_out, d_x, d_gamma);
      Vector<double> gamma_prime = gamma.template cast<double>();
      if (scale == apex::RmsNormGamma::kOnePlusGamma) gamma_prime.array() += 1.0;
      const auto g = apex::reference::rms_norm_backward(x.template cast<double>(), gamma_prime,
                                                        0.25, d_out.template cast<double>());
      apex::testing::expect_close(d_x, g.dx, Tolerance<Scalar>::kRel);
      apex::testing::expect_close(d_gamma, g.d_gamma, Tolerance<Scalar>::kRel);
    }
  }
}

TEST(RmsNormBackward, BitIdenticalForAnyThreadCountAnd16BitRows) {
  // 300 rows: five chunks of d_gamma's partial sums. bfloat16 x and d_out, float gradients.
  const RowMatrix<Eigen::bfloat16> x =
      random_input<float>(300, 70, 700).template cast<Eigen::bfloat16>();
  const RowMatrix<Eigen::bfloat16> d_out =
      random_input<float>(300, 70, 701).template cast<Eigen::bfloat16>();
  const Vector<float> gamma = random_gamma<float>(70, 702);
  RowMatrix<float> dx1(300, 70), dx2(300, 70);
  Vector<float> dg1(70), dg2(70);
  {
    const apex::testing::OneThread one;
    apex::rms_norm_backward(x, gamma, {}, d_out, dx1, dg1);
  }
  apex::rms_norm_backward(x, gamma, {}, d_out, dx2, dg2);
  EXPECT_TRUE(dx1 == dx2 && dg1 == dg2);
  const auto g = apex::reference::rms_norm_backward(x.cast<double>(), gamma.cast<double>(), 1e-6,
                                                    d_out.cast<double>());
  apex::testing::expect_close(dx2, g.dx, Tolerance<float>::kRel);
  apex::testing::expect_close(dg2, g.d_gamma, Tolerance<float>::kRel);
}

TEST(RmsNormBackward, DoubleRowsWhoseSquaresOverflow) {
  // RMSNorm is scale-invariant up to ε: x·2^600 has the gradient of x divided by 2^600.
  const RowMatrix<double> x = random_input<double>(2, 9, 710);
  const Vector<double> gamma = random_gamma<double>(9, 711);
  const RowMatrix<double> d_out = random_input<double>(2, 9, 712);
  const double big = std::ldexp(1.0, 600);
  RowMatrix<double> dx(2, 9), dx_big(2, 9);
  Vector<double> dg(9), dg_big(9);
  apex::rms_norm_backward(x, gamma, RmsNormParams{1e-300}, d_out, dx, dg);
  apex::rms_norm_backward(RowMatrix<double>(x * big), gamma, RmsNormParams{1e-300}, d_out, dx_big,
                          dg_big);
  apex::testing::expect_close(RowMatrix<double>(dx_big * big), dx, 1e-13);
  apex::testing::expect_close(dg_big, dg, 1e-13);
}

TEST(RmsNormBackward, RejectsBadInputBeforeWriting) {
  const RowMatrix<float> x = random_input<float>(3, 5, 720);
  const Vector<float> gamma = random_gamma<float>(5, 721);
  RowMatrix<float> d_out = random_input<float>(3, 5, 722);
  RowMatrix<float> dx = RowMatrix<float>::Constant(3, 5, 9.0f);
  Vector<float> dg = Vector<float>::Constant(5, 9.0f);
  const auto untouched = [&] { return (dx.array() == 9.0f).all() && (dg.array() == 9.0f).all(); };
  expect_invalid(
      [&] { apex::rms_norm_backward(x, Vector<float>(gamma.head(4)), {}, d_out, dx, dg); },
      {"[rms_norm_backward] gamma length (4)"});
  expect_invalid([&] { apex::rms_norm_backward(x, gamma, {}, d_out.topRows(2), dx, dg); },
                 {"[rms_norm_backward] d_out (2 x 5)"});
  expect_invalid([&] { apex::rms_norm_backward(x, gamma, {}, d_out, dx.leftCols(4), dg); },
                 {"[rms_norm_backward] d_x (3 x 4)"});
  expect_invalid([&] { apex::rms_norm_backward(x, gamma, {}, d_out, dx, dg.head(3)); },
                 {"[rms_norm_backward] d_gamma length (3)"});
  expect_invalid([&] { apex::rms_norm_backward(x, gamma, RmsNormParams{0.0}, d_out, dx, dg); },
                 {"[rms_norm_backward] eps (0)"});
  EXPECT_TRUE(untouched());
  expect_invalid([&] { apex::rms_norm_backward(x, gamma, {}, d_out, d_out, dg); },
                 {"[rms_norm_backward] d_x must not overlap d_out"});
  EXPECT_TRUE(untouched());
}

}  // namespace
}  // namespace rms_norm_test
