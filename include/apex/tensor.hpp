// SPDX-License-Identifier: MIT
// Per-head tensors: the documents' [B, H, S, D] as a strided view that hands out one head at a
// time as an S x D row-major Eigen::Map, without copying.
#pragma once

#include <apex/config.hpp>

#include <cstdint>
#include <type_traits>

namespace apex {

/// A non-owning view of a 4-D tensor [batch, heads, seq, dim] whose innermost dimension is
/// contiguous. Element (b, h, s, d) lives at
///   data + b * batch_stride + h * head_stride + s * row_stride + d.
/// Two layouts matter and both are views of this one type:
///
///   contiguous [B, H, S, D]            projection output [B*S, H*D] (heads side by side)
///   +--------- b=0 ---------+          row b*S+s:  | head 0 (D) | head 1 (D) | ... |
///   | h=0: S rows of D      |
///   | h=1: S rows of D      |          head_stride = D, row_stride = H*D,
///   +-----------------------+          batch_stride = S*H*D
///   head_stride = S*D, row_stride = D,
///   batch_stride = H*S*D
///
/// `T` may be const-qualified for a read-only view. Dense masks use the same type with T = bool
/// or T = Scalar (an additive bias), and a batch or head count of 1 broadcasts over that axis.
template <class T>
class HeadsView {
 public:
  /// The element type without const: Scalar, or bool for a boolean mask.
  using Element = std::remove_const_t<T>;
  /// One head as a [seq, dim] row-major map with a run-time row stride (row_stride()); const
  /// when T is.
  using HeadMap = Eigen::Map<
      std::conditional_t<std::is_const_v<T>, const RowMatrix<Element>, RowMatrix<Element>>, 0,
      Eigen::OuterStride<>>;

  /// An empty view: null data and every extent and stride 0 (empty() is true).
  HeadsView() = default;
  /// Views `data` with the given extents and strides (in elements); the dim elements of a row
  /// are contiguous. Nothing is checked or copied: the caller keeps the memory alive and every
  /// addressed element in bounds. An axis of extent 1 broadcasts, so its stride is never used.
  HeadsView(T* data, Index batch, Index heads, Index seq, Index dim, Index batch_stride,
            Index head_stride, Index row_stride)
      : data_(data),
        batch_(batch),
        heads_(heads),
        seq_(seq),
        dim_(dim),
        batch_stride_(batch_stride),
        head_stride_(head_stride),
        row_stride_(row_stride) {}

  /// A read-write view converts to a read-only one.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  HeadsView(const HeadsView<U>& other)  // NOLINT(google-explicit-constructor)
      : HeadsView(other.data(), other.batch(), other.heads(), other.seq(), other.dim(),
                  other.batch_stride(), other.head_stride(), other.row_stride()) {}

  /// [B, H, S, D] stored contiguously in that order.
  static HeadsView contiguous(T* data, Index batch, Index heads, Index seq, Index dim) {
    if (is_empty_shape(batch, heads, seq, dim))
      return HeadsView(data, batch, heads, seq, dim, 0, 0, 0);
    return HeadsView(data, batch, heads, seq, dim, heads * seq * dim, seq * dim, dim);
  }

  /// [B*S, H*D] token-major storage (what a projection x * W produces), viewed as [B, H, S, D].
  static HeadsView token_major(T* data, Index batch, Index seq, Index heads, Index dim) {
    if (is_empty_shape(batch, heads, seq, dim))
      return HeadsView(data, batch, heads, seq, dim, 0, 0, 0);
    return HeadsView(data, batch, heads, seq, dim, seq * heads * dim, dim, heads * dim);
  }

  /// Pointer to element (0, 0, 0, 0); null for a default-constructed view.
  T* data() const { return data_; }
  /// Number of batches B (1 broadcasts over the batch axis).
  Index batch() const { return batch_; }
  /// Number of heads H (1 broadcasts over the head axis).
  Index heads() const { return heads_; }
  /// Sequence length S: rows per head.
  Index seq() const { return seq_; }
  /// Per-head width D: columns per row, contiguous in memory.
  Index dim() const { return dim_; }
  /// Elements between (b, h, s, d) and (b + 1, h, s, d).
  Index batch_stride() const { return batch_stride_; }
  /// Elements between (b, h, s, d) and (b, h + 1, s, d).
  Index head_stride() const { return head_stride_; }
  /// Elements between consecutive rows (b, h, s, d) and (b, h, s + 1, d); at least dim().
  Index row_stride() const { return row_stride_; }
  /// True when the view points at no memory (data() is null), e.g. an absent optional mask.
  /// A view of a non-null buffer with a zero extent is not empty() but has no elements.
  bool empty() const { return data_ == nullptr; }

  /// Head (b, h) as a seq x dim row-major map. A size-1 batch or head axis broadcasts.
  /// A head with no elements is a map of the view's own pointer, never offset: the data of an
  /// empty matrix is null, and offsetting null is undefined even when nothing is read.
  HeadMap head(Index b, Index h) const {
    const Index bb = batch_ == 1 ? 0 : b;
    const Index hh = heads_ == 1 ? 0 : h;
    APEX_ASSERT(bb >= 0 && bb < batch_ && hh >= 0 && hh < heads_);
    T* const first =
        seq_ == 0 || dim_ == 0 ? data_ : data_ + bb * batch_stride_ + hh * head_stride_;
    return HeadMap(first, seq_, dim_, Eigen::OuterStride<>(row_stride_));
  }

 private:
  /// A view with no elements addresses no memory: its strides are 0 rather than products of
  /// extents (which, for an empty shape, need not fit in an Index).
  static bool is_empty_shape(Index batch, Index heads, Index seq, Index dim) {
    return batch == 0 || heads == 0 || seq == 0 || dim == 0;
  }

  T* data_ = nullptr;
  Index batch_ = 0;
  Index heads_ = 0;
  Index seq_ = 0;
  Index dim_ = 0;
  Index batch_stride_ = 0;
  Index head_stride_ = 0;
  Index row_stride_ = 0;
};

/// A read-only view whose scalar type is deduced from the other arguments of a call, so that a
/// HeadsView<Scalar> (or a HeadsTensor's view()) can be passed where a const view is expected.
template <class Scalar>
using ConstHeadsView = HeadsView<const detail::NoDeduce<Scalar>>;

namespace detail {

/// Throws std::invalid_argument ("[op] <what> [B, H, S, D] must have no negative extent") unless
/// every extent is >= 0: a view can be built with any numbers.
inline void check_extents(Index batch, Index heads, Index seq, Index dim, const char* op,
                          const char* what) {
  APEX_CHECK(batch >= 0 && heads >= 0 && seq >= 0 && dim >= 0,
             "[" << op << "] " << what << " [" << batch << ", " << heads << ", " << seq << ", "
                 << dim << "] must have no negative extent");
}

/// check_extents of a view's shape.
template <class T>
void check_extents(const HeadsView<T>& view, const char* op, const char* what) {
  check_extents(view.batch(), view.heads(), view.seq(), view.dim(), op, what);
}

/// Elements of a [B, H, S, D] tensor, B·H·S·D, for extents that must be >= 0 and whose product,
/// in bytes of `Scalar`, must fit in 64 bits. Throws std::invalid_argument prefixed with `op`.
template <class Scalar>
Index heads_tensor_size(Index batch, Index heads, Index seq, Index dim, const char* op) {
  check_extents(batch, heads, seq, dim, op, "shape");
  if (batch == 0 || heads == 0 || seq == 0 || dim == 0) return 0;  // empty, whatever the rest
  const std::int64_t size = checked_product({batch, heads, seq, dim}, op, "B*H*S*D");
  checked_product(size, static_cast<std::int64_t>(sizeof(Scalar)), op, "B*H*S*D bytes");
  return static_cast<Index>(size);
}

}  // namespace detail

/// An owning, zero-initialised, contiguous [B, H, S, D] tensor.
template <class Scalar>
class HeadsTensor {
 public:
  HeadsTensor() = default;
  /// Allocates B·H·S·D zeros. Throws std::invalid_argument on a negative extent or a size
  /// beyond 64 bits (before allocating).
  HeadsTensor(Index batch, Index heads, Index seq, Index dim)
      : storage_(Vector<Scalar>::Zero(
            detail::heads_tensor_size<Scalar>(batch, heads, seq, dim, "heads_tensor"))),
        batch_(batch),
        heads_(heads),
        seq_(seq),
        dim_(dim) {}

  /// Number of batches B.
  Index batch() const { return batch_; }
  /// Number of heads H.
  Index heads() const { return heads_; }
  /// Sequence length S: rows per head.
  Index seq() const { return seq_; }
  /// Per-head width D.
  Index dim() const { return dim_; }
  /// The B·H·S·D elements in [B, H, S, D] order (null when the tensor is empty).
  Scalar* data() { return storage_.data(); }
  /// Read-only access to the B·H·S·D elements in [B, H, S, D] order.
  const Scalar* data() const { return storage_.data(); }

  /// A read-write contiguous view of the whole tensor; valid while the tensor lives and is not
  /// reassigned.
  HeadsView<Scalar> view() {
    return HeadsView<Scalar>::contiguous(data(), batch_, heads_, seq_, dim_);
  }
  /// A read-only contiguous view of the whole tensor.
  HeadsView<const Scalar> view() const {
    return HeadsView<const Scalar>::contiguous(data(), batch_, heads_, seq_, dim_);
  }
  /// Head (b, h) as a writable [S, D] row-major map into the tensor (no copy).
  typename HeadsView<Scalar>::HeadMap head(Index b, Index h) { return view().head(b, h); }
  /// Head (b, h) as a read-only [S, D] row-major map into the tensor (no copy).
  typename HeadsView<const Scalar>::HeadMap head(Index b, Index h) const {
    return view().head(b, h);
  }

 private:
  Vector<Scalar> storage_;
  Index batch_ = 0;
  Index heads_ = 0;
  Index seq_ = 0;
  Index dim_ = 0;
};

/// A [rows, cols] row-major matrix as a one-batch, one-head view: a dense mask or bias shared by
/// every batch and head, or a single head. The view does not own the data.
template <class T>
HeadsView<const T> as_heads_view(const RowMatrix<T>& m) {
  return HeadsView<const T>(m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.cols());
}

}  // namespace apex
