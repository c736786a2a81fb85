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
// Inference. forward() recomputes a whole sequence (and is the oracle). A StackCache holds one
// cache per layer, the kind the documents motivate each layer with:
//   local layers   SlidingWindowCache of the last W tokens  2·H_kv·d_h values per token, ≤ W tokens
//   global layers  LatentCache (c_kv ‖ K_rope)               d_kv + H_kr·d_r values per token
// prefill() runs a prompt (with its bidirectional prefix) through the stack in one call and
// fills the caches; extend() continues with a chunk (chunked prefill, or several tokens at
// once) and decode_step() with one token per sequence. Each returns the logits of its tokens,
// equal to the rows forward() computes for the whole sequence.
//
// Long context. With StackConfig::yarn set, the RoPE tables are YaRN tables (§5) and the
// attention temperature goes where YarnParams::temperature says (tables, or the softmax scale),
// so the stack runs past the trained context L up to s·L positions; StackConfig::rope_scaling
// takes any other scaling (linear, dynamic NTK, Llama 3, LongRoPE: rope_scaling.hpp) instead.
// StackConfig::global_rope gives the global layers a RoPE (and scaling) of their own, as
// checkpoints with a larger base for their global layers need.
#pragma once

#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/embedding.hpp>
#include <apex/gqa.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/mla.hpp>
#include <apex/paged_cache.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/rope_config.hpp>
#include <apex/serving_cache.hpp>
#include <apex/yarn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

/// Shape of an APEX-1 attention stack.
struct StackConfig {
  Index vocab_size = 0;     ///< V
  Index d_model = 0;        ///< d
  Index num_layers = 0;     ///< L
  Index window = 0;         ///< W of the local layers (§10)
  Index global_every = 6;   ///< F_g (§11.2)
  GqaConfig local;          ///< local layers; local.d_model must equal d_model
  MlaConfig global;         ///< global layers; global.d_model must equal d_model
  Index max_positions = 0;  ///< longest sequence the RoPE tables cover
  /// Base, pairing and rotated features of the RoPE tables: the local layers' table rotates the
  /// first rope.rotary_dim features of each head (0: all; partial rotary, even, at most d_h),
  /// the global layers' table all d_r features of the decoupled RoPE (§9.3) whatever
  /// rotary_dim says.
  RopeParams rope;
  double norm_eps = 1e-6;  ///< ε of every RMSNorm (§3.2)
  /// YaRN (§5) for the RoPE tables: scale s, original context L, temperature placement. Unset:
  /// plain RoPE. When set, yarn->base must equal rope.base and max_positions must not exceed
  /// s·L (the context the YaRN frequencies are made for).
  std::optional<YarnParams> yarn;
  /// Another scaling of the RoPE tables (rope_scaling.hpp: linear, dynamic NTK, Llama 3,
  /// LongRoPE), for the local layers and, unless global_rope is set, the global ones; at most one
  /// of yarn and rope_scaling. Unset (std::monostate): none.
  RopeScaling rope_scaling;
  /// The RoPE (and YaRN) of the global layers when it differs from the local layers' rope and
  /// yarn: Gemma 3, for one, rotates its local layers with base 10 000 and its global ones with
  /// base 1 000 000. Unset: the global layers use rope and yarn too. Its rope.rotary_dim must be
  /// 0 (the decoupled RoPE rotates all of its d_r features).
  std::optional<LayerRope> global_rope;
  /// How the global (MLA) layers' weights are folded for absorbed decoding, once, at
  /// construction (absorb_mla_weights).
  MlaAbsorbParams absorb;
};

/// Which rows of logits prefill() and extend() return.
enum class LogitRows {
  kAll,   ///< every new token: [B*n, V], row b*n + s
  kLast,  ///< the last new token of each sequence: [B, V] (all a generation loop needs)
};

/// Options of the cached (inference) calls of AttentionStack.
struct DecodeOptions {
  /// Which rows of logits to return: every new token (the default) or only the last one of
  /// each sequence, which shrinks the LM head's product from [B*n, d]·[d, V] to [B, d]·[d, V].
  LogitRows logits = LogitRows::kAll;
  /// MLA decoding path of the global layers (mla.hpp): kAuto takes the cheaper one for the
  /// chunk length (absorbed for single tokens, naive for prompts); both are exact.
  MlaPath mla = MlaPath::kAuto;
};

/// The cache memory of an APEX-1 stack at a given context, by layer kind (bytes).
struct StackCacheMemory {
  Index local_layers = 0;   ///< GQA + sliding window
  Index global_layers = 0;  ///< MLA
  /// One local layer, one sequence, one token: 2·H_kv·d_h·bytes (K and V), held for the last
  /// W tokens only. 0 when there is no local layer.
  std::int64_t local_bytes_per_token = 0;
  /// One global layer, one sequence, one token: (d_kv + H_kr·d_r)·bytes (c_kv and K_rope,
  /// mla.hpp). 0 when there is no global layer.
  std::int64_t global_bytes_per_token = 0;
  /// One local layer at the context: B·min(S, W)·local_bytes_per_token (§10.3).
  std::int64_t local_bytes_per_layer = 0;
  /// One global layer at the context: B·S·global_bytes_per_token (§9.4 plus K_rope).
  std::int64_t global_bytes_per_layer = 0;
  /// Every layer: local_layers·local_bytes_per_layer + global_layers·global_bytes_per_layer.
  std::int64_t total_bytes = 0;
};

/// One row of the layer plan: what layer l is and what a decoder caches for it per token.
struct LayerPlan {
  Index layer = 0;      ///< l, counted from 0
  bool global = false;  ///< true for a global (MLA) layer, l mod F_g = F_g − 1 (§11.2)
  /// Values cached per token: 2·H_kv·d_h for a local layer (kept for the last W tokens only);
  /// d_kv + H_kr·d_r for a global (MLA) layer (c_kv and K_rope, see mla.hpp).
  std::int64_t cache_values_per_token = 0;
};

/// The cache memory of a stack with this config holding `context` tokens for `batch` sequences,
/// each value `bytes_per_value` bytes wide (2 for FP16, sizeof(Scalar) for a StackCache): what
/// StackCache::bytes() reports for a cache of capacity `context`. Needs no weights, so it can
/// be evaluated for APEX-1 Large. Throws on a non-positive batch, context or value width, an
/// invalid layer config, or a size beyond 64 bits.
inline StackCacheMemory stack_cache_memory(const StackConfig& c, Index batch, Index context,
                                           Index bytes_per_value) {
  APEX_CHECK(batch >= 1 && context >= 1 && bytes_per_value >= 1,
             "[stack] batch (" << batch << "), context (" << context << ") and bytes_per_value ("
                               << bytes_per_value << ") must be >= 1");
  APEX_CHECK(c.num_layers >= 0, "[stack] num_layers (" << c.num_layers << ") must be >= 0");
  APEX_CHECK(c.window >= 1, "[stack] window W (" << c.window << ") must be >= 1");
  APEX_CHECK(c.global_every >= 1,
             "[stack] global_every F_g (" << c.global_every << ") must be >= 1");
  StackCacheMemory m;
  // Layers l in [0, L) with l mod F_g = F_g − 1 (§11.2): floor(L / F_g) of them, counted without
  // a loop over a user-given L.
  m.global_layers = c.num_layers / c.global_every;
  m.local_layers = c.num_layers - m.global_layers;
  // Every product is checked: the dimensions are the user's, and a wrapped size is worse than
  // an error.
  const char* op = "stack";
  if (m.local_layers > 0) {
    detail::check_gqa_config(c.local);
    m.local_bytes_per_token = detail::checked_product(
        {2, c.local.num_kv_heads, c.local.head_dim, bytes_per_value}, op, "2*H_kv*d_h*bytes");
    m.local_bytes_per_layer = sliding_window_cache_bytes(
        batch, context, c.window, c.local.num_kv_heads, c.local.head_dim, bytes_per_value);
  }
  if (m.global_layers > 0) {
    detail::check_mla_config(c.global);
    const std::int64_t values = detail::checked_sum(
        c.global.d_kv,
        detail::checked_product(c.global.rope_key_heads(), c.global.rope_dim, op, "H_kr*d_r"), op,
        "d_kv + H_kr*d_r");
    m.global_bytes_per_token = detail::checked_product(values, bytes_per_value, op, "bytes/token");
    m.global_bytes_per_layer =
        detail::checked_product({batch, context, m.global_bytes_per_token}, op, "B*S*bytes/token");
  }
  const std::int64_t local_bytes =
      detail::checked_product(m.local_layers, m.local_bytes_per_layer, op, "local bytes");
  const std::int64_t global_bytes =
      detail::checked_product(m.global_layers, m.global_bytes_per_layer, op, "global bytes");
  m.total_bytes = detail::checked_sum(local_bytes, global_bytes, op, "total bytes");
  return m;
}

template <class Scalar, class Weight = Scalar>
class AttentionStack;

/// The decoding state of one AttentionStack: one cache per layer (a SlidingWindowCache of W
/// tokens for each local layer, a LatentCache of `capacity` tokens for each global layer), the
/// batch, the prefix and the next absolute position. Made by AttentionStack::make_cache and
/// advanced only by that stack's prefill / extend / decode_step, which check that it matches.
/// Every layer's cache stores Storage (Scalar, or Eigen::half / Eigen::bfloat16 for half the
/// bytes): AttentionStack::make_cache<Storage>.
/// Memory: bytes() = stack_cache_memory(config, batch, capacity, sizeof(Storage)).total_bytes,
/// allocated at construction; the local layers' share never grows, the global layers' grows
/// only through reserve().
template <class Scalar, class Storage = Scalar>
class StackCache {
 public:
  /// An empty cache of no layers (as a moved-from one is); the stacks reject it.
  StackCache() = default;
  /// The cache of one layer: a SlidingWindowCache for a local layer, a LatentCache for a
  /// global one.
  using LayerCache =
      std::variant<SlidingWindowCache<Scalar, Storage>, LatentCache<Scalar, Storage>>;

  /// Number of sequences B decoded side by side.
  Index batch() const { return batch_; }
  /// Tokens the global layers can hold (positions [0, capacity)).
  Index capacity() const { return capacity_; }
  /// Number of layer caches, L (one per layer of the stack).
  Index num_layers() const { return static_cast<Index>(layers_.size()); }
  /// Absolute position of the next token (= tokens processed per sequence).
  Index next_position() const { return next_; }
  /// P of the sequence being decoded (set by prefill).
  Index prefix() const { return prefix_; }
  /// The cache of layer l, read-only (it is written only by the stack). Throws
  /// std::invalid_argument unless 0 <= l < num_layers().
  const LayerCache& layer(Index l) const {
    APEX_CHECK(l >= 0 && l < num_layers(),
               "[stack] layer (" << l << ") must lie in [0, " << num_layers() << ")");
    return layers_[static_cast<std::size_t>(l)];
  }

  /// Exact bytes of every layer's cache.
  std::int64_t bytes() const { return local_bytes() + global_bytes(); }
  /// Bytes of the local layers' sliding-window caches: constant, whatever the context.
  std::int64_t local_bytes() const { return bytes_of<SlidingWindowCache<Scalar, Storage>>(); }
  /// Bytes of the global layers' latent caches: proportional to capacity(), so it grows with
  /// reserve().
  std::int64_t global_bytes() const { return bytes_of<LatentCache<Scalar, Storage>>(); }

  /// Grows the global layers' capacity to at least `capacity` (one copy of each latent cache;
  /// see LatentCache::reserve). Never shrinks.
  void reserve(Index capacity) {
    detail::check_constructed(batch() >= 1, "stack", "cache");
    if (capacity <= capacity_) return;
    for (LayerCache& cache : layers_) {
      if (auto* latent = std::get_if<LatentCache<Scalar, Storage>>(&cache)) {
        latent->reserve(capacity);
      }
    }
    capacity_ = capacity;
  }

  /// Forgets the sequence (memory kept): the next call must be prefill (or extend from 0).
  void clear() {
    for (LayerCache& cache : layers_) std::visit([](auto& c) { c.clear(); }, cache);
    next_ = 0;
    prefix_ = 0;
  }

 private:
  template <class, class>
  friend class AttentionStack;

  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, called by make_cache only
  StackCache(Index batch, Index capacity, std::vector<LayerCache> layers)
      : batch_(batch), capacity_(capacity), layers_(std::move(layers)) {}

  template <class Kind>
  std::int64_t bytes_of() const {
    std::int64_t total = 0;
    for (const LayerCache& cache : layers_) {
      if (const auto* c = std::get_if<Kind>(&cache)) total += c->bytes();
    }
    return total;
  }

  detail::ResetOnMove<Index> batch_;
  detail::ResetOnMove<Index> capacity_;
  detail::ResetOnMove<Index> next_;
  detail::ResetOnMove<Index> prefix_;
  std::vector<LayerCache> layers_;  // a moved-from vector is empty
};

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

  /// An empty stack (as a moved-from one is): no layers, no weights; every call throws
  /// std::invalid_argument.
  AttentionStack() = default;
  /// Takes ownership of the weights; throws if the config is inconsistent (every field is
  /// checked), if layers[l] is not of the kind the layer rule gives layer l or not of the shape
  /// the config gives that kind, or if any γ or the table has the wrong shape.
  AttentionStack(const StackConfig& config, RowMatrix<Weight> embedding,
                 std::vector<Vector<Scalar>> norm_gammas, Vector<Scalar> final_gamma,
                 std::vector<Layer> layers)
      : config_(checked(config)),
        embedding_(std::move(embedding)),
        norm_gammas_(std::move(norm_gammas)),
        final_gamma_(std::move(final_gamma)),
        layers_(std::move(layers)),
        local_rope_(rope_table(config, false)),
        global_rope_(rope_table(config, true)),
        local_multiplier_(softmax_multiplier(config, false)),
        global_multiplier_(softmax_multiplier(config, true)) {
    const Index d = config.d_model;
    APEX_CHECK(embedding_.rows() == config.vocab_size && embedding_.cols() == d,
               "[stack] embedding shape [" << embedding_.rows() << ", " << embedding_.cols()
                                           << "] must be [V, d] = [" << config.vocab_size << ", "
                                           << d << "]");
    APEX_CHECK(static_cast<Index>(layers_.size()) == config.num_layers &&
                   static_cast<Index>(norm_gammas_.size()) == config.num_layers,
               "[stack] " << layers_.size() << " layers and " << norm_gammas_.size()
                          << " norm gammas given; num_layers is " << config.num_layers);
    for (Index l = 0; l < config.num_layers; ++l) check_layer(config, l);
    APEX_CHECK(final_gamma_.size() == d,
               "[stack] final gamma length (" << final_gamma_.size() << ") must be d = " << d);
    absorbed_.resize(layers_.size());
    Index globals = 0;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (const auto* mla = std::get_if<Mla>(&layers_[l])) {
        absorbed_[l] = absorb_mla_weights(*mla, config.absorb);
        ++globals;
      }
    }
    global_layers_ = globals;
  }

  /// A stack with random weights for examples and tests: embedding entries N(0, 0.02²) (§2.3),
  /// every γ = 1 (§3.2), attention layers from their own random() with seeds derived from `seed`
  /// (every weight drawn in double and rounded once to Weight).
  static AttentionStack random(const StackConfig& config, std::uint64_t seed) {
    checked(config);
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 0.02);
    RowMatrix<Weight> embedding(config.vocab_size, config.d_model);
    for (Index i = 0; i < embedding.size(); ++i) {
      embedding.data()[i] = round_to<Weight>(normal(rng));
    }
    std::vector<Vector<Scalar>> gammas(static_cast<std::size_t>(config.num_layers),
                                       Vector<Scalar>::Ones(config.d_model));
    std::vector<Layer> layers;
    for (Index l = 0; l < config.num_layers; ++l) {
      const std::uint64_t layer_seed = rng();
      if (is_global_layer(l, config.global_every)) {
        layers.emplace_back(Mla::random(config.global, layer_seed));
      } else {
        layers.emplace_back(Gqa::random(config.local, layer_seed));
      }
    }
    return AttentionStack(config, std::move(embedding), std::move(gammas),
                          Vector<Scalar>::Ones(config.d_model), std::move(layers));
  }

  /// The configuration the stack was built with (checked at construction).
  const StackConfig& config() const { return config_; }
  /// The [V, d] embedding table W_E, which is also the tied LM head (§2.5).
  const RowMatrix<Weight>& embedding() const { return embedding_; }

  /// The same stack with every weight matrix (the embedding table and each layer's projections)
  /// stored as W (Scalar, Eigen::half or Eigen::bfloat16): widened exactly or rounded once to
  /// nearest even; the γ are kept, the RoPE tables and absorbed weights are built anew (the
  /// latter folded from the converted weights). Allocates the new stack.
  template <class W>
  AttentionStack<Scalar, W> with_weights() const {
    check_constructed();
    std::vector<typename AttentionStack<Scalar, W>::Layer> layers;
    layers.reserve(layers_.size());
    for (const Layer& layer : layers_) {
      std::visit([&](const auto& a) { layers.emplace_back(a.template with_weights<W>()); }, layer);
    }
    return AttentionStack<Scalar, W>(config(), converted<W>(embedding_), norm_gammas_, final_gamma_,
                                     std::move(layers));
  }

  /// Bytes of the weights the stack holds: the embedding table and every layer's matrices in
  /// Weight (with the absorbed products of absorb_mla_weights), the γ in Scalar. The RoPE
  /// tables are not counted.
  std::int64_t weight_bytes() const {
    const auto weight = static_cast<std::int64_t>(sizeof(Weight));
    std::int64_t total = static_cast<std::int64_t>(embedding_.size()) * weight;
    for (const Layer& layer : layers_) {
      total += std::visit([](const auto& a) { return a.weight_bytes(); }, layer);
    }
    for (const MlaAbsorbedWeights<Weight>& a : absorbed_) {
      total += static_cast<std::int64_t>(a.w_q_latent.size() + a.w_o_latent.size()) * weight;
    }
    const auto gammas = static_cast<std::int64_t>(norm_gammas_.size() + 1) * config().d_model;
    return total + gammas * static_cast<std::int64_t>(sizeof(Scalar));
  }
  /// The attention layer of block l. Throws std::out_of_range unless 0 <= l < L.
  const Layer& layer(Index l) const { return layers_.at(static_cast<std::size_t>(l)); }

  /// The kind of every layer and its cache values per token (multiply by sizeof(Scalar) for
  /// bytes).
  std::vector<LayerPlan> plan() const {
    std::vector<LayerPlan> rows;
    for (Index l = 0; l < config().num_layers; ++l) {
      LayerPlan row;
      row.layer = l;
      row.global = is_global_layer(l, config().global_every);
      row.cache_values_per_token =
          row.global
              ? mla_cache_values_per_token(config().global)
              : kv_cache_values_per_token(config().local.num_kv_heads, config().local.head_dim);
      rows.push_back(row);
    }
    return rows;
  }

  /// The mask of layer l for a prompt whose first `prefix` tokens are bidirectional (§11.1).
  AttentionMask<Scalar> mask_for_layer(Index l, Index prefix) const {
    AttentionMask<Scalar> mask;
    mask.positions = layer_mask(l, LayerMaskParams{prefix, config().window, config().global_every});
    return mask;
  }

  /// The forward pass described at the top of this header.
  ///   tokens: [B, S] ids in [0, V), the first `prefix` positions of every sequence forming the
  ///   bidirectional prefix (0 ≤ P ≤ S, S ≤ max_positions) -> logits [B*S, V].
  /// Allocates the [B*S, d] residual stream, one [B*S, d] normalised copy, what each layer's
  /// forward allocates, and the logits.
  template <class TokensDerived>
  RowMatrix<Scalar> forward(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix) const {
    check_constructed();
    const Index batch = tokens.rows();
    const Index seq = tokens.cols();
    APEX_CHECK(batch >= 1 && seq >= 1,
               "[stack] tokens shape [" << batch << ", " << seq << "] must be non-empty");
    APEX_CHECK(prefix >= 0 && prefix <= seq,
               "[stack] prefix (" << prefix << ") must lie in [0, S = " << seq << "]");
    APEX_CHECK(seq <= config().max_positions, "[stack] sequence length ("
                                                  << seq << ") exceeds max_positions ("
                                                  << config().max_positions << ")");
    RowMatrix<Scalar> x = embedded(tokens);  // checks every id
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    const RmsNormParams norm{config().norm_eps};
    for (Index l = 0; l < config().num_layers; ++l) {
      rms_norm(x, norm_gammas_[static_cast<std::size_t>(l)], norm, normed);
      const AttentionMask<Scalar> mask = mask_for_layer(l, prefix);
      std::visit(
          [&](const auto& attention) {
            x.noalias() += attention.forward(normed, batch, mask, layer_params(attention, 0));
          },
          layers_[static_cast<std::size_t>(l)]);
    }
    rms_norm(x, final_gamma_, norm, normed);
    return lm_head(normed, embedding_);
  }

  // -------------------------------------------------------------------------------------------
  // Inference with caches
  // -------------------------------------------------------------------------------------------

  /// An empty StackCache for `batch` sequences of up to `capacity` tokens (1 <= capacity <=
  /// max_positions): a SlidingWindowCache of W tokens per local layer and a LatentCache of
  /// `capacity` tokens per global layer, every one storing Storage (Scalar by default;
  /// stack.make_cache<Eigen::bfloat16>(batch, capacity) for 16-bit caches). Allocates
  /// stack_cache_memory(config, batch, capacity, sizeof(Storage)).total_bytes.
  template <class Storage = Scalar>
  StackCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    APEX_CHECK(batch >= 1, "[stack] batch (" << batch << ") must be >= 1");
    APEX_CHECK(capacity >= 1 && capacity <= config().max_positions,
               "[stack] capacity (" << capacity << ") must lie in [1, max_positions = "
                                    << config().max_positions << "]");
    std::vector<typename StackCache<Scalar, Storage>::LayerCache> caches;
    caches.reserve(layers_.size());
    for (const Layer& layer : layers_) {
      if (const auto* mla = std::get_if<Mla>(&layer)) {
        caches.emplace_back(mla->template make_cache<Storage>(batch, capacity));
      } else {
        caches.emplace_back(
            std::get<Gqa>(layer).template make_window_cache<Storage>(batch, config().window));
      }
    }
    return StackCache<Scalar, Storage>(batch, capacity, std::move(caches));
  }

  /// Prefill: runs a prompt through the stack in one call and fills the (empty) cache with it.
  ///   tokens: [B, S] ids in [0, V), B = cache.batch(); the first `prefix` positions (0 <= P <= S)
  ///   form the bidirectional prefix (§11.1), which must therefore be inside this call.
  ///   -> logits [B*S, V] (row b*S + s), or [B, V] for LogitRows::kLast; equal to the rows of
  ///   forward(tokens, prefix).
  /// Throws (cache unchanged) if the cache is not empty or not made by this stack's make_cache,
  /// on a batch mismatch, a bad id, or S beyond the cache's capacity or max_positions.
  /// Allocates the [B*S, d] residual stream and what each layer's cached forward allocates.
  template <class TokensDerived, class Storage>
  RowMatrix<Scalar> prefill(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                            const DecodeOptions& options,
                            StackCache<Scalar, Storage>& cache) const {
    APEX_CHECK(cache.next_position() == 0,
               "[stack] prefill needs an empty cache (its next position is "
                   << cache.next_position()
                   << "): use extend() to continue a sequence, or clear()");
    APEX_CHECK(prefix >= 0 && prefix <= tokens.cols(),
               "[stack] prefix (" << prefix << ") must lie in [0, S = " << tokens.cols() << "]");
    return run_cached(tokens, prefix, options, cache);
  }

  /// prefill with the default options (all logits, MLA path chosen by chunk length).
  template <class TokensDerived, class Storage>
  RowMatrix<Scalar> prefill(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                            StackCache<Scalar, Storage>& cache) const {
    return prefill(tokens, prefix, DecodeOptions{}, cache);
  }

  /// Extend: continues the cached sequences with a chunk of n tokens each, at positions
  /// [p, p + n), p = cache.next_position(): the later chunks of a chunked prefill, or several
  /// tokens decoded at once. tokens: [B, n], n >= 1 -> logits [B*n, V] (or [B, V] with
  /// LogitRows::kLast), equal to the rows p … p + n − 1 of forward() on the whole sequence.
  /// Throws (cache unchanged) on a batch mismatch, a bad id, or p + n beyond the cache's
  /// capacity or max_positions (a full cache does not grow by itself: StackCache::reserve).
  template <class TokensDerived, class Storage>
  RowMatrix<Scalar> extend(const Eigen::MatrixBase<TokensDerived>& tokens,
                           const DecodeOptions& options, StackCache<Scalar, Storage>& cache) const {
    return run_cached(tokens, cache.prefix(), options, cache);
  }

  /// extend with the default options.
  template <class TokensDerived, class Storage>
  RowMatrix<Scalar> extend(const Eigen::MatrixBase<TokensDerived>& tokens,
                           StackCache<Scalar, Storage>& cache) const {
    return extend(tokens, DecodeOptions{}, cache);
  }

  /// Decode step: one new token per sequence (next_tokens[b] for sequence b), at position
  /// p = cache.next_position() -> logits [B, V] of that position. The global layers take the
  /// absorbed MLA path unless options.mla says otherwise. Checks and errors as for extend.
  template <class Storage>
  RowMatrix<Scalar> decode_step(const std::vector<std::int64_t>& next_tokens,
                                const DecodeOptions& options,
                                StackCache<Scalar, Storage>& cache) const {
    const Eigen::Map<const TokenMatrix> column(next_tokens.data(),
                                               static_cast<Index>(next_tokens.size()), 1);
    return run_cached(column, cache.prefix(), options, cache);
  }

  /// decode_step with the default options.
  template <class Storage>
  RowMatrix<Scalar> decode_step(const std::vector<std::int64_t>& next_tokens,
                                StackCache<Scalar, Storage>& cache) const {
    return decode_step(next_tokens, DecodeOptions{}, cache);
  }

  // -------------------------------------------------------------------------------------------
  // Serving many sequences (continuous batching)
  // -------------------------------------------------------------------------------------------

  /// An empty ServingCache for this stack: a PagedKvCache of shape.local_pages pages for each
  /// local layer and a PagedLatentCache of shape.global_pages pages for each global layer, pages
  /// of shape.page_size tokens, storing Storage. Throws unless the pools of the layers the stack
  /// has are >= 1 page of >= 1 token. Allocates the pools.
  template <class Storage = Scalar>
  ServingCache<Scalar, Storage> make_serving_cache(const ServingCacheShape& shape) const {
    check_constructed();
    std::vector<typename ServingCache<Scalar, Storage>::LayerCache> caches;
    caches.reserve(layers_.size());
    for (const Layer& layer : layers_) {
      if (const auto* mla = std::get_if<Mla>(&layer)) {
        const MlaConfig& c = mla->config();
        caches.emplace_back(PagedLatentCache<Scalar, Storage>(
            {c.d_kv, c.rope_key_heads(), c.rope_dim, shape.page_size, shape.global_pages}));
      } else {
        const GqaConfig& c = std::get<Gqa>(layer).config();
        caches.emplace_back(PagedKvCache<Scalar, Storage>(
            {c.num_kv_heads, c.head_dim, shape.page_size, shape.local_pages}));
      }
    }
    return ServingCache<Scalar, Storage>(std::move(caches));
  }

  /// One pass of many sequences of a ServingCache through the stack (continuous batching):
  /// tokens[i] are the next tokens of sequence ids[i], at positions cache.length(ids[i]) + s —
  /// its prompt in its first call (the prefix it was added with must lie inside it), then one
  /// token per step, or any chunk — and every sequence follows the APEX-1 rules of its own
  /// prefix (§11.1). Prompts and single tokens of different sequences may share one call: their
  /// rows go through every projection together, and each layer's attention is one sdpa_paged
  /// call over all of them (the global layers take the absorbed MLA path, exact for any chunk).
  /// The local layers then give back the pages that their window has passed.
  ///   ids: N distinct live sequences; tokens: N non-empty lists of ids in [0, V)
  ///   -> logits [N, V], row i for the last token of ids[i]: what prefill / extend /
  ///   decode_step of that sequence alone return for it (to the rounding of the other path).
  /// Every check runs before any cache is written (live and distinct ids, token ids, the
  /// prefix, max_positions, room in every layer's pool): on error nothing changes. Allocates
  /// the [T, d] residual stream (T tokens in all) and what each layer's forward_paged allocates.
  template <class Storage>
  RowMatrix<Scalar> serve(const std::vector<SequenceId>& ids,
                          const std::vector<std::vector<std::int64_t>>& tokens,
                          ServingCache<Scalar, Storage>& cache) const {
    const std::vector<Index> cu = check_serve(ids, tokens, cache);
    TokenMatrix flat(1, cu.back());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::copy(tokens[i].begin(), tokens[i].end(), flat.data() + cu[i]);
    }
    std::vector<std::pair<SequenceId, Index>> appends;
    for (std::size_t i = 0; i < ids.size(); ++i) appends.emplace_back(ids[i], cu[i + 1] - cu[i]);
    for (const auto& layer_cache : cache.layers_) {
      std::visit([&](const auto& c) { c.check_appends(appends, "serve"); }, layer_cache);
    }
    RowMatrix<Scalar> x = embedded(flat);
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    RowMatrix<Scalar> attended(x.rows(), x.cols());
    const RmsNormParams norm{config().norm_eps};
    for (Index l = 0; l < config().num_layers; ++l) {
      const auto at = static_cast<std::size_t>(l);
      rms_norm(x, norm_gammas_[at], norm, normed);
      std::vector<PositionMask> rules;
      rules.reserve(ids.size());
      for (const SequenceId id : ids) {
        rules.push_back(layer_mask(
            l, LayerMaskParams{cache.prefix(id), config().window, config().global_every}));
      }
      auto& layer_cache = cache.layers_[at];
      if (const auto* mla = std::get_if<Mla>(&layers_[at])) {
        mla->forward_paged(normed, cu, ids, rules, layer_params(*mla, 0), absorbed_[at],
                           std::get<PagedLatentCache<Scalar, Storage>>(layer_cache), attended);
      } else {
        const auto& gqa = std::get<Gqa>(layers_[at]);
        auto& kv = std::get<PagedKvCache<Scalar, Storage>>(layer_cache);
        gqa.forward_paged(normed, cu, ids, rules, layer_params(gqa, 0), kv, attended);
        for (const SequenceId id : ids) {  // the next query, at length(id), sees no key before
          const Index start = kv.length(id) - config().window + 1;
          if (start > kv.first_position(id)) kv.forget_before(id, start);
        }
      }
      x += attended;
    }
    return last_logits(x, std::vector<Index>(cu.begin() + 1, cu.end()));
  }

  // -------------------------------------------------------------------------------------------
  // Building blocks, for running the stack's blocks under an attention schedule of one's own
  // (apex/distributed/stack.hpp runs them across the ranks of an MPI job). forward() is
  //   x = embed_tokens(tokens); for each l: x += attention of layer(l) on block_norm(l, x)
  //   with block_params(l) and mask_for_layer(l, P); logits = output_logits(x).
  // -------------------------------------------------------------------------------------------

  /// x_0 = Embed(tokens)·√d (§2.2): tokens [B, S] -> [B*S, d], row b*S + s. Checks every id.
  /// Allocates the result.
  template <class TokensDerived>
  RowMatrix<Scalar> embed_tokens(const Eigen::MatrixBase<TokensDerived>& tokens) const {
    check_constructed();
    return embedded(tokens);
  }

  /// RMSNorm(x; γ_l) (§3), block l's normalisation of its input: x [rows, d] -> out [rows, d]
  /// (out may be x). Throws unless 0 <= l < L and the shapes fit.
  void block_norm(Index l, const RowMatrix<Scalar>& x, RowRef<Scalar> out) const {
    check_block(l);
    rms_norm(x, norm_gammas_[static_cast<std::size_t>(l)], RmsNormParams{config().norm_eps}, out);
  }

  /// The parameters block l's attention layer takes: the RoPE table of its kind (local or
  /// global, YaRN's where set) and the softmax scale (YaRN's temperature where it goes to the
  /// scale), with position_offset 0: set it to the absolute position of the rows' first token.
  /// Throws unless 0 <= l < L. The table is the stack's: the result is valid while it lives.
  AttentionLayerParams<Scalar> block_params(Index l) const {
    check_block(l);
    return std::visit([&](const auto& a) { return layer_params(a, 0); },
                      layers_[static_cast<std::size_t>(l)]);
  }

  /// logits = RMSNorm(x; γ_final) · W_Eᵀ (§2.5, the tied LM head): x [rows, d] -> [rows, V], as
  /// prefill and decode_step compute them (bit-identical for any thread count). Allocates the
  /// normalised copy and the result.
  RowMatrix<Scalar> output_logits(const RowMatrix<Scalar>& x) const {
    check_constructed();
    APEX_CHECK(x.cols() == config().d_model,
               "[stack] x width (" << x.cols() << ") must be d_model = " << config().d_model);
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    rms_norm(x, final_gamma_, RmsNormParams{config().norm_eps}, RowRef<Scalar>(normed));
    return detail::matmul_transposed<Scalar>(normed, embedding_);
  }

  /// The cache memory of this stack for `batch` sequences of `context` tokens in this scalar
  /// type, or for caches storing Storage (stack_cache_memory with bytes_per_value =
  /// sizeof(Storage)): the bytes make_cache<Storage> allocates.
  template <class Storage = Scalar>
  StackCacheMemory cache_memory(Index batch, Index context) const {
    return stack_cache_memory(config(), batch, context, static_cast<Index>(sizeof(Storage)));
  }

 private:
  static const StackConfig& checked(const StackConfig& c) {
    APEX_CHECK(c.vocab_size >= 1, "[stack] vocab_size (" << c.vocab_size << ") must be >= 1");
    APEX_CHECK(c.num_layers >= 0, "[stack] num_layers (" << c.num_layers << ") must be >= 0");
    APEX_CHECK(c.window >= 1, "[stack] window W (" << c.window << ") must be >= 1");
    APEX_CHECK(c.global_every >= 1,
               "[stack] global_every F_g (" << c.global_every << ") must be >= 1");
    APEX_CHECK(c.d_model >= 1, "[stack] d_model (" << c.d_model << ") must be >= 1");
    // The [V, d] embedding table is allocated from these: its size must be representable.
    detail::checked_product({c.vocab_size, c.d_model, static_cast<Index>(sizeof(Weight))}, "stack",
                            "embedding bytes V*d*sizeof(Weight)");
    APEX_CHECK(c.local.d_model == c.d_model && c.global.d_model == c.d_model,
               "[stack] local.d_model (" << c.local.d_model << ") and global.d_model ("
                                         << c.global.d_model << ") must equal d_model ("
                                         << c.d_model << ")");
    // Every norm of every call uses it: a bad ε must fail here, not halfway through a call that
    // has already written some layers' caches.
    APEX_CHECK(std::isfinite(c.norm_eps) && c.norm_eps > 0.0,
               "[stack] norm_eps (" << c.norm_eps << ") must be positive and finite");
    detail::check_gqa_config(c.local);
    detail::check_mla_config(c.global);
    check_rope(c, layer_rope(c, false), c.local.head_dim, "");
    check_rope(c, layer_rope(c, true), c.global.rope_dim, "global_rope.");
    APEX_CHECK(!c.global_rope || c.global_rope->rope.rotary_dim == 0,
               "[stack] global_rope.rope.rotary_dim ("
                   << c.global_rope->rope.rotary_dim
                   << ") must be 0 for the global layers: their decoupled RoPE rotates all d_r "
                   << "features");
    return c;
  }

  /// The RoPE of the local or the global layers (rope.rotary_dim is the local layers' only).
  static LayerRope layer_rope(const StackConfig& c, bool global) {
    if (!global) return {c.rope, c.yarn, c.rope_scaling};
    if (c.global_rope) return *c.global_rope;
    // Returned as a prvalue, not a named local: moving a local variant makes GCC 12 warn falsely
    // (-Wmaybe-uninitialized) about the members of an alternative it does not hold.
    RopeParams whole = c.rope;
    whole.rotary_dim = 0;
    return {whole, c.yarn, c.rope_scaling};
  }

  /// One kind's RoPE: rotary_dim within the head (0: all of it, else even and at most head_dim),
  /// a positive base (RopeTable checks it), at most one scaling, and YaRN's parameters, base and
  /// reach or the other scaling's parameters. `prefix` names the field in messages.
  static void check_rope(const StackConfig& c, const LayerRope& r, Index head_dim,
                         const char* prefix) {
    APEX_CHECK(r.rope.rotary_dim == 0 || (r.rope.rotary_dim >= 2 && r.rope.rotary_dim % 2 == 0 &&
                                          r.rope.rotary_dim <= head_dim),
               "[stack] " << prefix << "rope.rotary_dim (" << r.rope.rotary_dim
                          << ") must be 0 (all) or even, in [2, " << head_dim << "]");
    check_layer_rope(r, "stack", prefix);
    if (!r.yarn) {
      const Index rotary_dim = r.rope.rotary_dim == 0 ? head_dim : r.rope.rotary_dim;
      // Checks the scaling's parameters (and allocates its d_r/2 frequencies).
      (void)scaled_rope_frequencies(rotary_dim, r.rope.base, r.scaling, c.max_positions);
      (void)scaled_rope_magnitude(r.scaling);
      return;
    }
    const double factor = yarn_attention_factor(*r.yarn);  // checks the YaRN parameters
    (void)factor;
    const double reach = r.yarn->scale * static_cast<double>(r.yarn->original_context);
    APEX_CHECK(static_cast<double>(c.max_positions) <= reach,
               "[stack] max_positions (" << c.max_positions << ") must not exceed " << prefix
                                         << "yarn.scale · original_context (" << reach << ")");
  }

  /// Layer l must be of the kind the layer rule gives it, built with the stack's config for that
  /// kind (a layer of another shape would fail only later, against its cache), with a γ of d.
  void check_layer(const StackConfig& c, Index l) const {
    const auto at = static_cast<std::size_t>(l);
    APEX_CHECK(norm_gammas_[at].size() == c.d_model,
               "[stack] gamma of layer " << l << " has length " << norm_gammas_[at].size()
                                         << ", expected d = " << c.d_model);
    const bool global = is_global_layer(l, c.global_every);
    APEX_CHECK(std::holds_alternative<Mla>(layers_[at]) == global,
               "[stack] layer " << l << " must be "
                                << (global ? "MultiHeadLatentAttention (global)"
                                           : "GroupedQueryAttention (local)"));
    if (const auto* mla = std::get_if<Mla>(&layers_[at])) {
      const MlaConfig& m = mla->config();
      const MlaConfig& e = c.global;
      APEX_CHECK(m.d_model == e.d_model && m.d_q == e.d_q && m.d_kv == e.d_kv &&
                     m.num_q_heads == e.num_q_heads && m.num_kv_heads == e.num_kv_heads &&
                     m.head_dim == e.head_dim && m.rope_dim == e.rope_dim &&
                     m.rope_key_heads() == e.rope_key_heads(),
                 "[stack] layer " << l << " (MLA: d_kv " << m.d_kv << ", H_q " << m.num_q_heads
                                  << ", H_kv " << m.num_kv_heads << ", d_h " << m.head_dim
                                  << ", d_r " << m.rope_dim
                                  << ") must have the shape of config.global (d_kv " << e.d_kv
                                  << ", H_q " << e.num_q_heads << ", H_kv " << e.num_kv_heads
                                  << ", d_h " << e.head_dim << ", d_r " << e.rope_dim << ")");
    } else {
      const GqaConfig& g = std::get<Gqa>(layers_[at]).config();
      const GqaConfig& e = c.local;
      APEX_CHECK(g.d_model == e.d_model && g.num_q_heads == e.num_q_heads &&
                     g.num_kv_heads == e.num_kv_heads && g.head_dim == e.head_dim,
                 "[stack] layer " << l << " (GQA: H_q " << g.num_q_heads << ", H_kv "
                                  << g.num_kv_heads << ", d_h " << g.head_dim
                                  << ") must have the shape of config.local (H_q " << e.num_q_heads
                                  << ", H_kv " << e.num_kv_heads << ", d_h " << e.head_dim << ")");
    }
  }

  /// Throws unless the stack is constructed and 0 <= l < L.
  void check_block(Index l) const {
    check_constructed();
    APEX_CHECK(l >= 0 && l < config().num_layers,
               "[stack] layer (" << l << ") must lie in [0, " << config().num_layers << ")");
  }

  /// Throws for an empty (default-constructed or moved-from) stack.
  void check_constructed() const {
    detail::check_constructed(config().vocab_size >= 1, "stack", "stack");
  }

  /// The RoPE table of the local (head_dim wide) or the global (d_r wide) layers.
  static RopeTable<Scalar> rope_table(const StackConfig& c, bool global) {
    const Index head_dim = global ? c.global.rope_dim : c.local.head_dim;
    return layer_rope_table<Scalar>(layer_rope(c, global), c.max_positions, head_dim);
  }

  /// YaRN's softmax-scale multiplier of the local or the global layers (1 without YaRN).
  static double softmax_multiplier(const StackConfig& c, bool global) {
    return layer_rope_softmax_multiplier(layer_rope(c, global));
  }

  const RopeTable<Scalar>* rope_for(const Gqa&) const { return &local_rope_; }
  const RopeTable<Scalar>* rope_for(const Mla&) const { return &global_rope_; }
  double multiplier_for(const Gqa&) const { return local_multiplier_; }
  double multiplier_for(const Mla&) const { return global_multiplier_; }
  /// d_qk, the width the default softmax scale 1/√d_qk of a layer refers to.
  Index qk_dim(const Gqa&) const { return config().local.head_dim; }
  Index qk_dim(const Mla&) const { return config().global.qk_dim(); }

  /// x_0 = Embed(tokens)·√d (§2.2) in Scalar, whatever Weight the table is stored in; checks
  /// every id.
  template <class TokensDerived>
  RowMatrix<Scalar> embedded(const Eigen::MatrixBase<TokensDerived>& tokens) const {
    const Index rows = detail::checked_product(tokens.rows(), tokens.cols(), "stack", "B*S");
    RowMatrix<Scalar> x(rows, config().d_model);
    embed(embedding_, tokens, EmbeddingParams{}, x);
    return x;
  }

  /// RoPE table, position and (with YaRN) softmax scale of a layer.
  template <class Attention>
  AttentionLayerParams<Scalar> layer_params(const Attention& attention,
                                            Index position_offset) const {
    AttentionLayerParams<Scalar> params;
    params.rope = rope_for(attention);
    params.position_offset = position_offset;
    const double multiplier = multiplier_for(attention);
    if (multiplier != 1.0) {
      params.attention.scale = multiplier / std::sqrt(static_cast<double>(qk_dim(attention)));
    }
    return params;
  }

  /// Throws unless `cache` has the layout make_cache gives for this stack.
  template <class Storage>
  void check_cache(const StackCache<Scalar, Storage>& cache) const {
    bool matches = cache.num_layers() == config().num_layers;
    for (Index l = 0; matches && l < config().num_layers; ++l) {
      const auto& layer_cache = cache.layer(l);
      if (is_global_layer(l, config().global_every)) {
        const auto* c = std::get_if<LatentCache<Scalar, Storage>>(&layer_cache);
        matches = c != nullptr && c->batch() == cache.batch() &&
                  c->latent_dim() == config().global.d_kv &&
                  c->rope_heads() == config().global.rope_key_heads() &&
                  c->rope_dim() == config().global.rope_dim && c->capacity() == cache.capacity() &&
                  c->next_position() == cache.next_position();
      } else {
        const auto* c = std::get_if<SlidingWindowCache<Scalar, Storage>>(&layer_cache);
        matches = c != nullptr && c->batch() == cache.batch() &&
                  c->num_kv_heads() == config().local.num_kv_heads &&
                  c->head_dim() == config().local.head_dim && c->window() == config().window &&
                  c->next_position() == cache.next_position();
      }
    }
    APEX_CHECK(matches,
               "[stack] the cache was not made by this stack's make_cache (its layers "
               "do not match the stack's "
                   << config().num_layers << " layers)");
  }

  /// The logits of rows ends[i] − 1 of the residual stream x (the last token of each sequence):
  /// the final RMSNorm and the tied LM head (§2.5), logits = h · W_Eᵀ, as lm_head computes it
  /// (detail::matmul: fixed tiles, bit-identical for any thread count). -> [ends.size(), V].
  RowMatrix<Scalar> last_logits(const RowMatrix<Scalar>& x, const std::vector<Index>& ends) const {
    RowMatrix<Scalar> last(static_cast<Index>(ends.size()), x.cols());
    for (std::size_t i = 0; i < ends.size(); ++i) last.row(Index(i)) = x.row(ends[i] - 1);
    rms_norm(last, final_gamma_, RmsNormParams{config().norm_eps}, RowRef<Scalar>(last));
    return detail::matmul_transposed<Scalar>(last, embedding_);
  }

  /// The checks of serve() that come before the pools' room, each message naming serve: the
  /// cache is this stack's, the ids are live and distinct, every sequence gets tokens in
  /// [0, V), its prefix lies inside its first call, and its positions stay below max_positions.
  /// Returns the row offsets of the sequences' tokens.
  template <class Storage>
  std::vector<Index> check_serve(const std::vector<SequenceId>& ids,
                                 const std::vector<std::vector<std::int64_t>>& tokens,
                                 const ServingCache<Scalar, Storage>& cache) const {
    check_constructed();
    bool matches = cache.num_layers() == config().num_layers;
    for (Index l = 0; matches && l < config().num_layers; ++l) {
      const bool global = is_global_layer(l, config().global_every);
      const auto& c = cache.layer(l);
      if (global) {
        const auto* latent = std::get_if<PagedLatentCache<Scalar, Storage>>(&c);
        matches = latent != nullptr && latent->latent_dim() == config().global.d_kv &&
                  latent->row_dim() == config().global.d_kv + config().global.rope_key_heads() *
                                                                  config().global.rope_dim;
      } else {
        const auto* kv = std::get_if<PagedKvCache<Scalar, Storage>>(&c);
        matches = kv != nullptr && kv->num_kv_heads() == config().local.num_kv_heads &&
                  kv->head_dim() == config().local.head_dim;
      }
    }
    APEX_CHECK(matches,
               "[serve] the serving cache was not made by this stack's "
               "make_serving_cache (its layers do not match the stack's "
                   << config().num_layers << " layers)");
    APEX_CHECK(ids.size() == tokens.size(), "[serve] ids ("
                                                << ids.size() << ") and tokens (" << tokens.size()
                                                << ") must have one entry per sequence");
    std::vector<Index> cu{0};
    detail::check_live_ids(cache, ids, "serve");
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index length = cache.length(ids[i]);
      const Index prefix = cache.prefix(ids[i]);
      const auto n = static_cast<Index>(tokens[i].size());
      APEX_CHECK(std::count(ids.begin(), ids.end(), ids[i]) == 1,
                 "[serve] sequence " << ids[i] << " appears more than once in one call");
      APEX_CHECK(n >= 1, "[serve] sequence " << ids[i] << " gets no token");
      APEX_CHECK(length >= prefix || n >= prefix,
                 "[serve] the prefix (" << prefix << ") of sequence " << ids[i]
                                        << " must lie inside its first call (" << n << " tokens)");
      APEX_CHECK(n <= config().max_positions - length,
                 "[serve] positions [" << length << ", " << length + n << ") of sequence " << ids[i]
                                       << " exceed max_positions (" << config().max_positions
                                       << ")");
      for (std::size_t t = 0; t < tokens[i].size(); ++t) {
        APEX_CHECK(tokens[i][t] >= 0 && tokens[i][t] < config().vocab_size,
                   "[serve] tokens[" << i << "][" << t << "] (" << tokens[i][t]
                                     << ") must be a token id in [0, V = " << config().vocab_size
                                     << ")");
      }
      cu.push_back(cu.back() + n);
    }
    return cu;
  }

  /// prefill / extend / decode_step: n = tokens.cols() new tokens per sequence at positions
  /// [p, p + n). Every check (the ids included, through embed) runs before the first cache is
  /// written, so that an error leaves every layer's cache as it was.
  template <class TokensDerived, class Storage>
  RowMatrix<Scalar> run_cached(const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                               const DecodeOptions& options,
                               StackCache<Scalar, Storage>& cache) const {
    check_constructed();
    check_cache(cache);
    const Index batch = tokens.rows();
    const Index n = tokens.cols();
    const Index first = cache.next_position();
    APEX_CHECK(batch == cache.batch(), "[stack] tokens batch ("
                                           << batch << ") must equal the cache's batch ("
                                           << cache.batch() << ")");
    APEX_CHECK(n >= 1,
               "[stack] tokens must hold at least one token per sequence (got " << n << ")");
    APEX_CHECK(n <= config().max_positions - first,
               "[stack] positions [" << first << ", " << first + n << ") exceed max_positions ("
                                     << config().max_positions << ")");
    APEX_CHECK(global_layers_ == 0 || n <= cache.capacity() - first,
               "[stack] positions [" << first << ", " << first + n
                                     << ") exceed the cache's capacity (" << cache.capacity()
                                     << "): a full cache does not grow by itself; reserve() a "
                                        "larger one");
    APEX_CHECK(prefix == 0 || first >= prefix || (first == 0 && n >= prefix),
               "[stack] prefix (" << prefix << ") must lie inside the first chunk");
    RowMatrix<Scalar> x = embedded(tokens);  // checks every id
    RowMatrix<Scalar> normed(x.rows(), x.cols());
    RowMatrix<Scalar> attended(x.rows(), x.cols());
    const RmsNormParams norm{config().norm_eps};
    for (Index l = 0; l < config().num_layers; ++l) {
      const auto at = static_cast<std::size_t>(l);
      rms_norm(x, norm_gammas_[at], norm, normed);
      const PositionMask rule =
          layer_mask(l, LayerMaskParams{prefix, config().window, config().global_every});
      auto& layer_cache = cache.layers_[at];
      if (const auto* mla = std::get_if<Mla>(&layers_[at])) {
        auto& latent = std::get<LatentCache<Scalar, Storage>>(layer_cache);
        const AttentionLayerParams<Scalar> params = layer_params(*mla, first);
        const MlaPath path =
            options.mla == MlaPath::kAuto ? mla_cheaper_path(config().global, n) : options.mla;
        if (path == MlaPath::kAbsorbed) {
          mla->forward_absorbed(normed, rule, params, absorbed_[at], latent, attended);
        } else {
          mla->forward_cached(normed, rule, params, latent, attended);
        }
      } else {
        const auto& gqa = std::get<Gqa>(layers_[at]);
        gqa.forward_cached(normed, rule, layer_params(gqa, first),
                           std::get<SlidingWindowCache<Scalar, Storage>>(layer_cache), attended);
      }
      x += attended;
    }
    cache.next_ = first + n;
    if (first == 0) cache.prefix_ = prefix;
    // The tied LM head (§2.5), logits = h · W_Eᵀ, as lm_head computes it (detail::matmul: spread
    // over threads in fixed tiles, bit-identical for any thread count).
    if (options.logits == LogitRows::kLast) {
      std::vector<Index> ends;
      for (Index b = 1; b <= batch; ++b) ends.push_back(b * n);
      return last_logits(x, ends);
    }
    rms_norm(x, final_gamma_, norm, normed);
    return detail::matmul_transposed<Scalar>(normed, embedding_);
  }

  detail::ResetOnMove<StackConfig> config_;  // a moved-from stack is an empty one
  RowMatrix<Weight> embedding_;
  std::vector<Vector<Scalar>> norm_gammas_;
  Vector<Scalar> final_gamma_;
  std::vector<Layer> layers_;
  RopeTable<Scalar> local_rope_;
  RopeTable<Scalar> global_rope_;
  double local_multiplier_ = 1.0;   ///< YaRN's softmax-scale multiplier (1 without YaRN)
  double global_multiplier_ = 1.0;  ///< the same for the global layers
  detail::ResetOnMove<Index> global_layers_;
  std::vector<MlaAbsorbedWeights<Weight>> absorbed_;  ///< per layer; empty for local layers
};

}  // namespace apex
