// SPDX-License-Identifier: MIT
// Tests of include/apex/cascade_attention.hpp: sdpa_cascade against the plain double loops of
// reference/attention.hpp over every sequence's tokens (kept by a shadow model), for random
// histories of add / append / fork (so prefixes shared at several levels), every kind of position
// rule, sinks, soft-capping and ALiBi, GQA groups {1, 4, 16}; against sdpa_paged bit for bit
// where nothing is shared; its plan (each shared page read once); threads; bad input.
#include <apex/cascade_attention.hpp>
#include <apex/mask.hpp>
#include <apex/paged_attention.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa_params.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using apex::Index;
using apex::PositionMask;
using apex::SequenceId;
using apex::testing::Heads;
using apex_test::MatrixD;

constexpr Index kKvHeads = 2;
constexpr Index kDim = 16;

/// The tokens of one sequence as the shadow keeps them: K and V of each head, [tokens, d].
struct Tokens {
  std::vector<MatrixD> k = std::vector<MatrixD>(kKvHeads, MatrixD(0, kDim));
  std::vector<MatrixD> v = std::vector<MatrixD>(kKvHeads, MatrixD(0, kDim));
  Index length() const { return k[0].rows(); }
};

/// A paged cache of float and the shadow of its sequences.
struct Shadowed {
  explicit Shadowed(Index page) : cache({kKvHeads, kDim, page, 256}) {}
  apex::PagedKvCache<float> cache;
  std::map<SequenceId, Tokens> tokens;

  SequenceId add() {
    const SequenceId id = cache.add();
    tokens[id];
    return id;
  }
  SequenceId fork(SequenceId parent) {
    const SequenceId id = cache.fork(parent);
    tokens[id] = tokens[parent];
    return id;
  }
  void append(SequenceId id, Index n, std::mt19937& rng) {
    Heads<float> k(1, kKvHeads, n, kDim), v(1, kKvHeads, n, kDim);
    k.randomize(rng);
    v.randomize(rng);
    cache.append(id, k.view(), v.view());
    Tokens& t = tokens[id];
    const Index old = t.length();
    for (Index h = 0; h < kKvHeads; ++h) {
      t.k[std::size_t(h)].conservativeResize(old + n, kDim);
      t.v[std::size_t(h)].conservativeResize(old + n, kDim);
      t.k[std::size_t(h)].bottomRows(n) = k.head(0, h);
      t.v[std::size_t(h)].bottomRows(n) = v.head(0, h);
    }
  }
};

/// A prompt of `prompt` tokens, then `steps` random forks and appends: sequences sharing pages at
/// several levels. Returns the live ids in order.
std::vector<SequenceId> random_family(Shadowed& s, Index prompt, int steps, std::mt19937& rng) {
  std::vector<SequenceId> ids{s.add()};
  s.append(ids[0], prompt, rng);
  for (int step = 0; step < steps; ++step) {
    const SequenceId pick = ids[std::uniform_int_distribution<std::size_t>(0, ids.size() - 1)(rng)];
    if (rng() % 2 == 0) {
      ids.push_back(s.fork(pick));
    } else {
      s.append(pick, std::uniform_int_distribution<Index>(1, 12)(rng), rng);
    }
  }
  return ids;
}

/// The reference's form of a PositionMask (no offsets: the positions are the sequence's own).
apex_test::MaskRule reference_rule(const PositionMask& m) {
  apex_test::MaskRule r;
  r.causal = m.causal;
  r.window = m.window.value_or(0);
  r.chunk = m.chunk.value_or(0);
  r.prefix = m.prefix;
  return r;
}

/// One call's queries (the last cu[i + 1] − cu[i] tokens of ids[i]: `each`, or 1 to 3 by id, as
/// many as the sequence holds at most).
struct Call {
  std::vector<SequenceId> ids;
  std::vector<Index> cu{0};
  Heads<double> q;
  Call(const Shadowed& s, std::vector<SequenceId> sequences, Index q_heads, std::mt19937& rng,
       Index each = 0)
      : ids(std::move(sequences)), q(1, q_heads, 0, kDim) {
    for (const SequenceId id : ids) {
      const Index held = s.tokens.at(id).length();
      cu.push_back(cu.back() + std::min<Index>(held, each > 0 ? each : 1 + id.value % 3));
    }
    q = Heads<double>(1, q_heads, cu.back(), kDim, apex::testing::Layout::kTokenMajor);
    q.randomize(rng);
  }
  template <class T>
  Heads<T> queries() const {
    Heads<T> out(1, q.heads(), q.seq(), kDim);
    for (Index h = 0; h < q.heads(); ++h) out.head_map(0, h) = q.head(0, h).cast<T>();
    return out;
  }
};

/// The plain loops over each sequence's tokens: out [H_q, total_q, d] and lse, as double heads.
std::pair<Heads<double>, Heads<double>> reference(const Shadowed& s, const Call& call,
                                                  const PositionMask& rule,
                                                  const apex::SdpaParams& params) {
  const Index q_heads = call.q.heads(), total = call.q.seq();
  Heads<double> out(1, q_heads, total, kDim), lse(1, q_heads, total, 1);
  const apex_test::MaskRule r = reference_rule(rule);
  for (std::size_t i = 0; i < call.ids.size(); ++i) {
    const Tokens& t = s.tokens.at(call.ids[i]);
    const Index q0 = call.cu[i], nq = call.cu[i + 1] - q0, first = t.length() - nq;
    for (Index h = 0; h < q_heads; ++h) {
      const Index g = apex_test::kv_head_of(h, q_heads, kKvHeads);
      const double slope = params.alibi_slopes.empty() ? 0.0 : params.alibi_slopes[std::size_t(h)];
      MatrixD bias(nq, t.length());
      for (Index a = 0; a < nq; ++a) {
        for (Index j = 0; j < t.length(); ++j) bias(a, j) = slope * double(j - (first + a));
      }
      const double sink = params.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                               : params.sinks[std::size_t(h)];
      const auto result = apex_test::attention(
          call.q.head(0, h).middleRows(q0, nq), t.k[std::size_t(g)], t.v[std::size_t(g)],
          [&](Index a, Index j) { return apex_test::rule_allows(r, first + a, j); }, &bias,
          params.scale.value_or(1.0 / std::sqrt(double(kDim))), params.softcap, sink);
      out.head_map(0, h).middleRows(q0, nq) = result.out;
      lse.head_map(0, h).middleRows(q0, nq) = result.lse;
    }
  }
  return {std::move(out), std::move(lse)};
}

/// Normwise as kAttention says: max |out − ref| ≤ tol · max |ref|, lse ≤ tol · max(1, max |lse|).
template <class T>
void expect_near_reference(const Heads<T>& out, const Heads<T>& lse,
                           const std::pair<Heads<double>, Heads<double>>& expected, double tol) {
  double out_scale = 0, lse_scale = 1, out_error = 0, lse_error = 0;
  for (Index h = 0; h < out.heads(); ++h) {
    const MatrixD want = expected.first.head(0, h), got = out.head(0, h);
    const MatrixD want_lse = expected.second.head(0, h), got_lse = lse.head(0, h);
    out_scale = std::max(out_scale, want.cwiseAbs().maxCoeff());
    out_error = std::max(out_error, (got - want).cwiseAbs().maxCoeff());
    for (Index i = 0; i < want_lse.rows(); ++i) {
      if (std::isinf(want_lse(i, 0))) {
        EXPECT_EQ(got_lse(i, 0), want_lse(i, 0)) << "head " << h << ", row " << i;
        continue;
      }
      lse_scale = std::max(lse_scale, std::abs(want_lse(i, 0)));
      lse_error = std::max(lse_error, std::abs(got_lse(i, 0) - want_lse(i, 0)));
    }
  }
  EXPECT_LE(out_error, tol * out_scale);
  EXPECT_LE(lse_error, tol * lse_scale);
}

/// The position rules of the tests: none, causal, windows that end inside or beyond a shared
/// prompt, chunks, and a bidirectional prefix.
std::vector<std::pair<std::string, PositionMask>> rules() {
  PositionMask prefix = apex::causal_mask();
  prefix.prefix = 6;
  PositionMask chunks = apex::causal_mask();
  chunks.chunk = 16;
  return {{"none", PositionMask{}},
          {"causal", apex::causal_mask()},
          {"window 7", apex::sliding_window_mask(7)},
          {"window 500", apex::sliding_window_mask(500)},
          {"chunk 16", chunks},
          {"prefix 6", prefix}};
}

/// The score terms of the tests, for H_q heads.
std::vector<std::pair<std::string, apex::SdpaParams>> score_terms(Index q_heads) {
  apex::SdpaParams sinks;
  for (Index h = 0; h < q_heads; ++h) sinks.sinks.push_back(0.25 * double(h % 5) - 0.5);
  apex::SdpaParams capped;
  capped.softcap = 2.0;
  capped.scale = 0.9;
  apex::SdpaParams alibi;
  alibi.alibi_slopes = apex::alibi_slopes(q_heads);
  return {{"plain", {}}, {"sinks", sinks}, {"softcap", capped}, {"alibi", alibi}};
}

/// The plan of a call: its views, as sdpa_cascade makes them.
apex::CascadePlan plan_of(const Shadowed& s, const Call& call, const PositionMask& rule,
                          const apex::SdpaParams& params = {}) {
  const Heads<float> q = call.queries<float>();
  Heads<float> out(1, q.heads(), q.seq(), kDim);
  const auto views = apex::detail::paged_sequence_views<float>(
      q.view(), call.cu, s.cache, call.ids, {rule}, params, out.view(), apex::HeadsView<float>{},
      apex::AttentionMask<float>{}, "test");
  return apex::detail::plan_cascade(apex::detail::cascade_sequences(views));
}

template <class T>
void run_random_families(double tol) {
  std::mt19937 rng(11);
  Index levels = 0;  // shared passes of the causal calls
  for (const Index group : {1, 4, 16}) {
    for (int trial = 0; trial < 3; ++trial) {
      const Index page = Index{4} << (trial % 3);
      Shadowed s(page);
      const std::vector<SequenceId> ids =
          random_family(s, std::uniform_int_distribution<Index>(2 * page, 40)(rng), 14, rng);
      const Call call(s, ids, group * kKvHeads, rng);
      const Heads<T> q = call.queries<T>();
      levels += Index(plan_of(s, call, apex::causal_mask()).shared.size());
      for (const auto& [rule_name, rule] : rules()) {
        for (const auto& [terms_name, params] : score_terms(group * kKvHeads)) {
          SCOPED_TRACE("G " + std::to_string(group) + ", page " + std::to_string(page) + ", " +
                       rule_name + ", " + terms_name);
          Heads<T> out(1, q.heads(), q.seq(), kDim), lse(1, q.heads(), q.seq(), 1);
          apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {rule}, params, out.view(),
                             lse.view());
          expect_near_reference(out, lse, reference(s, call, rule, params), tol);
        }
      }
    }
  }
  EXPECT_GE(levels, 9 * 2) << "the families share pages, at two levels or more";
}

TEST(SdpaCascade, RandomSharingEqualsThePlainLoops_Float) {
  run_random_families<float>(apex::testing::Tolerances<float>::kAttention);
}

TEST(SdpaCascade, RandomSharingEqualsThePlainLoops_Double) {
  run_random_families<double>(apex::testing::Tolerances<double>::kAttention);
}

/// A prompt of 5 pages shared by five sequences, two more pages shared by three of them, then
/// one decoded token each: two passes, the second nested in the first, and every page of the
/// cache read exactly once (against 5·5 + 3·2 + 5 page reads one sequence at a time).
TEST(SdpaCascade, PlanReadsEverySharedPageOnce) {
  std::mt19937 rng(3);
  const Index page = 4;
  Shadowed s(page);
  const SequenceId root = s.add();
  s.append(root, 5 * page, rng);
  const SequenceId a = s.fork(root), b = s.fork(root);
  s.append(a, 2 * page, rng);
  const SequenceId a1 = s.fork(a), a2 = s.fork(a);
  const std::vector<SequenceId> ids{root, a, b, a1, a2};
  for (const SequenceId id : ids) s.append(id, 1, rng);
  const Call call(s, ids, 4 * kKvHeads, rng, 1);
  const apex::CascadePlan plan = plan_of(s, call, apex::causal_mask());
  ASSERT_EQ(plan.shared.size(), 2U);
  EXPECT_EQ(plan.shared[0].first_key, 0);
  EXPECT_EQ(plan.shared[0].keys, 5 * page);
  EXPECT_EQ(plan.shared[0].members, (std::vector<Index>{0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.shared[1].first_key, 5 * page);
  EXPECT_EQ(plan.shared[1].keys, 2 * page);
  EXPECT_EQ(plan.shared[1].members, (std::vector<Index>{1, 3, 4}));
  EXPECT_EQ(plan.own_first_key, (std::vector<Index>{20, 28, 20, 28, 28}));
  std::multiset<Index> read;
  for (const apex::SharedPass& pass : plan.shared) {
    const auto table = s.cache.block_table(ids[std::size_t(pass.members.front())]);
    for (Index p = pass.first_key / page; p < (pass.first_key + pass.keys) / page; ++p) {
      read.insert(table[std::size_t(p)]);
    }
  }
  Index one_by_one = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto table = s.cache.block_table(ids[i]);
    one_by_one += Index(table.size());
    for (auto p = std::size_t(plan.own_first_key[i] / page); p < table.size(); ++p) {
      read.insert(table[p]);
    }
  }
  EXPECT_EQ(Index(read.size()), s.cache.pages_in_use());
  EXPECT_EQ(Index(std::set<Index>(read.begin(), read.end()).size()), s.cache.pages_in_use())
      << "no page read twice";
  EXPECT_EQ(one_by_one, 5 * 5 + 3 * 2 + 5);
  // A window that ends inside the prompt shares nothing.
  EXPECT_TRUE(plan_of(s, call, apex::sliding_window_mask(8)).shared.empty());
}

/// Where no pages are shared (separate sequences), sdpa_cascade is sdpa_paged, bit for bit.
TEST(SdpaCascade, NothingSharedIsSdpaPagedBitForBit) {
  std::mt19937 rng(5);
  Shadowed s(8);
  std::vector<SequenceId> ids;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(s.add());
    s.append(ids.back(), 10 + 9 * i, rng);
  }
  const Call call(s, ids, 4 * kKvHeads, rng);
  const Heads<float> q = call.queries<float>();
  for (const auto& [terms_name, params] : score_terms(q.heads())) {
    SCOPED_TRACE(terms_name);
    Heads<float> a(1, q.heads(), q.seq(), kDim), b(1, q.heads(), q.seq(), kDim);
    Heads<float> la(1, q.heads(), q.seq(), 1), lb(1, q.heads(), q.seq(), 1);
    apex::sdpa_cascade(q.view(), call.cu, s.cache, ids, {apex::causal_mask()}, params, a.view(),
                       la.view());
    apex::sdpa_paged(q.view(), call.cu, s.cache, ids, {apex::causal_mask()}, params, b.view(),
                     lb.view());
    for (std::size_t e = 0; e < a.size(); ++e) ASSERT_EQ(a.at(e), b.at(e)) << "element " << e;
    for (std::size_t e = 0; e < la.size(); ++e) ASSERT_EQ(la.at(e), lb.at(e)) << "lse " << e;
  }
}

#ifdef _OPENMP
/// One thread and two give the same bits.
TEST(SdpaCascade, BitIdenticalForAnyNumberOfThreads) {
  std::mt19937 rng(9);
  Shadowed s(4);
  const std::vector<SequenceId> ids = random_family(s, 24, 16, rng);
  const Call call(s, ids, 4 * kKvHeads, rng);
  const Heads<float> q = call.queries<float>();
  const auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Heads<float> out(1, q.heads(), q.seq(), kDim);
    apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {apex::causal_mask()},
                       score_terms(q.heads())[1].second, out.view());
    omp_set_num_threads(saved);
    return out;
  };
  const Heads<float> one = run(1), two = run(2);
  ASSERT_FALSE(plan_of(s, call, apex::causal_mask()).shared.empty());
  for (std::size_t e = 0; e < one.size(); ++e) ASSERT_EQ(one.at(e), two.at(e)) << "element " << e;
}
#endif

/// Bad input: the errors of sdpa_paged, named sdpa_cascade, and the output untouched.
TEST(SdpaCascade, RejectsBadInputAndChangesNothing) {
  std::mt19937 rng(2);
  Shadowed s(4);
  const SequenceId a = s.add();
  s.append(a, 12, rng);
  const SequenceId b = s.fork(a);
  s.append(b, 2, rng);
  const Call call(s, {a, b}, 2 * kKvHeads, rng);
  const Heads<float> q = call.queries<float>();
  Heads<float> out(1, q.heads(), q.seq(), kDim);
  out.fill(7.0F);
  const auto expect_rejected = [&](const auto& run, const std::string& words) {
    try {
      run();
      ADD_FAILURE() << "no error; expected one naming " << words;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("sdpa_cascade"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.all_equal(7.0F));
  };
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), {0, 1, 99}, s.cache, call.ids, {apex::causal_mask()}, {},
                           out.view());
      },
      "cu_seqlens_q");
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), call.cu, s.cache, {a, SequenceId{42}}, {apex::causal_mask()},
                           {}, out.view());
      },
      "ids[1]");
  PositionMask offset = apex::causal_mask();
  offset.key_offset = 3;
  expect_rejected(
      [&] { apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {offset}, {}, out.view()); },
      "key_offset");
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {apex::causal_mask()}, {},
                           out.view().middle_rows(0, 1));
      },
      "out");
}

}  // namespace
