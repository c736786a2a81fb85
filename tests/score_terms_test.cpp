// SPDX-License-Identifier: MIT
// detail/score_terms.hpp: the score terms as pieces a kernel composes (soft-cap, ALiBi, the
// user's score rule; the bias, the position rule, the dense mask, the user's mask rule), and
// kv_format.hpp: the scalar K/V formats. Each piece is checked on random rows against the
// formula it documents, written out in double; their composition against the kernel itself.
#include <apex/apex.hpp>
#include <apex/detail/score_terms.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "test_util.hpp"

namespace score_terms_test {
namespace {

using apex::Index;
using apex::detail::AlibiTerm;
using apex::detail::ScoreArray;
using apex::detail::ScoreRow;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<float> random_row(Index n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 4.0F);
  std::vector<float> row(static_cast<std::size_t>(n));
  for (float& x : row) x = normal(rng);
  return row;
}

// Soft-cap: c·tanh(x / c) on every score, in the compute type (within 2 ulp of the double
// formula: one division, one tanh, one product).
TEST(ScoreTerms, SoftcapIsCapTimesTanhOfScoreOverCap) {
  const Index n = 37;
  std::vector<float> row = random_row(n, 1);
  const std::vector<float> raw = row;
  const apex::detail::Softcap<float> softcap{5.0F};
  ASSERT_TRUE(softcap.on());
  ScoreArray<float> s(row.data(), n);
  softcap.apply(s);
  for (Index j = 0; j < n; ++j) {
    const double expected = 5.0 * std::tanh(static_cast<double>(raw[std::size_t(j)]) / 5.0);
    EXPECT_NEAR(row[std::size_t(j)], expected, 4.0 * std::numeric_limits<float>::epsilon() * 5.0)
        << j;
    EXPECT_LE(std::abs(row[std::size_t(j)]), 5.0F);
  }
  EXPECT_FALSE(apex::detail::Softcap<float>{}.on());
}

// ALiBi: the term slope·(kp − qp) is rounded once, for every row of a tile that shares the key
// distances of its first row (the precision the kernel fixed for tiles of many rows).
TEST(ScoreTerms, AlibiTermIsRoundedOnceForEveryRowOfTheTile) {
  const Index n = 64, kp = 4000, qp0 = 4100;
  const double slopes[2] = {0.0625, 0.70710678118654752};
  std::vector<float> distance(static_cast<std::size_t>(n));
  AlibiTerm<float>::fill(distance.data(), kp, qp0, n);
  const AlibiTerm<float> alibi{slopes};
  for (Index offset = 0; offset < 40; offset += 13) {
    std::vector<float> row(static_cast<std::size_t>(n), 0.0F);
    ScoreArray<float> s(row.data(), n);
    alibi.apply(s, 1, distance.data(), offset);
    for (Index j = 0; j < n; ++j) {
      const float slope = static_cast<float>(slopes[1]);
      const float expected = slope * static_cast<float>((kp + j) - (qp0 + offset));
      EXPECT_EQ(row[std::size_t(j)], expected) << "offset " << offset << " key " << j;
    }
  }
}

// The position tile: +inf where the rule allows (query qp0 + i, key kp + j), -inf elsewhere; a
// row keeps its scores (NaN included) only where the tile is positive.
TEST(ScoreTerms, PositionTileForbidsExactlyWhatTheRuleForbids) {
  apex::PositionMask rule;
  rule.causal = true;
  rule.window = 5;
  const Index rows = 6, n = 20, qp0 = 10, kp = 2, ld = 32;
  std::vector<float> tile(static_cast<std::size_t>(rows * ld));
  apex::detail::PositionTile<float>::fill(rule, qp0, rows, kp, n, tile.data(), ld);
  for (Index i = 0; i < rows; ++i) {
    std::vector<float> row = random_row(n, 10 + static_cast<std::uint64_t>(i));
    row[3] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> raw = row;
    ScoreArray<float> s(row.data(), n);
    apex::detail::PositionTile<float>::apply(s, tile.data() + i * ld);
    for (Index j = 0; j < n; ++j) {
      if (rule.allows(qp0 + i, kp + j)) {
        EXPECT_TRUE(row[std::size_t(j)] == raw[std::size_t(j)] ||
                    (std::isnan(row[std::size_t(j)]) && std::isnan(raw[std::size_t(j)])))
            << i << j;
      } else {
        EXPECT_EQ(row[std::size_t(j)], -std::numeric_limits<float>::infinity()) << i << " " << j;
      }
    }
  }
}

struct Problem {
  using Query = float;
  using Key = float;
  using Value = float;
  using Bias = float;
  using Rules = apex::NoRules;
  const Rules* rules = nullptr;
  apex::HeadsView<const bool> allowed;
  apex::HeadsView<const float> bias;
  double softcap = 0.0;
  const double* alibi_slopes = nullptr;
};

// The composition: transform (soft-cap, then ALiBi) and forbid (bias, then position, then the
// dense mask), against the formula in double; a bias of -inf and a forbidden key give -inf even
// where the score is NaN.
TEST(ScoreTerms, TransformThenForbidFollowTheDocumentedOrder) {
  const Index n = 24, h = 1, i = 2, qp = 50, kp = 30, key_index = 4;
  const Index keys = key_index + n;
  std::vector<float> bias_data(static_cast<std::size_t>(2 * 3 * keys));
  std::vector<char> allowed_data(static_cast<std::size_t>(2 * 3 * keys));
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  for (std::size_t x = 0; x < bias_data.size(); ++x) {
    bias_data[x] = x % 11 == 0 ? -std::numeric_limits<float>::infinity() : normal(rng);
    allowed_data[x] = static_cast<char>(x % 7 != 0);
  }
  const std::unique_ptr<bool[]> allowed_bools(new bool[allowed_data.size()]);
  for (std::size_t x = 0; x < allowed_data.size(); ++x) allowed_bools[x] = allowed_data[x] != 0;
  const double slopes[2] = {0.5, 0.25};
  Problem p;
  p.bias = apex::HeadsView<const float>(bias_data.data(), {1, 2, 3, keys}, {0, 3 * keys, keys});
  p.allowed =
      apex::HeadsView<const bool>(allowed_bools.get(), {1, 2, 3, keys}, {0, 3 * keys, keys});
  p.softcap = 8.0;
  p.alibi_slopes = slopes;
  const apex::detail::ScoreTerms<float, Problem> terms(p);
  ASSERT_TRUE(terms.modifies());
  ASSERT_TRUE(terms.dense());

  apex::PositionMask rule;
  rule.causal = true;
  rule.window = 16;
  std::vector<float> tile(static_cast<std::size_t>(n));
  apex::detail::PositionTile<float>::fill(rule, qp, 1, kp, n, tile.data(), n);
  std::vector<float> distance(static_cast<std::size_t>(n));
  AlibiTerm<float>::fill(distance.data(), kp, qp, n);

  std::vector<float> row = random_row(n, 3);
  row[5] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> raw = row;
  const ScoreRow where{0, h, i, qp, key_index, kp, n};
  ScoreArray<float> s(row.data(), n);
  terms.transform(s, where, distance.data(), 0);
  terms.forbid(s, where, tile.data(), false);

  for (Index j = 0; j < n; ++j) {
    const std::size_t at = static_cast<std::size_t>((h * 3 + i) * keys + key_index + j);
    const double b = bias_data[at];
    const bool forbidden = !rule.allows(qp, kp + j) || allowed_data[at] == 0 || b == -kInf;
    if (forbidden) {
      EXPECT_EQ(row[std::size_t(j)], -std::numeric_limits<float>::infinity()) << j;
      continue;
    }
    if (std::isnan(raw[std::size_t(j)])) {
      EXPECT_TRUE(std::isnan(row[std::size_t(j)])) << j;
      continue;
    }
    const double expected = 8.0 * std::tanh(static_cast<double>(raw[std::size_t(j)]) / 8.0) +
                            0.25 * double((kp + j) - qp) + b;
    EXPECT_NEAR(row[std::size_t(j)], expected, 1e-5 * (1.0 + std::abs(expected))) << j;
  }
}

// The scalar formats: one value per element, their bytes, an exact widening, and a store that is
// round_to element by element (double to half or bfloat16 rounded once, not twice).
template <class T>
void check_scalar_format() {
  using Format = apex::KvFormat<T>;
  static_assert(std::is_same_v<typename Format::Element, T>);
  static_assert(Format::kValuesPerElement == 1);
  static_assert(apex::is_kv_format_v<T>);
  EXPECT_EQ(Format::elements(128), 128);
  EXPECT_EQ(Format::bytes(1000), 1000 * static_cast<std::int64_t>(sizeof(T)));
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 100.0);
  apex::RowMatrix<double> x(3, 17);
  for (Index e = 0; e < x.size(); ++e) x.data()[e] = normal(rng);
  apex::RowMatrix<T> stored(3, 17);
  Format::store_rows(stored.block(0, 0, 3, 17), x);
  std::vector<double> widened(static_cast<std::size_t>(x.size()));
  Format::widen(stored.data(), widened.data(), x.size());
  for (Index e = 0; e < x.size(); ++e) {
    const T expected = apex::round_to<T>(x.data()[e]);
    EXPECT_EQ(static_cast<double>(stored.data()[e]), static_cast<double>(expected)) << e;
    EXPECT_EQ(widened[static_cast<std::size_t>(e)], static_cast<double>(expected)) << e;
  }
}

TEST(KvFormat, ScalarFormatsStoreRoundedOnceAndWidenExactly) {
  check_scalar_format<float>();
  check_scalar_format<double>();
  check_scalar_format<Eigen::half>();
  check_scalar_format<Eigen::bfloat16>();
  static_assert(!apex::is_kv_format_v<int>);
  static_assert(!apex::is_kv_format_v<bool>);
}

}  // namespace
}  // namespace score_terms_test
