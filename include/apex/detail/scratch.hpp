// SPDX-License-Identifier: MIT
// Per-thread scratch memory of the attention kernels: numbered buffers that grow on first use and
// are reused by every later call on the same thread, so that a call whose shapes the thread has
// seen before allocates nothing and touches no fresh page. apex::release_scratch() frees them.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>

namespace apex::detail {

/// Which buffer of a thread's scratch a caller means. The kernel's per-task buffers and the
/// calling thread's decode partials never share a slot, as both live on the calling thread.
enum class ScratchSlot : int {
  kQStacked,
  kQPacked,
  kKCopy,
  kKPacked,
  kScores,
  kPPacked,
  kVCopy,
  kVPacked,
  kAcc,
  kPositionTile,
  kAlibi,
  kRowStats,
  kRowScale,
  kDecodePartials,
  kMergeWeights,
  kWeightPanel,
  kWeightPartials,
  kJobTasks,
  kJobFlags,
  kTaskFlags,
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
/// sdpa (or of anything built on it) allocates its buffers again. Call it from outside any
/// parallel region (inside one it frees the calling thread's scratch only).
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
