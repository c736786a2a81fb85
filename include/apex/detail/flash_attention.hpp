// SPDX-License-Identifier: MIT
// Tiled scaled dot-product attention with an online softmax: the fast path behind apex::sdpa.
// apex::reference::sdpa (sdpa.hpp) is the plain version it is tested against.
//
// WHAT IT COMPUTES (§6.2, grouped heads §8.2, masks §10–§11): for every query row i
//   out[i] = Σ_j softmax_j(softcap(scale · q_i·k_j) + bias_ij, forbidden → -inf) v_j
//   lse[i] = log Σ_j exp(softcap(scale · q_i·k_j) + bias_ij)          (allowed j only)
// without ever holding an S_q × S_k score matrix (FlashAttention: Dao et al. 2022, Algorithm 1).
//
// ONE TASK = batch b, key/value head, one block of Bq query positions. The G = H_q / H_kv query
// heads that read the same key/value head are stacked into one scratch block of M = G·Bq rows,
// so each key/value block is read once per group and every product has a few hundred rows:
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
// Key blocks are streamed in order; each row keeps a running maximum m and sum l:
//   S    = Qs·K_jᵀ                         Eigen's GEMM micro-kernel (gebp)
//   S    = softcap(S), + bias, then mask   the mask only where needed (MASK-AWARE SKIPPING)
//   m'   = max(m, max_j S)                 a row with nothing allowed yet keeps m' = -inf
//   P    = exp(S − m'),  α = exp(m − m')   Eigen's vectorised exp over whole rows
//   l    = α·l + Σ_j P
//   acc  = diag(α)·acc + P·V_j             the diag(α) pass is skipped for rows with α = 1
// and at the end out = acc / l, lse = m + log l. A row that saw no allowed key gets zeros and
// lse = -inf, as in the reference. The scale is folded into Qs when it is copied; the natural
// exp is kept (Eigen 3.4 has no vectorised exp2, and its exp already works in base 2 inside).
//
// NON-FINITE INPUT (the policy of apex::sdpa). A forbidden key never reaches the output: its
// score is selected to -inf after softcap and bias and its weight to exactly 0, and a block
// that may hide keys and holds a NaN or ±inf value adds only the keys each row sees
// (update_visible_keys; a check of the block's values, O(Bk·d_v), decides). A NaN score among
// a row's allowed keys makes that row NaN (out and lse), tracked explicitly rather than left to
// NaN arithmetic, which max and comparisons would drop; other rows are unaffected.
//
// MASK-AWARE SKIPPING. Each (query block, key block) pair is classified on absolute positions
// with classify_block: kNone skips the block (no product at all), kAll needs no mask work, and
// kPartial applies PositionMask::allows element by element, evaluated once for the Bq × Bk tile
// and shared by the G stacked heads. Causal attention thus costs about half of full attention,
// and a sliding window about S·(W + Bq + Bk). Dense boolean masks and biases are applied to
// every block that is not skipped.
//
// PRODUCTS (the GEMM kernel, M > stream_rows). Both products call Eigen's own GEMM building
// blocks (gemm_pack_lhs, gemm_pack_rhs and gebp_kernel of
// Eigen/src/Core/products/GeneralBlockPanelKernel.h, the code behind every large Eigen product)
// on buffers owned by this file, instead of `noalias() = A * B`, because then:
//   - Qs is packed once per query block and reused for every key block;
//   - nothing is allocated (Eigen's product allocates its packing buffers at every call, from
//     the heap once they exceed 128 KiB);
//   - Eigen never splits a product over threads: outside an OpenMP region it would (with a
//     blocking of its own), and the arithmetic would depend on the number of threads.
// Both products are computed transposed, because Eigen's kernel writes column-major results:
// S and acc stay row-major (one query row per contiguous row, which the softmax wants):
//   Sᵀ (Bk × M)    = K_j (Bk × d_qk) · Qsᵀ (d_qk × M)
//   accᵀ (d_v × M) += V_jᵀ (d_v × Bk) · Pᵀ (Bk × M)
// Each K_j, V_j block is first copied to contiguous scratch: a sequential read the hardware
// prefetcher follows, whereas the packing routines read 48 rows at a time and, reading from
// DRAM, wait on every cache line (decoding S = 32768 with this kernel: 13 → 17 GB/s).
//
// THE STREAMING KERNEL (M ≤ stream_rows, e.g. one new token of 4 grouped heads). With so few
// rows the products are matrix-vector products at heart, bound by reading K and V, and packing
// costs more than it saves. Each key row, then each value row, is read once in memory order
// and used at once by every stacked row (Eigen's packet primitives, 4 rows at a time), so the
// hardware prefetcher streams the cache from DRAM while the thread computes.
//
// DECODING (flash-decoding, Dao et al. 2023). When all the queries fit in one query block
// (S_q ≤ Bq: a few new tokens against a long cache) there would be only B·H_kv tasks. The keys
// are then cut into chunks of a fixed length (decode_chunk, independent of the thread count),
// every (b, kv head, chunk) task produces a partial result (out_c, lse_c) over its keys, and the
// partials are merged in chunk order with merge_attention's formula extended to n parts:
//   L = max_c lse_c,  w_c = exp(lse_c − L),  out = Σ_c w_c·out_c / Σ_c w_c,  lse = L + log Σ_c w_c
//
// THREADS AND DETERMINISM. Tasks run through detail::parallel_for. What a task computes depends
// only on the shapes (the block sizes and the choice of kernel are fixed, the key blocks and the
// decode merge run in a fixed order, Eigen's kernels are called serially), so the output is
// bit-identical for any number of threads. Within one (b, kv head) the prefill tasks take query
// blocks in the order 0, n−1, 1, n−2, … so that OpenMP's static schedule gives every thread a
// similar share of a causal triangle.
//
// BLOCK SIZES (FlashBlocking). Measured with float, d_h = 128, H_q = 32, H_kv = 8, 2 threads on
// an AMD EPYC (Zen 4, AVX-512), where Eigen's 4096³ GEMM runs at ≈ 158 GFLOP/s and a plain read
// of memory at ≈ 31 GB/s:
//   - M = G·Bq ≈ 256 stacked rows, Bk = 64. Causal S = 4096 ran at 144–150 GFLOP/s for
//     M ∈ {192, 256, 384, 512} and Bk ∈ {48, …, 192} and at 135–140 with M = 128; M = 256,
//     Bk = 64 was the best. Larger blocks waste more work on the diagonal and at window edges:
//     window 512 at S = 16384 ran at 130 GFLOP/s with Bk = 64, 117 with Bk = 128.
//   - stream_rows = 8. Decoding S = 32768: M = 4 streams 27 GB/s against 16 with the GEMM
//     kernel, M = 8 25 against 13; at M = 16 and 32 both are compute-bound and within 6 %; at
//     M = 64 the GEMM kernel is ahead.
//   - stream_key_block = decode_chunk = 512: 28 GB/s, against 27 with blocks of 256 and 23 with
//     blocks of 32–64 (fixed costs per block); chunks of 512 to 4096 keys were within 2 %, and
//     short ones give more tasks to share (B·H_kv·⌈S_k / 512⌉).
//
// MEMORY. Per thread, grown on first use and reused afterwards (thread_local, never shrunk):
//   GEMM kernel: 2·M·d_qk (stacked and packed Q) + 2·Bk·d_qk (copied and packed K) + 2·M·Bk
//   (scores and packed P) + 2·Bk·d_v (copied and packed V) + M·d_v (accumulator) + Bq·Bk
//   (position tile) + 3·M (m, l, α) scalars, rows padded to 16 scalars. For float, M = 256,
//   Bk = 64, d_qk = d_v = 128: about 0.7 MiB per thread, whatever S is.
//   Streaming kernel: M·d_qk + M·Bk + M·d_v + Bq·Bk + 3·M scalars (≈ 15 KiB for M = 4).
// Decoding also keeps, on the calling thread, the partial results of every chunk:
// B·H_q·S_q·(d_v + 1)·⌈S_k / decode_chunk⌉ scalars (1 MiB for one token, H_q = 32, d_v = 128,
// S_k = 32768).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>

namespace apex::detail {

/// Block sizes of the tiled kernel (see BLOCK SIZES above). The defaults are what apex::sdpa
/// uses; tests pass small ones to put block boundaries where they want them.
struct FlashBlocking {
  Index stacked_rows = 256;      ///< target M = G·Bq; Bq = max(1, stacked_rows / G)
  Index key_block = 64;          ///< Bk of the GEMM kernel
  Index stream_rows = 8;         ///< M at or below which the streaming kernel is used instead
  Index stream_key_block = 512;  ///< Bk of the streaming kernel
  Index decode_chunk = 512;      ///< keys per partial result when decoding
};

/// Everything a task needs, resolved once per call.
template <class Scalar>
struct FlashProblem {
  HeadsView<const Scalar> q, k, v;
  PositionMask positions;
  HeadsView<const bool> allowed;  // empty: no dense mask
  HeadsView<const Scalar> bias;   // empty: no bias
  Scalar scale = 1;
  Scalar softcap = 0;  // 0: off
  Index group = 1;     // G = H_q / H_kv
  Index s_q = 0, s_k = 0, d_qk = 0, d_v = 0;
  Index first_query = 0;  // absolute position of query row 0
};

/// Leading dimension of scratch rows: a multiple of 16 scalars, so that rows start on a cache
/// line (64 bytes for float) and vectorised loops over a row peel the same way on every thread.
inline Index padded(Index n) { return (n + 15) / 16 * 16; }

/// Per-thread scratch. Buffers only grow, so once a thread has seen the shapes of a call it
/// allocates nothing and touches no fresh page.
template <class Scalar>
class FlashScratch {
 public:
  enum Buffer {
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
    kRowStats,
    kCount
  };

  Scalar* get(Buffer which, Index size) {
    Vector<Scalar>& buffer = buffers_[which];
    if (buffer.size() < size) buffer.resize(size);  // Eigen aligns it (64 bytes with AVX-512)
    return buffer.data();
  }

  static FlashScratch& for_this_thread() {
    thread_local FlashScratch scratch;
    return scratch;
  }

 private:
  Vector<Scalar> buffers_[kCount];
};

/// Eigen 3.4's GEMM building blocks for C += A·B with a column-major C: pack_lhs copies A into
/// the micro-kernel's panel layout, pack_rhs does the same for B, kernel runs the register-
/// blocked micro-kernel (gebp) over the packed panels.
template <class Scalar, int LhsOrder, int RhsOrder>
struct EigenGemm {
  using Traits = Eigen::internal::gebp_traits<Scalar, Scalar>;
  using LhsMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, LhsOrder>;
  using RhsMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, RhsOrder>;
  using ResMapper = Eigen::internal::blas_data_mapper<Scalar, Index, Eigen::ColMajor>;

  /// A: rows × depth, stored in LhsOrder with leading dimension ld.
  static void pack_lhs(Scalar* packed, const Scalar* a, Index ld, Index rows, Index depth) {
    Eigen::internal::gemm_pack_lhs<Scalar, Index, LhsMapper, Traits::mr, Traits::LhsProgress,
                                   typename Traits::LhsPacket4Packing, LhsOrder>
        pack;
    pack(packed, LhsMapper(a, ld), depth, rows);
  }
  /// B: depth × cols, stored in RhsOrder with leading dimension ld.
  static void pack_rhs(Scalar* packed, const Scalar* b, Index ld, Index depth, Index cols) {
    Eigen::internal::gemm_pack_rhs<Scalar, Index, RhsMapper, Traits::nr, RhsOrder> pack;
    pack(packed, RhsMapper(b, ld), depth, cols);
  }
  /// C (rows × cols, column-major, leading dimension ldc) += A·B, from the packed panels.
  static void kernel(Scalar* c, Index ldc, const Scalar* a_packed, const Scalar* b_packed,
                     Index rows, Index depth, Index cols) {
    Eigen::internal::gebp_kernel<Scalar, Scalar, Index, ResMapper, Traits::mr, Traits::nr> gebp;
    gebp(ResMapper(c, ldc), a_packed, b_packed, rows, depth, cols, Scalar(1));
  }
};

/// The running state of one query block (M stacked rows) while key blocks stream past.
template <class Scalar>
class FlashBlock {
 public:
  static constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  static constexpr Scalar kNaN = std::numeric_limits<Scalar>::quiet_NaN();

  /// Query rows [q0, q0 + bq) of the G heads that share key/value head (b, kv_head), against
  /// key blocks of at most key_block rows, with the GEMM kernel or the streaming one.
  FlashBlock(const FlashProblem<Scalar>& p, Index b, Index kv_head, Index q0, Index bq,
             Index key_block, bool stream)
      : p_(p),
        streaming_(stream),
        b_(b),
        kv_head_(kv_head),
        q0_(q0),
        bq_(bq),
        rows_(p.group * bq),
        ld_s_(padded(key_block)),
        ld_acc_(padded(p.d_v)) {
    using S = FlashScratch<Scalar>;
    S& scratch = S::for_this_thread();
    if (!stream) {
      q_packed_ = scratch.get(S::kQPacked, rows_ * p.d_qk);
      k_copy_ = scratch.get(S::kKCopy, key_block * p.d_qk);
      k_packed_ = scratch.get(S::kKPacked, key_block * p.d_qk);
      p_packed_ = scratch.get(S::kPPacked, rows_ * key_block);
      v_copy_ = scratch.get(S::kVCopy, key_block * p.d_v);
      v_packed_ = scratch.get(S::kVPacked, key_block * p.d_v);
    }
    scores_ = scratch.get(S::kScores, rows_ * ld_s_);
    acc_ = scratch.get(S::kAcc, rows_ * ld_acc_);
    position_tile_ = scratch.get(S::kPositionTile, bq * ld_s_);
    row_max_ = scratch.get(S::kRowStats, 3 * rows_);
    row_sum_ = row_max_ + rows_;
    row_scale_ = row_sum_ + rows_;

    // Qs = scale·Q with the G heads' rows stacked, packed once as the right-hand side Qsᵀ
    // (d_qk × M, column-major = Qs row-major) of every score product.
    q_stacked_ = scratch.get(S::kQStacked, rows_ * p.d_qk);
    for (Index g = 0; g < p.group; ++g) {
      Eigen::Map<RowMatrix<Scalar>>(q_stacked_ + g * bq * p.d_qk, bq, p.d_qk) =
          p.scale * p.q.head(b, kv_head * p.group + g).middleRows(q0, bq);
    }
    if (!stream) ScoreGemm::pack_rhs(q_packed_, q_stacked_, p.d_qk, p.d_qk, rows_);

    std::fill(row_max_, row_max_ + rows_, kNegInf);
    std::fill(row_sum_, row_sum_ + rows_, Scalar(0));
    std::fill(acc_, acc_ + rows_ * ld_acc_, Scalar(0));
  }

  Index rows() const { return rows_; }

  /// Folds keys [k0, k0 + n) (n ≤ key_block) into the running state.
  void add_keys(Index k0, Index n) {
    const Index query_pos = p_.first_query + q0_;
    const Index key_pos = p_.positions.key_offset + k0;
    const BlockCoverage coverage =
        classify_block(p_.positions, query_pos, query_pos + bq_, key_pos, key_pos + n);
    if (coverage == BlockCoverage::kNone) return;

    if (streaming()) {
      stream_scores(k0, n);
    } else {
      // Sᵀ = K_j·Qsᵀ: Bk × M column-major, i.e. S (M × Bk) row-major with stride ld_s_.
      std::fill(scores_, scores_ + rows_ * ld_s_, Scalar(0));
      if (p_.d_qk > 0) {
        copy_rows(p_.k.head(b_, kv_head_), k0, n, k_copy_);
        ScoreGemm::pack_lhs(k_packed_, k_copy_, p_.d_qk, n, p_.d_qk);
        ScoreGemm::kernel(scores_, ld_s_, k_packed_, q_packed_, n, p_.d_qk, rows_);
      }
    }

    if (coverage == BlockCoverage::kPartial) fill_position_tile(query_pos, key_pos, n);
    const bool may_hide_keys =
        coverage == BlockCoverage::kPartial || !p_.allowed.empty() || !p_.bias.empty();
    bool rescale = false;
    for (Index r = 0; r < rows_; ++r) {
      RowArray s(scores_ + r * ld_s_, n);
      const Index g = r / bq_;
      const Index i = r - g * bq_;
      // softcap(x) = c·tanh(x / c) on the scaled score, before the mask and the bias, so that
      // a forbidden key stays forbidden (SdpaParams::softcap).
      if (p_.softcap > 0) s = p_.softcap * (s * (Scalar(1) / p_.softcap)).tanh();
      if (!p_.bias.empty()) {
        // A bias of -inf forbids the key even where the score is NaN (NaN + -inf is NaN).
        const ConstRowArray bias = bias_row(g, i, k0, n);
        s = (bias == kNegInf).select(kNegInf, s + bias);
      }
      // The masks come last and select rather than add, so that a forbidden key's score is
      // -inf whatever its key or bias held (NaN included).
      if (coverage == BlockCoverage::kPartial)
        forbid_where_negative(s.data(), position_tile_ + i * ld_s_, n);
      if (!p_.allowed.empty()) apply_allowed(s, g, i, k0, n);

      const Scalar old_max = row_max_[r];
      const Scalar block_max = s.template maxCoeff<Eigen::PropagateNaN>();
      if (std::isnan(block_max) || std::isnan(old_max)) {
        // A NaN score among the allowed keys (NaN in q, in an allowed k, or in the bias): the
        // row's result is NaN (finish_row), and nothing else depends on it.
        row_max_[r] = kNaN;
        s.setZero();
        row_scale_[r] = Scalar(1);
        continue;
      }
      const Scalar new_max = std::max(old_max, block_max);
      if (new_max == kNegInf) {  // nothing allowed so far: P = 0, the state is unchanged
        s.setZero();
        row_scale_[r] = Scalar(1);
        continue;
      }
      if (may_hide_keys) {
        exp_keeping_hidden_zero(s.data(), n, new_max);
      } else {
        s = (s - new_max).exp();
      }
      const Scalar alpha = old_max == new_max ? Scalar(1) : std::exp(old_max - new_max);
      row_scale_[r] = alpha;
      rescale = rescale || alpha != Scalar(1);
      row_sum_[r] = alpha * row_sum_[r] + s.sum();
      row_max_[r] = new_max;
    }
    if (rescale) {
      for (Index r = 0; r < rows_; ++r) {
        if (row_scale_[r] != Scalar(1)) RowArray(acc_ + r * ld_acc_, p_.d_v) *= row_scale_[r];
      }
    }

    // P(r, j) = 0 for a forbidden key, and 0·NaN = NaN: where a block may hide keys and holds a
    // value that is not finite, only the keys each row may see are added.
    if (may_hide_keys && p_.d_v > 0 && !values_finite(k0, n)) {
      update_visible_keys(k0, n);
    } else if (streaming()) {
      stream_update(k0, n);
    } else if (p_.d_v > 0) {
      // accᵀ += V_jᵀ·Pᵀ: d_v × M column-major, i.e. acc (M × d_v) row-major.
      copy_rows(p_.v.head(b_, kv_head_), k0, n, v_copy_);
      UpdateGemm::pack_lhs(v_packed_, v_copy_, p_.d_v, p_.d_v, n);
      UpdateGemm::pack_rhs(p_packed_, scores_, ld_s_, n, rows_);
      UpdateGemm::kernel(acc_, ld_acc_, v_packed_, p_packed_, p_.d_v, n, rows_);
    }
  }

  /// Stacked row r normalised, out_row = acc_r / l_r, and returns its lse = m_r + log l_r; a row
  /// that saw no allowed key is written as zeros and returns -inf, a row with a NaN score (or an
  /// infinite one, whose weight is inf - inf) is written as NaN and returns NaN.
  template <class OutRow>
  Scalar finish_row(Index r, OutRow&& out_row) const {
    const Scalar total = row_sum_[r];
    if (std::isnan(row_max_[r]) || std::isnan(total)) {
      out_row.setConstant(kNaN);
      return kNaN;
    }
    if (!(total > Scalar(0))) {
      out_row.setZero();
      return kNegInf;
    }
    out_row = ConstRowVector(acc_ + r * ld_acc_, p_.d_v) * (Scalar(1) / total);
    return row_max_[r] + std::log(total);
  }

 private:
  using RowArray = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstRowArray = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstRowVector = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;
  // Sᵀ = K·Qsᵀ: K row-major (Bk × d_qk), Qsᵀ column-major (d_qk × M).
  using ScoreGemm = EigenGemm<Scalar, Eigen::RowMajor, Eigen::ColMajor>;
  // accᵀ += Vᵀ·Pᵀ: Vᵀ column-major (d_v × Bk, i.e. V row-major), Pᵀ column-major (Bk × M).
  using UpdateGemm = EigenGemm<Scalar, Eigen::ColMajor, Eigen::ColMajor>;

  // ---- the streaming kernel (see the top of this file) ----------------------------------
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr Index kPacket = Eigen::internal::unpacket_traits<Packet>::size;

  bool streaming() const { return streaming_; }

  /// S(r, j) = Qs_r · k_j for the stacked rows r and keys k0 + j, j < n.
  void stream_scores(Index k0, Index n) {
    namespace ei = Eigen::internal;
    const auto k_head = p_.k.head(b_, kv_head_);
    const Index d = p_.d_qk;
    const Index vectorised = d / kPacket * kPacket;
    for (Index j = 0; j < n; ++j) {
      const Scalar* key = k_head.data() + (k0 + j) * k_head.outerStride();
      Index r = 0;
      for (; r + 4 <= rows_; r += 4) {
        const Scalar* q = q_stacked_ + r * d;
        Packet a0 = ei::pset1<Packet>(Scalar(0)), a1 = a0, a2 = a0, a3 = a0;
        for (Index c = 0; c < vectorised; c += kPacket) {
          const Packet kc = ei::ploadu<Packet>(key + c);
          a0 = ei::pmadd(ei::ploadu<Packet>(q + c), kc, a0);
          a1 = ei::pmadd(ei::ploadu<Packet>(q + d + c), kc, a1);
          a2 = ei::pmadd(ei::ploadu<Packet>(q + 2 * d + c), kc, a2);
          a3 = ei::pmadd(ei::ploadu<Packet>(q + 3 * d + c), kc, a3);
        }
        Scalar s0 = ei::predux(a0), s1 = ei::predux(a1), s2 = ei::predux(a2), s3 = ei::predux(a3);
        for (Index c = vectorised; c < d; ++c) {
          s0 += q[c] * key[c];
          s1 += q[d + c] * key[c];
          s2 += q[2 * d + c] * key[c];
          s3 += q[3 * d + c] * key[c];
        }
        scores_[r * ld_s_ + j] = s0;
        scores_[(r + 1) * ld_s_ + j] = s1;
        scores_[(r + 2) * ld_s_ + j] = s2;
        scores_[(r + 3) * ld_s_ + j] = s3;
      }
      for (; r < rows_; ++r) {
        const Scalar* q = q_stacked_ + r * d;
        Packet a = ei::pset1<Packet>(Scalar(0));
        for (Index c = 0; c < vectorised; c += kPacket) {
          a = ei::pmadd(ei::ploadu<Packet>(q + c), ei::ploadu<Packet>(key + c), a);
        }
        Scalar sum = ei::predux(a);
        for (Index c = vectorised; c < d; ++c) sum += q[c] * key[c];
        scores_[r * ld_s_ + j] = sum;
      }
    }
  }

  /// acc_r += Σ_j P(r, j) v_j for values k0 + j, j < n, in groups of kStreamKeys keys so that
  /// the 4 × 4 packets of acc being updated stay in registers.
  void stream_update(Index k0, Index n) {
    namespace ei = Eigen::internal;
    constexpr Index kStreamKeys = 8;
    const auto v_head = p_.v.head(b_, kv_head_);
    const Index dv = p_.d_v;
    for (Index j0 = 0; j0 < n; j0 += kStreamKeys) {
      const Index j1 = std::min(n, j0 + kStreamKeys);
      const Scalar* values = v_head.data() + (k0 + j0) * v_head.outerStride();
      const Index stride = v_head.outerStride();
      Index r = 0;
      for (; r + 4 <= rows_; r += 4) {
        Scalar* acc = acc_ + r * ld_acc_;
        const Scalar* prob = scores_ + r * ld_s_;
        Index c = 0;
        for (; c + 4 * kPacket <= dv; c += 4 * kPacket) {
          Packet acc_block[4][4];
          for (int i = 0; i < 4; ++i) {
            for (int u = 0; u < 4; ++u) {
              acc_block[i][u] = ei::pload<Packet>(acc + i * ld_acc_ + c + u * kPacket);
            }
          }
          for (Index j = j0; j < j1; ++j) {
            const Scalar* value = values + (j - j0) * stride + c;
            Packet v[4];
            for (int u = 0; u < 4; ++u) v[u] = ei::ploadu<Packet>(value + u * kPacket);
            for (int i = 0; i < 4; ++i) {
              const Packet w = ei::pset1<Packet>(prob[i * ld_s_ + j]);
              for (int u = 0; u < 4; ++u) acc_block[i][u] = ei::pmadd(w, v[u], acc_block[i][u]);
            }
          }
          for (int i = 0; i < 4; ++i) {
            for (int u = 0; u < 4; ++u) {
              ei::pstore(acc + i * ld_acc_ + c + u * kPacket, acc_block[i][u]);
            }
          }
        }
        for (; c + kPacket <= dv; c += kPacket) {
          Packet acc_column[4];
          for (int i = 0; i < 4; ++i) acc_column[i] = ei::pload<Packet>(acc + i * ld_acc_ + c);
          for (Index j = j0; j < j1; ++j) {
            const Packet v = ei::ploadu<Packet>(values + (j - j0) * stride + c);
            for (int i = 0; i < 4; ++i) {
              acc_column[i] = ei::pmadd(ei::pset1<Packet>(prob[i * ld_s_ + j]), v, acc_column[i]);
            }
          }
          for (int i = 0; i < 4; ++i) ei::pstore(acc + i * ld_acc_ + c, acc_column[i]);
        }
        for (; c < dv; ++c) {
          for (Index j = j0; j < j1; ++j) {
            const Scalar value = values[(j - j0) * stride + c];
            for (int i = 0; i < 4; ++i) acc[i * ld_acc_ + c] += prob[i * ld_s_ + j] * value;
          }
        }
      }
      for (; r < rows_; ++r) {
        RowArray acc(acc_ + r * ld_acc_, dv);
        for (Index j = j0; j < j1; ++j) {
          acc += scores_[r * ld_s_ + j] * ConstRowArray(values + (j - j0) * stride, dv);
        }
      }
    }
  }

  /// Rows [k0, k0 + n) of a key or value head, copied contiguously to `dst`.
  template <class HeadMap>
  static void copy_rows(const HeadMap& head, Index k0, Index n, Scalar* dst) {
    const Index cols = head.cols();
    const Index stride = head.outerStride();
    using Span = Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
    using ConstSpan = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
    if (stride == cols) {  // one contiguous range
      Span(dst, n * cols) = ConstSpan(head.data() + k0 * stride, n * cols);
      return;
    }
    for (Index j = 0; j < n; ++j) {
      Span(dst + j * cols, cols) = ConstSpan(head.data() + (k0 + j) * stride, cols);
    }
  }

  /// position_tile(i, j) = +inf where the PositionMask allows query q0 + i and key k0 + j and
  /// -inf where it forbids the pair.
  void fill_position_tile(Index query_pos, Index key_pos, Index n) {
    constexpr Scalar kPosInf = std::numeric_limits<Scalar>::infinity();
    for (Index i = 0; i < bq_; ++i) {
      Scalar* tile = position_tile_ + i * ld_s_;
      for (Index j = 0; j < n; ++j) {
        tile[j] = p_.positions.allows(query_pos + i, key_pos + j) ? kPosInf : kNegInf;
      }
    }
  }

  /// s_j = -inf where tile_j < 0 (the pair is forbidden), s_j unchanged elsewhere, whatever s_j
  /// holds (NaN included): a select in packets, as Eigen 3.4's Array::select is not vectorised.
  static void forbid_where_negative(Scalar* s, const Scalar* tile, Index n) {
    namespace ei = Eigen::internal;
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    const Packet neg_inf = ei::pset1<Packet>(kNegInf);
    Index j = 0;
    for (; j + kPacket <= n; j += kPacket) {
      const Packet allowed = ei::pcmp_lt(zero, ei::ploadu<Packet>(tile + j));
      ei::pstoreu(s + j, ei::pselect(allowed, ei::ploadu<Packet>(s + j), neg_inf));
    }
    for (; j < n; ++j) {
      if (!(tile[j] > Scalar(0))) s[j] = kNegInf;
    }
  }

  /// s_j = exp(s_j - max), and exactly 0 where s_j = -inf: Eigen's vectorised exp clamps its
  /// argument (exp(-inf) is 5.6e-309 in double), and a hidden key must weigh nothing.
  static void exp_keeping_hidden_zero(Scalar* s, Index n, Scalar max) {
    namespace ei = Eigen::internal;
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    const Packet neg_inf = ei::pset1<Packet>(kNegInf);
    const Packet m = ei::pset1<Packet>(max);
    Index j = 0;
    for (; j + kPacket <= n; j += kPacket) {
      const Packet x = ei::ploadu<Packet>(s + j);
      ei::pstoreu(s + j, ei::pselect(ei::pcmp_eq(x, neg_inf), zero, ei::pexp(ei::psub(x, m))));
    }
    for (; j < n; ++j) s[j] = s[j] == kNegInf ? Scalar(0) : std::exp(s[j] - max);
  }

  /// Whether values k0 .. k0 + n - 1 are all finite.
  bool values_finite(Index k0, Index n) const {
    return p_.v.head(b_, kv_head_).middleRows(k0, n).allFinite();
  }

  /// acc_r += Σ_j P(r, j) v_j over the keys with P(r, j) ≠ 0 only, one row at a time: the slow
  /// path of blocks whose hidden keys may hold NaN or ±inf values.
  void update_visible_keys(Index k0, Index n) {
    const auto v_head = p_.v.head(b_, kv_head_);
    for (Index r = 0; r < rows_; ++r) {
      Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>> acc(acc_ + r * ld_acc_, p_.d_v);
      const Scalar* prob = scores_ + r * ld_s_;
      for (Index j = 0; j < n; ++j) {
        if (prob[j] != Scalar(0)) acc.noalias() += prob[j] * v_head.row(k0 + j);
      }
    }
  }

  void apply_allowed(RowArray& s, Index g, Index i, Index k0, Index n) const {
    const bool* allowed = p_.allowed.head(b_, kv_head_ * p_.group + g).row(q0_ + i).data() + k0;
    for (Index j = 0; j < n; ++j) {
      if (!allowed[j]) s[j] = kNegInf;
    }
  }

  ConstRowArray bias_row(Index g, Index i, Index k0, Index n) const {
    return ConstRowArray(p_.bias.head(b_, kv_head_ * p_.group + g).row(q0_ + i).data() + k0, n);
  }

  const FlashProblem<Scalar>& p_;
  bool streaming_;
  Index b_, kv_head_, q0_, bq_, rows_, ld_s_, ld_acc_;
  Scalar* q_stacked_ = nullptr;
  Scalar* q_packed_ = nullptr;
  Scalar* k_copy_ = nullptr;
  Scalar* k_packed_ = nullptr;
  Scalar* scores_ = nullptr;
  Scalar* p_packed_ = nullptr;
  Scalar* v_copy_ = nullptr;
  Scalar* v_packed_ = nullptr;
  Scalar* acc_ = nullptr;
  Scalar* position_tile_ = nullptr;
  Scalar* row_max_ = nullptr;
  Scalar* row_sum_ = nullptr;
  Scalar* row_scale_ = nullptr;
};

/// A block length in [1, max(1, limit)].
inline Index clamp_block(Index block, Index limit) {
  return std::max<Index>(1, std::min(block, limit));
}

/// Decoding's partial results, on the calling thread; grows only.
template <class Scalar>
Scalar* decode_partials(Index size) {
  thread_local Vector<Scalar> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

/// The fast path of apex::sdpa (see the top of this file). The arguments have passed
/// check_sdpa; `scale` is resolved and `softcap` is 0 when off.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v], allowed and
///   bias: [1 or B, 1 or H_q, S_q, S_k] or empty -> out: [B, H_q, S_q, d_v],
///   lse (optional): [B, H_q, S_q, 1]
template <class Scalar>
void flash_sdpa(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                const HeadsView<const Scalar>& v, const PositionMask& positions,
                const HeadsView<const bool>& allowed, const HeadsView<const Scalar>& bias,
                double scale, double softcap, const HeadsView<Scalar>& out,
                const HeadsView<Scalar>& lse, const FlashBlocking& blocking = {}) {
  require_supported_scalar<Scalar>();
  FlashProblem<Scalar> p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.positions = positions;
  p.allowed = allowed;
  p.bias = bias;
  p.scale = static_cast<Scalar>(scale);
  p.softcap = static_cast<Scalar>(softcap);
  p.group = q.heads() / k.heads();
  p.s_q = q.seq();
  p.s_k = k.seq();
  p.d_qk = q.dim();
  p.d_v = v.dim();
  p.first_query = positions.first_query_position(p.s_q, p.s_k);
  const Index batch = q.batch();
  const Index kv_heads = k.heads();
  if (batch == 0 || q.heads() == 0 || p.s_q == 0) return;

  const Index query_block = std::min(std::max<Index>(1, blocking.stacked_rows / p.group), p.s_q);
  const Index query_blocks = (p.s_q + query_block - 1) / query_block;
  const Index chunk = std::max<Index>(1, blocking.decode_chunk);
  const bool decoding = query_blocks == 1 && p.s_k > chunk;

  if (!decoding) {
    // Prefill: one task per (b, kv head, query block), all keys in blocks of key_block.
    parallel_for(batch * kv_heads * query_blocks, [&](Index task) {
      const Index bh = task / query_blocks;
      const Index t = task - bh * query_blocks;
      const Index block = t % 2 == 0 ? t / 2 : query_blocks - 1 - t / 2;
      const Index b = bh / kv_heads;
      const Index kv_head = bh - b * kv_heads;
      const Index q0 = block * query_block;
      const Index bq = std::min(query_block, p.s_q - q0);
      const bool streaming = p.group * bq <= blocking.stream_rows;
      const Index key_block =
          clamp_block(streaming ? blocking.stream_key_block : blocking.key_block, p.s_k);
      FlashBlock<Scalar> state(p, b, kv_head, q0, bq, key_block, streaming);
      for (Index k0 = 0; k0 < p.s_k; k0 += key_block) {
        state.add_keys(k0, std::min(key_block, p.s_k - k0));
      }
      for (Index r = 0; r < state.rows(); ++r) {
        const Index g = r / bq;
        const Index h = kv_head * p.group + g;
        const Index i = q0 + r - g * bq;
        const Scalar row_lse = state.finish_row(r, out.head(b, h).row(i));
        if (!lse.empty()) lse.head(b, h)(i, 0) = row_lse;
      }
    });
    return;
  }

  // Decoding: one task per (b, kv head, chunk of keys), each writing its partial result for
  // the M = G·S_q stacked rows as M records of d_v + 1 scalars (normalised output, then lse).
  const Index rows = p.group * p.s_q;
  const bool streaming = rows <= blocking.stream_rows;
  const Index key_block =
      clamp_block(streaming ? blocking.stream_key_block : blocking.key_block, chunk);
  const Index chunks = (p.s_k + chunk - 1) / chunk;
  const Index record = p.d_v + 1;
  Scalar* partials = decode_partials<Scalar>(batch * kv_heads * chunks * rows * record);
  parallel_for(batch * kv_heads * chunks, [&](Index task) {
    const Index bh = task / chunks;
    const Index c = task - bh * chunks;
    const Index b = bh / kv_heads;
    FlashBlock<Scalar> state(p, b, bh - b * kv_heads, 0, p.s_q, key_block, streaming);
    const Index k_end = std::min(p.s_k, (c + 1) * chunk);
    for (Index k0 = c * chunk; k0 < k_end; k0 += key_block) {
      state.add_keys(k0, std::min(key_block, k_end - k0));
    }
    Scalar* partial = partials + task * rows * record;
    for (Index r = 0; r < rows; ++r) {
      Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>> out_row(partial + r * record, p.d_v);
      partial[r * record + p.d_v] = state.finish_row(r, out_row);
    }
  });
  // Merge, for each (b, kv head) and stacked row, over the chunks in order.
  parallel_for(batch * kv_heads, [&](Index bh) {
    const Index b = bh / kv_heads;
    const Index kv_head = bh - b * kv_heads;
    const Scalar* first = partials + bh * chunks * rows * record;
    for (Index r = 0; r < rows; ++r) {
      const Index g = r / p.s_q;
      const Index i = r - g * p.s_q;
      const Index h = kv_head * p.group + g;
      const auto part = [&](Index c) { return first + (c * rows + r) * record; };
      Scalar max_lse = FlashBlock<Scalar>::kNegInf;
      bool nan = false;
      for (Index c = 0; c < chunks; ++c) {
        max_lse = std::max(max_lse, part(c)[p.d_v]);
        nan = nan || std::isnan(part(c)[p.d_v]);
      }
      auto out_row = out.head(b, h).row(i);
      if (nan) {  // a chunk whose row is NaN (FlashBlock::finish_row) makes the row NaN
        out_row.setConstant(FlashBlock<Scalar>::kNaN);
        if (!lse.empty()) lse.head(b, h)(i, 0) = FlashBlock<Scalar>::kNaN;
        continue;
      }
      out_row.setZero();
      Scalar total = 0;
      if (max_lse != FlashBlock<Scalar>::kNegInf) {
        for (Index c = 0; c < chunks; ++c) {
          const Scalar weight = std::exp(part(c)[p.d_v] - max_lse);
          if (weight == Scalar(0)) continue;  // includes chunks with no allowed key
          total += weight;
          out_row +=
              weight * Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(part(c), p.d_v);
        }
        out_row *= Scalar(1) / total;
      }
      if (!lse.empty()) {
        lse.head(b, h)(i, 0) = total > Scalar(0) ? max_lse + std::log(total) : max_lse;
      }
    }
  });
}

}  // namespace apex::detail
