// SPDX-License-Identifier: MIT
// The merge of attention results over disjoint key sets into the result over their union
// (split-key decoding, window runs, the shards of ring attention): from each part's softmax
// statistics (m_c, l_c) or its log-sum-exp,
//   M = max_c m_c,  w_c = l_c·exp(m_c − M),  out = Σ_c w_c·out_c / Σ_c w_c,
// computed in double by detail::merge_rows (detail/online_softmax.hpp), the one place the rules
// live (a NaN part makes the row NaN, a part without keys is skipped, no keys at all gives zeros;
// the non-finite policy at the top of sdpa.hpp).
//   parts_out: [n·S_q, d_v], statistics [n, S_q] -> out: [S_q, d_v], statistics [S_q]
// Each call allocates n + d_v doubles.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/online_softmax.hpp>

#include <cmath>
#include <limits>

namespace apex {

namespace detail {

/// n partial results of `rows` rows, merged row by row in double by merge_rows (with the sink
/// of every row, -inf for none).
///   out_of(c, i) -> pointer to the d_v outputs of part c, row i; stats_of(c, i) -> its
///   SoftmaxStats<double>; write(i, stats) receives each merged row's statistics, whose outputs
///   go to out_row(i). Allocates n + d_v doubles.
template <class Scalar, class OutOf, class StatsOf, class OutRow, class Write>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (parts, rows, width)
void merge_parts(Index parts, Index rows, Index d_v, const OutOf& out_of, const StatsOf& stats_of,
                 const OutRow& out_row, const Write& write,
                 double sink = -std::numeric_limits<double>::infinity()) {
  Vector<double> scratch(parts + d_v);
  for (Index i = 0; i < rows; ++i) {
    const auto part_at = [&](Index c) {
      return PartRow<Scalar, double>{out_of(c, i), stats_of(c, i)};
    };
    write(i, merge_rows<double>(parts, d_v, part_at, out_row(i), scratch.data(),
                                scratch.data() + parts, sink));
  }
}

/// The shapes of an n-way merge: parts_out [n·S_q, d_v], a statistic [n, S_q] named `what`, and
/// out [S_q, d_v] (n = rows of the statistic, S_q = its columns).
struct MergeShapes {
  Index stacked_rows, d_v, stat_rows, stat_cols, out_rows, out_cols;
};

inline void check_merge_shapes(const MergeShapes& m, const char* op, const char* what) {
  const Index parts = m.stat_rows;
  const Index rows = m.stat_cols;
  APEX_CHECK(parts >= 1 && m.stacked_rows == checked_product(parts, rows, op, "n*S_q"),
             "[" << op << "] parts_out rows (" << m.stacked_rows << ") must be n*S_q = " << parts
                 << "*" << rows << " (n >= 1 parts, n and S_q from " << what << ")");
  APEX_CHECK(m.out_rows == rows && m.out_cols == m.d_v,
             "[" << op << "] output shape [" << m.out_rows << ", " << m.out_cols
                 << "] must be [S_q, d_v] = [" << rows << ", " << m.d_v << "]");
}

/// The whole of merge_attention_stats, with the sink of every row (-inf: none).
template <class DO, class DM, class DS>
void merge_stats(const Eigen::MatrixBase<DO>& parts_out, const Eigen::MatrixBase<DM>& parts_max,
                 const Eigen::MatrixBase<DS>& parts_sum, double sink,
                 RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> max,
                 VectorRef<typename DO::Scalar> sum, const char* op) {
  using Scalar = typename DO::Scalar;
  require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> po(parts_out.derived());
  const ConstRowRef<Scalar> pm(parts_max.derived());
  const ConstRowRef<Scalar> ps(parts_sum.derived());
  const Index parts = pm.rows();
  const Index rows = pm.cols();
  check_merge_shapes({po.rows(), po.cols(), parts, rows, out.rows(), out.cols()}, op, "parts_max");
  APEX_CHECK(ps.rows() == parts && ps.cols() == rows,
             "[" << op << "] parts_sum shape [" << ps.rows() << ", " << ps.cols()
                 << "] must equal parts_max shape [" << parts << ", " << rows << "]");
  APEX_CHECK(max.size() == rows && sum.size() == rows, "[" << op << "] max and sum lengths ("
                                                           << max.size() << ", " << sum.size()
                                                           << ") must equal S_q " << rows);
  merge_parts<Scalar>(
      parts, rows, po.cols(), [&](Index c, Index i) { return po.row(c * rows + i).data(); },
      [&](Index c, Index i) {
        return SoftmaxStats<double>{double(pm(c, i)), double(ps(c, i))};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const SoftmaxStats<double>& s) {
        max(i) = static_cast<Scalar>(s.max);
        sum(i) = static_cast<Scalar>(s.sum);
      },
      sink);
}

}  // namespace detail

/// Merges n attention results over disjoint key sets into the result over their union, exactly
/// at any logit magnitude, from each part's softmax statistics (SoftmaxStatsView, as sdpa writes
/// them; named apart from merge_attention, whose two-way form has as many arguments):
///   M = max_c m_c,  w_c = l_c·exp(m_c − M),  out = Σ_c w_c·out_c / Σ_c w_c,  (M, Σ_c w_c)
/// with the rules of detail::merge_rows (a NaN part makes the row NaN; a part without keys is
/// skipped; no keys at all gives zeros, max -inf and sum 0). Computed in double.
///   parts_out: [n·S_q, d_v], part c in rows [c·S_q, (c+1)·S_q); parts_max, parts_sum: [n, S_q]
///   -> out: [S_q, d_v], max, sum: [S_q]
/// out may be one part's block of parts_out (in place). Allocates n + d_v doubles.
template <class DO, class DM, class DS>
void merge_attention_stats(const Eigen::MatrixBase<DO>& parts_out,
                           const Eigen::MatrixBase<DM>& parts_max,
                           const Eigen::MatrixBase<DS>& parts_sum, RowRef<typename DO::Scalar> out,
                           VectorRef<typename DO::Scalar> max, VectorRef<typename DO::Scalar> sum) {
  detail::merge_stats(parts_out, parts_max, parts_sum, -std::numeric_limits<double>::infinity(),
                      out, max, sum, "merge_attention_stats");
}

/// merge_attention_stats for rows with an attention sink (SdpaParams::sinks; one head's rows, so
/// one sink): the parts, computed without the sink, are merged and the sink joins once, as one
/// more logit of zero value (detail::with_sink): with M = max(max_c m_c, sink),
///   out = Σ_c w_c·out_c / (e^(sink − M) + Σ_c w_c),  sum = e^(sink − M) + Σ_c w_c,
/// the result of sdpa over all the keys with that sink. A row without keys gets zeros and the
/// statistics (sink, 1). Throws if the sink is not finite. Shapes and allocation as above.
template <class DO, class DM, class DS>
void merge_attention_stats(const Eigen::MatrixBase<DO>& parts_out,
                           const Eigen::MatrixBase<DM>& parts_max,
                           const Eigen::MatrixBase<DS>& parts_sum, double sink,
                           RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> max,
                           VectorRef<typename DO::Scalar> sum) {
  APEX_CHECK(std::isfinite(sink), "[merge_attention_stats] sink (" << sink << ") must be finite");
  detail::merge_stats(parts_out, parts_max, parts_sum, sink, out, max, sum,
                      "merge_attention_stats");
}

/// Merges n attention results over disjoint key sets from their log-sum-exps:
///   L = max_c lse_c,  w_c = exp(lse_c − L),  out = Σ_c w_c·out_c / Σ_c w_c,  lse = L + log Σ w_c
/// (each part is the statistics (lse_c, 1); rules as above), computed in double. Exact up to the
/// rounding of the lse values themselves, which in float loses ~1e-3 of absolute precision at
/// logits near 1e4: for exactness at any magnitude use merge_attention_stats (above).
///   parts_out: [n·S_q, d_v] (part c in rows [c·S_q, (c+1)·S_q)), parts_lse: [n, S_q]
///   -> out: [S_q, d_v], lse: [S_q]
/// out and lse may be one part's block of parts_out and that part's lse (in place). Allocates
/// n + d_v doubles.
template <class DO, class DL>
void merge_attention(const Eigen::MatrixBase<DO>& parts_out, const Eigen::MatrixBase<DL>& parts_lse,
                     RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> lse) {
  using Scalar = typename DO::Scalar;
  detail::require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> po(parts_out.derived());
  const ConstRowRef<Scalar> pl(parts_lse.derived());
  const Index parts = pl.rows();
  const Index rows = pl.cols();
  detail::check_merge_shapes({po.rows(), po.cols(), parts, rows, out.rows(), out.cols()},
                             "merge_attention", "parts_lse");
  APEX_CHECK(lse.size() == rows,
             "[merge_attention] lse length (" << lse.size() << ") must equal S_q " << rows);
  detail::merge_parts<Scalar>(
      parts, rows, po.cols(), [&](Index c, Index i) { return po.row(c * rows + i).data(); },
      [&](Index c, Index i) {
        return detail::SoftmaxStats<double>{double(pl(c, i)), 1.0};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const detail::SoftmaxStats<double>& s) {
        lse(i) = static_cast<Scalar>(detail::log_sum_exp(s));
      });
}

/// Merges two attention results over disjoint key sets A and B into the result over A ∪ B:
///   lse = log(e^lse_a + e^lse_b),  out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b),
/// the n-way merge above with n = 2. This is what makes split-key (flash-decoding) attention
/// exact. A side whose lse is -inf (no allowed key) contributes nothing; if both are -inf the
/// row is zeros with lse -inf; if either is NaN (a NaN row of sdpa) the row is NaN.
///   out_a, out_b: [S_q, d_v], lse_a, lse_b: [S_q] -> out: [S_q, d_v], lse: [S_q]
/// out and lse may be out_a and lse_a, or out_b and lse_b (accumulate in place). Allocates
/// 2 + d_v doubles.
template <class DA, class LA, class DB, class LB>
void merge_attention(const Eigen::MatrixBase<DA>& out_a, const Eigen::MatrixBase<LA>& lse_a,
                     const Eigen::MatrixBase<DB>& out_b, const Eigen::MatrixBase<LB>& lse_b,
                     RowRef<typename DA::Scalar> out, VectorRef<typename DA::Scalar> lse) {
  using Scalar = typename DA::Scalar;
  detail::require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> a(out_a.derived());
  const ConstRowRef<Scalar> b(out_b.derived());
  const ConstVectorRef<Scalar> la(lse_a.derived());
  const ConstVectorRef<Scalar> lb(lse_b.derived());
  const Index rows = a.rows();
  APEX_CHECK(b.rows() == rows && b.cols() == a.cols(), "[merge_attention] out_b shape ["
                                                           << b.rows() << ", " << b.cols()
                                                           << "] must equal out_a shape [" << rows
                                                           << ", " << a.cols() << "]");
  APEX_CHECK(la.size() == rows && lb.size() == rows, "[merge_attention] lse_a and lse_b lengths ("
                                                         << la.size() << ", " << lb.size()
                                                         << ") must equal the rows " << rows);
  APEX_CHECK(out.rows() == rows && out.cols() == a.cols() && lse.size() == rows,
             "[merge_attention] output shape [" << out.rows() << ", " << out.cols() << "] / lse "
                                                << lse.size() << " must be [" << rows << ", "
                                                << a.cols() << "] / " << rows);
  detail::merge_parts<Scalar>(
      2, rows, a.cols(),
      [&](Index c, Index i) { return c == 0 ? a.row(i).data() : b.row(i).data(); },
      [&](Index c, Index i) {
        return detail::SoftmaxStats<double>{double(c == 0 ? la(i) : lb(i)), 1.0};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const detail::SoftmaxStats<double>& s) {
        lse(i) = static_cast<Scalar>(detail::log_sum_exp(s));
      });
}

}  // namespace apex
