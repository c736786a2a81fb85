// SPDX-License-Identifier: MIT
// Tests of include/apex/block_sparse.hpp: block-sparse masks as rules of apex::sdpa and of the
// ragged and paged entry points. The oracle of every map is its equivalent boolean mask, built
// here from the dense array of block states and the partial rule pair by pair (never from the
// map's own lookups). Checked:
//   - random maps (absent, kAll and kPartial blocks) equal the dense mask: against the plain
//     loops, apex::reference::sdpa in double and apex::sdpa with the same rule written as a plain
//     mask rule, for block sizes that do not divide S, S_q < S_k, S_q = 1, several heads and
//     batches, maps shared over the batch and/or the heads, on every path of the tiled kernel;
//   - the named patterns (sliding window with global tokens, strided) against their per-pair
//     definitions written out here, and their maps block by block;
//   - the classifier is exact: equal to the answer computed from the dense states for random
//     rectangles, and verify_classifier finds no false answer on any path;
//   - blocks marked absent are never read (their keys and values in PROT_NONE memory);
//   - sdpa_varlen and sdpa_block_tables with a map equal each sequence's reference;
//   - the result does not depend on the number of threads;
//   - bad maps and maps that do not fit the call are rejected before anything is written.
#include <apex/block_sparse.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/mask.hpp>
#include <apex/paged_attention.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_case.hpp"
#include "guarded_buffer.hpp"
#include "kernel_paths.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace block_sparse_test {
namespace {

using apex::BlockCoverage;
using apex::BlockSparseMask;
using apex::BlockSparseShape;
using apex::Index;
using apex::PositionRange;
using apex::detail::FlashBlocking;
using apex::testing::expect_invalid;
using apex::testing::expect_matches_loops;
using apex::testing::expect_same_outputs;
using apex::testing::GuardedBuffer;
using apex::testing::Heads;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Values;

/// A per-pair rule: one type for every plain rule of these tests (one kernel instantiation).
using PairRule = std::function<bool(Index, Index, Index, Index)>;

template <class Scalar>
class BlockSparse : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(BlockSparse, Scalars, apex::testing::ScalarName);

/// The paths of the tiled kernel, each named.
std::vector<std::pair<const char*, FlashBlocking>> paths() { return apex::testing::kernel_paths(); }

/// The partial rule of the random maps: a fixed pseudo-random pattern of pairs.
bool scattered_pairs(Index b, Index h, Index q, Index k) {
  const auto x = static_cast<std::uint64_t>(q * 1000003 + k * 7919 + b * 104729 + h * 1299709);
  return (x * 0x9E3779B97F4A7C15ULL) >> 62 != 0;  // about 3 pairs in 4
}

/// A random map as a dense array of block states, and its equivalent boolean mask.
struct DenseMap {
  BlockSparseShape shape;
  std::vector<BlockCoverage> states;  ///< [batch, heads, query_blocks, key_blocks]

  /// Random states: absent, kAll and kPartial with the given probabilities (the rest kPartial).
  DenseMap(const BlockSparseShape& s, double p_absent, double p_all, std::uint32_t seed)
      : shape(s), states(static_cast<std::size_t>(s.rows() * s.key_blocks)) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (BlockCoverage& state : states) {
      const double x = u(rng);
      state = x < p_absent           ? BlockCoverage::kNone
              : x < p_absent + p_all ? BlockCoverage::kAll
                                     : BlockCoverage::kPartial;
    }
  }

  /// The state of block (I, J) of (b, h); kNone outside the map.
  BlockCoverage block(Index b, Index h, Index qb, Index kb) const {
    if (qb < 0 || kb < 0 || qb >= shape.query_blocks || kb >= shape.key_blocks) {
      return BlockCoverage::kNone;
    }
    const Index bb = shape.batch == 1 ? 0 : b, hh = shape.heads == 1 ? 0 : h;
    return states[std::size_t(
        ((bb * shape.heads + hh) * shape.query_blocks + qb) * shape.key_blocks + kb)];
  }

  /// The equivalent boolean mask, pair by pair.
  bool allows(Index b, Index h, Index q, Index k) const {
    if (q < 0 || k < 0) return false;
    switch (block(b, h, q / shape.query_block, k / shape.key_block)) {
      case BlockCoverage::kAll:
        return true;
      case BlockCoverage::kPartial:
        return scattered_pairs(b, h, q, k);
      default:
        return false;
    }
  }

  /// A map of the given shape whose every block is kPartial.
  static BlockSparseMask every_block_partial(const BlockSparseShape& s) {
    return BlockSparseMask::from_classifier(
        s, [](Index, Index, Index, Index) { return BlockCoverage::kPartial; });
  }

  /// The answer an exact classifier gives for q × k, from the dense states.
  BlockCoverage classify(Index b, Index h, const PositionRange& q, const PositionRange& k) const {
    bool all = true, none = true;
    for (Index qb = q.begin / shape.query_block; qb <= (q.end - 1) / shape.query_block; ++qb) {
      for (Index kb = k.begin / shape.key_block; kb <= (k.end - 1) / shape.key_block; ++kb) {
        const BlockCoverage s = block(b, h, qb, kb);
        all = all && s == BlockCoverage::kAll;
        none = none && s == BlockCoverage::kNone;
      }
    }
    const bool inside = q.end <= shape.query_blocks * shape.query_block &&
                        k.end <= shape.key_blocks * shape.key_block;
    all = all && inside;
    return none ? BlockCoverage::kNone : all ? BlockCoverage::kAll : BlockCoverage::kPartial;
  }
};

/// Sets p's dense mask to the pairs `allows(b, h, qp, kp)` accepts (absolute positions).
template <class Scalar>
void set_dense_mask(Problem<Scalar>& p, const PairRule& allows) {
  p.add_dense_mask(p.shape.batch, p.shape.q_heads, 1.0);
  for (Index b = 0; b < p.shape.batch; ++b) {
    for (Index h = 0; h < p.shape.q_heads; ++h) {
      auto rows = p.allowed_rows(b, h);
      for (Index i = 0; i < p.shape.s_q; ++i) {
        for (Index j = 0; j < p.shape.s_k; ++j) {
          rows(i, j) = allows(b, h, p.first_query() + i, p.key_offset + j);
        }
      }
    }
  }
}

/// A copy of a tensor in double (same layout and shape).
template <class Scalar>
Heads<double> in_double(const Heads<Scalar>& t) {
  const apex::HeadsShape s = t.view().shape();
  Heads<double> d(s.batch, s.heads, s.seq, s.dim);
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) d.head_map(b, h) = t.head(b, h);
  }
  return d;
}

/// Runs `rules` on p: apex::sdpa itself when blocking is unset, else the tiled kernel with it.
template <class Scalar, class Rules>
void run(const Problem<Scalar>& p, const Rules& rules, Outputs<Scalar>& o,
         const FlashBlocking* blocking) {
  if (blocking == nullptr) {
    apex::sdpa(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, rules,
               o.out.view(), o.lse.view());
  } else {
    apex::detail::flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(
        p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, o.out.view(),
        o.lse.view(), {}, *blocking, rules);
  }
}

/// Where the problems of a test sit: the shape, the seed of Q, K, V, the position rule and the
/// alignment.
struct Case {
  Shape shape;
  std::uint32_t seed = 1;
  apex_test::MaskRule rule;           ///< the PositionMask on top of the map (default: none)
  std::optional<Index> query_offset;  ///< unset: bottom-right
};

template <class Scalar>
Problem<Scalar> make_problem(const Case& c) {
  Problem<Scalar> p(c.shape, Layout::kTokenMajor, c.seed, Values::kNormal);
  p.rule = c.rule;
  p.query_offset = c.query_offset;
  return p;
}

/// The outputs of apex::reference::sdpa in double on p's values with p's dense mask, rounded to
/// Scalar.
template <class Scalar>
Outputs<Scalar> reference_in_double(const Problem<Scalar>& p) {
  Outputs<double> ref(p.shape);
  const Heads<double> qd = in_double(p.q), kd = in_double(p.k), vd = in_double(p.v);
  apex::AttentionMask<double> mask;
  mask.positions = p.attention_mask().positions;
  mask.allowed = p.attention_mask().allowed;
  apex::reference::sdpa<double>(qd.view(), kd.view(), vd.view(), mask, p.params, ref.out.view(),
                                ref.lse.view());
  Outputs<Scalar> rounded(p.shape);
  for (Index b = 0; b < p.shape.batch; ++b) {
    for (Index h = 0; h < p.shape.q_heads; ++h) {
      rounded.out.head_map(b, h) = ref.out.head(b, h).template cast<Scalar>();
      rounded.lse.head_map(b, h) = ref.lse.head(b, h).template cast<Scalar>();
    }
  }
  return rounded;
}

/// The case run with block-sparse `rules` equals: the plain loops with `allows` as a dense mask,
/// apex::reference::sdpa in double with that dense mask, and apex::sdpa with `allows` as a plain
/// mask rule; on apex::sdpa's own entry point and on every path.
template <class Scalar, class Rules>
void expect_equals_dense(const Case& c, const Rules& rules, const PairRule& allows,
                         const std::string& what) {
  const Problem<Scalar> p = make_problem<Scalar>(c);
  Problem<Scalar> dense = make_problem<Scalar>(c);  // the same values, with the dense mask
  set_dense_mask(dense, allows);
  const Outputs<Scalar> ref = reference_in_double(dense);
  Outputs<Scalar> plain(c.shape);
  run(p, apex::mask_rule(allows), plain, nullptr);
  const std::vector<std::pair<const char*, FlashBlocking>> all = paths();
  for (std::size_t i = 0; i <= all.size(); ++i) {
    const FlashBlocking* blocking = i == 0 ? nullptr : &all[i - 1].second;
    SCOPED_TRACE(what + ", " + apex::testing::describe(c.shape) + ", " +
                 (i == 0 ? "apex::sdpa" : all[i - 1].first));
    Outputs<Scalar> o(c.shape);
    run(p, rules, o, blocking);
    expect_matches_loops(dense, o, /*with_lse=*/true);
    expect_same_outputs(o, ref, "against apex::reference::sdpa in double");
    expect_same_outputs(o, plain, "against apex::sdpa with a plain mask rule");
  }
}

/// The map of a DenseMap, built the three ways (dense states, a classifier, compressed rows),
/// which must agree.
BlockSparseMask map_of(const DenseMap& d) {
  const BlockSparseMask map = BlockSparseMask::from_states(d.shape, d.states);
  const BlockSparseMask again = BlockSparseMask::from_classifier(
      d.shape, [&d](Index b, Index h, Index qb, Index kb) { return d.block(b, h, qb, kb); });
  const BlockSparseMask rows(d.shape, map.rows());
  EXPECT_EQ(again.rows().offsets, map.rows().offsets);
  EXPECT_EQ(again.rows().key_blocks, map.rows().key_blocks);
  EXPECT_EQ(rows.listed_blocks(), map.listed_blocks());
  EXPECT_EQ(rows.partial_blocks(), map.partial_blocks());
  return map;
}

/// The block-sparse rules of a map with the scattered partial rule, held as a PairRule.
apex::BlockSparseRules<PairRule> scattered_rules(const BlockSparseMask& map) {
  return apex::block_sparse_rules(map, PairRule(scattered_pairs));
}

// Random maps (40 % absent, 30 % kAll, 30 % kPartial) equal their dense mask: blocks that do not
// divide S, S_q < S_k (bottom-right and top-left), S_q = 1, a causal PositionMask on top, GQA,
// B = 2, and maps shared over the batch, the heads, both or neither.
TYPED_TEST(BlockSparse, RandomMapsEqualTheDenseMask) {
  using Scalar = TypeParam;
  struct Setting {
    Case c;
    Index query_block, key_block;
    bool per_batch, per_head;
  };
  const std::vector<Setting> settings = {
      {{{2, 4, 2, 70, 100, 16, 8}, 11, {}, std::nullopt}, 16, 16, true, true},
      {{{2, 4, 2, 70, 100, 16, 8}, 12, {}, Index{0}}, 7, 13, false, true},
      {{{2, 4, 4, 97, 97, 16, 16}, 13, {true, 0, 0}, std::nullopt}, 24, 10, true, false},
      {{{1, 8, 2, 130, 130, 24, 16}, 14, {}, std::nullopt}, 64, 32, false, false},
      {{{2, 4, 1, 1, 300, 16, 8}, 15, {true, 0, 0}, std::nullopt}, 5, 37, true, true},
      {{{1, 2, 1, 3, 1300, 16, 8}, 16, {}, std::nullopt}, 1, 64, false, true},
  };
  for (const Setting& s : settings) {
    const Shape& shape = s.c.shape;
    const Index first_query =
        s.c.query_offset ? *s.c.query_offset : shape.s_k - shape.s_q;  // key_offset 0
    BlockSparseShape grid;
    grid.batch = s.per_batch ? shape.batch : 1;
    grid.heads = s.per_head ? shape.q_heads : 1;
    grid.query_block = s.query_block;
    grid.key_block = s.key_block;
    grid.query_blocks = BlockSparseShape::blocks_covering(first_query + shape.s_q, s.query_block);
    grid.key_blocks = BlockSparseShape::blocks_covering(shape.s_k, s.key_block);
    const DenseMap dense(grid, 0.4, 0.3, s.c.seed);
    const BlockSparseMask map = map_of(dense);
    expect_equals_dense<Scalar>(
        s.c, scattered_rules(map),
        [&dense](Index b, Index h, Index q, Index k) { return dense.allows(b, h, q, k); },
        "Bq " + std::to_string(s.query_block) + ", Bk " + std::to_string(s.key_block));
  }
}

// A map without partial blocks needs no partial rule (FlashInfer's BSR attention).
TYPED_TEST(BlockSparse, MapWithoutPartialBlocksNeedsNoRule) {
  using Scalar = TypeParam;
  const Case c{{1, 4, 2, 90, 90, 16, 8}, 21, {}, std::nullopt};
  const BlockSparseShape grid{1, 4, 6, 6, 16, 16};
  DenseMap dense(grid, 0.5, 0.5, 21);
  for (BlockCoverage& s : dense.states) {
    if (s == BlockCoverage::kPartial) s = BlockCoverage::kAll;
  }
  const BlockSparseMask map = map_of(dense);
  ASSERT_EQ(map.partial_blocks(), 0);
  expect_equals_dense<Scalar>(
      c, apex::block_sparse_rules(map),
      [&dense](Index b, Index h, Index q, Index k) { return dense.allows(b, h, q, k); },
      "no partial blocks");
}

// ---- the named patterns ---------------------------------------------------------------------

/// Longformer's pattern, written out pair by pair: window W (the query counted), global tokens.
bool longformer_allows(Index q, Index k, Index window, const std::vector<Index>& global,
                       bool causal) {
  if (causal && k > q) return false;
  const auto is_global = [&global](Index p) {
    return std::find(global.begin(), global.end(), p) != global.end();
  };
  return std::abs(q - k) < window || is_global(q) || is_global(k);
}

/// Sparse Transformer's strided pattern on blocks of `block` positions, pair by pair.
bool strided_allows(Index q, Index k, const apex::StridedPattern& s) {
  if (s.causal && k > q) return false;
  const Index d = q / s.block - k / s.block;
  return std::abs(d) < s.local || d % s.stride == 0;
}

/// Expects every block of `map` to be what `allows` says of its positions: kAll if every pair,
/// absent if none, kPartial otherwise.
void expect_exact_blocks(const BlockSparseMask& map, const PairRule& allows) {
  const BlockSparseShape& s = map.shape();
  for (Index qb = 0; qb < s.query_blocks; ++qb) {
    for (Index kb = 0; kb < s.key_blocks; ++kb) {
      bool all = true, none = true;
      for (Index q = qb * s.query_block; q < (qb + 1) * s.query_block; ++q) {
        for (Index k = kb * s.key_block; k < (kb + 1) * s.key_block; ++k) {
          const bool a = allows(0, 0, q, k);
          all = all && a;
          none = none && !a;
        }
      }
      const BlockCoverage want = none  ? BlockCoverage::kNone
                                 : all ? BlockCoverage::kAll
                                       : BlockCoverage::kPartial;
      ASSERT_EQ(map.block_state(0, 0, qb, kb), want) << "block (" << qb << ", " << kb << ")";
    }
  }
}

// The sliding window with global tokens, causal and not, against its per-pair definition: the
// map block by block, and attention with the pattern as partial rule.
TYPED_TEST(BlockSparse, SlidingWindowWithGlobalEqualsItsDefinition) {
  using Scalar = TypeParam;
  for (const bool causal : {true, false}) {
    const Case c{{1, 4, 2, 200, 200, 16, 8}, 31, {}, Index{0}};
    const apex::SlidingWindowGlobal pattern{23, {0, 1, 17, 120, 121}, causal};
    const BlockSparseShape grid{1, 1, 10, 15, 20, 14};  // 200 queries, 210 keys
    const BlockSparseMask map = apex::sliding_window_with_global(grid, pattern);
    const PairRule allows = [&pattern](Index, Index, Index q, Index k) {
      return longformer_allows(q, k, pattern.window, pattern.global, pattern.causal);
    };
    expect_exact_blocks(map, allows);
    EXPECT_LT(map.listed_blocks(), 10 * 15);
    expect_equals_dense<Scalar>(c, apex::block_sparse_rules(map, pattern), allows,
                                causal ? "causal window + global" : "window + global");
  }
}

// Sparse Transformer's strided pattern, per position (B = 1) and on blocks, causal and not.
TYPED_TEST(BlockSparse, StridedEqualsItsDefinition) {
  using Scalar = TypeParam;
  const Case c{{1, 4, 2, 150, 150, 16, 8}, 41, {}, Index{0}};
  for (const apex::StridedPattern& pattern :
       {apex::StridedPattern{1, 12, 12, true}, apex::StridedPattern{16, 2, 3, true},
        apex::StridedPattern{16, 2, 3, false}, apex::StridedPattern{10, 1, 4, true}}) {
    const BlockSparseShape grid{1, 1, 10, 10, 16, 16};  // 160 positions each way
    const BlockSparseMask map = apex::strided(grid, pattern);
    const PairRule allows = [&pattern](Index, Index, Index q, Index k) {
      return strided_allows(q, k, pattern);
    };
    expect_exact_blocks(map, allows);
    expect_equals_dense<Scalar>(c, apex::block_sparse_rules(map, pattern), allows,
                                "strided B " + std::to_string(pattern.block) + ", local " +
                                    std::to_string(pattern.local) + ", stride " +
                                    std::to_string(pattern.stride));
  }
}

// ---- the classifier ---------------------------------------------------------------------------

// For random rectangles, inside the map and reaching out of it, the map's answer is the one the
// dense states give: exact both ways (kNone and kAll whenever true, not only when safe).
TEST(BlockSparse, ClassifierIsExactForAnyRectangle) {
  std::mt19937 rng(5);
  for (const double p_absent : {0.2, 0.5, 0.9}) {
    const BlockSparseShape grid{2, 3, 9, 11, 7, 5};
    const DenseMap dense(grid, p_absent, (1.0 - p_absent) * 0.8, 7);
    const BlockSparseMask map = map_of(dense);
    std::uniform_int_distribution<Index> q_pos(0, 70), k_pos(0, 60), len(1, 30);
    for (int t = 0; t < 3000; ++t) {
      const Index qb = q_pos(rng), kb = k_pos(rng);
      const PositionRange q{qb, qb + len(rng)}, k{kb, kb + len(rng)};
      const Index b = t % 2, h = t % 3;
      ASSERT_EQ(map.classify(b, h, q, k), dense.classify(b, h, q, k))
          << "b " << b << ", h " << h << ", q [" << q.begin << ", " << q.end << "), k [" << k.begin
          << ", " << k.end << ")";
    }
  }
}

// verify_classifier finds no false answer on any path, for random maps and the patterns (whose
// own classifiers answer inside their partial blocks).
TYPED_TEST(BlockSparse, VerifyClassifierFindsNoLie) {
  using Scalar = TypeParam;
  const Case c{{2, 8, 2, 150, 150, 16, 8}, 51, {}, std::nullopt};
  const DenseMap dense({2, 8, 10, 12, 16, 13}, 0.4, 0.3, 51);
  const BlockSparseMask random_map = map_of(dense);
  const apex::SlidingWindowGlobal pattern{30, {3, 64}, true};
  const BlockSparseMask window_map =
      apex::sliding_window_with_global({1, 1, 10, 10, 16, 16}, pattern);
  const apex::StridedPattern strided{8, 2, 3, true};  // pattern blocks inside the map's
  const BlockSparseMask strided_map = apex::strided({1, 1, 10, 10, 16, 16}, strided);
  const Problem<Scalar> p = make_problem<Scalar>(c);
  for (const auto& [path, blocking] : paths()) {
    SCOPED_TRACE(path);
    apex::ClassifierReport report;
    Outputs<Scalar> o(c.shape);
    run(p, apex::verify_classifier(scattered_rules(random_map), report), o, &blocking);
    run(p, apex::verify_classifier(apex::block_sparse_rules(window_map, pattern), report), o,
        &blocking);
    run(p, apex::verify_classifier(apex::block_sparse_rules(strided_map, strided), report), o,
        &blocking);
    EXPECT_TRUE(report.ok()) << report.message();
    EXPECT_GT(report.blocks_checked(), 0);
  }
}

// ---- absent blocks are never read -----------------------------------------------------------

// K and V of one key/value head in guarded memory: the keys that only absent blocks cover are
// unreadable, and sdpa completes and equals the loops. Every query row sees key block 0 (global
// tokens, kAll) and the key blocks from 35 on (a causal band, kPartial on the diagonal); blocks
// 1 to 34 are absent. Prefill (S_q = 60) and decoding (S_q = 1, without block 0, whose tile would
// span the gap on the streaming path), default and small blocks, through apex::sdpa too.
TYPED_TEST(BlockSparse, AbsentBlocksAreNeverRead) {
  using Scalar = TypeParam;
  const Index s_k = 3000, d = 32, block = 64;
  for (const Index s_q : {Index{60}, Index{1}}) {
    SCOPED_TRACE("S_q = " + std::to_string(s_q));
    const bool global = s_q > 1;
    const BlockSparseShape grid{1, 1, 47, 47, block, block};  // 3008 positions
    const BlockSparseMask map =
        BlockSparseMask::from_classifier(grid, [global](Index, Index, Index qb, Index kb) {
          if (kb == 0) return global ? BlockCoverage::kAll : BlockCoverage::kNone;
          if (kb < 35 || kb > qb) return BlockCoverage::kNone;
          return kb == qb ? BlockCoverage::kPartial : BlockCoverage::kAll;
        });
    const auto causal = [](Index, Index, Index q, Index k) { return k <= q; };
    const auto rules = apex::block_sparse_rules(map, PairRule(causal));
    const Shape shape{1, 4, 1, s_q, s_k, d, d};
    Problem<Scalar> p(shape, Layout::kContiguous, 61, Values::kNormal);
    set_dense_mask(p, [&map](Index, Index, Index q, Index k) {
      const BlockCoverage s = map.pair_state(0, 0, q, k);
      return s == BlockCoverage::kAll || (s == BlockCoverage::kPartial && k <= q);
    });
    GuardedBuffer<Scalar> k(std::size_t(s_k * d)), v(std::size_t(s_k * d));
    std::memcpy(k.data(), p.k.data(), std::size_t(s_k * d) * sizeof(Scalar));
    std::memcpy(v.data(), p.v.data(), std::size_t(s_k * d) * sizeof(Scalar));
    const std::size_t first = global ? std::size_t(block * d) : 0;
    const std::size_t last = std::size_t((global ? 35 * block : 1536) * d);
    ASSERT_GT(k.forbid(first, last), 0U);
    ASSERT_GT(v.forbid(first, last), 0U);
    const auto k_view = apex::HeadsView<const Scalar>::contiguous(k.data(), {1, 1, s_k, d});
    const auto v_view = apex::HeadsView<const Scalar>::contiguous(v.data(), {1, 1, s_k, d});
    const apex::AttentionMask<Scalar> no_mask;
    for (const auto& [path, blocking] : {paths()[0], paths()[1]}) {
      SCOPED_TRACE(path);
      Outputs<Scalar> o(shape);
      apex::detail::flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(
          p.q.view(), k_view, v_view, no_mask, p.params, o.out.view(), o.lse.view(), {}, blocking,
          rules);
      expect_matches_loops(p, o, /*with_lse=*/true);
    }
    Outputs<Scalar> o(shape);
    apex::sdpa(p.q.view(), k_view, v_view, no_mask, p.params, rules, o.out.view(), o.lse.view());
    expect_matches_loops(p, o, /*with_lse=*/true);
  }
}

// ---- the ragged and paged entry points --------------------------------------------------------

/// Sequence i's output equals the reference in double over its own keys, causal (bottom-right),
/// with `allows` (sequence i as batch i) as the dense mask, normwise (kAttention).
/// q: [1, H_q, nq, d], k, v: [1, H_kv, nk, d] (token-major), the queries the last nq positions.
template <class Scalar>
void expect_sequence_equals_reference(const apex::HeadsView<const Scalar>& q,
                                      const apex::HeadsView<const Scalar>& k,
                                      const apex::HeadsView<const Scalar>& v,
                                      const apex::HeadsView<Scalar>& out, Index i,
                                      const PairRule& allows, const std::string& what) {
  const Index nq = q.seq(), nk = k.seq(), hq = q.heads();
  apex::BoolMatrix allowed(hq * nq, nk);
  for (Index h = 0; h < hq; ++h) {
    for (Index r = 0; r < nq; ++r) {
      for (Index j = 0; j < nk; ++j)
        allowed(h * nq + r, j) = allows(i, h, nk - nq + r, j) && j <= nk - nq + r;
    }
  }
  const auto widen = [](const apex::HeadsView<const Scalar>& t) {
    apex::HeadsTensor<double> d(t.shape());
    for (Index h = 0; h < t.heads(); ++h)
      d.view().head(0, h) = t.head(0, h).template cast<double>();
    return d;
  };
  const apex::HeadsTensor<double> qd = widen(q), kd = widen(k), vd = widen(v);
  apex::HeadsTensor<double> ref({1, hq, nq, v.dim()});
  apex::AttentionMask<double> mask;
  mask.allowed = apex::HeadsView<const bool>::contiguous(allowed.data(), {1, hq, nq, nk});
  apex::reference::sdpa<double>(qd.view(), kd.view(), vd.view(), mask, apex::SdpaParams{},
                                ref.view());
  double max_ref = 0.0, max_err = 0.0;
  for (Index h = 0; h < hq; ++h) {
    const apex_test::MatrixD o = out.head(0, h).template cast<double>();
    max_ref = std::max(max_ref, ref.view().head(0, h).cwiseAbs().maxCoeff());
    max_err = std::max(max_err, (o - ref.view().head(0, h)).cwiseAbs().maxCoeff());
  }
  EXPECT_LE(max_err, apex::testing::Tolerances<Scalar>::kAttention * max_ref) << what;
}

// sdpa_varlen with a map of one batch per sequence (and one shared by all): each sequence equals
// its reference, causal per sequence, sequences of 0 queries and of more keys than queries.
TYPED_TEST(BlockSparse, VarlenEqualsEachSequence) {
  using Scalar = TypeParam;
  const std::vector<Index> q_len{20, 0, 35, 1}, k_len{50, 10, 35, 77};
  const apex::RaggedBatch batch = apex::RaggedBatch::from_lengths(q_len, k_len);
  const Index hq = 4, hkv = 2, d = 16, total_q = batch.cu_seqlens_q.back();
  std::mt19937 rng(71);
  Heads<Scalar> q(1, hq, total_q, d, Layout::kTokenMajor),
      out(1, hq, total_q, d, Layout::kTokenMajor);
  Heads<Scalar> k(1, hkv, batch.cu_seqlens_k.back(), d, Layout::kTokenMajor);
  Heads<Scalar> v(1, hkv, batch.cu_seqlens_k.back(), d, Layout::kTokenMajor);
  for (Heads<Scalar>* t : {&q, &k, &v}) t->randomize(rng, Values::kNormal);
  for (const Index map_batch : {Index{4}, Index{1}}) {
    const DenseMap dense({map_batch, hq, 8, 8, 10, 10}, 0.3, 0.3, 72);
    const BlockSparseMask map = map_of(dense);
    const PairRule allows = [&dense](Index b, Index h, Index qp, Index kp) {
      return dense.allows(b, h, qp, kp);
    };
    out.fill(Scalar(0));
    apex::sdpa_varlen(q.view(), k.view(), v.view(), batch, {apex::causal_mask()},
                      apex::AttentionMask<Scalar>{}, apex::SdpaParams{}, scattered_rules(map),
                      out.view());
    for (std::size_t i = 0; i < q_len.size(); ++i) {
      if (q_len[i] == 0) continue;
      const Index q0 = batch.cu_seqlens_q[i], k0 = batch.cu_seqlens_k[i];
      expect_sequence_equals_reference<Scalar>(
          q.view().middle_rows(q0, q_len[i]), k.view().middle_rows(k0, k_len[i]),
          v.view().middle_rows(k0, k_len[i]), out.view().middle_rows(q0, q_len[i]), Index(i),
          allows, "map batch " + std::to_string(map_batch) + ", sequence " + std::to_string(i));
    }
  }
}

// sdpa_block_tables (paged K/V of the caller's own) with a sliding window and global tokens:
// each sequence equals its reference over its gathered tokens.
TYPED_TEST(BlockSparse, BlockTablesEqualEachSequence) {
  using Scalar = TypeParam;
  const Index page = 8, pages = 40, hq = 4, hkv = 2, d = 16;
  std::mt19937 rng(81);
  Heads<Scalar> k_pool(pages, hkv, page, d), v_pool(pages, hkv, page, d);
  k_pool.randomize(rng, Values::kNormal);
  v_pool.randomize(rng, Values::kNormal);
  std::vector<Index> order(pages);
  for (Index p = 0; p < pages; ++p) order[std::size_t(p)] = p;
  std::shuffle(order.begin(), order.end(), rng);
  apex::BlockTables<Scalar, Scalar> tables{k_pool.view(), v_pool.view(), {}, {100, 37, 5}};
  std::size_t next = 0;
  for (const Index length : tables.lengths) {
    const auto n = std::size_t((length + page - 1) / page);
    tables.block_tables.emplace_back(order.begin() + long(next), order.begin() + long(next + n));
    next += n;
  }
  const std::vector<Index> cu = {0, 30, 30, 35};  // 30, 0 and 5 queries
  Heads<Scalar> q(1, hq, 35, d, Layout::kTokenMajor), out(1, hq, 35, d, Layout::kTokenMajor);
  q.randomize(rng, Values::kNormal);
  const apex::SlidingWindowGlobal pattern{9, {0, 2, 40}, true};
  const BlockSparseMask map = apex::sliding_window_with_global({1, 1, 13, 13, 8, 8}, pattern);
  apex::sdpa_block_tables(q.view(), cu, tables, {apex::causal_mask()},
                          apex::AttentionMask<Scalar>{}, apex::SdpaParams{},
                          apex::block_sparse_rules(map, pattern), out.view());
  for (std::size_t i = 0; i < 3; ++i) {
    const Index length = tables.lengths[i], nq = cu[i + 1] - cu[i];
    if (nq == 0) continue;
    Heads<Scalar> k(1, hkv, length, d), v(1, hkv, length, d);
    for (Index t = 0; t < length; ++t) {
      const Index p = tables.block_tables[i][std::size_t(t / page)];
      for (Index h = 0; h < hkv; ++h) {
        k.head_map(0, h).row(t) = k_pool.view().head(p, h).row(t % page);
        v.head_map(0, h).row(t) = v_pool.view().head(p, h).row(t % page);
      }
    }
    expect_sequence_equals_reference<Scalar>(
        q.view().middle_rows(cu[i], nq), k.view(), v.view(), out.view().middle_rows(cu[i], nq),
        Index(i),
        [&pattern](Index, Index, Index qp, Index kp) {
          return longformer_allows(qp, kp, pattern.window, pattern.global, pattern.causal);
        },
        "sequence " + std::to_string(i));
  }
}

// ---- threads ----------------------------------------------------------------------------------

TYPED_TEST(BlockSparse, ThreadCountDoesNotChangeResults) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: apex runs on one thread";
#else
  using Scalar = TypeParam;
  const int saved = omp_get_max_threads();
  for (const Shape& shape : {Shape{1, 8, 2, 600, 600, 32, 32}, Shape{1, 8, 2, 1, 5000, 32, 32}}) {
    const DenseMap dense({1, 8, 79, 79, 64, 64}, 0.5, 0.3, 91);  // 5056 positions
    const BlockSparseMask map = map_of(dense);
    const Problem<Scalar> p = make_problem<Scalar>({shape, 92, {true, 0, 0}, std::nullopt});
    Outputs<Scalar> one(shape), two(shape);
    omp_set_num_threads(1);
    run(p, scattered_rules(map), one, nullptr);
    omp_set_num_threads(2);
    run(p, scattered_rules(map), two, nullptr);
    omp_set_num_threads(saved);
    EXPECT_EQ(std::memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(Scalar)), 0);
    EXPECT_EQ(std::memcmp(one.lse.data(), two.lse.data(), one.lse.size() * sizeof(Scalar)), 0);
  }
#endif
}

// ---- bad input --------------------------------------------------------------------------------

// Bad maps are rejected where they are built, each message naming the value and what was
// expected.
TEST(BlockSparse, RejectsBadMaps) {
  const auto build = [](const BlockSparseShape& shape, apex::BlockSparseRows rows) {
    return [shape, rows] { (void)BlockSparseMask(shape, rows); };
  };
  const BlockSparseShape two_rows{1, 1, 2, 4, 16, 16};
  using S = BlockCoverage;
  expect_invalid(build({1, 1, 2, 4, 0, 16}, {{0, 0, 0}, {}, {}}),
                 "[BlockSparseMask] query_block (0) must be >= 1");
  expect_invalid(build({1, 1, 2, 4, 16, 0}, {{0, 0, 0}, {}, {}}),
                 "[BlockSparseMask] key_block (0) must be >= 1");
  expect_invalid(build({0, 1, 2, 4, 16, 16}, {{0}, {}, {}}),
                 "[BlockSparseMask] batch (0) must be >= 1");
  expect_invalid(build(two_rows, {{0, 2, 3}, {3, 1, 0}, {S::kAll, S::kAll, S::kAll}}),
                 "key_blocks[1] (1) of row 0 must be greater than the one before it (3)");
  expect_invalid(build(two_rows, {{0, 2, 3}, {1, 1, 0}, {S::kAll, S::kAll, S::kAll}}),
                 "key_blocks[1] (1) of row 0 must be greater than the one before it (1)");
  expect_invalid(build(two_rows, {{0, 1, 2}, {0, 4}, {S::kAll, S::kAll}}),
                 "key_blocks[1] (4) of row 1 must be in [0, key_blocks = 4)");
  expect_invalid(build(two_rows, {{0, 1, 2}, {0, -1}, {S::kAll, S::kAll}}),
                 "key_blocks[1] (-1) of row 1 must be in [0, key_blocks = 4)");
  expect_invalid(build(two_rows, {{0, 1}, {0}, {S::kAll}}),
                 "offsets holds 2 entries; expected rows + 1 = 3");
  expect_invalid(build(two_rows, {{0, 2, 1}, {0}, {S::kAll}}),
                 "offsets[2] (1) must be >= offsets[1] (2)");
  expect_invalid(build(two_rows, {{0, 1, 1}, {0}, {S::kNone}}),
                 "states[0] (0) must be kAll or kPartial: absent blocks are not listed");
  expect_invalid(build(two_rows, {{0, 1, 1}, {0}, {}}), "states holds 0 entries");
  expect_invalid(
      [] {
        BlockSparseMask::from_states({1, 1, 2, 2, 4, 4}, {S::kAll});
      },
      "[BlockSparseMask::from_states] states holds 1 blocks; expected");
  expect_invalid(
      [] {
        apex::sliding_window_with_global({1, 1, 2, 2, 4, 4}, {0, {}, true});
      },
      "[sliding_window_with_global] window (0) must be >= 1");
  expect_invalid(
      [] {
        apex::sliding_window_with_global({1, 1, 2, 2, 4, 4}, {2, {5, 3}, true});
      },
      "[sliding_window_with_global] global[1] (3) must be >= 0 and greater");
  expect_invalid(
      [] {
        apex::strided({1, 1, 2, 2, 4, 4}, {4, 1, 0, true});
      },
      "[strided] stride (0) must be >= 1");
  const BlockSparseMask partial = BlockSparseMask::from_states({1, 1, 1, 1, 4, 4}, {S::kPartial});
  expect_invalid([&partial] { (void)apex::block_sparse_rules(partial); },
                 "[block_sparse_rules] the map has 1 kPartial blocks but no partial rule");
}

// A map that does not fit the call (batch, heads, too few blocks for the positions) is rejected
// by apex::sdpa, sdpa_varlen and sdpa_block_tables before anything is written.
TYPED_TEST(BlockSparse, RejectsMapsThatDoNotFitTheCall) {
  using Scalar = TypeParam;
  const Shape shape{2, 4, 2, 30, 50, 16, 16};
  const Problem<Scalar> p = make_problem<Scalar>({shape, 101, {}, std::nullopt});
  struct Bad {
    BlockSparseShape grid;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{3, 1, 4, 4, 16, 16}, "[sdpa] block-sparse map batch (3) must be 1 or the call's 2"},
      {{1, 2, 4, 4, 16, 16}, "[sdpa] block-sparse map heads (2) must be 1 or H_q (4)"},
      {{1, 1, 3, 4, 16, 16},
       "[sdpa] block-sparse map covers query positions [0, 48) (3 blocks of 16); the call's "
       "queries are at [20, 50)"},
      {{1, 1, 4, 3, 16, 16},
       "[sdpa] block-sparse map covers key positions [0, 48) (3 blocks of 16); the call's keys "
       "are at [0, 50)"},
  };
  for (const Bad& b : bad) {
    const BlockSparseMask map = DenseMap::every_block_partial(b.grid);
    Outputs<Scalar> o(shape);
    o.fill(Scalar(42));
    expect_invalid([&] { run(p, scattered_rules(map), o, nullptr); }, b.message);
    EXPECT_TRUE(o.out.all_equal(Scalar(42)) && o.lse.all_equal(Scalar(42))) << b.message;
  }
  // Top-left queries at [0, 30) fit 2 query blocks of 16; bottom-right ones do not.
  const BlockSparseMask small_map = DenseMap::every_block_partial({1, 1, 2, 4, 16, 16});
  Problem<Scalar> top_left = make_problem<Scalar>({shape, 101, {}, Index{0}});
  Outputs<Scalar> o(shape);
  run(top_left, scattered_rules(small_map), o, nullptr);  // fits: no throw
  // The ragged and paged calls: a map of 3 batches for 2 sequences, and one too short.
  const apex::RaggedBatch two = apex::RaggedBatch::from_lengths({10, 20}, {20, 40});
  Heads<Scalar> q(1, 4, 30, 16, Layout::kTokenMajor), out(1, 4, 30, 16, Layout::kTokenMajor);
  Heads<Scalar> k(1, 2, 60, 16, Layout::kTokenMajor), v(1, 2, 60, 16, Layout::kTokenMajor);
  out.fill(Scalar(42));
  const BlockSparseMask three = DenseMap::every_block_partial({3, 1, 2, 2, 16, 16});
  expect_invalid(
      [&] {
        apex::sdpa_varlen(q.view(), k.view(), v.view(), two, {apex::causal_mask()},
                          apex::AttentionMask<Scalar>{}, apex::SdpaParams{}, scattered_rules(three),
                          out.view());
      },
      "[sdpa_varlen] block-sparse map batch (3) must be 1 or the call's 2");
  expect_invalid(
      [&] {
        apex::sdpa_varlen(q.view(), k.view(), v.view(), two, {apex::causal_mask()},
                          apex::AttentionMask<Scalar>{}, apex::SdpaParams{},
                          scattered_rules(small_map), out.view());
      },
      "[sdpa_varlen] block-sparse map covers query positions [0, 32) (2 blocks of 16); the "
      "call's queries are at [20, 40)");  // sequence 1: its 40 keys fit, its queries do not
  Heads<Scalar> k_pool(5, 2, 16, 16), v_pool(5, 2, 16, 16);
  const apex::BlockTables<Scalar, Scalar> tables{
      k_pool.view(), v_pool.view(), {{0, 1}, {2, 3, 4}}, {20, 40}};
  expect_invalid(
      [&] {
        apex::sdpa_block_tables(q.view(), {0, 10, 30}, tables, {apex::causal_mask()},
                                apex::AttentionMask<Scalar>{}, apex::SdpaParams{},
                                scattered_rules(small_map), out.view());
      },
      "[sdpa_block_tables] block-sparse map covers query positions [0, 32) (2 blocks of 16); "
      "the call's queries are at [20, 40)");
  EXPECT_TRUE(out.all_equal(Scalar(42)));
}

}  // namespace
}  // namespace block_sparse_test
