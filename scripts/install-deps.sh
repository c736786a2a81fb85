#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Makes sure the packages apex's build needs are present: Eigen 3.4 for the library itself,
# GoogleTest for the tests, Google Benchmark for the benchmarks, Open MPI for the optional
# component apex::mpi (apex/distributed/) and its tests, and for the optional Python module
# (python/) pybind11, Python's headers, numpy, and pytest, PyTorch and matplotlib for its tests
# and scripts (all for the system's python3, /usr/bin/python3, where Debian installs them). On Debian or Ubuntu, as root,
# it installs whatever is missing with apt-get; anywhere else it says what to install and fails.
#   scripts/install-deps.sh        what building, testing and benchmarking need
#   scripts/install-deps.sh --ci   also the tools of .ci/run: clang with its sanitizer and
#                                  fuzzer runtimes, clang-tidy, clang-format, doxygen, valgrind
set -euo pipefail

missing=()
have_header() { [ -f "/usr/include/$1" ] || [ -f "/usr/local/include/$1" ]; }
have_header eigen3/Eigen/Core || missing+=(libeigen3-dev)
have_header gtest/gtest.h || missing+=(libgtest-dev)
have_header benchmark/benchmark.h || missing+=(libbenchmark-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
compgen -G "/usr/lib/*/openmpi/include/mpi.h" >/dev/null || have_header mpi.h || missing+=(libopenmpi-dev)
command -v mpiexec >/dev/null || missing+=(openmpi-bin)
have_header pybind11/pybind11.h || missing+=(pybind11-dev)
compgen -G "/usr/include/python3*/Python.h" >/dev/null || missing+=(python3-dev)
have_module() { [ -x /usr/bin/python3 ] && /usr/bin/python3 -c "import $1" 2>/dev/null; }
have_module numpy || missing+=(python3-numpy)
have_module pytest || missing+=(python3-pytest)
have_module torch || missing+=(python3-torch)
have_module matplotlib || missing+=(python3-matplotlib)
if [ "${1:-}" = "--ci" ]; then
  command -v clang++ >/dev/null || missing+=(clang)
  compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null ||
    missing+=(libclang-rt-14-dev)
  command -v clang-tidy >/dev/null || missing+=(clang-tidy)
  command -v clang-format >/dev/null || missing+=(clang-format)
  command -v doxygen >/dev/null || missing+=(doxygen)
  command -v valgrind >/dev/null || missing+=(valgrind)
  command -v dpkg-deb >/dev/null || missing+=(dpkg)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
fi

[ ${#missing[@]} -eq 0 ] && exit 0

if command -v apt-get >/dev/null && [ "$(id -u)" -eq 0 ]; then
  echo "apex: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
  echo "apex: installing ${missing[*]} with sudo" >&2
  sudo apt-get update -qq
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  cat >&2 <<MSG
apex: missing build requirements: ${missing[*]}
  Debian/Ubuntu: apt-get install libeigen3-dev libgtest-dev libbenchmark-dev cmake g++
                 libopenmpi-dev openmpi-bin pybind11-dev python3-dev python3-numpy
                 python3-pytest python3-torch python3-matplotlib
  Fedora:        dnf install eigen3-devel gtest-devel google-benchmark-devel cmake gcc-c++
                 openmpi-devel
  macOS:         brew install eigen googletest google-benchmark cmake open-mpi
Eigen must be 3.4.x; CMake 3.25 or newer for the presets.
MSG
  exit 1
fi
