// SPDX-License-Identifier: MIT
// Attention masks from positions: causal, sliding window (§10) and the APEX-1 prefix / global /
// local rule (§11). `true` (or "allowed") always means "the query may attend to the key".
#pragma once

#include <apex/config.hpp>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace apex {

/// The document (segment) of every position of a packed sequence, for PositionMask::documents:
/// ids[p] is the document of absolute position p, for p in [0, size). A document is a run of
/// consecutive positions, so the ids are non-decreasing (checked by every attention entry
/// point); their values are otherwise free. A non-owning view: the ids must outlive the calls
/// that use them. Default-constructed: unset (no document rule).
struct DocumentIds {
  const Index* ids = nullptr;  ///< ids[p]: the document of position p; null: unset
  Index size = 0;              ///< positions with an id, [0, size)

  DocumentIds() = default;
  /// A view of `count` ids at `data` (not a copy).
  DocumentIds(const Index* data, Index count) : ids(data), size(count) {}
  /// A view of a vector's ids (not a copy).
  explicit DocumentIds(const std::vector<Index>& v)
      : ids(v.data()), size(static_cast<Index>(v.size())) {}

  /// Whether the view is unset (no document rule).
  bool empty() const { return ids == nullptr; }
  /// The first position of the document of position `pos` (pos in [0, size)).
  Index first_of(Index pos) const {
    return static_cast<Index>(std::lower_bound(ids, ids + pos, ids[pos]) - ids);
  }
  /// One past the last position of the document of position `pos` (pos in [0, size)).
  Index end_of(Index pos) const {
    return static_cast<Index>(std::upper_bound(ids + pos, ids + size, ids[pos]) - ids);
  }
};

/// Which (query, key) pairs may attend, decided from absolute positions alone, so that the fast
/// kernels can skip whole blocks without reading a mask.
///
/// Query row i has absolute position query_offset + i and key row j has key_offset + j. A pair
/// (qp, kp) is allowed when
///   - both lie in the bidirectional prefix [0, P): 0 <= qp, kp < prefix (§11.1), or
///   - with documents set, both positions belong to the same document, and the mask is not
///     causal, or it is causal and 0 <= qp - kp, and, with a window W, also qp - kp < W (§10.2:
///     the query itself counts, so W = 1 sees only itself), and, with a chunk size C,
///     ⌊qp / C⌋ = ⌊kp / C⌋ (chunked local attention, as Llama 4 uses: a query sees the keys of
///     its own chunk of C positions, causally).
/// The prefix rule comes first: prefix positions see each other whatever the other parts say.
/// A document mask without causal is bidirectional inside each document; with causal it is
/// causal inside each document (a packed batch of sequences).
///
/// Causal alignment: by default (query_offset unset) the S_q queries are the last S_q of the
/// key_offset + S_k positions, the convention of decoding with a KV cache (FlashAttention's
/// bottom-right alignment). Set query_offset = 0 for the top-left alignment PyTorch and ONNX use
/// when S_q != S_k and there is no cache.
///
/// Range: the offsets are >= 0, and the end of each range of positions, key_offset + S_k and
/// query_offset + S_q, must itself be an Index (at most 2^63 - 1); build_mask and the attention
/// entry points reject offsets that would overflow there. With documents, every query and key
/// position has an id: the first query position is >= 0 and documents.size is the end of the
/// last range, max(query end, key end).
struct PositionMask {
  bool causal = false;                ///< key j visible only if kp <= qp; false: everything allowed
  std::optional<Index> window;        ///< W >= 1; requires causal = true
  std::optional<Index> chunk;         ///< C >= 1: chunked local attention; requires causal = true
  Index prefix = 0;                   ///< P >= 0: positions [0, P) attend to each other freely
  DocumentIds documents;              ///< unset: no document rule
  std::optional<Index> query_offset;  ///< position of query row 0; unset: key_offset + S_k - S_q
  Index key_offset = 0;               ///< absolute position of key row 0

  /// Absolute position of query row 0 for S_q queries against S_k keys.
  Index first_query_position(Index num_queries, Index num_keys) const {
    return query_offset ? *query_offset : key_offset + num_keys - num_queries;
  }

  /// The rule itself, on absolute positions. The prefix is the positions [0, P): a query placed
  /// before position 0 (bottom-right alignment with S_q > key_offset + S_k) is not in it.
  bool allows(Index query_pos, Index key_pos) const {
    if (in_prefix(query_pos) && in_prefix(key_pos)) return true;
    if (!documents.empty() && documents.ids[query_pos] != documents.ids[key_pos]) return false;
    if (!causal) return true;
    const Index distance = query_pos - key_pos;
    return distance >= 0 && (!window || distance < *window) &&
           (!chunk || chunk_of(query_pos) == chunk_of(key_pos));
  }

  /// True when no pair can be forbidden: the kernels then skip mask work.
  bool allows_everything() const { return !causal && documents.empty(); }

  /// Whether an absolute position lies in the bidirectional prefix [0, P).
  bool in_prefix(Index pos) const { return pos >= 0 && pos < prefix; }

  /// ⌊pos / C⌋, rounding towards -inf (queries may sit before position 0). Needs a chunk.
  Index chunk_of(Index pos) const {
    const Index c = *chunk;
    return pos >= 0 ? pos / c : -((-(pos + 1)) / c) - 1;
  }
};

/// How a rectangle of (query, key) positions relates to a PositionMask.
enum class BlockCoverage {
  kNone,     ///< no pair in the block may attend: the block can be skipped
  kPartial,  ///< some pairs may, or the interval test cannot tell: check each pair
  kAll       ///< every pair may attend: no mask work needed
};

/// A range of absolute positions [begin, end).
struct PositionRange {
  Index begin;  ///< first position
  Index end;    ///< one past the last position
};

namespace detail {

/// What one part of a rule (causal distance, chunks, documents) says of a rectangle: every pair
/// passes it, or none does (both false: some may).
struct PartCoverage {
  bool all = true;
  bool none = false;
};

/// The causal part (with its window) on queries q, keys k.
inline PartCoverage causal_coverage(const PositionMask& m, const PositionRange& q,
                                    const PositionRange& k) {
  const Index min_distance = q.begin - (k.end - 1);
  const Index max_distance = (q.end - 1) - k.begin;
  return {min_distance >= 0 && (!m.window || max_distance < *m.window),
          max_distance < 0 || (m.window && min_distance >= *m.window)};
}

/// The part of a rule that groups positions (chunks, documents), given as group(pos): all when
/// both ranges lie in one group, none when their (non-decreasing) groups are disjoint.
template <class Group>
PartCoverage group_coverage(const Group& group, const PositionRange& q, const PositionRange& k) {
  const Index q0 = group(q.begin), q1 = group(q.end - 1);
  const Index k0 = group(k.begin), k1 = group(k.end - 1);
  return {q0 == q1 && k0 == k1 && q0 == k0, q1 < k0 || k1 < q0};
}

}  // namespace detail

/// Classifies queries [q_begin, q_end) against keys [k_begin, k_end) (absolute positions, both
/// ranges non-empty and, with documents, inside [0, documents.size)). kNone and kAll are exact;
/// kPartial means "check each pair" and is also the answer whenever the interval tests of the
/// rule's parts (causal distance, chunks, documents: each decided on its own) cannot tell.
inline BlockCoverage classify_block(const PositionMask& mask, Index q_begin, Index q_end,
                                    Index k_begin, Index k_end) {
  APEX_ASSERT(q_begin < q_end && k_begin < k_end);
  if (mask.allows_everything()) return BlockCoverage::kAll;
  detail::PartCoverage rule;
  const auto join = [&rule](const detail::PartCoverage& part) {
    rule.all = rule.all && part.all;
    rule.none = rule.none || part.none;
  };
  const PositionRange q{q_begin, q_end};
  const PositionRange k{k_begin, k_end};
  if (!mask.documents.empty()) {
    join(detail::group_coverage([&](Index p) { return mask.documents.ids[p]; }, q, k));
  }
  if (mask.causal) join(detail::causal_coverage(mask, q, k));
  if (mask.chunk) join(detail::group_coverage([&](Index p) { return mask.chunk_of(p); }, q, k));
  const bool inside_prefix =
      q_begin >= 0 && q_end <= mask.prefix && k_begin >= 0 && k_end <= mask.prefix;
  if (rule.all || inside_prefix) return BlockCoverage::kAll;
  const bool touches_prefix =
      q_begin < mask.prefix && q_end > 0 && k_begin < mask.prefix && k_end > 0;
  if (rule.none && !touches_prefix) return BlockCoverage::kNone;
  return BlockCoverage::kPartial;
}

/// The key positions that queries [q_begin, q_end) may see (a non-empty query range, inside the
/// documents' ids where those are set): every key a query of the range may attend lies in the
/// returned range, which the kernels visit instead of all the keys, so that keys outside it are
/// never read. It is an interval hull: keys inside it may still be forbidden.
inline PositionRange visible_keys(const PositionMask& mask, Index q_begin, Index q_end) {
  constexpr Index kMin = std::numeric_limits<Index>::min();
  constexpr Index kMax = std::numeric_limits<Index>::max();
  PositionRange r{kMin, kMax};
  if (mask.causal) r.end = q_end;
  // Key positions are >= 0, so bounds below 0 need not be formed (they could overflow).
  if (mask.window && q_begin >= *mask.window - 1) {
    r.begin = std::max(r.begin, q_begin - (*mask.window - 1));
  }
  if (mask.chunk && q_begin >= 0) r.begin = std::max(r.begin, q_begin - q_begin % *mask.chunk);
  if (mask.chunk && q_end > 0) {
    const Index last_chunk = (q_end - 1) - (q_end - 1) % *mask.chunk;
    if (last_chunk <= kMax - *mask.chunk) r.end = std::min(r.end, last_chunk + *mask.chunk);
  }
  if (!mask.documents.empty()) {
    r.begin = std::max(r.begin, mask.documents.first_of(q_begin));
    r.end = std::min(r.end, mask.documents.end_of(q_end - 1));
  }
  if (q_begin < mask.prefix && q_end > 0) {  // queries in the prefix see all of it
    r.begin = std::min(r.begin, Index{0});
    r.end = std::max(r.end, mask.prefix);
  }
  return r;
}

namespace detail {

/// Preconditions on a PositionMask, shared by every attention entry point.
inline void check_position_mask(const PositionMask& mask, const char* op) {
  APEX_CHECK(!mask.window || *mask.window >= 1,
             "[" << op << "] window (" << *mask.window << ") must be at least 1");
  APEX_CHECK(!mask.window || mask.causal,
             "[" << op << "] window (" << *mask.window << ") requires causal = true");
  APEX_CHECK(!mask.chunk || *mask.chunk >= 1,
             "[" << op << "] chunk (" << *mask.chunk << ") must be at least 1");
  APEX_CHECK(!mask.chunk || mask.causal,
             "[" << op << "] chunk (" << *mask.chunk << ") requires causal = true");
  APEX_CHECK(mask.documents.size >= 0 && (mask.documents.size == 0 || !mask.documents.empty()),
             "[" << op << "] documents (" << mask.documents.size
                 << " ids) must be a view of >= 0 ids with data");
  APEX_CHECK(mask.prefix >= 0, "[" << op << "] prefix (" << mask.prefix << ") must be >= 0");
  APEX_CHECK(!mask.query_offset || *mask.query_offset >= 0,
             "[" << op << "] query_offset (" << *mask.query_offset << ") must be >= 0");
  APEX_CHECK(mask.key_offset >= 0,
             "[" << op << "] key_offset (" << mask.key_offset << ") must be >= 0");
}

/// Preconditions on the document ids of a PositionMask for S_q queries against S_k keys: an id
/// for every position [0, max(query end, key end)), no query before position 0, and
/// non-decreasing ids (each document a run of consecutive positions). O(size).
inline void check_documents(const PositionMask& mask, Index num_queries, Index num_keys,
                            const char* op) {
  const Index first = mask.first_query_position(num_queries, num_keys);
  const Index end = std::max(first + num_queries, mask.key_offset + num_keys);
  APEX_CHECK(num_queries == 0 || first >= 0,
             "[" << op << "] documents need every query at a position >= 0 (the first query is at "
                 << first << ")");
  APEX_CHECK(mask.documents.size == end,
             "[" << op << "] documents length (" << mask.documents.size
                 << ") must be the end of the positions, max(query end, key end) = " << end);
  const Index* ids = mask.documents.ids;
  const Index* drop = std::is_sorted_until(ids, ids + mask.documents.size);
  APEX_CHECK(drop == ids + mask.documents.size,
             "[" << op << "] documents ids must be non-decreasing (one run of positions per "
                 << "document): position " << (drop - ids) << " has id " << *drop << " after "
                 << *(drop - 1));
}

/// Preconditions on a PositionMask applied to S_q queries against S_k keys: those above, and
/// that every position the rule forms is an Index: the keys' end key_offset + S_k and the
/// queries' end (query_offset + S_q when set; under bottom-right alignment it is the keys' end).
/// Positions, their differences and the bounds of any block of them then never overflow.
inline void check_position_mask(const PositionMask& mask, Index num_queries, Index num_keys,
                                const char* op) {
  check_position_mask(mask, op);
  constexpr Index kMax = std::numeric_limits<Index>::max();
  APEX_CHECK(num_queries >= 0 && num_keys >= 0, "[" << op << "] S_q (" << num_queries
                                                    << ") and S_k (" << num_keys
                                                    << ") must be >= 0");
  APEX_CHECK(num_keys <= kMax - mask.key_offset,
             "[" << op << "] key_offset (" << mask.key_offset << ") + S_k (" << num_keys
                 << ") must not exceed the largest position " << kMax);
  APEX_CHECK(!mask.query_offset || num_queries <= kMax - *mask.query_offset,
             "[" << op << "] query_offset (" << *mask.query_offset << ") + S_q (" << num_queries
                 << ") must not exceed the largest position " << kMax);
  if (!mask.documents.empty()) check_documents(mask, num_queries, num_keys, op);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Mask builders (§10 - §11). Every builder returns a PositionMask, the form the attention kernels
// consume (they skip whole blocks from it and never read a dense mask); build_mask expands one to
// booleans for inspection, for render_mask and for code that wants a dense mask.
//
// Shared conventions:
//   - true = the query may attend to the key;
//   - the window W counts the query itself: key j is in the window of query i iff 0 <= i - j < W,
//     so W = 1 sees only itself and W >= i + 1 sees the whole causal history of query i (§10.2);
//   - positions are absolute; S_q queries against S_k keys are aligned bottom-right by default
//     (the queries are the last S_q positions), see PositionMask::first_query_position;
//   - a query row with no allowed key (a query placed before every key, as when S_q > S_k under
//     bottom-right alignment, or one emptied by a dense mask or a -inf bias) yields zeros in
//     attention and a log-sum-exp of -inf, never NaN.
// ---------------------------------------------------------------------------------------------

/// The APEX-1 per-layer mask settings (§11.1 - §11.2).
struct LayerMaskParams {
  /// P: positions [0, P) attend to each other in both directions, on every layer (§11.1).
  Index prefix = 0;
  /// W: the sliding window of the local layers (§10.2, §11.1). The documents give no value, so
  /// 0 means "not set" and asking for a local layer's mask with it is an error.
  Index window = 0;
  /// F_g: every F_g-th layer is global (§11.2: F_g = 6, layers 5, 11, 17, ...).
  Index global_every = 6;
};

namespace detail {

inline bool is_global_layer_checked(Index layer, Index global_every, const char* op) {
  APEX_CHECK(layer >= 0, "[" << op << "] layer (" << layer << ") must be >= 0");
  APEX_CHECK(global_every >= 1,
             "[" << op << "] global_every F_g (" << global_every << ") must be >= 1");
  return layer % global_every == global_every - 1;
}

/// Number of decimal digits of a non-negative integer (at least 1).
inline int decimal_digits(Index value) {
  int digits = 1;
  for (; value >= 10; value /= 10) ++digits;
  return digits;
}

inline void append_right_aligned(std::string& line, const std::string& text, int width) {
  const int pad = width - static_cast<int>(text.size());
  if (pad > 0) line.append(static_cast<std::size_t>(pad), ' ');
  line += text;
}

}  // namespace detail

/// Whether layer l is global: l mod F_g == F_g - 1 (§11.2). With the default F_g = 6 the layers
/// 5, 11, 17, 23, ... are global (full causal; MLA in APEX-1) and all others local (sliding
/// window; GQA). Throws if layer < 0 or F_g < 1. F_g = 1 makes every layer global.
inline bool is_global_layer(Index layer, Index global_every = 6) {
  return detail::is_global_layer_checked(layer, global_every, "is_global_layer");
}

/// Plain causal attention: key j is visible to query i iff j <= i (absolute positions).
inline PositionMask causal_mask() {
  PositionMask mask;
  mask.causal = true;
  return mask;
}

/// Sliding-window attention (§10.2): mask[i, j] = 1 iff 0 <= i - j < W (which implies j <= i).
/// The query counts towards its own window. Throws if W < 1.
inline PositionMask sliding_window_mask(Index window) {
  APEX_CHECK(window >= 1, "[sliding_window_mask] window (" << window << ") must be >= 1");
  PositionMask mask = causal_mask();
  mask.window = window;
  return mask;
}

/// The APEX-1 mask of layer l (§11.1 - §11.2):
///   - every layer: positions [0, P) attend to each other freely (bidirectional prefix);
///   - global layers (l mod F_g == F_g - 1): causal, j <= i (W is not used);
///   - local layers: causal within the window, 0 <= i - j < W.
/// The prefix exception applies only when both positions are in [0, P): on a local layer a query
/// at i >= P sees a prefix key only if it is inside its window (§11.3, local row 4 no longer sees
/// position 0). Throws if P < 0, F_g < 1, W < 0, layer < 0, or W < 1 on a local layer.
inline PositionMask layer_mask(Index layer, const LayerMaskParams& params) {
  APEX_CHECK(params.prefix >= 0, "[layer_mask] prefix P (" << params.prefix << ") must be >= 0");
  APEX_CHECK(params.window >= 0,
             "[layer_mask] window W (" << params.window << ") must be >= 0 (0 = not set)");
  const bool global = detail::is_global_layer_checked(layer, params.global_every, "layer_mask");
  APEX_CHECK(global || params.window >= 1, "[layer_mask] window W ("
                                               << params.window << ") must be >= 1 for local layer "
                                               << layer << " (LayerMaskParams::window is not set)");
  PositionMask mask = causal_mask();
  mask.prefix = params.prefix;
  if (!global) mask.window = params.window;
  return mask;
}

/// Expands a PositionMask to booleans for S_q queries against S_k keys, with the alignment the
/// attention kernels use: row i is absolute position first_query_position(S_q, S_k) + i (the last
/// S_q positions unless query_offset is set) and column j is key_offset + j.
///   -> [S_q, S_k], true = may attend. Allocates the S_q x S_k result (O(S_q · S_k) bytes): meant
/// for inspection and tests; attention itself never needs it.
/// A row that is all false is a query with no visible key; attention returns zeros for it.
inline void build_mask(const PositionMask& mask, Eigen::Ref<BoolMatrix> out) {
  detail::check_position_mask(mask, out.rows(), out.cols(), "build_mask");
  const Index first_query = mask.first_query_position(out.rows(), out.cols());
  for (Index i = 0; i < out.rows(); ++i) {
    for (Index j = 0; j < out.cols(); ++j) {
      out(i, j) = mask.allows(first_query + i, mask.key_offset + j);
    }
  }
}

/// Value-returning form of build_mask: [S_q, S_k] booleans. Allocates the result. Throws, before
/// allocating, when S_q·S_k does not fit in 64 bits.
inline BoolMatrix build_mask(const PositionMask& mask, Index num_queries, Index num_keys) {
  APEX_CHECK(num_queries >= 0, "[build_mask] num_queries (" << num_queries << ") must be >= 0");
  APEX_CHECK(num_keys >= 0, "[build_mask] num_keys (" << num_keys << ") must be >= 0");
  detail::checked_product(num_queries, num_keys, "build_mask", "num_queries*num_keys");
  detail::check_position_mask(mask, num_queries, num_keys, "build_mask");
  BoolMatrix result(num_queries, num_keys);
  build_mask(mask, result);
  return result;
}

/// The dense [S, S] mask of APEX-1 layer l over a whole sequence of S tokens (§11.3): query i and
/// key j are both position i, j. Throws on the conditions of layer_mask and if P > S (a prefix
/// longer than the sequence describes no sequence). Allocates the S x S result.
inline BoolMatrix build_mask(Index layer, Index seq_len, const LayerMaskParams& params) {
  APEX_CHECK(seq_len >= 0, "[build_mask] seq_len S (" << seq_len << ") must be >= 0");
  APEX_CHECK(params.prefix <= seq_len,
             "[build_mask] prefix P ("
                 << params.prefix << ") must not exceed the sequence length S (" << seq_len << ")");
  detail::checked_product(seq_len, seq_len, "build_mask", "S*S");
  return build_mask(layer_mask(layer, params), seq_len, seq_len);
}

/// Draws a mask the way §11.3 does: a header `Position:  0  1  2 ...` and, for each requested
/// row, `    i:     █  █  ·  ...` with █ (U+2588) for "may attend" and · (U+00B7) for "masked".
/// Each line ends with '\n' and has no trailing blanks.
///
/// Layout: the header and the row labels take 9 columns ("Position:", or the row index right-
/// aligned in 5 columns, ':' and 3 blanks); then every column is 3 characters wide, its number
/// or glyph right-aligned. Two-digit positions (S up to 100) therefore fit with one blank between
/// them (`...  8  9 10 11`) and the glyph sits under the last digit; beyond that the columns
/// widen to (digits + 1) so that numbers never touch, and the row labels widen past 5 digits.
/// For S <= 10 the output is the §11.3 picture character for character (without its "← ..."
/// annotations). Columns are labelled 0 .. S_k - 1 and rows by their index 0 .. S_q - 1, which
/// are the positions for a mask over a whole sequence.
///   rows: which rows to draw, in the order given; empty = all rows. Allocates the string.
inline std::string render_mask(const BoolMatrix& mask, const std::vector<Index>& rows = {}) {
  for (const Index r : rows) {
    APEX_CHECK(r >= 0 && r < mask.rows(),
               "[render_mask] row (" << r << ") must be in [0, " << mask.rows() << ")");
  }
  const int cell = std::max(3, detail::decimal_digits(std::max<Index>(mask.cols() - 1, 0)) + 1);
  const int label = std::max(5, detail::decimal_digits(std::max<Index>(mask.rows() - 1, 0)));
  const int margin = label + 4;  // label, ':' and three blanks; "Position:" when label = 5
  std::string text = "Position:";
  text.append(static_cast<std::size_t>(margin - 9), ' ');
  for (Index j = 0; j < mask.cols(); ++j) {
    detail::append_right_aligned(text, std::to_string(j), cell);
  }
  text += '\n';
  const auto draw_row = [&](Index i) {
    detail::append_right_aligned(text, std::to_string(i), label);
    text += ":   ";
    for (Index j = 0; j < mask.cols(); ++j) {
      text.append(static_cast<std::size_t>(cell - 1), ' ');
      text += mask(i, j) ? "\xE2\x96\x88" : "\xC2\xB7";  // UTF-8 of U+2588 and U+00B7
    }
    text += '\n';
  };
  if (rows.empty()) {
    for (Index i = 0; i < mask.rows(); ++i) draw_row(i);
  } else {
    for (const Index i : rows) draw_row(i);
  }
  return text;
}

}  // namespace apex
