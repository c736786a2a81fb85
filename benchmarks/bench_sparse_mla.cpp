// SPDX-License-Identifier: MIT
// DeepSeek Sparse Attention's decoding step at DeepSeek-V3.2's shapes, one sequence, against
// dense absorbed MLA in the same run: H_q = 128 absorbed query heads over latent rows
// [c_kv ‖ K_rope] of 512 + 64 values, an indexer of H_I = 64 heads of d_I = 128 and k = 2048.
// The layer's projections are the same for both and left out: these are the attention parts.
//   BM_SparseMlaDecode/<format>/indexer/<S>    LightningIndexer::select over S cached keys;
//                                              GBps counts the key bytes (read against BM_MemRead)
//   BM_SparseMlaDecode/<format>/attention/<S>  sdpa_sparse over the 2048 selected latent rows
//   BM_SparseMlaDecode/<format>/step/<S>       both: the whole sparse step
//   BM_SparseMlaDecode/<format>/indexer_bf16/<S>, .../step_bf16/<S>: the same with the indexer's
//                                              bfloat16 products permitted (allow_bf16_products)
//   BM_DenseMlaDecode/<format>/<S>             absorbed MLA over all S rows (sdpa), at S = 2048
//                                              (what the attention part should cost) and at S
//   BM_SparseMlaPrefill/<S>                    a prompt of S tokens: the indexer selects for every
//                                              query, then sdpa_sparse attends (absorbed, f32)
//   BM_SparseMlaPrefill/indexer/<S>            the indexer's part of it
//   BM_DenseMlaPrefill/<S>                     MLA's dense prefill: causal sdpa over decompressed
//                                              heads (d_qk = 192, d_v = 128), as forward() runs it
// <format>: f32 (latent rows and indexer keys in float), bf16_fp8 (latent rows in bfloat16,
// indexer keys in DeepSeek's fp8 e4m3 with a float scale per 128 values) or bf16 (both in
// bfloat16). GFLOPS counts
// 2·H_q·(2·d_kv + d_r) flops per attended row, and 2·H_I·d_I per scored key.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12's own AVX-512 headers warn (-Wmaybe-uninitialized) when Eigen's kernels are inlined at
// -O3 -march=native; see yardsticks.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/indexer.hpp>
#include <apex/kv_quant.hpp>
#include <apex/sdpa.hpp>
#include <apex/sparse_attention.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

using apex::HeadsView;
using apex::Index;
using apex::RowMatrix;

constexpr Index kHeads = 128, kLatent = 512, kRope = 64, kRow = kLatent + kRope;
constexpr Index kIndexHeads = 64, kIndexDim = 128, kTopK = 2048;
constexpr Index kLongest = 131072;

/// Entry i of a deterministic fill in [-1, 1) (a hash, fast enough for 10^8 entries).
float fill_value(std::uint64_t i) {
  i = (i ^ (i >> 31)) * 0x7fb5d329728ea185ULL;
  i = (i ^ (i >> 27)) * 0x81dadef4bc2dd44dULL;
  return static_cast<float>(static_cast<double>(i >> 40) / double(1 << 23) - 1.0);
}

/// The cached rows of one sequence of kLongest tokens, stored in one format each.
template <class Latent, class Key>
struct DecodeCache {
  std::vector<Latent> rows;  // [kLongest, kRow]
  std::vector<Key> keys;     // [kLongest, d_I in elements]

  DecodeCache() {
    rows.resize(std::size_t(kLongest * kRow));
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = Latent(fill_value(i));
    const Index width = apex::KvFormat<Key>::elements(kIndexDim);
    keys.resize(std::size_t(kLongest * width));
    std::vector<float> row(static_cast<std::size_t>(kIndexDim));
    for (Index s = 0; s < kLongest; ++s) {
      for (Index j = 0; j < kIndexDim; ++j)
        row[std::size_t(j)] = fill_value(~std::uint64_t(s * kIndexDim + j));
      apex::KvFormat<Key>::store_row(row.data(), kIndexDim, keys.data() + s * width);
    }
  }
  HeadsView<const Latent> latent_rows(Index s) const {
    return HeadsView<const Latent>(rows.data(), {1, 1, s, kRow}, {0, 0, kRow});
  }
  HeadsView<const Latent> latent(Index s) const {
    return HeadsView<const Latent>(rows.data(), {1, 1, s, kLatent}, {0, 0, kRow});
  }
  HeadsView<const Key> index_keys(Index s) const {
    const Index width = apex::KvFormat<Key>::elements(kIndexDim);
    return HeadsView<const Key>(keys.data(), {1, 1, s, width}, {0, 0, width});
  }
};

template <class Latent, class Key>
const DecodeCache<Latent, Key>& decode_cache() {
  static const DecodeCache<Latent, Key> cache;
  return cache;
}

/// The indexer whose select() the step runs (its projections are not used here), with exact
/// float products or with bfloat16 products permitted (IndexerConfig::allow_bf16_products).
const apex::LightningIndexer<float>& indexer(bool bf16_products = false) {
  const auto make = [](bool bf16) {
    apex::IndexerConfig c;
    c.d_model = 64;
    c.d_q = 64;
    c.heads = kIndexHeads;
    c.head_dim = kIndexDim;
    c.rope_dim = kRope;
    c.top_k = kTopK;
    c.allow_bf16_products = bf16;
    return apex::LightningIndexer<float>::random(c, 1);
  };
  static const auto exact = make(false);
  static const auto rounded = make(true);
  return bf16_products ? rounded : exact;
}

/// The step's inputs: the absorbed query [1, H_q, 1, kRow], the indexer's query and weights.
struct StepInputs {
  RowMatrix<float> q = apex::bench::random_matrix<float>(1, kHeads* kRow, 3);
  RowMatrix<float> q_index = apex::bench::random_matrix<float>(1, kIndexHeads* kIndexDim, 4);
  RowMatrix<float> w_index = apex::bench::random_matrix<float>(1, kIndexHeads, 5, 0.0, 0.02);
  HeadsView<const float> query() const {
    return HeadsView<const float>::token_major(q.data(), {1, kHeads, 1, kRow});
  }
};

const StepInputs& inputs() {
  static const StepInputs in;
  return in;
}

/// What a decoding benchmark times: the indexer's selection, the attention over the selected
/// rows, or both; the indexer with exact products or with bfloat16 products permitted.
struct Part {
  bool select = true;
  bool attend = true;
  bool bf16_products = false;
};

template <class Latent, class Key>
void BM_SparseMlaDecode(benchmark::State& state, Part part) {
  const Index s = state.range(0);
  const auto& cache = decode_cache<Latent, Key>();
  const StepInputs& in = inputs();
  RowMatrix<float> out(kHeads, kLatent);
  const auto o = HeadsView<float>::token_major(out.data(), {1, kHeads, 1, kLatent});
  apex::SdpaParams params;
  params.scale = 1.0 / std::sqrt(192.0);
  const auto& scorer = indexer(part.bf16_products);
  apex::KeySelection selected = scorer.select(in.q_index, in.w_index, cache.index_keys(s), s - 1);
  for (auto _ : state) {
    if (part.select) selected = scorer.select(in.q_index, in.w_index, cache.index_keys(s), s - 1);
    if (part.attend) {
      apex::sdpa_sparse(in.query(), cache.latent_rows(s), cache.latent(s), selected, params, o);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double attention = 2.0 * kHeads * (2.0 * kLatent + kRope) * double(std::min(s, kTopK));
  const double scoring = 2.0 * kIndexHeads * kIndexDim * double(s);
  const double key_bytes =
      double(apex::KvFormat<Key>::bytes(s * apex::KvFormat<Key>::elements(kIndexDim)));
  if (!part.attend) state.counters["GBps"] = apex::bench::gbps(state, key_bytes);
  state.counters["GFLOPS"] =
      apex::bench::gflops(state, (part.attend ? attention : 0.0) + (part.select ? scoring : 0.0));
}

template <class Latent, class Key>
void BM_DenseMlaDecode(benchmark::State& state) {
  const Index s = state.range(0);
  const auto& cache = decode_cache<Latent, Key>();
  const StepInputs& in = inputs();
  RowMatrix<float> out(kHeads, kLatent);
  const auto o = HeadsView<float>::token_major(out.data(), {1, kHeads, 1, kLatent});
  apex::SdpaParams params;
  params.scale = 1.0 / std::sqrt(192.0);
  for (auto _ : state) {
    apex::sdpa(in.query(), cache.latent_rows(s), cache.latent(s), apex::AttentionMask<float>{},
               params, o);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPS"] =
      apex::bench::gflops(state, 2.0 * kHeads * (2.0 * kLatent + kRope) * double(s));
}

/// A prompt of S tokens (S <= kLongest) of the f32 cache: the indexer's queries and weights per
/// token and the absorbed queries [1, H_q, S, kRow].
struct PromptInputs {
  Index s;
  RowMatrix<float> q, q_index, w_index;
  explicit PromptInputs(Index tokens)
      : s(tokens),
        q(apex::bench::random_matrix<float>(tokens, kHeads * kRow, 6)),
        q_index(apex::bench::random_matrix<float>(tokens, kIndexHeads * kIndexDim, 7)),
        w_index(apex::bench::random_matrix<float>(tokens, kIndexHeads, 8, 0.0, 0.02)) {}
};

void BM_SparseMlaPrefill(benchmark::State& state, bool indexer_only) {
  const Index s = state.range(0);
  const auto& cache = decode_cache<float, float>();
  const PromptInputs in(s);
  RowMatrix<float> out(s, kHeads * kLatent);
  const auto o = HeadsView<float>::token_major(out.data(), {1, kHeads, s, kLatent});
  const auto q = HeadsView<const float>::token_major(in.q.data(), {1, kHeads, s, kRow});
  apex::SdpaParams params;
  params.scale = 1.0 / std::sqrt(192.0);
  for (auto _ : state) {
    const apex::KeySelection selected =
        indexer().select(in.q_index, in.w_index, cache.index_keys(s), 0);
    if (!indexer_only) {
      apex::sdpa_sparse(q, cache.latent_rows(s), cache.latent(s), selected, params, o);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

void BM_DenseMlaPrefill(benchmark::State& state) {
  const Index s = state.range(0);
  const Index d_qk = 192, d_v = 128;
  const RowMatrix<float> q = apex::bench::random_matrix<float>(s, kHeads * d_qk, 9);
  const RowMatrix<float> k = apex::bench::random_matrix<float>(s, kHeads * d_qk, 10);
  const RowMatrix<float> v = apex::bench::random_matrix<float>(s, kHeads * d_v, 11);
  RowMatrix<float> out(s, kHeads * d_v);
  apex::AttentionMask<float> causal;
  causal.positions.causal = true;
  for (auto _ : state) {
    apex::sdpa(HeadsView<const float>::token_major(q.data(), {1, kHeads, s, d_qk}),
               HeadsView<const float>::token_major(k.data(), {1, kHeads, s, d_qk}),
               HeadsView<const float>::token_major(v.data(), {1, kHeads, s, d_v}), causal, {},
               HeadsView<float>::token_major(out.data(), {1, kHeads, s, d_v}));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

template <class Latent, class Key>
void register_format(const std::string& name) {
  const std::pair<const char*, Part> parts[] = {{"indexer", {true, false, false}},
                                                {"attention", {false, true, false}},
                                                {"step", {true, true, false}},
                                                {"indexer_bf16", {true, false, true}},
                                                {"step_bf16", {true, true, true}}};
  for (const auto& [part_name, part] : parts) {
    const Part which = part;
    benchmark::RegisterBenchmark(
        ("BM_SparseMlaDecode/" + name + "/" + part_name).c_str(),
        [which](benchmark::State& st) { BM_SparseMlaDecode<Latent, Key>(st, which); })
        ->ArgName("S")
        ->Arg(kLongest)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark(("BM_DenseMlaDecode/" + name).c_str(),
                               BM_DenseMlaDecode<Latent, Key>)
      ->ArgName("S")
      ->Arg(kTopK)
      ->Arg(kLongest)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

const int kRegistered = [] {
  register_format<float, float>("f32");
  register_format<Eigen::bfloat16, apex::BlockFp8E4m3<128>>("bf16_fp8");
  register_format<Eigen::bfloat16, Eigen::bfloat16>("bf16");
  for (const bool indexer_only : {false, true}) {
    benchmark::RegisterBenchmark(
        indexer_only ? "BM_SparseMlaPrefill/indexer" : "BM_SparseMlaPrefill",
        [indexer_only](benchmark::State& st) { BM_SparseMlaPrefill(st, indexer_only); })
        ->ArgName("S")
        ->Arg(16384)
        ->Iterations(1)
        ->UseRealTime()
        ->Unit(benchmark::kSecond);
  }
  benchmark::RegisterBenchmark("BM_DenseMlaPrefill", BM_DenseMlaPrefill)
      ->ArgName("S")
      ->Arg(16384)
      ->Iterations(1)
      ->UseRealTime()
      ->Unit(benchmark::kSecond);
  return 0;
}();

}  // namespace
