// SPDX-License-Identifier: MIT
// Per-head tensors: the documents' [B, H, S, D] as a strided view that hands out one head at a
// time as an S x D row-major Eigen::Map, without copying.
#pragma once

#include <apex/config.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <type_traits>
#include <utility>

namespace apex {

/// The extents of a [batch, heads, seq, dim] tensor, always in that order: a shape is one value
/// that every factory and check takes, so that no two call sites order four Index arguments
/// differently.
struct HeadsShape {
  Index batch = 0;  ///< B (1 broadcasts over the batch axis)
  Index heads = 0;  ///< H (1 broadcasts over the head axis)
  Index seq = 0;    ///< S, rows per head
  Index dim = 0;    ///< D, the contiguous width of one row

  /// True when some extent is 0: the tensor has no elements.
  bool has_no_elements() const { return batch == 0 || heads == 0 || seq == 0 || dim == 0; }
  /// Equal extents, axis by axis.
  friend bool operator==(const HeadsShape& a, const HeadsShape& b) {
    return a.batch == b.batch && a.heads == b.heads && a.seq == b.seq && a.dim == b.dim;
  }
  /// Some extent differs.
  friend bool operator!=(const HeadsShape& a, const HeadsShape& b) { return !(a == b); }
};

namespace detail {

/// Streams a shape as "[B, H, S, D]" in error messages.
struct ShapeText {
  const HeadsShape& shape;
  friend std::ostream& operator<<(std::ostream& os, const ShapeText& t) {
    return os << "[" << t.shape.batch << ", " << t.shape.heads << ", " << t.shape.seq << ", "
              << t.shape.dim << "]";
  }
};

/// Whether `Buffer` (any cv and reference) is a dense Eigen object: a matrix, an array, a Map,
/// a Ref, a block or an expression.
template <class Buffer>
constexpr bool is_eigen_dense_v =
    std::is_base_of_v<Eigen::DenseBase<std::decay_t<Buffer>>, std::decay_t<Buffer>>;

/// Whether `Buffer` is a contiguous range other than an Eigen object: something with .data() and
/// .size() (std::vector, std::array, a span type).
template <class Buffer, class = void>
struct IsContiguousRange : std::false_type {};
template <class Buffer>
struct IsContiguousRange<Buffer, std::void_t<decltype(std::declval<Buffer&>().data()),
                                             decltype(std::declval<Buffer&>().size())>>
    : std::bool_constant<!is_eigen_dense_v<Buffer>> {};

/// The type of buffer.data() for a named `Buffer` (void when it has none: an Eigen expression).
template <class Buffer, class = void>
struct DataPointerImpl {
  using type = void;
};
template <class Buffer>
struct DataPointerImpl<Buffer, std::void_t<decltype(std::declval<Buffer&>().data())>> {
  using type = decltype(std::declval<Buffer&>().data());
};
template <class Buffer>
using DataPointer = typename DataPointerImpl<Buffer>::type;

/// Whether an Eigen object may hold its own elements, so that a view of a temporary one would
/// dangle: a Matrix or Array, or a Ref to const (which copies what it cannot reference).
template <class M>
struct MayOwnStorage : std::is_base_of<Eigen::PlainObjectBase<M>, M> {};
template <class M, int Options, class Stride>
struct MayOwnStorage<Eigen::Ref<const M, Options, Stride>> : std::true_type {};

/// What the checked factories of HeadsView accept besides a pointer: an Eigen object or a
/// contiguous range.
template <class Buffer>
using EnableIfViewBuffer =
    std::enable_if_t<is_eigen_dense_v<Buffer> ||
                     IsContiguousRange<std::remove_reference_t<Buffer>>::value>;

}  // namespace detail

/// The strides of a [B, H, S, D] view, in elements, outermost first; the D elements of a row
/// are always contiguous (stride 1).
struct HeadsStrides {
  Index batch = 0;  ///< between (b, h, s, d) and (b + 1, h, s, d)
  Index head = 0;   ///< between (b, h, s, d) and (b, h + 1, s, d)
  Index row = 0;    ///< between (b, h, s, d) and (b, h, s + 1, d)
};

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
/// Strides may be any Index values. A stride of 0 on an axis of extent > 1 broadcasts: every
/// index along it reads the same memory (for inputs: a K/V head shared without a copy, one mask
/// row for every query). Negative strides walk the axis backwards. An axis of extent 1 never
/// uses its stride. Views that apex writes (outputs) must address distinct memory for distinct
/// elements; the functions that write check it (detail::check_output_view).
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
  /// Views `data` with the given shape and strides (in elements); the dim elements of a row are
  /// contiguous. Nothing is checked or copied: the caller keeps the memory alive and every
  /// addressed element in bounds. An axis of extent 1 broadcasts, so its stride is never used.
  HeadsView(T* data, const HeadsShape& shape, const HeadsStrides& strides)
      : data_(data), shape_(shape), strides_(strides) {}

  /// A read-write view converts to a read-only one.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  HeadsView(const HeadsView<U>& other)  // NOLINT(google-explicit-constructor)
      : HeadsView(other.data(), other.shape(), other.strides()) {}

  /// [B, H, S, D] stored contiguously in that order. Unchecked: nothing is known of the buffer
  /// behind `data`, so the caller guarantees it holds B·H·S·D elements; the overloads below that
  /// take the buffer itself check it. Throws std::invalid_argument on a negative extent or when
  /// the element count does not fit in 64 bits.
  static HeadsView contiguous(T* data, const HeadsShape& shape) {
    if (checked_elements(shape, "contiguous") == 0) return HeadsView(data, shape, {});
    return HeadsView(data, shape,
                     {shape.heads * shape.seq * shape.dim, shape.seq * shape.dim, shape.dim});
  }

  /// [B*S, H*D] token-major storage (what a projection x * W produces), viewed as [B, H, S, D]:
  /// token s of batch b is row b*S + s, and head h is columns [h*D, (h+1)*D) of it. Unchecked
  /// like contiguous(data, shape): the caller guarantees B·S·H·D elements. Throws as
  /// contiguous().
  static HeadsView token_major(T* data, const HeadsShape& shape) {
    if (checked_elements(shape, "token_major") == 0) return HeadsView(data, shape, {});
    return HeadsView(data, shape,
                     {shape.seq * shape.heads * shape.dim, shape.dim, shape.heads * shape.dim});
  }

  /// contiguous(data, shape) over a buffer of `size` elements, checked: throws
  /// std::invalid_argument unless size == B·H·S·D.
  static HeadsView contiguous(T* data, Index size, const HeadsShape& shape) {
    check_buffer_size(size, shape, "contiguous", "buffer");
    return contiguous(data, shape);
  }

  /// token_major(data, shape) over a buffer of `size` elements, checked: throws
  /// std::invalid_argument unless size == B·S·H·D.
  static HeadsView token_major(T* data, Index size, const HeadsShape& shape) {
    check_buffer_size(size, shape, "token_major", "buffer");
    return token_major(data, shape);
  }

  /// contiguous(data, shape) over a buffer that knows its size, checked: an Eigen object whose
  /// elements are contiguous (a RowMatrix, a Vector, a Map, a Ref or a block of whole rows) or a
  /// container with .data() and .size() (std::vector, std::array, a span type). Throws
  /// std::invalid_argument unless it holds exactly B·H·S·D elements, one after another (a block
  /// of some columns of a wider matrix is rejected: it is not [B, H, S, D] storage). A writable
  /// view needs a writable buffer; a temporary matrix or container does not compile (the view
  /// would dangle).
  template <class Buffer, class = detail::EnableIfViewBuffer<Buffer>>
  static HeadsView contiguous(Buffer&& buffer, const HeadsShape& shape) {
    return of_buffer<false, Buffer>(std::forward<Buffer>(buffer), shape);
  }

  /// token_major(data, shape) over a buffer that knows its size, checked. A row-major Eigen
  /// matrix [B*S, H*D] (a RowMatrix, a Map, a Ref, or a block of columns of a wider matrix such
  /// as the Q part of a fused QKV projection): throws std::invalid_argument unless rows == B·S,
  /// cols == H·D and each row is contiguous; its outer stride becomes the view's row stride. A
  /// container with .data() and .size(): throws unless size == B·S·H·D. A writable view needs a
  /// writable buffer; a temporary matrix or container does not compile (the view would dangle).
  template <class Buffer, class = detail::EnableIfViewBuffer<Buffer>>
  static HeadsView token_major(Buffer&& buffer, const HeadsShape& shape) {
    return of_buffer<true, Buffer>(std::forward<Buffer>(buffer), shape);
  }

  /// Pointer to element (0, 0, 0, 0); null for a default-constructed view.
  T* data() const { return data_; }
  /// The extents [B, H, S, D].
  const HeadsShape& shape() const { return shape_; }
  /// The strides, in elements.
  const HeadsStrides& strides() const { return strides_; }
  /// Number of batches B (1 broadcasts over the batch axis).
  Index batch() const { return shape_.batch; }
  /// Number of heads H (1 broadcasts over the head axis).
  Index heads() const { return shape_.heads; }
  /// Sequence length S: rows per head.
  Index seq() const { return shape_.seq; }
  /// Per-head width D: columns per row, contiguous in memory.
  Index dim() const { return shape_.dim; }
  /// Elements between (b, h, s, d) and (b + 1, h, s, d).
  Index batch_stride() const { return strides_.batch; }
  /// Elements between (b, h, s, d) and (b, h + 1, s, d).
  Index head_stride() const { return strides_.head; }
  /// Elements between consecutive rows (b, h, s, d) and (b, h, s + 1, d).
  Index row_stride() const { return strides_.row; }
  /// True when the view points at no memory (data() is null), e.g. an absent optional mask.
  /// A view of a non-null buffer with a zero extent is not empty() but has no elements.
  bool empty() const { return data_ == nullptr; }

  /// Head (b, h) as a seq x dim row-major map. A size-1 batch or head axis broadcasts.
  /// A head with no elements is a map of the view's own pointer, never offset: the data of an
  /// empty matrix is null, and offsetting null is undefined even when nothing is read.
  // The indices in the order of the tensor's axes, as Eigen's operator()(i, j) takes them.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
  HeadMap head(Index b, Index h) const {
    const Index bb = shape_.batch == 1 ? 0 : b;
    const Index hh = shape_.heads == 1 ? 0 : h;
    APEX_ASSERT(bb >= 0 && bb < shape_.batch && hh >= 0 && hh < shape_.heads);
    T* const first = shape_.seq == 0 || shape_.dim == 0
                         ? data_
                         : data_ + bb * strides_.batch + hh * strides_.head;
    return HeadMap(first, shape_.seq, shape_.dim, Eigen::OuterStride<>(strides_.row));
  }

  /// Rows [first, first + count) of every head: the same view with seq = count, starting at
  /// row `first` (0 <= first, first + count <= seq(); unchecked).
  HeadsView middle_rows(Index first, Index count) const {
    APEX_ASSERT(first >= 0 && count >= 0 && first + count <= shape_.seq);
    HeadsShape shape = shape_;
    shape.seq = count;
    T* const start = count == 0 || shape_.dim == 0 ? data_ : data_ + first * strides_.row;
    return HeadsView(start, shape, strides_);
  }

  /// Batches [first, first + count) of the view: the same view with batch = count, starting at
  /// batch `first` (0 <= first, first + count <= batch(); unchecked). A view that broadcasts
  /// over the batch axis (batch() == 1) gives itself with batch = count.
  HeadsView middle_batches(Index first, Index count) const {
    APEX_ASSERT(first >= 0 && count >= 0 && (shape_.batch == 1 || first + count <= shape_.batch));
    HeadsShape shape = shape_;
    shape.batch = count;
    if (shape_.batch == 1) return HeadsView(data_, shape, {0, strides_.head, strides_.row});
    T* const start = count == 0 || shape.has_no_elements() ? data_ : data_ + first * strides_.batch;
    return HeadsView(start, shape, strides_);
  }

 private:
  /// B·H·S·D for extents >= 0 whose product fits in 64 bits (so every stride the factories form
  /// does too); throws std::invalid_argument otherwise.
  static std::int64_t checked_elements(const HeadsShape& s, const char* factory) {
    APEX_CHECK(s.batch >= 0 && s.heads >= 0 && s.seq >= 0 && s.dim >= 0,
               "[heads_view] " << factory << " shape [" << s.batch << ", " << s.heads << ", "
                               << s.seq << ", " << s.dim << "] must have no negative extent");
    if (s.has_no_elements()) return 0;
    return detail::checked_product({s.batch, s.heads, s.seq, s.dim}, "heads_view", "B*H*S*D");
  }

  /// The compile-time requirements on an Eigen buffer, each a static_assert with its reason:
  /// storage (not an expression), the view's element type, row-major rows (a vector will do for
  /// contiguous), writable for a writable view, and no temporary that owns its elements. True
  /// when all hold, so that the factory compiles no further after a failure.
  template <class Buffer, bool kTokenMajor>
  static constexpr bool accepts_matrix() {
    using M = std::decay_t<Buffer>;
    constexpr bool has_storage = (M::Flags & Eigen::DirectAccessBit) != 0;
    constexpr bool same_scalar = std::is_same_v<typename M::Scalar, Element>;
    constexpr bool writable = std::is_convertible_v<detail::DataPointer<Buffer>, T*>;
    constexpr bool outlives =
        std::is_lvalue_reference_v<Buffer> || !detail::MayOwnStorage<M>::value;
    constexpr bool row_major = M::IsRowMajor || (!kTokenMajor && M::IsVectorAtCompileTime);
    static_assert(has_storage,
                  "apex::HeadsView: the matrix must have storage (a Matrix, Map, Ref or block), "
                  "not an expression; evaluate it into a RowMatrix first");
    static_assert(!has_storage || same_scalar,
                  "apex::HeadsView: the matrix's scalar type must be the view's element type");
    static_assert(!has_storage || !same_scalar || writable,
                  "apex::HeadsView: a writable view needs a writable matrix (not const, not a "
                  "Map or Ref of const)");
    static_assert(outlives,
                  "apex::HeadsView: a view of a temporary matrix would dangle; name the matrix");
    static_assert(row_major,
                  "apex::HeadsView: the matrix must be row-major (apex::RowMatrix), or a vector "
                  "for contiguous()");
    return has_storage && same_scalar && writable && outlives && row_major;
  }

  /// The compile-time requirements on a contiguous range, as accepts_matrix: the view's element
  /// type, writable for a writable view, and an lvalue (a temporary container's storage would be
  /// freed before the view is used).
  template <class Buffer>
  static constexpr bool accepts_range() {
    using Pointer = detail::DataPointer<Buffer>;
    constexpr bool same_element =
        std::is_same_v<std::remove_cv_t<std::remove_pointer_t<Pointer>>, Element>;
    constexpr bool writable = std::is_convertible_v<Pointer, T*>;
    constexpr bool outlives = std::is_lvalue_reference_v<Buffer>;
    static_assert(same_element,
                  "apex::HeadsView: the buffer's element type must be the view's element type");
    static_assert(!same_element || writable,
                  "apex::HeadsView: a writable view needs a writable buffer (not const)");
    static_assert(outlives,
                  "apex::HeadsView: a view of a temporary buffer would dangle; name the buffer, "
                  "or pass (data, size)");
    return same_element && writable && outlives;
  }

  /// Throws unless a buffer of `size` elements is exactly the B·H·S·D that `shape` addresses.
  static void check_buffer_size(Index size, const HeadsShape& s, const char* factory,
                                const char* what) {
    const std::int64_t elements = checked_elements(s, factory);
    APEX_CHECK(size == elements, "[heads_view] " << factory << " " << what << " size (" << size
                                                 << ") must be B*H*S*D (" << elements
                                                 << ") for shape " << detail::ShapeText{s});
  }

  /// Throws unless the elements of a [rows, cols] Eigen buffer lie one after another, as
  /// contiguous() reads them.
  static void check_matrix_is_dense(Index rows, Index cols, Index outer_stride, Index inner_stride,
                                    bool is_vector) {
    if (rows * cols <= 1) return;
    APEX_CHECK(inner_stride == 1, "[heads_view] contiguous matrix inner stride ("
                                      << inner_stride
                                      << ") must be 1: the elements lie one after another");
    APEX_CHECK(is_vector || rows == 1 || outer_stride == cols,
               "[heads_view] contiguous matrix outer stride ("
                   << outer_stride << ") must be cols (" << cols
                   << "): a block of some columns of a wider matrix is not [B, H, S, D] storage "
                      "(view it with token_major, or with strides)");
  }

  /// The checked factories that take a buffer: contiguous(buffer, shape) (kTokenMajor false) or
  /// token_major(buffer, shape). A range goes to the (data, size) factory, an Eigen object to
  /// the checks of its layout; a buffer that fails a requirement stops at its static_assert.
  template <bool kTokenMajor, class Buffer>
  static HeadsView of_buffer(Buffer&& buffer, const HeadsShape& shape) {
    if constexpr (!detail::is_eigen_dense_v<Buffer>) {
      if constexpr (!accepts_range<Buffer>()) {
        return {};  // a static_assert has failed
      } else {
        const auto size = static_cast<Index>(buffer.size());
        return kTokenMajor ? token_major(buffer.data(), size, shape)
                           : contiguous(buffer.data(), size, shape);
      }
    } else if constexpr (!accepts_matrix<Buffer, kTokenMajor>()) {
      return {};  // a static_assert has failed
    } else if constexpr (kTokenMajor) {
      return token_major_of_matrix(buffer.data(), buffer.rows(), buffer.cols(),
                                   buffer.outerStride(), buffer.innerStride(), shape);
    } else {
      check_matrix_is_dense(buffer.rows(), buffer.cols(), buffer.outerStride(),
                            buffer.innerStride(), std::decay_t<Buffer>::IsVectorAtCompileTime);
      check_buffer_size(buffer.size(), shape, "contiguous", "matrix");
      return contiguous(buffer.data(), shape);
    }
  }

  /// The token-major view of a row-major [rows, cols] matrix with the given strides: throws
  /// unless rows == B·S, cols == H·D and rows are contiguous and do not overlap. The outer stride
  /// is the view's row stride, so a block of columns is viewed in place.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
  static HeadsView token_major_of_matrix(T* data, Index rows, Index cols, Index outer_stride,
                                         Index inner_stride, const HeadsShape& s) {
    checked_elements(s, "token_major");
    const std::int64_t tokens =
        detail::checked_product(s.batch, s.seq, "heads_view", "token_major batch * seq");
    const std::int64_t width =
        detail::checked_product(s.heads, s.dim, "heads_view", "token_major heads * dim");
    APEX_CHECK(rows == tokens, "[heads_view] token_major matrix rows ("
                                   << rows << ") must be batch * seq (" << s.batch << " * " << s.seq
                                   << " = " << tokens << ") for shape " << detail::ShapeText{s});
    APEX_CHECK(cols == width, "[heads_view] token_major matrix cols ("
                                  << cols << ") must be heads * dim (" << s.heads << " * " << s.dim
                                  << " = " << width << ") for shape " << detail::ShapeText{s});
    if (s.has_no_elements()) return HeadsView(data, s, {});
    APEX_CHECK(cols == 1 || inner_stride == 1,
               "[heads_view] token_major matrix inner stride ("
                   << inner_stride << ") must be 1: the D elements of a head's row are contiguous");
    const Index row_stride = rows == 1 ? cols : outer_stride;
    APEX_CHECK(row_stride >= cols, "[heads_view] token_major matrix outer stride ("
                                       << outer_stride << ") must be at least cols (" << cols
                                       << "): rows must not overlap");
    return HeadsView(data, s, {s.seq * row_stride, s.dim, row_stride});
  }

  T* data_ = nullptr;
  HeadsShape shape_;
  HeadsStrides strides_;
};

/// A read-only view whose scalar type is deduced from the other arguments of a call, so that a
/// HeadsView<Scalar> (or a HeadsTensor's view()) can be passed where a const view is expected.
template <class Scalar>
using ConstHeadsView = HeadsView<const detail::NoDeduce<Scalar>>;

namespace detail {

/// Throws std::invalid_argument ("[op] <what> [B, H, S, D] must have no negative extent") unless
/// every extent is >= 0: a view can be built with any numbers.
inline void check_extents(const HeadsShape& s, const char* op, const char* what) {
  APEX_CHECK(s.batch >= 0 && s.heads >= 0 && s.seq >= 0 && s.dim >= 0,
             "[" << op << "] " << what << " [" << s.batch << ", " << s.heads << ", " << s.seq
                 << ", " << s.dim << "] must have no negative extent");
}

/// check_extents of a view's shape.
template <class T>
void check_extents(const HeadsView<T>& view, const char* op, const char* what) {
  check_extents(view.shape(), op, what);
}

/// Elements of a [B, H, S, D] tensor, B·H·S·D, for extents that must be >= 0 and whose product,
/// in bytes of `Scalar`, must fit in 64 bits. Throws std::invalid_argument prefixed with `op`.
template <class Scalar>
Index heads_tensor_size(const HeadsShape& s, const char* op) {
  check_extents(s, op, "shape");
  if (s.has_no_elements()) return 0;  // empty, whatever the rest
  const std::int64_t size = checked_product({s.batch, s.heads, s.seq, s.dim}, op, "B*H*S*D");
  checked_product(size, static_cast<std::int64_t>(sizeof(Scalar)), op, "B*H*S*D bytes");
  return static_cast<Index>(size);
}

/// The byte range [first, last] a view's elements occupy (first > last when it has none), for
/// overlap tests between views. Every axis of extent > 1 spans (extent − 1)·|stride| elements,
/// in the direction of its stride's sign.
struct ByteRange {
  std::uintptr_t first = 1;
  std::uintptr_t last = 0;
  bool overlaps(const ByteRange& o) const {
    return first <= last && o.first <= o.last && first <= o.last && o.first <= last;
  }
};

/// a·b + c, or false when a product or sum of the view's extents, strides and element size
/// leaves 64 bits (a view that no buffer can back: its checks must then assume the worst).
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): a·b + c, in the order it is written
inline bool fused_fits(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t& result) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const auto magnitude = [](std::int64_t x) {
    return x < 0 ? std::uint64_t(0) - static_cast<std::uint64_t>(x) : static_cast<std::uint64_t>(x);
  };
  if (a != 0 && magnitude(b) > static_cast<std::uint64_t>(kMax) / magnitude(a)) return false;
  const std::int64_t product = a * b;  // |a·b| <= kMax
  if (c > 0 ? product > kMax - c : product < -kMax - c) return false;
  result = product + c;
  return true;
}

template <class T>
ByteRange byte_range(const HeadsView<T>& v) {
  if (v.empty() || v.shape().has_no_elements()) return {};
  constexpr ByteRange kEverything{0, std::numeric_limits<std::uintptr_t>::max()};
  std::int64_t low = 0;
  std::int64_t high = v.dim() - 1;
  bool fits = true;
  const auto extend = [&](Index extent, Index stride) {
    if (extent <= 1) return;
    std::int64_t& end = stride < 0 ? low : high;
    fits = fits && fused_fits(extent - 1, stride, end, end);
  };
  extend(v.batch(), v.batch_stride());
  extend(v.heads(), v.head_stride());
  extend(v.seq(), v.row_stride());
  const auto size = static_cast<std::int64_t>(sizeof(T));
  std::int64_t first = 0, last = 0;
  if (!fits || !fused_fits(low, size, 0, first) || !fused_fits(high, size, size - 1, last)) {
    return kEverything;  // overlaps every range: a call refuses to write through it
  }
  const auto base = reinterpret_cast<std::uintptr_t>(v.data());
  return {base + static_cast<std::uintptr_t>(first), base + static_cast<std::uintptr_t>(last)};
}

/// The byte range of a row-major matrix, Map, Ref or block (its rows, columns and row stride).
template <class M>
ByteRange matrix_byte_range(const M& m) {
  using T = std::remove_const_t<typename M::Scalar>;
  return byte_range(
      HeadsView<const T>(m.data(), {1, 1, m.rows(), m.cols()}, {0, 0, m.outerStride()}));
}

/// Whether distinct elements of `v` occupy distinct memory, by the nesting test: ordered by
/// |stride|, every axis of extent > 1 must step over the whole span of the axes inside it. This
/// holds for every layout apex builds (contiguous, token-major, cache views); a layout it
/// rejects may still be distinct, but apex does not write through it.
template <class T>
bool elements_distinct(const HeadsView<T>& v) {
  if (v.shape().has_no_elements()) return true;
  struct Axis {
    Index extent, stride;
  };
  Axis axes[3] = {
      {v.batch(), v.batch_stride()}, {v.heads(), v.head_stride()}, {v.seq(), v.row_stride()}};
  for (Axis& a : axes) {
    if (a.extent > 1 && a.stride == std::numeric_limits<Index>::min()) return false;
    a.stride = a.stride < 0 ? -a.stride : a.stride;
  }
  std::sort(std::begin(axes), std::end(axes),
            [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  std::int64_t span = v.dim();  // elements covered by the axes inside the current one
  for (const Axis& a : axes) {
    if (a.extent <= 1) continue;
    if (a.stride < span) return false;
    if (!fused_fits(a.stride, a.extent - 1, span, span)) return false;  // spans no real memory
  }
  return true;
}

/// Throws unless apex may write through `v`: distinct elements must be distinct memory (a zero
/// or overlapping stride would make two results land on one place).
template <class T>
void check_output_view(const HeadsView<T>& v, const char* op, const char* what) {
  APEX_CHECK(elements_distinct(v), "[" << op << "] " << what << " strides (batch "
                                       << v.batch_stride() << ", head " << v.head_stride()
                                       << ", row " << v.row_stride() << ") for shape [" << v.batch()
                                       << ", " << v.heads() << ", " << v.seq() << ", " << v.dim()
                                       << "] make distinct elements share memory; an output "
                                          "needs a layout without overlap");
}

}  // namespace detail

/// An owning, zero-initialised, contiguous [B, H, S, D] tensor. A default-constructed or
/// moved-from tensor is empty: every extent 0, no storage.
template <class Scalar>
class HeadsTensor {
 public:
  HeadsTensor() = default;
  /// Allocates B·H·S·D zeros. Throws std::invalid_argument on a negative extent or a size
  /// beyond 64 bits (before allocating).
  explicit HeadsTensor(const HeadsShape& shape)
      : storage_(Vector<Scalar>::Zero(detail::heads_tensor_size<Scalar>(shape, "heads_tensor"))),
        shape_(shape) {}

  /// The extents [B, H, S, D].
  const HeadsShape& shape() const { return shape_.get(); }
  /// Number of batches B.
  Index batch() const { return shape().batch; }
  /// Number of heads H.
  Index heads() const { return shape().heads; }
  /// Sequence length S: rows per head.
  Index seq() const { return shape().seq; }
  /// Per-head width D.
  Index dim() const { return shape().dim; }
  /// The B·H·S·D elements in [B, H, S, D] order (null when the tensor is empty).
  Scalar* data() { return storage_.data(); }
  /// Read-only access to the B·H·S·D elements in [B, H, S, D] order.
  const Scalar* data() const { return storage_.data(); }

  /// A read-write contiguous view of the whole tensor; valid while the tensor lives and is not
  /// reassigned.
  HeadsView<Scalar> view() { return HeadsView<Scalar>::contiguous(data(), shape()); }
  /// A read-only contiguous view of the whole tensor.
  HeadsView<const Scalar> view() const {
    return HeadsView<const Scalar>::contiguous(data(), shape());
  }
  /// Head (b, h) as a writable [S, D] row-major map into the tensor (no copy).
  typename HeadsView<Scalar>::HeadMap head(Index b, Index h) { return view().head(b, h); }
  /// Head (b, h) as a read-only [S, D] row-major map into the tensor (no copy).
  typename HeadsView<const Scalar>::HeadMap head(Index b, Index h) const {
    return view().head(b, h);
  }

 private:
  Vector<Scalar> storage_;  // Eigen leaves a moved-from matrix empty
  detail::ResetOnMove<HeadsShape> shape_;
};

/// A [rows, cols] row-major matrix as a one-batch, one-head view: a dense mask or bias shared by
/// every batch and head, or a single head. The view does not own the data, so it cannot be made
/// of a temporary (that overload is deleted).
template <class T>
HeadsView<const T> as_heads_view(const RowMatrix<T>& m) {
  return HeadsView<const T>(m.data(), {1, 1, m.rows(), m.cols()}, {0, 0, m.cols()});
}
template <class T>
HeadsView<const T> as_heads_view(RowMatrix<T>&& m) = delete;
template <class T>
HeadsView<const T> as_heads_view(const RowMatrix<T>&& m) = delete;

}  // namespace apex
