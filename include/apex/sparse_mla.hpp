// SPDX-License-Identifier: MIT
// DeepSeek Sparse Attention (DeepSeek-V3.2): multi-head latent attention (§9, mla.hpp) whose
// every query attends only to the top-k cached tokens a lightning indexer (indexer.hpp) picks
// for it, so that the attention of a decoding step costs the same at 128K tokens as at k.
//
//   x [B*n, d] ─┬─ MLA's absorbed queries q̃ [B*n, H_q·(d_kv + H_kr·d_r)] ───────────────┐
//               ├─ c_kv ‖ K_rope ──▶ LatentCache rows  [B, C, d_kv + H_kr·d_r] ──────────┤
//               ├─ indexer keys ───▶ IndexerKeyCache   [B, C, d_I] ─┐                    │
//               └─ indexer queries, head weights ──────────────────┴▶ top-k selection ──┤
//                                                                   [B*n, min(k, S)]     ▼
//                                  o = sdpa_sparse(q̃, rows, c_kv, selection) ─▶ out = absorbed
//                                                                               output [B*n, d]
//
// A step appends the chunk's latent rows and indexer keys first, so every query ranks the keys
// of every token up to and including itself (causal); with k at least the visible count every
// key is selected and the result is absorbed MLA's (MultiHeadLatentAttention::forward_absorbed)
// over the same cache; a test checks both, and the equality with MLA's forward pass under the
// dense mask that allows the selected keys only.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/detail/mla_steps.hpp>
#include <apex/indexer.hpp>
#include <apex/key_selection.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mla.hpp>
#include <apex/mla_absorbed.hpp>
#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
#include <apex/sparse_attention.hpp>

#include <cstdint>
#include <utility>
#include <vector>

namespace apex {

/// What a sparse MLA layer caches per token: the latent row [c_kv ‖ K_rope] (LatentCache, in
/// Storage's format) and the indexer key (IndexerKeyCache, in KeyStorage's), side by side for
/// the same B sequences and positions. bytes() counts both.
template <class Scalar, class Storage = Scalar, class KeyStorage = Storage>
struct SparseLatentCache {
  LatentCache<Scalar, Storage> latent;               ///< [B, C, d_kv + H_kr·d_r]
  IndexerKeyCache<Scalar, KeyStorage> indexer_keys;  ///< [B, C, d_I]

  /// Number of sequences.
  Index batch() const { return latent.batch(); }
  /// Tokens held (the same in both parts).
  Index size() const { return latent.size(); }
  /// Position of the next token.
  Index next_position() const { return latent.next_position(); }
  /// Exact bytes of both parts.
  std::int64_t bytes() const { return latent.bytes() + indexer_keys.bytes(); }
  /// Drops the tokens at positions >= new_size from both parts.
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size(),
               "[sparse_mla] truncate size (" << new_size << ") must lie in [0, " << size() << "]");
    latent.truncate(new_size);
    indexer_keys.truncate(new_size);
  }
};

/// A sparse MLA layer's paged cache for many sequences: a PagedLatentCache of latent rows and a
/// PagedIndexerKeyCache of indexer keys holding the same sequences under the same ids (add, fork,
/// free and truncate act on both, in step). bytes() counts both pools.
template <class Scalar, class Storage = Scalar, class KeyStorage = Storage>
struct SparsePagedCache {
  PagedLatentCache<Scalar, Storage> latent;               ///< rows [c_kv ‖ K_rope]
  PagedIndexerKeyCache<Scalar, KeyStorage> indexer_keys;  ///< keys [d_I]

  /// Adds an empty sequence to both parts; its id.
  SequenceId add() { return same_id(latent.add(), indexer_keys.add()); }
  /// Forks sequence id in both parts (copy on write); the new id.
  SequenceId fork(SequenceId id) {
    check_live(id);
    return same_id(latent.fork(id), indexer_keys.fork(id));
  }
  /// Frees sequence id in both parts.
  void free(SequenceId id) {
    check_live(id);
    latent.free(id);
    indexer_keys.free(id);
  }
  /// Keeps the first new_length tokens of sequence id in both parts.
  void truncate(SequenceId id, Index new_length) {
    check_live(id);
    latent.truncate(id, new_length);
    indexer_keys.truncate(id, new_length);
  }
  /// Exact bytes of both pools.
  std::int64_t bytes() const { return latent.bytes() + indexer_keys.bytes(); }

 private:
  /// Throws unless id is live in both parts.
  void check_live(SequenceId id) const {
    APEX_CHECK(latent.contains(id) && indexer_keys.contains(id),
               "[sparse_mla] sequence " << id << " must be live in both parts of the cache");
  }
  /// The id both parts gave (they hand out ids in the same order when used through this cache).
  static SequenceId same_id(SequenceId a, SequenceId b) {
    APEX_ASSERT(a == b);
    (void)b;
    return a;
  }
};

namespace detail {

/// What one step of sparse MLA reads: the layer, its absorbed weights and its indexer (held by
/// a SparseLatentAttention, or by an AttentionStack for each of its sparse global layers).
template <class Scalar, class Weight>
struct SparseMlaParts {
  const MultiHeadLatentAttention<Scalar, Weight>& mla;
  const MlaAbsorbedWeights<Weight>& absorbed;
  const LightningIndexer<Scalar, Weight>& indexer;
};

/// Every check of sparse_mla_step; returns n.
template <class Scalar, class Weight, class Storage, class KeyStorage>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of sparse_mla_step's arguments
Index check_sparse_step(const SparseMlaParts<Scalar, Weight>& layer, const ConstRowRef<Scalar>& x,
                        Index prefix, const AttentionLayerParams<Scalar>& params,
                        const LatentCache<Scalar, Storage>& latent,
                        const IndexerKeyCache<Scalar, KeyStorage>& keys,
                        const RowRef<Scalar>& out) {
  detail::check_constructed(layer.mla.config().d_model >= 1, "sparse_mla", "layer");
  PositionMask mask;
  mask.causal = true;
  mask.prefix = prefix;
  const Index n = check_mla_cached(layer.mla.config(), layer.mla.weights(), x, mask, params, latent,
                                   mla_absorbed_heads(layer.mla.config()), out);
  const Index d_i = layer.indexer.config().head_dim;
  APEX_CHECK(keys.batch() == latent.batch() && keys.head_dim() == d_i &&
                 keys.next_position() == latent.next_position(),
             "[sparse_mla] indexer_keys (batch "
                 << keys.batch() << ", head_dim " << keys.head_dim() << ", next position "
                 << keys.next_position() << ") must match the latent cache (batch "
                 << latent.batch() << ", next position " << latent.next_position() << ") and d_I ("
                 << d_i << ")");
  keys.check_room(n);
  return n;
}

/// The absorbed attention of a chunk's queries q [B*n, H_q·width] over their selected latent
/// rows -> o_latent [B*n, H_q·d_kv] (a whole-row format: see detail::latent_outputs).
template <class Scalar, class Weight, class Storage>
RowMatrix<Scalar> attend_selected(const MultiHeadLatentAttention<Scalar, Weight>& mla,
                                  const RowMatrix<Scalar>& q, Index n, const KeySelection& selected,
                                  const LatentCache<Scalar, Storage>& cache,
                                  const AttentionLayerParams<Scalar>& params) {
  constexpr bool kWhole = is_latent_row_format_v<Storage>;
  const Index h_q = mla.config().num_q_heads;
  const SdpaParams attention =
      mla_attention_params(mla.config(), mla.weights().sinks, params.attention);
  const auto queries =
      HeadsView<const Scalar>::token_major(q.data(), {cache.batch(), h_q, n, cache.row_width()});
  return latent_outputs<Scalar>(
      queries.shape(), cache.latent_dim(), kWhole ? cache.row_width() : cache.latent_dim(),
      [&](const HeadsView<Scalar>& o) {
        if constexpr (kWhole) {
          sdpa_sparse(queries, cache.rows(), cache.rows(), selected, attention, o);
        } else {
          sdpa_sparse(queries, cache.rows(), cache.latent(), selected, attention, o);
        }
      });
}

/// One step of sparse MLA over contiguous caches (SparseLatentAttention::forward, and the
/// cached calls of a stack with sparse global layers): n new tokens per sequence at positions
/// [p, p + n), p = params.position_offset = latent.next_position(), the first `prefix` positions
/// of every sequence bidirectional (§11.1; 0: causal throughout). Appends the chunk's latent
/// rows and indexer keys, selects for each row the top k of the keys it sees
/// (LightningIndexer::select) and attends with absorbed MLA over those only. Every check runs
/// before a cache or out is written; out may be x. Returns the selection.
template <class Scalar, class Weight, class Storage, class KeyStorage>
KeySelection sparse_mla_step(const SparseMlaParts<Scalar, Weight>& layer,
                             const ConstRowRef<Scalar>& x, Index prefix,
                             const AttentionLayerParams<Scalar>& params,
                             LatentCache<Scalar, Storage>& latent,
                             IndexerKeyCache<Scalar, KeyStorage>& keys, RowRef<Scalar> out) {
  const Index n = check_sparse_step(layer, x, prefix, params, latent, keys, out);
  const Index batch = latent.batch(), offset = params.position_offset;
  const MlaConfig& c = layer.mla.config();
  const MlaWeights<Weight>& w = layer.mla.weights();
  const RowPositions at{offset, batch, nullptr};
  const RowMatrix<Scalar> c_q = matmul<Scalar>(x, w.w_dq);
  const RowMatrix<Scalar> q = absorbed_queries(c, w, x, c_q, at, params, layer.absorbed);
  const RowMatrix<Scalar> q_index = layer.indexer.queries(c_q, batch, *params.rope, offset);
  const RowMatrix<Scalar> w_index = layer.indexer.head_weights(x);
  const RowMatrix<Scalar> k_index = layer.indexer.keys(x, batch, *params.rope, offset);
  latent.append(mla_latent_rows(c, w, x, at, params), offset);
  keys.append(k_index, offset);
  KeySelection selected = layer.indexer.select(q_index, w_index, keys.keys(), offset, prefix);
  const RowMatrix<Scalar> o_latent = attend_selected(layer.mla, q, n, selected, latent, params);
  absorbed_output(c, w, o_latent, layer.absorbed, out);
  return selected;
}

/// Every check of sparse_mla_paged_step; returns the positions of the rows.
template <class Scalar, class Weight, class Storage, class KeyStorage>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of the step's arguments
Vector<Index> check_sparse_paged_step(
    const SparseMlaParts<Scalar, Weight>& layer, const ConstRowRef<Scalar>& x,
    const std::vector<Index>& cu_seqlens, const std::vector<SequenceId>& ids,
    const std::vector<Index>& prefixes, const AttentionLayerParams<Scalar>& params,
    const PagedLatentCache<Scalar, Storage>& latent,
    const PagedIndexerKeyCache<Scalar, KeyStorage>& keys, const RowRef<Scalar>& out) {
  const char* op = "sparse_mla";
  const MlaConfig& c = layer.mla.config();
  check_constructed(c.d_model >= 1, op, "layer");
  check_mla_rope(c, params.rope);
  check_paged_layer_input(x, c.d_model, params.position_offset, op);
  check_indexer_trees(params.draft_trees, static_cast<Index>(ids.size()), op);
  check_mla_paged_cache(c, latent);
  APEX_CHECK(keys.head_dim() == layer.indexer.config().head_dim,
             "[" << op << "] the key cache's head_dim (" << keys.head_dim() << ") must equal d_I ("
                 << layer.indexer.config().head_dim << ")");
  APEX_ASSERT(prefixes.size() == ids.size());
  std::vector<PositionMask> masks(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    masks[i].causal = true;
    masks[i].prefix = prefixes[i];
  }
  Vector<Index> positions = paged_step_positions(x.rows(), cu_seqlens, ids, masks, latent,
                                                 params.rope, op, params.row_positions);
  std::vector<std::pair<SequenceId, Index>> appends;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    APEX_CHECK(
        keys.contains(ids[i]) && keys.length(ids[i]) == latent.length(ids[i]),
        "[" << op << "] sequence " << ids[i] << " must hold as many indexer keys as latent rows");
    appends.emplace_back(ids[i], cu_seqlens[i + 1] - cu_seqlens[i]);
  }
  keys.check_appends(appends, op);
  const SdpaParams attention = mla_attention_params(c, layer.mla.weights().sinks, params.attention);
  check_layer_attention<Scalar>({1, x.rows(), 0, "T"}, mla_absorbed_heads(c), {}, attention, out,
                                c.d_model, op);
  return positions;
}

/// The absorbed attention of a paged step's queries q [T, H_q·width] over their selected rows
/// of the latent pages -> o_latent [T, H_q·d_kv].
template <class Scalar, class Weight, class Storage>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of the step's arguments
RowMatrix<Scalar> attend_selected_paged(const MultiHeadLatentAttention<Scalar, Weight>& mla,
                                        const RowMatrix<Scalar>& q,
                                        const std::vector<Index>& cu_seqlens,
                                        const std::vector<SequenceId>& ids,
                                        const KeySelection& selected,
                                        const PagedLatentCache<Scalar, Storage>& cache,
                                        const AttentionLayerParams<Scalar>& params) {
  const MlaConfig& c = mla.config();
  const Index width = c.d_kv + c.rope_key_heads() * c.rope_dim;
  const SdpaParams attention = mla_attention_params(c, mla.weights().sinks, params.attention);
  const auto queries =
      HeadsView<const Scalar>::token_major(q.data(), {1, c.num_q_heads, q.rows(), width});
  return latent_outputs<Scalar>(
      queries.shape(), c.d_kv, cache.value_dim(), [&](const HeadsView<Scalar>& o) {
        sdpa_sparse_paged(queries, cu_seqlens, cache, ids, selected, attention, o);
      });
}

/// One step of sparse MLA over paged caches (SparseLatentAttention::forward_paged, and serve()
/// of a stack with sparse global layers): rows [cu[i], cu[i + 1]) of x are the next tokens of
/// sequence ids[i], at positions latent.length(ids[i]) + s, its first prefixes[i] positions
/// bidirectional (§11.1). As sparse_mla_step for each sequence: the latent rows and indexer keys
/// appended to its pages, each row's top k of the keys it sees (LightningIndexer::select_paged),
/// absorbed MLA over those rows read in their pages. With params.row_positions and
/// params.draft_trees (speculative verification, tree_mask.hpp), each row is rotated at its
/// position in the text and ranks only the keys its tree lets it see. Every check runs before a
/// cache or out is written; out may be x. Returns the selection.
template <class Scalar, class Weight, class Storage, class KeyStorage>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of forward_paged's arguments
KeySelection sparse_mla_paged_step(
    const SparseMlaParts<Scalar, Weight>& layer, const ConstRowRef<Scalar>& x,
    const std::vector<Index>& cu_seqlens, const std::vector<SequenceId>& ids,
    const std::vector<Index>& prefixes, const AttentionLayerParams<Scalar>& params,
    PagedLatentCache<Scalar, Storage>& latent, PagedIndexerKeyCache<Scalar, KeyStorage>& keys,
    RowRef<Scalar> out) {
  const Vector<Index> positions =
      check_sparse_paged_step(layer, x, cu_seqlens, ids, prefixes, params, latent, keys, out);
  const MlaConfig& c = layer.mla.config();
  const MlaWeights<Weight>& w = layer.mla.weights();
  const RowPositions at{0, 1, &positions};
  const RowMatrix<Scalar> c_q = matmul<Scalar>(x, w.w_dq);
  const RowMatrix<Scalar> q = absorbed_queries(c, w, x, c_q, at, params, layer.absorbed);
  const RowMatrix<Scalar> q_index = layer.indexer.queries(c_q, *params.rope, positions);
  const RowMatrix<Scalar> w_index = layer.indexer.head_weights(x);
  const RowMatrix<Scalar> k_index = layer.indexer.keys(x, *params.rope, positions);
  const RowMatrix<Scalar> rows = mla_latent_rows(c, w, x, at, params);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const Index first = cu_seqlens[i], n = cu_seqlens[i + 1] - first;
    latent.append(ids[i], rows.middleRows(first, n));
    keys.append(ids[i], k_index.middleRows(first, n));
  }
  KeySelection selected = layer.indexer.select_paged(q_index, w_index, cu_seqlens, keys, ids,
                                                     &prefixes, params.draft_trees);
  const RowMatrix<Scalar> o_latent =
      attend_selected_paged(layer.mla, q, cu_seqlens, ids, selected, latent, params);
  absorbed_output(c, w, o_latent, layer.absorbed, out);
  return selected;
}

}  // namespace detail

/// A multi-head latent attention layer with a lightning indexer: DeepSeek Sparse Attention (see
/// the top of this header). Holds the MLA layer, its absorbed weights (absorb_mla_weights, once
/// at construction) and the indexer, whose d_model, d_q and d_r must be the layer's. Immutable
/// after construction.
template <class Scalar, class Weight = Scalar>
class SparseLatentAttention {
 public:
  /// An empty layer; every use throws.
  SparseLatentAttention() = default;
  /// Takes the layer and the indexer and folds the absorbed weights. Throws unless both are
  /// constructed and the indexer's d_model, d_q and rope_dim equal the layer's d_model, d_q and
  /// rope_dim (the indexer reads MLA's query latent and the same RoPE table).
  SparseLatentAttention(MultiHeadLatentAttention<Scalar, Weight> mla,
                        LightningIndexer<Scalar, Weight> indexer, const MlaAbsorbParams& fold = {})
      : mla_(std::move(mla)), indexer_(std::move(indexer)) {
    APEX_CHECK(mla_.config().d_model >= 1 && indexer_.config().d_model >= 1,
               "[sparse_mla] the layer and the indexer must be constructed");
    detail::check_indexer_fits(mla_.config(), indexer_.config(), "sparse_mla");
    absorbed_ = absorb_mla_weights(mla_, fold);
  }

  /// The MLA layer.
  const MultiHeadLatentAttention<Scalar, Weight>& mla() const { return mla_; }
  /// The lightning indexer.
  const LightningIndexer<Scalar, Weight>& indexer() const { return indexer_; }
  /// The absorbed weights folded at construction.
  const MlaAbsorbedWeights<Weight>& absorbed() const { return absorbed_; }

  /// An empty cache of B sequences of `capacity` tokens: latent rows as Storage, indexer keys as
  /// KeyStorage (DeepSeek's own: BlockFp8E4m3<128>).
  template <class Storage = Scalar, class KeyStorage = Storage>
  SparseLatentCache<Scalar, Storage, KeyStorage> make_cache(Index batch, Index capacity) const {
    return {mla_.template make_cache<Storage>(batch, capacity),
            indexer_.template make_cache<KeyStorage>(batch, capacity)};
  }

  /// One step of n new tokens per sequence (a prompt, a chunk or one decoded token) at
  /// positions [p, p + n), p = params.position_offset = cache.next_position(): appends their
  /// latent rows and indexer keys, selects for each of them the top k of the keys [0, its
  /// position] (LightningIndexer::select) and attends with absorbed MLA over those only
  /// (sdpa_sparse: keys [c_kv ‖ K_rope], values c_kv, the layer's scale and sinks):
  ///   out_t = Concat_h (softmax_{s ∈ sel(t)}(q̃_{t,h}·row_sᵀ · scale) c_kv) W_UV,g · W_O
  ///   x: [B*n, d] -> out: [B*n, d]; returns the selection [B*n, min(k, p + n)].
  /// params: the RoPE table of the layer (head_dim d_r), covering the positions. Every check
  /// runs before the cache or out is written; out may be x itself. Allocates the chunk's
  /// projections, queries, selection and latent output: O(n·(H_q·(d_kv + d_r) + k)), nothing
  /// proportional to the cache besides the indexer's scores (detail/indexer_scores.hpp).
  template <class Derived, class Storage, class KeyStorage>
  KeySelection forward(const Eigen::MatrixBase<Derived>& x,
                       const AttentionLayerParams<Scalar>& params,
                       SparseLatentCache<Scalar, Storage, KeyStorage>& cache,
                       RowRef<Scalar> out) const {
    return detail::sparse_mla_step(parts(), detail::layer_rows<Scalar>(x), 0, params, cache.latent,
                                   cache.indexer_keys, out);
  }

  /// An empty paged cache of num_pages pages of page_size tokens in each part.
  template <class Storage = Scalar, class KeyStorage = Storage>
  SparsePagedCache<Scalar, Storage, KeyStorage> make_paged_cache(Index page_size,
                                                                 Index num_pages) const {
    const MlaConfig& c = mla_.config();
    return {
        PagedLatentCache<Scalar, Storage>(
            {c.d_kv, c.rope_key_heads(), c.rope_dim, page_size, num_pages}),
        PagedIndexerKeyCache<Scalar, KeyStorage>(indexer_.config().head_dim, page_size, num_pages)};
  }

  /// One step of many sequences of a paged cache (continuous batching): rows [cu[i], cu[i + 1])
  /// of x are the next tokens of sequence ids[i], at positions cache.latent.length(ids[i]) + s.
  /// As forward() for each sequence: their latent rows and indexer keys appended to the
  /// sequence's pages, each row's top k of the keys its sequence holds up to its own position
  /// (LightningIndexer::select_paged), absorbed MLA over those rows read in their pages
  /// (sdpa_sparse_paged).
  ///   x: [T, d]; cu_seqlens: N + 1 row offsets; ids: N distinct sequences live in both parts,
  ///   of equal lengths; params: the RoPE table (head_dim d_r) covering every new position,
  ///   position_offset 0 -> out: [T, d]; returns the selection [T, min(k, the most keys a
  ///   sequence holds)] of positions.
  /// Speculative verification (tree_mask.hpp): with params.row_positions the rows are rotated at
  /// those positions (latent rows, queries and indexer keys), and with params.draft_trees (one
  /// tree per sequence, no window) a draft token ranks, and attends to, the committed keys, its
  /// ancestors and itself only: what the last token of its path would, committed.
  /// Every check runs before the cache or out is written; out may be x itself. Allocates the
  /// step's projections, positions, queries, selection and latent output.
  template <class Derived, class Storage, class KeyStorage>
  KeySelection forward_paged(const Eigen::MatrixBase<Derived>& x,
                             const std::vector<Index>& cu_seqlens,
                             const std::vector<SequenceId>& ids,
                             const AttentionLayerParams<Scalar>& params,
                             SparsePagedCache<Scalar, Storage, KeyStorage>& cache,
                             RowRef<Scalar> out) const {
    return detail::sparse_mla_paged_step(parts(), detail::layer_rows<Scalar>(x), cu_seqlens, ids,
                                         std::vector<Index>(ids.size(), 0), params, cache.latent,
                                         cache.indexer_keys, out);
  }

  /// Value-returning forward: the output [B*n, d] (the selection is dropped).
  template <class Derived, class Storage, class KeyStorage>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<Derived>& x,
                            const AttentionLayerParams<Scalar>& params,
                            SparseLatentCache<Scalar, Storage, KeyStorage>& cache) const {
    RowMatrix<Scalar> out(x.rows(), mla_.config().d_model);
    forward(x, params, cache, out);
    return out;
  }

 private:
  /// The layer's parts, as detail::sparse_mla_step reads them.
  detail::SparseMlaParts<Scalar, Weight> parts() const { return {mla_, absorbed_, indexer_}; }

  MultiHeadLatentAttention<Scalar, Weight> mla_;
  LightningIndexer<Scalar, Weight> indexer_;
  MlaAbsorbedWeights<Weight> absorbed_;
};

}  // namespace apex
