// SPDX-License-Identifier: MIT
// Continuous batching: a 6-layer APEX-1 stack (d = 512, random weights) serves 64 requests of
// random prompt and output lengths, at most 16 at a time, from one ServingCache (paged caches:
// each local layer holds a window's pages per sequence, each global layer the whole history).
// New requests are admitted as others finish, and their prompts go through the stack in the
// same pass as the decode steps of the running ones. Every fourth request continues a shared
// system prompt, prefilled once and forked (its pages are shared, not copied). Prints the
// tokens per second, the pages in use over time, and the speed-up over serving the requests one
// at a time (a StackCache each, prefill then decode steps), which it also checks gives every
// request the same logits.
#include <apex/apex.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Tokens = std::vector<std::int64_t>;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t argmax(const apex::RowMatrix<float>& logits, apex::Index row) {
  apex::Index best = 0;
  logits.row(row).maxCoeff(&best);
  return best;
}

apex::StackConfig config() {
  apex::StackConfig c;
  c.vocab_size = 1000;
  c.d_model = 512;
  c.num_layers = 6;  // layer 5 global (MLA), the others local (GQA with a window)
  c.window = 32;
  c.local = apex::GqaConfig{512, 8, 2, 64};
  c.global.d_model = 512;
  c.global.d_q = 256;
  c.global.d_kv = 128;
  c.global.num_q_heads = 8;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 64;
  c.global.rope_dim = 32;
  c.max_positions = 512;
  return c;
}

/// One request: its prompt (after the shared system prompt, when it continues it), how many
/// tokens it generates, and what serving it gave.
struct Request {
  bool shared = false;
  Tokens prompt;
  std::size_t outputs = 0;
  apex::SequenceId id;
  Tokens generated;
  std::vector<apex::RowMatrix<float>> logits;  // of the prompt's last token, then each output
};

std::vector<Request> make_requests(std::mt19937& rng) {
  std::vector<Request> requests(64);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    Request& q = requests[r];
    q.shared = r % 4 == 0;
    q.prompt.resize(std::uniform_int_distribution<std::size_t>(8, 48)(rng));
    for (auto& t : q.prompt) t = static_cast<std::int64_t>(rng() % 1000);
    q.outputs = std::uniform_int_distribution<std::size_t>(4, 24)(rng);
  }
  return requests;
}

/// Serves every request with continuous batching; returns the seconds it took.
double serve_all(const apex::AttentionStack<float>& stack, const Tokens& system,
                 std::vector<Request>& requests) {
  auto cache = stack.make_serving_cache(apex::ServingCacheShape{16, 16 * 8, 16 * 8 + 8});
  const auto start = Clock::now();
  const apex::SequenceId parent = cache.add();
  stack.serve({parent}, {system}, cache);  // the shared system prompt, once
  std::printf("  step  live  pages in use (shared system prompt: %lld pages)\n",
              static_cast<long long>(cache.pages_in_use()));
  std::size_t admitted = 0, finished = 0;
  for (int step = 0; finished < requests.size(); ++step) {
    std::vector<apex::SequenceId> ids;
    std::vector<Tokens> feed;
    std::vector<Request*> who;
    for (Request& q : requests) {  // the running requests: one token each
      if (q.id.value >= 0 && !q.generated.empty() && q.generated.size() < q.outputs) {
        ids.push_back(q.id);
        feed.push_back({q.generated.back()});
        who.push_back(&q);
      }
    }
    while (admitted < requests.size() && cache.sequences() - 1 < 16) {  // new requests
      Request& q = requests[admitted++];
      q.id = q.shared ? cache.fork(parent) : cache.add(8);
      ids.push_back(q.id);
      feed.push_back(q.prompt);
      who.push_back(&q);
    }
    const apex::RowMatrix<float> logits = stack.serve(ids, feed, cache);
    if (step % 20 == 0) {
      std::printf("  %4d  %4lld  %lld\n", step, static_cast<long long>(cache.sequences() - 1),
                  static_cast<long long>(cache.pages_in_use()));
    }
    for (std::size_t i = 0; i < who.size(); ++i) {
      Request& q = *who[i];
      q.logits.push_back(logits.row(static_cast<apex::Index>(i)));
      q.generated.push_back(argmax(logits, static_cast<apex::Index>(i)));
      if (q.generated.size() == q.outputs) {
        cache.free(q.id);
        ++finished;
      }
    }
  }
  cache.free(parent);
  std::printf("  done: %lld pages in use\n", static_cast<long long>(cache.pages_in_use()));
  return seconds_since(start);
}

/// Serves the requests one at a time (a StackCache each: prefill of the whole prompt, then a
/// decode step per output, fed the tokens the batched run generated); returns the seconds and
/// the largest relative difference from the batched run's logits.
std::pair<double, double> one_at_a_time(const apex::AttentionStack<float>& stack,
                                        const Tokens& system,
                                        const std::vector<Request>& requests) {
  double seconds = 0.0, worst = 0.0;
  for (const Request& q : requests) {
    Tokens text = q.shared ? system : Tokens{};
    text.insert(text.end(), q.prompt.begin(), q.prompt.end());
    const auto start = Clock::now();
    auto cache = stack.make_cache(1, static_cast<apex::Index>(text.size() + q.outputs));
    apex::DecodeOptions last;
    last.logits = apex::LogitRows::kLast;
    const Eigen::Map<const apex::TokenMatrix> prompt(text.data(), 1,
                                                     static_cast<apex::Index>(text.size()));
    std::vector<apex::RowMatrix<float>> logits{
        stack.prefill(prompt, q.shared ? 0 : 8, last, cache)};
    for (std::size_t t = 0; t + 1 < q.outputs; ++t) {
      logits.push_back(stack.decode_step({q.generated[t]}, cache));
    }
    seconds += seconds_since(start);
    for (std::size_t t = 0; t < logits.size(); ++t) {
      const float scale = std::max(1.0f, logits[t].cwiseAbs().maxCoeff());
      worst = std::max(worst, double((logits[t] - q.logits[t]).cwiseAbs().maxCoeff() / scale));
    }
  }
  return {seconds, worst};
}

int run() {
  const auto stack = apex::AttentionStack<float>::random(config(), 2026);
  std::mt19937 rng(5);
  Tokens system(32);
  for (auto& t : system) t = static_cast<std::int64_t>(rng() % 1000);
  std::vector<Request> requests = make_requests(rng);
  std::size_t tokens = system.size();
  for (const Request& q : requests) tokens += q.prompt.size() + q.outputs;
  std::printf(
      "Serving 64 requests (prompts 8-48 tokens, 4-24 outputs; every fourth continues a\n"
      "32-token system prompt) with a 6-layer stack, d = 512, at most 16 at a time:\n");
  const double batched = serve_all(stack, system, requests);
  const auto [alone, worst] = one_at_a_time(stack, system, requests);
  std::size_t alone_tokens = 0;
  for (const Request& q : requests) {
    alone_tokens += (q.shared ? system.size() : 0) + q.prompt.size() + q.outputs;
  }
  std::printf("Continuous batching: %zu tokens in %.2f s, %.0f tokens/s\n", tokens, batched,
              static_cast<double>(tokens) / batched);
  std::printf("One at a time:       %zu tokens in %.2f s, %.0f tokens/s\n", alone_tokens, alone,
              static_cast<double>(alone_tokens) / alone);
  std::printf("Speed-up: %.1fx (requests served per second)\n", alone / batched);
  std::printf("Largest relative logit difference from serving each request alone: %.2e\n", worst);
  return worst < 1e-4 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
