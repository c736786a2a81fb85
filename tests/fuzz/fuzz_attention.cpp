// SPDX-License-Identifier: MIT
// Fuzz target: attention on small random shapes with random masks, in float and double, and
// with K and V stored in half or bfloat16.
//   - SDPA: the tiled kernel (apex::sdpa, and detail::flash_sdpa with random block sizes so
//     that every path runs on small shapes: GEMM and streaming kernels, split-key decoding,
//     partial and skipped blocks) against apex::reference::sdpa as a differential oracle when
//     the inputs are moderate, with a tolerance derived from the size of the scores. Values of
//     keys that no query may see can be NaN or ±inf even then: they must not reach the output.
//   - With extreme values (NaN, ±inf, ±1e30, ±max, denormals) anywhere: no crash and no
//     undefined behaviour, and a query row with no allowed key still gets zeros and lse = -inf.
//   - GroupedQueryAttention::forward against its own projections attended by the reference, and
//     MultiHeadLatentAttention::forward against decompress() attended by the reference; MLA's
//     absorbed decoding against its naive decoding, chunk by chunk.
// Every size is small (at most a few dozen), so nothing needs an allocation cap.
#include <apex/apex.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex::fuzz {
namespace {

/// A [B, H, S, D] tensor in one of the two layouts apex reads: contiguous per head, or token-
/// major (heads side by side in each row, as a projection writes them).
template <class Scalar>
struct Tensor {
  Vector<Scalar> storage;
  HeadsView<Scalar> view;

  Tensor(Index b, Index h, Index s, Index d, bool token_major)
      : storage(Vector<Scalar>::Zero(std::max<Index>(1, b * h * s * d))) {
    view = token_major ? HeadsView<Scalar>::token_major(storage.data(), {b, h, s, d})
                       : HeadsView<Scalar>::contiguous(storage.data(), {b, h, s, d});
  }
  HeadsView<const Scalar> cview() const { return view; }
  Scalar& at(Index b, Index h, Index s, Index d) { return view.head(b, h)(s, d); }
  Scalar at(Index b, Index h, Index s, Index d) const { return view.head(b, h)(s, d); }
};

struct Shape {
  Index batch, kv_heads, group, s_q, s_k, d_qk, d_v;
  Index q_heads() const { return kv_heads * group; }
};

/// What one pair (query row i of head h in batch b, key j) is, structurally.
template <class Scalar>
bool pair_allowed(const AttentionMask<Scalar>& mask, const Shape& sh, Index b, Index h, Index i,
                  Index j) {
  const Index first = mask.positions.first_query_position(sh.s_q, sh.s_k);
  if (!mask.positions.allows(first + i, mask.positions.key_offset + j)) return false;
  return mask.allowed.empty() || mask.allowed.head(b, h)(i, j);
}

/// Small random blocks, so that every path of the kernel runs on small shapes: the GEMM and
/// streaming paths, split-key decoding with a few chunks, partial and skipped blocks.
detail::FlashBlocking random_blocking(Input& in) {
  detail::FlashBlocking blocking;
  blocking.stacked_rows = in.in(1, 24);
  blocking.key_block = in.in(1, 16);
  blocking.stream_rows = in.in(0, 16);
  blocking.stream_key_block = in.in(1, 16);
  blocking.decode_chunk = in.in(1, 16);
  blocking.split_below = in.in(1, 32);
  blocking.partial_budget = in.in(1, 1 << 14);
  return blocking;
}

template <class Scalar>
void sdpa_case(Input& in) {
  Shape sh;
  sh.batch = in.in(1, 2);
  sh.kv_heads = in.in(1, 3);
  sh.group = in.in(1, 3);
  sh.s_q = in.in(0, 12);
  sh.s_k = in.in(0, 40);
  sh.d_qk = in.in(0, 20);
  sh.d_v = in.in(0, 20);
  const Values mode = in.choice(3) == 0 ? Values::kExtreme : Values::kModerate;
  const double bound = in.pick({0.5, 1.0, 4.0});

  Tensor<Scalar> q(sh.batch, sh.q_heads(), sh.s_q, sh.d_qk, in.flag());
  Tensor<Scalar> k(sh.batch, sh.kv_heads, sh.s_k, sh.d_qk, in.flag());
  Tensor<Scalar> v(sh.batch, sh.kv_heads, sh.s_k, sh.d_v, in.flag());

  // The mask: the position rule, maybe a dense boolean mask, maybe an additive bias.
  AttentionMask<Scalar> mask;
  PositionMask& rule = mask.positions;
  rule.causal = in.flag();
  if (rule.causal && in.flag()) rule.window = in.in(1, sh.s_k + 3);
  rule.prefix = in.flag() ? 0 : in.in(0, sh.s_k + 2);
  if (in.flag()) rule.query_offset = in.in(0, sh.s_k + 2);
  rule.key_offset = in.flag() ? 0 : in.in(0, 6);
  BoolMatrix shared_allowed;
  Vector<bool> allowed_storage;
  if (in.choice(3) == 0) {
    const bool per_head = in.flag();
    const Index mb = per_head ? sh.batch : 1, mh = per_head ? sh.q_heads() : 1;
    allowed_storage.resize(std::max<Index>(1, mb * mh * sh.s_q * sh.s_k));
    const int density = in.choice(4);  // 0: mostly forbidden … 3: all allowed
    for (Index i = 0; i < allowed_storage.size(); ++i) {
      allowed_storage(i) = density == 3 || in.choice(4) < density + 1;
    }
    mask.allowed =
        HeadsView<const bool>::contiguous(allowed_storage.data(), {mb, mh, sh.s_q, sh.s_k});
  }
  Vector<Scalar> bias_storage;
  if (in.choice(3) == 0) {
    const bool per_head = in.flag();
    const Index mb = per_head ? sh.batch : 1, mh = per_head ? sh.q_heads() : 1;
    bias_storage.resize(std::max<Index>(1, mb * mh * sh.s_q * sh.s_k));
    for (Index i = 0; i < bias_storage.size(); ++i) {
      bias_storage(i) = in.choice(8) == 0 ? -std::numeric_limits<Scalar>::infinity()
                                          : draw_value<Scalar>(in, mode, 2.0);
    }
    mask.bias = HeadsView<const Scalar>::contiguous(bias_storage.data(), {mb, mh, sh.s_q, sh.s_k});
  }
  SdpaParams params;
  if (in.flag()) params.scale = mode == Values::kExtreme ? in.any_real() : in.real_in(-2.0, 2.0);
  if (in.choice(4) == 0) params.softcap = in.real_in(0.5, 50.0);
  if (params.scale && !std::isfinite(*params.scale)) params.scale = 1.0;
  if (!params.scale && sh.d_qk == 0) params.scale = 1.0;  // 1/√0 is rejected (by design)

  // Values. A key row that no query row of its group may see ("dead") gets NaN or ±inf in K
  // and V now and then, even in moderate mode: skipped keys must not reach the output.
  for (Index b = 0; b < sh.batch; ++b) {
    for (Index h = 0; h < sh.q_heads(); ++h) {
      auto qh = q.view.head(b, h);
      fill(qh, in, mode, bound);
    }
    for (Index g = 0; g < sh.kv_heads; ++g) {
      auto kh = k.view.head(b, g);
      auto vh = v.view.head(b, g);
      fill(kh, in, mode, bound);
      fill(vh, in, mode, bound);
      for (Index j = 0; j < sh.s_k; ++j) {
        bool dead = true;
        for (Index r = 0; dead && r < sh.group; ++r) {
          for (Index i = 0; dead && i < sh.s_q; ++i) {
            dead = !pair_allowed(mask, sh, b, g * sh.group + r, i, j);
          }
        }
        if (!dead || in.choice(3) != 0) continue;
        const Scalar poison = in.pick({std::numeric_limits<Scalar>::quiet_NaN(),
                                       std::numeric_limits<Scalar>::infinity(),
                                       -std::numeric_limits<Scalar>::infinity()});
        if (sh.d_qk > 0) kh(j, in.in(0, sh.d_qk - 1)) = poison;
        if (sh.d_v > 0) vh(j, in.in(0, sh.d_v - 1)) = poison;
      }
    }
  }

  // The reference, then the fast path: the public one or the kernel with random blocking.
  Tensor<Scalar> expected(sh.batch, sh.q_heads(), sh.s_q, sh.d_v, false);
  Tensor<Scalar> expected_lse(sh.batch, sh.q_heads(), sh.s_q, 1, false);
  reference::sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, expected.view,
                          expected_lse.view);
  Tensor<Scalar> out(sh.batch, sh.q_heads(), sh.s_q, sh.d_v, in.flag());
  Tensor<Scalar> lse(sh.batch, sh.q_heads(), sh.s_q, 1, false);
  const bool want_lse = in.flag();
  const bool public_path = in.flag();
  if (public_path) {
    sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, out.view,
                 want_lse ? lse.view : HeadsView<Scalar>());
  } else {
    const detail::FlashBlocking blocking = random_blocking(in);
    detail::flash_sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, out.view,
                               want_lse ? lse.view : HeadsView<Scalar>(), {}, blocking);
    if (std::getenv("APEX_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr,
                   "blocking: stacked_rows %ld key_block %ld stream_rows %ld stream_key_block %ld "
                   "decode_chunk %ld\n",
                   blocking.stacked_rows, blocking.key_block, blocking.stream_rows,
                   blocking.stream_key_block, blocking.decode_chunk);
    }
  }

  if (std::getenv("APEX_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr,
                 "sdpa<%s> B %ld H_kv %ld G %ld S_q %ld S_k %ld d_qk %ld d_v %ld mode %d bound %g "
                 "causal %d window %ld prefix %ld query_offset %ld key_offset %ld allowed %d "
                 "bias %d scale %g softcap %g lse %d\n",
                 sizeof(Scalar) == 4 ? "float" : "double", sh.batch, sh.kv_heads, sh.group, sh.s_q,
                 sh.s_k, sh.d_qk, sh.d_v, static_cast<int>(mode), bound, rule.causal,
                 rule.window.value_or(-1), rule.prefix, rule.query_offset.value_or(-1),
                 rule.key_offset, !mask.allowed.empty(), !mask.bias.empty(),
                 params.scale.value_or(-1), params.softcap, want_lse);
    for (Index b = 0; b < sh.batch; ++b) {
      for (Index g = 0; g < sh.kv_heads; ++g) {
        for (Index j = 0; j < sh.s_k; ++j) {
          const bool bad_k = !k.view.head(b, g).row(j).allFinite();
          const bool bad_v = !v.view.head(b, g).row(j).allFinite();
          if (bad_k || bad_v) {
            std::fprintf(stderr,
                         "  non-finite key/value row: b %ld kv head %ld j %ld (k %d, v %d)\n", b, g,
                         j, bad_k, bad_v);
          }
        }
      }
    }
  }

  // Tolerances: an error of ε·(1 + |score|) in a score moves the softmax weights by about that
  // relative amount, so the output moves by about that times max|v|; the sums over S_k keys and
  // d terms add a few ε each. 16× margin.
  const double eps = static_cast<double>(std::numeric_limits<Scalar>::epsilon());
  const double scale = params.scale
                           ? std::abs(*params.scale)
                           : 1.0 / std::sqrt(static_cast<double>(std::max<Index>(1, sh.d_qk)));
  const double score_bound = scale * static_cast<double>(sh.d_qk) * bound * bound + 2.0;
  const double tol_out =
      16.0 * eps * (score_bound + static_cast<double>(sh.s_k + sh.d_qk) + 1.0) * bound;
  const double tol_lse = 16.0 * eps * (score_bound + static_cast<double>(sh.s_k) + 1.0);

  for (Index b = 0; b < sh.batch; ++b) {
    for (Index h = 0; h < sh.q_heads(); ++h) {
      for (Index i = 0; i < sh.s_q; ++i) {
        bool any_allowed = false;
        for (Index j = 0; j < sh.s_k && !any_allowed; ++j) {
          any_allowed = pair_allowed(mask, sh, b, h, i, j);
        }
        const std::string where = "(b " + std::to_string(b) + ", h " + std::to_string(h) + ", i " +
                                  std::to_string(i) + ")";
        if (!any_allowed) {
          // §6 as the library documents it: no visible key → zeros and lse = -inf, never NaN.
          for (Index c = 0; c < sh.d_v; ++c) {
            APEX_FUZZ_REQUIRE(out.at(b, h, i, c) == Scalar(0),
                              "sdpa: a row with no allowed key is not zero at " + where);
          }
          if (want_lse) {
            APEX_FUZZ_REQUIRE(lse.at(b, h, i, 0) == -std::numeric_limits<Scalar>::infinity(),
                              "sdpa: a row with no allowed key has lse != -inf at " + where);
          }
          continue;
        }
        if (mode == Values::kExtreme) continue;
        const Scalar ref_lse = expected_lse.at(b, h, i, 0);
        if (!std::isfinite(ref_lse)) {
          // Every allowed key was removed by a -inf bias: the reference gives zeros.
          for (Index c = 0; c < sh.d_v; ++c) {
            APEX_FUZZ_REQUIRE(
                out.at(b, h, i, c) == Scalar(0),
                "sdpa: a row whose keys are all biased to -inf is not zero at " + where);
          }
          continue;
        }
        for (Index c = 0; c < sh.d_v; ++c) {
          const double got = static_cast<double>(out.at(b, h, i, c));
          const double want = static_cast<double>(expected.at(b, h, i, c));
          APEX_FUZZ_REQUIRE(std::abs(got - want) <= tol_out,
                            "sdpa: the fast path differs from the reference at " + where +
                                ", column " + std::to_string(c) + ": " + std::to_string(got) +
                                " vs " + std::to_string(want) + " (tolerance " +
                                std::to_string(tol_out) + ")");
        }
        if (want_lse) {
          const double got = static_cast<double>(lse.at(b, h, i, 0));
          APEX_FUZZ_REQUIRE(std::abs(got - static_cast<double>(ref_lse)) <= tol_lse,
                            "sdpa: lse differs from the reference at " + where + ": " +
                                std::to_string(got) + " vs " +
                                std::to_string(static_cast<double>(ref_lse)));
        }
      }
    }
  }
}

/// Classes 1, 3 and 4 of the hardening pass: scores exactly representable in Scalar (q = e_0,
/// k_j = [s_j, …], scale 1) at any magnitude up to where float overflows or double's merges used
/// to lose the chunks' sizes, some keys with -inf scores or underflowing weights whose values are
/// NaN. Every path (public, or random blocks with split keys) must match the reference: out to a
/// tolerance of a few ε (the scores are exact, only exp and the sums round), NaN exactly where
/// the reference has NaN.
template <class Scalar>
void exact_logit_case(Input& in) {
  Shape sh;
  sh.batch = 1;
  sh.kv_heads = in.in(1, 2);
  sh.group = in.in(1, 3);
  sh.s_q = in.in(1, 6);
  sh.s_k = in.in(1, 60);
  sh.d_qk = in.in(1, 4);
  sh.d_v = in.in(1, 4);
  const double magnitude = std::is_same_v<Scalar, float> ? in.pick({1.0, 1e4, 1e30, 1e38, 3e38})
                                                         : in.pick({1.0, 1e4, 1e30, 1e300});
  Tensor<Scalar> q(sh.batch, sh.q_heads(), sh.s_q, sh.d_qk, in.flag());
  Tensor<Scalar> k(sh.batch, sh.kv_heads, sh.s_k, sh.d_qk, in.flag());
  Tensor<Scalar> v(sh.batch, sh.kv_heads, sh.s_k, sh.d_v, in.flag());
  for (Index h = 0; h < sh.q_heads(); ++h) {
    for (Index i = 0; i < sh.s_q; ++i) q.at(0, h, i, 0) = Scalar(1);
  }
  for (Index g = 0; g < sh.kv_heads; ++g) {
    for (Index j = 0; j < sh.s_k; ++j) {
      // A few distinct levels near the magnitude, each exact in Scalar.
      const Scalar level = static_cast<Scalar>(magnitude * (1.0 - 0.125 * in.choice(3)));
      k.at(0, g, j, 0) = in.choice(6) == 0 ? -std::numeric_limits<Scalar>::infinity() : level;
      for (Index c = 0; c < sh.d_v; ++c) v.at(0, g, j, c) = static_cast<Scalar>(in.real_in(-1, 1));
      if (in.choice(8) == 0)
        v.at(0, g, j, in.in(0, sh.d_v - 1)) = std::numeric_limits<Scalar>::quiet_NaN();
    }
  }
  AttentionMask<Scalar> mask;
  mask.positions.causal = in.flag();
  SdpaParams params;
  params.scale = 1.0;
  Tensor<Scalar> expected(1, sh.q_heads(), sh.s_q, sh.d_v, false);
  reference::sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, expected.view);
  Tensor<Scalar> out(1, sh.q_heads(), sh.s_q, sh.d_v, in.flag());
  const detail::FlashBlocking blocking = in.flag() ? random_blocking(in) : detail::FlashBlocking{};
  detail::flash_sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, out.view, {}, {},
                             blocking);
  const double tol = 64.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon()) *
                     static_cast<double>(sh.s_k + 4);
  for (Index h = 0; h < sh.q_heads(); ++h) {
    for (Index i = 0; i < sh.s_q; ++i) {
      for (Index c = 0; c < sh.d_v; ++c) {
        const double got = static_cast<double>(out.at(0, h, i, c));
        const double want = static_cast<double>(expected.at(0, h, i, c));
        const std::string where = "h " + std::to_string(h) + " i " + std::to_string(i) + " c " +
                                  std::to_string(c) + ", magnitude " + std::to_string(magnitude);
        APEX_FUZZ_REQUIRE(std::isnan(got) == std::isnan(want),
                          "exact logits: NaN differs from the reference at " + where);
        if (!std::isnan(want)) {
          APEX_FUZZ_REQUIRE(std::abs(got - want) <= tol, "exact logits: " + std::to_string(got) +
                                                             " vs " + std::to_string(want) +
                                                             " at " + where);
        }
      }
    }
  }
}

/// Class 2: softmax scales and soft-caps of any finite magnitude on moderate inputs. A float call
/// computes in double when float cannot represent them; wherever the reference's scores stay far
/// from a tie its answer is reproduced, and always: no crash, and outputs inside the range of
/// the values (a softmax is a convex combination).
template <class Scalar>
void extreme_parameter_case(Input& in) {
  const Index s_q = in.in(1, 4), s_k = in.in(1, 40), d = in.in(1, 6), d_v = in.in(1, 3);
  Tensor<Scalar> q(1, 1, s_q, d, false), k(1, 1, s_k, d, false), v(1, 1, s_k, d_v, false);
  for (Index i = 0; i < s_q; ++i) {
    for (Index c = 0; c < d; ++c) q.at(0, 0, i, c) = static_cast<Scalar>(in.real_in(-1, 1));
  }
  for (Index j = 0; j < s_k; ++j) {
    for (Index c = 0; c < d; ++c) k.at(0, 0, j, c) = static_cast<Scalar>(in.real_in(-1, 1));
    for (Index c = 0; c < d_v; ++c) v.at(0, 0, j, c) = static_cast<Scalar>(in.real_in(-1, 1));
  }
  SdpaParams params;
  const double exponent = in.real_in(-300, 300);
  if (in.flag()) params.scale = (in.flag() ? 1.0 : -1.0) * std::pow(10.0, exponent);
  if (in.flag()) params.softcap = std::pow(10.0, in.real_in(-300, 300));
  AttentionMask<Scalar> mask;
  Tensor<Scalar> out(1, 1, s_q, d_v, false);
  Tensor<Scalar> expected(1, 1, s_q, d_v, false);
  sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, out.view);
  reference::sdpa<Scalar>(q.cview(), k.cview(), v.cview(), mask, params, expected.view);
  const bool moderate = (!params.scale || std::abs(*params.scale) <= 4.0) ||
                        (params.softcap > 0 && params.softcap <= 4.0);
  for (Index i = 0; i < s_q; ++i) {
    for (Index c = 0; c < d_v; ++c) {
      const double got = static_cast<double>(out.at(0, 0, i, c));
      APEX_FUZZ_REQUIRE(std::isfinite(got) && std::abs(got) <= 1.0 + 1e-6,
                        "extreme parameters: output " + std::to_string(got) +
                            " outside the values' range (scale " +
                            std::to_string(params.scale.value_or(0)) + ", softcap " +
                            std::to_string(params.softcap) + ")");
      if (moderate) {
        const double want = static_cast<double>(expected.at(0, 0, i, c));
        APEX_FUZZ_REQUIRE(std::abs(got - want) <= 1e-4, "extreme parameters: fast " +
                                                            std::to_string(got) + " vs reference " +
                                                            std::to_string(want));
      }
    }
  }
}

/// Plain RoPE on a copy, for the layer oracles (the library's rope() is tested on its own).
template <class Scalar>
RowMatrix<Scalar> rotate(const RopeTable<Scalar>* table, Index offset, Index batch,
                         const RowMatrix<Scalar>& x) {
  if (table == nullptr || x.rows() == 0) return x;
  RowMatrix<Scalar> out = x;
  const Index seq = x.rows() / batch;
  for (Index b = 0; b < batch; ++b) {
    apply_rope(*table, offset, RowRef<Scalar>(out.middleRows(b * seq, seq)));
  }
  return out;
}

template <class Scalar>
void expect_close(const RowMatrix<Scalar>& got, const RowMatrix<Scalar>& want, double tol,
                  const char* what) {
  APEX_FUZZ_REQUIRE(got.rows() == want.rows() && got.cols() == want.cols(), what);
  for (Index i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got.data()[i]);
    const double w = static_cast<double>(want.data()[i]);
    APEX_FUZZ_REQUIRE(std::abs(g - w) <= tol * (1.0 + std::abs(w)),
                      std::string(what) + ": " + std::to_string(g) + " vs " + std::to_string(w));
  }
}

template <class Scalar>
AttentionMask<Scalar> layer_rule(Input& in, Index seq) {
  AttentionMask<Scalar> mask;
  mask.positions.causal = in.flag();
  if (mask.positions.causal && in.flag()) mask.positions.window = in.in(1, seq + 2);
  mask.positions.prefix = in.flag() ? 0 : in.in(0, seq + 1);
  return mask;
}

/// A layer's input: B sequences of S tokens, [B·S, d_model], with moderate values or (one
/// time in three) extreme ones.
template <class Scalar>
struct Tokens {
  Index batch;
  Index seq;
  Values mode;
  RowMatrix<Scalar> x;

  Tokens(Input& in, Index max_batch, Index max_seq, Index d_model)
      : batch(in.in(1, max_batch)),
        seq(in.in(1, max_seq)),
        mode(in.choice(3) == 0 ? Values::kExtreme : Values::kModerate),
        x(batch * seq, d_model) {
    fill(x, in, mode, 1.0);
  }

  /// Decoding: calls step(from, chunk) for consecutive chunks of random lengths n that cover
  /// every sequence, where chunk holds tokens [from, from + n) of each sequence, [B·n, d_model].
  template <class Step>
  void in_chunks(Input& in, Step&& step) const {
    for (Index from = 0; from < seq;) {
      const Index n = in.in(1, seq - from);
      RowMatrix<Scalar> chunk(batch * n, x.cols());
      for (Index b = 0; b < batch; ++b) {
        chunk.middleRows(b * n, n) = x.middleRows(b * seq + from, n);
      }
      step(from, chunk);
      from += n;
    }
  }
};

template <class Scalar>
double layer_tolerance() {
  // Projections, attention and the output projection each round a few times in Scalar.
  return 2048.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon());
}

template <class Scalar>
void gqa_case(Input& in) {
  const auto layer = small_gqa<Scalar>(in, /*max_d_model=*/12, /*max_heads=*/3,
                                       /*max_half_head_dim=*/4, /*max_seed=*/1000);
  const GqaConfig& c = layer.config();
  const Tokens<Scalar> t(in, /*max_batch=*/3, /*max_seq=*/9, c.d_model);
  const AttentionMask<Scalar> mask = layer_rule<Scalar>(in, t.seq);
  AttentionLayerParams<Scalar> params;
  std::optional<RopeTable<Scalar>> table;
  if (in.flag()) {
    RopeParams rp;
    rp.pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
    table.emplace(t.seq + 8, c.head_dim, rp);
    params.rope = &*table;
    params.position_offset = in.in(0, 8);
  }
  if (in.choice(4) == 0) params.attention.softcap = in.real_in(1.0, 30.0);

  if (in.flag()) {
    // Decoding in random chunks with a full or a sliding-window cache must give what forward
    // gives on the whole sequence with the same causal rule (positions start at 0).
    PositionMask rule;
    rule.causal = true;
    const bool ring = in.flag();
    const Index window = in.in(1, t.seq + 1);
    if (ring || in.flag()) rule.window = window;
    AttentionMask<Scalar> whole;
    whole.positions = rule;
    params.position_offset = 0;
    const RowMatrix<Scalar> want = layer.forward(t.x, t.batch, whole, params);
    KvCache<Scalar> full = layer.make_cache(t.batch, t.seq);
    SlidingWindowCache<Scalar> windowed(
        {t.batch, c.num_kv_heads, c.head_dim, window + in.in(0, 2)});
    RowMatrix<Scalar> got(t.batch * t.seq, c.d_model);
    t.in_chunks(in, [&](Index from, const RowMatrix<Scalar>& chunk) {
      params.position_offset = from;
      const RowMatrix<Scalar> part = ring ? layer.forward_cached(chunk, rule, params, windowed)
                                          : layer.forward_cached(chunk, rule, params, full);
      const Index n = chunk.rows() / t.batch;
      for (Index b = 0; b < t.batch; ++b) {
        got.middleRows(b * t.seq + from, n) = part.middleRows(b * n, n);
      }
    });
    if (t.mode == Values::kModerate) {
      expect_close(got, want, layer_tolerance<Scalar>(),
                   ring ? "gqa decoding with a sliding-window cache differs from forward"
                        : "gqa decoding with a full cache differs from forward");
    }
    return;
  }
  const RowMatrix<Scalar> out = layer.forward(t.x, t.batch, mask, params);
  if (t.mode == Values::kExtreme) return;

  // Oracle: the same projections, rotated, attended by the reference, then W_O.
  const auto& w = layer.weights();
  const RowMatrix<Scalar> qm =
      rotate(params.rope, params.position_offset, t.batch, RowMatrix<Scalar>(t.x * w.w_q));
  const RowMatrix<Scalar> km =
      rotate(params.rope, params.position_offset, t.batch, RowMatrix<Scalar>(t.x * w.w_k));
  const RowMatrix<Scalar> vm = t.x * w.w_v;
  RowMatrix<Scalar> concat(t.batch * t.seq, c.num_q_heads * c.head_dim);
  reference::sdpa<Scalar>(
      HeadsView<const Scalar>::token_major(qm.data(), {t.batch, c.num_q_heads, t.seq, c.head_dim}),
      HeadsView<const Scalar>::token_major(km.data(), {t.batch, c.num_kv_heads, t.seq, c.head_dim}),
      HeadsView<const Scalar>::token_major(vm.data(), {t.batch, c.num_kv_heads, t.seq, c.head_dim}),
      mask, params.attention,
      HeadsView<Scalar>::token_major(concat.data(), {t.batch, c.num_q_heads, t.seq, c.head_dim}));
  const RowMatrix<Scalar> want = concat * w.w_o;
  expect_close(out, want, layer_tolerance<Scalar>(), "gqa forward differs from its oracle");
}

template <class Scalar>
void mla_case(Input& in) {
  const auto layer = small_mla<Scalar>(in, /*max_d_model=*/10, /*max_latent=*/6,
                                       /*max_head_dim=*/4, /*max_seed=*/1000);
  const MlaConfig& c = layer.config();
  const Tokens<Scalar> t(in, /*max_batch=*/2, /*max_seq=*/8, c.d_model);
  RopeParams rp;
  rp.pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  const RopeTable<Scalar> table(t.seq + 8, c.rope_dim, rp);
  AttentionLayerParams<Scalar> params;
  params.rope = &table;

  if (in.flag()) {
    // Prefill: forward against decompress() attended by the reference.
    const AttentionMask<Scalar> mask = layer_rule<Scalar>(in, t.seq);
    params.position_offset = in.in(0, 8);
    const RowMatrix<Scalar> out = layer.forward(t.x, t.batch, mask, params);
    if (t.mode == Values::kExtreme) return;
    const ProjectedQkv<Scalar> p = layer.decompress(t.x, t.batch, params);
    SdpaParams attention = params.attention;
    attention.scale = 1.0 / std::sqrt(static_cast<double>(c.qk_dim()));
    RowMatrix<Scalar> concat(t.batch * t.seq, c.num_q_heads * c.head_dim);
    reference::sdpa<Scalar>(
        p.q_heads(), p.k_heads(), p.v_heads(), mask, attention,
        HeadsView<Scalar>::token_major(concat.data(), {t.batch, c.num_q_heads, t.seq, c.head_dim}));
    const RowMatrix<Scalar> want = concat * layer.weights().w_o;
    expect_close(out, want, layer_tolerance<Scalar>(), "mla forward differs from its oracle");
    return;
  }

  // Decoding: the same chunks through the naive and the absorbed path must agree.
  MlaAbsorbParams fold;
  fold.query = in.pick({MlaFold::kAuto, MlaFold::kFactored, MlaFold::kMultiplied});
  fold.output = in.pick({MlaFold::kAuto, MlaFold::kFactored, MlaFold::kMultiplied});
  const MlaAbsorbedWeights<Scalar> absorbed = absorb_mla_weights(layer, fold);
  LatentCache<Scalar> naive_cache = layer.make_cache(t.batch, t.seq);
  LatentCache<Scalar> absorbed_cache = layer.make_cache(t.batch, t.seq);
  PositionMask rule;
  rule.causal = true;
  if (in.flag()) rule.window = in.in(1, t.seq + 1);
  t.in_chunks(in, [&](Index from, const RowMatrix<Scalar>& chunk) {
    params.position_offset = from;
    const RowMatrix<Scalar> naive = layer.forward_cached(chunk, rule, params, naive_cache);
    const RowMatrix<Scalar> fast =
        layer.forward_absorbed(chunk, rule, params, absorbed, absorbed_cache);
    if (t.mode == Values::kModerate) {
      expect_close(fast, naive, layer_tolerance<Scalar>(),
                   "mla absorbed decoding differs from naive decoding");
    }
  });
}

/// 16-bit storage (issue: attention on half and bfloat16 K/V): float queries against K and V in
/// half or bfloat16, moderate or extreme values (a float beyond half's range becomes an infinity
/// there), any mask rule and blocking. Widening is exact and the arithmetic is the float
/// kernel's, so the output must be bit for bit that of the float call on the widened values.
template <class T>
void sixteen_bit_case(Input& in) {
  Shape sh;
  sh.batch = in.in(1, 2);
  sh.kv_heads = in.in(1, 2);
  sh.group = in.in(1, 3);
  sh.s_q = in.in(0, 10);
  sh.s_k = in.in(0, 40);
  sh.d_qk = in.in(1, 16);
  sh.d_v = in.in(0, 16);
  const Values mode = in.choice(3) == 0 ? Values::kExtreme : Values::kModerate;
  Tensor<float> q(sh.batch, sh.q_heads(), sh.s_q, sh.d_qk, in.flag());
  Tensor<float> k(sh.batch, sh.kv_heads, sh.s_k, sh.d_qk, false);
  Tensor<float> v(sh.batch, sh.kv_heads, sh.s_k, sh.d_v, false);
  Tensor<T> k16(sh.batch, sh.kv_heads, sh.s_k, sh.d_qk, false);
  Tensor<T> v16(sh.batch, sh.kv_heads, sh.s_k, sh.d_v, false);
  fill(q.storage, in, mode, 2.0);
  fill(k.storage, in, mode, 2.0);
  fill(v.storage, in, mode, 2.0);
  // The same (contiguous) layout: element i of the storage is the same element of both.
  for (Index i = 0; i < k.storage.size(); ++i) {
    k16.storage(i) = round_to<T>(k.storage(i));
    k.storage(i) = static_cast<float>(k16.storage(i));
  }
  for (Index i = 0; i < v.storage.size(); ++i) {
    v16.storage(i) = round_to<T>(v.storage(i));
    v.storage(i) = static_cast<float>(v16.storage(i));
  }
  AttentionMask<float> mask;
  mask.positions.causal = in.flag();
  if (mask.positions.causal && in.flag()) mask.positions.window = in.in(1, sh.s_k + 3);
  if (in.flag()) mask.positions.query_offset = in.in(0, sh.s_k + 2);
  SdpaParams params;
  if (in.choice(4) == 0) params.softcap = in.real_in(0.5, 50.0);
  const detail::FlashBlocking blocking = in.flag() ? detail::FlashBlocking{} : random_blocking(in);
  Tensor<float> got(sh.batch, sh.q_heads(), sh.s_q, sh.d_v, false);
  Tensor<float> want(sh.batch, sh.q_heads(), sh.s_q, sh.d_v, false);
  Tensor<float> got_lse(sh.batch, sh.q_heads(), sh.s_q, 1, false);
  Tensor<float> want_lse(sh.batch, sh.q_heads(), sh.s_q, 1, false);
  detail::flash_sdpa<float, T, T, float, float>(q.cview(), k16.cview(), v16.cview(), mask, params,
                                                got.view, got_lse.view, {}, blocking);
  detail::flash_sdpa<float>(q.cview(), k.cview(), v.cview(), mask, params, want.view, want_lse.view,
                            {}, blocking);
  const auto same = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
  for (Index i = 0; i < got.storage.size(); ++i) {
    APEX_FUZZ_REQUIRE(same(got.storage(i), want.storage(i)),
                      "sdpa: 16-bit K/V differ from float K/V holding the same values at element " +
                          std::to_string(i));
  }
  for (Index i = 0; i < got_lse.storage.size(); ++i) {
    APEX_FUZZ_REQUIRE(same(got_lse.storage(i), want_lse.storage(i)),
                      "sdpa: 16-bit K/V give another lse at row " + std::to_string(i));
  }
}

/// A user mask rule whose block classifier lies (or tells the truth, or answers a value that is
/// no BlockCoverage), on random block sizes so that every path asks it: no crash, no undefined
/// behaviour, and finite inputs give finite outputs whatever it says; verify_classifier reports
/// no violation for the honest classifier, and its run equals the rule without a classifier bit
/// for bit, lie or not.
template <class Scalar>
void lying_classifier_case(Input& in) {
  Shape sh;
  sh.batch = in.in(1, 2);
  sh.kv_heads = in.in(1, 2);
  sh.group = in.in(1, 3);
  sh.s_q = in.in(0, 12);
  sh.s_k = in.in(0, 40);
  sh.d_qk = in.in(1, 12);
  sh.d_v = in.in(1, 12);
  Tensor<Scalar> q(sh.batch, sh.q_heads(), sh.s_q, sh.d_qk, in.flag());
  Tensor<Scalar> k(sh.batch, sh.kv_heads, sh.s_k, sh.d_qk, in.flag());
  Tensor<Scalar> v(sh.batch, sh.kv_heads, sh.s_k, sh.d_v, in.flag());
  fill(q.storage, in, Values::kModerate, 2.0);
  fill(k.storage, in, Values::kModerate, 2.0);
  fill(v.storage, in, Values::kModerate, 2.0);
  // The pair rule: a pseudo-random pattern of the positions and the head, fixed by a seed.
  const auto seed = static_cast<std::uint64_t>(in.in(0, 1 << 20));
  const int density = in.choice(4);
  const auto mix = [seed](Index a, Index b, Index c, Index d) {
    std::uint64_t x = seed ^ (std::uint64_t(a) * 0x9E3779B97F4A7C15ull) ^
                      (std::uint64_t(b) * 0xC2B2AE3D27D4EB4Full) ^
                      (std::uint64_t(c) * 0x165667B19E3779F9ull) ^ (std::uint64_t(d) << 17);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
  };
  const auto allows = [mix, density](Index b, Index h, Index qp, Index kp) {
    return int(mix(b, h, qp, kp) % 4) <= density;
  };
  // 0: honest (the exact coverage), 1: random answers, 2: values outside the enum too.
  const int honesty = in.choice(3);
  const auto classify = [mix, allows, honesty](Index b, Index h, PositionRange qr,
                                               PositionRange kr) {
    if (honesty == 0) {
      bool any = false, all = true;
      for (Index qp = qr.begin; qp < qr.end; ++qp) {
        for (Index kp = kr.begin; kp < kr.end; ++kp) {
          const bool a = allows(b, h, qp, kp);
          any = any || a;
          all = all && a;
        }
      }
      return !any ? BlockCoverage::kNone : all ? BlockCoverage::kAll : BlockCoverage::kPartial;
    }
    const auto r = static_cast<int>(mix(b + 7, h, qr.begin, kr.begin) % (honesty == 1 ? 3 : 5));
    return static_cast<BlockCoverage>(r);
  };
  const auto rules = mask_rule(allows, classify);
  AttentionMask<Scalar> mask;
  mask.positions.causal = in.flag();
  if (in.flag()) mask.positions.query_offset = in.in(0, sh.s_k + 2);
  const detail::FlashBlocking blocking = in.flag() ? detail::FlashBlocking{} : random_blocking(in);
  const auto run = [&](const auto& with) {
    Tensor<Scalar> out(sh.batch, sh.q_heads(), sh.s_q, sh.d_v, false);
    Tensor<Scalar> lse(sh.batch, sh.q_heads(), sh.s_q, 1, false);
    detail::flash_sdpa<Scalar, Scalar, Scalar, Scalar, Scalar>(q.cview(), k.cview(), v.cview(),
                                                               mask, SdpaParams{}, out.view,
                                                               lse.view, {}, blocking, with);
    return std::make_pair(std::move(out), std::move(lse));
  };
  const auto [out, lse] = run(rules);
  for (Index i = 0; i < out.storage.size(); ++i) {
    APEX_FUZZ_REQUIRE(std::isfinite(out.storage(i)),
                      "a lying classifier made a finite input's output non-finite");
  }
  for (Index i = 0; i < lse.storage.size(); ++i) {
    APEX_FUZZ_REQUIRE(!std::isnan(lse.storage(i)), "a lying classifier made lse NaN");
  }
  ClassifierReport report;
  const auto [checked, checked_lse] = run(verify_classifier(rules, report));
  const auto [plain, plain_lse] = run(mask_rule(allows));
  APEX_FUZZ_REQUIRE(honesty != 0 || report.ok(),
                    "verify_classifier reported an honest classifier: " + report.message());
  APEX_FUZZ_REQUIRE(same_bits(checked.storage, plain.storage) &&
                        same_bits(checked_lse.storage, plain_lse.storage),
                    "verify_classifier's run differs from the rule without a classifier");
}

/// The checks of this target: SDPA (random, exact large logits, extreme parameters, 16-bit K/V)
/// takes most of the inputs, the two layers the rest.
template <class Scalar>
constexpr Check kChecks[] = {
    sdpa_case<Scalar>,
    sdpa_case<Scalar>,
    exact_logit_case<Scalar>,
    extreme_parameter_case<Scalar>,
    gqa_case<Scalar>,
    mla_case<Scalar>,
    sixteen_bit_case<
        std::conditional_t<std::is_same_v<Scalar, float>, Eigen::half, Eigen::bfloat16>>,
    lying_classifier_case<Scalar>};

}  // namespace
}  // namespace apex::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace apex::fuzz;
  return run_checks(data, size, kChecks<float>, kChecks<double>);
}
