// SPDX-License-Identifier: MIT
// The APEX-1 attention stack across the ranks of an MPI job (context parallelism): one sequence's
// prompt is split over the ranks by a SequenceSharding, every block's attention runs as ring
// attention, each layer's K/V stays sharded in a ShardedKvCache, and decoding steps attend over
// the shards and merge. Every rank holds the whole stack (its weights are small next to the
// context); only the sequence is divided. The logits equal those of the stack in one process:
//
//   x_0   = Embed(tokens_r)·√d                                  rank r's rows (its chunks)
//   x_l+1 = x_l + W_O · ring_attention(Q_l, K_l, V_l; mask_l)    Q, K, V projected per chunk,
//                                                                RoPE at the chunks' positions
//   logits_r = RMSNorm(x_L; γ_final) · W_Eᵀ
//
// with mask_l = stack.mask_for_layer(l, P) on the whole sequence; both calls are the stack's
// block loop (AttentionStack::run_blocks) with the attention of their mode. A decoding step
// computes the new token's projections on every rank (the same arithmetic everywhere), appends its
// K/V to the rank that owns its position, and attends with ShardedKvCache::attend; every rank gets
// the same logits.
//
// CACHES. Each layer caches K and V as its attention reads them: local layers H_kv heads of d_h
// (every position, not only the window: positions are dealt to ranks, and a rank keeps what it
// was dealt); global layers the decompressed K_final (d_h + d_r) and V (d_h) of H_kv heads, not
// the latent rows, so the naive MLA path is the one run here. ShardedStackCache::bytes() is
// this rank's share. Batch 1: one sequence. The caches store any K/V format (Storage of
// make_sharded_cache: a storage type, or q8_0, q4_0 or fp8 blocks, every head width then whole
// blocks): the prefill stores each layer's K and V first, and its ring attends to and sends
// the stored rows, so that every token is attended to with the values the cache keeps of it, in
// the prefill as when decoding (as the single-process stack does).
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/distributed/communicator.hpp>
#include <apex/distributed/ring_attention.hpp>
#include <apex/distributed/sharded_cache.hpp>
#include <apex/distributed/sharding.hpp>
#include <apex/stack.hpp>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <variant>
#include <vector>

namespace apex::distributed {

namespace detail {
struct ShardedStackCacheAccess;  // the context-parallel calls, below ShardedStackCache
}  // namespace detail

/// The decoding state of an AttentionStack run across ranks: one ShardedKvCache per layer (see
/// CACHES above), the prompt's sharding, its prefix and the next position. Made by
/// make_sharded_cache; advanced by context_parallel_prefill and context_parallel_decode_step.
/// Default-constructed or moved from: no layers, rejected by both.
template <class Scalar, class Storage = Scalar>
class ShardedStackCache {
 public:
  /// An empty cache of no layers.
  ShardedStackCache() = default;
  /// Layers L.
  Index num_layers() const { return static_cast<Index>(layers_.size()); }
  /// The cache of layer l (throws std::out_of_range unless 0 <= l < L).
  const ShardedKvCache<Scalar, Storage>& layer(Index l) const {
    return layers_.at(static_cast<std::size_t>(l));
  }
  /// The absolute position of the next token (tokens processed so far).
  Index next_position() const { return next_; }
  /// P of the sequence (set by the prefill).
  Index prefix() const { return prefix_; }
  /// Bytes of this rank's K and V, every layer.
  std::int64_t bytes() const {
    std::int64_t total = 0;
    for (const auto& c : layers_) total += c.bytes();
    return total;
  }

  /// One cache per layer (make_sharded_cache builds them).
  explicit ShardedStackCache(std::vector<ShardedKvCache<Scalar, Storage>> layers)
      : layers_(std::move(layers)) {}

 private:
  friend struct detail::ShardedStackCacheAccess;

  std::vector<ShardedKvCache<Scalar, Storage>> layers_;  // a moved-from vector is empty
  apex::detail::ResetOnMove<Index> prefix_;
  apex::detail::ResetOnMove<Index> next_;
};

namespace detail {

/// The one door into a ShardedStackCache's layers and positions: only the context-parallel
/// calls below write them.
struct ShardedStackCacheAccess {
  template <class Scalar, class Storage>
  static std::vector<ShardedKvCache<Scalar, Storage>>& layers(
      ShardedStackCache<Scalar, Storage>& cache) {
    return cache.layers_;
  }
  /// P of the prompt, set by the prefill.
  template <class Scalar, class Storage>
  static void set_prefix(ShardedStackCache<Scalar, Storage>& cache, Index prefix) {
    cache.prefix_ = prefix;
  }
  /// After a prefill or a decoding step: the next position.
  template <class Scalar, class Storage>
  static void advance(ShardedStackCache<Scalar, Storage>& cache, Index next) {
    cache.next_ = next;
  }
};

/// H_kv, d_qk and d_v of the K and V that layer `layer` attends with.
template <class Layer>
ShardedCacheShape layer_cache_shape(const Layer& layer, Index capacity, Index decode_block) {
  const apex::detail::LayerHeads heads = layer.attention_heads();
  return {1, heads.num_kv_heads, heads.qk_dim, capacity, decode_block, heads.v_dim};
}

/// Q, K and V of rows `x` of one layer (RoPE and positions from `params`).
template <class Scalar, class Weight>
ProjectedQkv<Scalar> layer_projections(const typename AttentionStack<Scalar, Weight>::Layer& layer,
                                       const RowMatrix<Scalar>& x,
                                       const AttentionLayerParams<Scalar>& params) {
  using Gqa = typename AttentionStack<Scalar, Weight>::Gqa;
  if (const auto* gqa = std::get_if<Gqa>(&layer)) return gqa->project(x, 1, params);
  return std::get<typename AttentionStack<Scalar, Weight>::Mla>(layer).decompress(x, 1, params);
}

/// The layer's attention parameters: the stack's (scale), with the layer's sinks.
template <class Scalar, class Weight>
SdpaParams layer_attention(const typename AttentionStack<Scalar, Weight>::Layer& layer,
                           const AttentionLayerParams<Scalar>& params) {
  return std::visit(
      [&](const auto& a) {
        return apex::detail::with_layer_sinks(params.attention, a.weights().sinks, "stack");
      },
      layer);
}

/// out = concat · W_O of the layer: [rows, H_q·d_v] -> [rows, d].
template <class Scalar, class Weight>
void output_projection(const typename AttentionStack<Scalar, Weight>::Layer& layer,
                       const RowMatrix<Scalar>& concat, RowMatrix<Scalar>& out) {
  std::visit([&](const auto& a) { apex::detail::matmul<Scalar>(concat, a.weights().w_o, out); },
             layer);
}

/// Copies the rows of a [1, H, n, D] view into rows [row, row + n) of a [1, H, S, D] tensor.
template <class Scalar>
void put_rows(const HeadsView<const Scalar>& from, HeadsTensor<Scalar>& to, Index row) {
  for (Index h = 0; h < from.heads(); ++h) {
    to.head(0, h).middleRows(row, from.seq()) = from.head(0, h);
  }
}

}  // namespace detail

/// The sharded caches of `stack` on every rank of comm (collective): one ShardedKvCache per layer
/// of capacity_per_rank positions storing Storage (Scalar by default; any K/V format),
/// decoded tokens dealt in blocks of decode_block. Throws on every rank as ShardedKvCache's
/// constructor does (a layer's head width that is not whole blocks of Storage's format).
/// Allocates every layer's K and V.
template <class Storage = void, class Scalar, class Weight>
auto make_sharded_cache(MPI_Comm comm, const AttentionStack<Scalar, Weight>& stack,
                        Index capacity_per_rank, Index decode_block = 64) {
  using S = std::conditional_t<std::is_void_v<Storage>, Scalar, Storage>;
  apex::detail::check_dense_stack(stack.config(), "make_sharded_cache");
  std::vector<ShardedKvCache<Scalar, S>> layers;
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    std::visit(
        [&](const auto& layer) {
          layers.emplace_back(comm,
                              detail::layer_cache_shape(layer, capacity_per_rank, decode_block));
        },
        stack.layer(l));
  }
  return ShardedStackCache<Scalar, S>(std::move(layers));
}

namespace detail {

/// This rank's checks of a context-parallel prefill (run inside the agreement, so that one
/// rank's failure throws on all): the cache, the sharding, this rank's tokens, the prefix and
/// the prompt's length, and each layer's per-rank sizes (Q [1, H_q, S_r, d_qk] and the attention
/// output [S_r, H_q·d_v]). Returns the embedded tokens [S_r, d] (embed_tokens checks every id).
template <class Scalar, class Weight, class Storage>
RowMatrix<Scalar> checked_prefill_input(const RankInfo& me,
                                        const AttentionStack<Scalar, Weight>& stack,
                                        const SequenceSharding& sharding,
                                        const std::vector<std::int64_t>& local_tokens, Index prefix,
                                        const ShardedStackCache<Scalar, Storage>& cache,
                                        const char* op) {
  apex::detail::check_dense_stack(stack.config(), op);
  APEX_CHECK(cache.num_layers() == stack.config().num_layers,
             "[" << op << "] the cache has " << cache.num_layers() << " layers; the stack "
                 << stack.config().num_layers << " (make_sharded_cache makes it)");
  APEX_CHECK(cache.next_position() == 0, "[" << op << "] the cache must be empty (it holds "
                                             << cache.next_position() << " positions)");
  APEX_CHECK(sharding.ranks() == me.size, "[" << op << "] sharding ranks (" << sharding.ranks()
                                              << ") must be the communicator's size " << me.size);
  const Index rows = sharding.local_length(me.rank);
  APEX_CHECK(static_cast<Index>(local_tokens.size()) == rows,
             "[" << op << "] local_tokens holds " << local_tokens.size()
                 << " ids; this rank's shard has " << rows);
  APEX_CHECK(
      prefix >= 0 && prefix <= sharding.length(),
      "[" << op << "] prefix (" << prefix << ") must lie in [0, S = " << sharding.length() << "]");
  APEX_CHECK(sharding.length() <= stack.config().max_positions,
             "[" << op << "] the prompt (" << sharding.length()
                 << " positions) exceeds max_positions (" << stack.config().max_positions << ")");
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    const apex::detail::LayerHeads heads =
        std::visit([](const auto& a) { return a.attention_heads(); }, stack.layer(l));
    apex::detail::checked_product({rows, heads.num_q_heads, std::max(heads.qk_dim, heads.v_dim),
                                   static_cast<std::int64_t>(sizeof(Scalar))},
                                  op, "a layer's query bytes S_r*H_q*d*sizeof(Scalar)");
  }
  const Eigen::Map<const TokenMatrix> ids(local_tokens.data(), 1, rows);
  return stack.embed_tokens(ids);
}

/// Q, K and V of this rank's rows `normed` [S_r, d] of layer l, each chunk rotated at its own
/// positions, into q [1, H_q, S_r, d_qk], k and v [1, H_kv, S_r, d]. Returns the layer's
/// attention parameters (scale, its sinks).
// NOLINTBEGIN(bugprone-easily-swappable-parameters): (q, k, v) as every attention call
template <class Scalar, class Weight>
SdpaParams project_local_rows(const AttentionStack<Scalar, Weight>& stack, Index l,
                              const RowMatrix<Scalar>& normed,
                              const std::vector<PositionRange>& chunks, HeadsTensor<Scalar>& q,
                              HeadsTensor<Scalar>& k, HeadsTensor<Scalar>& v) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const auto& layer = stack.layer(l);
  Index row = 0;
  SdpaParams attention;
  for (const PositionRange& c : chunks) {
    const Index n = c.end - c.begin;
    AttentionLayerParams<Scalar> params = stack.block_params(l);
    params.position_offset = c.begin;
    attention = layer_attention<Scalar, Weight>(layer, params);
    const RowMatrix<Scalar> part = normed.middleRows(row, n);
    const ProjectedQkv<Scalar> p = layer_projections<Scalar, Weight>(layer, part, params);
    put_rows(p.q_heads(), q, row);
    put_rows(p.k_heads(), k, row);
    put_rows(p.v_heads(), v, row);
    row += n;
  }
  return attention;
}

}  // namespace detail

/// Context-parallel prefill (collective): the prompt of one sequence, sharded by `sharding`,
/// through the stack, and its K/V into the (empty) cache.
///   local_tokens: this rank's S_r token ids, the positions of sharding.chunks(rank) in order;
///   prefix: P of the whole prompt (0 <= P <= S, the same everywhere)
///   -> logits [S_r, V] of this rank's positions: the rows forward(tokens, P) gives them.
/// Every check that can fail on one rank (the cache, the ids, the lengths, the prefix,
/// max_positions) is agreed on before any layer runs, so bad input throws on every rank and
/// changes no cache. Adds the ring's bytes to *traffic when given. Allocates the residual stream,
/// the projections and the ring's buffers of one layer at a time (ring_attention).
template <class Scalar, class Weight, class Storage>
RowMatrix<Scalar> context_parallel_prefill(MPI_Comm comm,
                                           const AttentionStack<Scalar, Weight>& stack,
                                           const SequenceSharding& sharding,
                                           const std::vector<std::int64_t>& local_tokens,
                                           Index prefix, ShardedStackCache<Scalar, Storage>& cache,
                                           Traffic* traffic = nullptr) {
  constexpr const char* op = "context_parallel_prefill";
  const RankInfo me = apex::distributed::detail::rank_info(comm, op);
  RowMatrix<Scalar> x;
  apex::distributed::detail::agree(comm, me, op,
                                   {{"sequence length", sharding.length()},
                                    {"ranks", sharding.ranks()},
                                    {"prefix", prefix},
                                    {"layers", cache.num_layers()}},
                                   [&] {
                                     x = detail::checked_prefill_input(
                                         me, stack, sharding, local_tokens, prefix, cache, op);
                                   });
  const std::vector<PositionRange> chunks = sharding.chunks(me.rank);
  const Index rows = x.rows();
  std::vector<ShardedKvCache<Scalar, Storage>>& layers =
      detail::ShardedStackCacheAccess::layers(cache);
  stack.run_blocks(x, [&](Index l, const auto& layer, const RowMatrix<Scalar>& normed,
                          RowMatrix<Scalar>& attended) {
    const apex::detail::LayerHeads heads =
        std::visit([](const auto& a) { return a.attention_heads(); }, layer);
    HeadsTensor<Scalar> q({1, heads.num_q_heads, rows, heads.qk_dim});
    HeadsTensor<Scalar> k({1, heads.num_kv_heads, rows, heads.qk_dim});
    HeadsTensor<Scalar> v({1, heads.num_kv_heads, rows, heads.v_dim});
    const SdpaParams attention = detail::project_local_rows(stack, l, normed, chunks, q, k, v);
    // K and V stored first (rounded or quantized once), so that the ring attends to and sends
    // what the cache keeps of the prompt, as decoding will read it.
    ShardedKvCache<Scalar, Storage>& kv = layers[static_cast<std::size_t>(l)];
    kv.load_prompt(sharding, k.view(), v.view());
    RowMatrix<Scalar> concat(rows, heads.num_q_heads * heads.v_dim);
    const Traffic t = ring_attention(
        comm, sharding, q.view(), kv.keys(), kv.values(), stack.mask_for_layer(l, prefix).positions,
        attention,
        HeadsView<Scalar>::token_major(concat.data(), {1, heads.num_q_heads, rows, heads.v_dim}));
    if (traffic != nullptr) *traffic += t;
    detail::output_projection<Scalar, Weight>(layer, concat, attended);
  });
  detail::ShardedStackCacheAccess::set_prefix(cache, prefix);
  detail::ShardedStackCacheAccess::advance(cache, sharding.length());
  return stack.output_logits(x);
}

/// Context-parallel decoding step (collective): the next token of the sequence (the same id on
/// every rank) at position p = cache.next_position() -> logits [1, V], the same on every rank:
/// what the stack's decode_step gives in one process. Throws on every rank alike (the checks
/// depend only on values every rank shares: the id, max_positions, the owner's room) with no
/// cache changed. Adds each layer's record bytes to *traffic when given. Allocates the token's
/// projections and each layer's records (ShardedKvCache::attend).
template <class Scalar, class Weight, class Storage>
RowMatrix<Scalar> context_parallel_decode_step(MPI_Comm comm,
                                               const AttentionStack<Scalar, Weight>& stack,
                                               std::int64_t token,
                                               ShardedStackCache<Scalar, Storage>& cache,
                                               Traffic* traffic = nullptr) {
  constexpr const char* op = "context_parallel_decode_step";
  const RankInfo me = apex::distributed::detail::rank_info(comm, op);
  const Index p = cache.next_position();
  RowMatrix<Scalar> x;
  apex::distributed::detail::agree(
      comm, me, op, {{"token", token}, {"position", p}, {"layers", cache.num_layers()}}, [&] {
        apex::detail::check_dense_stack(stack.config(), op);
        APEX_CHECK(cache.num_layers() == stack.config().num_layers && p > 0,
                   "[" << op << "] the cache must be this stack's, prefilled first");
        APEX_CHECK(p < stack.config().max_positions, "[" << op << "] position " << p
                                                         << " exceeds max_positions ("
                                                         << stack.config().max_positions << ")");
        if (cache.num_layers() > 0) {  // every layer deals positions alike
          const ShardedKvCache<Scalar, Storage>& first = cache.layer(0);
          const int owner = first.owner_of(p);
          APEX_CHECK(first.length_of(owner) < first.capacity(),
                     "[" << op << "] rank " << owner << ", which holds position " << p
                         << ", is full (capacity " << first.capacity() << ")");
        }
        const TokenMatrix ids = TokenMatrix::Constant(1, 1, token);
        x = stack.embed_tokens(ids);  // checks the id
      });
  std::vector<ShardedKvCache<Scalar, Storage>>& layers =
      detail::ShardedStackCacheAccess::layers(cache);
  stack.run_blocks(x, [&](Index l, const auto& layer, const RowMatrix<Scalar>& normed,
                          RowMatrix<Scalar>& attended) {
    AttentionLayerParams<Scalar> params = stack.block_params(l);
    params.position_offset = p;
    const ProjectedQkv<Scalar> proj =
        detail::layer_projections<Scalar, Weight>(layer, normed, params);
    ShardedKvCache<Scalar, Storage>& kv = layers[static_cast<std::size_t>(l)];
    kv.append(proj.k_heads(), proj.v_heads(), p);
    const apex::detail::LayerHeads heads =
        std::visit([](const auto& a) { return a.attention_heads(); }, layer);
    RowMatrix<Scalar> concat(1, heads.num_q_heads * heads.v_dim);
    const Traffic t = kv.attend(
        proj.q_heads(), stack.mask_for_layer(l, cache.prefix()).positions,
        detail::layer_attention<Scalar, Weight>(layer, params),
        HeadsView<Scalar>::token_major(concat.data(), {1, heads.num_q_heads, 1, heads.v_dim}));
    if (traffic != nullptr) *traffic += t;
    detail::output_projection<Scalar, Weight>(layer, concat, attended);
  });
  detail::ShardedStackCacheAccess::advance(cache, p + 1);
  return stack.output_logits(x);
}

}  // namespace apex::distributed
