// SPDX-License-Identifier: MIT
// Fuzz target: RoPE (§4) and YaRN (§5) tables built with extreme bases, scales, betas, positions
// and dimensions, and their application. For every table the library accepts:
//   - every cos/sin entry is finite, at most the table's magnitude, and equals magnitude·cos(m·θ_i)
//     (resp. sin) computed here in long double, to the rounding of the angle and of Scalar;
//   - the two features of a pair hold the same value, as the pairing lays them out;
//   - θ_0 = 1 and θ_i decreases (plain RoPE); YaRN's θ'_i lies in [θ_i / s, θ_i], its ramp in
//     [0, 1] and its regimes follow the ramp; with s = 1 YaRN is plain RoPE exactly;
//   - a table rebuilt with from_cos_sin (full or half width) rotates exactly like the original;
//   - apply_rope keeps the length of every pair (times the magnitude) for moderate x, leaves the
//     features past the rotary width alone, and the offset, id and value-returning forms agree.
// Sizes are capped (positions ≤ 512, dimensions ≤ 64) so that each table is small; the bases,
// scales and betas come from the whole double range.
#include <apex/rope.hpp>
#include <apex/yarn.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace apex::fuzz {
namespace {

/// An exponent-spread positive real: 1 + tiny, ordinary, or astronomically large, plus the
/// invalid ones (≤ 1, NaN, inf).
double extreme_base(Input& in) {
  switch (in.choice(5)) {
    case 0:
      return 1.0 + std::ldexp(1.0, -static_cast<int>(in.in(1, 52)));
    case 1:
      return std::ldexp(1.0, static_cast<int>(in.in(1, 1023)));
    case 2:
      return in.pick({10000.0, 500000.0, 1e6, 2.0, 1.5});
    case 3:
      return in.real_in(1.0, 1e7);
    default:
      return in.any_real();
  }
}

template <class Scalar>
void check_table_values(const RopeTable<Scalar>& table, const Vector<double>& theta,
                        double magnitude) {
  const Index rd = table.rotary_dim();
  const Index pairs = rd / 2;
  const bool interleaved = table.pairing() == RopePairing::kInterleaved;
  const double eps = static_cast<double>(std::numeric_limits<Scalar>::epsilon());
  for (Index m = 0; m < table.max_positions(); ++m) {
    for (Index i = 0; i < pairs; ++i) {
      const Index a = interleaved ? 2 * i : i;
      const Index b = interleaved ? 2 * i + 1 : i + pairs;
      const Scalar c = table.cos()(m, a), s = table.sin()(m, a);
      APEX_FUZZ_REQUIRE(table.cos()(m, b) == c && table.sin()(m, b) == s,
                        "the two features of a RoPE pair hold different values");
      APEX_FUZZ_REQUIRE(
          std::isfinite(static_cast<double>(c)) && std::isfinite(static_cast<double>(s)),
          "an accepted RoPE/YaRN table holds a non-finite entry");
      const double limit = magnitude * (1.0 + 2.0 * eps) +
                           static_cast<double>(std::numeric_limits<Scalar>::denorm_min());
      APEX_FUZZ_REQUIRE(
          std::abs(static_cast<double>(c)) <= limit && std::abs(static_cast<double>(s)) <= limit,
          "a RoPE/YaRN entry exceeds the table's magnitude");
      // The library forms the angle m·θ in double; its rounding error is at most half an ulp of
      // the angle, which moves cos and sin by as much. Then the product with the magnitude and
      // the rounding to Scalar.
      const double angle = static_cast<double>(m) * theta(i);
      const long double exact = static_cast<long double>(m) * static_cast<long double>(theta(i));
      const double tol = magnitude * (std::abs(angle) * 2.3e-16 + 4.0 * eps) +
                         static_cast<double>(std::numeric_limits<Scalar>::denorm_min());
      const double want_c = magnitude * static_cast<double>(std::cos(exact));
      const double want_s = magnitude * static_cast<double>(std::sin(exact));
      APEX_FUZZ_REQUIRE(std::abs(static_cast<double>(c) - want_c) <= tol &&
                            std::abs(static_cast<double>(s) - want_s) <= tol,
                        "RoPE entry (" + std::to_string(m) + ", pair " + std::to_string(i) +
                            ") is not magnitude·cos/sin(m·θ): " + std::to_string(c) + ", " +
                            std::to_string(s) + " vs " + std::to_string(want_c) + ", " +
                            std::to_string(want_s));
    }
  }
}

/// apply_rope's contract on a table the library accepted.
template <class Scalar>
void check_application(Input& in, const RopeTable<Scalar>& table, double magnitude) {
  const Index head_dim = table.head_dim();
  if (head_dim > 64) return;
  const Index heads = in.in(1, 3);
  const Index rows = in.in(0, std::min<Index>(6, table.max_positions()));
  const Values mode = in.choice(4) == 0 ? Values::kExtreme : Values::kModerate;
  RowMatrix<Scalar> x(rows, heads * head_dim);
  fill(x, in, mode, 2.0);
  const Index offset = in.in(0, table.max_positions() - rows);
  RowMatrix<Scalar> rotated = x;
  apply_rope(table, offset, RowRef<Scalar>(rotated));

  // The id form and the value-returning forms agree bit for bit.
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> ids(rows);
  for (Index t = 0; t < rows; ++t) ids(t) = static_cast<std::int32_t>(offset + t);
  RowMatrix<Scalar> by_ids = x;
  apply_rope(table, ids, RowRef<Scalar>(by_ids));
  APEX_FUZZ_REQUIRE(same_bits(by_ids, rotated),
                    "apply_rope: the id form differs from the offset form");
  APEX_FUZZ_REQUIRE(same_bits(rope(table, offset, x), rotated), "rope() differs from apply_rope");

  // A table rebuilt from its own cos/sin rotates identically.
  const RopeTable<Scalar> full = RopeTable<Scalar>::from_cos_sin(
      table.cos(), table.sin(), head_dim, table.pairing(), RopeCacheWidth::kFull);
  RowMatrix<Scalar> again = x;
  apply_rope(full, offset, RowRef<Scalar>(again));
  APEX_FUZZ_REQUIRE(same_bits(again, rotated), "from_cos_sin(kFull) rotates differently");

  const Index rd = table.rotary_dim();
  const bool interleaved = table.pairing() == RopePairing::kInterleaved;
  const double eps = static_cast<double>(std::numeric_limits<Scalar>::epsilon());
  for (Index t = 0; t < rows; ++t) {
    for (Index h = 0; h < heads; ++h) {
      for (Index f = rd; f < head_dim; ++f) {
        const Index col = h * head_dim + f;
        APEX_FUZZ_REQUIRE(same_bits(rotated.col(col).row(t), x.col(col).row(t)),
                          "apply_rope changed a feature past the rotary width");
      }
      if (mode == Values::kExtreme) continue;
      for (Index i = 0; i < rd / 2; ++i) {
        const Index a = h * head_dim + (interleaved ? 2 * i : i);
        const Index b = h * head_dim + (interleaved ? 2 * i + 1 : i + rd / 2);
        const double before =
            std::hypot(static_cast<double>(x(t, a)), static_cast<double>(x(t, b)));
        const double after =
            std::hypot(static_cast<double>(rotated(t, a)), static_cast<double>(rotated(t, b)));
        APEX_FUZZ_REQUIRE(
            std::abs(after - magnitude * before) <= 8.0 * eps * magnitude * (before + 1e-30),
            "apply_rope does not keep the length of a pair: " + std::to_string(before) + " -> " +
                std::to_string(after));
      }
    }
  }
}

template <class Scalar>
void plain_table(Input& in) {
  const Index positions = in.flag() ? in.in(1, 64) : in.in(-1, 512);
  const Index head_dim = in.flag() ? 2 * in.in(0, 16) : in.in(-2, 66);
  RopeParams params;
  params.rotary_dim = in.flag() ? 0 : in.in(-2, head_dim + 2);
  params.base = extreme_base(in);
  params.pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  const Index rd = params.rotary_dim == 0 ? head_dim : params.rotary_dim;
  const bool valid = positions >= 1 && rd >= 2 && rd % 2 == 0 && rd <= head_dim &&
                     std::isfinite(params.base) && params.base > 1.0;
  std::optional<RopeTable<Scalar>> table;
  const bool returned =
      attempt("RopeTable", !valid, [&] { table.emplace(positions, head_dim, params); });
  APEX_FUZZ_REQUIRE(returned == valid, "RopeTable rejected valid arguments");
  if (!returned) return;
  const Vector<double> theta = rope_frequencies(rd, params.base);
  APEX_FUZZ_REQUIRE(theta(0) == 1.0, "θ_0 must be 1");
  for (Index i = 1; i < theta.size(); ++i) {
    APEX_FUZZ_REQUIRE(theta(i) <= theta(i - 1) && theta(i) > 0.0, "θ_i must decrease and stay > 0");
  }
  check_table_values(*table, theta, 1.0);
  check_application(in, *table, 1.0);
}

template <class Scalar>
void frequency_table(Input& in) {
  Vector<double> theta(in.in(1, 8));
  for (Index i = 0; i < theta.size(); ++i) {
    theta(i) =
        in.flag() ? in.real_in(0.0, 4.0) : std::ldexp(1.0, static_cast<int>(in.in(-1074, 40)));
  }
  const Index positions = in.in(1, 256);
  const double magnitude =
      in.flag() ? 1.0 : std::ldexp(in.real_in(0.5, 1.0), static_cast<int>(in.in(-60, 60)));
  const auto pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  // Valid arguments (every angle m·θ is finite and the magnitude lies in float's normal range):
  // the table must be built, so any exception is a finding.
  const RopeTable<Scalar> table = RopeTable<Scalar>::from_frequencies(
      theta, positions, 2 * theta.size() + in.in(0, 3), pairing, magnitude);
  check_table_values(table, theta, magnitude);
  check_application(in, table, magnitude);
}

template <class Scalar>
void yarn(Input& in) {
  YarnParams p;
  p.scale =
      in.flag() ? in.real_in(1.0, 64.0) : in.pick({1.0, 1.0 + 1e-15, 1e6, 1e300, 40.0, 0.5, -1.0});
  p.original_context = in.flag() ? in.in(1, 1 << 20) : in.any_index();
  p.beta_fast = in.flag() ? in.real_in(0.5, 64.0) : in.any_real();
  p.beta_slow = in.flag() ? in.real_in(0.01, 2.0) : in.any_real();
  p.base = extreme_base(in);
  p.truncate = in.flag();
  if (in.flag()) p.mscale = in.real_in(0.0, 2.0);
  if (in.flag()) p.mscale_all_dim = in.real_in(0.0, 2.0);
  if (in.choice(4) == 0) p.attention_factor = in.real_in(0.1, 4.0);
  p.temperature = in.pick({YarnTemperature::kInTables, YarnTemperature::kSoftmaxScale,
                           YarnTemperature::kLogits, YarnTemperature::kNone});
  const Index rd = 2 * in.in(1, 32);
  const Index head_dim = rd + in.in(0, 4);
  const Index positions = in.in(1, 256);
  const auto pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;

  std::optional<RopeTable<Scalar>> table;
  const bool returned = attempt("yarn_table", [&] {
    table.emplace(yarn_table<Scalar>(positions, head_dim, in.flag() ? 0 : rd, pairing, p));
  });
  if (!returned) return;
  const Index table_rd = table->rotary_dim();
  const Vector<double> theta = yarn_frequencies(table_rd, p);
  const Vector<double> plain = rope_frequencies(table_rd, p.base);
  const Vector<double> ramp = yarn_ramp(table_rd, p);
  const std::vector<YarnRegime> regimes = yarn_regimes(table_rd, p);
  const YarnCorrectionRange range = yarn_correction_range(table_rd, p);
  // (low may exceed d − 1: when even the slowest pair turns β_fast times over L the range lies
  // past the last pair and every pair is left unscaled, as the reference code does.)
  APEX_FUZZ_REQUIRE(std::isfinite(range.low) && std::isfinite(range.high) && range.low >= 0.0 &&
                        range.low < range.high,
                    "YaRN correction range [" + std::to_string(range.low) + ", " +
                        std::to_string(range.high) + "] is empty or not finite for rotary_dim " +
                        std::to_string(table_rd) + ", " + describe(p));
  for (Index i = 0; i < theta.size(); ++i) {
    APEX_FUZZ_REQUIRE(
        theta(i) <= plain(i) * (1 + 1e-12) && theta(i) >= plain(i) / p.scale * (1 - 1e-12),
        "YaRN θ' outside [θ/s, θ]");
    APEX_FUZZ_REQUIRE(ramp(i) >= 0.0 && ramp(i) <= 1.0, "YaRN ramp outside [0, 1]");
    const YarnRegime expected = ramp(i) <= 0.0   ? YarnRegime::kHighFrequency
                                : ramp(i) >= 1.0 ? YarnRegime::kLowFrequency
                                                 : YarnRegime::kMidFrequency;
    APEX_FUZZ_REQUIRE(regimes[static_cast<std::size_t>(i)] == expected, "YaRN regime vs ramp");
  }
  if (p.scale == 1.0) {
    for (Index i = 0; i < theta.size(); ++i) {
      APEX_FUZZ_REQUIRE(theta(i) == plain(i), "YaRN with s = 1 is not plain RoPE");
    }
  }
  const double magnitude = yarn_table_magnitude(p);
  check_table_values(*table, theta, magnitude);
  check_application(in, *table, magnitude);
}

/// The checks of this target, in the order an input's choice selects them.
template <class Scalar>
constexpr Check kChecks[] = {plain_table<Scalar>, frequency_table<Scalar>, yarn<Scalar>};

}  // namespace
}  // namespace apex::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace apex::fuzz;
  return run_checks(data, size, kChecks<float>, kChecks<double>);
}
