#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds apex's libFuzzer targets with clang (-fsanitize=fuzzer,address,undefined, assertions
# on) in build/fuzz and runs each one for the given number of seconds (default 60) on a copy of
# its seed corpus tests/fuzz/corpus/<target>/. Fails if any target reports a finding (a crash,
# undefined behaviour, an out-of-bounds access, a leak, a timeout, an allocation over the limit
# or a broken contract); the input that triggered it is kept in build/fuzz/findings/<target>/.
#
#   tests/fuzz/run.sh [seconds] [--update-corpus] [--only <target>] [--regressions]
#     --update-corpus   replace tests/fuzz/corpus/<target>/ with a fresh minimisation of the old
#                       seeds and what the run discovered: a smallest set of inputs (greedy set
#                       cover) reaching every edge that any of them reaches
#     --only <target>   one target, e.g. fuzz_attention
#     --regressions     instead of fuzzing, build tests/fuzz_regressions_test.cpp with clang's
#                       ASan + UBSan and run it, one process per test
# Environment: CXX (default clang++), APEX_FUZZ_JOBS (build jobs, and targets fuzzed at once;
# default 2).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
seconds=60
update=0
only=""
regressions=0
while [ $# -gt 0 ]; do
  case "$1" in
    --update-corpus) update=1 ;;
    --only) only="$2"; shift ;;
    --regressions) regressions=1 ;;
    [0-9]*) seconds="$1" ;;
    *) echo "usage: $0 [seconds] [--update-corpus] [--only <target>] [--regressions]" >&2; exit 2 ;;
  esac
  shift
done

cxx=${CXX:-clang++}
if ! command -v "$cxx" >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" -eq 0 ]; then
    echo "apex fuzz: installing clang and its sanitizer runtimes" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      clang libclang-rt-dev >/dev/null 2>&1 ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        clang-14 libclang-rt-14-dev >/dev/null
    command -v "$cxx" >/dev/null || cxx=clang++-14
  fi
fi
command -v "$cxx" >/dev/null || { echo "apex fuzz: $cxx not found (install clang)" >&2; exit 1; }

build="$src/build/fuzz"
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# Sanitizer flags come from tests/fuzz/CMakeLists.txt; CMAKE_CXX_FLAGS and the build type are
# cleared so that a reused build directory cannot add -DNDEBUG or other flags.
configure() {
  cmake -S "$src" -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE= \
    -DAPEX_BUILD_FUZZERS=ON -DAPEX_BUILD_TESTS=OFF -DAPEX_BUILD_EXAMPLES=OFF \
    -DAPEX_BUILD_BENCHMARKS=OFF -DAPEX_INSTALL=OFF -DAPEX_USE_OPENMP=OFF \
    -DAPEX_TEST_MAX_KERNEL_ISA=host \
    -DCMAKE_CXX_FLAGS= >/dev/null
}

if [ "$regressions" -eq 1 ]; then
  configure
  cmake --build "$build" -j "${APEX_FUZZ_JOBS:-2}" --target fuzz_regressions_clang
  # One process per test: a sanitizer report aborts the process it happens in.
  binary="$build/tests/fuzz/fuzz_regressions_clang"
  passed=0
  failures=()
  suite=""
  while IFS= read -r line; do
    case "$line" in
      "  "*) name="$suite${line#  }"; name="${name%%  #*}" ;;
      *) suite="${line%%  #*}"; continue ;;
    esac
    if "$binary" --gtest_filter="$name" >"$build/regression.log" 2>&1; then
      passed=$((passed + 1))
    else
      failures+=("$name")
      grep -a -m3 'runtime error\|ERROR: AddressSanitizer\|Failure\|threw' "$build/regression.log" |
        sed "s|^|  $name: |" >&2 || true
    fi
  done < <("$binary" --gtest_list_tests)
  echo "regressions: ${#failures[@]} failing: ${failures[*]:-none}"
  echo "${passed} passed, ${#failures[@]} failed"
  [ ${#failures[@]} -eq 0 ]
  exit
fi

echo "== building the fuzz targets ($cxx)"
start=$(now)
configure
targets=()
for source in "$src"/tests/fuzz/fuzz_*.cpp; do
  name=$(basename "$source" .cpp)
  [ -n "$only" ] && [ "$name" != "$only" ] && continue
  targets+=("$name")
done
[ ${#targets[@]} -gt 0 ] || { echo "apex fuzz: no target named $only" >&2; exit 2; }
if [ -n "$only" ]; then
  cmake --build "$build" -j "${APEX_FUZZ_JOBS:-2}" --target "$only"
else
  cmake --build "$build" -j "${APEX_FUZZ_JOBS:-2}" --target apex_fuzzers
fi
echo "build: $(elapsed "$start") s"

# final_stat <name> <log>: the value of libFuzzer's final statistic stat::<name>, or nothing.
final_stat() { grep -a "stat::$1" "$2" | tail -1 | awk '{print $2}' || true; }

# fuzz_one <target>: fuzzes one target (and, with --update-corpus, minimises its corpus). Its
# summary line goes to build/fuzz/<target>.summary; it fails on a finding.
fuzz_one() {
  local name=$1 corpus work findings start status took execs rate merged before
  corpus="$src/tests/fuzz/corpus/$name"
  work="$build/run/$name"
  findings="$build/findings/$name"
  rm -rf "$work" "$findings"
  mkdir -p "$work" "$findings"
  [ -d "$corpus" ] && cp -r "$corpus/." "$work/"
  echo "== $name: ${seconds} s"
  start=$(now)
  set +e
  "$build/tests/fuzz/$name" "$work" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=512 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$findings/" >"$build/$name.log" 2>&1
  status=$?
  set -e
  took=$(elapsed "$start")
  execs=$(final_stat number_of_executed_units "$build/$name.log")
  rate=$(final_stat average_exec_per_sec "$build/$name.log")
  if [ "$status" -ne 0 ]; then
    printf '%-16s FINDING  %8s exec/s %10s execs  %6s s\n' "$name" "${rate:-?}" "${execs:-?}" \
      "$took" >"$build/$name.summary"
    echo "--- $name found something (exit $status); the input is in $findings/" >&2
    grep -a -m1 -B2 -A30 'ERROR\|runtime error\|apex fuzz finding' "$build/$name.log" >&2 ||
      tail -40 "$build/$name.log" >&2
    return 1
  fi
  printf '%-16s ok       %8s exec/s %10s execs  %6s s\n' "$name" "${rate:-?}" "${execs:-?}" \
    "$took" >"$build/$name.summary"
  rmdir "$findings" 2>/dev/null || true
  if [ "$update" -eq 1 ]; then
    # Into an empty directory, so that the committed corpus does not only ever grow.
    merged="$build/merged/$name"
    rm -rf "$merged"
    mkdir -p "$merged" "$corpus"
    before=$(find "$corpus" -type f | wc -l)
    if "$build/tests/fuzz/$name" -set_cover_merge=1 -use_counters=0 -max_len=4096 \
      -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 "$merged" "$corpus" "$work" \
      >"$build/$name.merge.log" 2>&1; then
      rm -rf "$corpus"
      mv "$merged" "$corpus"
      echo "   corpus: $before -> $(find "$corpus" -type f | wc -l) files"
    else
      echo "--- $name: minimising the corpus failed (see build/fuzz/$name.merge.log)" >&2
      return 1
    fi
  fi
}

# The targets run APEX_FUZZ_JOBS at a time (libFuzzer runs one process on one core).
failed=0
running=0
for name in "${targets[@]}"; do
  if [ "$running" -ge "${APEX_FUZZ_JOBS:-2}" ]; then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$name" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || failed=1
  running=$((running - 1))
done

echo "== fuzz summary (${seconds} s per target)"
for name in "${targets[@]}"; do cat "$build/$name.summary"; done
if [ "$failed" -ne 0 ]; then
  echo "fuzzing found problems: see build/fuzz/<target>.log and build/fuzz/findings/" >&2
  exit 1
fi
