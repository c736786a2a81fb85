// SPDX-License-Identifier: MIT
// One layer's rotary embedding as data (LayerRope: base, pairing, rotated features, and YaRN or
// another scaling), and the entry point that reads it from the fields a HuggingFace config.json
// writes (RopeConfig), so that a checkpoint's `rope_scaling` / `rope_parameters` entry becomes
// the table apex rotates with:
//
//   config.json                              RopeConfig field
//   rope_theta                               rope_theta
//   head_dim (or hidden_size / heads)        head_dim (for MLA: qk_rope_head_dim)
//   partial_rotary_factor                    partial_rotary_factor
//   max_position_embeddings                  max_position_embeddings
//   rope_scaling.rope_type (or .type)        rope_type
//   rope_scaling.factor, ...                 factor, low_freq_factor, high_freq_factor,
//                                            original_max_position_embeddings, beta_fast,
//                                            beta_slow, mscale, mscale_all_dim,
//                                            attention_factor, truncate, short_factor,
//                                            long_factor, mrope_section, mrope_interleaved
//
// Phi-3 writes original_max_position_embeddings at the top level rather than in rope_scaling;
// it goes in the same field. What each type reads, and where apex departs from HuggingFace, is
// in the comment of rope_config_layer; docs/guide.md maps each type to llama.cpp and MLX too.
#pragma once

#include <apex/config.hpp>
#include <apex/mrope.hpp>
#include <apex/rope.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/yarn.hpp>

#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace apex {

/// The rotary position embedding of one kind of layer: RoPE's base, rotated features and pairing
/// (§4), and YaRN (§5) or another scaling (rope_scaling.hpp) when set; at most one of the two.
struct LayerRope {
  RopeParams rope;                 ///< base, rotated features and pairing
  std::optional<YarnParams> yarn;  ///< YaRN, or unset
  RopeScaling scaling;             ///< linear, dynamic NTK, Llama 3 or LongRoPE, or none
};

/// Throws unless `r` describes a table: yarn and scaling not both set, and YaRN's base equal to
/// RoPE's. `prefix` names the fields in messages (e.g. "global_rope."). O(1).
inline void check_layer_rope(const LayerRope& r, const char* op, const char* prefix) {
  APEX_CHECK(!r.yarn || std::holds_alternative<std::monostate>(r.scaling),
             "[" << op << "] " << prefix << "yarn and " << prefix
                 << "scaling are both set; a table has one scaling");
  if (!r.yarn) return;
  APEX_CHECK(r.yarn->base == r.rope.base, "[" << op << "] " << prefix << "yarn.base ("
                                              << r.yarn->base << ") must equal " << prefix
                                              << "rope.base (" << r.rope.base << ")");
}

/// The table of a layer's RoPE for positions [0, max_positions) on heads head_dim wide:
/// yarn_table when YaRN is set, else scaled_rope_table (plain RoPE without a scaling). Memory:
/// 2 · max_positions · rotary_dim scalars; everything is checked before it is allocated.
template <class Scalar>
RopeTable<Scalar> layer_rope_table(const LayerRope& r, Index max_positions, Index head_dim) {
  check_layer_rope(r, "rope", "");
  if (r.yarn) {
    return yarn_table<Scalar>(max_positions, head_dim, r.rope.rotary_dim, r.rope.pairing, *r.yarn);
  }
  return scaled_rope_table<Scalar>(max_positions, head_dim, r.rope, r.scaling);
}

/// What multiplies the layer's softmax scale (1/√d_qk): YaRN's multiplier
/// (yarn_softmax_scale_multiplier), 1 for every other kind (their factors are in the tables).
inline double layer_rope_softmax_multiplier(const LayerRope& r) {
  return r.yarn ? yarn_softmax_scale_multiplier(*r.yarn) : 1.0;
}

/// The RoPE fields of a HuggingFace config (see the top of this header). Unset optional fields
/// are fields the config does not have; a field the rope type does not read must stay unset
/// (or empty), so that a config apex would read differently from what it says is an error.
struct RopeConfig {
  /// "default", "linear", "dynamic", "yarn", "llama3" or "longrope"; "su" is read as
  /// "longrope" and "mrope" as "default" (older Phi-3 and Qwen2-VL configs).
  std::string rope_type = "default";
  double rope_theta = 10000.0;         ///< the base b
  Index head_dim = 0;                  ///< width of one head the table rotates (> 0)
  double partial_rotary_factor = 1.0;  ///< rotary_dim = int(head_dim · this), even, ≥ 2
  Index max_position_embeddings = 0;   ///< the config's context (0: absent)
  std::optional<double> factor;        ///< linear, dynamic, yarn, llama3, longrope: the factor f
  /// yarn, llama3, longrope (Phi-3 writes it at the top level), dynamic (must equal
  /// max_position_embeddings): the trained context L
  std::optional<Index> original_max_position_embeddings;
  std::optional<double> low_freq_factor;   ///< llama3
  std::optional<double> high_freq_factor;  ///< llama3
  std::optional<double> beta_fast;         ///< yarn (absent or 0: 32)
  std::optional<double> beta_slow;         ///< yarn (absent or 0: 1)
  std::optional<double> mscale;            ///< yarn (DeepSeek)
  std::optional<double> mscale_all_dim;    ///< yarn (DeepSeek)
  std::optional<double> attention_factor;  ///< yarn, longrope
  std::optional<bool> truncate;            ///< yarn (absent: true)
  std::vector<double> short_factor;        ///< longrope: rotary_dim / 2 entries
  std::vector<double> long_factor;         ///< longrope: rotary_dim / 2 entries
  std::vector<Index> mrope_section;        ///< multimodal RoPE: three section sizes, or empty
  bool mrope_interleaved = false;          ///< Qwen3-VL's interleaved sections
  /// Which features pair up. HuggingFace checkpoints rotate halves (its rotate_half); GPT-J
  /// style checkpoints and MLX's `traditional=True` rotate neighbours (kInterleaved).
  RopePairing pairing = RopePairing::kHalfSplit;
};

namespace detail {

// The name under which apex reads a rope type, or an error listing the ones it knows.
inline std::string canonical_rope_type(const std::string& type) {
  if (type == "su") return "longrope";
  if (type == "mrope") return "default";
  for (const char* known : {"default", "linear", "dynamic", "yarn", "llama3", "longrope"}) {
    if (type == known) return type;
  }
  APEX_CHECK(false, "[rope_config] rope_type (\""
                        << type
                        << "\") must be one of default, linear, dynamic, yarn, llama3, longrope "
                           "(or su, mrope)");
  return type;
}

// Every field the type does not read must be unset: a config that says more than apex reads.
inline void check_unused_rope_fields(const RopeConfig& c, const std::string& type,
                                     const std::vector<std::string>& reads) {
  const auto reads_field = [&](const char* name) {
    for (const std::string& r : reads) {
      if (r == name) return true;
    }
    return false;
  };
  const auto check = [&](bool present, const char* name) {
    APEX_CHECK(!present || reads_field(name), "[rope_config] "
                                                  << name << " is set, but rope_type \"" << type
                                                  << "\" does not use it");
  };
  check(c.factor.has_value(), "factor");
  check(c.original_max_position_embeddings.has_value(), "original_max_position_embeddings");
  check(c.low_freq_factor.has_value(), "low_freq_factor");
  check(c.high_freq_factor.has_value(), "high_freq_factor");
  check(c.beta_fast.has_value(), "beta_fast");
  check(c.beta_slow.has_value(), "beta_slow");
  check(c.mscale.has_value(), "mscale");
  check(c.mscale_all_dim.has_value(), "mscale_all_dim");
  check(c.attention_factor.has_value(), "attention_factor");
  check(c.truncate.has_value(), "truncate");
  check(!c.short_factor.empty(), "short_factor");
  check(!c.long_factor.empty(), "long_factor");
}

template <class T>
T required_rope_field(const std::optional<T>& value, const char* name, const std::string& type) {
  APEX_CHECK(value.has_value(),
             "[rope_config] " << name << " is required for rope_type \"" << type << "\"");
  return *value;
}

// YaRN and LongRoPE: with original_max_position_embeddings set, HuggingFace scales by
// max_position_embeddings / original_max_position_embeddings and ignores `factor`; apex takes
// the same ratio and rejects a factor that disagrees with it (vLLM and llama.cpp read the
// factor, so such a config means different models to different readers).
inline double context_scale(const RopeConfig& c, const std::string& type) {
  if (!c.original_max_position_embeddings) return required_rope_field(c.factor, "factor", type);
  const Index original = *c.original_max_position_embeddings;
  APEX_CHECK(original > 0,
             "[rope_config] original_max_position_embeddings (" << original << ") must be > 0");
  APEX_CHECK(c.max_position_embeddings > 0, "[rope_config] max_position_embeddings ("
                                                << c.max_position_embeddings
                                                << ") must be > 0 when "
                                                   "original_max_position_embeddings is "
                                                   "set (rope_type \""
                                                << type << "\")");
  const double ratio =
      static_cast<double>(c.max_position_embeddings) / static_cast<double>(original);
  // Configs print the factor with a few digits (33.333 for 100000 / 3000): agreement to 1e-6
  // relative is agreement.
  APEX_CHECK(!c.factor || std::abs(*c.factor - ratio) <= 1e-6 * ratio,
             "[rope_config] factor (" << c.factor.value_or(0.0)
                                      << ") is inconsistent with max_position_embeddings / "
                                         "original_max_position_embeddings ("
                                      << c.max_position_embeddings << " / " << original << " = "
                                      << ratio << "), which HuggingFace uses instead");
  return ratio;
}

inline Index original_context(const RopeConfig& c, const std::string& type) {
  const Index original = c.original_max_position_embeddings.value_or(c.max_position_embeddings);
  APEX_CHECK(original > 0,
             "[rope_config] original_max_position_embeddings or "
             "max_position_embeddings must be > 0 for rope_type \""
                 << type << "\" (got " << original << ")");
  return original;
}

// A beta of 0 counts as unset, as HuggingFace's `or 32` reads it.
inline double beta_or(const std::optional<double>& beta, double fallback) {
  return beta && *beta != 0.0 ? *beta : fallback;
}

inline YarnParams yarn_from_config(const RopeConfig& c) {
  YarnParams y;
  y.base = c.rope_theta;
  y.scale = context_scale(c, "yarn");
  y.original_context = original_context(c, "yarn");
  y.beta_fast = beta_or(c.beta_fast, 32.0);
  y.beta_slow = beta_or(c.beta_slow, 1.0);
  y.truncate = c.truncate.value_or(true);
  // HuggingFace's attention factor: the given one, else DeepSeek's ratio when both mscale and
  // mscale_all_dim are non-zero, else 0.1·ln(s) + 1.
  if (c.attention_factor) {
    y.attention_factor = *c.attention_factor;
  } else if (c.mscale.value_or(0.0) != 0.0 && c.mscale_all_dim.value_or(0.0) != 0.0) {
    y.attention_factor = yarn_mscale(y.scale, *c.mscale) / yarn_mscale(y.scale, *c.mscale_all_dim);
  } else {
    y.attention_factor = yarn_mscale(y.scale);
  }
  // DeepSeek-V2/V3 also scale the whole logit by get(s, mscale_all_dim)² when it is non-zero.
  if (c.mscale_all_dim.value_or(0.0) != 0.0) y.mscale_all_dim = c.mscale_all_dim;
  return y;
}

inline LongRope longrope_from_config(const RopeConfig& c) {
  LongRope p;
  p.short_factor = c.short_factor;
  p.long_factor = c.long_factor;
  p.scale = context_scale(c, "longrope");
  p.original_context = original_context(c, "longrope");
  p.attention_factor = c.attention_factor;
  return p;
}

inline DynamicNtkRope dynamic_from_config(const RopeConfig& c) {
  APEX_CHECK(c.max_position_embeddings > 0, "[rope_config] max_position_embeddings ("
                                                << c.max_position_embeddings
                                                << ") must be > 0 for rope_type "
                                                   "\"dynamic\"");
  APEX_CHECK(!c.original_max_position_embeddings ||
                 *c.original_max_position_embeddings == c.max_position_embeddings,
             "[rope_config] original_max_position_embeddings ("
                 << c.original_max_position_embeddings.value_or(0)
                 << ") must be unset or equal max_position_embeddings ("
                 << c.max_position_embeddings
                 << ") for rope_type \"dynamic\": HuggingFace scales from the latter");
  return {required_rope_field(c.factor, "factor", "dynamic"), c.max_position_embeddings, 0};
}

inline Llama3Rope llama3_from_config(const RopeConfig& c) {
  const std::string type = "llama3";
  return {required_rope_field(c.factor, "factor", type),
          required_rope_field(c.low_freq_factor, "low_freq_factor", type),
          required_rope_field(c.high_freq_factor, "high_freq_factor", type),
          required_rope_field(c.original_max_position_embeddings,
                              "original_max_position_embeddings", type)};
}

}  // namespace detail

/// The rotated features of a config: int(head_dim · partial_rotary_factor), as HuggingFace
/// truncates it; it must be even and at least 2.
inline Index rope_config_rotary_dim(const RopeConfig& c) {
  APEX_CHECK(c.head_dim > 0, "[rope_config] head_dim (" << c.head_dim << ") must be > 0");
  APEX_CHECK(
      std::isfinite(c.partial_rotary_factor) && c.partial_rotary_factor > 0.0 &&
          c.partial_rotary_factor <= 1.0,
      "[rope_config] partial_rotary_factor (" << c.partial_rotary_factor << ") must lie in (0, 1]");
  const auto rotary_dim =
      static_cast<Index>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  APEX_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0,
             "[rope_config] int(head_dim * partial_rotary_factor) = int("
                 << c.head_dim << " * " << c.partial_rotary_factor << ") = " << rotary_dim
                 << " must be even and at least 2");
  return rotary_dim;
}

/// A config's RoPE as a LayerRope, read as HuggingFace's `modeling_rope_utils.py` reads it:
///   default   rope_theta only (mrope_section may be set: see mrope_config_sections)
///   linear    factor
///   dynamic   factor; the original context is max_position_embeddings, and the base is fixed
///             for the length of the table (rope_scaling.hpp says why)
///   yarn      factor or max_position_embeddings / original_max_position_embeddings, original
///             context (original_max_position_embeddings, else max_position_embeddings),
///             beta_fast, beta_slow, truncate, and the attention factor: attention_factor, else
///             get(s, mscale) / get(s, mscale_all_dim) when both are non-zero, else
///             0.1·ln(s) + 1, in the tables; mscale_all_dim, when non-zero, also multiplies the
///             softmax scale by get(s, mscale_all_dim)² as DeepSeek's models do
///   llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
///   longrope  short_factor, long_factor, factor or the ratio as for yarn, attention_factor; the
///             table's length picks the list (rope_scaling.hpp)
/// Any field the type does not read must be unset; a factor that disagrees with the ratio of
/// the two context fields is an error (HuggingFace takes the ratio, vLLM the factor). O(fields).
inline LayerRope rope_config_layer(const RopeConfig& c) {
  const std::string type = detail::canonical_rope_type(c.rope_type);
  LayerRope r;
  r.rope.base = c.rope_theta;
  r.rope.rotary_dim = rope_config_rotary_dim(c);
  r.rope.pairing = c.pairing;
  detail::check_rope_base(c.rope_theta);
  if (type == "default") {
    detail::check_unused_rope_fields(c, type, {});
  } else if (type == "linear") {
    detail::check_unused_rope_fields(c, type, {"factor"});
    r.scaling = LinearRope{detail::required_rope_field(c.factor, "factor", type)};
  } else if (type == "dynamic") {
    detail::check_unused_rope_fields(c, type, {"factor", "original_max_position_embeddings"});
    r.scaling = detail::dynamic_from_config(c);
  } else if (type == "yarn") {
    detail::check_unused_rope_fields(
        c, type,
        {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
         "mscale_all_dim", "attention_factor", "truncate"});
    r.yarn = detail::yarn_from_config(c);
  } else if (type == "llama3") {
    detail::check_unused_rope_fields(
        c, type,
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    r.scaling = detail::llama3_from_config(c);
  } else {
    detail::check_unused_rope_fields(c, type,
                                     {"factor", "original_max_position_embeddings",
                                      "attention_factor", "short_factor", "long_factor"});
    r.scaling = detail::longrope_from_config(c);
  }
  return r;
}

/// The multimodal sections of a config (mrope_section and mrope_interleaved), or none when
/// mrope_section is empty. Checked against the rotary dimension: three sizes summing to its
/// pairs.
inline std::optional<MropeSections> mrope_config_sections(const RopeConfig& c) {
  if (c.mrope_section.empty()) return std::nullopt;
  APEX_CHECK(c.mrope_section.size() == 3, "[rope_config] mrope_section has "
                                              << c.mrope_section.size()
                                              << " entries; expected 3 (temporal, height, "
                                                 "width)");
  MropeSections s;
  for (std::size_t i = 0; i < 3; ++i) s.sections[i] = c.mrope_section[i];
  s.layout = c.mrope_interleaved ? MropeLayout::kInterleaved : MropeLayout::kSections;
  check_mrope_sections(s, rope_config_rotary_dim(c));
  return s;
}

/// The RoPE table a config declares, for positions [0, max_positions) on heads head_dim wide:
/// layer_rope_table(rope_config_layer(c), max_positions, c.head_dim). Every field is checked
/// (see rope_config_layer) before the table is allocated.
template <class Scalar>
RopeTable<Scalar> rope_config_table(const RopeConfig& c, Index max_positions) {
  (void)mrope_config_sections(c);  // checks the sections against the rotary dimension
  return layer_rope_table<Scalar>(rope_config_layer(c), max_positions, c.head_dim);
}

/// What the config's attention multiplies its softmax scale by (layer_rope_softmax_multiplier):
/// get(s, mscale_all_dim)² for a YaRN config with a non-zero mscale_all_dim, else 1.
inline double rope_config_softmax_multiplier(const RopeConfig& c) {
  return layer_rope_softmax_multiplier(rope_config_layer(c));
}

}  // namespace apex
