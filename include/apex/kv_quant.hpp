// SPDX-License-Identifier: MIT
// Quantized K/V formats: rows of keys, values or latents stored in 8 or 4 bits per value, in
// blocks of consecutive values along the row, each block with its own scale. Each is a format
// of kv_format.hpp (KvFormat<Block>): a cache or a K/V view of blocks holds elements of the
// block type, kValuesPerElement values each, and the kernel widens them to float or double as
// it reads them.
//
//   format            block      bytes  bits/value  stored                        value
//   BlockQ8_0          32 values   34     8.5       half d, int8 q[32]            q[j]·d
//   BlockQ4_0          32 values   18     4.5       half d, 4-bit codes c[32]     (c[j] − 8)·d
//   BlockFp8<E4m3, B>   B values  4 + B   8 + 32/B  float s, e4m3 codes[B]        e4m3(c)·s
//   BlockFp8<E5m2, B>   B values  4 + B   8 + 32/B  float s, e5m2 codes[B]        e5m2(c)·s
//   FlashMlaFp8Row      a latent   656    9.1       c_kv as e4m3 codes with a float s per 128
//     <512, 64>         row (576)                   values, K_rope as bfloat16 (below)
//
// q8_0 AND q4_0 are ggml's block formats, byte for byte (llama.cpp's q8_0 and q4_0 caches):
//   BlockQ8_0  | d (IEEE half, 2 bytes) | q[0] ... q[31] (int8) |
//   BlockQ4_0  | d (IEEE half, 2 bytes) | byte j = c[j] | c[j + 16] << 4, j = 0..15 |
// and a finite row quantizes to the bytes of ggml's reference quantizers
// (quantize_row_q8_0_ref, quantize_row_q4_0_ref), computed in float exactly as they do:
//   q8_0: amax = max |x_j|; d = amax / 127; id = d ≠ 0 ? 1/d : 0; q_j = round(x_j·id), ties
//         away from zero; d stored as half (rounded to nearest even, after id was taken);
//   q4_0: m = the x_j of largest magnitude (the first such); d = m / −8; id as above;
//         c_j = min(15, trunc(x_j·id + 8.5)); d stored as half.
// ggml's CPU backend writes q8_0 caches with a faster quantizer that rounds ties to even
// instead; both decode alike. As in ggml, a block whose d overflows half (amax beyond
// 127·65504 for q8_0, 8·65504 for q4_0) stores d = inf, and its values read back as ±inf or
// NaN (0·inf); a d below half's range rounds to a half subnormal or to 0. Where d is so small
// that 1/d overflows (a block's values all below about 3e-37 in magnitude), ggml's arithmetic
// meets infinities and converts them to integers: apex stores code 0 there, as x86 builds of
// ggml do, and the values read back as 0 either way (d is a half 0).
//
// fp8 WITH BLOCK SCALES, as DeepSeek's and FlashMLA's fp8 caches: a float scale s = amax / the
// format's largest finite value (448 for e4m3, 57344 for e5m2) per block of B values (B = 128
// by default), and each value's code fp8_encode(x_j / s) (fp8.hpp: rounded once to nearest
// even, saturating). A block of zeros has s = 0 and stores the values' signed zeros.
//
// FLASHMLA's fp8 LATENT ROWS (FlashMlaFp8Row<D_kv, D_rope>), as DeepSeek-V3.2's fp8 MLA cache
// lays out one token: one element is a whole row of a latent cache (§9.4), c_kv and K_rope,
//   | code[0 .. D_kv) e4m3 | scale[0 .. D_kv/128) float | rope[0 .. D_rope) bfloat16 bits |
// (656 bytes at D_kv = 512, D_rope = H_kr·d_r = 64). c_kv is quantized per 128 values exactly as
// BlockFp8E4m3<128> is (the same scale and codes), and K_rope, whose rotation the scores are most
// sensitive to, is rounded once to bfloat16. Its values are [c_kv ‖ K_rope], D_kv + D_rope of
// them. Rows written by another quantizer (DeepSeek's power-of-two scales) read back as they
// are: a value is code·scale whatever chose the scale.
//
// NON-FINITE INPUT (apex's rule, the same for every block format; ggml's answers to it are
// accidents of its arithmetic): a block holding a NaN or ±inf stores a NaN scale, so that all
// its values read back as NaN; the other blocks of the row, and other rows, are unaffected. (In
// a FlashMlaFp8Row, each 128 values of c_kv are such a block; K_rope keeps a NaN or ±inf as
// bfloat16 keeps it, as the 16-bit formats do.)
// Attention then treats those values as apex::sdpa does any NaN (sdpa.hpp).
//
// DOUBLE INPUT. The quantizers read float, as ggml's do: double values are rounded to float
// first. Widening gives floats (the value column above, formed in float); a double kernel reads
// those floats exactly.
//
// Nothing here allocates.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/widen_blocks.hpp>
#include <apex/fp8.hpp>
#include <apex/kv_format.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <type_traits>

namespace apex {

/// ggml's q8_0 block: 32 values as int8 codes with one IEEE half scale (34 bytes).
struct BlockQ8_0 {
  static constexpr Index kValues = 32;  ///< values per block
  std::uint16_t d;                      ///< the scale, as the bits of an IEEE half
  std::int8_t q[kValues];               ///< value j is q[j]·d
};

/// ggml's q4_0 block: 32 values as 4-bit codes with one IEEE half scale (18 bytes).
struct BlockQ4_0 {
  static constexpr Index kValues = 32;  ///< values per block
  std::uint16_t d;                      ///< the scale, as the bits of an IEEE half
  std::uint8_t q[kValues / 2];          ///< codes of values j (low nibble) and j + 16 (high)
};

/// B values as OFP8 codes of kind K with one float scale (4 + B bytes); B a multiple of 4.
template <Fp8Kind K, int B = 128>
struct BlockFp8 {
  static_assert(B >= 4 && B % 4 == 0, "BlockFp8: a block is a positive multiple of 4 values");
  static constexpr Index kValues = B;  ///< values per block
  float scale;                         ///< value j is fp8_decode<K>(code[j])·scale
  std::uint8_t code[B];                ///< the values' codes
};

/// fp8 e4m3 (OFP8, largest finite 448) with a float scale per B values.
template <int B = 128>
using BlockFp8E4m3 = BlockFp8<Fp8Kind::kE4m3, B>;
/// fp8 e5m2 (OFP8, largest finite 57344) with a float scale per B values.
template <int B = 128>
using BlockFp8E5m2 = BlockFp8<Fp8Kind::kE5m2, B>;

/// One token's row of a latent cache in FlashMLA's fp8 layout (header comment): c_kv (D_kv
/// values) as e4m3 codes with a float scale per 128 values, then K_rope (D_rope = H_kr·d_r
/// values) as bfloat16. Its values are [c_kv ‖ K_rope]: kLatent + kRope of them.
template <int D_kv = 512, int D_rope = 64>
struct FlashMlaFp8Row {
  static_assert(D_kv >= 128 && D_kv % 128 == 0,
                "FlashMlaFp8Row: c_kv is a positive multiple of 128 values");
  static_assert(D_rope >= 2 && D_rope % 2 == 0, "FlashMlaFp8Row: K_rope is even and not empty");
  static constexpr Index kGroup = 128;             ///< c_kv values per scale
  static constexpr Index kLatent = D_kv;           ///< c_kv values, d_kv
  static constexpr Index kRope = D_rope;           ///< K_rope values, H_kr·d_r
  static constexpr Index kValues = D_kv + D_rope;  ///< values of the row
  std::uint8_t code[D_kv];                         ///< c_kv's e4m3 codes
  float scale[D_kv / kGroup];    ///< c_kv value j is e4m3(code[j])·scale[j / 128]
  Eigen::bfloat16 rope[D_rope];  ///< K_rope
};

static_assert(sizeof(FlashMlaFp8Row<>) == 656,
              "FlashMLA's fp8 latent row is 512 codes, 4 float scales and 64 bfloat16: 656 bytes");
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18,
              "q8_0 and q4_0 blocks are ggml's: 34 and 18 bytes");
static_assert(sizeof(BlockFp8E4m3<>) == 132, "an fp8 block is its scale and its codes");

namespace detail {

/// The half nearest to f (ties to even), as its bits; f's overflow gives ±inf, NaN a NaN.
inline std::uint16_t half_bits(float f) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(f));
}

/// The float value of half bits.
inline float half_value(std::uint16_t bits) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
}

/// Whether all n values are finite.
inline bool all_finite_values(const float* x, Index n) {
  bool finite = true;
  for (Index j = 0; j < n; ++j) finite = finite && std::isfinite(x[j]);
  return finite;
}

/// x·id + 8.5 in float, the two operations rounded one after the other as ggml's q4_0 reference
/// computes them, never fused into one multiply-add (the sum is formed exactly in double, then
/// rounded once to float: the float addition's result).
inline float q4_offset_code(float x, float id) {
  const float scaled = x * id;
  return static_cast<float>(static_cast<double>(scaled) + 8.5);
}

}  // namespace detail

/// The q8_0 block of 32 float values x (header comment: ggml's reference quantizer for finite x,
/// a NaN scale for a block holding a non-finite value).
inline BlockQ8_0 quantize_q8_0(const float* x) {
  BlockQ8_0 y{};
  if (!detail::all_finite_values(x, BlockQ8_0::kValues)) {
    y.d = detail::half_bits(std::numeric_limits<float>::quiet_NaN());
    return y;
  }
  float amax = 0.0f;
  for (Index j = 0; j < BlockQ8_0::kValues; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y.d = detail::half_bits(d);
  for (Index j = 0; j < BlockQ8_0::kValues; ++j) {
    const float scaled = x[j] * id;
    y.q[j] = std::isfinite(scaled) ? static_cast<std::int8_t>(std::round(scaled)) : std::int8_t{0};
  }
  return y;
}

/// The q4_0 block of 32 float values x (header comment).
inline BlockQ4_0 quantize_q4_0(const float* x) {
  BlockQ4_0 y{};
  if (!detail::all_finite_values(x, BlockQ4_0::kValues)) {
    y.d = detail::half_bits(std::numeric_limits<float>::quiet_NaN());
    std::fill(std::begin(y.q), std::end(y.q), std::uint8_t{0x88});
    return y;
  }
  float amax = 0.0f;
  float extreme = 0.0f;  // the first value of largest magnitude
  for (Index j = 0; j < BlockQ4_0::kValues; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      extreme = x[j];
    }
  }
  const float d = extreme / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y.d = detail::half_bits(d);
  const auto code = [&](float v) {
    const float offset = detail::q4_offset_code(v, id);
    return std::isfinite(offset) ? std::min(15, static_cast<int>(offset)) : 0;
  };
  for (Index j = 0; j < BlockQ4_0::kValues / 2; ++j) {
    y.q[j] = static_cast<std::uint8_t>(code(x[j]) | code(x[j + 16]) << 4U);
  }
  return y;
}

/// The fp8 block of B float values x (header comment).
template <Fp8Kind K, int B>
BlockFp8<K, B> quantize_fp8(const float* x) {
  BlockFp8<K, B> y{};
  if (!detail::all_finite_values(x, B)) {
    y.scale = std::numeric_limits<float>::quiet_NaN();
    return y;
  }
  float amax = 0.0f;
  for (Index j = 0; j < B; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float largest = fp8_decode<K>(detail::fp8_layout(K).max_finite);
  y.scale = amax / largest;
  for (Index j = 0; j < B; ++j) {
    y.code[j] = fp8_encode<K>(y.scale != 0.0f ? x[j] / y.scale : x[j]);
  }
  return y;
}

/// The FlashMLA fp8 row of the float values x [c_kv ‖ K_rope] (header comment): each 128 values
/// of c_kv as quantize_fp8<kE4m3, 128> quantizes them, K_rope rounded to bfloat16.
template <int D_kv, int D_rope>
FlashMlaFp8Row<D_kv, D_rope> quantize_flashmla_row(const float* x) {
  using Row = FlashMlaFp8Row<D_kv, D_rope>;
  Row y{};
  for (Index g = 0; g < D_kv / Row::kGroup; ++g) {
    const BlockFp8E4m3<Row::kGroup> block =
        quantize_fp8<Fp8Kind::kE4m3, Row::kGroup>(x + g * Row::kGroup);
    y.scale[g] = block.scale;
    std::copy_n(block.code, Row::kGroup, y.code + g * Row::kGroup);
  }
  for (Index j = 0; j < D_rope; ++j) {
    y.rope[j] = Eigen::bfloat16(x[D_kv + j]);  // to nearest, ties to even
  }
  return y;
}

/// y[0, 32) = the values of a q8_0 block, q[j]·d formed in float, as C.
template <class C>
void dequantize(const BlockQ8_0& x, C* y) {
  const float d = detail::half_value(x.d);
  for (Index j = 0; j < BlockQ8_0::kValues; ++j)
    y[j] = static_cast<C>(static_cast<float>(x.q[j]) * d);
}

/// y[0, 32) = the values of a q4_0 block, (c_j − 8)·d formed in float, as C.
template <class C>
void dequantize(const BlockQ4_0& x, C* y) {
  const float d = detail::half_value(x.d);
  for (Index j = 0; j < BlockQ4_0::kValues / 2; ++j) {
    y[j] = static_cast<C>(static_cast<float>((x.q[j] & 0x0F) - 8) * d);
    y[j + 16] = static_cast<C>(static_cast<float>((x.q[j] >> 4) - 8) * d);
  }
}

/// y[0, B) = the values of an fp8 block, fp8_decode(code_j)·scale formed in float, as C.
template <class C, Fp8Kind K, int B>
void dequantize(const BlockFp8<K, B>& x, C* y) {
  for (Index j = 0; j < B; ++j) y[j] = static_cast<C>(fp8_decode<K>(x.code[j]) * x.scale);
}

/// y[0, D_kv + D_rope) = the values of a FlashMLA fp8 row: e4m3(code_j)·scale formed in float,
/// then the bfloat16 values of K_rope, as C.
template <class C, int D_kv, int D_rope>
void dequantize(const FlashMlaFp8Row<D_kv, D_rope>& x, C* y) {
  for (Index j = 0; j < D_kv; ++j) {
    y[j] = static_cast<C>(fp8_decode<Fp8Kind::kE4m3>(x.code[j]) * x.scale[j / 128]);
  }
  for (Index j = 0; j < D_rope; ++j) {
    y[D_kv + j] = static_cast<C>(static_cast<float>(x.rope[j]));
  }
}

namespace detail {

/// The quantizer of each block format (quantize_q8_0, quantize_q4_0, quantize_fp8,
/// quantize_flashmla_row).
inline BlockQ8_0 quantize_block(const float* x, const BlockQ8_0*) { return quantize_q8_0(x); }
inline BlockQ4_0 quantize_block(const float* x, const BlockQ4_0*) { return quantize_q4_0(x); }
template <Fp8Kind K, int B>
BlockFp8<K, B> quantize_block(const float* x, const BlockFp8<K, B>*) {
  return quantize_fp8<K, B>(x);
}
template <int D_kv, int D_rope>
FlashMlaFp8Row<D_kv, D_rope> quantize_block(const float* x, const FlashMlaFp8Row<D_kv, D_rope>*) {
  return quantize_flashmla_row<D_kv, D_rope>(x);
}

#if APEX_X86_KERNELS
/// The SIMD widening of each block format (detail/widen_blocks.hpp: AVX2, fp8 with AVX-512
/// where the kernel level has it).
inline void widen_simd(const BlockQ8_0* src, float* dst, Index count) {
  widen_q8_0_avx2(src, dst, count);
}
inline void widen_simd(const BlockQ4_0* src, float* dst, Index count) {
  widen_q4_0_avx2(src, dst, count);
}
template <Fp8Kind K, int B>
void widen_simd(const BlockFp8<K, B>* src, float* dst, Index count) {
  widen_fp8_blocks<K>(src, dst, count);
}
template <int D_kv, int D_rope>
void widen_simd(const FlashMlaFp8Row<D_kv, D_rope>* src, float* dst, Index count) {
  for (Index i = 0; i < count; ++i, dst += D_kv + D_rope) {
    for (Index g = 0; g < D_kv / 128; ++g) {
      widen_fp8_codes<Fp8Kind::kE4m3>(src[i].code + g * 128, src[i].scale[g], dst + g * 128, 128);
    }
    widen(src[i].rope, dst + D_kv, D_rope);
  }
}
#endif

/// The format of a row of blocks of `Block` (kv_format.hpp): Block::kValues values a block.
template <class Block>
struct BlockFormat {
  using Element = Block;                                      ///< a block
  static constexpr Index kValuesPerElement = Block::kValues;  ///< values in a block

  /// Blocks of a row of `values` values (a multiple of kValuesPerElement: check_row_values).
  static constexpr Index elements(Index values) { return values / kValuesPerElement; }
  /// Bytes of `count` blocks.
  static constexpr std::int64_t bytes(std::int64_t count) {
    return count * static_cast<std::int64_t>(sizeof(Block));
  }
  /// dst[0, count·kValuesPerElement) = the values of src[0, count) as C (dequantize; for float
  /// with AVX2 or AVX-512 where the kernel level has it, the same bits).
  template <class C>
  static void widen(const Block* src, C* dst, Index count) {
#if APEX_X86_KERNELS
    if constexpr (std::is_same_v<C, float>) {
      if (widen_blocks_with_avx2()) return widen_simd(src, dst, count);
    }
#endif
    for (Index i = 0; i < count; ++i) dequantize(src[i], dst + i * kValuesPerElement);
  }
  /// dst[0, values / kValuesPerElement) = the blocks of the row x[0, values) of float or double
  /// values (double rounded to float first).
  template <class S>
  static void store_row(const S* x, Index values, Block* dst) {
    float row[kValuesPerElement];
    for (Index i = 0; i < values / kValuesPerElement; ++i) {
      for (Index j = 0; j < kValuesPerElement; ++j) {
        row[j] = static_cast<float>(x[i * kValuesPerElement + j]);
      }
      dst[i] = quantize_block(row, static_cast<const Block*>(nullptr));
    }
  }
};

}  // namespace detail

/// q8_0 rows (BlockQ8_0).
template <>
struct KvFormat<BlockQ8_0> : detail::BlockFormat<BlockQ8_0> {};
/// q4_0 rows (BlockQ4_0).
template <>
struct KvFormat<BlockQ4_0> : detail::BlockFormat<BlockQ4_0> {};
/// fp8 rows with a float scale per block (BlockFp8).
template <Fp8Kind K, int B>
struct KvFormat<BlockFp8<K, B>> : detail::BlockFormat<BlockFp8<K, B>> {};
/// FlashMLA's fp8 latent rows (FlashMlaFp8Row): one element a whole row of a latent cache.
template <int D_kv, int D_rope>
struct KvFormat<FlashMlaFp8Row<D_kv, D_rope>> : detail::BlockFormat<FlashMlaFp8Row<D_kv, D_rope>> {
};
/// A FlashMlaFp8Row is one whole row of a latent cache.
template <int D_kv, int D_rope>
inline constexpr bool is_latent_row_format_v<FlashMlaFp8Row<D_kv, D_rope>> = true;

}  // namespace apex
