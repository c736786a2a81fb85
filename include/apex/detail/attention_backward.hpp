// SPDX-License-Identifier: MIT
// The backward pass of the tiled kernel (sdpa_backward.hpp): the gradients of attention by its
// inputs, recomputed block by block from the forward's log-sum-exp (FlashAttention-2's backward:
// Dao 2023, Algorithm 2), never holding an S_q × S_k matrix.
//
// WHAT IT COMPUTES. With s_ij the forward's logit of the raw score x_ij = scale·q_i·k_j (the score
// terms of score_terms.hpp, forbidden → -inf), lse_i and o_i the forward's results and do_i the
// loss's gradient by o_i:
//   p_ij  = exp(s_ij − lse_i)            the weights (0 for a key that takes no part)
//   dp_ij = do_i · v_j
//   D_i   = do_i · o_i                   (= Σ_j p_ij dp_ij: a sink adds no value)
//   ds_ij = p_ij (dp_ij − D_i)           the gradient by the logit, which is d bias_ij
//   dx_ij = ds_ij · s'_ij                s' = ds_ij/dx_ij, the soft-cap's and the score rule's
//                                        derivative (ScoreTerms::transform_with_slope; else 1)
//   dq_i  = scale · Σ_j dx_ij k_j     dk_j = scale · Σ_i dx_ij q_i     dv_j = Σ_i p_ij do_i
//   d sink_h = −Σ_(b, i) exp(sink_h − lse_i) · D_i
// with dk and dv summed over the G query heads of a key/value head.
//
// THREE PASSES, each one parallel loop of tasks that own what they write: no two tasks add to
// the same element, and each task sums in a fixed order, so the result is bit-identical for any
// number of threads (the order that FlashAttention's deterministic mode enforces with locks is
// here the order of a loop inside one task):
//   keys     a task per (b, kv head, block of Bk keys) writes the block's dK and dV rows, summed
//            over the query blocks that see it, in ascending order: per pair of blocks
//            S = Qs·Kᵀ, dP = dO·Vᵀ, dV += Pᵀ·dO, dK += dXᵀ·Qs   (Qs = scale·Q, so dK is scaled)
//   queries  a task per (b, kv head, block of Bq queries), its G heads stacked into M = G·Bq rows
//            as in the forward, writes their dQ rows, summed over the visible key blocks in
//            ascending order: S, dP, dQ += dX·K; and each row's share of d sink, added up in
//            task order after the loop
//   bias     only when d_bias is asked for: a task per (b', h', block of Bq rows) of d_bias sums
//            dS over the (b, h) that share those rows (a broadcast bias), in order, one key
//            block at a time: S, dP
// The keys and queries passes each recompute the scores (as Triton's tutorial and FlashAttention-3
// split dK/dV from dQ): seven products per pair of blocks instead of five with an atomic dQ, in
// exchange for no contention, no S × S buffer and no per-thread copy of dQ.
//
// The visible keys, the block classification (PositionMask and the user's classifier) and the
// score terms are the forward's, so a block the forward skips is skipped here too, unread.
//
// COMPUTE TYPE as the forward's (attention_plan.hpp, COMPUTE TYPE): double when an input or the
// gradients are double or a parameter does not fit float; a float pass that meets a raw score or
// a gradient that is not finite is redone in double.
//
// MEMORY: a task's buffers in its thread's scratch (ScratchSlot::kBackwardTile), for M stacked
// rows (M = G·⌊256 / G⌋, at least G) and Bk = 128 keys, in scalars of C:
//   M·(d_qk + d_v + 2)               Qs, dO, lse and D of the stacked rows
//   Bk·(d_qk + d_v)                  K and V widened
//   5·M·Bk                           S then P, dP then dS, s' then dX, the position tile, d bias
//   Bk + max(M, Bk)·d_qk + Bk·d_v    ALiBi's distances, the dK (or dQ) and dV accumulators
// (about 1.2 MiB of float at d_qk = d_v = 128, whatever S), and on the calling thread a byte per
// task (ScratchSlot::kTaskFlags) and, with sinks, G doubles per query task
// (ScratchSlot::kBackwardSinks). Eigen's products may allocate their packing buffers where these
// exceed EIGEN_STACK_ALLOCATION_LIMIT (128 KiB).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/score_terms.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, a tile's position (b, heads, rows)
namespace apex::detail {

/// Block sizes of the backward pass; tests pass small ones to put boundaries where they want.
struct BackwardBlocking {
  Index stacked_rows = 256;  ///< target M = G·Bq; Bq = max(1, stacked_rows / G)
  Index key_block = 128;     ///< Bk
};

/// A backward problem: the forward's problem P (its keys in one segment), the forward's results
/// and the loss's gradient by the output, each of its own storage type.
template <class P, class TO, class TL, class TD>
struct BackwardProblem {
  using Forward = P;
  /// Whether some input is double, so that the pass computes in double from the start.
  static constexpr bool kWide = kWideInput<P> || std::is_same_v<TO, double> ||
                                std::is_same_v<TL, double> || std::is_same_v<TD, double>;
  P forward;
  HeadsView<const TO> out;    ///< o [B, H_q, S_q, d_v]
  HeadsView<const TL> lse;    ///< [B, H_q, S_q, 1]
  HeadsView<const TD> d_out;  ///< do [B, H_q, S_q, d_v]
};

/// What the backward pass writes: dq, dk, dv as q, k, v; d_bias as the bias (empty: not asked
/// for); d_sinks [H_q] (null: not asked for).
template <class TG>
struct BackwardOutputs {
  HeadsView<TG> dq, dk, dv, d_bias;
  double* d_sinks = nullptr;
};

/// How a backward call is cut into tasks, from the shapes and the blocking alone.
struct BackwardPlan {
  Index kv_heads = 0;      ///< H_kv
  Index pairs = 0;         ///< B·H_kv
  Index query_block = 1;   ///< Bq
  Index query_blocks = 0;  ///< ⌈S_q / Bq⌉
  Index key_block = 1;     ///< Bk
  Index key_blocks = 0;    ///< ⌈S_k / Bk⌉
  Index rows = 0;          ///< M = G·Bq
};

template <class P>
BackwardPlan plan_backward(const P& p, const BackwardBlocking& blocking) {
  BackwardPlan plan;
  plan.kv_heads = p.segments[0].k.heads();
  plan.pairs = p.q.batch() * plan.kv_heads;
  plan.query_block = clamp_block(blocking.stacked_rows / p.group, p.s_q);
  plan.query_blocks = (p.s_q + plan.query_block - 1) / plan.query_block;
  plan.key_block = clamp_block(blocking.key_block, p.s_k);
  plan.key_blocks = (p.s_k + plan.key_block - 1) / plan.key_block;
  plan.rows = p.group * plan.query_block;
  return plan;
}

/// A task's buffers (see MEMORY), carved from the thread's ScratchSlot::kBackwardTile.
template <class C>
struct GradientBuffers {
  C *qs, *d_out, *lse, *delta;          // M·d_qk, M·d_v, M, M
  C *k, *v;                             // Bk·d_qk, Bk·d_v
  C *s, *ds, *slope, *position, *bias;  // M·Bk each
  C* distance;                          // Bk
  C *acc, *acc_v;                       // max(M, Bk)·d_qk (dK or dQ), Bk·d_v (dV)
};

template <class C>
GradientBuffers<C> gradient_buffers(const BackwardPlan& plan, Index d_qk, Index d_v) {
  const Index m = plan.rows;
  const Index n = plan.key_block;
  const Index sizes[] = {m * d_qk,
                         m * d_v,
                         m,
                         m,
                         n * d_qk,
                         n * d_v,
                         m * n,
                         m * n,
                         m * n,
                         m * n,
                         m * n,
                         n,
                         std::max(m, n) * d_qk,
                         n * d_v};
  constexpr Index kPad = ThreadScratch::kAlignment / static_cast<Index>(sizeof(C));
  Index total = 0;
  for (const Index size : sizes) total += (size + kPad - 1) / kPad * kPad;
  C* next = ThreadScratch::local().get<C>(ScratchSlot::kBackwardTile, total);
  GradientBuffers<C> buf{};
  C** fields[] = {&buf.qs,   &buf.d_out,    &buf.lse, &buf.delta, &buf.k,
                  &buf.v,    &buf.s,        &buf.ds,  &buf.slope, &buf.position,
                  &buf.bias, &buf.distance, &buf.acc, &buf.acc_v};
  for (Index i = 0; i < Index{std::size(sizes)}; ++i) {
    *fields[i] = next;
    next += (sizes[i] + kPad - 1) / kPad * kPad;
  }
  return buf;
}

/// One tile of the backward pass: `heads` query heads from first_head, of batch b, stacked over
/// query rows [q0, q0 + bq) as the forward stacks them (row r = g·bq + i), and the weights and
/// logit gradients of those rows against one block of keys at a time (gradients), which the
/// passes then multiply into dK, dV or dQ.
template <class C, class BP>
class GradientTile {
 public:
  using P = typename BP::Forward;
  using Block = KeyBlock<typename P::Key, typename P::Value>;

  GradientTile(const BP& bp, const GradientBuffers<C>& buf, Index b, Index first_head, Index heads,
               Index q0, Index bq)
      : bp_(bp),
        p_(bp.forward),
        terms_(bp.forward),
        buf_(buf),
        b_(b),
        h0_(first_head),
        q0_(q0),
        bq_(bq),
        heads_(heads),
        rows_(heads * bq) {
    load_rows();
  }

  /// Stacked rows M = heads·bq.
  Index rows() const { return rows_; }
  /// Query head and query row of stacked row r.
  Index head_of(Index r) const { return h0_ + r / bq_; }
  Index query_of(Index r) const { return q0_ + r % bq_; }
  /// Whether a float pass met a raw score that is not finite (the call is redone in double).
  bool saw_non_finite_score() const { return non_finite_score_; }

  /// For the keys of `keys`: P (buffer s), dS (buffer ds) and dX (dx()) of every stacked row,
  /// with their rows read by load(), which returns {k, v}, the block's n rows of K and V
  /// (contiguous, in C). False, with nothing read or computed, when the block is forbidden for
  /// every row (the forward skips it too, unread).
  template <class Load>
  bool gradients(const Block& keys, const Load& load) {
    const Index qp0 = p_.first_query + q0_;
    const PositionRange q{qp0, qp0 + bq_};
    const PositionRange kr{keys.position(), keys.position() + keys.n};
    const BlockCoverage coverage = classify_block(p_.positions, q.begin, q.end, kr.begin, kr.end);
    if (coverage == BlockCoverage::kNone) return false;
    const BlockCoverage user = user_coverage(p_.rules, b_, h0_, heads_, q, kr);
    if (user == BlockCoverage::kNone) return false;
    n_ = keys.n;
    const auto [k, v] = load();
    matmul_serial<C, Eigen::ColMajor>(rows_, n_, p_.d_qk, buf_.qs, p_.d_qk, k, p_.d_qk, buf_.s, n_);
    if constexpr (std::is_same_v<C, float>) {
      non_finite_score_ = non_finite_score_ || !all_finite(buf_.s, rows_, n_, n_);
    }
    logits(keys, coverage, user);
    matmul_serial<C, Eigen::ColMajor>(rows_, n_, p_.d_v, buf_.d_out, p_.d_v, v, p_.d_v, buf_.ds,
                                      n_);
    weights();
    return true;
  }

  /// The gradients by the raw scores of the last block, rows × n (the logits' where no term
  /// curves).
  const C* dx() const { return terms_.curves() ? buf_.slope : buf_.ds; }
  /// The gradients by the logits of the last block (d bias), rows × n.
  const C* ds() const { return buf_.ds; }

  /// The keys pass's products for the last block: dv (n × d_v) += Pᵀ·dO and dk (n × d_qk) +=
  /// dXᵀ·Qs (scaled, as Qs is).
  void add_key_gradients(C* dk, C* dv) const {
    matmul_serial<C, Eigen::RowMajor, Eigen::ColMajor>(n_, p_.d_v, rows_, buf_.s, n_, buf_.d_out,
                                                       p_.d_v, dv, p_.d_v, true);
    matmul_serial<C, Eigen::RowMajor, Eigen::ColMajor>(n_, p_.d_qk, rows_, dx(), n_, buf_.qs,
                                                       p_.d_qk, dk, p_.d_qk, true);
  }
  /// The queries pass's product for the last block: dq (rows × d_qk) += dX·K (not yet scaled).
  void add_query_gradients(C* dq, const C* k) const {
    matmul_serial<C, Eigen::RowMajor>(rows_, p_.d_qk, n_, dx(), n_, k, p_.d_qk, dq, p_.d_qk, true);
  }

  /// Stacked row r's share of d sink: −exp(sink − lse_r) · D_r (0 without sinks).
  double sink_share(Index r) const {
    if (p_.sinks == nullptr) return 0.0;
    const C sink = static_cast<C>(p_.sinks[head_of(r)]);
    return -static_cast<double>(std::exp(sink - buf_.lse[r]) * buf_.delta[r]);
  }

 private:
  /// Qs = scale·Q, dO, lse and D = dO·O (in C) of every stacked row.
  void load_rows() {
    const C scale = static_cast<C>(p_.scale);
    for (Index g = 0; g < heads_; ++g) {
      const Index h = h0_ + g;
      Eigen::Map<RowMatrix<C>>(buf_.qs + g * bq_ * p_.d_qk, bq_, p_.d_qk) =
          p_.q.head(b_, h).middleRows(q0_, bq_).template cast<C>() * scale;
      Eigen::Map<RowMatrix<C>> d_out(buf_.d_out + g * bq_ * p_.d_v, bq_, p_.d_v);
      d_out = bp_.d_out.head(b_, h).middleRows(q0_, bq_).template cast<C>();
      for (Index i = 0; i < bq_; ++i) {
        buf_.lse[g * bq_ + i] = widen_to<C>(bp_.lse.head(b_, h)(q0_ + i, 0));
        buf_.delta[g * bq_ + i] =
            (d_out.row(i).array() * bp_.out.head(b_, h).row(q0_ + i).array().template cast<C>())
                .sum();
      }
    }
  }

  template <class To, class T>
  static To widen_to(T x) {
    return static_cast<To>(static_cast<compute_t<std::remove_const_t<T>>>(x));
  }

  /// The score terms of every row (ScoreTerms: transform, with the slopes s' where the terms
  /// curve, then forbid), as the forward's tile applies them.
  void logits(const Block& keys, BlockCoverage coverage, BlockCoverage user) {
    const bool partial = coverage == BlockCoverage::kPartial;
    const bool user_partial = user == BlockCoverage::kPartial;
    if (!partial && !user_partial && !terms_.dense() && !terms_.modifies()) return;
    const Index qp0 = p_.first_query + q0_;
    if (partial) {
      PositionTile<C>::fill(p_.positions, qp0, bq_, keys.position(), n_, buf_.position, n_);
    }
    if (terms_.alibi.on()) AlibiTerm<C>::fill(buf_.distance, keys.position(), qp0, n_);
    for (Index r = 0; r < rows_; ++r) {
      ScoreArray<C> s(buf_.s + r * n_, n_);
      const Index i = query_of(r);
      const ScoreRow row{b_, head_of(r), i, p_.first_query + i, keys.index, keys.position(), n_};
      if (terms_.curves()) {
        ScoreArray<C> slope(buf_.slope + r * n_, n_);
        terms_.transform_with_slope(s, slope, row, buf_.distance, i - q0_);
      } else {
        terms_.transform(s, row, buf_.distance, i - q0_);
      }
      terms_.forbid(s, row, partial ? buf_.position + (i - q0_) * n_ : nullptr, user_partial);
    }
  }

  /// Per row: P = exp(S − lse) (−0.0 for a key that takes no part: exp_weights), dS = P∘(dP − D)
  /// (0 for a key that takes no part, whatever dP holds), and dX = dS∘s' where the terms curve.
  void weights() {
    for (Index r = 0; r < rows_; ++r) {
      C* p = buf_.s + r * n_;
      bool hidden = false;
      exp_weights(p, n_, buf_.lse[r], hidden);
      ScoreArray<C> ds(buf_.ds + r * n_, n_);
      ds = ConstScoreArray<C>(p, n_) * (ds - buf_.delta[r]);
      if (hidden) {
        for (Index j = 0; j < n_; ++j) {
          if (std::signbit(p[j])) ds[j] = C(0);
        }
      }
      if (terms_.curves()) ScoreArray<C>(buf_.slope + r * n_, n_) *= ds;
    }
  }

  const BP& bp_;
  const P& p_;
  ScoreTerms<C, P> terms_;
  GradientBuffers<C> buf_;
  Index b_, h0_, q0_, bq_, heads_, rows_;
  Index n_ = 0;  // keys of the last block
  bool non_finite_score_ = false;
};

/// The rows of a block of keys of (b, kv head), K and V widened into buf.k and buf.v: {k, v}.
template <class C, class Block>
std::pair<const C*, const C*> load_keys(const Block& keys, Index b, Index kv_head,
                                        const GradientBuffers<C>& buf) {
  load_rows<C>(key_head(*keys.segment, b, kv_head), keys.row, keys.n, buf.k);
  load_rows<C>(value_head(*keys.segment, b, kv_head), keys.row, keys.n, buf.v);
  return {buf.k, buf.v};
}

/// Whether a float pass may keep its result: no non-finite raw score, no non-finite gradient in
/// the rows × cols block acc (ld cols).
template <class C>
bool kept_in(const C* acc, Index rows, Index cols) {
  return !std::is_same_v<C, float> || all_finite(acc, rows, cols, cols);
}

/// Writes rows × cols of acc (contiguous), times `scale`, rounded once to TG, to `to`.
template <class TG, class C, class To>
void write_rows(const C* acc, Index rows, Index cols, C scale, To&& to) {
  const Eigen::Map<const RowMatrix<C>> from(acc, rows, cols);
  to = rounded<TG>((from * scale).array()).matrix();
}

/// Keys task `task`: the dK and dV rows of one (b, kv head, key block). Returns whether a float
/// pass may keep them.
template <class C, class BP, class TG>
bool key_task(const BP& bp, const BackwardPlan& plan, const BackwardOutputs<TG>& o, Index task) {
  const auto& p = bp.forward;
  const PairBlock where = pair_block(task, plan.key_blocks, plan.kv_heads);
  const Index b = where.b, kv_head = where.kv_head, block = where.block;
  const Index j0 = block * plan.key_block;
  const Index n = std::min(plan.key_block, p.s_k - j0);
  const GradientBuffers<C> buf = gradient_buffers<C>(plan, p.d_qk, p.d_v);
  std::fill(buf.acc, buf.acc + n * p.d_qk, C(0));
  std::fill(buf.acc_v, buf.acc_v + n * p.d_v, C(0));
  bool kept = true;
  for (Index qb = 0; qb < plan.query_blocks; ++qb) {
    const Index q0 = qb * plan.query_block;
    const Index bq = std::min(plan.query_block, p.s_q - q0);
    for_each_key_block(
        p, j0, j0 + n, visible_keys_of(p, q0, bq), plan.key_block, [&](const auto& keys) {
          // Only the keys the query block may see are read, as the forward reads them.
          GradientTile<C, BP> tile(bp, buf, b, kv_head * p.group, p.group, q0, bq);
          const Index at = keys.index - j0;
          if (tile.gradients(keys, [&] { return load_keys<C>(keys, b, kv_head, buf); })) {
            tile.add_key_gradients(buf.acc + at * p.d_qk, buf.acc_v + at * p.d_v);
          }
          kept = kept && !tile.saw_non_finite_score();
        });
  }
  write_rows<TG>(buf.acc, n, p.d_qk, C(1), o.dk.head(b, kv_head).middleRows(j0, n));
  write_rows<TG>(buf.acc_v, n, p.d_v, C(1), o.dv.head(b, kv_head).middleRows(j0, n));
  return kept && kept_in(buf.acc, n, p.d_qk) && kept_in(buf.acc_v, n, p.d_v);
}

/// Queries task `task`: the dQ rows of one (b, kv head, query block), its G heads stacked, and
/// their rows' shares of d sink in sinks[0, G). Returns whether a float pass may keep them.
template <class C, class BP, class TG>
bool query_task(const BP& bp, const BackwardPlan& plan, const BackwardOutputs<TG>& o, Index task,
                double* sinks) {
  const auto& p = bp.forward;
  const PairBlock where = pair_block(task, plan.query_blocks, plan.kv_heads);
  const Index b = where.b, kv_head = where.kv_head, block = where.block;
  const Index q0 = block * plan.query_block;
  const Index bq = std::min(plan.query_block, p.s_q - q0);
  const GradientBuffers<C> buf = gradient_buffers<C>(plan, p.d_qk, p.d_v);
  GradientTile<C, BP> tile(bp, buf, b, kv_head * p.group, p.group, q0, bq);
  std::fill(buf.acc, buf.acc + tile.rows() * p.d_qk, C(0));
  for_each_key_block(p, 0, p.s_k, visible_keys_of(p, q0, bq), plan.key_block,
                     [&](const auto& keys) {
                       const auto load = [&] { return load_keys<C>(keys, b, kv_head, buf); };
                       if (tile.gradients(keys, load)) tile.add_query_gradients(buf.acc, buf.k);
                     });
  const C scale = static_cast<C>(p.scale);
  for (Index g = 0; g < p.group; ++g) {
    write_rows<TG>(buf.acc + g * bq * p.d_qk, bq, p.d_qk, scale,
                   o.dq.head(b, kv_head * p.group + g).middleRows(q0, bq));
    double share = 0.0;
    for (Index i = 0; i < bq; ++i) share += tile.sink_share(g * bq + i);
    if (sinks != nullptr) sinks[g] = share;
  }
  return !tile.saw_non_finite_score() && kept_in(buf.acc, tile.rows(), p.d_qk);
}

/// Bias task `task`: rows [q0, q0 + Bq) of d_bias head (b', h'), the sum of dS over the (b, h)
/// that the bias view maps there (all b when its batch is 1, all h when its heads are 1), in
/// order, one key block at a time. Returns whether a float pass may keep them.
template <class C, class BP, class TG>
bool bias_task(const BP& bp, const BackwardPlan& plan, const BackwardOutputs<TG>& o, Index task) {
  const auto& p = bp.forward;
  const HeadsView<TG>& d_bias = o.d_bias;
  const Index slice = task / plan.query_blocks;
  const Index q0 = (task - slice * plan.query_blocks) * plan.query_block;
  const Index bq = std::min(plan.query_block, p.s_q - q0);
  const Index bb = slice / d_bias.heads();
  const Index hh = slice - bb * d_bias.heads();
  const bool all_batches = d_bias.batch() == 1;
  const bool all_heads = d_bias.heads() == 1;
  const GradientBuffers<C> buf = gradient_buffers<C>(plan, p.d_qk, p.d_v);
  bool kept = true;
  for (Index j0 = 0; j0 < p.s_k; j0 += plan.key_block) {
    const Index n = std::min(plan.key_block, p.s_k - j0);
    Eigen::Map<RowMatrix<C>> acc(buf.bias, bq, n);
    acc.setZero();
    for (Index b = all_batches ? 0 : bb; b < (all_batches ? p.q.batch() : bb + 1); ++b) {
      for (Index h = all_heads ? 0 : hh; h < (all_heads ? p.q.heads() : hh + 1); ++h) {
        const Index kv_head = h / p.group;
        for_each_key_block(
            p, j0, j0 + n, visible_keys_of(p, q0, bq), plan.key_block, [&](const auto& keys) {
              const Index at = keys.index - j0;
              GradientTile<C, BP> tile(bp, buf, b, h, 1, q0, bq);
              if (tile.gradients(keys, [&] { return load_keys<C>(keys, b, kv_head, buf); })) {
                acc.middleCols(at, keys.n) += Eigen::Map<const RowMatrix<C>>(tile.ds(), bq, keys.n);
              }
              kept = kept && !tile.saw_non_finite_score();
            });
      }
    }
    write_rows<TG>(buf.bias, bq, n, C(1), d_bias.head(bb, hh).block(q0, j0, bq, n));
    kept = kept && kept_in(buf.bias, bq, n);
  }
  return kept;
}

/// One pass of the backward in C: the keys, queries and (when asked for) bias tasks, each pass
/// one parallel loop. Returns whether a float pass may keep its results.
template <class C, class BP, class TG>
bool backward_pass(const BP& bp, const BackwardOutputs<TG>& o, const BackwardBlocking& blocking) {
  const auto& p = bp.forward;
  const BackwardPlan plan = plan_backward(p, blocking);
  const Index key_tasks = plan.pairs * plan.key_blocks;
  const Index query_tasks = plan.pairs * plan.query_blocks;
  const Index bias_tasks =
      o.d_bias.empty() ? 0 : o.d_bias.batch() * o.d_bias.heads() * plan.query_blocks;
  const Index most = std::max({key_tasks, query_tasks, bias_tasks});
  ThreadScratch& scratch = ThreadScratch::local();
  auto* ok = scratch.get<unsigned char>(ScratchSlot::kTaskFlags, ThreadScratch::whole_pages(most));
  double* sinks = o.d_sinks == nullptr
                      ? nullptr
                      : scratch.get<double>(ScratchSlot::kBackwardSinks, query_tasks * p.group);
  bool kept = true;
  const auto all_ok = [&](Index tasks) {
    kept = kept && std::all_of(ok, ok + tasks, [](unsigned char x) { return x != 0; });
  };
  parallel_for(key_tasks, [&](Index t) { ok[t] = key_task<C>(bp, plan, o, t); });
  all_ok(key_tasks);
  parallel_for(query_tasks, [&](Index t) {
    ok[t] = query_task<C>(bp, plan, o, t, sinks == nullptr ? nullptr : sinks + t * p.group);
  });
  all_ok(query_tasks);
  parallel_for(bias_tasks, [&](Index t) { ok[t] = bias_task<C>(bp, plan, o, t); });
  all_ok(bias_tasks);
  if (o.d_sinks != nullptr) {
    std::fill(o.d_sinks, o.d_sinks + p.q.heads(), 0.0);
    for (Index t = 0; t < query_tasks; ++t) {
      const Index pair = t / plan.query_blocks;
      const Index kv_head = pair % plan.kv_heads;
      for (Index g = 0; g < p.group; ++g)
        o.d_sinks[kv_head * p.group + g] += sinks[t * p.group + g];
    }
  }
  return kept;
}

/// The backward pass of one problem whose every precondition holds (sdpa_backward checks them):
/// in float, and again in double where the float pass may not keep its result (COMPUTE TYPE).
template <class BP, class TG>
void attention_backward(const BP& bp, const BackwardOutputs<TG>& o,
                        const BackwardBlocking& blocking) {
  constexpr bool wide = BP::kWide || std::is_same_v<TG, double>;
  if constexpr (!wide) {
    if (fits_float(bp.forward) && backward_pass<float>(bp, o, blocking)) return;
  }
  backward_pass<double>(bp, o, blocking);
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
