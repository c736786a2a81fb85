// SPDX-License-Identifier: MIT
// apex from several threads at once. Eight std::threads run the tiled and the reference SDPA
// (prefill and split-key decoding), RMSNorm, RoPE and a grouped-query attention layer on data of
// their own, sharing one layer and one RoPE table (both documented as safe to share: const
// methods only), and every result must equal, bit for bit, what the same calls return when
// made one after another on the main thread. What this guards: the per-thread scratch of the
// tiled kernel (thread_local buffers that grow on first use), the decode partials kept on the
// calling thread, and anything else that might be shared by mistake.
//
// The same program is built with ThreadSanitizer by tests/sanitize_thread.sh, which is what
// finds races that happen not to change a result here.
#include <apex/gqa.hpp>
#include <apex/mask.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace concurrency_test {
namespace {

using apex::AttentionMask;
using apex::HeadsTensor;
using apex::Index;
using apex::RowMatrix;
using apex::Vector;

constexpr int kThreads = 8;
constexpr int kRounds = 3;

/// Bitwise equality (the results are deterministic, so not even the last bit may differ).
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(),
                     sizeof(typename A::Scalar) * static_cast<std::size_t>(a.size())) == 0;
}

template <class Scalar>
RowMatrix<Scalar> flat(const HeadsTensor<Scalar>& t) {
  return Eigen::Map<const RowMatrix<Scalar>>(t.data(), t.batch() * t.heads() * t.seq(), t.dim());
}

/// Everything one thread computes.
template <class Scalar>
struct Results {
  RowMatrix<Scalar> prefill, prefill_lse, decode, decode_lse, reference, norm, rotated, layer;
};

/// What the threads share: read-only after construction.
template <class Scalar>
struct Shared {
  apex::GroupedQueryAttention<Scalar> layer =
      apex::GroupedQueryAttention<Scalar>::random({48, 6, 2, 8}, 11);
  apex::RopeTable<Scalar> rope{512, 8};
};

/// The work of thread `t`: shapes and data depend on t, so that the threads' scratch buffers
/// grow to different sizes and no two threads compute the same thing.
template <class Scalar>
Results<Scalar> work(int t, const Shared<Scalar>& shared) {
  std::mt19937 rng(1000u + static_cast<std::uint32_t>(t));
  Results<Scalar> r;
  const Index ti = t;
  AttentionMask<Scalar> causal;
  causal.positions = apex::causal_mask();
  if (t % 2 == 1) causal.positions.window = 17 + ti;

  {  // Prefill: many query blocks, grouped heads, a causal (and for odd t windowed) mask.
    const Index s = 70 + 13 * ti;
    const auto q = apex::testing::random_heads<Scalar>(2, 6, s, 24, rng);
    const auto k = apex::testing::random_heads<Scalar>(2, 2, s, 24, rng);
    const auto v = apex::testing::random_heads<Scalar>(2, 2, s, 20, rng);
    HeadsTensor<Scalar> out({2, 6, s, 20}), lse({2, 6, s, 1});
    apex::sdpa<Scalar>(q.view(), k.view(), v.view(), causal, {}, out.view(), lse.view());
    r.prefill = flat(out);
    r.prefill_lse = flat(lse);
    HeadsTensor<Scalar> ref({2, 6, s, 20});
    apex::reference::sdpa<Scalar>(q.view(), k.view(), v.view(), causal, {}, ref.view());
    r.reference = flat(ref);
  }
  {  // Decoding: two new tokens against a long cache (split-key path, partials per call).
    const Index s_k = 1300 + 100 * ti;
    const auto q = apex::testing::random_heads<Scalar>(1, 8, 2, 32, rng);
    const auto k = apex::testing::random_heads<Scalar>(1, 2, s_k, 32, rng);
    const auto v = apex::testing::random_heads<Scalar>(1, 2, s_k, 32, rng);
    HeadsTensor<Scalar> out({1, 8, 2, 32}), lse({1, 8, 2, 1});
    apex::sdpa<Scalar>(q.view(), k.view(), v.view(), causal, {}, out.view(), lse.view());
    r.decode = flat(out);
    r.decode_lse = flat(lse);
  }
  {  // RMSNorm.
    const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(33 + ti, 96, rng);
    const Vector<Scalar> gamma = apex::testing::random_matrix<Scalar>(96, 1, rng);
    r.norm = apex::rms_norm(x, gamma);
  }
  {  // RoPE in place, shared table, four heads side by side.
    r.rotated = apex::testing::random_matrix<Scalar>(40 + ti, 32, rng);
    apex::apply_rope(shared.rope, 7 * ti, apex::RowRef<Scalar>(r.rotated));
  }
  {  // A grouped-query attention layer with RoPE, shared by every thread.
    const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(2 * (20 + ti), 48, rng);
    apex::AttentionLayerParams<Scalar> params;
    params.rope = &shared.rope;
    params.position_offset = ti;
    r.layer = shared.layer.forward(x, 2, causal, params);
  }
  return r;
}

template <class Scalar>
void expect_same(const Results<Scalar>& got, const Results<Scalar>& want, int t) {
  EXPECT_TRUE(same_bits(got.prefill, want.prefill)) << "thread " << t << ": sdpa prefill";
  EXPECT_TRUE(same_bits(got.prefill_lse, want.prefill_lse)) << "thread " << t << ": prefill lse";
  EXPECT_TRUE(same_bits(got.decode, want.decode)) << "thread " << t << ": sdpa decoding";
  EXPECT_TRUE(same_bits(got.decode_lse, want.decode_lse)) << "thread " << t << ": decoding lse";
  EXPECT_TRUE(same_bits(got.reference, want.reference)) << "thread " << t << ": reference sdpa";
  EXPECT_TRUE(same_bits(got.norm, want.norm)) << "thread " << t << ": rms_norm";
  EXPECT_TRUE(same_bits(got.rotated, want.rotated)) << "thread " << t << ": apply_rope";
  EXPECT_TRUE(same_bits(got.layer, want.layer)) << "thread " << t << ": gqa forward";
}

template <class Scalar>
class ConcurrencyTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ConcurrencyTyped, Scalars, apex::testing::ScalarName);

TYPED_TEST(ConcurrencyTyped, EightThreadsMatchSequentialBitForBit) {
  using Scalar = TypeParam;
  const Shared<Scalar> shared;
  std::vector<Results<Scalar>> expected;
  for (int t = 0; t < kThreads; ++t) expected.push_back(work<Scalar>(t, shared));

  for (int round = 0; round < kRounds; ++round) {
    std::vector<Results<Scalar>> got(kThreads);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        // Start together, so that the calls overlap as much as they can.
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();
        got[static_cast<std::size_t>(t)] = work<Scalar>(t, shared);
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (int t = 0; t < kThreads; ++t) {
      expect_same(got[static_cast<std::size_t>(t)], expected[static_cast<std::size_t>(t)], t);
    }
  }
}

}  // namespace
}  // namespace concurrency_test
