// SPDX-License-Identifier: MIT
// YaRN context extension (§5): per-pair frequency scaling and the attention temperature, built
// into a RopeTable (§4) that the usual apply_rope rotates with.
//
// §5.3–§5.4 and the §5.6 example contradict each other, so the library implements YaRN as the
// authors' reference code, HuggingFace transformers and llama.cpp do (SEED-NOTES.md, "YaRN,
// exactly"), which reproduces the document's classification of the §5.6 pairs:
//   1. θ_i = b^(-2i/d) (extrapolation) and θ_i / s (interpolation), d = rotary dimension
//   2. corr(n) = d·ln(L / (2π·n)) / (2·ln b): the pair index making n full turns over L
//   3. lo = max(floor(corr(β_fast)), 0), hi = min(ceil(corr(β_slow)), d − 1)
//   4. ramp_i = clamp((i − lo) / (hi − lo), 0, 1)
//   5. θ'_i = (θ_i / s)·ramp_i + θ_i·(1 − ramp_i)
//   6. attention factor = 0.1·ln(s) + 1 (s > 1), DeepSeek's mscale variant optional
//
// Where the temperature goes (YarnTemperature). §5.5 says the factor is "multiplied into
// attention scores". The YaRN paper and every reference implementation instead multiply the
// cos/sin tables by it, so q and k each carry it and the logits of rotated features grow by
// factor² (kInTables, the default). DeepSeek-V2/V3 fold the square into the softmax scale of
// the whole logit instead (kSoftmaxScale). For attention on fully rotated heads both give the
// same result; with decoupled RoPE (MLA) they differ, since only the rotated part of the logit
// sees the tables. kLogits is the literal reading of §5.5 (logits × factor once) and kNone
// drops the temperature. See SEED-NOTES.md.
#pragma once

#include <apex/config.hpp>
#include <apex/rope.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <vector>

namespace apex {

/// Where YaRN's attention factor is applied (see the comment at the top of this header).
enum class YarnTemperature {
  kInTables,      ///< cos/sin × factor: rotated logits × factor² (HuggingFace, llama.cpp)
  kSoftmaxScale,  ///< tables unscaled; the caller multiplies the softmax scale by factor²
  kLogits,        ///< tables unscaled; the caller multiplies the softmax scale by factor
  kNone,          ///< no temperature at all
};

/// Parameters of YaRN (§5). The defaults are the document's (β_fast = 32, β_slow = 1,
/// b = 10000); `original_context` (L, the trained context) has no default and must be set.
struct YarnParams {
  double scale = 1.0;          ///< s = extended context / original context, ≥ 1
  Index original_context = 0;  ///< L, the context the model was trained with (> 0)
  double beta_fast = 32.0;     ///< pairs turning ≥ β_fast times over L keep θ (high frequency)
  double beta_slow = 1.0;      ///< pairs turning ≤ β_slow times over L get θ/s (low frequency)
  double base = 10000.0;       ///< b in θ_i = b^(-2i/d)
  /// Round the correction range outwards to whole pairs (floor/ceil), as the reference code
  /// does by default; false keeps the real-valued bounds.
  bool truncate = true;
  /// DeepSeek's mscale and mscale_all_dim: with either set, the table factor is
  /// get(s, mscale) / get(s, mscale_all_dim), get(s, m) = 0.1·m·ln(s) + 1, an unset mscale
  /// counting as 1 and an unset mscale_all_dim as 0 (DeepSeek's own defaults). A set
  /// mscale_all_dim also multiplies the softmax scale by get(s, mscale_all_dim)², as DeepSeek
  /// does for the whole logit (see yarn_softmax_scale_multiplier). A set value must give a
  /// finite get(s, m) > 0 (m > −10 / ln(s)): a temperature ≤ 0 has no meaning.
  std::optional<double> mscale;
  /// DeepSeek's mscale_all_dim (see mscale): divides the table factor and, when set, also
  /// multiplies the softmax scale (yarn_softmax_scale_multiplier). Unset: counts as 0 in the
  /// factor and leaves the softmax scale alone.
  std::optional<double> mscale_all_dim;
  /// Overrides the factor of step 6 (mscale / mscale_all_dim then only affect the softmax
  /// multiplier through mscale_all_dim).
  std::optional<double> attention_factor;
  /// Where the attention factor goes: into the cos/sin tables (kInTables, the default, as the
  /// reference code does), the softmax scale, the logits, or nowhere. §5.5 says the logits;
  /// see the top of this header and SEED-NOTES.md.
  YarnTemperature temperature = YarnTemperature::kInTables;
};

/// How YaRN treats one frequency pair (§5.3).
enum class YarnRegime {
  kHighFrequency,  ///< ramp 0: θ' = θ (extrapolated, unchanged)
  kMidFrequency,   ///< 0 < ramp < 1: a blend of θ and θ/s
  kLowFrequency,   ///< ramp 1: θ' = θ/s (interpolated)
};

/// The pair-index range [low, high] over which the ramp of step 4 rises from 0 to 1.
struct YarnCorrectionRange {
  double low = 0.0;   ///< lo: pairs i <= lo keep θ_i (ramp 0); a pair index, >= 0
  double high = 0.0;  ///< hi > lo: pairs i >= hi use θ_i / s (ramp 1)
};

/// get(s, m) = 0.1·m·ln(s) + 1 for s > 1, else 1: the YaRN temperature (§5.5) with DeepSeek's
/// multiplier m (m = 1 gives the document's 0.1·ln(s) + 1). The bare formula, unchecked: it
/// is ≤ 0 for m ≤ −10 / ln(s), which YarnParams rejects.
inline double yarn_mscale(double scale, double m = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

namespace detail {

// A set DeepSeek multiplier must give a usable temperature get(s, m): finite and > 0.
inline void check_yarn_mscale(const std::optional<double>& m, double scale, const char* name) {
  if (!m) return;
  APEX_CHECK(std::isfinite(*m), "[yarn] " << name << " (" << *m << ") must be finite");
  const double get = yarn_mscale(scale, *m);
  APEX_CHECK(std::isfinite(get) && get > 0.0,
             "[yarn] " << name << " (" << *m << ") gives get(scale, " << name << ") = 0.1 * "
                       << name << " * ln(scale) + 1 = " << get << " at scale (" << scale
                       << "); it must be finite and > 0");
}

inline void check_yarn_params(const YarnParams& p) {
  APEX_CHECK(std::isfinite(p.scale) && p.scale >= 1.0,
             "[yarn] scale (" << p.scale << ") must be finite and >= 1");
  APEX_CHECK(p.original_context > 0,
             "[yarn] original_context (" << p.original_context << ") must be > 0");
  APEX_CHECK(std::isfinite(p.beta_slow) && p.beta_slow > 0.0,
             "[yarn] beta_slow (" << p.beta_slow << ") must be finite and > 0");
  APEX_CHECK(std::isfinite(p.beta_fast) && p.beta_fast > p.beta_slow,
             "[yarn] beta_fast (" << p.beta_fast << ") must be finite and greater than beta_slow ("
                                  << p.beta_slow << ")");
  APEX_CHECK(std::isfinite(p.base) && p.base > 1.0,
             "[yarn] base (" << p.base << ") must be finite and greater than 1");
  check_yarn_mscale(p.mscale, p.scale, "mscale");
  check_yarn_mscale(p.mscale_all_dim, p.scale, "mscale_all_dim");
  APEX_CHECK(!p.attention_factor || (std::isfinite(*p.attention_factor) && *p.attention_factor > 0),
             "[yarn] attention_factor (" << *p.attention_factor << ") must be finite and > 0");
}

inline void check_yarn_rotary_dim(Index rotary_dim) {
  APEX_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0,
             "[yarn] rotary_dim (" << rotary_dim << ") must be even and at least 2");
}

// Step 2: the (real-valued) pair index i at which θ_i·L = 2π·n.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, step 2 of the YaRN recipe
inline double yarn_correction_dim(double rotations, Index rotary_dim, const YarnParams& p) {
  const double d = static_cast<double>(rotary_dim);
  const double two_pi = 2.0 * 3.14159265358979323846;
  return d * std::log(static_cast<double>(p.original_context) / (two_pi * rotations)) /
         (2.0 * std::log(p.base));
}

}  // namespace detail

/// Steps 2–3: lo = max(floor(corr(β_fast)), 0), hi = min(ceil(corr(β_slow)), d − 1), without
/// floor/ceil when params.truncate is false, d = rotary_dim. If hi ≤ lo, hi = lo + 0.001 (the
/// reference code does this for hi = lo; hi < lo only happens when even the slowest pair turns
/// β_fast times over L, and then every pair is correctly left unscaled). The result is always
/// finite with lo < hi, for every accepted input: lo is also capped at d − 1 (corr(β_fast) can
/// be huge or +inf for a base near 1 or tiny betas; every pair index is < d − 1, so the ramp,
/// 0 for all pairs, is the same), and where 0.001 is below the spacing of doubles at lo, hi is
/// the next double above lo. O(1), no allocation.
inline YarnCorrectionRange yarn_correction_range(Index rotary_dim, const YarnParams& params) {
  detail::check_yarn_rotary_dim(rotary_dim);
  detail::check_yarn_params(params);
  double low = detail::yarn_correction_dim(params.beta_fast, rotary_dim, params);
  double high = detail::yarn_correction_dim(params.beta_slow, rotary_dim, params);
  if (params.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  const double last = static_cast<double>(rotary_dim - 1);
  low = std::min(std::max(low, 0.0), last);
  high = std::min(high, last);
  if (high <= low) {
    high = std::max(low + 0.001, std::nextafter(low, std::numeric_limits<double>::infinity()));
  }
  return {low, high};
}

/// Step 4: ramp_i = clamp((i − lo) / (hi − lo), 0, 1) for the d/2 pairs; 0 keeps θ_i, 1 uses
/// θ_i / s. Allocates the d/2-vector.
inline Vector<double> yarn_ramp(Index rotary_dim, const YarnParams& params) {
  const YarnCorrectionRange range = yarn_correction_range(rotary_dim, params);
  Vector<double> ramp(rotary_dim / 2);
  for (Index i = 0; i < ramp.size(); ++i) {
    const double r = (static_cast<double>(i) - range.low) / (range.high - range.low);
    ramp(i) = std::clamp(r, 0.0, 1.0);
  }
  return ramp;
}

/// Step 5: θ'_i = (θ_i / s)·ramp_i + θ_i·(1 − ramp_i), θ_i = b^(-2i/d), d = rotary_dim (for
/// partial rotary, the rotary and not the head dimension). Lies in [θ_i / s, θ_i] and does not
/// increase with i. With s = 1 it returns rope_frequencies(d, b) exactly. Allocates the result.
inline Vector<double> yarn_frequencies(Index rotary_dim, const YarnParams& params) {
  const Vector<double> ramp = yarn_ramp(rotary_dim, params);  // checks everything
  Vector<double> theta = rope_frequencies(rotary_dim, params.base);
  if (params.scale == 1.0) return theta;  // (θ·r + θ·(1 − r) need not round back to θ)
  for (Index i = 0; i < theta.size(); ++i) {
    theta(i) = (theta(i) / params.scale) * ramp(i) + theta(i) * (1.0 - ramp(i));
  }
  return theta;
}

/// The regime of each pair (§5.3), read off the ramp: 0 → high frequency (θ unchanged),
/// 1 → low frequency (θ/s), between → mid frequency (blend). Allocates the d/2 entries.
inline std::vector<YarnRegime> yarn_regimes(Index rotary_dim, const YarnParams& params) {
  const Vector<double> ramp = yarn_ramp(rotary_dim, params);
  std::vector<YarnRegime> regimes(static_cast<std::size_t>(ramp.size()));
  for (Index i = 0; i < ramp.size(); ++i) {
    regimes[static_cast<std::size_t>(i)] = ramp(i) <= 0.0   ? YarnRegime::kHighFrequency
                                           : ramp(i) >= 1.0 ? YarnRegime::kLowFrequency
                                                            : YarnRegime::kMidFrequency;
  }
  return regimes;
}

/// Step 6, the attention factor (§5.5) that YaRN's reference code multiplies into the tables:
/// params.attention_factor if set; else get(s, mscale) / get(s, mscale_all_dim) if either
/// DeepSeek parameter is set (unset mscale = 1, unset mscale_all_dim = 0); else
/// 0.1·ln(s) + 1 (1 for s = 1). s = 32 gives 1.346574 (§5.5 prints 1.347). Always finite and
/// > 0: parameters that would give anything else are rejected.
inline double yarn_attention_factor(const YarnParams& params) {
  detail::check_yarn_params(params);  // each set get(s, m) is finite and > 0
  if (params.attention_factor) return *params.attention_factor;
  if (params.mscale || params.mscale_all_dim) {
    const double numerator = yarn_mscale(params.scale, params.mscale.value_or(1.0));
    const double denominator = yarn_mscale(params.scale, params.mscale_all_dim.value_or(0.0));
    const double factor = numerator / denominator;
    // Two finite positive values can still overflow or underflow in the ratio.
    APEX_CHECK(std::isfinite(factor) && factor > 0.0,
               "[yarn] attention factor get(scale, mscale) / get(scale, mscale_all_dim) = "
                   << numerator << " / " << denominator << " = " << factor
                   << " must be finite and > 0");
    return factor;
  }
  return yarn_mscale(params.scale);
}

/// What multiplies every cos/sin entry of a YaRN table: the attention factor for kInTables,
/// 1 otherwise.
inline double yarn_table_magnitude(const YarnParams& params) {
  const double factor = yarn_attention_factor(params);  // checks params
  return params.temperature == YarnTemperature::kInTables ? factor : 1.0;
}

/// The number the caller multiplies the attention softmax scale (1/√d_qk, §6) by, so that the
/// temperature ends up where params.temperature says:
///   kInTables     w                 (the tables already carry the factor)
///   kSoftmaxScale factor² · w       (same attention as kInTables on fully rotated heads)
///   kLogits       factor · √w       (§5.5 read literally: logits × factor once)
///   kNone         1
/// where w = get(s, mscale_all_dim)² when mscale_all_dim is set (DeepSeek-V2/V3 scale the whole
/// logit by it: 1.8739 for V3's s = 40, mscale = mscale_all_dim = 1) and w = 1 otherwise.
/// Always finite and > 0: parameters that would give anything else are rejected.
inline double yarn_softmax_scale_multiplier(const YarnParams& params) {
  const double factor = yarn_attention_factor(params);  // checks params
  const double all_dim =
      params.mscale_all_dim ? yarn_mscale(params.scale, *params.mscale_all_dim) : 1.0;
  double multiplier = 1.0;
  switch (params.temperature) {
    case YarnTemperature::kInTables:
      multiplier = all_dim * all_dim;
      break;
    case YarnTemperature::kSoftmaxScale:
      multiplier = factor * factor * all_dim * all_dim;
      break;
    case YarnTemperature::kLogits:
      multiplier = factor * all_dim;
      break;
    case YarnTemperature::kNone:
      break;
  }
  // factor and all_dim are finite and > 0, but squaring them can overflow or underflow.
  APEX_CHECK(std::isfinite(multiplier) && multiplier > 0.0,
             "[yarn] softmax scale multiplier (" << multiplier << ") from attention factor ("
                                                 << factor << ") and get(scale, mscale_all_dim) ("
                                                 << all_dim << ") must be finite and > 0");
  return multiplier;
}

/// The YaRN RoPE table (§5 on top of §4.7): RopeTable::from_frequencies with θ' of step 5 and
/// magnitude yarn_table_magnitude(params). rotary_dim = 0 means head_dim (the whole head).
/// Shapes and memory as for RopeTable: 2 · max_positions · rotary_dim scalars. Every argument
/// (including the table size and the magnitude, which must lie in Scalar's normal range) is
/// checked before anything is allocated. θ' ∈ [0, 1], so every angle m·θ' is finite.
template <class Scalar>
RopeTable<Scalar> yarn_table(Index max_positions, Index head_dim, Index rotary_dim,
                             RopePairing pairing, const YarnParams& params) {
  detail::require_supported_scalar<Scalar>();
  detail::check_rope_max_positions(max_positions, "yarn");
  APEX_CHECK(rotary_dim != 0 || (head_dim >= 2 && head_dim % 2 == 0),
             "[yarn] head_dim (" << head_dim
                                 << ") must be even and at least 2 when rotary_dim is 0 (the "
                                    "whole head rotates)");
  const Index rd = rotary_dim == 0 ? head_dim : rotary_dim;
  detail::check_yarn_rotary_dim(rd);
  APEX_CHECK(rd <= head_dim,
             "[yarn] rotary_dim (" << rd << ") must not exceed head_dim (" << head_dim << ")");
  detail::check_rope_table_size<Scalar>(max_positions, rd, "yarn");
  const double magnitude = yarn_table_magnitude(params);  // checks params
  detail::check_rope_magnitude<Scalar>(magnitude, "yarn", "table magnitude (attention factor)");
  return RopeTable<Scalar>::from_frequencies(yarn_frequencies(rd, params), max_positions, head_dim,
                                             pairing, magnitude);
}

}  // namespace apex
