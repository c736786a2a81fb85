// SPDX-License-Identifier: MIT
// Context parallelism over MPI, on P ranks:
//   1. one grouped-query attention layer: a prompt of 4096 tokens prefilled by ring attention
//      (each rank holding one early and one late chunk: the zigzag layout of causal attention),
//      its K/V kept sharded in a ShardedKvCache, then 64 tokens decoded, each rank attending to
//      the positions it holds and the partial results merged;
//   2. a 6-layer APEX-1 stack (local GQA layers with a window, global MLA layers, a
//      bidirectional prefix): a 1024-token prompt prefilled across the ranks, then 16 tokens
//      decoded greedily.
// Prints, per rank, the cache bytes it holds and the bytes it sent (with what the ring model
// predicts), and the largest difference from one process computing the same alone.
//
//   mpiexec -n 4 ./example_06_context_parallel      (add --oversubscribe on a small machine)
#include <apex/apex.hpp>
#include <apex/distributed/ring_attention.hpp>
#include <apex/distributed/sharded_cache.hpp>
#include <apex/distributed/stack.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

namespace {

using apex::HeadsTensor;
using apex::Index;
namespace dist = apex::distributed;

constexpr Index kPrompt = 4096, kDecode = 64, kQHeads = 8, kKvHeads = 2, kDim = 64;

/// A [B, H, S, D] tensor of N(0, 1) values; the same seed gives the same tensor on every rank.
HeadsTensor<float> random_heads(Index heads, Index seq, std::uint32_t seed) {
  HeadsTensor<float> t({1, heads, seq, kDim});
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index i = 0; i < heads * seq * kDim; ++i) t.data()[i] = normal(rng);
  return t;
}

/// max |a − b| over two views of one shape.
double max_difference(const apex::HeadsView<const float>& a,
                      const apex::HeadsView<const float>& b) {
  double d = 0.0;
  for (Index h = 0; h < a.heads(); ++h) {
    d = std::max(d, double((a.head(0, h) - b.head(0, h)).cwiseAbs().maxCoeff()));
  }
  return d;
}

/// Rank 0 prints one line per rank, in rank order.
void print_per_rank(const dist::RankInfo& me, const char* what, const std::vector<double>& mine) {
  std::vector<double> all(mine.size() * static_cast<std::size_t>(me.size));
  MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(),
             static_cast<int>(mine.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (me.rank != 0) return;
  std::printf("%s\n", what);
  for (int r = 0; r < me.size; ++r) {
    std::printf("  rank %d:", r);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const double x = all[static_cast<std::size_t>(r) * mine.size() + i];
      std::printf(x == std::floor(x) ? " %12.0f" : " %12.3g", x);
    }
    std::printf("\n");
  }
}

/// Part 2: the stack across ranks against the stack in one process. Returns whether they agree.
bool run_stack(const dist::RankInfo& me) {
  apex::StackConfig c;
  c.vocab_size = 512;
  c.d_model = 128;
  c.num_layers = 6;
  c.global_every = 3;
  c.window = 128;
  c.local = apex::GqaConfig{128, 4, 2, 32};
  c.global.d_model = 128;
  c.global.d_q = 64;
  c.global.d_kv = 64;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 4;
  c.global.head_dim = 32;
  c.global.rope_dim = 16;
  c.max_positions = 2048;
  const auto stack = apex::AttentionStack<float>::random(c, 7);
  constexpr Index kStackPrompt = 1024, kStackDecode = 16, kPrefixTokens = 32;
  apex::TokenMatrix prompt(1, kStackPrompt);
  for (Index p = 0; p < kStackPrompt; ++p) prompt(0, p) = (31 * p + 7) % c.vocab_size;

  const dist::SequenceSharding sharding(kStackPrompt, me.size, dist::ShardLayout::kZigzag);
  std::vector<std::int64_t> local;
  for (const apex::PositionRange& r : sharding.chunks(me.rank)) {
    for (Index p = r.begin; p < r.end; ++p) local.push_back(prompt(0, p));
  }
  auto cache = dist::make_sharded_cache(MPI_COMM_WORLD, stack, kStackPrompt + kStackDecode, 16);
  dist::Traffic prefill, decode;
  const apex::RowMatrix<float> logits = dist::context_parallel_prefill(
      MPI_COMM_WORLD, stack, sharding, local, kPrefixTokens, cache, &prefill);
  auto single = stack.make_cache(1, kStackPrompt + kStackDecode);
  const apex::RowMatrix<float> want = stack.prefill(prompt, kPrefixTokens, single);
  double error = 0.0;
  Index row = 0;
  for (const apex::PositionRange& r : sharding.chunks(me.rank)) {
    for (Index p = r.begin; p < r.end; ++p, ++row) {
      error = std::max(error, double((logits.row(row) - want.row(p)).cwiseAbs().maxCoeff()));
    }
  }
  // Greedy decoding: every rank has the same logits, so every rank picks the same token.
  std::int64_t next = 0;
  want.row(kStackPrompt - 1).maxCoeff(&next);
  for (Index t = 0; t < kStackDecode; ++t) {
    const apex::RowMatrix<float> got =
        dist::context_parallel_decode_step(MPI_COMM_WORLD, stack, next, cache, &decode);
    const apex::RowMatrix<float> one = stack.decode_step({next}, single);
    error = std::max(error, double((got - one).cwiseAbs().maxCoeff()));
    got.row(0).maxCoeff(&next);
  }
  if (me.rank == 0) {
    std::printf(
        "\nthe APEX-1 stack on %d ranks: %d layers (d = %d), a %d-token prompt with a "
        "%d-token prefix, %d decoded tokens\n\n",
        me.size, int(c.num_layers), int(c.d_model), int(kStackPrompt), int(kPrefixTokens),
        int(kStackDecode));
  }
  print_per_rank(
      me,
      "per rank: cache bytes, prefill bytes sent, decode bytes contributed, "
      "max |logits - one process|",
      {double(cache.bytes()), double(prefill.bytes_sent), double(decode.collective_bytes), error});
  return error < 1e-3;
}

int run() {
  const dist::RankInfo me = dist::rank_info(MPI_COMM_WORLD);
  apex::PositionMask causal;
  causal.causal = true;

  // The whole prompt, drawn alike on every rank; each rank keeps its shard.
  const HeadsTensor<float> q = random_heads(kQHeads, kPrompt, 1);
  const HeadsTensor<float> k = random_heads(kKvHeads, kPrompt, 2);
  const HeadsTensor<float> v = random_heads(kKvHeads, kPrompt, 3);
  const dist::SequenceSharding sharding(kPrompt, me.size, dist::ShardLayout::kZigzag);
  const HeadsTensor<float> q_r = dist::shard_rows(q.view(), sharding, me.rank);
  const HeadsTensor<float> k_r = dist::shard_rows(k.view(), sharding, me.rank);
  const HeadsTensor<float> v_r = dist::shard_rows(v.view(), sharding, me.rank);

  // Prefill: ring attention, against one process's sdpa over the whole prompt.
  HeadsTensor<float> out_r({1, kQHeads, q_r.seq(), kDim});
  const double began = MPI_Wtime();
  const dist::Traffic ring = dist::ring_attention(MPI_COMM_WORLD, sharding, q_r.view(), k_r.view(),
                                                  v_r.view(), causal, {}, out_r.view());
  const double ring_seconds = MPI_Wtime() - began;
  HeadsTensor<float> whole({1, kQHeads, kPrompt, kDim});
  apex::sdpa(q.view(), k.view(), v.view(), apex::AttentionMask<float>{causal, {}, {}}, {},
             whole.view());
  const double prefill_error =
      max_difference(out_r.view(), dist::shard_rows(whole.view(), sharding, me.rank).view());
  const std::int64_t row_bytes = kKvHeads * 2 * kDim * std::int64_t(sizeof(float));
  const std::int64_t predicted =
      dist::ring_bytes_sent(sharding, causal, row_bytes)[static_cast<std::size_t>(me.rank)];

  // Decode: the K/V stays where the prefill put it; new tokens are dealt in blocks of 16.
  dist::ShardedKvCache<float> cache(MPI_COMM_WORLD,
                                    {1, kKvHeads, kDim, kPrompt / me.size + kDecode, 16});
  cache.load_prompt(sharding, k_r.view(), v_r.view());
  apex::KvCache<float> single({1, kKvHeads, kDim, kPrompt + kDecode});
  single.append(k.view(), v.view(), 0);
  double decode_error = 0.0;
  dist::Traffic decode;
  for (Index t = 0; t < kDecode; ++t) {
    const HeadsTensor<float> q1 = random_heads(kQHeads, 1, 100 + std::uint32_t(t));
    const HeadsTensor<float> k1 = random_heads(kKvHeads, 1, 200 + std::uint32_t(t));
    const HeadsTensor<float> v1 = random_heads(kKvHeads, 1, 300 + std::uint32_t(t));
    cache.append(k1.view(), v1.view(), kPrompt + t);
    single.append(k1.view(), v1.view(), kPrompt + t);
    HeadsTensor<float> o({1, kQHeads, 1, kDim}), o_single({1, kQHeads, 1, kDim});
    decode += cache.attend(q1.view(), causal, {}, o.view());
    apex::sdpa(q1.view(), single.keys(), single.values(),
               apex::AttentionMask<float>{causal, {}, {}}, {}, o_single.view());
    decode_error = std::max(decode_error, max_difference(o.view(), o_single.view()));
  }

  if (me.rank == 0) {
    std::printf(
        "context parallelism on %d ranks: causal GQA, %d query / %d K/V heads of %d, "
        "a %d-token prompt (zigzag shards), %d decoded tokens\n\n",
        me.size, int(kQHeads), int(kKvHeads), int(kDim), int(kPrompt), int(kDecode));
  }
  print_per_rank(me,
                 "per rank: positions held, cache bytes, ring bytes sent, ring model's bytes, "
                 "decode bytes contributed",
                 {double(cache.local_length()), double(cache.bytes()), double(ring.bytes_sent),
                  double(predicted), double(decode.collective_bytes)});
  print_per_rank(me,
                 "per rank: ring prefill seconds, max |prefill - one process|, "
                 "max |decode - one process|",
                 {ring_seconds, prefill_error, decode_error});
  const bool stack_agrees = run_stack(me);
  const int agrees =
      ring.bytes_sent == predicted && prefill_error < 1e-4 && decode_error < 1e-4 && stack_agrees;
  int all_agree = 0;
  MPI_Allreduce(&agrees, &all_agree, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (me.rank == 0) {
    std::printf("\n%s\n", all_agree ? "every rank agrees with the single-process run"
                                    : "MISMATCH with the single-process run");
  }
  return all_agree ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 1;
  try {
    status = run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
