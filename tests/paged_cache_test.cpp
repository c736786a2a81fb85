// SPDX-License-Identifier: MIT
// Tests of include/apex/paged_cache.hpp and cascade_attention.hpp: the page bookkeeping (sharing,
// copy on write, keep_tokens, release, no leak), and attention through block tables (sdpa_paged),
// which must equal apex::sdpa over the same tokens stored contiguously bit for bit (the kernel's
// key blocks are the same), and so the plain loops that sdpa is tested against. A shadow model
// keeps every sequence's tokens in plain matrices.
#include <apex/cascade_attention.hpp>
#include <apex/mask.hpp>
#include <apex/paged_cache.hpp>
#include <apex/sdpa.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"
#include "tolerances.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace paged_cache_test {
namespace {

using apex::Index;
using apex::PositionMask;
using apex::RowMatrix;
using apex::SequenceId;
using apex::testing::Heads;

constexpr Index kHeads = 2;  // H_kv
constexpr Index kDim = 16;   // d_h

/// A sequence's tokens as the shadow model keeps them: K and V, [H_kv, tokens, d_h].
struct Tokens {
  std::vector<RowMatrix<float>> k =
      std::vector<RowMatrix<float>>(kHeads, RowMatrix<float>(0, kDim));
  std::vector<RowMatrix<float>> v =
      std::vector<RowMatrix<float>>(kHeads, RowMatrix<float>(0, kDim));
  Index length() const { return k[0].rows(); }
};

/// Appends n random tokens to sequence id of the cache and of the shadow.
void append_random(apex::PagedKvCache<float>& cache, std::map<SequenceId, Tokens>& shadow,
                   SequenceId id, Index n, std::mt19937& rng) {
  Heads<float> k(1, kHeads, n, kDim), v(1, kHeads, n, kDim);
  k.randomize(rng);
  v.randomize(rng);
  cache.append(id, k.view(), v.view());
  Tokens& t = shadow[id];
  const Index old = t.length();
  for (Index h = 0; h < kHeads; ++h) {
    t.k[std::size_t(h)].conservativeResize(old + n, kDim);
    t.v[std::size_t(h)].conservativeResize(old + n, kDim);
    t.k[std::size_t(h)].bottomRows(n) = k.view().head(0, h);
    t.v[std::size_t(h)].bottomRows(n) = v.view().head(0, h);
  }
}

/// Tokens [first, length) of a shadow sequence as contiguous [1, H_kv, n, d_h] K and V.
std::pair<Heads<float>, Heads<float>> contiguous(const Tokens& t, Index first) {
  const Index n = t.length() - first;
  Heads<float> k(1, kHeads, n, kDim), v(1, kHeads, n, kDim);
  for (Index h = 0; h < kHeads; ++h) {
    k.head_map(0, h) = t.k[std::size_t(h)].bottomRows(n);
    v.head_map(0, h) = t.v[std::size_t(h)].bottomRows(n);
  }
  return {std::move(k), std::move(v)};
}

/// sdpa over the shadow's held tokens, for queries that are the sequence's last S_q tokens.
Heads<float> contiguous_attention(const Tokens& t, Index first, const Heads<float>& q,
                                  PositionMask rule) {
  const auto [k, v] = contiguous(t, first);
  Heads<float> out(1, q.heads(), q.seq(), kDim);
  rule.key_offset = first;
  apex::sdpa(q.view(), k.view(), v.view(), apex::AttentionMask<float>{rule, {}, {}},
             apex::SdpaParams{}, out.view());
  return out;
}

/// Paged attention against contiguous attention over the same tokens: bit for bit on Eigen's
/// internal kernels, whose products add key after key whatever the panels; within the float
/// attention tolerance on the public-API fallback (APEX_EIGEN_PUBLIC_ONLY), which sums each
/// panel of keys before adding it, and whose panels end where pages do.
template <class A, class B>
void expect_paged_equals_contiguous(const A& paged, const B& contiguous) {
  ASSERT_EQ(paged.rows(), contiguous.rows());
  ASSERT_EQ(paged.cols(), contiguous.cols());
  for (Index r = 0; r < paged.rows(); ++r) {
    for (Index c = 0; c < paged.cols(); ++c) {
#if APEX_EIGEN_INTERNALS
      ASSERT_EQ(paged(r, c), contiguous(r, c)) << "row " << r << ", column " << c;
#else
      ASSERT_NEAR(paged(r, c), contiguous(r, c), apex::testing::Tolerances<float>::kAttention)
          << "row " << r << ", column " << c;
#endif
    }
  }
}

void expect_paged_equals_contiguous_heads(const Heads<float>& a, const Heads<float>& b) {
  ASSERT_EQ(a.heads(), b.heads());
  for (Index h = 0; h < a.heads(); ++h) {
    expect_paged_equals_contiguous(a.view().head(0, h), b.view().head(0, h));
  }
}

/// Every live sequence: sdpa_paged of its last S_q tokens (all sequences in one call) equals
/// sdpa over its held tokens stored contiguously, bit for bit.
void expect_attention_matches(const apex::PagedKvCache<float>& cache,
                              const std::map<SequenceId, Tokens>& shadow, const PositionMask& rule,
                              std::mt19937& rng) {
  std::vector<SequenceId> ids;
  std::vector<Index> cu{0};
  for (const auto& [id, t] : shadow) {
    ids.push_back(id);
    cu.push_back(cu.back() + std::min<Index>(t.length(), 1 + id.value % 3));
  }
  const Index q_heads = 2 * kHeads;
  Heads<float> q(1, q_heads, cu.back(), kDim, apex::testing::Layout::kTokenMajor);
  Heads<float> out(1, q_heads, cu.back(), kDim, apex::testing::Layout::kTokenMajor);
  q.randomize(rng);
  apex::sdpa_paged(q.view(), cu, cache, ids, {rule}, apex::SdpaParams{}, out.view());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(ids[i].value));
    const Index nq = cu[i + 1] - cu[i];
    Heads<float> qi(1, q_heads, nq, kDim), mine(1, q_heads, nq, kDim);
    for (Index h = 0; h < q_heads; ++h) {
      qi.head_map(0, h) = q.view().head(0, h).middleRows(cu[i], nq);
      mine.head_map(0, h) = out.view().head(0, h).middleRows(cu[i], nq);
    }
    const Heads<float> expected =
        contiguous_attention(shadow.at(ids[i]), cache.first_position(ids[i]), qi, rule);
    expect_paged_equals_contiguous_heads(mine, expected);
  }
}

/// Frees the sequences that hold no token (attention needs one), in the cache and the shadow.
void free_empty(apex::PagedKvCache<float>& cache, std::map<SequenceId, Tokens>& shadow) {
  for (auto it = shadow.begin(); it != shadow.end();) {
    if (it->second.length() == 0) {
      cache.free(it->first);
      it = shadow.erase(it);
    } else {
      ++it;
    }
  }
}

/// Random histories of add / append / fork / truncate / free for random page sizes: attention
/// through the block tables equals contiguous attention after every few operations, the block
/// counts follow the sharing, and no page is left once every sequence is freed.
TEST(PagedKvCache, RandomHistoriesEqualContiguousAttention) {
  std::mt19937 rng(17);
  for (const Index page : {1, 3, 8, 16, 64}) {
    SCOPED_TRACE("page size " + std::to_string(page));
    apex::PagedKvCache<float> cache({kHeads, kDim, page, 4000 / page + 8});
    std::map<SequenceId, Tokens> shadow;
    std::uniform_int_distribution<int> op(0, 9);
    for (int step = 0; step < 60; ++step) {
      const int what = shadow.empty() ? 0 : op(rng);
      auto pick = [&] {
        auto it = shadow.begin();
        std::advance(it, std::uniform_int_distribution<std::size_t>(0, shadow.size() - 1)(rng));
        return it->first;
      };
      if (what == 0 || shadow.size() < 2) {
        const SequenceId id = cache.add();
        shadow[id];
        append_random(cache, shadow, id, std::uniform_int_distribution<Index>(1, 90)(rng), rng);
      } else if (what <= 4) {
        const SequenceId id = pick();
        if (cache.free_pages() > 20) append_random(cache, shadow, id, 1 + step % 7, rng);
      } else if (what <= 6) {
        const SequenceId from = pick();
        const Index in_use = cache.pages_in_use();
        const SequenceId id = cache.fork(from);
        EXPECT_EQ(cache.pages_in_use(), in_use) << "a fork copies no page";
        EXPECT_EQ(cache.block_table(id), cache.block_table(from));
        shadow[id] = shadow[from];
      } else if (what == 7) {
        const SequenceId id = pick();
        const Index length = std::uniform_int_distribution<Index>(0, shadow[id].length())(rng);
        cache.truncate(id, length);
        for (Index h = 0; h < kHeads; ++h) {
          shadow[id].k[std::size_t(h)].conservativeResize(length, kDim);
          shadow[id].v[std::size_t(h)].conservativeResize(length, kDim);
        }
      } else if (shadow.size() > 2) {
        const SequenceId id = pick();
        cache.free(id);
        shadow.erase(id);
      }
      if (step % 6 == 5) {
        free_empty(cache, shadow);
        if (!shadow.empty()) expect_attention_matches(cache, shadow, apex::causal_mask(), rng);
      }
    }
    for (const auto& [id, t] : shadow) {
      EXPECT_EQ(cache.length(id), t.length());
      cache.free(id);
    }
    EXPECT_EQ(cache.free_pages(), cache.num_pages()) << "a page leaked";
    EXPECT_EQ(cache.sequences(), 0);
  }
}

/// Speculative decoding's accept over random histories: a draft of 1 to 20 tokens is appended
/// after a sequence's committed tokens (sometimes then forked, so that its pages are shared),
/// and keep_tokens keeps a random increasing subset of it, moved down in order. The sequence then
/// holds exactly the shadow's tokens (attention bit for bit against contiguous), holds no page
/// past its length, its forks are unchanged, and no page leaks.
TEST(PagedKvCache, KeepTokensKeepsAPathAndDropsTheRest) {
  std::mt19937 rng(23);
  for (const Index page : {1, 4, 16}) {
    SCOPED_TRACE("page size " + std::to_string(page));
    apex::PagedKvCache<float> cache({kHeads, kDim, page, 2400 / page + 8});
    std::map<SequenceId, Tokens> shadow;
    for (int round = 0; round < 24; ++round) {
      SequenceId id = shadow.empty() || round % 5 == 0 ? cache.add() : shadow.rbegin()->first;
      if (shadow.count(id) == 0 || rng() % 3 == 0) {
        append_random(cache, shadow, id, std::uniform_int_distribution<Index>(1, 30)(rng), rng);
      }
      if (rng() % 4 == 0) {  // a continuation forked before the draft
        const SequenceId other = cache.fork(id);
        shadow[other] = shadow[id];
        id = other;
      }
      const Index first = cache.length(id);
      const Index draft = std::uniform_int_distribution<Index>(1, 20)(rng);
      append_random(cache, shadow, id, draft, rng);
      if (rng() % 3 == 0) shadow[cache.fork(id)] = shadow[id];  // the draft's pages shared
      std::vector<Index> rows;
      for (Index r = 0; r < draft; ++r) {
        if (rng() % 2 == 0) rows.push_back(r);
      }
      cache.keep_tokens(id, first, rows);
      Tokens& t = shadow[id];
      for (Index h = 0; h < kHeads; ++h) {
        for (std::size_t k = 0; k < rows.size(); ++k) {
          t.k[std::size_t(h)].row(first + Index(k)) = t.k[std::size_t(h)].row(first + rows[k]);
          t.v[std::size_t(h)].row(first + Index(k)) = t.v[std::size_t(h)].row(first + rows[k]);
        }
        t.k[std::size_t(h)].conservativeResize(first + Index(rows.size()), kDim);
        t.v[std::size_t(h)].conservativeResize(first + Index(rows.size()), kDim);
      }
      ASSERT_EQ(cache.length(id), t.length());
      ASSERT_EQ(Index(cache.block_table(id).size()), apex::detail::pages_holding(t.length(), page));
      free_empty(cache, shadow);
      if (!shadow.empty()) expect_attention_matches(cache, shadow, apex::causal_mask(), rng);
    }
    for (const auto& [id, t] : shadow) cache.free(id);
    EXPECT_EQ(cache.free_pages(), cache.num_pages()) << "a page leaked";
  }
}

/// keep_tokens' bad input: an unknown sequence, `first` outside the held tokens, rows that are
/// not increasing or lie past the draft, and a full pool where a shared page must be copied:
/// each throws naming what is wrong, and the cache keeps its tokens, pages and tables.
TEST(PagedKvCache, KeepTokensRejectsBadInputAndChangesNothing) {
  std::mt19937 rng(7);
  apex::PagedKvCache<float> cache({kHeads, kDim, 4, 5});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId a = cache.add();
  append_random(cache, shadow, a, 18, rng);  // 5 pages: the pool is full
  const SequenceId b = cache.fork(a);
  shadow[b] = shadow[a];
  const auto table = cache.block_table(a);
  using apex::testing::expect_invalid;
  expect_invalid([&] { cache.keep_tokens(SequenceId{9}, 0, {}); }, "sequence 9 does not exist");
  expect_invalid([&] { cache.keep_tokens(a, 19, {}); }, "first (19) must be in [0, 18]");
  expect_invalid([&] { cache.keep_tokens(a, -1, {}); }, "first (-1) must be in [0, 18]");
  expect_invalid(
      [&] {
        cache.keep_tokens(a, 10, {0, 3, 3});
      },
      "rows[2] (3) must be greater than the row before it and below length − first (8)");
  expect_invalid([&] { cache.keep_tokens(a, 10, {8}); }, "rows[0] (8) must be greater");
  expect_invalid([&] { cache.keep_tokens(a, 10, {-1}); }, "rows[0] (-1)");
  expect_invalid(
      [&] {
        cache.keep_tokens(a, 6, {1, 2, 3});  // into pages 1 and 2
      },
      "the pool is full: keeping the rows copies 2 shared pages, 0 are free");
  EXPECT_EQ(cache.length(a), 18);
  EXPECT_EQ(cache.block_table(a), table);
  EXPECT_EQ(cache.pages_in_use(), 5);
  cache.keep_tokens(a, 10, {0, 1, 2});  // nothing moves: no copy needed, pages released
  EXPECT_EQ(cache.length(a), 13);
  EXPECT_EQ(cache.length(b), 18);
  shadow[a] = shadow[b];
  for (Index h = 0; h < kHeads; ++h) {
    shadow[a].k[std::size_t(h)].conservativeResize(13, kDim);
    shadow[a].v[std::size_t(h)].conservativeResize(13, kDim);
  }
  expect_attention_matches(cache, shadow, apex::causal_mask(), rng);
}

/// A fork shares every page; the first append to either side copies the shared, partly filled
/// last page (and only it), and the other side's tokens and attention are unchanged.
TEST(PagedKvCache, ForkSharesPagesAndCopiesOnWrite) {
  std::mt19937 rng(4);
  apex::PagedKvCache<float> cache({kHeads, kDim, 8, 16});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId a = cache.add();
  append_random(cache, shadow, a, 20, rng);  // pages: 8 + 8 + 4
  EXPECT_EQ(cache.pages_in_use(), 3);
  EXPECT_DOUBLE_EQ(cache.fragmentation(), 4.0 / 24.0);
  const SequenceId b = cache.fork(a);
  shadow[b] = shadow[a];
  EXPECT_EQ(cache.pages_in_use(), 3);
  for (const Index page : cache.block_table(a)) EXPECT_EQ(cache.references(page), 2);
  append_random(cache, shadow, b, 1, rng);
  EXPECT_EQ(cache.pages_in_use(), 4) << "the shared last page is copied once";
  EXPECT_EQ(cache.block_table(a)[0], cache.block_table(b)[0]);
  EXPECT_EQ(cache.block_table(a)[1], cache.block_table(b)[1]);
  EXPECT_NE(cache.block_table(a)[2], cache.block_table(b)[2]);
  EXPECT_EQ(cache.references(cache.block_table(a)[2]), 1);
  append_random(cache, shadow, a, 4, rng);  // a's last page is its own now: written in place
  EXPECT_EQ(cache.pages_in_use(), 4);
  expect_attention_matches(cache, shadow, apex::causal_mask(), rng);
  cache.free(a);
  EXPECT_EQ(cache.pages_in_use(), 3);
  cache.free(b);
  EXPECT_EQ(cache.free_pages(), 16);
  EXPECT_DOUBLE_EQ(cache.fragmentation(), 0.0);
}

/// A sliding window over a long history keeps O(W) pages when the pages before the window are
/// forgotten after every token; attention with the window equals sdpa over the held tokens bit
/// for bit, and sdpa over the whole history to rounding (different key blocks).
TEST(PagedKvCache, ForgottenPagesKeepAWindowSmall) {
  std::mt19937 rng(8);
  const Index page = 16, window = 100;
  apex::PagedKvCache<float> cache({kHeads, kDim, page, 12});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId id = cache.add();
  append_random(cache, shadow, id, 50, rng);
  for (int t = 0; t < 900; ++t) {
    cache.forget_before(id, cache.length(id) - window + 1 > 0 ? cache.length(id) - window + 1 : 0);
    append_random(cache, shadow, id, 1, rng);
    ASSERT_LE(cache.pages_in_use(), (window + 2 * page - 2) / page + 1);
  }
  EXPECT_GT(cache.first_position(id), 0);
  EXPECT_EQ(cache.block_table(id)[0], -1);
  const PositionMask rule = apex::sliding_window_mask(window);
  expect_attention_matches(cache, shadow, rule, rng);
  Heads<float> q(1, 2 * kHeads, 1, kDim), out(1, 2 * kHeads, 1, kDim);
  q.randomize(rng);
  apex::sdpa_paged(q.view(), {0, 1}, cache, {id}, {rule}, apex::SdpaParams{}, out.view());
  const Heads<float> whole = contiguous_attention(shadow[id], 0, q, rule);
  for (std::size_t e = 0; e < out.size(); ++e) {
    EXPECT_NEAR(out.at(e), whole.at(e), apex::testing::Tolerances<float>::kAttention);
  }
}

/// Decoding many sequences in one call (one query each, lengths from 1 to 3000, some split
/// into key chunks) equals one call per sequence, and each the plain loops.
TEST(PagedKvCache, BatchedDecodingEqualsOneCallPerSequence) {
  std::mt19937 rng(6);
  apex::PagedKvCache<float> cache({kHeads, kDim, 32, 400});
  std::map<SequenceId, Tokens> shadow;
  std::vector<SequenceId> ids;
  for (const Index length : {1, 3000, 17, 1200, 64, 2500}) {
    ids.push_back(cache.add());
    append_random(cache, shadow, ids.back(), length, rng);
  }
  const Index q_heads = 2 * kHeads;
  std::vector<Index> cu;
  for (std::size_t i = 0; i <= ids.size(); ++i) cu.push_back(Index(i));
  Heads<float> q(1, q_heads, Index(ids.size()), kDim, apex::testing::Layout::kTokenMajor);
  Heads<float> out(1, q_heads, Index(ids.size()), kDim, apex::testing::Layout::kTokenMajor);
  q.randomize(rng);
  apex::sdpa_paged(q.view(), cu, cache, ids, {apex::causal_mask()}, apex::SdpaParams{}, out.view());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    Heads<float> one(1, q_heads, 1, kDim);
    apex::sdpa_paged(q.view().middle_rows(Index(i), 1), {0, 1}, cache, {ids[i]},
                     {apex::causal_mask()}, apex::SdpaParams{}, one.view());
    const Tokens& t = shadow[ids[i]];
    for (Index h = 0; h < q_heads; ++h) {
      EXPECT_TRUE(out.view().head(0, h).row(Index(i)) == one.view().head(0, h).row(0));
      const Index kv = apex_test::kv_head_of(h, q_heads, kHeads);
      const auto ref = apex_test::attention(
          q.head(0, h).row(Index(i)), t.k[std::size_t(kv)].cast<double>(),
          t.v[std::size_t(kv)].cast<double>(), [](Index, Index) { return true; }, nullptr,
          1.0 / std::sqrt(double(kDim)), 0.0);
      EXPECT_LE((one.head(0, h) - ref.out).cwiseAbs().maxCoeff(),
                apex::testing::Tolerances<float>::kAttention);
    }
  }
}

/// The latent cache of absorbed MLA: keys are whole rows [c_kv ‖ K_rope], values their first
/// d_kv columns; equals sdpa over the same rows stored contiguously, bit for bit.
TEST(PagedLatentCache, AttentionEqualsContiguousRows) {
  std::mt19937 rng(12);
  const Index d_kv = 24, rope_heads = 1, rope_dim = 8, width = d_kv + rope_heads * rope_dim;
  apex::PagedLatentCache<float> cache({d_kv, rope_heads, rope_dim, 16, 64});
  EXPECT_EQ(cache.bytes(), std::int64_t(64 * 16 * width * 4));
  const SequenceId a = cache.add();
  const RowMatrix<float> rows = apex::testing::random_matrix<float>(300, width, rng);
  cache.append(a, rows.topRows(200));
  const SequenceId b = cache.fork(a);
  cache.append(a, rows.bottomRows(100));
  cache.append(b, rows.bottomRows(5));
  // 4 query heads stream the rows; 16 take the GEMM path keys-major, 40 in panels (both read
  // each block of rows once for keys and values).
  for (const Index q_heads : {Index{4}, Index{16}, Index{40}}) {
    Heads<float> q(1, q_heads, 2, width), out(1, q_heads, 2, d_kv);
    q.randomize(rng);
    apex::sdpa_paged(q.view(), {0, 1, 2}, cache, {a, b}, {apex::causal_mask()}, apex::SdpaParams{},
                     out.view());
    for (const auto& [id, n, row] :
         {std::tuple{a, Index(300), Index(0)}, std::tuple{b, Index(205), Index(1)}}) {
      RowMatrix<float> held(n, width);
      held << rows.topRows(200), (id == a ? rows.bottomRows(100) : rows.bottomRows(5));
      const auto k = apex::HeadsView<const float>(held.data(), {1, 1, n, width}, {0, 0, width});
      const auto v = apex::HeadsView<const float>(held.data(), {1, 1, n, d_kv}, {0, 0, width});
      Heads<float> one(1, q_heads, 1, d_kv);
      apex::sdpa(q.view().middle_rows(row, 1), k, v,
                 apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
                 one.view());
      for (Index h = 0; h < q_heads; ++h) {
        SCOPED_TRACE("sequence " + std::to_string(id.value) + ", " + std::to_string(q_heads) +
                     " query heads");
        expect_paged_equals_contiguous(out.view().head(0, h).row(row),
                                       one.view().head(0, h).row(0));
      }
    }
  }
}

/// A pool and block tables of the caller's own (sdpa_block_tables): the pages of three
/// sequences in shuffled order, one sequence empty of queries; equals contiguous attention over
/// the gathered tokens. A table that points outside the pool, or is too short, is rejected.
TEST(PagedKvCache, BlockTablesOfTheCallersOwn) {
  std::mt19937 rng(21);
  const Index page = 8, pages = 40, q_heads = 4;
  Heads<float> k_pool(pages, kHeads, page, kDim), v_pool(pages, kHeads, page, kDim);
  k_pool.randomize(rng);
  v_pool.randomize(rng);
  std::vector<Index> order(pages);
  for (Index p = 0; p < pages; ++p) order[std::size_t(p)] = p;
  std::shuffle(order.begin(), order.end(), rng);
  apex::BlockTables<float, float> tables{k_pool.view(), v_pool.view(), {}, {100, 37, 5}};
  std::size_t next = 0;
  for (const Index length : tables.lengths) {
    tables.block_tables.emplace_back(order.begin() + long(next),
                                     order.begin() + long(next + std::size_t((length + 7) / 8)));
    next += std::size_t((length + 7) / 8);
  }
  const std::vector<Index> cu = {0, 3, 3, 4};  // 3, 0 and 1 queries
  Heads<float> q(1, q_heads, 4, kDim), out(1, q_heads, 4, kDim);
  q.randomize(rng);
  apex::sdpa_block_tables(q.view(), cu, tables, {apex::causal_mask()}, apex::SdpaParams{},
                          out.view());
  for (std::size_t i = 0; i < 3; ++i) {
    const Index length = tables.lengths[i], nq = cu[i + 1] - cu[i];
    if (nq == 0) continue;
    Heads<float> k(1, kHeads, length, kDim), v(1, kHeads, length, kDim), one(1, q_heads, nq, kDim);
    for (Index t = 0; t < length; ++t) {
      const Index p = tables.block_tables[i][std::size_t(t / page)];
      for (Index h = 0; h < kHeads; ++h) {
        k.head_map(0, h).row(t) = k_pool.view().head(p, h).row(t % page);
        v.head_map(0, h).row(t) = v_pool.view().head(p, h).row(t % page);
      }
    }
    apex::sdpa(q.view().middle_rows(cu[i], nq), k.view(), v.view(),
               apex::AttentionMask<float>{apex::causal_mask(), {}, {}}, apex::SdpaParams{},
               one.view());
    for (Index h = 0; h < q_heads; ++h) {
      expect_paged_equals_contiguous(out.view().head(0, h).middleRows(cu[i], nq),
                                     one.view().head(0, h));
    }
  }
  out.fill(float(apex::testing::kSentinel));
  const auto attend = [&](const apex::BlockTables<float, float>& t) {
    return [&, t] {
      apex::sdpa_block_tables(q.view(), cu, t, {apex::causal_mask()}, apex::SdpaParams{},
                              out.view());
    };
  };
  auto outside = tables;
  outside.block_tables[1][2] = pages;
  apex::testing::expect_invalid(attend(outside), {"[sdpa_block_tables] block_tables[1][2] (40)",
                                                  "points outside the pool of 40 pages"});
  outside.block_tables[1][2] = -1;
  apex::testing::expect_invalid(attend(outside), "block_tables[1][2] (-1)");
  auto short_table = tables;
  short_table.block_tables[0].pop_back();
  apex::testing::expect_invalid(attend(short_table), "holds 100 tokens in 12 pages of 8");
  auto missing = tables;
  missing.lengths.pop_back();
  apex::testing::expect_invalid(attend(missing), "one entry per sequence");
  EXPECT_TRUE(out.all_equal(float(apex::testing::kSentinel)));
}

/// Bad input: a clear std::invalid_argument, and nothing changes.
TEST(PagedKvCache, RejectsBadInputAndChangesNothing) {
  std::mt19937 rng(1);
  apex::PagedKvCache<float> cache({kHeads, kDim, 4, 3});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId a = cache.add();
  append_random(cache, shadow, a, 10, rng);  // 3 pages: the pool is full
  const SequenceId gone = cache.add();
  cache.free(gone);
  Heads<float> k(1, kHeads, 3, kDim), v(1, kHeads, 3, kDim);
  using apex::testing::expect_invalid;
  expect_invalid([&] { cache.append(a, k.view(), v.view()); },
                 {"[paged_kv_cache] the pool is full", "needs 1 pages, 0 of 3 are free"});
  EXPECT_EQ(cache.length(a), 10);
  expect_invalid([&] { cache.append(gone, k.view(), v.view()); },
                 {"sequence " + std::to_string(gone.value), "does not exist"});
  expect_invalid([&] { cache.fork(gone); }, "does not exist (never added, or freed)");
  expect_invalid([&] { cache.free(gone); }, "does not exist");
  expect_invalid([&] { cache.length(SequenceId{99}); }, "sequence 99 does not exist");
  Heads<float> wide(1, kHeads, 1, kDim + 1);
  expect_invalid([&] { cache.append(a, wide.view(), wide.view()); }, "[1, H_kv, n, d_h]");
  expect_invalid([&] { cache.truncate(a, 11); }, "new length (11) must be in [0, 10]");
  expect_invalid([&] { cache.forget_before(a, -1); }, "position (-1) must be in [0, 10]");
  EXPECT_EQ(cache.pages_in_use(), 3);

  Heads<float> q(1, 2 * kHeads, 2, kDim), out(1, 2 * kHeads, 2, kDim);
  out.fill(float(apex::testing::kSentinel));
  const auto attend = [&](const std::vector<Index>& cu, const std::vector<SequenceId>& ids,
                          const PositionMask& rule) {
    return [&, cu, ids, rule] {
      apex::sdpa_paged(q.view(), cu, cache, ids, {rule}, apex::SdpaParams{}, out.view());
    };
  };
  expect_invalid(attend({0, 2}, {gone}, apex::causal_mask()), "does not exist");
  expect_invalid(attend({0, 1}, {a}, apex::causal_mask()), "cu_seqlens_q ends at 1");
  expect_invalid(attend({1, 2}, {a}, apex::causal_mask()), "cu_seqlens_q[0] (1) must be 0");
  PositionMask offset = apex::causal_mask();
  offset.query_offset = 0;
  expect_invalid(attend({0, 2}, {a}, offset), "sets query_offset or key_offset");
  const SequenceId short_one = [&] {
    apex::PagedKvCache<float>& c = cache;
    c.truncate(a, 1);
    return a;
  }();
  expect_invalid(attend({0, 2}, {short_one}, apex::causal_mask()),
                 "has 2 queries but holds 1 tokens");
  EXPECT_TRUE(out.all_equal(float(apex::testing::kSentinel)));

  apex::PagedKvCache<float> moved = std::move(cache);
  EXPECT_EQ(cache.num_pages(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(cache.sequences(), 0);  // NOLINT(bugprone-use-after-move)
  expect_invalid([&] { cache.add(); }, "the cache is empty");  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved.length(a), 1);
  expect_invalid([] { apex::PagedKvCache<float>({kHeads, kDim, 0, 4}); }, "page_size (0)");
  expect_invalid([] { apex::PagedLatentCache<float>({8, 1, 3, 4, 4}); }, "rope_dim (3)");
}

/// Alias checks that do not depend on the order of the arguments: an output inside the cache's
/// pages is rejected whatever sequences the call names, in whatever order, empty or not, and the
/// pages stay as they were.
TEST(PagedKvCache, AliasChecksIndependentOfOrder_OutputsInsideThePool) {
  std::mt19937 rng(5);
  apex::PagedKvCache<float> cache({kHeads, kDim, 4, 8});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId empty = cache.add();
  const SequenceId full = cache.add();
  const SequenceId other = cache.add();
  append_random(cache, shadow, full, 6, rng);
  append_random(cache, shadow, other, 3, rng);
  const apex::HeadsView<const float> k_pool = cache.segment(full).k;
  const apex::HeadsView<const float> v_pool = cache.segment(full).v;
  // Views of 2 query heads × 1 row of d_h over the start of each pool (a caller's bug).
  auto* k_bytes = const_cast<float*>(k_pool.data());  // NOLINT: the call must refuse to write
  auto* v_bytes = const_cast<float*>(v_pool.data());  // NOLINT
  const std::vector<float> k_before(k_bytes, k_bytes + 2 * kDim);
  const std::vector<float> v_before(v_bytes, v_bytes + 2 * kDim);
  Heads<float> q(1, 2, 1, kDim), out(1, 2, 1, kDim), lse(1, 2, 1, 1);
  q.randomize(rng);
  const auto in_pool = [](float* at, Index dim) {
    return apex::HeadsView<float>::contiguous(at, {1, 2, 1, dim});
  };
  using apex::testing::expect_invalid;
  const std::vector<std::vector<SequenceId>> orders = {
      {empty, full}, {full, empty}, {empty, other}, {other}, {empty, full, other}};
  for (const auto& ids : orders) {
    std::vector<Index> cu(ids.size() + 1, 0);
    cu.back() = 1;  // the last sequence named holds the one query
    for (float* pool : {k_bytes, v_bytes}) {
      expect_invalid(
          [&] {
            apex::sdpa_paged(q.view(), cu, cache, ids, {apex::causal_mask()}, apex::SdpaParams{},
                             in_pool(pool, kDim));
          },
          "[sdpa_paged] out must not share memory with the cache's pages");
      expect_invalid(
          [&] {
            apex::sdpa_paged(q.view(), cu, cache, ids, {apex::causal_mask()}, apex::SdpaParams{},
                             out.view(), in_pool(pool, 1));
          },
          "[sdpa_paged] lse must not share memory with the cache's pages");
    }
  }
  EXPECT_EQ(std::vector<float>(k_bytes, k_bytes + 2 * kDim), k_before);
  EXPECT_EQ(std::vector<float>(v_bytes, v_bytes + 2 * kDim), v_before);
  // The same call with outputs of its own runs.
  apex::sdpa_paged(q.view(), {0, 0, 1}, cache, {empty, full}, {apex::causal_mask()},
                   apex::SdpaParams{}, out.view(), lse.view());
  EXPECT_TRUE(std::isfinite(lse.view().head(0, 0)(0, 0)));
}

/// Alias checks of sdpa_block_tables cover the block tables too: the kernel reads them while it
/// writes the outputs.
TEST(PagedKvCache, AliasChecksIndependentOfOrder_OutputsOverABlockTable) {
  std::mt19937 rng(6);
  constexpr Index kWidth = 2;  // d: an output of 2 heads × 1 row × 2 floats is 16 bytes
  Heads<float> k_pool(4, kHeads, 4, kWidth), v_pool(4, kHeads, 4, kWidth);
  k_pool.randomize(rng);
  v_pool.randomize(rng);
  // The first sequence is empty, so the second one's table is the only one with bytes.
  apex::BlockTables<float, float> tables{k_pool.view(), v_pool.view(), {{}, {0, 1, 2, 3}}, {0, 13}};
  Heads<float> q(1, 2, 1, kWidth);
  q.randomize(rng);
  const std::vector<Index> before = tables.block_tables[1];
  const auto over_table = apex::HeadsView<float>::contiguous(
      reinterpret_cast<float*>(tables.block_tables[1].data()), {1, 2, 1, kWidth});
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_block_tables(q.view(), {0, 0, 1}, tables, {apex::causal_mask()},
                                apex::SdpaParams{}, over_table);
      },
      "[sdpa_block_tables] the outputs must not share memory with block_tables[1]");
  EXPECT_EQ(tables.block_tables[1], before);
}

/// Unchecked arithmetic on sizes that users give: a length near the largest Index is an error
/// (the page count is not computed as the overflowing (length + page − 1) / page), and so is a
/// latent row width that does not fit.
TEST(PagedKvCache, UncheckedArithmetic_HugeLengthsAndWidthsAreRejected) {
  Heads<float> k_pool(4, kHeads, 8, kDim), v_pool(4, kHeads, 8, kDim);
  constexpr Index kMax = std::numeric_limits<Index>::max();
  apex::BlockTables<float, float> tables{k_pool.view(), v_pool.view(), {{0, 1}}, {kMax}};
  Heads<float> q(1, 2, 1, kDim), out(1, 2, 1, kDim);
  out.fill(float(apex::testing::kSentinel));
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_block_tables(q.view(), {0, 1}, tables, {apex::causal_mask()}, apex::SdpaParams{},
                                out.view());
      },
      {"[sdpa_block_tables] sequence 0 holds 9223372036854775807 tokens in 2 pages of 8",
       "⌈length / page⌉ pages"});
  EXPECT_TRUE(out.all_equal(float(apex::testing::kSentinel)));
  apex::testing::expect_invalid(
      [] {
        apex::PagedLatentCache<float>({kMax, 1, 2, 4, 4});
      },
      {"[paged_latent_cache] d_kv + H_kr·d_r (9223372036854775807 + 2)", "fit in 64 bits"});
}

/// Errors that name the call the user made: an unknown id, or a full pool, reported by
/// sdpa_paged and not by the cache it asked.
TEST(PagedKvCache, ErrorsNameTheCall_UnknownIdsInSdpaPaged) {
  std::mt19937 rng(7);
  apex::PagedKvCache<float> cache({kHeads, kDim, 4, 4});
  std::map<SequenceId, Tokens> shadow;
  const SequenceId a = cache.add();
  append_random(cache, shadow, a, 5, rng);
  const SequenceId gone = cache.add();
  cache.free(gone);
  Heads<float> q(1, 2, 2, kDim), out(1, 2, 2, kDim);
  apex::testing::expect_invalid(
      [&] {
        apex::sdpa_paged(q.view(), {0, 1, 2}, cache, {a, gone}, {apex::causal_mask()},
                         apex::SdpaParams{}, out.view());
      },
      {"[sdpa_paged] ids[1]: sequence " + std::to_string(gone.value),
       "does not exist in the cache"});
  apex::testing::expect_invalid(
      [&] {
        cache.check_appends({{a, 100}}, "my_step");
      },
      {"[my_step] the pool is full", "the step needs 25 pages"});
}

/// The value stored for row 0 of a one-sequence paged cache, column c of key head h.
template <class Cache>
double stored_key(const Cache& cache, SequenceId id, Index h, Index c) {
  const auto segment = cache.segment(id);
  return static_cast<double>(segment.k.head(segment.pages[0], h)(0, c));
}

// Doubles appended to a 16-bit paged cache are rounded once to the storage type, as every cache
// of apex rounds them (KvFormat::store_rows): not double → float → half, which rounds twice.
// 1 + 2^-11 + 2^-40 lies just above the tie between two halves: once rounded it is 1 + 2^-10,
// twice rounded (the 2^-40 lost in float, then the tie to even) it would be 1.
TEST(PagedKvCache, DoublesAreRoundedOnceToTheStorageType) {
  const double x = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  const double y = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);  // the same for bfloat16
  ASSERT_EQ(static_cast<double>(apex::round_to<Eigen::half>(x)), 1.0 + std::ldexp(1.0, -10));
  ASSERT_EQ(static_cast<double>(apex::round_to<Eigen::bfloat16>(y)), 1.0 + std::ldexp(1.0, -7));

  apex::PagedKvCache<double, Eigen::half> kv({2, 4, 8, 2});
  const SequenceId a = kv.add();
  Heads<double> k(1, 2, 1, 4), v(1, 2, 1, 4);
  k.fill(x);
  v.fill(x);
  kv.append(a, k.view(), v.view());
  for (Index h = 0; h < 2; ++h) {
    for (Index c = 0; c < 4; ++c) EXPECT_EQ(stored_key(kv, a, h, c), 1.0 + std::ldexp(1.0, -10));
  }

  apex::PagedLatentCache<double, Eigen::bfloat16> latent({4, 1, 2, 8, 2});
  const SequenceId b = latent.add();
  RowMatrix<double> rows = RowMatrix<double>::Constant(1, 6, y);
  latent.append(b, rows);
  for (Index c = 0; c < 6; ++c) EXPECT_EQ(stored_key(latent, b, 0, c), 1.0 + std::ldexp(1.0, -7));
}

// ---- cascade attention (cascade_attention.hpp)
// --------------------------------------------------- sdpa_cascade against the plain double loops
// of reference/attention.hpp over every sequence's tokens, for random histories of add / append /
// fork (so prefixes shared at several levels), every kind of position rule, sinks, soft-capping and
// ALiBi, GQA groups {1, 4, 16}; against sdpa_paged bit for bit where nothing is shared; its plan
// (each shared page read once); threads; bad input.
namespace cascade {

using apex_test::MatrixD;

/// A paged cache of float and the shadow of its sequences (the Tokens above).
struct Shadowed {
  explicit Shadowed(Index page) : cache({kHeads, kDim, page, 256}) {}
  apex::PagedKvCache<float> cache;
  std::map<SequenceId, Tokens> tokens;

  SequenceId add() {
    const SequenceId id = cache.add();
    tokens[id];
    return id;
  }
  SequenceId fork(SequenceId parent) {
    const SequenceId id = cache.fork(parent);
    tokens[id] = tokens[parent];
    return id;
  }
  void append(SequenceId id, Index n, std::mt19937& rng) {
    append_random(cache, tokens, id, n, rng);
  }
};

/// A prompt of `prompt` tokens, then `steps` random forks and appends: sequences sharing pages at
/// several levels. Returns the live ids in order.
std::vector<SequenceId> random_family(Shadowed& s, Index prompt, int steps, std::mt19937& rng) {
  std::vector<SequenceId> ids{s.add()};
  s.append(ids[0], prompt, rng);
  for (int step = 0; step < steps; ++step) {
    const SequenceId pick = ids[std::uniform_int_distribution<std::size_t>(0, ids.size() - 1)(rng)];
    if (rng() % 2 == 0) {
      ids.push_back(s.fork(pick));
    } else {
      s.append(pick, std::uniform_int_distribution<Index>(1, 12)(rng), rng);
    }
  }
  return ids;
}

/// The reference's form of a PositionMask (no offsets: the positions are the sequence's own).
apex_test::MaskRule reference_rule(const PositionMask& m) {
  apex_test::MaskRule r;
  r.causal = m.causal;
  r.window = m.window.value_or(0);
  r.chunk = m.chunk.value_or(0);
  r.prefix = m.prefix;
  return r;
}

/// One call's queries (the last cu[i + 1] − cu[i] tokens of ids[i]: `each`, or 1 to 3 by id, as
/// many as the sequence holds at most).
struct Call {
  std::vector<SequenceId> ids;
  std::vector<Index> cu{0};
  Heads<double> q;
  Call(const Shadowed& s, std::vector<SequenceId> sequences, Index q_heads, std::mt19937& rng,
       Index each = 0)
      : ids(std::move(sequences)), q(1, q_heads, 0, kDim) {
    for (const SequenceId id : ids) {
      const Index held = s.tokens.at(id).length();
      cu.push_back(cu.back() + std::min<Index>(held, each > 0 ? each : 1 + id.value % 3));
    }
    q = Heads<double>(1, q_heads, cu.back(), kDim, apex::testing::Layout::kTokenMajor);
    q.randomize(rng);
  }
  template <class T>
  Heads<T> queries() const {
    Heads<T> out(1, q.heads(), q.seq(), kDim);
    for (Index h = 0; h < q.heads(); ++h) out.head_map(0, h) = q.head(0, h).cast<T>();
    return out;
  }
};

/// The plain loops over each sequence's tokens: out [H_q, total_q, d] and lse, as double heads.
std::pair<Heads<double>, Heads<double>> reference(const Shadowed& s, const Call& call,
                                                  const PositionMask& rule,
                                                  const apex::SdpaParams& params) {
  const Index q_heads = call.q.heads(), total = call.q.seq();
  Heads<double> out(1, q_heads, total, kDim), lse(1, q_heads, total, 1);
  const apex_test::MaskRule r = reference_rule(rule);
  for (std::size_t i = 0; i < call.ids.size(); ++i) {
    const Tokens& t = s.tokens.at(call.ids[i]);
    const Index q0 = call.cu[i], nq = call.cu[i + 1] - q0, first = t.length() - nq;
    for (Index h = 0; h < q_heads; ++h) {
      const Index g = apex_test::kv_head_of(h, q_heads, kHeads);
      const double slope = params.alibi_slopes.empty() ? 0.0 : params.alibi_slopes[std::size_t(h)];
      MatrixD bias(nq, t.length());
      for (Index a = 0; a < nq; ++a) {
        for (Index j = 0; j < t.length(); ++j) bias(a, j) = slope * double(j - (first + a));
      }
      const double sink = params.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                               : params.sinks[std::size_t(h)];
      const auto result = apex_test::attention(
          call.q.head(0, h).middleRows(q0, nq), t.k[std::size_t(g)].cast<double>(),
          t.v[std::size_t(g)].cast<double>(),
          [&](Index a, Index j) { return apex_test::rule_allows(r, first + a, j); }, &bias,
          params.scale.value_or(1.0 / std::sqrt(double(kDim))), params.softcap, sink);
      out.head_map(0, h).middleRows(q0, nq) = result.out;
      lse.head_map(0, h).middleRows(q0, nq) = result.lse;
    }
  }
  return {std::move(out), std::move(lse)};
}

/// Normwise as kAttention says: max |out − ref| ≤ tol · max |ref|, lse ≤ tol · max(1, max |lse|).
template <class T>
void expect_near_reference(const Heads<T>& out, const Heads<T>& lse,
                           const std::pair<Heads<double>, Heads<double>>& expected, double tol) {
  double out_scale = 0, lse_scale = 1, out_error = 0, lse_error = 0;
  for (Index h = 0; h < out.heads(); ++h) {
    const MatrixD want = expected.first.head(0, h), got = out.head(0, h);
    const MatrixD want_lse = expected.second.head(0, h), got_lse = lse.head(0, h);
    out_scale = std::max(out_scale, want.cwiseAbs().maxCoeff());
    out_error = std::max(out_error, (got - want).cwiseAbs().maxCoeff());
    for (Index i = 0; i < want_lse.rows(); ++i) {
      if (std::isinf(want_lse(i, 0))) {
        EXPECT_EQ(got_lse(i, 0), want_lse(i, 0)) << "head " << h << ", row " << i;
        continue;
      }
      lse_scale = std::max(lse_scale, std::abs(want_lse(i, 0)));
      lse_error = std::max(lse_error, std::abs(got_lse(i, 0) - want_lse(i, 0)));
    }
  }
  EXPECT_LE(out_error, tol * out_scale);
  EXPECT_LE(lse_error, tol * lse_scale);
}

/// The position rules of the tests: none, causal, windows that end inside or beyond a shared
/// prompt, chunks, and a bidirectional prefix.
std::vector<std::pair<std::string, PositionMask>> rules() {
  PositionMask prefix = apex::causal_mask();
  prefix.prefix = 6;
  PositionMask chunks = apex::causal_mask();
  chunks.chunk = 16;
  return {{"none", PositionMask{}},
          {"causal", apex::causal_mask()},
          {"window 7", apex::sliding_window_mask(7)},
          {"window 500", apex::sliding_window_mask(500)},
          {"chunk 16", chunks},
          {"prefix 6", prefix}};
}

/// The score terms of the tests, for H_q heads.
std::vector<std::pair<std::string, apex::SdpaParams>> score_terms(Index q_heads) {
  apex::SdpaParams sinks;
  for (Index h = 0; h < q_heads; ++h) sinks.sinks.push_back(0.25 * double(h % 5) - 0.5);
  apex::SdpaParams capped;
  capped.softcap = 2.0;
  capped.scale = 0.9;
  apex::SdpaParams alibi;
  alibi.alibi_slopes = apex::alibi_slopes(q_heads);
  return {{"plain", {}}, {"sinks", sinks}, {"softcap", capped}, {"alibi", alibi}};
}

/// The plan of a call: its views, as sdpa_cascade makes them.
apex::CascadePlan plan_of(const Shadowed& s, const Call& call, const PositionMask& rule,
                          const apex::SdpaParams& params = {}) {
  const Heads<float> q = call.queries<float>();
  Heads<float> out(1, q.heads(), q.seq(), kDim);
  const auto views = apex::detail::paged_sequence_views<float>(
      q.view(), call.cu, s.cache, call.ids, {rule}, params, out.view(), apex::HeadsView<float>{},
      apex::AttentionMask<float>{}, "test");
  return apex::detail::plan_cascade(apex::detail::cascade_sequences(views));
}

template <class T>
void run_random_families(double tol) {
  std::mt19937 rng(11);
  Index levels = 0;  // shared passes of the causal calls
  for (const Index group : {1, 4, 16}) {
    for (int trial = 0; trial < 3; ++trial) {
      const Index page = Index{4} << (trial % 3);
      Shadowed s(page);
      const std::vector<SequenceId> ids =
          random_family(s, std::uniform_int_distribution<Index>(2 * page, 40)(rng), 14, rng);
      const Call call(s, ids, group * kHeads, rng);
      const Heads<T> q = call.queries<T>();
      levels += Index(plan_of(s, call, apex::causal_mask()).shared.size());
      for (const auto& [rule_name, rule] : rules()) {
        for (const auto& [terms_name, params] : score_terms(group * kHeads)) {
          SCOPED_TRACE("G " + std::to_string(group) + ", page " + std::to_string(page) + ", " +
                       rule_name + ", " + terms_name);
          Heads<T> out(1, q.heads(), q.seq(), kDim), lse(1, q.heads(), q.seq(), 1);
          apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {rule}, params, out.view(),
                             lse.view());
          expect_near_reference(out, lse, reference(s, call, rule, params), tol);
        }
      }
    }
  }
  EXPECT_GE(levels, 9 * 2) << "the families share pages, at two levels or more";
}

TEST(SdpaCascade, RandomSharingEqualsThePlainLoops_Float) {
  run_random_families<float>(apex::testing::Tolerances<float>::kAttention);
}

TEST(SdpaCascade, RandomSharingEqualsThePlainLoops_Double) {
  run_random_families<double>(apex::testing::Tolerances<double>::kAttention);
}

/// A prompt of 5 pages shared by five sequences, two more pages shared by three of them, then
/// one decoded token each: two passes, the second nested in the first, and every page of the
/// cache read exactly once (against 5·5 + 3·2 + 5 page reads one sequence at a time).
TEST(SdpaCascade, PlanReadsEverySharedPageOnce) {
  std::mt19937 rng(3);
  const Index page = 4;
  Shadowed s(page);
  const SequenceId root = s.add();
  s.append(root, 5 * page, rng);
  const SequenceId a = s.fork(root), b = s.fork(root);
  s.append(a, 2 * page, rng);
  const SequenceId a1 = s.fork(a), a2 = s.fork(a);
  const std::vector<SequenceId> ids{root, a, b, a1, a2};
  for (const SequenceId id : ids) s.append(id, 1, rng);
  const Call call(s, ids, 4 * kHeads, rng, 1);
  const apex::CascadePlan plan = plan_of(s, call, apex::causal_mask());
  ASSERT_EQ(plan.shared.size(), 2U);
  EXPECT_EQ(plan.shared[0].first_key, 0);
  EXPECT_EQ(plan.shared[0].keys, 5 * page);
  EXPECT_EQ(plan.shared[0].members, (std::vector<Index>{0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.shared[1].first_key, 5 * page);
  EXPECT_EQ(plan.shared[1].keys, 2 * page);
  EXPECT_EQ(plan.shared[1].members, (std::vector<Index>{1, 3, 4}));
  EXPECT_EQ(plan.own_first_key, (std::vector<Index>{20, 28, 20, 28, 28}));
  std::multiset<Index> read;
  for (const apex::SharedPass& pass : plan.shared) {
    const auto table = s.cache.block_table(ids[std::size_t(pass.members.front())]);
    for (Index p = pass.first_key / page; p < (pass.first_key + pass.keys) / page; ++p) {
      read.insert(table[std::size_t(p)]);
    }
  }
  Index one_by_one = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto table = s.cache.block_table(ids[i]);
    one_by_one += Index(table.size());
    for (auto p = std::size_t(plan.own_first_key[i] / page); p < table.size(); ++p) {
      read.insert(table[p]);
    }
  }
  EXPECT_EQ(Index(read.size()), s.cache.pages_in_use());
  EXPECT_EQ(Index(std::set<Index>(read.begin(), read.end()).size()), s.cache.pages_in_use())
      << "no page read twice";
  EXPECT_EQ(one_by_one, 5 * 5 + 3 * 2 + 5);
  // A window that ends inside the prompt shares nothing.
  EXPECT_TRUE(plan_of(s, call, apex::sliding_window_mask(8)).shared.empty());
}

/// Where no pages are shared (separate sequences), sdpa_cascade is sdpa_paged, bit for bit.
TEST(SdpaCascade, NothingSharedIsSdpaPagedBitForBit) {
  std::mt19937 rng(5);
  Shadowed s(8);
  std::vector<SequenceId> ids;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(s.add());
    s.append(ids.back(), 10 + 9 * i, rng);
  }
  const Call call(s, ids, 4 * kHeads, rng);
  const Heads<float> q = call.queries<float>();
  for (const auto& [terms_name, params] : score_terms(q.heads())) {
    SCOPED_TRACE(terms_name);
    Heads<float> a(1, q.heads(), q.seq(), kDim), b(1, q.heads(), q.seq(), kDim);
    Heads<float> la(1, q.heads(), q.seq(), 1), lb(1, q.heads(), q.seq(), 1);
    apex::sdpa_cascade(q.view(), call.cu, s.cache, ids, {apex::causal_mask()}, params, a.view(),
                       la.view());
    apex::sdpa_paged(q.view(), call.cu, s.cache, ids, {apex::causal_mask()}, params, b.view(),
                     lb.view());
    for (std::size_t e = 0; e < a.size(); ++e) ASSERT_EQ(a.at(e), b.at(e)) << "element " << e;
    for (std::size_t e = 0; e < la.size(); ++e) ASSERT_EQ(la.at(e), lb.at(e)) << "lse " << e;
  }
}

#ifdef _OPENMP
/// One thread and two give the same bits.
TEST(SdpaCascade, BitIdenticalForAnyNumberOfThreads) {
  std::mt19937 rng(9);
  Shadowed s(4);
  const std::vector<SequenceId> ids = random_family(s, 24, 16, rng);
  const Call call(s, ids, 4 * kHeads, rng);
  const Heads<float> q = call.queries<float>();
  const auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Heads<float> out(1, q.heads(), q.seq(), kDim);
    apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {apex::causal_mask()},
                       score_terms(q.heads())[1].second, out.view());
    omp_set_num_threads(saved);
    return out;
  };
  const Heads<float> one = run(1), two = run(2);
  ASSERT_FALSE(plan_of(s, call, apex::causal_mask()).shared.empty());
  for (std::size_t e = 0; e < one.size(); ++e) ASSERT_EQ(one.at(e), two.at(e)) << "element " << e;
}
#endif

/// Bad input: the errors of sdpa_paged, named sdpa_cascade, and the output untouched.
TEST(SdpaCascade, RejectsBadInputAndChangesNothing) {
  std::mt19937 rng(2);
  Shadowed s(4);
  const SequenceId a = s.add();
  s.append(a, 12, rng);
  const SequenceId b = s.fork(a);
  s.append(b, 2, rng);
  const Call call(s, {a, b}, 2 * kHeads, rng);
  const Heads<float> q = call.queries<float>();
  Heads<float> out(1, q.heads(), q.seq(), kDim);
  out.fill(7.0F);
  const auto expect_rejected = [&](const auto& run, const std::string& words) {
    try {
      run();
      ADD_FAILURE() << "no error; expected one naming " << words;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("sdpa_cascade"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.all_equal(7.0F));
  };
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), {0, 1, 99}, s.cache, call.ids, {apex::causal_mask()}, {},
                           out.view());
      },
      "cu_seqlens_q");
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), call.cu, s.cache, {a, SequenceId{42}}, {apex::causal_mask()},
                           {}, out.view());
      },
      "ids[1]");
  PositionMask offset = apex::causal_mask();
  offset.key_offset = 3;
  expect_rejected(
      [&] { apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {offset}, {}, out.view()); },
      "key_offset");
  expect_rejected(
      [&] {
        apex::sdpa_cascade(q.view(), call.cu, s.cache, call.ids, {apex::causal_mask()}, {},
                           out.view().middle_rows(0, 1));
      },
      "out");
}

}  // namespace cascade

}  // namespace
}  // namespace paged_cache_test
