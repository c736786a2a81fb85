// SPDX-License-Identifier: MIT
// Training the stack (stack_training.hpp): stack_forward against forward; stack_backward against
// finite differences of the stack's own forward pass in double, for parameters of every kind
// (the tied table, a block's γ, the final γ, a local and a global layer's matrices); the
// cross-entropy and its gradient against finite differences; AdamW against its formula;
// bit-identical gradients for any thread count; bad input.
#include <apex/stack_training.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <variant>
#include <vector>

#include "finite_differences.hpp"
#include "test_util.hpp"

namespace stack_training_test {
namespace {

using apex::Index;
using apex::RowMatrix;
using apex::testing::expect_invalid;

// Layer 1 is global (F_g = 2), layers 0 and 2 local with a window of 3.
apex::StackConfig tiny_config() {
  apex::StackConfig c;
  c.vocab_size = 11;
  c.d_model = 8;
  c.num_layers = 3;
  c.window = 3;
  c.global_every = 2;
  c.local = apex::GqaConfig{8, 2, 1, 4};
  c.global.d_model = 8;
  c.global.d_q = 6;
  c.global.d_kv = 5;
  c.global.num_q_heads = 2;
  c.global.num_kv_heads = 1;
  c.global.head_dim = 4;
  c.global.rope_dim = 2;
  c.max_positions = 8;
  return c;
}

apex::TokenMatrix tokens_of(Index batch, Index seq, Index vocab) {
  apex::TokenMatrix t(batch, seq);
  for (Index b = 0; b < batch; ++b)
    for (Index s = 0; s < seq; ++s) t(b, s) = (5 * b + 3 * s + 1) % vocab;
  return t;
}

TEST(StackTraining, ForwardKeepsTheResidualsAndGivesForwardsLogits) {
  const auto stack = apex::AttentionStack<float>::random(tiny_config(), 3);
  const apex::TokenMatrix tokens = tokens_of(2, 6, 11);
  apex::StackActivations<float> saved;
  const RowMatrix<float> logits = apex::stack_forward(stack, tokens, 2, saved);
  EXPECT_EQ(logits, stack.forward(tokens, 2));
  EXPECT_EQ(saved.residuals.size(), 4u);
  EXPECT_EQ(saved.residuals[0], stack.embed_tokens(tokens));
}

TEST(StackTraining, BackwardMatchesFiniteDifferencesOfTheForwardPass) {
  const apex::StackConfig config = tiny_config();
  apex::StackParameters<double> w =
      apex::stack_parameters(apex::AttentionStack<double>::random(config, 5));
  // Random γ, so that their gradients are not those of ones.
  for (auto& g : w.norm_gammas) g = apex::testing::random_matrix<double>(8, 1, 6, 0.5, 1.5);
  w.final_gamma = apex::testing::random_matrix<double>(8, 1, 7, 0.5, 1.5);
  w.embedding *= 20.0;  // rows of O(1), so that the logits vary
  const apex::TokenMatrix tokens = tokens_of(2, 5, 11);
  const RowMatrix<double> d_logits = apex::testing::random_matrix<double>(10, 11, 8);
  const auto loss = [&] {
    const auto stack = apex::stack_from_parameters(config, w);
    return (stack.forward(tokens, 1).array() * d_logits.array()).sum();
  };
  const auto stack = apex::stack_from_parameters(config, w);
  apex::StackActivations<double> saved;
  apex::stack_forward(stack, tokens, 1, saved);
  apex::StackParameters<double> g;
  apex::stack_backward(stack, saved, d_logits, g);
  apex::testing::expect_matches_differences(w.embedding, g.embedding, loss, "d_embedding");
  apex::testing::expect_matches_differences(w.final_gamma, g.final_gamma, loss, "d_final_gamma");
  apex::testing::expect_matches_differences(w.norm_gammas[1], g.norm_gammas[1], loss, "d_gamma_1");
  auto& local = std::get<apex::GqaWeights<double>>(w.layers[0]);
  const auto& d_local = std::get<apex::GqaWeights<double>>(g.layers[0]);
  apex::testing::expect_matches_differences(local.w_q, d_local.w_q, loss, "layer 0 d_w_q");
  apex::testing::expect_matches_differences(local.w_o, d_local.w_o, loss, "layer 0 d_w_o");
  auto& global = std::get<apex::MlaWeights<double>>(w.layers[1]);
  const auto& d_global = std::get<apex::MlaWeights<double>>(g.layers[1]);
  apex::testing::expect_matches_differences(global.w_dkv, d_global.w_dkv, loss, "layer 1 d_w_dkv");
  apex::testing::expect_matches_differences(global.w_kr, d_global.w_kr, loss, "layer 1 d_w_kr");
}

TEST(StackTraining, CrossEntropyAndItsGradient) {
  RowMatrix<double> logits = apex::testing::random_matrix<double>(4, 6, 20, -3.0, 3.0);
  const std::vector<std::int64_t> targets = {2, -1, 5, 0};
  RowMatrix<double> d_logits;
  const auto loss = [&] {
    RowMatrix<double> unused;
    return apex::cross_entropy(logits, targets, unused);
  };
  const double value = apex::cross_entropy(logits, targets, d_logits);
  double expected = 0.0;
  for (const Index t : {0, 2, 3}) {
    const double lse = std::log(logits.row(t).array().exp().sum());
    expected += (lse - logits(t, targets[std::size_t(t)])) / 3.0;
  }
  EXPECT_NEAR(value, expected, 1e-14);
  EXPECT_TRUE(d_logits.row(1).isZero(0.0)) << "a row without a target has no gradient";
  apex::testing::expect_matches_differences(logits, d_logits, loss, "d_logits");
  RowMatrix<double> untouched = RowMatrix<double>::Constant(4, 6, 9.0);
  expect_invalid(
      [&] {
        apex::cross_entropy(logits, {2, 6, 5, 0}, untouched);
      },
      {"[cross_entropy] target (6) of row 1", "[-1, V) = [-1, 6)"});
  expect_invalid(
      [&] {
        apex::cross_entropy(logits, {2, 1}, untouched);
      },
      {"[cross_entropy] targets length (2)"});
  EXPECT_TRUE((untouched.array() == 9.0).all());
}

TEST(StackTraining, AdamWFollowsItsFormula) {
  const apex::StackConfig config = tiny_config();
  apex::StackParameters<double> w =
      apex::stack_parameters(apex::AttentionStack<double>::random(config, 30));
  const apex::StackParameters<double> start = w;
  apex::StackParameters<double> g = w;
  g.embedding.setConstant(0.5);
  g.final_gamma.setConstant(-2.0);
  for (auto& gamma : g.norm_gammas) gamma.setZero();
  for (auto& layer : g.layers) {
    std::visit([](auto& l) { l.w_o.setConstant(0.25); }, layer);
  }
  const apex::AdamWParams p{0.1, 0.9, 0.999, 1e-8, 0.01};
  apex::AdamW<double> adam(p);
  adam.step(w, g);
  adam.step(w, g);
  // With a constant gradient, m̂ = g and v̂ = g² at every step: each step moves a weight by
  // η·(sign(g)·|g| / (|g| + ε) + λ·w) (λ on matrices), from the weight before the step.
  const auto expected = [&](double w0, double grad, bool decay) {
    double x = w0;
    for (int s = 0; s < 2; ++s)
      x -= p.learning_rate * (grad / (std::abs(grad) + p.eps) + (decay ? p.weight_decay * x : 0.0));
    return x;
  };
  EXPECT_NEAR(w.embedding(3, 2), expected(start.embedding(3, 2), 0.5, true), 1e-15);
  EXPECT_NEAR(w.final_gamma(4), expected(start.final_gamma(4), -2.0, false), 1e-15);
  EXPECT_EQ(w.norm_gammas[0], start.norm_gammas[0]) << "a zero gradient moves no γ";
  const auto& wo = std::get<apex::GqaWeights<double>>(w.layers[0]).w_o;
  const auto& wo0 = std::get<apex::GqaWeights<double>>(start.layers[0]).w_o;
  EXPECT_NEAR(wo(1, 1), expected(wo0(1, 1), 0.25, true), 1e-15);
  EXPECT_EQ(adam.steps(), 2);
}

TEST(StackTraining, GradientsAreBitIdenticalForAnyThreadCount) {
  const auto stack = apex::AttentionStack<float>::random(tiny_config(), 40);
  const apex::TokenMatrix tokens = tokens_of(3, 8, 11);
  apex::StackActivations<float> saved;
  const RowMatrix<float> logits = apex::stack_forward(stack, tokens, 0, saved);
  std::vector<std::int64_t> targets(24);
  for (std::size_t t = 0; t < targets.size(); ++t) targets[t] = std::int64_t(t % 11);
  RowMatrix<float> d_logits;
  apex::cross_entropy(logits, targets, d_logits);
  apex::StackParameters<float> g1, g2;
  {
    const apex::testing::OneThread one;
    apex::stack_backward(stack, saved, d_logits, g1);
  }
  apex::stack_backward(stack, saved, d_logits, g2);
  EXPECT_EQ(g1.embedding, g2.embedding);
  EXPECT_EQ(g1.final_gamma, g2.final_gamma);
  for (std::size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(g1.norm_gammas[l], g2.norm_gammas[l]);
    std::visit(
        [&](const auto& a) {
          const auto& b = std::get<std::decay_t<decltype(a)>>(g2.layers[l]);
          EXPECT_EQ(a.w_o, b.w_o) << "layer " << l;
        },
        g1.layers[l]);
  }
}

TEST(StackTraining, BackwardRejectsMismatchedInput) {
  const auto stack = apex::AttentionStack<float>::random(tiny_config(), 50);
  apex::StackActivations<float> saved;
  const RowMatrix<float> logits = apex::stack_forward(stack, tokens_of(1, 4, 11), 0, saved);
  apex::StackParameters<float> g;
  expect_invalid([&] { apex::stack_backward(stack, saved, RowMatrix<float>(4, 10), g); },
                 {"[stack_backward] d_logits shape [4, 10]", "[4, 11]"});
  apex::StackActivations<float> empty;
  expect_invalid([&] { apex::stack_backward(stack, empty, logits, g); },
                 {"[stack_backward] saved activations"});
}

}  // namespace
}  // namespace stack_training_test
