// SPDX-License-Identifier: MIT
// The rules of apex::sdpa beyond causal, window and prefix: attention sinks, ALiBi, chunked local
// attention and document masks. On random inputs each must equal
//   - the plain loops of reference/attention.hpp, given the rule as their own per-pair test
//     (apex_test::rule_allows), ALiBi as a dense bias and the sink as an extra score, and
//   - apex::reference::sdpa,
// on every path of the tiled kernel (the default blocks, small blocks, Eigen's GEMM kernel
// everywhere, the streaming kernel everywhere, split-key decoding), for group sizes {1, 4, 16},
// lengths that fill no block, float and double. Besides:
//   - a sink is the "extra logit column": attention over one more key whose score is the sink
//     and whose value is zero;
//   - partial results merged with the sink count it once;
//   - blocks a rule forbids are never read: the keys and values they hold sit in memory the
//     process cannot read (mmap with PROT_NONE), and the kernel completes;
//   - the result does not depend on the number of threads;
//   - a user classifier that lies (kNone or kAll where allows() disagrees): verify_classifier
//     names the rectangle, the answer and a pair that refutes it, and its output is that of the
//     rule without classifier, bit for bit; unchecked, the output is that of the rule the
//     answers imply (attention_rules.hpp, A CLASSIFIER THAT LIES);
//   - bad sinks, slopes, chunk sizes and document ids are rejected before anything is written.
#include <apex/detail/flash_attention.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
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
#include "guarded_buffer.hpp"
#include "kernel_paths.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace sdpa_rules_test {
namespace {

using apex::Index;
using apex::RowMatrix;
using apex::Vector;
using apex::detail::FlashBlocking;
using apex::testing::expect_matches_loops;
using apex::testing::expect_same_outputs;
using apex::testing::GuardedBuffer;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Values;
using apex_test::MaskRule;

template <class Scalar>
class SdpaRules : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SdpaRules, Scalars, apex::testing::ScalarName);

/// The paths of the tiled kernel, each named.
std::vector<std::pair<const char*, FlashBlocking>> paths() { return apex::testing::kernel_paths(); }

/// Document ids of `length` positions: documents of random lengths in [1, longest].
std::vector<Index> random_documents(Index length, Index longest, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<Index> size(1, longest);
  std::vector<Index> ids;
  Index id = 0;
  while (static_cast<Index>(ids.size()) < length) {
    const Index n = size(rng);
    for (Index i = 0; i < n && static_cast<Index>(ids.size()) < length; ++i) ids.push_back(id);
    id += 3;  // ids need not be consecutive, only non-decreasing
  }
  return ids;
}

/// Random values for the H_q heads, uniform in [lo, hi).
std::vector<double> random_heads(Index heads, double lo, double hi, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(lo, hi);
  std::vector<double> values(static_cast<std::size_t>(heads));
  for (double& v : values) v = uniform(rng);
  return values;
}

/// One rule of the table: a position rule (documents built for the case's length), ALiBi
/// slopes, sinks, soft-capping.
struct Rule {
  const char* name;
  MaskRule rule;
  Index longest_document = 0;  ///< 0: no documents; else documents of up to this many tokens
  bool alibi = false;
  bool sinks = false;
  double softcap = 0.0;
};

std::vector<Rule> rules() {
  // clang-format off
  return {
    //  name                     causal  W    P  chunk       docs  alibi  sinks  cap
    {"chunk_13",               {true,    0,   0, 13},          0, false, false, 0.0},
    {"chunk_64_window_40",     {true,   40,   0, 64},          0, false, false, 0.0},
    {"chunk_prefix",           {true,    0,  20, 16},          0, false, false, 0.0},
    {"documents_causal",       {true,    0,   0,  0},         60, false, false, 0.0},
    {"documents_bidirectional",{false,   0,   0,  0},         60, false, false, 0.0},
    {"documents_window",       {true,   17,   0,  0},         90, false, false, 2.0},
    {"alibi_causal",           {true,    0,   0,  0},          0, true,  false, 0.0},
    {"alibi_window_softcap",   {true,   30,   0,  0},          0, true,  false, 3.0},
    {"alibi_bidirectional",    {false,   0,   0,  0},          0, true,  false, 0.0},
    {"sinks_causal",           {true,    0,   0,  0},          0, false, true,  0.0},
    {"sinks_none",             {false,   0,   0,  0},          0, false, true,  0.0},
    {"everything",             {true,   50,   8, 32},         70, true,  true,  2.5},
  };
  // clang-format on
}

/// A problem with the rule applied (its document ids live in `ids`, which must outlive it).
template <class Scalar>
Problem<Scalar> make_problem(const Rule& r, const Shape& shape, std::uint32_t seed,
                             std::vector<Index>& ids) {
  Problem<Scalar> p(shape, Layout::kTokenMajor, seed, Values::kNormal);
  p.rule = r.rule;
  if (r.longest_document > 0) {
    ids = random_documents(shape.s_k, r.longest_document, seed);
    p.rule.documents = &ids;
  }
  if (r.alibi) p.params.alibi_slopes = apex::alibi_slopes(shape.q_heads);
  if (r.sinks) p.params.sinks = random_heads(shape.q_heads, -1.0, 3.0, seed + 1);
  p.params.softcap = r.softcap;
  return p;
}

template <class Scalar>
void check_rule(const Rule& r, const Shape& shape, std::uint32_t seed,
                const FlashBlocking& blocking) {
  std::vector<Index> ids;
  const Problem<Scalar> p = make_problem<Scalar>(r, shape, seed, ids);
  Outputs<Scalar> fast(shape, Layout::kTokenMajor);
  Outputs<Scalar> ref(shape, Layout::kTokenMajor);
  apex::detail::flash_sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                                   fast.out.view(), fast.lse.view(), {}, blocking);
  apex::reference::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                                ref.out.view(), ref.lse.view());
  expect_same_outputs(fast, ref, r.name);
  expect_matches_loops(p, fast, /*with_lse=*/true);
}

// Every rule, every path, G ∈ {1, 4, 16}, S = 100 (no multiple of any block), self-attention.
TYPED_TEST(SdpaRules, EachRuleEqualsTheLoopsOnEveryPath) {
  std::uint32_t seed = 1000;
  for (const Rule& r : rules()) {
    for (const Index group : {Index{1}, Index{4}, Index{16}}) {
      const Shape shape{1, group, 1, 100, 100, 24, 16};
      for (const auto& [path, blocking] : paths()) {
        SCOPED_TRACE(std::string(r.name) + ", G = " + std::to_string(group) + ", " + path);
        check_rule<TypeParam>(r, shape, ++seed, blocking);
      }
    }
  }
}

// Decoding: S_q ∈ {1, 3} new queries against 1300 keys, GQA 8 / 2, split over key chunks and
// merged (the sink joins once, at the merge).
TYPED_TEST(SdpaRules, EachRuleEqualsTheLoopsWhenDecoding) {
  std::uint32_t seed = 2000;
  for (const Rule& r : rules()) {
    if (!r.rule.causal) continue;  // decoding is causal
    for (const Index s_q : {Index{1}, Index{3}}) {
      const Shape shape{1, 8, 2, s_q, 1300, 32, 32};
      for (const auto& [path, blocking] : paths()) {
        SCOPED_TRACE(std::string(r.name) + ", S_q = " + std::to_string(s_q) + ", " + path);
        check_rule<TypeParam>(r, shape, ++seed, blocking);
      }
    }
  }
}

// The split-key plan cuts only the keys a window can see: a window of 300 over 20000 keys is
// split over its window (each chunk does work) and equals the loops.
TYPED_TEST(SdpaRules, DecodingAWindowSplitsOnlyTheWindow) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 1, 1, 20000, 16, 16};
  Problem<Scalar> p(shape, Layout::kContiguous, 77, Values::kNormal);
  p.rule = {true, 300, 0};
  FlashBlocking blocking;
  blocking.decode_chunk = 64;
  apex::detail::AttentionProblem<Scalar, Scalar, Scalar, Scalar> problem;
  const apex::detail::KeySegment<Scalar, Scalar> keys{p.k.view(), p.v.view(), 0};
  problem.q = p.q.view();
  problem.segments = &keys;
  problem.num_segments = 1;
  problem.positions = p.attention_mask().positions;
  problem.first_query = shape.s_k - 1;
  problem.group = 4;
  problem.s_q = 1;
  problem.s_k = shape.s_k;
  problem.d_qk = problem.d_v = 16;
  const apex::detail::AttentionPlan plan = apex::detail::plan_attention(problem, 1, blocking);
  EXPECT_TRUE(plan.split);
  EXPECT_EQ(plan.first_key, shape.s_k - 300);
  EXPECT_LE(plan.chunk * plan.chunks, 300 + plan.chunk);
  Outputs<Scalar> fast(shape);
  apex::detail::flash_sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                                   fast.out.view(), fast.lse.view(), {}, blocking);
  expect_matches_loops(p, fast, /*with_lse=*/true);
}

// ---- sinks
// ---------------------------------------------------------------------------------------

// The sink is one more logit of zero value: attention with sinks equals attention over one more
// key, allowed for every query, with k = 0, v = 0 and a bias equal to the head's sink. The
// extra key makes the position rule a dense mask here.
TYPED_TEST(SdpaRules, SinkEqualsAnExtraLogitColumn) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 2, 70, 90, 16, 12};
  std::vector<Index> unused;
  const Rule r{"sinks", {true, 25, 0}, 0, false, true, 0.0};
  Problem<Scalar> p = make_problem<Scalar>(r, shape, 5, unused);
  // The column stores the sinks as Scalar: give sdpa the same rounded values.
  for (double& s : p.params.sinks) s = static_cast<double>(static_cast<Scalar>(s));
  const Shape wide{1, 4, 2, 70, 91, 16, 12};
  Problem<Scalar> column(wide, Layout::kContiguous, 6);
  for (Index h = 0; h < 2; ++h) {
    column.k.head_map(0, h).setZero();
    column.v.head_map(0, h).setZero();
    column.k.head_map(0, h).topRows(90) = p.k.view().head(0, h);
    column.v.head_map(0, h).topRows(90) = p.v.view().head(0, h);
  }
  for (Index h = 0; h < 4; ++h) column.q.head_map(0, h) = p.q.view().head(0, h);
  column.add_dense_mask(1, 4, 1.0);
  column.add_bias(1, 4, 0.0);
  for (Index h = 0; h < 4; ++h) {
    column.bias_rows(0, h).setZero();
    for (Index i = 0; i < 70; ++i) {
      for (Index j = 0; j < 90; ++j) {
        column.allowed_rows(0, h)(i, j) = apex_test::rule_allows(p.rule, 20 + i, j);
      }
      column.bias_rows(0, h)(i, 90) = static_cast<Scalar>(p.params.sinks[std::size_t(h)]);
    }
  }
  Outputs<Scalar> with_sinks(shape, Layout::kTokenMajor);
  Outputs<Scalar> with_column(wide, Layout::kContiguous);
  apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                     with_sinks.out.view(), with_sinks.lse.view());
  apex::reference::sdpa<Scalar>(column.q.view(), column.k.view(), column.v.view(),
                                column.attention_mask(), column.params, with_column.out.view(),
                                with_column.lse.view());
  expect_same_outputs(with_sinks, with_column, "sink against an extra logit column");
}

// A row in which no key takes part gives zeros, and its lse is the sink (the denominator is
// e^sink alone); on the decoding path too.
TYPED_TEST(SdpaRules, FullyMaskedRowsWithASinkGiveZeros) {
  using Scalar = TypeParam;
  for (const Index s_k : {Index{40}, Index{3000}}) {
    const Shape shape{1, 2, 1, 4, s_k, 16, 8};
    Problem<Scalar> p(shape, Layout::kContiguous, 9, Values::kNormal);
    p.rule = {true, 0, 0};
    p.query_offset = 0;
    p.key_offset = 10;  // every key after every query
    p.params.sinks = {0.75, -2.0};
    Outputs<Scalar> o(shape);
    o.fill(Scalar(7));
    apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                       o.out.view(), o.lse.view());
    for (std::size_t i = 0; i < o.out.size(); ++i) ASSERT_EQ(o.out.at(i), Scalar(0));
    for (Index h = 0; h < 2; ++h) {
      for (Index i = 0; i < 4; ++i) {
        EXPECT_EQ(o.lse.view().head(0, h)(i, 0),
                  static_cast<Scalar>(p.params.sinks[std::size_t(h)]));
      }
    }
  }
}

// Two halves of the keys, each computed without the sink, merged with it, equal one call over
// all the keys with the sink: the merge counts the sink once.
TYPED_TEST(SdpaRules, MergedPartsCountTheSinkOnce) {
  using Scalar = TypeParam;
  const Index s_q = 9;
  const Index s_k = 200;
  std::mt19937 rng(13);
  std::normal_distribution<double> normal;
  const auto random = [&](Index rows, Index cols) {
    RowMatrix<Scalar> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(normal(rng));
    return m;
  };
  const RowMatrix<Scalar> q = random(s_q, 16), k = random(s_k, 16), v = random(s_k, 8);
  // [rows, cols] of a matrix from row `first` on, as a one-batch, one-head view.
  const auto in = [](const RowMatrix<Scalar>& m, Index first, Index rows) {
    return apex::HeadsView<const Scalar>::contiguous(m.data() + first * m.cols(),
                                                     {1, 1, rows, m.cols()});
  };
  const auto out = [](RowMatrix<Scalar>& m) {
    return apex::HeadsView<Scalar>::contiguous(m.data(), {1, 1, m.rows(), m.cols()});
  };
  const double sink = 1.5;
  apex::AttentionMask<Scalar> whole;
  whole.positions = apex::causal_mask();
  apex::SdpaParams with_sink;
  with_sink.sinks = {sink};
  RowMatrix<Scalar> expected(s_q, 8);
  RowMatrix<Scalar> expected_lse(s_q, 1);
  apex::sdpa<Scalar>(in(q, 0, s_q), in(k, 0, s_k), in(v, 0, s_k), whole, with_sink, out(expected),
                     out(expected_lse));
  // The halves: keys [0, 100) and [100, 200), at their own positions, without the sink.
  RowMatrix<Scalar> parts_out(2 * s_q, 8);
  RowMatrix<Scalar> parts_max(2, s_q);
  RowMatrix<Scalar> parts_sum(2, s_q);
  for (Index c = 0; c < 2; ++c) {
    apex::AttentionMask<Scalar> half;
    half.positions = apex::causal_mask();
    half.positions.query_offset = s_k - s_q;
    half.positions.key_offset = c * 100;
    RowMatrix<Scalar> part(s_q, 8), max(s_q, 1), sum(s_q, 1);
    apex::sdpa<Scalar>(in(q, 0, s_q), in(k, c * 100, 100), in(v, c * 100, 100), half, {}, out(part),
                       {}, {out(max), out(sum)});
    parts_out.middleRows(c * s_q, s_q) = part;
    parts_max.row(c) = max.transpose();
    parts_sum.row(c) = sum.transpose();
  }
  RowMatrix<Scalar> merged(s_q, 8);
  Vector<Scalar> max(s_q), sum(s_q);
  apex::merge_attention_stats(parts_out, parts_max, parts_sum, sink, merged, max, sum);
  const double tol = apex::testing::Tolerances<Scalar>::kAttention;
  EXPECT_LE((merged - expected).cwiseAbs().maxCoeff(), tol * expected.cwiseAbs().maxCoeff());
  for (Index i = 0; i < s_q; ++i) {
    EXPECT_NEAR(double(max(i)) + std::log(double(sum(i))), double(expected_lse(i, 0)),
                tol * std::abs(double(expected_lse(i, 0))));
  }
  EXPECT_THROW(
      apex::merge_attention_stats(parts_out, parts_max, parts_sum,
                                  std::numeric_limits<double>::infinity(), merged, max, sum),
      std::invalid_argument);
}

// ---- ALiBi
// ---------------------------------------------------------------------------------------

// The standard slopes: 2^(−8(h+1)/H) for H a power of two; for other H, those of the largest
// power of two below it, then every other slope of twice that many heads.
TEST(Alibi, StandardSlopes) {
  const std::vector<double> eight = apex::alibi_slopes(8);
  ASSERT_EQ(eight.size(), 8U);
  for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(eight[h], std::ldexp(1.0, -int(h) - 1));
  const std::vector<double> twelve = apex::alibi_slopes(12);
  ASSERT_EQ(twelve.size(), 12U);
  for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(twelve[h], eight[h]);
  for (std::size_t h = 8; h < 12; ++h) {  // 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    EXPECT_DOUBLE_EQ(twelve[h], std::pow(2.0, -0.5 - double(h - 8)));
  }
  EXPECT_EQ(apex::alibi_slopes(1), std::vector<double>{1.0 / 256.0});
  EXPECT_THROW(apex::alibi_slopes(0), std::invalid_argument);
}

// The ALiBi term slope·(kp − qp) is rounded once, as the double loops round it, however many
// query rows a tile holds: a tile of 256 rows of one head once formed it as slope·(kp − qp0) −
// slope·(qp − qp0), two rounded products of magnitude up to slope·256 whose difference carries
// the nearest keys' weight, an error of about u·slope·256 ≈ 1e-5 in every near score. Rounded
// once, a key at distance d errs by u·slope·d in a score whose weight is at most e^(−slope·d),
// so the term adds at most u/e per score to the dot products' own few u: 1e-6 (about 17 u)
// normwise holds with room, a tenth of what the split form gives. Half K/V, as decoding
// stores them; H = 12 heads of their own (G = 1: the tiles with the most rows per head).
TEST(Alibi, TermRoundedOnceInTilesOfManyRows) {
  constexpr Index kHeads = 12, kLength = 1024, kDim = 16, kSize = kHeads * kLength * kDim;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  apex::HeadsTensor<float> q({1, kHeads, kLength, kDim}), out({1, kHeads, kLength, kDim});
  apex::HeadsTensor<Eigen::half> k({1, kHeads, kLength, kDim}), v({1, kHeads, kLength, kDim});
  apex::HeadsTensor<double> qd({1, kHeads, kLength, kDim}), kd({1, kHeads, kLength, kDim}),
      vd({1, kHeads, kLength, kDim}), want({1, kHeads, kLength, kDim});
  for (Index i = 0; i < kSize; ++i) {
    q.data()[i] = normal(rng);
    k.data()[i] = Eigen::half(normal(rng));
    v.data()[i] = Eigen::half(normal(rng));
    qd.data()[i] = q.data()[i];
    kd.data()[i] = double(k.data()[i]);
    vd.data()[i] = double(v.data()[i]);
  }
  apex::AttentionMask<float> mask;
  mask.positions = apex::causal_mask();
  apex::SdpaParams params;
  params.alibi_slopes = apex::alibi_slopes(kHeads);
  apex::sdpa(std::as_const(q).view(), std::as_const(k).view(), std::as_const(v).view(), mask,
             params, out.view());
  apex::AttentionMask<double> mask_d;
  mask_d.positions = apex::causal_mask();
  apex::reference::sdpa<double>(std::as_const(qd).view(), std::as_const(kd).view(),
                                std::as_const(vd).view(), mask_d, params, want.view());
  double err = 0.0, ref = 0.0;
  for (Index i = 0; i < kSize; ++i) {
    err = std::max(err, std::abs(double(out.data()[i]) - want.data()[i]));
    ref = std::max(ref, std::abs(want.data()[i]));
  }
  EXPECT_LE(err, 1e-6 * ref);
}

// ---- user rules
// ----------------------------------------------------------------------------------

/// The causal rule's pair test and its exact block classifier.
bool causal_allows(Index, Index, Index q, Index k) { return k <= q; }
apex::BlockCoverage causal_coverage(apex::PositionRange q, apex::PositionRange k) {
  if (k.begin > q.end - 1) return apex::BlockCoverage::kNone;
  if (k.end - 1 <= q.begin) return apex::BlockCoverage::kAll;
  return apex::BlockCoverage::kPartial;
}

/// A user rule restating causal attention, with its exact block classifier.
auto user_causal() {
  return apex::mask_rule(causal_allows,
                         [](Index, Index, apex::PositionRange q, apex::PositionRange k) {
                           return causal_coverage(q, k);
                         });
}

/// Runs the fast kernel on `p` with `rules` (or the reference with them), writing `o`.
template <class Scalar, class Rules>
void run_with_rules(const Problem<Scalar>& p, const Rules& rules, Outputs<Scalar>& o,
                    const FlashBlocking& blocking, bool reference = false) {
  if (reference) {
    apex::reference::sdpa(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, rules,
                          o.out.view(), o.lse.view());
  } else {
    apex::detail::flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(
        p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, o.out.view(),
        o.lse.view(), {}, blocking, rules);
  }
}

/// The built-in rule of `builtin` and the same rule written by the user (`rules`, on a problem
/// without the built-in part, `user`) give the same attention on every path, and the reference
/// with the user's rules agrees.
template <class Scalar, class Rules>
void expect_user_rule_matches(const Problem<Scalar>& builtin, const Problem<Scalar>& user,
                              const Rules& rules, const std::string& what) {
  const Shape& shape = builtin.shape;
  for (const auto& [path, blocking] : paths()) {
    SCOPED_TRACE(what + ", " + path);
    Outputs<Scalar> expected(shape, Layout::kTokenMajor);
    Outputs<Scalar> actual(shape, Layout::kTokenMajor);
    Outputs<Scalar> reference(shape, Layout::kTokenMajor);
    apex::detail::flash_sdpa<Scalar>(builtin.q.view(), builtin.k.view(), builtin.v.view(),
                                     builtin.attention_mask(), builtin.params, expected.out.view(),
                                     expected.lse.view(), {}, blocking);
    run_with_rules(user, rules, actual, blocking);
    run_with_rules(user, rules, reference, blocking, /*reference=*/true);
    expect_same_outputs(actual, expected, what + ": user rule against the built-in rule");
    expect_same_outputs(reference, expected, what + ": reference with the user rule");
  }
}

// Causal (with a classifier), a window (without), chunks, documents and ALiBi (a score rule),
// written as user rules, equal the built-in rules, prefill and decode, G ∈ {1, 4, 16}.
TYPED_TEST(SdpaRules, UserRulesEqualTheBuiltInRules) {
  using Scalar = TypeParam;
  std::uint32_t seed = 3000;
  for (const Shape& shape : {Shape{1, 1, 1, 130, 130, 16, 8}, Shape{1, 4, 1, 130, 130, 16, 8},
                             Shape{1, 16, 1, 70, 70, 16, 8}, Shape{1, 8, 2, 2, 1500, 16, 8}}) {
    ++seed;
    const std::string where = "H_q " + std::to_string(shape.q_heads) + ", S_q " +
                              std::to_string(shape.s_q) + ", S_k " + std::to_string(shape.s_k);
    const auto problem = [&](const MaskRule& rule) {
      Problem<Scalar> p(shape, Layout::kTokenMajor, seed, Values::kNormal);
      p.rule = rule;
      return p;
    };
    const Problem<Scalar> none = problem({});
    expect_user_rule_matches(problem({true, 0, 0}), none, user_causal(), "causal, " + where);
    constexpr Index w = 37;
    expect_user_rule_matches(
        problem({true, w, 0}), none,
        apex::mask_rule([](Index, Index, Index q, Index k) { return k <= q && q - k < w; }),
        "window, " + where);
    constexpr Index c = 48;
    expect_user_rule_matches(
        problem({true, 0, 0, c}), none, apex::mask_rule([](Index, Index, Index q, Index k) {
          return k <= q && apex_test::chunk_index(q, c) == apex_test::chunk_index(k, c);
        }),
        "chunks, " + where);
    const std::vector<Index> ids = random_documents(shape.s_k, 50, seed);
    Problem<Scalar> documents = problem({true, 0, 0});
    documents.rule.documents = &ids;
    expect_user_rule_matches(documents, problem({true, 0, 0}),
                             apex::mask_rule([&ids](Index, Index, Index q, Index k) {
                               return ids[std::size_t(q)] == ids[std::size_t(k)];
                             }),
                             "documents, " + where);
    const std::vector<double> slopes = apex::alibi_slopes(shape.q_heads);
    Problem<Scalar> alibi = problem({true, 0, 0});
    alibi.params.alibi_slopes = slopes;
    expect_user_rule_matches(alibi, problem({true, 0, 0}),
                             apex::score_rule([&slopes](Index, Index h, Index q, Index k, auto s) {
                               return s - decltype(s)(slopes[std::size_t(h)] * double(q - k));
                             }),
                             "ALiBi, " + where);
  }
}

// A rule that depends on the batch and the head: a window of 5 + 7·h + 11·b keys, with a
// score rule that adds 0.25·h·b. Against the plain loops, head by head.
TYPED_TEST(SdpaRules, UserRulesSeeTheBatchAndTheHead) {
  using Scalar = TypeParam;
  const Shape shape{2, 8, 2, 90, 90, 16, 16};
  Problem<Scalar> p(shape, Layout::kContiguous, 41, Values::kNormal);
  const auto window = [](Index b, Index h) { return 5 + 7 * h + 11 * b; };
  const auto rules = apex::attention_rules(
      [window](Index b, Index h, Index q, Index k) { return k <= q && q - k < window(b, h); },
      apex::CheckEveryPair{},
      [](Index b, Index h, Index, Index, auto s) { return s + decltype(s)(0.25 * double(h * b)); });
  for (const auto& [path, blocking] : paths()) {
    SCOPED_TRACE(path);
    Outputs<Scalar> o(shape);
    run_with_rules(p, rules, o, blocking);
    double max_ref = 0.0, max_err = 0.0;
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 8; ++h) {
        const Index kv = apex_test::kv_head_of(h, 8, 2);
        const apex_test::MatrixD bias = apex_test::MatrixD::Constant(90, 90, 0.25 * double(h * b));
        const apex_test::AttentionResult ref = apex_test::attention(
            p.q.head(b, h), p.k.head(b, kv), p.v.head(b, kv),
            [&](Index i, Index j) { return apex_test::sliding_window_allows(i, j, window(b, h)); },
            &bias, 0.25, 0.0);
        const apex_test::MatrixD out = o.out.head(b, h);
        max_ref = std::max(max_ref, ref.out.cwiseAbs().maxCoeff());
        max_err = std::max(max_err, (out - ref.out).cwiseAbs().maxCoeff());
      }
    }
    EXPECT_LE(max_err, apex::testing::Tolerances<Scalar>::kAttention * max_ref);
  }
}

// ---- user rules: classifiers that lie (attention_rules.hpp, A CLASSIFIER THAT LIES) ----------

using apex::BlockCoverage;
using apex::PositionRange;

/// Whether two outputs hold the same bits (out and lse).
template <class Scalar>
bool same_bits(const Outputs<Scalar>& a, const Outputs<Scalar>& b) {
  const auto same = [](const apex::testing::Heads<Scalar>& x,
                       const apex::testing::Heads<Scalar>& y) {
    return x.size() == y.size() && std::memcmp(&x.at(0), &y.at(0), x.size() * sizeof(Scalar)) == 0;
  };
  return same(a.out, b.out) && same(a.lse, b.lse);
}

/// Runs `rules` on `p` through apex::sdpa itself, writing `o`.
template <class Scalar, class Rules>
void run_sdpa(const Problem<Scalar>& p, const Rules& rules, Outputs<Scalar>& o) {
  apex::sdpa(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, rules, o.out.view(),
             o.lse.view());
}

/// The paths of the tiled kernel, and apex::sdpa's own (blocking unset).
std::vector<std::pair<const char*, std::optional<FlashBlocking>>> entry_points() {
  std::vector<std::pair<const char*, std::optional<FlashBlocking>>> all = {{"apex::sdpa", {}}};
  for (const auto& [path, blocking] : paths()) all.emplace_back(path, blocking);
  return all;
}

/// Runs `rules` on `p` on one entry point.
template <class Scalar, class Rules>
void run_on(const Problem<Scalar>& p, const Rules& rules, Outputs<Scalar>& o,
            const std::optional<FlashBlocking>& blocking) {
  if (blocking) {
    run_with_rules(p, rules, o, *blocking);
  } else {
    run_sdpa(p, rules, o);
  }
}

/// Causal attention as a user rule whose classifier answers `lie` for the one rectangle (b, h,
/// [32, 48) × [32, 48)) and the truth elsewhere. With the small blocks and G = 1 that rectangle
/// is a tile, so the lie is told exactly once.
auto causal_lying_once(Index lie_b, Index lie_h, BlockCoverage lie) {
  return apex::mask_rule(causal_allows, [=](Index b, Index h, PositionRange q, PositionRange k) {
    if (b == lie_b && h == lie_h && q.begin == 32 && k.begin == 32) return lie;
    return causal_coverage(q, k);
  });
}

/// verify_classifier, run with the small blocks on a B = 2, H = 4, G = 1 problem without a
/// PositionMask, reports exactly one false answer, with `message`; its output is that of the
/// rule without a classifier, bit for bit, and a second run after reset() reports the same.
template <class Scalar, class Rules>
void expect_lie_reported(const Rules& lying, const std::string& message) {
  const Shape shape{2, 4, 4, 100, 100, 16, 8};
  const Problem<Scalar> p(shape, Layout::kContiguous, 51, Values::kNormal);
  const FlashBlocking small = paths()[1].second;
  apex::ClassifierReport report;
  Outputs<Scalar> checked(shape), plain(shape);
  for (int run = 0; run < 2; ++run) {
    report.reset();
    run_with_rules(p, apex::verify_classifier(lying, report), checked, small);
    EXPECT_FALSE(report.ok());
    EXPECT_EQ(report.violations(), 1);
    EXPECT_GT(report.blocks_checked(), 1);
    EXPECT_EQ(report.message(), message);
    ASSERT_TRUE(report.first_violation().has_value());
    EXPECT_EQ(report.first_violation()->message(), message);
    apex::testing::expect_invalid([&] { report.throw_if_violated(); }, message);
  }
  run_with_rules(p, apex::mask_rule(lying.allows), plain, small);
  EXPECT_TRUE(same_bits(checked, plain))
      << "the checked run must equal the rule without classifier";
}

// A classifier that calls a diagonal block kNone is caught, with the rectangle and the first
// pair (in row order) that allows() accepts.
TYPED_TEST(SdpaRules, LyingClassifier_VerifyNamesAKNoneLie) {
  expect_lie_reported<TypeParam>(causal_lying_once(1, 3, BlockCoverage::kNone),
                                 "[verify_classifier] classify(b=1, h=3, q=[32,48), k=[32,48)) "
                                 "said kNone but allows(1, 3, 32, 32) is true");
}

// A classifier that calls a diagonal block kAll is caught, with the first pair it rejects.
TYPED_TEST(SdpaRules, LyingClassifier_VerifyNamesAKAllLie) {
  expect_lie_reported<TypeParam>(causal_lying_once(0, 2, BlockCoverage::kAll),
                                 "[verify_classifier] classify(b=0, h=2, q=[32,48), k=[32,48)) "
                                 "said kAll but allows(0, 2, 32, 33) is false");
}

// An answer that is no BlockCoverage is reported too, and without the check the kernel takes
// it as kPartial (the output of the rule without classifier, bit for bit).
TYPED_TEST(SdpaRules, LyingClassifier_VerifyNamesAnInvalidAnswer) {
  using Scalar = TypeParam;
  const auto invalid = causal_lying_once(0, 0, static_cast<BlockCoverage>(7));
  expect_lie_reported<Scalar>(invalid,
                              "[verify_classifier] classify(b=0, h=0, q=[32,48), k=[32,48)) said "
                              "BlockCoverage(7), which is not kNone, kPartial or kAll");
  const Shape shape{2, 4, 4, 100, 100, 16, 8};
  const Problem<Scalar> p(shape, Layout::kContiguous, 51, Values::kNormal);
  Outputs<Scalar> unchecked(shape), plain(shape);
  run_with_rules(p, invalid, unchecked, paths()[1].second);
  run_with_rules(p, apex::mask_rule(causal_allows), plain, paths()[1].second);
  EXPECT_TRUE(same_bits(unchecked, plain));
}

/// Shapes for the classifier tests: prefill with G = 4, and decoding S_q = 3 against 1300 keys
/// with G = 4 (split over key chunks).
std::vector<Shape> classifier_shapes() {
  return {Shape{1, 4, 1, 100, 100, 16, 8}, Shape{1, 8, 2, 3, 1300, 16, 8}};
}

// Classifiers that lie on every diagonal tile (kNone for every block not wholly before the
// queries; kAll for every block not wholly after them) are caught on every entry point and
// path, prefill and decode: the report names a rectangle, the answer and a pair that refutes
// it, and the checked output is that of the rule without classifier, bit for bit.
TYPED_TEST(SdpaRules, LyingClassifier_VerifyCatchesLiesOnEveryPath) {
  using Scalar = TypeParam;
  const auto none_lie = [](Index, Index, PositionRange q, PositionRange k) {
    return k.end - 1 <= q.begin ? BlockCoverage::kAll : BlockCoverage::kNone;
  };
  const auto all_lie = [](Index, Index, PositionRange q, PositionRange k) {
    return k.begin > q.end - 1 ? BlockCoverage::kNone : BlockCoverage::kAll;
  };
  const auto check = [](const auto& lying, BlockCoverage lie, const Problem<Scalar>& p,
                        const std::optional<FlashBlocking>& blocking) {
    apex::ClassifierReport report;
    Outputs<Scalar> checked(p.shape), plain(p.shape);
    run_on(p, apex::verify_classifier(lying, report), checked, blocking);
    run_on(p, apex::mask_rule(causal_allows), plain, blocking);
    EXPECT_TRUE(same_bits(checked, plain));
    ASSERT_FALSE(report.ok());
    EXPECT_GE(report.violations(), 1);
    EXPECT_GE(report.blocks_checked(), report.violations());
    const apex::ClassifierViolation v = *report.first_violation();
    EXPECT_EQ(v.said, lie);
    EXPECT_TRUE(v.q.begin <= v.q_pos && v.q_pos < v.q.end) << v.message();
    EXPECT_TRUE(v.k.begin <= v.k_pos && v.k_pos < v.k.end) << v.message();
    EXPECT_EQ(causal_allows(v.b, v.h, v.q_pos, v.k_pos), lie == BlockCoverage::kNone)
        << v.message();
    EXPECT_EQ(report.message().rfind(v.message(), 0), 0U) << report.message();
    EXPECT_THROW(report.throw_if_violated(), std::invalid_argument);
  };
  for (const Shape& shape : classifier_shapes()) {
    const Problem<Scalar> p(shape, Layout::kTokenMajor, 52, Values::kNormal);
    for (const auto& [path, blocking] : entry_points()) {
      SCOPED_TRACE(apex::testing::describe(shape) + ", " + path);
      check(apex::mask_rule(causal_allows, none_lie), BlockCoverage::kNone, p, blocking);
      check(apex::mask_rule(causal_allows, all_lie), BlockCoverage::kAll, p, blocking);
    }
  }
}

// The causal classifier of the header's comment is honest: the report is ok after checking
// blocks, nothing is thrown, and the output is that of the rule without classifier, bit for
// bit, and of causal attention. reference::sdpa never asks the classifier.
TYPED_TEST(SdpaRules, LyingClassifier_HonestClassifierReportsOk) {
  using Scalar = TypeParam;
  for (const Shape& shape : classifier_shapes()) {
    Problem<Scalar> causal(shape, Layout::kTokenMajor, 53, Values::kNormal);
    causal.rule = {true, 0, 0};
    const Problem<Scalar> p(shape, Layout::kTokenMajor, 53, Values::kNormal);  // same values
    for (const auto& [path, blocking] : entry_points()) {
      SCOPED_TRACE(apex::testing::describe(shape) + ", " + path);
      apex::ClassifierReport report;
      Outputs<Scalar> checked(shape), plain(shape);
      run_on(p, apex::verify_classifier(user_causal(), report), checked, blocking);
      run_on(p, apex::mask_rule(causal_allows), plain, blocking);
      EXPECT_TRUE(report.ok()) << report.message();
      EXPECT_GT(report.blocks_checked(), 0);
      EXPECT_EQ(report.violations(), 0);
      EXPECT_EQ(report.message(), "");
      EXPECT_FALSE(report.first_violation().has_value());
      EXPECT_NO_THROW(report.throw_if_violated());
      EXPECT_TRUE(same_bits(checked, plain));
      expect_matches_loops(causal, checked, /*with_lse=*/true);
    }
    apex::ClassifierReport report;
    Outputs<Scalar> reference(shape);
    run_with_rules(p, apex::verify_classifier(user_causal(), report), reference, {},
                   /*reference=*/true);
    EXPECT_EQ(report.blocks_checked(), 0);
    expect_matches_loops(causal, reference, /*with_lse=*/true);
  }
}

/// The largest |a − b| over the outputs.
template <class Scalar>
double max_difference(const Outputs<Scalar>& a, const Outputs<Scalar>& b) {
  double d = 0.0;
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    d = std::max(d, std::abs(double(a.out.at(i)) - double(b.out.at(i))));
  }
  return d;
}

// Unchecked, a classifier that says kAll of every rectangle gives the attention of the
// PositionMask (a causal window) and the dense mask alone, as if allows() were true: the rule
// (every third key forbidden) is never asked, and the masks still apply. On every entry point
// and path, prefill and decode, against the plain loops of that implied rule.
TYPED_TEST(SdpaRules, LyingClassifier_UncheckedKAllTakesEveryPairTheMasksAllow) {
  using Scalar = TypeParam;
  const auto lying = apex::mask_rule(
      [](Index, Index, Index, Index k) { return k % 3 != 0; },
      [](Index, Index, PositionRange, PositionRange) { return BlockCoverage::kAll; });
  for (const Shape& shape : classifier_shapes()) {
    Problem<Scalar> p(shape, Layout::kTokenMajor, 54, Values::kNormal);
    p.rule = {true, 70, 0};
    p.add_dense_mask(1, shape.q_heads, 0.7);
    for (const auto& [path, blocking] : entry_points()) {
      SCOPED_TRACE(apex::testing::describe(shape) + ", " + path);
      Outputs<Scalar> o(shape), honest(shape);
      run_on(p, lying, o, blocking);
      expect_matches_loops(p, o, /*with_lse=*/true);  // the PositionMask and the dense mask only
      run_on(p, apex::mask_rule(lying.allows), honest, blocking);
      EXPECT_GT(max_difference(o, honest), 1e-3) << "the lie must change the result";
    }
  }
}

// Unchecked, a classifier that says kNone of every rectangle for all the heads of the last
// key/value head fully masks them (zeros, lse = -inf), as if allows() were false; head 0 saying
// kNone alone (the other heads of its group say kAll) takes no effect: allows() decides its
// pairs (true). Every entry point and path, prefill and decode, against the plain loops of the
// implied rule (a dense mask false for the last group's heads).
TYPED_TEST(SdpaRules, LyingClassifier_UncheckedKNoneSkipsTheBlocksOfAWholeGroup) {
  using Scalar = TypeParam;
  for (const Shape& shape : {Shape{2, 4, 2, 100, 100, 16, 8}, Shape{1, 8, 2, 3, 1300, 16, 8}}) {
    const Index group = shape.q_heads / shape.kv_heads;
    const Index last_group = shape.q_heads - group;  // its first head
    const auto lying = apex::mask_rule([](Index, Index, Index, Index) { return true; },
                                       [last_group](Index, Index h, PositionRange, PositionRange) {
                                         return h == 0 || h >= last_group ? BlockCoverage::kNone
                                                                          : BlockCoverage::kAll;
                                       });
    Problem<Scalar> p(shape, Layout::kTokenMajor, 55, Values::kNormal);
    p.rule = {true, 0, 0};
    Problem<Scalar> implied(shape, Layout::kTokenMajor, 55, Values::kNormal);  // same values
    implied.rule = p.rule;
    implied.add_dense_mask(1, shape.q_heads, 1.0);
    for (Index h = last_group; h < shape.q_heads; ++h)
      implied.allowed_rows(0, h).setConstant(false);
    for (const auto& [path, blocking] : entry_points()) {
      SCOPED_TRACE(apex::testing::describe(shape) + ", " + path);
      Outputs<Scalar> o(shape);
      run_on(p, lying, o, blocking);
      expect_matches_loops(implied, o, /*with_lse=*/true);
    }
  }
}

// ---- block skipping ----------------------------------------------------------------------------

// K and V of one key/value head, contiguous [S_k, d], in guarded memory; the keys that no query
// may see are made unreadable, and sdpa must complete and equal the loops. Queries are the last
// S_q positions (bottom-right), so the keys before the window, the chunk or the document of the
// first query are forbidden for every query. Both the prefill path (S_q = 60) and the decoding
// path (S_q = 1; with small blocks, split over chunks of 40 keys) run, with the default blocks
// and small ones.
TYPED_TEST(SdpaRules, ForbiddenKeysAreNeverRead) {
  using Scalar = TypeParam;
  const Index s_k = 3000;
  const Index d = 32;
  std::vector<Index> ids(static_cast<std::size_t>(s_k));
  for (Index i = 0; i < s_k; ++i) ids[std::size_t(i)] = i < 1700 ? 0 : i < 2970 ? 1 : 2;
  struct Guarded {
    const char* name;
    MaskRule rule;
    bool documents;
  };
  const Guarded rules[] = {
      {"window", {true, 400, 0}, false},
      {"chunk", {true, 0, 0, 512}, false},
      {"documents", {true, 0, 0}, true},
  };
  for (const Index s_q : {Index{60}, Index{1}}) {
    for (const Guarded& g : rules) {
      SCOPED_TRACE(std::string(g.name) + ", S_q = " + std::to_string(s_q));
      const Shape shape{1, 4, 1, s_q, s_k, d, d};
      Problem<Scalar> p(shape, Layout::kContiguous, 21, Values::kNormal);
      p.rule = g.rule;
      if (g.documents) p.rule.documents = &ids;
      GuardedBuffer<Scalar> k(std::size_t(s_k * d)), v(std::size_t(s_k * d));
      std::memcpy(k.data(), p.k.data(), std::size_t(s_k * d) * sizeof(Scalar));
      std::memcpy(v.data(), p.v.data(), std::size_t(s_k * d) * sizeof(Scalar));
      const Index first_query = s_k - s_q;
      Index first_visible = 0;  // the first key any query may see
      while (!apex_test::rule_allows(p.rule, first_query, first_visible)) ++first_visible;
      for (Index q = first_query; q < s_k; ++q) {
        for (Index j = 0; j < first_visible; ++j)
          ASSERT_FALSE(apex_test::rule_allows(p.rule, q, j));
      }
      ASSERT_GT(k.forbid(0, std::size_t(first_visible * d)), 0U);
      ASSERT_GT(v.forbid(0, std::size_t(first_visible * d)), 0U);
      const auto k_view = apex::HeadsView<const Scalar>::contiguous(k.data(), {1, 1, s_k, d});
      const auto v_view = apex::HeadsView<const Scalar>::contiguous(v.data(), {1, 1, s_k, d});
      for (const auto& [path, blocking] : {paths()[0], paths()[1]}) {
        SCOPED_TRACE(path);
        Outputs<Scalar> o(shape);
        apex::detail::flash_sdpa<Scalar>(p.q.view(), k_view, v_view, p.attention_mask(), p.params,
                                         o.out.view(), o.lse.view(), {}, blocking);
        expect_matches_loops(p, o, /*with_lse=*/true);
      }
    }
  }
}

// ---- threads
// -------------------------------------------------------------------------------------

TYPED_TEST(SdpaRules, ThreadCountDoesNotChangeResults) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: apex runs on one thread";
#else
  using Scalar = TypeParam;
  const int saved = omp_get_max_threads();
  const Rule everything = rules().back();
  for (const Shape& shape : {Shape{1, 8, 2, 300, 300, 32, 32}, Shape{1, 8, 2, 1, 5000, 32, 32}}) {
    std::vector<Index> ids;
    const Problem<Scalar> p = make_problem<Scalar>(everything, shape, 3, ids);
    Outputs<Scalar> one(shape), two(shape);
    omp_set_num_threads(1);
    apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                       one.out.view(), one.lse.view());
    omp_set_num_threads(2);
    apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                       two.out.view(), two.lse.view());
    omp_set_num_threads(saved);
    EXPECT_EQ(std::memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(Scalar)), 0);
    EXPECT_EQ(std::memcmp(one.lse.data(), two.lse.data(), one.lse.size() * sizeof(Scalar)), 0);
  }
#endif
}

// ---- bad input
// -----------------------------------------------------------------------------------

// Each bad parameter throws std::invalid_argument naming it, and the outputs keep their values.
TYPED_TEST(SdpaRules, RejectsBadRulesBeforeWriting) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 2, 8, 8, 16, 16};
  const Problem<Scalar> base(shape, Layout::kContiguous, 12, Values::kNormal);
  const std::vector<Index> short_ids(7, 0);
  const std::vector<Index> unsorted_ids{0, 0, 1, 1, 0, 2, 2, 2};
  struct Bad {
    const char* expected;  ///< part of the message
    std::function<void(apex::AttentionMask<Scalar>&, apex::SdpaParams&)> spoil;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const Bad bad[] = {
      {"sinks length (3) must be the number of query heads 4",
       [](auto&, auto& params) {
         params.sinks = {0.0, 1.0, 2.0};
       }},
      {"sinks[2] (nan) must be finite",
       [](auto&, auto& params) {
         params.sinks = {0.0, 1.0, std::nan(""), 2.0};
       }},
      {"sinks[0] (inf) must be finite",
       [inf](auto&, auto& params) {
         params.sinks = {inf, 1.0, 1.0, 2.0};
       }},
      {"alibi_slopes length (5) must be the number of query heads 4",
       [](auto&, auto& params) { params.alibi_slopes = apex::alibi_slopes(5); }},
      {"alibi_slopes[1] (-inf) must be finite",
       [inf](auto&, auto& params) {
         params.alibi_slopes = {0.5, -inf, 0.1, 0.1};
       }},
      {"chunk (0) must be at least 1",
       [](auto& mask, auto&) {
         mask.positions = apex::causal_mask();
         mask.positions.chunk = 0;
       }},
      {"chunk (4) requires causal = true", [](auto& mask, auto&) { mask.positions.chunk = 4; }},
      {"documents length (7) must be the end of the positions, max(query end, key end) = 8",
       [&short_ids](auto& mask, auto&) {
         mask.positions.documents = apex::DocumentIds(short_ids);
       }},
      {"documents ids must be non-decreasing (one run of positions per document): position 4 has "
       "id 0 after 1",
       [&unsorted_ids](auto& mask, auto&) {
         mask.positions.documents = apex::DocumentIds(unsorted_ids);
       }},
  };
  for (const Bad& b : bad) {
    apex::AttentionMask<Scalar> mask = base.attention_mask();
    apex::SdpaParams params;
    b.spoil(mask, params);
    Outputs<Scalar> o(shape);
    o.fill(Scalar(42));
    try {
      apex::sdpa<Scalar>(base.q.view(), base.k.view(), base.v.view(), mask, params, o.out.view(),
                         o.lse.view());
      ADD_FAILURE() << "expected std::invalid_argument: " << b.expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("[sdpa] ") + b.expected), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(o.out.all_equal(Scalar(42))) << b.expected;
    EXPECT_TRUE(o.lse.all_equal(Scalar(42))) << b.expected;
  }
}

}  // namespace
}  // namespace sdpa_rules_test
