// SPDX-License-Identifier: MIT
// Multi-head attention (§7): every head attends on its own, the heads are concatenated and
// projected by W_O. Also the §7.3 parameter count, the §7.4 KV-cache size, and the conversion
// between the two layouts of per-head data.
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

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/mask.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>

namespace apex {

// ---------------------------------------------------------------------------------------------
// Sizes (§7.3, §7.4)
// ---------------------------------------------------------------------------------------------

/// Parameters of a multi-head attention layer (§7.3): W_Q, W_K, W_V are [d, H_q·d_h] and W_O is
/// [H_q·d_h, d], so the total is 4·d·H_q·d_h, which is 4·d² when H_q·d_h = d. No biases.
/// Throws std::invalid_argument on a negative argument or a count beyond 64 bits.
inline std::int64_t mha_parameter_count(std::int64_t d_model, std::int64_t num_q_heads,
                                        std::int64_t head_dim) {
  return detail::checked_product({4, d_model, num_q_heads, head_dim}, "mha_parameter_count",
                                 "4*d*H_q*d_h");
}

/// Values stored in the KV cache per token and per layer: K and V, num_kv_heads heads of
/// head_dim each, 2·H_kv·d_h (§7.4 with H_kv = H_q; §8.3, §9.4 for fewer heads).
/// Throws std::invalid_argument on a negative argument or a count beyond 64 bits.
inline std::int64_t kv_cache_values_per_token(std::int64_t num_kv_heads, std::int64_t head_dim) {
  return detail::checked_product({2, num_kv_heads, head_dim}, "kv_cache_values_per_token",
                                 "2*H_kv*d_h");
}

namespace detail {

/// kv_cache_bytes with the operation named in its messages (`op`), for the functions that
/// evaluate it on their own arguments.
inline std::int64_t checked_kv_cache_bytes(std::int64_t batch, std::int64_t seq,
                                           std::int64_t num_kv_heads, std::int64_t head_dim,
                                           std::int64_t bytes_per_value, const char* op) {
  return checked_product({2, batch, seq, num_kv_heads, head_dim, bytes_per_value}, op,
                         "2*B*S*H_kv*d_h*bytes");
}

}  // namespace detail

/// Bytes of the KV cache of one layer (§7.4): 2·B·S·H_kv·d_h·bytes_per_value, K and V.
/// Note: §7.4 prints "4 GB per layer" for 128K tokens, 128 heads of 128, FP16; that is K
/// alone. K and V take 2 × 131072 × 128 × 128 × 2 bytes = 8 GiB (SEED-NOTES.md).
/// Throws std::invalid_argument on a negative argument or a size beyond 64 bits.
inline std::int64_t kv_cache_bytes(std::int64_t batch, std::int64_t seq, std::int64_t num_kv_heads,
                                   std::int64_t head_dim, std::int64_t bytes_per_value) {
  return detail::checked_kv_cache_bytes(batch, seq, num_kv_heads, head_dim, bytes_per_value,
                                        "kv_cache_bytes");
}

// ---------------------------------------------------------------------------------------------
// Layout conversion
// ---------------------------------------------------------------------------------------------

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
  APEX_CHECK(batch >= 1 && xr.rows() % batch == 0,
             "[split_heads] batch (" << batch << ") must be >= 1 and divide the rows of x ("
                                     << xr.rows() << ")");
  APEX_CHECK(heads >= 1 && xr.cols() % heads == 0,
             "[split_heads] heads (" << heads << ") must be >= 1 and divide the columns of x ("
                                     << xr.cols() << ")");
  const Index seq = xr.rows() / batch;
  const Index dim = xr.cols() / heads;
  APEX_CHECK(out.batch() == batch && out.heads() == heads && out.seq() == seq && out.dim() == dim,
             "[split_heads] out shape [" << out.batch() << ", " << out.heads() << ", " << out.seq()
                                         << ", " << out.dim() << "] must be [B, H, S, d_h] = ["
                                         << batch << ", " << heads << ", " << seq << ", " << dim
                                         << "]");
  if (seq == 0 || dim == 0) return;  // nothing to copy (and x's data may be null)
  const auto in = HeadsView<const Scalar>(xr.data(), batch, heads, seq, dim, seq * xr.outerStride(),
                                          dim, xr.outerStride());
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
  APEX_CHECK(batch >= 1 && x.rows() % batch == 0,
             "[split_heads] batch (" << batch << ") must be >= 1 and divide the rows of x ("
                                     << x.rows() << ")");
  APEX_CHECK(heads >= 1 && x.cols() % heads == 0,
             "[split_heads] heads (" << heads << ") must be >= 1 and divide the columns of x ("
                                     << x.cols() << ")");
  HeadsTensor<Scalar> result(batch, heads, x.rows() / batch, x.cols() / heads);
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
  const auto target = HeadsView<Scalar>(out.data(), batch, heads.heads(), seq, dim,
                                        seq * out.outerStride(), dim, out.outerStride());
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads.heads(); ++h) target.head(b, h) = heads.head(b, h);
  }
}

/// Value-returning merge_heads: [B, H, S, d_h] -> a new [B*S, H·d_h] matrix.
template <class T>
RowMatrix<std::remove_const_t<T>> merge_heads(const HeadsView<T>& heads) {
  detail::heads_tensor_size<std::remove_const_t<T>>(heads.batch(), heads.heads(), heads.seq(),
                                                    heads.dim(), "merge_heads");
  RowMatrix<std::remove_const_t<T>> result(heads.batch() * heads.seq(),
                                           heads.heads() * heads.dim());
  merge_heads(heads, RowRef<std::remove_const_t<T>>(result));
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

namespace detail {

/// out = x · w for the projections of attention layers. With a few rows (a decoding step) the
/// product is a matrix-vector product bound by reading w, which Eigen runs on one thread; it is
/// then cut into fixed blocks of 512 columns spread over the threads (detail::parallel_for), so
/// that w is read at the machine's bandwidth. The blocks do not depend on the number of threads,
/// so neither does the result. More rows, or a small w: one Eigen product (which Eigen threads
/// itself when it is large). w may be any Eigen expression with columns (a matrix, a transpose).
/// out must have x.rows() rows and w.cols() columns and must not overlap x or w.
template <class Scalar, class Weight>
void project_rows(const ConstRowRef<Scalar>& x, const Weight& w, RowRef<Scalar> out) {
  constexpr Index kFewRows = 8;
  constexpr Index kBlock = 512;
  constexpr Index kMinWeights = Index{1} << 18;  // below 1 MiB of float a thread team costs more
  const Index cols = w.cols();
  if (x.rows() > kFewRows || w.rows() * cols < kMinWeights) {
    out.noalias() = x * w;
    return;
  }
  parallel_for((cols + kBlock - 1) / kBlock, [&](Index j) {
    const Index first = j * kBlock;
    const Index n = std::min(kBlock, cols - first);
    out.middleCols(first, n).noalias() = x * w.middleCols(first, n);
  });
}

/// project_rows into a new [x.rows(), w.cols()] matrix.
template <class Scalar, class Weight>
RowMatrix<Scalar> project_rows(const ConstRowRef<Scalar>& x, const Weight& w) {
  RowMatrix<Scalar> out(x.rows(), w.cols());
  project_rows<Scalar>(x, w, out);
  return out;
}

/// A view with the given shape and no data: for running shape checks before anything exists.
template <class T>
HeadsView<T> shape_only_view(Index batch, Index heads, Index seq, Index dim) {
  return HeadsView<T>(nullptr, batch, heads, seq, dim, 0, 0, 0);
}

}  // namespace detail

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
/// concatenation.
template <class DerivedWo>
void multi_head_attention(const ConstHeadsView<typename DerivedWo::Scalar>& q,
                          const ConstHeadsView<typename DerivedWo::Scalar>& k,
                          const ConstHeadsView<typename DerivedWo::Scalar>& v,
                          const AttentionMask<typename DerivedWo::Scalar>& mask,
                          const SdpaParams& params, const Eigen::MatrixBase<DerivedWo>& w_o,
                          RowRef<typename DerivedWo::Scalar> out) {
  using Scalar = typename DerivedWo::Scalar;
  detail::require_supported_scalar<Scalar>();
  const Index batch = q.batch();
  const Index heads = q.heads();
  const Index s_q = q.seq();
  const Index d_v = v.dim();
  detail::check_sdpa<Scalar>(q, k, v, mask, params,
                             detail::shape_only_view<Scalar>(batch, heads, s_q, d_v), {},
                             "multi_head_attention");
  // The concatenation [B*S_q, H_q*d_v] is allocated below: its size must be representable.
  detail::heads_tensor_size<Scalar>(batch, heads, s_q, d_v, "multi_head_attention");
  APEX_CHECK(w_o.rows() == heads * d_v, "[multi_head_attention] w_o rows ("
                                            << w_o.rows() << ") must equal H_q*d_v = " << heads
                                            << "*" << d_v << " = " << heads * d_v);
  APEX_CHECK(out.rows() == batch * s_q && out.cols() == w_o.cols(),
             "[multi_head_attention] out shape [" << out.rows() << ", " << out.cols()
                                                  << "] must be [B*S_q, d] = [" << batch * s_q
                                                  << ", " << w_o.cols() << "]");
  const ConstRowRef<Scalar> wo(w_o.derived());
  RowMatrix<Scalar> concat(batch * s_q, heads * d_v);
  sdpa<Scalar>(q, k, v, mask, params,
               HeadsView<Scalar>::token_major(concat.data(), batch, s_q, heads, d_v));
  detail::project_rows<Scalar>(concat, wo, out);
}

/// Value-returning multi_head_attention: a new [B*S_q, d] matrix.
template <class DerivedWo>
RowMatrix<typename DerivedWo::Scalar> multi_head_attention(
    const ConstHeadsView<typename DerivedWo::Scalar>& q,
    const ConstHeadsView<typename DerivedWo::Scalar>& k,
    const ConstHeadsView<typename DerivedWo::Scalar>& v,
    const AttentionMask<typename DerivedWo::Scalar>& mask, const SdpaParams& params,
    const Eigen::MatrixBase<DerivedWo>& w_o) {
  using Scalar = typename DerivedWo::Scalar;
  const Index rows = detail::checked_product(q.batch(), q.seq(), "multi_head_attention", "B*S_q");
  detail::checked_product({rows, w_o.cols(), static_cast<Index>(sizeof(Scalar))},
                          "multi_head_attention", "B*S_q*d bytes of the output");
  RowMatrix<Scalar> out(rows, w_o.cols());
  multi_head_attention(q, k, v, mask, params, w_o, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// What the attention layers (GroupedQueryAttention in gqa.hpp, MultiHeadLatentAttention in
// mla.hpp) share.
// ---------------------------------------------------------------------------------------------

/// Parameters of an attention layer's forward pass.
template <class Scalar>
struct AttentionLayerParams {
  /// Softmax scale (unset: 1/√d_qk, d_qk being the width of one query/key head) and soft-cap.
  SdpaParams attention;
  /// RoPE table (§4), not owned; it must outlive the call. GroupedQueryAttention rotates Q and
  /// K with it when set (table head_dim = the layer's head_dim); MultiHeadLatentAttention needs
  /// it for its decoupled RoPE (table head_dim = rope_dim d_r, §9.3).
  const RopeTable<Scalar>* rope = nullptr;
  /// Absolute position of the first row of every batch block for RoPE: row b*S + s is rotated
  /// at position position_offset + s (0 for a prompt; p for a block continuing at position p).
  /// Attention itself is over the block's own keys, and the mask's positions are set in
  /// AttentionMask::positions, independently of this.
  Index position_offset = 0;
};

/// Queries, keys and values after a layer's projections, heads side by side in each row
/// (token-major), with the views attention reads them through.
///   q: [B*S, H_q·d_qk], k: [B*S, H_kv·d_qk], v: [B*S, H_kv·d_v]
template <class Scalar>
struct ProjectedQkv {
  RowMatrix<Scalar> q;     ///< [B*S, H_q·d_qk] queries, RoPE applied when the layer uses it
  RowMatrix<Scalar> k;     ///< [B*S, H_kv·d_qk] keys, RoPE applied when the layer uses it
  RowMatrix<Scalar> v;     ///< [B*S, H_kv·d_v] values
  Index batch = 1;         ///< B: the rows are B blocks of S tokens
  Index num_q_heads = 1;   ///< H_q, query heads in q
  Index num_kv_heads = 1;  ///< H_kv, key/value heads in k and v
  Index qk_dim = 0;        ///< d_qk, width of one query/key head
  Index v_dim = 0;         ///< d_v, width of one value head

  /// Tokens per sequence S = rows of q / B (0 when batch is 0).
  Index seq() const { return batch == 0 ? 0 : q.rows() / batch; }
  /// [B, H_q, S, d_qk] view of q (no copy).
  HeadsView<const Scalar> q_heads() const {
    return HeadsView<const Scalar>::token_major(q.data(), batch, seq(), num_q_heads, qk_dim);
  }
  /// [B, H_kv, S, d_qk] view of k (no copy).
  HeadsView<const Scalar> k_heads() const {
    return HeadsView<const Scalar>::token_major(k.data(), batch, seq(), num_kv_heads, qk_dim);
  }
  /// [B, H_kv, S, d_v] view of v (no copy).
  HeadsView<const Scalar> v_heads() const {
    return HeadsView<const Scalar>::token_major(v.data(), batch, seq(), num_kv_heads, v_dim);
  }
};

namespace detail {

inline void check_head_counts(Index num_q_heads, Index num_kv_heads, const char* op) {
  APEX_CHECK(num_q_heads >= 1, "[" << op << "] num_q_heads (" << num_q_heads << ") must be >= 1");
  APEX_CHECK(num_kv_heads >= 1,
             "[" << op << "] num_kv_heads (" << num_kv_heads << ") must be >= 1");
  APEX_CHECK(num_q_heads % num_kv_heads == 0, "[" << op << "] num_q_heads (" << num_q_heads
                                                  << ") must be a multiple of num_kv_heads ("
                                                  << num_kv_heads << ")");
}

template <class Scalar>
void check_weight_shape(const RowMatrix<Scalar>& w, Index rows, Index cols, const char* op,
                        const char* name, const char* expected) {
  APEX_CHECK(w.rows() == rows && w.cols() == cols,
             "[" << op << "] " << name << " shape [" << w.rows() << ", " << w.cols() << "] must be "
                 << expected << " = [" << rows << ", " << cols << "]");
}

/// A [rows, cols] matrix of independent N(0, 1/rows) entries: fan-in scaling, so that x·W keeps
/// the scale of x (each output is a sum of `rows` terms).
template <class Scalar>
RowMatrix<Scalar> random_weight(Index rows, Index cols, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(rows)));
  RowMatrix<Scalar> w(rows, cols);
  for (Index i = 0; i < w.size(); ++i) w.data()[i] = static_cast<Scalar>(normal(rng));
  return w;
}

/// The checks every layer forward makes on x, the batch and the RoPE positions.
template <class Scalar>
void check_layer_input(const ConstRowRef<Scalar>& x, Index batch, Index d_model,
                       const RopeTable<Scalar>* rope, Index position_offset, const char* op) {
  APEX_CHECK(x.cols() == d_model,
             "[" << op << "] x width (" << x.cols() << ") must equal d_model (" << d_model << ")");
  APEX_CHECK(batch >= 1, "[" << op << "] batch (" << batch << ") must be >= 1");
  APEX_CHECK(x.rows() % batch == 0, "[" << op << "] x rows (" << x.rows()
                                        << ") must be a multiple of batch (" << batch
                                        << "): B blocks of S rows");
  if (rope == nullptr) return;
  const Index seq = x.rows() / batch;
  APEX_CHECK(position_offset >= 0,
             "[" << op << "] position_offset (" << position_offset << ") must be >= 0");
  // position_offset + S would overflow for an offset near the top of the range: compare the
  // offset with max_positions - S instead (both >= 0, so the difference cannot overflow).
  const Index table = rope->max_positions();
  APEX_CHECK(seq == 0 || (seq <= table && position_offset <= table - seq),
             "[" << op << "] positions [position_offset, position_offset + S) = ["
                 << position_offset << ", " << position_offset << " + " << seq
                 << ") must be below the RoPE table's max_positions (" << table << ")");
}

/// A layer's RoPE table, when it has one, must be as wide as the features the layer rotates
/// (`what` names them in the message).
template <class Scalar>
void check_rope_head_dim(const RopeTable<Scalar>* rope, Index expected, const char* what,
                         const char* op) {
  APEX_CHECK(rope == nullptr || rope->head_dim() == expected,
             "[" << op << "] RoPE table head_dim (" << (rope ? rope->head_dim() : 0)
                 << ") must equal " << what << " (" << expected << ")");
}

/// The heads of the attention a layer runs on its projections: H_q query heads and H_kv
/// key/value heads, queries and keys d_qk wide, values d_v wide.
struct LayerHeads {
  Index num_q_heads = 1;
  Index num_kv_heads = 1;
  Index qk_dim = 0;
  Index v_dim = 0;
};

/// A ProjectedQkv with its batch and heads set and q, k, v still empty, for a projection to fill.
template <class Scalar>
ProjectedQkv<Scalar> empty_projection(Index batch, const LayerHeads& heads) {
  ProjectedQkv<Scalar> p;
  p.batch = batch;
  p.num_q_heads = heads.num_q_heads;
  p.num_kv_heads = heads.num_kv_heads;
  p.qk_dim = heads.qk_dim;
  p.v_dim = heads.v_dim;
  return p;
}

/// The forward pass of an attention layer (§7.2), once the layer has checked x [B*S, d] (rows a
/// multiple of batch >= 1) and its parameters: checks the mask and the attention parameters
/// against the shapes the projections will have (on shape-only views, so that nothing is computed
/// before every check has passed) and out against [B*S, d]; then attends with
/// multi_head_attention and W_O on the ProjectedQkv that `project()` returns. `op` prefixes the
/// messages. Allocates what `project` allocates and the concatenation.
template <class Scalar, class Project>
void attention_layer_forward(const ConstRowRef<Scalar>& x, Index batch, const LayerHeads& heads,
                             const AttentionMask<Scalar>& mask, const SdpaParams& attention,
                             const Project& project, const RowMatrix<Scalar>& w_o,
                             RowRef<Scalar> out, const char* op) {
  const Index seq = x.rows() / batch;
  const Index h_q = heads.num_q_heads;
  const Index h_kv = heads.num_kv_heads;
  check_sdpa<Scalar>(shape_only_view<const Scalar>(batch, h_q, seq, heads.qk_dim),
                     shape_only_view<const Scalar>(batch, h_kv, seq, heads.qk_dim),
                     shape_only_view<const Scalar>(batch, h_kv, seq, heads.v_dim), mask, attention,
                     shape_only_view<Scalar>(batch, h_q, seq, heads.v_dim), {}, op);
  APEX_CHECK(out.rows() == x.rows() && out.cols() == x.cols(),
             "[" << op << "] out shape [" << out.rows() << ", " << out.cols()
                 << "] must be [B*S, d] = [" << x.rows() << ", " << x.cols() << "]");
  const ProjectedQkv<Scalar> p = project();
  multi_head_attention(p.q_heads(), p.k_heads(), p.v_heads(), mask, attention, w_o, out);
}

/// RoPE in place on every batch block of x [B*S, H·head_dim]: row b*S + s at offset + s.
template <class Scalar>
void apply_rope_per_batch(const RopeTable<Scalar>& table, Index position_offset, Index batch,
                          RowMatrix<Scalar>& x) {
  const Index seq = x.rows() / batch;
  if (seq == 0) return;
  for (Index b = 0; b < batch; ++b) {
    apply_rope(table, position_offset, RowRef<Scalar>(x.middleRows(b * seq, seq)));
  }
}

}  // namespace detail

}  // namespace apex
