// SPDX-License-Identifier: MIT
// The GEMM path's products of a tile of the tiled kernel (attention_tile.hpp): S = Qs·K_jᵀ and
// acc = diag(α)·acc + P·V_j, over the tile's buffers (tile_scratch.hpp) and on the kernels its
// path chose (TilePath).
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
// prefetcher follows, whereas packing straight from DRAM waits on every cache line.
//
// KEYS-MAJOR SCORES. Transposing K_j into panels moves Bk·d_qk values a block, which a tile of
// few rows (the query heads of absorbed MLA or of a wide GQA group decoding a token or a few)
// cannot repay: each key then meets only M rows. On apex's float kernels a tile of M <= one panel
// (32 rows on AVX-512, 16 on AVX2) or M < d_qk rows computes Sᵀ = K_j·Qsᵀ instead: K_j's rows
// are gemm's a, read as they are stored where they are float (rows_as), Qsᵀ, transposed once per
// task, is its b, in panels of M's columns, and Sᵀ [Bk × M], which is then transposed into S,
// moves Bk·M values. Each score is the same chain of multiply-adds over d_qk as on the other
// kernels (a multiply-add's product commutes exactly), so the results keep their bits. The key
// rows are read where they are stored only when the block's values lie inside them (below): then
// that one read serves both products. Otherwise they are first copied into k_copy, a sequential
// read that the prefetcher follows; read in place from memory, the gemm's twelve rows at a time
// stall it. Measured (Zen 5, 2 threads): 16 draft tokens of 8 sequences over paged float K/V of
// 8192 tokens, G = 4, d_qk = 128, 104 ms in place and 82 ms copied; absorbed MLA's latent rows
// (values inside), 16 heads, 5.8 ms in place and 7.0 ms copied; keys that stay in cache (one
// head of 8192, 4 MiB) lose 10-20 % copied at 33 to 96 rows, a case decoding rarely meets (a
// layer's cache is read once a step).
//
// VALUES INSIDE THE KEYS. Where the value rows are the first columns of the key rows
// (values_lead_keys, kv_read.hpp: absorbed MLA reads c_kv inside [c_kv ‖ K_rope]), the block's
// keys as float rows, which the scores read (scores() returns them), are P·V_j's b as well: the
// block is read or widened once for both products.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/eigen_adapter.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/detail/simd_kernels.hpp>
#include <apex/detail/tile_scratch.hpp>

#include <Eigen/Core>

#include <type_traits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (row, count) pairs of one head
namespace apex::detail {

/// The GEMM path's products of one tile (PRODUCTS), over its buffers and on its path's kernels:
/// a view made where it is used, holding nothing of its own. Allocates nothing.
template <class C>
class TileProducts {
 public:
  /// The products of the tile whose path and buffers these are.
  TileProducts(const TilePath& path, const TileBuffers<C>& buf) : path_(path), buf_(buf) {}

  /// Readies Qs (q_stacked) for every score product of the task: packed for Eigen's, rounded
  /// into pairs along d_qk for the bfloat16 ones.
  void prepare_queries() const {
    if (path_.simd == nullptr) {
      TileGemm<C>::pack_queries(buf_.q_packed, buf_.q_stacked, buf_.rows, buf_.d_qk);
    }
    if (path_.keys_major)
      transpose(buf_.q_t, buf_.ld_t, buf_.q_stacked, buf_.d_qk, buf_.rows, buf_.d_qk);
    if constexpr (std::is_same_v<C, float>) {
      if (path_.bf16 != nullptr) {
        const Index d = buf_.d_qk;
        path_.bf16->round_pairs(buf_.q_pairs, Bf16Kernels::pairs(d), buf_.q_stacked, d, buf_.rows,
                                d);
      }
    }
  }

  /// S [rows × n] (ld_s) = Qs·K_jᵀ for the n keys from `row` of k_head: on the bfloat16 dot
  /// products where allowed (paired_scores); keys-major (KEYS-MAJOR SCORES; the rows read in
  /// place where `values_inside`, the block's values leading its keys); else K_j copied to
  /// k_copy (widened) and on apex's float kernels (K transposed into their panels) or on
  /// Eigen's. Returns K_j as the rows of C that apex's float kernels read (in place or in
  /// k_copy, valid until the next block) for P·V_j to reuse (read_values), else null rows.
  template <class TK>
  ConstRows<C> scores(const SegmentHead<TK>& k_head, Index row, Index n, bool values_inside) const {
    const Index d = buf_.d_qk;
    if constexpr (std::is_same_v<C, float>) {
      if (path_.bf16 != nullptr) {
        paired_scores(k_head, row, n);
        return {nullptr, 0};
      }
      if (path_.keys_major) return keys_major_scores(k_head, row, n, values_inside);
    }
    load_rows<C>(k_head, row, n, buf_.k_copy);
    if constexpr (std::is_same_v<C, float>) {
      if (const FloatKernels* simd = path_.simd; simd != nullptr) {
        simd->pack_transposed(buf_.k_packed, buf_.k_copy, d, n, d);
        simd->f32.gemm(buf_.scores, buf_.ld_s, buf_.q_stacked, d, buf_.k_packed, simd->panel,
                       d * simd->panel, buf_.rows, n, d, false, nullptr);
        return {buf_.k_copy, d};
      }
    }
    TileGemm<C>::scores(buf_.scores, buf_.ld_s, buf_.k_copy, buf_.k_packed, buf_.q_packed,
                        buf_.q_stacked, buf_.rows, n, d);
    return {nullptr, 0};
  }

  /// Row r of P (its n weights) rounded into pairs along the keys for the bfloat16 P·V, while
  /// the softmax has it at hand; nothing on the other kernels.
  void round_weights(Index r, Index n) const {
    if constexpr (std::is_same_v<C, float>) {
      if (path_.bf16 != nullptr) {
        const Index pairs = Bf16Kernels::pairs(n);
        path_.bf16->round_pairs(buf_.p_pairs + r * pairs, pairs, buf_.score_row(r), buf_.ld_s, 1,
                                n);
      }
    }
  }

  /// acc = diag(α)·acc, for the rows whose α is not 1 (whose maximum moved).
  void scale_acc() const {
    for (Index r = 0; r < buf_.rows; ++r) {
      if (buf_.alpha[r] != C(1)) {
        Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>(buf_.acc_row(r), buf_.d_v) *= buf_.alpha[r];
      }
    }
  }

  /// Reads the n values from `row` of v_head as the update reads them and calls f(v, update):
  /// v their ConstRows (the first d_v columns of `keys` where those are the same rows read by
  /// the scores, VALUES INSIDE THE KEYS; stored bfloat16 rows where the bfloat16 products pack
  /// them as they are; else widened to C in v_copy), update() the product acc = diag(scale)·acc
  /// + P·V of them (scale: α, or nullptr where no row needs it).
  template <class TV, class F>
  void read_values(const SegmentHead<TV>& v_head, Index row, Index n, const C* scale,
                   const ConstRows<C>& keys, F&& f) const {
    if constexpr (std::is_same_v<C, float>) {
      if (keys.data != nullptr) {
        return f(keys, [&] { float_update(keys, n, scale); });
      }
    }
    if constexpr (std::is_same_v<C, float> && std::is_same_v<TV, Eigen::bfloat16>) {
      if (path_.bf16 != nullptr) {  // packed from the stored rows
        const ConstRows<TV> v = stored_rows(v_head, row, n, stored_copy<TV>(buf_.v_copy));
        return f(v, [&] {
          path_.bf16->pack_values_bf16(buf_.v_pairs, simd_elements(v.data), v.stride, n, buf_.d_v);
          paired_update(n, scale);
        });
      }
    }
    load_rows<C>(v_head, row, n, buf_.v_copy);
    f(ConstRows<C>{buf_.v_copy, buf_.d_v}, [&] { update(n, scale); });
  }

 private:
  /// S = Qs·Kᵀ on the bfloat16 dot products, Qs and K rounded, in pairs along d_qk: K_j
  /// packed into panels of pairs from its stored rows when they are bfloat16 (in place, or
  /// copied where the block spans pages), else from its widened copy.
  template <class TK>
  void paired_scores(const SegmentHead<TK>& k_head, Index row, Index n) const {
    const Bf16Kernels& bf16 = *path_.bf16;
    const Index d = buf_.d_qk, pairs = Bf16Kernels::pairs(d);
    if constexpr (std::is_same_v<TK, Eigen::bfloat16>) {
      const ConstRows<TK> k = stored_rows(k_head, row, n, stored_copy<TK>(buf_.k_copy));
      bf16.pack_keys_bf16(buf_.k_pairs, simd_elements(k.data), k.stride, n, d);
    } else {
      load_rows<C>(k_head, row, n, buf_.k_copy);
      bf16.pack_keys(buf_.k_pairs, buf_.k_copy, d, n, d);
    }
    bf16.gemm(buf_.scores, buf_.ld_s, buf_.q_pairs, pairs, buf_.k_pairs, bf16.panel,
              pairs * bf16.panel, buf_.rows, n, pairs, false, nullptr);
  }

  /// acc = diag(scale)·acc + P·V for the n values in v_copy: on the bfloat16 dot products (P
  /// and V rounded, in pairs along the keys) or apex's float kernels, which scale each row as
  /// they load it (the same bits as scaling first: x·1 = x), or on Eigen's after scale_acc.
  void update(Index n, const C* scale) const {
    const Index d_v = buf_.d_v;
    if constexpr (std::is_same_v<C, float>) {
      if (path_.bf16 != nullptr) {
        path_.bf16->pack_values(buf_.v_pairs, buf_.v_copy, d_v, n, d_v);
        return paired_update(n, scale);
      }
      if (path_.simd != nullptr) return float_update({buf_.v_copy, d_v}, n, scale);
    }
    if (scale != nullptr) scale_acc();
    TileGemm<C>::update(buf_.acc, buf_.ld_acc, buf_.scores, buf_.ld_s, buf_.p_packed, buf_.v_copy,
                        buf_.v_packed, buf_.rows, n, d_v);
  }

  /// acc = diag(scale)·acc + P·V on apex's float kernels, V's n rows (the first d_v columns of
  /// each) in v, read as they are.
  void float_update(const ConstRows<float>& v, Index n, const float* scale) const {
    const FloatKernels& simd = *path_.simd;
    simd.f32.gemm(buf_.acc, buf_.ld_acc, buf_.scores, buf_.ld_s, v.data, v.stride, simd.panel,
                  buf_.rows, buf_.d_v, n, true, scale);
  }

  /// KEYS-MAJOR SCORES: Sᵀ [n × rows] = K_j·Qsᵀ on apex's float kernels, K_j's rows read as
  /// float (in place where stored so and `in_place`, else copied or widened into k_copy), then
  /// transposed into S. Returns those rows.
  template <class TK>
  ConstRows<float> keys_major_scores(const SegmentHead<TK>& k_head, Index row, Index n,
                                     bool in_place) const {
    const FloatKernels& simd = *path_.simd;
    ConstRows<float> k{buf_.k_copy, buf_.d_qk};
    if (in_place) {
      k = rows_as(k_head, row, n, buf_.k_copy);
    } else {
      load_rows<C>(k_head, row, n, buf_.k_copy);
    }
    simd.f32.gemm(buf_.scores_t, buf_.ld_t, k.data, k.stride, buf_.q_t, buf_.ld_t, simd.panel, n,
                  buf_.rows, buf_.d_qk, false, nullptr);
    transpose(buf_.scores, buf_.ld_s, buf_.scores_t, buf_.ld_t, n, buf_.rows);
    return k;
  }

  /// dst [cols × rows] (row stride ld_dst) = srcᵀ, src [rows × cols] (row stride ld_src).
  static void transpose(C* dst, Index ld_dst, const C* src, Index ld_src, Index rows, Index cols) {
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < cols; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
    }
  }

  /// acc = diag(scale)·acc + P·V on the bfloat16 dot products, V_j's n values in v_pairs and
  /// P's rounded by round_weights in p_pairs.
  void paired_update(Index n, const C* scale) const {
    const Index pairs = Bf16Kernels::pairs(n);
    path_.bf16->gemm(buf_.acc, buf_.ld_acc, buf_.p_pairs, pairs, buf_.v_pairs, buf_.d_v,
                     path_.bf16->panel, buf_.rows, buf_.d_v, pairs, true, scale);
  }

  /// The scratch of a block copy (room for Bk rows of C) as room for as many rows of T stored
  /// as they are (T no wider than C).
  template <class T>
  static T* stored_copy(C* buffer) {
    static_assert(sizeof(T) <= sizeof(C));
    return reinterpret_cast<T*>(buffer);  // NOLINT: scratch bytes, reused for narrower values
  }

  const TilePath& path_;
  const TileBuffers<C>& buf_;
};

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
