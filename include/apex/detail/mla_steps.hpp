// SPDX-License-Identifier: MIT
// The steps of MultiHeadLatentAttention (mla.hpp) that need only its config and weights, not the
// layer: the checks of the weights, the RoPE table and the caches against the config, the random
// weights, a call's attention parameters, and the projections of the naive path (decompression,
// the final queries, the latent rows a cache stores and the decompression of a cache). The
// absorbed path's steps are in mla_absorbed.hpp.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cached_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/layer_backward.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/mla_config.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace apex::detail {

/// The heads of the layer's attention (H_q, H_kv, d_qk, d_v): queries and keys are
/// [content ‖ rope], d_h + d_r wide; values d_h wide.
inline LayerHeads mla_heads(const MlaConfig& c) {
  return {c.num_q_heads, c.num_kv_heads, c.qk_dim(), c.head_dim};
}

/// The eight matrices of w (const or not) in mla_parameter_table's order.
template <class Weights>
auto mla_matrices(Weights& w) {
  return std::array{&w.w_dkv, &w.w_uk, &w.w_uv, &w.w_dq, &w.w_uq, &w.w_qr, &w.w_kr, &w.w_o};
}

/// Throws unless the config is valid and every weight has its §9.5 shape, with one sink per query
/// head or none.
template <class Weight>
void check_mla_weights(const MlaConfig& c, const MlaWeights<Weight>& weights) {
  const std::vector<MlaMatrixShape> table = mla_parameter_table(c);
  const auto matrices = mla_matrices(weights);
  for (std::size_t i = 0; i < table.size(); ++i) {
    const RowMatrix<Weight>& w = *matrices[i];
    APEX_CHECK(w.rows() == table[i].rows && w.cols() == table[i].cols,
               "[mla] " << table[i].name << " shape [" << w.rows() << ", " << w.cols()
                        << "] must be [" << table[i].rows << ", " << table[i].cols << "]");
  }
  check_head_values(weights.sinks, c.num_q_heads, "mla", "sinks");
}

/// Random weights for MultiHeadLatentAttention::random: every entry of a [rows, cols] weight drawn
/// from N(0, 1/rows), in the order of mla_parameter_table, from a std::mt19937_64 seeded with
/// `seed`. Throws (before allocating) on an invalid config or a weight size beyond 64 bits.
template <class Weight>
MlaWeights<Weight> random_mla_weights(const MlaConfig& c, std::uint64_t seed) {
  const std::vector<MlaMatrixShape> table = mla_parameter_table(c);
  checked_product(mla_parameter_count(c), static_cast<std::int64_t>(sizeof(Weight)), "mla",
                  "weight bytes");
  std::mt19937_64 rng(seed);
  MlaWeights<Weight> w;
  const auto matrices = mla_matrices(w);
  for (std::size_t i = 0; i < table.size(); ++i) {
    *matrices[i] = random_weight<Weight>(table[i].rows, table[i].cols, rng);
  }
  return w;
}

/// Throws unless the call has a RoPE table of head_dim d_r: decoupled RoPE always applies.
template <class Scalar>
void check_mla_rope(const MlaConfig& c, const RopeTable<Scalar>* rope) {
  APEX_CHECK(rope != nullptr,
             "[mla] params.rope (null) must be a RoPE table with head_dim = rope_dim ("
                 << c.rope_dim << "): decoupled RoPE (§9.3) always applies");
  check_rope_head_dim(rope, c.rope_dim, "rope_dim d_r", "mla");
}

/// Throws unless a LatentCache holds the layer's rows: c_kv of d_kv and H_kr K_rope heads of d_r.
template <class Cache>
void check_mla_cache(const MlaConfig& c, const Cache& cache) {
  APEX_CHECK(cache.latent_dim() == c.d_kv && cache.rope_heads() == c.rope_key_heads() &&
                 cache.rope_dim() == c.rope_dim,
             "[mla] cache latent_dim, rope_heads, rope_dim ("
                 << cache.latent_dim() << ", " << cache.rope_heads() << ", " << cache.rope_dim()
                 << ") must equal the layer's d_kv, H_kr, d_r (" << c.d_kv << ", "
                 << c.rope_key_heads() << ", " << c.rope_dim << ")");
}

/// Throws unless a PagedLatentCache holds the layer's rows: d_kv latent values in rows of
/// d_kv + H_kr·d_r.
template <class Cache>
void check_mla_paged_cache(const MlaConfig& c, const Cache& cache) {
  const Index width = c.d_kv + c.rope_key_heads() * c.rope_dim;
  APEX_CHECK(cache.latent_dim() == c.d_kv && cache.row_dim() == width,
             "[mla] cache latent_dim (" << cache.latent_dim() << ") and row_dim ("
                                        << cache.row_dim() << ") must be the layer's d_kv ("
                                        << c.d_kv << ") and d_kv + H_kr·d_r (" << width << ")");
}

/// The attention parameters of a call: the layer's sinks, and the scale 1/√(d_h + d_r) unless
/// `attention` sets one. The default is the layer's, whatever width its keys are read at: the
/// absorbed path reads keys d_kv + H_kr·d_r wide, for which sdpa's 1/√d_qk would be wrong.
inline SdpaParams mla_attention_params(const MlaConfig& c, const std::vector<double>& sinks,
                                       const SdpaParams& attention) {
  SdpaParams p = with_layer_sinks(attention, sinks, "mla");
  if (!p.scale) p.scale = 1.0 / std::sqrt(static_cast<double>(c.qk_dim()));
  return p;
}

/// The checks of a call on x [B*S, d]: the layer is not empty, params has a RoPE table of d_r
/// covering the rows' positions.
template <class Scalar>
void check_mla_input(const MlaConfig& c, const ConstRowRef<Scalar>& x, Index batch,
                     const AttentionLayerParams<Scalar>& params) {
  check_constructed(c.d_model >= 1, "mla", "layer");
  check_mla_rope(c, params.rope);
  check_layer_input(x, batch, c.d_model, params.rope, params.position_offset, "mla");
}

/// The checks shared by both cached forms, the cache's room included; returns n, the new tokens
/// per sequence. The attention is checked at the shapes it will have (`heads`): queries and keys
/// d_h + d_r wide with H_kv key heads (naive), or d_kv + H_kr·d_r wide with one key head whose
/// values are d_kv wide (absorbed).
template <class Scalar, class Weight, class Cache>
Index check_mla_cached(const MlaConfig& c, const MlaWeights<Weight>& w,
                       const ConstRowRef<Scalar>& x, const PositionMask& mask,
                       const AttentionLayerParams<Scalar>& params, const Cache& cache,
                       const LayerHeads& heads, const RowRef<Scalar>& out) {
  const Index batch = cache.batch();
  // Positions first: params.position_offset must be the cache's next position, which also keeps
  // the layer's own position arithmetic below far from overflow.
  check_cached_rule(mask, params.position_offset, cache.next_position(), x.rows() / batch, "mla");
  check_mla_input(c, x, batch, params);
  check_mla_cache(c, cache);
  const Index n = x.rows() / batch;
  cache.check_room(n);
  check_layer_attention<Scalar>({batch, n, cache.size() + n, "B*n"}, heads,
                                cached_mask<Scalar>(mask, params.position_offset, 0),
                                mla_attention_params(c, w.sinks, params.attention), out, c.d_model,
                                "mla");
  return n;
}

/// [content_h ‖ rope_h] for every head h: content [rows, H·d_h] and rope [rows, H·d_r], or
/// [rows, d_r] shared by every head (H_kr = 1) -> [rows, H·(d_h + d_r)]. The copies are
/// O(rows · width), small next to the products that made the parts.
template <class Scalar>
RowMatrix<Scalar> concat_head_parts(const RowMatrix<Scalar>& content, Index d_h,
                                    const RowMatrix<Scalar>& rope, Index d_r) {
  const Index heads = content.cols() / d_h;
  const Index d_qk = d_h + d_r;
  RowMatrix<Scalar> joined(content.rows(), heads * d_qk);
  for (Index h = 0; h < heads; ++h) {
    const Index rope_head = rope.cols() == d_r ? 0 : h;
    joined.middleCols(h * d_qk, d_h) = content.middleCols(h * d_h, d_h);
    joined.middleCols(h * d_qk + d_h, d_r) = rope.middleCols(rope_head * d_r, d_r);
  }
  return joined;
}

/// Q_final = [c_q·W_UQ ‖ RoPE(x·W_QR)] per head: x [B*n, d] -> [B*n, H_q·(d_h + d_r)], row
/// b*n + s rotated at position params.position_offset + s. Allocates c_q, Q, Q_rope and the result.
template <class Scalar, class Weight>
RowMatrix<Scalar> mla_final_queries(const MlaConfig& c, const MlaWeights<Weight>& w,
                                    const ConstRowRef<Scalar>& x, Index batch,
                                    const AttentionLayerParams<Scalar>& params) {
  const RowMatrix<Scalar> c_q = matmul<Scalar>(x, w.w_dq);
  const RowMatrix<Scalar> q_content = matmul<Scalar>(c_q, w.w_uq);
  RowMatrix<Scalar> q_rope = matmul<Scalar>(x, w.w_qr);
  apply_rope_per_batch(*params.rope, params.position_offset, batch, q_rope);
  return concat_head_parts(q_content, c.head_dim, q_rope, c.rope_dim);
}

/// MultiHeadLatentAttention::decompress on checked input: Q_final from mla_final_queries, and
/// K_final = [c_kv·W_UK ‖ K_rope] and V = c_kv·W_UV from c_kv = x·W_DKV (§9.2), with
/// K_rope = RoPE(x·W_KR) straight from x (§9.3).
template <class Scalar, class Weight>
ProjectedQkv<Scalar> mla_decompress(const MlaConfig& c, const MlaWeights<Weight>& w,
                                    const ConstRowRef<Scalar>& x, Index batch,
                                    const AttentionLayerParams<Scalar>& params) {
  ProjectedQkv<Scalar> p = empty_projection<Scalar>(batch, mla_heads(c));
  if (x.rows() == 0) {
    // No tokens: the projections are empty, with null data that must not be cut into blocks.
    p.q.resize(0, c.num_q_heads * c.qk_dim());
    p.k.resize(0, c.num_kv_heads * c.qk_dim());
    p.v.resize(0, c.num_kv_heads * c.head_dim);
    return p;
  }
  const RowMatrix<Scalar> c_kv = matmul<Scalar>(x, w.w_dkv);
  const RowMatrix<Scalar> k_content = matmul<Scalar>(c_kv, w.w_uk);
  p.v = matmul<Scalar>(c_kv, w.w_uv);
  p.q = mla_final_queries(c, w, x, batch, params);
  RowMatrix<Scalar> k_rope = matmul<Scalar>(x, w.w_kr);
  apply_rope_per_batch(*params.rope, params.position_offset, batch, k_rope);
  p.k = concat_head_parts(k_content, c.head_dim, k_rope, c.rope_dim);
  return p;
}

/// The rows a latent cache stores for x [rows, d]: [rows, d_kv + H_kr·d_r] = [c_kv ‖ K_rope]
/// with c_kv = x·W_DKV and K_rope = RoPE(x·W_KR), every row rotated at its position `at`.
template <class Scalar, class Weight>
RowMatrix<Scalar> mla_latent_rows(const MlaConfig& c, const MlaWeights<Weight>& w,
                                  const ConstRowRef<Scalar>& x, const RowPositions& at,
                                  const AttentionLayerParams<Scalar>& params) {
  RowMatrix<Scalar> k_rope = matmul<Scalar>(x, w.w_kr);
  apply_rope_at(*params.rope, at, k_rope);
  RowMatrix<Scalar> rows(x.rows(), c.d_kv + k_rope.cols());
  matmul<Scalar>(x, w.w_dkv, rows.leftCols(c.d_kv));
  rows.rightCols(k_rope.cols()) = k_rope;
  return rows;
}

/// K_final [B·len, H_kv·(d_h + d_r)] and V [B·len, H_kv·d_h] of every token a latent cache holds
/// (len = cache.size()): K = c_kv·W_UK, V = c_kv·W_UV, K_final = [K ‖ K_rope], the cache's rows
/// [c_kv ‖ K_rope] widened as they are read (whole rows: every format has a view of them).
/// O(cache) work and memory: the naive path's cost.
template <class Scalar, class Weight, class Cache>
// Internal, the outputs (k, v) in their order. NOLINTBEGIN(bugprone-easily-swappable-parameters)
void decompress_latent_cache(const MlaConfig& c, const MlaWeights<Weight>& w, const Cache& cache,
                             RowMatrix<Scalar>& k, RowMatrix<Scalar>& v) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const Index h_kv = c.num_kv_heads;
  const Index d_h = c.head_dim;
  const Index d_r = c.rope_dim;
  const Index d_qk = c.qk_dim();
  const Index len = cache.size();
  k.resize(cache.batch() * len, h_kv * d_qk);
  v.resize(cache.batch() * len, h_kv * d_h);
  RowMatrix<Scalar> k_content;
  for (Index b = 0; b < cache.batch(); ++b) {
    const auto rows = head_values<Scalar>(cache.rows(), b, 0);  // [len, d_kv + H_kr·d_r]
    const ConstRowRef<Scalar> c_kv = rows.leftCols(c.d_kv);
    k_content = matmul<Scalar>(c_kv, w.w_uk);
    matmul<Scalar>(c_kv, w.w_uv, v.middleRows(b * len, len));
    for (Index g = 0; g < h_kv; ++g) {
      const Index rope_head = c.rope_key_heads() == 1 ? 0 : g;
      k.block(b * len, g * d_qk, len, d_h) = k_content.middleCols(g * d_h, d_h);
      k.block(b * len, g * d_qk + d_h, len, d_r) = rows.middleCols(c.d_kv + rope_head * d_r, d_r);
    }
  }
}

/// Naive attention of the chunk's final queries q [B*n, H_q·(d_h + d_r)] over every token the
/// cache holds, decompressed (decompress_latent_cache), then W_O -> out [B*n, d]. Allocates the
/// decompressed cache and the [B*n, H_q·d_h] concatenation.
template <class Scalar, class Weight, class Cache>
void attend_decompressed(const MlaConfig& c, const MlaWeights<Weight>& w,
                         const RowMatrix<Scalar>& q, const Cache& cache,
                         const AttentionMask<Scalar>& mask, const SdpaParams& attention,
                         RowRef<Scalar> out) {
  const Index batch = cache.batch();
  const Index len = cache.size();
  const Index d_qk = c.qk_dim();
  RowMatrix<Scalar> k, v;
  decompress_latent_cache(c, w, cache, k, v);
  multi_head_attention(
      HeadsView<const Scalar>::token_major(q.data(),
                                           {batch, c.num_q_heads, q.rows() / batch, d_qk}),
      HeadsView<const Scalar>::token_major(k.data(), {batch, c.num_kv_heads, len, d_qk}),
      HeadsView<const Scalar>::token_major(v.data(), {batch, c.num_kv_heads, len, c.head_dim}),
      mask, attention, w.w_o, out);
}

/// The inverse of concat_head_parts for gradients: d_joined [rows, H·(d_h + d_r)] is cut into
/// the content part [rows, H·d_h] and the rope part [rows, rope_heads·d_r]; with one rope head
/// shared by every head (rope_heads = 1) its gradient is the sum over the heads, in head order.
template <class Scalar>
// Internal, the outputs (content, rope) in their order.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
void split_head_parts(const RowMatrix<Scalar>& d_joined, Index d_h, Index d_r, Index rope_heads,
                      RowMatrix<Scalar>& content, RowMatrix<Scalar>& rope) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const Index d_qk = d_h + d_r;
  const Index heads = d_joined.cols() / d_qk;
  content.resize(d_joined.rows(), heads * d_h);
  rope = RowMatrix<Scalar>::Zero(d_joined.rows(), rope_heads * d_r);
  for (Index h = 0; h < heads; ++h) {
    const Index rope_head = rope_heads == 1 ? 0 : h;
    content.middleCols(h * d_h, d_h) = d_joined.middleCols(h * d_qk, d_h);
    rope.middleCols(rope_head * d_r, d_r) += d_joined.middleCols(h * d_qk + d_h, d_r);
  }
}

/// The backward pass of an MLA layer on checked input x [B*S, d] (see
/// MultiHeadLatentAttention::backward): recomputes the latents, the decompression and the
/// attention, then, from dQ_final, dK_final and dV (attention_projection_backward, with dW_O and
/// d sinks):
///   dQ_final = [dQ ‖ dQ_rope], dK_final = [dK ‖ dK_rope]   (a shared K_rope head sums its heads)
///   RoPE's backward on dQ_rope and dK_rope
///   dW_UQ = c_qᵀ·dQ,  dc_q = dQ·W_UQᵀ,  dW_DQ = xᵀ·dc_q,  dW_QR = xᵀ·dQ_rope,  dW_KR = xᵀ·dK_rope
///   dW_UK = c_kvᵀ·dK, dW_UV = c_kvᵀ·dV, dc_kv = dK·W_UKᵀ + dV·W_UVᵀ, dW_DKV = xᵀ·dc_kv
///   dx = dc_q·W_DQᵀ + dQ_rope·W_QRᵀ + dK_rope·W_KRᵀ + dc_kv·W_DKVᵀ.
/// Allocates the latents, the projections, their gradients and the weight gradients.
template <class Scalar, class Weight>
void mla_backward(const MlaConfig& c, const MlaWeights<Weight>& w, const ConstRowRef<Scalar>& x,
                  Index batch, const AttentionMask<Scalar>& mask, const SdpaParams& attention,
                  const AttentionLayerParams<Scalar>& params, const ConstRowRef<Scalar>& d_out,
                  RowRef<Scalar> d_x, MlaWeights<Scalar>& g) {
  const RowMatrix<Scalar> c_kv = matmul<Scalar>(x, w.w_dkv);
  const RowMatrix<Scalar> c_q = matmul<Scalar>(x, w.w_dq);
  const ProjectedQkv<Scalar> p = mla_decompress(c, w, x, batch, params);
  g.sinks.clear();
  const ProjectionGradients<Scalar> d =
      attention_projection_backward(p, mask, attention, w.w_o, d_out, g.w_o, &g.sinks);
  RowMatrix<Scalar> dq, dq_rope, dk, dk_rope;
  split_head_parts(d.q, c.head_dim, c.rope_dim, c.num_q_heads, dq, dq_rope);
  split_head_parts(d.k, c.head_dim, c.rope_dim, c.rope_key_heads(), dk, dk_rope);
  const RowPositions at{params.position_offset, batch, nullptr};
  apply_rope_at<true>(*params.rope, at, dq_rope);
  apply_rope_at<true>(*params.rope, at, dk_rope);
  projection_weight_gradient<Scalar>(c_q, dq, g.w_uq);
  RowMatrix<Scalar> dc_q = RowMatrix<Scalar>::Zero(x.rows(), c.d_q);
  add_input_gradient<Scalar>(dq, w.w_uq, dc_q);
  projection_weight_gradient<Scalar>(x, dc_q, g.w_dq);
  projection_weight_gradient<Scalar>(x, dq_rope, g.w_qr);
  projection_weight_gradient<Scalar>(x, dk_rope, g.w_kr);
  projection_weight_gradient<Scalar>(c_kv, dk, g.w_uk);
  projection_weight_gradient<Scalar>(c_kv, d.v, g.w_uv);
  RowMatrix<Scalar> dc_kv = RowMatrix<Scalar>::Zero(x.rows(), c.d_kv);
  add_input_gradient<Scalar>(dk, w.w_uk, dc_kv);
  add_input_gradient<Scalar>(d.v, w.w_uv, dc_kv);
  projection_weight_gradient<Scalar>(x, dc_kv, g.w_dkv);
  d_x.setZero();
  add_input_gradient<Scalar>(dc_q, w.w_dq, d_x);
  add_input_gradient<Scalar>(dq_rope, w.w_qr, d_x);
  add_input_gradient<Scalar>(dk_rope, w.w_kr, d_x);
  add_input_gradient<Scalar>(dc_kv, w.w_dkv, d_x);
}

}  // namespace apex::detail
