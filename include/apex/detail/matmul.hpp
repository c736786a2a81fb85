// SPDX-License-Identifier: MIT
// The products of apex's layers (projections, the tied LM head, MLA's decompression and weight
// folding), computed so that the result is bit-identical for any number of threads: the output
// is cut into fixed tiles, each tile is one product on one thread (matmul_serial), and the tiles
// are spread over the threads by detail::parallel_for. Eigen's own products pick their blocking
// from the thread count, so their last bits change with it; these never do.
//
// The weight may be stored in a narrower type than the product is computed in (Eigen::half or
// Eigen::bfloat16 weights of a float layer, storage.hpp). It is widened as it is read, never as
// a whole:
//   few rows (<= kStreamRows, a decoding step, bound by reading the weight): the streaming
//     products of the attention kernel (stream_update for x·w, stream_scores for x·wᵀ) read each
//     weight row once, in order, widening it packet by packet in registers where the target can
//     (kStreamsFrom); x·w is cut into fixed blocks of weight rows that the threads stream whole,
//     summed in order (stream_product); without in-register widening x·w widens kStreamDepth
//     weight rows at a time into a buffer on the stack, and x·wᵀ takes the panel path below;
//   more rows (a prompt): a kPanelDepth-deep panel of the tile's weights is widened into the
//     thread's scratch and multiplied by matmul_serial, the tile accumulating panel by panel.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/detail/widen.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <type_traits>

namespace apex::detail {

/// Tile of the output of one task: kTileRows × kTileCols. A decoding step (a few rows against a
/// 4–64 MiB weight) is a matrix-vector product bound by reading the weight: 512 columns a task
/// let every thread stream its share at the machine's bandwidth; a prompt's projection gets
/// tiles with enough work to amortise packing the weight's panel.
constexpr Index kTileRows = 512;
constexpr Index kTileCols = 512;
/// Below this many multiply-adds a product runs on the calling thread (a team costs more).
constexpr Index kParallelWork = Index{1} << 18;

/// Products with at most this many rows stream a 16-bit weight (see the top of this header).
constexpr Index kStreamRows = 8;
/// Weight rows a streaming product widens together where it cannot widen them in registers.
constexpr Index kStreamDepth = 8;
/// Depth of a widened weight panel: at most kPanelDepth · kTileCols compute scalars (512 KiB of
/// float) of per-thread scratch (ScratchSlot::kWeightPanel), kept for later products.
constexpr Index kPanelDepth = 256;

/// One output tile: rows [r0, r0 + rows) and columns [c0, c0 + cols) of the product.
struct MatmulTile {
  Index r0 = 0;
  Index rows = 0;
  Index c0 = 0;
  Index cols = 0;
};

/// Runs body(t) for t in [0, tasks) of an m × n × depth product: on the calling thread below
/// kParallelWork multiply-adds, else spread over the threads.
template <class Body>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): a product's m, n, k, as everywhere here
void parallel_tasks(Index tasks, Index m, Index n, Index depth, const Body& body) {
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(depth);
  parallel_for(tasks, body, work < static_cast<double>(kParallelWork) ? tasks + 1 : 2);
}

/// Calls tile(t) for every kTileRows × kTileCols tile t of an m × n output (with `depth` the
/// inner dimension), on the calling thread below kParallelWork multiply-adds, else spread over
/// the threads. Which tile holds which outputs depends on the shapes only.
template <class Tile>
void for_each_tile(Index m, Index n, Index depth, const Tile& tile) {
  const Index row_tiles = (m + kTileRows - 1) / kTileRows;
  const Index col_tiles = (n + kTileCols - 1) / kTileCols;
  const auto body = [&](Index t) {
    const Index r0 = t / col_tiles * kTileRows;
    const Index c0 = t % col_tiles * kTileCols;
    tile(MatmulTile{r0, std::min(kTileRows, m - r0), c0, std::min(kTileCols, n - c0)});
  };
  parallel_tasks(row_tiles * col_tiles, m, n, depth, body);
}

/// Where row r, column c of a row-major matrix is: the pointer arithmetic of every tile below.
template <class T>
T* at(T* data, Index stride, Index r, Index c) {
  return data + r * stride + c;
}

/// out tile = x · w on one thread, w stored in the compute type.
template <bool Transposed, class C>
void serial_tile(const ConstRowRef<C>& x, const ConstRowRef<C>& w, const MatmulTile& t,
                 RowRef<C>& out) {
  constexpr int kOrder = Transposed ? Eigen::ColMajor : Eigen::RowMajor;
  const C* w0 = Transposed ? at(w.data(), w.outerStride(), t.c0, 0) : w.data() + t.c0;
  matmul_serial<C, kOrder>(t.rows, t.cols, x.cols(), at(x.data(), x.outerStride(), t.r0, 0),
                           x.outerStride(), w0, w.outerStride(),
                           at(out.data(), out.outerStride(), t.r0, t.c0), out.outerStride());
}

/// How a streamed x·w with a narrower w is cut into tasks, from the shapes only: column strips
/// of kStreamCols and `blocks` blocks of `block_depth` weight rows, each task one (block, strip)
/// pair writing its own partial result; ld is the partials' row stride (a whole number of
/// packets, so that every strip starts aligned).
struct StreamPlan {
  Index blocks = 1;
  Index block_depth = 0;
  Index strips = 1;
  Index ld = 0;
};

/// Columns of one strip of a streamed product: 4 KiB of 16-bit weights per row, so that a task
/// reads its weight rows as one run of memory when n <= kStreamCols.
constexpr Index kStreamCols = 2048;
/// Weight rows of one depth block (the most; fewer when the partials would exceed their bound).
constexpr Index kStreamBlockDepth = 256;
/// Bound on the partial results of a streamed product, in scalars (2 MiB of float), unless a
/// single block's (m·ld) is larger.
constexpr Index kStreamPartials = Index{1} << 19;

// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): a product's m, k, n, as everywhere here
inline StreamPlan stream_plan(Index m, Index depth, Index n) {
  StreamPlan plan;
  plan.ld = (n + 15) / 16 * 16;
  plan.strips = (n + kStreamCols - 1) / kStreamCols;
  const Index most_blocks = std::max<Index>(1, kStreamPartials / (m * plan.ld));
  plan.block_depth = std::max(kStreamBlockDepth, (depth + most_blocks - 1) / most_blocks);
  plan.blocks = (depth + plan.block_depth - 1) / plan.block_depth;
  return plan;
}

/// Which part of a streamed product one task computes: weight rows [k0, k0 + depth) and
/// columns [c0, c0 + cols).
struct StreamBlock {
  Index k0 = 0;
  Index depth = 0;
  Index c0 = 0;
  Index cols = 0;
};

/// partial [m × cols] (leading dimension ld, aligned) = x[:, k0 : k0 + depth] ·
/// w[k0 : k0 + depth, c0 : c0 + cols] for one StreamBlock: the streaming product of attention's
/// values (stream_update, acc_r += Σ_k x(r, k) · w_k), each weight row read once, in order,
/// widened in registers where the target can (kStreamsFrom), else widened kStreamDepth rows of
/// kTileCols at a time into a buffer on the stack.
template <class C, class W>
void stream_block(const ConstRowRef<C>& x, const ConstRowRef<W>& w, const StreamBlock& block,
                  C* partial, Index ld) {
  const Index m = x.rows();
  const Index cols = block.cols;
  const Index len = block.depth;
  for (Index r = 0; r < m; ++r) std::fill(partial + r * ld, partial + r * ld + cols, C(0));
  const C* xs = x.data() + block.k0;
  const W* ws = at(w.data(), w.outerStride(), block.k0, block.c0);
  if constexpr (kStreamsFrom<C, W>) {
    stream_update(partial, ld, xs, x.outerStride(), m, ws, w.outerStride(), len, cols);
  } else {
    alignas(64) C rows[kStreamDepth * kTileCols];
    for (Index c = 0; c < cols; c += kTileCols) {
      const Index width = std::min(kTileCols, cols - c);
      for (Index j0 = 0; j0 < len; j0 += kStreamDepth) {
        const Index n = std::min(kStreamDepth, len - j0);
        for (Index j = 0; j < n; ++j) {
          widen(ws + (j0 + j) * w.outerStride() + c, rows + j * width, width);
        }
        stream_update(partial + c, ld, xs + j0, x.outerStride(), m, rows, width, n, width);
      }
    }
  }
}

/// out [m × n] = x · w for few rows (m <= kStreamRows), w [k × n] stored narrower than C: a
/// decoding step's projection, bound by reading w. The depth is cut into blocks (stream_plan)
/// so that each task streams whole weight rows (one run of memory when n <= kStreamCols) into
/// its own partial result, and the partials are summed in block order:
///   out = Σ_b x[:, block b] · w[block b, :]
/// The blocks depend on the shapes only, so the result is bit-identical for any number of
/// threads. Scratch: the partials, at most max(kStreamPartials, m·n rounded up to 16) scalars of
/// C on the calling thread (ScratchSlot::kWeightPartials).
template <class C, class W>
void stream_product(const ConstRowRef<C>& x, const ConstRowRef<W>& w, RowRef<C>& out) {
  const Index m = x.rows();
  const Index depth = x.cols();
  const Index n = w.cols();
  const StreamPlan plan = stream_plan(m, depth, n);
  C* partials =
      ThreadScratch::local().get<C>(ScratchSlot::kWeightPartials, plan.blocks * m * plan.ld);
  const auto task = [&](Index t) {
    const Index b = t / plan.strips;
    const Index c0 = t % plan.strips * kStreamCols;
    const Index k0 = b * plan.block_depth;
    const StreamBlock block{k0, std::min(plan.block_depth, depth - k0), c0,
                            std::min(kStreamCols, n - c0)};
    stream_block(x, w, block, partials + b * m * plan.ld + c0, plan.ld);
  };
  parallel_tasks(plan.blocks * plan.strips, m, n, depth, task);
  using Row = Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>;
  using ConstRow = Eigen::Map<const Eigen::Array<C, 1, Eigen::Dynamic>>;
  for (Index r = 0; r < m; ++r) {
    Row target(at(out.data(), out.outerStride(), r, 0), n);
    target = ConstRow(partials + r * plan.ld, n);
    for (Index b = 1; b < plan.blocks; ++b) target += ConstRow(partials + (b * m + r) * plan.ld, n);
  }
}

/// out tile = x · wᵀ for a tile of few rows, w [n × k] stored narrower than C and widened in
/// registers (kStreamsFrom): the streaming product of attention's scores (stream_scores,
/// out(r, c) = x_r · w_c), each weight row read once, in order, and dotted with every row of the
/// tile. Allocates nothing.
template <class C, class W>
void stream_tile_transposed(const ConstRowRef<C>& x, const ConstRowRef<W>& w, const MatmulTile& t,
                            RowRef<C>& out) {
  const Index depth = x.cols();
  C* s = at(out.data(), out.outerStride(), t.r0, t.c0);
  const C* xs = at(x.data(), x.outerStride(), t.r0, 0);
  const W* ws = at(w.data(), w.outerStride(), t.c0, 0);
  if (x.outerStride() == depth) {
    stream_scores(s, out.outerStride(), xs, t.rows, ws, w.outerStride(), t.cols, depth);
    return;
  }
  for (Index r = 0; r < t.rows; ++r) {  // stream_scores wants contiguous rows: one at a time
    stream_scores(s + r * out.outerStride(), out.outerStride(), xs + r * x.outerStride(), 1, ws,
                  w.outerStride(), t.cols, depth);
  }
}

/// out tile = x · w (or x · wᵀ) for a tile of many rows, w stored narrower than C: the tile's
/// weights are widened kPanelDepth rows of the inner dimension at a time into the thread's
/// scratch (row-major [depth × cols], or for wᵀ the column-major one that w's rows already are)
/// and multiplied by matmul_serial, accumulating from the second panel on. Scratch: at most
/// kPanelDepth · kTileCols scalars of C.
template <bool Transposed, class C, class W>
void panel_tile(const ConstRowRef<C>& x, const ConstRowRef<W>& w, const MatmulTile& t,
                RowRef<C>& out) {
  const Index depth = x.cols();
  C* panel = ThreadScratch::local().get<C>(ScratchSlot::kWeightPanel,
                                           std::min(kPanelDepth, depth) * t.cols);
  for (Index k0 = 0; k0 < depth; k0 += kPanelDepth) {
    const Index len = std::min(kPanelDepth, depth - k0);
    const C* lhs = at(x.data(), x.outerStride(), t.r0, k0);
    C* target = at(out.data(), out.outerStride(), t.r0, t.c0);
    if constexpr (Transposed) {
      for (Index c = 0; c < t.cols; ++c) {
        widen(at(w.data(), w.outerStride(), t.c0 + c, k0), panel + c * len, len);
      }
      matmul_serial<C, Eigen::ColMajor>(t.rows, t.cols, len, lhs, x.outerStride(), panel, len,
                                        target, out.outerStride(), k0 > 0);
    } else {
      for (Index k = 0; k < len; ++k) {
        widen(at(w.data(), w.outerStride(), k0 + k, t.c0), panel + k * t.cols, t.cols);
      }
      matmul_serial<C, Eigen::RowMajor>(t.rows, t.cols, len, lhs, x.outerStride(), panel, t.cols,
                                        target, out.outerStride(), k0 > 0);
    }
  }
}

/// out [m × n] = x [m × k] · w, where w is [k × n] row-major (Transposed = false) or given as its
/// transpose, a row-major [n × k] matrix (Transposed = true, for h · W_Eᵀ), stored in C or in a
/// narrower type W that is widened as it is read (see the top of this header). out must not
/// overlap x or w. Allocates what Eigen's packing needs per tile; a narrower w with more than
/// kStreamRows rows also uses the panel scratch.
template <bool Transposed, class C, class W>
void matmul_tiles(const ConstRowRef<C>& x, const ConstRowRef<W>& w, RowRef<C> out) {
  static_assert(is_storage_v<W> && sizeof(W) <= sizeof(C),
                "the weight must be stored in the compute type or a narrower one");
  const Index m = x.rows();
  const Index depth = x.cols();
  const Index n = Transposed ? w.rows() : w.cols();
  APEX_ASSERT(out.rows() == m && out.cols() == n && depth == (Transposed ? w.cols() : w.rows()));
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<C, W>) {
    for_each_tile(m, n, depth, [&](const MatmulTile& t) { serial_tile<Transposed>(x, w, t, out); });
  } else {
    if (depth == 0) {
      out.setZero();
      return;
    }
    if constexpr (!Transposed) {
      if (m <= kStreamRows) {
        stream_product(x, w, out);
        return;
      }
    }
    for_each_tile(m, n, depth, [&](const MatmulTile& t) {
      if constexpr (Transposed && kStreamsFrom<C, W>) {
        if (t.rows <= kStreamRows) {
          stream_tile_transposed(x, w, t, out);
          return;
        }
      }
      panel_tile<Transposed>(x, w, t, out);
    });
  }
}

/// out = x · w (w: [k × n], row-major, in Scalar or a 16-bit storage type), bit-identical for
/// any number of threads.
template <class Scalar, class DerivedW>
void matmul(const ConstRowRef<Scalar>& x, const Eigen::MatrixBase<DerivedW>& w,
            RowRef<Scalar> out) {
  using W = typename DerivedW::Scalar;
  matmul_tiles<false, Scalar, W>(x, ConstRowRef<W>(w.derived()), out);
}

/// out = x · wᵀ (w: [n × k], row-major, in Scalar or a 16-bit storage type), bit-identical for
/// any number of threads.
template <class Scalar, class DerivedW>
void matmul_transposed(const ConstRowRef<Scalar>& x, const Eigen::MatrixBase<DerivedW>& w,
                       RowRef<Scalar> out) {
  using W = typename DerivedW::Scalar;
  matmul_tiles<true, Scalar, W>(x, ConstRowRef<W>(w.derived()), out);
}

/// out = aᵀ · b, or out += aᵀ · b with `accumulate` (a: [k × m], b: [k × n], row-major, both in
/// Scalar): the weight gradient of a projection, xᵀ·dy, summed over the k tokens. Fixed tiles of
/// out, each one product on one thread (for_each_tile), so bit-identical for any number of
/// threads. Allocates nothing beyond Eigen's packing buffers.
template <class Scalar>
void matmul_lhs_transposed(const ConstRowRef<Scalar>& a, const ConstRowRef<Scalar>& b,
                           RowRef<Scalar> out, bool accumulate = false) {
  for_each_tile(out.rows(), out.cols(), a.rows(), [&](const MatmulTile& t) {
    matmul_serial<Scalar, Eigen::RowMajor, Eigen::ColMajor>(
        t.rows, t.cols, a.rows(), a.data() + t.r0, a.outerStride(), b.data() + t.c0,
        b.outerStride(), at(out.data(), out.outerStride(), t.r0, t.c0), out.outerStride(),
        accumulate);
  });
}

/// matmul into a new [x.rows(), w.cols()] matrix.
template <class Scalar, class DerivedW>
RowMatrix<Scalar> matmul(const ConstRowRef<Scalar>& x, const Eigen::MatrixBase<DerivedW>& w) {
  RowMatrix<Scalar> out(x.rows(), w.cols());
  matmul<Scalar>(x, w, out);
  return out;
}

/// matmul_transposed into a new [x.rows(), w.rows()] matrix.
template <class Scalar, class DerivedW>
RowMatrix<Scalar> matmul_transposed(const ConstRowRef<Scalar>& x,
                                    const Eigen::MatrixBase<DerivedW>& w) {
  RowMatrix<Scalar> out(x.rows(), w.rows());
  matmul_transposed<Scalar>(x, w, out);
  return out;
}

}  // namespace apex::detail
