// SPDX-License-Identifier: MIT
// The attention problems of sdpa_test and sdpa_fast_test, built in one place: random
// [B, H, S, D] queries, keys and values in either layout, a position rule, a dense boolean mask
// and an additive bias (each shared over the batch and/or the heads, or not), the outputs, what
// the plain loops of reference/attention.hpp give for each head, and the normwise comparisons
// with the tolerances of tolerances.hpp.
//
// A problem is described in the plain loops' own terms (apex_test::MaskRule and the two
// offsets); attention_mask() translates that description into the library's AttentionMask, and
// expected() evaluates it with apex_test::rule_allows, so the library's rule is never its own
// oracle.
#pragma once

#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "reference/attention.hpp"
#include "tolerances.hpp"

namespace apex::testing {

/// Output and log-sum-exp entries start as this value, so that entries a call did not write show.
inline constexpr double kSentinel = 12345.0;

// ---- storage for [B, H, S, D] tensors in either layout ------------------------------------------

/// The two layouts HeadsView describes: contiguous [B, H, S, D], and token-major [B·S, H·D] with
/// the heads side by side, as a projection writes them.
enum class Layout { kContiguous, kTokenMajor };

inline const char* layout_name(Layout layout) {
  return layout == Layout::kContiguous ? "contiguous" : "token-major";
}

/// How random entries are drawn: uniform in [-1, 1) or standard normal (larger scores).
enum class Values { kUniform, kNormal };

/// A [B, H, S, D] tensor that owns its storage (zeros at first) and hands out its HeadsView.
/// Not std::vector, which has no data() for bool.
template <class T>
class Heads {
 public:
  Heads(Index batch, Index heads, Index seq, Index dim, Layout layout = Layout::kContiguous)
      : size_(static_cast<std::size_t>(batch * heads * seq * dim)), storage_(new T[size_]()) {
    view_ = layout == Layout::kContiguous
                ? HeadsView<T>::contiguous(storage_.get(), {batch, heads, seq, dim})
                : HeadsView<T>::token_major(storage_.get(), {batch, heads, seq, dim});
  }
  Heads(const Heads&) = delete;
  Heads& operator=(const Heads&) = delete;
  Heads(Heads&&) noexcept = default;  // the buffer, and so the view, survive a move
  Heads& operator=(Heads&&) noexcept = default;
  ~Heads() = default;

  HeadsView<T> view() { return view_; }
  HeadsView<const T> view() const { return view_; }
  Index batch() const { return view_.batch(); }
  Index heads() const { return view_.heads(); }
  Index seq() const { return view_.seq(); }
  Index dim() const { return view_.dim(); }

  /// The storage, in storage order (not the view's order).
  T* data() { return storage_.get(); }
  std::size_t size() const { return size_; }
  T& at(std::size_t i) { return storage_[i]; }
  const T& at(std::size_t i) const { return storage_[i]; }

  void fill(T value) { std::fill(storage_.get(), storage_.get() + size_, value); }
  bool all_equal(T value) const {
    return std::all_of(storage_.get(), storage_.get() + size_, [&](T x) { return x == value; });
  }
  /// Random entries from `rng`, drawn in storage order.
  void randomize(std::mt19937& rng, Values values = Values::kUniform) {
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (std::size_t i = 0; i < size_; ++i) {
      storage_[i] = static_cast<T>(values == Values::kUniform ? uniform(rng) : normal(rng));
    }
  }

  /// Head (b, h) as an S × D matrix in double, for the plain loops.
  apex_test::MatrixD head(Index b, Index h) const {
    return view_.head(b, h).template cast<double>();
  }
  /// Head (b, h) in place, to write.
  auto head_map(Index b, Index h) { return view_.head(b, h); }

 private:
  std::size_t size_;
  std::unique_ptr<T[]> storage_;
  HeadsView<T> view_;
};

// ---- one attention problem ----------------------------------------------------------------------

/// The extents of a problem: query heads over key/value heads (§8.2), S_q queries against S_k keys,
/// query/key width d_qk and value width d_v.
struct Shape {
  Index batch = 1;
  Index q_heads = 1;
  Index kv_heads = 1;
  Index s_q = 1;
  Index s_k = 1;
  Index d_qk = 1;
  Index d_v = 1;
};

inline std::string describe(const Shape& s) {
  return "B " + std::to_string(s.batch) + ", H_q " + std::to_string(s.q_heads) + ", H_kv " +
         std::to_string(s.kv_heads) + ", S_q " + std::to_string(s.s_q) + ", S_k " +
         std::to_string(s.s_k) + ", d_qk " + std::to_string(s.d_qk) + ", d_v " +
         std::to_string(s.d_v);
}

inline std::string describe(const apex_test::MaskRule& r, const std::optional<Index>& query_offset,
                            Index key_offset = 0) {
  return "causal " + std::to_string(r.causal) + ", W " + std::to_string(r.window) + ", P " +
         std::to_string(r.prefix) + ", C " + std::to_string(r.chunk) +
         (r.documents != nullptr ? ", documents" : "") + ", query_offset " +
         (query_offset ? std::to_string(*query_offset) : std::string("bottom-right")) +
         ", key_offset " + std::to_string(key_offset);
}

/// One attention problem: random Q, K, V (drawn in that order from the seed), where they sit,
/// which pairs the masks allow, and the parameters.
template <class Scalar>
struct Problem {
  Shape shape;
  Heads<Scalar> q, k, v;
  apex_test::MaskRule rule;           ///< causal, window W, prefix P (§10-§11)
  std::optional<Index> query_offset;  ///< position of query row 0; unset: bottom-right alignment
  Index key_offset = 0;               ///< position of key row 0
  BoolMatrix allowed;                 ///< [B'·H'·S_q, S_k], contiguous [B', H', S_q, S_k]
  Index allowed_batch = 0;            ///< B' (1 or B); 0: no dense mask
  Index allowed_heads = 0;            ///< H' (1 or H_q)
  RowMatrix<Scalar> bias;             ///< [B'·H'·S_q, S_k], contiguous [B', H', S_q, S_k]
  Index bias_batch = 0;               ///< 0: no bias
  Index bias_heads = 0;
  SdpaParams params;

  Problem(const Shape& s, Layout layout, std::uint32_t seed, Values values = Values::kUniform)
      : shape(s),
        q(s.batch, s.q_heads, s.s_q, s.d_qk, layout),
        k(s.batch, s.kv_heads, s.s_k, s.d_qk, layout),
        v(s.batch, s.kv_heads, s.s_k, s.d_v, layout),
        rng_(seed) {
    q.randomize(rng_, values);
    k.randomize(rng_, values);
    v.randomize(rng_, values);
  }

  /// A random dense mask of [mask_batch, mask_heads, S_q, S_k], true with probability p_true; a
  /// size-1 axis is shared.
  void add_dense_mask(Index mask_batch, Index mask_heads, double p_true) {
    allowed_batch = mask_batch;
    allowed_heads = mask_heads;
    allowed.resize(mask_batch * mask_heads * shape.s_q, shape.s_k);
    std::bernoulli_distribution coin(p_true);
    for (Index r = 0; r < allowed.rows(); ++r) {
      for (Index c = 0; c < allowed.cols(); ++c) allowed(r, c) = coin(rng_);
    }
  }

  /// A random bias of [bias_batch, bias_heads, S_q, S_k], uniform in [-2, 2) and -inf with
  /// probability neg_inf_fraction; a size-1 axis is shared.
  void add_bias(Index b_batch, Index b_heads, double neg_inf_fraction) {
    bias_batch = b_batch;
    bias_heads = b_heads;
    bias.resize(b_batch * b_heads * shape.s_q, shape.s_k);
    std::uniform_real_distribution<double> uniform(-2.0, 2.0);
    std::bernoulli_distribution coin(neg_inf_fraction);
    for (Index r = 0; r < bias.rows(); ++r) {
      for (Index c = 0; c < bias.cols(); ++c) {
        bias(r, c) = coin(rng_) ? -std::numeric_limits<Scalar>::infinity()
                                : static_cast<Scalar>(uniform(rng_));
      }
    }
  }

  /// The S_q × S_k block of the stored mask / bias for stored (batch, head) (b, h), to write.
  auto allowed_rows(Index b, Index h) {
    return allowed.middleRows((b * allowed_heads + h) * shape.s_q, shape.s_q);
  }
  auto bias_rows(Index b, Index h) {
    return bias.middleRows((b * bias_heads + h) * shape.s_q, shape.s_q);
  }

  /// The library's description of the same masks.
  AttentionMask<Scalar> attention_mask() const {
    AttentionMask<Scalar> mask;
    mask.positions.causal = rule.causal;
    if (rule.window > 0) mask.positions.window = rule.window;
    mask.positions.prefix = rule.prefix;
    if (rule.chunk > 0) mask.positions.chunk = rule.chunk;
    if (rule.documents != nullptr) mask.positions.documents = DocumentIds(*rule.documents);
    mask.positions.query_offset = query_offset;
    mask.positions.key_offset = key_offset;
    if (allowed_batch > 0) {
      mask.allowed = HeadsView<const bool>::contiguous(
          allowed.data(), {allowed_batch, allowed_heads, shape.s_q, shape.s_k});
    }
    if (bias_batch > 0) {
      mask.bias = HeadsView<const Scalar>::contiguous(
          bias.data(), {bias_batch, bias_heads, shape.s_q, shape.s_k});
    }
    return mask;
  }

  /// Absolute position of query row 0: the offset if given, otherwise the queries are the last
  /// S_q of the key_offset + S_k positions.
  Index first_query() const {
    return query_offset ? *query_offset : key_offset + shape.s_k - shape.s_q;
  }

  /// Row of the dense mask / bias storage for (b, h, i): a size-1 axis is shared.
  static Index broadcast_row(Index b, Index h, Index i, Index n_batch, Index n_heads, Index s_q) {
    const Index bb = n_batch == 1 ? 0 : b;
    const Index hh = n_heads == 1 ? 0 : h;
    return (bb * n_heads + hh) * s_q + i;
  }

  /// Whether query row i of query head h (batch b) may see key row j: the position rule and the
  /// dense mask (the bias is the plain loops' business).
  bool allows(Index b, Index h, Index i, Index j) const {
    if (!apex_test::rule_allows(rule, first_query() + i, key_offset + j)) return false;
    if (allowed_batch == 0) return true;
    return allowed(broadcast_row(b, h, i, allowed_batch, allowed_heads, shape.s_q), j);
  }

  /// Whether the key reaches the query at all: allowed, and its bias is not -inf.
  bool sees(Index b, Index h, Index i, Index j) const {
    if (!allows(b, h, i, j)) return false;
    if (bias_batch == 0) return true;
    return bias(broadcast_row(b, h, i, bias_batch, bias_heads, shape.s_q), j) !=
           -std::numeric_limits<Scalar>::infinity();
  }

  /// What the plain loops take for batch b and query head h besides Q, K and V: the bias (the
  /// stored one plus ALiBi's −slope·(qp − kp); unset without either), the scale and the sink.
  struct HeadTerms {
    std::optional<apex_test::MatrixD> bias;
    double scale = 1.0;
    double sink = -std::numeric_limits<double>::infinity();
  };
  HeadTerms head_terms(Index b, Index h) const {
    HeadTerms t;
    if (bias_batch > 0 || !params.alibi_slopes.empty()) {
      t.bias = apex_test::MatrixD::Zero(shape.s_q, shape.s_k);
    }
    for (Index i = 0; i < shape.s_q && bias_batch > 0; ++i) {
      t.bias->row(i) = bias.row(broadcast_row(b, h, i, bias_batch, bias_heads, shape.s_q))
                           .template cast<double>();
    }
    if (!params.alibi_slopes.empty()) {
      const double slope = params.alibi_slopes[std::size_t(h)];
      for (Index i = 0; i < shape.s_q; ++i) {
        for (Index j = 0; j < shape.s_k; ++j) {
          (*t.bias)(i, j) -= slope * static_cast<double>((first_query() + i) - (key_offset + j));
        }
      }
    }
    t.scale = params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(shape.d_qk));
    if (!params.sinks.empty()) t.sink = params.sinks[std::size_t(h)];
    return t;
  }

  /// The plain loops for batch b, query head h, which reads key/value head ⌊h / G⌋ (§8.2).
  /// ALiBi is a bias of −slope·(qp − kp) added to the stored one; the sink goes to the loops.
  apex_test::AttentionResult expected(Index b, Index h) const {
    const Index kv = apex_test::kv_head_of(h, shape.q_heads, shape.kv_heads);
    const HeadTerms t = head_terms(b, h);
    return apex_test::attention(
        q.head(b, h), k.head(b, kv), v.head(b, kv),
        [&](Index i, Index j) { return allows(b, h, i, j); }, t.bias ? &*t.bias : nullptr, t.scale,
        params.softcap, t.sink);
  }

 private:
  std::mt19937 rng_;
};

/// The outputs of a problem: out [B, H_q, S_q, d_v] in either layout, lse [B, H_q, S_q, 1].
template <class Scalar>
struct Outputs {
  explicit Outputs(const Shape& s, Layout out_layout = Layout::kContiguous)
      : out(s.batch, s.q_heads, s.s_q, s.d_v, out_layout), lse(s.batch, s.q_heads, s.s_q, 1) {}
  Outputs& fill(Scalar value) {
    out.fill(value);
    lse.fill(value);
    return *this;
  }
  Heads<Scalar> out, lse;
};

// ---- comparisons --------------------------------------------------------------------------------

/// Compares outputs with the plain loops, normwise (Tolerances::kAttention), and checks the
/// conventions that no tolerance may hide: no NaN or infinity in out, rows without an allowed key
/// exactly zero with lse = -inf, and lse left alone (the sentinel) when it was not asked for.
template <class Scalar>
void expect_matches_loops(const Problem<Scalar>& p, const Outputs<Scalar>& o, bool with_lse) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const Shape& s = p.shape;
  double max_ref = 0.0;
  double max_err = 0.0;
  double max_lse_ref = 1.0;
  double max_lse_err = 0.0;
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.q_heads; ++h) {
      const apex_test::AttentionResult ref = p.expected(b, h);
      const apex_test::MatrixD out = o.out.head(b, h);
      const apex_test::MatrixD lse = o.lse.head(b, h);
      ASSERT_TRUE(out.allFinite()) << "non-finite output in head (" << b << ", " << h << ")";
      for (Index i = 0; i < s.s_q; ++i) {
        if (ref.lse(i) == -kInf) {
          EXPECT_TRUE(out.row(i).isZero(0.0)) << "row " << i << " of head (" << b << ", " << h
                                              << ") has no allowed key and must be zeros";
        }
        if (with_lse) {
          if (ref.lse(i) == -kInf) {
            EXPECT_EQ(lse(i, 0), -kInf) << "lse row " << i << " of head (" << b << ", " << h;
          } else {
            ASSERT_TRUE(std::isfinite(lse(i, 0))) << "lse row " << i << " head " << b << "," << h;
            max_lse_ref = std::max(max_lse_ref, std::abs(ref.lse(i)));
            max_lse_err = std::max(max_lse_err, std::abs(lse(i, 0) - ref.lse(i)));
          }
        }
      }
      max_ref = std::max(max_ref, ref.out.cwiseAbs().maxCoeff());
      max_err = std::max(max_err, (out - ref.out).cwiseAbs().maxCoeff());
    }
  }
  const double tol = Tolerances<Scalar>::kAttention;
  EXPECT_LE(max_err, tol * max_ref) << "output error, max |reference| = " << max_ref;
  if (with_lse) {
    EXPECT_LE(max_lse_err, tol * max_lse_ref) << "lse error, max(1, max |lse|) = " << max_lse_ref;
  } else {
    EXPECT_TRUE(o.lse.all_equal(static_cast<Scalar>(kSentinel))) << "lse written when not asked";
  }
}

/// Compares two outputs of the same problem, head by head (so their layouts may differ),
/// normwise (Tolerances::kAttention): out relative to max |expected out|, lse relative to
/// max(1, max finite |expected lse|). Every output must be finite, and an infinite expected lse
/// (a row with no allowed key) must be matched exactly.
template <class Scalar>
void expect_same_outputs(const Outputs<Scalar>& actual, const Outputs<Scalar>& expected,
                         const std::string& what) {
  const double tol = Tolerances<Scalar>::kAttention;
  ASSERT_EQ(actual.out.view().shape(), expected.out.view().shape()) << what;
  double max_ref = 0.0;
  double max_diff = 0.0;
  double max_lse = 1.0;
  for (Index b = 0; b < expected.out.batch(); ++b) {
    for (Index h = 0; h < expected.out.heads(); ++h) {
      const apex_test::MatrixD a = actual.out.head(b, h);
      const apex_test::MatrixD r = expected.out.head(b, h);
      ASSERT_TRUE(a.allFinite()) << what << ": non-finite output in head (" << b << ", " << h
                                 << ")";
      ASSERT_TRUE(r.allFinite()) << what << ": non-finite expected output in head (" << b << ", "
                                 << h << ")";
      max_ref = std::max(max_ref, r.cwiseAbs().maxCoeff());
      max_diff = std::max(max_diff, (a - r).cwiseAbs().maxCoeff());
      const apex_test::MatrixD lse = expected.lse.head(b, h);
      for (Index i = 0; i < lse.rows(); ++i) {
        if (std::isfinite(lse(i, 0))) max_lse = std::max(max_lse, std::abs(lse(i, 0)));
      }
    }
  }
  EXPECT_LE(max_diff, tol * max_ref) << what << ": max |expected| = " << max_ref;
  for (Index b = 0; b < expected.lse.batch(); ++b) {
    for (Index h = 0; h < expected.lse.heads(); ++h) {
      const apex_test::MatrixD a = actual.lse.head(b, h);
      const apex_test::MatrixD r = expected.lse.head(b, h);
      for (Index i = 0; i < r.rows(); ++i) {
        if (!std::isfinite(r(i, 0))) {
          ASSERT_EQ(a(i, 0), r(i, 0))
              << what << ": lse of head (" << b << ", " << h << "), row " << i;
        } else {
          ASSERT_NEAR(a(i, 0), r(i, 0), tol * max_lse)
              << what << ": lse of head (" << b << ", " << h << "), row " << i;
        }
      }
    }
  }
}

}  // namespace apex::testing
