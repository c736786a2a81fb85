// SPDX-License-Identifier: MIT
// Paged caches of quantized rows (page_pool.hpp and paged_attention.hpp over the block formats of
// kv_quant.hpp), for q8_0, q4_0 and fp8 e4m3 in blocks of 64:
//   - what a PagedKvCache holds is each appended row quantized alone (KvFormat::store_row of that
//     row, then widen), whatever page it lands in, through forks and copy on write;
//   - sdpa_paged over it (sequences of different lengths, pages scattered by frees, a fork) equals
//     sdpa_paged over a float paged cache holding the decoded values bit for bit, and sdpa over
//     each sequence's decoded values stored contiguously; sdpa_block_tables over its pools too;
//   - a head_dim (d_kv, d_r) that is not whole blocks throws at construction, naming it; a failed
//     append changes nothing; bytes() counts blocks;
//   - PagedLatentCache: c_kv and K_rope quantized part by part, absorbed attention over the rows;
//     and FlashMLA's whole fp8 rows, through sdpa_paged and an MLA layer's forward_paged.
#include <apex/kv_cache.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mask.hpp>
#include <apex/mla.hpp>
#include <apex/paged_cache.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention_case.hpp"
#include "format_names.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

namespace paged_quant_test {
namespace {

using apex::Index;
using apex::SequenceId;
using apex::testing::Heads;
using apex::testing::Layout;

template <class F>
using Format = apex::KvFormat<F>;

constexpr Index kKvHeads = 2;  // H_kv
constexpr Index kQHeads = 4;   // H_q: groups of 2
constexpr Index kPage = 8;     // tokens per page

/// The row x[0, d) quantized alone and decoded: what a cache of format F must hold for it.
template <class F>
std::vector<float> stored_row(const float* x, Index d) {
  std::vector<F> blocks(static_cast<std::size_t>(Format<F>::elements(d)));
  Format<F>::store_row(x, d, blocks.data());
  std::vector<float> out(static_cast<std::size_t>(d));
  Format<F>::widen(blocks.data(), out.data(), Format<F>::elements(d));
  return out;
}

/// Row j of head h of a paged segment's K or V (`pool`, read through `pages`), decoded.
template <class F>
std::vector<float> held_row(const apex::HeadsView<const F>& pool, const Index* pages, Index h,
                            Index j) {
  std::vector<float> out(static_cast<std::size_t>(apex::row_values(pool)));
  const F* row = apex::detail::row_data(pool, pages[j / pool.seq()], h, j % pool.seq());
  Format<F>::widen(row, out.data(), pool.dim());
  return out;
}

/// Paged attention against sdpa over the same values stored contiguously: bit for bit on
/// Eigen's internal kernels, within the float attention tolerance on the public-API fallback
/// (APEX_EIGEN_PUBLIC_ONLY), whose panels of keys end where pages do (as paged_cache_test).
void expect_paged_equals_contiguous(float paged, float contiguous) {
#if APEX_EIGEN_INTERNALS
  ASSERT_EQ(paged, contiguous);
#else
  ASSERT_NEAR(paged, contiguous, apex::testing::Tolerances<float>::kAttention);
#endif
}

/// Query rows [first, first + n) of every head of a paged call's output `out` against the same
/// rows computed alone over contiguous keys (`mine`, n rows a head), value by value.
template <class View>
void expect_rows_equal_contiguous(const View& out, Index first, const View& mine) {
  for (Index h = 0; h < mine.heads(); ++h) {
    for (Index s = 0; s < mine.seq(); ++s) {
      for (Index c = 0; c < mine.dim(); ++c) {
        expect_paged_equals_contiguous(out.head(0, h)(first + s, c), mine.head(0, h)(s, c));
      }
    }
  }
}

/// The decoded K and V a sequence holds, token-major: row (t, h) at (t·H_kv + h)·d.
struct History {
  std::vector<float> k, v;
  Index length = 0;
};

/// A paged cache of format F and a float paged cache fed the values F's rows decode to, through
/// the same operations (so the same ids and block tables), with the decoded history of each live
/// sequence.
template <class F>
struct QuantizedAndDecoded {
  explicit QuantizedAndDecoded(Index width)
      : d(width), quantized({kKvHeads, width, kPage, 64}), decoded({kKvHeads, width, kPage, 64}) {}

  SequenceId add() {
    const SequenceId id = quantized.add();
    EXPECT_EQ(decoded.add(), id);
    shadow[id];
    return id;
  }
  SequenceId fork(SequenceId from) {
    const SequenceId id = quantized.fork(from);
    EXPECT_EQ(decoded.fork(from), id);
    shadow[id] = shadow.at(from);
    return id;
  }
  void free(SequenceId id) {
    quantized.free(id);
    decoded.free(id);
    shadow.erase(id);
  }
  /// n random tokens: K token-major and V contiguous (appends read any layout).
  void append(SequenceId id, Index n, std::mt19937& rng) {
    Heads<float> k(1, kKvHeads, n, d, Layout::kTokenMajor), v(1, kKvHeads, n, d);
    Heads<float> kd(1, kKvHeads, n, d), vd(1, kKvHeads, n, d);
    k.randomize(rng, apex::testing::Values::kNormal);
    v.randomize(rng, apex::testing::Values::kNormal);
    History& history = shadow.at(id);
    for (Index t = 0; t < n; ++t) {
      for (Index h = 0; h < kKvHeads; ++h) {
        for (auto [from, to, all] : {std::tuple{k.view(), kd.view(), &history.k},
                                     std::tuple{v.view(), vd.view(), &history.v}}) {
          const std::vector<float> row = stored_row<F>(apex::detail::row_data(from, 0, h, t), d);
          std::copy(row.begin(), row.end(), apex::detail::row_data(to, 0, h, t));
          all->insert(all->end(), row.begin(), row.end());
        }
      }
    }
    history.length += n;
    quantized.append(id, k.view(), v.view());
    decoded.append(id, kd.view(), vd.view());
  }

  /// Every held row of every live sequence is its row quantized alone.
  void expect_holdings() const {
    for (const auto& [id, history] : shadow) {
      ASSERT_EQ(quantized.length(id), history.length);
      const auto segment = quantized.segment(id);
      for (Index t = 0; t < history.length; ++t) {
        for (Index h = 0; h < kKvHeads; ++h) {
          const auto at = history.k.begin() + (t * kKvHeads + h) * d;
          const auto vat = history.v.begin() + (t * kKvHeads + h) * d;
          ASSERT_EQ(held_row(segment.k, segment.pages, h, t), std::vector<float>(at, at + d))
              << "sequence " << id << ", token " << t << ", head " << h;
          ASSERT_EQ(held_row(segment.v, segment.pages, h, t), std::vector<float>(vat, vat + d));
        }
      }
    }
  }

  Index d;
  apex::PagedKvCache<float, F> quantized;
  apex::PagedKvCache<float> decoded;
  std::map<SequenceId, History> shadow;
};

/// One sdpa_paged call over every live sequence (its last 1 to 3 tokens as queries): over the
/// quantized cache it equals the call over the decoded cache bit for bit, sdpa over each
/// sequence's decoded values stored contiguously, and sdpa_block_tables over the quantized pools.
template <class F>
void expect_attention_matches(const QuantizedAndDecoded<F>& caches, std::mt19937& rng) {
  const Index d = caches.d;
  std::vector<SequenceId> ids;
  std::vector<Index> cu{0};
  apex::BlockTables<F, F> tables;
  for (const auto& [id, history] : caches.shadow) {
    ids.push_back(id);
    cu.push_back(cu.back() + std::min<Index>(history.length, 1 + id.value % 3));
    tables.block_tables.push_back(caches.quantized.block_table(id));
    tables.lengths.push_back(history.length);
  }
  Heads<float> q(1, kQHeads, cu.back(), d, Layout::kTokenMajor);
  q.randomize(rng, apex::testing::Values::kNormal);
  Heads<float> out(1, kQHeads, cu.back(), d), expected(1, kQHeads, cu.back(), d);
  Heads<float> from_tables(1, kQHeads, cu.back(), d);
  const std::vector<apex::PositionMask> causal{apex::causal_mask()};
  apex::sdpa_paged(q.view(), cu, caches.quantized, ids, causal, apex::SdpaParams{}, out.view());
  apex::sdpa_paged(q.view(), cu, caches.decoded, ids, causal, apex::SdpaParams{}, expected.view());
  const auto pools = caches.quantized.segment(ids.front());
  tables.k_pages = pools.k;
  tables.v_pages = pools.v;
  apex::sdpa_block_tables(q.view(), cu, tables, causal, apex::SdpaParams{}, from_tables.view());
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out.at(i), expected.at(i)) << i;  // bit for bit
    ASSERT_EQ(from_tables.at(i), out.at(i)) << i;
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const History& history = caches.shadow.at(ids[i]);
    const Index nq = cu[i + 1] - cu[i];
    const apex::HeadsShape kv{1, kKvHeads, history.length, d};
    Heads<float> mine(1, kQHeads, nq, d);
    apex::sdpa(q.view().middle_rows(cu[i], nq),
               apex::HeadsView<const float>::token_major(history.k.data(), kv),
               apex::HeadsView<const float>::token_major(history.v.data(), kv),
               apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
               mine.view());
    SCOPED_TRACE("sequence " + std::to_string(ids[i].value));
    expect_rows_equal_contiguous(out.view(), cu[i], mine.view());
  }
}

template <class F>
class PagedQuant : public ::testing::Test {};
using BlockFormats = ::testing::Types<apex::BlockQ8_0, apex::BlockQ4_0, apex::BlockFp8E4m3<64>>;
TYPED_TEST_SUITE(PagedQuant, BlockFormats, apex::testing::FormatName);

/// Two blocks a row (q8_0, q4_0: d = 64; fp8 in blocks of 64: d = 128).
template <class F>
constexpr Index kTwoBlocks = 2 * Format<F>::kValuesPerElement;

TYPED_TEST(PagedQuant, HoldsEachRowQuantizedAloneAndAttendsOverTheDecodedValues) {
  using F = TypeParam;
  std::mt19937 rng(29);
  QuantizedAndDecoded<F> caches(kTwoBlocks<F>);
  const SequenceId a = caches.add(), b = caches.add(), c = caches.add();
  caches.append(a, 5, rng);  // a, b and c take pages in turn: a's pages are scattered
  caches.append(b, 11, rng);
  caches.append(c, 1, rng);
  caches.append(a, 9, rng);
  const SequenceId f = caches.fork(a);  // shares a's pages, the last one 6 of 8 full
  caches.append(f, 3, rng);             // copies that page (copy on write), blocks as they are
  caches.append(a, 2, rng);
  caches.expect_holdings();
  EXPECT_NE(caches.quantized.block_table(a).back(), caches.quantized.block_table(f).back());
  EXPECT_EQ(caches.quantized.block_table(a).front(), caches.quantized.block_table(f).front());
  caches.free(b);  // its pages go back, and the next sequence takes them
  const SequenceId d = caches.add();
  caches.append(d, 20, rng);
  caches.append(c, 30, rng);
  caches.expect_holdings();
  expect_attention_matches(caches, rng);
  for (int step = 0; step < 3; ++step) {  // decoding: one token each, then one call
    for (const SequenceId id : {a, c, d, f}) caches.append(id, 1, rng);
    expect_attention_matches(caches, rng);
  }
  caches.expect_holdings();
}

TYPED_TEST(PagedQuant, WidthsMustBeWholeBlocksAndFailedAppendsChangeNothing) {
  using F = TypeParam;
  constexpr Index kBlock = Format<F>::kValuesPerElement;
  using apex::testing::expect_invalid;
  expect_invalid(
      [] {
        apex::PagedKvCache<float, F>({kKvHeads, kBlock + 16, kPage, 4});
      },
      "[paged_kv_cache] head_dim (" + std::to_string(kBlock + 16) + ") must be a multiple of the " +
          std::to_string(kBlock));
  expect_invalid(
      [] {
        apex::PagedKvCache<double, F>({1, kBlock / 2, kPage, 4});
      },
      "[paged_kv_cache] head_dim (" + std::to_string(kBlock / 2) + ")");
  expect_invalid(
      [] {
        apex::PagedLatentCache<float, F>({kBlock + 16, 1, kBlock, kPage, 4});
      },
      "[paged_latent_cache] latent_dim d_kv (" + std::to_string(kBlock + 16) + ")");
  expect_invalid(
      [] {
        apex::PagedLatentCache<float, F>({kBlock, 1, kBlock / 2, kPage, 4});
      },
      "[paged_latent_cache] rope_dim d_r (" + std::to_string(kBlock / 2) + ")");

  apex::PagedKvCache<float, F> cache({kKvHeads, kBlock, 4, 3});
  std::mt19937 rng(3);
  Heads<float> k(1, kKvHeads, 10, kBlock), v(1, kKvHeads, 10, kBlock);
  k.randomize(rng);
  v.randomize(rng);
  const SequenceId a = cache.add();
  cache.append(a, k.view(), v.view());  // 3 pages: the pool is full, the last page half full
  const auto pool_bytes = [&] {
    const auto segment = cache.segment(a);
    const std::size_t size =
        static_cast<std::size_t>(3 * kKvHeads * 4) * sizeof(F);  // pages·H·P rows of one block
    std::vector<unsigned char> bytes(2 * size);
    std::memcpy(bytes.data(), segment.k.data(), size);
    std::memcpy(bytes.data() + size, segment.v.data(), size);
    return bytes;
  };
  const std::vector<unsigned char> before = pool_bytes();
  const auto three = [&](Heads<float>& x) { return x.view().middle_rows(0, 3); };
  expect_invalid([&] { cache.append(a, three(k), three(v)); }, "[paged_kv_cache] the pool is full");
  Heads<float> wide(1, kKvHeads, 1, 2 * kBlock);
  expect_invalid([&] { cache.append(a, wide.view(), wide.view()); }, "[1, H_kv, n, d_h]");
  const SequenceId b = cache.fork(a);  // its first append must copy the shared last page
  expect_invalid([&] { cache.append(b, k.view().middle_rows(0, 1), v.view().middle_rows(0, 1)); },
                 "needs 1 pages, 0 of 3 are free");
  EXPECT_EQ(pool_bytes(), before);
  EXPECT_EQ(cache.length(a), 10);
  EXPECT_EQ(cache.length(b), 10);
  EXPECT_EQ(cache.pages_in_use(), 3);
}

TYPED_TEST(PagedQuant, BytesCountTheBlocks) {
  using F = TypeParam;
  constexpr Index kBlock = Format<F>::kValuesPerElement;
  const auto block = static_cast<std::int64_t>(sizeof(F));
  const apex::PagedKvCache<float, F> kv({kKvHeads, 2 * kBlock, kPage, 10});
  EXPECT_EQ(kv.bytes(), 2 * 10 * kKvHeads * kPage * 2 * block);  // K and V, 2 blocks a row
  EXPECT_EQ(kv.head_dim(), 2 * kBlock);
  EXPECT_EQ(kv.key_dim(), 2 * kBlock);
  const apex::PagedLatentCache<float, F> latent({2 * kBlock, 2, kBlock, kPage, 6});
  EXPECT_EQ(latent.bytes(), 6 * kPage * 4 * block);  // d_kv + H_kr·d_r: 4 blocks a row
  EXPECT_EQ(latent.row_dim(), 4 * kBlock);
  EXPECT_EQ(latent.value_dim(), 2 * kBlock);
}

TYPED_TEST(PagedQuant, LatentCacheStoresEachPartAndAbsorbedAttentionReadsIt) {
  // Rows [c_kv ‖ K_rope] of d_kv = 2 blocks and H_kr = 2 heads of d_r = 1 block, each part
  // quantized alone (no block straddles them), as LatentCache stores them. Absorbed attention
  // (keys the whole rows, values c_kv) over them equals the float cache's over the decoded rows
  // bit for bit, and sdpa's over those rows stored contiguously.
  using F = TypeParam;
  constexpr Index kBlock = Format<F>::kValuesPerElement;
  constexpr Index kLatent = 2 * kBlock, kRope = 2 * kBlock, kWidth = kLatent + kRope;
  apex::PagedLatentCache<float, F> quantized({kLatent, 2, kBlock, 4, 32});
  apex::PagedLatentCache<float> decoded({kLatent, 2, kBlock, 4, 32});
  std::mt19937 rng(31);
  std::map<SequenceId, apex::RowMatrix<float>> shadow;  // the decoded rows
  const auto append = [&](SequenceId id, Index n) {
    const apex::RowMatrix<float> rows = apex::testing::random_matrix<float>(n, kWidth, rng, -2, 2);
    apex::RowMatrix<float> rows_decoded(n, kWidth);
    for (Index t = 0; t < n; ++t) {
      const std::vector<float> c = stored_row<F>(rows.row(t).data(), kLatent);
      const std::vector<float> r = stored_row<F>(rows.row(t).data() + kLatent, kRope);
      std::copy(c.begin(), c.end(), rows_decoded.row(t).data());
      std::copy(r.begin(), r.end(), rows_decoded.row(t).data() + kLatent);
    }
    quantized.append(id, rows);
    decoded.append(id, rows_decoded);
    apex::RowMatrix<float>& all = shadow[id];
    all.conservativeResize(all.rows() + n, kWidth);
    all.bottomRows(n) = rows_decoded;
  };
  const SequenceId a = quantized.add();
  ASSERT_EQ(decoded.add(), a);
  append(a, 7);
  const SequenceId b = quantized.fork(a);  // shares a's pages, the last one 3 of 4 full
  ASSERT_EQ(decoded.fork(a), b);
  shadow[b] = shadow[a];
  append(a, 2);
  append(b, 5);
  const SequenceId c = quantized.add();
  ASSERT_EQ(decoded.add(), c);
  append(c, 3);

  for (const auto& [id, rows] : shadow) {  // what the pool holds
    const auto segment = quantized.segment(id);
    for (Index t = 0; t < rows.rows(); ++t) {
      ASSERT_EQ(held_row(segment.k, segment.pages, 0, t),
                std::vector<float>(rows.row(t).data(), rows.row(t).data() + kWidth));
    }
  }
  const std::vector<SequenceId> ids{a, b, c};
  const std::vector<Index> cu{0, 1, 3, 4};
  Heads<float> q(1, kQHeads, 4, kWidth), out(1, kQHeads, 4, kLatent),
      expected(1, kQHeads, 4, kLatent);
  q.randomize(rng, apex::testing::Values::kNormal);
  apex::sdpa_paged(q.view(), cu, quantized, ids, {apex::causal_mask()}, apex::SdpaParams{},
                   out.view());
  apex::sdpa_paged(q.view(), cu, decoded, ids, {apex::causal_mask()}, apex::SdpaParams{},
                   expected.view());
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out.at(i), expected.at(i)) << i;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const apex::RowMatrix<float>& rows = shadow.at(ids[i]);
    const Index n = rows.rows(), nq = cu[i + 1] - cu[i];
    const apex::HeadsView<const float> k(rows.data(), {1, 1, n, kWidth}, {0, 0, kWidth});
    const apex::HeadsView<const float> v(rows.data(), {1, 1, n, kLatent}, {0, 0, kWidth});
    Heads<float> mine(1, kQHeads, nq, kLatent);
    apex::sdpa(q.view().middle_rows(cu[i], nq), k, v,
               apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
               mine.view());
    expect_rows_equal_contiguous(out.view(), cu[i], mine.view());
  }
}

// ---- FlashMLA's fp8 latent rows ---------------------------------------------------------------
using FlashRow = apex::FlashMlaFp8Row<128, 64>;

// Each held row is its row quantized alone (the bytes of quantize_flashmla_row), through a fork
// and copy on write; attention over them (keys and values the whole rows, value_dim() = 192),
// for 16 query heads (the keys-major path), equals attention over the same rows in a
// LatentCache bit for bit; widths that are not the row's throw, naming them.
TEST(PagedFlashMlaRows, HoldWholeRowsAndAttendAsTheContiguousCache) {
  constexpr Index kWidth = FlashRow::kValues;
  apex::PagedLatentCache<float, FlashRow> cache({128, 2, 32, 4, 16});
  EXPECT_EQ(cache.bytes(), 16 * 4 * static_cast<std::int64_t>(sizeof(FlashRow)));
  EXPECT_EQ(cache.value_dim(), kWidth);
  std::mt19937 rng(61);
  std::map<SequenceId, apex::RowMatrix<float>> shadow;  // the rows appended
  const auto append = [&](SequenceId id, Index n) {
    const apex::RowMatrix<float> rows = apex::testing::random_matrix<float>(n, kWidth, rng, -3, 3);
    cache.append(id, rows);
    apex::RowMatrix<float>& all = shadow[id];
    all.conservativeResize(all.rows() + n, kWidth);
    all.bottomRows(n) = rows;
  };
  const SequenceId a = cache.add();
  append(a, 7);
  const SequenceId b = cache.fork(a);  // shares a's pages, the last one 3 of 4 full
  shadow[b] = shadow[a];
  append(a, 2);
  append(b, 5);
  const SequenceId c = cache.add();
  append(c, 3);
  for (const auto& [id, rows] : shadow) {
    const auto segment = cache.segment(id);
    for (Index t = 0; t < rows.rows(); ++t) {
      const FlashRow expected = apex::quantize_flashmla_row<128, 64>(rows.row(t).data());
      ASSERT_EQ(std::memcmp(apex::detail::row_data(segment.k, segment.pages[t / 4], 0, t % 4),
                            &expected, sizeof expected),
                0)
          << "sequence " << id.value << ", token " << t;
    }
  }
  const std::vector<SequenceId> ids{a, b, c};
  const std::vector<Index> cu{0, 1, 3, 4};
  constexpr Index kHeads = 16;
  Heads<float> q(1, kHeads, 4, kWidth), out(1, kHeads, 4, kWidth);
  q.randomize(rng, apex::testing::Values::kNormal);
  apex::sdpa_paged(q.view(), cu, cache, ids, {apex::causal_mask()}, apex::SdpaParams{}, out.view());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const apex::RowMatrix<float>& rows = shadow.at(ids[i]);
    const Index n = rows.rows(), nq = cu[i + 1] - cu[i];
    apex::LatentCache<float, FlashRow> contiguous({1, 128, 2, 32, n});
    contiguous.append(rows, 0);
    Heads<float> mine(1, kHeads, nq, kWidth);
    apex::sdpa(q.view().middle_rows(cu[i], nq), contiguous.rows(), contiguous.rows(),
               apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
               mine.view());
    expect_rows_equal_contiguous(out.view(), cu[i], mine.view());
  }
  apex::testing::expect_invalid(
      [] {
        apex::PagedLatentCache<float, FlashRow> bad({256, 2, 32, 4, 16});
      },
      "[paged_latent_cache] latent_dim d_kv (256) and H_kr*d_r (64) must be the row format's 128 "
      "and 64");
}

// An MLA layer decoding two sequences over FlashMLA rows in pages (forward_paged, the K_rope
// columns of the attention's output dropped) gives what forward_absorbed gives over a
// LatentCache of the format, sequence by sequence, within the attention tolerance (the
// projections of the rows of both sequences run as one product there).
TEST(PagedFlashMlaRows, MlaForwardPagedEqualsTheContiguousCache) {
  apex::MlaConfig config;
  config.d_model = 16;
  config.d_q = 10;
  config.d_kv = 128;
  config.num_q_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 6;
  config.rope_dim = 64;
  config.num_rope_key_heads = 1;
  const auto layer = apex::MultiHeadLatentAttention<float>::random(config, 62);
  const auto absorbed = apex::absorb_mla_weights(layer);
  const apex::RopeTable<float> rope(16, config.rope_dim);
  const apex::RowMatrix<float> x = apex::testing::random_matrix<float>(14, 16, 63);
  // Sequence 0 is x's rows [0, 9) in chunks of 6 and 3, sequence 1 rows [9, 14) in 3 and 2.
  const Index first[2] = {0, 9};
  const Index chunks[2][2] = {{6, 3}, {3, 2}};
  apex::PagedLatentCache<float, FlashRow> paged({128, 1, 64, 4, 16});
  const std::vector<SequenceId> ids{paged.add(), paged.add()};
  apex::AttentionLayerParams<float> params;
  params.rope = &rope;
  apex::RowMatrix<float> paged_out(14, 16);
  for (Index step = 0, done0 = 0, done1 = 0; step < 2; ++step) {
    const Index n0 = chunks[0][step], n1 = chunks[1][step];
    apex::RowMatrix<float> rows(n0 + n1, 16), out(n0 + n1, 16);
    rows << x.middleRows(first[0] + done0, n0), x.middleRows(first[1] + done1, n1);
    layer.forward_paged(rows, {0, n0, n0 + n1}, ids, {apex::causal_mask()}, params, absorbed, paged,
                        out);
    paged_out.middleRows(first[0] + done0, n0) = out.topRows(n0);
    paged_out.middleRows(first[1] + done1, n1) = out.bottomRows(n1);
    done0 += n0;
    done1 += n1;
  }
  for (Index seq = 0; seq < 2; ++seq) {
    apex::LatentCache<float, FlashRow> cache = layer.make_cache<FlashRow>(1, 9);
    for (Index step = 0, done = 0; step < 2; ++step) {
      const Index n = chunks[seq][step];
      params.position_offset = done;
      const apex::RowMatrix<float> out = layer.forward_absorbed(
          x.middleRows(first[seq] + done, n), apex::causal_mask(), params, absorbed, cache);
      for (Index r = 0; r < n; ++r) {
        for (Index col = 0; col < 16; ++col) {
          EXPECT_NEAR(paged_out(first[seq] + done + r, col), out(r, col),
                      apex::testing::Tolerances<float>::kAttention)
              << "sequence " << seq << ", token " << done + r << ", column " << col;
        }
      }
      done += n;
    }
    params.position_offset = 0;
  }
}

}  // namespace
}  // namespace paged_quant_test
