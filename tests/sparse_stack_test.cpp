// SPDX-License-Identifier: MIT
// An AttentionStack whose global layers are sparse (StackConfig::indexer, DeepSeek Sparse
// Attention): its forward pass against the stack's blocks composed by hand (each global layer
// MLA's forward pass under the dense mask of its indexer's selection, the bidirectional prefix
// included), equal to the dense stack when k covers every key, prefill / extend / decode_step
// equal to forward, reserve, the cache memory of the indexer keys in every format, weights
// converted with their indexers, bit-identical results for any number of threads, and bad
// input rejected with nothing changed; serve() over paged caches against each sequence alone,
// and speculative verification and acceptance against each text alone.
#include <apex/kv_quant.hpp>
#include <apex/stack.hpp>
#include <apex/stack_training.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "draft_paths.hpp"
#include "reference/indexer.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace sparse_stack_test {
namespace {

using apex::Index;
using apex::KeySelection;
using apex::RowMatrix;
using apex::testing::expect_invalid;
using apex::testing::normwise;
using apex::testing::Tolerances;

/// Layers 0, 1 local, 2 global (sparse), 3, 4 local, 5 global (sparse): k = top_k of S <= 24.
apex::StackConfig sparse_config(Index top_k) {
  apex::StackConfig c;
  c.vocab_size = 40;
  c.d_model = 24;
  c.num_layers = 6;
  c.window = 4;
  c.global_every = 3;
  c.local = apex::GqaConfig{24, 4, 2, 6};
  c.global.d_model = 24;
  c.global.d_q = 12;
  c.global.d_kv = 8;
  c.global.num_q_heads = 4;
  c.global.num_kv_heads = 2;
  c.global.head_dim = 6;
  c.global.rope_dim = 4;
  c.max_positions = 32;
  c.indexer = apex::IndexerConfig{24, 12, 3, 8, 4, top_k};
  return c;
}

apex::TokenMatrix tokens(Index batch, Index seq) {
  apex::TokenMatrix t(batch, seq);
  for (Index b = 0; b < batch; ++b) {
    for (Index s = 0; s < seq; ++s) t(b, s) = (11 * b + 7 * s + 5) % 40;
  }
  return t;
}

/// The same stack with dense global layers: its layers, table and γ, no indexers.
template <class Scalar>
apex::AttentionStack<Scalar> dense_twin(const apex::AttentionStack<Scalar>& sparse) {
  apex::StackConfig c = sparse.config();
  c.indexer.reset();
  std::vector<apex::Vector<Scalar>> gammas;
  std::vector<typename apex::AttentionStack<Scalar>::Layer> layers;
  for (Index l = 0; l < c.num_layers; ++l) {
    gammas.push_back(sparse.norm_gamma(l));
    layers.push_back(sparse.layer(l));
  }
  return apex::AttentionStack<Scalar>(c, sparse.embedding(), std::move(gammas),
                                      sparse.final_gamma(), std::move(layers));
}

/// Global layer l of a sparse stack composed by hand over whole sequences: the indexer's
/// selection (from its own queries, keys and weights, the prefix seen whole), then MLA's forward
/// pass (the naive, decompressing path) under the dense mask that allows the selected keys only.
template <class Scalar>
RowMatrix<Scalar> composed_sparse_layer(const apex::AttentionStack<Scalar>& stack, Index l,
                                        const RowMatrix<Scalar>& normed, Index batch,
                                        Index prefix) {
  const auto& mla = std::get<typename apex::AttentionStack<Scalar>::Mla>(stack.layer(l));
  const auto& indexer = stack.indexer(l);
  const apex::AttentionLayerParams<Scalar> params = stack.block_params(l);
  const Index seq = normed.rows() / batch;
  auto keys = indexer.make_cache(batch, seq);
  keys.append(indexer.keys(normed, batch, *params.rope, 0), 0);
  const RowMatrix<Scalar> c_q = normed * mla.weights().w_dq;
  const KeySelection selected =
      indexer.select(indexer.queries(c_q, batch, *params.rope, 0), indexer.head_weights(normed),
                     keys.keys(), 0, prefix);
  const std::vector<char> allowed = apex::reference::selection_mask(selected, batch, seq);
  apex::AttentionMask<Scalar> mask;
  mask.allowed = apex::HeadsView<const bool>::contiguous(
      reinterpret_cast<const bool*>(allowed.data()), {batch, 1, seq, seq});
  return mla.forward(normed, batch, mask, params);
}

template <class Scalar>
class SparseStack : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SparseStack, Scalars, apex::testing::ScalarName);

// forward() against the blocks composed by hand: local layers as the stack runs them, each
// global layer MLA under the mask of its indexer's top k, with and without a prefix.
TYPED_TEST(SparseStack, ForwardEqualsTheComposedLayers) {
  using Scalar = TypeParam;
  const auto stack = apex::AttentionStack<Scalar>::random(sparse_config(5), 3);
  const Index batch = 2, seq = 20;
  const apex::TokenMatrix t = tokens(batch, seq);
  for (const Index prefix : {Index{0}, Index{7}}) {
    SCOPED_TRACE("prefix " + std::to_string(prefix));
    RowMatrix<Scalar> x = stack.embed_tokens(t);
    stack.run_blocks(x, [&](Index l, const auto& layer, const RowMatrix<Scalar>& normed,
                            RowMatrix<Scalar>& attended) {
      if (apex::is_global_layer(l, stack.config().global_every)) {
        attended = composed_sparse_layer(stack, l, normed, batch, prefix);
      } else {
        const auto& gqa = std::get<typename apex::AttentionStack<Scalar>::Gqa>(layer);
        attended =
            gqa.forward(normed, batch, stack.mask_for_layer(l, prefix), stack.block_params(l));
      }
    });
    EXPECT_LE(normwise(stack.forward(t, prefix), stack.output_logits(x)),
              Tolerances<Scalar>::kAbsorbedMla);
  }
}

// With k at least the sequence every key is selected: the dense stack's results.
TYPED_TEST(SparseStack, EveryKeySelectedIsTheDenseStack) {
  using Scalar = TypeParam;
  const auto sparse = apex::AttentionStack<Scalar>::random(sparse_config(64), 4);
  const auto dense = dense_twin(sparse);
  const apex::TokenMatrix t = tokens(2, 18);
  EXPECT_LE(normwise(sparse.forward(t, 5), dense.forward(t, 5)), Tolerances<Scalar>::kAbsorbedMla);
  auto sparse_cache = sparse.make_cache(2, 24);
  auto dense_cache = dense.make_cache(2, 24);
  EXPECT_LE(normwise(sparse.prefill(t.leftCols(10), 5, sparse_cache),
                     dense.prefill(t.leftCols(10), 5, dense_cache)),
            Tolerances<Scalar>::kAbsorbedMla);
  for (Index s = 10; s < 18; ++s) {
    const std::vector<std::int64_t> next{t(0, s), t(1, s)};
    EXPECT_LE(
        normwise(sparse.decode_step(next, sparse_cache), dense.decode_step(next, dense_cache)),
        Tolerances<Scalar>::kAbsorbedMla);
  }
}

// prefill, extend and decode_step (k < S) give the rows of forward(); a reserve() between them
// keeps the indexer keys.
TYPED_TEST(SparseStack, CachedCallsMatchForward) {
  using Scalar = TypeParam;
  const auto stack = apex::AttentionStack<Scalar>::random(sparse_config(4), 5);
  const Index batch = 2, seq = 24, prefix = 6;
  const apex::TokenMatrix t = tokens(batch, seq);
  const RowMatrix<Scalar> full = stack.forward(t, prefix);
  auto rows = [&](Index first, Index n) {
    RowMatrix<Scalar> r(batch * n, full.cols());
    for (Index b = 0; b < batch; ++b) r.middleRows(b * n, n) = full.middleRows(b * seq + first, n);
    return r;
  };
  auto cache = stack.make_cache(batch, 12);
  EXPECT_LE(normwise(stack.prefill(t.leftCols(8), prefix, cache), rows(0, 8)),
            Tolerances<Scalar>::kDecode);
  EXPECT_LE(normwise(stack.extend(t.middleCols(8, 4), cache), rows(8, 4)),
            Tolerances<Scalar>::kDecode);
  cache.reserve(seq);
  EXPECT_EQ(cache.indexer_keys(2).capacity(), seq);
  EXPECT_EQ(cache.indexer_keys(2).size(), 12);
  for (Index s = 12; s < seq; ++s) {
    const std::vector<std::int64_t> next{t(0, s), t(1, s)};
    EXPECT_LE(normwise(stack.decode_step(next, cache), rows(s, 1)), Tolerances<Scalar>::kDecode);
  }
  EXPECT_EQ(cache.bytes(), stack.cache_memory(batch, seq).total_bytes);
}

// The indexer keys in the cache memory: bytes() equals the plan in every format, and each token
// of a sparse global layer costs d_I values (in the latent rows' format, or fp8 blocks of 128
// beside FlashMLA's whole latent rows) on top of its latent row.
TEST(SparseStack, CacheMemoryCountsTheIndexerKeys) {
  apex::StackConfig c = sparse_config(4);
  c.global.d_kv = 128;        // FlashMLA's rows hold c_kv in blocks of 128
  c.indexer->head_dim = 128;  // whole blocks of q8_0 and of fp8 blocks of 128
  const auto stack = apex::AttentionStack<float>::random(c, 6);
  apex::StackConfig dense_config = c;
  dense_config.indexer.reset();
  const auto f32 = stack.make_cache(3, 20);
  EXPECT_EQ(f32.bytes(), stack.cache_memory(3, 20).total_bytes);
  EXPECT_EQ(f32.bytes(), apex::stack_cache_memory(c, 3, 20, 4).total_bytes);
  const auto plan = apex::stack_cache_memory(c, 3, 20, 4);
  EXPECT_EQ(plan.indexer_bytes_per_token, 128 * 4);
  EXPECT_EQ(plan.global_bytes_per_token,
            apex::stack_cache_memory(dense_config, 3, 20, 4).global_bytes_per_token + 128 * 4);
  EXPECT_EQ(f32.indexer_keys(5).bytes(), 3 * 20 * 128 * 4);
  EXPECT_EQ(f32.indexer_keys(0).bytes(), 0);  // a local layer holds none
  const auto bf16 = stack.make_cache<Eigen::bfloat16>(3, 20);
  EXPECT_EQ(bf16.bytes(), stack.cache_memory<Eigen::bfloat16>(3, 20).total_bytes);
  EXPECT_EQ(apex::stack_cache_memory<Eigen::bfloat16>(c, 3, 20).indexer_bytes_per_token, 256);
  using Fp8Rows = apex::FlashMlaFp8Row<128, 8>;  // c_kv, then H_kr·d_r = 2·4 of K_rope
  static_assert(std::is_same_v<apex::indexer_key_format_t<Fp8Rows>, apex::BlockFp8E4m3<128>>);
  const auto quantized = stack.make_cache<Eigen::bfloat16, Fp8Rows>(3, 20);
  const auto q_plan = stack.cache_memory<Eigen::bfloat16, Fp8Rows>(3, 20);
  EXPECT_EQ(quantized.bytes(), q_plan.total_bytes);
  EXPECT_EQ(q_plan.indexer_bytes_per_token, 128 + 4);  // 128 codes and one float scale
  for (const auto& row : stack.plan()) {
    const std::int64_t values = row.global ? 128 + 2 * 4 + 128 : 2 * 2 * 6;
    EXPECT_EQ(row.cache_values_per_token, values);
  }
}

// with_weights converts the indexers too (each weight rounded once to bfloat16, and widened
// back exactly), and weight_bytes counts them.
TEST(SparseStack, ConvertedWeightsIncludeTheIndexers) {
  const auto stack = apex::AttentionStack<float>::random(sparse_config(5), 7);
  const auto bf16 = stack.with_weights<Eigen::bfloat16>();
  const auto rounded = bf16.with_weights<float>();
  for (const Index l : {Index{2}, Index{5}}) {
    const auto& from = stack.indexer(l).weights();
    const auto& to = rounded.indexer(l).weights();
    EXPECT_EQ(to.w_q, apex::converted<Eigen::bfloat16>(from.w_q).cast<float>());
    EXPECT_EQ(to.w_k, apex::converted<Eigen::bfloat16>(from.w_k).cast<float>());
    EXPECT_EQ(to.w_w, apex::converted<Eigen::bfloat16>(from.w_w).cast<float>());
    EXPECT_EQ(to.k_norm_gamma, apex::converted<Eigen::bfloat16>(from.k_norm_gamma).cast<float>());
    EXPECT_EQ(to.k_norm_beta, apex::converted<Eigen::bfloat16>(from.k_norm_beta).cast<float>());
  }
  const auto dense = dense_twin(stack);
  std::int64_t indexers = 0;
  for (const Index l : {Index{2}, Index{5}}) indexers += stack.indexer(l).weight_bytes();
  EXPECT_EQ(stack.weight_bytes(), dense.weight_bytes() + indexers);
  EXPECT_EQ(bf16.indexer(2).weight_bytes() * 2, stack.indexer(2).weight_bytes());
}

// The same logits, bit for bit, for one thread and for two.
TEST(SparseStack, BitIdenticalForAnyNumberOfThreads) {
  const auto stack = apex::AttentionStack<float>::random(sparse_config(5), 8);
  const apex::TokenMatrix t = tokens(2, 24);
  RowMatrix<float> one;
  {
    const apex::testing::OneThread threads;
    one = stack.forward(t, 3);
  }
  EXPECT_EQ(stack.forward(t, 3), one);
}

// serve() over paged caches: each sequence's logits are those of the cached calls on that
// sequence alone (a prompt with a prefix, its fork, and a prompt joining later, mixed with
// decoding tokens in one call); the pools hold the indexer keys.
TEST(SparseStack, ServeEqualsEachSequenceAlone) {
  const auto stack = apex::AttentionStack<double>::random(sparse_config(4), 10);
  const auto dense = dense_twin(stack);
  const apex::ServingCacheShape shape{4, 16, 16};
  auto serving = stack.make_serving_cache(shape);
  EXPECT_EQ(serving.bytes(), dense.make_serving_cache(shape).bytes() +
                                 2 * 16 * 4 * 8 * Index(sizeof(double)));  // 2 key pools
  const apex::TokenMatrix t = tokens(3, 16);
  auto row = [&](Index b, Index from, Index n) {
    return std::vector<std::int64_t>(t.row(b).data() + from, t.row(b).data() + from + n);
  };
  const apex::SequenceId a = serving.add(3);
  RowMatrix<double> got = stack.serve({a}, {row(0, 0, 9)}, serving);
  const apex::SequenceId b = serving.fork(a);
  std::vector<RowMatrix<double>> logits_a{got}, logits_b, logits_c;
  const apex::SequenceId c = serving.add(0);
  got = stack.serve({a, b, c}, {row(0, 9, 1), row(1, 9, 1), row(2, 0, 6)}, serving);
  logits_a.push_back(got.row(0));
  logits_b.push_back(got.row(1));
  logits_c.push_back(got.row(2));
  for (Index s = 10; s < 14; ++s) {
    got = stack.serve({c, a, b}, {row(2, s - 4, 1), row(0, s, 1), row(1, s, 1)}, serving);
    logits_c.push_back(got.row(0));
    logits_a.push_back(got.row(1));
    logits_b.push_back(got.row(2));
  }
  EXPECT_GT(serving.pages_in_use(), 0);
  // Each sequence alone: its prompt (b's is a's 9 tokens), then one token at a time.
  const auto alone = [&](Index seq, Index prompt, Index prefix, Index steps) {
    auto cache = stack.make_cache(1, 16);
    apex::TokenMatrix p(1, prompt);
    for (Index i = 0; i < prompt; ++i) p(0, i) = seq == 1 ? t(0, i) : t(seq, i);
    std::vector<RowMatrix<double>> out{
        stack.prefill(p, prefix, apex::DecodeOptions{apex::LogitRows::kLast}, cache)};
    for (Index s = prompt; s < prompt + steps; ++s) {
      out.push_back(stack.decode_step({t(seq, s)}, cache));
    }
    return out;
  };
  const auto want_a = alone(0, 9, 3, 5);
  const auto want_c = alone(2, 6, 0, 4);
  auto want_b = alone(1, 9, 3, 5);
  want_b.erase(want_b.begin());  // b's first logits are a's prompt's
  const auto expect_steps = [](const std::vector<RowMatrix<double>>& got_steps,
                               const std::vector<RowMatrix<double>>& want, const char* name) {
    ASSERT_EQ(got_steps.size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(normwise(got_steps[i], want[i]), Tolerances<double>::kDecode)
          << name << ", step " << i;
    }
  };
  expect_steps(logits_a, want_a, "a");
  expect_steps(logits_b, want_b, "b");
  expect_steps(logits_c, want_c, "c");
  EXPECT_EQ(serving.indexer_keys(2).length(c), 10);
  serving.free(b);
  EXPECT_FALSE(serving.indexer_keys(5).contains(b));
}

// Speculative decoding with sparse global layers, k = 4 below every context: rounds of random
// draft trees for two sequences (one with a prefix) verified in one pass, and in the second
// round a fork of the first, made while it verifies, accepting a path of its own. Every draft
// token's logits equal those of its text (committed ‖ its path) prefilled alone: its indexer ranks
// the same keys, each rotated at its position in the text, its siblings left out. After accept, the
// next token's logits equal the text run alone: the accepted latent rows and indexer keys are the
// text's. No page leaks.
TEST(SparseStack, VerifiedDraftsAndAcceptedPathsEqualEachTextAlone) {
  using Tokens = std::vector<std::int64_t>;
  std::mt19937 rng(21);
  const auto stack = apex::AttentionStack<double>::random(sparse_config(4), 12);
  auto serving = stack.make_serving_cache(apex::ServingCacheShape{4, 64, 64});
  const std::vector<Index> prefixes{0, 3};
  apex::testing::SpeculativeTexts seqs;
  seqs.texts = {{5, 9, 2, 33, 7, 1, 18, 4}, {3, 14, 15, 9, 26, 5, 35, 8, 9, 7}};
  for (std::size_t i = 0; i < seqs.texts.size(); ++i) {
    seqs.ids.push_back(serving.add(prefixes[i]));
    seqs.origin.push_back(i);
    (void)stack.serve({seqs.ids.back()}, {seqs.texts[i]}, serving);
  }
  const auto expect_alone = [&](std::size_t p, const Tokens& text, const auto& got,
                                const std::string& what) {
    auto cache = stack.make_cache(1, stack.config().max_positions);
    const Eigen::Map<const apex::TokenMatrix> all(text.data(), 1, Index(text.size()));
    const RowMatrix<double> want =
        stack.prefill(all, prefixes[p], apex::DecodeOptions{apex::LogitRows::kLast}, cache);
    EXPECT_LE(normwise(RowMatrix<double>(got), want), Tolerances<double>::kDecode) << what;
  };
  apex::testing::speculative_rounds(stack, serving, seqs, 3, 6, rng, expect_alone);
  for (const apex::SequenceId id : seqs.ids) {
    EXPECT_EQ(serving.indexer_keys(2).length(id), serving.length(id));
    EXPECT_EQ(serving.indexer_keys(5).length(id), serving.length(id));
    serving.free(id);
  }
  EXPECT_EQ(serving.pages_in_use(), 0);
}

// Bad configs, indexers and calls: clear errors, and a failed call changes no cache.
TEST(SparseStack, BadInputIsRejectedAndChangesNothing) {
  apex::StackConfig bad = sparse_config(4);
  bad.indexer->d_q = 10;
  expect_invalid([&] { (void)apex::AttentionStack<float>::random(bad, 1); },
                 {"[stack] indexer d_model (24), d_q (10) and rope_dim (4) must equal the MLA "
                  "layer's (24, 12, 4)"});
  bad = sparse_config(0);
  expect_invalid([&] { (void)apex::AttentionStack<float>::random(bad, 1); },
                 {"[indexer] top_k (0) must be >= 1"});
  const auto stack = apex::AttentionStack<float>::random(sparse_config(4), 9);
  const auto dense = dense_twin(stack);
  expect_invalid([&] { (void)stack.indexer(1); }, {"[stack] layer 1 has no indexer"});
  expect_invalid([&] { (void)dense.indexer(2); }, {"[stack] layer 2 has no indexer"});
  std::vector<apex::Vector<float>> gammas(6, apex::Vector<float>::Ones(24));
  std::vector<apex::AttentionStack<float>::Layer> layers;
  std::vector<apex::AttentionStack<float>::Indexer> indexers;
  for (Index l = 0; l < 6; ++l) {
    layers.push_back(stack.layer(l));
    indexers.push_back(l == 2 || l == 5 ? stack.indexer(l)
                                        : apex::AttentionStack<float>::Indexer{});
  }
  expect_invalid(
      [&] {
        (void)apex::AttentionStack<float>(dense.config(), stack.embedding(), gammas,
                                          stack.final_gamma(), layers, indexers);
      },
      {"[stack] indexers must be empty unless config.indexer is set (6 given)"});
  std::swap(indexers[1], indexers[2]);
  expect_invalid(
      [&] {
        (void)apex::AttentionStack<float>(stack.config(), stack.embedding(), gammas,
                                          stack.final_gamma(), layers, indexers);
      },
      {"[stack] indexers[1] must be empty (a local layer has no indexer)"});
  indexers.pop_back();
  expect_invalid(
      [&] {
        (void)apex::AttentionStack<float>(stack.config(), stack.embedding(), gammas,
                                          stack.final_gamma(), layers, indexers);
      },
      {"[stack] indexers holds 5 entries; expected one per layer (6)"});
  // A dense stack's serving cache, and paths that run dense global layers only.
  auto serving = stack.make_serving_cache(apex::ServingCacheShape{4, 8, 8});
  const apex::SequenceId id = serving.add();
  auto dense_serving = dense.make_serving_cache(apex::ServingCacheShape{4, 8, 8});
  const apex::SequenceId other_id = dense_serving.add();
  expect_invalid(
      [&] {
        (void)stack.serve({other_id}, {{1, 2}}, dense_serving);
      },
      {"[serve] the serving cache was not made by this stack's make_serving_cache"});
  expect_invalid([&] { (void)stack.serve({id}, {std::vector<std::int64_t>(40, 1)}, serving); },
                 {"[serve]"});
  EXPECT_EQ(serving.length(id), 0);
  EXPECT_EQ(serving.indexer_keys(2).length(id), 0);
  apex::StackActivations<float> saved;
  expect_invalid([&] { (void)apex::stack_forward(stack, tokens(1, 4), 0, saved); },
                 {"[stack_forward] takes a stack with dense global layers"});
  // A failed cached call leaves every layer's cache, the indexer keys included, as it was.
  auto cache = stack.make_cache(2, 16);
  (void)stack.prefill(tokens(2, 5), 2, cache);
  const apex::TokenMatrix out_of_vocabulary = apex::TokenMatrix::Constant(2, 1, 40);
  expect_invalid([&] { (void)stack.extend(out_of_vocabulary, cache); }, {"40"});
  expect_invalid([&] { (void)stack.extend(tokens(2, 12), cache); }, {"capacity (16)"});
  EXPECT_EQ(cache.next_position(), 5);
  EXPECT_EQ(cache.indexer_keys(2).size(), 5);
  EXPECT_EQ(cache.indexer_keys(5).size(), 5);
  auto other = dense.make_cache(2, 16);
  expect_invalid([&] { (void)stack.prefill(tokens(2, 4), 0, other); },
                 {"[stack] the cache was not made by this stack's make_cache"});
}

}  // namespace
}  // namespace sparse_stack_test
