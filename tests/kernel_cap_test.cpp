// SPDX-License-Identifier: MIT
// A program built with APEX_MAX_KERNEL_ISA (cpu.hpp) below the widest level: the levels above it
// are neither compiled nor chosen, set_kernel_isa refuses them by name, and attention on the
// levels that remain still equals the plain loops. This file is built with the cap 1 (AVX2) and,
// as kernel_cap0_test, with the cap 0 (Eigen's products only; tests/CMakeLists.txt); it sets the
// macro itself, before any apex header, so that a cap the build gives every test does not apply.
#ifndef APEX_TEST_CAP
#define APEX_TEST_CAP 1
#endif
#undef APEX_MAX_KERNEL_ISA
#define APEX_MAX_KERNEL_ISA APEX_TEST_CAP

#include <apex/cpu.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "attention_case.hpp"

namespace kernel_cap_test {
namespace {

using apex::KernelIsa;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Values;

static_assert(APEX_TEST_CAP == 0 || APEX_TEST_CAP == 1,
              "the tests below expect a cap under the AVX-512 levels");

constexpr KernelIsa kLevels[] = {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512,
                                 KernelIsa::kAvx512Bf16, KernelIsa::kAmx};

bool above_cap(KernelIsa isa) { return static_cast<int>(isa) > APEX_TEST_CAP; }

/// Whether the CPU has what kAvx2 needs, asked without apex: AVX2 and FMA from the compiler's
/// checks, F16C from CPUID leaf 1 (ECX bit 29).
bool cpu_has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1U << 29)) != 0;
#else
  return false;
#endif
}

TEST(KernelCap, LevelsAboveTheCapAreNeitherRunNorCompiled) {
  for (const KernelIsa isa : kLevels) {
    if (!above_cap(isa)) continue;
    SCOPED_TRACE(apex::to_string(isa));
    EXPECT_FALSE(apex::cpu_supports(isa));
    EXPECT_EQ(apex::detail::float_kernels(isa), nullptr);
    const KernelIsa before = apex::kernel_isa();
    try {
      apex::set_kernel_isa(isa);
      ADD_FAILURE() << "set_kernel_isa did not throw";
    } catch (const std::invalid_argument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(apex::to_string(isa)), std::string::npos) << message;
      EXPECT_NE(message.find("APEX_MAX_KERNEL_ISA is " + std::to_string(APEX_TEST_CAP)),
                std::string::npos)
          << message;
    }
    EXPECT_EQ(apex::kernel_isa(), before);
  }
}

TEST(KernelCap, TheBestLevelIsTheCpusUpToTheCap) {
  // APEX_X86_KERNELS is 0 where apex compiles no kernels of its own (EIGEN_DONT_VECTORIZE too).
  const KernelIsa expected = APEX_TEST_CAP >= 1 && APEX_X86_KERNELS != 0 && cpu_has_avx2()
                                 ? KernelIsa::kAvx2
                                 : KernelIsa::kPortable;
  EXPECT_EQ(apex::best_kernel_isa(), expected);
  if (std::getenv("APEX_KERNEL_ISA") == nullptr) {
    EXPECT_EQ(apex::kernel_isa(), expected);
  }
  const apex::detail::FloatKernels* kernels = apex::detail::float_kernels();
  if (expected == KernelIsa::kPortable) {
    EXPECT_EQ(kernels, nullptr);
  } else {
    ASSERT_NE(kernels, nullptr);
    EXPECT_EQ(kernels->isa, KernelIsa::kAvx2);
  }
}

/// apex::sdpa on one problem against the plain loops (attention_case.hpp's tolerance).
template <class Scalar>
void expect_sdpa_matches_loops(const Shape& shape, const apex_test::MaskRule& rule,
                               std::uint32_t seed) {
  Problem<Scalar> p(shape, Layout::kContiguous, seed, Values::kNormal);
  p.rule = rule;
  Outputs<Scalar> o(shape);
  apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, o.out.view(),
                     o.lse.view());
  apex::testing::expect_matches_loops(p, o, /*with_lse=*/true);
}

// Prefill (the tiled kernel, several blocks) and decoding (the streaming kernels) on the levels
// the cap leaves.
TEST(KernelCap, AttentionOnTheRemainingLevelsEqualsThePlainLoops) {
  const apex_test::MaskRule causal{true, 0, 0};
  const apex_test::MaskRule window{true, 40, 0};
  const Shape prefill{1, 4, 2, 200, 200, 64, 48};
  const Shape decode{2, 8, 2, 1, 700, 128, 64};
  expect_sdpa_matches_loops<float>(prefill, causal, 1);
  expect_sdpa_matches_loops<float>(prefill, window, 2);
  expect_sdpa_matches_loops<float>(decode, causal, 3);
  expect_sdpa_matches_loops<double>(prefill, causal, 4);
  expect_sdpa_matches_loops<double>(decode, window, 5);
}

}  // namespace
}  // namespace kernel_cap_test
