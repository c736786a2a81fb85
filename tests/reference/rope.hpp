// SPDX-License-Identifier: MIT
// Plain double-precision reference for RoPE (§4) and YaRN's frequencies (§5), written straight
// from the formulas for clarity, not speed. The library's kernels are compared against these.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace apex::reference {

/// §4.3: θ_i = base^(-2i/d_r), i = 0 … d_r/2 − 1.
inline std::vector<double> rope_theta(long rotary_dim, double base) {
  std::vector<double> theta;
  for (long i = 0; i < rotary_dim / 2; ++i) {
    theta.push_back(
        std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)));
  }
  return theta;
}

/// §4.2: every pair of every head of row t turns by the angle positions[t]·θ_i,
///   [x'_a]   [cos −sin] [x_a]
///   [x'_b] = [sin  cos] [x_b]  (then × magnitude),
/// with (a, b) = (2i, 2i+1) for the interleaved pairing and (i, i + d_r/2) for half-split,
/// d_r = 2·theta.size(). Features from d_r to head_dim in each head are copied unchanged.
inline Eigen::MatrixXd rope(const Eigen::MatrixXd& x, const std::vector<long long>& positions,
                            const std::vector<double>& theta, long head_dim, bool half_split,
                            double magnitude = 1.0) {
  const long rotary_dim = 2 * static_cast<long>(theta.size());
  const long heads = static_cast<long>(x.cols()) / head_dim;
  Eigen::MatrixXd out = x;
  for (long t = 0; t < x.rows(); ++t) {
    const double m = static_cast<double>(positions[static_cast<std::size_t>(t)]);
    for (long h = 0; h < heads; ++h) {
      for (long i = 0; i < rotary_dim / 2; ++i) {
        const long a = h * head_dim + (half_split ? i : 2 * i);
        const long b = h * head_dim + (half_split ? i + rotary_dim / 2 : 2 * i + 1);
        const double angle = m * theta[static_cast<std::size_t>(i)];
        const double c = std::cos(angle);
        const double s = std::sin(angle);
        out(t, a) = magnitude * (c * x(t, a) - s * x(t, b));
        out(t, b) = magnitude * (s * x(t, a) + c * x(t, b));
      }
    }
  }
  return out;
}

/// YaRN's frequencies, steps 1–5 of SEED-NOTES.md ("YaRN, exactly").
inline std::vector<double> yarn_theta(long d, double base, double s, double original_context,
                                      double beta_fast, double beta_slow, bool truncate) {
  const double pi = 3.14159265358979323846;
  const auto corr = [&](double n) {
    return static_cast<double>(d) * std::log(original_context / (2.0 * pi * n)) /
           (2.0 * std::log(base));
  };
  double lo = corr(beta_fast);
  double hi = corr(beta_slow);
  if (truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(d - 1));
  if (hi == lo) hi += 0.001;
  std::vector<double> theta = rope_theta(d, base);
  for (std::size_t i = 0; i < theta.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
    const double keep = 1.0 - ramp;
    theta[i] = (theta[i] / s) * (1.0 - keep) + theta[i] * keep;
  }
  return theta;
}

}  // namespace apex::reference
