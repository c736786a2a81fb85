#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Consumes apex the three ways a user does and runs the quick-start example each time:
#   1. add_subdirectory from another CMake project (which must build none of apex's tests),
#   2. cmake --install to a prefix, then find_package(apex CONFIG REQUIRED),
#   3. a plain compiler command with -I include and Eigen's include directory.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== add_subdirectory"
cmake -S "$src/tests/package/add_subdirectory" -B "$work/sub" -DAPEX_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/sub" -j2 >/dev/null
if find "$work/sub" -name '*_test' -type f | grep -q .; then
  echo "a consumer built apex's tests" >&2
  exit 1
fi
"$work/sub/consumer"

echo "== install + find_package"
cmake -S "$src" -B "$work/apex" -DAPEX_BUILD_TESTS=OFF -DAPEX_BUILD_EXAMPLES=OFF \
  -DAPEX_BUILD_BENCHMARKS=OFF -DAPEX_INSTALL=ON >/dev/null
cmake --install "$work/apex" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/share/cmake/apex/apexConfigVersion.cmake"
cmake -S "$src/tests/package/find_package" -B "$work/found" -DAPEX_SOURCE_DIR="$src" \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/found" -j2 >/dev/null
"$work/found/consumer"

echo "== plain include"
g++ -std=c++17 -O1 -I "$work/prefix/include" -I /usr/include/eigen3 \
  "$src/examples/00_quickstart.cpp" -o "$work/plain"
"$work/plain"
echo "package checks passed"
