// SPDX-License-Identifier: MIT
// The tile of the tiled kernel (flash_attention.hpp): one task's stacked query rows while the
// blocks of its keys stream past, with an online softmax (FlashAttention: Dao et al. 2022,
// Algorithm 1).
//
// ONE TASK = batch b, key/value head, one block of Bq query positions. The G = H_q / H_kv query
// heads that read the same key/value head are stacked into one tile of M = G·Bq rows, so each
// key/value block is read once per group and every product has a few hundred rows:
//
//         Qs = scale·Q, stacked                K_j: Bk keys             V_j: Bk keys
//        +---------------------+            +----------------+        +------------+
//   g=0  | Bq rows × d_qk      |            | Bk × d_qk      |        | Bk × d_v   |
//   g=1  | Bq rows × d_qk      |            +----------------+        +------------+
//   ...  |                     |                    |                        |
//   G-1  | Bq rows × d_qk      |   S = Qs·K_jᵀ  (M × Bk) --softmax--> acc += P·V_j (M × d_v)
//        +---------------------+
//   row r = g·Bq + i is query position q0 + i of query head kv_head·G + g.
//
// A tile folds in one key block at a time, in four named steps (AttentionTile::add_keys):
//   score       S = Qs·K_jᵀ                       K_j read through kv_read.hpp
//   mask        the score terms (score_terms.hpp), forbidden keys → -inf
//   softmax     m, l and P = exp(S − m) per row    softmax_update (online_softmax.hpp)
//   accumulate  acc = diag(α)·acc + P·V_j          V_j read through kv_read.hpp (or, where the
//                                                  values are the keys' first columns, the
//                                                  key block the scores read: absorbed MLA)
// and finish_row() ends each row with softmax_finish: out = acc / l, lse = m + log l (with the
// sink, which joins there once: THE SINK in online_softmax.hpp). Q is widened and scaled once
// per task (load_queries).
//
// MASK-AWARE SKIPPING. Each (query block, key block) pair is classified on absolute positions
// with classify_block, and by the user's rules' classifier: kNone skips the block (no product at
// all), kAll needs no mask work, and kPartial applies the rule element by element (the position
// rule evaluated once for the Bq × Bk tile and shared by the G stacked heads). Dense masks and
// biases apply to every block that is not skipped, soft-cap and ALiBi to every block.
//
// NON-FINITE INPUT follows apex::sdpa's policy (sdpa.hpp). In the tile: a block where some key
// may take no part and whose values are not all finite adds only the keys that take part
// (accumulate_visible); a float tile notes a raw score that is not finite
// (saw_non_finite_score), so that its job is computed again in double (attention_plan.hpp).
//
// TWO PATHS. A tile of M > stream_rows rows takes the GEMM path: both products run on a GEMM
// kernel over the tile's buffers (TileProducts, tile_products.hpp: PRODUCTS). The streaming
// path (M ≤ stream_rows, e.g. one new token of 4 grouped heads) is bound by reading K and V: each
// key row, then each value row, is read once in memory order and used at once by every stacked row.
//
// MEMORY: the tile's buffers (TileBuffers) and what they hold per thread: tile_scratch.hpp, MEMORY.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/score_terms.hpp>
#include <apex/detail/tile_products.hpp>
#include <apex/detail/tile_scratch.hpp>
#include <apex/kv_format.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, the tile's position (b, kv head,
// first query, rows)
namespace apex::detail {

/// The running state of one task (M = G·bq stacked rows of the G heads that share key/value head
/// (b, kv_head), query rows [q0, q0 + bq)), computing in C.
template <class C, class P>
class AttentionTile {
 public:
  using Block = KeyBlock<typename P::Key, typename P::Value>;

  /// `streaming` picks the path; key_block is the most keys add_keys will be given at once;
  /// `blocking` sizes the scratch (tile_buffers).
  AttentionTile(const P& p, Index b, Index kv_head, Index q0, Index bq, Index key_block,
                bool streaming, const FlashBlocking& blocking)
      : p_(p),
        terms_(p),
        path_(tile_path<C>(p, streaming, p.group * bq)),
        b_(b),
        kv_head_(kv_head),
        q0_(q0),
        bq_(bq),
        buf_(tile_buffers<C>(p, path_, p.group * bq, key_block, blocking)) {
    load_queries();
    std::fill(buf_.stats, buf_.stats + buf_.rows, SoftmaxStats<C>{});
    std::fill(buf_.acc, buf_.acc + buf_.rows * buf_.ld_acc, C(0));
  }

  /// Stacked rows M = G·bq.
  Index rows() const { return buf_.rows; }
  /// Whether a raw score was not finite where it matters (a float pass must then be redone in
  /// double); a NaN or +inf one shows in its row's result instead.
  bool saw_non_finite_score() const { return non_finite_score_; }

  /// Folds one block of keys into the running state: score, mask, softmax, accumulate.
  void add_keys(const Block& keys) {
    const Index query_pos = p_.first_query + q0_;
    const PositionRange q{query_pos, query_pos + bq_};
    const PositionRange k{keys.position(), keys.position() + keys.n};
    const BlockCoverage coverage = classify_block(p_.positions, q.begin, q.end, k.begin, k.end);
    if (coverage == BlockCoverage::kNone) return;
    const BlockCoverage user = user_coverage(p_.rules, b_, kv_head_ * p_.group, p_.group, q, k);
    if (user == BlockCoverage::kNone) return;
    // A score rule may return -inf: the raw scores are checked before it, as before a mask.
    const bool masked = coverage == BlockCoverage::kPartial || user == BlockCoverage::kPartial ||
                        terms_.dense() || P::Rules::kScores;
    score(keys, masked);
    if (masked || terms_.modifies()) {
      mask(keys, coverage, user);
    }
    const bool hidden = softmax(keys.n);
    // Unmasked, a key takes no part only when its raw score is -inf (see score()).
    if (!masked && hidden) non_finite_score_ = true;
    accumulate(keys, hidden);
  }

  /// Ends stacked row r: writes its d_v outputs to `out` (rounded once to T) and returns its
  /// statistics (softmax_finish), with the head's sink when `sink` is set (a whole row; a part
  /// of a row that is merged later leaves the sink to the merge).
  template <class T>
  SoftmaxStats<C> finish_row(Index r, T* out, bool sink) const {
    return softmax_finish(buf_.stats[r], buf_.acc_row(r), p_.d_v, out,
                          sink ? sink_of<C>(p_, head_of(r)) : -std::numeric_limits<C>::infinity());
  }

  /// Whether the running state holds only finite numbers: every row's statistics (or those of
  /// a row in which no key took part) and its accumulator. Its outputs are then finite too.
  bool finite() const {
    for (Index r = 0; r < buf_.rows; ++r) {
      if (!finite_stats(buf_.stats[r])) return false;
    }
    return all_finite(buf_.acc, buf_.rows, p_.d_v, buf_.ld_acc);
  }

  /// Query head of stacked row r.
  Index head_of(Index r) const { return kv_head_ * p_.group + r / bq_; }
  /// Query row of stacked row r.
  Index query_of(Index r) const { return q0_ + r % bq_; }

 private:
  /// The GEMM path's products over this tile's buffers (tile_products.hpp).
  TileProducts<C> products() const { return {path_, buf_}; }

  /// Qs = scale·Q with the G heads' rows stacked, widened to C; readied once for the GEMM path's
  /// products.
  void load_queries() {
    const C scale = static_cast<C>(p_.scale);
    for (Index g = 0; g < p_.group; ++g) {
      Eigen::Map<RowMatrix<C>>(buf_.q_stacked + g * bq_ * p_.d_qk, bq_, p_.d_qk) =
          p_.q.head(b_, kv_head_ * p_.group + g).middleRows(q0_, bq_).template cast<C>() * scale;
    }
    if (!path_.streaming) products().prepare_queries();
  }

  /// score: S (rows × n, leading dimension ld_s) = Qs·Kᵀ for the block's keys, streamed key row
  /// by key row or on the GEMM path's products. A float pass also notes whether a raw score is
  /// not finite (see COMPUTE TYPE): NaN and +inf show in the row's result, and -inf, in a block
  /// nothing masks, as a key that takes no part (add_keys); a block that is masked checks its
  /// raw scores here, before the masks hide them.
  void score(const Block& keys, bool masked) {
    const auto k_head = key_head(*keys.segment, b_, kv_head_);
    if (path_.streaming) {
      for_each_panel(
          k_head, keys.row, keys.n, whole_runs(path_.k_in_place), [&](Index j0, Index m) {
            read_rows(k_head, keys.row + j0, m, buf_.k_copy, path_.k_in_place,
                      [&](const auto* k, Index stride) {
                        streamed_scores(path_.simd, buf_.scores + j0, buf_.ld_s, buf_.q_stacked,
                                        buf_.rows, k, stride, m, p_.d_qk);
                      });
          });
    } else {
      values_inside_ =
          p_.d_v > 0 &&
          values_lead_keys(k_head, value_head(*keys.segment, b_, kv_head_), keys.row, keys.n);
      key_rows_ = products().scores(k_head, keys.row, keys.n, values_inside_);
    }
    if constexpr (std::is_same_v<C, float>) {
      if (masked && !non_finite_score_) {
        non_finite_score_ = !all_finite(buf_.scores, buf_.rows, keys.n, buf_.ld_s);
      }
    }
  }

  /// mask: the score terms of every row (ScoreTerms: transform, then forbid); `coverage` is what
  /// the PositionMask says of the block, `user` what the user's mask rule says. The position
  /// tile and the key distances of ALiBi are formed once per block for the G stacked heads.
  void mask(const Block& keys, BlockCoverage coverage, BlockCoverage user) {
    const Index qp0 = p_.first_query + q0_;
    const bool partial = coverage == BlockCoverage::kPartial;
    if (partial) {
      PositionTile<C>::fill(p_.positions, qp0, bq_, keys.position(), keys.n, buf_.position_tile,
                            buf_.ld_s);
    }
    if (terms_.alibi.on()) AlibiTerm<C>::fill(buf_.alibi, keys.position(), qp0, keys.n);
    for (Index r = 0; r < buf_.rows; ++r) {
      ScoreArray<C> s(buf_.score_row(r), keys.n);
      const Index i = query_of(r);
      const ScoreRow row{b_,         head_of(r),      i,     p_.first_query + i,
                         keys.index, keys.position(), keys.n};
      terms_.transform(s, row, buf_.alibi, i - q0_);
      terms_.forbid(s, row, partial ? buf_.position_tile + (i - q0_) * buf_.ld_s : nullptr,
                    user == BlockCoverage::kPartial);
    }
  }

  /// softmax: the online-softmax update of every row (softmax_update), and with bfloat16
  /// products the row's weights rounded into pairs for P·V while they are at hand. Notes in α
  /// and rescale_ the rows whose maximum moved. Returns whether some key of the block takes no
  /// part in some row.
  bool softmax(Index n) {
    rescale_ = false;
    bool hidden = false;
    for (Index r = 0; r < buf_.rows; ++r) {
      buf_.alpha[r] = softmax_update(buf_.stats[r], buf_.score_row(r), n, hidden, path_.simd);
      rescale_ = rescale_ || buf_.alpha[r] != C(1);
      products().round_weights(r, n);
    }
    return hidden;
  }

  /// acc *= α for the rows whose maximum moved (softmax), once, unless the update does it itself.
  void rescale_acc() {
    if (rescale_) products().scale_acc();
    rescale_ = false;
  }

  /// accumulate: acc = diag(α)·acc + P·V for the block's values, streamed value row by value row
  /// (after rescale_acc) or on the GEMM path's products, each through add_values.
  void accumulate(const Block& keys, bool hidden) {
    if (p_.d_v == 0) return;
    const auto v_head = value_head(*keys.segment, b_, kv_head_);
    if (!path_.streaming) {
      const C* scale = rescale_ ? buf_.alpha : nullptr;
      products().read_values(
          v_head, keys.row, keys.n, scale, values_inside_ ? key_rows_ : ConstRows<C>{nullptr, 0},
          [&](const auto& v, const auto& update) { add_values(v, 0, keys.n, hidden, update); });
      return;
    }
    rescale_acc();
    for_each_panel(v_head, keys.row, keys.n, whole_runs(path_.v_in_place), [&](Index j0, Index m) {
      read_rows(v_head, keys.row + j0, m, buf_.v_copy, path_.v_in_place,
                [&](const auto* v, Index stride) { stream_values(v, stride, j0, m, hidden); });
    });
  }

  /// Whether the streaming path takes rows a run at a time (for_each_panel): rows read in place
  /// by apex's float kernels.
  bool whole_runs(bool in_place) const { return in_place && path_.simd != nullptr; }

  /// acc += P·V for the m value rows at v (keys [j0, j0 + m) of the block), streamed: in one
  /// call, or where some key takes no part (`hidden`) kStreamPanel rows at a time, each checked
  /// by add_values (which widens a panel of blocks into v_copy); a row's sums are the same chain
  /// either way.
  template <class U>
  void stream_values(const U* v, Index stride, Index j0, Index m, bool hidden) {
    const Index panel = hidden ? kStreamPanel : m;
    for (Index c = 0; c < m; c += panel) {
      const Index n = std::min(panel, m - c);
      const U* rows = v + c * stride;
      add_values(ConstRows<U>{rows, stride}, j0 + c, n, hidden, [&] {
        streamed_update(path_.simd, buf_.acc, buf_.ld_acc, buf_.scores + j0 + c, buf_.ld_s,
                        buf_.rows, rows, stride, n, p_.d_v);
      });
    }
  }

  /// acc += P·V for the value rows v (keys [j0, j0 + n) of the block) by `update`, the fast
  /// product; but where some key takes no part (`hidden`) and v holds a value that is not
  /// finite, only the keys that take part are added, after rescale_acc (a weight of -0.0 times
  /// NaN would be NaN; the non-finite policy: sdpa.hpp). Rows of blocks read in place are
  /// widened into v_copy for that check (the fast product still reads the blocks).
  template <class T, class Update>
  void add_values(const ConstRows<T>& v, Index j0, Index n, bool hidden, const Update& update) {
    if constexpr (!is_storage_v<T>) {
      if (!hidden) return update();
      for (Index j = 0; j < n; ++j) {
        KvFormat<T>::widen(v.data + j * v.stride, buf_.v_copy + j * p_.d_v,
                           p_.d_v / KvFormat<T>::kValuesPerElement);
      }
      return add_values(ConstRows<C>{buf_.v_copy, p_.d_v}, j0, n, hidden, update);
    } else if (hidden && !all_finite(v.data, n, p_.d_v, v.stride)) {
      rescale_acc();
      accumulate_visible(v, j0, n);
    } else {
      update();
    }
  }

  /// acc_r += Σ_j P(r, j0 + j) v_j for the n value rows of v, over the keys that take part
  /// (weight without the sign bit), one row at a time: the slow path of blocks whose hidden keys
  /// may hold NaN or ±inf values.
  template <class T>
  void accumulate_visible(const ConstRows<T>& v, Index j0, Index n) {
    using Values = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>;
    for (Index r = 0; r < buf_.rows; ++r) {
      Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>> acc(buf_.acc_row(r), p_.d_v);
      const C* weight = buf_.score_row(r) + j0;
      for (Index j = 0; j < n; ++j) {
        if (!std::signbit(weight[j])) {
          acc += weight[j] * Values(v.data + j * v.stride, p_.d_v).template cast<C>();
        }
      }
    }
  }

  const P& p_;
  ScoreTerms<C, P> terms_;
  TilePath path_;
  bool rescale_ = false;  // some α of the last softmax is not 1 and acc is not rescaled yet
  ConstRows<C> key_rows_{nullptr, 0};  // the GEMM path's block of keys as C, where scores kept it
  bool values_inside_ = false;         // the block's values lead its keys (values_lead_keys)
  bool non_finite_score_ = false;
  Index b_, kv_head_, q0_, bq_;
  TileBuffers<C> buf_;  // in the thread's scratch (tile_scratch.hpp)
};

// ---------------------------------------------------------------------------------------------

/// Whether a tile met a non-finite number that a float pass must redo in double.
template <class C, class Tile>
bool tile_finite(const Tile& tile) {
  return !std::is_same_v<C, float> || (!tile.saw_non_finite_score() && tile.finite());
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
