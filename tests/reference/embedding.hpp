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

/// The gradient of L = Σ d_out ∘ embed(table, tokens, scale) by the table:
///   d_table[v, j] = scale · Σ_{(b, s) : tokens(b, s) = v} d_out[b*S + s, j].
inline RefMatrix embed_backward(const RefTokens& tokens, Eigen::Index vocab, double scale,
                                const RefMatrix& d_out) {
  RefMatrix d_table = RefMatrix::Zero(vocab, d_out.cols());
  for (Eigen::Index b = 0; b < tokens.rows(); ++b) {
    for (Eigen::Index s = 0; s < tokens.cols(); ++s) {
      const auto v = static_cast<Eigen::Index>(tokens(b, s));
      for (Eigen::Index j = 0; j < d_out.cols(); ++j) {
        d_table(v, j) += scale * d_out(b * tokens.cols() + s, j);
      }
    }
  }
  return d_table;
}

/// The gradients of L = Σ d_logits ∘ lm_head(h, table): d_h[t, j] = Σ_v d_logits[t, v]·table[v, j]
/// and d_table[v, j] = Σ_t d_logits[t, v]·h[t, j].
struct LmHeadGradients {
  RefMatrix d_h, d_table;
};
inline LmHeadGradients lm_head_backward(const RefMatrix& h, const RefMatrix& table,
                                        const RefMatrix& d_logits) {
  LmHeadGradients g{RefMatrix::Zero(h.rows(), h.cols()), RefMatrix::Zero(table.rows(), h.cols())};
  for (Eigen::Index t = 0; t < h.rows(); ++t) {
    for (Eigen::Index v = 0; v < table.rows(); ++v) {
      for (Eigen::Index j = 0; j < h.cols(); ++j) {
        g.d_h(t, j) += d_logits(t, v) * table(v, j);
        g.d_table(v, j) += d_logits(t, v) * h(t, j);
      }
    }
  }
  return g;
}

}  // namespace apex::reference
