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
#include <apex/sparse_attention.hpp>

#include <cstdint>
#include <utility>

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
    const MlaConfig& c = mla_.config();
    const IndexerConfig& i = indexer_.config();
    APEX_CHECK(c.d_model >= 1 && i.d_model >= 1,
               "[sparse_mla] the layer and the indexer must be constructed");
    APEX_CHECK(i.d_model == c.d_model && i.d_q == c.d_q && i.rope_dim == c.rope_dim,
               "[sparse_mla] indexer d_model ("
                   << i.d_model << "), d_q (" << i.d_q << ") and rope_dim (" << i.rope_dim
                   << ") must equal the layer's (" << c.d_model << ", " << c.d_q << ", "
                   << c.rope_dim << ")");
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
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    const Index n = check_step(xr, params, cache, out);
    const Index batch = cache.batch(), offset = params.position_offset;
    const MlaConfig& c = mla_.config();
    const detail::RowPositions at{offset, batch, nullptr};
    const RowMatrix<Scalar> q =
        detail::absorbed_queries(c, mla_.weights(), xr, at, params, absorbed_);
    const RowMatrix<Scalar> c_q = detail::matmul<Scalar>(xr, mla_.weights().w_dq);
    const RowMatrix<Scalar> q_index = indexer_.queries(c_q, batch, *params.rope, offset);
    const RowMatrix<Scalar> w_index = indexer_.head_weights(xr);
    const RowMatrix<Scalar> k_index = indexer_.keys(xr, batch, *params.rope, offset);
    cache.latent.append(detail::mla_latent_rows(c, mla_.weights(), xr, at, params), offset);
    cache.indexer_keys.append(k_index, offset);
    KeySelection selected = indexer_.select(q_index, w_index, cache.indexer_keys.keys(), offset);
    const RowMatrix<Scalar> o_latent = attend_selected(q, n, selected, cache.latent, params);
    detail::absorbed_output(c, mla_.weights(), o_latent, absorbed_, out);
    return selected;
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
  /// Every check of forward; returns n.
  template <class Storage, class KeyStorage>
  Index check_step(const ConstRowRef<Scalar>& x, const AttentionLayerParams<Scalar>& params,
                   const SparseLatentCache<Scalar, Storage, KeyStorage>& cache,
                   const RowRef<Scalar>& out) const {
    detail::check_constructed(mla_.config().d_model >= 1, "sparse_mla", "layer");
    PositionMask causal;
    causal.causal = true;
    const Index n =
        detail::check_mla_cached(mla_.config(), mla_.weights(), x, causal, params, cache.latent,
                                 detail::mla_absorbed_heads(mla_.config()), out);
    const IndexerKeyCache<Scalar, KeyStorage>& keys = cache.indexer_keys;
    APEX_CHECK(keys.batch() == cache.batch() && keys.head_dim() == indexer_.config().head_dim &&
                   keys.next_position() == cache.next_position(),
               "[sparse_mla] indexer_keys (batch "
                   << keys.batch() << ", head_dim " << keys.head_dim() << ", next position "
                   << keys.next_position() << ") must match the latent cache (batch "
                   << cache.batch() << ", next position " << cache.next_position() << ") and d_I ("
                   << indexer_.config().head_dim << ")");
    keys.check_room(n);
    return n;
  }

  /// The absorbed attention of the chunk's queries q [B*n, H_q·width] over their selected latent
  /// rows -> o_latent [B*n, H_q·d_kv] (a whole-row format: see detail::latent_outputs).
  template <class Storage>
  RowMatrix<Scalar> attend_selected(const RowMatrix<Scalar>& q, Index n,
                                    const KeySelection& selected,
                                    const LatentCache<Scalar, Storage>& cache,
                                    const AttentionLayerParams<Scalar>& params) const {
    constexpr bool kWhole = is_latent_row_format_v<Storage>;
    const Index h_q = mla_.config().num_q_heads;
    const SdpaParams attention =
        detail::mla_attention_params(mla_.config(), mla_.weights().sinks, params.attention);
    const auto queries =
        HeadsView<const Scalar>::token_major(q.data(), {cache.batch(), h_q, n, cache.row_width()});
    return detail::latent_outputs<Scalar>(
        queries.shape(), cache.latent_dim(), kWhole ? cache.row_width() : cache.latent_dim(),
        [&](const HeadsView<Scalar>& o) {
          if constexpr (kWhole) {
            sdpa_sparse(queries, cache.rows(), cache.rows(), selected, attention, o);
          } else {
            sdpa_sparse(queries, cache.rows(), cache.latent(), selected, attention, o);
          }
        });
  }

  MultiHeadLatentAttention<Scalar, Weight> mla_;
  LightningIndexer<Scalar, Weight> indexer_;
  MlaAbsorbedWeights<Weight> absorbed_;
};

}  // namespace apex
