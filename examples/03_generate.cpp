// SPDX-License-Identifier: MIT
// Greedy generation with caches: a 12-layer APEX-1 stack (d = 512, random weights, YaRN past its
// trained context) prefills a prompt whose first tokens form a bidirectional prefix, then decodes
// token by token against its caches (sliding-window rings on the local layers, c_kv + K_rope on
// the global ones). Prints the decoding speed, the cache memory by layer kind, and the speed-up
// over recomputing the whole sequence at every step, which it also checks gives the same logits;
// then decodes the same tokens with caches in half, bfloat16, q8_0, q4_0 and fp8 e4m3, and with
// caches and weights in half and bfloat16, and prints their speed, their bytes and how far their
// logits are from the float run's.
#include <apex/apex.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Greedy choice among the tokens not generated in the last `recent` positions. A model with
// random weights and a tied LM head mostly predicts the token it has just read (the residual
// stream carries that token's own embedding); banning recent repeats, as generation settings
// often do, makes the output less monotonous without making it random.
std::int64_t greedy_no_repeat(const apex::RowMatrix<float>& logits, const apex::TokenMatrix& tokens,
                              apex::Index position, apex::Index recent) {
  apex::RowMatrix<float> scores = logits.row(0);
  for (apex::Index t = std::max<apex::Index>(0, position - recent); t < position; ++t) {
    scores(0, static_cast<apex::Index>(tokens(0, t))) = -INFINITY;
  }
  apex::Index best = 0;
  scores.row(0).maxCoeff(&best);
  return best;
}

// printf's %-Ns counts bytes; this pads by characters, so that "§" (two bytes) lines up.
void print_padded(const std::string& text, std::size_t width) {
  std::size_t chars = 0;
  for (const char c : text) chars += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
  std::printf("%s%*s", text.c_str(), static_cast<int>(width > chars ? width - chars : 0), "");
}

double kib(std::int64_t bytes) { return static_cast<double>(bytes) / 1024.0; }

/// The float run that the other storage types replay: its tokens (the prompt, whose first
/// `prefix` are bidirectional, then what it generated) and its logits (row t: at position t).
struct FloatRun {
  const apex::TokenMatrix& tokens;
  apex::Index prompt_len;
  apex::Index prefix;
  const apex::RowMatrix<float>& logits;
};

/// What decoding a sequence with caches of one storage type gave.
struct CachedRun {
  double seconds = 0.0;           ///< decode steps only
  std::int64_t cache_bytes = 0;   ///< what the StackCache owns
  std::int64_t weight_bytes = 0;  ///< what the stack's weights take
  double worst_difference = 0.0;  ///< largest relative logit difference from the float run
};

/// Prefills the float run's prompt and decodes the rest of its tokens one at a time
/// (teacher-forced: the tokens are given, so that every step can be compared) with caches that
/// store Storage, comparing each step's logits with the float run's at that position.
template <class Storage, class Weight>
CachedRun decode_with(const apex::AttentionStack<float, Weight>& stack, const FloatRun& floats) {
  const apex::Index total = floats.tokens.cols();
  auto cache = stack.template make_cache<Storage>(1, total);
  apex::DecodeOptions last_only;
  last_only.logits = apex::LogitRows::kLast;
  stack.prefill(floats.tokens.leftCols(floats.prompt_len), floats.prefix, last_only, cache);
  CachedRun run;
  for (apex::Index t = floats.prompt_len; t < total; ++t) {
    const auto start = Clock::now();
    const apex::RowMatrix<float> logits =
        stack.decode_step({floats.tokens(0, t)}, last_only, cache);
    run.seconds += seconds_since(start);
    const auto reference = floats.logits.row(t);
    const double difference =
        (logits.row(0) - reference).cwiseAbs().maxCoeff() / reference.cwiseAbs().maxCoeff();
    run.worst_difference = std::max(run.worst_difference, difference);
  }
  run.cache_bytes = cache.bytes();
  run.weight_bytes = stack.weight_bytes();
  return run;
}

/// Decodes the float run's tokens with caches of Storage and prints the row of the table.
template <class Storage, class Weight>
void print_row(const char* caches, const char* weights,
               const apex::AttentionStack<float, Weight>& stack, const FloatRun& floats) {
  const CachedRun run = decode_with<Storage>(stack, floats);
  const apex::Index steps = floats.tokens.cols() - floats.prompt_len;
  std::printf("  %-10s %-10s %8.0f %10.1f %11.1f %26.2e\n", caches, weights,
              static_cast<double>(steps) / run.seconds, kib(run.cache_bytes), kib(run.weight_bytes),
              run.worst_difference);
}

int run() {
#ifdef _OPENMP
  // A decoding step of a model this small is a stream of kernels of a few microseconds each, too
  // short to share between threads (each would pay a fork and a join, and wait for a free core
  // when the machine is busy): one thread, which also keeps the timings below comparable.
  omp_set_num_threads(1);
#endif
  apex::StackConfig config;
  config.vocab_size = 4096;
  config.d_model = 512;
  config.num_layers = 12;  // layers 5 and 11 global (MLA), the other 10 local (GQA + window)
  config.window = 64;
  config.local = apex::GqaConfig{512, 8, 2, 64};
  config.global.d_model = 512;
  config.global.d_q = 192;
  config.global.d_kv = 128;
  config.global.num_q_heads = 8;
  config.global.num_kv_heads = 2;
  config.global.head_dim = 64;
  config.global.rope_dim = 32;
  config.max_positions = 512;
  apex::YarnParams yarn;  // trained on 128 positions, extended 4× to 512 (§5)
  yarn.scale = 4.0;
  yarn.original_context = 128;
  config.yarn = yarn;
  const auto stack = apex::AttentionStack<float>::random(config, /*seed=*/2026);

  const apex::Index prompt_len = 48, prefix = 16, new_tokens = 320;
  const apex::Index total = prompt_len + new_tokens;  // 368: far past the trained 128
  apex::TokenMatrix tokens(1, total);
  for (apex::Index s = 0; s < prompt_len; ++s) tokens(0, s) = (37 * s + 11) % config.vocab_size;

  // Prefill the prompt in one call, then decode one token at a time (greedy).
  apex::StackCache<float> cache = stack.make_cache(/*batch=*/1, /*capacity=*/total);
  apex::DecodeOptions last_only;
  last_only.logits = apex::LogitRows::kLast;
  auto start = Clock::now();
  apex::RowMatrix<float> logits =
      stack.prefill(tokens.leftCols(prompt_len), prefix, last_only, cache);
  const double prefill_seconds = seconds_since(start);

  // Every `stride`-th step is also recomputed from scratch with forward(), to time the
  // alternative and to check that both give the same logits.
  const apex::Index stride = 40;
  double decode_seconds = 0.0, sampled_recompute = 0.0, sampled_decode = 0.0;
  double worst_difference = 0.0;
  apex::RowMatrix<float> step_logits(total, config.vocab_size);  // row t: the logits at t
  for (apex::Index t = prompt_len; t < total; ++t) {
    tokens(0, t) = greedy_no_repeat(logits, tokens, t, /*recent=*/16);
    start = Clock::now();
    logits = stack.decode_step({tokens(0, t)}, last_only, cache);
    const double step = seconds_since(start);
    decode_seconds += step;
    step_logits.row(t) = logits.row(0);
    if ((t - prompt_len) % stride == stride - 1) {
      start = Clock::now();
      const apex::RowMatrix<float> full = stack.forward(tokens.leftCols(t + 1), prefix);
      sampled_recompute += seconds_since(start);
      sampled_decode += step;
      const double difference =
          (full.row(t) - logits.row(0)).cwiseAbs().maxCoeff() / full.row(t).cwiseAbs().maxCoeff();
      worst_difference = std::max(worst_difference, difference);
    }
  }

  std::printf(
      "APEX-1 stack: L = %lld (%lld local, %lld global), d = %lld, V = %lld, W = %lld, "
      "YaRN s = %.0f over L = %lld\n",
      static_cast<long long>(config.num_layers), 10LL, 2LL, static_cast<long long>(config.d_model),
      static_cast<long long>(config.vocab_size), static_cast<long long>(config.window), yarn.scale,
      static_cast<long long>(yarn.original_context));
  std::printf("Prefill: %lld tokens (prefix %lld) in %.1f ms\n", static_cast<long long>(prompt_len),
              static_cast<long long>(prefix), 1e3 * prefill_seconds);
  std::printf(
      "Decode:  %lld tokens in %.1f ms = %.0f tokens/s, one thread (positions %lld .. %lld)\n",
      static_cast<long long>(new_tokens), 1e3 * decode_seconds,
      static_cast<double>(new_tokens) / decode_seconds, static_cast<long long>(prompt_len),
      static_cast<long long>(total - 1));
  std::printf("First generated tokens:");
  for (apex::Index t = prompt_len; t < prompt_len + 12; ++t) {
    std::printf(" %lld", static_cast<long long>(tokens(0, t)));
  }
  std::printf(" ...\n");

  // Cache memory by layer kind, now (context = total) and for the same stack at its limit.
  const apex::StackCacheMemory now = stack.cache_memory(1, total);
  std::printf("\nCache memory (float, context %lld):\n", static_cast<long long>(total));
  std::printf(
      "  local  layers (GQA, ring of W = %lld): %2lld x %6.1f KiB, %5lld B per token and layer\n",
      static_cast<long long>(config.window), static_cast<long long>(now.local_layers),
      kib(now.local_bytes_per_layer), static_cast<long long>(now.local_bytes_per_token));
  std::printf(
      "  global layers (MLA, c_kv + K_rope):  %2lld x %6.1f KiB, %5lld B per token and layer\n",
      static_cast<long long>(now.global_layers), kib(now.global_bytes_per_layer),
      static_cast<long long>(now.global_bytes_per_token));
  std::printf(
      "  total %.1f KiB (the cache object reports %.1f KiB); full MHA caches on every "
      "layer would take %.1f KiB\n",
      kib(now.total_bytes), kib(cache.bytes()),
      kib(config.num_layers * apex::kv_cache_bytes(1, total, config.local.num_q_heads,
                                                   config.local.head_dim,
                                                   static_cast<std::int64_t>(sizeof(float)))));

  // Recomputing the sequence at every step costs what forward() costs at that length; the
  // sampled steps are spread evenly over the run, so stride × their sum estimates the total.
  const double recompute_estimate = static_cast<double>(stride) * sampled_recompute;
  std::printf(
      "\nRecomputing the whole sequence at every step: about %.0f ms for the %lld steps "
      "(every %lldth step timed)\n",
      1e3 * recompute_estimate, static_cast<long long>(new_tokens), static_cast<long long>(stride));
  std::printf("Speed-up of decoding with caches: %.1fx overall, %.1fx on the timed steps\n",
              recompute_estimate / decode_seconds, sampled_recompute / sampled_decode);
  std::printf("Largest relative difference between cached and recomputed logits: %.2e\n",
              worst_difference);

  // The same tokens decoded with 16-, 8- and 4-bit caches, then 16-bit caches and weights
  // (float arithmetic throughout). The fp8 blocks hold 32 values: d_r = 32 is one block.
  std::printf(
      "\nCaches in 16, 8 and 4 bits, and weights in 16 bits (the same %lld tokens, one "
      "thread):\n",
      static_cast<long long>(new_tokens));
  std::printf("  %-10s %-10s %8s %10s %11s %26s\n", "caches", "weights", "tokens/s", "cache KiB",
              "weight KiB", "largest logit difference");
  std::printf("  %-10s %-10s %8.0f %10.1f %11.1f %26s\n", "float", "float",
              static_cast<double>(new_tokens) / decode_seconds, kib(cache.bytes()),
              kib(stack.weight_bytes()), "-");
  const FloatRun floats{tokens, prompt_len, prefix, step_logits};
  print_row<Eigen::half>("half", "float", stack, floats);
  print_row<Eigen::bfloat16>("bfloat16", "float", stack, floats);
  print_row<apex::BlockQ8_0>("q8_0", "float", stack, floats);
  print_row<apex::BlockQ4_0>("q4_0", "float", stack, floats);
  print_row<apex::BlockFp8E4m3<32>>("fp8 e4m3", "float", stack, floats);
  print_row<Eigen::half>("half", "half", stack.with_weights<Eigen::half>(), floats);
  print_row<Eigen::bfloat16>("bfloat16", "bfloat16", stack.with_weights<Eigen::bfloat16>(), floats);

  // The summary of §7.4 / §8.3 / §9.4 / §10.3 for APEX-1 Large (FP16, 128K, d_r = 64 assumed).
  apex::CacheComparisonParams large;
  large.num_q_heads = 128;
  large.num_kv_heads = 8;
  large.head_dim = 128;
  large.latent_dim = 512;
  large.rope_dim = 64;
  large.rope_heads = 8;
  large.window = 4096;
  large.context = 131072;
  std::printf("\nAPEX-1 Large, one layer, 128K tokens, FP16:\n");
  for (const apex::CacheComparisonRow& row : apex::cache_comparison(large)) {
    std::printf("  ");
    print_padded(row.method, 22);
    print_padded(row.cached, 30);
    std::printf(" %6lld values/token %7.1f MiB %9.5f x MHA\n",
                static_cast<long long>(row.values_per_token),
                static_cast<double>(row.bytes_per_layer) / (1024.0 * 1024.0), row.relative);
  }
  return worst_difference < 1e-3 && logits.allFinite() ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
