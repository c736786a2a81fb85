// SPDX-License-Identifier: MIT
// Multi-head latent attention (§9): keys and values are decompressed from a small latent c_kv,
// queries from a latent c_q, and position enters through separate, rotated "decoupled RoPE"
// features concatenated to every query and key head.
//
//   x [B*S, d] ─ ·W_DKV ─▶ c_kv [B*S, d_kv] ─┬─ ·W_UK ─▶ K      [B*S, H_kv·d_h] ─┐
//              │                              └─ ·W_UV ─▶ V      [B*S, H_kv·d_h] ─┼───────┐
//              ├ ·W_DQ ─▶ c_q [B*S, d_q] ──── ·W_UQ ────▶ Q      [B*S, H_q·d_h]  ─┼─┐     │
//              ├ ·W_QR ─▶ RoPE ─────────────────────────▶ Q_rope [B*S, H_q·d_r]  ─┼─┤     │
//              └ ·W_KR ─▶ RoPE ─────────────────────────▶ K_rope [B*S, H_kr·d_r] ─┘ │     │
//                                                                                   ▼     ▼
//   per head:  Q_final = [Q_h ‖ Q_rope,h]            (d_h + d_r)      sdpa, then Concat · W_O
//              K_final = [K_g ‖ K_rope,g or K_rope,0] (d_h + d_r)     -> out [B*S, d]
//              V_g                                    (d_h)
//
// Departures from and additions to the document (SEED-NOTES.md, §9.2 - §9.4):
//   - softmax scale 1/√(d_h + d_r), the width of Q_final and K_final (apex::sdpa's default);
//   - H_kr, the number of K_rope heads, is H_kv as §9.3 writes it (the default) or 1, one K_rope
//     head shared by every head as DeepSeek-V2/V3 do;
//   - the cache: §9.4 counts only c_kv (d_kv values per token), but K_rope is computed from x,
//     not from c_kv, so a decoder must cache it too: d_kv + H_kr·d_r values per token. Both
//     figures are available, under names that say which is which.
//
// Decoding against a LatentCache (kv_cache.hpp) comes in two exact forms:
//   naive     (forward_cached): decompress K = c_kv·W_UK and V = c_kv·W_UV for every cached
//             token, then attend as forward() does. The oracle, and the cheaper path for long
//             chunks such as a prompt.
//   absorbed  (forward_absorbed, after absorb_mla_weights): W_UK folded into the query side and
//             W_UV into the output side, so that every query head attends straight to the
//             cached rows [c_kv ‖ K_rope] and nothing is decompressed (mla_absorbed.hpp derives
//             it and holds its steps).
//
// This header holds the layer. The config, the §9.5 table and the cache sizes are in
// mla_config.hpp, the naive path's steps in detail/mla_steps.hpp; it includes them all.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cache_memory.hpp>
#include <apex/cached_attention.hpp>
#include <apex/cascade_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/detail/mla_steps.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/mla_absorbed.hpp>
#include <apex/mla_config.hpp>
#include <apex/paged_cache.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace apex {

/// A multi-head latent attention layer (§9) that owns its eight weight matrices. The attention
/// itself is apex::sdpa on the decompressed heads (d_qk = d_h + d_r, d_v = d_h), grouped when
/// H_kv < H_q, followed by W_O: the same multi_head_attention as every other layer.
///
/// forward() decompresses K and V for the whole block, which is the right computation for a
/// prompt. The latent's benefit is in what a decoder caches (c_kv and K_rope, a LatentCache):
/// forward_cached() decodes against it naively (decompressing the cache at every call) and
/// forward_absorbed() with the folded weights of absorb_mla_weights (decompressing nothing).
/// The layer is immutable after construction; its members are const and may run from several
/// threads at once (on different caches).
///
/// Scalar (float or double) is the type the layer computes in; Weight the type its matrices
/// (and its absorbed weights) are stored in: Scalar, or Eigen::half / Eigen::bfloat16, widened
/// as each product reads them, exactly as for GroupedQueryAttention.
template <class Scalar, class Weight = Scalar>
class MultiHeadLatentAttention {
 public:
  /// An empty layer: no weights and a zero config, as a moved-from layer is; every use of it
  /// throws std::invalid_argument.
  MultiHeadLatentAttention() = default;
  /// Takes ownership of the weights; throws if the config is invalid (H_kv must divide H_q, d_r
  /// even, H_kr ∈ {1, H_kv}) or any weight does not have its §9.5 shape.
  MultiHeadLatentAttention(const MlaConfig& config, MlaWeights<Weight> weights)
      : config_(config), weights_(std::move(weights)) {
    detail::require_supported_scalar<Scalar>();
    detail::require_weight_type<Scalar, Weight>();
    detail::check_mla_weights(config, weights_);
  }

  /// A layer with random weights for examples and tests: every entry of a [rows, cols] weight is
  /// drawn from N(0, 1/rows) (fan-in scaling), in the order of mla_parameter_table, from a
  /// std::mt19937_64 seeded with `seed` (each drawn in double and rounded once to Weight).
  static MultiHeadLatentAttention random(const MlaConfig& config, std::uint64_t seed) {
    return MultiHeadLatentAttention(config, detail::random_mla_weights<Weight>(config, seed));
  }

  /// The configuration the layer was built with (checked at construction).
  const MlaConfig& config() const { return config_; }
  /// The eight weight matrices, read-only (shapes as in mla_parameter_table).
  const MlaWeights<Weight>& weights() const { return weights_; }
  /// Number of weights, the §9.5 total (mla_parameter_count).
  std::int64_t parameter_count() const { return mla_parameter_count(config()); }
  /// Bytes of the weights: parameter_count()·sizeof(Weight).
  std::int64_t weight_bytes() const {
    return parameter_count() * static_cast<std::int64_t>(sizeof(Weight));
  }

  /// The same layer with its weights stored as W (Scalar, Eigen::half or Eigen::bfloat16):
  /// widened exactly or rounded once to nearest even. Allocates the new weights; absorbed weights
  /// are folded anew from them (absorb_mla_weights).
  template <class W>
  MultiHeadLatentAttention<Scalar, W> with_weights() const {
    check_constructed();
    return MultiHeadLatentAttention<Scalar, W>(config(), converted_weights<W>(weights_));
  }

  /// Compression, decompression and decoupled RoPE (§9.2, §9.3), everything before attention:
  ///   c_kv = x·W_DKV, K = c_kv·W_UK, V = c_kv·W_UV, c_q = x·W_DQ, Q = c_q·W_UQ,
  ///   Q_rope = RoPE(x·W_QR), K_rope = RoPE(x·W_KR)   (row b*S + s at position offset + s),
  ///   Q_final[:, head h] = [Q_h ‖ Q_rope,h],  K_final[:, head g] = [K_g ‖ K_rope,g]
  /// (K_rope,0 for every g when H_kr = 1). params.rope is required: a table with
  /// head_dim = d_r.
  ///   x: [B*S, d] -> q = Q_final [B*S, H_q·(d_h+d_r)], k = K_final [B*S, H_kv·(d_h+d_r)],
  ///      v = V [B*S, H_kv·d_h], heads side by side.
  /// Allocates the results and the intermediates (c_kv, c_q, Q, K, Q_rope, K_rope).
  template <class Derived>
  ProjectedQkv<Scalar> decompress(const Eigen::MatrixBase<Derived>& x, Index batch,
                                  const AttentionLayerParams<Scalar>& params) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    detail::check_mla_input(config(), xr, batch, params);
    return detail::mla_decompress(config(), weights_, xr, batch, params);
  }

  /// The layer's forward pass (§9):
  ///   out = Concat_h softmax(Q_final,h K_final,gᵀ / √(d_h + d_r) + mask) V_g · W_O,
  ///   g = h / (H_q / H_kv), with Q_final, K_final, V from decompress().
  /// The softmax scale defaults to 1/√(d_h + d_r) (params.attention.scale overrides it).
  ///   x: [B*S, d], B blocks of S rows; mask: for S queries against S keys; out: [B*S, d].
  /// Every check runs before out is written. out may be x itself. Allocates what decompress
  /// allocates and the [B*S, H_q·d_h] concatenation.
  template <class Derived>
  void forward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
               const AttentionLayerParams<Scalar>& params, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    detail::check_mla_input(config(), xr, batch, params);
    detail::attention_layer_forward<Scalar>(
        xr, batch, attention_heads(), mask, attention_params(params),
        [&] { return detail::mla_decompress(config(), weights_, xr, batch, params); }, weights_.w_o,
        out, "mla");
  }

  /// The layer's backward pass: for out = forward(x, batch, mask, params) and d_out = ∂L/∂out,
  /// the gradient by x into d_x and by every weight into `grads`, in the weights' own layout
  /// (MlaWeights<Scalar>: the eight matrices, and the sinks where the layer has them; each
  /// resized here), through the decompression, the decoupled RoPE (a K_rope head shared by every
  /// head gathers all of their gradients) and the latents (detail::mla_backward gives every
  /// formula). It recomputes the latents, the decompression and the attention from x (one
  /// forward pass more; nothing but x is kept between the passes). x, d_out, d_x: [B*S, d]; mask
  /// and params as forward(). Every check runs before anything is written; d_x must not overlap
  /// x or d_out. Allocates the latents, the projections, their gradients and the weight
  /// gradients. Bit-identical for any number of threads.
  template <class Derived, class DOutDerived>
  void backward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
                const AttentionLayerParams<Scalar>& params,
                const Eigen::MatrixBase<DOutDerived>& d_out, RowRef<Scalar> d_x,
                MlaWeights<Scalar>& grads) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    const ConstRowRef<Scalar> dy = detail::layer_rows<Scalar>(d_out);
    detail::check_mla_input(config(), xr, batch, params);
    const SdpaParams attention = attention_params(params);
    const Index seq = xr.rows() / batch;
    detail::check_layer_attention<Scalar>({batch, seq, seq, "B*S"}, attention_heads(), mask,
                                          attention, d_x, config().d_model, "mla");
    detail::check_layer_backward(xr, dy, d_x, "mla");
    detail::mla_backward(config(), weights_, xr, batch, mask, attention, params, dy, d_x, grads);
  }

  /// Value-returning forward: a new [B*S, d] matrix.
  template <class Derived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<Derived>& x, Index batch,
                            const AttentionMask<Scalar>& mask,
                            const AttentionLayerParams<Scalar>& params) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward(x, batch, mask, params, out);
    return out;
  }

  /// An empty latent cache for this layer: c_kv and K_rope of `capacity` tokens, stored as
  /// Storage (Scalar, or Eigen::half / Eigen::bfloat16 for half the bytes).
  template <class Storage = Scalar>
  LatentCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    return LatentCache<Scalar, Storage>(
        {batch, config().d_kv, config().rope_key_heads(), config().rope_dim, capacity});
  }

  /// Naive decoding (§9, the oracle of forward_absorbed): the forward pass of a chunk of n new
  /// tokens per sequence at absolute positions [p, p + n), p = params.position_offset. Appends
  /// the chunk's c_kv = x·W_DKV and K_rope = RoPE(x·W_KR) to the cache, decompresses K and V of
  /// every cached token (K = c_kv·W_UK, V = c_kv·W_UV, K_final = [K ‖ K_rope]) and attends:
  ///   out = Concat_h softmax(Q_final,h K_final,gᵀ / √(d_h + d_r) + mask) V_g · W_O
  /// over keys [0, p + n), exactly what forward() computes for these rows of the sequence.
  ///   x: [B*n, d], B = cache.batch(); mask: position mask with offsets unset (a prefix must lie
  ///   inside the first chunk); params: rope required, position_offset = cache.next_position();
  ///   cache: this layer's d_kv, H_kr, d_r, room for n more tokens -> out: [B*n, d].
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// decompressed K and V of the whole cache ([B·(p+n), H_kv·(d_h + d_r)] and [B·(p+n), H_kv·d_h])
  /// besides the chunk's projections: O(cache) work and memory per call, the cost that
  /// forward_absorbed avoids. A 16-bit cache holds c_kv and K_rope rounded once; they are
  /// widened as they are decompressed.
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params,
                      LatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    detail::check_mla_cached(config(), weights_, xr, mask, params, cache, attention_heads(), out);
    const Index batch = cache.batch();
    const RowMatrix<Scalar> q = detail::mla_final_queries(config(), weights_, xr, batch, params);
    append_latents(xr, batch, params, cache);
    detail::attend_decompressed(config(), weights_, q, cache,
                                detail::cached_mask<Scalar>(mask, params.position_offset, 0),
                                attention_params(params), out);
  }

  /// Absorbed decoding (§9 with W_UK folded into the query side and W_UV into the output side,
  /// see the top of mla_absorbed.hpp): the same result as forward_cached, without decompressing
  /// anything. For the chunk's rows:
  ///   q̃_h  = Q_h W_UK,gᵀ  (d_kv)           (Q_h = c_q W_UQ,h, or c_q·W_q_latent,h when folded)
  ///   q_h' = [q̃_h ‖ Q_rope,h]  against keys [c_kv ‖ K_rope] (the cache's rows) and values c_kv,
  ///   o_h  = softmax(q_h'·keysᵀ / √(d_h + d_r) + mask) c_kv               (d_kv)
  ///   out  = Concat_h (o_h W_UV,g) · W_O     (or Concat_h o_h · W_o_latent when folded)
  /// One apex::sdpa call: a single key/value head of width d_kv + H_kr·d_r read once for all
  /// H_q query heads. When H_kr = H_kv > 1 the cached row holds every group's K_rope, and query
  /// head h carries its Q_rope in the slot of its group and zeros elsewhere (exact; it costs
  /// (H_kr − 1)·d_r multiply-adds per score and no extra memory). The softmax scale is
  /// params.attention.scale or 1/√(d_h + d_r), as in forward().
  ///   absorbed: absorb_mla_weights(*this) (computed once, at load time)
  ///   other arguments, checks and aliasing as for forward_cached.
  /// Allocates the chunk's projections, its [B*n, H_q·(d_kv + H_kr·d_r)] queries and
  /// [B*n, H_q·d_kv] attention output: O(chunk) memory, nothing proportional to the cache.
  /// A 16-bit or quantized cache's rows are read as stored, widened by sdpa (for a whole-row
  /// format, FlashMlaFp8Row, see detail::attend_latent_rows).
  template <class Derived, class Storage>
  void forward_absorbed(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                        const AttentionLayerParams<Scalar>& params,
                        const MlaAbsorbedWeights<Weight>& absorbed,
                        LatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    check_absorbed(absorbed);
    const Index n = detail::check_mla_cached(config(), weights_, xr, mask, params, cache,
                                             detail::mla_absorbed_heads(config()), out);
    const Index batch = cache.batch();
    const Index h_q = config().num_q_heads;
    const RowMatrix<Scalar> q = detail::absorbed_queries(
        config(), weights_, xr, {params.position_offset, batch, nullptr}, params, absorbed);
    append_latents(xr, batch, params, cache);
    const RowMatrix<Scalar> o_latent = detail::attend_latent_rows(
        HeadsView<const Scalar>::token_major(q.data(), {batch, h_q, n, cache.row_width()}), cache,
        detail::cached_mask<Scalar>(mask, params.position_offset, 0), attention_params(params));
    detail::absorbed_output(config(), weights_, o_latent, absorbed, out);
  }

  /// Absorbed decoding of many sequences of a paged latent cache in one step: rows [cu[i],
  /// cu[i + 1]) of x are the next tokens of sequence ids[i], at positions cache.length(ids[i]) +
  /// s. As forward_absorbed for each sequence, with the rows of all of them projected together
  /// (each rotated at its own position), each sequence's latent rows appended to its pages and
  /// one sdpa_paged call over every sequence's held rows, under masks[i] (masks[0] for all when
  /// it has one entry; sdpa_cascade or the draft trees' rules as params asks, as for
  /// GroupedQueryAttention::forward_paged).
  ///   x: [T, d]; cu_seqlens: N + 1 row offsets; ids: N distinct live sequences; masks: position
  ///   masks with their offsets unset; params: RoPE table (required) covering every new
  ///   position, position_offset 0; absorbed: absorb_mla_weights(*this) -> out: [T, d].
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// projections, the positions, the [T, H_q·(d_kv + H_kr·d_r)] queries and the [T, H_q·d_kv]
  /// attention output (a whole-row format, FlashMlaFp8Row: see detail::latent_outputs).
  template <class Derived, class Storage>
  void forward_paged(const Eigen::MatrixBase<Derived>& x, const std::vector<Index>& cu_seqlens,
                     const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                     const AttentionLayerParams<Scalar>& params,
                     const MlaAbsorbedWeights<Weight>& absorbed,
                     PagedLatentCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    check_absorbed(absorbed);
    detail::check_mla_rope(config(), params.rope);
    detail::check_paged_layer_input(xr, config().d_model, params.position_offset, "mla");
    detail::check_mla_paged_cache(config(), cache);
    const SdpaParams attention = attention_params(params);
    const detail::LayerHeads heads = detail::mla_absorbed_heads(config());
    const Index rows = xr.rows(), h_q = heads.num_q_heads, width = heads.qk_dim;
    const Index d_kv = config().d_kv;
    detail::check_layer_attention<Scalar>({1, rows, 0, "T"}, heads, {}, attention, out,
                                          config().d_model, "mla");
    const Vector<Index> positions = detail::paged_step_positions(
        rows, cu_seqlens, ids, masks, cache, params.rope, "mla", params.row_positions);
    const detail::RowPositions at{0, 1, &positions};
    const RowMatrix<Scalar> q =
        detail::absorbed_queries(config(), weights_, xr, at, params, absorbed);
    const RowMatrix<Scalar> latent = detail::mla_latent_rows(config(), weights_, xr, at, params);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index first = cu_seqlens[i];
      cache.append(ids[i], latent.middleRows(first, cu_seqlens[i + 1] - first));
    }
    const RowMatrix<Scalar> o_latent = detail::latent_outputs<Scalar>(
        {1, h_q, rows, width}, d_kv, cache.value_dim(), [&](const HeadsView<Scalar>& o) {
          detail::paged_step_attention(
              HeadsView<const Scalar>::token_major(q.data(), {1, h_q, rows, width}), cu_seqlens,
              cache, ids, masks, attention, params, o);
        });
    detail::absorbed_output(config(), weights_, o_latent, absorbed, out);
  }

  /// Value-returning forward_cached: a new [B*n, d] matrix.
  template <class Derived, class Storage>
  RowMatrix<Scalar> forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                   const AttentionLayerParams<Scalar>& params,
                                   LatentCache<Scalar, Storage>& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_cached(x, mask, params, cache, out);
    return out;
  }

  /// Value-returning forward_absorbed: a new [B*n, d] matrix.
  template <class Derived, class Storage>
  RowMatrix<Scalar> forward_absorbed(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                     const AttentionLayerParams<Scalar>& params,
                                     const MlaAbsorbedWeights<Weight>& absorbed,
                                     LatentCache<Scalar, Storage>& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_absorbed(x, mask, params, absorbed, cache, out);
    return out;
  }

  /// The heads of the layer's attention (H_q, H_kv, d_qk, d_v): queries and keys are
  /// [content ‖ rope], d_h + d_r wide; values d_h wide.
  detail::LayerHeads attention_heads() const { return detail::mla_heads(config()); }

 private:
  /// Throws for an empty (default-constructed or moved-from) layer.
  void check_constructed() const {
    detail::check_constructed(config().d_model >= 1, "mla", "layer");
  }

  /// Throws for an empty layer or absorbed weights not folded from a layer of this shape.
  void check_absorbed(const MlaAbsorbedWeights<Weight>& absorbed) const {
    check_constructed();
    detail::check_absorbed_weights(config(), absorbed);
  }

  /// The attention parameters of a call: the layer's sinks, and its scale 1/√(d_h + d_r).
  SdpaParams attention_params(const AttentionLayerParams<Scalar>& params) const {
    return detail::mla_attention_params(config(), weights_.sinks, params.attention);
  }

  /// Appends the chunk's latent rows [c_kv ‖ K_rope] to the cache (checked).
  template <class Storage>
  void append_latents(const ConstRowRef<Scalar>& x, Index batch,
                      const AttentionLayerParams<Scalar>& params,
                      LatentCache<Scalar, Storage>& cache) const {
    cache.append(detail::mla_latent_rows(config(), weights_, x,
                                         {params.position_offset, batch, nullptr}, params),
                 params.position_offset);
  }

  detail::ResetOnMove<MlaConfig> config_;  // a moved-from layer is an empty one
  MlaWeights<Weight> weights_;
};

/// Folds MLA's decompression matrices into the query and output sides for absorbed decoding
/// (§9; see the top of mla_absorbed.hpp and MultiHeadLatentAttention::forward_absorbed). With
/// G = H_q / H_kv and g = h / G the key head of query head h:
///   query side  (W_UK into the query):   W_q_latent,h = W_UQ,h · W_UK,gᵀ      [d_q, d_kv]
///   output side (W_UV into the output):  W_o_latent,h = W_UV,g · W_O,h        [d_kv, d]
/// where W_UQ,h, W_UK,g, W_UV,g are the d_h columns of head h (g) and W_O,h the d_h rows of head
/// h. Each side is multiplied or kept factored as params says (MlaFold). Products are formed in
/// double from the stored weights and rounded once to the layer's Weight. Apply once per layer
/// at load time; the result stays valid as long as the layer's weights (it does not refer to the
/// layer). Allocates the products: H_q·d_q·d_kv and H_q·d_kv·d weights when multiplied, nothing
/// when factored.
template <class Scalar, class Weight>
MlaAbsorbedWeights<Weight> absorb_mla_weights(const MultiHeadLatentAttention<Scalar, Weight>& layer,
                                              const MlaAbsorbParams& params = {}) {
  detail::require_supported_scalar<Scalar>();
  return detail::fold_mla_weights(layer.config(), layer.weights(), params);
}

}  // namespace apex
