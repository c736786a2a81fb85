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

#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/mask.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <utility>

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

/// The inputs and outputs of one sdpa call of a Case, built once so that the call can be made
/// (and counted) again and again.
template <class Scalar>
class SdpaCall {
 public:
  explicit SdpaCall(const Case& c)
      : c_(c),
        q_(apex::testing::random_heads<Scalar>(c.batch, c.q_heads, c.s_q, c.d_qk, 1)),
        k_(apex::testing::random_heads<Scalar>(c.batch, c.kv_heads, c.s_k, c.d_qk, 2)),
        v_(apex::testing::random_heads<Scalar>(c.batch, c.kv_heads, c.s_k, c.d_v, 3)),
        out_({c.batch, c.q_heads, c.s_q, c.d_v}),
        lse_({c.batch, c.q_heads, c.s_q, 1}),
        allowed_(apex::BoolMatrix::Constant(c.s_q, c.s_k, true)),
        bias_(apex::testing::random_matrix<Scalar>(c.s_q, c.s_k, 4)) {
    for (Index i = 0; i < c.s_q; ++i) allowed_(i, (i * 7) % c.s_k) = false;
    if (c.causal) mask_.positions = apex::causal_mask();
    if (c.dense_mask) mask_.allowed = apex::as_heads_view(allowed_);
    if (c.bias) mask_.bias = apex::as_heads_view(bias_);
  }
  void operator()() {
    apex::sdpa<Scalar>(q_.view(), k_.view(), v_.view(), mask_, {}, out_.view(),
                       c_.lse ? lse_.view() : apex::HeadsView<Scalar>());
  }

 private:
  Case c_;
  HeadsTensor<Scalar> q_, k_, v_, out_, lse_;
  apex::BoolMatrix allowed_;
  RowMatrix<Scalar> bias_;
  AttentionMask<Scalar> mask_;
};

/// Runs `body` on a new std::thread: its scratch, and that of the OpenMP team it starts, begins
/// empty whatever the tests before it did.
template <class Body>
void on_a_new_thread(Body&& body) {
  std::thread fresh(std::forward<Body>(body));
  fresh.join();
}

template <class Scalar>
class AllocationTyped : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_EQ(alloc_count::other_eigen_assertions.load(), 0); }
};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AllocationTyped, Scalars, apex::testing::ScalarName);

// ---- the promise of include/apex/detail/scratch.hpp (ALLOCATION), clause by clause -------------

TYPED_TEST(AllocationTyped, ExactPromise_SteadyStateCallAllocatesNothing) {
  // "any other request reuses it": a call repeated with its shapes allocates nothing.
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
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SdpaCall<Scalar> call(c);
    call();  // grows this thread's (and the OpenMP workers') scratch to these shapes
    const Allocations second = count(call);
    EXPECT_EQ(second.eigen, 0) << "Eigen heap allocations in a repeated sdpa call";
    EXPECT_EQ(second.news, 0) << "operator new in a repeated sdpa call";
    const Allocations third = count(call);
    EXPECT_EQ(third.eigen + third.news, 0);
  }
}

TYPED_TEST(AllocationTyped, ExactPromise_SmallerShapeAfterLargerDoesNotAllocate) {
  // The "in particular" of ALLOCATION: after a prefill whose tasks all take the GEMM path and a
  // split decode, of d_qk = d_v = 64 and 10 and 8 tasks (so on every thread of a team of up to
  // 8), no call of smaller shapes allocates, whatever its G, its S_k against the key blocks (64,
  // 512), its chunks or its lse. Before the tiles asked for their largest tile's buffers, G = 1
  // or 2 after G = 4 (more query rows per head) and 1536 keys after 2047 (3 chunks, not 2) did.
  using Scalar = TypeParam;
  const Case larger[] = {
      {"larger prefill", 2, 8, 2, 300, 300, 64, 64, true, false, false, true},
      // 2047 keys: 2 chunks of 1024 for each of 4 (b, kv head) pairs.
      {"larger decode", 2, 8, 2, 1, 2047, 64, 64, true, false, false, true},
  };
  const Case smaller[] = {
      // G = 1 after G = 4: Bq = 70 query rows where the larger call's tiles had 64.
      {"G = 1, S_k = 90, masks, no lse", 1, 4, 4, 70, 90, 64, 64, false, true, true, false},
      {"G = 2, S_k = 201", 2, 4, 2, 150, 201, 64, 64, true, false, false, true},
      {"one query and key fewer", 2, 8, 2, 299, 299, 64, 64, true, false, false, true},
      {"narrower heads, no lse", 1, 8, 2, 37, 130, 48, 40, true, false, false, false},
      {"streaming, 2 rows, S_k = 777", 1, 4, 2, 2, 777, 64, 64, true, false, false, true},
      // 1536 keys: 3 chunks of 512 per pair, more than the larger decode's 2.
      {"decode S_q = 1, more chunks", 2, 8, 2, 1, 1536, 64, 64, true, false, false, true},
      {"decode S_q = 1, G = 8, S_k = 1999", 1, 8, 1, 1, 1999, 32, 32, true, false, false, true},
      {"decode S_q = 1, not split, no lse", 1, 4, 4, 1, 1000, 64, 64, true, false, false, false},
  };
  on_a_new_thread([&] {
    for (const Case& c : larger) {
      SdpaCall<Scalar> call(c);
      call();
    }
    for (const Case& c : smaller) {
      SCOPED_TRACE(c.name);
      SdpaCall<Scalar> call(c);
      const Allocations first = count(call);
      EXPECT_EQ(first.eigen, 0) << "Eigen heap allocations in the first call of a smaller shape";
      EXPECT_EQ(first.news, 0) << "operator new in the first call of a smaller shape";
    }
  });
}

/// What scratch.hpp (ALLOCATION) says one task's tile asks for, in bytes of C, d_qk = d_v = d,
/// no ALiBi, K and V of type C, no bfloat16 products; and how many buffers that is.
template <class C>
std::pair<std::size_t, long> stated_tile(bool streaming, Index d) {
  const Index m = streaming ? 8 : 256, bk = streaming ? 512 : 64;
  const Index pad_bk = (bk + 15) / 16 * 16, pad_dv = (d + 15) / 16 * 16;
  // kQStacked, kScores, kPositionTile, kAcc, kRowStats, kRowScale
  Index scalars = m * d + 2 * m * pad_bk + m * pad_dv + 2 * m + m;
  long buffers = 6;
  if (!streaming) {
    scalars += bk * d + bk * d;  // kKCopy, kVCopy
    buffers += 2;
    const apex::detail::FloatKernels* simd =
        std::is_same_v<C, float> ? apex::detail::float_kernels() : nullptr;
    if (simd != nullptr) {
      scalars += (bk + simd->panel - 1) / simd->panel * simd->panel * d;  // kKPacked
      // kQPacked: Qsᵀ of the keys-major scores, d·pad(min(M, max(panel, d − 1)))
      scalars += d * ((std::min(m, std::max(simd->panel, d - 1)) + 15) / 16 * 16);
      buffers += 2;
    } else if (apex::detail::TileGemm<C>::kPacks) {
      scalars += m * d + bk * d + m * bk + bk * d;  // kQPacked, kKPacked, kPPacked, kVPacked
      buffers += 4;
    }
  }
  return {static_cast<std::size_t>(scalars) * sizeof(C), buffers};
}

/// The calling thread's kTaskFlags: one 4096-byte page up to 4096 tasks and merges.
constexpr std::size_t kFlagPage = 4096;

TYPED_TEST(AllocationTyped, ExactPromise_FirstCallOnANewThreadAllocatesTheStatedBuffers) {
  // "a thread starts with none", and the sizes of its buffers: one task (one (b, kv head) pair,
  // one query block), so the calling thread runs it, and the count is exact.
  using Scalar = TypeParam;
  for (const bool streaming : {false, true}) {
    SCOPED_TRACE(streaming ? "streaming, S_q = 1" : "GEMM path, M = 256");
    const Case c{"one task", 1, 4, 1, streaming ? 1 : 64, 300, 64, 64, true, false, false, true};
    const auto [tile_bytes, tile_buffers] = stated_tile<Scalar>(streaming, 64);
    on_a_new_thread([&, tile_bytes = tile_bytes, tile_buffers = tile_buffers] {
      SdpaCall<Scalar> call(c);
      EXPECT_EQ(apex::scratch_bytes(), 0U);
      const Allocations first = count(call);
      EXPECT_EQ(first.eigen, tile_buffers + 1) << "the tile's buffers and the task flags";
      EXPECT_EQ(first.news, 0);
      EXPECT_EQ(apex::scratch_bytes(), tile_bytes + kFlagPage);
      EXPECT_EQ(count(call).eigen, 0);
    });
  }
}

TYPED_TEST(AllocationTyped, ExactPromise_FirstSplitCallAllocatesTheWholePartialBudget) {
  // Split-key decoding: 3 chunks of 1024 keys of one pair, run on min(3, threads) threads, one
  // merge on the calling thread. Its partials are partial_budget scalars whatever the call, and
  // its merge weights ⌊S_k / 512⌋ + d_v.
  using Scalar = TypeParam;
  const Case c{"split decode", 1, 4, 1, 1, 3000, 64, 64, true, false, false, true};
  const auto [tile_bytes, tile_buffers] = stated_tile<Scalar>(true, 64);
  const long threads = std::min<long>(3, apex::detail::max_threads());
  const std::size_t partials = (std::size_t{1} << 19) * sizeof(Scalar);
  const std::size_t weights = static_cast<std::size_t>(3000 / 512 + 64) * sizeof(Scalar);
  on_a_new_thread([&, tile_bytes = tile_bytes, tile_buffers = tile_buffers] {
    SdpaCall<Scalar> call(c);
    const Allocations first = count(call);
    EXPECT_EQ(first.eigen, threads * tile_buffers + 3) << "tiles, flags, partials, weights";
    EXPECT_EQ(first.news, 0);
    EXPECT_EQ(apex::scratch_bytes(), tile_bytes + kFlagPage + partials + weights);
    EXPECT_EQ(count(call).eigen, 0);
  });
}

TYPED_TEST(AllocationTyped, ExactPromise_ReleaseScratchMakesTheNextCallAllocateAgain) {
  // "release_scratch() frees the calling thread's buffers and those of its OpenMP team": the
  // next call allocates what the first one did, to the byte, and the one after it nothing.
  using Scalar = TypeParam;
  const Case c{"decode", 2, 8, 2, 1, 3000, 64, 64, true, false, false, true};
  on_a_new_thread([&] {
    SdpaCall<Scalar> call(c);
    const Allocations first = count(call);
    const std::size_t held = apex::scratch_bytes();
    EXPECT_GT(first.eigen, 0);
    EXPECT_EQ(count(call).eigen, 0);
    apex::release_scratch();
    EXPECT_EQ(apex::scratch_bytes(), 0U);
    const Allocations again = count(call);
    EXPECT_EQ(again.eigen, first.eigen) << "every buffer of every thread, once each";
    EXPECT_EQ(again.news, 0);
    EXPECT_EQ(apex::scratch_bytes(), held);
    EXPECT_EQ(count(call).eigen, 0);
  });
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
