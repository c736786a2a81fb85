// SPDX-License-Identifier: MIT
// Tests for §2: the scaled embedding lookup and the weight-tied LM head.
#include <apex/embedding.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "finite_differences.hpp"
#include "reference/embedding.hpp"
#include "test_util.hpp"

namespace embedding_test {
namespace {

using apex::EmbeddingParams;
using apex::Index;
using apex::RowMatrix;
using apex::TokenMatrix;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

TokenMatrix random_tokens(Index batch, Index seq, Index vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> dist(0, static_cast<std::int64_t>(vocab) - 1);
  TokenMatrix ids(batch, seq);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = dist(rng);
  return ids;
}

// Tolerances, relative to the reference value.
// embed: the scale is rounded to Scalar and the product is rounded once more: two roundings.
// lm_head: a dot product of length d in Scalar is within d·u·Σ|h_j·w_j| of the exact value
// (the classical worst-case bound, FMA or not); the test uses exactly that bound.
template <class Scalar>
constexpr double kUnitRoundoff = std::numeric_limits<Scalar>::epsilon() / 2;
template <class Scalar>
constexpr double kEmbedRelTol = 2 * kUnitRoundoff<Scalar>;

template <class Scalar>
void expect_embed_matches(const RowMatrix<Scalar>& actual, const RowMatrix<double>& expected) {
  apex::testing::expect_near_elementwise(actual, expected, kEmbedRelTol<Scalar>, 0.0);
}

TEST(Embedding, S2_4_WorkedExample) {
  RowMatrix<double> table(3, 4);
  table << 0.01, -0.03, 0.02, 0.01,  //
      -0.02, 0.04, -0.01, 0.03,      //
      0.03, 0.01, -0.04, 0.02;
  RowMatrix<double> expected(3, 4);
  expected << -0.04, 0.08, -0.02, 0.06,  //
      0.02, -0.06, 0.04, 0.02,           //
      0.06, 0.02, -0.08, 0.04;

  // Default scale √d = √4 = 2; doubling is exact, so the printed values are met exactly.
  const RowMatrix<double> x = apex::embed(table, std::vector<std::int64_t>{1, 0, 2});
  ASSERT_EQ(x.rows(), 3);
  ASSERT_EQ(x.cols(), 4);
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 4; ++j) EXPECT_DOUBLE_EQ(x(i, j), expected(i, j));
  }

  // The same through the [B, S] token matrix, and in float.
  TokenMatrix ids(1, 3);
  ids << 1, 0, 2;
  EXPECT_EQ(apex::embed(table, ids), x);
  const RowMatrix<float> xf = apex::embed(RowMatrix<float>(table.cast<float>()), ids);
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(xf(i, j), static_cast<float>(expected(i, j)));
  }
}

TEST(Embedding, S2_5_TiedParameterCount) {
  EXPECT_EQ(apex::tied_parameters_saved(151643, 7168), std::int64_t{1086977024});
  // §2.5 rounds it to 1.09B.
  EXPECT_NEAR(static_cast<double>(apex::tied_parameters_saved(151643, 7168)) / 1e9, 1.09, 0.005);
  // The saving is exactly the size of an untied output projection [V, d].
  EXPECT_EQ(apex::tied_parameters_saved(3, 4), 12);
}

TEST(Embedding, TiedParameterCountRejectsNegativeOrOverflowingSizes) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  expect_invalid([] { (void)apex::tied_parameters_saved(-1, 7168); },
                 {"[tied_parameters_saved] vocab*d", "(-1 x 7168)", "must not be negative"});
  // (2^63 - 2)·3 does not fit in 64 bits: rejected, not wrapped.
  expect_invalid([&] { (void)apex::tied_parameters_saved(max - 1, 3); },
                 {"[tied_parameters_saved] vocab*d", "overflows 64 bits"});
  EXPECT_EQ(apex::tied_parameters_saved(max, 1), max);
  EXPECT_EQ(apex::tied_parameters_saved(0, max), 0);
}

TEST(Embedding, ExplicitScaleAndPlainLookup) {
  const RowMatrix<double> table = random_matrix<double>(5, 3, 1);
  TokenMatrix ids(1, 2);
  ids << 4, 0;
  EmbeddingParams plain;
  plain.scale = 1.0;
  const RowMatrix<double> x = apex::embed(table, ids, plain);
  EXPECT_EQ(x.row(0), table.row(4));
  EXPECT_EQ(x.row(1), table.row(0));
  EmbeddingParams half;
  half.scale = 0.5;
  const RowMatrix<double> y = apex::embed(table, ids, half);
  EXPECT_EQ(y.row(0), table.row(4) * 0.5);
}

TEST(Embedding, BatchRowsAreSequenceBlocks) {
  const RowMatrix<double> table = random_matrix<double>(6, 5, 2);
  TokenMatrix ids(2, 3);
  ids << 5, 1, 1,  //
      0, 3, 2;
  const RowMatrix<double> x = apex::embed(table, ids);
  ASSERT_EQ(x.rows(), 6);
  const double scale = std::sqrt(5.0);
  for (Index b = 0; b < 2; ++b) {
    for (Index s = 0; s < 3; ++s) {
      EXPECT_EQ(x.row(b * 3 + s), table.row(static_cast<Index>(ids(b, s))) * scale)
          << "b=" << b << " s=" << s;
    }
  }
}

TEST(Embedding, AcceptsOtherIntegerTypesAndLayouts) {
  const RowMatrix<double> table = random_matrix<double>(7, 4, 3);
  Eigen::Matrix<int, Eigen::Dynamic, Eigen::Dynamic> ids_int(2, 2);  // column-major int
  ids_int << 6, 0,                                                   //
      2, 3;
  TokenMatrix ids(2, 2);
  ids << 6, 0,  //
      2, 3;
  const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> table_col = table;  // col-major
  EXPECT_EQ(apex::embed(table_col, ids_int), apex::embed(table, ids));
}

TEST(Embedding, EmptyInputGivesEmptyOutput) {
  const RowMatrix<float> table = random_matrix<float>(4, 3, 4);
  const RowMatrix<float> x = apex::embed(table, std::vector<std::int64_t>{});
  EXPECT_EQ(x.rows(), 0);
  EXPECT_EQ(x.cols(), 3);
}

TEST(Embedding, LargeBatchMatchesRowByRow) {
  // Large enough to run on several threads; every row must still be its own lookup.
  const RowMatrix<float> table = random_matrix<float>(100, 300, 5);
  const TokenMatrix ids = random_tokens(4, 257, 100, 6);
  const RowMatrix<float> x = apex::embed(table, ids);
  const float scale = static_cast<float>(std::sqrt(300.0));
  for (Index r = 0; r < x.rows(); ++r) {
    ASSERT_EQ(x.row(r), table.row(static_cast<Index>(ids(r / 257, r % 257))) * scale) << r;
  }
}

TEST(Embedding, RejectsOutOfRangeIdsBeforeWriting) {
  const RowMatrix<double> table = random_matrix<double>(3, 4, 7);
  for (const std::int64_t bad : {std::int64_t{-1}, std::int64_t{3}}) {
    TokenMatrix ids(2, 3);
    ids << 0, 1, 2,  //
        1, bad, 0;
    RowMatrix<double> out = RowMatrix<double>::Constant(6, 4, -7.0);
    expect_invalid([&] { apex::embed(table, ids, {}, out); },
                   {"[embed]", "token id (" + std::to_string(bad) + ")", "b=1, s=1", "[0, 3)"});
    EXPECT_TRUE((out.array() == -7.0).all()) << "output was written before the check";
  }
  RowMatrix<double> out = RowMatrix<double>::Constant(2, 4, -7.0);
  expect_invalid(
      [&] {
        apex::embed(table, std::vector<std::int64_t>{2, 3}, {}, out);
      },
      {"token id (3)", "b=0, s=1"});
  EXPECT_TRUE((out.array() == -7.0).all());
}

TEST(Embedding, RejectsBadShapesAndScale) {
  const RowMatrix<double> table = random_matrix<double>(3, 4, 8);
  TokenMatrix ids(1, 2);
  ids << 0, 1;
  RowMatrix<double> rows_wrong = RowMatrix<double>::Constant(3, 4, -7.0);
  expect_invalid([&] { apex::embed(table, ids, {}, rows_wrong); },
                 {"[embed] out (3 x 4)", "2 x 4"});
  EXPECT_TRUE((rows_wrong.array() == -7.0).all());
  RowMatrix<double> cols_wrong = RowMatrix<double>::Constant(2, 5, -7.0);
  expect_invalid([&] { apex::embed(table, ids, {}, cols_wrong); },
                 {"[embed] out (2 x 5)", "2 x 4"});
  EXPECT_TRUE((cols_wrong.array() == -7.0).all());

  RowMatrix<double> out = RowMatrix<double>::Constant(2, 4, -7.0);
  EmbeddingParams inf_scale;
  inf_scale.scale = std::numeric_limits<double>::infinity();
  expect_invalid([&] { apex::embed(table, ids, inf_scale, out); }, {"[embed] scale (inf)"});
  EmbeddingParams nan_scale;
  nan_scale.scale = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { apex::embed(table, ids, nan_scale, out); }, {"[embed] scale"});
  EXPECT_TRUE((out.array() == -7.0).all());
}

TEST(Embedding, LmHeadRejectsBadShapes) {
  const RowMatrix<double> table = random_matrix<double>(5, 4, 9);
  const RowMatrix<double> h = random_matrix<double>(2, 3, 10);
  RowMatrix<double> out = RowMatrix<double>::Constant(2, 5, -7.0);
  expect_invalid([&] { apex::lm_head(h, table, out); }, {"[lm_head] h width (3)", "d (4)"});
  EXPECT_TRUE((out.array() == -7.0).all());
  const RowMatrix<double> h4 = random_matrix<double>(2, 4, 11);
  RowMatrix<double> wrong = RowMatrix<double>::Constant(2, 4, -7.0);
  expect_invalid([&] { apex::lm_head(h4, table, wrong); }, {"[lm_head] out (2 x 4)", "2 x 5"});
  EXPECT_TRUE((wrong.array() == -7.0).all());
}

TEST(Embedding, TiedHeadScoresATokensOwnEmbeddingByItsSquaredNorm) {
  // With a plain lookup, logit[t, tokens[t]] = ||W_E[tokens[t]]||²: the property weight tying
  // relies on (an embedding scores highest against itself when rows have equal norms).
  const RowMatrix<double> table = random_matrix<double>(9, 6, 12);
  const std::vector<std::int64_t> ids = {3, 8, 0};
  EmbeddingParams plain;
  plain.scale = 1.0;
  const RowMatrix<double> logits = apex::lm_head(apex::embed(table, ids, plain), table);
  ASSERT_EQ(logits.rows(), 3);
  ASSERT_EQ(logits.cols(), 9);
  for (Index t = 0; t < 3; ++t) {
    const Index v = static_cast<Index>(ids[static_cast<std::size_t>(t)]);
    EXPECT_NEAR(logits(t, v), table.row(v).squaredNorm(), 1e-15);
  }
}

template <class Scalar>
class EmbeddingTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EmbeddingTyped, Scalars, apex::testing::ScalarName);

TYPED_TEST(EmbeddingTyped, MatchesReferenceOnRandomShapes) {
  using Scalar = TypeParam;
  struct Shape {
    Index vocab, d, batch, seq;
  };
  const Shape shapes[] = {
      {1, 1, 1, 1}, {7, 3, 1, 5}, {50, 17, 2, 9}, {33, 64, 3, 1}, {1000, 129, 2, 130}};
  std::uint32_t seed = 100;
  for (const Shape& s : shapes) {
    const RowMatrix<Scalar> table = random_matrix<Scalar>(s.vocab, s.d, ++seed);
    const TokenMatrix ids = random_tokens(s.batch, s.seq, s.vocab, ++seed);
    const RowMatrix<double> table_d = table.template cast<double>();
    SCOPED_TRACE(::testing::Message()
                 << "V=" << s.vocab << " d=" << s.d << " B=" << s.batch << " S=" << s.seq);
    expect_embed_matches<Scalar>(
        apex::embed(table, ids),
        apex::reference::embed(table_d, ids, std::sqrt(static_cast<double>(s.d))));
    EmbeddingParams params;
    params.scale = 0.37;
    RowMatrix<Scalar> out(s.batch * s.seq, s.d);
    apex::embed(table, ids, params, out);
    expect_embed_matches<Scalar>(out, apex::reference::embed(table_d, ids, 0.37));
  }
}

TYPED_TEST(EmbeddingTyped, LmHeadMatchesReference) {
  using Scalar = TypeParam;
  struct Shape {
    Index tokens, d, vocab;
  };
  const Shape shapes[] = {{1, 1, 1}, {1, 7, 13}, {5, 33, 17}, {19, 64, 100}, {64, 130, 257}};
  std::uint32_t seed = 200;
  for (const Shape& s : shapes) {
    const RowMatrix<Scalar> h = random_matrix<Scalar>(s.tokens, s.d, ++seed);
    const RowMatrix<Scalar> table = random_matrix<Scalar>(s.vocab, s.d, ++seed);
    const RowMatrix<double> h_d = h.template cast<double>();
    const RowMatrix<double> table_d = table.template cast<double>();
    const RowMatrix<double> expected = apex::reference::lm_head(h_d, table_d);
    const RowMatrix<double> magnitude = apex::reference::lm_head_magnitude(h_d, table_d);
    RowMatrix<Scalar> out(s.tokens, s.vocab);
    apex::lm_head(h, table, out);
    const double bound = static_cast<double>(s.d) * kUnitRoundoff<Scalar>;
    for (Index t = 0; t < s.tokens; ++t) {
      for (Index v = 0; v < s.vocab; ++v) {
        ASSERT_NEAR(static_cast<double>(out(t, v)), expected(t, v), bound * magnitude(t, v))
            << "tokens=" << s.tokens << " d=" << s.d << " V=" << s.vocab << " at (" << t << ", "
            << v << ")";
      }
    }
    EXPECT_EQ(apex::lm_head(h, table), out);
  }
}

// ---- The backward passes ------------------------------------------------------------------------

TEST(EmbeddingBackward, ReferencesMatchFiniteDifferences) {
  RowMatrix<double> table = random_matrix<double>(6, 4, 400);
  RowMatrix<double> h = random_matrix<double>(5, 4, 401);
  const TokenMatrix ids = random_tokens(1, 5, 6, 402);
  const RowMatrix<double> d_out = random_matrix<double>(5, 4, 403);
  const RowMatrix<double> d_logits = random_matrix<double>(5, 6, 404);
  // One loss through both uses of the tied table, as a model with weight tying has.
  const auto loss = [&] {
    return (apex::reference::embed(table, ids, 1.7).array() * d_out.array()).sum() +
           (apex::reference::lm_head(h, table).array() * d_logits.array()).sum();
  };
  const auto head = apex::reference::lm_head_backward(h, table, d_logits);
  const RowMatrix<double> d_table =
      apex::reference::embed_backward(ids, 6, 1.7, d_out) + head.d_table;
  apex::testing::expect_matches_differences(table, d_table, loss, "d_table");
  apex::testing::expect_matches_differences(h, head.d_h, loss, "d_h");
}

// Each row of d_table is a sum of its tokens' rows times the scale, and the head's gradients are
// products of length V (d_h) and T (d_table) in Scalar: each within n·u·Σ|terms| of the plain
// loop (the magnitude: the same sums on absolute values), the classical bound of a sum.
TYPED_TEST(EmbeddingTyped, BackwardMatchesReferenceAndTheTiedTableSumsBothUses) {
  using Scalar = TypeParam;
  struct Shape {
    Index vocab, d, batch, seq;
  };
  const Shape shapes[] = {{1, 1, 1, 1}, {7, 3, 2, 5}, {50, 17, 2, 40}, {1100, 24, 3, 70}};
  std::uint32_t seed = 410;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "V=" << s.vocab << " d=" << s.d);
    const Index tokens = s.batch * s.seq;
    const TokenMatrix ids = random_tokens(s.batch, s.seq, s.vocab, ++seed);
    const RowMatrix<Scalar> table = random_matrix<Scalar>(s.vocab, s.d, ++seed);
    const RowMatrix<Scalar> h = random_matrix<Scalar>(tokens, s.d, ++seed);
    const RowMatrix<Scalar> d_out = random_matrix<Scalar>(tokens, s.d, ++seed);
    const RowMatrix<Scalar> d_logits = random_matrix<Scalar>(tokens, s.vocab, ++seed);
    RowMatrix<Scalar> d_table(s.vocab, s.d), d_h(tokens, s.d);
    apex::embed_backward(ids, EmbeddingParams{}, d_out, d_table);
    const double scale = std::sqrt(static_cast<double>(s.d));
    const RowMatrix<double> embed_ref =
        apex::reference::embed_backward(ids, s.vocab, scale, d_out.template cast<double>());
    const RowMatrix<double> embed_magnitude = apex::reference::embed_backward(
        ids, s.vocab, scale, d_out.template cast<double>().cwiseAbs());
    const double u = kUnitRoundoff<Scalar>;
    for (Index v = 0; v < s.vocab; ++v) {
      for (Index j = 0; j < s.d; ++j) {
        ASSERT_NEAR(double(d_table(v, j)), embed_ref(v, j),
                    double(tokens + 2) * u * embed_magnitude(v, j) + 1e-300);
      }
    }
    apex::lm_head_backward(h, table, d_logits, d_h, d_table, apex::GradientUpdate::kAdd);
    const auto head = apex::reference::lm_head_backward(
        h.template cast<double>(), table.template cast<double>(), d_logits.template cast<double>());
    const auto magnitude = apex::reference::lm_head_backward(
        h.template cast<double>().cwiseAbs(), table.template cast<double>().cwiseAbs(),
        d_logits.template cast<double>().cwiseAbs());
    for (Index t = 0; t < tokens; ++t) {
      for (Index j = 0; j < s.d; ++j) {
        ASSERT_NEAR(double(d_h(t, j)), head.d_h(t, j),
                    double(s.vocab) * u * magnitude.d_h(t, j) + 1e-300);
      }
    }
    // d_table = embed's part (rounded) + the head's part: the sum adds one rounding.
    for (Index v = 0; v < s.vocab; ++v) {
      for (Index j = 0; j < s.d; ++j) {
        ASSERT_NEAR(
            double(d_table(v, j)), embed_ref(v, j) + head.d_table(v, j),
            double(tokens + 2) * u * (magnitude.d_table(v, j) + embed_magnitude(v, j)) + 1e-300)
            << "(" << v << ", " << j << ")";
      }
    }
  }
}

TEST(EmbeddingBackward, BitIdenticalForAnyThreadCount) {
  const TokenMatrix ids = random_tokens(3, 200, 1100, 420);
  const RowMatrix<float> table = random_matrix<float>(1100, 40, 421);
  const RowMatrix<float> h = random_matrix<float>(600, 40, 422);
  const RowMatrix<float> d_out = random_matrix<float>(600, 40, 423);
  const RowMatrix<float> d_logits = random_matrix<float>(600, 1100, 424);
  RowMatrix<float> t1(1100, 40), t2(1100, 40), h1(600, 40), h2(600, 40);
  {
    const apex::testing::OneThread one;
    apex::embed_backward(ids, {}, d_out, t1);
    apex::lm_head_backward(h, table, d_logits, h1, t1, apex::GradientUpdate::kAdd);
  }
  apex::embed_backward(ids, {}, d_out, t2);
  apex::lm_head_backward(h, table, d_logits, h2, t2, apex::GradientUpdate::kAdd);
  EXPECT_TRUE(t1 == t2 && h1 == h2);
}

TEST(EmbeddingBackward, RejectsBadInputBeforeWriting) {
  const TokenMatrix ids = random_tokens(2, 3, 10, 430);
  const RowMatrix<float> d_out = random_matrix<float>(6, 4, 431);
  RowMatrix<float> d_table = RowMatrix<float>::Constant(10, 4, 7.0f);
  TokenMatrix bad = ids;
  bad(1, 2) = 10;
  expect_invalid([&] { apex::embed_backward(bad, {}, d_out, d_table); },
                 {"[embed_backward] token id (10)", "[0, 10)"});
  expect_invalid([&] { apex::embed_backward(ids, {}, d_out.topRows(5), d_table); },
                 {"[embed_backward] d_out (5 x 4)", "6 x 4"});
  EXPECT_TRUE((d_table.array() == 7.0f).all());
  const RowMatrix<float> h = random_matrix<float>(6, 4, 432);
  const RowMatrix<float> d_logits = random_matrix<float>(6, 10, 433);
  RowMatrix<float> d_h = RowMatrix<float>::Constant(6, 4, 7.0f);
  expect_invalid([&] { apex::lm_head_backward(h, d_table, d_logits.leftCols(9), d_h, d_table); },
                 {"[lm_head_backward] d_logits (6 x 9)"});
  RowMatrix<float> table = random_matrix<float>(10, 4, 434);
  expect_invalid([&] { apex::lm_head_backward(h, table, d_logits, d_h, table); },
                 {"[lm_head_backward] d_h and d_table must not overlap"});
  EXPECT_TRUE((d_table.array() == 7.0f).all() && (d_h.array() == 7.0f).all());
}

// ---------------------------------------------------------------------------------------------
// 16-bit tables (Eigen::half, Eigen::bfloat16)
// ---------------------------------------------------------------------------------------------

template <class T>
class Embedding16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Embedding16Bit, SixteenBit, apex::testing::ScalarName);

// Each output is the stored row times float(scale), formed in float and rounded once to the
// output's type: exactly the float lookup on the widened table, and that result rounded for a
// 16-bit output.
TYPED_TEST(Embedding16Bit, WidensTheStoredRowsAndRoundsOnce) {
  using T = TypeParam;
  const apex::RowMatrix<T> table16 =
      apex::testing::random_matrix<float>(11, 24, 91, -1.0, 1.0).cast<T>();
  const apex::RowMatrix<float> widened = table16.template cast<float>();
  apex::TokenMatrix tokens(2, 3);
  tokens << 0, 10, 3, 3, 7, 1;
  apex::RowMatrix<float> got(6, 24), want(6, 24);
  apex::embed(table16, tokens, {}, got);
  apex::embed(widened, tokens, {}, want);
  EXPECT_TRUE((got.array() == want.array()).all());
  apex::RowMatrix<T> got16(6, 24);
  apex::embed(table16, tokens, {}, got16);
  for (apex::Index r = 0; r < 6; ++r) {
    for (apex::Index c = 0; c < 24; ++c) {
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(got16(r, c)),
                Eigen::numext::bit_cast<std::uint16_t>(apex::round_to<T>(want(r, c))));
    }
  }
  // A scale that float cannot hold is applied in double, as for a float table.
  apex::EmbeddingParams tiny;
  tiny.scale = 1e-50;
  apex::embed(table16, tokens, tiny, got);
  apex::embed(widened, tokens, tiny, want);
  EXPECT_TRUE((got.array() == want.array()).all());
}

TYPED_TEST(Embedding16Bit, RejectsBadIdsBeforeWriting) {
  using T = TypeParam;
  const apex::RowMatrix<T> table16 = apex::RowMatrix<float>::Ones(4, 8).cast<T>();
  apex::TokenMatrix tokens(1, 2);
  tokens << 1, 4;
  apex::RowMatrix<float> out = apex::RowMatrix<float>::Constant(2, 8, 5.0f);
  apex::testing::expect_invalid([&] { apex::embed(table16, tokens, {}, out); },
                                {"[embed] token id (4)"});
  EXPECT_TRUE((out.array() == 5.0f).all());
}

}  // namespace
}  // namespace embedding_test
