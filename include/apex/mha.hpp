// SPDX-License-Identifier: MIT
// Multi-head attention (§7): every head attends on its own, the heads are concatenated and
// projected by W_O. Also the §7.3 parameter count and the conversion between the two layouts of
// per-head data. (The §7.4 cache sizes are in cache_memory.hpp.)
//
// Where the library converts between [B, S, H·d_h] and [B, H, S, d_h]:
//
//   x [B*S, d] ──x·W_Q──▶ Q [B*S, H·d_h]       row b*S+s: | head 0 (d_h) | head 1 | ... |
//                          │
//                          │ HeadsView::token_major: a strided VIEW, no copy
//                          ▼
//                 Q as [B, H, S, d_h] ──sdpa──▶ heads written straight into
//                                               concat [B*S, H·d_v] (also a token-major view)
//                                                 │ concat · W_O
//                                                 ▼
//                                               out [B*S, d]
//
// The projections and the attention never copy between the layouts: the document's
// [B, S, H·d_h] → [B, H, S, d_h] reshape is the view. split_heads / merge_heads below copy to
// and from a contiguous [B, H, S, d_h] HeadsTensor for code that wants that tensor itself.
#pragma once

#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <cstdint>
#include <type_traits>

namespace apex {

// ---------------------------------------------------------------------------------------------
// Size (§7.3)
// ---------------------------------------------------------------------------------------------

/// Parameters of a multi-head attention layer (§7.3): W_Q, W_K, W_V are [d, H_q·d_h] and W_O is
/// [H_q·d_h, d], so the total is 4·d·H_q·d_h, which is 4·d² when H_q·d_h = d. No biases.
/// Throws std::invalid_argument on a negative argument or a count beyond 64 bits.
inline std::int64_t mha_parameter_count(std::int64_t d_model, std::int64_t num_q_heads,
                                        std::int64_t head_dim) {
  return detail::checked_product({4, d_model, num_q_heads, head_dim}, "mha_parameter_count",
                                 "4*d*H_q*d_h");
}

// ---------------------------------------------------------------------------------------------
// Layout conversion
// ---------------------------------------------------------------------------------------------

namespace detail {

/// split_heads' checks of its counts against x [rows, cols]: batch and heads are >= 1 and
/// divide the rows and the columns.
inline void check_split_counts(Index batch, Index heads, Index rows, Index cols) {
  APEX_CHECK(batch >= 1 && rows % batch == 0,
             "[split_heads] batch (" << batch << ") must be >= 1 and divide the rows of x (" << rows
                                     << ")");
  APEX_CHECK(heads >= 1 && cols % heads == 0,
             "[split_heads] heads (" << heads << ") must be >= 1 and divide the columns of x ("
                                     << cols << ")");
}

}  // namespace detail

/// Copies token-major heads x [B*S, H·d_h] (a projection's output, heads side by side) into a
/// [B, H, S, d_h] view of any layout, normally a contiguous HeadsTensor:
///   out(b, h, s, :) = x[b*S + s, h*d_h : (h+1)*d_h].
/// batch and heads must divide x's rows and columns. out must not overlap x. Allocates nothing.
template <class Derived>
void split_heads(const Eigen::MatrixBase<Derived>& x, Index batch, Index heads,
                 const HeadsView<typename Derived::Scalar>& out) {
  using Scalar = typename Derived::Scalar;
  detail::require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> xr(x.derived());
  detail::check_split_counts(batch, heads, xr.rows(), xr.cols());
  const Index seq = xr.rows() / batch;
  const Index dim = xr.cols() / heads;
  APEX_CHECK(out.shape() == (HeadsShape{batch, heads, seq, dim}),
             "[split_heads] out shape [" << out.batch() << ", " << out.heads() << ", " << out.seq()
                                         << ", " << out.dim() << "] must be [B, H, S, d_h] = ["
                                         << batch << ", " << heads << ", " << seq << ", " << dim
                                         << "]");
  detail::check_output_view(out, "split_heads", "out");
  if (seq == 0 || dim == 0) return;  // nothing to copy (and x's data may be null)
  const HeadsView<const Scalar> in(xr.data(), {batch, heads, seq, dim},
                                   {seq * xr.outerStride(), dim, xr.outerStride()});
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) out.head(b, h) = in.head(b, h);
  }
}

/// Value-returning split_heads: [B*S, H·d_h] -> a new contiguous [B, H, S, d_h] HeadsTensor.
template <class Derived>
HeadsTensor<typename Derived::Scalar> split_heads(const Eigen::MatrixBase<Derived>& x, Index batch,
                                                  Index heads) {
  using Scalar = typename Derived::Scalar;
  detail::require_supported_scalar<Scalar>();
  detail::check_split_counts(batch, heads, x.rows(), x.cols());
  HeadsTensor<Scalar> result(HeadsShape{batch, heads, x.rows() / batch, x.cols() / heads});
  split_heads(x, batch, heads, result.view());
  return result;
}

/// The inverse of split_heads, and what §7.2 calls Concat(head_1, …, head_H): copies a
/// [B, H, S, d_h] view of any layout into token-major out [B*S, H·d_h]:
///   out[b*S + s, h*d_h : (h+1)*d_h] = heads(b, h, s, :).
/// out must not overlap heads. Allocates nothing.
template <class T>
void merge_heads(const HeadsView<T>& heads, RowRef<std::remove_const_t<T>> out) {
  using Scalar = std::remove_const_t<T>;
  detail::require_supported_scalar<Scalar>();
  const Index batch = heads.batch();
  const Index seq = heads.seq();
  const Index dim = heads.dim();
  detail::check_extents(heads, "merge_heads", "heads shape");
  const Index rows = detail::checked_product(batch, seq, "merge_heads", "B*S");
  const Index cols = detail::checked_product(heads.heads(), dim, "merge_heads", "H*d_h");
  APEX_CHECK(out.rows() == rows && out.cols() == cols, "[merge_heads] out shape ["
                                                           << out.rows() << ", " << out.cols()
                                                           << "] must be [B*S, H*d_h] = [" << rows
                                                           << ", " << cols << "]");
  if (out.size() == 0) return;  // nothing to copy (and the data may be null)
  // Token-major [B*S, H*d_h] as [B, H, S, d_h], honouring out's row stride.
  const HeadsView<Scalar> target(out.data(), {batch, heads.heads(), seq, dim},
                                 {seq * out.outerStride(), dim, out.outerStride()});
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads.heads(); ++h) target.head(b, h) = heads.head(b, h);
  }
}

/// Value-returning merge_heads: [B, H, S, d_h] -> a new [B*S, H·d_h] matrix.
template <class T>
RowMatrix<std::remove_const_t<T>> merge_heads(const HeadsView<T>& heads) {
  using Scalar = std::remove_const_t<T>;
  detail::heads_tensor_size<Scalar>(heads.shape(), "merge_heads");
  // An empty tensor skips the check above, but its rows and columns are still formed.
  const Index rows = detail::checked_product(heads.batch(), heads.seq(), "merge_heads", "B*S");
  const Index cols = detail::checked_product(heads.heads(), heads.dim(), "merge_heads", "H*d_h");
  RowMatrix<Scalar> result(rows, cols);
  merge_heads(heads, RowRef<Scalar>(result));
  return result;
}

/// merge_heads of a HeadsTensor.
template <class Scalar>
RowMatrix<Scalar> merge_heads(const HeadsTensor<Scalar>& heads) {
  return merge_heads(heads.view());
}

// ---------------------------------------------------------------------------------------------
// Attention + output projection (§7.2)
// ---------------------------------------------------------------------------------------------

/// Multi-head attention after the input projections (§7.2, grouped as in §8.2):
///   head_h = softmax(scale · Q_h K_gᵀ + mask) V_g,  g = h / (H_q / H_kv)   (apex::sdpa)
///   out    = Concat(head_0, …, head_{H_q−1}) · W_O
/// The heads are independent; apex::sdpa writes each one straight into its columns of the
/// [B*S_q, H_q·d_v] concatenation (a token-major view, so the concatenation is free), and one
/// GEMM applies W_O. H_kv = H_q is multi-head attention, 1 ≤ H_kv < H_q grouped-query or
/// multi-query attention: K and V are never repeated.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v] (any layout, e.g.
///      HeadsView::token_major over projection outputs, or HeadsTensor::view())
///   mask: position rule, and dense masks/biases shared ([S_q, S_k] via as_heads_view) or per
///      batch/head ([B', H', S_q, S_k] with B' ∈ {1, B}, H' ∈ {1, H_q})
///   w_o: [H_q·d_v, d] -> out: [B*S_q, d], row b*S_q + s for query s of batch b.
/// Every shape is checked before out is written. out may share storage with q, k or v (they are
/// read completely before out is written) but not with w_o. Allocates the [B*S_q, H_q·d_v]
/// concatenation. Bit-identical for any number of threads (sdpa, detail::matmul).
/// K and V may be stored in another format than the rest (a 16-bit or quantized cache's keys()
/// and values(): Eigen::half, Eigen::bfloat16, or the blocks of kv_quant.hpp), which sdpa widens
/// as it reads them, and so may W_O (a layer
/// with 16-bit weights), which the product widens as it reads it. Q's type (float or double) is
/// the type of the computation and of out.
template <class Q, class K, class V, class DerivedWo>
void multi_head_attention(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                          const AttentionMask<std::remove_const_t<Q>>& mask,
                          const SdpaParams& params, const Eigen::MatrixBase<DerivedWo>& w_o,
                          RowRef<std::remove_const_t<Q>> out) {
  using Scalar = std::remove_const_t<Q>;
  detail::require_supported_scalar<Scalar>();
  detail::require_storage_type<typename DerivedWo::Scalar>();
  const Index batch = q.batch();
  const Index heads = q.heads();
  const Index s_q = q.seq();
  const Index d_v = row_values(v);  // v.dim() for the scalar formats, blocks × values otherwise
  const char* op = "multi_head_attention";
  detail::check_sdpa(q, k, v, mask, params,
                     detail::shape_only_view<Scalar>({batch, heads, s_q, d_v}), {}, op);
  // The concatenation [B*S_q, H_q*d_v] is allocated below: its size must be representable, and
  // so must its rows and columns when it is empty.
  detail::heads_tensor_size<Scalar>({batch, heads, s_q, d_v}, op);
  const Index rows = detail::checked_product(batch, s_q, op, "B*S_q");
  const Index width = detail::checked_product(heads, d_v, op, "H_q*d_v");
  APEX_CHECK(w_o.rows() == width, "[multi_head_attention] w_o rows ("
                                      << w_o.rows() << ") must equal H_q*d_v = " << heads << "*"
                                      << d_v << " = " << width);
  APEX_CHECK(out.rows() == rows && out.cols() == w_o.cols(),
             "[multi_head_attention] out shape [" << out.rows() << ", " << out.cols()
                                                  << "] must be [B*S_q, d] = [" << rows << ", "
                                                  << w_o.cols() << "]");
  RowMatrix<Scalar> concat(rows, width);
  sdpa(q, k, v, mask, params,
       HeadsView<Scalar>::token_major(concat.data(), {batch, heads, s_q, d_v}));
  detail::matmul<Scalar>(concat, w_o, out);
}

/// Value-returning multi_head_attention: a new [B*S_q, d] matrix.
template <class Q, class K, class V, class DerivedWo>
RowMatrix<std::remove_const_t<Q>> multi_head_attention(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
    const AttentionMask<std::remove_const_t<Q>>& mask, const SdpaParams& params,
    const Eigen::MatrixBase<DerivedWo>& w_o) {
  using Scalar = std::remove_const_t<Q>;
  const Index rows = detail::checked_product(q.batch(), q.seq(), "multi_head_attention", "B*S_q");
  detail::checked_product({rows, w_o.cols(), static_cast<Index>(sizeof(Scalar))},
                          "multi_head_attention", "B*S_q*d bytes of the output");
  RowMatrix<Scalar> out(rows, w_o.cols());
  multi_head_attention(q, k, v, mask, params, w_o, out);
  return out;
}

}  // namespace apex
