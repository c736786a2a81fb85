// SPDX-License-Identifier: MIT
// Tests of include/apex/kv_cache.hpp: the decoding caches KvCache, SlidingWindowCache and
// LatentCache. (Attention over a cache is tested in cached_attention_test.cpp, the cache-size
// formulas of §7.4, §8.3, §9.4 and §10.3 in cache_memory_test.cpp.)
#include <apex/cache_memory.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mha.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "test_util.hpp"

namespace kv_cache_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::KvCache;
using apex::LatentCache;
using apex::RowMatrix;
using apex::SlidingWindowCache;
using apex::testing::chunk_of;
using apex::testing::expect_invalid;
using apex::testing::heads_of;
using apex::testing::random_matrix;

template <class Scalar>
class KvCacheTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(KvCacheTyped, Scalars, apex::testing::ScalarName);

// Row `position` of head (b, h) of the whole history [B*T, H*d] (token-major, T tokens).
template <class Scalar>
auto history_row(const RowMatrix<Scalar>& history, Index total, Index b, Index h, Index dim,
                 Index position) {
  return history.row(b * total + position).segment(h * dim, dim);
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
  // (The attention over the ring checks the chunk the same way: cached_attention_test.cpp.)
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
  // (The size formulas of apex/cache_memory.hpp: cache_memory_test.cpp.)
}

// ---------------------------------------------------------------------------------------------
// 16-bit storage: KvCache<float, T>, SlidingWindowCache<float, T>, LatentCache<float, T>
// ---------------------------------------------------------------------------------------------

template <class T>
class Cache16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Cache16Bit, SixteenBit, apex::testing::ScalarName);

/// Whether every element of a [B, H, S, D] view of T is the element of `from` rounded once.
template <class T, class Scalar>
bool holds_rounded(const HeadsView<const T>& stored, const HeadsView<const Scalar>& from) {
  if (stored.shape() != from.shape()) return false;
  for (Index b = 0; b < from.batch(); ++b) {
    for (Index h = 0; h < from.heads(); ++h) {
      for (Index s = 0; s < from.seq(); ++s) {
        for (Index d = 0; d < from.dim(); ++d) {
          const T want = apex::round_to<T>(from.head(b, h)(s, d));
          if (Eigen::numext::bit_cast<std::uint16_t>(stored.head(b, h)(s, d)) !=
              Eigen::numext::bit_cast<std::uint16_t>(want)) {
            return false;
          }
        }
      }
    }
  }
  return true;
}

TYPED_TEST(Cache16Bit, KvCacheRoundsOnceAndOwnsHalfTheBytes) {
  using T = TypeParam;
  constexpr Index kB = 2, kH = 3, kD = 5, kC = 9;
  const RowMatrix<double> history = random_matrix<double>(kB * 10, kH * kD, 31);  // 10 > C tokens
  KvCache<double, T> cache({kB, kH, kD, kC});
  static_assert(std::is_same_v<typename KvCache<double, T>::StorageType, T>);
  EXPECT_EQ(cache.bytes(), 2 * kB * kH * kC * kD * static_cast<std::int64_t>(sizeof(T)));
  EXPECT_EQ(cache.bytes() * 4, KvCache<double>({kB, kH, kD, kC}).bytes());
  const RowMatrix<double> first = chunk_of(history, kB, 0, 4);
  const RowMatrix<double> values = -first;
  cache.append(heads_of(first, kB, kH), heads_of(values, kB, kH), 0);
  EXPECT_TRUE(holds_rounded(cache.keys(), heads_of(first, kB, kH)));
  EXPECT_TRUE(holds_rounded(cache.values(), heads_of(values, kB, kH)));
  // Full: throws and keeps what it holds.
  const RowMatrix<double> rest = chunk_of(history, kB, 4, 6);
  expect_invalid([&] { cache.append(heads_of(rest, kB, kH), heads_of(rest, kB, kH), 4); },
                 "capacity");
  EXPECT_EQ(cache.size(), 4);
  EXPECT_TRUE(holds_rounded(cache.keys(), heads_of(first, kB, kH)));
  // reserve() keeps the rounded values exactly.
  cache.reserve(20);
  EXPECT_EQ(cache.bytes(), 2 * kB * kH * 20 * kD * static_cast<std::int64_t>(sizeof(T)));
  EXPECT_TRUE(holds_rounded(cache.keys(), heads_of(first, kB, kH)));
  cache.append(heads_of(rest, kB, kH), heads_of(rest, kB, kH), 4);
  EXPECT_TRUE(holds_rounded(cache.keys(), heads_of(chunk_of(history, kB, 0, 10), kB, kH)));
}

TYPED_TEST(Cache16Bit, SlidingWindowCacheRingHoldsRoundedTokens) {
  using T = TypeParam;
  constexpr Index kB = 1, kH = 2, kD = 4, kW = 5;
  const RowMatrix<float> history = random_matrix<float>(kB * 13, kH * kD, 32);
  SlidingWindowCache<float, T> ring({kB, kH, kD, kW});
  EXPECT_EQ(ring.bytes(), 2 * kB * kH * kW * kD * static_cast<std::int64_t>(sizeof(T)));
  const RowMatrix<float> chunk = chunk_of(history, kB, 0, 13);
  ring.append(heads_of(chunk, kB, kH), heads_of(chunk, kB, kH), 0);
  // Positions 8..12 are held, as runs [10, 12] in slots 0..2... oldest first.
  const auto runs = ring.segments();
  Index position = 8;
  for (const auto& run : runs) {
    if (run.keys.seq() == 0) continue;
    EXPECT_EQ(run.first_position, position);
    const RowMatrix<float> held = chunk_of(history, kB, position, run.keys.seq());
    EXPECT_TRUE(holds_rounded(run.keys, heads_of(held, kB, kH)));
    EXPECT_TRUE(holds_rounded(run.values, heads_of(held, kB, kH)));
    position += run.keys.seq();
  }
  EXPECT_EQ(position, 13);
}

TYPED_TEST(Cache16Bit, LatentCacheRowsAreRoundedOnce) {
  using T = TypeParam;
  const apex::LatentCacheShape shape{2, 6, 1, 4, 8};
  LatentCache<float, T> cache(shape);
  EXPECT_EQ(cache.bytes(), 2 * 8 * 10 * static_cast<std::int64_t>(sizeof(T)));
  const RowMatrix<float> c_kv = random_matrix<float>(2 * 3, 6, 33);
  const RowMatrix<float> k_rope = random_matrix<float>(2 * 3, 4, 34);
  cache.append(c_kv, k_rope, 0);
  RowMatrix<float> whole(2 * 3, 10);
  whole << c_kv, k_rope;
  EXPECT_TRUE(holds_rounded(cache.rows(),
                            HeadsView<const float>::token_major(whole.data(), {2, 1, 3, 10})));
  const RowMatrix<float> more = random_matrix<float>(2 * 6, 10, 35);
  expect_invalid([&] { cache.append(more, 3); }, {"capacity"});
  EXPECT_EQ(cache.size(), 3);
  cache.reserve(12);
  cache.append(more, 3);
  EXPECT_EQ(cache.size(), 9);
}

}  // namespace
}  // namespace kv_cache_test
