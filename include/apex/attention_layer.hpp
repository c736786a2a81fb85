// SPDX-License-Identifier: MIT
// What the attention layers (GroupedQueryAttention in gqa.hpp, MultiHeadLatentAttention in
// mla.hpp) share: their call parameters, the projections they hand to attention, and the checks
// and steps of a layer's forward pass that do not depend on the kind of layer.
#pragma once

#include <apex/cascade_attention.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>
#include <apex/tree_mask.hpp>

#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

namespace apex {

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
  /// forward_paged only: attend through sdpa_cascade (cascade_attention.hpp), which reads the
  /// pages that several of the step's sequences share (forks of one prompt) once for all of
  /// them, instead of sdpa_paged; equal to it to rounding, and bit for bit where nothing is
  /// shared. AttentionStack::serve sets it.
  bool read_shared_pages_once = false;
  /// forward_paged only: the RoPE position of every row, not owned (null: a row's position is
  /// its slot, the sequence's length + s). A draft token of speculative decoding sits at the
  /// committed length plus its depth in the draft tree (tree_mask.hpp) while its slot is the
  /// committed length plus its index. None before its sequence's length (positions do not go
  /// back) and, with a table, each below its max_positions.
  const Vector<Index>* row_positions = nullptr;
  /// forward_paged only: the draft trees of the step's sequences (sequence ids[i] is batch i of
  /// the TreeMasks, its draft its rows), not owned; attention then also follows
  /// tree_rules(*draft_trees) (speculative verification, tree_mask.hpp) and reads every
  /// sequence's pages itself (sdpa_paged). Null: no tree.
  const TreeMasks* draft_trees = nullptr;
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
    return HeadsView<const Scalar>::token_major(q.data(), {batch, num_q_heads, seq(), qk_dim});
  }
  /// [B, H_kv, S, d_qk] view of k (no copy).
  HeadsView<const Scalar> k_heads() const {
    return HeadsView<const Scalar>::token_major(k.data(), {batch, num_kv_heads, seq(), qk_dim});
  }
  /// [B, H_kv, S, d_v] view of v (no copy).
  HeadsView<const Scalar> v_heads() const {
    return HeadsView<const Scalar>::token_major(v.data(), {batch, num_kv_heads, seq(), v_dim});
  }
};

namespace detail {

template <class Scalar>
void check_weight_shape(const RowMatrix<Scalar>& w, Index rows, Index cols, const char* op,
                        const char* name, const char* expected) {
  APEX_CHECK(w.rows() == rows && w.cols() == cols,
             "[" << op << "] " << name << " shape [" << w.rows() << ", " << w.cols() << "] must be "
                 << expected << " = [" << rows << ", " << cols << "]");
}

/// A [rows, cols] matrix of independent N(0, 1/rows) entries: fan-in scaling, so that x·W keeps
/// the scale of x (each output is a sum of `rows` terms).
/// Each entry is drawn in double and rounded once to the storage type Weight.
template <class Weight>
RowMatrix<Weight> random_weight(Index rows, Index cols, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(rows)));
  RowMatrix<Weight> w(rows, cols);
  for (Index i = 0; i < w.size(); ++i) w.data()[i] = round_to<Weight>(normal(rng));
  return w;
}

/// The SdpaParams a layer's attention runs with: the caller's, with the sinks the layer owns
/// (when it has any; the caller must then give none, so that no sink is counted twice).
/// Allocates the copy of the parameters.
inline SdpaParams with_layer_sinks(const SdpaParams& attention, const std::vector<double>& sinks,
                                   const char* op) {
  if (sinks.empty()) return attention;
  APEX_CHECK(attention.sinks.empty(),
             "[" << op << "] params.attention.sinks (" << attention.sinks.size()
                 << " values) must be empty: the layer owns its " << sinks.size() << " sinks");
  SdpaParams p = attention;
  p.sinks = sinks;
  return p;
}

/// The checks every layer forward makes on x, the batch and the RoPE positions.
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, called by the two layers only
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

/// How many queries and keys one attention call of a layer has: B sequences of `queries` rows,
/// each against `keys` keys (0 for a paged step, whose key counts vary by sequence and are
/// checked per sequence). `rows` names out's B·queries rows in the messages ("B*S", "B*n", "T").
struct LayerCall {
  Index batch = 1;
  Index queries = 0;
  Index keys = 0;
  const char* rows = "B*S";
};

/// The checks of a layer's attention, made before anything is computed: sdpa's checks of the
/// mask and the attention parameters on shape-only views of the shapes the projections will have
/// (queries [B, H_q, n, d_qk], keys and values [B, H_kv, keys, d_qk or d_v]), then out against
/// [B·n, d]. Allocates nothing.
template <class Scalar>
void check_layer_attention(const LayerCall& call, const LayerHeads& heads,
                           const AttentionMask<Scalar>& mask, const SdpaParams& attention,
                           const RowRef<Scalar>& out, Index d_model, const char* op) {
  const Index b = call.batch;
  check_sdpa(shape_only_view<const Scalar>({b, heads.num_q_heads, call.queries, heads.qk_dim}),
             shape_only_view<const Scalar>({b, heads.num_kv_heads, call.keys, heads.qk_dim}),
             shape_only_view<const Scalar>({b, heads.num_kv_heads, call.keys, heads.v_dim}), mask,
             attention, shape_only_view<Scalar>({b, heads.num_q_heads, call.queries, heads.v_dim}),
             {}, op);
  const Index rows = b * call.queries;
  APEX_CHECK(out.rows() == rows && out.cols() == d_model,
             "[" << op << "] out shape [" << out.rows() << ", " << out.cols() << "] must be ["
                 << call.rows << ", d] = [" << rows << ", " << d_model << "]");
}

/// The forward pass of an attention layer (§7.2), once the layer has checked x [B*S, d] (rows a
/// multiple of batch >= 1) and its parameters: checks the mask and the attention parameters
/// against the shapes the projections will have (on shape-only views, so that nothing is computed
/// before every check has passed) and out against [B*S, d]; then attends with
/// multi_head_attention and W_O on the ProjectedQkv that `project()` returns. `op` prefixes the
/// messages. Allocates what `project` allocates and the concatenation.
template <class Scalar, class Project, class Weight>
void attention_layer_forward(const ConstRowRef<Scalar>& x, Index batch, const LayerHeads& heads,
                             const AttentionMask<Scalar>& mask, const SdpaParams& attention,
                             const Project& project, const RowMatrix<Weight>& w_o,
                             RowRef<Scalar> out, const char* op) {
  const Index seq = x.rows() / batch;
  check_layer_attention<Scalar>({batch, seq, seq, "B*S"}, heads, mask, attention, out, x.cols(),
                                op);
  const ProjectedQkv<Scalar> p = project();
  multi_head_attention(p.q_heads(), p.k_heads(), p.v_heads(), mask, attention, w_o, out);
}

/// The mask of a layer's cached call: `mask` (a position mask whose offsets the cache supplies)
/// with the chunk's queries at query_offset and the held keys from key_offset (0 for a cache
/// that holds every token; the oldest held position for a sliding window).
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, PositionMask's two offsets
AttentionMask<Scalar> cached_mask(const PositionMask& mask, Index query_offset, Index key_offset) {
  AttentionMask<Scalar> m;
  m.positions = mask;
  m.positions.query_offset = query_offset;
  m.positions.key_offset = key_offset;
  return m;
}

/// The attention of a layer's step over a paged cache (GroupedQueryAttention::forward_paged,
/// MultiHeadLatentAttention::forward_paged): sdpa_paged, under the draft trees' rules where
/// params has them, else sdpa_cascade where params asks to read shared pages once.
template <class Scalar, class Q, class Cache>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, the arguments of sdpa_paged
void paged_step_attention(const HeadsView<Q>& q, const std::vector<Index>& cu, const Cache& cache,
                          const std::vector<SequenceId>& ids,
                          const std::vector<PositionMask>& masks, const SdpaParams& attention,
                          const AttentionLayerParams<Scalar>& params,
                          const HeadsView<Scalar>& out) {
  if (params.draft_trees != nullptr) {
    sdpa_paged(q, cu, cache, ids, masks, AttentionMask<Scalar>{}, attention,
               tree_rules(*params.draft_trees), out);
  } else if (params.read_shared_pages_once) {
    sdpa_cascade(q, cu, cache, ids, masks, attention, out);
  } else {
    sdpa_paged(q, cu, cache, ids, masks, attention, out);
  }
}

/// The checks every layer's step over a paged cache makes on x [T, d] before its own: the rows
/// are many sequences', so their positions come from the cache (checked per sequence by
/// paged_step_positions) and params.position_offset must be 0.
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (width, offset) of one call
void check_paged_layer_input(const ConstRowRef<Scalar>& x, Index d_model, Index position_offset,
                             const char* op) {
  check_layer_input<Scalar>(x, 1, d_model, nullptr, 0, op);
  APEX_CHECK(position_offset == 0, "[" << op << "] params.position_offset (" << position_offset
                                       << ") must be 0: the paged cache gives positions");
}

/// x as the contiguous rows a layer reads: a view, or a copy when x is not RowMajor-contiguous.
/// Returned as a prvalue, so that a copy lives in the caller's Ref (Eigen's Ref copy would not
/// carry it over).
template <class Scalar, class Derived>
ConstRowRef<Scalar> layer_rows(const Eigen::MatrixBase<Derived>& x) {
  static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                "x must have the attention layer's scalar type");
  return ConstRowRef<Scalar>(x.derived());
}

/// RoPE in place on every batch block of x [B*S, H·head_dim]: row b*S + s at offset + s; or,
/// Transposed, its backward pass (the transposed rotation, apply_rope_backward).
template <bool Transposed = false, class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, one caller per layer
void apply_rope_per_batch(const RopeTable<Scalar>& table, Index position_offset, Index batch,
                          RowMatrix<Scalar>& x) {
  const Index seq = x.rows() / batch;
  if (seq == 0) return;
  for (Index b = 0; b < batch; ++b) {
    rope_at_offset<Transposed>(table, position_offset, RowRef<Scalar>(x.middleRows(b * seq, seq)));
  }
}

/// Where the rows of a layer's input lie: B blocks of S rows, row b·S + s at position offset + s
/// (a prompt, or a chunk continuing a cache), or row t at ids(t) (the new tokens of many
/// sequences, each at its own position).
struct RowPositions {
  Index offset = 0;
  Index batch = 1;
  const Vector<Index>* ids = nullptr;  ///< one position per row; null: offset + s per block
};

/// RoPE in place on every row of x [rows, H·head_dim] at its position; or, Transposed, its
/// backward pass.
template <bool Transposed = false, class Scalar>
void apply_rope_at(const RopeTable<Scalar>& table, const RowPositions& at, RowMatrix<Scalar>& x) {
  if (at.ids != nullptr) {
    rope_at_ids<Transposed>(table, *at.ids, RowRef<Scalar>(x));
  } else {
    apply_rope_per_batch<Transposed>(table, at.offset, at.batch, x);
  }
}

}  // namespace detail

}  // namespace apex
