// SPDX-License-Identifier: MIT
// detail/simd_kernels.hpp: apex's own float kernels, on every level this CPU runs, against plain
// double loops. The attention suites run again on every level (tests/CMakeLists.txt), which
// checks them inside the tiled kernel; these check each kernel alone, at its edges.
#include <apex/detail/simd_kernels.hpp>
#include <apex/storage.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace simd_kernels_test {
namespace {

using apex::Index;
using apex::KernelIsa;
using apex::detail::Bf16Kernels;
using apex::detail::Bf16Pair;
using apex::detail::FloatKernels;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kEps = std::numeric_limits<float>::epsilon() / 2;  // u, float's unit roundoff

/// The levels with kernels of their own that this CPU runs.
std::vector<KernelIsa> levels() {
  std::vector<KernelIsa> out;
  for (const KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (apex::cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

std::vector<float> normal(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

/// c [rows × cols] (ld_c) = (add ? diag(scale)·c : 0) + a [rows × depth] · b [depth × cols], with
/// the gemm of level `k`: b transposed into panels first when `transposed` (b given as
/// [cols × depth], the scores' K), else as it is (the update's V).
void run_gemm(const FloatKernels& k, std::vector<float>& c, Index ld_c, const std::vector<float>& a,
              const std::vector<float>& b, Index rows, Index cols, Index depth, bool add,
              bool transposed, const float* scale = nullptr) {
  if (transposed) {
    std::vector<float> packed(static_cast<std::size_t>(k.packed_size(cols, depth)) + 1);
    k.pack_transposed(packed.data(), b.data(), depth, cols, depth);
    k.f32.gemm(c.data(), ld_c, a.data(), depth, packed.data(), k.panel, depth * k.panel, rows, cols,
               depth, add, scale);
  } else {
    k.f32.gemm(c.data(), ld_c, a.data(), depth, b.data(), cols, k.panel, rows, cols, depth, add,
               scale);
  }
}

TEST(SimdKernels, GemmEqualsTheDoubleLoopsAndWritesOnlyItsColumns) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    for (const bool transposed : {true, false}) {
      for (const Index rows : {1, 5, 6, 7, 11, 12, 13, 25}) {
        for (const Index cols : {1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 70}) {
          for (const Index depth : {0, 1, 3, 64, 129}) {
            for (const bool add : {false, true}) {
              const auto a = normal(static_cast<std::size_t>(rows * depth), 1);
              const auto b = normal(static_cast<std::size_t>(depth * cols), 2);
              const Index ld_c = cols + 5;
              auto c = normal(static_cast<std::size_t>(rows * ld_c), 3);
              for (Index i = 0; i < rows; ++i) {  // beyond the columns: sentinels
                std::fill(c.data() + i * ld_c + cols, c.data() + (i + 1) * ld_c, 1234.5F);
              }
              const std::vector<float> c0 = c;
              run_gemm(k, c, ld_c, a, b, rows, cols, depth, add, transposed);
              const float* cp = c.data();
              const float* ap = a.data();
              const float* bp = b.data();
              for (Index i = 0; i < rows; ++i) {
                for (Index j = 0; j < cols; ++j) {
                  double sum = add ? c0.data()[i * ld_c + j] : 0.0;
                  double magnitude = std::abs(sum);
                  for (Index t = 0; t < depth; ++t) {
                    const double bt = transposed ? bp[j * depth + t] : bp[t * cols + j];
                    sum += double(ap[i * depth + t]) * bt;
                    magnitude += std::abs(double(ap[i * depth + t]) * bt);
                  }
                  // A chain of depth + 1 roundings: |error| <= (depth + 1)·u·Σ|terms|.
                  const double bound = double(depth + 1) * kEps * magnitude;
                  ASSERT_LE(std::abs(cp[i * ld_c + j] - sum), bound)
                      << apex::to_string(isa) << " rows " << rows << " cols " << cols << " depth "
                      << depth << " at (" << i << ", " << j << ")";
                }
                for (Index j = cols; j < ld_c; ++j) ASSERT_EQ(cp[i * ld_c + j], 1234.5F);
              }
            }
          }
        }
      }
    }
  }
}

TEST(SimdKernels, GemmGivesARowTheSameBitsWhateverTheRowsBesideIt) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    const Index rows = 29, cols = 45, depth = 70;
    const auto a = normal(static_cast<std::size_t>(rows * depth), 4);
    const auto b = normal(static_cast<std::size_t>(depth * cols), 5);
    std::vector<float> all(static_cast<std::size_t>(rows * cols));
    run_gemm(k, all, cols, a, b, rows, cols, depth, false, true);
    for (Index i = 0; i < rows; ++i) {
      const std::vector<float> row_a(a.begin() + i * depth, a.begin() + (i + 1) * depth);
      std::vector<float> one(static_cast<std::size_t>(cols));
      run_gemm(k, one, cols, row_a, b, 1, cols, depth, false, true);
      EXPECT_EQ(std::memcmp(one.data(), all.data() + i * cols, sizeof(float) * cols), 0)
          << apex::to_string(isa) << " row " << i;
    }
  }
}

/// x rounded to storage type T and read back as float, and the T values themselves.
template <class T>
std::vector<T> stored(const std::vector<float>& x) {
  std::vector<T> out;
  for (const float v : x) out.push_back(static_cast<T>(v));
  return out;
}
template <class T>
std::vector<float> widened(const std::vector<T>& x) {
  std::vector<float> out;
  for (const T v : x) out.push_back(static_cast<float>(v));
  return out;
}

/// q · k as the streaming scores (dots) form it with vectors of L lanes, written out in scalar
/// float: two accumulators over alternating chunks of L values (fused multiply-adds; the lanes
/// past d of a last, masked chunk multiply zeros), added lane by lane, then summed across lanes
/// in pairs (l, l + L/2), (l, l + L/4), ..., (l, l + 1).
float modelled_dot(const float* q, const float* k, Index d, Index lanes) {
  std::vector<float> even(static_cast<std::size_t>(lanes)), odd(even);
  const auto chunk = [&](std::vector<float>& acc, Index c) {
    for (Index l = 0; l < lanes; ++l) {
      const bool in = c + l < d;
      acc[static_cast<std::size_t>(l)] =
          std::fma(in ? q[c + l] : 0.0f, in ? k[c + l] : 0.0f, acc[static_cast<std::size_t>(l)]);
    }
  };
  Index c = 0;
  for (; c + 2 * lanes <= d; c += 2 * lanes) {
    chunk(even, c);
    chunk(odd, c + lanes);
  }
  if (c + lanes <= d) {
    chunk(even, c);
    c += lanes;
  }
  if (c < d) chunk(odd, c);
  std::vector<float> v(even.size());
  for (std::size_t l = 0; l < v.size(); ++l) v[l] = even[l] + odd[l];
  for (std::size_t width = v.size() / 2; width >= 1; width /= 2) {
    for (std::size_t l = 0; l < width; ++l) v[l] = v[l] + v[l + width];
  }
  return v[0];
}

/// The streaming products on rows stored as T: gemm with a 16-bit b (the values of a decoding
/// step) and dots (its scores), against the double loops on the widened values and, for the
/// scores, bit for bit against their order of operations written out (modelled_dot), and the
/// same bits for a row whatever the rows beside it.
template <class T>
void check_streaming_products(const char* type) {
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    const auto& kernels = k.rows<T>();
    for (const Index rows : {1, 3, 4, 5, 8, 13}) {
      for (const Index d : {1, 7, 8, 16, 17, 33, 64, 130}) {
        const Index n = 37, stride = d + 3;
        const auto q = normal(static_cast<std::size_t>(rows * d), 8);
        const auto keys = stored<T>(normal(static_cast<std::size_t>(n * stride), 9));
        const auto keys_f = widened(keys);
        std::vector<float> s(static_cast<std::size_t>(rows * n));
        kernels.dots(s.data(), n, q.data(), rows, apex::detail::simd_elements(keys.data()), stride,
                     n, d);
        std::vector<float> acc = normal(static_cast<std::size_t>(rows * d), 10);
        const std::vector<float> acc0 = acc;
        const auto p = normal(static_cast<std::size_t>(rows * n), 11);
        kernels.update(acc.data(), d, p.data(), n, rows, apex::detail::simd_elements(keys.data()),
                       stride, n, d);
        for (Index i = 0; i < rows; ++i) {
          for (Index j = 0; j < n; ++j) {
            double dot = 0, size = 0;
            for (Index c = 0; c < d; ++c) {
              const double term = double(q.data()[i * d + c]) * keys_f.data()[j * stride + c];
              dot += term;
              size += std::abs(term);
            }
            ASSERT_LE(std::abs(s.data()[i * n + j] - dot), double(d + 1) * kEps * size)
                << type << " " << apex::to_string(isa) << " dots rows " << rows << " d " << d;
            const float modelled = modelled_dot(q.data() + i * d, keys_f.data() + j * stride, d,
                                                isa == KernelIsa::kAvx2 ? 8 : 16);
            ASSERT_EQ(std::memcmp(&modelled, s.data() + i * n + j, sizeof modelled), 0)
                << type << " " << apex::to_string(isa) << " dots rows " << rows << " d " << d
                << " key " << j << ": " << s.data()[i * n + j] << " vs " << modelled;
          }
          for (Index c = 0; c < d; ++c) {
            double sum = acc0.data()[i * d + c], size = std::abs(sum);
            for (Index j = 0; j < n; ++j) {
              const double term = double(p.data()[i * n + j]) * keys_f.data()[j * stride + c];
              sum += term;
              size += std::abs(term);
            }
            ASSERT_LE(std::abs(acc.data()[i * d + c] - sum), double(n + 1) * kEps * size)
                << type << " " << apex::to_string(isa) << " gemm rows " << rows << " d " << d;
          }
        }
        for (Index i = 0; i < rows; ++i) {  // one row alone
          std::vector<float> one(static_cast<std::size_t>(n));
          kernels.dots(one.data(), n, q.data() + i * d, 1, apex::detail::simd_elements(keys.data()),
                       stride, n, d);
          EXPECT_EQ(std::memcmp(one.data(), s.data() + i * n, sizeof(float) * n), 0)
              << type << " dots row " << i << " of " << rows;
        }
      }
    }
  }
}

TEST(SimdKernels, StreamingProductsReadFloatBfloat16AndHalfRows) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  check_streaming_products<float>("float");
  check_streaming_products<Eigen::bfloat16>("bfloat16");
  check_streaming_products<Eigen::half>("half");
}

/// Every fp8 code of kind K through each level's streaming scores, which decode the codes in
/// registers: key j is a block of 128 copies of code j (scale s) and the query is 1/128 in every
/// lane, so that score j is exactly value(j)·s rounded once (128 equal terms sum without
/// rounding), NaN for a NaN code and ±inf for e5m2's infinities. The scales: 0.5; 2^121, which
/// times e4m3's 2^8 would overflow (the kernels then scale each value first: the large codes'
/// products overflow, the small ones' do not); and 2^-120, whose products are subnormal for the
/// smallest codes. (QuantizedAttention's tests check scales whose products round.)
template <apex::Fp8Kind K>
void check_every_fp8_code(const char* kind) {
  using Block = apex::BlockFp8<K>;
  constexpr Index kCodes = 256, kValues = Block::kValues;
  for (const float scale : {0.5f, 0x1p121f, 0x1p-120f}) {
    std::vector<Block> keys(kCodes);
    for (Index j = 0; j < kCodes; ++j) {
      Block& key = keys[static_cast<std::size_t>(j)];
      key.scale = scale;
      std::fill(std::begin(key.code), std::end(key.code), static_cast<std::uint8_t>(j));
    }
    const std::vector<float> q(kValues, 1.0f / kValues);
    for (const KernelIsa isa : levels()) {
      const auto& kernels = apex::detail::float_kernels(isa)->rows<Block>();
      std::vector<float> s(kCodes);
      kernels.dots(s.data(), kCodes, q.data(), 1, keys.data(), 1, kCodes, kValues);
      for (Index j = 0; j < kCodes; ++j) {
        const float expected = apex::fp8_decode<K>(static_cast<std::uint8_t>(j)) * scale;
        const float got = s[static_cast<std::size_t>(j)];
        ASSERT_TRUE(got == expected || (std::isnan(got) && std::isnan(expected)))
            << kind << " " << apex::to_string(isa) << " scale " << scale << " code " << j << ": "
            << got << " vs " << expected;
      }
    }
  }
}

TEST(SimdKernels, StreamingScoresDecodeEveryFp8Code) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  check_every_fp8_code<apex::Fp8Kind::kE4m3>("e4m3");
  check_every_fp8_code<apex::Fp8Kind::kE5m2>("e5m2");
}

TEST(SimdKernels, GemmScalesEachRowAsScalingFirstWould) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    const Index rows = 19, cols = 45, depth = 33;
    const auto a = normal(static_cast<std::size_t>(rows * depth), 12);
    const auto b = normal(static_cast<std::size_t>(depth * cols), 13);
    const auto c0 = normal(static_cast<std::size_t>(rows * cols), 14);
    std::vector<float> scale(static_cast<std::size_t>(rows));
    for (Index i = 0; i < rows; ++i) {
      scale.data()[i] = i % 3 == 0 ? 1.0F : std::exp(-0.3F * static_cast<float>(i));
    }
    std::vector<float> fused = c0;
    run_gemm(k, fused, cols, a, b, rows, cols, depth, true, false, scale.data());
    std::vector<float> first = c0;
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < cols; ++j) first.data()[i * cols + j] *= scale.data()[i];
    }
    run_gemm(k, first, cols, a, b, rows, cols, depth, true, false);
    EXPECT_EQ(std::memcmp(fused.data(), first.data(), sizeof(float) * fused.size()), 0)
        << apex::to_string(isa);
  }
}

TEST(SimdKernels, PackTransposedPadsThePanelsWithZeros) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    const Index n = k.panel + 3, d = 5, ld = 7;
    const auto keys = normal(static_cast<std::size_t>(n * ld), 6);
    std::vector<float> packed(static_cast<std::size_t>(k.packed_size(n, d)), -1.0F);
    ASSERT_EQ(k.packed_size(n, d), 2 * k.panel * d);
    k.pack_transposed(packed.data(), keys.data(), ld, n, d);
    for (Index j = 0; j < 2 * k.panel; ++j) {
      for (Index c = 0; c < d; ++c) {
        const float got = packed.data()[(j / k.panel * d + c) * k.panel + j % k.panel];
        EXPECT_EQ(got, j < n ? keys.data()[j * ld + c] : 0.0F) << "key " << j << " column " << c;
      }
    }
  }
}

/// The bfloat16 dot-product kernels of each level this CPU runs (AVX512-BF16, AMX), each with
/// its name; a level it lacks is named on stdout as not run.
std::vector<std::pair<const char*, const Bf16Kernels*>> bf16_kernels() {
  std::vector<std::pair<const char*, const Bf16Kernels*>> kernels;
  for (const KernelIsa isa : {KernelIsa::kAvx512Bf16, KernelIsa::kAmx}) {
    if (apex::cpu_supports(isa)) {
      kernels.emplace_back(apex::to_string(isa), apex::detail::float_kernels(isa)->bf16);
    } else {
      std::printf("this CPU does not run level %s: its bfloat16 kernels are not tested\n",
                  apex::to_string(isa));
    }
  }
  return kernels;
}

/// x rounded to bfloat16 (Eigen's conversion, to nearest even) and back.
double bf16_value(float x) { return double(static_cast<float>(Eigen::bfloat16(x))); }

/// The bfloat16 gemm, as run_gemm: a rounded into pairs along the depth, b packed as the keys
/// ([cols × depth], `transposed`) or as the values ([depth × cols]).
void run_bf16_gemm(const Bf16Kernels& k, std::vector<float>& c, Index ld_c,
                   const std::vector<float>& a, const std::vector<float>& b, Index rows, Index cols,
                   Index depth, bool add, bool transposed, const float* scale = nullptr) {
  const Index pairs = Bf16Kernels::pairs(depth);
  std::vector<Bf16Pair> a_pairs(static_cast<std::size_t>(rows * pairs) + 1);
  k.round_pairs(a_pairs.data(), pairs, a.data(), depth, rows, depth);
  if (transposed) {
    std::vector<Bf16Pair> packed(static_cast<std::size_t>(k.packed_pairs(cols, depth)) + 1);
    k.pack_keys(packed.data(), b.data(), depth, cols, depth);
    k.gemm(c.data(), ld_c, a_pairs.data(), pairs, packed.data(), k.panel, pairs * k.panel, rows,
           cols, pairs, add, scale);
  } else {
    std::vector<Bf16Pair> packed(static_cast<std::size_t>(pairs * cols) + 1);
    k.pack_values(packed.data(), b.data(), cols, depth, cols);
    k.gemm(c.data(), ld_c, a_pairs.data(), pairs, packed.data(), cols, k.panel, rows, cols, pairs,
           add, scale);
  }
}

TEST(SimdKernels, Bf16GemmEqualsTheDoubleLoopsOnTheRoundedFactors) {
  const auto levels = bf16_kernels();
  if (levels.empty()) GTEST_SKIP() << "this CPU lacks AVX512-BF16: the kernels are not run";
  // Shapes around the register tiles of AVX-512 (12 × 32) and AMX's tiles (16 rows, 32 columns
  // and 32 values deep, in blocks of 32 rows).
  for (const auto& [name, k] : levels) {
    for (const bool transposed : {true, false}) {
      for (const Index rows : {1, 5, 11, 12, 13, 16, 25, 32, 47, 48, 64}) {
        for (const Index cols : {1, 15, 16, 17, 31, 32, 33, 64, 70}) {
          for (const Index depth : {0, 1, 3, 31, 32, 33, 64, 129}) {
            for (const bool add : {false, true}) {
              const auto a = normal(static_cast<std::size_t>(rows * depth), 1);
              const auto b = normal(static_cast<std::size_t>(depth * cols), 2);
              const auto scale = normal(static_cast<std::size_t>(rows), 6);
              const Index ld_c = cols + 5;
              auto c = normal(static_cast<std::size_t>(rows * ld_c), 3);
              for (Index i = 0; i < rows; ++i) {
                std::fill(c.data() + i * ld_c + cols, c.data() + (i + 1) * ld_c, 1234.5F);
              }
              const std::vector<float> c0 = c;
              run_bf16_gemm(*k, c, ld_c, a, b, rows, cols, depth, add, transposed, scale.data());
              for (Index i = 0; i < rows; ++i) {
                for (Index j = 0; j < cols; ++j) {
                  // The start is rounded once (c·scale), each product of two bfloat16 values is
                  // exact in float, and each pair step rounds at most twice.
                  const double start =
                      add ? double(c0[std::size_t(i * ld_c + j)] * scale[std::size_t(i)]) : 0.0;
                  double sum = start, magnitude = std::abs(start);
                  for (Index t = 0; t < depth; ++t) {
                    const float bt =
                        transposed ? b[std::size_t(j * depth + t)] : b[std::size_t(t * cols + j)];
                    const double term = bf16_value(a[std::size_t(i * depth + t)]) * bf16_value(bt);
                    sum += term;
                    magnitude += std::abs(term);
                  }
                  const double bound = double(depth + 1) * kEps * magnitude;
                  ASSERT_LE(std::abs(c[std::size_t(i * ld_c + j)] - sum), bound)
                      << name << (transposed ? " keys" : " values") << " rows " << rows << " cols "
                      << cols << " depth " << depth << " add " << add << " at (" << i << ", " << j
                      << ")";
                }
                for (Index j = cols; j < ld_c; ++j)
                  ASSERT_EQ(c[std::size_t(i * ld_c + j)], 1234.5F);
              }
            }
          }
        }
      }
    }
  }
}

// pack_keys writes the documented layout: panel p's row t holds, in lane l, the pair
// (k(j, 2t), k(j, 2t + 1)) of key j = p·panel + l rounded to bfloat16 (to nearest even, as
// Eigen rounds), 0 past n or d; n and d around the 16 × 16 blocks it transposes.
TEST(SimdKernels, Bf16PackedKeysFollowTheLayout) {
  const auto levels = bf16_kernels();
  if (levels.empty()) GTEST_SKIP() << "this CPU lacks AVX512-BF16: the kernels are not run";
  const auto bits = [](float x) {
    return static_cast<std::uint32_t>(Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(x)));
  };
  for (const auto& [name, k] : levels) {
    for (const Index n : {1, 15, 16, 17, 33, 64, 100}) {
      for (const Index d : {1, 2, 21, 31, 32, 33, 64, 129}) {
        const Index ld = d + 3, pairs = Bf16Kernels::pairs(d);
        const auto x = normal(static_cast<std::size_t>(n * ld), 11);
        std::vector<Bf16Pair> packed(static_cast<std::size_t>(k->packed_pairs(n, d)), {1U});
        k->pack_keys(packed.data(), x.data(), ld, n, d);
        const auto value = [&](Index j, Index c) {
          return j < n && c < d ? bits(x[std::size_t(j * ld + c)]) : 0U;
        };
        for (std::size_t at = 0; at < packed.size(); ++at) {
          const Index panel = Index(at) / (k->panel * pairs), l = Index(at) % k->panel;
          const Index t = Index(at) / k->panel % pairs, j = panel * k->panel + l;
          ASSERT_EQ(packed[at].bits, value(j, 2 * t) | value(j, 2 * t + 1) << 16U)
              << name << ": n " << n << " d " << d << ", key " << j << " pair " << t;
        }
      }
    }
  }
}

TEST(SimdKernels, Bf16PackingOfStoredRowsEqualsPackingTheirFloatValues) {
  const auto levels = bf16_kernels();
  if (levels.empty()) GTEST_SKIP() << "this CPU lacks AVX512-BF16: the kernels are not run";
  const Bf16Kernels* k = levels.front().second;  // AMX packs and rounds with the same functions
  for (const Index n : {1, 15, 16, 17, 33, 64}) {
    for (const Index d : {1, 2, 21, 31, 32, 33, 64, 129}) {
      const Index ld = d + 3;  // rows with a stride
      auto x = normal(static_cast<std::size_t>(n * ld), 7);
      for (float& value : x) value = static_cast<float>(bf16_value(value));
      std::vector<Eigen::bfloat16> stored(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) stored[i] = Eigen::bfloat16(x[i]);
      const auto* bits = reinterpret_cast<const apex::detail::Bf16Bits*>(stored.data());
      const auto packed_size = static_cast<std::size_t>(k->packed_pairs(n, d));
      std::vector<Bf16Pair> from_float(packed_size, Bf16Pair{1U}),
          from_stored(packed_size, Bf16Pair{2U});
      k->pack_keys(from_float.data(), x.data(), ld, n, d);
      k->pack_keys_bf16(from_stored.data(), bits, ld, n, d);
      EXPECT_EQ(std::memcmp(from_float.data(), from_stored.data(), packed_size * sizeof(Bf16Pair)),
                0)
          << "keys n " << n << " d " << d;
      const auto value_size = static_cast<std::size_t>(Bf16Kernels::pairs(n) * d);
      std::vector<Bf16Pair> v_float(value_size, Bf16Pair{1U}), v_stored(value_size, Bf16Pair{2U});
      k->pack_values(v_float.data(), x.data(), ld, n, d);
      k->pack_values_bf16(v_stored.data(), bits, ld, n, d);
      EXPECT_EQ(std::memcmp(v_float.data(), v_stored.data(), value_size * sizeof(Bf16Pair)), 0)
          << "values n " << n << " d " << d;
    }
  }
}

TEST(SimdKernels, Bf16RoundingIsToNearestEvenAndKeepsNaN) {
  const auto levels = bf16_kernels();
  if (levels.empty()) GTEST_SKIP() << "this CPU lacks AVX512-BF16: the kernels are not run";
  const Bf16Kernels* k = levels.front().second;  // AMX packs and rounds with the same functions
  // Ties below and above an even bfloat16, values just past them, ±inf, NaN, a float subnormal
  // (which the instructions take as zero), and an odd count (the last pair's second half is 0).
  const std::vector<std::uint32_t> bits = {0x3F808000U, 0x3F818000U, 0x3F808001U,
                                           0xBF818000U, 0x7F800000U, 0xFF800000U,
                                           0x7FC00001U, 0x00010000U, 0x42F6E979U};
  std::vector<float> x(bits.size());
  std::memcpy(x.data(), bits.data(), sizeof(float) * bits.size());
  const Index n = static_cast<Index>(x.size());
  std::vector<Bf16Pair> pairs(static_cast<std::size_t>(Bf16Kernels::pairs(n)), Bf16Pair{~0U});
  k->round_pairs(pairs.data(), 0, x.data(), n, 1, n);
  std::vector<std::uint16_t> halves(2 * pairs.size());
  std::memcpy(halves.data(), pairs.data(), sizeof(std::uint16_t) * halves.size());
  const std::vector<std::uint16_t> want = {0x3F80, 0x3F82, 0x3F81, 0xBF82, 0x7F80,
                                           0xFF80, 0,      0x0000, 0x42F7, 0x0000};
  for (std::size_t i = 0; i < halves.size(); ++i) {
    if (i == 6) {
      EXPECT_EQ(halves[i] & 0x7F80U, 0x7F80U) << "NaN keeps its exponent";
      EXPECT_NE(halves[i] & 0x007FU, 0U) << "NaN stays NaN";
    } else {
      EXPECT_EQ(halves[i], want[i]) << "value " << i;
    }
  }
  // Rows long enough for whole vectors of 32 values, with ties, as Eigen rounds them.
  for (const Index cols : {32, 64, 77}) {
    auto row = normal(static_cast<std::size_t>(cols), 9);
    for (Index c = 0; c < cols; c += 5) {  // ties: the lower 16 bits 0x8000
      std::uint32_t u = 0;
      std::memcpy(&u, &row[std::size_t(c)], sizeof u);
      u = (u & 0xFFFF0000U) | 0x8000U;
      std::memcpy(&row[std::size_t(c)], &u, sizeof u);
    }
    std::vector<Bf16Pair> out(static_cast<std::size_t>(Bf16Kernels::pairs(cols)), Bf16Pair{~0U});
    k->round_pairs(out.data(), 0, row.data(), cols, 1, cols);
    std::vector<std::uint16_t> got(2 * out.size());
    std::memcpy(got.data(), out.data(), sizeof(std::uint16_t) * got.size());
    for (Index c = 0; c < cols; ++c) {
      EXPECT_EQ(got[std::size_t(c)],
                Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(row[std::size_t(c)])))
          << "cols " << cols << " value " << c;
    }
    if (cols % 2 != 0) {
      EXPECT_EQ(got.back(), 0U) << "the last pair's second half";
    }
  }
}

TEST(SimdKernels, MaxOfPropagatesNaNAndKeepsInfinities) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    EXPECT_EQ(k.max_of(nullptr, 0), -kInf);
    for (const Index n : {1, 7, 16, 17, 40}) {
      auto s = normal(static_cast<std::size_t>(n), 7);
      float expected = -kInf;
      for (const float x : s) expected = std::max(expected, x);
      EXPECT_EQ(k.max_of(s.data(), n), expected) << n;
      for (Index at = 0; at < n; ++at) {
        auto t = s;
        t.data()[at] = std::numeric_limits<float>::quiet_NaN();
        EXPECT_TRUE(std::isnan(k.max_of(t.data(), n))) << apex::to_string(isa) << " " << at;
        t.data()[at] = kInf;
        EXPECT_EQ(k.max_of(t.data(), n), kInf);
      }
      std::vector<float> hidden(static_cast<std::size_t>(n), -kInf);
      EXPECT_EQ(k.max_of(hidden.data(), n), -kInf);
    }
  }
}

/// Units in the last place between a float and the double it approximates.
double ulps(float got, double want) {
  const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
  return std::abs(got - want) / ulp;
}

TEST(SimdKernels, ExpSumIsWithinTwoUlpsAndMarksHiddenKeys) {
  if (levels().empty()) GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512 kernels";
  for (const KernelIsa isa : levels()) {
    const FloatKernels& k = *apex::detail::float_kernels(isa);
    // Every float step of 2^-10 over [-90, 0], against a maximum of 0.5.
    std::vector<float> s;
    for (float x = -90.0F; x <= 0.5F; x += 1.0F / 1024) s.push_back(x);
    std::vector<float> w = s;
    bool hidden = false;
    const float sum = k.exp_sum(w.data(), static_cast<Index>(w.size()), 0.5F, hidden);
    EXPECT_FALSE(hidden);
    double expected_sum = 0;
    double worst = 0;
    for (std::size_t j = 0; j < s.size(); ++j) {
      const double want = std::exp(double(s[j]) - 0.5);
      expected_sum += double(w[j]);
      if (double(s[j]) - 0.5 < -87.33654) {
        EXPECT_EQ(w[j], 0.0F) << s[j];
        EXPECT_FALSE(std::signbit(w[j]));
      } else {
        worst = std::max(worst, ulps(w[j], want));
      }
    }
    EXPECT_LE(worst, 2.0) << apex::to_string(isa);
    EXPECT_NEAR(sum, expected_sum, expected_sum * double(s.size()) * kEps);

    // -inf gives -0.0 and sets hidden; the sign of every other weight is clear.
    for (const Index n : {1, 9, 16, 33}) {
      std::vector<float> t(static_cast<std::size_t>(n), -1.0F);
      t[static_cast<std::size_t>(n - 1)] = -kInf;
      bool h = false;
      const float total = k.exp_sum(t.data(), n, 0.0F, h);
      EXPECT_TRUE(h) << n;
      EXPECT_EQ(t[static_cast<std::size_t>(n - 1)], 0.0F);
      EXPECT_TRUE(std::signbit(t[static_cast<std::size_t>(n - 1)]));
      for (Index j = 0; j + 1 < n; ++j) EXPECT_FALSE(std::signbit(t[static_cast<std::size_t>(j)]));
      EXPECT_NEAR(total, double(n - 1) * std::exp(-1.0), 1e-5 * double(n));
    }
    // A maximum of +inf: the +inf score's weight is NaN (inf − inf), a finite one's +0, as with
    // Eigen's exp, and the sum is NaN.
    std::vector<float> inf_row = {1.0F, kInf};
    bool h = false;
    EXPECT_TRUE(std::isnan(k.exp_sum(inf_row.data(), 2, kInf, h)));
    EXPECT_EQ(inf_row[0], 0.0F);
    EXPECT_FALSE(std::signbit(inf_row[0]));
    EXPECT_TRUE(std::isnan(inf_row[1]));
  }
}

}  // namespace
}  // namespace simd_kernels_test
