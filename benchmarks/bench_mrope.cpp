// SPDX-License-Identifier: MIT
// Multimodal RoPE (mrope.hpp): the float table of BM_Rope (8192 positions, d_h = 128, default
// pairing) applied in place to a query projection [tokens, d], d = H·128, with three position
// ids per token, in Qwen2-VL's sections [16, 24, 24] and Qwen3-VL's interleaved [24, 20, 20].
// Memory-bound like BM_Rope (same binary, same shapes): read both against BM_MemCopy.
// BM_Mrope_Text gives every stream BM_Rope's positions, so BM_Mrope_Text / BM_Rope is what
// gathering each token's cos/sin row costs; the others draw each stream's ids at random (image
// and video tokens), which also reads three table rows per token from anywhere in the table.
#include <apex/mrope.hpp>

#include <benchmark/benchmark.h>

#include <random>

#include "bench_util.hpp"

namespace {

constexpr apex::Index kHeadDim = 128;
constexpr apex::Index kTablePositions = 8192;

using Ids = Eigen::Matrix<apex::Index, 3, Eigen::Dynamic>;

// Three streams of ids: each uniform in [0, kTablePositions) (the same every run), or all
// three at BM_Rope's positions kTablePositions − tokens + t (text).
Ids make_ids(apex::Index tokens, bool text) {
  Ids ids(3, tokens);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<apex::Index> pick(0, kTablePositions - 1);
  for (apex::Index t = 0; t < tokens; ++t) {
    for (apex::Index k = 0; k < 3; ++k) ids(k, t) = text ? kTablePositions - tokens + t : pick(rng);
  }
  return ids;
}

// Args: tokens, d. GBps counts the bytes of x read and written: 2·tokens·d·sizeof(float); the
// table rows it reads (3 per token, 128·2 floats each) are not counted.
void run_mrope(benchmark::State& state, const apex::MropeSections& sections, bool text) {
  const apex::Index tokens = state.range(0);
  const apex::Index d = state.range(1);
  const apex::RopeTable<float> table(kTablePositions, kHeadDim);
  apex::RowMatrix<float> q = apex::bench::random_matrix<float>(tokens, d);
  const Ids ids = make_ids(tokens, text);
  for (auto _ : state) {
    apex::apply_mrope(table, sections, ids, q);
    benchmark::DoNotOptimize(q.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, 2.0 * static_cast<double>(tokens * d) * sizeof(float));
}

const apex::MropeSections kQwen2Vl{{16, 24, 24}, apex::MropeLayout::kSections};
const apex::MropeSections kQwen3Vl{{24, 20, 20}, apex::MropeLayout::kInterleaved};

void BM_Mrope_Text(benchmark::State& state) { run_mrope(state, kQwen2Vl, true); }
void BM_Mrope_Sections(benchmark::State& state) { run_mrope(state, kQwen2Vl, false); }
void BM_Mrope_Interleaved(benchmark::State& state) { run_mrope(state, kQwen3Vl, false); }
BENCHMARK(BM_Mrope_Text)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime();
BENCHMARK(BM_Mrope_Sections)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime();
BENCHMARK(BM_Mrope_Interleaved)
    ->ArgNames({"tokens", "d"})
    ->ArgsProduct({{1, 512, 4096}, {1024, 4096}})
    ->UseRealTime();

}  // namespace
