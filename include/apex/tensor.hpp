// SPDX-License-Identifier: MIT
// Per-head tensors: the documents' [B, H, S, D] as a strided view that hands out one head at a
// time as an S x D row-major Eigen::Map, without copying.
#pragma once

#include <apex/config.hpp>

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
  using Element = std::remove_const_t<T>;
  using HeadMap = Eigen::Map<
      std::conditional_t<std::is_const_v<T>, const RowMatrix<Element>, RowMatrix<Element>>, 0,
      Eigen::OuterStride<>>;

  HeadsView() = default;
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
    return HeadsView(data, batch, heads, seq, dim, heads * seq * dim, seq * dim, dim);
  }

  /// [B*S, H*D] token-major storage (what a projection x * W produces), viewed as [B, H, S, D].
  static HeadsView token_major(T* data, Index batch, Index seq, Index heads, Index dim) {
    return HeadsView(data, batch, heads, seq, dim, seq * heads * dim, dim, heads * dim);
  }

  T* data() const { return data_; }
  Index batch() const { return batch_; }
  Index heads() const { return heads_; }
  Index seq() const { return seq_; }
  Index dim() const { return dim_; }
  Index batch_stride() const { return batch_stride_; }
  Index head_stride() const { return head_stride_; }
  Index row_stride() const { return row_stride_; }
  bool empty() const { return data_ == nullptr; }

  /// Head (b, h) as a seq x dim row-major map. A size-1 batch or head axis broadcasts.
  HeadMap head(Index b, Index h) const {
    const Index bb = batch_ == 1 ? 0 : b;
    const Index hh = heads_ == 1 ? 0 : h;
    APEX_ASSERT(bb >= 0 && bb < batch_ && hh >= 0 && hh < heads_);
    return HeadMap(data_ + bb * batch_stride_ + hh * head_stride_, seq_, dim_,
                   Eigen::OuterStride<>(row_stride_));
  }

 private:
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

/// An owning, zero-initialised, contiguous [B, H, S, D] tensor.
template <class Scalar>
class HeadsTensor {
 public:
  HeadsTensor() = default;
  HeadsTensor(Index batch, Index heads, Index seq, Index dim)
      : storage_(Vector<Scalar>::Zero(batch * heads * seq * dim)),
        batch_(batch),
        heads_(heads),
        seq_(seq),
        dim_(dim) {}

  Index batch() const { return batch_; }
  Index heads() const { return heads_; }
  Index seq() const { return seq_; }
  Index dim() const { return dim_; }
  Scalar* data() { return storage_.data(); }
  const Scalar* data() const { return storage_.data(); }

  HeadsView<Scalar> view() {
    return HeadsView<Scalar>::contiguous(data(), batch_, heads_, seq_, dim_);
  }
  HeadsView<const Scalar> view() const {
    return HeadsView<const Scalar>::contiguous(data(), batch_, heads_, seq_, dim_);
  }
  typename HeadsView<Scalar>::HeadMap head(Index b, Index h) { return view().head(b, h); }
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
