// SPDX-License-Identifier: MIT
// Scaled dot-product attention (§6), for one head or for [B, H, S, D] heads with grouped
// key/value heads (§8), plus the log-sum-exp merge of partial results over disjoint keys.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <limits>
#include <optional>

namespace apex {

/// Parameters of softmax(softcap(scale · Q Kᵀ) + mask) V.
struct SdpaParams {
  /// Multiplies Q Kᵀ. Unset: 1/√d_qk (§6.2), where d_qk is the width of Q and K.
  std::optional<double> scale;
  /// c > 0 maps each scaled score x to c·tanh(x/c) (Gemma 2's logit soft-capping) before the
  /// mask and the bias are applied, so a forbidden key stays forbidden. 0 turns it off.
  double softcap = 0.0;
};

/// Everything that can forbid or bias a score. The parts combine: a pair is attended only if the
/// position rule allows it and the dense mask (if any) is true; the bias (if any) is then added.
///
/// Dense masks are [B', H', S_q, S_k] views where B' is 1 (shared by the batch) or B, and H' is 1
/// (shared by the heads) or H_q. For a single [S_q, S_k] matrix use as_heads_view(matrix).
template <class Scalar>
struct AttentionMask {
  /// The position rule (causal, window, prefix, offsets); the default allows every pair.
  PositionMask positions;
  HeadsView<const bool> allowed;  ///< true = may attend; empty = no dense mask
  HeadsView<const Scalar> bias;   ///< added to the scores; -inf forbids; empty = no bias
};

namespace detail {

inline void check_mask_view_shape(Index batch, Index heads, Index rows, Index cols, Index b,
                                  Index h, Index s_q, Index s_k, const char* op, const char* name) {
  APEX_CHECK(batch == 1 || batch == b, "[" << op << "] " << name << " batch (" << batch
                                           << ") must be 1 or the batch size " << b);
  APEX_CHECK(heads == 1 || heads == h, "[" << op << "] " << name << " heads (" << heads
                                           << ") must be 1 or the number of query heads " << h);
  APEX_CHECK(rows == s_q && cols == s_k, "[" << op << "] " << name << " shape [" << rows << ", "
                                             << cols << "] must be [S_q, S_k] = [" << s_q << ", "
                                             << s_k << "]");
}

/// Every precondition of sdpa on [B, H, S, D] views; throws before anything is written.
template <class Scalar>
void check_sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
                const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
                const SdpaParams& params, const HeadsView<Scalar>& out,
                const HeadsView<Scalar>& lse, const char* op) {
  check_extents(q, op, "q shape");
  check_extents(k, op, "k shape");
  check_extents(v, op, "v shape");
  check_extents(out, op, "output shape");
  check_extents(lse, op, "log-sum-exp shape");
  check_extents(mask.allowed, op, "allowed mask shape");
  check_extents(mask.bias, op, "bias shape");
  APEX_CHECK(k.dim() == q.dim(), "[" << op << "] key width d_qk (" << k.dim()
                                     << ") must equal the query width " << q.dim());
  APEX_CHECK(v.seq() == k.seq(), "[" << op << "] value length S_k (" << v.seq()
                                     << ") must equal the key length " << k.seq());
  APEX_CHECK(k.batch() == q.batch() && v.batch() == q.batch(),
             "[" << op << "] key/value batch (" << k.batch() << ", " << v.batch()
                 << ") must equal the query batch " << q.batch());
  APEX_CHECK(v.heads() == k.heads(), "[" << op << "] value heads (" << v.heads()
                                         << ") must equal the key heads " << k.heads());
  APEX_CHECK(k.heads() >= 1 && q.heads() % k.heads() == 0,
             "[" << op << "] num_q_heads (" << q.heads() << ") must be a multiple of num_kv_heads ("
                 << k.heads() << ")");
  APEX_CHECK(params.scale || q.dim() >= 1,
             "[" << op << "] d_qk (" << q.dim() << ") must be >= 1 for the default scale");
  APEX_CHECK(!params.scale || std::isfinite(*params.scale),
             "[" << op << "] scale (" << *params.scale << ") must be finite");
  APEX_CHECK(std::isfinite(params.softcap) && params.softcap >= 0.0,
             "[" << op << "] softcap (" << params.softcap << ") must be >= 0 (0 = off)");
  check_position_mask(mask.positions, q.seq(), k.seq(), op);
  if (!mask.allowed.empty()) {
    check_mask_view_shape(mask.allowed.batch(), mask.allowed.heads(), mask.allowed.seq(),
                          mask.allowed.dim(), q.batch(), q.heads(), q.seq(), k.seq(), op,
                          "allowed mask");
  }
  if (!mask.bias.empty()) {
    check_mask_view_shape(mask.bias.batch(), mask.bias.heads(), mask.bias.seq(), mask.bias.dim(),
                          q.batch(), q.heads(), q.seq(), k.seq(), op, "bias");
  }
  APEX_CHECK(out.batch() == q.batch() && out.heads() == q.heads() && out.seq() == q.seq() &&
                 out.dim() == v.dim(),
             "[" << op << "] output shape [" << out.batch() << ", " << out.heads() << ", "
                 << out.seq() << ", " << out.dim() << "] must be [B, H_q, S_q, d_v] = ["
                 << q.batch() << ", " << q.heads() << ", " << q.seq() << ", " << v.dim() << "]");
  APEX_CHECK(lse.empty() || (lse.batch() == q.batch() && lse.heads() == q.heads() &&
                             lse.seq() == q.seq() && lse.dim() == 1),
             "[" << op << "] log-sum-exp shape [" << lse.batch() << ", " << lse.heads() << ", "
                 << lse.seq() << ", " << lse.dim() << "] must be [B, H_q, S_q, 1] = [" << q.batch()
                 << ", " << q.heads() << ", " << q.seq() << ", 1]");
}

inline double softmax_scale(const SdpaParams& params, Index d_qk) {
  return params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(d_qk));
}

/// One (query, key) score after scaling, soft-capping, masking and bias; -inf when forbidden.
/// `allowed_row` and `bias_row` may be null.
inline double masked_score(double scaled, double softcap, bool allowed, double bias) {
  // A bias of -inf is a mask too: it forbids the key whatever the score (even NaN).
  if (!allowed || bias == -std::numeric_limits<double>::infinity()) {
    return -std::numeric_limits<double>::infinity();
  }
  if (softcap > 0.0) scaled = softcap * std::tanh(scaled / softcap);
  return scaled + bias;
}

/// Runs a [B, H, S, D] attention kernel on single-head matrices (B = H = 1).
template <class Scalar, class Kernel>
void sdpa_on_matrices(Kernel&& kernel, const ConstRowRef<Scalar>& q, const ConstRowRef<Scalar>& k,
                      const ConstRowRef<Scalar>& v, const AttentionMask<Scalar>& mask,
                      const SdpaParams& params, RowRef<Scalar>& out, Scalar* lse) {
  const auto view = [](const ConstRowRef<Scalar>& m) {
    return HeadsView<const Scalar>(m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride());
  };
  const HeadsView<Scalar> out_view(out.data(), 1, 1, out.rows(), out.cols(), 0, 0,
                                   out.outerStride());
  const HeadsView<Scalar> lse_view =
      lse ? HeadsView<Scalar>(lse, 1, 1, q.rows(), 1, 0, 0, 1) : HeadsView<Scalar>();
  kernel(view(q), view(k), view(v), mask, params, out_view, lse_view);
}

}  // namespace detail

/// Plain, exact implementations that the fast paths are tested against.
namespace reference {

/// Plain attention, written for clarity and exactness: the oracle every fast path is tested
/// against. For each (batch, query head h) it uses key/value head h / (H_q / H_kv) (§8.2) and
/// computes, one query row at a time and in double precision,
///   out[i] = Σ_j softmax_j(softcap(scale · q_i·k_j) + bias_ij, forbidden → -inf) v_j   (§6.2)
/// A row whose every key is forbidden gets zeros and a log-sum-exp of -inf.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1] (natural log of Σ_j exp score)
/// Allocates O(S_k · (d_qk + d_v)) doubles per head; never an S_q × S_k matrix.
template <class Scalar>
void sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
          const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
          const SdpaParams& params, const HeadsView<Scalar>& out,
          const HeadsView<Scalar>& lse = {}) {
  detail::require_supported_scalar<Scalar>();
  detail::check_sdpa(q, k, v, mask, params, out, lse, "sdpa");
  const Index s_q = q.seq();
  const Index s_k = k.seq();
  const Index group = q.heads() / k.heads();
  const double scale = detail::softmax_scale(params, q.dim());
  const Index first_query = mask.positions.first_query_position(s_q, s_k);
  for (Index b = 0; b < q.batch(); ++b) {
    for (Index h = 0; h < q.heads(); ++h) {
      const RowMatrix<double> qd = q.head(b, h).template cast<double>();
      const RowMatrix<double> kd = k.head(b, h / group).template cast<double>();
      const RowMatrix<double> vd = v.head(b, h / group).template cast<double>();
      auto out_head = out.head(b, h);
      Vector<double> scores(s_k);
      for (Index i = 0; i < s_q; ++i) {
        double row_max = -std::numeric_limits<double>::infinity();
        for (Index j = 0; j < s_k; ++j) {
          const bool allowed =
              mask.positions.allows(first_query + i, mask.positions.key_offset + j) &&
              (mask.allowed.empty() || mask.allowed.head(b, h)(i, j));
          const double bias = mask.bias.empty() ? 0.0 : double(mask.bias.head(b, h)(i, j));
          scores(j) =
              detail::masked_score(scale * qd.row(i).dot(kd.row(j)), params.softcap, allowed, bias);
          // A NaN score sticks (std::max would drop it).
          if (std::isnan(scores(j)) || scores(j) > row_max) row_max = scores(j);
        }
        if (std::isnan(row_max)) {  // a NaN among the allowed scores: the row is NaN
          out_head.row(i).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
          if (!lse.empty()) lse.head(b, h)(i, 0) = std::numeric_limits<Scalar>::quiet_NaN();
          continue;
        }
        if (row_max == -std::numeric_limits<double>::infinity()) {
          out_head.row(i).setZero();
          if (!lse.empty()) lse.head(b, h)(i, 0) = -std::numeric_limits<Scalar>::infinity();
          continue;
        }
        // Forbidden keys are skipped rather than weighted by zero, so that whatever their
        // values hold (even NaN) cannot reach the output.
        Eigen::Matrix<double, 1, Eigen::Dynamic> acc =
            Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(vd.cols());
        double total = 0.0;
        for (Index j = 0; j < s_k; ++j) {
          if (scores(j) == -std::numeric_limits<double>::infinity()) continue;
          const double weight = std::exp(scores(j) - row_max);
          acc += weight * vd.row(j);
          total += weight;
        }
        out_head.row(i) = (acc / total).template cast<Scalar>();
        if (!lse.empty()) lse.head(b, h)(i, 0) = static_cast<Scalar>(row_max + std::log(total));
      }
    }
  }
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

/// Scaled dot-product attention over [B, H, S, D] heads, grouped-query aware (§6.2, §8.2):
/// query head h of batch b attends with key/value head h / (H_q / H_kv), so H_kv = H_q is
/// multi-head attention, 1 < H_kv < H_q grouped-query attention and H_kv = 1 multi-query
/// attention. For each query row i,
///   out[i] = Σ_j softmax_j(softcap(scale · q_i·k_j) + bias_ij, forbidden → -inf) v_j
/// with scale = 1/√d_qk unless SdpaParams says otherwise. Causality and windows are measured in
/// absolute positions (see PositionMask for the alignment of S_q queries against S_k keys).
/// A query row whose every key is forbidden gets zeros (and lse = -inf), never NaN.
/// Non-finite input, on this path and the reference alike: a forbidden key never reaches the
/// output, whatever its key, value or bias hold (NaN included); a NaN score among a row's
/// allowed keys (NaN in q_i, in an allowed k_j or in bias_ij) makes that row's out and lse NaN;
/// a NaN or ±inf value v_j reaches exactly the rows that give key j a non-zero weight. Other
/// rows, heads and batches are unaffected. A bias of -inf forbids the key.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1], the natural-log
///      log-sum-exp of each row's scores, for merge_attention.
/// Any layout HeadsView can describe works (contiguous per head, or heads side by side as a
/// projection writes them). out must not overlap q, k or v.
/// Runs the tiled kernel of detail/flash_attention.hpp: keys streamed in blocks with an online
/// softmax, blocks the PositionMask forbids skipped, split-key (flash-decoding) when all queries
/// fit in one block. Extra memory is O(block²) per thread whatever S is (about 0.7 MiB per
/// thread for float, d = 128), kept in thread-local buffers that grow on first use and are then
/// reused, so repeated calls allocate nothing; decoding also keeps its per-chunk partial results
/// on the calling thread. Threads: detail::parallel_for (OpenMP when enabled); the result is
/// bit-identical for any number of threads.
template <class Scalar>
void sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
          const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
          const SdpaParams& params, const HeadsView<Scalar>& out,
          const HeadsView<Scalar>& lse = {}) {
  detail::require_supported_scalar<Scalar>();
  detail::check_sdpa(q, k, v, mask, params, out, lse, "sdpa");
  detail::flash_sdpa<Scalar>(q, k, v, mask.positions, mask.allowed, mask.bias,
                             detail::softmax_scale(params, q.dim()), params.softcap, out, lse);
}

/// Single-head form: q [S_q, d_qk], k [S_k, d_qk], v [S_k, d_v] -> out [S_q, d_v] (§6.2).
/// Inputs that are not row-major are copied once.
template <class DQ, class DK, class DV>
void sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
          const Eigen::MatrixBase<DV>& v, const AttentionMask<typename DQ::Scalar>& mask,
          const SdpaParams& params, RowRef<typename DQ::Scalar> out) {
  using Scalar = typename DQ::Scalar;
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { sdpa<Scalar>(args...); }, q, k, v, mask,
                                   params, out, nullptr);
}

/// Single-head form that also returns each row's log-sum-exp: lse [S_q].
template <class DQ, class DK, class DV>
void sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
          const Eigen::MatrixBase<DV>& v, const AttentionMask<typename DQ::Scalar>& mask,
          const SdpaParams& params, RowRef<typename DQ::Scalar> out,
          VectorRef<typename DQ::Scalar> lse) {
  using Scalar = typename DQ::Scalar;
  APEX_CHECK(lse.size() == q.rows(),
             "[sdpa] lse length (" << lse.size() << ") must equal S_q " << q.rows());
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { sdpa<Scalar>(args...); }, q, k, v, mask,
                                   params, out, lse.data());
}

/// Value-returning single-head form. Allocates the [S_q, d_v] result.
template <class DQ, class DK, class DV>
RowMatrix<typename DQ::Scalar> sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v,
                                    const AttentionMask<typename DQ::Scalar>& mask = {},
                                    const SdpaParams& params = {}) {
  RowMatrix<typename DQ::Scalar> result(q.rows(), v.cols());
  sdpa(q, k, v, mask, params, RowRef<typename DQ::Scalar>(result));
  return result;
}

/// Merges two attention results over disjoint key sets A and B into the result over A ∪ B:
///   lse = log(e^lse_a + e^lse_b),  out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b).
/// This is what makes split-key (flash-decoding) attention exact. A side whose lse is -inf
/// (no allowed key) contributes nothing; if both are -inf the row is zeros with lse -inf; if
/// either is NaN (a NaN row of sdpa) the row is NaN.
///   out_a, out_b: [S_q, d_v], lse_a, lse_b: [S_q] -> out: [S_q, d_v], lse: [S_q]
/// out and lse may alias out_a and lse_a (accumulate in place). Allocates nothing.
template <class DA, class LA, class DB, class LB>
void merge_attention(const Eigen::MatrixBase<DA>& out_a, const Eigen::MatrixBase<LA>& lse_a,
                     const Eigen::MatrixBase<DB>& out_b, const Eigen::MatrixBase<LB>& lse_b,
                     RowRef<typename DA::Scalar> out, VectorRef<typename DA::Scalar> lse) {
  using Scalar = typename DA::Scalar;
  detail::require_supported_scalar<Scalar>();
  const Index rows = out_a.rows();
  APEX_CHECK(out_b.rows() == rows && out_b.cols() == out_a.cols(),
             "[merge_attention] out_b shape [" << out_b.rows() << ", " << out_b.cols()
                                               << "] must equal out_a shape [" << rows << ", "
                                               << out_a.cols() << "]");
  APEX_CHECK(lse_a.size() == rows && lse_b.size() == rows,
             "[merge_attention] lse_a and lse_b lengths (" << lse_a.size() << ", " << lse_b.size()
                                                           << ") must equal the rows " << rows);
  APEX_CHECK(out.rows() == rows && out.cols() == out_a.cols() && lse.size() == rows,
             "[merge_attention] output shape [" << out.rows() << ", " << out.cols() << "] / lse "
                                                << lse.size() << " must be [" << rows << ", "
                                                << out_a.cols() << "] / " << rows);
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  for (Index i = 0; i < rows; ++i) {
    const Scalar la = lse_a(i);
    const Scalar lb = lse_b(i);
    if (std::isnan(la) || std::isnan(lb)) {  // a NaN row stays NaN, as sdpa leaves it
      out.row(i).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      lse(i) = std::numeric_limits<Scalar>::quiet_NaN();
      continue;
    }
    const Scalar m = std::max(la, lb);
    if (m == kNegInf) {
      out.row(i).setZero();
      lse(i) = kNegInf;
      continue;
    }
    const Scalar wa = std::exp(la - m);
    const Scalar wb = std::exp(lb - m);
    const Scalar total = wa + wb;
    out.row(i) = (wa / total) * out_a.row(i) + (wb / total) * out_b.row(i);
    lse(i) = m + std::log(total);
  }
}

}  // namespace apex
