// SPDX-License-Identifier: MIT
// apex::sdpa with SdpaParams::allow_bf16_products: the tiled kernel's GEMM path forms both
// products with bfloat16 factors on AVX512-BF16's dot products (detail/simd_kernels.hpp), sums
// in float, or on AMX's tiles.
//
// THE TOLERANCE. The kernel rounds Qs = scale·Q (in float), K and V to bfloat16 before their
// products, which the plain double loops can do too: they run here on those rounded values
// (scale 1, Qs in the place of Q). What they cannot see is the rounding of each weight P to
// bfloat16 before P·V, a relative error of at most u = 2^-8 per weight, so for every output
//   |out_ic − ref_ic| <= 2^-8 · Σ_j p_ij·|v_jc| / l_i  +  kAttention · max |ref|
// where the first term is the loops' own output on |V| (times 2^-8) and the second is the float
// kernel's normwise tolerance (tolerances.hpp). The scores are exact products summed in float, so
// lse is within kAttention of the loops on the rounded values.
//
// The same on AMX's tiles (KernelIsa::kAmx), whose tdpbf16ps sums the same rounded factors in
// float. Where the CPU lacks AVX512-BF16, or under another kernel level, the permission changes
// nothing: the results are the bits of the float kernel (checked on every level this CPU runs).
#include <apex/cpu.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>

#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"

namespace bf16_products_test {
namespace {

using apex::Index;
using apex::KernelIsa;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;
using apex::testing::Tolerances;
using apex::testing::Values;
using apex_test::MaskRule;

/// One problem of the table: the shape, the position rule, the soft-cap, the layout.
struct Case {
  const char* name;
  Shape shape;
  MaskRule rule;
  double softcap;
  Layout layout;
};

/// Every mask kind, groups of 1 to 16, lengths that fill no tile, d ∈ {16, 64, 128, 192, 576},
/// d_v ≠ d_qk, soft-capping, both layouts. Every tile is on the GEMM path: the default blocks
/// stack Bq = 256 / G query rows of the G heads, and the last block of each case keeps more than
/// 8 stacked rows (a tile of at most 8 streams its products, exactly).
std::vector<Case> cases() {
  const Layout kC = Layout::kContiguous;
  const Layout kT = Layout::kTokenMajor;
  // clang-format off
  return {
    //  name              B  H_q H_kv  S_q  S_k  d_qk d_v   causal W    P   C     cap  layout
    {"none",           { 2,  2,  2,   64,  65,  64,  64}, {false,  0,   0,  0},   0.0, kC},
    {"causal",         { 1,  8,  2,  300, 300, 128, 128}, {true,   0,   0,  0},   0.0, kT},
    {"causal_d16",     { 1,  4,  1,  131, 131,  16,  24}, {true,   0,   0,  0},   5.0, kC},
    {"window_gqa16",   { 1, 16,  1,   70,  97,  64, 128}, {true,  37,   0,  0},   0.0, kC},
    {"prefix",         { 1,  4,  1,   64,  65, 192,  64}, {true,   0,  20,  0},   3.0, kT},
    {"chunks",         { 1,  2,  1,  200, 200,  64,  32}, {true,   0,   0, 48},   0.0, kC},
    {"mla_d576",       { 1,  8,  1,   45,  45, 576, 512}, {true,   0,   0,  0},   0.0, kC},
    {"odd_widths",     { 1,  4,  2,   45,  77,  21,  13}, {false,  0,   0,  0},   2.0, kC},
  };
  // clang-format on
}

/// x rounded to bfloat16 and back.
float bf16(float x) { return static_cast<float>(Eigen::bfloat16(x)); }

/// The problem as the kernel's products see it: Qs = scale·Q rounded (with scale 1), K and V
/// rounded; with `absolute`, V is |V| (for the bound on the weights' rounding).
Problem<float> rounded(const Problem<float>& p, const Case& c, std::uint32_t seed, bool absolute) {
  Problem<float> r(c.shape, c.layout, seed, Values::kNormal);
  r.rule = p.rule;
  const auto scale = static_cast<float>(apex::detail::softmax_scale(p.params, c.shape.d_qk));
  for (std::size_t i = 0; i < r.q.size(); ++i) r.q.at(i) = bf16(p.q.at(i) * scale);
  for (std::size_t i = 0; i < r.k.size(); ++i) r.k.at(i) = bf16(p.k.at(i));
  for (std::size_t i = 0; i < r.v.size(); ++i) {
    r.v.at(i) = absolute ? std::abs(bf16(p.v.at(i))) : bf16(p.v.at(i));
  }
  r.params = p.params;
  r.params.scale = 1.0;
  return r;
}

/// Runs apex::sdpa on p into o.
void run(const Problem<float>& p, Outputs<float>& o) {
  apex::sdpa<float>(p.q.view(), p.k.view(), p.v.view(), p.attention_mask(), p.params, o.out.view(),
                    o.lse.view());
}

/// Whether two outputs hold the same bits.
bool same_bits(Outputs<float>& a, Outputs<float>& b) {
  return std::memcmp(a.out.data(), b.out.data(), sizeof(float) * a.out.size()) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), sizeof(float) * a.lse.size()) == 0;
}

/// Sets the kernel level for the lifetime of the object, then restores the one before.
class KernelLevel {
 public:
  explicit KernelLevel(KernelIsa isa) : saved_(apex::kernel_isa()) { apex::set_kernel_isa(isa); }
  KernelLevel(const KernelLevel&) = delete;
  KernelLevel& operator=(const KernelLevel&) = delete;
  ~KernelLevel() { apex::set_kernel_isa(saved_); }

 private:
  KernelIsa saved_;
};

/// The check of the top of this file for one case.
void check_case(const Case& c, std::uint32_t seed) {
  SCOPED_TRACE(c.name);
  Problem<float> p(c.shape, c.layout, seed, Values::kNormal);
  p.rule = c.rule;
  p.params.softcap = c.softcap;
  p.params.allow_bf16_products = true;
  Outputs<float> o(c.shape, c.layout);
  run(p, o);
  const Problem<float> r = rounded(p, c, seed, false);
  const Problem<float> r_abs = rounded(p, c, seed, true);
  const double tol = Tolerances<float>::kAttention;
  double max_ref = 0.0, max_lse = 1.0;
  for (Index b = 0; b < c.shape.batch; ++b) {
    for (Index h = 0; h < c.shape.q_heads; ++h) {
      const apex_test::AttentionResult ref = r.expected(b, h);
      max_ref = std::max(max_ref, ref.out.cwiseAbs().maxCoeff());
      for (Index i = 0; i < ref.lse.size(); ++i) {
        if (std::isfinite(ref.lse(i))) max_lse = std::max(max_lse, std::abs(ref.lse(i)));
      }
    }
  }
  double worst = 0.0;  // the largest error as a fraction of its bound
  for (Index b = 0; b < c.shape.batch; ++b) {
    for (Index h = 0; h < c.shape.q_heads; ++h) {
      const apex_test::AttentionResult ref = r.expected(b, h);
      const apex_test::AttentionResult weights = r_abs.expected(b, h);
      const apex_test::MatrixD out = o.out.head(b, h);
      const apex_test::MatrixD lse = o.lse.head(b, h);
      for (Index i = 0; i < out.rows(); ++i) {
        for (Index j = 0; j < out.cols(); ++j) {
          const double bound = 0x1p-8 * weights.out(i, j) + tol * max_ref;
          const double error = std::abs(out(i, j) - ref.out(i, j));
          worst = std::max(worst, error / bound);
          ASSERT_LE(error, bound) << "out of head (" << b << ", " << h << ") at (" << i << ", " << j
                                  << ")";
        }
        if (std::isfinite(ref.lse(i))) {
          ASSERT_NEAR(lse(i, 0), ref.lse(i), tol * max_lse) << "lse of head " << h << " row " << i;
        } else {
          ASSERT_EQ(lse(i, 0), ref.lse(i)) << "lse of head " << h << " row " << i;
        }
      }
    }
  }
  std::printf("%-10s %-14s largest error %.2f of its bound\n", apex::to_string(apex::kernel_isa()),
              c.name, worst);
}

/// The levels with bfloat16 products (AVX512-BF16's dot products, AMX's tiles) this CPU runs; a
/// level it lacks is named on stdout as not tested.
std::vector<KernelIsa> bf16_levels() {
  std::vector<KernelIsa> levels;
  for (const KernelIsa isa : {KernelIsa::kAvx512Bf16, KernelIsa::kAmx}) {
    if (apex::cpu_supports(isa)) {
      levels.push_back(isa);
    } else {
      std::printf("this CPU does not run level %s: its bfloat16 products are not tested\n",
                  apex::to_string(isa));
    }
  }
  return levels;
}

TEST(Bf16Products, WithinTheBoundOfRoundedFactorsOnEveryMaskKind) {
  const std::vector<KernelIsa> levels = bf16_levels();
  if (levels.empty()) {
    GTEST_SKIP() << "this CPU lacks AVX512-BF16: the bfloat16 products are not run";
  }
  for (const KernelIsa isa : levels) {
    SCOPED_TRACE(apex::to_string(isa));
    const KernelLevel level(isa);
    std::uint32_t seed = 700;
    for (const Case& c : cases()) check_case(c, ++seed);
  }
}

// The permission takes effect: on the bfloat16 level the products are rounded (the outputs differ
// from the float kernel's), and the result is bit-identical for 1 and 2 threads.
TEST(Bf16Products, RoundTheProductsAndGiveTheSameBitsForAnyThreadCount) {
  const std::vector<KernelIsa> levels = bf16_levels();
  if (levels.empty()) {
    GTEST_SKIP() << "this CPU lacks AVX512-BF16: the bfloat16 products are not run";
  }
  for (const KernelIsa isa : levels) {
    SCOPED_TRACE(apex::to_string(isa));
    const KernelLevel level(isa);
    const Case c = cases()[1];
    Problem<float> p(c.shape, c.layout, 11, Values::kNormal);
    p.rule = c.rule;
    Outputs<float> exact(c.shape, c.layout);
    run(p, exact);
    p.params.allow_bf16_products = true;
    Outputs<float> one(c.shape, c.layout);
    {
      const apex::testing::OneThread single;
      run(p, one);
    }
    Outputs<float> many(c.shape, c.layout);
#ifdef _OPENMP
    const int saved = omp_get_max_threads();
    omp_set_num_threads(2);
#endif
    run(p, many);
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    EXPECT_FALSE(same_bits(one, exact)) << "the bfloat16 products were not used";
    EXPECT_TRUE(same_bits(one, many)) << "1 and 2 threads differ";
  }
}

// K and V stored as bfloat16 are packed from their stored rows (in place, or copied where a block
// spans pages): the bits of float K and V that hold the same values, contiguous or paged.
TEST(Bf16Products, StoredBfloat16RowsGiveTheBitsOfTheirFloatValues) {
  const std::vector<KernelIsa> levels = bf16_levels();
  if (levels.empty()) {
    GTEST_SKIP() << "this CPU lacks AVX512-BF16: the bfloat16 products are not run";
  }
  for (const KernelIsa isa : levels) {
    SCOPED_TRACE(apex::to_string(isa));
    const KernelLevel level(isa);
    for (const Case& c : {cases()[1], cases()[7]}) {
      SCOPED_TRACE(c.name);
      Problem<float> p(c.shape, c.layout, 14, Values::kNormal);
      p.rule = c.rule;
      p.params.allow_bf16_products = true;
      for (std::size_t i = 0; i < p.k.size(); ++i) p.k.at(i) = bf16(p.k.at(i));
      for (std::size_t i = 0; i < p.v.size(); ++i) p.v.at(i) = bf16(p.v.at(i));
      Outputs<float> from_float(c.shape, c.layout);
      run(p, from_float);
      apex::testing::Heads<Eigen::bfloat16> k(c.shape.batch, c.shape.kv_heads, c.shape.s_k,
                                              c.shape.d_qk, c.layout);
      apex::testing::Heads<Eigen::bfloat16> v(c.shape.batch, c.shape.kv_heads, c.shape.s_k,
                                              c.shape.d_v, c.layout);
      for (std::size_t i = 0; i < k.size(); ++i) k.at(i) = Eigen::bfloat16(p.k.at(i));
      for (std::size_t i = 0; i < v.size(); ++i) v.at(i) = Eigen::bfloat16(p.v.at(i));
      Outputs<float> stored(c.shape, c.layout);
      apex::sdpa(p.q.view(), k.view(), v.view(), p.attention_mask(), p.params, stored.out.view(),
                 stored.lse.view());
      EXPECT_TRUE(same_bits(from_float, stored)) << "contiguous";
      if (c.shape.d_qk != c.shape.d_v || c.shape.batch != 1 || c.rule.chunk != 0) continue;
      for (const Index page : {3, 64}) {  // blocks across pages, and a page per block
        apex::PagedKvCache<float, Eigen::bfloat16> cache(
            {c.shape.kv_heads, c.shape.d_qk, page, c.shape.s_k / page + 1});
        const apex::SequenceId id = cache.add();
        cache.append(id, p.k.view(), p.v.view());
        Outputs<float> paged(c.shape, c.layout);
        apex::sdpa_paged(p.q.view(), {0, c.shape.s_q}, cache, {id}, {apex::causal_mask()}, p.params,
                         paged.out.view(), paged.lse.view());
        EXPECT_TRUE(same_bits(from_float, paged)) << "pages of " << page;
      }
    }
    // A block whose keys that take no part hold NaN values adds only the keys that take part: the
    // last 5 keys come after every query (top-left causal) and share a block with visible ones.
    Case c = cases()[1];
    c.shape.s_k = c.shape.s_q + 5;
    Problem<float> p(c.shape, c.layout, 15, Values::kNormal);
    p.rule = c.rule;
    p.query_offset = 0;
    p.params.allow_bf16_products = true;
    for (std::size_t i = 0; i < p.k.size(); ++i) p.k.at(i) = bf16(p.k.at(i));
    for (std::size_t i = 0; i < p.v.size(); ++i) p.v.at(i) = bf16(p.v.at(i));
    for (Index h = 0; h < c.shape.kv_heads; ++h) {
      p.v.head_map(0, h).bottomRows(5).setConstant(std::numeric_limits<float>::quiet_NaN());
    }
    apex::testing::Heads<Eigen::bfloat16> v(1, c.shape.kv_heads, c.shape.s_k, c.shape.d_v,
                                            c.layout);
    for (std::size_t i = 0; i < v.size(); ++i) v.at(i) = Eigen::bfloat16(p.v.at(i));
    Outputs<float> from_float(c.shape, c.layout), stored(c.shape, c.layout);
    run(p, from_float);
    apex::sdpa(p.q.view(), p.k.view(), v.view(), p.attention_mask(), p.params, stored.out.view(),
               stored.lse.view());
    EXPECT_TRUE(same_bits(from_float, stored)) << "NaN values of keys that take no part";
    // Rounded products, not a pass redone in double (which a NaN output would cause): the outputs
    // are finite and differ from the exact ones by the rounding of the weights.
    p.params.allow_bf16_products = false;
    Outputs<float> exact(c.shape, c.layout);
    run(p, exact);
    const apex_test::MatrixD rounded_out = stored.out.head(0, 0), exact_out = exact.out.head(0, 0);
    ASSERT_TRUE(rounded_out.allFinite());
    std::printf("largest difference from the exact outputs: %.2e\n",
                (rounded_out - exact_out).cwiseAbs().maxCoeff());
    EXPECT_GT((rounded_out - exact_out).cwiseAbs().maxCoeff(), 1e-4);
  }
}

// Elsewhere the permission changes nothing: on every other level this CPU runs, and on the
// streaming path (decoding: M = G·S_q <= 8 rows) of every level.
TEST(Bf16Products, ChangeNothingOnOtherLevelsAndWhenDecoding) {
  const Case c = cases()[1];
  std::vector<KernelIsa> levels;
  for (const KernelIsa isa : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (apex::cpu_supports(isa)) levels.push_back(isa);
  }
  for (const KernelIsa isa : levels) {
    const KernelLevel level(isa);
    Problem<float> p(c.shape, c.layout, 12, Values::kNormal);
    p.rule = c.rule;
    Outputs<float> exact(c.shape, c.layout), allowed(c.shape, c.layout);
    run(p, exact);
    p.params.allow_bf16_products = true;
    run(p, allowed);
    EXPECT_TRUE(same_bits(exact, allowed)) << apex::to_string(isa);
  }
  const Shape decode{1, 8, 2, 1, 1031, 128, 64};
  Problem<float> p(decode, Layout::kContiguous, 13, Values::kNormal);
  p.rule = MaskRule{true, 0, 0, 0};
  Outputs<float> exact(decode), allowed(decode);
  run(p, exact);
  p.params.allow_bf16_products = true;
  run(p, allowed);
  EXPECT_TRUE(same_bits(exact, allowed)) << "decoding";
}

}  // namespace
}  // namespace bf16_products_test
