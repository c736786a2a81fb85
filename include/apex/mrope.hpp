// SPDX-License-Identifier: MIT
// Multimodal RoPE (M-RoPE) as Qwen2-VL, Qwen2.5-VL and Qwen3-VL use it: every token carries three
// position ids (temporal, height, width) and each rotation pair of a head turns at the id of the
// stream it belongs to. The tables and the rotation kernels are rope.hpp's; any RopeTable (plain,
// YaRN, from_frequencies) can be applied this way.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/rope.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>

namespace apex {

/// How the h = d_r/2 rotation pairs of a head are divided among the three streams (t =
/// temporal, h = height, w = width) for mrope_section = [s_t, s_h, s_w], s_t + s_h + s_w = d_r/2.
/// The pair index i is the one of RopePairing: features (2i, 2i+1) or (i, i + d_r/2).
///
///   kSections (Qwen2-VL, Qwen2.5-VL), e.g. [16, 24, 24] for 64 pairs: three contiguous blocks
///     pair    0 ... 15 | 16 ... 39 | 40 ... 63
///     stream  t ...  t | h  ...  h | w  ...  w
///   HuggingFace (transformers, models/qwen2_vl/modeling_qwen2_vl.py,
///   apply_multimodal_rotary_pos_emb) splits its full-width half-split cos/sin by
///   mrope_section * 2 and takes chunk k from stream k % 3, so both features of a pair share
///   the stream given here.
///
///   kInterleaved (Qwen3-VL), e.g. [24, 20, 20] for 64 pairs: t, h, w in turn, then t
///     pair    0 1 2 3 4 5 ... 57 58 59 60 61 62 63
///     stream  t h w t h w ...  t  h  w  t  t  t  t
///   pair i is h when i % 3 == 1 and i < 3·s_h, w when i % 3 == 2 and i < 3·s_w, t otherwise
///   (transformers, models/qwen3_vl/modeling_qwen3_vl.py,
///   Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope: freqs_t[..., offset:3·s:3] =
///   freqs[dim] for (dim, offset) = (1, 1), (2, 2)).
enum class MropeLayout { kSections, kInterleaved };

/// The three stream sizes of M-RoPE (a checkpoint's `mrope_section`) and their layout. The
/// sizes are counted in rotation pairs and must sum to the table's rotary_dim / 2.
struct MropeSections {
  std::array<Index, 3> sections{};              ///< [s_t, s_h, s_w], pairs per stream
  MropeLayout layout = MropeLayout::kSections;  ///< contiguous sections or Qwen3-VL's interleaving
};

/// The stream (0 = temporal, 1 = height, 2 = width) whose position id turns rotation pair
/// `pair`, per the layout (see MropeLayout). O(1); the sections are not checked here.
inline int mrope_stream(const MropeSections& m, Index pair) {
  const std::array<Index, 3>& s = m.sections;
  if (m.layout == MropeLayout::kSections) {
    if (pair < s[0]) return 0;
    return pair < s[0] + s[1] ? 1 : 2;
  }
  if (pair % 3 == 1 && pair < 3 * s[1]) return 1;
  if (pair % 3 == 2 && pair < 3 * s[2]) return 2;
  return 0;
}

/// Throws std::invalid_argument unless `m` fits a table of rotary width `rotary_dim`: every
/// section ≥ 0 and s_t + s_h + s_w = rotary_dim / 2; for kInterleaved also the last height pair
/// 3·s_h − 2 and the last width pair 3·s_w − 1 lie below rotary_dim / 2, so that each stream
/// turns exactly its section's number of pairs. O(1), no allocation.
inline void check_mrope_sections(const MropeSections& m, Index rotary_dim) {
  const std::array<Index, 3>& s = m.sections;
  const Index pairs = rotary_dim / 2;
  for (std::size_t k = 0; k < 3; ++k) {
    APEX_CHECK(s[k] >= 0, "[mrope] mrope_section (" << s[0] << ", " << s[1] << ", " << s[2]
                                                    << ") must not be negative: mrope_section[" << k
                                                    << "] is " << s[k]);
  }
  // One section at a time, so that huge sections cannot overflow the sum.
  APEX_CHECK(s[0] <= pairs && s[1] <= pairs - s[0] && s[2] == pairs - s[0] - s[1],
             "[mrope] mrope_section (" << s[0] << ", " << s[1] << ", " << s[2]
                                       << ") must sum to rotary_dim / 2 (" << pairs << ")");
  if (m.layout != MropeLayout::kInterleaved) return;
  APEX_CHECK(s[1] == 0 || 3 * s[1] - 2 < pairs,
             "[mrope] interleaved mrope_section ("
                 << s[0] << ", " << s[1] << ", " << s[2] << "): the last height pair 3 * " << s[1]
                 << " - 2 (" << 3 * s[1] - 2 << ") must be below rotary_dim / 2 (" << pairs << ")");
  APEX_CHECK(s[2] == 0 || 3 * s[2] - 1 < pairs,
             "[mrope] interleaved mrope_section ("
                 << s[0] << ", " << s[1] << ", " << s[2] << "): the last width pair 3 * " << s[2]
                 << " - 1 (" << 3 * s[2] - 1 << ") must be below rotary_dim / 2 (" << pairs << ")");
}

namespace detail {

constexpr const char* mrope_stream_name(int stream) {
  return stream == 0 ? "temporal" : stream == 1 ? "height" : "width";
}

// What a row of x looks like to the kernel: `heads` heads of head_dim features side by side,
// the first rotary_dim of each rotating, pairs laid out per the table's pairing.
struct MropeRowShape {
  Index heads = 0;
  Index head_dim = 0;
  Index rotary_dim = 0;
  bool interleaved = true;  // RopePairing::kInterleaved, else kHalfSplit
};

// Copies both table entries of the pairs [begin, end) from `row` to `out` (table-row layout).
template <class Scalar>
void copy_mrope_pairs(const Scalar* row, Index begin, Index end, const MropeRowShape& shape,
                      Scalar* out) {
  if (shape.interleaved) {
    std::copy(row + 2 * begin, row + 2 * end, out + 2 * begin);
  } else {
    const Index half = shape.rotary_dim / 2;
    std::copy(row + begin, row + end, out + begin);
    std::copy(row + half + begin, row + half + end, out + half + begin);
  }
}

// The table row a token uses, laid out as a RopeTable row: both entries of each pair from the
// row of the pair's stream (rows[k]: the table row at the token's id in stream k). As
// HuggingFace builds it: the temporal row everywhere, then the height and width pairs over it.
template <class Scalar>
void gather_mrope_row(const std::array<const Scalar*, 3>& rows, const MropeSections& m,
                      const MropeRowShape& shape, Scalar* out) {
  const std::array<Index, 3>& s = m.sections;
  std::copy(rows[0], rows[0] + shape.rotary_dim, out);
  if (m.layout == MropeLayout::kSections) {
    copy_mrope_pairs(rows[1], s[0], s[0] + s[1], shape, out);
    copy_mrope_pairs(rows[2], s[0] + s[1], s[0] + s[1] + s[2], shape, out);
    return;
  }
  // One pair at a time: two assignments, not two calls of memmove.
  const Index b = shape.interleaved ? 1 : shape.rotary_dim / 2;  // feature b − feature a
  const Index step = shape.interleaved ? 2 : 1;                  // feature a of pair i: step·i
  for (Index i = 1; i < 3 * s[1]; i += 3) {
    out[step * i] = rows[1][step * i];
    out[step * i + b] = rows[1][step * i + b];
  }
  for (Index i = 2; i < 3 * s[2]; i += 3) {
    out[step * i] = rows[2][step * i];
    out[step * i + b] = rows[2][step * i + b];
  }
}

// The widest rotary part (features) whose per-token cos/sin rows are gathered on the stack:
// it covers every checkpoint's head (64 to 256 features) in 2 KiB of float per table.
constexpr Index kMropeGatherWidth = 512;

// One row of x (cos[k], sin[k]: the table rows at the token's id in stream k). The token's
// cos/sin rows are gathered once and every head turns with rope.hpp's kernels: the stream
// lookup is paid per row, not per head, and a head turns by exactly apply_rope's code (equal
// ids give its bits). A wider rotary part turns pair by pair straight from the table rows,
// with the same expressions. Transposed turns each pair the other way (apply_mrope_backward).
template <bool Transposed, class Scalar, class X>
void mrope_row(const std::array<const Scalar*, 3>& cos, const std::array<const Scalar*, 3>& sin,
               const MropeSections& m, const MropeRowShape& shape, X* row) {
  const Index d_r = shape.rotary_dim;
  if (d_r > kMropeGatherWidth) {
    for (Index i = 0; i < d_r / 2; ++i) {
      const auto k = static_cast<std::size_t>(mrope_stream(m, i));
      for (Index h = 0; h < shape.heads; ++h) {
        X* head = row + h * shape.head_dim;
        if (shape.interleaved) {
          rope_head_interleaved<Transposed>(cos[k] + 2 * i, sin[k] + 2 * i, head + 2 * i, 2);
        } else {
          rope_pairs_half_split<Transposed>(cos[k] + i, sin[k] + i, head + i, 1, d_r / 2);
        }
      }
    }
    return;
  }
  std::array<Scalar, kMropeGatherWidth> c;  // [0, d_r) is written before it is read
  std::array<Scalar, kMropeGatherWidth> s;
  gather_mrope_row(cos, m, shape, c.data());
  gather_mrope_row(sin, m, shape, s.data());
  for (Index h = 0; h < shape.heads; ++h) {
    X* head = row + h * shape.head_dim;
    if (shape.interleaved) {
      rope_head_interleaved<Transposed>(c.data(), s.data(), head, d_r);
    } else {
      rope_head_half_split<Transposed>(c.data(), s.data(), head, d_r);
    }
  }
}

// Rotates every row t of x with the table rows at ids(0, t), ids(1, t), ids(2, t); everything
// has been checked. Threads over rows (static schedule) as apply_rope_rows does.
template <bool Transposed, class Scalar, class X, class DerivedIds>
void apply_mrope_rows(const RopeTable<Scalar>& table, const MropeSections& m, const DerivedIds& ids,
                      RowRef<X> x) {
  const Index rows = x.rows();
  const Index rotary_dim = table.rotary_dim();
  const MropeRowShape shape{x.cols() / table.head_dim(), table.head_dim(), rotary_dim,
                            table.pairing() == RopePairing::kInterleaved};
  const Index stride = x.outerStride();
  X* const data = x.data();
  const Scalar* const cos = table.cos().data();
  const Scalar* const sin = table.sin().data();
  // Forking a thread team costs microseconds; below ~64K elements one thread is faster.
  const Index min_parallel = rows * x.cols() >= (Index{1} << 16) ? 2 : rows + 1;
  parallel_for(
      rows,
      [&](Index t) {
        std::array<const Scalar*, 3> c{}, s{};
        for (std::size_t k = 0; k < 3; ++k) {
          const Index offset = static_cast<Index>(ids(static_cast<Index>(k), t)) * rotary_dim;
          c[k] = cos + offset;
          s[k] = sin + offset;
        }
        mrope_row<Transposed>(c, s, m, shape, data + t * stride);
      },
      min_parallel);
}

template <class Scalar, class DerivedIds>
void check_mrope_ids(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& ids,
                     Index rows) {
  static_assert(std::is_integral_v<typename DerivedIds::Scalar>,
                "[mrope] position ids must have an integer scalar type");
  APEX_CHECK(ids.rows() == 3 && ids.cols() == rows,
             "[mrope] position_ids shape [" << ids.rows() << ", " << ids.cols()
                                            << "] must be [3, x.rows()] = [3, " << rows << "]");
  for (Index k = 0; k < 3; ++k) {
    for (Index t = 0; t < rows; ++t) {
      const auto id = ids(k, t);
      APEX_CHECK(position_in_table(id, table.max_positions()),
                 "[mrope] position id (" << +id << ") of stream " << k << " ("
                                         << mrope_stream_name(static_cast<int>(k)) << ") at row "
                                         << t << " must be in [0, max_positions) = [0, "
                                         << table.max_positions() << ")");
    }
  }
}

/// apply_mrope (or, Transposed, apply_mrope_backward) on rows of any storage type X: every
/// check, then the rotation.
template <bool Transposed = false, class Scalar, class DerivedIds, class X>
void mrope_at_ids(const RopeTable<Scalar>& table, const MropeSections& sections,
                  const Eigen::MatrixBase<DerivedIds>& position_ids, RowRef<X> x) {
  require_supported_scalar<Scalar>();
  check_constructed(table.max_positions() >= 1, "mrope", "table");
  APEX_CHECK(x.cols() % table.head_dim() == 0,
             "[mrope] x.cols() (" << x.cols() << ") must be a multiple of the table's head_dim ("
                                  << table.head_dim() << ")");
  check_mrope_sections(sections, table.rotary_dim());
  check_mrope_ids(table, position_ids, x.rows());
  require_storage_type<X>();
  apply_mrope_rows<Transposed>(table, sections, position_ids.derived(), x);
}

}  // namespace detail

/// Multimodal RoPE in place (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): row t turns every rotation pair i
/// of every head by the angle p_{k(i)}(t)·θ_i, where k(i) = mrope_stream(sections, i) and
/// p_k(t) = position_ids(k, t), i.e. with the table's cos/sin at row position_ids(k(i), t):
///   (a, b) -> (a·cos − b·sin, b·cos + a·sin)   (times the table's magnitude).
/// When the three ids of a token are equal this is apply_rope at that id, bit for bit (text
/// tokens). table: any RopeTable, either pairing, partial rotary (features past rotary_dim in
/// each head are unchanged). position_ids: an integer Eigen matrix [3, tokens] (rows temporal,
/// height, width; any integer type). x: [tokens, H·head_dim] (heads side by side) with any row
/// stride. Checks everything (table, width, sections, shape, every id of all three streams)
/// before x is touched. Threads over rows (static schedule: the same bits for any thread
/// count); allocates nothing (each row gathers its cos/sin rows into 2 · 512 scalars on the
/// stack and turns its heads with rope.hpp's kernels; rotary parts wider than 512 features are
/// turned pair by pair straight from the table).
template <class Scalar, class DerivedIds>
void apply_mrope(const RopeTable<Scalar>& table, const MropeSections& sections,
                 const Eigen::MatrixBase<DerivedIds>& position_ids,
                 RowRef<typename RopeTable<Scalar>::ScalarType> x) {
  detail::mrope_at_ids(table, sections, position_ids, x);
}
/// Multimodal RoPE in place on half rows: each pair is widened to the table's type, rotated and
/// rounded once back (round_to), as apply_rope does.
template <class Scalar, class DerivedIds>
void apply_mrope(const RopeTable<Scalar>& table, const MropeSections& sections,
                 const Eigen::MatrixBase<DerivedIds>& position_ids, RowRef<Eigen::half> x) {
  detail::mrope_at_ids(table, sections, position_ids, x);
}
/// Multimodal RoPE in place on bfloat16 rows (widened, rotated, rounded once).
template <class Scalar, class DerivedIds>
void apply_mrope(const RopeTable<Scalar>& table, const MropeSections& sections,
                 const Eigen::MatrixBase<DerivedIds>& position_ids, RowRef<Eigen::bfloat16> x) {
  detail::mrope_at_ids(table, sections, position_ids, x);
}

/// The backward pass of multimodal RoPE, in place: turns d_x, the gradient by the rotated rows,
/// into the gradient by the rows before rotation, each pair turned back by the transposed
/// rotation, (a, b) -> (a·cos + b·sin, b·cos − a·sin), at the angles apply_mrope used (the same
/// table, sections and position_ids). d_x: [tokens, H·head_dim] of float, double, half or
/// bfloat16. Checks and threads as apply_mrope; allocates nothing.
template <class Scalar, class DerivedIds, class Derived>
void apply_mrope_backward(const RopeTable<Scalar>& table, const MropeSections& sections,
                          const Eigen::MatrixBase<DerivedIds>& position_ids,
                          const Eigen::MatrixBase<Derived>& d_x) {
  detail::mrope_at_ids<true>(table, sections, position_ids,
                             RowRef<typename Derived::Scalar>(const_cast<Derived&>(d_x.derived())));
}

/// Value-returning form of apply_mrope: returns M-RoPE(x) as a new [tokens, cols] matrix (which
/// it allocates) and leaves x alone.
template <class Derived, class DerivedIds>
RowMatrix<typename Derived::Scalar> mrope(const RopeTable<typename Derived::Scalar>& table,
                                          const MropeSections& sections,
                                          const Eigen::MatrixBase<DerivedIds>& position_ids,
                                          const Eigen::MatrixBase<Derived>& x) {
  detail::require_supported_scalar<typename Derived::Scalar>();
  RowMatrix<typename Derived::Scalar> out = x;  // apply_mrope checks everything before rotating
  apply_mrope(table, sections, position_ids, out);
  return out;
}

}  // namespace apex
