// SPDX-License-Identifier: MIT
// The products of apex's layers (projections, the tied LM head, MLA's decompression and weight
// folding), computed so that the result is bit-identical for any number of threads: the output
// is cut into fixed tiles, each tile is one product on one thread (matmul_serial), and the tiles
// are spread over the threads by detail::parallel_for. Eigen's own products pick their blocking
// from the thread count, so their last bits change with it; these never do.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/parallel.hpp>

#include <algorithm>

namespace apex::detail {

/// Tile of the output of one task: kTileRows × kTileCols. A decoding step (a few rows against a
/// 4–64 MiB weight) is a matrix-vector product bound by reading the weight: 512 columns a task
/// let every thread stream its share at the machine's bandwidth; a prompt's projection gets
/// tiles with enough work to amortise packing the weight's panel.
constexpr Index kTileRows = 512;
constexpr Index kTileCols = 512;
/// Below this many multiply-adds a product runs on the calling thread (a team costs more).
constexpr Index kParallelWork = Index{1} << 18;

/// out [m × n] = x [m × k] · w, where w is [k × n] row-major (Transposed = false) or given as its
/// transpose, a row-major [n × k] matrix (Transposed = true, for h · W_Eᵀ). out must not overlap
/// x or w. Allocates what Eigen's packing needs per tile.
template <bool Transposed, class Scalar>
void matmul_tiles(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& w, RowRef<Scalar> out) {
  const Index m = x.rows();
  const Index depth = x.cols();
  const Index n = Transposed ? w.rows() : w.cols();
  APEX_ASSERT(out.rows() == m && out.cols() == n && depth == (Transposed ? w.cols() : w.rows()));
  if (m == 0 || n == 0) return;
  const Index row_tiles = (m + kTileRows - 1) / kTileRows;
  const Index col_tiles = (n + kTileCols - 1) / kTileCols;
  constexpr int kOrder = Transposed ? Eigen::ColMajor : Eigen::RowMajor;
  const auto tile = [&](Index t) {
    const Index r0 = t / col_tiles * kTileRows;
    const Index c0 = t % col_tiles * kTileCols;
    const Index rows = std::min(kTileRows, m - r0);
    const Index cols = std::min(kTileCols, n - c0);
    const Scalar* w0 = Transposed ? w.data() + c0 * w.outerStride() : w.data() + c0;
    matmul_serial<Scalar, kOrder>(rows, cols, depth, x.data() + r0 * x.outerStride(),
                                  x.outerStride(), w0, w.outerStride(),
                                  out.data() + r0 * out.outerStride() + c0, out.outerStride());
  };
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(depth);
  parallel_for(row_tiles * col_tiles, tile,
               work < static_cast<double>(kParallelWork) ? row_tiles * col_tiles + 1 : 2);
}

/// out = x · w (w: [k × n], row-major), bit-identical for any number of threads.
template <class Scalar>
void matmul(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& w, RowRef<Scalar> out) {
  matmul_tiles<false, Scalar>(x, w, out);
}

/// out = x · wᵀ (w: [n × k], row-major), bit-identical for any number of threads.
template <class Scalar>
void matmul_transposed(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& w,
                       RowRef<Scalar> out) {
  matmul_tiles<true, Scalar>(x, w, out);
}

/// matmul into a new [x.rows(), w.cols()] matrix.
template <class Scalar>
RowMatrix<Scalar> matmul(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& w) {
  RowMatrix<Scalar> out(x.rows(), w.cols());
  matmul<Scalar>(x, w, out);
  return out;
}

/// matmul_transposed into a new [x.rows(), w.rows()] matrix.
template <class Scalar>
RowMatrix<Scalar> matmul_transposed(const ConstRowRef<Scalar>& x, const ConstRowRef<Scalar>& w) {
  RowMatrix<Scalar> out(x.rows(), w.rows());
  matmul_transposed<Scalar>(x, w, out);
  return out;
}

}  // namespace apex::detail
