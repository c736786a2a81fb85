// SPDX-License-Identifier: MIT
// Tests for §8 and the attention layer: the head assignment ⌊i/G⌋, the KV-cache ratios, and
// GroupedQueryAttention (MHA, GQA and MQA as one layer) against plain loops.
#include <apex/gqa.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "finite_differences.hpp"
#include "reference/attention.hpp"
#include "reference/rms_norm.hpp"
#include "reference/rope.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace gqa_test {
namespace {

using apex::AttentionLayerParams;
using apex::AttentionMask;
using apex::GqaConfig;
using apex::GqaWeights;
using apex::GroupedQueryAttention;
using apex::Index;
using apex::RopePairing;
using apex::RopeParams;
using apex::RopeTable;
using apex::RowMatrix;
using apex::testing::expect_close;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;
using apex::testing::Tolerances;
using MatrixXd = Eigen::MatrixXd;

// Tolerance, per element: |actual − expected| ≤ tol · max(1, |expected|) with tol =
// Tolerances<Scalar>::kGqaLayer of tolerances.hpp. x is O(1) and the weights are N(0, 1/fan_in),
// so every intermediate is O(1). An output passes through the projection (dot products of length
// d ≤ 16), RoPE (one rotation), the scores (length d_h = 6), a softmax over ≤ 7 keys, the
// weighted sum and W_O (length ≤ 36). A wrong head, position or scale moves results by O(0.1).

// ---------------------------------------------------------------------------------------------
// Plain double-precision reference of the layer, written from §6.2, §7.2 and §8.2, with the
// attention itself the plain loop of reference/attention.hpp.
// ---------------------------------------------------------------------------------------------

struct PlainRope {
  bool enabled = false;
  bool half_split = false;
  Index offset = 0;
};

struct PlainQkv {
  MatrixXd q, k, v;  // [B*S, H_q d_h], [B*S, H_kv d_h], [B*S, H_kv d_h]
};

// The projections of §8.2 on every batch block: Q = RoPE(x W_Q), K = RoPE(x W_K), V = x W_V,
// row b*S + s at position offset + s.
template <class Scalar>
PlainQkv plain_project(const RowMatrix<Scalar>& x_in, Index batch, const GqaConfig& c,
                       const GqaWeights<Scalar>& w, const PlainRope& rope) {
  const MatrixXd x = x_in.template cast<double>();
  const Index seq = x.rows() / batch;
  const std::vector<double> theta = apex::reference::rope_theta(c.head_dim, 10000.0);
  std::vector<long long> positions;
  for (Index s = 0; s < seq; ++s) positions.push_back(rope.offset + s);
  PlainQkv r{x * w.w_q.template cast<double>(), x * w.w_k.template cast<double>(),
             x * w.w_v.template cast<double>()};
  if (!rope.enabled) return r;
  for (Index b = 0; b < batch; ++b) {
    r.q.middleRows(b * seq, seq) = apex::reference::rope(r.q.middleRows(b * seq, seq), positions,
                                                         theta, c.head_dim, rope.half_split);
    r.k.middleRows(b * seq, seq) = apex::reference::rope(r.k.middleRows(b * seq, seq), positions,
                                                         theta, c.head_dim, rope.half_split);
  }
  return r;
}

// The layer of §7.2 / §8.2: head_h = Attention(Q_h, K_⌊h/G⌋, V_⌊h/G⌋) on every batch block,
// out = Concat(heads) W_O.
template <class Scalar>
MatrixXd plain_layer(const RowMatrix<Scalar>& x, Index batch, const GqaConfig& c,
                     const GqaWeights<Scalar>& w, bool causal, const PlainRope& rope) {
  const PlainQkv p = plain_project(x, batch, c, w, rope);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const apex_test::MatrixD concat = apex_test::multi_head_attention(
      p.q, p.k, p.v, {batch, c.num_q_heads, c.num_kv_heads},
      [&](Index, Index, Index i, Index j) { return !causal || j <= i; }, scale);
  return concat * w.w_o.template cast<double>();
}

template <class Scalar>
AttentionMask<Scalar> causal_if(bool causal) {
  AttentionMask<Scalar> mask;
  if (causal) mask.positions = apex::causal_mask();
  return mask;
}

// ---------------------------------------------------------------------------------------------
// Worked examples
// ---------------------------------------------------------------------------------------------

TEST(Gqa, S8_3_MemorySavings) {
  EXPECT_EQ(apex::kv_cache_ratio({128, 128}), 1.0);       // MHA
  EXPECT_EQ(apex::kv_cache_ratio({128, 8}), 0.0625);      // GQA, H_kv = 8
  EXPECT_EQ(1.0 / apex::kv_cache_ratio({128, 8}), 16.0);  // "16× smaller"
  EXPECT_EQ(apex::kv_cache_ratio({128, 1}), 0.0078125);   // MQA (§8.3 prints 0.0078×)
  // The same ratios from the cache sizes 2 · H_kv · d_h · S of §8.3's table.
  const std::int64_t seq = 4096, d_h = 128;
  const double mha = static_cast<double>(apex::kv_cache_bytes(1, seq, 128, d_h, 2));
  EXPECT_EQ(static_cast<double>(apex::kv_cache_bytes(1, seq, 8, d_h, 2)) / mha, 0.0625);
  EXPECT_EQ(static_cast<double>(apex::kv_cache_bytes(1, seq, 1, d_h, 2)) / mha, 0.0078125);
  // APEX-1 Large: H_q = 128, H_kv = 8 -> G = 16 query heads per KV head.
  EXPECT_EQ((GqaConfig{7168, 128, 8, 128}.group_size()), 16);
  EXPECT_EQ(apex::kv_head_for({128, 8}, 15), 0);
  EXPECT_EQ(apex::kv_head_for({128, 8}, 16), 1);
  EXPECT_EQ(apex::kv_head_for({128, 8}, 127), 7);
}

TEST(Gqa, S8_4_HeadAssignment) {
  // H_q = 4, H_kv = 2, G = 2: Q0, Q1 -> KV head 0; Q2, Q3 -> KV head 1.
  std::vector<Index> assignment;
  for (Index i = 0; i < 4; ++i) assignment.push_back(apex::kv_head_for({4, 2}, i));
  EXPECT_EQ(assignment, (std::vector<Index>{0, 0, 1, 1}));

  // And attention really uses them: project with a 4/2 layer, attend through apex::sdpa on the
  // token-major views, and compare each head with plain attention against each KV head.
  const GqaConfig config{12, 4, 2, 4};
  const auto layer = GroupedQueryAttention<double>::random(config, 7);
  const Index seq = 6;
  const RowMatrix<double> x = random_matrix<double>(seq, config.d_model, 8);
  const apex::ProjectedQkv<double> p = layer.project(x, 1);
  // Per element, short chains (tolerances.hpp): a projection of 12 terms; heads of 4 dims over
  // 6 keys.
  const double tol = Tolerances<double>::kShortChain;
  expect_close(p.q, MatrixXd(x * layer.weights().w_q), tol);
  expect_close(p.k, MatrixXd(x * layer.weights().w_k), tol);
  const Index d_h = config.head_dim;
  ASSERT_GT((p.k.leftCols(d_h) - p.k.rightCols(d_h)).norm(), 0.1);  // distinct KV heads
  apex::HeadsTensor<double> out({1, 4, seq, d_h});
  apex::sdpa<double>(p.q_heads(), p.k_heads(), p.v_heads(), {}, {}, out.view());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_h));
  for (Index i = 0; i < 4; ++i) {
    SCOPED_TRACE("query head " + std::to_string(i));
    const MatrixXd q_i = p.q.middleCols(i * d_h, d_h);
    MatrixXd with_kv[2];
    for (Index g = 0; g < 2; ++g) {
      with_kv[g] = apex_test::attention(
                       q_i, p.k.middleCols(g * d_h, d_h), p.v.middleCols(g * d_h, d_h),
                       [](Index, Index) { return true; }, nullptr, scale, 0.0)
                       .out;
    }
    const Index mine = assignment[static_cast<std::size_t>(i)];
    expect_close(out.head(0, i), with_kv[mine], tol);
    EXPECT_GT((MatrixXd(out.head(0, i)) - with_kv[1 - mine]).norm(), 1e-3);
  }
}

TEST(Gqa, MhaAndMqaAreTheEndsOfTheSameRule) {
  for (Index i = 0; i < 8; ++i) {
    EXPECT_EQ(apex::kv_head_for({8, 8}, i), i);  // MHA: G = 1
    EXPECT_EQ(apex::kv_head_for({8, 1}, i), 0);  // MQA: G = H_q
  }
  EXPECT_EQ(GqaConfig::multi_head(64, 8, 8).num_kv_heads, 8);
  EXPECT_EQ(GqaConfig::multi_query(64, 8, 8).num_kv_heads, 1);
}

TEST(Gqa, ParameterCount) {
  // With H_kv = H_q the GQA count is §7.3's 4·d·H_q·d_h.
  EXPECT_EQ(apex::gqa_parameter_count(7168, 56, 56, 128), apex::mha_parameter_count(7168, 56, 128));
  // W_Q and W_O: d·H_q·d_h each; W_K and W_V: d·H_kv·d_h each.
  EXPECT_EQ(apex::gqa_parameter_count(7168, 128, 8, 128),
            2 * 7168LL * 128 * 128 + 2 * 7168LL * 8 * 128);
  // The count is the number of weights a layer really holds.
  for (const GqaConfig& c :
       {GqaConfig{20, 6, 6, 5}, GqaConfig{20, 6, 2, 5}, GqaConfig{20, 6, 1, 5}}) {
    const auto layer = GroupedQueryAttention<float>::random(c, 1);
    const auto& w = layer.weights();
    EXPECT_EQ(layer.parameter_count(), w.w_q.size() + w.w_k.size() + w.w_v.size() + w.w_o.size());
  }
}

TEST(Gqa, ParameterCountRejectsNegativeOrOverflowingArguments) {
  const std::int64_t huge = std::int64_t{1} << 62;
  expect_invalid([&] { (void)apex::gqa_parameter_count(huge, 2, 1, 1); },
                 {"[gqa_parameter_count] 2*d*H_q*d_h", "overflows 64 bits"});
  expect_invalid([] { (void)apex::gqa_parameter_count(7168, 128, -8, 128); },
                 {"[gqa_parameter_count] 2*d*H_kv*d_h", "must not be negative"});
  // Each half fits (2^62 each), their sum 2^63 does not.
  expect_invalid([&] { (void)apex::gqa_parameter_count(huge / 2, 1, 1, 1); },
                 {"[gqa_parameter_count] 2*d*H_q*d_h + 2*d*H_kv*d_h", "fit in 64 bits"});
}

TEST(Gqa, RejectsConfigsWhoseSizesOverflow) {
  // H_q·d_h = 2^62·4 wraps to 0: the layer would be built with zero-width projections.
  const Index huge = Index{1} << 62;
  expect_invalid(
      [&] {
        (void)GroupedQueryAttention<float>::random({1, huge, 1, 4}, 1);
      },
      {"[gqa] num_q_heads*head_dim", "overflows 64 bits"});
  // Widths that fit, weights that do not: 2·d·H_q·d_h = 2 · 2^40 · 2^12 · 2^12 = 2^65.
  const GqaConfig wide{Index{1} << 40, Index{1} << 12, 1, Index{1} << 12};
  expect_invalid([&] { (void)GroupedQueryAttention<float>::random(wide, 1); },
                 {"[gqa] weight count 2*d_model*num_q_heads*head_dim", "overflows 64 bits"});
  // The constructor checks the config before the weights' shapes.
  expect_invalid([&] { GroupedQueryAttention<float> layer(wide, GqaWeights<float>{}); },
                 "[gqa] weight count");
  // A count that fits whose bytes do not: 2^61 doubles (d·d_h·(2·H_q + 2·H_kv) with H_kv = H_q).
  const GqaConfig heavy{Index{1} << 30, Index{1} << 15, Index{1} << 15, Index{1} << 14};
  expect_invalid([&] { (void)GroupedQueryAttention<double>::random(heavy, 1); },
                 {"[gqa] weight bytes", "overflows 64 bits"});
}

TEST(Gqa, RandomWeightsAreSeededAndFanInScaled) {
  const GqaConfig config{256, 4, 2, 64};
  const auto a = GroupedQueryAttention<double>::random(config, 42);
  const auto b = GroupedQueryAttention<double>::random(config, 42);
  const auto c = GroupedQueryAttention<double>::random(config, 43);
  EXPECT_EQ(a.weights().w_q, b.weights().w_q);
  EXPECT_EQ(a.weights().w_o, b.weights().w_o);
  EXPECT_NE(a.weights().w_q, c.weights().w_q);
  // N(0, 1/fan_in): W_Q has fan-in d = 256, W_O has fan-in H_q·d_h = 256 as well; with 65536
  // samples the sample standard deviation is within 1% of 1/16 with overwhelming probability.
  const auto std_of = [](const RowMatrix<double>& w) {
    const double mean = w.mean();
    return std::sqrt((w.array() - mean).square().sum() / static_cast<double>(w.size() - 1));
  };
  EXPECT_NEAR(std_of(a.weights().w_q), 1.0 / 16.0, 0.01 / 16.0);
  EXPECT_NEAR(std_of(a.weights().w_o), 1.0 / 16.0, 0.01 / 16.0);
}

// ---------------------------------------------------------------------------------------------
// The layer against the plain loop
// ---------------------------------------------------------------------------------------------

template <class Scalar>
class GqaTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GqaTyped, Scalars, apex::testing::ScalarName);

struct LayerCase {
  Index num_q_heads, num_kv_heads, batch, seq;
  bool causal;
  bool rope;
  RopePairing pairing;
  Index offset;
};

const std::vector<LayerCase>& layer_cases() {
  static const std::vector<LayerCase> cases = {
      {3, 3, 2, 7, true, false, RopePairing::kInterleaved, 0},  // MHA, no RoPE
      {3, 3, 1, 5, false, true, RopePairing::kInterleaved, 0},  // MHA, bidirectional
      {6, 3, 2, 6, true, true, RopePairing::kInterleaved, 4},   // GQA, G = 2
      {6, 2, 3, 1, true, true, RopePairing::kHalfSplit, 9},     // GQA, G = 3, one token
      {6, 1, 2, 7, true, true, RopePairing::kInterleaved, 2},   // MQA
      {6, 2, 2, 5, true, true, RopePairing::kHalfSplit, 0},     // GQA, half-split pairing
  };
  return cases;
}

TYPED_TEST(GqaTyped, LayerMatchesPlainLoop) {
  using Scalar = TypeParam;
  const Index d_model = 13, head_dim = 6;
  for (const LayerCase& t : layer_cases()) {
    SCOPED_TRACE("H_q " + std::to_string(t.num_q_heads) + ", H_kv " +
                 std::to_string(t.num_kv_heads) + ", B " + std::to_string(t.batch) + ", S " +
                 std::to_string(t.seq));
    const GqaConfig config{d_model, t.num_q_heads, t.num_kv_heads, head_dim};
    const auto layer = GroupedQueryAttention<Scalar>::random(config, 100);
    const RowMatrix<Scalar> x = random_matrix<Scalar>(t.batch * t.seq, d_model, 101);
    RopeParams rope_params;
    rope_params.pairing = t.pairing;
    const RopeTable<Scalar> table(32, head_dim, rope_params);
    AttentionLayerParams<Scalar> params;
    params.rope = t.rope ? &table : nullptr;
    params.position_offset = t.offset;
    RowMatrix<Scalar> out(x.rows(), d_model);
    layer.forward(x, t.batch, causal_if<Scalar>(t.causal), params, out);
    const PlainRope plain_rope{t.rope, t.pairing == RopePairing::kHalfSplit, t.offset};
    expect_close(out, plain_layer(x, t.batch, config, layer.weights(), t.causal, plain_rope),
                 Tolerances<Scalar>::kGqaLayer);
    // The projections themselves (attention cannot see a position shift common to a block).
    const apex::ProjectedQkv<Scalar> p = layer.project(x, t.batch, params);
    const PlainQkv expected = plain_project(x, t.batch, config, layer.weights(), plain_rope);
    expect_close(p.q, expected.q, Tolerances<Scalar>::kGqaLayer);
    expect_close(p.k, expected.k, Tolerances<Scalar>::kGqaLayer);
    expect_close(p.v, expected.v, Tolerances<Scalar>::kGqaLayer);
  }
}

// GQA is MHA whose K and V heads are repeated G times: build that MHA layer explicitly (W_K and
// W_V with each KV head's columns copied to the G query heads that use it) and compare.
TYPED_TEST(GqaTyped, GqaEqualsMhaOnRepeatedKvHeads) {
  using Scalar = TypeParam;
  const Index d_model = 11, h_q = 6, d_h = 4, batch = 2, seq = 5;
  const RopeTable<Scalar> table(16, d_h);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  params.position_offset = 3;
  const AttentionMask<Scalar> mask = causal_if<Scalar>(true);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(batch * seq, d_model, 5);
  for (const Index h_kv : {Index{6}, Index{3}, Index{2}, Index{1}}) {
    SCOPED_TRACE("H_kv " + std::to_string(h_kv));
    const auto gqa = GroupedQueryAttention<Scalar>::random({d_model, h_q, h_kv, d_h}, 6);
    const GqaWeights<Scalar>& w = gqa.weights();
    GqaWeights<Scalar> repeated = w;
    repeated.w_k = RowMatrix<Scalar>(d_model, h_q * d_h);
    repeated.w_v = RowMatrix<Scalar>(d_model, h_q * d_h);
    for (Index h = 0; h < h_q; ++h) {
      const Index g = apex::kv_head_for({h_q, h_kv}, h);
      repeated.w_k.middleCols(h * d_h, d_h) = w.w_k.middleCols(g * d_h, d_h);
      repeated.w_v.middleCols(h * d_h, d_h) = w.w_v.middleCols(g * d_h, d_h);
    }
    const GroupedQueryAttention<Scalar> mha(GqaConfig::multi_head(d_model, h_q, d_h), repeated);
    expect_close(gqa.forward(x, batch, mask, params),
                 mha.forward(x, batch, mask, params).template cast<double>(),
                 Tolerances<Scalar>::kGqaLayer);
  }
}

// The decoding recipe of the class comment: project the new token at its position, append its
// K and V to a cache, attend with multi_head_attention (bottom-right causal alignment). The
// result is the last row of the prompt's forward pass.
TYPED_TEST(GqaTyped, DecodeStepWithACacheMatchesForward) {
  using Scalar = TypeParam;
  const GqaConfig config{12, 6, 2, 4};
  const Index seq = 7;
  const auto layer = GroupedQueryAttention<Scalar>::random(config, 11);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(seq, config.d_model, 12);
  const RopeTable<Scalar> table(16, config.head_dim);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  const AttentionMask<Scalar> mask = causal_if<Scalar>(true);
  const RowMatrix<Scalar> full = layer.forward(x, 1, mask, params);

  const apex::ProjectedQkv<Scalar> cached = layer.project(x.topRows(seq - 1), 1, params);
  params.position_offset = seq - 1;
  const apex::ProjectedQkv<Scalar> step = layer.project(x.bottomRows(1), 1, params);
  RowMatrix<Scalar> k_cache(seq, cached.k.cols());
  RowMatrix<Scalar> v_cache(seq, cached.v.cols());
  k_cache << cached.k, step.k;
  v_cache << cached.v, step.v;
  const auto heads = [&](const RowMatrix<Scalar>& m) {
    return apex::HeadsView<const Scalar>::token_major(
        m.data(), {1, config.num_kv_heads, seq, config.head_dim});
  };
  const RowMatrix<Scalar> row = apex::multi_head_attention(
      step.q_heads(), heads(k_cache), heads(v_cache), mask, {}, layer.weights().w_o);
  expect_close(row, full.bottomRows(1).template cast<double>(), Tolerances<Scalar>::kGqaLayer);
}

// QK-norm: every query and key head of the projections is RMS-normalised with its γ before
// RoPE (the plain RMSNorm of reference/rms_norm.hpp on each head, then the layer's RoPE table),
// V is untouched; decoding with a cache equals the forward pass, and a bad γ or ε is rejected.
TYPED_TEST(GqaTyped, QkNormNormalisesEveryHeadBeforeRope) {
  using Scalar = TypeParam;
  const GqaConfig config{12, 6, 2, 4};
  const Index seq = 9;
  const auto plain = GroupedQueryAttention<Scalar>::random(config, 21);
  GqaWeights<Scalar> weights = plain.weights();
  apex::QkNorm<Scalar> norm;
  norm.q_gamma = random_matrix<Scalar>(config.head_dim, 1, 22);
  norm.k_gamma = random_matrix<Scalar>(config.head_dim, 1, 23);
  norm.eps = 1e-5;
  weights.qk_norm = norm;
  const GroupedQueryAttention<Scalar> layer(config, weights);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(2 * seq, config.d_model, 24);
  const RopeTable<Scalar> table(16, config.head_dim);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  params.position_offset = 3;
  const apex::ProjectedQkv<Scalar> p = layer.project(x, 2, params);
  const apex::ProjectedQkv<Scalar> raw = plain.project(x, 2);
  const auto expected = [&](const RowMatrix<Scalar>& projected, const apex::Vector<Scalar>& gamma) {
    const Index d_h = config.head_dim;
    RowMatrix<Scalar> heads(projected.size() / d_h, d_h);
    const apex::reference::RmsMatrix flat =
        Eigen::Map<const RowMatrix<Scalar>>(projected.data(), heads.rows(), d_h)
            .template cast<double>();
    heads = apex::reference::rms_norm(flat, gamma.template cast<double>(), norm.eps)
                .template cast<Scalar>();
    RowMatrix<Scalar> rotated =
        Eigen::Map<RowMatrix<Scalar>>(heads.data(), projected.rows(), projected.cols());
    for (Index b = 0; b < 2; ++b) {
      apex::apply_rope(table, 3, apex::RowRef<Scalar>(rotated.middleRows(b * seq, seq)));
    }
    return rotated;
  };
  expect_close(p.q, expected(raw.q, norm.q_gamma).template cast<double>(),
               Tolerances<Scalar>::kGqaLayer);
  expect_close(p.k, expected(raw.k, norm.k_gamma).template cast<double>(),
               Tolerances<Scalar>::kGqaLayer);
  EXPECT_EQ(p.v, raw.v);

  params.position_offset = 0;
  const AttentionMask<Scalar> mask = causal_if<Scalar>(true);
  const RowMatrix<Scalar> full = layer.forward(x.topRows(seq), 1, mask, params);
  auto cache = layer.make_cache(1, seq);
  RowMatrix<Scalar> decoded(seq, config.d_model);
  for (Index t = 0; t < seq; ++t) {
    params.position_offset = t;
    decoded.row(t) = layer.forward_cached(x.middleRows(t, 1), apex::causal_mask(), params, cache);
  }
  expect_close(decoded, full.template cast<double>(), Tolerances<Scalar>::kGqaLayer);
  EXPECT_EQ(layer.template with_weights<Eigen::bfloat16>().weights().qk_norm->eps, norm.eps);

  weights.qk_norm->k_gamma.resize(3);
  expect_invalid([&] { GroupedQueryAttention<Scalar>(config, weights); },
                 "[gqa] qk_norm gamma lengths (4, 3) must be head_dim 4");
  weights.qk_norm = norm;
  weights.qk_norm->eps = 0.0;
  expect_invalid([&] { GroupedQueryAttention<Scalar>(config, weights); },
                 "[gqa] qk_norm eps (0) must be positive and finite");
}

TYPED_TEST(GqaTyped, ValueOverloadAndInPlaceAgree) {
  using Scalar = TypeParam;
  const GqaConfig config{10, 4, 2, 4};
  const auto layer = GroupedQueryAttention<Scalar>::random(config, 9);
  RowMatrix<Scalar> x = random_matrix<Scalar>(2 * 3, config.d_model, 10);
  const RowMatrix<Scalar> expected = layer.forward(x, 2, causal_if<Scalar>(true));
  RowMatrix<Scalar> out(x.rows(), config.d_model);
  layer.forward(x, 2, causal_if<Scalar>(true), {}, out);
  EXPECT_EQ(out, expected);
  layer.forward(x, 2, causal_if<Scalar>(true), {}, x);  // out = x: documented as allowed
  EXPECT_EQ(x, expected);
}

// ---------------------------------------------------------------------------------------------
// Bad input: the message names the argument; outputs keep their sentinel values.
// ---------------------------------------------------------------------------------------------

constexpr float kSentinel = 12345.0f;

TEST(Gqa, RejectsQueryHeadsNotAMultipleOfKvHeads) {
  const std::string message = "[gqa] num_q_heads (12) must be a multiple of num_kv_heads (5)";
  expect_invalid([] { (void)apex::kv_head_for({12, 5}, 0); }, {message});
  expect_invalid([] { (void)apex::kv_cache_ratio({12, 5}); }, {message});
  expect_invalid([] { (void)GroupedQueryAttention<float>::random({16, 12, 5, 4}, 1); }, {message});
  expect_invalid(
      [] {
        (void)apex::kv_head_for({4, 2}, 4);
      },
      {"[gqa] query_head (4) must be in [0, num_q_heads) = [0, 4)"});
}

TEST(Gqa, RejectsWeightShapeMismatch) {
  const GqaConfig config{16, 4, 2, 4};
  GqaWeights<float> w = GroupedQueryAttention<float>::random(config, 1).weights();
  w.w_k = random_matrix<float>(16, 7, 2);
  expect_invalid([&] { GroupedQueryAttention<float> layer(config, w); },
                 {"[gqa] w_k shape [16, 7] must be [d_model, num_kv_heads*head_dim] = [16, 8]"});
  w = GroupedQueryAttention<float>::random(config, 1).weights();
  w.w_o = random_matrix<float>(16, 15, 3);
  expect_invalid([&] { GroupedQueryAttention<float> layer(config, w); },
                 {"[gqa] w_o shape [16, 15] must be [num_q_heads*head_dim, d_model] = [16, 16]"});
}

// A layer and its sentinel-filled output for the forward-time checks below.
struct ForwardFixture {
  GqaConfig config{16, 4, 2, 4};
  GroupedQueryAttention<float> layer = GroupedQueryAttention<float>::random(config, 1);
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, kSentinel);
  bool untouched() const { return (out.array() == kSentinel).all(); }
};

TEST(Gqa, RejectsInputWidthOtherThanDModel) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 15, 1);
  expect_invalid([&] { f.layer.forward(x, 1, {}, {}, f.out); },
                 {"[gqa] x width (15) must equal d_model (16)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Gqa, RejectsRowsNotDivisibleByBatch) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 16, 1);
  expect_invalid([&] { f.layer.forward(x, 4, {}, {}, f.out); },
                 {"[gqa] x rows (6) must be a multiple of batch (4)"});
  expect_invalid([&] { f.layer.forward(x, 0, {}, {}, f.out); }, {"[gqa] batch (0) must be >= 1"});
  EXPECT_TRUE(f.untouched());
}

TEST(Gqa, RejectsRopeTableTooShort) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 16, 1);
  const RopeTable<float> table(8, 4);
  AttentionLayerParams<float> params;
  params.rope = &table;
  params.position_offset = 5;  // batch 2: S = 3, positions 5, 6, 7 fit in 8
  f.layer.forward(x, 2, {}, params, f.out);
  f.out.setConstant(kSentinel);
  params.position_offset = 6;  // positions 6, 7, 8 do not
  expect_invalid([&] { f.layer.forward(x, 2, {}, params, f.out); },
                 {"[gqa] positions [position_offset, position_offset + S) = [6, 6 + 3) must be "
                  "below the RoPE table's max_positions (8)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Gqa, RejectsPositionOffsetNearTheTopOfTheRange) {
  // position_offset + S overflows: the check compares without forming the sum, before any RoPE.
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 16, 1);
  const RopeTable<float> table(8, 4);
  AttentionLayerParams<float> params;
  params.rope = &table;
  const Index max = std::numeric_limits<Index>::max();
  for (const Index offset : {max, max - 2, Index{8}}) {
    params.position_offset = offset;
    expect_invalid([&] { f.layer.forward(x, 2, {}, params, f.out); },
                   {"[gqa] positions [position_offset, position_offset + S) = [" +
                        std::to_string(offset) + ", " + std::to_string(offset) + " + 3)",
                    "must be below the RoPE table's max_positions (8)"});
    expect_invalid([&] { (void)f.layer.project(x, 2, params); }, "[gqa] positions");
  }
  EXPECT_TRUE(f.untouched());
}

TEST(Gqa, CachedForwardRejectsPositionsBeyondTheIndexRange) {
  // A sliding-window cache holds only W tokens, so its next position can be anything: a chunk
  // that would end beyond the largest Index is rejected, and the cache and out stay unchanged.
  ForwardFixture f;
  apex::SlidingWindowCache<float> cache = f.layer.make_window_cache(1, 4);
  const Index max = std::numeric_limits<Index>::max();
  // One token's K (or V) row, [2 heads × 4], repeated max - 2 times by a zero row stride: after
  // appending it the cache sits at position max - 2.
  const RowMatrix<float> kv = RowMatrix<float>::Constant(1, 8, 0.5f);
  const apex::HeadsView<const float> many(kv.data(), {1, 2, max - 2, 4}, {0, 4, 0});
  cache.append(many, many, 0);
  ASSERT_EQ(cache.next_position(), max - 2);
  const RowMatrix<float> x = random_matrix<float>(3, 16, 1);
  RowMatrix<float> out = RowMatrix<float>::Constant(3, 16, kSentinel);
  AttentionLayerParams<float> params;
  params.position_offset = max - 2;
  expect_invalid(
      [&] { f.layer.forward_cached(x, apex::sliding_window_mask(4), params, cache, out); },
      {"[gqa] position_offset + n (9223372036854775805 + 3)", "fit in 64 bits"});
  EXPECT_TRUE((out.array() == kSentinel).all());
  EXPECT_EQ(cache.next_position(), max - 2);
}

TEST(Gqa, RejectsRopeTableOfAnotherHeadDim) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 16, 1);
  const RopeTable<float> table(8, 6);
  AttentionLayerParams<float> params;
  params.rope = &table;
  expect_invalid([&] { f.layer.forward(x, 2, {}, params, f.out); },
                 {"[gqa] RoPE table head_dim (6) must equal the layer's head_dim (4)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Gqa, RejectsWrongMaskAndOutputShapes) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 16, 1);
  const apex::BoolMatrix shared = apex::BoolMatrix::Constant(6, 6, true);  // S is 3
  AttentionMask<float> mask;
  mask.allowed = apex::as_heads_view(shared);
  expect_invalid([&] { f.layer.forward(x, 2, mask, {}, f.out); },
                 {"[gqa] allowed mask shape [6, 6] must be [S_q, S_k] = [3, 3]"});
  EXPECT_TRUE(f.untouched());
  RowMatrix<float> wide = RowMatrix<float>::Constant(6, 17, kSentinel);
  expect_invalid([&] { f.layer.forward(x, 2, {}, {}, wide); },
                 {"[gqa] out shape [6, 17] must be [B*S, d] = [6, 16]"});
  EXPECT_TRUE((wide.array() == kSentinel).all());
}

// ---------------------------------------------------------------------------------------------
// The backward pass, against finite differences of the layer's own forward pass in double
// (finite_differences.hpp: within 1e-7 of the largest gradient)
// ---------------------------------------------------------------------------------------------

TEST(GqaBackward, MatchesFiniteDifferencesWithRopeQkNormSinksAndAWindow) {
  const GqaConfig config{8, 4, 2, 4};
  const Index batch = 2, seq = 5;
  GqaWeights<double> w = GroupedQueryAttention<double>::random(config, 31).weights();
  w.sinks = {0.3, -0.2, 0.1, 0.5};
  w.qk_norm = apex::QkNorm<double>{random_matrix<double>(4, 1, 32, 0.5, 1.5),
                                   random_matrix<double>(4, 1, 33, 0.5, 1.5), 1e-3};
  RowMatrix<double> x = random_matrix<double>(batch * seq, config.d_model, 34);
  const RowMatrix<double> d_out = random_matrix<double>(batch * seq, config.d_model, 35);
  const RopeTable<double> table(16, config.head_dim, RopeParams{100.0, 0, RopePairing::kHalfSplit});
  AttentionLayerParams<double> params;
  params.rope = &table;
  params.position_offset = 2;
  params.attention.softcap = 3.0;
  AttentionMask<double> mask;
  mask.positions = apex::sliding_window_mask(3);
  const auto loss = [&] {
    const GroupedQueryAttention<double> layer(config, w);
    return (layer.forward(x, batch, mask, params).array() * d_out.array()).sum();
  };
  const GroupedQueryAttention<double> layer(config, w);
  RowMatrix<double> d_x(batch * seq, config.d_model);
  GqaWeights<double> g;
  layer.backward(x, batch, mask, params, d_out, d_x, g);
  apex::testing::expect_matches_differences(x, d_x, loss, "d_x");
  apex::testing::expect_matches_differences(w.w_q, g.w_q, loss, "d_w_q");
  apex::testing::expect_matches_differences(w.w_k, g.w_k, loss, "d_w_k");
  apex::testing::expect_matches_differences(w.w_v, g.w_v, loss, "d_w_v");
  apex::testing::expect_matches_differences(w.w_o, g.w_o, loss, "d_w_o");
  apex::testing::expect_matches_differences(w.qk_norm->q_gamma, g.qk_norm->q_gamma, loss,
                                            "d_q_gamma");
  apex::testing::expect_matches_differences(w.qk_norm->k_gamma, g.qk_norm->k_gamma, loss,
                                            "d_k_gamma");
  Eigen::Map<Eigen::VectorXd> sinks(w.sinks.data(), 4);
  apex::testing::expect_matches_differences(
      sinks, Eigen::Map<const Eigen::VectorXd>(g.sinks.data(), 4), loss, "d_sinks");
}

TEST(GqaBackward, FloatMatchesDoubleAndRejectsBadShapes) {
  const GqaConfig config{12, 6, 2, 4};
  const auto layer = GroupedQueryAttention<float>::random(config, 41);
  const auto wide =
      GroupedQueryAttention<double>(config, apex::converted_weights<double>(layer.weights()));
  const RowMatrix<float> x = random_matrix<float>(14, 12, 42);
  const RowMatrix<float> d_out = random_matrix<float>(14, 12, 43);
  const AttentionMask<float> mask = causal_if<float>(true);
  RowMatrix<float> d_x(14, 12);
  GqaWeights<float> g;
  layer.backward(x, 2, mask, {}, d_out, d_x, g);
  RowMatrix<double> d_x_wide(14, 12);
  GqaWeights<double> g_wide;
  wide.backward(RowMatrix<double>(x.cast<double>()), 2, causal_if<double>(true), {},
                RowMatrix<double>(d_out.cast<double>()), d_x_wide, g_wide);
  // Float against double on the same inputs: the chain of kGqaLayer and the backward's own
  // products, within kBackward of the largest gradient.
  const auto close = [](const auto& a, const auto& b) {
    const double scale = std::max(1.0, b.cwiseAbs().maxCoeff());
    return (a.template cast<double>() - b).cwiseAbs().maxCoeff() <=
           Tolerances<float>::kBackward * scale;
  };
  EXPECT_TRUE(close(d_x, d_x_wide));
  EXPECT_TRUE(close(g.w_q, g_wide.w_q) && close(g.w_k, g_wide.w_k) && close(g.w_v, g_wide.w_v) &&
              close(g.w_o, g_wide.w_o));
  EXPECT_TRUE(g.sinks.empty() && !g.qk_norm);
  RowMatrix<float> before = d_x;
  expect_invalid([&] { layer.backward(x, 2, mask, {}, d_out.topRows(12), d_x, g); },
                 {"[gqa] d_out shape [12, 12]"});
  expect_invalid([&] { layer.backward(x, 2, mask, {}, d_out, d_x.topRows(12), g); },
                 {"[gqa] out shape [12, 12]"});
  RowMatrix<float> x_copy = x;
  expect_invalid([&] { layer.backward(x_copy, 2, mask, {}, d_out, x_copy, g); },
                 {"[gqa] d_x must not overlap x or d_out"});
  EXPECT_EQ(d_x, before);
}

}  // namespace
}  // namespace gqa_test
