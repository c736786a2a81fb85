// SPDX-License-Identifier: MIT
// Plain reference loops for attention (§6, §7, §8) and its masks (§10, §11), in double precision:
// the one softmax-attention loop every attention test compares with. They are written from the
// documents' formulas for clarity, not speed, and independently of the library: nothing here uses
// apex::PositionMask or apex::reference, so a test that compares the library with these loops
// checks the library's rule, not a copy of it.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace apex_test {

using Index = Eigen::Index;
using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VectorD = Eigen::VectorXd;

// ---- masks ---------------------------------------------------------------------------------

/// §10.2: mask[i, j] = 1 iff 0 <= i - j < W and j <= i.
inline bool sliding_window_allows(Index i, Index j, Index window) {
  return 0 <= i - j && i - j < window && j <= i;
}

/// §11.2: layer l is global iff l mod F_g = F_g - 1.
inline bool is_global(Index layer, Index global_every) {
  return layer % global_every == global_every - 1;
}

/// A masking rule on absolute positions, spelled out the way §10-§11 describe it.
struct MaskRule {
  bool causal = false;  ///< forbid keys after the query
  Index window = 0;     ///< 0: no window; otherwise keep only keys with i - j < window (§10.2)
  Index prefix = 0;     ///< positions [0, prefix) see each other in both directions (§11.1)
  Index chunk = 0;      ///< 0: none; otherwise keep only keys of the query's chunk of `chunk`
  /// null: no documents; otherwise (*documents)[p] is the document of position p, and a query
  /// sees only keys of its own document.
  const std::vector<Index>* documents = nullptr;
};

/// Which chunk of `size` positions holds position p: the largest c with c·size <= p.
inline Index chunk_index(Index p, Index size) {
  Index c = p / size;
  if (c * size > p) --c;  // division truncates towards zero; p may be negative
  return c;
}

/// Whether the query at absolute position i may attend to the key at absolute position j.
inline bool rule_allows(const MaskRule& rule, Index i, Index j) {
  // §11.1 "All prefix tokens attend to all prefix tokens": positions 0 .. P-1 on both sides.
  const bool query_in_prefix = 0 <= i && i < rule.prefix;
  const bool key_in_prefix = 0 <= j && j < rule.prefix;
  if (query_in_prefix && key_in_prefix) return true;
  if (rule.documents != nullptr &&
      (*rule.documents)[std::size_t(i)] != (*rule.documents)[std::size_t(j)]) {
    return false;  // attention stays inside a document
  }
  if (!rule.causal) return true;
  if (j > i) return false;                                    // causal: no key from the future
  if (rule.window > 0 && i - j >= rule.window) return false;  // §10.2: 0 <= i - j < W
  if (rule.chunk > 0 && chunk_index(i, rule.chunk) != chunk_index(j, rule.chunk)) return false;
  return true;
}

/// §11.1 on one sequence of positions 0 .. S-1: the APEX-1 mask of a layer. global = true is the
/// "full causal" regime, otherwise the "causal + window W" regime; the prefix P applies to both.
inline bool apex_layer_allows(Index i, Index j, bool global, Index prefix, Index window) {
  if (i < prefix && j < prefix) return true;  // prefix bidirectional
  if (j > i) return false;                    // causal
  if (global) return true;                    // full causal history
  return i - j < window;                      // local: the last W positions, itself included
}

// ---- attention -----------------------------------------------------------------------------

struct AttentionResult {
  MatrixD out;  ///< [S_q, d_v]
  VectorD lse;  ///< [S_q], natural log of Σ_j exp(score_ij) over the allowed keys; -inf if none
};

/// softmax(softcap(scale · Q Kᵀ) + bias, forbidden → -inf) V for one head (§6.2), row by row:
///   1. S = scale · Q Kᵀ (the whole S_q × S_k matrix, materialised),
///   2. soft-capping c·tanh(s/c) when softcap > 0,
///   3. keys with allowed(i, j) false are dropped; the bias (if given) is added to the rest,
///   4. softmax over the remaining keys, subtracting the row maximum first,
///   5. out_i = Σ_j p_ij v_j over the remaining keys only (a dropped key's value is never read).
/// A row with no remaining key (all forbidden, or every score -inf) is zeros with lse = -inf.
/// A sink (gpt-oss), when finite, is one more score of every row whose value is zero: it joins
/// the denominator of step 4 and the lse; a row with no remaining key is then zeros with
/// lse = sink.
///   q: [S_q, d_qk], k: [S_k, d_qk], v: [S_k, d_v], bias: null or [S_q, S_k]
inline AttentionResult attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                 const std::function<bool(Index, Index)>& allowed,
                                 const MatrixD* bias, double scale, double softcap,
                                 double sink = -std::numeric_limits<double>::infinity()) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const Index s_q = q.rows();
  const Index s_k = k.rows();
  MatrixD scores(s_q, s_k);
  for (Index i = 0; i < s_q; ++i) {
    for (Index j = 0; j < s_k; ++j) {
      if (!allowed(i, j)) {
        scores(i, j) = kNegInf;
        continue;
      }
      double dot = 0.0;
      for (Index c = 0; c < q.cols(); ++c) dot += q(i, c) * k(j, c);
      double s = scale * dot;
      if (softcap > 0.0) s = softcap * std::tanh(s / softcap);
      if (bias != nullptr) s += (*bias)(i, j);
      scores(i, j) = s;
    }
  }
  AttentionResult result{MatrixD::Zero(s_q, v.cols()), VectorD::Constant(s_q, kNegInf)};
  for (Index i = 0; i < s_q; ++i) {
    double row_max = sink;
    for (Index j = 0; j < s_k; ++j) row_max = std::max(row_max, scores(i, j));
    if (row_max == kNegInf) continue;  // nothing to attend to: zeros, lse = -inf
    double total = std::exp(sink - row_max);
    for (Index j = 0; j < s_k; ++j) {
      if (scores(i, j) != kNegInf) total += std::exp(scores(i, j) - row_max);
    }
    for (Index j = 0; j < s_k; ++j) {
      if (scores(i, j) == kNegInf) continue;
      const double p = std::exp(scores(i, j) - row_max) / total;
      for (Index c = 0; c < v.cols(); ++c) result.out(i, c) += p * v(j, c);
    }
    result.lse(i) = row_max + std::log(total);
  }
  return result;
}

/// §8.2: query head h reads key/value head ⌊h / G⌋, G = H_q / H_kv query heads per group
/// (H_kv = H_q is multi-head attention, H_kv = 1 multi-query attention).
inline Index kv_head_of(Index query_head, Index q_heads, Index kv_heads) {
  return query_head / (q_heads / kv_heads);
}

/// The sequences and heads that token-major matrices hold (see multi_head_attention).
struct HeadCounts {
  Index batch = 1;
  Index q_heads = 1;
  Index kv_heads = 1;
};

/// §7.2 and §8.2 before W_O: head h of sequence b is attention() of its queries against key/value
/// head kv_head_of(h), with no bias and no soft-capping; the heads' outputs sit side by side.
/// Every matrix is token-major, as a projection writes it: row b·S + s, head h in the columns
/// [h·d, (h + 1)·d).
///   q: [B·S_q, H_q·d_qk], k: [B·S_k, H_kv·d_qk], v: [B·S_k, H_kv·d_v] -> [B·S_q, H_q·d_v]
/// allowed(b, h, i, j): whether query row i of head h in sequence b may see key row j.
inline MatrixD multi_head_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                    const HeadCounts& heads,
                                    const std::function<bool(Index, Index, Index, Index)>& allowed,
                                    double scale) {
  const Index s_q = q.rows() / heads.batch;
  const Index s_k = k.rows() / heads.batch;
  const Index d_qk = q.cols() / heads.q_heads;
  const Index d_v = v.cols() / heads.kv_heads;
  MatrixD out(q.rows(), heads.q_heads * d_v);
  for (Index b = 0; b < heads.batch; ++b) {
    for (Index h = 0; h < heads.q_heads; ++h) {
      const Index g = kv_head_of(h, heads.q_heads, heads.kv_heads);
      const auto head_allowed = [&](Index i, Index j) { return allowed(b, h, i, j); };
      out.block(b * s_q, h * d_v, s_q, d_v) =
          attention(q.block(b * s_q, h * d_qk, s_q, d_qk), k.block(b * s_k, g * d_qk, s_k, d_qk),
                    v.block(b * s_k, g * d_v, s_k, d_v), head_allowed, nullptr, scale, 0.0)
              .out;
    }
  }
  return out;
}

}  // namespace apex_test
