// SPDX-License-Identifier: MIT
// RMSNorm (§3) in float. A memory-bound kernel: read BM_RmsNorm's GBps against BM_StreamCopy's
// (bytes read + written per second, same run). BM_RmsNorm_PlainEigen is the obvious Eigen
// one-liner (float accumulation, single thread, a temporary per call), for comparison.
// BM_AddRmsNorm is the fused residual add + RMSNorm (add_rms_norm); BM_AddThenRmsNorm the two
// steps it replaces (`residual += x`, Eigen's, then rms_norm), with the same byte count (what
// the fused kernel must move), so that their times compare directly.
#include <apex/rms_norm.hpp>

#include <benchmark/benchmark.h>

#include "bench_util.hpp"

namespace {

using apex::Index;

// Bytes of one RMSNorm call: x read, out written, γ read once.
double rms_norm_bytes(Index tokens, Index d) {
  return (2.0 * static_cast<double>(tokens) + 1.0) * static_cast<double>(d) * sizeof(float);
}

// Times `norm(x, gamma, out)` on x [tokens, d] = [state.range(0), state.range(1)] (uniform in
// [-3, 3)) and γ uniform in [0.5, 1.5), built outside the loop, and sets the GBps counter.
template <class Norm>
void run_rms_norm(benchmark::State& state, const Norm& norm) {
  const Index tokens = state.range(0);
  const Index d = state.range(1);
  const apex::RowMatrix<float> x = apex::bench::random_matrix<float>(tokens, d, 1, -3.0, 3.0);
  const apex::Vector<float> gamma = apex::bench::random_vector<float>(d, 2, 0.5, 1.5);
  apex::RowMatrix<float> out = apex::RowMatrix<float>::Zero(tokens, d);
  for (auto _ : state) {
    norm(x, gamma, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = apex::bench::gbps(state, rms_norm_bytes(tokens, d));
}

void BM_RmsNorm(benchmark::State& state) {
  const apex::RmsNormParams params;
  run_rms_norm(state, [&](const auto& x, const auto& gamma, auto& out) {
    apex::rms_norm(x, gamma, params, out);
  });
}
BENCHMARK(BM_RmsNorm)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_RmsNorm_PlainEigen(benchmark::State& state) {
  const float eps = 1e-6f;
  const float inv_d = 1.0f / static_cast<float>(state.range(1));
  run_rms_norm(state, [&](const auto& x, const auto& gamma, auto& out) {
    out = (x.array().colwise() * ((x.array().square().rowwise().sum() * inv_d + eps).rsqrt()))
              .rowwise() *
          gamma.transpose().array();
  });
}
BENCHMARK(BM_RmsNorm_PlainEigen)
    ->ArgNames({"tokens", "d"})
    ->Args({4096, 4096})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// Bytes of one fused add + RMSNorm: x and residual read, residual and out written, γ read once.
double add_rms_norm_bytes(Index tokens, Index d) {
  return (4.0 * static_cast<double>(tokens) + 1.0) * static_cast<double>(d) * sizeof(float);
}

// Times `step(x, residual, gamma, out)` on x, residual [tokens, d] = [state.range(0),
// state.range(1)] (uniform in [-3, 3); the residual grows by x at every iteration, harmlessly)
// and γ uniform in [0.5, 1.5), and sets the GBps counter of the fused kernel's bytes.
template <class Step>
void run_add_rms_norm(benchmark::State& state, const Step& step) {
  const Index tokens = state.range(0);
  const Index d = state.range(1);
  const apex::RowMatrix<float> x = apex::bench::random_matrix<float>(tokens, d, 1, -3.0, 3.0);
  apex::RowMatrix<float> residual = apex::bench::random_matrix<float>(tokens, d, 3, -3.0, 3.0);
  const apex::Vector<float> gamma = apex::bench::random_vector<float>(d, 2, 0.5, 1.5);
  apex::RowMatrix<float> out = apex::RowMatrix<float>::Zero(tokens, d);
  for (auto _ : state) {
    step(x, residual, gamma, out);
    benchmark::DoNotOptimize(residual.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = apex::bench::gbps(state, add_rms_norm_bytes(tokens, d));
}

void BM_AddRmsNorm(benchmark::State& state) {
  const apex::RmsNormParams params;
  run_add_rms_norm(state, [&](const auto& x, auto& residual, const auto& gamma, auto& out) {
    apex::add_rms_norm(x, residual, gamma, params, out);
  });
}
BENCHMARK(BM_AddRmsNorm)
    ->ArgNames({"tokens", "d"})
    ->Args({4096, 4096})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_AddThenRmsNorm(benchmark::State& state) {
  const apex::RmsNormParams params;
  run_add_rms_norm(state, [&](const auto& x, auto& residual, const auto& gamma, auto& out) {
    residual += x;
    apex::rms_norm(residual, gamma, params, out);
  });
}
BENCHMARK(BM_AddThenRmsNorm)
    ->ArgNames({"tokens", "d"})
    ->Args({4096, 4096})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
