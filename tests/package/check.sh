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

# Where MPI is installed, each consumer also builds and runs (on two ranks) a program of
# apex::mpi, through add_subdirectory and through find_package(apex COMPONENTS mpi).
mpi=OFF
if command -v mpiexec >/dev/null; then mpi=ON; fi
run_mpi() {
  OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    timeout 120 mpiexec -n 2 --oversubscribe "$1"
}

echo "== add_subdirectory"
cmake -S "$src/tests/package/add_subdirectory" -B "$work/sub" -DAPEX_SOURCE_DIR="$src" \
  -DAPEX_CHECK_MPI=$mpi >/dev/null
cmake --build "$work/sub" -j2 >/dev/null
if find "$work/sub" -name '*_test' -type f | grep -q .; then
  echo "a consumer built apex's tests" >&2
  exit 1
fi
"$work/sub/consumer"
if [ $mpi = ON ]; then run_mpi "$work/sub/mpi_consumer"; fi

echo "== install + find_package"
cmake -S "$src" -B "$work/apex" -DAPEX_BUILD_TESTS=OFF -DAPEX_BUILD_EXAMPLES=OFF \
  -DAPEX_BUILD_BENCHMARKS=OFF -DAPEX_BUILD_PYTHON=OFF -DAPEX_INSTALL=ON >/dev/null
cmake --install "$work/apex" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/share/cmake/apex/apexConfigVersion.cmake"
cmake -S "$src/tests/package/find_package" -B "$work/found" -DAPEX_SOURCE_DIR="$src" \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DAPEX_CHECK_MPI=$mpi >/dev/null
cmake --build "$work/found" -j2 >/dev/null
"$work/found/consumer"
if [ $mpi = ON ]; then run_mpi "$work/found/mpi_consumer"; fi

echo "== plain include"
g++ -std=c++17 -O1 -I "$work/prefix/include" -I /usr/include/eigen3 \
  "$src/examples/00_quickstart.cpp" -o "$work/plain"
"$work/plain"
# The Python module, where the release build made it: `cmake --install --component python`
# puts the package where the interpreter looks under the prefix, and it imports from there.
if [ -d "$src/build/release/python/apex" ]; then
  echo "== Python module: install --component python"
  cmake --install "$src/build/release" --component python --prefix "$work/py" >/dev/null
  site=$(find "$work/py" -type d -name apex -path '*-packages/apex' | head -n 1)
  test -n "$site" || { echo "the Python package was not installed" >&2; exit 1; }
  (cd "$work" && PYTHONPATH=$(dirname "$site") /usr/bin/python3 -c '
import apex, numpy as np
assert apex.__file__.startswith("'"$work/py"'"), apex.__file__
q = np.eye(4, dtype=np.float32)
assert np.allclose(apex.sdpa(q, q, q, causal=True)[0], q[0])
print("imported", apex.__file__)')
  # A plain install leaves the Python package out (the headers' install is unchanged).
  if find "$work/prefix" -name '_core*' | grep -q .; then
    echo "a plain cmake --install installed the Python module" >&2
    exit 1
  fi
fi
echo "package checks passed"
