// SPDX-License-Identifier: MIT
// Grouped-query attention (§8) and the attention layer that owns its projections.
//
// One code path serves three variants: with G = H_q / H_kv query heads per key/value head,
//   H_kv = H_q       multi-head attention (§7, G = 1)
//   1 < H_kv < H_q   grouped-query attention (§8)
//   H_kv = 1         multi-query attention (G = H_q)
// are the same GroupedQueryAttention with a different config. Query head i reads key/value head
// ⌊i / G⌋ through apex::sdpa's views; K and V are never repeated or copied per group. The
// config and weights are in gqa_config.hpp, the steps that need no layer in detail/gqa_steps.hpp.
//
//   x [B*S, d] ─┬─ x·W_Q ─▶ Q [B*S, H_q·d_h]  ─(RoPE)─┐
//               ├─ x·W_K ─▶ K [B*S, H_kv·d_h] ─(RoPE)─┼─▶ multi_head_attention ─▶ out [B*S, d]
//               └─ x·W_V ─▶ V [B*S, H_kv·d_h] ────────┘    (sdpa per head, concat, ·W_O)
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cached_attention.hpp>
#include <apex/cascade_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/gqa_steps.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/gqa_config.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace apex {

/// An attention layer with H_q query heads and H_kv key/value heads (§7, §8) that owns its
/// projections W_Q, W_K, W_V, W_O. Multi-head attention is the config H_kv = H_q
/// (GqaConfig::multi_head) and multi-query attention H_kv = 1: there is one implementation.
///
/// forward() attends within the block it is given (a prompt). forward_cached() is the decoding
/// form: it attends a chunk of new tokens against a cache the caller owns (a KvCache for full
/// attention, a SlidingWindowCache for a windowed layer) and appends the chunk to it.
/// The layer is immutable after construction; forward and forward_cached are const, and may run
/// from several threads at once on different caches.
///
/// Scalar (float or double) is the type the layer computes in and takes and returns x in; Weight
/// is the type its four matrices are stored in: Scalar, or Eigen::half / Eigen::bfloat16 for half
/// the bytes, widened as each product reads them (detail/matmul.hpp), so that a decoding step,
/// which reads every weight once per token, moves half as much. The layer then computes exactly
/// what a Scalar layer holding the rounded weights computes (with_weights converts).
template <class Scalar, class Weight = Scalar>
class GroupedQueryAttention {
 public:
  /// An empty layer: no weights and a zero config, as a moved-from layer is; every use of it
  /// throws std::invalid_argument.
  GroupedQueryAttention() = default;
  /// Takes ownership of the weights; throws if the config is invalid (H_kv must divide H_q) or
  /// any weight does not have the shape documented in GqaWeights.
  GroupedQueryAttention(const GqaConfig& config, GqaWeights<Weight> weights)
      : config_(config), weights_(std::move(weights)) {
    detail::require_supported_scalar<Scalar>();
    detail::require_weight_type<Scalar, Weight>();
    detail::check_gqa_config(config);
    detail::check_gqa_weights(config, weights_);
  }

  /// A layer with random weights for examples and tests: every entry of a [rows, cols] weight is
  /// drawn from N(0, 1/rows) (fan-in scaling, so activations keep their scale), in the order
  /// W_Q, W_K, W_V, W_O, from a std::mt19937_64 seeded with `seed` (each drawn in double and
  /// rounded once to Weight).
  static GroupedQueryAttention random(const GqaConfig& config, std::uint64_t seed) {
    return GroupedQueryAttention(config, detail::random_gqa_weights<Weight>(config, seed));
  }

  /// The configuration the layer was built with (checked at construction).
  const GqaConfig& config() const { return config_; }
  /// The projections W_Q, W_K, W_V, W_O, read-only (shapes as in GqaWeights).
  const GqaWeights<Weight>& weights() const { return weights_; }
  /// Number of weights, d·d_h·(2·H_q + 2·H_kv) (gqa_parameter_count).
  std::int64_t parameter_count() const { return gqa_parameter_count(config()); }
  /// Bytes of the weights: parameter_count()·sizeof(Weight).
  std::int64_t weight_bytes() const {
    return parameter_count() * static_cast<std::int64_t>(sizeof(Weight));
  }

  /// The same layer with its weights stored as W (Scalar, Eigen::half or Eigen::bfloat16):
  /// widened exactly or rounded once to nearest even. Allocates the new weights.
  template <class W>
  GroupedQueryAttention<Scalar, W> with_weights() const {
    check_constructed();
    return GroupedQueryAttention<Scalar, W>(config(), converted_weights<W>(weights_));
  }

  /// The projections of §8.2 with RoPE (§4) on Q and K when params.rope is set:
  ///   Q = RoPE(x·W_Q), K = RoPE(x·W_K), V = x·W_V, row b*S + s at position offset + s,
  /// and, with a QK-norm, every head of Q and K RMS-normalised before RoPE.
  /// x: [B*S, d] (B blocks of S rows) -> q [B*S, H_q·d_h], k and v [B*S, H_kv·d_h], heads side
  /// by side. Allocates the three results.
  template <class Derived>
  ProjectedQkv<Scalar> project(const Eigen::MatrixBase<Derived>& x, Index batch,
                               const AttentionLayerParams<Scalar>& params = {}) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    detail::check_gqa_input(config(), xr, batch, params);
    return project_checked(xr, batch, params);
  }

  /// The layer's forward pass (§7.2, §8.2):
  ///   head_i = softmax(scale · Q_i K_gᵀ + mask) V_g,  g = ⌊i / G⌋,
  ///   out = Concat(head_0, …, head_{H_q−1}) · W_O,
  /// with Q, K, V from project() (RoPE on Q and K if params.rope is set) and attention by
  /// apex::sdpa on token-major views of the projections (no copy, no repeated K/V).
  ///   x: [B*S, d], B blocks of S rows; mask: for S queries against S keys (positions relative to
  ///   each block unless mask.positions sets offsets); out: [B*S, d].
  /// Every check runs before out is written. out may be x itself (x is fully consumed by the
  /// projections first). Allocates Q, K, V and the [B*S, H_q·d_h] concatenation.
  template <class Derived>
  void forward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
               const AttentionLayerParams<Scalar>& params, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    detail::check_gqa_input(config(), xr, batch, params);
    detail::attention_layer_forward<Scalar>(
        xr, batch, attention_heads(), mask, attention_params(params),
        [&] { return project_checked(xr, batch, params); }, weights_.w_o, out, "gqa");
  }

  /// Value-returning forward: a new [B*S, d] matrix.
  template <class Derived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<Derived>& x, Index batch,
                            const AttentionMask<Scalar>& mask = {},
                            const AttentionLayerParams<Scalar>& params = {}) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward(x, batch, mask, params, out);
    return out;
  }

  /// The layer's backward pass: for out = forward(x, batch, mask, params) and d_out = ∂L/∂out,
  /// the gradient by x into d_x and by every weight into `grads`, in the weights' own layout
  /// (GqaWeights<Scalar>: w_q, w_k, w_v, w_o; sinks and the QK-norm's γ where the layer has
  /// them, each resized here):
  ///   d_concat = d_out·W_Oᵀ, dW_O = concatᵀ·d_out; dq, dk, dv and d sinks by sdpa_backward;
  ///   RoPE's and the QK-norm's backward on dq and dk; dW_Q = xᵀ·dq, dW_K = xᵀ·dk,
  ///   dW_V = xᵀ·dv; d_x = dq·W_Qᵀ + dk·W_Kᵀ + dv·W_Vᵀ.
  /// It recomputes the projections and the attention from x (one forward pass more; nothing is
  /// kept between the two passes but x). x, d_out, d_x: [B*S, d]; mask and params as forward().
  /// Every check runs before anything is written; d_x must not overlap x or d_out. Allocates
  /// the projections, the concatenation, their gradients and the weight gradients. Threads as
  /// its parts; bit-identical for any number of threads.
  template <class Derived, class DOutDerived>
  void backward(const Eigen::MatrixBase<Derived>& x, Index batch, const AttentionMask<Scalar>& mask,
                const AttentionLayerParams<Scalar>& params,
                const Eigen::MatrixBase<DOutDerived>& d_out, RowRef<Scalar> d_x,
                GqaWeights<Scalar>& grads) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    const ConstRowRef<Scalar> dy = detail::layer_rows<Scalar>(d_out);
    detail::check_gqa_input(config(), xr, batch, params);
    const SdpaParams attention = attention_params(params);
    const Index seq = xr.rows() / batch;
    detail::check_layer_attention<Scalar>({batch, seq, seq, "B*S"}, attention_heads(), mask,
                                          attention, d_x, config().d_model, "gqa");
    detail::check_layer_backward(xr, dy, d_x, "gqa");
    detail::gqa_backward(config(), weights_, xr, {params.position_offset, batch, nullptr}, mask,
                         attention, params, dy, d_x, grads);
  }

  /// An empty full cache for this layer: K and V of H_kv heads of d_h, `capacity` tokens,
  /// stored as Storage (Scalar, or Eigen::half / Eigen::bfloat16 for half the bytes):
  /// layer.make_cache<Eigen::half>(batch, capacity).
  template <class Storage = Scalar>
  KvCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    return KvCache<Scalar, Storage>({batch, config().num_kv_heads, config().head_dim, capacity});
  }

  /// An empty sliding-window cache for this layer: the last `window` tokens, stored as Storage.
  template <class Storage = Scalar>
  SlidingWindowCache<Scalar, Storage> make_window_cache(Index batch, Index window) const {
    check_constructed();
    return SlidingWindowCache<Scalar, Storage>(
        {batch, config().num_kv_heads, config().head_dim, window});
  }

  /// Decoding with a full cache (§7.4, §8): the forward pass of a chunk of n new tokens per
  /// sequence at absolute positions [p, p + n), p = params.position_offset, against every token
  /// the cache holds. Projects the chunk (RoPE at positions p … p + n − 1), appends its K and V
  /// to the cache, then
  ///   head_i = softmax(scale · Q_i K_gᵀ + mask) V_g over keys [0, p + n),  out = Concat · W_O
  /// with apex::sdpa reading the cache in place (no copy, no repeated K/V).
  ///   x: [B*n, d] with B = cache.batch() (B blocks of n rows, n >= 1)
  ///   mask: the position mask (causal, window, prefix) with its offsets unset: the queries are
  ///     positions [p, p + n) and the keys [0, p + n). A bidirectional prefix must lie inside
  ///     the first chunk.
  ///   params: position_offset must equal cache.next_position() (never backwards, never
  ///     skipping); RoPE table, scale and soft-cap as for forward().
  ///   cache: num_kv_heads and head_dim of this layer, room for n more tokens (a full cache
  ///     throws, see KvCache) -> out: [B*n, d].
  /// Fed the tokens of a sequence in any chunks, it computes what forward() computes on the whole
  /// sequence. Every check runs before the cache or out is written: on error both are unchanged.
  /// out may be x itself. Allocates the projections and the [B*n, H_q·d_h] concatenation.
  /// A 16-bit cache (Storage Eigen::half or Eigen::bfloat16) holds each chunk's own projected K
  /// and V rounded once, and the attention reads them as stored: it equals forward() on the K
  /// and V the cache stored. A chunk's projection may differ from the whole sequence's in
  /// float's last bit (another product), so a stored value may be one 16-bit step from a
  /// rounding of forward()'s.
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params, KvCache<Scalar, Storage>& cache,
                      RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    const Index n = detail::check_gqa_cached(config(), weights_, xr, mask, params, cache, out);
    cache.check_room(n);
    const Index batch = cache.batch();
    const ProjectedQkv<Scalar> p = project_checked(xr, batch, params);
    cache.append(p.k_heads(), p.v_heads(), params.position_offset);
    multi_head_attention(p.q_heads(), cache.keys(), cache.values(),
                         detail::cached_mask<Scalar>(mask, params.position_offset, 0),
                         attention_params(params), weights_.w_o, out);
  }

  /// Decoding with a sliding-window cache (§10): as the KvCache form, but the cache holds only
  /// the last W tokens. The chunk attends to what the cache holds and to itself
  /// (sdpa_with_window_cache: one pass over the ring's runs and the chunk), then its K and V are
  /// appended, evicting the oldest. mask must be causal with a window of at most W (the layer's
  /// §10 window); the cache's memory stays 2·B·H_kv·W·d_h scalars however long the sequence.
  /// Every check runs before the cache or out is written. out may be x itself. Allocates the
  /// projections, the concatenation and, for a 16-bit cache, the chunk's rounded K and V (see
  /// sdpa_with_window_cache).
  template <class Derived, class Storage>
  void forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                      const AttentionLayerParams<Scalar>& params,
                      SlidingWindowCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    const Index n = detail::check_gqa_cached(config(), weights_, xr, mask, params, cache, out);
    detail::check_window_rule(mask, cache.window(), "gqa");
    const Index batch = cache.batch();
    const ProjectedQkv<Scalar> p = project_checked(xr, batch, params);
    const Index h_q = config().num_q_heads;
    const Index d_h = config().head_dim;
    RowMatrix<Scalar> concat(xr.rows(), h_q * d_h);
    sdpa_with_window_cache<Scalar, Storage>(
        p.q_heads(), p.k_heads(), p.v_heads(), mask, attention_params(params), cache,
        HeadsView<Scalar>::token_major(concat.data(), {batch, h_q, n, d_h}));
    cache.append(p.k_heads(), p.v_heads(), params.position_offset);
    detail::matmul<Scalar>(concat, weights_.w_o, out);
  }

  /// Decoding many sequences of a paged cache in one step (§8 and §10 for each): rows [cu[i],
  /// cu[i + 1]) of x are the next tokens of sequence ids[i], at positions cache.length(ids[i]) + s.
  /// The rows of every sequence are projected together (one product per weight), each rotated at
  /// its own position; each sequence's K and V are appended to its pages, then every sequence
  /// attends over its held tokens under masks[i] (masks[0] for all when it has one entry) in one
  /// sdpa_paged call (sdpa_cascade with params.read_shared_pages_once; the draft trees' rules
  /// beside the masks with params.draft_trees), and the result is projected by W_O.
  ///   x: [T, d]; cu_seqlens: N + 1 row offsets; ids: N distinct live sequences; masks: position
  ///   masks with their offsets unset (the positions are the cache's); params: RoPE table
  ///   covering every new position, scale and soft-cap, position_offset 0 (unused)
  ///   -> out: [T, d].
  /// A sequence fed its tokens this way, in any chunks, gets what forward_cached gets, to the
  /// rounding of the other order of its key blocks. A window layer's caller may then forget the
  /// pages its window has passed (forget_before). Every check runs before the cache or out is
  /// written: on error both are unchanged. out may be x itself.
  /// Allocates the projections, the positions and the [T, H_q·d_h] concatenation.
  template <class Derived, class Storage>
  void forward_paged(const Eigen::MatrixBase<Derived>& x, const std::vector<Index>& cu_seqlens,
                     const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                     const AttentionLayerParams<Scalar>& params,
                     PagedKvCache<Scalar, Storage>& cache, RowRef<Scalar> out) const {
    const ConstRowRef<Scalar> xr = detail::layer_rows<Scalar>(x);
    check_constructed();
    detail::check_paged_layer_input(xr, config().d_model, params.position_offset, "gqa");
    detail::check_rope_head_dim(params.rope, config().head_dim, "the layer's head_dim", "gqa");
    detail::check_gqa_cache(config(), cache.num_kv_heads(), cache.head_dim());
    const SdpaParams attention = attention_params(params);
    const Index rows = xr.rows(), h_q = config().num_q_heads, d_h = config().head_dim;
    detail::check_layer_attention<Scalar>({1, rows, 0, "T"}, attention_heads(), {}, attention, out,
                                          config().d_model, "gqa");
    const Vector<Index> positions = detail::paged_step_positions(
        rows, cu_seqlens, ids, masks, cache, params.rope, "gqa", params.row_positions);
    const ProjectedQkv<Scalar> p =
        detail::gqa_project(config(), weights_, xr, {0, 1, &positions}, params);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index first = cu_seqlens[i], n = cu_seqlens[i + 1] - first;
      cache.append(ids[i], p.k_heads().middle_rows(first, n), p.v_heads().middle_rows(first, n));
    }
    RowMatrix<Scalar> concat(rows, h_q * d_h);
    detail::paged_step_attention(
        p.q_heads(), cu_seqlens, cache, ids, masks, attention, params,
        HeadsView<Scalar>::token_major(concat.data(), {1, h_q, rows, d_h}));
    detail::matmul<Scalar>(concat, weights_.w_o, out);
  }

  /// Value-returning forward_cached (either cache): a new [B*n, d] matrix.
  template <class Derived, class Cache>
  RowMatrix<Scalar> forward_cached(const Eigen::MatrixBase<Derived>& x, const PositionMask& mask,
                                   const AttentionLayerParams<Scalar>& params, Cache& cache) const {
    RowMatrix<Scalar> out(x.rows(), config().d_model);
    forward_cached(x, mask, params, cache, out);
    return out;
  }

  /// The heads of the layer's attention (H_q, H_kv, d_qk, d_v): every head is d_h wide.
  detail::LayerHeads attention_heads() const { return detail::gqa_heads(config()); }

 private:
  /// Throws for an empty (default-constructed or moved-from) layer.
  void check_constructed() const {
    detail::check_constructed(config().d_model >= 1, "gqa", "layer");
  }

  /// The attention parameters of a call, with the layer's sinks.
  SdpaParams attention_params(const AttentionLayerParams<Scalar>& params) const {
    return detail::with_layer_sinks(params.attention, weights_.sinks, "gqa");
  }

  /// The projections of checked input, rows rotated at position_offset + s per batch block.
  ProjectedQkv<Scalar> project_checked(const ConstRowRef<Scalar>& x, Index batch,
                                       const AttentionLayerParams<Scalar>& params) const {
    return detail::gqa_project(config(), weights_, x, {params.position_offset, batch, nullptr},
                               params);
  }

  detail::ResetOnMove<GqaConfig> config_;  // a moved-from layer is an empty one
  GqaWeights<Weight> weights_;
};

}  // namespace apex
