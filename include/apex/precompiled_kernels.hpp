// SPDX-License-Identifier: MIT
// Compile the attention kernel once per program instead of once per translation unit (opt-in).
//
// Each translation unit that includes apex's attention (sdpa.hpp, the layers, the stack)
// compiles the tiled kernel for the types it uses: several seconds of g++ -O2 per combination of
// types. A program of many translation units can compile the common ones once:
//   1. compile every translation unit with the macro APEX_PRECOMPILED_KERNELS defined (with
//      CMake: link the target apex::precompiled_kernels, which does 1 and 2 for you);
//   2. compile one .cpp of your own that holds exactly
//        #define APEX_INSTANTIATE_KERNELS
//        #include <apex/precompiled_kernels.hpp>
//      with the same compiler flags as the rest (the same -march, the same APEX_ macros).
// The instances are listed in apex/detail/kernel_instances.hpp (float and double compute, with
// float, double, half and bfloat16 storage, and float compute with q8_0, q4_0 and fp8 storage in
// blocks of 128, without user rules; and the stack's draft-tree verification over float, double,
// half, bfloat16 and q8_0 caches), with the SIMD kernels they read rows through
// (APEX_ROW_TABLE_ELEMENTS, apex/detail/simd_kernels.hpp); everything else is compiled where it
// is used. Results are the same bit for bit: it is the same code, compiled once.
#pragma once

#include <apex/detail/kernel_instances.hpp>

#if defined(APEX_INSTANTIATE_KERNELS)
APEX_KERNEL_INSTANCES(APEX_KERNEL_DEFINE)
#endif
