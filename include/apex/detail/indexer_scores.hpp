// SPDX-License-Identifier: MIT
// The lightning indexer's scores and its top-k selection (indexer.hpp), for query rows against
// the cached indexer keys of their batch:
//   I_{t,s} = Σ_j w_{t,j} · ReLU(q_{t,j} · k_s)      s = 0 .. position(t)   (causal)
// with the scales folded into w (LightningIndexer::head_weights), then the k keys of largest
// score, ascending by position.
//
//   q  [rows, H·d]   row t: H heads side by side      keys [B, 1, S_k, d] (any K/V format)
//   w  [rows, H]                                       selection [rows, min(k, S_k)]
//
// HOW. The keys are read in fixed blocks of kIndexerKeyBlock rows from position 0, widened to the
// compute type C where they are not stored as C; for one query row and one key block,
// S = Q_t [H, d] · K_blockᵀ is one product on one thread (matmul_serial), then each key's score is
// Σ_j w_j·max(0, S(j, s)) summed over j in order. A key's score therefore depends on its block's
// shape and place alone: not on the number of threads, not on the other rows of the call, and
// not on whether the row is decoded alone or scored with a whole prompt.
//
// ORDER. Key a ranks before key b when I_a > I_b, or I_a = I_b and a < b (lower position first);
// a NaN score ranks as -∞. That is a strict total order, so the k selected keys are one set
// whatever the algorithm's path: std::nth_element over the visible keys' indices, then the k
// first sorted by position.
//
// MEMORY. The call holds the scores of at most kIndexerRows rows at once, kIndexerRows · S_k
// values of C and as many indices, and each thread a widened key block and its product,
// kIndexerKeyBlock · (d + H) values of C (thread_local, kept between calls).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/key_selection.hpp>
#include <apex/kv_format.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (row, block) indices of one call
namespace apex::detail {

/// Keys per block of the indexer's products (the blocks start at position 0).
inline constexpr Index kIndexerKeyBlock = 256;
/// Query rows whose scores are held at once.
inline constexpr Index kIndexerRows = 8;

/// What the indexer kernel reads: the query rows and their head weights in C, the keys of every
/// batch, where row t belongs to batch t / rows_per_batch at position first_position + t mod
/// rows_per_batch, seeing keys [0, min(position + 1, S_k)).
template <class C, class TK>
struct IndexerInputs {
  const C* q;                // [rows, heads·dim], row stride q_stride
  Index q_stride;            //
  const C* w;                // [rows, heads], row stride w_stride
  Index w_stride;            //
  HeadsView<const TK> keys;  // [B, 1, S_k, dim in elements]
  Index rows, heads, dim;    //
  Index rows_per_batch;      // n: query rows of each batch
  Index first_position;      // position of each batch's first query row

  Index batch_of(Index t) const { return t / rows_per_batch; }
  Index visible(Index t) const {
    return std::min(keys.seq(), first_position + t % rows_per_batch + 1);
  }
};

/// Rows [first, first + n) of one batch's keys as C: in place when stored as C, else widened
/// into `buffer` (n × dim). Returns the rows and their stride.
template <class C, class TK>
std::pair<const C*, Index> indexer_key_rows(const HeadsView<const TK>& keys, Index b, Index first,
                                            Index n, Index dim, C* buffer) {
  const auto head = keys.head(b, 0);
  if constexpr (std::is_same_v<TK, C>) {
    (void)n;
    (void)dim;
    (void)buffer;
    return {head.data() + first * head.outerStride(), head.outerStride()};
  } else {
    for (Index r = 0; r < n; ++r) {
      KvFormat<TK>::widen(head.data() + (first + r) * head.outerStride(), buffer + r * dim,
                          keys.dim());
    }
    return {buffer, dim};
  }
}

/// The scores of query row t against key block `block` (its visible part), written to
/// scores[first key of the block ...]. Scratch from the calling thread.
template <class C, class TK>
void score_key_block(const IndexerInputs<C, TK>& in, Index t, Index block, C* scores) {
  const Index first = block * kIndexerKeyBlock;
  const Index n = std::min(kIndexerKeyBlock, in.visible(t) - first);
  if (n <= 0) return;
  thread_local std::vector<C> scratch;
  scratch.resize(static_cast<std::size_t>(kIndexerKeyBlock * (in.dim + in.heads)));
  C* const product = scratch.data() + kIndexerKeyBlock * in.dim;  // [H, n]
  const auto [k, k_stride] =
      indexer_key_rows<C>(in.keys, in.batch_of(t), first, n, in.dim, scratch.data());
  // S = Q_t [H, d] · Kᵀ [d, n]: the keys' rows are the columns of a column-major right side.
  matmul_serial<C, Eigen::ColMajor>(in.heads, n, in.dim, in.q + t * in.q_stride, in.dim, k,
                                    k_stride, product, n);
  const C* w = in.w + t * in.w_stride;
  C* out = scores + first;
  std::fill_n(out, n, C(0));
  for (Index j = 0; j < in.heads; ++j) {
    const C* s = product + j * n;
    const C wj = w[j];
    for (Index i = 0; i < n; ++i) out[i] += wj * std::max(C(0), s[i]);
  }
}

/// Writes the selection of one row: the min(k, n) best of scores[0, n) in ascending position,
/// then -1 up to `width`. `order` holds n indices of scratch.
template <class C>
void select_top_k(const C* scores, Index n, Index k, Index width, Index* order, Index* selected) {
  const auto rank = [scores](Index i) {
    const C s = scores[i];
    return std::isnan(s) ? -std::numeric_limits<C>::infinity() : s;
  };
  const auto before = [&rank](Index a, Index b) {
    const C ra = rank(a), rb = rank(b);
    return ra > rb || (ra == rb && a < b);
  };
  std::iota(order, order + n, Index{0});
  const Index taken = std::min(k, n);
  if (taken < n) std::nth_element(order, order + taken, order + n, before);
  std::sort(order, order + taken);
  std::copy_n(order, taken, selected);
  std::fill(selected + taken, selected + width, Index{-1});
}

/// The scores of rows [first, first + count) into scores (count × S_k, row-major; entries past a
/// row's visible keys are left as they are), one task per (key block, row) in one parallel loop.
template <class C, class TK>
void score_rows(const IndexerInputs<C, TK>& in, Index first, Index count, C* scores) {
  const Index s_k = in.keys.seq();
  const Index blocks = (s_k + kIndexerKeyBlock - 1) / kIndexerKeyBlock;
  parallel_for(blocks * count, [&](Index task) {
    const Index block = task / count, r = task % count;
    score_key_block(in, first + r, block, scores + r * s_k);
  });
}

/// The whole kernel: every row's scores, kIndexerRows rows at a time, and its selection of
/// the top `k` into selected [rows, width].
template <class C, class TK>
void indexer_select(const IndexerInputs<C, TK>& in, Index k, KeySelection& selected) {
  const Index s_k = in.keys.seq();
  const Index width = selected.cols();
  std::vector<C> scores(static_cast<std::size_t>(std::min(in.rows, kIndexerRows) * s_k));
  std::vector<Index> order(scores.size());
  for (Index first = 0; first < in.rows; first += kIndexerRows) {
    const Index count = std::min(kIndexerRows, in.rows - first);
    score_rows(in, first, count, scores.data());
    parallel_for(count, [&](Index r) {
      select_top_k(scores.data() + r * s_k, in.visible(first + r), k, width, order.data() + r * s_k,
                   selected.row(first + r).data());
    });
  }
}

/// Every row's scores [rows, S_k], -∞ past a row's visible keys (for inspection and tests: the
/// values indexer_select ranks).
template <class C, class TK>
RowMatrix<C> indexer_scores(const IndexerInputs<C, TK>& in) {
  const Index s_k = in.keys.seq();
  RowMatrix<C> scores = RowMatrix<C>::Constant(in.rows, s_k, -std::numeric_limits<C>::infinity());
  for (Index first = 0; first < in.rows; first += kIndexerRows) {
    score_rows(in, first, std::min(kIndexerRows, in.rows - first), scores.row(first).data());
  }
  return scores;
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
