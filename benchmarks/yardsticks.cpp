// SPDX-License-Identifier: MIT
// The yardsticks every other benchmark is read against, measured in the same run:
//   BM_MemCopy  memory-bound kernels that read and write (bytes read + written per second)
//   BM_MemRead  memory-bound kernels that only read
//   BM_StreamCopy  the same copy as an ordinary vector loop (memcpy may switch to non-temporal
//               stores for large copies on some CPUs, which a kernel's own stores do not do)
//   BM_Gemm     compute-bound kernels (Eigen's float GEMM)
//   BM_FmaPeak  the machine's float limit: independent chains of fused multiply-adds on the
//               widest vectors this CPU runs (AVX-512, else AVX2 + FMA), whatever the build
//               targets, on every thread; BLAS-free
// The memory yardsticks use the threads the kernels use (detail::parallel_for, one contiguous
// chunk per thread), so a ratio compares like with like.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (the _mm512_undefined_* idiom; fixed in
// GCC 13). The pragma must precede the headers to cover them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/config.hpp>
#include <apex/cpu.hpp>
#include <apex/detail/parallel.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if APEX_X86_KERNELS
#include <immintrin.h>
#endif

#include "bench_util.hpp"

namespace {

using apex::Index;

// [begin, end) of chunk c when `size` units are split into `chunks` contiguous chunks.
struct Chunk {
  std::size_t begin, end;
};
Chunk chunk_of(std::size_t size, Index chunks, Index c) {
  const std::size_t n = static_cast<std::size_t>(chunks);
  const std::size_t i = static_cast<std::size_t>(c);
  return {size * i / n, size * (i + 1) / n};
}

// A buffer of `bytes` bytes, first touched by the threads that will use each chunk.
std::unique_ptr<std::uint64_t[]> touched_buffer(std::size_t words, Index chunks,
                                                std::uint64_t fill) {
  std::unique_ptr<std::uint64_t[]> buffer(new std::uint64_t[words]);
  apex::detail::parallel_for(chunks, [&](Index c) {
    const Chunk k = chunk_of(words, chunks, c);
    std::fill(buffer.get() + k.begin, buffer.get() + k.end, fill + static_cast<std::uint64_t>(c));
  });
  return buffer;
}

// Copies state.range(0) bytes from one buffer to another with std::memcpy, one contiguous
// chunk per thread. GBps counts the bytes read plus the bytes written.
void BM_MemCopy(benchmark::State& state) {
  const std::size_t words = static_cast<std::size_t>(state.range(0)) / sizeof(std::uint64_t);
  const Index chunks = apex::detail::max_threads();
  const auto src = touched_buffer(words, chunks, 1);
  const auto dst = touched_buffer(words, chunks, 0);
  for (auto _ : state) {
    apex::detail::parallel_for(chunks, [&](Index c) {
      const Chunk k = chunk_of(words, chunks, c);
      std::memcpy(dst.get() + k.begin, src.get() + k.begin,
                  (k.end - k.begin) * sizeof(std::uint64_t));
    });
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, 2.0 * static_cast<double>(words * sizeof(std::uint64_t)));
}
BENCHMARK(BM_MemCopy)->Arg(256 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

// dst[0, n) = src[0, n) as 64-bit words, with vector loads and stores of the widest width the
// CPU runs (the intrinsics keep a compiler from turning the loop into a call of memcpy).
#if APEX_X86_KERNELS
__attribute__((target("avx512f"))) void copy_avx512(std::uint64_t* dst, const std::uint64_t* src,
                                                    std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  }
  for (; i < n; ++i) dst[i] = src[i];
}
__attribute__((target("avx2"))) void copy_avx2(std::uint64_t* dst, const std::uint64_t* src,
                                               std::size_t n) {
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  for (; i < n; ++i) dst[i] = src[i];
}
#endif
void vector_copy(std::uint64_t* dst, const std::uint64_t* src, std::size_t n) {
#if APEX_X86_KERNELS
  if (apex::cpu_supports(apex::KernelIsa::kAvx512)) return copy_avx512(dst, src, n);
  if (apex::cpu_supports(apex::KernelIsa::kAvx2)) return copy_avx2(dst, src, n);
#endif
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = src[i];
    benchmark::ClobberMemory();  // one word at a time; no x86-64 machine takes this path
  }
}

// BM_MemCopy with vector_copy in place of memcpy. GBps counts the bytes read plus written.
void BM_StreamCopy(benchmark::State& state) {
  const std::size_t words = static_cast<std::size_t>(state.range(0)) / sizeof(std::uint64_t);
  const Index chunks = apex::detail::max_threads();
  const auto src = touched_buffer(words, chunks, 1);
  const auto dst = touched_buffer(words, chunks, 0);
  for (auto _ : state) {
    apex::detail::parallel_for(chunks, [&](Index c) {
      const Chunk k = chunk_of(words, chunks, c);
      vector_copy(dst.get() + k.begin, src.get() + k.begin, k.end - k.begin);
    });
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, 2.0 * static_cast<double>(words * sizeof(std::uint64_t)));
}
BENCHMARK(BM_StreamCopy)->Arg(256 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

// Sums state.range(0) bytes as 64-bit words (integer addition, which the compiler vectorises
// freely), one contiguous chunk per thread. GBps counts the bytes read.
void BM_MemRead(benchmark::State& state) {
  const std::size_t words = static_cast<std::size_t>(state.range(0)) / sizeof(std::uint64_t);
  const Index chunks = apex::detail::max_threads();
  const auto src = touched_buffer(words, chunks, 3);
  std::vector<std::uint64_t> partial(static_cast<std::size_t>(chunks));
  for (auto _ : state) {
    apex::detail::parallel_for(chunks, [&](Index c) {
      const Chunk k = chunk_of(words, chunks, c);
      const std::uint64_t* p = src.get();
      std::uint64_t sum = 0;
      for (std::size_t i = k.begin; i < k.end; ++i) sum += p[i];
      partial[static_cast<std::size_t>(c)] = sum;
    });
    std::uint64_t total = 0;
    for (const std::uint64_t s : partial) total += s;
    benchmark::DoNotOptimize(total);
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, static_cast<double>(words * sizeof(std::uint64_t)));
}
BENCHMARK(BM_MemRead)->Arg(256 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

// Eigen's float GEMM, C = A · B with M = N = K = state.range(0) (threaded by Eigen itself when
// built with OpenMP). GFLOPS counts 2·M·N·K per product.
void BM_Gemm(benchmark::State& state) {
  const Index n = state.range(0);
  const apex::RowMatrix<float> a = apex::bench::random_matrix<float>(n, n, 1);
  const apex::RowMatrix<float> b = apex::bench::random_matrix<float>(n, n, 2);
  apex::RowMatrix<float> c = apex::RowMatrix<float>::Zero(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  const double size = static_cast<double>(n);
  state.counters["GFLOPS"] = apex::bench::gflops(state, 2.0 * size * size * size);
}
BENCHMARK(BM_Gemm)->Arg(4096)->UseRealTime()->Unit(benchmark::kMillisecond);

// Runs `iterations` rounds of kChains independent chains x <- x·a + b on the widest vectors the
// CPU runs and returns the number of floating-point operations (2 per lane per fused
// multiply-add). kChains accumulators cover the latency of every FMA unit (4 cycles × 2 units
// needs 8; 12 and 16 leave room).
#if APEX_X86_KERNELS
__attribute__((target("avx512f"))) double fma_chains_avx512(Index iterations, float* sink) {
  constexpr int kChains = 16;
  __m512 x[kChains];
  for (int c = 0; c < kChains; ++c) x[c] = _mm512_set1_ps(1.0F + 0.01F * static_cast<float>(c));
  const __m512 a = _mm512_set1_ps(0.999999F);
  const __m512 b = _mm512_set1_ps(1e-6F);
  for (Index i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) x[c] = _mm512_fmadd_ps(x[c], a, b);
  }
  __m512 sum = x[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, x[c]);
  _mm512_storeu_ps(sink, sum);
  return 2.0 * 16 * kChains * static_cast<double>(iterations);
}
__attribute__((target("avx2,fma"))) double fma_chains_avx2(Index iterations, float* sink) {
  constexpr int kChains = 12;
  __m256 x[kChains];
  for (int c = 0; c < kChains; ++c) x[c] = _mm256_set1_ps(1.0F + 0.01F * static_cast<float>(c));
  const __m256 a = _mm256_set1_ps(0.999999F);
  const __m256 b = _mm256_set1_ps(1e-6F);
  for (Index i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) x[c] = _mm256_fmadd_ps(x[c], a, b);
  }
  __m256 sum = x[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, x[c]);
  _mm256_storeu_ps(sink, sum);
  return 2.0 * 8 * kChains * static_cast<double>(iterations);
}
#endif
double fma_chains(Index iterations, float* sink) {
#if APEX_X86_KERNELS
  if (apex::cpu_supports(apex::KernelIsa::kAvx512)) return fma_chains_avx512(iterations, sink);
  if (apex::cpu_supports(apex::KernelIsa::kAvx2)) return fma_chains_avx2(iterations, sink);
#endif
  float x = 1.0F;
  for (Index i = 0; i < iterations; ++i) x = x * 0.999999F + 1e-6F;
  sink[0] = x;
  return 2.0 * static_cast<double>(iterations);
}

// The FMA peak: state.range(0) rounds of fma_chains on every thread. GFLOPS counts the
// operations of all threads.
void BM_FmaPeak(benchmark::State& state) {
  const Index threads = apex::detail::max_threads();
  std::vector<float> sinks(static_cast<std::size_t>(threads) * 16);
  double flops = 0;
  for (auto _ : state) {
    std::vector<double> done(static_cast<std::size_t>(threads));
    apex::detail::parallel_for(threads, [&](Index t) {
      const auto i = static_cast<std::size_t>(t);
      done[i] = fma_chains(state.range(0), sinks.data() + 16 * i);
    });
    for (const double d : done) flops += d;
    benchmark::DoNotOptimize(sinks.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_FmaPeak)->Arg(1 << 22)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
