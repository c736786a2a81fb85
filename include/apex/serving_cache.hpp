// SPDX-License-Identifier: MIT
// The decoding state of an AttentionStack that serves many sequences at once (continuous
// batching): one paged cache per layer (paged_cache.hpp), a PagedKvCache for each local layer
// and a PagedLatentCache for each global layer, and the live sequences, each with its own
// length and bidirectional prefix. A sequence is one SequenceId in every layer. Sequences are
// added (empty), forked (sharing every page of every layer with their parent: a common prompt
// is held once), fed tokens by serve (stack_serving.hpp), and freed; the local layers give back
// the pages their window has passed, so they hold O(W) tokens per sequence.
#pragma once

#include <apex/config.hpp>
#include <apex/indexer.hpp>
#include <apex/paged_cache.hpp>
#include <apex/stack_config.hpp>
#include <apex/tree_mask.hpp>

#include <cstdint>
#include <map>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

/// The pools of a ServingCache: pages of page_size tokens, local_pages for each local layer and
/// global_pages for each global layer (each layer has a pool of its own; a sparse global layer
/// has two of global_pages pages, its latent rows' and its indexer keys').
struct ServingCacheShape {
  Index page_size = 16;    ///< tokens per page
  Index local_pages = 0;   ///< pages of each local layer's PagedKvCache
  Index global_pages = 0;  ///< pages of each global layer's PagedLatentCache
};

namespace detail {
struct ServingCacheAccess;  // stack_serving.hpp: make_serving_cache and serve
}  // namespace detail

/// The paged caches of every layer of one AttentionStack and its live sequences, made by
/// make_serving_cache and advanced only by serve() of that stack (stack_serving.hpp; the stack's
/// members of those names call them). Memory: the pools, allocated (zeroed) at construction
/// (bytes()), and a block table per sequence and layer.
/// The local layers' pages store format Storage and the global layers' format Global (as
/// StackCache's, stack_cache.hpp; Global is Storage unless given). A stack with sparse global
/// layers (StackConfig::indexer) adds, per global layer, a PagedIndexerKeyCache in format
/// indexer_key_format_t<Global> holding the same sequences.
/// Default-constructed or moved from, it is empty (no layers; the stacks reject it).
template <class Scalar, class Storage = Scalar, class Global = Storage>
class ServingCache {
 public:
  /// The cache of one layer: a PagedKvCache (local) or a PagedLatentCache (global).
  using LayerCache = std::variant<PagedKvCache<Scalar, Storage>, PagedLatentCache<Scalar, Global>>;
  /// The indexer keys of a sparse global layer.
  using KeyCache = PagedIndexerKeyCache<Scalar, indexer_key_format_t<Global>>;

  ServingCache() = default;

  /// Number of layers (one cache each).
  Index num_layers() const { return static_cast<Index>(layers_.size()); }
  /// The cache of layer l, read-only. Throws unless 0 <= l < num_layers().
  const LayerCache& layer(Index l) const {
    APEX_CHECK(l >= 0 && l < num_layers(),
               "[serving_cache] layer (" << l << ") must lie in [0, " << num_layers() << ")");
    return layers_[static_cast<std::size_t>(l)];
  }
  /// The indexer keys of layer l, read-only: a sparse global layer's, or an empty cache (no
  /// pages) for the other layers. Throws unless 0 <= l < num_layers().
  const KeyCache& indexer_keys(Index l) const {
    (void)layer(l);  // the check
    return keys_[static_cast<std::size_t>(l)];
  }
  /// Number of live sequences.
  Index sequences() const { return static_cast<Index>(prefix_.size()); }
  /// The live sequences' ids, in increasing order.
  std::vector<SequenceId> ids() const {
    std::vector<SequenceId> all;
    for (const auto& [id, prefix] : prefix_) all.push_back(id);
    return all;
  }
  /// Whether id names a live sequence (added, and not freed).
  bool contains(SequenceId id) const { return prefix_.count(id) == 1; }
  /// Tokens fed to sequence id so far (its next position). Throws unless it is live.
  Index length(SequenceId id) const {
    check_live(id);
    return std::visit([id](const auto& c) { return c.length(id); }, layers_.front());
  }
  /// Whether sequence id holds a verified draft that awaits accept_drafts (stack_speculative.hpp):
  /// until then it takes no serve or verify_drafts. Throws unless it is live.
  bool verifying(SequenceId id) const {
    check_live(id);
    return drafts_.count(id) == 1;
  }
  /// The bidirectional prefix P of sequence id (§11.1).
  Index prefix(SequenceId id) const {
    check_live(id);
    return prefix_.at(id);
  }
  /// Exact bytes of every layer's pool.
  std::int64_t bytes() const {
    std::int64_t total = 0;
    for (const auto& c : layers_) total += std::visit([](const auto& x) { return x.bytes(); }, c);
    for (const KeyCache& k : keys_) total += k.bytes();
    return total;
  }
  /// Pages in use, summed over the layers (a page shared by forks counts once).
  Index pages_in_use() const {
    Index total = 0;
    for (const auto& c : layers_) {
      total += std::visit([](const auto& x) { return x.pages_in_use(); }, c);
    }
    for (const KeyCache& k : keys_) total += sparse(k) ? k.pages_in_use() : 0;
    return total;
  }

  /// Adds an empty sequence whose first `prefix` positions will be bidirectional (they must come
  /// in its first serve() call) and returns its id. Throws on an empty cache or prefix < 0.
  SequenceId add(Index prefix = 0) {
    APEX_CHECK(!layers_.empty(),
               "[serving_cache] the cache is empty (default-constructed or "
               "moved from): it has no layers");
    APEX_CHECK(prefix >= 0, "[serving_cache] prefix (" << prefix << ") must be >= 0");
    SequenceId id;
    for (auto& c : layers_) id = std::visit([](auto& x) { return x.add(); }, c);
    for (KeyCache& k : keys_) {
      if (sparse(k)) same_id(id, k.add());
    }
    prefix_.emplace(id, prefix);
    return id;
  }
  /// Adds a sequence holding the tokens (and the prefix) of `id`, sharing its pages in every
  /// layer (copy on write), and returns its id: a continuation of a common prompt. A verified
  /// draft awaiting accept is forked with it, each to accept its own path.
  SequenceId fork(SequenceId id) {
    check_live(id);
    SequenceId child;
    for (auto& c : layers_) child = std::visit([id](auto& x) { return x.fork(id); }, c);
    for (KeyCache& k : keys_) {
      if (sparse(k)) same_id(child, k.fork(id));
    }
    prefix_.emplace(child, prefix_.at(id));
    if (drafts_.count(id) == 1) drafts_.emplace(child, drafts_.at(id));  // its own to accept
    return child;
  }
  /// Frees sequence id in every layer (its id is then invalid).
  void free(SequenceId id) {
    check_live(id);
    for (auto& c : layers_) std::visit([id](auto& x) { x.free(id); }, c);
    for (KeyCache& k : keys_) {
      if (sparse(k)) k.free(id);
    }
    prefix_.erase(id);
    drafts_.erase(id);
  }

 private:
  friend struct detail::ServingCacheAccess;

  ServingCache(std::vector<LayerCache> layers, std::vector<KeyCache> keys)
      : layers_(std::move(layers)), keys_(std::move(keys)) {}

  /// Whether a layer's key cache is a sparse layer's (it has pages), not an empty one.
  static bool sparse(const KeyCache& k) { return k.head_dim() >= 1; }
  /// Every pool hands out ids in the same order: a key cache's id is its layers'.
  static void same_id(SequenceId expected, SequenceId given) {
    APEX_ASSERT(expected == given);
    (void)expected;
    (void)given;
  }

  void check_live(SequenceId id) const {
    APEX_CHECK(prefix_.count(id) == 1,
               "[serving_cache] sequence " << id << " does not exist (never added, or freed)");
  }

  /// A verified draft: the committed length it follows and its tree.
  struct PendingDraft {
    Index committed = 0;
    DraftTree tree;
  };

  std::vector<LayerCache> layers_;             // a moved-from vector is empty
  std::vector<KeyCache> keys_;                 // one per layer; empty ones where not sparse
  std::map<SequenceId, Index> prefix_;         // the live sequences and their prefixes
  std::map<SequenceId, PendingDraft> drafts_;  // the verified drafts awaiting accept
};

}  // namespace apex
