// SPDX-License-Identifier: MIT
// apex::sdpa_sparse (sparse_attention.hpp): attention of each query row over its own selection
// of keys, against the plain double loop of reference::sdpa with the equivalent dense mask
// (allowed = selected), and against apex::sdpa itself where every visible key is selected; rows
// never selected are never read; bit-identical for any number of threads; bad selections are
// rejected with nothing written.
#include <apex/page_pool.hpp>
#include <apex/reference_attention.hpp>
#include <apex/sdpa.hpp>
#include <apex/sparse_attention.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "guarded_buffer.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace sparse_attention_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::KeySelection;
using apex::RowMatrix;
using apex::SdpaParams;
using apex::testing::expect_invalid;
using apex::testing::GuardedBuffer;
using apex::testing::Tolerances;

/// [B, H, S, d] storage with random entries in [-1, 1) (normal entries when `normal`).
template <class T>
struct Tensor {
  std::vector<T> data;
  apex::HeadsShape shape;

  Tensor(const apex::HeadsShape& s, std::mt19937& rng, bool normal = false) : shape(s) {
    data.resize(static_cast<std::size_t>(s.batch * s.heads * s.seq * s.dim));
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    std::normal_distribution<double> gauss(0.0, 1.0);
    for (T& x : data) x = static_cast<T>(normal ? gauss(rng) : uniform(rng));
  }
  HeadsView<T> view() { return HeadsView<T>::contiguous(data.data(), shape); }
  HeadsView<const T> view() const { return HeadsView<const T>::contiguous(data.data(), shape); }
};

/// A random selection: each row keeps each key of [0, visible(r)) with probability `keep`, at
/// most `width` of them (the first ones), the rest -1.
template <class Visible>
KeySelection random_selection(Index rows, Index width, double keep, Visible visible,
                              std::mt19937& rng) {
  std::bernoulli_distribution take(keep);
  KeySelection s = KeySelection::Constant(rows, width, -1);
  for (Index r = 0; r < rows; ++r) {
    Index n = 0;
    for (Index j = 0; j < visible(r) && n < width; ++j) {
      if (take(rng)) s(r, n++) = j;
    }
  }
  return s;
}

/// The dense mask [B, 1, S_q, S_k] that allows exactly the selected keys.
std::vector<char> dense_mask(const KeySelection& s, Index s_q, Index s_k) {
  std::vector<char> allowed(static_cast<std::size_t>(s.rows() * s_k), 0);
  for (Index r = 0; r < s.rows(); ++r) {
    for (Index j = 0; j < s.cols() && s(r, j) >= 0; ++j) {
      allowed[static_cast<std::size_t>(r * s_k + s(r, j))] = 1;
    }
  }
  (void)s_q;
  return allowed;
}

/// max |a − b| / max(1, max |b|) over two equally long ranges.
template <class A, class B>
double normwise_error(const A& a, const B& b) {
  double err = 0.0, scale = 1.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const double e = static_cast<double>(b[i]);
    if (std::isinf(e) && static_cast<double>(a[i]) == e) continue;
    err = std::max(err, std::abs(static_cast<double>(a[i]) - e));
    if (std::isfinite(e)) scale = std::max(scale, std::abs(e));
  }
  return err / scale;
}

/// One sparse problem: q, k, v, a selection, params; run() calls sdpa_sparse, expected() the
/// plain double loop under the equivalent dense mask.
template <class Scalar>
struct SparseCase {
  Index batch, h_q, h_kv, s_q, s_k, d_qk, d_v;
  Tensor<Scalar> q, k, v;
  KeySelection selected;
  SdpaParams params;

  SparseCase(const apex::HeadsShape& qs, Index kv_heads, Index keys, Index value_dim,
             std::mt19937& rng)
      : batch(qs.batch),
        h_q(qs.heads),
        h_kv(kv_heads),
        s_q(qs.seq),
        s_k(keys),
        d_qk(qs.dim),
        d_v(value_dim),
        q(qs, rng, true),
        k({qs.batch, kv_heads, keys, qs.dim}, rng, true),
        v({qs.batch, kv_heads, keys, value_dim}, rng) {}

  apex::HeadsShape out_shape() const { return {batch, h_q, s_q, d_v}; }

  void run(std::vector<Scalar>& out, std::vector<Scalar>& lse) const {
    out.assign(static_cast<std::size_t>(batch * h_q * s_q * d_v), Scalar(0));
    lse.assign(static_cast<std::size_t>(batch * h_q * s_q), Scalar(0));
    apex::sdpa_sparse(q.view(), k.view(), v.view(), selected, params,
                      HeadsView<Scalar>::contiguous(out.data(), out_shape()),
                      HeadsView<Scalar>::contiguous(lse.data(), {batch, h_q, s_q, 1}));
  }

  void expected(std::vector<double>& out, std::vector<double>& lse) const {
    std::vector<char> allowed = dense_mask(selected, s_q, s_k);
    static_assert(sizeof(bool) == sizeof(char));
    apex::AttentionMask<double> mask;
    mask.allowed = HeadsView<const bool>::contiguous(reinterpret_cast<const bool*>(allowed.data()),
                                                     {batch, 1, s_q, s_k});
    out.assign(static_cast<std::size_t>(batch * h_q * s_q * d_v), 0.0);
    lse.assign(static_cast<std::size_t>(batch * h_q * s_q), 0.0);
    apex::reference::sdpa(q.view(), k.view(), v.view(), mask, params,
                          HeadsView<double>::contiguous(out.data(), out_shape()),
                          HeadsView<double>::contiguous(lse.data(), {batch, h_q, s_q, 1}));
  }

  void expect_matches_reference() const {
    std::vector<Scalar> out, lse;
    std::vector<double> want_out, want_lse;
    run(out, lse);
    expected(want_out, want_lse);
    EXPECT_LE(normwise_error(out, want_out), Tolerances<Scalar>::kAttention);
    EXPECT_LE(normwise_error(lse, want_lse), Tolerances<Scalar>::kAttention);
  }
};

template <class Scalar>
class SparseAttention : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SparseAttention, Scalars, apex::testing::ScalarName);

// Random selections over shapes that are no multiple of any block: grouped heads, d_v != d_qk,
// S_q < S_k, several batches, with and without sinks and a soft-cap, each against the double
// loop over the equivalent dense mask.
TYPED_TEST(SparseAttention, EqualsDenseMaskOfTheSelection) {
  using Scalar = TypeParam;
  std::mt19937 rng(7);
  struct Shape {
    Index b, h_q, h_kv, s_q, s_k, d_qk, d_v, width;
    double keep;
  };
  const Shape shapes[] = {{1, 4, 1, 1, 300, 24, 16, 64, 0.3},
                          {2, 6, 2, 7, 131, 17, 9, 40, 0.5},
                          {1, 8, 8, 33, 97, 16, 16, 97, 0.9},
                          {3, 2, 1, 5, 700, 8, 12, 600, 0.8},
                          {1, 16, 1, 3, 2100, 40, 32, 700, 0.3}};
  for (const Shape& s : shapes) {
    for (const bool extras : {false, true}) {
      SCOPED_TRACE("S_q " + std::to_string(s.s_q) + " S_k " + std::to_string(s.s_k) +
                   (extras ? " sinks + softcap" : ""));
      SparseCase<Scalar> c({s.b, s.h_q, s.s_q, s.d_qk}, s.h_kv, s.s_k, s.d_v, rng);
      c.selected = random_selection(
          s.b * s.s_q, s.width, s.keep, [&](Index) { return s.s_k; }, rng);
      if (extras) {
        c.params.softcap = 3.0;
        for (Index h = 0; h < s.h_q; ++h) c.params.sinks.push_back(0.25 * double(h) - 0.5);
      }
      c.expect_matches_reference();
    }
  }
}

// A row that selects nothing is a fully masked row: zeros, and lse = the sink (-inf without).
TYPED_TEST(SparseAttention, EmptyRowIsFullyMasked) {
  using Scalar = TypeParam;
  std::mt19937 rng(8);
  SparseCase<Scalar> c({1, 2, 3, 8}, 1, 20, 8, rng);
  c.selected = KeySelection::Constant(3, 4, -1);
  c.selected(1, 0) = 5;
  c.selected(1, 1) = 19;
  std::vector<Scalar> out, lse;
  c.run(out, lse);
  for (Index h = 0; h < 2; ++h) {
    for (const Index i : {Index{0}, Index{2}}) {
      EXPECT_EQ(lse[static_cast<std::size_t>(h * 3 + i)], -std::numeric_limits<Scalar>::infinity());
      for (Index e = 0; e < 8; ++e)
        EXPECT_EQ(out[static_cast<std::size_t>((h * 3 + i) * 8 + e)], 0);
    }
  }
  c.params.sinks = {0.5, -1.0};
  c.expect_matches_reference();
}

// Every visible key selected: decoding (S_q = 1 over every key) equals apex::sdpa bit for bit
// (to the attention tolerance on Eigen's public-API fallback, APEX_EIGEN_PUBLIC_ONLY, whose
// panels end where the selection's one-row pages do), and a causal prompt (row i selects keys
// 0..i) equals causal sdpa to the attention tolerance (the prompt's tiles stack several
// queries; a selection's tile holds one).
TYPED_TEST(SparseAttention, EverythingSelectedIsDenseAttention) {
  using Scalar = TypeParam;
  std::mt19937 rng(9);
  const Index s_k = 1500, d = 64;
  for (const Index s_q : {Index{1}, Index{90}}) {
    SCOPED_TRACE("S_q " + std::to_string(s_q));
    SparseCase<Scalar> c({2, 16, s_q, d}, 1, s_k, 48, rng);
    c.selected = KeySelection::Constant(2 * s_q, s_k, -1);
    for (Index r = 0; r < 2 * s_q; ++r) {
      const Index visible = s_k - s_q + r % s_q + 1;
      for (Index j = 0; j < visible; ++j) c.selected(r, j) = j;
    }
    std::vector<Scalar> out, lse;
    c.run(out, lse);
    std::vector<Scalar> dense(out.size()), dense_lse(lse.size());
    apex::AttentionMask<Scalar> causal;
    causal.positions.causal = true;
    apex::sdpa(c.q.view(), c.k.view(), c.v.view(), causal, c.params,
               HeadsView<Scalar>::contiguous(dense.data(), c.out_shape()),
               HeadsView<Scalar>::contiguous(dense_lse.data(), {2, 16, s_q, 1}));
    if (s_q == 1 && APEX_EIGEN_INTERNALS) {
      EXPECT_EQ(std::memcmp(out.data(), dense.data(), out.size() * sizeof(Scalar)), 0);
      EXPECT_EQ(std::memcmp(lse.data(), dense_lse.data(), lse.size() * sizeof(Scalar)), 0);
    } else {
      EXPECT_LE(normwise_error(out, dense), Tolerances<Scalar>::kAttention);
      EXPECT_LE(normwise_error(lse, dense_lse), Tolerances<Scalar>::kAttention);
    }
  }
}

// The rows that no query selects are never read: K and V live in guarded memory whose pages
// outside the selected rows are unreadable, and the call completes and matches the loop.
TYPED_TEST(SparseAttention, UnselectedRowsAreNeverRead) {
  using Scalar = TypeParam;
  std::mt19937 rng(10);
  const Index s_k = 4096, d = 64, s_q = 4;
  SparseCase<Scalar> c({1, 8, s_q, d}, 1, s_k, d, rng);
  // Rows 1000..1063 and 3000..3040: every query picks from them only.
  c.selected = KeySelection::Constant(s_q, 80, -1);
  for (Index r = 0; r < s_q; ++r) {
    Index n = 0;
    for (Index j = 1000; j < 1064; j += 1 + r) c.selected(r, n++) = j;
    for (Index j = 3000; j < 3040 && n < 80; j += 3) c.selected(r, n++) = j;
  }
  const auto count = static_cast<std::size_t>(s_k * d);
  GuardedBuffer<Scalar> k(count), v(count);
  std::memcpy(k.data(), c.k.data.data(), count * sizeof(Scalar));
  std::memcpy(v.data(), c.v.data.data(), count * sizeof(Scalar));
  const auto row = [&](Index j) { return static_cast<std::size_t>(j * d); };
  for (GuardedBuffer<Scalar>* g : {&k, &v}) {
    ASSERT_GT(g->forbid(0, row(1000)), 0U);
    ASSERT_GT(g->forbid(row(1064), row(3000)), 0U);
    ASSERT_GT(g->forbid(row(3040), count), 0U);
  }
  std::vector<Scalar> out(static_cast<std::size_t>(8 * s_q * d));
  apex::sdpa_sparse(HeadsView<const Scalar>::contiguous(c.q.data.data(), {1, 8, s_q, d}),
                    HeadsView<const Scalar>::contiguous(k.data(), {1, 1, s_k, d}),
                    HeadsView<const Scalar>::contiguous(v.data(), {1, 1, s_k, d}), c.selected,
                    c.params, HeadsView<Scalar>::contiguous(out.data(), c.out_shape()));
  std::vector<double> want, want_lse;
  c.expected(want, want_lse);
  EXPECT_LE(normwise_error(out, want), Tolerances<Scalar>::kAttention);
}

#ifdef _OPENMP
// The same call on 1, 2 and 3 threads gives the same bits (decoding splits its keys over the
// threads' chunks; the split depends on the shapes only).
TYPED_TEST(SparseAttention, BitIdenticalForAnyThreadCount) {
  using Scalar = TypeParam;
  std::mt19937 rng(11);
  SparseCase<Scalar> c({2, 16, 3, 32}, 2, 5000, 32, rng);
  c.selected = random_selection(
      6, 3000, 0.7, [](Index) { return Index{5000}; }, rng);
  const int saved = omp_get_max_threads();
  std::vector<Scalar> first, first_lse;
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<Scalar> out, lse;
    c.run(out, lse);
    if (threads == 1) {
      first = out;
      first_lse = lse;
    } else {
      EXPECT_EQ(std::memcmp(out.data(), first.data(), out.size() * sizeof(Scalar)), 0);
      EXPECT_EQ(std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(Scalar)), 0);
    }
  }
  omp_set_num_threads(saved);
}
#endif

// Over a paged latent cache (pages of 16 filled in turn by three sequences, one forked, one with
// its first pages forgotten): each row's result is sdpa_sparse's over the same rows stored
// contiguously, bit for bit, and a position the sequence does not hold is rejected with nothing
// written; over a paged K/V cache of two heads, the same.
TYPED_TEST(SparseAttention, PagedEqualsContiguous) {
  using Scalar = TypeParam;
  std::mt19937 rng(14);
  const Index d_kv = 24, width = 32, h_q = 8, page = 16;
  apex::PagedLatentCache<Scalar> cache({d_kv, 1, width - d_kv, page, 64});
  std::vector<apex::SequenceId> ids{cache.add(), cache.add(), cache.add()};
  std::vector<RowMatrix<Scalar>> history(3);
  for (int round = 0; round < 6; ++round) {
    for (std::size_t i = 0; i < 3; ++i) {
      const Index n = 7 + Index(i) * 5 + round;
      const RowMatrix<Scalar> rows = apex::testing::random_matrix<Scalar>(n, width, rng);
      cache.append(ids[i], rows);
      history[i].conservativeResize(history[i].rows() + n, width);
      history[i].bottomRows(n) = rows;
    }
  }
  ids.push_back(cache.fork(ids[1]));
  history.push_back(history[1]);
  cache.forget_before(ids[2], 40);  // positions [32, length) held
  const std::vector<Index> cu{0, 3, 4, 9, 11};
  const Index total = cu.back();
  Tensor<Scalar> q({1, h_q, total, width}, rng, true);
  KeySelection selected = KeySelection::Constant(total, 60, -1);
  std::bernoulli_distribution take(0.4);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    for (Index r = cu[i]; r < cu[i + 1]; ++r) {
      Index n = 0;
      for (Index p = cache.first_position(ids[i]); p < cache.length(ids[i]) && n < 60; ++p) {
        if (take(rng)) selected(r, n++) = p;
      }
    }
  }
  std::vector<Scalar> out(static_cast<std::size_t>(h_q * total * d_kv));
  const auto out_view = HeadsView<Scalar>::contiguous(out.data(), {1, h_q, total, d_kv});
  apex::sdpa_sparse_paged(q.view(), cu, cache, ids, selected, {}, out_view);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const RowMatrix<Scalar>& rows = history[i];
    const Index nq = cu[i + 1] - cu[i];
    std::vector<Scalar> want(static_cast<std::size_t>(h_q * nq * d_kv));
    apex::sdpa_sparse(
        q.view().middle_rows(cu[i], nq),
        HeadsView<const Scalar>(rows.data(), {1, 1, rows.rows(), width}, {0, 0, width}),
        HeadsView<const Scalar>(rows.data(), {1, 1, rows.rows(), d_kv}, {0, 0, width}),
        KeySelection(selected.middleRows(cu[i], nq)), {},
        HeadsView<Scalar>::contiguous(want.data(), {1, h_q, nq, d_kv}));
    for (Index h = 0; h < h_q; ++h) {
      for (Index r = 0; r < nq; ++r) {
        for (Index e = 0; e < d_kv; ++e) {
          ASSERT_EQ(out_view.head(0, h)(cu[i] + r, e),
                    want[static_cast<std::size_t>((h * nq + r) * d_kv + e)])
              << "sequence " << i << " head " << h << " row " << r;
        }
      }
    }
  }
  std::vector<Scalar> before = out;
  KeySelection forgotten = selected;
  forgotten(5, 0) = 31;  // row 5 is sequence 2's, which holds [32, length)
  expect_invalid(
      [&] { apex::sdpa_sparse_paged(q.view(), cu, cache, ids, forgotten, {}, out_view); },
      {"[sdpa_sparse_paged]", "selection(5, 0) (31)", "[32, "});
  EXPECT_EQ(out, before);
  // A paged K/V cache of two key/value heads: the selected rows of both heads, in place.
  apex::PagedKvCache<Scalar> two_heads({2, width, 4, 8});
  const apex::SequenceId id = two_heads.add();
  Tensor<Scalar> k({1, 2, 10, width}, rng), v({1, 2, 10, width}, rng);
  two_heads.append(id, k.view(), v.view());
  KeySelection one = KeySelection::Constant(1, 4, -1);
  one(0, 0) = 1;
  one(0, 1) = 6;
  one(0, 2) = 9;
  std::vector<Scalar> paged(static_cast<std::size_t>(h_q * width)), want(paged.size());
  apex::sdpa_sparse_paged(q.view().middle_rows(0, 1), {0, 1}, two_heads, {id}, one, {},
                          HeadsView<Scalar>::contiguous(paged.data(), {1, h_q, 1, width}));
  apex::sdpa_sparse(q.view().middle_rows(0, 1), k.view(), v.view(), one, {},
                    HeadsView<Scalar>::contiguous(want.data(), {1, h_q, 1, width}));
  EXPECT_EQ(paged, want);
}

// A 16-bit key/value format is read as it is stored: equal to the loop over the stored values.
TEST(SparseAttention, SixteenBitKeysAndValues) {
  std::mt19937 rng(12);
  SparseCase<float> c({1, 8, 2, 32}, 1, 600, 32, rng);
  c.selected = random_selection(
      2, 300, 0.5, [](Index) { return Index{600}; }, rng);
  std::vector<Eigen::bfloat16> k(c.k.data.size()), v(c.v.data.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = Eigen::bfloat16(c.k.data[i]);
    c.k.data[i] = static_cast<float>(k[i]);
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = Eigen::bfloat16(c.v.data[i]);
    c.v.data[i] = static_cast<float>(v[i]);
  }
  std::vector<float> out(static_cast<std::size_t>(8 * 2 * 32));
  apex::sdpa_sparse(c.q.view(),
                    HeadsView<const Eigen::bfloat16>::contiguous(k.data(), {1, 1, 600, 32}),
                    HeadsView<const Eigen::bfloat16>::contiguous(v.data(), {1, 1, 600, 32}),
                    c.selected, c.params, HeadsView<float>::contiguous(out.data(), c.out_shape()));
  std::vector<double> want, want_lse;
  c.expected(want, want_lse);  // over the rounded values, stored back as float
  EXPECT_LE(normwise_error(out, want), Tolerances<float>::kAttention);
}

// Bad selections and parameters: a clear message, and the output left as it was.
TEST(SparseAttention, BadInputIsRejectedAndChangesNothing) {
  std::mt19937 rng(13);
  SparseCase<float> c({1, 2, 3, 8}, 1, 10, 8, rng);
  c.selected = KeySelection::Constant(3, 4, -1);
  std::vector<float> out(static_cast<std::size_t>(2 * 3 * 8), 7.0f);
  const auto call = [&](const KeySelection& s, const SdpaParams& p) {
    apex::sdpa_sparse(c.q.view(), c.k.view(), c.v.view(), s, p,
                      HeadsView<float>::contiguous(out.data(), c.out_shape()));
  };
  KeySelection rows = KeySelection::Constant(2, 4, -1);
  expect_invalid([&] { call(rows, {}); }, {"[sdpa_sparse]", "selection has 2 rows", "3"});
  KeySelection range = c.selected;
  range(0, 0) = 10;
  expect_invalid([&] { call(range, {}); }, {"[sdpa_sparse]", "selection(0, 0) (10)", "[0, 10)"});
  KeySelection order = c.selected;
  order(1, 0) = 4;
  order(1, 1) = 4;
  expect_invalid([&] { call(order, {}); }, {"selection(1, 1) (4)", "above the entry before"});
  KeySelection gap = c.selected;
  gap(2, 1) = 3;
  expect_invalid([&] { call(gap, {}); }, {"selection(2, 1) (3)", "-1"});
  KeySelection negative = c.selected;
  negative(2, 0) = -2;
  expect_invalid([&] { call(negative, {}); }, {"selection(2, 0) (-2)", "-1"});
  SdpaParams alibi;
  alibi.alibi_slopes = {0.5, 0.25};
  expect_invalid([&] { call(c.selected, alibi); }, {"[sdpa_sparse]", "alibi_slopes"});
  for (const float x : out) ASSERT_EQ(x, 7.0f);
}

}  // namespace
}  // namespace sparse_attention_test
