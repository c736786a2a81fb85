// SPDX-License-Identifier: MIT
// Context-parallel prefill: ring attention over MPI. Each of P ranks holds its shard of one
// sequence's Q, K and V (SequenceSharding: contiguous, or zigzag for causal load balance); the
// K/V shards travel around the ring of ranks, and each rank attends its queries to every shard
// that reaches it while the next one is in flight, merging each partial result into its running
// one through the softmax statistics (detail::merge_rows, the n-way merge of merge_attention.hpp).
// The result equals apex::sdpa over the whole sequence, row for row (within float's rounding of the
// merge; see ring_attention).
//
// THE RING. At step s (s = 0, 1, ...) rank r holds the K/V shard of rank o = (r − s) mod P,
// attends its query chunks to it, and forwards it to rank r + 1. The position rule decides, per
// pair of chunks, whether any (query, key) pair may attend (classify_block): pairs that cannot
// are never computed, and a shard is forwarded only as far as some rank still needs it. Shard o
// travels hops(o) steps, the largest t < P for which rank (o + t) mod P attends to a key of o
// (0 when none does): causal zigzag and unmasked attention need every shard everywhere
// (P − 1 hops); a sliding window narrower than a chunk needs one hop, and rank P − 1 never sends
// to rank 0. ring_plan gives the hops; ring_bytes_sent the exact bytes each rank sends.
//
// BYTES. Rank r sends, at each step s < hops((r − s) mod P), the K and V shard it holds (two
// messages) as stored: kv_row_bytes · S_o bytes with S_o that shard's rows and
//   kv_row_bytes = B · H_kv · (bytes of a key row in TK + bytes of a value row in TV),
// a row of d values taking d · sizeof(T) bytes in a scalar format and d / kValues blocks in a
// block format of kv_quant.hpp (KvFormat::bytes: q8_0's 34 bytes per 32 values, ...): K and V
// of a block format travel as their blocks, never widened.
// docs/guide.md ("Context parallelism") turns this into a scaling model.
#pragma once

#include <apex/distributed/communicator.hpp>
#include <apex/distributed/sharding.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_format.hpp>
#include <apex/kv_quant.hpp>
#include <apex/sdpa.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex::distributed {

/// How far each rank's K/V shard travels around the ring under a position rule.
struct RingPlan {
  std::vector<int> hops;  ///< hops[o]: steps shard o is forwarded (0 .. P − 1)
  int steps = 1;          ///< steps of the ring: 1 + max_o hops[o]
};

namespace detail {

/// Whether some query of rank qr may attend some key of rank kr (positions key_offset + row).
inline bool shards_interact(const SequenceSharding& sharding, const PositionMask& rule, int qr,
                            int kr) {
  for (const PositionRange& q : sharding.chunks(qr)) {
    for (const PositionRange& k : sharding.chunks(kr)) {
      const Index o = rule.key_offset;
      if (classify_block(rule, o + q.begin, o + q.end, o + k.begin, o + k.end) !=
          BlockCoverage::kNone) {
        return true;
      }
    }
  }
  return false;
}

/// The code of an fp8 block format of B values (type_code): 16·B + 7 for e4m3, + 8 for e5m2.
template <Fp8Kind K, int B>
constexpr std::int64_t fp8_block_code(const BlockFp8<K, B>* /*format*/) {
  return 16 * static_cast<std::int64_t>(B) + (K == Fp8Kind::kE4m3 ? 7 : 8);
}

/// A code for each storage type and K/V format (kv_format.hpp), so that ranks can check that
/// they agree on it: 1-4 float, double, half, bfloat16; 5 q8_0; 6 q4_0; fp8 blocks
/// fp8_block_code. Any other type does not compile.
template <class T>
constexpr std::int64_t type_code() {
  if constexpr (std::is_same_v<T, float>) {
    return 1;
  } else if constexpr (std::is_same_v<T, double>) {
    return 2;
  } else if constexpr (std::is_same_v<T, Eigen::half>) {
    return 3;
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return 4;
  } else if constexpr (std::is_same_v<T, BlockQ8_0>) {
    return 5;
  } else if constexpr (std::is_same_v<T, BlockQ4_0>) {
    return 6;
  } else {
    return fp8_block_code(static_cast<const T*>(nullptr));
  }
}

/// FNV-1a of `count` objects' bytes: lets ranks compare vectors (sinks, slopes, document ids)
/// through one integer. It runs before the checks (the agreement carries it), so a count that
/// the checks will reject (negative) reads nothing, and no byte count is formed that could wrap.
template <class T>
std::int64_t bytes_hash(const T* data, Index count) {
  std::uint64_t h = 1469598103934665603ULL;
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  for (Index i = 0; i < count; ++i) {
    for (std::size_t b = 0; b < sizeof(T); ++b) {
      h = (h ^ bytes[static_cast<std::size_t>(i) * sizeof(T) + b]) * 1099511628211ULL;
    }
  }
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

/// The bits of a double, as an agreed value.
inline std::int64_t bits_of(double x) {
  std::int64_t out = 0;
  std::memcpy(&out, &x, sizeof out);
  return out;
}

/// The values every rank must agree on for attention under `rule` and `params`.
inline std::vector<Agreed> rule_agreement(const PositionMask& rule, const SdpaParams& params) {
  const DocumentIds& docs = rule.documents;
  return {{"causal", rule.causal ? 1 : 0},
          {"window", rule.window ? *rule.window : -1},
          {"chunk", rule.chunk ? *rule.chunk : -1},
          {"prefix", rule.prefix},
          {"key_offset", rule.key_offset},
          {"query_offset", rule.query_offset ? *rule.query_offset : -1},
          {"documents length", docs.size},
          {"documents", docs.empty() ? 0 : bytes_hash(docs.ids, docs.size)},
          {"scale", params.scale ? bits_of(*params.scale) : -1},
          {"softcap", bits_of(params.softcap)},
          {"sinks", bytes_hash(params.sinks.data(), static_cast<Index>(params.sinks.size()))},
          {"alibi_slopes",
           bytes_hash(params.alibi_slopes.data(), static_cast<Index>(params.alibi_slopes.size()))},
          {"allow_bf16_products", params.allow_bf16_products ? 1 : 0}};
}

/// A K/V shard as it travels: [B, H_kv, rows, d_qk] keys and [B, H_kv, rows, d_v] values,
/// contiguous, as stored: elements of their formats TK and TV (the shapes count elements:
/// blocks of a block format).
template <class TK, class TV>
struct KvShard {
  std::vector<TK> k;
  std::vector<TV> v;
  HeadsShape k_shape, v_shape;  // of the shard held now

  /// Room for `rows` rows of the given shapes (rows replaced).
  void reserve(HeadsShape ks, HeadsShape vs, Index rows) {
    ks.seq = vs.seq = rows;
    k.resize(static_cast<std::size_t>(ks.batch * ks.heads * ks.seq * ks.dim));
    v.resize(static_cast<std::size_t>(vs.batch * vs.heads * vs.seq * vs.dim));
  }
  /// Sets the shape of the shard held to `rows` rows (within the room reserved).
  void hold(Index rows) { k_shape.seq = v_shape.seq = rows; }
  HeadsView<TK> keys() { return HeadsView<TK>::contiguous(k.data(), k_shape); }
  HeadsView<TV> values() { return HeadsView<TV>::contiguous(v.data(), v_shape); }
  /// Bytes of the keys (values) held, as stored (KvFormat::bytes).
  std::int64_t key_bytes() const {
    return KvFormat<TK>::bytes(k_shape.batch * k_shape.heads * k_shape.seq * k_shape.dim);
  }
  std::int64_t value_bytes() const {
    return KvFormat<TV>::bytes(v_shape.batch * v_shape.heads * v_shape.seq * v_shape.dim);
  }
};

/// The running result of one rank's query rows: the normalised output so far [B, H_q, S_r, d_v]
/// in C and each row's statistics (m, l) in double, with the part a step adds beside it.
template <class C>
struct RunningRows {
  HeadsTensor<C> out, part_out, part_max, part_sum;
  std::vector<apex::detail::SoftmaxStats<double>> stats;  // [B, H_q, S_r] rows
};

/// Merges the part rows [row0, row0 + rows) of every head into the running result:
/// merge_rows of the two parts (running, new), in that order, in double.
template <class C>
void merge_part(RunningRows<C>& r, Index row0, Index rows) {
  const HeadsShape s = r.out.shape();
  std::vector<double> scratch(static_cast<std::size_t>(2 + s.dim));
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) {
      for (Index i = row0; i < row0 + rows; ++i) {
        auto& running = r.stats[static_cast<std::size_t>((b * s.heads + h) * s.seq + i)];
        C* out = r.out.head(b, h).row(i).data();
        const apex::detail::SoftmaxStats<double> part{double(r.part_max.head(b, h)(i, 0)),
                                                      double(r.part_sum.head(b, h)(i, 0))};
        const C* part_out = r.part_out.head(b, h).row(i).data();
        const auto part_at = [&](Index c) {
          return apex::detail::PartRow<C, double>{c == 0 ? out : part_out, c == 0 ? running : part};
        };
        running = apex::detail::merge_rows<double>(2, s.dim, part_at, out, scratch.data(),
                                                   scratch.data() + 2);
      }
    }
  }
}

}  // namespace detail

/// The hops of every shard under `rule` (positions key_offset + row of the whole sequence; see
/// THE RING above). Needs no MPI. Throws std::invalid_argument unless the rule is one that
/// ring_attention accepts on the positions [key_offset, key_offset + S) (check_position_mask:
/// every position an Index). Allocates the result.
inline RingPlan ring_plan(const SequenceSharding& sharding, const PositionMask& rule) {
  apex::detail::check_position_mask(rule, sharding.length(), sharding.length(), "ring_plan");
  const int p = sharding.ranks();
  RingPlan plan;
  plan.hops.assign(static_cast<std::size_t>(p), 0);
  for (int o = 0; o < p; ++o) {
    for (int t = 1; t < p; ++t) {
      if (detail::shards_interact(sharding, rule, (o + t) % p, o)) {
        plan.hops[static_cast<std::size_t>(o)] = t;
      }
    }
    plan.steps = std::max(plan.steps, 1 + plan.hops[static_cast<std::size_t>(o)]);
  }
  return plan;
}

/// The bytes each rank sends in ring_attention, [P]: rank r sends, at each step s <
/// hops((r − s) mod P), the shard it holds, kv_row_bytes · S_((r − s) mod P) bytes, where
/// kv_row_bytes is what one position's K and V take as stored (BYTES above: for scalar formats
/// B·H_kv·(d_qk·sizeof(TK) + d_v·sizeof(TV)), for block formats their blocks' bytes).
/// Needs no MPI. Throws std::invalid_argument as ring_plan, for kv_row_bytes < 0, and when a
/// rank's bytes do not fit in 64 bits. Allocates the result.
inline std::vector<std::int64_t> ring_bytes_sent(const SequenceSharding& sharding,
                                                 const PositionMask& rule,
                                                 std::int64_t kv_row_bytes) {
  constexpr const char* op = "ring_bytes_sent";
  APEX_CHECK(kv_row_bytes >= 0,
             "[" << op << "] kv_row_bytes (" << kv_row_bytes << ") must be >= 0");
  apex::detail::check_position_mask(rule, sharding.length(), sharding.length(), op);
  const RingPlan plan = ring_plan(sharding, rule);
  const int p = sharding.ranks();
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(p), 0);
  for (int r = 0; r < p; ++r) {
    for (int s = 0; s < p; ++s) {
      const int o = ((r - s) % p + p) % p;
      if (s < plan.hops[static_cast<std::size_t>(o)]) {
        std::int64_t& sent = bytes[static_cast<std::size_t>(r)];
        sent = apex::detail::checked_sum(
            sent,
            apex::detail::checked_product(kv_row_bytes, sharding.local_length(o), op,
                                          "a shard's bytes kv_row_bytes*S_o"),
            op, "a rank's bytes sent");
      }
    }
  }
  return bytes;
}

namespace detail {

/// What every rank of a ring_attention call must agree on: the sharding, the shapes, the storage
/// types, the choice of lse, and the rule and parameters (rule_agreement).
template <class TQ, class TK, class TV, class TO>
std::vector<Agreed> ring_agreement(const SequenceSharding& sharding, const HeadsShape& q,
                                   const HeadsShape& k, Index d_v, bool lse_given,
                                   const PositionMask& positions, const SdpaParams& params) {
  std::vector<Agreed> agreed = {{"ranks", sharding.ranks()},
                                {"sequence length", sharding.length()},
                                {"layout", static_cast<std::int64_t>(sharding.layout())},
                                {"batch", q.batch},
                                {"query heads", q.heads},
                                {"key/value heads", k.heads},
                                {"d_qk", q.dim},
                                {"d_v", d_v},
                                {"query type", type_code<TQ>()},
                                {"key type", type_code<TK>()},
                                {"value type", type_code<TV>()},
                                {"output type", type_code<TO>()},
                                {"lse given", lse_given ? 1 : 0}};
  for (const Agreed& a : rule_agreement(positions, params)) agreed.push_back(a);
  return agreed;
}

/// This rank's checks of a ring_attention call (run inside the agreement, so that one rank's
/// failure throws on all): the shard lengths, sdpa's checks of the shapes and outputs, the rule
/// on the whole sequence, self-attention, and every size formed later (each message and shard
/// buffer at most a K or V shard of two of the largest chunks; the running rows).
template <class TQ, class TK, class TV, class TO>
void check_ring_inputs(const RankInfo& me, const SequenceSharding& sharding,
                       const HeadsView<const TQ>& q, const HeadsView<const TK>& k,
                       const HeadsView<const TV>& v, const PositionMask& positions,
                       const SdpaParams& params, const HeadsView<TO>& out, const HeadsView<TO>& lse,
                       const char* op) {
  APEX_CHECK(sharding.ranks() == me.size, "[" << op << "] sharding ranks (" << sharding.ranks()
                                              << ") must be the communicator's size " << me.size);
  const Index rows = sharding.local_length(me.rank);
  APEX_CHECK(q.seq() == rows && k.seq() == rows && v.seq() == rows,
             "[" << op << "] q, k, v rows (" << q.seq() << ", " << k.seq() << ", " << v.seq()
                 << ") must be this rank's shard length " << rows);
  PositionMask local;  // the shapes against each other; the rule against the whole sequence
  apex::detail::check_sdpa(q, k, v, AttentionMask<TO>{local, {}, {}}, params, out, lse, op);
  apex::detail::check_outputs<TO>({out, lse}, op);
  apex::detail::check_position_mask(positions, sharding.length(), sharding.length(), op);
  APEX_CHECK(!positions.query_offset || *positions.query_offset == positions.key_offset,
             "[" << op << "] query_offset (" << *positions.query_offset
                 << ") must be unset or equal to key_offset (" << positions.key_offset
                 << "): ring attention is self-attention");
  using apex::detail::checked_product;
  const Index largest = sharding.chunk(0).end - sharding.chunk(0).begin;
  const std::int64_t row_bytes =  // a row of k.dim() elements of TK (v.dim() of TV), as stored
      std::max(checked_product(k.dim(), KvFormat<TK>::bytes(1), op, "a key row's bytes"),
               checked_product(v.dim(), KvFormat<TV>::bytes(1), op, "a value row's bytes"));
  const std::int64_t bytes = checked_product({q.batch(), k.heads(), largest, 2, row_bytes}, op,
                                             "a K or V shard's bytes B*H_kv*S_chunk*2*row bytes");
  APEX_CHECK(bytes <= std::numeric_limits<int>::max(),
             "[" << op << "] a K or V shard of up to " << bytes
                 << " bytes exceeds one MPI message (2^31 − 1 bytes): use more ranks");
  checked_product({q.batch(), q.heads(), rows, row_values(v) + 1,
                   static_cast<std::int64_t>(2 * sizeof(double))},
                  op, "the running rows' bytes B*H_q*S_r*(d_v + 1)*16");
}

/// The two K/V shard buffers of the ring, each with room for the largest shard; the first holds
/// this rank's own K and V, copied as they are stored (write_rows of kv_cache.hpp).
template <class TK, class TV>
std::array<KvShard<TK, TV>, 2> ring_shards(const SequenceSharding& sharding,
                                           const HeadsView<const TK>& k,
                                           const HeadsView<const TV>& v) {
  Index room = 0;
  for (int r = 0; r < sharding.ranks(); ++r) room = std::max(room, sharding.local_length(r));
  std::array<KvShard<TK, TV>, 2> shards;
  for (auto& s : shards) {
    s.k_shape = k.shape();
    s.v_shape = v.shape();
    s.reserve(k.shape(), v.shape(), room);
  }
  apex::detail::write_rows(k, shards[0].k.data(), k.seq(), 0, k.seq(), 0);
  apex::detail::write_rows(v, shards[0].v.data(), v.seq(), 0, v.seq(), 0);
  return shards;
}

/// The running result of `rows` query rows of every head, zero parts so far.
template <class C>
RunningRows<C> running_rows(const HeadsShape& q, Index d_v) {
  const HeadsShape rows{q.batch, q.heads, q.seq, 1};
  return {HeadsTensor<C>({q.batch, q.heads, q.seq, d_v}),
          HeadsTensor<C>({q.batch, q.heads, q.seq, d_v}), HeadsTensor<C>(rows),
          HeadsTensor<C>(rows),
          std::vector<apex::detail::SoftmaxStats<double>>(
              static_cast<std::size_t>(q.batch * q.heads * q.seq))};
}

/// The direction of a transfer of the ring.
enum class Transfer { kSend, kReceive };

/// One non-blocking transfer of `bytes` bytes at `data` with rank `peer` (MPI_Isend or
/// MPI_Irecv); returns MPI's error code.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (bytes, peer, tag) as MPI's
inline int post_bytes(Transfer transfer, void* data, std::int64_t bytes, int peer, int tag,
                      MPI_Comm comm, MPI_Request* request) {
  const int count = static_cast<int>(bytes);
  return transfer == Transfer::kSend ? MPI_Isend(data, count, MPI_BYTE, peer, tag, comm, request)
                                     : MPI_Irecv(data, count, MPI_BYTE, peer, tag, comm, request);
}

/// The two non-blocking transfers of a shard with rank `peer` at step s: its K (tag 2s) and its
/// V (tag 2s + 1), into requests[0] and requests[1]. Each step of the ring receives the next
/// shard from the rank before into its requests 0 and 1 and sends the held one to the rank after
/// from its requests 2 and 3.
template <class TK, class TV>
void post_shard(Transfer transfer, MPI_Comm comm, KvShard<TK, TV>& shard, int peer, int step,
                MPI_Request* requests, const char* op) {
  mpi_call(
      post_bytes(transfer, shard.k.data(), shard.key_bytes(), peer, 2 * step, comm, &requests[0]),
      op);
  mpi_call(post_bytes(transfer, shard.v.data(), shard.value_bytes(), peer, 2 * step + 1, comm,
                      &requests[1]),
           op);
}

/// The chunks of the held shard (of rank `origin`) that the queries [first_query, + q_rows) may
/// see, as key segments at their positions (at most two: a zigzag shard has two chunks).
/// Returns the number of segments and sets `keys` to their rows.
template <class TK, class TV>
Index visible_segments(const SequenceSharding& sharding, int origin, KvShard<TK, TV>& held,
                       const PositionMask& positions, Index first_query, Index q_rows,
                       std::array<apex::detail::KeySegment<TK, TV>, 2>& segments, Index& keys) {
  Index count = 0;
  Index k_row = 0;
  keys = 0;
  for (const PositionRange& kc : sharding.chunks(origin)) {
    const Index first_key = positions.key_offset + kc.begin;
    const Index k_rows = kc.end - kc.begin;
    if (classify_block(positions, first_query, first_query + q_rows, first_key,
                       first_key + k_rows) != BlockCoverage::kNone) {
      segments[static_cast<std::size_t>(count++)] = {held.keys().middle_rows(k_row, k_rows),
                                                     held.values().middle_rows(k_row, k_rows),
                                                     first_key};
      keys += k_rows;
    }
    k_row += k_rows;
  }
  return count;
}

/// This rank's query chunks against the held shard of rank `origin`: the tiled kernel on each
/// (query chunk, visible key chunks) pair, merged into the running rows; the MPI library gets a
/// chance to progress the step's transfers between chunks.
template <class C, class TQ, class TK, class TV>
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, (this rank, the shard's rank)
void attend_held_shard(const SequenceSharding& sharding, int rank, int origin,
                       const HeadsView<const TQ>& q, KvShard<TK, TV>& held,
                       const PositionMask& positions, const SdpaParams& part_params,
                       RunningRows<C>& run, std::array<MPI_Request, 4>& requests, const char* op) {
  Index q_row = 0;
  for (const PositionRange& qc : sharding.chunks(rank)) {
    const Index q_rows = qc.end - qc.begin;
    if (q_rows == 0) continue;  // the one empty chunk of S = 0
    const Index first_query = positions.key_offset + qc.begin;
    std::array<apex::detail::KeySegment<TK, TV>, 2> segments;
    Index keys = 0;
    const Index count =
        visible_segments(sharding, origin, held, positions, first_query, q_rows, segments, keys);
    if (count > 0) {
      PositionMask rule = positions;
      rule.query_offset = first_query;
      rule.key_offset = segments[0].first_position;
      auto problem =
          apex::detail::attention_problem<TQ, TK, TV>(q.middle_rows(q_row, q_rows), segments.data(),
                                                      count, keys, rule, first_query, part_params);
      apex::detail::flash_attention(
          problem,
          apex::detail::AttentionOutputs<C>{run.part_out.view().middle_rows(q_row, q_rows),
                                            {},
                                            run.part_max.view().middle_rows(q_row, q_rows),
                                            run.part_sum.view().middle_rows(q_row, q_rows)},
          apex::detail::FlashBlocking{});
      merge_part(run, q_row, q_rows);
      int done = 0;
      mpi_call(MPI_Testall(4, requests.data(), &done, MPI_STATUSES_IGNORE), op);
    }
    q_row += q_rows;
  }
}

/// The end of the ring: each row's sink joins once (-inf without sinks), and the rows go to out
/// (and lse) in their type.
template <class C, class TO>
// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, (out, lse) as sdpa's
void finish_ring_rows(const RunningRows<C>& run, const std::vector<double>& sinks,
                      const HeadsView<TO>& out, const HeadsView<TO>& lse) {
  // NOLINTEND(bugprone-easily-swappable-parameters)
  const HeadsShape s = run.out.shape();
  std::vector<double> scratch(static_cast<std::size_t>(1 + s.dim));
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) {
      const double sink = sinks.empty() ? -std::numeric_limits<double>::infinity()
                                        : sinks[static_cast<std::size_t>(h)];
      for (Index i = 0; i < s.seq; ++i) {
        const auto part_at = [&](Index) {
          return apex::detail::PartRow<C, double>{
              run.out.head(b, h).row(i).data(),
              run.stats[static_cast<std::size_t>((b * s.heads + h) * s.seq + i)]};
        };
        const auto total =
            apex::detail::merge_rows<double>(1, s.dim, part_at, out.head(b, h).row(i).data(),
                                             scratch.data(), scratch.data() + 1, sink);
        if (!lse.empty())
          lse.head(b, h)(i, 0) = apex::round_to<TO>(apex::detail::log_sum_exp(total));
      }
    }
  }
}

}  // namespace detail

/// Ring attention (collective): the attention of one sequence of S positions, sharded over the
/// ranks of `comm` by `sharding`, each rank computing the rows of its own queries:
///   out_r = sdpa(Q, K, V, {positions}, params) restricted to rank r's rows,
/// with the rule `positions` on the whole sequence (query and key row i at position
/// key_offset + i: self-attention, so query_offset must be unset or equal to key_offset;
/// causal, window, chunk, prefix and document ids as for sdpa, the ids covering every position
/// [0, key_offset + S)), SdpaParams as for sdpa (scale, soft-cap, sinks, ALiBi, bf16 products).
///   q: [B, H_q, S_r, d_qk], k: [B, H_kv, S_r, d_qk], v: [B, H_kv, S_r, d_v] on rank r, S_r =
///   sharding.local_length(r), rows in the order of sharding.chunks(r)
///   -> out: [B, H_q, S_r, d_v], lse (optional): [B, H_q, S_r, 1].
/// K and V may be of any K/V format (kv_format.hpp), as sdpa reads them: a storage type, or the
/// blocks of a quantized format (kv_quant.hpp), whose views count blocks (row_values gives d);
/// the shards travel around the ring as stored, and the result is the float kernel's over the
/// decoded values.
/// Every rank must pass the same sharding (with P = the size of comm), B, heads, widths, storage
/// types, rule and parameters, and the same choice of lse; any rank's bad input throws
/// std::invalid_argument on every rank (the agreement of communicator.hpp) before a byte of
/// K/V moves or an output is written. Outputs may overlap the inputs (they are written last).
///
/// Accuracy: each part is the tiled kernel's (as sdpa's, in float for float and 16-bit inputs),
/// and the running result is kept in that type with its statistics in double, so each of the
/// at most 2P merges rounds once more: out is within the fast-path tolerance of the double
/// reference. A row with no allowed key is zeros (lse -inf, or the sink); NaN as sdpa. The
/// result does not depend on the number of threads.
///
/// Traffic: the K/V shards (BYTES above) with non-blocking sends and receives, posted before
/// each step's attention and completed after it (how much of a transfer overlaps depends on the
/// MPI library's progress); one MPI_Allgather of a few integers (the agreement). Returns the
/// bytes and messages sent. Memory: two K/V shard buffers of the largest shard; the running and
/// part results, 2·B·H_q·S_r·(d_v + 1) values of the compute type and the running statistics,
/// 2·B·H_q·S_r doubles; the kernel's scratch as for sdpa.
template <class Q, class K, class V, class TO>
Traffic ring_attention(MPI_Comm comm, const SequenceSharding& sharding, const HeadsView<Q>& q,
                       const HeadsView<K>& k, const HeadsView<V>& v, const PositionMask& positions,
                       const SdpaParams& params, const HeadsView<TO>& out,
                       const HeadsView<TO>& lse = {}) {
  using TQ = std::remove_const_t<Q>;
  using TK = std::remove_const_t<K>;
  using TV = std::remove_const_t<V>;
  using C = apex::detail::attention_compute_t<TQ, TK, TV, TO>;  // its running rows' type
  constexpr const char* op = "ring_attention";
  const RankInfo me = detail::rank_info(comm, op);
  const HeadsView<const TQ> cq(q);
  const HeadsView<const TK> ck(k);
  const HeadsView<const TV> cv(v);
  detail::agree(comm, me, op,
                detail::ring_agreement<TQ, TK, TV, TO>(
                    sharding, q.shape(), k.shape(), row_values(v), !lse.empty(), positions, params),
                [&] {
                  detail::check_ring_inputs(me, sharding, cq, ck, cv, positions, params, out, lse,
                                            op);
                });

  const int p = me.size;
  const RingPlan plan = ring_plan(sharding, positions);
  std::array<detail::KvShard<TK, TV>, 2> shards = detail::ring_shards(sharding, ck, cv);
  detail::RunningRows<C> run = detail::running_rows<C>(
      {q.batch(), q.heads(), sharding.local_length(me.rank), 1}, row_values(v));
  SdpaParams part_params = params;
  part_params.sinks.clear();  // the sink joins once, at the end

  Traffic traffic;
  const auto origin_at = [&](int step) { return ((me.rank - step) % p + p) % p; };
  const auto hops_of = [&](int origin) { return plan.hops[static_cast<std::size_t>(origin)]; };
  bool have = true;  // whether this rank holds shard origin_at(s) at step s
  for (int s = 0; s < plan.steps; ++s) {
    detail::KvShard<TK, TV>& held = shards[static_cast<std::size_t>(s % 2)];
    detail::KvShard<TK, TV>& next = shards[static_cast<std::size_t>((s + 1) % 2)];
    std::array<MPI_Request, 4> requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                                        MPI_REQUEST_NULL};
    const int next_origin = origin_at(s + 1);
    const bool receive = s + 1 < plan.steps && s + 1 <= hops_of(next_origin);
    if (receive) {
      next.hold(sharding.local_length(next_origin));
      detail::post_shard(detail::Transfer::kReceive, comm, next, (me.rank - 1 + p) % p, s,
                         &requests[0], op);
    }
    const int origin = origin_at(s);
    if (have && s < hops_of(origin)) {
      detail::post_shard(detail::Transfer::kSend, comm, held, (me.rank + 1) % p, s, &requests[2],
                         op);
      traffic.bytes_sent += held.key_bytes() + held.value_bytes();
      traffic.messages += 2;
    }
    if (have) {
      detail::attend_held_shard(sharding, me.rank, origin, cq, held, positions, part_params, run,
                                requests, op);
    }
    detail::mpi_call(MPI_Waitall(4, requests.data(), MPI_STATUSES_IGNORE), op);
    have = receive;
  }
  detail::finish_ring_rows(run, params.sinks, out, lse);
  return traffic;
}

}  // namespace apex::distributed
