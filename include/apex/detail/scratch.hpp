// SPDX-License-Identifier: MIT
// Per-thread scratch memory of the attention kernels, and the one statement of when apex's
// attention allocates it (sdpa.hpp, docs/guide.md and detail/flash_attention.hpp refer here).
//
// ALLOCATION. Each thread holds one buffer per ScratchSlot, all empty when the thread starts. A
// request for n bytes of a buffer that holds fewer frees it, then allocates n + kAlignment − 1
// bytes (one Eigen heap allocation); any other request reuses the buffer. So each buffer holds
// the largest request made of it on its thread since the thread started or last had its
// scratch released (release_scratch()), scratch_bytes() is the sum of those requests, and a call
// allocates once for each buffer, of each thread, of which it asks more than that thread holds.
// Nothing else in the attention kernel (detail/flash_attention.hpp) allocates; sdpa.hpp states
// the temporaries of its entry points (outputs that overlap an input), and the projections'
// slots (kWeightPanel, kWeightPartials: detail/matmul.hpp) follow the same rule.
//
// What the kernel asks for (each slot's request is written beside it below), in scalars of its
// compute type C (double when an input is double or a float call falls back to double, else
// float), none depending on S_q, B or H_q but the flags of over 4096 tasks:
//   - each thread that runs a task, its tile's buffers (kQStacked to kRowScale), sized for the
//     largest tile of the task's path whatever the task: M rows and key blocks of Bk, with
//       GEMM path (a task of G·Bq > 8 stacked rows)   M = max(256, G), Bk = 64 (AMX bf16: 256)
//       streaming path (G·Bq <= 8)                    M = 8, Bk = 512;
//   - the calling thread, kTaskFlags: whole 4096-byte pages, one up to 4096 tasks and merges;
//     for a ragged batch of n > 1 sequences kJobTasks and kJobFlags; and, once a call splits
//     keys (decoding, plan_attention), kDecodePartials: all of partial_budget, 2^19 scalars;
//   - each thread that runs a merge of split keys, kMergeWeights: ⌊S_k / 512⌋ + d_v.
// A call of n tasks runs them on the first min(n, T) threads of its OpenMP team of T (the static
// schedule of parallel_for), its B·H_kv merges likewise. Hence the first call on a thread (a new
// std::thread, or after release_scratch()) allocates these buffers, once each, on each thread
// that runs part of it, and a later call allocates only on a thread where it
//   - computes in double where the thread computed in float only;
//   - has a wider d_qk or d_v, or adds ALiBi, bfloat16 products or K, V that are widened before
//     they are streamed;
//   - runs a GEMM-path task where the thread ran only streaming ones (a GEMM tile's buffers hold
//     a streaming tile's), or runs a task or merge where the thread ran none;
//   - splits keys for the first time, or for a longer S_k (kMergeWeights);
//   - has more tasks and merges than its pages of flags hold, or more sequences;
// and each buffer it grows then holds exactly the new request. In particular a call allocates
// nothing after one on the same thread with the same compute type and options and no smaller
// d_qk, d_v and S_k, all of whose tasks took the GEMM path (or all of this call's stream), that
// split keys if this call does, and that had at least as many tasks: whatever this call's S_q,
// B, H_q, H_kv and G (up to 256), its S_k against the key blocks, and whether it wants the lse.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>

namespace apex::detail {

/// Which buffer of a thread's scratch a caller means, and what sdpa's kernel asks of it (M, Bk
/// and C as in ALLOCATION above). The kernel's per-task buffers and the calling thread's decode
/// partials never share a slot, as both live on the calling thread.
enum class ScratchSlot : int {
  kQStacked,  ///< M·d_qk: Qs, the stacked query rows
  kQPacked,   ///< M·d_qk: Qs packed for Eigen's products; apex's float: Qsᵀ, <= M·d_qk;
              ///< bf16: M·⌈d_qk/2⌉ pairs
  kKCopy,     ///< Bk·d_qk: K_j copied (GEMM), 32·d_qk if widened (streaming)
  kKPacked,   ///< Bk·d_qk (Eigen's), ⌈Bk/panel⌉·panel·d_qk (apex's float), bf16: in pairs
  kScores,    ///< M·pad(Bk): S, then P
  kPPacked,   ///< M·Bk: P packed for Eigen's products; bf16: M·⌈Bk/2⌉ pairs
  kVCopy,     ///< Bk·d_v: V_j copied (GEMM), 32·d_v if widened (streaming)
  kVPacked,   ///< Bk·d_v: V_j packed for Eigen's products; bf16: ⌈Bk/2⌉·d_v pairs
  kAcc,       ///< M·pad(d_v): the unnormalised outputs
  kPositionTile,    ///< M·pad(Bk): which keys the PositionMask allows, of a partial block
  kAlibi,           ///< pad(Bk), with ALiBi: the key distances from the tile's first query
  kRowStats,        ///< M SoftmaxStats<C> (2·M scalars): m and l of each row
  kRowScale,        ///< M: α of each row
  kDecodePartials,  ///< partial_budget, when keys are split: each chunk's (out, m, l)
  kMergeWeights,    ///< ⌊S_k / decode_chunk⌋ + d_v, on a merging thread
  kWeightPanel,     ///< (the projections' widened weight panels, not sdpa)
  kWeightPartials,  ///< (the projections' partial sums, not sdpa)
  kJobTasks,        ///< n JobTasks, for n > 1 sequences
  kJobFlags,        ///< 2·n bytes, for n > 1 sequences
  kTaskFlags,       ///< tasks + merges bytes, in whole pages (whole_pages)
  kBackwardTile,    ///< (sdpa_backward: one task's buffers, attention_backward.hpp, MEMORY)
  kBackwardSinks,   ///< (sdpa_backward: G doubles per query task, with sinks)
  kCount
};

/// The scratch of one thread: one byte buffer per ScratchSlot, allocated by Eigen, each handed
/// out at a multiple of kAlignment bytes.
class ThreadScratch {
 public:
  /// The alignment of every buffer: a cache line, which is also an AVX-512 vector and a row of
  /// an AMX tile, whatever Eigen aligns to for the build's target (16 bytes for baseline
  /// x86-64, where rows padded to 16 floats would otherwise straddle two lines).
  static constexpr Index kAlignment = 64;

  ThreadScratch() = default;
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  /// Buffer `slot` as room for `count` elements of T (contents unspecified). Grows the buffer if
  /// it is smaller (the old contents are lost); never shrinks it.
  template <class T>
  T* get(ScratchSlot slot, Index count) {
    Bytes& buffer = buffers_[static_cast<int>(slot)];
    const Index bytes = count * static_cast<Index>(sizeof(T));
    if (capacity(buffer) < bytes) {
      buffer.resize(0);  // free first: growing never holds the old and the new buffer at once
      buffer.resize(bytes + kAlignment - 1);
    }
    const auto address = reinterpret_cast<std::uintptr_t>(buffer.data());
    const auto skip = static_cast<Index>((kAlignment - address % kAlignment) % kAlignment);
    return reinterpret_cast<T*>(buffer.data() + skip);
  }

  /// `bytes` rounded up to whole 4096-byte pages: a size that does not change with small counts.
  static constexpr Index whole_pages(Index bytes) { return (bytes + kPage - 1) / kPage * kPage; }
  static constexpr Index kPage = 4096;

  /// Frees every buffer.
  void release() {
    for (Bytes& buffer : buffers_) buffer.resize(0);
  }

  /// Bytes of scratch this thread holds, as its buffers were asked for (each also holds up to
  /// kAlignment − 1 bytes before its start, as any aligned allocation does).
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const Bytes& buffer : buffers_) total += static_cast<std::size_t>(capacity(buffer));
    return total;
  }

  /// The calling thread's scratch.
  static ThreadScratch& local() {
    thread_local ThreadScratch scratch;
    return scratch;
  }

 private:
  using Bytes = Eigen::Matrix<unsigned char, Eigen::Dynamic, 1>;

  /// Bytes of `buffer` usable from its aligned start.
  static Index capacity(const Bytes& buffer) {
    return buffer.size() == 0 ? 0 : buffer.size() - (kAlignment - 1);
  }

  Bytes buffers_[static_cast<int>(ScratchSlot::kCount)];
};

}  // namespace apex::detail

namespace apex {

/// Frees the attention kernels' scratch (detail::ThreadScratch) of the calling thread and, with
/// OpenMP, of the threads of the team that apex's parallel loops start from it. The next call of
/// sdpa (or of anything built on it) allocates its buffers again, as a first call does
/// (detail/scratch.hpp, ALLOCATION). Call it from outside any parallel region (inside one it
/// frees the calling thread's scratch only). Other threads' scratch is untouched.
inline void release_scratch() {
  detail::ThreadScratch::local().release();
#ifdef _OPENMP
  if (!omp_in_parallel()) {
#pragma omp parallel
    detail::ThreadScratch::local().release();
  }
#endif
}

/// Bytes of attention scratch the calling thread holds now (0 after release_scratch()).
inline std::size_t scratch_bytes() { return detail::ThreadScratch::local().bytes(); }

}  // namespace apex
