// SPDX-License-Identifier: MIT
// Tests for LayerNorm (layer_norm.hpp): against a plain double loop written for clarity, with
// and without γ and β, on float, double and 16-bit rows; constant rows; double rows at the ends
// of the range; in place; thread counts; the fused residual add + LayerNorm against its two
// steps; the backward pass against its plain loop (itself against finite differences); bad
// input.
#include <apex/layer_norm.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "finite_differences.hpp"
#include "test_util.hpp"

namespace layer_norm_test {
namespace {

using apex::Index;
using apex::LayerNormParams;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

// ---- The plain loop ---------------------------------------------------------------------------

// out[t, j] = (x[t, j] − μ) / sqrt(σ² + ε) · γ[j] + β[j], μ = mean(x[t, :]),
// σ² = mean((x[t, :] − μ)²). An empty γ means 1 and an empty β means 0. Also returns, per
// element, the size of the terms that make it, |z·γ| + |β|, which the tolerance scales with.
struct Reference {
  RowMatrix<double> out, magnitude;
};

Reference reference_layer_norm(const RowMatrix<double>& x, const Vector<double>& gamma,
                               const Vector<double>& beta, double eps) {
  const Index d = x.cols();
  Reference r{RowMatrix<double>(x.rows(), d), RowMatrix<double>(x.rows(), d)};
  for (Index t = 0; t < x.rows(); ++t) {
    double sum = 0.0;
    for (Index j = 0; j < d; ++j) sum += x(t, j);
    const double mean = sum / static_cast<double>(d);
    double squares = 0.0;
    for (Index j = 0; j < d; ++j) squares += (x(t, j) - mean) * (x(t, j) - mean);
    const double sigma = std::sqrt(squares / static_cast<double>(d) + eps);
    for (Index j = 0; j < d; ++j) {
      const double scaled = (x(t, j) - mean) / sigma * (gamma.size() > 0 ? gamma(j) : 1.0);
      const double shift = beta.size() > 0 ? beta(j) : 0.0;
      r.out(t, j) = scaled + shift;
      r.magnitude(t, j) = std::abs(scaled) + std::abs(shift);
    }
  }
  return r;
}

// Tolerance: |out − reference| ≤ kRel · (|z·γ| + |β| + 1).
// float (and 16-bit rows written as float): the statistics are accumulated in double and the
//   output is formed in double and rounded once, so each element is within half an ulp of the
//   exact value, and the double reference is far closer than that; two ulps leave room.
// double: both apex and the reference lose up to d·u·max|x| in the mean (d ≤ 300, |x| ≤ 2:
//   about 7e-14), which reaches x − μ as an absolute error; 1e-13 covers it and the roundings.
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

template <class Scalar, class Out>
void expect_matches(const Out& actual, const Reference& expected) {
  ASSERT_EQ(actual.rows(), expected.out.rows());
  ASSERT_EQ(actual.cols(), expected.out.cols());
  for (Index t = 0; t < actual.rows(); ++t) {
    for (Index j = 0; j < actual.cols(); ++j) {
      EXPECT_NEAR(static_cast<double>(actual(t, j)), expected.out(t, j),
                  Tolerance<Scalar>::kRel * (expected.magnitude(t, j) + 1.0))
          << "at (" << t << ", " << j << ")";
    }
  }
}

// ---- Inputs -----------------------------------------------------------------------------------

// x: uniform in [-2, 2) plus a row offset of up to ±3, so that the mean matters.
template <class Scalar>
RowMatrix<Scalar> random_input(Index tokens, Index d, std::uint32_t seed) {
  RowMatrix<double> x = random_matrix<double>(tokens, d, seed, -2.0, 2.0);
  const RowMatrix<double> offsets = random_matrix<double>(tokens, 1, seed + 1000, -3.0, 3.0);
  for (Index t = 0; t < tokens; ++t) x.row(t).array() += offsets(t, 0);
  return x.cast<Scalar>();
}

// γ: magnitudes uniform in [0.5, 1.5), every third one negative; β: uniform in [-1, 1).
template <class Scalar>
Vector<Scalar> random_gamma(Index d, std::uint32_t seed) {
  Vector<Scalar> g = random_matrix<Scalar>(d, 1, seed, 0.5, 1.5);
  for (Index j = 0; j < d; j += 3) g(j) = -g(j);
  return g;
}
template <class Scalar>
Vector<Scalar> random_beta(Index d, std::uint32_t seed) {
  return random_matrix<Scalar>(d, 1, seed, -1.0, 1.0);
}

template <class A, class B>
bool same_bits(const A& a, const B& b) {
  static_assert(std::is_same_v<typename A::Scalar, typename B::Scalar>);
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(typename A::Scalar) * std::size_t(a.size())) == 0;
}

template <class T>
RowMatrix<double> wide(const RowMatrix<T>& m) {
  return m.template cast<double>();
}
template <class T>
Vector<double> wide(const Vector<T>& v) {
  return v.template cast<double>();
}
template <class T>
RowMatrix<double> wide16(const RowMatrix<T>& m) {
  return m.template cast<float>().template cast<double>();
}

struct Shape {
  Index tokens, d;
};
// Single rows, widths that are not multiples of the 16-wide accumulation, and enough rows to
// be split over threads.
const Shape kShapes[] = {{1, 1},   {1, 7},    {1, 16},  {3, 13},    {2, 17},
                         {17, 33}, {64, 100}, {5, 255}, {300, 129}, {1, 300}};

template <class Scalar>
class LayerNormTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(LayerNormTyped, Scalars, apex::testing::ScalarName);

// ---- Against the plain loop -------------------------------------------------------------------

TYPED_TEST(LayerNormTyped, MatchesReferenceWithAndWithoutGammaAndBeta) {
  using Scalar = TypeParam;
  const Vector<double> unset;
  std::uint32_t seed = 10;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    const RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, seed += 3);
    const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, seed + 1);
    const Vector<Scalar> beta = random_beta<Scalar>(s.d, seed + 2);
    const RowMatrix<double> xd = wide(x);
    const LayerNormParams params{0.25};
    RowMatrix<Scalar> out(s.tokens, s.d);
    apex::layer_norm(x, gamma, beta, params, out);
    expect_matches<Scalar>(out, reference_layer_norm(xd, wide(gamma), wide(beta), 0.25));
    apex::layer_norm(x, gamma, std::nullopt, params, out);
    expect_matches<Scalar>(out, reference_layer_norm(xd, wide(gamma), unset, 0.25));
    apex::layer_norm(x, std::nullopt, beta, params, out);
    expect_matches<Scalar>(out, reference_layer_norm(xd, unset, wide(beta), 0.25));
    apex::layer_norm(x, std::nullopt, std::nullopt, params, out);
    expect_matches<Scalar>(out, reference_layer_norm(xd, unset, unset, 0.25));
    // The value-returning form with the default ε (PyTorch's 1e-5).
    expect_matches<Scalar>(apex::layer_norm(x, gamma, beta),
                           reference_layer_norm(xd, wide(gamma), wide(beta), 1e-5));
  }
}

TYPED_TEST(LayerNormTyped, OutputHasZeroMeanAndUnitVarianceUpToEps) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = random_input<Scalar>(20, 96, 30);
  const RowMatrix<Scalar> out = apex::layer_norm(x, std::nullopt, std::nullopt);
  for (Index t = 0; t < x.rows(); ++t) {
    const RowMatrix<double> row = wide(RowMatrix<Scalar>(x.row(t)));
    const double mean = row.mean();
    const double var = (row.array() - mean).square().mean();
    const RowMatrix<double> o = wide(RowMatrix<Scalar>(out.row(t)));
    EXPECT_NEAR(o.mean(), 0.0, 16 * Tolerance<Scalar>::kRel) << "row " << t;
    EXPECT_NEAR((o.array() - o.mean()).square().mean(), var / (var + 1e-5),
                16 * Tolerance<Scalar>::kRel)
        << "row " << t;
  }
}

TYPED_TEST(LayerNormTyped, ConstantRowGivesExactlyBeta) {
  using Scalar = TypeParam;
  // 0.1 in double: a plain sum of three copies is 0.30000000000000004 and its mean is not 0.1;
  // the mean taken about x[0] is exact. Large and tiny values take double's rescaled path.
  for (const double c : {0.1, -3.0, 1e30, 1e-30, 0.0, 1e300, 1e-300}) {
    if (!std::isfinite(static_cast<Scalar>(c))) continue;
    for (const Index d : {Index{1}, Index{3}, Index{17}, Index{300}}) {
      SCOPED_TRACE(::testing::Message() << "c=" << c << " d=" << d);
      const RowMatrix<Scalar> x = RowMatrix<Scalar>::Constant(4, d, static_cast<Scalar>(c));
      const Vector<Scalar> gamma = random_gamma<Scalar>(d, 40);
      const Vector<Scalar> beta = random_beta<Scalar>(d, 41);
      for (const double eps : {1e-5, 1e-300}) {
        const RowMatrix<Scalar> out = apex::layer_norm(x, gamma, beta, LayerNormParams{eps});
        for (Index t = 0; t < 4; ++t) ASSERT_EQ(out.row(t), beta.transpose()) << "row " << t;
        const RowMatrix<Scalar> bare =
            apex::layer_norm(x, std::nullopt, std::nullopt, LayerNormParams{eps});
        EXPECT_TRUE((bare.array() == Scalar(0)).all());
      }
    }
  }
}

TYPED_TEST(LayerNormTyped, InPlaceAndColumnBlocks) {
  using Scalar = TypeParam;
  std::uint32_t seed = 50;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    RowMatrix<Scalar> x = random_input<Scalar>(s.tokens, s.d, seed += 3);
    const Vector<Scalar> gamma = random_gamma<Scalar>(s.d, seed + 1);
    const Vector<Scalar> beta = random_beta<Scalar>(s.d, seed + 2);
    const RowMatrix<Scalar> out_of_place = apex::layer_norm(x, gamma, beta);
    apex::layer_norm(x, gamma, beta, {}, x);
    EXPECT_TRUE(same_bits(x, out_of_place)) << "in place must give the same bits";
  }
  // The middle 37 features of wider rows, in place; the rest untouched.
  RowMatrix<Scalar> stream = random_input<Scalar>(9, 50, 60);
  const RowMatrix<Scalar> before = stream;
  const Vector<Scalar> gamma = random_gamma<Scalar>(37, 61);
  auto block = stream.middleCols(5, 37);
  apex::layer_norm(block, gamma, std::nullopt, {}, block);
  EXPECT_TRUE(same_bits(
      RowMatrix<Scalar>(stream.middleCols(5, 37)),
      apex::layer_norm(RowMatrix<Scalar>(before.middleCols(5, 37)), gamma, std::nullopt)));
  EXPECT_TRUE(
      same_bits(RowMatrix<Scalar>(stream.leftCols(5)), RowMatrix<Scalar>(before.leftCols(5))));
  EXPECT_TRUE(
      same_bits(RowMatrix<Scalar>(stream.rightCols(8)), RowMatrix<Scalar>(before.rightCols(8))));
}

TYPED_TEST(LayerNormTyped, ThreadCountDoesNotChangeResults) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: one thread only";
#else
  using Scalar = TypeParam;
  // 600 × 300: above the parallel threshold (32K elements).
  const RowMatrix<Scalar> x = random_input<Scalar>(600, 300, 70);
  const RowMatrix<Scalar> r0 = random_input<Scalar>(600, 300, 71);
  const Vector<Scalar> gamma = random_gamma<Scalar>(300, 72);
  const Vector<Scalar> beta = random_beta<Scalar>(300, 73);
  const auto compute = [&] {
    RowMatrix<Scalar> all(3 * 600, 300);
    all.topRows(600) = apex::layer_norm(x, gamma, beta);
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): the call writes it
    RowMatrix<Scalar> residual = r0;
    RowMatrix<Scalar> out(600, 300);
    apex::add_layer_norm(x, residual, gamma, beta, {}, out);
    all.middleRows(600, 600) = out;
    all.bottomRows(600) = residual;
    return all;
  };
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const RowMatrix<Scalar> one = compute();
  omp_set_num_threads(2);
  const RowMatrix<Scalar> two = compute();
  omp_set_num_threads(saved);
  EXPECT_TRUE(same_bits(one, two));
#endif
}

// ---- Double rows at the ends of the range -----------------------------------------------------

// LayerNorm is scale-invariant: for c a power of two, LN(c·v, ε) = LN(v, ε/c²). Rows whose
// squares overflow or underflow double are compared with their unscaled versions.
TEST(LayerNormDouble, SquaresThatOverflowOrUnderflow) {
  const RowMatrix<double> v = random_input<double>(3, 40, 80);
  const Vector<double> gamma = random_gamma<double>(40, 81);
  const Vector<double> beta = random_beta<double>(40, 82);
  struct Case {
    int exponent;
    double eps;  // the ε of the scaled row; the unscaled one uses ε / c²
  };
  // 2^1000: deviations² ~ 2^2000 overflow, ε negligible. 2^-530 with ε = 2^-1074: the squares
  // (~2^-1060) underflow and ε matters (ε / c² = 2^-14). 2^1023: the sum itself overflows.
  for (const Case& c :
       {Case{1000, 1e-6}, Case{-530, std::numeric_limits<double>::denorm_min()}, Case{1021, 1.0}}) {
    SCOPED_TRACE(c.exponent);
    const RowMatrix<double> x = (v.array() * std::ldexp(1.0, c.exponent)).matrix();
    ASSERT_TRUE(x.allFinite());
    const RowMatrix<double> out = apex::layer_norm(x, gamma, beta, LayerNormParams{c.eps});
    ASSERT_TRUE(out.allFinite());
    const double unscaled_eps = std::max(std::ldexp(c.eps, -2 * c.exponent), 1e-300);
    expect_matches<double>(out, reference_layer_norm(v, gamma, beta, unscaled_eps));
  }
}

TEST(LayerNormDouble, TinyDeviationsAroundAnOffsetWithTinyEps) {
  // x = 2^-540 · (3 + v): the deviations' squares (~2^-1080) are below the smallest double; with
  // ε = 2^-1074 the exact answer is LN(3 + v, ε · 2^1080) = LN(v, 64), where ε and the variance
  // (~1/3) both matter.
  const RowMatrix<double> v = random_matrix<double>(2, 23, 90, -1.0, 1.0);
  const RowMatrix<double> y = (v.array() + 3.0).matrix();  // rounded; the reference uses it too
  const RowMatrix<double> x = (y.array() * std::ldexp(1.0, -540)).matrix();
  const Vector<double> beta = random_beta<double>(23, 91);
  const RowMatrix<double> out = apex::layer_norm(
      x, std::nullopt, beta, LayerNormParams{std::numeric_limits<double>::denorm_min()});
  expect_matches<double>(out, reference_layer_norm(y, Vector<double>(), beta, 64.0));
}

TEST(LayerNormDouble, NonFiniteInputStaysInItsRow) {
  RowMatrix<double> x(3, 4);
  x << 1.0, std::numeric_limits<double>::quiet_NaN(), 2.0, 3.0,  //
      1.0, std::numeric_limits<double>::infinity(), 2.0, 3.0,    //
      1.0, 2.0, 3.0, 4.0;
  const RowMatrix<double> out = apex::layer_norm(x, std::nullopt, std::nullopt);
  EXPECT_TRUE(out.row(0).array().isNaN().all());
  EXPECT_TRUE(out.row(1).array().isNaN().all()) << "x − μ is NaN or ∞ − ∞ for every element";
  EXPECT_TRUE(out.row(2).allFinite());
}

// Float rows take their statistics in one pass about x[0] (var = mean(d²) − mean(d)²): a large
// common offset, a first element far from the rest (so mean(d²) ≫ var) and long rows stay
// within the float tolerance of the two-pass double reference; non-finite input gives NaN rows.
TEST(LayerNormFloat, OnePassStatisticsHoldForOffsetsOutliersAndLongRows) {
  const Index d = 4096;
  RowMatrix<float> x = random_matrix<float>(3, d, 92, -1.0, 1.0);
  x.row(0) = (x.row(0).array() * 1e-2F + 1e4F).matrix();  // offset 1e4, deviations 1e-2
  x(1, 0) = 1e6F;                                         // x[0] far from the rest
  x(2, 0) = -3e5F;
  const Vector<double> beta = random_beta<double>(d, 93);
  const RowMatrix<float> out = apex::layer_norm(x, std::nullopt, beta.cast<float>().eval());
  expect_matches<float>(out, reference_layer_norm(x.cast<double>(), Vector<double>(), beta, 1e-5));

  RowMatrix<float> bad = random_matrix<float>(3, 8, 94, -1.0, 1.0);
  bad(0, 3) = std::numeric_limits<float>::quiet_NaN();
  bad(1, 5) = std::numeric_limits<float>::infinity();
  const RowMatrix<float> bad_out = apex::layer_norm(bad, std::nullopt, std::nullopt);
  EXPECT_TRUE(bad_out.row(0).array().isNaN().all());
  EXPECT_TRUE(bad_out.row(1).array().isNaN().all());
  EXPECT_TRUE(bad_out.row(2).allFinite());
}

// ---- 16-bit rows ------------------------------------------------------------------------------

template <class T>
class LayerNorm16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(LayerNorm16Bit, SixteenBit, apex::testing::ScalarName);

TYPED_TEST(LayerNorm16Bit, MatchesTheReferenceAndRoundsOnce) {
  using T = TypeParam;
  const RowMatrix<T> x = random_input<float>(37, 130, 100).cast<T>();
  const Vector<T> gamma = random_gamma<float>(130, 101).cast<T>();
  const Vector<float> beta = random_beta<float>(130, 102);
  RowMatrix<double> as_double(37, 130);
  apex::layer_norm(x, gamma, beta, {}, as_double);
  RowMatrix<float> as_float(37, 130);
  apex::layer_norm(x, gamma, beta, {}, as_float);
  const Reference expected = reference_layer_norm(
      wide16(x), gamma.template cast<float>().template cast<double>(), wide(beta), 1e-5);
  expect_matches<double>(as_double, expected);
  expect_matches<float>(as_float, expected);
  // A 16-bit output is the double result rounded once, in place or not.
  RowMatrix<T> out(37, 130);
  apex::layer_norm(x, gamma, beta, {}, out);
  RowMatrix<T> in_place = x;
  apex::layer_norm(in_place, gamma, beta, {}, in_place);
  for (Index t = 0; t < 37; ++t) {
    for (Index j = 0; j < 130; ++j) {
      const auto want = Eigen::numext::bit_cast<std::uint16_t>(apex::round_to<T>(as_double(t, j)));
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(out(t, j)), want) << t << ", " << j;
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(in_place(t, j)), want) << t << ", " << j;
    }
  }
}

// ---- Fused residual add + LayerNorm -----------------------------------------------------------

template <class T>
class AddLayerNorm : public ::testing::Test {};
using AllStorage = ::testing::Types<float, double, Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(AddLayerNorm, AllStorage, apex::testing::ScalarName);

// residual += x (Eigen's addition in T) then layer_norm(residual), against the fused call, out
// of place and with out = x; γ and β set or not.
template <class T, class Gamma, class Beta>
void expect_fused_equals_two_steps(
    const RowMatrix<T>& x,  // NOLINT(bugprone-easily-swappable-parameters)
    const RowMatrix<T>& r0, const Gamma& gamma, const Beta& beta) {
  RowMatrix<T> expected_residual = r0;
  expected_residual += x;
  RowMatrix<T> expected(x.rows(), x.cols());
  apex::layer_norm(expected_residual, gamma, beta, {}, expected);

  RowMatrix<T> residual = r0;
  RowMatrix<T> out(x.rows(), x.cols());
  apex::add_layer_norm(x, residual, gamma, beta, {}, out);
  EXPECT_TRUE(same_bits(residual, expected_residual)) << "updated residual";
  EXPECT_TRUE(same_bits(out, expected)) << "normalised output";

  // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): the call writes it
  RowMatrix<T> x_then_out = x;
  residual = r0;
  apex::add_layer_norm(x_then_out, residual, gamma, beta, {}, x_then_out);
  EXPECT_TRUE(same_bits(residual, expected_residual));
  EXPECT_TRUE(same_bits(x_then_out, expected));
}

TYPED_TEST(AddLayerNorm, EqualsAddThenNormBitForBit) {
  using T = TypeParam;
  std::uint32_t seed = 200;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << s.tokens << " d=" << s.d);
    const RowMatrix<T> x = random_input<float>(s.tokens, s.d, seed += 4).cast<T>();
    const RowMatrix<T> r0 = random_input<float>(s.tokens, s.d, seed + 1).cast<T>();
    const Vector<T> gamma = random_gamma<float>(s.d, seed + 2).cast<T>();
    const Vector<T> beta = random_beta<float>(s.d, seed + 3).cast<T>();
    expect_fused_equals_two_steps(x, r0, gamma, beta);
    expect_fused_equals_two_steps(x, r0, std::nullopt, std::nullopt);
    expect_fused_equals_two_steps(x, r0, gamma, std::nullopt);
  }
}

// ---- Bad input --------------------------------------------------------------------------------

TEST(LayerNormErrors, RejectsBadInputBeforeWriting) {
  const RowMatrix<float> x = random_input<float>(3, 5, 300);
  const Vector<float> gamma = Vector<float>::Ones(5);
  const Vector<float> beta = Vector<float>::Zero(5);
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 5, -7.0f);
  const auto untouched = [&] { return (out.array() == -7.0f).all(); };
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  expect_invalid([&] { apex::layer_norm(x, gamma, beta, LayerNormParams{0.0}, out); },
                 {"[layer_norm] eps (0)", "positive and finite"});
  expect_invalid([&] { apex::layer_norm(x, gamma, beta, LayerNormParams{-1e-5}, out); },
                 {"[layer_norm] eps (-1e-05)"});
  expect_invalid([&] { apex::layer_norm(x, gamma, beta, LayerNormParams{inf}, out); },
                 {"[layer_norm] eps (inf)"});
  expect_invalid(
      [&] { apex::layer_norm(x, std::nullopt, std::nullopt, LayerNormParams{nan}, out); },
      {"[layer_norm] eps (nan)"});
  expect_invalid([&] { apex::layer_norm(x, Vector<float>::Ones(4), beta, {}, out); },
                 {"[layer_norm] gamma length (4)", "d (5)"});
  expect_invalid([&] { apex::layer_norm(x, std::nullopt, Vector<float>::Zero(6), {}, out); },
                 {"[layer_norm] beta length (6)", "d (5)"});
  EXPECT_TRUE(untouched());

  RowMatrix<float> wrong_rows = RowMatrix<float>::Constant(2, 5, -7.0f);
  expect_invalid([&] { apex::layer_norm(x, gamma, beta, {}, wrong_rows); },
                 {"[layer_norm] out (2 x 5)", "3 x 5 like x"});
  EXPECT_TRUE((wrong_rows.array() == -7.0f).all());

  // Overlaps: γ or β inside out, out partly over x.
  expect_invalid([&] { apex::layer_norm(x, out.row(1), beta, {}, out); },
                 {"[layer_norm] gamma must not overlap out"});
  expect_invalid([&] { apex::layer_norm(x, std::nullopt, out.row(2), {}, out); },
                 {"[layer_norm] beta must not overlap out"});
  EXPECT_TRUE(untouched());
  RowMatrix<float> buffer = random_input<float>(3, 6, 301);
  const RowMatrix<float> buffer0 = buffer;
  expect_invalid(
      [&] { apex::layer_norm(buffer.leftCols(5), gamma, beta, {}, buffer.rightCols(5)); },
      {"[layer_norm] out must either be x itself"});
  EXPECT_TRUE(same_bits(buffer, buffer0));
}

TEST(AddLayerNormErrors, RejectsBadInputBeforeWriting) {
  const RowMatrix<float> x0 = random_input<float>(3, 5, 310);
  const RowMatrix<float> r0 = random_input<float>(3, 5, 311);
  const Vector<float> gamma = Vector<float>::Ones(5);
  RowMatrix<float> x = x0;
  RowMatrix<float> residual = r0;
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 5, -7.0f);
  const RowMatrix<float> out0 = out;
  const auto untouched = [&] {
    return same_bits(x, x0) && same_bits(residual, r0) && same_bits(out, out0);
  };
  const auto none = std::nullopt;

  expect_invalid([&] { apex::add_layer_norm(x, residual, gamma, none, LayerNormParams{0.0}, out); },
                 {"[add_layer_norm] eps (0)"});
  expect_invalid([&] { apex::add_layer_norm(x, residual, none, Vector<float>::Ones(2), {}, out); },
                 {"[add_layer_norm] beta length (2)", "d (5)"});
  RowMatrix<float> tall_residual = RowMatrix<float>::Constant(4, 5, 3.0f);
  expect_invalid([&] { apex::add_layer_norm(x, tall_residual, gamma, none, {}, out); },
                 {"[add_layer_norm] residual (4 x 5)", "3 x 5 like x"});
  EXPECT_TRUE((tall_residual.array() == 3.0f).all());
  RowMatrix<float> narrow_out = RowMatrix<float>::Constant(3, 4, 3.0f);
  expect_invalid([&] { apex::add_layer_norm(x, residual, gamma, none, {}, narrow_out); },
                 {"[add_layer_norm] out (3 x 4)"});
  EXPECT_TRUE((narrow_out.array() == 3.0f).all());
  expect_invalid([&] { apex::add_layer_norm(x, residual, gamma, none, {}, residual); },
                 {"[add_layer_norm] out must not overlap residual"});
  expect_invalid([&] { apex::add_layer_norm(x, x, gamma, none, {}, out); },
                 {"[add_layer_norm] residual must not overlap x"});
  expect_invalid([&] { apex::add_layer_norm(x, residual, none, residual.row(0), {}, out); },
                 {"[add_layer_norm] beta must not overlap residual"});
  expect_invalid([&] { apex::add_layer_norm(x, residual, out.row(0), none, {}, out); },
                 {"[add_layer_norm] gamma must not overlap out"});
  EXPECT_TRUE(untouched());
}

// ---- The backward pass ------------------------------------------------------------------------

// The gradients of L = Σ d_out ∘ layer_norm(x, γ, β) from the chain rule on the plain loop's
// formula, with σ = sqrt(mean((x − μ)²) + ε) and z = (x − μ)/σ:
//   ∂out[t, j]/∂x[t, k] = γ_j (δ_jk − 1/d − z_j z_k / d) / σ,
//   dγ[j] = Σ_t d_out[t, j] z[t, j],  dβ[j] = Σ_t d_out[t, j].
struct LayerGradients {
  RowMatrix<double> dx;
  Vector<double> d_gamma, d_beta;
};
LayerGradients reference_backward(const RowMatrix<double>& x, const Vector<double>& gamma,
                                  double eps, const RowMatrix<double>& d_out) {
  const Index d = x.cols();
  const double n = static_cast<double>(d);
  LayerGradients g{RowMatrix<double>::Zero(x.rows(), d), Vector<double>::Zero(d),
                   Vector<double>::Zero(d)};
  for (Index t = 0; t < x.rows(); ++t) {
    const double mean = x.row(t).sum() / n;
    const double sigma = std::sqrt((x.row(t).array() - mean).square().sum() / n + eps);
    for (Index k = 0; k < d; ++k) {
      const double z_k = (x(t, k) - mean) / sigma;
      for (Index j = 0; j < d; ++j) {
        const double z_j = (x(t, j) - mean) / sigma;
        const double delta = j == k ? 1.0 : 0.0;
        g.dx(t, k) += d_out(t, j) * gamma(j) * (delta - 1.0 / n - z_j * z_k / n) / sigma;
      }
      g.d_gamma(k) += d_out(t, k) * z_k;
      g.d_beta(k) += d_out(t, k);
    }
  }
  return g;
}

TEST(LayerNormBackward, ReferenceMatchesFiniteDifferences) {
  RowMatrix<double> x = random_input<double>(3, 6, 800);
  Vector<double> gamma = random_gamma<double>(6, 801);
  Vector<double> beta = random_beta<double>(6, 802);
  const RowMatrix<double> d_out = random_matrix<double>(3, 6, 803);
  const auto loss = [&] {
    return (reference_layer_norm(x, gamma, beta, 0.05).out.array() * d_out.array()).sum();
  };
  const LayerGradients g = reference_backward(x, gamma, 0.05, d_out);
  apex::testing::expect_matches_differences(x, g.dx, loss, "dx");
  apex::testing::expect_matches_differences(gamma, g.d_gamma, loss, "d_gamma");
  apex::testing::expect_matches_differences(beta, g.d_beta, loss, "d_beta");
}

// Formed in double and rounded once: within Tolerance::kRel of the plain loop, relative above 1
// and absolute below.
TYPED_TEST(LayerNormTyped, BackwardMatchesReferenceWithAndWithoutGammaAndBeta) {
  using Scalar = TypeParam;
  std::uint32_t seed = 810;
  for (const auto& [tokens, d] : {std::pair<Index, Index>{1, 1}, {3, 17}, {70, 33}, {5, 130}}) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << tokens << " d=" << d);
    const RowMatrix<Scalar> x = random_input<Scalar>(tokens, d, ++seed);
    const Vector<Scalar> gamma = random_gamma<Scalar>(d, ++seed);
    const Vector<Scalar> beta = random_beta<Scalar>(d, ++seed);
    const RowMatrix<Scalar> d_out = random_matrix<Scalar>(tokens, d, ++seed);
    RowMatrix<Scalar> dx(tokens, d);
    Vector<Scalar> dg(d), db(d);
    apex::layer_norm_backward(x, gamma, beta, LayerNormParams{0.1}, d_out, dx, dg, db);
    const LayerGradients g = reference_backward(wide(x), wide(gamma), 0.1, wide(d_out));
    apex::testing::expect_close(dx, g.dx, Tolerance<Scalar>::kRel);
    apex::testing::expect_close(dg, g.d_gamma, Tolerance<Scalar>::kRel);
    apex::testing::expect_close(db, g.d_beta, Tolerance<Scalar>::kRel);
    // No γ (OLMo's non-parametric norm) and no gradients asked for but dx.
    RowMatrix<Scalar> dx_plain(tokens, d);
    apex::layer_norm_backward(x, std::nullopt, std::nullopt, LayerNormParams{0.1}, d_out, dx_plain,
                              std::nullopt, std::nullopt);
    const LayerGradients plain =
        reference_backward(wide(x), Vector<double>::Ones(d), 0.1, wide(d_out));
    apex::testing::expect_close(dx_plain, plain.dx, Tolerance<Scalar>::kRel);
  }
}

TEST(LayerNormBackward, BitIdenticalForAnyThreadCount) {
  const RowMatrix<float> x = random_input<float>(300, 40, 820);
  const RowMatrix<float> d_out = random_matrix<float>(300, 40, 821);
  const Vector<float> gamma = random_gamma<float>(40, 822);
  RowMatrix<float> dx1(300, 40), dx2(300, 40);
  Vector<float> dg1(40), dg2(40), db1(40), db2(40);
  {
    const apex::testing::OneThread one;
    apex::layer_norm_backward(x, gamma, std::nullopt, {}, d_out, dx1, dg1, db1);
  }
  apex::layer_norm_backward(x, gamma, std::nullopt, {}, d_out, dx2, dg2, db2);
  EXPECT_TRUE(same_bits(dx1, dx2) && dg1 == dg2 && db1 == db2);
}

TEST(LayerNormBackward, RejectsBadInputBeforeWriting) {
  const RowMatrix<float> x = random_input<float>(3, 5, 830);
  const Vector<float> gamma = random_gamma<float>(5, 831);
  const RowMatrix<float> d_out = random_matrix<float>(3, 5, 832);
  RowMatrix<float> dx = RowMatrix<float>::Constant(3, 5, 9.0f);
  Vector<float> dg = Vector<float>::Constant(5, 9.0f);
  Vector<float> db = Vector<float>::Constant(5, 9.0f);
  expect_invalid(
      [&] { apex::layer_norm_backward(x, gamma, std::nullopt, {}, d_out, dx, dg, db.head(4)); },
      {"[layer_norm_backward] d_beta length (4)"});
  expect_invalid(
      [&] {
        apex::layer_norm_backward(x, Vector<float>(gamma.head(3)), std::nullopt, {}, d_out, dx, dg,
                                  db);
      },
      {"[layer_norm_backward] gamma length (3)"});
  expect_invalid([&] { apex::layer_norm_backward(x, gamma, std::nullopt, {}, d_out, dx, dg, dg); },
                 {"[layer_norm_backward] d_gamma must not overlap d_beta"});
  EXPECT_TRUE((dx.array() == 9.0f).all() && (dg.array() == 9.0f).all() &&
              (db.array() == 9.0f).all());
}

}  // namespace
}  // namespace layer_norm_test
