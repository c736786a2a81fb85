// SPDX-License-Identifier: MIT
// What allocates. The documentation promises that
//   - apex::sdpa keeps its scratch in per-thread buffers that grow on first use, so a second
//     call with the same shapes allocates nothing (prefill, the streaming kernel for a few rows,
//     split-key decoding with its partials on the calling thread);
//   - rms_norm (row-major x, contiguous γ) and apply_rope never allocate.
// Two counters see every allocation of this program:
//   - Eigen's heap allocations (matrices, vectors, product buffers, the kernel's scratch) go
//     through Eigen::internal::aligned_malloc, which calls std::malloc directly, not operator
//     new. With EIGEN_RUNTIME_NO_MALLOC every such call first asserts
//     Eigen::internal::is_malloc_allowed(); this file defines eigen_assert so that the failed
//     check is counted instead of aborting (any other failed Eigen assertion fails the test);
//   - everything else in C++ (std::vector, std::string, ...) goes through the global operator
//     new, replaced below by a counting one.
// (With OpenMP, the runtime's own thread pool is created with malloc on first use and is not
// counted: it is not apex's workspace.)
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>

namespace alloc_count {
std::atomic<bool> counting{false};
std::atomic<long> eigen_mallocs{0};
std::atomic<long> news{0};
std::atomic<long> other_eigen_assertions{0};

inline void eigen_assert_failed(const char* condition) {
  if (std::strstr(condition, "heap allocation is forbidden") != nullptr) {
    eigen_mallocs.fetch_add(1);
  } else {
    other_eigen_assertions.fetch_add(1);
  }
}
}  // namespace alloc_count

#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                                \
  do {                                                                 \
    if (!static_cast<bool>(x)) ::alloc_count::eigen_assert_failed(#x); \
  } while (false)

#include <apex/mask.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>

#include "test_util.hpp"

// ---- the counting global operator new ----------------------------------------------------------

namespace {
void* counted_new(std::size_t size) {
  if (alloc_count::counting.load(std::memory_order_relaxed)) alloc_count::news.fetch_add(1);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* counted_new_aligned(std::size_t size, std::align_val_t align) {
  if (alloc_count::counting.load(std::memory_order_relaxed)) alloc_count::news.fetch_add(1);
  const auto alignment = static_cast<std::size_t>(align);
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (void* p = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t size) { return counted_new(size); }
void* operator new[](std::size_t size) { return counted_new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return counted_new(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return counted_new(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t align) {
  return counted_new_aligned(size, align);
}
void* operator new[](std::size_t size, std::align_val_t align) {
  return counted_new_aligned(size, align);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using apex::AttentionMask;
using apex::HeadsTensor;
using apex::Index;
using apex::RowMatrix;
using apex::RowRef;
using apex::Vector;

struct Allocations {
  long eigen = 0;
  long news = 0;
};

/// Runs `call` with both counters on and returns what it allocated.
template <class Call>
Allocations count(Call&& call) {
  alloc_count::eigen_mallocs = 0;
  alloc_count::news = 0;
  Eigen::internal::set_is_malloc_allowed(false);
  alloc_count::counting = true;
  call();
  alloc_count::counting = false;
  Eigen::internal::set_is_malloc_allowed(true);
  return {alloc_count::eigen_mallocs.load(), alloc_count::news.load()};
}

class Allocation : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_EQ(alloc_count::other_eigen_assertions.load(), 0); }
};

TEST_F(Allocation, CountersSeeEigenAndOperatorNew) {
  // The test would prove nothing if the counters were blind.
  const Allocations eigen = count([] {
    Vector<float> v(1000);
    v.setZero();
    EXPECT_EQ(v.size(), 1000);
  });
  EXPECT_GE(eigen.eigen, 1);
  const Allocations cpp = count([] {
    // Stored to a volatile, the pointer escapes: the compiler may not elide the allocation
    // (clang removes a new/delete pair whose pointer nothing sees).
    static int* volatile escaped = nullptr;
    escaped = new int(3);
    delete escaped;
  });
  EXPECT_EQ(cpp.news, 1);
}

/// One sdpa configuration: shapes, mask, and whether the log-sum-exp is wanted.
struct Case {
  const char* name;
  Index batch, q_heads, kv_heads, s_q, s_k, d_qk, d_v;
  bool causal, dense_mask, bias, lse;
};

template <class Scalar>
void expect_second_call_allocates_nothing(const Case& c) {
  SCOPED_TRACE(c.name);
  const auto q = apex::testing::random_heads<Scalar>(c.batch, c.q_heads, c.s_q, c.d_qk, 1);
  const auto k = apex::testing::random_heads<Scalar>(c.batch, c.kv_heads, c.s_k, c.d_qk, 2);
  const auto v = apex::testing::random_heads<Scalar>(c.batch, c.kv_heads, c.s_k, c.d_v, 3);
  HeadsTensor<Scalar> out({c.batch, c.q_heads, c.s_q, c.d_v});
  HeadsTensor<Scalar> lse({c.batch, c.q_heads, c.s_q, 1});
  apex::BoolMatrix allowed = apex::BoolMatrix::Constant(c.s_q, c.s_k, true);
  for (Index i = 0; i < c.s_q; ++i) allowed(i, (i * 7) % c.s_k) = false;
  const RowMatrix<Scalar> bias = apex::testing::random_matrix<Scalar>(c.s_q, c.s_k, 4);
  AttentionMask<Scalar> mask;
  if (c.causal) mask.positions = apex::causal_mask();
  if (c.dense_mask) mask.allowed = apex::as_heads_view(allowed);
  if (c.bias) mask.bias = apex::as_heads_view(bias);
  const auto call = [&] {
    apex::sdpa<Scalar>(q.view(), k.view(), v.view(), mask, {}, out.view(),
                       c.lse ? lse.view() : apex::HeadsView<Scalar>());
  };
  call();  // grows this thread's (and the OpenMP workers') scratch to these shapes
  const Allocations second = count(call);
  EXPECT_EQ(second.eigen, 0) << "Eigen heap allocations in a repeated sdpa call";
  EXPECT_EQ(second.news, 0) << "operator new in a repeated sdpa call";
  const Allocations third = count(call);
  EXPECT_EQ(third.eigen + third.news, 0);
}

template <class Scalar>
class AllocationTyped : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_EQ(alloc_count::other_eigen_assertions.load(), 0); }
};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AllocationTyped, Scalars, apex::testing::ScalarName);

TYPED_TEST(AllocationTyped, SdpaRepeatedCallAllocatesNothing) {
  using Scalar = TypeParam;
  const Case cases[] = {
      // GEMM kernel, several query blocks, grouped heads, causal skipping.
      {"prefill", 2, 8, 2, 300, 300, 64, 48, true, false, false, true},
      // Dense mask and bias on every block.
      {"prefill with masks", 1, 4, 4, 70, 90, 32, 32, false, true, true, false},
      // A few stacked rows: the streaming kernel.
      {"streaming", 1, 4, 2, 3, 200, 40, 40, true, false, false, true},
      // One new token against a long cache: split-key decoding and its partials.
      {"decoding", 2, 8, 2, 1, 3000, 64, 64, true, false, false, true},
  };
  for (const Case& c : cases) expect_second_call_allocates_nothing<Scalar>(c);
}

TYPED_TEST(AllocationTyped, FirstCallOnAFreshThreadGrowsItsScratch) {
  // The other side of the promise, and proof that the counters see the kernel's scratch: a
  // thread that has never run sdpa allocates its buffers on its first call.
  using Scalar = TypeParam;
  const auto q = apex::testing::random_heads<Scalar>(1, 4, 64, 32, 1);
  const auto k = apex::testing::random_heads<Scalar>(1, 4, 64, 32, 2);
  HeadsTensor<Scalar> out({1, 4, 64, 32});
  Allocations first;
  std::thread fresh([&] {
    first = count([&] { apex::sdpa<Scalar>(q.view(), k.view(), k.view(), {}, {}, out.view()); });
  });
  fresh.join();
  EXPECT_GT(first.eigen, 0);
}

TYPED_TEST(AllocationTyped, SingleHeadSdpaRepeatedCallAllocatesNothing) {
  // The Eigen-matrix form on row-major inputs views them without copying.
  using Scalar = TypeParam;
  const RowMatrix<Scalar> q = apex::testing::random_matrix<Scalar>(37, 24, 1);
  const RowMatrix<Scalar> k = apex::testing::random_matrix<Scalar>(130, 24, 2);
  const RowMatrix<Scalar> v = apex::testing::random_matrix<Scalar>(130, 16, 3);
  RowMatrix<Scalar> out(37, 16);
  AttentionMask<Scalar> mask;
  mask.positions = apex::causal_mask();
  const auto call = [&] { apex::sdpa(q, k, v, mask, {}, RowRef<Scalar>(out)); };
  call();
  const Allocations second = count(call);
  EXPECT_EQ(second.eigen, 0);
  EXPECT_EQ(second.news, 0);
}

TYPED_TEST(AllocationTyped, RmsNormNeverAllocates) {
  using Scalar = TypeParam;
  // 300 x 1024 crosses the threshold at which rows are spread over threads.
  for (const Index d : {Index{7}, Index{1024}}) {
    const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(300, d, 1);
    const Vector<Scalar> gamma = apex::testing::random_matrix<Scalar>(d, 1, 2);
    RowMatrix<Scalar> out(300, d);
    RowMatrix<Scalar> in_place = x;
    const Allocations a = count([&] {
      apex::rms_norm(x, gamma, {}, RowRef<Scalar>(out));
      apex::rms_norm(in_place, gamma, {}, RowRef<Scalar>(in_place));
    });
    EXPECT_EQ(a.eigen, 0) << "d = " << d;
    EXPECT_EQ(a.news, 0) << "d = " << d;
  }
}

TYPED_TEST(AllocationTyped, ApplyRopeNeverAllocates) {
  using Scalar = TypeParam;
  for (const apex::RopePairing pairing :
       {apex::RopePairing::kInterleaved, apex::RopePairing::kHalfSplit}) {
    apex::RopeParams params;
    params.pairing = pairing;
    params.rotary_dim = 48;
    const apex::RopeTable<Scalar> table(1024, 64, params);
    // 512 rows of 8 heads: large enough to be spread over threads.
    RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(512, 8 * 64, 1);
    RowMatrix<Scalar> wide = apex::testing::random_matrix<Scalar>(5, 3 * 64 + 10, 2);
    Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1> ids(5);
    ids << 9, 3, 1000, 0, 77;
    const Allocations a = count([&] {
      apex::apply_rope(table, 100, RowRef<Scalar>(x));
      apex::apply_rope(table, ids, RowRef<Scalar>(wide.leftCols(3 * 64)));
    });
    EXPECT_EQ(a.eigen, 0);
    EXPECT_EQ(a.news, 0);
  }
}

}  // namespace
