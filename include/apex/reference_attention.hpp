// SPDX-License-Identifier: MIT
// The plain reference of scaled dot-product attention (§6.2, grouped heads §8.2), written for
// clarity and exactness in double: the oracle every fast path of apex (sdpa, the caches, the
// many-sequence calls, the layers) is tested against, kept beside the tiled kernel of
// detail/flash_attention.hpp as its simple version. It follows the non-finite policy at the top
// of sdpa.hpp.
//   s_ij = softcap(scale · q_i·k_j) + ALiBi + score rule + bias_ij (forbidden: -inf)
//   out[i] = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij))
//   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v] -> out: [B, H_q, S_q,
//   d_v]
// Allocates O(S_k · (d_qk + d_v)) doubles per head, never an S_q × S_k matrix.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace apex {

namespace detail {

/// One (query, key) score of the reference: the score (after scaling, soft-capping, ALiBi and the
/// score rule) plus the bias, or -inf when forbidden.
inline double masked_score(double score, bool allowed, double bias) {
  // A bias of -inf is a mask too: it forbids the key whatever the score (even NaN).
  if (!allowed || bias == -std::numeric_limits<double>::infinity()) {
    return -std::numeric_limits<double>::infinity();
  }
  return score + bias;
}

/// The softmax of one row of the reference, in double: `scores` holds s_j for the keys that take
/// part and -inf for the others (whose values are then never read), `sink` the row's sink (-inf:
/// none). Writes out (d_v values rounded once to TO) and returns the row's (max, sum), following
/// the non-finite policy: NaN or +inf among the scores → NaN; no key and no sink → zeros.
template <class TO, class OutRow>
SoftmaxStats<double> reference_row(const Vector<double>& scores, double sink,
                                   const RowMatrix<double>& vd, OutRow&& out) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  double row_max = kNegInf;
  for (Index j = 0; j < scores.size(); ++j) {
    // A NaN score sticks (std::max would drop it).
    if (std::isnan(scores(j)) || scores(j) > row_max) row_max = scores(j);
  }
  if (std::isnan(row_max) || row_max == std::numeric_limits<double>::infinity()) {
    out.setConstant(std::numeric_limits<TO>::quiet_NaN());
    return {kNaN, kNaN};
  }
  row_max = std::max(row_max, sink);
  if (row_max == kNegInf) {  // no key takes part, and no sink
    out.setZero();
    return {};
  }
  // Keys that take no part are skipped rather than weighted by zero, so that whatever their
  // values hold (even NaN) cannot reach the output.
  Eigen::Matrix<double, 1, Eigen::Dynamic> acc =
      Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(vd.cols());
  double total = std::exp(sink - row_max);  // 0 without a sink
  for (Index j = 0; j < scores.size(); ++j) {
    if (scores(j) == kNegInf) continue;
    const double weight = std::exp(scores(j) - row_max);
    acc += weight * vd.row(j);
    total += weight;
  }
  out = rounded<TO>((acc / total).array()).matrix();
  return {row_max, total};
}

}  // namespace detail

/// Plain, exact implementations that the fast paths are tested against.
namespace reference {

/// Plain attention, written for clarity and exactness: the oracle every fast path is tested
/// against. For each (batch, query head h) it uses key/value head h / (H_q / H_kv) (§8.2) and
/// computes, one query row i (position qp) at a time and in double precision, for every key j
/// (position kp)
///   s_ij = softcap(scale · q_i·k_j) + ALiBi's −slope_h·(qp − kp), then the user's score rule,
///          then + bias_ij; -inf unless the PositionMask, the dense mask and the user's mask
///          rule all allow the pair (and the bias is not -inf)
///   out[i] = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij))      (§6.2; no sink: softmax)
/// following the non-finite policy at the top of sdpa.hpp (a row in which no key takes part
/// gets zeros and a log-sum-exp of -inf, or of the sink).
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1] (natural log of the row's
///      denominator), stats (optional): the max and sum of SoftmaxStatsView.
/// Each input may have its own storage type (float, double, half, bfloat16; read-only views or
/// not; the bias TB) and the outputs theirs (TO): the elements are read as doubles and each result
/// is rounded once to TO. Outputs must not overlap the inputs. Allocates O(S_k · (d_qk + d_v))
/// doubles per head; never an S_q × S_k matrix. `rules` (attention_rules.hpp) are called for
/// every pair.
template <class Q, class K, class V, class TB, class TO, class A, class C, class S>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params,
          const AttentionRules<A, C, S>& rules, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  detail::require_storage_type<std::remove_const_t<Q>>();
  detail::require_storage_type<std::remove_const_t<K>>();
  detail::require_storage_type<std::remove_const_t<V>>();
  detail::require_storage_type<TB>();
  detail::require_storage_type<TO>();
  detail::check_sdpa(q, k, v, mask, params, out, lse, "sdpa", stats);
  const Index group = q.heads() / k.heads();
  const double scale = detail::softmax_scale(params, q.dim());
  const Index first_query = mask.positions.first_query_position(q.seq(), k.seq());
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (b, h, i, j) as everywhere here
  const auto score = [&](Index b, Index h, Index i, Index j, double dot) {
    const Index qp = first_query + i;
    const Index kp = mask.positions.key_offset + j;
    double s = scale * dot;
    if (params.softcap > 0.0) s = params.softcap * std::tanh(s / params.softcap);
    if (!params.alibi_slopes.empty()) s -= params.alibi_slopes[std::size_t(h)] * double(qp - kp);
    s = static_cast<double>(rules.score(b, h, qp, kp, s));
    const bool allowed = mask.positions.allows(qp, kp) && rules.allows(b, h, qp, kp) &&
                         (mask.allowed.empty() || mask.allowed.head(b, h)(i, j));
    const double bias = mask.bias.empty() ? 0.0 : double(mask.bias.head(b, h)(i, j));
    return detail::masked_score(s, allowed, bias);
  };
  for (Index b = 0; b < q.batch(); ++b) {
    for (Index h = 0; h < q.heads(); ++h) {
      const RowMatrix<double> qd = q.head(b, h).template cast<double>();
      const RowMatrix<double> kd = k.head(b, h / group).template cast<double>();
      const RowMatrix<double> vd = v.head(b, h / group).template cast<double>();
      const double sink = params.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                               : params.sinks[std::size_t(h)];
      Vector<double> scores(k.seq());
      for (Index i = 0; i < q.seq(); ++i) {
        for (Index j = 0; j < k.seq(); ++j) scores(j) = score(b, h, i, j, qd.row(i).dot(kd.row(j)));
        const detail::SoftmaxStats<double> row =
            detail::reference_row<TO>(scores, sink, vd, out.head(b, h).row(i));
        if (!lse.empty()) lse.head(b, h)(i, 0) = round_to<TO>(detail::log_sum_exp(row));
        if (!stats.max.empty()) stats.max.head(b, h)(i, 0) = round_to<TO>(row.max);
        if (!stats.sum.empty()) stats.sum.head(b, h)(i, 0) = round_to<TO>(row.sum);
      }
    }
  }
}

/// The reference without user rules (the PositionMask, the dense mask, the bias and SdpaParams).
template <class Q, class K, class V, class TB, class TO>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  reference::sdpa(q, k, v, mask, params, NoRules{}, out, lse, stats);
}

/// The reference with every input, the bias and the outputs of one type.
template <class Scalar>
void sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
          const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
          const SdpaParams& params, const HeadsView<Scalar>& out, const HeadsView<Scalar>& lse = {},
          const SoftmaxStatsView<Scalar>& stats = {}) {
  reference::sdpa<const Scalar, const Scalar, const Scalar, Scalar, Scalar>(q, k, v, mask, params,
                                                                            out, lse, stats);
}

/// Single-head convenience form of the reference: q [S_q, d_qk], k [S_k, d_qk], v [S_k, d_v]
/// -> [S_q, d_v]. Allocates the result.
template <class DQ, class DK, class DV>
RowMatrix<typename DQ::Scalar> sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v,
                                    const AttentionMask<typename DQ::Scalar>& mask = {},
                                    const SdpaParams& params = {}) {
  using Scalar = typename DQ::Scalar;
  RowMatrix<Scalar> result(q.rows(), v.cols());
  RowRef<Scalar> out(result);
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { reference::sdpa<Scalar>(args...); }, q, k,
                                   v, mask, params, out, nullptr);
  return result;
}

}  // namespace reference

}  // namespace apex
