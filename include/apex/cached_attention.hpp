// SPDX-License-Identifier: MIT
// Attention of new queries against a cache (§7.4, §10): the rules a cached call's positions obey,
// and attention over a sliding-window cache's ring plus the chunk's own keys in one pass of the
// tiled kernel. (A full KvCache needs nothing of its own: its keys() and values() are views that
// apex::sdpa reads in place.)
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <array>
#include <string>
#include <type_traits>
#include <utility>

namespace apex {

namespace detail {

/// Checks the position rule of a cached call: n new queries at absolute positions
/// [first, first + n) against a cache whose next position is `next`.
///   - the rule's offsets must be unset: the cache supplies them;
///   - first must equal next (positions never go backwards or skip);
///   - a bidirectional prefix [0, P) must lie inside one call starting at 0: every prefix token
///     attends to every other, so none can be processed before the last of them is known.
inline void check_cached_rule(const PositionMask& rule, Index first, Index next, Index n,
                              const char* op) {
  check_position_mask(rule, op);
  APEX_CHECK(!rule.query_offset && rule.key_offset == 0,
             "[" << op << "] mask query_offset/key_offset must be unset: the cache supplies the "
                 << "positions");
  APEX_CHECK(n >= 1, "[" << op << "] the chunk must hold at least one token per sequence (got " << n
                         << ")");
  APEX_CHECK(first >= next, "[" << op << "] position_offset (" << first
                                << ") goes backwards: the cache's next position is " << next);
  APEX_CHECK(first == next, "[" << op << "] position_offset (" << first
                                << ") skips ahead: the cache's next position is " << next);
  // The chunk's positions [first, first + n) and everything formed from them must be Index
  // values (a sliding-window cache's next position is bounded by nothing else).
  checked_sum(first, n, op, "position_offset + n");
  APEX_CHECK(rule.prefix == 0 || first >= rule.prefix || (first == 0 && n >= rule.prefix),
             "[" << op << "] prefix P (" << rule.prefix << ") must lie within one chunk starting "
                 << "at position 0 (this chunk covers [" << first << ", " << first + n
                 << ")): the prefix is bidirectional");
}

/// A sliding-window cache holds the last W tokens: the rule must be causal with a window of at
/// most W.
inline void check_window_rule(const PositionMask& rule, Index cache_window, const char* op) {
  APEX_CHECK(rule.causal && rule.window && *rule.window <= cache_window,
             "[" << op << "] a SlidingWindowCache of W = " << cache_window
                 << " needs a causal mask with a window of at most " << cache_window << " (got "
                 << (rule.window ? std::to_string(*rule.window) : std::string("none")) << ")");
}

/// Every check of sdpa_with_window_cache, on shapes only.
template <class Scalar, class Storage>
void check_window_attention(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k_new,
                            const ConstHeadsView<Scalar>& v_new, const PositionMask& rule,
                            const SdpaParams& params,
                            const SlidingWindowCache<Scalar, Storage>& cache,
                            const HeadsView<Scalar>& out, const char* op) {
  check_constructed(cache.batch() >= 1, op, "cache");
  const Index next = cache.next_position();
  const Index n = q.seq();
  check_kv_chunk(k_new, v_new, {cache.batch(), cache.num_kv_heads(), 0, cache.head_dim()}, op);
  APEX_CHECK(k_new.seq() == n, "[" << op << "] chunk keys (" << k_new.seq()
                                   << ") must be as many as the queries (" << n << ")");
  check_cached_rule(rule, next, next, n, op);
  check_window_rule(rule, cache.window(), op);
  AttentionMask<Scalar> whole;
  whole.positions = rule;
  whole.positions.query_offset = next;
  whole.positions.key_offset = cache.first_position();
  const Index keys = cache.size() + n;
  check_sdpa(q, shape_only_view<const Scalar>({k_new.batch(), k_new.heads(), keys, k_new.dim()}),
             shape_only_view<const Scalar>({v_new.batch(), v_new.heads(), keys, v_new.dim()}),
             whole, params, out, {}, op);
  check_output_view(out, op, "output");
  const ByteRange written = byte_range(out);
  bool overlap = written.overlaps(byte_range(q)) || written.overlaps(byte_range(k_new)) ||
                 written.overlaps(byte_range(v_new));
  for (const auto& run : cache.segments()) {
    overlap = overlap || written.overlaps(byte_range(run.keys)) ||
              written.overlaps(byte_range(run.values));
  }
  APEX_CHECK(!overlap, "[" << op << "] out must not share memory with q, the chunk or the cache");
}

/// A chunk's rows stored as a cache of format Storage stores them: the buffer, and a contiguous
/// [B, H, n, D / kValuesPerElement] view of it.
template <class Storage>
struct StoredChunk {
  CacheBuffer<Storage> buffer;
  HeadsView<const Storage> view;
};

/// A contiguous copy of a [B, H, n, D] view stored through Storage's format (write_rows: every
/// value rounded or quantized once, as a cache stores it). Allocates the copy.
template <class Storage, class Scalar>
StoredChunk<Storage> stored_copy(const HeadsView<const Scalar>& from) {
  const HeadsShape& s = from.shape();
  const HeadsShape stored{s.batch, s.heads, s.seq, KvFormat<Storage>::elements(s.dim)};
  StoredChunk<Storage> chunk;
  chunk.buffer = zeroed_buffer<Storage>(s.batch * s.heads * s.seq * stored.dim);
  write_rows(from, chunk.buffer.data(), s.seq, 0, s.seq, 0);
  chunk.view = HeadsView<const Storage>::contiguous(chunk.buffer.data(), stored);
  return chunk;
}

}  // namespace detail

/// Attention of n new queries over a sliding-window cache plus the chunk's own keys (§10, §6.2),
/// without changing the cache: the keys are what the cache holds (the at most W tokens before
/// the chunk) followed by the chunk's n keys. The ring's (at most two) runs of consecutive
/// positions and the chunk are the key segments of one pass of the tiled kernel, each at its own
/// absolute positions; segments the rule forbids entirely are skipped block by block, and
/// nothing is merged or copied. Afterwards the caller appends the chunk (append keeps the last
/// W). Queries sit at positions [next, next + n), next = cache.next_position().
///   q: [B, H_q, n, d_h], k_new, v_new: [B, H_kv, n, d_h] (any layout)
///   rule: causal with window <= W (and an optional prefix); offsets unset
///   -> out: [B, H_q, n, d_h] (any layout with distinct elements; must not overlap the inputs or
///      the cache).
/// Every check runs before out is written. Allocates nothing beyond sdpa's scratch when the
/// cache stores Scalar. A cache of another format (16 bits, or the blocks of kv_quant.hpp) holds
/// its tokens rounded or quantized: the chunk's keys and values are stored so too (a copy of
/// 2·B·H_kv·n rows in the format, allocated), so that every token is attended to with the values
/// the cache keeps of it, in its own chunk as afterwards.
template <class Scalar, class Storage>
void sdpa_with_window_cache(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k_new,
                            const ConstHeadsView<Scalar>& v_new, const PositionMask& rule,
                            const SdpaParams& params,
                            const SlidingWindowCache<Scalar, Storage>& cache,
                            const HeadsView<Scalar>& out) {
  detail::require_supported_scalar<Scalar>();
  const char* op = "sdpa_with_window_cache";
  detail::check_window_attention(q, k_new, v_new, rule, params, cache, out, op);
  detail::StoredChunk<Storage> k_stored, v_stored;
  HeadsView<const Storage> k_chunk, v_chunk;
  if constexpr (std::is_same_v<Storage, Scalar>) {
    k_chunk = k_new;
    v_chunk = v_new;
  } else {
    k_stored = detail::stored_copy<Storage>(k_new);
    v_stored = detail::stored_copy<Storage>(v_new);
    k_chunk = k_stored.view;
    v_chunk = v_stored.view;
  }
  const Index next = cache.next_position();
  std::array<detail::KeySegment<Storage, Storage>, 3> segments;
  std::size_t count = 0;
  for (const auto& run : cache.segments()) {
    if (run.keys.seq() > 0) segments[count++] = {run.keys, run.values, run.first_position};
  }
  segments[count++] = {k_chunk, v_chunk, next};
  const auto p = detail::attention_problem<Scalar, Storage, Storage>(
      q, segments.data(), static_cast<Index>(count), cache.size() + k_new.seq(), rule, next,
      params);
  detail::flash_attention(p, detail::AttentionOutputs<Scalar>{out, {}, {}, {}},
                          detail::FlashBlocking{});
}

}  // namespace apex
