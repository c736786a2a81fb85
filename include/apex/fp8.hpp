// SPDX-License-Identifier: MIT
// The two 8-bit floating-point formats of the OCP 8-bit Floating Point Specification (OFP8,
// 2023), as K/V caches store them (kv_quant.hpp): one byte, sign | exponent | mantissa.
//
//   format  bits   bias  largest finite  least normal  least subnormal  inf   NaN
//   e4m3    1-4-3   7    448 (0x7e)      2^-6          2^-9             none  S.1111.111
//   e5m2    1-5-2  15    57344 (0x7b)    2^-14         2^-16            ±inf  S.11111.mm, mm ≠ 0
//
// Encoding (fp8_encode) rounds a float once, to nearest with ties to even, and saturates: a
// finite value beyond the largest finite one, and ±inf, become ± the largest finite value
// (OFP8's saturating conversion; an e5m2 cache never stores inf). NaN becomes NaN (0x7f with
// the input's sign). -0.0 keeps its sign. Decoding (fp8_decode) is exact: every code is a float.
// Both are plain integer arithmetic, the same on every machine; nothing allocates.
#pragma once

#include <apex/config.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>

namespace apex {

/// The two OFP8 formats.
enum class Fp8Kind {
  kE4m3,  ///< 4 exponent bits, 3 mantissa bits, no infinities, largest finite 448
  kE5m2,  ///< 5 exponent bits, 2 mantissa bits, IEEE-like, largest finite 57344
};

namespace detail {

/// The layout constants of an OFP8 format.
struct Fp8Layout {
  int mantissa_bits;
  int bias;
  std::uint8_t max_finite;  // the code of the largest finite magnitude
  std::uint8_t nan;         // the code apex writes for NaN (sign apart)
};

constexpr Fp8Layout fp8_layout(Fp8Kind kind) {
  return kind == Fp8Kind::kE4m3 ? Fp8Layout{3, 7, 0x7e, 0x7f} : Fp8Layout{2, 15, 0x7b, 0x7f};
}

/// n rounded to a multiple of 2^shift, to nearest with ties to even, then shifted right by
/// `shift` (n >= 0, shift >= 1).
constexpr std::uint32_t shift_rounded(std::uint32_t n, int shift) {
  const std::uint32_t half = 1U << (shift - 1);
  const std::uint32_t odd = (n >> shift) & 1U;
  return (n + half - 1 + odd) >> shift;
}

/// The value of an fp8 code, in double (exact; fp8_decode's table is made from it).
constexpr double fp8_value(std::uint8_t code, Fp8Kind kind) {
  const Fp8Layout f = fp8_layout(kind);
  const int exponent_bits = 7 - f.mantissa_bits;
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  const int exponent = (code >> f.mantissa_bits) & ((1 << exponent_bits) - 1);
  const double sign = (code & 0x80) != 0 ? -1.0 : 1.0;
  const int top = (1 << exponent_bits) - 1;
  constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
  if (kind == Fp8Kind::kE4m3 && exponent == top && mantissa == 7) return kNan;
  if (kind == Fp8Kind::kE5m2 && exponent == top) {
    return mantissa == 0 ? sign * std::numeric_limits<double>::infinity() : kNan;
  }
  // value = significand · 2^(e − bias − mantissa_bits), the significand with its hidden bit.
  const int significand = exponent == 0 ? mantissa : mantissa + (1 << f.mantissa_bits);
  int power = (exponent == 0 ? 1 : exponent) - f.bias - f.mantissa_bits;
  double value = significand;
  for (; power > 0; --power) value *= 2.0;
  for (; power < 0; ++power) value *= 0.5;
  return sign * value;
}

/// The 256 values of a format's codes as floats.
template <Fp8Kind kKind>
struct Fp8Table {
  static const std::array<float, 256>& values() {
    static const std::array<float, 256> table = [] {
      std::array<float, 256> t{};
      for (int c = 0; c < 256; ++c) {
        t[static_cast<std::size_t>(c)] =
            static_cast<float>(fp8_value(static_cast<std::uint8_t>(c), kKind));
      }
      return t;
    }();
    return table;
  }
};

}  // namespace detail

/// The value of fp8 code `code` of format kKind (exact).
template <Fp8Kind kKind>
inline float fp8_decode(std::uint8_t code) {
  return detail::Fp8Table<kKind>::values()[code];
}

/// x rounded once to format kKind, to nearest with ties to even, saturating (header comment):
/// |x| beyond the largest finite value, ±inf included, gives ± the largest finite value; NaN
/// gives the NaN code with x's sign.
template <Fp8Kind kKind>
inline std::uint8_t fp8_encode(float x) {
  constexpr detail::Fp8Layout f = detail::fp8_layout(kKind);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80U);
  const std::uint32_t magnitude = bits & 0x7fffffffU;
  if (magnitude > 0x7f800000U) return static_cast<std::uint8_t>(sign | f.nan);
  // The smallest normal magnitude of the format, as float bits: exponent 1 − bias.
  constexpr std::uint32_t min_normal = static_cast<std::uint32_t>(127 + 1 - f.bias) << 23;
  std::uint32_t code = 0;
  if (magnitude < min_normal) {
    // Subnormal (or zero): the code is |x| / 2^(1 − bias − m) rounded to an integer; that
    // quotient is below 2^m, so the float's significand (with its hidden bit) shifted right
    // is it. A result of 2^m is the smallest normal code, as it should be.
    const int exponent = static_cast<int>(magnitude >> 23);
    if (exponent == 0) return sign;  // float zeros and subnormals are far below 2^-16
    const std::uint32_t significand = (magnitude & 0x7fffffU) | 0x800000U;
    // |x| = significand · 2^(exponent − 150); the code's unit is 2^(1 − bias − m).
    const int shift = (1 - f.bias - f.mantissa_bits) - (exponent - 150);
    code = shift >= 32 ? 0 : detail::shift_rounded(significand, shift);
  } else {
    // Normal: re-bias the exponent, keep m mantissa bits, round the rest; a carry moves the
    // exponent up, as it should.
    const std::uint32_t rebased = magnitude - (static_cast<std::uint32_t>(127 - f.bias) << 23);
    const std::uint32_t rounded = detail::shift_rounded(rebased, 23 - f.mantissa_bits);
    code = rounded > f.max_finite ? f.max_finite : rounded;
  }
  return static_cast<std::uint8_t>(sign | code);
}

}  // namespace apex
