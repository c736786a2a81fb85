// SPDX-License-Identifier: MIT
// Tree masks for speculative decoding: the draft tokens a cheap model proposed, as a tree (a
// chain, or several continuations branching from one another: EAGLE, Medusa, lookahead), all
// verified by the target model in one pass. Draft token t may attend to the committed prefix and
// to exactly its ancestors and itself, never to a sibling branch.
//
//   DraftTree   one sequence's tree: n <= 64 draft tokens, parents[t] < t (or -1: t continues the
//               committed prefix directly); ancestors(t) a 64-bit mask, depth(t) its distance
//               from the prefix (a draft token's RoPE position is the committed length plus its
//               depth, where the caller sets positions)
//   TreeMasks   the trees of a batch (or of the sequences of sdpa_varlen / sdpa_paged /
//               sdpa_block_tables, which show sequence i to rules as batch i), and where each
//               one's draft tokens sit: positions [first[b], first[b] + n_b), their cache slots
//   tree_rules  the mask rule and exact block classifier of a TreeMasks (attention_rules.hpp),
//               which every entry point taking AttentionRules accepts, beside a PositionMask
//               (causal, for verification) that they join
//
// The rule, at absolute positions q (query) and k (key) of batch b with the tree of n tokens
// whose first token sits at f:
//   k <  f            allowed (the committed prefix; the PositionMask adds causality)
//   f <= k < f + n    allowed iff q = f + t is a draft token and k − f is t or an ancestor of t
//   k >= f + n        forbidden (past the draft)
// The classifier answers kAll for a block of committed keys (read at full speed, as without a
// tree), kNone for a block of draft keys that no query of the block descends from (skipped
// unread), and is exact: it looks at each query of the block that is a draft token (at most 64)
// and at nothing else. A batch b without a tree (b >= trees.size()) is not restricted.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/mask.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace apex {

/// One sequence's draft tree: n <= kMaxTokens draft tokens in an order where each parent comes
/// before its children. Default-constructed: the empty tree (no draft token).
class DraftTree {
 public:
  /// The most draft tokens a tree holds: one bit of a 64-bit ancestor mask each.
  static constexpr Index kMaxTokens = 64;

  DraftTree() = default;
  /// The tree whose token t continues token parents[t], or the committed prefix where
  /// parents[t] = -1. Throws std::invalid_argument, naming the entry, unless every parents[t]
  /// lies in [-1, t) and there are at most kMaxTokens tokens. Allocates the masks (n of them).
  explicit DraftTree(const std::vector<Index>& parents) {
    APEX_CHECK(static_cast<Index>(parents.size()) <= kMaxTokens,
               "[draft_tree] parents (" << parents.size() << " tokens) must hold at most "
                                        << kMaxTokens << " draft tokens");
    for (std::size_t t = 0; t < parents.size(); ++t) {
      const Index p = parents[t];
      APEX_CHECK(p >= -1 && p < static_cast<Index>(t),
                 "[draft_tree] parents[" << t << "] (" << p << ") must lie in [-1, " << t
                                         << "): a parent comes before its child");
    }
    for (std::size_t t = 0; t < parents.size(); ++t) {
      const Index p = parents[t];
      const std::uint64_t own = std::uint64_t{1} << t;
      ancestors_.push_back(p < 0 ? own : own | ancestors_[static_cast<std::size_t>(p)]);
      depths_.push_back(p < 0 ? 0 : depths_[static_cast<std::size_t>(p)] + 1);
      parents_.push_back(p);
    }
  }

  /// Number of draft tokens n.
  Index size() const { return static_cast<Index>(parents_.size()); }
  /// The parent of token t (-1: the committed prefix). t must lie in [0, n).
  Index parent(Index t) const { return parents_[at(t)]; }
  /// Edges from the committed prefix to token t: 0 for a token whose parent is -1.
  Index depth(Index t) const { return depths_[at(t)]; }
  /// Bit u set iff token u is t or an ancestor of t.
  std::uint64_t ancestors(Index t) const { return ancestors_[at(t)]; }
  /// Whether token t may attend to token u (u is t or one of its ancestors).
  bool sees(Index t, Index u) const { return ((ancestors(t) >> u) & 1U) != 0; }

 private:
  static std::size_t at(Index t) { return static_cast<std::size_t>(t); }

  std::vector<Index> parents_;
  std::vector<Index> depths_;
  std::vector<std::uint64_t> ancestors_;
};

/// The draft trees of a batch: batch b's tokens at positions [first[b], first[b] + trees[b]
/// .size()), first[b] its committed length. Pass tree_rules(masks) to sdpa (batch b),
/// sdpa_varlen, sdpa_paged or sdpa_block_tables (sequence i); the TreeMasks must outlive the
/// calls. Default-constructed: no tree (every batch unrestricted).
class TreeMasks {
 public:
  TreeMasks() = default;
  /// Throws std::invalid_argument unless there is one first position per tree, each is >= 0,
  /// and the window (0: none) is >= 0. With a window W, a pair is allowed only where its
  /// positions in the text lie less than W apart (the token's own, see text_position), the
  /// sliding window of a local layer measured along the text rather than along the slots.
  TreeMasks(std::vector<DraftTree> trees, std::vector<Index> first, Index window = 0)
      : trees_(std::move(trees)), first_(std::move(first)), window_(window) {
    APEX_CHECK(first_.size() == trees_.size(), "[tree_masks] first (" << first_.size()
                                                                      << " positions) must have "
                                                                         "one entry per tree ("
                                                                      << trees_.size() << ")");
    for (std::size_t b = 0; b < first_.size(); ++b) {
      APEX_CHECK(first_[b] >= 0,
                 "[tree_masks] first[" << b << "] (" << first_[b] << ") must be >= 0");
    }
    APEX_CHECK(window >= 0, "[tree_masks] window (" << window << ") must be >= 0 (0: none)");
  }

  /// Number of trees (batches or sequences restricted).
  Index size() const { return static_cast<Index>(trees_.size()); }
  /// The tree of batch b. b must lie in [0, size()).
  const DraftTree& tree(Index b) const { return trees_[static_cast<std::size_t>(b)]; }
  /// The position of batch b's first draft token (its committed length).
  Index first(Index b) const { return first_[static_cast<std::size_t>(b)]; }

  /// The window W along the text (0: none).
  Index window() const { return window_; }

  /// Where slot x of batch b stands in the text: x for a committed token, first + depth for a
  /// draft token (its RoPE position), first + n and on for slots past the draft.
  Index text_position(Index b, Index x) const {
    const Index f = first(b), n = tree(b).size();
    return x < f || x >= f + n ? x : f + tree(b).depth(x - f);
  }

  /// Whether query slot q of batch b may attend to key slot k (the rule above, and the window).
  bool allows(Index b, Index q, Index k) const {
    if (b >= size()) return true;
    if (window_ > 0 && text_position(b, q) - text_position(b, k) >= window_) return false;
    const Index f = first(b), n = tree(b).size();
    if (k < f) return true;
    if (k >= f + n || q < f || q >= f + n) return false;
    return tree(b).sees(q - f, k - f);
  }

  /// What allows() says of every pair of the rectangle q × k: kAll, kNone or kPartial, exactly
  /// without a window; with one, kAll or kNone wherever the window's part is the same for every
  /// pair (the least and greatest distances along the text both below W, or both at least W).
  BlockCoverage classify(Index b, PositionRange q, PositionRange k) const {
    if (b >= size()) return BlockCoverage::kAll;
    const BlockCoverage tree_part = classify_tree(b, q, k);
    if (window_ == 0 || tree_part == BlockCoverage::kNone) return tree_part;
    const auto [q_least, q_greatest] = text_span(b, q);
    const auto [k_least, k_greatest] = text_span(b, k);
    if (q_least - k_greatest >= window_) return BlockCoverage::kNone;
    return tree_part == BlockCoverage::kAll && q_greatest - k_least < window_
               ? BlockCoverage::kAll
               : BlockCoverage::kPartial;
  }

 private:
  /// classify() of the tree's rule alone (b < size()): exact.
  BlockCoverage classify_tree(Index b, PositionRange q, PositionRange k) const {
    if (k.end <= first(b)) return BlockCoverage::kAll;
    const Index f = first(b), n = tree(b).size();
    const Index lo = std::max(k.begin, f) - f, hi = std::min(k.end, f + n) - f;  // draft keys
    const std::uint64_t keys = lo < hi ? bits(hi) & ~bits(lo) : 0;
    // Committed keys are allowed to every query, keys past the draft to none, draft keys to the
    // draft queries that descend from them.
    bool all = k.end <= f + n && q.begin >= f && q.end <= f + n;
    bool none = k.begin >= f;
    for (Index p = std::max(q.begin, f); p < std::min(q.end, f + n); ++p) {
      const std::uint64_t seen = tree(b).ancestors(p - f) & keys;
      all = all && seen == keys;
      none = none && seen == 0;
    }
    return all ? BlockCoverage::kAll : none ? BlockCoverage::kNone : BlockCoverage::kPartial;
  }

  /// The least and the greatest text position of the slots r of batch b.
  std::pair<Index, Index> text_span(Index b, PositionRange r) const {
    const Index f = first(b), n = tree(b).size();
    std::pair<Index, Index> span{text_position(b, r.begin), text_position(b, r.end - 1)};
    for (Index x = std::max(r.begin, f); x < std::min(r.end, f + n); ++x) {
      span.first = std::min(span.first, text_position(b, x));
      span.second = std::max(span.second, text_position(b, x));
    }
    return span;
  }

  /// The mask of bits [0, count), count <= 64.
  static std::uint64_t bits(Index count) {
    return count >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << count) - 1;
  }

  std::vector<DraftTree> trees_;
  std::vector<Index> first_;
  Index window_ = 0;
};

namespace detail {

/// tree_rules' mask rule and classifier: calls of a TreeMasks held by address.
struct TreeAllows {
  const TreeMasks* masks;
  bool operator()(Index b, Index /*h*/, Index q, Index k) const { return masks->allows(b, q, k); }
};
struct TreeClassify {
  const TreeMasks* masks;
  BlockCoverage operator()(Index b, Index /*h*/, PositionRange q, PositionRange k) const {
    return masks->classify(b, q, k);
  }
};

}  // namespace detail

/// The AttentionRules of `masks`: its mask rule and exact classifier, no score rule. Holds the
/// address of `masks`, which must outlive every call that takes the rules.
inline AttentionRules<detail::TreeAllows, detail::TreeClassify> tree_rules(const TreeMasks& masks) {
  return mask_rule(detail::TreeAllows{&masks}, detail::TreeClassify{&masks});
}

}  // namespace apex
