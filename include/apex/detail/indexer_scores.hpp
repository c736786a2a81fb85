// SPDX-License-Identifier: MIT
// The lightning indexer's scores and its top-k selection (indexer.hpp), for query rows against
// the cached indexer keys of their sequence:
//   I_{t,s} = Σ_j w_{t,j} · ReLU(q_{t,j} · k_s)      s = first .. position(t)   (causal)
// with the scales folded into w (LightningIndexer::head_weights), then the k keys of largest
// score, ascending by position.
//
//   q  [rows, H·d]   row t: H heads side by side      keys: a key segment per sequence
//   w  [rows, H]                                       (contiguous or paged, any K/V format)
//                                                      selection [rows, width] of positions
//
// HOW. The keys are read in fixed blocks of kIndexerKeyBlock positions (the blocks start at its
// multiples), through the segment's block table when paged, and widened to the compute type C
// where they are not stored as C (kv_read.hpp's rows_as); for one query row and one key block,
// S = Q_t [H, d] · K_blockᵀ is one product on one thread (matmul_serial; with
// IndexerConfig::allow_bf16_products where the CPU has them, apex's bfloat16 products, on AMX
// tiles where it has those), then each key's score is Σ_j w_j·max(0, S(j, s)) summed over j in
// order. A key's score therefore depends on its
// block's place alone: not on the number of threads, not on the other rows of the call, not on
// whether the row is decoded alone or scored with a whole prompt, and not on whether the keys
// are paged.
//
// DRAFT TREES. With a TreeMasks (speculative verification, tree_mask.hpp; sequence i is its
// batch i), a row also drops the draft keys its tree hides from it (TreeMasks::allows: a draft
// token sees the committed keys, its ancestors and itself) before the selection, which then
// ranks the keys it may see, as if its path alone followed the committed ones.
//
// ORDER. Key a ranks before key b when I_a > I_b, or I_a = I_b and a < b (lower position first);
// a NaN score ranks as -∞. That is a strict total order, so the k selected keys are one set
// whatever the algorithm's path (select_top_k: the k-th best value, then one pass by position;
// select_top_k_split, for a row decoded alone: the same over runs of keys in parallel).
//
// MEMORY. The call holds the scores of at most kIndexerRows rows at once, kIndexerRows · S_k
// values of C and as many of scratch (S_k: the most keys of a sequence), and each thread a widened
// key block and its product, kIndexerKeyBlock · (d + H) values of C, and for the bfloat16
// products the packed pairs of IndexerScratch, about as many again (thread_local, kept between
// calls), and the held rows' queries rounded to pairs once, kIndexerRows · H · ⌈d/2⌉ pairs; a
// row decoded alone also the best k values of each thread's run of keys (select_top_k_split).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/key_selection.hpp>
#include <apex/kv_format.hpp>
#include <apex/tensor.hpp>
#include <apex/tree_mask.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (row, block) indices of one call
namespace apex::detail {

/// Keys per block of the indexer's products (the blocks start at the multiples of it).
inline constexpr Index kIndexerKeyBlock = 256;
/// Query rows whose scores are held at once.
inline constexpr Index kIndexerRows = 8;

/// What the indexer kernel reads: the query rows and their head weights in C, and the keys of
/// every sequence as a key segment (kv_read.hpp: contiguous, or paged and read through its block
/// table). Row t belongs to sequence row_sequence[t] and sees that sequence's keys
/// [first, end(t)): from the segment's first position to row_end[t], excluded (its own position
/// plus one when causal; the end of a bidirectional prefix for a row inside it), less the draft
/// keys its tree hides (trees, when set: batch row_sequence[t], the row at slot row_position[t]).
template <class C, class TK>
struct IndexerInputs {
  const Bf16Kernels* bf16;             // the bfloat16 products (C = float), where permitted
  const C* q;                          // [rows, heads·dim], row stride q_stride
  Index q_stride;                      //
  const C* w;                          // [rows, heads], row stride w_stride
  Index w_stride;                      //
  Index rows, heads, dim;              //
  const KeySegment<TK, TK>* segments;  // one per sequence
  const Index* row_sequence;           // [rows]
  const Index* row_end;                // [rows]
  Index longest;                       // most keys of a segment: the scores' row width
  const TreeMasks* trees;              // the sequences' draft trees, windowless (null: none)
  const Index* row_position;           // [rows], the rows' slots (read with trees only)

  const KeySegment<TK, TK>& segment(Index t) const { return segments[row_sequence[t]]; }
  Index first(Index t) const { return segment(t).first_position; }
  Index end(Index t) const { return std::min(first(t) + segment(t).size(), row_end[t]); }
};

/// A thread's scratch for score_key_block, in values of C (thread_local, kept between calls):
/// a widened key block [Bk, d], the product [H, Bk] and, for the bfloat16 products, the key
/// block packed in pairs (at most (Bk + 64)·⌈d/2⌉ of them: panels of at most 64 keys), each
/// pair one value of C's width or less.
template <class C>
struct IndexerScratch {
  C* widened;
  C* product;
  C* packed;

  template <class TK>
  static IndexerScratch of(const IndexerInputs<C, TK>& in) {
    thread_local std::vector<C> scratch;
    const Index pairs = in.bf16 != nullptr ? (in.dim + 1) / 2 : 0;
    const Index widened = kIndexerKeyBlock * in.dim, product = in.heads * kIndexerKeyBlock;
    const Index packed = (kIndexerKeyBlock + 64) * pairs;
    scratch.resize(static_cast<std::size_t>(widened + product + packed));
    C* const at = scratch.data();
    return {at, at + widened, at + widened + product};
  }
};

/// For the bfloat16 products (C = float, in.bf16 set): query rows [first, first + count) rounded
/// to pairs once, [count, H, ⌈d/2⌉], which every key block's product of those rows reads as
/// they are. Empty otherwise. Allocates count·H·⌈d/2⌉ pairs.
template <class C, class TK>
std::vector<Bf16Pair> rounded_queries(const IndexerInputs<C, TK>& in, Index first, Index count) {
  std::vector<Bf16Pair> rounded;
  if constexpr (std::is_same_v<C, float>) {
    if (in.bf16 != nullptr) {
      const Index pairs = Bf16Kernels::pairs(in.dim), row = in.heads * pairs;
      rounded.resize(static_cast<std::size_t>(count * row));
      for (Index r = 0; r < count; ++r) {
        in.bf16->round_pairs(rounded.data() + r * row, pairs, in.q + (first + r) * in.q_stride,
                             in.dim, in.heads, in.dim);
      }
    }
  }
  return rounded;
}

/// product [H, n] = Q_t [H, d] · Kᵀ for n keys k [n, d] (row stride k.stride): where bf16 is
/// set, on the bfloat16 products (Q_t already rounded to pairs, `q_pairs` [H, ⌈d/2⌉]; the keys
/// rounded to pairs and packed, keys stored as bfloat16 read as they are, from `stored`); else
/// in C (matmul_serial).
template <class C, class TK>
void key_block_products(const IndexerInputs<C, TK>& in, const C* q, const Bf16Pair* q_pairs,
                        const ConstRows<C>& k, const TK* stored, Index stored_stride, Index n,
                        C* packed, C* product) {
  if constexpr (std::is_same_v<C, float>) {
    if (in.bf16 != nullptr) {
      auto* b = reinterpret_cast<Bf16Pair*>(packed);  // NOLINT: scratch floats as pairs
      if constexpr (std::is_same_v<TK, Eigen::bfloat16>) {
        in.bf16->pack_keys_bf16(b, simd_elements(stored), stored_stride, n, in.dim);
      } else {
        in.bf16->pack_keys(b, k.data, k.stride, n, in.dim);
      }
      const Index pairs = Bf16Kernels::pairs(in.dim);
      in.bf16->gemm(product, n, q_pairs, pairs, b, in.bf16->panel, in.bf16->panel * pairs, in.heads,
                    n, pairs, false, nullptr);
      return;
    }
  }
  (void)q_pairs;
  (void)stored;
  (void)stored_stride;
  (void)packed;
  // S = Q_t [H, d] · Kᵀ [d, n]: the keys' rows are the columns of a column-major right side.
  matmul_serial<C, Eigen::ColMajor>(in.heads, n, in.dim, q, in.dim, k.data, k.stride, product, n);
}

/// The scores of query row t against the visible keys of key block `block` (positions
/// [block·Bk, (block + 1)·Bk)), written to scores[position − first(t)]; q_pairs: row t's
/// rounded_queries (read only for the bfloat16 products). Scratch from the calling thread
/// (IndexerScratch).
template <class C, class TK>
void score_key_block(const IndexerInputs<C, TK>& in, Index t, Index block, const Bf16Pair* q_pairs,
                     C* scores) {
  const Index first = std::max(in.first(t), block * kIndexerKeyBlock);
  const Index n = std::min(in.end(t), (block + 1) * kIndexerKeyBlock) - first;
  if (n <= 0) return;
  const IndexerScratch<C> scratch = IndexerScratch<C>::of(in);
  const KeySegment<TK, TK>& keys = in.segment(t);
  const SegmentHead<TK> head(keys.k, keys.pages, 0, 0);
  const Index row = first - keys.first_position;
  const TK* stored = nullptr;
  Index stored_stride = 0;
  if constexpr (std::is_same_v<TK, Eigen::bfloat16>) {
    if (in.bf16 != nullptr) {  // bfloat16 keys feed the pairs as they are (copied if paged)
      TK* const copy = reinterpret_cast<TK*>(scratch.widened);  // NOLINT: scratch, narrower rows
      const ConstRows<TK> rows = stored_rows(head, row, n, copy);
      stored = rows.data;
      stored_stride = rows.stride;
    }
  }
  const ConstRows<C> k =
      stored != nullptr ? ConstRows<C>{nullptr, 0} : rows_as<C>(head, row, n, scratch.widened);
  key_block_products(in, in.q + t * in.q_stride, q_pairs, k, stored, stored_stride, n,
                     scratch.packed, scratch.product);
  const C* w = in.w + t * in.w_stride;
  C* out = scores + (first - keys.first_position);
  std::fill_n(out, n, C(0));
  for (Index j = 0; j < in.heads; ++j) {
    const C* s = scratch.product + j * n;
    const C wj = w[j];
    for (Index i = 0; i < n; ++i) out[i] += wj * std::max(C(0), s[i]);
  }
}

/// Run p of `parts` runs of consecutive keys among n: [p·n / parts, (p + 1)·n / parts).
inline std::pair<Index, Index> key_run(Index p, Index n, Index parts) {
  return {p * n / parts, (p + 1) * n / parts};
}

/// The rank of a score in the selection's order (ORDER above): a NaN ranks as -∞.
template <class C>
C selection_rank(C s) {
  return std::isnan(s) ? -std::numeric_limits<C>::infinity() : s;
}

/// Writes the selection of one row: the min(k, n) best of scores[0, n) (ORDER above) in
/// ascending position (base + index), then -1 up to `width`. Exact and in O(n): the k-th best
/// value t by std::nth_element on a copy of the values (`ranks`, n of scratch), then, in one pass
/// by position, every key above t and the first keys equal to t until k are taken.
template <class C>
void select_top_k(const C* scores, Index n, Index k, Index base, Index width, C* ranks,
                  Index* selected) {
  const auto rank = selection_rank<C>;
  const Index taken = std::min(k, n);
  Index above = 0;  // keys ranked strictly above the k-th best value
  C kth = -std::numeric_limits<C>::infinity();
  if (taken < n) {
    std::transform(scores, scores + n, ranks, rank);
    std::nth_element(ranks, ranks + (taken - 1), ranks + n, std::greater<C>());
    kth = ranks[taken - 1];
    above =
        static_cast<Index>(std::count_if(scores, scores + n, [&](C s) { return rank(s) > kth; }));
  }
  Index ties = taken - above, out = 0;
  for (Index j = 0; j < n && out < taken; ++j) {
    const C r = rank(scores[j]);
    if (taken == n || r > kth || (r == kth && ties-- > 0)) selected[out++] = base + j;
  }
  std::fill(selected + taken, selected + width, Index{-1});
}

/// The taken-th best rank of scores[0, n) (1 <= taken < n), its keys cut into `parts` runs in
/// parallel: each run's own best min(taken, run) ranks by std::nth_element on its copy in
/// `ranks`, then the taken-th best among those (every rank above it, and the rank itself, lie in
/// their run's own best `taken`). Allocates those candidates, at most parts · taken values.
template <class C>
C split_kth_rank(const C* scores, Index n, Index taken, C* ranks, Index parts) {
  parallel_for(parts, [&](Index p) {
    const auto [begin, end] = key_run(p, n, parts);
    std::transform(scores + begin, scores + end, ranks + begin, selection_rank<C>);
    const Index best = std::min(taken, end - begin);
    if (best > 0) {
      std::nth_element(ranks + begin, ranks + begin + (best - 1), ranks + end, std::greater<C>());
    }
  });
  std::vector<C> candidates;
  candidates.reserve(static_cast<std::size_t>(parts * taken));
  for (Index p = 0; p < parts; ++p) {
    const auto [begin, end] = key_run(p, n, parts);
    candidates.insert(candidates.end(), ranks + begin,
                      ranks + begin + std::min(taken, end - begin));
  }
  const auto kth = candidates.begin() + (taken - 1);
  std::nth_element(candidates.begin(), kth, candidates.end(), std::greater<C>());
  return *kth;
}

/// select_top_k for one long row, its keys cut into `parts` runs of consecutive positions that
/// run in parallel (decoding has one row, and the selection would otherwise keep one thread
/// while the others wait). The same selection, whatever `parts`: the k-th best rank t
/// (split_kth_rank); each run's keys above t and equal to t, counted; then each run writes its
/// keys above t and its share of the ties, which go to the first runs first, in ascending
/// position after the runs before it. Allocates split_kth_rank's candidates and 2·parts counts.
template <class C>
void select_top_k_split(const C* scores, Index n, Index k, Index base, Index width, C* ranks,
                        Index* selected, Index parts) {
  const Index taken = std::min(k, n);
  if (taken == n || parts <= 1) {
    select_top_k(scores, n, k, base, width, ranks, selected);
    return;
  }
  const C kth = split_kth_rank(scores, n, taken, ranks, parts);
  // counts[2p]: run p's keys above kth, then its offset; counts[2p + 1]: equal to it, then its
  // share of the ties
  std::vector<Index> counts(static_cast<std::size_t>(2 * parts));
  parallel_for(parts, [&](Index p) {
    const auto [begin, end] = key_run(p, n, parts);
    Index above = 0, equal = 0;  // summed here, not in counts, which the threads share
    for (Index j = begin; j < end; ++j) {
      const C r = selection_rank(scores[j]);
      above += r > kth ? 1 : 0;
      equal += r == kth ? 1 : 0;
    }
    counts[static_cast<std::size_t>(2 * p)] = above;
    counts[static_cast<std::size_t>(2 * p + 1)] = equal;
  });
  Index ties = taken, out = 0;
  for (Index p = 0; p < parts; ++p) ties -= counts[static_cast<std::size_t>(2 * p)];
  for (Index p = 0; p < parts; ++p) {
    Index& above = counts[static_cast<std::size_t>(2 * p)];
    Index& equal = counts[static_cast<std::size_t>(2 * p + 1)];
    equal = std::min(ties, equal);
    ties -= equal;
    out += above + equal;
    above = out - above - equal;
  }
  parallel_for(parts, [&](Index p) {
    const auto [begin, end] = key_run(p, n, parts);
    Index at = counts[static_cast<std::size_t>(2 * p)];
    Index share = counts[static_cast<std::size_t>(2 * p + 1)];
    for (Index j = begin; j < end; ++j) {
      const C r = selection_rank(scores[j]);
      if (r > kth || (r == kth && share-- > 0)) selected[at++] = base + j;
    }
  });
  std::fill(selected + taken, selected + width, Index{-1});
}

/// The scores of rows [first, first + count) into scores (count × longest, row-major; entries
/// past a row's visible keys are left as they are), one task per (row, key block) in one
/// parallel loop, the tasks of a key block next to each other; for the bfloat16 products each
/// row's queries are rounded once before the loop (rounded_queries).
template <class C, class TK>
void score_rows(const IndexerInputs<C, TK>& in, Index first, Index count, C* scores) {
  // A row's keys start anywhere in a block: at most ⌈longest / Bk⌉ + 1 blocks.
  const Index blocks = (in.longest + kIndexerKeyBlock - 1) / kIndexerKeyBlock + 1;
  const std::vector<Bf16Pair> rounded = rounded_queries(in, first, count);
  const Index row_pairs = in.heads * Bf16Kernels::pairs(in.dim);
  parallel_for(blocks * count, [&](Index task) {
    const Index b = task / count, r = task % count;
    const Index t = first + r;
    const Bf16Pair* q_pairs = rounded.empty() ? nullptr : rounded.data() + r * row_pairs;
    score_key_block(in, t, in.first(t) / kIndexerKeyBlock + b, q_pairs, scores + r * in.longest);
  });
}

/// The draft keys a row of a draft tree keeps (DRAFT TREES above): where they start among the
/// row's keys and their slots, ascending (a tree holds at most DraftTree::kMaxTokens).
struct KeptDraftKeys {
  bool active = false;  // the row belongs to a tree
  Index from = 0;       // index of the first draft key among the row's keys
  Index count = 0;      // draft keys kept
  std::array<Index, DraftTree::kMaxTokens> slots{};

  /// A selection of `taken` keys of the row with the hidden keys dropped, its first key at
  /// `base`, mapped back to slots: base + from + j -> slots[j].
  void restore(Index* selected, Index taken, Index base) const {
    if (!active) return;
    for (Index j = 0; j < taken; ++j) {
      const Index at = selected[j] - base - from;
      if (at >= 0) selected[j] = slots[static_cast<std::size_t>(at)];
    }
  }
};

/// Drops from row t's scores[0, n) (keys first(t) + j) the draft keys its tree hides, those
/// after them moved down in order, their slots kept in `kept`; returns the number of keys left.
/// The committed keys stay: a windowless tree hides none of them.
template <class C, class TK>
Index drop_hidden_draft_keys(const IndexerInputs<C, TK>& in, Index t, C* scores, Index n,
                             KeptDraftKeys& kept) {
  const Index b = in.row_sequence[t];
  if (in.trees == nullptr || b >= in.trees->size()) return n;
  const Index base = in.first(t);
  kept.active = true;
  kept.from = std::clamp(in.trees->first(b) - base, Index{0}, n);
  Index left = kept.from;
  for (Index j = kept.from; j < n; ++j) {
    if (!in.trees->allows(b, in.row_position[t], base + j)) continue;
    APEX_ASSERT(kept.count < DraftTree::kMaxTokens);  // allowed keys past first are draft keys
    kept.slots[static_cast<std::size_t>(kept.count++)] = base + j;
    scores[left++] = scores[j];
  }
  return left;
}

/// The whole kernel: every row's scores, kIndexerRows rows at a time, and its selection of
/// the top `k` into selected [rows, width].
template <class C, class TK>
void indexer_select(const IndexerInputs<C, TK>& in, Index k, KeySelection& selected) {
  const Index width = selected.cols();
  const auto held = static_cast<std::size_t>(std::min(in.rows, kIndexerRows) * in.longest);
  std::vector<C> scores(held), ranks(held);
  for (Index first = 0; first < in.rows; first += kIndexerRows) {
    const Index count = std::min(kIndexerRows, in.rows - first);
    score_rows(in, first, count, scores.data());
    const auto select = [&](Index r, Index parts) {
      const Index t = first + r;
      C* const row = scores.data() + r * in.longest;
      Index* const out = selected.row(t).data();
      KeptDraftKeys kept;
      const Index n =
          drop_hidden_draft_keys(in, t, row, std::max<Index>(0, in.end(t) - in.first(t)), kept);
      select_top_k_split(row, n, k, in.first(t), width, ranks.data() + r * in.longest, out, parts);
      kept.restore(out, std::min(k, n), in.first(t));
    };
    if (count == 1) {
      select(0, max_threads());  // one row (decoding): its keys split over the threads
    } else {
      parallel_for(count, [&](Index r) { select(r, 1); });
    }
  }
}

/// Every row's scores [rows, longest] (column j: the sequence's key first + j), −∞ past a row's
/// visible keys (for inspection and tests: the values indexer_select ranks).
template <class C, class TK>
RowMatrix<C> indexer_scores(const IndexerInputs<C, TK>& in) {
  RowMatrix<C> scores =
      RowMatrix<C>::Constant(in.rows, in.longest, -std::numeric_limits<C>::infinity());
  for (Index first = 0; first < in.rows; first += kIndexerRows) {
    score_rows(in, first, std::min(kIndexerRows, in.rows - first), scores.row(first).data());
  }
  return scores;
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
