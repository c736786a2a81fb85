// SPDX-License-Identifier: MIT
// Cascade attention over a paged cache (shared-prefix attention, as FlashInfer's cascade
// kernels): sdpa_cascade computes what sdpa_paged computes, but where sequences share pages (a
// system prompt, few-shot examples, beams or parallel samples forked from one prompt), the
// queries of all of them attend to those pages in one pass, stacked as the rows of one problem
// (per K/V head: G query heads × every sharing sequence's rows), so a shared page is read once per
// call, not once per sequence. Each sequence then attends to the rest of its keys alone, and its
// parts c (disjoint key sets, each computed without the sink) are merged exactly in double from
// their softmax statistics (merge_rows, detail/online_softmax.hpp):
//   M = max_c m_c,  w_c = l_c·e^(m_c − M),  out = Σ_c w_c·o_c / (e^(sink − M) + Σ_c w_c)
//
// THE PLAN (detail::plan_cascade). Sharing is read from the block tables themselves, at every
// level, as a prefix tree of page ids: a run of pages held by many sequences is one pass; where
// some of them go on sharing (a sub-prefix: beams forked from a forked prompt), their next run is
// another pass; a sequence's keys after its last shared run are its own. A sequence takes part in
// shared passes only over whole pages whose every key all of its queries see under its rule
// (classify_block says kAll: causal queries after the prefix, not a window that ends inside it);
// otherwise its keys are all its own, computed as sdpa_paged computes them.
//
// ALIBI. The stacked rows of a pass sit at the positions of its first sequence's queries, one
// after another, so ALiBi's term slope·(kp − qp) of a row differs from its sequence's own by a
// constant of the row, slope·shift (PartOfRows). A constant added to every score of a row moves
// its maximum alone: the merge takes m + slope·shift for that part, in double, and the result is
// that of the row's own positions.
//
// ACCURACY. A sequence in no shared pass gets sdpa_paged's result bit for bit. A sequence with
// shared passes gets the same mathematical result, its parts rounded to the output type before the
// merge: not bit-identical to sdpa_paged, and within the tolerance the kernel is held to against
// the plain double loops (tests/paged_cache_test.cpp checks it there). Bit-identical for any
// number of threads (the plan depends on the inputs alone; each pass and the merges run in a fixed
// order).
//
// MEMORY. Allocates the plan; for each shared pass a copy of its rows of q and its partial
// result, H_q·rows·(d_qk + d_v + 2) scalars; for each sequence with shared passes the partial
// result of its own keys, H_q·S_q·(d_v + 2) scalars; n + d_v doubles per merge; scratch as for
// sdpa_varlen. In all at most (levels + 1)·H_q·total_q·(d_qk + d_v + 2) scalars, levels being the
// most shared passes of one sequence.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/online_softmax.hpp>
#include <apex/kv_format.hpp>
#include <apex/mask.hpp>
#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// One pass of a cascade: the keys [first_key, first_key + keys) of each member (counted from
/// the member's first held key; whole pages that every member's block table holds alike), read
/// once for the queries of all the members.
struct SharedPass {
  Index first_key = 0;         ///< first key of the pass in each member (a page boundary)
  Index keys = 0;              ///< keys of the pass (whole pages)
  std::vector<Index> members;  ///< the sequences (indices into the call's ids), >= 2, ascending
};

/// How sdpa_cascade splits a call: the shared passes, parents before children (so a sequence's
/// passes come in the order of its keys), and where each sequence's own keys begin.
struct CascadePlan {
  std::vector<SharedPass> shared;    ///< the passes over shared pages, parents first
  std::vector<Index> own_first_key;  ///< per sequence: its first key that no shared pass reads
};

namespace detail {

/// What the plan needs of one sequence of a call: its block table (null: contiguous), page size,
/// held keys, the positions of its queries and its rule at absolute positions.
struct CascadeSequence {
  const Index* pages = nullptr;
  Index page = 1;
  Index keys = 0;
  Index first_key_position = 0;  // position of its first held key
  Index first_query = 0;         // position of its first query
  Index queries = 0;
  PositionMask rule;
};

/// The most keys, in whole pages from the first held one, that every query of `s` sees under
/// its rule (0 without a block table or queries). Binary search: a smaller run
/// of an all-visible run is all visible.
inline Index shareable_keys(const CascadeSequence& s) {
  if (s.pages == nullptr || s.queries == 0) return 0;
  const auto all_seen = [&](Index pages) {
    return pages == 0 ||
           classify_block(s.rule, s.first_query, s.first_query + s.queries, s.first_key_position,
                          s.first_key_position + pages * s.page) == BlockCoverage::kAll;
  };
  Index low = 0, high = s.keys / s.page;  // all_seen(low) holds
  while (low < high) {
    const Index mid = high - (high - low) / 2;
    if (all_seen(mid)) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low * s.page;
}

/// The sequences of a plan with the pages each may share (shareable_keys, in pages).
struct PageTree {
  const std::vector<CascadeSequence>& sequences;
  std::vector<Index> limit;

  /// Whether sequence i may share its page p.
  bool holds(Index i, Index p) const { return limit[static_cast<std::size_t>(i)] > p; }
  /// The page id of sequence i's page p.
  Index page_of(Index i, Index p) const { return sequences[static_cast<std::size_t>(i)].pages[p]; }
  /// The first page from `from` on that not every sequence of `group` shares with the others.
  Index run_end(const std::vector<Index>& group, Index from) const {
    Index end = from;
    const auto shared_at = [&](Index p) {
      return std::all_of(group.begin(), group.end(), [&](Index i) {
        return holds(i, p) && page_of(i, p) == page_of(group.front(), p);
      });
    };
    while (shared_at(end)) ++end;
    return end;
  }
};

/// The cascade of a call (see THE PLAN): a prefix tree of the sequences' page ids, walked
/// depth first from the first page, each node shared by >= 2 sequences a pass. Allocates the
/// plan and its work list.
inline CascadePlan plan_cascade(const std::vector<CascadeSequence>& sequences) {
  const auto n = static_cast<Index>(sequences.size());
  CascadePlan plan;
  plan.own_first_key.assign(static_cast<std::size_t>(n), 0);
  PageTree tree{sequences, std::vector<Index>(static_cast<std::size_t>(n))};
  std::vector<Index> all;
  for (Index i = 0; i < n; ++i) {
    const CascadeSequence& s = sequences[static_cast<std::size_t>(i)];
    tree.limit[static_cast<std::size_t>(i)] = shareable_keys(s) / s.page;
    if (tree.holds(i, 0)) all.push_back(i);
  }
  std::vector<std::pair<std::vector<Index>, Index>> work{{all, 0}};  // members, next page
  while (!work.empty()) {
    const std::vector<Index> members = std::move(work.back().first);
    const Index from = work.back().second;
    work.pop_back();
    std::map<Index, std::vector<Index>> by_page;  // ordered: the same plan on every run
    for (const Index i : members) {
      if (tree.holds(i, from)) by_page[tree.page_of(i, from)].push_back(i);
    }
    for (auto& node : by_page) {
      std::vector<Index>& group = node.second;
      if (group.size() < 2) continue;
      const Index end = tree.run_end(group, from + 1);
      const Index page = sequences[static_cast<std::size_t>(group.front())].page;
      plan.shared.push_back({from * page, (end - from) * page, group});
      for (const Index i : group) plan.own_first_key[static_cast<std::size_t>(i)] = end * page;
      work.emplace_back(std::move(group), end);
    }
  }
  return plan;
}

/// The plan's view of the sequences of a paged call.
template <class TQ, class TK, class TV, class TO, class TB>
std::vector<CascadeSequence> cascade_sequences(
    const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& views) {
  std::vector<CascadeSequence> sequences;
  sequences.reserve(views.size());
  for (const auto& v : views) {
    const Index keys = v.keys.size();
    sequences.push_back({v.keys.pages, v.keys.pages ? v.keys.k.seq() : 1, keys,
                         v.keys.first_position, v.positions.first_query_position(v.q.seq(), keys),
                         v.q.seq(), v.positions});
  }
  return sequences;
}

/// A partial result of H_q heads × `rows` rows: outputs [1, H_q, rows, d_v] and statistics.
template <class TO>
struct PartialRows {
  PartialRows(Index heads, Index rows, Index d_v)
      : out(static_cast<std::size_t>(heads * rows * d_v)),
        max(static_cast<std::size_t>(heads * rows)),
        sum(static_cast<std::size_t>(heads * rows)),
        shape{1, heads, rows, d_v} {}
  HeadsView<TO> out_view() { return HeadsView<TO>::contiguous(out.data(), shape); }
  HeadsView<TO> stat_view(std::vector<TO>& stat) {
    return HeadsView<TO>::contiguous(stat.data(), {1, shape.heads, shape.seq, 1});
  }
  std::vector<TO> out, max, sum;
  HeadsShape shape;
};

/// The queries of a shared pass: each member's rows of q, stacked in the order of the members,
/// [1, H_q, Σ S_q, d_qk]. Allocates them.
template <class TQ, class TK, class TV, class TO, class TB>
std::vector<TQ> stacked_queries(const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& views,
                                const SharedPass& pass, Index rows) {
  const HeadsView<const TQ>& first = views[static_cast<std::size_t>(pass.members.front())].q;
  const Index heads = first.heads(), d = first.dim();
  std::vector<TQ> stacked(static_cast<std::size_t>(heads * rows * d));
  for (Index h = 0; h < heads; ++h) {
    Index row = 0;
    for (const Index m : pass.members) {
      const HeadsView<const TQ>& q = views[static_cast<std::size_t>(m)].q;
      for (Index i = 0; i < q.seq(); ++i, ++row) {
        std::copy_n(row_data(q, 0, h, i), d, stacked.data() + (h * rows + row) * d);
      }
    }
  }
  return stacked;
}

/// Where a sequence's rows are in one of its parts: the part's result, the first row, and (for
/// ALiBi) how many positions farther its keys lie from its queries than the part's rows say:
/// the term slope·(kp − qp) of the sequence's rows is the part's plus slope·shift, a constant of
/// the row that moves its maximum alone (m = m_part + slope·shift).
struct PartOfRows {
  Index result = 0;
  Index first_row = 0;
  Index shift = 0;
};

/// The shared passes of a plan and the own keys of each sequence that takes part in one, as
/// problems of their own (the parts), and where each such sequence finds its parts: a list per
/// sequence of (part, first row), in the order of its keys. The sequences in no shared pass are
/// `plain`, their views unchanged.
template <class TQ, class TK, class TV, class TO, class TB>
struct CascadeParts {
  using Views = SequenceViews<TQ, TK, TV, TO, TB>;
  std::vector<std::vector<TQ>> queries;  // each shared pass's stacked rows of q
  std::vector<PartialRows<TO>> results;  // each part's partial result
  std::vector<Views> parts, plain;
  std::vector<std::vector<PartOfRows>> path;
};

/// The keys [first, first + count) of a sequence's held keys `held`, count > 0.
template <class TK, class TV>
KeySegment<TK, TV> key_run(const KeySegment<TK, TV>& held, Index first, Index count) {
  return paged_segment(held.k, held.v, held.first_position + first,
                       held.pages + first / held.k.seq(), count);
}

/// The parts of `plan` over `views` (see CascadeParts). Allocates them.
template <class TQ, class TK, class TV, class TO, class TB>
CascadeParts<TQ, TK, TV, TO, TB> cascade_parts(
    const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& views, const CascadePlan& plan) {
  CascadeParts<TQ, TK, TV, TO, TB> c;
  const std::size_t n = views.size();
  c.queries.reserve(plan.shared.size());
  c.results.reserve(plan.shared.size() + n);  // the views into them stay where they are
  c.path.resize(n);
  const auto first_query = [](const auto& v) {
    return v.positions.first_query_position(v.q.seq(), v.keys.size());
  };
  for (const SharedPass& pass : plan.shared) {
    const auto& lead = views[static_cast<std::size_t>(pass.members.front())];
    PositionMask rule;  // every pair allowed (the plan's condition); rows at the lead's positions
    rule.query_offset = first_query(lead);
    Index rows = 0;
    for (const Index m : pass.members) {
      const auto& v = views[static_cast<std::size_t>(m)];
      const Index shift = (v.keys.first_position - lead.keys.first_position) -
                          (first_query(v) - (*rule.query_offset + rows));
      c.path[static_cast<std::size_t>(m)].push_back(
          {static_cast<Index>(c.results.size()), rows, shift});
      rows += v.q.seq();
    }
    c.queries.push_back(stacked_queries(views, pass, rows));
    PartialRows<TO>& result = c.results.emplace_back(lead.q.heads(), rows, lead.out.dim());
    c.parts.push_back({HeadsView<const TQ>::contiguous(c.queries.back().data(),
                                                       {1, lead.q.heads(), rows, lead.q.dim()}),
                       key_run(lead.keys, pass.first_key, pass.keys),
                       rule,
                       result.out_view(),
                       {},
                       {},
                       {},
                       result.stat_view(result.max),
                       result.stat_view(result.sum)});
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto& v = views[i];
    const Index own = plan.own_first_key[i], keys = v.keys.size() - own;
    if (c.path[i].empty()) {
      c.plain.push_back(v);
      continue;
    }
    if (keys == 0) continue;
    PositionMask rule = v.positions;
    rule.query_offset = first_query(v);
    rule.key_offset = v.keys.first_position + own;
    c.path[i].push_back({static_cast<Index>(c.results.size()), 0, 0});
    PartialRows<TO>& result = c.results.emplace_back(v.q.heads(), v.q.seq(), v.out.dim());
    c.parts.push_back({v.q,
                       key_run(v.keys, own, keys),
                       rule,
                       result.out_view(),
                       {},
                       {},
                       {},
                       result.stat_view(result.max),
                       result.stat_view(result.sum)});
  }
  return c;
}

/// Merges the parts of every sequence that has some (merge_rows, in double, in the order of its
/// keys, the head's sink joining once) into its output rows and lse. Allocates n + d_v doubles.
template <class TQ, class TK, class TV, class TO, class TB>
void merge_cascade(const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& views,
                   const CascadeParts<TQ, TK, TV, TO, TB>& c, const SdpaParams& params) {
  for (std::size_t i = 0; i < views.size(); ++i) {
    const auto& v = views[i];
    const auto& path = c.path[i];
    const auto parts = static_cast<Index>(path.size());
    const Index d_v = v.out.dim();
    std::vector<double> scratch(static_cast<std::size_t>(parts + d_v));
    for (Index h = 0; parts > 0 && h < v.q.heads(); ++h) {
      const double sink = params.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                               : params.sinks[static_cast<std::size_t>(h)];
      const double slope =
          params.alibi_slopes.empty() ? 0.0 : params.alibi_slopes[static_cast<std::size_t>(h)];
      for (Index r = 0; r < v.q.seq(); ++r) {
        const auto part_at = [&](Index p) {
          const PartOfRows& part = path[static_cast<std::size_t>(p)];
          const PartialRows<TO>& result = c.results[static_cast<std::size_t>(part.result)];
          const auto at = static_cast<std::size_t>(h * result.shape.seq + part.first_row + r);
          const double max = double(result.max[at]);
          return PartRow<TO, double>{
              result.out.data() + at * static_cast<std::size_t>(d_v),
              {part.shift == 0 ? max : max + slope * double(part.shift), double(result.sum[at])}};
        };
        const SoftmaxStats<double> stats =
            merge_rows<double>(parts, d_v, part_at, row_data(v.out, 0, h, r), scratch.data(),
                               scratch.data() + parts, sink);
        if (!v.lse.empty()) *row_data(v.lse, 0, h, r) = round_to<TO>(log_sum_exp(stats));
      }
    }
  }
}

/// The whole of sdpa_cascade after its checks: the plan, the plain sequences with `params`, the
/// parts without the sinks, then the merges.
template <class TQ, class TK, class TV, class TO, class TB>
void attend_cascade(const std::vector<SequenceViews<TQ, TK, TV, TO, TB>>& views,
                    const CascadePlan& plan, const SdpaParams& params) {
  const auto c = cascade_parts(views, plan);
  if (!c.plain.empty()) attend_sequences(c.plain, params, {});
  SdpaParams without_sinks = params;
  without_sinks.sinks.clear();
  if (!c.parts.empty()) attend_sequences(c.parts, without_sinks, {});
  merge_cascade(views, c, params);
}

}  // namespace detail

/// sdpa_paged with every run of pages that several of the named sequences share read once, for
/// all of them (cascade attention; see the top of this header for the plan, the accuracy and the
/// memory). The arguments, shapes, checks and errors are sdpa_paged's (the messages name
/// sdpa_cascade) and a failed call changes nothing. Use it where many sequences hold the same
/// pages (fork, page_pool.hpp); over sequences that share nothing it is sdpa_paged.
///   q: [1, H_q, total_q, d_qk] -> out: [1, H_q, total_q, d_v], lse (optional): [1, H_q,
///   total_q, 1].
template <class Q, class Cache, class TO>
void sdpa_cascade(const HeadsView<Q>& q, const std::vector<Index>& cu_seqlens_q, const Cache& cache,
                  const std::vector<SequenceId>& ids, const std::vector<PositionMask>& masks,
                  const SdpaParams& params, const HeadsView<TO>& out,
                  const HeadsView<TO>& lse = {}) {
  using TQ = std::remove_const_t<Q>;
  const auto views = detail::paged_sequence_views<TQ, Cache, TO, TQ>(
      q, cu_seqlens_q, cache, ids, masks, params, out, lse, AttentionMask<TQ>{}, "sdpa_cascade");
  detail::attend_cascade(views, detail::plan_cascade(detail::cascade_sequences(views)), params);
}

}  // namespace apex
