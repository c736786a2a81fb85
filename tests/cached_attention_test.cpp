// SPDX-License-Identifier: MIT
// Tests of include/apex/cached_attention.hpp: attention of new queries over a sliding-window
// cache plus the chunk's own keys (sdpa_with_window_cache), against the plain loops of
// reference/attention.hpp over the whole history, and the rules a cached call's positions obey.
// (The caches themselves are tested in kv_cache_test.cpp.)
#include <apex/cached_attention.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace cached_attention_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::RowMatrix;
using apex::SlidingWindowCache;
using apex::testing::chunk_of;
using apex::testing::expect_invalid;
using apex::testing::heads_of;
using apex::testing::random_matrix;
using apex::testing::Tolerances;

template <class Scalar>
class CachedAttentionTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CachedAttentionTyped, Scalars, apex::testing::ScalarName);

// ---------------------------------------------------------------------------------------------
// Attention over a sliding-window cache, against the plain loops of reference/attention.hpp
// ---------------------------------------------------------------------------------------------

// Tolerance, normwise against max(1, max |expected|): Tolerances<Scalar>::kWindowCache of
// tolerances.hpp. q, k, v are O(1), the softmax averages values, and the kernel reads the ring's
// (at most two) runs and the chunk as key segments of one pass, over at most W + n = 17 keys of
// width 5. A wrong key, position or segment moves outputs by O(0.1).
// The history runs twice: plain, and with attention sinks and ALiBi (the sink of a row joins
// once, however many segments its keys come from; ALiBi reads each segment's own positions).

template <class Scalar>
void check_window_cache_history(bool sinks_and_alibi) {
  const Index batch = 2, h_q = 4, h_kv = 2, dim = 5, window = 6, prefix = 4, total = 40;
  const RowMatrix<Scalar> q_all = random_matrix<Scalar>(batch * total, h_q * dim, 11);
  const RowMatrix<Scalar> k_all = random_matrix<Scalar>(batch * total, h_kv * dim, 12);
  const RowMatrix<Scalar> v_all = random_matrix<Scalar>(batch * total, h_kv * dim, 13);
  apex::PositionMask rule = apex::sliding_window_mask(window);
  rule.prefix = prefix;
  const apex_test::MaskRule plain{true, window, prefix};
  apex::SdpaParams params;
  if (sinks_and_alibi) {
    params.sinks = {0.3, -0.5, 1.0, 2.0};
    params.alibi_slopes = apex::alibi_slopes(h_q);
  }
  SlidingWindowCache<Scalar> cache({batch, h_kv, dim, window});
  Index position = 0;
  for (const Index n : {Index{5}, Index{1}, Index{1}, Index{3}, Index{6}, Index{1}, Index{9},
                        Index{2}, Index{1}, Index{11}}) {
    const RowMatrix<Scalar> q = chunk_of(q_all, batch, position, n);
    const RowMatrix<Scalar> k = chunk_of(k_all, batch, position, n);
    const RowMatrix<Scalar> v = chunk_of(v_all, batch, position, n);
    RowMatrix<Scalar> out(batch * n, h_q * dim);
    apex::sdpa_with_window_cache<Scalar>(
        heads_of(q, batch, h_q), heads_of(k, batch, h_kv), heads_of(v, batch, h_kv), rule, params,
        cache, HeadsView<Scalar>::token_major(out.data(), {batch, h_q, n, dim}));
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < h_q; ++h) {
        const Index g = apex_test::kv_head_of(h, h_q, h_kv);  // §8.2
        const apex_test::MatrixD qd =
            q_all.block(b * total + position, h * dim, n, dim).template cast<double>();
        const apex_test::MatrixD kd =
            k_all.block(b * total, g * dim, position + n, dim).template cast<double>();
        const apex_test::MatrixD vd =
            v_all.block(b * total, g * dim, position + n, dim).template cast<double>();
        // ALiBi as a dense bias −slope·(qp − kp), the sink as the loops' extra score.
        apex_test::MatrixD alibi = apex_test::MatrixD::Zero(n, position + n);
        double sink = -std::numeric_limits<double>::infinity();
        if (sinks_and_alibi) {
          for (Index i = 0; i < n; ++i) {
            for (Index j = 0; j < position + n; ++j) {
              alibi(i, j) = -params.alibi_slopes[std::size_t(h)] * double(position + i - j);
            }
          }
          sink = params.sinks[std::size_t(h)];
        }
        const auto expected = apex_test::attention(
            qd, kd, vd,
            [&](Index i, Index j) { return apex_test::rule_allows(plain, position + i, j); },
            &alibi, 1.0 / std::sqrt(static_cast<double>(dim)), 0.0, sink);
        const auto actual = out.block(b * n, h * dim, n, dim).template cast<double>();
        EXPECT_LE(
            (actual - expected.out).cwiseAbs().maxCoeff(),
            Tolerances<Scalar>::kWindowCache * std::max(1.0, expected.out.cwiseAbs().maxCoeff()))
            << "position " << position << ", n " << n << ", b " << b << ", h " << h;
      }
    }
    cache.append(heads_of(k, batch, h_kv), heads_of(v, batch, h_kv), position);
    position += n;
  }
  ASSERT_EQ(position, total);
}

TYPED_TEST(CachedAttentionTyped, WindowCacheAttentionEqualsAttentionOverTheWholeHistory) {
  for (const bool sinks_and_alibi : {false, true}) {
    SCOPED_TRACE(sinks_and_alibi ? "sinks and ALiBi" : "plain");
    check_window_cache_history<TypeParam>(sinks_and_alibi);
  }
}

// ---------------------------------------------------------------------------------------------
// Bad input: clear exceptions, output unchanged
// ---------------------------------------------------------------------------------------------

TEST(CachedAttention, ChunksOfNegativeLengthAreRejected) {
  // A view may claim -1 rows: the attention over the ring checks the chunk the way the ring's
  // append does (kv_cache_test.cpp), before writing out.
  const float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const HeadsView<const float> negative(data, {1, 1, -1, 2}, {0, 0, 2});
  const RowMatrix<float> two = random_matrix<float>(2, 2, 41);
  SlidingWindowCache<float> ring({1, 1, 2, 3});
  ring.append(heads_of(two, 1, 1), heads_of(two, 1, 1), 0);
  RowMatrix<float> out = RowMatrix<float>::Constant(1, 2, 99.0f);
  const RowMatrix<float> q = random_matrix<float>(1, 2, 42);
  expect_invalid(
      [&] {
        apex::sdpa_with_window_cache<float>(
            heads_of(q, 1, 1), negative, negative, apex::sliding_window_mask(3), {}, ring,
            HeadsView<float>::token_major(out.data(), {1, 1, 1, 2}));
      },
      "[sdpa_with_window_cache] chunk length n (-1) must be >= 0");
  EXPECT_TRUE((out.array() == 99.0f).all());
}

TEST(CachedAttention, WindowAttentionRejectsARuleTheRingCannotServe) {
  SlidingWindowCache<float> ring({1, 1, 2, 4});
  const RowMatrix<float> q = random_matrix<float>(1, 2, 41);
  RowMatrix<float> out = RowMatrix<float>::Constant(1, 2, 7.0f);
  const auto call = [&](const apex::PositionMask& rule) {
    apex::sdpa_with_window_cache<float>(heads_of(q, 1, 1), heads_of(q, 1, 1), heads_of(q, 1, 1),
                                        rule, {}, ring,
                                        HeadsView<float>::token_major(out.data(), {1, 1, 1, 2}));
  };
  expect_invalid([&] { call(apex::causal_mask()); },
                 "needs a causal mask with a window of at most 4 (got none)");
  expect_invalid([&] { call(apex::sliding_window_mask(5)); },
                 "needs a causal mask with a window of at most 4 (got 5)");
  apex::PositionMask offset = apex::sliding_window_mask(4);
  offset.query_offset = 0;
  expect_invalid([&] { call(offset); }, "query_offset/key_offset must be unset");
  EXPECT_EQ(out, RowMatrix<float>::Constant(1, 2, 7.0f));
}

}  // namespace
}  // namespace cached_attention_test
