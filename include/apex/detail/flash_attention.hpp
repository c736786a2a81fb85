// SPDX-License-Identifier: MIT
// Tiled scaled dot-product attention with an online softmax: the fast path behind apex::sdpa,
// its ragged, paged and cached forms, and ring attention. apex::reference::sdpa
// (reference_attention.hpp) is the plain version it is tested against.
//
// WHAT IT COMPUTES (§6.2, grouped heads §8.2, masks §10–§11): for every query row i (position
// qp) of query head h, with s_ij the logit of key j (the score terms of score_terms.hpp applied
// to scale·q_i·k_j; forbidden → -inf) and the head's sink (-inf without one),
//   out[i] = Σ_j e^(s_ij) v_j / (e^(sink_h) + Σ_j e^(s_ij))
//   lse[i] = log(e^(sink_h) + Σ_j e^(s_ij))                            (keys that take part)
// without ever holding an S_q × S_k score matrix (FlashAttention: Dao et al. 2022, Algorithm 1),
// and with apex::sdpa's policy on non-finite input (sdpa.hpp). The keys may come in several
// segments of consecutive positions (a sliding-window cache's ring is two, plus the new chunk):
// one pass over them all, no merge.
//
// THE PARTS, each a header of its own:
//   kv_read.hpp         every read of K and V: key segments (contiguous or paged), the block
//                       copy of the GEMM path, the row reader and products of the streaming path
//   score_terms.hpp     soft-cap, ALiBi, bias, position rule, dense mask, user rules: the pieces
//                       that turn a block's raw scores into logits
//   attention_plan.hpp  the problem, the block sizes, the cut into tasks, the compute type
//   attention_tile.hpp  one task's stacked query rows: score, mask, softmax, accumulate
//   this header         the tasks over those parts and the waves that run them
//
// VISIBLE KEYS. A query block visits only the keys its positions may see (visible_keys: up to
// the block's last query when causal, from its window's, chunk's or document's first key, and
// the prefix for prefix queries); the others are never read. Causal attention thus costs about
// half of full attention, a sliding window about S·(W + Bq + Bk), chunks of C about
// S·(C + Bq + Bk)/2, documents the sum of their causal triangles plus a block's edge each.
//
// WAVES. Every task of every job runs in one parallel loop, so that a batch of short and long
// sequences keeps every thread busy; the jobs run in waves whose split-decode partials fit
// partial_budget together, and a wave's merges run after its tasks.
//
// THREADS AND DETERMINISM. Tasks run through detail::parallel_for. What a task computes depends
// only on the shapes (the block sizes, the split and the choice of path are fixed, the key
// blocks and the merge run in a fixed order, Eigen's kernels are called serially), so the output
// is bit-identical for any number of threads. Within one (b, kv head) the prefill tasks take
// query blocks in the order 0, n−1, 1, n−2, … so that OpenMP's static schedule gives every
// thread a similar share of a causal triangle.
//
// MEMORY: each task's scratch (attention_tile.hpp, MEMORY); split-key decoding also keeps, on
// the calling thread, the partial results of every chunk in partial_budget = 2^19 scalars
// (2 MiB of float) whatever S_k, and each merging thread ⌊S_k / decode_chunk⌋ + d_v scalars.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/attention_plan.hpp>
#include <apex/detail/attention_tile.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/detail/scratch.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <type_traits>

// Not part of the public API: the BLAS-style lists of the schedulers; internal, each with one or
// two callers in this file.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
namespace apex::detail {

/// Writes a finished row's lse, max and sum where those outputs exist.
template <class C, class TO>
void write_row_stats(const AttentionOutputs<TO>& o, Index b, Index h, Index i,
                     const SoftmaxStats<C>& stats) {
  if (!o.lse.empty()) o.lse.head(b, h)(i, 0) = round_to<TO>(log_sum_exp(stats));
  if (!o.max.empty()) o.max.head(b, h)(i, 0) = round_to<TO>(stats.max);
  if (!o.sum.empty()) o.sum.head(b, h)(i, 0) = round_to<TO>(stats.sum);
}

/// Prefill task `task` of a job: (b, kv head, query block), the block's visible keys in
/// blocks; writes its rows. Within one (b, kv head) the query blocks are taken in the order 0,
/// n−1, 1, n−2, … (see THREADS). Returns tile_finite.
template <class C, class P, class TO>
bool prefill_task(const P& p, const JobTasks& t, const AttentionOutputs<TO>& o, Index task,
                  const FlashBlocking& blocking) {
  const PairBlock where = pair_block(task, t.plan.query_blocks, t.kv_heads);
  const Index b = where.b, kv_head = where.kv_head, block = where.block;
  const Index q0 = block * t.plan.query_block;
  const Index bq = std::min(t.plan.query_block, p.s_q - q0);
  const bool streaming = p.group * bq <= blocking.stream_rows;
  const Index key_block = key_block_for(p, streaming, blocking, p.s_k);
  AttentionTile<C, P> tile(p, b, kv_head, q0, bq, key_block, streaming, blocking);
  for_each_key_block(p, 0, p.s_k, visible_keys_of(p, q0, bq), key_block,
                     [&](const auto& keys) { tile.add_keys(keys); });
  for (Index r = 0; r < tile.rows(); ++r) {
    const Index h = tile.head_of(r);
    const Index i = tile.query_of(r);
    write_row_stats<C>(o, b, h, i, tile.finish_row(r, o.out.head(b, h).row(i).data(), true));
  }
  return tile_finite<C>(tile);
}

/// Split-decode task `task` of a job: (b, kv head, key chunk); writes the partial result of
/// its keys for the job's stacked rows, a record of d_v + 2 scalars each (normalised output, m,
/// l, without the sink), to `partials` (the job's). Returns tile_finite.
template <class C, class P>
bool chunk_task(const P& p, const JobTasks& t, Index task, C* partials,
                const FlashBlocking& blocking) {
  const Index pair = task / t.plan.chunks;
  const Index c = task - pair * t.plan.chunks;
  const Index b = pair / t.kv_heads;
  const bool streaming = t.rows <= blocking.stream_rows;
  const Index key_block = key_block_for(p, streaming, blocking, t.plan.chunk);
  AttentionTile<C, P> tile(p, b, pair - b * t.kv_heads, 0, p.s_q, key_block, streaming, blocking);
  const Index begin = t.plan.first_key + c * t.plan.chunk;
  for_each_key_block(p, begin, std::min(p.s_k, begin + t.plan.chunk), visible_keys_of(p, 0, p.s_q),
                     key_block, [&](const auto& keys) { tile.add_keys(keys); });
  const Index record = p.d_v + 2;
  C* partial = partials + task * t.rows * record;
  for (Index r = 0; r < t.rows; ++r) {
    const SoftmaxStats<C> stats = tile.finish_row(r, partial + r * record, false);
    partial[r * record + p.d_v] = stats.max;
    partial[r * record + p.d_v + 1] = stats.sum;
  }
  return tile_finite<C>(tile);
}

/// Merge task `pair` of a split job: merges the chunks of (b, kv head) in order and adds the
/// sink (merge_rows), writing the rows. Returns whether every merged row is finite (float).
template <class C, class P, class TO>
bool merge_task(const P& p, const JobTasks& t, const AttentionOutputs<TO>& o, Index pair,
                const C* partials, const FlashBlocking& blocking) {
  const Index chunks = t.plan.chunks;
  const Index b = pair / t.kv_heads;
  const Index kv_head = pair - b * t.kv_heads;
  const Index record = p.d_v + 2;
  const C* first = partials + pair * chunks * t.rows * record;
  // Asked for at ⌊S_k / decode_chunk⌋ >= chunks (plan_attention), which grows with S_k alone.
  const Index most_chunks = p.s_k / std::max<Index>(1, blocking.decode_chunk);
  C* weights = ThreadScratch::local().get<C>(ScratchSlot::kMergeWeights, most_chunks + p.d_v);
  bool ok = true;
  for (Index r = 0; r < t.rows; ++r) {
    const auto part_at = [&](Index c) {
      const C* rec = first + (c * t.rows + r) * record;
      return PartRow<C, C>{rec, {rec[p.d_v], rec[p.d_v + 1]}};
    };
    const Index h = kv_head * p.group + r / p.s_q;
    const Index i = r % p.s_q;
    TO* out = o.out.head(b, h).row(i).data();
    const SoftmaxStats<C> stats =
        merge_rows<C>(chunks, p.d_v, part_at, out, weights, weights + chunks, sink_of<C>(p, h));
    write_row_stats<C>(o, b, h, i, stats);
    // A merge can overflow (Σ_c w_c·o_c with w_c up to a chunk's length) where no part did: the
    // sum, left in C by merge_rows, is checked (an output type may overflow where C did not,
    // which no second pass would change).
    if (std::is_same_v<C, float>) {
      ok = ok && finite_stats(stats) &&
           (!(stats.sum > C(0)) || all_finite(weights + chunks, 1, p.d_v, p.d_v));
    }
  }
  return ok;
}

/// The job whose range [first(t), first(t) + size(t)) of a wave's list holds `item`: the last
/// job that starts at or before it (jobs with an empty range are passed over).
template <class First>
Index job_holding(const JobTasks* t, Index count, Index item, First&& first) {
  const JobTasks* next = std::upper_bound(
      t, t + count, item, [&](Index i, const JobTasks& job) { return i < first(job); });
  return static_cast<Index>(next - t) - 1;
}

/// One wave: every task of `count` jobs in one parallel loop (prefill and split-decode tasks
/// side by side), then every merge of the split ones; the split jobs' partial results, sized in
/// t[*].partials, on the calling thread's scratch. Clears finite[j] where job j met a
/// non-finite number (see COMPUTE TYPE).
template <class C, class P, class TO>
void run_wave(const AttentionJob<P, TO>* jobs, JobTasks* t, Index count, bool* finite,
              const FlashBlocking& blocking) {
  Index tasks = 0, merges = 0, partials = 0;
  for (Index j = 0; j < count; ++j) {
    t[j].first_task = tasks;
    t[j].first_merge = merges;
    t[j].first_partial = partials;
    tasks += t[j].tasks;
    merges += t[j].plan.split ? t[j].pairs : 0;
    partials += t[j].partials;
  }
  // Sizes that do not depend on the call's shapes (scratch.hpp, ALLOCATION): the whole budget
  // once any job splits, whole pages of flags.
  ThreadScratch& scratch = ThreadScratch::local();
  C* partial = scratch.get<C>(ScratchSlot::kDecodePartials,
                              partials > 0 ? std::max(partials, blocking.partial_budget) : 0);
  auto* ok = scratch.get<unsigned char>(ScratchSlot::kTaskFlags,
                                        ThreadScratch::whole_pages(tasks + merges));
  parallel_for(tasks, [&](Index task) {
    const Index j = job_holding(t, count, task, [](const JobTasks& x) { return x.first_task; });
    const P& p = *jobs[j].problem;
    const Index local = task - t[j].first_task;
    ok[task] = t[j].plan.split
                   ? chunk_task<C>(p, t[j], local, partial + t[j].first_partial, blocking)
                   : prefill_task<C>(p, t[j], jobs[j].outputs, local, blocking);
  });
  parallel_for(merges, [&](Index merge) {
    const Index j = job_holding(t, count, merge, [](const JobTasks& x) { return x.first_merge; });
    ok[tasks + merge] =
        merge_task<C>(*jobs[j].problem, t[j], jobs[j].outputs, merge - t[j].first_merge,
                      partial + t[j].first_partial, blocking);
  });
  for (Index j = 0; j < count; ++j) {
    const unsigned char* job_ok = ok + t[j].first_task;
    bool all = std::all_of(job_ok, job_ok + t[j].tasks, [](unsigned char x) { return x != 0; });
    if (t[j].plan.split) {
      const unsigned char* merged = ok + tasks + t[j].first_merge;
      all = all && std::all_of(merged, merged + t[j].pairs, [](unsigned char x) { return x != 0; });
    }
    finite[j] = finite[j] && all;
  }
}

/// One pass of the kernel in the compute type C over the jobs whose `run` flag is set (t[j] is
/// made here; a job not run gets no tasks): their tasks in waves of consecutive jobs whose
/// split-decode partials fit partial_budget together (a job alone always does: plan_attention),
/// so that the memory held stays bounded whatever the number of jobs. finite[j] is cleared
/// where job j must be redone in double.
template <class C, class P, class TO>
void attend_jobs(const AttentionJob<P, TO>* jobs, Index count, const bool* run, JobTasks* t,
                 bool* finite, const FlashBlocking& blocking) {
  for (Index j = 0; j < count; ++j)
    t[j] = run[j] ? job_tasks(*jobs[j].problem, blocking) : JobTasks{};
  for (Index begin = 0; begin < count;) {
    Index end = begin + 1;
    Index held = t[begin].partials;
    while (end < count && held + t[end].partials <= blocking.partial_budget) {
      held += t[end++].partials;
    }
    run_wave<C>(jobs + begin, t + begin, end - begin, finite + begin, blocking);
    begin = end;
  }
}

/// Runs the kernel on `count` jobs whose every precondition holds (the entry points check
/// them): each problem has at least one segment, all of one [B, H_kv] shape, and its outputs
/// are as AttentionOutputs says, overlapping no input and no other job's outputs. Picks each
/// job's compute type (see COMPUTE TYPE above): the jobs that fit float run in one float pass,
/// and those that do not, or that meet a number float cannot carry, in one double pass after
/// it. What a job computes does not depend on the other jobs. Memory: besides the tasks'
/// scratch, a JobTasks record and two flags per job on the calling thread's scratch (none for
/// one job).
template <class P, class TO>
void flash_attention(const AttentionJob<P, TO>* jobs, Index count, const FlashBlocking& blocking) {
  constexpr bool wide_input = kWideInput<P>;
  JobTasks one_job;
  bool one_job_flags[2];
  ThreadScratch& scratch = ThreadScratch::local();
  JobTasks* t = count == 1 ? &one_job : scratch.get<JobTasks>(ScratchSlot::kJobTasks, count);
  bool* run = count == 1 ? one_job_flags : scratch.get<bool>(ScratchSlot::kJobFlags, 2 * count);
  bool* finite = run + count;
  bool redo = false;
  for (Index j = 0; j < count; ++j) {
    run[j] = !wide_input && has_rows(*jobs[j].problem) && fits_float(*jobs[j].problem);
    finite[j] = true;
  }
  if constexpr (!wide_input) attend_jobs<float>(jobs, count, run, t, finite, blocking);
  for (Index j = 0; j < count; ++j) {
    run[j] = has_rows(*jobs[j].problem) && (!run[j] || !finite[j]);
    redo = redo || run[j];
  }
  if (redo) attend_jobs<double>(jobs, count, run, t, finite, blocking);
}

/// flash_attention of one problem.
template <class P, class TO>
void flash_attention(const P& p, const AttentionOutputs<TO>& o, const FlashBlocking& blocking) {
  const AttentionJob<P, TO> job{&p, o};
  flash_attention(&job, 1, blocking);
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)

// The common instances, declared extern where they are compiled once (precompiled_kernels.hpp).
#include <apex/detail/kernel_instances.hpp>
