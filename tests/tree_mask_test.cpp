// SPDX-License-Identifier: MIT
// Tests of include/apex/tree_mask.hpp: draft trees (ancestors, depths, bad parents), the exact
// block classifier of TreeMasks (checked against every pair of random rectangles), and tree
// attention on every path that takes rules (sdpa's GEMM, streaming and split-key paths,
// sdpa_varlen, sdpa_paged, sdpa_block_tables) against the plain loops of reference/attention.hpp
// with the mask written out from the parents alone (walking each token's chain of parents).
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>
#include <apex/tree_mask.hpp>
#include <apex/varlen.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "block_pool.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace tree_mask_test {
namespace {

using apex::BlockCoverage;
using apex::DraftTree;
using apex::Index;
using apex::TreeMasks;
using apex::testing::Heads;
using Parents = std::vector<Index>;

/// Whether draft token u is t or an ancestor of t, walking t's parents (not DraftTree's masks).
bool descends(const Parents& parents, Index t, Index u) {
  for (Index a = t; a >= 0; a = parents[std::size_t(a)]) {
    if (a == u) return true;
  }
  return false;
}

/// The parents of n draft tokens of a kind: a chain, a star (every token a child of token 0),
/// bushy (each parent uniform among the earlier tokens and the prefix) or deep (each parent one
/// of the two tokens before it).
Parents random_parents(const std::string& kind, Index n, std::mt19937& rng) {
  Parents parents;
  for (Index t = 0; t < n; ++t) {
    if (kind == "chain") {
      parents.push_back(t - 1);
    } else if (kind == "star") {
      parents.push_back(t == 0 ? -1 : 0);
    } else if (kind == "bushy") {
      parents.push_back(std::uniform_int_distribution<Index>(-1, t - 1)(rng));
    } else {
      parents.push_back(
          std::uniform_int_distribution<Index>(std::max<Index>(-1, t - 2), t - 1)(rng));
    }
  }
  return parents;
}

/// Whether position q may attend to position k for a tree of `parents` from position f, with
/// the causal rule: the rule of tree_mask.hpp spelled out from the parents.
bool tree_allows(const Parents& parents, Index f, Index q, Index k) {
  const auto n = Index(parents.size());
  if (k > q) return false;
  if (k < f) return true;
  return q < f + n && k < f + n && descends(parents, q - f, k - f);
}

// Tokens 0 and 4 continue the prefix; 1 and 2 continue 0; 3 continues 1; 5 continues 4.
TEST(DraftTree, AncestorsAndDepthsOfAWorkedTree) {
  const DraftTree tree({-1, 0, 0, 1, -1, 4});
  ASSERT_EQ(tree.size(), 6);
  const std::uint64_t ancestors[] = {0b1, 0b11, 0b101, 0b1011, 0b10000, 0b110000};
  const Index depths[] = {0, 1, 1, 2, 0, 1};
  for (Index t = 0; t < 6; ++t) {
    EXPECT_EQ(tree.ancestors(t), ancestors[t]) << "token " << t;
    EXPECT_EQ(tree.depth(t), depths[t]) << "token " << t;
  }
  EXPECT_EQ(tree.parent(3), 1);
  EXPECT_TRUE(tree.sees(3, 0));
  EXPECT_FALSE(tree.sees(3, 2));  // a sibling branch
  EXPECT_FALSE(tree.sees(0, 1));  // a descendant
  EXPECT_EQ(DraftTree().size(), 0);
}

// A chain of 64 tokens, the most a tree holds: the last token sees all of them.
TEST(DraftTree, SixtyFourTokensInAChain) {
  std::mt19937 rng(1);
  const DraftTree tree(random_parents("chain", DraftTree::kMaxTokens, rng));
  EXPECT_EQ(tree.ancestors(63), ~std::uint64_t{0});
  EXPECT_EQ(tree.depth(63), 63);
  EXPECT_EQ(tree.ancestors(0), 1U);
}

TEST(DraftTree, RejectsParentsThatDoNotComeFirstAndTreesOver64Tokens) {
  apex::testing::expect_invalid(
      [] {
        DraftTree({-1, 1});
      },
      "[draft_tree] parents[1] (1) must lie in [-1, 1)");
  apex::testing::expect_invalid(
      [] {
        DraftTree({-1, 0, 3, 1});
      },
      "[draft_tree] parents[2] (3) must lie in [-1, 2)");
  apex::testing::expect_invalid([] { DraftTree({-2}); },
                                "[draft_tree] parents[0] (-2) must lie in [-1, 0)");
  apex::testing::expect_invalid([] { DraftTree(Parents(65, -1)); },
                                "[draft_tree] parents (65 tokens) must hold at most 64");
}

TEST(TreeMasks, RejectsFirstPositionsThatDoNotFit) {
  apex::testing::expect_invalid(
      [] {
        TreeMasks({DraftTree({-1})}, {3, 4});
      },
      "[tree_masks] first (2 positions) must have one entry per tree (1)");
  apex::testing::expect_invalid(
      [] {
        TreeMasks({DraftTree({-1}), DraftTree()}, {0, -1});
      },
      "[tree_masks] first[1] (-1) must be >= 0");
}

// Default-constructed and moved-from objects are valid: no draft token, no tree (every batch
// unrestricted).
TEST(TreeMasks, DefaultAndMovedFromRestrictNothing) {
  TreeMasks moved({DraftTree({-1, 0})}, {4});
  const TreeMasks taken = std::move(moved);
  EXPECT_FALSE(taken.allows(0, 4, 5));
  const TreeMasks fresh;
  for (const TreeMasks* m : std::vector<const TreeMasks*>{&moved, &fresh}) {
    EXPECT_EQ(m->size(), 0);
    EXPECT_TRUE(m->allows(0, 4, 5));
    EXPECT_EQ(m->classify(0, {4, 6}, {0, 6}), BlockCoverage::kAll);
  }
  DraftTree tree({-1});
  const DraftTree other = std::move(tree);
  EXPECT_EQ(other.size(), 1);
  EXPECT_EQ(tree.size(), 0);  // NOLINT(bugprone-use-after-move): a moved-from tree is valid
}

/// What allows() says of every pair of the rectangle q × k, counted pair by pair.
BlockCoverage coverage_of_pairs(const TreeMasks& masks, Index b, apex::PositionRange q,
                                apex::PositionRange k) {
  bool any = false, every = true;
  for (Index i = q.begin; i < q.end; ++i) {
    for (Index j = k.begin; j < k.end; ++j) {
      const bool allowed = masks.allows(b, i, j);
      any = any || allowed;
      every = every && allowed;
    }
  }
  return every ? BlockCoverage::kAll : any ? BlockCoverage::kPartial : BlockCoverage::kNone;
}

// The classifier gives exactly what the pairs give (not only a safe answer), for every rectangle
// of positions in [0, f + n + 3) on trees of every kind and size, and allows() is the rule of the
// parents; a batch without a tree is not restricted.
TEST(TreeMasks, ClassifierIsExactOnEveryRectangle) {
  std::mt19937 rng(2);
  const Index f = 5;
  for (const Index n : {0, 1, 6, 13, 64}) {
    for (const std::string kind : {"chain", "star", "bushy", "deep"}) {
      const Parents parents = random_parents(kind, n, rng);
      const TreeMasks masks({DraftTree(parents)}, {f});
      const Index end = f + n + 3;
      for (Index i = 0; i < end; ++i) {
        for (Index j = 0; j < end; ++j) {
          const bool expected =
              j < f || (i >= f && i < f + n && j < f + n && descends(parents, i - f, j - f));
          ASSERT_EQ(masks.allows(0, i, j), expected)
              << kind << " n " << n << " (" << i << ", " << j << ")";
        }
      }
      const Index step = n > 16 ? 5 : 1;  // every rectangle of the small trees, a grid of 64's
      for (Index q0 = 0; q0 < end; q0 += step) {
        for (Index q1 = q0 + 1; q1 <= end; q1 += step) {
          for (Index k0 = 0; k0 < end; k0 += step) {
            for (Index k1 = k0 + 1; k1 <= end; k1 += step) {
              ASSERT_EQ(masks.classify(0, {q0, q1}, {k0, k1}),
                        coverage_of_pairs(masks, 0, {q0, q1}, {k0, k1}))
                  << kind << " n " << n << " q [" << q0 << ", " << q1 << ") k [" << k0 << ", " << k1
                  << ")";
            }
          }
        }
      }
    }
  }
  const TreeMasks one({DraftTree({-1})}, {2});
  EXPECT_TRUE(one.allows(1, 0, 5));
  EXPECT_EQ(one.classify(1, {0, 3}, {3, 9}), BlockCoverage::kAll);
}

/// The depth of draft token t, walking its parents.
Index depth_of(const Parents& parents, Index t) {
  Index d = 0;
  for (Index a = parents[std::size_t(t)]; a >= 0; a = parents[std::size_t(a)]) ++d;
  return d;
}

// With a window W along the text: allows() is the tree's rule and "the text positions (a draft
// token's: f + its depth) lie less than W apart", and the classifier never says kAll or kNone of
// a rectangle where some pair says otherwise; where every pair agrees it says so in the cases the
// window decides alone (a rectangle of committed keys wholly inside or wholly outside every
// query's window).
TEST(TreeMasks, WindowAlongTheText) {
  std::mt19937 rng(6);
  const Index f = 9;
  for (const Index w : {1, 3, 7, 40}) {
    for (const std::string kind : {"chain", "star", "bushy", "deep"}) {
      const Parents parents = random_parents(kind, 12, rng);
      const TreeMasks masks({DraftTree(parents)}, {f}, w);
      const auto text = [&](Index x) {
        return x >= f && x < f + 12 ? f + depth_of(parents, x - f) : x;
      };
      const Index end = f + 12 + 2;
      for (Index i = 0; i < end; ++i) {
        for (Index j = 0; j < end; ++j) {
          const bool tree =
              j < f || (i >= f && i < f + 12 && j < f + 12 && descends(parents, i - f, j - f));
          ASSERT_EQ(masks.allows(0, i, j), tree && text(i) - text(j) < w)
              << kind << " W " << w << " (" << i << ", " << j << ")";
        }
      }
      for (Index q0 = 0; q0 < end; ++q0) {
        for (Index q1 = q0 + 1; q1 <= end; ++q1) {
          for (Index k0 = 0; k0 < end; k0 += 2) {
            for (Index k1 = k0 + 1; k1 <= end; k1 += 3) {
              const BlockCoverage said = masks.classify(0, {q0, q1}, {k0, k1});
              const BlockCoverage pairs = coverage_of_pairs(masks, 0, {q0, q1}, {k0, k1});
              ASSERT_TRUE(said == BlockCoverage::kPartial || said == pairs)
                  << kind << " W " << w << " q [" << q0 << ", " << q1 << ") k [" << k0 << ", " << k1
                  << ")";
            }
          }
        }
      }
    }
  }
  const TreeMasks chain({DraftTree({-1, 0, 1})}, {10}, 4);  // draft at text positions 10, 11, 12
  EXPECT_EQ(chain.classify(0, {10, 13}, {0, 7}), BlockCoverage::kNone);
  EXPECT_EQ(chain.classify(0, {10, 11}, {7, 10}), BlockCoverage::kAll);
  EXPECT_EQ(chain.classify(0, {12, 13}, {9, 10}), BlockCoverage::kAll);
  EXPECT_EQ(chain.classify(0, {12, 13}, {8, 9}), BlockCoverage::kNone);
  const TreeMasks star({DraftTree({-1, -1, -1})}, {10}, 2);  // every draft token at 10
  EXPECT_EQ(star.classify(0, {12, 13}, {9, 10}), BlockCoverage::kAll)
      << "its text position, not its slot 12, decides";
  EXPECT_THROW(TreeMasks({DraftTree({-1})}, {0}, -1), std::invalid_argument);
}

/// Expects out and lse of every head of batch b (rows [r0, r0 + n) of the outputs) to be the
/// loops' attention of the draft queries q [n rows] to the keys k, v [f + n rows] of the tree.
void expect_tree_attention(const Heads<float>& q, const Heads<float>& k, const Heads<float>& v,
                           const Heads<float>& out, const Heads<float>& lse, Index b,
                           const Parents& parents, Index f, Index r0, Index k0,
                           const std::string& what) {
  const auto n = Index(parents.size());
  const Index hq = q.heads(), hkv = k.heads();
  const double scale = 1.0 / std::sqrt(double(q.dim()));
  double worst = 0.0, largest = 0.0, worst_lse = 0.0, largest_lse = 1.0;
  for (Index h = 0; h < hq; ++h) {
    const Index g = apex_test::kv_head_of(h, hq, hkv);
    const apex_test::AttentionResult expected = apex_test::attention(
        q.head(b, h).middleRows(r0, n), k.head(b, g).middleRows(k0, f + n),
        v.head(b, g).middleRows(k0, f + n),
        [&](Index i, Index j) { return tree_allows(parents, f, f + i, j); }, nullptr, scale, 0.0);
    const apex_test::MatrixD got = out.head(b, h).middleRows(r0, n);
    worst = std::max(worst, (got - expected.out).cwiseAbs().maxCoeff());
    largest = std::max(largest, expected.out.cwiseAbs().maxCoeff());
    for (Index i = 0; i < n; ++i) {
      worst_lse = std::max(worst_lse, std::abs(lse.head(b, h)(r0 + i, 0) - expected.lse(i)));
      largest_lse = std::max(largest_lse, std::abs(expected.lse(i)));
    }
  }
  EXPECT_LE(worst, apex::testing::Tolerances<float>::kAttention * largest) << what;
  EXPECT_LE(worst_lse, apex::testing::Tolerances<float>::kAttention * largest_lse) << what;
}

// sdpa with tree_rules and the causal rule equals the loops on the tree's mask: two batches with
// trees of their own, the draft tokens the last n positions after f committed ones, G query heads
// per key/value head. The shapes take the streaming path (G·n <= 8), the GEMM path, and split
// keys (a few draft tokens after 700 committed ones).
TEST(TreeAttention, SdpaEqualsTheLoopsOnEveryPath) {
  std::mt19937 rng(3);
  const std::string kinds[] = {"chain", "star", "bushy", "deep"};
  const Index hkv = 2, d = 32;
  int kind = 0;
  for (const Index g : {1, 4, 16}) {
    for (const Index n : {1, 3, 16, 64}) {
      for (const Index f : {0, 45, 700}) {
        const Index hq = g * hkv;
        Heads<float> q(2, hq, n, d), k(2, hkv, f + n, d), v(2, hkv, f + n, d);
        Heads<float> out(2, hq, n, d), lse(2, hq, n, 1);
        q.randomize(rng, apex::testing::Values::kNormal);
        k.randomize(rng, apex::testing::Values::kNormal);
        v.randomize(rng);
        const Parents parents[2] = {random_parents(kinds[kind % 4], n, rng),
                                    random_parents(kinds[(kind + 1) % 4], n, rng)};
        ++kind;
        const TreeMasks masks({DraftTree(parents[0]), DraftTree(parents[1])}, {f, f});
        apex::sdpa(q.view(), k.view(), v.view(),
                   apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
                   apex::tree_rules(masks), out.view(), lse.view());
        for (Index b = 0; b < 2; ++b) {
          expect_tree_attention(q, k, v, out, lse, b, parents[b], f, 0, 0,
                                "G " + std::to_string(g) + ", n " + std::to_string(n) + ", f " +
                                    std::to_string(f) + ", batch " + std::to_string(b));
        }
      }
    }
  }
}

// Three sequences, each its own tree after its own committed tokens, in one call of sdpa_varlen,
// of sdpa_paged (a paged cache of 8-token pages) and of sdpa_block_tables (a pool of the test's,
// pages taken from its end): each sequence's rows equal the loops on its tree's mask.
TEST(TreeAttention, VarlenPagedAndBlockTablesEqualTheLoops) {
  std::mt19937 rng(4);
  const std::vector<Index> first{20, 0, 150};
  const std::vector<Parents> parents{random_parents("bushy", 5, rng),
                                     random_parents("star", 16, rng), Parents{-1}};
  const Index hq = 8, hkv = 2, d = 16, page = 8;
  std::vector<Index> q_len, k_len;
  std::vector<DraftTree> trees;
  for (std::size_t i = 0; i < first.size(); ++i) {
    q_len.push_back(Index(parents[i].size()));
    k_len.push_back(first[i] + q_len.back());
    trees.emplace_back(parents[i]);
  }
  const TreeMasks masks(trees, first);
  const auto layout = apex::RaggedBatch::from_lengths(q_len, k_len);
  const Index total_q = layout.cu_seqlens_q.back(), total_k = layout.cu_seqlens_k.back();
  Heads<float> q(1, hq, total_q, d), k(1, hkv, total_k, d), v(1, hkv, total_k, d);
  Heads<float> out(1, hq, total_q, d), lse(1, hq, total_q, 1);
  q.randomize(rng, apex::testing::Values::kNormal);
  k.randomize(rng, apex::testing::Values::kNormal);
  v.randomize(rng);
  const std::vector<apex::PositionMask> causal{apex::causal_mask()};
  const auto expect_each = [&](const std::string& what) {
    for (std::size_t i = 0; i < first.size(); ++i) {
      expect_tree_attention(q, k, v, out, lse, 0, parents[i], first[i], layout.cu_seqlens_q[i],
                            layout.cu_seqlens_k[i], what + ", sequence " + std::to_string(i));
    }
  };
  apex::sdpa_varlen(q.view(), k.view(), v.view(), layout, causal, apex::AttentionMask<float>{},
                    apex::SdpaParams{}, apex::tree_rules(masks), out.view(), lse.view());
  expect_each("sdpa_varlen");

  apex::PagedKvCache<float> cache({hkv, d, page, 64});
  std::vector<apex::SequenceId> ids;
  for (std::size_t i = 0; i < first.size(); ++i) {
    ids.push_back(cache.add());
    const Index k0 = layout.cu_seqlens_k[i];
    cache.append(ids.back(), k.view().middle_rows(k0, k_len[i]),
                 v.view().middle_rows(k0, k_len[i]));
  }
  out.fill(std::numeric_limits<float>::quiet_NaN());
  apex::sdpa_paged(q.view(), layout.cu_seqlens_q, cache, ids, causal, apex::AttentionMask<float>{},
                   apex::SdpaParams{}, apex::tree_rules(masks), out.view(), lse.view());
  expect_each("sdpa_paged");

  Heads<float> k_pool(40, hkv, page, d), v_pool(40, hkv, page, d);
  const auto tables = apex::testing::fill_block_tables(
      k_pool, v_pool, k_len,
      [&](std::size_t i, Index h, Index t) {
        return k.view().head(0, h).row(layout.cu_seqlens_k[i] + t);
      },
      [&](std::size_t i, Index h, Index t) {
        return v.view().head(0, h).row(layout.cu_seqlens_k[i] + t);
      });
  out.fill(std::numeric_limits<float>::quiet_NaN());
  apex::sdpa_block_tables(q.view(), layout.cu_seqlens_q, tables, causal,
                          apex::AttentionMask<float>{}, apex::SdpaParams{}, apex::tree_rules(masks),
                          out.view(), lse.view());
  expect_each("sdpa_block_tables");
}

}  // namespace
}  // namespace tree_mask_test
