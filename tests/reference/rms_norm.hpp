// SPDX-License-Identifier: MIT
// Plain loop for §3 (RMSNorm), written for clarity. The sum of squares and the division are
// done in long double: on x86-64 its exponent range (±16382) holds the square of any double,
// so this reference neither overflows nor underflows where the library has to rescale.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <limits>

namespace apex::reference {

using RmsMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RmsVector = Eigen::Matrix<double, Eigen::Dynamic, 1>;

/// out[t, j] = x[t, j] / sqrt(mean_j(x[t, :]²) + eps) · gamma[j] (§3.2).
inline RmsMatrix rms_norm(const RmsMatrix& x, const RmsVector& gamma, double eps) {
  RmsMatrix out(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    long double sum_squares = 0.0L;
    for (Eigen::Index j = 0; j < x.cols(); ++j) {
      sum_squares += static_cast<long double>(x(t, j)) * static_cast<long double>(x(t, j));
    }
    const long double mean_square = sum_squares / static_cast<long double>(x.cols());
    const long double rms = std::sqrt(mean_square + static_cast<long double>(eps));
    for (Eigen::Index j = 0; j < x.cols(); ++j) {
      out(t, j) = static_cast<double>(static_cast<long double>(x(t, j)) / rms *
                                      static_cast<long double>(gamma(j)));
    }
  }
  return out;
}

/// The gradients of L = Σ d_out ∘ rms_norm(x, γ) by x and γ, from the chain rule on the formula
/// above with σ_t = sqrt(mean(x[t, :]²) + ε): ∂out[t, j]/∂x[t, k] = γ_j (δ_jk − x_j x_k / (d σ²)) /
/// σ,
///   dx[t, k] = Σ_j d_out[t, j] γ_j (δ_jk − x_j x_k / (d σ_t²)) / σ_t,
///   dγ[j] = Σ_t d_out[t, j] x[t, j] / σ_t.
struct RmsGradients {
  RmsMatrix dx;
  RmsVector d_gamma;
};
inline RmsGradients rms_norm_backward(const RmsMatrix& x, const RmsVector& gamma, double eps,
                                      const RmsMatrix& d_out) {
  const Eigen::Index d = x.cols();
  RmsGradients g{RmsMatrix::Zero(x.rows(), d), RmsVector::Zero(d)};
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    double mean_square = 0.0;
    for (Eigen::Index j = 0; j < d; ++j) mean_square += x(t, j) * x(t, j) / double(d);
    const double sigma = std::sqrt(mean_square + eps);
    for (Eigen::Index k = 0; k < d; ++k) {
      for (Eigen::Index j = 0; j < d; ++j) {
        const double delta = j == k ? 1.0 : 0.0;
        g.dx(t, k) += d_out(t, j) * gamma(j) *
                      (delta - x(t, j) * x(t, k) / (double(d) * sigma * sigma)) / sigma;
      }
      g.d_gamma(k) += d_out(t, k) * x(t, k) / sigma;
    }
  }
  return g;
}

/// Whether long double has the exponent range this reference relies on for double inputs
/// whose squares leave the double range (x86-64: yes; where long double is double: no).
inline bool rms_reference_has_extended_range() {
  return std::numeric_limits<long double>::max_exponent >
         2 * std::numeric_limits<double>::max_exponent;
}

}  // namespace apex::reference
