// SPDX-License-Identifier: MIT
// Attention over a selection of keys per query (DeepSeek Sparse Attention's second half: MLA
// over the top-k keys a lightning indexer picked, indexer.hpp): query row i of batch b attends
// to the keys listed in row b·S_q + i of a KeySelection only,
//   out[b, h, i] = Σ_{j ∈ sel(b, i)} e^(s_ij) v_j / (e^(sink_h) + Σ_{j ∈ sel(b, i)} e^(s_ij))
// with s_ij the logit of apex::sdpa (scale·q·k_j, soft-capped), over the selected keys in
// ascending order: exactly sdpa with a dense mask that allows the selected keys and nothing else
// (a test checks it), without forming that mask and without reading an unselected row.
//
//   selection [B*S_q, k]          k [B, H_kv, S_k, d_qk]
//   row b*S_q + i:  3 9 10 -1 -1   ──▶ rows 3, 9 and 10 of batch b's keys and values, read in
//                                      place (every head of them), the two slots after unused
//
// Each query row is a problem of its own, whose keys are a paged segment (kv_read.hpp) of pages
// of one row: its block table is its row of the selection, so the kernel reads the rows where
// they are, widening them from their format (kv_format.hpp) as it does for every paged read, and
// the row's result is sdpa's over those keys stored contiguously, bit for bit (to rounding with
// APEX_EIGEN_PUBLIC_ONLY, as for every paged read: kv_read.hpp). With every
// visible key selected (decoding: every cached row; a causal prompt: keys 0..i) the result is
// that of causal sdpa.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/key_selection.hpp>
#include <apex/mask.hpp>
#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
#include <apex/sdpa.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <type_traits>
#include <vector>

namespace apex {

namespace detail {

/// Batch b of a [B, H, S, d] view as a pool of pages of one row each, [S, H, 1, d]: page j is
/// row j of every head (a paged KeySegment over it with a block table of row indices reads
/// those rows in place).
template <class T>
HeadsView<const T> rows_as_pages(const HeadsView<const T>& view, Index b) {
  const Index bb = view.batch() == 1 ? 0 : b;
  const T* first = view.seq() == 0 ? view.data() : view.data() + bb * view.batch_stride();
  return HeadsView<const T>(first, {view.seq(), view.heads(), 1, view.dim()},
                            {view.row_stride(), view.head_stride(), view.row_stride()});
}

/// Every check of sdpa_sparse (before anything is written).
template <class TQ, class TK, class TV, class TO>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_sparse
void check_sdpa_sparse(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                       const HeadsView<const TV>& v, const KeySelection& selected,
                       const SdpaParams& params, const HeadsView<TO>& out, const HeadsView<TO>& lse,
                       const char* op) {
  check_sdpa(q, k, v, AttentionMask<TO>{}, params, out, lse, op);
  APEX_CHECK(params.alibi_slopes.empty(),
             "[" << op << "] alibi_slopes (" << params.alibi_slopes.size()
                 << " slopes) must be empty: ALiBi needs key positions, a selection gives rows");
  check_selection(selected, checked_product(q.batch(), q.seq(), op, "B*S_q"), k.seq(), op);
  check_no_overlap(q, k, v, out, lse, op);
  for (const auto& o : {out, lse}) {
    APEX_CHECK(!matrix_byte_range(selected).overlaps(byte_range(o)),
               "[" << op << "] the outputs must not share memory with the selection");
  }
}

/// The query rows of sdpa_sparse as sequences of one query each, whose keys are their selected
/// rows (rows_as_pages with the selection's row as block table). Allocates the views.
template <class TQ, class TK, class TV, class TO>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_sparse
std::vector<SequenceViews<TQ, TK, TV, TO>> selected_sequences(
    const HeadsView<const TQ>& q, const HeadsView<const TK>& k, const HeadsView<const TV>& v,
    // NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
    const KeySelection& selected, const HeadsView<TO>& out, const HeadsView<TO>& lse) {
  std::vector<SequenceViews<TQ, TK, TV, TO>> sequences;
  sequences.reserve(static_cast<std::size_t>(q.batch() * q.seq()));
  for (Index b = 0; b < q.batch(); ++b) {
    const HeadsView<const TK> k_pages = rows_as_pages(k, b);
    const HeadsView<const TV> v_pages = rows_as_pages(v, b);
    for (Index i = 0; i < q.seq(); ++i) {
      const Index r = b * q.seq() + i;
      const Index n = selected_count(selected, r);
      const HeadsView<TO> lse_row =
          lse.empty() ? HeadsView<TO>() : lse.middle_batches(b, 1).middle_rows(i, 1);
      sequences.push_back({q.middle_batches(b, 1).middle_rows(i, 1),
                           paged_segment(k_pages, v_pages, 0, selected.row(r).data(), n),
                           PositionMask{}, out.middle_batches(b, 1).middle_rows(i, 1), lse_row});
    }
  }
  return sequences;
}

/// Whether a paged segment's pools can be read as pools of one-row pages (rows_as_pages): their
/// pages follow one another row by row within each head, as the caches of page_pool.hpp store
/// them (head-major, [H, pages, page_size, width]).
template <class TK, class TV>
bool pages_as_rows(const KeySegment<TK, TV>& held) {
  const auto one_run = [](const auto& pool) {
    return pool.batch() <= 1 || pool.batch_stride() == pool.seq() * pool.row_stride();
  };
  return held.pages == nullptr || (one_run(held.k) && one_run(held.v));
}

/// Row r of `selected` (positions of a sequence whose held keys are `held`) as rows of the
/// sequence's pool of one-row pages, written to `rows`; returns their count.
template <class TK, class TV>
Index pool_rows_of(const KeySegment<TK, TV>& held, const KeySelection& selected, Index r,
                   Index* rows) {
  const Index n = selected_count(selected, r);
  const Index page = held.pages == nullptr ? 0 : held.k.seq();
  for (Index j = 0; j < n; ++j) {
    const Index at = selected(r, j) - held.first_position;
    rows[j] = page == 0 ? at : held.pages[at / page] * page + at % page;
  }
  return n;
}

/// Throws unless row r of `selected` lists positions of the held keys `held` of sequence `id`
/// (ascending, in [first_position, first_position + size), then -1).
template <class TK, class TV>
void check_selected_positions(const KeySelection& selected, Index r, const KeySegment<TK, TV>& held,
                              SequenceId id, const char* op) {
  const Index n = selected_count(selected, r);
  const Index first = held.first_position, end = held.first_position + held.size();
  for (Index j = 0; j < selected.cols(); ++j) {
    const Index p = selected(r, j);
    const bool valid =
        j < n ? p >= first && p < end && (j == 0 || p > selected(r, j - 1)) : p == -1;
    APEX_CHECK(valid, "[" << op << "] selection(" << r << ", " << j << ") (" << p << ") must be "
                          << (j < n ? "a held position of sequence " : "-1")
                          << (j < n ? std::to_string(id.value) + " in [" + std::to_string(first) +
                                          ", " + std::to_string(end) + ") above the entry before it"
                                    : ": an unused slot ends its row"));
  }
}

/// Every check of sdpa_sparse_paged (shapes, offsets, live ids, every selected position held by
/// its row's sequence, outputs apart from q, the selection and the pages).
template <class TQ, class Cache, class TO>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of the call
void check_sdpa_sparse_paged(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                             const Cache& cache, const std::vector<SequenceId>& ids,
                             const KeySelection& selected, const SdpaParams& params,
                             const HeadsView<TO>& out, const HeadsView<TO>& lse, const char* op) {
  const auto [k_shape, v_shape] = check_paged_shapes(q, cache, params, out, lse, op);
  APEX_CHECK(params.alibi_slopes.empty(),
             "[" << op << "] alibi_slopes (" << params.alibi_slopes.size()
                 << " slopes) must be empty: ALiBi needs key positions, a selection gives rows");
  const auto n = static_cast<Index>(ids.size());
  check_offsets(cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  check_live_ids(cache, ids, op);
  APEX_CHECK(selected.rows() == q.seq(),
             "[" << op << "] selection has " << selected.rows()
                 << " rows; expected one per query row, total_q = " << q.seq());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto held = cache.segment(ids[i]);
    APEX_ASSERT(pages_as_rows(held));
    for (Index r = cu_seqlens_q[i]; r < cu_seqlens_q[i + 1]; ++r) {
      check_selected_positions(selected, r, held, ids[i], op);
    }
  }
  check_no_overlap(q, k_shape, v_shape, out, lse, op);
  for (const auto& o : {out, lse}) {
    APEX_CHECK(!matrix_byte_range(selected).overlaps(byte_range(o)),
               "[" << op << "] the outputs must not share memory with the selection");
  }
  cache.check_not_aliased(out, op, "out");
  cache.check_not_aliased(lse, op, "lse");
}

/// The query rows of sdpa_sparse_paged as sequences of one query each, over their selected rows
/// of the pool (written to `rows`, [total_q, k], the kernel's block tables). Allocates the views.
template <class TQ, class Cache, class TO>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of the call
auto paged_selected_sequences(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                              const Cache& cache, const std::vector<SequenceId>& ids,
                              const KeySelection& selected, const HeadsView<TO>& out,
                              const HeadsView<TO>& lse, KeySelection& rows) {
  using Storage = typename Cache::StorageType;
  std::vector<SequenceViews<TQ, Storage, Storage, TO>> sequences;
  sequences.reserve(static_cast<std::size_t>(q.seq()));
  rows.resize(selected.rows(), selected.cols());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto held = cache.segment(ids[i]);
    const HeadsView<const Storage> k_pages = rows_as_pages(held.k, 0);
    const HeadsView<const Storage> v_pages = rows_as_pages(held.v, 0);
    for (Index r = cu_seqlens_q[i]; r < cu_seqlens_q[i + 1]; ++r) {
      Index* table = rows.row(r).data();
      const Index count = pool_rows_of(held, selected, r, table);
      sequences.push_back({q.middle_rows(r, 1), paged_segment(k_pages, v_pages, 0, table, count),
                           PositionMask{}, out.middle_rows(r, 1),
                           lse.empty() ? HeadsView<TO>() : lse.middle_rows(r, 1)});
    }
  }
  return sequences;
}

}  // namespace detail

/// Scaled dot-product attention of every query row over its own selection of keys (see the top
/// of this header): out[b, h, i] = softmax over j ∈ selected(b·S_q + i) of scale·q·k_j
/// (soft-capped, with the head's sink in the denominator) applied to v_j. The keys are read in
/// place through the selection, one row per page (kv_read.hpp); a row's result equals sdpa's
/// over its selected keys in ascending order, bit for bit (to rounding with
/// APEX_EIGEN_PUBLIC_ONLY), and the same bits for any number of threads.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v] (any K/V format),
///   selected: [B*S_q, k] (KeySelection), params: scale, softcap and sinks (ALiBi is rejected:
///   a selection gives rows, not positions) -> out: [B, H_q, S_q, d_v], lse (optional):
///   [B, H_q, S_q, 1].
/// Every check runs first (shapes; every selection row strictly ascending in [0, S_k), then -1;
/// outputs that share no memory with an input or the selection) and a failed call changes
/// nothing. Allocates one problem record per query row; scratch as for sdpa_varlen.
template <class Q, class K, class V, class TO>
void sdpa_sparse(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                 const KeySelection& selected, const SdpaParams& params, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) {
  using TQ = std::remove_const_t<Q>;
  using TK = std::remove_const_t<K>;
  using TV = std::remove_const_t<V>;
  detail::require_storage_type<TQ>();
  detail::require_kv_format<TK>();
  detail::require_kv_format<TV>();
  detail::require_storage_type<TO>();
  const HeadsView<const TQ> qc(q);
  const HeadsView<const TK> kc(k);
  const HeadsView<const TV> vc(v);
  detail::check_sdpa_sparse(qc, kc, vc, selected, params, out, lse, "sdpa_sparse");
  detail::attend_sequences(detail::selected_sequences(qc, kc, vc, selected, out, lse), params, {});
}

/// sdpa_sparse over sequences of a paged cache (page_pool.hpp), reading each selected row in its
/// page: the queries of sequence ids[i] are rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of q, and
/// row r of `selected` lists, ascending, positions that sequence holds ([first_position,
/// length)), then -1. Each row's result is sdpa_sparse's over the same rows stored contiguously,
/// bit for bit. Works on PagedLatentCache (absorbed MLA) and PagedKvCache alike.
///   q: [1, H_q, total_q, d_qk], selected: [total_q, k] -> out: [1, H_q, total_q, d_v], lse
///   (optional): [1, H_q, total_q, 1].
/// Every check runs first and a failed call changes nothing. Allocates the selection's rows in
/// the pool ([total_q, k]) and one problem record per query row.
template <class Q, class Cache, class TO>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of sdpa_paged's arguments
void sdpa_sparse_paged(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q,
                       const Cache& cache, const std::vector<SequenceId>& ids,
                       const KeySelection& selected, const SdpaParams& params,
                       const HeadsView<TO>& out, const HeadsView<TO>& lse = {}) {
  using TQ = std::remove_const_t<Q>;
  detail::require_storage_type<TQ>();
  detail::require_storage_type<TO>();
  const HeadsView<const TQ> qc(q);
  const char* op = "sdpa_sparse_paged";
  detail::check_sdpa_sparse_paged(qc, cu_seqlens_q, cache, ids, selected, params, out, lse, op);
  KeySelection rows;
  detail::attend_sequences(
      detail::paged_selected_sequences(qc, cu_seqlens_q, cache, ids, selected, out, lse, rows),
      params, {});
}

}  // namespace apex
