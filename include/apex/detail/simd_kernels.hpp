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
// into it. b and the keys may be float or a 16-bit format (bfloat16, half), and the streamed rows
// (dots, stream_update) also a block format of kv_quant.hpp (BlockValues), widened to float in
// registers as they are loaded; the sums are float. float_kernels() hands out the level in use as a
// table of function pointers, or nullptr for KernelIsa::kPortable, where the caller uses Eigen's
// products.
//
// Register tiles: AVX-512, 12 rows × 32 columns (24 of the 32 vector registers); AVX2, 6 rows ×
// 16 columns (12 of the 16), the shapes of BLIS's sgemm kernels for these targets.
#pragma once

#include <apex/config.hpp>
#include <apex/cpu.hpp>
#include <apex/kv_quant.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
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

/// Two bfloat16 values in one 32-bit word, the first in the low half: the element of the
/// operands of the bfloat16 dot-product kernels (Bf16Kernels), whose vector lanes hold pairs.
struct Bf16Pair {
  std::uint32_t bits;
};

/// Whether the streaming kernels (dots, stream_update) read rows of the block format F of
/// kv_quant.hpp in registers: q8_0, q4_0, and fp8 blocks of a multiple of 32 values, so that no
/// pair of vectors of values (8 or 16 lanes each) straddles two blocks.
template <class F>
inline constexpr bool kReadsBlocks = false;
template <>
inline constexpr bool kReadsBlocks<BlockQ8_0> = true;
template <>
inline constexpr bool kReadsBlocks<BlockQ4_0> = true;
template <Fp8Kind K, int B>
inline constexpr bool kReadsBlocks<BlockFp8<K, B>> = B % 32 == 0;

/// The element type the kernels read for a storage type T: float, Bf16Bits, HalfBits, the block
/// itself where kReadsBlocks, or void where they read no T.
template <class T>
using SimdElement = std::conditional_t<
    kReadsBlocks<T>, T,
    std::conditional_t<
        std::is_same_v<T, float>, float,
        std::conditional_t<std::is_same_v<T, Eigen::bfloat16>, Bf16Bits,
                           std::conditional_t<std::is_same_v<T, Eigen::half>, HalfBits, void>>>>;

// NOLINTBEGIN(cppcoreguidelines-macro-usage): X-macro lists, each spelled once
/// The row elements whose kernel tables (each level's row_table<E>, with every kernel they point
/// to) apex::precompiled_kernels compiles once (apex/precompiled_kernels.hpp; the attention
/// problems it compiles are in kernel_instances.hpp): float, the 16-bit formats, and the block
/// formats with their default block sizes. APEX_ROW_TABLE_ELEMENTS(X) calls X(E) for each.
#define APEX_ROW_TABLE_ELEMENTS(X) \
  X(float) X(HalfBits) X(Bf16Bits) X(BlockQ8_0) X(BlockQ4_0) X(BlockFp8E4m3<>) X(BlockFp8E5m2<>)
#define APEX_ROW_TABLE_DECLARE(E) extern template const RowKernels<E>& row_table<E>();
#define APEX_ROW_TABLE_DEFINE(E) template const RowKernels<E>& row_table<E>();
// NOLINTEND(cppcoreguidelines-macro-usage)

/// The values of a run of blocks of a quantized format, as the streaming kernels read a row of
/// them: value v is value v mod kValues of block v / kValues, and p + n is n values on (the way
/// a pointer to a row of scalars moves). A load of a vector of values at p dequantizes them in
/// registers; it never straddles two blocks (kReadsBlocks).
template <class Block>
struct BlockValues {
  const Block* blocks;  ///< the first block of the run
  Index value;          ///< values from its start

  BlockValues operator+(Index n) const { return {blocks, value + n}; }
  /// The address of the block that holds value `value` (for a prefetch).
  const Block* address() const { return blocks + unsigned_value() / Block::kValues; }
  /// The block that holds value `value`.
  const Block& block() const { return *address(); }
  /// Its place in that block.
  Index offset() const { return static_cast<Index>(unsigned_value() % Block::kValues); }

 private:
  // value >= 0: unsigned, the division and remainder are a shift and a mask
  std::size_t unsigned_value() const { return static_cast<std::size_t>(value); }
};

/// The kernels of one level that read rows of a storage element E (float, Bf16Bits, HalfBits, or
/// a block: then strides count blocks, d and d_v values, and gemm is null).
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

/// The bfloat16 dot-product kernels of KernelIsa::kAvx512Bf16 (vdpbf16ps) and of KernelIsa::kAmx
/// (the gemm on AMX tiles, tdpbf16ps; the rest the same): both products of a
/// tile with bfloat16 factors, summed in float. Pairs run along the sum of each product: along
/// d_qk for S = Qs·Kᵀ, along the keys for acc += P·V. Factors are rounded to bfloat16 to nearest
/// even (NaN stays NaN); the instructions treat a float or bfloat16 below 2^-126 in magnitude as
/// zero and flush such a sum to zero.
struct Bf16Kernels {
  /// gemm with a [rows × depth pairs] and b in panels of pairs, as RowKernels::gemm.
  void (*gemm)(float* c, Index ldc, const Bf16Pair* a, Index lda, const Bf16Pair* b, Index ldb,
               Index panel_step, Index rows, Index cols, Index depth, bool add, const float* scale);
  /// dst row r (ld_dst pairs) = src row r ([rows × cols], row stride ld_src) rounded, ⌈cols / 2⌉
  /// pairs, the second half of the last 0 when cols is odd: Qs and P as gemm's a.
  void (*round_pairs)(Bf16Pair* dst, Index ld_dst, const float* src, Index ld_src, Index rows,
                      Index cols);
  /// packed = kᵀ rounded, in panels for gemm's b (ldb = panel, panel_step = ⌈d / 2⌉·panel): panel
  /// p's row t holds pair (k(j, 2t), k(j, 2t + 1)) of keys j = p·panel + l (0 past n or d);
  /// k [n × d] with row stride ld_k. Writes packed_pairs(n, d) pairs.
  void (*pack_keys)(Bf16Pair* packed, const float* k, Index ld_k, Index n, Index d);
  /// pack_keys for keys stored as bfloat16 (read as they are, nothing rounded).
  void (*pack_keys_bf16)(Bf16Pair* packed, const Bf16Bits* k, Index ld_k, Index n, Index d);
  /// packed [⌈n / 2⌉ × d_v] (gemm's b with ldb = d_v, panel_step = panel): row u holds pairs
  /// (v(2u, c), v(2u + 1, c)) rounded, 0 for the row past an odd n; v [n × d_v], row stride ld_v.
  void (*pack_values)(Bf16Pair* packed, const float* v, Index ld_v, Index n, Index d_v);
  /// pack_values for values stored as bfloat16.
  void (*pack_values_bf16)(Bf16Pair* packed, const Bf16Bits* v, Index ld_v, Index n, Index d_v);
  /// Columns of a panel of gemm's b.
  Index panel;

  /// Pairs that pack_keys writes for n keys of width d.
  Index packed_pairs(Index n, Index d) const { return (n + panel - 1) / panel * panel * pairs(d); }
  /// Pairs of a row of n values.
  static Index pairs(Index n) { return (n + 1) / 2; }
};

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
  /// The bfloat16 dot-product kernels, or nullptr below KernelIsa::kAvx512Bf16.
  const Bf16Kernels* bf16;

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
  return reinterpret_cast<const SimdElement<T>*>(p);  // NOLINT: the same bits (or the same type)
}

#if APEX_X86_KERNELS

// A level's target region: every function from APEX_KERNEL_TARGET_PUSH("features") to
// APEX_KERNEL_TARGET_POP() is compiled for those features (clang's attribute push, GCC's target
// options), whatever the compiler targets. Defined for this header only.
#define APEX_KERNEL_PRAGMA(text) _Pragma(#text)
#if defined(__clang__)
#define APEX_KERNEL_TARGET_PUSH(features) \
  APEX_KERNEL_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define APEX_KERNEL_TARGET_POP() APEX_KERNEL_PRAGMA(clang attribute pop)
#else
#define APEX_KERNEL_TARGET_PUSH(features) \
  APEX_KERNEL_PRAGMA(GCC push_options) APEX_KERNEL_PRAGMA(GCC target(features))
#define APEX_KERNEL_TARGET_POP() APEX_KERNEL_PRAGMA(GCC pop_options)
#endif

// NOLINTBEGIN: intrinsics, C-style masks and the BLAS-style argument lists of the shared body.

/// Prefetches the n values at p into L1 (for rows read a little later), a line at a time: rows
/// of float, of the 16-bit formats and of blocks (double is not streamed here). The hardware
/// prefetcher stops at every 4 KiB page, and a decoding step's threads wait on memory there:
/// float K/V at 32K keys read at 0.39-0.64 of BM_MemRead without, 0.62-1.0 with (AMD Zen 5;
/// docs/performance.md, "Float rows prefetched").
template <class T>
void prefetch_values(const T* p, Index n) {
  static_assert(sizeof(T) <= sizeof(float), "rows of float or narrower");
  constexpr Index kPerLine = 64 / static_cast<Index>(sizeof(T));
  for (Index c = 0; c < n; c += kPerLine)
    _mm_prefetch(reinterpret_cast<const char*>(p + c), _MM_HINT_T0);
}
template <class Block>
void prefetch_values(BlockValues<Block> p, Index n) {
  const char* first = reinterpret_cast<const char*>(p.address());
  const char* end = reinterpret_cast<const char*>((p + n).address());
  for (const char* line = first; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
}

APEX_KERNEL_TARGET_PUSH("avx2,fma,f16c")
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
// reduce_add for kLanes vectors at once, in two steps: pair_sums(v[2i], v[2i + 1]) as the keys
// of a group come, then reduce_pairs over the kLanes / 2 results; lane j of the result is
// reduce_add(v[j]), formed with the same pairs of lanes ((l, l + 4), then (l, l + 2), then
// (l, l + 1)), so the same bits.
/// The first step for two vectors: [x's lanes l + (l + 4) | y's], l < 4.
inline V pair_sums(V x, V y) {
  return add(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
/// The rest, over the pair_sums p[0, 4) of v[0, 8): lane j = reduce_add(v[j]).
inline V reduce_pairs(const V* p) {
  V b[2];
  for (int i = 0; i < 2; ++i) {
    b[i] = add(_mm256_shuffle_ps(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm256_shuffle_ps(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const V sums = add(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // sums holds v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]'s: put them in order.
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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
// A block's values [at, at + 8) are block_codes(b, at) · block_scale(b), each the one
// KvFormat::widen forms (widen_blocks.hpp): the exact value of the code times the scale.
/// The 8 signed bytes at p as float lanes.
inline V int8_values(const void* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
}
/// A half scale, widened, in every lane.
inline V half_scale(std::uint16_t d) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(d)));
}
inline V block_codes(const BlockQ8_0& b, Index at) { return int8_values(b.q + at); }
inline V block_scale(const BlockQ8_0& b) { return half_scale(b.d); }
inline V block_codes(const BlockQ4_0& b, Index at) {
  // values [16, 32) are the high nibbles of bytes [0, 16)
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.q + at % 16));
  if (at >= 16) bytes = _mm_srli_epi16(bytes, 4);
  const __m128i codes = _mm_sub_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x0f)), _mm_set1_epi8(8));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
}
inline V block_scale(const BlockQ4_0& b) { return half_scale(b.d); }
/// The halves of the 8 fp8 codes of kind K at p (fp8_halves), widened: their values over
/// fp8_half_unit<K>().
template <Fp8Kind K>
V fp8_half_values(const std::uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_halves<K>(bytes)));
}
template <Fp8Kind K, int B>
V block_codes(const BlockFp8<K, B>& b, Index at) {
  return fp8_values<K>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.code + at)));
}
template <Fp8Kind K, int B>
V block_scale(const BlockFp8<K, B>& b) {
  return set1(b.scale);
}
#include <apex/detail/simd_kernels.inl>
}  // namespace simd_avx2
APEX_KERNEL_TARGET_POP()

#if APEX_MAX_KERNEL_ISA >= 2
APEX_KERNEL_TARGET_PUSH("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
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
/// Two 128-bit blocks of x, then two of y, as kPick selects them (_mm512_shuffle_f32x4).
template <int kPick>
inline V blocks(V x, V y) {
  return _mm512_maskz_shuffle_f32x4(kAll, x, y, kPick);
}
// reduce_add for kLanes vectors at once, as AVX2's pair_sums and reduce_pairs: the same pairs of
// lanes, (l, l + 8), (l, l + 4), (l, l + 2), then (l, l + 1), so the same bits.
/// The first step for two vectors: [x's lanes l + (l + 8) | y's], l < 8.
inline V pair_sums(V x, V y) {
  return add(blocks<_MM_SHUFFLE(1, 0, 1, 0)>(x, y), blocks<_MM_SHUFFLE(3, 2, 3, 2)>(x, y));
}
/// The rest, over the pair_sums p[0, 8) of v[0, 16): lane j = reduce_add(v[j]).
inline V reduce_pairs(const V* p) {
  V b[4];
  for (int i = 0; i < 4; ++i) {
    b[i] = add(blocks<_MM_SHUFFLE(2, 0, 2, 0)>(p[2 * i], p[2 * i + 1]),
               blocks<_MM_SHUFFLE(3, 1, 3, 1)>(p[2 * i], p[2 * i + 1]));
  }
  V c[2];
  for (int i = 0; i < 2; ++i) {
    c[i] = add(_mm512_maskz_shuffle_ps(kAll, b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_maskz_shuffle_ps(kAll, b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const V sums = add(_mm512_maskz_shuffle_ps(kAll, c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_maskz_shuffle_ps(kAll, c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // sums holds v[0], v[4], v[8], v[12], v[1], v[5], ...'s (a 4 × 4 transpose): put them in order.
  return _mm512_maskz_permutexvar_ps(
      kAll, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
inline float reduce_max(V v) {
  return simd_avx2::reduce_max(_mm256_max_ps(_mm512_maskz_extractf32x8_ps(0xFF, v, 0),
                                             _mm512_maskz_extractf32x8_ps(0xFF, v, 1)));
}
// A block's values [at, at + 16), as AVX2's block_codes and block_scale form them.
/// 16 signed bytes as float lanes.
inline V int8_values(__m128i bytes) {
  return _mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_cvtepi8_epi32(kAll, bytes));
}
/// A half scale, widened, in every lane.
inline V half_scale(std::uint16_t d) {
  return _mm512_maskz_cvtph_ps(kAll, _mm256_set1_epi16(static_cast<short>(d)));
}
inline V block_codes(const BlockQ8_0& b, Index at) {
  return int8_values(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q + at)));
}
inline V block_scale(const BlockQ8_0& b) { return half_scale(b.d); }
inline V block_codes(const BlockQ4_0& b, Index at) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q));
  if (at >= 16) bytes = _mm_srli_epi16(bytes, 4);  // values [16, 32): the high nibbles
  return int8_values(_mm_sub_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x0f)), _mm_set1_epi8(8)));
}
inline V block_scale(const BlockQ4_0& b) { return half_scale(b.d); }
/// A q4_0 block's 32 values (at = 0) as two vectors, each code c looking (c − 8)·d up in a table
/// of the 16 values the block can hold (vpermps reads an index's low 4 bits, so the high nibbles
/// need a shift and no mask): the products of block_codes · block_scale, the same bits, with
/// half the operations.
inline void block_pair(const BlockQ4_0& b, Index at, V& first, V& second) {
  APEX_ASSERT(at == 0);
  static_cast<void>(at);
  const V codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const V table = mul(codes, half_scale(b.d));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q));
  const auto lookup = [&table](__m128i nibbles) {
    return _mm512_maskz_permutexvar_ps(kAll, _mm512_maskz_cvtepu8_epi32(kAll, nibbles), table);
  };
  first = lookup(bytes);
  second = lookup(_mm_srli_epi16(bytes, 4));
}
/// The halves of the 16 fp8 codes of kind K at p (fp8_halves), widened: their values over
/// fp8_half_unit<K>().
template <Fp8Kind K>
V fp8_half_values(const std::uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_maskz_cvtph_ps(kAll, fp8_halves<K>(bytes));
}
template <Fp8Kind K, int B>
V block_codes(const BlockFp8<K, B>& b, Index at) {
  const V value = fp8_half_values<K>(b.code + at);
  return K == Fp8Kind::kE4m3 ? mul(value, set1(fp8_half_unit<K>())) : value;
}
template <Fp8Kind K, int B>
V block_scale(const BlockFp8<K, B>& b) {
  return set1(b.scale);
}
#include <apex/detail/simd_kernels.inl>
}  // namespace simd_avx512
APEX_KERNEL_TARGET_POP()
#endif  // APEX_MAX_KERNEL_ISA >= 2

#if APEX_MAX_KERNEL_ISA >= 3
// The bfloat16 dot products: AVX-512's operations and the shared body once more, under a target
// that adds AVX512-BF16 (kept apart, so that no instruction of it reaches the other levels), with
// Bf16Pair's loads and multiply-add; only gemm<Bf16Pair, Bf16Pair> and the packing below are
// compiled from it.
APEX_KERNEL_TARGET_PUSH("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
namespace simd_avx512_bf16 {
using simd_avx512::add;
using simd_avx512::any_of;
using simd_avx512::equal;
using simd_avx512::first_lanes;
using simd_avx512::fmadd;
using simd_avx512::is_nan;
using simd_avx512::kLanes;
using simd_avx512::kTileRows;
using simd_avx512::less;
using simd_avx512::load;
using simd_avx512::Mask;
using simd_avx512::mask_or;
using simd_avx512::max;
using simd_avx512::mul;
using simd_avx512::no_lanes;
using simd_avx512::pair_sums;
using simd_avx512::pow2;
using simd_avx512::reduce_add;
using simd_avx512::reduce_max;
using simd_avx512::reduce_pairs;
using simd_avx512::round_nearest;
using simd_avx512::select;
using simd_avx512::set1;
using simd_avx512::store;
using simd_avx512::sub;
using simd_avx512::V;
using simd_avx512::zero;
constexpr KernelIsa kIsa = KernelIsa::kAvx512Bf16;
inline V load(const Bf16Pair* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
inline V load(const Bf16Pair* p, Mask m) {
  return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, p));
}
inline V broadcast(const Bf16Pair* a) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(a->bits)));
}
/// acc + x₀·b₀ + x₁·b₁ in every lane, x and b holding pairs (vdpbf16ps).
inline V madd(const Bf16Pair* /*a*/, V x, V b, V acc) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)b);
}
/// The 16 floats of x rounded to bfloat16, in order.
inline __m256i round16(V x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#define APEX_SIMD_LOADS_OF_AVX512  // its loads are AVX-512's (using simd_avx512::load)
#include <apex/detail/simd_kernels.inl>
#undef APEX_SIMD_LOADS_OF_AVX512

/// Bf16Kernels::round_pairs.
inline void round_pairs(Bf16Pair* dst, Index ld_dst, const float* src, Index ld_src, Index rows,
                        Index cols) {
  const Index halves = 2 * Bf16Kernels::pairs(cols);  // bfloat16 values a row, padded to even
  for (Index r = 0; r < rows; ++r) {
    auto* out = reinterpret_cast<std::uint16_t*>(dst + r * ld_dst);
    const float* in = src + r * ld_src;
    Index c = 0;
    for (; c + 2 * kLanes <= cols; c += 2 * kLanes) {  // 32 values in one conversion
      _mm512_storeu_si512(out + c,
                          (__m512i)_mm512_cvtne2ps_pbh(load(in + c + kLanes), load(in + c)));
    }
    for (; c < halves; c += kLanes) {
      const __m256i bits = round16(load(in + c, first_lanes(cols - c)));  // 0 past cols
      _mm256_mask_storeu_epi16(out + c, first_lanes(halves - c), bits);
    }
  }
}

/// Pairs (x_l, y_l) of two rows of 16 floats, rounded, as 16 lanes.
inline __m512i interleave16(V x, V y) {
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(y, x);  // x's 16 values, then y's
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, halves);
}

/// Zeros for the keys of the last panel's second vector when n keys end in its first.
inline void zero_last_half_panel(Bf16Pair* packed, Index n, Index pairs) {
  const Index full = (n + kPanel - 1) / kPanel * kPanel;
  for (Index j0 = (n + kLanes - 1) / kLanes * kLanes; j0 < full; j0 += kLanes) {
    Bf16Pair* out = packed + (j0 / kPanel) * kPanel * pairs + j0 % kPanel;
    for (Index t = 0; t < pairs; ++t) _mm512_storeu_si512(out + t * kPanel, _mm512_setzero_si512());
  }
}

/// The 16 × 16 words of r transposed: word l of r[i] becomes word i of r[l]. Three passes of
/// unpacks and lane shuffles, 64 instructions in all. (Written in the masked forms with every
/// lane set, the same instructions: GCC before 12.3 warns falsely that the unmasked ones read an
/// uninitialized value.)
inline void transpose16(__m512i (&r)[16]) {
  constexpr __mmask16 kAll = 0xFFFF;
  constexpr __mmask8 kAll8 = 0xFF;
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i[c], r_{i+1}[c]) pairs
    t[i] = _mm512_mask_unpacklo_epi32(r[i], kAll, r[i], r[i + 1]);
    t[i + 1] = _mm512_mask_unpackhi_epi32(r[i], kAll, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per 128-bit lane: word c of rows i .. i + 3
    r[i] = _mm512_mask_unpacklo_epi64(t[i], kAll8, t[i], t[i + 2]);
    r[i + 1] = _mm512_mask_unpackhi_epi64(t[i], kAll8, t[i], t[i + 2]);
    r[i + 2] = _mm512_mask_unpacklo_epi64(t[i + 1], kAll8, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_mask_unpackhi_epi64(t[i + 1], kAll8, t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // lanes 0 and 2, then 1 and 3, of the row groups 0, 1 and 2, 3
    t[i] = _mm512_mask_shuffle_i32x4(r[i], kAll, r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_mask_shuffle_i32x4(r[i], kAll, r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_mask_shuffle_i32x4(r[i + 8], kAll, r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_mask_shuffle_i32x4(r[i + 8], kAll, r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {  // the four row groups of word i, then of word i + 8
    r[i] = _mm512_mask_shuffle_i32x4(t[i], kAll, t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_mask_shuffle_i32x4(t[i], kAll, t[i], t[i + 8], 0xdd);
  }
}

/// Packs n keys of d values into the panels of Bf16Kernels::pack_keys, 16 keys and 16 pairs at
/// a time: row_pairs(j, c, left) gives key j's 16 pairs from value c on (left > 0 values left in
/// the row, 0 past them), and transpose16 turns the 16 keys' pairs into 16 rows of the panel.
template <class RowPairs>
void pack_key_panels(Bf16Pair* packed, Index n, Index d, const RowPairs& row_pairs) {
  const Index pairs = Bf16Kernels::pairs(d);
  for (Index j0 = 0; j0 < n; j0 += kLanes) {
    const Index keys = std::min(kLanes, n - j0);
    Bf16Pair* out = packed + (j0 / kPanel) * kPanel * pairs + j0 % kPanel;
    for (Index t0 = 0; t0 < pairs; t0 += kLanes) {
      __m512i r[16];
      for (Index l = 0; l < kLanes; ++l) {
        r[l] = l < keys ? row_pairs(j0 + l, 2 * t0, d - 2 * t0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (Index t = t0; t < std::min(pairs, t0 + kLanes); ++t) {
        _mm512_storeu_si512(out + t * kPanel, r[t - t0]);
      }
    }
  }
  zero_last_half_panel(packed, n, pairs);
}

/// pack_key_panels' pairs of float keys k [n × d] (row stride ld): 32 values rounded in one
/// conversion.
struct FloatKeyPairs {
  const float* k;
  Index ld;
  __m512i operator()(Index j, Index c, Index left) const {
    const float* row = k + j * ld + c;
    const V high = left > kLanes ? load(row + kLanes, first_lanes(left - kLanes)) : zero();
    return (__m512i)_mm512_cvtne2ps_pbh(high, load(row, first_lanes(left)));
  }
};

/// pack_key_panels' pairs of keys stored as bfloat16: 32 values read as they are.
struct Bf16KeyPairs {
  const Bf16Bits* k;
  Index ld;
  __m512i operator()(Index j, Index c, Index left) const {
    const __mmask32 values = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1U;
    return _mm512_maskz_loadu_epi16(values, k + j * ld + c);
  }
};

/// Bf16Kernels::pack_keys: each key's values rounded along its row, then transposed in
/// registers (pack_key_panels).
inline void pack_keys(Bf16Pair* packed, const float* k, Index ld_k, Index n, Index d) {
  pack_key_panels(packed, n, d, FloatKeyPairs{k, ld_k});
}

/// Bf16Kernels::pack_keys_bf16: as pack_keys, the values read as they are.
inline void pack_keys_bf16(Bf16Pair* packed, const Bf16Bits* k, Index ld_k, Index n, Index d) {
  pack_key_panels(packed, n, d, Bf16KeyPairs{k, ld_k});
}

/// Bf16Kernels::pack_values_bf16: rows 2u and 2u + 1 interleaved, 16 columns at a time.
inline void pack_values_bf16(Bf16Pair* packed, const Bf16Bits* v, Index ld_v, Index n, Index d_v) {
  using simd_avx512::kAll;
  for (Index u = 0; 2 * u < n; ++u) {
    const Bf16Bits* first = v + 2 * u * ld_v;
    const bool second = 2 * u + 1 < n;
    for (Index c = 0; c < d_v; c += kLanes) {
      const Mask lanes = first_lanes(d_v - c);
      const __m512i x =
          _mm512_maskz_cvtepu16_epi32(kAll, _mm256_maskz_loadu_epi16(lanes, first + c));
      const __m512i y = second ? _mm512_maskz_cvtepu16_epi32(
                                     kAll, _mm256_maskz_loadu_epi16(lanes, first + ld_v + c))
                               : _mm512_setzero_si512();
      const __m512i pair = _mm512_or_si512(x, _mm512_maskz_slli_epi32(kAll, y, 16));
      _mm512_mask_storeu_epi32(packed + u * d_v + c, lanes, pair);
    }
  }
}

/// Bf16Kernels::pack_values: rows 2u and 2u + 1 interleaved, 16 columns at a time.
inline void pack_values(Bf16Pair* packed, const float* v, Index ld_v, Index n, Index d_v) {
  for (Index u = 0; 2 * u < n; ++u) {
    const float* first = v + 2 * u * ld_v;
    const bool second = 2 * u + 1 < n;
    for (Index c = 0; c < d_v; c += kLanes) {
      const Mask lanes = first_lanes(d_v - c);
      const V x = load(first + c, lanes);
      const V y = second ? load(first + ld_v + c, lanes) : zero();
      _mm512_mask_storeu_epi32(packed + u * d_v + c, lanes, interleave16(x, y));
    }
  }
}

#if defined(APEX_PRECOMPILED_KERNELS)
// The bfloat16 gemm is compiled once, in apex::precompiled_kernels (as the row tables are).
// NOLINTBEGIN(cppcoreguidelines-macro-usage)
#define APEX_BF16_GEMM_INSTANCE(KIND)                                                             \
  KIND template void gemm<Bf16Pair, Bf16Pair>(float*, Index, const Bf16Pair*, Index,              \
                                              const Bf16Pair*, Index, Index, Index, Index, Index, \
                                              bool, const float*);
// NOLINTEND(cppcoreguidelines-macro-usage)
APEX_BF16_GEMM_INSTANCE(extern)
#if defined(APEX_INSTANTIATE_KERNELS)
APEX_BF16_GEMM_INSTANCE()
#endif
#undef APEX_BF16_GEMM_INSTANCE
#endif

/// This level's bfloat16 kernels, as a table (simd_kernels.hpp's float_kernels).
inline const Bf16Kernels& bf16_table() {
  static const Bf16Kernels table{
      &gemm<Bf16Pair, Bf16Pair>, &round_pairs, &pack_keys, &pack_keys_bf16, &pack_values,
      &pack_values_bf16,         kPanel};
  return table;
}
}  // namespace simd_avx512_bf16
#if APEX_MAX_KERNEL_ISA >= 4

// AMX (KernelIsa::kAmx): the bfloat16 gemm on the tile registers, everything else
// simd_avx512_bf16's. A tile is 16 rows of 64 bytes: 16 floats of c, or 16 pairs of a or of b,
// so that b's panels of 32 columns (kPanel) are two tiles side by side, read in place with
// their row stride. tdpbf16ps adds a[16 × 16 pairs] · b[16 pairs × 16] into c[16 × 16], in
// float. The instructions are written as inline assembly (the tile is an immediate operand), so
// that they need no compiler target of their own and tell the compiler of the memory they touch.
namespace simd_amx {
using simd_avx512_bf16::kPanel;

/// Rows of a tile; pairs or floats in a tile's row.
constexpr Index kTile = 16;

/// The tile configuration ldtilecfg reads (palette 1, 64 bytes): tiles 0–7 of 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t row_bytes[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

inline void configure_tiles() {
  static const TileConfig config;
  asm volatile("ldtilecfg %0" : : "m"(config));
}
inline void release_tiles() { asm volatile("tilerelease" ::: "memory"); }
template <int kT>
APEX_ALWAYS_INLINE void tile_zero() {
  asm volatile("tilezero %%tmm%c0" : : "i"(kT));
}
/// Tile kT = 16 rows of 64 bytes, row r at base + r·stride bytes.
template <int kT>
APEX_ALWAYS_INLINE void tile_load(const void* base, Index stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(kT) : "memory");
}
template <int kT>
APEX_ALWAYS_INLINE void tile_store(void* base, Index stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(kT) : "memory");
}
/// Tile kC += tile kA · tile kB, in pairs (tdpbf16ps).
template <int kC, int kA, int kB>
APEX_ALWAYS_INLINE void tile_dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(kC), "i"(kA), "i"(kB));
}

/// c[16·kRowTiles × 32] (+)= a[16·kRowTiles × depth pairs] · b (one panel, depth a multiple of
/// 16): the accumulators in tiles 0–3 across the whole depth, a's tiles in 4–5, b's in 6–7.
template <int kRowTiles>
APEX_ALWAYS_INLINE void tile_block(float* c, Index ldc, const Bf16Pair* a, Index lda,
                                   const Bf16Pair* b, Index ldb, Index depth, bool add) {
  constexpr Index kBytes = 4;  // of a float or a pair
  float* c1 = c + kTile * ldc;
  if (add) {
    tile_load<0>(c, ldc * kBytes);
    tile_load<1>(c + kTile, ldc * kBytes);
    if constexpr (kRowTiles == 2) {
      tile_load<2>(c1, ldc * kBytes);
      tile_load<3>(c1 + kTile, ldc * kBytes);
    }
  } else {
    tile_zero<0>();
    tile_zero<1>();
    if constexpr (kRowTiles == 2) {
      tile_zero<2>();
      tile_zero<3>();
    }
  }
  for (Index t = 0; t < depth; t += kTile) {
    tile_load<6>(b + t * ldb, ldb * kBytes);
    tile_load<7>(b + t * ldb + kTile, ldb * kBytes);
    tile_load<4>(a + t, lda * kBytes);
    tile_dot<0, 4, 6>();
    tile_dot<1, 4, 7>();
    if constexpr (kRowTiles == 2) {
      tile_load<5>(a + kTile * lda + t, lda * kBytes);
      tile_dot<2, 5, 6>();
      tile_dot<3, 5, 7>();
    }
  }
  tile_store<0>(c, ldc * kBytes);
  tile_store<1>(c + kTile, ldc * kBytes);
  if constexpr (kRowTiles == 2) {
    tile_store<2>(c1, ldc * kBytes);
    tile_store<3>(c1 + kTile, ldc * kBytes);
  }
}

/// c[rows × cols] *= scale[row], cols a multiple of 16.
inline void scale_rows(float* c, Index ldc, const float* scale, Index rows, Index cols) {
  using namespace simd_avx512;
  for (Index i = 0; i < rows; ++i) {
    const V s = set1(scale[i]);
    for (Index j = 0; j < cols; j += kLanes) store(c + i * ldc + j, mul(load(c + i * ldc + j), s));
  }
}

/// Bf16Kernels::gemm on the tiles: the rows, columns and depth that fill whole tiles (multiples
/// of 16, 32 and 16) in blocks of 32 × 32, the rest (the depth's tail added on; the rows and
/// columns past the tiles) on simd_avx512_bf16's gemm. a and b are read in place; nothing is
/// read past the rows, columns or depth given.
inline void gemm(float* c, Index ldc, const Bf16Pair* a, Index lda, const Bf16Pair* b, Index ldb,
                 Index panel_step, Index rows, Index cols, Index depth, bool add,
                 const float* scale) {
  const auto rest = &simd_avx512_bf16::gemm<Bf16Pair, Bf16Pair>;
  const Index m = rows / kTile * kTile, n = cols / kPanel * kPanel, k = depth / kTile * kTile;
  if (m == 0 || n == 0 || k == 0) {
    return rest(c, ldc, a, lda, b, ldb, panel_step, rows, cols, depth, add, scale);
  }
  if (add && scale != nullptr) scale_rows(c, ldc, scale, m, n);
  configure_tiles();
  for (Index i = 0; i < m; i += 2 * kTile) {
    for (Index j = 0; j < n; j += kPanel) {
      const Bf16Pair* panel = b + j / kPanel * panel_step;
      if (m - i >= 2 * kTile) {
        tile_block<2>(c + i * ldc + j, ldc, a + i * lda, lda, panel, ldb, k, add);
      } else {
        tile_block<1>(c + i * ldc + j, ldc, a + i * lda, lda, panel, ldb, k, add);
      }
    }
  }
  release_tiles();
  if (k < depth) {
    rest(c, ldc, a + k, lda, b + k * ldb, ldb, panel_step, m, n, depth - k, true, nullptr);
  }
  if (n < cols) {
    rest(c + n, ldc, a, lda, b + n / kPanel * panel_step, ldb, panel_step, m, cols - n, depth, add,
         scale);
  }
  if (m < rows) {
    rest(c + m * ldc, ldc, a + m * lda, lda, b, ldb, panel_step, rows - m, cols, depth, add,
         scale == nullptr ? nullptr : scale + m);
  }
}

/// This level's bfloat16 kernels: simd_avx512_bf16's, with the gemm on the tiles.
inline const Bf16Kernels& bf16_table() {
  static const Bf16Kernels table = [] {
    Bf16Kernels t = simd_avx512_bf16::bf16_table();
    t.gemm = &gemm;
    return t;
  }();
  return table;
}
}  // namespace simd_amx
#endif  // APEX_MAX_KERNEL_ISA >= 4
APEX_KERNEL_TARGET_POP()
#endif  // APEX_MAX_KERNEL_ISA >= 3

// NOLINTEND

#undef APEX_ROW_TABLE_DEFINE
#undef APEX_ROW_TABLE_DECLARE
#undef APEX_ROW_TABLE_ELEMENTS
#undef APEX_KERNEL_TARGET_POP
#undef APEX_KERNEL_TARGET_PUSH
#undef APEX_KERNEL_PRAGMA

#endif

/// The row kernels of level `isa` (AVX2 or AVX-512) for rows of E.
template <class E>
const RowKernels<E>& row_kernels(KernelIsa isa) {
#if APEX_X86_KERNELS && APEX_MAX_KERNEL_ISA >= 2
  return isa >= KernelIsa::kAvx512 ? simd_avx512::row_table<E>() : simd_avx2::row_table<E>();
#elif APEX_X86_KERNELS
  (void)isa;
  return simd_avx2::row_table<E>();
#else
  (void)isa;
  static const RowKernels<E> none{};
  return none;
#endif
}

#if APEX_X86_KERNELS && APEX_MAX_KERNEL_ISA >= 3
/// AVX-512's float kernels as level `isa`, with the bfloat16 kernels `bf16`.
inline FloatKernels with_bf16(KernelIsa isa, const Bf16Kernels& bf16) {
  FloatKernels t = simd_avx512::float_table();
  t.isa = isa;
  t.bf16 = &bf16;
  return t;
}
#endif

/// The float kernels of level `isa` (which the CPU must run), nullptr for KernelIsa::kPortable
/// and for a level above APEX_MAX_KERNEL_ISA.
inline const FloatKernels* float_kernels(KernelIsa isa) {
#if APEX_X86_KERNELS
  // A level above APEX_MAX_KERNEL_ISA is not compiled: nullptr, as for kPortable.
  switch (isa) {
#if APEX_MAX_KERNEL_ISA >= 4
    case KernelIsa::kAmx: {
      static const FloatKernels table = with_bf16(KernelIsa::kAmx, simd_amx::bf16_table());
      return &table;
    }
#endif
#if APEX_MAX_KERNEL_ISA >= 3
    case KernelIsa::kAvx512Bf16: {
      static const FloatKernels table =
          with_bf16(KernelIsa::kAvx512Bf16, simd_avx512_bf16::bf16_table());
      return &table;
    }
#endif
#if APEX_MAX_KERNEL_ISA >= 2
    case KernelIsa::kAvx512:
      return &simd_avx512::float_table();
#endif
    case KernelIsa::kAvx2:
      return &simd_avx2::float_table();
    default:
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
