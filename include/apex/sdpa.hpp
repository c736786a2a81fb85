// SPDX-License-Identifier: MIT
// Scaled dot-product attention (§6), for one head or for [B, H, S, D] heads with grouped
// key/value heads (§8). Its parameters, mask and checks are in sdpa_params.hpp, its plain
// reference (apex::reference::sdpa) in reference_attention.hpp, the merge of partial results over
// disjoint keys (merge_attention, merge_attention_stats) in merge_attention.hpp; this header
// includes all three.
//
// NON-FINITE INPUT AND OVERFLOW: the policy of every attention path of apex (sdpa, its reference,
// split-key decoding, the caches' attention, merge_attention):
//   - a key takes part in a row when the mask allows it and its score is not -inf; a forbidden
//     key, or one whose score is -inf (an infinite key, a -inf bias), never reaches the output,
//     whatever its key, value or bias hold (NaN included);
//   - a NaN score among a row's keys (NaN in q_i, in an allowed k_j or in bias_ij), or a +inf
//     one, makes that row's out and lse NaN;
//   - a NaN or ±inf value v_j reaches exactly the rows in which key j takes part, even where its
//     weight underflows to 0: those rows' outputs are not finite in its columns;
//   - a row in which no key takes part is zeros, with lse = -inf (lse = the sink with one);
//   - finite inputs whose scores (or outputs) overflow float are computed again in double: a
//     float call returns the double reference's finite answer, rounded to float. The lse is
//     rounded to the output type, so it may be ±inf there;
//   - other rows, heads and batches are unaffected.
//
// ALLOCATION: which calls of sdpa (and of everything built on its kernel) allocate scratch, when,
// and how much per buffer and thread, is stated once, in detail/scratch.hpp (ALLOCATION).
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/mask.hpp>
#include <apex/merge_attention.hpp>
#include <apex/reference_attention.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <initializer_list>
#include <type_traits>

namespace apex {

namespace detail {

/// The parameters of the scores that the kernel takes from SdpaParams: the scale (resolved),
/// the soft-cap, and pointers to the sinks and ALiBi slopes (null when empty), which must
/// outlive the problem.
template <class P>
void set_score_params(P& p, const SdpaParams& params, Index d_qk) {
  p.scale = softmax_scale(params, d_qk);
  p.softcap = params.softcap;
  p.sinks = params.sinks.empty() ? nullptr : params.sinks.data();
  p.alibi_slopes = params.alibi_slopes.empty() ? nullptr : params.alibi_slopes.data();
  p.bf16_products = params.allow_bf16_products;
}

/// The kernel's problem for queries q (first at absolute position first_query) against
/// num_segments >= 1 key segments of one [B, H_kv] shape, s_k keys in all, under a rule and
/// parameters that have passed sdpa's checks (the params and segments must outlive the
/// problem). No dense mask, no bias and no user rules: the caller adds those it has.
// Internal, three callers. NOLINTBEGIN(bugprone-easily-swappable-parameters)
template <class TQ, class TK, class TV, class TB = TQ, class Rules = NoRules>
AttentionProblem<TQ, TK, TV, TB, Rules> attention_problem(
    const HeadsView<const TQ>& q, const KeySegment<TK, TV>* segments, Index num_segments, Index s_k,
    const PositionMask& positions, Index first_query, const SdpaParams& params) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  AttentionProblem<TQ, TK, TV, TB, Rules> p;
  p.q = q;
  p.segments = segments;
  p.num_segments = num_segments;
  p.positions = positions;
  p.first_query = first_query;
  set_score_params(p, params, q.dim());
  p.group = q.heads() / segments[0].k.heads();
  p.s_q = q.seq();
  p.s_k = s_k;
  p.d_qk = q.dim();
  p.d_v = row_values(segments[0].v);
  return p;
}

/// Copies a [B, H, S, D] view into another of the same shape.
template <class T>
void copy_heads(const HeadsView<const T>& from, const HeadsView<T>& to) {
  if (to.empty()) return;
  for (Index b = 0; b < to.batch(); ++b) {
    for (Index h = 0; h < to.heads(); ++h) to.head(b, h) = from.head(b, h);
  }
}

/// Throws unless apex may write all of sdpa's outputs: each has distinct elements, and no two
/// of them share memory.
template <class Scalar>
void check_outputs(std::initializer_list<HeadsView<Scalar>> outputs, const char* op) {
  for (const auto& o : outputs) check_output_view(o, op, "output");
  for (auto a = outputs.begin(); a != outputs.end(); ++a) {
    for (auto b = a + 1; b != outputs.end(); ++b) {
      APEX_CHECK(!byte_range(*a).overlaps(byte_range(*b)),
                 "[" << op << "] two outputs (out, lse, max, sum) share memory");
    }
  }
}

/// The whole of apex::sdpa: checks, the scale, and the tiled kernel, with block sizes that tests
/// and fuzz targets may choose. Each input has its storage type (TQ, TK, TV, and TB for the
/// bias); the outputs are TO. Outputs whose memory overlaps an input are computed into a
/// temporary first (allocated: [B, H_q, S_q, d_v] and the per-row outputs), then copied.
template <class TQ, class TK, class TV, class TB, class TO, class Rules = NoRules>
void flash_sdpa(const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                const HeadsView<const TV>& v, const AttentionMask<TB>& mask,
                const SdpaParams& params, const HeadsView<TO>& out, const HeadsView<TO>& lse,
                const SoftmaxStatsView<TO>& stats, const FlashBlocking& blocking = {},
                const Rules& rules = {}) {
  require_storage_type<TQ>();
  require_kv_format<TK>();
  require_kv_format<TV>();
  require_storage_type<TB>();
  require_storage_type<TO>();
  const char* op = "sdpa";
  check_sdpa(q, k, v, mask, params, out, lse, op, stats);
  check_outputs<TO>({out, lse, stats.max, stats.sum}, op);
  bool overlap = false;
  for (const ByteRange in : {byte_range(q), byte_range(k), byte_range(v), byte_range(mask.allowed),
                             byte_range(mask.bias)}) {
    for (const auto& o : {out, lse, stats.max, stats.sum})
      overlap = overlap || in.overlaps(byte_range(o));
  }
  if (overlap) {
    const auto temporary = [](const HeadsView<TO>& o) {
      return o.empty() ? HeadsTensor<TO>() : HeadsTensor<TO>(o.shape());
    };
    HeadsTensor<TO> t_out = temporary(out), t_lse = temporary(lse), t_max = temporary(stats.max),
                    t_sum = temporary(stats.sum);
    const auto view_of = [](HeadsTensor<TO>& t, const HeadsView<TO>& o) {
      return o.empty() ? HeadsView<TO>() : t.view();
    };
    flash_sdpa<TQ, TK, TV, TB, TO>(q, k, v, mask, params, view_of(t_out, out), view_of(t_lse, lse),
                                   {view_of(t_max, stats.max), view_of(t_sum, stats.sum)}, blocking,
                                   rules);
    copy_heads<TO>(t_out.view(), out);
    copy_heads<TO>(t_lse.view(), lse);
    copy_heads<TO>(t_max.view(), stats.max);
    copy_heads<TO>(t_sum.view(), stats.sum);
    return;
  }
  const KeySegment<TK, TV> keys{k, v, mask.positions.key_offset};
  auto p = attention_problem<TQ, TK, TV, TB, Rules>(
      q, &keys, 1, k.seq(), mask.positions, mask.positions.first_query_position(q.seq(), k.seq()),
      params);
  p.rules = &rules;
  p.allowed = mask.allowed;
  p.bias = mask.bias;
  flash_attention(p, AttentionOutputs<TO>{out, lse, stats.max, stats.sum}, blocking);
}

/// flash_sdpa with every input, the bias and the outputs of one type.
template <class Scalar>
void flash_sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
                const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
                const SdpaParams& params, const HeadsView<Scalar>& out,
                const HeadsView<Scalar>& lse, const SoftmaxStatsView<Scalar>& stats,
                const FlashBlocking& blocking = {}) {
  flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(q, k, v, mask, params, out, lse, stats,
                                                     blocking);
}

}  // namespace detail

/// Scaled dot-product attention over [B, H, S, D] heads, grouped-query aware (§6.2, §8.2):
/// query head h of batch b attends with key/value head h / (H_q / H_kv), so H_kv = H_q is
/// multi-head attention, 1 < H_kv < H_q grouped-query attention and H_kv = 1 multi-query
/// attention. For each query row i,
///   out[i] = Σ_j softmax_j(softcap(scale · q_i·k_j) + bias_ij, forbidden → -inf) v_j
/// with scale = 1/√d_qk unless SdpaParams says otherwise, and ALiBi and attention sinks where
/// SdpaParams sets them. Causality, windows, chunks and documents are measured in absolute
/// positions (see PositionMask for the alignment of S_q queries against S_k keys).
/// Non-finite input and overflow follow the policy at the top of this header.
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1], the natural-log
///      log-sum-exp of each row's scores; stats (optional): each row's max and sum (for exact
///      merges, merge_attention_stats).
/// Any layout HeadsView can describe works (contiguous per head, or heads side by side as a
/// projection writes them). The outputs must each address distinct memory per element and must
/// not share memory with one another; they may overlap q, k or v (even be the same memory):
/// sdpa then computes into a temporary and copies (an allocation of the outputs' size).
/// Runs the tiled kernel of detail/flash_attention.hpp: keys streamed in blocks with an online
/// softmax, blocks the PositionMask forbids skipped, split-key (flash-decoding) for a few
/// queries against many keys. Extra memory, in per-thread buffers that grow on first use and
/// are then reused (repeated calls allocate nothing; release_scratch() frees them), whatever
/// S_k: per thread running a task about 0.7 MiB for float, d = 128 (the MEMORY section of that
/// header gives the formula); split-key decoding, on the calling thread, at most 2^19 scalars of
/// partial results. Scalars are float, or double for a float call that falls back to double
/// (see the policy). Threads: detail::parallel_for (OpenMP when
/// enabled); the result is bit-identical for any number of threads.
///
/// STORAGE TYPES. Q, K, V, the bias and the outputs may each be float, double, Eigen::half or
/// Eigen::bfloat16 (storage.hpp), independently, and the input views read-only or not: for example
/// float Q with half K/V from a 16-bit cache, and float or half output. The kernel widens each
/// element as it reads it (K and V a block at a time, never a whole tensor) and computes in float,
/// or in double when an input is double (or on the fallback of the policy); each result is rounded
/// once to the output type.
template <class Q, class K, class V, class TB, class TO>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  detail::flash_sdpa<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>, TB,
                     TO>(q, k, v, mask, params, out, lse, stats);
}

/// sdpa with the user's rules (attention_rules.hpp) beside the mask and the parameters: a mask
/// rule (with its block classifier, so that blocks it forbids are skipped unread) and a score
/// rule, compiled into the kernel. A pair attends only if the PositionMask, the dense mask and the
/// mask rule all allow it; the score rule applies to every score after the soft-cap and ALiBi,
/// before the bias. Everything else (shapes, storage types, the non-finite policy, memory,
/// threads and determinism) is as for sdpa without rules, given rules that are pure functions.
template <class Q, class K, class V, class TB, class TO, class A, class C, class S>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params,
          const AttentionRules<A, C, S>& rules, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  detail::flash_sdpa<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>, TB,
                     TO>(q, k, v, mask, params, out, lse, stats, {}, rules);
}

/// sdpa with every input, the bias and the outputs of one type (float or double).
template <class Scalar>
void sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
          const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
          const SdpaParams& params, const HeadsView<Scalar>& out, const HeadsView<Scalar>& lse = {},
          const SoftmaxStatsView<Scalar>& stats = {}) {
  detail::flash_sdpa<Scalar>(q, k, v, mask, params, out, lse, stats);
}

/// Single-head form: q [S_q, d_qk], k [S_k, d_qk], v [S_k, d_v] -> out [S_q, d_v] (§6.2).
/// Inputs that are not row-major are copied once.
template <class DQ, class DK, class DV>
void sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
          const Eigen::MatrixBase<DV>& v, const AttentionMask<typename DQ::Scalar>& mask,
          const SdpaParams& params, RowRef<typename DQ::Scalar> out) {
  using Scalar = typename DQ::Scalar;
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { sdpa<Scalar>(args...); }, q, k, v, mask,
                                   params, out, nullptr);
}

/// Single-head form that also returns each row's log-sum-exp: lse [S_q].
template <class DQ, class DK, class DV>
void sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
          const Eigen::MatrixBase<DV>& v, const AttentionMask<typename DQ::Scalar>& mask,
          const SdpaParams& params, RowRef<typename DQ::Scalar> out,
          VectorRef<typename DQ::Scalar> lse) {
  using Scalar = typename DQ::Scalar;
  APEX_CHECK(lse.size() == q.rows(),
             "[sdpa] lse length (" << lse.size() << ") must equal S_q " << q.rows());
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { sdpa<Scalar>(args...); }, q, k, v, mask,
                                   params, out, lse.data());
}

/// Value-returning single-head form. Allocates the [S_q, d_v] result.
template <class DQ, class DK, class DV>
RowMatrix<typename DQ::Scalar> sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v,
                                    const AttentionMask<typename DQ::Scalar>& mask = {},
                                    const SdpaParams& params = {}) {
  RowMatrix<typename DQ::Scalar> result(q.rows(), v.cols());
  sdpa(q, k, v, mask, params, RowRef<typename DQ::Scalar>(result));
  return result;
}

}  // namespace apex
