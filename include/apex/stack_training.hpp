// SPDX-License-Identifier: MIT
// Training the APEX-1 stack (stack.hpp): its parameters as one value, a forward pass that keeps
// what the backward pass needs, the backward pass from the logits' gradient to every parameter,
// the cross-entropy loss on the tied head's logits, and the AdamW optimiser.
//
//   forward:   x_0 = Embed(tokens)·√d,  x_{l+1} = x_l + Attn_l(RMSNorm(x_l; γ_l)),
//              logits = RMSNorm(x_L; γ_f)·W_Eᵀ                      (kept: x_0 … x_L)
//   backward:  dh, dW_E = lm_head_backward(d_logits);  dx_L, dγ_f = rms_norm_backward(dh)
//              for l = L−1 … 0:  dn, dW_l = Attn_l.backward(RMSNorm(x_l), dx_{l+1})
//                                dx_l = dx_{l+1} + rms_norm_backward(x_l; γ_l, dn)   (and dγ_l)
//              dW_E += embed_backward(tokens, dx_0)                   (the tied table's two uses)
//
// MEMORY. The forward keeps the L + 1 residual streams x_l, (L + 1)·B·S·d scalars, and the
// backward recomputes each block's norm, projections and attention from x_l (a layer's
// backward, gqa.hpp and mla.hpp): one forward pass more per step, and at any time the tensors of
// one layer only. Every result is bit-identical for any number of threads.
#pragma once

#include <apex/config.hpp>
#include <apex/embedding.hpp>
#include <apex/gqa.hpp>
#include <apex/mla.hpp>
#include <apex/rms_norm.hpp>
#include <apex/stack.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace apex {

/// Every parameter of an AttentionStack in one value, laid out as the stack holds them: the
/// weights of a stack (stack_parameters, stack_from_parameters), its gradients (stack_backward)
/// and an optimiser's moments (AdamW) all take this shape.
template <class Scalar, class Weight = Scalar>
struct StackParameters {
  RowMatrix<Weight> embedding;              ///< W_E [V, d], the tied table
  std::vector<Vector<Scalar>> norm_gammas;  ///< γ_l [d] of each block's RMSNorm
  Vector<Scalar> final_gamma;               ///< γ [d] of the final RMSNorm
  /// Layer l's weights: GqaWeights for a local layer, MlaWeights for a global one.
  std::vector<std::variant<GqaWeights<Weight>, MlaWeights<Weight>>> layers;
};

/// The parameters of a stack (copies). Allocates them.
template <class Scalar, class Weight>
StackParameters<Scalar, Weight> stack_parameters(const AttentionStack<Scalar, Weight>& stack) {
  detail::check_stack_constructed(stack.config());
  detail::check_dense_stack(stack.config(), "stack_parameters");
  StackParameters<Scalar, Weight> p{stack.embedding(), {}, stack.final_gamma(), {}};
  for (Index l = 0; l < stack.config().num_layers; ++l) {
    p.norm_gammas.push_back(stack.norm_gamma(l));
    std::visit([&](const auto& layer) { p.layers.emplace_back(layer.weights()); }, stack.layer(l));
  }
  return p;
}

/// A stack of `config` with the given parameters (checked as the stack's constructor checks
/// them). Allocates the stack.
template <class Scalar, class Weight>
AttentionStack<Scalar, Weight> stack_from_parameters(const StackConfig& config,
                                                     StackParameters<Scalar, Weight> p) {
  using Stack = AttentionStack<Scalar, Weight>;
  detail::check_dense_stack(config, "stack_from_parameters");
  std::vector<typename Stack::Layer> layers;
  for (std::size_t l = 0; l < p.layers.size(); ++l) {
    if (auto* gqa = std::get_if<GqaWeights<Weight>>(&p.layers[l])) {
      layers.emplace_back(typename Stack::Gqa(config.local, std::move(*gqa)));
    } else {
      layers.emplace_back(
          typename Stack::Mla(config.global, std::move(std::get<MlaWeights<Weight>>(p.layers[l]))));
    }
  }
  return Stack(config, std::move(p.embedding), std::move(p.norm_gammas), std::move(p.final_gamma),
               std::move(layers));
}

/// What stack_backward needs of a forward pass: the tokens, the prefix and the residual
/// streams x_0 … x_L ([B*S, d] each).
template <class Scalar>
struct StackActivations {
  TokenMatrix tokens;                        ///< [B, S]
  Index prefix = 0;                          ///< P, the bidirectional prefix
  std::vector<RowMatrix<Scalar>> residuals;  ///< x_0 … x_L
};

/// The stack's forward pass (AttentionStack::forward, the same logits bit for bit) keeping the
/// residual streams for stack_backward in `saved`. tokens: [B, S] ids -> logits [B*S, V].
/// Allocates what forward allocates and (L + 1)·B·S·d scalars in `saved`.
template <class Scalar, class Weight, class TokensDerived>
RowMatrix<Scalar> stack_forward(const AttentionStack<Scalar, Weight>& stack,
                                const Eigen::MatrixBase<TokensDerived>& tokens, Index prefix,
                                StackActivations<Scalar>& saved) {
  detail::check_stack_constructed(stack.config());
  detail::check_dense_stack(stack.config(), "stack_forward");
  const Index batch = tokens.rows();
  detail::check_forward_tokens(stack.config(), batch, tokens.cols(), prefix);
  RowMatrix<Scalar> x = stack.embed_tokens(tokens);  // checks every id
  saved.tokens = tokens.template cast<std::int64_t>();
  saved.prefix = prefix;
  saved.residuals.clear();
  stack.run_blocks(x, [&](Index l, const auto& layer, const RowMatrix<Scalar>& normed,
                          RowMatrix<Scalar>& attended) {
    saved.residuals.push_back(x);
    const AttentionMask<Scalar> mask = stack.mask_for_layer(l, prefix);
    std::visit(
        [&](const auto& attention) {
          attended = attention.forward(normed, batch, mask, stack.block_params(l));
        },
        layer);
  });
  saved.residuals.push_back(x);
  return stack.output_logits(x);
}

/// The backward pass of the stack (see the top of this header): from d_logits = ∂L/∂logits
/// [B*S, V] and what stack_forward saved, the gradient by every parameter into `grads`
/// (resized here; embedding the sum of both uses of the tied table). Throws unless d_logits has
/// the logits' shape and `saved` comes from this stack. Allocates the gradients and, per layer,
/// what its backward allocates.
template <class Scalar, class Weight>
void stack_backward(const AttentionStack<Scalar, Weight>& stack,
                    const StackActivations<Scalar>& saved, const RowMatrix<Scalar>& d_logits,
                    StackParameters<Scalar, Scalar>& grads) {
  const StackConfig& c = stack.config();
  detail::check_stack_constructed(c);
  detail::check_dense_stack(c, "stack_backward");
  const Index rows = saved.tokens.rows() * saved.tokens.cols();
  APEX_CHECK(static_cast<Index>(saved.residuals.size()) == c.num_layers + 1 &&
                 saved.residuals.back().rows() == rows &&
                 saved.residuals.back().cols() == c.d_model,
             "[stack_backward] saved activations (" << saved.residuals.size()
                                                    << " residual streams) are not from a "
                                                       "stack_forward of this stack");
  APEX_CHECK(d_logits.rows() == rows && d_logits.cols() == c.vocab_size,
             "[stack_backward] d_logits shape [" << d_logits.rows() << ", " << d_logits.cols()
                                                 << "] must be [B*S, V] = [" << rows << ", "
                                                 << c.vocab_size << "]");
  const RmsNormParams norm{c.norm_eps};
  const Index batch = saved.tokens.rows();
  const RowMatrix<Scalar>& last = saved.residuals.back();
  RowMatrix<Scalar> normed(rows, c.d_model);
  rms_norm(last, stack.final_gamma(), norm, normed);
  RowMatrix<Scalar> d_normed(rows, c.d_model), dx(rows, c.d_model), d_block(rows, c.d_model);
  grads.embedding.resize(c.vocab_size, c.d_model);
  lm_head_backward(normed, stack.embedding(), d_logits, d_normed, grads.embedding);
  grads.final_gamma.resize(c.d_model);
  rms_norm_backward(last, stack.final_gamma(), norm, d_normed, dx, grads.final_gamma);
  grads.norm_gammas.assign(static_cast<std::size_t>(c.num_layers), Vector<Scalar>(c.d_model));
  grads.layers.clear();
  grads.layers.resize(static_cast<std::size_t>(c.num_layers));
  for (Index l = c.num_layers - 1; l >= 0; --l) {
    const auto at = static_cast<std::size_t>(l);
    const RowMatrix<Scalar>& x = saved.residuals[at];
    stack.block_norm(l, x, normed);
    const AttentionMask<Scalar> mask = stack.mask_for_layer(l, saved.prefix);
    std::visit(
        [&](const auto& attention) {
          using Grads = std::decay_t<decltype(attention.weights())>;
          using ScalarGrads = std::conditional_t<std::is_same_v<Grads, GqaWeights<Weight>>,
                                                 GqaWeights<Scalar>, MlaWeights<Scalar>>;
          ScalarGrads g;
          attention.backward(normed, batch, mask, stack.block_params(l), dx, d_normed, g);
          grads.layers[at] = std::move(g);
        },
        stack.layer(l));
    rms_norm_backward(x, stack.norm_gamma(l), norm, d_normed, d_block, grads.norm_gammas[at]);
    dx += d_block;
  }
  embed_backward(saved.tokens, EmbeddingParams{}, dx, grads.embedding, GradientUpdate::kAdd);
}

// ---------------------------------------------------------------------------------------------
// The loss and the optimiser
// ---------------------------------------------------------------------------------------------

/// The mean cross-entropy of the next-token targets under softmax(logits), and its gradient:
///   L = (1/N) Σ_t [log Σ_v e^(logits[t, v]) − logits[t, targets[t]]],
///   d_logits[t, :] = (softmax(logits[t, :]) − onehot(targets[t])) / N,
/// over the rows whose target is >= 0 (N of them; a target of −1 marks a row without one, whose
/// gradient is zero). logits: [T, V]; targets: T ids in [−1, V); d_logits: [T, V], written.
/// Each row in double, rounded once. Throws (before writing) on a target outside [−1, V) or a
/// shape that does not match. Allocates nothing.
template <class Scalar>
double cross_entropy(const RowMatrix<Scalar>& logits, const std::vector<std::int64_t>& targets,
                     RowMatrix<Scalar>& d_logits) {
  const Index rows = logits.rows();
  const Index vocab = logits.cols();
  APEX_CHECK(static_cast<Index>(targets.size()) == rows,
             "[cross_entropy] targets length (" << targets.size() << ") must be the logits' rows ("
                                                << rows << ")");
  Index counted = 0;
  for (std::size_t t = 0; t < targets.size(); ++t) {
    APEX_CHECK(targets[t] >= -1 && targets[t] < vocab,
               "[cross_entropy] target (" << targets[t] << ") of row " << t
                                          << " must be in [-1, V) = [-1, " << vocab << ")");
    counted += targets[t] >= 0 ? 1 : 0;
  }
  d_logits.resize(rows, vocab);
  const double scale = counted > 0 ? 1.0 / static_cast<double>(counted) : 0.0;
  double loss = 0.0;
  for (Index t = 0; t < rows; ++t) {
    const std::int64_t target = targets[static_cast<std::size_t>(t)];
    if (target < 0) {
      d_logits.row(t).setZero();
      continue;
    }
    const Eigen::Array<double, 1, Eigen::Dynamic> z = logits.row(t).array().template cast<double>();
    const double top = z.maxCoeff();
    const Eigen::Array<double, 1, Eigen::Dynamic> e = (z - top).exp();
    const double sum = e.sum();
    loss += std::log(sum) + top - z(target);
    Eigen::Array<double, 1, Eigen::Dynamic> g = e / sum;
    g(target) -= 1.0;
    d_logits.row(t) = (g * scale).template cast<Scalar>().matrix();
  }
  return loss * scale;
}

/// Parameters of AdamW (Loshchilov and Hutter 2019): decoupled weight decay.
struct AdamWParams {
  double learning_rate = 1e-3;  ///< η
  double beta1 = 0.9;           ///< β₁, the first moment's decay
  double beta2 = 0.999;         ///< β₂, the second moment's decay
  double eps = 1e-8;            ///< ε added to √v̂
  double weight_decay = 0.01;   ///< λ, applied to the matrices only (not to γ or sinks)
};

namespace detail {

/// The tensors of a GQA layer's weights (four matrices; the QK-norm's γ and the sinks where set).
template <class Weight, class F>
void for_each_layer_parameter(GqaWeights<Weight>& w, const GqaWeights<Weight>& g,
                              GqaWeights<Weight>& m, GqaWeights<Weight>& v, const F& f) {
  f(w.w_q, g.w_q, m.w_q, v.w_q, true);
  f(w.w_k, g.w_k, m.w_k, v.w_k, true);
  f(w.w_v, g.w_v, m.w_v, v.w_v, true);
  f(w.w_o, g.w_o, m.w_o, v.w_o, true);
  if (w.qk_norm) {
    f(w.qk_norm->q_gamma, g.qk_norm->q_gamma, m.qk_norm->q_gamma, v.qk_norm->q_gamma, false);
    f(w.qk_norm->k_gamma, g.qk_norm->k_gamma, m.qk_norm->k_gamma, v.qk_norm->k_gamma, false);
  }
  if (!w.sinks.empty()) f(w.sinks, g.sinks, m.sinks, v.sinks, false);
}

/// The tensors of an MLA layer's weights (eight matrices; the sinks where set).
template <class Weight, class F>
void for_each_layer_parameter(MlaWeights<Weight>& w, const MlaWeights<Weight>& g,
                              MlaWeights<Weight>& m, MlaWeights<Weight>& v, const F& f) {
  f(w.w_dkv, g.w_dkv, m.w_dkv, v.w_dkv, true);
  f(w.w_uk, g.w_uk, m.w_uk, v.w_uk, true);
  f(w.w_uv, g.w_uv, m.w_uv, v.w_uv, true);
  f(w.w_dq, g.w_dq, m.w_dq, v.w_dq, true);
  f(w.w_uq, g.w_uq, m.w_uq, v.w_uq, true);
  f(w.w_qr, g.w_qr, m.w_qr, v.w_qr, true);
  f(w.w_kr, g.w_kr, m.w_kr, v.w_kr, true);
  f(w.w_o, g.w_o, m.w_o, v.w_o, true);
  if (!w.sinks.empty()) f(w.sinks, g.sinks, m.sinks, v.sinks, false);
}

/// Calls f(w, g, m, v, decay) for every tensor of four StackParameters of one layout: the
/// embedding and each layer's matrices with decay = true, every γ and the sinks with false.
template <class P, class F>
void for_each_parameter(P& w, const P& g, P& m, P& v, const F& f) {
  f(w.embedding, g.embedding, m.embedding, v.embedding, true);
  for (std::size_t l = 0; l < w.norm_gammas.size(); ++l) {
    f(w.norm_gammas[l], g.norm_gammas[l], m.norm_gammas[l], v.norm_gammas[l], false);
  }
  f(w.final_gamma, g.final_gamma, m.final_gamma, v.final_gamma, false);
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    std::visit(
        [&](auto& wl) {
          using L = std::decay_t<decltype(wl)>;
          const L& gl = std::get<L>(g.layers[l]);
          L& ml = std::get<L>(m.layers[l]);
          L& vl = std::get<L>(v.layers[l]);
          for_each_layer_parameter(wl, gl, ml, vl, f);
        },
        w.layers[l]);
  }
}

/// The elements of a tensor (a contiguous Eigen matrix or vector, or a std::vector<double>) as
/// one Eigen array, in place.
template <class T>
auto as_array(T& x) {
  using Element = std::remove_const_t<std::remove_reference_t<decltype(*x.data())>>;
  using Array = Eigen::Array<Element, Eigen::Dynamic, 1>;
  using Map = Eigen::Map<std::conditional_t<std::is_const_v<T>, const Array, Array>>;
  return Map(x.data(), static_cast<Index>(x.size()));
}

}  // namespace detail

/// The AdamW optimiser over a stack's parameters (StackParameters<Scalar>): per element, at step
/// t (from 1),
///   m = β₁m + (1 − β₁)g,  v = β₂v + (1 − β₂)g²,  m̂ = m / (1 − β₁ᵗ),  v̂ = v / (1 − β₂ᵗ),
///   w ← w − η·(m̂ / (√v̂ + ε) + λ·w)      (λ on the matrices only).
/// The moments start at zero on the first step and take the parameters' layout. Allocates them
/// once. Deterministic: element by element, no reductions.
template <class Scalar>
class AdamW {
 public:
  /// An optimiser with the given rates; no step taken, no moments allocated.
  explicit AdamW(const AdamWParams& params = {}) : params_(params) {}

  /// One step: w ← w − η·(m̂ / (√v̂ + ε) + λ·w) for every parameter, g its gradient (the same
  /// layout, as stack_backward writes it).
  void step(StackParameters<Scalar>& w, const StackParameters<Scalar>& g) {
    if (step_ == 0) {
      m_ = zeros_like(w);
      v_ = zeros_like(w);
    }
    ++step_;
    const double c1 = 1.0 - std::pow(params_.beta1, static_cast<double>(step_));
    const double c2 = 1.0 - std::pow(params_.beta2, static_cast<double>(step_));
    const AdamWParams& p = params_;
    detail::for_each_parameter(
        w, g, m_, v_, [&](auto& wt, const auto& gt, auto& mt, auto& vt, bool decay) {
          auto wa = detail::as_array(wt);
          const auto ga = detail::as_array(gt);
          auto ma = detail::as_array(mt);
          auto va = detail::as_array(vt);
          using T = typename std::decay_t<decltype(wa)>::Scalar;
          ma = T(p.beta1) * ma + T(1.0 - p.beta1) * ga;
          va = T(p.beta2) * va + T(1.0 - p.beta2) * ga.square();
          const T lambda = decay ? T(p.weight_decay) : T(0);
          wa -=
              T(p.learning_rate) * ((ma / T(c1)) / ((va / T(c2)).sqrt() + T(p.eps)) + lambda * wa);
        });
  }

  /// Steps taken so far.
  std::int64_t steps() const { return step_; }

 private:
  /// A StackParameters of w's layout, every element zero.
  static StackParameters<Scalar> zeros_like(const StackParameters<Scalar>& w) {
    StackParameters<Scalar> z = w;
    detail::for_each_parameter(z, z, z, z, [](auto& t, const auto&, auto&, auto&, bool) {
      detail::as_array(t).setZero();
    });
    return z;
  }

  AdamWParams params_;
  std::int64_t step_ = 0;
  StackParameters<Scalar> m_, v_;
};

}  // namespace apex
