// SPDX-License-Identifier: MIT
// The APEX-1 attention stack: §2 embedding, L pre-norm attention blocks whose kind follows the
// §11.2 layer rule (global layers: multi-head latent attention, §9; local layers: grouped-query
// attention with a sliding window, §8 and §10), the final RMSNorm (§3) and the tied LM head
// (§2.5). Token ids in, logits out:
//
//   x_0     = Embed(tokens) · √d
//   x_{l+1} = x_l + Attention_l(RMSNorm(x_l; γ_l); mask_l)      l = 0 … L−1
//   logits  = RMSNorm(x_L; γ_final) · W_Eᵀ
//
// with mask_l = layer_mask(l, {P, W, F_g}): the prefix [0, P) bidirectional on every layer,
// then causal (global layers) or causal within W (local layers), §11.1. Part 3's feed-forward
// and MoE blocks do not exist in the documents, so the stack holds attention blocks only.
//
// Inference. forward() recomputes a whole sequence (and is the oracle). A StackCache
// (stack_cache.hpp) holds one cache per layer, the kind the documents motivate each layer with:
//   local layers   SlidingWindowCache of the last W tokens  2·H_kv·d_h values per token, ≤ W tokens
//   global layers  LatentCache (c_kv ‖ K_rope)               d_kv + H_kr·d_r values per token
// prefill() runs a prompt (with its bidirectional prefix) through the stack in one call and
// fills the caches; extend() continues with a chunk (chunked prefill, or several tokens at
// once) and decode_step() with one token per sequence. Each returns the logits of its tokens,
// equal to the rows forward() computes for the whole sequence.
//
// Serving many sequences at once over paged caches (continuous batching) is serve() with a
// ServingCache, in stack_serving.hpp. Every form — forward, the cached calls, serve and the
// context-parallel calls of apex/distributed/stack.hpp — is one block loop,
// AttentionStack::run_blocks, given the attention of its mode for each layer.
//
// Long context. With StackConfig::yarn set, the RoPE tables are YaRN tables (§5) and the
// attention temperature goes where YarnParams::temperature says (tables, or the softmax scale),
// so the stack runs past the trained context L up to s·L positions; StackConfig::rope_scaling
// takes any other scaling (linear, dynamic NTK, Llama 3, LongRoPE: rope_scaling.hpp) instead.
// StackConfig::global_rope gives the global layers a RoPE (and scaling) of their own, as
// checkpoints with a larger base for their global layers need.
//
// Rooms: the config, the options of the cached calls and the cache memory plan are in
// stack_config.hpp, the StackCache in stack_cache.hpp, the checks and build steps that hold no
// state in detail/stack_steps.hpp; this header includes them all.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/detail/stack_steps.hpp>
#include <apex/embedding.hpp>
#include <apex/gqa.hpp>
#include <apex/indexer.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mla.hpp>
#include <apex/rms_norm.hpp>
#include <apex/serving_cache.hpp>
#include <apex/sparse_mla.hpp>
#include <apex/stack_cache.hpp>
#include <apex/stack_config.hpp>
#include <apex/stack_serving.hpp>
#include <apex/stack_speculative.hpp>
#include <apex/storage.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

template <class Scalar, class Weight = Scalar>
class AttentionStack;

namespace detail {

// -------------------------------------------------------------------------------------------
// The cached calls (AttentionStack::prefill / extend / decode_step): the stack's block loop
// (AttentionStack::run_blocks) with each layer's attention on its cache in a StackCache
// -------------------------------------------------------------------------------------------

/// AttentionStack::make_cache: a SlidingWindowCache of W tokens per local layer and a
/// LatentCache of `capacity` tokens per global layer, storing Storage and Global.
template <class Storage, class Global, class Scalar, class Weight>
StackCache<Scalar, Storage, Global> make_stack_cache(const AttentionStack<Scalar, Weight>& stack,
                                                     Index batch, Index capacity) {
  using Stack = AttentionStack<Scalar, Weight>;
  const auto& config = stack.config();
  check_stack_constructed(config);
  APEX_CHECK(batch >= 1, "[stack] batch (" << batch << ") must be >= 1");
  APEX_CHECK(capacity >= 1 && capacity <= config.max_positions,
             "[stack] capacity (" << capacity << ") must lie in [1, max_positions = "
                                  << config.max_positions << "]");
  // The widths against the formats, and the sizes, checked before any layer allocates.
  (void)stack_cache_memory<Storage, Global>(config, batch, capacity);
  using Cache = StackCache<Scalar, Storage, Global>;
  std::vector<typename Cache::LayerCache> caches;
  std::vector<typename Cache::KeyCache> keys(static_cast<std::size_t>(config.num_layers));
  caches.reserve(static_cast<std::size_t>(config.num_layers));
  for (Index l = 0; l < config.num_layers; ++l) {
    if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
      caches.emplace_back(mla->template make_cache<Global>(batch, capacity));
      if (stack.sparse()) {
        keys[static_cast<std::size_t>(l)] =
            stack.indexer(l).template make_cache<indexer_key_format_t<Global>>(batch, capacity);
      }
    } else {
      caches.emplace_back(std::get<typename Stack::Gqa>(stack.layer(l))
                              .template make_window_cache<Storage>(batch, config.window));
    }
  }
  return StackCacheAccess::make<Scalar, Storage, Global>(batch, capacity, std::move(caches),
                                                         std::move(keys));
}

/// One layer of the cached calls: attended [B*n, d] = Attention_l(normed [B*n, d]) under layer
/// l's mask for the prefix, at positions from cache.next_position(), appending the rows' K/V (or
/// latents) to the layer's cache. The global layers take the MLA path options.mla names (kAuto:
/// the cheaper one for n); sparse ones always the absorbed path over their selected keys
/// (detail::sparse_mla_step), appending their indexer keys too.
template <class Scalar, class Weight, class Storage, class Global>
void cached_layer(const AttentionStack<Scalar, Weight>& stack, Index l,
                  const RowMatrix<Scalar>& normed, Index prefix, const DecodeOptions& options,
                  StackCache<Scalar, Storage, Global>& cache, RowMatrix<Scalar>& attended) {
  using Stack = AttentionStack<Scalar, Weight>;
  const auto& config = stack.config();
  const PositionMask mask =
      layer_mask(l, LayerMaskParams{prefix, config.window, config.global_every});
  AttentionLayerParams<Scalar> params = stack.block_params(l);
  params.position_offset = cache.next_position();
  auto& layer_cache = StackCacheAccess::layer(cache, l);
  if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
    auto& latent = std::get<LatentCache<Scalar, Global>>(layer_cache);
    if (stack.sparse()) {
      sparse_mla_step(stack.sparse_parts(l), ConstRowRef<Scalar>(normed), prefix, params, latent,
                      StackCacheAccess::indexer_keys(cache, l), RowRef<Scalar>(attended));
      return;
    }
    const Index n = normed.rows() / cache.batch();
    const MlaPath path =
        options.mla == MlaPath::kAuto ? mla_cheaper_path(config.global, n) : options.mla;
    if (path == MlaPath::kAbsorbed) {
      mla->forward_absorbed(normed, mask, params, stack.absorbed_weights(l), latent, attended);
    } else {
      mla->forward_cached(normed, mask, params, latent, attended);
    }
    return;
  }
  std::get<typename Stack::Gqa>(stack.layer(l))
      .forward_cached(normed, mask, params,
                      std::get<SlidingWindowCache<Scalar, Storage>>(layer_cache), attended);
}

/// prefill / extend / decode_step: n = tokens.cols() new tokens per sequence at positions
/// [p, p + n), the stack's block loop with each layer on its cache (cached_layer). Every check
/// (the ids included, through embed) runs before the first cache is written, so that an error
/// leaves every layer's cache as it was.
template <class TokensDerived, class Scalar, class Weight, class Storage, class Global>
RowMatrix<Scalar> run_cached(const AttentionStack<Scalar, Weight>& stack,
                             const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                             const DecodeOptions& options,
                             StackCache<Scalar, Storage, Global>& cache) {
  const auto& config = stack.config();
  check_stack_constructed(config);
  // Layers l with l mod F_g = F_g − 1 exist iff L >= F_g (the stack holds them by that rule).
  check_cached_call(config, config.num_layers / config.global_every > 0, tokens, prefix, cache);
  const Index batch = tokens.rows();
  const Index n = tokens.cols();
  const Index first = cache.next_position();
  RowMatrix<Scalar> x = stack.embed_tokens(tokens);  // checks every id
  stack.run_blocks(
      x, [&](Index l, const auto&, const RowMatrix<Scalar>& normed, RowMatrix<Scalar>& attended) {
        cached_layer(stack, l, normed, prefix, options, cache, attended);
      });
  StackCacheAccess::advance(cache, first, n, prefix);
  if (options.logits == LogitRows::kLast) {
    std::vector<Index> ends;
    for (Index b = 1; b <= batch; ++b) ends.push_back(b * n);
    return stack.last_logits(x, ends);
  }
  return stack.output_logits(x);
}

/// Sparse global layer l of `stack` over whole sequences (AttentionStack::forward): normed
/// [B*S, d] -> attended [B*S, d], one sparse_mla_step from position 0 on caches of [B, S] tokens
/// in Scalar, which it allocates.
template <class Scalar, class Weight>
void sparse_forward(const AttentionStack<Scalar, Weight>& stack, Index l,
                    // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): forward's (B, P)
                    const RowMatrix<Scalar>& normed, Index batch, Index prefix,
                    RowMatrix<Scalar>& attended) {
  const auto& mla = std::get<typename AttentionStack<Scalar, Weight>::Mla>(stack.layer(l));
  const Index seq = normed.rows() / batch;
  LatentCache<Scalar, Scalar> latent = mla.template make_cache<Scalar>(batch, seq);
  IndexerKeyCache<Scalar, Scalar> keys = stack.indexer(l).template make_cache<Scalar>(batch, seq);
  sparse_mla_step(stack.sparse_parts(l), ConstRowRef<Scalar>(normed), prefix, stack.block_params(l),
                  latent, keys, RowRef<Scalar>(attended));
}

// -------------------------------------------------------------------------------------------
// Building and converting a stack, and its weight bytes: from its constructor's arguments or its
// public accessors
// -------------------------------------------------------------------------------------------

/// AttentionStack::random: embedding entries N(0, 0.02²) (§2.3), every γ = 1 (§3.2), attention
/// layers from their own random() with seeds derived from `seed` (every weight drawn in double
/// and rounded once to Weight).
template <class Scalar, class Weight>
AttentionStack<Scalar, Weight> random_stack(const StackConfig& config, std::uint64_t seed) {
  using Stack = AttentionStack<Scalar, Weight>;
  checked_stack_config<Weight>(config);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  RowMatrix<Weight> embedding(config.vocab_size, config.d_model);
  for (Index i = 0; i < embedding.size(); ++i) {
    embedding.data()[i] = round_to<Weight>(normal(rng));
  }
  std::vector<Vector<Scalar>> gammas(static_cast<std::size_t>(config.num_layers),
                                     Vector<Scalar>::Ones(config.d_model));
  std::vector<typename Stack::Layer> layers;
  for (Index l = 0; l < config.num_layers; ++l) {
    const std::uint64_t layer_seed = rng();
    if (is_global_layer(l, config.global_every)) {
      layers.emplace_back(Stack::Mla::random(config.global, layer_seed));
    } else {
      layers.emplace_back(Stack::Gqa::random(config.local, layer_seed));
    }
  }
  // The indexers after every layer, so that a dense stack's weights do not depend on them.
  std::vector<typename Stack::Indexer> indexers;
  if (config.indexer) {
    indexers.resize(static_cast<std::size_t>(config.num_layers));
    for (Index l = 0; l < config.num_layers; ++l) {
      if (is_global_layer(l, config.global_every)) {
        indexers[static_cast<std::size_t>(l)] = Stack::Indexer::random(*config.indexer, rng());
      }
    }
  }
  return Stack(config, std::move(embedding), std::move(gammas),
               Vector<Scalar>::Ones(config.d_model), std::move(layers), std::move(indexers));
}

/// AttentionStack::with_weights: the stack of the same config, γ and layers, with every weight
/// matrix (the embedding table and each layer's projections) converted to W.
template <class W, class Scalar, class Weight>
AttentionStack<Scalar, W> converted_stack(const AttentionStack<Scalar, Weight>& stack,
                                          const std::vector<Vector<Scalar>>& norm_gammas) {
  const StackConfig& config = stack.config();
  std::vector<typename AttentionStack<Scalar, W>::Layer> layers;
  std::vector<typename AttentionStack<Scalar, W>::Indexer> indexers;
  for (Index l = 0; l < config.num_layers; ++l) {
    std::visit([&](const auto& a) { layers.emplace_back(a.template with_weights<W>()); },
               stack.layer(l));
    if (stack.sparse()) {
      indexers.push_back(is_global_layer(l, config.global_every)
                             ? stack.indexer(l).template with_weights<W>()
                             : typename AttentionStack<Scalar, W>::Indexer{});
    }
  }
  return AttentionStack<Scalar, W>(config, converted<W>(stack.embedding()), norm_gammas,
                                   stack.final_gamma(), std::move(layers), std::move(indexers));
}

/// AttentionStack::weight_bytes: the embedding table and every layer's matrices in Weight (with
/// the absorbed products of absorb_mla_weights, and the indexers of sparse global layers), the
/// L + 1 γ of d in Scalar.
template <class Scalar, class Weight>
std::int64_t stack_weight_bytes(const AttentionStack<Scalar, Weight>& stack) {
  const auto weight = static_cast<std::int64_t>(sizeof(Weight));
  std::int64_t total = static_cast<std::int64_t>(stack.embedding().size()) * weight;
  const Index layers = stack.config().num_layers;
  for (Index l = 0; l < layers; ++l) {
    total += std::visit([](const auto& a) { return a.weight_bytes(); }, stack.layer(l));
    if (stack.sparse() && is_global_layer(l, stack.config().global_every)) {
      total += stack.indexer(l).weight_bytes();
    }
    const MlaAbsorbedWeights<Weight>& a = stack.absorbed_weights(l);
    total += static_cast<std::int64_t>(a.w_q_latent.size() + a.w_o_latent.size()) * weight;
  }
  const auto gammas = static_cast<std::int64_t>(layers + 1) * stack.config().d_model;
  return total + gammas * static_cast<std::int64_t>(sizeof(Scalar));
}

}  // namespace detail

/// An APEX-1 attention stack that owns its weights: the [V, d] embedding table (also the LM
/// head), one γ per block plus the final γ, and one attention layer per block, global layers
/// MultiHeadLatentAttention and local layers GroupedQueryAttention. Built once at construction:
/// both RoPE tables ([max_positions, d_h] for the local layers, [max_positions, d_r] for the
/// decoupled RoPE of the global layers; each from config.rope and config.yarn, or the global one
/// from config.global_rope when set) and the absorbed
/// weights of every global layer (absorb_mla_weights). Immutable after construction: forward,
/// prefill, extend and decode_step are const and may run from several threads at once on
/// different StackCaches.
///
/// Scalar (float or double) is the type the stack computes in and returns logits in. Weight is
/// the type the embedding table (and tied LM head) and every layer's matrices are stored in:
/// Scalar, or Eigen::half / Eigen::bfloat16 for half the bytes, widened as each product reads
/// them; the γ of the norms stay in Scalar. AttentionStack<float, Eigen::bfloat16> computes
/// what a float stack holding the rounded weights computes (with_weights converts a stack);
/// its caches may be of any storage type (make_cache<Storage>), independently of Weight.
template <class Scalar, class Weight>
class AttentionStack {
 public:
  /// A local layer: grouped-query attention with the stack's scalar and weight types.
  using Gqa = GroupedQueryAttention<Scalar, Weight>;
  /// A global layer: multi-head latent attention with the stack's scalar and weight types.
  using Mla = MultiHeadLatentAttention<Scalar, Weight>;
  /// One attention block: Gqa for a local layer, Mla for a global one (which one is fixed by the
  /// layer rule, is_global_layer).
  using Layer = std::variant<Gqa, Mla>;
  /// The lightning indexer of a sparse global layer (StackConfig::indexer).
  using Indexer = LightningIndexer<Scalar, Weight>;

  /// An empty stack (as a moved-from one is): no layers, no weights; every call throws
  /// std::invalid_argument.
  AttentionStack() = default;
  /// Takes ownership of the weights; throws if the config is inconsistent (every field is
  /// checked), if layers[l] is not of the kind the layer rule gives layer l or not of the shape
  /// the config gives that kind, or if any γ or the table has the wrong shape.
  AttentionStack(const StackConfig& config, RowMatrix<Weight> embedding,
                 std::vector<Vector<Scalar>> norm_gammas, Vector<Scalar> final_gamma,
                 std::vector<Layer> layers)
      : AttentionStack(config, std::move(embedding), std::move(norm_gammas), std::move(final_gamma),
                       std::move(layers), {}) {}
  /// A stack with sparse global layers (config.indexer set): as above, plus indexers[l], the
  /// lightning indexer of global layer l, of config *config.indexer (one entry per layer; the
  /// local layers' entries are empty, default-constructed indexers). Without config.indexer,
  /// indexers must be empty.
  AttentionStack(const StackConfig& config, RowMatrix<Weight> embedding,
                 std::vector<Vector<Scalar>> norm_gammas, Vector<Scalar> final_gamma,
                 std::vector<Layer> layers, std::vector<Indexer> indexers)
      : config_(detail::checked_stack_config<Weight>(config)),
        embedding_(std::move(embedding)),
        norm_gammas_(std::move(norm_gammas)),
        final_gamma_(std::move(final_gamma)),
        layers_(std::move(layers)),
        indexers_(std::move(indexers)),
        local_rope_(detail::stack_rope<Scalar>(config, false)),
        global_rope_(detail::stack_rope<Scalar>(config, true)) {
    detail::check_stack_weights(config, embedding_, norm_gammas_, final_gamma_, layers_);
    detail::check_stack_indexers(config, indexers_);
    absorbed_ = detail::absorbed_stack_weights<Weight>(layers_, config.absorb);
  }

  /// A stack with random weights for examples and tests: embedding entries N(0, 0.02²) (§2.3),
  /// every γ = 1 (§3.2), attention layers from their own random() with seeds derived from `seed`
  /// (every weight drawn in double and rounded once to Weight).
  static AttentionStack random(const StackConfig& config, std::uint64_t seed) {
    return detail::random_stack<Scalar, Weight>(config, seed);
  }

  /// The configuration the stack was built with (checked at construction).
  const StackConfig& config() const { return config_; }
  /// The [V, d] embedding table W_E, which is also the tied LM head (§2.5).
  const RowMatrix<Weight>& embedding() const { return embedding_; }
  /// γ of the RMSNorm before layer l's attention (§3.2), [d]; throws unless 0 <= l < L.
  const Vector<Scalar>& norm_gamma(Index l) const {
    APEX_CHECK(l >= 0 && l < static_cast<Index>(norm_gammas_.size()),
               "[stack] layer (" << l << ") must lie in [0, " << norm_gammas_.size() << ")");
    return norm_gammas_[static_cast<std::size_t>(l)];
  }
  /// γ of the final RMSNorm before the LM head, [d] (empty for an empty stack).
  const Vector<Scalar>& final_gamma() const { return final_gamma_; }

  /// The same stack with every weight matrix (the embedding table and each layer's projections)
  /// stored as W (Scalar, Eigen::half or Eigen::bfloat16): widened exactly or rounded once to
  /// nearest even; the γ are kept, the RoPE tables and absorbed weights are built anew (the
  /// latter folded from the converted weights). Allocates the new stack.
  template <class W>
  AttentionStack<Scalar, W> with_weights() const {
    detail::check_stack_constructed(config());
    return detail::converted_stack<W>(*this, norm_gammas_);
  }

  /// Bytes of the weights the stack holds: the embedding table and every layer's matrices in
  /// Weight (with the absorbed products of absorb_mla_weights), the γ in Scalar. The RoPE
  /// tables are not counted.
  std::int64_t weight_bytes() const { return detail::stack_weight_bytes(*this); }
  /// The attention layer of block l. Throws std::out_of_range unless 0 <= l < L.
  const Layer& layer(Index l) const { return layers_.at(static_cast<std::size_t>(l)); }
  /// Whether the global layers are sparse (config().indexer set): DeepSeek Sparse Attention.
  bool sparse() const { return config().indexer.has_value(); }
  /// The lightning indexer of sparse global layer l. Throws unless the stack is sparse and
  /// l is a global layer.
  const Indexer& indexer(Index l) const {
    detail::check_stack_block(config(), l);
    APEX_CHECK(sparse() && is_global_layer(l, config().global_every),
               "[stack] layer " << l << " has no indexer: only the global layers of a stack with "
                                << "config.indexer set have one");
    return indexers_[static_cast<std::size_t>(l)];
  }
  /// What detail::sparse_mla_step reads of sparse global layer l: the layer, its absorbed
  /// weights and its indexer (valid while the stack lives).
  detail::SparseMlaParts<Scalar, Weight> sparse_parts(Index l) const {
    return {std::get<Mla>(layers_.at(static_cast<std::size_t>(l))), absorbed_weights(l),
            indexer(l)};
  }

  /// The kind of every layer and its cache values per token (multiply by sizeof(Scalar) for
  /// bytes).
  std::vector<LayerPlan> plan() const { return detail::stack_layer_plan(config()); }

  /// The mask of layer l for a prompt whose first `prefix` tokens are bidirectional (§11.1).
  AttentionMask<Scalar> mask_for_layer(Index l, Index prefix) const {
    AttentionMask<Scalar> mask;
    mask.positions = layer_mask(l, LayerMaskParams{prefix, config().window, config().global_every});
    return mask;
  }

  /// The forward pass described at the top of this header.
  ///   tokens: [B, S] ids in [0, V), the first `prefix` positions of every sequence forming the
  ///   bidirectional prefix (0 ≤ P ≤ S, S ≤ max_positions) -> logits [B*S, V].
  /// A sparse global layer runs as one prefill step of the whole sequences (sparse_mla_step:
  /// each row attends to the top k of the keys it sees), on caches of its own.
  /// Allocates the [B*S, d] residual stream, the block loop's two [B*S, d] buffers (run_blocks),
  /// what each layer's forward allocates (a sparse global layer: a latent cache and an indexer
  /// key cache of [B, S] tokens in Scalar), and the logits.
  template <class TokensDerived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix) const {
    detail::check_stack_constructed(config());
    const Index batch = tokens.rows();
    detail::check_forward_tokens(config(), batch, tokens.cols(), prefix);
    RowMatrix<Scalar> x = embed_tokens(tokens);  // checks every id
    run_blocks(x, [&](Index l, const Layer& layer, const RowMatrix<Scalar>& normed,
                      RowMatrix<Scalar>& attended) {
      if (sparse() && std::holds_alternative<Mla>(layer)) {
        detail::sparse_forward(*this, l, normed, batch, prefix, attended);
        return;
      }
      const AttentionMask<Scalar> mask = mask_for_layer(l, prefix);
      std::visit(
          [&](const auto& attention) {
            attended = attention.forward(normed, batch, mask, rope_of(attention).layer_params(0));
          },
          layer);
    });
    return output_logits(x);
  }

  // -------------------------------------------------------------------------------------------
  // Inference with caches
  // -------------------------------------------------------------------------------------------

  /// An empty StackCache for `batch` sequences of up to `capacity` tokens (1 <= capacity <=
  /// max_positions): a SlidingWindowCache of W tokens per local layer and a LatentCache of
  /// `capacity` tokens per global layer, the local ones storing Storage and the global ones
  /// Global (Scalar by default, Global = Storage unless given: stack.make_cache<Eigen::bfloat16>
  /// (batch, capacity) for 16-bit caches, make_cache<BlockQ8_0, FlashMlaFp8Row> for q8_0 windows
  /// and FlashMLA's fp8 latent rows). Throws where a layer's widths are not whole elements of
  /// its format (kv_format.hpp). Allocates
  /// stack_cache_memory<Storage, Global>(config, batch, capacity).total_bytes.
  template <class Storage = Scalar, class Global = Storage>
  StackCache<Scalar, Storage, Global> make_cache(Index batch, Index capacity) const {
    return detail::make_stack_cache<Storage, Global>(*this, batch, capacity);
  }

  /// Prefill: runs a prompt through the stack in one call and fills the (empty) cache with it.
  ///   tokens: [B, S] ids in [0, V), B = cache.batch(); the first `prefix` positions (0 <= P <= S)
  ///   form the bidirectional prefix (§11.1), which must therefore be inside this call.
  ///   -> logits [B*S, V] (row b*S + s), or [B, V] for LogitRows::kLast; equal to the rows of
  ///   forward(tokens, prefix).
  /// Throws (cache unchanged) if the cache is not empty or not made by this stack's make_cache,
  /// on a batch mismatch, a bad id, or S beyond the cache's capacity or max_positions.
  /// Allocates the [B*S, d] residual stream and what each layer's cached forward allocates.
  template <class TokensDerived, class Storage, class Global>
  RowMatrix<Scalar> prefill(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                            const DecodeOptions& options,
                            StackCache<Scalar, Storage, Global>& cache) const {
    detail::check_prefill(cache, prefix, tokens.cols());
    return detail::run_cached(*this, tokens, prefix, options, cache);
  }

  /// prefill with the default options (all logits, MLA path chosen by chunk length).
  template <class TokensDerived, class Storage, class Global>
  RowMatrix<Scalar> prefill(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                            StackCache<Scalar, Storage, Global>& cache) const {
    return prefill(tokens, prefix, DecodeOptions{}, cache);
  }

  /// Extend: continues the cached sequences with a chunk of n tokens each, at positions
  /// [p, p + n), p = cache.next_position(): the later chunks of a chunked prefill, or several
  /// tokens decoded at once. tokens: [B, n], n >= 1 -> logits [B*n, V] (or [B, V] with
  /// LogitRows::kLast), equal to the rows p … p + n − 1 of forward() on the whole sequence.
  /// Throws (cache unchanged) on a batch mismatch, a bad id, or p + n beyond the cache's
  /// capacity or max_positions (a full cache does not grow by itself: StackCache::reserve).
  template <class TokensDerived, class Storage, class Global>
  RowMatrix<Scalar> extend(const Eigen::MatrixBase<TokensDerived>& tokens,
                           const DecodeOptions& options,
                           StackCache<Scalar, Storage, Global>& cache) const {
    return detail::run_cached(*this, tokens, cache.prefix(), options, cache);
  }

  /// extend with the default options.
  template <class TokensDerived, class Storage, class Global>
  RowMatrix<Scalar> extend(const Eigen::MatrixBase<TokensDerived>& tokens,
                           StackCache<Scalar, Storage, Global>& cache) const {
    return extend(tokens, DecodeOptions{}, cache);
  }

  /// Decode step: one new token per sequence (next_tokens[b] for sequence b), at position
  /// p = cache.next_position() -> logits [B, V] of that position. The global layers take the
  /// absorbed MLA path unless options.mla says otherwise. Checks and errors as for extend.
  template <class Storage, class Global>
  RowMatrix<Scalar> decode_step(const std::vector<std::int64_t>& next_tokens,
                                const DecodeOptions& options,
                                StackCache<Scalar, Storage, Global>& cache) const {
    const Eigen::Map<const TokenMatrix> column(next_tokens.data(),
                                               static_cast<Index>(next_tokens.size()), 1);
    return detail::run_cached(*this, column, cache.prefix(), options, cache);
  }

  /// decode_step with the default options.
  template <class Storage, class Global>
  RowMatrix<Scalar> decode_step(const std::vector<std::int64_t>& next_tokens,
                                StackCache<Scalar, Storage, Global>& cache) const {
    return decode_step(next_tokens, DecodeOptions{}, cache);
  }

  // -------------------------------------------------------------------------------------------
  // Serving many sequences (continuous batching)
  // -------------------------------------------------------------------------------------------

  /// make_serving_cache(*this, shape) (stack_serving.hpp): an empty ServingCache of this stack's
  /// paged caches, the local layers' storing Storage and the global layers' Global (Global =
  /// Storage unless given).
  template <class Storage = Scalar, class Global = Storage>
  ServingCache<Scalar, Storage, Global> make_serving_cache(const ServingCacheShape& shape) const {
    return apex::make_serving_cache<Storage, Global>(*this, shape);
  }

  /// serve(*this, ids, tokens, cache) (stack_serving.hpp): one pass of many sequences of a
  /// ServingCache through the stack -> logits [N, V] of each sequence's last token.
  template <class Storage, class Global>
  RowMatrix<Scalar> serve(const std::vector<SequenceId>& ids,
                          const std::vector<std::vector<std::int64_t>>& tokens,
                          ServingCache<Scalar, Storage, Global>& cache) const {
    return apex::serve(*this, ids, tokens, cache);
  }

  /// verify_drafts(*this, ids, drafts, trees, cache) (stack_speculative.hpp): speculative
  /// verification of many sequences' draft trees in one pass -> logits [T, V] of every draft
  /// token.
  template <class Storage, class Global>
  RowMatrix<Scalar> verify_drafts(const std::vector<SequenceId>& ids,
                                  const std::vector<std::vector<std::int64_t>>& drafts,
                                  const std::vector<DraftTree>& trees,
                                  ServingCache<Scalar, Storage, Global>& cache) const {
    return apex::verify_drafts(*this, ids, drafts, trees, cache);
  }

  /// accept_drafts(*this, ids, paths, cache) (stack_speculative.hpp): keeps one path of each
  /// verified draft in every layer and releases the rest.
  template <class Storage, class Global>
  void accept_drafts(const std::vector<SequenceId>& ids,
                     const std::vector<std::vector<Index>>& paths,
                     ServingCache<Scalar, Storage, Global>& cache) const {
    apex::accept_drafts(*this, ids, paths, cache);
  }

  // -------------------------------------------------------------------------------------------
  // Building blocks, for running the stack's blocks under an attention schedule of one's own
  // (serve in stack_serving.hpp runs them over paged caches, apex/distributed/stack.hpp across
  // the ranks of an MPI job). forward() is
  //   x = embed_tokens(tokens);
  //   run_blocks(x, attention of layer(l) with block_params(l) and mask_for_layer(l, P));
  //   logits = output_logits(x).
  // -------------------------------------------------------------------------------------------

  /// The per-layer block loop of every form of the stack (forward, prefill / extend /
  /// decode_step, serve, and the context-parallel calls of apex/distributed/stack.hpp):
  ///   for l = 0 … L−1:   attend(l, layer(l), RMSNorm(x; γ_l), attended);   x += attended
  /// x: [rows, d], the residual stream, updated in place. attend(l, layer, normed, attended)
  /// writes block l's attention output [rows, d] of its normalised rows normed [rows, d] into
  /// attended [rows, d] (or assigns a new matrix of that shape to it), in its own mode: whole
  /// sequences, on a layer cache, paged, or across ranks; its checks must all have run before
  /// the first call writes a cache. Allocates the two [rows, d] buffers normed and attended.
  template <class Attend>
  void run_blocks(RowMatrix<Scalar>& x, Attend&& attend) const {
    detail::check_stack_constructed(config());
    detail::check_stack_width(config(), x.cols());
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    RowMatrix<Scalar> attended(x.rows(), x.cols());
    const RmsNormParams norm{config().norm_eps};
    for (Index l = 0; l < config().num_layers; ++l) {
      const auto at = static_cast<std::size_t>(l);
      rms_norm(x, norm_gammas_[at], norm, normed);
      attend(l, layers_[at], std::as_const(normed), attended);
      x += attended;
    }
  }

  /// x_0 = Embed(tokens)·√d (§2.2): tokens [B, S] -> [B*S, d], row b*S + s. Checks every id.
  /// Allocates the result.
  template <class TokensDerived>
  RowMatrix<Scalar> embed_tokens(const Eigen::MatrixBase<TokensDerived>& tokens) const {
    detail::check_stack_constructed(config());
    const Index rows = detail::checked_product(tokens.rows(), tokens.cols(), "stack", "B*S");
    RowMatrix<Scalar> x(rows, config().d_model);
    embed(embedding_, tokens, EmbeddingParams{}, x);  // in Scalar, whatever Weight the table is
    return x;
  }

  /// RMSNorm(x; γ_l) (§3), block l's normalisation of its input: x [rows, d] -> out [rows, d]
  /// (out may be x). Throws unless 0 <= l < L and the shapes fit.
  void block_norm(Index l, const RowMatrix<Scalar>& x, RowRef<Scalar> out) const {
    detail::check_stack_block(config(), l);
    rms_norm(x, norm_gammas_[static_cast<std::size_t>(l)], RmsNormParams{config().norm_eps}, out);
  }

  /// The parameters block l's attention layer takes: the RoPE table of its kind (local or
  /// global, YaRN's where set) and the softmax scale (YaRN's temperature where it goes to the
  /// scale), with position_offset 0: set it to the absolute position of the rows' first token.
  /// Throws unless 0 <= l < L. The table is the stack's: the result is valid while it lives.
  AttentionLayerParams<Scalar> block_params(Index l) const {
    detail::check_stack_block(config(), l);
    return std::visit([&](const auto& a) { return rope_of(a).layer_params(0); },
                      layers_[static_cast<std::size_t>(l)]);
  }

  /// logits = RMSNorm(x; γ_final) · W_Eᵀ (§2.5, the tied LM head): x [rows, d] -> [rows, V], as
  /// prefill and decode_step compute them (bit-identical for any thread count). Allocates the
  /// normalised copy and the result.
  RowMatrix<Scalar> output_logits(const RowMatrix<Scalar>& x) const {
    detail::check_stack_constructed(config());
    detail::check_stack_width(config(), x.cols());
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    rms_norm(x, final_gamma_, RmsNormParams{config().norm_eps}, RowRef<Scalar>(normed));
    return detail::matmul_transposed<Scalar>(normed, embedding_);
  }

  /// The logits of rows ends[i] − 1 of the residual stream x [rows, d] (the last token of each
  /// sequence whose rows end there): the final RMSNorm and the tied LM head (§2.5) of those rows
  /// only, as output_logits computes them -> [ends.size(), V]. Allocates the gathered rows and
  /// the result.
  RowMatrix<Scalar> last_logits(const RowMatrix<Scalar>& x, const std::vector<Index>& ends) const {
    RowMatrix<Scalar> last(static_cast<Index>(ends.size()), x.cols());
    for (std::size_t i = 0; i < ends.size(); ++i) last.row(Index(i)) = x.row(ends[i] - 1);
    rms_norm(last, final_gamma_, RmsNormParams{config().norm_eps}, RowRef<Scalar>(last));
    return detail::matmul_transposed<Scalar>(last, embedding_);
  }

  /// The absorbed weights of block l (absorb_mla_weights, folded at construction; empty for a
  /// local layer), as the absorbed MLA path takes them. Throws std::out_of_range unless
  /// 0 <= l < L.
  const MlaAbsorbedWeights<Weight>& absorbed_weights(Index l) const {
    return absorbed_.at(static_cast<std::size_t>(l));
  }

  /// The cache memory of this stack for `batch` sequences of `context` tokens in this scalar
  /// type, or for caches storing formats Storage and Global (stack_cache_memory<Storage,
  /// Global>): the bytes make_cache<Storage, Global> allocates.
  template <class Storage = Scalar, class Global = Storage>
  StackCacheMemory cache_memory(Index batch, Index context) const {
    return stack_cache_memory<Storage, Global>(config(), batch, context);
  }

 private:
  /// The RoPE (table, YaRN's multiplier, d_qk) of a layer's kind.
  const detail::StackRope<Scalar>& rope_of(const Gqa&) const { return local_rope_; }
  const detail::StackRope<Scalar>& rope_of(const Mla&) const { return global_rope_; }

  detail::ResetOnMove<StackConfig> config_;  // a moved-from stack is an empty one
  RowMatrix<Weight> embedding_;
  std::vector<Vector<Scalar>> norm_gammas_;
  Vector<Scalar> final_gamma_;
  std::vector<Layer> layers_;
  std::vector<Indexer> indexers_;          ///< one per layer when sparse (empty for the local ones)
  detail::StackRope<Scalar> local_rope_;   ///< [max_positions, d_h] table of the local layers
  detail::StackRope<Scalar> global_rope_;  ///< [max_positions, d_r] table of the global layers
  std::vector<MlaAbsorbedWeights<Weight>> absorbed_;  ///< per layer; empty for local layers
};

}  // namespace apex
