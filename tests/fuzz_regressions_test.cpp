// SPDX-License-Identifier: MIT
// Regression tests for what fuzzing apex found (tests/fuzz/). Each test is the smallest input
// that showed one finding, named F<n> as in tests/fuzz/fuzz_common.hpp, and asserts the
// documented contract: a call returns a sane result or throws std::invalid_argument ("[op] ..."),
// never undefined behaviour, a different exception, an allocation for a request it then rejects,
// or a result that depends on values the mask hides.
//
// Some findings were undefined behaviour that a plain release build does not observe (signed
// overflow that happens to wrap, pointer arithmetic on null); the sanitizer builds (the debug
// preset, and clang's in tests/fuzz/run.sh --regressions) are what see those.
#include <apex/apex.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "test_util.hpp"

namespace fuzz_regressions_test {
namespace {

using apex::AttentionMask;
using apex::BoolMatrix;
using apex::HeadsView;
using apex::Index;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;

constexpr Index kIndexMax = std::numeric_limits<Index>::max();
constexpr Index kHuge = Index{1} << 62;  // 4 × 2^62 wraps to 0 in 64 bits

/// Every apex message starts with the operation in brackets.
const std::string kAnyOp = "[";

/// The value, hidden from the optimiser: with a visible constant GCC proves the overflow of a
/// finding at compile time (and -Werror then stops the build) instead of the test showing it.
Index opaque(Index value) {
  volatile Index hidden = value;
  return hidden;
}

// ---- F1: the size and count helpers multiply without checking --------------------------------

TEST(FuzzRegressions, F1_CountHelpersRejectOverflow) {
  // Each of these products overflows std::int64_t (undefined behaviour); the helpers must
  // reject the arguments instead of returning a wrapped count.
  expect_invalid([] { (void)apex::tied_parameters_saved(kIndexMax - 1, 3); }, kAnyOp);
  expect_invalid([] { (void)apex::mha_parameter_count(kHuge, 4, 1); }, kAnyOp);
  expect_invalid([] { (void)apex::gqa_parameter_count(kHuge, 2, 1, 1); }, kAnyOp);
  expect_invalid([] { (void)apex::kv_cache_values_per_token(kHuge, 2); }, kAnyOp);
  expect_invalid([] { (void)apex::kv_cache_bytes(kHuge, 4, 1, 1, 2); }, kAnyOp);
  expect_invalid([] { (void)apex::sliding_window_cache_bytes(kHuge, 8, 4, 1, 1, 2); }, kAnyOp);
  expect_invalid([] { (void)apex::latent_cache_bytes(1, 1, kIndexMax, 1, 1, 1); }, kAnyOp);
}

TEST(FuzzRegressions, F1_CacheComparisonRejectsOverflow) {
  apex::CacheComparisonParams p;
  p.num_q_heads = kHuge;
  p.num_kv_heads = 1;
  p.head_dim = 4;
  p.latent_dim = 1;
  p.rope_dim = 1;
  p.rope_heads = 1;
  p.window = 1;
  p.context = 1;
  expect_invalid([&] { (void)apex::cache_comparison(p); }, "[cache_comparison]");
}

TEST(FuzzRegressions, F1_MlaParameterCountRejectsOverflow) {
  // Every width is valid, but W_DKV alone has d·d_kv = 2^32·2^34 entries.
  apex::MlaConfig c;
  c.d_model = opaque(Index{1} << 32);
  c.d_q = 1;
  c.d_kv = opaque(Index{1} << 34);
  c.num_q_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 1;
  c.rope_dim = 2;
  expect_invalid([&] { (void)apex::mla_parameter_count(c); }, "[mla]");
}

// ---- F2: layer construction multiplies heads by widths without checking ----------------------

TEST(FuzzRegressions, F2_GqaRejectsOverflowingWidths) {
  // H_q·d_h = 2^62·4 wraps to 0, and the layer is then built with zero-width projections.
  apex::GqaConfig c;
  c.d_model = 1;
  c.num_q_heads = kHuge;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  expect_invalid([&] { (void)apex::GroupedQueryAttention<float>::random(c, 1); }, "[gqa]");
}

TEST(FuzzRegressions, F2_MlaRejectsOverflowingWidths) {
  apex::MlaConfig c;
  c.d_model = 1;
  c.d_q = 1;
  c.d_kv = 1;
  c.num_q_heads = kHuge;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.rope_dim = 2;
  expect_invalid([&] { (void)apex::mla_parameter_table(c); }, "[mla]");
  expect_invalid([&] { (void)apex::mla_parameter_count(c); }, "[mla]");
}

// ---- F3: HeadsTensor checks nothing -----------------------------------------------------------

TEST(FuzzRegressions, F3_HeadsTensorRejectsNegativeOrOverflowingShapes) {
  expect_invalid([] { apex::HeadsTensor<float> t({-1, 1, 1, 1}); }, kAnyOp);
  // 2^62·4 wraps to 0: a tensor that claims [2^62, 4, 1, 1] over no storage.
  expect_invalid([] { apex::HeadsTensor<float> t({kHuge, 4, 1, 1}); }, kAnyOp);
}

// ---- F4: the caches multiply their dimensions without checking --------------------------------

TEST(FuzzRegressions, F4_CachesRejectOverflowingSizes) {
  expect_invalid([] { apex::KvCache<float> c({1, kHuge, 4, 1}); }, "[kv_cache]");
  expect_invalid(
      [] {
        apex::SlidingWindowCache<float> c({1, kHuge, 4, 1});
      },
      "[sliding_window_cache]");
  // d_kv + H_kr·d_r = 1 + 2^62·4 wraps to 1.
  expect_invalid([] { apex::LatentCache<float> c({1, 1, kHuge, 4, 1}); }, "[latent_cache]");
}

TEST(FuzzRegressions, F4_ReserveRejectsOverflowingCapacity) {
  // B·H·C·d = 4·2^62 wraps to 0: the cache would claim a capacity of 2^62 tokens over empty
  // storage, and the next append would write out of bounds.
  apex::KvCache<float> cache({1, 4, 1, 1});
  expect_invalid([&] { cache.reserve(kHuge); }, "[kv_cache]");
  EXPECT_EQ(cache.capacity(), 1);
  apex::LatentCache<float> latent({1, 2, 1, 2, 1});  // row width 4
  expect_invalid([&] { latent.reserve(kHuge); }, "[latent_cache]");
  EXPECT_EQ(latent.capacity(), 1);
}

// ---- F5: splitting or merging empty heads -----------------------------------------------------

TEST(FuzzRegressions, F5_EmptyHeadsSplitAndMergeWithoutNullArithmetic) {
  // x has no rows, so its data pointer is null; split_heads offsets it for every (b, h).
  // Undefined behaviour that UndefinedBehaviorSanitizer reports (debug preset). Any batch also
  // divides 0 rows, and the copy then loops B·H times over nothing.
  const RowMatrix<double> x(0, 4);
  const apex::HeadsTensor<double> heads = apex::split_heads(x, 1, 2);
  EXPECT_EQ(heads.seq(), 0);
  RowMatrix<double> back(0, 4);
  apex::merge_heads(heads.view(), back);
  EXPECT_EQ(back.rows(), 0);
}

// ---- F6: sizes whose element count overflows give std::bad_alloc ------------------------------

TEST(FuzzRegressions, F6_AbsurdDenseSizesAreInvalidArguments) {
  // S_q·S_k = 2^64: Eigen notices the overflow and throws std::bad_alloc.
  expect_invalid(
      [] { (void)apex::build_mask(apex::causal_mask(), Index{1} << 32, Index{1} << 32); },
      "[build_mask]");
  expect_invalid([] { (void)apex::build_mask(5, Index{1} << 32, apex::LayerMaskParams{}); },
                 "[build_mask]");
  Vector<double> theta(1);
  theta << 1.0;
  expect_invalid(
      [&] {
        (void)apex::RopeTable<float>::from_frequencies(theta, kHuge, 2,
                                                       apex::RopePairing::kInterleaved);
      },
      "[rope]");
}

// ---- F7: allocating before every check has passed ---------------------------------------------

TEST(FuzzRegressions, F7_RopeTableChecksPositionsBeforeAllocating) {
  // max_positions = 0 is invalid, but the θ vector of rotary_dim / 2 = 2^61 doubles is
  // allocated first (std::bad_alloc here; a smaller rotary_dim silently allocates gigabytes).
  apex::RopeParams params;
  params.rotary_dim = kHuge;
  expect_invalid([&] { apex::RopeTable<float> t(0, kHuge, params); }, "max_positions");
  apex::YarnParams yarn;
  yarn.scale = 8.0;
  yarn.original_context = 4096;
  expect_invalid(
      [&] { (void)apex::yarn_table<float>(0, kHuge, 0, apex::RopePairing::kInterleaved, yarn); },
      "max_positions");
}

// ---- F8: MLA on zero tokens -------------------------------------------------------------------

TEST(FuzzRegressions, F8_MlaForwardOnNoTokens) {
  // The projections of an empty x have null data, and MLA cuts them into column blocks:
  // pointer arithmetic on null (UndefinedBehaviorSanitizer, debug preset).
  apex::MlaConfig c;
  c.d_model = 4;
  c.d_q = 2;
  c.d_kv = 2;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.rope_dim = 2;
  const auto layer = apex::MultiHeadLatentAttention<double>::random(c, 7);
  const apex::RopeTable<double> table(8, 2);
  apex::AttentionLayerParams<double> params;
  params.rope = &table;
  const RowMatrix<double> x(0, 4);
  const RowMatrix<double> out = layer.forward(x, 1, {}, params);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), 4);
}

// ---- F9: accepted RoPE frequencies that give non-finite tables --------------------------------

template <class Scalar>
void expect_finite_or_rejected(const Vector<double>& theta, Index positions, double magnitude) {
  try {
    const auto table = apex::RopeTable<Scalar>::from_frequencies(
        theta, positions, 2 * theta.size(), apex::RopePairing::kInterleaved, magnitude);
    EXPECT_TRUE(table.cos().allFinite() && table.sin().allFinite())
        << "theta " << theta.transpose() << ", magnitude " << magnitude;
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[rope]", 0), 0u) << e.what();
  }
}

TEST(FuzzRegressions, F9_FrequencyTablesAreFiniteOrRejected) {
  // θ = 1e308 is finite, but m·θ overflows to +inf at m = 2, and cos(inf) is NaN.
  Vector<double> theta(1);
  theta << 1e308;
  expect_finite_or_rejected<double>(theta, 3, 1.0);
  // A magnitude beyond the float range makes every float entry infinite.
  theta << 0.5;
  expect_finite_or_rejected<float>(theta, 2, 1e39);
}

// ---- F10: positions near the top of the Index range -------------------------------------------

TEST(FuzzRegressions, F10_OffsetsThatOverflowPositionsAreRejected) {
  // key_offset + j overflows (undefined behaviour); the rule must reject such offsets.
  apex::PositionMask rule = apex::causal_mask();
  rule.key_offset = opaque(kIndexMax - 1);
  expect_invalid([&] { (void)apex::build_mask(rule, 1, 4); }, "[build_mask]");
  const RowMatrix<float> q = RowMatrix<float>::Ones(1, 2);
  const RowMatrix<float> kv = RowMatrix<float>::Ones(4, 2);
  AttentionMask<float> mask;
  mask.positions = rule;
  expect_invalid([&] { (void)apex::sdpa(q, kv, kv, mask); }, "[sdpa]");
  apex::PositionMask late_queries = apex::causal_mask();
  late_queries.query_offset = opaque(kIndexMax);
  mask.positions = late_queries;
  expect_invalid([&] { (void)apex::sdpa(q, kv, kv, mask); }, "[sdpa]");
}

TEST(FuzzRegressions, F10_LayerPositionOffsetNearTheLimit) {
  // position_offset + S overflows inside the layer's check (undefined behaviour, reported by
  // UndefinedBehaviorSanitizer in the debug preset); the call must be rejected.
  const auto layer = apex::GroupedQueryAttention<float>::random({4, 2, 1, 2}, 3);
  const apex::RopeTable<float> table(8, 2);
  apex::AttentionLayerParams<float> params;
  params.rope = &table;
  params.position_offset = opaque(kIndexMax);
  const RowMatrix<float> x = RowMatrix<float>::Ones(3, 4);
  expect_invalid([&] { (void)layer.forward(x, 1, {}, params); }, "[gqa]");
}

// ---- F11: YaRN factors computed from accepted parameters ---------------------------------------

TEST(FuzzRegressions, F11_YarnFactorIsPositiveOrRejected) {
  // get(s, m) = 0.1·m·ln(s) + 1 is negative for s = 32, m = -20: the "attention factor" is then
  // -5.93 (and 0 or ±inf for other finite m), which no caller can use.
  apex::YarnParams p;
  p.scale = 32.0;
  p.original_context = 4096;
  for (const double m : {-20.0, -1.0 / (0.1 * std::log(32.0))}) {
    p.mscale = m;
    try {
      const double factor = apex::yarn_attention_factor(p);
      EXPECT_TRUE(std::isfinite(factor) && factor > 0.0) << "mscale " << m << ": " << factor;
      const double multiplier = apex::yarn_softmax_scale_multiplier(p);
      EXPECT_TRUE(std::isfinite(multiplier) && multiplier > 0.0) << "mscale " << m;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("[yarn]", 0), 0u) << e.what();
    }
  }
}

// ---- F12: views with negative extents ----------------------------------------------------------

TEST(FuzzRegressions, F12_NegativeExtentsAreRejected) {
  float data[4] = {1, 2, 3, 4};
  const HeadsView<const float> q(data, {-1, 1, 1, 2}, {2, 2, 2});
  const HeadsView<const float> kv(data, {-1, 1, 2, 2}, {4, 4, 2});
  float out_data[2] = {0, 0};
  const HeadsView<float> out(out_data, {-1, 1, 1, 2}, {2, 2, 2});
  expect_invalid([&] { apex::sdpa<float>(q, kv, kv, {}, {}, out); }, "[sdpa]");

  // A chunk of -1 tokens passes append's checks and leaves the cache with size -1.
  apex::KvCache<float> cache({1, 1, 2, 4});
  const HeadsView<const float> chunk(data, {1, 1, -1, 2}, {0, 0, 2});
  expect_invalid([&] { cache.append(chunk, chunk, 0); }, "[kv_cache]");
  EXPECT_EQ(cache.size(), 0);
}

// ---- F13: YaRN ranges for extreme betas and bases ----------------------------------------------

TEST(FuzzRegressions, F13_YarnRangeIsFiniteAndNonEmptyOrRejected) {
  apex::YarnParams tiny_beta;
  tiny_beta.scale = 8.0;
  tiny_beta.original_context = 4096;
  tiny_beta.beta_slow = std::numeric_limits<double>::denorm_min();  // L / (2π·β) = inf
  apex::YarnParams base_near_one;
  base_near_one.scale = 8.0;
  base_near_one.original_context = Index{1} << 31;
  base_near_one.base = 1.0 + 0x1p-40;  // the range sits near 1e13, where lo + 0.001 == lo
  for (const apex::YarnParams& p : {tiny_beta, base_near_one}) {
    try {
      const apex::YarnCorrectionRange range = apex::yarn_correction_range(4, p);
      EXPECT_TRUE(std::isfinite(range.low) && std::isfinite(range.high) && range.low < range.high)
          << "[" << range.low << ", " << range.high << "]";
      EXPECT_TRUE(apex::yarn_frequencies(4, p).allFinite());
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("[yarn]", 0), 0u) << e.what();
    }
  }
}

// ---- F14: values of forbidden keys reach the output of the tiled kernel ------------------------

template <class Scalar>
class FuzzRegressionsTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FuzzRegressionsTyped, Scalars, apex::testing::ScalarName);

TYPED_TEST(FuzzRegressionsTyped, F14_ForbiddenKeysDoNotReachTheOutput) {
  // The tiled kernel weights a forbidden key by exp(-inf) = 0 instead of skipping it, and
  // 0·NaN = NaN: a NaN in the value (or key) of a key the query may not see poisons the row.
  // The reference skips forbidden keys, as sdpa.hpp documents. Here key 1 is hidden from the
  // only query, by a dense mask and by causality.
  using Scalar = TypeParam;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  const RowMatrix<Scalar> q = RowMatrix<Scalar>::Ones(1, 4);
  RowMatrix<Scalar> k = RowMatrix<Scalar>::Ones(2, 4);
  RowMatrix<Scalar> v = RowMatrix<Scalar>::Ones(2, 4);
  v(1, 0) = nan;
  k(1, 2) = nan;
  BoolMatrix allowed(1, 2);
  allowed << true, false;
  AttentionMask<Scalar> dense;
  dense.allowed = apex::as_heads_view(allowed);
  AttentionMask<Scalar> causal;
  causal.positions = apex::causal_mask();
  causal.positions.query_offset = 0;  // query at position 0, keys at 0 and 1
  for (const AttentionMask<Scalar>& mask : {dense, causal}) {
    const RowMatrix<Scalar> expected = apex::reference::sdpa(q, k, v, mask);
    ASSERT_TRUE(expected.allFinite());
    const RowMatrix<Scalar> got = apex::sdpa(q, k, v, mask);
    EXPECT_TRUE(got.allFinite()) << got;
    EXPECT_EQ(got, expected);
  }
}

TYPED_TEST(FuzzRegressionsTyped, F14_CausalPrefillIsolatesLaterTokens) {
  // The same on a prompt: a NaN produced at the last token must not reach the earlier ones,
  // which cannot see it.
  using Scalar = TypeParam;
  const Index s = 9;
  const RowMatrix<Scalar> q = apex::testing::random_matrix<Scalar>(s, 8, 1);
  RowMatrix<Scalar> k = apex::testing::random_matrix<Scalar>(s, 8, 2);
  RowMatrix<Scalar> v = apex::testing::random_matrix<Scalar>(s, 8, 3);
  k(s - 1, 0) = std::numeric_limits<Scalar>::infinity();
  v(s - 1, 3) = std::numeric_limits<Scalar>::quiet_NaN();
  AttentionMask<Scalar> mask;
  mask.positions = apex::causal_mask();
  const RowMatrix<Scalar> got = apex::sdpa(q, k, v, mask);
  EXPECT_TRUE(got.topRows(s - 1).allFinite()) << got;
}

}  // namespace
}  // namespace fuzz_regressions_test
