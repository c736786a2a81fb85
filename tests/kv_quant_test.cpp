// SPDX-License-Identifier: MIT
// The quantized K/V formats (kv_quant.hpp, fp8.hpp):
//   - fp8: every one of the 256 codes of e4m3 and e5m2 decodes to the value of its bit fields,
//     every finite code encodes back to itself, every tie between adjacent codes rounds to the
//     even one, values past the largest finite one (and ±inf) saturate, NaN stays NaN;
//   - q8_0 and q4_0: the bytes of ggml's reference quantizers (written out plainly in
//     reference/quantize.hpp) on random rows and on edge rows, and the values they decode to;
//   - apex's rule for non-finite input: the block's scale is NaN, its values read back NaN,
//     other blocks unchanged;
//   - attention over quantized K and V is attention over the values they decode to: bit for bit
//     the float kernel on those values, and within the float tolerance of the double loops.
#include <apex/cached_attention.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mla_absorbed.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "format_names.hpp"
#include "reference/quantize.hpp"
#include "tolerances.hpp"

namespace kv_quant_test {
namespace {

using apex::Fp8Kind;
using apex::Index;

template <Fp8Kind K>
constexpr int kExponentBits = K == Fp8Kind::kE4m3 ? 4 : 5;

template <class T>
class Fp8 : public ::testing::Test {};
template <Fp8Kind K>
struct Kind {
  static constexpr Fp8Kind kKind = K;
};
using Fp8Kinds = ::testing::Types<Kind<Fp8Kind::kE4m3>, Kind<Fp8Kind::kE5m2>>;
TYPED_TEST_SUITE(Fp8, Fp8Kinds, apex::testing::Fp8KindName);

TYPED_TEST(Fp8, EveryCodeDecodesToItsFieldsAndFiniteCodesEncodeBack) {
  constexpr Fp8Kind K = TypeParam::kKind;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const double expected = apex::reference::fp8_code_value(code, kExponentBits<K>);
    const float value = apex::fp8_decode<K>(code);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(value)) << c;
      EXPECT_EQ(apex::fp8_encode<K>(value) & 0x7f, 0x7f) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(value), expected) << c;
    if (std::isfinite(expected)) {
      EXPECT_EQ(apex::fp8_encode<K>(value), code) << c;
      EXPECT_EQ(std::signbit(value), (c & 0x80) != 0) << c;
    }
  }
}

TYPED_TEST(Fp8, TiesRoundToEvenAndNeighboursRoundToTheNearest) {
  constexpr Fp8Kind K = TypeParam::kKind;
  const std::uint8_t largest = K == Fp8Kind::kE4m3 ? 0x7e : 0x7b;
  for (int c = 0; c < largest; ++c) {
    for (const float sign : {1.0f, -1.0f}) {
      const float a = sign * apex::fp8_decode<K>(static_cast<std::uint8_t>(c));
      const float b = sign * apex::fp8_decode<K>(static_cast<std::uint8_t>(c + 1));
      const float tie = (a + b) / 2;  // exact: fp8 values have few bits
      const std::uint8_t s = sign < 0 ? 0x80 : 0x00;
      const auto even = static_cast<std::uint8_t>(s | (c % 2 == 0 ? c : c + 1));
      EXPECT_EQ(apex::fp8_encode<K>(tie), even) << c;
      EXPECT_EQ(apex::fp8_encode<K>(std::nextafter(tie, a)), static_cast<std::uint8_t>(s | c)) << c;
      EXPECT_EQ(apex::fp8_encode<K>(std::nextafter(tie, b)), static_cast<std::uint8_t>(s | (c + 1)))
          << c;
    }
  }
}

TYPED_TEST(Fp8, EncodingMatchesTheNearestCodeAndSaturates) {
  constexpr Fp8Kind K = TypeParam::kKind;
  constexpr int E = kExponentBits<K>;
  const float big = apex::fp8_decode<K>(K == Fp8Kind::kE4m3 ? 0x7e : 0x7b);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> exponent(-24.0f, 20.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i % 2 ? -1.0f : 1.0f) * std::exp2(exponent(gen));
    EXPECT_EQ(apex::fp8_encode<K>(x), apex::reference::fp8_nearest(x, E)) << x;
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(apex::fp8_decode<K>(apex::fp8_encode<K>(inf)), big);
  EXPECT_EQ(apex::fp8_decode<K>(apex::fp8_encode<K>(-inf)), -big);
  EXPECT_EQ(apex::fp8_decode<K>(apex::fp8_encode<K>(3.0f * big)), big);
  EXPECT_EQ(apex::fp8_decode<K>(apex::fp8_encode<K>(std::numeric_limits<float>::max())), big);
  EXPECT_TRUE(std::isnan(apex::fp8_decode<K>(apex::fp8_encode<K>(std::nanf("")))));
  EXPECT_EQ(apex::fp8_encode<K>(-0.0f), 0x80);
  EXPECT_EQ(apex::fp8_encode<K>(std::numeric_limits<float>::denorm_min()), 0x00);
}

// ---------------------------------------------------------------------------------------------
// q8_0 and q4_0 against ggml's reference quantizers
// ---------------------------------------------------------------------------------------------

template <class Block, std::size_t N>
std::array<std::uint8_t, N> bytes_of(const Block& b) {
  static_assert(sizeof(Block) == N);
  std::array<std::uint8_t, N> out{};
  std::memcpy(out.data(), &b, N);
  return out;
}

/// Edge rows of 32 finite values: zeros, one huge value, values at and beside rounding ties,
/// scales past half's range either way, float subnormals.
std::vector<std::array<float, 32>> edge_rows() {
  std::vector<std::array<float, 32>> rows;
  std::array<float, 32> r{};
  rows.push_back(r);  // all zeros
  r.fill(-0.0f);
  rows.push_back(r);
  for (int j = 0; j < 32; ++j) r[static_cast<std::size_t>(j)] = static_cast<float>(j) - 15.5f;
  r[31] = 127.0f;  // d = 1: every other value is a tie of round()
  rows.push_back(r);
  for (int j = 0; j < 32; ++j) r[static_cast<std::size_t>(j)] = static_cast<float>(j % 16) - 7.5f;
  r[0] = -8.0f;  // q4_0's d = 1: every value x + 8.5 is a whole number or half of one
  rows.push_back(r);
  for (int j = 0; j < 32; ++j) {
    r[static_cast<std::size_t>(j)] = std::nextafter(static_cast<float>(j % 16) - 7.5f, 0.0f);
  }
  r[5] = 8.0f;
  rows.push_back(r);
  r.fill(1e-3f);
  r[9] = 3e7f;  // one huge value: q8_0's d overflows half
  rows.push_back(r);
  r.fill(0.25f);
  r[3] = -6e5f;  // q4_0's d overflows half, q8_0's does not
  rows.push_back(r);
  for (int j = 0; j < 32; ++j) r[static_cast<std::size_t>(j)] = 1e-7f * static_cast<float>(j - 9);
  rows.push_back(r);  // d below half's normal range
  for (int j = 0; j < 32; ++j) r[static_cast<std::size_t>(j)] = 3e-38f * static_cast<float>(j - 9);
  rows.push_back(r);  // 1/d overflows float
  for (int j = 0; j < 32; ++j) {
    r[static_cast<std::size_t>(j)] =
        std::numeric_limits<float>::denorm_min() * static_cast<float>(1000 * j - 7000);
  }
  rows.push_back(r);  // float subnormals
  r.fill(5.0f);
  rows.push_back(r);  // equal values
  return rows;
}

std::vector<std::array<float, 32>> random_rows(int count) {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-8.0f, 8.0f);
  std::vector<std::array<float, 32>> rows(static_cast<std::size_t>(count));
  for (auto& r : rows) {
    const float s = std::exp2(scale(gen));
    for (float& v : r) v = s * normal(gen);
  }
  return rows;
}

TEST(KvQuant, Q8_0IsGgmlsReferenceByteForByte) {
  auto rows = random_rows(2000);
  for (const auto& r : edge_rows()) rows.push_back(r);
  for (const auto& r : rows) {
    const apex::BlockQ8_0 block = apex::quantize_q8_0(r.data());
    ASSERT_EQ((bytes_of<apex::BlockQ8_0, 34>(block)), apex::reference::q8_0_bytes(r.data()));
    float values[32];
    apex::dequantize(block, values);
    const float d = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(block.d));
    for (int j = 0; j < 32; ++j) {
      const float expected = static_cast<float>(block.q[j]) * d;
      ASSERT_TRUE(values[j] == expected || (std::isnan(values[j]) && std::isnan(expected)));
    }
  }
}

TEST(KvQuant, Q4_0IsGgmlsReferenceByteForByte) {
  auto rows = random_rows(2000);
  for (const auto& r : edge_rows()) rows.push_back(r);
  for (const auto& r : rows) {
    const apex::BlockQ4_0 block = apex::quantize_q4_0(r.data());
    ASSERT_EQ((bytes_of<apex::BlockQ4_0, 18>(block)), apex::reference::q4_0_bytes(r.data()));
    float values[32];
    apex::dequantize(block, values);
    const float d = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(block.d));
    for (int j = 0; j < 16; ++j) {
      const float low = static_cast<float>((block.q[j] & 0x0F) - 8) * d;
      const float high = static_cast<float>((block.q[j] >> 4) - 8) * d;
      ASSERT_TRUE(values[j] == low || (std::isnan(values[j]) && std::isnan(low)));
      ASSERT_TRUE(values[j + 16] == high || (std::isnan(values[j + 16]) && std::isnan(high)));
    }
  }
}

TEST(KvQuant, QuantizedValuesAreWithinHalfAStep) {
  // q8_0: |x − q·d| ≤ d/2 (plus d's own rounding to half); q4_0: ≤ |d|/2 likewise, with the
  // one-sided clamp at 15. Both relative to the block's largest magnitude.
  for (const auto& r : random_rows(500)) {
    float amax = 0.0f;
    for (float v : r) amax = std::max(amax, std::fabs(v));
    float q8[32], q4[32];
    apex::dequantize(apex::quantize_q8_0(r.data()), q8);
    apex::dequantize(apex::quantize_q4_0(r.data()), q4);
    for (int j = 0; j < 32; ++j) {
      EXPECT_LE(std::fabs(q8[j] - r[static_cast<std::size_t>(j)]), amax * (0.5f / 127 + 1e-3f));
      EXPECT_LE(std::fabs(q4[j] - r[static_cast<std::size_t>(j)]), amax * (1.0f / 8 + 1e-3f));
    }
  }
}

TEST(KvQuant, Fp8BlocksScaleByTheLargestMagnitude) {
  std::vector<float> x(128);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : x) v = normal(gen);
  x[17] = -40.0f;
  const auto e4 = apex::quantize_fp8<Fp8Kind::kE4m3, 128>(x.data());
  const auto e5 = apex::quantize_fp8<Fp8Kind::kE5m2, 128>(x.data());
  EXPECT_EQ(e4.scale, 40.0f / 448.0f);
  EXPECT_EQ(e5.scale, 40.0f / 57344.0f);
  float v4[128], v5[128];
  apex::dequantize(e4, v4);
  apex::dequantize(e5, v5);
  EXPECT_EQ(v4[17], -448.0f * e4.scale);
  for (std::size_t j = 0; j < 128; ++j) {
    EXPECT_EQ(e4.code[j], apex::fp8_encode<Fp8Kind::kE4m3>(x[j] / e4.scale));
    EXPECT_EQ(v4[j], apex::fp8_decode<Fp8Kind::kE4m3>(e4.code[j]) * e4.scale);
    // 3 mantissa bits: relative error ≤ 2^-4 of the value, or of the smallest normal.
    EXPECT_LE(std::fabs(v4[j] - x[j]),
              std::max(std::fabs(x[j]), 40.0f / 448 * 0x1p-6f) / 16 * 1.0001f);
    EXPECT_LE(std::fabs(v5[j] - x[j]),
              std::max(std::fabs(x[j]), 40.0f / 57344 * 0x1p-14f) / 8 * 1.0001f);
  }
  std::vector<float> zeros(128, 0.0f);
  zeros[3] = -0.0f;
  const auto z = apex::quantize_fp8<Fp8Kind::kE4m3, 128>(zeros.data());
  EXPECT_EQ(z.scale, 0.0f);
  EXPECT_EQ(z.code[3], 0x80);
  EXPECT_EQ(z.code[4], 0x00);
}

TEST(KvQuant, ANonFiniteValuePoisonsItsBlockOnly) {
  for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    std::vector<float> row(64, 0.5f);
    row[40] = bad;  // in the second block of 32
    apex::BlockQ8_0 q8[2];
    apex::BlockQ4_0 q4[2];
    apex::KvFormat<apex::BlockQ8_0>::store_row(row.data(), 64, q8);
    apex::KvFormat<apex::BlockQ4_0>::store_row(row.data(), 64, q4);
    float v8[64], v4[64];
    apex::KvFormat<apex::BlockQ8_0>::widen(q8, v8, 2);
    apex::KvFormat<apex::BlockQ4_0>::widen(q4, v4, 2);
    for (int j = 0; j < 64; ++j) {
      EXPECT_EQ(std::isnan(v8[j]), j >= 32) << j;
      EXPECT_EQ(std::isnan(v4[j]), j >= 32) << j;
    }
    float clean[32];  // the first block, as quantized on its own
    apex::dequantize(apex::quantize_q8_0(row.data()), clean);
    EXPECT_EQ(v8[0], clean[0]);
    std::vector<float> wide(256, 1.0f);
    wide[200] = bad;
    apex::BlockFp8E5m2<128> f8[2];
    apex::KvFormat<apex::BlockFp8E5m2<128>>::store_row(wide.data(), 256, f8);
    float v[256];
    apex::KvFormat<apex::BlockFp8E5m2<128>>::widen(f8, v, 2);
    EXPECT_EQ(v[127], 1.0f);
    EXPECT_TRUE(std::isnan(v[128]) && std::isnan(v[255]));
  }
}

TEST(KvQuant, DoubleValuesAreRoundedToFloatFirst) {
  std::vector<double> x(32);
  std::vector<float> xf(32);
  for (int j = 0; j < 32; ++j) {
    x[static_cast<std::size_t>(j)] = 0.1 * j - 1.0 + 1e-12;
    xf[static_cast<std::size_t>(j)] = static_cast<float>(x[static_cast<std::size_t>(j)]);
  }
  apex::BlockQ8_0 from_double{}, from_float{};
  apex::KvFormat<apex::BlockQ8_0>::store_row(x.data(), 32, &from_double);
  apex::KvFormat<apex::BlockQ8_0>::store_row(xf.data(), 32, &from_float);
  EXPECT_EQ((bytes_of<apex::BlockQ8_0, 34>(from_double)),
            (bytes_of<apex::BlockQ8_0, 34>(from_float)));
}

TEST(KvQuant, RowWidthsMustBeWholeBlocks) {
  EXPECT_THROW(apex::detail::check_row_values<apex::BlockQ8_0>(48, "test", "d_h"),
               std::invalid_argument);
  EXPECT_NO_THROW(apex::detail::check_row_values<apex::BlockQ8_0>(64, "test", "d_h"));
  try {
    apex::detail::check_row_values<apex::BlockFp8E4m3<128>>(192, "kv_cache", "head_dim");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim (192) must be a multiple of the 128"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Attention over quantized K and V
// ---------------------------------------------------------------------------------------------

/// A contiguous [B, H, S, d] tensor of random values, its rows stored in format F, and the
/// values those rows decode to, as float and double tensors of the same shape.
template <class F>
struct QuantizedHeads {
  apex::HeadsShape shape;     // in values
  std::vector<float> values;  // as drawn, before quantizing
  std::vector<F> blocks;
  std::vector<float> decoded;
  std::vector<double> decoded_double;

  QuantizedHeads(const apex::HeadsShape& s, std::mt19937& gen) : shape(s) {
    using Format = apex::KvFormat<F>;
    const Index rows = s.batch * s.heads * s.seq;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    values.resize(static_cast<std::size_t>(rows * s.dim));
    for (float& v : values) v = normal(gen);
    const Index per_row = Format::elements(s.dim);
    blocks.resize(static_cast<std::size_t>(rows * per_row));
    decoded.resize(values.size());
    for (Index r = 0; r < rows; ++r) {
      Format::store_row(values.data() + r * s.dim, s.dim, blocks.data() + r * per_row);
      Format::widen(blocks.data() + r * per_row, decoded.data() + r * s.dim, per_row);
    }
    decoded_double.assign(decoded.begin(), decoded.end());
  }
  /// Stores row r (of the [B·H·S] rows) with a NaN among its values: a block of NaN values.
  void poison(Index r) {
    using Format = apex::KvFormat<F>;
    const Index per_row = Format::elements(shape.dim);
    values[static_cast<std::size_t>(r * shape.dim)] = std::nanf("");
    Format::store_row(values.data() + r * shape.dim, shape.dim, blocks.data() + r * per_row);
    Format::widen(blocks.data() + r * per_row, decoded.data() + r * shape.dim, per_row);
    decoded_double.assign(decoded.begin(), decoded.end());
  }
  apex::HeadsView<const F> view() const {
    return apex::HeadsView<const F>::contiguous(
        blocks.data(),
        {shape.batch, shape.heads, shape.seq, apex::KvFormat<F>::elements(shape.dim)});
  }
  apex::HeadsView<const float> float_view() const {
    return apex::HeadsView<const float>::contiguous(decoded.data(), shape);
  }
  apex::HeadsView<const double> double_view() const {
    return apex::HeadsView<const double>::contiguous(decoded_double.data(), shape);
  }
};

template <class F>
class QuantizedAttention : public ::testing::Test {};
using BlockFormats = ::testing::Types<apex::BlockQ8_0, apex::BlockQ4_0, apex::BlockFp8E4m3<64>,
                                      apex::BlockFp8E5m2<128>>;
TYPED_TEST_SUITE(QuantizedAttention, BlockFormats, apex::testing::FormatName);

struct Case {
  Index batch, q_heads, kv_heads, s_q, s_k, d_qk, d_v;
  bool causal;
  double softcap;
};

TYPED_TEST(QuantizedAttention, IsAttentionOverTheDecodedValues) {
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  const Index wide = kBlock < 128 ? 2 * kBlock : kBlock;  // d_qk; d_v is kBlock
  const Case cases[] = {
      {1, 4, 4, 1, 300, wide, kBlock, false, 0.0},      // one query: streaming, split keys
      {2, 8, 2, 1, 1000, wide, kBlock, true, 0.0},      // GQA groups of 4, decoding
      {1, 8, 1, 1, 300, wide, kBlock, false, 0.0},      // a group of 8: eight rows a tile
      {1, 4, 1, 2, 150, wide, kBlock, true, 0.0},       // 2 queries × 4 heads: eight rows
      {1, 16, 1, 7, 77, wide, kBlock, true, 30.0},      // 16 heads on one K/V head, soft-cap
      {1, 4, 4, 64, 64, wide, wide, true, 0.0},         // the GEMM path, causal
      {1, 2, 1, 200, 333, kBlock, kBlock, false, 0.0},  // more keys than a block, not a multiple
  };
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& c : cases) {
    const QuantizedHeads<F> k(apex::HeadsShape{c.batch, c.kv_heads, c.s_k, c.d_qk}, gen);
    const QuantizedHeads<F> v(apex::HeadsShape{c.batch, c.kv_heads, c.s_k, c.d_v}, gen);
    const apex::HeadsShape q_shape{c.batch, c.q_heads, c.s_q, c.d_qk};
    const apex::HeadsShape o_shape{c.batch, c.q_heads, c.s_q, c.d_v};
    std::vector<float> q(static_cast<std::size_t>(c.batch * c.q_heads * c.s_q * c.d_qk));
    for (float& x : q) x = normal(gen);
    const std::vector<double> q_double(q.begin(), q.end());
    const auto qv = apex::HeadsView<const float>::contiguous(q.data(), q_shape);
    apex::AttentionMask<float> mask;
    if (c.causal) mask.positions = apex::causal_mask();
    apex::SdpaParams params;
    params.softcap = c.softcap;
    const std::size_t outputs = static_cast<std::size_t>(c.batch * c.q_heads * c.s_q * c.d_v);
    std::vector<float> out(outputs), expected(outputs);
    // Bit for bit at every kernel level: the streaming kernels of AVX2 and AVX-512 read the
    // blocks in registers, the others widen them first, and both form the same values.
    const apex::KernelIsa before = apex::kernel_isa();
    for (const apex::KernelIsa isa :
         {apex::KernelIsa::kPortable, apex::KernelIsa::kAvx2, apex::KernelIsa::kAvx512}) {
      if (!apex::cpu_supports(isa)) continue;
      apex::set_kernel_isa(isa);
      apex::sdpa(qv, k.view(), v.view(), mask, params,
                 apex::HeadsView<float>::contiguous(out.data(), o_shape));
      apex::sdpa(qv, k.float_view(), v.float_view(), mask, params,
                 apex::HeadsView<float>::contiguous(expected.data(), o_shape));
      apex::set_kernel_isa(before);
      ASSERT_EQ(out, expected) << apex::to_string(isa) << ", S_q " << c.s_q << ", S_k " << c.s_k;
    }

    std::vector<double> ref(outputs);
    apex::AttentionMask<double> mask_double;
    mask_double.positions = mask.positions;
    apex::reference::sdpa<double>(
        apex::HeadsView<const double>::contiguous(q_double.data(), q_shape), k.double_view(),
        v.double_view(), mask_double, params,
        apex::HeadsView<double>::contiguous(ref.data(), o_shape));
    double err = 0.0, scale = 0.0;
    for (std::size_t i = 0; i < outputs; ++i) {
      err = std::max(err, std::fabs(static_cast<double>(out[i]) - ref[i]));
      scale = std::max(scale, std::fabs(ref[i]));
    }
    EXPECT_LE(err, apex::testing::Tolerances<float>::kAttention * scale)
        << "S_q " << c.s_q << ", S_k " << c.s_k;
  }
}

TYPED_TEST(QuantizedAttention, KeysMustHaveTheQueryWidth) {
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  std::mt19937 gen(9);
  const QuantizedHeads<F> k(apex::HeadsShape{1, 1, 5, kBlock}, gen);
  std::vector<float> q(static_cast<std::size_t>(2 * kBlock), 1.0f), out(kBlock, -7.0f);
  const auto qv = apex::HeadsView<const float>::contiguous(q.data(), {1, 1, 1, 2 * kBlock});
  EXPECT_THROW(apex::sdpa(qv, k.view(), k.view(), apex::AttentionMask<float>{}, apex::SdpaParams{},
                          apex::HeadsView<float>::contiguous(out.data(), {1, 1, 1, kBlock})),
               std::invalid_argument);
  EXPECT_EQ(out[0], -7.0f);  // nothing written
}

// ---------------------------------------------------------------------------------------------
// Caches of quantized rows
// ---------------------------------------------------------------------------------------------

/// Random [B, H, n, d] chunk of floats (contiguous).
std::vector<float> random_chunk(const apex::HeadsShape& s, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(s.batch * s.heads * s.seq * s.dim));
  for (float& v : x) v = normal(gen);
  return x;
}

/// The values of every row of a [B, H, n, ·] view of blocks, decoded: [B, H, n, d] floats.
template <class F>
std::vector<float> decoded(const apex::HeadsView<const F>& view) {
  const Index d = apex::row_values(view);
  std::vector<float> out;
  std::vector<float> row(static_cast<std::size_t>(d));
  for (Index b = 0; b < view.batch(); ++b) {
    for (Index h = 0; h < view.heads(); ++h) {
      for (Index s = 0; s < view.seq(); ++s) {
        apex::KvFormat<F>::widen(apex::detail::row_data(view, b, h, s), row.data(), view.dim());
        out.insert(out.end(), row.begin(), row.end());
      }
    }
  }
  return out;
}

/// The chunk's rows quantized one by one and decoded (what a cache must hold for them).
template <class F>
std::vector<float> round_trip(const std::vector<float>& x, Index d) {
  std::vector<float> out(x.size());
  std::vector<F> blocks(static_cast<std::size_t>(apex::KvFormat<F>::elements(d)));
  for (std::size_t r = 0; r < x.size() / static_cast<std::size_t>(d); ++r) {
    apex::KvFormat<F>::store_row(x.data() + r * static_cast<std::size_t>(d), d, blocks.data());
    apex::KvFormat<F>::widen(blocks.data(), out.data() + r * static_cast<std::size_t>(d),
                             apex::KvFormat<F>::elements(d));
  }
  return out;
}

TYPED_TEST(QuantizedAttention, KvCacheStoresQuantizedRowsAndAttendsOverThem) {
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  const Index d = 2 * kBlock;
  apex::KvCache<float, F> cache({2, 2, d, 40});
  EXPECT_EQ(cache.head_dim(), d);
  EXPECT_EQ(cache.bytes(), 2 * 2 * 2 * 40 * 2 * static_cast<std::int64_t>(sizeof(F)));
  std::mt19937 gen(21);
  std::vector<float> all_k, all_v;  // the decoded history, [B, H, t, d] per append
  Index position = 0;
  for (const Index n : {Index{13}, Index{1}, Index{20}}) {
    const apex::HeadsShape s{2, 2, n, d};
    const std::vector<float> k = random_chunk(s, gen), v = random_chunk(s, gen);
    cache.append(apex::HeadsView<const float>::contiguous(k.data(), s),
                 apex::HeadsView<const float>::contiguous(v.data(), s), position);
    position += n;
    // The cache holds each row as its format stores it alone.
    const std::vector<float> kd = decoded(cache.keys()), expected = round_trip<F>(k, d);
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 2; ++h) {
        for (Index t = 0; t < n; ++t) {
          for (Index j = 0; j < d; ++j) {
            const Index at = ((b * 2 + h) * position + position - n + t) * d + j;
            ASSERT_EQ(kd[static_cast<std::size_t>(at)],
                      expected[static_cast<std::size_t>(((b * 2 + h) * n + t) * d + j)]);
          }
        }
      }
    }
  }
  // Attention over the cache is attention over its decoded rows.
  const std::vector<float> kd = decoded(cache.keys()), vd = decoded(cache.values());
  const apex::HeadsShape kv{2, 2, cache.size(), d}, q_shape{2, 4, 1, d}, o_shape{2, 4, 1, d};
  const std::vector<float> q = random_chunk(q_shape, gen);
  std::vector<float> out(static_cast<std::size_t>(2 * 4 * d)), expected(out.size());
  const auto qv = apex::HeadsView<const float>::contiguous(q.data(), q_shape);
  apex::sdpa(qv, cache.keys(), cache.values(), apex::AttentionMask<float>{}, apex::SdpaParams{},
             apex::HeadsView<float>::contiguous(out.data(), o_shape));
  apex::sdpa(qv, apex::HeadsView<const float>::contiguous(kd.data(), kv),
             apex::HeadsView<const float>::contiguous(vd.data(), kv), apex::AttentionMask<float>{},
             apex::SdpaParams{}, apex::HeadsView<float>::contiguous(expected.data(), o_shape));
  EXPECT_EQ(out, expected);
  // Growing keeps the blocks as they are.
  cache.reserve(100);
  EXPECT_EQ(decoded(cache.keys()), kd);
  EXPECT_EQ(decoded(cache.values()), vd);
}

TYPED_TEST(QuantizedAttention, CachesRejectBadShapesAndFullAppendsUnchanged) {
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  try {
    apex::KvCache<float, F> bad({1, 1, kBlock + 16, 8});
    FAIL() << "a head_dim that is not whole blocks must throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[kv_cache] head_dim"), std::string::npos) << e.what();
  }
  EXPECT_THROW((apex::SlidingWindowCache<float, F>({1, 1, kBlock / 2, 4})), std::invalid_argument);
  apex::KvCache<double, F> cache({1, 1, kBlock, 4});
  std::mt19937 gen(2);
  const apex::HeadsShape s{1, 1, 3, kBlock};
  const std::vector<float> xf = random_chunk(s, gen);
  const std::vector<double> x(xf.begin(), xf.end());
  const auto view = apex::HeadsView<const double>::contiguous(x.data(), s);
  cache.append(view, view, 0);
  const std::vector<float> before = decoded(cache.keys());
  EXPECT_THROW(cache.append(view, view, 3), std::invalid_argument);  // 6 > 4
  EXPECT_EQ(cache.size(), 3);
  EXPECT_EQ(decoded(cache.keys()), before);
}

TYPED_TEST(QuantizedAttention, SlidingWindowCacheKeepsTheLastRows) {
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  apex::SlidingWindowCache<float, F> ring({1, 2, kBlock, 5});
  std::mt19937 gen(4);
  const apex::HeadsShape s{1, 2, 7, kBlock};
  const std::vector<float> k = random_chunk(s, gen);
  const auto view = apex::HeadsView<const float>::contiguous(k.data(), s);
  ring.append(view, view, 0);
  const std::vector<float> expected = round_trip<F>(k, kBlock);
  const auto segments = ring.segments();
  Index position = ring.first_position();
  for (const auto& segment : segments) {
    const std::vector<float> got = decoded(segment.keys);
    const Index n = segment.keys.seq();
    for (Index h = 0; h < 2; ++h) {
      for (Index t = 0; t < n; ++t) {
        for (Index j = 0; j < kBlock; ++j) {
          ASSERT_EQ(got[static_cast<std::size_t>((h * n + t) * kBlock + j)],
                    expected[static_cast<std::size_t>((h * 7 + position + t) * kBlock + j)]);
        }
      }
    }
    position += n;
  }
  EXPECT_EQ(position, 7);
}

TYPED_TEST(QuantizedAttention, WindowCacheAttendsOverWhatItKeeps) {
  // Decoding chunk by chunk over a quantized ring equals decoding over a float ring that holds
  // the decoded values, bit for bit: the chunk is quantized as the ring will keep it.
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  constexpr Index kWindow = 6;
  apex::SlidingWindowCache<float, F> ring({1, 2, kBlock, kWindow});
  apex::SlidingWindowCache<float> plain({1, 2, kBlock, kWindow});
  apex::PositionMask rule = apex::causal_mask();
  rule.window = kWindow;
  std::mt19937 gen(8);
  Index position = 0;
  for (const Index n : {Index{4}, Index{1}, Index{5}, Index{2}}) {
    const apex::HeadsShape kv{1, 2, n, kBlock}, q_shape{1, 4, n, kBlock};
    const std::vector<float> q = random_chunk(q_shape, gen);
    const std::vector<float> k = random_chunk(kv, gen), v = random_chunk(kv, gen);
    const std::vector<float> kd = round_trip<F>(k, kBlock), vd = round_trip<F>(v, kBlock);
    const auto view = [&](const std::vector<float>& x, const apex::HeadsShape& s) {
      return apex::HeadsView<const float>::contiguous(x.data(), s);
    };
    std::vector<float> out(q.size()), expected(q.size());
    apex::sdpa_with_window_cache<float, F>(view(q, q_shape), view(k, kv), view(v, kv), rule, {},
                                           ring,
                                           apex::HeadsView<float>::contiguous(out.data(), q_shape));
    apex::sdpa_with_window_cache<float, float>(
        view(q, q_shape), view(kd, kv), view(vd, kv), rule, {}, plain,
        apex::HeadsView<float>::contiguous(expected.data(), q_shape));
    ASSERT_EQ(out, expected) << "at position " << position;
    ring.append(view(k, kv), view(v, kv), position);
    plain.append(view(kd, kv), view(vd, kv), position);
    position += n;
  }
}

template <class F>
class QuantizedLatent : public ::testing::Test {};
using LatentFormats = ::testing::Types<apex::BlockQ8_0, apex::BlockQ4_0, apex::BlockFp8E4m3<64>>;
TYPED_TEST_SUITE(QuantizedLatent, LatentFormats, apex::testing::FormatName);

TYPED_TEST(QuantizedLatent, LatentCacheStoresEachPartAndAbsorbedAttentionReadsIt) {
  // c_kv (d_kv = 128) and K_rope (H_kr = 2 heads of d_r = 64) quantized part by part, so that
  // no block straddles them; attention with K = whole rows and V = c_kv, as absorbed MLA
  // attends, is the float kernel's over the decoded rows.
  using F = TypeParam;
  constexpr Index kLatent = 128, kRope = 64, kRopeHeads = 2, kWidth = kLatent + kRopeHeads * kRope;
  apex::LatentCache<float, F> cache({2, kLatent, kRopeHeads, kRope, 16});
  EXPECT_EQ(cache.bytes(),
            2 * 16 * apex::KvFormat<F>::bytes(kWidth / apex::KvFormat<F>::kValuesPerElement));
  std::mt19937 gen(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  apex::RowMatrix<float> c(2 * 3, kLatent), r(2 * 3, kRopeHeads * kRope), whole(2 * 2, kWidth);
  for (apex::RowMatrix<float>* m : {&c, &r, &whole}) {
    *m = m->unaryExpr([&](float) { return normal(gen); });
  }
  cache.append(c, r, 0);
  cache.append(whole, 3);
  ASSERT_EQ(cache.size(), 5);
  // What the cache holds: each part of each row quantized alone.
  const std::vector<float> rows = decoded(cache.rows());
  for (Index b = 0; b < 2; ++b) {
    for (Index t = 0; t < 5; ++t) {
      std::vector<float> latent(kLatent), rope(kRopeHeads * kRope);
      if (t < 3) {
        latent.assign(c.row(b * 3 + t).data(), c.row(b * 3 + t).data() + kLatent);
        rope.assign(r.row(b * 3 + t).data(), r.row(b * 3 + t).data() + kRopeHeads * kRope);
      } else {
        const float* w = whole.row(b * 2 + t - 3).data();
        latent.assign(w, w + kLatent);
        rope.assign(w + kLatent, w + kWidth);
      }
      const std::vector<float> ld = round_trip<F>(latent, kLatent), rd = round_trip<F>(rope, kRope);
      for (Index j = 0; j < kWidth; ++j) {
        const float expected = j < kLatent ? ld[static_cast<std::size_t>(j)]
                                           : rd[static_cast<std::size_t>(j - kLatent)];
        ASSERT_EQ(rows[static_cast<std::size_t>((b * 5 + t) * kWidth + j)], expected);
      }
    }
  }
  EXPECT_EQ(decoded(cache.latent()).size(), static_cast<std::size_t>(2 * 5 * kLatent));
  EXPECT_EQ(decoded(cache.rope_keys()).size(),
            static_cast<std::size_t>(2 * kRopeHeads * 5 * kRope));
  // Absorbed attention: 4 query heads over K = rows, V = c_kv.
  const std::vector<float> latent_values = decoded(cache.latent());
  const apex::HeadsShape q_shape{2, 4, 2, kWidth}, o_shape{2, 4, 2, kLatent};
  const std::vector<float> q = random_chunk(q_shape, gen);
  std::vector<float> out(static_cast<std::size_t>(2 * 4 * 2 * kLatent)), expected(out.size());
  const auto qv = apex::HeadsView<const float>::contiguous(q.data(), q_shape);
  apex::sdpa(qv, cache.rows(), cache.latent(), apex::AttentionMask<float>{}, apex::SdpaParams{},
             apex::HeadsView<float>::contiguous(out.data(), o_shape));
  apex::sdpa(qv, apex::HeadsView<const float>::contiguous(rows.data(), {2, 1, 5, kWidth}),
             apex::HeadsView<const float>::contiguous(latent_values.data(), {2, 1, 5, kLatent}),
             apex::AttentionMask<float>{}, apex::SdpaParams{},
             apex::HeadsView<float>::contiguous(expected.data(), o_shape));
  EXPECT_EQ(out, expected);
  cache.reserve(40);
  EXPECT_EQ(decoded(cache.rows()), rows);
}

// FlashMLA's fp8 latent rows: one element a token, c_kv in e4m3 with a float scale per 128
// values and K_rope in bfloat16, laid out as DeepSeek's fp8 MLA cache is.
using FlashRow = apex::FlashMlaFp8Row<128, 64>;

/// A latent row of 192 values: c_kv's first 128 around 1, the rest of magnitude 1e3.
std::vector<float> latent_row(std::mt19937& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(FlashRow::kValues);
  for (std::size_t j = 0; j < x.size(); ++j) x[j] = normal(gen) * (j < 128 ? 1.0f : 1e3f);
  return x;
}

TEST(FlashMlaRow, IsFlashMlasLayoutWithEachPartInItsFormat) {
  using Wide = apex::FlashMlaFp8Row<>;
  EXPECT_EQ(sizeof(Wide), 656U);
  EXPECT_EQ(offsetof(Wide, code), 0U);
  EXPECT_EQ(offsetof(Wide, scale), 512U);
  EXPECT_EQ(offsetof(Wide, rope), 528U);
  std::mt19937 gen(51);
  const std::vector<float> x = latent_row(gen);
  const FlashRow row = apex::quantize_flashmla_row<128, 64>(x.data());
  const auto block = apex::quantize_fp8<Fp8Kind::kE4m3, 128>(x.data());
  EXPECT_EQ(row.scale[0], block.scale);
  EXPECT_EQ(std::memcmp(row.code, block.code, 128), 0);
  std::vector<float> values(FlashRow::kValues), c_kv(128);
  apex::dequantize(row, values.data());
  apex::dequantize(block, c_kv.data());
  for (Index j = 0; j < FlashRow::kValues; ++j) {
    const auto u = static_cast<std::size_t>(j);
    const float expected = j < 128 ? c_kv[u] : static_cast<float>(Eigen::bfloat16(x[u]));
    ASSERT_EQ(values[u], expected) << "value " << j;
  }
  // A non-finite c_kv value poisons its group of 128; K_rope keeps NaN and inf as bfloat16 does.
  std::vector<float> bad = x;
  bad[5] = std::numeric_limits<float>::infinity();
  bad[130] = std::nanf("");
  bad[131] = -std::numeric_limits<float>::infinity();
  apex::dequantize(apex::quantize_flashmla_row<128, 64>(bad.data()), values.data());
  for (Index j = 0; j < 128; ++j) ASSERT_TRUE(std::isnan(values[static_cast<std::size_t>(j)]));
  EXPECT_TRUE(std::isnan(values[130]));
  EXPECT_EQ(values[131], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(values[132], static_cast<float>(Eigen::bfloat16(x[132])));
}

TEST(FlashMlaRow, EveryKernelLevelWidensToTheScalarValues) {
  // Rows of random bytes (every code, every bfloat16 bit pattern) with finite, NaN and infinite
  // scales: KvFormat::widen at each level against the scalar dequantize, bit for bit.
  std::mt19937 gen(52);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<apex::FlashMlaFp8Row<256, 64>> rows(64);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    unsigned char raw[sizeof(rows[i])];
    for (auto& b : raw) b = static_cast<unsigned char>(byte(gen));
    std::memcpy(&rows[i], raw, sizeof raw);
    rows[i].scale[0] = std::ldexp(1.5f, static_cast<int>(i % 40) - 20);
    rows[i].scale[1] = i % 4 == 3 ? std::nanf("") : -0.75f;
  }
  constexpr std::size_t kValues = 320;
  for (const apex::KernelIsa isa :
       {apex::KernelIsa::kPortable, apex::KernelIsa::kAvx2, apex::KernelIsa::kAvx512}) {
    if (!apex::cpu_supports(isa)) continue;
    const apex::KernelIsa before = apex::kernel_isa();
    apex::set_kernel_isa(isa);
    std::vector<float> fast(rows.size() * kValues);
    apex::KvFormat<apex::FlashMlaFp8Row<256, 64>>::widen(rows.data(), fast.data(),
                                                         static_cast<Index>(rows.size()));
    apex::set_kernel_isa(before);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      float slow[kValues];
      apex::dequantize(rows[i], slow);
      for (std::size_t j = 0; j < kValues; ++j) {
        const float a = fast[i * kValues + j];
        ASSERT_TRUE(std::memcmp(&a, &slow[j], sizeof a) == 0 ||
                    (std::isnan(a) && std::isnan(slow[j])))
            << apex::to_string(isa) << " row " << i << " value " << j;
      }
    }
  }
}

TEST(FlashMlaRow, LatentCacheStoresWholeRowsAndAbsorbedAttentionReadsThem) {
  // d_kv = 128, K_rope H_kr = 2 heads of 32: each token one FlashMlaFp8Row<128, 64>, whatever
  // overload appended it; attention with K = V = rows (the K_rope columns of the output
  // dropped, as absorbed MLA does for this format) is the float kernel's over the decoded rows
  // with V = c_kv.
  constexpr Index kWidth = FlashRow::kValues;
  apex::LatentCache<float, FlashRow> cache({2, 128, 2, 32, 16});
  EXPECT_EQ(cache.bytes(), 2 * 16 * static_cast<std::int64_t>(sizeof(FlashRow)));
  std::mt19937 gen(53);
  apex::RowMatrix<float> whole(2 * 3, kWidth), more(2 * 2, kWidth);
  for (apex::RowMatrix<float>* m : {&whole, &more}) {
    for (Index r = 0; r < m->rows(); ++r) {
      const std::vector<float> x = latent_row(gen);
      m->row(r) = Eigen::Map<const apex::RowMatrix<float>>(x.data(), 1, kWidth);
    }
  }
  cache.append(whole.leftCols(128), whole.rightCols(64), 0);
  cache.append(more, 3);
  const std::vector<float> rows = decoded(cache.rows());
  for (Index b = 0; b < 2; ++b) {
    for (Index t = 0; t < 5; ++t) {
      const auto x = t < 3 ? whole.row(b * 3 + t) : more.row(b * 2 + t - 3);
      const FlashRow expected = apex::quantize_flashmla_row<128, 64>(x.data());
      ASSERT_EQ(
          std::memcmp(apex::detail::row_data(cache.rows(), b, 0, t), &expected, sizeof expected), 0)
          << "batch " << b << ", token " << t;
    }
  }
  const apex::HeadsShape q_shape{2, 4, 2, kWidth}, o_shape{2, 4, 2, 128};
  const std::vector<float> q = random_chunk(q_shape, gen);
  apex::RowMatrix<float> expected(2 * 2, 4 * 128);
  const auto rows_view = apex::HeadsView<const float>::contiguous(rows.data(), {2, 1, 5, kWidth});
  apex::sdpa(apex::HeadsView<const float>::contiguous(q.data(), q_shape), rows_view,
             apex::HeadsView<const float>(rows.data(), {2, 1, 5, 128}, {5 * kWidth, 0, kWidth}),
             apex::AttentionMask<float>{}, apex::SdpaParams{},
             apex::HeadsView<float>::token_major(expected.data(), o_shape));
  const apex::RowMatrix<float> out =
      apex::detail::attend_latent_rows(apex::HeadsView<const float>::contiguous(q.data(), q_shape),
                                       cache, apex::AttentionMask<float>{}, apex::SdpaParams{});
  EXPECT_EQ(out, expected);
  cache.reserve(40);
  EXPECT_EQ(decoded(cache.rows()), rows);
}

TEST(FlashMlaRow, LatentCacheWidthsMustBeTheRowsOwn) {
  for (const apex::LatentCacheShape& bad :
       {apex::LatentCacheShape{1, 256, 2, 32, 8}, apex::LatentCacheShape{1, 128, 1, 32, 8}}) {
    try {
      apex::LatentCache<float, FlashRow> cache(bad);
      FAIL() << "d_kv " << bad.latent_dim << ", H_kr " << bad.rope_heads;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("[latent_cache] latent_dim d_kv (" +
                                           std::to_string(bad.latent_dim) + ") and H_kr*d_r (" +
                                           std::to_string(bad.rope_heads * bad.rope_dim) +
                                           ") must be the row format's 128 and 64"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(QuantizedLatentShapes, PartsMustBeWholeBlocks) {
  try {
    apex::LatentCache<float, apex::BlockFp8E4m3<128>> bad({1, 512, 1, 64, 8});
    FAIL() << "d_r = 64 is not a whole block of 128";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[latent_cache] rope_dim d_r (64)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((apex::LatentCache<float, apex::BlockQ8_0>({1, 100, 1, 64, 8})),
               std::invalid_argument);
}

/// A block of random bytes (every code), with a finite random scale in 3 blocks of 4 and a
/// non-finite one (NaN, ±inf) in the fourth.
template <class F>
F random_block(std::mt19937& gen, int i) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-3.0f, 3.0f);
  unsigned char raw[sizeof(F)];
  for (auto& b : raw) b = static_cast<unsigned char>(byte(gen));
  F block;
  std::memcpy(&block, raw, sizeof(F));
  const float special[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  const float s = i % 4 == 3 ? special[(i / 4) % 3] : std::exp2(scale(gen) * 8.0f);
  if constexpr (std::is_same_v<F, apex::BlockQ8_0> || std::is_same_v<F, apex::BlockQ4_0>) {
    block.d = Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(s));
  } else {
    block.scale = s;
  }
  return block;
}

TYPED_TEST(QuantizedAttention, HiddenKeysWithNaNValuesTakeNoPart) {
  // Decoding one query over 300 keys, a dense mask hiding keys [150, 200), whose value rows are
  // NaN blocks, in key blocks that visible keys share (so the kernel reads them). The output is
  // finite and equals attention over float rows of the decoded values bit for bit, at every
  // kernel level (where the streaming kernels read blocks in place, the rows are widened for
  // the check).
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  std::mt19937 gen(17);
  const apex::HeadsShape kv_shape{1, 1, 300, kBlock}, q_shape{1, 4, 1, kBlock};
  const QuantizedHeads<F> k(kv_shape, gen);
  QuantizedHeads<F> v(kv_shape, gen);
  for (Index r = 150; r < 200; ++r) v.poison(r);
  std::vector<float> q(static_cast<std::size_t>(4 * kBlock));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(gen);
  const auto qv = apex::HeadsView<const float>::contiguous(q.data(), q_shape);
  std::array<bool, 300> allowed{};
  for (Index j = 0; j < 300; ++j) allowed[static_cast<std::size_t>(j)] = j < 150 || j >= 200;
  apex::AttentionMask<float> mask;
  mask.allowed = apex::HeadsView<const bool>::contiguous(allowed.data(), {1, 1, 1, 300});
  std::vector<float> out(q.size()), expected(q.size());
  const apex::KernelIsa before = apex::kernel_isa();
  for (const apex::KernelIsa isa :
       {apex::KernelIsa::kPortable, apex::KernelIsa::kAvx2, apex::KernelIsa::kAvx512}) {
    if (!apex::cpu_supports(isa)) continue;
    apex::set_kernel_isa(isa);
    apex::sdpa(qv, k.view(), v.view(), mask, {},
               apex::HeadsView<float>::contiguous(out.data(), q_shape));
    apex::sdpa(qv, k.float_view(), v.float_view(), mask, {},
               apex::HeadsView<float>::contiguous(expected.data(), q_shape));
    apex::set_kernel_isa(before);
    for (const float x : out) ASSERT_TRUE(std::isfinite(x)) << apex::to_string(isa);
    ASSERT_EQ(out, expected) << apex::to_string(isa);
  }
}

TYPED_TEST(QuantizedAttention, EveryKernelLevelWidensToTheScalarValues) {
  // KvFormat::widen (AVX2 or AVX-512 where the kernel level has it) against the scalar
  // dequantize, on blocks of random bytes (every code): each value bit for bit, NaN for NaN.
  using F = TypeParam;
  constexpr Index kValues = apex::KvFormat<F>::kValuesPerElement;
  std::mt19937 gen(31);
  std::vector<F> blocks;
  for (int i = 0; i < 256; ++i) blocks.push_back(random_block<F>(gen, i));
  for (const apex::KernelIsa isa :
       {apex::KernelIsa::kPortable, apex::KernelIsa::kAvx2, apex::KernelIsa::kAvx512}) {
    if (!apex::cpu_supports(isa)) continue;
    const apex::KernelIsa before = apex::kernel_isa();
    apex::set_kernel_isa(isa);
    std::vector<float> fast(blocks.size() * static_cast<std::size_t>(kValues));
    apex::KvFormat<F>::widen(blocks.data(), fast.data(), static_cast<Index>(blocks.size()));
    apex::set_kernel_isa(before);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      float slow[kValues];
      apex::dequantize(blocks[i], slow);
      for (Index j = 0; j < kValues; ++j) {
        const float a = fast[i * static_cast<std::size_t>(kValues) + static_cast<std::size_t>(j)];
        ASSERT_TRUE(std::memcmp(&a, &slow[j], sizeof a) == 0 ||
                    (std::isnan(a) && std::isnan(slow[j])))
            << apex::to_string(isa) << " block " << i << " value " << j << ": " << a << " vs "
            << slow[j];
      }
    }
  }
}

TYPED_TEST(QuantizedAttention, IsBitIdenticalForAnyThreadCount) {
#ifdef _OPENMP
  using F = TypeParam;
  constexpr Index kBlock = apex::KvFormat<F>::kValuesPerElement;
  std::mt19937 gen(17);
  // Decoding (split keys over threads) and a causal prefill over the same keys.
  const QuantizedHeads<F> k(apex::HeadsShape{1, 2, 3000, kBlock}, gen);
  const QuantizedHeads<F> v(apex::HeadsShape{1, 2, 3000, kBlock}, gen);
  for (const Index s_q : {Index{1}, Index{300}}) {
    const apex::HeadsShape q_shape{1, 8, s_q, kBlock};
    const std::vector<float> q = random_chunk(q_shape, gen);
    apex::AttentionMask<float> mask;
    mask.positions = apex::causal_mask();
    const auto run = [&] {
      std::vector<float> out(q.size());
      apex::sdpa(apex::HeadsView<const float>::contiguous(q.data(), q_shape), k.view(), v.view(),
                 mask, apex::SdpaParams{}, apex::HeadsView<float>::contiguous(out.data(), q_shape));
      return out;
    };
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    const std::vector<float> one = run();
    for (const int threads : {2, 3, 4}) {
      omp_set_num_threads(threads);
      EXPECT_EQ(run(), one) << "S_q " << s_q << ", " << threads << " threads";
    }
    omp_set_num_threads(saved);
  }
#else
  GTEST_SKIP() << "built without OpenMP, one thread only";
#endif
}

/// The largest normwise relative error of attention over K and V stored in F, against the same
/// attention over the unquantized float K and V, measured over 100 random problems (below), with
/// about a factor of two of room: q8_0 rounds a value to 1/254 of its block's largest magnitude,
/// q4_0 to 1/16, e4m3 to 2^-4 of the value, e5m2 to 2^-3 (the guide's accuracy table).
template <class F>
double storage_error_bound();
template <>
double storage_error_bound<apex::BlockQ8_0>() {
  return 3e-2;  // measured 1.4e-2
}
template <>
double storage_error_bound<apex::BlockQ4_0>() {
  return 4e-1;  // measured 2.0e-1
}
template <>
double storage_error_bound<apex::BlockFp8E4m3<64>>() {
  return 1.4e-1;  // measured 6.8e-2
}
template <>
double storage_error_bound<apex::BlockFp8E5m2<128>>() {
  return 2.8e-1;  // measured 1.4e-1
}

TYPED_TEST(QuantizedAttention, ErrorOfStoringKAndVIsBounded) {
  using F = TypeParam;
  double worst = 0.0;
  for (std::uint32_t seed = 0; seed < 100; ++seed) {
    std::mt19937 gen(1000 + seed);
    const Index s_k = 200 + seed;
    const QuantizedHeads<F> k(apex::HeadsShape{1, 2, s_k, 128}, gen);
    const QuantizedHeads<F> v(apex::HeadsShape{1, 2, s_k, 128}, gen);
    const apex::HeadsShape q_shape{1, 4, 16, 128};
    const std::vector<float> q = random_chunk(q_shape, gen);
    apex::AttentionMask<float> mask;
    if (seed % 2 == 0) mask.positions = apex::causal_mask();
    std::vector<float> exact(q.size()), stored(q.size());
    const auto qv = apex::HeadsView<const float>::contiguous(q.data(), q_shape);
    apex::sdpa(qv, apex::HeadsView<const float>::contiguous(k.values.data(), k.shape),
               apex::HeadsView<const float>::contiguous(v.values.data(), v.shape), mask,
               apex::SdpaParams{}, apex::HeadsView<float>::contiguous(exact.data(), q_shape));
    apex::sdpa(qv, k.view(), v.view(), mask, apex::SdpaParams{},
               apex::HeadsView<float>::contiguous(stored.data(), q_shape));
    double max_ref = 0.0, max_err = 0.0;
    for (std::size_t i = 0; i < exact.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(exact[i])));
      max_err = std::max(max_err, std::fabs(static_cast<double>(stored[i]) - exact[i]));
    }
    worst = std::max(worst, max_err / max_ref);
  }
  std::cout << "max normwise relative error of K/V stored as "
            << ::testing::internal::GetTypeName<F>() << " over 100 problems: " << worst << "\n";
  EXPECT_LE(worst, storage_error_bound<F>());
  EXPECT_GT(worst, 0.0) << "quantizing K and V must change something";
}

}  // namespace
}  // namespace kv_quant_test
