#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds tests/concurrency_test.cpp with ThreadSanitizer (clang, -fsanitize=thread) in
# build/tsan and runs it; fails on any data race TSan reports.
#
# OpenMP is off in this build by default. GCC's libgomp is not built with ThreadSanitizer, so
# TSan cannot see the synchronisation inside its barriers and thread pool and reports races on
# memory that the OpenMP runtime itself orders (false positives); what this test checks is
# apex's own sharing between the caller's threads (thread-local scratch, the decode partials,
# shared layers and tables), which does not depend on OpenMP. APEX_TSAN_OPENMP=ON builds with
# clang's -fopenmp (LLVM's libomp) instead, for a look at the OpenMP paths.
#
#   tests/sanitize_thread.sh            build and run (2 build jobs)
# Environment: CXX (default clang++), APEX_TSAN_OPENMP (OFF), APEX_TSAN_JOBS (2).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
cxx=${CXX:-clang++}
command -v "$cxx" >/dev/null || cxx=clang++-14
command -v "$cxx" >/dev/null || { echo "sanitize_thread: clang++ not found" >&2; exit 1; }
openmp=${APEX_TSAN_OPENMP:-OFF}
build="$src/build/tsan"

start=$(date +%s.%N)
cmake -S "$src" -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DAPEX_USE_OPENMP="$openmp" -DAPEX_BUILD_TESTS=ON -DAPEX_BUILD_EXAMPLES=OFF \
  -DAPEX_BUILD_BENCHMARKS=OFF -DAPEX_INSTALL=OFF -DAPEX_TEST_MAX_KERNEL_ISA=host >/dev/null
cmake --build "$build" -j "${APEX_TSAN_JOBS:-2}" --target concurrency_test
built=$(date +%s.%N)

# halt_on_error: the first report fails the run; exitcode 66 is TSan's own.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$build/tests/concurrency_test"
done_at=$(date +%s.%N)
awk -v a="$start" -v b="$built" -v c="$done_at" \
  'BEGIN { printf "sanitize_thread: build %.1f s, run %.1f s, no data race reported\n", b - a, c - b }'
