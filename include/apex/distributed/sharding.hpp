// SPDX-License-Identifier: MIT
// How one sequence's positions are split across the P ranks of context parallelism: the
// contiguous layout (rank r holds the r-th of P runs) and the load-balanced "zigzag" layout of
// causal ring attention (the sequence cut into 2P chunks; rank r holds chunk r and chunk
// 2P − 1 − r, one early and one late, so that under a causal rule every rank has about the same
// number of (query, key) pairs to compute). Needs no MPI: sharding is arithmetic on positions.
//
//   S = 10, P = 2, contiguous:  rank 0 [0, 5)            rank 1 [5, 10)
//   S = 10, P = 2, zigzag:      rank 0 [0, 3) ∪ [8, 10)  rank 1 [3, 6) ∪ [6, 8)
//
// Chunk c of n chunks holds ⌊S/n⌋ positions, one more for c < S mod n, so chunks differ by at
// most one position and S need not be divisible by P. A rank's rows are its chunks' positions,
// in increasing order: local row i of rank r is position chunks(r)[0].begin + i while i lies in
// the first chunk, and so on.
#pragma once

#include <apex/config.hpp>
#include <apex/mask.hpp>
#include <apex/tensor.hpp>

#include <type_traits>
#include <vector>

namespace apex::distributed {

/// Which layout a SequenceSharding uses.
enum class ShardLayout {
  kContiguous,  ///< P chunks: rank r holds chunk r
  kZigzag,      ///< 2P chunks: rank r holds chunks r and 2P − 1 − r (causal load balance)
};

/// The positions [0, S) of one sequence split across P ranks. Every chunk must hold at least
/// one position, so S >= P (contiguous) or S >= 2P (zigzag); the constructor throws
/// std::invalid_argument otherwise. Default-constructed: S = 0 on one rank, whose single chunk
/// is empty.
class SequenceSharding {
 public:
  /// No positions, one rank.
  SequenceSharding() = default;
  /// S = length positions on `ranks` ranks. Throws unless ranks >= 1, length >= 0 and every
  /// chunk holds at least one position (a length of 0 is allowed on one contiguous rank only).
  SequenceSharding(Index length, int ranks, ShardLayout layout)
      : length_(length), ranks_(ranks), layout_(layout) {
    APEX_CHECK(ranks >= 1, "[sequence_sharding] ranks (" << ranks << ") must be >= 1");
    APEX_CHECK(layout == ShardLayout::kContiguous || layout == ShardLayout::kZigzag,
               "[sequence_sharding] layout (" << static_cast<int>(layout)
                                              << ") must be kContiguous or kZigzag");
    const Index chunks = chunk_count();
    APEX_CHECK(length >= chunks || (length == 0 && chunks == 1),
               "[sequence_sharding] a sequence of "
                   << length << " positions cannot be split into " << chunks
                   << (layout == ShardLayout::kZigzag ? " zigzag" : " contiguous") << " chunks for "
                   << ranks << " ranks: every chunk needs at least one position (S >= " << chunks
                   << ")");
  }

  /// Positions S in all.
  Index length() const { return length_; }
  /// Ranks P.
  int ranks() const { return ranks_; }
  /// The layout.
  ShardLayout layout() const { return layout_; }
  /// Chunks in all: P (contiguous) or 2P (zigzag).
  Index chunk_count() const { return layout_ == ShardLayout::kZigzag ? 2 * Index{ranks_} : ranks_; }

  /// The positions of chunk c, 0 <= c < chunk_count() (unchecked).
  PositionRange chunk(Index c) const {
    const Index n = chunk_count();
    const Index base = length_ / n;
    const Index extra = length_ % n;
    const Index begin = c * base + (c < extra ? c : extra);
    return {begin, begin + base + (c < extra ? 1 : 0)};
  }

  /// The chunks of rank r, 0 <= r < ranks(), in increasing position order: one (contiguous) or
  /// two (zigzag). Throws on a rank outside [0, P). Allocates the result.
  std::vector<PositionRange> chunks(int rank) const {
    APEX_CHECK(rank >= 0 && rank < ranks_,
               "[sequence_sharding] rank (" << rank << ") must lie in [0, " << ranks_ << ")");
    if (layout_ == ShardLayout::kContiguous) return {chunk(rank)};
    return {chunk(rank), chunk(2 * Index{ranks_} - 1 - rank)};
  }

  /// Positions held by rank r: the rows of its Q, K and V. Throws as chunks().
  Index local_length(int rank) const {
    Index n = 0;
    for (const PositionRange& c : chunks(rank)) n += c.end - c.begin;
    return n;
  }

 private:
  Index length_ = 0;
  int ranks_ = 1;
  ShardLayout layout_ = ShardLayout::kContiguous;
};

/// The rows of rank r's shard of a whole sequence: [B, H, S, D] in, [B, H, S_r, D] out (the
/// chunks of `sharding.chunks(rank)`, in order), copied. For tests, examples and programs that
/// start from a whole sequence on every rank. Throws unless full.seq() == sharding.length().
/// Allocates the result.
template <class T>
HeadsTensor<std::remove_const_t<T>> shard_rows(const HeadsView<T>& full,
                                               const SequenceSharding& sharding, int rank) {
  APEX_CHECK(full.seq() == sharding.length(), "[shard_rows] sequence length ("
                                                  << full.seq() << ") must be the sharding's "
                                                  << sharding.length());
  HeadsShape shape = full.shape();
  shape.seq = sharding.local_length(rank);
  HeadsTensor<std::remove_const_t<T>> shard(shape);
  Index row = 0;
  for (const PositionRange& c : sharding.chunks(rank)) {
    for (Index b = 0; b < shape.batch; ++b) {
      for (Index h = 0; h < shape.heads; ++h) {
        shard.view().head(b, h).middleRows(row, c.end - c.begin) =
            full.head(b, h).middleRows(c.begin, c.end - c.begin);
      }
    }
    row += c.end - c.begin;
  }
  return shard;
}

}  // namespace apex::distributed
