// SPDX-License-Identifier: MIT
// cpu.hpp: the instruction-set level of apex's own kernels, chosen at run time, by the
// environment variable APEX_KERNEL_ISA, or by set_kernel_isa.
#include <apex/cpu.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace cpu_test {
namespace {

using apex::KernelIsa;

constexpr KernelIsa kLevels[] = {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512,
                                 KernelIsa::kAvx512Bf16, KernelIsa::kAmx};

/// Restores the level a test found when it ends.
class KeepLevel {
 public:
  KeepLevel() : level_(apex::kernel_isa()) {}
  KeepLevel(const KeepLevel&) = delete;
  KeepLevel& operator=(const KeepLevel&) = delete;
  ~KeepLevel() { apex::set_kernel_isa(level_); }

 private:
  KernelIsa level_;
};

TEST(Cpu, TheEnvironmentChoosesTheLevel) {
  const char* wanted = std::getenv("APEX_KERNEL_ISA");
  if (wanted == nullptr) {
    EXPECT_EQ(apex::kernel_isa(), apex::best_kernel_isa());
    return;
  }
  for (const KernelIsa isa : kLevels) {
    if (std::string(wanted) != apex::to_string(isa)) continue;
    if (!apex::cpu_supports(isa)) {
      GTEST_SKIP() << "APEX_KERNEL_ISA=" << wanted << ", which this CPU does not run";
    }
    EXPECT_EQ(apex::kernel_isa(), isa);
    return;
  }
  ADD_FAILURE() << "APEX_KERNEL_ISA=" << wanted << " names no level";
}

TEST(Cpu, TheBestLevelIsOneTheCpuRuns) {
  EXPECT_TRUE(apex::cpu_supports(KernelIsa::kPortable));
  EXPECT_TRUE(apex::cpu_supports(apex::best_kernel_isa()));
  for (const KernelIsa isa : kLevels) {
    if (static_cast<int>(isa) > static_cast<int>(apex::best_kernel_isa())) {
      EXPECT_FALSE(apex::cpu_supports(isa)) << apex::to_string(isa);
    }
  }
  // A wider level implies the narrower ones.
  if (apex::cpu_supports(KernelIsa::kAmx)) {
    EXPECT_TRUE(apex::cpu_supports(KernelIsa::kAvx512Bf16));
  }
  if (apex::cpu_supports(KernelIsa::kAvx512Bf16)) {
    EXPECT_TRUE(apex::cpu_supports(KernelIsa::kAvx512));
  }
  if (apex::cpu_supports(KernelIsa::kAvx512)) {
    EXPECT_TRUE(apex::cpu_supports(KernelIsa::kAvx2));
  }
}

TEST(Cpu, SetKernelIsaTakesEveryLevelTheCpuRunsAndRejectsTheOthers) {
  const KeepLevel keep;
  for (const KernelIsa isa : kLevels) {
    if (apex::cpu_supports(isa)) {
      apex::set_kernel_isa(isa);
      EXPECT_EQ(apex::kernel_isa(), isa);
    } else {
      const KernelIsa before = apex::kernel_isa();
      try {
        apex::set_kernel_isa(isa);
        ADD_FAILURE() << "set_kernel_isa(" << apex::to_string(isa) << ") did not throw";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(apex::to_string(isa)), std::string::npos) << e.what();
      }
      EXPECT_EQ(apex::kernel_isa(), before);
    }
  }
}

TEST(Cpu, SetKernelIsaRejectsAValueThatIsNoLevel) {
  const KeepLevel keep;
  const KernelIsa before = apex::kernel_isa();
  for (const int value : {-1, 5, 42}) {
    try {
      apex::set_kernel_isa(static_cast<KernelIsa>(value));
      ADD_FAILURE() << value << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("isa (" + std::to_string(value) + ")"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(apex::kernel_isa(), before);
  }
}

TEST(Cpu, LevelsHaveNames) {
  EXPECT_STREQ(apex::to_string(KernelIsa::kPortable), "portable");
  EXPECT_STREQ(apex::to_string(KernelIsa::kAvx2), "avx2");
  EXPECT_STREQ(apex::to_string(KernelIsa::kAvx512), "avx512");
  EXPECT_STREQ(apex::to_string(KernelIsa::kAvx512Bf16), "avx512bf16");
  EXPECT_STREQ(apex::to_string(KernelIsa::kAmx), "amx");
}

}  // namespace
}  // namespace cpu_test
