// SPDX-License-Identifier: MIT
// The one place apex spreads work over threads. With OpenMP enabled (-fopenmp, or CMake's
// APEX_USE_OPENMP) the iterations are split statically over the team, so which thread runs an
// iteration never changes a result; without OpenMP the loop simply runs in order.
#pragma once

#include <apex/config.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace apex::detail {

/// Number of threads a parallel_for may use (1 without OpenMP).
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// Index of the calling thread inside a parallel_for body (0 without OpenMP).
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/// Calls body(i) for i in [0, n). Iterations must be independent. Runs serially when n is
/// below `min_parallel` (forking a team costs a few microseconds) or when already inside a
/// parallel region.
template <class Body>
void parallel_for(Index n, Body&& body, [[maybe_unused]] Index min_parallel = 2) {
#ifdef _OPENMP
  if (n >= min_parallel && !omp_in_parallel() && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (Index i = 0; i < n; ++i) body(i);
    return;
  }
#endif
  for (Index i = 0; i < n; ++i) body(i);
}

}  // namespace apex::detail
