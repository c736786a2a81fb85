// SPDX-License-Identifier: MIT
// Plain double-precision reference for DeepSeek Sparse Attention's lightning indexer
// (apex/indexer.hpp), written from its formulas: the Hadamard matrix built entry by entry, RoPE
// from reference/rope.hpp, LayerNorm and every product as loops, the top-k as a sort.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <vector>

#include "rope.hpp"

namespace apex::reference {

/// Sylvester's Hadamard matrix entry H(i, j) = (−1)^popcount(i & j).
inline double hadamard_entry(long i, long j) {
  return std::bitset<64>(static_cast<unsigned long long>(i & j)).count() % 2 == 0 ? 1.0 : -1.0;
}

/// Every width-wide block v of every row replaced by H v / √width.
inline Eigen::MatrixXd hadamard(const Eigen::MatrixXd& x, long width) {
  Eigen::MatrixXd out(x.rows(), x.cols());
  for (long t = 0; t < x.rows(); ++t) {
    for (long first = 0; first < x.cols(); first += width) {
      for (long i = 0; i < width; ++i) {
        double sum = 0.0;
        for (long j = 0; j < width; ++j) sum += hadamard_entry(i, j) * x(t, first + j);
        out(t, first + i) = sum / std::sqrt(static_cast<double>(width));
      }
    }
  }
  return out;
}

/// LayerNorm of every row: (x − μ) / √(σ² + ε) · γ + β, σ² the biased variance.
inline Eigen::MatrixXd layer_norm(const Eigen::MatrixXd& x, const Eigen::VectorXd& gamma,
                                  const Eigen::VectorXd& beta, double eps) {
  Eigen::MatrixXd out(x.rows(), x.cols());
  const double n = static_cast<double>(x.cols());
  for (long t = 0; t < x.rows(); ++t) {
    double mean = 0.0, var = 0.0;
    for (long i = 0; i < x.cols(); ++i) mean += x(t, i) / n;
    for (long i = 0; i < x.cols(); ++i) var += (x(t, i) - mean) * (x(t, i) - mean) / n;
    for (long i = 0; i < x.cols(); ++i)
      out(t, i) = (x(t, i) - mean) / std::sqrt(var + eps) * gamma(i) + beta(i);
  }
  return out;
}

/// The indexer's queries Had(RoPE(c_q·W_IQ)) [T, H·d_I] (RoPE on the first 2·|theta| features
/// of each head, row t at positions[t]).
inline Eigen::MatrixXd indexer_queries(const Eigen::MatrixXd& c_q, const Eigen::MatrixXd& w_q,
                                       const std::vector<long long>& positions,
                                       const std::vector<double>& theta, long head_dim,
                                       bool half_split) {
  return hadamard(rope(c_q * w_q, positions, theta, head_dim, half_split), head_dim);
}

/// The indexer's keys Had(RoPE(LayerNorm(h·W_IK))) [T, d_I].
inline Eigen::MatrixXd indexer_keys(const Eigen::MatrixXd& h, const Eigen::MatrixXd& w_k,
                                    const Eigen::VectorXd& gamma, const Eigen::VectorXd& beta,
                                    double eps, const std::vector<long long>& positions,
                                    const std::vector<double>& theta, bool half_split) {
  const long d = static_cast<long>(w_k.cols());
  return hadamard(rope(layer_norm(h * w_k, gamma, beta, eps), positions, theta, d, half_split), d);
}

/// I[t, s] = Σ_j w[t, j]·ReLU(q_{t,j}·k_s) / √(H·d_I) for s <= query_positions[t] (and for
/// every s < prefix when the row lies in the prefix [0, prefix)), −∞ elsewhere; w is h·W_IW
/// unscaled, k the keys of the row's batch.
inline Eigen::MatrixXd indexer_scores(const Eigen::MatrixXd& q, const Eigen::MatrixXd& w,
                                      const Eigen::MatrixXd& k,
                                      const std::vector<long long>& query_positions,
                                      long long prefix = 0) {
  const long heads = static_cast<long>(w.cols());
  const long d = static_cast<long>(k.cols());
  const double scale = 1.0 / std::sqrt(static_cast<double>(heads * d));
  Eigen::MatrixXd out(q.rows(), k.rows());
  for (long t = 0; t < q.rows(); ++t) {
    for (long s = 0; s < k.rows(); ++s) {
      const long long at = query_positions[static_cast<std::size_t>(t)];
      const bool in_prefix = at < prefix && s < prefix;  // §11.1: the prefix sees itself whole
      if (s > at && !in_prefix) {
        out(t, s) = -std::numeric_limits<double>::infinity();
        continue;
      }
      double sum = 0.0;
      for (long j = 0; j < heads; ++j) {
        double dot = 0.0;
        for (long i = 0; i < d; ++i) dot += q(t, j * d + i) * k(s, i);
        sum += w(t, j) * std::max(0.0, dot);
      }
      out(t, s) = scale * sum;
    }
  }
  return out;
}

/// The top k of one row of scores (larger first, the lower position on a tie, NaN as −∞),
/// among its finite-or-not entries s < visible, sorted ascending by position: a plain sort.
inline std::vector<long> top_k(const std::vector<double>& scores, long visible, long k) {
  std::vector<long> order(static_cast<std::size_t>(visible));
  std::iota(order.begin(), order.end(), 0L);
  const auto rank = [&](long i) {
    const double s = scores[static_cast<std::size_t>(i)];
    return std::isnan(s) ? -std::numeric_limits<double>::infinity() : s;
  };
  std::stable_sort(order.begin(), order.end(), [&](long a, long b) { return rank(a) > rank(b); });
  order.resize(static_cast<std::size_t>(std::min(k, visible)));
  std::sort(order.begin(), order.end());
  return order;
}

/// The dense mask [B, 1, S, S] (row-major, 1 = allowed) that allows query row t of batch b,
/// row b·S + t of `selected`, exactly the keys its row lists (positions, then -1): what sparse
/// attention over a selection must equal under a dense mask.
template <class Selection>
std::vector<char> selection_mask(const Selection& selected, long batch, long seq) {
  std::vector<char> allowed(static_cast<std::size_t>(batch * seq * seq), 0);
  for (long r = 0; r < static_cast<long>(selected.rows()); ++r) {
    for (long j = 0; j < static_cast<long>(selected.cols()) && selected(r, j) >= 0; ++j) {
      allowed[static_cast<std::size_t>(r * seq + static_cast<long>(selected(r, j)))] = 1;
    }
  }
  return allowed;
}

}  // namespace apex::reference
