// SPDX-License-Identifier: MIT
// The plain reference for the backward pass of attention, in double precision: the gradients of
// a loss L by the inputs of apex_test::attention (reference/attention.hpp), given dO = ∂L/∂out,
// written from the chain rule with every S_q × S_k matrix materialised. It recomputes the
// forward from the inputs alone (nothing of the library's forward or statistics), and forms
// D_i = Σ_j p_ij dp_ij from the weights, not from the output, so that it shares no shortcut with
// the tiled kernel it checks. Finite differences of apex_test::attention check it in turn
// (sdpa_backward_test).
#pragma once

#include "reference/attention.hpp"

#include <Eigen/Core>

#include <cmath>
#include <functional>
#include <limits>

namespace apex_test {

/// The gradients of one head: by q, k, v, the bias (d_bias = ∂L/∂bias, zeros where the key is
/// forbidden), and the sink.
struct AttentionGradients {
  MatrixD dq;      ///< [S_q, d_qk]
  MatrixD dk;      ///< [S_k, d_qk]
  MatrixD dv;      ///< [S_k, d_v]
  MatrixD d_bias;  ///< [S_q, S_k]
  double d_sink = 0.0;
};

/// ∂L/∂(q, k, v, bias, sink) of attention(q, k, v, allowed, bias, scale, softcap, sink), for
/// d_out = ∂L/∂out [S_q, d_v]. With x_ij = scale·q_i·k_j, the logit s_ij = c·tanh(x_ij / c) +
/// bias_ij (or x_ij + bias_ij without a soft-cap c), and p_ij the softmax over the keys that take
/// part (allowed, s_ij > -inf) and the sink:
///   dp_ij = d_out_i · v_j,  D_i = Σ_j p_ij dp_ij,  ds_ij = p_ij (dp_ij − D_i),
///   dx_ij = ds_ij · (1 − tanh²(x_ij / c)),
///   dq_i = scale Σ_j dx_ij k_j,  dk_j = scale Σ_i dx_ij q_i,  dv_j = Σ_i p_ij d_out_i,
///   d bias_ij = ds_ij,  d sink = −Σ_i p_sink,i D_i  (p_sink,i = e^sink / the row's denominator).
inline AttentionGradients attention_backward(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                             const std::function<bool(Index, Index)>& allowed,
                                             const MatrixD* bias, double scale, double softcap,
                                             double sink, const MatrixD& d_out) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const Index s_q = q.rows();
  const Index s_k = k.rows();
  MatrixD x = MatrixD::Zero(s_q, s_k);  // raw scores
  MatrixD logit(s_q, s_k);              // -inf: takes no part
  for (Index i = 0; i < s_q; ++i) {
    for (Index j = 0; j < s_k; ++j) {
      double dot = 0.0;
      for (Index c = 0; c < q.cols(); ++c) dot += q(i, c) * k(j, c);
      x(i, j) = scale * dot;
      double s = softcap > 0.0 ? softcap * std::tanh(x(i, j) / softcap) : x(i, j);
      if (bias != nullptr) s += (*bias)(i, j);
      logit(i, j) = allowed(i, j) ? s : kNegInf;
    }
  }
  AttentionGradients g{MatrixD::Zero(s_q, q.cols()), MatrixD::Zero(s_k, k.cols()),
                       MatrixD::Zero(s_k, v.cols()), MatrixD::Zero(s_q, s_k), 0.0};
  for (Index i = 0; i < s_q; ++i) {
    double row_max = sink;
    for (Index j = 0; j < s_k; ++j) row_max = std::max(row_max, logit(i, j));
    if (row_max == kNegInf) continue;  // no key and no sink: the output is a constant zero
    double total = std::exp(sink - row_max);
    for (Index j = 0; j < s_k; ++j) {
      if (logit(i, j) != kNegInf) total += std::exp(logit(i, j) - row_max);
    }
    Eigen::RowVectorXd p = Eigen::RowVectorXd::Zero(s_k);
    Eigen::RowVectorXd dp = Eigen::RowVectorXd::Zero(s_k);
    double d = 0.0;
    for (Index j = 0; j < s_k; ++j) {
      if (logit(i, j) == kNegInf) continue;
      p(j) = std::exp(logit(i, j) - row_max) / total;
      for (Index c = 0; c < v.cols(); ++c) dp(j) += d_out(i, c) * v(j, c);
      d += p(j) * dp(j);
    }
    g.d_sink -= std::exp(sink - row_max) / total * d;
    for (Index j = 0; j < s_k; ++j) {
      if (logit(i, j) == kNegInf) continue;
      const double ds = p(j) * (dp(j) - d);
      g.d_bias(i, j) = ds;
      double dx = ds;
      if (softcap > 0.0) {
        const double t = std::tanh(x(i, j) / softcap);
        dx *= 1.0 - t * t;
      }
      for (Index c = 0; c < q.cols(); ++c) {
        g.dq(i, c) += scale * dx * k(j, c);
        g.dk(j, c) += scale * dx * q(i, c);
      }
      for (Index c = 0; c < v.cols(); ++c) g.dv(j, c) += p(j) * d_out(i, c);
    }
  }
  return g;
}

}  // namespace apex_test
