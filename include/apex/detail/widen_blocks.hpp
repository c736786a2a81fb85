// SPDX-License-Identifier: MIT
// Widening the blocks of the quantized K/V formats (kv_quant.hpp) to float with AVX2 (fp8 with
// AVX-512 where the level has it), chosen at run time by the kernel level (cpu.hpp's
// kernel_isa() at kAvx2 or above), whatever the compiler targets: the conversion behind every read
// of a quantized K or V (the kernel's loaders widen a block of keys, or a panel of rows while
// decoding, through KvFormat::widen).
//
// Each value is the one the scalar dequantize of kv_quant.hpp forms, bit for bit:
//   q8_0, q4_0   code · d: the integer code converted exactly, times the half scale widened
//                exactly; the product is exact in float (at most 8 + 11 significant bits);
//   fp8          the code's value (exact) times the float scale, rounded once.
// An fp8 code is decoded through an IEEE half (fp8_halves: its fields moved into a half's
// places with integer operations, then F16C's exact conversion): e5m2 is the upper byte of a half,
// and e4m3's fields in a half's places read as its value times 2^-8 (fp8_half_unit). Every fp8
// value, subnormal codes included, is a normal float, and so is every half they become: no
// subnormal float is formed, so a program that flushes them to zero decodes alike.
// The functions are templates over the block types (their fields d and q, or scale and code),
// defined in kv_quant.hpp, which calls them. Nothing here allocates.
#pragma once

#include <apex/config.hpp>
#include <apex/cpu.hpp>
#include <apex/fp8.hpp>

#include <cstdint>

#if APEX_X86_KERNELS
#include <immintrin.h>
#endif

namespace apex::detail {

#if APEX_X86_KERNELS

// NOLINTBEGIN: intrinsics and their casts

#define APEX_WIDEN_TARGET __attribute__((target("avx2,fma,f16c")))

/// Whether blocks are widened with AVX2: the kernel level is at least kAvx2.
inline bool widen_blocks_with_avx2() { return kernel_isa() >= KernelIsa::kAvx2; }

/// dst[0, 8) = the 8 signed 32-bit codes, converted to float, times d.
APEX_WIDEN_TARGET inline void store_scaled(float* dst, __m256i codes, __m256 d) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), d));
}

/// The 8 bytes at p, sign-extended (int8) to 32-bit lanes.
APEX_WIDEN_TARGET inline __m256i int8_lanes(const void* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

/// dst[0, 32·count) = the values of `count` q8_0 blocks: q[j]·d.
template <class Block>
APEX_WIDEN_TARGET void widen_q8_0_avx2(const Block* src, float* dst, Index count) {
  for (Index i = 0; i < count; ++i, dst += 32) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(src[i].d));
    for (int j = 0; j < 32; j += 8) store_scaled(dst + j, int8_lanes(src[i].q + j), d);
  }
}

/// dst[0, 32·count) = the values of `count` q4_0 blocks: (c_j − 8)·d, c_j the low nibble of byte
/// j for j < 16 and the high nibble of byte j − 16 after it.
template <class Block>
APEX_WIDEN_TARGET void widen_q4_0_avx2(const Block* src, float* dst, Index count) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i eight = _mm_set1_epi8(8);
  for (Index i = 0; i < count; ++i, dst += 32) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(src[i].d));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i].q));
    const __m128i low = _mm_sub_epi8(_mm_and_si128(bytes, nibble), eight);
    const __m128i high = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), eight);
    store_scaled(dst, _mm256_cvtepi8_epi32(low), d);
    store_scaled(dst + 8, _mm256_cvtepi8_epi32(_mm_srli_si128(low, 8)), d);
    store_scaled(dst + 16, _mm256_cvtepi8_epi32(high), d);
    store_scaled(dst + 24, _mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)), d);
  }
}

/// The IEEE half bits of the 16 fp8 codes of kind K in `bytes`: e5m2's sign, exponent and
/// mantissa are a half's upper byte (the same bias, ±inf and NaN alike), so its half has the
/// code's value; e4m3's, sign-extended to 16 bits and shifted into a half's places (exponent bias
/// 7 against 15), give the code's value times 2^-8, normal and subnormal codes alike, once bit 14
/// (a copy of the sign) is cleared; its NaN (magnitude 0x7f, which would read 1.875) is made a
/// half NaN.
template <Fp8Kind K>
APEX_WIDEN_TARGET __m256i fp8_halves(__m128i bytes) {
  if constexpr (K == Fp8Kind::kE5m2) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
  } else {
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
    const __m256i magnitude = _mm256_set1_epi16(0x3f80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(shifted, magnitude), magnitude);
    const __m256i half = _mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<short>(0xbfff)));
    return _mm256_or_si256(half, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
  }
}

/// The factor from the half of fp8_halves to the code's value: 2^8 for e4m3, 1 for e5m2.
template <Fp8Kind K>
constexpr float fp8_half_unit() {
  return K == Fp8Kind::kE4m3 ? 0x1p8f : 1.0f;
}

/// The values of the fp8 codes of kind K in the 8 low bytes of `bytes`, exactly.
template <Fp8Kind K>
APEX_WIDEN_TARGET __m256 fp8_values(__m128i bytes) {
  const __m256i half = fp8_halves<K>(bytes);
  const __m256 value = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
  return K == Fp8Kind::kE4m3 ? _mm256_mul_ps(value, _mm256_set1_ps(fp8_half_unit<K>())) : value;
}

/// dst[0, n) = the values of n fp8 codes of kind K times `scale` (n a multiple of 8).
template <Fp8Kind K>
APEX_WIDEN_TARGET void widen_fp8_codes_avx2(const std::uint8_t* code, float scale, float* dst,
                                            Index n) {
  const __m256 s = _mm256_set1_ps(scale);
  for (Index j = 0; j < n; j += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + j));
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(fp8_values<K>(bytes), s));
  }
}

#if APEX_MAX_KERNEL_ISA >= 2
/// widen_fp8_codes_avx2 with AVX-512: 16 codes a step, the same operations on each value (a last
/// 8 codes with AVX2).
template <Fp8Kind K>
__attribute__((target("avx512f,avx2,fma,f16c"))) void widen_fp8_codes_avx512(
    const std::uint8_t* code, float scale, float* dst, Index n) {
  const __m512 s = _mm512_set1_ps(scale);
  Index j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + j));
    // The masked form with every lane: GCC before 12.3 warns falsely about the unmasked one.
    __m512 value = _mm512_maskz_cvtph_ps(__mmask16(0xFFFF), fp8_halves<K>(bytes));
    if constexpr (K == Fp8Kind::kE4m3) {
      value = _mm512_mul_ps(value, _mm512_set1_ps(fp8_half_unit<K>()));
    }
    _mm512_storeu_ps(dst + j, _mm512_mul_ps(value, s));
  }
  if (j < n) widen_fp8_codes_avx2<K>(code + j, scale, dst + j, n - j);
}
#endif

/// dst[0, n) = the values of n fp8 codes of kind K times `scale` (n a multiple of 8): with
/// AVX-512 where the kernel level has it, else with AVX2; the same bits.
template <Fp8Kind K>
void widen_fp8_codes(const std::uint8_t* code, float scale, float* dst, Index n) {
#if APEX_MAX_KERNEL_ISA >= 2
  if (kernel_isa() >= KernelIsa::kAvx512) return widen_fp8_codes_avx512<K>(code, scale, dst, n);
#endif
  widen_fp8_codes_avx2<K>(code, scale, dst, n);
}

/// dst[0, B·count) = the values of `count` fp8 blocks of kind K: value(code_j)·scale.
template <Fp8Kind K, class Block>
void widen_fp8_blocks(const Block* src, float* dst, Index count) {
  for (Index i = 0; i < count; ++i, dst += Block::kValues) {
    widen_fp8_codes<K>(src[i].code, src[i].scale, dst, Block::kValues);
  }
}

#undef APEX_WIDEN_TARGET

// NOLINTEND

#endif

}  // namespace apex::detail
