// SPDX-License-Identifier: MIT
// The scratch of one tile of the tiled kernel (attention_tile.hpp): the path a tile takes and
// the kernels that run its products (TilePath), its buffers and their layout (TileBuffers), and
// where they come from (tile_buffers: the ScratchSlot buffers of the thread running the task).
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
//   On apex's float kernels the GEMM path needs less: no packed P or V, the transposed K is
//   ⌈Bk / panel⌉·panel·d_qk (panel = 16 or 32 keys), and the packed Q is Qsᵀ for keys-major
//   scores, d_qk·pad(min(M, max(panel, d_qk − 1))) (whose Sᵀ, Bk·pad(M), borrows the position
//   tile).
//   With bfloat16 products the GEMM path adds, in 32-bit pairs, M·⌈d_qk/2⌉ (Qs), ⌈Bk/32⌉·32·
//   ⌈d_qk/2⌉ (K_j), M·⌈Bk/2⌉ (P) and ⌈Bk/2⌉·d_v (V_j): no more than the packed buffers of
//   Eigen's path above. On AMX tiles Bk = amx_key_block = 256: for M = 256, d_qk = d_v = 128
//   about 1.6 MiB per thread.
//   With ALiBi, both paths add Bk (the key distances from the tile's first query).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <limits>
#include <type_traits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, a tile's rows and key block
namespace apex::detail {

/// Leading dimension of scratch rows: a multiple of 16 scalars, so that rows start on a cache
/// line and vectorised loops over a row peel the same way on every thread.
inline Index padded(Index n) { return (n + 15) / 16 * 16; }

/// The path a tile takes and the kernels that run its products (tile_products.hpp, PRODUCTS):
/// what decides which buffers it needs.
struct TilePath {
  /// M <= stream_rows: K and V streamed row by row; else the GEMM path.
  bool streaming;
  /// The products and the softmax on apex's own kernels (float), else nullptr.
  const FloatKernels* simd;
  /// The GEMM path's products on bfloat16 dot products where a call allows them, else nullptr.
  const Bf16Kernels* bf16;
  /// The GEMM path's scores computed keys-major (tile_products.hpp, KEYS-MAJOR SCORES): on
  /// apex's float kernels, without bfloat16 products, for a tile of at most one panel of rows
  /// or of fewer rows than d_qk.
  bool keys_major;
  /// Whether the streaming products read K, and V, in place (streams_in_place).
  bool k_in_place, v_in_place;
};

/// The path of a tile of `rows` stacked rows of problem p computing in C: `streaming` as the
/// plan chose, on apex's float kernels for float, on the bfloat16 ones where p allows them on
/// the GEMM path, keys-major where the rows fit one panel of those kernels or are fewer than
/// d_qk (KEYS-MAJOR SCORES).
template <class C, class P>
TilePath tile_path(const P& p, bool streaming, Index rows) {
  const FloatKernels* simd = std::is_same_v<C, float> ? float_kernels() : nullptr;
  const Bf16Kernels* bf16 = simd != nullptr && p.bf16_products && !streaming ? simd->bf16 : nullptr;
  const bool keys_major =
      simd != nullptr && bf16 == nullptr && !streaming && (rows <= simd->panel || rows < p.d_qk);
  return {streaming,
          simd,
          bf16,
          keys_major,
          streams_in_place<C, typename P::Key>(simd),
          streams_in_place<C, typename P::Value>(simd)};
}

/// The most rows of a keys-major tile of problem p whose tiles have at most m rows, on kernels
/// whose panels have `panel` columns.
template <class P>
Index keys_major_rows(const P& p, Index panel, Index m) {
  return std::min(m, std::max(panel, p.d_qk - 1));
}

/// One tile's buffers (MEMORY) and their layout: `rows` stacked query rows, rows of d_qk and
/// d_v, S and acc with leading dimensions ld_s and ld_acc. A buffer its path does not use is
/// null.
template <class C>
struct TileBuffers {
  /// Stacked rows M, and the widths of a query and of a value row.
  Index rows = 0, d_qk = 0, d_v = 0;
  /// padded(key block), padded(d_v), padded(M) (keys-major scores).
  Index ld_s = 0, ld_acc = 0, ld_t = 0;
  C* q_stacked = nullptr;       ///< [M × d_qk]: Qs
  C* q_packed = nullptr;        ///< Qs packed for Eigen's products (TileGemm)
  C* q_t = nullptr;             ///< [d_qk × ld_t]: Qsᵀ, for the keys-major scores
  C* scores_t = nullptr;        ///< [Bk × ld_t]: Sᵀ of the keys-major scores (position tile's)
  C* k_copy = nullptr;          ///< K_j copied (GEMM), or a widened panel of it (streaming)
  C* k_packed = nullptr;        ///< K_j packed for apex's float kernels or Eigen's
  Bf16Pair* q_pairs = nullptr;  ///< Qs rounded, for the bfloat16 products
  Bf16Pair* k_pairs = nullptr;  ///< K_j rounded
  Bf16Pair* p_pairs = nullptr;  ///< P rounded
  Bf16Pair* v_pairs = nullptr;  ///< V_j rounded
  C* scores = nullptr;          ///< [M × ld_s]: S, then P
  C* p_packed = nullptr;        ///< P packed for Eigen's products
  C* v_copy = nullptr;          ///< V_j copied (GEMM), or a widened panel of it (streaming)
  C* v_packed = nullptr;        ///< V_j packed for Eigen's products
  C* acc = nullptr;             ///< [M × ld_acc]: the unnormalised outputs
  C* position_tile = nullptr;   ///< [Bq × ld_s]: which keys the PositionMask allows
  C* alibi = nullptr;           ///< [ld_s]: kp − qp0, the key distances of the tile's first row
  SoftmaxStats<C>* stats = nullptr;  ///< [M]: m and l of each row
  C* alpha = nullptr;                ///< [M]: α of each row in the last softmax

  /// Row r of S (then P).
  C* score_row(Index r) const { return scores + r * ld_s; }
  /// Row r of acc.
  C* acc_row(Index r) const { return acc + r * ld_acc; }
};

/// The buffers of a tile of `rows` stacked rows of problem p on `path`, given key blocks of at
/// most key_block keys: each points into the thread's scratch, asked for at the size of the
/// path's largest tile (its most rows, its key block unclamped by S_k) rather than this tile's,
/// so that what a thread holds depends on neither S_q, S_k nor which task it runs (scratch.hpp,
/// ALLOCATION, which also says when this allocates).
template <class C, class P>
TileBuffers<C> tile_buffers(const P& p, const TilePath& path, Index rows, Index key_block,
                            const FlashBlocking& blocking) {
  TileBuffers<C> t;
  t.rows = rows;
  t.d_qk = p.d_qk;
  t.d_v = p.d_v;
  t.ld_s = padded(key_block);
  t.ld_acc = padded(p.d_v);
  ThreadScratch& scratch = ThreadScratch::local();
  const auto get = [&](ScratchSlot slot, Index count) { return scratch.get<C>(slot, count); };
  const bool gemm = !path.streaming;
  // Every tile has at most max(G, stacked_rows) rows (plan_attention), a streaming one also at
  // most stream_rows.
  const Index largest = std::max(p.group, blocking.stacked_rows);
  const Index m = std::max(rows, gemm ? largest : std::min(largest, blocking.stream_rows));
  const Index keys = std::max(
      key_block, key_block_for(p, path.streaming, blocking, std::numeric_limits<Index>::max()));
  const Index ld_s = padded(keys);
  t.q_stacked = get(ScratchSlot::kQStacked, m * p.d_qk);
  // The streaming path widens one panel of keys at a time (kStreamPanel rows).
  const Index copied = gemm ? keys : std::min(keys, kStreamPanel);
  if (gemm || !path.k_in_place) t.k_copy = get(ScratchSlot::kKCopy, copied * p.d_qk);
  // Value rows of blocks read in place are widened here where hidden keys need a check
  // (AttentionTile::add_values).
  constexpr bool kBlockValues = !is_storage_v<typename P::Value>;
  if (gemm || !path.v_in_place || kBlockValues) {
    t.v_copy = get(ScratchSlot::kVCopy, copied * p.d_v);
  }
  if (path.bf16 != nullptr) {
    const auto pairs = [&](ScratchSlot slot, Index count) {
      return scratch.get<Bf16Pair>(slot, count);
    };
    t.q_pairs = pairs(ScratchSlot::kQPacked, m * Bf16Kernels::pairs(p.d_qk));
    t.k_pairs = pairs(ScratchSlot::kKPacked, path.bf16->packed_pairs(keys, p.d_qk));
    t.p_pairs = pairs(ScratchSlot::kPPacked, m * Bf16Kernels::pairs(keys));
    t.v_pairs = pairs(ScratchSlot::kVPacked, Bf16Kernels::pairs(keys) * p.d_v);
  } else if (gemm && path.simd != nullptr) {
    t.k_packed = get(ScratchSlot::kKPacked, path.simd->packed_size(keys, p.d_qk));
    // Asked for by every tile of the path, keys-major or not (see the top of this function).
    t.q_t = get(ScratchSlot::kQPacked, p.d_qk * padded(keys_major_rows(p, path.simd->panel, m)));
  } else if (gemm && TileGemm<C>::kPacks) {
    t.q_packed = get(ScratchSlot::kQPacked, m * p.d_qk);
    t.k_packed = get(ScratchSlot::kKPacked, keys * p.d_qk);
    t.p_packed = get(ScratchSlot::kPPacked, m * keys);
    t.v_packed = get(ScratchSlot::kVPacked, keys * p.d_v);
  }
  t.scores = get(ScratchSlot::kScores, m * ld_s);
  t.acc = get(ScratchSlot::kAcc, m * t.ld_acc);
  // Bq <= m rows of ld_s; and Sᵀ of keys-major scores, keys × ld_t (ld_t <= padded(m)), done
  // with before mask() fills the position tile.
  t.position_tile = get(ScratchSlot::kPositionTile, (gemm ? padded(m) : m) * ld_s);
  t.ld_t = padded(rows);
  if (path.keys_major) t.scores_t = t.position_tile;
  if (p.alibi_slopes != nullptr) t.alibi = get(ScratchSlot::kAlibi, ld_s);
  t.stats = scratch.get<SoftmaxStats<C>>(ScratchSlot::kRowStats, m);
  t.alpha = get(ScratchSlot::kRowScale, m);
  return t;
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
