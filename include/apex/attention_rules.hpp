// SPDX-License-Identifier: MIT
// Programmable attention rules: a mask rule of the user's (which pairs may attend, with an
// optional block classifier so that the kernel can still skip) and a score rule (a function
// applied to every score before the softmax), compiled into the tiled kernel as templates: the
// CPU counterpart of PyTorch's flex_attention mask_mod / score_mod. apex::sdpa takes them beside
// its AttentionMask and SdpaParams (sdpa.hpp).
//
//   mask rule    allows(b, h, q_pos, k_pos) -> bool            true = may attend
//   classifier   classify(b, h, q_range, k_range) -> BlockCoverage
//                  kNone: no pair of the rectangle may attend (the block is skipped unread),
//                  kAll: every pair may (no per-pair work), kPartial: ask allows() per pair.
//                  It must be exact when it says kNone or kAll; kPartial is always safe.
//   score rule   score(b, h, q_pos, k_pos, s) -> s'            s in the compute type (float
//                  or double: write it as a generic lambda), applied to every score after the
//                  soft-cap and ALiBi, before the bias and the masks
// b is the batch, h the query head, positions are absolute (PositionMask's alignment). The rule
// joins the PositionMask and the dense mask: a pair attends only if all of them allow it.
//
// Each callable is invoked from the kernel's worker threads (concurrently, in no fixed order) and
// must be a pure function of its arguments. A rule written this way costs one call per pair of
// the blocks its classifier leaves kPartial (the built-in rules of PositionMask evaluate once per
// query block and share it across a group's heads), and a score rule one call per score.
//
// The built-in rules written as user rules (mask.hpp's PositionMask and SdpaParams do the same,
// faster; the tests check that both agree):
//
//   causal:    apex::mask_rule([](Index, Index, Index q, Index k) { return k <= q; },
//                              [](Index, Index, PositionRange q, PositionRange k) {
//                                if (k.begin > q.end - 1) return BlockCoverage::kNone;
//                                if (k.end - 1 <= q.begin) return BlockCoverage::kAll;
//                                return BlockCoverage::kPartial;
//                              });
//   window W:  apex::mask_rule([W](Index, Index, Index q, Index k) {
//                                return k <= q && q - k < W; });
//   ALiBi:     apex::score_rule([&slopes](Index, Index h, Index q, Index k, auto s) {
//                                 return s - decltype(s)(slopes[h] * double(q - k)); });
//   documents: apex::mask_rule([&ids](Index, Index, Index q, Index k) {
//                                return ids[q] == ids[k]; });
#pragma once

#include <apex/config.hpp>
#include <apex/mask.hpp>

#include <type_traits>
#include <utility>

namespace apex {

/// The mask rule that allows every pair (no rule).
struct AllowAll {
  /// Every pair may attend.
  bool operator()(Index /*b*/, Index /*h*/, Index /*q_pos*/, Index /*k_pos*/) const { return true; }
};

/// A classifier that cannot tell: every block is checked pair by pair.
struct CheckEveryPair {
  /// kPartial for every rectangle.
  BlockCoverage operator()(Index /*b*/, Index /*h*/, PositionRange /*q*/,
                           PositionRange /*k*/) const {
    return BlockCoverage::kPartial;
  }
};

/// The score rule that leaves every score as it is (no rule).
struct KeepScore {
  /// The score, unchanged.
  template <class S>
  S operator()(Index /*b*/, Index /*h*/, Index /*q_pos*/, Index /*k_pos*/, S s) const {
    return s;
  }
};

/// A mask rule, its block classifier and a score rule, held by value (a lambda's captures are
/// what it refers to; they must outlive the call). Build one with mask_rule, score_rule or
/// attention_rules.
template <class Allows = AllowAll, class Classify = CheckEveryPair, class Score = KeepScore>
struct AttentionRules {
  Allows allows;      ///< bool(b, h, q_pos, k_pos): true = may attend
  Classify classify;  ///< BlockCoverage(b, h, q_range, k_range), exact for kNone and kAll
  Score score;        ///< s'(b, h, q_pos, k_pos, s), s float or double

  /// Whether there is a mask rule (the kernel compiles its calls in only then).
  static constexpr bool kMasks = !std::is_same_v<Allows, AllowAll>;
  /// Whether there is a score rule.
  static constexpr bool kScores = !std::is_same_v<Score, KeepScore>;
};

/// No user rule: what apex::sdpa without rules uses.
using NoRules = AttentionRules<>;

/// A user mask rule without a classifier: every block it may touch is checked pair by pair.
template <class Allows>
AttentionRules<Allows> mask_rule(Allows allows) {
  return {std::move(allows), {}, {}};
}

/// A user mask rule with its block classifier.
template <class Allows, class Classify>
AttentionRules<Allows, Classify> mask_rule(Allows allows, Classify classify) {
  return {std::move(allows), std::move(classify), {}};
}

/// A user score rule alone.
template <class Score>
AttentionRules<AllowAll, CheckEveryPair, Score> score_rule(Score score) {
  return {{}, {}, std::move(score)};
}

/// A mask rule, its classifier and a score rule together.
template <class Allows, class Classify, class Score>
AttentionRules<Allows, Classify, Score> attention_rules(Allows allows, Classify classify,
                                                        Score score) {
  return {std::move(allows), std::move(classify), std::move(score)};
}

namespace detail {

/// What a user mask rule says of a rectangle for several heads at once (the stacked heads of a
/// tile): kNone if it says so for every head, kAll if for every head, else kPartial. kAll
/// without a mask rule (then `rules` may be null).
template <class Rules>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, one caller (the tile)
BlockCoverage user_coverage(const Rules* rules, Index b, Index first_head, Index heads,
                            const PositionRange& q, const PositionRange& k) {
  if constexpr (!Rules::kMasks) {
    return BlockCoverage::kAll;
  } else {
    bool none = true;
    bool all = true;
    for (Index h = first_head; h < first_head + heads; ++h) {
      const BlockCoverage c = rules->classify(b, h, q, k);
      none = none && c == BlockCoverage::kNone;
      all = all && c == BlockCoverage::kAll;
    }
    return none ? BlockCoverage::kNone : all ? BlockCoverage::kAll : BlockCoverage::kPartial;
  }
}

}  // namespace detail

}  // namespace apex
