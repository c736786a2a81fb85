// SPDX-License-Identifier: MIT
// Many sequences at once (varlen.hpp, paged_cache.hpp), float, d_h = 128, read against
// bench_attention.cpp's single-sequence figures and the yardsticks in the same run:
//   BM_Varlen/causal/16384    16 sequences of random lengths summing to S = 16384 (the documents
//                             of BM_Sdpa_Fast/documents16, as separate sequences), each causal,
//                             H_q = 32, H_kv = 8, packed token-major, one sdpa_varlen call.
//                             GFLOPS counts 4·d_h·H_q per allowed pair, Σ_i L_i (L_i + 1) / 2:
//                             compare with BM_Sdpa_Fast/documents16/16384 (the same pairs as one
//                             sequence with a document mask) and BM_Sdpa_Fast/causal.
//   BM_PagedDecode/block:P/S  one new token (H_q = 32) against S tokens (H_kv = 8) of a
//                             PagedKvCache with pages of P tokens, through its block table.
//                             GBps counts the K and V bytes read: compare with
//                             BM_Decode_Fast/f32/S (the same keys stored contiguously). The
//                             sequence's pages follow one another in the pool (a pool is stored
//                             head-major, so each head then reads as one stream); with
//                             /scattered:8 they lie 8 pages apart, as after churn; with /q8_0
//                             the cache holds q8_0 blocks (kv_quant.hpp): compare with
//                             BM_Decode_Fast/q8_0/S.
//   BM_BatchDecode/seqs:64    one decoding step of 64 sequences of a PagedKvCache (pages of 64),
//                             lengths spread geometrically over 256 .. 32768 (439 K tokens in
//                             all), H_q = 8, H_kv = 2 (the group of 4 of BM_Decode_Fast): one
//                             sdpa_paged call. GBps counts the K and V bytes of every sequence:
//                             compare with BM_MemRead.
//   BM_TreeVerify/seqs:8/tree:16/cache:8192
//                             speculative verification: 8 sequences of a PagedKvCache (pages of
//                             64) hold 8192 committed tokens and a draft tree of 16 (random
//                             parents), H_q = 32, H_kv = 8; one sdpa_paged call with the 16 draft
//                             tokens of each as queries under tree_rules (tree_mask.hpp). GBps
//                             counts the K and V bytes held: compare with /tree:plain/, one
//                             decoding step (1 query a sequence) over the same caches.
//   BM_CascadeDecode/seqs:64/prefix:16384/suffix:256/<how>
//                             one decoding step of 64 sequences forked from one prompt of 16384
//                             tokens (pages of 64), each with 256 tokens of its own after it,
//                             H_q = 32, H_kv = 8; /cascade: sdpa_cascade (the prompt's pages
//                             read once for all 64), /paged: sdpa_paged over the same cache (read
//                             64 times); /bf16/… the same over a bfloat16 cache, with bfloat16
//                             products allowed (AMX tiles where the CPU has them). GBps counts the
//                             K and V bytes the cache holds (the prompt once and every suffix),
//                             for both: compare with BM_MemRead.
// Threads: OpenMP, as many as OMP_NUM_THREADS says (the figures are meant for 2).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (fixed in GCC 13). The pragma must precede them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/cache_memory.hpp>
#include <apex/cascade_attention.hpp>
#include <apex/config.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/tensor.hpp>
#include <apex/tree_mask.hpp>
#include <apex/varlen.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_util.hpp"

namespace {

using apex::Index;
using apex::RowMatrix;

constexpr Index kHeadDim = 128;

/// Token-major [1, heads, rows, d_h] storage with uniform values in [-1, 1).
struct Packed {
  Packed(Index heads, Index rows, std::uint64_t seed)
      : data(apex::bench::random_matrix<float>(rows, heads * kHeadDim, seed)),
        view(apex::HeadsView<float>::token_major(data.data(), {1, heads, rows, kHeadDim})) {}
  RowMatrix<float> data;
  apex::HeadsView<float> view;
};

void run_varlen(benchmark::State& state) {
  const Index s = state.range(0);
  const Index q_heads = 32, kv_heads = 8;
  const std::vector<Index> lengths = apex::bench::random_lengths(s, 16, 16);
  const apex::RaggedBatch batch = apex::RaggedBatch::from_lengths(lengths, lengths);
  const Packed q(q_heads, s, 1), k(kv_heads, s, 2), v(kv_heads, s, 3);
  Packed out(q_heads, s, 4);
  const apex::SdpaParams params;
  for (auto _ : state) {
    apex::sdpa_varlen(q.view, k.view, v.view, batch, {apex::causal_mask()}, params, out.view);
    benchmark::DoNotOptimize(out.data.data());
    benchmark::ClobberMemory();
  }
  double pairs = 0.0;
  for (const Index l : lengths) pairs += static_cast<double>(l) * static_cast<double>(l + 1) / 2.0;
  state.counters["GFLOPS"] =
      apex::bench::gflops(state, pairs * 4.0 * static_cast<double>(kHeadDim * q_heads));
}

/// A PagedKvCache of rows stored as Format holding sequences of the given lengths of random K/V,
/// appended 512 tokens at a time, so that each sequence's pages follow one another in the pool;
/// returns the cache and the sequences' ids. With `scatter` > 1, `scatter` − 1 other sequences
/// are appended a page at a time in turn with each one and then freed: its pages lie `scatter`
/// apart, as after churn.
template <class Format>
std::pair<apex::PagedKvCache<float, Format>, std::vector<apex::SequenceId>> filled_cache(
    const std::vector<Index>& lengths, Index kv_heads, Index page, Index scatter) {
  Index pages = 0;
  for (const Index l : lengths) pages += (l + page - 1) / page;
  apex::PagedKvCache<float, Format> cache({kv_heads, kHeadDim, page, pages * scatter});
  const Packed block(kv_heads, 512, 5);
  std::vector<apex::SequenceId> ids;
  for (const Index l : lengths) {
    ids.push_back(cache.add());
    std::vector<apex::SequenceId> others;
    for (Index o = 1; o < scatter; ++o) others.push_back(cache.add());
    const Index chunk = scatter > 1 ? page : 512;
    for (Index done = 0; done < l;) {
      const Index n = std::min<Index>(chunk, l - done);
      const auto rows = block.view.middle_rows(0, n);
      cache.append(ids.back(), rows, rows);
      for (const apex::SequenceId other : others) cache.append(other, rows, rows);
      done += n;
    }
    for (const apex::SequenceId other : others) cache.free(other);
  }
  return {std::move(cache), std::move(ids)};
}

/// One query per sequence against its whole paged history; GBps counts the K/V bytes held.
template <class Format = float>
void run_paged_decode(benchmark::State& state, const std::vector<Index>& lengths, Index q_heads,
                      Index kv_heads, Index page, Index scatter = 1) {
  const auto [cache, ids] = filled_cache<Format>(lengths, kv_heads, page, scatter);
  const auto n = static_cast<Index>(ids.size());
  std::vector<Index> cu;
  for (Index i = 0; i <= n; ++i) cu.push_back(i);
  const Packed q(q_heads, n, 6);
  Packed out(q_heads, n, 7);
  const apex::SdpaParams params;
  for (auto _ : state) {
    apex::sdpa_paged(q.view, cu, cache, ids, {apex::causal_mask()}, params, out.view);
    benchmark::DoNotOptimize(out.data.data());
    benchmark::ClobberMemory();
  }
  Index tokens = 0;
  for (const Index l : lengths) tokens += l;
  state.counters["GBps"] = apex::bench::gbps(
      state, static_cast<double>(apex::kv_cache_bytes<Format>(1, tokens, kv_heads, kHeadDim)));
}

/// Verification of draft trees of `draft` tokens (bushy: random parents) after `committed` tokens
/// in each of `seqs` sequences, their draft queries under tree_rules; draft = 0: one decoding
/// step over the same caches (committed + 16 tokens, one query each). GBps counts the K/V held.
void run_tree_verify(benchmark::State& state, Index seqs, Index draft, Index committed) {
  const Index q_heads = 32, kv_heads = 8, held = committed + 16;
  const auto [cache, ids] = filled_cache<float>(std::vector<Index>(seqs, held), kv_heads, 64, 1);
  const Index rows = std::max<Index>(draft, 1);
  std::vector<Index> cu;
  for (Index i = 0; i <= seqs; ++i) cu.push_back(i * rows);
  std::mt19937 rng(8);
  std::vector<apex::DraftTree> trees;
  for (Index i = 0; i < seqs && draft > 0; ++i) {
    std::vector<Index> parents;
    for (Index t = 0; t < draft; ++t) {
      parents.push_back(std::uniform_int_distribution<Index>(-1, t - 1)(rng));
    }
    trees.emplace_back(parents);
  }
  const apex::TreeMasks masks(trees, std::vector<Index>(trees.size(), held - draft));
  const Packed q(q_heads, seqs * rows, 6);
  Packed out(q_heads, seqs * rows, 7);
  const apex::SdpaParams params;
  for (auto _ : state) {
    apex::sdpa_paged(q.view, cu, cache, ids, {apex::causal_mask()}, apex::AttentionMask<float>{},
                     params, apex::tree_rules(masks), out.view);
    benchmark::DoNotOptimize(out.data.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = apex::bench::gbps(
      state, static_cast<double>(apex::kv_cache_bytes<float>(seqs, held, kv_heads, kHeadDim)));
}

/// One decoding step of `seqs` sequences forked from a prompt of `prefix` tokens, each holding
/// `suffix` tokens of its own after it (its query the last), through sdpa_cascade or sdpa_paged.
template <class Format>
void run_cascade_decode(benchmark::State& state, Index seqs, Index prefix, Index suffix,
                        bool cascade) {
  const Index q_heads = 32, kv_heads = 8, page = 64;
  apex::PagedKvCache<float, Format> cache(
      {kv_heads, kHeadDim, page, (prefix + seqs * (suffix + page)) / page});
  const Packed block(kv_heads, 512, 5);
  const auto append = [&](apex::SequenceId id, Index tokens) {
    for (Index done = 0; done < tokens; done += 512) {
      const auto rows = block.view.middle_rows(0, std::min<Index>(512, tokens - done));
      cache.append(id, rows, rows);
    }
  };
  std::vector<apex::SequenceId> ids{cache.add()};
  append(ids[0], prefix);
  while (static_cast<Index>(ids.size()) < seqs) ids.push_back(cache.fork(ids[0]));
  for (const apex::SequenceId id : ids) append(id, suffix);
  std::vector<Index> cu;
  for (Index i = 0; i <= seqs; ++i) cu.push_back(i);
  const Packed q(q_heads, seqs, 6);
  Packed out(q_heads, seqs, 7);
  apex::SdpaParams params;
  params.allow_bf16_products = std::is_same_v<Format, Eigen::bfloat16>;
  for (auto _ : state) {
    if (cascade) {
      apex::sdpa_cascade(q.view, cu, cache, ids, {apex::causal_mask()}, params, out.view);
    } else {
      apex::sdpa_paged(q.view, cu, cache, ids, {apex::causal_mask()}, params, out.view);
    }
    benchmark::DoNotOptimize(out.data.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      apex::bench::gbps(state, static_cast<double>(apex::kv_cache_bytes<Format>(
                                   1, prefix + seqs * suffix, kv_heads, kHeadDim)));
}

/// 64 lengths spread geometrically over [256, 32768].
std::vector<Index> spread_lengths() {
  std::vector<Index> lengths;
  for (int i = 0; i < 64; ++i) {
    lengths.push_back(static_cast<Index>(std::lround(256.0 * std::pow(128.0, i / 63.0))));
  }
  return lengths;
}

const bool kRegistered = [] {
  benchmark::RegisterBenchmark("BM_Varlen/causal", run_varlen)
      ->Arg(16384)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (const Index page : {16, 64, 256}) {
    benchmark::RegisterBenchmark(
        ("BM_PagedDecode/block:" + std::to_string(page)).c_str(),
        [page](benchmark::State& state) { run_paged_decode(state, {state.range(0)}, 32, 8, page); })
        ->Arg(32768)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_PagedDecode/block:16/q8_0",
                               [](benchmark::State& state) {
                                 run_paged_decode<apex::BlockQ8_0>(state, {state.range(0)}, 32, 8,
                                                                   16);
                               })
      ->Arg(32768)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(
      "BM_PagedDecode/block:16/scattered:8",
      [](benchmark::State& state) { run_paged_decode(state, {state.range(0)}, 32, 8, 16, 8); })
      ->Arg(32768)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(
      "BM_BatchDecode/seqs:64",
      [](benchmark::State& state) { run_paged_decode(state, spread_lengths(), 8, 2, 64); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (const Index draft : {16, 0}) {
    const std::string tree = draft > 0 ? "tree:16" : "tree:plain";
    benchmark::RegisterBenchmark(
        ("BM_TreeVerify/seqs:8/" + tree + "/cache:8192").c_str(),
        [draft](benchmark::State& state) { run_tree_verify(state, 8, draft, 8192); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const bool cascade : {true, false}) {
    const std::string how = cascade ? "cascade" : "paged";
    benchmark::RegisterBenchmark(
        ("BM_CascadeDecode/seqs:64/prefix:16384/suffix:256/" + how).c_str(),
        [cascade](benchmark::State& state) {
          run_cascade_decode<float>(state, 64, 16384, 256, cascade);
        })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(
        ("BM_CascadeDecode/bf16/seqs:64/prefix:16384/suffix:256/" + how).c_str(),
        [cascade](benchmark::State& state) {
          run_cascade_decode<Eigen::bfloat16>(state, 64, 16384, 256, cascade);
        })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
