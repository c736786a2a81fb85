// SPDX-License-Identifier: MIT
// The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2): a small many-head scorer
// that ranks every cached token for each query, so that MLA (mla.hpp, sparse_attention.hpp)
// attends to the top k of them only. For a query token t and a cached token s:
//
//   q_{t,j} = Had(RoPE_{d_r}(c_q,t · W_IQ,j))         j = 0 .. H_I − 1, each d_I wide
//   k_s     = Had(RoPE_{d_r}(LayerNorm(h_s · W_IK)))  one key head shared by every head
//   w_{t,j} = (h_t · W_IW)_j · H_I^(-1/2) · d_I^(-1/2)
//   I_{t,s} = Σ_j w_{t,j} · ReLU(q_{t,j} · k_s)        over s <= t (causal)
//
// and the k keys of largest I_{t,s} are selected (all of them when fewer are visible). With a
// bidirectional prefix P (§11.1, select's `prefix`), a token t < P sees the keys s < P.
//
// CONVENTIONS (DeepSeek-V3.2-Exp's reference, inference/model.py, class Indexer):
//   - c_q is MLA's query latent (x·W_DQ), h the layer's input; x·W with W [in, out];
//   - RoPE turns the FIRST d_r features of each query head and of the key (MLA puts its rope
//     part last), at the token's position, with the table the caller gives (its pairing is the
//     table's: DeepSeek's reference rotates interleaved pairs);
//   - RoPE comes before the Hadamard transform Had(v) = H_{d_I} v / √d_I (Sylvester's natural
//     order, as fast_hadamard_transform; d_I a power of two), which mixes all d_I features;
//   - LayerNorm has a weight and a bias and eps = 1e-6 (IndexerConfig::norm_eps);
//   - the scales H_I^(-1/2) and d_I^(-1/2) are folded into w, as the reference does; its fp8
//     block scales have no counterpart here: the keys are stored in the cache's format (any K/V
//     format of kv_format.hpp) and every product is computed in the layer's scalar type;
//   - equal scores rank the lower position first, a NaN score as −∞ (detail/indexer_scores.hpp):
//     the selection is one set, the same for any number of threads, and listed ascending.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/indexer_scores.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/indexer_config.hpp>
#include <apex/key_selection.hpp>
#include <apex/kv_format.hpp>
#include <apex/layer_norm.hpp>
#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
#include <apex/rope.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>
#include <apex/tree_mask.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace apex {

namespace detail {

/// Throws unless w has the shapes of c.
template <class Weight>
void check_indexer_weights(const IndexerConfig& c, const IndexerWeights<Weight>& w) {
  check_weight_shape(w.w_q, c.d_q, c.heads * c.head_dim, "indexer", "w_q", "[d_q, H_I*d_I]");
  check_weight_shape(w.w_k, c.d_model, c.head_dim, "indexer", "w_k", "[d_model, d_I]");
  check_weight_shape(w.w_w, c.d_model, c.heads, "indexer", "w_w", "[d_model, H_I]");
  APEX_CHECK(w.k_norm_gamma.size() == c.head_dim && w.k_norm_beta.size() == c.head_dim,
             "[indexer] k_norm_gamma (" << w.k_norm_gamma.size() << ") and k_norm_beta ("
                                        << w.k_norm_beta.size() << ") must hold d_I (" << c.head_dim
                                        << ") values each");
}

/// In place on every width-wide block of every row of x: Had(v) = H_width v / √width, with the
/// Walsh–Hadamard butterflies (a, b) -> (a + b, a − b) in Sylvester's natural order.
template <class S>
void hadamard_blocks(RowMatrix<S>& x, Index width) {
  const S scale = S(1) / std::sqrt(static_cast<S>(width));
  for (Index t = 0; t < x.rows(); ++t) {
    for (Index first = 0; first < x.cols(); first += width) {
      S* v = x.row(t).data() + first;
      for (Index half = 1; half < width; half *= 2) {
        for (Index i = 0; i < width; i += 2 * half) {
          for (Index j = i; j < i + half; ++j) {
            const S a = v[j], b = v[j + half];
            v[j] = a + b;
            v[j + half] = a - b;
          }
        }
      }
      for (Index j = 0; j < width; ++j) v[j] *= scale;
    }
  }
}

/// RoPE on the first d_r features of every head_dim-wide head of x [rows, H·head_dim], each row
/// at its position `at` (offset + s within each of at.batch blocks, or at.ids); then the
/// Hadamard transform of every head.
template <class S>
void rotate_and_mix(const RopeTable<S>& rope, const RowPositions& at, Index head_dim,
                    RowMatrix<S>& x) {
  const Index n = x.rows() / at.batch;
  for (Index first = 0; first < x.cols(); first += head_dim) {
    if (at.ids != nullptr) {
      rope_at_ids(rope, *at.ids, RowRef<S>(x.middleCols(first, rope.head_dim())));
      continue;
    }
    for (Index b = 0; b < at.batch; ++b) {
      apply_rope(rope, at.offset, x.block(b * n, first, n, rope.head_dim()));
    }
  }
  hadamard_blocks(x, head_dim);
}

/// Throws unless `trees` (when given) holds one tree per sequence of the call and no window (the
/// indexer serves global layers), in a message naming `op`.
inline void check_indexer_trees(const TreeMasks* trees, Index sequences, const char* op) {
  if (trees == nullptr) return;
  APEX_CHECK(trees->size() == sequences, "[" << op << "] draft trees (" << trees->size()
                                             << ") must be one per sequence (" << sequences << ")");
  APEX_CHECK(trees->window() == 0,
             "[" << op << "] the draft trees have a window (" << trees->window()
                 << "); the indexer ranks a global layer's keys, which have none");
}

/// The key segments of a call of the indexer (one per sequence), each query row's sequence,
/// position and the end of its visible keys, and the sequences' draft trees (or none): what
/// detail::IndexerInputs points to.
template <class TK>
struct IndexerCall {
  std::vector<KeySegment<TK, TK>> segments;
  std::vector<Index> row_sequence, row_position, row_end;
  Index longest = 0;                 // most keys of a segment
  const TreeMasks* trees = nullptr;  // windowless

  /// A query row of `sequence` at `position`: it sees the keys up to its own position, and the
  /// whole bidirectional prefix [0, prefix) when it lies inside it (§11.1).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal, one caller per layout
  void add_row(Index sequence, Index position, Index prefix) {
    row_sequence.push_back(sequence);
    row_position.push_back(position);
    row_end.push_back(position < prefix ? prefix : position + 1);
  }

  template <class C>
  IndexerInputs<C, TK> inputs(const RowMatrix<C>& q, const RowMatrix<C>& w,
                              const IndexerConfig& c) const {
    const FloatKernels* simd = std::is_same_v<C, float> ? float_kernels() : nullptr;
    const Bf16Kernels* bf16 = simd != nullptr && c.allow_bf16_products ? simd->bf16 : nullptr;
    APEX_ASSERT(bf16 == nullptr || bf16->panel <= 64);  // the bound of IndexerScratch
    IndexerInputs<C, TK> in{
        bf16,           q.data(), q.cols(),   w.data(),           w.cols(),
        q.rows(),       c.heads,  c.head_dim, segments.data(),    row_sequence.data(),
        row_end.data(), longest,  trees,      row_position.data()};
    return in;
  }
};

}  // namespace detail

/// The cache of a lightning indexer's keys k_s [B, C, d_I] in a K/V format (kv_format.hpp:
/// float, double, half, bfloat16 or a quantized block format), beside a layer's latent cache.
/// Positions, overflow and empty caches as for LatentCache (kv_cache.hpp): an append must start
/// at next_position() and fit in the capacity, and every check runs before anything is written.
/// Memory: B·C·d_I values in Storage's format, allocated at construction.
template <class Scalar, class Storage = Scalar>
class IndexerKeyCache {
 public:
  /// An empty cache: every extent 0; appends throw.
  IndexerKeyCache() = default;
  /// Allocates B·C keys of d_I values. Throws unless every extent is >= 1 and d_I is a whole
  /// number of Storage's elements.
  IndexerKeyCache(Index batch, Index head_dim, Index capacity) {
    detail::require_supported_scalar<Scalar>();
    detail::require_kv_format<Storage>();
    APEX_CHECK(batch >= 1 && head_dim >= 1 && capacity >= 1,
               "[indexer_cache] batch (" << batch << "), head_dim (" << head_dim
                                         << ") and capacity (" << capacity << ") must be >= 1");
    detail::check_row_values<Storage>(head_dim, "indexer_cache", "head_dim");
    const Index count = detail::checked_product(
        {batch, capacity, KvFormat<Storage>::elements(head_dim)}, "indexer_cache", "B*C*d_I");
    keys_ = detail::zeroed_buffer<Storage>(count);
    batch_ = batch;
    dim_ = head_dim;
    capacity_ = capacity;
  }

  /// Number of sequences B.
  Index batch() const { return batch_; }
  /// d_I, the values of one key.
  Index head_dim() const { return dim_; }
  /// Tokens that fit.
  Index capacity() const { return capacity_; }
  /// Tokens held: positions [0, size()).
  Index size() const { return size_; }
  /// Position of the next token (= size()).
  Index next_position() const { return size_; }
  /// Exact bytes of the stored keys.
  std::int64_t bytes() const {
    return KvFormat<Storage>::bytes(static_cast<std::int64_t>(keys_.size()));
  }

  /// Appends the keys of n tokens per sequence, keys [B*n, d_I] (row b*n + s), at positions
  /// [position, position + n). position must equal next_position() and n fit. Checks first.
  template <class D>
  void append(const Eigen::MatrixBase<D>& keys, Index position) {
    const ConstRowRef<Scalar> k(keys.derived());
    detail::check_constructed(batch() >= 1, "indexer_cache", "cache");
    APEX_CHECK(k.cols() == head_dim() && k.rows() % batch() == 0,
               "[indexer_cache] keys [" << k.rows() << ", " << k.cols()
                                        << "] must be [B*n, d_I] = [" << batch() << "*n, "
                                        << head_dim() << "]");
    detail::check_append_position(position, size_, "indexer_cache");
    const Index n = k.rows() / batch();
    check_room(n);
    for (Index b = 0; b < batch(); ++b) {
      for (Index t = 0; t < n; ++t) {
        KvFormat<Storage>::store_row(k.row(b * n + t).data(), head_dim(), row_at(b, size_ + t));
      }
    }
    size_.get() += n;
  }

  /// Throws unless n more tokens fit.
  void check_room(Index n) const {
    APEX_CHECK(n <= capacity() - size_, "[indexer_cache] appending "
                                            << n << " tokens at position " << size()
                                            << " would exceed the capacity (" << capacity() << ")");
  }

  /// [B, 1, size(), d_I in elements]: the cached keys, what the indexer scores read.
  HeadsView<const Storage> keys() const {
    const Index width = KvFormat<Storage>::elements(head_dim());
    return HeadsView<const Storage>(keys_.data(), {batch(), 1, size_, width},
                                    {capacity() * width, 0, width});
  }

  /// Drops the tokens at positions >= new_size (0 <= new_size <= size()).
  void truncate(Index new_size) {
    APEX_CHECK(new_size >= 0 && new_size <= size_, "[indexer_cache] truncate size ("
                                                       << new_size << ") must lie in [0, " << size_
                                                       << "]");
    size_ = new_size;
  }
  /// Grows the capacity to at least `capacity`, keeping the cached keys (one copy: allocates
  /// the new buffer, then frees the old one). Never shrinks. Throws (cache unchanged) if the new
  /// size does not fit in 64 bits, or on an empty cache.
  void reserve(Index capacity) {
    detail::check_constructed(batch() >= 1, "indexer_cache", "cache");
    if (capacity <= this->capacity()) return;
    const Index stride = KvFormat<Storage>::elements(head_dim());
    const Index size =
        detail::checked_product({batch(), capacity, stride}, "indexer_cache", "B*C*d_I");
    detail::grow_token_rows<Storage>(keys_, {batch(), this->capacity(), stride}, capacity, size_,
                                     size);
    capacity_ = capacity;
  }

  /// Forgets every token (the memory is kept).
  void clear() { size_ = 0; }

 private:
  Storage* row_at(Index b, Index t) {
    return keys_.data() + (b * capacity() + t) * KvFormat<Storage>::elements(head_dim());
  }

  detail::ResetOnMove<Index> batch_, dim_, capacity_, size_;
  detail::CacheBuffer<Storage> keys_;
};

/// The lightning indexer's keys of many sequences in a pool of pages (page_pool.hpp: add, fork
/// with copy on write, truncate, free, forget_before, as PagedLatentCache), one key of d_I values
/// per token in Storage's format. Beside a PagedLatentCache, with the same sequences in the same
/// order (SparsePagedCache, sparse_mla.hpp, keeps the two in step). Memory: num_pages · page_size
/// keys, allocated at construction.
template <class Scalar, class Storage = Scalar>
class PagedIndexerKeyCache : public PagedSequences<Storage> {
  using Base = PagedSequences<Storage>;
  using Base::pool_;

 public:
  /// The type of the appended keys.
  using ScalarType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// An empty cache: no pages (every add throws).
  PagedIndexerKeyCache() = default;
  /// Allocates the pool of num_pages pages of page_size keys of head_dim values. Throws unless
  /// every extent is >= 1 and head_dim is a whole number of Storage's elements.
  PagedIndexerKeyCache(Index head_dim, Index page_size, Index num_pages)
      : Base(page_size, num_pages, {{1, checked_width(head_dim)}}, "paged_indexer_cache"),
        dim_(head_dim) {
    detail::require_supported_scalar<Scalar>();
  }

  /// d_I, the values of one key.
  Index head_dim() const { return dim_; }

  /// Appends the keys of n tokens of sequence id, keys [n, d_I]. Checks everything first (a
  /// live id, the width, room in the pool) and changes nothing when one fails.
  void append(SequenceId id, const ConstRowRef<Scalar>& keys) {
    pool_.sequence(id, kOp);
    APEX_CHECK(keys.cols() == head_dim(), "[" << kOp << "] keys have " << keys.cols()
                                              << " columns; expected d_I = " << head_dim());
    pool_.check_grow(id, keys.rows(), kOp);
    // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): append_tokens's (token, page, row)
    this->append_tokens(id, keys.rows(), [&](Index t, Index page, Index row) {
      KvFormat<Storage>::store_row(keys.row(t).data(), head_dim(),
                                   detail::row_data(pool_.plane(0), page, 0, row));
    });
  }

  /// The keys sequence id holds as a paged key segment of the kernels. Valid until the sequence
  /// changes.
  detail::KeySegment<Storage, Storage> segment(SequenceId id) const {
    return this->held_segment(id, pool_.plane(0), pool_.plane(0));
  }

 private:
  static constexpr const char* kOp = "paged_indexer_cache";

  /// head_dim in elements of Storage, checked.
  static Index checked_width(Index head_dim) {
    APEX_CHECK(head_dim >= 1, "[" << kOp << "] head_dim (" << head_dim << ") must be >= 1");
    detail::check_row_values<Storage>(head_dim, kOp, "head_dim");
    return KvFormat<Storage>::elements(head_dim);
  }

  detail::ResetOnMove<Index> dim_;
};

/// A lightning indexer (see the top of this header) that owns its weights. Immutable after
/// construction; its members may run from several threads at once (on different caches).
/// Scalar (float or double) is the type it computes in, Weight the type its weights are
/// stored in (Scalar, Eigen::half or Eigen::bfloat16).
template <class Scalar, class Weight = Scalar>
class LightningIndexer {
 public:
  /// An empty indexer; every use throws.
  LightningIndexer() = default;
  /// Takes the weights; throws unless the config is valid and the weights have its shapes.
  LightningIndexer(const IndexerConfig& config, IndexerWeights<Weight> weights)
      : config_(config), weights_(std::move(weights)) {
    detail::require_supported_scalar<Scalar>();
    detail::require_weight_type<Scalar, Weight>();
    detail::check_indexer_config(config);
    detail::check_indexer_weights(config, weights_);
  }

  /// An indexer with random weights (N(0, 1/fan-in) matrices in the order w_q, w_k, w_w; γ from
  /// N(1, 0.1²), β from N(0, 0.1²)) drawn from std::mt19937_64(seed), for tests and examples.
  static LightningIndexer random(const IndexerConfig& config, std::uint64_t seed) {
    detail::check_indexer_config(config);
    std::mt19937_64 rng(seed);
    IndexerWeights<Weight> w;
    w.w_q = detail::random_weight<Weight>(config.d_q, config.heads * config.head_dim, rng);
    w.w_k = detail::random_weight<Weight>(config.d_model, config.head_dim, rng);
    w.w_w = detail::random_weight<Weight>(config.d_model, config.heads, rng);
    std::normal_distribution<double> spread(0.0, 0.1);
    w.k_norm_gamma.resize(config.head_dim);
    w.k_norm_beta.resize(config.head_dim);
    for (Index i = 0; i < config.head_dim; ++i) {
      w.k_norm_gamma(i) = round_to<Weight>(1.0 + spread(rng));
      w.k_norm_beta(i) = round_to<Weight>(spread(rng));
    }
    return LightningIndexer(config, std::move(w));
  }

  /// The configuration (checked at construction).
  const IndexerConfig& config() const { return config_; }
  /// The weights, read-only.
  const IndexerWeights<Weight>& weights() const { return weights_; }
  /// Bytes of the weights: W_IQ, W_IK, W_IW and the LayerNorm's γ and β, in Weight.
  std::int64_t weight_bytes() const {
    const IndexerWeights<Weight>& w = weights_;
    const auto count =
        w.w_q.size() + w.w_k.size() + w.w_w.size() + w.k_norm_gamma.size() + w.k_norm_beta.size();
    return static_cast<std::int64_t>(count) * static_cast<std::int64_t>(sizeof(Weight));
  }

  /// The same indexer with its weights stored as W (Scalar, Eigen::half or Eigen::bfloat16):
  /// widened exactly or rounded once to nearest even. Allocates the new weights.
  template <class W>
  LightningIndexer<Scalar, W> with_weights() const {
    check_constructed();
    const IndexerWeights<Weight>& w = weights_;
    return LightningIndexer<Scalar, W>(
        config(),
        IndexerWeights<W>{converted<W>(w.w_q), converted<W>(w.w_k), converted<W>(w.k_norm_gamma),
                          converted<W>(w.k_norm_beta), converted<W>(w.w_w)});
  }

  /// The indexer's queries q_{t,j} = Had(RoPE(c_q,t·W_IQ,j)):
  ///   c_q: [B*n, d_q] (row b*n + s at position offset + s) -> [B*n, H_I·d_I], heads side by
  ///   side. rope: a table with head_dim = d_r covering the positions. Allocates the result.
  template <class Derived>
  RowMatrix<Scalar> queries(const Eigen::MatrixBase<Derived>& c_q, Index batch,
                            const RopeTable<Scalar>& rope, Index offset) const {
    const ConstRowRef<Scalar> c(c_q.derived());
    check_rows(c, config().d_q, batch, rope, offset, "c_q", "d_q");
    return project_queries(c, rope, {offset, batch, nullptr});
  }

  /// queries() with every row at its own position: c_q [T, d_q], positions [T] (each below the
  /// table's max_positions) -> [T, H_I·d_I]. Allocates the result.
  template <class Derived>
  RowMatrix<Scalar> queries(const Eigen::MatrixBase<Derived>& c_q, const RopeTable<Scalar>& rope,
                            const Vector<Index>& positions) const {
    const ConstRowRef<Scalar> c(c_q.derived());
    check_rows(c, config().d_q, 1, rope, 0, "c_q", "d_q");
    return project_queries(c, rope, {0, 1, &positions});
  }

  /// The indexer's keys k_s = Had(RoPE(LayerNorm(h_s·W_IK))): h: [B*n, d] (positions as for
  /// queries) -> [B*n, d_I]. Allocates the result.
  template <class Derived>
  RowMatrix<Scalar> keys(const Eigen::MatrixBase<Derived>& h, Index batch,
                         const RopeTable<Scalar>& rope, Index offset) const {
    const ConstRowRef<Scalar> x(h.derived());
    check_rows(x, config().d_model, batch, rope, offset, "h", "d_model");
    return project_keys(x, rope, {offset, batch, nullptr});
  }

  /// keys() with every row at its own position: h [T, d], positions [T] -> [T, d_I].
  template <class Derived>
  RowMatrix<Scalar> keys(const Eigen::MatrixBase<Derived>& h, const RopeTable<Scalar>& rope,
                         const Vector<Index>& positions) const {
    const ConstRowRef<Scalar> x(h.derived());
    check_rows(x, config().d_model, 1, rope, 0, "h", "d_model");
    return project_keys(x, rope, {0, 1, &positions});
  }

  /// The head weights w_{t,j} = (h_t·W_IW)_j · H_I^(-1/2) · d_I^(-1/2): h [T, d] -> [T, H_I].
  template <class Derived>
  RowMatrix<Scalar> head_weights(const Eigen::MatrixBase<Derived>& h) const {
    const ConstRowRef<Scalar> x(h.derived());
    check_constructed();
    APEX_CHECK(x.cols() == config().d_model, "[indexer] h width (" << x.cols()
                                                                   << ") must equal d_model ("
                                                                   << config().d_model << ")");
    const double scale = 1.0 / std::sqrt(static_cast<double>(config().heads) *
                                         static_cast<double>(config().head_dim));
    RowMatrix<Scalar> w = detail::matmul<Scalar>(x, weights_.w_w);
    w *= static_cast<Scalar>(scale);
    return w;
  }

  /// An empty key cache of this indexer: B sequences of `capacity` tokens, stored as Storage.
  template <class Storage = Scalar>
  IndexerKeyCache<Scalar, Storage> make_cache(Index batch, Index capacity) const {
    check_constructed();
    return IndexerKeyCache<Scalar, Storage>(batch, config().head_dim, capacity);
  }

  /// The top-k selection of every query row (see the top of this header): q = queries(...)
  /// [B*n, H_I·d_I] and w = head_weights(...) [B*n, H_I] of n query rows per sequence at
  /// positions [offset, offset + n), against keys [B, 1, S_k, d_I] (cache.keys(), positions
  /// [0, S_k); offset + n <= S_k: each query's own key is cached) -> [B*n, min(k, S_k)]: row
  /// b*n + s lists the min(k, offset + s + 1) best keys of [0, offset + s] ascending, then -1.
  /// With a bidirectional prefix (0 <= prefix <= S_k), a row at position t < prefix ranks the
  /// keys [0, prefix) instead. Bit-identical for any number of threads. Memory: see
  /// detail/indexer_scores.hpp.
  template <class TK>
  KeySelection select(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w,
                      const HeadsView<const TK>& keys, Index offset, Index prefix = 0) const {
    const detail::IndexerCall<TK> call = contiguous_call(q, w, keys, offset, prefix);
    KeySelection selected(q.rows(), std::min(config().top_k, call.longest));
    detail::indexer_select(call.inputs(q, w, config()), config().top_k, selected);
    return selected;
  }

  /// The scores I_{t,s} that select() ranks, [B*n, S_k], −∞ where s is not visible to t (past
  /// t, or past the prefix for t inside it; arguments as for select). For inspection and tests:
  /// allocates the whole [B*n, S_k] matrix.
  template <class TK>
  RowMatrix<Scalar> scores(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w,
                           const HeadsView<const TK>& keys, Index offset, Index prefix = 0) const {
    const detail::IndexerCall<TK> call = contiguous_call(q, w, keys, offset, prefix);
    return detail::indexer_scores(call.inputs(q, w, config()));
  }

  /// select() over the sequences of a paged key cache: rows [cu_seqlens[i], cu_seqlens[i + 1])
  /// of q and w are the last tokens of sequence ids[i] (already appended), each ranking the keys
  /// the sequence holds up to its own position (all of [0, P) inside a bidirectional prefix P =
  /// (*prefixes)[i], when given) -> [T, min(k, the most keys a sequence holds)], positions
  /// ascending, then -1. The same selection as select() over the same keys stored contiguously,
  /// bit for bit, for any number of threads. Allocates a few values per row.
  /// With `trees` (speculative verification, tree_mask.hpp: sequence ids[i] is its batch i, its
  /// draft the keys from trees->first(i) on, no window), a row also leaves out the draft keys its
  /// tree hides (TreeMasks::allows): a draft token ranks the committed keys, its ancestors and
  /// itself, the same keys, with the same scores, as the last token of its path committed.
  template <class Storage>
  KeySelection select_paged(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w,
                            const std::vector<Index>& cu_seqlens,
                            const PagedIndexerKeyCache<Scalar, Storage>& cache,
                            const std::vector<SequenceId>& ids,
                            const std::vector<Index>* prefixes = nullptr,
                            const TreeMasks* trees = nullptr) const {
    const detail::IndexerCall<Storage> call =
        paged_call(q, w, cu_seqlens, cache, ids, prefixes, trees);
    KeySelection selected(q.rows(), std::min(config().top_k, call.longest));
    detail::indexer_select(call.inputs(q, w, config()), config().top_k, selected);
    return selected;
  }

 private:
  void check_constructed() const {
    detail::check_constructed(config().d_model >= 1, "indexer", "indexer");
  }

  /// Throws unless x [B*n, width] has B blocks of rows whose positions the table covers.
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): private, two callers
  void check_rows(const ConstRowRef<Scalar>& x, Index width, Index batch,
                  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
                  const RopeTable<Scalar>& rope, Index offset, const char* name,
                  const char* what) const {
    check_constructed();
    APEX_CHECK(x.cols() == width, "[indexer] " << name << " width (" << x.cols() << ") must equal "
                                               << what << " (" << width << ")");
    APEX_CHECK(batch >= 1 && x.rows() % batch == 0,
               "[indexer] " << name << " rows (" << x.rows()
                            << ") must be B blocks of n rows; batch (" << batch << ")");
    detail::check_rope_head_dim(&rope, config().rope_dim, "rope_dim d_r", "indexer");
    APEX_CHECK(offset >= 0 && offset <= rope.max_positions() - x.rows() / batch,
               "[indexer] positions [" << offset << ", " << offset << " + " << x.rows() / batch
                                       << ") must lie in the RoPE table's [0, "
                                       << rope.max_positions() << ")");
  }

  /// Had(RoPE(c_q·W_IQ)) at the rows' positions (checked by the caller; RoPE checks ids).
  RowMatrix<Scalar> project_queries(const ConstRowRef<Scalar>& c_q, const RopeTable<Scalar>& rope,
                                    const detail::RowPositions& at) const {
    RowMatrix<Scalar> q = detail::matmul<Scalar>(c_q, weights_.w_q);
    detail::rotate_and_mix(rope, at, config().head_dim, q);
    return q;
  }

  /// Had(RoPE(LayerNorm(h·W_IK))) at the rows' positions.
  RowMatrix<Scalar> project_keys(const ConstRowRef<Scalar>& h, const RopeTable<Scalar>& rope,
                                 const detail::RowPositions& at) const {
    RowMatrix<Scalar> k = detail::matmul<Scalar>(h, weights_.w_k);
    layer_norm(k, weights_.k_norm_gamma, weights_.k_norm_beta, LayerNormParams{config().norm_eps},
               k);
    detail::rotate_and_mix(rope, at, config().head_dim, k);
    return k;
  }

  /// Throws unless q and w are a call's queries and head weights.
  void check_queries(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w) const {
    check_constructed();
    const IndexerConfig& c = config();
    APEX_CHECK(q.cols() == c.heads * c.head_dim && w.cols() == c.heads && w.rows() == q.rows(),
               "[indexer] q [" << q.rows() << ", " << q.cols() << "] and w [" << w.rows() << ", "
                               << w.cols() << "] must be [T, H_I*d_I] = [T, "
                               << c.heads * c.head_dim << "] and [T, H_I] = [T, " << c.heads
                               << "]");
  }

  /// The kernel's view of a select() or scores() call over contiguous keys, checked.
  template <class TK>
  detail::IndexerCall<TK> contiguous_call(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w,
                                          const HeadsView<const TK>& keys, Index offset,
                                          Index prefix) const {
    check_queries(q, w);
    APEX_CHECK(keys.heads() == 1 && row_values(keys) == config().head_dim && keys.batch() >= 1 &&
                   q.rows() % keys.batch() == 0,
               "[indexer] keys [" << keys.batch() << ", " << keys.heads() << ", " << keys.seq()
                                  << ", " << row_values(keys)
                                  << " values] must be [B, 1, S_k, d_I = " << config().head_dim
                                  << "] with B dividing the query rows (" << q.rows() << ")");
    const Index n = q.rows() / keys.batch();
    APEX_CHECK(offset >= 0 && offset <= keys.seq() - n,
               "[indexer] query positions [" << offset << ", " << offset << " + " << n
                                             << ") must be keys of the cache (S_k = " << keys.seq()
                                             << "): append before selecting");
    APEX_CHECK(prefix >= 0 && prefix <= keys.seq(),
               "[indexer] prefix (" << prefix << ") must lie in [0, S_k = " << keys.seq()
                                    << "]: the prefix's keys are ranked by every row inside it");
    detail::IndexerCall<TK> call;
    call.longest = keys.seq();
    for (Index b = 0; b < keys.batch(); ++b) {
      const HeadsView<const TK> batch = keys.middle_batches(b, 1);
      call.segments.push_back({batch, batch, 0, nullptr, 0});
    }
    for (Index t = 0; t < q.rows(); ++t) call.add_row(t / n, offset + t % n, prefix);
    return call;
  }

  /// The kernel's view of a select_paged() call, checked.
  template <class Storage>
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): the order of select_paged's arguments
  detail::IndexerCall<Storage> paged_call(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& w,
                                          const std::vector<Index>& cu_seqlens,
                                          const PagedIndexerKeyCache<Scalar, Storage>& cache,
                                          const std::vector<SequenceId>& ids,
                                          const std::vector<Index>* prefixes,
                                          const TreeMasks* trees) const {
    const char* op = "indexer";
    check_queries(q, w);
    APEX_CHECK(cache.head_dim() == config().head_dim,
               "[indexer] the key cache's head_dim (" << cache.head_dim() << ") must equal d_I ("
                                                      << config().head_dim << ")");
    detail::check_offsets(cu_seqlens, static_cast<Index>(ids.size()), q.rows(), op, "cu_seqlens");
    APEX_CHECK(prefixes == nullptr || prefixes->size() == ids.size(),
               "[indexer] prefixes holds " << prefixes->size() << " entries; expected one per "
                                           << "sequence (" << ids.size() << ")");
    detail::check_indexer_trees(trees, static_cast<Index>(ids.size()), op);
    detail::check_live_ids(cache, ids, op);
    detail::IndexerCall<Storage> call;
    call.trees = trees;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      call.segments.push_back(cache.segment(ids[i]));
      const Index held = call.segments.back().size();
      const Index n = cu_seqlens[i + 1] - cu_seqlens[i];
      APEX_CHECK(n <= held, "[indexer] sequence " << ids[i] << " has " << n
                                                  << " query rows but holds " << held
                                                  << " keys: append before selecting");
      const Index prefix = prefixes != nullptr ? (*prefixes)[i] : 0;
      APEX_CHECK(prefix >= 0 && prefix <= held,
                 "[indexer] the prefix (" << prefix << ") of sequence " << ids[i]
                                          << " must lie in [0, " << held << "], the keys it holds");
      call.longest = std::max(call.longest, held);
      for (Index s = 0; s < n; ++s) {
        call.add_row(static_cast<Index>(i), cache.length(ids[i]) - n + s, prefix);
      }
    }
    return call;
  }

  detail::ResetOnMove<IndexerConfig> config_;
  IndexerWeights<Weight> weights_;
};

}  // namespace apex
