// SPDX-License-Identifier: MIT
// The yardsticks every other benchmark is read against, measured in the same run:
//   BM_MemCopy  memory-bound kernels that read and write (bytes read + written per second)
//   BM_MemRead  memory-bound kernels that only read
//   BM_Gemm     compute-bound kernels (Eigen's float GEMM)
// The memory yardsticks use the threads the kernels use (detail::parallel_for, one contiguous
// chunk per thread), so a ratio compares like with like.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (the _mm512_undefined_* idiom; fixed in
// GCC 13). The pragma must precede the headers to cover them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

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

}  // namespace
