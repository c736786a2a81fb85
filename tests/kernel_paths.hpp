// SPDX-License-Identifier: MIT
// The paths of the tiled kernel a rule test runs each call on, named: the default blocks, small
// blocks (many block boundaries and decode chunks), Eigen's GEMM kernel everywhere and the
// streaming kernel everywhere (sdpa_rules_test, block_sparse_test).
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>

#include <utility>
#include <vector>

namespace apex::testing {

/// The kernel's paths, each named.
inline std::vector<std::pair<const char*, detail::FlashBlocking>> kernel_paths() {
  detail::FlashBlocking small;  // many block boundaries and decode chunks
  small.stacked_rows = 16;
  small.key_block = 16;
  small.stream_key_block = 8;
  small.decode_chunk = 40;
  detail::FlashBlocking gemm;  // Eigen's GEMM kernel everywhere
  gemm.stream_rows = 0;
  detail::FlashBlocking streaming;  // the streaming kernel everywhere
  streaming.stream_rows = Index{1} << 20;
  return {{"default blocks", detail::FlashBlocking{}},
          {"small blocks", small},
          {"GEMM kernel", gemm},
          {"streaming kernel", streaming}};
}

}  // namespace apex::testing
