// SPDX-License-Identifier: MIT
// Tests of include/apex/cache_memory.hpp: what KV caches cost, §7.4 (the KV-cache size), §8.3
// (GQA and MQA), §9.4 (MLA's latent cache) and §10.3 (the sliding window), and the checks that no
// size is returned wrapped. (The caches themselves are tested in kv_cache_test.cpp.)
#include <apex/cache_memory.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "test_util.hpp"

namespace cache_memory_test {
namespace {

using apex::Index;
using apex::testing::expect_invalid;

// ---------------------------------------------------------------------------------------------
// §7.4: values per token and bytes per layer
// ---------------------------------------------------------------------------------------------

TEST(CacheMemory, S7_4_KvCacheSize) {
  const std::int64_t context = std::int64_t{128} * 1024;
  const std::int64_t gib = std::int64_t{1} << 30;
  // §7.4 prints "4 GB per layer"; K and V together take 8 GiB, 4 GiB is K alone (SEED-NOTES.md).
  EXPECT_EQ(apex::kv_cache_bytes(1, context, 128, 128, 2), 8 * gib);
  EXPECT_EQ(apex::kv_cache_bytes(1, context, 128, 128, 2) / 2, 4 * gib);
  EXPECT_EQ(apex::kv_cache_values_per_token(128, 128), 32768);
  // Linear in every factor: batch 3, FP32.
  EXPECT_EQ(apex::kv_cache_bytes(3, context, 128, 128, 4), 48 * gib);
}

TEST(CacheMemory, SizeHelpersRejectNegativeOrOverflowingArguments) {
  // 2 · 2^62 · 2 = 2^64 wraps to 0 in 64 bits: rejected, never returned wrapped.
  const std::int64_t huge = std::int64_t{1} << 62;
  expect_invalid([&] { (void)apex::kv_cache_values_per_token(huge, 2); },
                 {"[kv_cache_values_per_token] 2*H_kv*d_h", "overflows 64 bits"});
  expect_invalid([] { (void)apex::kv_cache_values_per_token(8, -1); },
                 {"[kv_cache_values_per_token] 2*H_kv*d_h", "must not be negative"});
  expect_invalid([&] { (void)apex::kv_cache_bytes(huge, 4, 1, 1, 2); },
                 {"[kv_cache_bytes] 2*B*S*H_kv*d_h*bytes", "overflows 64 bits"});
  expect_invalid([] { (void)apex::kv_cache_bytes(1, -131072, 128, 128, 2); },
                 {"[kv_cache_bytes] 2*B*S*H_kv*d_h*bytes", "must not be negative"});
  // The largest representable results are still returned.
  EXPECT_EQ(apex::kv_cache_values_per_token(huge / 2, 1), huge);
}

// ---------------------------------------------------------------------------------------------
// §7.4, §8.3, §9.4, §10.3 for APEX-1 Large
// ---------------------------------------------------------------------------------------------

// The documents give H_q = 128, H_kv = 8, d_h = 128, d_kv = 512, W = 4096 and a 128K context for
// APEX-1 Large, FP16; they give no d_r (their range is 32-64): 64, as DeepSeek-V2/V3 use.
apex::CacheComparisonParams apex1_large(Index rope_heads) {
  apex::CacheComparisonParams p;
  p.num_q_heads = 128;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.latent_dim = 512;
  p.rope_dim = 64;
  p.rope_heads = rope_heads;
  p.window = 4096;
  p.context = 131072;
  p.batch = 1;
  p.bytes_per_value = 2;
  return p;
}

TEST(CacheMemory, S7_4_S8_3_S9_4_CacheTablesForApex1Large) {
  const auto rows = apex::cache_comparison(apex1_large(8));
  ASSERT_EQ(rows.size(), 6u);
  constexpr std::int64_t kGiB = std::int64_t{1} << 30;
  constexpr std::int64_t kMiB = std::int64_t{1} << 20;
  // §7.4 prints "4 GB per layer"; K and V take 2 × 131072 × 128 × 128 × 2 bytes = 8 GiB
  // (4 GiB is K alone) (SEED-NOTES.md).
  EXPECT_EQ(rows[0].method, "MHA");
  EXPECT_EQ(rows[0].values_per_token, 2 * 128 * 128);
  EXPECT_EQ(rows[0].bytes_per_layer, 8 * kGiB);
  EXPECT_EQ(rows[0].relative, 1.0);
  // §8.3: GQA with 8 KV heads 0.0625 (16× smaller), MQA 1/128 = 0.0078.
  EXPECT_EQ(rows[1].method, "GQA");
  EXPECT_EQ(rows[1].values_per_token, 2 * 8 * 128);
  EXPECT_EQ(rows[1].bytes_per_layer, 512 * kMiB);
  EXPECT_DOUBLE_EQ(rows[1].relative, 0.0625);
  EXPECT_EQ(rows[2].method, "MQA");
  EXPECT_EQ(rows[2].bytes_per_layer, 64 * kMiB);
  EXPECT_DOUBLE_EQ(rows[2].relative, 0.0078125);
  // §10.3: the window keeps 4096 of the 131072 tokens, 32× less than full GQA: 16 MiB.
  EXPECT_EQ(rows[3].method, "GQA + window");
  EXPECT_EQ(rows[3].bytes_per_layer, 16 * kMiB);
  EXPECT_DOUBLE_EQ(rows[3].relative, 1.0 / 512.0);
  EXPECT_EQ(rows[1].bytes_per_layer / rows[3].bytes_per_layer, 32);
  // §9.4 prints 1.6% for c_kv alone: 512 / 32768 = 1.5625%.
  EXPECT_EQ(rows[4].values_per_token, 512);
  EXPECT_EQ(rows[4].bytes_per_layer, 128 * kMiB);
  EXPECT_DOUBLE_EQ(rows[4].relative, 0.015625);
  // What MLA has to cache: c_kv and K_rope, 512 + 8·64 = 1024 values per token (3.125%) with
  // §9.3's H_kr = H_kv = 8, 512 + 64 = 576 (1.7578%) with one shared K_rope head (SEED-NOTES.md).
  EXPECT_EQ(rows[5].values_per_token, 1024);
  EXPECT_EQ(rows[5].bytes_per_layer, 256 * kMiB);
  EXPECT_DOUBLE_EQ(rows[5].relative, 0.03125);
  const auto shared = apex::cache_comparison(apex1_large(1));
  EXPECT_EQ(shared[5].values_per_token, 576);
  EXPECT_EQ(shared[5].bytes_per_layer, 144 * kMiB);
  EXPECT_DOUBLE_EQ(shared[5].relative, 576.0 / 32768.0);

  apex::CacheComparisonParams bad = apex1_large(1);
  bad.window = 0;
  expect_invalid([&] { apex::cache_comparison(bad); }, {"[cache_comparison]", "W 0"});
}

TEST(CacheMemory, WindowBytesAreCappedAtW) {
  EXPECT_EQ(apex::sliding_window_cache_bytes(1, 100, 4096, 8, 128, 2), 2 * 100 * 8 * 128 * 2);
  EXPECT_EQ(apex::sliding_window_cache_bytes(3, 1 << 20, 4096, 8, 128, 2),
            3LL * 2 * 4096 * 8 * 128 * 2);
}

TEST(CacheMemory, SizesBeyond64BitsAreRejectedNotWrapped) {
  // 2^62 · 4 wraps to 0 in 64 bits: a formula must throw rather than return the wrapped size.
  // (The caches' own constructors and reserve() are checked in kv_cache_test.cpp.)
  const Index huge = Index{1} << 62;
  expect_invalid([&] { (void)apex::sliding_window_cache_bytes(huge, 8, 4, 1, 1, 2); },
                 {"[sliding_window_cache_bytes]", "overflows 64 bits"});
  // d_kv + H_kr·d_r = max + 1 does not fit.
  const Index max = std::numeric_limits<Index>::max();
  expect_invalid([&] { (void)apex::latent_cache_bytes(1, 1, max, 1, 1, 1); },
                 "[latent_cache_bytes] d_kv + H_kr*d_r");
  expect_invalid([&] { (void)apex::kv_cache_bytes(-1, 1, 1, 1, 2); },
                 "[kv_cache_bytes] 2*B*S*H_kv*d_h*bytes");
  apex::CacheComparisonParams p = apex1_large(8);
  p.num_q_heads = huge;
  expect_invalid([&] { (void)apex::cache_comparison(p); }, {"[cache_comparison]", "overflows"});
}

}  // namespace

TEST(CacheMemory, FormatsCountTheirBlocks) {
  // 2·B·S·H_kv·(bytes of a row of d_h values): half 2 bytes a value, q8_0 34 per 32, q4_0 18 per
  // 32, fp8 with a float scale per 128 values 132 per 128.
  EXPECT_EQ(apex::kv_cache_bytes<Eigen::half>(1, 131072, 8, 128),
            apex::kv_cache_bytes(1, 131072, 8, 128, 2));
  EXPECT_EQ(apex::kv_cache_bytes<apex::BlockQ8_0>(2, 100, 8, 128), 2LL * 2 * 100 * 8 * 4 * 34);
  EXPECT_EQ(apex::kv_cache_bytes<apex::BlockQ4_0>(1, 100, 8, 128), 2LL * 100 * 8 * 4 * 18);
  EXPECT_EQ(apex::kv_cache_bytes<apex::BlockFp8E4m3<128>>(1, 100, 8, 256), 2LL * 100 * 8 * 2 * 132);
  expect_invalid([] { (void)apex::kv_cache_bytes<apex::BlockQ8_0>(1, 1, 1, 48); },
                 {"[kv_cache_bytes] head_dim (48)", "multiple of the 32"});
}

TEST(CacheMemory, QuantizedCachesOfApex1Large) {
  constexpr std::int64_t kMiB = std::int64_t{1} << 20;
  const auto rows = apex::quantized_cache_comparison(apex1_large(1));
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0].method, "GQA, FP16");
  EXPECT_EQ(rows[0].bytes_per_layer, 512 * kMiB);  // the GQA row of cache_comparison
  EXPECT_DOUBLE_EQ(rows[0].relative, 0.0625);
  EXPECT_EQ(rows[1].bytes_per_layer, 272 * kMiB);  // 8.5 bits a value
  EXPECT_EQ(rows[2].bytes_per_layer, 144 * kMiB);  // 4.5 bits a value
  EXPECT_EQ(rows[3].bytes_per_layer, 264 * kMiB);  // 8.25 bits a value
  EXPECT_EQ(rows[4].bytes_per_layer, 144 * kMiB);  // 576 values of 2 bytes
  // FlashMLA's fp8 layout: 512 e4m3 codes, 4 float scales, 64 bfloat16 values = 656 bytes.
  EXPECT_EQ(rows[5].bytes_per_layer, 131072LL * 656);
  expect_invalid([] { (void)apex::quantized_cache_comparison(apex::CacheComparisonParams{}); },
                 "[cache_comparison]");
  apex::CacheComparisonParams odd = apex1_large(1);
  odd.head_dim = 96;
  expect_invalid([&] { (void)apex::quantized_cache_comparison(odd); },
                 {"[quantized_cache_comparison] head_dim (96)"});
}
}  // namespace cache_memory_test
