// SPDX-License-Identifier: MIT
// K/V formats: what one stored row of a key or value cache is, and the two conversions between it
// and the compute type. Every cache stores its rows through its format (store_rows, bytes), and
// every read of K or V by the attention kernel widens them through it (detail/kv_read.hpp), so a
// new format is one specialisation of KvFormat and the kernels that widen it.
//
// A FORMAT F describes a row of d values (a head's key or value, or a latent row) as elements:
//   Element            what a K or V view, a cache buffer or a page holds (HeadsView<Element>);
//   kValuesPerElement  how many values one element carries (1 for a scalar; a block of a
//                      quantized format carries many, with its scale);
//   elements(d)        the elements of a row of d values; bytes(n) the bytes of n elements;
//   widen(src, dst, n) n elements to n·kValuesPerElement values of a compute type C (float or
//                      double), exactly as stored;
//   store_row(x, n, dst)  the row x[0, n) of float or double values into elements dst (n a
//                      multiple of kValuesPerElement), rounded or quantized once;
//   store_rows(dst, x) (the scalar formats) rows of values x (any Eigen expression) into rows
//                      of elements dst, rounded once (the only rounding a cache applies).
// The scalar formats are apex's storage types (storage.hpp): float, double, Eigen::half and
// Eigen::bfloat16, one value per element, rounded once to nearest with ties to even (round_to).
// The block formats, 8 and 4 bits a value with a scale per block, are in kv_quant.hpp.
//
// A view of K or V of format F is a HeadsView<const F::Element>: its dim() counts elements, and
// its rows hold row_values(view) = dim()·kValuesPerElement values.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/widen.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// The format of rows stored as F (see the header comment); only formats have one.
template <class F, class Enable = void>
struct KvFormat;

/// The scalar formats: float, double, Eigen::half and Eigen::bfloat16, one value per element.
template <class T>
struct KvFormat<T, std::enable_if_t<is_storage_v<T>>> {
  using Element = T;                             ///< a stored value
  static constexpr Index kValuesPerElement = 1;  ///< one value per element

  /// Elements of a row of `values` values.
  static constexpr Index elements(Index values) { return values; }
  /// Bytes of `count` elements.
  static constexpr std::int64_t bytes(std::int64_t count) {
    return count * static_cast<std::int64_t>(sizeof(T));
  }
  /// dst[0, count) = src[0, count) widened to C, exactly (detail::widen's vector conversions).
  template <class C>
  static void widen(const T* src, C* dst, Index count) {
    detail::widen(src, dst, count);
  }
  /// dst[0, n) = x[0, n) rounded once to T: store_rows on the row (the same bits).
  template <class S>
  static void store_row(const S* x, Index n, T* dst) {
    store_rows(Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(dst, n),
               Eigen::Map<const Eigen::Matrix<S, 1, Eigen::Dynamic>>(x, n));
  }
  /// dst = x rounded once to T, element by element (rounded): dst a block of T, x an expression
  /// of float or double values of the same shape.
  template <class Dst, class Src>
  static void store_rows(Dst&& dst, const Eigen::MatrixBase<Src>& x) {
    dst = rounded<T>(x.array()).matrix();
  }
};

/// Whether rows may be stored as F (F has a KvFormat).
template <class F, class Enable = void>
inline constexpr bool is_kv_format_v = false;
template <class F>
inline constexpr bool is_kv_format_v<F, std::void_t<typename KvFormat<F>::Element>> = true;

/// Whether an element of F is one whole row of a latent cache, c_kv and K_rope together
/// (FlashMlaFp8Row, kv_quant.hpp), rather than a run of values of either part: a latent cache
/// of such a format has no view of c_kv or K_rope alone, only of its rows.
template <class F>
inline constexpr bool is_latent_row_format_v = false;

/// The values in a row of a view of K or V whose elements are of format T
/// (dim()·kValuesPerElement).
template <class T>
Index row_values(const HeadsView<T>& view) {
  return view.dim() * KvFormat<std::remove_const_t<T>>::kValuesPerElement;
}

namespace detail {

/// The first element of row s of head (b, h) of a view (a batch or head axis of extent 1
/// broadcasts), by the view's strides: elements of any format, no Eigen map of them.
template <class T>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the indices in the order of the axes
T* row_data(const HeadsView<T>& view, Index b, Index h, Index s) {
  const Index bb = view.batch() == 1 ? 0 : b;
  const Index hh = view.heads() == 1 ? 0 : h;
  return view.data() + bb * view.batch_stride() + hh * view.head_stride() + s * view.row_stride();
}

/// The buffer of `size` elements of format F, zeroed: an Eigen vector for the scalar formats
/// (aligned for Eigen's packets), a std::vector of blocks for the block formats.
template <class F>
auto zeroed_buffer(Index size) {
  if constexpr (is_storage_v<F>) {
    return Vector<F>::Zero(size).eval();
  } else {
    return std::vector<F>(static_cast<std::size_t>(size), F{});
  }
}
/// The type of zeroed_buffer<F>.
template <class F>
using CacheBuffer = decltype(zeroed_buffer<F>(0));

/// The layout of a contiguous cache of one row per token: `batch` sequences of `capacity` rows
/// of `stride` elements, [batch, capacity, stride].
struct TokenRows {
  Index batch = 0;
  Index capacity = 0;
  Index stride = 0;
};

/// Moves `rows` (laid out as `from`) into a zeroed buffer of `size` elements laid out as
/// [from.batch, capacity, from.stride] (capacity >= from.capacity; `size` checked by the caller),
/// keeping the first `kept` rows of each sequence: reserve() of the caches of one row per token
/// (LatentCache, IndexerKeyCache). Allocates the new buffer, then frees the old one; `rows` is
/// unchanged if the allocation throws.
template <class F>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, two callers (the reserves)
void grow_token_rows(CacheBuffer<F>& rows, const TokenRows& from, Index capacity, Index kept,
                     Index size) {
  CacheBuffer<F> grown = zeroed_buffer<F>(size);
  for (Index b = 0; b < from.batch; ++b) {
    std::copy_n(rows.data() + b * from.capacity * from.stride, kept * from.stride,
                grown.data() + b * capacity * from.stride);
  }
  rows = std::move(grown);
}

/// Head (b, h) of a view of K, V or latent rows in any format, as a [seq, row_values] matrix of
/// Scalar: the view's own map when it holds Scalar, else its rows widened through their format
/// (allocated: seq × row_values).
template <class Scalar, class T>
auto head_values(const HeadsView<const T>& view, Index b, Index h) {
  if constexpr (is_storage_v<T>) {
    return widened<Scalar>(view.head(b, h));
  } else {
    RowMatrix<Scalar> rows(view.seq(), row_values(view));
    for (Index s = 0; s < view.seq(); ++s) {
      KvFormat<T>::widen(row_data(view, b, h, s), rows.row(s).data(), view.dim());
    }
    return rows;
  }
}

/// Formats other than apex's K/V formats are rejected at compile time.
template <class T>
constexpr void require_kv_format() {
  static_assert(is_kv_format_v<T>,
                "apex reads K and V as float, double, Eigen::half, Eigen::bfloat16 or a block "
                "format of kv_quant.hpp");
}

/// Throws unless a row of `values` values is a whole number of elements of format F.
template <class F>
void check_row_values(Index values, const char* op, const char* name) {
  APEX_CHECK(values % KvFormat<F>::kValuesPerElement == 0,
             "[" << op << "] " << name << " (" << values << ") must be a multiple of the "
                 << KvFormat<F>::kValuesPerElement << " values of a block of its format");
}

/// Throws unless the latent rows of `shape` (a LatentCacheShape or PagedLatentCacheShape: d_kv
/// values, H_kr heads of d_r) are stored by format F: c_kv and each K_rope head whole elements
/// (no block straddles them), or, for a whole-row format, exactly its d_kv and H_kr·d_r.
template <class F, class Shape>
void check_latent_parts(const Shape& shape, const char* op) {
  if constexpr (is_latent_row_format_v<F>) {
    const std::int64_t rope = checked_product(shape.rope_heads, shape.rope_dim, op, "H_kr*d_r");
    APEX_CHECK(shape.latent_dim == F::kLatent && rope == F::kRope,
               "[" << op << "] latent_dim d_kv (" << shape.latent_dim << ") and H_kr*d_r (" << rope
                   << ") must be the row format's " << F::kLatent << " and " << F::kRope);
  } else {
    check_row_values<F>(shape.latent_dim, op, "latent_dim d_kv");
    check_row_values<F>(shape.rope_dim, op, "rope_dim d_r");
  }
}

/// Stores one token's latent row through format F at `to`: c_kv (d_kv values) and K_rope
/// (rope_values) each quantized alone, so that no block straddles the two, or, for a whole-row
/// format, as one element of the row [c_kv ‖ K_rope] (copied together first where the parts lie
/// apart).
template <class F, class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the parts in the order of the row
void store_latent_row(const Scalar* c_kv, Index d_kv, const Scalar* k_rope, Index rope_values,
                      F* to) {
  if constexpr (is_latent_row_format_v<F>) {
    std::array<Scalar, F::kValues> whole;
    std::copy_n(c_kv, F::kLatent, whole.data());
    std::copy_n(k_rope, F::kRope, whole.data() + F::kLatent);
    KvFormat<F>::store_row(whole.data(), F::kValues, to);
  } else {
    KvFormat<F>::store_row(c_kv, d_kv, to);
    KvFormat<F>::store_row(k_rope, rope_values, to + KvFormat<F>::elements(d_kv));
  }
}

}  // namespace detail

}  // namespace apex
