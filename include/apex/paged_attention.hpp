// SPDX-License-Identifier: MIT
// Attention over paged K/V (vLLM's PagedAttention; §6.2, §8.2 per sequence): sdpa_paged over the
// held tokens of the sequences of a paged cache (page_pool.hpp), sdpa_block_tables over a pool and
// block tables of the caller's own, and the checks of a layer's step over a paged cache. Each
// sequence's queries are its last tokens and attend over its keys as sdpa would over the same
// tokens stored contiguously, bit for bit:
//   out_i = Σ_j softmax_j(s_ij) v_j, keys j read through the block table, page by page, without
//   gathering them (a paged detail::KeySegment of the kernel)
//   q: [1, H_q, total_q, d_qk], the sequences packed along the rows -> out: [1, H_q, total_q, d_v]
// K and V may be stored in any K/V format (kv_format.hpp, kv_quant.hpp): the kernel widens them a
// block at a time as it reads the pages, so attention over a quantized paged cache is attention
// over the values its rows decode to, bit for bit.
// Allocates a few records per sequence; scratch as for sdpa_varlen (varlen.hpp).
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/kv_format.hpp>
#include <apex/mask.hpp>
#include <apex/page_pool.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

namespace detail {

/// Throws unless every id names a live sequence of `cache`, in a message that names the call
/// `op` and the argument (the cache's own lookups would name the cache).
template <class Cache>
void check_live_ids(const Cache& cache, const std::vector<SequenceId>& ids, const char* op) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    APEX_CHECK(cache.contains(ids[i]), "[" << op << "] ids[" << i << "]: sequence " << ids[i]
                                           << " does not exist in the cache (never added, or "
                                              "freed)");
  }
}

/// Throws unless `rule` leaves the positions to the cache (no query_offset, key_offset 0).
inline void check_cache_rule(const PositionMask& rule, Index i, const char* op) {
  APEX_CHECK(!rule.query_offset && rule.key_offset == 0,
             "[" << op << "] masks[" << i
                 << "] sets query_offset or key_offset; over a paged cache "
                 << "the positions are the sequence's own (its queries are its last S_q tokens)");
}

/// The checks of a layer's step over a paged cache (GroupedQueryAttention::forward_paged and
/// MultiHeadLatentAttention::forward_paged): rows [cu[i], cu[i + 1]) of an input of `rows` rows
/// are the next tokens of the distinct live sequences ids[i]; each rule leaves the positions to
/// the cache and holds for the sequence once its tokens are appended; the RoPE table (when
/// given) covers every new position; the pool has room for them all. Returns the position of
/// every row: length(ids[i]) + s, or `given` (checked: one per row, none before its sequence's
/// length, each below the table's max_positions). Allocates it.
template <class Cache, class Table>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, one caller per layer
Vector<Index> paged_step_positions(Index rows, const std::vector<Index>& cu,
                                   const std::vector<SequenceId>& ids,
                                   const std::vector<PositionMask>& masks, const Cache& cache,
                                   const Table* rope, const char* op,
                                   const Vector<Index>* given = nullptr) {
  const auto n = static_cast<Index>(ids.size());
  check_offsets(cu, n, rows, op, "cu_seqlens");
  check_mask_count(masks, n, op);
  Vector<Index> positions(rows);
  std::vector<std::pair<SequenceId, Index>> appends;
  check_live_ids(cache, ids, op);
  for (Index i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const Index tokens = cu[at + 1] - cu[at];
    const Index length = cache.length(ids[at]);
    APEX_CHECK(rope == nullptr ||
                   (tokens <= rope->max_positions() && length <= rope->max_positions() - tokens),
               "[" << op << "] positions [" << length << ", " << length << " + " << tokens
                   << ") of sequence " << ids[at] << " must be below the RoPE table's "
                   << "max_positions (" << (rope ? rope->max_positions() : 0) << ")");
    PositionMask rule = masks[masks.size() == 1 ? 0 : at];
    check_cache_rule(rule, masks.size() == 1 ? 0 : i, op);
    rule.key_offset = cache.first_position(ids[at]);
    check_sequence_rule(rule, tokens, length + tokens - rule.key_offset, "sequence", ids[at].value,
                        op);
    for (Index s = 0; s < tokens; ++s) positions(cu[at] + s) = length + s;
    appends.emplace_back(ids[at], tokens);
  }
  cache.check_appends(appends, op);
  if (given == nullptr) return positions;
  APEX_CHECK(given->size() == rows, "[" << op << "] row_positions holds " << given->size()
                                        << " positions; expected one per row (" << rows << ")");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (cu[i] == cu[i + 1]) continue;
    const Index length = positions(cu[i]);  // the sequence's next position
    for (Index r = cu[i]; r < cu[i + 1]; ++r) {
      const Index p = (*given)(r);
      APEX_CHECK(p >= length && (rope == nullptr || p < rope->max_positions()),
                 "[" << op << "] row_positions[" << r << "] (" << p << ") must be >= " << length
                     << " (sequence " << ids[i] << "'s length: positions do not go back)"
                     << (rope ? " and below the RoPE table's max_positions (" : "")
                     << (rope ? std::to_string(rope->max_positions()) + ")" : ""));
    }
  }
  return *given;
}

}  // namespace detail

namespace detail {

/// The checks on the shapes of a call over a paged cache (sdpa_paged, sdpa_sparse_paged): q
/// packs the sequences along its rows (batch 1), and q, out and lse fit the cache's key and value
/// widths and heads (check_sdpa). Returns the cache's keys and values as views of no rows,
/// [1, H_kv, 0, width in elements of the cache's format], for the checks that follow.
template <class TQ, class Cache, class TO>
auto check_paged_shapes(const HeadsView<const TQ>& q, const Cache& cache, const SdpaParams& params,
                        const HeadsView<TO>& out, const HeadsView<TO>& lse, const char* op) {
  using Storage = typename Cache::StorageType;
  APEX_CHECK(q.batch() == 1, "[" << op << "] q batch (" << q.batch()
                                 << ") must be 1: the sequences are packed along the rows");
  // The widths in elements of the cache's format: check_sdpa compares their values (row_values).
  const HeadsView<const Storage> k_shape = shape_only_view<const Storage>(
      {1, cache.num_kv_heads(), 0, KvFormat<Storage>::elements(cache.key_dim())});
  const HeadsView<const Storage> v_shape = shape_only_view<const Storage>(
      {1, cache.num_kv_heads(), 0, KvFormat<Storage>::elements(cache.value_dim())});
  check_sdpa(q, k_shape, v_shape, AttentionMask<TO>{}, params, out, lse, op);
  return std::pair<HeadsView<const Storage>, HeadsView<const Storage>>{k_shape, v_shape};
}

/// Every check of sdpa_paged (named `op` in the messages), then the views of each sequence
/// alone: its query rows, its held keys, its rule at its positions, its output rows and its rows
/// of the dense masks (see sdpa_varlen for their layout: row r is query row r of q, column j the
/// sequence's j-th held key). Allocates the views.
template <class TQ, class Cache, class TO, class TB = TQ>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_paged
std::vector<SequenceViews<TQ, typename Cache::StorageType, typename Cache::StorageType, TO, TB>>
paged_sequence_views(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                     const Cache& cache, const std::vector<SequenceId>& ids,
                     const std::vector<PositionMask>& masks, const SdpaParams& params,
                     const HeadsView<TO>& out, const HeadsView<TO>& lse,
                     const AttentionMask<TB>& mask, const char* op) {
  using Storage = typename Cache::StorageType;
  const auto n = static_cast<Index>(ids.size());
  const auto [k_shape, v_shape] = check_paged_shapes(q, cache, params, out, lse, op);
  check_offsets(cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  check_mask_count(masks, n, op);
  check_live_ids(cache, ids, op);
  Index longest = 0;  // the most keys of a sequence
  for (const SequenceId id : ids) longest = std::max(longest, cache.segment(id).size());
  check_batch_masks(mask, q.shape(), longest, true, op);
  // The outputs against q, and against the whole of the cache (every pool and block table): the
  // check does not depend on which sequences are named, their order or their lengths.
  check_no_overlap(q, k_shape, v_shape, out, lse, op);
  cache.check_not_aliased(out, op, "out");
  cache.check_not_aliased(lse, op, "lse");
  std::vector<SequenceViews<TQ, Storage, Storage, TO, TB>> sequences(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const Index q0 = cu_seqlens_q[at], nq = cu_seqlens_q[at + 1] - q0;
    const Index length = cache.length(ids[at]);
    APEX_CHECK(nq <= length, "[" << op << "] sequence " << ids[at] << " has " << nq
                                 << " queries but holds " << length
                                 << " tokens; its queries must be its last tokens");
    PositionMask rule = masks[masks.size() == 1 ? 0 : at];
    check_cache_rule(rule, masks.size() == 1 ? 0 : i, op);
    const auto keys = cache.segment(ids[at]);
    rule.key_offset = keys.first_position;
    check_sequence_rule(rule, nq, keys.size(), "sequence", ids[at].value, op);
    sequences[at] = {q.middle_rows(q0, nq),
                     keys,
                     rule,
                     out.middle_rows(q0, nq),
                     lse.empty() ? HeadsView<TO>() : lse.middle_rows(q0, nq),
                     sequence_mask_rows(mask.allowed, 0, q0, nq, keys.size()),
                     sequence_mask_rows(mask.bias, 0, q0, nq, keys.size())};
  }
  return sequences;
}

/// The whole of sdpa_paged, with the dense masks and user rules of its other overloads.
template <class TQ, class Cache, class TO, class TB = TQ, class R = NoRules>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_paged
void flash_sdpa_paged(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                      const Cache& cache, const std::vector<SequenceId>& ids,
                      const std::vector<PositionMask>& masks, const SdpaParams& params,
                      const HeadsView<TO>& out, const HeadsView<TO>& lse,
                      const AttentionMask<TB>& mask = {}, const R& user_rules = {}) {
  attend_sequences(paged_sequence_views(q, cu_seqlens_q, cache, ids, masks, params, out, lse, mask,
                                        "sdpa_paged"),
                   params, {}, user_rules);
}

/// Throws unless sequence i's block table holds its `length` tokens in pages of `page` tokens of
/// a pool of `pool` pages, and its nq queries are among them.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, one caller
inline void check_block_table(const std::vector<Index>& table, Index i, Index length, Index nq,
                              Index page, Index pool, const char* op) {
  APEX_CHECK(length >= nq && static_cast<Index>(table.size()) >= pages_holding(length, page),
             "[" << op << "] sequence " << i << " holds " << length << " tokens in " << table.size()
                 << " pages of " << page << "; it needs >= " << nq
                 << " tokens (its queries are its last ones) and ⌈length / page⌉ pages");
  for (std::size_t j = 0; j < table.size(); ++j) {
    APEX_CHECK(table[j] >= 0 && table[j] < pool,
               "[" << op << "] block_tables[" << i << "][" << j << "] (" << table[j]
                   << ") points outside the pool of " << pool << " pages");
  }
}

/// The checks of sdpa_block_tables on the pools, the tables and the outputs (the per-sequence
/// ones are check_block_table's).
template <class TQ, class TK, class TV, class TO>
void check_block_tables(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                        const BlockTables<TK, TV>& pages, const std::vector<PositionMask>& masks,
                        const SdpaParams& params, const HeadsView<TO>& out,
                        const HeadsView<TO>& lse, const char* op) {
  const HeadsView<const TK>& k = pages.k_pages;
  const HeadsView<const TV>& v = pages.v_pages;
  APEX_CHECK(q.batch() == 1, "[" << op << "] q batch (" << q.batch()
                                 << ") must be 1: the sequences are packed along the rows");
  APEX_CHECK(k.batch() == v.batch() && k.seq() == v.seq() && k.seq() >= 1,
             "[" << op << "] k_pages [" << k.batch() << ", " << k.heads() << ", " << k.seq() << ", "
                 << k.dim() << "] and v_pages [" << v.batch() << ", " << v.heads() << ", "
                 << v.seq() << ", " << v.dim()
                 << "] must have the same pages of the same size (>= 1)");
  check_sdpa(q, k.middle_rows(0, 0).middle_batches(0, 1), v.middle_rows(0, 0).middle_batches(0, 1),
             AttentionMask<TO>{}, params, out, lse, op);
  const auto n = static_cast<Index>(pages.lengths.size());
  APEX_CHECK(static_cast<Index>(pages.block_tables.size()) == n,
             "[" << op << "] block_tables (" << pages.block_tables.size() << ") and lengths (" << n
                 << ") must have one entry per sequence");
  check_offsets(cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  check_mask_count(masks, n, op);
  check_no_overlap(q, k, v, out, lse, op);
  for (std::size_t i = 0; i < pages.block_tables.size(); ++i) {  // read while out is written
    const ByteRange table = byte_range(pages.block_tables[i]);
    APEX_CHECK(!table.overlaps(byte_range(out)) && !table.overlaps(byte_range(lse)),
               "[" << op << "] the outputs must not share memory with block_tables[" << i << "]");
  }
}

/// The whole of sdpa_block_tables, with the dense masks and user rules of its other overloads
/// (column j of the masks: the sequence's key j).
template <class TQ, class TK, class TV, class TO, class TB = TQ, class R = NoRules>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of the call
void flash_sdpa_block_tables(const HeadsView<const TQ>& q, const std::vector<Index>& cu_seqlens_q,
                             const BlockTables<TK, TV>& pages,
                             const std::vector<PositionMask>& masks, const SdpaParams& params,
                             const HeadsView<TO>& out, const HeadsView<TO>& lse,
                             const AttentionMask<TB>& mask = {}, const R& user_rules = {}) {
  const char* op = "sdpa_block_tables";
  check_block_tables(q, cu_seqlens_q, pages, masks, params, out, lse, op);
  const Index longest =
      pages.lengths.empty() ? 0 : *std::max_element(pages.lengths.begin(), pages.lengths.end());
  check_batch_masks(mask, q.shape(), std::max<Index>(0, longest), true, op);
  const Index page = pages.k_pages.seq();
  const auto n = static_cast<Index>(pages.lengths.size());
  std::vector<SequenceViews<TQ, TK, TV, TO, TB>> sequences(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const Index q0 = cu_seqlens_q[at], nq = cu_seqlens_q[at + 1] - q0;
    const Index length = pages.lengths[at];
    const std::vector<Index>& table = pages.block_tables[at];
    check_block_table(table, i, length, nq, page, pages.k_pages.batch(), op);
    const PositionMask& rule = masks[masks.size() == 1 ? 0 : at];
    check_cache_rule(rule, masks.size() == 1 ? 0 : i, op);
    check_sequence_rule(rule, nq, length, "sequence", i, op);
    sequences[at] = {q.middle_rows(q0, nq),
                     paged_segment(pages.k_pages, pages.v_pages, 0, table.data(), length),
                     rule,
                     out.middle_rows(q0, nq),
                     lse.empty() ? HeadsView<TO>() : lse.middle_rows(q0, nq),
                     sequence_mask_rows(mask.allowed, 0, q0, nq, length),
                     sequence_mask_rows(mask.bias, 0, q0, nq, length)};
  }
  attend_sequences(sequences, params, {}, user_rules);
}

}  // namespace detail

/// Attention of many sequences of a paged cache (PagedKvCache, or PagedLatentCache for absorbed
/// MLA), each over its own held tokens, read through its block table (§6.2, §8.2 per sequence):
/// the queries of sequence ids[i] are rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of q and are
/// its last S_q tokens, already appended (so a decoding step is: append each sequence's new
/// token, then one sdpa_paged over all of them). masks[i] (or masks[0] for all) is applied on
/// the sequence's absolute positions; its query_offset and key_offset must be unset: the cache
/// gives them. Equals sdpa over the same tokens stored contiguously, bit for bit (except with
/// APEX_EIGEN_PUBLIC_ONLY: to rounding), for any number of threads, and over a cache of a block
/// format sdpa over the values its rows decode to.
///   q: [1, H_q, total_q, d_qk] (d_qk = cache.key_dim(); H_q a multiple of cache.num_kv_heads())
///   -> out: [1, H_q, total_q, d_v] (d_v = cache.value_dim()), lse (optional): [1, H_q, total_q,
///   1].
/// Every check runs first (offsets, live ids, S_q <= the sequence's length, each rule, shapes,
/// outputs that must not share memory with q or with any page or block table of the cache,
/// whatever sequences are named) and a failed call changes nothing.
/// Allocates a few records per sequence; scratch as for sdpa_varlen. An id may appear more than
/// once.
template <class Q, class Cache, class TO>
void sdpa_paged(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q, const Cache& cache,
                const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                const SdpaParams& params, const HeadsView<TO>& out, const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_paged<std::remove_const_t<Q>>(q, cu_seqlens_q, cache, ids, masks, params, out,
                                                   lse);
}

/// sdpa_paged with dense masks: mask.allowed and mask.bias are [1, 1 or H_q, total_q, ≥ the most
/// keys a named sequence holds], row r the query row r of q and column j the j-th held key of
/// that row's own sequence (position first_position + j), applied as sdpa applies them;
/// mask.positions must stay the default (the position masks are `masks`). Otherwise as sdpa_paged.
template <class Q, class Cache, class TB, class TO>
void sdpa_paged(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q, const Cache& cache,
                const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<TO>& out,
                const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_paged<std::remove_const_t<Q>, Cache, TO, TB>(q, cu_seqlens_q, cache, ids,
                                                                  masks, params, out, lse, mask);
}

/// sdpa_paged with dense masks and the user's rules (attention_rules.hpp), which see the
/// sequence ids[i] as batch i, at its absolute positions.
template <class Q, class Cache, class TB, class TO, class A, class C, class S>
void sdpa_paged(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q, const Cache& cache,
                const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                const AttentionMask<TB>& mask, const SdpaParams& params,
                const AttentionRules<A, C, S>& user_rules, const HeadsView<TO>& out,
                const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_paged<std::remove_const_t<Q>, Cache, TO, TB>(
      q, cu_seqlens_q, cache, ids, masks, params, out, lse, mask, user_rules);
}

/// sdpa_paged over a pool and block tables of the caller's (BlockTables): the queries of
/// sequence i are rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of q and are its last S_q tokens,
/// at positions lengths[i] − S_q + s; masks[i] (or masks[0]) as for sdpa_paged. Checks first
/// (the pools' shapes, one table and length per sequence, every page of a table inside the pool,
/// S_q <= lengths[i], the masks, the outputs) and changes nothing when one fails. Equals sdpa
/// over the same tokens stored contiguously, as sdpa_paged does; pools of a block format hold
/// rows of d_qk / kValuesPerElement blocks (the key width compared with q is their values).
///   q: [1, H_q, total_q, d_qk] -> out: [1, H_q, total_q, d_v], lse (optional).
template <class Q, class TK, class TV, class TO>
void sdpa_block_tables(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q,
                       const BlockTables<TK, TV>& pages, const std::vector<PositionMask>& masks,
                       const SdpaParams& params, const HeadsView<TO>& out,
                       const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_block_tables<std::remove_const_t<Q>>(q, cu_seqlens_q, pages, masks, params,
                                                          out, lse);
}

/// sdpa_block_tables with dense masks (column j: key j of the row's own sequence; layout and
/// checks as for sdpa_paged's).
template <class Q, class TK, class TV, class TB, class TO>
void sdpa_block_tables(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q,
                       const BlockTables<TK, TV>& pages, const std::vector<PositionMask>& masks,
                       const AttentionMask<TB>& mask, const SdpaParams& params,
                       const HeadsView<TO>& out, const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_block_tables<std::remove_const_t<Q>, TK, TV, TO, TB>(
      q, cu_seqlens_q, pages, masks, params, out, lse, mask);
}

/// sdpa_block_tables with dense masks and the user's rules, which see sequence i as batch i.
template <class Q, class TK, class TV, class TB, class TO, class A, class C, class S>
void sdpa_block_tables(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q,
                       const BlockTables<TK, TV>& pages, const std::vector<PositionMask>& masks,
                       const AttentionMask<TB>& mask, const SdpaParams& params,
                       const AttentionRules<A, C, S>& user_rules, const HeadsView<TO>& out,
                       const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_block_tables<std::remove_const_t<Q>, TK, TV, TO, TB>(
      q, cu_seqlens_q, pages, masks, params, out, lse, mask, user_rules);
}

}  // namespace apex
