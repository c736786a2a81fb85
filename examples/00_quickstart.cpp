// SPDX-License-Identifier: MIT
// A first look at apex: normalise a few token vectors, rotate their queries and keys with RoPE,
// and run causal attention over them.
#include <apex/apex.hpp>

#include <iostream>

int main() {
  const apex::Index tokens = 6, d_head = 8;

  // Activations are [tokens, features], row-major.
  const apex::RowMatrix<float> x = apex::RowMatrix<float>::Random(tokens, d_head);
  const apex::RowMatrix<float> h = apex::rms_norm(x, apex::Vector<float>::Ones(d_head));

  // A RoPE table is built once (§4.7) and applied to queries and keys at their positions.
  const apex::RopeTable<float> rope(/*max_positions=*/1024, d_head);
  apex::RowMatrix<float> q = h, k = h;
  apex::apply_rope(rope, /*position_offset=*/0, q);
  apex::apply_rope(rope, /*position_offset=*/0, k);

  // Causal scaled dot-product attention (§6): softmax(q kᵀ / √d) v, key j ≤ query i.
  apex::AttentionMask<float> mask;
  mask.positions = apex::causal_mask();
  const apex::RowMatrix<float> out = apex::sdpa(q, k, h, mask);

  std::cout << "attention output [" << out.rows() << " x " << out.cols() << "]\n" << out << "\n";
  // The first token can only see itself, so its output is its own value row.
  return out.row(0).isApprox(h.row(0), 1e-5f) ? 0 : 1;
}
