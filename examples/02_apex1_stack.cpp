// SPDX-License-Identifier: MIT
// A small APEX-1 attention stack with random weights: its layer plan (§11.2), the two §11.3 mask
// pictures, and a forward pass over a prompt whose first tokens form a bidirectional prefix.
#include <apex/apex.hpp>

#include <cstdio>

int main() {
  apex::StackConfig config;
  config.vocab_size = 1000;
  config.d_model = 256;
  config.num_layers = 12;
  config.window = 4;
  config.local = apex::GqaConfig{256, 8, 2, 32};
  config.global.d_model = 256;
  config.global.d_q = 96;
  config.global.d_kv = 64;
  config.global.num_q_heads = 8;
  config.global.num_kv_heads = 2;
  config.global.head_dim = 32;
  config.global.rope_dim = 16;
  config.global.num_rope_key_heads = 1;
  config.max_positions = 64;
  const auto stack = apex::AttentionStack<float>::random(config, /*seed=*/2026);

  std::printf("Layer plan (L = %lld, F_g = %lld, W = %lld):\n",
              static_cast<long long>(config.num_layers),
              static_cast<long long>(config.global_every), static_cast<long long>(config.window));
  for (const apex::LayerPlan& row : stack.plan()) {
    std::printf(
        "  layer %2lld  %s  cache %5lld bytes/token\n", static_cast<long long>(row.layer),
        row.global ? "G  MLA          " : "L  GQA + window ",
        static_cast<long long>(row.cache_values_per_token) * static_cast<long long>(sizeof(float)));
  }

  const apex::LayerMaskParams pictures{/*prefix=*/4, /*window=*/4, /*global_every=*/6};
  std::printf("\nGlobal layer (full causal), P = 4, S = 10 (§11.3)\n%s",
              apex::render_mask(apex::build_mask(5, 10, pictures)).c_str());
  std::printf("\nLocal layer (window = 4), P = 4, S = 10 (§11.3)\n%s",
              apex::render_mask(apex::build_mask(0, 10, pictures)).c_str());

  apex::TokenMatrix prompt(1, 10);
  prompt << 17, 4, 256, 999, 3, 141, 59, 26, 535, 89;
  const apex::RowMatrix<float> logits = stack.forward(prompt, /*prefix=*/4);
  std::printf("\nForward pass: tokens [1 x 10], prefix 4 -> logits [%lld x %lld]\n",
              static_cast<long long>(logits.rows()), static_cast<long long>(logits.cols()));
  std::printf("Most likely next token after each position:");
  for (apex::Index t = 0; t < logits.rows(); ++t) {
    apex::Index best = 0;
    logits.row(t).maxCoeff(&best);
    std::printf(" %lld", static_cast<long long>(best));
  }
  std::printf("\n");
  return logits.allFinite() ? 0 : 1;
}
