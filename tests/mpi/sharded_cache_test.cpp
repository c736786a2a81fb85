// SPDX-License-Identifier: MIT
// Sharded decoding (apex/distributed/sharded_cache.hpp): a prompt prefilled by ring attention and
// 200 decoded tokens, against a single-process KvCache with apex::sdpa and against the double
// reference; windows that leave ranks without keys, sinks, 16-bit storage; who holds what;
// bad input refused on every rank with nothing changed; empty and moved-from caches.
#include "mpi_test_util.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#include <apex/distributed/ring_attention.hpp>
#include <apex/distributed/sharded_cache.hpp>
#include <apex/kv_cache.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace mpi_sharded_cache_test {
namespace {

using apex::HeadsTensor;
using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::SdpaParams;
using apex::distributed::SequenceSharding;
using apex::distributed::ShardedCacheShape;
using apex::distributed::ShardedKvCache;
using apex::distributed::ShardLayout;
using apex::testing::world;

constexpr Index kBatch = 2, kQHeads = 4, kKvHeads = 2, kDim = 8, kPrompt = 37, kSteps = 200;

/// Prefills a prompt into a sharded cache and a single-process one, then decodes kSteps tokens
/// (K, V and q drawn alike on every rank), comparing every step's output and lse on every rank.
template <class Storage>
void decode_and_compare(const PositionMask& rule, const SdpaParams& params, Index decode_block) {
  const auto me = world();
  const SequenceSharding sharding(kPrompt, me.size, ShardLayout::kZigzag);
  const auto k = apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, kDim, 5);
  const auto v = apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, kDim, 6);
  ShardedKvCache<float, Storage> sharded(
      MPI_COMM_WORLD, ShardedCacheShape{kBatch, kKvHeads, kDim, kPrompt + kSteps, decode_block});
  sharded.load_prompt(sharding, apex::distributed::shard_rows(k.view(), sharding, me.rank).view(),
                      apex::distributed::shard_rows(v.view(), sharding, me.rank).view());
  apex::KvCache<float, Storage> whole({kBatch, kKvHeads, kDim, kPrompt + kSteps});
  whole.append(k.view(), v.view(), 0);

  constexpr double tol = apex::testing::Tolerances<float>::kAttention;
  std::mt19937 rng(77);
  for (Index step = 0; step < kSteps; ++step) {
    const Index position = kPrompt + step;
    const auto k1 = apex::testing::random_heads<float>(kBatch, kKvHeads, 1, kDim, rng);
    const auto v1 = apex::testing::random_heads<float>(kBatch, kKvHeads, 1, kDim, rng);
    auto q = apex::testing::random_heads<float>(kBatch, kQHeads, 1, kDim, rng);
    sharded.append(k1.view(), v1.view(), position);
    whole.append(k1.view(), v1.view(), position);
    if (me.rank != 0) q = HeadsTensor<float>(q.view().shape());  // only rank 0 has it
    apex::distributed::broadcast(MPI_COMM_WORLD, q.view(), 0);

    HeadsTensor<float> out({kBatch, kQHeads, 1, kDim}), lse({kBatch, kQHeads, 1, 1});
    sharded.attend(q.view(), rule, params, out.view(), lse.view());
    HeadsTensor<float> want({kBatch, kQHeads, 1, kDim}), want_lse({kBatch, kQHeads, 1, 1});
    apex::sdpa(q.view(), whole.keys(), whole.values(), apex::AttentionMask<float>{rule, {}, {}},
               params, want.view(), want_lse.view());
    apex::testing::expect_normwise(out.view(), want.view(), tol);
    apex::testing::expect_normwise(lse.view(), want_lse.view(), tol);
    if (step % 50 == 0) {  // and the double reference, now and then
      HeadsTensor<double> exact({kBatch, kQHeads, 1, kDim}), exact_lse({kBatch, kQHeads, 1, 1});
      apex::reference::sdpa(q.view(), whole.keys(), whole.values(),
                            apex::AttentionMask<double>{rule, {}, {}}, params, exact.view(),
                            exact_lse.view());
      apex::testing::expect_normwise(out.view(), exact.view(), tol);
      apex::testing::expect_normwise(lse.view(), exact_lse.view(), tol);
    }
  }
  // Every position is held once: the counts add up, and each rank knows the others'.
  Index held = 0;
  for (int r = 0; r < me.size; ++r) held += sharded.length_of(r);
  EXPECT_EQ(held, kPrompt + kSteps);
  EXPECT_EQ(sharded.length_of(me.rank), sharded.local_length());
  EXPECT_EQ(sharded.length(), kPrompt + kSteps);
}

PositionMask causal() {
  PositionMask m;
  m.causal = true;
  return m;
}

TEST(ShardedDecode, TwoHundredTokensEqualSingleProcessDecode) {
  decode_and_compare<float>(causal(), {}, 16);
}

TEST(ShardedDecode, AWindowThatLeavesRanksWithoutKeys) {
  PositionMask rule = causal();
  rule.window = 20;  // inside one or two blocks: most ranks hold no visible key
  decode_and_compare<float>(rule, {}, 8);
}

TEST(ShardedDecode, SinksAlibiAndPrefix) {
  SdpaParams params;
  params.sinks = {1.0, -0.5, 0.0, 3.0};
  params.alibi_slopes = apex::alibi_slopes(kQHeads);
  PositionMask rule = causal();
  rule.prefix = 10;
  decode_and_compare<float>(rule, params, 64);
}

TEST(ShardedDecode, HalfAndBfloat16Storage) {
  decode_and_compare<Eigen::half>(causal(), {}, 32);
  decode_and_compare<Eigen::bfloat16>(causal(), {}, 1);
}

TEST(ShardedDecode, DecodedTokensAreDealtInBlocks) {
  const auto me = world();
  ShardedKvCache<float> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 1, 4, 64, 3});
  const SequenceSharding sharding(2 * me.size, me.size, ShardLayout::kZigzag);
  const auto k = apex::testing::random_heads<float>(1, 1, 2 * me.size, 4, 1);
  cache.load_prompt(sharding, apex::distributed::shard_rows(k.view(), sharding, me.rank).view(),
                    apex::distributed::shard_rows(k.view(), sharding, me.rank).view());
  const auto more = apex::testing::random_heads<float>(1, 1, 12, 4, 2);
  cache.append(more.view(), more.view(), 2 * me.size);
  for (Index p = 2 * me.size; p < 2 * me.size + 12; ++p) {
    EXPECT_EQ(cache.owner_of(p), int((p / 3) % me.size));
  }
  Index mine = 0;
  for (Index p = 2 * me.size; p < 2 * me.size + 12; ++p) mine += cache.owner_of(p) == me.rank;
  EXPECT_EQ(cache.local_length(), 2 + mine);
  for (const auto& run : cache.runs()) {  // runs are ordered and each holds its own positions
    for (Index i = 0; i < run.count; ++i) {
      EXPECT_TRUE(run.position + i < 2 * me.size || cache.owner_of(run.position + i) == me.rank);
    }
  }
}

TEST(ShardedDecode, BadInputOnOneRankIsRefusedOnEveryRank) {
  const auto me = world();
  const int last = me.size - 1;
  ShardedKvCache<float> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 2, 4, 8, 4});
  const SequenceSharding sharding(me.size, me.size, ShardLayout::kContiguous);
  const auto kv = apex::testing::random_heads<float>(1, 2, 1, 4, 3);
  // The last rank's shard has the wrong width.
  const auto wrong = apex::testing::random_heads<float>(1, 2, 1, 5, 3);
  apex::testing::expect_invalid(
      [&] {
        cache.load_prompt(sharding, me.rank == last ? wrong.view() : kv.view(),
                          me.rank == last ? wrong.view() : kv.view());
      },
      {"[sharded_kv_cache] k chunk [1, 2, n, 5] must be",
       "(on rank " + std::to_string(last) + ")"});
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.local_length(), 0);
  cache.load_prompt(sharding, kv.view(), kv.view());

  // A query of other heads on the last rank: every rank refuses, no output written.
  const auto q = apex::testing::random_heads<float>(1, 2, 1, 4, 4);
  const auto q3 = apex::testing::random_heads<float>(1, 4, 1, 4, 4);
  HeadsTensor<float> out2({1, 2, 1, 4}), out4({1, 4, 1, 4});
  out2.data()[0] = 9.0f;
  out4.data()[0] = 9.0f;
  if (me.size > 1) {
    apex::testing::expect_invalid(
        [&] {
          if (me.rank == last) {
            cache.attend(q3.view(), causal(), {}, out4.view());
          } else {
            cache.attend(q.view(), causal(), {}, out2.view());
          }
        },
        {"[sharded_kv_cache] query heads must be the same on every rank"});
    EXPECT_EQ(out2.data()[0], 9.0f);
    EXPECT_EQ(out4.data()[0], 9.0f);
  }
  // More tokens than all ranks have room for are refused everywhere; so is a chunk that fits
  // in all but overflows one rank (a rank gets its ninth position before the others are full),
  // and no rank's count moves.
  const auto many = apex::testing::random_heads<float>(1, 2, 7 * me.size + 1, 4, 5);
  apex::testing::expect_invalid(
      [&] { cache.append(many.view(), many.view(), me.size); },
      {"appending " + std::to_string(7 * me.size + 1) + " tokens",
       "would exceed the capacity (8 per rank)", std::to_string(7 * me.size) + " positions free"});
  EXPECT_EQ(cache.length(), me.size);
  std::vector<Index> held(static_cast<std::size_t>(me.size), 1);
  Index overflowing = 0;  // tokens from position P on until some rank would get a ninth
  for (bool fits = true; fits; ++overflowing) {
    fits = ++held[static_cast<std::size_t>(cache.owner_of(me.size + overflowing))] <= 8;
  }
  if (overflowing <= 7 * me.size) {
    const auto some = apex::testing::random_heads<float>(1, 2, overflowing, 4, 5);
    apex::testing::expect_invalid([&] { cache.append(some.view(), some.view(), me.size); },
                                  "would exceed its capacity (8)");
  }
  EXPECT_EQ(cache.length(), me.size);
  apex::testing::expect_invalid([&] { cache.append(kv.view(), kv.view(), me.size + 1); },
                                "skips ahead");
  // A rule with keys at an offset is refused (collectively), nothing written.
  PositionMask shifted = causal();
  shifted.key_offset = 2;
  apex::testing::expect_invalid([&] { cache.attend(q.view(), shifted, {}, out2.view()); },
                                "key_offset (2) must be 0");
  EXPECT_EQ(out2.data()[0], 9.0f);
}

TEST(ShardedDecode, EmptyAndMovedFromCachesAreValid) {
  ShardedKvCache<float> none;
  EXPECT_EQ(none.length(), 0);
  EXPECT_EQ(none.ranks(), 1);
  EXPECT_EQ(none.bytes(), 0);
  const auto kv = apex::testing::random_heads<float>(1, 1, 1, 4, 3);
  apex::testing::expect_invalid([&] { none.append(kv.view(), kv.view(), 0); }, "is empty");
  ShardedKvCache<float> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 1, 4, 8, 4});
  cache.append(kv.view(), kv.view(), 0);
  ShardedKvCache<float> moved = std::move(cache);
  EXPECT_EQ(moved.length(), 1);
  EXPECT_EQ(cache.length(), 0);  // NOLINT(bugprone-use-after-move): moved-from is valid
  EXPECT_EQ(cache.bytes(), 0);
  apex::testing::expect_invalid([&] { cache.append(kv.view(), kv.view(), 0); }, "is empty");
}

// Unchecked arithmetic on user-given sizes (hardening class 2): each of these sizes was formed
// with plain signed arithmetic, which overflowed (undefined behaviour) or wrapped to a count
// that passed the checks after it, or was truncated to MPI's int count. The views of huge
// shapes are never read (the checks come first), so they view one float.

TEST(Communicator, UncheckedArithmetic_HugeBroadcastIsRejectedOnEveryRank) {
  float dummy = 0.0f;
  // 2^62 + 1 floats: the byte count wrapped to 4, which passed the one-message check.
  const Index huge = (Index{1} << 62) + 1;
  const HeadsView<float> wrapped(&dummy, {1, 1, 1, huge}, {huge, huge, huge});
  apex::testing::expect_invalid(
      [&] { apex::distributed::broadcast(MPI_COMM_WORLD, wrapped, 0); },
      {"[broadcast] view bytes B*H*S*D*sizeof(T)", "overflows 64 bits", "(on rank 0)"});
  // 2^31 bytes: within 64 bits, above one MPI message (an int count): rejected, not truncated.
  const Index big = Index{1} << 29;
  const HeadsView<float> message(&dummy, {1, 1, 1, big}, {big, big, big});
  apex::testing::expect_invalid(
      [&] { apex::distributed::broadcast(MPI_COMM_WORLD, message, 0); },
      {"[broadcast] the view's 2147483648 bytes exceed one MPI message", "(on rank 0)"});
  EXPECT_EQ(dummy, 0.0f);
}

TEST(ShardedDecode, UncheckedArithmetic_HugeAppendIsRejected) {
  // The n tokens were dealt to their owners one by one before any capacity was checked, so a
  // huge n was a hang of n steps (and the length, 1 + n, would overflow for the largest).
  const auto me = world();
  ShardedKvCache<float> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 1, 4, 8, 4});
  const auto one = apex::testing::random_heads<float>(1, 1, 1, 4, 3);
  cache.append(one.view(), one.view(), 0);
  float dummy = 0.0f;
  for (const Index n : {Index{1} << 62, std::numeric_limits<Index>::max()}) {
    const HeadsView<const float> kv(&dummy, {1, 1, n, 4}, {0, 0, 0});
    apex::testing::expect_invalid(
        [&] { cache.append(kv, kv, 1); },
        {"[sharded_kv_cache] appending " + std::to_string(n) + " tokens at position 1",
         "would exceed the capacity (8 per rank) of all " + std::to_string(me.size) + " ranks",
         std::to_string(8 * me.size - 1) + " positions free"});
  }
  EXPECT_EQ(cache.length(), 1);
}

TEST(ShardedDecode, UncheckedArithmetic_RecordsBeyondOneMpiMessageAreRejectedOnEveryRank) {
  // B·H_q·S_q·(d_v + 2) doubles go to MPI_Allgather with an int count: 2^29 queries of width 4
  // make 3·2^30 records, which the count truncated.
  ShardedKvCache<float> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 1, 4, 8, 4});
  const auto one = apex::testing::random_heads<float>(1, 1, 1, 4, 3);
  cache.append(one.view(), one.view(), 0);
  float dummy = 0.0f;
  const Index queries = Index{1} << 29;
  const HeadsView<const float> q(&dummy, {1, 1, queries, 4}, {0, 0, 0});
  const HeadsView<float> out(&dummy, {1, 1, queries, 4}, {0, 0, 4});
  apex::testing::expect_invalid(
      [&] { cache.attend(q, PositionMask{}, {}, out); },
      {"[sharded_kv_cache] the records of B*H_q*S_q*(d_v + 2) = 3221225472 doubles exceed one "
       "MPI message",
       "(on rank 0)"});
  EXPECT_EQ(dummy, 0.0f);
}

}  // namespace
}  // namespace mpi_sharded_cache_test
