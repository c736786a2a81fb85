// SPDX-License-Identifier: MIT
// Preconditions shared by several public headers (the caches, the cached attention, the layers),
// each written once: every message names the operation, the argument, its value and what was
// expected, and every check runs before anything is written.
#pragma once

#include <apex/config.hpp>
#include <apex/tensor.hpp>

#include <cstdint>

namespace apex::detail {

/// A view with the given shape and no data: for running shape checks before anything exists.
template <class T>
HeadsView<T> shape_only_view(const HeadsShape& shape) {
  return HeadsView<T>(nullptr, shape, {});
}

/// H_q >= 1, H_kv >= 1 and H_kv divides H_q.
inline void check_head_counts(Index num_q_heads, Index num_kv_heads, const char* op) {
  APEX_CHECK(num_q_heads >= 1, "[" << op << "] num_q_heads (" << num_q_heads << ") must be >= 1");
  APEX_CHECK(num_kv_heads >= 1,
             "[" << op << "] num_kv_heads (" << num_kv_heads << ") must be >= 1");
  APEX_CHECK(num_q_heads % num_kv_heads == 0, "[" << op << "] num_q_heads (" << num_q_heads
                                                  << ") must be a multiple of num_kv_heads ("
                                                  << num_kv_heads << ")");
}

/// The extents of a cache, each >= 1 (`slots_name` names the fourth: capacity or window).
inline void check_cache_dims(const HeadsShape& s, const char* op, const char* slots_name) {
  APEX_CHECK(s.batch >= 1, "[" << op << "] batch (" << s.batch << ") must be >= 1");
  APEX_CHECK(s.heads >= 1, "[" << op << "] num_kv_heads (" << s.heads << ") must be >= 1");
  APEX_CHECK(s.dim >= 1, "[" << op << "] head_dim (" << s.dim << ") must be >= 1");
  APEX_CHECK(s.seq >= 1, "[" << op << "] " << slots_name << " (" << s.seq << ") must be >= 1");
}

/// Scalars of a [B, H, slots, D] buffer (K or V of a cache), checked together with the bytes of
/// both buffers (which bytes() reports). The extents are already known to be >= 1.
template <class Scalar>
Index cache_buffer_size(const HeadsShape& s, const char* op) {
  const std::int64_t values =
      checked_product({s.batch, s.heads, s.seq, s.dim}, op, "B*H*slots*d_h");
  checked_product(values, 2 * static_cast<std::int64_t>(sizeof(Scalar)), op, "cache bytes");
  return static_cast<Index>(values);
}

/// An append at `position` to a cache whose next position is `next`: never backwards, never
/// skipping.
inline void check_append_position(Index position, Index next, const char* op) {
  APEX_CHECK(position >= next, "[" << op << "] position (" << position
                                   << ") goes backwards: the cache's next position is " << next);
  APEX_CHECK(position == next, "[" << op << "] position (" << position
                                   << ") skips ahead: the cache's next position is " << next);
}

/// A chunk of new keys and values [B, H, n, D] against a cache of batch B, H heads of width D.
template <class Scalar>
void check_kv_chunk(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    const HeadsShape& cache, const char* op) {
  APEX_CHECK(k.batch() == cache.batch && v.batch() == cache.batch,
             "[" << op << "] chunk batch (k " << k.batch() << ", v " << v.batch()
                 << ") must equal the cache's batch (" << cache.batch << ")");
  APEX_CHECK(k.heads() == cache.heads && v.heads() == cache.heads,
             "[" << op << "] chunk heads (k " << k.heads() << ", v " << v.heads()
                 << ") must equal the cache's num_kv_heads (" << cache.heads << ")");
  APEX_CHECK(k.dim() == cache.dim && v.dim() == cache.dim,
             "[" << op << "] chunk head width (k " << k.dim() << ", v " << v.dim()
                 << ") must equal the cache's head_dim (" << cache.dim << ")");
  APEX_CHECK(k.seq() >= 0, "[" << op << "] chunk length n (" << k.seq() << ") must be >= 0");
  APEX_CHECK(v.seq() == k.seq(), "[" << op << "] value chunk length (" << v.seq()
                                     << ") must equal the key chunk length (" << k.seq() << ")");
}

}  // namespace apex::detail
