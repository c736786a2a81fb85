// SPDX-License-Identifier: MIT
// Decoding layer by layer: GroupedQueryAttention::forward_cached (full and sliding-window
// caches, MHA and GQA configs) and MultiHeadLatentAttention::forward_cached (naive) and
// forward_absorbed, fed a sequence one token (or one chunk) at a time, against the layer's own
// forward() over the whole sequence, which is itself tested against plain loops in gqa_test and
// mla_test. Also absorbed against naive MLA on random weights, chunked against one-shot prefill,
// and bad input.
#include <apex/gqa.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_quant.hpp>
#include <apex/mask.hpp>
#include <apex/mha.hpp>
#include <apex/mla.hpp>
#include <apex/rope.hpp>
#include <apex/sdpa.hpp>
#include <apex/yarn.hpp>

#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.hpp"
#include "tolerances.hpp"

namespace decode_test {
namespace {

using apex::AttentionLayerParams;
using apex::AttentionMask;
using apex::GqaConfig;
using apex::GroupedQueryAttention;
using apex::Index;
using apex::KvCache;
using apex::LatentCache;
using apex::MlaConfig;
using apex::MultiHeadLatentAttention;
using apex::PositionMask;
using apex::RopeTable;
using apex::RowMatrix;
using apex::SlidingWindowCache;
using apex::testing::expect_invalid;
using apex::testing::random_matrix;

// Sequence length of the one-token-at-a-time tests: with W = 64 the ring wraps 15 times. (The
// whole file takes about 1 s in release and well under a minute in the debug preset with
// AddressSanitizer and UndefinedBehaviorSanitizer, so debug builds run the same length.)
constexpr Index kTokens = 1000;
constexpr Index kWindow = 64;

constexpr Index kBatch = 2;

// Decoding against one forward pass: |Δ| ≤ tol · max|row| for every row of the outputs. Both
// sides run the same formulas in the same scalar type but sum in different orders (different
// key blocks, partial softmaxes merged through their statistics, and for absorbed MLA
// (q W_UKᵀ)·c instead of q·(c W_UK)); with O(1) inputs and softmaxes over up to 1000 keys that is
// a few hundred float ulps, well inside 1e-4 (tolerances.hpp, kDecode). A wrong position, key or
// scale moves rows by O(0.1).
template <class Scalar>
constexpr double kTol = apex::testing::Tolerances<Scalar>::kDecode;

template <class Scalar>
void expect_rows_close(const RowMatrix<Scalar>& actual, const RowMatrix<Scalar>& expected,
                       double tol, const std::string& what) {
  ASSERT_EQ(actual.rows(), expected.rows()) << what;
  ASSERT_EQ(actual.cols(), expected.cols()) << what;
  Index failures = 0;
  for (Index r = 0; r < expected.rows() && failures < 5; ++r) {
    const double scale = expected.row(r).cwiseAbs().maxCoeff();
    const double error = (actual.row(r) - expected.row(r)).cwiseAbs().maxCoeff();
    if (error > tol * std::max(scale, 1e-30)) {
      ADD_FAILURE() << what << ": row " << r << " differs by " << error << " (row max " << scale
                    << ")";
      ++failures;
    }
  }
}

// Rows [first, first + n) of every batch block of x [B*T, cols].
template <class Scalar>
RowMatrix<Scalar> rows_of(const RowMatrix<Scalar>& x, Index batch, Index first, Index n) {
  const Index total = x.rows() / batch;
  RowMatrix<Scalar> chunk(batch * n, x.cols());
  for (Index b = 0; b < batch; ++b) chunk.middleRows(b * n, n) = x.middleRows(b * total + first, n);
  return chunk;
}

// Feeds x [B*T, d] to step(chunk [B*n, d], position) -> [B*n, d]: first `first` tokens, then
// chunks cycling through `pattern`, and reassembles the outputs as [B*T, d].
template <class Scalar, class Step>
RowMatrix<Scalar> run_in_chunks(const RowMatrix<Scalar>& x, Index batch, Index first,
                                const std::vector<Index>& pattern, Step step) {
  const Index total = x.rows() / batch;
  RowMatrix<Scalar> result(x.rows(), x.cols());
  Index position = 0;
  std::size_t next = 0;
  while (position < total) {
    Index n = position == 0 ? first : pattern[next++ % pattern.size()];
    n = std::min(n, total - position);
    const RowMatrix<Scalar> out = step(rows_of(x, batch, position, n), position);
    for (Index b = 0; b < batch; ++b) {
      result.middleRows(b * total + position, n) = out.middleRows(b * n, n);
    }
    position += n;
  }
  return result;
}

// The RoPE table and softmax scale of a test variant: plain RoPE, or YaRN with s = 8 over an
// original context of 128 (so positions up to 1024 are in reach and kTokens runs far past L).
template <class Scalar>
struct RopeSetup {
  RopeTable<Scalar> table;
  apex::SdpaParams attention;
};

template <class Scalar>
RopeSetup<Scalar> rope_setup(bool yarn, Index rotary, Index qk_dim,
                             apex::YarnTemperature temperature) {
  if (!yarn) return {RopeTable<Scalar>(kTokens, rotary), {}};
  apex::YarnParams p;
  p.scale = 8.0;
  p.original_context = 128;
  p.temperature = temperature;
  apex::SdpaParams attention;
  attention.scale = apex::yarn_softmax_scale_multiplier(p) / std::sqrt(static_cast<double>(qk_dim));
  return {apex::yarn_table<Scalar>(kTokens, rotary, 0, apex::RopePairing::kInterleaved, p),
          attention};
}

template <class Scalar>
AttentionLayerParams<Scalar> layer_params(const RopeSetup<Scalar>& setup, Index position) {
  AttentionLayerParams<Scalar> params;
  params.rope = &setup.table;
  params.attention = setup.attention;
  params.position_offset = position;
  return params;
}

PositionMask rule_with(PositionMask rule, Index prefix) {
  rule.prefix = prefix;
  return rule;
}

template <class Layer, class Scalar>
RowMatrix<Scalar> forward_oracle(const Layer& layer, const RowMatrix<Scalar>& x,
                                 const PositionMask& rule, const RopeSetup<Scalar>& setup) {
  AttentionMask<Scalar> mask;
  mask.positions = rule;
  return layer.forward(x, kBatch, mask, layer_params(setup, 0));
}

struct Variant {
  Index prefix;
  bool yarn;
  std::string name() const {
    return "prefix " + std::to_string(prefix) + (yarn ? ", YaRN" : ", plain RoPE");
  }
};
const std::vector<Variant> kVariants = {{0, false}, {9, false}, {0, true}, {9, true}};

// One token at a time after the prefix (or after the first token when there is none).
Index first_chunk(const Variant& v) { return std::max<Index>(v.prefix, 1); }

// ---------------------------------------------------------------------------------------------
// One token at a time = one forward pass (float, N = kTokens)
// ---------------------------------------------------------------------------------------------

TEST(Decode, MhaWithFullCacheMatchesForwardOneTokenAtATime) {
  const apex::testing::OneThread one_thread;
  const auto layer = GroupedQueryAttention<float>::random(GqaConfig::multi_head(16, 2, 8), 101);
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 102);
  for (const Variant& v : kVariants) {
    const auto setup = rope_setup<float>(v.yarn, 8, 8, apex::YarnTemperature::kInTables);
    const PositionMask rule = rule_with(apex::causal_mask(), v.prefix);
    KvCache<float> cache = layer.make_cache(kBatch, kTokens);
    const RowMatrix<float> decoded =
        run_in_chunks(x, kBatch, first_chunk(v), {1}, [&](const RowMatrix<float>& c, Index p) {
          return layer.forward_cached(c, rule, layer_params(setup, p), cache);
        });
    expect_rows_close(decoded, forward_oracle(layer, x, rule, setup), kTol<float>,
                      "MHA, " + v.name());
    EXPECT_EQ(cache.next_position(), kTokens);
  }
}

TEST(Decode, GqaWithSlidingWindowCacheMatchesForwardOneTokenAtATime) {
  const apex::testing::OneThread one_thread;
  const auto layer = GroupedQueryAttention<float>::random(GqaConfig{16, 4, 2, 6}, 111);
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 112);
  for (const Variant& v : kVariants) {
    const auto setup = rope_setup<float>(v.yarn, 6, 6, apex::YarnTemperature::kSoftmaxScale);
    const PositionMask rule = rule_with(apex::sliding_window_mask(kWindow), v.prefix);
    const RowMatrix<float> expected = forward_oracle(layer, x, rule, setup);
    // The ring of W = 64 slots, which wraps many times...
    SlidingWindowCache<float> ring = layer.make_window_cache(kBatch, kWindow);
    const std::int64_t ring_bytes = ring.bytes();
    const RowMatrix<float> decoded =
        run_in_chunks(x, kBatch, first_chunk(v), {1}, [&](const RowMatrix<float>& c, Index p) {
          RowMatrix<float> out = layer.forward_cached(c, rule, layer_params(setup, p), ring);
          EXPECT_EQ(ring.bytes(), ring_bytes);
          return out;
        });
    expect_rows_close(decoded, expected, kTol<float>, "GQA, window cache, " + v.name());
    EXPECT_EQ(ring.next_position(), kTokens);
    // ... and a full cache under the same windowed rule.
    KvCache<float> full = layer.make_cache(kBatch, kTokens);
    const RowMatrix<float> decoded_full =
        run_in_chunks(x, kBatch, first_chunk(v), {1}, [&](const RowMatrix<float>& c, Index p) {
          return layer.forward_cached(c, rule, layer_params(setup, p), full);
        });
    expect_rows_close(decoded_full, expected, kTol<float>, "GQA, full cache, " + v.name());
  }
}

// ---------------------------------------------------------------------------------------------
// 16-bit caches (Eigen::half, Eigen::bfloat16): decoding = one forward pass on the stored K and V
// ---------------------------------------------------------------------------------------------

// What a 16-bit cache promises. A cached step projects its chunk (project(): x·W_K and x·W_V,
// RoPE on K at the chunk's positions) and stores K and V rounded once to T; attention then reads
// them as stored. That is not a rounding of the forward pass's own K and V bit for bit: the
// projection of a chunk of two rows and that of the whole sequence are different products
// (Eigen's product kernel takes other paths for 2 rows than for tiles of 512 and sums the 16
// terms in another order, with FMA where the target has it), so they differ in float's last bit
// (in 22 % of the K and V elements of the test below in a baseline x86-64 build, 68 % with
// -march=native on AVX-512), and an element that lies that close to a rounding boundary of T
// rounds to the neighbouring T value: a whole T step (up to 2^-7 of the value in bfloat16,
// 2^-10 in half) in one stored K or V. A few such steps in bfloat16 moved rows by up to 1.8e-4
// of their maximum in the -march=native build, past kDecode. So the oracle attends over the K
// and V that decoding stored, read back from the cache and checked bit for bit (the comparison
// then measures attention alone, at kDecode), and those stored values are checked separately
// against the forward pass's: each a rounding of a value within the projection's float error.

// K and V of every token as a 16-bit cache stores them, widened to float: [B*T, H_kv·d_h]
// each, token-major as project() returns them (token t of batch b is row b*T + t).
struct StoredKv {
  RowMatrix<float> k;
  RowMatrix<float> v;
};

// Records what a cached step on `chunk` [B*n, d] at `position` stores: the chunk projected as
// forward_cached projects it, K and V rounded to T.
template <class T>
void record_stored_chunk(const GroupedQueryAttention<float>& layer, const RowMatrix<float>& chunk,
                         const RopeSetup<float>& setup, Index position, StoredKv& stored) {
  const apex::ProjectedQkv<float> p = layer.project(chunk, kBatch, layer_params(setup, position));
  const auto round = [](float value) { return static_cast<float>(apex::round_to<T>(value)); };
  const Index n = chunk.rows() / kBatch;
  const Index total = stored.k.rows() / kBatch;
  for (Index b = 0; b < kBatch; ++b) {
    stored.k.middleRows(b * total + position, n) = p.k.middleRows(b * n, n).unaryExpr(round);
    stored.v.middleRows(b * total + position, n) = p.v.middleRows(b * n, n).unaryExpr(round);
  }
}

// The number of elements of `held` ([B, H_kv, len, d_h] of a cache, the token at row s being at
// absolute position first_position + s) that differ from `recorded` ([B*T, H_kv·d_h]).
template <class T>
Index count_unlike_recorded(const apex::HeadsView<const T>& held, Index first_position,
                            const RowMatrix<float>& recorded) {
  const Index total = recorded.rows() / kBatch;
  Index unlike = 0;
  for (Index b = 0; b < held.batch(); ++b) {
    for (Index h = 0; h < held.heads(); ++h) {
      const auto head = held.head(b, h);
      for (Index s = 0; s < held.seq(); ++s) {
        for (Index d = 0; d < held.dim(); ++d) {
          const float stored = static_cast<float>(head(s, d));
          unlike += stored != recorded(b * total + first_position + s, h * held.dim() + d);
        }
      }
    }
  }
  return unlike;
}

// Every key and value the cache holds is the recorded one, bit for bit.
template <class T>
void expect_cache_holds(const KvCache<float, T>& cache, const StoredKv& stored,
                        const std::string& what) {
  EXPECT_EQ(count_unlike_recorded(cache.keys(), 0, stored.k), 0) << what << ": keys";
  EXPECT_EQ(count_unlike_recorded(cache.values(), 0, stored.v), 0) << what << ": values";
}

template <class T>
void expect_cache_holds(const SlidingWindowCache<float, T>& cache, const StoredKv& stored,
                        const std::string& what) {
  for (const auto& run : cache.segments()) {
    EXPECT_EQ(count_unlike_recorded(run.keys, run.first_position, stored.k), 0) << what << ": keys";
    EXPECT_EQ(count_unlike_recorded(run.values, run.first_position, stored.v), 0)
        << what << ": values";
  }
}

// Decodes x [B*T, d] through `cache` in the chunks of run_in_chunks and returns the outputs; the
// K and V every step stored go to `stored`, and the cache is checked to hold them bit for bit: a
// ring after every step (it keeps the last W; the first tokens of a chunk longer than W are
// never held, they are attended only within their chunk, rounded the same way), a full cache
// at the end.
template <class T, class Cache>
RowMatrix<float> decode_recording(const GroupedQueryAttention<float>& layer,
                                  const RowMatrix<float>& x, const PositionMask& rule,
                                  const RopeSetup<float>& setup, const std::vector<Index>& pattern,
                                  Cache& cache, StoredKv& stored, const std::string& what) {
  const Index width = layer.config().num_kv_heads * layer.config().head_dim;
  stored.k.resize(x.rows(), width);
  stored.v.resize(x.rows(), width);
  constexpr bool kRing = std::is_same_v<Cache, SlidingWindowCache<float, T>>;
  RowMatrix<float> decoded =
      run_in_chunks(x, kBatch, 1, pattern, [&](const RowMatrix<float>& c, Index p) {
        record_stored_chunk<T>(layer, c, setup, p, stored);
        RowMatrix<float> out = layer.forward_cached(c, rule, layer_params(setup, p), cache);
        if constexpr (kRing) expect_cache_holds(cache, stored, what);
        return out;
      });
  if constexpr (!kRing) expect_cache_holds(cache, stored, what);
  return decoded;
}

// The oracle of decoding with a 16-bit cache: the forward pass of the layer with its K and V
// replaced by those the cache stored. Q is the forward pass's own: one projection against
// another, float's last bits, far inside kDecode.
RowMatrix<float> forward_on_stored_kv(const GroupedQueryAttention<float>& layer,
                                      const RowMatrix<float>& x, const StoredKv& stored,
                                      const PositionMask& rule, const RopeSetup<float>& setup) {
  apex::ProjectedQkv<float> p = layer.project(x, kBatch, layer_params(setup, 0));
  p.k = stored.k;
  p.v = stored.v;
  AttentionMask<float> mask;
  mask.positions = rule;
  return apex::multi_head_attention(p.q_heads(), p.k_heads(), p.v_heads(), mask, setup.attention,
                                    layer.weights().w_o);
}

// The stored K and V against the forward pass's `exact` ones (before rounding): every stored
// element is T's rounding of a value within the projection's float error ε of the exact one,
// round(e − ε) <= stored <= round(e + ε) (rounding is monotonic), with ε = kShortChain ·
// max(1, |e|): a projection is a dot product of d_model = 16 terms and RoPE two more
// (tolerances.hpp). So a stored element is round(e), or its neighbour when e lies within ε of a
// rounding boundary; a token stored at the wrong position, or with the wrong rotation, is
// O(0.1) away. Returns how many are the neighbour.
template <class T>
Index expect_stored_rounds_exact(const RowMatrix<float>& stored, const RowMatrix<float>& exact,
                                 const std::string& what) {
  const auto round = [](double value) {
    return static_cast<double>(apex::round_to<T>(static_cast<float>(value)));
  };
  const double tol = apex::testing::Tolerances<float>::kShortChain;
  Index neighbours = 0, outside = 0;
  for (Index i = 0; i < exact.size(); ++i) {
    const double e = exact.data()[i];
    const double s = stored.data()[i];
    const double eps = tol * std::max(1.0, std::abs(e));
    outside += s < round(e - eps) || s > round(e + eps);
    neighbours += s != round(e);
  }
  EXPECT_EQ(outside, 0) << what << ": elements not a rounding of the forward pass's";
  return neighbours;
}

template <class T>
class Decode16Bit : public ::testing::Test {};
using SixteenBit = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Decode16Bit, SixteenBit, apex::testing::ScalarName);

// 1000 tokens one at a time through a 16-bit full cache and a 16-bit ring (chunks of 1, 3 and 70
// > W): within the float tolerance of decoding (kDecode) of the forward pass on the K and V the
// cache stored, which are the forward pass's K and V rounded once, up to one T step where the
// projection's last bit decides the rounding; at half the bytes of a float cache.
TYPED_TEST(Decode16Bit, GqaWithFullAndWindowCachesMatchesForwardOnRoundedValues) {
  using T = TypeParam;
  const apex::testing::OneThread one_thread;
  const auto layer = GroupedQueryAttention<float>::random(GqaConfig{16, 4, 2, 6}, 151);
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 152);
  const auto setup = rope_setup<float>(false, 6, 6, apex::YarnTemperature::kInTables);
  const apex::ProjectedQkv<float> exact = layer.project(x, kBatch, layer_params(setup, 0));
  Index neighbours = 0;
  const auto expect_stored_matches_forward = [&](const StoredKv& stored, const std::string& what) {
    neighbours += expect_stored_rounds_exact<T>(stored.k, exact.k, what + ", K");
    neighbours += expect_stored_rounds_exact<T>(stored.v, exact.v, what + ", V");
  };
  for (const PositionMask& rule : {apex::causal_mask(), apex::sliding_window_mask(kWindow)}) {
    KvCache<float, T> full = layer.template make_cache<T>(kBatch, kTokens);
    EXPECT_EQ(full.bytes(), layer.make_cache(kBatch, kTokens).bytes() / 2);
    StoredKv stored;
    const RowMatrix<float> decoded =
        decode_recording<T>(layer, x, rule, setup, {1}, full, stored, "full 16-bit cache");
    expect_stored_matches_forward(stored, "full 16-bit cache");
    expect_rows_close(decoded, forward_on_stored_kv(layer, x, stored, rule, setup), kTol<float>,
                      "full 16-bit cache");
    if (!rule.window) continue;
    SlidingWindowCache<float, T> ring = layer.template make_window_cache<T>(kBatch, kWindow);
    EXPECT_EQ(ring.bytes(), layer.make_window_cache(kBatch, kWindow).bytes() / 2);
    StoredKv ring_stored;
    const RowMatrix<float> decoded_ring = decode_recording<T>(
        layer, x, rule, setup, {1, 3, 70}, ring, ring_stored, "16-bit window cache");
    expect_stored_matches_forward(ring_stored, "16-bit window cache");
    expect_rows_close(decoded_ring, forward_on_stored_kv(layer, x, ring_stored, rule, setup),
                      kTol<float>, "16-bit window cache");
  }
  std::cout << "stored K and V elements one step from the forward pass's rounding: " << neighbours
            << "\n";
}

// MLA layers for the tests: H_kr = H_kv as §9.3 writes it, and one shared K_rope head.
MlaConfig mla_config(Index rope_key_heads) {
  MlaConfig c;
  c.d_model = 16;
  c.d_q = 10;
  c.d_kv = 12;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 6;
  c.rope_dim = 4;
  c.num_rope_key_heads = rope_key_heads;
  return c;
}

TEST(Decode, MlaNaiveAndAbsorbedMatchForwardOneTokenAtATime) {
  const apex::testing::OneThread one_thread;
  for (const Index h_kr : {Index{0}, Index{1}}) {
    const MlaConfig config = mla_config(h_kr);
    const auto layer =
        MultiHeadLatentAttention<float>::random(config, static_cast<std::uint32_t>(121 + h_kr));
    const auto absorbed = apex::absorb_mla_weights(layer);
    const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 122);
    for (const Variant& v : kVariants) {
      const auto setup = rope_setup<float>(
          v.yarn, config.rope_dim, config.qk_dim(),
          v.prefix == 0 ? apex::YarnTemperature::kInTables : apex::YarnTemperature::kSoftmaxScale);
      const PositionMask rule = rule_with(apex::causal_mask(), v.prefix);
      const RowMatrix<float> expected = forward_oracle(layer, x, rule, setup);
      const std::string name = "H_kr " + std::to_string(config.rope_key_heads()) + ", " + v.name();

      LatentCache<float> naive_cache = layer.make_cache(kBatch, kTokens);
      const RowMatrix<float> naive =
          run_in_chunks(x, kBatch, first_chunk(v), {1}, [&](const RowMatrix<float>& c, Index p) {
            return layer.forward_cached(c, rule, layer_params(setup, p), naive_cache);
          });
      expect_rows_close(naive, expected, kTol<float>, "MLA naive, " + name);

      LatentCache<float> cache = layer.make_cache(kBatch, kTokens);
      const RowMatrix<float> decoded =
          run_in_chunks(x, kBatch, first_chunk(v), {1}, [&](const RowMatrix<float>& c, Index p) {
            return layer.forward_absorbed(c, rule, layer_params(setup, p), absorbed, cache);
          });
      expect_rows_close(decoded, expected, kTol<float>, "MLA absorbed, " + name);
      // The cache holds exactly c_kv and K_rope: d_kv + H_kr·d_r values per token.
      EXPECT_EQ(cache.row_width(), apex::mla_cache_values_per_token(config));
      EXPECT_EQ(cache.bytes(), static_cast<std::int64_t>(kBatch * kTokens) *
                                   apex::mla_cache_values_per_token(config) *
                                   static_cast<std::int64_t>(sizeof(float)));
    }
  }
}

/// max over rows r of max |a_r − b_r| / max |b_r|: the largest normwise row difference.
double largest_normwise_difference(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  double worst = 0.0;
  for (Index r = 0; r < b.rows(); ++r) {
    worst = std::max(worst, static_cast<double>((a.row(r) - b.row(r)).cwiseAbs().maxCoeff() /
                                                b.row(r).cwiseAbs().maxCoeff()));
  }
  return worst;
}

// A 16-bit latent cache: naive and absorbed decoding read the same rounded c_kv and K_rope, so
// they agree as closely as on a float cache (kAbsorbedMla), and both stay within the bound of
// rounding c_kv and K_rope of the forward pass: the largest normwise row difference,
// max |Δ| / max |row|, measured 8.3e-4 for half and 7.3e-3 for bfloat16 over these 1000 tokens;
// the bounds are about twice that.
TYPED_TEST(Decode16Bit, MlaNaiveAndAbsorbedReadTheSameRoundedLatents) {
  using T = TypeParam;
  const double bound = std::is_same_v<T, Eigen::half> ? 1.6e-3 : 1.5e-2;
  const apex::testing::OneThread one_thread;
  const MlaConfig config = mla_config(1);
  const auto layer = MultiHeadLatentAttention<float>::random(config, 161);
  const auto absorbed = apex::absorb_mla_weights(layer);
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 162);
  const auto setup =
      rope_setup<float>(false, config.rope_dim, config.qk_dim(), apex::YarnTemperature::kInTables);
  const PositionMask rule = apex::causal_mask();
  const RowMatrix<float> exact = forward_oracle(layer, x, rule, setup);
  LatentCache<float, T> naive_cache = layer.template make_cache<T>(kBatch, kTokens);
  LatentCache<float, T> cache = layer.template make_cache<T>(kBatch, kTokens);
  EXPECT_EQ(2 * cache.bytes(), layer.make_cache(kBatch, kTokens).bytes());
  const RowMatrix<float> naive =
      run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
        return layer.forward_cached(c, rule, layer_params(setup, p), naive_cache);
      });
  const RowMatrix<float> decoded =
      run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
        return layer.forward_absorbed(c, rule, layer_params(setup, p), absorbed, cache);
      });
  expect_rows_close(decoded, naive, apex::testing::Tolerances<float>::kAbsorbedMla,
                    "absorbed against naive, 16-bit cache");
  const double worst = largest_normwise_difference(naive, exact);
  std::cout << "largest normwise row difference of MLA on a 16-bit cache: " << worst << "\n";
  EXPECT_LE(worst, bound);
  EXPECT_GT(worst, 0.0);
}

// FlashMLA's fp8 latent rows (kv_quant.hpp: c_kv in e4m3 with a float scale per 128 values,
// K_rope in bfloat16, one element a token): naive decoding (which widens the rows and splits
// them) and absorbed decoding (whose values are the whole rows, the K_rope columns dropped) read
// the same stored rows, so they agree as on a float cache (kAbsorbedMla); against the forward
// pass, the largest normwise row difference over these 300 tokens was measured 1.3e-1 (printed;
// 1.6e-1 with both parts in e4m3 blocks of 64, whose K_rope is coarser) and the bound is about
// twice that.
TEST(Decode, MlaNaiveAndAbsorbedReadTheSameFlashMlaRows) {
  using Row = apex::FlashMlaFp8Row<128, 64>;
  const apex::testing::OneThread one_thread;
  MlaConfig config = mla_config(1);
  config.d_kv = 128;
  config.rope_dim = 64;
  constexpr Index kRowTokens = 300;
  const auto layer = MultiHeadLatentAttention<float>::random(config, 181);
  const auto absorbed = apex::absorb_mla_weights(layer);
  const RowMatrix<float> x = random_matrix<float>(kBatch * kRowTokens, 16, 182);
  const auto setup =
      rope_setup<float>(false, config.rope_dim, config.qk_dim(), apex::YarnTemperature::kInTables);
  const PositionMask rule = apex::causal_mask();
  const RowMatrix<float> exact = forward_oracle(layer, x, rule, setup);
  LatentCache<float, Row> naive_cache = layer.make_cache<Row>(kBatch, kRowTokens);
  LatentCache<float, Row> cache = layer.make_cache<Row>(kBatch, kRowTokens);
  EXPECT_EQ(cache.bytes(), kBatch * kRowTokens * static_cast<std::int64_t>(sizeof(Row)));
  const RowMatrix<float> naive =
      run_in_chunks(x, kBatch, 7, {1, 3}, [&](const RowMatrix<float>& c, Index p) {
        return layer.forward_cached(c, rule, layer_params(setup, p), naive_cache);
      });
  const RowMatrix<float> decoded =
      run_in_chunks(x, kBatch, 7, {1, 3}, [&](const RowMatrix<float>& c, Index p) {
        return layer.forward_absorbed(c, rule, layer_params(setup, p), absorbed, cache);
      });
  expect_rows_close(decoded, naive, apex::testing::Tolerances<float>::kAbsorbedMla,
                    "absorbed against naive, FlashMLA rows");
  const double worst = largest_normwise_difference(naive, exact);
  std::cout << "largest normwise row difference of MLA on FlashMLA rows: " << worst << "\n";
  EXPECT_LE(worst, 2.6e-1);
  EXPECT_GT(worst, 0.0);
}

// 16-bit weights: a layer holding T weights computes what a float layer holding the same
// (widened) weights computes, within the float tolerance of decoding (kDecode), 1000 tokens one
// at a time on float caches: GQA on a full and a window cache, naive MLA, and absorbed MLA,
// whose folded products the 16-bit layer rounds to T once (the float layer is given those same
// rounded products).
TYPED_TEST(Decode16Bit, LayersWith16BitWeightsMatchFloatLayersOnTheSameWeights) {
  using T = TypeParam;
  const apex::testing::OneThread one_thread;
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 172);

  const auto gqa = GroupedQueryAttention<float, T>::random(GqaConfig{16, 4, 2, 6}, 171);
  const GroupedQueryAttention<float> gqa_wide = gqa.template with_weights<float>();
  EXPECT_EQ(2 * gqa.weight_bytes(), gqa_wide.weight_bytes());
  const auto setup = rope_setup<float>(false, 6, 6, apex::YarnTemperature::kInTables);
  const PositionMask window = apex::sliding_window_mask(kWindow);
  const RowMatrix<float> expected = forward_oracle(gqa_wide, x, window, setup);
  expect_rows_close(forward_oracle(gqa, x, window, setup), expected, kTol<float>,
                    "GQA forward, 16-bit weights");
  KvCache<float> full = gqa.make_cache(kBatch, kTokens);
  SlidingWindowCache<float> ring = gqa.make_window_cache(kBatch, kWindow);
  const auto decode = [&](auto& cache) {
    return run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
      return gqa.forward_cached(c, window, layer_params(setup, p), cache);
    });
  };
  expect_rows_close(decode(full), expected, kTol<float>, "GQA full cache, 16-bit weights");
  expect_rows_close(decode(ring), expected, kTol<float>, "GQA window cache, 16-bit weights");

  const MlaConfig config = mla_config(1);
  const auto mla = MultiHeadLatentAttention<float, T>::random(config, 173);
  const MultiHeadLatentAttention<float> mla_wide = mla.template with_weights<float>();
  const apex::MlaAbsorbedWeights<T> absorbed = apex::absorb_mla_weights(mla);
  ASSERT_TRUE(absorbed.query_multiplied());  // so that a rounded product takes part
  const apex::MlaAbsorbedWeights<float> absorbed_wide{absorbed.config,
                                                      apex::converted<float>(absorbed.w_q_latent),
                                                      apex::converted<float>(absorbed.w_o_latent)};
  const auto mla_setup =
      rope_setup<float>(false, config.rope_dim, config.qk_dim(), apex::YarnTemperature::kInTables);
  const PositionMask causal = apex::causal_mask();
  LatentCache<float> naive_cache = mla.make_cache(kBatch, kTokens);
  const RowMatrix<float> naive =
      run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
        return mla.forward_cached(c, causal, layer_params(mla_setup, p), naive_cache);
      });
  expect_rows_close(naive, forward_oracle(mla_wide, x, causal, mla_setup), kTol<float>,
                    "MLA naive, 16-bit weights");
  LatentCache<float> cache = mla.make_cache(kBatch, kTokens);
  LatentCache<float> wide_cache = mla.make_cache(kBatch, kTokens);
  const RowMatrix<float> absorbed_out =
      run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
        return mla.forward_absorbed(c, causal, layer_params(mla_setup, p), absorbed, cache);
      });
  const RowMatrix<float> absorbed_expected =
      run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
        return mla_wide.forward_absorbed(c, causal, layer_params(mla_setup, p), absorbed_wide,
                                         wide_cache);
      });
  expect_rows_close(absorbed_out, absorbed_expected, kTol<float>, "MLA absorbed, 16-bit weights");
  apex::GqaWeights<T> bad = apex::converted_weights<T>(gqa_wide.weights());
  bad.w_o.resize(5, 5);
  expect_invalid([&] { GroupedQueryAttention<float, T>(gqa.config(), bad); },
                 "[gqa] w_o shape [5, 5] must be");
  expect_invalid([] { (void)GroupedQueryAttention<float>().with_weights<T>(); },
                 "[gqa] the layer is empty");
  expect_invalid([] { (void)MultiHeadLatentAttention<float>().with_weights<T>(); },
                 "[mla] the layer is empty");
}

// ---------------------------------------------------------------------------------------------
// Absorbed = naive MLA on random weights, float and double, every folding
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Attention sinks owned by the layers: every path counts each head's sink once
// ---------------------------------------------------------------------------------------------

// A layer whose weights hold sinks computes what the same layer without them computes when the
// sinks are given per call (SdpaParams::sinks), and its cached paths (GQA with a full and a
// window cache, MLA naive and absorbed, one token at a time, where the split-key decode merges
// partial results) equal its forward pass. The sinks change the result (they are not ignored),
// and a call that brings sinks of its own to a layer that owns some is rejected.
TEST(Decode, LayersOwnTheirSinksOnEveryPath) {
  const RowMatrix<float> x = random_matrix<float>(kBatch * kTokens, 16, 181);
  const std::vector<double> sinks{0.5, -1.0, 2.0, 0.0};
  const auto gqa_plain = GroupedQueryAttention<float>::random(GqaConfig{16, 4, 2, 6}, 182);
  apex::GqaWeights<float> gqa_weights = gqa_plain.weights();
  gqa_weights.sinks = sinks;
  const GroupedQueryAttention<float> gqa(gqa_plain.config(), gqa_weights);
  const auto setup = rope_setup<float>(false, 6, 6, apex::YarnTemperature::kInTables);
  const PositionMask window = apex::sliding_window_mask(kWindow);
  const RowMatrix<float> expected = forward_oracle(gqa, x, window, setup);
  AttentionMask<float> mask;
  mask.positions = window;
  AttentionLayerParams<float> per_call = layer_params(setup, 0);
  per_call.attention.sinks = sinks;
  EXPECT_EQ(gqa_plain.forward(x, kBatch, mask, per_call), expected);
  EXPECT_GT((forward_oracle(gqa_plain, x, window, setup) - expected).cwiseAbs().maxCoeff(), 1e-3);
  KvCache<float> full = gqa.make_cache(kBatch, kTokens);
  SlidingWindowCache<float> ring = gqa.make_window_cache(kBatch, kWindow);
  const auto decode = [&](auto& cache) {
    return run_in_chunks(x, kBatch, 1, {1}, [&](const RowMatrix<float>& c, Index p) {
      return gqa.forward_cached(c, window, layer_params(setup, p), cache);
    });
  };
  expect_rows_close(decode(full), expected, kTol<float>, "GQA full cache, sinks");
  expect_rows_close(decode(ring), expected, kTol<float>, "GQA window cache, sinks");
  expect_invalid([&] { (void)gqa.forward(x, kBatch, mask, per_call); },
                 "[gqa] params.attention.sinks (4 values) must be empty: the layer owns its 4 "
                 "sinks");
  gqa_weights.sinks = {1.0, 2.0};
  expect_invalid([&] { GroupedQueryAttention<float>(gqa_plain.config(), gqa_weights); },
                 "[gqa] sinks length (2) must be the number of query heads 4");

  const MlaConfig config = mla_config(1);
  const auto mla_plain = MultiHeadLatentAttention<float>::random(config, 183);
  apex::MlaWeights<float> mla_weights = mla_plain.weights();
  mla_weights.sinks = std::vector<double>(std::size_t(config.num_q_heads), 0.75);
  const MultiHeadLatentAttention<float> mla(config, mla_weights);
  const apex::MlaAbsorbedWeights<float> absorbed = apex::absorb_mla_weights(mla);
  const auto mla_setup =
      rope_setup<float>(false, config.rope_dim, config.qk_dim(), apex::YarnTemperature::kInTables);
  const PositionMask causal = apex::causal_mask();
  const RowMatrix<float> mla_expected = forward_oracle(mla, x, causal, mla_setup);
  EXPECT_GT((forward_oracle(mla_plain, x, causal, mla_setup) - mla_expected).cwiseAbs().maxCoeff(),
            1e-3);
  LatentCache<float> naive_cache = mla.make_cache(kBatch, kTokens);
  LatentCache<float> absorbed_cache = mla.make_cache(kBatch, kTokens);
  expect_rows_close(run_in_chunks(x, kBatch, 1, {1},
                                  [&](const RowMatrix<float>& c, Index p) {
                                    return mla.forward_cached(c, causal, layer_params(mla_setup, p),
                                                              naive_cache);
                                  }),
                    mla_expected, kTol<float>, "MLA naive, sinks");
  expect_rows_close(run_in_chunks(x, kBatch, 1, {1},
                                  [&](const RowMatrix<float>& c, Index p) {
                                    return mla.forward_absorbed(c, causal,
                                                                layer_params(mla_setup, p),
                                                                absorbed, absorbed_cache);
                                  }),
                    mla_expected, kTol<float>, "MLA absorbed, sinks");
  EXPECT_EQ(mla.with_weights<Eigen::bfloat16>().weights().sinks, mla_weights.sinks);
}

template <class Scalar>
class DecodeTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DecodeTyped, Scalars, apex::testing::ScalarName);

// Absorbed against naive: the same attention with the products associated differently, on O(1)
// values through at most three chained products of length ≤ 16: tens of ulps (kAbsorbedMla).
template <class Scalar>
constexpr double kAbsorbTol = apex::testing::Tolerances<Scalar>::kAbsorbedMla;

TYPED_TEST(DecodeTyped, AbsorbedMlaEqualsNaiveMlaForEveryFolding) {
  const apex::testing::OneThread one_thread;
  using Scalar = TypeParam;
  struct Shape {
    Index h_q, h_kv, h_kr, d_q, d_kv, d_h, d_r;
  };
  // Grouped with per-group and shared K_rope heads, multi-query, multi-head, and widths where
  // the folded products are larger (d_kv > d_h) or smaller than their factors.
  const std::vector<Shape> shapes = {{4, 2, 2, 10, 12, 6, 4},
                                     {4, 2, 1, 10, 12, 6, 4},
                                     {6, 1, 1, 7, 9, 5, 2},
                                     {3, 3, 3, 8, 5, 7, 6},
                                     {4, 4, 1, 16, 4, 8, 2}};
  const std::vector<apex::MlaFold> folds = {apex::MlaFold::kFactored, apex::MlaFold::kMultiplied,
                                            apex::MlaFold::kAuto};
  for (const Shape& s : shapes) {
    MlaConfig c;
    c.d_model = 13;
    c.d_q = s.d_q;
    c.d_kv = s.d_kv;
    c.num_q_heads = s.h_q;
    c.num_kv_heads = s.h_kv;
    c.head_dim = s.d_h;
    c.rope_dim = s.d_r;
    c.num_rope_key_heads = s.h_kr;
    const auto layer = MultiHeadLatentAttention<Scalar>::random(c, 131);
    const RopeTable<Scalar> table(64, s.d_r);
    const Index total = 23;
    const RowMatrix<Scalar> x = random_matrix<Scalar>(kBatch * total, c.d_model, 132);
    const PositionMask rule = rule_with(apex::causal_mask(), 3);
    AttentionLayerParams<Scalar> params;
    params.rope = &table;
    for (const apex::MlaFold query : folds) {
      for (const apex::MlaFold output : folds) {
        const auto absorbed = apex::absorb_mla_weights(layer, apex::MlaAbsorbParams{query, output});
        EXPECT_EQ(absorbed.query_multiplied(), query == apex::MlaFold::kMultiplied ||
                                                   (query == apex::MlaFold::kAuto &&
                                                    s.d_q * s.d_kv <= s.d_h * (s.d_q + s.d_kv)));
        LatentCache<Scalar> naive_cache = layer.make_cache(kBatch, total);
        LatentCache<Scalar> cache = layer.make_cache(kBatch, total);
        const std::vector<Index> pattern = {1, 1, 2, 1, 4, 1};
        run_in_chunks(x, kBatch, 7, pattern, [&](const RowMatrix<Scalar>& chunk, Index p) {
          params.position_offset = p;
          const RowMatrix<Scalar> naive = layer.forward_cached(chunk, rule, params, naive_cache);
          RowMatrix<Scalar> fast = layer.forward_absorbed(chunk, rule, params, absorbed, cache);
          expect_rows_close(fast, naive, kAbsorbTol<Scalar>,
                            "H_q " + std::to_string(s.h_q) + ", H_kv " + std::to_string(s.h_kv) +
                                ", H_kr " + std::to_string(s.h_kr) + ", position " +
                                std::to_string(p));
          return fast;
        });
        // Both paths cache the same latent rows.
        EXPECT_EQ(apex::merge_heads(cache.rows()), apex::merge_heads(naive_cache.rows()));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Chunked prefill = one-shot prefill
// ---------------------------------------------------------------------------------------------

TYPED_TEST(DecodeTyped, ChunkedPrefillEqualsOneShotPrefill) {
  const apex::testing::OneThread one_thread;
  using Scalar = TypeParam;
  const Index prompt = 45, total = 52, prefix = 6, window = 8;
  const auto gqa = GroupedQueryAttention<Scalar>::random(GqaConfig{16, 4, 2, 6}, 141);
  const auto mla = MultiHeadLatentAttention<Scalar>::random(mla_config(0), 142);
  const auto absorbed = apex::absorb_mla_weights(mla);
  const RopeTable<Scalar> gqa_table(64, 6);
  const RopeTable<Scalar> mla_table(64, 4);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(kBatch * total, 16, 143);
  const PositionMask causal = rule_with(apex::causal_mask(), prefix);
  const PositionMask windowed = rule_with(apex::sliding_window_mask(window), prefix);

  // Runs the prompt (in one call, or in chunks whose first holds the prefix) and then the rest
  // of the sequence one token at a time; returns every output.
  const auto run = [&](const auto& layer, const RopeTable<Scalar>& table, const PositionMask& rule,
                       auto make_cache, auto call, const std::vector<Index>& chunks) {
    auto cache = make_cache();
    AttentionLayerParams<Scalar> params;
    params.rope = &table;
    std::vector<Index> pattern = chunks;
    pattern.push_back(prompt);  // sentinel: chunks beyond the prompt are single tokens
    RowMatrix<Scalar> result(x.rows(), x.cols());
    Index position = 0;
    std::size_t next = 0;
    while (position < total) {
      const Index n = position < prompt ? std::min(pattern[next++], prompt - position) : 1;
      params.position_offset = position;
      const RowMatrix<Scalar> out =
          call(layer, rows_of(x, kBatch, position, n), rule, params, cache);
      for (Index b = 0; b < kBatch; ++b) {
        result.middleRows(b * total + position, n) = out.middleRows(b * n, n);
      }
      position += n;
    }
    return result;
  };
  const auto plain = [](const auto& layer, const RowMatrix<Scalar>& chunk, const PositionMask& rule,
                        const AttentionLayerParams<Scalar>& params,
                        auto& cache) { return layer.forward_cached(chunk, rule, params, cache); };
  const auto absorbed_call = [&](const auto& layer, const RowMatrix<Scalar>& chunk,
                                 const PositionMask& rule,
                                 const AttentionLayerParams<Scalar>& params, auto& cache) {
    return layer.forward_absorbed(chunk, rule, params, absorbed, cache);
  };
  const auto ring = [&] { return gqa.make_window_cache(kBatch, window); };
  const auto full = [&] { return gqa.make_cache(kBatch, total); };
  const auto latent = [&] { return mla.make_cache(kBatch, total); };

  const std::vector<std::vector<Index>> chunkings = {{7, 1, 12, 3, 9}, {6, 6, 6}, {20, 25}};
  for (const auto& chunks : chunkings) {
    const std::string name = "first chunk " + std::to_string(chunks.front());
    expect_rows_close(run(gqa, gqa_table, windowed, ring, plain, chunks),
                      run(gqa, gqa_table, windowed, ring, plain, {prompt}), kTol<Scalar>,
                      "GQA window cache, " + name);
    expect_rows_close(run(gqa, gqa_table, causal, full, plain, chunks),
                      run(gqa, gqa_table, causal, full, plain, {prompt}), kTol<Scalar>,
                      "GQA full cache, " + name);
    expect_rows_close(run(mla, mla_table, causal, latent, plain, chunks),
                      run(mla, mla_table, causal, latent, plain, {prompt}), kTol<Scalar>,
                      "MLA naive, " + name);
    expect_rows_close(run(mla, mla_table, causal, latent, absorbed_call, chunks),
                      run(mla, mla_table, causal, latent, plain, {prompt}), kTol<Scalar>,
                      "MLA absorbed, " + name);
  }
}

// ---------------------------------------------------------------------------------------------
// The projections of a decoding step, spread over threads
// ---------------------------------------------------------------------------------------------

// A few rows against a large weight are cut into fixed column blocks (512, 512, 476 here), so
// the result is the product's, to rounding, and bit-identical for any number of threads.
TYPED_TEST(DecodeTyped, FewRowProjectionsAreSplitIntoFixedBlocks) {
  using Scalar = TypeParam;
  const RowMatrix<Scalar> x = random_matrix<Scalar>(3, 700, 171);
  const RowMatrix<Scalar> w = random_matrix<Scalar>(700, 1500, 172);
  const RowMatrix<Scalar> w_t = w.transpose();
  const Eigen::MatrixXd expected = x.template cast<double>() * w.template cast<double>();
  // Dot products of 700 terms of size O(1): |error| ≲ 700·u·Σ|terms|, about 3e-3 in float at
  // worst and far less in practice; relative to the largest output (about 25).
  const double tol =
      (std::is_same_v<Scalar, float> ? 1e-5 : 1e-13) * expected.cwiseAbs().maxCoeff();
  const RowMatrix<Scalar> plain = apex::detail::matmul<Scalar>(x, w);
  const RowMatrix<Scalar> transposed = apex::detail::matmul<Scalar>(x, w_t.transpose());
  EXPECT_LE((plain.template cast<double>() - expected).cwiseAbs().maxCoeff(), tol);
  EXPECT_LE((transposed.template cast<double>() - expected).cwiseAbs().maxCoeff(), tol);
#ifdef _OPENMP
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const RowMatrix<Scalar> one = apex::detail::matmul<Scalar>(x, w);
  omp_set_num_threads(2);
  const RowMatrix<Scalar> two = apex::detail::matmul<Scalar>(x, w);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
#endif
}

// ---------------------------------------------------------------------------------------------
// Bad input: clear exceptions, cache and output unchanged
// ---------------------------------------------------------------------------------------------

TEST(Decode, BadGqaCallsThrowAndLeaveCacheAndOutputUnchanged) {
  const auto layer = GroupedQueryAttention<float>::random(GqaConfig{12, 4, 2, 6}, 151);
  const RopeTable<float> table(32, 6);
  const RowMatrix<float> x = random_matrix<float>(kBatch * 5, 12, 152);
  const PositionMask rule = apex::causal_mask();
  AttentionLayerParams<float> params;
  params.rope = &table;
  KvCache<float> cache = layer.make_cache(kBatch, 6);
  layer.forward_cached(x, rule, params, cache);  // positions [0, 5)
  const RowMatrix<float> keys = apex::merge_heads(cache.keys());
  const RowMatrix<float> values = apex::merge_heads(cache.values());
  const RowMatrix<float> sentinel = RowMatrix<float>::Constant(kBatch, 12, -3.0f);
  RowMatrix<float> out = sentinel;
  const auto call = [&](const RowMatrix<float>& chunk, const PositionMask& r, Index position) {
    AttentionLayerParams<float> p = params;
    p.position_offset = position;
    layer.forward_cached(chunk, r, p, cache, out);
  };
  const auto unchanged = [&](const char* what) {
    EXPECT_EQ(cache.next_position(), 5) << what;
    EXPECT_EQ(apex::merge_heads(cache.keys()), keys) << what;
    EXPECT_EQ(apex::merge_heads(cache.values()), values) << what;
    EXPECT_EQ(out, sentinel) << what;
  };
  const RowMatrix<float> one = random_matrix<float>(kBatch, 12, 153);
  expect_invalid([&] { call(one, rule, 3); },
                 "[gqa] position_offset (3) goes backwards: the cache's next position is 5");
  unchanged("backwards");
  expect_invalid([&] { call(one, rule, 6); },
                 "[gqa] position_offset (6) skips ahead: the cache's next position is 5");
  unchanged("skip");
  const RowMatrix<float> two = random_matrix<float>(kBatch * 2, 12, 154);
  RowMatrix<float> out2 = RowMatrix<float>::Constant(kBatch * 2, 12, -3.0f);
  AttentionLayerParams<float> at5 = params;
  at5.position_offset = 5;
  expect_invalid([&] { layer.forward_cached(two, rule, at5, cache, out2); },
                 {"[kv_cache] appending 2 tokens at position 5 would exceed the capacity (6)",
                  "never grows by itself"});
  EXPECT_EQ(out2, RowMatrix<float>::Constant(kBatch * 2, 12, -3.0f));
  unchanged("capacity");
  const RowMatrix<float> three_rows = random_matrix<float>(3, 12, 155);
  expect_invalid([&] { layer.forward_cached(three_rows, rule, at5, cache); },
                 "[gqa] x rows (3) must be a multiple of batch (2)");
  unchanged("batch");
  KvCache<float> other_heads({kBatch, 4, 6, 8});
  expect_invalid([&] { layer.forward_cached(one, rule, params, other_heads, out); },
                 "[gqa] cache num_kv_heads (4) and head_dim (6) must equal the layer's "
                 "num_kv_heads (2) and head_dim (6)");
  EXPECT_EQ(other_heads.next_position(), 0);
  PositionMask offset = rule;
  offset.query_offset = 5;
  expect_invalid([&] { call(one, offset, 5); }, "query_offset/key_offset must be unset");
  unchanged("offset");

  // A sliding-window cache needs a causal windowed rule within its W.
  SlidingWindowCache<float> ring = layer.make_window_cache(kBatch, 4);
  expect_invalid([&] { layer.forward_cached(one, rule, params, ring, out); },
                 "[gqa] a SlidingWindowCache of W = 4 needs a causal mask with a window of at most "
                 "4 (got none)");
  expect_invalid(
      [&] { layer.forward_cached(one, apex::sliding_window_mask(5), params, ring, out); },
      "(got 5)");
  // A prefix must lie inside the first chunk.
  expect_invalid(
      [&] { layer.forward_cached(x, rule_with(apex::sliding_window_mask(4), 6), params, ring); },
      "[gqa] prefix P (6) must lie within one chunk starting at position 0 (this chunk covers "
      "[0, 5))");
  EXPECT_EQ(ring.next_position(), 0);
  EXPECT_EQ(out, sentinel);
}

TEST(Decode, BadMlaCallsThrowAndLeaveCacheAndOutputUnchanged) {
  const MlaConfig config = mla_config(0);
  const auto layer = MultiHeadLatentAttention<double>::random(config, 161);
  const auto absorbed = apex::absorb_mla_weights(layer);
  const RopeTable<double> table(16, config.rope_dim);
  const RowMatrix<double> x = random_matrix<double>(kBatch * 4, 16, 162);
  AttentionLayerParams<double> params;
  params.rope = &table;
  LatentCache<double> cache = layer.make_cache(kBatch, 5);
  layer.forward_absorbed(x, apex::causal_mask(), params, absorbed, cache);
  const RowMatrix<double> rows = apex::merge_heads(cache.rows());
  const RowMatrix<double> sentinel = RowMatrix<double>::Constant(kBatch * 2, 16, 9.0);
  RowMatrix<double> out = sentinel;
  const auto unchanged = [&](const char* what) {
    EXPECT_EQ(cache.next_position(), 4) << what;
    EXPECT_EQ(apex::merge_heads(cache.rows()), rows) << what;
    EXPECT_EQ(out, sentinel) << what;
  };
  const RowMatrix<double> two = random_matrix<double>(kBatch * 2, 16, 163);
  params.position_offset = 4;
  expect_invalid(
      [&] { layer.forward_absorbed(two, apex::causal_mask(), params, absorbed, cache, out); },
      "[latent_cache] appending 2 tokens at position 4 would exceed the capacity (5)");
  unchanged("capacity, absorbed");
  expect_invalid([&] { layer.forward_cached(two, apex::causal_mask(), params, cache, out); },
                 "[latent_cache] appending 2 tokens at position 4 would exceed the capacity (5)");
  unchanged("capacity, naive");
  params.position_offset = 1;
  RowMatrix<double> out1 = RowMatrix<double>::Constant(kBatch, 16, 9.0);
  expect_invalid(
      [&] {
        layer.forward_absorbed(two.topRows(kBatch), apex::causal_mask(), params, absorbed, cache,
                               out1);
      },
      "[mla] position_offset (1) goes backwards: the cache's next position is 4");
  EXPECT_EQ(out1, RowMatrix<double>::Constant(kBatch, 16, 9.0));
  unchanged("backwards");
  params.position_offset = 4;
  LatentCache<double> wrong({kBatch, config.d_kv, 1, config.rope_dim, 8});
  AttentionLayerParams<double> at0 = params;
  at0.position_offset = 0;
  expect_invalid([&] { layer.forward_cached(two, apex::causal_mask(), at0, wrong, out); },
                 "[mla] cache latent_dim, rope_heads, rope_dim (12, 1, 4) must equal the layer's "
                 "d_kv, H_kr, d_r (12, 2, 4)");
  const auto other = MultiHeadLatentAttention<double>::random(mla_config(1), 164);
  const auto other_absorbed = apex::absorb_mla_weights(other);
  expect_invalid(
      [&] { layer.forward_absorbed(two, apex::causal_mask(), params, other_absorbed, cache, out); },
      "[mla] absorbed weights were folded from a layer of another shape");
  unchanged("absorbed weights");
  AttentionLayerParams<double> no_rope = params;
  no_rope.rope = nullptr;
  expect_invalid(
      [&] { layer.forward_absorbed(two, apex::causal_mask(), no_rope, absorbed, cache, out); },
      "[mla] params.rope (null) must be a RoPE table");
  unchanged("rope");
}

}  // namespace
}  // namespace decode_test
