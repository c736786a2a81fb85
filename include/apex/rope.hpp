// SPDX-License-Identifier: MIT
// Rotary position embedding (§4): the frequency table θ_i, precomputed cos/sin tables, and the
// in-place rotation of query and key rows. A table is built once and applied many times.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace apex {

/// Which two features of a head form one rotation pair (rotary width d_r, h = d_r / 2).
///
///   kInterleaved (§4.4, the default): pairs (2i, 2i+1)
///     features   | x0  x1 | x2  x3 | ... |     rotate_half(x) = [-x1, x0, -x3, x2, ...]
///     cos row    | c0  c0 | c1  c1 | ... |     c_i = cos(m·θ_i)
///
///   kHalfSplit (Llama, GPT-NeoX and HuggingFace checkpoints): pairs (i, i + h)
///     features   | x0 x1 ... x_{h-1} | x_h ... x_{2h-1} |   rotate_half(x) = [-x_h.., x0..]
///     cos row    | c0 c1 ... c_{h-1} | c0  ... c_{h-1}  |
///
/// Both compute the same rotation of each pair; weights trained with one pairing need that
/// pairing (or a permutation of their projection columns).
enum class RopePairing { kInterleaved, kHalfSplit };

/// How user-supplied cos/sin values are laid out (RopeTable::from_cos_sin).
///   kHalf: [P, d_r/2], one value per pair (ONNX RotaryEmbedding, FlashAttention).
///   kFull: [P, d_r], already laid out per the pairing as in RopeTable::cos() (HuggingFace).
enum class RopeCacheWidth { kHalf, kFull };

/// Parameters of a plain RoPE table. The defaults are the document's (§4.2, §4.4).
struct RopeParams {
  double base = 10000.0;  ///< b in θ_i = b^(-2i/d_r)
  /// Number of leading features of each head that rotate (even). 0 means the whole head.
  /// Features [rotary_dim, head_dim) pass through unchanged (partial rotary, as in GPT-NeoX).
  Index rotary_dim = 0;
  /// Which features form a rotated pair: (2i, 2i+1) as §4.4 writes it (the default), or
  /// (i, i + d_r/2) for Llama, GPT-NeoX and HuggingFace checkpoints.
  RopePairing pairing = RopePairing::kInterleaved;
};

namespace detail {

template <class Scalar>
constexpr const char* rope_scalar_name() {
  return std::is_same_v<Scalar, float> ? "float" : "double";
}

inline void check_rope_rotary_dim(Index rotary_dim) {
  APEX_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0,
             "[rope] rotary_dim (" << rotary_dim << ") must be even and at least 2");
}

inline void check_rope_base(double base) {
  APEX_CHECK(std::isfinite(base) && base > 1.0,
             "[rope] base (" << base << ") must be finite and greater than 1");
}

inline void check_rope_max_positions(Index max_positions, const char* op) {
  APEX_CHECK(max_positions >= 1,
             "[" << op << "] max_positions (" << max_positions << ") must be at least 1");
}

// The cos and sin tables hold 2 · max_positions · rotary_dim scalars. The entry count must be
// an addressable Index and the byte count must fit in 64 bits; a larger request is a wrong
// argument (rejected before anything is allocated), not an out-of-memory condition.
template <class Scalar>
void check_rope_table_size(Index max_positions, Index rotary_dim, const char* op) {
  const std::int64_t entries =
      checked_product(max_positions, rotary_dim, op, "table entries max_positions x rotary_dim");
  checked_product(entries, 2 * static_cast<std::int64_t>(sizeof(Scalar)), op,
                  "table bytes (max_positions * rotary_dim) x (2 tables * sizeof(Scalar))");
}

// Every entry is magnitude · cos or magnitude · sin (|·| ≤ magnitude), rounded to Scalar. Above
// Scalar's largest value the entries become infinite; below its smallest normal value they
// flush towards zero and lose their precision. Both are rejected (NaN fails the comparison).
template <class Scalar>
void check_rope_magnitude(double magnitude, const char* op, const char* what) {
  constexpr double lowest = static_cast<double>(std::numeric_limits<Scalar>::min());
  constexpr double highest = static_cast<double>(std::numeric_limits<Scalar>::max());
  APEX_CHECK(magnitude >= lowest && magnitude <= highest,
             "[" << op << "] " << what << " (" << magnitude
                 << ") must be finite, > 0 and within the normal range of "
                 << rope_scalar_name<Scalar>() << " [" << lowest << ", " << highest
                 << "], so that every table entry is finite");
}

// Each θ_i finite and ≥ 0, and the largest angle (max_positions − 1)·max θ finite in double:
// cos and sin of a finite angle are finite, but an angle that overflows to inf gives NaN.
// The table forms m·θ_i for m ≤ max_positions − 1, and rounding is monotone, so no angle
// exceeds the one checked here. O(θ.size()), no allocation.
inline void check_rope_theta(const Vector<double>& theta, Index max_positions) {
  double largest = 0.0;
  for (Index i = 0; i < theta.size(); ++i) {
    APEX_CHECK(std::isfinite(theta(i)) && theta(i) >= 0.0,
               "[rope] theta[" << i << "] (" << theta(i) << ") must be finite and >= 0");
    largest = std::max(largest, theta(i));
  }
  const double last = static_cast<double>(max_positions - 1);
  APEX_CHECK(std::isfinite(last * largest),
             "[rope] the largest angle (max_positions - 1) * max theta = ("
                 << last << ") * (" << largest
                 << ") must be finite in double (cos and sin of an infinite angle are NaN)");
}

// The rotary width of a table of max_positions positions for heads head_dim wide, from a
// requested rotary_dim (0: the whole head), with every check of that shape and of the table's
// size, before anything is allocated.
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of RopeTable's arguments
Index checked_rotary_dim(Index max_positions, Index head_dim, Index rotary_dim) {
  check_rope_max_positions(max_positions, "rope");
  APEX_CHECK(rotary_dim != 0 || (head_dim >= 2 && head_dim % 2 == 0),
             "[rope] head_dim (" << head_dim
                                 << ") must be even and at least 2 when rotary_dim is 0 "
                                    "(the whole head rotates)");
  const Index d_r = rotary_dim == 0 ? head_dim : rotary_dim;
  check_rope_rotary_dim(d_r);
  APEX_CHECK(d_r <= head_dim,
             "[rope] rotary_dim (" << d_r << ") must not exceed head_dim (" << head_dim << ")");
  check_rope_table_size<Scalar>(max_positions, d_r, "rope");
  return d_r;
}

}  // namespace detail

/// θ_i = base^(-2i/d_r) for i = 0 … d_r/2 − 1 (§4.3), in double precision.
/// Note: §4.3's table for d_h = 8 (0.0316, 0.0010, …) does not follow its own formula; the
/// formula is implemented (θ = 1, 0.1, 0.01, 0.001), see SEED-NOTES.md.
/// Returns a vector of d_r/2 frequencies (allocates it).
inline Vector<double> rope_frequencies(Index rotary_dim, double base) {
  detail::check_rope_rotary_dim(rotary_dim);
  detail::check_rope_base(base);
  const Index pairs = rotary_dim / 2;
  Vector<double> theta(pairs);
  for (Index i = 0; i < pairs; ++i) {
    theta(i) = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
  }
  return theta;
}

/// Precomputed cos/sin tables of §4.7 for positions 0 … max_positions − 1, shape
/// [max_positions, rotary_dim] each, laid out according to the pairing:
///   kInterleaved: cos[m, 2i] = cos[m, 2i+1] = magnitude · cos(m·θ_i)
///   kHalfSplit:   cos[m, i]  = cos[m, i + d_r/2] = magnitude · cos(m·θ_i)
/// (sin likewise). Each angle m·θ_i is formed directly in double precision (never accumulated
/// over m) and only the cosine and sine are rounded to Scalar: in float, m·θ itself would be
/// off by up to ~0.06 rad at m = 10^6 (SEED-NOTES.md, §4.7). Memory: 2 · max_positions ·
/// rotary_dim scalars; every constructor checks all of its arguments, and that this size fits
/// in 64-bit byte counts, before allocating anything, and every table it builds is finite.
///
/// head_dim is the width of one head in the rows the table is applied to; it may exceed
/// rotary_dim, in which case the trailing head_dim − rotary_dim features of every head are left
/// unchanged (partial rotary; MLA's decoupled RoPE rotates a separate block instead).
template <class Scalar>
class RopeTable {
 public:
  /// The scalar type of the table entries (float or double).
  using ScalarType = Scalar;

  /// An empty table (max_positions() = 0), as a moved-from one is: apply_rope rejects it.
  RopeTable() = default;

  /// The plain RoPE table (§4.3, §4.7): θ_i = base^(-2i/d_r), magnitude 1.
  RopeTable(Index max_positions, Index head_dim, const RopeParams& params = {}) {
    detail::require_supported_scalar<Scalar>();
    const Index rotary_dim =
        detail::checked_rotary_dim<Scalar>(max_positions, head_dim, params.rotary_dim);
    detail::check_rope_base(params.base);
    // θ ∈ (0, 1] and magnitude 1: build() cannot reject what follows.
    build(rope_frequencies(rotary_dim, params.base), max_positions, head_dim, params.pairing, 1.0);
  }

  /// A table for arbitrary frequencies θ (d_r = 2·θ.size()), e.g. YaRN's (§5). Every cos and
  /// sin entry is multiplied by `magnitude`, which is how an attention factor that scales both
  /// q and k is baked into the tables (the logits of rotated features then grow by
  /// magnitude²). θ_i must be finite and ≥ 0 with (max_positions − 1)·max_i θ_i finite in
  /// double (so that every angle, and hence every entry, is finite); magnitude must lie in the
  /// normal range of Scalar (so that magnitude·cos rounds to a finite, non-flushed Scalar).
  static RopeTable from_frequencies(const Vector<double>& theta, Index max_positions,
                                    Index head_dim, RopePairing pairing, double magnitude = 1.0) {
    detail::require_supported_scalar<Scalar>();
    RopeTable table;
    table.build(theta, max_positions, head_dim, pairing, magnitude);
    return table;
  }

  /// A table from user-supplied values (as ONNX RotaryEmbedding and FlashAttention take them).
  /// cos, sin: [P, d_r/2] for RopeCacheWidth::kHalf (one value per pair, spread over the pair
  /// here), or [P, d_r] for RopeCacheWidth::kFull, already laid out per `pairing` exactly as
  /// cos() returns it; in the full-width form the two entries of a pair are used as given and
  /// are not checked to agree. Values are converted to Scalar. The width must be stated because
  /// a [P, 64] cache for 128-wide heads may mean either layout. Every value must be finite and
  /// within Scalar's range (checked before anything is allocated).
  template <class DerivedCos, class DerivedSin>
  static RopeTable from_cos_sin(const Eigen::MatrixBase<DerivedCos>& cos,
                                const Eigen::MatrixBase<DerivedSin>& sin, Index head_dim,
                                RopePairing pairing, RopeCacheWidth width) {
    detail::require_supported_scalar<Scalar>();
    APEX_CHECK(sin.rows() == cos.rows() && sin.cols() == cos.cols(),
               "[rope] sin shape [" << sin.rows() << ", " << sin.cols()
                                    << "] must equal cos shape [" << cos.rows() << ", "
                                    << cos.cols() << "]");
    APEX_CHECK(cos.rows() >= 1,
               "[rope] cos/sin rows (max_positions) (" << cos.rows() << ") must be at least 1");
    const bool half = width == RopeCacheWidth::kHalf;
    APEX_CHECK(cos.cols() >= 1 && (half || cos.cols() % 2 == 0),
               "[rope] cos/sin width (" << cos.cols() << ") must be "
                                        << (half ? "at least 1 (d_r/2, half width)"
                                                 : "even and at least 2 (d_r, full width)"));
    const Index rotary_dim = half ? 2 * cos.cols() : cos.cols();
    APEX_CHECK(rotary_dim <= head_dim, "[rope] rotary_dim implied by cos/sin ("
                                           << rotary_dim << ") must not exceed head_dim ("
                                           << head_dim << ")");
    detail::check_rope_table_size<Scalar>(cos.rows(), rotary_dim, "rope");
    check_values(cos, "cos");
    check_values(sin, "sin");
    RopeTable table;
    table.head_dim_ = head_dim;
    table.rotary_dim_ = rotary_dim;
    table.pairing_ = pairing;
    if (!half) {
      table.cos_ = cos.template cast<Scalar>();
      table.sin_ = sin.template cast<Scalar>();
      return table;
    }
    const Index positions = cos.rows();
    table.cos_.resize(positions, rotary_dim);
    table.sin_.resize(positions, rotary_dim);
    for (Index m = 0; m < positions; ++m) {
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        table.store(m, i, static_cast<Scalar>(cos(m, i)), static_cast<Scalar>(sin(m, i)));
      }
    }
    return table;
  }

  /// Number of positions P the table covers: positions [0, P) can be rotated.
  Index max_positions() const { return cos_.rows(); }
  /// Width of one head in the rows the table is applied to (>= rotary_dim()).
  Index head_dim() const { return head_dim_; }
  /// d_r: leading features of each head that rotate (even); the rest pass through.
  Index rotary_dim() const { return rotary_dim_; }
  /// Which features form a rotated pair; fixes the layout of cos() and sin().
  RopePairing pairing() const { return pairing_; }
  /// [max_positions, rotary_dim] cosines cos(m·θ_i) (times from_frequencies' magnitude), laid
  /// out per pairing() (see the class comment).
  const RowMatrix<Scalar>& cos() const { return cos_; }
  /// [max_positions, rotary_dim] sines, same layout and magnitude as cos().
  const RowMatrix<Scalar>& sin() const { return sin_; }

 private:
  // User-supplied cos/sin values: finite and within Scalar's range, so that the converted
  // table is finite (compared in double: converting an out-of-range value is undefined).
  template <class Derived>
  static void check_values(const Eigen::MatrixBase<Derived>& values, const char* name) {
    constexpr double highest = static_cast<double>(std::numeric_limits<Scalar>::max());
    for (Index m = 0; m < values.rows(); ++m) {
      for (Index j = 0; j < values.cols(); ++j) {
        const double v = static_cast<double>(values(m, j));
        APEX_CHECK(std::isfinite(v) && std::abs(v) <= highest,
                   "[rope] " << name << "(" << m << ", " << j << ") (" << v
                             << ") must be finite and at most " << highest << " in magnitude ("
                             << detail::rope_scalar_name<Scalar>() << ")");
      }
    }
  }

  // Checks every argument, then allocates and fills the tables.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, as the public constructors
  void build(const Vector<double>& theta, Index max_positions, Index head_dim, RopePairing pairing,
             double magnitude) {
    APEX_CHECK(theta.size() >= 1,
               "[rope] theta size (" << theta.size() << ") must be at least 1 (one pair)");
    detail::check_rope_max_positions(max_positions, "rope");
    const Index rotary_dim = 2 * theta.size();
    APEX_CHECK(head_dim >= rotary_dim, "[rope] head_dim (" << head_dim
                                                           << ") must be at least rotary_dim ("
                                                           << rotary_dim << ")");
    detail::check_rope_table_size<Scalar>(max_positions, rotary_dim, "rope");
    detail::check_rope_magnitude<Scalar>(magnitude, "rope", "magnitude");
    detail::check_rope_theta(theta, max_positions);
    head_dim_ = head_dim;
    rotary_dim_ = rotary_dim;
    pairing_ = pairing;
    cos_.resize(max_positions, rotary_dim);
    sin_.resize(max_positions, rotary_dim);
    const Index pairs = theta.size();
    // One row per position, rows independent: the same values for any thread count. Small
    // tables are not worth a thread team.
    const Index min_parallel = max_positions * pairs >= (Index{1} << 14) ? 2 : max_positions + 1;
    detail::parallel_for(
        max_positions,
        [&](Index m) {
          for (Index i = 0; i < pairs; ++i) {
            // m·θ_i formed directly in double (m < 2^53 is exact), never accumulated over m.
            const double angle = static_cast<double>(m) * theta(i);
            store(m, i, static_cast<Scalar>(magnitude * std::cos(angle)),
                  static_cast<Scalar>(magnitude * std::sin(angle)));
          }
        },
        min_parallel);
  }

  // Writes the cos/sin of pair i at position m into both features of the pair.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, (position, pair, cos, sin)
  void store(Index m, Index i, Scalar c, Scalar s) {
    const Index a = pairing_ == RopePairing::kInterleaved ? 2 * i : i;
    const Index b = pairing_ == RopePairing::kInterleaved ? 2 * i + 1 : i + rotary_dim_ / 2;
    cos_(m, a) = c;
    cos_(m, b) = c;
    sin_(m, a) = s;
    sin_(m, b) = s;
  }

  detail::ResetOnMove<Index> head_dim_;
  detail::ResetOnMove<Index> rotary_dim_;
  RopePairing pairing_ = RopePairing::kInterleaved;
  RowMatrix<Scalar> cos_;  // Eigen leaves a moved-from matrix empty
  RowMatrix<Scalar> sin_;
};

namespace detail {

// One head, in place: x' = x ⊙ cos + rotate_half(x) ⊙ sin on the rotary features (§4.4),
// i.e. the 2×2 rotation of §4.2 on each pair (a, b):  a' = a·c − b·s,  b' = b·c + a·s.
// Written as plain loops over contiguous data so that the compiler vectorises them: for
// half-split the two halves are two contiguous streams; for interleaved the pair loop becomes
// x·cos ∓ swap_pairs(x)·sin (a permute and a fused multiply-add/subtract per vector). Rows of
// another storage type X (16 bits) are widened to the table's Scalar and each result rounded
// once back to X. Transposed turns each pair the other way (sin negated, exactly): the
// transpose of the rotation, which is the backward pass of RoPE (apply_rope_backward).
template <bool Transposed = false, class Scalar, class X>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): detail, the table's (cos, sin) rows
inline void rope_head_interleaved(const Scalar* c, const Scalar* s, X* x, Index rotary_dim) {
  for (Index j = 0; j < rotary_dim; j += 2) {
    const auto a = static_cast<Scalar>(x[j]);
    const auto b = static_cast<Scalar>(x[j + 1]);
    const Scalar s0 = Transposed ? -s[j] : s[j];
    const Scalar s1 = Transposed ? -s[j + 1] : s[j + 1];
    x[j] = round_to<X>(a * c[j] - b * s0);
    x[j + 1] = round_to<X>(b * c[j + 1] + a * s1);
  }
}

// The half-split rotation of `count` consecutive pairs (i, i + half) of a head whose rotary
// width is 2·half, starting at c, s, x (already offset to the first pair): a whole head is
// count = half = d_r / 2 (rope_head_half_split); multimodal RoPE (mrope.hpp) turns runs of pairs.
template <bool Transposed = false, class Scalar, class X>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): detail, (pairs to turn, offset of b)
inline void rope_pairs_half_split(const Scalar* c, const Scalar* s, X* x, Index count, Index half) {
  X* lo = x;
  X* hi = x + half;
  const Scalar* c_hi = c + half;
  const Scalar* s_hi = s + half;
  for (Index i = 0; i < count; ++i) {
    const auto a = static_cast<Scalar>(lo[i]);
    const auto b = static_cast<Scalar>(hi[i]);
    const Scalar s_lo = Transposed ? -s[i] : s[i];
    const Scalar s_up = Transposed ? -s_hi[i] : s_hi[i];
    lo[i] = round_to<X>(a * c[i] - b * s_lo);
    hi[i] = round_to<X>(b * c_hi[i] + a * s_up);
  }
}

template <bool Transposed = false, class Scalar, class X>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): detail, the table's (cos, sin) rows
inline void rope_head_half_split(const Scalar* c, const Scalar* s, X* x, Index rotary_dim) {
  rope_pairs_half_split<Transposed>(c, s, x, rotary_dim / 2, rotary_dim / 2);
}

// Rotates every row of x (heads side by side) at the position position(t), or by the transposed
// rotation; positions have been checked. Threads over rows (static schedule); small problems stay
// on the calling thread.
template <bool Transposed = false, class Scalar, class X, class PositionOf>
void apply_rope_rows(const RopeTable<Scalar>& table, RowRef<X> x, PositionOf position) {
  const Index rows = x.rows();
  const Index head_dim = table.head_dim();
  const Index rotary_dim = table.rotary_dim();
  const Index heads = x.cols() / head_dim;
  const Index stride = x.outerStride();
  X* const data = x.data();
  const Scalar* const cos = table.cos().data();
  const Scalar* const sin = table.sin().data();
  // Forking a thread team costs microseconds; below ~64K elements one thread is faster.
  const Index min_parallel = rows * x.cols() >= (Index{1} << 16) ? 2 : rows + 1;
  const bool interleaved = table.pairing() == RopePairing::kInterleaved;
  parallel_for(
      rows,
      [&](Index t) {
        const Index offset = static_cast<Index>(position(t)) * rotary_dim;
        const Scalar* c = cos + offset;
        const Scalar* s = sin + offset;
        X* row = data + t * stride;
        if (interleaved) {
          for (Index h = 0; h < heads; ++h)
            rope_head_interleaved<Transposed>(c, s, row + h * head_dim, rotary_dim);
        } else {
          for (Index h = 0; h < heads; ++h)
            rope_head_half_split<Transposed>(c, s, row + h * head_dim, rotary_dim);
        }
      },
      min_parallel);
}

template <class Scalar>
void check_rope_width(const RopeTable<Scalar>& table, Index cols) {
  check_constructed(table.max_positions() >= 1, "rope", "table");
  APEX_CHECK(cols % table.head_dim() == 0,
             "[rope] x.cols() (" << cols << ") must be a multiple of the table's head_dim ("
                                 << table.head_dim() << ")");
}

template <class Scalar>
void check_rope_offset(const RopeTable<Scalar>& table, Index position_offset, Index rows) {
  APEX_CHECK(position_offset >= 0,
             "[rope] position_offset (" << position_offset << ") must be >= 0");
  // The first position past the table, if any, is max(position_offset, max_positions).
  const Index first_bad = std::max(position_offset, table.max_positions());
  APEX_CHECK(rows == 0 || position_offset <= table.max_positions() - rows,
             "[rope] position id (" << first_bad << ") of row " << first_bad - position_offset
                                    << " (position_offset " << position_offset << ", " << rows
                                    << " rows) must be below the table's max_positions ("
                                    << table.max_positions() << ")");
}

// True when id is a valid row of a table with `positions` rows, for any integer type.
template <class Id>
constexpr bool position_in_table(Id id, Index positions) {
  if constexpr (std::is_signed_v<Id>) {
    return id >= 0 && static_cast<long long>(id) < static_cast<long long>(positions);
  } else {
    return static_cast<unsigned long long>(id) < static_cast<unsigned long long>(positions);
  }
}

template <class Scalar, class DerivedIds>
void check_rope_ids(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& ids,
                    Index rows) {
  static_assert(std::is_integral_v<typename DerivedIds::Scalar>,
                "[rope] position ids must have an integer scalar type");
  static_assert(DerivedIds::IsVectorAtCompileTime, "[rope] position ids must be a vector");
  APEX_CHECK(ids.size() == rows, "[rope] position_ids size ("
                                     << ids.size() << ") must equal x.rows() (" << rows << ")");
  for (Index t = 0; t < rows; ++t) {
    const auto id = ids(t);
    APEX_CHECK(position_in_table(id, table.max_positions()),
               "[rope] position id (" << +id << ") at row " << t
                                      << " must be in [0, max_positions) = [0, "
                                      << table.max_positions() << ")");
  }
}

/// apply_rope (or, Transposed, apply_rope_backward) with a position offset on rows of any
/// storage type X.
template <bool Transposed = false, class Scalar, class X>
void rope_at_offset(const RopeTable<Scalar>& table, Index position_offset, RowRef<X> x) {
  require_supported_scalar<Scalar>();
  require_storage_type<X>();
  check_rope_width(table, x.cols());
  check_rope_offset(table, position_offset, x.rows());
  apply_rope_rows<Transposed>(table, x, [position_offset](Index t) { return position_offset + t; });
}

/// apply_rope (or, Transposed, apply_rope_backward) with explicit position ids on rows of any
/// storage type X.
template <bool Transposed = false, class Scalar, class DerivedIds, class X>
void rope_at_ids(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& position_ids,
                 RowRef<X> x) {
  require_supported_scalar<Scalar>();
  require_storage_type<X>();
  check_rope_width(table, x.cols());
  check_rope_ids(table, position_ids, x.rows());
  const DerivedIds& ids = position_ids.derived();
  apply_rope_rows<Transposed>(table, x, [&ids](Index t) { return ids(t); });
}

}  // namespace detail

/// RoPE in place (§4.4): x' = x ⊙ cos(mΘ) + rotate_half(x) ⊙ sin(mΘ), row t at position
/// m = position_offset + t (a prompt starting at 0, or a decode step at the cache length).
/// x: [tokens, H·head_dim] (heads side by side, as a projection produces them) or one head
/// [tokens, head_dim]; every head of a row is rotated at that row's position, and features past
/// the table's rotary_dim in each head are unchanged. Any row stride is accepted (e.g. a block
/// of columns of a wider matrix). Every position is checked before x is touched. Threads over
/// rows; allocates nothing.
template <class Scalar>
void apply_rope(const RopeTable<Scalar>& table, Index position_offset,
                RowRef<typename RopeTable<Scalar>::ScalarType> x) {
  detail::rope_at_offset(table, position_offset, x);
}

/// RoPE in place on 16-bit rows (Eigen::half or Eigen::bfloat16) with a table of float or
/// double: each pair is widened, rotated in the table's type and rounded once back (round_to).
template <class Scalar>
void apply_rope(const RopeTable<Scalar>& table, Index position_offset, RowRef<Eigen::half> x) {
  detail::rope_at_offset(table, position_offset, x);
}
/// RoPE in place on bfloat16 rows, as for half rows.
template <class Scalar>
void apply_rope(const RopeTable<Scalar>& table, Index position_offset, RowRef<Eigen::bfloat16> x) {
  detail::rope_at_offset(table, position_offset, x);
}

/// RoPE in place with explicit positions: row t at position position_ids(t) (packed sequences,
/// left padding, speculative decoding). position_ids: an Eigen vector of any integer type
/// (Index, std::int64_t, int) with one id per row of x; each must lie in [0, max_positions).
/// x as for the offset form (16-bit rows too). Everything is checked before x is touched;
/// allocates nothing.
template <class Scalar, class DerivedIds>
void apply_rope(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& position_ids,
                RowRef<typename RopeTable<Scalar>::ScalarType> x) {
  detail::rope_at_ids(table, position_ids, x);
}
/// RoPE in place with explicit positions on half rows (widened, rotated, rounded once).
template <class Scalar, class DerivedIds>
void apply_rope(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& position_ids,
                RowRef<Eigen::half> x) {
  detail::rope_at_ids(table, position_ids, x);
}
/// RoPE in place with explicit positions on bfloat16 rows (widened, rotated, rounded once).
template <class Scalar, class DerivedIds>
void apply_rope(const RopeTable<Scalar>& table, const Eigen::MatrixBase<DerivedIds>& position_ids,
                RowRef<Eigen::bfloat16> x) {
  detail::rope_at_ids(table, position_ids, x);
}

/// The backward pass of RoPE, in place: turns d_x, the gradient of a loss by the rotated rows,
/// into its gradient by the rows before rotation, dx = Rᵀ·dy per pair (the transposed rotation:
/// a' = a·cos + b·sin, b' = b·cos − a·sin), row t at position m = position_offset + t as
/// apply_rope took it. Every table kind (plain, YaRN with its magnitude, the scalings of
/// rope_scaling.hpp, user cos/sin) is a rotation times a magnitude per pair, whose transpose
/// this is; features past rotary_dim pass their gradient through unchanged. d_x: [tokens,
/// H·head_dim] of float, double, half or bfloat16 (a row-major matrix, Map, Ref or block with
/// contiguous rows), as for apply_rope. Every position is checked before d_x is touched; threads
/// over rows; allocates nothing.
template <class Scalar, class Derived>
void apply_rope_backward(const RopeTable<Scalar>& table, Index position_offset,
                         const Eigen::MatrixBase<Derived>& d_x) {
  detail::rope_at_offset<true>(
      table, position_offset,
      RowRef<typename Derived::Scalar>(const_cast<Derived&>(d_x.derived())));
}

/// The backward pass of RoPE with explicit positions: row t at position_ids(t), as apply_rope
/// with ids took it; otherwise as the offset form above.
template <class Scalar, class DerivedIds, class Derived>
void apply_rope_backward(const RopeTable<Scalar>& table,
                         const Eigen::MatrixBase<DerivedIds>& position_ids,
                         const Eigen::MatrixBase<Derived>& d_x) {
  detail::rope_at_ids<true>(table, position_ids,
                            RowRef<typename Derived::Scalar>(const_cast<Derived&>(d_x.derived())));
}

/// Value-returning form of apply_rope with a position offset: returns RoPE(x) as a new
/// [tokens, cols] matrix and leaves x alone. (A different name from apply_rope so that a
/// non-const matrix passed to apply_rope is always rotated in place, never silently copied.)
template <class Derived>
RowMatrix<typename Derived::Scalar> rope(const RopeTable<typename Derived::Scalar>& table,
                                         Index position_offset,
                                         const Eigen::MatrixBase<Derived>& x) {
  detail::require_supported_scalar<typename Derived::Scalar>();
  RowMatrix<typename Derived::Scalar> out = x;  // apply_rope checks everything before rotating
  apply_rope(table, position_offset, out);
  return out;
}

/// Value-returning form of apply_rope with explicit position ids; allocates the result.
template <class Derived, class DerivedIds>
RowMatrix<typename Derived::Scalar> rope(const RopeTable<typename Derived::Scalar>& table,
                                         const Eigen::MatrixBase<DerivedIds>& position_ids,
                                         const Eigen::MatrixBase<Derived>& x) {
  detail::require_supported_scalar<typename Derived::Scalar>();
  RowMatrix<typename Derived::Scalar> out = x;  // apply_rope checks everything before rotating
  apply_rope(table, position_ids, out);
  return out;
}

}  // namespace apex
