// SPDX-License-Identifier: MIT
// apex::sdpa_backward: the plain backward loop (reference/attention_backward.hpp) against central
// finite differences of the plain forward loop; the tiled backward against the plain loop on
// random problems with every score term and mask kind, GQA, d_v != d_qk and blocks that do not
// divide S; bit-identical results for 1–4 threads; the scratch bound; storage types; bad input.
#include <apex/sdpa_backward.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_case.hpp"
#include "finite_differences.hpp"
#include "guarded_buffer.hpp"
#include "reference/attention_backward.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace sdpa_backward_test {
namespace {

using apex::AttentionMask;
using apex::HeadsView;
using apex::Index;
using apex::RowMatrix;
using apex::SdpaGradients;
using apex::SdpaParams;
using apex::testing::expect_matches_differences;
using apex::testing::Heads;
using apex::testing::Layout;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Tolerances;
using apex_test::MatrixD;

// ---- the plain loop against finite differences ----

/// L = Σ d_out ∘ attention(...).out, the loss whose gradient by out is d_out.
double loss(const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD* bias, double scale,
            double softcap, double sink, const MatrixD& d_out,
            const std::function<bool(Index, Index)>& allowed) {
  return (apex_test::attention(q, k, v, allowed, bias, scale, softcap, sink).out.array() *
          d_out.array())
      .sum();
}

TEST(SdpaBackwardReference, MatchesFiniteDifferencesOfTheForwardLoop) {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto random = [&](Index rows, Index cols) {
    MatrixD m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
    return m;
  };
  const Index s_q = 5, s_k = 7, d_qk = 4, d_v = 3;
  MatrixD q = random(s_q, d_qk), k = random(s_k, d_qk), v = random(s_k, d_v);
  MatrixD bias = random(s_q, s_k), d_out = random(s_q, d_v);
  MatrixD sink(1, 1);
  sink(0, 0) = 0.3;
  const double scale = 0.6, softcap = 2.5;
  // Causal with the queries last, and one pair forbidden by hand: row 0 sees keys 0–2 only.
  const auto allowed = [](Index i, Index j) { return j <= i + 2 && !(i == 3 && j == 1); };
  const apex_test::AttentionGradients g =
      apex_test::attention_backward(q, k, v, allowed, &bias, scale, softcap, sink(0, 0), d_out);
  const auto f = [&] { return loss(q, k, v, &bias, scale, softcap, sink(0, 0), d_out, allowed); };
  expect_matches_differences(q, g.dq, f, "dq");
  expect_matches_differences(k, g.dk, f, "dk");
  expect_matches_differences(v, g.dv, f, "dv");
  expect_matches_differences(bias, g.d_bias, f, "d_bias");
  MatrixD d_sink(1, 1);
  d_sink(0, 0) = g.d_sink;
  expect_matches_differences(sink, d_sink, f, "d_sink");
  EXPECT_EQ(g.d_bias(3, 1), 0.0) << "a forbidden pair has no gradient";
}

// ---- the tiled backward against the plain loop ----

/// The gradients of a problem, in Scalar, filled with a sentinel before the call.
template <class Scalar>
struct Gradients {
  Gradients(const Problem<Scalar>& p, bool with_bias, bool with_sinks)
      : dq(p.shape.batch, p.shape.q_heads, p.shape.s_q, p.shape.d_qk),
        dk(p.shape.batch, p.shape.kv_heads, p.shape.s_k, p.shape.d_qk),
        dv(p.shape.batch, p.shape.kv_heads, p.shape.s_k, p.shape.d_v),
        d_bias(with_bias ? p.bias_batch : 0, with_bias ? p.bias_heads : 0, p.shape.s_q,
               p.shape.s_k) {
    for (auto* g : {&dq, &dk, &dv, &d_bias}) g->fill(static_cast<Scalar>(kSentinelValue));
    if (with_sinks) d_sinks.assign(3, kSentinelValue);  // resized by the call
    with_sinks_ = with_sinks;
  }
  SdpaGradients<Scalar> view() {
    return {dq.view(), dk.view(), dv.view(),
            d_bias.size() > 0 ? d_bias.view() : HeadsView<Scalar>(),
            with_sinks_ ? &d_sinks : nullptr};
  }
  static constexpr double kSentinelValue = 12345.0;
  Heads<Scalar> dq, dk, dv, d_bias;
  std::vector<double> d_sinks;
  bool with_sinks_ = false;
};

/// Runs apex::sdpa, then the backward with the given blocking, for d_out drawn from `seed`.
template <class Scalar, class Rules = apex::NoRules>
void run_backward(const Problem<Scalar>& p, const Heads<Scalar>& d_out, Gradients<Scalar>& g,
                  const apex::detail::BackwardBlocking& blocking = {}, const Rules& rules = {}) {
  apex::testing::Outputs<Scalar> o(p.shape);
  const AttentionMask<Scalar> mask = p.attention_mask();
  apex::sdpa(p.q.view(), p.k.view(), p.v.view(), mask, p.params, rules, o.out.view(), o.lse.view());
  apex::detail::sdpa_backward<Scalar, Scalar, Scalar, Scalar, Scalar, Scalar, Scalar, Scalar>(
      p.q.view(), p.k.view(), p.v.view(), mask, p.params, o.out.view(), o.lse.view(), d_out.view(),
      g.view(), blocking, rules);
}

/// The plain loop's gradients of every head, dk and dv summed over each group (§8.2), d_bias over
/// the (b, h) its broadcast view maps to each slice, d_sinks over the batch.
struct Expected {
  std::vector<MatrixD> dq, dk, dv, d_bias;  // [b·H + h] each
  std::vector<double> d_sinks;
};

template <class Scalar>
Expected expected_gradients(const Problem<Scalar>& p, const Heads<Scalar>& d_out) {
  const Shape& s = p.shape;
  Expected e;
  e.dk.assign(std::size_t(s.batch * s.kv_heads), MatrixD::Zero(s.s_k, s.d_qk));
  e.dv.assign(std::size_t(s.batch * s.kv_heads), MatrixD::Zero(s.s_k, s.d_v));
  const Index slices = std::max<Index>(1, p.bias_batch * p.bias_heads);
  e.d_bias.assign(std::size_t(slices), MatrixD::Zero(s.s_q, s.s_k));
  e.d_sinks.assign(std::size_t(s.q_heads), 0.0);
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.q_heads; ++h) {
      const Index kv = apex_test::kv_head_of(h, s.q_heads, s.kv_heads);
      const auto t = p.head_terms(b, h);
      const apex_test::AttentionGradients g = apex_test::attention_backward(
          p.q.head(b, h), p.k.head(b, kv), p.v.head(b, kv),
          [&](Index i, Index j) { return p.allows(b, h, i, j); }, t.bias ? &*t.bias : nullptr,
          t.scale, p.params.softcap, t.sink, d_out.head(b, h));
      e.dq.push_back(g.dq);
      e.dk[std::size_t(b * s.kv_heads + kv)] += g.dk;
      e.dv[std::size_t(b * s.kv_heads + kv)] += g.dv;
      if (p.bias_batch > 0) {
        const Index slice =
            (p.bias_batch == 1 ? 0 : b) * p.bias_heads + (p.bias_heads == 1 ? 0 : h);
        e.d_bias[std::size_t(slice)] += g.d_bias;
      }
      e.d_sinks[std::size_t(h)] += g.d_sink;
    }
  }
  return e;
}

/// max |actual − expected| <= tol · max(1, max |expected|) over every head of one gradient. The
/// inputs are O(1) (drawn from N(0, 1)), so a gradient much smaller than 1 comes from cancellation
/// (ds = p(dp − D) with D from the rounded output) and carries the absolute error of the O(1)
/// terms it cancelled.
template <class T>
void expect_close(const Heads<T>& actual, const std::vector<MatrixD>& expected, double tol,
                  const std::string& what) {
  double max_ref = 1.0, max_err = 0.0;
  for (Index b = 0; b < actual.batch(); ++b) {
    for (Index h = 0; h < actual.heads(); ++h) {
      const MatrixD& r = expected[std::size_t(b * actual.heads() + h)];
      const MatrixD a = actual.head(b, h);
      ASSERT_TRUE(a.allFinite()) << what << ": not finite in head (" << b << ", " << h << ")";
      max_ref = std::max(max_ref, r.cwiseAbs().maxCoeff());
      max_err = std::max(max_err, (a - r).cwiseAbs().maxCoeff());
    }
  }
  EXPECT_LE(max_err, tol * max_ref) << what << ": max |expected| = " << max_ref;
}

template <class Scalar>
void expect_matches_loops(const Problem<Scalar>& p, const Heads<Scalar>& d_out,
                          const Gradients<Scalar>& g, const std::string& what) {
  const double tol = Tolerances<Scalar>::kBackward;
  const Expected e = expected_gradients(p, d_out);
  expect_close(g.dq, e.dq, tol, what + " dq");
  expect_close(g.dk, e.dk, tol, what + " dk");
  expect_close(g.dv, e.dv, tol, what + " dv");
  if (g.d_bias.size() > 0) expect_close(g.d_bias, e.d_bias, tol, what + " d_bias");
  if (!g.d_sinks.empty()) {
    ASSERT_EQ(g.d_sinks.size(), e.d_sinks.size()) << what;
    double max_ref = 1.0;
    for (const double x : e.d_sinks) max_ref = std::max(max_ref, std::abs(x));
    for (std::size_t h = 0; h < e.d_sinks.size(); ++h) {
      EXPECT_NEAR(g.d_sinks[h], e.d_sinks[h], tol * max_ref) << what << " d_sinks[" << h << "]";
    }
  }
}

/// One random case: a shape, a rule and the terms, by name.
struct Case {
  std::string name;
  Shape shape;
  apex_test::MaskRule rule;
  std::optional<Index> query_offset;
  Index key_offset = 0;
  double dense_mask = 0.0;  // probability of true in a dense mask [1, H_q, ...]; 0: none
  double bias = -1.0;       // fraction of -inf in a bias [B, 1, ...]; < 0: none
  double softcap = 0.0;
  bool alibi = false;
  bool sinks = false;
};

std::vector<Case> cases() {
  static const std::vector<Index> documents = {0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
                                               3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5};
  std::vector<Case> c;
  c.push_back({"full", {2, 4, 2, 13, 17, 8, 8}, {}, std::nullopt, 0});
  c.push_back({"causal_gqa_dv", {1, 6, 2, 19, 19, 8, 5}, {true}, std::nullopt, 0});
  c.push_back({"causal_short_queries", {2, 2, 1, 5, 23, 7, 6}, {true}, std::nullopt, 0});
  c.push_back({"window_prefix", {1, 4, 4, 21, 21, 6, 6}, {true, 5, 4}, std::nullopt, 0});
  c.push_back({"chunks_offsets", {1, 3, 1, 11, 17, 5, 7}, {true, 0, 0, 6}, Index{9}, 3});
  Case docs{"documents", {1, 2, 1, 30, 30, 6, 6}, {true}, std::nullopt, 0};
  docs.rule.documents = &documents;
  c.push_back(docs);
  c.push_back({"dense_mask_bias", {2, 4, 2, 9, 14, 6, 6}, {}, std::nullopt, 0, 0.6, 0.1});
  c.push_back({"softcap_alibi_sinks",
               {1, 4, 2, 16, 16, 8, 8},
               {true},
               std::nullopt,
               0,
               0.0,
               -1.0,
               1.5,
               true,
               true});
  c.push_back({"everything",
               {2, 4, 1, 12, 15, 5, 4},
               {true, 7},
               std::nullopt,
               0,
               0.7,
               0.05,
               2.0,
               true,
               true});
  // Rows with no key at all: S_q > S_k under bottom-right alignment, and a sparse mask.
  c.push_back({"empty_rows", {1, 2, 2, 9, 4, 4, 4}, {true}, std::nullopt, 0, 0.3, 0.3});
  return c;
}

template <class Scalar>
Problem<Scalar> make_problem(const Case& c, std::uint32_t seed) {
  Problem<Scalar> p(c.shape, Layout::kContiguous, seed, apex::testing::Values::kNormal);
  p.rule = c.rule;
  p.query_offset = c.query_offset;
  p.key_offset = c.key_offset;
  if (c.dense_mask > 0.0) p.add_dense_mask(1, c.shape.q_heads, c.dense_mask);
  if (c.bias >= 0.0) p.add_bias(c.shape.batch, 1, c.bias);
  p.params.softcap = c.softcap;
  if (c.alibi) p.params.alibi_slopes = apex::alibi_slopes(c.shape.q_heads);
  if (c.sinks) {
    for (Index h = 0; h < c.shape.q_heads; ++h) p.params.sinks.push_back(0.25 * double(h) - 0.5);
  }
  return p;
}

template <class Scalar>
Heads<Scalar> random_d_out(const Shape& s, std::uint32_t seed) {
  Heads<Scalar> d_out(s.batch, s.q_heads, s.s_q, s.d_v);
  std::mt19937 rng(seed);
  d_out.randomize(rng, apex::testing::Values::kNormal);
  return d_out;
}

template <class Scalar>
class SdpaBackward : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SdpaBackward, Scalars, apex::testing::ScalarName);

TYPED_TEST(SdpaBackward, MatchesThePlainLoopOnEveryTermAndMask) {
  using Scalar = TypeParam;
  // Small blocks put block boundaries inside every problem (S not a multiple of any of them);
  // the default blocks give one block per problem.
  const apex::detail::BackwardBlocking blockings[] = {{8, 4}, {3, 5}, {}};
  std::uint32_t seed = 1;
  for (const Case& c : cases()) {
    for (const auto& blocking : blockings) {
      const Problem<Scalar> p = make_problem<Scalar>(c, seed);
      const Heads<Scalar> d_out = random_d_out<Scalar>(c.shape, seed + 100);
      Gradients<Scalar> g(p, c.bias >= 0.0, c.sinks);
      run_backward(p, d_out, g, blocking);
      expect_matches_loops(p, d_out, g,
                           c.name + " (blocks " + std::to_string(blocking.stacked_rows) + "/" +
                               std::to_string(blocking.key_block) + ")");
      ++seed;
    }
  }
}

TYPED_TEST(SdpaBackward, EmptySidesGiveZeroGradients) {
  using Scalar = TypeParam;
  for (const Shape& s : {Shape{1, 2, 1, 0, 5, 4, 3}, Shape{1, 2, 1, 4, 0, 4, 3}}) {
    Problem<Scalar> p(s, Layout::kContiguous, 3);
    const Heads<Scalar> d_out = random_d_out<Scalar>(s, 4);
    Gradients<Scalar> g(p, false, false);
    run_backward(p, d_out, g);
    EXPECT_TRUE(g.dq.all_equal(Scalar(0)) && g.dk.all_equal(Scalar(0)) && g.dv.all_equal(Scalar(0)))
        << apex::testing::describe(s);
  }
}

TYPED_TEST(SdpaBackward, MaskAndScoreRulesMatchTheirBuiltInTwins) {
  using Scalar = TypeParam;
  // A window of 5 as a user rule with an exact classifier, and the soft-cap as a score rule with
  // its derivative, against the plain loop of the built-in window and soft-cap.
  Case c{"rules", {1, 4, 2, 23, 23, 6, 6}, {true, 5}, std::nullopt, 0};
  c.softcap = 1.5;
  const Problem<Scalar> expected_problem = make_problem<Scalar>(c, 11);
  Problem<Scalar> p = make_problem<Scalar>(c, 11);
  p.rule = {};
  p.params.softcap = 0.0;
  const double cap = 1.5;
  const auto rules = apex::attention_rules(
      [](Index, Index, Index qp, Index kp) { return kp <= qp && qp - kp < 5; },
      [](Index, Index, apex::PositionRange q, apex::PositionRange k) {
        if (k.begin > q.end - 1 || k.end - 1 < q.begin - 4) return apex::BlockCoverage::kNone;
        return apex::BlockCoverage::kPartial;
      },
      apex::with_derivative(
          [cap](Index, Index, Index, Index, auto s) { return cap * std::tanh(s / cap); },
          [cap](Index, Index, Index, Index, auto s) {
            const auto t = std::tanh(s / cap);
            return 1 - t * t;
          }));
  const Heads<Scalar> d_out = random_d_out<Scalar>(c.shape, 12);
  Gradients<Scalar> g(p, false, false);
  run_backward(p, d_out, g, {8, 4}, rules);
  expect_matches_loops(expected_problem, d_out, g, "rules");
}

// ---- threads, scratch, storage types ----

TEST(SdpaBackwardThreads, BitIdenticalForOneToFourThreads) {
  Case c{"threads", {2, 4, 2, 70, 70, 16, 12}, {true, 0, 6}, std::nullopt, 0, 0.0, 0.0, 3.0, true,
         true};
  const Problem<float> p = make_problem<float>(c, 21);
  const Heads<float> d_out = random_d_out<float>(c.shape, 22);
  Gradients<float> first(p, true, true);
  run_backward(p, d_out, first, {16, 8});
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  for (int threads = 1; threads <= 4; ++threads) {
    omp_set_num_threads(threads);
    Gradients<float> g(p, true, true);
    run_backward(p, d_out, g, {16, 8});
    for (auto [a, b] : {std::pair{&g.dq, &first.dq},
                        {&g.dk, &first.dk},
                        {&g.dv, &first.dv},
                        {&g.d_bias, &first.d_bias}}) {
      EXPECT_TRUE(std::equal(a->data(), a->data() + a->size(), b->data())) << threads << " threads";
    }
    EXPECT_EQ(g.d_sinks, first.d_sinks) << threads << " threads";
  }
  omp_set_num_threads(saved);
#else
  GTEST_SKIP() << "built without OpenMP: one thread only";
#endif
}

TEST(SdpaBackwardScratch, StaysWithinTheDocumentedBound) {
  // d_qk = d_v = 64, G = 4: M = 256, Bk = 128; the bound of attention_backward.hpp, MEMORY, in
  // float, plus the alignment padding of its 14 buffers, the flag pages and the sinks' doubles.
  const Shape s{1, 8, 2, 600, 600, 64, 64};
  Case c{"scratch", s, {true}, std::nullopt, 0, 0.0, -1.0, 0.0, false, true};
  const Problem<float> p = make_problem<float>(c, 31);
  const Heads<float> d_out = random_d_out<float>(s, 32);
  Gradients<float> g(p, false, true);
  apex::release_scratch();
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  run_backward(p, d_out, g);
  const std::size_t used = apex::scratch_bytes();
#ifdef _OPENMP
  omp_set_num_threads(saved);
#endif
  const Index m = 256, n = 128, d = 64;
  const Index scalars = m * (2 * d + 2) + n * 2 * d + 5 * m * n + n + std::max(m, n) * d + n * d;
  const Index tasks = 2 * ((600 + 63) / 64);  // query tasks: 2 kv heads × ⌈600 / 64⌉ blocks
  // The forward (run_backward calls sdpa first) keeps its own slots: subtract what it holds.
  const std::size_t forward_bytes = [&] {
    apex::release_scratch();
    apex::testing::Outputs<float> o(s);
    apex::sdpa(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, o.out.view(),
               o.lse.view());
    return apex::scratch_bytes();
  }();
  const std::size_t bound = std::size_t(scalars) * sizeof(float) + 14 * 64 + 4096 +
                            std::size_t(tasks * 4) * sizeof(double);
  EXPECT_LE(used - forward_bytes, bound);
  EXPECT_GT(used - forward_bytes, std::size_t(scalars) * sizeof(float) / 2) << "bound too loose";
}

TEST(SdpaBackwardStorage, SixteenBitInputsAndGradients) {
  // Q in half, K and V in bfloat16, out, lse and d_out in float: the gradients in float match the
  // plain loop on the widened values, and in bfloat16 are those float gradients rounded once.
  Case c{"storage", {1, 4, 2, 20, 20, 8, 8}, {true}, std::nullopt, 0};
  Problem<float> p = make_problem<float>(c, 41);
  Heads<Eigen::half> q(1, 4, 20, 8);
  Heads<Eigen::bfloat16> k(1, 2, 20, 8), v(1, 2, 20, 8);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q.at(i) = Eigen::half(p.q.at(i));
    p.q.at(i) = float(q.at(i));
  }
  for (std::size_t i = 0; i < k.size(); ++i) {
    k.at(i) = Eigen::bfloat16(p.k.at(i));
    p.k.at(i) = float(k.at(i));
    v.at(i) = Eigen::bfloat16(p.v.at(i));
    p.v.at(i) = float(v.at(i));
  }
  const Heads<float> d_out = random_d_out<float>(c.shape, 42);
  apex::testing::Outputs<float> o(c.shape);
  const AttentionMask<float> mask = p.attention_mask();
  apex::sdpa(q.view(), k.view(), v.view(), mask, p.params, o.out.view(), o.lse.view());
  Gradients<float> g(p, false, false);
  apex::sdpa_backward(q.view(), k.view(), v.view(), mask, p.params, o.out.view(), o.lse.view(),
                      d_out.view(), g.view());
  expect_matches_loops(p, d_out, g, "16-bit inputs");
  Heads<Eigen::bfloat16> dq(1, 4, 20, 8), dk(1, 2, 20, 8), dv(1, 2, 20, 8);
  apex::sdpa_backward(q.view(), k.view(), v.view(), mask, p.params, o.out.view(), o.lse.view(),
                      d_out.view(),
                      SdpaGradients<Eigen::bfloat16>{dq.view(), dk.view(), dv.view()});
  for (auto [narrow, wide] : {std::pair{&dq, &g.dq}, {&dk, &g.dk}, {&dv, &g.dv}}) {
    for (std::size_t i = 0; i < narrow->size(); ++i) {
      ASSERT_EQ(narrow->at(i), Eigen::bfloat16(wide->at(i))) << "element " << i;
    }
  }
}

TEST(SdpaBackwardOverflow, FloatScoresThatOverflowAreComputedInDouble) {
  // Scores of 1e40 overflow float; the soft-cap brings the logits back. The float call must give
  // the double answer rounded, as the forward does.
  Case c{"overflow", {1, 2, 1, 6, 6, 4, 4}, {true}, std::nullopt, 0};
  c.softcap = 20.0;
  Problem<float> p = make_problem<float>(c, 51);
  p.q.at(0) = 1e20f;
  p.k.at(0) = 1e20f;
  p.params.scale = 1e-30;  // x = 1e10 for the pair (0, 0): finite in float only once scaled
  const Heads<float> d_out = random_d_out<float>(c.shape, 52);
  Gradients<float> g(p, false, false);
  run_backward(p, d_out, g);
  expect_matches_loops(p, d_out, g, "overflow");
}

// ---- block skipping ----

TEST(SdpaBackwardSkipping, ForbiddenKeysAreNeverRead) {
  // K and V in guarded memory whose keys before the first query's window are unreadable: the
  // backward pass must complete, and equal the loops. The window as the PositionMask, and as a
  // user rule whose classifier says kNone for the blocks before it.
  const Index s_k = 3000, s_q = 60, d = 32;
  for (const bool user_rule : {false, true}) {
    SCOPED_TRACE(user_rule ? "user rule" : "PositionMask");
    const Shape shape{1, 4, 1, s_q, s_k, d, d};
    Problem<double> p(shape, Layout::kContiguous, 81, apex::testing::Values::kNormal);
    p.rule = {true, 400};
    apex::testing::GuardedBuffer<double> k(std::size_t(s_k * d)), v(std::size_t(s_k * d));
    std::copy(p.k.data(), p.k.data() + s_k * d, k.data());
    std::copy(p.v.data(), p.v.data() + s_k * d, v.data());
    // A user rule narrows no key range, so the kernels read whole blocks its classifier calls
    // partial: only the keys of blocks (of up to 512 keys) that it calls kNone are forbidden.
    const Index first_visible = s_k - s_q - 399;
    const Index unread = user_rule ? first_visible / 512 * 512 : first_visible;
    ASSERT_GT(k.forbid(0, std::size_t(unread * d)), 0U);
    ASSERT_GT(v.forbid(0, std::size_t(unread * d)), 0U);
    const auto k_view = HeadsView<const double>::contiguous(k.data(), {1, 1, s_k, d});
    const auto v_view = HeadsView<const double>::contiguous(v.data(), {1, 1, s_k, d});
    const Heads<double> d_out = random_d_out<double>(shape, 82);
    apex::testing::Outputs<double> o(shape);
    AttentionMask<double> mask = p.attention_mask();
    const auto window =
        apex::mask_rule([](Index, Index, Index qp, Index kp) { return kp <= qp && qp - kp < 400; },
                        [](Index, Index, apex::PositionRange q, apex::PositionRange kr) {
                          const bool none = kr.end - 1 < q.begin - 399 || kr.begin > q.end - 1;
                          return none ? apex::BlockCoverage::kNone : apex::BlockCoverage::kPartial;
                        });
    if (user_rule) mask.positions = apex::PositionMask{};
    apex::sdpa(p.q.view(), k_view, v_view, mask, p.params, window, o.out.view(), o.lse.view());
    Gradients<double> g(p, false, false);
    const apex::detail::BackwardBlocking blocking{64, 32};
    using D = double;
    if (user_rule) {
      apex::detail::sdpa_backward<D, D, D, D, D, D, D, D>(p.q.view(), k_view, v_view, mask,
                                                          p.params, o.out.view(), o.lse.view(),
                                                          d_out.view(), g.view(), blocking, window);
    } else {
      apex::detail::sdpa_backward<D, D, D, D, D, D, D, D>(p.q.view(), k_view, v_view, mask,
                                                          p.params, o.out.view(), o.lse.view(),
                                                          d_out.view(), g.view(), blocking);
    }
    expect_matches_loops(p, d_out, g, "guarded");
  }
}

// ---- ragged batches ----

TEST(SdpaVarlenBackward, EachSequenceAsSdpaBackwardAlone) {
  // Three sequences (one without queries), GQA, sinks, causal with a window: the packed call
  // equals one sdpa_backward per sequence bit for bit, and d_sinks is their sum.
  const std::vector<Index> q_lengths = {7, 0, 12}, k_lengths = {9, 5, 12};
  const apex::RaggedBatch batch = apex::RaggedBatch::from_lengths(q_lengths, k_lengths);
  const Index total_q = 19, total_k = 26;
  Heads<float> q(1, 4, total_q, 8), k(1, 2, total_k, 8), v(1, 2, total_k, 6);
  std::mt19937 rng(71);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  Heads<float> out(1, 4, total_q, 6), lse(1, 4, total_q, 1), d_out(1, 4, total_q, 6);
  d_out.randomize(rng);
  apex::PositionMask rule = apex::causal_mask();
  rule.window = 4;
  SdpaParams params;
  params.sinks = {0.1, -0.3, 0.2, 0.0};
  apex::sdpa_varlen(q.view(), k.view(), v.view(), batch, {rule}, params, out.view(), lse.view());
  Heads<float> dq(1, 4, total_q, 8), dk(1, 2, total_k, 8), dv(1, 2, total_k, 6);
  dk.fill(7.0f);
  std::vector<double> d_sinks;
  apex::sdpa_varlen_backward(q.view(), k.view(), v.view(), batch, {rule}, params, out.view(),
                             lse.view(), d_out.view(),
                             SdpaGradients<float>{dq.view(), dk.view(), dv.view(), {}, &d_sinks});
  std::vector<double> expected_sinks(4, 0.0);
  for (std::size_t i = 0; i < 3; ++i) {
    const Index q0 = batch.cu_seqlens_q[i], nq = q_lengths[i];
    const Index k0 = batch.cu_seqlens_k[i], nk = k_lengths[i];
    const auto rows = [](const auto& view, Index first, Index count) {
      return view.middle_rows(first, count);
    };
    Heads<float> sq(1, 4, nq, 8), sk(1, 2, nk, 8), sv(1, 2, nk, 6);
    std::vector<double> s_sinks;
    apex::AttentionMask<float> mask;
    mask.positions = rule;
    apex::sdpa_backward(rows(q.view(), q0, nq), rows(k.view(), k0, nk), rows(v.view(), k0, nk),
                        mask, params, rows(out.view(), q0, nq), rows(lse.view(), q0, nq),
                        rows(d_out.view(), q0, nq),
                        SdpaGradients<float>{sq.view(), sk.view(), sv.view(), {}, &s_sinks});
    for (Index h = 0; h < 4; ++h) {
      EXPECT_EQ(RowMatrix<float>(dq.view().head(0, h).middleRows(q0, nq)),
                RowMatrix<float>(sq.view().head(0, h)))
          << "sequence " << i;
    }
    for (Index h = 0; h < 2; ++h) {
      EXPECT_EQ(RowMatrix<float>(dk.view().head(0, h).middleRows(k0, nk)),
                RowMatrix<float>(sk.view().head(0, h)))
          << "sequence " << i;
      EXPECT_EQ(RowMatrix<float>(dv.view().head(0, h).middleRows(k0, nk)),
                RowMatrix<float>(sv.view().head(0, h)))
          << "sequence " << i;
    }
    for (std::size_t h = 0; h < 4; ++h) expected_sinks[h] += s_sinks[h];
  }
  EXPECT_EQ(d_sinks, expected_sinks);
  EXPECT_TRUE(RowMatrix<float>(dk.view().head(0, 1).middleRows(9, 5)).isZero(0.0))
      << "the keys of a sequence without queries have no gradient";
  // A bad offset list is refused before anything is written.
  dq.fill(3.0f);
  const apex::RaggedBatch bad = apex::RaggedBatch::from_lengths({7, 0, 11}, k_lengths);
  EXPECT_THROW(apex::sdpa_varlen_backward(q.view(), k.view(), v.view(), bad, {rule}, params,
                                          out.view(), lse.view(), d_out.view(),
                                          SdpaGradients<float>{dq.view(), dk.view(), dv.view()}),
               std::invalid_argument);
  EXPECT_TRUE(dq.all_equal(3.0f));
}

// ---- bad input ---------------------------------------------------------------------------------

TEST(SdpaBackwardErrors, BadShapesThrowAndWriteNothing) {
  Case c{"errors", {1, 4, 2, 6, 7, 4, 3}, {true}, std::nullopt, 0};
  const Problem<float> p = make_problem<float>(c, 61);
  const Heads<float> d_out = random_d_out<float>(c.shape, 62);
  apex::testing::Outputs<float> o(c.shape);
  const AttentionMask<float> mask = p.attention_mask();
  apex::sdpa(p.q.view(), p.k.view(), p.v.view(), mask, p.params, o.out.view(), o.lse.view());
  Gradients<float> g(p, false, false);
  Heads<float> wrong(1, 4, 6, 5);
  const auto untouched = [&] {
    return g.dq.all_equal(12345.0f) && g.dk.all_equal(12345.0f) && g.dv.all_equal(12345.0f);
  };
  const auto expect_throw = [&](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no throw; expected a message with '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(untouched()) << needle;
  };
  const auto call = [&](const SdpaGradients<float>& grads, const HeadsView<const float>& lse,
                        const HeadsView<const float>& dout, const SdpaParams& params) {
    apex::sdpa_backward(p.q.view(), p.k.view(), p.v.view(), mask, params, o.out.view(), lse, dout,
                        grads);
  };
  auto grads = g.view();
  grads.dq = wrong.view();
  expect_throw([&] { call(grads, o.lse.view(), d_out.view(), p.params); }, "dq shape");
  expect_throw([&] { call(g.view(), o.lse.view(), wrong.view(), p.params); }, "d_out shape");
  expect_throw([&] { call(g.view(), HeadsView<const float>(), d_out.view(), p.params); }, "lse");
  std::vector<double> d_sinks;
  grads = g.view();
  grads.d_sinks = &d_sinks;
  expect_throw([&] { call(grads, o.lse.view(), d_out.view(), p.params); }, "d_sinks");
  EXPECT_TRUE(d_sinks.empty());
  Heads<float> d_bias(1, 4, 6, 6);
  grads = g.view();
  grads.d_bias = d_bias.view();
  expect_throw([&] { call(grads, o.lse.view(), d_out.view(), p.params); }, "d_bias");
  grads = g.view();
  grads.dv = HeadsView<float>::contiguous(g.dk.data(), {1, 2, 7, 3});
  expect_throw([&] { call(grads, o.lse.view(), d_out.view(), p.params); }, "share memory");
  // dv written over v itself.
  const HeadsView<float> v_memory =
      HeadsView<float>::contiguous(const_cast<float*>(p.v.view().head(0, 0).data()), {1, 2, 7, 3});
  expect_throw(
      [&] {
        apex::sdpa_backward(p.q.view(), p.k.view(), p.v.view(), mask, p.params, o.out.view(),
                            o.lse.view(), d_out.view(),
                            SdpaGradients<float>{g.dq.view(), g.dk.view(), v_memory});
      },
      "shares memory with an input");
  SdpaParams bad = p.params;
  bad.softcap = -1.0;
  expect_throw([&] { call(g.view(), o.lse.view(), d_out.view(), bad); }, "softcap");
}

}  // namespace
}  // namespace sdpa_backward_test
