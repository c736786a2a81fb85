// SPDX-License-Identifier: MIT
// Memory that the tests can make unreadable page by page (mmap, then mprotect with PROT_NONE):
// where a kernel promises never to read some keys, their pages are forbidden and the kernel
// must still complete (sdpa_rules_test, sdpa_backward_test).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstddef>
#include <stdexcept>

namespace apex::testing {

/// Memory for `count` values of T, laid out so that the values at [no_read_begin, no_read_end)
/// can be made unreadable page by page (the pages wholly inside the range).
template <class T>
class GuardedBuffer {
 public:
  explicit GuardedBuffer(std::size_t count) : bytes_(round_up(count * sizeof(T))) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    data_ = static_cast<T*>(p);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  ~GuardedBuffer() { munmap(data_, bytes_); }
  T* data() { return data_; }
  /// Makes the whole pages inside [begin, end) (element indices) unreadable; returns how many.
  std::size_t forbid(std::size_t begin, std::size_t end) {
    const std::size_t page = page_size();
    const std::size_t lo = (begin * sizeof(T) + page - 1) / page * page;
    const std::size_t hi = end * sizeof(T) / page * page;
    if (hi <= lo) return 0;
    EXPECT_EQ(mprotect(reinterpret_cast<char*>(data_) + lo, hi - lo, PROT_NONE), 0);
    return (hi - lo) / page;
  }

 private:
  static std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
  static std::size_t round_up(std::size_t n) {
    return (n + page_size() - 1) / page_size() * page_size();
  }
  std::size_t bytes_;
  T* data_ = nullptr;
};

}  // namespace apex::testing
