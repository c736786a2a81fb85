// SPDX-License-Identifier: MIT
// Widening a run of stored elements to the compute type: the one conversion behind every read of
// a 16-bit K or V (the kernel's loaders in flash_attention.hpp). Eigen 3.4's cast<>() converts
// one element at a time, which bounds a 16-bit decode at a fraction of the memory bandwidth it is
// meant to save; these loops convert 8 or 16 elements per instruction.
//
//   bfloat16 -> float  the 16 bits are the upper half of the float: a zero-extend and a shift,
//                      written as a plain loop that compilers vectorise with SSE2 and later.
//   half -> float      F16C's vcvtph2ps, 8 at a time: used directly when the compiler targets
//                      F16C, else chosen at run time on x86-64 with GCC or clang (a function
//                      compiled for AVX + F16C, called when the CPU has both); otherwise, or
//                      with EIGEN_DONT_VECTORIZE, Eigen's scalar conversion.
//   anything else      a plain element-by-element conversion (exact: every half and bfloat16
//                      is a float, every float a double).
#pragma once

#include <apex/config.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(EIGEN_DONT_VECTORIZE)
#include <cpuid.h>
#include <immintrin.h>
#define APEX_X86_F16C_DISPATCH 1
#else
#define APEX_X86_F16C_DISPATCH 0
#endif

namespace apex::detail {

/// dst[i] = src[i] widened to float, for the 16-bit patterns of bfloat16.
inline void widen_bfloat16(const std::uint16_t* src, float* dst, Index n) {
  for (Index i = 0; i < n; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof bits);
  }
}

#if APEX_X86_F16C_DISPATCH
/// dst[i] = src[i] widened to float, for the 16-bit patterns of IEEE half, with F16C.
__attribute__((target("avx,f16c"))) inline void widen_half_f16c(const std::uint16_t* src,
                                                                float* dst, Index n) {
  Index i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

/// Whether this CPU (and its operating system) runs AVX and F16C instructions, asked once: AVX
/// through the compiler's check (which includes the OS's support for the AVX registers), F16C
/// from CPUID leaf 1 (ECX bit 29; not every compiler's check knows it).
inline bool cpu_has_f16c() {
#if defined(__F16C__) && defined(__AVX__)
  return true;
#else
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__builtin_cpu_supports("avx") == 0 || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) {
      return false;
    }
    return (ecx & (1U << 29)) != 0;
  }();
  return has;
#endif
}
#endif

/// dst[i] = src[i] widened to float, for IEEE half.
inline void widen_half(const Eigen::half* src, float* dst, Index n) {
#if APEX_X86_F16C_DISPATCH
  if (cpu_has_f16c()) {
    widen_half_f16c(reinterpret_cast<const std::uint16_t*>(src), dst, n);
    return;
  }
#endif
  for (Index i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// dst[i] = src[i] converted to C, for n elements: exact, since C is at least as wide as T.
template <class T, class C>
void widen(const T* src, C* dst, Index n) {
  if constexpr (std::is_same_v<T, C>) {
    std::copy(src, src + n, dst);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<C, float>) {
    widen_bfloat16(reinterpret_cast<const std::uint16_t*>(src), dst, n);
  } else if constexpr (std::is_same_v<T, Eigen::half> && std::is_same_v<C, float>) {
    widen_half(src, dst, n);
  } else {
    for (Index i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
  }
}

}  // namespace apex::detail
