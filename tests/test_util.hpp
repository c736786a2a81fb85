// SPDX-License-Identifier: MIT
// Helpers shared by the test programs: deterministic random inputs, the check that a call is
// rejected with std::invalid_argument and a given message, element-wise closeness checks, a
// guard that runs a scope on one thread, and token-major chunks of a history for the cache tests.
// Tolerances are not set here: the attention tests take theirs from tolerances.hpp, with the
// reasons.
#pragma once

#include <apex/config.hpp>
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace apex::testing {

/// Runs the enclosing scope on one OpenMP thread. Decoding tests make tens of thousands of calls
/// on tiny shapes, where forking an OpenMP team costs more than the work and, on a loaded
/// machine (ctest -j2 on two cores), can wait a whole scheduler time slice. Results do not
/// depend on the number of threads (sdpa_fast_test checks this bit for bit), so such tests run
/// on one thread and their runtime does not depend on what else the machine is doing.
class OneThread {
 public:
  OneThread() {
#ifdef _OPENMP
    saved_ = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
  }
  ~OneThread() {
#ifdef _OPENMP
    omp_set_num_threads(saved_);
#endif
  }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

#ifdef _OPENMP
 private:
  int saved_ = 1;
#endif
};

/// Names typed tests after their scalar: `RopeTyped/float.Name` rather than `RopeTyped/0.Name`.
struct ScalarName {
  template <class T>
  static std::string GetName(int /*index*/) {
    if constexpr (std::is_same_v<T, float>) return "float";
    if constexpr (std::is_same_v<T, double>) return "double";
    if constexpr (std::is_same_v<T, Eigen::half>) return "half";
    if constexpr (std::is_same_v<T, Eigen::bfloat16>) return "bfloat16";
    return "other";
  }
};

/// A rows x cols matrix of uniform values in [lo, hi), drawn from `rng` in storage order, so
/// that consecutive calls on one generator give different matrices.
template <class Scalar>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::mt19937& rng, double lo = -1.0,
                                double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(dist(rng));
  return m;
}

/// The same from a generator of its own: the same seed gives the same matrix.
template <class Scalar>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint32_t seed, double lo = -1.0,
                                double hi = 1.0) {
  std::mt19937 rng(seed);
  return random_matrix<Scalar>(rows, cols, rng, lo, hi);
}

/// Expects `call()` to throw std::invalid_argument whose message contains every one of `parts`.
template <class Call>
void expect_invalid(Call&& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected std::invalid_argument, nothing was thrown";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message \"" << message << "\" lacks \"" << part << "\"";
    }
  }
}

/// The same for a braced list of parts: expect_invalid(call, {"[op]", "name (3)"}).
template <class Call>
void expect_invalid(Call&& call, std::initializer_list<std::string> parts) {
  expect_invalid(std::forward<Call>(call), std::vector<std::string>(parts));
}

/// The same for a single part.
template <class Call>
void expect_invalid(Call&& call, const std::string& part) {
  expect_invalid(std::forward<Call>(call), std::vector<std::string>{part});
}

/// Expects equal shapes and |actual − expected| ≤ max(abs_tol, rel_tol·|expected|) for every
/// element. Compared in double; stops at the first shape mismatch.
template <class Actual, class Expected>
void expect_near_elementwise(const Actual& actual, const Expected& expected, double rel_tol,
                             double abs_tol) {
  ASSERT_EQ(actual.rows(), expected.rows());
  ASSERT_EQ(actual.cols(), expected.cols());
  for (Index i = 0; i < expected.rows(); ++i) {
    for (Index j = 0; j < expected.cols(); ++j) {
      const double e = static_cast<double>(expected(i, j));
      EXPECT_NEAR(static_cast<double>(actual(i, j)), e, std::max(abs_tol, rel_tol * std::abs(e)))
          << "at (" << i << ", " << j << ") of " << expected.rows() << " x " << expected.cols();
    }
  }
}

/// Expects |actual − expected| ≤ tol·max(1, |expected|) for every element: relative for
/// values above 1, absolute below.
template <class Actual, class Expected>
void expect_close(const Actual& actual, const Expected& expected, double tol) {
  expect_near_elementwise(actual, expected, tol, tol);
}

/// The normwise error max |a − b| / max(1, max |b|) of two matrices of the same shape, in
/// double: one figure for a whole result, relative to its largest value above 1.
template <class A, class B>
double normwise(const A& a, const B& b) {
  const double scale = std::max(1.0, b.template cast<double>().cwiseAbs().maxCoeff());
  return (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff() / scale;
}

// ---- Random [B, H, S, D] tensors, in the per-head layout of apex/tensor.hpp ----------------

/// A [batch, heads, seq, dim] tensor of uniform values in [lo, hi), drawn from `rng` in storage
/// order like random_matrix.
template <class Scalar>
HeadsTensor<Scalar> random_heads(Index batch, Index heads, Index seq, Index dim, std::mt19937& rng,
                                 double lo = -1.0, double hi = 1.0) {
  HeadsTensor<Scalar> t({batch, heads, seq, dim});
  std::uniform_real_distribution<double> dist(lo, hi);
  const Index size = batch * heads * seq * dim;
  for (Index i = 0; i < size; ++i) t.data()[i] = static_cast<Scalar>(dist(rng));
  return t;
}

/// The same from a generator of its own: the same seed gives the same tensor.
template <class Scalar>
HeadsTensor<Scalar> random_heads(Index batch, Index heads, Index seq, Index dim, std::uint32_t seed,
                                 double lo = -1.0, double hi = 1.0) {
  std::mt19937 rng(seed);
  return random_heads<Scalar>(batch, heads, seq, dim, rng, lo, hi);
}

// ---- Token-major chunks of a history, for the decoding caches --------------------------------

/// The [B, H, n, d] view of a token-major chunk [B·n, H·d] (what a projection writes).
template <class Scalar>
HeadsView<const Scalar> heads_of(const RowMatrix<Scalar>& m, Index batch, Index heads) {
  return HeadsView<const Scalar>::token_major(m.data(),
                                              {batch, heads, m.rows() / batch, m.cols() / heads});
}

/// The tokens [first, first + n) of every batch of a token-major history [B·T, H·d].
template <class Scalar>
RowMatrix<Scalar> chunk_of(const RowMatrix<Scalar>& history, Index batch, Index first, Index n) {
  const Index total = history.rows() / batch;
  RowMatrix<Scalar> chunk(batch * n, history.cols());
  for (Index b = 0; b < batch; ++b) {
    chunk.middleRows(b * n, n) = history.middleRows(b * total + first, n);
  }
  return chunk;
}

}  // namespace apex::testing
