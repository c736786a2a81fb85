// SPDX-License-Identifier: MIT
// LayerNorm (Ba, Kiros and Hinton 2016; PyTorch's nn.LayerNorm): each token's features centred
// on their mean and divided by their standard deviation, then scaled by γ and shifted by β.
// Not in the APEX-1 documents, which use RMSNorm (§3); GPT-2 and Phi use it with γ and β,
// OLMo-1 without either ("non-parametric").
//
//   x   [tokens, d]  ──►  out[t, j] = (x[t, j] − μ_t) / sqrt(σ²_t + ε) · γ[j] + β[j]
//   γ, β [d], each optional     μ_t = mean_j x[t, :],  σ²_t = mean_j (x[t, :] − μ_t)²  (biased)
//
// add_layer_norm fuses a block's residual step with the next LayerNorm, as add_rms_norm does.
// The row kernel is RMSNorm's (detail::norm_row, detail/norm_rows.hpp) with the row centred
// first: a pass for the statistics (two for double rows) and one for the write, from L1/L2.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/norm_backward.hpp>
#include <apex/detail/norm_rows.hpp>
#include <apex/storage.hpp>

#include <optional>
#include <type_traits>

namespace apex {

/// Parameters of LayerNorm.
struct LayerNormParams {
  /// ε added to the variance under the square root; must be positive and finite. The default
  /// is PyTorch's (nn.LayerNorm, GPT-2, Phi).
  double eps = 1e-5;
};

namespace detail {

/// γ or β of a LayerNorm: an Eigen vector expression, read through a contiguous Ref (the
/// primary template), or std::nullopt, unset (γ = 1, β = 0: nothing is multiplied or added).
template <class V, bool = std::is_same_v<V, std::nullopt_t>>
class OptionalNormVector {
 public:
  static_assert(std::is_base_of_v<Eigen::MatrixBase<V>, V> && V::IsVectorAtCompileTime,
                "[layer_norm] gamma and beta are vectors or std::nullopt");
  using Scalar = typename V::Scalar;
  static constexpr bool kSet = true;
  explicit OptionalNormVector(const V& v) : ref_(v.derived()) { require_storage_type<Scalar>(); }
  const Scalar* data() const { return ref_.data(); }
  Index size() const { return ref_.size(); }
  ByteSpan span() const { return vector_span(ref_); }

 private:
  ConstVectorRef<Scalar> ref_;
};

template <class V>
class OptionalNormVector<V, true> {
 public:
  using Scalar = float;
  static constexpr bool kSet = false;
  explicit OptionalNormVector(std::nullopt_t /*unset*/) {}
  const float* data() const { return nullptr; }
  ByteSpan span() const { return {}; }
};

/// LayerNorm's γ and β (each an OptionalNormVector), their NormForm, and the checks that
/// check_norm_call makes on them: each set one has length d and overlaps no written view.
template <class Gamma, class Beta>
struct LayerNormVectors {
  using G = OptionalNormVector<Gamma>;
  using B = OptionalNormVector<Beta>;
  /// The write's formula: centred, γ and β where set.
  using Form = NormForm<true, G::kSet ? NormScale::kGamma : NormScale::kNone, B::kSet>;

  G gamma;
  B beta;

  LayerNormVectors(const Gamma& g, const Beta& b) : gamma(g), beta(b) {}
  void check_lengths(const char* op, Index d) const {
    if constexpr (G::kSet) check_norm_vector_length(op, "gamma", gamma.size(), d);
    if constexpr (B::kSet) check_norm_vector_length(op, "beta", beta.size(), d);
  }
  void check_disjoint(const char* op, const char* written_name, ByteSpan written) const {
    check_norm_disjoint(op, "gamma", gamma.span(), written_name, written);
    check_norm_disjoint(op, "beta", beta.span(), written_name, written);
  }
};

}  // namespace detail

/// LayerNorm over the last dimension:
///   out[t, :] = (x[t, :] − μ_t) / sqrt(σ²_t + ε) · γ + β,
///   μ_t = mean(x[t, :]),  σ²_t = mean((x[t, :] − μ_t)²)  (biased, as PyTorch's LayerNorm).
/// x: [tokens, d]; gamma, beta: [d] (any vector expression) or std::nullopt, each on its own:
/// unset γ multiplies by nothing (γ = 1), unset β adds nothing (β = 0), so
///   layer_norm(x, gamma, beta, {}, out)                 GPT-2, Phi
///   layer_norm(x, std::nullopt, std::nullopt, {}, out)  OLMo-1's non-parametric LayerNorm.
/// out: [tokens, d] (a row-major matrix, Map, Ref or block of one with contiguous rows). Each
/// argument may have its own storage type, float, double, Eigen::half or Eigen::bfloat16.
/// In place is allowed: out may be x itself (the same rows); any other overlap of out with x,
/// and any overlap of out with γ or β, is rejected before anything is written.
/// Accuracy: μ and σ² are accumulated in double in a fixed order, about x[t, 0] (so a constant
/// row gives exactly β): in one pass for float and 16-bit rows (relative error of σ² at most
/// about n·2^-53, far below float's), in two (the mean, then the squared deviations) for double
/// rows; the output is formed in double and rounded once to out's type. Double rows whose
/// statistics would overflow (|x| ≳ 1e154) or underflow are scaled by powers of two (exact) first.
/// Allocates nothing when x is row-major with contiguous rows and γ, β are contiguous vectors
/// (otherwise Eigen::Ref copies the input). Threads over rows (detail::parallel_for); each row's
/// result is independent of the thread count.
template <class Derived, class Gamma, class Beta, class OutDerived>
void layer_norm(const Eigen::MatrixBase<Derived>& x, const Gamma& gamma, const Beta& beta,
                const LayerNormParams& params, const Eigen::MatrixBase<OutDerived>& out_) {
  using TX = typename Derived::Scalar;
  using TO = typename OutDerived::Scalar;
  detail::require_storage_types<TX, TO>();
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TX> xr(x.derived());
  using Vectors = detail::LayerNormVectors<Gamma, Beta>;
  const Vectors v(gamma, beta);
  detail::check_norm_call("layer_norm", params.eps, v, xr, out);
  detail::norm_rows<typename Vectors::Form>(xr, v.gamma.data(), v.beta.data(), params.eps, out);
}

/// LayerNorm returning a new [tokens, d] matrix of x's type; see the overload above.
template <class Derived, class Gamma, class Beta>
RowMatrix<typename Derived::Scalar> layer_norm(const Eigen::MatrixBase<Derived>& x,
                                               const Gamma& gamma, const Beta& beta,
                                               const LayerNormParams& params = {}) {
  return detail::new_norm_output(x, [&](auto& out) { layer_norm(x, gamma, beta, params, out); });
}

/// The residual add of a block fused with the next LayerNorm:
///   residual[t, :] ← residual[t, :] + x[t, :]   (rounded once to residual's type),
///   out[t, :] = LayerNorm(residual[t, :])       (from the rounded sum, as layer_norm above).
/// Bit for bit `residual += x; layer_norm(residual, gamma, beta, params, out)` for x and
/// residual of one storage type; the sum, the checks and the single pass over memory are those
/// of add_rms_norm (rms_norm.hpp). x, residual, out: [tokens, d]; gamma, beta: [d] or
/// std::nullopt. out may be x itself; out must not overlap residual, γ or β otherwise, and
/// residual must not overlap x, γ or β. A failed call changes nothing. Allocates nothing for
/// contiguous rows and vectors. Threads over rows; results are independent of the thread count.
template <class Derived, class ResidualDerived, class Gamma, class Beta, class OutDerived>
void add_layer_norm(const Eigen::MatrixBase<Derived>& x,
                    const Eigen::MatrixBase<ResidualDerived>& residual_, const Gamma& gamma,
                    const Beta& beta, const LayerNormParams& params,
                    const Eigen::MatrixBase<OutDerived>& out_) {
  using TX = typename Derived::Scalar;
  using TR = typename ResidualDerived::Scalar;
  using TO = typename OutDerived::Scalar;
  detail::require_storage_types<TX, TR, TO>();
  RowRef<TR> residual(const_cast<ResidualDerived&>(residual_.derived()));
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TX> xr(x.derived());
  using Vectors = detail::LayerNormVectors<Gamma, Beta>;
  const Vectors v(gamma, beta);
  detail::check_norm_call("add_layer_norm", params.eps, v, xr, out, &residual);
  detail::add_norm_rows<typename Vectors::Form>(xr, residual, v.gamma.data(), v.beta.data(),
                                                params.eps, out);
}

/// The backward pass of LayerNorm: for out = layer_norm(x, γ, β, params) and d_out = ∂L/∂out,
///   dx[t, :] = (g − mean(g) − z·mean(g∘z)) / σ_t,   g = d_out[t, :]∘γ (γ = 1 when unset),
///   dγ = Σ_t d_out[t, :]∘z,   dβ = Σ_t d_out[t, :],
/// with z = (x[t, :] − μ_t) / σ_t and σ_t = sqrt(σ²_t + ε) as layer_norm forms them. x, d_out,
/// d_x: [tokens, d]; gamma, beta: [d] or std::nullopt as given to layer_norm (β does not enter);
/// d_gamma, d_beta: [d] vectors to write, or std::nullopt (not computed). Each of its own storage
/// type; computed in double, each result rounded once, bit-identical for any number of threads
/// (the sums over tokens in fixed chunks). Nothing written may overlap anything read or written;
/// every check is made before anything is written. Allocates as rms_norm_backward.
template <class Derived, class Gamma, class Beta, class DOutDerived, class DxDerived, class DGamma,
          class DBeta>
void layer_norm_backward(const Eigen::MatrixBase<Derived>& x, const Gamma& gamma, const Beta& beta,
                         const LayerNormParams& params, const Eigen::MatrixBase<DOutDerived>& d_out,
                         const Eigen::MatrixBase<DxDerived>& d_x_, const DGamma& d_gamma_,
                         const DBeta& d_beta_) {
  using TX = typename Derived::Scalar;
  using TY = typename DOutDerived::Scalar;
  using TD = typename DxDerived::Scalar;
  detail::require_storage_types<TX, TY, TD>();
  RowRef<TD> d_x(const_cast<DxDerived&>(d_x_.derived()));
  using Vectors = detail::LayerNormVectors<Gamma, Beta>;
  const Vectors v(gamma, beta);
  const detail::NormGradientVector<DGamma> d_gamma(d_gamma_);
  const detail::NormGradientVector<DBeta> d_beta(d_beta_);
  const ConstRowRef<TX> xr(x.derived());
  const ConstRowRef<TY> dy(d_out.derived());
  const char* op = "layer_norm_backward";
  v.check_lengths(op, xr.cols());
  Index gamma_size = -1;
  if constexpr (Vectors::G::kSet) gamma_size = v.gamma.size();
  detail::check_norm_backward(op, params.eps, gamma_size, v.gamma.span(), xr, dy, d_x, d_gamma,
                              d_beta);
  using Form = detail::NormForm<true, Vectors::Form::kScale, false>;
  const detail::NormBackward<Form, TX, TY, typename Vectors::G::Scalar, TD> nb{
      xr, dy, v.gamma.data(), params.eps};
  detail::norm_backward_rows(nb, d_x, d_gamma.data(), d_beta.data());
}

}  // namespace apex
