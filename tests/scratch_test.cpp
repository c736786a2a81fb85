// SPDX-License-Identifier: MIT
// The kernel's scratch (include/apex/detail/scratch.hpp and the MEMORY section of
// detail/flash_attention.hpp): bounded whatever the number of keys, and released on request;
// the growth rule of ALLOCATION on a ThreadScratch of its own (allocation_test.cpp counts what
// sdpa allocates).
// Resident memory is read from /proc/self/status inside a new thread, after sdpa returns and
// while the thread (and its OpenMP team) still holds its buffers.
#include <apex/cpu.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace scratch_test {
namespace {

using apex::AttentionMask;
using apex::HeadsTensor;
using apex::Index;
using apex::Vector;

/// VmRSS of this process in KiB (-1 if /proc is not there).
double resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6));
  }
  return -1.0;
}

/// The bound sdpa documents for its scratch, in bytes (detail/flash_attention.hpp, MEMORY), for
/// d_qk = d_v = d and the default blocks (M <= 256 stacked rows, Bk = 64, or 256 for bfloat16
/// products on AMX tiles; the streaming path needs less), float: per thread that runs tasks
///   2·M·d + 4·Bk·d + 2·M·Bk + M·d + M·Bk + 3·M  scalars,
/// and on the calling thread 2^19 scalars of split-key partials.
double documented_scratch_bytes(Index d, int threads, bool bf16_products) {
  const bool tiles = bf16_products && apex::kernel_isa() == apex::KernelIsa::kAmx;
  const double m = 256, bk = tiles ? 256 : 64;
  const double dd = static_cast<double>(d);
  const double per_thread = 2 * m * dd + 4 * bk * dd + 2 * m * bk + m * dd + m * bk + 3 * m;
  return 4.0 * (per_thread * threads + double(Index{1} << 19));
}

TEST(Scratch, SdpaScratchIsBoundedWhateverTheCacheLength) {
  // One layer of a long-context decode or extend: 128K cached keys, H_q = 32, H_kv = 8,
  // d = 128. The scratch must not grow with S_k: before its split was bounded,
  // a 64-token chunk held some 270 MB of partial results here.
  const Index s_k = Index{1} << 17, d = 128;
  // One head's keys and values, shared by the 8 key/value heads through a zero head stride: the
  // kernel sees [1, 8, S_k, d] (what it allocates depends on the shapes only) in 128 MiB.
  HeadsTensor<float> k_head({1, 1, s_k, d}), v_head({1, 1, s_k, d});
  Eigen::Map<Vector<float>>(k_head.data(), s_k * d).setConstant(0.01f);
  Eigen::Map<Vector<float>>(v_head.data(), s_k * d).setConstant(0.5f);
  const apex::HeadsView<const float> k(k_head.data(), {1, 8, s_k, d}, {0, 0, d});
  const apex::HeadsView<const float> v(v_head.data(), {1, 8, s_k, d}, {0, 0, d});
  const int threads = apex::detail::max_threads();
  // What a new thread and its OpenMP team cost before any scratch: stacks and the runtime's own.
  constexpr double kThreadSlackBytes = 4.0 * 1024 * 1024;
  // With bfloat16 products too (where the CPU has them), whose pairs must fit the same bound.
  for (const auto& [s_q, bf16] : {std::pair{Index{1}, false}, std::pair{Index{64}, false},
                                  std::pair{Index{65}, false}, std::pair{Index{65}, true}}) {
    HeadsTensor<float> q({1, 32, s_q, d}), out({1, 32, s_q, d});
    Eigen::Map<Vector<float>>(q.data(), 32 * s_q * d).setConstant(0.02f);
    AttentionMask<float> mask;  // a window keeps the work small; the scratch does not depend on it
    mask.positions = apex::sliding_window_mask(1024);
    apex::SdpaParams params;
    params.allow_bf16_products = bf16;
    const double bound = documented_scratch_bytes(d, threads, bf16);
    double extra_bytes = -1.0;
    std::thread fresh([&] {  // a thread whose scratch starts empty
      const double before = resident_kib();
      apex::sdpa<float>(q.view(), k, v, mask, params, out.view());
      extra_bytes = 1024.0 * (resident_kib() - before);  // its buffers are still held here
    });
    fresh.join();
    ASSERT_GE(extra_bytes, -4096.0) << "no /proc/self/status";
    std::printf(
        "S_q = %ld%s: %.2f MiB of extra resident memory (bound %.2f MiB + %.0f MiB slack)\n",
        static_cast<long>(s_q), bf16 ? ", bfloat16 products" : "", extra_bytes / 1048576,
        bound / 1048576, kThreadSlackBytes / 1048576);
    EXPECT_LE(extra_bytes, bound + kThreadSlackBytes)
        << "S_q = " << s_q << ": " << extra_bytes / 1048576 << " MiB of scratch, bound "
        << bound / 1048576 << " MiB";
    EXPECT_TRUE(out.head(0, 31).allFinite());
    EXPECT_NEAR(out.head(0, 0)(s_q - 1, 0), 0.5f, 1e-6f);  // every value is 0.5
  }
}

TEST(Scratch, BatchedDecodingScratchIsBoundedWhateverTheBatch) {
  // One decoding step of 256 sequences of 4096 tokens (one sequence of a paged cache, named 256
  // times: the kernel sees 256 jobs), H_q = 32, H_kv = 8, d = 64. Each job's split-key partials
  // take 8 pairs · 8 chunks · 4 rows · 66 scalars, 17 MiB for all of them at once: the jobs must
  // run in waves whose partials fit the one-call bound of 2^19 scalars. The calling thread's
  // scratch is then its task buffers, the partials and a small record per job and task.
  const Index d = 64, kv_heads = 8, q_heads = 32, tokens = 4096, sequences = 256;
  apex::PagedKvCache<float> cache({kv_heads, d, 64, tokens / 64});
  const apex::SequenceId id = cache.add();
  const auto kv = apex::testing::random_heads<float>(1, kv_heads, tokens, d, 3);
  cache.append(id, kv.view(), kv.view());
  const std::vector<apex::SequenceId> ids(sequences, id);
  std::vector<Index> cu;
  for (Index i = 0; i <= sequences; ++i) cu.push_back(i);
  const auto q = apex::testing::random_heads<float>(1, q_heads, sequences, d, 4);
  HeadsTensor<float> out({1, q_heads, sequences, d});
  std::size_t held = 0;
  std::thread fresh([&] {  // a thread whose scratch starts empty
    apex::sdpa_paged(q.view(), cu, cache, ids, {apex::causal_mask()}, {}, out.view());
    held = apex::scratch_bytes();
  });
  fresh.join();
  const double records = double(sequences) * (sizeof(apex::detail::JobTasks) + 2 + 8 * 9);
  const double bound = documented_scratch_bytes(d, 1, false) + records;
  EXPECT_GT(held, 0U);
  EXPECT_LE(static_cast<double>(held), bound)
      << static_cast<double>(held) / 1048576 << " MiB, bound " << bound / 1048576 << " MiB";
  EXPECT_TRUE(out.head(0, 0).allFinite());
}

TEST(Scratch, ReleaseScratchFreesTheCallingThreadsBuffers) {
  std::thread fresh([] {
    const auto q = apex::testing::random_heads<float>(1, 8, 1, 64, 1);
    const auto kv = apex::testing::random_heads<float>(1, 2, 4000, 64, 2);
    HeadsTensor<float> out({1, 8, 1, 64});
    EXPECT_EQ(apex::scratch_bytes(), 0U);
    apex::sdpa<float>(q.view(), kv.view(), kv.view(), {}, {}, out.view());
    EXPECT_GT(apex::scratch_bytes(), 0U);  // split-key partials at least
    apex::release_scratch();
    EXPECT_EQ(apex::scratch_bytes(), 0U);
    HeadsTensor<float> again({1, 8, 1, 64});
    apex::sdpa<float>(q.view(), kv.view(), kv.view(), {}, {}, again.view());
    EXPECT_EQ(Eigen::Map<const Vector<float>>(again.data(), 8 * 64),
              Eigen::Map<const Vector<float>>(out.data(), 8 * 64));
  });
  fresh.join();
}

TEST(Scratch, ExactPromise_ABufferHoldsItsLargestRequestUntilReleased) {
  // ALLOCATION: a request for more than a buffer holds grows it to exactly that request; a
  // smaller one reuses it (same memory); release() empties every buffer.
  using apex::detail::ScratchSlot;
  apex::detail::ThreadScratch scratch;
  EXPECT_EQ(scratch.bytes(), 0U);
  float* first = scratch.get<float>(ScratchSlot::kScores, 1000);
  EXPECT_EQ(scratch.bytes(), 4000U);
  EXPECT_EQ(scratch.get<float>(ScratchSlot::kScores, 999), first);
  EXPECT_EQ(scratch.get<double>(ScratchSlot::kScores, 500), reinterpret_cast<double*>(first));
  EXPECT_EQ(scratch.get<char>(ScratchSlot::kScores, 0), reinterpret_cast<char*>(first));
  EXPECT_EQ(scratch.bytes(), 4000U);
  scratch.get<double>(ScratchSlot::kScores, 501);  // 4008 bytes: grows to exactly that
  EXPECT_EQ(scratch.bytes(), 4008U);
  scratch.get<unsigned char>(ScratchSlot::kTaskFlags, 3);
  EXPECT_EQ(scratch.bytes(), 4011U);
  scratch.release();
  EXPECT_EQ(scratch.bytes(), 0U);
  // The flags' size: whole pages, so that a count of tasks below 4096 never grows them.
  EXPECT_EQ(apex::detail::ThreadScratch::whole_pages(0), 0);
  EXPECT_EQ(apex::detail::ThreadScratch::whole_pages(1), 4096);
  EXPECT_EQ(apex::detail::ThreadScratch::whole_pages(4096), 4096);
  EXPECT_EQ(apex::detail::ThreadScratch::whole_pages(4097), 8192);
}

TEST(Scratch, EveryBufferStartsOnACacheLine) {
  std::thread fresh([] {  // a thread whose scratch starts empty
    apex::detail::ThreadScratch scratch;
    for (const Index count : {0, 1, 3, 17, 1000, 65537}) {
      for (const auto slot :
           {apex::detail::ScratchSlot::kScores, apex::detail::ScratchSlot::kAcc}) {
        const auto address = reinterpret_cast<std::uintptr_t>(scratch.get<float>(slot, count));
        EXPECT_EQ(address % apex::detail::ThreadScratch::kAlignment, 0U) << "count " << count;
        const auto bytes = reinterpret_cast<std::uintptr_t>(scratch.get<char>(slot, 3 * count));
        EXPECT_EQ(bytes % apex::detail::ThreadScratch::kAlignment, 0U) << "count " << count;
      }
    }
    // Held: the largest request of each slot, 65537 floats, as asked for.
    EXPECT_EQ(scratch.bytes(), 2 * 65537 * sizeof(float));
  });
  fresh.join();
}

}  // namespace
}  // namespace scratch_test
