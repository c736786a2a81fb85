// SPDX-License-Identifier: MIT
// Plain references for the quantized K/V formats (kv_quant.hpp, fp8.hpp), written from their
// definitions for clarity, not speed:
//   - ggml's q8_0 and q4_0 reference quantizers, step by step in float as ggml computes them
//     (the C operations it uses: fabsf, roundf, a float-to-int8 conversion), into raw bytes laid
//     out as ggml lays them out, for finite input;
//   - the value of an OFP8 code from its bit fields with std::ldexp, and the nearest code to a
//     value by searching all 256 codes (ties to the even code), saturating.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace apex::reference {

/// The half nearest to f (ties to even) as its bits, from f's bits: the one rounding ggml's
/// GGML_FP32_TO_FP16 does, written out.
inline std::uint16_t float_to_half_bits(float f) {
  std::uint32_t x = 0;
  std::memcpy(&x, &f, sizeof x);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000U);
  const std::uint32_t magnitude = x & 0x7fffffffU;
  if (magnitude > 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7e00U);
  const double a = std::fabs(static_cast<double>(f));
  // The candidates: every finite half is k · 2^(e − 24) for an integer k; search by scaling.
  if (a >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7c00U);  // rounds past 65504
  int e = a == 0.0 ? -14 : std::max(-14, std::ilogb(a));  // subnormals share 2^-14's step
  const double step = std::ldexp(1.0, e - 10);
  double k = std::floor(a / step);
  const double rest = a - k * step;
  if (rest > step / 2 || (rest == step / 2 && std::fmod(k, 2.0) == 1.0)) k += 1;
  const double rounded = k * step;
  if (rounded == 0.0) return sign;
  const int exponent = std::ilogb(rounded);
  if (exponent < -14) {  // subnormal: the mantissa counts steps of 2^-24
    return static_cast<std::uint16_t>(sign |
                                      static_cast<std::uint16_t>(rounded / std::ldexp(1.0, -24)));
  }
  const auto mantissa =
      static_cast<std::uint16_t>((rounded / std::ldexp(1.0, exponent) - 1.0) * 1024.0);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>((exponent + 15) << 10) |
                                    mantissa);
}

/// ggml's quantize_row_q8_0_ref of one block of 32 finite floats, as its 34 bytes.
inline std::array<std::uint8_t, 34> q8_0_bytes(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = amax > std::fabs(x[j]) ? amax : std::fabs(x[j]);
  const float d = amax / 127;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  std::array<std::uint8_t, 34> bytes{};
  const std::uint16_t half = float_to_half_bits(d);
  std::memcpy(bytes.data(), &half, 2);
  for (int j = 0; j < 32; ++j) {
    const float scaled = x[j] * id;
    // A non-finite product (1/d overflowed) converts to code 0, as on x86.
    const auto code = static_cast<std::int8_t>(std::isfinite(scaled) ? std::roundf(scaled) : 0.0f);
    std::memcpy(bytes.data() + 2 + j, &code, 1);
  }
  return bytes;
}

/// ggml's quantize_row_q4_0_ref of one block of 32 finite floats, as its 18 bytes.
inline std::array<std::uint8_t, 18> q4_0_bytes(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  std::array<std::uint8_t, 18> bytes{};
  const std::uint16_t half = float_to_half_bits(d);
  std::memcpy(bytes.data(), &half, 2);
  const auto code = [&](float v) {
    volatile float scaled = v * id;  // rounded to float before the addition, as in ggml
    const float offset = scaled + 8.5f;
    if (!std::isfinite(offset)) return 0;
    const int truncated = static_cast<std::int8_t>(offset);
    return truncated < 15 ? truncated : 15;
  };
  for (int j = 0; j < 16; ++j) {
    bytes[static_cast<std::size_t>(2 + j)] =
        static_cast<std::uint8_t>(code(x[j]) | (code(x[j + 16]) << 4));
  }
  return bytes;
}

/// The value of an OFP8 code with `exponent_bits` (4: e4m3, 5: e5m2), from its fields.
inline double fp8_code_value(std::uint8_t c, int exponent_bits) {
  const int mantissa_bits = 7 - exponent_bits;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (c >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = c & ((1 << mantissa_bits) - 1);
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  const int top = (1 << exponent_bits) - 1;
  if (exponent_bits == 4 && e == top && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (exponent_bits == 5 && e == top) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  const double fraction = static_cast<double>(m) / (1 << mantissa_bits);
  return e == 0 ? sign * std::ldexp(fraction, 1 - bias)
                : sign * std::ldexp(1.0 + fraction, e - bias);
}

/// The finite code nearest to x (ties to the code with an even mantissa), saturating at the
/// largest finite code, by searching every code; NaN gives 0x7f with x's sign.
inline std::uint8_t fp8_nearest(double x, int exponent_bits) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7f);
  const double a = std::fabs(x);
  int best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    const double v = fp8_code_value(static_cast<std::uint8_t>(c), exponent_bits);
    if (!std::isfinite(v)) continue;
    const double distance = std::fabs(v - a);
    if (distance < best_distance || (distance == best_distance && (c & 1) == 0)) {
      best = c;
      best_distance = distance;
    }
  }
  if (std::isinf(a)) best = exponent_bits == 4 ? 0x7e : 0x7b;
  return static_cast<std::uint8_t>(sign | best);
}

}  // namespace apex::reference
