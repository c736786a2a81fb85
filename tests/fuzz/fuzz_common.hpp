// SPDX-License-Identifier: MIT
// What every apex fuzz target shares: turning the fuzzer's bytes into integers and reals drawn
// from the whole range (with the edges over-represented), matrices of ordinary or extreme
// values, the contract check "a call returns or throws std::invalid_argument, with an output
// left untouched on error", the allocation bound that keeps the targets inside the fuzzer's
// memory limit, the position rules and small attention layers that several targets draw, and
// the dispatch of one input to one of a target's checks.
//
// Allocation policy (why the targets never ask for terabytes). A size that the library would
// legitimately allocate for, once every check has passed, is passed through only when the
// allocation it implies is small (kMaxElements); sizes whose product does not even fit in an
// Index are always passed through, because the library must reject those itself (computing the
// product would be signed overflow). Huge sizes that are representable but valid are skipped
// (see Bound). Every target also has a "poisoned" mode in which one other parameter is made
// invalid on purpose and the sizes are passed uncapped: the call must then throw, and it must
// do so before allocating (libFuzzer's -malloc_limit_mb turns a huge allocation into a crash).
#pragma once

#include <apex/config.hpp>
#include <apex/gqa.hpp>
#include <apex/mask.hpp>
#include <apex/mla.hpp>
#include <apex/yarn.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>

namespace apex::fuzz {

/// The most elements a target lets one accepted call allocate (32 MiB of doubles).
constexpr Index kMaxElements = Index{1} << 22;

/// Prints what went wrong and aborts, which libFuzzer records as a crash with its input.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "\n*** apex fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define APEX_FUZZ_REQUIRE(cond, what)                                    \
  do {                                                                   \
    if (!(cond)) ::apex::fuzz::fail(std::string(what) + " [" #cond "]"); \
  } while (false)

/// The fuzzer's bytes as typed values. Integers and reals come from the whole range, with the
/// values that break code (0, ±1, the extremes, powers of two, NaN, ±inf, denormals) drawn far
/// more often than uniform sampling would.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : fdp_(data, size) {}

  FuzzedDataProvider& provider() { return fdp_; }
  bool flag() { return fdp_.ConsumeBool(); }

  /// An integer in [lo, hi].
  Index in(Index lo, Index hi) { return fdp_.ConsumeIntegralInRange<Index>(lo, hi); }
  int choice(int count) { return fdp_.ConsumeIntegralInRange<int>(0, count - 1); }

  /// Any Index: small values most of the time, else an edge of the range.
  Index any_index() {
    constexpr Index kMax = std::numeric_limits<Index>::max();
    constexpr Index kMin = std::numeric_limits<Index>::min();
    switch (choice(16)) {
      case 0:
      case 1:
      case 2:
      case 3:
        return in(-3, 16);
      case 4:
        return in(0, 64);
      case 5:
        return 0;
      case 6:
        return kMax - in(0, 2);
      case 7:
        return kMin + in(0, 2);
      case 8:
        return (Index{1} << in(0, 62)) + in(-1, 1);
      case 9:
        return -(Index{1} << in(0, 62)) + in(-1, 1);
      case 10:
        return Index{std::numeric_limits<std::int32_t>::max()} + in(-1, 2);
      case 11:
        return Index{1} << in(30, 40);
      case 12:
        return fdp_.ConsumeIntegral<Index>();
      case 13:
        return in(-1000, 100000);
      default:
        return in(1, 8);
    }
  }

  /// A size that is usually valid (0 … hi) and sometimes anything at all.
  Index size(Index hi) { return choice(8) == 0 ? any_index() : in(0, hi); }

  /// Any double: NaN, ±inf, ±0, ±1e30, the largest and smallest normals and denormals, random
  /// bit patterns, and ordinary values.
  double any_real() {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    switch (choice(16)) {
      case 0:
        return std::numeric_limits<double>::quiet_NaN();
      case 1:
        return kInf;
      case 2:
        return -kInf;
      case 3:
        return flag() ? 0.0 : -0.0;
      case 4:
        return flag() ? 1e30 : -1e30;
      case 5:
        return pick({std::numeric_limits<double>::max(), std::numeric_limits<double>::lowest(),
                     1e300, -1e300, 1e154, 3.4e38, 1e15, 1e-300});
      case 6:
        return pick({std::numeric_limits<double>::denorm_min(),
                     -std::numeric_limits<double>::denorm_min(), std::numeric_limits<double>::min(),
                     1e-310, 1e-45, 1e-38});
      case 7:
        return pick({std::numeric_limits<double>::epsilon(), 1.0 + 1e-15, 1.0 - 1e-16, 1e-12});
      case 8: {
        const std::uint64_t bits = fdp_.ConsumeIntegral<std::uint64_t>();
        double value;
        std::memcpy(&value, &bits, sizeof value);
        return value;
      }
      case 9:
        return pick({1.0, -1.0, 0.5, 2.0, 32.0, 10000.0, 1e-6, 4096.0, 500000.0});
      case 10:
        return static_cast<double>(any_index());
      default:
        return fdp_.ConsumeFloatingPointInRange<double>(-100.0, 100.0);
    }
  }

  /// A finite real in [lo, hi].
  double real_in(double lo, double hi) { return fdp_.ConsumeFloatingPointInRange<double>(lo, hi); }

  template <class T>
  T pick(std::initializer_list<T> values) {
    const auto at = fdp_.ConsumeIntegralInRange<std::size_t>(0, values.size() - 1);
    return *(values.begin() + at);
  }

 private:
  FuzzedDataProvider fdp_;
};

/// How matrix entries are drawn.
enum class Values {
  kModerate,  ///< finite, |x| <= a bound the caller gives (differential oracles apply)
  kExtreme,   ///< moderate values mixed with NaN, ±inf, ±1e30, ±max, denormals and ±0
};

/// One entry of a matrix of Scalar.
template <class Scalar>
Scalar draw_value(Input& in, Values mode, double bound) {
  using L = std::numeric_limits<Scalar>;
  if (mode == Values::kExtreme && in.choice(4) == 0) {
    switch (in.choice(10)) {
      case 0:
        return L::quiet_NaN();
      case 1:
        return L::infinity();
      case 2:
        return -L::infinity();
      case 3:
        return static_cast<Scalar>(in.flag() ? 1e30 : -1e30);
      case 4:
        return in.flag() ? L::max() : L::lowest();
      case 5:
        return in.flag() ? L::denorm_min() : -L::denorm_min();
      case 6:
        return in.flag() ? L::min() : -L::min();
      case 7:
        return in.flag() ? Scalar(0) : -Scalar(0);
      case 8:
        return static_cast<Scalar>(in.flag() ? 1e-30 : -1e-30);
      default:
        return static_cast<Scalar>(in.real_in(-1e6, 1e6));
    }
  }
  return static_cast<Scalar>(in.real_in(-bound, bound));
}

/// Fills `m` (any Eigen dense object) entry by entry.
template <class Matrix>
void fill(Matrix& m, Input& in, Values mode, double bound = 1.0) {
  using Scalar = typename Matrix::Scalar;
  for (Index i = 0; i < m.rows(); ++i) {
    for (Index j = 0; j < m.cols(); ++j) m(i, j) = draw_value<Scalar>(in, mode, bound);
  }
}

/// What a call with these sizes would allocate if the library accepted it.
enum class Bound {
  kSmall,     ///< fits kMaxElements: pass it
  kHuge,      ///< representable but too big for a fuzzer: skip the call
  kOverflow,  ///< the product does not fit in an Index: the library must reject it, pass it
};

/// Classifies the product of `factors` (as the library would multiply them). A non-positive
/// factor makes the product non-positive, which is small (the library must reject negative
/// sizes, and zero allocates nothing).
inline Bound bound_of(std::initializer_list<Index> factors) {
  bool non_positive = false;
  for (const Index f : factors) non_positive = non_positive || f <= 0;
  if (non_positive) return Bound::kSmall;
  __int128 product = 1;
  for (const Index f : factors) {
    product *= f;
    if (product > static_cast<__int128>(std::numeric_limits<Index>::max())) {
      return Bound::kOverflow;
    }
  }
  return product > kMaxElements ? Bound::kHuge : Bound::kSmall;
}

// Fuzzing history, one line per finding (the number names its regression test). The targets
// exercise all of these inputs.
//   F1  size/count helpers overflowed: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F2  GQA/MLA H·d_h unchecked: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F3  HeadsTensor shapes unchecked: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F4  cache sizes overflowed: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F5  empty split/merge_heads UB: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F6  huge sizes threw bad_alloc: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F7  RoPE θ allocated before checks: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F8  MLA forward on 0 tokens UB: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F9  non-finite RoPE tables: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F10 offsets overflowed positions: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F11 YaRN factor <= 0 or not finite: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F12 negative view extents accepted: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F13 YaRN range infinite or empty: fixed; regression test in tests/fuzz_regressions_test.cpp
//   F14 masked keys reached sdpa output: fixed; regression test in tests/fuzz_regressions_test.cpp

/// Bitwise equality of two dense objects of the same shape (NaN payloads included).
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) {
      const auto x = a(i, j);
      const auto y = b(i, j);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  }
  return true;
}

/// True when a call whose allocation is `bound` may be made.
inline bool may_call(Bound bound) { return bound != Bound::kHuge; }

/// The house rule for messages: "[op] ..." naming what was wrong.
inline void check_message(const char* what) {
  const std::string message = what;
  APEX_FUZZ_REQUIRE(
      !message.empty() && message[0] == '[' && message.find("] ") != std::string::npos,
      "std::invalid_argument message does not start with \"[op] \": \"" + message + "\"");
}

/// Runs `call`. Returns true if it returned normally, false if it threw std::invalid_argument
/// (whose message must follow the house rule). Anything else it throws is a finding.
template <class Call>
bool attempt(const char* name, Call&& call) {
  try {
    std::forward<Call>(call)();
    return true;
  } catch (const std::invalid_argument& e) {
    check_message(e.what());
    return false;
  } catch (const std::exception& e) {
    fail(std::string(name) + " threw " + typeid(e).name() + " (\"" + e.what() +
         "\") instead of returning or throwing std::invalid_argument");
  } catch (...) {
    fail(std::string(name) + " threw a non-std exception");
  }
}

/// As attempt(), and a call that must be rejected (`must_throw`) must not return.
template <class Call>
bool attempt(const char* name, bool must_throw, Call&& call) {
  const bool returned = attempt(name, std::forward<Call>(call));
  if (must_throw && returned) fail(std::string(name) + " accepted an argument that is invalid");
  return returned;
}

/// As attempt(name, must_throw, call) for a call that writes `out` (a dense object): when it
/// throws, `out` must still hold, bit for bit, what it held before.
template <class Out, class Call>
bool attempt_writing(const char* name, bool must_throw, Out& out, Call&& call) {
  const typename Out::PlainObject before = out;
  const bool returned = attempt(name, must_throw, std::forward<Call>(call));
  if (!returned && !same_bits(out, before)) {
    fail(std::string(name) + " wrote its output before throwing");
  }
  return returned;
}

/// YaRN parameters as text, for failure messages.
inline std::string describe(const YarnParams& p) {
  char text[512];
  std::snprintf(text, sizeof text,
                "YarnParams{scale %.17g, original_context %lld, beta_fast %.17g, beta_slow %.17g, "
                "base %.17g, truncate %d, mscale %s%.17g, mscale_all_dim %s%.17g}",
                p.scale, static_cast<long long>(p.original_context), p.beta_fast, p.beta_slow,
                p.base, p.truncate ? 1 : 0, p.mscale ? "" : "unset ", p.mscale.value_or(0),
                p.mscale_all_dim ? "" : "unset ", p.mscale_all_dim.value_or(0));
  return text;
}

/// A position rule whose fields are each small and meaningful about half the time and drawn
/// from the whole Index range otherwise: the prefix in [0, max_prefix], the offsets in
/// [0, max_offset], a window (present half the time) in [1, *max_window] (without max_window,
/// always from the whole range). The query offset is present half the time.
inline PositionMask any_position_mask(Input& in, Index max_prefix, Index max_offset,
                                      std::optional<Index> max_window = std::nullopt) {
  PositionMask m;
  m.causal = in.flag();
  if (in.flag()) m.window = max_window && in.flag() ? in.in(1, *max_window) : in.any_index();
  m.prefix = in.flag() ? in.in(0, max_prefix) : in.any_index();
  if (in.flag()) m.query_offset = in.flag() ? in.in(0, max_offset) : in.any_index();
  m.key_offset = in.flag() ? in.in(0, max_offset) : in.any_index();
  return m;
}

/// The documented preconditions of a PositionMask applied to S_q queries against S_k keys,
/// including that the last positions, key_offset + S_k and query_offset + S_q, are Index values.
inline bool position_mask_valid(const PositionMask& m, Index s_q, Index s_k) {
  constexpr Index kMax = std::numeric_limits<Index>::max();
  return (!m.window || (*m.window >= 1 && m.causal)) && m.prefix >= 0 &&
         (!m.query_offset || (*m.query_offset >= 0 && s_q <= kMax - *m.query_offset)) &&
         m.key_offset >= 0 && s_k <= kMax - m.key_offset;
}

/// Small valid head counts for a GQA or MLA configuration: H_kv in [1, max_heads] and H_q =
/// H_kv·G with the group size G in [1, max_heads].
template <class Config>
void small_head_counts(Input& in, Index max_heads, Config& c) {
  c.num_kv_heads = in.in(1, max_heads);
  c.num_q_heads = c.num_kv_heads * in.in(1, max_heads);
}

/// A grouped-query attention layer with a small valid configuration and random weights:
/// d_model in [1, max_d_model], H_kv and the group size H_q / H_kv in [1, max_heads], d_h even
/// in [2, 2·max_half_head_dim], the weights' seed in [0, max_seed].
template <class Scalar>
GroupedQueryAttention<Scalar> small_gqa(Input& in, Index max_d_model, Index max_heads,
                                        Index max_half_head_dim, Index max_seed) {
  GqaConfig c;
  c.d_model = in.in(1, max_d_model);
  small_head_counts(in, max_heads, c);
  c.head_dim = 2 * in.in(1, max_half_head_dim);
  return GroupedQueryAttention<Scalar>::random(c, static_cast<std::uint64_t>(in.in(0, max_seed)));
}

/// A multi-head latent attention layer with a small valid configuration and random weights:
/// d_model in [1, max_d_model], d_q and d_kv in [1, max_latent], d_h in [1, max_head_dim],
/// H_kv and the group size in [1, 2], d_r in {2, 4}, one shared RoPE key head or one per KV
/// head, the weights' seed in [0, max_seed].
template <class Scalar>
MultiHeadLatentAttention<Scalar> small_mla(Input& in, Index max_d_model, Index max_latent,
                                           Index max_head_dim, Index max_seed) {
  MlaConfig c;
  c.d_model = in.in(1, max_d_model);
  c.d_q = in.in(1, max_latent);
  c.d_kv = in.in(1, max_latent);
  small_head_counts(in, 2, c);
  c.head_dim = in.in(1, max_head_dim);
  c.rope_dim = 2 * in.in(1, 2);
  c.num_rope_key_heads = in.flag() ? 1 : 0;
  return MultiHeadLatentAttention<Scalar>::random(c,
                                                  static_cast<std::uint64_t>(in.in(0, max_seed)));
}

/// One way a target exercises the library (for one scalar type, where that matters).
using Check = void (*)(Input&);

/// The body of LLVMFuzzerTestOneInput for a target whose checks do not depend on a scalar
/// type: the input picks one of `checks` (an entry listed twice is drawn twice as often).
template <std::size_t N>
int run_checks(const std::uint8_t* data, std::size_t size, const Check (&checks)[N]) {
  Input in(data, size);
  checks[in.choice(static_cast<int>(N))](in);
  return 0;
}

/// The same for a target whose checks run in float and in double: `as_float` and `as_double`
/// list the same checks in the same order, and the input picks the scalar type, then the check.
template <std::size_t N>
int run_checks(const std::uint8_t* data, std::size_t size, const Check (&as_float)[N],
               const Check (&as_double)[N]) {
  Input in(data, size);
  const Check* checks = in.flag() ? as_float : as_double;
  checks[in.choice(static_cast<int>(N))](in);
  return 0;
}

}  // namespace apex::fuzz
