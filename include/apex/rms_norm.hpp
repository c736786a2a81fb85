// SPDX-License-Identifier: MIT
// RMSNorm (§3): each token's features divided by their root mean square, then scaled by γ.
//
//   x   [tokens, d]  ──►  out[t, j] = x[t, j] / sqrt(mean_j(x[t, :]²) + ε) · γ'[j]
//   γ   [d]               γ' = γ (the documents, Llama) or 1 + γ (Gemma: RmsNormGamma)
//
// add_rms_norm fuses a pre-norm block's residual step with the next norm:
//
//   residual [tokens, d] ← residual + x,   out = RMSNorm(residual)
//
// The kernel makes two passes over a row: the sum of squares, then the scaled write. A row is
// at most a few tens of kilobytes, so the second pass reads it from L1/L2 and the memory
// traffic is one read of x and one write of out; the second pass prefetches the next row, so
// that the reads of one row and the writes of the one before overlap. Rows are spread over threads
// statically. The row machinery (detail/norm_rows.hpp) is shared with LayerNorm (layer_norm.hpp),
// which centres the row first.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/norm_backward.hpp>
#include <apex/detail/norm_rows.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

namespace apex {

/// How γ scales a normalised row. A convention of the checkpoint, so it is spelled out:
///   kGamma         out = x / RMS(x) · γ        the documents (§3.2), Llama, Qwen, Mistral;
///   kOnePlusGamma  out = x / RMS(x) · (1 + γ)  Gemma 1–3, whose checkpoints store γ − 1
///                                              (HuggingFace GemmaRMSNorm, zeros at init).
enum class RmsNormGamma { kGamma, kOnePlusGamma };

/// Parameters of RMSNorm. The defaults are the document's (§3.2).
struct RmsNormParams {
  /// ε added to the mean square under the square root; must be positive and finite.
  double eps = 1e-6;
  /// γ or 1 + γ (see RmsNormGamma).
  RmsNormGamma scale = RmsNormGamma::kGamma;
};

namespace detail {

/// RMSNorm's γ, read through a contiguous Ref, as check_norm_call checks it.
template <class TG>
struct RmsNormVectors {
  ConstVectorRef<TG> gamma;

  void check_lengths(const char* op, Index d) const {
    check_norm_vector_length(op, "gamma", gamma.size(), d);
  }
  void check_disjoint(const char* op, const char* written_name, ByteSpan written) const {
    check_norm_disjoint(op, "gamma", vector_span(gamma), written_name, written);
  }
};

/// Calls run(Form{}) with RMSNorm's NormForm for `scale` (γ or 1 + γ, no β).
template <class Run>
void with_rms_norm_form(RmsNormGamma scale, const Run& run) {
  if (scale == RmsNormGamma::kOnePlusGamma) {
    run(NormForm<false, NormScale::kOnePlusGamma, false>{});
  } else {
    run(NormForm<false, NormScale::kGamma, false>{});
  }
}

}  // namespace detail

/// RMSNorm over the last dimension (§3.2):
///   out[t, :] = x[t, :] / sqrt(mean(x[t, :]²) + ε) · γ        (params.scale = kGamma)
///   out[t, :] = x[t, :] / sqrt(mean(x[t, :]²) + ε) · (1 + γ)  (params.scale = kOnePlusGamma).
/// x: [tokens, d], gamma: [d] (any vector expression), out: [tokens, d] (a row-major matrix,
/// Map, Ref or block of one with contiguous rows, written in place). Each may have its own
/// storage type, float, double, Eigen::half or Eigen::bfloat16 (storage.hpp): for example
/// bfloat16 rows with a float γ written as float.
/// In place is allowed: out may be x itself (the same rows); any other overlap of out with x,
/// or of out with gamma, is rejected.
/// Accuracy: float and 16-bit rows accumulate the squares in double, so values near the float
/// maximum do not overflow and values near 1e-20 keep all their digits; the output, including
/// 1 + γ, is formed in double and rounded once to out's type. (HuggingFace's GemmaRMSNorm
/// computes x·rsqrt(mean(x²) + ε) in float32, multiplies by (1.0 + γ) in float32 and casts to
/// x's type, rounding at each step; apex's one rounding is at least as accurate.) Double rows
/// whose squares would overflow or underflow are rescaled by a power of two (exact) before
/// squaring; ordinary rows take the plain two-pass loop.
/// Allocates nothing when x is row-major with contiguous rows and gamma is a contiguous
/// vector (otherwise Eigen::Ref copies the input). Threads over rows (detail::parallel_for);
/// each row's result is independent of the thread count.
template <class Derived, class GammaDerived, class OutDerived>
void rms_norm(const Eigen::MatrixBase<Derived>& x, const Eigen::MatrixBase<GammaDerived>& gamma,
              const RmsNormParams& params, const Eigen::MatrixBase<OutDerived>& out_) {
  using TX = typename Derived::Scalar;
  using TG = typename GammaDerived::Scalar;
  using TO = typename OutDerived::Scalar;
  detail::require_storage_types<TX, TG, TO>();
  static_assert(GammaDerived::IsVectorAtCompileTime, "[rms_norm] gamma must be a vector");
  // The output is written through a Ref to its storage (Eigen's idiom for output parameters
  // that may be temporaries, such as blocks and maps).
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TX> xr(x.derived());
  const detail::RmsNormVectors<TG> v{gamma.derived()};
  detail::check_norm_call("rms_norm", params.eps, v, xr, out);
  detail::with_rms_norm_form(params.scale, [&](auto form) {
    const float* no_beta = nullptr;
    detail::norm_rows<decltype(form)>(xr, v.gamma.data(), no_beta, params.eps, out);
  });
}

/// RMSNorm (§3.2) returning a new [tokens, d] matrix of x's type; see the overload above.
template <class Derived, class GammaDerived>
RowMatrix<typename Derived::Scalar> rms_norm(const Eigen::MatrixBase<Derived>& x,
                                             const Eigen::MatrixBase<GammaDerived>& gamma,
                                             const RmsNormParams& params = {}) {
  return detail::new_norm_output(x, [&](auto& out) { rms_norm(x, gamma, params, out); });
}

/// The residual add of a pre-norm block fused with the next RMSNorm (vLLM's fused_add_rms_norm):
///   residual[t, :] ← residual[t, :] + x[t, :]   (rounded once to residual's type),
///   out[t, :] = RMSNorm(residual[t, :])         (from the rounded sum, as rms_norm above).
/// Bit for bit `residual += x; rms_norm(residual, gamma, params, out)` for x and residual of one
/// storage type (float, double, half, bfloat16: Eigen's additions round the sum once, and so
/// does this); for mixed types the sum is formed in double and rounded once to residual's type.
/// One pass over memory: each row is added, then normalised while it is in cache (read x and
/// residual, write residual and out), where the two steps cross memory twice.
/// x: [tokens, d] (read), residual: [tokens, d] (read and written: the updated residual stream),
/// gamma: [d], out: [tokens, d]; each of its own storage type. out may be x itself (in place);
/// out must not overlap residual or gamma otherwise, and residual must not overlap x or gamma.
/// Every check is made before anything is written: a failed call changes nothing.
/// Allocates nothing for row-major x, residual and out with contiguous rows and a contiguous
/// γ. Threads over rows; each row's result is independent of the thread count.
template <class Derived, class ResidualDerived, class GammaDerived, class OutDerived>
void add_rms_norm(const Eigen::MatrixBase<Derived>& x,
                  const Eigen::MatrixBase<ResidualDerived>& residual_,
                  const Eigen::MatrixBase<GammaDerived>& gamma, const RmsNormParams& params,
                  const Eigen::MatrixBase<OutDerived>& out_) {
  using TX = typename Derived::Scalar;
  using TR = typename ResidualDerived::Scalar;
  using TG = typename GammaDerived::Scalar;
  using TO = typename OutDerived::Scalar;
  detail::require_storage_types<TX, TR, TG, TO>();
  static_assert(GammaDerived::IsVectorAtCompileTime, "[add_rms_norm] gamma must be a vector");
  RowRef<TR> residual(const_cast<ResidualDerived&>(residual_.derived()));
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TX> xr(x.derived());
  const detail::RmsNormVectors<TG> v{gamma.derived()};
  detail::check_norm_call("add_rms_norm", params.eps, v, xr, out, &residual);
  detail::with_rms_norm_form(params.scale, [&](auto form) {
    const float* no_beta = nullptr;
    detail::add_norm_rows<decltype(form)>(xr, residual, v.gamma.data(), no_beta, params.eps, out);
  });
}

/// add_rms_norm returning out as a new [tokens, d] matrix of x's type (residual is updated).
template <class Derived, class ResidualDerived, class GammaDerived>
RowMatrix<typename Derived::Scalar> add_rms_norm(const Eigen::MatrixBase<Derived>& x,
                                                 const Eigen::MatrixBase<ResidualDerived>& residual,
                                                 const Eigen::MatrixBase<GammaDerived>& gamma,
                                                 const RmsNormParams& params = {}) {
  return detail::new_norm_output(x,
                                 [&](auto& out) { add_rms_norm(x, residual, gamma, params, out); });
}

/// The backward pass of RMSNorm (§3.2): for out = rms_norm(x, γ, params) and d_out = ∂L/∂out,
///   dx[t, :] = (g − z·mean(g∘z)) / σ_t,   g = d_out[t, :]∘γ',  z = x[t, :] / σ_t,
///   dγ = Σ_t d_out[t, :]∘z,               σ_t = sqrt(mean(x[t, :]²) + ε),
/// with γ' = γ or 1 + γ (params.scale); dγ is the same for both. x, d_out, d_x: [tokens, d];
/// gamma, d_gamma: [d]; each of its own storage type. Computed in double per row (z and σ as
/// rms_norm forms them), each result rounded once; dγ sums the tokens in fixed chunks, so every
/// result is bit-identical for any number of threads. Nothing written may overlap anything read
/// or written; every check is made before anything is written. Allocates d doubles per chunk of
/// 64 rows and two more per chunk for dγ (detail/norm_backward.hpp). Threads over chunks of rows.
template <class Derived, class GammaDerived, class DOutDerived, class DxDerived,
          class DGammaDerived>
void rms_norm_backward(const Eigen::MatrixBase<Derived>& x,
                       const Eigen::MatrixBase<GammaDerived>& gamma, const RmsNormParams& params,
                       const Eigen::MatrixBase<DOutDerived>& d_out,
                       const Eigen::MatrixBase<DxDerived>& d_x_,
                       const Eigen::MatrixBase<DGammaDerived>& d_gamma_) {
  using TX = typename Derived::Scalar;
  using TG = typename GammaDerived::Scalar;
  using TY = typename DOutDerived::Scalar;
  using TD = typename DxDerived::Scalar;
  detail::require_storage_types<TX, TG, TY, TD>();
  static_assert(GammaDerived::IsVectorAtCompileTime, "[rms_norm_backward] gamma must be a vector");
  RowRef<TD> d_x(const_cast<DxDerived&>(d_x_.derived()));
  const detail::NormGradientVector<DGammaDerived> d_gamma(d_gamma_.derived());
  const detail::NormGradientVector<std::nullopt_t> no_beta(std::nullopt);
  const ConstRowRef<TX> xr(x.derived());
  const ConstRowRef<TY> dy(d_out.derived());
  const ConstVectorRef<TG> g(gamma.derived());
  detail::check_norm_backward("rms_norm_backward", params.eps, g.size(), detail::vector_span(g), xr,
                              dy, d_x, d_gamma, no_beta);
  detail::with_rms_norm_form(params.scale, [&](auto form) {
    using Form = decltype(form);
    const detail::NormBackward<Form, TX, TY, TG, TD> nb{xr, dy, g.data(), params.eps};
    detail::norm_backward_rows(nb, d_x, d_gamma.data(), no_beta.data());
  });
}

}  // namespace apex
