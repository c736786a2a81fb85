// SPDX-License-Identifier: MIT
// Helpers of the MPI tests: this rank's place, and the rows of a whole-sequence result that a
// rank's shard holds.
#pragma once

#include <apex/distributed/communicator.hpp>
#include <apex/distributed/sharding.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace apex::testing {

/// This process's rank and the size of MPI_COMM_WORLD.
inline distributed::RankInfo world() { return distributed::rank_info(MPI_COMM_WORLD); }

/// max |a − b| over two views of one shape, and max |b| (for normwise comparisons).
template <class A, class B>
std::pair<double, double> max_difference(const HeadsView<A>& a, const HeadsView<B>& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double diff = 0.0;
  double scale = 0.0;
  for (Index i = 0; i < a.batch(); ++i) {
    for (Index h = 0; h < a.heads(); ++h) {
      for (Index s = 0; s < a.seq(); ++s) {
        for (Index d = 0; d < a.dim(); ++d) {
          const double x = double(a.head(i, h)(s, d));
          const double y = double(b.head(i, h)(s, d));
          diff = std::max(diff, std::isnan(x) != std::isnan(y) ? INFINITY : std::abs(x - y));
          scale = std::max(scale, std::abs(y));
        }
      }
    }
  }
  return {diff, scale};
}

/// Expects max |actual − expected| ≤ tol · max(1, max |expected|).
template <class A, class B>
void expect_normwise(const HeadsView<A>& actual, const HeadsView<B>& expected, double tol) {
  const auto [diff, scale] = max_difference(actual, expected);
  EXPECT_LE(diff, tol * std::max(1.0, scale)) << "largest |expected| " << scale;
}

}  // namespace apex::testing
