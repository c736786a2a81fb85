// SPDX-License-Identifier: MIT
// K and V of several sequences copied into pools of a test's own, with their block tables, for
// sdpa_block_tables (vLLM's layout, page_pool.hpp's BlockTables): each sequence's pages are taken
// from the pools' end backwards, so that no sequence's pages are in order.
#pragma once

#include <apex/config.hpp>
#include <apex/page_pool.hpp>

#include <cstddef>
#include <utility>
#include <vector>

#include "attention_case.hpp"

namespace apex::testing {

/// Copies token t of head h of sequence i, key_row(i, h, t) and value_row(i, h, t) (rows of d
/// values), for t < held[i], into the pools [pages, H_kv, page, d] and returns their BlockTables
/// (views of the pools, which must outlive them).
template <class Scalar, class KeyRow, class ValueRow>
BlockTables<Scalar, Scalar> fill_block_tables(Heads<Scalar>& k_pool, Heads<Scalar>& v_pool,
                                              const std::vector<Index>& held, KeyRow key_row,
                                              ValueRow value_row) {
  const Index page = k_pool.seq();
  BlockTables<Scalar, Scalar> tables;
  Index next = k_pool.batch() - 1;
  for (std::size_t i = 0; i < held.size(); ++i) {
    std::vector<Index> table;
    for (Index t = 0; t < held[i]; ++t) {
      if (t % page == 0) table.push_back(next--);
      for (Index h = 0; h < k_pool.heads(); ++h) {
        k_pool.head_map(table.back(), h).row(t % page) = key_row(i, h, t);
        v_pool.head_map(table.back(), h).row(t % page) = value_row(i, h, t);
      }
    }
    tables.block_tables.push_back(table);
    tables.lengths.push_back(held[i]);
  }
  tables.k_pages = std::as_const(k_pool).view();
  tables.v_pages = std::as_const(v_pool).view();
  return tables;
}

}  // namespace apex::testing
