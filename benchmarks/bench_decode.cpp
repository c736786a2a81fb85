// SPDX-License-Identifier: MIT
// One decoding step of one attention layer against a cache (§7.4, §8.3, §9.4, §10): project the
// new token, append it to the cache, attend over everything cached, project the output. Float
// arithmetic, batch 1, at APEX-1-like widths: d = 2048, H_q = 16 query heads of d_h = 128; the
// weights and the cache are stored as f32, or both as f16 / bf16 (Eigen::half, Eigen::bfloat16),
// or the weights as bf16 and the cache as q8_0, q4_0 or fp8 e4m3 blocks of 128 (kv_quant.hpp), the
// last part of the name: BM_DecodeStep/gqa/bf16/cache_len:32768, BM_DecodeStep/gqa/q8_0/....
//
//   BM_DecodeStep/mha           H_kv = 16, full KvCache                       (§7)
//   BM_DecodeStep/gqa           H_kv = 2 (G = 8), full KvCache                (§8)
//   BM_DecodeStep/mla_naive     d_q = 768, d_kv = 512, d_r = 64, H_kv = H_kr = 2, LatentCache;
//                               decompresses K and V of every cached token    (§9, the oracle)
//   BM_DecodeStep/mla_absorbed  the same layer and cache, W_UK and W_UV absorbed: attends to
//                               the latent rows directly                       (§9)
//   BM_DecodeStep/local_window  the gqa layer with a SlidingWindowCache of W = 4096 (APEX-1
//                               Large's window): constant work and memory past W   (§10)
//
//   BM_LatentAttention/<shape>  the attention of an absorbed MLA step alone (the sdpa call of
//                               forward_absorbed: all H_q query heads against the one key/value
//                               head [c_kv ‖ K_rope] / c_kv of a LatentCache), shape apex1 as
//                               the layer above (H_q = 16, d_kv = 512, H_kr = 2, d_r = 64) or
//                               deepseek (H_q = 128, d_kv = 512, one K_rope head of d_r = 64, as
//                               DeepSeek-V2/V3); GFLOPS counts 2·H_q·(2·d_kv + H_kr·d_r) flops
//                               per cached token: compare with BM_FmaPeak   (§9)
//
// cache_len is the number of cached tokens once the step is done (the step attends to all of
// them, or to the last W). Counters: cache_bytes is what the cache object owns (exactly
// cache_len tokens, or W for the ring); GBps is the cached keys and values (or latent rows) the
// attention reads per step, per second — compare with BM_MemRead; weight_bytes is what the
// layer's weights take. Every step reads all of them (in f32: 64 MiB for mha, 36 MiB for gqa and
// local_window, 41 MiB for mla, half that in 16 bits), which dominates the short caches; absorbed
// MLA is compute-bound at long ones (H_q·(2·d_kv + H_kr·d_r) multiply-adds per cached token,
// against the naive path's 2·d_kv·H_kv·d_h to decompress it). Threads: OpenMP, as many as
// OMP_NUM_THREADS says (the figures are meant for 2).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (fixed in GCC 13). The pragma must precede them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/config.hpp>
#include <apex/gqa.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/mla.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "bench_util.hpp"

namespace {

using apex::Index;
using apex::RowMatrix;

constexpr Index kModel = 2048;
constexpr Index kQueryHeads = 16;
constexpr Index kHeadDim = 128;
constexpr Index kGroupedKvHeads = 2;
constexpr Index kWindow = 4096;
constexpr Index kFill = 512;  // tokens of random K/V written per append while filling a cache

enum class Kind { kMha, kGqa, kMlaNaive, kMlaAbsorbed, kLocalWindow };

/// The benchmarks' layers, with their weights stored as Weight.
template <class Weight>
const apex::GroupedQueryAttention<float, Weight>& gqa_layer(Index kv_heads) {
  using Layer = apex::GroupedQueryAttention<float, Weight>;
  static const auto mha = Layer::random({kModel, kQueryHeads, kQueryHeads, kHeadDim}, 1);
  static const auto gqa = Layer::random({kModel, kQueryHeads, kGroupedKvHeads, kHeadDim}, 2);
  return kv_heads == kQueryHeads ? mha : gqa;
}

template <class Weight>
const apex::MultiHeadLatentAttention<float, Weight>& mla_layer() {
  static const auto layer = [] {
    apex::MlaConfig c;
    c.d_model = kModel;
    c.d_q = 768;
    c.d_kv = 512;
    c.num_q_heads = kQueryHeads;
    c.num_kv_heads = kGroupedKvHeads;
    c.head_dim = kHeadDim;
    c.rope_dim = 64;
    return apex::MultiHeadLatentAttention<float, Weight>::random(c, 3);
  }();
  return layer;
}

template <class Weight>
const apex::MlaAbsorbedWeights<Weight>& mla_absorbed() {
  static const auto absorbed = apex::absorb_mla_weights(mla_layer<Weight>());
  return absorbed;
}

/// Appends `count` tokens of random K/V (uniform in [-1, 1)) to a KvCache or SlidingWindowCache.
template <class Cache>
void fill_kv(Cache& cache, Index count) {
  const Index width = cache.num_kv_heads() * cache.head_dim();
  const RowMatrix<float> block = apex::bench::random_matrix<float>(kFill, width, 7);
  for (Index done = 0; done < count;) {
    const Index n = std::min(kFill, count - done);
    const auto view = apex::HeadsView<const float>::token_major(
        block.data(), {1, cache.num_kv_heads(), n, cache.head_dim()});
    cache.append(view, view, done);
    done += n;
  }
}

/// Appends `count` random latent rows [c_kv ‖ K_rope] to a LatentCache.
template <class Cache>
void fill_latent(Cache& cache, Index count) {
  const RowMatrix<float> block = apex::bench::random_matrix<float>(kFill, cache.row_width(), 8);
  for (Index done = 0; done < count;) {
    const Index n = std::min(kFill, count - done);
    cache.append(block.topRows(n), done);
    done += n;
  }
}

/// Decodes one token at position cache_len - 1 per iteration. The full caches are truncated
/// back after each step (O(1), inside the timed loop); the ring cannot be, so it keeps going
/// and is restored from a copy (outside the timing) when its positions reach the RoPE table's
/// end. The weights are stored as Storage, the cache as Format.
template <class Storage, class Format = Storage>
void BM_DecodeStep(benchmark::State& state, Kind kind) {
  const Index cache_len = state.range(0);
  const Index position = cache_len - 1;
  const RowMatrix<float> x = apex::bench::random_matrix<float>(1, kModel, 9);
  RowMatrix<float> out(1, kModel);
  apex::AttentionLayerParams<float> params;
  params.position_offset = position;
  std::int64_t cache_bytes = 0;
  std::int64_t weight_bytes = 0;
  double bytes_read = 0.0;

  if (kind == Kind::kMlaNaive || kind == Kind::kMlaAbsorbed) {
    const auto& layer = mla_layer<Storage>();
    weight_bytes = layer.weight_bytes();
    const apex::RopeTable<float> rope(cache_len, layer.config().rope_dim);
    params.rope = &rope;
    auto cache = layer.template make_cache<Format>(1, cache_len);
    fill_latent(cache, position);
    cache_bytes = cache.bytes();
    bytes_read = static_cast<double>(cache_bytes);
    for (auto _ : state) {
      if (kind == Kind::kMlaAbsorbed) {
        layer.forward_absorbed(x, apex::causal_mask(), params, mla_absorbed<Storage>(), cache, out);
      } else {
        layer.forward_cached(x, apex::causal_mask(), params, cache, out);
      }
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      cache.truncate(position);
    }
  } else if (kind == Kind::kLocalWindow) {
    const auto& layer = gqa_layer<Storage>(kGroupedKvHeads);
    weight_bytes = layer.weight_bytes();
    const Index steps = 4096;  // positions per pass before the ring is restored
    const apex::RopeTable<float> rope(position + steps, kHeadDim);
    params.rope = &rope;
    auto cache = layer.template make_window_cache<Format>(1, kWindow);
    fill_kv(cache, position);
    const auto start = cache;
    const apex::PositionMask rule = apex::sliding_window_mask(kWindow);
    cache_bytes = cache.bytes();  // the ring's W tokens, of which the step reads min(cache_len, W)
    bytes_read = static_cast<double>(cache_bytes) *
                 static_cast<double>(std::min(cache_len, kWindow)) / static_cast<double>(kWindow);
    for (auto _ : state) {
      if (cache.next_position() == position + steps) {
        state.PauseTiming();
        cache = start;
        state.ResumeTiming();
      }
      params.position_offset = cache.next_position();
      layer.forward_cached(x, rule, params, cache, out);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  } else {
    const auto& layer = gqa_layer<Storage>(kind == Kind::kMha ? kQueryHeads : kGroupedKvHeads);
    weight_bytes = layer.weight_bytes();
    const apex::RopeTable<float> rope(cache_len, kHeadDim);
    params.rope = &rope;
    auto cache = layer.template make_cache<Format>(1, cache_len);
    fill_kv(cache, position);
    cache_bytes = cache.bytes();
    bytes_read = static_cast<double>(cache_bytes);
    for (auto _ : state) {
      layer.forward_cached(x, apex::causal_mask(), params, cache, out);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      cache.truncate(position);
    }
  }
  state.counters["cache_bytes"] =
      benchmark::Counter(static_cast<double>(cache_bytes), benchmark::Counter::kDefaults,
                         benchmark::Counter::OneK::kIs1024);
  state.counters["weight_bytes"] =
      benchmark::Counter(static_cast<double>(weight_bytes), benchmark::Counter::kDefaults,
                         benchmark::Counter::OneK::kIs1024);
  state.counters["GBps"] = apex::bench::gbps(state, bytes_read);
}

/// The shapes of BM_LatentAttention: query heads, d_kv, K_rope heads, d_r.
struct LatentShape {
  Index heads, latent, rope_heads, rope_dim;
};

/// One decoding step's latent attention (absorbed queries of width d_kv + H_kr·d_r for every
/// query head, one token) over cache_len random rows of a LatentCache stored as Format.
template <class Format>
void BM_LatentAttention(benchmark::State& state, LatentShape shape) {
  const Index cache_len = state.range(0);
  apex::LatentCache<float, Format> cache(
      {1, shape.latent, shape.rope_heads, shape.rope_dim, cache_len});
  fill_latent(cache, cache_len);
  const Index width = cache.row_width();
  const RowMatrix<float> q = apex::bench::random_matrix<float>(1, shape.heads * width, 10);
  RowMatrix<float> out(1, shape.heads * shape.latent);
  const apex::SdpaParams params;  // scale 1/√(d_kv + H_kr·d_r)
  const auto queries =
      apex::HeadsView<const float>::token_major(q.data(), {1, shape.heads, 1, width});
  const auto target =
      apex::HeadsView<float>::token_major(out.data(), {1, shape.heads, 1, shape.latent});
  for (auto _ : state) {
    apex::sdpa(queries, cache.rows(), cache.latent(), apex::AttentionMask<float>{}, params, target);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double macs_per_token =
      static_cast<double>(shape.heads * (2 * shape.latent + shape.rope_heads * shape.rope_dim));
  state.counters["GFLOPS"] =
      apex::bench::gflops(state, 2.0 * macs_per_token * static_cast<double>(cache_len));
  state.counters["GBps"] = apex::bench::gbps(state, static_cast<double>(cache.bytes()));
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"cache_len"})
      ->Arg(1024)
      ->Arg(8192)
      ->Arg(32768)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

/// BM_DecodeStep/<kind>/<precision>: f32 for every kind, f16 and bf16 (Eigen::half and
/// Eigen::bfloat16 weights and caches, float arithmetic) for all but the naive MLA oracle, and
/// q8_0, q4_0 and fp8_e4m3 caches with bf16 weights for gqa, mla_absorbed and local_window
/// (mla_absorbed's fp8 cache in FlashMLA's rows: c_kv in e4m3 blocks of 128, K_rope in
/// bfloat16).
const bool kRegistered = [] {
  const std::pair<const char*, Kind> kinds[] = {{"mha", Kind::kMha},
                                                {"gqa", Kind::kGqa},
                                                {"mla_naive", Kind::kMlaNaive},
                                                {"mla_absorbed", Kind::kMlaAbsorbed},
                                                {"local_window", Kind::kLocalWindow}};
  const auto add = [](const std::string& name, Kind kind, auto storage, auto format) {
    using Storage = decltype(storage);
    using Format = decltype(format);
    benchmark::RegisterBenchmark(("BM_DecodeStep/" + name).c_str(), [kind](
                                                                        benchmark::State& state) {
      BM_DecodeStep<Storage, Format>(state, kind);
    })->Apply(decode_args);
  };
  for (const auto& [name, kind] : kinds) add(std::string(name) + "/f32", kind, float{}, float{});
  for (const auto& [name, kind] : kinds) {
    if (kind == Kind::kMlaNaive) continue;
    add(std::string(name) + "/f16", kind, Eigen::half{}, Eigen::half{});
    add(std::string(name) + "/bf16", kind, Eigen::bfloat16{}, Eigen::bfloat16{});
    if (kind == Kind::kMha) continue;
    add(std::string(name) + "/q8_0", kind, Eigen::bfloat16{}, apex::BlockQ8_0{});
    add(std::string(name) + "/q4_0", kind, Eigen::bfloat16{}, apex::BlockQ4_0{});
    if (kind == Kind::kMlaAbsorbed) {  // d_r = 64 is no whole block of 128: FlashMLA's rows
      add(std::string(name) + "/fp8_e4m3", kind, Eigen::bfloat16{},
          apex::FlashMlaFp8Row<512, 128>{});
    } else {
      add(std::string(name) + "/fp8_e4m3", kind, Eigen::bfloat16{}, apex::BlockFp8E4m3<128>{});
    }
  }
  const std::pair<const char*, LatentShape> shapes[] = {{"apex1", {kQueryHeads, 512, 2, 64}},
                                                        {"deepseek", {128, 512, 1, 64}}};
  for (const auto& [shape_name, latent_shape] : shapes) {
    const std::string prefix = "BM_LatentAttention/" + std::string(shape_name) + "/";
    const LatentShape shape = latent_shape;
    const auto add_latent = [&](const std::string& format, auto stored) {
      benchmark::RegisterBenchmark(
          (prefix + format).c_str(),
          [shape](benchmark::State& state) { BM_LatentAttention<decltype(stored)>(state, shape); })
          ->ArgNames({"cache_len"})
          ->Arg(32768)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    };
    add_latent("f32", float{});
    add_latent("bf16", Eigen::bfloat16{});
  }
  return true;
}();

}  // namespace
