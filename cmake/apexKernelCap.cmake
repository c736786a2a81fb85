# SPDX-License-Identifier: MIT
# APEX_TEST_MAX_KERNEL_ISA: the macro APEX_MAX_KERNEL_ISA (include/apex/cpu.hpp) for apex's own
# programs (tests, examples, benchmarks, fuzz targets; never a consumer's): empty for every level
# (the default), 0-4 for that cap, or "host" for the widest level the machine running CMake has.
# A level the machine lacks is never run there, so "host" only leaves out code that would not
# run: the sanitised builds of CI (the debug preset, tests/fuzz/run.sh) use it to compile about
# half as much kernel code on a machine without AVX-512. Only for builds run where they are built.
set(APEX_TEST_MAX_KERNEL_ISA "" CACHE STRING
    "APEX_MAX_KERNEL_ISA for apex's own programs: empty (every level), 0-4, or host")
if(APEX_TEST_MAX_KERNEL_ISA STREQUAL "host")
  if(NOT DEFINED APEX_HOST_KERNEL_ISA)
    try_run(_apex_probe_ran _apex_probe_built "${CMAKE_CURRENT_BINARY_DIR}/kernel_isa_probe"
            "${CMAKE_CURRENT_SOURCE_DIR}/cmake/best_kernel_isa.cpp"
            CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${CMAKE_CURRENT_SOURCE_DIR}/include"
            LINK_LIBRARIES Eigen3::Eigen
            CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON
            COMPILE_OUTPUT_VARIABLE _apex_probe_log
            RUN_OUTPUT_VARIABLE _apex_probe_level)
    string(STRIP "${_apex_probe_level}" _apex_probe_level)
    if(NOT _apex_probe_built OR NOT _apex_probe_ran EQUAL 0
       OR NOT _apex_probe_level MATCHES "^[0-4]$")
      message(FATAL_ERROR "APEX_TEST_MAX_KERNEL_ISA=host: the probe of this machine's level "
                          "failed:\n${_apex_probe_log}")
    endif()
    set(APEX_HOST_KERNEL_ISA "${_apex_probe_level}" CACHE INTERNAL
        "The widest level of apex's kernels the machine that configured this build runs")
  endif()
  set(_apex_max_kernel_isa "${APEX_HOST_KERNEL_ISA}")
elseif(APEX_TEST_MAX_KERNEL_ISA MATCHES "^[0-4]$")
  set(_apex_max_kernel_isa "${APEX_TEST_MAX_KERNEL_ISA}")
elseif(NOT APEX_TEST_MAX_KERNEL_ISA STREQUAL "")
  message(FATAL_ERROR "APEX_TEST_MAX_KERNEL_ISA (${APEX_TEST_MAX_KERNEL_ISA}) must be empty, "
                      "0-4 or host")
endif()
if(DEFINED _apex_max_kernel_isa)
  message(STATUS "apex: own programs built with APEX_MAX_KERNEL_ISA=${_apex_max_kernel_isa}")
  add_compile_definitions(APEX_MAX_KERNEL_ISA=${_apex_max_kernel_isa})
endif()
