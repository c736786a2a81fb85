// SPDX-License-Identifier: MIT
// LayerNorm (layer_norm.hpp) in float, with γ and β (GPT-2, Phi). A memory-bound kernel: read
// BM_LayerNorm's GBps against BM_StreamCopy's (bytes read + written per second, same run).
#include <apex/layer_norm.hpp>

#include <benchmark/benchmark.h>

#include "bench_util.hpp"

namespace {

using apex::Index;

// Bytes of one LayerNorm call: x read, out written, γ and β read once.
double layer_norm_bytes(Index tokens, Index d) {
  return (2.0 * static_cast<double>(tokens) + 2.0) * static_cast<double>(d) * sizeof(float);
}

void BM_LayerNorm(benchmark::State& state) {
  const Index tokens = state.range(0);
  const Index d = state.range(1);
  const apex::RowMatrix<float> x = apex::bench::random_matrix<float>(tokens, d, 1, -3.0, 3.0);
  const apex::Vector<float> gamma = apex::bench::random_vector<float>(d, 2, 0.5, 1.5);
  const apex::Vector<float> beta = apex::bench::random_vector<float>(d, 3, -1.0, 1.0);
  apex::RowMatrix<float> out = apex::RowMatrix<float>::Zero(tokens, d);
  const apex::LayerNormParams params;
  for (auto _ : state) {
    apex::layer_norm(x, gamma, beta, params, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = apex::bench::gbps(state, layer_norm_bytes(tokens, d));
}
BENCHMARK(BM_LayerNorm)
    ->ArgNames({"tokens", "d"})
    ->Args({4096, 4096})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
