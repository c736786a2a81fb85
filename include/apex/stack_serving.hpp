// SPDX-License-Identifier: MIT
// Serving many sequences through an AttentionStack (continuous batching), beside the ServingCache
// it advances: make_serving_cache builds the paged caches of every layer, serve runs one pass of
// N sequences (T tokens in all, prompts and single tokens mixed) through the stack's block loop
// (AttentionStack::run_blocks), each layer's attention one paged call over all of their rows:
//
//   x_0     = Embed(tokens_0 ‖ … ‖ tokens_{N−1})·√d                                    [T, d]
//   x_{l+1} = x_l + Attention_l(RMSNorm(x_l; γ_l); layer_mask(l, P_i) for sequence i)  paged
//   logits  = RMSNorm(x_L[last row of each sequence]; γ_final) · W_Eᵀ                  [N, V]
//
// The global layers take the absorbed MLA path (exact for any chunk; sparse ones, with
// StackConfig::indexer, over each row's selection: sparse_mla.hpp); the local layers give back
// the pages that their window has passed. AttentionStack::make_serving_cache and
// AttentionStack::serve are these functions.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/config.hpp>
#include <apex/embedding.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/serving_cache.hpp>
#include <apex/sparse_mla.hpp>
#include <apex/stack_config.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

template <class Scalar, class Weight>
class AttentionStack;

namespace detail {

/// The one door into a ServingCache's layers: only this header builds a cache and writes it.
struct ServingCacheAccess {
  template <class Cache>
  static Cache make(std::vector<typename Cache::LayerCache> layers,
                    std::vector<typename Cache::KeyCache> keys) {
    return Cache(std::move(layers), std::move(keys));
  }
  template <class Cache>
  static typename Cache::LayerCache& layer(Cache& cache, Index l) {
    return cache.layers_[static_cast<std::size_t>(l)];
  }
  template <class Cache>
  static typename Cache::KeyCache& indexer_keys(Cache& cache, Index l) {
    return cache.keys_[static_cast<std::size_t>(l)];
  }
  /// The verified drafts awaiting accept (stack_speculative.hpp).
  template <class Cache>
  static auto& drafts(Cache& cache) {
    return cache.drafts_;
  }
};

/// Throws unless `cache` has the layers make_serving_cache gives `stack` (message naming `op`).
template <class Scalar, class Weight, class Storage, class Global>
void check_serving_layers(const AttentionStack<Scalar, Weight>& stack,
                          const ServingCache<Scalar, Storage, Global>& cache, const char* op) {
  const auto& config = stack.config();
  bool matches = cache.num_layers() == config.num_layers;
  for (Index l = 0; matches && l < config.num_layers; ++l) {
    const auto& c = cache.layer(l);
    const Index d_i =
        config.indexer && is_global_layer(l, config.global_every) ? config.indexer->head_dim : 0;
    if (is_global_layer(l, config.global_every)) {
      const auto* latent = std::get_if<PagedLatentCache<Scalar, Global>>(&c);
      matches = latent != nullptr && latent->latent_dim() == config.global.d_kv &&
                latent->row_dim() ==
                    config.global.d_kv + config.global.rope_key_heads() * config.global.rope_dim &&
                cache.indexer_keys(l).head_dim() == d_i;
    } else {
      const auto* kv = std::get_if<PagedKvCache<Scalar, Storage>>(&c);
      matches = kv != nullptr && kv->num_kv_heads() == config.local.num_kv_heads &&
                kv->head_dim() == config.local.head_dim;
    }
  }
  APEX_CHECK(matches, "[" << op
                          << "] the serving cache was not made by this stack's "
                             "make_serving_cache (its layers do not match the stack's "
                          << config.num_layers << " layers)");
}

/// The checks of serve() that come before the pools' room, each message naming `op`: the cache
/// is the stack's, the ids are live, distinct and hold no draft awaiting accept, every sequence
/// gets tokens in [0, V), its prefix lies inside its first call, and its positions stay below
/// max_positions. Returns the
/// row offsets cu of the sequences' tokens ([N + 1], cu[0] = 0, cu[N] = T).
template <class Scalar, class Weight, class Storage, class Global>
std::vector<Index> check_serve(const AttentionStack<Scalar, Weight>& stack,
                               const std::vector<SequenceId>& ids,
                               const std::vector<std::vector<std::int64_t>>& tokens,
                               const ServingCache<Scalar, Storage, Global>& cache,
                               const char* op = "serve") {
  const auto& config = stack.config();
  check_constructed(config.vocab_size >= 1, "stack", "stack");
  check_serving_layers(stack, cache, op);
  APEX_CHECK(ids.size() == tokens.size(), "[" << op << "] ids (" << ids.size() << ") and tokens ("
                                              << tokens.size()
                                              << ") must have one entry per sequence");
  std::vector<Index> cu{0};
  check_live_ids(cache, ids, op);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const Index length = cache.length(ids[i]);
    const Index prefix = cache.prefix(ids[i]);
    const auto n = static_cast<Index>(tokens[i].size());
    APEX_CHECK(std::count(ids.begin(), ids.end(), ids[i]) == 1,
               "[" << op << "] sequence " << ids[i] << " appears more than once in one call");
    APEX_CHECK(!cache.verifying(ids[i]), "[" << op << "] sequence " << ids[i]
                                             << " holds a verified draft: accept_drafts first");
    APEX_CHECK(n >= 1, "[" << op << "] sequence " << ids[i] << " gets no token");
    APEX_CHECK(length >= prefix || n >= prefix,
               "[" << op << "] the prefix (" << prefix << ") of sequence " << ids[i]
                   << " must lie inside its first call (" << n << " tokens)");
    APEX_CHECK(n <= config.max_positions - length,
               "[" << op << "] positions [" << length << ", " << length + n << ") of sequence "
                   << ids[i] << " exceed max_positions (" << config.max_positions << ")");
    for (std::size_t t = 0; t < tokens[i].size(); ++t) {
      APEX_CHECK(tokens[i][t] >= 0 && tokens[i][t] < config.vocab_size,
                 "[" << op << "] tokens[" << i << "][" << t << "] (" << tokens[i][t]
                     << ") must be a token id in [0, V = " << config.vocab_size << ")");
    }
    cu.push_back(cu.back() + n);
  }
  return cu;
}

/// The sequences' tokens one after another, [1, T]: tokens[i] at columns [cu[i], cu[i + 1]).
inline TokenMatrix packed_tokens(const std::vector<std::vector<std::int64_t>>& tokens,
                                 const std::vector<Index>& cu) {
  TokenMatrix flat(1, cu.back());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    std::copy(tokens[i].begin(), tokens[i].end(), flat.data() + cu[i]);
  }
  return flat;
}

/// Throws unless every layer's pool has room for the new tokens of every sequence.
template <class Scalar, class Storage, class Global>
void check_serve_room(const std::vector<SequenceId>& ids, const std::vector<Index>& cu,
                      const ServingCache<Scalar, Storage, Global>& cache,
                      const char* op = "serve") {
  std::vector<std::pair<SequenceId, Index>> appends;
  for (std::size_t i = 0; i < ids.size(); ++i) appends.emplace_back(ids[i], cu[i + 1] - cu[i]);
  for (Index l = 0; l < cache.num_layers(); ++l) {
    std::visit([&](const auto& c) { c.check_appends(appends, op); }, cache.layer(l));
    if (cache.indexer_keys(l).head_dim() >= 1) cache.indexer_keys(l).check_appends(appends, op);
  }
}

/// One layer's attention over its paged cache for the rows of `ids` (rows [cu[i], cu[i + 1])
/// of normed [T, d] are sequence ids[i]'s): the GQA layer's forward_paged or the MLA layer's
/// absorbed one, under masks and params -> attended [T, d].
template <class Scalar, class Weight, class Storage, class Global>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, a layer's step
void paged_layer_step(const AttentionStack<Scalar, Weight>& stack, Index l,
                      const RowMatrix<Scalar>& normed, const std::vector<Index>& cu,
                      const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                      const AttentionLayerParams<Scalar>& params,
                      ServingCache<Scalar, Storage, Global>& cache, RowMatrix<Scalar>& attended) {
  using Stack = AttentionStack<Scalar, Weight>;
  auto& layer_cache = ServingCacheAccess::layer(cache, l);
  if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
    auto& latent = std::get<PagedLatentCache<Scalar, Global>>(layer_cache);
    if (stack.sparse()) {
      std::vector<Index> prefixes(masks.size());
      for (std::size_t i = 0; i < masks.size(); ++i) prefixes[i] = masks[i].prefix;
      sparse_mla_paged_step(stack.sparse_parts(l), ConstRowRef<Scalar>(normed), cu, ids, prefixes,
                            params, latent, ServingCacheAccess::indexer_keys(cache, l),
                            RowRef<Scalar>(attended));
      return;
    }
    mla->forward_paged(normed, cu, ids, masks, params, stack.absorbed_weights(l), latent, attended);
    return;
  }
  std::get<typename Stack::Gqa>(stack.layer(l))
      .forward_paged(normed, cu, ids, masks, params,
                     std::get<PagedKvCache<Scalar, Storage>>(layer_cache), attended);
}

/// Gives back the pages of a local layer's cache that sequence id's next query no longer sees
/// (the window of W ends at its next position).
template <class Cache>
void forget_past_window(Cache& cache, SequenceId id, const StackConfig& config) {
  const Index start = cache.length(id) - config.window + 1;
  if (start > cache.first_position(id)) cache.forget_before(id, start);
}

/// One layer of serve(): attended [T, d] = Attention_l(normed [T, d]) over the layer's paged
/// cache, each sequence under its own mask, pages shared by several read once; a local layer
/// then frees the pages its window left.
template <class Scalar, class Weight, class Storage, class Global>
void serve_layer(const AttentionStack<Scalar, Weight>& stack, Index l,
                 const RowMatrix<Scalar>& normed, const std::vector<Index>& cu,
                 const std::vector<SequenceId>& ids, ServingCache<Scalar, Storage, Global>& cache,
                 RowMatrix<Scalar>& attended) {
  const auto& config = stack.config();
  std::vector<PositionMask> masks;
  masks.reserve(ids.size());
  for (const SequenceId id : ids) {
    masks.push_back(
        layer_mask(l, LayerMaskParams{cache.prefix(id), config.window, config.global_every}));
  }
  AttentionLayerParams<Scalar> params = stack.block_params(l);
  params.read_shared_pages_once = true;  // forks of one prompt read its pages once a layer
  paged_layer_step(stack, l, normed, cu, ids, masks, params, cache, attended);
  if (is_global_layer(l, config.global_every)) return;
  auto& kv = std::get<PagedKvCache<Scalar, Storage>>(ServingCacheAccess::layer(cache, l));
  for (const SequenceId id : ids) forget_past_window(kv, id, config);
}

}  // namespace detail

/// An empty ServingCache for `stack`: a PagedKvCache of shape.local_pages pages for each local
/// layer and a PagedLatentCache of shape.global_pages pages for each global layer, pages of
/// shape.page_size tokens, the local ones storing Storage (void: the stack's Scalar) and the
/// global ones Global (void: as the local ones). Throws unless the pools of the layers the stack
/// has are >= 1 page of >= 1 token, and where a layer's widths are not whole elements of its
/// format (kv_format.hpp). A stack with sparse global layers gets, per global layer, a
/// PagedIndexerKeyCache of shape.global_pages pages beside the latent one. Allocates the pools.
template <class Storage = void, class Global = void, class Scalar, class Weight>
auto make_serving_cache(const AttentionStack<Scalar, Weight>& stack,
                        const ServingCacheShape& shape) {
  using Stored = std::conditional_t<std::is_void_v<Storage>, Scalar, Storage>;
  using Latent = std::conditional_t<std::is_void_v<Global>, Stored, Global>;
  using Cache = ServingCache<Scalar, Stored, Latent>;
  using Stack = AttentionStack<Scalar, Weight>;
  detail::check_constructed(stack.config().vocab_size >= 1, "stack", "stack");
  std::vector<typename Cache::LayerCache> caches;
  std::vector<typename Cache::KeyCache> keys(static_cast<std::size_t>(stack.config().num_layers));
  caches.reserve(static_cast<std::size_t>(stack.config().num_layers));
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    if (const auto* mla = std::get_if<typename Stack::Mla>(&stack.layer(l))) {
      const auto& c = mla->config();
      caches.emplace_back(PagedLatentCache<Scalar, Latent>(
          {c.d_kv, c.rope_key_heads(), c.rope_dim, shape.page_size, shape.global_pages}));
      if (stack.sparse()) {
        keys[static_cast<std::size_t>(l)] = typename Cache::KeyCache(
            stack.config().indexer->head_dim, shape.page_size, shape.global_pages);
      }
    } else {
      const auto& c = std::get<typename Stack::Gqa>(stack.layer(l)).config();
      caches.emplace_back(PagedKvCache<Scalar, Stored>(
          {c.num_kv_heads, c.head_dim, shape.page_size, shape.local_pages}));
    }
  }
  return detail::ServingCacheAccess::make<Cache>(std::move(caches), std::move(keys));
}

/// One pass of many sequences of a ServingCache through the stack (continuous batching):
/// tokens[i] are the next tokens of sequence ids[i], at positions cache.length(ids[i]) + s — its
/// prompt in its first call (the prefix it was added with must lie inside it), then one token per
/// step, or any chunk — and every sequence follows the APEX-1 rules of its own prefix (§11.1).
/// Prompts and single tokens of different sequences may share one call: their rows go through
/// every projection together, and each layer's attention is one sdpa_cascade call over all of them
/// (cascade_attention.hpp: pages that several of them share, forks of one prompt, are read once).
///   ids: N distinct live sequences; tokens: N non-empty lists of ids in [0, V)
///   -> logits [N, V], row i for the last token of ids[i]: what prefill / extend / decode_step of
///   that sequence alone return for it (to the rounding of the other path).
/// Every check runs before any cache is written (live and distinct ids, token ids, the prefix,
/// max_positions, room in every layer's pool): on error nothing changes. Allocates the [T, d]
/// residual stream (T tokens in all), the block loop's two [T, d] buffers and what each layer's
/// forward_paged allocates.
template <class Scalar, class Weight, class Storage, class Global>
RowMatrix<Scalar> serve(const AttentionStack<Scalar, Weight>& stack,
                        const std::vector<SequenceId>& ids,
                        const std::vector<std::vector<std::int64_t>>& tokens,
                        ServingCache<Scalar, Storage, Global>& cache) {
  const std::vector<Index> cu = detail::check_serve(stack, ids, tokens, cache);
  detail::check_serve_room(ids, cu, cache);
  RowMatrix<Scalar> x = stack.embed_tokens(detail::packed_tokens(tokens, cu));
  stack.run_blocks(
      x, [&](Index l, const auto&, const RowMatrix<Scalar>& normed, RowMatrix<Scalar>& attended) {
        detail::serve_layer(stack, l, normed, cu, ids, cache, attended);
      });
  return stack.last_logits(x, std::vector<Index>(cu.begin() + 1, cu.end()));
}

}  // namespace apex
