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
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/rope_config.hpp>
#include <apex/serving_cache.hpp>
#include <apex/stack_serving.hpp>
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

namespace detail {
struct StackCacheAccess;  // the cached calls of AttentionStack, below StackCache
}  // namespace detail

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
  friend struct detail::StackCacheAccess;

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

namespace detail {

// -------------------------------------------------------------------------------------------
// The checks of an AttentionStack's config and layers (its constructor runs them)
// -------------------------------------------------------------------------------------------

/// The RoPE of the local or the global layers (rope.rotary_dim is the local layers' only).
inline LayerRope stack_layer_rope(const StackConfig& c, bool global) {
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
inline void check_stack_rope(const StackConfig& c, const LayerRope& r, Index head_dim,
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

/// Every field of an AttentionStack's config, for a stack whose weights are stored as Weight.
template <class Weight>
const StackConfig& checked_stack_config(const StackConfig& c) {
  APEX_CHECK(c.vocab_size >= 1, "[stack] vocab_size (" << c.vocab_size << ") must be >= 1");
  APEX_CHECK(c.num_layers >= 0, "[stack] num_layers (" << c.num_layers << ") must be >= 0");
  APEX_CHECK(c.window >= 1, "[stack] window W (" << c.window << ") must be >= 1");
  APEX_CHECK(c.global_every >= 1,
             "[stack] global_every F_g (" << c.global_every << ") must be >= 1");
  APEX_CHECK(c.d_model >= 1, "[stack] d_model (" << c.d_model << ") must be >= 1");
  // The [V, d] embedding table is allocated from these: its size must be representable.
  checked_product({c.vocab_size, c.d_model, static_cast<Index>(sizeof(Weight))}, "stack",
                  "embedding bytes V*d*sizeof(Weight)");
  APEX_CHECK(c.local.d_model == c.d_model && c.global.d_model == c.d_model,
             "[stack] local.d_model (" << c.local.d_model << ") and global.d_model ("
                                       << c.global.d_model << ") must equal d_model (" << c.d_model
                                       << ")");
  // Every norm of every call uses it: a bad ε must fail here, not halfway through a call that
  // has already written some layers' caches.
  APEX_CHECK(std::isfinite(c.norm_eps) && c.norm_eps > 0.0,
             "[stack] norm_eps (" << c.norm_eps << ") must be positive and finite");
  check_gqa_config(c.local);
  check_mla_config(c.global);
  check_stack_rope(c, stack_layer_rope(c, false), c.local.head_dim, "");
  check_stack_rope(c, stack_layer_rope(c, true), c.global.rope_dim, "global_rope.");
  APEX_CHECK(!c.global_rope || c.global_rope->rope.rotary_dim == 0,
             "[stack] global_rope.rope.rotary_dim ("
                 << c.global_rope->rope.rotary_dim
                 << ") must be 0 for the global layers: their decoupled RoPE rotates all d_r "
                 << "features");
  return c;
}

/// Layer l must be of the kind the layer rule gives it, built with the stack's config for that
/// kind (a layer of another shape would fail only later, against its cache), with a γ of d.
template <class Scalar, class Weight>
void check_stack_layer(const StackConfig& c, Index l, const Vector<Scalar>& gamma,
                       const std::variant<GroupedQueryAttention<Scalar, Weight>,
                                          MultiHeadLatentAttention<Scalar, Weight>>& layer) {
  using Gqa = GroupedQueryAttention<Scalar, Weight>;
  using Mla = MultiHeadLatentAttention<Scalar, Weight>;
  APEX_CHECK(gamma.size() == c.d_model, "[stack] gamma of layer "
                                            << l << " has length " << gamma.size()
                                            << ", expected d = " << c.d_model);
  const bool global = is_global_layer(l, c.global_every);
  APEX_CHECK(std::holds_alternative<Mla>(layer) == global,
             "[stack] layer " << l << " must be "
                              << (global ? "MultiHeadLatentAttention (global)"
                                         : "GroupedQueryAttention (local)"));
  if (const auto* mla = std::get_if<Mla>(&layer)) {
    const MlaConfig& m = mla->config();
    const MlaConfig& e = c.global;
    APEX_CHECK(m.d_model == e.d_model && m.d_q == e.d_q && m.d_kv == e.d_kv &&
                   m.num_q_heads == e.num_q_heads && m.num_kv_heads == e.num_kv_heads &&
                   m.head_dim == e.head_dim && m.rope_dim == e.rope_dim &&
                   m.rope_key_heads() == e.rope_key_heads(),
               "[stack] layer " << l << " (MLA: d_kv " << m.d_kv << ", H_q " << m.num_q_heads
                                << ", H_kv " << m.num_kv_heads << ", d_h " << m.head_dim << ", d_r "
                                << m.rope_dim << ") must have the shape of config.global (d_kv "
                                << e.d_kv << ", H_q " << e.num_q_heads << ", H_kv "
                                << e.num_kv_heads << ", d_h " << e.head_dim << ", d_r "
                                << e.rope_dim << ")");
  } else {
    const GqaConfig& g = std::get<Gqa>(layer).config();
    const GqaConfig& e = c.local;
    APEX_CHECK(g.d_model == e.d_model && g.num_q_heads == e.num_q_heads &&
                   g.num_kv_heads == e.num_kv_heads && g.head_dim == e.head_dim,
               "[stack] layer " << l << " (GQA: H_q " << g.num_q_heads << ", H_kv "
                                << g.num_kv_heads << ", d_h " << g.head_dim
                                << ") must have the shape of config.local (H_q " << e.num_q_heads
                                << ", H_kv " << e.num_kv_heads << ", d_h " << e.head_dim << ")");
  }
}

/// The RoPE table of the local (head_dim wide) or the global (d_r wide) layers.
template <class Scalar>
RopeTable<Scalar> stack_rope_table(const StackConfig& c, bool global) {
  const Index head_dim = global ? c.global.rope_dim : c.local.head_dim;
  return layer_rope_table<Scalar>(stack_layer_rope(c, global), c.max_positions, head_dim);
}

/// YaRN's softmax-scale multiplier of the local or the global layers (1 without YaRN).
inline double stack_softmax_multiplier(const StackConfig& c, bool global) {
  return layer_rope_softmax_multiplier(stack_layer_rope(c, global));
}

/// The weights given to an AttentionStack: the [V, d] table, one γ of d and one layer (of its
/// kind and shape, check_stack_layer) per block, and the final γ of d.
template <class Scalar, class Weight, class Layer>
void check_stack_weights(const StackConfig& config, const RowMatrix<Weight>& embedding,
                         const std::vector<Vector<Scalar>>& norm_gammas,
                         const Vector<Scalar>& final_gamma, const std::vector<Layer>& layers) {
  const Index d = config.d_model;
  APEX_CHECK(embedding.rows() == config.vocab_size && embedding.cols() == d,
             "[stack] embedding shape [" << embedding.rows() << ", " << embedding.cols()
                                         << "] must be [V, d] = [" << config.vocab_size << ", " << d
                                         << "]");
  APEX_CHECK(static_cast<Index>(layers.size()) == config.num_layers &&
                 static_cast<Index>(norm_gammas.size()) == config.num_layers,
             "[stack] " << layers.size() << " layers and " << norm_gammas.size()
                        << " norm gammas given; num_layers is " << config.num_layers);
  for (Index l = 0; l < config.num_layers; ++l) {
    const auto at = static_cast<std::size_t>(l);
    check_stack_layer(config, l, norm_gammas[at], layers[at]);
  }
  APEX_CHECK(final_gamma.size() == d,
             "[stack] final gamma length (" << final_gamma.size() << ") must be d = " << d);
}

// -------------------------------------------------------------------------------------------
// The cached calls (AttentionStack::prefill / extend / decode_step): the stack's block loop
// (AttentionStack::run_blocks) with each layer's attention on its cache in a StackCache
// -------------------------------------------------------------------------------------------

/// Throws unless `cache` has the layout AttentionStack::make_cache gives for a stack of `config`.
template <class Scalar, class Storage>
void check_stack_cache(const StackConfig& config, const StackCache<Scalar, Storage>& cache) {
  bool matches = cache.num_layers() == config.num_layers;
  for (Index l = 0; matches && l < config.num_layers; ++l) {
    const auto& layer_cache = cache.layer(l);
    if (is_global_layer(l, config.global_every)) {
      const auto* c = std::get_if<LatentCache<Scalar, Storage>>(&layer_cache);
      matches = c != nullptr && c->batch() == cache.batch() &&
                c->latent_dim() == config.global.d_kv &&
                c->rope_heads() == config.global.rope_key_heads() &&
                c->rope_dim() == config.global.rope_dim && c->capacity() == cache.capacity() &&
                c->next_position() == cache.next_position();
    } else {
      const auto* c = std::get_if<SlidingWindowCache<Scalar, Storage>>(&layer_cache);
      matches = c != nullptr && c->batch() == cache.batch() &&
                c->num_kv_heads() == config.local.num_kv_heads &&
                c->head_dim() == config.local.head_dim && c->window() == config.window &&
                c->next_position() == cache.next_position();
    }
  }
  APEX_CHECK(matches,
             "[stack] the cache was not made by this stack's make_cache (its layers "
             "do not match the stack's "
                 << config.num_layers << " layers)");
}

/// The checks of prefill / extend / decode_step for n = tokens.cols() new tokens per sequence
/// at positions [p, p + n), p = cache.next_position(): the cache, the batch, n,
/// max_positions, the cache's capacity and the prefix (the ids are checked by embed).
template <class TokensDerived, class Scalar, class Storage>
void check_cached_call(const StackConfig& config, bool has_global_layers,
                       const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                       const StackCache<Scalar, Storage>& cache) {
  check_stack_cache(config, cache);
  const Index batch = tokens.rows();
  const Index n = tokens.cols();
  const Index first = cache.next_position();
  APEX_CHECK(batch == cache.batch(), "[stack] tokens batch (" << batch
                                                              << ") must equal the cache's batch ("
                                                              << cache.batch() << ")");
  APEX_CHECK(n >= 1, "[stack] tokens must hold at least one token per sequence (got " << n << ")");
  APEX_CHECK(n <= config.max_positions - first,
             "[stack] positions [" << first << ", " << first + n << ") exceed max_positions ("
                                   << config.max_positions << ")");
  APEX_CHECK(!has_global_layers || n <= cache.capacity() - first,
             "[stack] positions [" << first << ", " << first + n
                                   << ") exceed the cache's capacity (" << cache.capacity()
                                   << "): a full cache does not grow by itself; reserve() a "
                                      "larger one");
  APEX_CHECK(prefix == 0 || first >= prefix || (first == 0 && n >= prefix),
             "[stack] prefix (" << prefix << ") must lie inside the first chunk");
}

/// The one door into a StackCache's layers and position: only the cached calls below make a
/// cache and advance it.
struct StackCacheAccess {
  template <class Scalar, class Storage>
  static StackCache<Scalar, Storage> make(
      Index batch, Index capacity,
      std::vector<typename StackCache<Scalar, Storage>::LayerCache> layers) {
    return StackCache<Scalar, Storage>(batch, capacity, std::move(layers));
  }
  template <class Scalar, class Storage>
  static typename StackCache<Scalar, Storage>::LayerCache& layer(StackCache<Scalar, Storage>& cache,
                                                                 Index l) {
    return cache.layers_[static_cast<std::size_t>(l)];
  }
  /// After n tokens from position `first`: the next position, and the prefix of a first call.
  template <class Scalar, class Storage>
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (first, n, prefix) positions
  static void advance(StackCache<Scalar, Storage>& cache, Index first, Index n, Index prefix) {
    cache.next_ = first + n;
    if (first == 0) cache.prefix_ = prefix;
  }
};

/// AttentionStack::make_cache: a SlidingWindowCache of W tokens per local layer and a
/// LatentCache of `capacity` tokens per global layer, storing Storage.
template <class Storage, class Scalar, class Weight>
StackCache<Scalar, Storage> make_stack_cache(const AttentionStack<Scalar, Weight>& stack,
                                             Index batch, Index capacity) {
  using Stack = AttentionStack<Scalar, Weight>;
  const auto& config = stack.config();
  check_constructed(config.vocab_size >= 1, "stack", "stack");
  APEX_CHECK(batch >= 1, "[stack] batch (" << batch << ") must be >= 1");
  APEX_CHECK(capacity >= 1 && capacity <= config.max_positions,
             "[stack] capacity (" << capacity << ") must lie in [1, max_positions = "
                                  << config.max_positions << "]");
  std::vector<typename StackCache<Scalar, Storage>::LayerCache> caches;
  caches.reserve(static_cast<std::size_t>(config.num_layers));
  for (Index l = 0; l < config.num_layers; ++l) {
    if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
      caches.emplace_back(mla->template make_cache<Storage>(batch, capacity));
    } else {
      caches.emplace_back(std::get<typename Stack::Gqa>(stack.layer(l))
                              .template make_window_cache<Storage>(batch, config.window));
    }
  }
  return StackCacheAccess::make<Scalar, Storage>(batch, capacity, std::move(caches));
}

/// One layer of the cached calls: attended [B*n, d] = Attention_l(normed [B*n, d]) under layer
/// l's mask for the prefix, at positions from cache.next_position(), appending the rows' K/V (or
/// latents) to the layer's cache. The global layers take the MLA path options.mla names (kAuto:
/// the cheaper one for n).
template <class Scalar, class Weight, class Storage>
void cached_layer(const AttentionStack<Scalar, Weight>& stack, Index l,
                  const RowMatrix<Scalar>& normed, Index prefix, const DecodeOptions& options,
                  StackCache<Scalar, Storage>& cache, RowMatrix<Scalar>& attended) {
  using Stack = AttentionStack<Scalar, Weight>;
  const auto& config = stack.config();
  const PositionMask mask =
      layer_mask(l, LayerMaskParams{prefix, config.window, config.global_every});
  AttentionLayerParams<Scalar> params = stack.block_params(l);
  params.position_offset = cache.next_position();
  auto& layer_cache = StackCacheAccess::layer(cache, l);
  if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
    auto& latent = std::get<LatentCache<Scalar, Storage>>(layer_cache);
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
template <class TokensDerived, class Scalar, class Weight, class Storage>
RowMatrix<Scalar> run_cached(const AttentionStack<Scalar, Weight>& stack,
                             const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                             const DecodeOptions& options, StackCache<Scalar, Storage>& cache) {
  const auto& config = stack.config();
  check_constructed(config.vocab_size >= 1, "stack", "stack");
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

  /// An empty stack (as a moved-from one is): no layers, no weights; every call throws
  /// std::invalid_argument.
  AttentionStack() = default;
  /// Takes ownership of the weights; throws if the config is inconsistent (every field is
  /// checked), if layers[l] is not of the kind the layer rule gives layer l or not of the shape
  /// the config gives that kind, or if any γ or the table has the wrong shape.
  AttentionStack(const StackConfig& config, RowMatrix<Weight> embedding,
                 std::vector<Vector<Scalar>> norm_gammas, Vector<Scalar> final_gamma,
                 std::vector<Layer> layers)
      : config_(detail::checked_stack_config<Weight>(config)),
        embedding_(std::move(embedding)),
        norm_gammas_(std::move(norm_gammas)),
        final_gamma_(std::move(final_gamma)),
        layers_(std::move(layers)),
        local_rope_(detail::stack_rope_table<Scalar>(config, false)),
        global_rope_(detail::stack_rope_table<Scalar>(config, true)),
        local_multiplier_(detail::stack_softmax_multiplier(config, false)),
        global_multiplier_(detail::stack_softmax_multiplier(config, true)) {
    detail::check_stack_weights(config, embedding_, norm_gammas_, final_gamma_, layers_);
    absorbed_.resize(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (const auto* mla = std::get_if<Mla>(&layers_[l])) {
        absorbed_[l] = absorb_mla_weights(*mla, config.absorb);
      }
    }
  }

  /// A stack with random weights for examples and tests: embedding entries N(0, 0.02²) (§2.3),
  /// every γ = 1 (§3.2), attention layers from their own random() with seeds derived from `seed`
  /// (every weight drawn in double and rounded once to Weight).
  static AttentionStack random(const StackConfig& config, std::uint64_t seed) {
    detail::checked_stack_config<Weight>(config);
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
  /// Allocates the [B*S, d] residual stream, the block loop's two [B*S, d] buffers (run_blocks),
  /// what each layer's forward allocates, and the logits.
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
    run_blocks(x, [&](Index l, const Layer& layer, const RowMatrix<Scalar>& normed,
                      RowMatrix<Scalar>& attended) {
      const AttentionMask<Scalar> mask = mask_for_layer(l, prefix);
      std::visit(
          [&](const auto& attention) {
            attended = attention.forward(normed, batch, mask, layer_params(attention, 0));
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
  /// `capacity` tokens per global layer, every one storing Storage (Scalar by default;
  /// stack.make_cache<Eigen::bfloat16>(batch, capacity) for 16-bit caches). Allocates
  /// stack_cache_memory(config, batch, capacity, sizeof(Storage)).total_bytes.
  template <class Storage = Scalar>
  StackCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    return detail::make_stack_cache<Storage>(*this, batch, capacity);
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
    return detail::run_cached(*this, tokens, prefix, options, cache);
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
    return detail::run_cached(*this, tokens, cache.prefix(), options, cache);
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
    return detail::run_cached(*this, column, cache.prefix(), options, cache);
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

  /// make_serving_cache(*this, shape) (stack_serving.hpp): an empty ServingCache of this stack's
  /// paged caches, storing Storage.
  template <class Storage = Scalar>
  ServingCache<Scalar, Storage> make_serving_cache(const ServingCacheShape& shape) const {
    return apex::make_serving_cache<Storage>(*this, shape);
  }

  /// serve(*this, ids, tokens, cache) (stack_serving.hpp): one pass of many sequences of a
  /// ServingCache through the stack -> logits [N, V] of each sequence's last token.
  template <class Storage>
  RowMatrix<Scalar> serve(const std::vector<SequenceId>& ids,
                          const std::vector<std::vector<std::int64_t>>& tokens,
                          ServingCache<Scalar, Storage>& cache) const {
    return apex::serve(*this, ids, tokens, cache);
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
    check_constructed();
    APEX_CHECK(x.cols() == config().d_model,
               "[stack] x width (" << x.cols() << ") must be d_model = " << config().d_model);
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
  /// type, or for caches storing Storage (stack_cache_memory with bytes_per_value =
  /// sizeof(Storage)): the bytes make_cache<Storage> allocates.
  template <class Storage = Scalar>
  StackCacheMemory cache_memory(Index batch, Index context) const {
    return stack_cache_memory(config(), batch, context, static_cast<Index>(sizeof(Storage)));
  }

 private:
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

  detail::ResetOnMove<StackConfig> config_;  // a moved-from stack is an empty one
  RowMatrix<Weight> embedding_;
  std::vector<Vector<Scalar>> norm_gammas_;
  Vector<Scalar> final_gamma_;
  std::vector<Layer> layers_;
  RopeTable<Scalar> local_rope_;
  RopeTable<Scalar> global_rope_;
  double local_multiplier_ = 1.0;   ///< YaRN's softmax-scale multiplier (1 without YaRN)
  double global_multiplier_ = 1.0;  ///< the same for the global layers
  std::vector<MlaAbsorbedWeights<Weight>> absorbed_;  ///< per layer; empty for local layers
};

}  // namespace apex
