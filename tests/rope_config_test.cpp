// SPDX-License-Identifier: MIT
// The config entry point (rope_config.hpp): the rope_scaling entries of real checkpoints' config
// files give the tables built by hand from each kind's parameters, HuggingFace's reading of the
// fields (factor from the two context lengths, DeepSeek's mscale pair, beta 0 as unset), and a
// clear error naming the field for every missing, unused or inconsistent one.
#include <apex/rope_config.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace rope_config_test {
namespace {

using apex::Index;
using apex::RopeConfig;
using apex::RopePairing;
using apex::RopeTable;
using apex::testing::expect_invalid;

void expect_same_table(const RopeTable<double>& actual, const RopeTable<double>& expected,
                       const std::string& what) {
  EXPECT_EQ(actual.head_dim(), expected.head_dim()) << what;
  EXPECT_EQ(actual.rotary_dim(), expected.rotary_dim()) << what;
  EXPECT_EQ(actual.pairing(), expected.pairing()) << what;
  EXPECT_EQ(actual.cos(), expected.cos()) << what;
  EXPECT_EQ(actual.sin(), expected.sin()) << what;
}

// Llama 3.1 8B's config.json: rope_theta 500000, head_dim 128, max_position_embeddings 131072,
// rope_scaling {factor 8, low_freq_factor 1, high_freq_factor 4,
// original_max_position_embeddings 8192, rope_type llama3}.
RopeConfig llama31() {
  RopeConfig c;
  c.rope_type = "llama3";
  c.rope_theta = 500000.0;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.factor = 8.0;
  c.low_freq_factor = 1.0;
  c.high_freq_factor = 4.0;
  c.original_max_position_embeddings = 8192;
  return c;
}

// Phi-3-mini-128k's shape: head_dim 96, max_position_embeddings 131072, top-level
// original_max_position_embeddings 4096, rope_scaling {type su/longrope, short_factor,
// long_factor} with 48 entries each (values here are illustrative).
RopeConfig phi3() {
  RopeConfig c;
  c.rope_type = "longrope";
  c.head_dim = 96;
  c.max_position_embeddings = 131072;
  c.original_max_position_embeddings = 4096;
  for (Index i = 0; i < 48; ++i) {
    c.short_factor.push_back(1.0 + 0.01 * static_cast<double>(i));
    c.long_factor.push_back(1.0 + 0.5 * static_cast<double>(i));
  }
  return c;
}

// DeepSeek-V3's config.json: qk_rope_head_dim 64, rope_theta 10000, max_position_embeddings
// 163840, rope_scaling {beta_fast 32, beta_slow 1, factor 40, mscale 1, mscale_all_dim 1,
// original_max_position_embeddings 4096, type yarn}.
RopeConfig deepseek_v3() {
  RopeConfig c;
  c.rope_type = "yarn";
  c.head_dim = 64;
  c.max_position_embeddings = 163840;
  c.factor = 40.0;
  c.original_max_position_embeddings = 4096;
  c.beta_fast = 32.0;
  c.beta_slow = 1.0;
  c.mscale = 1.0;
  c.mscale_all_dim = 1.0;
  c.pairing = RopePairing::kInterleaved;  // DeepSeek's checkpoints rotate neighbouring pairs
  return c;
}

TEST(RopeConfig, Llama31IsTheLlama3Table) {
  const auto table = apex::rope_config_table<double>(llama31(), 256);
  const auto expected = apex::scaled_rope_table<double>(
      256, 128, {500000.0, 0, RopePairing::kHalfSplit}, apex::Llama3Rope{8.0, 1.0, 4.0, 8192});
  expect_same_table(table, expected, "llama3");
  EXPECT_EQ(apex::rope_config_softmax_multiplier(llama31()), 1.0);
}

TEST(RopeConfig, Phi3IsLongRopeScaledByTheContextRatio) {
  const RopeConfig c = phi3();
  apex::LongRope p;
  p.short_factor = c.short_factor;
  p.long_factor = c.long_factor;
  p.original_context = 4096;
  p.scale = 32.0;
  for (Index positions : {Index{100}, Index{4097}}) {
    const auto table = apex::rope_config_table<double>(c, positions);
    expect_same_table(
        table,
        apex::scaled_rope_table<double>(positions, 96, {10000.0, 0, RopePairing::kHalfSplit}, p),
        "phi3, " + std::to_string(positions));
    // √(1 + ln 32 / ln 4096) in every entry: cos(0) = 1 times the factor.
    EXPECT_DOUBLE_EQ(table.cos()(0, 0), std::sqrt(1.0 + std::log(32.0) / std::log(4096.0)));
  }
  RopeConfig su = c;
  su.rope_type = "su";
  expect_same_table(apex::rope_config_table<double>(su, 64), apex::rope_config_table<double>(c, 64),
                    "su");
  // Without the top-level context field, the scale is rope_scaling's factor.
  RopeConfig with_factor = c;
  with_factor.original_max_position_embeddings.reset();
  with_factor.factor = 32.0;
  with_factor.max_position_embeddings = 4096;
  expect_same_table(apex::rope_config_table<double>(with_factor, 64),
                    apex::rope_config_table<double>(c, 64), "factor");
}

TEST(RopeConfig, DeepSeekV3IsYarnWithItsSoftmaxMultiplier) {
  const RopeConfig c = deepseek_v3();
  apex::YarnParams y;
  y.scale = 40.0;
  y.original_context = 4096;
  y.mscale = 1.0;
  y.mscale_all_dim = 1.0;
  const auto expected = apex::yarn_table<double>(64, 64, 0, RopePairing::kInterleaved, y);
  expect_same_table(apex::rope_config_table<double>(c, 64), expected, "deepseek");
  const double get = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(apex::rope_config_softmax_multiplier(c), get * get);
  EXPECT_NEAR(apex::rope_config_softmax_multiplier(c), 1.8739, 1e-4);
}

TEST(RopeConfig, YarnReadsFieldsAsHuggingFaceDoes) {
  // Qwen3 with YaRN enabled: factor 4 over 32768, max_position_embeddings 131072.
  RopeConfig c;
  c.rope_type = "yarn";
  c.rope_theta = 1000000.0;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.factor = 4.0;
  c.original_max_position_embeddings = 32768;
  apex::YarnParams y;
  y.base = 1000000.0;
  y.scale = 4.0;
  y.original_context = 32768;
  expect_same_table(apex::rope_config_table<double>(c, 64),
                    apex::yarn_table<double>(64, 128, 0, RopePairing::kHalfSplit, y), "qwen3");
  // beta 0 counts as unset (HuggingFace's `or 32`); truncate false keeps real bounds (gpt-oss).
  RopeConfig zero_beta = c;
  zero_beta.beta_fast = 0.0;
  zero_beta.beta_slow = 0.0;
  expect_same_table(apex::rope_config_table<double>(zero_beta, 64),
                    apex::rope_config_table<double>(c, 64), "beta 0");
  RopeConfig real_bounds = c;
  real_bounds.truncate = false;
  y.truncate = false;
  expect_same_table(apex::rope_config_table<double>(real_bounds, 64),
                    apex::yarn_table<double>(64, 128, 0, RopePairing::kHalfSplit, y), "truncate");
  // mscale alone does not enter HuggingFace's factor: 0.1·ln(s) + 1 in the tables.
  RopeConfig mscale_only = c;
  mscale_only.mscale = 0.707;
  EXPECT_DOUBLE_EQ(apex::rope_config_table<double>(mscale_only, 1).cos()(0, 0),
                   0.1 * std::log(4.0) + 1.0);
  EXPECT_EQ(apex::rope_config_softmax_multiplier(mscale_only), 1.0);
  // A given attention factor wins.
  RopeConfig given = c;
  given.attention_factor = 1.5;
  EXPECT_EQ(apex::rope_config_table<double>(given, 1).cos()(0, 0), 1.5);
  // Without original_max_position_embeddings the factor is read and L is
  // max_position_embeddings.
  RopeConfig no_original = c;
  no_original.original_max_position_embeddings.reset();
  no_original.max_position_embeddings = 32768;
  expect_same_table(apex::rope_config_table<double>(no_original, 64),
                    apex::rope_config_table<double>(c, 64), "no original");
}

TEST(RopeConfig, LinearDynamicAndDefault) {
  RopeConfig linear;
  linear.rope_type = "linear";
  linear.rope_theta = 1000000.0;
  linear.head_dim = 16;
  linear.factor = 8.0;  // Gemma 3's global layers
  expect_same_table(apex::rope_config_table<double>(linear, 32),
                    apex::scaled_rope_table<double>(32, 16, {1000000.0, 0, RopePairing::kHalfSplit},
                                                    apex::LinearRope{8.0}),
                    "linear");
  RopeConfig dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.head_dim = 16;
  dynamic.max_position_embeddings = 64;
  dynamic.factor = 2.0;
  expect_same_table(apex::rope_config_table<double>(dynamic, 256),
                    apex::scaled_rope_table<double>(256, 16, {10000.0, 0, RopePairing::kHalfSplit},
                                                    apex::DynamicNtkRope{2.0, 64, 0}),
                    "dynamic");
  // Partial rotary: int(80 · 0.4) = 32 of Phi-2's 80 features rotate.
  RopeConfig partial;
  partial.head_dim = 80;
  partial.partial_rotary_factor = 0.4;
  const auto table = apex::rope_config_table<double>(partial, 8);
  EXPECT_EQ(table.rotary_dim(), 32);
  EXPECT_EQ(table.head_dim(), 80);
  expect_same_table(table, RopeTable<double>(8, 80, {10000.0, 32, RopePairing::kHalfSplit}),
                    "partial");
}

TEST(RopeConfig, MultimodalSections) {
  RopeConfig qwen2vl;
  qwen2vl.rope_type = "mrope";
  qwen2vl.rope_theta = 1000000.0;
  qwen2vl.head_dim = 128;
  qwen2vl.mrope_section = {16, 24, 24};
  const auto sections = apex::mrope_config_sections(qwen2vl);
  ASSERT_TRUE(sections.has_value());
  EXPECT_EQ(sections->sections[0], 16);
  EXPECT_EQ(sections->sections[2], 24);
  EXPECT_EQ(sections->layout, apex::MropeLayout::kSections);
  expect_same_table(apex::rope_config_table<double>(qwen2vl, 16),
                    RopeTable<double>(16, 128, {1000000.0, 0, RopePairing::kHalfSplit}), "mrope");
  RopeConfig qwen3vl = qwen2vl;
  qwen3vl.rope_type = "default";
  qwen3vl.mrope_section = {24, 20, 20};
  qwen3vl.mrope_interleaved = true;
  EXPECT_EQ(apex::mrope_config_sections(qwen3vl)->layout, apex::MropeLayout::kInterleaved);
  RopeConfig text;
  text.head_dim = 8;
  EXPECT_FALSE(apex::mrope_config_sections(text).has_value());
}

TEST(RopeConfig, BadFieldsAreNamed) {
  const auto table = [](const RopeConfig& c) { (void)apex::rope_config_table<float>(c, 16); };
  RopeConfig c = llama31();
  c.rope_type = "ntk-by-parts";
  expect_invalid([&] { table(c); }, {"[rope_config] rope_type (\"ntk-by-parts\")", "llama3"});
  c = llama31();
  c.low_freq_factor.reset();
  expect_invalid([&] { table(c); },
                 "[rope_config] low_freq_factor is required for rope_type "
                 "\"llama3\"");
  c = llama31();
  c.low_freq_factor = 4.0;
  expect_invalid([&] { table(c); }, "high_freq_factor (4) must be finite and greater than");
  c = llama31();
  c.factor = 0.0;
  expect_invalid([&] { table(c); }, "factor (0)");
  c = llama31();
  c.beta_fast = 32.0;
  expect_invalid([&] { table(c); }, "beta_fast is set, but rope_type \"llama3\" does not use it");
  RopeConfig plain;
  plain.head_dim = 8;
  plain.factor = 2.0;
  expect_invalid([&] { table(plain); }, "factor is set, but rope_type \"default\"");
  plain.factor.reset();
  plain.short_factor = {1.0};
  expect_invalid([&] { table(plain); }, "short_factor is set");
  // Qwen3's default max_position_embeddings with its YaRN block: factor 4 but 40960 / 32768.
  c = RopeConfig{};
  c.rope_type = "yarn";
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.factor = 4.0;
  c.original_max_position_embeddings = 32768;
  expect_invalid([&] { table(c); }, {"factor (4) is inconsistent", "40960 / 32768 = 1.25"});
  // A factor printed to a few digits agrees with the ratio it stands for.
  c.max_position_embeddings = 100000;
  c.original_max_position_embeddings = 3000;
  c.factor = 33.33333333;
  EXPECT_NO_THROW(table(c));
  c.factor = 33.33;
  expect_invalid([&] { table(c); }, "factor (33.33) is inconsistent");
  c.factor.reset();
  c.max_position_embeddings = 0;
  expect_invalid([&] { table(c); }, "max_position_embeddings (0) must be > 0 when");
  c = RopeConfig{};
  c.rope_type = "yarn";
  c.head_dim = 8;
  expect_invalid([&] { table(c); }, "factor is required for rope_type \"yarn\"");
  c.factor = 2.0;
  expect_invalid([&] { table(c); }, "original_max_position_embeddings or max_position_embeddings");
  c = RopeConfig{};
  c.rope_type = "dynamic";
  c.head_dim = 8;
  c.factor = 2.0;
  expect_invalid([&] { table(c); }, "max_position_embeddings (0) must be > 0 for rope_type");
  c.max_position_embeddings = 32;
  c.original_max_position_embeddings = 16;
  expect_invalid([&] { table(c); }, "original_max_position_embeddings (16) must be unset or equal");
  RopeConfig lr = phi3();
  lr.long_factor.pop_back();
  expect_invalid([&] { table(lr); }, "long_factor has 47 entries; expected rotary_dim / 2 = 48");
  lr = phi3();
  lr.factor = 8.0;
  expect_invalid([&] { table(lr); }, "factor (8) is inconsistent");
  // Shapes.
  RopeConfig shape;
  expect_invalid([&] { table(shape); }, "head_dim (0) must be > 0");
  shape.head_dim = 10;
  shape.partial_rotary_factor = 0.5;
  expect_invalid([&] { table(shape); }, "int(10 * 0.5) = 5 must be even");
  shape.partial_rotary_factor = 1.5;
  expect_invalid([&] { table(shape); }, "partial_rotary_factor (1.5) must lie in (0, 1]");
  shape.partial_rotary_factor = 1.0;
  shape.rope_theta = 1.0;
  expect_invalid([&] { table(shape); }, "base (1)");
  RopeConfig mm;
  mm.head_dim = 128;
  mm.mrope_section = {16, 24};
  expect_invalid([&] { table(mm); }, "mrope_section has 2 entries; expected 3");
  mm.mrope_section = {16, 24, 20};
  expect_invalid([&] { table(mm); }, "mrope_section");
}

}  // namespace
}  // namespace rope_config_test
