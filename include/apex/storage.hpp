// SPDX-License-Identifier: MIT
// Storage types: what apex may hold in memory, what it computes them in, and the one rounding
// from a computed value to a stored one.
//
// apex computes in float or double (the compute type) and stores tensors in any of
//   float, double, Eigen::half (IEEE binary16: 1 sign, 5 exponent, 10 fraction bits) and
//   Eigen::bfloat16 (1 sign, 8 exponent, 7 fraction bits: float's range, 8 bits of precision).
// A 16-bit element is widened to float when it is read (exactly: every half and every bfloat16
// is a float) and the arithmetic runs in float; a computed value is narrowed to the storage type
// when it is written, rounded once to nearest, ties to even (round_to). A half infinity is an
// infinity, a half NaN a NaN: the non-finite policies of the kernels are unchanged.
#pragma once

#include <apex/config.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace apex {

/// Whether T is one of the 16-bit storage types.
template <class T>
inline constexpr bool is_16bit_v =
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// Whether apex may store elements of type T: float, double, Eigen::half or Eigen::bfloat16.
template <class T>
inline constexpr bool is_storage_v =
    is_16bit_v<T> || std::is_same_v<T, float> || std::is_same_v<T, double>;

/// The type elements of storage type T are computed in: float for the 16-bit types, else T.
template <class T>
using compute_t = std::conditional_t<is_16bit_v<T>, float, T>;

/// The wider of two compute types.
template <class A, class B>
using wider_t =
    std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

/// x rounded once, to nearest with ties to even, to the storage type T (x itself when T holds it
/// exactly). From double to a 16-bit type this is not double → float → T, which would round
/// twice: x is first rounded to float towards zero with the last bit set when inexact ("round
/// to odd"), which a float → T rounding then turns into the correctly rounded result, because
/// float has more than two bits beyond T's precision.
template <class T, class S>
T round_to(S x) {
  static_assert(is_storage_v<T> && (std::is_same_v<S, float> || std::is_same_v<S, double>),
                "round_to: a float or double to float, double, half or bfloat16");
  if constexpr (!is_16bit_v<T> || std::is_same_v<S, float>) {
    return static_cast<T>(x);
  } else {
    float f = static_cast<float>(x);
    if (std::isfinite(f) && static_cast<double>(f) != x) {
      if (std::abs(static_cast<double>(f)) > std::abs(x)) f = std::nextafter(f, 0.0f);
      std::uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof bits);
      bits |= 1U;
      std::memcpy(&f, &bits, sizeof bits);
    }
    return static_cast<T>(f);
  }
}

/// An Eigen expression of `x` rounded element by element to T (round_to): a vectorised cast
/// where one rounding is what the cast does, round_to otherwise.
template <class T, class Derived>
auto rounded(const Eigen::ArrayBase<Derived>& x) {
  using S = typename Derived::Scalar;
  if constexpr (is_16bit_v<T> && std::is_same_v<S, double>) {
    return x.unaryExpr([](S v) { return round_to<T>(v); });
  } else {
    return x.template cast<T>();
  }
}

/// A matrix of Scalar with the values of `m`: `m` itself (a copy of the expression or map, not of
/// its elements) when it already holds Scalar, else a row-major copy widened element by element
/// (allocated).
template <class Scalar, class Derived>
auto widened(const Eigen::MatrixBase<Derived>& m) {
  if constexpr (std::is_same_v<typename Derived::Scalar, Scalar>) {
    return m.derived();
  } else {
    return RowMatrix<Scalar>(m.template cast<Scalar>());
  }
}

/// `m` as a new row-major matrix of storage type T: widened exactly, or rounded once to nearest
/// with ties to even (round_to; a 16-bit value is widened to float first, which is exact). How a
/// layer's weights move to another storage type (with_weights).
template <class T, class Derived>
RowMatrix<T> converted(const Eigen::MatrixBase<Derived>& m) {
  if constexpr (is_16bit_v<typename Derived::Scalar>) {
    return rounded<T>(m.template cast<float>().array()).matrix();
  } else {
    return rounded<T>(m.array()).matrix();
  }
}

namespace detail {

/// Storage types other than float, double, half and bfloat16 are rejected at compile time.
template <class T>
constexpr void require_storage_type() {
  static_assert(is_storage_v<T>, "apex stores float, double, Eigen::half and Eigen::bfloat16");
}

/// A layer computing in Scalar holds its weights in Scalar or in a 16-bit storage type.
template <class Scalar, class Weight>
constexpr void require_weight_type() {
  static_assert(std::is_same_v<Weight, Scalar> || is_16bit_v<Weight>,
                "a layer's weights are stored in its scalar type, Eigen::half or Eigen::bfloat16");
}

}  // namespace detail
}  // namespace apex
