// SPDX-License-Identifier: MIT
// Speculative decoding through an AttentionStack that serves many sequences (a ServingCache,
// stack_serving.hpp): a cheap draft (a smaller model, prompt lookup, EAGLE or Medusa heads)
// proposes each sequence's next tokens as a tree (tree_mask.hpp), the stack verifies every draft
// token of every sequence in one pass, and the caller keeps the path the target agrees with.
//
//   verify_drafts   appends each sequence's draft tokens after its committed ones in every layer
//                   (slot committed + t), each rotated at its position in the text (committed +
//                   depth(t)), and attends under the tree's rule: draft token t sees the committed
//                   tokens and exactly its ancestors and itself (a local layer's window measured
//                   along the text). Returns the logits of every draft token: row t of a sequence
//                   is the target's prediction after the text committed ‖ path to t.
//   accept_drafts   keeps one path of each verified tree (root first; empty: none), its rows moved
//                   down to the slots after the committed tokens in every layer, and releases the
//                   rest (PagedKvCache::keep_tokens); the local layers then give back the pages
//                   their window has passed, as serve does.
//
// A stack with sparse global layers (StackConfig::indexer) verifies and accepts drafts too: a
// draft token's indexer ranks the committed keys, its ancestors and itself, and accept keeps the
// path's indexer keys beside its latent rows.
//
// Between the two a sequence is `verifying` (ServingCache::verifying) and takes no serve or
// verify_drafts. With greedy acceptance (the longest path along which each draft token is the
// target's argmax after its parent), the tokens produced equal greedy decoding of the target
// alone, to the rounding of the paths taken (examples/07_speculative.cpp checks it token for
// token).
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/config.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/serving_cache.hpp>
#include <apex/stack_config.hpp>
#include <apex/stack_serving.hpp>
#include <apex/tree_mask.hpp>

#include <algorithm>
#include <cstdint>
#include <variant>
#include <vector>

namespace apex {

namespace detail {

/// The checks of verify_drafts beyond serve's (check_serve, which runs first): a tree per
/// sequence, of as many tokens as its draft, after its prefix.
template <class Scalar, class Storage, class Global>
void check_drafts(const std::vector<SequenceId>& ids,
                  const std::vector<std::vector<std::int64_t>>& drafts,
                  const std::vector<DraftTree>& trees,
                  const ServingCache<Scalar, Storage, Global>& cache) {
  const char* op = "verify_drafts";
  APEX_CHECK(trees.size() == ids.size(), "[" << op << "] trees (" << trees.size()
                                             << ") must have one entry per sequence (" << ids.size()
                                             << ")");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    APEX_CHECK(trees[i].size() == static_cast<Index>(drafts[i].size()),
               "[" << op << "] trees[" << i << "] has " << trees[i].size() << " tokens; drafts["
                   << i << "] has " << drafts[i].size());
    APEX_CHECK(cache.length(ids[i]) >= cache.prefix(ids[i]),
               "[" << op << "] sequence " << ids[i] << " has not yet been fed its prefix ("
                   << cache.prefix(ids[i]) << " tokens): a draft follows it");
  }
}

/// The text position of every draft row (committed + depth), row cu[i] + t for sequence i.
template <class Scalar, class Storage, class Global>
Vector<Index> draft_positions(const std::vector<SequenceId>& ids, const std::vector<Index>& cu,
                              const std::vector<DraftTree>& trees,
                              const ServingCache<Scalar, Storage, Global>& cache) {
  Vector<Index> positions(cu.back());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    for (Index t = 0; t < trees[i].size(); ++t) {
      positions(cu[i] + t) = cache.length(ids[i]) + trees[i].depth(t);
    }
  }
  return positions;
}

/// Throws unless paths[i] is a path of sequence ids[i]'s verified tree from a root (each token
/// the child of the one before it, the first a root), for live, distinct, verifying ids, and
/// every layer's pool has room for the pages the moves copy.
template <class Scalar, class Storage, class Global>
void check_accept(const std::vector<SequenceId>& ids, const std::vector<std::vector<Index>>& paths,
                  ServingCache<Scalar, Storage, Global>& cache) {
  const char* op = "accept_drafts";
  APEX_CHECK(paths.size() == ids.size(), "[" << op << "] paths (" << paths.size()
                                             << ") must have one entry per sequence (" << ids.size()
                                             << ")");
  check_live_ids(cache, ids, op);
  const auto& drafts = ServingCacheAccess::drafts(cache);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    APEX_CHECK(std::count(ids.begin(), ids.end(), ids[i]) == 1,
               "[" << op << "] sequence " << ids[i] << " appears more than once in one call");
    APEX_CHECK(cache.verifying(ids[i]),
               "[" << op << "] sequence " << ids[i] << " holds no verified draft");
    const DraftTree& tree = drafts.at(ids[i]).tree;
    for (std::size_t k = 0; k < paths[i].size(); ++k) {
      const Index t = paths[i][k], parent = k == 0 ? -1 : paths[i][k - 1];
      APEX_CHECK(t >= 0 && t < tree.size() && tree.parent(t) == parent,
                 "[" << op << "] paths[" << i << "][" << k << "] (" << t
                     << ") must be a draft token whose parent is " << parent
                     << ": a path runs from a root of the tree, each token a child of the one "
                        "before it");
    }
  }
  const auto check_room = [&](const auto& c) {
    Index copies = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      copies += c.keep_copies(ids[i], drafts.at(ids[i]).committed, paths[i], op);
    }
    c.check_room(copies, "keeping the accepted rows", op);
  };
  for (Index l = 0; l < cache.num_layers(); ++l) {
    std::visit(check_room, cache.layer(l));
    if (cache.indexer_keys(l).head_dim() >= 1) check_room(cache.indexer_keys(l));
  }
}

}  // namespace detail

/// Verifies the draft trees of many sequences of a ServingCache in one pass through the stack
/// (see the top of this header): drafts[i][t] is draft token t of sequence ids[i], continuing
/// drafts[i][trees[i].parent(t)] (or its last committed token where the parent is -1).
///   ids: N distinct live sequences, none verifying, each fed its prefix; drafts: N non-empty
///   lists of ids in [0, V); trees: N DraftTree of as many tokens
///   -> logits [T, V], T = Σ_i n_i, row cu[i] + t for draft token t of sequence i (cu the
///   running sums of the drafts' sizes).
/// The sequences are then `verifying` until accept_drafts. Every check runs before any cache is
/// written (serve's, with the message naming verify_drafts, and a tree per draft): on error
/// nothing changes. Allocates as serve does, and the [T] positions.
template <class Scalar, class Weight, class Storage, class Global>
RowMatrix<Scalar> verify_drafts(const AttentionStack<Scalar, Weight>& stack,
                                const std::vector<SequenceId>& ids,
                                const std::vector<std::vector<std::int64_t>>& drafts,
                                const std::vector<DraftTree>& trees,
                                ServingCache<Scalar, Storage, Global>& cache) {
  const std::vector<Index> cu = detail::check_serve(stack, ids, drafts, cache, "verify_drafts");
  detail::check_drafts(ids, drafts, trees, cache);
  detail::check_serve_room(ids, cu, cache, "verify_drafts");
  const Vector<Index> positions = detail::draft_positions(ids, cu, trees, cache);
  std::vector<Index> committed;
  for (const SequenceId id : ids) committed.push_back(cache.length(id));
  const auto& config = stack.config();
  const TreeMasks global_trees(trees, committed), local_trees(trees, committed, config.window);
  RowMatrix<Scalar> x = stack.embed_tokens(detail::packed_tokens(drafts, cu));
  stack.run_blocks(
      x, [&](Index l, const auto&, const RowMatrix<Scalar>& normed, RowMatrix<Scalar>& attended) {
        const bool global = is_global_layer(l, config.global_every);
        std::vector<PositionMask> masks;  // causal and the prefix; a window is the trees'
        masks.reserve(ids.size());
        for (const SequenceId id : ids) {
          masks.push_back(layer_mask(l, LayerMaskParams{cache.prefix(id), 0, 1}));
        }
        AttentionLayerParams<Scalar> params = stack.block_params(l);
        params.row_positions = &positions;
        params.draft_trees = global ? &global_trees : &local_trees;
        detail::paged_layer_step(stack, l, normed, cu, ids, masks, params, cache, attended);
      });
  auto& pending = detail::ServingCacheAccess::drafts(cache);
  for (std::size_t i = 0; i < ids.size(); ++i) pending[ids[i]] = {committed[i], trees[i]};
  std::vector<Index> rows(static_cast<std::size_t>(cu.back()));
  for (Index r = 0; r < cu.back(); ++r) rows[static_cast<std::size_t>(r)] = r + 1;
  return stack.last_logits(x, rows);
}

/// Keeps path paths[i] of sequence ids[i]'s verified draft in every layer (see the top of this
/// header) and releases the rest: the sequence's length becomes its committed length plus the
/// path's, and it is no longer verifying. paths[i] runs from a root of its tree, each token a
/// child of the one before it (empty: the whole draft is rejected). Every check runs first (live,
/// distinct, verifying ids; each path a path of its tree; room in every pool for the pages the
/// moves copy where a draft's pages are shared with a fork): on error nothing changes. Allocates
/// nothing but the checks' lists.
template <class Scalar, class Weight, class Storage, class Global>
void accept_drafts(const AttentionStack<Scalar, Weight>& stack, const std::vector<SequenceId>& ids,
                   const std::vector<std::vector<Index>>& paths,
                   ServingCache<Scalar, Storage, Global>& cache) {
  detail::check_serving_layers(stack, cache, "accept_drafts");
  detail::check_accept(ids, paths, cache);
  auto& pending = detail::ServingCacheAccess::drafts(cache);
  const auto keep = [&](auto& c) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      c.keep_tokens(ids[i], pending.at(ids[i]).committed, paths[i]);
    }
  };
  for (Index l = 0; l < cache.num_layers(); ++l) {
    auto& layer = detail::ServingCacheAccess::layer(cache, l);
    std::visit(keep, layer);
    auto& keys = detail::ServingCacheAccess::indexer_keys(cache, l);
    if (keys.head_dim() >= 1) keep(keys);
    if (!is_global_layer(l, stack.config().global_every)) {
      auto& kv = std::get<PagedKvCache<Scalar, Storage>>(layer);
      for (const SequenceId id : ids) detail::forget_past_window(kv, id, stack.config());
    }
  }
  for (const SequenceId id : ids) pending.erase(id);
}

}  // namespace apex
