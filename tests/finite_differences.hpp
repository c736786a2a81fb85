// SPDX-License-Identifier: MIT
// Central finite differences, the check of every plain backward loop in tests/reference/: each
// loop's gradient of a scalar loss is compared with the differences of the plain forward loop it
// differentiates, in double.
//
// With step h = 1e-5 and O(1) inputs, (f(x + h) − f(x − h)) / 2h differs from f'(x) by
// O(h²·|f'''|) ≈ 1e-10 plus the rounding of f, O(u·|f| / h) ≈ 1e-11: a bound of
// 1e-7 · max(1, max |gradient|) leaves a thousandfold margin and still fails on any wrong term.
#pragma once

#include <Eigen/Core>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace apex::testing {

/// Every entry of `analytic` (the gradient of f by x, x's shape) against the central difference
/// of f by that entry of x, within 1e-7 · max(1, max |analytic|). x is restored after each step.
template <class X, class Analytic, class F>
void expect_matches_differences(X& x, const Analytic& analytic, F&& f, const char* what) {
  constexpr double kStep = 1e-5;
  ASSERT_EQ(x.rows(), analytic.rows()) << what;
  ASSERT_EQ(x.cols(), analytic.cols()) << what;
  const double bound = 1e-7 * std::max(1.0, static_cast<double>(analytic.cwiseAbs().maxCoeff()));
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double saved = x(r, c);
      x(r, c) = saved + kStep;
      const double up = f();
      x(r, c) = saved - kStep;
      const double down = f();
      x(r, c) = saved;
      EXPECT_NEAR((up - down) / (2 * kStep), static_cast<double>(analytic(r, c)), bound)
          << what << "(" << r << ", " << c << ")";
    }
  }
}

}  // namespace apex::testing
