// SPDX-License-Identifier: MIT
// Scaled dot-product attention (§6, §8, §10): the tiled kernel behind apex::sdpa against the
// plain reference, read against the yardsticks of yardsticks.cpp in the same run:
//   BM_Sdpa_*    prefill, S_q = S_k = S, H_q = 32, H_kv = 8, d_h = 128, B = 1, float. GFLOPS
//                counts 4·d_h·H_q per allowed (query, key) pair: 4·S²·d_h·H_q for full
//                attention, exactly half of it for causal, the allowed pairs of the others:
//                window512 (Σ_i min(i + 1, 512)), chunked4096 (chunked local attention in chunks
//                of 4096, causal inside each: Σ_i (i mod 4096) + 1), documents16 (16 documents
//                of random lengths packed into S, causal inside each: Σ_d L_d (L_d + 1) / 2);
//                alibi is causal with ALiBi's standard slopes, user_causal causal attention
//                written as a user rule with its block classifier (both the causal pairs). Compare
//                with BM_Gemm, and each rule's GFLOPS with causal's at the same S: equal GFLOPS
//                means a time in proportion to the allowed pairs. BM_Sdpa_Fast/causal/f16 and /bf16
//                store K and V in 16 bits (Q and the output in float); /bf16_products also
//                permits bfloat16 products (SdpaParams::allow_bf16_products: AVX512-BF16's dot
//                products where the CPU has them); /q8_0 stores them as q8_0 blocks, widened a
//                block of keys at a time. Compare with BM_Sdpa_Fast/causal at the same S and
//                with BM_FmaPeak.
//   BM_Decode_Fast/<precision>  one new token against a cache of S tokens, H_q = 32, H_kv = 8,
//                d_h = 128, K and V stored as f32, f16, bf16, q8_0, q4_0 or fp8_e4m3 (blocks of
//                128 with a float scale): GBps counts the K and V bytes as stored, which every
//                call reads once. Compare with BM_MemRead, and the formats' times with f16's.
//   BM_Sdpa_Fast_PeakMemory  causal attention over S = 65536 (one head, d_h = 128): extra_MiB
//                is the growth of the peak resident set during the call, beyond the inputs and
//                the output that already exist (the kernel promises O(block²) per thread). The
//                call runs on a new thread, so that its thread-local scratch starts empty.
// Threads: OpenMP, as many as OMP_NUM_THREADS says (the figures are meant for 2).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (fixed in GCC 13). The pragma must precede them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/config.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

using apex::Index;
using apex::RowMatrix;

constexpr Index kHeadDim = 128;
constexpr Index kQueryHeads = 32;
constexpr Index kKvHeads = 8;
constexpr Index kWindow = 512;

constexpr Index kChunk = 4096;
constexpr Index kDocuments = 16;

enum class Mask { kCausal, kFull, kWindow512, kChunked4096, kDocuments16, kAlibi, kUserCausal };

/// Causal attention as a user rule (attention_rules.hpp) with its exact block classifier.
auto user_causal_rule() {
  return apex::mask_rule([](Index, Index, Index q, Index k) { return k <= q; },
                         [](Index, Index, apex::PositionRange q, apex::PositionRange k) {
                           if (k.begin > q.end - 1) return apex::BlockCoverage::kNone;
                           if (k.end - 1 <= q.begin) return apex::BlockCoverage::kAll;
                           return apex::BlockCoverage::kPartial;
                         });
}

/// The document ids of kDocuments documents of random lengths (apex::bench::random_lengths,
/// seed 16: the sequences of BM_Varlen) packed into S positions.
std::vector<Index> random_documents(Index s) {
  std::vector<Index> ids;
  Index id = 0;
  for (const Index length : apex::bench::random_lengths(s, kDocuments, 16)) {
    ids.insert(ids.end(), static_cast<std::size_t>(length), id++);
  }
  return ids;
}

/// The rule of `mask` over S positions; documents16 views `ids`, which must outlive it.
apex::PositionMask position_mask(Mask mask, const std::vector<Index>& ids) {
  apex::PositionMask m;
  m.causal = mask != Mask::kFull && mask != Mask::kUserCausal;
  if (mask == Mask::kWindow512) m.window = kWindow;
  if (mask == Mask::kChunked4096) m.chunk = kChunk;
  if (mask == Mask::kDocuments16) m.documents = apex::DocumentIds(ids);
  return m;
}

/// Allowed (query, key) pairs for S queries against S keys.
double allowed_pairs(Mask mask, Index s) {
  const double n = static_cast<double>(s);
  if (mask == Mask::kFull) return n * n;
  if (mask == Mask::kCausal || mask == Mask::kAlibi || mask == Mask::kUserCausal) {
    return n * n / 2.0;  // the convention of the GFLOPS counter
  }
  const std::vector<Index> ids =
      mask == Mask::kDocuments16 ? random_documents(s) : std::vector<Index>();
  const apex::PositionMask rule = position_mask(mask, ids);
  double pairs = 0.0;
  for (Index i = 0; i < s; ++i) {
    Index first = 0;  // the first key of query i
    if (rule.window) first = std::max<Index>(0, i - *rule.window + 1);
    if (rule.chunk) first = i - i % *rule.chunk;
    if (!rule.documents.empty()) first = rule.documents.first_of(i);
    pairs += static_cast<double>(i - first + 1);
  }
  return pairs;
}

/// [1, heads, seq, d] contiguous inputs with uniform values in [-1, 1), stored as T (float,
/// Eigen::half or Eigen::bfloat16, or the blocks of a quantized format of kv_quant.hpp).
template <class T = float>
struct HeadsInput {
  HeadsInput(Index heads, Index seq, Index dim, std::uint64_t seed)
      : values(apex::bench::random_matrix<float>(heads * seq, dim, seed)),
        data(stored(values)),
        view(apex::HeadsView<const T>::contiguous(
            data.data(), {1, heads, seq, apex::KvFormat<T>::elements(dim)})) {}
  RowMatrix<float> values;
  std::conditional_t<apex::is_storage_v<T>, RowMatrix<T>, std::vector<T>> data;
  apex::HeadsView<const T> view;

 private:
  static auto stored(const RowMatrix<float>& x) {
    if constexpr (apex::is_storage_v<T>) {
      return RowMatrix<T>(x.cast<T>());
    } else {
      using Format = apex::KvFormat<T>;
      const Index per_row = Format::elements(x.cols());
      std::vector<T> blocks(static_cast<std::size_t>(x.rows() * per_row));
      for (Index r = 0; r < x.rows(); ++r) {
        Format::store_row(x.row(r).data(), x.cols(), blocks.data() + r * per_row);
      }
      return blocks;
    }
  }
};

/// The storage types of K and V that the benchmarks compare, named as in their names;
/// kBF16Products stores them as bfloat16 and permits bfloat16 products
/// (SdpaParams::allow_bf16_products).
enum class Precision { kF32, kF16, kBF16, kBF16Products, kQ8_0, kQ4_0, kFp8E4m3 };

/// Calls f(T{}) with T the storage type of `precision`.
template <class F>
void with_precision(Precision precision, F&& f) {
  switch (precision) {
    case Precision::kF32:
      return f(float{});
    case Precision::kF16:
      return f(Eigen::half{});
    case Precision::kBF16:
    case Precision::kBF16Products:
      return f(Eigen::bfloat16{});
    case Precision::kQ8_0:
      return f(apex::BlockQ8_0{});
    case Precision::kQ4_0:
      return f(apex::BlockQ4_0{});
    case Precision::kFp8E4m3:
      return f(apex::BlockFp8E4m3<128>{});
  }
}

/// A zeroed (hence already touched) [1, heads, seq, d] output.
struct HeadsOutput {
  HeadsOutput(Index heads, Index seq, Index dim)
      : data(RowMatrix<float>::Zero(heads * seq, dim)),
        view(apex::HeadsView<float>::contiguous(data.data(), {1, heads, seq, dim})) {}
  RowMatrix<float> data;
  apex::HeadsView<float> view;
};

// Prefill: S queries against S keys, K and V stored as `precision`. `reference` selects
// apex::reference::sdpa.
void run_prefill(benchmark::State& state, Mask mask, bool reference, Precision precision) {
  with_precision(precision, [&](auto storage) {
    using T = decltype(storage);
    const Index s = state.range(0);
    const HeadsInput<> q(kQueryHeads, s, kHeadDim, 1);
    const HeadsInput<T> k(kKvHeads, s, kHeadDim, 2);
    const HeadsInput<T> v(kKvHeads, s, kHeadDim, 3);
    HeadsOutput out(kQueryHeads, s, kHeadDim);
    const std::vector<Index> ids =
        mask == Mask::kDocuments16 ? random_documents(s) : std::vector<Index>();
    apex::AttentionMask<float> attention_mask;
    attention_mask.positions = position_mask(mask, ids);
    apex::SdpaParams params;
    if (mask == Mask::kAlibi) params.alibi_slopes = apex::alibi_slopes(kQueryHeads);
    params.allow_bf16_products = precision == Precision::kBF16Products;
    const auto rules = user_causal_rule();
    for (auto _ : state) {
      bool by_reference = false;  // the reference reads scalar storage only
      if constexpr (apex::is_storage_v<T>) {
        by_reference = reference;
        if (reference) {
          apex::reference::sdpa(q.view, k.view, v.view, attention_mask, params, out.view);
        }
      }
      if (!by_reference && mask == Mask::kUserCausal) {
        apex::sdpa(q.view, k.view, v.view, attention_mask, params, rules, out.view);
      } else if (!by_reference) {
        apex::sdpa(q.view, k.view, v.view, attention_mask, params, out.view);
      }
      benchmark::DoNotOptimize(out.data.data());
      benchmark::ClobberMemory();
    }
  });
  state.counters["GFLOPS"] =
      apex::bench::gflops(state, allowed_pairs(mask, state.range(0)) * 4.0 *
                                     static_cast<double>(kHeadDim * kQueryHeads));
}

// Decoding: one query (the newest position) against a cache of S keys, all of them visible,
// K and V stored as `precision`; GBps counts the bytes of K and V as stored.
void run_decode(benchmark::State& state, Precision precision) {
  double kv_bytes = 0.0;
  with_precision(precision, [&](auto storage) {
    using T = decltype(storage);
    const Index s = state.range(0);
    const HeadsInput<> q(kQueryHeads, 1, kHeadDim, 4);
    const HeadsInput<T> k(kKvHeads, s, kHeadDim, 5);
    const HeadsInput<T> v(kKvHeads, s, kHeadDim, 6);
    HeadsOutput out(kQueryHeads, 1, kHeadDim);
    apex::AttentionMask<float> attention_mask;
    attention_mask.positions = apex::causal_mask();
    const apex::SdpaParams params;
    for (auto _ : state) {
      apex::sdpa(q.view, k.view, v.view, attention_mask, params, out.view);
      benchmark::DoNotOptimize(out.data.data());
      benchmark::ClobberMemory();
    }
    using Format = apex::KvFormat<T>;
    kv_bytes = 2.0 * static_cast<double>(Format::bytes(s * kKvHeads * Format::elements(kHeadDim)));
  });
  state.counters["GBps"] = apex::bench::gbps(state, kv_bytes);
}

// Causal attention over S tokens, one head, d_h = 128: the growth of the peak resident set
// during each call, beyond the inputs and the output, which exist (and are touched) before.
void run_peak_memory(benchmark::State& state) {
  const Index s = state.range(0);
  const HeadsInput<> q(1, s, kHeadDim, 7);
  const HeadsInput<> k(1, s, kHeadDim, 8);
  const HeadsInput<> v(1, s, kHeadDim, 9);
  HeadsOutput out(1, s, kHeadDim);
  apex::AttentionMask<float> attention_mask;
  attention_mask.positions = apex::causal_mask();
  const apex::SdpaParams params;
  double extra_kib = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    if (!apex::bench::reset_peak_rss()) {
      state.SkipWithError("cannot reset the peak resident set (/proc/self/clear_refs)");
      break;
    }
    const double before = apex::bench::status_kib("VmRSS");
    state.ResumeTiming();
    // From a new thread, whose OpenMP team is new too: every thread-local buffer of the kernel
    // starts empty, so its growth is measured whatever ran before in this process.
    std::thread call(
        [&] { apex::sdpa<float>(q.view, k.view, v.view, attention_mask, params, out.view); });
    call.join();
    benchmark::DoNotOptimize(out.data.data());
    benchmark::ClobberMemory();
    state.PauseTiming();
    extra_kib = std::max(extra_kib, apex::bench::status_kib("VmHWM") - before);
    state.ResumeTiming();
  }
  state.counters["extra_MiB"] = extra_kib / 1024.0;
  state.counters["GFLOPS"] = apex::bench::gflops(
      state, allowed_pairs(Mask::kCausal, s) * 4.0 * static_cast<double>(kHeadDim));
}

const bool kRegistered = [] {
  const auto prefill = [](const std::string& name, Mask mask, bool reference,
                          Precision precision = Precision::kF32) {
    return benchmark::RegisterBenchmark(name.c_str(),
                                        [mask, reference, precision](benchmark::State& state) {
                                          run_prefill(state, mask, reference, precision);
                                        })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  // The reference is single-threaded and slow: its first call alone outlasts the minimum
  // measuring time, so it runs once (as do the S = 16384 and 65536 runs).
  prefill("BM_Sdpa_Reference/causal", Mask::kCausal, true)->Arg(1024);
  prefill("BM_Sdpa_Fast/causal", Mask::kCausal, false)->Arg(1024)->Arg(4096)->Arg(16384);
  prefill("BM_Sdpa_Fast/full", Mask::kFull, false)->Arg(4096)->Arg(16384);
  prefill("BM_Sdpa_Fast/window512", Mask::kWindow512, false)->Arg(4096)->Arg(16384);
  prefill("BM_Sdpa_Fast/chunked4096", Mask::kChunked4096, false)->Arg(16384);
  prefill("BM_Sdpa_Fast/documents16", Mask::kDocuments16, false)->Arg(16384);
  prefill("BM_Sdpa_Fast/alibi", Mask::kAlibi, false)->Arg(4096);
  prefill("BM_Sdpa_Fast/user_causal", Mask::kUserCausal, false)->Arg(4096);
  prefill("BM_Sdpa_Fast/causal/f16", Mask::kCausal, false, Precision::kF16)->Arg(4096);
  prefill("BM_Sdpa_Fast/causal/bf16", Mask::kCausal, false, Precision::kBF16)->Arg(4096);
  prefill("BM_Sdpa_Fast/causal/bf16_products", Mask::kCausal, false, Precision::kBF16Products)
      ->Arg(4096);
  prefill("BM_Sdpa_Fast/causal/q8_0", Mask::kCausal, false, Precision::kQ8_0)->Arg(4096);
  for (const auto& [name, precision] :
       {std::pair{"f32", Precision::kF32}, std::pair{"f16", Precision::kF16},
        std::pair{"bf16", Precision::kBF16}, std::pair{"q8_0", Precision::kQ8_0},
        std::pair{"q4_0", Precision::kQ4_0}, std::pair{"fp8_e4m3", Precision::kFp8E4m3}}) {
    const Precision p = precision;
    benchmark::RegisterBenchmark((std::string("BM_Decode_Fast/") + name).c_str(),
                                 [p](benchmark::State& state) { run_decode(state, p); })
        ->Arg(4096)
        ->Arg(32768)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_Sdpa_Fast_PeakMemory/causal", run_peak_memory)
      ->Arg(65536)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace
