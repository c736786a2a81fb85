// SPDX-License-Identifier: MIT
// The RoPE scalings checkpoints declare beside YaRN (yarn.hpp): linear (position interpolation),
// dynamic NTK, Llama 3 and LongRoPE. Each is a new set of frequencies θ'_i (and, for LongRoPE,
// an attention factor that multiplies the cos/sin tables), built into an ordinary RopeTable
// (rope.hpp) that apply_rope, the layers, the caches and the stack use unchanged.
//
// With θ_i = b^(-2i/d), d the rotary dimension, i = 0 … d/2 − 1, every formula in double:
//
//   linear    θ'_i = θ_i / f                           (positions m/f: m·θ/f = (m/f)·θ)
//   dynamic   θ'_i = b'^(-2i/d),  b' = b · (f·n/L − (f − 1))^(d/(d−2)),  n = max(length, L)
//   llama3    λ_i = 2π/θ_i,  L_lo = L/low_freq_factor,  L_hi = L/high_freq_factor
//               λ_i < L_hi  (high frequency)   θ'_i = θ_i
//               λ_i > L_lo  (low frequency)    θ'_i = θ_i / f
//               otherwise   (between)          θ'_i = (1 − w)·θ_i/f + w·θ_i,
//                                              w = (L/λ_i − low_freq_factor)
//                                                  / (high_freq_factor − low_freq_factor)
//   longrope  θ'_i = θ_i / e_i,  e = long_factor if the table reaches past L, else short_factor;
//             cos/sin × a, a = attention_factor or √(1 + ln s / ln L) for s > 1 (1 otherwise)
//
// (f the factor, L the original context, s the context scale.) These are HuggingFace's
// definitions (`transformers/modeling_rope_utils.py`: `_compute_linear_scaling_rope_parameters`,
// `_compute_dynamic_ntk_parameters`, `_compute_llama3_parameters`, `_compute_longrope_parameters`),
// which form θ in float32; apex forms everything in double and rounds only the table entries.
//
// Length-dependent kinds. Dynamic NTK and LongRoPE choose their frequencies from a sequence
// length. HuggingFace re-derives them from the current length at every call, so a cached key
// keeps the rotation of the length it was appended at while later ones get another: its
// decoding and its forward pass over the same tokens disagree past L. apex fixes the frequencies
// once, for the length the table is built for (its max_positions unless stated), so every
// position of a sequence is rotated with the same θ' and decoding equals the forward pass. To
// reproduce HuggingFace's forward pass over n tokens, build the table for length n.
#pragma once

#include <apex/config.hpp>
#include <apex/rope.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <variant>
#include <vector>

namespace apex {

/// Linear scaling (position interpolation): θ'_i = θ_i / factor. HF `"rope_type": "linear"`.
struct LinearRope {
  double factor = 1.0;  ///< f ≥ 1: the context the table stretches to is f times the trained one
};

/// Dynamic NTK scaling: the base grows with the length the table serves (see the top of this
/// header). HF `"rope_type": "dynamic"`; HF's original context is `max_position_embeddings`.
struct DynamicNtkRope {
  double factor = 1.0;         ///< f ≥ 1
  Index original_context = 0;  ///< L, the trained context (> 0)
  /// n, the sequence length the frequencies are made for; 0 (the default) means the table's
  /// max_positions. Lengths up to L give plain RoPE.
  Index length = 0;
};

/// Llama 3.1's scaling: long wavelengths divided by the factor, short ones kept, a smooth blend
/// between. HF `"rope_type": "llama3"` (Llama 3.1–3.3: factor 8, 1, 4, 8192; Llama 3.2: 32, ...).
struct Llama3Rope {
  double factor = 8.0;            ///< f ≥ 1
  double low_freq_factor = 1.0;   ///< > 0; wavelengths above L / low_freq_factor get θ/f
  double high_freq_factor = 4.0;  ///< > low_freq_factor; wavelengths below L / it keep θ
  Index original_context = 0;     ///< L, `original_max_position_embeddings` (> 0)
};

/// Which LongRoPE factor list a table uses.
enum class LongRopeFactors {
  kByLength,  ///< long_factor when the table's length exceeds original_context, else short
  kShort,     ///< short_factor always
  kLong,      ///< long_factor always
};

/// LongRoPE (Phi-3, Phi-3.5, Phi-4-mini; HF `"rope_type": "longrope"`, formerly `"su"`):
/// per-pair rescale factors and an attention factor multiplied into the tables.
struct LongRope {
  std::vector<double> short_factor;  ///< d/2 factors e_i > 0 for contexts up to L
  std::vector<double> long_factor;   ///< d/2 factors e_i > 0 for contexts past L
  Index original_context = 0;        ///< L, `original_max_position_embeddings` (> 0)
  /// s, the context scale in the default attention factor: HF takes max_position_embeddings / L
  /// when the config has original_max_position_embeddings, else rope_scaling's `factor`.
  double scale = 1.0;
  /// The factor that multiplies every cos/sin entry; unset: √(1 + ln s / ln L) for s > 1, else 1.
  std::optional<double> attention_factor;
  LongRopeFactors factors = LongRopeFactors::kByLength;  ///< which list the table uses
};

/// A RoPE scaling other than YaRN (yarn.hpp), or none (std::monostate: plain RoPE).
using RopeScaling = std::variant<std::monostate, LinearRope, DynamicNtkRope, Llama3Rope, LongRope>;

namespace detail {

inline void check_rope_factor(double factor, const char* op) {
  APEX_CHECK(std::isfinite(factor) && factor >= 1.0,
             "[" << op << "] factor (" << factor << ") must be finite and >= 1");
}

inline void check_original_context(Index original_context, const char* op) {
  APEX_CHECK(original_context > 0,
             "[" << op << "] original_context (" << original_context << ") must be > 0");
}

inline void check_rope_scaling(const LinearRope& p) { check_rope_factor(p.factor, "rope linear"); }

inline void check_rope_scaling(const DynamicNtkRope& p) {
  check_rope_factor(p.factor, "rope dynamic");
  check_original_context(p.original_context, "rope dynamic");
  APEX_CHECK(p.length >= 0,
             "[rope dynamic] length (" << p.length << ") must be >= 0 (0: the table's)");
}

inline void check_rope_scaling(const Llama3Rope& p) {
  check_rope_factor(p.factor, "rope llama3");
  check_original_context(p.original_context, "rope llama3");
  APEX_CHECK(std::isfinite(p.low_freq_factor) && p.low_freq_factor > 0.0,
             "[rope llama3] low_freq_factor (" << p.low_freq_factor << ") must be finite and > 0");
  APEX_CHECK(std::isfinite(p.high_freq_factor) && p.high_freq_factor > p.low_freq_factor,
             "[rope llama3] high_freq_factor (" << p.high_freq_factor
                                                << ") must be finite and greater than "
                                                   "low_freq_factor ("
                                                << p.low_freq_factor << ")");
}

inline void check_longrope_list(const std::vector<double>& factors, Index pairs, const char* name) {
  APEX_CHECK(static_cast<Index>(factors.size()) == pairs,
             "[rope longrope] " << name << " has " << factors.size()
                                << " entries; expected rotary_dim / 2 = " << pairs);
  for (std::size_t i = 0; i < factors.size(); ++i) {
    APEX_CHECK(std::isfinite(factors[i]) && factors[i] > 0.0,
               "[rope longrope] " << name << "[" << i << "] (" << factors[i]
                                  << ") must be finite and > 0");
  }
}

inline void check_rope_scaling(const LongRope& p) {
  check_original_context(p.original_context, "rope longrope");
  APEX_CHECK(std::isfinite(p.scale) && p.scale > 0.0,
             "[rope longrope] scale (" << p.scale << ") must be finite and > 0");
  APEX_CHECK(!p.attention_factor || (std::isfinite(*p.attention_factor) && *p.attention_factor > 0),
             "[rope longrope] attention_factor (" << p.attention_factor.value_or(0.0)
                                                  << ") must be finite and > 0");
}

// θ_i / divisor_i for a divisor per pair, in double.
template <class DivisorOf>
Vector<double> divided_frequencies(Index rotary_dim, double base, DivisorOf divisor) {
  Vector<double> theta = rope_frequencies(rotary_dim, base);
  for (Index i = 0; i < theta.size(); ++i) theta(i) /= divisor(i);
  return theta;
}

}  // namespace detail

/// Linear scaling: θ'_i = θ_i / factor, θ_i = base^(-2i/d_r). Allocates the d_r/2 entries.
inline Vector<double> linear_rope_frequencies(Index rotary_dim, double base, const LinearRope& p) {
  detail::check_rope_scaling(p);
  return detail::divided_frequencies(rotary_dim, base, [&](Index) { return p.factor; });
}

/// Dynamic NTK's base for a table of `length` positions (p.length overrides it when set):
/// b' = b · (f·n/L − (f − 1))^(d/(d−2)), n = max(length, L); b' = b for n = L. d_r ≥ 4 (the
/// exponent needs d_r > 2). O(1).
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (rotary_dim, base) as rope_frequencies
inline double dynamic_ntk_base(Index rotary_dim, double base, const DynamicNtkRope& p,
                               Index length) {
  detail::check_rope_scaling(p);
  detail::check_rope_rotary_dim(rotary_dim);
  detail::check_rope_base(base);
  APEX_CHECK(rotary_dim >= 4, "[rope dynamic] rotary_dim (" << rotary_dim
                                                            << ") must be at least 4 (the base's "
                                                               "exponent is d / (d - 2))");
  const Index used = p.length > 0 ? p.length : length;
  const double n = static_cast<double>(std::max(used, p.original_context));
  const double ratio = p.factor * n / static_cast<double>(p.original_context) - (p.factor - 1.0);
  const double d = static_cast<double>(rotary_dim);
  const double scaled = base * std::pow(ratio, d / (d - 2.0));
  APEX_CHECK(std::isfinite(scaled), "[rope dynamic] the scaled base ("
                                        << scaled << ") for length " << n
                                        << " must be finite; the length is too large");
  return scaled;
}

/// Dynamic NTK frequencies for a table of `length` positions: θ'_i = b'^(-2i/d_r) with
/// dynamic_ntk_base. Allocates the d_r/2 entries.
inline Vector<double> dynamic_ntk_frequencies(Index rotary_dim, double base,
                                              const DynamicNtkRope& p, Index length) {
  return rope_frequencies(rotary_dim, dynamic_ntk_base(rotary_dim, base, p, length));
}

/// Llama 3's frequencies (see the top of this header): each pair's wavelength λ_i = 2π/θ_i
/// decides whether θ_i is kept, divided by the factor, or blended. Allocates the d_r/2 entries.
inline Vector<double> llama3_frequencies(Index rotary_dim, double base, const Llama3Rope& p) {
  detail::check_rope_scaling(p);
  const double two_pi = 2.0 * 3.14159265358979323846;
  const double context = static_cast<double>(p.original_context);
  const double low_wavelength = context / p.low_freq_factor;
  const double high_wavelength = context / p.high_freq_factor;
  Vector<double> theta = rope_frequencies(rotary_dim, base);
  for (Index i = 0; i < theta.size(); ++i) {
    const double wavelength = two_pi / theta(i);
    if (wavelength < high_wavelength) continue;  // high frequency: kept
    if (wavelength > low_wavelength) {
      theta(i) /= p.factor;  // low frequency: interpolated
      continue;
    }
    const double w =
        (context / wavelength - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
    theta(i) = (1.0 - w) * theta(i) / p.factor + w * theta(i);
  }
  return theta;
}

/// Whether a LongRoPE table of `length` positions uses long_factor.
inline bool longrope_uses_long(const LongRope& p, Index length) {
  switch (p.factors) {
    case LongRopeFactors::kShort:
      return false;
    case LongRopeFactors::kLong:
      return true;
    case LongRopeFactors::kByLength:
      break;
  }
  return length > p.original_context;
}

/// LongRoPE's frequencies for a table of `length` positions: θ'_i = θ_i / e_i with e the list
/// longrope_uses_long picks (both lists must have d_r/2 finite entries > 0). Allocates the d_r/2
/// entries.
inline Vector<double> longrope_frequencies(Index rotary_dim, double base, const LongRope& p,
                                           Index length) {
  detail::check_rope_scaling(p);
  detail::check_rope_rotary_dim(rotary_dim);
  // Both lists, whichever this table reads: a wrong one is a wrong configuration.
  detail::check_longrope_list(p.short_factor, rotary_dim / 2, "short_factor");
  detail::check_longrope_list(p.long_factor, rotary_dim / 2, "long_factor");
  const std::vector<double>& e = longrope_uses_long(p, length) ? p.long_factor : p.short_factor;
  return detail::divided_frequencies(rotary_dim, base,
                                     [&](Index i) { return e[static_cast<std::size_t>(i)]; });
}

/// LongRoPE's attention factor, multiplied into every cos/sin entry: p.attention_factor if set,
/// else √(1 + ln s / ln L) for s > 1 and 1 otherwise (L = original_context; for L = 1, where
/// ln L = 0, the factor is 1). O(1).
inline double longrope_attention_factor(const LongRope& p) {
  detail::check_rope_scaling(p);
  if (p.attention_factor) return *p.attention_factor;
  if (p.scale <= 1.0 || p.original_context == 1) return 1.0;
  return std::sqrt(1.0 + std::log(p.scale) / std::log(static_cast<double>(p.original_context)));
}

/// The frequencies θ' of a scaling for a table of `length` positions (plain RoPE's for
/// std::monostate). Allocates the d_r/2 entries.
inline Vector<double> scaled_rope_frequencies(Index rotary_dim, double base,
                                              const RopeScaling& scaling, Index length) {
  struct Visit {
    Index rotary_dim;
    double base;
    Index length;
    Vector<double> operator()(std::monostate) const { return rope_frequencies(rotary_dim, base); }
    Vector<double> operator()(const LinearRope& p) const {
      return linear_rope_frequencies(rotary_dim, base, p);
    }
    Vector<double> operator()(const DynamicNtkRope& p) const {
      return dynamic_ntk_frequencies(rotary_dim, base, p, length);
    }
    Vector<double> operator()(const Llama3Rope& p) const {
      return llama3_frequencies(rotary_dim, base, p);
    }
    Vector<double> operator()(const LongRope& p) const {
      return longrope_frequencies(rotary_dim, base, p, length);
    }
  };
  return std::visit(Visit{rotary_dim, base, length}, scaling);
}

/// What multiplies every cos/sin entry of a scaled table: LongRoPE's attention factor, else 1.
inline double scaled_rope_magnitude(const RopeScaling& scaling) {
  const auto* longrope = std::get_if<LongRope>(&scaling);
  return longrope != nullptr ? longrope_attention_factor(*longrope) : 1.0;
}

/// A RoPE table with a scaling: RopeTable::from_frequencies with scaled_rope_frequencies for
/// max_positions positions and magnitude scaled_rope_magnitude. params gives the base, the
/// rotated features (rotary_dim 0: all of head_dim) and the pairing. Shapes and memory as for
/// RopeTable: 2 · max_positions · rotary_dim scalars; everything is checked before the table is
/// allocated.
template <class Scalar>
RopeTable<Scalar> scaled_rope_table(Index max_positions, Index head_dim, const RopeParams& params,
                                    const RopeScaling& scaling) {
  detail::require_supported_scalar<Scalar>();
  const Index rotary_dim =
      detail::checked_rotary_dim<Scalar>(max_positions, head_dim, params.rotary_dim);
  const Vector<double> theta =
      scaled_rope_frequencies(rotary_dim, params.base, scaling, max_positions);
  const double magnitude = scaled_rope_magnitude(scaling);
  detail::check_rope_magnitude<Scalar>(magnitude, "rope", "table magnitude (attention factor)");
  return RopeTable<Scalar>::from_frequencies(theta, max_positions, head_dim, params.pairing,
                                             magnitude);
}

}  // namespace apex
