// SPDX-License-Identifier: MIT
// The shape of an APEX-1 attention stack (StackConfig), the options of its cached calls
// (DecodeOptions), and what it holds per layer and in its caches (LayerPlan,
// stack_cache_memory): values with no weights behind them, so that a model can be planned, APEX-1
// Large included, before one is built. The stack itself is in stack.hpp, its decoding state in
// stack_cache.hpp.
#pragma once

#include <apex/cache_memory.hpp>
#include <apex/config.hpp>
#include <apex/gqa.hpp>
#include <apex/indexer_config.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_format.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mla.hpp>
#include <apex/rope.hpp>
#include <apex/rope_config.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/yarn.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace apex {

/// Shape of an APEX-1 attention stack.
struct StackConfig {
  Index vocab_size = 0;     ///< V
  Index d_model = 0;        ///< d
  Index num_layers = 0;     ///< L
  Index window = 0;         ///< W of the local layers (§10)
  Index global_every = 6;   ///< F_g (§11.2)
  GqaConfig local;          ///< local layers; local.d_model must equal d_model
  MlaConfig global;         ///< global layers; global.d_model must equal d_model
  Index max_positions = 0;  ///< longest sequence the RoPE tables cover
  /// Base, pairing and rotated features of the RoPE tables: the local layers' table rotates the
  /// first rope.rotary_dim features of each head (0: all; partial rotary, even, at most d_h),
  /// the global layers' table all d_r features of the decoupled RoPE (§9.3) whatever
  /// rotary_dim says.
  RopeParams rope;
  double norm_eps = 1e-6;  ///< ε of every RMSNorm (§3.2)
  /// YaRN (§5) for the RoPE tables: scale s, original context L, temperature placement. Unset:
  /// plain RoPE. When set, yarn->base must equal rope.base and max_positions must not exceed
  /// s·L (the context the YaRN frequencies are made for).
  std::optional<YarnParams> yarn;
  /// Another scaling of the RoPE tables (rope_scaling.hpp: linear, dynamic NTK, Llama 3,
  /// LongRoPE), for the local layers and, unless global_rope is set, the global ones; at most one
  /// of yarn and rope_scaling. Unset (std::monostate): none.
  RopeScaling rope_scaling;
  /// The RoPE (and YaRN) of the global layers when it differs from the local layers' rope and
  /// yarn: Gemma 3, for one, rotates its local layers with base 10 000 and its global ones with
  /// base 1 000 000. Unset: the global layers use rope and yarn too. Its rope.rotary_dim must be
  /// 0 (the decoupled RoPE rotates all of its d_r features).
  std::optional<LayerRope> global_rope;
  /// How the global (MLA) layers' weights are folded for absorbed decoding, once, at
  /// construction (absorb_mla_weights).
  MlaAbsorbParams absorb;
  /// Sparse global layers (DeepSeek Sparse Attention, sparse_mla.hpp): when set, every global
  /// layer has a lightning indexer of this shape (its d_model, d_q and rope_dim equal to
  /// global's), and each query attends to the top_k keys its indexer picks among those it sees
  /// (the bidirectional prefix included). The caches then hold an indexer key per token and
  /// global layer beside the latent row. Unset: dense global layers.
  std::optional<IndexerConfig> indexer;
};

/// The format a stack's sparse global layers store their indexer keys in: the latent rows'
/// format G, or DeepSeek's own fp8 blocks of 128 values (BlockFp8E4m3<128>) when G is a
/// whole-row latent format (FlashMlaFp8Row), which holds latent rows only.
template <class G>
using indexer_key_format_t = std::conditional_t<is_latent_row_format_v<G>, BlockFp8E4m3<128>, G>;

/// Which rows of logits prefill() and extend() return.
enum class LogitRows {
  kAll,   ///< every new token: [B*n, V], row b*n + s
  kLast,  ///< the last new token of each sequence: [B, V] (all a generation loop needs)
};

/// Options of the cached (inference) calls of AttentionStack.
struct DecodeOptions {
  /// Which rows of logits to return: every new token (the default) or only the last one of
  /// each sequence, which shrinks the LM head's product from [B*n, d]·[d, V] to [B, d]·[d, V].
  LogitRows logits = LogitRows::kAll;
  /// MLA decoding path of the global layers (mla.hpp): kAuto takes the cheaper one for the
  /// chunk length (absorbed for single tokens, naive for prompts); both are exact. Sparse
  /// global layers (StackConfig::indexer) always take the absorbed path over their selection.
  MlaPath mla = MlaPath::kAuto;
};

/// The cache memory of an APEX-1 stack at a given context, by layer kind (bytes).
struct StackCacheMemory {
  Index local_layers = 0;   ///< GQA + sliding window
  Index global_layers = 0;  ///< MLA
  /// One local layer, one sequence, one token: 2·H_kv·d_h·bytes (K and V), held for the last
  /// W tokens only. 0 when there is no local layer.
  std::int64_t local_bytes_per_token = 0;
  /// One global layer, one sequence, one token: (d_kv + H_kr·d_r)·bytes (c_kv and K_rope,
  /// mla.hpp), plus indexer_bytes_per_token for sparse global layers. 0 when there is no global
  /// layer.
  std::int64_t global_bytes_per_token = 0;
  /// The part of global_bytes_per_token that is the indexer's key (d_I values) when the global
  /// layers are sparse (StackConfig::indexer); 0 otherwise.
  std::int64_t indexer_bytes_per_token = 0;
  /// One local layer at the context: B·min(S, W)·local_bytes_per_token (§10.3).
  std::int64_t local_bytes_per_layer = 0;
  /// One global layer at the context: B·S·global_bytes_per_token (§9.4 plus K_rope).
  std::int64_t global_bytes_per_layer = 0;
  /// Every layer: local_layers·local_bytes_per_layer + global_layers·global_bytes_per_layer.
  std::int64_t total_bytes = 0;
};

/// One row of the layer plan: what layer l is and what a decoder caches for it per token.
struct LayerPlan {
  Index layer = 0;      ///< l, counted from 0
  bool global = false;  ///< true for a global (MLA) layer, l mod F_g = F_g − 1 (§11.2)
  /// Values cached per token: 2·H_kv·d_h for a local layer (kept for the last W tokens only);
  /// d_kv + H_kr·d_r for a global (MLA) layer (c_kv and K_rope, see mla.hpp), plus d_I when it
  /// is sparse (the indexer's key).
  std::int64_t cache_values_per_token = 0;
};

namespace detail {

/// The fields of the layer rule every use of a config needs: L >= 0, W >= 1 and F_g >= 1.
inline void check_stack_layer_rule(const StackConfig& c) {
  APEX_CHECK(c.num_layers >= 0, "[stack] num_layers (" << c.num_layers << ") must be >= 0");
  APEX_CHECK(c.window >= 1, "[stack] window W (" << c.window << ") must be >= 1");
  APEX_CHECK(c.global_every >= 1,
             "[stack] global_every F_g (" << c.global_every << ") must be >= 1");
}

/// Throws for a stack with sparse global layers (config.indexer) where `op` runs dense ones
/// only: training and the context-parallel calls.
inline void check_dense_stack(const StackConfig& c, const char* op) {
  APEX_CHECK(!c.indexer, "[" << op << "] takes a stack with dense global layers: config.indexer "
                             << "(sparse global layers) runs in forward(), the cached calls "
                             << "(prefill, extend, decode_step), serve() and speculative "
                             << "decoding (verify_drafts, accept_drafts) only");
}

}  // namespace detail

/// The cache memory of a stack with this config holding `context` tokens for `batch` sequences,
/// each value `bytes_per_value` bytes wide (2 for FP16, sizeof(Scalar) for a StackCache): what
/// StackCache::bytes() reports for a cache of capacity `context`. Needs no weights, so it can
/// be evaluated for APEX-1 Large. Throws on a non-positive batch, context or value width, an
/// invalid layer config, or a size beyond 64 bits.
inline StackCacheMemory stack_cache_memory(const StackConfig& c, Index batch, Index context,
                                           Index bytes_per_value) {
  APEX_CHECK(batch >= 1 && context >= 1 && bytes_per_value >= 1,
             "[stack] batch (" << batch << "), context (" << context << ") and bytes_per_value ("
                               << bytes_per_value << ") must be >= 1");
  detail::check_stack_layer_rule(c);
  StackCacheMemory m;
  // Layers l in [0, L) with l mod F_g = F_g − 1 (§11.2): floor(L / F_g) of them, counted without
  // a loop over a user-given L.
  m.global_layers = c.num_layers / c.global_every;
  m.local_layers = c.num_layers - m.global_layers;
  // Every product is checked: the dimensions are the user's, and a wrapped size is worse than
  // an error.
  const char* op = "stack";
  if (m.local_layers > 0) {
    detail::check_gqa_config(c.local);
    m.local_bytes_per_token = detail::checked_product(
        {2, c.local.num_kv_heads, c.local.head_dim, bytes_per_value}, op, "2*H_kv*d_h*bytes");
    m.local_bytes_per_layer = sliding_window_cache_bytes(
        batch, context, c.window, c.local.num_kv_heads, c.local.head_dim, bytes_per_value);
  }
  if (m.global_layers > 0) {
    detail::check_mla_config(c.global);
    const std::int64_t values = detail::checked_sum(
        c.global.d_kv,
        detail::checked_product(c.global.rope_key_heads(), c.global.rope_dim, op, "H_kr*d_r"), op,
        "d_kv + H_kr*d_r");
    if (c.indexer) {
      detail::check_indexer_config(*c.indexer);
      m.indexer_bytes_per_token =
          detail::checked_product(c.indexer->head_dim, bytes_per_value, op, "d_I*bytes");
    }
    m.global_bytes_per_token =
        detail::checked_sum(detail::checked_product(values, bytes_per_value, op, "bytes/token"),
                            m.indexer_bytes_per_token, op, "bytes/token");
    m.global_bytes_per_layer =
        detail::checked_product({batch, context, m.global_bytes_per_token}, op, "B*S*bytes/token");
  }
  const std::int64_t local_bytes =
      detail::checked_product(m.local_layers, m.local_bytes_per_layer, op, "local bytes");
  const std::int64_t global_bytes =
      detail::checked_product(m.global_layers, m.global_bytes_per_layer, op, "global bytes");
  m.total_bytes = detail::checked_sum(local_bytes, global_bytes, op, "total bytes");
  return m;
}

/// The cache memory of a stack with this config whose local layers store format F and whose
/// global layers store format G (kv_format.hpp: float, double, a 16-bit type, a block format of
/// kv_quant.hpp, or for G a whole-row latent format such as FlashMlaFp8Row; G = F unless given):
/// what StackCache<Scalar, F, G>::bytes() reports for a cache of capacity `context`. A local
/// layer holds 2·H_kv rows of d_h values per token for min(S, W) tokens, a global one a latent
/// row [c_kv ‖ K_rope] of d_kv + H_kr·d_r values; each row costs the bytes of its elements. For
/// one scalar format this is stack_cache_memory(c, batch, context, sizeof(F)). Sparse global
/// layers add an indexer key of d_I values per token in indexer_key_format_t<G>. Throws as that
/// does, and unless d_h is whole blocks of F, the latent row's parts are stored by G
/// (detail::check_latent_parts) and d_I is whole blocks of the key format.
template <class F, class G = F>
StackCacheMemory stack_cache_memory(const StackConfig& c, Index batch, Index context) {
  StackCacheMemory m = stack_cache_memory(c, batch, context, 1);  // the checks and layer counts
  const char* op = "stack";
  if (m.local_layers > 0) {
    detail::check_row_values<F>(c.local.head_dim, op, "local head_dim");
    const std::int64_t row = KvFormat<F>::bytes(KvFormat<F>::elements(c.local.head_dim));
    m.local_bytes_per_token =
        detail::checked_product({2, c.local.num_kv_heads, row}, op, "2*H_kv*row bytes");
    m.local_bytes_per_layer = detail::checked_product(
        {batch, std::min<Index>(context, c.window), m.local_bytes_per_token}, op,
        "B*min(S, W)*bytes/token");
  }
  if (m.global_layers > 0) {
    LatentCacheShape latent;
    latent.latent_dim = c.global.d_kv;
    latent.rope_heads = c.global.rope_key_heads();
    latent.rope_dim = c.global.rope_dim;
    detail::check_latent_parts<G>(latent, op);
    const Index values = latent.latent_dim + latent.rope_heads * latent.rope_dim;  // checked
    if (c.indexer) {
      using K = indexer_key_format_t<G>;
      detail::check_row_values<K>(c.indexer->head_dim, op, "indexer head_dim");
      m.indexer_bytes_per_token = KvFormat<K>::bytes(KvFormat<K>::elements(c.indexer->head_dim));
    }
    m.global_bytes_per_token =
        KvFormat<G>::bytes(KvFormat<G>::elements(values)) + m.indexer_bytes_per_token;
    m.global_bytes_per_layer =
        detail::checked_product({batch, context, m.global_bytes_per_token}, op, "B*S*bytes/token");
  }
  m.total_bytes = detail::checked_sum(
      detail::checked_product(m.local_layers, m.local_bytes_per_layer, op, "local bytes"),
      detail::checked_product(m.global_layers, m.global_bytes_per_layer, op, "global bytes"), op,
      "total bytes");
  return m;
}

}  // namespace apex
