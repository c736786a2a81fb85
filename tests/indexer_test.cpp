// SPDX-License-Identifier: MIT
// apex::LightningIndexer and IndexerKeyCache (indexer.hpp): the queries, keys, head weights and
// scores against the plain double loops of reference/indexer.hpp (RoPE, LayerNorm and the
// Hadamard transform included), the selection against a sort of the scores, ties and NaN by
// the documented order, every key format, bit-identical selections for any number of threads
// and for a row scored alone or with others, draft tokens ranking what their tree shows them, and
// bad input rejected with nothing changed.
#include <apex/detail/simd_kernels.hpp>
#include <apex/indexer.hpp>
#include <apex/kv_quant.hpp>
#include <apex/rope.hpp>
#include <apex/tree_mask.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference/indexer.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace indexer_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::IndexerConfig;
using apex::KeySelection;
using apex::RowMatrix;
using apex::testing::expect_invalid;
using apex::testing::Tolerances;

IndexerConfig small_config(Index top_k = 16) {
  IndexerConfig c;
  c.d_model = 48;
  c.d_q = 40;
  c.heads = 6;
  c.head_dim = 32;
  c.rope_dim = 8;
  c.top_k = top_k;
  return c;
}

/// max |a − b| / max(1, max |b|) over the finite entries of b; infinite entries must agree.
double normwise(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
  double err = 0.0, scale = 1.0;
  for (Index i = 0; i < b.rows(); ++i) {
    for (Index j = 0; j < b.cols(); ++j) {
      if (std::isinf(b(i, j))) {
        if (a(i, j) != b(i, j)) return std::numeric_limits<double>::infinity();
        continue;
      }
      err = std::max(err, std::abs(a(i, j) - b(i, j)));
      scale = std::max(scale, std::abs(b(i, j)));
    }
  }
  return err / scale;
}

template <class M>
Eigen::MatrixXd as_double(const M& m) {
  return m.template cast<double>();
}

/// A layer's worth of indexer inputs: B sequences of n tokens at [0, n), its indexer, a RoPE
/// table (half-split pairs), and the reference's view of them.
template <class Scalar>
struct IndexerCase {
  IndexerConfig config;
  Index batch, n;
  apex::LightningIndexer<Scalar> indexer;
  apex::RopeTable<Scalar> rope;
  RowMatrix<Scalar> h, c_q;

  IndexerCase(const IndexerConfig& c, Index b, Index tokens, std::uint32_t seed)
      : config(c),
        batch(b),
        n(tokens),
        indexer(apex::LightningIndexer<Scalar>::random(c, seed)),
        rope(4096, c.rope_dim, {10000.0, 0, apex::RopePairing::kHalfSplit}),
        h(apex::testing::random_matrix<Scalar>(b * tokens, c.d_model, seed + 1)),
        c_q(apex::testing::random_matrix<Scalar>(b * tokens, c.d_q, seed + 2)) {}

  std::vector<long long> positions() const {
    std::vector<long long> p;
    for (Index b = 0; b < batch; ++b) {
      for (Index s = 0; s < n; ++s) p.push_back(s);
    }
    return p;
  }
  Eigen::MatrixXd expected_queries() const {
    return apex::reference::indexer_queries(
        as_double(c_q), as_double(indexer.weights().w_q), positions(),
        apex::reference::rope_theta(static_cast<long>(config.rope_dim), 10000.0),
        static_cast<long>(config.head_dim), true);
  }
  Eigen::MatrixXd expected_keys() const {
    const auto& w = indexer.weights();
    return apex::reference::indexer_keys(
        as_double(h), as_double(w.w_k), w.k_norm_gamma.template cast<double>(),
        w.k_norm_beta.template cast<double>(), config.norm_eps, positions(),
        apex::reference::rope_theta(static_cast<long>(config.rope_dim), 10000.0), true);
  }
};

template <class Scalar>
class Indexer : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Indexer, Scalars, apex::testing::ScalarName);

// q, k and w of the formula, RoPE on the first d_r features, LayerNorm and Hadamard included.
TYPED_TEST(Indexer, QueriesKeysAndWeightsFollowTheFormula) {
  using Scalar = TypeParam;
  IndexerCase<Scalar> c(small_config(), 2, 37, 3);
  const RowMatrix<Scalar> q = c.indexer.queries(c.c_q, c.batch, c.rope, 0);
  const RowMatrix<Scalar> k = c.indexer.keys(c.h, c.batch, c.rope, 0);
  const RowMatrix<Scalar> w = c.indexer.head_weights(c.h);
  EXPECT_LE(normwise(as_double(q), c.expected_queries()), Tolerances<Scalar>::kIndexer);
  EXPECT_LE(normwise(as_double(k), c.expected_keys()), Tolerances<Scalar>::kIndexer);
  const Eigen::MatrixXd want_w = as_double(c.h) * as_double(c.indexer.weights().w_w) /
                                 std::sqrt(double(c.config.heads * c.config.head_dim));
  EXPECT_LE(normwise(as_double(w), want_w), Tolerances<Scalar>::kIndexer);
}

// The scores over a cache, causal, against the loop; and the selection against a sort of the
// library's own scores (the exact order), and of the loop's where no two scores are close.
TYPED_TEST(Indexer, ScoresAndSelectionFollowTheFormula) {
  using Scalar = TypeParam;
  for (const Index top_k : {Index{1}, Index{7}, Index{30}, Index{600}}) {
    SCOPED_TRACE("k = " + std::to_string(top_k));
    IndexerCase<Scalar> c(small_config(top_k), 2, 300, 5);
    auto cache = c.indexer.make_cache(c.batch, 400);
    cache.append(c.indexer.keys(c.h, c.batch, c.rope, 0), 0);
    const RowMatrix<Scalar> q = c.indexer.queries(c.c_q, c.batch, c.rope, 0);
    const RowMatrix<Scalar> w = c.indexer.head_weights(c.h);
    const RowMatrix<Scalar> scores = c.indexer.scores(q, w, cache.keys(), 0);
    const KeySelection selected = c.indexer.select(q, w, cache.keys(), 0);
    ASSERT_EQ(selected.cols(), std::min<Index>(top_k, 300));
    const Eigen::MatrixXd want_k = c.expected_keys();
    const Eigen::MatrixXd want_q = c.expected_queries();
    const Eigen::MatrixXd want_w = as_double(c.h) * as_double(c.indexer.weights().w_w);
    for (Index b = 0; b < c.batch; ++b) {
      const std::vector<long long> at = [&] {
        std::vector<long long> p;
        for (Index s = 0; s < c.n; ++s) p.push_back(s);
        return p;
      }();
      const Eigen::MatrixXd want = apex::reference::indexer_scores(
          want_q.middleRows(b * c.n, c.n), want_w.middleRows(b * c.n, c.n),
          want_k.middleRows(b * c.n, c.n), at);
      EXPECT_LE(normwise(as_double(scores.middleRows(b * c.n, c.n)), want),
                Tolerances<Scalar>::kIndexer);
    }
    for (Index t = 0; t < c.batch * c.n; ++t) {
      const Index visible = t % c.n + 1;
      std::vector<double> row(static_cast<std::size_t>(visible));
      for (Index s = 0; s < visible; ++s) row[std::size_t(s)] = double(scores(t, s));
      const std::vector<long> want = apex::reference::top_k(row, long(visible), long(top_k));
      for (Index j = 0; j < selected.cols(); ++j) {
        const Index expected = j < Index(want.size()) ? Index(want[std::size_t(j)]) : -1;
        ASSERT_EQ(selected(t, j), expected) << "row " << t << " slot " << j;
      }
    }
  }
}

// A bidirectional prefix P (§11.1): a row inside it scores and ranks every key of [0, P), a row
// after it the keys up to its own position; against the loop, and the selection against a sort.
TYPED_TEST(Indexer, RowsInsideAPrefixSeeItWhole) {
  using Scalar = TypeParam;
  const Index prefix = 37;
  IndexerCase<Scalar> c(small_config(9), 2, 120, 8);
  auto cache = c.indexer.make_cache(c.batch, 120);
  cache.append(c.indexer.keys(c.h, c.batch, c.rope, 0), 0);
  const RowMatrix<Scalar> q = c.indexer.queries(c.c_q, c.batch, c.rope, 0);
  const RowMatrix<Scalar> w = c.indexer.head_weights(c.h);
  const RowMatrix<Scalar> scores = c.indexer.scores(q, w, cache.keys(), 0, prefix);
  const KeySelection selected = c.indexer.select(q, w, cache.keys(), 0, prefix);
  const Eigen::MatrixXd want_k = c.expected_keys(), want_q = c.expected_queries();
  const Eigen::MatrixXd want_w = as_double(c.h) * as_double(c.indexer.weights().w_w);
  std::vector<long long> at;
  for (Index s = 0; s < c.n; ++s) at.push_back(s);
  for (Index b = 0; b < c.batch; ++b) {
    const Eigen::MatrixXd want = apex::reference::indexer_scores(
        want_q.middleRows(b * c.n, c.n), want_w.middleRows(b * c.n, c.n),
        want_k.middleRows(b * c.n, c.n), at, prefix);
    EXPECT_LE(normwise(as_double(scores.middleRows(b * c.n, c.n)), want),
              Tolerances<Scalar>::kIndexer);
  }
  for (Index t = 0; t < c.batch * c.n; ++t) {
    const Index visible = std::max(t % c.n + 1, prefix);
    std::vector<double> row(static_cast<std::size_t>(visible));
    for (Index s = 0; s < visible; ++s) row[std::size_t(s)] = double(scores(t, s));
    const std::vector<long> want = apex::reference::top_k(row, long(visible), 9);
    for (Index j = 0; j < selected.cols(); ++j) {
      ASSERT_EQ(selected(t, j), Index(want[std::size_t(j)])) << "row " << t << " slot " << j;
    }
  }
  expect_invalid([&] { (void)c.indexer.select(q, w, cache.keys(), 0, 121); },
                 {"[indexer] prefix (121) must lie in [0, S_k = 120]"});
  expect_invalid([&] { (void)c.indexer.select(q, w, cache.keys(), 0, -1); },
                 {"[indexer] prefix (-1)"});
}

// reserve() grows the key cache and keeps its keys (the selection over them is unchanged);
// it never shrinks, and an empty cache rejects it.
TEST(Indexer, ReserveKeepsTheKeys) {
  IndexerCase<float> c(small_config(5), 2, 30, 11);
  auto cache = c.indexer.make_cache(c.batch, 30);
  cache.append(c.indexer.keys(c.h, c.batch, c.rope, 0), 0);
  const RowMatrix<float> q = c.indexer.queries(c.c_q, c.batch, c.rope, 0);
  const RowMatrix<float> w = c.indexer.head_weights(c.h);
  const KeySelection before = c.indexer.select(q, w, cache.keys(), 0);
  cache.reserve(70);
  EXPECT_EQ(cache.capacity(), 70);
  EXPECT_EQ(cache.size(), 30);
  EXPECT_EQ(cache.bytes(), 2 * 70 * 32 * Index(sizeof(float)));
  EXPECT_EQ(c.indexer.select(q, w, cache.keys(), 0), before);
  cache.reserve(10);
  EXPECT_EQ(cache.capacity(), 70);
  apex::IndexerKeyCache<float> empty;
  expect_invalid([&] { empty.reserve(4); }, {"[indexer_cache]", "cache"});
}

// Two configs are equal when every field is: changing any one of them makes them differ.
TEST(Indexer, ConfigsAreEqualWhenEveryFieldIs) {
  const IndexerConfig base = small_config(5);
  EXPECT_TRUE(base == small_config(5));
  EXPECT_FALSE(base != small_config(5));
  const std::vector<std::function<void(IndexerConfig&)>> changes = {
      [](IndexerConfig& c) { c.d_model += 1; },
      [](IndexerConfig& c) { c.d_q += 1; },
      [](IndexerConfig& c) { c.heads += 1; },
      [](IndexerConfig& c) { c.head_dim *= 2; },
      [](IndexerConfig& c) { c.rope_dim += 2; },
      [](IndexerConfig& c) { c.top_k += 1; },
      [](IndexerConfig& c) { c.norm_eps *= 2; },
      [](IndexerConfig& c) { c.allow_bf16_products = !c.allow_bf16_products; }};
  for (std::size_t i = 0; i < changes.size(); ++i) {
    IndexerConfig changed = base;
    changes[i](changed);
    EXPECT_FALSE(changed == base) << "field " << i;
    EXPECT_TRUE(changed != base) << "field " << i;
  }
}

// Equal scores rank the lower position first; NaN ranks last; fewer visible keys than k are
// all selected.
TEST(Indexer, TiesNanAndShortRowsFollowTheDocumentedOrder) {
  IndexerConfig c = small_config(3);
  c.heads = 1;
  c.head_dim = 4;
  c.rope_dim = 2;
  const auto indexer = apex::LightningIndexer<double>::random(c, 1);
  // Keys: equal rows (equal scores), a NaN row, a larger one.
  RowMatrix<double> keys(6, 4);
  keys << 1, 0, 0, 0,  //
      1, 0, 0, 0,      //
      std::nan(""), 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, -1, 0, 0, 0;
  RowMatrix<double> q(6, 4), w(6, 1);
  q.setZero();
  q.col(0).setOnes();
  w.setOnes();
  const auto view = HeadsView<const double>::contiguous(keys.data(), {1, 1, 6, 4});
  const KeySelection s = indexer.select(q, w, view, 0);
  ASSERT_EQ(s.cols(), 3);
  EXPECT_EQ(s.row(0), (Eigen::Matrix<Index, 1, 3>() << 0, -1, -1).finished());
  EXPECT_EQ(s.row(1), (Eigen::Matrix<Index, 1, 3>() << 0, 1, -1).finished());
  EXPECT_EQ(s.row(2), (Eigen::Matrix<Index, 1, 3>() << 0, 1, 2).finished());
  EXPECT_EQ(s.row(3), (Eigen::Matrix<Index, 1, 3>() << 0, 1, 3).finished());  // NaN out
  EXPECT_EQ(s.row(4), (Eigen::Matrix<Index, 1, 3>() << 0, 1, 3).finished());  // 4 ties, later
  EXPECT_EQ(s.row(5), (Eigen::Matrix<Index, 1, 3>() << 0, 1, 3).finished());  // ReLU(-1) = 0
}

// A row decoded alone has its keys split into runs that select in parallel
// (detail::select_top_k_split): the same selection as one pass over the row, for any number of
// runs (more runs than keys included), on scores with many ties, NaN and -inf, and k below,
// at and above the row's length.
TEST(Indexer, SplitSelectionIsTheSelectionOfTheWholeRow) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> value(-3, 3);  // few values: many ties
  for (const Index n : {1, 5, 64, 1000}) {
    std::vector<float> scores(static_cast<std::size_t>(n));
    for (float& x : scores) x = static_cast<float>(value(gen));
    scores[0] = std::nanf("");
    if (n > 3) scores[3] = -std::numeric_limits<float>::infinity();
    if (n > 4) scores[static_cast<std::size_t>(n - 1)] = std::nanf("");
    for (const Index k : {Index{1}, Index{2}, n / 2 + 1, n, n + 3}) {
      const Index width = std::min(k, n) + 2;
      std::vector<float> ranks(static_cast<std::size_t>(n));
      std::vector<Index> whole(static_cast<std::size_t>(width), -7);
      apex::detail::select_top_k(scores.data(), n, k, 100, width, ranks.data(), whole.data());
      for (const Index parts : {1, 2, 3, 7}) {
        std::vector<Index> split(static_cast<std::size_t>(width), -7);
        apex::detail::select_top_k_split(scores.data(), n, k, 100, width, ranks.data(),
                                         split.data(), parts);
        EXPECT_EQ(split, whole) << "n " << n << ", k " << k << ", parts " << parts;
      }
    }
  }
}

// Every key format the cache stores: the selection is that of the keys the cache holds, widened
// (the fp8 case is DeepSeek's own: e4m3 with one float scale per 128 values).
template <class Storage>
void expect_format_selects_its_values() {
  IndexerConfig c = small_config(20);
  c.head_dim = 128;
  c.rope_dim = 16;
  IndexerCase<float> ic(c, 1, 200, 9);
  auto cache = ic.indexer.make_cache<Storage>(1, 256);
  cache.append(ic.indexer.keys(ic.h, 1, ic.rope, 0), 0);
  RowMatrix<float> widened(200, 128);
  const auto stored = cache.keys();
  for (Index s = 0; s < 200; ++s) {
    apex::KvFormat<Storage>::widen(apex::detail::row_data(stored, 0, 0, s), widened.row(s).data(),
                                   stored.dim());
  }
  const RowMatrix<float> q = ic.indexer.queries(ic.c_q, 1, ic.rope, 0);
  const RowMatrix<float> w = ic.indexer.head_weights(ic.h);
  const KeySelection from_cache = ic.indexer.select(q, w, stored, 0);
  const KeySelection from_values = ic.indexer.select(
      q, w, HeadsView<const float>::contiguous(widened.data(), {1, 1, 200, 128}), 0);
  EXPECT_EQ(from_cache, from_values);
  EXPECT_EQ(cache.bytes(),
            apex::KvFormat<Storage>::bytes(256 * apex::KvFormat<Storage>::elements(128)));
}

TEST(Indexer, EveryKeyFormat) {
  expect_format_selects_its_values<float>();
  expect_format_selects_its_values<Eigen::half>();
  expect_format_selects_its_values<Eigen::bfloat16>();
  expect_format_selects_its_values<apex::BlockQ8_0>();
  expect_format_selects_its_values<apex::BlockFp8E4m3<128>>();
}

// allow_bf16_products: where the CPU has the bfloat16 products, the scores are those of the
// loop over the query heads and keys rounded to bfloat16 (for float and for bfloat16 keys, read
// as they are); elsewhere the exact ones. A decoded row selects what it selects in a prompt.
TEST(Indexer, Bf16ProductsRoundTheFactors) {
  const apex::detail::FloatKernels* simd = apex::detail::float_kernels();
  const bool rounds = simd != nullptr && simd->bf16 != nullptr;
  IndexerConfig config = small_config(7);
  config.allow_bf16_products = true;
  IndexerCase<float> c(config, 2, 90, 12);
  const RowMatrix<float> q = c.indexer.queries(c.c_q, c.batch, c.rope, 0);
  const RowMatrix<float> w = c.indexer.head_weights(c.h);
  const RowMatrix<float> k = c.indexer.keys(c.h, c.batch, c.rope, 0);
  const auto rounded = [&](const RowMatrix<float>& m) -> Eigen::MatrixXd {
    return rounds ? apex::converted<Eigen::bfloat16>(m).cast<double>() : as_double(m);
  };
  std::vector<long long> at;
  for (Index s = 0; s < c.n; ++s) at.push_back(s);
  auto f32 = c.indexer.make_cache(c.batch, 90);
  auto b16 = c.indexer.make_cache<Eigen::bfloat16>(c.batch, 90);
  f32.append(k, 0);
  b16.append(k, 0);
  const RowMatrix<float> from_f32 = c.indexer.scores(q, w, f32.keys(), 0);
  const RowMatrix<float> from_b16 = c.indexer.scores(q, w, b16.keys(), 0);
  const Eigen::MatrixXd bf16_keys = apex::converted<Eigen::bfloat16>(k).cast<double>();
  for (Index b = 0; b < c.batch; ++b) {
    const Eigen::MatrixXd want_w =
        as_double(w.middleRows(b * c.n, c.n)) * std::sqrt(double(config.heads * config.head_dim));
    const Eigen::MatrixXd want_f32 = apex::reference::indexer_scores(
        rounded(q.middleRows(b * c.n, c.n)), want_w, rounded(k.middleRows(b * c.n, c.n)), at);
    const Eigen::MatrixXd want_b16 = apex::reference::indexer_scores(
        rounded(q.middleRows(b * c.n, c.n)), want_w, bf16_keys.middleRows(b * c.n, c.n), at);
    EXPECT_LE(normwise(as_double(from_f32.middleRows(b * c.n, c.n)), want_f32),
              Tolerances<float>::kIndexer);
    EXPECT_LE(normwise(as_double(from_b16.middleRows(b * c.n, c.n)), want_b16),
              Tolerances<float>::kIndexer);
  }
  const KeySelection all = c.indexer.select(q, w, b16.keys(), 0);
  for (const Index t : {Index{0}, Index{41}, Index{89}}) {
    const KeySelection alone =
        c.indexer.select(q.middleRows(t, 1), w.middleRows(t, 1),
                         b16.keys().middle_batches(0, 1).middle_rows(0, t + 1), t);
    EXPECT_EQ(alone.row(0).head(alone.cols()), all.row(t).head(alone.cols())) << "row " << t;
  }
}

// A row's selection does not depend on the thread count, nor on the rows scored with it: a
// prompt's rows selected together equal each row selected alone, as decoding does.
TYPED_TEST(Indexer, BitIdenticalForThreadsAndForRowsAlone) {
  using Scalar = TypeParam;
  IndexerCase<Scalar> c(small_config(50), 1, 700, 11);
  auto cache = c.indexer.make_cache(1, 700);
  cache.append(c.indexer.keys(c.h, 1, c.rope, 0), 0);
  const RowMatrix<Scalar> q = c.indexer.queries(c.c_q, 1, c.rope, 0);
  const RowMatrix<Scalar> w = c.indexer.head_weights(c.h);
  const KeySelection all = c.indexer.select(q, w, cache.keys(), 0);
  for (const Index t : {Index{0}, Index{255}, Index{256}, Index{511}, Index{699}}) {
    const RowMatrix<Scalar> qt = q.row(t), wt = w.row(t);
    const KeySelection alone = c.indexer.select(qt, wt, cache.keys().middle_rows(0, t + 1), t);
    EXPECT_EQ(alone.leftCols(std::min<Index>(50, t + 1)),
              all.row(t).leftCols(std::min<Index>(50, t + 1)))
        << "row " << t;
  }
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  const RowMatrix<Scalar> scores = c.indexer.scores(q, w, cache.keys(), 0);
  for (const int threads : {1, 3}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(c.indexer.select(q, w, cache.keys(), 0), all);
    const RowMatrix<Scalar> again = c.indexer.scores(q, w, cache.keys(), 0);
    EXPECT_EQ(std::memcmp(again.data(), scores.data(), sizeof(Scalar) * std::size_t(again.size())),
              0);
  }
  omp_set_num_threads(saved);
#endif
}

// Draft trees (speculative verification): a draft token ranks the committed keys, its ancestors
// and itself only; the other draft keys are left out before the top k, not ranked low. Against a
// sort of the scores of exactly those keys, for two sequences of a paged cache (300 committed
// keys, past a key block, and 40) with trees of 12 and 5 tokens, k below and above the visible
// counts.
TEST(Indexer, DraftTokensRankTheKeysTheirTreeShows) {
  const std::vector<Index> committed{300, 40};
  const std::vector<apex::DraftTree> trees{apex::DraftTree({-1, 0, 0, 1, -1, 3, 2, 4, 5, 5, 8, 1}),
                                           apex::DraftTree({-1, -1, 0, 2, 1})};
  const apex::TreeMasks masks(trees, committed);
  const std::vector<Index> cu{0, 12, 17};
  for (const Index top_k : {Index{1}, Index{20}, Index{400}}) {
    SCOPED_TRACE("k = " + std::to_string(top_k));
    const auto indexer = apex::LightningIndexer<float>::random(small_config(top_k), 3);
    const RowMatrix<float> q = apex::testing::random_matrix<float>(17, 6 * 32, 4u);
    const RowMatrix<float> w = apex::testing::random_matrix<float>(17, 6, 5u);
    apex::PagedIndexerKeyCache<float> paged(32, 16, 64);
    std::vector<apex::SequenceId> ids;
    std::vector<RowMatrix<float>> keys;
    for (std::size_t i = 0; i < 2; ++i) {
      const Index held = committed[i] + trees[i].size();
      keys.push_back(apex::testing::random_matrix<float>(held, 32, 6u + std::uint32_t(i)));
      ids.push_back(paged.add());
      paged.append(ids.back(), keys.back());
    }
    const KeySelection got = indexer.select_paged(q, w, cu, paged, ids, nullptr, &masks);
    ASSERT_EQ(got.cols(), std::min<Index>(top_k, 312));
    for (std::size_t i = 0; i < 2; ++i) {
      const Index n = trees[i].size(), c = committed[i];
      auto contiguous = indexer.make_cache(1, c + n);
      contiguous.append(keys[i], 0);
      const RowMatrix<float> scores =
          indexer.scores(RowMatrix<float>(q.middleRows(cu[i], n)),
                         RowMatrix<float>(w.middleRows(cu[i], n)), contiguous.keys(), c);
      for (Index t = 0; t < n; ++t) {
        std::vector<Index> visible;
        for (Index s = 0; s < c + n; ++s) {
          if (s < c || trees[i].sees(t, s - c)) visible.push_back(s);
        }
        std::vector<double> row;
        for (const Index s : visible) row.push_back(double(scores(t, s)));
        const std::vector<long> want =
            apex::reference::top_k(row, long(visible.size()), long(top_k));
        for (Index j = 0; j < got.cols(); ++j) {
          const Index expected =
              j < Index(want.size()) ? visible[std::size_t(want[std::size_t(j)])] : -1;
          ASSERT_EQ(got(cu[i] + t, j), expected)
              << "sequence " << i << ", draft token " << t << ", slot " << j;
        }
      }
    }
    const apex::TreeMasks one({trees[0]}, {committed[0]});
    expect_invalid([&] { (void)indexer.select_paged(q, w, cu, paged, ids, nullptr, &one); },
                   {"[indexer] draft trees (1) must be one per sequence (2)"});
    const apex::TreeMasks windowed(trees, committed, 4);
    expect_invalid([&] { (void)indexer.select_paged(q, w, cu, paged, ids, nullptr, &windowed); },
                   {"[indexer] the draft trees have a window (4)"});
  }
}

// Bad configs, weights, inputs and cache appends: clear messages, nothing changed.
TEST(Indexer, BadInputIsRejectedAndChangesNothing) {
  const auto rejects = [](IndexerConfig c, const std::vector<std::string>& parts) {
    expect_invalid([&] { (void)apex::LightningIndexer<float>::random(c, 1); }, parts);
  };
  IndexerConfig c = small_config();
  c.top_k = 0;
  rejects(c, {"[indexer]", "top_k (0)"});
  c = small_config();
  c.head_dim = 24;
  rejects(c, {"head_dim d_I (24)", "power of two"});
  c = small_config();
  c.rope_dim = 64;
  rejects(c, {"rope_dim d_r (64)", "<= d_I (32)"});
  c = small_config();
  auto weights = apex::LightningIndexer<float>::random(c, 1).weights();
  weights.w_k.resize(3, 3);
  expect_invalid([&] { apex::LightningIndexer<float>(c, weights); }, {"[indexer]", "w_k"});

  IndexerCase<float> ic(small_config(), 1, 10, 2);
  auto cache = ic.indexer.make_cache(1, 16);
  const RowMatrix<float> k = ic.indexer.keys(ic.h, 1, ic.rope, 0);
  expect_invalid([&] { cache.append(k, 3); }, {"[indexer_cache]", "position (3)", "skips"});
  expect_invalid([&] { cache.append(k.leftCols(8), 0); }, {"[indexer_cache]", "keys [10, 8]"});
  cache.append(k, 0);
  expect_invalid([&] { cache.append(k, 10); }, {"[indexer_cache]", "exceed the capacity (16)"});
  EXPECT_EQ(cache.size(), 10);
  const RowMatrix<float> q = ic.indexer.queries(ic.c_q, 1, ic.rope, 0);
  const RowMatrix<float> w = ic.indexer.head_weights(ic.h);
  expect_invalid([&] { (void)ic.indexer.select(q, w, cache.keys(), 1); },
                 {"[indexer]", "query positions [1, 1 + 10)", "S_k = 10"});
  expect_invalid([&] { (void)ic.indexer.select(q.leftCols(6), w, cache.keys(), 0); },
                 {"[indexer]", "q [10, 6]"});
  expect_invalid([&] { (void)ic.indexer.queries(ic.c_q, 1, ic.rope, 4090); },
                 {"[indexer]", "positions [4090, 4090 + 10)"});
  const apex::RopeTable<float> wrong(64, 16);
  expect_invalid([&] { (void)ic.indexer.keys(ic.h, 1, wrong, 0); }, {"[indexer]", "head_dim (16)"});
  const apex::LightningIndexer<float> empty;
  expect_invalid([&] { (void)empty.head_weights(ic.h); }, {"[indexer]"});
  apex::IndexerKeyCache<float> none;
  expect_invalid([&] { none.append(k, 0); }, {"[indexer_cache]"});
}

}  // namespace
}  // namespace indexer_test
