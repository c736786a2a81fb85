// SPDX-License-Identifier: MIT
// The plan of a call of the tiled kernel (flash_attention.hpp): the problem it is given, how it
// is cut into tasks, the block sizes, and the type it computes in. Everything here depends on the
// shapes and the blocking alone, never on the number of threads.
//
// COMPUTE TYPE (attention_compute_t, fits_float). A call computes in double when any input is
// double. Otherwise it computes in float, unless a parameter does not fit float (fits_float: the
// scale, the soft-cap, a sink, the largest ALiBi term), or unless the float pass meets a score,
// or produces an output, that is not finite (a finite q·k can overflow float: q = k = 1e20);
// then the whole job is computed again in double, so that a finite input always gets the finite
// answer of the double reference. (Inputs that hold NaN or infinities therefore cost two
// passes.) Ring attention (distributed/ring_attention.hpp) keeps its running rows in the type
// attention_compute_t gives for its inputs and outputs.
//
// TASKS (plan_attention, job_tasks). A call is a list of jobs, one problem each (an sdpa call,
// or one sequence of a ragged batch, with its own positions, rule and keys). prefill: one task
// per (b, kv head, query block of Bq = stacked_rows / G rows), its visible keys in blocks.
// decode (split keys, flash-decoding: Dao et al. 2023): when every query of a job fits in one
// block and the job has few (b, kv head) pairs, its visible keys are cut into chunks, each
// (b, kv head, chunk) task writes a partial result (out_c, m_c, l_c) without the sink, and a
// merge task per pair combines them in chunk order and adds the sink. The chunks are few enough
// that one job's partials are bounded whatever S_k. A job's plan depends on its own shapes
// alone, so a sequence of a batch gets the bits of the same sequence in a call of its own.
//
// BLOCK SIZES (FlashBlocking), each the fastest of those measured (docs/performance.md, "How
// the block sizes were chosen"):
//   - M = G·Bq ≈ 256 stacked rows and Bk = 64: larger key blocks waste work on the diagonal and
//     at window edges, fewer rows leave the products short.
//   - amx_key_block = 256 on AMX tiles: the tiles' products are short next to the softmax's
//     work, and P·V takes 8 steps of 32 keys per load and store of its accumulator tiles.
//   - stream_rows = 8: up to 8 stacked rows the streaming path is bound by reading K and V and
//     well ahead of the GEMM path; from 16 rows both are compute-bound.
//   - stream_key_block = decode_chunk = 512: fewer fixed costs per block than smaller blocks.
// Split-key decoding keeps the partial results of every chunk in partial_budget = 2^19 scalars
// (2 MiB of float) whatever S_k.
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/config.hpp>
#include <apex/cpu.hpp>
#include <apex/detail/kv_read.hpp>
#include <apex/mask.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

// NOLINTBEGIN(bugprone-easily-swappable-parameters): internal, each with a caller or two
namespace apex::detail {

/// Block sizes and the decode split of the tiled kernel (see BLOCK SIZES above). The defaults are
/// what apex::sdpa uses; tests pass small ones to put block boundaries where they want them.
struct FlashBlocking {
  Index stacked_rows = 256;      ///< target M = G·Bq; Bq = max(1, stacked_rows / G)
  Index key_block = 64;          ///< Bk of the GEMM path
  Index amx_key_block = 256;     ///< Bk of the GEMM path with bfloat16 products on AMX tiles
  Index stream_rows = 8;         ///< M at or below which the streaming path is used instead
  Index stream_key_block = 512;  ///< Bk of the streaming path
  Index decode_chunk = 512;      ///< fewest keys per partial result when decoding
  Index split_below = 16;        ///< split keys only when B·H_kv is below this
  Index partial_budget = Index{1} << 19;  ///< most scalars of decode partials of one call
};

/// Everything a task needs, resolved once per call. Keys are the segments in order; key j of
/// the whole problem (a column of the dense masks) is row j − (keys before its segment) of its
/// segment. R is the type of the user's AttentionRules (attention_rules.hpp), NoRules for none.
template <class TQ, class TK, class TV, class TB, class R = NoRules>
struct AttentionProblem {
  using Query = TQ;
  using Key = TK;
  using Value = TV;
  using Bias = TB;
  using Rules = R;
  const R* rules = nullptr;  // the user's rules; null only when R is NoRules
  HeadsView<const TQ> q;
  const KeySegment<TK, TV>* segments = nullptr;
  Index num_segments = 0;
  PositionMask positions;         // the rule, on absolute positions
  Index first_query = 0;          // absolute position of query row 0
  HeadsView<const bool> allowed;  // empty: no dense mask
  HeadsView<const TB> bias;       // empty: no bias
  double scale = 1.0;
  double softcap = 0.0;                  // 0: off
  const double* sinks = nullptr;         // [H_q] extra logits of zero value; null: none
  const double* alibi_slopes = nullptr;  // [H_q] score += slope·(kp − qp); null: none
  bool bf16_products = false;            // SdpaParams::allow_bf16_products
  Index group = 1;                       // G = H_q / H_kv
  Index s_q = 0, s_k = 0, d_qk = 0, d_v = 0;
};

/// What the kernel writes: out [B, H_q, S_q, d_v] and, where not empty, [B, H_q, S_q, 1] views
/// of lse = m + log l and of the statistics m and l themselves.
template <class TO>
struct AttentionOutputs {
  HeadsView<TO> out, lse, max, sum;
};

/// A block length in [1, max(1, limit)].
inline Index clamp_block(Index block, Index limit) {
  return std::max<Index>(1, std::min(block, limit));
}

/// The sink of query head h in C: an extra logit of every row of the head, or -inf (none).
template <class C, class P>
C sink_of(const P& p, Index h) {
  return p.sinks != nullptr ? static_cast<C>(p.sinks[h]) : -std::numeric_limits<C>::infinity();
}

/// The (b, kv head, block) of task `task` of a list that gives each (b, kv head) pair `blocks`
/// consecutive tasks, its blocks taken in the order 0, n−1, 1, n−2, … so that OpenMP's static
/// schedule gives every thread a similar share of a causal triangle.
struct PairBlock {
  Index b = 0;
  Index kv_head = 0;
  Index block = 0;
};
inline PairBlock pair_block(Index task, Index blocks, Index kv_heads) {
  const Index pair = task / blocks;
  const Index k = task - pair * blocks;
  const Index b = pair / kv_heads;
  return {b, pair - b * kv_heads, k % 2 == 0 ? k / 2 : blocks - 1 - k / 2};
}

/// How a call is cut into tasks, from the shapes and the blocking alone (never the thread count).
struct AttentionPlan {
  Index query_block = 1;   ///< Bq
  Index query_blocks = 0;  ///< ⌈S_q / Bq⌉
  bool split = false;      ///< split-key decoding
  Index chunk = 0;         ///< keys per chunk when split
  Index chunks = 0;        ///< chunks per (b, kv head) when split
  Index first_key = 0;     ///< problem index of the first key of chunk 0 when split
};

/// The keys of queries [q0, q0 + bq) of a problem: visible_keys of their absolute positions.
template <class P>
PositionRange visible_keys_of(const P& p, Index q0, Index bq) {
  return visible_keys(p.positions, p.first_query + q0, p.first_query + q0 + bq);
}

/// The problem indices [begin, end) that hold every key in `visible` (a hull: the segments may
/// hold keys between them that are not visible; begin = end when none is).
template <class P>
std::pair<Index, Index> key_hull(const P& p, const PositionRange& visible) {
  Index first = 0;
  Index begin = p.s_k;
  Index end = 0;
  for (Index s = 0; s < p.num_segments; ++s) {
    const auto [lo, hi] = rows_in(p.segments[s], visible);
    if (lo < hi) {
      begin = std::min(begin, first + lo);
      end = std::max(end, first + hi);
    }
    first += p.segments[s].size();
  }
  return {begin, std::max(begin, end)};
}

/// The key block of a tile, for the path it takes: amx_key_block where the GEMM path's products
/// run on AMX tiles (bfloat16 products permitted on KernelIsa::kAmx).
template <class P>
Index key_block_for(const P& p, bool streaming, const FlashBlocking& blocking, Index keys) {
  const bool tiles = !streaming && p.bf16_products && kernel_isa() == KernelIsa::kAmx;
  const Index block = streaming ? blocking.stream_key_block
                      : tiles   ? blocking.amx_key_block
                                : blocking.key_block;
  return clamp_block(block, keys);
}

/// Query blocks of Bq = stacked_rows / G rows. Keys are split when every query fits in one
/// block (a few new tokens against a long cache), the (b, kv head) pairs are fewer than
/// split_below (so that the threads would otherwise idle), and the partial results of at least
/// two chunks per pair fit in partial_budget scalars: B·H_kv·chunks·M·(d_v + 2) <= budget, M =
/// G·S_q. The chunks are as many as fit (each at least decode_chunk keys, a whole number of key
/// blocks), so the partials are bounded whatever S_k, and a call with many query rows, whose
/// tasks are compute-bound anyway, is not split. Only the keys the queries may see are cut
/// (key_hull of visible_keys): a window over a long cache splits its window, not the cache.
template <class P>
AttentionPlan plan_attention(const P& p, Index kv_heads, const FlashBlocking& blocking) {
  AttentionPlan plan;
  plan.query_block = std::min(std::max<Index>(1, blocking.stacked_rows / p.group), p.s_q);
  plan.query_blocks = (p.s_q + plan.query_block - 1) / plan.query_block;
  const Index pairs = p.q.batch() * kv_heads;
  const Index shortest = std::max<Index>(1, blocking.decode_chunk);
  if (plan.query_blocks != 1 || pairs >= blocking.split_below) return plan;
  const auto [first, end] = key_hull(p, visible_keys_of(p, 0, p.s_q));
  const Index keys = end - first;
  if (keys < 2 * shortest) return plan;
  const Index record = p.group * p.s_q * (p.d_v + 2);  // scalars of one chunk's partial result
  const Index fit = blocking.partial_budget / std::max<Index>(1, pairs * record);
  const Index wanted = std::min(fit, keys / shortest);  // chunks per pair
  if (wanted < 2) return plan;
  const bool streaming = p.group * p.s_q <= blocking.stream_rows;
  const Index block = key_block_for(p, streaming, blocking, keys);
  plan.chunk = (keys + wanted - 1) / wanted;
  if (plan.chunk > block) plan.chunk = (plan.chunk + block - 1) / block * block;
  plan.chunks = (keys + plan.chunk - 1) / plan.chunk;
  plan.first_key = first;
  plan.split = plan.chunks >= 2;
  return plan;
}

/// One problem of a call of the kernel and where its results go. A call is a list of jobs (one
/// for sdpa, one per sequence of a ragged batch) whose tasks run side by side.
template <class P, class TO>
struct AttentionJob {
  const P* problem = nullptr;
  AttentionOutputs<TO> outputs;
};

/// A job's share of one wave of tasks: its plan, and where its tasks, its merges (split only)
/// and its partial results (split only) lie in the wave's lists.
struct JobTasks {
  AttentionPlan plan;
  Index kv_heads = 0;
  Index pairs = 0;          ///< (b, kv head) pairs
  Index rows = 0;           ///< stacked rows of a split task, G·S_q
  Index first_task = 0;     ///< the wave's tasks [first_task, first_task + tasks) are the job's
  Index tasks = 0;          ///< pairs · query blocks, or pairs · chunks when split
  Index first_merge = 0;    ///< the wave's merges [first_merge, first_merge + pairs) (split)
  Index first_partial = 0;  ///< offset of the job's partial results in the wave's (split)
  Index partials = 0;       ///< scalars of them: pairs · chunks · rows · (d_v + 2)
};

/// The plan of a job and the size of its task lists (first_* are set by the wave).
template <class P>
JobTasks job_tasks(const P& p, const FlashBlocking& blocking) {
  JobTasks t;
  t.kv_heads = p.segments[0].k.heads();
  t.plan = plan_attention(p, t.kv_heads, blocking);
  t.pairs = p.q.batch() * t.kv_heads;
  t.rows = p.group * p.s_q;
  t.tasks = t.pairs * (t.plan.split ? t.plan.chunks : t.plan.query_blocks);
  t.partials = t.plan.split ? t.pairs * t.plan.chunks * t.rows * (p.d_v + 2) : 0;
  return t;
}

/// Whether a float pass can hold the call's parameters: the scale, the soft-cap and the sinks
/// are floats (representable_in), and ALiBi's largest term, the largest |slope| times the
/// largest distance between a query and a key, does not overflow float.
template <class P>
bool fits_float(const P& p) {
  if (!representable_in<float>(p.scale) || !representable_in<float>(p.softcap)) return false;
  double slope = 0.0;
  for (Index h = 0; h < p.q.heads(); ++h) {
    if (p.sinks != nullptr && !representable_in<float>(p.sinks[h])) return false;
    if (p.alibi_slopes != nullptr) {
      if (!representable_in<float>(p.alibi_slopes[h])) return false;
      slope = std::max(slope, std::abs(p.alibi_slopes[h]));
    }
  }
  if (slope == 0.0) return true;
  const double q_first = static_cast<double>(p.first_query);
  const double q_last = q_first + static_cast<double>(p.s_q - 1);
  double distance = 0.0;
  for (Index s = 0; s < p.num_segments; ++s) {
    const double k_first = static_cast<double>(p.segments[s].first_position);
    const double k_last = k_first + static_cast<double>(p.segments[s].size() - 1);
    distance = std::max({distance, std::abs(q_last - k_first), std::abs(k_last - q_first)});
  }
  return slope * distance <= static_cast<double>(std::numeric_limits<float>::max());
}

/// Whether a problem has any row to compute.
template <class P>
bool has_rows(const P& p) {
  return p.q.batch() > 0 && p.q.heads() > 0 && p.s_q > 0;
}

/// The type a call computes in first (see COMPUTE TYPE): double when any of the types is double,
/// else float (which a job leaves for double where fits_float says no or a float pass meets a
/// number float cannot carry).
template <class... T>
using attention_compute_t = std::conditional_t<(std::is_same_v<T, double> || ...), double, float>;

/// Whether a problem's inputs hold doubles, so that it computes in double from the start.
template <class P>
inline constexpr bool kWideInput = std::is_same_v<
    attention_compute_t<typename P::Query, typename P::Key, typename P::Value, typename P::Bias>,
    double>;

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
