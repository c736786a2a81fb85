// SPDX-License-Identifier: MIT
// Caches for decoding one token (or a short chunk) at a time (§7.4, §8.3, §9.4, §10), the
// attention of new queries over a sliding-window cache, and the memory they take.
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
#pragma once

#include <apex/config.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace apex {

namespace detail {

/// Scalars of a [B, H, slots, D] buffer (K or V of a cache), checked together with the bytes of
/// both buffers (which bytes() reports). The dimensions are already known to be >= 1.
template <class Scalar>
Index cache_buffer_size(Index batch, Index heads, Index slots, Index dim, const char* op) {
  const std::int64_t values = checked_product({batch, heads, slots, dim}, op, "B*H*slots*d_h");
  checked_product(values, 2 * static_cast<std::int64_t>(sizeof(Scalar)), op, "cache bytes");
  return static_cast<Index>(values);
}

inline void check_append_position(Index position, Index next, const char* op) {
  APEX_CHECK(position >= next, "[" << op << "] position (" << position
                                   << ") goes backwards: the cache's next position is " << next);
  APEX_CHECK(position == next, "[" << op << "] position (" << position
                                   << ") skips ahead: the cache's next position is " << next);
}

/// A chunk of new keys and values [B, H, n, D] against a cache of batch B, H heads of width D.
template <class Scalar>
void check_kv_chunk(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index batch,
                    Index heads, Index dim, const char* op) {
  APEX_CHECK(k.batch() == batch && v.batch() == batch,
             "[" << op << "] chunk batch (k " << k.batch() << ", v " << v.batch()
                 << ") must equal the cache's batch (" << batch << ")");
  APEX_CHECK(k.heads() == heads && v.heads() == heads,
             "[" << op << "] chunk heads (k " << k.heads() << ", v " << v.heads()
                 << ") must equal the cache's num_kv_heads (" << heads << ")");
  APEX_CHECK(k.dim() == dim && v.dim() == dim,
             "[" << op << "] chunk head width (k " << k.dim() << ", v " << v.dim()
                 << ") must equal the cache's head_dim (" << dim << ")");
  APEX_CHECK(k.seq() >= 0, "[" << op << "] chunk length n (" << k.seq() << ") must be >= 0");
  APEX_CHECK(v.seq() == k.seq(), "[" << op << "] value chunk length (" << v.seq()
                                     << ") must equal the key chunk length (" << k.seq() << ")");
}

inline void check_cache_dims(Index batch, Index heads, Index dim, Index slots, const char* op,
                             const char* slots_name) {
  APEX_CHECK(batch >= 1, "[" << op << "] batch (" << batch << ") must be >= 1");
  APEX_CHECK(heads >= 1, "[" << op << "] num_kv_heads (" << heads << ") must be >= 1");
  APEX_CHECK(dim >= 1, "[" << op << "] head_dim (" << dim << ") must be >= 1");
  APEX_CHECK(slots >= 1, "[" << op << "] " << slots_name << " (" << slots << ") must be >= 1");
}

/// Copies a [B, H, n, D] view into rows [first, first + n) of a [B, H, slots, D] buffer.
template <class Scalar>
void write_rows(const HeadsView<const Scalar>& src, Scalar* dst, Index slots, Index src_row,
                Index count, Index first) {
  const Index heads = src.heads();
  const Index dim = src.dim();
  const HeadsView<Scalar> target(dst, src.batch(), heads, slots, dim, heads * slots * dim,
                                 slots * dim, dim);
  for (Index b = 0; b < src.batch(); ++b) {
    for (Index h = 0; h < heads; ++h) {
      target.head(b, h).middleRows(first, count) = src.head(b, h).middleRows(src_row, count);
    }
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// KvCache (§7.4, §8.3)
// ---------------------------------------------------------------------------------------------

/// The full K/V cache of one multi-head or grouped-query attention layer: K and V of every token
/// so far, [B, H_kv, C, d_h] each, capacity C fixed at construction. keys() and values() are
/// HeadsViews of the first size() rows of every head (head stride C·d_h), ready for apex::sdpa.
/// Memory: 2·B·H_kv·C·d_h scalars, allocated (zeroed) at construction, never implicitly more.
/// Overflow: append past C throws and leaves the cache unchanged; reserve() grows explicitly.
template <class Scalar>
class KvCache {
 public:
  /// Allocates K and V. Throws unless batch, num_kv_heads, head_dim and capacity are >= 1.
  KvCache(Index batch, Index num_kv_heads, Index head_dim, Index capacity)
      : batch_(batch), heads_(num_kv_heads), dim_(head_dim) {
    detail::require_supported_scalar<Scalar>();
    detail::check_cache_dims(batch, num_kv_heads, head_dim, capacity, "kv_cache", "capacity");
    const Index size =
        detail::cache_buffer_size<Scalar>(batch, num_kv_heads, capacity, head_dim, "kv_cache");
    capacity_ = capacity;
    k_ = Vector<Scalar>::Zero(size);
    v_ = Vector<Scalar>::Zero(size);
  }

  /// Number of sequences B cached side by side.
  Index batch() const { return batch_; }
  /// Number of cached K/V heads H_kv (H_q for MHA, fewer for GQA/MQA).
  Index num_kv_heads() const { return heads_; }
  /// Per-head width d_h of K and V.
  Index head_dim() const { return dim_; }
  /// Tokens C that fit before append throws; changes only through reserve().
  Index capacity() const { return capacity_; }
  /// Tokens held: positions [0, size()).
  Index size() const { return size_; }
  /// Absolute position of the next token to append (= size()).
  Index next_position() const { return size_; }
  /// Exact bytes of the stored values: 2·B·H_kv·C·d_h·sizeof(Scalar) (K and V).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(k_.size() + v_.size()) *
           static_cast<std::int64_t>(sizeof(Scalar));
  }

  /// Appends a chunk of n tokens at absolute positions [position, position + n):
  ///   k, v: [B, H_kv, n, d_h] views of any layout (for a projection's token-major output
  ///   [B*n, H_kv·d_h] use HeadsView::token_major or ProjectedQkv::k_heads()).
  /// position must equal next_position() (never backwards, never skipping) and size() + n must
  /// not exceed capacity(). Every check runs before anything is written; k and v must not
  /// overlap the cache. Allocates nothing.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index position) {
    check_append(k, v, position);
    detail::write_rows(k, k_.data(), capacity_, 0, k.seq(), size_);
    detail::write_rows(v, v_.data(), capacity_, 0, v.seq(), size_);
    size_ += k.seq();
  }

  /// Everything append checks, without appending: for callers that must validate a whole step
  /// before changing any cache.
  void check_append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    Index position) const {
    detail::check_kv_chunk(k, v, batch_, heads_, dim_, "kv_cache");
    detail::check_append_position(position, size_, "kv_cache");
    check_room(k.seq());
  }

  /// Throws unless n more tokens fit.
  void check_room(Index n) const {
    APEX_CHECK(n <= capacity_ - size_, "[kv_cache] appending "
                                           << n << " tokens at position " << size_
                                           << " would exceed the capacity (" << capacity_
                                           << "): a KvCache never grows by itself; reserve() a "
                                              "larger capacity (or use a SlidingWindowCache for a "
                                              "windowed layer)");
  }

  /// [B, H_kv, size(), d_h] view of the cached keys (head stride C·d_h), no copy. It holds
  /// size() as of the call, and reserve() frees the memory it points to.
  HeadsView<const Scalar> keys() const { return view(k_.data()); }
  /// [B, H_kv, size(), d_h] view of the cached values; same layout and lifetime as keys().
  HeadsView<const Scalar> values() const { return view(v_.data()); }

  /// Drops the tokens at positions >= new_size (0 <= new_size <= size()). O(1).
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size_,
               "[kv_cache] truncate size (" << new_size << ") must lie in [0, " << size_ << "]");
    size_ = new_size;
  }

  /// Grows the capacity to at least `capacity`, keeping the cached tokens (one copy; allocates
  /// the new K and V, then frees the old ones). Never shrinks. Throws (cache unchanged) if the
  /// new size does not fit in 64 bits.
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    const Index size =
        detail::cache_buffer_size<Scalar>(batch_, heads_, capacity, dim_, "kv_cache");
    Vector<Scalar> k = Vector<Scalar>::Zero(size);
    Vector<Scalar> v = Vector<Scalar>::Zero(size);
    detail::write_rows(keys(), k.data(), capacity, 0, size_, 0);
    detail::write_rows(values(), v.data(), capacity, 0, size_, 0);
    k_ = std::move(k);
    v_ = std::move(v);
    capacity_ = capacity;
  }

  /// Forgets every token (the memory is kept).
  void clear() { size_ = 0; }

 private:
  HeadsView<const Scalar> view(const Scalar* data) const {
    return HeadsView<const Scalar>(data, batch_, heads_, size_, dim_, heads_ * capacity_ * dim_,
                                   capacity_ * dim_, dim_);
  }

  Index batch_ = 0;
  Index heads_ = 0;
  Index dim_ = 0;
  Index capacity_ = 0;
  Index size_ = 0;
  Vector<Scalar> k_;
  Vector<Scalar> v_;
};

// ---------------------------------------------------------------------------------------------
// SlidingWindowCache (§10)
// ---------------------------------------------------------------------------------------------

/// The cache of a sliding-window layer (§10.2: query i sees keys 0 <= i − j < W): K and V of the
/// last W tokens only, [B, H_kv, W, d_h] each, as a ring where absolute position p lives in slot
/// p mod W. Memory: 2·B·H_kv·W·d_h scalars, allocated at construction and constant afterwards,
/// however many tokens pass through. The cache never fills; old tokens are overwritten.
///
/// W slots are enough for any chunk: the new tokens attend to what the ring holds (the W tokens
/// before them) and to each other, and only then are appended (see sdpa_with_window_cache).
template <class Scalar>
class SlidingWindowCache {
 public:
  /// A run of held tokens with consecutive positions [first_position, first_position + n):
  /// keys and values are [B, H_kv, n, d_h] views into the ring.
  struct Segment {
    Index first_position = 0;        ///< absolute position of the run's first token
    HeadsView<const Scalar> keys;    ///< [B, H_kv, n, d_h] keys of the run (n = keys.seq())
    HeadsView<const Scalar> values;  ///< [B, H_kv, n, d_h] values of the run
  };

  /// Allocates the ring. Throws unless batch, num_kv_heads, head_dim and window are >= 1.
  SlidingWindowCache(Index batch, Index num_kv_heads, Index head_dim, Index window)
      : batch_(batch), heads_(num_kv_heads), dim_(head_dim) {
    detail::require_supported_scalar<Scalar>();
    detail::check_cache_dims(batch, num_kv_heads, head_dim, window, "sliding_window_cache",
                             "window");
    const Index size = detail::cache_buffer_size<Scalar>(batch, num_kv_heads, window, head_dim,
                                                         "sliding_window_cache");
    window_ = window;
    k_ = Vector<Scalar>::Zero(size);
    v_ = Vector<Scalar>::Zero(size);
  }

  /// Number of sequences B cached side by side.
  Index batch() const { return batch_; }
  /// Number of cached K/V heads H_kv.
  Index num_kv_heads() const { return heads_; }
  /// Per-head width d_h of K and V.
  Index head_dim() const { return dim_; }
  /// Window W: the number of ring slots, i.e. the most tokens ever held (§10.2).
  Index window() const { return window_; }
  /// Absolute position of the next token (= tokens seen so far).
  Index next_position() const { return next_; }
  /// Tokens held: min(next_position(), W), positions [first_position(), next_position()).
  Index size() const { return std::min(next_, window_); }
  /// Absolute position of the oldest held token: next_position() − size() (0 until the ring
  /// wraps).
  Index first_position() const { return next_ - size(); }
  /// Exact bytes of the stored values: 2·B·H_kv·W·d_h·sizeof(Scalar), whatever next_position().
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(k_.size() + v_.size()) *
           static_cast<std::int64_t>(sizeof(Scalar));
  }

  /// Appends a chunk of n tokens at positions [position, position + n); only the last min(n, W)
  /// are kept (the rest would be evicted at once). k, v: [B, H_kv, n, d_h] views of any layout.
  /// position must equal next_position(). Checks run before anything is written; k and v must
  /// not overlap the cache. Allocates nothing.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index position) {
    check_append(k, v, position);
    const Index n = k.seq();
    const Index kept = std::min(n, window_);
    const Index first = position + n - kept;  // absolute position of the first kept token
    // At most two runs: slots [first mod W, W) then [0, ...).
    const Index slot = first % window_;
    const Index run = std::min(kept, window_ - slot);
    const Index src = n - kept;
    detail::write_rows(k, k_.data(), window_, src, run, slot);
    detail::write_rows(v, v_.data(), window_, src, run, slot);
    if (kept > run) {
      detail::write_rows(k, k_.data(), window_, src + run, kept - run, 0);
      detail::write_rows(v, v_.data(), window_, src + run, kept - run, 0);
    }
    next_ += n;
  }

  /// Everything append checks, without appending.
  void check_append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    Index position) const {
    detail::check_kv_chunk(k, v, batch_, heads_, dim_, "sliding_window_cache");
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
    const Index first = first_position();
    const Index slot = first % window_;
    const Index run = std::min(held, window_ - slot);
    result[0] = segment(first, slot, run);
    result[1] = segment(first + run, 0, held - run);
    return result;
  }

  /// Forgets every token (the memory is kept).
  void clear() { next_ = 0; }

 private:
  Segment segment(Index first_position, Index slot, Index count) const {
    const auto view = [&](const Scalar* data) {
      return HeadsView<const Scalar>(data + slot * dim_, batch_, heads_, count, dim_,
                                     heads_ * window_ * dim_, window_ * dim_, dim_);
    };
    return Segment{first_position, view(k_.data()), view(v_.data())};
  }

  Index batch_ = 0;
  Index heads_ = 0;
  Index dim_ = 0;
  Index window_ = 0;
  Index next_ = 0;
  Vector<Scalar> k_;
  Vector<Scalar> v_;
};

// ---------------------------------------------------------------------------------------------
// LatentCache (§9.4)
// ---------------------------------------------------------------------------------------------

/// The cache of one multi-head latent attention layer (§9): per token, c_kv = x·W_DKV (d_kv
/// values) and the rotated K_rope = RoPE(x·W_KR) (H_kr heads of d_r), side by side in one row
/// of width d_kv + H_kr·d_r, [B, C, d_kv + H_kr·d_r] in all and nothing else. K and V are never
/// stored: the naive decoder decompresses them from latent(), the absorbed one attends to rows()
/// directly (mla.hpp). Memory: B·C·(d_kv + H_kr·d_r) scalars, allocated at construction.
/// Overflow: append past C throws and leaves the cache unchanged; reserve() grows explicitly.
template <class Scalar>
class LatentCache {
 public:
  /// Allocates the rows. Throws unless every argument is >= 1 (and rope_dim is even).
  LatentCache(Index batch, Index latent_dim, Index rope_heads, Index rope_dim, Index capacity)
      : batch_(batch), latent_(latent_dim), rope_heads_(rope_heads), rope_dim_(rope_dim) {
    detail::require_supported_scalar<Scalar>();
    APEX_CHECK(batch >= 1, "[latent_cache] batch (" << batch << ") must be >= 1");
    APEX_CHECK(latent_dim >= 1,
               "[latent_cache] latent_dim d_kv (" << latent_dim << ") must be >= 1");
    APEX_CHECK(rope_heads >= 1,
               "[latent_cache] rope_heads H_kr (" << rope_heads << ") must be >= 1");
    APEX_CHECK(rope_dim >= 2 && rope_dim % 2 == 0,
               "[latent_cache] rope_dim d_r (" << rope_dim << ") must be even and at least 2");
    APEX_CHECK(capacity >= 1, "[latent_cache] capacity (" << capacity << ") must be >= 1");
    detail::checked_sum(latent_dim,
                        detail::checked_product(rope_heads, rope_dim, "latent_cache", "H_kr*d_r"),
                        "latent_cache", "d_kv + H_kr*d_r");
    const Index size = storage_size(capacity);
    capacity_ = capacity;
    rows_ = Vector<Scalar>::Zero(size);
  }

  /// Number of sequences B cached side by side.
  Index batch() const { return batch_; }
  /// Latent width d_kv: the first d_kv values of every row (c_kv).
  Index latent_dim() const { return latent_; }
  /// Number of cached K_rope heads H_kr.
  Index rope_heads() const { return rope_heads_; }
  /// Width d_r of one K_rope head (even).
  Index rope_dim() const { return rope_dim_; }
  /// d_kv + H_kr·d_r: the values cached per token (mla_cache_values_per_token).
  Index row_width() const { return latent_ + rope_heads_ * rope_dim_; }
  /// Tokens C that fit before append throws; changes only through reserve().
  Index capacity() const { return capacity_; }
  /// Tokens held: positions [0, size()).
  Index size() const { return size_; }
  /// Absolute position of the next token to append (= size()).
  Index next_position() const { return size_; }
  /// Exact bytes of the stored values: B·C·(d_kv + H_kr·d_r)·sizeof(Scalar).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(rows_.size()) * static_cast<std::int64_t>(sizeof(Scalar));
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
    check_rows(c.rows(), c.cols(), latent_, "c_kv", "d_kv");
    check_rows(r.rows(), r.cols(), rope_heads_ * rope_dim_, "k_rope", "H_kr*d_r");
    APEX_CHECK(r.rows() == c.rows(), "[latent_cache] k_rope rows ("
                                         << r.rows() << ") must equal c_kv rows (" << c.rows()
                                         << ")");
    detail::check_append_position(position, size_, "latent_cache");
    const Index n = c.rows() / batch_;
    check_room(n);
    for (Index b = 0; b < batch_; ++b) {
      auto target = batch_rows(b).middleRows(size_, n);
      target.leftCols(latent_) = c.middleRows(b * n, n);
      target.rightCols(rope_heads_ * rope_dim_) = r.middleRows(b * n, n);
    }
    size_ += n;
  }

  /// Appends n tokens from whole rows [B*n, d_kv + H_kr·d_r] = [c_kv ‖ K_rope] (the layout of
  /// rows()). Same checks as the other overload.
  template <class D>
  void append(const Eigen::MatrixBase<D>& rows, Index position) {
    const ConstRowRef<Scalar> r(rows.derived());
    check_rows(r.rows(), r.cols(), row_width(), "rows", "d_kv + H_kr*d_r");
    detail::check_append_position(position, size_, "latent_cache");
    const Index n = r.rows() / batch_;
    check_room(n);
    for (Index b = 0; b < batch_; ++b) batch_rows(b).middleRows(size_, n) = r.middleRows(b * n, n);
    size_ += n;
  }

  /// Throws unless n more tokens fit.
  void check_room(Index n) const {
    APEX_CHECK(n <= capacity_ - size_, "[latent_cache] appending "
                                           << n << " tokens at position " << size_
                                           << " would exceed the capacity (" << capacity_
                                           << "): a LatentCache never grows by itself; reserve() "
                                              "a larger capacity");
  }

  /// [B, 1, size(), d_kv]: the cached c_kv (row stride d_kv + H_kr·d_r).
  HeadsView<const Scalar> latent() const {
    return HeadsView<const Scalar>(rows_.data(), batch_, 1, size_, latent_, capacity_ * row_width(),
                                   0, row_width());
  }
  /// [B, H_kr, size(), d_r]: the cached rotated K_rope.
  HeadsView<const Scalar> rope_keys() const {
    return HeadsView<const Scalar>(rows_.data() + latent_, batch_, rope_heads_, size_, rope_dim_,
                                   capacity_ * row_width(), rope_dim_, row_width());
  }
  /// [B, 1, size(), d_kv + H_kr·d_r]: whole rows [c_kv ‖ K_rope], the keys of absorbed MLA.
  HeadsView<const Scalar> rows() const {
    return HeadsView<const Scalar>(rows_.data(), batch_, 1, size_, row_width(),
                                   capacity_ * row_width(), 0, row_width());
  }

  /// Drops the tokens at positions >= new_size (0 <= new_size <= size()). O(1).
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size_, "[latent_cache] truncate size ("
                                                       << new_size << ") must lie in [0, " << size_
                                                       << "]");
    size_ = new_size;
  }

  /// Grows the capacity to at least `capacity`, keeping the cached tokens (one copy). Never
  /// shrinks. Throws (cache unchanged) if the new size does not fit in 64 bits.
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    Vector<Scalar> rows = Vector<Scalar>::Zero(storage_size(capacity));
    for (Index b = 0; b < batch_; ++b) {
      Eigen::Map<RowMatrix<Scalar>>(rows.data() + b * capacity * row_width(), capacity, row_width())
          .topRows(size_) = batch_rows(b).topRows(size_);
    }
    rows_ = std::move(rows);
    capacity_ = capacity;
  }

  /// Forgets every token (the memory is kept).
  void clear() { size_ = 0; }

 private:
  /// Scalars of [B, capacity, d_kv + H_kr·d_r], checked together with their bytes.
  Index storage_size(Index capacity) const {
    const std::int64_t values =
        detail::checked_product({batch_, capacity, row_width()}, "latent_cache", "B*C*row_width");
    detail::checked_product(values, static_cast<std::int64_t>(sizeof(Scalar)), "latent_cache",
                            "cache bytes");
    return static_cast<Index>(values);
  }

  Eigen::Map<RowMatrix<Scalar>> batch_rows(Index b) {
    return Eigen::Map<RowMatrix<Scalar>>(rows_.data() + b * capacity_ * row_width(), capacity_,
                                         row_width());
  }
  Eigen::Map<const RowMatrix<Scalar>> batch_rows(Index b) const {
    return Eigen::Map<const RowMatrix<Scalar>>(rows_.data() + b * capacity_ * row_width(),
                                               capacity_, row_width());
  }

  void check_rows(Index rows, Index cols, Index width, const char* name, const char* what) const {
    APEX_CHECK(cols == width, "[latent_cache] " << name << " width (" << cols << ") must equal "
                                                << what << " (" << width << ")");
    APEX_CHECK(rows % batch_ == 0, "[latent_cache] "
                                       << name << " rows (" << rows
                                       << ") must be a multiple of the cache's batch (" << batch_
                                       << "): B blocks of n rows");
  }

  Index batch_ = 0;
  Index latent_ = 0;
  Index rope_heads_ = 0;
  Index rope_dim_ = 0;
  Index capacity_ = 0;
  Index size_ = 0;
  Vector<Scalar> rows_;
};

// ---------------------------------------------------------------------------------------------
// Attention against a cache
// ---------------------------------------------------------------------------------------------

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

}  // namespace detail

/// Attention of n new queries over a sliding-window cache plus the chunk's own keys (§10, §6.2),
/// without changing the cache: the keys are what the cache holds (the at most W tokens before
/// the chunk) followed by the chunk's n keys. Each of the at most three runs of consecutive
/// positions (two in the ring, one in the chunk) is one apex::sdpa call with its own key_offset;
/// the partial results are combined exactly by merge_attention (log-sum-exp), and runs the
/// rule forbids entirely are skipped. Afterwards the caller appends the chunk (append keeps the
/// last W). Queries sit at positions [next, next + n), next = cache.next_position().
///   q: [B, H_q, n, d_h], k_new, v_new: [B, H_kv, n, d_h] (any layout)
///   rule: causal with window <= W (and an optional prefix); offsets unset
///   -> out: [B, H_q, n, d_h] (any layout; must not overlap the inputs).
/// Every check runs before out is written. Allocates, when more than one run is attended, a
/// [B, H_q, n, d_h] partial result and two [B, H_q, n] log-sum-exps.
template <class Scalar>
void sdpa_with_window_cache(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k_new,
                            const ConstHeadsView<Scalar>& v_new, const PositionMask& rule,
                            const SdpaParams& params, const SlidingWindowCache<Scalar>& cache,
                            const HeadsView<Scalar>& out) {
  detail::require_supported_scalar<Scalar>();
  const char* op = "sdpa_with_window_cache";
  const Index next = cache.next_position();
  const Index n = q.seq();
  detail::check_kv_chunk(k_new, v_new, cache.batch(), cache.num_kv_heads(), cache.head_dim(), op);
  APEX_CHECK(k_new.seq() == n, "[" << op << "] chunk keys (" << k_new.seq()
                                   << ") must be as many as the queries (" << n << ")");
  detail::check_cached_rule(rule, next, next, n, op);
  detail::check_window_rule(rule, cache.window(), op);
  AttentionMask<Scalar> whole;
  whole.positions = rule;
  whole.positions.query_offset = next;
  whole.positions.key_offset = cache.first_position();
  detail::check_sdpa<Scalar>(q,
                             detail::shape_only_view<const Scalar>(k_new.batch(), k_new.heads(),
                                                                   cache.size() + n, k_new.dim()),
                             detail::shape_only_view<const Scalar>(v_new.batch(), v_new.heads(),
                                                                   cache.size() + n, v_new.dim()),
                             whole, params, out, {}, op);

  struct Run {
    Index first_position;
    HeadsView<const Scalar> keys;
    HeadsView<const Scalar> values;
  };
  std::array<Run, 3> runs;
  Index count = 0;
  const auto add = [&](Index first, const HeadsView<const Scalar>& k,
                       const HeadsView<const Scalar>& v) {
    if (k.seq() == 0) return;
    if (classify_block(rule, next, next + n, first, first + k.seq()) == BlockCoverage::kNone) {
      return;
    }
    runs[static_cast<std::size_t>(count++)] = Run{first, k, v};
  };
  for (const auto& segment : cache.segments()) {
    add(segment.first_position, segment.keys, segment.values);
  }
  add(next, k_new, v_new);  // never skipped: each query sees itself

  const auto mask_for = [&](Index first) {
    AttentionMask<Scalar> mask;
    mask.positions = rule;
    mask.positions.query_offset = next;
    mask.positions.key_offset = first;
    return mask;
  };
  if (count == 1) {
    sdpa<Scalar>(q, runs[0].keys, runs[0].values, mask_for(runs[0].first_position), params, out);
    return;
  }
  const Index batch = q.batch();
  const Index heads = q.heads();
  HeadsTensor<Scalar> lse(batch, heads, n, 1);
  HeadsTensor<Scalar> part(batch, heads, n, out.dim());
  HeadsTensor<Scalar> part_lse(batch, heads, n, 1);
  sdpa<Scalar>(q, runs[0].keys, runs[0].values, mask_for(runs[0].first_position), params, out,
               lse.view());
  for (Index r = 1; r < count; ++r) {
    const Run& run = runs[static_cast<std::size_t>(r)];
    sdpa<Scalar>(q, run.keys, run.values, mask_for(run.first_position), params, part.view(),
                 part_lse.view());
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        Eigen::Map<Vector<Scalar>> acc_lse(lse.head(b, h).data(), n);
        const Eigen::Map<const Vector<Scalar>> new_lse(part_lse.head(b, h).data(), n);
        const auto acc = out.head(b, h);
        merge_attention(acc, acc_lse, part.head(b, h), new_lse, RowRef<Scalar>(acc),
                        VectorRef<Scalar>(acc_lse));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Memory (§7.4, §8.3, §9.4, §10.3)
// ---------------------------------------------------------------------------------------------

/// Bytes of a sliding-window cache after `context` tokens: 2·B·min(S, W)·H_kv·d_h·bytes — the
/// full-cache formula of §7.4 with S capped at W. Throws on a negative argument or overflow.
inline std::int64_t sliding_window_cache_bytes(std::int64_t batch, std::int64_t context,
                                               std::int64_t window, std::int64_t num_kv_heads,
                                               std::int64_t head_dim,
                                               std::int64_t bytes_per_value) {
  APEX_CHECK(context >= 0 && window >= 0, "[sliding_window_cache_bytes] context ("
                                              << context << ") and window (" << window
                                              << ") must be >= 0");
  return detail::checked_kv_cache_bytes(batch, std::min(context, window), num_kv_heads, head_dim,
                                        bytes_per_value, "sliding_window_cache_bytes");
}

/// Bytes of a latent cache (§9.4) after `context` tokens: B·S·(d_kv + H_kr·d_r)·bytes. With
/// rope_heads = 0 it is §9.4's count (c_kv only), which undercounts what a decoder keeps.
/// Throws on a negative argument or overflow.
inline std::int64_t latent_cache_bytes(std::int64_t batch, std::int64_t context,
                                       std::int64_t latent_dim, std::int64_t rope_heads,
                                       std::int64_t rope_dim, std::int64_t bytes_per_value) {
  const char* op = "latent_cache_bytes";
  const std::int64_t width =
      detail::checked_sum(latent_dim, detail::checked_product(rope_heads, rope_dim, op, "H_kr*d_r"),
                          op, "d_kv + H_kr*d_r");
  return detail::checked_product({batch, context, width, bytes_per_value}, op,
                                 "B*S*(d_kv + H_kr*d_r)*bytes");
}

/// The dimensions the §7.4 / §8.3 / §9.4 / §10.3 cache comparisons are made at. No defaults: the
/// documents give APEX-1 Large's H_q = 128, H_kv = 8, d_h = 128, d_kv = 512, W = 4096 and a 128K
/// context, but no d_r (their range is 32–64).
struct CacheComparisonParams {
  Index num_q_heads = 0;      ///< H_q (the MHA baseline caches H_q heads)
  Index num_kv_heads = 0;     ///< H_kv of GQA
  Index head_dim = 0;         ///< d_h
  Index latent_dim = 0;       ///< d_kv of MLA
  Index rope_dim = 0;         ///< d_r of MLA's decoupled RoPE
  Index rope_heads = 0;       ///< H_kr, MLA's K_rope heads (H_kv as §9.3 writes it, or 1)
  Index window = 0;           ///< W of the sliding-window layers
  Index context = 0;          ///< S, tokens cached
  Index batch = 1;            ///< B
  Index bytes_per_value = 2;  ///< 2 for FP16 / BF16 as §7.4 assumes, 4 for float
};

/// One row of the cache comparison.
struct CacheComparisonRow {
  std::string method;                 ///< "MHA", "GQA", "MQA", "MLA (as §9.4 counts)", ...
  std::string cached;                 ///< what is stored per token
  std::int64_t values_per_token = 0;  ///< per layer and sequence (window layers: while filling)
  std::int64_t bytes_per_layer = 0;   ///< at the given context and batch
  double relative = 0.0;              ///< bytes_per_layer / the MHA row's
};

/// The §7.4, §8.3 and §9.4 tables (and the §10.3 sliding window) for one set of dimensions, one
/// layer each, relative to multi-head attention with H_q heads:
///   MHA                   K + V, H_q heads           2·H_q·d_h per token   (§7.4, §8.3)
///   GQA                   K + V, H_kv heads          2·H_kv·d_h            (§8.3, §9.4)
///   MQA                   K + V, one head            2·d_h                 (§8.3)
///   GQA + window          K + V, H_kv heads, last W  2·H_kv·d_h, min(S, W) tokens (§10.3)
///   MLA (as §9.4 counts)  c_kv only                  d_kv                  (§9.4)
///   MLA                   c_kv + K_rope              d_kv + H_kr·d_r       (what is cached)
/// §7.4 prints "4 GB per layer" for the MHA row at 128K, FP16; the row is 8 GiB (K and V), and
/// §9.4's 1.6% is 1.5625% for c_kv alone (SEED-NOTES.md). Allocates the rows.
inline std::vector<CacheComparisonRow> cache_comparison(const CacheComparisonParams& p) {
  APEX_CHECK(p.num_q_heads >= 1 && p.num_kv_heads >= 1 && p.head_dim >= 1 && p.latent_dim >= 1 &&
                 p.rope_dim >= 1 && p.rope_heads >= 1 && p.window >= 1 && p.context >= 1 &&
                 p.batch >= 1 && p.bytes_per_value >= 1,
             "[cache_comparison] every dimension must be >= 1 (H_q "
                 << p.num_q_heads << ", H_kv " << p.num_kv_heads << ", d_h " << p.head_dim
                 << ", d_kv " << p.latent_dim << ", d_r " << p.rope_dim << ", H_kr " << p.rope_heads
                 << ", W " << p.window << ", S " << p.context << ", B " << p.batch << ", bytes "
                 << p.bytes_per_value << ")");
  const char* op = "cache_comparison";
  const auto kv_bytes = [&](std::int64_t heads, std::int64_t tokens) {
    return detail::checked_kv_cache_bytes(p.batch, tokens, heads, p.head_dim, p.bytes_per_value,
                                          op);
  };
  const auto kv_values = [&](std::int64_t heads) {
    return detail::checked_product({2, heads, p.head_dim}, op, "2*H*d_h");
  };
  const std::int64_t mha = kv_bytes(p.num_q_heads, p.context);
  const auto row = [&](std::string method, std::string cached, std::int64_t values,
                       std::int64_t bytes) {
    return CacheComparisonRow{std::move(method), std::move(cached), values, bytes,
                              static_cast<double>(bytes) / static_cast<double>(mha)};
  };
  const std::string kv_heads = std::to_string(p.num_kv_heads);
  const std::int64_t latent_values = detail::checked_sum(
      p.latent_dim, detail::checked_product(p.rope_heads, p.rope_dim, op, "H_kr*d_r"), op,
      "d_kv + H_kr*d_r");
  return {
      row("MHA", "K + V, " + std::to_string(p.num_q_heads) + " heads", kv_values(p.num_q_heads),
          mha),
      row("GQA", "K + V, " + kv_heads + " heads", kv_values(p.num_kv_heads),
          kv_bytes(p.num_kv_heads, p.context)),
      row("MQA", "K + V, 1 head", kv_values(1), kv_bytes(1, p.context)),
      row("GQA + window", "K + V, " + kv_heads + " heads, last " + std::to_string(p.window),
          kv_values(p.num_kv_heads), kv_bytes(p.num_kv_heads, std::min(p.context, p.window))),
      row("MLA (as §9.4 counts)", "c_kv only", p.latent_dim,
          detail::checked_product({p.batch, p.context, p.latent_dim, p.bytes_per_value}, op,
                                  "B*S*d_kv*bytes")),
      row("MLA", "c_kv + K_rope (" + std::to_string(p.rope_heads) + " heads)", latent_values,
          detail::checked_product({p.batch, p.context, latent_values, p.bytes_per_value}, op,
                                  "B*S*(d_kv + H_kr*d_r)*bytes")),
  };
}

}  // namespace apex
