// SPDX-License-Identifier: MIT
// The steps of GroupedQueryAttention (gqa.hpp) that need only its config and weights, not the
// layer: the checks of the weights and of a cache against the config, the random weights, and
// the projections (QK-norm, RoPE) that every forward form starts with.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cached_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/layer_backward.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/gqa_config.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>

namespace apex::detail {

/// The heads of a GQA layer's attention (H_q, H_kv, d_qk, d_v): every head is d_h wide.
inline LayerHeads gqa_heads(const GqaConfig& c) {
  return {c.num_q_heads, c.num_kv_heads, c.head_dim, c.head_dim};
}

/// Throws unless every weight has the shape documented in GqaWeights for a (checked) config:
/// the four projections, one sink per query head or none, QK-norm γ of d_h and a positive ε.
template <class Weight>
void check_gqa_weights(const GqaConfig& c, const GqaWeights<Weight>& w) {
  const Index d = c.d_model;
  const Index q_width = c.num_q_heads * c.head_dim;
  const Index kv_width = c.num_kv_heads * c.head_dim;
  check_weight_shape(w.w_q, d, q_width, "gqa", "w_q", "[d_model, num_q_heads*head_dim]");
  check_weight_shape(w.w_k, d, kv_width, "gqa", "w_k", "[d_model, num_kv_heads*head_dim]");
  check_weight_shape(w.w_v, d, kv_width, "gqa", "w_v", "[d_model, num_kv_heads*head_dim]");
  check_weight_shape(w.w_o, q_width, d, "gqa", "w_o", "[num_q_heads*head_dim, d_model]");
  check_head_values(w.sinks, c.num_q_heads, "gqa", "sinks");
  if (const auto& norm = w.qk_norm) {
    APEX_CHECK(norm->q_gamma.size() == c.head_dim && norm->k_gamma.size() == c.head_dim,
               "[gqa] qk_norm gamma lengths (" << norm->q_gamma.size() << ", "
                                               << norm->k_gamma.size() << ") must be head_dim "
                                               << c.head_dim);
    APEX_CHECK(std::isfinite(norm->eps) && norm->eps > 0.0,
               "[gqa] qk_norm eps (" << norm->eps << ") must be positive and finite");
  }
}

/// Random weights for GroupedQueryAttention::random: every entry of a [rows, cols] weight drawn
/// from N(0, 1/rows), in the order W_Q, W_K, W_V, W_O, from a std::mt19937_64 seeded with
/// `seed`. Throws (before allocating) on an invalid config or a weight size beyond 64 bits.
template <class Weight>
GqaWeights<Weight> random_gqa_weights(const GqaConfig& c, std::uint64_t seed) {
  check_gqa_config(c);
  checked_product(gqa_parameter_count(c), static_cast<std::int64_t>(sizeof(Weight)), "gqa",
                  "weight bytes");
  std::mt19937_64 rng(seed);
  const Index d = c.d_model;
  const Index q_width = c.num_q_heads * c.head_dim;
  const Index kv_width = c.num_kv_heads * c.head_dim;
  GqaWeights<Weight> w;
  w.w_q = random_weight<Weight>(d, q_width, rng);
  w.w_k = random_weight<Weight>(d, kv_width, rng);
  w.w_v = random_weight<Weight>(d, kv_width, rng);
  w.w_o = random_weight<Weight>(q_width, d, rng);
  return w;
}

/// Throws unless a cache (full, sliding-window or paged) holds the layer's key/value heads.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the cache's two accessors
inline void check_gqa_cache(const GqaConfig& c, Index num_kv_heads, Index head_dim) {
  APEX_CHECK(num_kv_heads == c.num_kv_heads && head_dim == c.head_dim,
             "[gqa] cache num_kv_heads (" << num_kv_heads << ") and head_dim (" << head_dim
                                          << ") must equal the layer's num_kv_heads ("
                                          << c.num_kv_heads << ") and head_dim (" << c.head_dim
                                          << ")");
}

/// The checks of a call on x [B*S, d]: the layer is not empty, a RoPE table (when given) is d_h
/// wide and covers the rows' positions.
template <class Scalar>
void check_gqa_input(const GqaConfig& c, const ConstRowRef<Scalar>& x, Index batch,
                     const AttentionLayerParams<Scalar>& params) {
  check_constructed(c.d_model >= 1, "gqa", "layer");
  check_layer_input(x, batch, c.d_model, params.rope, params.position_offset, "gqa");
  check_rope_head_dim(params.rope, c.head_dim, "the layer's head_dim", "gqa");
}

/// The checks shared by both cached forms, a full or a sliding-window cache (the cache's own
/// checks come from the caller): returns n, the new tokens per sequence, which attend to the
/// cache.size() keys it holds and to their own.
template <class Scalar, class Weight, class Cache>
Index check_gqa_cached(const GqaConfig& c, const GqaWeights<Weight>& w,
                       const ConstRowRef<Scalar>& x, const PositionMask& mask,
                       const AttentionLayerParams<Scalar>& params, const Cache& cache,
                       const RowRef<Scalar>& out) {
  const Index batch = cache.batch();
  const Index p = params.position_offset;
  // Positions first: params.position_offset must be the cache's next position, which also keeps
  // the layer's own position arithmetic below far from overflow.
  check_cached_rule(mask, p, cache.next_position(), x.rows() / batch, "gqa");
  check_gqa_input(c, x, batch, params);
  check_gqa_cache(c, cache.num_kv_heads(), cache.head_dim());
  const Index n = x.rows() / batch;
  const Index held = cache.size();
  check_layer_attention<Scalar>(
      {batch, n, held + n, "B*n"}, gqa_heads(c), cached_mask<Scalar>(mask, p, p - held),
      with_layer_sinks(params.attention, w.sinks, "gqa"), out, c.d_model, "gqa");
  return n;
}

/// RMSNorm of every d_h-wide head of x [rows, H·d_h] (heads side by side), in place.
template <class Scalar, class Weight>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, RMSNorm's (eps, head_dim)
void normalize_heads(const Vector<Weight>& gamma, double eps, Index head_dim,
                     RowMatrix<Scalar>& x) {
  Eigen::Map<RowMatrix<Scalar>> heads(x.data(), x.size() / head_dim, head_dim);
  rms_norm(heads, gamma, RmsNormParams{eps}, heads);
}

/// The projections of §8.2 with every row rotated at its position `at` (QK-norm first):
///   Q = RoPE(norm(x·W_Q)), K = RoPE(norm(x·W_K)), V = x·W_V
/// (no norm without a QK-norm, no RoPE without params.rope), checked input.
///   x: [rows, d] -> q [rows, H_q·d_h], k and v [rows, H_kv·d_h]. Allocates the three results
/// and, where `before_norm` is given and the layer has a QK-norm, x·W_Q and x·W_K into it (what
/// the backward pass needs).
template <class Scalar, class Weight>
ProjectedQkv<Scalar> gqa_project(const GqaConfig& c, const GqaWeights<Weight>& w,
                                 const ConstRowRef<Scalar>& x, const RowPositions& at,
                                 const AttentionLayerParams<Scalar>& params,
                                 ProjectedQkv<Scalar>* before_norm = nullptr) {
  ProjectedQkv<Scalar> p = empty_projection<Scalar>(at.batch, gqa_heads(c));
  p.q = matmul<Scalar>(x, w.w_q);
  p.k = matmul<Scalar>(x, w.w_k);
  p.v = matmul<Scalar>(x, w.w_v);
  if (const auto& norm = w.qk_norm) {
    if (before_norm != nullptr) {
      before_norm->q = p.q;
      before_norm->k = p.k;
    }
    normalize_heads(norm->q_gamma, norm->eps, c.head_dim, p.q);
    normalize_heads(norm->k_gamma, norm->eps, c.head_dim, p.k);
  }
  if (params.rope != nullptr) {
    apply_rope_at(*params.rope, at, p.q);
    apply_rope_at(*params.rope, at, p.k);
  }
  return p;
}

/// The [rows·H, d_h] view of x [rows, H·d_h] whose rows are the heads (what the QK-norm
/// normalises).
template <class Scalar>
Eigen::Map<RowMatrix<Scalar>> head_rows(RowMatrix<Scalar>& x, Index head_dim) {
  return {x.data(), x.size() / head_dim, head_dim};
}

/// The QK-norm's backward pass on one of q, k: d (the gradient by the normalised heads) becomes
/// the gradient by the heads before the norm (x·W), and d_gamma gets the gradient by γ.
template <class Scalar, class Weight>
void normalize_heads_backward(RowMatrix<Scalar>& before, const Vector<Weight>& gamma, double eps,
                              Index head_dim, RowMatrix<Scalar>& d, Vector<Scalar>& d_gamma) {
  RowMatrix<Scalar> d_before(d.rows(), d.cols());
  d_gamma.resize(head_dim);
  rms_norm_backward(head_rows(before, head_dim), gamma, RmsNormParams{eps}, head_rows(d, head_dim),
                    head_rows(d_before, head_dim), d_gamma);
  d = std::move(d_before);
}

/// The backward pass of a GQA layer on checked input x [rows, d] at positions `at` (see
/// GroupedQueryAttention::backward): recomputes the projections and the attention, then
///   dq, dk, dv, dW_O, d sinks     attention_projection_backward
///   RoPE, QK-norm                 their backward passes on dq and dk (dγ of the norm)
///   dW_Q = xᵀ·dq, dW_K = xᵀ·dk, dW_V = xᵀ·dv,  dx = dq·W_Qᵀ + dk·W_Kᵀ + dv·W_Vᵀ.
/// g gets every gradient in the weights' layout (its sinks and QK-norm only where the layer has
/// them). Allocates the projections, their gradients and the weight gradients.
template <class Scalar, class Weight>
void gqa_backward(const GqaConfig& c, const GqaWeights<Weight>& w, const ConstRowRef<Scalar>& x,
                  const RowPositions& at, const AttentionMask<Scalar>& mask,
                  const SdpaParams& attention, const AttentionLayerParams<Scalar>& params,
                  const ConstRowRef<Scalar>& d_out, RowRef<Scalar> d_x, GqaWeights<Scalar>& g) {
  ProjectedQkv<Scalar> before_norm;
  const ProjectedQkv<Scalar> p = gqa_project(c, w, x, at, params, &before_norm);
  g.sinks.clear();
  ProjectionGradients<Scalar> d =
      attention_projection_backward(p, mask, attention, w.w_o, d_out, g.w_o, &g.sinks);
  if (params.rope != nullptr) {
    apply_rope_at<true>(*params.rope, at, d.q);
    apply_rope_at<true>(*params.rope, at, d.k);
  }
  g.qk_norm.reset();
  if (const auto& norm = w.qk_norm) {
    g.qk_norm = QkNorm<Scalar>{{}, {}, norm->eps};
    normalize_heads_backward(before_norm.q, norm->q_gamma, norm->eps, c.head_dim, d.q,
                             g.qk_norm->q_gamma);
    normalize_heads_backward(before_norm.k, norm->k_gamma, norm->eps, c.head_dim, d.k,
                             g.qk_norm->k_gamma);
  }
  projection_weight_gradient<Scalar>(x, d.q, g.w_q);
  projection_weight_gradient<Scalar>(x, d.k, g.w_k);
  projection_weight_gradient<Scalar>(x, d.v, g.w_v);
  d_x.setZero();
  add_input_gradient<Scalar>(d.q, w.w_q, d_x);
  add_input_gradient<Scalar>(d.k, w.w_k, d_x);
  add_input_gradient<Scalar>(d.v, w.w_v, d_x);
}

}  // namespace apex::detail
