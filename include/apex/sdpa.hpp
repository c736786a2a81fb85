// SPDX-License-Identifier: MIT
// Scaled dot-product attention (§6), for one head or for [B, H, S, D] heads with grouped
// key/value heads (§8); the merge of partial results over disjoint keys; the plain reference.
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
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

namespace apex {

/// Parameters of softmax(softcap(scale · Q Kᵀ) + ALiBi + mask, sink) V.
///
/// The score of query row i (absolute position qp) of query head h against key j (position kp):
///   s_ij = softcap(scale · q_i·k_j) + slope_h·(kp − qp) + bias_ij    (forbidden → -inf)
/// and the output, with the head's sink (when set) as one more logit whose value is zero:
///   out_i = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij)).
/// A parameter that float cannot represent makes a float call compute in double.
struct SdpaParams {
  /// Multiplies Q Kᵀ. Unset: 1/√d_qk (§6.2), where d_qk is the width of Q and K. Any finite
  /// value.
  std::optional<double> scale;
  /// c > 0 maps each scaled score x to c·tanh(x/c) (Gemma 2's logit soft-capping) before ALiBi,
  /// the mask and the bias are applied, so a forbidden key stays forbidden. 0 turns it off.
  double softcap = 0.0;
  /// Attention sinks (as gpt-oss uses them): one finite logit per query head, [H_q], that joins
  /// every row's softmax denominator and contributes no value. Empty: none. The lse, max and
  /// sum outputs then describe the row with its sink (lse = log(e^sink + Σ_j e^(s_j))), and a
  /// row in which no key takes part is zeros with lse = sink. Merging such results would count
  /// the sink twice: merge results computed without it and give it to the merge
  /// (merge_attention_stats with a sink).
  std::vector<double> sinks;
  /// ALiBi (Press et al. 2022): one finite slope per query head, [H_q]; the score of a key kp
  /// for a query qp gains −slope·(qp − kp), computed in the kernel from the positions (never
  /// stored as a matrix). alibi_slopes(H) gives the standard geometric slopes. Empty: none.
  /// Without a causal rule the keys after a query get a positive term.
  std::vector<double> alibi_slopes;
  /// Permits the tiled kernel to form both products with bfloat16 factors, summed in float, as
  /// PyTorch's and oneDNN's bf16 attention does, where the CPU has AVX512-BF16's dot products
  /// (KernelIsa::kAvx512Bf16, cpu.hpp) or AMX's tiles (KernelIsa::kAmx): in each tile of more
  /// than 8 stacked query rows (G·Bq, the G query heads of a key/value head: prefill, not
  /// decoding, whose products stream), in float, Qs = scale·Q, K, the weights P and V are rounded
  /// to bfloat16 to nearest even before their products. K and V stored as bfloat16 round to
  /// themselves; the sums, the softmax and the outputs stay float. Each weight then
  /// carries a relative error up to 2^-8 and each score up to 2^-8·scale·Σ_c |q_c·k_c| (from Qs),
  /// and values below 2^-126 in magnitude count as zero. Where the CPU lacks the instructions,
  /// under another kernel level, or where the call computes in double, the products are exact as
  /// without it. Off by default.
  bool allow_bf16_products = false;
};

/// The standard ALiBi slopes of H heads (Press et al. 2022): for H a power of two, the
/// geometric sequence slope_h = 2^(−8(h + 1)/H), h = 0 .. H − 1; otherwise the slopes of the
/// largest power of two n < H, followed by every other slope of 2n's sequence (the 1st, 3rd,
/// ...) until there are H. Throws if H < 1. Allocates the result.
inline std::vector<double> alibi_slopes(Index heads) {
  APEX_CHECK(heads >= 1, "[alibi_slopes] heads (" << heads << ") must be >= 1");
  const auto geometric = [](Index n) {
    std::vector<double> slopes(static_cast<std::size_t>(n));
    for (Index h = 0; h < n; ++h) {
      slopes[static_cast<std::size_t>(h)] =
          std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n));
    }
    return slopes;
  };
  Index n = 1;
  while (n * 2 <= heads) n *= 2;
  std::vector<double> slopes = geometric(n);
  const std::vector<double> finer = geometric(2 * n);
  for (Index h = 0; static_cast<Index>(slopes.size()) < heads; h += 2) {
    slopes.push_back(finer[static_cast<std::size_t>(h)]);
  }
  return slopes;
}

/// Everything that can forbid or bias a score. The parts combine: a pair is attended only if the
/// position rule allows it and the dense mask (if any) is true; the bias (if any) is then added.
///
/// Dense masks are [B', H', S_q, S_k] views where B' is 1 (shared by the batch) or B, and H' is 1
/// (shared by the heads) or H_q. For a single [S_q, S_k] matrix use as_heads_view(matrix).
template <class Scalar>
struct AttentionMask {
  /// The position rule (causal, window, prefix, offsets); the default allows every pair.
  PositionMask positions;
  HeadsView<const bool> allowed;  ///< true = may attend; empty = no dense mask
  HeadsView<const Scalar> bias;   ///< added to the scores; -inf forbids; empty = no bias
};

/// The softmax statistics of every row of an attention result, optional outputs of sdpa beside
/// the lse, [B, H_q, S_q, 1] each (an empty view is not written):
///   max  m, the largest score among the row's keys (-inf when no key takes part, NaN for a NaN
///        row);
///   sum  l = Σ_j exp(s_j − m), in [1, S_k] (0 when no key takes part).
/// lse = m + log l. Unlike the lse they lose nothing when the scores are large, so partial
/// results merged through them (merge_attention_stats) are exact at any logit magnitude.
template <class Scalar>
struct SoftmaxStatsView {
  HeadsView<Scalar> max;  ///< m per row, or empty
  HeadsView<Scalar> sum;  ///< l per row, or empty
};

namespace detail {

inline void check_mask_view_shape(const HeadsShape& mask, const HeadsShape& q, Index s_k,
                                  const char* op, const char* name) {
  APEX_CHECK(mask.batch == 1 || mask.batch == q.batch,
             "[" << op << "] " << name << " batch (" << mask.batch
                 << ") must be 1 or the batch size " << q.batch);
  APEX_CHECK(mask.heads == 1 || mask.heads == q.heads,
             "[" << op << "] " << name << " heads (" << mask.heads
                 << ") must be 1 or the number of query heads " << q.heads);
  APEX_CHECK(mask.seq == q.seq && mask.dim == s_k,
             "[" << op << "] " << name << " shape [" << mask.seq << ", " << mask.dim
                 << "] must be [S_q, S_k] = [" << q.seq << ", " << s_k << "]");
}

/// Throws unless `view` is empty or has the shape [B, H_q, S_q, 1] of a per-row output.
template <class T>
void check_row_output(const HeadsView<T>& view, const HeadsShape& q, const char* op,
                      const char* name) {
  APEX_CHECK(view.empty() || view.shape() == (HeadsShape{q.batch, q.heads, q.seq, 1}),
             "[" << op << "] " << name << " shape [" << view.batch() << ", " << view.heads() << ", "
                 << view.seq() << ", " << view.dim() << "] must be [B, H_q, S_q, 1] = [" << q.batch
                 << ", " << q.heads << ", " << q.seq << ", 1]");
}

/// Throws unless `values` (SdpaParams::sinks or alibi_slopes) is empty or holds H_q finite
/// values.
inline void check_head_values(const std::vector<double>& values, Index q_heads, const char* op,
                              const char* name) {
  if (values.empty()) return;
  APEX_CHECK(static_cast<Index>(values.size()) == q_heads,
             "[" << op << "] " << name << " length (" << values.size()
                 << ") must be the number of query heads " << q_heads << " (or 0 for none)");
  for (std::size_t h = 0; h < values.size(); ++h) {
    APEX_CHECK(std::isfinite(values[h]),
               "[" << op << "] " << name << "[" << h << "] (" << values[h] << ") must be finite");
  }
}

/// Every precondition of sdpa on the shapes of [B, H, S, D] views; throws before anything is
/// written. The views' memory is not looked at, so shape-only views may be checked. The element
/// types are any (each view may be read-only or not).
template <class Q, class K, class V, class B, class O>
// q, k, v and the outputs, as sdpa takes them.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
void check_sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                const AttentionMask<B>& mask, const SdpaParams& params, const HeadsView<O>& out,
                const HeadsView<O>& lse, const char* op,
                const SoftmaxStatsView<std::remove_const_t<O>>& stats = {}) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  check_extents(q, op, "q shape");
  check_extents(k, op, "k shape");
  check_extents(v, op, "v shape");
  check_extents(out, op, "output shape");
  check_extents(lse, op, "log-sum-exp shape");
  check_extents(mask.allowed, op, "allowed mask shape");
  check_extents(mask.bias, op, "bias shape");
  APEX_CHECK(k.dim() == q.dim(), "[" << op << "] key width d_qk (" << k.dim()
                                     << ") must equal the query width " << q.dim());
  APEX_CHECK(v.seq() == k.seq(), "[" << op << "] value length S_k (" << v.seq()
                                     << ") must equal the key length " << k.seq());
  APEX_CHECK(k.batch() == q.batch() && v.batch() == q.batch(),
             "[" << op << "] key/value batch (" << k.batch() << ", " << v.batch()
                 << ") must equal the query batch " << q.batch());
  APEX_CHECK(v.heads() == k.heads(), "[" << op << "] value heads (" << v.heads()
                                         << ") must equal the key heads " << k.heads());
  APEX_CHECK(k.heads() >= 1 && q.heads() % k.heads() == 0,
             "[" << op << "] num_q_heads (" << q.heads() << ") must be a multiple of num_kv_heads ("
                 << k.heads() << ")");
  APEX_CHECK(params.scale || q.dim() >= 1,
             "[" << op << "] d_qk (" << q.dim() << ") must be >= 1 for the default scale");
  APEX_CHECK(!params.scale || std::isfinite(*params.scale),
             "[" << op << "] scale (" << *params.scale << ") must be finite");
  APEX_CHECK(std::isfinite(params.softcap) && params.softcap >= 0.0,
             "[" << op << "] softcap (" << params.softcap << ") must be >= 0 (0 = off)");
  check_head_values(params.sinks, q.heads(), op, "sinks");
  check_head_values(params.alibi_slopes, q.heads(), op, "alibi_slopes");
  check_position_mask(mask.positions, q.seq(), k.seq(), op);
  if (!mask.allowed.empty()) {
    check_mask_view_shape(mask.allowed.shape(), q.shape(), k.seq(), op, "allowed mask");
  }
  if (!mask.bias.empty()) check_mask_view_shape(mask.bias.shape(), q.shape(), k.seq(), op, "bias");
  APEX_CHECK(out.shape() == (HeadsShape{q.batch(), q.heads(), q.seq(), v.dim()}),
             "[" << op << "] output shape [" << out.batch() << ", " << out.heads() << ", "
                 << out.seq() << ", " << out.dim() << "] must be [B, H_q, S_q, d_v] = ["
                 << q.batch() << ", " << q.heads() << ", " << q.seq() << ", " << v.dim() << "]");
  check_row_output(lse, q.shape(), op, "log-sum-exp");
  check_row_output(stats.max, q.shape(), op, "max");
  check_row_output(stats.sum, q.shape(), op, "sum");
}

/// The softmax scale of a call: SdpaParams::scale, or 1/√d_qk (§6.2). The one place it is
/// resolved.
inline double softmax_scale(const SdpaParams& params, Index d_qk) {
  return params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(d_qk));
}

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
  p.d_v = segments[0].v.dim();
  return p;
}

/// One (query, key) score of the reference: the score (after scaling, soft-capping, ALiBi and the
/// score rule) plus the bias, or -inf when forbidden.
inline double masked_score(double score, bool allowed, double bias) {
  // A bias of -inf is a mask too: it forbids the key whatever the score (even NaN).
  if (!allowed || bias == -std::numeric_limits<double>::infinity()) {
    return -std::numeric_limits<double>::infinity();
  }
  return score + bias;
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
  require_storage_type<TK>();
  require_storage_type<TV>();
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

/// Runs a [B, H, S, D] attention function on single-head matrices (B = H = 1).
template <class Scalar, class Kernel>
void sdpa_on_matrices(Kernel&& kernel, const ConstRowRef<Scalar>& q, const ConstRowRef<Scalar>& k,
                      const ConstRowRef<Scalar>& v, const AttentionMask<Scalar>& mask,
                      const SdpaParams& params, RowRef<Scalar>& out, Scalar* lse) {
  const auto view = [](const ConstRowRef<Scalar>& m) {
    return HeadsView<const Scalar>(m.data(), {1, 1, m.rows(), m.cols()}, {0, 0, m.outerStride()});
  };
  const HeadsView<Scalar> out_view(out.data(), {1, 1, out.rows(), out.cols()},
                                   {0, 0, out.outerStride()});
  const HeadsView<Scalar> lse_view =
      lse ? HeadsView<Scalar>(lse, {1, 1, q.rows(), 1}, {0, 0, 1}) : HeadsView<Scalar>();
  kernel(view(q), view(k), view(v), mask, params, out_view, lse_view);
}

/// The softmax of one row of the reference, in double: `scores` holds s_j for the keys that take
/// part and -inf for the others (whose values are then never read), `sink` the row's sink (-inf:
/// none). Writes out (d_v values rounded once to TO) and returns the row's (max, sum), following
/// the non-finite policy: NaN or +inf among the scores → NaN; no key and no sink → zeros.
template <class TO, class OutRow>
SoftmaxStats<double> reference_row(const Vector<double>& scores, double sink,
                                   const RowMatrix<double>& vd, OutRow&& out) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  double row_max = kNegInf;
  for (Index j = 0; j < scores.size(); ++j) {
    // A NaN score sticks (std::max would drop it).
    if (std::isnan(scores(j)) || scores(j) > row_max) row_max = scores(j);
  }
  if (std::isnan(row_max) || row_max == std::numeric_limits<double>::infinity()) {
    out.setConstant(std::numeric_limits<TO>::quiet_NaN());
    return {kNaN, kNaN};
  }
  row_max = std::max(row_max, sink);
  if (row_max == kNegInf) {  // no key takes part, and no sink
    out.setZero();
    return {};
  }
  // Keys that take no part are skipped rather than weighted by zero, so that whatever their
  // values hold (even NaN) cannot reach the output.
  Eigen::Matrix<double, 1, Eigen::Dynamic> acc =
      Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(vd.cols());
  double total = std::exp(sink - row_max);  // 0 without a sink
  for (Index j = 0; j < scores.size(); ++j) {
    if (scores(j) == kNegInf) continue;
    const double weight = std::exp(scores(j) - row_max);
    acc += weight * vd.row(j);
    total += weight;
  }
  out = rounded<TO>((acc / total).array()).matrix();
  return {row_max, total};
}

}  // namespace detail

/// Plain, exact implementations that the fast paths are tested against.
namespace reference {

/// Plain attention, written for clarity and exactness: the oracle every fast path is tested
/// against. For each (batch, query head h) it uses key/value head h / (H_q / H_kv) (§8.2) and
/// computes, one query row i (position qp) at a time and in double precision, for every key j
/// (position kp)
///   s_ij = softcap(scale · q_i·k_j) + ALiBi's −slope_h·(qp − kp), then the user's score rule,
///          then + bias_ij; -inf unless the PositionMask, the dense mask and the user's mask
///          rule all allow the pair (and the bias is not -inf)
///   out[i] = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij))      (§6.2; no sink: softmax)
/// following the non-finite policy at the top of this header (a row in which no key takes part
/// gets zeros and a log-sum-exp of -inf, or of the sink).
///   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]
///   -> out: [B, H_q, S_q, d_v], lse (optional): [B, H_q, S_q, 1] (natural log of the row's
///      denominator), stats (optional): the max and sum of SoftmaxStatsView.
/// Each input may have its own storage type (float, double, half, bfloat16; read-only views or
/// not; the bias TB) and the outputs theirs (TO): the elements are read as doubles and each result
/// is rounded once to TO. Outputs must not overlap the inputs. Allocates O(S_k · (d_qk + d_v))
/// doubles per head; never an S_q × S_k matrix. `rules` (attention_rules.hpp) are called for
/// every pair.
template <class Q, class K, class V, class TB, class TO, class A, class C, class S>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params,
          const AttentionRules<A, C, S>& rules, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  detail::require_storage_type<std::remove_const_t<Q>>();
  detail::require_storage_type<std::remove_const_t<K>>();
  detail::require_storage_type<std::remove_const_t<V>>();
  detail::require_storage_type<TB>();
  detail::require_storage_type<TO>();
  detail::check_sdpa(q, k, v, mask, params, out, lse, "sdpa", stats);
  const Index group = q.heads() / k.heads();
  const double scale = detail::softmax_scale(params, q.dim());
  const Index first_query = mask.positions.first_query_position(q.seq(), k.seq());
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (b, h, i, j) as everywhere here
  const auto score = [&](Index b, Index h, Index i, Index j, double dot) {
    const Index qp = first_query + i;
    const Index kp = mask.positions.key_offset + j;
    double s = scale * dot;
    if (params.softcap > 0.0) s = params.softcap * std::tanh(s / params.softcap);
    if (!params.alibi_slopes.empty()) s -= params.alibi_slopes[std::size_t(h)] * double(qp - kp);
    s = static_cast<double>(rules.score(b, h, qp, kp, s));
    const bool allowed = mask.positions.allows(qp, kp) && rules.allows(b, h, qp, kp) &&
                         (mask.allowed.empty() || mask.allowed.head(b, h)(i, j));
    const double bias = mask.bias.empty() ? 0.0 : double(mask.bias.head(b, h)(i, j));
    return detail::masked_score(s, allowed, bias);
  };
  for (Index b = 0; b < q.batch(); ++b) {
    for (Index h = 0; h < q.heads(); ++h) {
      const RowMatrix<double> qd = q.head(b, h).template cast<double>();
      const RowMatrix<double> kd = k.head(b, h / group).template cast<double>();
      const RowMatrix<double> vd = v.head(b, h / group).template cast<double>();
      const double sink = params.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                               : params.sinks[std::size_t(h)];
      Vector<double> scores(k.seq());
      for (Index i = 0; i < q.seq(); ++i) {
        for (Index j = 0; j < k.seq(); ++j) scores(j) = score(b, h, i, j, qd.row(i).dot(kd.row(j)));
        const detail::SoftmaxStats<double> row =
            detail::reference_row<TO>(scores, sink, vd, out.head(b, h).row(i));
        if (!lse.empty()) lse.head(b, h)(i, 0) = round_to<TO>(detail::log_sum_exp(row));
        if (!stats.max.empty()) stats.max.head(b, h)(i, 0) = round_to<TO>(row.max);
        if (!stats.sum.empty()) stats.sum.head(b, h)(i, 0) = round_to<TO>(row.sum);
      }
    }
  }
}

/// The reference without user rules (the PositionMask, the dense mask, the bias and SdpaParams).
template <class Q, class K, class V, class TB, class TO>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  reference::sdpa(q, k, v, mask, params, NoRules{}, out, lse, stats);
}

/// The reference with every input, the bias and the outputs of one type.
template <class Scalar>
void sdpa(const ConstHeadsView<Scalar>& q, const ConstHeadsView<Scalar>& k,
          const ConstHeadsView<Scalar>& v, const AttentionMask<Scalar>& mask,
          const SdpaParams& params, const HeadsView<Scalar>& out, const HeadsView<Scalar>& lse = {},
          const SoftmaxStatsView<Scalar>& stats = {}) {
  reference::sdpa<const Scalar, const Scalar, const Scalar, Scalar, Scalar>(q, k, v, mask, params,
                                                                            out, lse, stats);
}

/// Single-head convenience form of the reference: q [S_q, d_qk], k [S_k, d_qk], v [S_k, d_v]
/// -> [S_q, d_v]. Allocates the result.
template <class DQ, class DK, class DV>
RowMatrix<typename DQ::Scalar> sdpa(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v,
                                    const AttentionMask<typename DQ::Scalar>& mask = {},
                                    const SdpaParams& params = {}) {
  using Scalar = typename DQ::Scalar;
  RowMatrix<Scalar> result(q.rows(), v.cols());
  RowRef<Scalar> out(result);
  detail::sdpa_on_matrices<Scalar>([](auto&&... args) { reference::sdpa<Scalar>(args...); }, q, k,
                                   v, mask, params, out, nullptr);
  return result;
}

}  // namespace reference

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

// ---------------------------------------------------------------------------------------------
// Merging partial results (detail::merge_rows holds the rules)
// ---------------------------------------------------------------------------------------------

namespace detail {

/// n partial results of `rows` rows, merged row by row in double by merge_rows (with the sink
/// of every row, -inf for none).
///   out_of(c, i) -> pointer to the d_v outputs of part c, row i; stats_of(c, i) -> its
///   SoftmaxStats<double>; write(i, stats) receives each merged row's statistics, whose outputs
///   go to out_row(i). Allocates n + d_v doubles.
template <class Scalar, class OutOf, class StatsOf, class OutRow, class Write>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (parts, rows, width)
void merge_parts(Index parts, Index rows, Index d_v, const OutOf& out_of, const StatsOf& stats_of,
                 const OutRow& out_row, const Write& write,
                 double sink = -std::numeric_limits<double>::infinity()) {
  Vector<double> scratch(parts + d_v);
  for (Index i = 0; i < rows; ++i) {
    const auto part_at = [&](Index c) {
      return PartRow<Scalar, double>{out_of(c, i), stats_of(c, i)};
    };
    write(i, merge_rows<double>(parts, d_v, part_at, out_row(i), scratch.data(),
                                scratch.data() + parts, sink));
  }
}

/// The shapes of an n-way merge: parts_out [n·S_q, d_v], a statistic [n, S_q] named `what`, and
/// out [S_q, d_v] (n = rows of the statistic, S_q = its columns).
struct MergeShapes {
  Index stacked_rows, d_v, stat_rows, stat_cols, out_rows, out_cols;
};

inline void check_merge_shapes(const MergeShapes& m, const char* op, const char* what) {
  const Index parts = m.stat_rows;
  const Index rows = m.stat_cols;
  APEX_CHECK(parts >= 1 && m.stacked_rows == checked_product(parts, rows, op, "n*S_q"),
             "[" << op << "] parts_out rows (" << m.stacked_rows << ") must be n*S_q = " << parts
                 << "*" << rows << " (n >= 1 parts, n and S_q from " << what << ")");
  APEX_CHECK(m.out_rows == rows && m.out_cols == m.d_v,
             "[" << op << "] output shape [" << m.out_rows << ", " << m.out_cols
                 << "] must be [S_q, d_v] = [" << rows << ", " << m.d_v << "]");
}

}  // namespace detail

namespace detail {

/// The whole of merge_attention_stats, with the sink of every row (-inf: none).
template <class DO, class DM, class DS>
void merge_stats(const Eigen::MatrixBase<DO>& parts_out, const Eigen::MatrixBase<DM>& parts_max,
                 const Eigen::MatrixBase<DS>& parts_sum, double sink,
                 RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> max,
                 VectorRef<typename DO::Scalar> sum, const char* op) {
  using Scalar = typename DO::Scalar;
  require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> po(parts_out.derived());
  const ConstRowRef<Scalar> pm(parts_max.derived());
  const ConstRowRef<Scalar> ps(parts_sum.derived());
  const Index parts = pm.rows();
  const Index rows = pm.cols();
  check_merge_shapes({po.rows(), po.cols(), parts, rows, out.rows(), out.cols()}, op, "parts_max");
  APEX_CHECK(ps.rows() == parts && ps.cols() == rows,
             "[" << op << "] parts_sum shape [" << ps.rows() << ", " << ps.cols()
                 << "] must equal parts_max shape [" << parts << ", " << rows << "]");
  APEX_CHECK(max.size() == rows && sum.size() == rows, "[" << op << "] max and sum lengths ("
                                                           << max.size() << ", " << sum.size()
                                                           << ") must equal S_q " << rows);
  merge_parts<Scalar>(
      parts, rows, po.cols(), [&](Index c, Index i) { return po.row(c * rows + i).data(); },
      [&](Index c, Index i) {
        return SoftmaxStats<double>{double(pm(c, i)), double(ps(c, i))};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const SoftmaxStats<double>& s) {
        max(i) = static_cast<Scalar>(s.max);
        sum(i) = static_cast<Scalar>(s.sum);
      },
      sink);
}

}  // namespace detail

/// Merges n attention results over disjoint key sets into the result over their union, exactly
/// at any logit magnitude, from each part's softmax statistics (SoftmaxStatsView, as sdpa writes
/// them; named apart from merge_attention, whose two-way form has as many arguments):
///   M = max_c m_c,  w_c = l_c·exp(m_c − M),  out = Σ_c w_c·out_c / Σ_c w_c,  (M, Σ_c w_c)
/// with the rules of detail::merge_rows (a NaN part makes the row NaN; a part without keys is
/// skipped; no keys at all gives zeros, max -inf and sum 0). Computed in double.
///   parts_out: [n·S_q, d_v], part c in rows [c·S_q, (c+1)·S_q); parts_max, parts_sum: [n, S_q]
///   -> out: [S_q, d_v], max, sum: [S_q]
/// out may be one part's block of parts_out (in place). Allocates n + d_v doubles.
template <class DO, class DM, class DS>
void merge_attention_stats(const Eigen::MatrixBase<DO>& parts_out,
                           const Eigen::MatrixBase<DM>& parts_max,
                           const Eigen::MatrixBase<DS>& parts_sum, RowRef<typename DO::Scalar> out,
                           VectorRef<typename DO::Scalar> max, VectorRef<typename DO::Scalar> sum) {
  detail::merge_stats(parts_out, parts_max, parts_sum, -std::numeric_limits<double>::infinity(),
                      out, max, sum, "merge_attention_stats");
}

/// merge_attention_stats for rows with an attention sink (SdpaParams::sinks; one head's rows, so
/// one sink): the parts, computed without the sink, are merged and the sink joins once, as one
/// more logit of zero value (detail::with_sink): with M = max(max_c m_c, sink),
///   out = Σ_c w_c·out_c / (e^(sink − M) + Σ_c w_c),  sum = e^(sink − M) + Σ_c w_c,
/// the result of sdpa over all the keys with that sink. A row without keys gets zeros and the
/// statistics (sink, 1). Throws if the sink is not finite. Shapes and allocation as above.
template <class DO, class DM, class DS>
void merge_attention_stats(const Eigen::MatrixBase<DO>& parts_out,
                           const Eigen::MatrixBase<DM>& parts_max,
                           const Eigen::MatrixBase<DS>& parts_sum, double sink,
                           RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> max,
                           VectorRef<typename DO::Scalar> sum) {
  APEX_CHECK(std::isfinite(sink), "[merge_attention_stats] sink (" << sink << ") must be finite");
  detail::merge_stats(parts_out, parts_max, parts_sum, sink, out, max, sum,
                      "merge_attention_stats");
}

/// Merges n attention results over disjoint key sets from their log-sum-exps:
///   L = max_c lse_c,  w_c = exp(lse_c − L),  out = Σ_c w_c·out_c / Σ_c w_c,  lse = L + log Σ w_c
/// (each part is the statistics (lse_c, 1); rules as above), computed in double. Exact up to the
/// rounding of the lse values themselves, which in float loses ~1e-3 of absolute precision at
/// logits near 1e4: for exactness at any magnitude use merge_attention_stats (above).
///   parts_out: [n·S_q, d_v] (part c in rows [c·S_q, (c+1)·S_q)), parts_lse: [n, S_q]
///   -> out: [S_q, d_v], lse: [S_q]
/// out and lse may be one part's block of parts_out and that part's lse (in place). Allocates
/// n + d_v doubles.
template <class DO, class DL>
void merge_attention(const Eigen::MatrixBase<DO>& parts_out, const Eigen::MatrixBase<DL>& parts_lse,
                     RowRef<typename DO::Scalar> out, VectorRef<typename DO::Scalar> lse) {
  using Scalar = typename DO::Scalar;
  detail::require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> po(parts_out.derived());
  const ConstRowRef<Scalar> pl(parts_lse.derived());
  const Index parts = pl.rows();
  const Index rows = pl.cols();
  detail::check_merge_shapes({po.rows(), po.cols(), parts, rows, out.rows(), out.cols()},
                             "merge_attention", "parts_lse");
  APEX_CHECK(lse.size() == rows,
             "[merge_attention] lse length (" << lse.size() << ") must equal S_q " << rows);
  detail::merge_parts<Scalar>(
      parts, rows, po.cols(), [&](Index c, Index i) { return po.row(c * rows + i).data(); },
      [&](Index c, Index i) {
        return detail::SoftmaxStats<double>{double(pl(c, i)), 1.0};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const detail::SoftmaxStats<double>& s) {
        lse(i) = static_cast<Scalar>(detail::log_sum_exp(s));
      });
}

/// Merges two attention results over disjoint key sets A and B into the result over A ∪ B:
///   lse = log(e^lse_a + e^lse_b),  out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b),
/// the n-way merge above with n = 2. This is what makes split-key (flash-decoding) attention
/// exact. A side whose lse is -inf (no allowed key) contributes nothing; if both are -inf the
/// row is zeros with lse -inf; if either is NaN (a NaN row of sdpa) the row is NaN.
///   out_a, out_b: [S_q, d_v], lse_a, lse_b: [S_q] -> out: [S_q, d_v], lse: [S_q]
/// out and lse may be out_a and lse_a, or out_b and lse_b (accumulate in place). Allocates
/// 2 + d_v doubles.
template <class DA, class LA, class DB, class LB>
void merge_attention(const Eigen::MatrixBase<DA>& out_a, const Eigen::MatrixBase<LA>& lse_a,
                     const Eigen::MatrixBase<DB>& out_b, const Eigen::MatrixBase<LB>& lse_b,
                     RowRef<typename DA::Scalar> out, VectorRef<typename DA::Scalar> lse) {
  using Scalar = typename DA::Scalar;
  detail::require_supported_scalar<Scalar>();
  const ConstRowRef<Scalar> a(out_a.derived());
  const ConstRowRef<Scalar> b(out_b.derived());
  const ConstVectorRef<Scalar> la(lse_a.derived());
  const ConstVectorRef<Scalar> lb(lse_b.derived());
  const Index rows = a.rows();
  APEX_CHECK(b.rows() == rows && b.cols() == a.cols(), "[merge_attention] out_b shape ["
                                                           << b.rows() << ", " << b.cols()
                                                           << "] must equal out_a shape [" << rows
                                                           << ", " << a.cols() << "]");
  APEX_CHECK(la.size() == rows && lb.size() == rows, "[merge_attention] lse_a and lse_b lengths ("
                                                         << la.size() << ", " << lb.size()
                                                         << ") must equal the rows " << rows);
  APEX_CHECK(out.rows() == rows && out.cols() == a.cols() && lse.size() == rows,
             "[merge_attention] output shape [" << out.rows() << ", " << out.cols() << "] / lse "
                                                << lse.size() << " must be [" << rows << ", "
                                                << a.cols() << "] / " << rows);
  detail::merge_parts<Scalar>(
      2, rows, a.cols(),
      [&](Index c, Index i) { return c == 0 ? a.row(i).data() : b.row(i).data(); },
      [&](Index c, Index i) {
        return detail::SoftmaxStats<double>{double(c == 0 ? la(i) : lb(i)), 1.0};
      },
      [&](Index i) { return out.row(i).data(); },
      [&](Index i, const detail::SoftmaxStats<double>& s) {
        lse(i) = static_cast<Scalar>(detail::log_sum_exp(s));
      });
}

}  // namespace apex
