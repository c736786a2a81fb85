// SPDX-License-Identifier: MIT
// Tests of include/apex/mask.hpp: the sliding window (§10), the APEX-1 prefix / global / local
// rule and its pictures (§11), block classification and query alignment.
#include <apex/mask.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "reference/attention.hpp"
#include "test_util.hpp"

namespace mask_test {
namespace {

using apex::BoolMatrix;
using apex::Index;
using apex::LayerMaskParams;
using apex::PositionMask;
using apex::testing::expect_invalid;
using apex_test::MaskRule;

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

bool starts_with(const std::string& text, const std::string& start) {
  return text.compare(0, start.size(), start) == 0;
}

bool ends_with(const std::string& text, const std::string& end) {
  return text.size() >= end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

Index count_allowed(const BoolMatrix& mask) { return mask.cast<Index>().sum(); }

// §10.2: for several W and S, the dense mask is exactly {(i, j) : 0 <= i - j < W and j <= i}.
TEST(Mask, S10_2_SlidingWindowFormula) {
  for (const Index s : {1, 2, 5, 10, 17, 33}) {
    for (const Index w : {1, 2, 3, 4, 7, 10, 16, 40}) {
      const BoolMatrix mask = apex::build_mask(apex::sliding_window_mask(w), s, s);
      ASSERT_EQ(mask.rows(), s);
      ASSERT_EQ(mask.cols(), s);
      for (Index i = 0; i < s; ++i) {
        for (Index j = 0; j < s; ++j) {
          EXPECT_EQ(mask(i, j), apex_test::sliding_window_allows(i, j, w))
              << "S = " << s << ", W = " << w << ", i = " << i << ", j = " << j;
        }
      }
    }
  }
  // W = 1 is the query alone (the window counts the query itself).
  EXPECT_TRUE(apex::build_mask(apex::sliding_window_mask(1), 4, 4).isIdentity());
}

// §10.3: "S = 128K, W = 4K → sliding window is 32× cheaper". What is computed here:
//   - the document's ratio is that of the complexity bounds O(S²·d_h) / O(S·W·d_h) = S / W = 32;
//   - the exact numbers of allowed (query, key) pairs are S(S+1)/2 for causal attention and
//     W(W+1)/2 + (S − W)·W for the window; both closed forms are checked against build_mask on
//     small cases, then evaluated at S = 131072, W = 4096: 8,590,000,128 vs 528,484,352 pairs.
//     Their ratio is ≈ 16.25, because a causal kernel already skips the masked upper triangle; the
//     32× is the saving against the full S × S square (S² / (S·W) = 32 exactly).
TEST(Mask, S10_3_WindowCostRatio) {
  const auto causal_pairs = [](std::int64_t s) { return s * (s + 1) / 2; };
  const auto window_pairs = [](std::int64_t s, std::int64_t w) {
    return w >= s ? s * (s + 1) / 2 : w * (w + 1) / 2 + (s - w) * w;
  };
  for (const Index s : {1, 7, 10, 64, 100}) {
    EXPECT_EQ(count_allowed(apex::build_mask(apex::causal_mask(), s, s)), causal_pairs(s));
    for (const Index w : {1, 3, 4, 16, 100, 200}) {
      EXPECT_EQ(count_allowed(apex::build_mask(apex::sliding_window_mask(w), s, s)),
                window_pairs(s, w))
          << "S = " << s << ", W = " << w;
    }
  }

  const std::int64_t s = 128 * 1024;
  const std::int64_t w = 4 * 1024;
  EXPECT_EQ(s / w, 32);
  EXPECT_EQ(s % w, 0);
  EXPECT_EQ((s * s) / (s * w), 32);  // the document's 32×: the full square against S·W
  EXPECT_EQ(causal_pairs(s), 8590000128);
  EXPECT_EQ(window_pairs(s, w), 528484352);
  const double causal_ratio =
      static_cast<double>(causal_pairs(s)) / static_cast<double>(window_pairs(s, w));
  EXPECT_NEAR(causal_ratio, 16.25403, 1e-5);
}

// §11.2: F_g = 6 gives L L L L L G L L L L L G for layers 0..11, then 17, 23, ... are global.
TEST(Mask, S11_2_LayerTable) {
  std::string table;
  for (Index layer = 0; layer < 12; ++layer) table += apex::is_global_layer(layer) ? 'G' : 'L';
  EXPECT_EQ(table, "LLLLLGLLLLLG");
  for (const Index layer : {5, 11, 17, 23, 29}) EXPECT_TRUE(apex::is_global_layer(layer));
  for (const Index layer : {0, 6, 12, 16, 18, 22, 24}) EXPECT_FALSE(apex::is_global_layer(layer));
  // The default parameters of LayerMaskParams are the document's F_g.
  EXPECT_EQ(LayerMaskParams{}.global_every, 6);
  // F_g = 1: every layer is global; F_g = 2: every odd layer.
  for (Index layer = 0; layer < 8; ++layer) {
    EXPECT_TRUE(apex::is_global_layer(layer, 1));
    EXPECT_EQ(apex::is_global_layer(layer, 2), layer % 2 == 1);
  }
}

// §11.3, global layer, P = 4, S = 10: all ten rows are rendered; the rows the document shows
// (0-5 and 9) must match its picture character for character (without the "← ..." notes).
TEST(Mask, S11_3_GlobalLayerPicture) {
  const LayerMaskParams params{/*prefix=*/4, /*window=*/4};
  ASSERT_TRUE(apex::is_global_layer(5));
  const BoolMatrix mask = apex::build_mask(5, 10, params);
  const std::vector<std::string> lines = split_lines(apex::render_mask(mask));
  ASSERT_EQ(lines.size(), 11u);
  EXPECT_EQ(lines[0], "Position:  0  1  2  3  4  5  6  7  8  9");
  EXPECT_EQ(lines[1 + 0], "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 1], "    1:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 2], "    2:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 3], "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 4], "    4:     █  █  █  █  █  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 5], "    5:     █  █  █  █  █  █  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 9], "    9:     █  █  █  █  █  █  █  █  █  █");
  // The rows the document leaves out follow the same rule.
  EXPECT_EQ(lines[1 + 7], "    7:     █  █  █  █  █  █  █  █  ·  ·");

  // Selecting the document's rows reproduces its whole picture.
  EXPECT_EQ(apex::render_mask(mask, {0, 1, 2, 3, 4, 5, 9}),
            "Position:  0  1  2  3  4  5  6  7  8  9\n"
            "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    1:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    2:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    4:     █  █  █  █  █  ·  ·  ·  ·  ·\n"
            "    5:     █  █  █  █  █  █  ·  ·  ·  ·\n"
            "    9:     █  █  █  █  █  █  █  █  █  █\n");
}

// §11.3, local layer, P = 4, W = 4, S = 10: rows 0, 3, 4, 7, 9 as printed. Row 4 is the one to
// notice: position 4 is outside the prefix, so it no longer sees position 0 (4 - 0 = W).
TEST(Mask, S11_3_LocalLayerPicture) {
  const LayerMaskParams params{/*prefix=*/4, /*window=*/4};
  ASSERT_FALSE(apex::is_global_layer(0));
  const BoolMatrix mask = apex::build_mask(0, 10, params);
  const std::vector<std::string> lines = split_lines(apex::render_mask(mask));
  ASSERT_EQ(lines.size(), 11u);
  EXPECT_EQ(lines[0], "Position:  0  1  2  3  4  5  6  7  8  9");
  EXPECT_EQ(lines[1 + 0], "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 3], "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 4], "    4:     ·  █  █  █  █  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 7], "    7:     ·  ·  ·  ·  █  █  █  █  ·  ·");
  EXPECT_EQ(lines[1 + 9], "    9:     ·  ·  ·  ·  ·  ·  █  █  █  █");

  EXPECT_EQ(apex::render_mask(mask, {0, 3, 4, 7, 9}),
            "Position:  0  1  2  3  4  5  6  7  8  9\n"
            "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
            "    4:     ·  █  █  █  █  ·  ·  ·  ·  ·\n"
            "    7:     ·  ·  ·  ·  █  █  █  █  ·  ·\n"
            "    9:     ·  ·  ·  ·  ·  ·  █  █  █  █\n");
}

// The layer masks equal the §11.1 rule, written independently in tests/reference/attention.hpp,
// for many layers, F_g, P, W and S.
TEST(Mask, LayerMaskMatchesFormula) {
  for (const Index global_every : {1, 2, 3, 6}) {
    for (Index layer = 0; layer < 14; ++layer) {
      for (const Index s : {1, 4, 10, 13}) {
        for (const Index p : {Index{0}, Index{1}, Index{4}, s}) {
          if (p > s) continue;
          for (const Index w : {1, 2, 4, 9, 20}) {
            const LayerMaskParams params{p, w, global_every};
            const bool global = apex_test::is_global(layer, global_every);
            ASSERT_EQ(apex::is_global_layer(layer, global_every), global);
            const BoolMatrix mask = apex::build_mask(layer, s, params);
            for (Index i = 0; i < s; ++i) {
              for (Index j = 0; j < s; ++j) {
                ASSERT_EQ(mask(i, j), apex_test::apex_layer_allows(i, j, global, p, w))
                    << "layer " << layer << ", F_g " << global_every << ", S " << s << ", P " << p
                    << ", W " << w << ", (" << i << ", " << j << ")";
              }
            }
          }
        }
      }
    }
  }
}

// With W >= S no key ever leaves the window: a local layer is a global one.
TEST(Mask, LocalEqualsGlobalWhenWindowCoversSequence) {
  for (const Index s : {1, 5, 10, 17}) {
    for (const Index w : {s, s + 3}) {
      for (const Index p : {Index{0}, Index{2}, s}) {
        if (p > s) continue;
        const LayerMaskParams params{p, w};
        EXPECT_EQ(apex::build_mask(0, s, params), apex::build_mask(5, s, params))
            << "S " << s << ", W " << w << ", P " << p;
      }
    }
  }
  // ...and with W < S it is not.
  EXPECT_NE(apex::build_mask(0, 10, {0, 9}), apex::build_mask(5, 10, {0, 9}));
}

// Without a prefix the global layer is plain causal attention (lower triangle).
TEST(Mask, GlobalWithoutPrefixIsCausal) {
  for (const Index s : {1, 3, 10, 31}) {
    const BoolMatrix global = apex::build_mask(5, s, {0, 4});
    EXPECT_EQ(global, apex::build_mask(apex::causal_mask(), s, s));
    BoolMatrix lower = BoolMatrix::Constant(s, s, false);
    lower.triangularView<Eigen::Lower>().setConstant(true);
    EXPECT_EQ(global, lower);
  }
}

// classify_block against the per-pair rule on random rectangles: kAll means every pair is allowed,
// kNone means none is (kPartial may be either). The rectangles include prefix and window edges and
// queries before position 0; the per-pair rule itself is checked against the independent formula.
TEST(Mask, ClassifyBlockAgreesWithPairRule) {
  std::mt19937 rng(20240611);
  const auto uniform = [&rng](Index lo, Index hi) {  // inclusive
    return std::uniform_int_distribution<Index>(lo, hi)(rng);
  };
  int all_count = 0;
  int none_count = 0;
  int partial_count = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    PositionMask mask;
    mask.causal = uniform(0, 9) != 0;
    if (mask.causal && uniform(0, 2) != 0) mask.window = uniform(1, 12);
    mask.prefix = uniform(0, 2) == 0 ? 0 : uniform(1, 16);
    const Index q_begin = uniform(-6, 40);
    const Index q_end = q_begin + uniform(1, 16);
    const Index k_begin = uniform(0, 40);
    const Index k_end = k_begin + uniform(1, 16);
    const apex_test::MaskRule rule{mask.causal, mask.window.value_or(0), mask.prefix};
    bool any = false;
    bool all = true;
    for (Index qp = q_begin; qp < q_end; ++qp) {
      for (Index kp = k_begin; kp < k_end; ++kp) {
        const bool allowed = mask.allows(qp, kp);
        ASSERT_EQ(allowed, apex_test::rule_allows(rule, qp, kp))
            << "causal " << mask.causal << ", W " << rule.window << ", P " << mask.prefix << ", ("
            << qp << ", " << kp << ")";
        any = any || allowed;
        all = all && allowed;
      }
    }
    const apex::BlockCoverage coverage = apex::classify_block(mask, q_begin, q_end, k_begin, k_end);
    const std::string where = "causal " + std::to_string(mask.causal) + ", W " +
                              std::to_string(rule.window) + ", P " + std::to_string(mask.prefix) +
                              ", q [" + std::to_string(q_begin) + ", " + std::to_string(q_end) +
                              "), k [" + std::to_string(k_begin) + ", " + std::to_string(k_end) +
                              ")";
    if (coverage == apex::BlockCoverage::kAll) {
      ++all_count;
      ASSERT_TRUE(all) << where;
    } else if (coverage == apex::BlockCoverage::kNone) {
      ++none_count;
      ASSERT_FALSE(any) << where;
    } else {
      ++partial_count;
    }
  }
  // The sample reaches all three answers often enough for the checks above to mean something.
  EXPECT_GT(all_count, 1000);
  EXPECT_GT(none_count, 1000);
  EXPECT_GT(partial_count, 1000);

  // Edges, exactly.
  PositionMask prefixed = apex::sliding_window_mask(3);
  prefixed.prefix = 8;
  EXPECT_EQ(apex::classify_block(prefixed, 0, 8, 0, 8), apex::BlockCoverage::kAll);   // the prefix
  EXPECT_EQ(apex::classify_block(prefixed, 0, 8, 8, 9), apex::BlockCoverage::kNone);  // key after
  EXPECT_EQ(apex::classify_block(prefixed, 8, 9, 6, 9), apex::BlockCoverage::kAll);   // window 3
  EXPECT_EQ(apex::classify_block(prefixed, 8, 9, 5, 9), apex::BlockCoverage::kPartial);
  EXPECT_EQ(apex::classify_block(prefixed, 20, 30, 0, 8), apex::BlockCoverage::kNone);
  EXPECT_EQ(apex::classify_block(apex::causal_mask(), 5, 9, 9, 12), apex::BlockCoverage::kNone);
  EXPECT_EQ(apex::classify_block(PositionMask{}, 5, 9, 9, 12), apex::BlockCoverage::kAll);
}

// Chunks and documents, alone and with the causal rule, windows and a prefix: on random
// rectangles, the per-pair rule equals the independent formula, kAll and kNone are exact, and
// visible_keys holds every key that some query of the rectangle may see.
TEST(Mask, ChunksAndDocumentsClassifyExactlyAndBoundTheVisibleKeys) {
  std::mt19937 rng(20261201);
  const auto uniform = [&rng](Index lo, Index hi) {  // inclusive
    return std::uniform_int_distribution<Index>(lo, hi)(rng);
  };
  int counts[3] = {0, 0, 0};
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<Index> ids;
    for (Index id = 0; static_cast<Index>(ids.size()) < 80; id += uniform(1, 2)) {
      ids.resize(std::min<std::size_t>(80, ids.size() + std::size_t(uniform(1, 20))), id);
    }
    PositionMask mask;
    mask.causal = uniform(0, 3) != 0;
    if (mask.causal && uniform(0, 1) != 0) mask.chunk = uniform(1, 24);
    if (mask.causal && uniform(0, 2) == 0) mask.window = uniform(1, 30);
    if (!mask.chunk || uniform(0, 1) == 0) mask.documents = apex::DocumentIds(ids);
    mask.prefix = uniform(0, 2) == 0 ? uniform(1, 16) : 0;
    const MaskRule rule{mask.causal, mask.window.value_or(0), mask.prefix, mask.chunk.value_or(0),
                        mask.documents.empty() ? nullptr : &ids};
    const Index q_begin = uniform(0, 70);
    const Index q_end = std::min<Index>(80, q_begin + uniform(1, 10));
    const Index k_begin = uniform(0, 70);
    const Index k_end = std::min<Index>(80, k_begin + uniform(1, 10));
    bool any = false;
    bool all = true;
    for (Index qp = q_begin; qp < q_end; ++qp) {
      for (Index kp = k_begin; kp < k_end; ++kp) {
        const bool allowed = mask.allows(qp, kp);
        ASSERT_EQ(allowed, apex_test::rule_allows(rule, qp, kp)) << trial;
        any = any || allowed;
        all = all && allowed;
      }
    }
    const apex::BlockCoverage coverage = apex::classify_block(mask, q_begin, q_end, k_begin, k_end);
    ++counts[static_cast<int>(coverage)];
    if (coverage == apex::BlockCoverage::kAll) {
      ASSERT_TRUE(all) << trial;
    }
    if (coverage == apex::BlockCoverage::kNone) {
      ASSERT_FALSE(any) << trial;
    }
    const apex::PositionRange visible = apex::visible_keys(mask, q_begin, q_end);
    for (Index qp = q_begin; qp < q_end; ++qp) {
      for (Index kp = 0; kp < 80; ++kp) {
        if (mask.allows(qp, kp)) {
          ASSERT_TRUE(visible.begin <= kp && kp < visible.end)
              << "trial " << trial << ": key " << kp << " of query " << qp << " outside ["
              << visible.begin << ", " << visible.end << ")";
        }
      }
    }
  }
  // Each answer is reached often enough for the checks above to mean something.
  EXPECT_GT(counts[0], 500);  // kNone
  EXPECT_GT(counts[1], 500);  // kPartial
  EXPECT_GT(counts[2], 500);  // kAll
}

// Chunked attention of C = 3 over 7 positions: each query sees the keys of its own chunk, up to
// itself; queries before position 0 see nothing.
TEST(Mask, ChunkedAttentionByHand) {
  PositionMask mask = apex::causal_mask();
  mask.chunk = 3;
  BoolMatrix expected(7, 7);
  expected << 1, 0, 0, 0, 0, 0, 0,  //
      1, 1, 0, 0, 0, 0, 0,          //
      1, 1, 1, 0, 0, 0, 0,          //
      0, 0, 0, 1, 0, 0, 0,          //
      0, 0, 0, 1, 1, 0, 0,          //
      0, 0, 0, 1, 1, 1, 0,          //
      0, 0, 0, 0, 0, 0, 1;
  EXPECT_EQ(apex::build_mask(mask, 7, 7), expected);
  EXPECT_EQ(mask.chunk_of(-1), -1);
  EXPECT_EQ(mask.chunk_of(-3), -1);
  EXPECT_EQ(mask.chunk_of(-4), -2);
  EXPECT_EQ(apex::classify_block(mask, 3, 6, 0, 3), apex::BlockCoverage::kNone);
  EXPECT_EQ(apex::classify_block(mask, 5, 6, 3, 6), apex::BlockCoverage::kAll);
  const apex::PositionRange visible = apex::visible_keys(mask, 4, 7);
  EXPECT_EQ(visible.begin, 3);
  EXPECT_EQ(visible.end, 7);
}

// Documents [0, 0, 0, 5, 5, 9]: bidirectional inside each document, or causal inside each.
TEST(Mask, DocumentMaskByHand) {
  const std::vector<Index> ids{0, 0, 0, 5, 5, 9};
  PositionMask mask;
  mask.documents = apex::DocumentIds(ids);
  BoolMatrix expected(6, 6);
  expected << 1, 1, 1, 0, 0, 0,  //
      1, 1, 1, 0, 0, 0,          //
      1, 1, 1, 0, 0, 0,          //
      0, 0, 0, 1, 1, 0,          //
      0, 0, 0, 1, 1, 0,          //
      0, 0, 0, 0, 0, 1;
  EXPECT_EQ(apex::build_mask(mask, 6, 6), expected);
  mask.causal = true;
  EXPECT_EQ(apex::build_mask(mask, 6, 6), BoolMatrix(expected.triangularView<Eigen::Lower>()));
  EXPECT_THROW(apex::build_mask(mask, 5, 5), std::invalid_argument);  // 6 ids for 5 positions
}

// S_q < S_k: by default the queries are the last S_q positions (bottom-right, as when decoding
// with a KV cache); query_offset = 0 puts them first (top-left).
TEST(Mask, QueryAlignmentBottomRightVsTopLeft) {
  const Index s_q = 3;
  const Index s_k = 5;
  PositionMask bottom_right = apex::causal_mask();
  PositionMask top_left = apex::causal_mask();
  top_left.query_offset = 0;
  EXPECT_EQ(bottom_right.first_query_position(s_q, s_k), 2);
  EXPECT_EQ(top_left.first_query_position(s_q, s_k), 0);

  BoolMatrix expected_bottom_right(s_q, s_k);
  expected_bottom_right << 1, 1, 1, 0, 0,  //
      1, 1, 1, 1, 0,                       //
      1, 1, 1, 1, 1;
  BoolMatrix expected_top_left(s_q, s_k);
  expected_top_left << 1, 0, 0, 0, 0,  //
      1, 1, 0, 0, 0,                   //
      1, 1, 1, 0, 0;
  EXPECT_EQ(apex::build_mask(bottom_right, s_q, s_k), expected_bottom_right);
  EXPECT_EQ(apex::build_mask(top_left, s_q, s_k), expected_top_left);

  // A single decoding query sees the whole cache, or its window of it.
  EXPECT_TRUE(apex::build_mask(apex::causal_mask(), 1, 7).all());
  BoolMatrix last_three(1, 7);
  last_three << 0, 0, 0, 0, 1, 1, 1;
  EXPECT_EQ(apex::build_mask(apex::sliding_window_mask(3), 1, 7), last_three);

  // A key_offset shifts the keys: queries 5, 6 against keys 3..6 of a window of 2.
  PositionMask shifted = apex::sliding_window_mask(2);
  shifted.key_offset = 3;
  BoolMatrix expected_shifted(2, 4);
  expected_shifted << 0, 1, 1, 0,  //
      0, 0, 1, 1;
  EXPECT_EQ(apex::build_mask(shifted, 2, 4), expected_shifted);
}

// S_q > S_k under bottom-right alignment places the first queries before position 0: they see no
// key (attention gives them zeros) and are not part of the prefix [0, P).
TEST(Mask, QueriesBeforePositionZeroSeeNothing) {
  PositionMask mask = apex::causal_mask();
  mask.prefix = 2;
  EXPECT_EQ(mask.first_query_position(6, 4), -2);
  BoolMatrix expected(6, 4);
  expected << 0, 0, 0, 0,  // position -2
      0, 0, 0, 0,          // position -1
      1, 1, 0, 0,          // position 0, in the prefix
      1, 1, 0, 0,          // position 1, in the prefix
      1, 1, 1, 0,          //
      1, 1, 1, 1;
  EXPECT_EQ(apex::build_mask(mask, 6, 4), expected);
  EXPECT_EQ(apex::classify_block(mask, -2, 0, 0, 2), apex::BlockCoverage::kNone);
  EXPECT_EQ(apex::classify_block(mask, -2, 2, 0, 2), apex::BlockCoverage::kPartial);
}

// The output form of build_mask writes into a caller's matrix and equals the value form.
TEST(Mask, BuildMaskIntoMatrix) {
  PositionMask mask = apex::sliding_window_mask(4);
  mask.prefix = 3;
  BoolMatrix out(7, 12);
  apex::build_mask(mask, out);
  EXPECT_EQ(out, apex::build_mask(mask, 7, 12));
}

// Positions 10 and beyond: columns stay 3 wide, numbers right-aligned, glyphs under the last digit.
TEST(Mask, RenderTwoDigitPositions) {
  const BoolMatrix mask = apex::build_mask(apex::causal_mask(), 12, 12);
  const std::vector<std::string> lines = split_lines(apex::render_mask(mask));
  ASSERT_EQ(lines.size(), 13u);
  EXPECT_EQ(lines[0], "Position:  0  1  2  3  4  5  6  7  8  9 10 11");
  EXPECT_EQ(lines[1 + 0], "    0:     █  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·");
  EXPECT_EQ(lines[1 + 10], "   10:     █  █  █  █  █  █  █  █  █  █  █  ·");
  EXPECT_EQ(lines[1 + 11], "   11:     █  █  █  █  █  █  █  █  █  █  █  █");
}

// Three-digit positions widen every column to 4 so that numbers never touch; six-digit row
// indices widen the label margin.
TEST(Mask, RenderWidensBeyondTwoDigits) {
  const BoolMatrix wide = apex::build_mask(apex::sliding_window_mask(2), 1, 101);
  const std::vector<std::string> lines = split_lines(apex::render_mask(wide));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_PRED2(starts_with, lines[0], "Position:   0   1   2   3");
  EXPECT_PRED2(ends_with, lines[0], "  98  99 100");
  EXPECT_PRED2(starts_with, lines[1], "    0:      ·   ·   ·");
  EXPECT_PRED2(ends_with, lines[1], "   ·   █   █");  // query 100 sees keys 99 and 100

  const BoolMatrix tall = apex::build_mask(PositionMask{}, 100001, 1);
  const std::string text = apex::render_mask(tall, {0, 100000});
  EXPECT_EQ(text,
            "Position:   0\n"
            "     0:     █\n"
            "100000:     █\n");
}

// An empty row selection renders every row; a selection keeps its order and may repeat.
TEST(Mask, RenderRowSelection) {
  const BoolMatrix mask = apex::build_mask(apex::causal_mask(), 3, 3);
  EXPECT_EQ(apex::render_mask(mask),
            "Position:  0  1  2\n"
            "    0:     █  ·  ·\n"
            "    1:     █  █  ·\n"
            "    2:     █  █  █\n");
  EXPECT_EQ(apex::render_mask(mask, {2, 0, 2}),
            "Position:  0  1  2\n"
            "    2:     █  █  █\n"
            "    0:     █  ·  ·\n"
            "    2:     █  █  █\n");
}

// ---- bad input ------------------------------------------------------------------------------

TEST(Mask, RejectsWindowBelowOne) {
  expect_invalid([] { apex::sliding_window_mask(0); },
                 "[sliding_window_mask] window (0) must be >= 1");
  // A local layer needs W; the default 0 means "not set".
  expect_invalid([] { apex::layer_mask(0, LayerMaskParams{}); },
                 "[layer_mask] window W (0) must be >= 1 for local layer 0");
  expect_invalid(
      [] {
        apex::build_mask(3, 10, LayerMaskParams{0, 0});
      },
      "window W (0) must be >= 1 for local layer 3");
  expect_invalid(
      [] {
        apex::layer_mask(5, LayerMaskParams{0, -2});
      },
      "[layer_mask] window W (-2) must be >= 0");
  // A global layer does not use W.
  EXPECT_FALSE(apex::layer_mask(5, LayerMaskParams{}).window.has_value());
}

TEST(Mask, RejectsPrefixLongerThanSequence) {
  expect_invalid(
      [] {
        apex::build_mask(5, 10, LayerMaskParams{11, 4});
      },
      "[build_mask] prefix P (11) must not exceed the sequence length S (10)");
  EXPECT_NO_THROW(apex::build_mask(5, 10, LayerMaskParams{10, 4}));
}

TEST(Mask, RejectsGlobalEveryBelowOne) {
  expect_invalid([] { apex::is_global_layer(3, 0); },
                 "[is_global_layer] global_every F_g (0) must be >= 1");
  expect_invalid(
      [] {
        apex::layer_mask(3, LayerMaskParams{0, 4, -1});
      },
      "[layer_mask] global_every F_g (-1) must be >= 1");
}

TEST(Mask, RejectsNegativePrefix) {
  expect_invalid(
      [] {
        apex::layer_mask(5, LayerMaskParams{-1, 4});
      },
      "[layer_mask] prefix P (-1) must be >= 0");
  PositionMask mask = apex::causal_mask();
  mask.prefix = -3;
  expect_invalid([&] { apex::build_mask(mask, 2, 2); }, "[build_mask] prefix (-3) must be >= 0");
}

TEST(Mask, RejectsNegativeLayer) {
  expect_invalid([] { apex::is_global_layer(-1); }, "[is_global_layer] layer (-1) must be >= 0");
  expect_invalid(
      [] {
        apex::layer_mask(-6, LayerMaskParams{0, 4});
      },
      "[layer_mask] layer (-6) must be >= 0");
}

TEST(Mask, RejectsBadPositionMaskAndLeavesOutputUntouched) {
  PositionMask window_without_causal;
  window_without_causal.window = 4;
  BoolMatrix out = BoolMatrix::Constant(3, 5, true);
  expect_invalid([&] { apex::build_mask(window_without_causal, out); },
                 "[build_mask] window (4) requires causal = true");
  EXPECT_TRUE(out.all());
  PositionMask zero_window = apex::causal_mask();
  zero_window.window = 0;
  expect_invalid([&] { apex::build_mask(zero_window, out); },
                 "[build_mask] window (0) must be at least 1");
  EXPECT_TRUE(out.all());
  expect_invalid([] { apex::build_mask(apex::causal_mask(), -1, 3); },
                 "[build_mask] num_queries (-1) must be >= 0");
}

TEST(Mask, RejectsSizesWhoseElementCountOverflows) {
  // S_q·S_k = 2^64: an invalid argument, found before anything is allocated (not bad_alloc).
  const Index big = Index{1} << 32;
  expect_invalid([&] { (void)apex::build_mask(apex::causal_mask(), big, big); },
                 {"[build_mask] num_queries*num_keys", "overflows 64 bits"});
  expect_invalid([&] { (void)apex::build_mask(5, big, LayerMaskParams{}); },
                 {"[build_mask] S*S", "overflows 64 bits"});
  // A zero side is an empty mask, however long the other.
  EXPECT_EQ(apex::build_mask(apex::causal_mask(), 0, Index{1} << 62).size(), 0);
}

/// The value, hidden from the optimiser: with a visible constant GCC proves that the loop the
/// rejected call never reaches would overflow, and -Werror then stops the build.
Index opaque(Index value) {
  volatile Index hidden = value;
  return hidden;
}

TEST(Mask, RejectsOffsetsWhosePositionsOverflow) {
  const Index max = std::numeric_limits<Index>::max();
  PositionMask rule = apex::causal_mask();
  rule.key_offset = opaque(max - 1);  // keys at max - 1, max, max + 1, ...: the third is no Index
  BoolMatrix out = BoolMatrix::Constant(1, 4, true);
  expect_invalid([&] { apex::build_mask(rule, out); },
                 {"[build_mask] key_offset (9223372036854775806) + S_k (4)",
                  "must not exceed the largest position 9223372036854775807"});
  EXPECT_TRUE(out.all());
  expect_invalid([&] { (void)apex::build_mask(rule, 1, 4); }, "[build_mask] key_offset");
  PositionMask late = apex::causal_mask();
  late.query_offset = opaque(max);  // the end of the query range, max + 1, is no Index
  expect_invalid([&] { apex::build_mask(late, out); },
                 {"[build_mask] query_offset (9223372036854775807) + S_q (1)", "largest position"});
  EXPECT_TRUE(out.all());
}

TEST(Mask, PositionsUpToTheLargestIndexAreExact) {
  // Keys [max - 4, max) and, bottom-right aligned, queries [max - 2, max): every position and
  // every difference is formed without overflow (UndefinedBehaviorSanitizer checks that).
  const Index max = std::numeric_limits<Index>::max();
  PositionMask rule = apex::sliding_window_mask(2);
  rule.key_offset = max - 4;
  const BoolMatrix mask = apex::build_mask(rule, 2, 4);
  for (Index i = 0; i < 2; ++i) {
    for (Index j = 0; j < 4; ++j) {
      EXPECT_EQ(mask(i, j), apex_test::sliding_window_allows(i + 2, j, 2)) << i << ", " << j;
    }
  }
  // Top-left: queries at [max - 1, max), against the same keys.
  rule.query_offset = max - 1;
  const BoolMatrix late = apex::build_mask(rule, 1, 4);
  BoolMatrix expected(1, 4);
  expected << false, false, true, true;  // keys max - 2 and max - 1, W = 2
  EXPECT_EQ(late, expected);
}

TEST(Mask, RejectsRenderRowOutOfRange) {
  const BoolMatrix mask = apex::build_mask(apex::causal_mask(), 4, 4);
  expect_invalid(
      [&] {
        apex::render_mask(mask, {0, 4});
      },
      "[render_mask] row (4) must be in [0, 4)");
  expect_invalid([&] { apex::render_mask(mask, {-1}); },
                 "[render_mask] row (-1) must be in [0, 4)");
}

}  // namespace
}  // namespace mask_test
