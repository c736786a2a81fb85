// SPDX-License-Identifier: MIT
// Many sequences of different lengths in one attention call: ragged (variable-length) batches
// packed along the token axis, described by cumulative lengths (FlashAttention's varlen API),
// and batches of a fixed-capacity cache in which each sequence holds its own number of keys
// (ONNX Attention-24's nonpad_kv_seqlen).
//
// Each sequence is attended on its own, with its own positions and rule, exactly as one apex::sdpa
// call on it alone would (§6.2, §8.2, §10–§11): no query ever sees another sequence's keys, and no
// dense mask is formed. The tiled kernel runs every (sequence, key/value head, query block) task
// of the batch in one parallel loop (detail/flash_attention.hpp, SCHEDULERS), and plans each
// sequence from its own shapes, so a sequence's result is bit for bit the result of sdpa on that
// sequence alone, whatever the rest of the batch and the number of threads.
//
//   packed tokens, cu_seqlens = {0, 3, 3, 7}: three sequences of 3, 0 and 4 tokens
//   row:   0   1   2 | 3   4   5   6
//          seq 0     | seq 2            (seq 1 is empty)
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace apex {

/// The layout of a ragged batch of N sequences packed one after another along the token axis:
/// sequence i's queries are rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of Q (and of the
/// output), and its keys rows [cu_seqlens_k[i], cu_seqlens_k[i + 1]) of K and V. Both lists have
/// N + 1 entries, start at 0, never decrease, and end at the number of rows of their tensors.
struct RaggedBatch {
  std::vector<Index> cu_seqlens_q;  ///< N + 1 query offsets
  std::vector<Index> cu_seqlens_k;  ///< N + 1 key offsets

  /// Number of sequences N (0 for an empty layout).
  Index sequences() const {
    return cu_seqlens_q.empty() ? 0 : static_cast<Index>(cu_seqlens_q.size()) - 1;
  }

  /// The layout of sequences with the given query and key lengths (of equal count, each >= 0).
  /// Throws std::invalid_argument otherwise. Allocates the two lists.
  static RaggedBatch from_lengths(const std::vector<Index>& q_lengths,
                                  const std::vector<Index>& k_lengths) {
    APEX_CHECK(q_lengths.size() == k_lengths.size(),
               "[ragged_batch] q_lengths (" << q_lengths.size() << ") and k_lengths ("
                                            << k_lengths.size()
                                            << ") must have one length per sequence each");
    RaggedBatch batch;
    batch.cu_seqlens_q = cumulative(q_lengths, "q_lengths");
    batch.cu_seqlens_k = cumulative(k_lengths, "k_lengths");
    return batch;
  }

 private:
  static std::vector<Index> cumulative(const std::vector<Index>& lengths, const char* name) {
    std::vector<Index> cu{0};
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      APEX_CHECK(lengths[i] >= 0,
                 "[ragged_batch] " << name << "[" << i << "] (" << lengths[i] << ") must be >= 0");
      cu.push_back(detail::checked_sum(cu.back(), lengths[i], "ragged_batch", name));
    }
    return cu;
  }
};

namespace detail {

/// Throws unless `cu` (named `name`) is N + 1 offsets from 0, never decreasing, to `rows`.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the counts of one call
inline void check_offsets(const std::vector<Index>& cu, Index sequences, Index rows, const char* op,
                          const char* name) {
  APEX_CHECK(static_cast<Index>(cu.size()) == sequences + 1,
             "[" << op << "] " << name << " has " << cu.size()
                 << " entries; expected N + 1 = " << sequences + 1);
  APEX_CHECK(cu.front() == 0, "[" << op << "] " << name << "[0] (" << cu.front() << ") must be 0");
  for (Index i = 0; i < sequences; ++i) {
    const auto at = static_cast<std::size_t>(i);
    APEX_CHECK(cu[at + 1] >= cu[at], "[" << op << "] " << name << " must not decrease: entry "
                                         << i + 1 << " (" << cu[at + 1] << ") < entry " << i << " ("
                                         << cu[at] << ")");
  }
  APEX_CHECK(cu.back() == rows, "[" << op << "] " << name << " ends at " << cu.back()
                                    << "; expected the tensor's " << rows << " rows");
}

/// One sequence of a batch: its query rows, its keys (one segment, contiguous or paged; the
/// rule's key_offset is the segment's first position), its rule, its outputs and its rows of the
/// dense masks (sequence_mask_rows; empty: none), as sdpa would take them for that sequence
/// alone.
template <class TQ, class TK, class TV, class TO, class TB = TQ>
struct SequenceViews {
  HeadsView<const TQ> q;
  KeySegment<TK, TV> keys;
  PositionMask positions;
  HeadsView<TO> out, lse;
  HeadsView<const bool> allowed{};
  HeadsView<const TB> bias{};
  HeadsView<TO> max{}, sum{};  // the rows' softmax statistics (optional, as sdpa's stats)
};

/// Throws unless `masks` holds one position mask for all n sequences or one for each.
inline void check_mask_count(const std::vector<PositionMask>& masks, Index n, const char* op) {
  APEX_CHECK(masks.size() == 1 || static_cast<Index>(masks.size()) == n,
             "[" << op << "] masks holds " << masks.size()
                 << " position masks; expected 1 (shared) or one per sequence (" << n << ")");
}

/// Throws unless the dense masks of a call over many sequences fit it (empty views are no
/// mask): each of mask.allowed and mask.bias is [1 or B, 1 or H_q, rows of q, >= keys], `keys`
/// being the most keys of any sequence, so that row r is query row r of q and column j key j of
/// that row's own sequence. When each sequence has a rule of its own (`own_rules`), the mask's
/// position rule must allow every pair (the default): it would have no sequence to apply to.
template <class TB>
void check_batch_masks(const AttentionMask<TB>& mask, const HeadsShape& q, Index keys,
                       bool own_rules, const char* op) {
  APEX_CHECK(!own_rules || mask.positions.allows_everything(),
             "[" << op << "] mask.positions must allow every pair (the default PositionMask): "
                 << "each sequence's rule is its entry of the masks");
  const auto check = [&](const HeadsShape& view, const char* name) {
    APEX_CHECK(view.dim >= keys, "[" << op << "] " << name << " has " << view.dim
                                     << " columns; expected at least the most keys of a sequence ("
                                     << keys << ")");
    HeadsShape narrowed = view;
    narrowed.dim = keys;
    check_mask_view_shape(narrowed, q, keys, op, name);
  };
  if (!mask.allowed.empty()) check(mask.allowed.shape(), "allowed mask");
  if (!mask.bias.empty()) check(mask.bias.shape(), "bias");
}

/// The rows [first, first + count) of batch b of a dense mask of a call over many sequences,
/// narrowed to its first `keys` columns: the dense mask of that sequence alone (checked by
/// check_batch_masks; an empty view stays empty).
template <class T>
HeadsView<const T> sequence_mask_rows(const HeadsView<const T>& mask, Index b, Index first,
                                      Index count, Index keys) {
  if (mask.empty()) return {};
  const HeadsView<const T> rows = mask.middle_batches(b, 1).middle_rows(first, count);
  return HeadsView<const T>(rows.data(), {1, rows.heads(), count, keys}, rows.strides());
}

/// Throws unless the rule of sequence (or batch: `what`) i holds for its S_q queries and S_k
/// keys (check_position_mask), naming it in the message.
inline void check_sequence_rule(const PositionMask& rule, Index s_q, Index s_k, const char* what,
                                Index i, const char* op) {
  try {
    check_position_mask(rule, s_q, s_k, op);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(e.what()) + " (" + what + " " + std::to_string(i) +
                                ")");
  }
}

/// check_sdpa on the shapes alone (widths, heads, outputs, parameters), with the rule left to
/// check_sequence_rule: a rule with document ids is checked per sequence, against its own
/// positions.
template <class TQ, class TK, class TV, class TO>
void check_batch_shapes(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                        const HeadsView<const TV>& v, const SdpaParams& params,
                        const HeadsView<TO>& out, const HeadsView<TO>& lse, const char* op) {
  check_sdpa(q, k, v, AttentionMask<TO>{}, params, out, lse, op);
}

/// Throws unless no output shares memory with an input (a ragged call has no temporary to
/// compute into, unlike sdpa).
template <class TQ, class TK, class TV, class TO>
void check_no_overlap(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                      const HeadsView<const TV>& v, const HeadsView<TO>& out,
                      const HeadsView<TO>& lse, const char* op) {
  check_outputs<TO>({out, lse}, op);
  for (const ByteRange in : {byte_range(q), byte_range(k), byte_range(v)}) {
    for (const auto& o : {out, lse}) {
      APEX_CHECK(!in.overlaps(byte_range(o)),
                 "[" << op << "] the outputs must not share memory with q, k or v");
    }
  }
}

/// Attention of every sequence of a batch, each on its own (checked already), in one run of
/// the kernel; the user's rules see sequence i as batch i (rules_at_batch). Allocates a
/// problem, a key segment, a job and the rules' references per sequence.
template <class TQ, class TK, class TV, class TO, class TB, class R = NoRules>
void attend_sequences(const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& sequences,
                      const SdpaParams& params, const FlashBlocking& blocking,
                      const R& rules = {}) {
  using Rules = RulesAtBatch<R>;
  using Problem = AttentionProblem<TQ, TK, TV, TB, Rules>;
  std::vector<KeySegment<TK, TV>> keys;
  std::vector<Rules> sequence_rules;
  std::vector<Problem> problems;
  std::vector<AttentionJob<Problem, TO>> jobs;
  keys.reserve(sequences.size());
  sequence_rules.reserve(sequences.size());
  problems.reserve(sequences.size());
  jobs.reserve(sequences.size());
  for (const auto& s : sequences) {
    keys.push_back(s.keys);
    sequence_rules.push_back(rules_at_batch(rules, static_cast<Index>(problems.size())));
    const Index s_k = s.keys.size();
    problems.push_back(attention_problem<TQ, TK, TV, TB, Rules>(
        s.q, &keys.back(), 1, s_k, s.positions, s.positions.first_query_position(s.q.seq(), s_k),
        params));
    problems.back().rules = &sequence_rules.back();
    problems.back().allowed = s.allowed;
    problems.back().bias = s.bias;
    jobs.push_back({&problems.back(), {s.out, s.lse, s.max, s.sum}});
  }
  flash_attention(jobs.data(), static_cast<Index>(jobs.size()), blocking);
}

/// The whole of sdpa_varlen, with block sizes that tests may choose, and the dense masks and
/// user rules of its other overloads.
template <class TQ, class TK, class TV, class TO, class TB = TQ, class R = NoRules>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_varlen
void flash_sdpa_varlen(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                       const HeadsView<const TV>& v, const RaggedBatch& batch,
                       const std::vector<PositionMask>& masks, const SdpaParams& params,
                       const HeadsView<TO>& out, const HeadsView<TO>& lse,
                       const FlashBlocking& blocking = {}, const AttentionMask<TB>& mask = {},
                       const R& user_rules = {}) {
  const char* op = "sdpa_varlen";
  APEX_CHECK(q.batch() == 1, "[" << op << "] q batch (" << q.batch()
                                 << ") must be 1: the sequences are packed along the rows");
  check_batch_shapes(q, k, v, params, out, lse, op);
  APEX_CHECK(!batch.cu_seqlens_q.empty(),
             "[" << op << "] cu_seqlens_q must have N + 1 >= 1 entries");
  const Index n = batch.sequences();
  check_offsets(batch.cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  check_offsets(batch.cu_seqlens_k, n, k.seq(), op, "cu_seqlens_k");
  check_mask_count(masks, n, op);
  Index longest = 0;  // the most keys of a sequence
  for (std::size_t i = 0; i + 1 < batch.cu_seqlens_k.size(); ++i) {
    longest = std::max(longest, batch.cu_seqlens_k[i + 1] - batch.cu_seqlens_k[i]);
  }
  check_batch_masks(mask, q.shape(), longest, true, op);
  check_no_overlap(q, k, v, out, lse, op);
  std::vector<SequenceViews<TQ, TK, TV, TO, TB>> sequences(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const Index q0 = batch.cu_seqlens_q[at], nq = batch.cu_seqlens_q[at + 1] - q0;
    const Index k0 = batch.cu_seqlens_k[at], nk = batch.cu_seqlens_k[at + 1] - k0;
    const PositionMask& rule = masks[masks.size() == 1 ? 0 : at];
    check_sequence_rule(rule, nq, nk, "sequence", i, op);
    sequences[at] = {q.middle_rows(q0, nq),
                     {k.middle_rows(k0, nk), v.middle_rows(k0, nk), rule.key_offset},
                     rule,
                     out.middle_rows(q0, nq),
                     lse.empty() ? HeadsView<TO>() : lse.middle_rows(q0, nq),
                     sequence_mask_rows(mask.allowed, 0, q0, nq, nk),
                     sequence_mask_rows(mask.bias, 0, q0, nq, nk)};
  }
  attend_sequences(sequences, params, blocking, user_rules);
}

/// The whole of sdpa_nonpad_kv, with block sizes that tests may choose, and the dense masks and
/// user rules of its other overloads (mask.positions is the rule).
template <class TQ, class TK, class TV, class TO, class TB = TQ, class R = NoRules>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_nonpad_kv
void flash_sdpa_nonpad_kv(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                          const HeadsView<const TV>& v, const std::vector<Index>& nonpad_kv_seqlen,
                          const AttentionMask<TB>& mask, const SdpaParams& params,
                          const HeadsView<TO>& out, const HeadsView<TO>& lse,
                          const FlashBlocking& blocking = {}, const R& user_rules = {}) {
  const char* op = "sdpa_nonpad_kv";
  const PositionMask& rule = mask.positions;
  check_batch_shapes(q, k, v, params, out, lse, op);
  const Index batches = q.batch();
  APEX_CHECK(static_cast<Index>(nonpad_kv_seqlen.size()) == batches,
             "[" << op << "] nonpad_kv_seqlen holds " << nonpad_kv_seqlen.size()
                 << " lengths; expected one per batch (" << batches << ")");
  check_batch_masks(mask, q.shape(), k.seq(), false, op);
  check_no_overlap(q, k, v, out, lse, op);
  std::vector<SequenceViews<TQ, TK, TV, TO, TB>> sequences(static_cast<std::size_t>(batches));
  for (Index b = 0; b < batches; ++b) {
    const auto at = static_cast<std::size_t>(b);
    const Index length = nonpad_kv_seqlen[at];
    APEX_CHECK(length >= 0 && length <= k.seq(), "[" << op << "] nonpad_kv_seqlen[" << b << "] ("
                                                     << length << ") must be in [0, " << k.seq()
                                                     << "], the keys the cache holds");
    check_sequence_rule(rule, q.seq(), length, "batch", b, op);
    sequences[at] = {q.middle_batches(b, 1),
                     {k.middle_batches(b, 1).middle_rows(0, length),
                      v.middle_batches(b, 1).middle_rows(0, length), rule.key_offset},
                     rule,
                     out.middle_batches(b, 1),
                     lse.empty() ? HeadsView<TO>() : lse.middle_batches(b, 1),
                     sequence_mask_rows(mask.allowed, b, 0, q.seq(), length),
                     sequence_mask_rows(mask.bias, b, 0, q.seq(), length)};
  }
  attend_sequences(sequences, params, blocking, user_rules);
}

}  // namespace detail

/// Attention of a ragged batch (§6.2, §8.2 per sequence): sequence i of `batch` attends from its
/// queries to its own keys only, under masks[i] (or masks[0] for every sequence when masks has
/// one entry) applied to that sequence alone, exactly as sdpa(q_i, k_i, v_i, {masks[i]}, params,
/// out_i, lse_i) would: positions count from each sequence's own start (key_offset, and by
/// default its queries are the last of its key positions: bottom-right alignment, the decoding
/// convention; set query_offset = 0 for top-left), and a causal rule, window, chunk, prefix or
/// document ids are its own.
///   q: [1, H_q, total_q, d_qk], k: [1, H_kv, total_k, d_qk], v: [1, H_kv, total_k, d_v]
///   (sequences packed along the rows; heads side by side, as a projection writes them, is
///   HeadsView::token_major(data, {1, H, total, d}))
///   -> out: [1, H_q, total_q, d_v], lse (optional): [1, H_q, total_q, 1].
/// Sequences may be empty (no query: nothing written; no key: zeros and lse = -inf, or the
/// sink). Every check runs before anything is written (offsets, each sequence as sdpa checks
/// it, outputs that must not share memory with an input) and a failed call changes nothing.
/// Storage types as for sdpa. Allocates a few records per sequence; the kernel's scratch as for
/// sdpa, and split-key partials at most FlashBlocking::partial_budget scalars whatever N. The
/// result is bit-identical for any number of threads and equals one sdpa call per sequence bit
/// for bit.
template <class Q, class K, class V, class TO>
void sdpa_varlen(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                 const RaggedBatch& batch, const std::vector<PositionMask>& masks,
                 const SdpaParams& params, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_varlen<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                            TO>(q, k, v, batch, masks, params, out, lse);
}

/// sdpa_varlen with dense masks: mask.allowed and mask.bias are [1, 1 or H_q, total_q, ≥ the
/// most keys of a sequence], row r the query row r of q and column j key j of that row's own
/// sequence (so sequence i reads rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and columns
/// [0, its keys)), applied as sdpa applies them (TB: the bias's type); mask.positions must be the
/// default, each sequence's rule being its entry of `masks`. Sequence i's result is bit for bit
/// sdpa on it alone with its rows and columns of the masks. Checks, storage types, memory,
/// threads and bit-identity as for sdpa_varlen.
template <class Q, class K, class V, class TB, class TO>
void sdpa_varlen(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                 const RaggedBatch& batch, const std::vector<PositionMask>& masks,
                 const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_varlen<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                            TO, TB>(q, k, v, batch, masks, params, out, lse, {}, mask);
}

/// sdpa_varlen with dense masks and the user's rules (attention_rules.hpp), which see sequence i
/// as batch i (the positions they are given are the sequence's own, as for its rule).
template <class Q, class K, class V, class TB, class TO, class A, class C, class S>
void sdpa_varlen(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                 const RaggedBatch& batch, const std::vector<PositionMask>& masks,
                 const AttentionMask<TB>& mask, const SdpaParams& params,
                 const AttentionRules<A, C, S>& user_rules, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_varlen<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                            TO, TB>(q, k, v, batch, masks, params, out, lse, {}, mask, user_rules);
}

/// Attention over a batch of fixed-capacity caches in which batch b holds only its first
/// nonpad_kv_seqlen[b] keys (ONNX Attention-24's nonpad_kv_seqlen): batch b's S_q queries attend
/// to keys [0, nonpad_kv_seqlen[b]) under `rule`, as sdpa would on those keys alone, so with the
/// default alignment the queries are the last S_q positions of each batch's own keys
/// (bottom-right causal per batch); the keys past a batch's length are never read.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, C, d_qk], v: [B, H_kv, C, d_v] (e.g. a KvCache's
///   buffers), nonpad_kv_seqlen: B lengths in [0, C]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1].
/// Checks, storage types, memory, threads and bit-identity as for sdpa_varlen.
template <class Q, class K, class V, class TO>
void sdpa_nonpad_kv(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const std::vector<Index>& nonpad_kv_seqlen, const PositionMask& rule,
                    const SdpaParams& params, const HeadsView<TO>& out,
                    const HeadsView<TO>& lse = {}) {
  using TQ = std::remove_const_t<Q>;
  detail::flash_sdpa_nonpad_kv<TQ, std::remove_const_t<K>, std::remove_const_t<V>, TO>(
      q, k, v, nonpad_kv_seqlen, AttentionMask<TQ>{rule, {}, {}}, params, out, lse);
}

/// sdpa_nonpad_kv with dense masks (ONNX Attention-24's attn_mask beside nonpad_kv_seqlen, in
/// one call): mask.positions is the rule of every batch, and mask.allowed and mask.bias are
/// [1 or B, 1 or H_q, S_q, C] over the cache's C key slots (batch b reads the columns
/// [0, nonpad_kv_seqlen[b])), broadcast and applied as sdpa applies them (TB: the bias's type).
/// Checks, storage types, memory, threads and bit-identity as for sdpa_varlen; batch b's result
/// is bit for bit sdpa on its own keys with its own rows and columns of the masks.
template <class Q, class K, class V, class TB, class TO>
void sdpa_nonpad_kv(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const std::vector<Index>& nonpad_kv_seqlen, const AttentionMask<TB>& mask,
                    const SdpaParams& params, const HeadsView<TO>& out,
                    const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_nonpad_kv<std::remove_const_t<Q>, std::remove_const_t<K>,
                               std::remove_const_t<V>, TO, TB>(q, k, v, nonpad_kv_seqlen, mask,
                                                               params, out, lse);
}

/// sdpa_nonpad_kv with dense masks and the user's rules (attention_rules.hpp), which see batch b
/// as b.
template <class Q, class K, class V, class TB, class TO, class A, class C, class S>
void sdpa_nonpad_kv(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const std::vector<Index>& nonpad_kv_seqlen, const AttentionMask<TB>& mask,
                    const SdpaParams& params, const AttentionRules<A, C, S>& rules,
                    const HeadsView<TO>& out, const HeadsView<TO>& lse = {}) {
  detail::flash_sdpa_nonpad_kv<std::remove_const_t<Q>, std::remove_const_t<K>,
                               std::remove_const_t<V>, TO, TB>(q, k, v, nonpad_kv_seqlen, mask,
                                                               params, out, lse, {}, rules);
}

}  // namespace apex
