// SPDX-License-Identifier: MIT
// Speculative decoding: a 6-layer APEX-1 stack (d = 256, random weights) generates 64 tokens
// greedily for 4 sequences, first one token per step through serve(), then speculatively. The
// draft is prompt lookup: where the last two tokens of a text occurred before, the tokens that
// followed them there are guessed to follow again (up to 3 places, 5 tokens each, merged into a
// tree under the token already known to come next). Each step verifies every sequence's tree in
// one verify_drafts pass, walks it greedily (a draft token is accepted while it is the target's
// argmax after its parent) and keeps that path with accept_drafts. Prints the tokens accepted
// per step, the tokens per second of both ways, and checks that the speculative tokens equal
// the plain ones, token for token.
#include <apex/apex.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Tokens = std::vector<std::int64_t>;
using apex::Index;

constexpr Index kNewTokens = 64;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t argmax(const apex::RowMatrix<float>& logits, Index row) {
  Index best = 0;
  logits.row(row).maxCoeff(&best);
  return best;
}

apex::StackConfig config() {
  apex::StackConfig c;
  c.vocab_size = 512;
  c.d_model = 256;
  c.num_layers = 6;  // layer 5 global (MLA), the others local (GQA with a window)
  c.window = 32;
  c.local = apex::GqaConfig{256, 8, 2, 32};
  c.global.d_model = 256;
  c.global.d_q = 128;
  c.global.d_kv = 64;
  c.global.num_q_heads = 8;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 32;
  c.global.rope_dim = 16;
  c.max_positions = 512;
  return c;
}

/// A draft tree for `text` whose next token is known to be `next`: token 0 is `next`, and under
/// it the tokens that followed the last two tokens of text ‖ next where they occurred before
/// (the latest 3 places, 5 tokens each), merged where they agree.
struct Draft {
  Tokens tokens;
  std::vector<Index> parents;
};

Draft prompt_lookup(const Tokens& text, std::int64_t next) {
  Tokens all = text;
  all.push_back(next);
  Draft d{{next}, {-1}};
  const std::size_t n = all.size();
  int places = 0;
  for (std::size_t end = n - 1; end >= 2 && places < 3; --end) {  // all[end - 2, end) = last two
    if (all[end - 2] != all[n - 2] || all[end - 1] != all[n - 1]) continue;
    ++places;
    Index at = 0;  // walk down the tree, adding what is new
    for (std::size_t k = end; k < std::min(n, end + 5); ++k) {
      Index child = -1;
      for (Index t = 0; t < static_cast<Index>(d.tokens.size()); ++t) {
        if (d.parents[static_cast<std::size_t>(t)] == at &&
            d.tokens[static_cast<std::size_t>(t)] == all[k]) {
          child = t;
        }
      }
      if (child < 0) {
        d.tokens.push_back(all[k]);
        d.parents.push_back(at);
        child = static_cast<Index>(d.tokens.size()) - 1;
      }
      at = child;
    }
  }
  return d;
}

/// The greedy path through a verified draft: token 0 (known), then while a child of the last
/// token is the target's argmax after it. Returns the path; `next` becomes the target's token
/// after its end.
std::vector<Index> greedy_path(const Draft& d, const apex::RowMatrix<float>& logits, Index row0,
                               std::int64_t& next) {
  std::vector<Index> path{0};
  for (;;) {
    next = argmax(logits, row0 + path.back());
    Index child = -1;
    for (Index t = 0; t < static_cast<Index>(d.tokens.size()); ++t) {
      if (d.parents[static_cast<std::size_t>(t)] == path.back() &&
          d.tokens[static_cast<std::size_t>(t)] == next) {
        child = t;
      }
    }
    if (child < 0) return path;
    path.push_back(child);
  }
}

/// Prompts that repeat themselves a little, as text does.
std::vector<Tokens> prompts() {
  std::mt19937 rng(7);
  std::vector<Tokens> all;
  for (int s = 0; s < 4; ++s) {
    Tokens phrase;
    for (int t = 0; t < 6; ++t) phrase.push_back(std::int64_t(rng() % 512));
    Tokens p;
    for (int r = 0; r < 4; ++r) {
      p.insert(p.end(), phrase.begin(), phrase.end());
      p.push_back(std::int64_t(rng() % 512));
    }
    all.push_back(p);
  }
  return all;
}

/// Plain greedy decoding of every prompt: kNewTokens tokens each, one serve() step at a time.
std::vector<Tokens> plain(const apex::AttentionStack<float>& stack, const std::vector<Tokens>& p,
                          double& seconds) {
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{16, 256, 256});
  std::vector<apex::SequenceId> ids;
  for (std::size_t i = 0; i < p.size(); ++i) ids.push_back(cache.add());
  const Clock::time_point start = Clock::now();
  apex::RowMatrix<float> logits = stack.serve(ids, p, cache);
  std::vector<Tokens> out(p.size());
  for (Index step = 0; step < kNewTokens; ++step) {
    std::vector<Tokens> next;
    for (std::size_t i = 0; i < p.size(); ++i) {
      out[i].push_back(argmax(logits, Index(i)));
      next.push_back({out[i].back()});
    }
    if (step + 1 < kNewTokens) logits = stack.serve(ids, next, cache);
  }
  seconds = seconds_since(start);
  return out;
}

/// The same decoding, speculatively: each step verifies every sequence's prompt-lookup tree in
/// one pass and keeps its greedy path. Counts the steps.
std::vector<Tokens> speculative(const apex::AttentionStack<float>& stack,
                                const std::vector<Tokens>& p, double& seconds, Index& steps) {
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{16, 256, 256});
  std::vector<apex::SequenceId> ids;
  for (std::size_t i = 0; i < p.size(); ++i) ids.push_back(cache.add());
  const Clock::time_point start = Clock::now();
  const apex::RowMatrix<float> first = stack.serve(ids, p, cache);
  std::vector<Tokens> text = p, out(p.size());
  std::vector<std::int64_t> next;
  for (std::size_t i = 0; i < p.size(); ++i) next.push_back(argmax(first, Index(i)));
  steps = 0;
  while (out.front().size() < std::size_t(kNewTokens)) {
    std::vector<Draft> drafts;
    std::vector<Tokens> tokens;
    std::vector<apex::DraftTree> trees;
    for (std::size_t i = 0; i < p.size(); ++i) {
      drafts.push_back(prompt_lookup(text[i], next[i]));
      tokens.push_back(drafts.back().tokens);
      trees.emplace_back(drafts.back().parents);
    }
    const apex::RowMatrix<float> logits = stack.verify_drafts(ids, tokens, trees, cache);
    std::vector<std::vector<Index>> paths;
    Index row = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      paths.push_back(greedy_path(drafts[i], logits, row, next[i]));
      for (const Index t : paths.back()) {
        text[i].push_back(drafts[i].tokens[std::size_t(t)]);
        out[i].push_back(drafts[i].tokens[std::size_t(t)]);
      }
      row += Index(drafts[i].tokens.size());
    }
    stack.accept_drafts(ids, paths, cache);
    ++steps;
  }
  seconds = seconds_since(start);
  for (Tokens& o : out) o.resize(std::size_t(kNewTokens));
  return out;
}

}  // namespace

int main() {
  try {
    const auto stack = apex::AttentionStack<float>::random(config(), 11);
    const std::vector<Tokens> p = prompts();
    double plain_s = 0, spec_s = 0;
    Index steps = 0;
    const std::vector<Tokens> want = plain(stack, p, plain_s);
    const std::vector<Tokens> got = speculative(stack, p, spec_s, steps);
    const double produced = double(kNewTokens) * double(p.size());
    std::printf("4 sequences, %d new tokens each, greedy\n", int(kNewTokens));
    std::printf("  plain decoding:        %3d steps, %8.1f tokens/s\n", int(kNewTokens),
                produced / plain_s);
    std::printf(
        "  speculative decoding:  %3d steps, %8.1f tokens/s (%.2f tokens accepted per "
        "sequence and step)\n",
        int(steps), produced / spec_s, double(kNewTokens) / double(steps));
    std::printf("  speed-up: %.2fx\n", plain_s / spec_s);
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (got[i] != want[i]) {
        std::fprintf(stderr, "sequence %zu: the speculative tokens differ from plain decoding\n",
                     i);
        return 1;
      }
    }
    std::printf("the speculative tokens equal plain greedy decoding, token for token\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
