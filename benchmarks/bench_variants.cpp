// SPDX-License-Identifier: MIT
// The attention variants of §7 - §10 side by side at equal model width: one full layer forward
// (projections, RoPE, causal attention, output projection) in float, batch 1, for S tokens.
//
//   d = 1024, H_q = 16, d_h = 64 for every variant (H_q·d_h = d)
//   BM_Variant_Mha            H_kv = 16                         (§7)
//   BM_Variant_Gqa4           H_kv = 4,  G = 4                  (§8)
//   BM_Variant_Gqa16          H_kv = 1,  G = 16 (multi-query)   (§8)
//   BM_Variant_Mla            d_kv = 256, d_q = 384, d_r = 64, H_kv = 16, H_kr = H_kv (§9)
//   BM_Variant_SlidingWindow  the Gqa4 layer with a window W = S/8 (§10, APEX-1's local layers)
//
// These run apex::sdpa (the tiled kernel). BM_VariantReference_Mha/Mla at S = 512 run the same
// layers with the attention done by apex::reference::sdpa, the plain oracle, for comparison.
//
// Counters: GFLOPS counts the useful work of one forward, a multiply-add being two operations:
// the projections, 2·(d_qk + d_v) per attended (query, key) pair and per query head (only the
// pairs the mask allows: S(S+1)/2 causal, Σ min(i+1, W) with a window), and W_O. RoPE and the
// softmax are not counted. kv_cache_bytes_per_token is what a decoder keeps per token and layer
// in float: 2·H_kv·d_h values for MHA/GQA, d_kv + H_kr·d_r for MLA (c_kv and K_rope).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
// GEMM kernels are inlined at -O3 -march=native (the _mm512_undefined_* idiom; fixed in
// GCC 13). The pragma must precede the headers to cover them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <apex/gqa.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/mla.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>

#include "bench_util.hpp"

namespace {

using apex::Index;

constexpr Index kModel = 1024;
constexpr Index kQueryHeads = 16;
constexpr Index kHeadDim = 64;
constexpr Index kMaxPositions = 8192;

apex::GqaConfig gqa_config(Index num_kv_heads) {
  return {kModel, kQueryHeads, num_kv_heads, kHeadDim};
}

apex::MlaConfig mla_config() {
  apex::MlaConfig c;
  c.d_model = kModel;
  c.d_q = 384;
  c.d_kv = 256;
  c.num_q_heads = kQueryHeads;
  c.num_kv_heads = kQueryHeads;
  c.head_dim = kHeadDim;
  c.rope_dim = 64;
  return c;  // num_rope_key_heads = 0: one K_rope head per KV head, as §9.3 writes it
}

// (query, key) pairs a causal mask allows over S tokens, with an optional window W.
double attended_pairs(Index seq, Index window) {
  double pairs = 0.0;
  for (Index i = 0; i < seq; ++i) {
    pairs += static_cast<double>(window > 0 ? std::min(i + 1, window) : i + 1);
  }
  return pairs;
}

double gqa_flops(const apex::GqaConfig& c, Index seq, Index window) {
  const double n = static_cast<double>(seq);
  const double d = static_cast<double>(c.d_model);
  const double q_width = static_cast<double>(c.num_q_heads * c.head_dim);
  const double kv_width = static_cast<double>(c.num_kv_heads * c.head_dim);
  const double projections = 2.0 * n * d * (q_width + 2.0 * kv_width);
  const double attention = 2.0 * static_cast<double>(c.num_q_heads) * attended_pairs(seq, window) *
                           static_cast<double>(2 * c.head_dim);
  const double output = 2.0 * n * q_width * d;
  return projections + attention + output;
}

double mla_flops(const apex::MlaConfig& c, Index seq) {
  double projections = 0.0;
  for (const apex::MlaMatrixShape& m : apex::mla_parameter_table(c)) {
    projections += 2.0 * static_cast<double>(seq) * static_cast<double>(m.count());
  }
  const double attention = 2.0 * static_cast<double>(c.num_q_heads) * attended_pairs(seq, 0) *
                           static_cast<double>(c.qk_dim() + c.head_dim);
  return projections + attention;  // W_O is in the table
}

apex::AttentionMask<float> causal(Index window) {
  apex::AttentionMask<float> mask;
  mask.positions = window > 0 ? apex::sliding_window_mask(window) : apex::causal_mask();
  return mask;
}

// Times `forward(x, mask, params, out)`, one layer forward on S = state.range(0) tokens of batch
// 1 with the RoPE table and a causal mask (window W if W > 0), and sets the counters.
template <class Forward>
void run_forward(benchmark::State& state, const apex::RopeTable<float>& table, Index window,
                 double flops, double cache_bytes_per_token, const Forward& forward) {
  const Index seq = state.range(0);
  const apex::RowMatrix<float> x = apex::bench::random_matrix<float>(seq, kModel, 7);
  apex::RowMatrix<float> out(seq, kModel);
  apex::AttentionLayerParams<float> params;
  params.rope = &table;
  const apex::AttentionMask<float> mask = causal(window);
  for (auto _ : state) {
    forward(x, mask, params, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPS"] = apex::bench::gflops(state, flops);
  state.counters["kv_cache_bytes_per_token"] = cache_bytes_per_token;
}

double gqa_cache_bytes(Index num_kv_heads) {
  return static_cast<double>(apex::kv_cache_values_per_token(num_kv_heads, kHeadDim)) *
         sizeof(float);
}

double mla_cache_bytes(const apex::MlaConfig& config) {
  return static_cast<double>(apex::mla_cache_values_per_token(config)) * sizeof(float);
}

void gqa_variant(benchmark::State& state, Index num_kv_heads, Index window_divisor) {
  const Index seq = state.range(0);
  const Index window = window_divisor > 0 ? seq / window_divisor : 0;
  const apex::GqaConfig config = gqa_config(num_kv_heads);
  const auto layer = apex::GroupedQueryAttention<float>::random(config, 1);
  const apex::RopeTable<float> table(kMaxPositions, kHeadDim);
  run_forward(state, table, window, gqa_flops(config, seq, window), gqa_cache_bytes(num_kv_heads),
              [&](const auto& x, const auto& mask, const auto& params, auto& out) {
                layer.forward(x, 1, mask, params, out);
              });
}

void BM_Variant_Mha(benchmark::State& state) { gqa_variant(state, kQueryHeads, 0); }
void BM_Variant_Gqa4(benchmark::State& state) { gqa_variant(state, kQueryHeads / 4, 0); }
void BM_Variant_Gqa16(benchmark::State& state) { gqa_variant(state, kQueryHeads / 16, 0); }
void BM_Variant_SlidingWindow(benchmark::State& state) { gqa_variant(state, kQueryHeads / 4, 8); }

void BM_Variant_Mla(benchmark::State& state) {
  const apex::MlaConfig config = mla_config();
  const auto layer = apex::MultiHeadLatentAttention<float>::random(config, 1);
  const apex::RopeTable<float> table(kMaxPositions, config.rope_dim);
  run_forward(state, table, 0, mla_flops(config, state.range(0)), mla_cache_bytes(config),
              [&](const auto& x, const auto& mask, const auto& params, auto& out) {
                layer.forward(x, 1, mask, params, out);
              });
}

// The same layers with attention by the plain oracle: the projections (project / decompress),
// apex::reference::sdpa into the token-major concatenation `concat` [S, H_q·d_v], then W_O.
void reference_forward(const apex::ProjectedQkv<float>& p, const apex::AttentionMask<float>& mask,
                       const apex::RowMatrix<float>& w_o, apex::RowMatrix<float>& concat,
                       apex::RowMatrix<float>& out) {
  apex::reference::sdpa<float>(
      p.q_heads(), p.k_heads(), p.v_heads(), mask, {},
      apex::HeadsView<float>::token_major(concat.data(), {1, p.num_q_heads, p.seq(), p.v_dim}));
  out.noalias() = concat * w_o;
}

void BM_VariantReference_Mha(benchmark::State& state) {
  const Index seq = state.range(0);
  const apex::GqaConfig config = gqa_config(kQueryHeads);
  const auto layer = apex::GroupedQueryAttention<float>::random(config, 1);
  const apex::RopeTable<float> table(kMaxPositions, kHeadDim);
  apex::RowMatrix<float> concat(seq, kQueryHeads * kHeadDim);
  run_forward(state, table, 0, gqa_flops(config, seq, 0), gqa_cache_bytes(kQueryHeads),
              [&](const auto& x, const auto& mask, const auto& params, auto& out) {
                reference_forward(layer.project(x, 1, params), mask, layer.weights().w_o, concat,
                                  out);
              });
}

void BM_VariantReference_Mla(benchmark::State& state) {
  const Index seq = state.range(0);
  const apex::MlaConfig config = mla_config();
  const auto layer = apex::MultiHeadLatentAttention<float>::random(config, 1);
  const apex::RopeTable<float> table(kMaxPositions, config.rope_dim);
  apex::RowMatrix<float> concat(seq, kQueryHeads * kHeadDim);
  run_forward(state, table, 0, mla_flops(config, seq), mla_cache_bytes(config),
              [&](const auto& x, const auto& mask, const auto& params, auto& out) {
                reference_forward(layer.decompress(x, 1, params), mask, layer.weights().w_o, concat,
                                  out);
              });
}

// S = 512, 2048, 8192; ms of wall-clock time (the kernels are threaded).
void variant_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"S"})->Arg(512)->Arg(2048)->Arg(8192)->UseRealTime()->Unit(benchmark::kMillisecond);
}

// The plain oracle at S = 512 only.
void reference_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"S"})->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Variant_Mha)->Apply(variant_args);
BENCHMARK(BM_Variant_Gqa4)->Apply(variant_args);
BENCHMARK(BM_Variant_Gqa16)->Apply(variant_args);
BENCHMARK(BM_Variant_Mla)->Apply(variant_args);
BENCHMARK(BM_Variant_SlidingWindow)->Apply(variant_args);
BENCHMARK(BM_VariantReference_Mha)->Apply(reference_args);
BENCHMARK(BM_VariantReference_Mla)->Apply(reference_args);

}  // namespace
