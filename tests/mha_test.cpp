// SPDX-License-Identifier: MIT
// Tests for §7: multi-head attention after the projections (per-head sdpa, concat, W_O), the
// layout conversions and the §7.3 parameter count. (The §7.4 KV-cache size is a formula of
// apex/cache_memory.hpp: cache_memory_test.cpp.)
#include <apex/mha.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace mha_test {
namespace {

using apex::AttentionMask;
using apex::HeadsTensor;
using apex::HeadsView;
using apex::Index;
using apex::RowMatrix;
using apex::testing::expect_close;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;
using apex::testing::Tolerances;
using MatrixXd = Eigen::MatrixXd;

// Tolerance, per element: |actual − expected| ≤ tol · max(1, |expected|) with tol =
// Tolerances<Scalar>::kShortChain of tolerances.hpp. Inputs are O(1), and every output is a chain
// of short dot products (length ≤ 16), one softmax over ≤ 9 keys and the W_O product (length
// ≤ 12). Observed errors are ~20× below it; a wrong head, scale or mask moves results by O(0.1).

// ---------------------------------------------------------------------------------------------
// The expected output: the plain loop of reference/attention.hpp (§6.2, §7.2, §8.2), then W_O.
// ---------------------------------------------------------------------------------------------

// Which (b, h, i, j) pairs may attend; i, j are row indices of the head's q and k.
using AllowFn = bool (*)(Index b, Index h, Index i, Index j, Index s_q, Index s_k);

bool allow_all(Index, Index, Index, Index, Index, Index) { return true; }
// Causal with the queries as the last S_q of the S_k positions.
bool allow_causal(Index, Index, Index i, Index j, Index s_q, Index s_k) {
  return j <= s_k - s_q + i;
}

// A [B, H, S, D] view as the token-major [B·S, H·D] matrix the plain loop reads, in double.
template <class T>
apex_test::MatrixD token_major(const HeadsView<T>& view) {
  apex_test::MatrixD m(view.batch() * view.seq(), view.heads() * view.dim());
  for (Index b = 0; b < view.batch(); ++b) {
    for (Index h = 0; h < view.heads(); ++h) {
      m.block(b * view.seq(), h * view.dim(), view.seq(), view.dim()) =
          view.head(b, h).template cast<double>();
    }
  }
  return m;
}

// §7.2: out = Concat_h Attention(Q_h, K_g, V_g) · W_O, g = h / (H_q / H_kv).
template <class T, class Allow>
MatrixXd plain_mha(const HeadsView<T>& q, const HeadsView<T>& k, const HeadsView<T>& v,
                   const MatrixXd& w_o, Allow allow) {
  const Index s_q = q.seq();
  const Index s_k = k.seq();
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.dim()));
  const apex_test::MatrixD concat = apex_test::multi_head_attention(
      token_major(q), token_major(k), token_major(v), {q.batch(), q.heads(), k.heads()},
      [&](Index b, Index h, Index i, Index j) { return allow(b, h, i, j, s_q, s_k); }, scale);
  return concat * w_o;
}

// ---------------------------------------------------------------------------------------------
// Worked examples
// ---------------------------------------------------------------------------------------------

TEST(Mha, S7_3_ParameterCount) {
  // W_Q, W_K, W_V: d × H_q·d_h each; W_O: H_q·d_h × d.
  const std::int64_t d = 7168;
  const std::int64_t h_q = 56;
  const std::int64_t d_h = 128;  // H_q · d_h = 7168 = d
  const std::int64_t per_matrix = d * h_q * d_h;
  EXPECT_EQ(apex::mha_parameter_count(d, h_q, d_h), 3 * per_matrix + h_q * d_h * d);
  EXPECT_EQ(apex::mha_parameter_count(d, h_q, d_h), 4 * d * d);  // 4d² when H_q·d_h = d
  EXPECT_EQ(apex::mha_parameter_count(d, h_q, d_h), 205'520'896);
  // H_q·d_h ≠ d: the count is 4·d·H_q·d_h, not 4d².
  EXPECT_EQ(apex::mha_parameter_count(1024, 16, 128), 4 * 1024 * 2048);
}

TEST(Mha, SizeHelpersRejectNegativeOrOverflowingArguments) {
  // 4 · 2^62 wraps to 0 in 64 bits: rejected, never returned wrapped. (The cache sizes of §7.4
  // are tested in cache_memory_test.cpp.)
  const std::int64_t huge = std::int64_t{1} << 62;
  expect_invalid([&] { (void)apex::mha_parameter_count(huge, 4, 1); },
                 {"[mha_parameter_count] 4*d*H_q*d_h", "overflows 64 bits"});
  expect_invalid([] { (void)apex::mha_parameter_count(7168, -56, 128); },
                 {"[mha_parameter_count] 4*d*H_q*d_h", "must not be negative"});
  // The largest representable results are still returned.
  EXPECT_EQ(apex::mha_parameter_count(0, huge, huge), 0);
}

// ---------------------------------------------------------------------------------------------
// Layout conversion
// ---------------------------------------------------------------------------------------------

TEST(Mha, SplitHeadsIsTheDocumentsReshape) {
  const Index batch = 2, seq = 3, heads = 4, dim = 5;
  RowMatrix<double> x(batch * seq, heads * dim);
  for (Index r = 0; r < x.rows(); ++r) {
    for (Index c = 0; c < x.cols(); ++c) x(r, c) = static_cast<double>(1000 * r + c);
  }
  const HeadsTensor<double> t = apex::split_heads(x, batch, heads);
  ASSERT_EQ(t.batch(), batch);
  ASSERT_EQ(t.heads(), heads);
  ASSERT_EQ(t.seq(), seq);
  ASSERT_EQ(t.dim(), dim);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index s = 0; s < seq; ++s) {
        for (Index j = 0; j < dim; ++j) {
          // Contiguous [B, H, S, D]: element (b, h, s, j) at ((b·H + h)·S + s)·D + j.
          EXPECT_EQ(t.data()[((b * heads + h) * seq + s) * dim + j], x(b * seq + s, h * dim + j));
        }
      }
    }
  }
  EXPECT_EQ(apex::merge_heads(t), x);
  // The token-major view sees the same elements without a copy.
  const auto view = HeadsView<const double>::token_major(x.data(), {batch, heads, seq, dim});
  EXPECT_EQ(apex::merge_heads(view), x);
}

TEST(Mha, SplitAndMergeOfNoTokens) {
  // x has no rows, so its data is null: nothing is copied and no pointer is offset from it
  // (UndefinedBehaviorSanitizer checks the latter), whatever batch divides the 0 rows.
  const RowMatrix<double> x(0, 6);
  for (const Index batch : {Index{1}, Index{3}, Index{1} << 40}) {
    const HeadsTensor<double> t = apex::split_heads(x, batch, 2);
    EXPECT_EQ(t.batch(), batch);
    EXPECT_EQ(t.heads(), 2);
    EXPECT_EQ(t.seq(), 0);
    EXPECT_EQ(t.dim(), 3);
    const RowMatrix<double> back = apex::merge_heads(t);
    EXPECT_EQ(back.rows(), 0);
    EXPECT_EQ(back.cols(), 6);
  }
  // No columns: heads of width 0.
  const RowMatrix<float> narrow(4, 0);
  const HeadsTensor<float> t = apex::split_heads(narrow, 2, 5);
  EXPECT_EQ(t.dim(), 0);
  RowMatrix<float> back(4, 0);
  apex::merge_heads(t.view(), back);
  EXPECT_EQ(back.rows(), 4);
}

TEST(Mha, MergeHeadsRejectsNegativeExtents) {
  // [-1, 1, -1, 2]: B·S = 1 and H·d_h = 2 match a 1 × 2 output, but the extents are not a shape.
  const float data[2] = {1.0f, 2.0f};
  const HeadsView<const float> heads(data, {-1, 1, -1, 2}, {0, 0, 2});
  RowMatrix<float> out = RowMatrix<float>::Constant(1, 2, 7.0f);
  expect_invalid([&] { apex::merge_heads(heads, out); },
                 {"[merge_heads] heads shape [-1, 1, -1, 2] must have no negative extent"});
  EXPECT_TRUE((out.array() == 7.0f).all());
  expect_invalid([&] { (void)apex::merge_heads(heads); }, "[merge_heads]");
}

TEST(Mha, MergeHeadsHonoursRowStride) {
  const HeadsTensor<float> t = apex::split_heads(random_matrix<float>(6, 8, 1), 2, 4);
  RowMatrix<float> wide = RowMatrix<float>::Constant(6, 11, -7.0f);
  apex::merge_heads(t.view(), apex::RowRef<float>(wide.middleCols(2, 8)));
  EXPECT_EQ(RowMatrix<float>(wide.middleCols(2, 8)), apex::merge_heads(t));
  EXPECT_TRUE((wide.leftCols(2).array() == -7.0f).all());
  EXPECT_TRUE((wide.rightCols(1).array() == -7.0f).all());
}

// ---------------------------------------------------------------------------------------------
// multi_head_attention against the plain loop
// ---------------------------------------------------------------------------------------------

template <class Scalar>
class MhaTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MhaTyped, Scalars, apex::testing::ScalarName);

// Shapes that are multiples of nothing in particular: B = 2, H_q = 3, S_q = 5, S_k = 7,
// d_qk = 5, d_v = 3, d = 7. Q as a contiguous tensor, K and V token-major (projection layout).
template <class Scalar>
struct Problem {
  Index batch = 2, heads = 3, kv_heads = 3, s_q = 5, s_k = 7, d_qk = 5, d_v = 3, d = 7;
  HeadsTensor<Scalar> q;
  RowMatrix<Scalar> k, v, w_o;

  explicit Problem(Index num_kv_heads, Index queries = 5) : kv_heads(num_kv_heads), s_q(queries) {
    q = apex::split_heads(random_matrix<Scalar>(batch * s_q, heads * d_qk, 11), batch, heads);
    k = random_matrix<Scalar>(batch * s_k, kv_heads * d_qk, 12);
    v = random_matrix<Scalar>(batch * s_k, kv_heads * d_v, 13);
    w_o = random_matrix<Scalar>(heads * d_v, d, 14);
  }
  HeadsView<const Scalar> q_view() const { return q.view(); }
  HeadsView<const Scalar> k_view() const {
    return HeadsView<const Scalar>::token_major(k.data(), {batch, kv_heads, s_k, d_qk});
  }
  HeadsView<const Scalar> v_view() const {
    return HeadsView<const Scalar>::token_major(v.data(), {batch, kv_heads, s_k, d_v});
  }
  MatrixXd w_o_double() const { return w_o.template cast<double>(); }
};

TYPED_TEST(MhaTyped, MatchesPlainPerHeadLoop) {
  using Scalar = TypeParam;
  for (const Index kv_heads : {Index{3}, Index{1}}) {  // MHA, and MQA through the same call
    SCOPED_TRACE("kv_heads " + std::to_string(kv_heads));
    const Problem<Scalar> p(kv_heads);
    const RowMatrix<Scalar> out =
        apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), {}, {}, p.w_o);
    expect_close(out, plain_mha(p.q_view(), p.k_view(), p.v_view(), p.w_o_double(), allow_all),
                 Tolerances<Scalar>::kShortChain);
  }
}

TYPED_TEST(MhaTyped, CausalWithFewerQueriesThanKeys) {
  using Scalar = TypeParam;
  for (const Index queries : {Index{1}, Index{5}, Index{7}}) {  // decode step, chunk, prompt
    SCOPED_TRACE("S_q " + std::to_string(queries));
    const Problem<Scalar> p(3, queries);
    AttentionMask<Scalar> mask;
    mask.positions = apex::causal_mask();
    RowMatrix<Scalar> out(p.batch * queries, p.d);
    apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), mask, {}, p.w_o, out);
    expect_close(out, plain_mha(p.q_view(), p.k_view(), p.v_view(), p.w_o_double(), allow_causal),
                 Tolerances<Scalar>::kShortChain);
  }
}

// A dense mask per batch and head; row 2 of (b = 1, h = 0) forbids every key (-> zeros).
bool allow_pattern(Index b, Index h, Index i, Index j, Index, Index) {
  if (b == 1 && h == 0 && i == 2) return false;
  return (b + 2 * h + i + 3 * j) % 4 != 0;
}

TYPED_TEST(MhaTyped, DenseMaskPerBatchAndHead) {
  using Scalar = TypeParam;
  const Problem<Scalar> p(3);
  Eigen::Matrix<bool, Eigen::Dynamic, 1> storage(p.batch * p.heads * p.s_q * p.s_k);
  const auto allowed =
      HeadsView<bool>::contiguous(storage.data(), {p.batch, p.heads, p.s_q, p.s_k});
  for (Index b = 0; b < p.batch; ++b) {
    for (Index h = 0; h < p.heads; ++h) {
      for (Index i = 0; i < p.s_q; ++i) {
        for (Index j = 0; j < p.s_k; ++j)
          allowed.head(b, h)(i, j) = allow_pattern(b, h, i, j, 0, 0);
      }
    }
  }
  AttentionMask<Scalar> mask;
  mask.allowed = allowed;
  const RowMatrix<Scalar> out =
      apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), mask, {}, p.w_o);
  expect_close(out, plain_mha(p.q_view(), p.k_view(), p.v_view(), p.w_o_double(), allow_pattern),
               Tolerances<Scalar>::kShortChain);
}

bool allow_shared(Index, Index, Index i, Index j, Index, Index) { return (i + j) % 3 != 1; }

TYPED_TEST(MhaTyped, SharedDenseMask) {
  using Scalar = TypeParam;
  const Problem<Scalar> p(3);
  apex::BoolMatrix shared(p.s_q, p.s_k);
  for (Index i = 0; i < p.s_q; ++i) {
    for (Index j = 0; j < p.s_k; ++j) shared(i, j) = allow_shared(0, 0, i, j, 0, 0);
  }
  AttentionMask<Scalar> mask;
  mask.allowed = apex::as_heads_view(shared);
  const RowMatrix<Scalar> out =
      apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), mask, {}, p.w_o);
  expect_close(out, plain_mha(p.q_view(), p.k_view(), p.v_view(), p.w_o_double(), allow_shared),
               Tolerances<Scalar>::kShortChain);
}

// The documented aliasing: out may be the storage Q was read from.
TYPED_TEST(MhaTyped, OutMayOverwriteTheQueries) {
  using Scalar = TypeParam;
  const Index batch = 2, heads = 2, seq = 4, dim = 3;
  RowMatrix<Scalar> q = random_matrix<Scalar>(batch * seq, heads * dim, 21);
  const RowMatrix<Scalar> k = random_matrix<Scalar>(batch * seq, heads * dim, 22);
  const RowMatrix<Scalar> v = random_matrix<Scalar>(batch * seq, heads * dim, 23);
  const RowMatrix<Scalar> w_o = random_matrix<Scalar>(heads * dim, heads * dim, 24);
  const auto view = [&](const RowMatrix<Scalar>& m) {
    return HeadsView<const Scalar>::token_major(m.data(), {batch, heads, seq, dim});
  };
  const RowMatrix<Scalar> expected =
      apex::multi_head_attention(view(q), view(k), view(v), {}, {}, w_o);
  apex::multi_head_attention(view(q), view(k), view(v), {}, {}, w_o, apex::RowRef<Scalar>(q));
  EXPECT_EQ(q, expected);
}

// ---------------------------------------------------------------------------------------------
// Bad input: the message names the argument, and the output keeps its sentinel values.
// ---------------------------------------------------------------------------------------------

constexpr double kSentinel = 12345.0;

TEST(Mha, RejectsQueryHeadsNotAMultipleOfKvHeads) {
  Problem<double> p(3);
  const RowMatrix<double> k = random_matrix<double>(p.batch * p.s_k, 2 * p.d_qk, 1);
  const RowMatrix<double> v = random_matrix<double>(p.batch * p.s_k, 2 * p.d_v, 2);
  const auto kv = HeadsView<const double>::token_major(k.data(), {p.batch, 2, p.s_k, p.d_qk});
  const auto vv = HeadsView<const double>::token_major(v.data(), {p.batch, 2, p.s_k, p.d_v});
  RowMatrix<double> out = RowMatrix<double>::Constant(p.batch * p.s_q, p.d, kSentinel);
  expect_invalid([&] { apex::multi_head_attention(p.q_view(), kv, vv, {}, {}, p.w_o, out); },
                 {"[multi_head_attention] num_q_heads (3) must be a multiple of num_kv_heads (2)"});
  EXPECT_TRUE((out.array() == kSentinel).all());
}

TEST(Mha, RejectsWrongOutputProjection) {
  const Problem<double> p(3);
  const RowMatrix<double> w_o = random_matrix<double>(p.heads * p.d_v + 1, p.d, 3);
  RowMatrix<double> out = RowMatrix<double>::Constant(p.batch * p.s_q, p.d, kSentinel);
  expect_invalid(
      [&] { apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), {}, {}, w_o, out); },
      {"[multi_head_attention] w_o rows (10) must equal H_q*d_v = 3*3 = 9"});
  EXPECT_TRUE((out.array() == kSentinel).all());
}

TEST(Mha, RejectsWrongOutputShape) {
  const Problem<double> p(3);
  RowMatrix<double> out = RowMatrix<double>::Constant(p.batch * p.s_q, p.d + 1, kSentinel);
  expect_invalid(
      [&] { apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), {}, {}, p.w_o, out); },
      {"[multi_head_attention] out shape [10, 8] must be [B*S_q, d] = [10, 7]"});
  EXPECT_TRUE((out.array() == kSentinel).all());
}

TEST(Mha, RejectsWrongMaskShape) {
  const Problem<double> p(3);
  const apex::BoolMatrix shared = apex::BoolMatrix::Constant(p.s_q, p.s_k + 1, true);
  AttentionMask<double> mask;
  mask.allowed = apex::as_heads_view(shared);
  RowMatrix<double> out = RowMatrix<double>::Constant(p.batch * p.s_q, p.d, kSentinel);
  expect_invalid(
      [&] { apex::multi_head_attention(p.q_view(), p.k_view(), p.v_view(), mask, {}, p.w_o, out); },
      {"[multi_head_attention] allowed mask shape [5, 8] must be [S_q, S_k] = [5, 7]"});
  EXPECT_TRUE((out.array() == kSentinel).all());
}

TEST(Mha, RejectsAConcatenationBeyond64Bits) {
  // Views may claim any extents (here with zero strides over two values): B·S_q·H_q·d_v =
  // 2^32 · 2^32 · 2 cannot be allocated, and must be rejected rather than wrapped.
  const double data[2] = {1.0, 2.0};
  const Index big = Index{1} << 32;
  const HeadsView<const double> q(data, {big, 1, big, 2}, {0, 0, 0});
  const HeadsView<const double> kv(data, {big, 1, 1, 2}, {0, 0, 0});
  const RowMatrix<double> w_o = RowMatrix<double>::Ones(2, 3);
  RowMatrix<double> out = RowMatrix<double>::Constant(2, 3, kSentinel);
  expect_invalid([&] { apex::multi_head_attention(q, kv, kv, {}, {}, w_o, out); },
                 {"[multi_head_attention] B*H*S*D", "overflows 64 bits"});
  EXPECT_TRUE((out.array() == kSentinel).all());
  expect_invalid([&] { (void)apex::multi_head_attention(q, kv, kv, {}, {}, w_o); },
                 {"[multi_head_attention] B*S_q", "overflows 64 bits"});
}

TEST(Mha, SplitAndMergeRejectBadShapes) {
  const RowMatrix<float> x = random_matrix<float>(6, 8, 5);
  expect_invalid([&] { (void)apex::split_heads(x, 4, 2); },
                 {"[split_heads] batch (4) must be >= 1 and divide the rows of x (6)"});
  expect_invalid([&] { (void)apex::split_heads(x, 2, 3); },
                 {"[split_heads] heads (3) must be >= 1 and divide the columns of x (8)"});
  HeadsTensor<float> wrong({2, 4, 3, 3});
  wrong.view().head(0, 0).setConstant(7.0f);
  expect_invalid([&] { apex::split_heads(x, 2, 4, wrong.view()); },
                 {"[split_heads] out shape [2, 4, 3, 3] must be [B, H, S, d_h] = [2, 4, 3, 2]"});
  EXPECT_TRUE((wrong.head(0, 0).array() == 7.0f).all());
  const HeadsTensor<float> t = apex::split_heads(x, 2, 4);
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 9, 7.0f);
  expect_invalid([&] { apex::merge_heads(t.view(), out); },
                 {"[merge_heads] out shape [6, 9] must be [B*S, H*d_h] = [6, 8]"});
  EXPECT_TRUE((out.array() == 7.0f).all());
}

}  // namespace
}  // namespace mha_test
