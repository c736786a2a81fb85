// SPDX-License-Identifier: MIT
// The shape and the weights of a lightning indexer (DeepSeek Sparse Attention, indexer.hpp):
// what LightningIndexer is built from, and what a stack with sparse global layers declares
// (StackConfig::indexer), apart from the indexer's kernels so that a config can be planned
// without them.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/mla_config.hpp>
#include <apex/tensor.hpp>

#include <cmath>

namespace apex {

/// Shape of a lightning indexer (DeepSeek-V3.2: H_I = 64, d_I = 128, d_r = 64, k = 2048).
struct IndexerConfig {
  Index d_model = 0;       ///< d, the width of the layer's input h
  Index d_q = 0;           ///< width of the query latent c_q (MLA's d_q)
  Index heads = 0;         ///< H_I, indexer query heads
  Index head_dim = 0;      ///< d_I, a power of two (the Hadamard transform)
  Index rope_dim = 0;      ///< d_r: RoPE on the first d_r features (even, <= d_I)
  Index top_k = 0;         ///< k >= 1: keys selected per query
  double norm_eps = 1e-6;  ///< ε of the keys' LayerNorm
  /// Permits the scores' products q_{t,j}·k_s with bfloat16 factors, summed in float, where the
  /// CPU has AVX512-BF16's dot products or AMX's tiles (KernelIsa::kAvx512Bf16, kAmx, cpu.hpp):
  /// each query head and each key (in float, or widened from its format) is rounded to
  /// bfloat16 to nearest even; keys stored as bfloat16 are read as they are. Each product then
  /// carries a relative error up to 2^-8·Σ_c |q_c·k_c| / |q·k|, so nearly equal scores may
  /// swap ranks (DeepSeek's own indexer multiplies in fp8). Elsewhere, or when the indexer
  /// computes in double, the products are exact as without it. Off by default.
  bool allow_bf16_products = false;

  /// Whether every field is equal (the stack checks each global layer's indexer against
  /// StackConfig::indexer so).
  friend bool operator==(const IndexerConfig& a, const IndexerConfig& b) {
    return a.d_model == b.d_model && a.d_q == b.d_q && a.heads == b.heads &&
           a.head_dim == b.head_dim && a.rope_dim == b.rope_dim && a.top_k == b.top_k &&
           a.norm_eps == b.norm_eps && a.allow_bf16_products == b.allow_bf16_products;
  }
  /// !(a == b).
  friend bool operator!=(const IndexerConfig& a, const IndexerConfig& b) { return !(a == b); }
};

/// The weights of a lightning indexer, applied as x·W.
template <class Weight>
struct IndexerWeights {
  RowMatrix<Weight> w_q;        ///< W_IQ [d_q, H_I·d_I]
  RowMatrix<Weight> w_k;        ///< W_IK [d, d_I]
  Vector<Weight> k_norm_gamma;  ///< LayerNorm weight [d_I]
  Vector<Weight> k_norm_beta;   ///< LayerNorm bias [d_I]
  RowMatrix<Weight> w_w;        ///< W_IW [d, H_I]
};

namespace detail {

/// Throws unless c describes an indexer.
inline void check_indexer_config(const IndexerConfig& c) {
  const char* op = "indexer";
  APEX_CHECK(c.d_model >= 1, "[" << op << "] d_model (" << c.d_model << ") must be >= 1");
  APEX_CHECK(c.d_q >= 1, "[" << op << "] d_q (" << c.d_q << ") must be >= 1");
  APEX_CHECK(c.heads >= 1, "[" << op << "] heads H_I (" << c.heads << ") must be >= 1");
  APEX_CHECK(c.head_dim >= 1 && (c.head_dim & (c.head_dim - 1)) == 0,
             "[" << op << "] head_dim d_I (" << c.head_dim
                 << ") must be a power of two (the Hadamard transform)");
  APEX_CHECK(c.rope_dim >= 2 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim,
             "[" << op << "] rope_dim d_r (" << c.rope_dim << ") must be even, >= 2 and <= d_I ("
                 << c.head_dim << ")");
  APEX_CHECK(c.top_k >= 1, "[" << op << "] top_k (" << c.top_k << ") must be >= 1");
  APEX_CHECK(c.norm_eps > 0.0 && std::isfinite(c.norm_eps),
             "[" << op << "] norm_eps (" << c.norm_eps << ") must be positive and finite");
  checked_product({c.d_q, c.heads, c.head_dim}, op, "W_IQ count d_q*H_I*d_I");
  checked_product(c.d_model, c.head_dim, op, "W_IK count d*d_I");
  checked_product(c.d_model, c.heads, op, "W_IW count d*H_I");
}

/// Throws unless an indexer of config i can serve an MLA layer of config c: the same d_model,
/// d_q and d_r (the indexer reads MLA's query latent and turns the same RoPE table).
inline void check_indexer_fits(const MlaConfig& c, const IndexerConfig& i, const char* op) {
  APEX_CHECK(i.d_model == c.d_model && i.d_q == c.d_q && i.rope_dim == c.rope_dim,
             "[" << op << "] indexer d_model (" << i.d_model << "), d_q (" << i.d_q
                 << ") and rope_dim (" << i.rope_dim << ") must equal the MLA layer's ("
                 << c.d_model << ", " << c.d_q << ", " << c.rope_dim << ")");
}

}  // namespace detail

}  // namespace apex
