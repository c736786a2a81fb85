// SPDX-License-Identifier: MIT
// Absorbed MLA decoding (§9): the weights folded for it, the choice between it and the naive
// path, and the steps of MultiHeadLatentAttention::forward_absorbed and forward_paged (mla.hpp)
// that need only the layer's config and weights: the absorbed queries and output.
//
// Naive decoding decompresses K = c_kv·W_UK and V = c_kv·W_UV for every cached token. Absorbed
// decoding, with g the key head of query head h, reads the same attention as
//   q_h·k_j = q_h·(c_kv,j W_UK,g) = (q_h W_UK,gᵀ)·c_kv,j          (W_UK into the query)
//   Σ_j p_j v_j = Σ_j p_j c_kv,j W_UV,g = (Σ_j p_j c_kv,j) W_UV,g   (W_UV into the output)
// so every query head attends straight to the cached rows [c_kv ‖ K_rope] with the query
// [q_h W_UK,gᵀ ‖ q_rope,h] (d_kv + d_r wide) and values c_kv: one apex::sdpa call whose single
// key/value head is shared by all H_q query heads. Nothing is decompressed; the cost per cached
// token is O(H_q·d_kv) instead of the naive O(H_kv·d_h·d_kv) decompression, which is what makes
// MLA decoding cheap.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/kv_cache.hpp>
#include <apex/mla_config.hpp>
#include <apex/rope.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

namespace apex {

/// How absorb_mla_weights treats one side of the absorption.
///   kFactored   keep the two factors and apply them in turn at run time (q̃_h = (c_q W_UQ,h)
///               W_UK,gᵀ; out = Concat(o_h W_UV,g) W_O): nothing new is stored;
///   kMultiplied store their product (W_UQ,h W_UK,gᵀ: [d_q, d_kv] per head; W_UV,g W_O,h:
///               [d_kv, d] per head), one product at run time;
///   kAuto       whichever costs fewer multiply-adds per token: query side multiplied iff
///               d_q·d_kv <= d_h·(d_q + d_kv), output side iff d_kv·d <= d_h·(d_kv + d).
/// With the usual d_kv > d_h (APEX-1 Large: d_kv = 512, d_h = 128) both products are larger than
/// their factors, so kAuto keeps them factored; the products pay off when d_kv is small.
enum class MlaFold { kAuto, kFactored, kMultiplied };

/// Parameters of absorb_mla_weights.
struct MlaAbsorbParams {
  MlaFold query = MlaFold::kAuto;   ///< W_UK into the query side
  MlaFold output = MlaFold::kAuto;  ///< W_UV into the output side
};

/// What absorbed MLA decoding needs beyond the layer's own weights: the folded products where
/// absorb_mla_weights chose to multiply (an empty matrix means "factored: use W_UQ and W_UK, or
/// W_UV and W_O, in turn"). Computed once per layer at load time, stored as the layer's Weight.
template <class Weight>
struct MlaAbsorbedWeights {
  MlaConfig config;              ///< the config of the layer they were folded from
  RowMatrix<Weight> w_q_latent;  ///< [d_q, H_q·d_kv], block h = W_UQ,h · W_UK,gᵀ; or empty
  RowMatrix<Weight> w_o_latent;  ///< [H_q·d_kv, d], row block h = W_UV,g · W_O,h; or empty

  /// True when the query side was folded into w_q_latent; false: apply W_UQ, then W_UKᵀ.
  bool query_multiplied() const { return w_q_latent.size() != 0; }
  /// True when the output side was folded into w_o_latent; false: apply W_UV, then W_O.
  bool output_multiplied() const { return w_o_latent.size() != 0; }
};

/// Which MLA decoding path a caller wants (AttentionStack's DecodeOptions).
///   kNaive     decompress K and V of the whole cache, then attend (forward_cached)
///   kAbsorbed  attend to the latent rows directly (forward_absorbed)
///   kAuto      mla_cheaper_path for the chunk length
enum class MlaPath { kAuto, kNaive, kAbsorbed };

/// The cheaper exact path for n new tokens per sequence, counting the attention's multiply-adds
/// per cached token: naive 2·d_kv·H_kv·d_h (decompressing K and V) + n·H_q·(2·d_h + d_r),
/// absorbed n·H_q·(2·d_kv + H_kr·d_r). The cache length cancels, so the answer depends on n
/// alone: absorbed for single tokens and short chunks, naive for prompts (APEX-1 Large with
/// H_kr = 1: absorbed up to n = 10).
inline MlaPath mla_cheaper_path(const MlaConfig& c, Index new_tokens) {
  detail::check_mla_config(c);
  APEX_CHECK(new_tokens >= 1,
             "[mla] new_tokens (" << new_tokens << ") must be >= 1 (tokens per sequence)");
  const double n = static_cast<double>(new_tokens);
  const double h_q = static_cast<double>(c.num_q_heads);
  const double d_kv = static_cast<double>(c.d_kv);
  const double d_h = static_cast<double>(c.head_dim);
  const double d_r = static_cast<double>(c.rope_dim);
  const double naive =
      2.0 * d_kv * static_cast<double>(c.num_kv_heads) * d_h + n * h_q * (2.0 * d_h + d_r);
  const double absorbed = n * h_q * (2.0 * d_kv + static_cast<double>(c.rope_key_heads()) * d_r);
  return absorbed <= naive ? MlaPath::kAbsorbed : MlaPath::kNaive;
}

namespace detail {

/// The heads of the absorbed attention: H_q query heads against one key/value head, queries and
/// keys d_kv + H_kr·d_r wide (a cached row), values d_kv wide (c_kv).
inline LayerHeads mla_absorbed_heads(const MlaConfig& c) {
  return {c.num_q_heads, 1, c.d_kv + c.rope_key_heads() * c.rope_dim, c.d_kv};
}

/// Throws unless `absorbed` was folded from a layer of config c (absorb_mla_weights).
template <class Weight>
void check_absorbed_weights(const MlaConfig& c, const MlaAbsorbedWeights<Weight>& absorbed) {
  const MlaConfig& a = absorbed.config;
  APEX_CHECK(a.d_model == c.d_model && a.d_q == c.d_q && a.d_kv == c.d_kv &&
                 a.num_q_heads == c.num_q_heads && a.num_kv_heads == c.num_kv_heads &&
                 a.head_dim == c.head_dim && a.rope_dim == c.rope_dim &&
                 a.rope_key_heads() == c.rope_key_heads(),
             "[mla] absorbed weights were folded from a layer of another shape: use "
             "absorb_mla_weights(this layer)");
  // H_q·d_kv is not among the sizes the config check bounds (it bounds H_q·d_h).
  const Index latent = checked_product(c.num_q_heads, c.d_kv, "mla", "H_q*d_kv");
  APEX_CHECK(!absorbed.query_multiplied() ||
                 (absorbed.w_q_latent.rows() == c.d_q && absorbed.w_q_latent.cols() == latent),
             "[mla] absorbed w_q_latent shape ["
                 << absorbed.w_q_latent.rows() << ", " << absorbed.w_q_latent.cols()
                 << "] must be [d_q, H_q*d_kv] = [" << c.d_q << ", " << latent << "] (or empty)");
  APEX_CHECK(!absorbed.output_multiplied() ||
                 (absorbed.w_o_latent.rows() == latent && absorbed.w_o_latent.cols() == c.d_model),
             "[mla] absorbed w_o_latent shape ["
                 << absorbed.w_o_latent.rows() << ", " << absorbed.w_o_latent.cols()
                 << "] must be [H_q*d_kv, d] = [" << latent << ", " << c.d_model << "] (or empty)");
}

/// The folding of absorb_mla_weights (see there) for a layer of config c and weights w.
template <class Weight>
MlaAbsorbedWeights<Weight> fold_mla_weights(const MlaConfig& c, const MlaWeights<Weight>& w,
                                            const MlaAbsorbParams& params) {
  const Index h_q = c.num_q_heads;
  const Index group = h_q / c.num_kv_heads;
  const Index d_h = c.head_dim;
  const Index d_kv = c.d_kv;
  const Index d = c.d_model;
  // Costs in double: d_q·d_kv is not among the sizes the config check bounds.
  const auto choose = [](MlaFold fold, double multiplied_cost, double factored_cost) {
    return fold == MlaFold::kMultiplied ||
           (fold == MlaFold::kAuto && multiplied_cost <= factored_cost);
  };
  const auto real = [](Index n) { return static_cast<double>(n); };
  MlaAbsorbedWeights<Weight> result;
  result.config = c;
  const bool multiply_query =
      choose(params.query, real(c.d_q) * real(d_kv), real(d_h) * (real(c.d_q) + real(d_kv)));
  const bool multiply_output =
      choose(params.output, real(d_kv) * real(d), real(d_h) * (real(d_kv) + real(d)));
  // The products are new matrices: check their sizes before allocating either.
  const auto bytes = static_cast<Index>(sizeof(Weight));
  if (multiply_query) {
    checked_product({c.d_q, h_q, d_kv, bytes}, "mla", "w_q_latent bytes d_q*H_q*d_kv");
  }
  if (multiply_output) {
    checked_product({h_q, d_kv, d, bytes}, "mla", "w_o_latent bytes H_q*d_kv*d");
  }
  if (multiply_query) {
    const RowMatrix<double> w_uq = converted<double>(w.w_uq);
    const RowMatrix<double> w_uk = converted<double>(w.w_uk);
    result.w_q_latent.resize(c.d_q, h_q * d_kv);
    for (Index h = 0; h < h_q; ++h) {
      const Index g = h / group;
      result.w_q_latent.middleCols(h * d_kv, d_kv) = converted<Weight>(
          matmul_transposed<double>(w_uq.middleCols(h * d_h, d_h), w_uk.middleCols(g * d_h, d_h)));
    }
  }
  if (multiply_output) {
    const RowMatrix<double> w_uv = converted<double>(w.w_uv);
    const RowMatrix<double> w_o = converted<double>(w.w_o);
    result.w_o_latent.resize(h_q * d_kv, d);
    for (Index h = 0; h < h_q; ++h) {
      const Index g = h / group;
      result.w_o_latent.middleRows(h * d_kv, d_kv) = converted<Weight>(
          matmul<double>(w_uv.middleCols(g * d_h, d_h), w_o.middleRows(h * d_h, d_h)));
    }
  }
  return result;
}

/// The absorbed queries of forward_absorbed, [B*n, H_q·(d_kv + H_kr·d_r)]: per head
/// [q̃_h ‖ 0 … Q_rope,h … 0], q̃_h = Q_h W_UK,gᵀ, the rope part in the slot of head h's K_rope,
/// every row rotated at its position `at` (the slots: MultiHeadLatentAttention::forward_absorbed).
/// Throws (before allocating) when their size does not fit in 64 bits. c_q = x·W_DQ, the query
/// latent, is the caller's (a sparse layer's indexer reads it too).
template <class Scalar, class Weight>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): x and its query latent, in that order
RowMatrix<Scalar> absorbed_queries(const MlaConfig& c, const MlaWeights<Weight>& w,
                                   const ConstRowRef<Scalar>& x, const RowMatrix<Scalar>& c_q,
                                   const RowPositions& at,
                                   const AttentionLayerParams<Scalar>& params,
                                   const MlaAbsorbedWeights<Weight>& absorbed) {
  const Index h_q = c.num_q_heads;
  const Index group = h_q / c.num_kv_heads;
  const Index d_h = c.head_dim;
  const Index d_r = c.rope_dim;
  const Index d_kv = c.d_kv;
  const Index width = d_kv + c.rope_key_heads() * d_r;  // of a cached row and a query head
  const Index q_width =
      checked_product(h_q, width, "mla", "absorbed query width H_q*(d_kv + H_kr*d_r)");
  checked_product({x.rows(), q_width, static_cast<Index>(sizeof(Scalar))}, "mla",
                  "absorbed query bytes B*n*H_q*(d_kv + H_kr*d_r)");
  RowMatrix<Scalar> q = RowMatrix<Scalar>::Zero(x.rows(), q_width);
  if (absorbed.query_multiplied()) {
    const RowMatrix<Scalar> q_latent = matmul<Scalar>(c_q, absorbed.w_q_latent);
    for (Index h = 0; h < h_q; ++h) {
      q.middleCols(h * width, d_kv) = q_latent.middleCols(h * d_kv, d_kv);
    }
  } else {
    // q̃ for the G heads of group g of token t: [G, d_h] (contiguous in Q's row) · W_UK,gᵀ.
    const RowMatrix<Scalar> q_content = matmul<Scalar>(c_q, w.w_uq);
    for (Index t = 0; t < x.rows(); ++t) {
      for (Index g = 0; g < c.num_kv_heads; ++g) {
        const Eigen::Map<const RowMatrix<Scalar>> q_group(q_content.row(t).data() + g * group * d_h,
                                                          group, d_h);
        RowMap<Scalar> target(q.row(t).data() + g * group * width, group, d_kv,
                              Eigen::OuterStride<>(width));
        matmul_transposed<Scalar>(q_group, w.w_uk.middleCols(g * d_h, d_h), target);
      }
    }
  }
  RowMatrix<Scalar> q_rope = matmul<Scalar>(x, w.w_qr);
  apply_rope_at(*params.rope, at, q_rope);
  for (Index h = 0; h < h_q; ++h) {
    const Index slot = c.rope_key_heads() == 1 ? 0 : h / group;
    q.middleCols(h * width + d_kv + slot * d_r, d_r) = q_rope.middleCols(h * d_r, d_r);
  }
  return q;
}

/// absorbed_queries with the query latent c_q = x·W_DQ computed here.
template <class Scalar, class Weight>
RowMatrix<Scalar> absorbed_queries(const MlaConfig& c, const MlaWeights<Weight>& w,
                                   const ConstRowRef<Scalar>& x, const RowPositions& at,
                                   const AttentionLayerParams<Scalar>& params,
                                   const MlaAbsorbedWeights<Weight>& absorbed) {
  return absorbed_queries(c, w, x, matmul<Scalar>(x, w.w_dq), at, params, absorbed);
}

/// out = Concat_h (o_h W_UV,g) · W_O, or Concat_h o_h · W_o_latent when folded, from the latent
/// attention outputs o_latent [B*n, H_q·d_kv] -> out [B*n, d]. Allocates the [B*n, H_q·d_h]
/// concatenation when factored.
template <class Scalar, class Weight>
void absorbed_output(const MlaConfig& c, const MlaWeights<Weight>& w,
                     const RowMatrix<Scalar>& o_latent, const MlaAbsorbedWeights<Weight>& absorbed,
                     RowRef<Scalar> out) {
  if (absorbed.output_multiplied()) {
    matmul<Scalar>(o_latent, absorbed.w_o_latent, out);
    return;
  }
  const Index group = c.num_q_heads / c.num_kv_heads;
  const Index d_h = c.head_dim;
  const Index d_kv = c.d_kv;
  // o_h W_UV,g for the G heads of group g of token t: [G, d_kv] · W_UV,g -> [G, d_h].
  RowMatrix<Scalar> concat(o_latent.rows(), c.num_q_heads * d_h);
  for (Index t = 0; t < o_latent.rows(); ++t) {
    for (Index g = 0; g < c.num_kv_heads; ++g) {
      const Eigen::Map<const RowMatrix<Scalar>> o_group(o_latent.row(t).data() + g * group * d_kv,
                                                        group, d_kv);
      Eigen::Map<RowMatrix<Scalar>> target(concat.row(t).data() + g * group * d_h, group, d_h);
      matmul<Scalar>(o_group, w.w_uv.middleCols(g * d_h, d_h), target);
    }
  }
  matmul<Scalar>(concat, w.w_o, out);
}

/// o_latent [B*n, H_q·d_kv] (token-major) of an attention whose values are `value_dim` wide,
/// which attend(out) writes to the token-major view `out` [B, H_q, n, value_dim]: directly where
/// value_dim = d_kv, else (a whole-row format, whose values are the whole rows: no view of c_kv
/// alone) into a [B*n, H_q·value_dim] buffer first, of which each head's first d_kv columns are
/// kept. A whole-row format costs H_kr·d_r / d_kv more multiply-adds in the update.
template <class Scalar, class Attend>
RowMatrix<Scalar> latent_outputs(const HeadsShape& q, Index d_kv, Index value_dim,
                                 const Attend& attend) {
  const Index rows = q.batch * q.seq;
  RowMatrix<Scalar> o_latent(rows, q.heads * d_kv);
  if (value_dim == d_kv) {
    attend(HeadsView<Scalar>::token_major(o_latent.data(), {q.batch, q.heads, q.seq, d_kv}));
    return o_latent;
  }
  RowMatrix<Scalar> o_rows(rows, q.heads * value_dim);
  attend(HeadsView<Scalar>::token_major(o_rows.data(), {q.batch, q.heads, q.seq, value_dim}));
  for (Index h = 0; h < q.heads; ++h) {
    o_latent.middleCols(h * d_kv, d_kv) = o_rows.middleCols(h * value_dim, d_kv);
  }
  return o_latent;
}

/// The attention of absorbed queries q [B, H_q, n, d_kv + H_kr·d_r] over every row a latent
/// cache holds, one key/value head shared by all H_q heads: keys [c_kv ‖ K_rope] (rows()),
/// values c_kv -> o_latent [B*n, H_q·d_kv] (token-major). A whole-row format
/// (is_latent_row_format_v: FlashMlaFp8Row) attends with the whole rows as values
/// (latent_outputs), and allocates the [B*n, H_q·(d_kv + H_kr·d_r)] output first.
template <class Scalar, class Storage>
RowMatrix<Scalar> attend_latent_rows(const HeadsView<const Scalar>& q,
                                     const LatentCache<Scalar, Storage>& cache,
                                     const AttentionMask<Scalar>& mask, const SdpaParams& params) {
  constexpr bool kWhole = is_latent_row_format_v<Storage>;
  return latent_outputs<Scalar>(q.shape(), cache.latent_dim(),
                                kWhole ? cache.row_width() : cache.latent_dim(),
                                [&](const HeadsView<Scalar>& out) {
                                  if constexpr (kWhole) {
                                    sdpa(q, cache.rows(), cache.rows(), mask, params, out);
                                  } else {
                                    sdpa(q, cache.rows(), cache.latent(), mask, params, out);
                                  }
                                });
}

}  // namespace detail

}  // namespace apex
