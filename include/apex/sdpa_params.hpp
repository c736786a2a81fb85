// SPDX-License-Identifier: MIT
// What an attention call takes beside its tensors (§6.2): the parameters of the scores
// (SdpaParams: scale, soft-cap, sinks, ALiBi), the mask (AttentionMask: position rule, dense mask
// and bias), the optional softmax statistics (SoftmaxStatsView), the standard ALiBi slopes, and
// the shape checks of sdpa that every attention path runs first. sdpa.hpp, its reference
// (reference_attention.hpp) and the many-sequence calls share them; the non-finite policy they
// follow is stated at the top of sdpa.hpp.
//   q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v]; a dense mask or
//   bias [B', H', S_q, S_k] (B' in {1, B}, H' in {1, H_q}); per-row outputs [B, H_q, S_q, 1].
// Allocates nothing but alibi_slopes' result.
#pragma once

#include <apex/config.hpp>
#include <apex/kv_format.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <optional>
#include <type_traits>
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
  APEX_CHECK(row_values(k) == q.dim(), "[" << op << "] key width d_qk (" << row_values(k)
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
  const Index d_v = row_values(v);
  APEX_CHECK(out.shape() == (HeadsShape{q.batch(), q.heads(), q.seq(), d_v}),
             "[" << op << "] output shape [" << out.batch() << ", " << out.heads() << ", "
                 << out.seq() << ", " << out.dim() << "] must be [B, H_q, S_q, d_v] = ["
                 << q.batch() << ", " << q.heads() << ", " << q.seq() << ", " << d_v << "]");
  check_row_output(lse, q.shape(), op, "log-sum-exp");
  check_row_output(stats.max, q.shape(), op, "max");
  check_row_output(stats.sum, q.shape(), op, "sum");
}

/// The softmax scale of a call: SdpaParams::scale, or 1/√d_qk (§6.2). The one place it is
/// resolved.
inline double softmax_scale(const SdpaParams& params, Index d_qk) {
  return params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(d_qk));
}

/// Runs a [B, H, S, D] attention function on single-head matrices (B = H = 1), the
/// single-head forms of sdpa and of its reference.
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

}  // namespace detail

}  // namespace apex
