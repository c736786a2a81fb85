// SPDX-License-Identifier: MIT
// Training a small APEX-1 stack from scratch on a task that needs attention: copying. Every
// sequence is 8 random tokens, a separator, and the same 8 tokens again; the model is scored on
// the second half only, where each token is the one 9 positions back, which no position can
// know without attending. Two blocks (a local GQA layer with a window of 4, then a global MLA
// layer), d = 64, the tied embedding as LM head; the mean cross-entropy, its gradient through
// the whole stack (stack_training.hpp) and AdamW, for 400 steps of 16 sequences. Prints the loss
// falling, the copy accuracy reached (chance is 1/16) and the steps per second; deterministic
// from its seed, whatever the number of threads (the gradients are bit-identical for any).
#include <apex/apex.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <string>
#include <vector>

namespace {

using apex::Index;

constexpr Index kVocab = 17;  // 16 symbols and the separator
constexpr Index kSeparator = 16;
constexpr Index kHalf = 8;
constexpr Index kSeq = 2 * kHalf + 1;
constexpr Index kBatch = 16;

apex::StackConfig model_config() {
  apex::StackConfig c;
  c.vocab_size = kVocab;
  c.d_model = 64;
  c.num_layers = 2;
  c.global_every = 2;  // layer 0 local, layer 1 global
  c.window = 4;
  c.local = apex::GqaConfig{64, 4, 2, 16};
  c.global.d_model = 64;
  c.global.d_q = 32;
  c.global.d_kv = 32;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 4;
  c.global.head_dim = 16;
  c.global.rope_dim = 8;
  c.max_positions = kSeq;
  return c;
}

/// A batch of copy sequences and their targets: at position s the next token, scored (>= 0)
/// only where it is a copy of the first half.
struct Batch {
  apex::TokenMatrix tokens{kBatch, kSeq};
  std::vector<std::int64_t> targets;
};

Batch copy_batch(std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> symbol(0, kSeparator - 1);
  Batch b;
  b.targets.assign(static_cast<std::size_t>(kBatch * kSeq), -1);
  for (Index i = 0; i < kBatch; ++i) {
    for (Index s = 0; s < kHalf; ++s) {
      b.tokens(i, s) = symbol(rng);
      b.tokens(i, kHalf + 1 + s) = b.tokens(i, s);
    }
    b.tokens(i, kHalf) = kSeparator;
    // Position kHalf + s predicts token kHalf + 1 + s, the copy of token s.
    for (Index s = 0; s < kHalf; ++s) {
      b.targets[static_cast<std::size_t>(i * kSeq + kHalf + s)] = b.tokens(i, s);
    }
  }
  return b;
}

/// The share of scored positions whose most likely token is the target.
double accuracy(const apex::RowMatrix<float>& logits, const std::vector<std::int64_t>& targets) {
  Index right = 0, scored = 0;
  for (Index t = 0; t < logits.rows(); ++t) {
    const std::int64_t target = targets[static_cast<std::size_t>(t)];
    if (target < 0) continue;
    Index best = 0;
    logits.row(t).maxCoeff(&best);
    right += best == target ? 1 : 0;
    ++scored;
  }
  return static_cast<double>(right) / static_cast<double>(scored);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // An optional seed of the weights and of the data: `example_08_train 7`.
    const std::uint64_t seed = argc > 1 ? std::stoull(argv[1]) : 2026;
    const apex::StackConfig config = model_config();
    apex::StackParameters<float> params =
        apex::stack_parameters(apex::AttentionStack<float>::random(config, seed));
    params.embedding *= 6.0f;  // rows of norm about 1: logits that can tell tokens apart
    apex::AdamW<float> adam(apex::AdamWParams{3e-3, 0.9, 0.99, 1e-8, 0.0});
    std::mt19937_64 rng(seed + 1);
    const Batch held_out = copy_batch(rng);
    const auto start = std::chrono::steady_clock::now();
    constexpr int kSteps = 400;
    double last_loss = 0.0;
    for (int step = 1; step <= kSteps; ++step) {
      const auto stack = apex::stack_from_parameters(config, params);
      const Batch batch = copy_batch(rng);
      apex::StackActivations<float> saved;
      const apex::RowMatrix<float> logits = apex::stack_forward(stack, batch.tokens, 0, saved);
      apex::RowMatrix<float> d_logits;
      last_loss = apex::cross_entropy(logits, batch.targets, d_logits);
      apex::StackParameters<float> grads;
      apex::stack_backward(stack, saved, d_logits, grads);
      adam.step(params, grads);
      if (step == 1 || step % 50 == 0) {
        std::printf("step %3d  loss %.4f  train accuracy %.3f\n", step, last_loss,
                    accuracy(logits, batch.targets));
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto trained = apex::stack_from_parameters(config, params);
    const double held = accuracy(trained.forward(held_out.tokens, 0), held_out.targets);
    std::printf("held-out copy accuracy %.3f (chance %.3f), %.1f steps/s\n", held,
                1.0 / static_cast<double>(kSeparator), kSteps / seconds);
    // The example is also a test: training must have learned to copy.
    if (!(last_loss < 0.5 && held > 0.9)) {
      std::fprintf(stderr, "training did not learn the copy task\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
