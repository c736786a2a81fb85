// SPDX-License-Identifier: MIT
#include <apex/kv_cache.hpp>
#include <apex/mla.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/stack.hpp>
#include <apex/yarn.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "reference/embedding.hpp"
#include "reference/rms_norm.hpp"
#include "test_util.hpp"

namespace stack_test {
namespace {

using apex::Index;
using apex::testing::expect_invalid;

apex::StackConfig small_config() {
  apex::StackConfig c;
  c.vocab_size = 50;
  c.d_model = 24;
  c.num_layers = 7;  // layers 0-4 local, 5 global, 6 local
  c.window = 3;
  c.local = apex::GqaConfig{24, 4, 2, 6};
  c.global.d_model = 24;
  c.global.d_q = 10;
  c.global.d_kv = 8;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 6;
  c.global.rope_dim = 4;
  c.max_positions = 16;
  return c;
}

apex::TokenMatrix prompt(Index batch, Index seq) {
  apex::TokenMatrix tokens(batch, seq);
  for (Index b = 0; b < batch; ++b)
    for (Index s = 0; s < seq; ++s) tokens(b, s) = (7 * b + 13 * s + 3) % 50;
  return tokens;
}

// One attention block composed by hand: the layer's projections (tested against plain loops in
// gqa_test / mla_test), the reference attention, the concatenation and W_O.
template <class Layer>
apex::RowMatrix<double> attention_block(const Layer& layer, const apex::RowMatrix<double>& h,
                                        Index batch, const apex::AttentionMask<double>& mask,
                                        const apex::RopeTable<double>& rope,
                                        const apex::SdpaParams& attention = {}) {
  apex::AttentionLayerParams<double> params;
  params.rope = &rope;
  apex::ProjectedQkv<double> p;
  if constexpr (std::is_same_v<Layer, apex::MultiHeadLatentAttention<double>>) {
    p = layer.decompress(h, batch, params);
  } else {
    p = layer.project(h, batch, params);
  }
  apex::RowMatrix<double> heads(h.rows(), p.num_q_heads * p.v_dim);
  const auto out =
      apex::HeadsView<double>::token_major(heads.data(), {batch, p.num_q_heads, p.seq(), p.v_dim});
  apex::reference::sdpa<double>(p.q_heads(), p.k_heads(), p.v_heads(), mask, attention, out);
  return heads * layer.weights().w_o;
}

/// The logits of a stack composed by hand in double: embedding, then every block with its layer's
/// RoPE table and attention parameters (local or global), the final norm and the tied LM head.
struct KindRope {
  const apex::RopeTable<double>& table;
  apex::SdpaParams attention;
};

apex::RowMatrix<double> composed_logits(const apex::AttentionStack<double>& stack,
                                        const apex::TokenMatrix& tokens, Index prefix,
                                        const KindRope& local, const KindRope& global) {
  const apex::StackConfig& config = stack.config();
  const Index batch = tokens.rows();
  const apex::RowMatrix<double>& table = stack.embedding();
  const apex::Vector<double> ones = apex::Vector<double>::Ones(config.d_model);
  apex::RowMatrix<double> x =
      apex::reference::embed(table, tokens, std::sqrt(static_cast<double>(config.d_model)));
  for (Index l = 0; l < config.num_layers; ++l) {
    const apex::RowMatrix<double> h = apex::reference::rms_norm(x, ones, config.norm_eps);
    const apex::AttentionMask<double> mask = stack.mask_for_layer(l, prefix);
    if (const auto* mla = std::get_if<apex::MultiHeadLatentAttention<double>>(&stack.layer(l))) {
      x += attention_block(*mla, h, batch, mask, global.table, global.attention);
    } else {
      const auto& gqa = std::get<apex::GroupedQueryAttention<double>>(stack.layer(l));
      x += attention_block(gqa, h, batch, mask, local.table, local.attention);
    }
  }
  return apex::reference::lm_head(apex::reference::rms_norm(x, ones, config.norm_eps), table);
}

TEST(Stack, ForwardEqualsTheComposedFormulas) {
  const apex::StackConfig config = small_config();
  const auto stack = apex::AttentionStack<double>::random(config, 11);
  const Index batch = 2, seq = 9, prefix = 3;
  const apex::TokenMatrix tokens = prompt(batch, seq);

  const apex::RopeTable<double> local_rope(config.max_positions, config.local.head_dim);
  const apex::RopeTable<double> global_rope(config.max_positions, config.global.rope_dim);
  const apex::RowMatrix<double> expected =
      composed_logits(stack, tokens, prefix, {local_rope, {}}, {global_rope, {}});

  const apex::RowMatrix<double> logits = stack.forward(tokens, prefix);
  ASSERT_EQ(logits.rows(), batch * seq);
  ASSERT_EQ(logits.cols(), config.vocab_size);
  // Double throughout; the fast and reference attention paths differ by rounding only.
  EXPECT_LE((logits - expected).cwiseAbs().maxCoeff(), 1e-12 * expected.cwiseAbs().maxCoeff());

  // The float stack with the same weights agrees to float rounding accumulated over 7 blocks.
  const auto float_stack = apex::AttentionStack<float>::random(config, 11);
  const apex::RowMatrix<float> float_logits = float_stack.forward(tokens, prefix);
  EXPECT_LE((float_logits.cast<double>() - expected).cwiseAbs().maxCoeff(),
            1e-4 * expected.cwiseAbs().maxCoeff());
}

TEST(Stack, S11_2_LayerPlanFollowsTheLayerRule) {
  apex::StackConfig config = small_config();
  config.num_layers = 12;
  const auto stack = apex::AttentionStack<float>::random(config, 1);
  std::string kinds;
  for (const apex::LayerPlan& row : stack.plan()) {
    kinds += row.global ? 'G' : 'L';
    EXPECT_EQ(row.cache_values_per_token,
              row.global ? config.global.d_kv + config.global.num_kv_heads * config.global.rope_dim
                         : 2 * config.local.num_kv_heads * config.local.head_dim);
  }
  EXPECT_EQ(kinds, "LLLLLGLLLLLG");
}

TEST(Stack, LaterTokensNeverReachEarlierLogitsOutsideThePrefix) {
  const auto stack = apex::AttentionStack<double>::random(small_config(), 5);
  const Index seq = 8;
  const apex::TokenMatrix tokens = prompt(1, seq);
  for (const Index prefix : {Index{0}, Index{4}}) {
    const apex::RowMatrix<double> base = stack.forward(tokens, prefix);
    for (Index changed = 0; changed < seq; ++changed) {
      apex::TokenMatrix other = tokens;
      other(0, changed) = (other(0, changed) + 1) % 50;
      const apex::RowMatrix<double> logits = stack.forward(other, prefix);
      for (Index t = 0; t < seq; ++t) {
        // Position t sees token `changed` through some layer iff changed <= t, or both lie in
        // the prefix.
        const bool visible = changed <= t || (t < prefix && changed < prefix);
        const double difference = (logits.row(t) - base.row(t)).cwiseAbs().maxCoeff();
        if (visible) {
          EXPECT_GT(difference, 0.0)
              << "prefix " << prefix << ", t " << t << ", changed " << changed;
        } else {
          EXPECT_EQ(difference, 0.0)
              << "prefix " << prefix << ", t " << t << ", changed " << changed;
        }
      }
    }
  }
}

TEST(Stack, BadInputThrowsClearErrors) {
  const apex::StackConfig config = small_config();
  const auto stack = apex::AttentionStack<float>::random(config, 3);
  apex::TokenMatrix tokens = prompt(1, 6);
  expect_invalid([&] { stack.forward(tokens, 7); }, "prefix (7) must lie in [0, S = 6]");
  tokens(0, 2) = 50;
  expect_invalid([&] { stack.forward(tokens, 0); }, "50");
  expect_invalid([&] { stack.forward(prompt(1, 17), 0); },
                 "sequence length (17) exceeds max_positions (16)");

  apex::StackConfig bad = config;
  bad.window = 0;
  expect_invalid([&] { apex::AttentionStack<float>::random(bad, 1); }, "window W (0)");
  bad = config;
  bad.local.d_model = 12;
  expect_invalid([&] { apex::AttentionStack<float>::random(bad, 1); }, "local.d_model (12)");

  // Layer 5 must be global: a GQA layer in its place is rejected.
  std::vector<apex::AttentionStack<float>::Layer> layers;
  for (Index l = 0; l < config.num_layers; ++l)
    layers.emplace_back(apex::GroupedQueryAttention<float>::random(config.local, 1));
  expect_invalid(
      [&] {
        apex::AttentionStack<float>(
            config, apex::RowMatrix<float>::Zero(config.vocab_size, config.d_model),
            std::vector<apex::Vector<float>>(7, apex::Vector<float>::Ones(config.d_model)),
            apex::Vector<float>::Ones(config.d_model), layers);
      },
      "layer 5 must be MultiHeadLatentAttention");
}

TEST(Stack, ConfigSizesBeyond64BitsAreRejected) {
  apex::StackConfig bad = small_config();
  bad.d_model = 0;
  bad.local.d_model = 0;
  bad.global.d_model = 0;
  expect_invalid([&] { apex::AttentionStack<float>::random(bad, 1); },
                 "[stack] d_model (0) must be >= 1");
  // V·d = 2^40 · 2^30 values: rejected before the embedding table is allocated.
  bad = small_config();
  bad.vocab_size = Index{1} << 40;
  bad.d_model = Index{1} << 30;
  bad.local.d_model = bad.d_model;
  bad.global.d_model = bad.d_model;
  expect_invalid([&] { apex::AttentionStack<float>::random(bad, 1); },
                 {"[stack] embedding bytes V*d*sizeof(Weight)", "overflows 64 bits"});
  // A layer config whose widths overflow makes the cache size meaningless.
  bad = small_config();
  bad.local.num_q_heads = Index{1} << 62;
  bad.local.num_kv_heads = 1;
  expect_invalid([&] { (void)apex::stack_cache_memory(bad, 1, 16, 2); },
                 {"[gqa] num_q_heads*head_dim", "overflows 64 bits"});
}

// ---------------------------------------------------------------------------------------------
// YaRN
// ---------------------------------------------------------------------------------------------

// The stack with YaRN against the same composition by hand, with YaRN tables and, for the
// softmax-scale placement, the multiplier folded into each layer's 1/√d_qk.
TEST(Stack, YarnForwardEqualsTheComposedFormulas) {
  for (const auto temperature :
       {apex::YarnTemperature::kInTables, apex::YarnTemperature::kSoftmaxScale}) {
    apex::StackConfig config = small_config();
    apex::YarnParams yarn;
    yarn.scale = 4.0;
    yarn.original_context = 4;
    yarn.temperature = temperature;
    config.yarn = yarn;
    const auto stack = apex::AttentionStack<double>::random(config, 17);
    const Index batch = 2, seq = 14, prefix = 3;
    const apex::TokenMatrix tokens = prompt(batch, seq);
    const auto local_rope = apex::yarn_table<double>(config.max_positions, config.local.head_dim, 0,
                                                     apex::RopePairing::kInterleaved, yarn);
    const auto global_rope = apex::yarn_table<double>(config.max_positions, config.global.rope_dim,
                                                      0, apex::RopePairing::kInterleaved, yarn);
    const double multiplier = apex::yarn_softmax_scale_multiplier(yarn);
    apex::SdpaParams local_attention, global_attention;
    local_attention.scale = multiplier / std::sqrt(static_cast<double>(config.local.head_dim));
    global_attention.scale = multiplier / std::sqrt(static_cast<double>(config.global.qk_dim()));
    const apex::RowMatrix<double> expected = composed_logits(
        stack, tokens, prefix, {local_rope, local_attention}, {global_rope, global_attention});
    const apex::RowMatrix<double> logits = stack.forward(tokens, prefix);
    EXPECT_LE((logits - expected).cwiseAbs().maxCoeff(), 1e-12 * expected.cwiseAbs().maxCoeff());
    // YaRN changes the result (positions past L = 4 are rotated differently).
    apex::StackConfig plain = config;
    plain.yarn.reset();
    const apex::RowMatrix<double> without =
        apex::AttentionStack<double>::random(plain, 17).forward(tokens, prefix);
    EXPECT_GT((without - logits).cwiseAbs().maxCoeff(), 1e-3 * expected.cwiseAbs().maxCoeff());
  }
}

// Each kind of layer with its own RoPE: the local layers rotate the first 4 of their 6 features
// with base 10 000 (partial rotary), the global layers all of their d_r = 4 with base 1 000 000
// and YaRN (s = 4 over L = 4) that the local layers do not use. The stack equals the composition
// with those tables, and each setting changes the logits.
TEST(Stack, EachKindOfLayerTakesItsOwnRope) {
  apex::StackConfig config = small_config();
  config.rope.rotary_dim = 4;
  apex::YarnParams yarn;
  yarn.base = 1e6;
  yarn.scale = 4.0;
  yarn.original_context = 4;
  yarn.temperature = apex::YarnTemperature::kSoftmaxScale;
  apex::LayerRope global;
  global.rope.base = 1e6;
  global.yarn = yarn;
  config.global_rope = global;
  const auto stack = apex::AttentionStack<double>::random(config, 19);
  const Index batch = 2, seq = 14, prefix = 3;
  const apex::TokenMatrix tokens = prompt(batch, seq);
  apex::RopeParams local_params;
  local_params.rotary_dim = 4;
  const apex::RopeTable<double> local_rope(config.max_positions, config.local.head_dim,
                                           local_params);
  const auto global_rope = apex::yarn_table<double>(config.max_positions, config.global.rope_dim, 0,
                                                    apex::RopePairing::kInterleaved, yarn);
  apex::SdpaParams global_attention;
  global_attention.scale = apex::yarn_softmax_scale_multiplier(yarn) /
                           std::sqrt(static_cast<double>(config.global.qk_dim()));
  const apex::RowMatrix<double> expected =
      composed_logits(stack, tokens, prefix, {local_rope, {}}, {global_rope, global_attention});
  const apex::RowMatrix<double> logits = stack.forward(tokens, prefix);
  EXPECT_LE((logits - expected).cwiseAbs().maxCoeff(), 1e-12 * expected.cwiseAbs().maxCoeff());
  const auto changes = [&](apex::StackConfig other, const char* what) {
    const apex::RowMatrix<double> without =
        apex::AttentionStack<double>::random(other, 19).forward(tokens, prefix);
    EXPECT_GT((without - logits).cwiseAbs().maxCoeff(), 1e-6 * expected.cwiseAbs().maxCoeff())
        << what;
  };
  apex::StackConfig whole_heads = config;
  whole_heads.rope.rotary_dim = 0;
  changes(whole_heads, "partial rotary");
  apex::StackConfig shared = config;
  shared.global_rope.reset();
  changes(shared, "the global layers' own RoPE");

  apex::StackConfig bad = config;
  bad.rope.rotary_dim = 8;
  expect_invalid([&] { (void)apex::AttentionStack<double>::random(bad, 1); },
                 "[stack] rope.rotary_dim (8) must be 0 (all) or even, in [2, 6]");
  bad = config;
  bad.global_rope->rope.rotary_dim = 2;
  expect_invalid([&] { (void)apex::AttentionStack<double>::random(bad, 1); },
                 "[stack] global_rope.rope.rotary_dim (2) must be 0 for the global layers");
  bad = config;
  bad.global_rope->yarn->base = 10000.0;
  expect_invalid([&] { (void)apex::AttentionStack<double>::random(bad, 1); },
                 "[stack] global_rope.yarn.base (10000) must equal global_rope.rope.base (1e+06)");
}

TEST(Stack, YarnConfigIsChecked) {
  apex::StackConfig config = small_config();
  apex::YarnParams yarn;
  yarn.scale = 2.0;
  yarn.original_context = 4;
  config.yarn = yarn;
  expect_invalid([&] { apex::AttentionStack<float>::random(config, 1); },
                 "[stack] max_positions (16) must not exceed yarn.scale · original_context (8)");
  config.yarn->scale = 4.0;
  config.yarn->base = 500000.0;
  expect_invalid([&] { apex::AttentionStack<float>::random(config, 1); },
                 "[stack] yarn.base (500000) must equal rope.base (10000)");
  config.yarn->base = 10000.0;
  config.yarn->original_context = 0;
  expect_invalid([&] { apex::AttentionStack<float>::random(config, 1); },
                 "[yarn] original_context (0) must be > 0");
}

// The other RoPE scalings (rope_scaling.hpp) in the stack: the local layers with one kind, the
// global layers with Llama 3's through global_rope. forward() equals the composition with the
// tables built by hand, and the scaling changes the logits. (Decoding with each kind is in
// DecodingWithEveryRopeScalingMatchesForward below.)
std::vector<std::pair<std::string, apex::RopeScaling>> scalings(Index original, Index pairs) {
  apex::LongRope longrope;
  longrope.short_factor.assign(static_cast<std::size_t>(pairs), 1.25);
  longrope.long_factor.assign(static_cast<std::size_t>(pairs), 3.0);
  longrope.original_context = original;
  longrope.scale = 4.0;
  return {{"linear", apex::LinearRope{4.0}},
          {"dynamic", apex::DynamicNtkRope{4.0, original, 0}},
          {"llama3", apex::Llama3Rope{4.0, 1.0, 4.0, original}},
          {"longrope", longrope}};
}

TEST(Stack, RopeScalingsForwardEqualsTheComposedFormulas) {
  for (const auto& [name, scaling] : scalings(4, 3)) {
    apex::StackConfig config = small_config();
    config.rope_scaling = scaling;
    apex::LayerRope global;
    global.scaling = apex::Llama3Rope{4.0, 1.0, 4.0, 4};
    config.global_rope = global;
    const auto stack = apex::AttentionStack<double>::random(config, 29);
    const Index batch = 2, seq = 14, prefix = 3;
    const apex::TokenMatrix tokens = prompt(batch, seq);
    const auto local_rope = apex::scaled_rope_table<double>(
        config.max_positions, config.local.head_dim, config.rope, scaling);
    const auto global_rope = apex::scaled_rope_table<double>(
        config.max_positions, config.global.rope_dim, global.rope, global.scaling);
    const apex::RowMatrix<double> expected =
        composed_logits(stack, tokens, prefix, {local_rope, {}}, {global_rope, {}});
    const apex::RowMatrix<double> logits = stack.forward(tokens, prefix);
    EXPECT_LE((logits - expected).cwiseAbs().maxCoeff(), 1e-12 * expected.cwiseAbs().maxCoeff())
        << name;
    apex::StackConfig plain = config;
    plain.rope_scaling = {};
    const apex::RowMatrix<double> without =
        apex::AttentionStack<double>::random(plain, 29).forward(tokens, prefix);
    EXPECT_GT((without - logits).cwiseAbs().maxCoeff(), 1e-6 * expected.cwiseAbs().maxCoeff())
        << name;
  }
  apex::StackConfig bad = small_config();
  bad.rope_scaling = apex::LinearRope{2.0};
  apex::YarnParams yarn;
  yarn.scale = 4.0;
  yarn.original_context = 4;
  bad.yarn = yarn;
  expect_invalid([&] { (void)apex::AttentionStack<float>::random(bad, 1); },
                 "[stack] yarn and scaling are both set");
  bad = small_config();
  bad.rope_scaling = apex::Llama3Rope{4.0, 2.0, 1.0, 4};
  expect_invalid([&] { (void)apex::AttentionStack<float>::random(bad, 1); },
                 "[rope llama3] high_freq_factor (1)");
  bad = small_config();
  apex::LayerRope global;
  global.scaling = apex::LongRope{};
  bad.global_rope = global;
  expect_invalid([&] { (void)apex::AttentionStack<float>::random(bad, 1); },
                 "[rope longrope] original_context (0)");
}

// ---------------------------------------------------------------------------------------------
// Inference: prefill, extend, decode_step
// ---------------------------------------------------------------------------------------------

// Sequence length of the one-token-at-a-time test: the W = 64 rings of the local layers wrap 15
// times. (The test takes about 1 s in release and well under a minute in the debug preset with
// AddressSanitizer and UndefinedBehaviorSanitizer, so debug builds run the same length.)
constexpr Index kTokens = 1000;

// The 7-layer stack of small_config (layers 0-4 and 6 local, 5 global) with W = 64 and room for
// 1024 positions; optionally with YaRN (s = 8 over L = 128: positions up to 1024).
apex::StackConfig decode_config(bool yarn) {
  apex::StackConfig c = small_config();
  c.window = 64;
  c.max_positions = 1024;
  if (yarn) {
    apex::YarnParams p;
    p.scale = 8.0;
    p.original_context = 128;
    c.yarn = p;
  }
  return c;
}

apex::TokenMatrix random_tokens(Index batch, Index seq, Index vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> id(0, vocab - 1);
  apex::TokenMatrix tokens(batch, seq);
  for (Index i = 0; i < tokens.size(); ++i) tokens.data()[i] = id(rng);
  return tokens;
}

// Logits from the cache against logits from forward(): |Δ| ≤ tol · max|row| for every row.
// Float, as the specification asks: 1e-4 relative. The two sides run the same formulas with
// sums in different orders (key blocks, merged partial softmaxes, absorbed MLA) through 7
// blocks; that is a few hundred ulps. A wrong position, key, mask or scale moves rows by O(0.1).
constexpr double kDecodeTol = 1e-4;

void expect_logits_close(const apex::RowMatrix<float>& actual,
                         const apex::RowMatrix<float>& expected, const std::string& what) {
  ASSERT_EQ(actual.rows(), expected.rows()) << what;
  ASSERT_EQ(actual.cols(), expected.cols()) << what;
  Index failures = 0;
  for (Index r = 0; r < expected.rows() && failures < 5; ++r) {
    const double scale = expected.row(r).cwiseAbs().maxCoeff();
    const double error = (actual.row(r) - expected.row(r)).cwiseAbs().maxCoeff();
    if (error > kDecodeTol * scale) {
      ADD_FAILURE() << what << ": row " << r << " differs by " << error << " (row max " << scale
                    << ")";
      ++failures;
    }
  }
}

TEST(Stack, DecodingOneTokenAtATimeMatchesForward) {
  const apex::testing::OneThread one_thread;
  struct Variant {
    Index prefix;
    bool yarn;
    apex::MlaPath mla;
  };
  const std::vector<Variant> variants = {
      {0, false, apex::MlaPath::kAuto}, {9, false, apex::MlaPath::kAuto},
      {0, true, apex::MlaPath::kAuto},  {9, true, apex::MlaPath::kAuto},
      {9, true, apex::MlaPath::kNaive}, {0, false, apex::MlaPath::kAbsorbed}};
  const Index batch = 2;
  for (const Variant& v : variants) {
    const apex::StackConfig config = decode_config(v.yarn);
    const auto stack = apex::AttentionStack<float>::random(config, 23);
    const apex::TokenMatrix tokens = random_tokens(batch, kTokens, config.vocab_size, 24);
    const apex::RowMatrix<float> expected = stack.forward(tokens, v.prefix);
    const std::string name = "prefix " + std::to_string(v.prefix) + (v.yarn ? ", YaRN" : "") +
                             ", MLA path " + std::to_string(static_cast<int>(v.mla));

    apex::DecodeOptions options;
    options.mla = v.mla;
    apex::StackCache<float> cache = stack.make_cache(batch, kTokens);
    const std::int64_t local_bytes = cache.local_bytes();
    EXPECT_EQ(cache.bytes(), stack.cache_memory(batch, kTokens).total_bytes);
    apex::RowMatrix<float> logits(batch * kTokens, config.vocab_size);
    const Index first = std::max<Index>(v.prefix, 1);
    const apex::RowMatrix<float> prompt_logits =
        stack.prefill(tokens.leftCols(first), v.prefix, options, cache);
    for (Index b = 0; b < batch; ++b) {
      logits.middleRows(b * kTokens, first) = prompt_logits.middleRows(b * first, first);
    }
    for (Index t = first; t < kTokens; ++t) {
      const apex::RowMatrix<float> step =
          stack.decode_step({tokens(0, t), tokens(1, t)}, options, cache);
      ASSERT_EQ(step.rows(), batch);
      for (Index b = 0; b < batch; ++b) logits.row(b * kTokens + t) = step.row(b);
      // The local layers' rings hold W tokens from the start: their memory never grows.
      ASSERT_EQ(cache.local_bytes(), local_bytes) << "at position " << t;
    }
    EXPECT_EQ(cache.next_position(), kTokens);
    EXPECT_EQ(cache.prefix(), v.prefix);
    expect_logits_close(logits, expected, name);
  }
}

// Every RoPE scaling, local and global layers alike, decoded one token at a time past its
// original context (L = 128 of 1000 tokens): the logits of forward().
TEST(Stack, DecodingWithEveryRopeScalingMatchesForward) {
  const apex::testing::OneThread one_thread;
  const Index batch = 2;
  for (const auto& [name, scaling] : scalings(128, 3)) {
    apex::StackConfig config = decode_config(false);
    config.rope_scaling = scaling;
    if (std::holds_alternative<apex::LongRope>(scaling)) {
      // The global layers' d_r = 4 has 2 pairs, the local layers' d_h = 6 three.
      apex::LayerRope global;
      global.scaling = scalings(128, 2).back().second;
      config.global_rope = global;
    }
    const auto stack = apex::AttentionStack<float>::random(config, 31);
    const apex::TokenMatrix tokens = random_tokens(batch, kTokens, config.vocab_size, 32);
    const apex::RowMatrix<float> expected = stack.forward(tokens, 0);
    apex::StackCache<float> cache = stack.make_cache(batch, kTokens);
    apex::RowMatrix<float> logits(batch * kTokens, config.vocab_size);
    const apex::RowMatrix<float> first = stack.prefill(tokens.leftCols(1), 0, {}, cache);
    for (Index b = 0; b < batch; ++b) logits.row(b * kTokens) = first.row(b);
    for (Index t = 1; t < kTokens; ++t) {
      const apex::RowMatrix<float> step =
          stack.decode_step({tokens(0, t), tokens(1, t)}, {}, cache);
      for (Index b = 0; b < batch; ++b) logits.row(b * kTokens + t) = step.row(b);
    }
    expect_logits_close(logits, expected, name);
  }
}

// Attention sinks in every layer (owned by the layers' weights, as a checkpoint holds them):
// decoding one token at a time, with both MLA paths, gives the logits of forward(), and the
// sinks change them.
TEST(Stack, LayersWithSinksDecodeAsForward) {
  const apex::testing::OneThread one_thread;
  const apex::StackConfig config = decode_config(false);
  const auto plain = apex::AttentionStack<float>::random(config, 23);
  std::vector<apex::AttentionStack<float>::Layer> layers;
  for (Index l = 0; l < config.num_layers; ++l) {
    std::visit(
        [&](const auto& layer) {
          using Kind = std::decay_t<decltype(layer)>;
          auto weights = layer.weights();
          weights.sinks.assign(std::size_t(layer.config().num_q_heads), 0.5 + 0.25 * double(l));
          layers.emplace_back(Kind(layer.config(), weights));
        },
        plain.layer(l));
  }
  const apex::AttentionStack<float> stack(
      config, plain.embedding(),
      std::vector<apex::Vector<float>>(std::size_t(config.num_layers),
                                       apex::Vector<float>::Ones(config.d_model)),
      apex::Vector<float>::Ones(config.d_model), std::move(layers));
  const Index batch = 2, prefix = 9;
  const apex::TokenMatrix tokens = random_tokens(batch, kTokens, config.vocab_size, 24);
  const apex::RowMatrix<float> expected = stack.forward(tokens, prefix);
  EXPECT_GT((plain.forward(tokens, prefix) - expected).cwiseAbs().maxCoeff(), 1e-4);
  for (const apex::MlaPath path : {apex::MlaPath::kNaive, apex::MlaPath::kAbsorbed}) {
    apex::DecodeOptions options;
    options.mla = path;
    apex::StackCache<float> cache = stack.make_cache(batch, kTokens);
    apex::RowMatrix<float> logits(batch * kTokens, config.vocab_size);
    const apex::RowMatrix<float> prompt =
        stack.prefill(tokens.leftCols(prefix), prefix, options, cache);
    for (Index b = 0; b < batch; ++b) {
      logits.middleRows(b * kTokens, prefix) = prompt.middleRows(b * prefix, prefix);
    }
    for (Index t = prefix; t < kTokens; ++t) {
      const apex::RowMatrix<float> step =
          stack.decode_step({tokens(0, t), tokens(1, t)}, options, cache);
      for (Index b = 0; b < batch; ++b) logits.row(b * kTokens + t) = step.row(b);
    }
    expect_logits_close(logits, expected,
                        path == apex::MlaPath::kNaive ? "sinks, naive MLA" : "sinks, absorbed MLA");
  }
}

// 16-bit caches in every layer: the bytes that cache_memory<T> reports, half of float's, and
// logits that differ from the float caches' by the rounding of the stored values only. Over
// kTokens decoded tokens (prefix 9, default MLA path) the largest normwise difference of a row,
// max |Δ| / max |float row|, measured 6.9e-4 for half and 7.9e-3 for bfloat16; the bounds are
// about twice that.
template <class T>
void decode_with_16bit_caches(double bound) {
  const apex::testing::OneThread one_thread;
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<float>::random(config, 23);
  const Index batch = 2, prefix = 9;
  const apex::TokenMatrix tokens = random_tokens(batch, kTokens, config.vocab_size, 24);
  apex::StackCache<float> wide = stack.make_cache(batch, kTokens);
  apex::StackCache<float, T> narrow = stack.make_cache<T>(batch, kTokens);
  EXPECT_EQ(narrow.bytes(), stack.cache_memory<T>(batch, kTokens).total_bytes);
  EXPECT_EQ(2 * narrow.bytes(), wide.bytes());
  double worst = 0.0;
  const auto compare = [&](const apex::RowMatrix<float>& a, const apex::RowMatrix<float>& b) {
    for (Index r = 0; r < a.rows(); ++r) {
      worst = std::max(worst, static_cast<double>((a.row(r) - b.row(r)).cwiseAbs().maxCoeff() /
                                                  b.row(r).cwiseAbs().maxCoeff()));
    }
  };
  compare(stack.prefill(tokens.leftCols(prefix), prefix, narrow),
          stack.prefill(tokens.leftCols(prefix), prefix, wide));
  for (Index t = prefix; t < kTokens; ++t) {
    compare(stack.decode_step({tokens(0, t), tokens(1, t)}, narrow),
            stack.decode_step({tokens(0, t), tokens(1, t)}, wide));
  }
  std::cout << "largest normwise logit difference, 16-bit against float caches: " << worst << "\n";
  EXPECT_LE(worst, bound);
  EXPECT_GT(worst, 0.0) << "rounding the caches must change something";
}

TEST(Stack, HalfCachesStayWithinTheirBoundOfFloatCaches) {
  decode_with_16bit_caches<Eigen::half>(1.4e-3);
}

TEST(Stack, BFloat16CachesStayWithinTheirBoundOfFloatCaches) {
  decode_with_16bit_caches<Eigen::bfloat16>(1.6e-2);
}

// 16-bit weights (the embedding table, so the LM head, and every layer's matrices) and 16-bit
// caches: the stack's weights take half the bytes, and
//  - on float caches, with naive MLA, it decodes what a float stack holding the same (widened)
//    weights decodes, to the tolerance of decoding against forward (kDecode);
//  - with its caches in T too (default MLA path), its logits stay within a bound of the float
//    stack.s: max |Δ| / max |float row| measured 1.1e-3 for half and 1.4e-2 for bfloat16 over
//    kTokens tokens; the bounds are about twice that.
template <class T>
void decode_with_16bit_weights(double bound) {
  const apex::testing::OneThread one_thread;
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<float>::random(config, 33);
  const apex::AttentionStack<float, T> narrow = stack.template with_weights<T>();
  const apex::AttentionStack<float> widened = narrow.template with_weights<float>();
  const std::int64_t gammas =
      (config.num_layers + 1) * config.d_model * static_cast<std::int64_t>(sizeof(float));
  EXPECT_EQ(2 * (narrow.weight_bytes() - gammas), stack.weight_bytes() - gammas);
  const Index batch = 2, prefix = 9;
  const apex::TokenMatrix tokens = random_tokens(batch, kTokens, config.vocab_size, 34);
  apex::DecodeOptions naive;
  naive.mla = apex::MlaPath::kNaive;
  apex::StackCache<float> same_values = narrow.make_cache(batch, kTokens);
  apex::StackCache<float> oracle = widened.make_cache(batch, kTokens);
  apex::StackCache<float, T> narrow_cache = narrow.template make_cache<T>(batch, kTokens);
  apex::StackCache<float> wide_cache = stack.make_cache(batch, kTokens);
  double worst = 0.0;
  const auto compare = [&](const apex::RowMatrix<float>& a, const apex::RowMatrix<float>& b) {
    for (Index r = 0; r < a.rows(); ++r) {
      worst = std::max(worst, static_cast<double>((a.row(r) - b.row(r)).cwiseAbs().maxCoeff() /
                                                  b.row(r).cwiseAbs().maxCoeff()));
    }
  };
  expect_logits_close(narrow.prefill(tokens.leftCols(prefix), prefix, naive, same_values),
                      widened.prefill(tokens.leftCols(prefix), prefix, naive, oracle),
                      "16-bit weights, prefill");
  compare(narrow.prefill(tokens.leftCols(prefix), prefix, narrow_cache),
          stack.prefill(tokens.leftCols(prefix), prefix, wide_cache));
  for (Index t = prefix; t < kTokens; ++t) {
    const std::vector<std::int64_t> next = {tokens(0, t), tokens(1, t)};
    expect_logits_close(narrow.decode_step(next, naive, same_values),
                        widened.decode_step(next, naive, oracle),
                        "16-bit weights, token " + std::to_string(t));
    compare(narrow.decode_step(next, narrow_cache), stack.decode_step(next, wide_cache));
  }
  std::cout << "largest normwise logit difference, 16-bit weights and caches against float: "
            << worst << "\n";
  EXPECT_LE(worst, bound);
  EXPECT_GT(worst, 0.0) << "rounding the weights must change something";
  expect_invalid([] { (void)apex::AttentionStack<float>().with_weights<T>(); },
                 "[stack] the stack is empty");
}

TEST(Stack, HalfWeightsDecodeAsFloatWeightsOfTheSameValues) {
  decode_with_16bit_weights<Eigen::half>(2.2e-3);
}

TEST(Stack, BFloat16WeightsDecodeAsFloatWeightsOfTheSameValues) {
  decode_with_16bit_weights<Eigen::bfloat16>(2.8e-2);
}

TEST(Stack, ChunkedPrefillEqualsOneShotPrefill) {
  const apex::testing::OneThread one_thread;
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<double>::random(config, 31);
  const Index batch = 2, prompt_len = 70, total = 80, prefix = 6;
  const apex::TokenMatrix tokens = random_tokens(batch, total, config.vocab_size, 32);
  const apex::RowMatrix<double> expected = stack.forward(tokens, prefix);
  // Returns the logits of the prompt (fed in the given chunks, the first holding the prefix) and
  // of the tokens decoded after it, as [B*total, V].
  const auto run = [&](const std::vector<Index>& chunks) {
    apex::StackCache<double> cache = stack.make_cache(batch, total);
    apex::RowMatrix<double> logits(batch * total, config.vocab_size);
    Index position = 0;
    for (const Index n : chunks) {
      const apex::RowMatrix<double> part =
          position == 0 ? stack.prefill(tokens.middleCols(0, n), prefix, cache)
                        : stack.extend(tokens.middleCols(position, n), cache);
      for (Index b = 0; b < batch; ++b) {
        logits.middleRows(b * total + position, n) = part.middleRows(b * n, n);
      }
      position += n;
    }
    EXPECT_EQ(position, prompt_len);
    for (; position < total; ++position) {
      const apex::RowMatrix<double> step =
          stack.decode_step({tokens(0, position), tokens(1, position)}, cache);
      for (Index b = 0; b < batch; ++b) logits.row(b * total + position) = step.row(b);
    }
    return logits;
  };
  const apex::RowMatrix<double> one_shot = run({prompt_len});
  // Double: one-shot, chunked and the full forward pass agree to rounding.
  EXPECT_LE((one_shot - expected).cwiseAbs().maxCoeff(), 1e-11 * expected.cwiseAbs().maxCoeff());
  for (const std::vector<Index>& chunks :
       std::vector<std::vector<Index>>{{6, 10, 1, 53}, {13, 1, 1, 1, 54}, {64, 6}, {35, 35}}) {
    const apex::RowMatrix<double> chunked = run(chunks);
    EXPECT_LE((chunked - one_shot).cwiseAbs().maxCoeff(), 1e-11 * one_shot.cwiseAbs().maxCoeff())
        << "first chunk " << chunks.front();
  }
}

TEST(Stack, LastLogitsAreTheLastRowsOfAllLogits) {
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<double>::random(config, 41);
  const apex::TokenMatrix tokens = random_tokens(3, 12, config.vocab_size, 42);
  apex::StackCache<double> all_cache = stack.make_cache(3, 32);
  apex::StackCache<double> last_cache = stack.make_cache(3, 32);
  apex::DecodeOptions last;
  last.logits = apex::LogitRows::kLast;
  const apex::RowMatrix<double> all = stack.prefill(tokens, 4, all_cache);
  const apex::RowMatrix<double> only_last = stack.prefill(tokens, 4, last, last_cache);
  ASSERT_EQ(only_last.rows(), 3);
  // Equal up to rounding: the LM head is then a 3-row product, for which Eigen picks another
  // kernel than for 36 rows.
  const double tol = 1e-13 * all.cwiseAbs().maxCoeff();
  for (Index b = 0; b < 3; ++b) {
    EXPECT_LE((only_last.row(b) - all.row(b * 12 + 11)).cwiseAbs().maxCoeff(), tol);
  }
  const apex::TokenMatrix more = random_tokens(3, 5, config.vocab_size, 43);
  const apex::RowMatrix<double> all_more = stack.extend(more, all_cache);
  const apex::RowMatrix<double> last_more = stack.extend(more, last, last_cache);
  for (Index b = 0; b < 3; ++b) {
    EXPECT_LE((last_more.row(b) - all_more.row(b * 5 + 4)).cwiseAbs().maxCoeff(), tol);
  }
}

TEST(Stack, CacheMemoryIsReportedExactly) {
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<float>::random(config, 51);
  apex::StackCache<float> cache = stack.make_cache(2, 300);
  const apex::StackCacheMemory m = stack.cache_memory(2, 300);
  EXPECT_EQ(m.local_layers, 6);
  EXPECT_EQ(m.global_layers, 1);
  // Local: 2·H_kv·d_h = 24 floats per token, for the last W = 64 tokens of each sequence.
  EXPECT_EQ(m.local_bytes_per_token, 24 * 4);
  EXPECT_EQ(m.local_bytes_per_layer, 2 * 64 * 24 * 4);
  // Global: d_kv + H_kr·d_r = 8 + 2·4 = 16 floats per token.
  EXPECT_EQ(m.global_bytes_per_token, 16 * 4);
  EXPECT_EQ(m.global_bytes_per_layer, 2 * 300 * 16 * 4);
  EXPECT_EQ(cache.local_bytes(), 6 * m.local_bytes_per_layer);
  EXPECT_EQ(cache.global_bytes(), m.global_bytes_per_layer);
  EXPECT_EQ(cache.bytes(), m.total_bytes);
  cache.reserve(500);
  EXPECT_EQ(cache.capacity(), 500);
  EXPECT_EQ(cache.bytes(), stack.cache_memory(2, 500).total_bytes);
}

// §7.4, §8.3, §9.4 for a whole APEX-1 Large stack: d = 7168, H_q = 128, H_kv = 8, d_h = 128,
// d_kv = 512, W = 4096, a 128K context in FP16. The documents give no d_r (range 32-64), d_q or
// L (range 6-72): d_r = 64, d_q = 1536 (it does not enter the cache) and L = 72, so 60 local
// and 12 global layers.
TEST(Stack, S7_4_S9_4_Apex1LargeCacheMemory) {
  apex::StackConfig c;
  c.vocab_size = 151643;
  c.d_model = 7168;
  c.num_layers = 72;
  c.window = 4096;
  c.local = apex::GqaConfig{7168, 128, 8, 128};
  c.global.d_model = 7168;
  c.global.d_q = 1536;
  c.global.d_kv = 512;
  c.global.num_q_heads = 128;
  c.global.num_kv_heads = 8;
  c.global.head_dim = 128;
  c.global.rope_dim = 64;
  c.max_positions = 131072;
  const apex::StackCacheMemory m = apex::stack_cache_memory(c, 1, 131072, 2);
  constexpr std::int64_t kMiB = std::int64_t{1} << 20;
  EXPECT_EQ(m.local_layers, 60);
  EXPECT_EQ(m.global_layers, 12);
  EXPECT_EQ(m.local_bytes_per_token, 4096);   // 2·8·128 values, FP16
  EXPECT_EQ(m.global_bytes_per_token, 2048);  // 512 + 8·64 values (c_kv + K_rope), FP16
  EXPECT_EQ(m.local_bytes_per_layer, 16 * kMiB);
  EXPECT_EQ(m.global_bytes_per_layer, 256 * kMiB);
  EXPECT_EQ(m.total_bytes, 4032 * kMiB);  // 60 × 16 MiB + 12 × 256 MiB
  // The same 72 layers as multi-head attention with full caches: 72 × 8 GiB (§7.4, corrected).
  const std::int64_t mha = 72 * apex::kv_cache_bytes(1, 131072, 128, 128, 2);
  EXPECT_EQ(mha, std::int64_t{576} * 1024 * kMiB);
  EXPECT_EQ(mha / m.total_bytes, 146);  // 146.3× less memory
  // With one shared K_rope head (DeepSeek's layout) the global layers need 576 values per token.
  c.global.num_rope_key_heads = 1;
  EXPECT_EQ(apex::stack_cache_memory(c, 1, 131072, 2).global_bytes_per_layer, 144 * kMiB);
}

TEST(Stack, BadDecodeInputThrowsAndLeavesTheCacheUnchanged) {
  const apex::StackConfig config = decode_config(false);
  const auto stack = apex::AttentionStack<float>::random(config, 61);
  const apex::TokenMatrix tokens = random_tokens(2, 8, config.vocab_size, 62);
  apex::StackCache<float> cache = stack.make_cache(2, 9);
  stack.prefill(tokens, 3, cache);
  const apex::StackCache<float> saved = cache;
  // The cache is unchanged when its next step gives exactly what a saved copy gives.
  const auto expect_unchanged = [&](const std::string& what) {
    EXPECT_EQ(cache.next_position(), 8) << what;
    EXPECT_EQ(cache.bytes(), saved.bytes()) << what;
    apex::StackCache<float> a = cache;
    apex::StackCache<float> b = saved;
    EXPECT_EQ(stack.decode_step({1, 2}, a), stack.decode_step({1, 2}, b)) << what;
  };

  expect_invalid(
      [&] {
        stack.decode_step({1, 2, 3}, cache);
      },
      "[stack] tokens batch (3) must equal the cache's batch (2)");
  expect_unchanged("batch");
  expect_invalid([&] { stack.extend(random_tokens(2, 2, config.vocab_size, 63), cache); },
                 {"[stack] positions [8, 10) exceed the cache's capacity (9)", "reserve()"});
  expect_unchanged("capacity");
  apex::TokenMatrix bad = random_tokens(2, 1, config.vocab_size, 64);
  bad(1, 0) = config.vocab_size;
  expect_invalid([&] { stack.extend(bad, cache); }, "50");
  expect_unchanged("token id");
  expect_invalid([&] { stack.prefill(tokens, 0, cache); },
                 "[stack] prefill needs an empty cache (its next position is 8)");
  expect_unchanged("prefill");
  const auto other = apex::AttentionStack<float>::random(small_config(), 65);
  apex::StackCache<float> foreign = other.make_cache(2, 9);
  expect_invalid(
      [&] {
        stack.decode_step({1, 2}, foreign);
      },
      "[stack] the cache was not made by this stack's make_cache");
  EXPECT_EQ(foreign.next_position(), 0);

  // Decoding past the capacity: the documented policy is an error; reserve() grows the cache.
  stack.decode_step({1, 2}, cache);
  expect_invalid(
      [&] {
        stack.decode_step({1, 2}, cache);
      },
      "[stack] positions [9, 10) exceed the cache's capacity (9)");
  EXPECT_EQ(cache.next_position(), 9);
  cache.reserve(12);
  const apex::RowMatrix<float> after = stack.decode_step({3, 4}, cache);
  EXPECT_EQ(cache.next_position(), 10);
  EXPECT_TRUE(after.allFinite());

  // The prefix must be inside the prompt, and positions inside max_positions.
  apex::StackCache<float> fresh = stack.make_cache(2, 9);
  expect_invalid([&] { stack.prefill(tokens.leftCols(4), 5, fresh); },
                 "[stack] prefix (5) must lie in [0, S = 4]");
  EXPECT_EQ(fresh.next_position(), 0);
  expect_invalid([&] { stack.make_cache(2, 1025); },
                 "[stack] capacity (1025) must lie in [1, max_positions = 1024]");
  apex::StackConfig local_only = small_config();
  local_only.num_layers = 3;  // no global layer: the rings never fill, max_positions still binds
  const auto short_stack = apex::AttentionStack<float>::random(local_only, 66);
  apex::StackCache<float> ring_only = short_stack.make_cache(1, 16);
  short_stack.prefill(random_tokens(1, 16, 50, 67), 0, ring_only);
  expect_invalid([&] { short_stack.decode_step({1}, ring_only); },
                 "[stack] positions [16, 17) exceed max_positions (16)");
  EXPECT_EQ(ring_only.next_position(), 16);
}

}  // namespace
}  // namespace stack_test
