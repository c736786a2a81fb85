// SPDX-License-Identifier: MIT
// Tests for §9: multi-head latent attention (compression, decompression, decoupled RoPE), its
// parameter table and its cache size, against plain loops of the §9 formulas.
#include <apex/mla.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "finite_differences.hpp"
#include "reference/attention.hpp"
#include "reference/rope.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace mla_test {
namespace {

using apex::AttentionLayerParams;
using apex::AttentionMask;
using apex::Index;
using apex::MlaConfig;
using apex::MlaWeights;
using apex::MultiHeadLatentAttention;
using apex::RopeTable;
using apex::RowMatrix;
using apex::testing::expect_close;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;
using apex::testing::Tolerances;
using MatrixXd = Eigen::MatrixXd;

// Tolerance, per element: |actual − expected| ≤ tol · max(1, |expected|) with tol =
// Tolerances<Scalar>::kMlaLayer of tolerances.hpp. x is O(1) and the weights are N(0, 1/fan_in),
// so every intermediate is O(1). An output passes through two chained projections (x·W_DKV then
// ·W_UK, lengths ≤ 14), RoPE, the scores (length d_h + d_r = 9), a softmax over ≤ 7 keys, the
// weighted sum and W_O (length ≤ 20). A wrong head, position or scale moves results by O(0.01) or
// more.

// ---------------------------------------------------------------------------------------------
// Plain double-precision reference, written straight from §9.2 - §9.3 and §6.2.
// ---------------------------------------------------------------------------------------------

struct PlainQkv {
  MatrixXd q_final;  // [B*S, H_q (d_h + d_r)]
  MatrixXd k_final;  // [B*S, H_kv (d_h + d_r)]
  MatrixXd v;        // [B*S, H_kv d_h]
};

template <class Scalar>
PlainQkv plain_decompress(const RowMatrix<Scalar>& x_in, Index batch, const MlaConfig& c,
                          const MlaWeights<Scalar>& w, Index offset) {
  const MatrixXd x = x_in.template cast<double>();
  const Index seq = x.rows() / batch;
  const Index d_h = c.head_dim, d_r = c.rope_dim, w_qk = d_h + d_r;
  const Index h_kr = c.num_rope_key_heads == 0 ? c.num_kv_heads : c.num_rope_key_heads;
  const std::vector<double> theta = apex::reference::rope_theta(d_r, 10000.0);
  std::vector<long long> positions;
  for (Index s = 0; s < seq; ++s) positions.push_back(offset + s);
  PlainQkv r;
  r.q_final.resize(x.rows(), c.num_q_heads * w_qk);
  r.k_final.resize(x.rows(), c.num_kv_heads * w_qk);
  r.v.resize(x.rows(), c.num_kv_heads * d_h);
  for (Index b = 0; b < batch; ++b) {
    const MatrixXd xb = x.middleRows(b * seq, seq);
    const MatrixXd c_kv = xb * w.w_dkv.template cast<double>();  // §9.2
    const MatrixXd k = c_kv * w.w_uk.template cast<double>();    // §9.2
    const MatrixXd v = c_kv * w.w_uv.template cast<double>();    // §9.2
    const MatrixXd c_q = xb * w.w_dq.template cast<double>();    // §9.2
    const MatrixXd q = c_q * w.w_uq.template cast<double>();     // §9.2
    const MatrixXd q_rope = apex::reference::rope(xb * w.w_qr.template cast<double>(), positions,
                                                  theta, d_r, /*half_split=*/false);  // §9.3
    const MatrixXd k_rope = apex::reference::rope(xb * w.w_kr.template cast<double>(), positions,
                                                  theta, d_r, /*half_split=*/false);  // §9.3
    for (Index h = 0; h < c.num_q_heads; ++h) {
      r.q_final.block(b * seq, h * w_qk, seq, d_h) = q.middleCols(h * d_h, d_h);
      r.q_final.block(b * seq, h * w_qk + d_h, seq, d_r) = q_rope.middleCols(h * d_r, d_r);
    }
    for (Index g = 0; g < c.num_kv_heads; ++g) {
      const Index rope_head = h_kr == 1 ? 0 : g;
      r.k_final.block(b * seq, g * w_qk, seq, d_h) = k.middleCols(g * d_h, d_h);
      r.k_final.block(b * seq, g * w_qk + d_h, seq, d_r) = k_rope.middleCols(rope_head * d_r, d_r);
    }
    r.v.middleRows(b * seq, seq) = v;
  }
  return r;
}

// Attention of every head on the decompressed tensors with scale 1/√(d_h + d_r) (the plain loop
// of reference/attention.hpp), then W_O.
template <class Scalar>
MatrixXd plain_mla(const RowMatrix<Scalar>& x, Index batch, const MlaConfig& c,
                   const MlaWeights<Scalar>& w, bool causal, Index offset) {
  const PlainQkv p = plain_decompress(x, batch, c, w, offset);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim + c.rope_dim));
  const apex_test::MatrixD concat = apex_test::multi_head_attention(
      p.q_final, p.k_final, p.v, {batch, c.num_q_heads, c.num_kv_heads},
      [&](Index, Index, Index i, Index j) { return !causal || j <= i; }, scale);
  return concat * w.w_o.template cast<double>();
}

template <class Scalar>
AttentionMask<Scalar> causal_if(bool causal) {
  AttentionMask<Scalar> mask;
  if (causal) mask.positions = apex::causal_mask();
  return mask;
}

// The small config of the typed tests: nothing is a multiple of anything, H_q = 2·H_kv.
MlaConfig small_config(Index num_rope_key_heads) {
  MlaConfig c;
  c.d_model = 14;
  c.d_q = 9;
  c.d_kv = 7;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 5;
  c.rope_dim = 4;
  c.num_rope_key_heads = num_rope_key_heads;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Worked examples
// ---------------------------------------------------------------------------------------------

// APEX-1 Large as §9.4 gives it (d_kv = 512, H_q = 128, d_h = 128) with H_kv = 8 from §8.3.
// The documents give no d_r for APEX-1 Large: d_r = 64 is an assumption of this test (DeepSeek-V3's
// value). d_model and d_q do not enter the cache size.
MlaConfig apex1_large(Index num_rope_key_heads) {
  MlaConfig c;
  c.d_model = 7168;
  c.d_q = 1536;
  c.d_kv = 512;
  c.num_q_heads = 128;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.rope_dim = 64;  // assumption, see above
  c.num_rope_key_heads = num_rope_key_heads;
  return c;
}

TEST(Mla, S9_4_CacheSize) {
  const MlaConfig large = apex1_large(0);  // H_kr = H_kv = 8, as §9.3 writes it
  // MHA caches 2 · H_q · d_h = 32768 values per token.
  EXPECT_EQ(apex::kv_cache_values_per_token(128, 128), 32768);
  // §9.4's figure, c_kv only: 512 / 32768 = 1.5625% (printed as 1.6%), a 98.4375% reduction.
  EXPECT_EQ(apex::mla_cache_values_per_token_document(large), 512);
  EXPECT_EQ(apex::mla_cache_ratio_document(large), 0.015625);
  EXPECT_EQ(1.0 - apex::mla_cache_ratio_document(large), 0.984375);
  // The true figure also caches K_rope (it comes from x, not c_kv; SEED-NOTES.md):
  // H_kr = H_kv = 8: 512 + 8·64 = 1024 values, 3.125% of MHA.
  EXPECT_EQ(apex::mla_cache_values_per_token(large), 1024);
  EXPECT_EQ(apex::mla_cache_ratio(large), 0.03125);
  // H_kr = 1 (one shared K_rope head): 512 + 64 = 576 values, 1.7578125% of MHA.
  const MlaConfig shared = apex1_large(1);
  EXPECT_EQ(apex::mla_cache_values_per_token(shared), 576);
  EXPECT_EQ(apex::mla_cache_ratio(shared), 0.017578125);
  EXPECT_EQ(apex::mla_cache_values_per_token_document(shared), 512);
  // Either way MLA caches less than GQA with 8 KV heads (0.0625, §8.3).
  EXPECT_LT(apex::mla_cache_ratio(large),
            static_cast<double>(apex::kv_cache_values_per_token(8, 128)) / 32768.0);
}

TEST(Mla, S9_5_ParameterCount) {
  MlaConfig c;
  c.d_model = 24;
  c.d_q = 10;
  c.d_kv = 8;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 6;
  c.rope_dim = 4;
  const std::int64_t d = 24, d_q = 10, d_kv = 8, h_q = 4, h_kv = 2, d_h = 6, d_r = 4;
  struct Expected {
    const char* name;
    std::int64_t rows, cols;
  };
  const std::vector<Expected> expected = {
      {"W_DKV", d, d_kv},      {"W_UK", d_kv, h_kv * d_h}, {"W_UV", d_kv, h_kv * d_h},
      {"W_DQ", d, d_q},        {"W_UQ", d_q, h_q * d_h},   {"W_QR", d, h_q * d_r},
      {"W_KR", d, h_kv * d_r}, {"W_O", h_q * d_h, d},
  };
  const std::vector<apex::MlaMatrixShape> table = apex::mla_parameter_table(c);
  ASSERT_EQ(table.size(), expected.size());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < table.size(); ++i) {
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(table[i].name, expected[i].name);
    EXPECT_EQ(table[i].rows, expected[i].rows);
    EXPECT_EQ(table[i].cols, expected[i].cols);
    EXPECT_EQ(table[i].count(), expected[i].rows * expected[i].cols);
    EXPECT_FALSE(table[i].purpose.empty());
    total += expected[i].rows * expected[i].cols;
  }
  // 192 + 96 + 96 + 240 + 240 + 384 + 192 + 576
  EXPECT_EQ(total, 2016);
  EXPECT_EQ(apex::mla_parameter_count(c), total);
  // A layer holds exactly these weights.
  const auto layer = MultiHeadLatentAttention<float>::random(c, 3);
  const auto& w = layer.weights();
  EXPECT_EQ(layer.parameter_count(), w.w_dkv.size() + w.w_uk.size() + w.w_uv.size() +
                                         w.w_dq.size() + w.w_uq.size() + w.w_qr.size() +
                                         w.w_kr.size() + w.w_o.size());
  // One shared K_rope head: W_KR shrinks to [d, d_r].
  c.num_rope_key_heads = 1;
  EXPECT_EQ(apex::mla_parameter_table(c)[6].cols, d_r);
  EXPECT_EQ(apex::mla_parameter_count(c), total - d * h_kv * d_r + d * d_r);
}

// ---------------------------------------------------------------------------------------------
// The layer against the plain loops
// ---------------------------------------------------------------------------------------------

template <class Scalar>
class MlaTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MlaTyped, Scalars, apex::testing::ScalarName);

struct MlaCase {
  Index num_q_heads, num_kv_heads, num_rope_key_heads, batch, seq;
  bool causal;
  Index offset;
};

const std::vector<MlaCase>& mla_cases() {
  static const std::vector<MlaCase> cases = {
      {4, 2, 0, 2, 7, true, 0},   // the document's H_kr = H_kv, grouped, B = 2
      {4, 2, 1, 2, 7, true, 5},   // one shared K_rope head
      {4, 2, 0, 1, 6, false, 3},  // bidirectional
      {3, 3, 0, 3, 4, true, 9},   // H_kv = H_q
      {3, 3, 1, 2, 1, true, 2},   // a single token per block
      {4, 1, 1, 2, 5, true, 0},   // one KV head
  };
  return cases;
}

std::string describe(const MlaCase& t) {
  return "H_q " + std::to_string(t.num_q_heads) + ", H_kv " + std::to_string(t.num_kv_heads) +
         ", H_kr " + std::to_string(t.num_rope_key_heads) + ", B " + std::to_string(t.batch) +
         ", S " + std::to_string(t.seq);
}

MlaConfig config_of(const MlaCase& t) {
  MlaConfig c = small_config(t.num_rope_key_heads);
  c.num_q_heads = t.num_q_heads;
  c.num_kv_heads = t.num_kv_heads;
  return c;
}

// What a case of mla_cases() runs on: its config, a layer with random weights (from `seed`), an
// input x [B*S, d] (from seed + 1) and params with `table` at the case's position offset.
template <class Scalar>
struct CaseSetup {
  MlaConfig config;
  MultiHeadLatentAttention<Scalar> layer;
  RowMatrix<Scalar> x;
  AttentionLayerParams<Scalar> params;
};

template <class Scalar>
CaseSetup<Scalar> setup_case(const MlaCase& t, const RopeTable<Scalar>& table, std::uint32_t seed) {
  const MlaConfig c = config_of(t);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  params.position_offset = t.offset;
  return {c, MultiHeadLatentAttention<Scalar>::random(c, seed),
          random_matrix<Scalar>(t.batch * t.seq, c.d_model, seed + 1), params};
}

TYPED_TEST(MlaTyped, DecompressMatchesPlainLoop) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  for (const MlaCase& t : mla_cases()) {
    SCOPED_TRACE(describe(t));
    const auto [c, layer, x, params] = setup_case<Scalar>(t, table, 20);
    const apex::ProjectedQkv<Scalar> p = layer.decompress(x, t.batch, params);
    const PlainQkv expected = plain_decompress(x, t.batch, c, layer.weights(), t.offset);
    expect_close(p.q, expected.q_final, Tolerances<Scalar>::kMlaLayer);
    expect_close(p.k, expected.k_final, Tolerances<Scalar>::kMlaLayer);
    expect_close(p.v, expected.v, Tolerances<Scalar>::kMlaLayer);
    EXPECT_EQ(p.qk_dim, c.head_dim + c.rope_dim);
    EXPECT_EQ(p.v_dim, c.head_dim);
  }
}

TYPED_TEST(MlaTyped, ForwardMatchesPlainLoop) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  for (const MlaCase& t : mla_cases()) {
    SCOPED_TRACE(describe(t));
    const auto [c, layer, x, params] = setup_case<Scalar>(t, table, 30);
    RowMatrix<Scalar> out(x.rows(), c.d_model);
    layer.forward(x, t.batch, causal_if<Scalar>(t.causal), params, out);
    expect_close(out, plain_mla(x, t.batch, c, layer.weights(), t.causal, t.offset),
                 Tolerances<Scalar>::kMlaLayer);
  }
}

// MLA is ordinary attention on the decompressed heads: the oracle apex::reference::sdpa on
// decompress()'s tensors, then W_O, gives the layer's output.
TYPED_TEST(MlaTyped, ForwardEqualsSdpaOnDecompressedHeads) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  for (const MlaCase& t : mla_cases()) {
    SCOPED_TRACE(describe(t));
    const auto [c, layer, x, params] = setup_case<Scalar>(t, table, 40);
    const AttentionMask<Scalar> mask = causal_if<Scalar>(t.causal);
    const apex::ProjectedQkv<Scalar> p = layer.decompress(x, t.batch, params);
    RowMatrix<Scalar> concat(x.rows(), c.num_q_heads * c.head_dim);
    apex::reference::sdpa<Scalar>(p.q_heads(), p.k_heads(), p.v_heads(), mask, {},
                                  apex::HeadsView<Scalar>::token_major(
                                      concat.data(), {t.batch, c.num_q_heads, t.seq, c.head_dim}));
    const MatrixXd expected = (concat * layer.weights().w_o).template cast<double>();
    expect_close(layer.forward(x, t.batch, mask, params), expected, Tolerances<Scalar>::kMlaLayer);
  }
}

// One shared K_rope head is the per-KV-head layout with every K_rope head equal.
TYPED_TEST(MlaTyped, SharedRopeKeyEqualsRepeatedRopeKeys) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  params.position_offset = 4;
  const MlaConfig shared_config = small_config(1);
  const auto shared = MultiHeadLatentAttention<Scalar>::random(shared_config, 50);
  MlaWeights<Scalar> w = shared.weights();
  const RowMatrix<Scalar> one_head = w.w_kr;
  w.w_kr.resize(shared_config.d_model, shared_config.num_kv_heads * shared_config.rope_dim);
  for (Index g = 0; g < shared_config.num_kv_heads; ++g) {
    w.w_kr.middleCols(g * shared_config.rope_dim, shared_config.rope_dim) = one_head;
  }
  const MultiHeadLatentAttention<Scalar> per_head(small_config(0), w);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(2 * 6, shared_config.d_model, 51);
  const AttentionMask<Scalar> mask = causal_if<Scalar>(true);
  expect_close(shared.forward(x, 2, mask, params),
               per_head.forward(x, 2, mask, params).template cast<double>(),
               Tolerances<Scalar>::kMlaLayer);
}

TYPED_TEST(MlaTyped, DefaultScaleIsOverTheFullQueryKeyWidth) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  const MlaConfig c = small_config(0);
  const auto layer = MultiHeadLatentAttention<Scalar>::random(c, 60);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(6, c.d_model, 61);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  const RowMatrix<Scalar> by_default = layer.forward(x, 1, {}, params);
  params.attention.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim + c.rope_dim));
  EXPECT_EQ(layer.forward(x, 1, {}, params), by_default);
  params.attention.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));  // d_h alone
  EXPECT_GT((layer.forward(x, 1, {}, params) - by_default).norm(), 1e-3);
}

TYPED_TEST(MlaTyped, OutputMayOverwriteTheInput) {
  using Scalar = TypeParam;
  const RopeTable<Scalar> table(32, 4);
  const MlaConfig c = small_config(0);
  const auto layer = MultiHeadLatentAttention<Scalar>::random(c, 70);
  RowMatrix<Scalar> x = random_matrix<Scalar>(8, c.d_model, 71);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;
  const RowMatrix<Scalar> expected = layer.forward(x, 2, causal_if<Scalar>(true), params);
  layer.forward(x, 2, causal_if<Scalar>(true), params, x);
  EXPECT_EQ(x, expected);
}

// ---------------------------------------------------------------------------------------------
// Bad input: the message names the argument; outputs keep their sentinel values.
// ---------------------------------------------------------------------------------------------

constexpr float kSentinel = 12345.0f;

TEST(Mla, RejectsRopeKeyHeadsOtherThanOneOrKvHeads) {
  MlaConfig c = small_config(3);
  expect_invalid([&] { (void)MultiHeadLatentAttention<float>::random(c, 1); },
                 {"[mla] num_rope_key_heads (3) must be 1 (one shared K_rope head) or "
                  "num_kv_heads (2)"});
  expect_invalid([&] { (void)apex::mla_cache_values_per_token(c); }, {"num_rope_key_heads (3)"});
}

TEST(Mla, RejectsOddRopeDim) {
  MlaConfig c = small_config(0);
  c.rope_dim = 5;
  expect_invalid([&] { (void)MultiHeadLatentAttention<float>::random(c, 1); },
                 {"[mla] rope_dim d_r (5) must be even and at least 2"});
  expect_invalid([&] { (void)apex::mla_parameter_count(c); }, {"[mla] rope_dim d_r (5)"});
}

TEST(Mla, RejectsQueryHeadsNotAMultipleOfKvHeads) {
  MlaConfig c = small_config(0);
  c.num_q_heads = 6;
  c.num_kv_heads = 4;
  expect_invalid([&] { (void)MultiHeadLatentAttention<float>::random(c, 1); },
                 {"[mla] num_q_heads (6) must be a multiple of num_kv_heads (4)"});
}

TEST(Mla, RejectsWeightShapeMismatch) {
  const MlaConfig c = small_config(0);
  MlaWeights<float> w = MultiHeadLatentAttention<float>::random(c, 1).weights();
  w.w_uk = random_matrix<float>(7, 9, 2);
  expect_invalid([&] { MultiHeadLatentAttention<float> layer(c, w); },
                 {"[mla] W_UK shape [7, 9] must be [7, 10]"});
  w = MultiHeadLatentAttention<float>::random(c, 1).weights();
  w.w_kr = random_matrix<float>(14, 4, 2);  // one head's worth, but H_kr = H_kv = 2
  expect_invalid([&] { MultiHeadLatentAttention<float> layer(c, w); },
                 {"[mla] W_KR shape [14, 4] must be [14, 8]"});
}

TEST(Mla, RejectsConfigsWhoseSizesOverflow) {
  // H_q·d_h = 2^62·4 wraps to 0: the shape table would list zero-width matrices.
  MlaConfig c = small_config(0);
  c.num_q_heads = Index{1} << 62;
  c.num_kv_heads = 1;
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { (void)apex::mla_parameter_table(c); }, [&] { (void)apex::mla_parameter_count(c); },
           [&] { (void)apex::mla_cache_ratio(c); },
           [&] { (void)MultiHeadLatentAttention<float>::random(c, 1); }}) {
    expect_invalid(call, {"[mla] 2*num_q_heads*head_dim", "overflows 64 bits"});
  }
  // The cached row d_kv + H_kr·d_r.
  c = small_config(1);
  c.d_kv = std::numeric_limits<Index>::max() - 1;
  expect_invalid([&] { (void)apex::mla_cache_values_per_token(c); },
                 {"[mla] d_kv + H_kr*rope_dim", "fit in 64 bits"});
  // Widths that fit, W_DKV that does not: d·d_kv = 2^32 · 2^34.
  c = small_config(0);
  c.d_model = Index{1} << 32;
  c.d_kv = Index{1} << 34;
  expect_invalid([&] { (void)apex::mla_parameter_count(c); },
                 {"[mla] W_DKV count d_model*d_kv", "overflows 64 bits"});
  // Every matrix fits, their sum does not: W_DKV and W_DQ have 2^62 weights each.
  c = small_config(0);
  c.d_model = Index{1} << 31;
  c.d_q = Index{1} << 31;
  c.d_kv = Index{1} << 31;
  expect_invalid([&] { (void)apex::mla_parameter_table(c); },
                 {"[mla] weight count", "fit in 64 bits"});
  // A count that fits (about 2^61) whose bytes in double do not.
  c.d_model = Index{1} << 30;
  c.d_q = Index{1} << 30;
  c.d_kv = Index{1} << 30;
  expect_invalid([&] { (void)MultiHeadLatentAttention<double>::random(c, 1); },
                 {"[mla] weight bytes", "overflows 64 bits"});
}

struct ForwardFixture {
  MlaConfig config = small_config(0);
  MultiHeadLatentAttention<float> layer = MultiHeadLatentAttention<float>::random(config, 1);
  RopeTable<float> table{8, 4};
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 14, kSentinel);
  AttentionLayerParams<float> params() const {
    AttentionLayerParams<float> p;
    p.rope = &table;
    return p;
  }
  bool untouched() const { return (out.array() == kSentinel).all(); }
};

TEST(Mla, RejectsInputWidthOtherThanDModel) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 13, 1);
  expect_invalid([&] { f.layer.forward(x, 1, {}, f.params(), f.out); },
                 {"[mla] x width (13) must equal d_model (14)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Mla, RejectsRowsNotDivisibleByBatch) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 14, 1);
  expect_invalid([&] { f.layer.forward(x, 4, {}, f.params(), f.out); },
                 {"[mla] x rows (6) must be a multiple of batch (4)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Mla, RejectsRopeTableTooShort) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 14, 1);
  AttentionLayerParams<float> params = f.params();
  params.position_offset = 2;  // one block of 6: positions 2 … 7 fit in a table of 8
  f.layer.forward(x, 1, {}, params, f.out);
  f.out.setConstant(kSentinel);
  params.position_offset = 3;
  expect_invalid([&] { f.layer.forward(x, 1, {}, params, f.out); },
                 {"[mla] positions [position_offset, position_offset + S) = [3, 3 + 6) must be "
                  "below the RoPE table's max_positions (8)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Mla, RejectsMissingOrMismatchedRopeTable) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 14, 1);
  expect_invalid([&] { f.layer.forward(x, 1, {}, {}, f.out); },
                 {"[mla] params.rope (null) must be a RoPE table with head_dim = rope_dim (4)"});
  const RopeTable<float> wide(8, 6);
  AttentionLayerParams<float> params;
  params.rope = &wide;
  expect_invalid([&] { f.layer.forward(x, 1, {}, params, f.out); },
                 {"[mla] RoPE table head_dim (6) must equal rope_dim d_r (4)"});
  EXPECT_TRUE(f.untouched());
}

TEST(Mla, RejectsPositionOffsetNearTheTopOfTheRange) {
  // position_offset + S overflows: the layer compares without forming the sum, before RoPE.
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 14, 1);
  AttentionLayerParams<float> params = f.params();
  const Index max = std::numeric_limits<Index>::max();
  params.position_offset = max;
  expect_invalid([&] { f.layer.forward(x, 1, {}, params, f.out); },
                 {"[mla] positions [position_offset, position_offset + S) = [" +
                      std::to_string(max) + ", " + std::to_string(max) + " + 6)",
                  "max_positions (8)"});
  expect_invalid([&] { (void)f.layer.decompress(x, 2, params); }, "[mla] positions");
  EXPECT_TRUE(f.untouched());
}

TEST(Mla, ForwardOnNoTokens) {
  // An empty x has null data; the layer must not cut its (empty) projections into blocks.
  const MlaConfig c = small_config(0);
  const auto layer = MultiHeadLatentAttention<double>::random(c, 7);
  const RopeTable<double> table(8, c.rope_dim);
  AttentionLayerParams<double> params;
  params.rope = &table;
  const RowMatrix<double> x(0, c.d_model);
  const apex::ProjectedQkv<double> p = layer.decompress(x, 3, params);
  EXPECT_EQ(p.q.rows(), 0);
  EXPECT_EQ(p.q.cols(), c.num_q_heads * c.qk_dim());
  EXPECT_EQ(p.k.cols(), c.num_kv_heads * c.qk_dim());
  EXPECT_EQ(p.v.cols(), c.num_kv_heads * c.head_dim);
  const RowMatrix<double> out = layer.forward(x, 3, {}, params);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), c.d_model);
}

TEST(Mla, RejectsWrongOutputShape) {
  ForwardFixture f;
  const RowMatrix<float> x = random_matrix<float>(6, 14, 1);
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 13, kSentinel);
  expect_invalid([&] { f.layer.forward(x, 2, {}, f.params(), out); },
                 {"[mla] out shape [6, 13] must be [B*S, d] = [6, 14]"});
  EXPECT_TRUE((out.array() == kSentinel).all());
}

// ---------------------------------------------------------------------------------------------
// The backward pass, against finite differences of the layer's own forward pass in double
// (finite_differences.hpp: within 1e-7 of the largest gradient)
// ---------------------------------------------------------------------------------------------

TEST(MlaBackward, MatchesFiniteDifferencesForPerHeadAndSharedRopeKeys) {
  const RopeTable<double> table(32, 4);
  for (const Index rope_key_heads : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << "num_rope_key_heads " << rope_key_heads);
    const MlaConfig config = small_config(rope_key_heads);
    MlaWeights<double> w = MultiHeadLatentAttention<double>::random(config, 60).weights();
    w.sinks.assign(std::size_t(config.num_q_heads), 0.25);
    const Index batch = 2, seq = 4;
    RowMatrix<double> x = random_matrix<double>(batch * seq, config.d_model, 61);
    const RowMatrix<double> d_out = random_matrix<double>(batch * seq, config.d_model, 62);
    AttentionLayerParams<double> params;
    params.rope = &table;
    params.position_offset = 3;
    const AttentionMask<double> mask = causal_if<double>(true);
    const auto loss = [&] {
      const MultiHeadLatentAttention<double> layer(config, w);
      return (layer.forward(x, batch, mask, params).array() * d_out.array()).sum();
    };
    const MultiHeadLatentAttention<double> layer(config, w);
    RowMatrix<double> d_x(batch * seq, config.d_model);
    MlaWeights<double> g;
    layer.backward(x, batch, mask, params, d_out, d_x, g);
    apex::testing::expect_matches_differences(x, d_x, loss, "d_x");
    const char* names[] = {"d_w_dkv", "d_w_uk", "d_w_uv", "d_w_dq",
                           "d_w_uq",  "d_w_qr", "d_w_kr", "d_w_o"};
    RowMatrix<double>* weights[] = {&w.w_dkv, &w.w_uk, &w.w_uv, &w.w_dq,
                                    &w.w_uq,  &w.w_qr, &w.w_kr, &w.w_o};
    const RowMatrix<double>* grads[] = {&g.w_dkv, &g.w_uk, &g.w_uv, &g.w_dq,
                                        &g.w_uq,  &g.w_qr, &g.w_kr, &g.w_o};
    for (int i = 0; i < 8; ++i) {
      apex::testing::expect_matches_differences(*weights[i], *grads[i], loss, names[i]);
    }
    Eigen::Map<Eigen::VectorXd> sinks(w.sinks.data(), config.num_q_heads);
    apex::testing::expect_matches_differences(
        sinks, Eigen::Map<const Eigen::VectorXd>(g.sinks.data(), config.num_q_heads), loss,
        "d_sinks");
  }
}

TEST(MlaBackward, RejectsBadShapesBeforeWriting) {
  const RopeTable<float> table(32, 4);
  const MlaConfig config = small_config(0);
  const auto layer = MultiHeadLatentAttention<float>::random(config, 70);
  const RowMatrix<float> x = random_matrix<float>(8, config.d_model, 71);
  const RowMatrix<float> d_out = random_matrix<float>(8, config.d_model, 72);
  AttentionLayerParams<float> params;
  params.rope = &table;
  RowMatrix<float> d_x = RowMatrix<float>::Constant(8, config.d_model, 3.0f);
  MlaWeights<float> g;
  const AttentionMask<float> mask = causal_if<float>(true);
  expect_invalid([&] { layer.backward(x, 2, mask, params, d_out.topRows(6), d_x, g); },
                 {"[mla] d_out shape [6,"});
  expect_invalid([&] { layer.backward(x, 2, mask, {}, d_out, d_x, g); }, {"[mla]", "RoPE"});
  EXPECT_TRUE((d_x.array() == 3.0f).all());
}

}  // namespace
}  // namespace mla_test
