// SPDX-License-Identifier: MIT
// Sharded decoding: the K/V cache of one sequence (or of a batch of sequences of one length)
// split across the ranks of a communicator by position, so that a context too long for one
// machine's memory is held by several. A decoding step gives every rank the new token's queries
// (broadcast() them from the rank that computed them, or compute them on every rank); each rank
// attends them to the tokens it holds, and the partial results are combined with the n-way merge
// of the softmax statistics (detail::merge_rows):
//   M = max_r m_r,  w_r = l_r·e^(m_r − M),  out = Σ_r w_r·out_r / Σ_r w_r
// after one MPI_Allgather of every rank's (m, l, out) rows, merged on every rank in rank order,
// so that every rank gets the same, bit-identical result.
//
// WHO HOLDS WHAT. The prompt's positions are held as the SequenceSharding of the prefill said
// (load_prompt: the shards ring_attention took). Each later position p goes to rank
// ⌊p / decode_block⌋ mod P: blocks of decode_block consecutive tokens, dealt round the ranks, so
// that decoding fills every rank alike. Every rank knows every rank's count, so a full rank is
// known (and an append refused) everywhere.
#pragma once

#include <apex/distributed/communicator.hpp>
#include <apex/distributed/ring_attention.hpp>
#include <apex/distributed/sharding.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_format.hpp>
#include <apex/sdpa.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex::distributed {

/// A run of consecutive positions that one rank holds in consecutive rows of its cache.
struct CacheRun {
  Index position = 0;  ///< first position of the run
  Index row = 0;       ///< its row in the rank's cache
  Index count = 0;     ///< positions in the run
};

/// The shape of a ShardedKvCache: B sequences, H_kv heads of keys d_qk wide and values d_v wide,
/// and the tokens each rank can hold.
struct ShardedCacheShape {
  Index batch = 0;              ///< B
  Index num_kv_heads = 0;       ///< H_kv
  Index head_dim = 0;           ///< d_qk, the width of a key head (and of a value head by default)
  Index capacity_per_rank = 0;  ///< tokens one rank can hold
  Index decode_block = 64;      ///< positions dealt to one rank at a time after the prompt
  Index value_dim = 0;          ///< d_v, the width of a value head; 0: head_dim
};

namespace detail {

// -------------------------------------------------------------------------------------------
// The steps of a ShardedKvCache that hold no state of their own: its checks, who owns a
// position, and the records of attend (written by each rank, merged on every rank)
// -------------------------------------------------------------------------------------------

/// The rank that holds a position past the prompt: ⌊p / decode_block⌋ mod P.
inline int owner_rank(Index position, Index decode_block, int ranks) {
  return static_cast<int>((position / decode_block) % ranks);
}

/// The values every rank of a ShardedKvCache agrees on at construction: the shape and the code
/// of the storage type.
inline std::vector<Agreed> cache_shape_agreement(const ShardedCacheShape& shape,
                                                 std::int64_t storage_type) {
  return {{"batch", shape.batch},
          {"num_kv_heads", shape.num_kv_heads},
          {"head_dim", shape.head_dim},
          {"value_dim", shape.value_dim},
          {"capacity_per_rank", shape.capacity_per_rank},
          {"decode_block", shape.decode_block},
          {"storage type", storage_type}};
}

/// One rank's K and V: the buffers of a KvCache (kv_cache.hpp), [B, H_kv, C, d_qk] and
/// [B, H_kv, C, d_v] in Storage's format, zeroed. Throws unless decode_block and every extent
/// are >= 1 and d_qk and d_v are whole blocks of the format (KvBuffers' checks, as KvCache's),
/// d_v being value_dim, or head_dim when it is 0.
template <class Scalar, class Storage>
apex::detail::KvBuffers<Scalar, Storage> shard_buffers(const ShardedCacheShape& shape,
                                                       const char* op) {
  APEX_CHECK(shape.decode_block >= 1,
             "[" << op << "] decode_block (" << shape.decode_block << ") must be >= 1");
  const Index d_v = shape.value_dim == 0 ? shape.head_dim : shape.value_dim;
  return apex::detail::KvBuffers<Scalar, Storage>(
      {shape.batch, shape.num_kv_heads, shape.capacity_per_rank, shape.head_dim}, d_v, op,
      "capacity_per_rank");
}

/// Throws unless k and v are chunks [B, H_kv, n, d_qk] and [B, H_kv, n, d_v] of a cache whose
/// buffers have the shapes `keys` and `values`.
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (k, v) as everywhere in apex
void check_kv_chunk(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    const HeadsShape& keys, const HeadsShape& values, const char* op) {
  apex::detail::check_extents(k, op, "k shape");
  apex::detail::check_extents(v, op, "v shape");
  APEX_CHECK(k.batch() == keys.batch && k.heads() == keys.heads && k.dim() == keys.dim,
             "[" << op << "] k chunk [" << k.batch() << ", " << k.heads() << ", n, " << k.dim()
                 << "] must be [B, H_kv, n, d_qk] = [" << keys.batch << ", " << keys.heads
                 << ", n, " << keys.dim << "]");
  APEX_CHECK(v.batch() == values.batch && v.heads() == values.heads && v.dim() == values.dim &&
                 v.seq() == k.seq(),
             "[" << op << "] v chunk [" << v.batch() << ", " << v.heads() << ", " << v.seq() << ", "
                 << v.dim() << "] must be [B, H_kv, n, d_v] = [" << values.batch << ", "
                 << values.heads << ", " << k.seq() << ", " << values.dim << "]");
}

/// Throws unless n tokens appended at `position` fit: into the room of all ranks together, and
/// each into the room of the rank that owns it (owner_rank), every rank holding `counts[r]` of
/// `capacity` positions.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, positions and sizes
inline void check_append_room(const std::vector<Index>& counts, Index capacity, Index decode_block,
                              Index position, Index n, const char* op) {
  const auto ranks = static_cast<int>(counts.size());
  // More tokens than all ranks have room for never fit. Checked first, so that the owners
  // below are counted over at most that room and position + n is an Index.
  Index room = 0;
  for (const Index held : counts) {
    room = apex::detail::checked_sum(room, capacity - held, op, "positions free");
  }
  APEX_CHECK(n <= room, "[" << op << "] appending " << n << " tokens at position " << position
                            << " would exceed the capacity (" << capacity << " per rank) of all "
                            << ranks << " ranks, which have " << room << " positions free");
  std::vector<Index> extra(counts.size(), 0);
  for (Index i = 0; i < n; ++i) {
    ++extra[static_cast<std::size_t>(owner_rank(position + i, decode_block, ranks))];
  }
  for (int r = 0; r < ranks; ++r) {
    const auto at = static_cast<std::size_t>(r);
    APEX_CHECK(counts[at] + extra[at] <= capacity,
               "[" << op << "] appending " << extra[at] << " tokens to rank " << r
                   << ", which holds " << counts[at] << ", would exceed its capacity (" << capacity
                   << ")");
  }
}

/// One rank's part of attend as records: for each (b, h, i) row of part [B, H_q, S_q, d], the
/// row's m = max(b, h)(i), l = sum(b, h)(i) and the d values of part, in double.
template <class Scalar>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): (part, max, sum) as flash_attention's
void write_records(const HeadsTensor<Scalar>& part, const HeadsTensor<Scalar>& max,
                   const HeadsTensor<Scalar>& sum, double* records) {
  const Index d = part.dim();
  for (Index b = 0; b < part.batch(); ++b) {
    for (Index h = 0; h < part.heads(); ++h) {
      for (Index i = 0; i < part.seq(); ++i) {
        double* rec = records + ((b * part.heads() + h) * part.seq() + i) * (d + 2);
        rec[0] = double(max.head(b, h)(i, 0));
        rec[1] = double(sum.head(b, h)(i, 0));
        for (Index c = 0; c < d; ++c) rec[2 + c] = double(part.head(b, h)(i, c));
      }
    }
  }
}

/// The rows of every rank's records `all` (rank-major; per rank, row (b, h, i) of q's shape
/// holds m, l and d values of out), merged in rank order with each head's sink (-inf without
/// sinks) into out (and lse) in their type.
template <class TO>
// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (out, lse) as sdpa's
void merge_records(const std::vector<double>& all, int ranks, const HeadsShape& q, Index d,
                   const std::vector<double>& sinks, const HeadsView<TO>& out,
                   const HeadsView<TO>& lse) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const Index rows = q.batch * q.heads * q.seq;
  const Index width = d + 2;  // m, l, out
  std::vector<double> scratch(static_cast<std::size_t>(ranks + d));
  for (Index b = 0; b < q.batch; ++b) {
    for (Index h = 0; h < q.heads; ++h) {
      const double sink = sinks.empty() ? -std::numeric_limits<double>::infinity()
                                        : sinks[static_cast<std::size_t>(h)];
      for (Index i = 0; i < q.seq; ++i) {
        const Index row = (b * q.heads + h) * q.seq + i;
        const auto part_at = [&](Index r) {
          const double* rec = all.data() + (r * rows + row) * width;
          return apex::detail::PartRow<double, double>{rec + 2, {rec[0], rec[1]}};
        };
        const auto total =
            apex::detail::merge_rows<double>(ranks, d, part_at, out.head(b, h).row(i).data(),
                                             scratch.data(), scratch.data() + ranks, sink);
        if (!lse.empty())
          lse.head(b, h)(i, 0) = apex::round_to<TO>(apex::detail::log_sum_exp(total));
      }
    }
  }
}

}  // namespace detail

/// One attention layer's K/V cache, sharded by position over the ranks of a communicator (see
/// WHO HOLDS WHAT above). Each rank holds K [B, H_kv, C, d_qk] and V [B, H_kv, C, d_v] in the
/// K/V format Storage (kv_format.hpp: float, double, half, bfloat16, or a block format of
/// kv_quant.hpp), C = capacity_per_rank, allocated (zeroed) at construction; Scalar is the type
/// of the chunks appended and of the attention. Each row is stored as a KvCache of Storage
/// stores it: rounded once, or quantized once, block by block, when it is appended (a row is
/// never sent between ranks: every rank is given the rows and keeps its own), and attend reads
/// the stored rows as sdpa does, so its result is the float kernel's over the decoded values.
/// Default-constructed or moved from, it is empty: no communicator, no memory, and every call
/// but the accessors throws.
template <class Scalar, class Storage = Scalar>
class ShardedKvCache {
 public:
  /// An empty cache.
  ShardedKvCache() = default;

  /// Collective: every rank of comm constructs its shard with the same shape and Storage
  /// (agreed). Throws std::invalid_argument on every rank unless each extent, the capacity and
  /// decode_block are >= 1 and head_dim and the value width are whole blocks of Storage's format
  /// (`[sharded_kv_cache] head_dim (48) must be a multiple of the 32 values of a block of its
  /// format`). comm must outlive the cache.
  ShardedKvCache(MPI_Comm comm, const ShardedCacheShape& shape) {
    constexpr const char* op = "sharded_kv_cache";
    const RankInfo me = detail::rank_info(comm, op);
    detail::agree(comm, me, op, detail::cache_shape_agreement(shape, detail::type_code<Storage>()),
                  [&] { buffers_ = detail::shard_buffers<Scalar, Storage>(shape, op); });
    comm_ = comm;
    me_ = me;
    decode_block_ = shape.decode_block;
    counts_.assign(static_cast<std::size_t>(me.size), 0);
  }

  /// Ranks P the cache spans (1 when empty).
  int ranks() const { return me_.get().size; }
  /// This rank's place.
  int rank() const { return me_.get().rank; }
  /// Positions held by all ranks together: the next position is length().
  Index length() const { return length_; }
  /// Positions this rank holds.
  Index local_length() const { return local_size_; }
  /// Positions each rank can hold.
  Index capacity() const { return buffers_.shape().seq; }
  /// Positions rank r holds (every rank knows every rank's count). Throws on a rank outside
  /// [0, P).
  Index length_of(int r) const {
    APEX_CHECK(r >= 0 && r < me_.get().size,
               "[sharded_kv_cache] rank (" << r << ") must lie in [0, " << me_.get().size << ")");
    return counts_.empty() ? 0 : counts_[static_cast<std::size_t>(r)];
  }
  /// The runs this rank holds, in increasing position order.
  const std::vector<CacheRun>& runs() const { return runs_; }
  /// Exact bytes of this rank's K and V buffers as stored, through Storage's format:
  /// B·H_kv·C·(d_qk + d_v) values, in blocks for a block format (KvFormat::bytes).
  std::int64_t bytes() const { return buffers_.bytes(); }
  /// [B, H_kv, local_length(), d_qk] view of the keys this rank holds, as stored (elements of
  /// Storage: blocks for a block format, row_values gives d_qk), in the order of runs(): after
  /// load_prompt, this rank's K shard of the prompt as ring_attention takes it. No copy; it
  /// holds local_length() as of the call.
  HeadsView<const Storage> keys() const { return buffers_.keys(0, local_size_); }
  /// [B, H_kv, local_length(), d_v] view of the values this rank holds; as keys().
  HeadsView<const Storage> values() const { return buffers_.values(0, local_size_); }
  /// The rank that holds (or will hold) a position past the prompt: ⌊p / decode_block⌋ mod P.
  int owner_of(Index position) const {
    return detail::owner_rank(position, decode_block_, me_.get().size);
  }

  /// Collective: stores this rank's shard of a prompt of sharding.length() positions, starting
  /// at position 0 on an empty cache: k [B, H_kv, S_r, d_qk], v [B, H_kv, S_r, d_v], the rows of
  /// sharding.chunks(rank) in order (what ring_attention took). Throws on every rank, with no
  /// rank changed, unless every rank's cache is constructed and empty, the sharding spans the
  /// communicator, the shapes fit and every rank's shard fits its capacity. Allocates the runs.
  void load_prompt(const SequenceSharding& sharding, const HeadsView<const Scalar>& k,
                   const HeadsView<const Scalar>& v) {
    constexpr const char* op = "sharded_kv_cache";
    const RankInfo me = detail::rank_info(comm_, op);
    detail::agree(comm_, me, op,
                  {{"sequence length", sharding.length()},
                   {"ranks", sharding.ranks()},
                   {"layout", static_cast<std::int64_t>(sharding.layout())},
                   {"length", length_}},
                  [&] {
                    APEX_CHECK(length_ == 0, "[" << op << "] load_prompt needs an empty cache; it "
                                                 << "holds " << length_ << " positions");
                    APEX_CHECK(sharding.ranks() == me.size,
                               "[" << op << "] sharding ranks (" << sharding.ranks()
                                   << ") must be the communicator's size " << me.size);
                    const Index rows = sharding.local_length(me.rank);
                    APEX_CHECK(k.seq() == rows, "[" << op << "] shard rows (" << k.seq()
                                                    << ") must be this rank's shard length "
                                                    << rows);
                    check_chunk(k, v);
                    APEX_CHECK(rows <= capacity(), "[" << op << "] this rank's shard (" << rows
                                                       << " positions) exceeds its capacity ("
                                                       << capacity() << ")");
                  });
    store(k, v, 0, k.seq());
    Index row = 0;
    for (int r = 0; r < me.size; ++r) {
      counts_[static_cast<std::size_t>(r)] = sharding.local_length(r);
    }
    for (const PositionRange& c : sharding.chunks(me.rank)) {
      if (c.end > c.begin) runs_.push_back({c.begin, row, c.end - c.begin});
      row += c.end - c.begin;
    }
    length_ = sharding.length();
  }

  /// Appends n tokens at positions [position, position + n), each stored by its owner (owner_of):
  ///   k: [B, H_kv, n, d_qk], v: [B, H_kv, n, d_v], the same on every rank (each rank keeps the
  ///   rows it owns).
  /// No communication. Every rank checks everything (position == length(), the shapes, each
  /// owner's room), so a call that one rank refuses every rank refuses alike, before anything
  /// changes. Allocates a run where a new one starts.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index position) {
    constexpr const char* op = "sharded_kv_cache";
    check_chunk(k, v);
    apex::detail::check_append_position(position, length_, op);
    detail::check_append_room(counts_, capacity(), decode_block_, position, k.seq(), op);
    for (Index i = 0; i < k.seq();) {
      const int owner = owner_of(position + i);
      Index n = 1;
      while (i + n < k.seq() && owner_of(position + i + n) == owner) ++n;
      if (owner == me_.get().rank) {
        if (runs_.empty() || runs_.back().position + runs_.back().count != position + i) {
          runs_.push_back({position + i, local_size_, 0});
        }
        store(k, v, i, n);
        runs_.back().count += n;
      }
      counts_[static_cast<std::size_t>(owner)] += n;
      i += n;
    }
    length_.get() += k.seq();
  }

  /// Collective: the attention of S_q queries to every cached position, on every rank:
  ///   out = sdpa(q, K, V, {rule}, params) over the whole cache, rule on absolute positions
  ///   (keys 0 .. length() − 1, key_offset 0; by default the queries are the last S_q
  ///   positions, the decoding convention).
  ///   q: [B, H_q, S_q, d_qk], the same on every rank -> out: [B, H_q, S_q, d_v],
  ///   lse (optional): [B, H_q, S_q, 1], the same on every rank.
  /// Each rank attends to its runs (one pass of the tiled kernel, the runs as key segments),
  /// then one MPI_Allgather of its B·H_q·S_q rows of (m, l, out) in double, merged with the
  /// sinks on every rank in rank order. Checks (shapes, rule, parameters, agreed values, and
  /// B·H_q·S_q·(d_v + 2) <= 2^31 − 1, the records being one MPI message) throw on every rank
  /// before anything is written. Accuracy within the fast path's tolerance of the double
  /// reference; the result does not depend on the number of threads. Allocates the records:
  /// (P + 1)·B·H_q·S_q·(d_v + 2) doubles, a part in Scalar and a segment per run.
  /// Returns this rank's record bytes as collective_bytes.
  template <class TO>
  Traffic attend(const HeadsView<const Scalar>& q, const PositionMask& rule,
                 const SdpaParams& params, const HeadsView<TO>& out,
                 const HeadsView<TO>& lse = {}) const {
    constexpr const char* op = "sharded_kv_cache";
    const RankInfo me = detail::rank_info(comm_, op);
    std::vector<detail::Agreed> agreed = {{"length", length_},
                                          {"batch", q.batch()},
                                          {"query heads", q.heads()},
                                          {"queries", q.seq()},
                                          {"d", q.dim()},
                                          {"output type", detail::type_code<TO>()},
                                          {"lse given", lse.empty() ? 0 : 1}};
    for (const detail::Agreed& a : detail::rule_agreement(rule, params)) agreed.push_back(a);
    detail::agree(comm_, me, op, agreed, [&] {
      apex::detail::check_constructed(!counts_.empty(), op, "cache");
      apex::detail::check_sdpa(q, keys(), values(), AttentionMask<TO>{PositionMask{}, {}, {}},
                               params, out, lse, op);
      apex::detail::check_outputs<TO>({out, lse}, op);
      apex::detail::check_position_mask(rule, q.seq(), length_, op);
      APEX_CHECK(rule.key_offset == 0, "[" << op << "] key_offset (" << rule.key_offset
                                           << ") must be 0: the cache's keys are positions 0 .. "
                                           << length_ - 1);
      // The records go to MPI as one message of doubles, whose count is an int.
      const std::int64_t count = apex::detail::checked_product(
          {q.batch(), q.heads(), q.seq(), value_dim() + 2}, op, "records B*H_q*S_q*(d_v + 2)");
      APEX_CHECK(count <= std::numeric_limits<int>::max(),
                 "[" << op << "] the records of B*H_q*S_q*(d_v + 2) = " << count
                     << " doubles exceed one MPI message (2^31 - 1 elements): attend fewer "
                        "queries at a time");
    });

    const Index rows = q.batch() * q.heads() * q.seq();
    const Index d = value_dim();
    const Index width = d + 2;  // m, l, out
    std::vector<double> mine(static_cast<std::size_t>(rows * width));
    local_part(q, rule, params, mine.data());
    std::vector<double> all(mine.size() * static_cast<std::size_t>(me.size));
    const int count = static_cast<int>(mine.size());  // checked above
    detail::mpi_call(
        MPI_Allgather(mine.data(), count, MPI_DOUBLE, all.data(), count, MPI_DOUBLE, comm_), op);
    detail::merge_records(all, me.size, q.shape(), d, params.sinks, out, lse);
    Traffic traffic;
    traffic.collective_bytes = static_cast<std::int64_t>(mine.size() * sizeof(double));
    return traffic;
  }

 private:
  /// Throws unless the cache is constructed and k and v are chunks [B, H_kv, n, d_qk] and
  /// [B, H_kv, n, d_v] of it.
  void check_chunk(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) const {
    apex::detail::check_constructed(!counts_.empty(), "sharded_kv_cache", "cache");
    detail::check_kv_chunk(k, v, buffers_.shape(), buffers_.value_shape(), "sharded_kv_cache");
  }

  /// d_v, the values in a row of V.
  Index value_dim() const { return buffers_.value_shape().dim; }

  /// Appends rows [from, from + n) of the chunk k, v after this rank's rows, stored through
  /// Storage's format (KvBuffers::write: rounded, or quantized row by row).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, (k, v) as everywhere in apex
  void store(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v, Index from,
             Index n) {
    buffers_.write(k, v, from, n, local_size_);
    local_size_.get() += n;
  }

  /// This rank's part, as records (m, l, out[d]) per (b, h, i) row, without the sink. A rank
  /// holding no key that the rule allows gives (-inf, 0, zeros).
  void local_part(const HeadsView<const Scalar>& q, const PositionMask& rule,
                  const SdpaParams& params, double* records) const {
    const Index d = value_dim();
    const HeadsShape row_shape{q.batch(), q.heads(), q.seq(), 1};
    HeadsTensor<Scalar> part({q.batch(), q.heads(), q.seq(), d}), max(row_shape), sum(row_shape);
    std::vector<apex::detail::KeySegment<Storage, Storage>> segments;
    const Index first_query = rule.first_query_position(q.seq(), length_);
    for (const CacheRun& run : runs_) {
      if (q.seq() > 0 && classify_block(rule, first_query, first_query + q.seq(), run.position,
                                        run.position + run.count) == BlockCoverage::kNone) {
        continue;
      }
      segments.push_back(
          {buffers_.keys(run.row, run.count), buffers_.values(run.row, run.count), run.position});
    }
    for (Index i = 0; i < max.seq() * max.batch() * max.heads(); ++i) {
      max.data()[i] = -std::numeric_limits<Scalar>::infinity();
    }
    if (!segments.empty()) {
      Index keys = 0;
      for (const auto& s : segments) keys += s.size();
      SdpaParams part_params = params;
      part_params.sinks.clear();  // the sink joins once, in the merge
      PositionMask positions = rule;
      positions.query_offset = first_query;
      positions.key_offset = segments.front().first_position;
      const auto problem = apex::detail::attention_problem<Scalar, Storage, Storage>(
          q, segments.data(), static_cast<Index>(segments.size()), keys, positions, first_query,
          part_params);
      apex::detail::flash_attention(
          problem, apex::detail::AttentionOutputs<Scalar>{part.view(), {}, max.view(), sum.view()},
          apex::detail::FlashBlocking{});
    }
    detail::write_records(part, max, sum, records);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  apex::detail::ResetOnMove<RankInfo> me_;
  Index decode_block_ = 1;
  apex::detail::KvBuffers<Scalar, Storage> buffers_;  // [B, H_kv, C, d_qk], [B, H_kv, C, d_v]
  apex::detail::ResetOnMove<Index> local_size_;       // rows this rank holds
  std::vector<Index> counts_;   // positions held by each rank; empty: not constructed
  std::vector<CacheRun> runs_;  // this rank's runs
  apex::detail::ResetOnMove<Index> length_;
};

}  // namespace apex::distributed
