// SPDX-License-Identifier: MIT
// The RoPE scalings of rope_scaling.hpp (linear, dynamic NTK, Llama 3, LongRoPE): frequencies
// against plain double loops written from the published definitions, against values of
// HuggingFace's formulas evaluated independently (Python float64), tables at positions up to
// 2^20, both pairings and partial rotary, decoding with a cache against the forward pass, and
// bad parameters.
#include <apex/gqa.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/rope.hpp>
#include <apex/rope_scaling.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"
#include "tolerances.hpp"

namespace rope_scaling_test {
namespace {

using apex::DynamicNtkRope;
using apex::Index;
using apex::LinearRope;
using apex::Llama3Rope;
using apex::LongRope;
using apex::LongRopeFactors;
using apex::RopePairing;
using apex::RopeParams;
using apex::RopeScaling;
using apex::RopeTable;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

constexpr double kPi = 3.14159265358979323846;

// ---------------------------------------------------------------------------------------------
// Plain double references, one per kind, written from the definitions (HuggingFace's
// `modeling_rope_utils.py`; Llama 3.1's `apply_scaling` in meta-llama/llama-models; LongRoPE,
// Ding et al. 2024, and Phi-3's `Phi3LongRoPEScaledRotaryEmbedding`).
// ---------------------------------------------------------------------------------------------

// θ_i = 1 / b^(2i/d), i = 0 … d/2 − 1.
std::vector<double> reference_theta(Index d, double base) {
  std::vector<double> theta;
  for (Index i = 0; i < d; i += 2) {
    theta.push_back(1.0 / std::pow(base, static_cast<double>(i) / static_cast<double>(d)));
  }
  return theta;
}

std::vector<double> reference_linear(Index d, double base, double factor) {
  std::vector<double> theta = reference_theta(d, base);
  for (double& t : theta) t = t / factor;
  return theta;
}

std::vector<double> reference_dynamic(Index d, double base, double factor, Index original,
                                      Index length) {
  const double n = static_cast<double>(std::max(length, original));
  const double dd = static_cast<double>(d);
  const double scaled =
      base * std::pow(factor * n / static_cast<double>(original) - factor + 1.0, dd / (dd - 2.0));
  return reference_theta(d, scaled);
}

// Llama 3.1's rule, written with a clamped blend weight: w = clamp((L/λ − lo)/(hi − lo), 0, 1)
// and θ' = (1 − w)·θ/f + w·θ, which is θ/f for long wavelengths and θ for short ones.
std::vector<double> reference_llama3(Index d, double base, const Llama3Rope& p) {
  std::vector<double> theta = reference_theta(d, base);
  const double context = static_cast<double>(p.original_context);
  for (double& t : theta) {
    const double wavelength = 2.0 * kPi / t;
    const double w = std::clamp(
        (context / wavelength - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor), 0.0,
        1.0);
    t = (1.0 - w) * t / p.factor + w * t;
  }
  return theta;
}

std::vector<double> reference_longrope(Index d, double base, const std::vector<double>& factors) {
  std::vector<double> theta = reference_theta(d, base);
  for (std::size_t i = 0; i < theta.size(); ++i) theta[i] = theta[i] / factors[i];
  return theta;
}

// Relative agreement of two frequency computations that round in different places: a few ulp.
constexpr double kThetaRel = 8.0 * std::numeric_limits<double>::epsilon();

void expect_theta(const Vector<double>& actual, const std::vector<double>& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.size(), static_cast<Index>(expected.size())) << what;
  for (Index i = 0; i < actual.size(); ++i) {
    const double e = expected[static_cast<std::size_t>(i)];
    EXPECT_NEAR(actual(i), e, kThetaRel * std::abs(e)) << what << ", pair " << i;
  }
}

// The cos/sin entries of pair i at position m, per pairing, from a table.
double cos_entry(const RopeTable<double>& t, Index m, Index i) {
  return t.cos()(m, t.pairing() == RopePairing::kInterleaved ? 2 * i : i);
}
double sin_entry(const RopeTable<double>& t, Index m, Index i) {
  return t.sin()(m, t.pairing() == RopePairing::kInterleaved ? 2 * i + 1 : i + t.rotary_dim() / 2);
}

// Every entry of a double table against magnitude·cos(m·θ_i) of the reference θ at the given
// positions: the angles differ by m·|Δθ| ≤ m·θ·kThetaRel, so |Δ| ≤ magnitude·(m·θ·kThetaRel
// + 4ε).
void expect_table(const RopeTable<double>& table, const std::vector<double>& theta,
                  double magnitude, const std::vector<Index>& positions, const std::string& what) {
  const double eps = std::numeric_limits<double>::epsilon();
  for (Index m : positions) {
    for (std::size_t i = 0; i < theta.size(); ++i) {
      const double angle = static_cast<double>(m) * theta[i];
      const double tol = magnitude * (angle * kThetaRel + 4.0 * eps);
      const auto pair = static_cast<Index>(i);
      EXPECT_NEAR(cos_entry(table, m, pair), magnitude * std::cos(angle), tol)
          << what << ", m " << m << ", pair " << i;
      EXPECT_NEAR(sin_entry(table, m, pair), magnitude * std::sin(angle), tol)
          << what << ", m " << m << ", pair " << i;
    }
  }
}

// The float table is the double table rounded once, entry by entry.
void expect_float_is_rounded_double(const RopeTable<float>& f, const RopeTable<double>& d,
                                    const std::string& what) {
  ASSERT_EQ(f.cos().rows(), d.cos().rows());
  ASSERT_EQ(f.cos().cols(), d.cos().cols());
  Index mismatches = 0;
  for (Index m = 0; m < d.cos().rows(); ++m) {
    for (Index j = 0; j < d.cos().cols(); ++j) {
      mismatches += f.cos()(m, j) != static_cast<float>(d.cos()(m, j));
      mismatches += f.sin()(m, j) != static_cast<float>(d.sin()(m, j));
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

// One case of every kind, with the reference frequencies it should give for `length`.
struct KindCase {
  std::string name;
  RopeScaling scaling;
  std::vector<double> theta;  // the reference for rotary_dim, base and length below
  double magnitude;
};

constexpr double kBase = 10000.0;

std::vector<double> pair_factors(Index pairs, double first, double step) {
  std::vector<double> f;
  for (Index i = 0; i < pairs; ++i) f.push_back(first + step * static_cast<double>(i));
  return f;
}

std::vector<KindCase> kind_cases(Index rotary_dim, Index length) {
  const Index pairs = rotary_dim / 2;
  std::vector<KindCase> cases;
  cases.push_back({"linear", LinearRope{4.0}, reference_linear(rotary_dim, kBase, 4.0), 1.0});
  cases.push_back({"dynamic", DynamicNtkRope{4.0, 256, 0},
                   reference_dynamic(rotary_dim, kBase, 4.0, 256, length), 1.0});
  const Llama3Rope llama3{8.0, 1.0, 4.0, 64};
  cases.push_back({"llama3", llama3, reference_llama3(rotary_dim, kBase, llama3), 1.0});
  LongRope longrope;
  longrope.short_factor = pair_factors(pairs, 1.0, 0.05);
  longrope.long_factor = pair_factors(pairs, 1.5, 0.5);
  longrope.original_context = 256;
  longrope.scale = 16.0;
  const double af = std::sqrt(1.0 + std::log(16.0) / std::log(256.0));
  const bool long_list = length > 256;
  cases.push_back({"longrope", longrope,
                   reference_longrope(rotary_dim, kBase,
                                      long_list ? longrope.long_factor : longrope.short_factor),
                   af});
  return cases;
}

// ---------------------------------------------------------------------------------------------
// Frequencies
// ---------------------------------------------------------------------------------------------

TEST(RopeScaling, FrequenciesMatchTheDefinitionsForEveryKind) {
  for (Index rotary_dim : {Index{8}, Index{64}, Index{128}}) {
    for (Index length : {Index{100}, Index{4096}}) {
      for (const KindCase& k : kind_cases(rotary_dim, length)) {
        const Vector<double> theta =
            apex::scaled_rope_frequencies(rotary_dim, kBase, k.scaling, length);
        expect_theta(
            theta, k.theta,
            k.name + ", d_r " + std::to_string(rotary_dim) + ", length " + std::to_string(length));
      }
    }
  }
}

// Values of HuggingFace's formulas evaluated in float64 by an independent Python script
// (math module only): Llama 3.1 8B (base 500000, d = 128, factor 8, low 1, high 4, L = 8192),
// dynamic NTK (base 10000, d = 64, factor 4, max_position_embeddings 2048, length 8192) and a
// LongRoPE table (base 10000, d = 96, long_factor_i = 1 + i/4, L = 4096, s = 32).
TEST(RopeScaling, FrequenciesMatchIndependentlyComputedValues) {
  const Vector<double> llama3 = apex::llama3_frequencies(128, 500000.0, {8.0, 1.0, 4.0, 8192});
  const std::vector<std::pair<Index, double>> llama3_expected = {{0, 1.0},
                                                                 {10, 0.12868737343265052},
                                                                 {20, 0.016560440080994446},
                                                                 {30, 0.0013718935677611381},
                                                                 {40, 3.428102195952591e-05},
                                                                 {45, 1.2297638677963614e-05},
                                                                 {50, 4.411534674558404e-06},
                                                                 {63, 3.068925988914511e-07}};
  for (const auto& [i, value] : llama3_expected) {
    EXPECT_NEAR(llama3(i), value, kThetaRel * value) << "llama3 pair " << i;
  }
  const DynamicNtkRope dynamic{4.0, 2048, 0};
  EXPECT_NEAR(apex::dynamic_ntk_base(64, 10000.0, dynamic, 8192), 141213.75739786727,
              kThetaRel * 141213.75739786727);
  const Vector<double> dyn = apex::dynamic_ntk_frequencies(64, 10000.0, dynamic, 8192);
  const std::vector<std::pair<Index, double>> dynamic_expected = {
      {0, 1.0}, {5, 0.15679482234197184}, {17, 0.001837079026915096}, {31, 1.025785717048711e-05}};
  for (const auto& [i, value] : dynamic_expected) {
    EXPECT_NEAR(dyn(i), value, kThetaRel * value) << "dynamic pair " << i;
  }
  LongRope longrope;
  longrope.short_factor = pair_factors(48, 1.0, 0.0);
  longrope.long_factor = pair_factors(48, 1.0, 0.25);
  longrope.original_context = 4096;
  longrope.scale = 131072.0 / 4096.0;
  const Vector<double> lr = apex::longrope_frequencies(96, 10000.0, longrope, 131072);
  const std::vector<std::pair<Index, double>> longrope_expected = {
      {0, 1.0}, {7, 0.09491480784300134}, {23, 0.0017948557905608715}, {47, 9.50217771473403e-06}};
  for (const auto& [i, value] : longrope_expected) {
    EXPECT_NEAR(lr(i), value, kThetaRel * value) << "longrope pair " << i;
  }
  EXPECT_NEAR(apex::longrope_attention_factor(longrope), 1.1902380714238083, 4e-16);
}

TEST(RopeScaling, Llama3KeepsHighBlendsMiddleAndDividesLowFrequencies) {
  const Llama3Rope p{8.0, 1.0, 4.0, 8192};
  const Vector<double> plain = apex::rope_frequencies(128, 500000.0);
  const Vector<double> scaled = apex::llama3_frequencies(128, 500000.0, p);
  Index kept = 0;
  Index divided = 0;
  Index blended = 0;
  for (Index i = 0; i < plain.size(); ++i) {
    const double wavelength = 2.0 * kPi / plain(i);
    if (wavelength < 8192.0 / 4.0) {
      EXPECT_EQ(scaled(i), plain(i)) << i;
      ++kept;
    } else if (wavelength > 8192.0) {
      EXPECT_EQ(scaled(i), plain(i) / 8.0) << i;
      ++divided;
    } else {
      EXPECT_LT(scaled(i), plain(i)) << i;
      EXPECT_GT(scaled(i), plain(i) / 8.0) << i;
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  // θ' does not increase with i (the blend is continuous at both bounds).
  for (Index i = 1; i < scaled.size(); ++i) EXPECT_LE(scaled(i), scaled(i - 1)) << i;
}

TEST(RopeScaling, DynamicIsPlainUpToTheOriginalContext) {
  const DynamicNtkRope p{4.0, 512, 0};
  for (Index length : {Index{1}, Index{300}, Index{512}}) {
    const Vector<double> theta = apex::dynamic_ntk_frequencies(32, kBase, p, length);
    EXPECT_EQ(theta, apex::rope_frequencies(32, kBase)) << length;
  }
  // A stated length overrides the table's; longer lengths lower every frequency but the first.
  DynamicNtkRope fixed = p;
  fixed.length = 2048;
  EXPECT_EQ(apex::dynamic_ntk_frequencies(32, kBase, fixed, 600),
            apex::dynamic_ntk_frequencies(32, kBase, p, 2048));
  const Vector<double> longer = apex::dynamic_ntk_frequencies(32, kBase, p, 4096);
  const Vector<double> shorter = apex::dynamic_ntk_frequencies(32, kBase, p, 1024);
  EXPECT_EQ(longer(0), 1.0);
  for (Index i = 1; i < longer.size(); ++i) EXPECT_LT(longer(i), shorter(i)) << i;
}

TEST(RopeScaling, LongRopePicksItsListByLengthUnlessTold) {
  LongRope p;
  p.short_factor = pair_factors(4, 1.0, 0.5);
  p.long_factor = pair_factors(4, 2.0, 1.0);
  p.original_context = 100;
  EXPECT_EQ(apex::longrope_frequencies(8, kBase, p, 100),
            apex::longrope_frequencies(8, kBase, p, 50));
  EXPECT_NE(apex::longrope_frequencies(8, kBase, p, 101),
            apex::longrope_frequencies(8, kBase, p, 100));
  expect_theta(apex::longrope_frequencies(8, kBase, p, 101),
               reference_longrope(8, kBase, p.long_factor), "long");
  p.factors = LongRopeFactors::kShort;
  expect_theta(apex::longrope_frequencies(8, kBase, p, 1 << 20),
               reference_longrope(8, kBase, p.short_factor), "short forced");
  p.factors = LongRopeFactors::kLong;
  expect_theta(apex::longrope_frequencies(8, kBase, p, 1),
               reference_longrope(8, kBase, p.long_factor), "long forced");
  // The attention factor: given, or √(1 + ln s / ln L) for s > 1, 1 otherwise.
  p.scale = 1.0;
  EXPECT_EQ(apex::longrope_attention_factor(p), 1.0);
  p.scale = 32.0;
  EXPECT_DOUBLE_EQ(apex::longrope_attention_factor(p),
                   std::sqrt(1.0 + std::log(32.0) / std::log(100.0)));
  p.attention_factor = 1.25;
  EXPECT_EQ(apex::longrope_attention_factor(p), 1.25);
}

// ---------------------------------------------------------------------------------------------
// Tables
// ---------------------------------------------------------------------------------------------

TEST(RopeScaling, TablesMatchTheReferenceBothPairingsAndPartialRotary) {
  const Index positions = 600;
  for (RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    for (Index rotary_dim : {Index{0}, Index{6}}) {
      const Index head_dim = 10;
      const Index d = rotary_dim == 0 ? head_dim : rotary_dim;
      for (const KindCase& k : kind_cases(d, positions)) {
        const RopeParams params{kBase, rotary_dim, pairing};
        const auto table = apex::scaled_rope_table<double>(positions, head_dim, params, k.scaling);
        const std::string what =
            k.name + (pairing == RopePairing::kInterleaved ? ", interleaved" : ", half-split") +
            ", d_r " + std::to_string(d);
        EXPECT_EQ(table.rotary_dim(), d) << what;
        EXPECT_EQ(table.head_dim(), head_dim) << what;
        EXPECT_EQ(table.pairing(), pairing) << what;
        expect_table(table, k.theta, k.magnitude, {0, 1, 17, 255, 256, 599}, what);
        expect_float_is_rounded_double(
            apex::scaled_rope_table<float>(positions, head_dim, params, k.scaling), table, what);
      }
    }
  }
}

// Positions up to 2^20 (a million-token context), in a table of rotary width 8: the angles are
// formed in double, so the entries stay within kThetaRel·m·θ of the reference.
TEST(RopeScaling, TablesAreExactAtPositionsUpToTwoToTheTwenty) {
  const Index positions = (Index{1} << 20) + 1;
  for (const KindCase& k : kind_cases(8, positions)) {
    const auto table = apex::scaled_rope_table<double>(
        positions, 8, {kBase, 0, RopePairing::kHalfSplit}, k.scaling);
    expect_table(table, k.theta, k.magnitude,
                 {Index{1} << 19, (Index{1} << 20) - 1, Index{1} << 20}, k.name + ", 2^20");
  }
}

TEST(RopeScaling, PlainScalingIsThePlainTable) {
  const RopeParams params{500000.0, 6, RopePairing::kHalfSplit};
  const auto scaled = apex::scaled_rope_table<float>(100, 8, params, RopeScaling{});
  const RopeTable<float> plain(100, 8, params);
  EXPECT_EQ(scaled.cos(), plain.cos());
  EXPECT_EQ(scaled.sin(), plain.sin());
  // A factor of 1 changes nothing either.
  const auto linear = apex::scaled_rope_table<float>(100, 8, params, LinearRope{1.0});
  EXPECT_EQ(linear.cos(), plain.cos());
}

TEST(RopeScaling, ScaledTablesRotate16BitRows) {
  const Index positions = 64;
  for (const KindCase& k : kind_cases(8, positions)) {
    const auto table = apex::scaled_rope_table<float>(
        positions, 8, {kBase, 0, RopePairing::kHalfSplit}, k.scaling);
    const RowMatrix<float> x = random_matrix<float>(5, 16, 7);
    RowMatrix<Eigen::bfloat16> x16 = x.cast<Eigen::bfloat16>();
    RowMatrix<float> widened = x16.cast<float>();
    apex::apply_rope(table, 40, widened);
    apex::apply_rope(table, 40, x16);
    // Each output is the float rotation of the widened input, rounded once.
    EXPECT_EQ(x16, widened.cast<Eigen::bfloat16>()) << k.name;
  }
}

// ---------------------------------------------------------------------------------------------
// Tables compose with caches: 1000 tokens decoded one at a time = one forward pass
// ---------------------------------------------------------------------------------------------

TEST(RopeScaling, DecodingWithEveryKindEqualsTheForwardPass) {
  const apex::testing::OneThread one_thread;
  constexpr Index kTokens = 1000;
  const auto layer = apex::GroupedQueryAttention<float>::random(apex::GqaConfig{16, 4, 2, 8}, 4242);
  const RowMatrix<float> x = random_matrix<float>(kTokens, 16, 4243);
  const apex::PositionMask rule = apex::causal_mask();
  for (const KindCase& k : kind_cases(8, kTokens)) {
    const auto table =
        apex::scaled_rope_table<float>(kTokens, 8, {kBase, 0, RopePairing::kHalfSplit}, k.scaling);
    apex::AttentionLayerParams<float> params;
    params.rope = &table;
    apex::AttentionMask<float> mask;
    mask.positions = rule;
    const RowMatrix<float> expected = layer.forward(x, 1, mask, params);
    apex::KvCache<float> cache = layer.make_cache(1, kTokens);
    RowMatrix<float> decoded(kTokens, 16);
    for (Index t = 0; t < kTokens; ++t) {
      params.position_offset = t;
      decoded.row(t) = layer.forward_cached(x.middleRows(t, 1), rule, params, cache);
    }
    const double tol = apex::testing::Tolerances<float>::kDecode;
    for (Index t = 0; t < kTokens; ++t) {
      const double scale = std::max(expected.row(t).cwiseAbs().maxCoeff(), 1e-30F);
      ASSERT_LE((decoded.row(t) - expected.row(t)).cwiseAbs().maxCoeff(), tol * scale)
          << k.name << ", token " << t;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bad parameters: a clear std::invalid_argument naming the field
// ---------------------------------------------------------------------------------------------

TEST(RopeScaling, BadParametersNameTheField) {
  const auto table = [](const RopeScaling& s, Index rotary_dim = 8) {
    return apex::scaled_rope_table<float>(16, rotary_dim, {kBase, 0, RopePairing::kHalfSplit}, s);
  };
  for (double factor : {0.0, -1.0, 0.5, std::nan(""), HUGE_VAL}) {
    expect_invalid([&] { table(LinearRope{factor}); }, {"[rope linear]", "factor"});
    expect_invalid([&] { table(DynamicNtkRope{factor, 8, 0}); }, {"[rope dynamic]", "factor"});
    expect_invalid([&] { table(Llama3Rope{factor, 1.0, 4.0, 8}); }, {"[rope llama3]", "factor"});
  }
  expect_invalid(
      [&] {
        table(DynamicNtkRope{2.0, 0, 0});
      },
      {"[rope dynamic]", "original_context (0)"});
  expect_invalid([&] { table(DynamicNtkRope{2.0, 8, -1}); }, {"[rope dynamic]", "length (-1)"});
  expect_invalid(
      [&] {
        table(DynamicNtkRope{2.0, 8, 0}, 2);
      },
      {"[rope dynamic]", "rotary_dim (2)"});
  expect_invalid(
      [&] {
        table(Llama3Rope{8.0, 4.0, 4.0, 8});
      },
      {"[rope llama3]", "high_freq_factor (4)", "low_freq_factor (4)"});
  expect_invalid(
      [&] {
        table(Llama3Rope{8.0, 4.0, 1.0, 8});
      },
      {"[rope llama3]", "high_freq_factor (1)"});
  expect_invalid(
      [&] {
        table(Llama3Rope{8.0, 0.0, 4.0, 8});
      },
      {"[rope llama3]", "low_freq_factor (0)"});
  expect_invalid(
      [&] {
        table(Llama3Rope{8.0, 1.0, 4.0, 0});
      },
      {"[rope llama3]", "original_context (0)"});
  LongRope longrope;
  longrope.short_factor = pair_factors(4, 1.0, 0.0);
  longrope.long_factor = pair_factors(4, 1.0, 0.0);
  longrope.original_context = 8;
  EXPECT_NO_THROW(table(longrope));
  LongRope wrong = longrope;
  wrong.short_factor.pop_back();
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "short_factor has 3 entries", "4"});
  wrong = longrope;
  wrong.original_context = 4;  // a 16-position table now reads long_factor
  wrong.long_factor.push_back(1.0);
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "long_factor has 5 entries"});
  wrong = longrope;
  wrong.short_factor[2] = 0.0;
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "short_factor[2] (0)"});
  wrong = longrope;
  wrong.attention_factor = -1.0;
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "attention_factor (-1)"});
  wrong = longrope;
  wrong.scale = 0.0;
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "scale (0)"});
  wrong = longrope;
  wrong.original_context = 0;
  expect_invalid([&] { table(wrong); }, {"[rope longrope]", "original_context (0)"});
  // An attention factor outside float's normal range would give infinite or flushed entries.
  wrong = longrope;
  wrong.attention_factor = 1e39;
  expect_invalid([&] { table(wrong); }, {"[rope]", "magnitude"});
  // The table's own arguments are checked as for RopeTable.
  expect_invalid([&] { apex::scaled_rope_table<float>(0, 8, {}, LinearRope{2.0}); },
                 "max_positions (0)");
  expect_invalid(
      [&] {
        apex::scaled_rope_table<float>(8, 8, {kBase, 10, RopePairing::kHalfSplit}, LinearRope{2.0});
      },
      "rotary_dim (10)");
}

}  // namespace
}  // namespace rope_scaling_test
