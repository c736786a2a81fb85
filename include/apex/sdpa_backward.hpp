// SPDX-License-Identifier: MIT
// The backward pass of scaled dot-product attention (§6.2, grouped heads §8.2, masks §10–§11):
// the gradients of a loss by Q, K and V (and by the bias and the sinks where asked), given the
// forward's output O, its log-sum-exp and the loss's gradient dO by O. It recomputes the scores
// block by block from the log-sum-exp (FlashAttention-2's backward), with every score term of
// apex::sdpa, and never holds an S_q × S_k matrix. The kernel and its formulas are in
// detail/attention_backward.hpp; its plain reference is tests/reference/attention_backward.hpp.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/attention_backward.hpp>
#include <apex/sdpa.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <initializer_list>
#include <type_traits>
#include <vector>

namespace apex {

/// What sdpa_backward writes, all of storage type TG:
///   dq [B, H_q, S_q, d_qk], dk [B, H_kv, S_k, d_qk], dv [B, H_kv, S_k, d_v]   (required)
///   d_bias   the gradient by the dense bias, in the bias's shape [B', H', S_q, S_k] (a broadcast
///            axis of the bias sums over it), or with no bias any such shape (the gradient by a
///            zero bias of that shape); empty: not computed. An S_q × S_k output by nature.
///   d_sinks  the gradient by SdpaParams::sinks, resized to H_q; null: not computed.
template <class TG>
struct SdpaGradients {
  HeadsView<TG> dq{};                      ///< ∂L/∂q, q's shape
  HeadsView<TG> dk{};                      ///< ∂L/∂k, k's shape
  HeadsView<TG> dv{};                      ///< ∂L/∂v, v's shape
  HeadsView<TG> d_bias{};                  ///< ∂L/∂bias, or empty
  std::vector<double>* d_sinks = nullptr;  ///< ∂L/∂sinks, or null
};

namespace detail {

/// Throws unless the backward's inputs and outputs fit the forward's shapes (check_sdpa) and
/// may be written: each gradient has distinct elements and shares memory with no input and no
/// other gradient.
template <class Q, class K, class V, class O, class L, class D, class TB, class TG>
// q, k, v and the results, as sdpa_backward takes them.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
void check_sdpa_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                         const AttentionMask<TB>& mask, const SdpaParams& params,
                         const HeadsView<O>& out, const HeadsView<L>& lse,
                         const HeadsView<D>& d_out, const SdpaGradients<TG>& grads) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const char* op = "sdpa_backward";
  check_sdpa(q, k, v, mask, params, out, HeadsView<O>(), op);
  APEX_CHECK(!lse.empty(), "[" << op << "] lse is empty; the forward's log-sum-exp is required");
  check_row_output(lse, q.shape(), op, "log-sum-exp");
  APEX_CHECK(d_out.shape() == out.shape(),
             "[" << op << "] d_out shape [" << d_out.batch() << ", " << d_out.heads() << ", "
                 << d_out.seq() << ", " << d_out.dim() << "] must be the output's [" << out.batch()
                 << ", " << out.heads() << ", " << out.seq() << ", " << out.dim() << "]");
  const auto same_shape = [&](const HeadsView<TG>& g, const HeadsShape& like, const char* name) {
    APEX_CHECK(g.shape() == like, "[" << op << "] " << name << " shape [" << g.batch() << ", "
                                      << g.heads() << ", " << g.seq() << ", " << g.dim()
                                      << "] must be [" << like.batch << ", " << like.heads << ", "
                                      << like.seq << ", " << like.dim << "]");
  };
  same_shape(grads.dq, q.shape(), "dq");
  same_shape(grads.dk, k.shape(), "dk");
  same_shape(grads.dv, v.shape(), "dv");
  if (!grads.d_bias.empty()) {
    if (mask.bias.empty()) {
      check_mask_view_shape(grads.d_bias.shape(), q.shape(), k.seq(), op, "d_bias");
    } else {
      same_shape(grads.d_bias, mask.bias.shape(), "d_bias (the bias's shape)");
    }
  }
  APEX_CHECK(grads.d_sinks == nullptr || !params.sinks.empty(),
             "[" << op << "] d_sinks is asked for, but SdpaParams::sinks is empty");
  for (const auto& g : {grads.dq, grads.dk, grads.dv, grads.d_bias}) {
    check_output_view(g, op, "gradient");
  }
  const ByteRange written[] = {byte_range(grads.dq), byte_range(grads.dk), byte_range(grads.dv),
                               byte_range(grads.d_bias)};
  const ByteRange read[] = {byte_range(q),
                            byte_range(k),
                            byte_range(v),
                            byte_range(out),
                            byte_range(lse),
                            byte_range(d_out),
                            byte_range(mask.allowed),
                            byte_range(mask.bias)};
  for (std::size_t a = 0; a < std::size(written); ++a) {
    for (const ByteRange& r : read) {
      APEX_CHECK(!written[a].overlaps(r),
                 "[" << op << "] a gradient (dq, dk, dv, d_bias) shares memory with an input");
    }
    for (std::size_t b = a + 1; b < std::size(written); ++b) {
      APEX_CHECK(!written[a].overlaps(written[b]),
                 "[" << op << "] two gradients (dq, dk, dv, d_bias) share memory");
    }
  }
}

/// The whole of apex::sdpa_backward, with block sizes that tests may choose.
template <class TQ, class TK, class TV, class TO, class TL, class TD, class TB, class TG,
          class Rules = NoRules>
void sdpa_backward(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                   const HeadsView<const TV>& v, const AttentionMask<TB>& mask,
                   const SdpaParams& params, const HeadsView<const TO>& out,
                   const HeadsView<const TL>& lse, const HeadsView<const TD>& d_out,
                   const SdpaGradients<TG>& grads, const BackwardBlocking& blocking = {},
                   const Rules& rules = {}) {
  require_storage_type<TQ>();
  require_storage_type<TO>();
  require_storage_type<TL>();
  require_storage_type<TD>();
  require_storage_type<TB>();
  require_storage_type<TG>();
  static_assert(is_storage_v<TK> && is_storage_v<TV>,
                "sdpa_backward: K and V must be float, double, half or bfloat16 (a block-quantized "
                "cache format has no gradient)");
  static_assert(kDifferentiableScore<typename Rules::ScoreRule>,
                "sdpa_backward: a score rule needs its derivative; build it with "
                "apex::with_derivative(score, derivative) (attention_rules.hpp)");
  check_sdpa_backward(q, k, v, mask, params, out, lse, d_out, grads);
  const KeySegment<TK, TV> keys{k, v, mask.positions.key_offset};
  BackwardProblem<AttentionProblem<TQ, TK, TV, TB, Rules>, TO, TL, TD> bp{
      attention_problem<TQ, TK, TV, TB, Rules>(
          q, &keys, 1, k.seq(), mask.positions,
          mask.positions.first_query_position(q.seq(), k.seq()), params),
      out, lse, d_out};
  bp.forward.rules = &rules;
  bp.forward.allowed = mask.allowed;
  bp.forward.bias = mask.bias;
  if (grads.d_sinks != nullptr) grads.d_sinks->assign(static_cast<std::size_t>(q.heads()), 0.0);
  BackwardOutputs<TG> o{grads.dq, grads.dk, grads.dv, grads.d_bias,
                        grads.d_sinks == nullptr ? nullptr : grads.d_sinks->data()};
  attention_backward(bp, o, blocking);
}

}  // namespace detail

/// The gradients of a loss L by the inputs of apex::sdpa, given the forward's output O, its
/// log-sum-exp and dO = ∂L/∂O (FlashAttention-2's backward pass, with every score term of sdpa:
/// the scale, the soft-cap, ALiBi, sinks, the position rule, the dense mask and bias). For each
/// query row i of head h, with p_ij the forward's weights, the logits s_ij and the raw scores
/// x_ij = scale·q_i·k_j:
///   dv_j = Σ_i p_ij do_i                       ds_ij = p_ij (do_i·v_j − do_i·o_i)
///   dq_i = scale · Σ_j ds_ij s'_ij k_j           dk_j = scale · Σ_i ds_ij s'_ij q_i
///   d bias_ij = ds_ij                           d sink_h = −Σ_(b, i) e^(sink_h − lse_i) do_i·o_i
/// where s'_ij = ∂s_ij/∂x_ij is 1 − tanh²(x_ij / c) with a soft-cap c and 1 without; dk and dv
/// sum over the G query heads of a key/value head (§8.2).
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v], mask and params as
///   given to sdpa; out and d_out: [B, H_q, S_q, d_v]; lse: [B, H_q, S_q, 1], the forward's
///   (with its sink, as sdpa writes it) -> grads (SdpaGradients).
/// The forward must have been sdpa(q, k, v, mask, params) itself: apex checks every shape, but
/// an out or lse from another call (or rounded to a 16-bit type: keep the lse in float) is not
/// detectable and gives the gradients of no loss in particular. A row with lse = -inf (no key
/// took part) has zero gradients and gives none.
/// Non-finite input: a key that takes no part in a row (forbidden, or a -inf score) gets and
/// gives no gradient through its weight there, whatever its key and value hold; a NaN or ±inf in
/// q, k, v, out, d_out or the lse makes the gradients that meet it through a product NaN or
/// infinite, which may include the other rows and keys of the blocks it is in. Finite inputs
/// whose scores overflow float are computed in double, as sdpa computes them.
/// Storage types: every input, and the gradients, may be float, double, half or bfloat16 (K and V
/// not block-quantized); computed in float, or in double when one is double, each gradient rounded
/// once. Threads: detail::parallel_for; the result is bit-identical for any number of threads.
/// Allocates: per thread about 1.2 MiB of float scratch at d = 128 (the MEMORY section of
/// detail/attention_backward.hpp: the bound whatever S), kept for later calls; d_sinks resized.
/// Gradients must not share memory with an input or with one another. Throws
/// std::invalid_argument, before writing anything, on any shape that does not match.
template <class Q, class K, class V, class O, class L, class D, class TB, class TG>
void sdpa_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                   const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<O>& out,
                   const HeadsView<L>& lse, const HeadsView<D>& d_out,
                   const SdpaGradients<TG>& grads) {
  detail::sdpa_backward<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                        std::remove_const_t<O>, std::remove_const_t<L>, std::remove_const_t<D>, TB,
                        TG>(q, k, v, mask, params, out, lse, d_out, grads);
}

/// sdpa_backward with the user's rules, as sdpa takes them: a mask rule (its classifier's kNone
/// blocks are skipped unread here too) and a score rule, which must carry its derivative
/// (with_derivative, attention_rules.hpp).
template <class Q, class K, class V, class O, class L, class D, class TB, class TG, class A,
          class C, class S>
void sdpa_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                   const AttentionMask<TB>& mask, const SdpaParams& params,
                   const AttentionRules<A, C, S>& rules, const HeadsView<O>& out,
                   const HeadsView<L>& lse, const HeadsView<D>& d_out,
                   const SdpaGradients<TG>& grads) {
  detail::sdpa_backward<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                        std::remove_const_t<O>, std::remove_const_t<L>, std::remove_const_t<D>, TB,
                        TG>(q, k, v, mask, params, out, lse, d_out, grads, {}, rules);
}

/// The backward pass of sdpa_varlen (a ragged batch, varlen.hpp): each sequence's gradients as
/// sdpa_backward gives them for that sequence alone, under its rule masks[i] (or masks[0] for
/// all), written to its rows of dq [1, H_q, total_q, d_qk], dk [1, H_kv, total_k, d_qk] and
/// dv [1, H_kv, total_k, d_v]; d_sinks (where asked) sums the sequences in order. out and lse
/// are sdpa_varlen's results for the same call; d_out: [1, H_q, total_q, d_v]. Keys of a
/// sequence without queries get zeros. Every check (the offsets, and each sequence's as
/// sdpa_backward makes them) runs before anything is written. The sequences run one after
/// another, each on every thread (so many short sequences use the threads less well than one
/// long one); bit-identical for any number of threads and to one sdpa_backward per sequence.
/// Dense masks and user rules are not taken here (use sdpa_backward per sequence).
template <class Q, class K, class V, class O, class L, class D, class TG>
void sdpa_varlen_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                          const RaggedBatch& batch, const std::vector<PositionMask>& masks,
                          const SdpaParams& params, const HeadsView<O>& out,
                          const HeadsView<L>& lse, const HeadsView<D>& d_out,
                          const SdpaGradients<TG>& grads) {
  const char* op = "sdpa_varlen_backward";
  APEX_CHECK(q.batch() == 1, "[" << op << "] q batch (" << q.batch()
                                 << ") must be 1: the sequences are packed along the rows");
  APEX_CHECK(!batch.cu_seqlens_q.empty(),
             "[" << op << "] cu_seqlens_q must have N + 1 >= 1 entries");
  const Index n = batch.sequences();
  detail::check_offsets(batch.cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  detail::check_offsets(batch.cu_seqlens_k, n, k.seq(), op, "cu_seqlens_k");
  detail::check_mask_count(masks, n, op);
  APEX_CHECK(grads.d_bias.empty(), "[" << op << "] d_bias is not taken: there is no dense bias");
  for (const detail::ByteRange written :
       {detail::byte_range(grads.dq), detail::byte_range(grads.dk), detail::byte_range(grads.dv)}) {
    for (const detail::ByteRange read :
         {detail::byte_range(q), detail::byte_range(k), detail::byte_range(v),
          detail::byte_range(out), detail::byte_range(lse), detail::byte_range(d_out)}) {
      APEX_CHECK(!written.overlaps(read),
                 "[" << op << "] a gradient (dq, dk, dv) shares memory with an input");
    }
  }
  // The views of sequence i: its rows of every input and gradient.
  const auto sequence = [&](Index i, const auto& view, bool keys) {
    const auto& cu = keys ? batch.cu_seqlens_k : batch.cu_seqlens_q;
    const auto at = static_cast<std::size_t>(i);
    return view.middle_rows(cu[at], cu[at + 1] - cu[at]);
  };
  const auto call = [&](Index i, bool run) {
    AttentionMask<std::remove_const_t<Q>> mask;
    mask.positions = masks[masks.size() == 1 ? 0 : static_cast<std::size_t>(i)];
    std::vector<double> d_sinks;
    const SdpaGradients<TG> g{sequence(i, grads.dq, false),
                              sequence(i, grads.dk, true),
                              sequence(i, grads.dv, true),
                              {},
                              grads.d_sinks == nullptr ? nullptr : &d_sinks};
    if (!run) {
      detail::check_sdpa_backward(sequence(i, q, false), sequence(i, k, true), sequence(i, v, true),
                                  mask, params, sequence(i, out, false), sequence(i, lse, false),
                                  sequence(i, d_out, false), g);
      return;
    }
    sdpa_backward(sequence(i, q, false), sequence(i, k, true), sequence(i, v, true), mask, params,
                  sequence(i, out, false), sequence(i, lse, false), sequence(i, d_out, false), g);
    for (std::size_t h = 0; h < d_sinks.size(); ++h) (*grads.d_sinks)[h] += d_sinks[h];
  };
  for (Index i = 0; i < n; ++i) call(i, false);
  if (grads.d_sinks != nullptr) grads.d_sinks->assign(static_cast<std::size_t>(q.heads()), 0.0);
  for (Index i = 0; i < n; ++i) call(i, true);
}

}  // namespace apex
