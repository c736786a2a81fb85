// SPDX-License-Identifier: MIT
// Inputs an adversarial user tries, one suite per class of defect that such a user found in an
// earlier apex (the numbering follows that report): merges that lost precision at large logits,
// parameters that float could not represent, scores that overflow float, keys of zero weight,
// moved-from and default objects, integer overflow, failed calls with side effects, messages that
// misstated values, results that depended on the thread count, and aliasing the documentation
// did not state. Each test checks the documented behaviour on every path that can show it:
//   prefill      sdpa with S_q spanning several query blocks
//   decode       sdpa of a few queries against many keys (split keys, merged chunks), with the
//                default blocks and with small ones (detail::flash_sdpa)
//   window       sdpa_with_window_cache over a ring that has wrapped (two segments + the chunk)
//   merge        merge_attention of partial results over disjoint keys
// Expected values come from apex::reference::sdpa (double) or, where the answer is known in
// closed form, from that form.
#include <apex/apex.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "test_util.hpp"
#include "tolerances.hpp"

namespace adversarial_test {
namespace {

using apex::AttentionMask;
using apex::HeadsShape;
using apex::HeadsTensor;
using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::RowMatrix;
using apex::RowRef;
using apex::SdpaParams;
using apex::Vector;
using apex::testing::expect_invalid;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Normwise tolerance of a fast result against the double reference: the attention entry of the
// table (tolerances.hpp). Closed-form expectations below use it too.
template <class Scalar>
constexpr double kTol = apex::testing::Tolerances<Scalar>::kAttention;

template <class Scalar>
RowMatrix<Scalar> flat(const HeadsTensor<Scalar>& t) {
  return Eigen::Map<const RowMatrix<Scalar>>(t.data(), t.batch() * t.heads() * t.seq(), t.dim());
}

/// max |a − b| over all elements, compared in double.
template <class Scalar>
double max_diff(const HeadsTensor<Scalar>& a, const HeadsTensor<Scalar>& b) {
  return (flat(a).template cast<double>() - flat(b).template cast<double>()).cwiseAbs().maxCoeff();
}

/// One attention problem of [B, H, S, D] tensors, and the ways of running it.
template <class Scalar>
struct Case {
  Case(HeadsShape q_shape, Index kv_heads, Index s_k, Index d_v)
      : q(q_shape),
        k({q_shape.batch, kv_heads, s_k, q_shape.dim}),
        v({q_shape.batch, kv_heads, s_k, d_v}) {}

  HeadsShape out_shape() const { return {q.batch(), q.heads(), q.seq(), v.dim()}; }
  HeadsShape row_shape() const { return {q.batch(), q.heads(), q.seq(), 1}; }

  /// apex::sdpa, or with `blocking` the kernel with those block sizes.
  void fast(HeadsTensor<Scalar>& out, HeadsTensor<Scalar>& lse,
            const apex::detail::FlashBlocking& blocking = {}) const {
    out = HeadsTensor<Scalar>(out_shape());
    lse = HeadsTensor<Scalar>(row_shape());
    apex::detail::flash_sdpa<Scalar>(q.view(), k.view(), v.view(), mask, params, out.view(),
                                     lse.view(), {}, blocking);
  }
  void reference(HeadsTensor<Scalar>& out, HeadsTensor<Scalar>& lse) const {
    out = HeadsTensor<Scalar>(out_shape());
    lse = HeadsTensor<Scalar>(row_shape());
    apex::reference::sdpa<Scalar>(q.view(), k.view(), v.view(), mask, params, out.view(),
                                  lse.view());
  }

  HeadsTensor<Scalar> q, k, v;
  AttentionMask<Scalar> mask;
  SdpaParams params;
};

/// Small blocks that force split-key decoding of a few hundred keys into several chunks.
apex::detail::FlashBlocking small_chunks() {
  apex::detail::FlashBlocking b;
  b.decode_chunk = 64;
  b.stream_key_block = 32;
  b.key_block = 16;
  return b;
}

/// Expects the fast kernel, with the default and with small blocks, to equal the reference
/// (normwise for out, relative to max(1, |lse|) for lse).
template <class Scalar>
void expect_fast_equals_reference(const Case<Scalar>& c) {
  HeadsTensor<Scalar> ref, ref_lse;
  c.reference(ref, ref_lse);
  const double scale = std::max(1.0, flat(ref).template cast<double>().cwiseAbs().maxCoeff());
  const double lse_scale =
      std::max(1.0, flat(ref_lse).template cast<double>().cwiseAbs().maxCoeff());
  for (const auto& blocking : {apex::detail::FlashBlocking{}, small_chunks()}) {
    HeadsTensor<Scalar> out, lse;
    c.fast(out, lse, blocking);
    EXPECT_LE(max_diff(out, ref), kTol<Scalar> * scale) << "chunk " << blocking.decode_chunk;
    EXPECT_LE(max_diff(lse, ref_lse), kTol<Scalar> * lse_scale)
        << "chunk " << blocking.decode_chunk;
  }
}

template <class Scalar>
class Adversarial : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Adversarial, Scalars, apex::testing::ScalarName);

// ---- C1: merges exact at any logit magnitude --------------------------------------------------

// Keys whose scores are exactly `high` or `low` (q = [1, 0], k_j = [score_j, 0], scale 1), every
// value random: the decode path merges chunks whose maxima are equal or differ by 0.5.
template <class Scalar>
Case<Scalar> two_level_scores(Index s_q, Index s_k, double high, double low, std::uint32_t seed) {
  Case<Scalar> c({1, 2, s_q, 2}, 1, s_k, 5);
  for (Index h = 0; h < 2; ++h) c.q.head(0, h).col(0).setOnes();
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(0.3);
  for (Index j = 0; j < s_k; ++j) {
    c.k.head(0, 0)(j, 0) = static_cast<Scalar>(pick(rng) ? high : low);
  }
  c.v = apex::testing::random_heads<Scalar>(1, 1, s_k, 5, seed + 1);
  c.params.scale = 1.0;
  return c;
}

TEST(C1ExactMerges, FloatDecodeAtLogitsNearTenThousand) {
  // 812 keys with logits 10000 and 10000.5, both exact in float: the lse of a chunk carries only
  // ~1e-3 of absolute precision there, its (max, sum) everything.
  for (const Index s_k : {Index{812}, Index{3000}}) {
    const Case<float> c = two_level_scores<float>(1, s_k, 10000.5, 10000.0, 7);
    expect_fast_equals_reference(c);
  }
}

TEST(C1ExactMerges, DoubleAtLogitsNearTenToThirty) {
  // Every score is 1e30 (scale 1e30, q = k = 1): attention is the mean of the values, whatever
  // chunks the keys are cut into. Merging through lse, every chunk would weigh the same.
  const Index s_k = 1300;
  Case<double> c({1, 2, 1, 1}, 1, s_k, 3);
  c.q.head(0, 0).setOnes();
  c.q.head(0, 1).setOnes();
  c.k.head(0, 0).setOnes();
  c.v = apex::testing::random_heads<double>(1, 1, s_k, 3, 5);
  c.params.scale = 1e30;
  const Eigen::RowVectorXd mean = c.v.head(0, 0).colwise().mean();
  for (const auto& blocking : {apex::detail::FlashBlocking{}, small_chunks()}) {
    HeadsTensor<double> out, lse;
    c.fast(out, lse, blocking);
    EXPECT_LE((out.head(0, 0).row(0) - mean).cwiseAbs().maxCoeff(), kTol<double>);
    EXPECT_LE((out.head(0, 1).row(0) - mean).cwiseAbs().maxCoeff(), kTol<double>);
  }
  expect_fast_equals_reference(c);
}

TEST(C1ExactMerges, WindowCacheAtLargeLogits) {
  // A ring that has wrapped holds two runs; with the chunk, three segments of one pass.
  const Index window = 300, chunk = 3;
  apex::SlidingWindowCache<double> cache({1, 1, 1, window});
  const HeadsTensor<double> past_k = apex::testing::random_heads<double>(1, 1, 700, 1, 1, 0.5, 1.0);
  const HeadsTensor<double> past_v = apex::testing::random_heads<double>(1, 1, 700, 1, 2);
  cache.append(past_k.view(), past_v.view(), 0);
  HeadsTensor<double> q({1, 4, chunk, 1});
  for (Index h = 0; h < 4; ++h) q.head(0, h).setOnes();
  const HeadsTensor<double> k = apex::testing::random_heads<double>(1, 1, chunk, 1, 3, 0.5, 1.0);
  const HeadsTensor<double> v = apex::testing::random_heads<double>(1, 1, chunk, 1, 4);
  SdpaParams params;
  params.scale = 1e30;  // scores 1e30·k_j: different keys' scores differ by up to 5e29
  HeadsTensor<double> out({1, 4, chunk, 1});
  apex::sdpa_with_window_cache<double>(
      q.view(), k.view(), v.view(), apex::sliding_window_mask(window), params, cache, out.view());
  // The same attention on the contiguous keys [400, 703) (what the ring holds, then the chunk)
  // at their positions.
  const Index first = 700 - window;
  HeadsTensor<double> all_k({1, 1, window + chunk, 1}), all_v({1, 1, window + chunk, 1});
  for (Index j = 0; j < window + chunk; ++j) {
    const Index pos = first + j;
    all_k.head(0, 0).row(j) = pos < 700 ? past_k.head(0, 0).row(pos) : k.head(0, 0).row(pos - 700);
    all_v.head(0, 0).row(j) = pos < 700 ? past_v.head(0, 0).row(pos) : v.head(0, 0).row(pos - 700);
  }
  AttentionMask<double> mask;
  mask.positions = apex::sliding_window_mask(window);
  mask.positions.query_offset = 700;
  mask.positions.key_offset = first;
  HeadsTensor<double> ref({1, 4, chunk, 1});
  apex::reference::sdpa<double>(q.view(), all_k.view(), all_v.view(), mask, params, ref.view());
  EXPECT_LE(max_diff(out, ref), kTol<double>);
}

TYPED_TEST(Adversarial, C1_MergeThroughStatisticsIsExact) {
  // Parts of 1, 100 and 700 keys, all with the same large score: only (max, sum) tell them apart.
  using Scalar = TypeParam;
  const double logit = std::is_same_v<Scalar, float> ? 1e4 : 1e30;
  const Index sizes[] = {1, 100, 700};
  const Index total = 801;
  Case<Scalar> c({1, 1, 2, 1}, 1, total, 3);
  c.q.head(0, 0).setOnes();
  c.k.head(0, 0).setOnes();
  c.v = apex::testing::random_heads<Scalar>(1, 1, total, 3, 9);
  c.params.scale = logit;
  RowMatrix<Scalar> parts_out(3 * 2, 3), parts_max(3, 2), parts_sum(3, 2), parts_lse(3, 2);
  Index begin = 0;
  for (Index part = 0; part < 3; ++part) {
    const Index n = sizes[part];
    HeadsTensor<Scalar> out({1, 1, 2, 3}), m({1, 1, 2, 1}), l({1, 1, 2, 1}), lse({1, 1, 2, 1});
    apex::sdpa<Scalar>(c.q.view(), c.k.view().middle_rows(begin, n),
                       c.v.view().middle_rows(begin, n), {}, c.params, out.view(), lse.view(),
                       {m.view(), l.view()});
    parts_out.middleRows(2 * part, 2) = out.head(0, 0);
    parts_max.row(part) = m.head(0, 0).transpose();
    parts_sum.row(part) = l.head(0, 0).transpose();
    parts_lse.row(part) = lse.head(0, 0).transpose();
    begin += n;
  }
  RowMatrix<Scalar> merged(2, 3);
  Vector<Scalar> max(2), sum(2);
  apex::merge_attention_stats(parts_out, parts_max, parts_sum, merged, max, sum);
  const Eigen::RowVectorXd mean = c.v.head(0, 0).template cast<double>().colwise().mean();
  for (Index i = 0; i < 2; ++i) {
    EXPECT_LE((merged.row(i).template cast<double>() - mean).cwiseAbs().maxCoeff(), kTol<Scalar>);
    EXPECT_EQ(static_cast<double>(max(i)), logit);
    EXPECT_NEAR(static_cast<double>(sum(i)), static_cast<double>(total), kTol<Scalar> * total);
  }
  if (std::is_same_v<Scalar, double>) {
    // The lse of each part rounds to 1e30 whatever its size: the lse form cannot tell them apart
    // (documented), and weighs the parts equally.
    RowMatrix<Scalar> by_lse(2, 3);
    Vector<Scalar> lse(2);
    apex::merge_attention(parts_out, parts_lse, by_lse, lse);
    EXPECT_GT((by_lse.row(0).template cast<double>() - mean).cwiseAbs().maxCoeff(), 1e-3);
  }
}

// ---- C2: parameters the compute type cannot represent ------------------------------------------

TEST(C2ParameterRange, SdpaScaleBeyondFloatIsComputedInDouble) {
  // scale 1e60 with q·k ~ 1e-60: scores of order one. In float the scale itself is inf.
  Case<float> c({1, 2, 5, 4}, 1, 40, 3);
  c.q = apex::testing::random_heads<float>(1, 2, 5, 4, 1, 1e-30, 2e-30);
  c.k = apex::testing::random_heads<float>(1, 1, 40, 4, 2, 1e-30, 2e-30);
  c.v = apex::testing::random_heads<float>(1, 1, 40, 3, 3);
  c.params.scale = 1e60;
  expect_fast_equals_reference(c);
  HeadsTensor<float> out, lse;
  c.fast(out, lse);
  EXPECT_TRUE(flat(out).allFinite());
}

TEST(C2ParameterRange, SoftcapBelowFloatStillCaps) {
  // softcap 1e-50 rounds to 0 in float, which would mean "off"; the reference caps every score to
  // ±1e-50, i.e. uniform attention.
  Case<float> c({1, 1, 3, 4}, 1, 30, 2);
  c.q = apex::testing::random_heads<float>(1, 1, 3, 4, 4, -3.0, 3.0);
  c.k = apex::testing::random_heads<float>(1, 1, 30, 4, 5, -3.0, 3.0);
  c.v = apex::testing::random_heads<float>(1, 1, 30, 2, 6);
  c.params.softcap = 1e-50;
  expect_fast_equals_reference(c);
  HeadsTensor<float> out, lse;
  c.fast(out, lse);
  const Eigen::RowVectorXd mean = c.v.head(0, 0).cast<double>().colwise().mean();
  EXPECT_LE((out.head(0, 0).row(0).cast<double>() - mean).cwiseAbs().maxCoeff(), kTol<float>);
}

TEST(C2ParameterRange, SoftcapBeyondFloatIsComputedInDouble) {
  Case<float> c({1, 1, 3, 4}, 1, 30, 2);
  c.q = apex::testing::random_heads<float>(1, 1, 3, 4, 7);
  c.k = apex::testing::random_heads<float>(1, 1, 30, 4, 8);
  c.v = apex::testing::random_heads<float>(1, 1, 30, 2, 9);
  c.params.softcap = 1e300;
  expect_fast_equals_reference(c);
}

TEST(C2ParameterRange, EmbeddingScaleBeyondFloatIsAppliedInDouble) {
  // 1e40 (inf in float) times entries near 1e-10 is ~1e30, well inside float.
  RowMatrix<float> table(2, 3);
  table << 1e-10f, -2e-10f, 3e-10f, 4e-10f, 5e-10f, -6e-10f;
  apex::EmbeddingParams params;
  params.scale = 1e40;
  const RowMatrix<float> out = apex::embed(table, std::vector<std::int64_t>{1, 0}, params);
  ASSERT_TRUE(out.allFinite());
  for (Index j = 0; j < 3; ++j) {
    EXPECT_FLOAT_EQ(out(0, j), static_cast<float>(static_cast<double>(table(1, j)) * 1e40));
    EXPECT_FLOAT_EQ(out(1, j), static_cast<float>(static_cast<double>(table(0, j)) * 1e40));
  }
}

// ---- C3: finite inputs whose scores overflow float ----------------------------------------------

TEST(C3ScoreOverflow, FloatScoresBeyondRangeGiveTheDoubleAnswer) {
  // q = k = 1e20 (scale 1): q·k = 4e40 overflows float; the reference computes in double. The
  // rule: a float call then computes in double and returns that answer, rounded.
  for (const Index s_q : {Index{1}, Index{3}, Index{300}}) {
    Case<float> c({1, 2, s_q, 4}, 1, 700, 3);
    c.q = apex::testing::random_heads<float>(1, 2, s_q, 4, 11, 0.5e20, 1e20);
    c.k = apex::testing::random_heads<float>(1, 1, 700, 4, 12, -1e20, 1e20);
    c.v = apex::testing::random_heads<float>(1, 1, 700, 3, 13);
    c.params.scale = 1.0;
    c.mask.positions = apex::causal_mask();
    HeadsTensor<float> ref, ref_lse, out, lse;
    c.reference(ref, ref_lse);
    for (const auto& blocking : {apex::detail::FlashBlocking{}, small_chunks()}) {
      c.fast(out, lse, blocking);
      ASSERT_TRUE(flat(out).allFinite()) << "S_q = " << s_q;
      EXPECT_LE(max_diff(out, ref), kTol<float>) << "S_q = " << s_q;
      // lse ~ ±1e40 is beyond float: both round it to ±inf; a finite one agrees to rounding.
      for (Index i = 0; i < ref_lse.batch() * ref_lse.heads() * ref_lse.seq(); ++i) {
        const double r = ref_lse.data()[i], f = lse.data()[i];
        if (std::isinf(r)) {
          EXPECT_EQ(f, r);
        } else {
          EXPECT_NEAR(f, r, kTol<float> * std::abs(r));
        }
      }
    }
  }
}

TEST(C3ScoreOverflow, WindowCacheScoresBeyondRange) {
  apex::SlidingWindowCache<float> cache({1, 1, 2, 8});
  const HeadsTensor<float> past_k = apex::testing::random_heads<float>(1, 1, 11, 2, 1, -2e19, 2e19);
  const HeadsTensor<float> past_v = apex::testing::random_heads<float>(1, 1, 11, 2, 2);
  cache.append(past_k.view(), past_v.view(), 0);
  const HeadsTensor<float> q = apex::testing::random_heads<float>(1, 2, 2, 2, 3, 1e20, 2e20);
  const HeadsTensor<float> k = apex::testing::random_heads<float>(1, 1, 2, 2, 4, -2e19, 2e19);
  const HeadsTensor<float> v = apex::testing::random_heads<float>(1, 1, 2, 2, 5);
  HeadsTensor<float> out({1, 2, 2, 2});
  apex::sdpa_with_window_cache<float>(q.view(), k.view(), v.view(), apex::sliding_window_mask(8),
                                      {}, cache, out.view());
  EXPECT_TRUE(flat(out).allFinite());
}

// ---- C4: one rule for keys whose weight is exactly zero -----------------------------------------

// Key 5 has a NaN value; `how` decides whether it takes part in the rows.
enum class Hidden { kInfiniteKey, kMasked, kNegInfBias, kUnderflow };

template <class Scalar>
Case<Scalar> nan_value_case(Index s_q, Index s_k, Hidden how) {
  Case<Scalar> c({1, 2, s_q, 3}, 1, s_k, 4);
  c.q = apex::testing::random_heads<Scalar>(1, 2, s_q, 3, 21, 0.5, 1.0);  // positive
  c.k = apex::testing::random_heads<Scalar>(1, 1, s_k, 3, 22);
  c.v = apex::testing::random_heads<Scalar>(1, 1, s_k, 4, 23);
  c.v.head(0, 0)(5, 1) = std::numeric_limits<Scalar>::quiet_NaN();
  switch (how) {
    case Hidden::kInfiniteKey:  // q > 0 and k_5 = -inf: score -inf, weight exactly 0
      c.k.head(0, 0).row(5).setConstant(-std::numeric_limits<Scalar>::infinity());
      break;
    case Hidden::kMasked:
      break;  // the caller masks it
    case Hidden::kNegInfBias:
      break;                  // the caller biases it
    case Hidden::kUnderflow:  // allowed, score far below the others: its weight underflows to 0
      c.k.head(0, 0).row(5).setConstant(static_cast<Scalar>(-1e4));
      break;
  }
  return c;
}

/// Whether key 5's NaN reached output column 1 of every row (expected), or of none.
template <class Scalar>
void expect_nan_column(const HeadsTensor<Scalar>& out, bool reached, const char* path) {
  for (Index h = 0; h < out.heads(); ++h) {
    for (Index i = 0; i < out.seq(); ++i) {
      const auto row = out.head(0, h).row(i);
      EXPECT_EQ(std::isnan(static_cast<double>(row(1))), reached)
          << path << " h " << h << " i " << i;
      EXPECT_TRUE(std::isfinite(static_cast<double>(row(0)))) << path;
    }
  }
}

TYPED_TEST(Adversarial, C4_ZeroWeightKeysOneRuleOnEveryPath) {
  using Scalar = TypeParam;
  std::vector<Scalar> bias_storage;
  for (const Hidden how :
       {Hidden::kInfiniteKey, Hidden::kMasked, Hidden::kNegInfBias, Hidden::kUnderflow}) {
    for (const Index s_q : {Index{1}, Index{2}, Index{200}}) {
      const Index s_k = 900;
      Case<Scalar> c = nan_value_case<Scalar>(s_q, s_k, how);
      apex::BoolMatrix allowed = apex::BoolMatrix::Constant(s_q, s_k, true);
      RowMatrix<Scalar> bias = RowMatrix<Scalar>::Zero(s_q, s_k);
      if (how == Hidden::kMasked) {
        allowed.col(5).setConstant(false);
        c.mask.allowed = apex::as_heads_view(allowed);
      }
      if (how == Hidden::kNegInfBias) {
        bias.col(5).setConstant(-std::numeric_limits<Scalar>::infinity());
        c.mask.bias = apex::as_heads_view(bias);
      }
      const bool reached = how == Hidden::kUnderflow;
      SCOPED_TRACE("S_q = " + std::to_string(s_q) + ", case " + std::to_string(int(how)));
      HeadsTensor<Scalar> out, lse;
      c.reference(out, lse);
      expect_nan_column(out, reached, "reference");
      c.fast(out, lse);
      expect_nan_column(out, reached, "sdpa");
      c.fast(out, lse, small_chunks());
      expect_nan_column(out, reached, "small blocks");
      if (how != Hidden::kMasked && how != Hidden::kNegInfBias) {
        c.mask.positions = apex::causal_mask();  // with a position rule too
        c.fast(out, lse, small_chunks());
        expect_nan_column(out, reached, "causal, small blocks");
      }
    }
  }
}

TEST(C4ZeroWeightKeys, WindowCacheFollowsTheRule) {
  // Position 3 in the ring holds a NaN value: outside the window of the chunk it must not be
  // read; inside it with an infinite key it takes no part; with an underflowing weight it does.
  for (const bool infinite_key : {true, false}) {
    apex::SlidingWindowCache<double> cache({1, 1, 2, 6});
    HeadsTensor<double> past_k = apex::testing::random_heads<double>(1, 1, 8, 2, 1);
    HeadsTensor<double> past_v = apex::testing::random_heads<double>(1, 1, 8, 2, 2);
    past_v.head(0, 0)(4, 1) = std::numeric_limits<double>::quiet_NaN();
    past_k.head(0, 0).row(4).setConstant(infinite_key ? -kInf : -1e5);
    cache.append(past_k.view(), past_v.view(), 0);
    const HeadsTensor<double> q = apex::testing::random_heads<double>(1, 1, 1, 2, 3, 0.5, 1.0);
    const HeadsTensor<double> k = apex::testing::random_heads<double>(1, 1, 1, 2, 4);
    const HeadsTensor<double> v = apex::testing::random_heads<double>(1, 1, 1, 2, 5);
    HeadsTensor<double> out({1, 1, 1, 2});
    apex::sdpa_with_window_cache<double>(q.view(), k.view(), v.view(), apex::sliding_window_mask(6),
                                         {}, cache, out.view());
    EXPECT_TRUE(std::isfinite(out.head(0, 0)(0, 0)));
    EXPECT_EQ(std::isnan(out.head(0, 0)(0, 1)), !infinite_key);
  }
}

/// A stack of three small layers (1 global), for the tests that need one.
apex::StackConfig tiny_stack() {
  apex::StackConfig c;
  c.vocab_size = 20;
  c.d_model = 8;
  c.num_layers = 3;
  c.window = 3;
  c.global_every = 2;
  c.local = apex::GqaConfig{8, 2, 1, 4};
  c.global.d_model = 8;
  c.global.d_q = 4;
  c.global.d_kv = 4;
  c.global.num_q_heads = 2;
  c.global.num_kv_heads = 1;
  c.global.head_dim = 4;
  c.global.rope_dim = 2;
  c.max_positions = 8;
  return c;
}

// ---- C5: moved-from and default-constructed objects
// ----------------------------------------------

TEST(C5MovedFrom, CachesAreEmptyAndRejectAppends) {
  const HeadsTensor<float> kv({1, 2, 3, 4});
  apex::KvCache<float> full({1, 2, 4, 8});
  full.append(kv.view(), kv.view(), 0);
  apex::KvCache<float> taken = std::move(full);
  EXPECT_EQ(taken.size(), 3);
  const apex::KvCache<float> fresh;
  for (const apex::KvCache<float>* empty :
       {static_cast<const apex::KvCache<float>*>(&full), &fresh}) {  // moved-from, default
    EXPECT_EQ(empty->batch(), 0);
    EXPECT_EQ(empty->capacity(), 0);
    EXPECT_EQ(empty->size(), 0);
    EXPECT_EQ(empty->bytes(), 0);
    EXPECT_EQ(empty->keys().seq(), 0);
  }
  expect_invalid([&] { full.append(kv.view(), kv.view(), 0); }, "[kv_cache] the cache is empty");
  expect_invalid([&] { full.reserve(10); }, "[kv_cache] the cache is empty");
  full = apex::KvCache<float>({1, 2, 4, 8});  // assignable again
  full.append(kv.view(), kv.view(), 0);
  EXPECT_EQ(full.size(), 3);

  apex::SlidingWindowCache<float> ring({1, 2, 4, 2});
  ring.append(kv.view(), kv.view(), 0);
  apex::SlidingWindowCache<float> ring2(std::move(ring));
  EXPECT_EQ(ring.window(), 0);
  EXPECT_EQ(ring.next_position(), 0);
  EXPECT_EQ(ring.segments()[0].keys.seq(), 0);
  expect_invalid([&] { ring.append(kv.view(), kv.view(), 0); },
                 "[sliding_window_cache] the cache is empty");
  expect_invalid([] { apex::SlidingWindowCache<float>().append({}, {}, 0); }, "the cache is empty");

  apex::LatentCache<float> latent({1, 4, 1, 2, 3});
  apex::LatentCache<float> latent2 = std::move(latent);
  EXPECT_EQ(latent.capacity(), 0);
  EXPECT_EQ(latent.row_width(), 0);
  expect_invalid([&] { latent.append(RowMatrix<float>::Zero(1, 6), 0); },
                 "[latent_cache] the cache is empty");
  EXPECT_EQ(latent2.capacity(), 3);
}

TEST(C5MovedFrom, HeadsTensorIsEmpty) {
  HeadsTensor<double> t({2, 3, 4, 5});
  HeadsTensor<double> u = std::move(t);
  EXPECT_EQ(t.batch(), 0);
  EXPECT_EQ(t.view().shape(), (HeadsShape{0, 0, 0, 0}));
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_EQ(u.seq(), 4);
  t = HeadsTensor<double>({1, 1, 1, 1});
  EXPECT_EQ(t.head(0, 0)(0, 0), 0.0);
}

TEST(C5MovedFrom, LayersRejectEveryUse) {
  const apex::GqaConfig gqa_config{16, 4, 2, 4};
  auto gqa = apex::GroupedQueryAttention<float>::random(gqa_config, 1);
  auto gqa2 = std::move(gqa);
  const RowMatrix<float> x = RowMatrix<float>::Random(3, 16);
  EXPECT_EQ(gqa2.forward(x, 1).rows(), 3);
  const apex::GroupedQueryAttention<float> fresh;
  for (const apex::GroupedQueryAttention<float>* empty :
       {static_cast<const apex::GroupedQueryAttention<float>*>(&gqa),
        &fresh}) {  // moved-from, default
    EXPECT_EQ(empty->config().d_model, 0);
    expect_invalid([&] { (void)empty->forward(x, 1); }, "[gqa] the layer is empty");
    expect_invalid([&] { (void)empty->project(x, 1); }, "[gqa] the layer is empty");
    expect_invalid([&] { (void)empty->make_cache(1, 4); }, "[gqa] the layer is empty");
  }
  expect_invalid([] { (void)apex::GqaConfig{}.group_size(); }, "[gqa] num_q_heads (0)");

  apex::MlaConfig mla_config;
  mla_config.d_model = 16;
  mla_config.d_q = 8;
  mla_config.d_kv = 6;
  mla_config.num_q_heads = 2;
  mla_config.num_kv_heads = 1;
  mla_config.head_dim = 4;
  mla_config.rope_dim = 2;
  auto mla = apex::MultiHeadLatentAttention<float>::random(mla_config, 2);
  const auto absorbed = apex::absorb_mla_weights(mla);
  auto mla2 = std::move(mla);
  const apex::RopeTable<float> rope(16, 2);
  apex::AttentionLayerParams<float> params;
  params.rope = &rope;
  EXPECT_EQ(mla2.forward(x, 1, {}, params).rows(), 3);
  auto cache = mla2.make_cache(1, 8);
  expect_invalid([&] { (void)mla.forward(x, 1, {}, params); }, "[mla] the layer is empty");
  expect_invalid([&] { (void)mla.make_cache(1, 8); }, "[mla] the layer is empty");
  expect_invalid(
      [&] { (void)mla.forward_absorbed(x, apex::causal_mask(), params, absorbed, cache); },
      "[mla] the layer is empty");
  EXPECT_EQ(cache.size(), 0);
}

TEST(C5MovedFrom, StackCacheAndTablesAreEmpty) {
  const apex::StackConfig c = tiny_stack();
  auto stack = apex::AttentionStack<float>::random(c, 3);
  auto cache = stack.make_cache(1, 8);
  const apex::TokenMatrix tokens = apex::TokenMatrix::Constant(1, 2, 1);
  auto moved_cache = std::move(cache);
  EXPECT_EQ(cache.batch(), 0);
  EXPECT_EQ(cache.num_layers(), 0);
  expect_invalid([&] { (void)stack.prefill(tokens, 0, cache); }, "[stack]");
  expect_invalid([&] { cache.reserve(4); }, "[stack] the cache is empty");
  EXPECT_EQ(stack.prefill(tokens, 0, moved_cache).rows(), 2);
  auto stack2 = std::move(stack);
  expect_invalid([&] { (void)stack.forward(tokens, 0); }, "[stack] the stack is empty");
  expect_invalid([&] { (void)stack.make_cache(1, 4); }, "[stack] the stack is empty");
  expect_invalid(
      [] { (void)apex::AttentionStack<float>().forward(apex::TokenMatrix::Zero(1, 1), 0); },
      "[stack] the stack is empty");
  EXPECT_EQ(stack2.forward(tokens, 0).rows(), 2);

  apex::RopeTable<float> table(8, 4);
  apex::RopeTable<float> table2 = std::move(table);
  EXPECT_EQ(table.max_positions(), 0);
  EXPECT_EQ(table.head_dim(), 0);
  RowMatrix<float> xr = RowMatrix<float>::Random(2, 4);
  expect_invalid([&] { apex::apply_rope(table, 0, RowRef<float>(xr)); },
                 "[rope] the table is empty");
  expect_invalid([&] { apex::apply_rope(apex::RopeTable<float>(), 0, RowRef<float>(xr)); },
                 "[rope] the table is empty");
  apex::apply_rope(table2, 0, RowRef<float>(xr));
}

// ---- C6: integer overflow outside the checked helpers
// --------------------------------------------

TEST(C6IntegerOverflow, ViewFactoriesCheckTheirStrides) {
  const Index huge = Index{1} << 40;
  float x = 0;
  expect_invalid(
      [&] {
        (void)HeadsView<float>::contiguous(&x, {huge, huge, 1, 1});
      },
      "[heads_view] B*H*S*D");
  expect_invalid(
      [&] {
        (void)HeadsView<float>::token_major(&x, {1, huge, huge, 2});
      },
      "[heads_view] B*H*S*D");
  expect_invalid(
      [&] {
        (void)HeadsView<float>::contiguous(&x, {1, -1, 1, 1});
      },
      "no negative extent");
  // An empty shape needs no strides, whatever its other extents.
  EXPECT_EQ(HeadsView<float>::contiguous(&x, {0, huge, huge, huge}).batch_stride(), 0);
}

TEST(C6IntegerOverflow, EmptyInputsStillCheckTheWidthsTheyForm) {
  // S_q = 0, but H_q·d_v (the concatenation's width, and W_O's expected rows) overflows.
  const Index huge = Index{1} << 62;
  const float x = 0;
  const HeadsView<const float> q(&x, {1, 2, 0, 1}, {0, 0, 1});
  const HeadsView<const float> kv(&x, {1, 1, 0, 1}, {0, 0, 1});
  const HeadsView<const float> v(&x, {1, 1, 0, huge}, {0, 0, huge});
  const RowMatrix<float> w_o(1, 1);
  expect_invalid(
      [&] {
        (void)apex::multi_head_attention(q, kv, v, AttentionMask<float>{}, SdpaParams{}, w_o);
      },
      "[multi_head_attention]");
}

TEST(C6IntegerOverflow, StackCacheMemoryDoesNotLoopOverLayers) {
  apex::StackConfig c = tiny_stack();
  c.num_layers = Index{1} << 62;
  c.global_every = 6;
  // 2^62 layers of bytes overflow 64 bits: an error, at once (not after 2^62 iterations).
  expect_invalid([&] { (void)apex::stack_cache_memory(c, 1, 16, 2); }, "overflows 64 bits");
  c.num_layers = 12;
  const apex::StackCacheMemory m = apex::stack_cache_memory(c, 1, 16, 2);
  EXPECT_EQ(m.global_layers, 2);
  EXPECT_EQ(m.local_layers, 10);
}

// ---- C7: a failed call changes nothing
// -------------------------------------------------------------

TEST(C7FailedCalls, StackRejectsBadNormEpsAtConstruction) {
  for (const double eps : {0.0, -1e-6, std::numeric_limits<double>::quiet_NaN(), kInf}) {
    apex::StackConfig c = tiny_stack();
    c.norm_eps = eps;
    expect_invalid([&] { (void)apex::AttentionStack<float>::random(c, 1); }, "[stack] norm_eps");
  }
}

TEST(C7FailedCalls, StackRejectsLayersOfAnotherShape) {
  const apex::StackConfig c = tiny_stack();
  auto good = apex::AttentionStack<float>::random(c, 1);
  std::vector<apex::AttentionStack<float>::Layer> layers;
  for (Index l = 0; l < c.num_layers; ++l) layers.push_back(good.layer(l));
  apex::GqaConfig wider = c.local;
  wider.num_kv_heads = 2;  // the config says 1
  layers[0] = apex::GroupedQueryAttention<float>::random(wider, 5);
  std::vector<Vector<float>> gammas(3, Vector<float>::Ones(8));
  expect_invalid(
      [&] {
        apex::AttentionStack<float>(c, good.embedding(), gammas, Vector<float>::Ones(8), layers);
      },
      {"[stack] layer 0", "must have the shape of config.local"});
}

// The γ a stack was built with are handed back as given; a layer outside [0, L) is refused.
TEST(C7FailedCalls, StackNormGammaRejectsLayersOutOfRange) {
  const apex::StackConfig c = tiny_stack();
  const auto good = apex::AttentionStack<float>::random(c, 1);
  std::vector<apex::AttentionStack<float>::Layer> layers;
  for (Index l = 0; l < c.num_layers; ++l) layers.push_back(good.layer(l));
  std::vector<Vector<float>> gammas;
  for (Index l = 0; l < c.num_layers; ++l)
    gammas.push_back(Vector<float>::Constant(8, 0.5f + static_cast<float>(l)));
  const Vector<float> last = Vector<float>::LinSpaced(8, -1.0f, 1.0f);
  const apex::AttentionStack<float> stack(c, good.embedding(), gammas, last, layers);
  for (Index l = 0; l < c.num_layers; ++l)
    EXPECT_EQ(stack.norm_gamma(l), gammas[static_cast<std::size_t>(l)]) << l;
  EXPECT_EQ(stack.final_gamma(), last);
  EXPECT_EQ(good.norm_gamma(0), Vector<float>::Ones(8));  // random(): every γ = 1
  expect_invalid([&] { (void)stack.norm_gamma(c.num_layers); }, "[stack] layer (3)");
  expect_invalid([&] { (void)stack.norm_gamma(-1); }, "[stack] layer (-1)");
}

TEST(C7FailedCalls, FailedStackCallsLeaveTheCacheAsItWas) {
  const apex::StackConfig c = tiny_stack();
  const auto stack = apex::AttentionStack<double>::random(c, 2);
  auto cache = stack.make_cache(1, 8);
  apex::TokenMatrix bad = apex::TokenMatrix::Constant(1, 3, 2);
  bad(0, 2) = 99;  // the last id is out of range
  expect_invalid([&] { (void)stack.prefill(bad, 0, cache); }, "[embed] token id (99)");
  EXPECT_EQ(cache.next_position(), 0);
  (void)stack.prefill(apex::TokenMatrix::Constant(1, 3, 2), 0, cache);
  expect_invalid([&] { (void)stack.extend(apex::TokenMatrix::Constant(1, 6, 1), cache); },
                 "exceed");
  EXPECT_EQ(cache.next_position(), 3);
  for (Index l = 0; l < cache.num_layers(); ++l) {
    std::visit([](const auto& layer_cache) { EXPECT_EQ(layer_cache.next_position(), 3); },
               cache.layer(l));
  }
}

// ---- C8: messages that name the value the caller gave
// ----------------------------------------------

TEST(C8Messages, TokenIdsAreReportedAsGiven) {
  const RowMatrix<float> table = RowMatrix<float>::Ones(4, 2);
  Eigen::Matrix<std::uint64_t, 1, 2, Eigen::RowMajor> ids;
  ids << 1, std::numeric_limits<std::uint64_t>::max();
  expect_invalid([&] { (void)apex::embed(table, ids); }, "[embed] token id (18446744073709551615)");
  Eigen::Matrix<std::int8_t, 1, 1> small_ids;
  small_ids << std::int8_t{-3};
  expect_invalid([&] { (void)apex::embed(table, small_ids); }, "[embed] token id (-3)");
}

TEST(C8Messages, RopePositionIdsAreReportedAsNumbers) {
  const apex::RopeTable<float> table(8, 4);
  RowMatrix<float> x = RowMatrix<float>::Zero(1, 4);
  Eigen::Matrix<std::int8_t, 1, 1> ids;
  ids << std::int8_t{65};  // printed as a character it would read "A"
  expect_invalid([&] { apex::apply_rope(table, ids, RowRef<float>(x)); },
                 "[rope] position id (65)");
}

TEST(C8Messages, MlaCheaperPathRejectsNegativeTokenCounts) {
  apex::MlaConfig m;
  m.d_model = 16;
  m.d_q = 8;
  m.d_kv = 6;
  m.num_q_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 4;
  m.rope_dim = 2;
  expect_invalid([&] { (void)apex::mla_cheaper_path(m, -1); }, "[mla] new_tokens (-1)");
  expect_invalid([&] { (void)apex::mla_cheaper_path(m, 0); }, "[mla] new_tokens (0)");
  EXPECT_EQ(apex::mla_cheaper_path(m, 1), apex::MlaPath::kAbsorbed);
}

// ---- C9: bit-identical for every thread count
// ----------------------------------------------------

/// Runs `compute` with 1, 2, 3 and 4 OpenMP threads and expects bit-identical results.
template <class Compute>
void expect_same_bits_for_thread_counts(const Compute& compute, const char* what) {
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const RowMatrix<float> one = compute();
  for (const int threads : {2, 3, 4}) {
    omp_set_num_threads(threads);
    const RowMatrix<float> other = compute();
    ASSERT_EQ(other.rows(), one.rows());
    ASSERT_EQ(other.cols(), one.cols());
    EXPECT_EQ(std::memcmp(other.data(), one.data(), sizeof(float) * std::size_t(one.size())), 0)
        << what << " differs between 1 and " << threads << " threads";
  }
  omp_set_num_threads(saved);
#else
  (void)compute;
  GTEST_SKIP() << what << ": built without OpenMP, one thread only";
#endif
}

TEST(C9ThreadCounts, LayersAndStackAreBitIdentical) {
  const apex::GqaConfig config{512, 8, 2, 64};
  const auto gqa = apex::GroupedQueryAttention<float>::random(config, 1);
  const RowMatrix<float> chunk = apex::testing::random_matrix<float>(8, 512, 2);
  const RowMatrix<float> prompt = apex::testing::random_matrix<float>(300, 512, 3);
  expect_same_bits_for_thread_counts([&] { return gqa.forward(chunk, 1); }, "gqa 8-token chunk");
  expect_same_bits_for_thread_counts([&] { return gqa.forward(prompt, 2); }, "gqa prompt");
  expect_same_bits_for_thread_counts(
      [&] {
        auto cache = gqa.make_cache(1, 16);
        return gqa.forward_cached(chunk, apex::causal_mask(), {}, cache);
      },
      "gqa cached");
  const RowMatrix<float> table = apex::testing::random_matrix<float>(3000, 512, 4);
  expect_same_bits_for_thread_counts([&] { return apex::lm_head(chunk, table); }, "lm_head");

  apex::StackConfig c;
  c.vocab_size = 1000;
  c.d_model = 256;
  c.num_layers = 2;
  c.window = 16;
  c.global_every = 2;
  c.local = apex::GqaConfig{256, 4, 2, 64};
  c.global.d_model = 256;
  c.global.d_q = 96;
  c.global.d_kv = 64;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 32;
  c.global.rope_dim = 16;
  c.max_positions = 64;
  const auto stack = apex::AttentionStack<float>::random(c, 5);
  apex::TokenMatrix tokens(2, 24);
  for (Index i = 0; i < tokens.size(); ++i) tokens.data()[i] = (37 * i + 11) % 1000;
  expect_same_bits_for_thread_counts([&] { return stack.forward(tokens, 4); }, "stack forward");
  expect_same_bits_for_thread_counts(
      [&] {
        auto cache = stack.make_cache(2, 64);
        (void)stack.prefill(tokens, 4, cache);
        return stack.decode_step({3, 4}, cache);
      },
      "stack prefill + decode_step");

  // 16-bit weights: streamed (few rows) and widened panel by panel (a prompt), both in fixed
  // tiles.
  const auto narrow = stack.with_weights<Eigen::bfloat16>();
  const auto narrow_gqa = gqa.with_weights<Eigen::half>();
  expect_same_bits_for_thread_counts([&] { return narrow_gqa.forward(chunk, 1); },
                                     "gqa 8-token chunk, half weights");
  expect_same_bits_for_thread_counts([&] { return narrow_gqa.forward(prompt, 2); },
                                     "gqa prompt, half weights");
  expect_same_bits_for_thread_counts([&] { return narrow.forward(tokens, 4); },
                                     "stack forward, bfloat16 weights");
  expect_same_bits_for_thread_counts(
      [&] {
        auto cache = narrow.make_cache<Eigen::bfloat16>(2, 64);
        (void)narrow.prefill(tokens, 4, cache);
        return narrow.decode_step({3, 4}, cache);
      },
      "stack prefill + decode_step, bfloat16 weights and caches");
}

TEST(C9ThreadCounts, SdpaIsBitIdentical) {
  for (const Index s_q : {Index{1}, Index{3}, Index{300}}) {
    const auto q = apex::testing::random_heads<float>(1, 8, s_q, 32, 1);
    const auto k = apex::testing::random_heads<float>(1, 2, 2000, 32, 2);
    const auto v = apex::testing::random_heads<float>(1, 2, 2000, 32, 3);
    expect_same_bits_for_thread_counts(
        [&] {
          HeadsTensor<float> out({1, 8, s_q, 32});
          AttentionMask<float> mask;
          mask.positions = apex::causal_mask();
          apex::sdpa<float>(q.view(), k.view(), v.view(), mask, {}, out.view());
          return flat(out);
        },
        "sdpa");
  }
}

// ---- C10: aliasing and strides, as documented
// --------------------------------------------------------

TYPED_TEST(Adversarial, C10_SdpaOutputMayOverlapItsInputs) {
  using Scalar = TypeParam;
  const auto q = apex::testing::random_heads<Scalar>(2, 4, 70, 16, 1);
  const auto k = apex::testing::random_heads<Scalar>(2, 2, 70, 16, 2);
  const auto v = apex::testing::random_heads<Scalar>(2, 2, 70, 16, 3);
  AttentionMask<Scalar> mask;
  mask.positions = apex::causal_mask();
  HeadsTensor<Scalar> expected({2, 4, 70, 16});
  apex::sdpa<Scalar>(q.view(), k.view(), v.view(), mask, {}, expected.view());
  HeadsTensor<Scalar> in_place = q;  // out is q itself
  apex::sdpa<Scalar>(in_place.view(), k.view(), v.view(), mask, {}, in_place.view());
  EXPECT_EQ(flat(in_place), flat(expected));
  // out overlaps v: the first half of out's memory is v.
  HeadsTensor<Scalar> big({2, 4, 70, 16});
  std::memcpy(big.data(), v.data(), sizeof(Scalar) * std::size_t(2 * 2 * 70 * 16));
  const auto v_in_big = HeadsView<const Scalar>::contiguous(big.data(), {2, 2, 70, 16});
  HeadsTensor<Scalar> expected_v({2, 4, 70, 16});
  apex::sdpa<Scalar>(q.view(), k.view(), v_in_big, mask, {}, expected_v.view());
  apex::sdpa<Scalar>(q.view(), k.view(), v_in_big, mask, {}, big.view());
  EXPECT_EQ(flat(big), flat(expected_v));
}

TYPED_TEST(Adversarial, C10_OutputsThatShareMemoryAreRejected) {
  using Scalar = TypeParam;
  const auto q = apex::testing::random_heads<Scalar>(1, 2, 3, 4, 1);
  HeadsTensor<Scalar> out({1, 2, 3, 4});
  // A zero row stride would put every query's output on one row.
  const HeadsView<Scalar> collapsed(out.data(), {1, 2, 3, 4}, {0, 12, 0});
  expect_invalid([&] { apex::sdpa<Scalar>(q.view(), q.view(), q.view(), {}, {}, collapsed); },
                 "make distinct elements share memory");
  // lse inside out.
  const HeadsView<Scalar> lse(out.data(), {1, 2, 3, 1}, {0, 12, 4});
  expect_invalid([&] { apex::sdpa<Scalar>(q.view(), q.view(), q.view(), {}, {}, out.view(), lse); },
                 "two outputs");
  // An empty output of any strides is fine.
  const HeadsView<Scalar> none(out.data(), {1, 2, 0, 4}, {0, 0, 0});
  const HeadsView<const Scalar> q_none(q.data(), {1, 2, 0, 4}, {0, 0, 0});
  apex::sdpa<Scalar>(q_none, q.view(), q.view(), {}, {}, none);
}

TYPED_TEST(Adversarial, C10_ZeroAndNegativeInputStridesWork) {
  using Scalar = TypeParam;
  const auto k = apex::testing::random_heads<Scalar>(1, 1, 9, 4, 1);
  const auto v = apex::testing::random_heads<Scalar>(1, 1, 9, 3, 2);
  const auto q = apex::testing::random_heads<Scalar>(3, 2, 5, 4, 3);
  // K and V shared by 3 batches through a zero batch stride.
  const HeadsView<const Scalar> k3(k.data(), {3, 1, 9, 4}, {0, 0, 4});
  const HeadsView<const Scalar> v3(v.data(), {3, 1, 9, 3}, {0, 0, 3});
  HeadsTensor<Scalar> out({3, 2, 5, 3}), ref({3, 2, 5, 3});
  apex::sdpa<Scalar>(q.view(), k3, v3, {}, {}, out.view());
  apex::reference::sdpa<Scalar>(q.view(), k3, v3, {}, {}, ref.view());
  EXPECT_LE(max_diff(out, ref), kTol<Scalar>);
  // The keys and values read backwards (negative row stride): attention without a mask does not
  // depend on the order of the keys.
  const HeadsView<const Scalar> k_rev(k.data() + 8 * 4, {1, 1, 9, 4}, {0, 0, -4});
  const HeadsView<const Scalar> v_rev(v.data() + 8 * 3, {1, 1, 9, 3}, {0, 0, -3});
  const auto q1 = apex::testing::random_heads<Scalar>(1, 2, 5, 4, 4);
  HeadsTensor<Scalar> fwd({1, 2, 5, 3}), rev({1, 2, 5, 3});
  apex::sdpa<Scalar>(q1.view(), k.view(), v.view(), {}, {}, fwd.view());
  apex::sdpa<Scalar>(q1.view(), k_rev, v_rev, {}, {}, rev.view());
  EXPECT_LE(max_diff(fwd, rev), kTol<Scalar>);
}

TYPED_TEST(Adversarial, C10_MergeInPlaceOverEitherSide) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> a = apex::testing::random_matrix<Scalar>(4, 3, 1);
  const RowMatrix<Scalar> b = apex::testing::random_matrix<Scalar>(4, 3, 2);
  const Vector<Scalar> la = (Eigen::Vector4d() << 0.5, -1, 2, -kInf).finished().cast<Scalar>();
  const Vector<Scalar> lb = (Eigen::Vector4d() << 1, 3, -kInf, -kInf).finished().cast<Scalar>();
  RowMatrix<Scalar> expected(4, 3);
  Vector<Scalar> expected_lse(4);
  apex::merge_attention(a, la, b, lb, expected, expected_lse);
  RowMatrix<Scalar> over_b = b;
  Vector<Scalar> over_lb = lb;
  apex::merge_attention(a, la, over_b, over_lb, over_b, over_lb);
  EXPECT_EQ(over_b, expected);
  EXPECT_EQ(over_lb, expected_lse);
  RowMatrix<Scalar> over_a = a;
  Vector<Scalar> over_la = la;
  apex::merge_attention(over_a, over_la, b, lb, over_a, over_la);
  EXPECT_EQ(over_a, expected);
  EXPECT_TRUE(expected.row(3).isZero());
  EXPECT_EQ(expected_lse(3), -std::numeric_limits<Scalar>::infinity());
}

template <class T, class = void>
struct CanViewTemporary : std::false_type {};
template <class T>
struct CanViewTemporary<T, std::void_t<decltype(apex::as_heads_view(std::declval<T>()))>>
    : std::true_type {};

TEST(C10Aliasing, NoViewOfATemporary) {
  static_assert(CanViewTemporary<const RowMatrix<float>&>::value, "a view of an lvalue");
  static_assert(!CanViewTemporary<RowMatrix<float>>::value, "no view of a temporary");
  static_assert(!CanViewTemporary<RowMatrix<float>&&>::value, "no view of an rvalue");
  SUCCEED();
}

}  // namespace
}  // namespace adversarial_test
