// SPDX-License-Identifier: MIT
// The small APEX-1 stack that the tests of quantized caches share: every head width a whole
// number of blocks of 32 (q8_0, q4_0, fp8 in blocks of 32), so that one config serves every
// format. d = 64, vocabulary 50; local layers GQA with 4 query heads of 32 and 2 K/V heads;
// global layers MLA with d_q 32, d_kv 64, 4 query heads of 32 over 2 K/V heads and one shared
// K_rope head of 32.
#pragma once

#include <apex/stack_config.hpp>

namespace apex::testing {

/// The stack above with `layers` layers, every `global_every`-th one global (F_g), local windows
/// of `window` tokens and positions up to max_positions.
inline StackConfig whole_block_config(Index layers, Index global_every, Index window,
                                      Index max_positions) {
  StackConfig c;
  c.vocab_size = 50;
  c.d_model = 64;
  c.num_layers = layers;
  c.global_every = global_every;
  c.window = window;
  c.local = GqaConfig{64, 4, 2, 32};
  c.global.d_model = 64;
  c.global.d_q = 32;
  c.global.d_kv = 64;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 32;
  c.global.rope_dim = 32;
  c.global.num_rope_key_heads = 1;
  c.max_positions = max_positions;
  return c;
}

}  // namespace apex::testing
