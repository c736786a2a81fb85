// SPDX-License-Identifier: MIT
// Tests of include/apex/sdpa.hpp: scaled dot-product attention (§6), grouped heads (§8), every
// kind of mask (§10-§11, dense, bias), soft-capping, the log-sum-exp and merge_attention.
//
// Every test runs on four configurations: {float, double} × {apex::reference::sdpa, apex::sdpa}.
// apex::sdpa is the entry point users call and the one a fast (tiled) kernel sits behind, so the
// shapes are chosen to cross any tile size: S_q = 1, S_q < S_k, S_q > S_k, sizes 1, 7, 63, 65, 130,
// and d_v != d_qk. Results are compared with the plain double loops of reference/attention.hpp;
// the problems are built by attention_case.hpp and the tolerances are those of tolerances.hpp.
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace sdpa_test {
namespace {

using apex::AttentionMask;
using apex::BoolMatrix;
using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::RowMatrix;
using apex::SdpaParams;
using apex::Vector;
using apex::testing::describe;
using apex::testing::expect_invalid;
using apex::testing::expect_matches_loops;
using apex::testing::expect_same_outputs;
using apex::testing::Heads;
using apex::testing::kSentinel;
using apex::testing::Layout;
using apex::testing::layout_name;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::random_matrix;
using apex::testing::Shape;
using apex::testing::Tolerances;
using apex_test::MaskRule;
using apex_test::MatrixD;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- the two paths under test ------------------------------------------------------------------
struct ReferencePath {
  static constexpr const char* kName = "reference";
  template <class Scalar>
  static void run(const apex::ConstHeadsView<Scalar>& q, const apex::ConstHeadsView<Scalar>& k,
                  const apex::ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
                  const SdpaParams& params, const HeadsView<Scalar>& out,
                  const HeadsView<Scalar>& lse) {
    apex::reference::sdpa<Scalar>(q, k, v, mask, params, out, lse);
  }
};

struct DefaultPath {
  static constexpr const char* kName = "default";
  template <class Scalar>
  static void run(const apex::ConstHeadsView<Scalar>& q, const apex::ConstHeadsView<Scalar>& k,
                  const apex::ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
                  const SdpaParams& params, const HeadsView<Scalar>& out,
                  const HeadsView<Scalar>& lse) {
    apex::sdpa<Scalar>(q, k, v, mask, params, out, lse);
  }
};

template <class S, class P>
struct Config {
  using Scalar = S;
  using Path = P;
};

using Configs = ::testing::Types<Config<float, ReferencePath>, Config<float, DefaultPath>,
                                 Config<double, ReferencePath>, Config<double, DefaultPath>>;

struct ConfigNames {
  template <class T>
  static std::string GetName(int /*index*/) {
    return std::string(std::is_same_v<typename T::Scalar, float> ? "float_" : "double_") +
           T::Path::kName;
  }
};

template <class C>
class Sdpa : public ::testing::Test {};
TYPED_TEST_SUITE(Sdpa, Configs, ConfigNames);

/// max |a - b| over all entries; equal infinities count as no difference, a NaN as infinite.
double max_abs_diff(const MatrixD& a, const MatrixD& b) {
  double result = 0.0;
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) {
      if (a(i, j) == b(i, j)) continue;
      const double diff = std::abs(a(i, j) - b(i, j));
      if (std::isnan(diff)) return kInf;
      result = std::max(result, diff);
    }
  }
  return result;
}

/// Largest finite |x| in m, at least `floor`.
double max_finite_abs(const MatrixD& m, double floor) {
  double result = floor;
  for (Index i = 0; i < m.rows(); ++i) {
    for (Index j = 0; j < m.cols(); ++j) {
      if (std::isfinite(m(i, j))) result = std::max(result, std::abs(m(i, j)));
    }
  }
  return result;
}

/// Runs a path on a problem; out and lse start as a sentinel so that unwritten entries show.
template <class Path, class Scalar>
Outputs<Scalar> run(const Problem<Scalar>& p, Layout out_layout = Layout::kContiguous,
                    bool with_lse = true) {
  Outputs<Scalar> o(p.shape, out_layout);
  o.fill(static_cast<Scalar>(kSentinel));
  Path::template run<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                             o.out.view(), with_lse ? o.lse.view() : HeadsView<Scalar>());
  return o;
}

/// Runs `path` on the problem and compares with the loops.
template <class Path, class Scalar>
void check(const Problem<Scalar>& p, Layout out_layout = Layout::kContiguous,
           bool with_lse = true) {
  SCOPED_TRACE(describe(p.shape) + "; " + describe(p.rule, p.query_offset, p.key_offset) +
               "; output " + layout_name(out_layout) + (with_lse ? ", with lse" : ", no lse"));
  const Outputs<Scalar> o = run<Path>(p, out_layout, with_lse);
  expect_matches_loops(p, o, with_lse);
}

/// The single-head shapes every rule is tried on: tile-unfriendly sizes, S_q = 1, S_q < S_k,
/// S_q > S_k, and d_v != d_qk. The last two are long enough for a tiled kernel to use several
/// query blocks (S_q = 300) and to split the keys of a decoding query into chunks (S_k = 1100).
const std::vector<Shape>& single_head_shapes() {
  static const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, 1, 1},     {1, 1, 1, 1, 7, 7, 5},      {1, 1, 1, 1, 130, 16, 9},
      {1, 1, 1, 7, 7, 8, 8},     {1, 1, 1, 7, 65, 63, 65},   {1, 1, 1, 63, 63, 17, 3},
      {1, 1, 1, 65, 65, 64, 64}, {1, 1, 1, 63, 130, 33, 16}, {1, 1, 1, 130, 130, 65, 7},
      {1, 1, 1, 65, 7, 9, 9},    {1, 1, 1, 300, 300, 16, 8}, {1, 1, 1, 1, 1100, 16, 8},
  };
  return shapes;
}

template <class Path, class Scalar>
void check_rule_on_shapes(const MaskRule& rule, const std::optional<Index>& query_offset,
                          std::uint32_t seed) {
  for (const Shape& shape : single_head_shapes()) {
    Problem<Scalar> p(shape, Layout::kContiguous, seed++);
    p.rule = rule;
    p.query_offset = query_offset;
    check<Path>(p);
  }
}

// ---- §6.4 ------------------------------------------------------------------------------------

// §6.4: Q = [[1,0],[0,1]], K = [[1,0],[0,1],[1,1]], V = [[1,2],[3,4],[5,6]], d_h = 2.
TYPED_TEST(Sdpa, S6_4_WorkedExample) {
  using Scalar = typename TypeParam::Scalar;
  RowMatrix<Scalar> q(2, 2), k(3, 2), v(3, 2);
  q << 1, 0, 0, 1;
  k << 1, 0, 0, 1, 1, 1;
  v << 1, 2, 3, 4, 5, 6;
  RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(2, 2, static_cast<Scalar>(kSentinel));
  RowMatrix<Scalar> lse = RowMatrix<Scalar>::Constant(2, 1, static_cast<Scalar>(kSentinel));
  TypeParam::Path::template run<Scalar>(apex::as_heads_view(q), apex::as_heads_view(k),
                                        apex::as_heads_view(v), {}, {},
                                        HeadsView<Scalar>(out.data(), {1, 1, 2, 2}, {0, 0, 2}),
                                        HeadsView<Scalar>(lse.data(), {1, 1, 2, 1}, {0, 0, 1}));
  EXPECT_NEAR(out(0, 0), 3.000, 1e-4);
  EXPECT_NEAR(out(0, 1), 4.000, 1e-4);
  // §6.4 prints row 1 as [3.406, 4.406]; the exact values are 3.40667, 4.40667 (SEED-NOTES.md)
  EXPECT_NEAR(out(1, 0), 3.40667, 1e-4);
  EXPECT_NEAR(out(1, 1), 4.40667, 1e-4);
  // Both rows have the scores {1/√2, 1/√2, 0} (§6.4 step 2), so Σ exp = 2·e^(1/√2) + 1 = 5.0562.
  const double expected_lse = std::log(2.0 * std::exp(1.0 / std::sqrt(2.0)) + 1.0);
  EXPECT_NEAR(lse(0, 0), expected_lse, 1e-5);
  EXPECT_NEAR(lse(1, 0), expected_lse, 1e-5);
  // Step 3's weights, [0.401, 0.198, 0.401] for row 0, are exp(score - lse).
  EXPECT_NEAR(std::exp(1.0 / std::sqrt(2.0) - lse(0, 0)), 0.401, 5e-4);
  EXPECT_NEAR(std::exp(0.0 - lse(0, 0)), 0.198, 5e-4);
}

// ---- against the plain loops -------------------------------------------------------------------

TYPED_TEST(Sdpa, NoMaskMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 100;
  for (const Shape& shape : single_head_shapes()) {
    Problem<Scalar> p(shape, Layout::kContiguous, seed++);
    check<typename TypeParam::Path>(p, Layout::kContiguous, /*with_lse=*/true);
    check<typename TypeParam::Path>(p, Layout::kContiguous, /*with_lse=*/false);
  }
}

// Causal, both alignments: bottom-right (the queries are the last S_q positions) and top-left
// (query_offset = 0), and an arbitrary offset. With S_q > S_k, bottom-right leaves the first
// S_q - S_k rows without keys (zeros).
TYPED_TEST(Sdpa, CausalMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  using Path = typename TypeParam::Path;
  const MaskRule causal{true, 0, 0};
  check_rule_on_shapes<Path, Scalar>(causal, std::nullopt, 200);
  check_rule_on_shapes<Path, Scalar>(causal, Index{0}, 300);
  check_rule_on_shapes<Path, Scalar>(causal, Index{5}, 400);
}

// Decoding with a cache: S_q = 1 (and a short block of 7) against long key sequences, up to
// lengths where a tiled kernel splits the keys into chunks and merges the partial results.
TYPED_TEST(Sdpa, DecodingCausalMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 500;
  for (const Index s_k : {1, 7, 63, 64, 65, 130, 513, 1100}) {
    for (const Index s_q : {Index{1}, std::min<Index>(7, s_k)}) {
      for (const MaskRule& rule : {MaskRule{true, 0, 0}, MaskRule{true, 1, 0},
                                   MaskRule{true, 16, 0}, MaskRule{true, 600, 5}}) {
        Problem<Scalar> p({2, 4, 2, s_q, s_k, 16, 24}, Layout::kTokenMajor, seed++);
        p.rule = rule;
        check<typename TypeParam::Path>(p, Layout::kTokenMajor);
      }
    }
  }
  // A dense mask and a bias on the split path.
  Problem<Scalar> p({2, 4, 2, 1, 1100, 16, 24}, Layout::kContiguous, seed++);
  p.rule = {true, 700, 0};
  p.add_dense_mask(2, 4, 0.7);
  p.add_bias(1, 4, 0.1);
  check<typename TypeParam::Path>(p);
}

// Several query blocks, grouped heads (G = 4 stacks four query heads per KV head) and long keys,
// with every kind of mask at once.
TYPED_TEST(Sdpa, LongGroupedSequencesMatchLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 550;
  for (const Shape& shape : {Shape{1, 4, 1, 130, 600, 16, 8}, Shape{2, 8, 2, 257, 257, 9, 12}}) {
    for (const MaskRule& rule : {MaskRule{false, 0, 0}, MaskRule{true, 0, 0},
                                 MaskRule{true, 100, 0}, MaskRule{true, 64, 70}}) {
      Problem<Scalar> p(shape, Layout::kTokenMajor, seed++);
      p.rule = rule;
      check<typename TypeParam::Path>(p, Layout::kTokenMajor);
    }
    Problem<Scalar> p(shape, Layout::kContiguous, seed++);
    p.rule = {true, 0, 3};
    p.add_dense_mask(1, shape.q_heads, 0.8);
    p.add_bias(shape.batch, 1, 0.05);
    check<typename TypeParam::Path>(p);
  }
}

TYPED_TEST(Sdpa, SlidingWindowMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 600;
  for (const Index window : {1, 3, 16, 64, 65, 200}) {
    check_rule_on_shapes<typename TypeParam::Path, Scalar>({true, window, 0}, std::nullopt,
                                                           seed += 20);
  }
  check_rule_on_shapes<typename TypeParam::Path, Scalar>({true, 4, 0}, Index{0}, 800);
}

TYPED_TEST(Sdpa, PrefixWithWindowMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 900;
  for (const Index prefix : {1, 5, 17, 64, 130}) {
    for (const Index window : {1, 4, 16}) {
      check_rule_on_shapes<typename TypeParam::Path, Scalar>({true, window, prefix}, std::nullopt,
                                                             seed += 20);
    }
  }
}

TYPED_TEST(Sdpa, PrefixWithCausalMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 1300;
  for (const Index prefix : {1, 5, 17, 64, 130}) {
    check_rule_on_shapes<typename TypeParam::Path, Scalar>({true, 0, prefix}, std::nullopt,
                                                           seed += 20);
  }
  check_rule_on_shapes<typename TypeParam::Path, Scalar>({true, 0, 9}, Index{0}, 1500);
}

// Dense boolean masks shared by everything, per batch, per head and per (batch, head), alone and
// with a causal rule; with GQA (H_q = 4, H_kv = 2) so the mask follows the query head.
TYPED_TEST(Sdpa, DenseMaskMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 1600;
  const std::vector<std::pair<Index, Index>> broadcasts = {{1, 1}, {2, 1}, {1, 4}, {2, 4}};
  for (const auto& [mb, mh] : broadcasts) {
    for (const bool causal : {false, true}) {
      for (const Shape& shape : {Shape{2, 4, 2, 7, 65, 9, 5}, Shape{2, 4, 2, 63, 63, 8, 16},
                                 Shape{2, 4, 2, 1, 130, 7, 7}}) {
        Problem<Scalar> p(shape, Layout::kContiguous, seed++);
        p.rule = {causal, 0, 0};
        p.add_dense_mask(mb, mh, 0.6);
        SCOPED_TRACE("dense mask [" + std::to_string(mb) + ", " + std::to_string(mh) + "]");
        check<typename TypeParam::Path>(p);
      }
    }
  }
}

// Additive bias (with and without -inf entries), shared / per batch / per head, alone and with a
// dense mask and a causal window.
TYPED_TEST(Sdpa, AdditiveBiasMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 1700;
  const std::vector<std::pair<Index, Index>> broadcasts = {{1, 1}, {2, 1}, {1, 3}, {2, 3}};
  for (const auto& [bb, bh] : broadcasts) {
    for (const double neg_inf_fraction : {0.0, 0.3}) {
      for (const bool with_rules : {false, true}) {
        Problem<Scalar> p({2, 3, 3, 65, 130, 17, 6}, Layout::kTokenMajor, seed++);
        p.add_bias(bb, bh, neg_inf_fraction);
        if (with_rules) {
          p.rule = {true, 40, 3};
          p.add_dense_mask(1, 3, 0.8);
        }
        SCOPED_TRACE("bias [" + std::to_string(bb) + ", " + std::to_string(bh) + "], -inf " +
                     std::to_string(neg_inf_fraction));
        check<typename TypeParam::Path>(p);
      }
    }
  }
}

// Soft-capping c·tanh(x/c) before the mask and bias; scale = 1 makes the raw scores large
// (|x| up to ~20) so the cap matters.
TYPED_TEST(Sdpa, SoftcapMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 1800;
  for (const double softcap : {0.0, 0.5, 5.0, 50.0}) {
    for (const Shape& shape : {Shape{1, 2, 1, 7, 65, 63, 5}, Shape{1, 2, 2, 130, 130, 33, 8}}) {
      Problem<Scalar> p(shape, Layout::kContiguous, seed++);
      p.params.scale = 1.0;
      p.params.softcap = softcap;
      p.rule = {true, 0, 0};
      p.add_bias(1, 1, 0.1);
      SCOPED_TRACE("softcap " + std::to_string(softcap));
      check<typename TypeParam::Path>(p);
    }
  }
}

TYPED_TEST(Sdpa, CustomScaleMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 1900;
  for (const double scale : {0.0, 0.05, 1.0, -0.3, 2.5}) {
    Problem<Scalar> p({1, 2, 1, 63, 65, 9, 17}, Layout::kContiguous, seed++);
    p.params.scale = scale;
    p.rule = {true, 0, 0};
    SCOPED_TRACE("scale " + std::to_string(scale));
    check<typename TypeParam::Path>(p);
  }
}

// The log-sum-exp with large scores (scale 3 makes |score| up to ~40): the max subtraction must
// keep it finite and accurate.
TYPED_TEST(Sdpa, LogSumExpMatchesLoops) {
  using Scalar = typename TypeParam::Scalar;
  std::uint32_t seed = 2000;
  for (const Shape& shape : single_head_shapes()) {
    Problem<Scalar> p(shape, Layout::kContiguous, seed++);
    p.params.scale = 3.0;
    p.rule = {true, 9, 2};
    check<typename TypeParam::Path>(p);
  }
}

// §8.4: H_q = 4, H_kv = 2, G = 2: heads 0 and 1 use KV head 0, heads 2 and 3 use KV head 1. All
// query heads get the same Q and the KV heads differ, so the assignment shows in the outputs.
TYPED_TEST(Sdpa, S8_4_GqaHeadAssignment) {
  using Scalar = typename TypeParam::Scalar;
  Problem<Scalar> p({1, 4, 2, 7, 65, 16, 8}, Layout::kContiguous, 2100);
  for (Index h = 1; h < 4; ++h) p.q.head_map(0, h) = p.q.head_map(0, 0);
  p.rule = {true, 0, 0};
  const Outputs<Scalar> o = run<typename TypeParam::Path>(p);
  expect_matches_loops(p, o, true);

  const Index kv_head_of[4] = {0, 0, 1, 1};  // the document's assignment table
  const double tol = Tolerances<Scalar>::kAttention;
  for (Index h = 0; h < 4; ++h) {
    const MatrixD q0 = p.q.head(0, 0);
    const apex_test::AttentionResult ref = apex_test::attention(
        q0, p.k.head(0, kv_head_of[h]), p.v.head(0, kv_head_of[h]),
        [&](Index i, Index j) { return j <= 65 - 7 + i; }, nullptr, 0.25, 0.0);
    const MatrixD out = o.out.head(0, h);
    EXPECT_LE((out - ref.out).cwiseAbs().maxCoeff(), tol * ref.out.cwiseAbs().maxCoeff())
        << "query head " << h;
  }
  // Same group: same result; different groups: clearly different.
  const double scale = max_finite_abs(o.out.head(0, 0), 0.0);
  EXPECT_LE(max_abs_diff(o.out.head(0, 0), o.out.head(0, 1)), tol * scale);
  EXPECT_LE(max_abs_diff(o.out.head(0, 2), o.out.head(0, 3)), tol * scale);
  EXPECT_GT(max_abs_diff(o.out.head(0, 0), o.out.head(0, 2)), 1e-2);
}

// GQA equals MHA run on the K/V heads repeated G times: [K0, K1] → [K0, K0, K0, K1, K1, K1].
TYPED_TEST(Sdpa, GqaEqualsMhaWithRepeatedKvHeads) {
  using Scalar = typename TypeParam::Scalar;
  for (const Layout layout : {Layout::kContiguous, Layout::kTokenMajor}) {
    Problem<Scalar> gqa({2, 6, 2, 7, 63, 9, 12}, layout, 2200);
    gqa.rule = {true, 30, 2};
    Problem<Scalar> mha({2, 6, 6, 7, 63, 9, 12}, layout, 2201);
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 6; ++h) {
        mha.q.head_map(b, h) = gqa.q.head_map(b, h);
        mha.k.head_map(b, h) = gqa.k.head_map(b, h / 3);
        mha.v.head_map(b, h) = gqa.v.head_map(b, h / 3);
      }
    }
    mha.rule = gqa.rule;
    const Outputs<Scalar> o_gqa = run<typename TypeParam::Path>(gqa, layout);
    const Outputs<Scalar> o_mha = run<typename TypeParam::Path>(mha, layout);
    expect_matches_loops(gqa, o_gqa, true);
    expect_matches_loops(mha, o_mha, true);
    SCOPED_TRACE(layout_name(layout));
    expect_same_outputs(o_gqa, o_mha, "GQA against MHA on repeated heads");
  }
}

// B > 1 with the two layouts HeadsView describes: heads side by side as a projection writes them
// ([B·S, H·D], token-major) and contiguous [B, H, S, D]; inputs and output in either layout give
// the same result.
TYPED_TEST(Sdpa, BatchedLayoutsMatchLoops) {
  using Scalar = typename TypeParam::Scalar;
  const Shape shape{3, 4, 2, 63, 65, 16, 7};
  Problem<Scalar> contiguous(shape, Layout::kContiguous, 2300);
  Problem<Scalar> token_major(shape, Layout::kTokenMajor, 2301);
  for (Index b = 0; b < shape.batch; ++b) {
    for (Index h = 0; h < shape.q_heads; ++h) {
      token_major.q.head_map(b, h) = contiguous.q.head_map(b, h);
    }
    for (Index h = 0; h < shape.kv_heads; ++h) {
      token_major.k.head_map(b, h) = contiguous.k.head_map(b, h);
      token_major.v.head_map(b, h) = contiguous.v.head_map(b, h);
    }
  }
  contiguous.rule = token_major.rule = {true, 0, 4};
  for (const Layout out_layout : {Layout::kContiguous, Layout::kTokenMajor}) {
    check<typename TypeParam::Path>(contiguous, out_layout);
    check<typename TypeParam::Path>(token_major, out_layout);
  }
  const Outputs<Scalar> a = run<typename TypeParam::Path>(contiguous, Layout::kContiguous);
  const Outputs<Scalar> b = run<typename TypeParam::Path>(token_major, Layout::kTokenMajor);
  expect_same_outputs(b, a, "token-major against contiguous");
}

// ---- log-sum-exp merge
// ---------------------------------------------------------------------------

/// Single-head attention through a path on row-major matrices, keys at absolute offset key_offset.
template <class Path, class Scalar>
void run_single_head(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                     const RowMatrix<Scalar>& v, Index key_begin, Index key_end,
                     const PositionMask& positions, RowMatrix<Scalar>& out, Vector<Scalar>& lse) {
  const Index s_q = q.rows();
  const Index n = key_end - key_begin;
  out.setConstant(s_q, v.cols(), static_cast<Scalar>(kSentinel));
  lse.setConstant(s_q, static_cast<Scalar>(kSentinel));
  AttentionMask<Scalar> mask;
  mask.positions = positions;
  mask.positions.key_offset = key_begin;
  Path::template run<Scalar>(apex::as_heads_view(q),
                             HeadsView<const Scalar>(k.data() + key_begin * k.cols(),
                                                     {1, 1, n, k.cols()}, {0, 0, k.cols()}),
                             HeadsView<const Scalar>(v.data() + key_begin * v.cols(),
                                                     {1, 1, n, v.cols()}, {0, 0, v.cols()}),
                             mask, SdpaParams{},
                             HeadsView<Scalar>(out.data(), {1, 1, s_q, v.cols()}, {0, 0, v.cols()}),
                             HeadsView<Scalar>(lse.data(), {1, 1, s_q, 1}, {0, 0, 1}));
}

// Splitting the keys at several points, attending to each part (keys placed at their absolute
// positions with key_offset, queries at the last S_q positions) and merging the two results gives
// attention over all keys, including splits where one side has no allowed key for some or all rows.
TYPED_TEST(Sdpa, MergeOfKeySplitsEqualsFullAttention) {
  using Scalar = typename TypeParam::Scalar;
  using Path = typename TypeParam::Path;
  const Index s_q = 7;
  const Index s_k = 65;
  std::mt19937 rng(2400);
  const RowMatrix<Scalar> q = random_matrix<Scalar>(s_q, 16, rng);
  const RowMatrix<Scalar> k = random_matrix<Scalar>(s_k, 16, rng);
  const RowMatrix<Scalar> v = random_matrix<Scalar>(s_k, 9, rng);
  const double tol = Tolerances<Scalar>::kAttention;
  bool saw_empty_side = false;
  for (const MaskRule& rule :
       {MaskRule{false, 0, 0}, MaskRule{true, 0, 0}, MaskRule{true, 4, 0}, MaskRule{true, 8, 5}}) {
    PositionMask positions;
    positions.causal = rule.causal;
    if (rule.window > 0) positions.window = rule.window;
    positions.prefix = rule.prefix;
    positions.query_offset = s_k - s_q;  // explicit: each part sees only some of the keys
    const apex_test::AttentionResult ref = apex_test::attention(
        q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
        [&](Index i, Index j) { return apex_test::rule_allows(rule, s_k - s_q + i, j); }, nullptr,
        0.25, 0.0);
    for (const Index split : {1, 7, 32, 58, 60, 64}) {
      SCOPED_TRACE(describe(rule, s_k - s_q) + ", split at " + std::to_string(split));
      RowMatrix<Scalar> out_a, out_b;
      Vector<Scalar> lse_a, lse_b;
      run_single_head<Path>(q, k, v, 0, split, positions, out_a, lse_a);
      run_single_head<Path>(q, k, v, split, s_k, positions, out_b, lse_b);
      saw_empty_side = saw_empty_side ||
                       (lse_a.array() == -std::numeric_limits<Scalar>::infinity()).any() ||
                       (lse_b.array() == -std::numeric_limits<Scalar>::infinity()).any();
      RowMatrix<Scalar> out(s_q, 9);
      Vector<Scalar> lse(s_q);
      apex::merge_attention(out_a, lse_a, out_b, lse_b, out, lse);
      const MatrixD out_d = out.template cast<double>();
      EXPECT_LE((out_d - ref.out).cwiseAbs().maxCoeff(), tol * ref.out.cwiseAbs().maxCoeff());
      EXPECT_LE((lse.template cast<double>() - ref.lse).cwiseAbs().maxCoeff(),
                tol * std::max(1.0, ref.lse.cwiseAbs().maxCoeff()));
    }
  }
  // Causal split at 60: queries 58 and 59 have no key in [60, 65); window 4 split at 32: no query
  // has a key in [0, 32).
  EXPECT_TRUE(saw_empty_side);
}

// merge_attention may accumulate into its first operand.
TYPED_TEST(Sdpa, MergeInPlace) {
  using Scalar = typename TypeParam::Scalar;
  using Path = typename TypeParam::Path;
  const Index s_q = 1;
  const Index s_k = 130;
  std::mt19937 rng(2500);
  const RowMatrix<Scalar> q = random_matrix<Scalar>(s_q, 8, rng);
  const RowMatrix<Scalar> k = random_matrix<Scalar>(s_k, 8, rng);
  const RowMatrix<Scalar> v = random_matrix<Scalar>(s_k, 3, rng);
  const PositionMask positions = [] {
    PositionMask m = apex::causal_mask();
    m.query_offset = 129;
    return m;
  }();
  RowMatrix<Scalar> acc, part;
  Vector<Scalar> acc_lse, part_lse;
  run_single_head<Path>(q, k, v, 0, 50, positions, acc, acc_lse);
  for (const auto& [begin, end] :
       std::vector<std::pair<Index, Index>>{{50, 64}, {64, 129}, {129, 130}}) {
    run_single_head<Path>(q, k, v, begin, end, positions, part, part_lse);
    apex::merge_attention(acc, acc_lse, part, part_lse, acc, acc_lse);
  }
  const apex_test::AttentionResult ref = apex_test::attention(
      q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
      [](Index, Index) { return true; }, nullptr, 1.0 / std::sqrt(8.0), 0.0);
  const double tol = Tolerances<Scalar>::kAttention;
  EXPECT_LE((acc.template cast<double>() - ref.out).cwiseAbs().maxCoeff(),
            tol * ref.out.cwiseAbs().maxCoeff());
  EXPECT_NEAR(static_cast<double>(acc_lse(0)), ref.lse(0),
              tol * std::max(1.0, std::abs(ref.lse(0))));
}

// ---- invariants
// ------------------------------------------------------------------------------------

// Forbidding a key with the boolean mask and adding -inf to its score are the same thing.
TYPED_TEST(Sdpa, MaskedKeyEqualsNegativeInfinityBias) {
  using Scalar = typename TypeParam::Scalar;
  const Shape shape{2, 2, 1, 63, 65, 7, 9};
  Problem<Scalar> by_mask(shape, Layout::kContiguous, 2600);
  by_mask.add_dense_mask(2, 2, 0.5);
  by_mask.add_bias(2, 2, 0.0);
  Problem<Scalar> by_bias(shape, Layout::kContiguous, 2600);  // the same Q, K, V
  by_bias.add_bias(2, 2, 0.0);
  by_bias.bias = by_mask.bias;
  for (Index r = 0; r < by_bias.bias.rows(); ++r) {
    for (Index c = 0; c < by_bias.bias.cols(); ++c) {
      if (!by_mask.allowed(r, c)) by_bias.bias(r, c) = -std::numeric_limits<Scalar>::infinity();
    }
  }
  const Outputs<Scalar> a = run<typename TypeParam::Path>(by_mask);
  const Outputs<Scalar> b = run<typename TypeParam::Path>(by_bias);
  expect_matches_loops(by_mask, a, true);
  expect_matches_loops(by_bias, b, true);
  expect_same_outputs(b, a, "-inf bias against masked keys");
}

// A query row with no allowed key gives zeros and lse = -inf, never NaN, whatever removed the
// keys: the dense mask, a -inf bias on every key, or a causal rule that puts the query before all
// keys (bottom-right with S_q > S_k).
TYPED_TEST(Sdpa, FullyMaskedRowGivesZeros) {
  using Scalar = typename TypeParam::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  Problem<Scalar> p({1, 2, 2, 70, 65, 8, 5}, Layout::kContiguous, 2700);
  p.rule = {true, 0, 0};  // rows 0..4 sit at positions -5..-1
  p.add_dense_mask(1, 2, 0.9);
  p.allowed.row(10).setConstant(false);       // head 0, row 10
  p.allowed.row(70 + 20).setConstant(false);  // head 1, row 20
  p.add_bias(1, 1, 0.0);
  p.bias.row(30).setConstant(kNegInf);  // every head, row 30
  const Outputs<Scalar> o = run<typename TypeParam::Path>(p);
  expect_matches_loops(p, o, true);
  const auto expect_empty_row = [&](Index h, Index i) {
    EXPECT_TRUE(o.out.head(0, h).row(i).isZero(0.0)) << "head " << h << ", row " << i;
    EXPECT_EQ(o.lse.head(0, h)(i, 0), kNegInf) << "head " << h << ", row " << i;
  };
  for (Index h = 0; h < 2; ++h) {
    for (Index i = 0; i < 5; ++i) expect_empty_row(h, i);
    expect_empty_row(h, 30);
  }
  expect_empty_row(0, 10);
  expect_empty_row(1, 20);
  EXPECT_FALSE(o.out.head(0, 0).row(20).isZero(0.0));  // only the chosen rows are empty

  // A whole head with no allowed key at all.
  Problem<Scalar> none({1, 1, 1, 7, 65, 8, 5}, Layout::kContiguous, 2701);
  none.add_dense_mask(1, 1, 0.0);
  const Outputs<Scalar> z = run<typename TypeParam::Path>(none);
  EXPECT_TRUE(z.out.head(0, 0).isZero(0.0));
  EXPECT_TRUE((z.lse.head(0, 0).array() == -kInf).all());
}

// The values (and keys) of masked positions never reach the output: filling them with 1e30
// changes nothing. Checked for keys removed by the dense mask, by a window (decoding), and by
// top-left causal alignment (keys after the last query).
TYPED_TEST(Sdpa, MaskedValuesNeverMatter) {
  using Scalar = typename TypeParam::Scalar;
  const Scalar huge = static_cast<Scalar>(1e30);
  const auto poison = [&](Problem<Scalar>& p, const std::vector<Index>& keys) {
    for (Index b = 0; b < p.shape.batch; ++b) {
      for (Index h = 0; h < p.shape.kv_heads; ++h) {
        for (const Index j : keys) {
          p.k.head_map(b, h).row(j).setConstant(huge);
          p.v.head_map(b, h).row(j).setConstant(-huge);
        }
      }
    }
  };
  const auto compare = [](const Outputs<Scalar>& a, const Outputs<Scalar>& b) {
    expect_same_outputs(b, a, "poisoned against clean");
  };
  {  // dense mask removing whole key columns 3, 40, 64 for every query
    Problem<Scalar> clean({1, 2, 1, 63, 65, 8, 6}, Layout::kContiguous, 2800);
    clean.rule = {true, 0, 0};
    clean.add_dense_mask(1, 1, 1.0);
    for (const Index j : {3, 40, 64}) clean.allowed.col(j).setConstant(false);
    Problem<Scalar> poisoned({1, 2, 1, 63, 65, 8, 6}, Layout::kContiguous, 2800);
    poisoned.rule = clean.rule;
    poisoned.add_dense_mask(1, 1, 1.0);
    poisoned.allowed = clean.allowed;
    poison(poisoned, {3, 40, 64});
    const Outputs<Scalar> a = run<typename TypeParam::Path>(clean);
    const Outputs<Scalar> b = run<typename TypeParam::Path>(poisoned);
    expect_matches_loops(poisoned, b, true);
    compare(a, b);
  }
  {  // decoding with a window of 16: keys 0..113 are outside it
    Problem<Scalar> clean({2, 2, 1, 1, 130, 8, 6}, Layout::kTokenMajor, 2801);
    clean.rule = {true, 16, 0};
    Problem<Scalar> poisoned({2, 2, 1, 1, 130, 8, 6}, Layout::kTokenMajor, 2801);
    poisoned.rule = clean.rule;
    std::vector<Index> outside;
    for (Index j = 0; j < 130 - 16; ++j) outside.push_back(j);
    poison(poisoned, outside);
    const Outputs<Scalar> a = run<typename TypeParam::Path>(clean);
    const Outputs<Scalar> b = run<typename TypeParam::Path>(poisoned);
    expect_matches_loops(poisoned, b, true);
    compare(a, b);
  }
  {  // top-left causal, 7 queries against 65 keys: keys 7..64 are in every query's future
    Problem<Scalar> clean({1, 1, 1, 7, 65, 8, 6}, Layout::kContiguous, 2802);
    clean.rule = {true, 0, 0};
    clean.query_offset = 0;
    Problem<Scalar> poisoned({1, 1, 1, 7, 65, 8, 6}, Layout::kContiguous, 2802);
    poisoned.rule = clean.rule;
    poisoned.query_offset = 0;
    std::vector<Index> future;
    for (Index j = 7; j < 65; ++j) future.push_back(j);
    poison(poisoned, future);
    const Outputs<Scalar> a = run<typename TypeParam::Path>(clean);
    const Outputs<Scalar> b = run<typename TypeParam::Path>(poisoned);
    expect_matches_loops(poisoned, b, true);
    compare(a, b);
  }
}

// ---- bad input: each throws std::invalid_argument naming the problem, output untouched
// -----------

/// A valid problem (B = 1, H_q = 2, H_kv = 1, S_q = 3, S_k = 7, d_qk = 4, d_v = 5) whose parts a
/// test replaces one at a time.
template <class Scalar>
struct BadInputSetup {
  Heads<Scalar> q{1, 2, 3, 4};
  Heads<Scalar> k{1, 1, 7, 4};
  Heads<Scalar> v{1, 1, 7, 5};
  Heads<Scalar> out{1, 2, 3, 5};
  Heads<Scalar> lse{1, 2, 3, 1};
  AttentionMask<Scalar> mask;
  SdpaParams params;

  BadInputSetup() {
    std::mt19937 rng(2900);
    q.randomize(rng);
    k.randomize(rng);
    v.randomize(rng);
    out.fill(static_cast<Scalar>(kSentinel));
    lse.fill(static_cast<Scalar>(kSentinel));
  }
};

/// Calls the path with q, k, v, out, lse (any of which a test may replace) and expects an
/// std::invalid_argument containing `needle`, with every output still holding the sentinel.
template <class Path, class Scalar>
void expect_rejected(const Heads<Scalar>& q, const Heads<Scalar>& k, const Heads<Scalar>& v,
                     const AttentionMask<Scalar>& mask, const SdpaParams& params,
                     Heads<Scalar>& out, Heads<Scalar>& lse, const std::string& needle) {
  expect_invalid(
      [&] {
        Path::template run<Scalar>(q.view(), k.view(), v.view(), mask, params, out.view(),
                                   lse.view());
      },
      needle);
  EXPECT_TRUE(out.all_equal(static_cast<Scalar>(kSentinel))) << "output written before the check";
  EXPECT_TRUE(lse.all_equal(static_cast<Scalar>(kSentinel))) << "lse written before the check";
}

TYPED_TEST(Sdpa, RejectsMismatchedQueryKeyWidth) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  Heads<Scalar> k5(1, 1, 7, 5);
  expect_rejected<typename TypeParam::Path>(
      s.q, k5, s.v, s.mask, s.params, s.out, s.lse,
      "[sdpa] key width d_qk (5) must equal the query width 4");
}

TYPED_TEST(Sdpa, RejectsMismatchedKeyValueLength) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  Heads<Scalar> v6(1, 1, 6, 5);
  expect_rejected<typename TypeParam::Path>(
      s.q, s.k, v6, s.mask, s.params, s.out, s.lse,
      "[sdpa] value length S_k (6) must equal the key length 7");
}

TYPED_TEST(Sdpa, RejectsMaskOfWrongShape) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  const BoolMatrix wrong = BoolMatrix::Constant(3, 6, true);
  s.mask.allowed = apex::as_heads_view(wrong);
  expect_rejected<typename TypeParam::Path>(
      s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
      "[sdpa] allowed mask shape [3, 6] must be [S_q, S_k] = [3, 7]");
  const BoolMatrix three_heads = BoolMatrix::Constant(9, 7, true);
  s.mask.allowed = HeadsView<const bool>::contiguous(three_heads.data(), {1, 3, 3, 7});
  expect_rejected<typename TypeParam::Path>(
      s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
      "[sdpa] allowed mask heads (3) must be 1 or the number of query heads 2");
}

TYPED_TEST(Sdpa, RejectsBiasOfWrongShape) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  const RowMatrix<Scalar> wrong = RowMatrix<Scalar>::Zero(4, 7);
  s.mask.bias = apex::as_heads_view(wrong);
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] bias shape [4, 7] must be [S_q, S_k] = [3, 7]");
  const RowMatrix<Scalar> two_batches = RowMatrix<Scalar>::Zero(6, 7);
  s.mask.bias = HeadsView<const Scalar>::contiguous(two_batches.data(), {2, 1, 3, 7});
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] bias batch (2) must be 1 or the batch size 1");
}

TYPED_TEST(Sdpa, RejectsQueryHeadsNotMultipleOfKvHeads) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  Heads<Scalar> q3(1, 3, 3, 4);
  Heads<Scalar> k2(1, 2, 7, 4);
  Heads<Scalar> v2(1, 2, 7, 5);
  Heads<Scalar> out3(1, 3, 3, 5);
  Heads<Scalar> lse3(1, 3, 3, 1);
  out3.fill(static_cast<Scalar>(kSentinel));
  lse3.fill(static_cast<Scalar>(kSentinel));
  expect_rejected<typename TypeParam::Path>(
      q3, k2, v2, s.mask, s.params, out3, lse3,
      "[sdpa] num_q_heads (3) must be a multiple of num_kv_heads (2)");
}

TYPED_TEST(Sdpa, RejectsWindowBelowOne) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  s.mask.positions = apex::causal_mask();
  s.mask.positions.window = 0;
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] window (0) must be at least 1");
}

TYPED_TEST(Sdpa, RejectsWindowWithoutCausal) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  s.mask.positions.window = 4;
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] window (4) requires causal = true");
}

TYPED_TEST(Sdpa, RejectsNegativePrefix) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  s.mask.positions = apex::causal_mask();
  s.mask.positions.prefix = -1;
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] prefix (-1) must be >= 0");
}

TYPED_TEST(Sdpa, RejectsNegativeSoftcap) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  s.params.softcap = -1.0;
  expect_rejected<typename TypeParam::Path>(s.q, s.k, s.v, s.mask, s.params, s.out, s.lse,
                                            "[sdpa] softcap (-1) must be >= 0");
}

TYPED_TEST(Sdpa, RejectsWrongOutputShape) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  Heads<Scalar> out4(1, 2, 3, 4);  // d_qk instead of d_v
  out4.fill(static_cast<Scalar>(kSentinel));
  expect_rejected<typename TypeParam::Path>(
      s.q, s.k, s.v, s.mask, s.params, out4, s.lse,
      "[sdpa] output shape [1, 2, 3, 4] must be [B, H_q, S_q, d_v] = [1, 2, 3, 5]");
}

TYPED_TEST(Sdpa, RejectsWrongLseShape) {
  using Scalar = typename TypeParam::Scalar;
  BadInputSetup<Scalar> s;
  Heads<Scalar> lse_kv(1, 1, 3, 1);  // one per KV head instead of per query head
  lse_kv.fill(static_cast<Scalar>(kSentinel));
  expect_rejected<typename TypeParam::Path>(
      s.q, s.k, s.v, s.mask, s.params, s.out, lse_kv,
      "[sdpa] log-sum-exp shape [1, 1, 3, 1] must be [B, H_q, S_q, 1] = [1, 2, 3, 1]");
}

TYPED_TEST(Sdpa, MergeRejectsMismatchedShapes) {
  using Scalar = typename TypeParam::Scalar;
  const RowMatrix<Scalar> out_a = RowMatrix<Scalar>::Zero(3, 4);
  const Vector<Scalar> lse_a = Vector<Scalar>::Zero(3);
  RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(3, 4, static_cast<Scalar>(kSentinel));
  Vector<Scalar> lse = Vector<Scalar>::Constant(3, static_cast<Scalar>(kSentinel));
  const auto expect_merge_rejected = [&](const RowMatrix<Scalar>& ob, const Vector<Scalar>& lb,
                                         RowMatrix<Scalar>& o, Vector<Scalar>& l,
                                         const std::string& needle) {
    const RowMatrix<Scalar> o_before = o;
    const Vector<Scalar> l_before = l;
    expect_invalid([&] { apex::merge_attention(out_a, lse_a, ob, lb, o, l); }, needle);
    EXPECT_EQ(o, o_before);
    EXPECT_EQ(l, l_before);
  };
  expect_merge_rejected(RowMatrix<Scalar>::Zero(3, 5), lse_a, out, lse,
                        "[merge_attention] out_b shape [3, 5] must equal out_a shape [3, 4]");
  expect_merge_rejected(out_a, Vector<Scalar>::Zero(2), out, lse,
                        "[merge_attention] lse_a and lse_b lengths (3, 2) must equal the rows 3");
  RowMatrix<Scalar> out_wrong = RowMatrix<Scalar>::Constant(2, 4, static_cast<Scalar>(kSentinel));
  expect_merge_rejected(out_a, lse_a, out_wrong, lse,
                        "[merge_attention] output shape [2, 4] / lse 3 must be [3, 4] / 3");
  Vector<Scalar> lse_wrong = Vector<Scalar>::Constant(4, static_cast<Scalar>(kSentinel));
  expect_merge_rejected(out_a, lse_a, out, lse_wrong,
                        "[merge_attention] output shape [3, 4] / lse 4 must be [3, 4] / 3");
}

}  // namespace
}  // namespace sdpa_test
