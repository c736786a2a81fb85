// SPDX-License-Identifier: MIT
// Prints the widest level of apex's kernels this machine runs (an int of apex::KernelIsa):
// cmake/apexKernelCap.cmake runs it for APEX_TEST_MAX_KERNEL_ISA=host.
#include <apex/cpu.hpp>

#include <cstdio>

int main() {
  std::printf("%d\n", static_cast<int>(apex::best_kernel_isa()));
  return 0;
}
