// SPDX-License-Identifier: MIT
// RoPE (§4): a precomputed float table applied in place to a query projection [tokens, d],
// d = H·128 (heads side by side). Memory-bound: read it against BM_MemCopy of the same run.
#include <apex/rope.hpp>

#include <benchmark/benchmark.h>

#include "bench_util.hpp"

namespace {

constexpr apex::Index kHeadDim = 128;
constexpr apex::Index kTablePositions = 8192;

// Args: tokens, d. GBps counts the bytes of x read and written: 2·tokens·d·sizeof(float); the
// table rows it reads (tokens·128·2 floats) are not counted.
void BM_Rope(benchmark::State& state) {
  const apex::Index tokens = state.range(0);
  const apex::Index d = state.range(1);
  const apex::RopeTable<float> table(kTablePositions, kHeadDim);
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
BENCHMARK(BM_Rope)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime();

}  // namespace
