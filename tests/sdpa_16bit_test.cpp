// SPDX-License-Identifier: MIT
// apex::sdpa on 16-bit inputs and outputs (Eigen::half, Eigen::bfloat16), accumulated in float.
//
// The 16-bit path is exact apart from the rounding of the stored values, which these tests show
// three ways:
//   - widening is exact and the arithmetic is the float kernel's, so sdpa on 16-bit K/V (or Q, K
//     and V) is bit-identical to sdpa on float tensors that hold the same (rounded) values, for
//     every mask, group, length and soft-cap, non-finite values included;
//   - against the double loops of reference/attention.hpp on those rounded values it is within
//     the float tolerance of the float path (Tolerances<float>::kAttention);
//   - a 16-bit output is the float output rounded once.
// Against the float path on the unrounded values, the error is that of rounding every stored
// element once; Sdpa16Bit.ErrorOfStoringKAndVIsBounded states the bound measured for each type.
// The products of layers with 16-bit weights (detail/matmul.hpp), which share the streaming
// products, are checked here too (Widening16Bit).
// tests/CMakeLists.txt builds this file three times: for the default target (16-bit rows widened
// before the streaming products), for AVX2 + F16C and for AVX-512 (widened in registers).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 reports -Wmaybe-uninitialized (and, at -O1, -Wuninitialized) inside its own AVX-512
// intrinsic headers, whose _mm512_undefined_* values are uninitialised on purpose, when Eigen's
// kernels are inlined (the sdpa_16bit_avx512_test build; fixed in GCC 13). The pragmas must
// precede them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <apex/detail/matmul.hpp>
#include <apex/sdpa.hpp>
#include <apex/storage.hpp>

#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"

namespace sdpa_16bit_test {
namespace {

using apex::Index;
using apex::SdpaParams;
using apex::testing::Heads;
using apex::testing::Layout;
using apex::testing::Outputs;
using apex::testing::Problem;
using apex::testing::Shape;

/// Rounds every element of `from` to T, in place (so that `from` then holds exactly the values
/// a T tensor can), and returns the T copy, in the same layout.
template <class T>
Heads<T> round_in_place(Heads<float>& from, Layout layout) {
  Heads<T> to(from.batch(), from.heads(), from.seq(), from.dim(), layout);
  for (std::size_t i = 0; i < from.size(); ++i) {
    to.at(i) = apex::round_to<T>(from.at(i));
    from.at(i) = static_cast<float>(to.at(i));
  }
  return to;
}

/// The spacing of T at 1: 2^-10 for half, 2^-7 for bfloat16 (Eigen 3.4's epsilon() for half
/// says 2^-13).
template <class T>
float epsilon() {
  return std::is_same_v<T, Eigen::half> ? 0x1p-10f : 0x1p-7f;
}

/// A copy of a float tensor (same layout).
Heads<float> copy_of(const Heads<float>& from) {
  Heads<float> to(from.batch(), from.heads(), from.seq(), from.dim());
  for (std::size_t i = 0; i < from.size(); ++i) to.at(i) = from.at(i);
  return to;
}

template <class T>
bool same_bits(const Heads<T>& a, const Heads<T>& b) {
  return a.size() == b.size() && std::memcmp(&a.at(0), &b.at(0), a.size() * sizeof(T)) == 0;
}

/// The masks every test runs: none, causal, a window, a prefix, a dense mask and a bias.
enum class MaskKind { kNone, kCausal, kWindow, kPrefix, kDense, kBias };
constexpr MaskKind kMaskKinds[] = {MaskKind::kNone,   MaskKind::kCausal, MaskKind::kWindow,
                                   MaskKind::kPrefix, MaskKind::kDense,  MaskKind::kBias};

void apply(MaskKind kind, Problem<float>& p) {
  switch (kind) {
    case MaskKind::kNone:
      break;
    case MaskKind::kCausal:
      p.rule.causal = true;
      break;
    case MaskKind::kWindow:
      p.rule.causal = true;
      p.rule.window = 23;
      break;
    case MaskKind::kPrefix:
      p.rule.causal = true;
      p.rule.prefix = 5;
      break;
    case MaskKind::kDense:
      p.add_dense_mask(1, p.shape.q_heads, 0.6);
      break;
    case MaskKind::kBias:
      p.add_bias(p.shape.batch, 1, 0.1);
      break;
  }
}

std::string describe(MaskKind kind, const Shape& s, double softcap) {
  return "mask " + std::to_string(static_cast<int>(kind)) + ", " + apex::testing::describe(s) +
         ", softcap " + std::to_string(softcap);
}

/// One problem of the sweep: float Q, random K and V rounded to T; S_k not a multiple of any
/// block, d_v ≠ d_qk.
template <class T>
struct Case16 {
  Case16(const Shape& s, MaskKind kind, double softcap, std::uint32_t seed)
      : p(s, Layout::kContiguous, seed, apex::testing::Values::kNormal),
        k16(round_in_place<T>(p.k, Layout::kContiguous)),
        v16(round_in_place<T>(p.v, Layout::kContiguous)) {
    apply(kind, p);
    p.params.softcap = softcap;
  }
  Problem<float> p;
  Heads<T> k16, v16;
};

/// The shapes of the sweep: S_q ∈ {1, 7, 64} for every group, and 1000 queries once.
std::vector<Shape> sweep_shapes() {
  std::vector<Shape> shapes;
  for (const Index s_q : {1, 7, 64}) {
    for (const Index group : {1, 4}) shapes.push_back({2, 2 * group, 2, s_q, s_q + 101, 24, 40});
  }
  shapes.push_back({1, 2, 1, 1000, 1037, 16, 24});
  return shapes;
}

template <class T>
class Sdpa16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Sdpa16Bit, SixteenBit, apex::testing::ScalarName);

// Float Q, 16-bit K and V: bit for bit the float call on the same values, and within the float
// tolerance of the double loops.
TYPED_TEST(Sdpa16Bit, KeysAndValuesMatchTheReferenceOnTheRoundedValues) {
  using T = TypeParam;
  std::uint32_t seed = 1;
  for (const Shape& s : sweep_shapes()) {
    for (const MaskKind kind : kMaskKinds) {
      for (const double softcap : {0.0, 2.5}) {
        SCOPED_TRACE(describe(kind, s, softcap));
        Case16<T> c(s, kind, softcap, seed++);
        Outputs<float> got(s), want(s);
        got.fill(12345.0f);
        want.fill(12345.0f);
        const auto mask = c.p.attention_mask();
        apex::sdpa(c.p.q.view(), c.k16.view(), c.v16.view(), mask, c.p.params, got.out.view(),
                   got.lse.view());
        apex::sdpa<float>(c.p.q.view(), c.p.k.view(), c.p.v.view(), mask, c.p.params,
                          want.out.view(), want.lse.view());
        EXPECT_TRUE(same_bits(got.out, want.out)) << "out differs from the float path";
        EXPECT_TRUE(same_bits(got.lse, want.lse)) << "lse differs from the float path";
        apex::testing::expect_matches_loops(c.p, got, true);
      }
    }
  }
}

// Q, K and V in 16 bits, output in float and in 16 bits: the 16-bit output is the float output
// rounded once; the reference takes the same mixed types.
TYPED_TEST(Sdpa16Bit, EveryInputAndTheOutputIn16Bits) {
  using T = TypeParam;
  std::uint32_t seed = 100;
  for (const MaskKind kind : kMaskKinds) {
    const Shape s{2, 4, 2, 7, 300, 24, 40};
    Case16<T> c(s, kind, kind == MaskKind::kWindow ? 3.0 : 0.0, seed++);
    const Heads<T> q16 = round_in_place<T>(c.p.q, Layout::kContiguous);
    const auto mask = c.p.attention_mask();
    Outputs<float> got(s);
    apex::sdpa(q16.view(), c.k16.view(), c.v16.view(), mask, c.p.params, got.out.view(),
               got.lse.view());
    apex::testing::expect_matches_loops(c.p, got, true);
    Heads<T> out16(s.batch, s.q_heads, s.s_q, s.d_v), lse16(s.batch, s.q_heads, s.s_q, 1);
    apex::sdpa(q16.view(), c.k16.view(), c.v16.view(), mask, c.p.params, out16.view(),
               lse16.view());
    Heads<T> ref16(s.batch, s.q_heads, s.s_q, s.d_v);
    apex::reference::sdpa(q16.view(), c.k16.view(), c.v16.view(), mask, c.p.params, ref16.view());
    int differ = 0;
    for (std::size_t i = 0; i < out16.size(); ++i) {
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(out16.at(i)),
                Eigen::numext::bit_cast<std::uint16_t>(apex::round_to<T>(got.out.at(i))))
          << "element " << i;
      // The reference rounds its double result: the same value but where float and double
      // straddle a rounding boundary, then one step apart.
      const float a = static_cast<float>(out16.at(i));
      const float r = static_cast<float>(ref16.at(i));
      if (a != r) {
        ++differ;
        EXPECT_LE(std::abs(a - r), std::abs(r) * 0x1p-6f) << "element " << i;
      }
    }
    EXPECT_LE(differ, static_cast<int>(out16.size() / 50)) << "16-bit outputs one step apart";
    for (std::size_t i = 0; i < lse16.size(); ++i) {
      // The lse is rounded from double: within a step of T of the float lse.
      const float a = static_cast<float>(lse16.at(i));
      const float r = got.lse.at(i);
      if (!std::isfinite(r)) {
        EXPECT_EQ(a, r) << "lse " << i;
      } else {
        EXPECT_LE(std::abs(a - r), std::abs(r) * epsilon<T>())
            << "lse " << i << ": " << a << " against " << r << ", mask " << static_cast<int>(kind);
      }
    }
  }
}

// A 16-bit infinity is an infinity and a 16-bit NaN a NaN: the non-finite policy holds as on
// float inputs, bit for bit.
TYPED_TEST(Sdpa16Bit, NonFiniteValuesFollowThePolicyAsInFloat) {
  using T = TypeParam;
  const Shape s{1, 2, 1, 5, 70, 8, 8};
  Case16<T> c(s, MaskKind::kCausal, 0.0, 7);
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const auto poison = [&](Heads<T>& t16, Heads<float>& t, Index row, Index col, float value) {
    const std::size_t i = static_cast<std::size_t>(row * t.dim() + col);
    t16.at(i) = static_cast<T>(value);
    t.at(i) = value;
  };
  poison(c.k16, c.p.k, 3, 1, kInf);    // a key at +inf: a NaN or infinite score
  poison(c.k16, c.p.k, 10, 0, -kInf);  // and one at -inf
  poison(c.v16, c.p.v, 20, 2, kNaN);   // a NaN value
  poison(c.v16, c.p.v, 69, 5, kInf);   // an infinite value, seen only by the last query
  const auto mask = c.p.attention_mask();
  Outputs<float> got(s), want(s);
  apex::sdpa(c.p.q.view(), c.k16.view(), c.v16.view(), mask, c.p.params, got.out.view(),
             got.lse.view());
  apex::sdpa<float>(c.p.q.view(), c.p.k.view(), c.p.v.view(), mask, c.p.params, want.out.view(),
                    want.lse.view());
  EXPECT_TRUE(same_bits(got.out, want.out));
  EXPECT_TRUE(same_bits(got.lse, want.lse));
  int non_finite = 0;
  for (std::size_t i = 0; i < got.out.size(); ++i)
    non_finite += std::isfinite(got.out.at(i)) ? 0 : 1;
  EXPECT_GT(non_finite, 0) << "the poisoned keys and values must show";
}

/// The bound on the normwise relative error of storing K and V in T (stated in docs/guide.md):
/// the largest error measured over the 100 problems below was 7.0e-4 for half and 7.4e-3 for
/// bfloat16 (about 1.4 units of the rounding of one element, 2^-11 and 2^-8); the bounds are
/// about twice that.
template <class T>
double storage_error_bound();
template <>
double storage_error_bound<Eigen::half>() {
  return 1.5e-3;
}
template <>
double storage_error_bound<Eigen::bfloat16>() {
  return 1.5e-2;
}

// Against the float path on the unrounded values: max |out_T − out_float| / max |out_float|
// over 100 random problems (normal Q, K, V; d = 64; causal and not; a group of 2).
TYPED_TEST(Sdpa16Bit, ErrorOfStoringKAndVIsBounded) {
  using T = TypeParam;
  double worst = 0.0;
  for (std::uint32_t seed = 0; seed < 100; ++seed) {
    const Shape s{1, 4, 2, 16, 200 + seed, 64, 64};
    Problem<float> p(s, Layout::kContiguous, 1000 + seed, apex::testing::Values::kNormal);
    p.rule.causal = seed % 2 == 0;
    Heads<float> k = copy_of(p.k), v = copy_of(p.v);
    const Heads<T> k16 = round_in_place<T>(k, Layout::kContiguous);
    const Heads<T> v16 = round_in_place<T>(v, Layout::kContiguous);
    Outputs<float> exact(s), stored(s);
    const auto mask = p.attention_mask();
    apex::sdpa<float>(p.q.view(), p.k.view(), p.v.view(), mask, p.params, exact.out.view());
    apex::sdpa(p.q.view(), k16.view(), v16.view(), mask, p.params, stored.out.view());
    double max_ref = 0.0, max_err = 0.0;
    for (std::size_t i = 0; i < exact.out.size(); ++i) {
      max_ref = std::max(max_ref, std::abs(double(exact.out.at(i))));
      max_err = std::max(max_err, std::abs(double(stored.out.at(i)) - exact.out.at(i)));
    }
    worst = std::max(worst, max_err / max_ref);
  }
  std::cout << "max normwise relative error of "
            << (std::is_same_v<T, Eigen::half> ? "half" : "bfloat16")
            << " K/V over 100 problems: " << worst << "\n";
  EXPECT_LE(worst, storage_error_bound<T>());
  EXPECT_GT(worst, 0.0) << "rounding K and V must change something";
}

// The products behind 16-bit weights equal the product of the widened weight to the float
// tolerance of a dot product (1e-5 of the largest output, as for float weights in
// DecodeTyped.FewRowProjectionsAreSplitIntoFixedBlocks), for few rows (streamed) and more
// (widened panel by panel), either orientation, depths that are no multiple of any block, and
// strided operands; bit-identical for one and two threads; scratch within its documented bounds
// (the streamed x·wᵀ allocates none where the weights are widened in registers).
template <class T>
class Widening16Bit : public ::testing::Test {};
TYPED_TEST_SUITE(Widening16Bit, SixteenBit, apex::testing::ScalarName);

TYPED_TEST(Widening16Bit, ProductsEqualTheProductOfTheWidenedWeight) {
  using T = TypeParam;
  using apex::RowMatrix;
  using apex::testing::random_matrix;
  namespace d = apex::detail;
  constexpr Index kCols = 2100;  // two stream strips, five tiles
  const auto panel = static_cast<std::size_t>(d::kPanelDepth * d::kTileCols) * sizeof(float);
  for (const Index rows : {Index{1}, Index{3}, Index{8}, Index{9}, Index{130}}) {
    for (const Index depth : {Index{1}, Index{5}, Index{300}, Index{1030}}) {
      const std::string shape = std::to_string(rows) + " x " + std::to_string(depth);
      const RowMatrix<float> x_wide =
          random_matrix<float>(rows, depth + 3, static_cast<std::uint32_t>(181 + rows));
      const apex::ConstRowRef<float> x(x_wide.leftCols(depth));
      const RowMatrix<T> w = apex::converted<T>(
          random_matrix<float>(depth, kCols, static_cast<std::uint32_t>(182 + depth)));
      const RowMatrix<T> w_t = w.transpose();
      const Eigen::MatrixXd expected = x.template cast<double>() * apex::converted<double>(w);
      const double tol = 1e-5 * expected.cwiseAbs().maxCoeff();
      RowMatrix<float> out_wide = RowMatrix<float>::Constant(rows, kCols + 5, 7.0f);
      d::matmul<float>(x, w, out_wide.leftCols(kCols));
      EXPECT_LE((out_wide.leftCols(kCols).template cast<double>() - expected).cwiseAbs().maxCoeff(),
                tol)
          << shape;
      EXPECT_TRUE((out_wide.rightCols(5).array() == 7.0f).all()) << shape << ": outside out";
      RowMatrix<float> transposed = d::matmul_transposed<float>(x, w_t);
      EXPECT_LE((transposed.template cast<double>() - expected).cwiseAbs().maxCoeff(), tol)
          << shape << ", transposed";

      const apex::testing::OneThread one_thread;
      const auto scratch_of = [](const auto& product) {
        apex::release_scratch();
        product();
        return apex::scratch_bytes();
      };
      RowMatrix<float> plain(rows, kCols);
      const std::size_t plain_bytes = scratch_of([&] { d::matmul<float>(x, w, plain); });
      const std::size_t transposed_bytes =
          scratch_of([&] { d::matmul_transposed<float>(x, w_t, transposed); });
      if (rows > d::kStreamRows) {
        EXPECT_LE(plain_bytes, panel) << shape;
        EXPECT_LE(transposed_bytes, panel) << shape;
      } else {
        const std::size_t partials = static_cast<std::size_t>(std::max(
                                         d::kStreamPartials, rows * ((kCols + 15) / 16 * 16))) *
                                     sizeof(float);
        EXPECT_GT(plain_bytes, 0U) << shape;
        EXPECT_LE(plain_bytes, partials) << shape;
        if (apex::detail::kStreamsFrom<float, T>) {
          EXPECT_EQ(transposed_bytes, 0U) << shape << ": streamed in place";
        } else {
          EXPECT_LE(transposed_bytes, panel) << shape;
        }
      }
#ifdef _OPENMP
      omp_set_num_threads(2);
      EXPECT_EQ(plain, d::matmul<float>(x, w)) << shape << ": 1 and 2 threads";
      EXPECT_EQ(transposed, d::matmul_transposed<float>(x, w_t)) << shape << ": 1 and 2 threads";
#endif
    }
  }
}

}  // namespace
}  // namespace sdpa_16bit_test
