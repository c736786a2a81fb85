// SPDX-License-Identifier: MIT
// Names of the K/V formats for typed tests (the third argument of TYPED_TEST_SUITE, which C++17
// with -Wpedantic needs): "q8_0", "q4_0", "fp8_e4m3_64", ... and "e4m3" / "e5m2" for the kinds.
#pragma once

#include <apex/fp8.hpp>
#include <apex/kv_quant.hpp>

#include <string>
#include <type_traits>

namespace apex::testing {

/// The name of a block format of kv_quant.hpp.
struct FormatName {
  template <class F>
  static std::string GetName(int /*index*/) {
    if constexpr (std::is_same_v<F, BlockQ8_0>) {
      return "q8_0";
    } else if constexpr (std::is_same_v<F, BlockQ4_0>) {
      return "q4_0";
    } else {
      return kind_name<F>() + "_" + std::to_string(F::kValues);
    }
  }

 private:
  template <class F>
  static std::string kind_name() {
    if constexpr (std::is_same_v<F, BlockFp8E4m3<F::kValues>>) return "fp8_e4m3";
    return "fp8_e5m2";
  }
};

/// The name of a type with a member kKind of type Fp8Kind.
struct Fp8KindName {
  template <class K>
  static std::string GetName(int /*index*/) {
    return K::kKind == Fp8Kind::kE4m3 ? "e4m3" : "e5m2";
  }
};

}  // namespace apex::testing
