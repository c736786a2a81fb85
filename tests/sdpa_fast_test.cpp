// SPDX-License-Identifier: MIT
// Tests of the tiled kernel behind apex::sdpa (include/apex/detail/flash_attention.hpp): on random
// inputs it must equal the oracle apex::reference::sdpa for every kind of mask, sequence lengths
// that do and do not fill its blocks, several head widths and group sizes, float and double, with
// and without soft-capping; its decoding path (keys split in chunks, then merged) must too; and
// its result must not depend on the number of threads.
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
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using apex::AttentionMask;
using apex::HeadsView;
using apex::Index;
using apex::PositionMask;
using apex::SdpaParams;

// ---- tolerances: the only place they are set ----------------------------------------------------
// Normwise: max |fast − reference| ≤ kRelative · max |reference| over a whole output; for the
// log-sum-exp, ≤ kRelative · max(1, max |lse|) (an absolute error δ in a log is a relative error δ
// in the sum it stands for). The reference works in double whatever the scalar, so the error
// measured is the fast kernel's own arithmetic: O(1) scores from dot products of up to 192 terms,
// an exp per score and sums of up to 1031 terms, a few units of the last place each.
// A wrong mask, head, scale or merge moves results by 1e-3 or more.
template <class Scalar>
struct Tolerance;
template <>
struct Tolerance<float> {
  // float: ε = 6e-8, so 1e-5 leaves ~170 ε for the accumulated rounding.
  static constexpr double kRelative = 1e-5;
};
template <>
struct Tolerance<double> {
  // double: ε = 1.1e-16, so 1e-12 leaves ~10^4 ε; the float bound scaled the same way.
  static constexpr double kRelative = 1e-12;
};

template <class Scalar>
class SdpaFast : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SdpaFast, Scalars);

// ---- [B, H, S, D] storage in either layout ------------------------------------------------------
enum class Layout { kContiguous, kTokenMajor };

template <class T>
class Heads {
 public:
  Heads(Index batch, Index heads, Index seq, Index dim, Layout layout = Layout::kContiguous)
      : size_(static_cast<std::size_t>(batch * heads * seq * dim)), storage_(new T[size_]()) {
    view_ = layout == Layout::kContiguous
                ? HeadsView<T>::contiguous(data(), batch, heads, seq, dim)
                : HeadsView<T>::token_major(data(), batch, seq, heads, dim);
  }

  const HeadsView<T>& view() const { return view_; }
  T* data() { return storage_.get(); }
  std::size_t size() const { return size_; }
  T& at(std::size_t i) { return storage_[i]; }
  const T& at(std::size_t i) const { return storage_[i]; }

 private:
  std::size_t size_;
  std::unique_ptr<T[]> storage_;  // not std::vector, which has no data() for bool
  HeadsView<T> view_;
};

template <class Scalar>
void fill_normal(Heads<Scalar>& t, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (std::size_t i = 0; i < t.size(); ++i) t.at(i) = static_cast<Scalar>(dist(rng));
}

// ---- one attention problem ----------------------------------------------------------------------
enum class Dense { kNone, kBoolean, kBias };

struct Shape {
  Index batch, q_heads, kv_heads, s_q, s_k, d_qk, d_v;
};

PositionMask no_mask() { return {}; }
PositionMask causal(std::optional<Index> window = std::nullopt, Index prefix = 0) {
  PositionMask m;
  m.causal = true;
  m.window = window;
  m.prefix = prefix;
  return m;
}
PositionMask causal_at(Index query_offset, Index key_offset) {
  PositionMask m = causal();
  m.query_offset = query_offset;
  m.key_offset = key_offset;
  return m;
}

// Causal with a window of 70 and a prefix of 150, queries at 100..163: the first 50 see every
// key of the prefix (later ones included), the others their window only.
PositionMask prefix_window() {
  PositionMask m = causal(70, 150);
  m.query_offset = 100;
  return m;
}

template <class Scalar>
struct Problem {
  Problem(const Shape& s, Layout layout, std::uint32_t seed)
      : shape(s),
        q(s.batch, s.q_heads, s.s_q, s.d_qk, layout),
        k(s.batch, s.kv_heads, s.s_k, s.d_qk, layout),
        v(s.batch, s.kv_heads, s.s_k, s.d_v, layout),
        rng(seed) {
    fill_normal(q, rng);
    fill_normal(k, rng);
    fill_normal(v, rng);
  }

  /// A random [B, H_q, S_q, S_k] boolean mask (true with probability p_true).
  void add_boolean(double p_true) {
    allowed.emplace(shape.batch, shape.q_heads, shape.s_q, shape.s_k);
    std::bernoulli_distribution dist(p_true);
    for (std::size_t i = 0; i < allowed->size(); ++i) allowed->at(i) = dist(rng);
    mask.allowed = allowed->view();
  }
  /// A random [1, H_q, S_q, S_k] bias (shared by the batch), -inf with probability p_forbid.
  void add_bias(double p_forbid) {
    bias.emplace(1, shape.q_heads, shape.s_q, shape.s_k);
    std::uniform_real_distribution<double> value(-2.0, 2.0);
    std::bernoulli_distribution forbid(p_forbid);
    for (std::size_t i = 0; i < bias->size(); ++i) {
      bias->at(i) =
          forbid(rng) ? -std::numeric_limits<Scalar>::infinity() : static_cast<Scalar>(value(rng));
    }
    mask.bias = bias->view();
  }

  Shape shape;
  Heads<Scalar> q, k, v;
  std::mt19937 rng;
  std::optional<Heads<bool>> allowed;
  std::optional<Heads<Scalar>> bias;
  AttentionMask<Scalar> mask;
  SdpaParams params;
};

template <class Scalar>
struct Outputs {
  Outputs(const Shape& s, Layout layout)
      : out(s.batch, s.q_heads, s.s_q, s.d_v, layout), lse(s.batch, s.q_heads, s.s_q, 1) {}
  Heads<Scalar> out, lse;
};

/// Runs apex::sdpa (the fast kernel) or, with `blocking`, the kernel with other block sizes.
template <class Scalar>
void run_fast(const Problem<Scalar>& p, Outputs<Scalar>& o,
              const std::optional<apex::detail::FlashBlocking>& blocking = std::nullopt) {
  if (!blocking) {
    apex::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.mask, p.params, o.out.view(),
                       o.lse.view());
    return;
  }
  apex::detail::check_sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.mask, p.params,
                                   o.out.view(), o.lse.view(), "sdpa");
  apex::detail::flash_sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.mask.positions,
                                   p.mask.allowed, p.mask.bias,
                                   apex::detail::softmax_scale(p.params, p.shape.d_qk),
                                   p.params.softcap, o.out.view(), o.lse.view(), *blocking);
}

template <class Scalar>
void run_reference(const Problem<Scalar>& p, Outputs<Scalar>& o) {
  apex::reference::sdpa<Scalar>(p.q.view(), p.k.view(), p.v.view(), p.mask, p.params, o.out.view(),
                                o.lse.view());
}

/// Compares fast and reference outputs with the tolerance of the scalar type; -inf log-sum-exps
/// (rows with no allowed key) must match exactly.
template <class Scalar>
void expect_matches(const Outputs<Scalar>& fast, const Outputs<Scalar>& ref,
                    const std::string& what) {
  const double tol = Tolerance<Scalar>::kRelative;
  double max_ref = 0.0;
  double max_diff = 0.0;
  for (std::size_t i = 0; i < ref.out.size(); ++i) {
    const double r = static_cast<double>(ref.out.at(i));
    const double f = static_cast<double>(fast.out.at(i));
    ASSERT_TRUE(std::isfinite(f)) << what << ": output element " << i << " is " << f;
    max_ref = std::max(max_ref, std::abs(r));
    max_diff = std::max(max_diff, std::abs(f - r));
  }
  EXPECT_LE(max_diff, tol * max_ref) << what << ": max |ref| = " << max_ref;

  double max_lse = 1.0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    const double r = static_cast<double>(ref.lse.at(i));
    if (std::isfinite(r)) max_lse = std::max(max_lse, std::abs(r));
  }
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    const double r = static_cast<double>(ref.lse.at(i));
    const double f = static_cast<double>(fast.lse.at(i));
    if (!std::isfinite(r)) {
      ASSERT_EQ(f, r) << what << ": lse element " << i;
    } else {
      ASSERT_NEAR(f, r, tol * max_lse) << what << ": lse element " << i;
    }
  }
}

// ---- the table of cases -------------------------------------------------------------------------
struct Case {
  const char* name;
  Shape shape;
  PositionMask positions;
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

template <class Scalar>
void check_case(const Case& c, std::uint32_t seed,
                const std::optional<apex::detail::FlashBlocking>& blocking = std::nullopt) {
  Problem<Scalar> p(c.shape, c.layout, seed);
  p.mask.positions = c.positions;
  p.params.softcap = c.softcap;
  if (c.dense == Dense::kBoolean) p.add_boolean(0.7);
  if (c.dense == Dense::kBias) p.add_bias(0.1);
  Outputs<Scalar> fast(c.shape, c.layout);
  Outputs<Scalar> ref(c.shape, c.layout);
  run_fast(p, fast, blocking);
  run_reference(p, ref);
  expect_matches(fast, ref, c.name);
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
  Problem<Scalar> p(shape, Layout::kContiguous, 7);
  p.mask.positions = causal();  // S_q > S_k: rows 0..4 sit at positions -5..-1
  p.add_boolean(0.9);
  for (Index j = 0; j < shape.s_k; ++j) {
    p.allowed->view().head(0, 1)(10, j) = false;  // head 1, row 10
  }
  p.add_bias(0.0);
  for (Index j = 0; j < shape.s_k; ++j) {
    p.bias->view().head(0, 3)(40, j) = kNegInf;  // head 3, row 40
  }
  Outputs<Scalar> fast(shape, Layout::kContiguous);
  Outputs<Scalar> ref(shape, Layout::kContiguous);
  run_fast(p, fast);
  run_reference(p, ref);
  expect_matches(fast, ref, "fully masked rows");
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
  Problem<Scalar> d(one, Layout::kContiguous, 8);
  d.mask.positions = causal_at(0, 1);
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
    Problem<Scalar> p(shape, Layout::kTokenMajor, softcap ? 9 : 10);
    p.mask.positions = causal(50, 12);
    p.params.softcap = softcap ? 3.0 : 0.0;
    p.params.scale = 0.3;
    Outputs<Scalar> fast(shape, Layout::kTokenMajor);
    Outputs<Scalar> ref(shape, Layout::kTokenMajor);
    run_fast(p, fast);
    run_reference(p, ref);
    expect_matches(fast, ref, softcap ? "lse with softcap" : "lse");
  }
}

// ---- decoding: S_q = 1 against 5000 keys, split in chunks of 512 and merged ---------------------
TYPED_TEST(SdpaFast, DecodingSplitOverChunksEqualsReference) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 1, 1, 5000, 64, 64};
  const PositionMask masks[] = {no_mask(), causal(), causal(700, 16), causal_at(2500, 0)};
  std::uint32_t seed = 300;
  for (const PositionMask& positions : masks) {
    Problem<Scalar> p(shape, Layout::kContiguous, ++seed);
    p.mask.positions = positions;
    Outputs<Scalar> fast(shape, Layout::kContiguous);
    Outputs<Scalar> ref(shape, Layout::kContiguous);
    run_fast(p, fast);
    run_reference(p, ref);
    expect_matches(fast, ref, "decode, mask " + std::to_string(seed - 300));
  }
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
  };
  for (const Case& c : runs) {
    Problem<Scalar> p(c.shape, c.layout, 11);
    p.mask.positions = c.positions;
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

// ---- errors -------------------------------------------------------------------------------------
// apex::sdpa checks everything before the kernel writes anything.
TYPED_TEST(SdpaFast, RejectsBadInputBeforeWriting) {
  using Scalar = TypeParam;
  const Shape shape{1, 4, 3, 8, 8, 16, 16};  // 4 query heads over 3 key/value heads
  Problem<Scalar> p(shape, Layout::kContiguous, 12);
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
