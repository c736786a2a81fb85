// SPDX-License-Identifier: MIT
// Block-sparse masks: a block map of the user's, which (query block, key block) pairs are computed,
// each either wholly allowed or partial (its pairs decided by a rule of the user's), given to
// apex::sdpa and the ragged and paged entry points as attention rules (attention_rules.hpp), so
// that a static sparse pattern (a sliding window with global tokens as Longformer and BigBird use,
// Sparse Transformer's strided pattern, ...) costs its allowed blocks only. The CPU counterpart of
// PyTorch flex_attention's BlockMask (kv_num_blocks/kv_indices, full_kv_num_blocks/full_kv_indices)
// and of FlashInfer's block-sparse (BSR) attention.
//
// THE MAP. Absolute positions are cut into query blocks of Bq positions and key blocks of Bk
// (query block I holds the positions [I·Bq, (I + 1)·Bq)); for each (batch b, query head h, query
// block I) a row lists, in increasing order, the key blocks J that are computed and the state of
// each, compressed by rows (CSR), so that memory is O(rows + listed blocks), not O(blocks²):
//
//          key block J:  0    1    2    3    4    5          rows.offsets   [0, 1, 3, 5, 7, 10]
//   query block I = 0   [P]   .    .    .    .    .          rows.key_blocks
//                   1   [F]  [P]   .    .    .    .            [0 | 0 1 | 1 2 | 2 3 | 0 3 4]
//                   2    .   [F]  [P]   .    .    .          rows.states
//                   3    .    .   [F]  [P]   .    .            [P | F P | F P | F P | F F P]
//                   4   [F]   .    .   [F]  [P]   .
//   [F] kAll: every pair attends   [P] kPartial: the partial rule decides   . absent: none (kNone)
//
// The rows of one (b, h) follow each other, (b, h) in the order b·H + h; a map of batch 1 is
// shared by every batch and one of heads 1 by every query head. Blocks need not divide the
// sequence: the map covers the positions [0, query_blocks·Bq) × [0, key_blocks·Bk), which must hold
// every position a call uses (checked); the last blocks may reach beyond it.
//
// THE RULES. block_sparse_rules(map, partial) is an AttentionRules whose
//   allows(b, h, q, k)   = false if block (⌊q/Bq⌋, ⌊k/Bk⌋) is absent, true if kAll, and
//                          partial(b, h, q, k) if kPartial (the PositionMask and the dense mask
//                          still apply on top, as for every rule);
//   classify(b, h, Q, K) = kNone if every map block the rectangle Q × K overlaps is absent, kAll
//                          if every one is kAll, kPartial otherwise: exact for the map, for any
//                          rectangle (the kernel's tiles need not align with the map's blocks),
//                          two binary searches in each map row the rectangle crosses; inside
//                          one kPartial block, the partial rule's own classify(Q, K) answers
//                          when it has one (the named patterns do), so that the kernel's tiles
//                          there are skipped or unmasked where the rule allows.
// So absent blocks are skipped unread and kAll blocks cost no per-pair work. Positions, batches or
// heads outside the map count as absent (the rules never read outside it); the entry points below
// reject a map that does not cover their call before anything is written.
//
// BATCH AXIS. apex::sdpa gives the rules its batch b; the calls over many sequences (sdpa_varlen,
// sdpa_paged, sdpa_block_tables) give sequence i as batch i, and sdpa_nonpad_kv batch b as b: a
// map of batch 1 applies to every sequence, else it has one batch per sequence. Positions are the
// sequence's own absolute positions (its PositionMask's alignment; over a paged cache, the
// cache's), so one map of the longest sequence serves a ragged batch.
//
// The entry points of this header are those of sdpa.hpp, varlen.hpp and paged_attention.hpp taking
// block-sparse rules: they check the map against the call (check_block_sparse) and then run that
// call, unchanged. Rules wrapped by verify_classifier are ordinary rules: unchecked, but safe.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/mask.hpp>
#include <apex/paged_attention.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// The extents of a block map: how many (batch, head) maps it holds, how many query and key
/// blocks each has, and how many positions a block holds.
struct BlockSparseShape {
  Index batch = 1;         ///< 1: shared by every batch (or sequence); else one per batch
  Index heads = 1;         ///< 1: shared by every query head; else H_q
  Index query_blocks = 0;  ///< query blocks per (b, h): covers positions [0, query_blocks·Bq)
  Index key_blocks = 0;    ///< key blocks per row: covers positions [0, key_blocks·Bk)
  Index query_block = 64;  ///< Bq >= 1, positions per query block
  Index key_block = 64;    ///< Bk >= 1, positions per key block

  /// ⌈positions / block⌉: the blocks of `block` positions that cover [0, positions).
  static Index blocks_covering(Index positions, Index block) {
    APEX_CHECK(positions >= 0 && block >= 1, "[blocks_covering] positions ("
                                                 << positions << ") must be >= 0 and block ("
                                                 << block << ") >= 1");
    return positions / block + (positions % block != 0 ? 1 : 0);
  }
  /// Rows of the map, batch · heads · query_blocks.
  Index rows() const { return batch * heads * query_blocks; }
};

/// A block map in compressed rows (CSR): row r = (b·heads + h)·query_blocks + I lists the key
/// blocks key_blocks[offsets[r] .. offsets[r + 1]) (increasing) with their states (kAll or
/// kPartial; absent blocks are not listed).
struct BlockSparseRows {
  std::vector<Index> offsets;         ///< rows + 1 entries, from 0, non-decreasing
  std::vector<Index> key_blocks;      ///< offsets.back() key blocks, increasing in each row
  std::vector<BlockCoverage> states;  ///< one per listed key block: kAll or kPartial
};

/// Which (query block, key block) pairs of each (batch, head) are computed, and how (THE MAP
/// above): a shape and its compressed rows, checked once when built. Immutable. Memory:
/// O(rows + listed blocks).
class BlockSparseMask {
 public:
  /// An empty map (no blocks); useful only to be assigned.
  BlockSparseMask() = default;

  /// The map of a shape and its compressed rows; throws std::invalid_argument naming the first
  /// bad value (block sizes < 1, counts < 0, offsets not from 0 to the listed count or
  /// decreasing, a key block out of [0, key_blocks) or not above the one before it in its row, a
  /// state not kAll or kPartial).
  BlockSparseMask(const BlockSparseShape& shape, BlockSparseRows rows)
      : shape_(shape), rows_(std::move(rows)) {
    check_shape(shape_, "BlockSparseMask");
    check_rows("BlockSparseMask");
    count_partials();
  }

  /// The map of a dense array of states, [batch, heads, query_blocks, key_blocks] in row-major
  /// order (kNone: absent). Allocates the map; the array can be freed afterwards.
  static BlockSparseMask from_states(const BlockSparseShape& shape,
                                     const std::vector<BlockCoverage>& states) {
    const char* op = "BlockSparseMask::from_states";
    check_shape(shape, op);
    const Index size = detail::checked_product({shape.rows(), shape.key_blocks}, op, "the blocks");
    APEX_CHECK(static_cast<Index>(states.size()) == size,
               "[" << op << "] states holds " << states.size() << " blocks; expected batch·heads·"
                   << "query_blocks·key_blocks = " << size);
    return from_classifier(shape, [&](Index b, Index h, Index qb, Index kb) {
      return states[static_cast<std::size_t>(
          ((b * shape.heads + h) * shape.query_blocks + qb) * shape.key_blocks + kb)];
    });
  }

  /// The map whose block (b, h, I, J) has the state classify(b, h, I, J) -> BlockCoverage
  /// (kNone: absent), asked once per block in row order. O(blocks) calls, O(listed) memory.
  template <class Classify>
  static BlockSparseMask from_classifier(const BlockSparseShape& shape, const Classify& classify) {
    const char* op = "BlockSparseMask::from_classifier";
    check_shape(shape, op);
    detail::checked_product({shape.rows(), shape.key_blocks}, op, "the blocks");
    BlockSparseRows rows;
    rows.offsets.reserve(static_cast<std::size_t>(shape.rows() + 1));
    rows.offsets.push_back(0);
    for (Index b = 0; b < shape.batch; ++b) {
      for (Index h = 0; h < shape.heads; ++h) {
        for (Index qb = 0; qb < shape.query_blocks; ++qb) {
          for (Index kb = 0; kb < shape.key_blocks; ++kb) {
            const BlockCoverage state = classify(b, h, qb, kb);
            APEX_CHECK(valid_state(state), "[" << op << "] block (" << b << ", " << h << ", " << qb
                                               << ", " << kb << ") has state "
                                               << static_cast<int>(state)
                                               << "; expected kNone, kPartial or kAll");
            if (state == BlockCoverage::kNone) continue;
            rows.key_blocks.push_back(kb);
            rows.states.push_back(state);
          }
          rows.offsets.push_back(static_cast<Index>(rows.key_blocks.size()));
        }
      }
    }
    return BlockSparseMask(shape, std::move(rows));
  }

  /// The shape.
  const BlockSparseShape& shape() const { return shape_; }
  /// The compressed rows.
  const BlockSparseRows& rows() const { return rows_; }
  /// Listed blocks (kAll and kPartial), over every row.
  Index listed_blocks() const { return static_cast<Index>(rows_.key_blocks.size()); }
  /// Listed blocks in state kPartial.
  Index partial_blocks() const { return partial_before_.empty() ? 0 : partial_before_.back(); }
  /// Query positions the map covers, [0, query_blocks·Bq).
  Index query_positions() const { return shape_.query_blocks * shape_.query_block; }
  /// Key positions the map covers, [0, key_blocks·Bk).
  Index key_positions() const { return shape_.key_blocks * shape_.key_block; }

  /// The state of block (I, J) of (b, h): kNone when absent or outside the map.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the map's axes
  BlockCoverage block_state(Index b, Index h, Index query_block, Index key_block) const {
    const Index r = row_of(b, h, query_block);
    if (r < 0 || key_block < 0 || key_block >= shape_.key_blocks) return BlockCoverage::kNone;
    const Index* first = rows_.key_blocks.data() + rows_.offsets[std::size_t(r)];
    const Index* last = rows_.key_blocks.data() + rows_.offsets[std::size_t(r) + 1];
    const Index* at = std::lower_bound(first, last, key_block);
    if (at == last || *at != key_block) return BlockCoverage::kNone;
    return rows_.states[static_cast<std::size_t>(at - rows_.key_blocks.data())];
  }

  /// The state of the block holding the pair (q_pos, k_pos) of (b, h) (absolute positions).
  BlockCoverage pair_state(Index b, Index h, Index q_pos, Index k_pos) const {
    if (q_pos < 0 || k_pos < 0) return BlockCoverage::kNone;
    return block_state(b, h, q_pos / shape_.query_block, k_pos / shape_.key_block);
  }

  /// What the map says of the rectangle of positions q × k (non-empty) of (b, h), combining every
  /// map block it overlaps: kNone if all are absent, kAll if all are kAll, else kPartial. A part
  /// of the rectangle outside the map counts as absent. Two binary searches per map row crossed.
  BlockCoverage classify(Index b, Index h, const PositionRange& q, const PositionRange& k) const {
    const Index q_begin = std::max<Index>(q.begin, 0), q_end = std::min(q.end, query_positions());
    const Index k_begin = std::max<Index>(k.begin, 0), k_end = std::min(k.end, key_positions());
    if (q_begin >= q_end || k_begin >= k_end) return BlockCoverage::kNone;
    bool all = q_begin == q.begin && q_end == q.end && k_begin == k.begin && k_end == k.end;
    bool none = true;
    const Index kb0 = k_begin / shape_.key_block, kb1 = (k_end - 1) / shape_.key_block;
    for (Index qb = q_begin / shape_.query_block; qb <= (q_end - 1) / shape_.query_block; ++qb) {
      const Index r = row_of(b, h, qb);
      if (r < 0) return BlockCoverage::kNone;  // (b, h) outside the map: every block absent
      const Index* base = rows_.key_blocks.data();
      const Index* first = base + rows_.offsets[std::size_t(r)];
      const Index* last = base + rows_.offsets[std::size_t(r) + 1];
      const Index lo = std::lower_bound(first, last, kb0) - base;
      const Index hi = std::upper_bound(base + lo, last, kb1) - base;
      const Index partial = partial_before_[std::size_t(hi)] - partial_before_[std::size_t(lo)];
      none = none && hi == lo;
      all = all && hi - lo == kb1 - kb0 + 1 && partial == 0;
      if (!none && !all) return BlockCoverage::kPartial;
    }
    return none ? BlockCoverage::kNone : all ? BlockCoverage::kAll : BlockCoverage::kPartial;
  }

 private:
  static bool valid_state(BlockCoverage s) {
    return s == BlockCoverage::kNone || s == BlockCoverage::kPartial || s == BlockCoverage::kAll;
  }

  static void check_shape(const BlockSparseShape& s, const char* op) {
    APEX_CHECK(s.query_block >= 1,
               "[" << op << "] query_block (" << s.query_block << ") must be >= 1");
    APEX_CHECK(s.key_block >= 1, "[" << op << "] key_block (" << s.key_block << ") must be >= 1");
    APEX_CHECK(s.batch >= 1, "[" << op << "] batch (" << s.batch << ") must be >= 1");
    APEX_CHECK(s.heads >= 1, "[" << op << "] heads (" << s.heads << ") must be >= 1");
    APEX_CHECK(s.query_blocks >= 0,
               "[" << op << "] query_blocks (" << s.query_blocks << ") must be >= 0");
    APEX_CHECK(s.key_blocks >= 0,
               "[" << op << "] key_blocks (" << s.key_blocks << ") must be >= 0");
    detail::checked_product({s.batch, s.heads, s.query_blocks}, op, "batch·heads·query_blocks");
    detail::checked_product(s.query_blocks, s.query_block, op, "query_blocks·query_block");
    detail::checked_product(s.key_blocks, s.key_block, op, "key_blocks·key_block");
  }

  void check_rows(const char* op) const {
    const auto& off = rows_.offsets;
    const auto listed = static_cast<Index>(rows_.key_blocks.size());
    APEX_CHECK(static_cast<Index>(off.size()) == shape_.rows() + 1,
               "[" << op << "] offsets holds " << off.size() << " entries; expected rows + 1 = "
                   << shape_.rows() + 1 << " (rows = batch·heads·query_blocks)");
    APEX_CHECK(off.front() == 0 && off.back() == listed,
               "[" << op << "] offsets must run from 0 to the " << listed
                   << " listed key blocks; they run from " << off.front() << " to " << off.back());
    APEX_CHECK(rows_.states.size() == rows_.key_blocks.size(),
               "[" << op << "] states holds " << rows_.states.size()
                   << " entries; expected one per listed key block (" << listed << ")");
    for (std::size_t r = 0; r + 1 < off.size(); ++r) {  // first, so that every row is in range
      APEX_CHECK(off[r] <= off[r + 1], "[" << op << "] offsets[" << r + 1 << "] (" << off[r + 1]
                                           << ") must be >= offsets[" << r << "] (" << off[r]
                                           << ")");
    }
    for (std::size_t r = 0; r + 1 < off.size(); ++r) {
      for (Index e = off[r]; e < off[r + 1]; ++e) check_entry(static_cast<Index>(r), e, op);
    }
  }

  /// Throws unless listed block e of row r is in range, above the one before it in its row, and
  /// kAll or kPartial.
  void check_entry(Index r, Index e, const char* op) const {
    const Index kb = rows_.key_blocks[std::size_t(e)];
    APEX_CHECK(kb >= 0 && kb < shape_.key_blocks,
               "[" << op << "] key_blocks[" << e << "] (" << kb << ") of row " << r
                   << " must be in [0, key_blocks = " << shape_.key_blocks << ")");
    APEX_CHECK(e == rows_.offsets[std::size_t(r)] || rows_.key_blocks[std::size_t(e - 1)] < kb,
               "[" << op << "] key_blocks[" << e << "] (" << kb << ") of row " << r
                   << " must be greater than the one before it ("
                   << rows_.key_blocks[std::size_t(e - 1)] << "): sorted, no repeats");
    const BlockCoverage s = rows_.states[std::size_t(e)];
    APEX_CHECK(s == BlockCoverage::kAll || s == BlockCoverage::kPartial,
               "[" << op << "] states[" << e << "] (" << static_cast<int>(s)
                   << ") must be kAll or kPartial: absent blocks are not listed");
  }

  void count_partials() {
    partial_before_.assign(rows_.states.size() + 1, 0);
    for (std::size_t e = 0; e < rows_.states.size(); ++e) {
      partial_before_[e + 1] =
          partial_before_[e] + (rows_.states[e] == BlockCoverage::kPartial ? 1 : 0);
    }
  }

  /// The row of (b, h, I), broadcasting a batch or heads of 1; -1 outside the map.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the map's axes
  Index row_of(Index b, Index h, Index query_block) const {
    const Index bb = shape_.batch == 1 ? 0 : b;
    const Index hh = shape_.heads == 1 ? 0 : h;
    if (bb < 0 || bb >= shape_.batch || hh < 0 || hh >= shape_.heads || query_block < 0 ||
        query_block >= shape_.query_blocks) {
      return -1;
    }
    return (bb * shape_.heads + hh) * shape_.query_blocks + query_block;
  }

  BlockSparseShape shape_;
  BlockSparseRows rows_{{0}, {}, {}};
  std::vector<Index> partial_before_{0};  ///< [e]: kPartial blocks among the first e listed
};

// ---------------------------------------------------------------------------------------------
// The rules of a map
// ---------------------------------------------------------------------------------------------

/// The partial rule of block_sparse_rules(map) without one: never asked (that call rejects a map
/// with partial blocks), and false if it were.
struct NoPartialRule {
  /// False.
  bool operator()(Index /*b*/, Index /*h*/, Index /*q_pos*/, Index /*k_pos*/) const {
    return false;
  }
};

/// The mask rule of a map: absent -> false, kAll -> true, kPartial -> partial(b, h, q, k).
template <class Partial>
struct BlockSparseAllows {
  const BlockSparseMask* map;  ///< outlives the rules
  Partial partial;             ///< bool(b, h, q_pos, k_pos), for the pairs of kPartial blocks

  /// Whether the pair may attend, by its block's state.
  bool operator()(Index b, Index h, Index q_pos, Index k_pos) const {
    switch (map->pair_state(b, h, q_pos, k_pos)) {
      case BlockCoverage::kAll:
        return true;
      case BlockCoverage::kPartial:
        return static_cast<bool>(partial(b, h, q_pos, k_pos));
      default:
        return false;
    }
  }
};

namespace detail {

/// Whether a partial rule has a classifier of its own, classify(q_range, k_range) ->
/// BlockCoverage (the named patterns do).
template <class P, class = void>
inline constexpr bool kClassifiesRanges = false;
/// A partial rule with classify(PositionRange, PositionRange).
template <class P>
inline constexpr bool
    kClassifiesRanges<P, std::void_t<decltype(std::declval<const P&>().classify(
                             std::declval<PositionRange>(), std::declval<PositionRange>()))>> =
        true;

}  // namespace detail

/// The block classifier of a map (BlockSparseMask::classify): exact for any rectangle. When
/// the rectangle lies inside one kPartial block and the partial rule has a classifier of its own
/// (classify(q_range, k_range), exact for kNone and kAll, as the named patterns have), that
/// classifier answers instead, so that the kernel's tiles inside a partial block are skipped or
/// left unmasked where the rule allows it.
template <class Partial>
struct BlockSparseClassifier {
  const BlockSparseMask* map;  ///< outlives the rules
  Partial partial;             ///< the partial rule (its classifier is asked, when it has one)

  /// The answer for the rectangle q × k of (b, h).
  BlockCoverage operator()(Index b, Index h, const PositionRange& q, const PositionRange& k) const {
    const BlockCoverage coverage = map->classify(b, h, q, k);
    if constexpr (detail::kClassifiesRanges<Partial>) {
      const BlockSparseShape& s = map->shape();
      if (coverage == BlockCoverage::kPartial && q.begin >= 0 && k.begin >= 0 &&
          q.begin / s.query_block == (q.end - 1) / s.query_block &&
          k.begin / s.key_block == (k.end - 1) / s.key_block) {
        return partial.classify(q, k);  // one kPartial block: the rule decides every pair
      }
    }
    return coverage;
  }
};

/// The AttentionRules type of block_sparse_rules (S: the score rule, KeepScore unless replaced).
template <class Partial, class Score = KeepScore>
using BlockSparseRules =
    AttentionRules<BlockSparseAllows<Partial>, BlockSparseClassifier<Partial>, Score>;

/// The rules of a map whose kPartial blocks are decided pair by pair by `partial`, a pure
/// function bool(b, h, q_pos, k_pos) of absolute positions (asked only inside kPartial blocks).
/// The rules point to `map`, which must outlive every call that uses them (a temporary map is
/// refused at compile time); `partial` is held by value. To add a score rule, build
///   apex::attention_rules(rules.allows, rules.classify, score)
/// which the entry points of this header still recognise.
template <class Partial>
BlockSparseRules<Partial> block_sparse_rules(const BlockSparseMask& map, Partial partial) {
  return {{&map, partial}, {&map, std::move(partial)}, {}};
}

/// The rules of a map without partial blocks: a block is computed wholly (kAll) or not at all, as
/// in FlashInfer's BSR attention. Throws std::invalid_argument if the map lists a kPartial block
/// (partial blocks need a rule: pass one, or mark them kAll).
inline BlockSparseRules<NoPartialRule> block_sparse_rules(const BlockSparseMask& map) {
  APEX_CHECK(map.partial_blocks() == 0, "[block_sparse_rules] the map has "
                                            << map.partial_blocks()
                                            << " kPartial blocks but no partial rule: pass "
                                               "one, or mark them kAll");
  return {{&map, {}}, {&map, {}}, {}};
}

/// Rules must not point to a temporary map.
template <class Partial>
BlockSparseRules<Partial> block_sparse_rules(const BlockSparseMask&& map, Partial partial) = delete;
/// Rules must not point to a temporary map.
BlockSparseRules<NoPartialRule> block_sparse_rules(const BlockSparseMask&& map) = delete;

// ---------------------------------------------------------------------------------------------
// Named patterns: each a per-pair rule (the partial rule of its map) with an exact classifier
// ---------------------------------------------------------------------------------------------

namespace detail {

/// A rectangle classified row by row from the count of allowed keys of each query row,
/// allowed_keys(q_pos, k) in [0, |k|): kAll if every row allows all, kNone if none allows any.
template <class Count>
BlockCoverage classify_by_rows(const Count& allowed_keys, const PositionRange& q,
                               const PositionRange& k) {
  bool all = true, none = true;
  for (Index qp = q.begin; qp < q.end && (all || none); ++qp) {
    const Index n = allowed_keys(qp, k);
    all = all && n == k.end - k.begin;
    none = none && n == 0;
  }
  return none ? BlockCoverage::kNone : all ? BlockCoverage::kAll : BlockCoverage::kPartial;
}

/// |a ∩ b| of two ranges.
inline Index overlap(const PositionRange& a, const PositionRange& b) {
  return std::max<Index>(0, std::min(a.end, b.end) - std::max(a.begin, b.begin));
}

/// The map of a pattern (an object with classify(q_range, k_range)), each block the pattern's
/// answer on the block's positions.
template <class Pattern>
BlockSparseMask pattern_mask(const BlockSparseShape& shape, const Pattern& pattern) {
  return BlockSparseMask::from_classifier(shape, [&](Index, Index, Index qb, Index kb) {
    const PositionRange q{qb * shape.query_block, (qb + 1) * shape.query_block};
    const PositionRange k{kb * shape.key_block, (kb + 1) * shape.key_block};
    return pattern.classify(q, k);
  });
}

}  // namespace detail

/// A sliding window with global tokens (Longformer, Beltagy et al. 2020; BigBird's window and
/// global parts, Zaheer et al. 2020). Query q may see key k iff
///   causal:      k <= q and (q − k < W or q is global or k is global)
///   not causal:  |q − k| < W or q is global or k is global
/// The window counts the query itself (apex's convention: W = 1 sees only itself), so Longformer's
/// two-sided window of w tokens is W = w/2 + 1 here. A global position attends to every key and
/// every query attends to it (causal: those not after the query). The same for every batch and
/// head. Usable as the partial rule of its map (sliding_window_with_global).
struct SlidingWindowGlobal {
  Index window = 1;           ///< W >= 1
  std::vector<Index> global;  ///< the global positions: increasing, >= 0
  bool causal = true;         ///< whether keys after the query are excluded

  /// Whether query position q may see key position k.
  bool operator()(Index /*b*/, Index /*h*/, Index q, Index k) const {
    if (causal && k > q) return false;
    const Index distance = q > k ? q - k : k - q;
    return distance < window || is_global(q) || is_global(k);
  }
  /// Whether a position is global.
  bool is_global(Index pos) const { return std::binary_search(global.begin(), global.end(), pos); }
  /// Global positions in the range r.
  Index globals_in(const PositionRange& r) const {
    if (r.begin >= r.end) return 0;
    return static_cast<Index>(std::lower_bound(global.begin(), global.end(), r.end) -
                              std::lower_bound(global.begin(), global.end(), r.begin));
  }
  /// Keys of the range k that query position q may see: |k ∩ visible(q)|.
  Index allowed_keys(Index q, const PositionRange& k) const {
    const PositionRange keys{k.begin, causal ? std::min(k.end, q + 1) : k.end};
    if (keys.begin >= keys.end) return 0;
    if (is_global(q)) return keys.end - keys.begin;
    const bool wide = window > std::numeric_limits<Index>::max() - q;  // q + W would overflow
    const PositionRange near{std::max(keys.begin, q - window + 1),
                             causal ? keys.end
                             : wide ? keys.end
                                    : std::min(keys.end, q + window)};
    const Index in_window = std::max<Index>(0, near.end - near.begin);
    return in_window + globals_in(keys) - globals_in(near);
  }
  /// The exact coverage of the rectangle q × k (row by row, O(|q| log |global|)).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): as every classifier
  BlockCoverage classify(const PositionRange& q, const PositionRange& k) const {
    return detail::classify_by_rows(
        [this](Index qp, const PositionRange& kr) { return allowed_keys(qp, kr); }, q, k);
  }
};

/// Sparse Transformer's strided pattern (Child et al. 2019, "strided"), on blocks of B positions:
/// with I = ⌊q/B⌋ and J = ⌊k/B⌋, query q may see key k iff
///   causal:      k <= q and (I − J < local or (I − J) mod stride = 0)
///   not causal:  |I − J| < local or (I − J) mod stride = 0
/// B = 1, local = stride = l is the paper's pattern (the previous l positions, and every l-th
/// one before them); B > 1 is its block form, whose blocks are whole (only the diagonal blocks
/// of a causal pattern are partial), so that a map of the same blocks skips every other block.
/// The same for every batch and head. Usable as the partial rule of its map (strided).
struct StridedPattern {
  Index block = 1;     ///< B >= 1, positions per block of the pattern
  Index local = 1;     ///< local >= 1 blocks: the query's block and the local − 1 before it
  Index stride = 1;    ///< stride >= 1 blocks between the strided blocks
  bool causal = true;  ///< whether keys after the query are excluded

  /// Whether the pattern allows query block I to see key block J (positions aside).
  bool allows_blocks(Index query_block, Index key_block) const {
    const Index d = query_block - key_block;
    if (causal && d < 0) return false;
    return (d < 0 ? -d : d) < local || d % stride == 0;
  }
  /// Whether query position q may see key position k.
  bool operator()(Index /*b*/, Index /*h*/, Index q, Index k) const {
    return (!causal || k <= q) && allows_blocks(q / block, k / block);
  }
  /// Keys of the range k that query position q may see (one step per pattern block of k).
  Index allowed_keys(Index q, const PositionRange& k) const {
    const PositionRange keys{k.begin, causal ? std::min(k.end, q + 1) : k.end};
    Index count = 0;
    for (Index kb = keys.begin / block; kb * block < keys.end; ++kb) {
      if (allows_blocks(q / block, kb)) {
        count += detail::overlap(keys, {kb * block, (kb + 1) * block});
      }
    }
    return count;
  }
  /// The exact coverage of the rectangle q × k (row by row).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): as every classifier
  BlockCoverage classify(const PositionRange& q, const PositionRange& k) const {
    return detail::classify_by_rows(
        [this](Index qp, const PositionRange& kr) { return allowed_keys(qp, kr); }, q, k);
  }
};

/// The map of a sliding window with global tokens on `shape` (every batch and head alike; give
/// shape.batch = shape.heads = 1): each block kAll, kPartial or absent exactly as the pattern
/// says of its positions. Use it with the pattern as partial rule:
///   apex::block_sparse_rules(map, pattern). O(blocks · Bq · log |global|) time.
inline BlockSparseMask sliding_window_with_global(const BlockSparseShape& shape,
                                                  const SlidingWindowGlobal& pattern) {
  const char* op = "sliding_window_with_global";
  APEX_CHECK(pattern.window >= 1, "[" << op << "] window (" << pattern.window << ") must be >= 1");
  for (std::size_t i = 0; i < pattern.global.size(); ++i) {
    APEX_CHECK(pattern.global[i] >= 0 && (i == 0 || pattern.global[i - 1] < pattern.global[i]),
               "[" << op << "] global[" << i << "] (" << pattern.global[i]
                   << ") must be >= 0 and greater than the one before it (increasing)");
  }
  return detail::pattern_mask(shape, pattern);
}

/// The map of Sparse Transformer's strided pattern on `shape` (every batch and head alike), each
/// block as the pattern says of its positions; use it with the pattern as partial rule. The map
/// skips most when its blocks are the pattern's (shape.query_block = shape.key_block = B).
inline BlockSparseMask strided(const BlockSparseShape& shape, const StridedPattern& pattern) {
  const char* op = "strided";
  APEX_CHECK(pattern.block >= 1, "[" << op << "] block (" << pattern.block << ") must be >= 1");
  APEX_CHECK(pattern.local >= 1, "[" << op << "] local (" << pattern.local << ") must be >= 1");
  APEX_CHECK(pattern.stride >= 1, "[" << op << "] stride (" << pattern.stride << ") must be >= 1");
  return detail::pattern_mask(shape, pattern);
}

// ---------------------------------------------------------------------------------------------
// Checking a map against a call, and the entry points that do it
// ---------------------------------------------------------------------------------------------

/// What one problem of a call asks of a map: its batch (or sequence) and query head counts, and
/// the absolute positions of its queries and keys.
struct BlockSparseUse {
  Index batch = 1;              ///< batches (or sequences) of the call
  Index heads = 1;              ///< query heads H_q
  PositionRange queries{0, 0};  ///< query positions of one problem
  PositionRange keys{0, 0};     ///< key positions of one problem
};

/// Throws std::invalid_argument (prefixed with op) unless the map fits the use: batch and heads 1
/// or equal to the call's, and every query and key position inside the map (queries at positions
/// >= 0). O(1).
inline void check_block_sparse(const BlockSparseMask& map, const BlockSparseUse& use,
                               const char* op) {
  const BlockSparseShape& s = map.shape();
  APEX_CHECK(s.batch == 1 || s.batch == use.batch,
             "[" << op << "] block-sparse map batch (" << s.batch << ") must be 1 or the call's "
                 << use.batch << " (batches, or sequences of a ragged or paged call)");
  APEX_CHECK(s.heads == 1 || s.heads == use.heads, "[" << op << "] block-sparse map heads ("
                                                       << s.heads << ") must be 1 or H_q ("
                                                       << use.heads << ")");
  if (use.queries.begin >= use.queries.end || use.keys.begin >= use.keys.end) return;
  APEX_CHECK(use.queries.begin >= 0 && use.queries.end <= map.query_positions(),
             "[" << op << "] block-sparse map covers query positions [0, " << map.query_positions()
                 << ") (" << s.query_blocks << " blocks of " << s.query_block
                 << "); the call's queries are at [" << use.queries.begin << ", " << use.queries.end
                 << ")");
  APEX_CHECK(use.keys.begin >= 0 && use.keys.end <= map.key_positions(),
             "[" << op << "] block-sparse map covers key positions [0, " << map.key_positions()
                 << ") (" << s.key_blocks << " blocks of " << s.key_block
                 << "); the call's keys are at [" << use.keys.begin << ", " << use.keys.end << ")");
}

namespace detail {

/// The positions of a problem of S_q queries against S_k keys under `rule` (checked first).
inline BlockSparseUse block_sparse_use(const PositionMask& rule, Index batch, Index heads,
                                       Index s_q, Index s_k, const char* op) {
  check_position_mask(rule, s_q, s_k, op);
  const Index first = rule.first_query_position(s_q, s_k);
  return {batch, heads, {first, first + s_q}, {rule.key_offset, rule.key_offset + s_k}};
}

/// Checks the map against each sequence i of a ragged call (N sequences, H_q heads): nq_i
/// queries, nk_i keys, under masks[i] (or masks[0]), key positions from its key_offset plus
/// `key_start(i)`. The call's own checks of the offsets and masks run first.
template <class Lengths>
void check_block_sparse_sequences(const BlockSparseMask& map, Index n, Index heads,
                                  const std::vector<PositionMask>& masks, const Lengths& lengths,
                                  const char* op) {
  check_mask_count(masks, n, op);
  for (Index i = 0; i < n; ++i) {
    const std::pair<Index, Index> qk = lengths(i);  // (queries, keys)
    const PositionMask& rule = masks[masks.size() == 1 ? 0 : std::size_t(i)];
    check_block_sparse(map, block_sparse_use(rule, n, heads, qk.first, qk.second, op), op);
  }
}

}  // namespace detail

/// sdpa with block-sparse rules (block_sparse_rules): checks first that the map fits the call
/// (batch 1 or B, heads 1 or H_q, every query and key position of mask.positions' alignment
/// inside it; queries at positions >= 0), then is sdpa with those rules (sdpa.hpp): absent
/// blocks are skipped unread, kAll blocks cost no mask work. Nothing is written when a check
/// fails. q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v] -> out
/// [B, H_q, S_q, d_v], lse and stats (optional) as for sdpa.
template <class Q, class K, class V, class TB, class TO, class P, class S>
void sdpa(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
          const AttentionMask<TB>& mask, const SdpaParams& params,
          const BlockSparseRules<P, S>& rules, const HeadsView<TO>& out,
          const HeadsView<TO>& lse = {}, const SoftmaxStatsView<TO>& stats = {}) {
  check_block_sparse(
      *rules.classify.map,
      detail::block_sparse_use(mask.positions, q.batch(), q.heads(), q.seq(), k.seq(), "sdpa"),
      "sdpa");
  detail::flash_sdpa<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>, TB,
                     TO>(q, k, v, mask, params, out, lse, stats, {}, rules);
}

/// sdpa_varlen with block-sparse rules: the map's batch is 1 or N (sequence i is batch i) and it
/// covers every sequence's own query and key positions (checked first); otherwise as
/// sdpa_varlen with user rules (varlen.hpp).
template <class Q, class K, class V, class TB, class TO, class P, class S>
void sdpa_varlen(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                 const RaggedBatch& batch, const std::vector<PositionMask>& masks,
                 const AttentionMask<TB>& mask, const SdpaParams& params,
                 const BlockSparseRules<P, S>& rules, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) {
  const char* op = "sdpa_varlen";
  APEX_CHECK(!batch.cu_seqlens_q.empty(),
             "[" << op << "] cu_seqlens_q must have N + 1 >= 1 entries");
  const Index n = batch.sequences();
  detail::check_offsets(batch.cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  detail::check_offsets(batch.cu_seqlens_k, n, k.seq(), op, "cu_seqlens_k");
  detail::check_block_sparse_sequences(
      *rules.classify.map, n, q.heads(), masks,
      [&](Index i) {
        const auto at = static_cast<std::size_t>(i);
        return std::pair<Index, Index>{batch.cu_seqlens_q[at + 1] - batch.cu_seqlens_q[at],
                                       batch.cu_seqlens_k[at + 1] - batch.cu_seqlens_k[at]};
      },
      op);
  detail::flash_sdpa_varlen<std::remove_const_t<Q>, std::remove_const_t<K>, std::remove_const_t<V>,
                            TO, TB>(q, k, v, batch, masks, params, out, lse, {}, mask, rules);
}

/// sdpa_nonpad_kv with block-sparse rules: the map's batch is 1 or B and it covers each batch's
/// query and key positions under mask.positions (checked first); otherwise as sdpa_nonpad_kv
/// with user rules (varlen.hpp).
template <class Q, class K, class V, class TB, class TO, class P, class S>
void sdpa_nonpad_kv(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const std::vector<Index>& nonpad_kv_seqlen, const AttentionMask<TB>& mask,
                    const SdpaParams& params, const BlockSparseRules<P, S>& rules,
                    const HeadsView<TO>& out, const HeadsView<TO>& lse = {}) {
  const char* op = "sdpa_nonpad_kv";
  APEX_CHECK(static_cast<Index>(nonpad_kv_seqlen.size()) == q.batch(),
             "[" << op << "] nonpad_kv_seqlen holds " << nonpad_kv_seqlen.size()
                 << " lengths; expected one per batch (" << q.batch() << ")");
  for (Index b = 0; b < q.batch(); ++b) {
    const Index length = nonpad_kv_seqlen[std::size_t(b)];
    APEX_CHECK(length >= 0 && length <= k.seq(), "[" << op << "] nonpad_kv_seqlen[" << b << "] ("
                                                     << length << ") must be in [0, " << k.seq()
                                                     << "], the keys the cache holds");
    check_block_sparse(
        *rules.classify.map,
        detail::block_sparse_use(mask.positions, q.batch(), q.heads(), q.seq(), length, op), op);
  }
  detail::flash_sdpa_nonpad_kv<std::remove_const_t<Q>, std::remove_const_t<K>,
                               std::remove_const_t<V>, TO, TB>(q, k, v, nonpad_kv_seqlen, mask,
                                                               params, out, lse, {}, rules);
}

/// sdpa_paged with block-sparse rules: the map's batch is 1 or the number of ids (ids[i] is
/// batch i) and it covers each sequence's query and key positions in the cache (checked first);
/// otherwise as sdpa_paged with user rules (paged_attention.hpp).
template <class Q, class Cache, class TB, class TO, class P, class S>
void sdpa_paged(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q, const Cache& cache,
                const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                const AttentionMask<TB>& mask, const SdpaParams& params,
                const BlockSparseRules<P, S>& rules, const HeadsView<TO>& out,
                const HeadsView<TO>& lse = {}) {
  const char* op = "sdpa_paged";
  const auto n = static_cast<Index>(ids.size());
  detail::check_offsets(cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  detail::check_live_ids(cache, ids, op);
  detail::check_mask_count(masks, n, op);
  for (Index i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const auto keys = cache.segment(ids[at]);
    PositionMask rule = masks[masks.size() == 1 ? 0 : at];
    detail::check_cache_rule(rule, masks.size() == 1 ? 0 : i, op);
    rule.key_offset = keys.first_position;  // the cache gives each sequence its positions
    const Index nq = std::min(cu_seqlens_q[at + 1] - cu_seqlens_q[at], keys.size());
    check_block_sparse(*rules.classify.map,
                       detail::block_sparse_use(rule, n, q.heads(), nq, keys.size(), op), op);
  }
  detail::flash_sdpa_paged<std::remove_const_t<Q>, Cache, TO, TB>(
      q, cu_seqlens_q, cache, ids, masks, params, out, lse, mask, rules);
}

/// sdpa_block_tables with block-sparse rules: the map's batch is 1 or the number of sequences
/// (sequence i is batch i) and it covers each sequence's positions (its keys [0, lengths[i]),
/// its queries the last of them), checked first; otherwise as sdpa_block_tables with user rules
/// (paged_attention.hpp).
template <class Q, class TK, class TV, class TB, class TO, class P, class S>
void sdpa_block_tables(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q,
                       const BlockTables<TK, TV>& pages, const std::vector<PositionMask>& masks,
                       const AttentionMask<TB>& mask, const SdpaParams& params,
                       const BlockSparseRules<P, S>& rules, const HeadsView<TO>& out,
                       const HeadsView<TO>& lse = {}) {
  const char* op = "sdpa_block_tables";
  const auto n = static_cast<Index>(pages.lengths.size());
  detail::check_offsets(cu_seqlens_q, n, q.seq(), op, "cu_seqlens_q");
  detail::check_block_sparse_sequences(
      *rules.classify.map, n, q.heads(), masks,
      [&](Index i) {
        const auto at = static_cast<std::size_t>(i);
        const Index length = std::max<Index>(0, pages.lengths[at]);
        return std::pair<Index, Index>{std::min(cu_seqlens_q[at + 1] - cu_seqlens_q[at], length),
                                       length};
      },
      op);
  detail::flash_sdpa_block_tables<std::remove_const_t<Q>, TK, TV, TO, TB>(
      q, cu_seqlens_q, pages, masks, params, out, lse, mask, rules);
}

}  // namespace apex
