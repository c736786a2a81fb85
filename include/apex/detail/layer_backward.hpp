// SPDX-License-Identifier: MIT
// What the attention layers' backward passes share (GroupedQueryAttention::backward,
// MultiHeadLatentAttention::backward): the attention and W_O of a layer differentiated from its
// projections, the weight gradients of a projection, and the sum of a layer's input gradients
// (RoPE's backward on every row at its position is apply_rope_at<true>, attention_layer.hpp).
//
// RECOMPUTATION. A layer's backward takes the layer's input x and recomputes its projections
// and its attention (with the lse) from it, so that nothing but x needs to be kept between the
// forward and the backward pass: a layer costs one forward more, and holds its projections, the
// concatenation and their gradients ([B*S, H·d] each) while it runs.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/config.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/sdpa_backward.hpp>
#include <apex/tensor.hpp>

#include <vector>

namespace apex::detail {

/// The checks of a layer's backward pass beside its forward's: d_out has x's shape, and d_x
/// (checked against out's shape by check_layer_attention) overlaps neither x nor d_out.
template <class Scalar>
void check_layer_backward(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& d_out,
                          const RowRef<Scalar>& d_x, const char* op) {
  APEX_CHECK(d_out.rows() == x.rows() && d_out.cols() == x.cols(),
             "[" << op << "] d_out shape [" << d_out.rows() << ", " << d_out.cols()
                 << "] must be x's [" << x.rows() << ", " << x.cols() << "]");
  const ByteRange written = matrix_byte_range(d_x);
  APEX_CHECK(!written.overlaps(matrix_byte_range(x)) && !written.overlaps(matrix_byte_range(d_out)),
             "[" << op << "] d_x must not overlap x or d_out");
}

/// The gradients of a layer's projections: by q, k and v, token-major as the projections.
template <class Scalar>
struct ProjectionGradients {
  RowMatrix<Scalar> q, k, v;
};

/// The backward pass of a layer's attention and output projection, from its projections p (as
/// its forward formed them) and d_out = ∂L/∂out [B*S, d]:
///   concat, lse = sdpa(q, k, v)            (recomputed)
///   d_concat = d_out · W_Oᵀ,   dW_O = concatᵀ · d_out
///   dq, dk, dv = sdpa_backward(q, k, v, concat, lse, d_concat)   (and d sinks)
/// d_w_o gets W_O's shape; d_sinks, when not null, the gradient by the attention's sinks.
/// Allocates the concatenation, the lse, d_concat and the three gradients.
template <class Scalar, class Weight>
ProjectionGradients<Scalar> attention_projection_backward(
    const ProjectedQkv<Scalar>& p, const AttentionMask<Scalar>& mask, const SdpaParams& attention,
    const RowMatrix<Weight>& w_o, const ConstRowRef<Scalar>& d_out, RowMatrix<Scalar>& d_w_o,
    std::vector<double>* d_sinks) {
  const Index rows = p.q.rows();
  const HeadsShape out_shape{p.batch, p.num_q_heads, p.seq(), p.v_dim};
  RowMatrix<Scalar> concat(rows, p.num_q_heads * p.v_dim);
  RowMatrix<Scalar> lse(rows, p.num_q_heads);
  const auto out_view = HeadsView<Scalar>::token_major(concat.data(), out_shape);
  const auto lse_view =
      HeadsView<Scalar>::token_major(lse.data(), {p.batch, p.num_q_heads, p.seq(), 1});
  sdpa(p.q_heads(), p.k_heads(), p.v_heads(), mask, attention, out_view, lse_view);
  RowMatrix<Scalar> d_concat(rows, concat.cols());
  matmul_transposed<Scalar>(d_out, w_o, d_concat);
  d_w_o.resize(concat.cols(), d_out.cols());
  matmul_lhs_transposed<Scalar>(concat, d_out, d_w_o);
  ProjectionGradients<Scalar> g{RowMatrix<Scalar>(rows, p.q.cols()),
                                RowMatrix<Scalar>(rows, p.k.cols()),
                                RowMatrix<Scalar>(rows, p.v.cols())};
  const auto heads_of = [&](RowMatrix<Scalar>& m, Index heads, Index dim) {
    return HeadsView<Scalar>::token_major(m.data(), {p.batch, heads, p.seq(), dim});
  };
  sdpa_backward(p.q_heads(), p.k_heads(), p.v_heads(), mask, attention,
                HeadsView<const Scalar>(out_view), HeadsView<const Scalar>(lse_view),
                HeadsView<const Scalar>::token_major(d_concat.data(), out_shape),
                SdpaGradients<Scalar>{heads_of(g.q, p.num_q_heads, p.qk_dim),
                                      heads_of(g.k, p.num_kv_heads, p.qk_dim),
                                      heads_of(g.v, p.num_kv_heads, p.v_dim),
                                      {},
                                      attention.sinks.empty() ? nullptr : d_sinks});
  return g;
}

/// The gradient of a projection y = x·W by its weight, dW = xᵀ·dy, into `d_w` (resized to
/// [x.cols(), dy.cols()]). Fixed tiles: bit-identical for any number of threads.
template <class Scalar>
void projection_weight_gradient(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& dy,
                                RowMatrix<Scalar>& d_w) {
  d_w.resize(x.cols(), dy.cols());
  matmul_lhs_transposed<Scalar>(x, dy, d_w);
}

/// dx += dy·Wᵀ, the gradient by x of y = x·W added to dx (W in Scalar or a 16-bit type).
template <class Scalar, class Weight>
void add_input_gradient(const ConstRowRef<Scalar>& dy, const RowMatrix<Weight>& w,
                        RowRef<Scalar> dx) {
  RowMatrix<Scalar> part(dx.rows(), dx.cols());
  matmul_transposed<Scalar>(dy, w, part);
  dx += part;
}

}  // namespace apex::detail
