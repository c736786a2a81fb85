// SPDX-License-Identifier: MIT
// storage.hpp: the storage types and the one rounding to them.
#include <apex/detail/eigen_adapter.hpp>
#include <apex/storage.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "test_util.hpp"

namespace storage_test {
namespace {

using Eigen::bfloat16;
using Eigen::half;

template <class T>
std::uint16_t bits_of(T x) {
  return Eigen::numext::bit_cast<std::uint16_t>(x);
}

template <class T>
T from_bits(std::uint16_t b) {
  return Eigen::numext::bit_cast<T>(b);
}

/// The correctly rounded T of a double, found by comparing with the two neighbours of the
/// candidate double → float → T gives (which is at most one step off): nearest, ties to the
/// even bit pattern. Finite x within T's range only.
template <class T>
T nearest(double x) {
  const T guess = static_cast<T>(static_cast<float>(x));
  T best = guess;
  double best_error = std::abs(static_cast<double>(static_cast<float>(guess)) - x);
  for (const int step : {-1, 1}) {
    std::uint16_t b = bits_of(guess);
    // Step one representable value up or down in magnitude order (sign-magnitude patterns).
    const bool negative = (b & 0x8000U) != 0;
    const bool away = (step > 0) != negative;  // away from zero for this sign
    if (!away && (b & 0x7FFFU) == 0) continue;
    b = static_cast<std::uint16_t>(away ? b + 1 : b - 1);
    const T neighbour = from_bits<T>(b);
    const double value = static_cast<double>(static_cast<float>(neighbour));
    if (!std::isfinite(value)) continue;
    const double error = std::abs(value - x);
    if (error < best_error || (error == best_error && (b & 1U) == 0)) {
      best = neighbour;
      best_error = error;
    }
  }
  return best;
}

template <class T>
class StorageRounding : public ::testing::Test {};
using SixteenBit = ::testing::Types<half, bfloat16>;
TYPED_TEST_SUITE(StorageRounding, SixteenBit, apex::testing::ScalarName);

TYPED_TEST(StorageRounding, TypesAndComputeTypes) {
  using T = TypeParam;
  static_assert(apex::is_16bit_v<T> && apex::is_storage_v<T>);
  static_assert(std::is_same_v<apex::compute_t<T>, float>);
  static_assert(std::is_same_v<apex::compute_t<double>, double>);
  static_assert(!apex::is_storage_v<int> && !apex::is_16bit_v<float>);
  EXPECT_EQ(sizeof(T), 2U);
}

// The traps of double rounding: just above and just below the midpoint of two neighbours, by
// less than a float ulp, so that double → float lands exactly on the midpoint and a second
// rounding would go to the even neighbour instead of the nearer one.
TYPED_TEST(StorageRounding, DoubleRoundsOnceNearEveryMidpoint) {
  using T = TypeParam;
  int checked = 0;
  for (std::uint32_t b = 0; b < 0x7C00U; b += 7) {  // positive finite patterns (both types)
    const double lo = static_cast<double>(static_cast<float>(from_bits<T>(std::uint16_t(b))));
    const double hi = static_cast<double>(static_cast<float>(from_bits<T>(std::uint16_t(b + 1))));
    if (!std::isfinite(hi)) break;
    const double mid = 0.5 * (lo + hi);
    const double nudge = (hi - lo) * 0x1p-40;
    for (const double x : {mid - nudge, mid + nudge, mid, -(mid - nudge), -(mid + nudge), -mid}) {
      const T got = apex::round_to<T>(x);
      ASSERT_EQ(bits_of(got), bits_of(nearest<T>(x))) << "x = " << x;
      ++checked;
    }
  }
  EXPECT_GT(checked, 20000);
}

TYPED_TEST(StorageRounding, RandomDoublesAndFloatsRoundToNearest) {
  using T = TypeParam;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-30, 15);
  for (int n = 0; n < 200000; ++n) {
    const double x = std::ldexp(mantissa(rng), exponent(rng));
    ASSERT_EQ(bits_of(apex::round_to<T>(x)), bits_of(nearest<T>(x))) << "x = " << x;
    const float f = static_cast<float>(x);
    ASSERT_EQ(bits_of(apex::round_to<T>(f)), bits_of(static_cast<T>(f))) << "f = " << f;
  }
}

TYPED_TEST(StorageRounding, SpecialValuesAndOverflow) {
  using T = TypeParam;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(Eigen::numext::isnan(apex::round_to<T>(std::nan(""))));
  EXPECT_EQ(static_cast<float>(apex::round_to<T>(kInf)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(static_cast<float>(apex::round_to<T>(-kInf)), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(static_cast<float>(apex::round_to<T>(1e300)), std::numeric_limits<float>::infinity());
  // Below half the smallest subnormal: a signed zero.
  EXPECT_EQ(bits_of(apex::round_to<T>(1e-300)), 0U);
  EXPECT_EQ(bits_of(apex::round_to<T>(-1e-300)), 0x8000U);
  EXPECT_EQ(static_cast<float>(apex::round_to<T>(1.0)), 1.0f);
}

TEST(StorageRounding, RoundedExpressionRoundsEachElementOnce) {
  Eigen::ArrayXd x(3);
  const double mid = 1.0 + 0x1p-11;  // halfway between 1 and the next half
  x << mid + 0x1p-40, mid - 0x1p-40, -3.25;
  const Eigen::Array<half, Eigen::Dynamic, 1> r = apex::rounded<half>(x);
  EXPECT_EQ(static_cast<float>(r(0)), 1.0f + 0x1p-10f);
  EXPECT_EQ(static_cast<float>(r(1)), 1.0f);
  EXPECT_EQ(static_cast<float>(r(2)), -3.25f);
  EXPECT_EQ(bits_of(apex::round_to<half>(mid + 0x1p-40)), bits_of(r(0)));
}

// The kernel's check for values that are not finite (detail::all_finite), which reads 16-bit
// values as bits: every bit pattern, alone and among finite values, and only the n columns of
// each row of a strided block.
template <class T>
void check_all_finite_on_every_pattern() {
  using apex::detail::all_finite;
  std::vector<T> block(3 * 40, T(1.5F));
  for (std::uint32_t b = 0; b <= 0xFFFFU; ++b) {
    const T x = from_bits<T>(static_cast<std::uint16_t>(b));
    const bool finite = std::isfinite(static_cast<float>(x));
    ASSERT_EQ(all_finite(&x, 1, 1, 1), finite) << std::hex << b;
    block[1 * 40 + 33] = x;  // row 1, column 33 of [3 × 37] with ld = 40
    ASSERT_EQ(all_finite(block.data(), 3, 37, 40), finite) << std::hex << b;
    block[1 * 40 + 33] = T(1.5F);
    block[1 * 40 + 38] = x;  // past the 37 columns: never read
    ASSERT_TRUE(all_finite(block.data(), 3, 37, 40)) << std::hex << b;
    block[1 * 40 + 38] = T(1.5F);
  }
}

TEST(StorageBits, AllFiniteReadsEvery16BitPatternAsItsValue) {
  check_all_finite_on_every_pattern<bfloat16>();
  check_all_finite_on_every_pattern<half>();
}

}  // namespace
}  // namespace storage_test
