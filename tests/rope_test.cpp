// SPDX-License-Identifier: MIT
#include <apex/rope.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "reference/rope.hpp"
#include "test_util.hpp"

namespace rope_test {
namespace {

using apex::Index;
using apex::RopeCacheWidth;
using apex::RopePairing;
using apex::RopeParams;
using apex::RopeTable;
using apex::RowMatrix;
using apex::Vector;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

constexpr double kPi = 3.14159265358979323846;

// Tolerances, one place per scalar type. Inputs are uniform in [-1, 1] and the tables have
// magnitude M (1 unless stated). Each output a·c − b·s rounds c and s once (to Scalar) and then
// the two products and their sum: at most about 1.5·ε·(|a·c| + |b·s|) ≤ 1.5·√2·ε·M·|(a, b)|
// ≤ 3·ε·M. The reference forms the same angles in double, so the bound below (4·ε·M) holds for
// float and double alike.
template <class Scalar>
double kernel_tolerance(double magnitude = 1.0) {
  return 4.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon()) *
         std::max(1.0, magnitude);
}

template <class Scalar>
Eigen::MatrixXd to_double(const RowMatrix<Scalar>& x) {
  return x.template cast<double>();
}

std::vector<long long> offset_positions(Index offset, Index rows) {
  std::vector<long long> p;
  for (Index t = 0; t < rows; ++t) p.push_back(static_cast<long long>(offset + t));
  return p;
}

// The largest |a − b| over all entries.
double max_abs_diff(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
  return (a - b).cwiseAbs().maxCoeff();
}

// ---------------------------------------------------------------------------------------------
// Worked examples

TEST(Rope, S4_3_FrequencyTable) {
  // §4.3 prints θ = 1, 0.0316, 0.0010, 0.00003 for d_h = 8; its own formula θ_i = 10000^(-2i/8)
  // gives 1, 0.1, 0.01, 0.001 (SEED-NOTES.md).
  const Vector<double> theta = apex::rope_frequencies(8, 10000.0);
  ASSERT_EQ(theta.size(), 4);
  const double expected[] = {1.0, 0.1, 0.01, 0.001};
  const double wavelength[] = {6.283, 62.83, 628.3, 6283.0};
  for (Index i = 0; i < 4; ++i) {
    EXPECT_NEAR(theta(i), expected[i], 1e-15 * expected[i]) << "pair " << i;
    const double lambda = 2.0 * kPi / theta(i);
    EXPECT_NEAR(lambda, wavelength[i], 5e-4 * wavelength[i]) << "pair " << i;
  }
}

TEST(Rope, S4_6_WorkedExampleAtPosition3) {
  const RopeTable<double> table(4, 4);  // d_head = 4, base 10000, positions 0..3
  // Step 3: cos = [cos 3, cos 3, cos 0.03, cos 0.03], sin likewise (the document rounds).
  const double doc_cos[] = {-0.990, -0.990, 0.9996, 0.9996};
  const double doc_sin[] = {0.141, 0.141, 0.030, 0.030};
  const double angle[] = {3.0, 3.0, 0.03, 0.03};
  for (Index j = 0; j < 4; ++j) {
    EXPECT_NEAR(table.cos()(3, j), doc_cos[j], 5e-4) << j;
    EXPECT_NEAR(table.sin()(3, j), doc_sin[j], 5e-4) << j;
    EXPECT_NEAR(table.cos()(3, j), std::cos(angle[j]), 1e-15) << j;
    EXPECT_NEAR(table.sin()(3, j), std::sin(angle[j]), 1e-15) << j;
  }

  RowMatrix<double> q(1, 4);
  q << 1.0, 0.5, 0.3, -0.2;
  const RowMatrix<double> rotated = apex::rope(table, 3, q);
  const double exact[] = {-1.06055, -0.35388, 0.30586, -0.19091};
  const double doc[] = {-1.061, -0.354, 0.306, -0.191};
  for (Index j = 0; j < 4; ++j) {
    EXPECT_NEAR(rotated(0, j), exact[j], 5e-6) << j;
    EXPECT_NEAR(rotated(0, j), doc[j], 5e-4) << j;
  }
  // §4.6 prints ||q|| = ||q'|| ≈ 1.187; the exact value is 1.17473 (SEED-NOTES.md).
  EXPECT_NEAR(q.norm(), 1.17473, 5e-6);
  EXPECT_NEAR(rotated.norm(), q.norm(), 1e-15);
}

// ---------------------------------------------------------------------------------------------
// Against the reference, float and double

template <class Scalar>
class RopeTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RopeTyped, Scalars, apex::testing::ScalarName);

struct Shape {
  Index rows, heads, head_dim, rotary_dim, offset, max_positions;
  double base;
};

// Sizes that are not multiples of 4, 8 or 16, single rows, single pairs, partial rotary, and a
// case large enough to be spread over threads.
const Shape kShapes[] = {
    {1, 1, 2, 2, 0, 1, 10000.0},          {1, 3, 6, 6, 7, 9, 10000.0},
    {5, 1, 10, 6, 3, 20, 10000.0},        {7, 4, 22, 22, 0, 7, 500000.0},
    {13, 2, 34, 18, 100, 200, 10000.0},   {33, 5, 64, 64, 50, 300, 1e6},
    {3, 2, 128, 32, 1000, 1003, 10000.0}, {600, 2, 128, 128, 17, 700, 10000.0},
};

TYPED_TEST(RopeTyped, MatchesReferenceOnRandomShapes) {
  using Scalar = TypeParam;
  std::mt19937 rng(1234);
  for (const Shape& s : kShapes) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      const bool half = pairing == RopePairing::kHalfSplit;
      SCOPED_TRACE(::testing::Message()
                   << "rows " << s.rows << " heads " << s.heads << " head_dim " << s.head_dim
                   << " rotary " << s.rotary_dim << " half_split " << half);
      const RopeTable<Scalar> table(s.max_positions, s.head_dim,
                                    RopeParams{s.base, s.rotary_dim, pairing});
      const RowMatrix<Scalar> x = random_matrix<Scalar>(s.rows, s.heads * s.head_dim, rng);
      const Eigen::MatrixXd expected = apex::reference::rope(
          to_double(x), offset_positions(s.offset, s.rows),
          apex::reference::rope_theta(s.rotary_dim, s.base), s.head_dim, half);
      const RowMatrix<Scalar> y = apex::rope(table, s.offset, x);
      EXPECT_LE(max_abs_diff(to_double(y), expected), kernel_tolerance<Scalar>());

      RowMatrix<Scalar> in_place = x;
      apex::apply_rope(table, s.offset, in_place);
      EXPECT_EQ(in_place, y);  // same kernel, same bits
    }
  }
}

TYPED_TEST(RopeTyped, MagnitudeAndArbitraryFrequenciesMatchReference) {
  using Scalar = TypeParam;
  std::mt19937 rng(99);
  std::uniform_real_distribution<double> dist(0.0, 1.5);
  Vector<double> theta(9);
  for (Index i = 0; i < theta.size(); ++i) theta(i) = dist(rng);
  const std::vector<double> theta_ref(theta.data(), theta.data() + theta.size());
  const double magnitude = 1.3466;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const auto table = RopeTable<Scalar>::from_frequencies(theta, 50, 21, pairing, magnitude);
    EXPECT_EQ(table.rotary_dim(), 18);
    EXPECT_EQ(table.head_dim(), 21);
    const RowMatrix<Scalar> x = random_matrix<Scalar>(11, 3 * 21, rng);
    const Eigen::MatrixXd expected =
        apex::reference::rope(to_double(x), offset_positions(39, 11), theta_ref, 21,
                              pairing == RopePairing::kHalfSplit, magnitude);
    const RowMatrix<Scalar> y = apex::rope(table, 39, x);
    // Pass-through features keep their value; only the rotary ones carry the magnitude.
    EXPECT_LE(max_abs_diff(to_double(y), expected), kernel_tolerance<Scalar>(magnitude));
  }
}

TYPED_TEST(RopeTyped, ExplicitPositionIdsMatchReferenceAndOffsetForm) {
  using Scalar = TypeParam;
  std::mt19937 rng(7);
  const Index rows = 19, head_dim = 14, heads = 3, positions = 64;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> table(positions, head_dim, RopeParams{10000.0, 0, pairing});
    const RowMatrix<Scalar> x = random_matrix<Scalar>(rows, heads * head_dim, rng);

    // Unsorted, repeated ids (packed sequences), in three integer types.
    std::uniform_int_distribution<Index> pick(0, positions - 1);
    Vector<Index> ids(rows);
    for (Index t = 0; t < rows; ++t) ids(t) = pick(rng);
    ids(3) = ids(4);
    const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1> ids64 = ids.cast<std::int64_t>();
    const Eigen::VectorXi ids32 = ids.cast<int>();
    std::vector<long long> ids_ref(ids.data(), ids.data() + rows);

    const Eigen::MatrixXd expected =
        apex::reference::rope(to_double(x), ids_ref, apex::reference::rope_theta(head_dim, 1e4),
                              head_dim, pairing == RopePairing::kHalfSplit);
    const RowMatrix<Scalar> y = apex::rope(table, ids, x);
    EXPECT_LE(max_abs_diff(to_double(y), expected), kernel_tolerance<Scalar>());
    EXPECT_EQ(apex::rope(table, ids64, x), y);
    EXPECT_EQ(apex::rope(table, ids32, x), y);
    RowMatrix<Scalar> in_place = x;
    apex::apply_rope(table, ids, in_place);
    EXPECT_EQ(in_place, y);

    // Ids offset + t give exactly the offset form.
    Vector<Index> consecutive(rows);
    for (Index t = 0; t < rows; ++t) consecutive(t) = 20 + t;
    EXPECT_EQ(apex::rope(table, consecutive, x), apex::rope(table, 20, x));
  }
}

TYPED_TEST(RopeTyped, EveryHeadOfARowTurnsAtThatRowsPosition) {
  using Scalar = TypeParam;
  std::mt19937 rng(3);
  const Index rows = 6, head_dim = 10, heads = 4;
  const RopeTable<Scalar> table(32, head_dim);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(rows, heads * head_dim, rng);
  const RowMatrix<Scalar> all = apex::rope(table, 5, x);
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<Scalar> one = apex::rope(table, 5, x.middleCols(h * head_dim, head_dim));
    EXPECT_EQ(RowMatrix<Scalar>(all.middleCols(h * head_dim, head_dim)), one) << "head " << h;
  }
  // A block of columns of a wider matrix is rotated in place, its neighbours untouched.
  RowMatrix<Scalar> wide = random_matrix<Scalar>(rows, 3 * head_dim, rng);
  const RowMatrix<Scalar> before = wide;
  apex::apply_rope(table, 5, wide.middleCols(head_dim, head_dim));
  EXPECT_EQ(RowMatrix<Scalar>(wide.leftCols(head_dim)),
            RowMatrix<Scalar>(before.leftCols(head_dim)));
  EXPECT_EQ(RowMatrix<Scalar>(wide.rightCols(head_dim)),
            RowMatrix<Scalar>(before.rightCols(head_dim)));
  EXPECT_EQ(RowMatrix<Scalar>(wide.middleCols(head_dim, head_dim)),
            apex::rope(table, 5, before.middleCols(head_dim, head_dim)));
}

TYPED_TEST(RopeTyped, PartialRotaryLeavesTheTailUnchanged) {
  using Scalar = TypeParam;
  std::mt19937 rng(11);
  const Index head_dim = 24, rotary_dim = 8, heads = 3;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> table(40, head_dim, RopeParams{10000.0, rotary_dim, pairing});
    const RowMatrix<Scalar> x = random_matrix<Scalar>(9, heads * head_dim, rng);
    const RowMatrix<Scalar> y = apex::rope(table, 30, x);
    for (Index h = 0; h < heads; ++h) {
      const Index tail = h * head_dim + rotary_dim;
      EXPECT_EQ(RowMatrix<Scalar>(y.middleCols(tail, head_dim - rotary_dim)),
                RowMatrix<Scalar>(x.middleCols(tail, head_dim - rotary_dim)));
      EXPECT_NE(RowMatrix<Scalar>(y.middleCols(h * head_dim, rotary_dim)),
                RowMatrix<Scalar>(x.middleCols(h * head_dim, rotary_dim)));
    }
  }
}

TYPED_TEST(RopeTyped, PreservesTheNormOfEveryPair) {
  using Scalar = TypeParam;
  std::mt19937 rng(5);
  const Index head_dim = 30, rows = 40;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> table(2000, head_dim, RopeParams{10000.0, 0, pairing});
    const RowMatrix<Scalar> x = random_matrix<Scalar>(rows, head_dim, rng);
    const RowMatrix<Scalar> y = apex::rope(table, 1950, x);
    for (Index t = 0; t < rows; ++t) {
      for (Index i = 0; i < head_dim / 2; ++i) {
        const Index a = pairing == RopePairing::kInterleaved ? 2 * i : i;
        const Index b = pairing == RopePairing::kInterleaved ? 2 * i + 1 : i + head_dim / 2;
        const double before = std::hypot(double(x(t, a)), double(x(t, b)));
        const double after = std::hypot(double(y(t, a)), double(y(t, b)));
        EXPECT_NEAR(after, before, kernel_tolerance<Scalar>()) << "row " << t << " pair " << i;
      }
    }
  }
}

// §4.5: <RoPE(q, m), RoPE(k, n)> depends only on m − n. Each side is compared with the same
// product at positions (m − n, 0) or (0, n − m); RoPE at position 0 is the identity.
// Tolerances relative to ||q||·||k||: in double the angles m·θ (m < 2000) carry ≲ 1e-13 of
// rounding, so 1e-12; in float each rotated feature carries ≲ 2·ε relative error (as in
// kernel_tolerance), about 6·ε per inner product and 12·ε between two of them, so 16·ε.
template <class Scalar>
double relative_position_tolerance() {
  return std::is_same_v<Scalar, double> ? 1e-12 : 16.0 * std::numeric_limits<float>::epsilon();
}

TYPED_TEST(RopeTyped, InnerProductDependsOnlyOnRelativePosition) {
  using Scalar = TypeParam;
  std::mt19937 rng(21);
  const Index head_dim = 64;
  std::uniform_int_distribution<Index> pos(0, 1999);
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> table(2000, head_dim, RopeParams{10000.0, 0, pairing});
    for (int trial = 0; trial < 200; ++trial) {
      const RowMatrix<Scalar> q = random_matrix<Scalar>(1, head_dim, rng);
      const RowMatrix<Scalar> k = random_matrix<Scalar>(1, head_dim, rng);
      const Index m = pos(rng), n = pos(rng);
      const auto dot = [](const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
        return to_double(a).cwiseProduct(to_double(b)).sum();
      };
      const double at_mn = dot(apex::rope(table, m, q), apex::rope(table, n, k));
      const double shifted =
          m >= n ? dot(apex::rope(table, m - n, q), k) : dot(q, apex::rope(table, n - m, k));
      const double scale = to_double(q).norm() * to_double(k).norm();
      EXPECT_NEAR(at_mn, shifted, relative_position_tolerance<Scalar>() * scale)
          << "m " << m << " n " << n;
    }
  }
}

TYPED_TEST(RopeTyped, PairingsAgreeAfterPermutingFeatures) {
  using Scalar = TypeParam;
  std::mt19937 rng(8);
  const Index head_dim = 18, heads = 2, half = head_dim / 2;
  const RopeTable<Scalar> interleaved(100, head_dim,
                                      RopeParams{10000.0, 0, RopePairing::kInterleaved});
  const RopeTable<Scalar> split(100, head_dim, RopeParams{10000.0, 0, RopePairing::kHalfSplit});
  const RowMatrix<Scalar> x = random_matrix<Scalar>(12, heads * head_dim, rng);
  // Feature 2i goes to i and 2i+1 to i + d/2 in every head.
  RowMatrix<Scalar> permuted(x.rows(), x.cols());
  for (Index h = 0; h < heads; ++h) {
    for (Index i = 0; i < half; ++i) {
      permuted.col(h * head_dim + i) = x.col(h * head_dim + 2 * i);
      permuted.col(h * head_dim + half + i) = x.col(h * head_dim + 2 * i + 1);
    }
  }
  const RowMatrix<Scalar> a = apex::rope(interleaved, 80, x);
  const RowMatrix<Scalar> b = apex::rope(split, 80, permuted);
  for (Index h = 0; h < heads; ++h) {
    for (Index i = 0; i < half; ++i) {
      // Both evaluate the same two products per feature: equal up to rounding order.
      for (Index t = 0; t < x.rows(); ++t) {
        EXPECT_NEAR(a(t, h * head_dim + 2 * i), b(t, h * head_dim + i), kernel_tolerance<Scalar>());
        EXPECT_NEAR(a(t, h * head_dim + 2 * i + 1), b(t, h * head_dim + half + i),
                    kernel_tolerance<Scalar>());
      }
    }
  }
}

TYPED_TEST(RopeTyped, FromCosSinEqualsTheBuiltTable) {
  using Scalar = TypeParam;
  std::mt19937 rng(13);
  const Index positions = 37, head_dim = 20, rotary_dim = 12;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    const RopeTable<Scalar> built(positions, head_dim, RopeParams{10000.0, rotary_dim, pairing});
    // Half width, as ONNX and FlashAttention take them, computed here in double.
    const std::vector<double> theta = apex::reference::rope_theta(rotary_dim, 10000.0);
    RowMatrix<double> cos_half(positions, rotary_dim / 2), sin_half(positions, rotary_dim / 2);
    for (Index m = 0; m < positions; ++m) {
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        cos_half(m, i) = std::cos(static_cast<double>(m) * theta[static_cast<std::size_t>(i)]);
        sin_half(m, i) = std::sin(static_cast<double>(m) * theta[static_cast<std::size_t>(i)]);
      }
    }
    const auto from_half = RopeTable<Scalar>::from_cos_sin(cos_half, sin_half, head_dim, pairing,
                                                           RopeCacheWidth::kHalf);
    const auto from_full = RopeTable<Scalar>::from_cos_sin(built.cos(), built.sin(), head_dim,
                                                           pairing, RopeCacheWidth::kFull);
    for (const auto* table : {&from_half, &from_full}) {
      EXPECT_EQ(table->max_positions(), positions);
      EXPECT_EQ(table->head_dim(), head_dim);
      EXPECT_EQ(table->rotary_dim(), rotary_dim);
      EXPECT_EQ(table->pairing(), pairing);
      // Both round the same double value once.
      EXPECT_EQ(table->cos(), built.cos());
      EXPECT_EQ(table->sin(), built.sin());
    }
    const RowMatrix<Scalar> x = random_matrix<Scalar>(5, 2 * head_dim, rng);
    EXPECT_EQ(apex::rope(from_half, 30, x), apex::rope(built, 30, x));
  }
}

// ---------------------------------------------------------------------------------------------
// Long positions (§4.7 decision: angles in double)

TEST(Rope, FloatTablesAreAccurateAtPositionOneMillion) {
  const Index positions = 1'000'001, head_dim = 8;
  const double base = 500000.0;
  const RopeTable<float> table(positions, head_dim, RopeParams{base, 0, RopePairing::kHalfSplit});
  double worst = 0.0, worst_float_angle = 0.0;
  for (Index m = positions - 50; m < positions; ++m) {
    for (Index i = 0; i < head_dim / 2; ++i) {
      const long double theta =
          std::pow(static_cast<long double>(base),
                   -2.0L * static_cast<long double>(i) / static_cast<long double>(head_dim));
      const long double angle = static_cast<long double>(m) * theta;
      worst = std::max({worst, static_cast<double>(std::fabs(table.cos()(m, i) - std::cos(angle))),
                        static_cast<double>(std::fabs(table.sin()(m, i + 4) - std::sin(angle)))});
      // What forming the angle in float would give (shows this test can fail).
      const float float_angle = static_cast<float>(m) * static_cast<float>(theta);
      worst_float_angle =
          std::max(worst_float_angle,
                   static_cast<double>(std::fabs(std::cos(float_angle) - std::cos(angle))));
    }
  }
  EXPECT_LE(worst, 1e-6);
  EXPECT_GT(worst_float_angle, 1e-3);
}

// A float table of 2^20 positions, the largest position included (max_positions − 1), against
// an independent double computation: θ_i from the formula, the angle m·θ_i formed once in
// double and cos/sin evaluated (argument reduction included) in double. Each entry must be
// that value rounded to float. Tolerance per entry: 2^-24·|v| (float's unit roundoff, the
// rounding of v to float) plus 2^-30 for the two double computations of the angle, which may
// differ by a few ε relative: m·θ ≤ 2^20 and 2^20·4ε < 2^-30. Forming the angle in float, or
// accumulating it over m, is off by ~1e-2 here (checked below, so the test can fail).
// Memory: 2 tables × 2^20 × 8 floats = 64 MiB.
double float_rounding_tolerance(double value) { return std::ldexp(std::abs(value), -24) + 0x1p-30; }

TEST(Rope, FloatTableOf2To20PositionsIsExactToFloatRounding) {
  const Index positions = Index{1} << 20, head_dim = 8;
  const double base = 10000.0;
  const RopeTable<float> table(positions, head_dim);
  ASSERT_EQ(table.max_positions(), positions);
  // The documented size: [max_positions, rotary_dim] each, nothing more.
  EXPECT_EQ(table.cos().rows(), positions);
  EXPECT_EQ(table.cos().cols(), head_dim);
  EXPECT_EQ(table.sin().size(), positions * head_dim);

  const std::vector<double> theta = apex::reference::rope_theta(head_dim, base);
  std::vector<Index> checked_positions;
  for (Index m = 0; m < positions; m += 4099) checked_positions.push_back(m);
  for (Index m = positions - 64; m < positions; ++m) checked_positions.push_back(m);
  checked_positions.push_back(positions / 2);
  double worst_excess = -1.0, worst_float_angle = 0.0;
  for (const Index m : checked_positions) {
    for (Index i = 0; i < head_dim / 2; ++i) {
      const double angle = static_cast<double>(m) * theta[static_cast<std::size_t>(i)];
      const double c = std::cos(angle), s = std::sin(angle);
      for (const Index j : {2 * i, 2 * i + 1}) {  // interleaved: both features of pair i
        const double dc = std::abs(static_cast<double>(table.cos()(m, j)) - c);
        const double ds = std::abs(static_cast<double>(table.sin()(m, j)) - s);
        worst_excess = std::max(
            {worst_excess, dc - float_rounding_tolerance(c), ds - float_rounding_tolerance(s)});
        EXPECT_LE(dc, float_rounding_tolerance(c)) << "cos at m " << m << " feature " << j;
        EXPECT_LE(ds, float_rounding_tolerance(s)) << "sin at m " << m << " feature " << j;
      }
      const float float_angle =
          static_cast<float>(m) * static_cast<float>(theta[static_cast<std::size_t>(i)]);
      worst_float_angle =
          std::max(worst_float_angle, std::abs(std::cos(static_cast<double>(float_angle)) - c));
    }
  }
  EXPECT_LE(worst_excess, 0.0);
  EXPECT_GT(worst_float_angle, 1e-3);

  // The last position is usable by apply_rope and agrees with the double reference; one past
  // it is rejected.
  std::mt19937 rng(20);
  const RowMatrix<float> x = random_matrix<float>(1, 2 * head_dim, rng);
  const Eigen::MatrixXd expected = apex::reference::rope(
      to_double(x), {static_cast<long long>(positions - 1)}, theta, head_dim, false);
  EXPECT_LE(max_abs_diff(to_double(apex::rope(table, positions - 1, x)), expected),
            kernel_tolerance<float>());
  RowMatrix<float> y = x;
  expect_invalid([&] { apex::apply_rope(table, positions, y); },
                 {"[rope]", "position id (1048576)"});
  EXPECT_EQ(y, x);
}

// ---------------------------------------------------------------------------------------------
// Bad input: each throws std::invalid_argument naming the argument, and leaves x untouched.

TEST(Rope, RejectsOddHeadDimAndRotaryDim) {
  expect_invalid([] { RopeTable<float>(16, 7); }, {"[rope]", "head_dim (7)", "even"});
  expect_invalid(
      [] {
        RopeTable<float>(16, 8, RopeParams{10000.0, 5});
      },
      {"[rope]", "rotary_dim (5)", "even"});
  expect_invalid([] { apex::rope_frequencies(3, 10000.0); }, {"rotary_dim (3)"});
  expect_invalid(
      [] {
        RowMatrix<double> c = RowMatrix<double>::Zero(4, 3);
        RopeTable<double>::from_cos_sin(c, c, 8, RopePairing::kInterleaved, RopeCacheWidth::kFull);
      },
      {"[rope]", "width (3)", "even"});
}

TEST(Rope, RejectsRotaryDimBeyondHeadDim) {
  expect_invalid(
      [] {
        RopeTable<double>(16, 8, RopeParams{10000.0, 16});
      },
      {"[rope]", "rotary_dim (16)", "head_dim (8)"});
  expect_invalid(
      [] {
        RopeTable<double>::from_frequencies(Vector<double>::Ones(5), 4, 8,
                                            RopePairing::kInterleaved);
      },
      {"[rope]", "head_dim (8)", "rotary_dim (10)"});
}

TEST(Rope, RejectsBaseNotAboveOne) {
  expect_invalid([] { RopeTable<float>(16, 8, RopeParams{1.0}); }, {"[rope]", "base (1)"});
  expect_invalid([] { apex::rope_frequencies(8, std::nan("")); }, {"[rope]", "base (nan)"});
}

TEST(Rope, RejectsBadTableParameters) {
  expect_invalid([] { RopeTable<float>(0, 8); }, {"[rope]", "max_positions (0)"});
  expect_invalid(
      [] {
        RopeTable<float>::from_frequencies(Vector<double>::Ones(2), 4, 4, RopePairing::kInterleaved,
                                           -1.0);
      },
      {"[rope]", "magnitude (-1)"});
  expect_invalid(
      [] {
        RowMatrix<double> c = RowMatrix<double>::Zero(4, 2);
        RowMatrix<double> s = RowMatrix<double>::Zero(5, 2);
        RopeTable<double>::from_cos_sin(c, s, 8, RopePairing::kInterleaved, RopeCacheWidth::kHalf);
      },
      {"[rope]", "sin shape [5, 2]", "cos shape [4, 2]"});
}

constexpr Index kHugePositions = Index{1} << 62;

// Whether a table's cos or sin still holds `before`: the shapes first, since == needs equal
// shapes (a rejected assignment must leave the old table in place).
template <class Scalar>
bool unchanged(const RowMatrix<Scalar>& now, const RowMatrix<Scalar>& before) {
  return now.rows() == before.rows() && now.cols() == before.cols() && now == before;
}

TEST(Rope, RejectsTablesTooLargeToAddress) {
  // Each table on the left is rejected by a std::invalid_argument, not std::bad_alloc: the
  // entry count max_positions·rotary_dim or the byte count 2·entries·sizeof(Scalar) does not
  // fit in 64 bits. The table assigned to keeps its contents.
  RopeTable<float> table(4, 2);
  const RowMatrix<float> before = table.cos();
  const Vector<double> theta = Vector<double>::Constant(1, 0.5);
  expect_invalid(
      [&] {
        table =
            RopeTable<float>::from_frequencies(theta, kHugePositions, 2, RopePairing::kInterleaved);
      },
      {"[rope]", "max_positions x rotary_dim", "(4611686018427387904 x 2)", "overflows"});
  // 2^60 · 2 entries fit, but 2^61 entries × 2 tables × 4 bytes = 2^64 bytes do not.
  expect_invalid(
      [&] {
        table =
            RopeTable<float>::from_frequencies(theta, Index{1} << 60, 2, RopePairing::kInterleaved);
      },
      {"[rope]", "table bytes", "overflows"});
  expect_invalid([&] { table = RopeTable<float>(Index{1} << 50, Index{1} << 20); },
                 {"[rope]", "max_positions x rotary_dim", "overflows"});
  EXPECT_TRUE(unchanged(table.cos(), before));
  EXPECT_EQ(table.max_positions(), 4);
}

TEST(Rope, ChecksEveryArgumentBeforeAllocating) {
  // rotary_dim = 2^62 would need 2^61 frequencies (and far more for the table): every
  // argument is checked first, so these are std::invalid_argument and never std::bad_alloc.
  expect_invalid(
      [] {
        RopeTable<float>(0, kHugePositions, RopeParams{10000.0, kHugePositions});
      },
      {"[rope]", "max_positions (0)", "at least 1"});
  expect_invalid([] { RopeTable<float>(1, Index{1} << 40, RopeParams{1.0}); },
                 {"[rope]", "base (1)"});
  // 2^61 entries fit an Index, 2^61 × 2 tables × 8 bytes do not.
  expect_invalid([] { RopeTable<double>(1, Index{1} << 61); },
                 {"[rope]", "table bytes", "overflows"});
}

TEST(Rope, RejectsFrequenciesWhoseAnglesOverflow) {
  // θ = 1e308 is finite, but m·θ = inf at m = 2 and cos(inf) is NaN.
  RopeTable<double> table(4, 2);
  const RowMatrix<double> before = table.sin();
  Vector<double> theta(2);
  theta << 1.0, 1e308;
  expect_invalid(
      [&] { table = RopeTable<double>::from_frequencies(theta, 3, 4, RopePairing::kInterleaved); },
      {"[rope]", "largest angle", "(max_positions - 1) * max theta = (2) * (1e+308)", "finite"});
  EXPECT_TRUE(unchanged(table.sin(), before));
  // With one position the only angle is 0·θ = 0: accepted, and finite.
  table = RopeTable<double>::from_frequencies(theta, 1, 4, RopePairing::kInterleaved);
  EXPECT_TRUE(table.cos().allFinite() && table.sin().allFinite());
  EXPECT_EQ(table.cos()(0, 3), 1.0);
  // The largest position whose angle is finite is accepted: (P − 1)·θ = 1e308.
  theta << 1.0, 1e308 / 3.0;
  table = RopeTable<double>::from_frequencies(theta, 4, 4, RopePairing::kInterleaved);
  EXPECT_TRUE(table.cos().allFinite() && table.sin().allFinite());
  // Negative and non-finite frequencies.
  theta << 1.0, -1.0;
  expect_invalid(
      [&] { table = RopeTable<double>::from_frequencies(theta, 3, 4, RopePairing::kInterleaved); },
      {"[rope]", "theta[1] (-1)", "finite and >= 0"});
  theta << std::numeric_limits<double>::infinity(), 1.0;
  expect_invalid(
      [&] { table = RopeTable<double>::from_frequencies(theta, 3, 4, RopePairing::kInterleaved); },
      {"[rope]", "theta[0] (inf)"});
  EXPECT_EQ(table.max_positions(), 4);
}

TEST(Rope, RejectsMagnitudeOutsideTheScalarRange) {
  // magnitude·cos is rounded to Scalar: above its largest value every entry would be infinite,
  // below its smallest normal value flushed towards zero.
  const Vector<double> theta = Vector<double>::Constant(1, 0.5);
  RopeTable<float> table(4, 2);
  const RowMatrix<float> before = table.cos();
  for (const double magnitude :
       {1e39, 1e-39, std::numeric_limits<double>::infinity(), std::nan(""), 0.0}) {
    SCOPED_TRACE(magnitude);
    expect_invalid(
        [&] {
          table =
              RopeTable<float>::from_frequencies(theta, 2, 2, RopePairing::kInterleaved, magnitude);
        },
        {"[rope]", "magnitude (", "normal range of float"});
    EXPECT_TRUE(unchanged(table.cos(), before));
  }
  // The largest float is accepted and gives finite entries; in double 1e39 is fine.
  const auto largest =
      RopeTable<float>::from_frequencies(theta, 3, 2, RopePairing::kInterleaved,
                                         static_cast<double>(std::numeric_limits<float>::max()));
  EXPECT_TRUE(largest.cos().allFinite() && largest.sin().allFinite());
  EXPECT_EQ(largest.cos()(0, 0), std::numeric_limits<float>::max());
  const auto wide =
      RopeTable<double>::from_frequencies(theta, 3, 2, RopePairing::kInterleaved, 1e39);
  EXPECT_EQ(wide.cos()(0, 0), 1e39);
  expect_invalid(
      [&] { RopeTable<double>::from_frequencies(theta, 3, 2, RopePairing::kInterleaved, 1e-320); },
      {"[rope]", "magnitude (", "normal range of double"});
}

TEST(Rope, RejectsNonFiniteOrOutOfRangeCosSin) {
  RowMatrix<double> c = RowMatrix<double>::Constant(3, 2, 0.5);
  RowMatrix<double> s = RowMatrix<double>::Constant(3, 2, 0.5);
  RopeTable<float> table(4, 4);
  const RowMatrix<float> before = table.cos();
  c(1, 0) = std::numeric_limits<double>::infinity();
  expect_invalid(
      [&] {
        table = RopeTable<float>::from_cos_sin(c, s, 4, RopePairing::kInterleaved,
                                               RopeCacheWidth::kHalf);
      },
      {"[rope]", "cos(1, 0) (inf)", "finite"});
  c(1, 0) = 0.5;
  s(2, 1) = 1e39;  // finite in double, infinite in float
  expect_invalid(
      [&] {
        table = RopeTable<float>::from_cos_sin(c, s, 4, RopePairing::kInterleaved,
                                               RopeCacheWidth::kFull);
      },
      {"[rope]", "sin(2, 1) (1e+39)", "(float)"});
  s(2, 1) = std::nan("");
  expect_invalid(
      [&] {
        RopeTable<double>::from_cos_sin(c, s, 4, RopePairing::kInterleaved, RopeCacheWidth::kFull);
      },
      {"[rope]", "sin(2, 1) (nan)"});
  EXPECT_TRUE(unchanged(table.cos(), before));
}

class RopeBadApplication : public ::testing::Test {
 protected:
  RopeBadApplication() : table_(16, 8), x_(5, 16) {
    std::mt19937 rng(17);
    x_ = random_matrix<float>(5, 16, rng);
    before_ = x_;
  }
  RopeTable<float> table_;
  RowMatrix<float> x_;
  RowMatrix<float> before_;
};

TEST_F(RopeBadApplication, PositionOffsetPlusRowsBeyondTable) {
  // Rows at positions 12..16: 12..15 are valid, 16 is not; nothing may be rotated.
  expect_invalid([&] { apex::apply_rope(table_, 12, x_); },
                 {"[rope]", "position id (16)", "max_positions (16)"});
  EXPECT_EQ(x_, before_);
  expect_invalid([&] { apex::apply_rope(table_, -1, x_); }, {"[rope]", "position_offset (-1)"});
  EXPECT_EQ(x_, before_);
  apex::apply_rope(table_, 11, x_);  // the last valid offset
  EXPECT_NE(x_, before_);
}

TEST_F(RopeBadApplication, PositionIdBeyondTableOrNegative) {
  Vector<Index> ids(5);
  ids << 1, 2, 3, 16, 4;
  expect_invalid([&] { apex::apply_rope(table_, ids, x_); },
                 {"[rope]", "position id (16)", "row 3", "max_positions", "16"});
  EXPECT_EQ(x_, before_);
  ids(3) = -1;
  expect_invalid([&] { apex::apply_rope(table_, ids, x_); }, {"[rope]", "position id (-1)"});
  EXPECT_EQ(x_, before_);
  Vector<Index> short_ids(4);
  short_ids << 1, 2, 3, 4;
  expect_invalid([&] { apex::apply_rope(table_, short_ids, x_); },
                 {"[rope]", "position_ids size (4)", "x.rows() (5)"});
  EXPECT_EQ(x_, before_);
}

TEST_F(RopeBadApplication, ColumnsNotAMultipleOfHeadDim) {
  RowMatrix<float> x = x_.leftCols(12);
  const RowMatrix<float> before = x;
  expect_invalid([&] { apex::apply_rope(table_, 0, x); },
                 {"[rope]", "x.cols() (12)", "head_dim (8)"});
  EXPECT_EQ(x, before);
}

// ---------------------------------------------------------------------------------------------
// 16-bit rows (Eigen::half, Eigen::bfloat16) with a float table
// ---------------------------------------------------------------------------------------------

template <class T>
class Rope16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Rope16Bit, SixteenBit, apex::testing::ScalarName);

// Every element is the rotation of the stored values, computed in float and rounded once: within
// one rounding of T (2^-11 relative for half, 2^-8 for bfloat16, an ulp of T here) of the same
// rotation in double on the widened inputs, plus float's own error on the values that cancel.
// Both pairings, both forms (offset and ids), untouched features past the rotary width.
TYPED_TEST(Rope16Bit, RotatesStoredValuesAndRoundsOnce) {
  using T = TypeParam;
  const double step = std::is_same_v<T, Eigen::half> ? 0x1p-10 : 0x1p-7;
  for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
    RopeParams params;
    params.pairing = pairing;
    params.rotary_dim = 12;  // of head_dim 16
    const RopeTable<float> table(40, 16, params);
    const RowMatrix<T> x16 = random_matrix<float>(7, 32, 81, -2.0, 2.0).cast<T>();
    const RowMatrix<double> wide = x16.template cast<double>();
    const RowMatrix<double> expected = apex::rope(RopeTable<double>(40, 16, params), 5, wide);
    RowMatrix<T> rotated = x16;
    apex::apply_rope(table, 5, rotated);
    Vector<Index> ids(7);
    for (Index t = 0; t < 7; ++t) ids(t) = 5 + t;
    RowMatrix<T> by_ids = x16;
    apex::apply_rope(table, ids, by_ids);
    for (Index r = 0; r < 7; ++r) {
      for (Index c = 0; c < 32; ++c) {
        const double got = static_cast<double>(rotated(r, c));
        ASSERT_LE(std::abs(got - expected(r, c)), step * std::abs(expected(r, c)) + 1e-6)
            << "row " << r << ", column " << c;
        ASSERT_EQ(static_cast<float>(by_ids(r, c)), static_cast<float>(rotated(r, c)));
        if (c % 16 >= 12) {
          ASSERT_EQ(static_cast<float>(rotated(r, c)), static_cast<float>(x16(r, c)));
        }
      }
    }
  }
}

TYPED_TEST(Rope16Bit, ChecksPositionsBeforeTouchingTheRows) {
  using T = TypeParam;
  const RopeTable<float> table(8, 4);
  RowMatrix<T> x = RowMatrix<float>::Constant(3, 8, 1.5f).cast<T>();
  expect_invalid([&] { apex::apply_rope(table, 6, x); }, {"[rope] position id (8)"});
  EXPECT_TRUE((x.template cast<float>().array() == 1.5f).all());
}

// ---------------------------------------------------------------------------------------------
// The backward pass: the transposed rotation, which is the rotation by the negated angle (times
// the same magnitude): the reference at positions −m.

std::vector<long long> negated(std::vector<long long> positions) {
  for (long long& p : positions) p = -p;
  return positions;
}

TYPED_TEST(RopeTyped, BackwardIsTheTransposedRotation) {
  using Scalar = TypeParam;
  std::mt19937 rng(4321);
  for (const Shape& s : kShapes) {
    for (const RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
      const bool half = pairing == RopePairing::kHalfSplit;
      SCOPED_TRACE(::testing::Message() << "rows " << s.rows << " head_dim " << s.head_dim
                                        << " rotary " << s.rotary_dim << " half_split " << half);
      const RopeTable<Scalar> table(s.max_positions, s.head_dim,
                                    RopeParams{s.base, s.rotary_dim, pairing});
      const RowMatrix<Scalar> dy = random_matrix<Scalar>(s.rows, s.heads * s.head_dim, rng);
      RowMatrix<Scalar> dx = dy;
      apex::apply_rope_backward(table, s.offset, dx);
      const std::vector<double> theta = apex::reference::rope_theta(s.rotary_dim, s.base);
      const std::vector<long long> positions = offset_positions(s.offset, s.rows);
      EXPECT_LE(max_abs_diff(to_double(dx), apex::reference::rope(to_double(dy), negated(positions),
                                                                  theta, s.head_dim, half)),
                kernel_tolerance<Scalar>());
      // The adjoint identity ⟨rope(x), dy⟩ = ⟨x, rope_backward(dy)⟩, on the reference's rope.
      const RowMatrix<Scalar> x = random_matrix<Scalar>(s.rows, s.heads * s.head_dim, rng);
      const double forward =
          (apex::reference::rope(to_double(x), positions, theta, s.head_dim, half).array() *
           to_double(dy).array())
              .sum();
      const double backward = (to_double(x).array() * to_double(dx).array()).sum();
      EXPECT_NEAR(forward, backward, kernel_tolerance<Scalar>() * static_cast<double>(dy.size()));
      // Explicit positions: the same bits as the offset form.
      Vector<Index> ids(s.rows);
      for (Index t = 0; t < s.rows; ++t) ids(t) = s.offset + t;
      RowMatrix<Scalar> by_ids = dy;
      apex::apply_rope_backward(table, ids, by_ids);
      EXPECT_EQ(by_ids, dx);
    }
  }
}

TEST(RopeBackward, MagnitudeTablesAnd16BitRows) {
  // A YaRN-style table (magnitude 1.25): the transpose carries the same magnitude. bfloat16
  // gradients are turned in float and rounded once, as apply_rope turns bfloat16 rows.
  std::mt19937 rng(77);
  Vector<double> theta(4);
  theta << 1.0, 0.3, 0.05, 0.001;
  const auto table =
      RopeTable<float>::from_frequencies(theta, 40, 10, RopePairing::kHalfSplit, 1.25);
  const RowMatrix<float> dy = random_matrix<float>(9, 20, rng);
  RowMatrix<float> dx = dy;
  apex::apply_rope_backward(table, 30, dx);
  const std::vector<double> theta_ref(theta.data(), theta.data() + 4);
  EXPECT_LE(max_abs_diff(to_double(dx),
                         apex::reference::rope(to_double(dy), negated(offset_positions(30, 9)),
                                               theta_ref, 10, true, 1.25)),
            kernel_tolerance<float>(1.25));
  RowMatrix<Eigen::bfloat16> narrow = dy.cast<Eigen::bfloat16>();
  const RowMatrix<float> widened = narrow.cast<float>();
  RowMatrix<float> expected = widened;
  apex::apply_rope_backward(table, 30, expected);
  apex::apply_rope_backward(table, 30, narrow);
  EXPECT_EQ(narrow, RowMatrix<Eigen::bfloat16>(expected.cast<Eigen::bfloat16>()));
}

TEST(RopeBackward, RejectsBadPositionsBeforeWriting) {
  const RopeTable<float> table(8, 4);
  RowMatrix<float> dx = RowMatrix<float>::Constant(3, 8, 5.0f);
  expect_invalid([&] { apex::apply_rope_backward(table, 6, dx); }, {"[rope] position id (8)"});
  Vector<Index> ids(3);
  ids << 0, 9, 1;
  expect_invalid([&] { apex::apply_rope_backward(table, ids, dx); }, {"[rope] position id (9)"});
  expect_invalid([&] { apex::apply_rope_backward(table, 0, dx.leftCols(6)); },
                 {"[rope] x.cols() (6)"});
  EXPECT_TRUE((dx.array() == 5.0f).all());
}

}  // namespace
}  // namespace rope_test
