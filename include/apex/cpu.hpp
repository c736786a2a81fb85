// SPDX-License-Identifier: MIT
// Which instruction set apex's own float kernels run on (detail/simd_kernels.hpp): chosen at run
// time, so that one binary built for baseline x86-64 (a plain `-O2` Release build, no -march
// flag) still runs its attention products with AVX2 or AVX-512 where the CPU has them.
//
//   KernelIsa::kPortable  Eigen's products and packets, for whatever the compiler targets: the
//                         only path off x86-64, with compilers other than GCC and clang, and
//                         with EIGEN_DONT_VECTORIZE.
//   KernelIsa::kAvx2      AVX2 + FMA + F16C, 8 floats a vector.
//   KernelIsa::kAvx512    AVX-512 F, BW, DQ and VL (and the AVX2 set), 16 floats a vector.
//   KernelIsa::kAvx512Bf16  kAvx512 plus AVX512-BF16's dot products of bfloat16 pairs, which the
//                         tiled kernel uses where a call permits it (SdpaParams::
//                         allow_bf16_products); every other product is kAvx512's.
//   KernelIsa::kAmx       kAvx512Bf16 with those permitted bfloat16 products on AMX's tile
//                         registers (tdpbf16ps, 16 × 16 floats a tile), where the CPU has AMX-TILE
//                         and AMX-BF16 and Linux grants the process the tile state
//                         (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once, by cpu_supports).
//
// The default is the widest level this CPU and its operating system run (best_kernel_isa()).
// Two ways to force another one, where the CPU runs it (else the best one it does is kept):
//   - the environment variable APEX_KERNEL_ISA=portable|avx2|avx512|avx512bf16|amx, read at the
//     first call of an apex kernel (the tests run the attention suites once per level this way);
//   - compiling with the macro APEX_KERNEL_ISA defined to 0 (portable), 1 (AVX2), 2 (AVX-512),
//     3 (AVX-512 with BF16) or 4 (AMX), which the environment variable overrides.
// set_kernel_isa() changes the level at run time; call it while no apex call is running.
//
// The macro APEX_MAX_KERNEL_ISA (0–4, default 4) is the widest level compiled into a program:
// the levels above it are neither compiled nor chosen, as if the CPU lacked them. A program for
// AVX2 machines only, built with APEX_MAX_KERNEL_ISA=1, compiles about 30 % of the kernels' code
// (the AVX-512 levels are the rest); 0 leaves Eigen's products alone. Define it alike in every
// translation unit of a program (as EIGEN_DONT_VECTORIZE).
//
// Results are bit-identical for any number of threads under one level; two levels round
// differently (to float's rounding: the order of the sums differs).
#pragma once

#include <apex/config.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>

#if !defined(APEX_MAX_KERNEL_ISA)
/// The widest KernelIsa level compiled into the program, as an int (see the top of cpu.hpp).
#define APEX_MAX_KERNEL_ISA 4
#endif
static_assert(APEX_MAX_KERNEL_ISA >= 0 && APEX_MAX_KERNEL_ISA <= 4,
              "APEX_MAX_KERNEL_ISA must be 0 (portable), 1 (avx2), 2 (avx512), 3 (avx512bf16) or "
              "4 (amx)");

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(EIGEN_DONT_VECTORIZE) && APEX_MAX_KERNEL_ISA >= 1
/// 1 where apex compiles its AVX2 and AVX-512 kernels (x86-64 with GCC or clang, Eigen's
/// vectorisation not switched off, APEX_MAX_KERNEL_ISA at least 1), 0 elsewhere.
#define APEX_X86_KERNELS 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define APEX_X86_KERNELS 0
#endif

namespace apex {

/// An instruction-set level of apex's own kernels (see the top of cpu.hpp).
enum class KernelIsa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

/// "portable", "avx2", "avx512", "avx512bf16" or "amx".
inline const char* to_string(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAmx:
      return "amx";
    case KernelIsa::kAvx512Bf16:
      return "avx512bf16";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
    case KernelIsa::kPortable:
      break;
  }
  return "portable";
}

namespace detail {
/// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), the operating
/// system saves the tile state (XCR0 bits 17 and 18) and Linux lets this process use it (the
/// permission arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) asks for, for every thread of
/// the process). Asked once; false off Linux.
inline bool amx_usable() {
#if APEX_X86_KERNELS && defined(__linux__) && defined(__x86_64__)
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx & (1U << 24)) == 0 || (edx & (1U << 22)) == 0) return false;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & (1U << 27)) == 0) return false;
    unsigned low = 0, high = 0;  // XCR0, which OSXSAVE (CPUID 1, ECX bit 27) lets xgetbv read
    asm volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    constexpr unsigned kTileState = (1U << 17) | (1U << 18);  // XTILECFG, XTILEDATA
    if ((low & kTileState) != kTileState) return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
#else
  return false;
#endif
}
}  // namespace detail

/// Whether this CPU and its operating system run apex's kernels of level `isa` (the compiler's
/// checks, which include the OS's support for the vector registers), and this program has them
/// (`isa` ≤ APEX_MAX_KERNEL_ISA). kPortable always.
inline bool cpu_supports(KernelIsa isa) {
  if (static_cast<int>(isa) > APEX_MAX_KERNEL_ISA) return false;
#if APEX_X86_KERNELS
  switch (isa) {
    case KernelIsa::kAmx:
      return cpu_supports(KernelIsa::kAvx512Bf16) && detail::amx_usable();
    case KernelIsa::kAvx512Bf16: {
      // AVX512_BF16 from CPUID leaf 7, sub-leaf 1 (EAX bit 5).
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      return cpu_supports(KernelIsa::kAvx512) &&
             __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1U << 5)) != 0;
    }
    case KernelIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             cpu_supports(KernelIsa::kAvx2);
    case KernelIsa::kAvx2: {
      // F16C from CPUID leaf 1 (ECX bit 29): not every compiler's check knows it.
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1U << 29)) != 0;
    }
    case KernelIsa::kPortable:
      break;
  }
  return true;
#else
  return isa == KernelIsa::kPortable;
#endif
}

/// The widest level this CPU runs, asked once.
inline KernelIsa best_kernel_isa() {
  static const KernelIsa best = [] {
    if (cpu_supports(KernelIsa::kAmx)) return KernelIsa::kAmx;
    if (cpu_supports(KernelIsa::kAvx512Bf16)) return KernelIsa::kAvx512Bf16;
    if (cpu_supports(KernelIsa::kAvx512)) return KernelIsa::kAvx512;
    if (cpu_supports(KernelIsa::kAvx2)) return KernelIsa::kAvx2;
    return KernelIsa::kPortable;
  }();
  return best;
}

namespace detail {
/// The level the environment variable APEX_KERNEL_ISA names, or -1 when it is unset or names
/// none.
inline int kernel_isa_from_environment() {
  const char* name = std::getenv("APEX_KERNEL_ISA");  // NOLINT(concurrency-mt-unsafe): read once
  if (name == nullptr) return -1;
  for (const KernelIsa isa : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512,
                              KernelIsa::kAvx512Bf16, KernelIsa::kAmx}) {
    if (std::strcmp(name, to_string(isa)) == 0) return static_cast<int>(isa);
  }
  return -1;
}

/// The level in use (an int of KernelIsa), initialised from the environment, the macro or the
/// best level (see the top of cpu.hpp).
inline std::atomic<int>& kernel_isa_state() {
  static std::atomic<int> state = [] {
#if defined(APEX_KERNEL_ISA)
    static_assert(APEX_KERNEL_ISA >= 0 && APEX_KERNEL_ISA <= 4,
                  "APEX_KERNEL_ISA must be 0 (portable), 1 (avx2), 2 (avx512), 3 (avx512bf16) or "
                  "4 (amx)");
    int wanted = APEX_KERNEL_ISA;
#else
    int wanted = -1;
#endif
    if (kernel_isa_from_environment() >= 0) wanted = kernel_isa_from_environment();
    if (wanted >= 0 && cpu_supports(static_cast<KernelIsa>(wanted))) return wanted;
    return static_cast<int>(best_kernel_isa());
  }();
  return state;
}
}  // namespace detail

/// The level apex's kernels run on now.
inline KernelIsa kernel_isa() {
  return static_cast<KernelIsa>(detail::kernel_isa_state().load(std::memory_order_relaxed));
}

/// Makes apex's kernels run on level `isa` from now on (for every thread). Throws
/// std::invalid_argument, changing nothing, when `isa` is not a level or this CPU does not run it.
/// Not to be called while an apex call is running.
inline void set_kernel_isa(KernelIsa isa) {
  const int level = static_cast<int>(isa);
  APEX_CHECK(level >= 0 && level <= 4,
             "[set_kernel_isa] isa (" << level << ") must be a KernelIsa (0, 1, 2, 3 or 4)");
  APEX_CHECK(level <= APEX_MAX_KERNEL_ISA, "[set_kernel_isa] isa ("
                                               << to_string(isa)
                                               << ") must be a level this program compiles: "
                                                  "APEX_MAX_KERNEL_ISA is "
                                               << APEX_MAX_KERNEL_ISA);
  APEX_CHECK(cpu_supports(isa), "[set_kernel_isa] isa ("
                                    << to_string(isa)
                                    << ") must be one this CPU runs; the best it runs is "
                                    << to_string(best_kernel_isa()));
  detail::kernel_isa_state().store(level, std::memory_order_relaxed);
}

}  // namespace apex
