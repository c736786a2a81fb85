// SPDX-License-Identifier: MIT
// Ring attention (apex/distributed/ring_attention.hpp) against the double reference of the whole
// sequence, on every rank count the test is run with: every rule, GQA, d_v != d_qk, lengths not
// divisible by P, both layouts, 16-bit K/V, sinks and ALiBi; the bytes sent against the model;
// bad input on one rank thrown on every rank, with the outputs untouched.
#include "mpi_test_util.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#include <apex/distributed/ring_attention.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace mpi_ring_attention_test {
namespace {

using apex::HeadsTensor;
using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::SdpaParams;
using apex::distributed::SequenceSharding;
using apex::distributed::ShardLayout;
using apex::testing::world;

/// One whole-sequence problem, the same on every rank (one seed).
struct WholeSequence {
  Index batch = 2, q_heads = 4, kv_heads = 2, d_qk = 16, d_v = 8, length = 37;
  HeadsTensor<float> q, k, v;

  WholeSequence& draw(std::uint32_t seed) {
    q = apex::testing::random_heads<float>(batch, q_heads, length, d_qk, seed);
    k = apex::testing::random_heads<float>(batch, kv_heads, length, d_qk, seed + 1);
    v = apex::testing::random_heads<float>(batch, kv_heads, length, d_v, seed + 2);
    return *this;
  }
};

/// The reference out and lse of the whole sequence, in double.
struct Expected {
  HeadsTensor<double> out, lse;
};

Expected reference(const WholeSequence& w, const PositionMask& rule, const SdpaParams& params) {
  Expected e{HeadsTensor<double>({w.batch, w.q_heads, w.length, w.d_v}),
             HeadsTensor<double>({w.batch, w.q_heads, w.length, 1})};
  apex::reference::sdpa(w.q.view(), w.k.view(), w.v.view(),
                        apex::AttentionMask<double>{rule, {}, {}}, params, e.out.view(),
                        e.lse.view());
  return e;
}

/// Runs ring attention on this rank's shard of `w` (K/V stored as KV) and checks its rows
/// against the reference and its bytes against the model. Returns this rank's output.
template <class KV = float>
HeadsTensor<float> check_ring(const WholeSequence& w, ShardLayout layout, const PositionMask& rule,
                              const SdpaParams& params = {}) {
  const auto me = world();
  const SequenceSharding sharding(w.length, me.size, layout);
  const auto q = apex::distributed::shard_rows(w.q.view(), sharding, me.rank);
  HeadsTensor<KV> k_store({w.batch, w.kv_heads, w.length, w.d_qk});
  HeadsTensor<KV> v_store({w.batch, w.kv_heads, w.length, w.d_v});
  for (Index i = 0; i < w.k.view().shape().batch * w.kv_heads * w.length * w.d_qk; ++i) {
    k_store.data()[i] = apex::round_to<KV>(w.k.data()[i]);
  }
  for (Index i = 0; i < w.batch * w.kv_heads * w.length * w.d_v; ++i) {
    v_store.data()[i] = apex::round_to<KV>(w.v.data()[i]);
  }
  const auto k = apex::distributed::shard_rows(k_store.view(), sharding, me.rank);
  const auto v = apex::distributed::shard_rows(v_store.view(), sharding, me.rank);
  const Index rows = sharding.local_length(me.rank);
  HeadsTensor<float> out({w.batch, w.q_heads, rows, w.d_v});
  HeadsTensor<float> lse({w.batch, w.q_heads, rows, 1});
  const apex::distributed::Traffic traffic = apex::distributed::ring_attention(
      MPI_COMM_WORLD, sharding, q.view(), k.view(), v.view(), rule, params, out.view(), lse.view());

  // The reference sees the very K/V the ring does (rounded to KV).
  WholeSequence rounded = w;
  for (Index i = 0; i < w.batch * w.kv_heads * w.length * w.d_qk; ++i) {
    rounded.k.data()[i] = float(k_store.data()[i]);
  }
  for (Index i = 0; i < w.batch * w.kv_heads * w.length * w.d_v; ++i) {
    rounded.v.data()[i] = float(v_store.data()[i]);
  }
  const Expected e = reference(rounded, rule, params);
  const auto expected_out = apex::distributed::shard_rows(e.out.view(), sharding, me.rank);
  const auto expected_lse = apex::distributed::shard_rows(e.lse.view(), sharding, me.rank);
  constexpr double tol = apex::testing::Tolerances<float>::kAttention;
  apex::testing::expect_normwise(out.view(), expected_out.view(), tol);
  apex::testing::expect_normwise(lse.view(), expected_lse.view(), tol);

  const std::int64_t row_bytes =
      w.batch * w.kv_heads * (w.d_qk * Index(sizeof(KV)) + w.d_v * Index(sizeof(KV)));
  EXPECT_EQ(traffic.bytes_sent, apex::distributed::ring_bytes_sent(
                                    sharding, rule, row_bytes)[static_cast<std::size_t>(me.rank)]);
  return out;
}

PositionMask causal() {
  PositionMask m;
  m.causal = true;
  return m;
}

TEST(RingAttention, NoMaskEqualsSdpaOnEitherLayout) {
  WholeSequence w;
  w.draw(11);
  check_ring(w, ShardLayout::kContiguous, {});
  check_ring(w, ShardLayout::kZigzag, {});
}

TEST(RingAttention, CausalZigzagEqualsSdpa) {
  WholeSequence w;
  w.draw(21);
  check_ring(w, ShardLayout::kZigzag, causal());
  check_ring(w, ShardLayout::kContiguous, causal());
}

TEST(RingAttention, SlidingWindowEqualsSdpa) {
  WholeSequence w;
  w.draw(31);
  PositionMask rule = causal();
  rule.window = 5;
  check_ring(w, ShardLayout::kContiguous, rule);
  check_ring(w, ShardLayout::kZigzag, rule);
}

TEST(RingAttention, PrefixChunksAndDocumentsEqualSdpa) {
  WholeSequence w;
  w.draw(41);
  PositionMask prefix = causal();
  prefix.prefix = 9;
  prefix.window = 12;
  check_ring(w, ShardLayout::kZigzag, prefix);
  PositionMask chunked = causal();
  chunked.chunk = 7;
  check_ring(w, ShardLayout::kContiguous, chunked);
  std::vector<Index> ids(static_cast<std::size_t>(w.length + 3));
  for (std::size_t p = 0; p < ids.size(); ++p) ids[p] = Index(p) / 10;
  PositionMask documents = causal();
  documents.documents = apex::DocumentIds(ids);
  documents.key_offset = 3;  // positions 3 .. 39
  check_ring(w, ShardLayout::kZigzag, documents);
}

TEST(RingAttention, SinksAlibiSoftcapAndScaleEqualSdpa) {
  WholeSequence w;
  w.draw(51);
  SdpaParams params;
  params.sinks = {0.5, -1.0, 2.0, 0.0};
  params.alibi_slopes = apex::alibi_slopes(w.q_heads);
  params.softcap = 3.0;
  params.scale = 0.4;
  check_ring(w, ShardLayout::kZigzag, causal(), params);
}

TEST(RingAttention, SixteenBitKeysAndValuesEqualSdpa) {
  WholeSequence w;
  w.draw(61);
  check_ring<Eigen::half>(w, ShardLayout::kZigzag, causal());
  check_ring<Eigen::bfloat16>(w, ShardLayout::kContiguous, {});
}

TEST(RingAttention, ShortestSequencesEachLayoutServes) {
  const auto me = world();
  WholeSequence w;
  w.length = 2 * me.size;  // one position per zigzag chunk
  w.draw(71);
  check_ring(w, ShardLayout::kZigzag, causal());
  w.length = me.size;  // one per contiguous chunk
  w.draw(72);
  check_ring(w, ShardLayout::kContiguous, causal());
}

TEST(RingAttention, BytesSentFollowTheRingModel) {
  // Independent of ring_bytes_sent: the unmasked ring forwards every shard P − 1 hops, so rank
  // r sends every shard but its successor's; a window narrower than a chunk only needs the
  // shard of the previous rank, so rank r sends its own (none for the last rank).
  const auto me = world();
  const SequenceSharding contiguous(37, me.size, ShardLayout::kContiguous);
  const std::int64_t row = 2 * 2 * (16 + 8) * 4;
  const int next = (me.rank + 1) % me.size;
  EXPECT_EQ(
      apex::distributed::ring_bytes_sent(contiguous, {}, row)[static_cast<std::size_t>(me.rank)],
      me.size == 1 ? 0 : row * (37 - contiguous.local_length(next)));
  PositionMask window = causal();
  window.window = 5;
  EXPECT_EQ(apex::distributed::ring_bytes_sent(contiguous, window,
                                               row)[static_cast<std::size_t>(me.rank)],
            me.rank + 1 < me.size ? row * contiguous.local_length(me.rank) : 0);
  const auto plan = apex::distributed::ring_plan(contiguous, window);
  EXPECT_EQ(plan.steps, me.size == 1 ? 1 : 2);
  // Causal zigzag: every rank's late chunk sees every other rank's early chunk, so every shard
  // goes P − 1 hops, as without a mask.
  const SequenceSharding zigzag(37, me.size, ShardLayout::kZigzag);
  EXPECT_EQ(apex::distributed::ring_bytes_sent(zigzag, causal(), row)[std::size_t(me.rank)],
            me.size == 1 ? 0 : row * (37 - zigzag.local_length(next)));
  EXPECT_EQ(apex::distributed::ring_plan(zigzag, causal()).steps, me.size);
}

#ifdef _OPENMP
TEST(RingAttention, BitIdenticalForAnyNumberOfThreads) {
  WholeSequence w;
  w.length = 300;
  w.draw(81);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const HeadsTensor<float> one = check_ring(w, ShardLayout::kZigzag, causal());
  omp_set_num_threads(2);
  const HeadsTensor<float> two = check_ring(w, ShardLayout::kZigzag, causal());
  omp_set_num_threads(threads);
  const Index n = one.batch() * one.heads() * one.seq() * one.dim();
  EXPECT_TRUE(std::equal(one.data(), one.data() + n, two.data()));
}
#endif

/// Runs ring attention where `spoil(rank, q, k, v, out)` may alter this rank's arguments, and
/// expects std::invalid_argument with every part of the message on every rank, the output
/// unchanged.
template <class Spoil>
void expect_rejected_everywhere(const Spoil& spoil, const std::vector<std::string>& parts) {
  const auto me = world();
  WholeSequence w;
  w.draw(91);
  const SequenceSharding sharding(w.length, me.size, ShardLayout::kZigzag);
  HeadsTensor<float> q = apex::distributed::shard_rows(w.q.view(), sharding, me.rank);
  HeadsTensor<float> k = apex::distributed::shard_rows(w.k.view(), sharding, me.rank);
  HeadsTensor<float> v = apex::distributed::shard_rows(w.v.view(), sharding, me.rank);
  HeadsTensor<float> out({w.batch, w.q_heads, q.seq(), w.d_v});
  SequenceSharding used = sharding;
  spoil(me.rank, q, k, v, out, used);
  for (Index i = 0; i < out.batch() * out.heads() * out.seq() * out.dim(); ++i) {
    out.data()[i] = 7.0f;
  }
  apex::testing::expect_invalid(
      [&] {
        apex::distributed::ring_attention(MPI_COMM_WORLD, used, q.view(), k.view(), v.view(),
                                          causal(), {}, out.view());
      },
      parts);
  const Index n = out.batch() * out.heads() * out.seq() * out.dim();
  EXPECT_TRUE(std::all_of(out.data(), out.data() + n, [](float x) { return x == 7.0f; }));
}

TEST(RingAttention, ShapesThatDifferAcrossRanksThrowOnEveryRank) {
  const auto me = world();
  if (me.size == 1) GTEST_SKIP() << "needs two ranks";
  // The last rank's values are wider: each rank's own shapes agree, the ranks do not.
  expect_rejected_everywhere(
      [&](int rank, HeadsTensor<float>&, HeadsTensor<float>&, HeadsTensor<float>& v,
          HeadsTensor<float>& out, SequenceSharding&) {
        if (rank != me.size - 1) return;
        v = HeadsTensor<float>({v.batch(), v.heads(), v.seq(), v.dim() + 1});
        out = HeadsTensor<float>({out.batch(), out.heads(), out.seq(), out.dim() + 1});
      },
      {"[ring_attention] d_v must be the same on every rank", "rank 0 has 8"});
}

TEST(RingAttention, ABadShardOnOneRankThrowsOnEveryRank) {
  const auto me = world();
  const int last = me.size - 1;
  expect_rejected_everywhere(
      [&](int rank, HeadsTensor<float>&, HeadsTensor<float>& k, HeadsTensor<float>&,
          HeadsTensor<float>&, SequenceSharding&) {
        if (rank == last) k = HeadsTensor<float>({k.batch(), k.heads(), k.seq() - 1, k.dim()});
      },
      {"[ring_attention] q, k, v rows", "(on rank " + std::to_string(last) + ")"});
}

TEST(RingAttention, AShardingForAnotherRankCountThrowsOnEveryRank) {
  const auto me = world();
  expect_rejected_everywhere(
      [&](int, HeadsTensor<float>&, HeadsTensor<float>&, HeadsTensor<float>&, HeadsTensor<float>&,
          SequenceSharding& s) { s = SequenceSharding(37, me.size + 1, ShardLayout::kZigzag); },
      {"sharding ranks (" + std::to_string(me.size + 1) + ")", "communicator's size"});
}

TEST(RingAttention, ShardingThatCannotServeTheRanksIsRejected) {
  const auto me = world();
  apex::testing::expect_invalid(
      [&] { SequenceSharding(2 * me.size - 1, me.size, ShardLayout::kZigzag); },
      {"[sequence_sharding]", "cannot be split into " + std::to_string(2 * me.size)});
  apex::testing::expect_invalid([&] { SequenceSharding(10, 0, ShardLayout::kContiguous); },
                                "ranks (0) must be >= 1");
  const SequenceSharding none;
  EXPECT_EQ(none.ranks(), 1);
  EXPECT_EQ(none.local_length(0), 0);
}

TEST(RingAttention, ZigzagShardsAreOneEarlyAndOneLateChunk) {
  const SequenceSharding s(10, 2, ShardLayout::kZigzag);
  const auto r0 = s.chunks(0);
  const auto r1 = s.chunks(1);
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_EQ(r0[0].begin, 0);
  EXPECT_EQ(r0[0].end, 3);
  EXPECT_EQ(r0[1].begin, 8);
  EXPECT_EQ(r0[1].end, 10);
  EXPECT_EQ(r1[0].begin, 3);
  EXPECT_EQ(r1[0].end, 6);
  EXPECT_EQ(r1[1].begin, 6);
  EXPECT_EQ(r1[1].end, 8);
  EXPECT_EQ(s.local_length(0), 5);
  EXPECT_EQ(s.local_length(1), 5);
}

// Unchecked arithmetic on user-given sizes (hardening class 2): each of these sizes was formed
// with plain signed arithmetic, which overflowed (undefined behaviour) or wrapped to a small
// count that passed the checks after it.

TEST(RingAttention, UncheckedArithmetic_RingBytesSentOverflowIsRejected) {
  // Needs no MPI, so any rank count: P = 2, contiguous, every shard one hop.
  const SequenceSharding two(37, 2, ShardLayout::kContiguous);
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max() / 4;
  apex::testing::expect_invalid(
      [&] { apex::distributed::ring_bytes_sent(two, {}, huge); },
      {"[ring_bytes_sent] a shard's bytes kv_row_bytes*S_o (" + std::to_string(huge) + " x ",
       "overflows 64 bits"});
  // Each shard's bytes fit, a rank's sum over its two sends (P = 3: two hops) does not.
  const SequenceSharding three(3, 3, ShardLayout::kContiguous);
  const std::int64_t half = std::numeric_limits<std::int64_t>::max() / 2 + 1;
  apex::testing::expect_invalid([&] { apex::distributed::ring_bytes_sent(three, {}, half); },
                                {"[ring_bytes_sent] a rank's bytes sent", "fit in 64 bits"});
  apex::testing::expect_invalid([&] { apex::distributed::ring_bytes_sent(two, {}, -1); },
                                "[ring_bytes_sent] kv_row_bytes (-1) must be >= 0");
  EXPECT_EQ(apex::distributed::ring_bytes_sent(three, {}, half - 1)[0], 2 * (half - 1));
}

TEST(RingAttention, UncheckedArithmetic_PositionsBeyondIndexAreRejectedByThePlan) {
  // key_offset + a chunk's end overflowed in the plan, which checked no rule.
  const SequenceSharding sharding(10, 2, ShardLayout::kContiguous);
  PositionMask rule = causal();
  rule.key_offset = std::numeric_limits<Index>::max() - 5;
  const std::string offset = "key_offset (" + std::to_string(rule.key_offset) + ") + S_k (10)";
  apex::testing::expect_invalid([&] { apex::distributed::ring_plan(sharding, rule); },
                                {"[ring_plan] " + offset, "must not exceed the largest position"});
  apex::testing::expect_invalid([&] { apex::distributed::ring_bytes_sent(sharding, rule, 1); },
                                "[ring_bytes_sent] " + offset);
}

TEST(RingAttention, UncheckedArithmetic_HugeLengthIsRejectedOnEveryRank) {
  // S = P·(2^60 + 1) positions of width 1: the bound on a K or V shard, B·H_kv·S_chunk·2·d·4
  // bytes = 2^63 + 8, wrapped below INT_MAX and passed the one-message check. The views are
  // never read (the checks come first), so they view one float.
  const auto me = world();
  float dummy = 0.0f;
  const auto attend = [&](Index length) {
    const SequenceSharding sharding(length, me.size, ShardLayout::kContiguous);
    const Index rows = sharding.local_length(me.rank);
    const HeadsView<const float> in(&dummy, {1, 1, rows, 1}, {0, 0, 0});
    const HeadsView<float> out(&dummy, {1, 1, rows, 1}, {rows, rows, 1});
    apex::distributed::ring_attention(MPI_COMM_WORLD, sharding, in, in, in, causal(), {}, out);
  };
  apex::testing::expect_invalid(
      [&] { attend(((Index{1} << 60) + 1) * me.size); },
      {"[ring_attention] a K or V shard's bytes", "overflows 64 bits", "(on rank 0)"});
  // Within 64 bits but above one MPI message (an int count of bytes): rejected, not truncated.
  apex::testing::expect_invalid(
      [&] { attend((Index{1} << 28) * me.size + me.size); },
      {"[ring_attention] a K or V shard of up to", "exceeds one MPI message", "(on rank 0)"});
  EXPECT_EQ(dummy, 0.0f);
}

TEST(RingAttention, UncheckedArithmetic_NegativeDocumentsLengthIsRejectedOnEveryRank) {
  // The agreement hashes the document ids before any check; a view of -1 ids on the last rank
  // made it read (size_t)(-1)·8 bytes.
  const auto me = world();
  const int last = me.size - 1;
  WholeSequence w;
  w.draw(95);
  const SequenceSharding sharding(w.length, me.size, ShardLayout::kZigzag);
  const auto q = apex::distributed::shard_rows(w.q.view(), sharding, me.rank);
  const auto k = apex::distributed::shard_rows(w.k.view(), sharding, me.rank);
  const auto v = apex::distributed::shard_rows(w.v.view(), sharding, me.rank);
  HeadsTensor<float> out({w.batch, w.q_heads, q.seq(), w.d_v});
  const std::vector<Index> ids(static_cast<std::size_t>(w.length), 0);
  PositionMask rule = causal();
  rule.documents = me.rank == last ? apex::DocumentIds(ids.data(), -1) : apex::DocumentIds(ids);
  apex::testing::expect_invalid(
      [&] {
        apex::distributed::ring_attention(MPI_COMM_WORLD, sharding, q.view(), k.view(), v.view(),
                                          rule, {}, out.view());
      },
      {"[ring_attention] documents (-1 ids) must be a view of >= 0 ids",
       "(on rank " + std::to_string(last) + ")"});
}

}  // namespace
}  // namespace mpi_ring_attention_test
