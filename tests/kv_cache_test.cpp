// SPDX-License-Identifier: MIT
// Tests for the decoding caches (KvCache, SlidingWindowCache, LatentCache), attention over a
// sliding-window cache, and the cache-size tables of §7.4, §8.3, §9.4 and §10.3.
#include <apex/cache_memory.hpp>
#include <apex/cached_attention.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "reference/attention.hpp"
#include "test_util.hpp"

namespace {

using apex::HeadsView;
using apex::Index;
using apex::KvCache;
using apex::LatentCache;
using apex::RowMatrix;
using apex::SlidingWindowCache;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

template <class Scalar>
class KvCacheTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(KvCacheTyped, Scalars, apex::testing::ScalarName);

// A token-major chunk [B*n, H*d] (what a projection writes) and its [B, H, n, d] view.
template <class Scalar>
HeadsView<const Scalar> heads_of(const RowMatrix<Scalar>& m, Index batch, Index heads) {
  return HeadsView<const Scalar>::token_major(m.data(),
                                              {batch, heads, m.rows() / batch, m.cols() / heads});
}

// Row `position` of head (b, h) of the whole history [B*T, H*d] (token-major, T tokens).
template <class Scalar>
auto history_row(const RowMatrix<Scalar>& history, Index total, Index b, Index h, Index dim,
                 Index position) {
  return history.row(b * total + position).segment(h * dim, dim);
}

// The tokens [first, first + n) of every batch of a token-major history [B*T, H*d].
template <class Scalar>
RowMatrix<Scalar> chunk_of(const RowMatrix<Scalar>& history, Index batch, Index first, Index n) {
  const Index total = history.rows() / batch;
  RowMatrix<Scalar> chunk(batch * n, history.cols());
  for (Index b = 0; b < batch; ++b) {
    chunk.middleRows(b * n, n) = history.middleRows(b * total + first, n);
  }
  return chunk;
}

TYPED_TEST(KvCacheTyped, AppendsChunksAndViewsThemInPlace) {
  using Scalar = TypeParam;
  const Index batch = 2, heads = 3, dim = 5, total = 11;
  const RowMatrix<Scalar> k_all = random_matrix<Scalar>(batch * total, heads * dim, 1);
  const RowMatrix<Scalar> v_all = random_matrix<Scalar>(batch * total, heads * dim, 2);
  KvCache<Scalar> cache({batch, heads, dim, total});
  EXPECT_EQ(cache.bytes(),
            static_cast<std::int64_t>(2 * batch * heads * total * dim * sizeof(Scalar)));
  Index position = 0;
  for (const Index n : {Index{4}, Index{1}, Index{3}, Index{3}}) {
    const RowMatrix<Scalar> k = chunk_of(k_all, batch, position, n);
    const RowMatrix<Scalar> v = chunk_of(v_all, batch, position, n);
    cache.append(heads_of(k, batch, heads), heads_of(v, batch, heads), position);
    position += n;
    ASSERT_EQ(cache.size(), position);
    ASSERT_EQ(cache.next_position(), position);
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        for (Index t = 0; t < position; ++t) {
          EXPECT_EQ(cache.keys().head(b, h).row(t), history_row(k_all, total, b, h, dim, t));
          EXPECT_EQ(cache.values().head(b, h).row(t), history_row(v_all, total, b, h, dim, t));
        }
      }
    }
  }
  EXPECT_EQ(cache.keys().seq(), total);
  EXPECT_EQ(cache.keys().head_stride(), total * dim);

  // reserve keeps the tokens; truncate drops the newest; clear drops everything.
  cache.reserve(20);
  EXPECT_EQ(cache.capacity(), 20);
  EXPECT_EQ(cache.bytes(),
            static_cast<std::int64_t>(2 * batch * heads * 20 * dim * sizeof(Scalar)));
  EXPECT_EQ(cache.keys().head(1, 2).row(10), history_row(k_all, total, 1, 2, dim, 10));
  cache.truncate(6);
  EXPECT_EQ(cache.next_position(), 6);
  const RowMatrix<Scalar> again = chunk_of(k_all, batch, 6, 1);
  cache.append(heads_of(again, batch, heads), heads_of(again, batch, heads), 6);
  EXPECT_EQ(cache.size(), 7);
  cache.clear();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.capacity(), 20);
}

TYPED_TEST(KvCacheTyped, SlidingWindowHoldsTheLastWTokensAcrossManyWraps) {
  using Scalar = TypeParam;
  const Index batch = 2, heads = 2, dim = 3, window = 5, total = 37;
  const RowMatrix<Scalar> k_all = random_matrix<Scalar>(batch * total, heads * dim, 3);
  const RowMatrix<Scalar> v_all = random_matrix<Scalar>(batch * total, heads * dim, 4);
  SlidingWindowCache<Scalar> cache({batch, heads, dim, window});
  const std::int64_t bytes = cache.bytes();
  EXPECT_EQ(bytes, static_cast<std::int64_t>(2 * batch * heads * window * dim * sizeof(Scalar)));
  Index position = 0;
  // Single tokens, chunks shorter than W, exactly W and longer than W.
  const std::vector<Index> chunks = {1, 1, 2, 1, 3, 5, 1, 7, 2, 1, 1, 12};
  for (const Index n : chunks) {
    const RowMatrix<Scalar> k = chunk_of(k_all, batch, position, n);
    const RowMatrix<Scalar> v = chunk_of(v_all, batch, position, n);
    cache.append(heads_of(k, batch, heads), heads_of(v, batch, heads), position);
    position += n;
    ASSERT_EQ(cache.next_position(), position);
    ASSERT_EQ(cache.size(), std::min(position, window));
    ASSERT_EQ(cache.first_position(), position - cache.size());
    EXPECT_EQ(cache.bytes(), bytes) << "the ring never grows";
    // The segments cover [first_position, next_position) in order, each with its positions.
    Index expected = cache.first_position();
    for (const auto& segment : cache.segments()) {
      if (segment.keys.seq() == 0) continue;
      EXPECT_EQ(segment.first_position, expected);
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < heads; ++h) {
          for (Index t = 0; t < segment.keys.seq(); ++t) {
            EXPECT_EQ(segment.keys.head(b, h).row(t),
                      history_row(k_all, total, b, h, dim, expected + t));
            EXPECT_EQ(segment.values.head(b, h).row(t),
                      history_row(v_all, total, b, h, dim, expected + t));
          }
        }
      }
      expected += segment.keys.seq();
    }
    EXPECT_EQ(expected, position);
  }
  ASSERT_EQ(position, total);
}

TYPED_TEST(KvCacheTyped, LatentCacheHoldsExactlyCkvAndKropePerToken) {
  using Scalar = TypeParam;
  const Index batch = 2, d_kv = 7, rope_heads = 3, d_r = 4, capacity = 9;
  LatentCache<Scalar> cache({batch, d_kv, rope_heads, d_r, capacity});
  // §9.4 corrected: d_kv + H_kr·d_r values per token and nothing else (SEED-NOTES.md).
  EXPECT_EQ(cache.row_width(), d_kv + rope_heads * d_r);
  EXPECT_EQ(cache.bytes(), static_cast<std::int64_t>(batch * capacity * (d_kv + rope_heads * d_r) *
                                                     sizeof(Scalar)));
  EXPECT_EQ(cache.bytes(), apex::latent_cache_bytes(batch, capacity, d_kv, rope_heads, d_r,
                                                    static_cast<std::int64_t>(sizeof(Scalar))));
  const RowMatrix<Scalar> c1 = random_matrix<Scalar>(batch * 3, d_kv, 5);
  const RowMatrix<Scalar> r1 = random_matrix<Scalar>(batch * 3, rope_heads * d_r, 6);
  cache.append(c1, r1, 0);
  const RowMatrix<Scalar> rows2 = random_matrix<Scalar>(batch * 2, cache.row_width(), 7);
  cache.append(rows2, 3);
  ASSERT_EQ(cache.size(), 5);
  for (Index b = 0; b < batch; ++b) {
    for (Index t = 0; t < 3; ++t) {
      EXPECT_EQ(cache.latent().head(b, 0).row(t), c1.row(b * 3 + t));
      for (Index h = 0; h < rope_heads; ++h) {
        EXPECT_EQ(cache.rope_keys().head(b, h).row(t), r1.row(b * 3 + t).segment(h * d_r, d_r));
      }
    }
    for (Index t = 0; t < 2; ++t) {
      EXPECT_EQ(cache.rows().head(b, 0).row(3 + t), rows2.row(b * 2 + t));
    }
  }
  cache.reserve(12);
  EXPECT_EQ(cache.rows().head(1, 0).row(4), rows2.row(3));
  EXPECT_EQ(cache.bytes(),
            batch * 12 * cache.row_width() * static_cast<std::int64_t>(sizeof(Scalar)));
}

// ---------------------------------------------------------------------------------------------
// Attention over a sliding-window cache, against the plain loops of reference/attention.hpp
// ---------------------------------------------------------------------------------------------

// Tolerance, relative to the largest output: q, k, v are O(1), the softmax averages values, and
// the library combines up to three partial softmaxes with their log-sum-exps; the classical
// bound for a d-term dot product, an exp and a W-term weighted sum is a few hundred float ulps at
// most. A wrong key, position or merge weight moves outputs by O(0.1).
template <class Scalar>
constexpr double kWindowTol = std::is_same_v<Scalar, float> ? 2e-6 : 1e-13;

TYPED_TEST(KvCacheTyped, WindowCacheAttentionEqualsAttentionOverTheWholeHistory) {
  using Scalar = TypeParam;
  const Index batch = 2, h_q = 4, h_kv = 2, dim = 5, window = 6, prefix = 4, total = 40;
  const RowMatrix<Scalar> q_all = random_matrix<Scalar>(batch * total, h_q * dim, 11);
  const RowMatrix<Scalar> k_all = random_matrix<Scalar>(batch * total, h_kv * dim, 12);
  const RowMatrix<Scalar> v_all = random_matrix<Scalar>(batch * total, h_kv * dim, 13);
  apex::PositionMask rule = apex::sliding_window_mask(window);
  rule.prefix = prefix;
  const apex_test::MaskRule plain{true, window, prefix};
  SlidingWindowCache<Scalar> cache({batch, h_kv, dim, window});
  Index position = 0;
  for (const Index n : {Index{5}, Index{1}, Index{1}, Index{3}, Index{6}, Index{1}, Index{9},
                        Index{2}, Index{1}, Index{11}}) {
    const RowMatrix<Scalar> q = chunk_of(q_all, batch, position, n);
    const RowMatrix<Scalar> k = chunk_of(k_all, batch, position, n);
    const RowMatrix<Scalar> v = chunk_of(v_all, batch, position, n);
    RowMatrix<Scalar> out(batch * n, h_q * dim);
    apex::sdpa_with_window_cache<Scalar>(
        heads_of(q, batch, h_q), heads_of(k, batch, h_kv), heads_of(v, batch, h_kv), rule, {},
        cache, HeadsView<Scalar>::token_major(out.data(), {batch, h_q, n, dim}));
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < h_q; ++h) {
        const Index g = h / (h_q / h_kv);
        const apex_test::MatrixD qd =
            q_all.block(b * total + position, h * dim, n, dim).template cast<double>();
        const apex_test::MatrixD kd =
            k_all.block(b * total, g * dim, position + n, dim).template cast<double>();
        const apex_test::MatrixD vd =
            v_all.block(b * total, g * dim, position + n, dim).template cast<double>();
        const auto expected = apex_test::attention(
            qd, kd, vd,
            [&](Index i, Index j) { return apex_test::rule_allows(plain, position + i, j); },
            nullptr, 1.0 / std::sqrt(static_cast<double>(dim)), 0.0);
        const auto actual = out.block(b * n, h * dim, n, dim).template cast<double>();
        EXPECT_LE((actual - expected.out).cwiseAbs().maxCoeff(),
                  kWindowTol<Scalar> * std::max(1.0, expected.out.cwiseAbs().maxCoeff()))
            << "position " << position << ", n " << n << ", b " << b << ", h " << h;
      }
    }
    cache.append(heads_of(k, batch, h_kv), heads_of(v, batch, h_kv), position);
    position += n;
  }
  ASSERT_EQ(position, total);
}

// ---------------------------------------------------------------------------------------------
// Bad input: clear exceptions, cache unchanged
// ---------------------------------------------------------------------------------------------

TEST(KvCache, BadAppendsThrowAndLeaveTheCacheUnchanged) {
  const Index batch = 2, heads = 2, dim = 3;
  KvCache<float> cache({batch, heads, dim, 4});
  const RowMatrix<float> three = random_matrix<float>(batch * 3, heads * dim, 21);
  cache.append(heads_of(three, batch, heads), heads_of(three, batch, heads), 0);
  const RowMatrix<float> keys_before = apex::merge_heads(cache.keys());
  const auto unchanged = [&] {
    EXPECT_EQ(cache.next_position(), 3);
    EXPECT_EQ(apex::merge_heads(cache.keys()), keys_before);
  };
  const RowMatrix<float> two = random_matrix<float>(batch * 2, heads * dim, 22);
  expect_invalid(
      [&] { cache.append(heads_of(two, batch, heads), heads_of(two, batch, heads), 3); },
      {"[kv_cache] appending 2 tokens at position 3 would exceed the capacity (4)", "reserve()"});
  unchanged();
  const RowMatrix<float> one = random_matrix<float>(batch, heads * dim, 23);
  expect_invalid([&] { cache.append(heads_of(one, batch, heads), heads_of(one, batch, heads), 2); },
                 "[kv_cache] position (2) goes backwards: the cache's next position is 3");
  unchanged();
  expect_invalid([&] { cache.append(heads_of(one, batch, heads), heads_of(one, batch, heads), 5); },
                 "[kv_cache] position (5) skips ahead: the cache's next position is 3");
  unchanged();
  const RowMatrix<float> wide_batch = random_matrix<float>(3, heads * dim, 24);
  expect_invalid(
      [&] { cache.append(heads_of(wide_batch, 3, heads), heads_of(wide_batch, 3, heads), 3); },
      "[kv_cache] chunk batch (k 3, v 3) must equal the cache's batch (2)");
  unchanged();
  const RowMatrix<float> other_heads = random_matrix<float>(batch, 3 * dim, 25);
  expect_invalid(
      [&] { cache.append(heads_of(other_heads, batch, 3), heads_of(other_heads, batch, 3), 3); },
      "[kv_cache] chunk heads (k 3, v 3) must equal the cache's num_kv_heads (2)");
  unchanged();
  expect_invalid([&] { KvCache<float>({1, 2, 3, 0}); }, "[kv_cache] capacity (0) must be >= 1");
  expect_invalid([&] { cache.truncate(4); }, "[kv_cache] truncate size (4) must lie in [0, 3]");
  unchanged();
}

TEST(KvCache, BadWindowAndLatentAppendsThrowAndLeaveTheCacheUnchanged) {
  SlidingWindowCache<double> ring({1, 2, 3, 4});
  const RowMatrix<double> six = random_matrix<double>(6, 6, 31);
  ring.append(heads_of(six, 1, 2), heads_of(six, 1, 2), 0);
  const RowMatrix<double> segment0 = apex::merge_heads(ring.segments()[0].keys);
  const RowMatrix<double> one = random_matrix<double>(1, 6, 32);
  expect_invalid(
      [&] { ring.append(heads_of(one, 1, 2), heads_of(one, 1, 2), 4); },
      "[sliding_window_cache] position (4) goes backwards: the cache's next position is 6");
  const RowMatrix<double> other = random_matrix<double>(2, 6, 33);
  expect_invalid([&] { ring.append(heads_of(other, 2, 2), heads_of(other, 2, 2), 6); },
                 "[sliding_window_cache] chunk batch (k 2, v 2) must equal the cache's batch (1)");
  EXPECT_EQ(ring.next_position(), 6);
  EXPECT_EQ(apex::merge_heads(ring.segments()[0].keys), segment0);
  expect_invalid(
      [&] {
        SlidingWindowCache<double>({1, 2, 3, 0});
      },
      "[sliding_window_cache] window (0) must be >= 1");

  LatentCache<double> latent({1, 4, 1, 2, 3});
  latent.append(random_matrix<double>(2, 6, 34), 0);
  const RowMatrix<double> rows_before = apex::merge_heads(latent.rows());
  expect_invalid([&] { latent.append(random_matrix<double>(2, 6, 35), 2); },
                 "[latent_cache] appending 2 tokens at position 2 would exceed the capacity (3)");
  expect_invalid([&] { latent.append(random_matrix<double>(1, 6, 36), 1); },
                 "[latent_cache] position (1) goes backwards");
  expect_invalid([&] { latent.append(random_matrix<double>(1, 5, 37), 2); },
                 "[latent_cache] rows width (5) must equal d_kv + H_kr*d_r (6)");
  expect_invalid(
      [&] { latent.append(random_matrix<double>(1, 4, 38), random_matrix<double>(1, 3, 39), 2); },
      "[latent_cache] k_rope width (3) must equal H_kr*d_r (2)");
  EXPECT_EQ(latent.next_position(), 2);
  EXPECT_EQ(apex::merge_heads(latent.rows()), rows_before);
  expect_invalid(
      [&] {
        LatentCache<double>({1, 4, 1, 3, 8});
      },
      "[latent_cache] rope_dim d_r (3) must be even");
}

TEST(KvCache, ChunksOfNegativeLengthAreRejected) {
  // A view may claim -1 rows; appending it used to pass every check and leave size() at -1.
  const float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const HeadsView<const float> negative(data, {1, 1, -1, 2}, {0, 0, 2});
  KvCache<float> cache({1, 1, 2, 4});
  const RowMatrix<float> two = random_matrix<float>(2, 2, 41);
  cache.append(heads_of(two, 1, 1), heads_of(two, 1, 1), 0);
  const RowMatrix<float> keys_before = apex::merge_heads(cache.keys());
  expect_invalid([&] { cache.append(negative, negative, 2); },
                 "[kv_cache] chunk length n (-1) must be >= 0");
  expect_invalid([&] { cache.check_append(negative, negative, 2); }, "[kv_cache] chunk length");
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(apex::merge_heads(cache.keys()), keys_before);

  SlidingWindowCache<float> ring({1, 1, 2, 3});
  ring.append(heads_of(two, 1, 1), heads_of(two, 1, 1), 0);
  const RowMatrix<float> held = apex::merge_heads(ring.segments()[0].keys);
  expect_invalid([&] { ring.append(negative, negative, 2); },
                 "[sliding_window_cache] chunk length n (-1) must be >= 0");
  EXPECT_EQ(ring.next_position(), 2);
  EXPECT_EQ(apex::merge_heads(ring.segments()[0].keys), held);
  // The attention over the ring checks the chunk the same way, before writing out.
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

TEST(KvCache, WindowPositionsBeyondTheIndexRangeAreRejected) {
  // The ring keeps W tokens, so nothing else bounds its next position: a chunk (here one row
  // repeated by a zero row stride) that would carry it past the largest Index is rejected.
  const Index max = std::numeric_limits<Index>::max();
  const RowMatrix<float> row = RowMatrix<float>::Constant(1, 2, 0.5f);
  SlidingWindowCache<float> ring({1, 1, 2, 3});
  const HeadsView<const float> almost_all(row.data(), {1, 1, max - 1, 2}, {0, 0, 0});
  ring.append(almost_all, almost_all, 0);
  ASSERT_EQ(ring.next_position(), max - 1);
  EXPECT_EQ(ring.size(), 3);
  const HeadsView<const float> two(row.data(), {1, 1, 2, 2}, {0, 0, 0});
  expect_invalid(
      [&] { ring.append(two, two, max - 1); },
      {"[sliding_window_cache] position + n (9223372036854775806 + 2)", "fit in 64 bits"});
  EXPECT_EQ(ring.next_position(), max - 1);
  // One more token still fits: its position is max - 1, the next is max.
  const HeadsView<const float> one(row.data(), {1, 1, 1, 2}, {0, 0, 0});
  ring.append(one, one, max - 1);
  EXPECT_EQ(ring.next_position(), max);
}

TEST(KvCache, WindowAttentionRejectsARuleTheRingCannotServe) {
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

// ---------------------------------------------------------------------------------------------
// §7.4, §8.3, §9.4, §10.3 for APEX-1 Large
// ---------------------------------------------------------------------------------------------

// The documents give H_q = 128, H_kv = 8, d_h = 128, d_kv = 512, W = 4096 and a 128K context for
// APEX-1 Large, FP16; they give no d_r (their range is 32-64): 64, as DeepSeek-V2/V3 use.
apex::CacheComparisonParams apex1_large(Index rope_heads) {
  apex::CacheComparisonParams p;
  p.num_q_heads = 128;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.latent_dim = 512;
  p.rope_dim = 64;
  p.rope_heads = rope_heads;
  p.window = 4096;
  p.context = 131072;
  p.batch = 1;
  p.bytes_per_value = 2;
  return p;
}

TEST(KvCache, S7_4_S8_3_S9_4_CacheTablesForApex1Large) {
  const auto rows = apex::cache_comparison(apex1_large(8));
  ASSERT_EQ(rows.size(), 6u);
  constexpr std::int64_t kGiB = std::int64_t{1} << 30;
  constexpr std::int64_t kMiB = std::int64_t{1} << 20;
  // §7.4 prints "4 GB per layer"; K and V take 2 × 131072 × 128 × 128 × 2 bytes = 8 GiB
  // (4 GiB is K alone) (SEED-NOTES.md).
  EXPECT_EQ(rows[0].method, "MHA");
  EXPECT_EQ(rows[0].values_per_token, 2 * 128 * 128);
  EXPECT_EQ(rows[0].bytes_per_layer, 8 * kGiB);
  EXPECT_EQ(rows[0].relative, 1.0);
  // §8.3: GQA with 8 KV heads 0.0625 (16× smaller), MQA 1/128 = 0.0078.
  EXPECT_EQ(rows[1].method, "GQA");
  EXPECT_EQ(rows[1].values_per_token, 2 * 8 * 128);
  EXPECT_EQ(rows[1].bytes_per_layer, 512 * kMiB);
  EXPECT_DOUBLE_EQ(rows[1].relative, 0.0625);
  EXPECT_EQ(rows[2].method, "MQA");
  EXPECT_EQ(rows[2].bytes_per_layer, 64 * kMiB);
  EXPECT_DOUBLE_EQ(rows[2].relative, 0.0078125);
  // §10.3: the window keeps 4096 of the 131072 tokens, 32× less than full GQA: 16 MiB.
  EXPECT_EQ(rows[3].method, "GQA + window");
  EXPECT_EQ(rows[3].bytes_per_layer, 16 * kMiB);
  EXPECT_DOUBLE_EQ(rows[3].relative, 1.0 / 512.0);
  EXPECT_EQ(rows[1].bytes_per_layer / rows[3].bytes_per_layer, 32);
  // §9.4 prints 1.6% for c_kv alone: 512 / 32768 = 1.5625%.
  EXPECT_EQ(rows[4].values_per_token, 512);
  EXPECT_EQ(rows[4].bytes_per_layer, 128 * kMiB);
  EXPECT_DOUBLE_EQ(rows[4].relative, 0.015625);
  // What MLA has to cache: c_kv and K_rope, 512 + 8·64 = 1024 values per token (3.125%) with
  // §9.3's H_kr = H_kv = 8, 512 + 64 = 576 (1.7578%) with one shared K_rope head (SEED-NOTES.md).
  EXPECT_EQ(rows[5].values_per_token, 1024);
  EXPECT_EQ(rows[5].bytes_per_layer, 256 * kMiB);
  EXPECT_DOUBLE_EQ(rows[5].relative, 0.03125);
  const auto shared = apex::cache_comparison(apex1_large(1));
  EXPECT_EQ(shared[5].values_per_token, 576);
  EXPECT_EQ(shared[5].bytes_per_layer, 144 * kMiB);
  EXPECT_DOUBLE_EQ(shared[5].relative, 576.0 / 32768.0);

  apex::CacheComparisonParams bad = apex1_large(1);
  bad.window = 0;
  expect_invalid([&] { apex::cache_comparison(bad); }, {"[cache_comparison]", "W 0"});
}

TEST(KvCache, WindowBytesAreCappedAtW) {
  EXPECT_EQ(apex::sliding_window_cache_bytes(1, 100, 4096, 8, 128, 2), 2 * 100 * 8 * 128 * 2);
  EXPECT_EQ(apex::sliding_window_cache_bytes(3, 1 << 20, 4096, 8, 128, 2),
            3LL * 2 * 4096 * 8 * 128 * 2);
}

TEST(KvCache, SizesBeyond64BitsAreRejectedNotWrapped) {
  // 2^62 · 4 wraps to 0 in 64 bits: a cache of that size would claim storage it does not have.
  const Index huge = Index{1} << 62;
  expect_invalid(
      [&] {
        KvCache<float>({1, huge, 4, 1});
      },
      {"[kv_cache] B*H*slots*d_h", "overflows 64 bits"});
  expect_invalid(
      [&] {
        SlidingWindowCache<float>({1, 4, 1, huge});
      },
      {"[sliding_window_cache]", "overflows 64 bits"});
  expect_invalid(
      [&] {
        LatentCache<float>({1, 1, huge, 4, 1});
      },
      {"[latent_cache] H_kr*d_r", "overflows 64 bits"});
  KvCache<float> cache({1, 4, 1, 2});
  expect_invalid([&] { cache.reserve(huge); }, {"[kv_cache]", "overflows 64 bits"});
  EXPECT_EQ(cache.capacity(), 2);
  LatentCache<float> latent({1, 2, 1, 2, 2});
  expect_invalid([&] { latent.reserve(huge); }, {"[latent_cache]", "overflows 64 bits"});
  EXPECT_EQ(latent.capacity(), 2);
  expect_invalid([&] { (void)apex::sliding_window_cache_bytes(huge, 8, 4, 1, 1, 2); },
                 {"[sliding_window_cache_bytes]", "overflows 64 bits"});
  // d_kv + H_kr·d_r = max + 1 does not fit.
  const Index max = std::numeric_limits<Index>::max();
  expect_invalid([&] { (void)apex::latent_cache_bytes(1, 1, max, 1, 1, 1); },
                 "[latent_cache_bytes] d_kv + H_kr*d_r");
  expect_invalid([&] { (void)apex::kv_cache_bytes(-1, 1, 1, 1, 2); },
                 "[kv_cache_bytes] 2*B*S*H_kv*d_h*bytes");
  apex::CacheComparisonParams p = apex1_large(8);
  p.num_q_heads = huge;
  expect_invalid([&] { (void)apex::cache_comparison(p); }, {"[cache_comparison]", "overflows"});
}

}  // namespace
