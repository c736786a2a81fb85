// SPDX-License-Identifier: MIT
// Version, error-checking macros and the matrix aliases every apex header uses.
#pragma once

#include <Eigen/Core>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

#define APEX_VERSION_MAJOR 0
#define APEX_VERSION_MINOR 1
#define APEX_VERSION_PATCH 0

/// Throws std::invalid_argument with a streamed message unless `cond` holds.
/// User-facing preconditions: always on, never compiled out. The message starts with the
/// operation in brackets and names the argument, its value and what was expected:
///   APEX_CHECK(d % 2 == 0, "[rope] head_dim (" << d << ") must be even");
#define APEX_CHECK(cond, message)                                             \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream apex_check_stream_;                                  \
      apex_check_stream_ << message; /* NOLINT(bugprone-macro-parentheses) */ \
      throw std::invalid_argument(apex_check_stream_.str());                  \
    }                                                                         \
  } while (false)

/// Internal invariants: checked in debug builds only. Define APEX_ASSERT before including
/// apex to make a violation throw (tests do) or to turn it off everywhere.
#ifndef APEX_ASSERT
#include <cassert>
#define APEX_ASSERT(cond) assert(cond)
#endif

/// Forces inlining of a small hot function whose callers need its locals in registers (a
/// compiler would otherwise judge it by size alone).
#if defined(__GNUC__) || defined(__clang__)
#define APEX_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define APEX_ALWAYS_INLINE inline
#endif

/// The formulas of the APEX-1 Mathematical Reference, Parts 1 and 2, as Eigen code.
namespace apex {

/// Sizes and indices: Eigen's signed index type (std::ptrdiff_t).
using Index = Eigen::Index;

/// Activations are [tokens, features], row-major: one token per row. The documents' [B, S, d]
/// is B consecutive blocks of S rows.
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// A column vector: gains, frequencies, log-sum-exps.
template <class Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
/// Row-major boolean matrix; for masks, `true` means "may attend".
using BoolMatrix = Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A writable view of row-major data whose rows are contiguous (any row stride): a RowMatrix,
/// a block of columns of one, or an Eigen::Map.
template <class Scalar>
using RowRef = Eigen::Ref<RowMatrix<Scalar>>;
/// The read-only RowRef; other inputs (column-major, expressions) are copied into it once.
template <class Scalar>
using ConstRowRef = Eigen::Ref<const RowMatrix<Scalar>>;
/// A writable view of a contiguous vector.
template <class Scalar>
using VectorRef = Eigen::Ref<Vector<Scalar>>;
/// The read-only VectorRef.
template <class Scalar>
using ConstVectorRef = Eigen::Ref<const Vector<Scalar>>;

namespace detail {

/// Blocks template argument deduction for one parameter, so that the scalar type is deduced
/// from the others and this one may be converted (for example HeadsView<T> to HeadsView<const T>).
template <class T>
struct NoDeduceImpl {
  using type = T;
};
template <class T>
using NoDeduce = typename NoDeduceImpl<T>::type;

/// apex computes in float or double; the rest is rejected at compile time.
template <class Scalar>
constexpr void require_supported_scalar() {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "apex supports float and double");
}

/// A value that a move leaves at T{}. apex's classes hold the numbers that describe their storage
/// (extents, sizes, positions) in it, so that a moved-from object is an empty one, exactly like a
/// default-constructed one, instead of one whose sizes outlive its memory. Reads convert to
/// const T&; writes go through get().
template <class T>
class ResetOnMove {
 public:
  ResetOnMove() = default;
  ResetOnMove(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  ResetOnMove(const ResetOnMove&) = default;
  ResetOnMove& operator=(const ResetOnMove&) = default;
  ResetOnMove(ResetOnMove&& other) noexcept : value_(std::exchange(other.value_, T{})) {}
  ResetOnMove& operator=(ResetOnMove&& other) noexcept {
    if (this != &other) value_ = std::exchange(other.value_, T{});
    return *this;
  }
  ~ResetOnMove() = default;

  const T& get() const { return value_; }
  T& get() { return value_; }
  operator const T&() const { return value_; }  // NOLINT(google-explicit-constructor)

 private:
  T value_{};
};

/// Whether a parameter given in double is represented by `Compute` without changing its meaning:
/// finite there, and 0 or at least the smallest normal magnitude (a smaller one would round to
/// 0 or lose its precision). The kernels compute in double when a parameter is not.
template <class Compute>
bool representable_in(double value) {
  constexpr double kMax = static_cast<double>(std::numeric_limits<Compute>::max());
  constexpr double kMin = static_cast<double>(std::numeric_limits<Compute>::min());
  const double magnitude = value < 0 ? -value : value;
  return magnitude <= kMax && (magnitude == 0.0 || magnitude >= kMin);
}

/// Throws unless an object that owns storage has been constructed with its shape: a default-
/// constructed or moved-from one holds nothing and accepts no data.
inline void check_constructed(bool constructed, const char* op, const char* what) {
  APEX_CHECK(constructed, "[" << op << "] the " << what
                              << " is empty (default-constructed or moved-from): construct it with "
                                 "its shape first");
}

/// a·b for non-negative a and b, or std::invalid_argument naming `what` when the product does
/// not fit in 64 bits (sizes are products of user-given dimensions; a wrapped product would
/// describe less memory than the object then indexes).
inline std::int64_t checked_product(std::int64_t a, std::int64_t b, const char* op,
                                    const char* what) {
  APEX_CHECK(a >= 0 && b >= 0,
             "[" << op << "] " << what << " (" << a << " x " << b << ") must not be negative");
  APEX_CHECK(b == 0 || a <= std::numeric_limits<std::int64_t>::max() / b,
             "[" << op << "] " << what << " (" << a << " x " << b << ") overflows 64 bits");
  return a * b;
}

/// The product of several non-negative factors, checked as checked_product.
inline std::int64_t checked_product(std::initializer_list<std::int64_t> factors, const char* op,
                                    const char* what) {
  std::int64_t result = 1;
  for (const std::int64_t f : factors) result = checked_product(result, f, op, what);
  return result;
}

/// a + b for non-negative a and b, checked likewise.
inline std::int64_t checked_sum(std::int64_t a, std::int64_t b, const char* op, const char* what) {
  APEX_CHECK(a >= 0 && b >= 0 && a <= std::numeric_limits<std::int64_t>::max() - b,
             "[" << op << "] " << what << " (" << a << " + " << b
                 << ") must be non-negative and fit in 64 bits");
  return a + b;
}

}  // namespace detail
}  // namespace apex
