// SPDX-License-Identifier: MIT
// Tests of include/apex/varlen.hpp: ragged batches (cu_seqlens) and per-batch key lengths
// (nonpad_kv_seqlen). Each sequence is checked two ways: bit for bit against apex::sdpa on that
// sequence alone (the kernel plans each sequence from its own shapes, so nothing may differ), and
// normwise against the plain loops of tests/reference/attention.hpp (Tolerances::kAttention).
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/varlen.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace varlen_test {
namespace {

using apex::Index;
using apex::PositionMask;
using apex::testing::Heads;
using apex::testing::Layout;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// A ragged batch: N sequences of the given query and key lengths packed token-major (heads
/// side by side), random Q, K, V, one rule per sequence (in the plain loops' terms and the
/// library's), and the outputs, which start as the sentinel.
template <class Scalar>
struct Batch {
  apex::RaggedBatch layout;
  Index q_heads, kv_heads, d_qk, d_v;
  Heads<Scalar> q, k, v, out, lse;
  std::vector<apex_test::MaskRule> rules;
  std::vector<std::optional<Index>> query_offsets;
  std::vector<std::vector<Index>> documents;  // per sequence, when its rule has documents
  apex::SdpaParams params;

  Batch(const std::vector<Index>& q_len, const std::vector<Index>& k_len, Index hq, Index hkv,
        Index dqk, Index dv, std::uint32_t seed)
      : layout(apex::RaggedBatch::from_lengths(q_len, k_len)),
        q_heads(hq),
        kv_heads(hkv),
        d_qk(dqk),
        d_v(dv),
        q(1, hq, layout.cu_seqlens_q.back(), dqk, Layout::kTokenMajor),
        k(1, hkv, layout.cu_seqlens_k.back(), dqk, Layout::kTokenMajor),
        v(1, hkv, layout.cu_seqlens_k.back(), dv, Layout::kTokenMajor),
        out(1, hq, layout.cu_seqlens_q.back(), dv, Layout::kTokenMajor),
        lse(1, hq, layout.cu_seqlens_q.back(), 1),
        rules(q_len.size()),
        query_offsets(q_len.size()),
        documents(q_len.size()) {
    std::mt19937 rng(seed);
    q.randomize(rng);
    k.randomize(rng);
    v.randomize(rng);
    out.fill(Scalar(apex::testing::kSentinel));
    lse.fill(Scalar(apex::testing::kSentinel));
  }

  Index sequences() const { return layout.sequences(); }
  Index q_begin(Index i) const { return layout.cu_seqlens_q[std::size_t(i)]; }
  Index q_len(Index i) const { return layout.cu_seqlens_q[std::size_t(i) + 1] - q_begin(i); }
  Index k_begin(Index i) const { return layout.cu_seqlens_k[std::size_t(i)]; }
  Index k_len(Index i) const { return layout.cu_seqlens_k[std::size_t(i) + 1] - k_begin(i); }

  /// Sequence i gets document ids over its positions: runs of random length.
  void add_documents(Index i, std::mt19937& rng) {
    const Index end = std::max(q_len(i), k_len(i));  // bottom-right or top-left, offset 0
    std::vector<Index>& ids = documents[std::size_t(i)];
    ids.resize(std::size_t(end));
    std::uniform_int_distribution<Index> run(1, 9);
    Index id = 0;
    for (Index p = 0; p < end;) {
      const Index n = run(rng);
      for (Index t = 0; t < n && p < end; ++t) ids[std::size_t(p++)] = id;
      ++id;
    }
    rules[std::size_t(i)].documents = &ids;
  }

  /// The library's rule of sequence i.
  PositionMask mask(Index i) const {
    const apex_test::MaskRule& r = rules[std::size_t(i)];
    PositionMask m;
    m.causal = r.causal;
    if (r.window > 0) m.window = r.window;
    if (r.chunk > 0) m.chunk = r.chunk;
    m.prefix = r.prefix;
    if (r.documents != nullptr) m.documents = apex::DocumentIds(*r.documents);
    m.query_offset = query_offsets[std::size_t(i)];
    return m;
  }
  std::vector<PositionMask> masks() const {
    std::vector<PositionMask> all;
    for (Index i = 0; i < sequences(); ++i) all.push_back(mask(i));
    return all;
  }
};

/// apex::sdpa on sequence i alone, into fresh outputs.
template <class Scalar>
std::pair<Heads<Scalar>, Heads<Scalar>> alone(const Batch<Scalar>& b, Index i,
                                              const apex::detail::FlashBlocking& blocking) {
  Heads<Scalar> out(1, b.q_heads, b.q_len(i), b.d_v), lse(1, b.q_heads, b.q_len(i), 1);
  const apex::AttentionMask<Scalar> mask{b.mask(i), {}, {}};
  apex::detail::flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(
      b.q.view().middle_rows(b.q_begin(i), b.q_len(i)),
      b.k.view().middle_rows(b.k_begin(i), b.k_len(i)),
      b.v.view().middle_rows(b.k_begin(i), b.k_len(i)), mask, b.params, out.view(), lse.view(), {},
      blocking);
  return {std::move(out), std::move(lse)};
}

/// Expects sequence i of the batch's outputs to equal sdpa on it alone, bit for bit, and the
/// plain loops to Tolerances::kAttention (normwise over the sequence).
template <class Scalar>
void expect_sequence_right(const Batch<Scalar>& b, Index i,
                           const apex::detail::FlashBlocking& blocking) {
  SCOPED_TRACE("sequence " + std::to_string(i) + ": S_q " + std::to_string(b.q_len(i)) + ", S_k " +
               std::to_string(b.k_len(i)));
  const auto [out, lse] = alone(b, i, blocking);
  const auto q = b.q.view().middle_rows(b.q_begin(i), b.q_len(i));
  const auto k = b.k.view().middle_rows(b.k_begin(i), b.k_len(i));
  const auto v = b.v.view().middle_rows(b.k_begin(i), b.k_len(i));
  const auto got = b.out.view().middle_rows(b.q_begin(i), b.q_len(i));
  const auto got_lse = b.lse.view().middle_rows(b.q_begin(i), b.q_len(i));
  const apex_test::MaskRule& rule = b.rules[std::size_t(i)];
  const Index first_query = b.mask(i).first_query_position(b.q_len(i), b.k_len(i));
  double max_ref = 0.0, max_err = 0.0;
  for (Index h = 0; h < b.q_heads; ++h) {
    const Index kv = apex_test::kv_head_of(h, b.q_heads, b.kv_heads);
    for (Index r = 0; r < b.q_len(i); ++r) {
      for (Index c = 0; c < b.d_v; ++c) {
        ASSERT_EQ(got.head(0, h)(r, c), out.view().head(0, h)(r, c))
            << "head " << h << " row " << r << " differs from sdpa on the sequence alone";
      }
      ASSERT_EQ(got_lse.head(0, h)(r, 0), lse.view().head(0, h)(r, 0)) << "lse row " << r;
    }
    const auto ref = apex_test::attention(
        q.head(0, h).template cast<double>(), k.head(0, kv).template cast<double>(),
        v.head(0, kv).template cast<double>(),
        [&](Index r, Index j) { return apex_test::rule_allows(rule, first_query + r, j); }, nullptr,
        1.0 / std::sqrt(double(b.d_qk)), 0.0);
    const apex_test::MatrixD mine = got.head(0, h).template cast<double>();
    for (Index r = 0; r < b.q_len(i); ++r) {
      if (ref.lse(r) == kNegInf) {
        EXPECT_TRUE(mine.row(r).isZero(0.0)) << "row " << r << " has no key: zeros";
        EXPECT_EQ(double(got_lse.head(0, h)(r, 0)), kNegInf);
      }
    }
    if (mine.size() > 0) {
      max_ref = std::max(max_ref, ref.out.cwiseAbs().maxCoeff());
      max_err = std::max(max_err, (mine - ref.out).cwiseAbs().maxCoeff());
    }
  }
  EXPECT_LE(max_err, apex::testing::Tolerances<Scalar>::kAttention * std::max(1.0, max_ref));
}

/// Lengths with empty and one-token sequences among random ones up to `longest`.
std::vector<Index> lengths(std::mt19937& rng, std::size_t n, Index longest) {
  std::vector<Index> len(n);
  std::uniform_int_distribution<Index> pick(0, longest);
  for (std::size_t i = 0; i < n; ++i) len[i] = i == 1 ? 0 : i == 2 ? 1 : pick(rng);
  return len;
}

/// The rules tried, one per sequence in turn: none, causal, window, prefix + window, chunks,
/// documents (bidirectional and causal), top-left causal.
template <class Scalar>
void give_rules(Batch<Scalar>& b, std::mt19937& rng) {
  for (Index i = 0; i < b.sequences(); ++i) {
    apex_test::MaskRule& r = b.rules[std::size_t(i)];
    switch (i % 8) {
      case 0:
        break;
      case 1:
        r.causal = true;
        break;
      case 2:
        r.causal = true;
        r.window = 7;
        break;
      case 3:
        r.causal = true;
        r.window = 5;
        r.prefix = 4;
        break;
      case 4:
        r.causal = true;
        r.chunk = 16;
        break;
      case 5:
        b.add_documents(i, rng);
        break;
      case 6:
        r.causal = true;
        b.add_documents(i, rng);
        break;
      default:
        r.causal = true;
        b.query_offsets[std::size_t(i)] = 0;
        break;
    }
  }
}

template <class Scalar>
class VarlenTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(VarlenTyped, Scalars, apex::testing::ScalarName);

/// §6.2 / §8.2 per sequence: prefill of sequences of random lengths (0 and 1 among them), every
/// rule, GQA groups 1, 4 and 16, default and small blocks (several query and key blocks per
/// sequence).
TYPED_TEST(VarlenTyped, EqualsOneSdpaPerSequence) {
  using Scalar = TypeParam;
  std::mt19937 rng(7);
  apex::detail::FlashBlocking small;
  small.stacked_rows = 16;
  small.key_block = 8;
  small.stream_key_block = 8;
  for (const Index group : {1, 4, 16}) {
    for (const bool blocks_small : {false, true}) {
      SCOPED_TRACE("G " + std::to_string(group) + (blocks_small ? ", small blocks" : ""));
      std::vector<Index> q_len = lengths(rng, 16, 70);
      std::vector<Index> k_len = q_len;  // prefill: the queries are the sequence's tokens
      for (std::size_t i = 0; i < q_len.size(); i += 3) k_len[i] += 5;  // some with history
      Batch<Scalar> b(q_len, k_len, 2 * group, 2, 24, 16, 11 + std::uint32_t(group));
      give_rules(b, rng);
      const auto blocking = blocks_small ? small : apex::detail::FlashBlocking{};
      apex::detail::flash_sdpa_varlen<Scalar, Scalar, Scalar, Scalar>(
          b.q.view(), b.k.view(), b.v.view(), b.layout, b.masks(), b.params, b.out.view(),
          b.lse.view(), blocking);
      for (Index i = 0; i < b.sequences(); ++i) expect_sequence_right(b, i, blocking);
    }
  }
}

/// Decoding many sequences at once: one query each against keys of very different lengths,
/// so that the long ones are split into key chunks and the short ones are not; with a budget of
/// partial results so small that the sequences run in several waves.
TYPED_TEST(VarlenTyped, BatchedDecodingEqualsOneCallPerSequence) {
  using Scalar = TypeParam;
  std::mt19937 rng(3);
  const std::vector<Index> k_len = {1, 2000, 0, 37, 5000, 700, 1200, 3};
  const std::vector<Index> q_len(k_len.size(), 1);
  for (const Index budget : {Index{1} << 19, Index{20000}}) {
    SCOPED_TRACE("partial budget " + std::to_string(budget));
    Batch<Scalar> b(q_len, k_len, 8, 2, 32, 32, 5);
    for (Index i = 0; i < b.sequences(); ++i) b.rules[std::size_t(i)].causal = true;
    b.rules[5].window = 300;
    apex::detail::FlashBlocking blocking;
    blocking.partial_budget = budget;
    apex::detail::flash_sdpa_varlen<Scalar, Scalar, Scalar, Scalar>(
        b.q.view(), b.k.view(), b.v.view(), b.layout, b.masks(), b.params, b.out.view(),
        b.lse.view(), blocking);
    for (Index i = 0; i < b.sequences(); ++i) expect_sequence_right(b, i, blocking);
  }
}

/// One rule for every sequence (rules of size 1), with sinks and ALiBi from the parameters.
TEST(Varlen, OneRuleForEverySequenceWithSinksAndAlibi) {
  std::mt19937 rng(9);
  Batch<float> b(lengths(rng, 6, 40), lengths(rng, 6, 40), 4, 2, 16, 8, 21);
  b.params.sinks = {0.5, -1.0, 2.0, 0.0};
  b.params.alibi_slopes = apex::alibi_slopes(4);
  for (auto& r : b.rules) r.causal = true;  // what alone() gives sdpa
  apex::sdpa_varlen(b.q.view(), b.k.view(), b.v.view(), b.layout, {apex::causal_mask()}, b.params,
                    b.out.view(), b.lse.view());
  for (Index i = 0; i < b.sequences(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const auto [out, lse] = alone(b, i, {});
    const auto got = b.out.view().middle_rows(b.q_begin(i), b.q_len(i));
    const auto got_lse = b.lse.view().middle_rows(b.q_begin(i), b.q_len(i));
    for (Index h = 0; h < b.q_heads; ++h) {
      EXPECT_TRUE(got.head(0, h) == out.view().head(0, h));
      EXPECT_TRUE(got_lse.head(0, h) == lse.view().head(0, h));
    }
  }
}

/// A sequence whose float scores overflow is computed again in double, alone: it gets sdpa's
/// answer, and the other sequences keep their float pass.
TEST(Varlen, OverflowingSequenceFallsBackAlone) {
  Batch<float> b({5, 6, 4}, {5, 6, 4}, 2, 1, 8, 8, 4);
  for (Index r = 0; r < b.q_len(1); ++r) {
    for (Index h = 0; h < b.q_heads; ++h)
      b.q.head_map(0, h).row(b.q_begin(1) + r).setConstant(1e20f);
  }
  for (Index r = 0; r < b.k_len(1); ++r)
    b.k.head_map(0, 0).row(b.k_begin(1) + r).setConstant(1e20f);
  for (auto& r : b.rules) r.causal = true;
  apex::sdpa_varlen(b.q.view(), b.k.view(), b.v.view(), b.layout, b.masks(), b.params, b.out.view(),
                    b.lse.view());
  for (Index i = 0; i < b.sequences(); ++i) {
    const auto [out, lse] = alone(b, i, {});
    const auto got = b.out.view().middle_rows(b.q_begin(i), b.q_len(i));
    for (Index h = 0; h < b.q_heads; ++h) {
      EXPECT_TRUE(got.head(0, h).allFinite());
      EXPECT_TRUE(got.head(0, h) == out.view().head(0, h)) << "sequence " << i;
    }
  }
}

/// 1 and 2 threads give the same bits.
TEST(Varlen, BitIdenticalForAnyThreadCount) {
#ifdef _OPENMP
  std::mt19937 rng(5);
  const std::vector<Index> k_len = {3000, 17, 0, 1500, 64};
  const std::vector<Index> q_len = {1, 17, 0, 1, 64};
  Batch<float> one(q_len, k_len, 8, 2, 32, 32, 8), two(q_len, k_len, 8, 2, 32, 32, 8);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  apex::sdpa_varlen(one.q.view(), one.k.view(), one.v.view(), one.layout, {apex::causal_mask()},
                    one.params, one.out.view(), one.lse.view());
  omp_set_num_threads(2);
  apex::sdpa_varlen(two.q.view(), two.k.view(), two.v.view(), two.layout, {apex::causal_mask()},
                    two.params, two.out.view(), two.lse.view());
  omp_set_num_threads(saved);
  for (std::size_t e = 0; e < one.out.size(); ++e) ASSERT_EQ(one.out.at(e), two.out.at(e));
  for (std::size_t e = 0; e < one.lse.size(); ++e) ASSERT_EQ(one.lse.at(e), two.lse.at(e));
#else
  GTEST_SKIP() << "built without OpenMP: one thread only";
#endif
}

/// ONNX Attention-24's nonpad_kv_seqlen: batch b of a cache of capacity C attends to its first
/// len_b keys, bottom-right causal per batch; the keys past the length hold NaN, which must
/// never be read. Against the plain loops on the truncated keys, and bit for bit against sdpa on
/// them.
TYPED_TEST(VarlenTyped, NonpadKvSeqlenIgnoresThePadding) {
  using Scalar = TypeParam;
  const Index batches = 5, capacity = 90, s_q = 3, hq = 4, hkv = 2, d = 16;
  const std::vector<Index> lengths = {0, 1, 90, 47, 2};
  Heads<Scalar> q(batches, hq, s_q, d), k(batches, hkv, capacity, d), v(batches, hkv, capacity, d);
  Heads<Scalar> out(batches, hq, s_q, d), lse(batches, hq, s_q, 1);
  std::mt19937 rng(2);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  for (Index b = 0; b < batches; ++b) {
    for (Index h = 0; h < hkv; ++h) {
      const Index pad = capacity - lengths[std::size_t(b)];
      k.head_map(b, h).bottomRows(pad).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      v.head_map(b, h).bottomRows(pad).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    }
  }
  for (const bool causal : {false, true}) {
    PositionMask rule;
    rule.causal = causal;
    apex::sdpa_nonpad_kv(q.view(), k.view(), v.view(), lengths, rule, apex::SdpaParams{},
                         out.view(), lse.view());
    for (Index b = 0; b < batches; ++b) {
      const Index len = lengths[std::size_t(b)];
      SCOPED_TRACE("batch " + std::to_string(b) + ", length " + std::to_string(len));
      Heads<Scalar> one(1, hq, s_q, d), one_lse(1, hq, s_q, 1);
      apex::sdpa(q.view().middle_batches(b, 1), k.view().middle_batches(b, 1).middle_rows(0, len),
                 v.view().middle_batches(b, 1).middle_rows(0, len),
                 apex::AttentionMask<Scalar>{rule, {}, {}}, apex::SdpaParams{}, one.view(),
                 one_lse.view());
      for (Index h = 0; h < hq; ++h) {
        const Index kv = apex_test::kv_head_of(h, hq, hkv);
        EXPECT_TRUE(out.view().head(b, h) == one.view().head(0, h));
        EXPECT_TRUE(lse.view().head(b, h) == one_lse.view().head(0, h));
        const apex_test::MatrixD kk = k.head(b, kv).topRows(len);
        const apex_test::MatrixD vv = v.head(b, kv).topRows(len);
        const Index first = len - s_q;  // bottom-right: the queries are the last S_q positions
        const auto ref = apex_test::attention(
            q.head(b, h), kk, vv, [&](Index i, Index j) { return !causal || j <= first + i; },
            nullptr, 1.0 / std::sqrt(double(d)), 0.0);
        const apex_test::MatrixD mine = out.head(b, h);
        ASSERT_TRUE(mine.allFinite());
        EXPECT_LE((mine - ref.out).cwiseAbs().maxCoeff(),
                  apex::testing::Tolerances<Scalar>::kAttention);
      }
    }
  }
}

/// Bad input: a clear std::invalid_argument naming the argument, and the outputs untouched.
TEST(Varlen, RejectsBadInputAndChangesNothing) {
  Batch<float> b({2, 3}, {2, 3}, 2, 1, 8, 8, 1);
  const auto call = [&](const apex::RaggedBatch& layout, const std::vector<PositionMask>& rules) {
    return [&b, layout, rules] {
      apex::sdpa_varlen(b.q.view(), b.k.view(), b.v.view(), layout, rules, b.params, b.out.view(),
                        b.lse.view());
    };
  };
  const std::vector<PositionMask> one{apex::causal_mask()};
  apex::testing::expect_invalid(call({{1, 2, 5}, {0, 2, 5}}, one),
                                {"[sdpa_varlen]", "cu_seqlens_q[0] (1)"});
  apex::testing::expect_invalid(call({{0, 3, 2, 5}, {0, 2, 2, 5}}, one),
                                {"cu_seqlens_q", "must not decrease"});
  apex::testing::expect_invalid(call({{0, 2, 4}, {0, 2, 5}}, one),
                                {"cu_seqlens_q ends at 4", "5 rows"});
  apex::testing::expect_invalid(call({{0, 2, 5}, {0, 5}}, one),
                                {"cu_seqlens_k has 2 entries", "N + 1 = 3"});
  apex::testing::expect_invalid(call({{}, {}}, one), "cu_seqlens_q must have N + 1 >= 1 entries");
  apex::testing::expect_invalid(call(b.layout, {one[0], one[0], one[0]}),
                                {"masks holds 3", "one per sequence (2)"});
  PositionMask bad;
  bad.window = 3;  // without causal
  apex::testing::expect_invalid(call(b.layout, {one[0], bad}), {"requires causal", "(sequence 1)"});
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_varlen(
            b.q.view(), b.k.view(), b.v.view(), b.layout, one, b.params,
            apex::HeadsView<float>(b.q.data(), b.out.view().shape(), b.out.view().strides()),
            b.lse.view());
      },
      "must not share memory");
  Heads<float> two(2, 2, 5, 8);
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_varlen(two.view(), b.k.view(), b.v.view(), b.layout, one, b.params, b.out.view(),
                          b.lse.view());
      },
      "q batch (2) must be 1");
  EXPECT_TRUE(b.out.all_equal(float(apex::testing::kSentinel)));
  EXPECT_TRUE(b.lse.all_equal(float(apex::testing::kSentinel)));

  Heads<float> q(2, 2, 1, 8), k(2, 1, 6, 8), v(2, 1, 6, 8), out(2, 2, 1, 8);
  out.fill(float(apex::testing::kSentinel));
  const auto nonpad = [&](const std::vector<Index>& lengths) {
    return [&, lengths] {
      apex::sdpa_nonpad_kv(q.view(), k.view(), v.view(), lengths, apex::causal_mask(),
                           apex::SdpaParams{}, out.view());
    };
  };
  apex::testing::expect_invalid(nonpad({3}),
                                {"[sdpa_nonpad_kv]", "holds 1 lengths", "per batch (2)"});
  apex::testing::expect_invalid(nonpad({3, 7}), {"nonpad_kv_seqlen[1] (7)", "[0, 6]"});
  apex::testing::expect_invalid(nonpad({-1, 2}), "nonpad_kv_seqlen[0] (-1)");
  EXPECT_TRUE(out.all_equal(float(apex::testing::kSentinel)));
  apex::testing::expect_invalid(
      [] {
        apex::RaggedBatch::from_lengths({1, -2}, {1, 1});
      },
      "q_lengths[1] (-2) must be >= 0");
  apex::testing::expect_invalid(
      [] {
        apex::RaggedBatch::from_lengths({1}, {1, 1});
      },
      "one length per sequence");
}

}  // namespace
}  // namespace varlen_test
