// SPDX-License-Identifier: MIT
// Dense masks and user rules on the calls over many sequences (varlen.hpp): sdpa_nonpad_kv with
// an attn_mask and a bias beside nonpad_kv_seqlen in one call (ONNX Attention-24), sdpa_varlen
// with masks over the packed rows, and the user's rules seeing each sequence as its own batch.
// Each sequence is checked bit for bit against apex::sdpa on that sequence alone with its rows and
// columns of the masks, and normwise against the plain loops of tests/reference/attention.hpp
// (Tolerances::kAttention).
#include <apex/attention_rules.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>
#include <apex/varlen.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "block_pool.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace sequence_masks_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::testing::Heads;

/// A boolean mask [batch, heads, rows, cols], about one pair in five forbidden, owned.
struct BoolMask {
  Index batch, heads, rows, cols;
  std::unique_ptr<bool[]> data;

  BoolMask(Index b, Index h, Index r, Index c, std::mt19937& rng)
      : batch(b), heads(h), rows(r), cols(c), data(new bool[std::size_t(b * h * r * c)]) {
    std::bernoulli_distribution allowed(0.8);
    for (Index x = 0; x < b * h * r * c; ++x) data[std::size_t(x)] = allowed(rng);
  }
  HeadsView<const bool> view() const {
    return HeadsView<const bool>(data.get(), {batch, heads, rows, cols},
                                 {heads * rows * cols, rows * cols, cols});
  }
};

/// Rows [first, first + count) of batch b of a mask view, narrowed to `keys` columns: what a
/// sequence of a many-sequence call reads, as a view for sdpa on that sequence alone.
template <class T>
HeadsView<const T> rows_of(const HeadsView<const T>& mask, Index b, Index first, Index count,
                           Index keys) {
  const HeadsView<const T> rows = mask.middle_batches(b, 1).middle_rows(first, count);
  return HeadsView<const T>(rows.data(), {1, rows.heads(), count, keys}, rows.strides());
}

/// The plain loops' answer for head h of one sequence with its dense mask and bias rows.
template <class Scalar>
apex_test::AttentionResult reference_head(const Heads<Scalar>& q, Index qb, Index q0, Index nq,
                                          const Heads<Scalar>& k, const Heads<Scalar>& v, Index kb,
                                          Index k0, Index nk, Index h, Index kv,
                                          const HeadsView<const bool>& allowed,
                                          const HeadsView<const Scalar>& bias, bool causal) {
  const apex_test::MatrixD qq = q.head(qb, h).middleRows(q0, nq);
  const apex_test::MatrixD kk = k.head(kb, kv).middleRows(k0, nk);
  const apex_test::MatrixD vv = v.head(kb, kv).middleRows(k0, nk);
  const apex_test::MatrixD b = bias.head(0, h).template cast<double>();
  const Index first = nk - nq;  // bottom-right: the queries are the last positions
  const auto allows = [&](Index i, Index j) {
    return allowed.head(0, h)(i, j) && (!causal || j <= first + i);
  };
  return apex_test::attention(qq, kk, vv, allows, &b, 1.0 / std::sqrt(double(q.dim())), 0.0);
}

// ONNX Attention-24 with both attn_mask (boolean, broadcast over the heads) and a bias, beside
// nonpad_kv_seqlen: one call; the padded slots hold NaN in K, V and the bias and are never read.
TEST(SequenceMasks, NonpadKvWithDenseMaskAndBiasIsOneCall) {
  using Scalar = float;
  const Index batches = 4, capacity = 70, s_q = 5, hq = 4, hkv = 2, d = 16;
  const std::vector<Index> lengths = {0, 70, 33, 6};
  std::mt19937 rng(5);
  Heads<Scalar> q(batches, hq, s_q, d), k(batches, hkv, capacity, d), v(batches, hkv, capacity, d);
  Heads<Scalar> bias(batches, hq, s_q, capacity), out(batches, hq, s_q, d),
      lse(batches, hq, s_q, 1);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  bias.randomize(rng);
  const BoolMask allowed(batches, 1, s_q, capacity, rng);
  for (Index b = 0; b < batches; ++b) {
    const Index pad = capacity - lengths[std::size_t(b)];
    for (Index h = 0; h < hkv; ++h) {
      k.head_map(b, h).bottomRows(pad).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      v.head_map(b, h).bottomRows(pad).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    }
    for (Index h = 0; h < hq; ++h) {
      bias.head_map(b, h).rightCols(pad).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    }
  }
  for (const bool causal : {false, true}) {
    PositionMask rule;
    rule.causal = causal;
    const apex::AttentionMask<Scalar> mask{rule, allowed.view(), bias.view()};
    out.fill(Scalar(apex::testing::kSentinel));
    apex::sdpa_nonpad_kv(q.view(), k.view(), v.view(), lengths, mask, apex::SdpaParams{},
                         out.view(), lse.view());
    for (Index b = 0; b < batches; ++b) {
      const Index len = lengths[std::size_t(b)];
      SCOPED_TRACE("causal " + std::to_string(causal) + ", batch " + std::to_string(b));
      Heads<Scalar> one(1, hq, s_q, d), one_lse(1, hq, s_q, 1);
      const auto my_allowed = rows_of(allowed.view(), b, 0, s_q, len);
      const auto my_bias = rows_of(HeadsView<const Scalar>(bias.view()), b, 0, s_q, len);
      apex::sdpa(q.view().middle_batches(b, 1), k.view().middle_batches(b, 1).middle_rows(0, len),
                 v.view().middle_batches(b, 1).middle_rows(0, len),
                 apex::AttentionMask<Scalar>{rule, my_allowed, my_bias}, apex::SdpaParams{},
                 one.view(), one_lse.view());
      for (Index h = 0; h < hq; ++h) {
        EXPECT_TRUE(out.view().head(b, h) == one.view().head(0, h));
        EXPECT_TRUE(lse.view().head(b, h) == one_lse.view().head(0, h));
        const Index kv = apex_test::kv_head_of(h, hq, hkv);
        const auto ref =
            reference_head(q, b, 0, s_q, k, v, b, 0, len, h, kv, my_allowed, my_bias, causal);
        const apex_test::MatrixD mine = out.head(b, h);
        EXPECT_LE((mine - ref.out).cwiseAbs().maxCoeff(),
                  apex::testing::Tolerances<Scalar>::kAttention);
      }
    }
  }
}

// A ragged batch with a dense mask and a bias over the packed query rows (column j: key j of the
// row's own sequence), its own rule per sequence, and user rules (a mask rule with its classifier
// and a score rule) that see sequence i as batch i.
TEST(SequenceMasks, VarlenWithDenseMasksAndUserRulesEqualsOneSdpaPerSequence) {
  using Scalar = float;
  const std::vector<Index> q_len = {7, 0, 130, 1}, k_len = {7, 9, 300, 40};
  const Index hq = 4, hkv = 2, d = 16, longest = 300;
  const auto layout = apex::RaggedBatch::from_lengths(q_len, k_len);
  const Index total_q = layout.cu_seqlens_q.back(), total_k = layout.cu_seqlens_k.back();
  std::mt19937 rng(9);
  Heads<Scalar> q(1, hq, total_q, d), k(1, hkv, total_k, d), v(1, hkv, total_k, d);
  Heads<Scalar> bias(1, hq, total_q, longest + 3), out(1, hq, total_q, d), lse(1, hq, total_q, 1);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  bias.randomize(rng);
  const BoolMask allowed(1, hq, total_q, longest, rng);
  std::vector<PositionMask> rules(q_len.size());
  rules[0].causal = true;
  rules[2].causal = true;
  rules[2].window = 64;
  // Forbids keys whose position is a multiple of (b + 3) for heads h > b, and adds b·0.125 to
  // every score of sequence b: wrong if a sequence saw another's index.
  const auto user = apex::attention_rules(
      [](Index b, Index h, Index, Index kp) { return h <= b || kp % (b + 3) != 0; },
      [](Index b, Index h, apex::PositionRange, apex::PositionRange) {
        return h <= b ? apex::BlockCoverage::kAll : apex::BlockCoverage::kPartial;
      },
      [](Index b, Index, Index, Index, auto s) { return s + decltype(s)(0.125 * double(b)); });
  const apex::AttentionMask<Scalar> mask{{}, allowed.view(), bias.view()};
  out.fill(Scalar(apex::testing::kSentinel));
  apex::sdpa_varlen(q.view(), k.view(), v.view(), layout, rules, mask, apex::SdpaParams{}, user,
                    out.view(), lse.view());
  for (Index i = 0; i < Index(q_len.size()); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const Index q0 = layout.cu_seqlens_q[std::size_t(i)], nq = q_len[std::size_t(i)];
    const Index k0 = layout.cu_seqlens_k[std::size_t(i)], nk = k_len[std::size_t(i)];
    if (nq == 0) continue;
    Heads<Scalar> one(1, hq, nq, d), one_lse(1, hq, nq, 1);
    const auto own = apex::detail::rules_at_batch(user, i);
    apex::sdpa(
        q.view().middle_rows(q0, nq), k.view().middle_rows(k0, nk), v.view().middle_rows(k0, nk),
        apex::AttentionMask<Scalar>{rules[std::size_t(i)], rows_of(allowed.view(), 0, q0, nq, nk),
                                    rows_of(HeadsView<const Scalar>(bias.view()), 0, q0, nq, nk)},
        apex::SdpaParams{}, own, one.view(), one_lse.view());
    for (Index h = 0; h < hq; ++h) {
      EXPECT_TRUE(out.view().head(0, h).middleRows(q0, nq) == one.view().head(0, h));
      EXPECT_TRUE(lse.view().head(0, h).middleRows(q0, nq) == one_lse.view().head(0, h));
    }
  }
  // Against the plain loops for the long sequence, whose window, mask and rules all bite.
  const Index q0 = layout.cu_seqlens_q[2], k0 = layout.cu_seqlens_k[2];
  for (Index h = 0; h < hq; ++h) {
    const Index kv = apex_test::kv_head_of(h, hq, hkv);
    const apex_test::MatrixD qq = q.head(0, h).middleRows(q0, 130);
    const apex_test::MatrixD kk = k.head(0, kv).middleRows(k0, 300);
    const apex_test::MatrixD vv = v.head(0, kv).middleRows(k0, 300);
    apex_test::MatrixD b = bias.head(0, h).block(q0, 0, 130, 300);
    b.array() += 0.25;  // the score rule of sequence 2
    const auto allows = [&](Index r, Index j) {
      const Index qp = 170 + r;  // bottom-right: the last 130 of 300 positions
      return allowed.view().head(0, h)(q0 + r, j) && j <= qp && qp - j < 64 &&
             (h <= 2 || j % 5 != 0);
    };
    const auto ref = apex_test::attention(qq, kk, vv, allows, &b, 0.25, 0.0);
    const apex_test::MatrixD mine = out.head(0, h).middleRows(q0, 130);
    EXPECT_LE((mine - ref.out).cwiseAbs().maxCoeff(), apex::testing::Tolerances<Scalar>::kAttention)
        << "head " << h;
  }
}

// A paged cache: masks over the packed query rows (column j: the sequence's j-th held key) and
// user rules seeing ids[i] as batch i, on sdpa_paged and on sdpa_block_tables over the cache's
// own pool; each equals sdpa over the same tokens stored contiguously with the same rows and
// columns of the masks, bit for bit.
TEST(SequenceMasks, PagedAndBlockTablesWithDenseMasksAndUserRules) {
  using Scalar = float;
  const Index hq = 4, hkv = 2, d = 16, page = 16;
  const std::vector<Index> held = {40, 7, 100}, q_len = {3, 1, 5};
  std::mt19937 rng(21);
  apex::PagedKvCache<Scalar> cache({hkv, d, page, 32});
  std::vector<apex::SequenceId> ids;
  std::vector<Heads<Scalar>> ks, vs;
  for (const Index n : held) {
    ids.push_back(cache.add());
    ks.emplace_back(1, hkv, n, d);
    vs.emplace_back(1, hkv, n, d);
    ks.back().randomize(rng);
    vs.back().randomize(rng);
    cache.append(ids.back(), ks.back().view(), vs.back().view());
  }
  const std::vector<Index> cu = {0, 3, 4, 9};
  Heads<Scalar> q(1, hq, 9, d), out(1, hq, 9, d), bias(1, 1, 9, 100);
  q.randomize(rng);
  bias.randomize(rng);
  const BoolMask allowed(1, hq, 9, 100, rng);
  const apex::AttentionMask<Scalar> mask{{}, allowed.view(), bias.view()};
  const std::vector<PositionMask> rules{apex::causal_mask()};
  const auto user =
      apex::mask_rule([](Index b, Index h, Index, Index kp) { return (kp + b + h) % 4 != 0; });
  const auto expect_per_sequence = [&](const char* call) {
    for (std::size_t i = 0; i < held.size(); ++i) {
      SCOPED_TRACE(std::string(call) + ", sequence " + std::to_string(i));
      const Index q0 = cu[i], nq = q_len[i], n = held[i];
      Heads<Scalar> one(1, hq, nq, d);
      const auto own = apex::detail::rules_at_batch(user, Index(i));
      apex::sdpa(
          q.view().middle_rows(q0, nq), ks[i].view(), vs[i].view(),
          apex::AttentionMask<Scalar>{apex::causal_mask(), rows_of(allowed.view(), 0, q0, nq, n),
                                      rows_of(HeadsView<const Scalar>(bias.view()), 0, q0, nq, n)},
          apex::SdpaParams{}, own, one.view());
      for (Index h = 0; h < hq; ++h) {
#if APEX_EIGEN_INTERNALS
        EXPECT_TRUE(out.view().head(0, h).middleRows(q0, nq) == one.view().head(0, h));
#else
        const apex_test::MatrixD a = out.head(0, h).middleRows(q0, nq), b = one.head(0, h);
        EXPECT_LE((a - b).cwiseAbs().maxCoeff(), apex::testing::Tolerances<Scalar>::kAttention);
#endif
      }
    }
  };
  out.fill(Scalar(apex::testing::kSentinel));
  apex::sdpa_paged(q.view(), cu, cache, ids, rules, mask, apex::SdpaParams{}, user, out.view());
  expect_per_sequence("sdpa_paged");

  // A pool of the test's own, the pages of each sequence taken from its end backwards.
  const Index pool_pages = 12;
  Heads<Scalar> k_pool(pool_pages, hkv, page, d), v_pool(pool_pages, hkv, page, d);
  k_pool.fill(std::numeric_limits<Scalar>::quiet_NaN());
  v_pool.fill(std::numeric_limits<Scalar>::quiet_NaN());
  const auto tables = apex::testing::fill_block_tables(
      k_pool, v_pool, held,
      [&](std::size_t i, Index h, Index t) { return ks[i].view().head(0, h).row(t); },
      [&](std::size_t i, Index h, Index t) { return vs[i].view().head(0, h).row(t); });
  out.fill(Scalar(apex::testing::kSentinel));
  apex::sdpa_block_tables(q.view(), cu, tables, rules, mask, apex::SdpaParams{}, user, out.view());
  expect_per_sequence("sdpa_block_tables");
}

// Bad masks throw before anything is written: too few columns for the longest sequence, rows
// that are not the query rows, a position rule on the mask where each sequence has its own, a
// batch extent that is neither 1 nor B.
TEST(SequenceMasks, RejectsMasksThatDoNotFitAndChangesNothing) {
  using Scalar = float;
  std::mt19937 rng(3);
  const auto layout = apex::RaggedBatch::from_lengths({2, 3}, {4, 6});
  Heads<Scalar> q(1, 2, 5, 8), k(1, 1, 10, 8), v(1, 1, 10, 8), out(1, 2, 5, 8);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  out.fill(Scalar(apex::testing::kSentinel));
  const std::vector<PositionMask> rules{apex::causal_mask()};
  const auto varlen = [&](const apex::AttentionMask<Scalar>& mask) {
    return [&, mask] {
      apex::sdpa_varlen(q.view(), k.view(), v.view(), layout, rules, mask, apex::SdpaParams{},
                        out.view());
    };
  };
  const BoolMask narrow(1, 1, 5, 5, rng), short_rows(1, 1, 4, 6, rng), fits(1, 1, 5, 6, rng);
  apex::testing::expect_invalid(varlen({{}, narrow.view(), {}}),
                                {"[sdpa_varlen]", "allowed mask has 5 columns", "(6)"});
  apex::testing::expect_invalid(varlen({{}, short_rows.view(), {}}),
                                {"[sdpa_varlen]", "allowed mask"});
  apex::testing::expect_invalid(varlen({apex::causal_mask(), fits.view(), {}}),
                                {"[sdpa_varlen]", "mask.positions"});
  EXPECT_TRUE(out.all_equal(Scalar(apex::testing::kSentinel)));

  Heads<Scalar> bq(2, 2, 3, 8), bk(2, 1, 6, 8), bv(2, 1, 6, 8), bout(2, 2, 3, 8);
  bq.randomize(rng);
  bk.randomize(rng);
  bv.randomize(rng);
  bout.fill(Scalar(apex::testing::kSentinel));
  Heads<Scalar> bias3(3, 2, 3, 6);
  bias3.randomize(rng);
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_nonpad_kv(bq.view(), bk.view(), bv.view(), {6, 2},
                             apex::AttentionMask<Scalar>{{}, {}, bias3.view()}, apex::SdpaParams{},
                             bout.view());
      },
      {"[sdpa_nonpad_kv]", "bias batch (3)", "batch size 2"});
  EXPECT_TRUE(bout.all_equal(Scalar(apex::testing::kSentinel)));
}

}  // namespace
}  // namespace sequence_masks_test
