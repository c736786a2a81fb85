// SPDX-License-Identifier: MIT
// Tests of include/apex/serving_cache.hpp and AttentionStack::serve: many sequences served at
// once (continuous batching over paged caches) give every sequence the logits it gets alone
// (AttentionStack::prefill / decode_step with a StackCache of batch 1, tested against forward()
// in stack_test); forks share pages; windows give pages back; bad input changes nothing.
#include <apex/gqa.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/serving_cache.hpp>
#include <apex/stack.hpp>
#include <apex/tree_mask.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "draft_paths.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace serving_cache_test {
namespace {

using apex::Index;
using apex::RowMatrix;
using apex::SequenceId;
using Tokens = std::vector<std::int64_t>;

/// Seven layers (0-4 local with W = 5, 5 global, 6 local), vocabulary 40, up to 256 positions.
apex::StackConfig serving_config() {
  apex::StackConfig c;
  c.vocab_size = 40;
  c.d_model = 24;
  c.num_layers = 7;
  c.window = 5;
  c.local = apex::GqaConfig{24, 4, 2, 6};
  c.global.d_model = 24;
  c.global.d_q = 10;
  c.global.d_kv = 8;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 6;
  c.global.rope_dim = 4;
  c.max_positions = 256;
  return c;
}

/// The logits of every token of `tokens` after the first `prompt` of them, for a sequence run
/// alone: prefill of the prompt, then one decode_step per token (rows 0 .. n − prompt).
RowMatrix<double> alone(const apex::AttentionStack<double>& stack, const Tokens& tokens,
                        std::size_t prompt, Index prefix) {
  auto cache = stack.make_cache(1, 256);
  apex::DecodeOptions last;
  last.logits = apex::LogitRows::kLast;
  const Eigen::Map<const apex::TokenMatrix> first(tokens.data(), 1, Index(prompt));
  RowMatrix<double> logits(Index(tokens.size() - prompt + 1), stack.config().vocab_size);
  logits.row(0) = stack.prefill(first, prefix, last, cache);
  for (std::size_t t = prompt; t < tokens.size(); ++t) {
    logits.row(Index(t - prompt + 1)) = stack.decode_step({tokens[t]}, cache);
  }
  return logits;
}

/// Continuous batching: requests arrive, are prefilled (several in one call, beside the decode
/// steps of the others), decode a token per step and leave; every logit row equals the same
/// request run alone.
TEST(ServingCache, ContinuousBatchingEqualsEachSequenceAlone) {
  const auto stack = apex::AttentionStack<double>::random(serving_config(), 3);
  std::mt19937 rng(5);
  struct Request {
    Tokens tokens;
    std::size_t prompt;
    Index prefix;
    SequenceId id;
    std::size_t fed = 0;
    RowMatrix<double> logits;
  };
  std::vector<Request> requests;
  for (int r = 0; r < 12; ++r) {
    Request q;
    const std::size_t prompt = std::uniform_int_distribution<std::size_t>(1, 30)(rng);
    const std::size_t total = prompt + std::uniform_int_distribution<std::size_t>(0, 25)(rng);
    for (std::size_t t = 0; t < total; ++t) q.tokens.push_back(rng() % 40);
    q.prompt = prompt;
    q.prefix = r % 3 == 0 ? Index(std::min<std::size_t>(prompt, 4)) : 0;
    q.logits.resize(Index(total - prompt + 1), 40);
    requests.push_back(std::move(q));
  }
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 200, 200});
  std::size_t next = 0;
  for (int step = 0; step < 200; ++step) {
    std::vector<SequenceId> ids;
    std::vector<Tokens> feed;
    std::vector<Request*> who;
    for (int arrive = 0; arrive < 2 && next < requests.size(); ++arrive) {  // new prompts
      Request& q = requests[next++];
      q.id = cache.add(q.prefix);
    }
    for (Request& q : requests) {
      if (q.id.value < 0 || q.fed == q.tokens.size()) continue;
      const std::size_t n = q.fed == 0 ? q.prompt : 1;
      ids.push_back(q.id);
      feed.emplace_back(q.tokens.begin() + long(q.fed), q.tokens.begin() + long(q.fed + n));
      who.push_back(&q);
    }
    if (ids.empty()) break;
    const RowMatrix<double> logits = stack.serve(ids, feed, cache);
    for (std::size_t i = 0; i < who.size(); ++i) {
      Request& q = *who[i];
      q.fed += feed[i].size();
      q.logits.row(Index(q.fed - q.prompt)) = logits.row(Index(i));
      if (q.fed == q.tokens.size()) cache.free(q.id);
    }
  }
  EXPECT_EQ(cache.sequences(), 0);
  EXPECT_EQ(cache.pages_in_use(), 0) << "a page leaked";
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Request& q = requests[r];
    ASSERT_EQ(q.fed, q.tokens.size()) << "request " << r << " was not served to the end";
    const RowMatrix<double> expected = alone(stack, q.tokens, q.prompt, q.prefix);
    const double scale = std::max(1.0, expected.cwiseAbs().maxCoeff());
    EXPECT_LE((q.logits - expected).cwiseAbs().maxCoeff(),
              apex::testing::Tolerances<double>::kDecode * scale)
        << "request " << r;
  }
}

/// One call may hold more tokens than max_positions in all (each sequence's own positions are
/// what must fit): three 100-token prompts against max_positions = 256.
TEST(ServingCache, ACallMayHoldMoreTokensThanMaxPositions) {
  const auto stack = apex::AttentionStack<double>::random(serving_config(), 9);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{8, 64, 64});
  std::vector<SequenceId> ids;
  std::vector<Tokens> prompts;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(cache.add(i));
    prompts.emplace_back();
    for (int t = 0; t < 100; ++t) prompts.back().push_back((7 * t + 3 * i) % 40);
  }
  const RowMatrix<double> logits = stack.serve(ids, prompts, cache);
  for (int i = 0; i < 3; ++i) {
    const RowMatrix<double> expected = alone(stack, prompts[std::size_t(i)], 100, i);
    EXPECT_LE(
        (logits.row(i) - expected.row(0)).cwiseAbs().maxCoeff(),
        apex::testing::Tolerances<double>::kDecode * std::max(1.0, expected.cwiseAbs().maxCoeff()));
  }
}

/// Two continuations of a common prompt: the fork shares the prompt's pages in every layer,
/// each continuation gets the logits of its whole text run alone, and the shared pages are
/// freed only with the last holder.
TEST(ServingCache, ForksShareThePromptAndDivergeCorrectly) {
  const auto stack = apex::AttentionStack<float>::random(serving_config(), 4);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{8, 40, 40});
  const Tokens prompt = {3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 4, 33};
  const SequenceId a = cache.add(2);
  const RowMatrix<float> first = stack.serve({a}, {prompt}, cache);
  const Index in_use = cache.pages_in_use();
  const SequenceId b = cache.fork(a);
  EXPECT_EQ(cache.pages_in_use(), in_use) << "a fork copies no page";
  EXPECT_EQ(cache.length(b), cache.length(a));
  EXPECT_EQ(cache.prefix(b), 2);
  const Tokens ta = {11, 12, 13}, tb = {21, 22, 23};
  RowMatrix<float> got_a(4, 40), got_b(4, 40);
  got_a.row(0) = first.row(0);
  got_b.row(0) = first.row(0);
  for (std::size_t t = 0; t < ta.size(); ++t) {
    const RowMatrix<float> logits = stack.serve({a, b}, {{ta[t]}, {tb[t]}}, cache);
    got_a.row(Index(t + 1)) = logits.row(0);
    got_b.row(Index(t + 1)) = logits.row(1);
  }
  const auto expect_alone = [&](Tokens text, const RowMatrix<float>& got) {
    auto c = stack.make_cache(1, 64);
    apex::DecodeOptions last;
    last.logits = apex::LogitRows::kLast;
    const Eigen::Map<const apex::TokenMatrix> p(text.data(), 1, Index(prompt.size()));
    RowMatrix<float> want(4, 40);
    want.row(0) = stack.prefill(p, 2, last, c);
    for (std::size_t t = prompt.size(); t < text.size(); ++t) {
      want.row(Index(t - prompt.size() + 1)) = stack.decode_step({text[t]}, c);
    }
    EXPECT_LE((got - want).cwiseAbs().maxCoeff(), apex::testing::Tolerances<float>::kDecode *
                                                      std::max(1.0f, want.cwiseAbs().maxCoeff()));
  };
  Tokens text_a = prompt, text_b = prompt;
  text_a.insert(text_a.end(), ta.begin(), ta.end());
  text_b.insert(text_b.end(), tb.begin(), tb.end());
  expect_alone(text_a, got_a);
  expect_alone(text_b, got_b);
  // The global layer holds both histories: the 19-token prompt's 3 pages once, and the page
  // each continuation copied on write (its last, shared, partly filled page).
  const auto& global = std::get<apex::PagedLatentCache<float>>(cache.layer(5));
  EXPECT_EQ(global.pages_in_use(), 4);
  cache.free(a);
  EXPECT_EQ(global.pages_in_use(), 3);
  cache.free(b);
  EXPECT_EQ(cache.pages_in_use(), 0);
}

/// Five continuations of one prompt, two of them forked again after a few tokens of their own
/// (prefixes shared at two levels), with a window wider than the texts so that the local layers
/// share pages too: serve reads the shared pages once per layer (sdpa_cascade) and every
/// continuation gets the logits of its whole text run alone.
TEST(ServingCache, ManyForksOfOnePromptEqualEachAlone) {
  apex::StackConfig config = serving_config();
  config.window = 64;
  const auto stack = apex::AttentionStack<double>::random(config, 6);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 80, 80});
  const Tokens prompt = {3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 4, 33};
  std::vector<SequenceId> ids{cache.add(2)};
  std::vector<Tokens> texts{prompt};
  std::vector<std::vector<RowMatrix<double>>> got(1);
  got[0].push_back(stack.serve({ids[0]}, {prompt}, cache));
  const auto step = [&](int t) {
    std::vector<Tokens> next;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      next.push_back({std::int64_t((7 * i + 3 * std::size_t(t) + 1) % 40)});
      texts[i].push_back(next.back()[0]);
    }
    const RowMatrix<double> logits = stack.serve(ids, next, cache);
    for (std::size_t i = 0; i < ids.size(); ++i) got[i].push_back(logits.row(Index(i)));
  };
  const auto fork = [&](std::size_t i) {
    ids.push_back(cache.fork(ids[i]));
    texts.push_back(texts[i]);
    got.push_back(got[i]);
  };
  for (int f = 0; f < 4; ++f) fork(0);
  for (int t = 0; t < 9; ++t) step(t);  // 28 tokens: 7 pages of 4 each
  fork(1);
  fork(2);
  for (int t = 9; t < 12; ++t) step(t);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const RowMatrix<double> want = alone(stack, texts[i], prompt.size(), 2);
    ASSERT_EQ(Index(got[i].size()), want.rows());  // a fork's first rows are its parent's
    for (Index r = 0; r < want.rows(); ++r) {
      EXPECT_LE((got[i][std::size_t(r)] - want.row(r)).cwiseAbs().maxCoeff(),
                apex::testing::Tolerances<double>::kDecode *
                    std::max(1.0, want.row(r).cwiseAbs().maxCoeff()))
          << "row " << r;
    }
  }
}

/// A local layer keeps O(W) tokens per sequence however long it gets; a global layer keeps all.
TEST(ServingCache, LocalLayersGiveBackWhatTheWindowPassed) {
  const auto stack = apex::AttentionStack<float>::random(serving_config(), 6);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 6, 80});
  const SequenceId id = cache.add();
  stack.serve({id}, {{1, 2, 3}}, cache);
  for (int t = 0; t < 200; ++t) stack.serve({id}, {{t % 40}}, cache);
  const auto& local = std::get<apex::PagedKvCache<float>>(cache.layer(0));
  const auto& global = std::get<apex::PagedLatentCache<float>>(cache.layer(5));
  EXPECT_LE(local.pages_in_use(), 3);    // W = 5 tokens span at most 3 pages of 4
  EXPECT_EQ(global.pages_in_use(), 51);  // 203 tokens
  EXPECT_GT(local.first_position(id), 190);
}

/// Bad input: a clear std::invalid_argument, and no cache changes.
TEST(ServingCache, RejectsBadInputAndChangesNothing) {
  const auto stack = apex::AttentionStack<float>::random(serving_config(), 7);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 4, 4});
  const SequenceId a = cache.add();
  stack.serve({a}, {{1, 2, 3, 4, 5}}, cache);
  const SequenceId gone = cache.add();
  cache.free(gone);
  const Index pages = cache.pages_in_use();
  using apex::testing::expect_invalid;
  expect_invalid([&] { stack.serve({gone}, {{1}}, cache); },
                 {"sequence " + std::to_string(gone.value), "does not exist"});
  expect_invalid([&] { stack.serve({a, a}, {{1}, {2}}, cache); }, "appears more than once");
  expect_invalid([&] { stack.serve({a}, {{}}, cache); }, "gets no token");
  expect_invalid([&] { stack.serve({a}, {{1}, {2}}, cache); }, "one entry per sequence");
  expect_invalid([&] { stack.serve({a}, {{41}}, cache); }, "41");
  expect_invalid([&] { stack.serve({a}, {Tokens(20, 1)}, cache); }, "the pool is full");
  const SequenceId p = cache.add(3);
  expect_invalid([&] { stack.serve({p}, {{1, 2}}, cache); }, "must lie inside its first call");
  expect_invalid([&] { cache.fork(gone); }, "does not exist");
  EXPECT_EQ(cache.length(a), 5);
  EXPECT_EQ(cache.length(p), 0);
  EXPECT_EQ(cache.pages_in_use(), pages);
  auto other = apex::AttentionStack<float>::random(serving_config(), 8)
                   .make_serving_cache(apex::ServingCacheShape{4, 4, 4});
  apex::StackConfig smaller = serving_config();
  smaller.num_layers = 3;
  const auto short_stack = apex::AttentionStack<float>::random(smaller, 1);
  const SequenceId o = other.add();
  expect_invalid([&] { short_stack.serve({o}, {{1}}, other); }, "was not made by this stack");
  apex::ServingCache<float> empty;
  expect_invalid([&] { empty.add(); }, "the cache is empty");
  const apex::ServingCache<float> moved = std::move(cache);
  EXPECT_EQ(cache.num_layers(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(moved.length(a), 5);
}

/// Errors that name the call the user made: serve and a layer's paged step report an unknown
/// id, a bad token or a full pool under their own names, not under the cache's or embed's.
TEST(ServingCache, ErrorsNameTheCall_ServeAndPagedLayerSteps) {
  const auto stack = apex::AttentionStack<float>::random(serving_config(), 7);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 4, 4});
  const SequenceId a = cache.add();
  stack.serve({a}, {{1, 2, 3}}, cache);
  const SequenceId gone = cache.add();
  cache.free(gone);
  using apex::testing::expect_invalid;
  expect_invalid(
      [&] {
        stack.serve({a, gone}, {{1}, {1}}, cache);
      },
      {"[serve] ids[1]: sequence " + std::to_string(gone.value), "does not exist"});
  expect_invalid(
      [&] {
        stack.serve({a}, {{1, 41}}, cache);
      },
      "[serve] tokens[0][1] (41) must be a token id in [0, V = 40)");
  expect_invalid([&] { stack.serve({a}, {{-1}}, cache); }, "[serve] tokens[0][0] (-1)");
  expect_invalid([&] { stack.serve({a}, {Tokens(20, 1)}, cache); }, "[serve] the pool is full");
  EXPECT_EQ(cache.length(a), 3);

  const auto gqa = apex::GroupedQueryAttention<float>::random(serving_config().local, 3);
  apex::PagedKvCache<float> kv({2, 6, 4, 2});
  const SequenceId b = kv.add();
  const SequenceId freed = kv.add();
  kv.free(freed);
  const RowMatrix<float> x = RowMatrix<float>::Random(9, 24);
  RowMatrix<float> out(9, 24);
  expect_invalid(
      [&] {
        gqa.forward_paged(x.topRows(1), {0, 1}, {freed}, {apex::causal_mask()}, {}, kv,
                          out.topRows(1));
      },
      {"[gqa] ids[0]: sequence " + std::to_string(freed.value), "does not exist"});
  expect_invalid(
      [&] {
        gqa.forward_paged(x, {0, 9}, {b}, {apex::causal_mask()}, {}, kv, out);
      },
      "[gqa] the pool is full");
  apex::AttentionLayerParams<float> placed;
  const apex::Vector<Index> two = apex::Vector<Index>::Constant(2, 0);
  placed.row_positions = &two;
  expect_invalid(
      [&] {
        gqa.forward_paged(x.topRows(1), {0, 1}, {b}, {apex::causal_mask()}, placed, kv,
                          out.topRows(1));
      },
      "[gqa] row_positions holds 2 positions; expected one per row (1)");
  const apex::Vector<Index> negative = apex::Vector<Index>::Constant(1, -3);
  placed.row_positions = &negative;
  expect_invalid(
      [&] {
        gqa.forward_paged(x.topRows(1), {0, 1}, {b}, {apex::causal_mask()}, placed, kv,
                          out.topRows(1));
      },
      "[gqa] row_positions[0] (-3) must be >= 0");
  gqa.forward_paged(x.topRows(3), {0, 3}, {b}, {apex::causal_mask()}, {}, kv, out.topRows(3));
  const apex::Vector<Index> back = apex::Vector<Index>::Constant(1, 2);
  placed.row_positions = &back;
  expect_invalid(
      [&] {
        gqa.forward_paged(x.topRows(1), {0, 1}, {b}, {apex::causal_mask()}, placed, kv,
                          out.topRows(1));
      },
      "[gqa] row_positions[0] (2) must be >= 3 (sequence " + std::to_string(b.value) +
          "'s length: positions do not go back)");
  EXPECT_EQ(kv.length(b), 3);
}

/// Speculative decoding through serve's caches: rounds of random draft trees for three
/// sequences (one with a prefix; windows of 5 that the drafts cross), verified in one pass, a
/// random path of each accepted (sometimes none), then a token served. Every draft token's
/// logits equal the target's after committed text ‖ its path, run alone (each draft token at
/// its position in the text, not its slot); after accept, the next token's logits equal the
/// text run alone, so the accepted rows are what decoding them one at a time would store. A
/// sequence forked while verifying accepts a path of its own. No page leaks.
TEST(ServingCache, VerifiedDraftsAndAcceptedPathsEqualEachTextAlone) {
  std::mt19937 rng(12);
  const auto stack = apex::AttentionStack<double>::random(serving_config(), 8);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 200, 200});
  const std::vector<Tokens> prompts = {{5, 9, 2, 33, 7, 1, 18},
                                       Tokens(12, 4),
                                       {3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6}};
  const std::vector<Index> prefixes = {0, 3, 0};
  apex::testing::SpeculativeTexts seqs;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    seqs.ids.push_back(cache.add(prefixes[i]));
    seqs.texts.push_back(prompts[i]);
    seqs.origin.push_back(i);
    stack.serve({seqs.ids.back()}, {prompts[i]}, cache);
  }
  const auto expect_alone = [&](std::size_t p, const Tokens& text, const auto& got,
                                const std::string& what) {
    const RowMatrix<double> all = alone(stack, text, prompts[p].size(), prefixes[p]);
    const auto want = all.row(all.rows() - 1);
    EXPECT_LE((got - want).cwiseAbs().maxCoeff(), apex::testing::Tolerances<double>::kDecode *
                                                      std::max(1.0, want.cwiseAbs().maxCoeff()))
        << what;
  };
  apex::testing::speculative_rounds(stack, cache, seqs, 4, 9, rng, expect_alone);
  for (const SequenceId id : seqs.ids) cache.free(id);
  EXPECT_EQ(cache.pages_in_use(), 0);
}

/// verify_drafts and accept_drafts check everything first and change nothing on error.
TEST(ServingCache, SpeculativeCallsRejectBadInputAndChangeNothing) {
  const auto stack = apex::AttentionStack<float>::random(serving_config(), 9);
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{4, 40, 40});
  const SequenceId a = cache.add(), b = cache.add(5);
  stack.serve({a, b}, {{1, 2, 3}, {4, 5, 6, 7, 8}}, cache);
  const SequenceId late = cache.add(9);
  const Index in_use = cache.pages_in_use();
  const apex::DraftTree tree({-1, 0, 0});
  using apex::testing::expect_invalid;
  expect_invalid(
      [&] {
        stack.verify_drafts({a}, {{1, 2, 3}}, {}, cache);
      },
      "[verify_drafts] trees (0) must have one entry per sequence (1)");
  expect_invalid(
      [&] {
        stack.verify_drafts({a}, {{1, 2}}, {tree}, cache);
      },
      "[verify_drafts] trees[0] has 3 tokens; drafts[0] has 2");
  expect_invalid(
      [&] {
        stack.verify_drafts({a}, {{1, 2, 40}}, {tree}, cache);
      },
      "[verify_drafts] tokens[0][2] (40)");
  stack.serve({late}, {Tokens(9, 2)}, cache);
  const Index late_pages = cache.pages_in_use();
  expect_invalid([&] { stack.accept_drafts({a}, {{0}}, cache); },
                 "[accept_drafts] sequence 0 holds no verified draft");
  EXPECT_EQ(cache.pages_in_use(), late_pages);
  EXPECT_GT(late_pages, in_use);
  stack.verify_drafts({a, b}, {{1, 2, 3}, {4, 5, 6}}, {tree, tree}, cache);
  EXPECT_EQ(cache.length(a), 6);
  expect_invalid(
      [&] {
        stack.verify_drafts({a}, {{1, 2, 3}}, {tree}, cache);
      },
      "[verify_drafts] sequence 0 holds a verified draft: accept_drafts first");
  expect_invalid([&] { stack.serve({b}, {{1}}, cache); },
                 "[serve] sequence 1 holds a verified draft: accept_drafts first");
  expect_invalid(
      [&] {
        stack.accept_drafts({a, b}, {{0, 1}, {1}}, cache);
      },
      "[accept_drafts] paths[1][0] (1) must be a draft token whose parent is -1");
  expect_invalid(
      [&] {
        stack.accept_drafts({a, b}, {{0, 1, 2}, {}}, cache);
      },
      "[accept_drafts] paths[0][2] (2) must be a draft token whose parent is 1");
  expect_invalid([&] { stack.accept_drafts({a}, {{0, 3}}, cache); }, "paths[0][1] (3)");
  expect_invalid([&] { stack.accept_drafts({a, a}, {{}, {}}, cache); }, "appears more than once");
  EXPECT_EQ(cache.length(a), 6);
  EXPECT_EQ(cache.length(b), 8);
  EXPECT_TRUE(cache.verifying(a) && cache.verifying(b));
  stack.accept_drafts({a, b}, {{0, 2}, {}}, cache);
  EXPECT_EQ(cache.length(a), 5);
  EXPECT_EQ(cache.length(b), 5);
  EXPECT_FALSE(cache.verifying(a) || cache.verifying(b));
}

}  // namespace
}  // namespace serving_cache_test
