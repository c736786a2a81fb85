// SPDX-License-Identifier: MIT
// The tile of the tiled kernel (flash_attention.hpp): one task's stacked query rows while the
// blocks of its keys stream past, with an online softmax (FlashAttention: Dao et al. 2022,
// Algorithm 1).
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
//   score       S = Qs·K_jᵀ                       K_j read through kv_read.hpp
//   mask        the score terms (score_terms.hpp), forbidden keys → -inf
//   softmax     m, l and P = exp(S − m) per row    softmax_update (online_softmax.hpp)
//   accumulate  acc = diag(α)·acc + P·V_j          V_j read through kv_read.hpp
// and finish_row() ends each row with softmax_finish: out = acc / l, lse = m + log l (with the
// sink, which joins there once: THE SINK in online_softmax.hpp). Q is widened and scaled once
// per task (load_queries).
//
// MASK-AWARE SKIPPING. Each (query block, key block) pair is classified on absolute positions
// with classify_block, and by the user's rules' classifier: kNone skips the block (no product at
// all), kAll needs no mask work, and kPartial applies the rule element by element (the position
// rule evaluated once for the Bq × Bk tile and shared by the G stacked heads). Dense masks and
// biases apply to every block that is not skipped, soft-cap and ALiBi to every block.
//
// NON-FINITE INPUT follows apex::sdpa's policy (sdpa.hpp). In the tile: a block where some key
// may take no part and whose values are not all finite adds only the keys that take part
// (accumulate_visible); a float tile notes a raw score that is not finite
// (saw_non_finite_score), so that its job is computed again in double (attention_plan.hpp).
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
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/score_terms.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, the tile's position (b, kv head,
// first query, rows)
namespace apex::detail {

/// Leading dimension of scratch rows: a multiple of 16 scalars, so that rows start on a cache
/// line and vectorised loops over a row peel the same way on every thread.
inline Index padded(Index n) { return (n + 15) / 16 * 16; }

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
        terms_(p),
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
                        terms_.dense() || P::Rules::kScores;
    score(keys, masked);
    if (masked || terms_.modifies()) {
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
      for_each_panel(k_head, keys.row, keys.n, [&](Index j0, Index m) {
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

  /// mask: the score terms of every row (ScoreTerms: transform, then forbid); `coverage` is what
  /// the PositionMask says of the block, `user` what the user's mask rule says. The position
  /// tile and the key distances of ALiBi are formed once per block for the G stacked heads.
  void mask(const Block& keys, BlockCoverage coverage, BlockCoverage user) {
    const Index qp0 = p_.first_query + q0_;
    const bool partial = coverage == BlockCoverage::kPartial;
    if (partial) {
      PositionTile<C>::fill(p_.positions, qp0, bq_, keys.position(), keys.n, position_tile_, ld_s_);
    }
    if (terms_.alibi.on()) AlibiTerm<C>::fill(alibi_, keys.position(), qp0, keys.n);
    for (Index r = 0; r < rows_; ++r) {
      ScoreArray<C> s(scores_ + r * ld_s_, keys.n);
      const Index i = query_of(r);
      const ScoreRow row{b_,         head_of(r),      i,     p_.first_query + i,
                         keys.index, keys.position(), keys.n};
      terms_.transform(s, row, alibi_, i - q0_);
      terms_.forbid(s, row, partial ? position_tile_ + (i - q0_) * ld_s_ : nullptr,
                    user == BlockCoverage::kPartial);
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
      for_each_panel(v_head, keys.row, keys.n, [&](Index j0, Index m) {
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
  ScoreTerms<C, P> terms_;
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

/// Whether a tile met a non-finite number that a float pass must redo in double.
template <class C, class Tile>
bool tile_finite(const Tile& tile) {
  return !std::is_same_v<C, float> || (!tile.saw_non_finite_score() && tile.finite());
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
