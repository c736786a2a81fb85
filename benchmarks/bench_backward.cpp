// SPDX-License-Identifier: MIT
// The backward pass of attention (apex::sdpa_backward), read against the forward kernel in the
// same run:
//   BM_SdpaBackward/causal/S  causal, S_q = S_k = S, H_q = 32, H_kv = 8, d_h = 128, B = 1, float:
//                dQ, dK and dV from Q, K, V, the forward's output and lse, and dO. GFLOPS counts
//                the backward's work as FlashAttention does, 2.5 × the forward's (five products
//                to the forward's two): 2.5 · 4·d_h·H_q per allowed pair, S²/2 pairs. Compare
//                with BM_Sdpa_Fast/causal/S (bench_attention.cpp): the target is a ratio of 0.6
//                or more. The forward runs once, outside the timed loop.
//   BM_SdpaBackward_PeakMemory  the same for one head at S = 65536, d_h = 128: extra_MiB is the
//                growth of the peak resident set during the call, beyond the inputs, the
//                forward's results and the gradients, which exist and are touched before (the
//                target: under 64 MiB). The call runs on a new thread, so its scratch starts empty.
// Threads: OpenMP, as many as OMP_NUM_THREADS says (the figures are meant for 2).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (fixed in GCC 13). The pragma must precede them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/config.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/sdpa_backward.hpp>
#include <apex/tensor.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <thread>

#include "bench_util.hpp"

namespace {

using apex::Index;
using apex::RowMatrix;

constexpr Index kHeadDim = 128;

/// One causal problem, [1, H, S, d_h] contiguous float heads: the inputs, the forward's results
/// (computed once), dO and the gradients (zeroed, so touched).
struct BackwardCase {
  BackwardCase(Index q_heads, Index kv_heads, Index s)
      : q(apex::bench::random_matrix<float>(q_heads * s, kHeadDim, 1)),
        k(apex::bench::random_matrix<float>(kv_heads * s, kHeadDim, 2)),
        v(apex::bench::random_matrix<float>(kv_heads * s, kHeadDim, 3)),
        d_out(apex::bench::random_matrix<float>(q_heads * s, kHeadDim, 4)),
        out(RowMatrix<float>::Zero(q_heads * s, kHeadDim)),
        lse(RowMatrix<float>::Zero(q_heads * s, 1)),
        dq(RowMatrix<float>::Zero(q_heads * s, kHeadDim)),
        dk(RowMatrix<float>::Zero(kv_heads * s, kHeadDim)),
        dv(RowMatrix<float>::Zero(kv_heads * s, kHeadDim)),
        q_shape{1, q_heads, s, kHeadDim},
        kv_shape{1, kv_heads, s, kHeadDim} {
    mask.positions = apex::causal_mask();
    apex::sdpa(view(q, q_shape), view(k, kv_shape), view(v, kv_shape), mask, params,
               view(out, q_shape), view(lse, {1, q_heads, s, 1}));
  }

  static apex::HeadsView<float> view(RowMatrix<float>& m, const apex::HeadsShape& shape) {
    return apex::HeadsView<float>::contiguous(m.data(), shape);
  }

  void backward() {
    apex::sdpa_backward(
        view(q, q_shape), view(k, kv_shape), view(v, kv_shape), mask, params, view(out, q_shape),
        view(lse, {1, q_shape.heads, q_shape.seq, 1}), view(d_out, q_shape),
        apex::SdpaGradients<float>{view(dq, q_shape), view(dk, kv_shape), view(dv, kv_shape)});
  }

  RowMatrix<float> q, k, v, d_out, out, lse, dq, dk, dv;
  apex::HeadsShape q_shape, kv_shape;
  apex::AttentionMask<float> mask;
  apex::SdpaParams params;
};

/// 2.5 × the forward's GFLOPS count of causal attention over S: 4·d_h·H_q per pair, S²/2 pairs.
double backward_flops(Index s, Index q_heads) {
  const double n = static_cast<double>(s);
  return 2.5 * (n * n / 2.0) * 4.0 * static_cast<double>(kHeadDim * q_heads);
}

void BM_SdpaBackward(benchmark::State& state) {
  const Index s = state.range(0);
  BackwardCase c(32, 8, s);
  for (auto _ : state) {
    c.backward();
    benchmark::DoNotOptimize(c.dq.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPS"] = apex::bench::gflops(state, backward_flops(s, 32));
}

void BM_SdpaBackward_PeakMemory(benchmark::State& state) {
  const Index s = state.range(0);
  BackwardCase c(1, 1, s);
  double extra_kib = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    if (!apex::bench::reset_peak_rss()) {
      state.SkipWithError("cannot reset the peak resident set (/proc/self/clear_refs)");
      break;
    }
    const double before = apex::bench::status_kib("VmRSS");
    state.ResumeTiming();
    std::thread call([&] { c.backward(); });  // a new thread: its scratch starts empty
    call.join();
    benchmark::DoNotOptimize(c.dq.data());
    benchmark::ClobberMemory();
    state.PauseTiming();
    extra_kib = std::max(extra_kib, apex::bench::status_kib("VmHWM") - before);
    state.ResumeTiming();
  }
  state.counters["extra_MiB"] = extra_kib / 1024.0;
  state.counters["GFLOPS"] = apex::bench::gflops(state, backward_flops(s, 1));
}

}  // namespace

BENCHMARK(BM_SdpaBackward)
    ->Name("BM_SdpaBackward/causal")
    ->ArgName("S")
    ->Arg(1024)
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaBackward_PeakMemory)
    ->ArgName("S")
    ->Arg(65536)
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
