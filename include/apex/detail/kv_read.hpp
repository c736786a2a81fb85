// SPDX-License-Identifier: MIT
// Reading K and V: every read of a key or value row by the tiled kernel (flash_attention.hpp)
// goes through this header.
//
// WHERE KEYS LIVE. A problem's keys are one or more segments of consecutive absolute positions
// (KeySegment): a contiguous [B, H_kv, n, d] view, or a pool of pages addressed through a block
// table. One head of a segment (SegmentHead) is read as runs of evenly strided rows: one run for
// a contiguous head, one per page for a paged one. A sliding-window cache's ring is two
// segments, plus the new chunk; a paged sequence is one.
//
// TWO READERS, BY PATH. The kernel computes in C (float or double) on rows stored as T (float,
// double, Eigen::half, Eigen::bfloat16):
//   load_rows   the block copy of the GEMM path: rows widened to C while they are copied,
//               by their format (KvFormat<T>::widen, kv_format.hpp), one run (page) at a time;
//   read_rows   the row reader of the streaming path: in place when the streaming products
//               widen T in registers themselves (streams_in_place: always on apex's float
//               kernels, for the 16-bit formats and most block formats too; on Eigen's where
//               the build targets AVX, for the 16-bit formats), else a panel of kStreamPanel
//               rows widened by load_rows just before it is used;
//   stored_rows rows as they are stored (the bfloat16 products pack them directly);
//   rows_as     rows as C, in place where they are stored as C (the GEMM path's keys-major
//               scores read them so), else widened by load_rows.
// Where a problem's values are the first columns of its keys' rows (values_lead_keys: absorbed
// MLA), the GEMM path reads each key block once, as C, for both products.
// The streaming products themselves (streamed_scores, streamed_update) pick apex's float kernels
// or Eigen's for the row type they are given.
//
// BLOCKS. for_each_key_block cuts the keys a query block may see into blocks that never straddle
// two segments and end on the segment's multiples of the block length, so that the same keys
// stored contiguously or in pages give the same blocks, and for_each_panel cuts a streamed block
// into panels that end where a page does. The products add key after key whatever the panels,
// so paged attention equals contiguous attention bit for bit (only the fallback on Eigen's public
// API, APEX_EIGEN_PUBLIC_ONLY, which sums a panel before adding it, differs by rounding).
//
// Allocates nothing: the buffers are the caller's (the tile's scratch).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/kv_format.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <type_traits>
#include <utility>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (row, count) pairs of one head
namespace apex::detail {

/// A run of keys with consecutive absolute positions [first_position, first_position + size()),
/// stored in one of two ways:
///   contiguous (pages null)  k [B, H_kv, n, d_qk] and v [B, H_kv, n, d_v]; size() = n;
///   paged                    k [pool pages, H_kv, page, d_qk] and v [pool pages, H_kv, page, d_v]
///                            are pools of pages (the views' batch axis is the page), and key
///                            row j lives in row j mod page of page pages[j / page]; size() =
///                            paged_rows, and the problem has one batch (b = 0).
/// The kernel reads a paged segment through its block table, page by page, never gathering it.
template <class TK, class TV>
struct KeySegment {
  HeadsView<const TK> k;
  HeadsView<const TV> v;
  Index first_position = 0;
  const Index* pages = nullptr;  // block table; null: contiguous
  Index paged_rows = 0;          // rows of a paged segment

  /// Keys in the segment.
  Index size() const { return pages == nullptr ? k.seq() : paged_rows; }
};

/// Rows of T at `data`, row j at data + j·stride.
template <class T>
struct ConstRows {
  const T* data;
  Index stride;
};

/// One head of a segment's K or V, read row by row: a contiguous head is one run of evenly
/// strided rows, a paged one a run per page.
template <class T>
class SegmentHead {
 public:
  /// Head (b, h) of `view` (a contiguous segment's K or V, or a pool of pages with `pages`).
  SegmentHead(const HeadsView<const T>& view, const Index* pages, Index b, Index h)
      : view_(view), pages_(pages), b_(b), h_(h) {}

  /// Width of a row.
  Index cols() const { return view_.dim(); }
  /// Rows from `row` to the end of its run (its page, or the head).
  Index run(Index row) const {
    if (pages_ == nullptr) return view_.seq() - row;
    return view_.seq() - row % view_.seq();
  }
  /// The rows of the run that starts at `row` (row < the head's rows).
  ConstRows<T> rows(Index row) const {
    const Index stride = view_.row_stride();
    if (pages_ == nullptr) return {row_data(view_, b_, h_, row), stride};
    const Index page = view_.seq();
    return {row_data(view_, pages_[row / page], h_, row % page), stride};
  }

 private:
  HeadsView<const T> view_;
  const Index* pages_;
  Index b_, h_;
};

/// The K and V heads (b, kv head) of a segment.
template <class TK, class TV>
SegmentHead<TK> key_head(const KeySegment<TK, TV>& segment, Index b, Index kv_head) {
  return {segment.k, segment.pages, b, kv_head};
}
template <class TK, class TV>
SegmentHead<TV> value_head(const KeySegment<TK, TV>& segment, Index b, Index kv_head) {
  return {segment.v, segment.pages, b, kv_head};
}

/// Keys of one panel of the streaming path (a multiple of stream_update's groups of 8 keys).
constexpr Index kStreamPanel = 32;

// ---------------------------------------------------------------------------------------------
// Loaders: every read of K and V
// ---------------------------------------------------------------------------------------------

/// The block copy: rows [row, row + n) of one head, written contiguously (n rows of
/// cols·kValuesPerElement values) to `dst` and widened from the head's format to C
/// (KvFormat<T>::widen, kv_format.hpp), one run (page) at a time.
template <class C, class T>
void load_rows(const SegmentHead<T>& head, Index row, Index n, C* dst) {
  using Format = KvFormat<T>;
  const Index cols = head.cols();
  const Index values = cols * Format::kValuesPerElement;
  while (n > 0) {
    const Index m = std::min(n, head.run(row));
    const ConstRows<T> src = head.rows(row);
    if (src.stride == cols) {  // one contiguous range: a single pass
      Format::widen(src.data, dst, m * cols);
    } else {
      for (Index r = 0; r < m; ++r)
        Format::widen(src.data + r * src.stride, dst + r * values, cols);
    }
    row += m;
    n -= m;
    dst += m * values;
  }
}

/// Rows [row, row + n) of one head as one block of evenly strided rows: in place when they lie
/// in one run, else copied as they are stored (nothing widened) into `buffer` (n × cols).
template <class T>
ConstRows<T> stored_rows(const SegmentHead<T>& head, Index row, Index n, T* buffer) {
  if (n <= head.run(row)) return head.rows(row);
  const Index cols = head.cols();
  for (Index done = 0; done < n;) {
    const Index m = std::min(n - done, head.run(row + done));
    const ConstRows<T> src = head.rows(row + done);
    for (Index r = 0; r < m; ++r) {
      std::copy_n(src.data + r * src.stride, cols, buffer + (done + r) * cols);
    }
    done += m;
  }
  return {buffer, cols};
}

/// Rows [row, row + n) of one head as rows of C: in place where they are stored as C in one run,
/// else copied (stored_rows) or widened (load_rows) into `buffer` (n rows of the head's values).
template <class C, class T>
ConstRows<C> rows_as(const SegmentHead<T>& head, Index row, Index n, C* buffer) {
  if constexpr (std::is_same_v<T, C>) {
    return stored_rows(head, row, n, buffer);
  } else {
    load_rows(head, row, n, buffer);
    return {buffer, head.cols() * KvFormat<T>::kValuesPerElement};
  }
}

/// Whether rows [row, row + n) of the value head v are, row for row, the first columns of the
/// same rows of the key head k (the same memory): MLA's values c_kv inside its keys
/// [c_kv ‖ K_rope] (mla_absorbed.hpp), which a tile then reads once for both products.
template <class TK, class TV>
bool values_lead_keys(const SegmentHead<TK>& k, const SegmentHead<TV>& v, Index row, Index n) {
  if constexpr (!std::is_same_v<TK, TV>) {
    return false;
  } else {
    if (v.cols() > k.cols()) return false;
    for (Index done = 0; done < n;) {
      const Index at = row + done;
      const Index m = std::min(n - done, k.run(at));
      const ConstRows<TK> keys = k.rows(at), values = v.rows(at);
      if (v.run(at) < m || keys.data != values.data || keys.stride != values.stride) return false;
      done += m;
    }
    return true;
  }
}

/// Whether the streaming products read rows of T in place for compute type C: Eigen's when
/// kStreamsFrom<C, T> (the build's target widens T in registers), apex's float kernels when
/// `simd` is set and reads T (float, bfloat16, half); else rows are widened first (load_rows).
template <class C, class T>
bool streams_in_place(const FloatKernels* simd) {
  if constexpr (kStreamsFrom<C, T>) return true;
  return std::is_same_v<C, float> && !std::is_void_v<SimdElement<T>> && simd != nullptr;
}

/// Whether some CPU may stream rows of T in place for C (streams_in_place can be true): a block
/// format only where apex's float kernels read it (kReadsBlocks).
template <class C, class T>
inline constexpr bool kMayStreamInPlace = kStreamsFrom<C, T> || (std::is_same_v<C, float> &&
                                                                 !std::is_void_v<SimdElement<T>>);

/// The row reader: calls f(data, stride) for rows [row, row + n) of one head, inside one run
/// (n <= head.run(row)): in place (data a T*) when `in_place` (streams_in_place), else widened
/// into `buffer` (n × cols) by load_rows (data a C*).
template <class C, class T, class F>
void read_rows(const SegmentHead<T>& head, Index row, Index n, C* buffer, bool in_place, F&& f) {
  APEX_ASSERT(n <= head.run(row));
  if constexpr (kMayStreamInPlace<C, T>) {
    if (in_place) {
      const ConstRows<T> rows = head.rows(row);
      return f(rows.data, rows.stride);
    }
  }
  APEX_ASSERT(!in_place);
  load_rows(head, row, n, buffer);
  f(static_cast<const C*>(buffer), head.cols() * KvFormat<T>::kValuesPerElement);
}

/// The streaming products for rows of U (C, or T read in place), on apex's float kernels where
/// `simd` is set and reads U, else on Eigen's (stream_scores and stream_update, which read U:
/// streams_in_place said so):
///   scores:  s [rows × n] (ld_s) = q [rows × d] · kᵀ, key row j at k + j·stride;
///   update:  acc [rows × d_v] (ld_acc) += p [rows × n] (ld_p) · v, value row j at v + j·stride.
template <class C, class U>
void streamed_scores(const FloatKernels* simd, C* s, Index ld_s, const C* q, Index rows, const U* k,
                     Index stride, Index n, Index d) {
  if constexpr (std::is_same_v<C, float> && !std::is_void_v<SimdElement<U>>) {
    if (simd != nullptr) {
      return simd->rows<U>().dots(s, ld_s, q, rows, simd_elements(k), stride, n, d);
    }
  }
  if constexpr (kStreamsFrom<C, U>) {
    stream_scores(s, ld_s, q, rows, k, stride, n, d);
  } else {
    APEX_ASSERT(false);  // streams_in_place never reads such rows in place
  }
}
template <class C, class U>
void streamed_update(const FloatKernels* simd, C* acc, Index ld_acc, const C* p, Index ld_p,
                     Index rows, const U* v, Index stride, Index n, Index d_v) {
  if constexpr (std::is_same_v<C, float> && !std::is_void_v<SimdElement<U>>) {
    if (simd != nullptr) {
      return simd->rows<U>().update(acc, ld_acc, p, ld_p, rows, simd_elements(v), stride, n, d_v);
    }
  }
  if constexpr (kStreamsFrom<C, U>) {
    stream_update(acc, ld_acc, p, ld_p, rows, v, stride, n, d_v);
  } else {
    APEX_ASSERT(false);  // streams_in_place never reads such rows in place
  }
}

/// One block of keys of a problem: rows [row, row + n) of a segment, which are keys
/// [index, index + n) of the whole problem.
template <class TK, class TV>
struct KeyBlock {
  const KeySegment<TK, TV>* segment;
  Index row, n, index;
  Index position() const { return segment->first_position + row; }
};

/// The rows [begin, end) of a segment whose positions lie in `range` (empty: begin = end).
template <class TK, class TV>
std::pair<Index, Index> rows_in(const KeySegment<TK, TV>& segment, const PositionRange& range) {
  const Index first = segment.first_position;  // >= 0: the differences below cannot overflow
  const Index size = segment.size();
  const Index begin = range.begin <= first ? 0 : std::min(size, range.begin - first);
  const Index end = range.end <= first ? 0 : std::min(size, range.end - first);
  return {begin, std::max(begin, end)};
}

/// Calls f(KeyBlock) for the keys [begin, end) of the problem whose positions lie in `visible`
/// (visible_keys), in order, in blocks of at most `block` keys that never straddle two segments.
/// The blocks end on the segment's multiples of `block` (the first and last may be shorter), so
/// that a causal diagonal falls on whole blocks. Keys outside `visible` are never read.
template <class P, class F>
void for_each_key_block(const P& p, Index begin, Index end, const PositionRange& visible,
                        Index block, F&& f) {
  Index first = 0;  // problem index of the segment's first key
  for (Index s = 0; s < p.num_segments; ++s) {
    const auto& segment = p.segments[s];
    const Index size = segment.size();
    const auto [row_begin, row_end] = rows_in(segment, visible);
    const Index lo = std::max(begin, first + row_begin);
    const Index hi = std::min(end, first + row_end);
    for (Index k0 = lo; k0 < hi;) {
      const Index stop = std::min(hi, first + ((k0 - first) / block + 1) * block);
      f(KeyBlock<typename P::Key, typename P::Value>{&segment, k0 - first, stop - k0, k0});
      k0 = stop;
    }
    first += size;
  }
}

/// Calls f(j0, m) for the panels [j0, j0 + m) of a streamed block of n keys from `row` of
/// `head`, in order, each within one run (page): a run at a time where `whole_runs` (rows that
/// apex's float kernels read in place: they prefetch ahead only rows of that run, a page's
/// neighbour in the pool may belong to another sequence, and their sums do not depend on the
/// panels), else kStreamPanel keys at a time (rows widened into a buffer just before they are
/// used, so that reading memory and the arithmetic overlap; Eigen's products, whose sums follow
/// the panels). The panels start at multiples of stream_update's groups of keys (pages of a
/// multiple of 8 keys keep them there), so a row's sums are formed in the same order whatever
/// the storage type.
template <class T, class F>
void for_each_panel(const SegmentHead<T>& head, Index row, Index n, bool whole_runs, F&& f) {
  const Index panel = whole_runs ? n : kStreamPanel;
  for (Index j0 = 0; j0 < n;) {
    const Index m = std::min({panel, n - j0, head.run(row + j0)});
    f(j0, m);
    j0 += m;
  }
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
