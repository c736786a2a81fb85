// SPDX-License-Identifier: MIT
// The score terms of attention, as pieces over one row of a block of scores: what turns a raw
// score scale·q_i·k_j into the logit the softmax sees (§6.2, masks §10–§11, and the options of
// SdpaParams and AttentionRules). The tiled kernel (attention_tile.hpp) applies them to every
// block it does not skip; any other kernel over the same problem (a backward pass, a sparse or
// tree kernel) applies the same pieces in the same order and so recomputes the same logits,
// bit for bit.
//
// THE TERMS, IN ORDER, for query row i (absolute position qp) of query head h and key j
// (position kp):
//   transform  softcap   x → c·tanh(x / c)                   (SdpaParams::softcap; 0: off)
//              ALiBi     + slope_h·(kp − qp)                  (rounded once: AlibiTerm)
//              rules     x → rules.score(b, h, qp, kp, x)     (AttentionRules with kScores)
//   forbid     bias      + bias(i, j); a bias of -inf forbids the key even where x is NaN
//              position  the PositionMask (causal, window, prefix, chunk, documents), from a
//                        tile of ±inf evaluated once per block for the G heads (PositionTile)
//              dense     allowed(i, j) false → -inf
//              rules     rules.allows(b, h, qp, kp) false → -inf (kMasks; blocks the rules'
//                        classifier calls partial only)
// A forbidden key's logit is selected to -inf, never added to, so that it is -inf whatever its
// key or bias held (the policy on non-finite input: sdpa.hpp).
//
// SHAPES. A row of n scores s[0, n) of the keys [key_index, key_index + n) of the problem (the
// columns of the dense masks), at positions [kp, kp + n): ScoreRow says where it sits. The
// pieces hold views and pointers into the caller's problem and allocate nothing; the tiles of
// PositionTile and AlibiTerm are the caller's buffers (Bq × ld and n scalars of C).
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <limits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, positions and indices of a row
namespace apex::detail {

/// Where one row of a block of scores sits: batch b, query head h, query row i of the problem at
/// absolute position qp; its n keys are keys [key_index, key_index + n) of the problem, at
/// absolute positions [kp, kp + n).
struct ScoreRow {
  Index b, h, i, qp;
  Index key_index, kp, n;
};

/// A row of scores of compute type C, as an Eigen array over the caller's buffer.
template <class C>
using ScoreArray = Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>;
template <class C>
using ConstScoreArray = Eigen::Map<const Eigen::Array<C, 1, Eigen::Dynamic>>;

/// softcap(x) = c·tanh(x / c) on the scaled score; off when c = 0 (Gemma 2's logit soft-cap).
template <class C>
struct Softcap {
  C cap = C(0);

  bool on() const { return cap > C(0); }
  void apply(ScoreArray<C>& s) const { s = cap * (s * (C(1) / cap)).tanh(); }
  /// apply(), and slope *= its derivative 1 − tanh²(x / c) at each score x.
  void apply_with_slope(ScoreArray<C>& s, ScoreArray<C>& slope) const {
    s = (s * (C(1) / cap)).tanh();
    slope *= C(1) - s.square();
    s *= cap;
  }
};

/// ALiBi's slope_h·(kp − qp) (Press et al. 2022). A tile forms the key distances of its first
/// query row once per block, distance(j) = kp_j − qp0 (fill), and a row at offset o = qp − qp0
/// adds slope·(distance(j) − o): a difference of integers, exact in C (below 2^24 in float),
/// so the term is rounded once, as the reference rounds it.
template <class C>
struct AlibiTerm {
  const double* slopes = nullptr;  // [H_q]; null: off

  bool on() const { return slopes != nullptr; }
  /// distance [n] = kp − qp0 for keys at positions [kp, kp + n).
  static void fill(C* distance, Index kp, Index qp0, Index n) {
    const C first = static_cast<C>(kp - qp0);
    ScoreArray<C>(distance, n) =
        Eigen::Array<C, 1, Eigen::Dynamic>::LinSpaced(n, first, first + C(n - 1));
  }
  void apply(ScoreArray<C>& s, Index h, const C* distance, Index offset) const {
    const C slope = static_cast<C>(slopes[h]);
    s += slope * (ConstScoreArray<C>(distance, s.size()) - static_cast<C>(offset));
  }
};

/// The position rule of a block, evaluated once for its Bq query rows and shared by the G heads
/// stacked on them: tile(i, j) = +inf where the PositionMask allows query qp0 + i and key kp + j,
/// -inf where it forbids the pair; a row then keeps its scores where the tile is positive.
template <class C>
struct PositionTile {
  static void fill(const PositionMask& positions, Index qp0, Index rows, Index kp, Index n, C* tile,
                   Index ld) {
    constexpr C kInf = std::numeric_limits<C>::infinity();
    for (Index i = 0; i < rows; ++i) {
      C* row = tile + i * ld;
      for (Index j = 0; j < n; ++j) row[j] = positions.allows(qp0 + i, kp + j) ? kInf : -kInf;
    }
  }
  static void apply(ScoreArray<C>& s, const C* tile_row) {
    forbid_unless_positive(s.data(), tile_row, s.size());
  }
};

/// The dense bias [B, H_q, S_q, S_k] (broadcast views allowed), added to the scores; -inf
/// forbids the key even where the score is NaN (NaN + -inf is NaN). Off when empty.
template <class C, class TB>
struct DenseBias {
  HeadsView<const TB> bias;

  bool on() const { return !bias.empty(); }
  void apply(ScoreArray<C>& s, const ScoreRow& r) const {
    constexpr C kNegInf = -std::numeric_limits<C>::infinity();
    const auto b =
        bias.head(r.b, r.h).row(r.i).segment(r.key_index, r.n).array().template cast<C>();
    s = (b == kNegInf).select(kNegInf, s + b);
  }
};

/// The dense boolean mask [B, H_q, S_q, S_k] (broadcast views allowed): false forbids the key.
/// Off when empty.
template <class C>
struct DenseAllowed {
  HeadsView<const bool> allowed;

  bool on() const { return !allowed.empty(); }
  void apply(ScoreArray<C>& s, const ScoreRow& r) const {
    const bool* row = allowed.head(r.b, r.h).row(r.i).data() + r.key_index;
    for (Index j = 0; j < r.n; ++j) {
      if (!row[j]) s[j] = -std::numeric_limits<C>::infinity();
    }
  }
};

/// The user's AttentionRules R (attention_rules.hpp): its score rule (R::kScores) and its mask
/// rule (R::kMasks), on absolute positions. NoRules compiles to nothing.
template <class C, class R>
struct UserRules {
  const R* rules = nullptr;

  void score(ScoreArray<C>& s, const ScoreRow& r) const {
    if constexpr (R::kScores) {
      for (Index j = 0; j < r.n; ++j) {
        s[j] = static_cast<C>(rules->score(r.b, r.h, r.qp, r.kp + j, s[j]));
      }
    }
  }
  /// score(), and slope *= the rule's derivative at each score (kDifferentiableScore).
  void score_with_slope(ScoreArray<C>& s, ScoreArray<C>& slope, const ScoreRow& r) const {
    if constexpr (R::kScores) {
      for (Index j = 0; j < r.n; ++j) {
        slope[j] *= static_cast<C>(rules->score.slope(r.b, r.h, r.qp, r.kp + j, s[j]));
        s[j] = static_cast<C>(rules->score(r.b, r.h, r.qp, r.kp + j, s[j]));
      }
    }
  }
  void forbid(ScoreArray<C>& s, const ScoreRow& r) const {
    if constexpr (R::kMasks) {
      for (Index j = 0; j < r.n; ++j) {
        if (!rules->allows(r.b, r.h, r.qp, r.kp + j)) s[j] = -std::numeric_limits<C>::infinity();
      }
    }
  }
};

/// Every score term of a problem P (AttentionProblem, attention_plan.hpp), in C, composed in the
/// order above. transform() and forbid() are the two halves a kernel calls on each row of a
/// block; what a block needs at all is said by modifies() and by the block's coverage.
template <class C, class P>
struct ScoreTerms {
  Softcap<C> softcap;
  AlibiTerm<C> alibi;
  DenseBias<C, typename P::Bias> bias;
  DenseAllowed<C> allowed;
  UserRules<C, typename P::Rules> rules;

  explicit ScoreTerms(const P& p)
      : softcap{static_cast<C>(p.softcap)},
        alibi{p.alibi_slopes},
        bias{p.bias},
        allowed{p.allowed},
        rules{p.rules} {}

  /// Whether some term changes the scores of every block, masked or not.
  bool modifies() const { return softcap.on() || alibi.on() || P::Rules::kScores; }
  /// Whether some dense term applies to every block (the bias and the dense mask).
  bool dense() const { return bias.on() || allowed.on(); }
  /// Whether transform() is more than adding a constant to each score (the soft-cap or a score
  /// rule), so that a backward pass needs its derivative (transform_with_slope).
  bool curves() const { return softcap.on() || P::Rules::kScores; }

  /// softcap, ALiBi (the distances of alibi.fill, the row at offset qp − qp0) and the user's
  /// score rule. `distance` is read only with ALiBi.
  void transform(ScoreArray<C>& s, const ScoreRow& r, const C* distance, Index offset) const {
    if (softcap.on()) softcap.apply(s);
    if (alibi.on()) alibi.apply(s, r.h, distance, offset);
    rules.score(s, r);
  }
  /// transform(), and in `slope` the derivative of each logit by its raw score, ds'/ds (the
  /// soft-cap's 1 − tanh², times the score rule's slope; ALiBi adds a constant). The same
  /// logits as transform(), bit for bit. Needs a differentiable score rule (with_derivative).
  void transform_with_slope(ScoreArray<C>& s, ScoreArray<C>& slope, const ScoreRow& r,
                            const C* distance, Index offset) const {
    slope.setOnes();
    if (softcap.on()) softcap.apply_with_slope(s, slope);
    if (alibi.on()) alibi.apply(s, r.h, distance, offset);
    rules.score_with_slope(s, slope, r);
  }
  /// The bias, then the position tile's row (null: the block is not partial for the position
  /// rule), the dense mask and, where `user_partial`, the user's mask rule.
  void forbid(ScoreArray<C>& s, const ScoreRow& r, const C* position_row, bool user_partial) const {
    if (bias.on()) bias.apply(s, r);
    if (position_row != nullptr) PositionTile<C>::apply(s, position_row);
    if (allowed.on()) allowed.apply(s, r);
    if (user_partial) rules.forbid(s, r);
  }
};

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
