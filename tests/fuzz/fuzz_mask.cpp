// SPDX-License-Identifier: MIT
// Fuzz target: the mask builders of §10–§11 against the rules as the documents state them, and
// classify_block (which lets the attention kernels skip or trust whole blocks) against the
// per-pair rule.
//   - layer_mask / build_mask(layer, S, params) for random S, P, W, F_g and layer: accepted
//     exactly when the documented preconditions hold, and then every entry equals
//       (i < P and j < P) or (global layer: j <= i) or (local layer: 0 <= i - j < W),
//     global iff layer mod F_g == F_g - 1 (§11.1–§11.2);
//   - build_mask(PositionMask, S_q, S_k) with random offsets: row i is absolute position
//     first_query + i (bottom-right unless query_offset is set), column j is key_offset + j;
//   - render_mask draws one glyph per entry;
//   - classify_block on random rectangles of absolute positions (also far from 0): kAll must
//     mean every pair is allowed and kNone that none is.
// Sizes passed to the builders are capped at 96 (the dense results are S_q × S_k); the rule
// parameters are drawn from the whole Index range.
#include <apex/mask.hpp>

#include "fuzz_common.hpp"

#include <optional>
#include <string>

namespace apex::fuzz {
namespace {

constexpr Index kMaxSide = 96;

/// A rule parameter: small and meaningful most of the time, anything otherwise.
Index parameter(Input& in, Index small_hi) {
  return in.flag() ? in.in(-1, small_hi) : in.any_index();
}

/// §11 as the document writes it, for positions i (query) and j (key) of one sequence.
bool document_rule(Index i, Index j, Index prefix, Index window, bool global) {
  if (i < prefix && j < prefix) return true;
  if (global) return j <= i;
  return 0 <= i - j && i - j < window;
}

void layer_masks(Input& in) {
  LayerMaskParams params;
  params.prefix = parameter(in, 12);
  params.window = parameter(in, 12);
  params.global_every = in.flag() ? in.in(1, 8) : in.any_index();
  const Index layer = parameter(in, 20);
  const Index s = in.in(0, kMaxSide);

  const bool base_ok =
      params.prefix >= 0 && params.window >= 0 && layer >= 0 && params.global_every >= 1;
  const bool global = base_ok && layer % params.global_every == params.global_every - 1;
  const bool rule_ok = base_ok && (global || params.window >= 1);

  PositionMask rule;
  const bool made = attempt("layer_mask", !rule_ok, [&] { rule = layer_mask(layer, params); });
  APEX_FUZZ_REQUIRE(made == rule_ok, "layer_mask rejected valid parameters");
  if (made) {
    APEX_FUZZ_REQUIRE(rule.causal && rule.prefix == params.prefix, "layer_mask: causal, prefix");
    APEX_FUZZ_REQUIRE(global ? !rule.window : (rule.window && *rule.window == params.window),
                      "layer_mask: a global layer has no window, a local one has W");
    bool is_global = false;
    attempt("is_global_layer", [&] { is_global = is_global_layer(layer, params.global_every); });
    APEX_FUZZ_REQUIRE(is_global == global, "is_global_layer disagrees with l mod F_g = F_g - 1");
  }

  const bool dense_ok = rule_ok && params.prefix <= s;
  BoolMatrix mask;
  const bool built =
      attempt("build_mask(layer, S)", !dense_ok, [&] { mask = build_mask(layer, s, params); });
  APEX_FUZZ_REQUIRE(built == dense_ok, "build_mask(layer, S) rejected valid parameters");
  if (!built) return;
  APEX_FUZZ_REQUIRE(mask.rows() == s && mask.cols() == s, "build_mask(layer, S) shape");
  Index allowed = 0;
  for (Index i = 0; i < s; ++i) {
    for (Index j = 0; j < s; ++j) {
      APEX_FUZZ_REQUIRE(mask(i, j) == document_rule(i, j, params.prefix, params.window, global),
                        "build_mask(layer, S) differs from the rule of §11 at (" +
                            std::to_string(i) + ", " + std::to_string(j) + ")");
      allowed += mask(i, j) ? 1 : 0;
    }
  }
  // render_mask: a header and one line per row, one glyph per entry.
  const std::string text = render_mask(mask);
  Index lines = 0, full = 0, dots = 0;
  for (std::size_t at = 0; at < text.size(); ++at) {
    if (text[at] == '\n') ++lines;
    if (text.compare(at, 3, "\xE2\x96\x88") == 0) ++full;
    if (text.compare(at, 2, "\xC2\xB7") == 0) ++dots;
  }
  APEX_FUZZ_REQUIRE(lines == s + 1 && full == allowed && dots == s * s - allowed,
                    "render_mask does not draw one glyph per entry");
}

/// A rule with a small window as often as one from the whole range.
PositionMask random_rule(Input& in) {
  return any_position_mask(in, /*max_prefix=*/20, /*max_offset=*/40, /*max_window=*/20);
}

/// The rule of PositionMask restated: prefix pairs, then causality and the window.
bool restated_rule(const PositionMask& m, Index qp, Index kp) {
  const bool in_prefix = qp >= 0 && qp < m.prefix && kp >= 0 && kp < m.prefix;
  if (in_prefix || !m.causal) return true;
  if (kp > qp) return false;
  // qp - kp >= 0 here; compare without forming a difference that could overflow.
  return !m.window || static_cast<__int128>(qp) - kp < *m.window;
}

void position_masks(Input& in) {
  const PositionMask m = random_rule(in);
  const Index s_q = in.in(0, 24);
  const Index s_k = in.in(0, 24);
  const bool valid = position_mask_valid(m, s_q, s_k);
  BoolMatrix mask;
  const bool built =
      attempt("build_mask(mask, S_q, S_k)", !valid, [&] { mask = build_mask(m, s_q, s_k); });
  APEX_FUZZ_REQUIRE(built == valid, "build_mask(mask, S_q, S_k) rejected a valid rule");
  if (!built) return;
  const Index first = m.query_offset ? *m.query_offset : m.key_offset + s_k - s_q;
  for (Index i = 0; i < s_q; ++i) {
    for (Index j = 0; j < s_k; ++j) {
      APEX_FUZZ_REQUIRE(mask(i, j) == restated_rule(m, first + i, m.key_offset + j),
                        "build_mask(mask, S_q, S_k) misaligns or misapplies the rule");
    }
  }
}

void block_classification(Input& in) {
  PositionMask m = random_rule(in);
  if (m.window && *m.window < 1) m.window = 1;  // classify_block takes checked rules
  if (!m.causal) m.window.reset();
  if (m.prefix < 0) m.prefix = 0;
  // Absolute positions: queries may start before 0 (bottom-right alignment with S_q > S_k),
  // keys start at key_offset >= 0. Far from 0 as well as near it.
  constexpr Index kFar = Index{1} << 61;
  const Index q_begin = in.flag() ? in.in(-8, 48) : in.in(-kFar, kFar);
  const Index k_begin = in.flag() ? in.in(0, 48) : in.in(0, kFar);
  const Index q_len = in.in(1, 20);
  const Index k_len = in.in(1, 20);
  BlockCoverage coverage = BlockCoverage::kPartial;
  attempt("classify_block", [&] {
    coverage = classify_block(m, q_begin, q_begin + q_len, k_begin, k_begin + k_len);
  });
  if (coverage == BlockCoverage::kPartial) return;
  for (Index i = 0; i < q_len; ++i) {
    for (Index j = 0; j < k_len; ++j) {
      const bool allowed = restated_rule(m, q_begin + i, k_begin + j);
      APEX_FUZZ_REQUIRE(allowed == m.allows(q_begin + i, k_begin + j),
                        "PositionMask::allows differs from its documented rule");
      APEX_FUZZ_REQUIRE(coverage == BlockCoverage::kAll ? allowed : !allowed,
                        coverage == BlockCoverage::kAll
                            ? "classify_block said kAll for a block with a forbidden pair"
                            : "classify_block said kNone for a block with an allowed pair");
    }
  }
}

void window_masks(Input& in) {
  const Index w = parameter(in, 12);
  PositionMask m;
  const bool made = attempt("sliding_window_mask", w < 1, [&] { m = sliding_window_mask(w); });
  APEX_FUZZ_REQUIRE(made == (w >= 1), "sliding_window_mask rejected a valid window");
  if (!made) return;
  const Index s = in.in(0, 32);
  const BoolMatrix mask = build_mask(m, s, s);
  for (Index i = 0; i < s; ++i) {
    for (Index j = 0; j < s; ++j) {
      // §10.2: mask[i, j] = 1 iff 0 <= i - j < W.
      APEX_FUZZ_REQUIRE(mask(i, j) == (0 <= i - j && i - j < w),
                        "sliding window differs from §10.2");
    }
  }
}

/// The checks of this target, in the order an input's choice selects them.
constexpr Check kChecks[] = {layer_masks, position_masks, block_classification, window_masks};

}  // namespace
}  // namespace apex::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace apex::fuzz;
  return run_checks(data, size, kChecks);
}
