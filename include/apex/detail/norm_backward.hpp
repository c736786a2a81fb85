// SPDX-License-Identifier: MIT
// The backward pass of the norms (rms_norm_backward, layer_norm_backward): for a row x with its
// normalised value z (the forward's, norm_rows.hpp) and σ = sqrt(var + ε) (var = mean(x²) for
// RMSNorm, mean((x − μ)²) for LayerNorm), out = z·γ' + β and dy = ∂L/∂out:
//   g = dy ∘ γ'                                    (γ' = γ, 1 + γ, or 1 when unset)
//   dx = (g − z·mean(g∘z)) / σ                      RMSNorm
//   dx = (g − mean(g) − z·mean(g∘z)) / σ            LayerNorm (centred)
//   dγ = Σ_t dy ∘ z (γ and 1 + γ alike),  dβ = Σ_t dy
// Every row is computed in double, z and σ as the forward forms them (double rows whose squares
// overflow or underflow rescaled by powers of two), and dx rounded once. The sums over tokens
// run in fixed chunks of rows, added in order, so dγ and dβ are bit-identical for any number of
// threads.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/norm_rows.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (row, length, ε) as norm_rows.hpp
namespace apex::detail {

/// σ = sqrt(var + ε) of a row (Centered: about its mean), in double, as the forward forms its
/// 1/σ: from norm_stats, or for a double row whose statistics overflow or underflow from the
/// rescaled deviations of RowScaling, σ = 2^(k+m)·sqrt(mean(e²) + ε·2^(-2(k+m))).
template <bool Centered, class TX>
double norm_sigma(const TX* x, Index n, double eps) {
  const NormStats s = norm_stats<Centered>(x, n);
  if constexpr (std::is_same_v<TX, double>) {
    if (!(std::isfinite(s.var) && s.var + eps >= 0x1p-900)) {
      RowScaling scaling;
      const RowKind kind = row_scaling<Centered>(x, n, scaling);
      if (kind == RowKind::kConstant) return std::sqrt(eps);
      if (kind == RowKind::kScaled) {
        const int binade = scaling.k + scaling.m;
        double squares = 0.0;
        for (Index j = 0; j < n; ++j) {
          const double u = std::scalbn(x[j], -scaling.k);
          const double e = Centered ? std::scalbn(u - scaling.mean, -scaling.m) : u;
          squares += e * e;
        }
        const double scaled_eps = std::scalbn(eps, -2 * binade);
        if (!std::isfinite(scaled_eps)) return std::sqrt(eps);
        return std::scalbn(std::sqrt(squares / static_cast<double>(n) + scaled_eps), binade);
      }
    }
  }
  return std::sqrt(s.var + eps);
}

/// The row kernels' view of a norm's backward: x, dy (read), dx (written) as row-major refs,
/// γ and β as in the forward (null when unset), and the Form of the forward.
template <class Form, class TX, class TY, class TG, class TD>
struct NormBackward {
  ConstRowRef<TX> x;
  ConstRowRef<TY> dy;
  const TG* gamma;  // null: γ' = 1
  double eps;

  /// dx of row t into d (d elements of TD), with z of the row left in z (d doubles).
  void row(Index t, TD* d, double* z) const {
    const Index n = x.cols();
    if (n == 0) return;
    const TX* xr = x.data() + t * x.outerStride();
    const TY* dyr = dy.data() + t * dy.outerStride();
    using ZForm = NormForm<Form::kCentered, NormScale::kNone, false>;
    const float* none = nullptr;
    norm_row<ZForm>(xr, none, none, eps, z, n, NextRows<TX>{});
    const double sigma = norm_sigma<Form::kCentered>(xr, n, eps);
    const auto g = [&](Index j) {
      return norm_affine<NormForm<false, Form::kScale, false>>(static_cast<double>(dyr[j]), gamma,
                                                               none, j);
    };
    const double count = static_cast<double>(n);
    const double mean_g = Form::kCentered ? lane_sum<double>(n, g) / count : 0.0;
    const double mean_gz = lane_sum<double>(n, [&](Index j) { return g(j) * z[j]; }) / count;
    for (Index j = 0; j < n; ++j) d[j] = round_to<TD>((g(j) - mean_g - z[j] * mean_gz) / sigma);
  }
};

/// A gradient vector that a norm's backward writes (dγ, dβ): an Eigen vector expression, written
/// through a contiguous Ref (the primary template), or std::nullopt, not asked for.
template <class V, bool = std::is_same_v<V, std::nullopt_t>>
class NormGradientVector {
 public:
  static_assert(V::IsVectorAtCompileTime, "norm gradients are vectors or std::nullopt");
  using Scalar = typename V::Scalar;
  explicit NormGradientVector(const V& v) : ref_(const_cast<V&>(v)) {
    require_storage_type<Scalar>();
  }
  Scalar* data() const { return ref_.data(); }
  Index size() const { return ref_.size(); }
  ByteSpan span() const { return vector_span(ref_); }
  void check(const char* op, const char* name, Index d) const {
    check_norm_vector_length(op, name, ref_.size(), d);
  }

 private:
  mutable VectorRef<Scalar> ref_;
};

template <class V>
class NormGradientVector<V, true> {
 public:
  using Scalar = double;
  explicit NormGradientVector(std::nullopt_t /*unset*/) {}
  double* data() const { return nullptr; }
  ByteSpan span() const { return {}; }
  void check(const char* /*op*/, const char* /*name*/, Index /*d*/) const {}
};

/// The checks of a norm's backward, before anything is written: ε, γ's length, the shapes of
/// d_out and dx, the lengths of the gradient vectors asked for, and that nothing written
/// overlaps anything read or anything else written.
template <class TX, class TY, class TD, class DG, class DB>
void check_norm_backward(const char* op, double eps, Index gamma_size, ByteSpan gamma,
                         const ConstRowRef<TX>& x, const ConstRowRef<TY>& dy, const RowRef<TD>& dx,
                         const DG& d_gamma, const DB& d_beta) {
  check_norm_eps(op, eps);
  if (gamma_size >= 0) check_norm_vector_length(op, "gamma", gamma_size, x.cols());
  APEX_CHECK(dy.rows() == x.rows() && dy.cols() == x.cols(),
             "[" << op << "] d_out (" << dy.rows() << " x " << dy.cols() << ") must be " << x.rows()
                 << " x " << x.cols() << " like x");
  check_norm_shape(op, "d_x", x, dx);
  d_gamma.check(op, "d_gamma", x.cols());
  d_beta.check(op, "d_beta", x.cols());
  const ByteSpan written[] = {matrix_span(dx), d_gamma.span(), d_beta.span()};
  const char* names[] = {"d_x", "d_gamma", "d_beta"};
  for (int w = 0; w < 3; ++w) {
    check_norm_disjoint(op, names[w], written[w], "x", matrix_span(x));
    check_norm_disjoint(op, names[w], written[w], "d_out", matrix_span(dy));
    check_norm_disjoint(op, names[w], written[w], "gamma", gamma);
    for (int o = w + 1; o < 3; ++o)
      check_norm_disjoint(op, names[w], written[w], names[o], written[o]);
  }
}

/// Rows of one task of norm_backward_rows: its rows' shares of dγ and dβ are summed in row order
/// into one partial sum per task, and the partial sums in task order, so that the result does
/// not depend on the number of threads.
constexpr Index kNormRowChunk = 64;

/// dx of every row, and dγ = Σ_t dy∘z and dβ = Σ_t dy (where not null), threaded over chunks of
/// kNormRowChunk rows. Allocates d doubles of z per chunk and, with dγ or dβ, two partial sums of
/// d doubles per chunk (⌈tokens / 64⌉ · 2d doubles).
template <class Form, class TX, class TY, class TG, class TD, class TDG, class TDB>
void norm_backward_rows(const NormBackward<Form, TX, TY, TG, TD>& nb, RowRef<TD>& dx, TDG* d_gamma,
                        TDB* d_beta) {
  const Index tokens = nb.x.rows();
  const Index n = nb.x.cols();
  const Index chunks = (tokens + kNormRowChunk - 1) / kNormRowChunk;
  const bool sums = d_gamma != nullptr || d_beta != nullptr;
  RowMatrix<double> partial = RowMatrix<double>::Zero(sums ? 2 * chunks : 0, n);
  parallel_for(chunks, [&](Index chunk) {
    Eigen::VectorXd z(n);
    const Index end = std::min(tokens, (chunk + 1) * kNormRowChunk);
    for (Index t = chunk * kNormRowChunk; t < end; ++t) {
      nb.row(t, dx.data() + t * dx.outerStride(), z.data());
      if (!sums) continue;
      const TY* dyr = nb.dy.data() + t * nb.dy.outerStride();
      for (Index j = 0; j < n; ++j) {
        const double dy = static_cast<double>(dyr[j]);
        partial(2 * chunk, j) += dy * z[j];
        partial(2 * chunk + 1, j) += dy;
      }
    }
  });
  for (Index j = 0; j < n && sums; ++j) {
    double sum_dz = 0.0;
    double sum_d = 0.0;
    for (Index chunk = 0; chunk < chunks; ++chunk) {
      sum_dz += partial(2 * chunk, j);
      sum_d += partial(2 * chunk + 1, j);
    }
    if (d_gamma != nullptr) d_gamma[j] = round_to<TDG>(sum_dz);
    if (d_beta != nullptr) d_beta[j] = round_to<TDB>(sum_d);
  }
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
