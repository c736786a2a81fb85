// SPDX-License-Identifier: MIT
// RoPE (§4): a precomputed float table applied in place to a query projection [tokens, d],
// d = H·128 (heads side by side). Memory-bound: read it against BM_MemCopy of the same run.
// BM_Rope/<kind> applies the table of each scaling a checkpoint may declare (rope_scaling.hpp,
// yarn.hpp); they are tables like the plain one, so each should run at BM_Rope's GB/s.
#include <apex/rope.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/yarn.hpp>

#include <benchmark/benchmark.h>

#include <string>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

constexpr apex::Index kHeadDim = 128;
constexpr apex::Index kTablePositions = 8192;

// Rotates q [tokens, d] = [state.range(0), state.range(1)] in place with `table`. GBps counts
// the bytes of x read and written: 2·tokens·d·sizeof(float); the table rows it reads
// (tokens·128·2 floats) are not counted.
void run_rope(benchmark::State& state, const apex::RopeTable<float>& table) {
  const apex::Index tokens = state.range(0);
  const apex::Index d = state.range(1);
  apex::RowMatrix<float> q = apex::bench::random_matrix<float>(tokens, d);
  // Rotating the same buffer every iteration keeps it in place; the values just keep turning.
  const apex::Index offset = kTablePositions - tokens;
  for (auto _ : state) {
    apex::apply_rope(table, offset, q);
    benchmark::DoNotOptimize(q.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, 2.0 * static_cast<double>(tokens * d) * sizeof(float));
}

void BM_Rope(benchmark::State& state) {
  run_rope(state, apex::RopeTable<float>(kTablePositions, kHeadDim));
}
BENCHMARK(BM_Rope)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime();

// Half-split tables (HuggingFace's layout): plain RoPE, the yardstick of this group, and each
// scaling with parameters of the kind checkpoints use.
std::vector<std::pair<std::string, apex::RopeTable<float>>> scaled_tables() {
  const apex::RopeParams half{10000.0, 0, apex::RopePairing::kHalfSplit};
  apex::LongRope longrope;
  longrope.short_factor.assign(kHeadDim / 2, 1.05);
  longrope.long_factor.assign(kHeadDim / 2, 4.0);
  longrope.original_context = 4096;
  longrope.scale = 32.0;
  apex::YarnParams yarn;
  yarn.scale = 4.0;
  yarn.original_context = 4096;
  const auto table = [&](const apex::RopeScaling& s) {
    return apex::scaled_rope_table<float>(kTablePositions, kHeadDim, half, s);
  };
  return {
      {"plain", apex::RopeTable<float>(kTablePositions, kHeadDim, half)},
      {"linear", table(apex::LinearRope{4.0})},
      {"dynamic", table(apex::DynamicNtkRope{4.0, 2048, 0})},
      {"llama3", table(apex::Llama3Rope{8.0, 1.0, 4.0, 2048})},
      {"longrope", table(longrope)},
      {"yarn", apex::yarn_table<float>(kTablePositions, kHeadDim, 0, half.pairing, yarn)},
  };
}

const bool kRegistered = [] {
  for (auto& [name, table] : scaled_tables()) {
    benchmark::RegisterBenchmark(
        ("BM_Rope/" + name).c_str(),
        [t = std::move(table)](benchmark::State& state) { run_rope(state, t); })
        ->ArgNames({"tokens", "d"})
        ->Args({4096, 4096})
        ->UseRealTime();
  }
  return true;
}();

}  // namespace
