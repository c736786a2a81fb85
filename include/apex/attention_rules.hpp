// SPDX-License-Identifier: MIT
// Programmable attention rules: a mask rule of the user's (which pairs may attend, with an
// optional block classifier so that the kernel can still skip) and a score rule (a function
// applied to every score before the softmax), compiled into the tiled kernel as templates: the
// CPU counterpart of PyTorch's flex_attention mask_mod / score_mod. apex::sdpa takes them beside
// its AttentionMask and SdpaParams (sdpa_params.hpp).
//
//   mask rule    allows(b, h, q_pos, k_pos) -> bool            true = may attend
//   classifier   classify(b, h, q_range, k_range) -> BlockCoverage
//                  kNone: no pair of the rectangle may attend (the block is skipped unread),
//                  kAll: every pair may (no per-pair work), kPartial: ask allows() per pair.
//                  It must be exact when it says kNone or kAll (what a false answer does:
//                  below; verify_classifier finds one); kPartial is always safe.
//   score rule   score(b, h, q_pos, k_pos, s) -> s'            s in the compute type (float
//                  or double: write it as a generic lambda), applied to every score after the
//                  soft-cap and ALiBi, before the bias and the masks
// b is the batch, h the query head, positions are absolute (PositionMask's alignment). The rule
// joins the PositionMask and the dense mask: a pair attends only if all of them allow it.
//
// A CLASSIFIER THAT LIES (kNone for a rectangle holding a pair that allows() accepts, kAll for
// one holding a pair it rejects) costs exactness, not safety. apex::sdpa still reads and writes
// nothing outside its inputs and outputs and has no undefined behaviour: an answer only chooses
// among three things honest answers do too (skip the block, no per-pair work, ask allows()); no
// index or size is computed from it. The output is the attention of the rule the answers imply.
// The kernel asks about the rectangles of its tiles, a block of queries × a block of keys, for
// each of the G query heads stacked in the tile (those sharing a key/value head), except where
// the PositionMask alone excludes the block; it takes kNone or kAll only when all G heads give
// it, and any other answer (or value) as kPartial. For every pair of the tile and each head:
//   kNone     the block is skipped unread: no pair takes part, as if allows() were false
//   kAll      allows() is not called: a pair takes part wherever the PositionMask and the dense
//             mask allow it, as if allows() were true (the bias and the score rule still apply)
//   kPartial  allows() decides each pair, as for an honest classifier
// The tiles depend on the shapes and on the kernel's block sizes and path, not on the number of
// threads: a lie about part of a rectangle changes the result by an amount that depends on the
// shapes, the same for any number of threads; a lie that holds for every rectangle (always kAll,
// say) gives exactly the rule it states. apex::reference::sdpa never calls the classifier (it
// computes the rule of allows()). To find a lie, run once with verify_classifier (below).
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

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
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

  using ScoreRule = Score;  ///< the score rule's type

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

/// A score rule with its derivative, for the backward pass (sdpa_backward.hpp), which needs
/// ds'/ds at every score the rule was given: derivative(b, h, q_pos, k_pos, s) -> ds'/ds, taken
/// at the rule's input s. A rule without one is a compile-time error there, and works as before
/// everywhere else. Build it with with_derivative; it goes wherever a score rule goes:
///   // Gemma 2's soft-cap written as a rule: s' = c·tanh(s/c), ds'/ds = 1 − tanh²(s/c)
///   auto capped = apex::score_rule(apex::with_derivative(
///       [c](Index, Index, Index, Index, auto s) { return c * std::tanh(s / c); },
///       [c](Index, Index, Index, Index, auto s) {
///         const auto t = std::tanh(s / c);
///         return 1 - t * t;
///       }));
template <class Score, class Derivative>
struct DifferentiableScore {
  Score score;            ///< s'(b, h, q_pos, k_pos, s)
  Derivative derivative;  ///< ds'/ds (b, h, q_pos, k_pos, s)

  /// The score rule itself.
  template <class S>
  S operator()(Index b, Index h, Index q_pos, Index k_pos, S s) const {
    return static_cast<S>(score(b, h, q_pos, k_pos, s));
  }
  /// Its derivative at the rule's input s.
  template <class S>
  S slope(Index b, Index h, Index q_pos, Index k_pos, S s) const {
    return static_cast<S>(derivative(b, h, q_pos, k_pos, s));
  }
};

/// A score rule and its derivative, both s'(b, h, q_pos, k_pos, s) in float or double (generic
/// lambdas), as one score rule (DifferentiableScore).
template <class Score, class Derivative>
DifferentiableScore<Score, Derivative> with_derivative(Score score, Derivative derivative) {
  return {std::move(score), std::move(derivative)};
}

/// Whether a score rule can be differentiated: no rule (KeepScore), or one built with
/// with_derivative.
template <class Score>
inline constexpr bool kDifferentiableScore = std::is_same_v<Score, KeepScore>;
/// A score rule built with with_derivative can be differentiated.
template <class Score, class Derivative>
inline constexpr bool kDifferentiableScore<DifferentiableScore<Score, Derivative>> = true;

// ---------------------------------------------------------------------------------------------
// Checking a classifier (a debug and test mode)
// ---------------------------------------------------------------------------------------------

/// A rectangle a classifier misjudged: what it was asked, what it said and a pair that shows the
/// answer false (q_pos = k_pos = -1 when the answer was no BlockCoverage at all).
struct ClassifierViolation {
  Index b = 0;                                   ///< the batch asked about
  Index h = 0;                                   ///< the query head asked about
  PositionRange q{0, 0};                         ///< the query positions asked about
  PositionRange k{0, 0};                         ///< the key positions asked about
  BlockCoverage said = BlockCoverage::kPartial;  ///< the classifier's answer
  Index q_pos = -1;                              ///< the query position of a refuting pair
  Index k_pos = -1;                              ///< its key position

  /// "[verify_classifier] classify(b=0, h=3, q=[64,128), k=[64,128)) said kNone but
  /// allows(0, 3, 64, 64) is true".
  std::string message() const {
    std::ostringstream out;
    out << "[verify_classifier] classify(b=" << b << ", h=" << h << ", q=[" << q.begin << ","
        << q.end << "), k=[" << k.begin << "," << k.end << ")) said ";
    if (said == BlockCoverage::kNone || said == BlockCoverage::kAll) {
      const bool none = said == BlockCoverage::kNone;
      out << (none ? "kNone" : "kAll") << " but allows(" << b << ", " << h << ", " << q_pos << ", "
          << k_pos << ") is " << (none ? "true" : "false");
    } else {
      out << "BlockCoverage(" << static_cast<int>(said)
          << "), which is not kNone, kPartial or kAll";
    }
    return out.str();
  }
};

template <class Allows, class Classify>
struct VerifiedClassifier;

/// What verify_classifier found over the calls that used its rules: the rectangles checked, how
/// many were misjudged and the first one recorded (with several threads, whichever was found
/// first). Safe to update from the kernel's threads at once (atomic counters, a mutex around the
/// violation). Not copyable: the rules point to it, so it must outlive the calls.
class ClassifierReport {
 public:
  ClassifierReport() = default;
  ClassifierReport(const ClassifierReport&) = delete;
  ClassifierReport& operator=(const ClassifierReport&) = delete;
  ClassifierReport(ClassifierReport&&) = delete;
  ClassifierReport& operator=(ClassifierReport&&) = delete;
  ~ClassifierReport() = default;

  /// Whether no answer was false.
  bool ok() const { return violations() == 0; }
  /// Rectangles the classifier was asked about (each call; a float pass redone in double asks
  /// again).
  std::int64_t blocks_checked() const { return blocks_.load(std::memory_order_relaxed); }
  /// Rectangles it misjudged.
  std::int64_t violations() const { return violations_.load(std::memory_order_relaxed); }
  /// The first misjudged rectangle recorded; empty while ok().
  std::optional<ClassifierViolation> first_violation() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return first_;
  }
  /// The first violation's message, with the count of the others; empty while ok().
  std::string message() const {
    const std::optional<ClassifierViolation> first = first_violation();
    if (!first) return {};
    const std::int64_t others = violations() - 1;
    return others > 0 ? first->message() + " (and " + std::to_string(others) + " more rectangles)"
                      : first->message();
  }
  /// Throws std::invalid_argument with message() unless ok().
  void throw_if_violated() const {
    if (!ok()) throw std::invalid_argument(message());
  }
  /// Forgets everything, to check another call. Not while a call uses the rules.
  void reset() {
    const std::lock_guard<std::mutex> lock(mutex_);
    first_.reset();
    blocks_.store(0, std::memory_order_relaxed);
    violations_.store(0, std::memory_order_relaxed);
  }

 private:
  template <class Allows, class Classify>
  friend struct VerifiedClassifier;

  void add_block() { blocks_.fetch_add(1, std::memory_order_relaxed); }
  void add_violation(const ClassifierViolation& violation) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!first_) first_ = violation;
    violations_.fetch_add(1, std::memory_order_relaxed);
  }

  std::atomic<std::int64_t> blocks_{0};
  std::atomic<std::int64_t> violations_{0};
  mutable std::mutex mutex_;
  std::optional<ClassifierViolation> first_;
};

/// The classifier of verify_classifier: asks the user's, checks a kNone or kAll answer against
/// allows() on every pair of the rectangle (|q| · |k| calls), records a false or invalid one
/// in the report, and answers kPartial whatever it heard, so that allows() decides every pair.
template <class Allows, class Classify>
struct VerifiedClassifier {
  Allows allows;             ///< a copy of the rule's allows()
  Classify classify;         ///< the user's classifier
  ClassifierReport* report;  ///< shared by every copy; outlives the calls

  /// kPartial, after asking the user's classifier and checking its answer.
  BlockCoverage operator()(Index b, Index h, const PositionRange& q, const PositionRange& k) const {
    const BlockCoverage said = classify(b, h, q, k);
    report->add_block();
    if (said == BlockCoverage::kPartial) return BlockCoverage::kPartial;
    ClassifierViolation violation{b, h, q, k, said, -1, -1};
    if (said == BlockCoverage::kNone || said == BlockCoverage::kAll) {
      const bool claimed = said == BlockCoverage::kAll;  // what allows() must say of every pair
      if (!find_pair(violation, !claimed)) return BlockCoverage::kPartial;  // the answer holds
    }
    report->add_violation(violation);
    return BlockCoverage::kPartial;
  }

 private:
  /// Finds in v's rectangle a pair for which allows() is `value`, in row order; false if none.
  bool find_pair(ClassifierViolation& v, bool value) const {
    for (Index qp = v.q.begin; qp < v.q.end; ++qp) {
      for (Index kp = v.k.begin; kp < v.k.end; ++kp) {
        if (static_cast<bool>(allows(v.b, v.h, qp, kp)) == value) {
          v.q_pos = qp;
          v.k_pos = kp;
          return true;
        }
      }
    }
    return false;
  }
};

/// The same rules with their classifier checked: each answer of kNone or kAll is tested against
/// allows() on every pair of its rectangle, the first false one and the counts go to `report`,
/// and the kernel is told kPartial, so the result is exactly that of the rules without a
/// classifier (mask_rule(allows)), bit for bit, whether the classifier lies or not. Works
/// wherever AttentionRules go (apex::sdpa, reference::sdpa, which never asks, so checks nothing).
/// A debug and test mode: every classified block costs O(|q| · |k|) calls of allows() on top of
/// the per-pair work of a rule without classifier, and no block is skipped. Nothing is thrown
/// from the kernel's threads; call report.throw_if_violated() after the call.
///   apex::ClassifierReport report;
///   apex::sdpa(q, k, v, mask, params, apex::verify_classifier(rules, report), out);
///   report.throw_if_violated();  // "[verify_classifier] classify(b=0, h=3, ...) said kNone ..."
template <class Allows, class Classify, class Score>
AttentionRules<Allows, VerifiedClassifier<Allows, Classify>, Score> verify_classifier(
    const AttentionRules<Allows, Classify, Score>& rules, ClassifierReport& report) {
  return {rules.allows, {rules.allows, rules.classify, &report}, rules.score};
}

namespace detail {

/// A user function of (b, ...) called with its batch index fixed: each sequence of a call over
/// many sequences is a problem of one batch (b = 0), and its rules see the sequence's index.
template <class F>
struct AtBatch {
  const F* f;
  Index b;

  template <class... Args>
  auto operator()(Index /*b*/, Args... args) const {
    return (*f)(b, args...);
  }
};

/// f with its batch index fixed at b; the defaults (no rule) stay as they are, so that the
/// kernel still compiles their calls out.
template <class F>
auto at_batch(const F& f, Index b) {
  if constexpr (std::is_same_v<F, AllowAll> || std::is_same_v<F, CheckEveryPair> ||
                std::is_same_v<F, KeepScore>) {
    return f;
  } else {
    return AtBatch<F>{&f, b};
  }
}

/// `rules` as the rules of the sequence of index b of a call over many sequences (at_batch on
/// each of its three functions); they refer to `rules`, which must outlive them.
template <class A, class C, class S>
auto rules_at_batch(const AttentionRules<A, C, S>& rules, Index b) {
  using Allows = decltype(at_batch(rules.allows, b));
  using Classify = decltype(at_batch(rules.classify, b));
  using Score = decltype(at_batch(rules.score, b));
  return AttentionRules<Allows, Classify, Score>{
      at_batch(rules.allows, b), at_batch(rules.classify, b), at_batch(rules.score, b)};
}

/// The type of rules_at_batch(R, b).
template <class R>
using RulesAtBatch = decltype(rules_at_batch(std::declval<const R&>(), 0));

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
