// SPDX-License-Identifier: MIT
// Quantized K/V across ranks (issue 29): the sharded cache, ring attention and the distributed
// stack over q8_0, q4_0 and fp8 e4m3 blocks (kv_quant.hpp; fp8 in blocks of 32, so that one head
// width serves every format). What a rank keeps is each row quantized alone, as a KvCache keeps
// it; attention over quantized K/V is the float kernel's over the decoded values, bit for bit
// (the same runs and merges, the kernel reading blocks as it reads their values), and within the
// float tolerance of a single-process KvCache of the same format (the merge rounds otherwise);
// bytes held and sent are counted as stored; a width that is not whole blocks is refused on
// every rank. The distributed stack over q8_0 caches gives its one-rank logits, up to values
// that the merges' rounding moves across a quantization step. One typed suite and one stack, in
// one translation unit, so that each format's kernel is compiled once.
#include "format_names.hpp"
#include "mpi_test_util.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"
#include "whole_block_stack.hpp"

#include <apex/cached_attention.hpp>
#include <apex/distributed/ring_attention.hpp>
#include <apex/distributed/sharded_cache.hpp>
#include <apex/distributed/stack.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_quant.hpp>
#include <apex/sdpa.hpp>
#include <apex/stack.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <variant>
#include <vector>

namespace mpi_kv_quant_test {
namespace {

using apex::HeadsShape;
using apex::HeadsTensor;
using apex::HeadsView;
using apex::Index;
using apex::KvFormat;
using apex::PositionMask;
using apex::SdpaParams;
using apex::distributed::SequenceSharding;
using apex::distributed::ShardedCacheShape;
using apex::distributed::ShardedKvCache;
using apex::distributed::ShardLayout;
using apex::testing::world;

template <class F>
class QuantizedShards : public ::testing::Test {};
using Formats = ::testing::Types<apex::BlockQ8_0, apex::BlockQ4_0, apex::BlockFp8E4m3<32>>;
TYPED_TEST_SUITE(QuantizedShards, Formats, apex::testing::FormatName);

/// The rows of a [B, H, n, d] view of any format as floats: the values sdpa reads.
template <class T>
HeadsTensor<float> decoded(const HeadsView<const T>& view) {
  HeadsTensor<float> out({view.batch(), view.heads(), view.seq(), apex::row_values(view)});
  for (Index b = 0; b < view.batch(); ++b) {
    for (Index h = 0; h < view.heads(); ++h) {
      out.view().head(b, h) = apex::detail::head_values<float>(view, b, h);
    }
  }
  return out;
}

/// Expects two views of one shape to hold the same values, bit for bit (NaN as NaN).
void expect_identical(const HeadsTensor<float>& actual, const HeadsTensor<float>& expected) {
  const auto [diff, scale] = apex::testing::max_difference(actual.view(), expected.view());
  EXPECT_EQ(diff, 0.0) << "largest |expected| " << scale;
}

/// The bytes of [B, H, n, d] values stored as F.
template <class F>
std::int64_t stored_bytes(const HeadsShape& s) {
  return KvFormat<F>::bytes(s.batch * s.heads * s.seq * KvFormat<F>::elements(s.dim));
}

PositionMask causal() {
  PositionMask m;
  m.causal = true;
  return m;
}

// ---------------------------------------------------------------------------------------------
// ShardedKvCache
// ---------------------------------------------------------------------------------------------

constexpr Index kBatch = 2, kQHeads = 4, kKvHeads = 2, kPrompt = 37, kSteps = 24;

/// A ShardedKvCache of F, one of floats given the decoded values of the same rows, and a
/// single-process KvCache of F, filled alike: a prompt of kPrompt tokens, then kSteps decoded
/// one at a time, each step's attention compared.
template <class F>
struct ThreeCaches {
  static constexpr Index kDqk = 2 * KvFormat<F>::kValuesPerElement;  // d_qk != d_v
  static constexpr Index kDv = KvFormat<F>::kValuesPerElement;
  static constexpr Index kCapacity = kPrompt + kSteps;
  ShardedKvCache<float, F> quantized;
  ShardedKvCache<float, float> decoded_values;
  apex::KvCache<float, F> whole_k, whole_v;  // a KvCache has one width: K and V apart

  ThreeCaches()
      : quantized(MPI_COMM_WORLD, shape()),
        decoded_values(MPI_COMM_WORLD, shape()),
        whole_k({kBatch, kKvHeads, kDqk, kCapacity}),
        whole_v({kBatch, kKvHeads, kDv, kCapacity}) {}

  static ShardedCacheShape shape() {
    return {kBatch, kKvHeads, kDqk, kCapacity, /*decode_block=*/8, /*value_dim=*/kDv};
  }

  /// The prompt's rows k, v: this rank's shard into the sharded caches, all into the KvCache.
  void load(const SequenceSharding& sharding, const HeadsTensor<float>& k,
            const HeadsTensor<float>& v) {
    const int rank = world().rank;
    const auto shard = [&](const HeadsTensor<float>& x) {
      return apex::distributed::shard_rows(x.view(), sharding, rank);
    };
    quantized.load_prompt(sharding, shard(k).view(), shard(v).view());
    decoded_values.load_prompt(sharding, shard(stored_values(k)).view(),
                               shard(stored_values(v)).view());
    whole_k.append(k.view(), k.view(), 0);
    whole_v.append(v.view(), v.view(), 0);
  }

  /// One token's k, v at `position`, in every cache.
  void append(const HeadsTensor<float>& k, const HeadsTensor<float>& v, Index position) {
    quantized.append(k.view(), v.view(), position);
    decoded_values.append(stored_values(k).view(), stored_values(v).view(), position);
    whole_k.append(k.view(), k.view(), position);
    whole_v.append(v.view(), v.view(), position);
  }

  /// The values rows x take once stored as F (each row quantized alone).
  static HeadsTensor<float> stored_values(const HeadsTensor<float>& x) {
    const auto stored = apex::detail::stored_copy<F>(HeadsView<const float>(x.view()));
    return decoded(stored.view);
  }
};

TYPED_TEST(QuantizedShards, ShardedCacheAttendsOverItsDecodedRowsOnEveryRank) {
  using F = TypeParam;
  using Caches = ThreeCaches<F>;
  const auto me = world();
  const SequenceSharding sharding(kPrompt, me.size, ShardLayout::kZigzag);
  Caches caches;
  caches.load(sharding,
              apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, Caches::kDqk, 5),
              apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, Caches::kDv, 6));
  SdpaParams params;
  params.sinks = {0.5, -1.0, 0.0, 2.0};
  PositionMask rule = causal();
  rule.window = 30;  // some ranks hold no visible key at some steps
  std::mt19937 rng(7);
  for (Index step = 0; step < kSteps; ++step) {
    const Index position = kPrompt + step;
    caches.append(apex::testing::random_heads<float>(kBatch, kKvHeads, 1, Caches::kDqk, rng),
                  apex::testing::random_heads<float>(kBatch, kKvHeads, 1, Caches::kDv, rng),
                  position);
    const auto q = apex::testing::random_heads<float>(kBatch, kQHeads, 1, Caches::kDqk, rng);
    const HeadsShape o{kBatch, kQHeads, 1, Caches::kDv}, r{kBatch, kQHeads, 1, 1};
    HeadsTensor<float> out(o), lse(r), want(o), want_lse(r), whole(o), whole_lse(r);
    const apex::distributed::Traffic traffic =
        caches.quantized.attend(q.view(), rule, params, out.view(), lse.view());
    const apex::distributed::Traffic float_traffic =
        caches.decoded_values.attend(q.view(), rule, params, want.view(), want_lse.view());
    expect_identical(out, want);
    expect_identical(lse, want_lse);
    apex::sdpa(q.view(), caches.whole_k.keys(), caches.whole_v.values(),
               apex::AttentionMask<float>{rule, {}, {}}, params, whole.view(), whole_lse.view());
    constexpr double tol = apex::testing::Tolerances<float>::kAttention;
    apex::testing::expect_normwise(out.view(), whole.view(), tol);
    apex::testing::expect_normwise(lse.view(), whole_lse.view(), tol);
    // No row travels; the records are what they are for floats.
    EXPECT_EQ(traffic.bytes_sent, 0);
    EXPECT_EQ(traffic.collective_bytes, float_traffic.collective_bytes);
  }
  // Each rank keeps its rows as a KvCache of F keeps them: each row quantized alone.
  expect_identical(decoded(caches.quantized.keys()), decoded(caches.decoded_values.keys()));
  expect_identical(decoded(caches.quantized.values()), decoded(caches.decoded_values.values()));
  EXPECT_EQ(caches.quantized.local_length(), caches.decoded_values.local_length());
  // bytes() counts the blocks: those of a KvCache of F for K and for V.
  const HeadsShape k_shape{kBatch, kKvHeads, Caches::kCapacity, Caches::kDqk};
  const HeadsShape v_shape{kBatch, kKvHeads, Caches::kCapacity, Caches::kDv};
  EXPECT_EQ(caches.quantized.bytes(), stored_bytes<F>(k_shape) + stored_bytes<F>(v_shape));
  EXPECT_EQ(caches.quantized.bytes(), (caches.whole_k.bytes() + caches.whole_v.bytes()) / 2);
  EXPECT_LT(3 * caches.quantized.bytes(), caches.decoded_values.bytes());  // 9 bits a value, not 32
}

TYPED_TEST(QuantizedShards, WidthsThatAreNotWholeBlocksAreRefusedOnEveryRank) {
  using F = TypeParam;
  constexpr Index kBlock = KvFormat<F>::kValuesPerElement;
  const auto me = world();
  ShardedKvCache<float, F> cache(MPI_COMM_WORLD, ShardedCacheShape{1, 2, kBlock, 8, 4});
  const auto one = apex::testing::random_heads<float>(1, 2, 1, kBlock, 3);
  cache.append(one.view(), one.view(), 0);
  const std::int64_t bytes = cache.bytes();
  const std::string block = "must be a multiple of the " + std::to_string(kBlock) + " values";
  apex::testing::expect_invalid(
      [&] {
        cache = ShardedKvCache<float, F>(MPI_COMM_WORLD, {1, 2, kBlock + 16, 8, 4});
      },
      {"[sharded_kv_cache] head_dim (" + std::to_string(kBlock + 16) + ") " + block,
       "(on rank 0)"});
  apex::testing::expect_invalid(
      [&] {
        cache = ShardedKvCache<float, F>(MPI_COMM_WORLD, {1, 2, kBlock, 8, 4, kBlock / 2});
      },
      {"[sharded_kv_cache] value_dim (" + std::to_string(kBlock / 2) + ") " + block});
  // The cache assigned to is as it was.
  EXPECT_EQ(cache.length(), 1);
  EXPECT_EQ(cache.bytes(), bytes);
  EXPECT_EQ(cache.ranks(), me.size);
  if (me.rank == cache.owner_of(0)) {
    expect_identical(decoded(cache.keys()), ThreeCaches<F>::stored_values(one));
  }
}

// ---------------------------------------------------------------------------------------------
// Ring attention
// ---------------------------------------------------------------------------------------------

/// Ring attention over this rank's shard of K/V stored as F, against the ring over the decoded
/// values (bit for bit) and against apex::sdpa over the whole decoded sequence (within the float
/// tolerance); the bytes sent are the blocks' (ring_bytes_sent of a stored row's bytes).
template <class F>
void check_quantized_ring(ShardLayout layout, const PositionMask& rule) {
  constexpr Index kDqk = 2 * KvFormat<F>::kValuesPerElement, kDv = KvFormat<F>::kValuesPerElement;
  const auto me = world();
  const SequenceSharding sharding(kPrompt, me.size, layout);
  const auto shard = [&](const HeadsTensor<float>& x) {
    return apex::distributed::shard_rows(x.view(), sharding, me.rank);
  };
  const auto q = apex::testing::random_heads<float>(kBatch, kQHeads, kPrompt, kDqk, 11);
  const auto k = apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, kDqk, 12);
  const auto v = apex::testing::random_heads<float>(kBatch, kKvHeads, kPrompt, kDv, 13);
  const HeadsTensor<float> q_r = shard(q), k_r = shard(k), v_r = shard(v);
  const auto k_stored = apex::detail::stored_copy<F>(HeadsView<const float>(k_r.view()));
  const auto v_stored = apex::detail::stored_copy<F>(HeadsView<const float>(v_r.view()));
  const Index rows = sharding.local_length(me.rank);
  const HeadsShape o{kBatch, kQHeads, rows, kDv}, r{kBatch, kQHeads, rows, 1};
  HeadsTensor<float> out(o), lse(r), want(o), want_lse(r);
  const apex::distributed::Traffic traffic =
      apex::distributed::ring_attention(MPI_COMM_WORLD, sharding, q_r.view(), k_stored.view,
                                        v_stored.view, rule, {}, out.view(), lse.view());
  const HeadsTensor<float> k_values = decoded(k_stored.view), v_values = decoded(v_stored.view);
  const apex::distributed::Traffic float_traffic =
      apex::distributed::ring_attention(MPI_COMM_WORLD, sharding, q_r.view(), k_values.view(),
                                        v_values.view(), rule, {}, want.view(), want_lse.view());
  expect_identical(out, want);
  expect_identical(lse, want_lse);

  // The whole sequence's decoded K/V in one process.
  const HeadsTensor<float> k_all = ThreeCaches<F>::stored_values(k),
                           v_all = ThreeCaches<F>::stored_values(v);
  HeadsTensor<float> whole({kBatch, kQHeads, kPrompt, kDv}),
      whole_lse({kBatch, kQHeads, kPrompt, 1});
  apex::sdpa(q.view(), k_all.view(), v_all.view(), apex::AttentionMask<float>{rule, {}, {}}, {},
             whole.view(), whole_lse.view());
  constexpr double tol = apex::testing::Tolerances<float>::kAttention;
  apex::testing::expect_normwise(out.view(), shard(whole).view(), tol);
  apex::testing::expect_normwise(lse.view(), shard(whole_lse).view(), tol);

  const std::int64_t row_bytes =
      stored_bytes<F>({kBatch, kKvHeads, 1, kDqk}) + stored_bytes<F>({kBatch, kKvHeads, 1, kDv});
  const std::int64_t float_row = kBatch * kKvHeads * (kDqk + kDv) * 4;
  const auto at = static_cast<std::size_t>(me.rank);
  EXPECT_EQ(traffic.bytes_sent, apex::distributed::ring_bytes_sent(sharding, rule, row_bytes)[at]);
  EXPECT_EQ(float_traffic.bytes_sent,
            apex::distributed::ring_bytes_sent(sharding, rule, float_row)[at]);
  EXPECT_EQ(traffic.messages, float_traffic.messages);
}

TYPED_TEST(QuantizedShards, RingAttentionSendsBlocksAndAttendsOverTheirValues) {
  check_quantized_ring<TypeParam>(ShardLayout::kZigzag, causal());
  PositionMask window = causal();
  window.window = 6;
  check_quantized_ring<TypeParam>(ShardLayout::kContiguous, window);
}

// ---------------------------------------------------------------------------------------------
// The distributed stack
// ---------------------------------------------------------------------------------------------

/// The stack of whole_block_stack.hpp: layers 0, 1 local (W = 8), layer 2 global.
apex::StackConfig whole_block_config() { return apex::testing::whole_block_config(3, 3, 8, 64); }

constexpr Index kStackPrompt = 23, kStackSteps = 5, kStackPrefix = 4;

/// The logits of a prompt of kStackPrompt tokens (every prompt row, then kStackSteps decoded
/// rows) across the ranks of comm, every cache in Storage; adds the traffic to *traffic and
/// returns this rank's prompt rows followed by the decoded rows, and its cache's bytes.
template <class Storage>
apex::RowMatrix<float> stack_logits(MPI_Comm comm, const apex::AttentionStack<float>& stack,
                                    apex::distributed::Traffic* traffic, std::int64_t* bytes) {
  const auto me = apex::distributed::rank_info(comm);
  const SequenceSharding sharding(kStackPrompt, me.size, ShardLayout::kZigzag);
  const auto token_at = [](Index p) { return std::int64_t{(7 * p + 3) % 50}; };
  std::vector<std::int64_t> local;
  for (const apex::PositionRange& c : sharding.chunks(me.rank)) {
    for (Index p = c.begin; p < c.end; ++p) local.push_back(token_at(p));
  }
  auto cache =
      apex::distributed::make_sharded_cache<Storage>(comm, stack, kStackPrompt + kStackSteps, 2);
  const apex::RowMatrix<float> prompt = apex::distributed::context_parallel_prefill(
      comm, stack, sharding, local, kStackPrefix, cache, traffic);
  apex::RowMatrix<float> logits(prompt.rows() + kStackSteps, prompt.cols());
  logits.topRows(prompt.rows()) = prompt;
  for (Index step = 0; step < kStackSteps; ++step) {
    logits.row(prompt.rows() + step) = apex::distributed::context_parallel_decode_step(
        comm, stack, token_at(kStackPrompt + step), cache, traffic);
  }
  *bytes = cache.bytes();
  return logits;
}

/// This rank's rows of the whole prompt's rows `all` (kStackPrompt of them, then the decoded
/// ones), in the order stack_logits gives them.
apex::RowMatrix<float> rank_rows(const apex::RowMatrix<float>& all, int rank, int ranks) {
  const SequenceSharding sharding(kStackPrompt, ranks, ShardLayout::kZigzag);
  apex::RowMatrix<float> rows(sharding.local_length(rank) + kStackSteps, all.cols());
  Index row = 0;
  for (const apex::PositionRange& c : sharding.chunks(rank)) {
    for (Index p = c.begin; p < c.end; ++p) rows.row(row++) = all.row(p);
  }
  rows.bottomRows(kStackSteps) = all.bottomRows(kStackSteps);
  return rows;
}

TEST(QuantizedContextParallelStack, Q8_0CachesGiveTheOneRankLogitsAndCountTheirBlocks) {
  using F = apex::BlockQ8_0;
  const auto me = world();
  const auto stack = apex::AttentionStack<float>::random(whole_block_config(), 19);
  apex::distributed::Traffic traffic, alone;
  std::int64_t bytes = 0, alone_bytes = 0;
  const apex::RowMatrix<float> got = stack_logits<F>(MPI_COMM_WORLD, stack, &traffic, &bytes);
  // The same stack on this rank alone: every row quantized as it is across the ranks.
  const apex::RowMatrix<float> one = stack_logits<F>(MPI_COMM_SELF, stack, &alone, &alone_bytes);
  const apex::RowMatrix<float> want = rank_rows(one, me.rank, me.size);
  ASSERT_EQ(got.rows(), want.rows());
  // Within float's rounding, the same arithmetic as one rank, but for the merges' order: their
  // rounding (5e-7 of a row for float caches) moves a value now and then across a rounding
  // boundary of q8_0, a step of 1/127 of its block's largest value, which the later layers
  // carry to the logits. Measured on 1-4 ranks: at most 1.2e-3 of a row, against 1.5e-2 between
  // q8_0 and float caches; the bound, 5e-3, lies between.
  constexpr double kQuantStepBound = 5e-3;
  for (Index i = 0; i < got.rows(); ++i) {
    EXPECT_LE(double((got.row(i) - want.row(i)).cwiseAbs().maxCoeff()),
              kQuantStepBound * double(want.row(i).cwiseAbs().maxCoeff()))
        << "row " << i;
  }
  // The ring sent blocks: each layer's stored K and V rows under its own rule; the cache holds
  // blocks, the same on every rank count.
  std::int64_t expected = 0;
  std::int64_t held = 0;
  const SequenceSharding sharding(kStackPrompt, me.size, ShardLayout::kZigzag);
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    const auto heads =
        std::visit([](const auto& a) { return a.attention_heads(); }, stack.layer(l));
    const std::int64_t row = stored_bytes<F>({1, heads.num_kv_heads, 1, heads.qk_dim}) +
                             stored_bytes<F>({1, heads.num_kv_heads, 1, heads.v_dim});
    expected += apex::distributed::ring_bytes_sent(sharding,
                                                   stack.mask_for_layer(l, kStackPrefix).positions,
                                                   row)[static_cast<std::size_t>(me.rank)];
    held += row * (kStackPrompt + kStackSteps);
  }
  EXPECT_EQ(traffic.bytes_sent, expected);
  EXPECT_EQ(bytes, held);
  EXPECT_EQ(alone_bytes, held);
  // Head widths that are not whole blocks: refused on every rank by the layer's cache.
  const auto narrow = apex::AttentionStack<float>::random(
      [] {
        apex::StackConfig c = whole_block_config();
        c.local.head_dim = 16;
        return c;
      }(),
      3);
  apex::testing::expect_invalid(
      [&] { apex::distributed::make_sharded_cache<F>(MPI_COMM_WORLD, narrow, 8); },
      {"[sharded_kv_cache] head_dim (16) must be a multiple of the 32 values", "(on rank 0)"});
}

}  // namespace
}  // namespace mpi_kv_quant_test
