// SPDX-License-Identifier: MIT
// Small helpers shared by the benchmarks: rate counters and deterministic random inputs.
#pragma once

#include <apex/config.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace apex::bench {

/// GBps counter: `bytes_per_iteration` (bytes read + bytes written by one iteration) times the
/// number of iterations, per second, in units of 1e9 bytes. Set it after the timed loop.
inline benchmark::Counter gbps(const benchmark::State& state, double bytes_per_iteration) {
  return benchmark::Counter(bytes_per_iteration * static_cast<double>(state.iterations()) / 1e9,
                            benchmark::Counter::kIsRate);
}

/// GFLOPS counter: `flops_per_iteration` times the number of iterations, per second, in units
/// of 1e9 floating-point operations (a multiply-add counts as two).
inline benchmark::Counter gflops(const benchmark::State& state, double flops_per_iteration) {
  return benchmark::Counter(flops_per_iteration * static_cast<double>(state.iterations()) / 1e9,
                            benchmark::Counter::kIsRate);
}

/// A rows x cols row-major matrix of uniform values in [lo, hi), the same for the same seed.
template <class Scalar>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed = 1, double lo = -1.0,
                                double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(dist(rng));
  return m;
}

/// A vector of n uniform values in [lo, hi), the same for the same seed.
template <class Scalar>
Vector<Scalar> random_vector(Index n, std::uint64_t seed = 1, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Vector<Scalar> v(n);
  for (Index i = 0; i < n; ++i) v(i) = static_cast<Scalar>(dist(rng));
  return v;
}

/// `count` lengths >= 1 that sum to `total` (>= count): the gaps between count − 1 distinct
/// cut points drawn uniformly from [1, total), the same for the same seed.
inline std::vector<Index> random_lengths(Index total, Index count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Index> cuts{0, total};
  std::uniform_int_distribution<Index> cut(1, total - 1);
  while (static_cast<Index>(cuts.size()) < count + 1) {
    const Index c = cut(rng);
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<Index> lengths;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) lengths.push_back(cuts[i + 1] - cuts[i]);
  return lengths;
}

/// A field of /proc/self/status in KiB (VmRSS, VmHWM), or -1 if unavailable.
inline double status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0)
      return std::stod(line.substr(field.size() + 1));
  }
  return -1.0;
}

/// Resets the peak resident set (VmHWM) to the current one; false if the kernel refuses.
inline bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace apex::bench
