// SPDX-License-Identifier: MIT
// A selection of keys per query row: what DeepSeek Sparse Attention's lightning indexer produces
// (indexer.hpp) and what sparse attention reads (sparse_attention.hpp).
//
//   KeySelection [rows, k]        row r = b·S_q + i, the query rows token-major
//   row r:  3  9  10  -1  -1      keys 3, 9 and 10 of batch b, ascending; -1 fills the rest
#pragma once

#include <apex/config.hpp>

#include <Eigen/Core>

#include <string>

namespace apex {

/// The keys each query row attends to: row r = b·S_q + i (token-major, as projections produce
/// them) lists the key rows (positions) of batch b that query i of batch b sees, strictly
/// ascending, each in [0, S_k); the slots after them hold -1 (FlashMLA's and vLLM's convention
/// for an unused slot). A row of -1 only selects nothing.
using KeySelection = Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

namespace detail {

/// Keys of row r of a selection: the count before its first negative entry.
inline Index selected_count(const KeySelection& selected, Index r) {
  const Index* row = selected.row(r).data();
  Index n = 0;
  while (n < selected.cols() && row[n] >= 0) ++n;
  return n;
}

/// Throws unless `selected` is a selection of keys [0, s_k) for `rows` query rows: that many
/// rows, each strictly ascending entries in [0, s_k) followed only by -1. O(rows · k).
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, a count and a bound
inline void check_selection(const KeySelection& selected, Index rows, Index s_k, const char* op) {
  APEX_CHECK(selected.rows() == rows, "[" << op << "] selection has " << selected.rows()
                                          << " rows; expected one per query row, B*S_q = " << rows);
  for (Index r = 0; r < rows; ++r) {
    const Index n = selected_count(selected, r);
    for (Index j = 0; j < selected.cols(); ++j) {
      const Index key = selected(r, j);
      const bool valid = j < n ? key < s_k && (j == 0 || key > selected(r, j - 1)) : key == -1;
      APEX_CHECK(valid, "[" << op << "] selection(" << r << ", " << j << ") (" << key
                            << ") must be " << (j < n ? "a key in [0, " : "")
                            << (j < n ? std::to_string(s_k) + ") above the entry before it" : "")
                            << (j < n ? "" : "-1: an unused slot ends its row"));
    }
  }
}

}  // namespace detail

}  // namespace apex
