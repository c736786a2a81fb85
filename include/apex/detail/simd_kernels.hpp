// SPDX-License-Identifier: MIT
// apex's own float kernels for the tiled attention kernel's hot loops, compiled for AVX2 and for
// AVX-512 whatever the compiler targets, and chosen at run time (cpu.hpp): a program built for
// baseline x86-64 runs them at the speed of a -march=native build.
//
//   gemm             c (+)= a · b, register-blocked (BLIS-style): a tile of kTileRows rows × two
//                    vectors of accumulators stays in registers across the whole depth, a is
//                    broadcast element by element, b is read a row of vectors at a time. It
//                    computes both products of a tile: S = Qs·Kᵀ (b = K transposed into panels
//                    by pack_transposed) and acc += P·V (b = V's rows as they are).
//   stream_update    acc += p · v for a few rows, streaming each value row once (decoding)
//   dots             s = q · kᵀ for a few query rows, streaming each key row once (decoding)
//   max_of, exp_sum  the block maximum and the weights e^(s − m) with their sum, for the online
//                    softmax (online_softmax.hpp).
//
// HOW ONE SOURCE BECOMES TWO KERNELS. Each level is a namespace (simd_avx2, simd_avx512) compiled
// under that level's target (GCC's and clang's target pragmas), holding the level's vector
// operations, written with intrinsics, and then the shared body, simd_kernels.inl, included
// into it. b and the keys may be float or a 16-bit format (bfloat16, half), widened to float in
// registers as they are loaded; the sums are float. float_kernels() hands out the level in use as a
// table of function pointers, or nullptr for KernelIsa::kPortable, where the caller uses Eigen's
// products.
//
// Register tiles: AVX-512, 12 rows × 32 columns (24 of the 32 vector registers); AVX2, 6 rows ×
// 16 columns (12 of the 16), the shapes of BLIS's sgemm kernels for these targets.
#pragma once

#include <apex/config.hpp>
#include <apex/cpu.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if APEX_X86_KERNELS
#include <immintrin.h>
#endif

namespace apex::detail {

/// The bits of a bfloat16 and of an IEEE half (the layouts of Eigen::bfloat16 and Eigen::half),
/// as the kernels' widening loads read them.
struct Bf16Bits {
  std::uint16_t bits;
};
struct HalfBits {
  std::uint16_t bits;
};

/// The element type the kernels read for a storage type T: float, Bf16Bits, HalfBits, or void
/// where they read no T.
template <class T>
using SimdElement = std::conditional_t<
    std::is_same_v<T, float>, float,
    std::conditional_t<std::is_same_v<T, Eigen::bfloat16>, Bf16Bits,
                       std::conditional_t<std::is_same_v<T, Eigen::half>, HalfBits, void>>>;

/// The kernels of one level that read rows of a storage element E (float, Bf16Bits, HalfBits).
template <class E>
struct RowKernels {
  /// c [rows × cols] = (add ? diag(scale)·c : 0) + a [rows × depth] (row stride lda) · b, b in
  /// panels of `panel` columns, panel p at b + p·panel_step with row stride ldb; scale: one
  /// factor per row, or nullptr for none. Allocates nothing.
  void (*gemm)(float* c, Index ldc, const float* a, Index lda, const E* b, Index ldb,
               Index panel_step, Index rows, Index cols, Index depth, bool add, const float* scale);
  /// acc [rows × d_v] (ld_acc) += p [rows × n] (ld_p) · v, value row j at v + j·stride, each
  /// value row read once, in memory order (decoding). Allocates nothing.
  void (*update)(float* acc, Index ld_acc, const float* p, Index ld_p, Index rows, const E* v,
                 Index stride, Index n, Index d_v);
  /// s [rows × n] (ld_s) = q [rows × d] (contiguous) · kᵀ, key row j at k + j·k_stride.
  void (*dots)(float* s, Index ld_s, const float* q, Index rows, const E* k, Index k_stride,
               Index n, Index d);
};

template <class E>
const RowKernels<E>& row_kernels(KernelIsa isa);

/// The float kernels of one level (see the top of this header).
struct FloatKernels {
  /// The level.
  KernelIsa isa;
  /// gemm and dots reading float rows.
  RowKernels<float> f32;
  /// packed = kᵀ in panels for gemm (panel_step = d·panel, ldb = panel), k [n × d] with row
  /// stride ld_k; writes packed_size(n, d) floats.
  void (*pack_transposed)(float* packed, const float* k, Index ld_k, Index n, Index d);
  /// max of n floats, NaN if one is NaN, -inf for none.
  float (*max_of)(const float* s, Index n);
  /// s_j = e^(s_j − max) (-0.0 where s_j = -inf), returns their sum, sets hidden if some s_j
  /// was -inf.
  float (*exp_sum)(float* s, Index n, float max, bool& hidden);
  /// Columns of a panel of gemm's b.
  Index panel;

  /// Floats that pack_transposed writes for n rows of d.
  Index packed_size(Index n, Index d) const { return (n + panel - 1) / panel * panel * d; }

  /// The row kernels for storage type T (SimdElement<T> not void). Those of the 16-bit formats
  /// have tables of their own, so that only a program that reads 16-bit rows compiles them.
  template <class T>
  const RowKernels<SimdElement<T>>& rows() const {
    using E = SimdElement<T>;
    if constexpr (std::is_same_v<E, float>) {
      return f32;
    } else {
      return row_kernels<E>(isa);
    }
  }
};

/// p as the kernels' element type of T (the same bits).
template <class T>
const SimdElement<T>* simd_elements(const T* p) {
  return reinterpret_cast<const SimdElement<T>*>(p);  // NOLINT: the same 16 or 32 bits
}

#if APEX_X86_KERNELS

// NOLINTBEGIN: intrinsics, C-style masks and the BLAS-style argument lists of the shared body.

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace simd_avx2 {
using V = __m256;
using Mask = __m256i;  // all ones in a lane that takes part
constexpr KernelIsa kIsa = KernelIsa::kAvx2;
constexpr Index kLanes = 8;
constexpr Index kTileRows = 6;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline V load(const float* p, Mask m, float fill) {
  return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void store(float* p, V v, Mask m) { _mm256_maskstore_ps(p, m, v); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V round_nearest(V x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/// 2^n for integral n in [-126, 127].
inline V pow2(V n) {
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline Mask first_lanes(Index n) {
  const auto count = static_cast<int>(std::min<Index>(n, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Mask less(V a, V b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
inline Mask equal(V a, V b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline Mask is_nan(V a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
inline Mask no_lanes() { return _mm256_setzero_si256(); }
inline Mask mask_or(Mask a, Mask b) { return _mm256_or_si256(a, b); }
inline bool any_of(Mask m, Mask lanes) { return _mm256_testz_si256(m, lanes) == 0; }
/// m ? a : b, lane by lane.
inline V select(Mask m, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
inline float reduce_add(V v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
inline V load(const Bf16Bits* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline V load(const HalfBits* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
/// The lanes of m of a 16-bit row, through a zeroed copy (AVX2 has no 16-bit masked load).
template <class H>
V load(const H* p, Mask m) {
  const auto count = static_cast<std::size_t>(
      __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(m)))));
  H part[kLanes] = {};
  std::memcpy(part, p, count * sizeof(H));
  return load(static_cast<const H*>(part));
}
inline float reduce_max(V v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
}
#include <apex/detail/simd_kernels.inl>
}  // namespace simd_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif
namespace simd_avx512 {
using V = __m512;
using Mask = __mmask16;
constexpr KernelIsa kIsa = KernelIsa::kAvx512;
constexpr Index kLanes = 16;
constexpr Index kTileRows = 12;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline V load(const float* p, Mask m, float fill) { return _mm512_mask_loadu_ps(set1(fill), m, p); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
// GCC 12's unmasked forms of these pass _mm512_undefined_*() through, which -Wuninitialized
// reports wherever they are inlined; the zero-masking forms with every lane set are the same
// instructions without it.
constexpr __mmask16 kAll = 0xFFFF;
inline V max(V a, V b) { return _mm512_maskz_max_ps(kAll, a, b); }
inline V round_nearest(V x) {
  return _mm512_maskz_roundscale_ps(kAll, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/// 2^n for integral n in [-126, 127].
inline V pow2(V n) {
  const __m512i biased =
      _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, biased, 23));
}
inline Mask first_lanes(Index n) {
  return n >= kLanes ? Mask(0xFFFF) : static_cast<Mask>((1U << static_cast<unsigned>(n)) - 1U);
}
inline Mask less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask equal(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(V a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Mask no_lanes() { return 0; }
inline Mask mask_or(Mask a, Mask b) { return static_cast<Mask>(a | b); }
inline bool any_of(Mask m, Mask lanes) { return (m & lanes) != 0; }
inline V select(Mask m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
inline V widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, bits), 16));
}
inline V load(const Bf16Bits* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V load(const Bf16Bits* p, Mask m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline V load(const HalfBits* p) {
  return _mm512_maskz_cvtph_ps(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V load(const HalfBits* p, Mask m) {
  return _mm512_maskz_cvtph_ps(kAll, _mm256_maskz_loadu_epi16(m, p));
}
inline float reduce_add(V v) {
  return simd_avx2::reduce_add(_mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xFF, v, 0),
                                             _mm512_maskz_extractf32x8_ps(0xFF, v, 1)));
}
inline float reduce_max(V v) {
  return simd_avx2::reduce_max(_mm256_max_ps(_mm512_maskz_extractf32x8_ps(0xFF, v, 0),
                                             _mm512_maskz_extractf32x8_ps(0xFF, v, 1)));
}
#include <apex/detail/simd_kernels.inl>
}  // namespace simd_avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// NOLINTEND

#endif

/// The row kernels of level `isa` (AVX2 or AVX-512) for rows of E.
template <class E>
const RowKernels<E>& row_kernels(KernelIsa isa) {
#if APEX_X86_KERNELS
  return isa == KernelIsa::kAvx512 ? simd_avx512::row_table<E>() : simd_avx2::row_table<E>();
#else
  (void)isa;
  static const RowKernels<E> none{};
  return none;
#endif
}

/// The float kernels of level `isa` (which the CPU must run), nullptr for KernelIsa::kPortable.
inline const FloatKernels* float_kernels(KernelIsa isa) {
#if APEX_X86_KERNELS
  switch (isa) {
    case KernelIsa::kAvx512:
      return &simd_avx512::float_table();
    case KernelIsa::kAvx2:
      return &simd_avx2::float_table();
    case KernelIsa::kPortable:
      break;
  }
#else
  (void)isa;
#endif
  return nullptr;
}

/// The float kernels of the level in use (kernel_isa()), nullptr for KernelIsa::kPortable.
inline const FloatKernels* float_kernels() { return float_kernels(kernel_isa()); }

}  // namespace apex::detail
