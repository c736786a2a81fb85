// SPDX-License-Identifier: MIT
// The APEX-1 stack across ranks (apex/distributed/stack.hpp): a context-parallel prefill and
// decoding steps give the logits of the stack in one process (forward, prefill and decode_step),
// with its local (GQA, window) and global (MLA, decoupled RoPE) layers, a bidirectional prefix,
// double and float; bad input on one rank is refused on every rank with no cache changed.
#include "mpi_test_util.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#include <apex/distributed/stack.hpp>
#include <apex/stack.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace mpi_stack_test {
namespace {

using apex::Index;
using apex::distributed::SequenceSharding;
using apex::distributed::ShardLayout;
using apex::testing::world;

apex::StackConfig small_config() {
  apex::StackConfig c;
  c.vocab_size = 50;
  c.d_model = 24;
  c.num_layers = 6;  // layers 0, 1, 3, 4 local; 2 and 5 global
  c.global_every = 3;
  c.window = 5;
  c.local = apex::GqaConfig{24, 4, 2, 6};
  c.global.d_model = 24;
  c.global.d_q = 10;
  c.global.d_kv = 8;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 6;
  c.global.rope_dim = 4;
  c.max_positions = 64;
  return c;
}

constexpr Index kPrompt = 29, kPrefix = 6, kSteps = 20;

std::int64_t token_at(Index p) { return (13 * p + 5) % 50; }

/// Prefills kPrompt tokens across the ranks and decodes kSteps more; every row of logits is
/// compared with the single-process stack's, row by row: |Δ| ≤ tol · max |row|.
template <class Scalar>
void compare_with_one_process(ShardLayout layout,
                              const apex::StackConfig& config = small_config()) {
  const auto me = world();
  const auto stack = apex::AttentionStack<Scalar>::random(config, 17);
  const SequenceSharding sharding(kPrompt, me.size, layout);
  std::vector<std::int64_t> local;
  for (const apex::PositionRange& c : sharding.chunks(me.rank)) {
    for (Index p = c.begin; p < c.end; ++p) local.push_back(token_at(p));
  }
  auto cache = apex::distributed::make_sharded_cache(MPI_COMM_WORLD, stack, kPrompt + kSteps, 4);
  apex::distributed::Traffic traffic;
  const apex::RowMatrix<Scalar> logits = apex::distributed::context_parallel_prefill(
      MPI_COMM_WORLD, stack, sharding, local, kPrefix, cache, &traffic);

  apex::TokenMatrix all(1, kPrompt + kSteps);
  for (Index p = 0; p < kPrompt + kSteps; ++p) all(0, p) = token_at(p);
  const apex::RowMatrix<Scalar> whole = stack.forward(all.leftCols(kPrompt), kPrefix);
  constexpr double tol = apex::testing::Tolerances<Scalar>::kDecode;
  const auto expect_row = [&](const auto& got, Index got_row, const auto& want, Index want_row) {
    const double scale = double(want.row(want_row).cwiseAbs().maxCoeff());
    EXPECT_LE(double((got.row(got_row) - want.row(want_row)).cwiseAbs().maxCoeff()), tol * scale);
  };
  Index row = 0;
  for (const apex::PositionRange& c : sharding.chunks(me.rank)) {
    for (Index p = c.begin; p < c.end; ++p) expect_row(logits, row++, whole, p);
  }
  EXPECT_EQ(cache.next_position(), kPrompt);
  // The ring's bytes: each layer's K and V (heads and widths of its kind) under its own rule.
  std::int64_t expected = 0;
  std::int64_t record_bytes = 0;  // a decoding step's (m, l, out) rows of every layer
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    const auto heads =
        std::visit([](const auto& a) { return a.attention_heads(); }, stack.layer(l));
    const std::int64_t kv_row = heads.num_kv_heads * (heads.qk_dim + heads.v_dim) *
                                static_cast<std::int64_t>(sizeof(Scalar));
    expected +=
        apex::distributed::ring_bytes_sent(sharding, stack.mask_for_layer(l, kPrefix).positions,
                                           kv_row)[static_cast<std::size_t>(me.rank)];
    record_bytes += heads.num_q_heads * (heads.v_dim + 2) * 8;
  }
  EXPECT_EQ(traffic.bytes_sent, expected);
  traffic = {};

  const apex::RowMatrix<Scalar> full = stack.forward(all, kPrefix);
  auto single = stack.make_cache(1, kPrompt + kSteps);
  stack.prefill(all.leftCols(kPrompt), kPrefix, single);
  for (Index step = 0; step < kSteps; ++step) {
    const std::int64_t next = token_at(kPrompt + step);
    const apex::RowMatrix<Scalar> got = apex::distributed::context_parallel_decode_step(
        MPI_COMM_WORLD, stack, next, cache, &traffic);
    const apex::RowMatrix<Scalar> want = stack.decode_step({next}, single);
    expect_row(got, 0, want, 0);
    expect_row(got, 0, full, kPrompt + step);
  }
  EXPECT_EQ(cache.next_position(), kPrompt + kSteps);
  EXPECT_GT(cache.bytes(), 0);
  EXPECT_EQ(traffic.bytes_sent, 0);
  EXPECT_EQ(traffic.collective_bytes, kSteps * record_bytes);
}

TEST(ContextParallelStack, DoubleLogitsEqualOneProcess) {
  compare_with_one_process<double>(ShardLayout::kZigzag);
}

TEST(ContextParallelStack, FloatLogitsEqualOneProcessOnEitherLayout) {
  compare_with_one_process<float>(ShardLayout::kZigzag);
  compare_with_one_process<float>(ShardLayout::kContiguous);
}

// RoPE scalings reach the ranks through the stack's tables: Llama 3's on the local layers and
// LongRoPE's on the global ones, both past their original context of 16 positions.
TEST(ContextParallelStack, ScaledRopeLogitsEqualOneProcess) {
  apex::StackConfig config = small_config();
  config.rope_scaling = apex::Llama3Rope{4.0, 1.0, 4.0, 16};
  apex::LongRope longrope;
  longrope.short_factor = {1.0, 1.5};
  longrope.long_factor = {2.0, 6.0};
  longrope.original_context = 16;
  longrope.scale = 4.0;
  apex::LayerRope global;
  global.scaling = longrope;
  config.global_rope = global;
  compare_with_one_process<double>(ShardLayout::kZigzag, config);
}

TEST(ContextParallelStack, BadInputOnOneRankIsRefusedEverywhere) {
  const auto me = world();
  const auto stack = apex::AttentionStack<float>::random(small_config(), 3);
  const SequenceSharding sharding(kPrompt, me.size, ShardLayout::kZigzag);
  std::vector<std::int64_t> local(static_cast<std::size_t>(sharding.local_length(me.rank)), 1);
  if (me.rank == me.size - 1) local.back() = 50;  // an id outside the vocabulary
  auto cache = apex::distributed::make_sharded_cache(MPI_COMM_WORLD, stack, kPrompt, 4);
  apex::testing::expect_invalid(
      [&] {
        apex::distributed::context_parallel_prefill(MPI_COMM_WORLD, stack, sharding, local, 0,
                                                    cache);
      },
      {"50", "(on rank " + std::to_string(me.size - 1) + ")"});
  EXPECT_EQ(cache.next_position(), 0);
  for (Index l = 0; l < cache.num_layers(); ++l) EXPECT_EQ(cache.layer(l).local_length(), 0);
  local.back() = 1;
  apex::testing::expect_invalid(
      [&] { apex::distributed::context_parallel_decode_step(MPI_COMM_WORLD, stack, 1, cache); },
      "prefilled first");
  apex::distributed::ShardedStackCache<float> none;
  apex::testing::expect_invalid(
      [&] {
        apex::distributed::context_parallel_prefill(MPI_COMM_WORLD, stack, sharding, local, 0,
                                                    none);
      },
      "the cache has 0 layers");
}

TEST(ContextParallelStack, AFullRankRefusesTheNextTokenEverywhere) {
  const auto me = world();
  const auto stack = apex::AttentionStack<float>::random(small_config(), 4);
  const SequenceSharding sharding(kPrompt, me.size, ShardLayout::kZigzag);
  std::vector<std::int64_t> local(static_cast<std::size_t>(sharding.local_length(me.rank)), 2);
  Index room = 0;
  for (int r = 0; r < me.size; ++r) room = std::max(room, sharding.local_length(r));
  auto cache = apex::distributed::make_sharded_cache(MPI_COMM_WORLD, stack, room + 1, 2);
  apex::distributed::context_parallel_prefill(MPI_COMM_WORLD, stack, sharding, local, 0, cache);
  bool refused = false;
  for (Index step = 0; step < 2 * me.size + 2 && !refused; ++step) {
    const Index before = cache.next_position();
    try {
      apex::distributed::context_parallel_decode_step(MPI_COMM_WORLD, stack, 3, cache);
    } catch (const std::invalid_argument& e) {
      refused = true;
      EXPECT_NE(std::string(e.what()).find("is full (capacity " + std::to_string(room + 1) + ")"),
                std::string::npos)
          << e.what();
      EXPECT_EQ(cache.next_position(), before);
      for (Index l = 0; l < cache.num_layers(); ++l) EXPECT_EQ(cache.layer(l).length(), before);
    }
  }
  EXPECT_TRUE(refused);
}

}  // namespace
}  // namespace mpi_stack_test
