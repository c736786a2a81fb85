// SPDX-License-Identifier: MIT
// Plain double-precision loops for §2 (embedding lookup, tied LM head), written for clarity.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>

namespace apex::reference {

using RefMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RefTokens = Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// X[b*S + s, j] = table[tokens(b, s), j] · scale (§2.2).
inline RefMatrix embed(const RefMatrix& table, const RefTokens& tokens, double scale) {
  const Eigen::Index batch = tokens.rows();
  const Eigen::Index seq = tokens.cols();
  RefMatrix out(batch * seq, table.cols());
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index s = 0; s < seq; ++s) {
      for (Eigen::Index j = 0; j < table.cols(); ++j) {
        out(b * seq + s, j) = table(static_cast<Eigen::Index>(tokens(b, s)), j) * scale;
      }
    }
  }
  return out;
}

/// logits[t, v] = Σ_j h[t, j] · table[v, j] (§2.5).
inline RefMatrix lm_head(const RefMatrix& h, const RefMatrix& table) {
  RefMatrix out(h.rows(), table.rows());
  for (Eigen::Index t = 0; t < h.rows(); ++t) {
    for (Eigen::Index v = 0; v < table.rows(); ++v) {
      double sum = 0.0;
      for (Eigen::Index j = 0; j < h.cols(); ++j) sum += h(t, j) * table(v, j);
      out(t, v) = sum;
    }
  }
  return out;
}

/// Σ_j |h[t, j] · table[v, j]|: the scale of the rounding error of each logit.
inline RefMatrix lm_head_magnitude(const RefMatrix& h, const RefMatrix& table) {
  RefMatrix out(h.rows(), table.rows());
  for (Eigen::Index t = 0; t < h.rows(); ++t) {
    for (Eigen::Index v = 0; v < table.rows(); ++v) {
      double sum = 0.0;
      for (Eigen::Index j = 0; j < h.cols(); ++j) sum += std::abs(h(t, j) * table(v, j));
      out(t, v) = sum;
    }
  }
  return out;
}

}  // namespace apex::reference
