// SPDX-License-Identifier: MIT
// Speculative decoding in the tests of verify_drafts and accept_drafts (stack_speculative.hpp):
// paths through a draft tree (apex::DraftTree, tree_mask.hpp), random drafts and paths, and
// rounds of verify, accept and serve checked against each text run alone.
#pragma once

#include <apex/config.hpp>
#include <apex/serving_cache.hpp>
#include <apex/tree_mask.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace apex::testing {

/// The tokens of a draft tree's path from a root to token t, root first.
inline std::vector<std::int64_t> path_tokens(const DraftTree& tree,
                                             const std::vector<std::int64_t>& draft, Index t) {
  std::vector<std::int64_t> path;
  for (Index a = t; a >= 0; a = tree.parent(a)) path.insert(path.begin(), draft[std::size_t(a)]);
  return path;
}

/// The draft indices of a path from a root down to a random depth (possibly empty).
inline std::vector<Index> random_path(const DraftTree& tree, std::mt19937& rng) {
  std::vector<Index> path;
  for (;;) {
    const Index parent = path.empty() ? -1 : path.back();
    std::vector<Index> children;
    for (Index t = 0; t < tree.size(); ++t) {
      if (tree.parent(t) == parent) children.push_back(t);
    }
    if (children.empty() || rng() % 4 == 0) return path;
    path.push_back(children[rng() % children.size()]);
  }
}

/// A random tree of n tokens (each token's parent drawn from -1 .. t − 1) and its n draft tokens
/// drawn from [0, vocab).
inline std::pair<DraftTree, std::vector<std::int64_t>> random_draft(Index n, std::int64_t vocab,
                                                                    std::mt19937& rng) {
  std::vector<Index> parents;
  std::vector<std::int64_t> draft;
  for (Index t = 0; t < n; ++t) {
    parents.push_back(std::uniform_int_distribution<Index>(-1, t - 1)(rng));
    draft.push_back(std::uniform_int_distribution<std::int64_t>(0, vocab - 1)(rng));
  }
  return {DraftTree(parents), draft};
}

/// The sequences of a ServingCache that speculative_rounds advances: ids[i]'s text so far, and
/// the sequence it descends from (its own index, or the one a fork was made of).
struct SpeculativeTexts {
  std::vector<SequenceId> ids;
  std::vector<std::vector<std::int64_t>> texts;
  std::vector<std::size_t> origin;
};

/// `rounds` rounds of speculative decoding of every sequence of `seqs` through `stack` and its
/// serving cache: a random draft tree of 1 .. max_draft tokens each, verified in one pass, every
/// draft token's logits checked by expect_alone(origin, committed text ‖ its path, logits row,
/// what); in round 1 a fork of sequence 0 made while it verifies (it shares the draft's pages
/// and accepts a path of its own); a random path of each accepted (sometimes none), then one
/// random token served and its logits checked by expect_alone against the whole text.
template <class Stack, class Cache, class ExpectAlone>
void speculative_rounds(const Stack& stack, Cache& cache, SpeculativeTexts& seqs, int rounds,
                        Index max_draft, std::mt19937& rng, const ExpectAlone& expect_alone) {
  using Tokens = std::vector<std::int64_t>;
  const std::int64_t vocab = stack.config().vocab_size;
  for (int round = 0; round < rounds; ++round) {
    const std::string name = "round " + std::to_string(round) + ", sequence ";
    std::vector<DraftTree> trees;
    std::vector<Tokens> drafts;
    for (std::size_t i = 0; i < seqs.ids.size(); ++i) {
      auto [tree, draft] =
          random_draft(std::uniform_int_distribution<Index>(1, max_draft)(rng), vocab, rng);
      trees.push_back(std::move(tree));
      drafts.push_back(std::move(draft));
    }
    const auto logits = stack.verify_drafts(seqs.ids, drafts, trees, cache);
    Index row = 0;
    for (std::size_t i = 0; i < seqs.ids.size(); ++i) {
      EXPECT_TRUE(cache.verifying(seqs.ids[i]));
      for (Index t = 0; t < trees[i].size(); ++t, ++row) {
        Tokens text = seqs.texts[i];
        const Tokens path = path_tokens(trees[i], drafts[i], t);
        text.insert(text.end(), path.begin(), path.end());
        expect_alone(seqs.origin[i], text, logits.row(row),
                     name + std::to_string(i) + ", draft token " + std::to_string(t));
      }
    }
    if (round == 1) {
      seqs.ids.push_back(cache.fork(seqs.ids[0]));
      seqs.texts.push_back(seqs.texts[0]);
      seqs.origin.push_back(seqs.origin[0]);
      trees.push_back(trees[0]);
      drafts.push_back(drafts[0]);
    }
    std::vector<std::vector<Index>> paths;
    std::vector<Tokens> next;
    for (std::size_t i = 0; i < seqs.ids.size(); ++i) {
      paths.push_back(random_path(trees[i], rng));
      for (const Index t : paths.back()) seqs.texts[i].push_back(drafts[i][std::size_t(t)]);
      next.push_back({std::int64_t(rng() % std::uint64_t(vocab))});
    }
    stack.accept_drafts(seqs.ids, paths, cache);
    for (std::size_t i = 0; i < seqs.ids.size(); ++i) {
      EXPECT_FALSE(cache.verifying(seqs.ids[i]));
      EXPECT_EQ(cache.length(seqs.ids[i]), Index(seqs.texts[i].size()));
      seqs.texts[i].push_back(next[i][0]);
    }
    const auto served = stack.serve(seqs.ids, next, cache);
    for (std::size_t i = 0; i < seqs.ids.size(); ++i) {
      expect_alone(seqs.origin[i], seqs.texts[i], served.row(Index(i)),
                   name + std::to_string(i) + ", after accept");
    }
  }
}

}  // namespace apex::testing
