// SPDX-License-Identifier: MIT
// The APEX-1 stack over quantized caches (kv_quant.hpp): every layer's cache (the local layers'
// sliding windows, the global layers' latent rows) in q8_0, q4_0 or fp8 e4m3 blocks of 32, or
// the local layers in one format and the global layers in another (q8_0 windows beside
// FlashMLA's fp8 latent rows).
//   - make_cache<F, G> allocates what cache_memory<F, G> (stack_cache_memory<F, G>) reports,
//     each layer in its own format;
//   - decoding 1000 tokens, the logits stay within a bound of the float caches' logits: the
//     largest normwise difference of a row, max |Δ| / max |float row|, was measured (printed
//     below) and each bound is about twice it, as for the 16-bit caches in stack_test.cpp;
//   - serving sequences over paged caches of the two formats gives each what the contiguous
//     caches of the same formats give it alone.
// Attention over each kind of quantized cache is exact up to its stored values: kv_quant_test
// and paged_quant_test show that bit for bit.
#include <apex/kv_quant.hpp>
#include <apex/stack.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <random>
#include <variant>
#include <vector>

#include "test_util.hpp"
#include "tolerances.hpp"
#include "whole_block_stack.hpp"

namespace stack_quant_test {
namespace {

using apex::Index;

/// The stack of whole_block_stack.hpp: layers 0-4 and 6 local (W = 64), layer 5 global.
apex::StackConfig whole_block_config() { return apex::testing::whole_block_config(7, 6, 64, 1024); }

/// FlashMLA's fp8 latent row, for a global layer of d_kv = 128 and one K_rope head of 64.
using FlashRow = apex::FlashMlaFp8Row<128, 64>;

/// whole_block_config with the global layer's latent row FlashRow's.
apex::StackConfig flash_row_config() {
  apex::StackConfig c = whole_block_config();
  c.global.d_kv = 128;
  c.global.rope_dim = 64;
  return c;
}

/// The largest normwise logit difference of a row over a prompt of 9 tokens and 991 decoded
/// ones, with the local layers' caches in F and the global layers' in G against float caches
/// (2 sequences).
template <class F, class G = F>
double logit_difference_over_1000_tokens(const apex::StackConfig& config = whole_block_config()) {
  const apex::testing::OneThread one_thread;
  const auto stack = apex::AttentionStack<float>::random(config, 41);
  const Index batch = 2, prefix = 9, tokens = 1000;
  std::mt19937 rng(42);
  std::uniform_int_distribution<std::int64_t> id(0, config.vocab_size - 1);
  apex::TokenMatrix ids(batch, tokens);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = id(rng);
  apex::StackCache<float> wide = stack.make_cache(batch, tokens);
  apex::StackCache<float, F, G> narrow = stack.template make_cache<F, G>(batch, tokens);
  EXPECT_EQ(narrow.bytes(), (stack.template cache_memory<F, G>(batch, tokens).total_bytes));
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
            << ::testing::internal::GetTypeName<F>() << " and "
            << ::testing::internal::GetTypeName<G>() << " against float caches: " << worst << "\n";
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
  // make_cache makes the same check, named after the stack, before any layer allocates.
  const auto stack = apex::AttentionStack<float>::random(odd, 5);
  apex::testing::expect_invalid([&] { (void)stack.make_cache<apex::BlockQ8_0>(1, 8); },
                                "[stack] local head_dim (16) must be a multiple of the 32");
}

TEST(StackQuant, Q8_0WindowsAndFlashMlaRowsStayWithinTheirBoundOfFloatCaches) {
  const double worst =
      logit_difference_over_1000_tokens<apex::BlockQ8_0, FlashRow>(flash_row_config());
  EXPECT_LE(worst, 3.0e-2);  // measured 1.50e-2
  EXPECT_GT(worst, 0.0);
}

// make_cache<F, G> gives each local layer a window of F and each global layer latent rows of G,
// and allocates what cache_memory<F, G> reports: 2·H_kv q8_0 rows of 32 values a token for the
// windows, one FlashMLA row a token for the latent cache (128 fp8 codes, their float scale and
// 64 bfloat16 K_rope values: 260 bytes).
TEST(StackQuant, EachLayerStoresItsOwnFormat) {
  const apex::StackConfig config = flash_row_config();
  const auto stack = apex::AttentionStack<float>::random(config, 43);
  const apex::StackCache<float, apex::BlockQ8_0, FlashRow> cache =
      stack.make_cache<apex::BlockQ8_0, FlashRow>(3, 100);
  for (Index l = 0; l < config.num_layers; ++l) {
    if (apex::is_global_layer(l, config.global_every)) {
      EXPECT_TRUE((std::holds_alternative<apex::LatentCache<float, FlashRow>>(cache.layer(l))))
          << "layer " << l;
    } else {
      EXPECT_TRUE((
          std::holds_alternative<apex::SlidingWindowCache<float, apex::BlockQ8_0>>(cache.layer(l))))
          << "layer " << l;
    }
  }
  const apex::StackCacheMemory m = stack.cache_memory<apex::BlockQ8_0, FlashRow>(3, 100);
  EXPECT_EQ(m.local_bytes_per_token, 4 * 34);
  EXPECT_EQ(m.global_bytes_per_token, 128 + 4 + 64 * 2);
  EXPECT_EQ(m.local_bytes_per_layer, 3 * 64 * 4 * 34);
  EXPECT_EQ(m.global_bytes_per_layer, 3 * 100 * 260);
  EXPECT_EQ(cache.local_bytes(), 6 * m.local_bytes_per_layer);
  EXPECT_EQ(cache.global_bytes(), m.global_bytes_per_layer);
  EXPECT_EQ(cache.bytes(), m.total_bytes);
  // A latent row that is not FlashRow's is refused by name, before anything is allocated.
  apex::testing::expect_invalid(
      [&] {
        (void)apex::stack_cache_memory<apex::BlockQ8_0, FlashRow>(whole_block_config(), 1, 8);
      },
      "[stack] latent_dim d_kv (64) and H_kr*d_r (32) must be the row format's 128 and 64");
}

// Sequences served together over paged q8_0 windows and FlashMLA latent rows (prompts, then a
// token a step) get the logits that prefill and decode_step give each alone over a StackCache
// of the same formats, within the decoding tolerance (the two paths round the projections of
// different row counts alike, and the attention's sums in their own orders).
TEST(StackQuant, ServingQ8_0WindowsAndFlashMlaRowsEqualsEachSequenceAlone) {
  const apex::StackConfig config = flash_row_config();
  const auto stack = apex::AttentionStack<float>::random(config, 44);
  std::mt19937 rng(45);
  std::uniform_int_distribution<std::int64_t> id(0, config.vocab_size - 1);
  const std::vector<Index> prompts{5, 9, 3};
  constexpr Index kSteps = 6;
  auto serving = stack.make_serving_cache<apex::BlockQ8_0, FlashRow>({4, 64, 64});
  std::vector<apex::SequenceId> ids;
  std::vector<std::vector<std::int64_t>> tokens(prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(serving.add());
    for (Index t = 0; t < prompts[i] + kSteps; ++t) tokens[i].push_back(id(rng));
  }
  std::vector<apex::RowMatrix<float>> served(prompts.size(),
                                             apex::RowMatrix<float>(kSteps + 1, config.vocab_size));
  for (Index step = 0; step <= kSteps; ++step) {
    std::vector<std::vector<std::int64_t>> feed;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const Index from = step == 0 ? 0 : prompts[i] + step - 1;
      const Index to = prompts[i] + step;
      feed.emplace_back(tokens[i].begin() + from, tokens[i].begin() + to);
    }
    const apex::RowMatrix<float> logits = stack.serve(ids, feed, serving);
    for (std::size_t i = 0; i < prompts.size(); ++i) served[i].row(step) = logits.row(Index(i));
  }
  apex::DecodeOptions last;
  last.logits = apex::LogitRows::kLast;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    auto cache = stack.make_cache<apex::BlockQ8_0, FlashRow>(1, 64);
    const Eigen::Map<const apex::TokenMatrix> prompt(tokens[i].data(), 1, prompts[i]);
    apex::RowMatrix<float> alone(kSteps + 1, config.vocab_size);
    alone.row(0) = stack.prefill(prompt, 0, last, cache);
    for (Index step = 1; step <= kSteps; ++step) {
      alone.row(step) = stack.decode_step({tokens[i][std::size_t(prompts[i] + step - 1)]}, cache);
    }
    const double scale = std::max(1.0F, alone.cwiseAbs().maxCoeff());
    EXPECT_LE((served[i] - alone).cwiseAbs().maxCoeff(),
              apex::testing::Tolerances<float>::kDecode * scale)
        << "sequence " << i;
  }
}

}  // namespace
}  // namespace stack_quant_test
