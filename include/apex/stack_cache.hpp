// SPDX-License-Identifier: MIT
// The decoding state of an AttentionStack (stack.hpp): StackCache, one cache per layer of the
// kind the documents motivate each layer with, and the one door (detail::StackCacheAccess)
// through which the stack's cached calls make and advance it:
//   local layers   SlidingWindowCache of the last W tokens  2·H_kv·d_h values per token, ≤ W tokens
//   global layers  LatentCache (c_kv ‖ K_rope)               d_kv + H_kr·d_r values per token
//                  and, sparse (StackConfig::indexer), an IndexerKeyCache     d_I values per token
#pragma once

#include <apex/config.hpp>
#include <apex/indexer.hpp>
#include <apex/kv_cache.hpp>
#include <apex/stack_config.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

namespace detail {
struct StackCacheAccess;  // the cached calls of AttentionStack, below StackCache
}  // namespace detail

/// The decoding state of one AttentionStack: one cache per layer (a SlidingWindowCache of W
/// tokens for each local layer, a LatentCache of `capacity` tokens for each global layer), the
/// batch, the prefix and the next absolute position. Made by AttentionStack::make_cache and
/// advanced only by that stack's prefill / extend / decode_step, which check that it matches.
/// The local layers' caches store format Storage and the global layers' latent caches format
/// Global (kv_format.hpp: Scalar, a 16-bit type, a block format of kv_quant.hpp, or for the
/// latent rows a whole-row format such as FlashMlaFp8Row; Global is Storage unless given):
/// AttentionStack::make_cache<Storage, Global>.
/// A stack with sparse global layers (StackConfig::indexer) also holds, per global layer, an
/// IndexerKeyCache of `capacity` keys in format indexer_key_format_t<Global>.
/// Memory: bytes() = stack_cache_memory<Storage, Global>(config, batch, capacity).total_bytes,
/// allocated at construction; the local layers' share never grows, the global layers' grows
/// only through reserve().
template <class Scalar, class Storage = Scalar, class Global = Storage>
class StackCache {
 public:
  /// An empty cache of no layers (as a moved-from one is); the stacks reject it.
  StackCache() = default;
  /// The cache of one layer: a SlidingWindowCache for a local layer, a LatentCache for a
  /// global one.
  using LayerCache = std::variant<SlidingWindowCache<Scalar, Storage>, LatentCache<Scalar, Global>>;
  /// The indexer keys of a sparse global layer.
  using KeyCache = IndexerKeyCache<Scalar, indexer_key_format_t<Global>>;

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
  /// The indexer keys of layer l, read-only: a sparse global layer's, or an empty cache (for a
  /// local or dense global layer). Throws std::invalid_argument unless 0 <= l < num_layers().
  const KeyCache& indexer_keys(Index l) const {
    (void)layer(l);  // the check
    return keys_[static_cast<std::size_t>(l)];
  }

  /// Exact bytes of every layer's cache.
  std::int64_t bytes() const { return local_bytes() + global_bytes(); }
  /// Bytes of the local layers' sliding-window caches: constant, whatever the context.
  std::int64_t local_bytes() const { return bytes_of<SlidingWindowCache<Scalar, Storage>>(); }
  /// Bytes of the global layers' latent caches and indexer keys: proportional to capacity(), so
  /// it grows with reserve().
  std::int64_t global_bytes() const {
    std::int64_t keys = 0;
    for (const KeyCache& k : keys_) keys += k.bytes();
    return bytes_of<LatentCache<Scalar, Global>>() + keys;
  }

  /// Grows the global layers' capacity to at least `capacity` (one copy of each latent cache
  /// and indexer key cache; see LatentCache::reserve). Never shrinks.
  void reserve(Index capacity) {
    detail::check_constructed(batch() >= 1, "stack", "cache");
    if (capacity <= capacity_) return;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (auto* latent = std::get_if<LatentCache<Scalar, Global>>(&layers_[l])) {
        latent->reserve(capacity);
        if (keys_[l].batch() >= 1) keys_[l].reserve(capacity);
      }
    }
    capacity_ = capacity;
  }

  /// Forgets the sequence (memory kept): the next call must be prefill (or extend from 0).
  void clear() {
    for (LayerCache& cache : layers_) std::visit([](auto& c) { c.clear(); }, cache);
    for (KeyCache& keys : keys_) keys.clear();
    next_ = 0;
    prefix_ = 0;
  }

 private:
  friend struct detail::StackCacheAccess;

  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, called by make_cache only
  StackCache(Index batch, Index capacity, std::vector<LayerCache> layers,
             std::vector<KeyCache> keys)
      : batch_(batch), capacity_(capacity), layers_(std::move(layers)), keys_(std::move(keys)) {}

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
  std::vector<KeyCache> keys_;      // one per layer; empty caches where a layer is not sparse
};

namespace detail {

/// The one door into a StackCache's layers and position: only the cached calls of AttentionStack
/// (stack.hpp) make a cache and advance it.
struct StackCacheAccess {
  template <class Scalar, class Storage, class Global>
  static StackCache<Scalar, Storage, Global> make(
      Index batch, Index capacity,
      std::vector<typename StackCache<Scalar, Storage, Global>::LayerCache> layers,
      std::vector<typename StackCache<Scalar, Storage, Global>::KeyCache> keys) {
    return StackCache<Scalar, Storage, Global>(batch, capacity, std::move(layers), std::move(keys));
  }
  template <class Cache>
  static typename Cache::LayerCache& layer(Cache& cache, Index l) {
    return cache.layers_[static_cast<std::size_t>(l)];
  }
  template <class Cache>
  static typename Cache::KeyCache& indexer_keys(Cache& cache, Index l) {
    return cache.keys_[static_cast<std::size_t>(l)];
  }
  /// After n tokens from position `first`: the next position, and the prefix of a first call.
  template <class Cache>
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (first, n, prefix) positions
  static void advance(Cache& cache, Index first, Index n, Index prefix) {
    cache.next_ = first + n;
    if (first == 0) cache.prefix_ = prefix;
  }
};

}  // namespace detail

}  // namespace apex
