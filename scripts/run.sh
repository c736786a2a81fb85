#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The README's commands. Each first installs what is missing (scripts/install-deps.sh).
#   scripts/run.sh demo    build and run the worked examples of the documents (Parts 1 and 2)
#   scripts/run.sh test    build and run the whole test suite (release preset)
#   scripts/run.sh bench   build the benchmarks (-O3 -march=native) and run them
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

case "${1:-}" in
  demo)
    cmake --preset release >/dev/null
    cmake --build --preset release --target example_01_part1_worked_examples \
      example_04_part2_worked_examples
    ./build/release/examples/example_01_part1_worked_examples
    echo
    ./build/release/examples/example_04_part2_worked_examples
    ;;
  test)
    cmake --workflow --preset release
    ;;
  bench)
    shift
    cmake --workflow --preset bench
    ./build/bench/benchmarks/apex_bench "$@"
    ;;
  *)
    echo "usage: scripts/run.sh demo|test|bench [benchmark flags]" >&2
    exit 2
    ;;
esac
