// SPDX-License-Identifier: MIT
// Caches for decoding one token (or a short chunk) at a time (§7.4, §8.3, §9.4, §10): the
// containers only. What they cost is in cache_memory.hpp, attention over them in
// cached_attention.hpp and in the layers.
//
// Three caches, each owning its memory and reporting its exact size with bytes():
//
//   KvCache             K and V of H_kv heads, [B, H_kv, C, d_h] each, capacity C fixed at
//                       construction (§7.4 for H_kv = H_q, §8.3 for fewer heads). Token t of
//                       batch b, head h lives in row t of head (b, h):
//                         K: | b=0: h=0 [C × d_h] | h=1 [C × d_h] | ... | b=1: ... |
//                       so keys() is a HeadsView with seq = size() and head stride C·d_h:
//                       exactly what apex::sdpa reads, no copy.
//
//   SlidingWindowCache  K and V of the last W tokens only (§10), [B, H_kv, W, d_h] each. The
//                       token at absolute position p lives in slot p mod W (a ring):
//                         slot:      0    1    2    3          (W = 4, 6 tokens seen)
//                         position:  4    5    2    3          next position 6
//                       segments() hands out the held tokens as at most two runs of consecutive
//                       positions (here [2, 3] in slots 2-3, then [4, 5] in slots 0-1), each a
//                       HeadsView with its first absolute position, so that masks and RoPE stay
//                       right after the ring wraps. Memory O(W) however long the sequence.
//
//   LatentCache         what multi-head latent attention (§9) needs per token: c_kv (d_kv values)
//                       and the rotated K_rope (H_kr·d_r values), side by side in one row:
//                         row t of batch b: | c_kv (d_kv) | K_rope head 0 (d_r) | ... |
//                       [B, C, d_kv + H_kr·d_r] in all, nothing else (§9.4 counts only c_kv; see
//                       mla.hpp and SEED-NOTES.md for why K_rope must be cached too).
//
// Positions. Every cache tracks the absolute position of the next token (next_position()); an
// append must start exactly there: a position that goes backwards or skips ahead is rejected.
//
// Overflow policy. KvCache and LatentCache never grow by themselves: appending past the
// capacity throws std::invalid_argument and leaves the cache unchanged. reserve() grows one
// explicitly (one copy), truncate() drops the newest tokens (e.g. rejected speculative tokens).
// SlidingWindowCache never fills. Every check of every member runs before anything is written.
//
// Empty caches. A default-constructed or moved-from cache is empty: every extent 0, no memory;
// it can be assigned to, cleared, truncated to 0 and viewed (views with no elements), and every
// append or reserve on it throws std::invalid_argument.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/kv_format.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

namespace detail {

/// Copies rows [src_row, src_row + count) of a [B, H, n, ·] view into rows [first, first +
/// count) of a [B, H, slots, D] buffer of elements of format Storage (D = the elements of a row
/// of the view's values): stored through the buffer's format (KvFormat: each value rounded or
/// quantized once), or copied as they are when the source is already stored so.
template <class Src, class Storage>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (slots, source row, count)
void write_rows(const HeadsView<const Src>& src, Storage* dst, Index slots, Index src_row,
                Index count, Index first) {
  const HeadsShape& s = src.shape();
  const Index dim = KvFormat<Storage>::elements(row_values(src));
  const HeadsView<Storage> target(dst, {s.batch, s.heads, slots, dim},
                                  {s.heads * slots * dim, slots * dim, dim});
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) {
      if constexpr (is_storage_v<Storage>) {
        auto rows = target.head(b, h).middleRows(first, count);
        if constexpr (std::is_same_v<Src, Storage>) {
          rows = src.head(b, h).middleRows(src_row, count);
        } else {
          KvFormat<Storage>::store_rows(rows, src.head(b, h).middleRows(src_row, count));
        }
      } else {  // a block format: row by row, no Eigen expression of blocks
        for (Index r = 0; r < count; ++r) {
          Storage* row = row_data(target, b, h, first + r);
          if constexpr (std::is_same_v<Src, Storage>) {
            std::copy_n(row_data(src, b, h, src_row + r), dim, row);
          } else {
            KvFormat<Storage>::store_row(row_data(src, b, h, src_row + r), s.dim, row);
          }
        }
      }
    }
  }
}

/// The [B, H, rows, D] view of rows [first, first + rows) of every head of a [B, H, slots, D]
/// buffer.
template <class Scalar>
HeadsView<const Scalar> buffer_rows(const Scalar* data, const HeadsShape& buffer, Index first,
                                    Index rows) {
  const Index dim = buffer.dim;
  return HeadsView<const Scalar>(rows == 0 ? data : data + first * dim,
                                 {buffer.batch, buffer.heads, rows, dim},
                                 {buffer.heads * buffer.seq * dim, buffer.seq * dim, dim});
}

/// K and V of a cache: a [B, H, slots, D] buffer of keys and a [B, H, slots, D_v] buffer of
/// values, elements of format Storage, zeroed at construction, with their shape (D and D_v in
/// values; a row holds D / kValuesPerElement elements); chunks of Scalar are rounded or quantized
/// to Storage as they are written. Default-constructed or moved from, it is empty (every extent
/// 0, no memory).
template <class Scalar, class Storage>
class KvBuffers {
 public:
  KvBuffers() = default;
  /// K and V of one width D = shape.dim (see the other constructor).
  KvBuffers(const HeadsShape& shape, const char* op, const char* slots_name)
      : KvBuffers(shape, shape.dim, op, slots_name) {}
  /// Allocates both buffers, keys [B, H, slots, D] (`keys`) and values [B, H, slots, D_v];
  /// throws unless every extent is >= 1 (`slots_name` names the slots in messages: capacity or
  /// window), D (head_dim) and D_v (value_dim) are whole numbers of Storage's blocks and the
  /// bytes fit in 64 bits.
  KvBuffers(const HeadsShape& keys, Index value_dim, const char* op, const char* slots_name) {
    require_supported_scalar<Scalar>();
    require_kv_format<Storage>();
    check_cache_dims(keys, op, slots_name);
    APEX_CHECK(value_dim >= 1, "[" << op << "] value_dim (" << value_dim << ") must be >= 1");
    check_row_values<Storage>(keys.dim, op, "head_dim");
    check_row_values<Storage>(value_dim, op, "value_dim");
    HeadsShape values = keys;
    values.dim = value_dim;
    const Index k_size = cache_buffer_size<Storage>(element_shape(keys), op);
    const Index v_size = cache_buffer_size<Storage>(element_shape(values), op);
    k_ = zeroed_buffer<Storage>(k_size);
    v_ = zeroed_buffer<Storage>(v_size);
    shape_ = keys;
    value_dim_ = value_dim;
  }

  /// [B, H, slots, D] of the keys, D in values.
  const HeadsShape& shape() const { return shape_; }
  /// [B, H, slots, D_v] of the values, D_v in values.
  HeadsShape value_shape() const {
    HeadsShape s = shape();
    s.dim = value_dim_;
    return s;
  }
  /// Bytes of both buffers.
  std::int64_t bytes() const {
    return KvFormat<Storage>::bytes(static_cast<std::int64_t>(k_.size() + v_.size()));
  }
  /// Rows [first, first + rows) of every head of K (of V).
  HeadsView<const Storage> keys(Index first, Index rows) const {
    return buffer_rows(k_.data(), element_shape(shape()), first, rows);
  }
  HeadsView<const Storage> values(Index first, Index rows) const {
    return buffer_rows(v_.data(), element_shape(value_shape()), first, rows);
  }
  /// Rows [src_row, src_row + count) of a chunk's k and v into rows [first, first + count).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (k, v) and (row, count, first)
  void write(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index src_row,
             Index count, Index first) {
    write_rows(k, k_.data(), shape().seq, src_row, count, first);
    write_rows(v, v_.data(), shape().seq, src_row, count, first);
  }
  /// Grows to `slots` (> the current slots), keeping the first `kept` rows (one copy); throws,
  /// unchanged, if the new size does not fit in 64 bits.
  void grow(Index slots, Index kept, const char* op) {
    HeadsShape grown = shape(), grown_values = value_shape();
    grown.seq = grown_values.seq = slots;
    const Index k_size = cache_buffer_size<Storage>(element_shape(grown), op);
    const Index v_size = cache_buffer_size<Storage>(element_shape(grown_values), op);
    CacheBuffer<Storage> k = zeroed_buffer<Storage>(k_size);
    CacheBuffer<Storage> v = zeroed_buffer<Storage>(v_size);
    write_rows(keys(0, kept), k.data(), slots, 0, kept, 0);
    write_rows(values(0, kept), v.data(), slots, 0, kept, 0);
    k_ = std::move(k);
    v_ = std::move(v);
    shape_ = grown;
  }

 private:
  /// The shape in elements of Storage: D / kValuesPerElement a row.
  static HeadsShape element_shape(HeadsShape s) {
    s.dim = KvFormat<Storage>::elements(s.dim);
    return s;
  }
  ResetOnMove<HeadsShape> shape_;
  ResetOnMove<Index> value_dim_;
  CacheBuffer<Storage> k_;  // Eigen and the standard library leave a moved-from buffer empty
  CacheBuffer<Storage> v_;
};

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// KvCache (§7.4, §8.3)
// ---------------------------------------------------------------------------------------------

/// The shape of a KvCache: B sequences of up to C tokens, H_kv heads of d_h.
struct KvCacheShape {
  Index batch = 0;         ///< B
  Index num_kv_heads = 0;  ///< H_kv
  Index head_dim = 0;      ///< d_h
  Index capacity = 0;      ///< C, tokens that fit
};

/// The full K/V cache of one multi-head or grouped-query attention layer: K and V of every token
/// so far, [B, H_kv, C, d_h] each, capacity C fixed at construction. keys() and values() are
/// HeadsViews of the first size() rows of every head (head stride C·d_h), ready for apex::sdpa.
/// Memory: 2·B·H_kv·C·d_h elements of Storage, allocated (zeroed) at construction, never
/// implicitly more. Overflow: append past C throws and leaves the cache unchanged; reserve()
/// grows explicitly.
///
/// Scalar is the type of the chunks appended (float or double); Storage, the type held (by
/// default Scalar; Eigen::half or Eigen::bfloat16 for half the bytes): KvCache<float, Eigen::half>
/// rounds every appended element once, to nearest even, and its keys() and values() are half
/// views, which apex::sdpa widens to float as it reads them.
template <class Scalar, class Storage = Scalar>
class KvCache {
 public:
  /// The type of the appended chunks, and of the attention computed over them.
  using ComputeType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// An empty cache (see "Empty caches" above).
  KvCache() = default;
  /// Allocates K and V. Throws unless batch, num_kv_heads, head_dim and capacity are >= 1.
  explicit KvCache(const KvCacheShape& s)
      : buffers_({s.batch, s.num_kv_heads, s.capacity, s.head_dim}, "kv_cache", "capacity") {}

  /// Number of sequences B cached side by side.
  Index batch() const { return shape().batch; }
  /// Number of cached K/V heads H_kv (H_q for MHA, fewer for GQA/MQA).
  Index num_kv_heads() const { return shape().heads; }
  /// Per-head width d_h of K and V.
  Index head_dim() const { return shape().dim; }
  /// Tokens C that fit before append throws; changes only through reserve().
  Index capacity() const { return shape().seq; }
  /// Tokens held: positions [0, size()).
  Index size() const { return size_; }
  /// Absolute position of the next token to append (= size()).
  Index next_position() const { return size_; }
  /// Exact bytes of the stored values: 2·B·H_kv·C·d_h·sizeof(Storage) (K and V).
  std::int64_t bytes() const { return buffers_.bytes(); }

  /// Appends a chunk of n tokens at absolute positions [position, position + n):
  ///   k, v: [B, H_kv, n, d_h] views of any layout (for a projection's token-major output
  ///   [B*n, H_kv·d_h] use HeadsView::token_major or ProjectedQkv::k_heads()).
  /// position must equal next_position() (never backwards, never skipping) and size() + n must
  /// not exceed capacity(). Every check runs before anything is written; k and v must not
  /// overlap the cache. Each element is rounded once to Storage. Allocates nothing.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index position) {
    check_append(k, v, position);
    buffers_.write(k, v, 0, k.seq(), size_);
    size_.get() += k.seq();
  }

  /// Everything append checks, without appending: for callers that must validate a whole step
  /// before changing any cache.
  void check_append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    Index position) const {
    detail::check_constructed(batch() >= 1, "kv_cache", "cache");
    detail::check_kv_chunk(k, v, shape(), "kv_cache");
    detail::check_append_position(position, size_, "kv_cache");
    check_room(k.seq());
  }

  /// Throws unless n more tokens fit.
  void check_room(Index n) const {
    APEX_CHECK(n <= capacity() - size_, "[kv_cache] appending "
                                            << n << " tokens at position " << size()
                                            << " would exceed the capacity (" << capacity()
                                            << "): a KvCache never grows by itself; reserve() a "
                                               "larger capacity (or use a SlidingWindowCache for "
                                               "a windowed layer)");
  }

  /// [B, H_kv, size(), d_h] view of the cached keys (head stride C·d_h), no copy. It holds
  /// size() as of the call, and reserve() frees the memory it points to.
  HeadsView<const Storage> keys() const { return buffers_.keys(0, size_); }
  /// [B, H_kv, size(), d_h] view of the cached values; same layout and lifetime as keys().
  HeadsView<const Storage> values() const { return buffers_.values(0, size_); }

  /// Drops the tokens at positions >= new_size (0 <= new_size <= size()). O(1).
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size_,
               "[kv_cache] truncate size (" << new_size << ") must lie in [0, " << size() << "]");
    size_ = new_size;
  }

  /// Grows the capacity to at least `capacity`, keeping the cached tokens (one copy; allocates
  /// the new K and V, then frees the old ones). Never shrinks. Throws (cache unchanged) if the
  /// new size does not fit in 64 bits, or on an empty cache.
  void reserve(Index capacity) {
    detail::check_constructed(batch() >= 1, "kv_cache", "cache");
    if (capacity <= this->capacity()) return;
    buffers_.grow(capacity, size_, "kv_cache");
  }

  /// Forgets every token (the memory is kept).
  void clear() { size_ = 0; }

 private:
  const HeadsShape& shape() const { return buffers_.shape(); }

  detail::KvBuffers<Scalar, Storage> buffers_;  // [B, H_kv, C, d_h] each
  detail::ResetOnMove<Index> size_;
};

// ---------------------------------------------------------------------------------------------
// SlidingWindowCache (§10)
// ---------------------------------------------------------------------------------------------

/// The shape of a SlidingWindowCache: B sequences, H_kv heads of d_h, the last W tokens.
struct WindowCacheShape {
  Index batch = 0;         ///< B
  Index num_kv_heads = 0;  ///< H_kv
  Index head_dim = 0;      ///< d_h
  Index window = 0;        ///< W, tokens held
};

/// The cache of a sliding-window layer (§10.2: query i sees keys 0 <= i − j < W): K and V of the
/// last W tokens only, [B, H_kv, W, d_h] each, as a ring where absolute position p lives in slot
/// p mod W. Memory: 2·B·H_kv·W·d_h elements of Storage, allocated at construction and constant
/// afterwards, however many tokens pass through. The cache never fills; old tokens are
/// overwritten. Scalar and Storage as for KvCache: the chunks appended, and what the ring holds.
///
/// W slots are enough for any chunk: the new tokens attend to what the ring holds (the W tokens
/// before them) and to each other, and only then are appended (see sdpa_with_window_cache).
template <class Scalar, class Storage = Scalar>
class SlidingWindowCache {
 public:
  /// The type of the appended chunks, and of the attention computed over them.
  using ComputeType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// A run of held tokens with consecutive positions [first_position, first_position + n):
  /// keys and values are [B, H_kv, n, d_h] views into the ring.
  struct Segment {
    Index first_position = 0;         ///< absolute position of the run's first token
    HeadsView<const Storage> keys;    ///< [B, H_kv, n, d_h] keys of the run (n = keys.seq())
    HeadsView<const Storage> values;  ///< [B, H_kv, n, d_h] values of the run
  };

  /// An empty cache (see "Empty caches" above).
  SlidingWindowCache() = default;
  /// Allocates the ring. Throws unless batch, num_kv_heads, head_dim and window are >= 1.
  explicit SlidingWindowCache(const WindowCacheShape& s)
      : buffers_({s.batch, s.num_kv_heads, s.window, s.head_dim}, "sliding_window_cache",
                 "window") {}

  /// Number of sequences B cached side by side.
  Index batch() const { return shape().batch; }
  /// Number of cached K/V heads H_kv.
  Index num_kv_heads() const { return shape().heads; }
  /// Per-head width d_h of K and V.
  Index head_dim() const { return shape().dim; }
  /// Window W: the number of ring slots, i.e. the most tokens ever held (§10.2).
  Index window() const { return shape().seq; }
  /// Absolute position of the next token (= tokens seen so far).
  Index next_position() const { return next_; }
  /// Tokens held: min(next_position(), W), positions [first_position(), next_position()).
  Index size() const { return std::min<Index>(next_, window()); }
  /// Absolute position of the oldest held token: next_position() − size() (0 until the ring
  /// wraps).
  Index first_position() const { return next_ - size(); }
  /// Exact bytes of the stored values: 2·B·H_kv·W·d_h·sizeof(Storage), whatever
  /// next_position().
  std::int64_t bytes() const { return buffers_.bytes(); }

  /// Appends a chunk of n tokens at positions [position, position + n); only the last min(n, W)
  /// are kept (the rest would be evicted at once). k, v: [B, H_kv, n, d_h] views of any layout.
  /// position must equal next_position(). Checks run before anything is written; k and v must
  /// not overlap the cache. Allocates nothing.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index position) {
    check_append(k, v, position);
    const Index n = k.seq();
    const Index w = window();
    const Index kept = std::min(n, w);
    const Index first = position + n - kept;  // absolute position of the first kept token
    // At most two runs: slots [first mod W, W) then [0, ...).
    const Index slot = first % w;
    const Index run = std::min(kept, w - slot);
    const Index src = n - kept;
    buffers_.write(k, v, src, run, slot);
    if (kept > run) buffers_.write(k, v, src + run, kept - run, 0);
    next_.get() += n;
  }

  /// Everything append checks, without appending.
  void check_append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    Index position) const {
    detail::check_constructed(batch() >= 1, "sliding_window_cache", "cache");
    detail::check_kv_chunk(k, v, shape(), "sliding_window_cache");
    detail::check_append_position(position, next_, "sliding_window_cache");
    // The ring holds only the last W tokens, so n is otherwise unbounded: the next position
    // after the chunk must still be an Index.
    detail::checked_sum(next_, k.seq(), "sliding_window_cache", "position + n");
  }

  /// The held tokens as at most two runs of consecutive positions, oldest first; an unused
  /// entry has keys.seq() == 0. Allocates nothing.
  std::array<Segment, 2> segments() const {
    std::array<Segment, 2> result;
    const Index held = size();
    if (held == 0) return result;
    const Index first = first_position();
    const Index slot = first % window();
    const Index run = std::min(held, window() - slot);
    result[0] = segment(first, slot, run);
    result[1] = segment(first + run, 0, held - run);
    return result;
  }

  /// Forgets every token (the memory is kept).
  void clear() { next_ = 0; }

 private:
  const HeadsShape& shape() const { return buffers_.shape(); }

  Segment segment(Index first_position, Index slot, Index count) const {
    return Segment{first_position, buffers_.keys(slot, count), buffers_.values(slot, count)};
  }

  detail::KvBuffers<Scalar, Storage> buffers_;  // [B, H_kv, W, d_h] each
  detail::ResetOnMove<Index> next_;
};

// ---------------------------------------------------------------------------------------------
// LatentCache (§9.4)
// ---------------------------------------------------------------------------------------------

/// The shape of a LatentCache: B sequences of up to C tokens, each token d_kv latent values and
/// H_kr rotated K_rope heads of d_r.
struct LatentCacheShape {
  Index batch = 0;       ///< B
  Index latent_dim = 0;  ///< d_kv
  Index rope_heads = 0;  ///< H_kr
  Index rope_dim = 0;    ///< d_r (even)
  Index capacity = 0;    ///< C
};

/// The cache of one multi-head latent attention layer (§9): per token, c_kv = x·W_DKV (d_kv
/// values) and the rotated K_rope = RoPE(x·W_KR) (H_kr heads of d_r), side by side in one row
/// of width d_kv + H_kr·d_r, [B, C, d_kv + H_kr·d_r] in all and nothing else. K and V are never
/// stored: the naive decoder decompresses them from the rows, the absorbed one attends to rows()
/// directly (mla.hpp). Memory: B·C·(d_kv + H_kr·d_r) values in Storage's format, allocated at
/// construction. Overflow: append past C throws and leaves the cache unchanged; reserve() grows
/// explicitly. Scalar and Storage as for KvCache: the rows appended, and what the cache holds; a
/// block format stores c_kv and K_rope apart (each whole blocks), a whole-row format
/// (FlashMlaFp8Row) one element a token.
template <class Scalar, class Storage = Scalar>
class LatentCache {
 public:
  /// The type of the appended rows, and of the attention computed over them.
  using ComputeType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// An empty cache (see "Empty caches" above).
  LatentCache() = default;
  /// Allocates the rows. Throws unless every extent is >= 1 (and rope_dim is even).
  explicit LatentCache(const LatentCacheShape& shape) {
    detail::require_supported_scalar<Scalar>();
    detail::require_kv_format<Storage>();
    APEX_CHECK(shape.batch >= 1, "[latent_cache] batch (" << shape.batch << ") must be >= 1");
    APEX_CHECK(shape.latent_dim >= 1,
               "[latent_cache] latent_dim d_kv (" << shape.latent_dim << ") must be >= 1");
    APEX_CHECK(shape.rope_heads >= 1,
               "[latent_cache] rope_heads H_kr (" << shape.rope_heads << ") must be >= 1");
    APEX_CHECK(
        shape.rope_dim >= 2 && shape.rope_dim % 2 == 0,
        "[latent_cache] rope_dim d_r (" << shape.rope_dim << ") must be even and at least 2");
    APEX_CHECK(shape.capacity >= 1,
               "[latent_cache] capacity (" << shape.capacity << ") must be >= 1");
    detail::checked_sum(
        shape.latent_dim,
        detail::checked_product(shape.rope_heads, shape.rope_dim, "latent_cache", "H_kr*d_r"),
        "latent_cache", "d_kv + H_kr*d_r");
    check_part_widths(shape);
    rows_ = detail::zeroed_buffer<Storage>(storage_size(shape, shape.capacity));
    shape_ = shape;
  }

  /// Number of sequences B cached side by side.
  Index batch() const { return shape().batch; }
  /// Latent width d_kv: the first d_kv values of every row (c_kv).
  Index latent_dim() const { return shape().latent_dim; }
  /// Number of cached K_rope heads H_kr.
  Index rope_heads() const { return shape().rope_heads; }
  /// Width d_r of one K_rope head (even).
  Index rope_dim() const { return shape().rope_dim; }
  /// d_kv + H_kr·d_r: the values cached per token (mla_cache_values_per_token).
  Index row_width() const { return latent_dim() + rope_heads() * rope_dim(); }
  /// Tokens C that fit before append throws; changes only through reserve().
  Index capacity() const { return shape().capacity; }
  /// Tokens held: positions [0, size()).
  Index size() const { return size_; }
  /// Absolute position of the next token to append (= size()).
  Index next_position() const { return size_; }
  /// Exact bytes of the stored values: B·C rows of d_kv + H_kr·d_r values in Storage's format.
  std::int64_t bytes() const {
    return KvFormat<Storage>::bytes(static_cast<std::int64_t>(rows_.size()));
  }

  /// Appends n tokens at positions [position, position + n) from their latents and rotated
  /// rope keys: c_kv [B*n, d_kv], k_rope [B*n, H_kr·d_r] (B blocks of n rows, row b*n + s for
  /// token s of batch b). position must equal next_position() and size() + n <= capacity().
  /// Checks run before anything is written. Allocates nothing (unless an input is not
  /// row-major).
  template <class DC, class DR>
  void append(const Eigen::MatrixBase<DC>& c_kv, const Eigen::MatrixBase<DR>& k_rope,
              Index position) {
    const ConstRowRef<Scalar> c(c_kv.derived());
    const ConstRowRef<Scalar> r(k_rope.derived());
    detail::check_constructed(batch() >= 1, "latent_cache", "cache");
    check_rows(c.rows(), c.cols(), latent_dim(), "c_kv", "d_kv");
    check_rows(r.rows(), r.cols(), rope_heads() * rope_dim(), "k_rope", "H_kr*d_r");
    APEX_CHECK(r.rows() == c.rows(), "[latent_cache] k_rope rows ("
                                         << r.rows() << ") must equal c_kv rows (" << c.rows()
                                         << ")");
    detail::check_append_position(position, size_, "latent_cache");
    const Index n = c.rows() / batch();
    check_room(n);
    for (Index b = 0; b < batch(); ++b) {
      for (Index t = 0; t < n; ++t) {
        store(c.row(b * n + t).data(), r.row(b * n + t).data(), row_at(b, size_ + t));
      }
    }
    size_.get() += n;
  }

  /// Appends n tokens from whole rows [B*n, d_kv + H_kr·d_r] = [c_kv ‖ K_rope] (the layout of
  /// rows()). Same checks as the other overload.
  template <class D>
  void append(const Eigen::MatrixBase<D>& rows, Index position) {
    const ConstRowRef<Scalar> r(rows.derived());
    detail::check_constructed(batch() >= 1, "latent_cache", "cache");
    check_rows(r.rows(), r.cols(), row_width(), "rows", "d_kv + H_kr*d_r");
    detail::check_append_position(position, size_, "latent_cache");
    const Index n = r.rows() / batch();
    check_room(n);
    for (Index b = 0; b < batch(); ++b) {
      for (Index t = 0; t < n; ++t) {
        const Scalar* from = r.row(b * n + t).data();
        store(from, from + latent_dim(), row_at(b, size_ + t));
      }
    }
    size_.get() += n;
  }

  /// Throws unless n more tokens fit.
  void check_room(Index n) const {
    APEX_CHECK(n <= capacity() - size_, "[latent_cache] appending "
                                            << n << " tokens at position " << size()
                                            << " would exceed the capacity (" << capacity()
                                            << "): a LatentCache never grows by itself; reserve() "
                                               "a larger capacity");
  }

  /// [B, 1, size(), d_kv]: the cached c_kv (row stride d_kv + H_kr·d_r). The extents and
  /// strides of these views count elements of Storage (values, for the scalar formats; blocks
  /// of a quantized one: row_values gives the values). A whole-row format
  /// (is_latent_row_format_v) has only rows().
  HeadsView<const Storage> latent() const {
    static_assert(!is_latent_row_format_v<Storage>, "a whole-row format's cache has only rows()");
    const Index stride = elements(row_width());
    return HeadsView<const Storage>(rows_.data(), {batch(), 1, size_, elements(latent_dim())},
                                    {capacity() * stride, 0, stride});
  }
  /// [B, H_kr, size(), d_r]: the cached rotated K_rope.
  HeadsView<const Storage> rope_keys() const {
    static_assert(!is_latent_row_format_v<Storage>, "a whole-row format's cache has only rows()");
    const Index stride = elements(row_width());
    const Index head = elements(rope_dim());
    return HeadsView<const Storage>(
        size_ == 0 ? rows_.data() : rows_.data() + elements(latent_dim()),
        {batch(), rope_heads(), size_, head}, {capacity() * stride, head, stride});
  }
  /// [B, 1, size(), d_kv + H_kr·d_r]: whole rows [c_kv ‖ K_rope], the keys of absorbed MLA.
  HeadsView<const Storage> rows() const {
    const Index stride = elements(row_width());
    return HeadsView<const Storage>(rows_.data(), {batch(), 1, size_, stride},
                                    {capacity() * stride, 0, stride});
  }

  /// Drops the tokens at positions >= new_size (0 <= new_size <= size()). O(1).
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size_, "[latent_cache] truncate size ("
                                                       << new_size << ") must lie in [0, " << size()
                                                       << "]");
    size_ = new_size;
  }

  /// Grows the capacity to at least `capacity`, keeping the cached tokens (one copy). Never
  /// shrinks. Throws (cache unchanged) if the new size does not fit in 64 bits, or on an empty
  /// cache.
  void reserve(Index capacity) {
    detail::check_constructed(batch() >= 1, "latent_cache", "cache");
    if (capacity <= this->capacity()) return;
    detail::grow_token_rows<Storage>(rows_, {batch(), this->capacity(), elements(row_width())},
                                     capacity, size_, storage_size(shape(), capacity));
    shape_.get().capacity = capacity;
  }

  /// Forgets every token (the memory is kept).
  void clear() { size_ = 0; }

 private:
  const LatentCacheShape& shape() const { return shape_; }

  /// Elements of Storage in `values` values (a whole number of blocks: checked at construction).
  static Index elements(Index values) { return KvFormat<Storage>::elements(values); }

  /// Throws unless c_kv and K_rope are whole elements of Storage each, or, for a whole-row
  /// format, exactly the widths of its row.
  static void check_part_widths(const LatentCacheShape& s) {
    detail::check_latent_parts<Storage>(s, "latent_cache");
  }

  /// Stores one token's c_kv (d_kv values) and K_rope (H_kr·d_r) into `row`
  /// (detail::store_latent_row).
  void store(const Scalar* c_kv, const Scalar* k_rope, Storage* row) const {
    detail::store_latent_row(c_kv, latent_dim(), k_rope, rope_heads() * rope_dim(), row);
  }

  /// Elements of [B, capacity, d_kv + H_kr·d_r], checked together with their bytes.
  static Index storage_size(const LatentCacheShape& s, Index capacity) {
    const Index width = elements(s.latent_dim + s.rope_heads * s.rope_dim);
    const std::int64_t count =
        detail::checked_product({s.batch, capacity, width}, "latent_cache", "B*C*row_width");
    detail::checked_product(count, static_cast<std::int64_t>(sizeof(Storage)), "latent_cache",
                            "cache bytes");
    return static_cast<Index>(count);
  }

  /// The first element of token t's row of batch b.
  Storage* row_at(Index b, Index t) {
    return rows_.data() + (b * capacity() + t) * elements(row_width());
  }
  const Storage* row_at(Index b, Index t) const {
    return rows_.data() + (b * capacity() + t) * elements(row_width());
  }

  void check_rows(Index rows, Index cols, Index width, const char* name, const char* what) const {
    APEX_CHECK(cols == width, "[latent_cache] " << name << " width (" << cols << ") must equal "
                                                << what << " (" << width << ")");
    APEX_CHECK(rows % batch() == 0, "[latent_cache] "
                                        << name << " rows (" << rows
                                        << ") must be a multiple of the cache's batch (" << batch()
                                        << "): B blocks of n rows");
  }

  detail::ResetOnMove<LatentCacheShape> shape_;
  detail::ResetOnMove<Index> size_;
  detail::CacheBuffer<Storage> rows_;
};

}  // namespace apex
