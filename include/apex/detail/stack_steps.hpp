// SPDX-License-Identifier: MIT
// The steps an AttentionStack (stack.hpp) is built from that hold no state of their own: the
// checks of its config, layers and weights (its constructor runs them), the RoPE of each kind of
// layer (StackRope), the absorbed weights and layer plan derived from the config and layers, and
// the checks of its calls (forward, and the cached calls on a StackCache). Users include
// stack.hpp.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/gqa.hpp>
#include <apex/indexer_config.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/mla.hpp>
#include <apex/rope.hpp>
#include <apex/rope_config.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/stack_cache.hpp>
#include <apex/stack_config.hpp>
#include <apex/yarn.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <variant>
#include <vector>

namespace apex::detail {

// -------------------------------------------------------------------------------------------
// The checks of an AttentionStack's config and layers (its constructor runs them), and what it
// builds from them
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
  check_stack_layer_rule(c);
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
  if (c.indexer) {
    check_indexer_config(*c.indexer);
    check_indexer_fits(c.global, *c.indexer, "stack");
  }
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

/// The RoPE of one kind of layer of a stack (local or global), built once at construction.
template <class Scalar>
struct StackRope {
  /// [max_positions, d_h] for the local layers, [max_positions, d_r] for the decoupled RoPE of
  /// the global layers (YaRN's, or another scaling's, where set).
  RopeTable<Scalar> table;
  double multiplier = 1.0;  ///< YaRN's softmax-scale multiplier (1 without YaRN)
  Index qk_dim = 0;         ///< d_qk, the width the default softmax scale 1/√d_qk refers to

  /// RoPE table, position and (with YaRN) softmax scale of a layer of this kind.
  AttentionLayerParams<Scalar> layer_params(Index position_offset) const {
    AttentionLayerParams<Scalar> params;
    params.rope = &table;
    params.position_offset = position_offset;
    if (multiplier != 1.0) {
      params.attention.scale = multiplier / std::sqrt(static_cast<double>(qk_dim));
    }
    return params;
  }
};

/// The RoPE of the local (a table head_dim wide) or the global (d_r wide) layers.
template <class Scalar>
StackRope<Scalar> stack_rope(const StackConfig& c, bool global) {
  const Index head_dim = global ? c.global.rope_dim : c.local.head_dim;
  const LayerRope rope = stack_layer_rope(c, global);
  return {layer_rope_table<Scalar>(rope, c.max_positions, head_dim),
          layer_rope_softmax_multiplier(rope), global ? c.global.qk_dim() : c.local.head_dim};
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

/// The indexers given to an AttentionStack: none without config.indexer; else one per layer,
/// of config.indexer's shape for a global layer and empty (default-constructed) for a local one.
template <class Indexer>
void check_stack_indexers(const StackConfig& c, const std::vector<Indexer>& indexers) {
  if (!c.indexer) {
    APEX_CHECK(indexers.empty(), "[stack] indexers must be empty unless config.indexer is set ("
                                     << indexers.size() << " given)");
    return;
  }
  APEX_CHECK(static_cast<Index>(indexers.size()) == c.num_layers,
             "[stack] indexers holds " << indexers.size() << " entries; expected one per layer ("
                                       << c.num_layers << ")");
  const IndexerConfig& e = *c.indexer;
  for (Index l = 0; l < c.num_layers; ++l) {
    const IndexerConfig& i = indexers[static_cast<std::size_t>(l)].config();
    const bool global = is_global_layer(l, c.global_every);
    const bool fits = global ? i == e : i.d_model == 0;
    APEX_CHECK(fits, "[stack] indexers[" << l << "] must be "
                                         << (global ? "an indexer of config.indexer's shape"
                                                    : "empty (a local layer has no indexer)"));
  }
}

/// The absorbed weights of every layer (absorb_mla_weights of each global layer, empty for a
/// local one), folded once at construction.
template <class Weight, class Gqa, class Mla>
std::vector<MlaAbsorbedWeights<Weight>> absorbed_stack_weights(
    const std::vector<std::variant<Gqa, Mla>>& layers, const MlaAbsorbParams& params) {
  std::vector<MlaAbsorbedWeights<Weight>> absorbed(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (const auto* mla = std::get_if<Mla>(&layers[l])) {
      absorbed[l] = absorb_mla_weights(*mla, params);
    }
  }
  return absorbed;
}

/// AttentionStack::plan: the kind of every layer of a (checked) config and its cache values per
/// token.
inline std::vector<LayerPlan> stack_layer_plan(const StackConfig& c) {
  std::vector<LayerPlan> rows;
  for (Index l = 0; l < c.num_layers; ++l) {
    LayerPlan row;
    row.layer = l;
    row.global = is_global_layer(l, c.global_every);
    row.cache_values_per_token =
        row.global ? mla_cache_values_per_token(c.global) + (c.indexer ? c.indexer->head_dim : 0)
                   : kv_cache_values_per_token(c.local.num_kv_heads, c.local.head_dim);
    rows.push_back(row);
  }
  return rows;
}

// -------------------------------------------------------------------------------------------
// The checks of an AttentionStack's calls
// -------------------------------------------------------------------------------------------

/// Throws for an empty (default-constructed or moved-from) stack, whose config is the default.
inline void check_stack_constructed(const StackConfig& c) {
  check_constructed(c.vocab_size >= 1, "stack", "stack");
}

/// Throws unless the stack is constructed and 0 <= l < L.
inline void check_stack_block(const StackConfig& c, Index l) {
  check_stack_constructed(c);
  APEX_CHECK(l >= 0 && l < c.num_layers,
             "[stack] layer (" << l << ") must lie in [0, " << c.num_layers << ")");
}

/// Throws unless a residual stream is `width` = d wide.
inline void check_stack_width(const StackConfig& c, Index width) {
  APEX_CHECK(width == c.d_model,
             "[stack] x width (" << width << ") must be d_model = " << c.d_model);
}

/// Throws unless the bidirectional prefix lies within the S tokens of the call.
inline void check_stack_prefix(Index prefix, Index seq) {
  APEX_CHECK(prefix >= 0 && prefix <= seq,
             "[stack] prefix (" << prefix << ") must lie in [0, S = " << seq << "]");
}

/// The checks of forward for tokens [B, S] with a prefix P (the ids are checked by embed).
inline void check_forward_tokens(const StackConfig& c, Index batch, Index seq, Index prefix) {
  APEX_CHECK(batch >= 1 && seq >= 1,
             "[stack] tokens shape [" << batch << ", " << seq << "] must be non-empty");
  check_stack_prefix(prefix, seq);
  APEX_CHECK(seq <= c.max_positions, "[stack] sequence length ("
                                         << seq << ") exceeds max_positions (" << c.max_positions
                                         << ")");
}

/// The checks prefill adds to extend's: an empty cache and a prefix within the prompt of S
/// tokens.
template <class Scalar, class Storage, class Global>
void check_prefill(const StackCache<Scalar, Storage, Global>& cache, Index prefix, Index seq) {
  APEX_CHECK(cache.next_position() == 0,
             "[stack] prefill needs an empty cache (its next position is "
                 << cache.next_position() << "): use extend() to continue a sequence, or clear()");
  check_stack_prefix(prefix, seq);
}

/// Throws unless `cache` has the layout AttentionStack::make_cache gives for a stack of `config`.
template <class Scalar, class Storage, class Global>
void check_stack_cache(const StackConfig& config,
                       const StackCache<Scalar, Storage, Global>& cache) {
  bool matches = cache.num_layers() == config.num_layers;
  for (Index l = 0; matches && l < config.num_layers; ++l) {
    const auto& layer_cache = cache.layer(l);
    if (is_global_layer(l, config.global_every)) {
      const auto* c = std::get_if<LatentCache<Scalar, Global>>(&layer_cache);
      const auto& keys = cache.indexer_keys(l);
      matches = c != nullptr && c->batch() == cache.batch() &&
                c->latent_dim() == config.global.d_kv &&
                c->rope_heads() == config.global.rope_key_heads() &&
                c->rope_dim() == config.global.rope_dim && c->capacity() == cache.capacity() &&
                c->next_position() == cache.next_position() &&
                keys.head_dim() == (config.indexer ? config.indexer->head_dim : 0) &&
                (!config.indexer ||
                 (keys.batch() == cache.batch() && keys.capacity() == cache.capacity() &&
                  keys.next_position() == cache.next_position()));
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
template <class TokensDerived, class Scalar, class Storage, class Global>
void check_cached_call(const StackConfig& config, bool has_global_layers,
                       const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                       const StackCache<Scalar, Storage, Global>& cache) {
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

}  // namespace apex::detail
