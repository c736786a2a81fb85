// SPDX-License-Identifier: MIT
// Tiled scaled dot-product attention with an online softmax: the fast path behind apex::sdpa.
// apex::reference::sdpa (sdpa.hpp) is the plain version it is tested against.
//
// WHAT IT COMPUTES (§6.2, grouped heads §8.2, masks §10–§11): for every query row i (position
// qp) of query head h, with s_ij = softcap(scale · q_i·k_j) + slope_h·(kp_j − qp) + bias_ij
// (forbidden → -inf; the ALiBi term only with slopes) and the head's sink (-inf without one),
//   out[i] = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij))
//   lse[i] = log(e^(sink_h) + Σ_j e^(s_ij))                            (keys that take part)
// without ever holding an S_q × S_k score matrix (FlashAttention: Dao et al. 2022, Algorithm 1).
// The keys may come in several segments of consecutive positions (a sliding-window cache's ring
// is two, plus the new chunk): one pass over them all, no merge.
//
// ONE TASK = batch b, key/value head, one block of Bq query positions. The G = H_q / H_kv query
// heads that read the same key/value head are stacked into one tile of M = G·Bq rows, so each
// key/value block is read once per group and every product has a few hundred rows:
//
//         Qs = scale·Q, stacked                K_j: Bk keys             V_j: Bk keys
//        +---------------------+            +----------------+        +------------+
//   g=0  | Bq rows × d_qk      |            | Bk × d_qk      |        | Bk × d_v   |
//   g=1  | Bq rows × d_qk      |            +----------------+        +------------+
//   ...  |                     |                    |                        |
//   G-1  | Bq rows × d_qk      |   S = Qs·K_jᵀ  (M × Bk) --softmax--> acc += P·V_j (M × d_v)
//        +---------------------+
//   row r = g·Bq + i is query position q0 + i of query head kv_head·G + g.
//
// A tile folds in one key block at a time, in four named steps (AttentionTile::add_keys):
//   score       S = Qs·K_jᵀ                       gemm, TileGemm (packed) or stream_scores
//   mask        softcap, + ALiBi, + bias, position rule, dense mask: forbidden → -inf
//   softmax     m, l and P = exp(S − m) per row    softmax_update (online_softmax.hpp)
//   accumulate  acc = diag(α)·acc + P·V_j          gemm, TileGemm (packed) or stream_update
// and finish_row() ends each row with softmax_finish: out = acc / l, lse = m + log l (with the
// sink, which joins there once: THE SINK in online_softmax.hpp).
//
// INPUTS TYPED BY WHAT THEY STORE. Q, K, V (and the bias) are views of their storage types
// (float, double, Eigen::half, Eigen::bfloat16); the kernel computes in C (float, or double).
// Every read of K and V goes through one loader per path: load_rows (the block copy of the GEMM
// path, which widens while it copies, with the vector conversions of widen.hpp) and read_rows
// (the row reader of the streaming path, in place when the storage is C or a 16-bit type that
// the streaming products widen packet by packet in registers, streams_in_place: always on apex's
// float kernels, on Eigen's where the build targets AVX, else widened a panel at a time by
// load_rows). Q is widened and scaled once per task (load_queries).
//
// COMPUTE TYPE. A call computes in double when any input is double. Otherwise it computes in
// float, unless a parameter does not fit float (fits_float: the scale, the soft-cap, a sink, the
// largest ALiBi term), or unless the float pass meets a score, or produces an output, that is not
// finite (a finite q·k can overflow float: q = k = 1e20); then the whole call is computed again
// in double, so that a finite input always gets the finite answer of the double reference.
// (Inputs that hold NaN or infinities therefore cost two passes.)
//
// MASK-AWARE SKIPPING. A query block visits only the keys its positions may see (visible_keys:
// up to the block's last query when causal, from its window's, chunk's or document's first key,
// and the prefix for prefix queries); the others are never read. Inside that range each (query
// block, key block) pair is classified on absolute positions with classify_block: kNone skips
// the block (no product at all), kAll needs no mask work, and kPartial applies
// PositionMask::allows element by element, evaluated once for the Bq × Bk tile and shared by the
// G stacked heads. Causal attention thus costs about half of full attention, a sliding window
// about S·(W + Bq + Bk), chunks of C about S·(C + Bq + Bk)/2, documents the sum of their causal
// triangles plus a block's edge each. Dense boolean masks and biases are applied to every block
// that is not skipped; ALiBi needs mask work in every block (a term per score).
//
// NON-FINITE INPUT (the policy of apex::sdpa; PARTICIPATION in online_softmax.hpp). A forbidden
// key never reaches the output: its score is selected to -inf after softcap and bias, and its
// weight is -0.0. A block where some key may take no part and whose values are not all finite
// adds only the keys that take part (accumulate_visible). A NaN score among a row's keys makes
// the row NaN (out and lse), tracked explicitly rather than left to NaN arithmetic.
//
// PRODUCTS. In float, where the CPU runs AVX2 or AVX-512 (kernel_isa(), cpu.hpp), the GEMM path
// (M > stream_rows) runs both products on apex's own register-blocked kernel (gemm,
// simd_kernels.hpp), with K_j transposed into its panels once per block and P and V_j read as
// they are; the softmax's block maximum, exponentials and sums run there too. These kernels are
// compiled for each level whatever the build targets, so a baseline -O2 build runs them as a
// -march=native one does. Where a call permits bfloat16 products (SdpaParams::
// allow_bf16_products) and the CPU has AVX512-BF16 (KernelIsa::kAvx512Bf16), the GEMM path's
// products run on bfloat16 dot products instead (Bf16Kernels): Qs rounded into pairs along d_qk
// once per task, K_j rounded and transposed into panels of pairs, P rounded into pairs along
// the keys and V_j interleaved in pairs of rows, each once per block; the streaming path stays
// exact. On AMX (KernelIsa::kAmx) the same packed pairs feed the tiles (tdpbf16ps) in place,
// with key blocks of amx_key_block = 256. Otherwise (double, or KernelIsa::kPortable) the GEMM path
// runs both products on Eigen's GEMM micro-kernel over buffers owned by this kernel (TileGemm,
// eigen_adapter.hpp): Qs is packed once per task, nothing is allocated, and Eigen never splits a
// product over threads (its thread-dependent blocking would make results depend on the number of
// threads). Each K_j, V_j block is first copied to contiguous scratch: a sequential read the
// prefetcher follows, whereas packing straight from DRAM waits on every cache line. The streaming
// path (M ≤ stream_rows, e.g. one new token of 4 grouped heads) is bound by reading K and V: each
// key row, then each value row, is read once in memory order and used at once by every stacked row.
//
// SCHEDULERS. A call of the kernel is a list of jobs, one problem each (an sdpa call, or one
// sequence of a ragged batch, with its own positions, rule and keys), and every task of every
// job runs in one parallel loop, so that a batch of short and long sequences keeps every thread
// busy. prefill: one task per (b, kv head, query block), its visible keys in blocks. decode
// (split keys, flash-decoding: Dao et al. 2023): when every query of a job fits in one block
// and the job has few (b, kv head) pairs, its visible keys are cut into chunks, each (b, kv
// head, chunk) task writes a partial result (out_c, m_c, l_c) without the sink, and merge_rows
// combines them in chunk order and adds the sink. The chunks are few enough that one job's
// partials are bounded whatever S_k (AttentionPlan), and the jobs run in waves whose partials
// fit the same bound together. A job's plan depends on its own shapes alone, so a sequence of a
// batch gets the bits of the same sequence in a call of its own.
//
// PAGED KEYS. A key segment may live in pages of a pool, addressed through a block table
// (KeySegment): the loaders read it page by page (SegmentHead), the streaming panels end where
// a page does, and the key blocks are the same as for the same keys stored contiguously. The
// products add key after key whatever the panels (stream_update), so paged attention equals
// contiguous attention bit for bit; only the fallback on Eigen's public API
// (APEX_EIGEN_PUBLIC_ONLY), which sums a panel before adding it, differs by rounding.
//
// THREADS AND DETERMINISM. Tasks run through detail::parallel_for. What a task computes depends
// only on the shapes (the block sizes, the split and the choice of path are fixed, the key
// blocks and the merge run in a fixed order, Eigen's kernels are called serially), so the output
// is bit-identical for any number of threads. Within one (b, kv head) the prefill tasks take
// query blocks in the order 0, n−1, 1, n−2, … so that OpenMP's static schedule gives every
// thread a similar share of a causal triangle.
//
// BLOCK SIZES (FlashBlocking), each the fastest of those measured (docs/performance.md, "How
// the block sizes were chosen"):
//   - M = G·Bq ≈ 256 stacked rows and Bk = 64: larger key blocks waste work on the diagonal and
//     at window edges, fewer rows leave the products short.
//   - amx_key_block = 256 on AMX tiles: the tiles' products are short next to the softmax's
//     work, and P·V takes 8 steps of 32 keys per load and store of its accumulator tiles.
//   - stream_rows = 8: up to 8 stacked rows the streaming path is bound by reading K and V and
//     well ahead of the GEMM path; from 16 rows both are compute-bound.
//   - stream_key_block = decode_chunk = 512: fewer fixed costs per block than smaller blocks.
//
// MEMORY (ScratchSlot buffers of the thread running a task, each sized for the path's largest
// tile whatever S_q and S_k; when they are allocated: detail/scratch.hpp, ALLOCATION), in
// scalars of C with rows padded to 16:
//   GEMM path: 2·M·d_qk (stacked and packed Q) + 2·Bk·d_qk (copied and packed K) + 2·M·Bk
//   (scores and packed P) + 2·Bk·d_v (copied and packed V) + M·d_v (accumulator) + M·Bk
//   (position tile) + 3·M (m, l, α). For float, M = 256, Bk = 64, d_qk = d_v = 128: about
//   0.7 MiB per thread, whatever S is.
//   Streaming path (M = 8, Bk = 512): M·d_qk + 2·M·Bk + M·d_v + 3·M, plus 32·(d_qk + d_v)
//   when K and V are widened before they are streamed (a panel of kStreamPanel = 32 keys at a time:
//   a storage type the streaming products do not widen in registers themselves, streams_in_place).
//   On apex's float kernels the GEMM path needs less: no packed Q, P or V, and the transposed
//   K is ⌈Bk / panel⌉·panel·d_qk (panel = 16 or 32 keys).
//   With bfloat16 products the GEMM path adds, in 32-bit pairs, M·⌈d_qk/2⌉ (Qs), ⌈Bk/32⌉·32·
//   ⌈d_qk/2⌉ (K_j), M·⌈Bk/2⌉ (P) and ⌈Bk/2⌉·d_v (V_j): no more than the packed buffers of
//   Eigen's path above. On AMX tiles Bk = amx_key_block = 256: for M = 256, d_qk = d_v = 128
//   about 1.6 MiB per thread.
//   With ALiBi, both paths add Bk (the key distances from the tile's first query).
// Split-key decoding also keeps, on the calling thread, the partial results of every chunk in
// partial_budget = 2^19 scalars (2 MiB of float) whatever S_k, and each merging thread
// ⌊S_k / decode_chunk⌋ + d_v scalars.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/detail/widen.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>

// Not part of the public API: the tile's position (b, kv head, first query, rows) and the
// BLAS-style lists of the schedulers; internal, each with one or two callers in this file.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
namespace apex::detail {

/// Block sizes and the decode split of the tiled kernel (see BLOCK SIZES above). The defaults are
/// what apex::sdpa uses; tests pass small ones to put block boundaries where they want them.
struct FlashBlocking {
  Index stacked_rows = 256;      ///< target M = G·Bq; Bq = max(1, stacked_rows / G)
  Index key_block = 64;          ///< Bk of the GEMM path
  Index amx_key_block = 256;     ///< Bk of the GEMM path with bfloat16 products on AMX tiles
  Index stream_rows = 8;         ///< M at or below which the streaming path is used instead
  Index stream_key_block = 512;  ///< Bk of the streaming path
  Index decode_chunk = 512;      ///< fewest keys per partial result when decoding
  Index split_below = 16;        ///< split keys only when B·H_kv is below this
  Index partial_budget = Index{1} << 19;  ///< most scalars of decode partials of one call
};

/// A run of keys with consecutive absolute positions [first_position, first_position + size()),
/// stored in one of two ways:
///   contiguous (pages null)  k [B, H_kv, n, d_qk] and v [B, H_kv, n, d_v]; size() = n;
///   paged                    k [pool pages, H_kv, page, d_qk] and v [pool pages, H_kv, page, d_v]
///                            are pools of pages (the views' batch axis is the page), and key
///                            row j lives in row j mod page of page pages[j / page]; size() =
///                            paged_rows, and the problem has one batch (b = 0).
/// The kernel reads a paged segment through its block table, page by page, never gathering it.
template <class TK, class TV>
struct KeySegment {
  HeadsView<const TK> k;
  HeadsView<const TV> v;
  Index first_position = 0;
  const Index* pages = nullptr;  // block table; null: contiguous
  Index paged_rows = 0;          // rows of a paged segment

  /// Keys in the segment.
  Index size() const { return pages == nullptr ? k.seq() : paged_rows; }
};

/// Rows of T at `data`, row j at data + j·stride.
template <class T>
struct ConstRows {
  const T* data;
  Index stride;
};

/// One head of a segment's K or V, read row by row: a contiguous head is one run of evenly
/// strided rows, a paged one a run per page.
template <class T>
class SegmentHead {
 public:
  /// Head (b, h) of `view` (a contiguous segment's K or V, or a pool of pages with `pages`).
  SegmentHead(const HeadsView<const T>& view, const Index* pages, Index b, Index h)
      : view_(view), pages_(pages), b_(b), h_(h) {}

  /// Width of a row.
  Index cols() const { return view_.dim(); }
  /// Rows from `row` to the end of its run (its page, or the head).
  Index run(Index row) const {
    if (pages_ == nullptr) return view_.seq() - row;
    return view_.seq() - row % view_.seq();
  }
  /// The rows of the run that starts at `row`.
  ConstRows<T> rows(Index row) const {
    if (pages_ == nullptr) {
      const auto head = view_.head(b_, h_);
      return {head.data() + row * head.outerStride(), head.outerStride()};
    }
    const Index page = view_.seq();
    const auto head = view_.head(pages_[row / page], h_);
    return {head.data() + row % page * head.outerStride(), head.outerStride()};
  }

 private:
  HeadsView<const T> view_;
  const Index* pages_;
  Index b_, h_;
};

/// The K and V heads (b, kv head) of a segment.
template <class TK, class TV>
SegmentHead<TK> key_head(const KeySegment<TK, TV>& segment, Index b, Index kv_head) {
  return {segment.k, segment.pages, b, kv_head};
}
template <class TK, class TV>
SegmentHead<TV> value_head(const KeySegment<TK, TV>& segment, Index b, Index kv_head) {
  return {segment.v, segment.pages, b, kv_head};
}

/// Everything a task needs, resolved once per call. Keys are the segments in order; key j of
/// the whole problem (a column of the dense masks) is row j − (keys before its segment) of its
/// segment. R is the type of the user's AttentionRules (attention_rules.hpp), NoRules for none.
template <class TQ, class TK, class TV, class TB, class R = NoRules>
struct AttentionProblem {
  using Query = TQ;
  using Key = TK;
  using Value = TV;
  using Bias = TB;
  using Rules = R;
  const R* rules = nullptr;  // the user's rules; null only when R is NoRules
  HeadsView<const TQ> q;
  const KeySegment<TK, TV>* segments = nullptr;
  Index num_segments = 0;
  PositionMask positions;         // the rule, on absolute positions
  Index first_query = 0;          // absolute position of query row 0
  HeadsView<const bool> allowed;  // empty: no dense mask
  HeadsView<const TB> bias;       // empty: no bias
  double scale = 1.0;
  double softcap = 0.0;                  // 0: off
  const double* sinks = nullptr;         // [H_q] extra logits of zero value; null: none
  const double* alibi_slopes = nullptr;  // [H_q] score += slope·(kp − qp); null: none
  bool bf16_products = false;            // SdpaParams::allow_bf16_products
  Index group = 1;                       // G = H_q / H_kv
  Index s_q = 0, s_k = 0, d_qk = 0, d_v = 0;
};

/// What the kernel writes: out [B, H_q, S_q, d_v] and, where not empty, [B, H_q, S_q, 1] views
/// of lse = m + log l and of the statistics m and l themselves.
template <class TO>
struct AttentionOutputs {
  HeadsView<TO> out, lse, max, sum;
};

/// Leading dimension of scratch rows: a multiple of 16 scalars, so that rows start on a cache
/// line and vectorised loops over a row peel the same way on every thread.
inline Index padded(Index n) { return (n + 15) / 16 * 16; }

/// Keys of one panel of the streaming path (a multiple of stream_update's groups of 8 keys).
constexpr Index kStreamPanel = 32;

/// A block length in [1, max(1, limit)].
inline Index clamp_block(Index block, Index limit) {
  return std::max<Index>(1, std::min(block, limit));
}

// ---------------------------------------------------------------------------------------------
// Loaders: every read of K and V
// ---------------------------------------------------------------------------------------------

/// The block copy: rows [row, row + n) of one head, written contiguously (n × cols) to `dst`
/// and widened from the storage type to C once per element, by widen() (vector conversions), one
/// run (page) at a time.
template <class C, class T>
void load_rows(const SegmentHead<T>& head, Index row, Index n, C* dst) {
  const Index cols = head.cols();
  while (n > 0) {
    const Index m = std::min(n, head.run(row));
    const ConstRows<T> src = head.rows(row);
    if (src.stride == cols) {  // one contiguous range: a single pass
      widen(src.data, dst, m * cols);
    } else {
      for (Index r = 0; r < m; ++r) widen(src.data + r * src.stride, dst + r * cols, cols);
    }
    row += m;
    n -= m;
    dst += m * cols;
  }
}

/// Rows [row, row + n) of one head as one block of evenly strided rows: in place when they lie
/// in one run, else copied as they are stored (nothing widened) into `buffer` (n × cols).
template <class T>
ConstRows<T> stored_rows(const SegmentHead<T>& head, Index row, Index n, T* buffer) {
  if (n <= head.run(row)) return head.rows(row);
  const Index cols = head.cols();
  for (Index done = 0; done < n;) {
    const Index m = std::min(n - done, head.run(row + done));
    const ConstRows<T> src = head.rows(row + done);
    for (Index r = 0; r < m; ++r) {
      std::copy_n(src.data + r * src.stride, cols, buffer + (done + r) * cols);
    }
    done += m;
  }
  return {buffer, cols};
}

/// Whether the streaming products read rows of T in place for compute type C: Eigen's when
/// kStreamsFrom<C, T> (the build's target widens T in registers), apex's float kernels when
/// `simd` is set and reads T (float, bfloat16, half); else rows are widened first (load_rows).
template <class C, class T>
bool streams_in_place(const FloatKernels* simd) {
  if constexpr (kStreamsFrom<C, T>) return true;
  return std::is_same_v<C, float> && !std::is_void_v<SimdElement<T>> && simd != nullptr;
}

/// The row reader: calls f(data, stride) for rows [row, row + n) of one head, inside one run
/// (n <= head.run(row)): in place (data a T*) when `in_place` (streams_in_place), else widened
/// into `buffer` (n × cols) by load_rows (data a C*).
template <class C, class T, class F>
void read_rows(const SegmentHead<T>& head, Index row, Index n, C* buffer, bool in_place, F&& f) {
  APEX_ASSERT(n <= head.run(row));
  if (in_place) {
    const ConstRows<T> rows = head.rows(row);
    f(rows.data, rows.stride);
  } else {
    load_rows(head, row, n, buffer);
    f(static_cast<const C*>(buffer), head.cols());
  }
}

/// The streaming products for rows of U (C, or T read in place), on apex's float kernels where
/// `simd` is set and reads U, else on Eigen's (stream_scores and stream_update, which read U:
/// streams_in_place said so):
///   scores:  s [rows × n] (ld_s) = q [rows × d] · kᵀ, key row j at k + j·stride;
///   update:  acc [rows × d_v] (ld_acc) += p [rows × n] (ld_p) · v, value row j at v + j·stride.
template <class C, class U>
void streamed_scores(const FloatKernels* simd, C* s, Index ld_s, const C* q, Index rows, const U* k,
                     Index stride, Index n, Index d) {
  if constexpr (std::is_same_v<C, float> && !std::is_void_v<SimdElement<U>>) {
    if (simd != nullptr) {
      return simd->rows<U>().dots(s, ld_s, q, rows, simd_elements(k), stride, n, d);
    }
  }
  if constexpr (kStreamsFrom<C, U>) {
    stream_scores(s, ld_s, q, rows, k, stride, n, d);
  } else {
    APEX_ASSERT(false);  // streams_in_place never reads such rows in place
  }
}
template <class C, class U>
void streamed_update(const FloatKernels* simd, C* acc, Index ld_acc, const C* p, Index ld_p,
                     Index rows, const U* v, Index stride, Index n, Index d_v) {
  if constexpr (std::is_same_v<C, float> && !std::is_void_v<SimdElement<U>>) {
    if (simd != nullptr) {
      return simd->rows<U>().update(acc, ld_acc, p, ld_p, rows, simd_elements(v), stride, n, d_v);
    }
  }
  if constexpr (kStreamsFrom<C, U>) {
    stream_update(acc, ld_acc, p, ld_p, rows, v, stride, n, d_v);
  } else {
    APEX_ASSERT(false);  // streams_in_place never reads such rows in place
  }
}

/// One block of keys of a problem: rows [row, row + n) of a segment, which are keys
/// [index, index + n) of the whole problem.
template <class TK, class TV>
struct KeyBlock {
  const KeySegment<TK, TV>* segment;
  Index row, n, index;
  Index position() const { return segment->first_position + row; }
};

/// The rows [begin, end) of a segment whose positions lie in `range` (empty: begin = end).
template <class TK, class TV>
std::pair<Index, Index> rows_in(const KeySegment<TK, TV>& segment, const PositionRange& range) {
  const Index first = segment.first_position;  // >= 0: the differences below cannot overflow
  const Index size = segment.size();
  const Index begin = range.begin <= first ? 0 : std::min(size, range.begin - first);
  const Index end = range.end <= first ? 0 : std::min(size, range.end - first);
  return {begin, std::max(begin, end)};
}

/// Calls f(KeyBlock) for the keys [begin, end) of the problem whose positions lie in `visible`
/// (visible_keys), in order, in blocks of at most `block` keys that never straddle two segments.
/// The blocks end on the segment's multiples of `block` (the first and last may be shorter), so
/// that a causal diagonal falls on whole blocks. Keys outside `visible` are never read.
template <class P, class F>
void for_each_key_block(const P& p, Index begin, Index end, const PositionRange& visible,
                        Index block, F&& f) {
  Index first = 0;  // problem index of the segment's first key
  for (Index s = 0; s < p.num_segments; ++s) {
    const auto& segment = p.segments[s];
    const Index size = segment.size();
    const auto [row_begin, row_end] = rows_in(segment, visible);
    const Index lo = std::max(begin, first + row_begin);
    const Index hi = std::min(end, first + row_end);
    for (Index k0 = lo; k0 < hi;) {
      const Index stop = std::min(hi, first + ((k0 - first) / block + 1) * block);
      f(KeyBlock<typename P::Key, typename P::Value>{&segment, k0 - first, stop - k0, k0});
      k0 = stop;
    }
    first += size;
  }
}

/// The sink of query head h in C: an extra logit of every row of the head, or -inf (none).
template <class C, class P>
C sink_of(const P& p, Index h) {
  return p.sinks != nullptr ? static_cast<C>(p.sinks[h]) : -std::numeric_limits<C>::infinity();
}

// ---------------------------------------------------------------------------------------------
// The tile: one task's stacked query rows while key blocks stream past
// ---------------------------------------------------------------------------------------------

template <class P>
Index key_block_for(const P& p, bool streaming, const FlashBlocking& blocking, Index keys);

/// The running state of one task (M = G·bq stacked rows of the G heads that share key/value head
/// (b, kv_head), query rows [q0, q0 + bq)), computing in C.
template <class C, class P>
class AttentionTile {
 public:
  using Block = KeyBlock<typename P::Key, typename P::Value>;

  /// `streaming` picks the path; key_block is the most keys add_keys will be given at once;
  /// `blocking` sizes the scratch (allocate).
  AttentionTile(const P& p, Index b, Index kv_head, Index q0, Index bq, Index key_block,
                bool streaming, const FlashBlocking& blocking)
      : p_(p),
        streaming_(streaming),
        simd_(std::is_same_v<C, float> ? float_kernels() : nullptr),
        bf16_(simd_ != nullptr && p.bf16_products && !streaming ? simd_->bf16 : nullptr),
        k_in_place_(streams_in_place<C, typename P::Key>(simd_)),
        v_in_place_(streams_in_place<C, typename P::Value>(simd_)),
        b_(b),
        kv_head_(kv_head),
        q0_(q0),
        bq_(bq),
        rows_(p.group * bq),
        ld_s_(padded(key_block)),
        ld_acc_(padded(p.d_v)) {
    allocate(key_block, blocking);
    load_queries();
    std::fill(stats_, stats_ + rows_, SoftmaxStats<C>{});
    std::fill(acc_, acc_ + rows_ * ld_acc_, C(0));
  }

  Index rows() const { return rows_; }
  /// Whether a raw score was not finite where it matters (a float pass must then be redone in
  /// double); a NaN or +inf one shows in its row's result instead.
  bool saw_non_finite_score() const { return non_finite_score_; }

  /// Folds one block of keys into the running state: score, mask, softmax, accumulate.
  void add_keys(const Block& keys) {
    const Index query_pos = p_.first_query + q0_;
    const PositionRange q{query_pos, query_pos + bq_};
    const PositionRange k{keys.position(), keys.position() + keys.n};
    const BlockCoverage coverage = classify_block(p_.positions, q.begin, q.end, k.begin, k.end);
    if (coverage == BlockCoverage::kNone) return;
    const BlockCoverage user = user_coverage(p_.rules, b_, kv_head_ * p_.group, p_.group, q, k);
    if (user == BlockCoverage::kNone) return;
    // A score rule may return -inf: the raw scores are checked before it, as before a mask.
    const bool masked = coverage == BlockCoverage::kPartial || user == BlockCoverage::kPartial ||
                        !p_.allowed.empty() || !p_.bias.empty() || P::Rules::kScores;
    score(keys, masked);
    if (masked || p_.softcap > 0.0 || p_.alibi_slopes != nullptr || P::Rules::kScores) {
      mask(keys, coverage, user);
    }
    const bool hidden = softmax(keys.n);
    // Unmasked, a key takes no part only when its raw score is -inf (see score()).
    if (!masked && hidden) non_finite_score_ = true;
    accumulate(keys, hidden);
  }

  /// Ends stacked row r: writes its d_v outputs to `out` (rounded once to T) and returns its
  /// statistics (softmax_finish), with the head's sink when `sink` is set (a whole row; a part
  /// of a row that is merged later leaves the sink to the merge).
  template <class T>
  SoftmaxStats<C> finish_row(Index r, T* out, bool sink) const {
    return softmax_finish(stats_[r], acc_ + r * ld_acc_, p_.d_v, out,
                          sink ? sink_of<C>(p_, head_of(r)) : -std::numeric_limits<C>::infinity());
  }

  /// Whether the running state holds only finite numbers: every row's statistics (or those of
  /// a row in which no key took part) and its accumulator. Its outputs are then finite too.
  bool finite() const {
    for (Index r = 0; r < rows_; ++r) {
      if (!finite_stats(stats_[r])) return false;
    }
    return all_finite(acc_, rows_, p_.d_v, ld_acc_);
  }

  /// Query head and query row of stacked row r.
  Index head_of(Index r) const { return kv_head_ * p_.group + r / bq_; }
  Index query_of(Index r) const { return q0_ + r % bq_; }

 private:
  using RowArray = Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>;

  /// Points the buffers into the thread's scratch, each asked for at the size of the path's
  /// largest tile (its most rows, its key block unclamped by S_k) rather than this tile's, so
  /// that what a thread holds depends on neither S_q, S_k nor which task it runs (scratch.hpp,
  /// ALLOCATION).
  void allocate(Index key_block, const FlashBlocking& blocking) {
    ThreadScratch& scratch = ThreadScratch::local();
    const auto get = [&](ScratchSlot slot, Index count) { return scratch.get<C>(slot, count); };
    const bool gemm = !streaming_;
    const bool widen_k = !k_in_place_;
    const bool widen_v = !v_in_place_;
    // Every tile has at most max(G, stacked_rows) rows (plan_attention), a streaming one also at
    // most stream_rows.
    const Index largest = std::max(p_.group, blocking.stacked_rows);
    const Index rows = std::max(rows_, gemm ? largest : std::min(largest, blocking.stream_rows));
    const Index keys = std::max(
        key_block, key_block_for(p_, streaming_, blocking, std::numeric_limits<Index>::max()));
    const Index ld_s = padded(keys);
    q_stacked_ = get(ScratchSlot::kQStacked, rows * p_.d_qk);
    // The streaming path widens one panel of keys at a time (kStreamPanel rows).
    const Index copied = gemm ? keys : std::min(keys, kStreamPanel);
    if (gemm || widen_k) k_copy_ = get(ScratchSlot::kKCopy, copied * p_.d_qk);
    if (gemm || widen_v) v_copy_ = get(ScratchSlot::kVCopy, copied * p_.d_v);
    if (bf16_ != nullptr) {
      const auto pairs = [&](ScratchSlot slot, Index count) {
        return scratch.get<Bf16Pair>(slot, count);
      };
      q_pairs_ = pairs(ScratchSlot::kQPacked, rows * Bf16Kernels::pairs(p_.d_qk));
      k_pairs_ = pairs(ScratchSlot::kKPacked, bf16_->packed_pairs(keys, p_.d_qk));
      p_pairs_ = pairs(ScratchSlot::kPPacked, rows * Bf16Kernels::pairs(keys));
      v_pairs_ = pairs(ScratchSlot::kVPacked, Bf16Kernels::pairs(keys) * p_.d_v);
    } else if (gemm && simd_ != nullptr) {
      k_packed_ = get(ScratchSlot::kKPacked, simd_->packed_size(keys, p_.d_qk));
    } else if (gemm && TileGemm<C>::kPacks) {
      q_packed_ = get(ScratchSlot::kQPacked, rows * p_.d_qk);
      k_packed_ = get(ScratchSlot::kKPacked, keys * p_.d_qk);
      p_packed_ = get(ScratchSlot::kPPacked, rows * keys);
      v_packed_ = get(ScratchSlot::kVPacked, keys * p_.d_v);
    }
    scores_ = get(ScratchSlot::kScores, rows * ld_s);
    acc_ = get(ScratchSlot::kAcc, rows * ld_acc_);
    position_tile_ = get(ScratchSlot::kPositionTile, rows * ld_s);  // bq_ <= rows of ld_s_
    if (p_.alibi_slopes != nullptr) alibi_ = get(ScratchSlot::kAlibi, ld_s);
    stats_ = scratch.get<SoftmaxStats<C>>(ScratchSlot::kRowStats, rows);
    alpha_ = get(ScratchSlot::kRowScale, rows);
  }

  /// Qs = scale·Q with the G heads' rows stacked, widened to C; packed once for the GEMM path.
  void load_queries() {
    const C scale = static_cast<C>(p_.scale);
    for (Index g = 0; g < p_.group; ++g) {
      Eigen::Map<RowMatrix<C>>(q_stacked_ + g * bq_ * p_.d_qk, bq_, p_.d_qk) =
          p_.q.head(b_, kv_head_ * p_.group + g).middleRows(q0_, bq_).template cast<C>() * scale;
    }
    if (!streaming_ && simd_ == nullptr) {
      TileGemm<C>::pack_queries(q_packed_, q_stacked_, rows_, p_.d_qk);
    }
    if constexpr (std::is_same_v<C, float>) {
      if (bf16_ != nullptr) {
        const Index d = p_.d_qk;
        bf16_->round_pairs(q_pairs_, Bf16Kernels::pairs(d), q_stacked_, d, rows_, d);
      }
    }
  }

  /// score: S (rows × n, leading dimension ld_s) = Qs·Kᵀ for the block's keys. A float pass
  /// also notes whether a raw score is not finite (see COMPUTE TYPE): NaN and +inf show in the
  /// row's result, and -inf, in a block nothing masks, as a key that takes no part (add_keys);
  /// a block that is masked checks its raw scores here, before the masks hide them.
  void score(const Block& keys, bool masked) {
    const auto k_head = key_head(*keys.segment, b_, kv_head_);
    if (streaming_) {
      for_each_panel(k_head, keys, [&](Index j0, Index m) {
        read_rows(k_head, keys.row + j0, m, k_copy_, k_in_place_, [&](const auto* k, Index stride) {
          streamed_scores(simd_, scores_ + j0, ld_s_, q_stacked_, rows_, k, stride, m, p_.d_qk);
        });
      });
    } else {
      tile_scores(k_head, keys);
    }
    if constexpr (std::is_same_v<C, float>) {
      if (masked && !non_finite_score_) {
        non_finite_score_ = !all_finite(scores_, rows_, keys.n, ld_s_);
      }
    }
  }

  /// S = Qs·Kᵀ on the GEMM path for the block's keys: on the bfloat16 dot products where
  /// allowed (paired_scores), else K_j copied to k_copy_ (widened) and on apex's float kernels
  /// (K transposed into their panels) or on Eigen's.
  void tile_scores(const SegmentHead<typename P::Key>& k_head, const Block& keys) {
    const Index d = p_.d_qk, n = keys.n;
    if constexpr (std::is_same_v<C, float>) {
      if (bf16_ != nullptr) return paired_scores(k_head, keys);
    }
    load_rows<C>(k_head, keys.row, n, k_copy_);
    if constexpr (std::is_same_v<C, float>) {
      if (simd_ != nullptr) {
        simd_->pack_transposed(k_packed_, k_copy_, d, n, d);
        simd_->f32.gemm(scores_, ld_s_, q_stacked_, d, k_packed_, simd_->panel, d * simd_->panel,
                        rows_, n, d, false, nullptr);
        return;
      }
    }
    TileGemm<C>::scores(scores_, ld_s_, k_copy_, k_packed_, q_packed_, q_stacked_, rows_, n, d);
  }

  /// S = Qs·Kᵀ on the bfloat16 dot products, Qs and K rounded, in pairs along d_qk: K_j
  /// packed into panels of pairs from its stored rows when they are bfloat16 (in place, or
  /// copied where the block spans pages), else from its widened copy.
  void paired_scores(const SegmentHead<typename P::Key>& k_head, const Block& keys) {
    using Key = typename P::Key;
    const Index d = p_.d_qk, n = keys.n, pairs = Bf16Kernels::pairs(d);
    if constexpr (std::is_same_v<Key, Eigen::bfloat16>) {
      const ConstRows<Key> k = stored_rows(k_head, keys.row, n, stored_copy<Key>(k_copy_));
      bf16_->pack_keys_bf16(k_pairs_, simd_elements(k.data), k.stride, n, d);
    } else {
      load_rows<C>(k_head, keys.row, n, k_copy_);
      bf16_->pack_keys(k_pairs_, k_copy_, d, n, d);
    }
    bf16_->gemm(scores_, ld_s_, q_pairs_, pairs, k_pairs_, bf16_->panel, pairs * bf16_->panel,
                rows_, n, pairs, false, nullptr);
  }

  /// acc = diag(α)·acc + P·V on the GEMM path for the n values in v_copy_: on the bfloat16 dot
  /// products (P and V rounded, in pairs along the keys) or apex's float kernels, which scale
  /// each row as they load it (the same bits as scaling first: x·1 = x), or on Eigen's after
  /// rescale_acc.
  void tile_update(Index n) {
    if constexpr (std::is_same_v<C, float>) {
      if (bf16_ != nullptr) {
        bf16_->pack_values(v_pairs_, v_copy_, p_.d_v, n, p_.d_v);
        return paired_update(n);
      }
      if (simd_ != nullptr) {
        simd_->f32.gemm(acc_, ld_acc_, scores_, ld_s_, v_copy_, p_.d_v, simd_->panel, rows_, p_.d_v,
                        n, true, rescale_ ? alpha_ : nullptr);
        return;
      }
    }
    rescale_acc();
    TileGemm<C>::update(acc_, ld_acc_, scores_, ld_s_, p_packed_, v_copy_, v_packed_, rows_, n,
                        p_.d_v);
  }

  /// acc = diag(α)·acc + P·V on the bfloat16 dot products, V_j's n values in v_pairs_ and P's
  /// rounded by softmax in p_pairs_.
  void paired_update(Index n) {
    const Index pairs = Bf16Kernels::pairs(n);
    bf16_->gemm(acc_, ld_acc_, p_pairs_, pairs, v_pairs_, p_.d_v, bf16_->panel, rows_, p_.d_v,
                pairs, true, rescale_ ? alpha_ : nullptr);
  }

  /// The scratch of a block copy (room for Bk rows of C) as room for as many rows of T stored
  /// as they are (T no wider than C).
  template <class T>
  static T* stored_copy(C* buffer) {
    static_assert(sizeof(T) <= sizeof(C));
    return reinterpret_cast<T*>(buffer);  // NOLINT: scratch bytes, reused for narrower values
  }

  /// mask: every row's scores are modified (modify_row), then the rules forbid keys
  /// (forbid_row); `coverage` is what the PositionMask says of the block, `user` what the user's
  /// mask rule says.
  void mask(const Block& keys, BlockCoverage coverage, BlockCoverage user) {
    if (coverage == BlockCoverage::kPartial) fill_position_tile(keys);
    if (p_.alibi_slopes != nullptr) fill_alibi(keys);
    for (Index r = 0; r < rows_; ++r) {
      RowArray s(scores_ + r * ld_s_, keys.n);
      modify_row(s, head_of(r), query_of(r), keys);
      forbid_row(s, head_of(r), query_of(r), keys, coverage, user);
    }
  }

  /// The terms of a row's scores, in order: softcap(x) = c·tanh(x / c) on the scaled score,
  /// ALiBi's slope·(kp − qp), the user's score rule. Row i of query head h.
  void modify_row(RowArray& s, Index h, Index i, const Block& keys) const {
    const Index n = keys.n;
    const C softcap = static_cast<C>(p_.softcap);
    if (softcap > C(0)) s = softcap * (s * (C(1) / softcap)).tanh();
    const Index qp = p_.first_query + i;
    if (p_.alibi_slopes != nullptr) {
      // kp − qp = (kp − qp0) − (qp − qp0), qp0 the tile's first query: a difference of integers,
      // exact in C, so the term slope·(kp − qp) is rounded once, as the reference rounds it.
      const C slope = static_cast<C>(p_.alibi_slopes[h]);
      s += slope * (RowArray(alibi_, n) - static_cast<C>(i - q0_));
    }
    if constexpr (P::Rules::kScores) {
      for (Index j = 0; j < n; ++j) {
        s[j] = static_cast<C>(p_.rules->score(b_, h, qp, keys.position() + j, s[j]));
      }
    }
  }

  /// The bias, then the position rule, the dense mask and the user's mask rule, which select
  /// -inf rather than add, so that a forbidden key's score is -inf whatever its key or bias held
  /// (NaN included). Row i of query head h.
  void forbid_row(RowArray& s, Index h, Index i, const Block& keys, BlockCoverage coverage,
                  BlockCoverage user) const {
    constexpr C kNegInf = -std::numeric_limits<C>::infinity();
    const Index n = keys.n;
    if (!p_.bias.empty()) {
      // A bias of -inf forbids the key even where the score is NaN (NaN + -inf is NaN).
      const auto bias =
          p_.bias.head(b_, h).row(i).segment(keys.index, n).array().template cast<C>();
      s = (bias == kNegInf).select(kNegInf, s + bias);
    }
    if (coverage == BlockCoverage::kPartial) {
      forbid_unless_positive(s.data(), position_tile_ + (i - q0_) * ld_s_, n);
    }
    if (!p_.allowed.empty()) {
      const bool* allowed = p_.allowed.head(b_, h).row(i).data() + keys.index;
      for (Index j = 0; j < n; ++j) {
        if (!allowed[j]) s[j] = kNegInf;
      }
    }
    if constexpr (P::Rules::kMasks) {
      if (user != BlockCoverage::kPartial) return;
      const Index qp = p_.first_query + i;
      for (Index j = 0; j < n; ++j) {
        if (!p_.rules->allows(b_, h, qp, keys.position() + j)) s[j] = kNegInf;
      }
    }
  }

  /// alibi(j) = kp_j − qp0 for the block's keys, qp0 the tile's first query position: the key
  /// distances of its first row, formed once per block and shared by every head (exact integers
  /// in C below 2^24 in float; fits_float keeps the terms finite).
  void fill_alibi(const Block& keys) {
    const C first = static_cast<C>(keys.position() - (p_.first_query + q0_));
    RowArray(alibi_, keys.n) =
        Eigen::Array<C, 1, Eigen::Dynamic>::LinSpaced(keys.n, first, first + C(keys.n - 1));
  }

  /// position_tile(i, j) = +inf where the PositionMask allows query q0 + i and the block's key j,
  /// -inf where it forbids the pair: evaluated once per block, shared by the G stacked heads.
  void fill_position_tile(const Block& keys) {
    constexpr C kInf = std::numeric_limits<C>::infinity();
    const Index query_pos = p_.first_query + q0_;
    for (Index i = 0; i < bq_; ++i) {
      C* tile = position_tile_ + i * ld_s_;
      for (Index j = 0; j < keys.n; ++j) {
        tile[j] = p_.positions.allows(query_pos + i, keys.position() + j) ? kInf : -kInf;
      }
    }
  }

  /// softmax: the online-softmax update of every row (softmax_update), and with bfloat16
  /// products the row's weights rounded into pairs for P·V while they are at hand. Notes in α
  /// and rescale_ the rows whose maximum moved. Returns whether some key of the block takes no
  /// part in some row.
  bool softmax(Index n) {
    rescale_ = false;
    bool hidden = false;
    const Index pairs = Bf16Kernels::pairs(n);  // of a row of P for the bfloat16 products
    for (Index r = 0; r < rows_; ++r) {
      C* s = scores_ + r * ld_s_;
      alpha_[r] = softmax_update(stats_[r], s, n, hidden, simd_);
      rescale_ = rescale_ || alpha_[r] != C(1);
      if constexpr (std::is_same_v<C, float>) {
        if (bf16_ != nullptr) bf16_->round_pairs(p_pairs_ + r * pairs, pairs, s, ld_s_, 1, n);
      }
    }
    return hidden;
  }

  /// acc *= α for the rows whose maximum moved (softmax), unless the update does it itself.
  void rescale_acc() {
    if (!rescale_) return;
    for (Index r = 0; r < rows_; ++r) {
      if (alpha_[r] != C(1)) RowArray(acc_ + r * ld_acc_, p_.d_v) *= alpha_[r];
    }
  }

  /// accumulate: acc += P·V for the block's values. Where some key takes no part (`hidden`)
  /// and the block holds a value that is not finite, only the keys that take part are added (a
  /// weight of -0.0 times NaN would be NaN).
  void accumulate(const Block& keys, bool hidden) {
    if (p_.d_v == 0) return;
    const auto v_head = value_head(*keys.segment, b_, kv_head_);
    if (streaming_) {
      rescale_acc();
      for_each_panel(v_head, keys, [&](Index j0, Index m) {
        read_rows(v_head, keys.row + j0, m, v_copy_, v_in_place_, [&](const auto* v, Index stride) {
          using U = std::remove_const_t<std::remove_pointer_t<decltype(v)>>;
          if (hidden && !all_finite(v, m, p_.d_v, stride)) {
            accumulate_visible(ConstRows<U>{v, stride}, j0, m);
          } else {
            streamed_update(simd_, acc_, ld_acc_, scores_ + j0, ld_s_, rows_, v, stride, m, p_.d_v);
          }
        });
      });
      return;
    }
    using Value = typename P::Value;
    if constexpr (std::is_same_v<C, float> && std::is_same_v<Value, Eigen::bfloat16>) {
      if (bf16_ != nullptr) {  // packed from the stored rows
        const ConstRows<Value> v =
            stored_rows(v_head, keys.row, keys.n, stored_copy<Value>(v_copy_));
        if (hidden && !all_finite(v.data, keys.n, p_.d_v, v.stride)) {
          rescale_acc();
          accumulate_visible(v, 0, keys.n);
        } else {
          bf16_->pack_values_bf16(v_pairs_, simd_elements(v.data), v.stride, keys.n, p_.d_v);
          paired_update(keys.n);
        }
        return;
      }
    }
    load_rows<C>(v_head, keys.row, keys.n, v_copy_);
    const ConstRows<C> v{v_copy_, p_.d_v};
    if (hidden && !all_finite(v.data, keys.n, p_.d_v, v.stride)) {
      rescale_acc();
      accumulate_visible(v, 0, keys.n);
    } else {
      tile_update(keys.n);
    }
  }

  /// Calls f(j0, m) for the panels [j0, j0 + m) of a streamed block, in order: kStreamPanel keys
  /// each, cut short where a page of `head` ends. A 16-bit panel is widened just before it is
  /// used, so that reading memory and the arithmetic overlap; the panels start at multiples of
  /// stream_update's groups of keys (pages of a multiple of 8 keys keep them there), so a row's
  /// sums are formed in the same order whatever the storage type.
  template <class T, class F>
  static void for_each_panel(const SegmentHead<T>& head, const Block& keys, F&& f) {
    for (Index j0 = 0; j0 < keys.n;) {
      const Index m = std::min({kStreamPanel, keys.n - j0, head.run(keys.row + j0)});
      f(j0, m);
      j0 += m;
    }
  }

  /// acc_r += Σ_j P(r, j0 + j) v_j for the n value rows of v, over the keys that take part
  /// (weight without the sign bit), one row at a time: the slow path of blocks whose hidden keys
  /// may hold NaN or ±inf values.
  template <class T>
  void accumulate_visible(const ConstRows<T>& v, Index j0, Index n) {
    using Values = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>;
    for (Index r = 0; r < rows_; ++r) {
      RowArray acc(acc_ + r * ld_acc_, p_.d_v);
      const C* weight = scores_ + r * ld_s_ + j0;
      for (Index j = 0; j < n; ++j) {
        if (!std::signbit(weight[j])) {
          acc += weight[j] * Values(v.data + j * v.stride, p_.d_v).template cast<C>();
        }
      }
    }
  }

  const P& p_;
  bool streaming_;
  const FloatKernels* simd_;      // the products and the softmax on apex's own kernels (float)
  const Bf16Kernels* bf16_;       // the GEMM path's products on bfloat16 dot products, if allowed
  bool k_in_place_, v_in_place_;  // streams_in_place for K and V
  bool rescale_ = false;          // some α of the last softmax is not 1
  bool non_finite_score_ = false;
  Index b_, kv_head_, q0_, bq_, rows_, ld_s_, ld_acc_;
  C* q_stacked_ = nullptr;
  C* q_packed_ = nullptr;
  C* k_copy_ = nullptr;
  C* k_packed_ = nullptr;
  Bf16Pair* q_pairs_ = nullptr;  // Qs, K_j, P and V_j rounded, for bf16_
  Bf16Pair* k_pairs_ = nullptr;
  Bf16Pair* p_pairs_ = nullptr;
  Bf16Pair* v_pairs_ = nullptr;
  C* scores_ = nullptr;
  C* p_packed_ = nullptr;
  C* v_copy_ = nullptr;
  C* v_packed_ = nullptr;
  C* acc_ = nullptr;
  C* position_tile_ = nullptr;
  C* alibi_ = nullptr;  // [ld_s]: kp − qp0, the key distances of the tile's first row
  SoftmaxStats<C>* stats_ = nullptr;
  C* alpha_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Schedulers
// ---------------------------------------------------------------------------------------------

/// How a call is cut into tasks, from the shapes and the blocking alone (never the thread count).
struct AttentionPlan {
  Index query_block = 1;   ///< Bq
  Index query_blocks = 0;  ///< ⌈S_q / Bq⌉
  bool split = false;      ///< split-key decoding
  Index chunk = 0;         ///< keys per chunk when split
  Index chunks = 0;        ///< chunks per (b, kv head) when split
  Index first_key = 0;     ///< problem index of the first key of chunk 0 when split
};

/// The keys of queries [q0, q0 + bq) of a problem: visible_keys of their absolute positions.
template <class P>
PositionRange visible_keys_of(const P& p, Index q0, Index bq) {
  return visible_keys(p.positions, p.first_query + q0, p.first_query + q0 + bq);
}

/// The problem indices [begin, end) that hold every key in `visible` (a hull: the segments may
/// hold keys between them that are not visible; begin = end when none is).
template <class P>
std::pair<Index, Index> key_hull(const P& p, const PositionRange& visible) {
  Index first = 0;
  Index begin = p.s_k;
  Index end = 0;
  for (Index s = 0; s < p.num_segments; ++s) {
    const auto [lo, hi] = rows_in(p.segments[s], visible);
    if (lo < hi) {
      begin = std::min(begin, first + lo);
      end = std::max(end, first + hi);
    }
    first += p.segments[s].size();
  }
  return {begin, std::max(begin, end)};
}

/// The key block of a tile, for the path it takes: amx_key_block where the GEMM path's products
/// run on AMX tiles (bfloat16 products permitted on KernelIsa::kAmx).
template <class P>
Index key_block_for(const P& p, bool streaming, const FlashBlocking& blocking, Index keys) {
  const bool tiles = !streaming && p.bf16_products && kernel_isa() == KernelIsa::kAmx;
  const Index block = streaming ? blocking.stream_key_block
                      : tiles   ? blocking.amx_key_block
                                : blocking.key_block;
  return clamp_block(block, keys);
}

/// Query blocks of Bq = stacked_rows / G rows. Keys are split when every query fits in one
/// block (a few new tokens against a long cache), the (b, kv head) pairs are fewer than
/// split_below (so that the threads would otherwise idle), and the partial results of at least
/// two chunks per pair fit in partial_budget scalars: B·H_kv·chunks·M·(d_v + 2) <= budget, M =
/// G·S_q. The chunks are as many as fit (each at least decode_chunk keys, a whole number of key
/// blocks), so the partials are bounded whatever S_k, and a call with many query rows, whose
/// tasks are compute-bound anyway, is not split. Only the keys the queries may see are cut
/// (key_hull of visible_keys): a window over a long cache splits its window, not the cache.
template <class P>
AttentionPlan plan_attention(const P& p, Index kv_heads, const FlashBlocking& blocking) {
  AttentionPlan plan;
  plan.query_block = std::min(std::max<Index>(1, blocking.stacked_rows / p.group), p.s_q);
  plan.query_blocks = (p.s_q + plan.query_block - 1) / plan.query_block;
  const Index pairs = p.q.batch() * kv_heads;
  const Index shortest = std::max<Index>(1, blocking.decode_chunk);
  if (plan.query_blocks != 1 || pairs >= blocking.split_below) return plan;
  const auto [first, end] = key_hull(p, visible_keys_of(p, 0, p.s_q));
  const Index keys = end - first;
  if (keys < 2 * shortest) return plan;
  const Index record = p.group * p.s_q * (p.d_v + 2);  // scalars of one chunk's partial result
  const Index fit = blocking.partial_budget / std::max<Index>(1, pairs * record);
  const Index wanted = std::min(fit, keys / shortest);  // chunks per pair
  if (wanted < 2) return plan;
  const bool streaming = p.group * p.s_q <= blocking.stream_rows;
  const Index block = key_block_for(p, streaming, blocking, keys);
  plan.chunk = (keys + wanted - 1) / wanted;
  if (plan.chunk > block) plan.chunk = (plan.chunk + block - 1) / block * block;
  plan.chunks = (keys + plan.chunk - 1) / plan.chunk;
  plan.first_key = first;
  plan.split = plan.chunks >= 2;
  return plan;
}

/// Writes a finished row's lse, max and sum where those outputs exist.
template <class C, class TO>
void write_row_stats(const AttentionOutputs<TO>& o, Index b, Index h, Index i,
                     const SoftmaxStats<C>& stats) {
  if (!o.lse.empty()) o.lse.head(b, h)(i, 0) = round_to<TO>(log_sum_exp(stats));
  if (!o.max.empty()) o.max.head(b, h)(i, 0) = round_to<TO>(stats.max);
  if (!o.sum.empty()) o.sum.head(b, h)(i, 0) = round_to<TO>(stats.sum);
}

/// One problem of a call of the kernel and where its results go. A call is a list of jobs (one
/// for sdpa, one per sequence of a ragged batch) whose tasks run side by side.
template <class P, class TO>
struct AttentionJob {
  const P* problem = nullptr;
  AttentionOutputs<TO> outputs;
};

/// A job's share of one wave of tasks: its plan, and where its tasks, its merges (split only)
/// and its partial results (split only) lie in the wave's lists.
struct JobTasks {
  AttentionPlan plan;
  Index kv_heads = 0;
  Index pairs = 0;          ///< (b, kv head) pairs
  Index rows = 0;           ///< stacked rows of a split task, G·S_q
  Index first_task = 0;     ///< the wave's tasks [first_task, first_task + tasks) are the job's
  Index tasks = 0;          ///< pairs · query blocks, or pairs · chunks when split
  Index first_merge = 0;    ///< the wave's merges [first_merge, first_merge + pairs) (split)
  Index first_partial = 0;  ///< offset of the job's partial results in the wave's (split)
  Index partials = 0;       ///< scalars of them: pairs · chunks · rows · (d_v + 2)
};

/// The plan of a job and the size of its task lists (first_* are set by the wave).
template <class P>
JobTasks job_tasks(const P& p, const FlashBlocking& blocking) {
  JobTasks t;
  t.kv_heads = p.segments[0].k.heads();
  t.plan = plan_attention(p, t.kv_heads, blocking);
  t.pairs = p.q.batch() * t.kv_heads;
  t.rows = p.group * p.s_q;
  t.tasks = t.pairs * (t.plan.split ? t.plan.chunks : t.plan.query_blocks);
  t.partials = t.plan.split ? t.pairs * t.plan.chunks * t.rows * (p.d_v + 2) : 0;
  return t;
}

/// Whether a tile met a non-finite number that a float pass must redo in double.
template <class C, class Tile>
bool tile_finite(const Tile& tile) {
  return !std::is_same_v<C, float> || (!tile.saw_non_finite_score() && tile.finite());
}

/// Prefill task `task` of a job: (b, kv head, query block), the block's visible keys in
/// blocks; writes its rows. Within one (b, kv head) the query blocks are taken in the order 0,
/// n−1, 1, n−2, … (see THREADS). Returns tile_finite.
template <class C, class P, class TO>
bool prefill_task(const P& p, const JobTasks& t, const AttentionOutputs<TO>& o, Index task,
                  const FlashBlocking& blocking) {
  const Index blocks = t.plan.query_blocks;
  const Index pair = task / blocks;
  const Index n = task - pair * blocks;
  const Index block = n % 2 == 0 ? n / 2 : blocks - 1 - n / 2;
  const Index b = pair / t.kv_heads;
  const Index q0 = block * t.plan.query_block;
  const Index bq = std::min(t.plan.query_block, p.s_q - q0);
  const bool streaming = p.group * bq <= blocking.stream_rows;
  const Index key_block = key_block_for(p, streaming, blocking, p.s_k);
  AttentionTile<C, P> tile(p, b, pair - b * t.kv_heads, q0, bq, key_block, streaming, blocking);
  for_each_key_block(p, 0, p.s_k, visible_keys_of(p, q0, bq), key_block,
                     [&](const auto& keys) { tile.add_keys(keys); });
  for (Index r = 0; r < tile.rows(); ++r) {
    const Index h = tile.head_of(r);
    const Index i = tile.query_of(r);
    write_row_stats<C>(o, b, h, i, tile.finish_row(r, o.out.head(b, h).row(i).data(), true));
  }
  return tile_finite<C>(tile);
}

/// Split-decode task `task` of a job: (b, kv head, key chunk); writes the partial result of
/// its keys for the job's stacked rows, a record of d_v + 2 scalars each (normalised output, m,
/// l, without the sink), to `partials` (the job's). Returns tile_finite.
template <class C, class P>
bool chunk_task(const P& p, const JobTasks& t, Index task, C* partials,
                const FlashBlocking& blocking) {
  const Index pair = task / t.plan.chunks;
  const Index c = task - pair * t.plan.chunks;
  const Index b = pair / t.kv_heads;
  const bool streaming = t.rows <= blocking.stream_rows;
  const Index key_block = key_block_for(p, streaming, blocking, t.plan.chunk);
  AttentionTile<C, P> tile(p, b, pair - b * t.kv_heads, 0, p.s_q, key_block, streaming, blocking);
  const Index begin = t.plan.first_key + c * t.plan.chunk;
  for_each_key_block(p, begin, std::min(p.s_k, begin + t.plan.chunk), visible_keys_of(p, 0, p.s_q),
                     key_block, [&](const auto& keys) { tile.add_keys(keys); });
  const Index record = p.d_v + 2;
  C* partial = partials + task * t.rows * record;
  for (Index r = 0; r < t.rows; ++r) {
    const SoftmaxStats<C> stats = tile.finish_row(r, partial + r * record, false);
    partial[r * record + p.d_v] = stats.max;
    partial[r * record + p.d_v + 1] = stats.sum;
  }
  return tile_finite<C>(tile);
}

/// Merge task `pair` of a split job: merges the chunks of (b, kv head) in order and adds the
/// sink (merge_rows), writing the rows. Returns whether every merged row is finite (float).
template <class C, class P, class TO>
bool merge_task(const P& p, const JobTasks& t, const AttentionOutputs<TO>& o, Index pair,
                const C* partials, const FlashBlocking& blocking) {
  const Index chunks = t.plan.chunks;
  const Index b = pair / t.kv_heads;
  const Index kv_head = pair - b * t.kv_heads;
  const Index record = p.d_v + 2;
  const C* first = partials + pair * chunks * t.rows * record;
  // Asked for at ⌊S_k / decode_chunk⌋ >= chunks (plan_attention), which grows with S_k alone.
  const Index most_chunks = p.s_k / std::max<Index>(1, blocking.decode_chunk);
  C* weights = ThreadScratch::local().get<C>(ScratchSlot::kMergeWeights, most_chunks + p.d_v);
  bool ok = true;
  for (Index r = 0; r < t.rows; ++r) {
    const auto part_at = [&](Index c) {
      const C* rec = first + (c * t.rows + r) * record;
      return PartRow<C, C>{rec, {rec[p.d_v], rec[p.d_v + 1]}};
    };
    const Index h = kv_head * p.group + r / p.s_q;
    const Index i = r % p.s_q;
    TO* out = o.out.head(b, h).row(i).data();
    const SoftmaxStats<C> stats =
        merge_rows<C>(chunks, p.d_v, part_at, out, weights, weights + chunks, sink_of<C>(p, h));
    write_row_stats<C>(o, b, h, i, stats);
    // A merge can overflow (Σ_c w_c·o_c with w_c up to a chunk's length) where no part did: the
    // sum, left in C by merge_rows, is checked (an output type may overflow where C did not,
    // which no second pass would change).
    if (std::is_same_v<C, float>) {
      ok = ok && finite_stats(stats) &&
           (!(stats.sum > C(0)) || all_finite(weights + chunks, 1, p.d_v, p.d_v));
    }
  }
  return ok;
}

/// The job whose range [first(t), first(t) + size(t)) of a wave's list holds `item`: the last
/// job that starts at or before it (jobs with an empty range are passed over).
template <class First>
Index job_holding(const JobTasks* t, Index count, Index item, First&& first) {
  const JobTasks* next = std::upper_bound(
      t, t + count, item, [&](Index i, const JobTasks& job) { return i < first(job); });
  return static_cast<Index>(next - t) - 1;
}

/// One wave: every task of `count` jobs in one parallel loop (prefill and split-decode tasks
/// side by side), then every merge of the split ones; the split jobs' partial results, sized in
/// t[*].partials, on the calling thread's scratch. Clears finite[j] where job j met a
/// non-finite number (see COMPUTE TYPE).
template <class C, class P, class TO>
void run_wave(const AttentionJob<P, TO>* jobs, JobTasks* t, Index count, bool* finite,
              const FlashBlocking& blocking) {
  Index tasks = 0, merges = 0, partials = 0;
  for (Index j = 0; j < count; ++j) {
    t[j].first_task = tasks;
    t[j].first_merge = merges;
    t[j].first_partial = partials;
    tasks += t[j].tasks;
    merges += t[j].plan.split ? t[j].pairs : 0;
    partials += t[j].partials;
  }
  // Sizes that do not depend on the call's shapes (scratch.hpp, ALLOCATION): the whole budget
  // once any job splits, whole pages of flags.
  ThreadScratch& scratch = ThreadScratch::local();
  C* partial = scratch.get<C>(ScratchSlot::kDecodePartials,
                              partials > 0 ? std::max(partials, blocking.partial_budget) : 0);
  auto* ok = scratch.get<unsigned char>(ScratchSlot::kTaskFlags,
                                        ThreadScratch::whole_pages(tasks + merges));
  parallel_for(tasks, [&](Index task) {
    const Index j = job_holding(t, count, task, [](const JobTasks& x) { return x.first_task; });
    const P& p = *jobs[j].problem;
    const Index local = task - t[j].first_task;
    ok[task] = t[j].plan.split
                   ? chunk_task<C>(p, t[j], local, partial + t[j].first_partial, blocking)
                   : prefill_task<C>(p, t[j], jobs[j].outputs, local, blocking);
  });
  parallel_for(merges, [&](Index merge) {
    const Index j = job_holding(t, count, merge, [](const JobTasks& x) { return x.first_merge; });
    ok[tasks + merge] =
        merge_task<C>(*jobs[j].problem, t[j], jobs[j].outputs, merge - t[j].first_merge,
                      partial + t[j].first_partial, blocking);
  });
  for (Index j = 0; j < count; ++j) {
    const unsigned char* job_ok = ok + t[j].first_task;
    bool all = std::all_of(job_ok, job_ok + t[j].tasks, [](unsigned char x) { return x != 0; });
    if (t[j].plan.split) {
      const unsigned char* merged = ok + tasks + t[j].first_merge;
      all = all && std::all_of(merged, merged + t[j].pairs, [](unsigned char x) { return x != 0; });
    }
    finite[j] = finite[j] && all;
  }
}

/// One pass of the kernel in the compute type C over the jobs whose `run` flag is set (t[j] is
/// made here; a job not run gets no tasks): their tasks in waves of consecutive jobs whose
/// split-decode partials fit partial_budget together (a job alone always does: plan_attention),
/// so that the memory held stays bounded whatever the number of jobs. finite[j] is cleared
/// where job j must be redone in double.
template <class C, class P, class TO>
void attend_jobs(const AttentionJob<P, TO>* jobs, Index count, const bool* run, JobTasks* t,
                 bool* finite, const FlashBlocking& blocking) {
  for (Index j = 0; j < count; ++j)
    t[j] = run[j] ? job_tasks(*jobs[j].problem, blocking) : JobTasks{};
  for (Index begin = 0; begin < count;) {
    Index end = begin + 1;
    Index held = t[begin].partials;
    while (end < count && held + t[end].partials <= blocking.partial_budget) {
      held += t[end++].partials;
    }
    run_wave<C>(jobs + begin, t + begin, end - begin, finite + begin, blocking);
    begin = end;
  }
}

/// Whether a float pass can hold the call's parameters: the scale, the soft-cap and the sinks
/// are floats (representable_in), and ALiBi's largest term, the largest |slope| times the
/// largest distance between a query and a key, does not overflow float.
template <class P>
bool fits_float(const P& p) {
  if (!representable_in<float>(p.scale) || !representable_in<float>(p.softcap)) return false;
  double slope = 0.0;
  for (Index h = 0; h < p.q.heads(); ++h) {
    if (p.sinks != nullptr && !representable_in<float>(p.sinks[h])) return false;
    if (p.alibi_slopes != nullptr) {
      if (!representable_in<float>(p.alibi_slopes[h])) return false;
      slope = std::max(slope, std::abs(p.alibi_slopes[h]));
    }
  }
  if (slope == 0.0) return true;
  const double q_first = static_cast<double>(p.first_query);
  const double q_last = q_first + static_cast<double>(p.s_q - 1);
  double distance = 0.0;
  for (Index s = 0; s < p.num_segments; ++s) {
    const double k_first = static_cast<double>(p.segments[s].first_position);
    const double k_last = k_first + static_cast<double>(p.segments[s].size() - 1);
    distance = std::max({distance, std::abs(q_last - k_first), std::abs(k_last - q_first)});
  }
  return slope * distance <= static_cast<double>(std::numeric_limits<float>::max());
}

/// Whether a problem has any row to compute.
template <class P>
bool has_rows(const P& p) {
  return p.q.batch() > 0 && p.q.heads() > 0 && p.s_q > 0;
}

/// Runs the kernel on `count` jobs whose every precondition holds (the entry points check
/// them): each problem has at least one segment, all of one [B, H_kv] shape, and its outputs
/// are as AttentionOutputs says, overlapping no input and no other job's outputs. Picks each
/// job's compute type (see COMPUTE TYPE above): the jobs that fit float run in one float pass,
/// and those that do not, or that meet a number float cannot carry, in one double pass after
/// it. What a job computes does not depend on the other jobs. Memory: besides the tasks'
/// scratch, a JobTasks record and two flags per job on the calling thread's scratch (none for
/// one job).
template <class P, class TO>
void flash_attention(const AttentionJob<P, TO>* jobs, Index count, const FlashBlocking& blocking) {
  constexpr bool wide_input =
      std::is_same_v<typename P::Query, double> || std::is_same_v<typename P::Key, double> ||
      std::is_same_v<typename P::Value, double> || std::is_same_v<typename P::Bias, double>;
  JobTasks one_job;
  bool one_job_flags[2];
  ThreadScratch& scratch = ThreadScratch::local();
  JobTasks* t = count == 1 ? &one_job : scratch.get<JobTasks>(ScratchSlot::kJobTasks, count);
  bool* run = count == 1 ? one_job_flags : scratch.get<bool>(ScratchSlot::kJobFlags, 2 * count);
  bool* finite = run + count;
  bool redo = false;
  for (Index j = 0; j < count; ++j) {
    run[j] = !wide_input && has_rows(*jobs[j].problem) && fits_float(*jobs[j].problem);
    finite[j] = true;
  }
  if constexpr (!wide_input) attend_jobs<float>(jobs, count, run, t, finite, blocking);
  for (Index j = 0; j < count; ++j) {
    run[j] = has_rows(*jobs[j].problem) && (!run[j] || !finite[j]);
    redo = redo || run[j];
  }
  if (redo) attend_jobs<double>(jobs, count, run, t, finite, blocking);
}

/// flash_attention of one problem.
template <class P, class TO>
void flash_attention(const P& p, const AttentionOutputs<TO>& o, const FlashBlocking& blocking) {
  const AttentionJob<P, TO> job{&p, o};
  flash_attention(&job, 1, blocking);
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)

// The common instances, declared extern where they are compiled once (precompiled_kernels.hpp).
#include <apex/detail/kernel_instances.hpp>
