// SPDX-License-Identifier: MIT
// The APEX-1 stack over quantized caches (kv_quant.hpp): every layer's cache (the local layers'
// sliding windows, the global layers' latent rows) in q8_0, q4_0 or fp8 e4m3 blocks of 32.
//   - make_cache<F> allocates what cache_memory<F> (stack_cache_memory<F>) reports;
//   - decoding 1000 tokens, the logits stay within a bound of the float caches' logits: the
//     largest normwise difference of a row, max |Δ| / max |float row|, was measured (printed
//     below) and each bound is about twice it, as for the 16-bit caches in stack_test.cpp.
// Attention over each kind of quantized cache is exact up to its stored values: kv_quant_test
// and paged_quant_test show that bit for bit.
#include <apex/kv_quant.hpp>
#include <apex/stack.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <random>

#include "test_util.hpp"
#include "whole_block_stack.hpp"

namespace {

using apex::Index;

/// The stack of whole_block_stack.hpp: layers 0-4 and 6 local (W = 64), layer 5 global.
apex::StackConfig whole_block_config() { return apex::testing::whole_block_config(7, 6, 64, 1024); }

/// The largest normwise logit difference of a row over a prompt of 9 tokens and 991 decoded
/// ones, with every cache in F against float caches (2 sequences).
template <class F>
double logit_difference_over_1000_tokens() {
  const apex::testing::OneThread one_thread;
  const apex::StackConfig config = whole_block_config();
  const auto stack = apex::AttentionStack<float>::random(config, 41);
  const Index batch = 2, prefix = 9, tokens = 1000;
  std::mt19937 rng(42);
  std::uniform_int_distribution<std::int64_t> id(0, config.vocab_size - 1);
  apex::TokenMatrix ids(batch, tokens);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = id(rng);
  apex::StackCache<float> wide = stack.make_cache(batch, tokens);
  apex::StackCache<float, F> narrow = stack.template make_cache<F>(batch, tokens);
  EXPECT_EQ(narrow.bytes(), stack.template cache_memory<F>(batch, tokens).total_bytes);
  EXPECT_LT(2 * narrow.bytes(), wide.bytes());
  double worst = 0.0;
  const auto compare = [&](const apex::RowMatrix<float>& a, const apex::RowMatrix<float>& b) {
    for (Index r = 0; r < a.rows(); ++r) {
      worst = std::max(worst, static_cast<double>((a.row(r) - b.row(r)).cwiseAbs().maxCoeff() /
                                                  b.row(r).cwiseAbs().maxCoeff()));
    }
  };
  compare(stack.prefill(ids.leftCols(prefix), prefix, narrow),
          stack.prefill(ids.leftCols(prefix), prefix, wide));
  for (Index t = prefix; t < tokens; ++t) {
    compare(stack.decode_step({ids(0, t), ids(1, t)}, narrow),
            stack.decode_step({ids(0, t), ids(1, t)}, wide));
  }
  std::cout << "largest normwise logit difference over 1000 tokens, "
            << ::testing::internal::GetTypeName<F>() << " against float caches: " << worst << "\n";
  return worst;
}

TEST(StackQuant, Q8_0CachesStayWithinTheirBoundOfFloatCaches) {
  const double worst = logit_difference_over_1000_tokens<apex::BlockQ8_0>();
  EXPECT_LE(worst, 2.6e-2);  // measured 1.28e-2
  EXPECT_GT(worst, 0.0);
}

TEST(StackQuant, Q4_0CachesStayWithinTheirBoundOfFloatCaches) {
  const double worst = logit_difference_over_1000_tokens<apex::BlockQ4_0>();
  EXPECT_LE(worst, 4.2e-1);  // measured 2.07e-1
  EXPECT_GT(worst, 0.0);
}

TEST(StackQuant, Fp8CachesStayWithinTheirBoundOfFloatCaches) {
  const double worst = logit_difference_over_1000_tokens<apex::BlockFp8E4m3<32>>();
  EXPECT_LE(worst, 1.3e-1);  // measured 6.40e-2
  EXPECT_GT(worst, 0.0);
}

TEST(StackQuant, CacheMemoryCountsBlocksAndChecksWidths) {
  const apex::StackConfig config = whole_block_config();
  // Local: 2·H_kv = 4 rows of 32 values a token, one q8_0 block (34 bytes) each, for min(S, W)
  // tokens; global: d_kv = 64 (2 blocks) and one K_rope row of 32 (1 block).
  const apex::StackCacheMemory m = apex::stack_cache_memory<apex::BlockQ8_0>(config, 3, 100);
  EXPECT_EQ(m.local_layers, 6);
  EXPECT_EQ(m.global_layers, 1);
  EXPECT_EQ(m.local_bytes_per_token, 4 * 34);
  EXPECT_EQ(m.local_bytes_per_layer, 3 * 64 * 4 * 34);
  EXPECT_EQ(m.global_bytes_per_token, 3 * 34);
  EXPECT_EQ(m.global_bytes_per_layer, 3 * 100 * 3 * 34);
  EXPECT_EQ(m.total_bytes, 6 * m.local_bytes_per_layer + m.global_bytes_per_layer);
  EXPECT_EQ(apex::stack_cache_memory<float>(config, 3, 100).total_bytes,
            apex::stack_cache_memory(config, 3, 100, 4).total_bytes);
  apex::StackConfig odd = config;
  odd.local = apex::GqaConfig{64, 4, 2, 16};
  apex::testing::expect_invalid([&] { (void)apex::stack_cache_memory<apex::BlockQ8_0>(odd, 1, 8); },
                                "[stack] local head_dim (16) must be a multiple of the 32");
}

}  // namespace
