// SPDX-License-Identifier: MIT
#include <apex/mrope.hpp>
#include <apex/rope.hpp>
#include <apex/yarn.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_util.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace mrope_test {
namespace {

using apex::Index;
using apex::MropeLayout;
using apex::MropeSections;
using apex::RopePairing;
using apex::RopeParams;
using apex::RopeTable;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

using Ids = Eigen::Matrix<Index, 3, Eigen::Dynamic>;

// ---------------------------------------------------------------------------------------------
// The plain double reference, written from the published definition (HuggingFace transformers:
// models/qwen2_vl/modeling_qwen2_vl.py apply_multimodal_rotary_pos_emb, and
// models/qwen3_vl/modeling_qwen3_vl.py Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope),
// not from the library's index rule.

// The stream of every pair, built the way HuggingFace builds it. Sections: the pairs are cut
// into blocks of mrope_section[0], [1], [2] pairs and block k takes stream k. Interleaved:
// every pair starts temporal, then for (dim, offset) = (1, 1), (2, 2) the pairs
// offset, offset + 3, … below 3·mrope_section[dim] take stream dim.
std::vector<int> reference_streams(const std::array<Index, 3>& sections, MropeLayout layout) {
  std::vector<int> stream;
  if (layout == MropeLayout::kSections) {
    for (int k = 0; k < 3; ++k)
      stream.insert(stream.end(), std::size_t(sections[std::size_t(k)]), k);
    return stream;
  }
  stream.assign(std::size_t(sections[0] + sections[1] + sections[2]), 0);
  for (int dim = 1; dim <= 2; ++dim) {
    for (Index i = dim; i < 3 * sections[std::size_t(dim)]; i += 3) stream[std::size_t(i)] = dim;
  }
  return stream;
}

// Every pair i of every head of row t turns by the angle p·θ_i in double, p = ids(s(i), t):
//   (a, b) -> magnitude · (a cos − b sin, a sin + b cos),
// (a, b) = (2i, 2i+1) for the interleaved pairing and (i, i + d_r/2) for half-split.
// Features past d_r = 2·θ.size() in each head are copied.
Eigen::MatrixXd reference_mrope(const Eigen::MatrixXd& x, const Ids& ids,
                                const std::vector<double>& theta, const std::vector<int>& stream,
                                Index head_dim, bool half_split, double magnitude = 1.0) {
  const Index pairs = static_cast<Index>(theta.size());
  const Index heads = x.cols() / head_dim;
  Eigen::MatrixXd out = x;
  for (Index t = 0; t < x.rows(); ++t) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < pairs; ++i) {
        const Index a = h * head_dim + (half_split ? i : 2 * i);
        const Index b = h * head_dim + (half_split ? i + pairs : 2 * i + 1);
        const double p = static_cast<double>(ids(stream[std::size_t(i)], t));
        const double angle = p * theta[std::size_t(i)];
        const double c = std::cos(angle), s = std::sin(angle);
        out(t, a) = magnitude * (c * x(t, a) - s * x(t, b));
        out(t, b) = magnitude * (s * x(t, a) + c * x(t, b));
      }
    }
  }
  return out;
}

// θ_i = base^(-2i/d_r).
std::vector<double> plain_theta(Index rotary_dim, double base) {
  std::vector<double> theta;
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    theta.push_back(std::pow(base, -2.0 * double(i) / double(rotary_dim)));
  }
  return theta;
}

// Tolerance, absolute, for inputs in [-1, 1] and tables of magnitude M. Each output a·c − b·s
// rounds c and s once (to Scalar, in the table) and then two products and a sum, each within
// u = ε/2 relative: at most about 3·u·(|a·c| + |b·s|) ≤ 3·u·√2·M·|(a, b)| ≤ 6·u·M = 3·ε·M,
// i.e. a few ulp of the rotated values (|·| ≤ √2·M). The reference forms the same angles in
// double (the tables do too, never in Scalar), so 4·ε·M bounds float and double alike.
template <class Scalar>
double tolerance(double magnitude = 1.0) {
  return 4.0 * double(std::numeric_limits<Scalar>::epsilon()) * std::max(1.0, magnitude);
}

double max_abs_diff(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
  return (a - b).cwiseAbs().maxCoeff();
}

// Ids drawn uniformly from [0, positions) for each stream independently.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (columns, range), as named
Ids random_ids(Index tokens, Index positions, std::mt19937& rng) {
  std::uniform_int_distribution<Index> pick(0, positions - 1);
  Ids ids(3, tokens);
  for (Index k = 0; k < 3; ++k) {
    for (Index t = 0; t < tokens; ++t) ids(k, t) = pick(rng);
  }
  return ids;
}

struct Case {
  const char* name;
  std::array<Index, 3> sections;
  MropeLayout layout;
  Index head_dim, rotary_dim, heads;
};

// Qwen2-VL / Qwen2.5-VL and Qwen3-VL as their checkpoints configure them (head_dim 128), then
// partial rotary, empty sections, sections that leave runs of two temporal pairs, and rotary
// parts wider than mrope.hpp gathers on the stack.
const Case kCases[] = {
    {"qwen2_vl", {16, 24, 24}, MropeLayout::kSections, 128, 128, 3},
    {"qwen3_vl", {24, 20, 20}, MropeLayout::kInterleaved, 128, 128, 3},
    {"sections_partial", {4, 6, 6}, MropeLayout::kSections, 48, 32, 2},
    {"interleaved_partial", {6, 5, 5}, MropeLayout::kInterleaved, 40, 32, 2},
    {"sections_empty_height", {8, 0, 8}, MropeLayout::kSections, 34, 32, 3},
    {"interleaved_empty_height", {11, 0, 5}, MropeLayout::kInterleaved, 32, 32, 1},
    {"interleaved_height_longer", {7, 5, 4}, MropeLayout::kInterleaved, 36, 32, 2},
    // Rotary parts wider than the gathered row (512 features) turn pair by pair from the table.
    {"wide_sections", {130, 65, 65}, MropeLayout::kSections, 520, 520, 1},
    {"wide_interleaved", {100, 80, 80}, MropeLayout::kInterleaved, 528, 520, 1},
};

template <class Scalar>
class MropeTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MropeTyped, Scalars, apex::testing::ScalarName);

// ---------------------------------------------------------------------------------------------
// The index rule

TEST(Mrope, StreamOfEachPairIsHuggingFacesRule) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const MropeSections m{c.sections, c.layout};
    const std::vector<int> expected = reference_streams(c.sections, c.layout);
    ASSERT_EQ(Index(expected.size()), c.rotary_dim / 2);
    std::array<Index, 3> count{};
    for (Index i = 0; i < c.rotary_dim / 2; ++i) {
      EXPECT_EQ(apex::mrope_stream(m, i), expected[std::size_t(i)]) << "pair " << i;
      ++count[std::size_t(apex::mrope_stream(m, i))];
    }
    EXPECT_EQ(count, c.sections);  // each stream turns its section's number of pairs
  }
  // The drawings of mrope.hpp: Qwen2-VL's blocks and Qwen3-VL's t h w … t h w t t t t.
  const MropeSections qwen2{{16, 24, 24}, MropeLayout::kSections};
  EXPECT_EQ(apex::mrope_stream(qwen2, 15), 0);
  EXPECT_EQ(apex::mrope_stream(qwen2, 16), 1);
  EXPECT_EQ(apex::mrope_stream(qwen2, 39), 1);
  EXPECT_EQ(apex::mrope_stream(qwen2, 40), 2);
  const MropeSections qwen3{{24, 20, 20}, MropeLayout::kInterleaved};
  const int tail[] = {0, 1, 2, 0, 0, 0, 0};  // pairs 57 … 63
  for (Index i = 57; i < 64; ++i) EXPECT_EQ(apex::mrope_stream(qwen3, i), tail[i - 57]) << i;
}

// ---------------------------------------------------------------------------------------------
// Against the reference

TYPED_TEST(MropeTyped, MatchesReferenceForQwenLayoutsBothPairingsAndPartialRotary) {
  using Scalar = TypeParam;
  std::mt19937 rng(2024);
  const Index positions = 3000, tokens = 23;
  for (const Case& c : kCases) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      const bool half = pairing == RopePairing::kHalfSplit;
      SCOPED_TRACE(::testing::Message() << c.name << " half_split " << half);
      const RopeTable<Scalar> table(positions, c.head_dim, RopeParams{1e6, c.rotary_dim, pairing});
      const MropeSections m{c.sections, c.layout};
      const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, c.heads * c.head_dim, rng);
      const Ids ids = random_ids(tokens, positions, rng);
      const Eigen::MatrixXd expected =
          reference_mrope(x.template cast<double>(), ids, plain_theta(c.rotary_dim, 1e6),
                          reference_streams(c.sections, c.layout), c.head_dim, half);
      const RowMatrix<Scalar> y = apex::mrope(table, m, ids, x);
      EXPECT_LE(max_abs_diff(y.template cast<double>(), expected), tolerance<Scalar>());
      RowMatrix<Scalar> in_place = x;
      apex::apply_mrope(table, m, ids, in_place);
      EXPECT_EQ(in_place, y);
    }
  }
}

// Positions up to 2^20 (the table's last row): the angle p·θ_i is formed in double by the
// table, so float keeps its few-ulp bound there (forming it in float would be off by ~1e-2).
// A narrow head keeps the two tables small: 2 × (2^20 + 1) × 8 entries.
TYPED_TEST(MropeTyped, MatchesReferenceAtPositionsUpTo2To20) {
  using Scalar = TypeParam;
  const Index positions = (Index{1} << 20) + 1, head_dim = 12, rotary_dim = 8;
  std::mt19937 rng(77);
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> table(positions, head_dim, RopeParams{10000.0, rotary_dim, pairing});
    for (const MropeLayout layout : {MropeLayout::kSections, MropeLayout::kInterleaved}) {
      const MropeSections m{{2, 1, 1}, layout};
      const Index tokens = 40;
      Ids ids = random_ids(tokens, positions, rng);
      ids(0, 0) = positions - 1;  // 2^20 in every stream somewhere
      ids(1, 1) = positions - 1;
      ids(2, 2) = positions - 1;
      for (Index t = 3; t < 8; ++t) ids.col(t).setConstant(positions - 1 - t);
      const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, 2 * head_dim, rng);
      const Eigen::MatrixXd expected = reference_mrope(
          x.template cast<double>(), ids, plain_theta(rotary_dim, 10000.0),
          reference_streams(m.sections, layout), head_dim, pairing == RopePairing::kHalfSplit);
      EXPECT_LE(max_abs_diff(apex::mrope(table, m, ids, x).template cast<double>(), expected),
                tolerance<Scalar>());
    }
  }
}

// Qwen2.5-VL long-context variants combine the sections with scaled frequencies: a YaRN table
// (frequencies θ' and magnitude from yarn.hpp) and arbitrary frequencies with a magnitude.
TYPED_TEST(MropeTyped, WorksWithYarnAndArbitraryFrequencyTables) {
  using Scalar = TypeParam;
  std::mt19937 rng(31);
  const Index head_dim = 128, positions = 5000, tokens = 17;
  apex::YarnParams yarn;
  yarn.scale = 4.0;
  yarn.original_context = 1024;
  yarn.base = 1e6;
  std::uniform_real_distribution<double> frequency(0.0, 1.5);
  Vector<double> theta(64);
  for (Index i = 0; i < theta.size(); ++i) theta(i) = frequency(rng);
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const bool half = pairing == RopePairing::kHalfSplit;
    const Vector<double> yarn_theta = apex::yarn_frequencies(head_dim, yarn);
    const double yarn_magnitude = apex::yarn_table_magnitude(yarn);
    ASSERT_GT(yarn_magnitude, 1.0);
    struct Table {
      RopeTable<Scalar> table;
      Vector<double> theta;
      double magnitude;
    };
    const Table tables[] = {
        {apex::yarn_table<Scalar>(positions, head_dim, 0, pairing, yarn), yarn_theta,
         yarn_magnitude},
        {RopeTable<Scalar>::from_frequencies(theta, positions, head_dim, pairing, 1.25), theta,
         1.25},
    };
    for (const Table& t : tables) {
      for (const MropeSections& m : {MropeSections{{16, 24, 24}, MropeLayout::kSections},
                                     MropeSections{{24, 20, 20}, MropeLayout::kInterleaved}}) {
        const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, 2 * head_dim, rng);
        const Ids ids = random_ids(tokens, positions, rng);
        const std::vector<double> th(t.theta.data(), t.theta.data() + t.theta.size());
        const Eigen::MatrixXd expected =
            reference_mrope(x.template cast<double>(), ids, th,
                            reference_streams(m.sections, m.layout), head_dim, half, t.magnitude);
        EXPECT_LE(max_abs_diff(apex::mrope(t.table, m, ids, x).template cast<double>(), expected),
                  tolerance<Scalar>(t.magnitude));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Properties

// Text tokens carry the same id in all three streams: M-RoPE is then RoPE, bit for bit, for
// every layout and pairing, partial rotary included.
TYPED_TEST(MropeTyped, EqualIdsGiveApplyRopeBitForBit) {
  using Scalar = TypeParam;
  std::mt19937 rng(5);
  const Index positions = 4096, tokens = 29;
  for (const Case& c : kCases) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      SCOPED_TRACE(::testing::Message() << c.name << " pairing " << int(pairing));
      const RopeTable<Scalar> table(positions, c.head_dim,
                                    RopeParams{10000.0, c.rotary_dim, pairing});
      const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, c.heads * c.head_dim, rng);
      std::uniform_int_distribution<Index> pick(0, positions - 1);
      Vector<Index> p(tokens);
      for (Index t = 0; t < tokens; ++t) p(t) = pick(rng);
      const Ids ids = p.transpose().replicate(3, 1);
      EXPECT_EQ(apex::mrope(table, MropeSections{c.sections, c.layout}, ids, x),
                apex::rope(table, p, x));
    }
  }
}

// A pair turned in stream s depends on the ids of stream s alone: new ids in the other two
// streams leave it unchanged bit for bit (and do change the pairs of those streams).
TYPED_TEST(MropeTyped, PairOfAStreamDependsOnlyOnThatStreamsIds) {
  using Scalar = TypeParam;
  std::mt19937 rng(9);
  const Index positions = 2048, tokens = 13;
  for (const Case& c : kCases) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      SCOPED_TRACE(::testing::Message() << c.name << " pairing " << int(pairing));
      const RopeTable<Scalar> table(positions, c.head_dim,
                                    RopeParams{10000.0, c.rotary_dim, pairing});
      const MropeSections m{c.sections, c.layout};
      const std::vector<int> stream = reference_streams(c.sections, c.layout);
      const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, c.heads * c.head_dim, rng);
      const Ids ids = random_ids(tokens, positions, rng);
      const RowMatrix<Scalar> y = apex::mrope(table, m, ids, x);
      for (int kept = 0; kept < 3; ++kept) {
        Ids other = random_ids(tokens, positions, rng);
        other.row(kept) = ids.row(kept);
        for (Index t = 0; t < tokens; ++t) {  // every other id differs from before
          for (Index k = 0; k < 3; ++k) {
            if (k != kept && other(k, t) == ids(k, t)) other(k, t) = (ids(k, t) + 1) % positions;
          }
        }
        const RowMatrix<Scalar> z = apex::mrope(table, m, other, x);
        const Index pairs = c.rotary_dim / 2;
        for (Index h = 0; h < c.heads; ++h) {
          for (Index i = 0; i < pairs; ++i) {
            const Index a = h * c.head_dim + (pairing == RopePairing::kHalfSplit ? i : 2 * i);
            const Index b = pairing == RopePairing::kHalfSplit ? a + pairs : a + 1;
            const bool same = z.col(a) == y.col(a) && z.col(b) == y.col(b);
            EXPECT_EQ(same, stream[std::size_t(i)] == kept)
                << "stream kept " << kept << " head " << h << " pair " << i;
          }
        }
      }
    }
  }
}

TYPED_TEST(MropeTyped, AnyIntegerIdTypeAnyRowStrideAndTailUntouched) {
  using Scalar = TypeParam;
  std::mt19937 rng(41);
  const Index head_dim = 40, rotary_dim = 32, positions = 100, tokens = 11;
  const RopeTable<Scalar> table(positions, head_dim,
                                RopeParams{10000.0, rotary_dim, RopePairing::kHalfSplit});
  const MropeSections m{{6, 5, 5}, MropeLayout::kInterleaved};
  const Ids ids = random_ids(tokens, positions, rng);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, 2 * head_dim, rng);
  const RowMatrix<Scalar> y = apex::mrope(table, m, ids, x);
  EXPECT_EQ(apex::mrope(table, m, Eigen::MatrixXi(ids.cast<int>()), x), y);
  EXPECT_EQ(
      apex::mrope(table, m,
                  Eigen::Matrix<std::uint16_t, 3, Eigen::Dynamic>(ids.cast<std::uint16_t>()), x),
      y);
  using RowIds = Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  EXPECT_EQ(apex::mrope(table, m, RowIds(ids.cast<std::int64_t>()), x), y);
  for (Index h = 0; h < 2; ++h) {  // features [rotary_dim, head_dim) of each head pass through
    EXPECT_EQ(RowMatrix<Scalar>(y.middleCols(h * head_dim + rotary_dim, head_dim - rotary_dim)),
              RowMatrix<Scalar>(x.middleCols(h * head_dim + rotary_dim, head_dim - rotary_dim)));
  }
  // Two heads as a block of columns of a wider matrix: rotated in place, neighbours untouched.
  RowMatrix<Scalar> wide = random_matrix<Scalar>(tokens, 4 * head_dim, rng);
  const RowMatrix<Scalar> before = wide;
  wide.middleCols(head_dim, 2 * head_dim) = x;
  apex::apply_mrope(table, m, ids, wide.middleCols(head_dim, 2 * head_dim));
  EXPECT_EQ(RowMatrix<Scalar>(wide.middleCols(head_dim, 2 * head_dim)), y);
  EXPECT_EQ(RowMatrix<Scalar>(wide.leftCols(head_dim)),
            RowMatrix<Scalar>(before.leftCols(head_dim)));
  EXPECT_EQ(RowMatrix<Scalar>(wide.rightCols(head_dim)),
            RowMatrix<Scalar>(before.rightCols(head_dim)));
}

// Rows are independent and split statically: the same bits on one thread and on two, for a
// problem large enough to be spread (tokens · cols ≥ 2^16).
TYPED_TEST(MropeTyped, SameBitsOnOneAndTwoThreads) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP";
#else
  using Scalar = TypeParam;
  std::mt19937 rng(13);
  const Index tokens = 300, heads = 4, head_dim = 128, positions = 8192;
  const RowMatrix<Scalar> x = random_matrix<Scalar>(tokens, heads * head_dim, rng);
  const Ids ids = random_ids(tokens, positions, rng);
  const int saved = omp_get_max_threads();
  for (const Case& c : {kCases[0], kCases[1]}) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      const RopeTable<Scalar> table(positions, head_dim, RopeParams{1e6, 0, pairing});
      const MropeSections m{c.sections, c.layout};
      omp_set_num_threads(1);
      const RowMatrix<Scalar> one = apex::mrope(table, m, ids, x);
      omp_set_num_threads(2);
      const RowMatrix<Scalar> two = apex::mrope(table, m, ids, x);
      EXPECT_EQ(one, two) << c.name;
      EXPECT_NE(one, x);
    }
  }
  omp_set_num_threads(saved);
#endif
}

// ---------------------------------------------------------------------------------------------
// 16-bit rows (Eigen::half, Eigen::bfloat16) with a float table

template <class T>
class Mrope16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Mrope16Bit, SixteenBit, apex::testing::ScalarName);

// Each element is the rotation of the stored values computed in float and rounded once: within
// one rounding of T (2^-11 relative for half, 2^-8 for bfloat16; the bound below is one step of
// T, twice that) of the double reference on the widened inputs, plus float's few ulp (1e-6
// absolute) on values that cancel. Features past the rotary width keep their bits, and equal
// ids give apply_rope's bits.
TYPED_TEST(Mrope16Bit, RotatesStoredValuesAndRoundsOnce) {
  using T = TypeParam;
  const double step = std::is_same_v<T, Eigen::half> ? 0x1p-10 : 0x1p-7;
  std::mt19937 rng(81);
  const Index head_dim = 40, rotary_dim = 32, positions = 600, tokens = 9;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<float> table(positions, head_dim, RopeParams{10000.0, rotary_dim, pairing});
    for (const MropeSections& m : {MropeSections{{4, 6, 6}, MropeLayout::kSections},
                                   MropeSections{{6, 5, 5}, MropeLayout::kInterleaved}}) {
      const RowMatrix<T> x16 = random_matrix<float>(tokens, 2 * head_dim, rng, -2.0, 2.0).cast<T>();
      const Ids ids = random_ids(tokens, positions, rng);
      const Eigen::MatrixXd expected = reference_mrope(
          x16.template cast<double>(), ids, plain_theta(rotary_dim, 10000.0),
          reference_streams(m.sections, m.layout), head_dim, pairing == RopePairing::kHalfSplit);
      RowMatrix<T> rotated = x16;
      apex::apply_mrope(table, m, ids, rotated);
      for (Index r = 0; r < tokens; ++r) {
        for (Index c = 0; c < 2 * head_dim; ++c) {
          const double got = static_cast<double>(rotated(r, c));
          ASSERT_LE(std::abs(got - expected(r, c)), step * std::abs(expected(r, c)) + 1e-6)
              << "row " << r << ", column " << c;
          if (c % head_dim >= rotary_dim) {
            ASSERT_EQ(static_cast<float>(rotated(r, c)), static_cast<float>(x16(r, c)));
          }
        }
      }
      Vector<Index> p = ids.row(0).transpose();
      RowMatrix<T> by_mrope = x16, by_rope = x16;
      apex::apply_mrope(table, m, Ids(p.transpose().replicate(3, 1)), by_mrope);
      apex::apply_rope(table, p, by_rope);
      EXPECT_TRUE(
          (by_mrope.template cast<float>().array() == by_rope.template cast<float>().array())
              .all());
    }
  }
}

TYPED_TEST(Mrope16Bit, ChecksIdsBeforeTouchingTheRows) {
  using T = TypeParam;
  const RopeTable<float> table(8, 4);
  RowMatrix<T> x = RowMatrix<float>::Constant(3, 8, 1.5f).cast<T>();
  Ids ids = Ids::Zero(3, 3);
  ids(2, 2) = 8;
  expect_invalid(
      [&] {
        apex::apply_mrope(table, MropeSections{{1, 0, 1}}, ids, x);
      },
      {"[mrope]", "position id (8)", "stream 2 (width)", "row 2"});
  EXPECT_TRUE((x.template cast<float>().array() == 1.5f).all());
}

// ---------------------------------------------------------------------------------------------
// Bad input: each throws std::invalid_argument naming the argument and its value, and leaves x
// untouched.

class MropeBadInput : public ::testing::Test {
 protected:
  MropeBadInput() : table_(16, 8), x_(random_matrix<float>(5, 16, 17)), before_(x_) {}
  void expect_rejected(const MropeSections& m, const Ids& ids,
                       std::initializer_list<std::string> parts) {
    expect_invalid([&] { apex::apply_mrope(table_, m, ids, x_); }, parts);
    EXPECT_EQ(x_, before_);
  }
  RopeTable<float> table_;  // 16 positions, head_dim 8: 4 pairs
  RowMatrix<float> x_;      // 5 tokens, 2 heads
  RowMatrix<float> before_;
  Ids ids_ = Ids::Constant(3, 5, 3);
};

TEST_F(MropeBadInput, SectionsNotSummingToThePairs) {
  expect_rejected(MropeSections{{1, 1, 1}}, ids_,
                  {"[mrope]", "mrope_section (1, 1, 1)", "must sum to rotary_dim / 2 (4)"});
  expect_rejected(MropeSections{{16, 24, 24}, MropeLayout::kInterleaved}, ids_,
                  {"[mrope]", "mrope_section (16, 24, 24)", "rotary_dim / 2 (4)"});
  // Huge sections are compared one at a time: no overflowing sum.
  const Index huge = std::numeric_limits<Index>::max();
  expect_rejected(MropeSections{{huge, huge, 2}}, ids_, {"[mrope]", "must sum to"});
  apex::apply_mrope(table_, MropeSections{{2, 1, 1}}, ids_, x_);  // a valid one rotates
  EXPECT_NE(x_, before_);
}

TEST_F(MropeBadInput, NegativeSection) {
  expect_rejected(MropeSections{{3, -1, 2}}, ids_,
                  {"[mrope]", "mrope_section (3, -1, 2)", "negative", "mrope_section[1] is -1"});
}

TEST_F(MropeBadInput, InterleavedSectionsPastThePairs) {
  // 4 pairs: t h w t. [1, 2, 1] sums to 4, but its second height pair would be pair 4.
  expect_rejected(MropeSections{{1, 2, 1}, MropeLayout::kInterleaved}, ids_,
                  {"[mrope]", "interleaved mrope_section (1, 2, 1)", "last height pair", "(4)",
                   "rotary_dim / 2 (4)"});
  expect_rejected(MropeSections{{1, 1, 2}, MropeLayout::kInterleaved}, ids_,
                  {"[mrope]", "last width pair", "(5)"});
  // The same sections are fine as contiguous blocks.
  apex::apply_mrope(table_, MropeSections{{1, 2, 1}}, ids_, x_);
  EXPECT_NE(x_, before_);
}

TEST_F(MropeBadInput, IdsOfTheWrongShape) {
  const MropeSections m{{2, 1, 1}};
  expect_invalid([&] { apex::apply_mrope(table_, m, Eigen::MatrixXi::Zero(2, 5), x_); },
                 {"[mrope]", "position_ids shape [2, 5]", "[3, x.rows()] = [3, 5]"});
  expect_invalid([&] { apex::apply_mrope(table_, m, Ids::Zero(3, 4), x_); },
                 {"[mrope]", "position_ids shape [3, 4]", "[3, 5]"});
  expect_invalid([&] { apex::apply_mrope(table_, m, Vector<Index>::Zero(5), x_); },
                 {"[mrope]", "position_ids shape [5, 1]"});
  EXPECT_EQ(x_, before_);
}

TEST_F(MropeBadInput, IdOutOfRange) {
  const MropeSections m{{2, 1, 1}};
  Ids ids = ids_;
  ids(1, 3) = 16;
  expect_rejected(m, ids,
                  {"[mrope]", "position id (16)", "stream 1 (height)", "row 3",
                   "[0, max_positions) = [0, 16)"});
  ids(1, 3) = 3;
  ids(0, 4) = -1;
  expect_rejected(m, ids, {"[mrope]", "position id (-1)", "stream 0 (temporal)", "row 4"});
  // An id of a stream with no pairs is checked too: it is still an input of the wrong range.
  ids(0, 4) = 3;
  ids(2, 0) = 100;
  expect_rejected(MropeSections{{2, 2, 0}}, ids,
                  {"[mrope]", "position id (100)", "stream 2 (width)", "row 0"});
}

TEST_F(MropeBadInput, ColumnsNotAMultipleOfHeadDim) {
  RowMatrix<float> x = x_.leftCols(12);
  const RowMatrix<float> before = x;
  expect_invalid(
      [&] {
        apex::apply_mrope(table_, MropeSections{{2, 1, 1}}, ids_, x);
      },
      {"[mrope]", "x.cols() (12)", "head_dim (8)"});
  EXPECT_EQ(x, before);
}

TEST_F(MropeBadInput, EmptyTable) {
  const RopeTable<float> empty;
  expect_invalid(
      [&] {
        apex::apply_mrope(empty, MropeSections{{2, 1, 1}}, ids_, x_);
      },
      {"[mrope]", "table is empty"});
  RopeTable<float> moved(16, 8);
  const RopeTable<float> taken = std::move(moved);
  const RopeTable<float>& emptied = moved;  // NOLINT(bugprone-use-after-move): now empty
  expect_invalid(
      [&] {
        apex::apply_mrope(emptied, MropeSections{{2, 1, 1}}, ids_, x_);
      },
      {"[mrope]", "table is empty"});
  EXPECT_EQ(taken.max_positions(), 16);
  EXPECT_EQ(x_, before_);
}

// ---------------------------------------------------------------------------------------------
// The backward pass: each pair turned back, the reference at the negated ids.

TYPED_TEST(MropeTyped, BackwardIsTheTransposedRotation) {
  using Scalar = TypeParam;
  std::mt19937 rng(909);
  const Index positions = 3000, tokens = 23;
  for (const Case& c : kCases) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      const bool half = pairing == RopePairing::kHalfSplit;
      SCOPED_TRACE(::testing::Message() << c.name << " half_split " << half);
      const RopeTable<Scalar> table(positions, c.head_dim, RopeParams{1e6, c.rotary_dim, pairing});
      const MropeSections m{c.sections, c.layout};
      const RowMatrix<Scalar> dy = random_matrix<Scalar>(tokens, c.heads * c.head_dim, rng);
      const Ids ids = random_ids(tokens, positions, rng);
      RowMatrix<Scalar> dx = dy;
      apex::apply_mrope_backward(table, m, ids, dx);
      const Ids negated = -ids;
      const Eigen::MatrixXd expected =
          reference_mrope(dy.template cast<double>(), negated, plain_theta(c.rotary_dim, 1e6),
                          reference_streams(c.sections, c.layout), c.head_dim, half);
      EXPECT_LE(max_abs_diff(dx.template cast<double>(), expected), tolerance<Scalar>());
    }
  }
}

}  // namespace
}  // namespace mrope_test
