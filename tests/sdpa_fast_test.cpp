// SPDX-License-Identifier: MIT
// Tests of the tiled kernel behind apex::sdpa (include/apex/detail/flash_attention.hpp): on random
// inputs it must equal the oracle apex::reference::sdpa and the plain loops of
// reference/attention.hpp (problems built by attention_case.hpp) for every kind of mask, sequence
// lengths that do and do not fill its blocks, several head widths and group sizes, float and
// double, with and without soft-capping; its decoding path (keys split in chunks, then merged)
// must too; and its result must not depend on the number of threads.
//
// The shapes are a table of cases rather than the full cartesian product, so that the program
// stays fast under AddressSanitizer; every value of every axis appears in at least one case:
//   S_q ∈ {1, 7, 64, 1000}, S_k ∈ {1, 63, 64, 65, 1031}, d_qk ∈ {16, 64, 128, 192}, d_v ≠ d_qk,
//   G = H_q / H_kv ∈ {1, 2, 4, 8, 16}, soft-capping on and off, both [B, H, S, D] layouts.
// With the default blocks (M = G·Bq = 256 stacked rows, Bk = 64 keys; decoding when S_q ≤ Bq and
// S_k > 512, with the streaming kernel when M ≤ 8), S_k = 63/64/65 sit on either side of one key
// block, S_q = 1000 spans several query blocks, and S_q ∈ {1, 7} against S_k = 1031 takes the
// decoding path (three chunks).
#include <apex/detail/flash_attention.hpp>
#include <apex/mask.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_case.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace sdpa_fast_test {
namespace {

using apex::HeadsView;
using apex::Index;
using apex::testing::expect_matches_loops;
using apex::testing::expect_same_outputs;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Tolerances;
using apex::testing::Values;
using apex_test::MaskRule;

// The inputs are drawn from N(0, 1) (Values::kNormal), which gives larger scores than uniform
// ones. Tolerances: those of tolerances.hpp, kAttention for the oracle and the plain loops alike
// (the oracle works in double whatever the scalar, like the loops).

template <class Scalar>
class SdpaFast : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SdpaFast, Scalars, apex::testing::ScalarName);

// ---- where the queries and keys sit -------------------------------------------------------------
enum class Dense { kNone, kBoolean, kBias };

/// The position rule of a case and the offsets of its queries and keys.
struct Positions {
  MaskRule rule;
  std::optional<Index> query_offset;  ///< unset: bottom-right alignment
  Index key_offset = 0;
};

Positions no_mask() { return {}; }
/// Causal, with a window W (0: none) and a bidirectional prefix P.
Positions causal(Index window = 0, Index prefix = 0) { return {{true, window, prefix}, {}, 0}; }
Positions causal_at(Index query_offset, Index key_offset) {
  return {{true, 0, 0}, query_offset, key_offset};
}

// Causal with a window of 70 and a prefix of 150, queries at 100..163: the first 50 see every
// key of the prefix (later ones included), the others their window only.
Positions prefix_window() { return {{true, 70, 150}, Index{100}, 0}; }

template <class Scalar>
void place(Problem<Scalar>& p, const Positions& at) {
  p.rule = at.rule;
  p.query_offset = at.query_offset;
  p.key_offset = at.key_offset;
}

/// Runs apex::sdpa (the fast kernel) or, with `blocking`, the kernel with other block sizes.
template <class Scalar>
void run_fast(const Problem<Scalar>& p, Outputs<Scalar>& o,
              const std::optional<apex::detail::FlashBlocking>& blocking = std::nullopt) {
  apex::detail::flash_sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                                   o.out.view(), o.lse.view(), {},
                                   blocking.value_or(apex::detail::FlashBlocking{}));
}

template <class Scalar>
void run_reference(const Problem<Scalar>& p, Outputs<Scalar>& o) {
  apex::reference::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params,
                                o.out.view(), o.lse.view());
}

// ---- the table of cases -------------------------------------------------------------------------
struct Case {
  const char* name;
  Shape shape;
  Positions positions;
  Dense dense;
  double softcap;
  Layout layout;
};

std::vector<Case> cases() {
  const Layout kC = Layout::kContiguous;
  const Layout kT = Layout::kTokenMajor;
  // clang-format off
  return {
    //  name                      B  H_q H_kv  S_q   S_k   d_qk d_v   positions             dense           cap  layout
    {"none_mha",               { 2,  2,  2,    64,   65,   64,  64}, no_mask(),            Dense::kNone,    0.0, kC},
    {"none_single_key",        { 1,  4,  1,     1,    1,   16,  24}, no_mask(),            Dense::kNone,    2.5, kT},
    {"causal_long",            { 1,  1,  1,  1000, 1031,   16,   8}, causal(),             Dense::kNone,    0.0, kC},
    {"causal_more_queries",    { 1, 16,  1,    64,   63,  128,  64}, causal(),             Dense::kNone,    5.0, kT},
    {"causal_d192",            { 2,  8,  2,     7,   65,  192,  64}, causal(),             Dense::kNone,    0.0, kC},
    {"causal_top_left",        { 1,  4,  1,    64, 1031,   16,  32}, causal_at(0, 0),      Dense::kNone,    0.0, kC},
    {"causal_offsets",         { 1,  4,  4,     7,   64,   16,  16}, causal_at(100, 60),   Dense::kNone,    3.0, kT},
    {"window_long",            { 1,  1,  1,  1000, 1031,   16,   8}, causal(37),           Dense::kNone,    0.0, kC},
    {"window_gqa16",           { 1, 16,  1,    64,   65,   64, 128}, causal(64),           Dense::kNone,    4.0, kC},
    {"prefix_causal",          { 1,  4,  1,    64,   65,  192,  64}, causal({}, 20),       Dense::kNone,    0.0, kT},
    {"prefix_window",          { 1,  2,  1,    64, 1031,   16,  16}, prefix_window(),      Dense::kNone,    1.5, kC},
    {"boolean",                { 2,  4,  1,    64,   63,   64,  48}, no_mask(),            Dense::kBoolean, 5.0, kC},
    {"boolean_causal_decode",  { 1,  4,  4,     7, 1031,   16,  16}, causal(),             Dense::kBoolean, 0.0, kT},
    {"bias_decode",            { 1,  4,  4,     7, 1031,   16,  16}, no_mask(),            Dense::kBias,    0.0, kC},
    {"bias_window",            { 2, 16,  1,    64,   64,  128,  32}, causal(20),           Dense::kBias,    2.0, kC},
    {"decode_gqa4",            { 1,  8,  2,     1, 1031,  128,  64}, causal(),             Dense::kNone,    0.0, kT},
    {"decode_one_head",        { 1,  1,  1,     1, 1031,   64,  32}, causal(),             Dense::kNone,    0.0, kC},
    {"decode_gqa8_window",     { 1,  8,  1,     1, 1031,   16,  24}, causal(300),          Dense::kBias,    1.0, kC},
  };
  // clang-format on
}

/// Gives the problem the case's position rule, softcap and dense mask or bias.
template <class Scalar>
void apply_case(const Case& c, Problem<Scalar>& p) {
  place(p, c.positions);
  p.params.softcap = c.softcap;
  if (c.dense == Dense::kBoolean) p.add_dense_mask(c.shape.batch, c.shape.q_heads, 0.7);
  if (c.dense == Dense::kBias) p.add_bias(1, c.shape.q_heads, 0.1);
}

template <class Scalar>
void check_case(const Case& c, std::uint32_t seed,
                const std::optional<apex::detail::FlashBlocking>& blocking = std::nullopt) {
  Problem<Scalar> p(c.shape, c.layout, seed, Values::kNormal);
  apply_case(c, p);
  Outputs<Scalar> fast(c.shape, c.layout);
  Outputs<Scalar> ref(c.shape, c.layout);
  run_fast(p, fast, blocking);
  run_reference(p, ref);
  expect_same_outputs(fast, ref, c.name);
  SCOPED_TRACE(c.name);
  expect_matches_loops(p, fast, /*with_lse=*/true);
}

TYPED_TEST(SdpaFast, EqualsReferenceOnEveryMaskKind) {
  std::uint32_t seed = 100;
  for (const Case& c : cases()) check_case<TypeParam>(c, ++seed);
}

// The same table with small blocks (Bq = 16 / G, Bk = 16, streaming blocks of 8 keys, decoding
// in chunks of 40 keys), so that every case crosses many block boundaries and decodes in many
// chunks.
TYPED_TEST(SdpaFast, EqualsReferenceWithSmallBlocks) {
  apex::detail::FlashBlocking small;
  small.stacked_rows = 16;
  small.key_block = 16;
  small.stream_key_block = 8;
  small.decode_chunk = 40;
  std::uint32_t seed = 200;
  for (const Case& c : cases()) {
    if (c.shape.s_q * c.shape.s_k > 100000) continue;  // the long cases add nothing here
    check_case<TypeParam>(c, ++seed, small);
  }
}

// The two inner kernels on every case: Eigen's GEMM kernel everywhere (stream_rows = 0), then
// the streaming kernel everywhere (by default it only takes M = G·Bq ≤ 8 stacked rows).
TYPED_TEST(SdpaFast, EachKernelEqualsReference) {
  for (const Index stream_rows : {Index{0}, Index{1} << 20}) {
    apex::detail::FlashBlocking blocks;
    blocks.stream_rows = stream_rows;
    SCOPED_TRACE(stream_rows == 0 ? "GEMM kernel" : "streaming kernel");
    std::uint32_t seed = 400;
    for (const Case& c : cases()) {
      if (c.shape.s_q * c.shape.s_k > 20000) continue;  // keeps the sanitizer build quick
      check_case<TypeParam>(c, ++seed, blocks);
    }
  }
}

// Window edges exactly on block boundaries: W ∈ {Bk − 1, Bk, Bk + 1, 2·Bk}, query blocks aligned
// with key blocks, S a multiple of the blocks and not. classify_block must say kAll / kNone only
// when every pair agrees.
TYPED_TEST(SdpaFast, WindowEdgesOnBlockBoundaries) {
  apex::detail::FlashBlocking blocks;
  blocks.stacked_rows = 16;  // G = 1: Bq = 16
  blocks.key_block = 16;
  for (const Index s : {Index{96}, Index{101}}) {
    for (const Index w : {Index{15}, Index{16}, Index{17}, Index{32}}) {
      for (const Index prefix : {Index{0}, Index{16}}) {
        const Case c{
            "window_on_block_edge", {1, 1, 1, s, s, 16, 8}, causal(w, prefix), Dense::kNone, 0.0,
            Layout::kContiguous};
        SCOPED_TRACE("S = " + std::to_string(s) + ", W = " + std::to_string(w) +
                     ", P = " + std::to_string(prefix));
        check_case<TypeParam>(c, static_cast<std::uint32_t>(s * 100 + w + prefix), blocks);
      }
    }
  }
  // The default blocks (G = 4: Bq = 64, Bk = 64) with W = Bk.
  const Case c{
      "window_64_default_blocks", {1, 4, 1, 256, 256, 64, 64}, causal(64), Dense::kNone, 0.0,
      Layout::kContiguous};
  check_case<TypeParam>(c, 31);
}

// Lengths that fill no block and widths that fill no SIMD packet (odd: d_qk = 21, d_v = 13), for
// every group size and both inner kernels.
TYPED_TEST(SdpaFast, LengthsNotMultiplesOfTheBlocks) {
  for (const Index stream_rows : {Index{0}, Index{1} << 20}) {
    apex::detail::FlashBlocking blocks;
    blocks.stacked_rows = 24;
    blocks.key_block = 10;
    blocks.stream_key_block = 10;
    blocks.stream_rows = stream_rows;
    for (const Index group : {Index{1}, Index{4}, Index{16}}) {
      for (const Index s_q : {Index{1}, Index{53}}) {
        const Case c{"odd_lengths", {1, group, 1, s_q, 47, 21, 13},
                     causal(),      Dense::kNone,
                     0.0,           Layout::kContiguous};
        SCOPED_TRACE("G = " + std::to_string(group) + ", S_q = " + std::to_string(s_q) +
                     (stream_rows == 0 ? ", GEMM kernel" : ", streaming kernel"));
        check_case<TypeParam>(c, static_cast<std::uint32_t>(group + s_q), blocks);
      }
    }
  }
}

// ---- rows with no allowed key -------------------------------------------------------------------
TYPED_TEST(SdpaFast, FullyMaskedRowsGiveZerosAndMinusInfinity) {
  using Scalar = TypeParam;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Shape shape{1, 4, 2, 70, 65, 16, 8};
  Problem<Scalar> p(shape, Layout::kContiguous, 7, Values::kNormal);
  place(p, causal());  // S_q > S_k: rows 0..4 sit at positions -5..-1
  p.add_dense_mask(shape.batch, shape.q_heads, 0.9);
  for (Index j = 0; j < shape.s_k; ++j) {
    p.allowed_rows(0, 1)(10, j) = false;  // head 1, row 10
  }
  p.add_bias(1, shape.q_heads, 0.0);
  for (Index j = 0; j < shape.s_k; ++j) {
    p.bias_rows(0, 3)(40, j) = kNegInf;  // head 3, row 40
  }
  Outputs<Scalar> fast(shape, Layout::kContiguous);
  Outputs<Scalar> ref(shape, Layout::kContiguous);
  run_fast(p, fast);
  run_reference(p, ref);
  expect_same_outputs(fast, ref, "fully masked rows");
  expect_matches_loops(p, fast, /*with_lse=*/true);
  const auto expect_empty = [&](Index h, Index i) {
    EXPECT_TRUE(fast.out.view().head(0, h).row(i).isZero(0.0)) << "head " << h << ", row " << i;
    EXPECT_EQ(fast.lse.view().head(0, h)(i, 0), kNegInf) << "head " << h << ", row " << i;
  };
  for (Index h = 0; h < shape.q_heads; ++h) {
    for (Index i = 0; i < 5; ++i) expect_empty(h, i);
  }
  expect_empty(1, 10);
  expect_empty(3, 40);
  EXPECT_FALSE(fast.out.view().head(0, 0).row(10).isZero(0.0));

  // Decoding with every key after the query: all chunks empty, the merge must give zeros.
  const Shape one{1, 4, 1, 1, 5000, 16, 8};
  Problem<Scalar> d(one, Layout::kContiguous, 8, Values::kNormal);
  place(d, causal_at(0, 1));
  Outputs<Scalar> out(one, Layout::kContiguous);
  run_fast(d, out);
  for (std::size_t i = 0; i < out.out.size(); ++i) EXPECT_EQ(out.out.at(i), Scalar(0));
  for (std::size_t i = 0; i < out.lse.size(); ++i) EXPECT_EQ(out.lse.at(i), kNegInf);
}

// ---- log-sum-exp --------------------------------------------------------------------------------
TYPED_TEST(SdpaFast, LogSumExpEqualsReference) {
  using Scalar = TypeParam;
  for (const bool softcap : {false, true}) {
    const Shape shape{1, 4, 2, 130, 200, 64, 32};
    Problem<Scalar> p(shape, Layout::kTokenMajor, softcap ? 9 : 10, Values::kNormal);
    place(p, causal(50, 12));
    p.params.softcap = softcap ? 3.0 : 0.0;
    p.params.scale = 0.3;
    Outputs<Scalar> fast(shape, Layout::kTokenMajor);
    Outputs<Scalar> ref(shape, Layout::kTokenMajor);
    run_fast(p, fast);
    run_reference(p, ref);
    expect_same_outputs(fast, ref, softcap ? "lse with softcap" : "lse");
    expect_matches_loops(p, fast, /*with_lse=*/true);
  }
}

// ---- decoding: S_q = 1 against 5000 keys, split in chunks of 512 and merged ---------------------
TYPED_TEST(SdpaFast, DecodingSplitOverChunksEqualsReference) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 1, 1, 5000, 64, 64};
  const Positions masks[] = {no_mask(), causal(), causal(700, 16), causal_at(2500, 0)};
  std::uint32_t seed = 300;
  for (const Positions& positions : masks) {
    Problem<Scalar> p(shape, Layout::kContiguous, ++seed, Values::kNormal);
    place(p, positions);
    Outputs<Scalar> fast(shape, Layout::kContiguous);
    Outputs<Scalar> ref(shape, Layout::kContiguous);
    run_fast(p, fast);
    run_reference(p, ref);
    expect_same_outputs(fast, ref, "decode, mask " + std::to_string(seed - 300));
    expect_matches_loops(p, fast, /*with_lse=*/true);
  }
}

// ---- non-finite input: the policy documented on apex::sdpa
// ---------------------------------------

/// The kernels a policy test runs: the default blocks, small blocks (many boundaries and decode
/// chunks), Eigen's GEMM kernel everywhere and the streaming kernel everywhere.
std::vector<std::pair<const char*, std::optional<apex::detail::FlashBlocking>>> kernels() {
  apex::detail::FlashBlocking small;
  small.stacked_rows = 16;
  small.key_block = 16;
  small.stream_key_block = 8;
  small.decode_chunk = 40;
  apex::detail::FlashBlocking gemm;
  gemm.stream_rows = 0;
  apex::detail::FlashBlocking streaming;
  streaming.stream_rows = Index{1} << 20;
  return {
      {"default", std::nullopt}, {"small blocks", small}, {"GEMM", gemm}, {"streaming", streaming}};
}

/// Poisons key j of (batch 0, key/value head 0): NaN in its key (so every row that sees it has
/// a NaN score) or only in one value column. Then, on every kernel: the rows that see the key
/// are NaN (the whole row, or that column), and every other row equals the clean reference.
template <class Scalar>
void check_poisoned_key(const Case& c, Index j, bool poison_key, std::uint32_t seed) {
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  Problem<Scalar> p(c.shape, c.layout, seed, Values::kNormal);
  apply_case(c, p);
  Outputs<Scalar> clean(c.shape, c.layout);
  run_reference(p, clean);
  if (poison_key) p.k.view().head(0, 0)(j, 0) = nan;
  p.v.view().head(0, 0)(j, c.shape.d_v - 1) = nan;
  const double tol = Tolerances<Scalar>::kAttentionRow;  // O(1) values: a normwise bound
  for (const auto& [name, blocking] : kernels()) {
    Outputs<Scalar> got(c.shape, c.layout);
    run_fast(p, got, blocking);
    for (Index b = 0; b < c.shape.batch; ++b) {
      for (Index h = 0; h < c.shape.q_heads; ++h) {
        const Index kv_head = apex_test::kv_head_of(h, c.shape.q_heads, c.shape.kv_heads);
        for (Index i = 0; i < c.shape.s_q; ++i) {
          const auto row = got.out.view().head(b, h).row(i);
          const auto ref = clean.out.view().head(b, h).row(i);
          const Scalar lse = got.lse.view().head(b, h)(i, 0);
          const bool hit = b == 0 && kv_head == 0 && p.sees(b, h, i, j);
          SCOPED_TRACE(std::string(c.name) + ", " + name + ", key " + std::to_string(j) + ", b " +
                       std::to_string(b) + " h " + std::to_string(h) + " row " + std::to_string(i));
          if (hit && poison_key) {
            ASSERT_TRUE(row.array().isNaN().all()) << row;
            ASSERT_TRUE(std::isnan(lse));
          } else if (hit) {
            ASSERT_TRUE(std::isnan(row(c.shape.d_v - 1))) << row;
            const Index d = c.shape.d_v - 1;
            ASSERT_TRUE(row.head(d).allFinite()) << row;
            ASSERT_LE((row.head(d).template cast<double>() - ref.head(d).template cast<double>())
                          .cwiseAbs()
                          .maxCoeff(),
                      tol);
          } else {
            ASSERT_TRUE(row.allFinite() && !std::isnan(lse)) << row;  // lse = -inf: no key
            ASSERT_LE(
                (row.template cast<double>() - ref.template cast<double>()).cwiseAbs().maxCoeff(),
                tol);
          }
        }
      }
    }
  }
}

// A NaN or ±inf in a key or value reaches exactly the rows that may see that key: never the rows
// a causal, window, prefix, boolean or -inf-bias mask hides it from (0·NaN would, through a
// weight of exp(-inf) = 0), never other heads or batches. Every case of the table, a key in the
// middle and the last key, on every kernel.
TYPED_TEST(SdpaFast, NonFiniteKeysAndValuesReachOnlyTheRowsThatSeeThem) {
  std::uint32_t seed = 500;
  for (const Case& c : cases()) {
    if (c.shape.s_q * c.shape.s_k > 70000) continue;
    for (const Index j : {c.shape.s_k / 2, c.shape.s_k - 1}) {
      check_poisoned_key<TypeParam>(c, j, /*poison_key=*/true, ++seed);
      check_poisoned_key<TypeParam>(c, j, /*poison_key=*/false, ++seed);
    }
  }
}

// A NaN in one query row makes that row NaN (out and lse) and no other.
TYPED_TEST(SdpaFast, NaNQueryPoisonsOnlyItsRow) {
  using Scalar = TypeParam;
  for (const Case& c : cases()) {
    if (c.shape.s_q * c.shape.s_k > 70000) continue;
    Problem<Scalar> p(c.shape, c.layout, 600, Values::kNormal);
    place(p, c.positions);
    if (c.dense == Dense::kBias) p.add_bias(1, c.shape.q_heads, 0.1);
    Outputs<Scalar> clean(c.shape, c.layout);
    run_reference(p, clean);
    const Index row = c.shape.s_q - 1;
    p.q.view().head(0, 0)(row, 0) = std::numeric_limits<Scalar>::quiet_NaN();
    const bool sees_any = [&] {
      for (Index j = 0; j < c.shape.s_k; ++j) {
        if (p.sees(0, 0, row, j)) return true;
      }
      return false;
    }();
    for (const auto& [name, blocking] : kernels()) {
      SCOPED_TRACE(std::string(c.name) + ", " + name);
      Outputs<Scalar> got(c.shape, c.layout);
      run_fast(p, got, blocking);
      for (Index b = 0; b < c.shape.batch; ++b) {
        for (Index h = 0; h < c.shape.q_heads; ++h) {
          for (Index i = 0; i < c.shape.s_q; ++i) {
            const auto out = got.out.view().head(b, h).row(i);
            if (b == 0 && h == 0 && i == row && sees_any) {
              ASSERT_TRUE(out.array().isNaN().all()) << out;
              ASSERT_TRUE(std::isnan(got.lse.view().head(b, h)(i, 0)));
            } else {
              ASSERT_EQ(out.allFinite(), true) << "b " << b << " h " << h << " row " << i;
            }
          }
        }
      }
    }
  }
}

// Logits far from 0 (±1e4, ±1e30) give the correctly rounded softmax: the maximum is subtracted
// before exp, so nothing overflows, and a logit 2e30 below the maximum weighs exactly 0. q = 0
// makes every score the bias exactly, so the plain loop on the stored logits, in double, gives
// the expected weights.
TYPED_TEST(SdpaFast, ExtremeLogitsGiveTheExactSoftmax) {
  using Scalar = TypeParam;
  const Shape shape{1, 1, 1, 1, 6, 4, 3};
  for (const double big : {1e4, 1e30}) {
    Problem<Scalar> p(shape, Layout::kContiguous, 31, Values::kNormal);
    p.q.view().head(0, 0).setZero();
    p.add_bias(1, 1, 0.0);
    const double logits[] = {big, big, big - 1.0, -big, 0.0, big - 2.0};
    for (Index j = 0; j < shape.s_k; ++j) p.bias(0, j) = static_cast<Scalar>(logits[j]);
    const double max_logit = static_cast<double>(p.bias.maxCoeff());
    const apex_test::AttentionResult expected = p.expected(0, 0);
    for (const auto& [name, blocking] : kernels()) {
      SCOPED_TRACE(std::string(name) + ", logits of " + std::to_string(big));
      Outputs<Scalar> got(shape, Layout::kContiguous);
      run_fast(p, got, blocking);
      for (Index c = 0; c < shape.d_v; ++c) {
        EXPECT_NEAR(static_cast<double>(got.out.view().head(0, 0)(0, c)), expected.out(0, c),
                    Tolerances<Scalar>::kAttention);
      }
      EXPECT_NEAR(static_cast<double>(got.lse.view().head(0, 0)(0, 0)), expected.lse(0),
                  Tolerances<Scalar>::kAttention * max_logit);
    }
  }
}

// Soft-capping with an additive -inf mask: the cap bounds the scores, the -inf still forbids (it
// is added after the cap), a forbidden key's NaN value stays out, and a row whose every key is
// -inf gives zeros on every kernel.
TYPED_TEST(SdpaFast, MinusInfinityBiasWithSoftcap) {
  using Scalar = TypeParam;
  const Shape shape{1, 2, 1, 9, 40, 16, 8};
  Problem<Scalar> p(shape, Layout::kContiguous, 21, Values::kNormal);
  p.params.softcap = 2.0;
  p.params.scale = 10.0;  // scores of size 10, capped at 2
  p.add_bias(1, shape.q_heads, 0.3);
  for (Index j = 0; j < shape.s_k; ++j) {
    p.bias_rows(0, 1)(4, j) = -std::numeric_limits<Scalar>::infinity();
  }
  // NaN in the values of keys hidden from every row of head 0, row 0.
  for (Index j = 0; j < shape.s_k; ++j) {
    if (!p.sees(0, 0, 0, j)) p.v.view().head(0, 0)(j, 0) = std::numeric_limits<Scalar>::quiet_NaN();
  }
  Outputs<Scalar> ref(shape, Layout::kContiguous);
  run_reference(p, ref);
  ASSERT_TRUE(ref.out.view().head(0, 0).row(0).allFinite());
  for (const auto& [name, blocking] : kernels()) {
    SCOPED_TRACE(name);
    Outputs<Scalar> got(shape, Layout::kContiguous);
    run_fast(p, got, blocking);
    EXPECT_TRUE(got.out.view().head(0, 0).row(0).allFinite());
    EXPECT_LE((got.out.view().head(0, 0).row(0).template cast<double>() -
               ref.out.view().head(0, 0).row(0).template cast<double>())
                  .cwiseAbs()
                  .maxCoeff(),
              Tolerances<Scalar>::kAttentionRow);
    EXPECT_TRUE(got.out.view().head(0, 1).row(4).isZero(0.0));
    EXPECT_EQ(got.lse.view().head(0, 1)(4, 0), -std::numeric_limits<Scalar>::infinity());
  }
}

// merge_attention keeps a NaN row NaN, rather than dropping it beside a side with no keys.
TYPED_TEST(SdpaFast, MergeKeepsNaNRows) {
  using Scalar = TypeParam;
  using Rows = apex::RowMatrix<Scalar>;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Scalar neg_inf = -std::numeric_limits<Scalar>::infinity();
  Rows a = Rows::Ones(2, 3);
  Rows b = Rows::Zero(2, 3);
  apex::Vector<Scalar> lse_a(2), lse_b(2);
  lse_a << nan, Scalar(0.5);
  lse_b << neg_inf, nan;
  a(0, 0) = nan;
  Rows out(2, 3);
  apex::Vector<Scalar> lse(2);
  apex::merge_attention(a, lse_a, b, lse_b, out, lse);
  EXPECT_TRUE(out.array().isNaN().all()) << out;
  EXPECT_TRUE(lse.array().isNaN().all()) << lse;
}

// ---- threads ------------------------------------------------------------------------------------
// The output must be bit-identical whatever the number of threads: the tasks and the order of
// every reduction are fixed by the shapes alone.
TYPED_TEST(SdpaFast, ThreadCountDoesNotChangeResults) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: apex runs on one thread";
#else
  using Scalar = TypeParam;
  const int saved = omp_get_max_threads();
  const Case runs[] = {
      {"prefill", {1, 8, 2, 300, 300, 64, 64}, causal(), Dense::kNone, 0.0, Layout::kContiguous},
      {"one_task", {1, 4, 1, 40, 500, 64, 64}, causal(), Dense::kNone, 0.0, Layout::kContiguous},
      {"decode", {1, 8, 2, 1, 5000, 64, 64}, causal(), Dense::kNone, 0.0, Layout::kContiguous},
      {"decode_keys_major",
       {1, 16, 1, 1, 5000, 192, 64},
       causal(),
       Dense::kNone,
       0.0,
       Layout::kContiguous},
  };
  for (const Case& c : runs) {
    Problem<Scalar> p(c.shape, c.layout, 11, Values::kNormal);
    place(p, c.positions);
    Outputs<Scalar> one(c.shape, c.layout);
    Outputs<Scalar> two(c.shape, c.layout);
    omp_set_num_threads(1);
    run_fast(p, one);
    omp_set_num_threads(2);
    run_fast(p, two);
    omp_set_num_threads(saved);
    EXPECT_EQ(std::memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(Scalar)), 0)
        << c.name;
    EXPECT_EQ(std::memcmp(one.lse.data(), two.lse.data(), one.lse.size() * sizeof(Scalar)), 0)
        << c.name;
  }
#endif
}

// ---- tiles of few rows, and values inside the keys ----------------------------------------------
// A GEMM-path tile of at most one panel of rows computes its scores keys-major on apex's float
// kernels (tile_products.hpp, KEYS-MAJOR SCORES), and values that are the first columns of the
// key rows are read from the key block that the scores read (VALUES INSIDE THE KEYS). Neither
// may change a bit: each score and each output is the same chain of multiply-adds as on the
// panel path, and the same values are read.

/// out and lse of the fast kernel in float over K and V stored as T, with `blocking`.
template <class T>
std::pair<apex::HeadsTensor<float>, apex::HeadsTensor<float>> fast_float(
    const apex::HeadsTensor<float>& q, const HeadsView<const T>& k, const HeadsView<const T>& v,
    const apex::AttentionMask<float>& mask, const apex::SdpaParams& params,
    const apex::detail::FlashBlocking& blocking) {
  apex::HeadsTensor<float> out({q.batch(), q.heads(), q.seq(), v.dim()});
  apex::HeadsTensor<float> lse({q.batch(), q.heads(), q.seq(), 1});
  apex::detail::flash_sdpa<float, T, T, float, float>(q.view(), k, v, mask, params, out.view(),
                                                      lse.view(), {}, blocking);
  return {std::move(out), std::move(lse)};
}

/// Elements of a tensor.
Index elements(const apex::HeadsTensor<float>& t) {
  return t.batch() * t.heads() * t.seq() * t.dim();
}

/// Whether two results hold the same bits.
void expect_same_bits(const apex::HeadsTensor<float>& a, const apex::HeadsTensor<float>& b,
                      const std::string& what) {
  ASSERT_EQ(elements(a), elements(b)) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(elements(a))), 0) << what;
}

/// Tiles of 16 and of 10 rows (keys-major: apex's float kernels have panels of 16 or 32 rows)
/// against tiles of 48 and 40 rows of the same problem, which take the panel path where d_qk =
/// 40 and are keys-major too, over two or three panels of rows, where d_qk = 80: the same bits,
/// for float and half K/V (read in place and widened), under a window, soft-capping and a causal
/// diagonal that cut key blocks, d_v = 48.
template <class T>
void expect_keys_major_bits(std::uint32_t seed, Index d_qk) {
  struct Tiles {
    Index q_heads, kv_heads, s_q, few_rows;
  };
  for (const Tiles& t : {Tiles{16, 1, 3, 16}, Tiles{2, 2, 40, 10}}) {
    const Index s_k = 300, d_v = 48;
    const auto q = apex::testing::random_heads<float>(1, t.q_heads, t.s_q, d_qk, seed, -2.0, 2.0);
    const auto k = apex::testing::random_heads<T>(1, t.kv_heads, s_k, d_qk, seed + 1, -2.0, 2.0);
    const auto v = apex::testing::random_heads<T>(1, t.kv_heads, s_k, d_v, seed + 2);
    apex::AttentionMask<float> mask;
    mask.positions = apex::sliding_window_mask(100);
    apex::SdpaParams params;
    params.softcap = 2.0;
    apex::detail::FlashBlocking few;
    few.stacked_rows = t.few_rows;  // G·Bq = few_rows
    const auto [out_few, lse_few] = fast_float<T>(q, k.view(), v.view(), mask, params, few);
    const auto [out_many, lse_many] = fast_float<T>(q, k.view(), v.view(), mask, params, {});
    const std::string what =
        std::to_string(t.q_heads) + " query heads, S_q = " + std::to_string(t.s_q) +
        ", d_qk = " + std::to_string(d_qk) + ", " + apex::testing::ScalarName::GetName<T>(0);
    expect_same_bits(out_few, out_many, "out, " + what);
    expect_same_bits(lse_few, lse_many, "lse, " + what);
  }
}

TEST(SdpaFastTiles, KeysMajorTilesKeepThePanelPathsBits) {
  const apex::detail::FloatKernels* simd = apex::detail::float_kernels();
  if (simd == nullptr) GTEST_SKIP() << "keys-major scores run on apex's float kernels only";
  ASSERT_GE(simd->panel, 16);  // a tile of 16 rows is keys-major
  ASSERT_LE(simd->panel, 32);  // a tile of 40 rows is not, unless d_qk > 40
  for (const Index d_qk : {Index{40}, Index{80}}) {
    expect_keys_major_bits<float>(31, d_qk);
    expect_keys_major_bits<Eigen::half>(32, d_qk);
  }
}

/// Absorbed MLA's shape: keys are whole rows [c_kv ‖ K_rope], values the first d_kv columns of
/// the same rows. Read once for both products, they give the bits of values stored apart, on
/// every path (streaming: 4 rows; keys-major: 16 and 16·3 rows; panels: 16·4 rows, as many as
/// d_qk; keys split in chunks at S_q = 1), for float and half rows; and a key that no query may
/// see keeps its NaN to itself.
template <class T>
void expect_values_inside_keys_bits(std::uint32_t seed) {
  const Index s_k = 1100, d_kv = 48, width = 64;
  apex::HeadsTensor<T> rows = apex::testing::random_heads<T>(1, 1, s_k, width, seed);
  rows.data()[(s_k - 3) * width + 5] = T(std::numeric_limits<float>::quiet_NaN());
  apex::HeadsTensor<T> apart({1, 1, s_k, d_kv});
  for (Index j = 0; j < s_k; ++j) {
    std::copy_n(rows.data() + j * width, d_kv, apart.data() + j * d_kv);
  }
  const HeadsView<const T> keys = rows.view();
  const HeadsView<const T> inside(rows.data(), {1, 1, s_k, d_kv}, {0, 0, width});
  for (const auto& [q_heads, s_q] :
       {std::pair{Index{4}, Index{1}}, std::pair{Index{16}, Index{1}},
        std::pair{Index{16}, Index{3}}, std::pair{Index{16}, Index{4}}}) {
    const auto q = apex::testing::random_heads<float>(1, q_heads, s_q, width, seed + 1);
    apex::AttentionMask<float> mask;  // the last 3 keys lie in every query's future
    mask.positions = apex::causal_mask();
    mask.positions.query_offset = s_k - 3 - s_q;
    const auto [out_in, lse_in] = fast_float<T>(q, keys, inside, mask, {}, {});
    const auto [out_apart, lse_apart] = fast_float<T>(q, keys, apart.view(), mask, {}, {});
    const std::string what = std::to_string(q_heads) +
                             " query heads, S_q = " + std::to_string(s_q) + ", " +
                             apex::testing::ScalarName::GetName<T>(0);
    expect_same_bits(out_in, out_apart, "out, " + what);
    expect_same_bits(lse_in, lse_apart, "lse, " + what);
    EXPECT_TRUE(Eigen::Map<const Eigen::ArrayXf>(out_in.data(), elements(out_in)).allFinite())
        << what;
  }
}

TEST(SdpaFastTiles, ValuesInsideTheKeysKeepTheirBits) {
  expect_values_inside_keys_bits<float>(41);
  expect_values_inside_keys_bits<Eigen::half>(42);
}

// ---- errors -------------------------------------------------------------------------------------
// apex::sdpa checks everything before the kernel writes anything.
TYPED_TEST(SdpaFast, RejectsBadInputBeforeWriting) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 3, 8, 8, 16, 16};  // 4 query heads over 3 key/value heads
  Problem<Scalar> p(shape, Layout::kContiguous, 12, Values::kNormal);
  Outputs<Scalar> o(shape, Layout::kContiguous);
  for (std::size_t i = 0; i < o.out.size(); ++i) o.out.at(i) = Scalar(42);
  try {
    run_fast(p, o);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[sdpa] num_q_heads (4)"), std::string::npos) << e.what();
  }
  for (std::size_t i = 0; i < o.out.size(); ++i) ASSERT_EQ(o.out.at(i), Scalar(42));
}

}  // namespace
}  // namespace sdpa_fast_test
