// SPDX-License-Identifier: MIT
// apex::SparseLatentAttention (sparse_mla.hpp), DeepSeek Sparse Attention: a prompt's output
// equals MLA's forward pass under the dense mask that allows each query its selected keys only
// (the naive path against the absorbed one); with k at least the visible count it is absorbed
// MLA itself (bit for bit when decoding); decoding 1000 tokens equals one sparse forward pass;
// bit-identical for any number of threads; bad input changes nothing.
#include <apex/indexer.hpp>
#include <apex/mla.hpp>
#include <apex/page_pool.hpp>
#include <apex/rope.hpp>
#include <apex/sparse_mla.hpp>
#include <apex/tree_mask.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "reference/indexer.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace sparse_mla_test {
namespace {

using apex::Index;
using apex::KeySelection;
using apex::RowMatrix;
using apex::testing::expect_invalid;
using apex::testing::normwise;
using apex::testing::Tolerances;

apex::MlaConfig mla_config() {
  apex::MlaConfig c;
  c.d_model = 32;
  c.d_q = 24;
  c.d_kv = 16;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rope_dim = 4;
  c.num_rope_key_heads = 1;
  return c;
}

apex::IndexerConfig indexer_config(Index top_k) {
  apex::IndexerConfig c;
  c.d_model = 32;
  c.d_q = 24;
  c.heads = 3;
  c.head_dim = 16;
  c.rope_dim = 4;
  c.top_k = top_k;
  return c;
}

template <class Scalar>
apex::SparseLatentAttention<Scalar> sparse_layer(Index top_k, std::uint64_t seed = 1) {
  apex::MlaConfig c = mla_config();
  auto mla = apex::MultiHeadLatentAttention<Scalar>::random(c, seed);
  apex::MlaWeights<Scalar> w = mla.weights();
  w.sinks = {0.3, -0.2, 0.0, 0.5};
  return {apex::MultiHeadLatentAttention<Scalar>(c, w),
          apex::LightningIndexer<Scalar>::random(indexer_config(top_k), seed + 7)};
}

template <class Scalar>
class SparseMla : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SparseMla, Scalars, apex::testing::ScalarName);

// A prompt of two sequences through the sparse layer equals MLA's forward pass (the naive,
// decompressing path) under the dense mask of the selection.
TYPED_TEST(SparseMla, EqualsForwardUnderTheSelectionMask) {
  using Scalar = TypeParam;
  const Index batch = 2, seq = 70;
  const auto layer = sparse_layer<Scalar>(9);
  const apex::RopeTable<Scalar> rope(256, 4);
  apex::AttentionLayerParams<Scalar> params;
  params.rope = &rope;
  const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(batch * seq, 32, 3u);
  auto cache = layer.make_cache(batch, 128);
  RowMatrix<Scalar> out(batch * seq, 32);
  const KeySelection selected = layer.forward(x, params, cache, out);
  ASSERT_EQ(selected.cols(), 9);
  for (Index r = 0; r < batch * seq; ++r) {
    EXPECT_EQ(apex::detail::selected_count(selected, r), std::min<Index>(9, r % seq + 1));
  }
  const std::vector<char> allowed = apex::reference::selection_mask(selected, batch, seq);
  apex::AttentionMask<Scalar> mask;
  mask.allowed = apex::HeadsView<const bool>::contiguous(
      reinterpret_cast<const bool*>(allowed.data()), {batch, 1, seq, seq});
  const RowMatrix<Scalar> want = layer.mla().forward(x, batch, mask, params);
  EXPECT_LE(normwise(out, want), Tolerances<Scalar>::kAbsorbedMla);
  EXPECT_EQ(cache.size(), seq);
  EXPECT_EQ(cache.bytes(), cache.latent.bytes() + cache.indexer_keys.bytes());
}

// With k at least the cache length every key is selected: each decoded token equals absorbed
// MLA's bit for bit (to rounding on Eigen's public-API fallback, APEX_EIGEN_PUBLIC_ONLY), and a
// prompt equals it to rounding (its tiles stack several queries).
TYPED_TEST(SparseMla, LargeKIsAbsorbedMla) {
  using Scalar = TypeParam;
  const Index batch = 2, prompt = 20, steps = 30;
  const auto layer = sparse_layer<Scalar>(1000);
  const apex::RopeTable<Scalar> rope(256, 4);
  apex::AttentionLayerParams<Scalar> params;
  params.rope = &rope;
  auto sparse_cache = layer.make_cache(batch, 64);
  auto dense_cache = layer.mla().make_cache(batch, 64);
  apex::PositionMask causal;
  causal.causal = true;
  const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(batch * prompt, 32, 5u);
  const RowMatrix<Scalar> sparse = layer.forward(x, params, sparse_cache);
  const RowMatrix<Scalar> dense =
      layer.mla().forward_absorbed(x, causal, params, layer.absorbed(), dense_cache);
  EXPECT_LE(normwise(sparse, dense), Tolerances<Scalar>::kAttention);
  for (Index t = 0; t < steps; ++t) {
    params.position_offset = prompt + t;
    const RowMatrix<Scalar> token =
        apex::testing::random_matrix<Scalar>(batch, 32, 100u + static_cast<std::uint32_t>(t));
    const RowMatrix<Scalar> a = layer.forward(token, params, sparse_cache);
    const RowMatrix<Scalar> b =
        layer.mla().forward_absorbed(token, causal, params, layer.absorbed(), dense_cache);
#if APEX_EIGEN_INTERNALS
    ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(Scalar) * std::size_t(a.size())), 0)
        << "step " << t;
#else
    // Eigen's public-API fallback sums each panel of keys before adding it, and the panels of
    // the selected rows (pages of one row) end elsewhere than those of the contiguous cache.
    ASSERT_LE(normwise(a, b), Tolerances<Scalar>::kAttention) << "step " << t;
#endif
  }
}

// Decoding 1000 tokens one at a time equals one sparse forward pass over them (k = 32 of up to
// 1000 keys), selection for selection; in double, where the projections of one row and of 1000
// agree to far below any gap between two scores.
TEST(SparseMla, DecodingEqualsTheForwardPass) {
  const Index seq = 1000;
  const auto layer = sparse_layer<double>(32);
  const apex::RopeTable<double> rope(seq, 4);
  apex::AttentionLayerParams<double> params;
  params.rope = &rope;
  const RowMatrix<double> x = apex::testing::random_matrix<double>(seq, 32, 11u);
  auto whole = layer.make_cache(1, seq);
  RowMatrix<double> forward(seq, 32);
  const KeySelection all = layer.forward(x, params, whole, forward);
  auto cache = layer.make_cache(1, seq);
  const apex::testing::OneThread one_thread;
  for (Index t = 0; t < seq; ++t) {
    params.position_offset = t;
    RowMatrix<double> out(1, 32);
    const KeySelection step = layer.forward(x.row(t), params, cache, out);
    ASSERT_EQ(step.leftCols(std::min<Index>(32, t + 1)),
              all.row(t).leftCols(std::min<Index>(32, t + 1)))
        << "token " << t;
    ASSERT_LE(normwise(out, RowMatrix<double>(forward.row(t))), Tolerances<double>::kDecode)
        << "token " << t;
  }
}

// Three sequences of a paged cache (pages of 8) advanced together, a prompt each, then five
// tokens each, equal the same sequences advanced one by one over contiguous caches: the same
// selections, and outputs equal to rounding (the projections of 92 rows and of 30 differ in the
// last bits). In double, where no two scores are that close.
TEST(SparseMla, PagedStepsEqualContiguousForward) {
  const auto layer = sparse_layer<double>(12);
  const apex::RopeTable<double> rope(256, 4);
  apex::AttentionLayerParams<double> params;
  params.rope = &rope;
  const std::vector<Index> prompts{30, 45, 17};
  auto paged = layer.make_paged_cache(8, 64);
  std::vector<apex::SequenceId> ids;
  std::vector<apex::SparseLatentCache<double>> alone;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(paged.add());
    alone.push_back(layer.make_cache(1, 64));
  }
  for (int step = 0; step < 6; ++step) {
    std::vector<Index> cu{0};
    for (const Index n : prompts) cu.push_back(cu.back() + (step == 0 ? n : 1));
    const RowMatrix<double> x =
        apex::testing::random_matrix<double>(cu.back(), 32, 40u + static_cast<std::uint32_t>(step));
    RowMatrix<double> out(cu.back(), 32);
    params.position_offset = 0;
    const KeySelection selected = layer.forward_paged(x, cu, ids, params, paged, out);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const Index n = cu[i + 1] - cu[i];
      params.position_offset = alone[i].next_position();
      RowMatrix<double> want(n, 32);
      const KeySelection own = layer.forward(x.middleRows(cu[i], n), params, alone[i], want);
      for (Index r = 0; r < n; ++r) {
        ASSERT_EQ(own.row(r), selected.row(cu[i] + r).leftCols(own.cols()))
            << "step " << step << " sequence " << i << " row " << r;
      }
      EXPECT_LE(normwise(RowMatrix<double>(out.middleRows(cu[i], n)), want),
                Tolerances<double>::kAbsorbedMla)
          << "step " << step << " sequence " << i;
    }
  }
  EXPECT_EQ(paged.bytes(), paged.latent.bytes() + paged.indexer_keys.bytes());
}

// The indexer over a paged key cache selects exactly what it selects over the same keys stored
// contiguously.
TEST(SparseMla, PagedIndexerEqualsContiguous) {
  const auto indexer = apex::LightningIndexer<float>::random(indexer_config(20), 3);
  const apex::RopeTable<float> rope(1024, 4);
  const RowMatrix<float> h = apex::testing::random_matrix<float>(600, 32, 8u);
  const RowMatrix<float> c_q = apex::testing::random_matrix<float>(600, 24, 9u);
  const RowMatrix<float> keys = indexer.keys(h, 1, rope, 0);
  apex::PagedIndexerKeyCache<float, Eigen::bfloat16> paged(16, 16, 64);
  auto contiguous = indexer.make_cache<Eigen::bfloat16>(1, 600);
  const apex::SequenceId other = paged.add(), id = paged.add();
  paged.append(other, keys.topRows(50));  // so that id's pages are not the first ones
  for (Index done = 0; done < 600; done += 100) paged.append(id, keys.middleRows(done, 100));
  contiguous.append(keys, 0);
  const RowMatrix<float> q = indexer.queries(c_q, 1, rope, 0).bottomRows(40);
  const RowMatrix<float> w = indexer.head_weights(h).bottomRows(40);
  const KeySelection want = indexer.select(q, w, contiguous.keys(), 560);
  EXPECT_EQ(indexer.select_paged(q, w, {0, 40}, paged, {id}), want);
  expect_invalid(
      [&] {
        (void)indexer.select_paged(q, w, {0, 40}, paged, {apex::SequenceId{7}});
      },
      {"[indexer]", "sequence 7"});
}

#ifdef _OPENMP
// A prompt and a decoding step give the same bits on 1, 2 and 3 threads.
TYPED_TEST(SparseMla, BitIdenticalForAnyThreadCount) {
  using Scalar = TypeParam;
  const auto layer = sparse_layer<Scalar>(40);
  const apex::RopeTable<Scalar> rope(512, 4);
  apex::AttentionLayerParams<Scalar> params;
  params.rope = &rope;
  const RowMatrix<Scalar> x = apex::testing::random_matrix<Scalar>(2 * 300, 32, 13u);
  const RowMatrix<Scalar> token = apex::testing::random_matrix<Scalar>(2, 32, 14u);
  const int saved = omp_get_max_threads();
  RowMatrix<Scalar> first, first_step;
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto cache = layer.make_cache(2, 301);
    params.position_offset = 0;
    const RowMatrix<Scalar> out = layer.forward(x, params, cache);
    params.position_offset = 300;
    const RowMatrix<Scalar> step = layer.forward(token, params, cache);
    if (threads == 1) {
      first = out;
      first_step = step;
      continue;
    }
    EXPECT_EQ(std::memcmp(out.data(), first.data(), sizeof(Scalar) * std::size_t(out.size())), 0);
    EXPECT_EQ(
        std::memcmp(step.data(), first_step.data(), sizeof(Scalar) * std::size_t(step.size())), 0);
  }
  omp_set_num_threads(saved);
}
#endif

// Mismatched indexers and caches, wrong positions: clear messages, caches and output unchanged.
TEST(SparseMla, BadInputIsRejectedAndChangesNothing) {
  const auto mla = apex::MultiHeadLatentAttention<float>::random(mla_config(), 1);
  apex::IndexerConfig wrong = indexer_config(4);
  wrong.d_q = 20;
  expect_invalid(
      [&] {
        apex::SparseLatentAttention<float>(mla, apex::LightningIndexer<float>::random(wrong, 2));
      },
      {"[sparse_mla]", "d_q (20)"});
  expect_invalid([&] { apex::SparseLatentAttention<float>(mla, {}); },
                 {"[sparse_mla]", "constructed"});
  const auto layer = sparse_layer<float>(4);
  const apex::RopeTable<float> rope(64, 4);
  apex::AttentionLayerParams<float> params;
  params.rope = &rope;
  const RowMatrix<float> x = apex::testing::random_matrix<float>(2 * 5, 32, 3u);
  RowMatrix<float> out = RowMatrix<float>::Constant(10, 32, 7.0f);
  auto cache = layer.make_cache(2, 8);
  params.position_offset = 1;
  expect_invalid([&] { layer.forward(x, params, cache, out); }, {"[mla]", "position"});
  params.position_offset = 0;
  cache.indexer_keys = apex::IndexerKeyCache<float>(2, 16, 4);  // room for 4 of the 5 tokens
  expect_invalid([&] { layer.forward(x, params, cache, out); },
                 {"[indexer_cache]", "exceed the capacity (4)"});
  cache.indexer_keys = apex::IndexerKeyCache<float>(1, 16, 8);
  expect_invalid([&] { layer.forward(x, params, cache, out); },
                 {"[sparse_mla]", "indexer_keys (batch 1"});
  EXPECT_EQ(cache.latent.size(), 0);
  EXPECT_EQ(cache.indexer_keys.size(), 0);
  EXPECT_TRUE((out.array() == 7.0f).all());
  auto paged = layer.make_paged_cache(4, 16);
  const apex::SequenceId id = paged.add();
  const apex::SequenceId latent_only = paged.latent.add();
  const apex::Vector<Index> at = apex::Vector<Index>::LinSpaced(10, 0, 9);
  const apex::DraftTree chain({-1, 0, 1, 2, 3, 4, 5, 6, 7, 8});
  const apex::TreeMasks windowed({chain}, {0}, 3), two({chain, chain}, {0, 0});
  const auto step = [&] { layer.forward_paged(x, {0, 10}, {id}, params, paged, out); };
  params.row_positions = &at;
  params.draft_trees = &windowed;
  expect_invalid(step, {"[sparse_mla] the draft trees have a window (3)"});
  params.draft_trees = &two;
  expect_invalid(step, {"[sparse_mla] draft trees (2) must be one per sequence (1)"});
  params.draft_trees = nullptr;
  const apex::Vector<Index> short_positions = at.head(9);
  params.row_positions = &short_positions;
  expect_invalid(step, {"[sparse_mla] row_positions holds 9 positions; expected one per row (10)"});
  params.row_positions = nullptr;
  expect_invalid(
      [&] {
        layer.forward_paged(x, {0, 10}, {latent_only}, params, paged, out);
      },
      {"[sparse_mla]", "indexer keys"});
  EXPECT_EQ(paged.latent.length(id), 0);
  EXPECT_EQ(paged.indexer_keys.length(id), 0);
  EXPECT_TRUE((out.array() == 7.0f).all());
  apex::SparseLatentAttention<float> empty;
  expect_invalid([&] { empty.forward(x, params, cache, out); }, {"[sparse_mla]"});
}

}  // namespace
}  // namespace sparse_mla_test
