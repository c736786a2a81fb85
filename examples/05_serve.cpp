// SPDX-License-Identifier: MIT
// Continuous batching: a 6-layer APEX-1 stack (d = 512, random weights) serves 64 requests of
// random prompt and output lengths, at most 16 at a time, from one ServingCache (paged caches:
// each local layer holds a window's pages per sequence, each global layer the whole history).
// New requests are admitted as others finish, and their prompts go through the stack in the
// same pass as the decode steps of the running ones. Every fourth request continues a shared
// system prompt, prefilled once and forked (its pages are shared, not copied). Prints the
// tokens per second, the pages in use over time, and the speed-up over serving the requests one
// at a time (a StackCache each, prefill then decode steps), which it also checks gives every
// request the same logits. Then serves the first 8 requests again, fed the same tokens, with the
// paged caches in float, half, bfloat16, q8_0, q4_0 and fp8 e4m3, and prints for each format the
// tokens per second, the pools' bytes and the most bytes in use, and the largest logit
// difference from the float run, which it checks is within the bound the tests hold the stack's
// logits to for that format.
#include <apex/apex.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <utility>
#include <variant>
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
/// tokens it generates, and what serving it gave. Tokens already in `generated` when it is
/// served are fed as they are (a replay of another run, so that both runs see the same text);
/// the others are chosen greedily.
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

/// Pages in use after a step of serve_all, summed over the layers.
struct PagesAt {
  int step = 0;
  apex::Index live = 0;  ///< requests being served
  apex::Index pages = 0;
};

/// What serving a list of requests took.
struct ServedRun {
  double seconds = 0.0;
  std::int64_t pool_bytes = 0;   ///< every layer's pool, allocated whatever is in use
  std::int64_t peak_bytes = 0;   ///< the most bytes of pages in use at once
  apex::Index system_pages = 0;  ///< pages of the shared system prompt
  apex::Index final_pages = 0;   ///< pages in use once every request is freed
  std::vector<PagesAt> pages;    ///< every 20th step
};

/// Bytes of the pages in use, summed over the layers (a layer's pages are all of one size).
template <class Storage>
std::int64_t bytes_in_use(const apex::ServingCache<float, Storage>& cache) {
  std::int64_t total = 0;
  for (apex::Index l = 0; l < cache.num_layers(); ++l) {
    total += std::visit([](const auto& c) { return c.bytes() / c.num_pages() * c.pages_in_use(); },
                        cache.layer(l));
  }
  return total;
}

/// Serves every request with continuous batching from a ServingCache storing Storage.
template <class Storage>
ServedRun serve_all(const apex::AttentionStack<float>& stack, const Tokens& system,
                    std::vector<Request>& requests) {
  auto cache = stack.make_serving_cache<Storage>(apex::ServingCacheShape{16, 16 * 8, 16 * 8 + 8});
  ServedRun run;
  const auto start = Clock::now();
  const apex::SequenceId parent = cache.add();
  stack.serve({parent}, {system}, cache);  // the shared system prompt, once
  run.system_pages = cache.pages_in_use();
  std::size_t admitted = 0, finished = 0;
  for (int step = 0; finished < requests.size(); ++step) {
    std::vector<apex::SequenceId> ids;
    std::vector<Tokens> feed;
    std::vector<Request*> who;
    for (Request& q : requests) {  // the running requests: one token each
      if (q.id.value >= 0 && !q.logits.empty() && q.logits.size() < q.outputs) {
        ids.push_back(q.id);
        feed.push_back({q.generated[q.logits.size() - 1]});
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
    if (step % 20 == 0) run.pages.push_back({step, cache.sequences() - 1, cache.pages_in_use()});
    run.peak_bytes = std::max(run.peak_bytes, bytes_in_use(cache));
    for (std::size_t i = 0; i < who.size(); ++i) {
      Request& q = *who[i];
      q.logits.push_back(logits.row(static_cast<apex::Index>(i)));
      if (q.generated.size() < q.logits.size()) {
        q.generated.push_back(argmax(logits, static_cast<apex::Index>(i)));
      }
      if (q.logits.size() == q.outputs) {
        cache.free(q.id);
        ++finished;
      }
    }
  }
  cache.free(parent);
  run.seconds = seconds_since(start);
  run.final_pages = cache.pages_in_use();
  run.pool_bytes = cache.bytes();
  return run;
}

/// The largest difference of a row of logits from the same row of `reference`, relative to that
/// row's largest logit (as docs/guide.md measures the stack's accuracy), over every row; NaN if
/// any row holds one.
double worst_difference(const std::vector<apex::RowMatrix<float>>& logits,
                        const std::vector<apex::RowMatrix<float>>& reference, double worst) {
  for (std::size_t t = 0; t < logits.size(); ++t) {
    const double difference =
        (logits[t] - reference[t]).cwiseAbs().maxCoeff<Eigen::PropagateNaN>() /
        reference[t].cwiseAbs().maxCoeff<Eigen::PropagateNaN>();
    worst = std::isnan(difference) ? difference : std::max(worst, difference);  // max drops NaN
  }
  return worst;
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
    worst = worst_difference(logits, q.logits, worst);
  }
  return {seconds, worst};
}

/// Tokens that serving `requests` feeds: the system prompt once, each prompt and each output.
std::size_t tokens_of(const Tokens& system, const std::vector<Request>& requests) {
  std::size_t tokens = system.size();
  for (const Request& q : requests) tokens += q.prompt.size() + q.outputs;
  return tokens;
}

/// Serves `served` again from a ServingCache storing Storage, fed the tokens the float run
/// generated, prints its row of the comparison, and returns whether its largest relative logit
/// difference from the float run is finite and at most `bound`.
template <class Storage>
bool compare_format(const char* name, double bound, const apex::AttentionStack<float>& stack,
                    const Tokens& system, const std::vector<Request>& served) {
  std::vector<Request> replay = served;
  for (Request& q : replay) {
    q.id = apex::SequenceId{};
    q.logits.clear();
  }
  const ServedRun run = serve_all<Storage>(stack, system, replay);
  double worst = 0.0;
  for (std::size_t r = 0; r < replay.size(); ++r) {
    worst = worst_difference(replay[r].logits, served[r].logits, worst);
  }
  std::printf("  %-9s %9.0f %10.1f %11.1f %26.2e\n", name,
              static_cast<double>(tokens_of(system, replay)) / run.seconds,
              static_cast<double>(run.pool_bytes) / 1024.0,
              static_cast<double>(run.peak_bytes) / 1024.0, worst);
  return std::isfinite(worst) && worst <= bound;
}

/// Serves the first `count` requests in each cache format, fed the float run's tokens, and
/// returns whether every format stayed within its bound. A few requests are enough to compare
/// formats that all see the same text, and keep the example short (it is a ctest test). The
/// bounds are those the tests hold the stack's logits to over 1000 decoded tokens, twice what
/// they measured (docs/guide.md, the accuracy tables): Stack.* for 16-bit caches, StackQuant.*
/// for the blocks. The float row differs from the float run only in how the requests were
/// batched, as the one-at-a-time run does, and is held to the same 1e-4.
bool compare_formats(const apex::AttentionStack<float>& stack, const Tokens& system,
                     const std::vector<Request>& requests, std::size_t count) {
  const std::vector<Request> first(requests.begin(),
                                   requests.begin() + static_cast<std::ptrdiff_t>(count));
  std::printf(
      "\nThe first %zu requests (%zu tokens) again, with the paged caches in each format, fed\n"
      "the tokens generated above (fp8 in blocks of 32: d_r = 32 is one block):\n",
      count, tokens_of(system, first));
  std::printf("  %-9s %9s %10s %11s %26s\n", "caches", "tokens/s", "pool KiB", "peak KiB",
              "largest logit difference");
  bool ok = compare_format<float>("float", 1e-4, stack, system, first);
  ok = compare_format<Eigen::half>("half", 1.4e-3, stack, system, first) && ok;
  ok = compare_format<Eigen::bfloat16>("bfloat16", 1.6e-2, stack, system, first) && ok;
  ok = compare_format<apex::BlockQ8_0>("q8_0", 2.6e-2, stack, system, first) && ok;
  ok = compare_format<apex::BlockQ4_0>("q4_0", 4.2e-1, stack, system, first) && ok;
  return compare_format<apex::BlockFp8E4m3<32>>("fp8 e4m3", 1.3e-1, stack, system, first) && ok;
}

int run() {
  const auto stack = apex::AttentionStack<float>::random(config(), 2026);
  std::mt19937 rng(5);
  Tokens system(32);
  for (auto& t : system) t = static_cast<std::int64_t>(rng() % 1000);
  std::vector<Request> requests = make_requests(rng);
  const std::size_t tokens = tokens_of(system, requests);
  std::printf(
      "Serving 64 requests (prompts 8-48 tokens, 4-24 outputs; every fourth continues a\n"
      "32-token system prompt) with a 6-layer stack, d = 512, at most 16 at a time:\n");
  const ServedRun batched = serve_all<float>(stack, system, requests);
  std::printf("  step  live  pages in use (shared system prompt: %lld pages)\n",
              static_cast<long long>(batched.system_pages));
  for (const PagesAt& p : batched.pages) {
    std::printf("  %4d  %4lld  %lld\n", p.step, static_cast<long long>(p.live),
                static_cast<long long>(p.pages));
  }
  std::printf("  done: %lld pages in use\n", static_cast<long long>(batched.final_pages));
  const auto [alone, worst] = one_at_a_time(stack, system, requests);
  std::size_t alone_tokens = 0;
  for (const Request& q : requests) {
    alone_tokens += (q.shared ? system.size() : 0) + q.prompt.size() + q.outputs;
  }
  std::printf("Continuous batching: %zu tokens in %.2f s, %.0f tokens/s\n", tokens, batched.seconds,
              static_cast<double>(tokens) / batched.seconds);
  std::printf("One at a time:       %zu tokens in %.2f s, %.0f tokens/s\n", alone_tokens, alone,
              static_cast<double>(alone_tokens) / alone);
  std::printf("Speed-up: %.1fx (requests served per second)\n", alone / batched.seconds);
  std::printf("Largest relative logit difference from serving each request alone: %.2e\n", worst);
  const bool formats_ok = compare_formats(stack, system, requests, 8);
  return worst < 1e-4 && formats_ok ? 0 : 1;
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
