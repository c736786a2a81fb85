// SPDX-License-Identifier: MIT
// Fuzz target: the parameter and shape validation of every public function. Each input picks
// one entry point and draws its sizes and parameters from the whole Index and double range
// (negative, zero, huge, NaN, ±inf). The contract checked:
//   - the call returns or throws std::invalid_argument whose message starts with "[op] ";
//     any other exception, a crash, an out-of-bounds access, a leak or undefined behaviour
//     (ASan + UBSan) is a finding;
//   - where the rule is simple enough to restate here, a call is accepted exactly when its
//     documented preconditions hold (`valid`), and a valid call's result is sane;
//   - an output passed in is left untouched when the call throws.
// Allocation: see fuzz_common.hpp. Sizes that would make an accepted call allocate more than
// kMaxElements are skipped unless the call is "poisoned" (another argument made invalid on
// purpose), in which case they are passed uncapped and the call must throw before allocating.
#include <apex/apex.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace apex::fuzz {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <class Scalar>
RowMatrix<Scalar> sentinel(Index rows, Index cols) {
  return RowMatrix<Scalar>::Constant(rows, cols, static_cast<Scalar>(-12345.25));
}

bool finite_positive(double x) { return std::isfinite(x) && x > 0.0; }

/// A [B, H, S, D] view over storage owned by the caller, in one of the two layouts apex uses.
/// Negative extents are passed to the view as they are; the storage covers the view when every
/// extent is >= 0 (and holds one element otherwise, so that the view is not "empty").
template <class T>
struct ViewBuffer {
  Eigen::Array<std::remove_const_t<T>, Eigen::Dynamic, 1> storage;
  HeadsView<T> view;
};

template <class Scalar>
ViewBuffer<Scalar> make_view(Input& in, Index b, Index h, Index s, Index d, Values mode) {
  ViewBuffer<Scalar> vb;
  const Index cb = std::max<Index>(b, 0), ch = std::max<Index>(h, 0), cs = std::max<Index>(s, 0),
              cd = std::max<Index>(d, 0);
  vb.storage.resize(std::max<Index>(1, cb * ch * cs * cd));
  for (Index i = 0; i < vb.storage.size(); ++i) vb.storage(i) = draw_value<Scalar>(in, mode, 2.0);
  if (in.flag()) {  // contiguous [B, H, S, D]
    vb.view = HeadsView<Scalar>(vb.storage.data(), {b, h, s, d}, {ch * cs * cd, cs * cd, cd});
  } else {  // token-major [B*S, H*D]
    vb.view = HeadsView<Scalar>(vb.storage.data(), {b, h, s, d}, {cs * ch * cd, cd, ch * cd});
  }
  return vb;
}

/// A small extent for a view: mostly 0 … 4, sometimes negative (which every function taking
/// views must reject).
Index extent(Input& in) { return in.choice(8) == 0 ? in.in(-3, -1) : in.in(0, 4); }

/// The position rule of every mask and attention check here: a window from the whole range.
PositionMask any_rule(Input& in) {
  return any_position_mask(in, /*max_prefix=*/6, /*max_offset=*/8);
}

// ---- §2 embedding -------------------------------------------------------------------------

template <class Scalar>
void embedding(Input& in) {
  RowMatrix<Scalar> table(in.in(0, 6), in.in(0, 5));
  fill(table, in, Values::kExtreme, 4.0);
  TokenMatrix tokens(in.in(0, 3), in.in(0, 4));
  for (Index i = 0; i < tokens.size(); ++i) {
    tokens.data()[i] = in.flag() ? in.in(-1, table.rows()) : in.any_index();
  }
  EmbeddingParams params;
  if (in.flag()) params.scale = in.any_real();
  const Index rows = in.flag() ? tokens.size() : in.in(0, 12);
  const Index cols = in.flag() ? table.cols() : in.in(0, 6);
  bool ids_ok = true;
  for (Index i = 0; i < tokens.size(); ++i) {
    ids_ok = ids_ok && tokens.data()[i] >= 0 && tokens.data()[i] < table.rows();
  }
  const double scale = params.scale.value_or(std::sqrt(static_cast<double>(table.cols())));
  const bool valid =
      ids_ok && std::isfinite(scale) && rows == tokens.size() && cols == table.cols();

  RowMatrix<Scalar> out = sentinel<Scalar>(rows, cols);
  const bool returned = attempt_writing("embed", !valid, out,
                                        [&] { embed(table, tokens, params, RowRef<Scalar>(out)); });
  APEX_FUZZ_REQUIRE(returned == valid, "embed rejected valid arguments");
  if (!returned) return;
  const Scalar factor = static_cast<Scalar>(scale);
  for (Index r = 0; r < out.rows(); ++r) {
    const RowMatrix<Scalar> expected = table.row(tokens.data()[r]) * factor;
    APEX_FUZZ_REQUIRE(same_bits(out.row(r), expected), "embed row differs from table[id]*scale");
  }
  // The other forms take the same path.
  std::vector<std::int64_t> ids(tokens.data(), tokens.data() + tokens.size());
  attempt("embed(vector)", [&] { (void)embed(table, ids, params); });
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic> narrow =
      tokens.template cast<std::int32_t>();
  attempt("embed(int32)", [&] { (void)embed(table, narrow, params); });
}

template <class Scalar>
void lm_head_shapes(Input& in) {
  RowMatrix<Scalar> h(in.in(0, 4), in.in(0, 4));
  RowMatrix<Scalar> table(in.in(0, 5), in.flag() ? h.cols() : in.in(0, 4));
  fill(h, in, Values::kExtreme, 2.0);
  fill(table, in, Values::kExtreme, 2.0);
  const Index rows = in.flag() ? h.rows() : in.in(0, 5);
  const Index cols = in.flag() ? table.rows() : in.in(0, 6);
  const bool valid = h.cols() == table.cols() && rows == h.rows() && cols == table.rows();
  RowMatrix<Scalar> out = sentinel<Scalar>(rows, cols);
  const bool returned =
      attempt_writing("lm_head", !valid, out, [&] { lm_head(h, table, RowRef<Scalar>(out)); });
  APEX_FUZZ_REQUIRE(returned == valid, "lm_head rejected valid arguments");
}

/// a·b·… in 128 bits, saturated at 2^64 (beyond every Index); meaningful for factors >= 0.
__int128 count_product(std::initializer_list<__int128> factors) {
  constexpr __int128 kCap = static_cast<__int128>(1) << 64;
  __int128 product = 1;
  for (const __int128 f : factors) {
    if (f == 0) return 0;
    product = product > kCap / f ? kCap : std::min(product * f, kCap);
  }
  return product;
}

/// The contract of a size or count helper: with every argument >= 0 and a count that fits in
/// 64 bits it returns that count (`exact`, computed here in 128 bits); a negative argument or a
/// count beyond 64 bits is std::invalid_argument. A count of 0 may be rejected too when its
/// other factors overflow if the helper multiplies them first; 4·Π max(|argument|, 1) bounds
/// every partial product a helper forms (no helper has a constant factor above 4).
template <class Call>
void check_count(const char* name, std::initializer_list<Index> arguments, __int128 exact,
                 Call&& call) {
  constexpr auto kMax = static_cast<__int128>(std::numeric_limits<Index>::max());
  bool non_negative = true;
  __int128 partial_bound = 4;
  for (const Index a : arguments) {
    non_negative = non_negative && a >= 0;
    const __int128 m = a < 0 ? -static_cast<__int128>(a) : a;
    partial_bound = std::min(partial_bound * std::max<__int128>(m, 1), kMax + 1);
  }
  const bool must_reject = !non_negative || exact > kMax;
  std::int64_t got = 0;
  const bool returned = attempt(name, must_reject, [&] { got = call(); });
  if (returned) {
    APEX_FUZZ_REQUIRE(got == exact, std::string(name) + " returned " + std::to_string(got) +
                                        " instead of " +
                                        std::to_string(static_cast<std::int64_t>(exact)));
  } else {
    APEX_FUZZ_REQUIRE(must_reject || (exact == 0 && partial_bound > kMax),
                      std::string(name) + " rejected valid arguments");
  }
}

void parameter_counts(Input& in) {
  // Plain arithmetic on sizes drawn from the whole range, where products overflow 64 bits.
  const Index a = in.any_index(), b = in.any_index(), c = in.any_index(), d = in.any_index(),
              e = in.any_index(), f = in.any_index();
  switch (in.choice(7)) {
    case 0:
      check_count("tied_parameters_saved", {a, b}, count_product({a, b}),
                  [&] { return tied_parameters_saved(a, b); });
      break;
    case 1:
      check_count("mha_parameter_count", {a, b, c}, count_product({4, a, b, c}),
                  [&] { return mha_parameter_count(a, b, c); });
      break;
    case 2:
      check_count("gqa_parameter_count", {a, b, c, d},
                  count_product({2, a, b, d}) + count_product({2, a, c, d}),
                  [&] { return gqa_parameter_count(a, b, c, d); });
      break;
    case 3:
      check_count("kv_cache_values_per_token", {a, b}, count_product({2, a, b}),
                  [&] { return kv_cache_values_per_token(a, b); });
      break;
    case 4:
      check_count("kv_cache_bytes", {a, b, c, d, e}, count_product({2, a, b, c, d, e}),
                  [&] { return kv_cache_bytes(a, b, c, d, e); });
      break;
    case 5:
      check_count("sliding_window_cache_bytes", {a, b, c, d, e, f},
                  count_product({2, a, std::min(b, c), d, e, f}),
                  [&] { return sliding_window_cache_bytes(a, b, c, d, e, f); });
      break;
    default:
      // B·S·(d_kv + H_kr·d_r)·bytes
      check_count("latent_cache_bytes", {a, b, c, d, e, f},
                  count_product({a, b, c + count_product({d, e}), f}),
                  [&] { return latent_cache_bytes(a, b, c, d, e, f); });
      break;
  }
}

// ---- §3 RMSNorm ---------------------------------------------------------------------------

template <class Scalar>
void rms_norm_checks(Input& in) {
  const Index tokens = in.in(0, 4);
  const Index d = in.in(0, 6);
  RmsNormParams params;
  params.eps = in.flag() ? 1e-6 : in.any_real();
  Vector<Scalar> gamma(in.flag() ? d : in.in(0, 7));
  for (Index i = 0; i < gamma.size(); ++i) gamma(i) = draw_value<Scalar>(in, Values::kExtreme, 2);
  // x and out live in one buffer so that out can be x itself, disjoint from it, or overlap it.
  std::vector<Scalar> buffer(static_cast<std::size_t>(3 * tokens * d + 8));
  for (auto& v : buffer) v = draw_value<Scalar>(in, Values::kExtreme, 4.0);
  const Index x_at = in.in(0, 4);
  const Eigen::Map<const RowMatrix<Scalar>> x(buffer.data() + x_at, tokens, d);
  const int layout = in.choice(4);
  const Index out_rows = layout == 3 ? in.in(0, 5) : tokens;
  const Index out_cols = layout == 3 ? in.in(0, 7) : d;
  Index out_at = x_at + tokens * d + 1;                                       // disjoint
  if (layout == 1) out_at = x_at;                                             // in place
  if (layout == 2) out_at = x_at + in.in(1, std::max<Index>(1, tokens * d));  // may overlap
  if (out_at + out_rows * out_cols > static_cast<Index>(buffer.size())) return;
  Eigen::Map<RowMatrix<Scalar>> out(buffer.data() + out_at, out_rows, out_cols);

  const bool overlap = layout == 2 && tokens * d > 0 && out_at < x_at + tokens * d;
  const bool valid = std::isfinite(params.eps) && params.eps > 0.0 && gamma.size() == d &&
                     out_rows == tokens && out_cols == d && !overlap;
  const std::vector<Scalar> before = buffer;
  const bool returned =
      attempt("rms_norm", !valid, [&] { rms_norm(x, gamma, params, RowRef<Scalar>(out)); });
  APEX_FUZZ_REQUIRE(returned == valid, "rms_norm rejected valid arguments");
  if (!returned) {
    APEX_FUZZ_REQUIRE(
        std::memcmp(before.data(), buffer.data(), buffer.size() * sizeof(Scalar)) == 0,
        "rms_norm wrote before throwing");
  }
}

// ---- §4 RoPE ------------------------------------------------------------------------------

template <class Scalar>
void check_table(const RopeTable<Scalar>& table, double magnitude) {
  // Rounding to Scalar: relative for normal results, absolute (half a denormal) below them.
  const double limit = magnitude * (1.0 + 4.0 * std::numeric_limits<Scalar>::epsilon()) +
                       static_cast<double>(std::numeric_limits<Scalar>::denorm_min());
  for (Index i = 0; i < table.cos().size(); ++i) {
    const double c = static_cast<double>(table.cos().data()[i]);
    const double s = static_cast<double>(table.sin().data()[i]);
    APEX_FUZZ_REQUIRE(std::isfinite(c) && std::isfinite(s),
                      "a RoPE table accepted by its checks holds a non-finite cos/sin entry");
    APEX_FUZZ_REQUIRE(std::abs(c) <= limit && std::abs(s) <= limit,
                      "a RoPE table entry exceeds its magnitude");
  }
}

template <class Scalar>
void rope_table_checks(Input& in) {
  const bool poison = in.choice(4) == 0;
  Index max_positions = in.any_index();
  Index head_dim = in.any_index();
  RopeParams params;
  params.rotary_dim = in.flag() ? 0 : in.any_index();
  params.base = in.flag() ? 10000.0 : in.any_real();
  params.pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  if (poison) {
    switch (in.choice(3)) {
      case 0:
        params.base = std::numeric_limits<double>::quiet_NaN();
        break;
      case 1:
        max_positions = -in.in(0, 5);
        break;
      default:
        // rotary_dim > head_dim (or an odd head_dim for the whole-head default)
        head_dim = params.rotary_dim == 0  ? 2 * in.in(0, 10) + 1
                   : params.rotary_dim > 2 ? params.rotary_dim - 1
                                           : -1;
        break;
    }
  }
  const Index rd = params.rotary_dim == 0 ? head_dim : params.rotary_dim;
  // The cos and sin tables: 2·max_positions·rotary_dim scalars, which must fit in 64-bit bytes.
  const Bound bound = bound_of({max_positions, rd, 2});
  const bool valid = max_positions >= 1 && rd >= 2 && rd % 2 == 0 && rd <= head_dim &&
                     std::isfinite(params.base) && params.base > 1.0 && bound != Bound::kOverflow;
  if (!poison && !may_call(bound)) return;
  std::optional<RopeTable<Scalar>> table;
  const bool returned = attempt("RopeTable", poison || !valid,
                                [&] { table.emplace(max_positions, head_dim, params); });
  APEX_FUZZ_REQUIRE(returned == valid, "RopeTable rejected valid arguments");
  if (returned) {
    APEX_FUZZ_REQUIRE(table->max_positions() == max_positions && table->rotary_dim() == rd &&
                          table->head_dim() == head_dim,
                      "RopeTable has the wrong shape");
    check_table(*table, 1.0);
  }
}

template <class Scalar>
void rope_from_frequencies(Input& in) {
  const bool poison = in.choice(4) == 0;
  Vector<double> theta(in.in(0, 5));
  for (Index i = 0; i < theta.size(); ++i) theta(i) = in.flag() ? in.real_in(0, 2) : in.any_real();
  Index max_positions = in.flag() ? in.in(0, 40) : in.any_index();
  const Index head_dim = in.flag() ? 2 * theta.size() : in.any_index();
  double magnitude = in.flag() ? 1.0 : in.any_real();
  if (poison) magnitude = in.flag() ? -1.0 : kInf;
  bool theta_ok = theta.size() >= 1;
  for (Index i = 0; i < theta.size(); ++i)
    theta_ok = theta_ok && std::isfinite(theta(i)) && theta(i) >= 0;
  const Bound bound = bound_of({max_positions, 2 * theta.size(), 2});
  // As documented: the tables fit in 64-bit bytes, the magnitude lies in Scalar's normal range
  // and the largest angle (max_positions − 1)·max θ is finite, so that every entry is finite.
  using L = std::numeric_limits<Scalar>;
  const bool valid = theta_ok && max_positions >= 1 && head_dim >= 2 * theta.size() &&
                     bound != Bound::kOverflow && magnitude >= static_cast<double>(L::min()) &&
                     magnitude <= static_cast<double>(L::max()) &&
                     std::isfinite(static_cast<double>(max_positions - 1) * theta.maxCoeff());
  if (!poison && !may_call(bound)) return;
  std::optional<RopeTable<Scalar>> table;
  const bool returned = attempt("RopeTable::from_frequencies", poison || !valid, [&] {
    table.emplace(RopeTable<Scalar>::from_frequencies(
        theta, max_positions, head_dim,
        in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit, magnitude));
  });
  APEX_FUZZ_REQUIRE(returned == valid, "RopeTable::from_frequencies rejected valid arguments");
  if (returned) check_table(*table, magnitude);
}

template <class Scalar>
void rope_from_cos_sin(Input& in) {
  RowMatrix<double> cos(in.in(0, 4), in.in(0, 5));
  RowMatrix<double> sin = in.flag() ? RowMatrix<double>(cos.rows(), cos.cols())
                                    : RowMatrix<double>(in.in(0, 4), in.in(0, 5));
  fill(cos, in, Values::kExtreme, 1.0);
  fill(sin, in, Values::kExtreme, 1.0);
  const Index head_dim = in.flag() ? in.in(0, 12) : in.any_index();
  const RopeCacheWidth width = in.flag() ? RopeCacheWidth::kHalf : RopeCacheWidth::kFull;
  const bool half = width == RopeCacheWidth::kHalf;
  const Index rd = half ? 2 * cos.cols() : cos.cols();
  // Every value finite and within Scalar's range (NaN fails the comparison).
  const auto representable = [](const RowMatrix<double>& m) {
    return (m.array().abs() <= static_cast<double>(std::numeric_limits<Scalar>::max())).all();
  };
  const bool valid = sin.rows() == cos.rows() && sin.cols() == cos.cols() && cos.rows() >= 1 &&
                     cos.cols() >= 1 && (half || cos.cols() % 2 == 0) && rd <= head_dim &&
                     representable(cos) && representable(sin);
  const bool returned = attempt("RopeTable::from_cos_sin", !valid, [&] {
    (void)RopeTable<Scalar>::from_cos_sin(
        cos, sin, head_dim, in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit, width);
  });
  APEX_FUZZ_REQUIRE(returned == valid, "RopeTable::from_cos_sin rejected valid arguments");
}

void rope_frequency_checks(Input& in) {
  const Index rd = in.any_index();
  const double base = in.flag() ? 10000.0 : in.any_real();
  const bool valid = rd >= 2 && rd % 2 == 0 && std::isfinite(base) && base > 1.0;
  if (!may_call(bound_of({rd}))) return;
  Vector<double> theta;
  const bool returned =
      attempt("rope_frequencies", !valid, [&] { theta = rope_frequencies(rd, base); });
  APEX_FUZZ_REQUIRE(returned == valid, "rope_frequencies rejected valid arguments");
  for (Index i = 0; returned && i < theta.size(); ++i) {
    APEX_FUZZ_REQUIRE(std::isfinite(theta(i)) && theta(i) > 0.0 && theta(i) <= 1.0,
                      "rope_frequencies returned a frequency outside (0, 1]");
  }
}

template <class Scalar>
void apply_rope_checks(Input& in) {
  const Index positions = in.in(1, 6);
  const Index rd = 2 * in.in(1, 3);
  const Index head_dim = rd + in.in(0, 2);
  RopeParams params;
  params.rotary_dim = rd;
  params.pairing = in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  const RopeTable<Scalar> table(positions, head_dim, params);
  RowMatrix<Scalar> x(in.in(0, 6), in.flag() ? head_dim * in.in(0, 3) : in.in(0, 12));
  fill(x, in, Values::kExtreme, 3.0);
  const RowMatrix<Scalar> before = x;
  const bool width_ok = x.cols() % head_dim == 0;
  switch (in.choice(5)) {
    case 0: {
      const Index offset = in.flag() ? in.in(-2, positions) : in.any_index();
      const bool valid = width_ok && offset >= 0 &&
                         (x.rows() == 0 || (offset <= positions && x.rows() <= positions - offset));
      const bool returned = attempt_writing("apply_rope(offset)", !valid, x,
                                            [&] { apply_rope(table, offset, RowRef<Scalar>(x)); });
      APEX_FUZZ_REQUIRE(returned == valid, "apply_rope rejected valid arguments");
      if (returned && x.rows() > 0) {
        // Features past the rotary width are never touched.
        for (Index c = 0; c < x.cols(); ++c) {
          if (c % head_dim < rd) continue;
          APEX_FUZZ_REQUIRE(same_bits(x.col(c), before.col(c)),
                            "apply_rope changed a pass-through");
        }
      }
      break;
    }
    case 1: {
      const Index offset = in.flag() ? in.in(-2, positions) : in.any_index();
      attempt("rope(offset)", [&] { (void)rope(table, offset, x); });
      break;
    }
    case 2: {
      Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1> ids(in.flag() ? x.rows() : in.in(0, 7));
      bool ids_ok = true;
      for (Index i = 0; i < ids.size(); ++i) {
        ids(i) = in.flag() ? in.in(-1, positions) : in.any_index();
        ids_ok = ids_ok && ids(i) >= 0 && ids(i) < positions;
      }
      const bool valid = width_ok && ids.size() == x.rows() && ids_ok;
      const bool returned = attempt_writing("apply_rope(ids)", !valid, x,
                                            [&] { apply_rope(table, ids, RowRef<Scalar>(x)); });
      APEX_FUZZ_REQUIRE(returned == valid, "apply_rope(ids) rejected valid arguments");
      break;
    }
    case 3: {
      Eigen::Matrix<std::uint64_t, Eigen::Dynamic, 1> ids(x.rows());
      for (Index i = 0; i < ids.size(); ++i) {
        ids(i) = in.flag() ? static_cast<std::uint64_t>(in.in(0, positions))
                           : static_cast<std::uint64_t>(in.any_index());
      }
      attempt("apply_rope(uint64 ids)", [&] { apply_rope(table, ids, RowRef<Scalar>(x)); });
      break;
    }
    default: {
      Eigen::Matrix<std::int8_t, Eigen::Dynamic, 1> ids(x.rows());
      for (Index i = 0; i < ids.size(); ++i) ids(i) = static_cast<std::int8_t>(in.in(-128, 127));
      attempt("rope(int8 ids)", [&] { (void)rope(table, ids, x); });
      break;
    }
  }
}

// ---- §5 YaRN ------------------------------------------------------------------------------

YarnParams any_yarn(Input& in) {
  YarnParams p;
  p.scale = in.flag() ? in.real_in(1.0, 64.0) : in.any_real();
  p.original_context = in.flag() ? in.in(1, 8192) : in.any_index();
  p.beta_fast = in.flag() ? 32.0 : in.any_real();
  p.beta_slow = in.flag() ? 1.0 : in.any_real();
  p.base = in.flag() ? 10000.0 : in.any_real();
  p.truncate = in.flag();
  if (in.flag()) p.mscale = in.flag() ? in.real_in(-2, 2) : in.any_real();
  if (in.flag()) p.mscale_all_dim = in.flag() ? in.real_in(-2, 2) : in.any_real();
  if (in.flag()) p.attention_factor = in.any_real();
  p.temperature = in.pick({YarnTemperature::kInTables, YarnTemperature::kSoftmaxScale,
                           YarnTemperature::kLogits, YarnTemperature::kNone});
  return p;
}

/// YarnParams as documented: a DeepSeek multiplier m, when set, must be finite and give a
/// temperature get(s, m) that is finite and > 0.
bool yarn_params_valid(const YarnParams& p) {
  const auto multiplier_ok = [&](const std::optional<double>& m) {
    return !m || (std::isfinite(*m) && finite_positive(yarn_mscale(p.scale, *m)));
  };
  return std::isfinite(p.scale) && p.scale >= 1.0 && p.original_context > 0 &&
         finite_positive(p.beta_slow) && std::isfinite(p.beta_fast) && p.beta_fast > p.beta_slow &&
         std::isfinite(p.base) && p.base > 1.0 && multiplier_ok(p.mscale) &&
         multiplier_ok(p.mscale_all_dim) &&
         (!p.attention_factor || finite_positive(*p.attention_factor));
}

template <class Scalar>
void yarn_checks(Input& in) {
  YarnParams p = any_yarn(in);
  Index rd = in.flag() ? 2 * in.in(0, 40) : in.any_index();
  const bool rd_ok = rd >= 2 && rd % 2 == 0;
  const bool valid = yarn_params_valid(p) && rd_ok;
  if (!may_call(bound_of({rd}))) return;
  switch (in.choice(7)) {
    case 0: {
      YarnCorrectionRange range;
      const bool returned =
          attempt("yarn_correction_range", !valid, [&] { range = yarn_correction_range(rd, p); });
      APEX_FUZZ_REQUIRE(returned == valid, "yarn_correction_range rejected valid arguments");
      if (returned) {
        APEX_FUZZ_REQUIRE(std::isfinite(range.low) && std::isfinite(range.high) &&
                              range.low < range.high && range.low >= 0.0,
                          "yarn_correction_range returned an empty or non-finite range for " +
                              describe(p) + ", rotary_dim " + std::to_string(rd));
      }
      break;
    }
    case 1: {
      Vector<double> ramp;
      const bool returned = attempt("yarn_ramp", !valid, [&] { ramp = yarn_ramp(rd, p); });
      APEX_FUZZ_REQUIRE(returned == valid, "yarn_ramp rejected valid arguments");
      for (Index i = 0; returned && i < ramp.size(); ++i) {
        APEX_FUZZ_REQUIRE(ramp(i) >= 0.0 && ramp(i) <= 1.0, "yarn ramp outside [0, 1]");
        if (i > 0) APEX_FUZZ_REQUIRE(ramp(i) >= ramp(i - 1), "yarn ramp decreases");
      }
      break;
    }
    case 2: {
      Vector<double> theta;
      const bool returned =
          attempt("yarn_frequencies", !valid, [&] { theta = yarn_frequencies(rd, p); });
      APEX_FUZZ_REQUIRE(returned == valid, "yarn_frequencies rejected valid arguments");
      if (returned) {
        const Vector<double> plain = rope_frequencies(rd, p.base);
        for (Index i = 0; i < theta.size(); ++i) {
          const double lo = plain(i) / p.scale * (1 - 1e-12);
          const double hi = plain(i) * (1 + 1e-12);
          APEX_FUZZ_REQUIRE(std::isfinite(theta(i)) && theta(i) >= lo && theta(i) <= hi,
                            "a YaRN frequency lies outside [theta/s, theta]: " + describe(p) +
                                ", rotary_dim " + std::to_string(rd) + ", pair " +
                                std::to_string(i) + ": theta' " + std::to_string(theta(i)) +
                                ", theta " + std::to_string(plain(i)));
        }
      }
      break;
    }
    case 3: {
      std::vector<YarnRegime> regimes;
      const bool returned = attempt("yarn_regimes", !valid, [&] { regimes = yarn_regimes(rd, p); });
      APEX_FUZZ_REQUIRE(returned == valid, "yarn_regimes rejected valid arguments");
      if (returned) APEX_FUZZ_REQUIRE(static_cast<Index>(regimes.size()) == rd / 2, "regimes");
      break;
    }
    case 4: {
      // Valid parameters give a factor and a multiplier that are finite and > 0, or are
      // rejected when those overflow or underflow (a ratio or a square of two finite values).
      // With none of the overrides the factor is 0.1·ln(s) + 1 <= 72: always accepted.
      const bool params_ok = yarn_params_valid(p);
      const bool plain = params_ok && !p.attention_factor && !p.mscale && !p.mscale_all_dim;
      double factor = 0, magnitude = 0, multiplier = 0;
      const bool returned = attempt("yarn_attention_factor", !params_ok, [&] {
        factor = yarn_attention_factor(p);
        magnitude = yarn_table_magnitude(p);
        multiplier = yarn_softmax_scale_multiplier(p);
      });
      APEX_FUZZ_REQUIRE(returned || !plain, "yarn_attention_factor rejected valid arguments");
      APEX_FUZZ_REQUIRE(
          !returned || (finite_positive(factor) && finite_positive(magnitude) &&
                        finite_positive(multiplier)),
          "a YaRN attention factor or softmax multiplier is not finite and > 0 for " + describe(p));
      break;
    }
    case 5: {
      const double s = in.any_real();
      const double m = in.any_real();
      attempt("yarn_mscale", [&] { (void)yarn_mscale(s, m); });
      break;
    }
    default: {
      const bool poison = in.choice(3) == 0;
      Index max_positions = in.flag() ? in.in(0, 64) : in.any_index();
      const Index head_dim = in.flag() ? rd + in.in(0, 3) : in.any_index();
      const Index rotary = in.flag() ? 0 : rd;
      if (poison) p.base = -1.0;
      const Index r = rotary == 0 ? head_dim : rotary;
      if (!poison && !may_call(bound_of({max_positions, r, 2}))) return;
      std::optional<RopeTable<Scalar>> table;
      const bool returned = attempt("yarn_table", poison, [&] {
        table.emplace(
            yarn_table<Scalar>(max_positions, head_dim, rotary,
                               in.flag() ? RopePairing::kInterleaved : RopePairing::kHalfSplit, p));
      });
      if (returned) check_table(*table, yarn_table_magnitude(p));
      break;
    }
  }
}

// ---- §10–§11 masks ------------------------------------------------------------------------

void mask_builders(Input& in) {
  switch (in.choice(6)) {
    case 0: {
      const Index w = in.any_index();
      PositionMask m;
      const bool returned =
          attempt("sliding_window_mask", w < 1, [&] { m = sliding_window_mask(w); });
      APEX_FUZZ_REQUIRE(returned == (w >= 1), "sliding_window_mask rejected a valid window");
      break;
    }
    case 1: {
      const Index layer = in.any_index();
      const Index every = in.flag() ? 6 : in.any_index();
      bool global = false;
      const bool valid = layer >= 0 && every >= 1;
      const bool returned =
          attempt("is_global_layer", !valid, [&] { global = is_global_layer(layer, every); });
      APEX_FUZZ_REQUIRE(returned == valid, "is_global_layer rejected valid arguments");
      if (returned) APEX_FUZZ_REQUIRE(global == (layer % every == every - 1), "is_global_layer");
      break;
    }
    case 2: {
      LayerMaskParams p;
      p.prefix = in.any_index();
      p.window = in.any_index();
      p.global_every = in.flag() ? 6 : in.any_index();
      const Index layer = in.any_index();
      attempt("layer_mask", [&] { (void)layer_mask(layer, p); });
      break;
    }
    case 3: {
      const PositionMask m = any_rule(in);
      const Index nq = in.flag() ? in.in(0, 6) : in.any_index();
      const Index nk = in.flag() ? in.in(0, 6) : in.any_index();
      const Bound bound = bound_of({nq, nk});
      if (!may_call(bound)) return;
      if (std::max(nq, nk) > kMaxElements) return;  // S_q × 0 still loops over S_q rows
      const bool valid = position_mask_valid(m, nq, nk) && nq >= 0 && nk >= 0;
      const bool returned =
          attempt("build_mask(mask, S_q, S_k)", !valid, [&] { (void)build_mask(m, nq, nk); });
      APEX_FUZZ_REQUIRE(returned == valid, "build_mask rejected valid arguments");
      break;
    }
    case 4: {
      LayerMaskParams p;
      p.prefix = in.flag() ? in.in(0, 8) : in.any_index();
      p.window = in.flag() ? in.in(0, 8) : in.any_index();
      p.global_every = in.flag() ? in.in(1, 7) : in.any_index();
      const Index layer = in.flag() ? in.in(0, 13) : in.any_index();
      const Index s = in.flag() ? in.in(0, 12) : in.any_index();
      const Bound bound = bound_of({s, s});
      if (!may_call(bound)) return;
      attempt("build_mask(layer, S)", [&] { (void)build_mask(layer, s, p); });
      break;
    }
    default: {
      BoolMatrix mask(in.in(0, 12), in.in(0, 12));
      for (Index i = 0; i < mask.size(); ++i) mask.data()[i] = in.flag();
      std::vector<Index> rows(static_cast<std::size_t>(in.in(0, 4)));
      bool valid = true;
      for (Index& r : rows) {
        r = in.flag() ? in.in(-1, mask.rows()) : in.any_index();
        valid = valid && r >= 0 && r < mask.rows();
      }
      const bool returned = attempt("render_mask", !valid, [&] { (void)render_mask(mask, rows); });
      APEX_FUZZ_REQUIRE(returned == valid, "render_mask rejected valid rows");
      break;
    }
  }
}

// ---- §6 SDPA, merge, heads ----------------------------------------------------------------

template <class Scalar>
void sdpa_checks(Input& in) {
  const Index b = extent(in), hkv = extent(in), s_k = extent(in), d = extent(in);
  const Index hq = in.flag() ? hkv * in.in(1, 3) : extent(in);
  const Index s_q = in.flag() ? s_k : extent(in);
  const Index d_v = in.flag() ? d : extent(in);
  auto q = make_view<const Scalar>(in, b, hq, s_q, d, Values::kExtreme);
  auto k = make_view<const Scalar>(in, in.flag() ? b : extent(in), hkv, s_k,
                                   in.flag() ? d : extent(in), Values::kExtreme);
  auto v = make_view<const Scalar>(in, in.flag() ? b : extent(in), in.flag() ? hkv : extent(in),
                                   in.flag() ? s_k : extent(in), d_v, Values::kExtreme);
  AttentionMask<Scalar> mask;
  mask.positions = any_rule(in);
  ViewBuffer<const bool> allowed;
  ViewBuffer<const Scalar> bias;
  if (in.flag()) {
    const Index mb = in.flag() ? 1 : extent(in), mh = in.flag() ? 1 : extent(in);
    const Index cb = std::max<Index>(mb, 0), ch = std::max<Index>(mh, 0);
    const Index rows = in.flag() ? s_q : extent(in), cols = in.flag() ? s_k : extent(in);
    allowed.storage.resize(
        std::max<Index>(1, cb * ch * std::max<Index>(rows, 0) * std::max<Index>(cols, 0)));
    for (Index i = 0; i < allowed.storage.size(); ++i) allowed.storage(i) = in.flag();
    const Index cr = std::max<Index>(rows, 0), cc = std::max<Index>(cols, 0);
    allowed.view = HeadsView<const bool>(allowed.storage.data(), {mb, mh, rows, cols},
                                         {ch * cr * cc, cr * cc, cc});
  }
  if (in.flag()) {
    bias = make_view<const Scalar>(in, in.flag() ? 1 : extent(in), in.flag() ? 1 : extent(in),
                                   in.flag() ? s_q : extent(in), in.flag() ? s_k : extent(in),
                                   Values::kExtreme);
  }
  mask.allowed = allowed.view;
  mask.bias = bias.view;
  SdpaParams params;
  if (in.flag()) params.scale = in.any_real();
  if (in.flag()) params.softcap = in.any_real();
  auto out = make_view<Scalar>(in, in.flag() ? b : extent(in), in.flag() ? hq : extent(in),
                               in.flag() ? s_q : extent(in), in.flag() ? d_v : extent(in),
                               Values::kModerate);
  ViewBuffer<Scalar> lse;
  if (in.flag()) {
    lse = make_view<Scalar>(in, in.flag() ? b : extent(in), in.flag() ? hq : extent(in),
                            in.flag() ? s_q : extent(in), in.flag() ? 1 : extent(in),
                            Values::kModerate);
  }
  const bool fast = in.flag();
  const bool returned = attempt_writing(fast ? "sdpa" : "reference::sdpa", false, out.storage, [&] {
    if (fast) {
      sdpa<Scalar>(q.view, k.view, v.view, mask, params, out.view, lse.view);
    } else {
      reference::sdpa<Scalar>(q.view, k.view, v.view, mask, params, out.view, lse.view);
    }
  });
  if (!returned) return;
  // An accepted call had consistent, non-negative shapes.
  APEX_FUZZ_REQUIRE(b >= 0 && hq >= 0 && hkv >= 1 && s_q >= 0 && s_k >= 0 && d >= 0 && d_v >= 0,
                    "sdpa accepted a view with a negative extent or no key/value head");
}

template <class Scalar>
void merge_checks(Input& in) {
  const Index rows = in.in(0, 4), cols = in.in(0, 4);
  RowMatrix<Scalar> a(rows, cols),
      bm(in.flag() ? rows : in.in(0, 4), in.flag() ? cols : in.in(0, 4));
  Vector<Scalar> la(in.flag() ? rows : in.in(0, 5)), lb(in.flag() ? rows : in.in(0, 5));
  fill(a, in, Values::kExtreme);
  fill(bm, in, Values::kExtreme);
  for (Index i = 0; i < la.size(); ++i) la(i) = draw_value<Scalar>(in, Values::kExtreme, 30);
  for (Index i = 0; i < lb.size(); ++i) lb(i) = draw_value<Scalar>(in, Values::kExtreme, 30);
  RowMatrix<Scalar> out =
      sentinel<Scalar>(in.flag() ? rows : in.in(0, 5), in.flag() ? cols : in.in(0, 5));
  Vector<Scalar> lse = Vector<Scalar>::Constant(in.flag() ? rows : in.in(0, 5), Scalar(7));
  const bool valid = bm.rows() == rows && bm.cols() == cols && la.size() == rows &&
                     lb.size() == rows && out.rows() == rows && out.cols() == cols &&
                     lse.size() == rows;
  const bool returned = attempt_writing("merge_attention", !valid, out, [&] {
    merge_attention(a, la, bm, lb, RowRef<Scalar>(out), VectorRef<Scalar>(lse));
  });
  APEX_FUZZ_REQUIRE(returned == valid, "merge_attention rejected valid arguments");
}

template <class Scalar>
void heads_checks(Input& in) {
  RowMatrix<Scalar> x(in.in(0, 6), in.in(0, 6));
  fill(x, in, Values::kModerate);
  const Index batch = in.flag() ? in.in(0, 3) : in.any_index();
  const Index heads = in.flag() ? in.in(0, 3) : in.any_index();
  if (in.choice(5) == 0) {
    // Class 6: the factories multiply extents into strides; a product beyond 64 bits must be
    // rejected, not wrapped.
    const HeadsShape shape{in.any_index(), in.any_index(), in.any_index(), in.any_index()};
    Scalar x0 = 0;
    const bool token_major = in.flag();
    HeadsView<Scalar> view;
    const bool returned = attempt("HeadsView factory", [&] {
      view = token_major ? HeadsView<Scalar>::token_major(&x0, shape)
                         : HeadsView<Scalar>::contiguous(&x0, shape);
    });
    const bool negative = shape.batch < 0 || shape.heads < 0 || shape.seq < 0 || shape.dim < 0;
    APEX_FUZZ_REQUIRE(!(returned && negative), "a HeadsView factory accepted a negative extent");
    if (returned && !shape.has_no_elements()) {
      APEX_FUZZ_REQUIRE(
          bound_of({shape.batch, shape.heads, shape.seq, shape.dim}) != Bound::kOverflow,
          "a HeadsView factory accepted a shape whose size overflows");
      APEX_FUZZ_REQUIRE(view.batch_stride() / shape.dim ==
                            (token_major ? shape.seq * shape.heads : shape.heads * shape.seq),
                        "a HeadsView factory formed a wrong stride");
    }
    return;
  }
  switch (in.choice(4)) {
    case 0: {
      const bool valid = batch >= 1 && heads >= 1 && x.rows() % batch == 0 && x.cols() % heads == 0;
      const bool returned =
          attempt("split_heads", !valid, [&] { (void)split_heads(x, batch, heads); });
      APEX_FUZZ_REQUIRE(returned == valid, "split_heads rejected valid arguments");
      break;
    }
    case 1: {
      auto out =
          make_view<Scalar>(in, extent(in), extent(in), extent(in), extent(in), Values::kModerate);
      attempt("split_heads(view)", [&] { split_heads(x, batch, heads, out.view); });
      break;
    }
    case 2: {
      auto h = make_view<const Scalar>(in, extent(in), extent(in), extent(in), extent(in),
                                       Values::kModerate);
      RowMatrix<Scalar> out = sentinel<Scalar>(in.in(0, 8), in.in(0, 8));
      attempt("merge_heads", [&] { merge_heads(h.view, RowRef<Scalar>(out)); });
      break;
    }
    default: {
      const Index bq = extent(in), hq = extent(in), sq = extent(in), d = extent(in);
      const Index hkv = in.flag() ? 1 : extent(in), sk = extent(in), dv = extent(in);
      auto q = make_view<const Scalar>(in, bq, hq, sq, d, Values::kModerate);
      auto k = make_view<const Scalar>(in, bq, hkv, sk, d, Values::kModerate);
      auto v = make_view<const Scalar>(in, bq, hkv, sk, dv, Values::kModerate);
      RowMatrix<Scalar> w_o(in.flag() ? std::max<Index>(0, hq * dv) : in.in(0, 8), in.in(0, 4));
      fill(w_o, in, Values::kModerate);
      RowMatrix<Scalar> out =
          sentinel<Scalar>(in.flag() ? std::max<Index>(0, bq * sq) : in.in(0, 6),
                           in.flag() ? w_o.cols() : in.in(0, 4));
      AttentionMask<Scalar> mask;
      mask.positions = any_rule(in);
      attempt_writing("multi_head_attention", false, out, [&] {
        multi_head_attention(q.view, k.view, v.view, mask, SdpaParams{}, w_o, RowRef<Scalar>(out));
      });
      break;
    }
  }
}

void head_count_checks(Input& in) {
  const Index q = in.any_index(), kv = in.any_index(), i = in.any_index();
  const bool counts_ok = q >= 1 && kv >= 1 && q % kv == 0;
  Index head = -1;
  const bool r1 = attempt("kv_head_for", [&] { head = kv_head_for({q, kv}, i); });
  APEX_FUZZ_REQUIRE(r1 == (counts_ok && i >= 0 && i < q), "kv_head_for validation");
  if (r1) APEX_FUZZ_REQUIRE(head >= 0 && head < kv, "kv_head_for out of range");
  double ratio = 0;
  const bool r2 = attempt("kv_cache_ratio", [&] { ratio = kv_cache_ratio({q, kv}); });
  APEX_FUZZ_REQUIRE(r2 == counts_ok, "kv_cache_ratio validation");
  if (r2) APEX_FUZZ_REQUIRE(ratio > 0 && ratio <= 1, "kv_cache_ratio out of (0, 1]");
}

// ---- §7–§9 layers -------------------------------------------------------------------------

/// One call of an attention layer's forward(), drawn for validation: x of the model width or
/// another, any batch count, any position rule, and the layer parameters, which the caller
/// completes (attach_rope, the scale, the softcap). Neither copied nor moved: params.rope
/// points into it.
template <class Scalar>
struct LayerCall {
  RowMatrix<Scalar> x;
  Index batch = 0;
  AttentionMask<Scalar> mask;
  AttentionLayerParams<Scalar> params;
  std::optional<RopeTable<Scalar>> table;

  LayerCall(Input& in, Index d_model) : x(in.in(0, 6), in.flag() ? d_model : in.in(0, 7)) {
    fill(x, in, Values::kExtreme, 2.0);
    batch = in.flag() ? in.in(1, 3) : in.any_index();
    mask.positions = any_rule(in);
  }
  LayerCall(const LayerCall&) = delete;
  LayerCall& operator=(const LayerCall&) = delete;

  /// A RoPE table of `rotary_dim` (the layer's) or of another even width, at any offset.
  void attach_rope(Input& in, Index rotary_dim) {
    table.emplace(in.in(1, 8), in.flag() ? rotary_dim : 2 * in.in(1, 4));
    params.rope = &*table;
    params.position_offset = in.flag() ? in.in(0, 8) : in.any_index();
  }

  /// forward() into an output of the right shape or another: it returns or throws, and an
  /// output it throws on is left untouched.
  template <class Layer>
  void check_forward(Input& in, const char* name, const Layer& layer) const {
    const Index d_model = layer.config().d_model;
    RowMatrix<Scalar> out =
        sentinel<Scalar>(in.flag() ? x.rows() : in.in(0, 6), in.flag() ? d_model : in.in(0, 7));
    attempt_writing(name, false, out,
                    [&] { layer.forward(x, batch, mask, params, RowRef<Scalar>(out)); });
  }
};

/// Head counts for a GQA or MLA configuration, each small and valid half the time (H_kv in
/// [1, max_heads], H_q a multiple of it) and from the whole range otherwise.
template <class Config>
void any_head_counts(Input& in, Index max_heads, Config& c) {
  c.num_kv_heads = in.flag() ? in.in(1, max_heads) : in.any_index();
  c.num_q_heads = in.flag() && std::abs(c.num_kv_heads) <= 8 ? c.num_kv_heads * in.in(1, max_heads)
                                                             : in.any_index();
}

/// Layer configurations for validation: each field small and valid half the time, from the
/// whole range otherwise.
GqaConfig any_gqa_config(Input& in) {
  GqaConfig c;
  c.d_model = in.flag() ? in.in(1, 8) : in.any_index();
  any_head_counts(in, 3, c);
  c.head_dim = in.flag() ? in.in(1, 6) : in.any_index();
  return c;
}

MlaConfig any_mla_config(Input& in) {
  MlaConfig c;
  c.d_model = in.flag() ? in.in(1, 6) : in.any_index();
  c.d_q = in.flag() ? in.in(1, 4) : in.any_index();
  c.d_kv = in.flag() ? in.in(1, 4) : in.any_index();
  any_head_counts(in, 2, c);
  c.head_dim = in.flag() ? in.in(1, 4) : in.any_index();
  c.rope_dim = in.flag() ? 2 * in.in(1, 2) : in.any_index();
  c.num_rope_key_heads = in.flag() ? in.in(0, 1) : in.any_index();
  return c;
}

template <class Scalar>
void gqa_checks(Input& in) {
  if (in.flag()) {
    // Construction from a config drawn from the whole range.
    const GqaConfig c = any_gqa_config(in);
    const Bound q_bound = bound_of({c.d_model, c.num_q_heads, c.head_dim});
    const Bound kv_bound = bound_of({c.d_model, c.num_kv_heads, c.head_dim});
    if (!may_call(q_bound) || !may_call(kv_bound)) return;
    attempt("GroupedQueryAttention::random",
            [&] { (void)GroupedQueryAttention<Scalar>::random(c, 1); });
    check_count("gqa_parameter_count(config)",
                {c.d_model, c.num_q_heads, c.num_kv_heads, c.head_dim},
                count_product({2, c.d_model, c.num_q_heads, c.head_dim}) +
                    count_product({2, c.d_model, c.num_kv_heads, c.head_dim}),
                [&] { return gqa_parameter_count(c); });
    return;
  }
  const auto layer = small_gqa<Scalar>(in, /*max_d_model=*/6, /*max_heads=*/2,
                                       /*max_half_head_dim=*/2, /*max_seed=*/100);
  LayerCall<Scalar> call(in, layer.config().d_model);
  if (in.flag()) call.attach_rope(in, layer.config().head_dim);
  if (in.flag()) call.params.attention.scale = in.any_real();
  if (in.flag()) call.params.attention.softcap = in.any_real();
  call.check_forward(in, "GroupedQueryAttention::forward", layer);
  attempt("GroupedQueryAttention::project",
          [&] { (void)layer.project(call.x, call.batch, call.params); });
}

template <class Scalar>
void mla_checks(Input& in) {
  if (in.flag()) {
    const MlaConfig c = any_mla_config(in);
    const Index hkr = c.num_rope_key_heads == 0 ? c.num_kv_heads : c.num_rope_key_heads;
    const bool small = may_call(bound_of({c.d_model, c.d_kv})) &&
                       may_call(bound_of({c.d_kv, c.num_kv_heads, c.head_dim})) &&
                       may_call(bound_of({c.d_model, c.d_q})) &&
                       may_call(bound_of({c.d_q, c.num_q_heads, c.head_dim})) &&
                       may_call(bound_of({c.d_model, c.num_q_heads, c.rope_dim})) &&
                       may_call(bound_of({c.d_model, hkr, c.rope_dim})) &&
                       may_call(bound_of({c.num_q_heads, c.head_dim, c.d_model}));  // W_O
    attempt("mla_parameter_count", [&] { (void)mla_parameter_count(c); });
    attempt("mla_cache_values_per_token", [&] { (void)mla_cache_values_per_token(c); });
    attempt("mla_cache_ratio", [&] { (void)mla_cache_ratio(c); });
    attempt("mla_cheaper_path", [&] { (void)mla_cheaper_path(c, in.any_index()); });
    if (small) {
      attempt("MultiHeadLatentAttention::random",
              [&] { (void)MultiHeadLatentAttention<Scalar>::random(c, 1); });
    }
    return;
  }
  const auto layer = small_mla<Scalar>(in, /*max_d_model=*/6, /*max_latent=*/4,
                                       /*max_head_dim=*/3, /*max_seed=*/100);
  LayerCall<Scalar> call(in, layer.config().d_model);
  // MLA needs its RoPE table: leave it out in only one call in four.
  if (in.choice(4) != 0) call.attach_rope(in, layer.config().rope_dim);
  if (in.flag()) call.params.attention.scale = in.any_real();
  call.check_forward(in, "MultiHeadLatentAttention::forward", layer);
}

// ---- caches and tensors -------------------------------------------------------------------

template <class Scalar>
void cache_checks(Input& in) {
  const Index b = in.flag() ? in.in(1, 2) : in.any_index();
  const Index h = in.flag() ? in.in(1, 2) : in.any_index();
  const Index d = in.flag() ? in.in(1, 3) : in.any_index();
  const Index c = in.flag() ? in.in(1, 6) : in.any_index();
  // K and V of B·H·C·d scalars each: a size whose byte count overflows 64 bits is rejected.
  const Bound bound = bound_of({b, h, c, d});
  const bool dims_ok = b >= 1 && h >= 1 && d >= 1 && c >= 1 && bound != Bound::kOverflow;
  switch (in.choice(4)) {
    case 0: {
      if (!may_call(bound)) return;
      std::optional<KvCache<Scalar>> cache;
      const bool returned = attempt("KvCache", !dims_ok, [&] {
        cache.emplace(KvCacheShape{b, h, d, c});
      });
      APEX_FUZZ_REQUIRE(returned == dims_ok, "KvCache rejected valid dimensions");
      if (!returned) return;
      for (int step = 0; step < 4; ++step) {
        switch (in.choice(4)) {
          case 0: {
            const Index n = in.in(0, 3);
            auto k =
                make_view<const Scalar>(in, in.flag() ? b : extent(in), in.flag() ? h : extent(in),
                                        n, in.flag() ? d : extent(in), Values::kModerate);
            auto v = make_view<const Scalar>(in, in.flag() ? b : extent(in),
                                             in.flag() ? h : extent(in), in.flag() ? n : extent(in),
                                             in.flag() ? d : extent(in), Values::kModerate);
            const Index pos = in.flag() ? cache->next_position() : in.any_index();
            attempt("KvCache::append", [&] { cache->append(k.view, v.view, pos); });
            break;
          }
          case 1: {
            const Index size = in.flag() ? in.in(-1, cache->size() + 1) : in.any_index();
            attempt("KvCache::truncate", [&] { cache->truncate(size); });
            break;
          }
          case 2: {
            const Index cap = in.flag() ? in.in(0, 10) : in.any_index();
            const Bound grown = bound_of({b, h, cap, d});
            if (!may_call(grown)) break;
            attempt("KvCache::reserve", [&] { cache->reserve(cap); });
            break;
          }
          default:
            attempt("KvCache::check_room", [&] { cache->check_room(in.any_index()); });
            break;
        }
      }
      break;
    }
    case 1: {
      if (!may_call(bound)) return;
      std::optional<SlidingWindowCache<Scalar>> cache;
      const bool returned = attempt("SlidingWindowCache", !dims_ok, [&] {
        cache.emplace(WindowCacheShape{b, h, d, c});
      });
      APEX_FUZZ_REQUIRE(returned == dims_ok, "SlidingWindowCache rejected valid dimensions");
      if (!returned) return;
      for (int step = 0; step < 4; ++step) {
        const Index n = in.in(0, 8);
        auto k = make_view<const Scalar>(in, b, h, n, d, Values::kModerate);
        auto v =
            make_view<const Scalar>(in, b, h, in.flag() ? n : extent(in), d, Values::kModerate);
        const Index pos = in.flag() ? cache->next_position() : in.any_index();
        attempt("SlidingWindowCache::append", [&] { cache->append(k.view, v.view, pos); });
        (void)cache->segments();
      }
      break;
    }
    case 2: {
      const Index rope_heads = in.flag() ? in.in(1, 2) : in.any_index();
      const Index rope_dim = in.flag() ? 2 * in.in(1, 2) : in.any_index();
      // B·C rows of width d_kv + H_kr·d_r: a width or a size beyond 64 bits is rejected.
      const __int128 width =
          static_cast<__int128>(d) + static_cast<__int128>(rope_heads) * rope_dim;
      const bool width_fits =
          width <= std::numeric_limits<Index>::max() && width >= std::numeric_limits<Index>::min();
      const Bound rows_bound =
          width_fits ? bound_of({b, c, static_cast<Index>(width)}) : Bound::kOverflow;
      if (!may_call(rows_bound)) return;
      const bool valid = b >= 1 && d >= 1 && rope_heads >= 1 && rope_dim >= 2 &&
                         rope_dim % 2 == 0 && c >= 1 && rows_bound != Bound::kOverflow;
      std::optional<LatentCache<Scalar>> cache;
      const bool returned = attempt("LatentCache", !valid, [&] {
        cache.emplace(LatentCacheShape{b, d, rope_heads, rope_dim, c});
      });
      APEX_FUZZ_REQUIRE(returned == valid, "LatentCache rejected valid dimensions");
      if (!returned) return;
      for (int step = 0; step < 3; ++step) {
        RowMatrix<Scalar> rows(in.in(0, 6), in.flag() ? cache->row_width() : in.in(0, 8));
        fill(rows, in, Values::kModerate);
        const Index pos = in.flag() ? cache->next_position() : in.any_index();
        attempt("LatentCache::append", [&] { cache->append(rows, pos); });
        if (in.flag()) {
          const Index cap = in.flag() ? in.in(0, 10) : in.any_index();
          const Bound grown = bound_of({b, cap, cache->row_width()});
          if (may_call(grown)) attempt("LatentCache::reserve", [&] { cache->reserve(cap); });
        }
        if (in.flag()) attempt("LatentCache::truncate", [&] { cache->truncate(in.any_index()); });
      }
      break;
    }
    default: {
      if (!may_call(bound)) return;
      // Any extent 0 makes an empty tensor, whatever the others.
      const bool valid = b >= 0 && h >= 0 && c >= 0 && d >= 0 && bound != Bound::kOverflow;
      const bool returned = attempt("HeadsTensor", !valid, [&] {
        HeadsTensor<Scalar> t({b, h, c, d});
      });
      APEX_FUZZ_REQUIRE(returned == valid, "HeadsTensor rejected a valid shape");
      break;
    }
  }
}

// ---- paged caches --------------------------------------------------------------------------

/// As attempt(name, must_throw, call), and an error must name `op`, the operation called (not a
/// component it asked).
template <class Call>
bool attempt_named(const char* name, const char* op, bool must_throw, Call&& call) {
  try {
    std::forward<Call>(call)();
  } catch (const std::invalid_argument& e) {
    check_message(e.what());
    APEX_FUZZ_REQUIRE(std::string(e.what()).rfind(std::string("[") + op + "]", 0) == 0,
                      std::string(name) + "'s error names another operation: " + e.what());
    return false;
  } catch (...) {
    fail(std::string(name) + " threw something other than std::invalid_argument");
  }
  if (must_throw) fail(std::string(name) + " accepted an argument that is invalid");
  return true;
}

/// A paged cache with live, empty and freed sequences, and sdpa_paged over ids drawn from all
/// of them (and unknown ones) in any order, with outputs of its own or lying inside a pool. An
/// unknown id or an output sharing memory with the pool must be rejected under sdpa_paged's
/// name whatever the order and the lengths, and a rejected call leaves the pool as it was.
template <class Scalar>
void paged_checks(Input& in) {
  const Index page = in.flag() ? in.in(1, 4) : in.any_index();
  const Index pages = in.flag() ? in.in(1, 6) : in.any_index();
  const Index h = in.in(1, 2), d = in.in(1, 3);
  const Bound bound = bound_of({2, pages, h, page, d});
  if (!may_call(bound)) return;
  const bool valid = page >= 1 && pages >= 1 && bound != Bound::kOverflow;
  std::optional<PagedKvCache<Scalar>> cache;
  const bool made = attempt("PagedKvCache", !valid, [&] {
    cache.emplace(PagedKvCacheShape{h, d, page, pages});
  });
  APEX_FUZZ_REQUIRE(made == valid, "PagedKvCache rejected valid dimensions");
  if (!made) return;
  std::vector<SequenceId> known;
  std::vector<bool> live;
  for (int i = 0; i < 3; ++i) {
    known.push_back(cache->add());
    auto k = make_view<const Scalar>(in, 1, h, in.in(0, 5), d, Values::kModerate);
    attempt("PagedKvCache::append", [&] { cache->append(known.back(), k.view, k.view); });
    live.push_back(in.choice(4) != 0);
    if (!live.back()) cache->free(known.back());
  }
  std::vector<SequenceId> ids;
  std::vector<Index> cu{0};
  bool ids_ok = true, lengths_ok = true;
  for (Index i = in.in(0, 4); i > 0; --i) {
    const int pick = in.choice(4);  // 3: any id, which may still name a live sequence
    ids.push_back(pick == 3 ? SequenceId{in.any_index()} : known[std::size_t(pick)]);
    const bool ok = cache->contains(ids.back());
    ids_ok = ids_ok && ok;
    const Index nq = in.in(0, 2);
    lengths_ok = lengths_ok && (!ok || nq <= cache->length(ids.back()));
    cu.push_back(cu.back() + nq);
  }
  const Index total = cu.back(), h_q = h * in.in(1, 2);
  auto q = make_view<const Scalar>(in, 1, h_q, total, d, Values::kModerate);
  auto out = make_view<Scalar>(in, 1, h_q, total, d, Values::kModerate);
  auto lse = make_view<Scalar>(in, 1, h_q, total, 1, Values::kModerate);
  // The pools' first elements (a segment of any live sequence starts there) and their contents.
  const auto live_at = std::find(live.begin(), live.end(), true);
  const auto pool_size = static_cast<std::size_t>(pages * h * page * d);  // one plane
  Scalar* pool[2] = {nullptr, nullptr};
  std::vector<Scalar> before[2];
  if (live_at != live.end()) {
    const auto keys = cache->segment(known[std::size_t(live_at - live.begin())]);
    pool[0] = const_cast<Scalar*>(keys.k.data());  // NOLINT: only ever compared or rejected
    pool[1] = const_cast<Scalar*>(keys.v.data());  // NOLINT
    for (int p = 0; p < 2; ++p) before[p].assign(pool[p], pool[p] + pool_size);
  }
  HeadsView<Scalar> out_view = out.view;
  HeadsView<Scalar> lse_view = in.flag() ? lse.view : HeadsView<Scalar>();
  bool aliased = false;  // an output inside a pool (the call must refuse it, whatever else)
  if (pool[0] != nullptr && total >= 1 && std::size_t(h_q * total * d) <= pool_size && in.flag()) {
    Scalar* at = pool[in.choice(2)];
    if (in.flag()) {
      out_view = HeadsView<Scalar>::contiguous(at, {1, h_q, total, d});
    } else {
      lse_view = HeadsView<Scalar>::contiguous(at, {1, h_q, total, 1});
    }
    aliased = true;
  }
  const bool must_throw = !ids_ok || !lengths_ok || aliased;
  const bool returned = attempt_named("sdpa_paged", "sdpa_paged", must_throw, [&] {
    sdpa_paged(q.view, cu, *cache, ids, {causal_mask()}, SdpaParams{}, out_view, lse_view);
  });
  APEX_FUZZ_REQUIRE(
      returned || !aliased || before[0] == std::vector<Scalar>(pool[0], pool[0] + pool_size),
      "a rejected sdpa_paged wrote into the key pool");
  APEX_FUZZ_REQUIRE(
      returned || !aliased || before[1] == std::vector<Scalar>(pool[1], pool[1] + pool_size),
      "a rejected sdpa_paged wrote into the value pool");
}

/// sdpa_block_tables over a pool of the caller's with lengths and pages from the whole range:
/// a call is accepted exactly when every table covers its length in pages of the pool (computed
/// here without overflow) and every sequence holds its queries.
template <class Scalar>
void block_table_checks(Input& in) {
  const Index page = in.in(1, 4), pages = in.in(1, 4), h = in.in(1, 2), d = in.in(1, 3);
  auto k_pool = make_view<const Scalar>(in, pages, h, page, d, Values::kModerate);
  auto v_pool = make_view<const Scalar>(in, pages, h, page, d, Values::kModerate);
  BlockTables<Scalar, Scalar> tables{k_pool.view, v_pool.view, {}, {}};
  std::vector<Index> cu{0};
  bool valid = true;
  for (Index i = in.in(0, 3); i > 0; --i) {
    const Index length = in.flag() ? in.in(0, 12) : in.any_index();
    std::vector<Index> table(std::size_t(in.in(0, 4)));
    for (Index& entry : table) entry = in.choice(8) == 0 ? in.any_index() : in.in(0, pages - 1);
    const Index nq = in.in(0, 2);
    const bool covered = length >= 0 && static_cast<__int128>(table.size()) * page >= length;
    bool inside = true;
    for (const Index entry : table) inside = inside && entry >= 0 && entry < pages;
    valid = valid && covered && inside && nq <= length;
    tables.lengths.push_back(length);
    tables.block_tables.push_back(std::move(table));
    cu.push_back(cu.back() + nq);
  }
  auto q = make_view<const Scalar>(in, 1, h, cu.back(), d, Values::kModerate);
  RowMatrix<Scalar> out = sentinel<Scalar>(h * cu.back(), d);
  const auto out_view = HeadsView<Scalar>::contiguous(out.data(), {1, h, cu.back(), d});
  const bool returned = attempt_writing("sdpa_block_tables", !valid, out, [&] {
    sdpa_block_tables(q.view, cu, tables, {causal_mask()}, SdpaParams{}, out_view);
  });
  APEX_FUZZ_REQUIRE(returned == valid, "sdpa_block_tables rejected a valid call");
}

void comparison_checks(Input& in) {
  if (in.flag()) {
    CacheComparisonParams p;
    p.num_q_heads = in.any_index();
    p.num_kv_heads = in.any_index();
    p.head_dim = in.any_index();
    p.latent_dim = in.any_index();
    p.rope_dim = in.any_index();
    p.rope_heads = in.any_index();
    p.window = in.any_index();
    p.context = in.any_index();
    p.batch = in.flag() ? 1 : in.any_index();
    p.bytes_per_value = in.flag() ? 2 : in.any_index();
    attempt("cache_comparison", [&] { (void)cache_comparison(p); });
    return;
  }
  StackConfig c;
  c.num_layers = in.any_index();  // any count: the layers are counted, not looped over
  c.window = in.any_index();
  c.global_every = in.any_index();
  c.local = any_gqa_config(in);
  c.global = any_mla_config(in);
  const Index batch = in.any_index(), context = in.any_index();
  const Index bytes = in.flag() ? 2 : in.any_index();
  attempt("stack_cache_memory", [&] { (void)stack_cache_memory(c, batch, context, bytes); });
}

// ---- moved-from and default objects, failed calls ------------------------------------------

/// Class 5 of the hardening pass: every owning type, default-constructed or moved from after
/// some use, answers its queries and rejects (std::invalid_argument) or performs harmlessly every
/// operation; none reaches undefined behaviour (the sanitizers watch).
template <class Scalar>
void moved_from_checks(Input& in) {
  const bool moved = in.flag();
  const HeadsTensor<Scalar> chunk({1, 1, in.in(0, 3), 2});
  const Index pos = in.flag() ? 0 : in.any_index();
  switch (in.choice(6)) {
    case 0: {
      KvCache<Scalar> c;
      if (moved) {
        KvCache<Scalar> full(KvCacheShape{1, 1, 2, 4});
        attempt("KvCache::append", [&] { full.append(chunk.view(), chunk.view(), 0); });
        c = std::move(full);
        attempt("moved-from KvCache::append",
                [&] { full.append(chunk.view(), chunk.view(), pos); });
        attempt("moved-from KvCache::reserve", [&] { full.reserve(in.in(0, 8)); });
        APEX_FUZZ_REQUIRE(full.size() == 0 && full.bytes() == 0 && full.keys().seq() == 0,
                          "a moved-from KvCache is not empty");
      }
      attempt("KvCache::append", [&] { c.append(chunk.view(), chunk.view(), pos); });
      attempt("KvCache::truncate", [&] { c.truncate(in.in(-1, 2)); });
      break;
    }
    case 1: {
      SlidingWindowCache<Scalar> c;
      if (moved) {
        SlidingWindowCache<Scalar> ring(WindowCacheShape{1, 1, 2, 3});
        attempt("SlidingWindowCache::append", [&] { ring.append(chunk.view(), chunk.view(), 0); });
        c = std::move(ring);
        attempt("moved-from SlidingWindowCache::append",
                [&] { ring.append(chunk.view(), chunk.view(), pos); });
        APEX_FUZZ_REQUIRE(ring.size() == 0 && ring.segments()[0].keys.seq() == 0,
                          "a moved-from SlidingWindowCache is not empty");
      }
      attempt("SlidingWindowCache::append", [&] { c.append(chunk.view(), chunk.view(), pos); });
      (void)c.segments();
      break;
    }
    case 2: {
      LatentCache<Scalar> c;
      if (moved) {
        LatentCache<Scalar> latent(LatentCacheShape{1, 2, 1, 2, 4});
        c = std::move(latent);
        attempt("moved-from LatentCache::append",
                [&] { latent.append(RowMatrix<Scalar>::Zero(in.in(0, 2), 4), pos); });
        APEX_FUZZ_REQUIRE(latent.rows().seq() == 0 && latent.bytes() == 0,
                          "a moved-from LatentCache is not empty");
      }
      attempt("LatentCache::append", [&] { c.append(RowMatrix<Scalar>::Zero(1, 4), pos); });
      attempt("LatentCache::reserve", [&] { c.reserve(in.in(0, 8)); });
      break;
    }
    case 3: {
      GroupedQueryAttention<Scalar> layer;
      if (moved) {
        auto full = GroupedQueryAttention<Scalar>::random(GqaConfig{4, 2, 1, 2}, 1);
        layer = std::move(full);
        attempt("moved-from gqa forward",
                [&] { (void)full.forward(RowMatrix<Scalar>::Zero(2, 4), 1); });
      }
      const RowMatrix<Scalar> x = RowMatrix<Scalar>::Zero(in.in(0, 2), in.flag() ? 4 : 0);
      attempt("gqa forward", [&] { (void)layer.forward(x, 1); });
      attempt("gqa make_cache", [&] { (void)layer.make_cache(1, 2); });
      break;
    }
    case 4: {
      MultiHeadLatentAttention<Scalar> layer;
      MlaConfig m;
      m.d_model = 4;
      m.d_q = 2;
      m.d_kv = 2;
      m.num_q_heads = 1;
      m.num_kv_heads = 1;
      m.head_dim = 2;
      m.rope_dim = 2;
      if (moved) {
        auto full = MultiHeadLatentAttention<Scalar>::random(m, 2);
        layer = std::move(full);
        attempt("moved-from mla make_cache", [&] { (void)full.make_cache(1, 2); });
      }
      const RopeTable<Scalar> rope(4, 2);
      AttentionLayerParams<Scalar> params;
      params.rope = &rope;
      attempt("mla forward",
              [&] { (void)layer.forward(RowMatrix<Scalar>::Zero(2, 4), 1, {}, params); });
      break;
    }
    default: {
      HeadsTensor<Scalar> t;
      RopeTable<Scalar> table;
      if (moved) {
        HeadsTensor<Scalar> full({1, 2, 3, 4});
        RopeTable<Scalar> full_table(4, 2);
        t = std::move(full);
        table = std::move(full_table);
        APEX_FUZZ_REQUIRE(full.data() == nullptr && full.view().shape().has_no_elements() &&
                              full_table.max_positions() == 0,
                          "a moved-from HeadsTensor or RopeTable is not empty");
        RowMatrix<Scalar> x = RowMatrix<Scalar>::Zero(in.in(0, 2), 2);
        attempt("apply_rope of a moved-from table",
                [&] { apply_rope(full_table, 0, RowRef<Scalar>(x)); });
      }
      RowMatrix<Scalar> x = RowMatrix<Scalar>::Zero(in.in(0, 2), 2);
      attempt("apply_rope", [&] { apply_rope(table, in.in(0, 3), RowRef<Scalar>(x)); });
      break;
    }
  }
}

/// The positions of every layer cache of a stack cache, and a checksum of what they hold.
template <class Scalar>
std::pair<std::vector<Index>, double> stack_cache_state(const StackCache<Scalar>& cache) {
  std::vector<Index> positions{cache.next_position()};
  double sum = 0;
  for (Index l = 0; l < cache.num_layers(); ++l) {
    std::visit(
        [&](const auto& c) {
          positions.push_back(c.next_position());
          if constexpr (std::is_same_v<std::decay_t<decltype(c)>, LatentCache<Scalar>>) {
            for (Index b = 0; b < c.batch(); ++b)
              sum += c.rows().head(b, 0).template cast<double>().sum();
          } else {
            for (const auto& segment : c.segments()) {
              for (Index b = 0; b < segment.keys.batch(); ++b) {
                for (Index h = 0; h < segment.keys.heads(); ++h) {
                  sum += segment.keys.head(b, h).template cast<double>().sum() +
                         segment.values.head(b, h).template cast<double>().sum();
                }
              }
            }
          }
        },
        cache.layer(l));
  }
  return {positions, sum};
}

/// Class 7: a stack call that throws leaves its cache as it was (positions and contents).
template <class Scalar>
void failed_stack_calls(Input& in) {
  StackConfig c;
  c.vocab_size = 16;
  c.d_model = 4;
  c.num_layers = in.in(1, 3);
  c.window = in.in(1, 3);
  c.global_every = 2;
  c.local = GqaConfig{4, 2, 1, 2};
  c.global.d_model = 4;
  c.global.d_q = 2;
  c.global.d_kv = 2;
  c.global.num_q_heads = 2;
  c.global.num_kv_heads = 1;
  c.global.head_dim = 2;
  c.global.rope_dim = 2;
  c.max_positions = 8;
  const auto stack = AttentionStack<Scalar>::random(c, 3);
  auto cache = stack.make_cache(in.in(1, 2), in.in(1, 8));
  for (int step = 0; step < 4; ++step) {
    const auto before = stack_cache_state(cache);
    TokenMatrix tokens(in.flag() ? cache.batch() : in.in(0, 3), in.in(0, 4));
    for (Index i = 0; i < tokens.size(); ++i) {
      tokens.data()[i] = in.choice(8) == 0 ? in.any_index() : in.in(0, 15);
    }
    const Index prefix = in.flag() ? 0 : in.in(-1, 4);
    bool returned = false;
    switch (in.choice(3)) {
      case 0:
        returned = attempt("stack prefill", [&] { (void)stack.prefill(tokens, prefix, cache); });
        break;
      case 1:
        returned = attempt("stack extend", [&] { (void)stack.extend(tokens, cache); });
        break;
      default: {
        std::vector<std::int64_t> next(static_cast<std::size_t>(in.in(0, 3)));
        for (auto& id : next) id = in.choice(8) == 0 ? in.any_index() : in.in(0, 15);
        returned = attempt("stack decode_step", [&] { (void)stack.decode_step(next, cache); });
        break;
      }
    }
    if (!returned) {
      const auto after = stack_cache_state(cache);
      APEX_FUZZ_REQUIRE(after.first == before.first,
                        "a failed stack call moved a cache's position");
      APEX_FUZZ_REQUIRE(same_bits(Eigen::Matrix<double, 1, 1>::Constant(after.second),
                                  Eigen::Matrix<double, 1, 1>::Constant(before.second)),
                        "a failed stack call changed a cache's contents");
    }
  }
}

/// Every check of this target, in the order an input's choice selects them.
template <class Scalar>
constexpr Check kChecks[] = {
    embedding<Scalar>,
    lm_head_shapes<Scalar>,
    parameter_counts,
    rms_norm_checks<Scalar>,
    rope_table_checks<Scalar>,
    rope_from_frequencies<Scalar>,
    rope_from_cos_sin<Scalar>,
    rope_frequency_checks,
    apply_rope_checks<Scalar>,
    yarn_checks<Scalar>,
    mask_builders,
    sdpa_checks<Scalar>,
    merge_checks<Scalar>,
    heads_checks<Scalar>,
    head_count_checks,
    gqa_checks<Scalar>,
    mla_checks<Scalar>,
    cache_checks<Scalar>,
    paged_checks<Scalar>,
    block_table_checks<Scalar>,
    comparison_checks,
    moved_from_checks<Scalar>,
    failed_stack_calls<Scalar>,
};

}  // namespace
}  // namespace apex::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace apex::fuzz;
  return run_checks(data, size, kChecks<float>, kChecks<double>);
}
