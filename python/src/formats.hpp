// SPDX-License-Identifier: MIT
// What the caches, the layers and the stack of the module share: the storage formats as the
// alternatives of a std::variant (a Python class holds one C++ cache of any format) with the
// dispatch on a format's name, and the keyword arguments of their attention calls.
#pragma once

#include "arrays.hpp"

#include <cstddef>
#include <iterator>
#include <type_traits>
#include <variant>

namespace apex::python {

/// The formats' names, in the order of the alternatives of AnyOf.
inline constexpr const char* kFormats[] = {"float32", "float64", "float16",  "bfloat16",
                                           "q8_0",    "q4_0",    "fp8_e4m3", "fp8_e5m2"};

/// A cache template C<Scalar, Storage> over every format: alternative i is format kFormats[i].
template <template <class, class> class C>
using AnyOf = std::variant<C<float, float>, C<double, double>, C<float, Eigen::half>,
                           C<float, Eigen::bfloat16>, C<float, BlockQ8_0>, C<float, BlockQ4_0>,
                           C<float, BlockFp8E4m3<>>, C<float, BlockFp8E5m2<>>>;

/// The alternative of the format named `name`; throws for an unknown name.
inline std::size_t format_index(const std::string& name, const char* op) {
  for (std::size_t i = 0; i < std::size(kFormats); ++i) {
    if (name == kFormats[i]) return i;
  }
  APEX_CHECK(false, "[" << op << "] format ('" << name
                        << "') must be one of 'float32', 'float64', 'float16', 'bfloat16', "
                           "'q8_0', 'q4_0', 'fp8_e4m3', 'fp8_e5m2'");
  return 0;
}

/// f(Tag<A>{}) for A the alternative `index` of Variant.
template <class Variant, std::size_t I = 0, class F>
auto on_alternative(std::size_t index, const F& f) {
  if constexpr (I + 1 < std::variant_size_v<Variant>) {
    if (index != I) return on_alternative<Variant, I + 1>(index, f);
  }
  return f(Tag<std::variant_alternative_t<I, Variant>>{});
}

/// The variant holding alternative `index`, made by make(Tag<Alternative>{}) (the alternatives
/// are distinct types, so the made object selects its own).
template <class Variant, class Make>
Variant make_alternative(std::size_t index, const Make& make) {
  return on_alternative<Variant>(index, [&](auto tag) { return Variant(make(tag)); });
}

/// A getter of a class that holds a variant `any`: get(alternative) whichever it holds.
template <class Box, class Get>
auto visiting(Get get) {
  return [get](const Box& box) { return std::visit(get, box.any); };
}

/// The compute type of a cache (KvCache and LatentCache: ComputeType; the paged caches:
/// ScalarType).
template <class Cache, class = void>
struct ComputeOf {
  using type = typename Cache::ScalarType;
};
template <class Cache>
struct ComputeOf<Cache, std::void_t<typename Cache::ComputeType>> {
  using type = typename Cache::ComputeType;
};
/// A stack's cache computes in its first type.
template <class S, class St, class G>
struct ComputeOf<StackCache<S, St, G>, void> {
  using type = S;
};
template <class Cache>
using compute_t = typename ComputeOf<std::decay_t<Cache>>::type;

/// Throws unless a layer computing in Scalar can use a cache computing in C.
template <class Scalar, class C>
void check_same_compute(const char* op, const char* format) {
  APEX_CHECK((std::is_same_v<Scalar, C>),
             "[" << op << "] the cache (format '" << format << "') computes in " << numpy_name<C>()
                 << ", the layer in " << numpy_name<Scalar>() << ": make the cache with the "
                 << "layer's make_cache (float64 layers take format 'float64' only)");
}

/// A cache view of any format decoded to Scalar: a new [B, H, S, D] array (D in values).
template <class Scalar, class T>
py::array decoded(const HeadsView<const T>& view) {
  const Index b_n = view.batch(), h_n = view.heads(), s_n = view.seq(), d = row_values(view);
  py::array out = new_array<Scalar>({b_n, h_n, s_n, d});
  Scalar* to = mutable_data<Scalar>(out);
  for (Index b = 0; b < b_n; ++b) {
    for (Index h = 0; h < h_n; ++h) {
      Eigen::Map<RowMatrix<Scalar>>(to + (b * h_n + h) * s_n * d, s_n, d) =
          detail::head_values<Scalar>(view, b, h);
    }
  }
  return out;
}

/// The formats, as the docstrings of the caches describe them.
inline constexpr const char* kFormatDoc =
    "float32 (4 bytes a value), float64 (8; computes in float64), float16 and bfloat16 (2, "
    "each value rounded once to nearest even), q8_0 (ggml's: blocks of 32 values as int8 with "
    "a float16 scale, 34 bytes), q4_0 (blocks of 32 as 4-bit codes with a float16 scale, 18 "
    "bytes), fp8_e4m3 and fp8_e5m2 (blocks of 128 values as OFP8 codes with a float32 scale, "
    "132 bytes). The block formats need the row width (head_dim) to be a whole number of "
    "blocks. Every format but float64 takes and computes in float32.";

// ---------------------------------------------------------------------------------------------
// The keyword arguments of attention calls
// ---------------------------------------------------------------------------------------------

/// The position rule and score parameters of a call (mask.hpp, sdpa_params.hpp).
struct CallArgs {
  bool causal = false;
  std::optional<Index> window;
  Index prefix = 0;
  std::optional<double> scale;
  double softcap = 0.0;

  PositionMask rule() const {
    PositionMask m;
    m.causal = causal;
    m.window = window;
    m.prefix = prefix;
    return m;
  }
  SdpaParams params() const {
    SdpaParams p;
    p.scale = scale;
    p.softcap = softcap;
    return p;
  }
};

/// The call arguments' keywords, in CallArgs' order, after the positional ones.
#define APEX_CALL_ARGS                                                              \
  py::arg("causal") = false, py::arg("window") = py::none(), py::arg("prefix") = 0, \
  py::arg("scale") = py::none(), py::arg("softcap") = 0.0

}  // namespace apex::python
