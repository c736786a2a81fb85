// SPDX-License-Identifier: MIT
#include <apex/yarn.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "reference/rope.hpp"
#include "test_util.hpp"

namespace yarn_test {
namespace {

using apex::Index;
using apex::RopePairing;
using apex::RopeParams;
using apex::RopeTable;
using apex::RowMatrix;
using apex::Vector;
using apex::YarnParams;
using apex::YarnRegime;
using apex::YarnTemperature;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

constexpr double kPi = 3.14159265358979323846;

// The §5.6 configuration: 4K → 128K.
YarnParams example_params() {
  YarnParams p;
  p.scale = 32.0;
  p.original_context = 4096;
  p.base = 10000.0;
  return p;
}

// Tolerance of a RoPE kernel against the double reference with inputs in [-1, 1] and tables of
// magnitude M: each output rounds c, s, two products and a sum, ≤ 3·ε·M (see rope_test.cpp).
template <class Scalar>
double kernel_tolerance(double magnitude) {
  return 4.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon()) *
         std::max(1.0, magnitude);
}

// A spread of realistic configurations for the property tests.
std::vector<std::pair<Index, YarnParams>> random_configurations() {
  std::vector<std::pair<Index, YarnParams>> out;
  std::mt19937 rng(2024);
  const Index dims[] = {8, 16, 32, 64, 96, 128, 256};
  const double bases[] = {10000.0, 500000.0, 1e6};
  const Index contexts[] = {2048, 4096, 8192, 32768, 131072};
  const double scales[] = {1.5, 4.0, 8.0, 32.0, 40.0};
  for (int trial = 0; trial < 200; ++trial) {
    YarnParams p;
    p.base = bases[rng() % 3];
    p.original_context = contexts[rng() % 5];
    p.scale = scales[rng() % 5];
    p.truncate = rng() % 2 == 0;
    if (rng() % 4 == 0) {
      p.beta_fast = 16.0;
      p.beta_slow = 2.0;
    }
    out.emplace_back(dims[rng() % 7], p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Worked examples

TEST(Yarn, S5_5_Temperature) {
  YarnParams p = example_params();
  EXPECT_NEAR(apex::yarn_attention_factor(p), 1.346574, 5e-7);
  EXPECT_NEAR(apex::yarn_attention_factor(p), 1.347, 5e-4);  // as printed
  p.scale = 1.0;
  EXPECT_EQ(apex::yarn_attention_factor(p), 1.0);
}

TEST(Yarn, S5_6_Extending4KTo128K) {
  // §5.6's own classification is self-contradictory ("628 > 32 but 628 < 32"); the reference
  // formulation (SEED-NOTES.md) gives lo = 5, hi = 12 and reproduces its pair 0, 8, 15 regimes.
  const YarnParams p = example_params();
  const apex::YarnCorrectionRange range = apex::yarn_correction_range(32, p);
  EXPECT_EQ(range.low, 5.0);
  EXPECT_EQ(range.high, 12.0);

  const Vector<double> ramp = apex::yarn_ramp(32, p);
  ASSERT_EQ(ramp.size(), 16);
  EXPECT_DOUBLE_EQ(ramp(8), 3.0 / 7.0);

  const Vector<double> theta = apex::yarn_frequencies(32, p);
  ASSERT_EQ(theta.size(), 16);
  EXPECT_EQ(theta(0), 1.0);                // pair 0: λ = 6.28, high frequency, unscaled
  EXPECT_NEAR(theta(8), 0.0058482, 5e-8);  // pair 8: blended
  // §5.6 prints θ_15 = 0.0001 (rounded); 10000^(-30/32) = 1.77828e-4, and θ'_15 = θ_15 / 32.
  const double theta15 = std::pow(10000.0, -30.0 / 32.0);
  EXPECT_NEAR(theta15, 1.77828e-4, 5e-10);
  EXPECT_DOUBLE_EQ(theta(15), theta15 / 32.0);

  const std::vector<YarnRegime> regimes = apex::yarn_regimes(32, p);
  ASSERT_EQ(regimes.size(), 16u);
  for (std::size_t i = 0; i < 16; ++i) {
    const YarnRegime expected = i <= 5    ? YarnRegime::kHighFrequency
                                : i >= 12 ? YarnRegime::kLowFrequency
                                          : YarnRegime::kMidFrequency;
    EXPECT_EQ(regimes[i], expected) << "pair " << i;
  }
}

TEST(Yarn, DeepSeekV3Temperature) {
  // DeepSeek-V3: s = 40, mscale = mscale_all_dim = 1: the tables carry get/get = 1 and the
  // softmax scale is multiplied by get(40, 1)² = 1.8739 (SEED-NOTES.md).
  YarnParams p;
  p.scale = 40.0;
  p.original_context = 4096;
  p.mscale = 1.0;
  p.mscale_all_dim = 1.0;
  const double get = 0.1 * std::log(40.0) + 1.0;
  EXPECT_EQ(apex::yarn_attention_factor(p), 1.0);
  EXPECT_EQ(apex::yarn_table_magnitude(p), 1.0);
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), 1.8739, 5e-5);
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), get * get, 1e-15);
  p.temperature = YarnTemperature::kSoftmaxScale;  // same numbers, since the table factor is 1
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), get * get, 1e-15);

  // DeepSeek-V2: mscale = mscale_all_dim = 0.707, s = 40.
  p.mscale = 0.707;
  p.mscale_all_dim = 0.707;
  p.temperature = YarnTemperature::kInTables;
  const double get707 = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_EQ(apex::yarn_attention_factor(p), 1.0);
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), get707 * get707, 1e-15);

  // mscale alone: DeepSeek's default mscale_all_dim = 0 gives get(s, 0) = 1.
  p.mscale = 1.0;
  p.mscale_all_dim.reset();
  EXPECT_NEAR(apex::yarn_attention_factor(p), get, 1e-15);
  EXPECT_EQ(apex::yarn_softmax_scale_multiplier(p), 1.0);

  // A user-supplied factor overrides step 6.
  p.attention_factor = 1.25;
  EXPECT_EQ(apex::yarn_attention_factor(p), 1.25);
  EXPECT_EQ(apex::yarn_table_magnitude(p), 1.25);
}

TEST(Yarn, TemperaturePlacements) {
  YarnParams p = example_params();
  const double f = 0.1 * std::log(32.0) + 1.0;
  p.temperature = YarnTemperature::kInTables;
  EXPECT_NEAR(apex::yarn_table_magnitude(p), f, 1e-15);
  EXPECT_EQ(apex::yarn_softmax_scale_multiplier(p), 1.0);
  p.temperature = YarnTemperature::kSoftmaxScale;
  EXPECT_EQ(apex::yarn_table_magnitude(p), 1.0);
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), f * f, 1e-15);
  p.temperature = YarnTemperature::kLogits;
  EXPECT_EQ(apex::yarn_table_magnitude(p), 1.0);
  EXPECT_NEAR(apex::yarn_softmax_scale_multiplier(p), f, 1e-15);
  p.temperature = YarnTemperature::kNone;
  EXPECT_EQ(apex::yarn_table_magnitude(p), 1.0);
  EXPECT_EQ(apex::yarn_softmax_scale_multiplier(p), 1.0);
}

TEST(Yarn, FactorInTablesEqualsFactorSquaredInSoftmaxScale) {
  // On fully rotated heads, logits with the factor in the tables equal the unscaled-table logits
  // times the kSoftmaxScale multiplier. Double, d = 64, positions up to 5000: the two logits
  // differ only by rounding, ≲ 1e-13·||q||·||k||.
  YarnParams in_tables = example_params();
  YarnParams in_softmax = in_tables;
  in_softmax.temperature = YarnTemperature::kSoftmaxScale;
  const Index d = 64;
  const auto a = apex::yarn_table<double>(5000, d, 0, RopePairing::kHalfSplit, in_tables);
  const auto b = apex::yarn_table<double>(5000, d, 0, RopePairing::kHalfSplit, in_softmax);
  const double mult_a = apex::yarn_softmax_scale_multiplier(in_tables);
  const double mult_b = apex::yarn_softmax_scale_multiplier(in_softmax);
  std::mt19937 rng(4);
  std::uniform_int_distribution<Index> pos(0, 4999);
  for (int trial = 0; trial < 100; ++trial) {
    const RowMatrix<double> q = random_matrix<double>(1, d, rng);
    const RowMatrix<double> k = random_matrix<double>(1, d, rng);
    const Index m = pos(rng), n = pos(rng);
    const double logit_a = mult_a * apex::rope(a, m, q).cwiseProduct(apex::rope(a, n, k)).sum();
    const double logit_b = mult_b * apex::rope(b, m, q).cwiseProduct(apex::rope(b, n, k)).sum();
    EXPECT_NEAR(logit_a, logit_b, 1e-13 * q.norm() * k.norm() * mult_b);
  }
}

// ---------------------------------------------------------------------------------------------
// Properties

TEST(Yarn, ScaleOneIsPlainRopeExactly) {
  for (const Index d : {2, 8, 30, 64, 128}) {
    for (const double base : {10000.0, 500000.0}) {
      YarnParams p;
      p.scale = 1.0;
      p.original_context = 4096;
      p.base = base;
      EXPECT_EQ(apex::yarn_frequencies(d, p), apex::rope_frequencies(d, base));
      EXPECT_EQ(apex::yarn_table_magnitude(p), 1.0);
      for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
        const auto yarn = apex::yarn_table<float>(100, d + 4, d, pairing, p);
        const RopeTable<float> plain(100, d + 4, RopeParams{base, d, pairing});
        EXPECT_EQ(yarn.cos(), plain.cos());
        EXPECT_EQ(yarn.sin(), plain.sin());
        EXPECT_EQ(yarn.head_dim(), plain.head_dim());
        EXPECT_EQ(yarn.rotary_dim(), plain.rotary_dim());
      }
    }
  }
}

TEST(Yarn, FrequenciesAreMonotoneAndBetweenInterpolationAndExtrapolation) {
  for (const auto& [d, p] : random_configurations()) {
    const Vector<double> theta = apex::rope_frequencies(d, p.base);
    const Vector<double> yarn = apex::yarn_frequencies(d, p);
    ASSERT_EQ(yarn.size(), d / 2);
    for (Index i = 0; i < yarn.size(); ++i) {
      // Within one rounding of the ends of [θ_i / s, θ_i].
      EXPECT_LE(yarn(i), theta(i) * (1 + 1e-15)) << "d " << d << " pair " << i;
      EXPECT_GE(yarn(i), theta(i) / p.scale * (1 - 1e-15)) << "d " << d << " pair " << i;
      if (i > 0) {
        EXPECT_LE(yarn(i), yarn(i - 1)) << "d " << d << " pair " << i;
      }
    }
  }
}

TEST(Yarn, MatchesReference) {
  // The reference blends with keep = 1 − ramp as SEED-NOTES.md writes it; the two orders of
  // evaluation agree to a few ε relative.
  for (const auto& [d, p] : random_configurations()) {
    const std::vector<double> expected =
        apex::reference::yarn_theta(d, p.base, p.scale, static_cast<double>(p.original_context),
                                    p.beta_fast, p.beta_slow, p.truncate);
    const Vector<double> theta = apex::yarn_frequencies(d, p);
    for (Index i = 0; i < theta.size(); ++i) {
      const double e = expected[static_cast<std::size_t>(i)];
      EXPECT_NEAR(theta(i), e, 4 * std::numeric_limits<double>::epsilon() * e)
          << "d " << d << " pair " << i;
    }
  }
}

TEST(Yarn, RegimesFollowRotationsOverTheTrainedContext) {
  // §5.3 in the reference formulation, read in terms of wavelengths: without truncation, a pair
  // whose θ_i turns at least β_fast times over L (λ_i ≤ L/β_fast) keeps θ_i, and one turning at
  // most β_slow times (λ_i ≥ L/β_slow) gets θ_i / s. Checked where the clamps of step 3 do not
  // apply (0 ≤ corr(β_fast), corr(β_slow) ≤ d − 1).
  int checked = 0;
  for (const auto& config : random_configurations()) {
    const Index d = config.first;
    YarnParams p = config.second;
    p.truncate = false;
    const double L = static_cast<double>(p.original_context);
    const auto corr = [&](double n) {
      return static_cast<double>(d) * std::log(L / (2 * kPi * n)) / (2 * std::log(p.base));
    };
    if (corr(p.beta_fast) < 0.0 || corr(p.beta_slow) > static_cast<double>(d - 1)) continue;
    const Vector<double> theta = apex::rope_frequencies(d, p.base);
    const std::vector<YarnRegime> regimes = apex::yarn_regimes(d, p);
    for (Index i = 0; i < theta.size(); ++i) {
      const double rotations = L * theta(i) / (2 * kPi);
      const YarnRegime expected = rotations >= p.beta_fast   ? YarnRegime::kHighFrequency
                                  : rotations <= p.beta_slow ? YarnRegime::kLowFrequency
                                                             : YarnRegime::kMidFrequency;
      EXPECT_EQ(regimes[static_cast<std::size_t>(i)], expected) << "d " << d << " pair " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(Yarn, PartialRotaryUsesTheRotaryDimension) {
  // Head of 64 features, 32 of them rotary: step 2 uses d = 32, as in the §5.6 example.
  const YarnParams p = example_params();
  const auto table = apex::yarn_table<double>(64, 64, 32, RopePairing::kInterleaved, p);
  EXPECT_EQ(table.rotary_dim(), 32);
  EXPECT_EQ(table.head_dim(), 64);
  const auto expected = RopeTable<double>::from_frequencies(apex::yarn_frequencies(32, p), 64, 64,
                                                            RopePairing::kInterleaved,
                                                            apex::yarn_attention_factor(p));
  EXPECT_EQ(table.cos(), expected.cos());
  EXPECT_EQ(table.sin(), expected.sin());
  // Pair 8 at position 1: magnitude · cos(θ'_8).
  EXPECT_NEAR(table.cos()(1, 16), 1.346574 * std::cos(0.0058482), 1e-6);
}

template <class Scalar>
class YarnTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(YarnTyped, Scalars, apex::testing::ScalarName);

TYPED_TEST(YarnTyped, TableAppliedMatchesReference) {
  using Scalar = TypeParam;
  std::mt19937 rng(31);
  YarnParams p = example_params();
  const double magnitude = apex::yarn_attention_factor(p);
  const std::vector<double> theta =
      apex::reference::yarn_theta(32, 10000.0, 32.0, 4096.0, 32.0, 1.0, true);
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const auto table = apex::yarn_table<Scalar>(5000, 40, 32, pairing, p);
    const RowMatrix<Scalar> x = random_matrix<Scalar>(23, 3 * 40, rng);
    std::vector<long long> positions;
    for (long long t = 0; t < 23; ++t) positions.push_back(4970 + t);
    const Eigen::MatrixXd expected =
        apex::reference::rope(x.template cast<double>(), positions, theta, 40,
                              pairing == RopePairing::kHalfSplit, magnitude);
    const RowMatrix<Scalar> y = apex::rope(table, 4970, x);
    // The reference θ' differs from the library's by a few ε relative (see MatchesReference):
    // at m < 5000 that moves an angle by < 1e-14, far inside the tolerance.
    EXPECT_LE((y.template cast<double>() - expected).cwiseAbs().maxCoeff(),
              kernel_tolerance<Scalar>(magnitude));
  }
}

// ---------------------------------------------------------------------------------------------
// Long positions (§4.7 decision: angles in double)

// A float YaRN table of 2^20 positions (s = 32 over L = 32768: exactly the extended context),
// the last position included, against an independent double computation: θ' from the
// reference of SEED-NOTES.md steps 1–5, the angle m·θ' formed once in double, cos/sin
// (argument reduction included) in double, times the factor 0.1·ln(32) + 1. Each entry must be
// that value rounded to float. Tolerance per entry: 2^-24·|v| (float's unit roundoff) plus
// M·2^-30 for the two double computations of θ', which agree to 4ε relative (MatchesReference):
// m·θ' ≤ 2^20, so the angles differ by < 2^20·4ε < 2^-30. An angle formed in float is off by
// ~1e-2 here (checked below, so the test can fail). Memory: 2 × 2^20 × 8 floats = 64 MiB.
TEST(Yarn, FloatTableOf2To20PositionsIsExactToFloatRounding) {
  const Index positions = Index{1} << 20, d = 8;
  YarnParams p;
  p.scale = 32.0;
  p.original_context = 32768;
  const auto table = apex::yarn_table<float>(positions, d, 0, RopePairing::kHalfSplit, p);
  ASSERT_EQ(table.max_positions(), positions);
  EXPECT_EQ(table.cos().size(), positions * d);  // the documented size, nothing more
  const double magnitude = 0.1 * std::log(32.0) + 1.0;
  const std::vector<double> theta =
      apex::reference::yarn_theta(d, p.base, p.scale, 32768.0, p.beta_fast, p.beta_slow, true);
  // The range is not degenerate for this configuration: some pair is really scaled.
  EXPECT_LT(theta.back(), apex::rope_frequencies(d, p.base)(d / 2 - 1));
  const auto tolerance = [&](double v) {
    return std::ldexp(std::abs(v), -24) + magnitude * 0x1p-30;
  };

  std::vector<Index> checked_positions;
  for (Index m = 0; m < positions; m += 4099) checked_positions.push_back(m);
  for (Index m = positions - 64; m < positions; ++m) checked_positions.push_back(m);
  double worst_float_angle = 0.0;
  for (const Index m : checked_positions) {
    for (Index i = 0; i < d / 2; ++i) {
      const double t = theta[static_cast<std::size_t>(i)];
      const double angle = static_cast<double>(m) * t;
      const double c = magnitude * std::cos(angle), s = magnitude * std::sin(angle);
      for (const Index j : {i, i + d / 2}) {  // half-split: both features of pair i
        EXPECT_LE(std::abs(static_cast<double>(table.cos()(m, j)) - c), tolerance(c))
            << "cos at m " << m << " feature " << j;
        EXPECT_LE(std::abs(static_cast<double>(table.sin()(m, j)) - s), tolerance(s))
            << "sin at m " << m << " feature " << j;
      }
      const float float_angle = static_cast<float>(m) * static_cast<float>(t);
      worst_float_angle = std::max(
          worst_float_angle, std::abs(magnitude * std::cos(static_cast<double>(float_angle)) - c));
    }
  }
  EXPECT_GT(worst_float_angle, 1e-3);

  // The last position rotates like the double reference.
  std::mt19937 rng(21);
  const RowMatrix<float> x = random_matrix<float>(2, 2 * d, rng);
  const Eigen::MatrixXd expected = apex::reference::rope(
      x.cast<double>(), {positions - 2, positions - 1}, theta, d, true, magnitude);
  EXPECT_LE((apex::rope(table, positions - 2, x).cast<double>() - expected).cwiseAbs().maxCoeff(),
            kernel_tolerance<float>(magnitude));
}

// ---------------------------------------------------------------------------------------------
// Bad input

TEST(Yarn, RejectsScaleBelowOne) {
  YarnParams p = example_params();
  p.scale = 0.5;
  expect_invalid([&] { apex::yarn_frequencies(32, p); }, {"[yarn]", "scale (0.5)", ">= 1"});
  p.scale = std::numeric_limits<double>::infinity();
  expect_invalid([&] { apex::yarn_attention_factor(p); }, {"[yarn]", "scale (inf)"});
}

TEST(Yarn, RejectsBetaFastNotAboveBetaSlow) {
  YarnParams p = example_params();
  p.beta_fast = 1.0;
  p.beta_slow = 1.0;
  expect_invalid([&] { apex::yarn_frequencies(32, p); },
                 {"[yarn]", "beta_fast (1)", "beta_slow (1)"});
  p.beta_fast = 32.0;
  p.beta_slow = 0.0;
  expect_invalid([&] { apex::yarn_ramp(32, p); }, {"[yarn]", "beta_slow (0)"});
}

TEST(Yarn, RejectsNonPositiveOriginalContext) {
  YarnParams p = example_params();
  p.original_context = 0;
  expect_invalid([&] { apex::yarn_correction_range(32, p); },
                 {"[yarn]", "original_context (0)", "> 0"});
  p.original_context = -4096;
  expect_invalid([&] { apex::yarn_table<float>(16, 32, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "original_context (-4096)"});
}

TEST(Yarn, RejectsBaseNotAboveOne) {
  YarnParams p = example_params();
  p.base = 1.0;
  expect_invalid([&] { apex::yarn_frequencies(32, p); }, {"[yarn]", "base (1)"});
}

TEST(Yarn, RejectsBadDimensionsAndFactors) {
  const YarnParams p = example_params();
  expect_invalid([&] { apex::yarn_frequencies(7, p); }, {"[yarn]", "rotary_dim (7)"});
  expect_invalid([&] { apex::yarn_table<float>(16, 7, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "head_dim (7)"});
  expect_invalid([&] { apex::yarn_table<float>(16, 16, 32, RopePairing::kInterleaved, p); },
                 {"[yarn]", "rotary_dim (32)", "head_dim (16)"});
  YarnParams q = p;
  q.attention_factor = -1.0;
  expect_invalid([&] { apex::yarn_attention_factor(q); }, {"[yarn]", "attention_factor (-1)"});
}

// Whether a table's cos or sin still holds `before`: the shapes first, since == needs equal
// shapes (a rejected assignment must leave the old table in place).
template <class Scalar>
bool unchanged(const RowMatrix<Scalar>& now, const RowMatrix<Scalar>& before) {
  return now.rows() == before.rows() && now.cols() == before.cols() && now == before;
}

TEST(Yarn, RejectsMscaleGivingANonPositiveTemperature) {
  // get(32, -20) = 1 − 2·ln(32) = −5.93: no usable temperature.
  YarnParams p = example_params();
  p.mscale = -20.0;
  expect_invalid([&] { apex::yarn_attention_factor(p); },
                 {"[yarn]", "mscale (-20)", "get(scale, mscale)", "-5.93", "> 0"});
  expect_invalid([&] { apex::yarn_softmax_scale_multiplier(p); }, {"[yarn]", "mscale (-20)"});
  expect_invalid([&] { apex::yarn_table<float>(8, 8, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "mscale (-20)"});
  // Just past the zero of get(s, m) at m = −10 / ln(s): get = −0.01.
  p.scale = 16.0;
  p.mscale = -1.01 * 10.0 / std::log(16.0);
  expect_invalid([&] { apex::yarn_attention_factor(p); },
                 {"[yarn]", "get(scale, mscale)", "-0.01"});
  p.mscale.reset();
  p.mscale_all_dim = -20.0;  // the denominator, and w of the softmax multiplier
  expect_invalid([&] { apex::yarn_softmax_scale_multiplier(p); },
                 {"[yarn]", "mscale_all_dim (-20)", "get(scale, mscale_all_dim)"});
  p.mscale_all_dim = std::numeric_limits<double>::infinity();
  expect_invalid([&] { apex::yarn_attention_factor(p); },
                 {"[yarn]", "mscale_all_dim (inf)", "finite"});
  // At s = 1 the temperature is 1 whatever m is: accepted.
  p.scale = 1.0;
  p.mscale = -20.0;
  p.mscale_all_dim = -20.0;
  EXPECT_EQ(apex::yarn_attention_factor(p), 1.0);
  EXPECT_EQ(apex::yarn_softmax_scale_multiplier(p), 1.0);
}

TEST(Yarn, RejectsFactorsThatOverflow) {
  // Each get(s, m) is finite and > 0, but their ratio or square is not.
  YarnParams p = example_params();
  p.mscale = 1e308;         // get = 3.47e307
  p.mscale_all_dim = -2.6;  // get = 0.0989: the ratio overflows
  expect_invalid([&] { apex::yarn_attention_factor(p); },
                 {"[yarn]", "attention factor get(scale, mscale) / get(scale, mscale_all_dim)",
                  "= inf", "finite and > 0"});
  p.mscale.reset();
  p.mscale_all_dim = 1e200;  // w = get² overflows
  expect_invalid([&] { apex::yarn_softmax_scale_multiplier(p); },
                 {"[yarn]", "softmax scale multiplier (inf)", "finite and > 0"});
  p.mscale_all_dim.reset();
  p.attention_factor = 1e200;
  p.temperature = YarnTemperature::kSoftmaxScale;  // factor² overflows
  expect_invalid([&] { apex::yarn_softmax_scale_multiplier(p); },
                 {"[yarn]", "softmax scale multiplier (inf)", "attention factor (1e+200)"});
  p.attention_factor = 1e-200;  // factor² underflows to 0
  expect_invalid([&] { apex::yarn_softmax_scale_multiplier(p); },
                 {"[yarn]", "softmax scale multiplier (0)"});
}

TEST(Yarn, CorrectionRangeIsFiniteAndNonEmptyForExtremeBetasAndBases) {
  // β_fast and β_slow tiny: L / (2π·β) overflows, so corr(β_fast) = corr(β_slow) = +inf. Every
  // pair turns more than β_fast times over L and keeps θ (ramp 0).
  YarnParams tiny = example_params();
  tiny.beta_slow = std::numeric_limits<double>::denorm_min();
  tiny.beta_fast = 2 * std::numeric_limits<double>::denorm_min();
  apex::YarnCorrectionRange range = apex::yarn_correction_range(32, tiny);
  EXPECT_EQ(range.low, 31.0);  // capped at d − 1 instead of +inf
  EXPECT_EQ(range.high, 31.0 + 0.001);
  EXPECT_EQ(apex::yarn_frequencies(32, tiny), apex::rope_frequencies(32, tiny.base));
  for (const YarnRegime r : apex::yarn_regimes(32, tiny)) EXPECT_EQ(r, YarnRegime::kHighFrequency);

  // A base just above 1: corr(β) ≈ 3.6e13, where lo + 0.001 == lo. Every pair has θ ≈ 1 and
  // turns ≫ β_fast times over L, so again every pair keeps θ.
  YarnParams near_one = example_params();
  near_one.original_context = Index{1} << 31;
  near_one.base = 1.0 + 0x1p-40;
  range = apex::yarn_correction_range(4, near_one);
  EXPECT_EQ(range.low, 3.0);
  EXPECT_EQ(range.high, 3.0 + 0.001);
  EXPECT_EQ(apex::yarn_frequencies(4, near_one), apex::rope_frequencies(4, near_one.base));

  // Where 0.001 is below the spacing of doubles at lo (d − 1 = 2^50 − 1, spacing 1/8), hi is
  // the next double above lo. (O(1): nothing of size d is built.)
  const Index d = Index{1} << 50;
  range = apex::yarn_correction_range(d, near_one);
  EXPECT_EQ(range.low, static_cast<double>(d - 1));
  EXPECT_EQ(range.high, std::nextafter(range.low, std::numeric_limits<double>::infinity()));
  EXPECT_LT(range.low, range.high);
}

TEST(Yarn, TableChecksEveryArgumentBeforeAllocating) {
  // head_dim = 2^62 would need 2^61 frequencies before the table: every argument is checked
  // first, so these are std::invalid_argument and never std::bad_alloc.
  YarnParams p = example_params();
  const Index huge = Index{1} << 62;
  expect_invalid([&] { apex::yarn_table<float>(0, huge, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "max_positions (0)", "at least 1"});
  expect_invalid([&] { apex::yarn_table<float>(1, huge, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "table bytes", "overflows"});
  expect_invalid([&] { apex::yarn_table<double>(huge, 2, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "max_positions x rotary_dim", "(4611686018427387904 x 2)"});
  p.mscale = -20.0;
  expect_invalid(
      [&] { apex::yarn_table<float>(1, Index{1} << 40, 0, RopePairing::kInterleaved, p); },
      {"[yarn]", "mscale (-20)"});
}

TEST(Yarn, RejectsTableMagnitudeOutsideTheScalarRange) {
  // A factor that float cannot hold would make every float entry infinite.
  YarnParams p = example_params();
  p.attention_factor = 1e39;
  RopeTable<float> table =
      apex::yarn_table<float>(4, 8, 0, RopePairing::kInterleaved, example_params());
  const RowMatrix<float> before = table.cos();
  expect_invalid([&] { table = apex::yarn_table<float>(4, 8, 0, RopePairing::kInterleaved, p); },
                 {"[yarn]", "table magnitude (attention factor) (1e+39)", "normal range of float"});
  EXPECT_TRUE(unchanged(table.cos(), before));
  // Double holds it; and with the factor outside the tables, float does too.
  const auto wide = apex::yarn_table<double>(4, 8, 0, RopePairing::kInterleaved, p);
  EXPECT_TRUE(wide.cos().allFinite() && wide.sin().allFinite());
  EXPECT_EQ(wide.cos()(0, 0), 1e39);
  p.temperature = YarnTemperature::kLogits;
  const auto outside = apex::yarn_table<float>(4, 8, 0, RopePairing::kInterleaved, p);
  EXPECT_EQ(outside.cos()(0, 0), 1.0f);
}

}  // namespace
}  // namespace yarn_test
