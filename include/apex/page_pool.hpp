// SPDX-License-Identifier: MIT
// The page bookkeeping of the paged KV caches: many sequences of different lengths in one pool of
// fixed-size pages, each sequence holding a block table of the pages its tokens live in (vLLM's
// PagedAttention). The attention over them (sdpa_paged, sdpa_block_tables) is in
// paged_attention.hpp, which reads K and V through the block table, page by page, without
// gathering them (a paged detail::KeySegment); paged_cache.hpp includes both.
//
//   pool (page = 4 tokens):  page 0 | page 1 | page 2 | page 3 | page 4 | ...
//   sequence 7, 10 tokens:   table {3, 0, 4}: positions 0-3 in page 3, 4-7 in page 0, 8-9 in 4
//   sequence 9 = fork of 7:  table {3, 0, 4} too (reference counts 2); its first append copies
//                            page 4 (the shared, partly filled last page) to a page of its own
//
// Two caches share the page bookkeeping (detail::PagePool):
//   PagedKvCache      K and V of H_kv heads of d_h (multi-head and grouped-query attention,
//                     §7.4, §8.3): pools [pages, H_kv, page, d_h] of K and of V.
//   PagedLatentCache  multi-head latent attention's rows [c_kv ‖ K_rope] (§9.4, as LatentCache):
//                     a pool [pages, 1, page, d_kv + H_kr·d_r].
// The pools are stored head-major ([H, pages, page, width] in memory, viewed page first): a
// head's pages lie one after another, so a sequence whose pages were taken in order is read as
// one stream per head, as a contiguous cache is (BM_PagedDecode measures both that and scattered
// pages).
//
// Operations: add a sequence, append tokens, fork (the new sequence shares every page; a page is
// copied only when a sequence writes into a page that another still holds: copy on write),
// truncate, forget the tokens before a position (pages wholly before it go back to the pool: a
// sliding window's cache stays O(W)), and free. Every check runs before anything changes, and a
// failed call changes nothing. Sequences are named by SequenceId values that are never reused,
// so an id of a freed sequence stays invalid.
//
// Formats: a pool holds rows of any K/V format (kv_format.hpp): float, double, half or bfloat16,
// or the blocks of a quantized format (kv_quant.hpp), each appended row stored through it alone
// (rounded or quantized once). The views of the pools count elements (blocks, for a quantized
// format: a row of d values is d / kValuesPerElement of them); the caches' widths (head_dim,
// latent_dim, row_dim, key_dim, value_dim) count values, and must be whole blocks. Pages are
// copied as they are stored, never decoded and stored again.
//
// Memory: the pool is allocated (zeroed) at construction and never grows; bytes() is its exact
// size; pages_in_use(), free_pages() and fragmentation() say how it is used. Each sequence also
// holds its block table (one Index per page of its history). A default-constructed or moved-from
// cache is empty: no pages, no sequences; every add throws.
#pragma once

#include <apex/config.hpp>
#include <apex/detail/checks.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/kv_format.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex {

/// The name of a sequence of a paged cache: handed out in increasing order and never reused, so
/// the id of a freed sequence stays invalid. A type of its own, so that an id is never taken for
/// a length or a position.
struct SequenceId {
  Index value = -1;  ///< the id's number; -1 (the default): no sequence

  /// Equal numbers.
  friend bool operator==(SequenceId a, SequenceId b) { return a.value == b.value; }
  /// Different numbers.
  friend bool operator!=(SequenceId a, SequenceId b) { return a.value != b.value; }
  /// Ordered by number (the order they were handed out in).
  friend bool operator<(SequenceId a, SequenceId b) { return a.value < b.value; }
  /// Prints the number.
  friend std::ostream& operator<<(std::ostream& out, SequenceId id) { return out << id.value; }
};

/// The shape of a PagedKvCache: a pool of num_pages pages of page_size tokens, each token H_kv
/// heads of d_h keys and values.
struct PagedKvCacheShape {
  Index num_kv_heads = 0;  ///< H_kv
  Index head_dim = 0;      ///< d_h
  Index page_size = 0;     ///< tokens per page (e.g. 16 to 256)
  Index num_pages = 0;     ///< pages in the pool
};

/// The shape of a PagedLatentCache: a pool of num_pages pages of page_size tokens, each token a
/// row of d_kv latent values and H_kr rotated K_rope heads of d_r (as LatentCacheShape).
struct PagedLatentCacheShape {
  Index latent_dim = 0;  ///< d_kv
  Index rope_heads = 0;  ///< H_kr
  Index rope_dim = 0;    ///< d_r (even)
  Index page_size = 0;   ///< tokens per page
  Index num_pages = 0;   ///< pages in the pool
};

namespace detail {

/// The kernel's key segment of `rows` keys from position `first` in pages `table` of the pools k
/// and v; with no keys, an empty contiguous segment (a table of no pages may be null, which
/// would otherwise mean "contiguous").
template <class TK, class TV>
KeySegment<TK, TV> paged_segment(const HeadsView<const TK>& k, const HeadsView<const TV>& v,
                                 Index first, const Index* table, Index rows) {
  if (rows == 0) {
    return {k.middle_rows(0, 0).middle_batches(0, 1), v.middle_rows(0, 0).middle_batches(0, 1),
            first};
  }
  return {k, v, first, table, rows};
}

/// ⌈tokens / page⌉, the pages that hold `tokens` tokens (tokens >= 0, page >= 1), without the
/// overflow of (tokens + page − 1) / page for a length near the largest Index.
inline Index pages_holding(Index tokens, Index page) {
  return tokens / page + (tokens % page != 0 ? 1 : 0);
}

/// The bytes of a vector's elements (none when it is empty), for the alias checks of the calls
/// that read it while they write their outputs.
template <class T>
ByteRange byte_range(const std::vector<T>& values) {
  if (values.empty()) return {};
  const auto first = reinterpret_cast<std::uintptr_t>(values.data());
  return {first, first + values.size() * sizeof(T) - 1};
}

/// The page bookkeeping of a paged cache and its pools ("planes": K and V, or the latent rows),
/// each [pages, H, page_size, width] elements of format Storage, the batch axis the page. A
/// sequence holds its length and its block table; pages before `first_page` were forgotten (-1).
template <class Storage>
class PagePool {
 public:
  /// One live sequence.
  struct Sequence {
    std::vector<Index> pages;  // block table: page of positions [i·P, (i + 1)·P); -1: forgotten
    Index length = 0;          // tokens: positions [0, length)
    Index first_page = 0;      // index of the first page still held
  };

  PagePool() = default;
  /// Allocates the pools: one per entry of `planes` ({H, width}, the width in values, whole
  /// elements of Storage: the caller checks it, naming its argument), num_pages pages of
  /// page_size rows each, zeroed. Throws unless every extent is >= 1 and the bytes fit in 64 bits.
  PagePool(Index page_size, Index num_pages, const std::vector<std::pair<Index, Index>>& planes,
           const char* op) {
    require_kv_format<Storage>();
    APEX_CHECK(page_size >= 1, "[" << op << "] page_size (" << page_size << ") must be >= 1");
    APEX_CHECK(num_pages >= 1, "[" << op << "] num_pages (" << num_pages << ") must be >= 1");
    for (const auto& [heads, width] : planes) {
      APEX_CHECK(heads >= 1 && width >= 1,
                 "[" << op << "] heads (" << heads << ") and width (" << width << ") must be >= 1");
      APEX_ASSERT(width % KvFormat<Storage>::kValuesPerElement == 0);
      heads_tensor_size<Storage>({num_pages, heads, page_size, elements(width)}, op);
    }
    for (const auto& [heads, width] : planes) {
      const HeadsShape stored{heads, num_pages, page_size, elements(width)};  // head-major
      planes_.push_back({zeroed_buffer<Storage>(heads_tensor_size<Storage>(stored, op)), stored});
    }
    page_size_ = page_size;
    refs_.assign(static_cast<std::size_t>(num_pages), 0);
    for (Index p = num_pages - 1; p >= 0; --p) free_.push_back(p);  // page 0 is taken first
  }

  Index page_size() const { return page_size_; }
  Index num_pages() const { return static_cast<Index>(refs_.size()); }
  Index free_pages() const { return static_cast<Index>(free_.size()); }
  Index pages_in_use() const { return num_pages() - free_pages(); }
  /// Bytes of every pool: exact, whatever is in use (its elements, counted by their format).
  std::int64_t bytes() const {
    std::int64_t total = 0;
    for (const auto& plane : planes_) {
      total += KvFormat<Storage>::bytes(static_cast<std::int64_t>(plane.elements.size()));
    }
    return total;
  }
  /// The live sequences, by id.
  const std::map<SequenceId, Sequence>& sequences() const { return sequences_; }
  /// How many sequences hold page p.
  Index references(Index page) const { return refs_[static_cast<std::size_t>(page)]; }
  /// Pool `plane`, [pages, H, page_size, width in elements of Storage].
  /// The pools are stored head-major, [H, pages, page_size, width], so that each head's pages
  /// lie one after another: a sequence whose pages were taken in order reads every head as one
  /// stream, as from a contiguous cache. plane() views them with the page first.
  HeadsView<const Storage> plane(std::size_t i) const {
    return pages_first(planes_[i].elements.data(), planes_[i].shape);
  }
  HeadsView<Storage> plane(std::size_t i) {
    return pages_first(planes_[i].elements.data(), planes_[i].shape);
  }

  /// Whether `id` names a live sequence.
  bool contains(SequenceId id) const { return sequences_.count(id) == 1; }

  /// Whether `range` shares memory with a pool or with a live sequence's block table: what an
  /// attention call reads of the cache, whatever sequences it names and in whatever order.
  bool overlaps(const ByteRange& range) const {
    for (const auto& plane : planes_) {
      if (range.overlaps(byte_range(pages_first(plane.elements.data(), plane.shape)))) return true;
    }
    for (const auto& [id, s] : sequences_) {
      if (range.overlaps(byte_range(s.pages))) return true;
    }
    return false;
  }

  /// The sequence `id`; throws unless it is live.
  const Sequence& sequence(SequenceId id, const char* op) const {
    const auto it = sequences_.find(id);
    APEX_CHECK(it != sequences_.end(),
               "[" << op << "] sequence " << id << " does not exist (never added, or freed)");
    return it->second;
  }

  /// A new, empty sequence. Throws on an empty pool.
  SequenceId add(const char* op) {
    APEX_CHECK(num_pages() > 0, "[" << op
                                    << "] the cache is empty (default-constructed or moved "
                                       "from): it has no pages");
    const SequenceId id{next_id_++};
    sequences_.emplace(id, Sequence{});
    return id;
  }

  /// A new sequence holding the same tokens as `id` in the same pages (each page's reference
  /// count grows by one; nothing is copied).
  SequenceId fork(SequenceId id, const char* op) {
    Sequence copy = sequence(id, op);
    for (const Index page : held(copy)) ++refs_[static_cast<std::size_t>(page)];
    const SequenceId child{next_id_++};
    sequences_.emplace(child, std::move(copy));
    return child;
  }

  /// Frees sequence `id`: its pages go back to the pool where no other sequence holds them.
  void free(SequenceId id, const char* op) {
    const Sequence& s = sequence(id, op);
    for (const Index page : held(s)) release(page);
    sequences_.erase(id);
  }

  /// Keeps the first new_length tokens of `id` (first held position <= new_length <= length);
  /// the pages past them are released.
  void truncate(SequenceId id, Index new_length, const char* op) {
    Sequence& s = mutable_sequence(id, op);
    const Index first = s.first_page * page_size_;
    APEX_CHECK(new_length >= first && new_length <= s.length,
               "[" << op << "] new length (" << new_length << ") must be in [" << first << ", "
                   << s.length << "] (the held tokens of sequence " << id << ")");
    const auto keep = static_cast<std::size_t>(pages_for(new_length));
    for (std::size_t i = std::max(keep, static_cast<std::size_t>(s.first_page)); i < s.pages.size();
         ++i) {
      release(s.pages[i]);
    }
    s.pages.resize(std::max(keep, static_cast<std::size_t>(s.first_page)));
    s.length = new_length;
  }

  /// Throws unless keep_tokens(id, first, rows) may run but for the pool's room: `id` live, its
  /// first held position <= first <= length, rows strictly increasing in [0, length − first).
  /// Returns the pages it copies: those a row moves into that another sequence holds too.
  Index keep_copies(SequenceId id, Index first, const std::vector<Index>& rows,
                    const char* op) const {
    const Sequence& s = sequence(id, op);
    const Index held = s.first_page * page_size_;
    APEX_CHECK(first >= held && first <= s.length,
               "[" << op << "] first (" << first << ") must be in [" << held << ", " << s.length
                   << "] (the held tokens of sequence " << id << ")");
    Index copies = 0, last_copied = -1;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      APEX_CHECK(rows[k] >= 0 && rows[k] < s.length - first && (k == 0 || rows[k] > rows[k - 1]),
                 "[" << op << "] rows[" << k << "] (" << rows[k]
                     << ") must be greater than the row before it and below length − first ("
                     << s.length - first << "): rows are a path of the tokens after first");
      const Index page = (first + static_cast<Index>(k)) / page_size_;
      if (rows[k] != static_cast<Index>(k) && page != last_copied &&
          references(s.pages[static_cast<std::size_t>(page)]) > 1) {
        ++copies;
        last_copied = page;
      }
    }
    return copies;
  }

  /// Throws unless `copies` pages are free (`what` says for what, in the message).
  void check_room(Index copies, const char* what, const char* op) const {
    APEX_CHECK(copies <= free_pages(), "[" << op << "] the pool is full: " << what << " copies "
                                           << copies << " shared pages, " << free_pages()
                                           << " are free");
  }

  /// Keeps the tokens at first + rows[k] at positions first + k (in order: each moves down, to a
  /// position no later row is read from) and drops the others from first on; checks first.
  void keep_tokens(SequenceId id, Index first, const std::vector<Index>& rows, const char* op) {
    check_room(keep_copies(id, first, rows, op), "keeping the rows", op);
    Sequence& s = mutable_sequence(id, op);
    for (std::size_t k = 0; k < rows.size(); ++k) {
      const Index to = first + static_cast<Index>(k), from = first + rows[k];
      if (to == from) continue;
      own_page(s, to / page_size_);
      copy_row(slot(s, from), slot(s, to));
    }
    truncate(id, first + static_cast<Index>(rows.size()), op);
  }

  /// Releases the pages of `id` that hold only positions before `position` (0 <= position <=
  /// length): a sliding window's tokens that no later query sees.
  void forget_before(SequenceId id, Index position, const char* op) {
    Sequence& s = mutable_sequence(id, op);
    APEX_CHECK(position >= 0 && position <= s.length,
               "[" << op << "] position (" << position << ") must be in [0, " << s.length
                   << "] (the tokens of sequence " << id << ")");
    const Index whole = position / page_size_;  // pages [0, whole) end at or before position
    for (; s.first_page < whole; ++s.first_page) {
      release(s.pages[static_cast<std::size_t>(s.first_page)]);
      s.pages[static_cast<std::size_t>(s.first_page)] = -1;
    }
  }

  /// Pages an append of n tokens to `id` takes from the pool: a private copy of a shared, partly
  /// filled last page, and the new pages.
  Index pages_needed(const Sequence& s, Index n) const {
    const Index used = s.length % page_size_;
    const bool copy = n > 0 && used > 0 && references(s.pages.back()) > 1;
    return pages_for(s.length + n) - pages_for(s.length) + (copy ? 1 : 0);
  }

  /// Throws unless n tokens can be appended to `id`: a live sequence, n >= 0, a length that
  /// stays an Index, and enough free pages.
  void check_grow(SequenceId id, Index n, const char* op) const {
    const Sequence& s = sequence(id, op);
    APEX_CHECK(n >= 0, "[" << op << "] token count (" << n << ") must be >= 0");
    checked_sum(s.length, n, op, "length + n");
    const Index needed = pages_needed(s, n);
    APEX_CHECK(needed <= free_pages(), "[" << op << "] the pool is full: appending " << n
                                           << " tokens to sequence " << id << " needs " << needed
                                           << " pages, " << free_pages() << " of " << num_pages()
                                           << " are free");
  }

  /// Throws unless n tokens can be appended to sequence id for every (id, n) of `appends` at once
  /// (distinct live ids): the pages they need together fit in the free pages.
  void check_grow_all(const std::vector<std::pair<SequenceId, Index>>& appends,
                      const char* op) const {
    Index needed = 0;
    for (const auto& [id, n] : appends) {
      const Sequence& s = sequence(id, op);
      APEX_CHECK(std::count_if(appends.begin(), appends.end(),
                               [id = id](const auto& a) { return a.first == id; }) == 1,
                 "[" << op << "] sequence " << id << " appears more than once in one step");
      APEX_CHECK(n >= 0, "[" << op << "] token count (" << n << ") must be >= 0");
      checked_sum(s.length, n, op, "length + n");
      needed += pages_needed(s, n);
    }
    APEX_CHECK(needed <= free_pages(), "[" << op << "] the pool is full: the step needs " << needed
                                           << " pages, " << free_pages() << " of " << num_pages()
                                           << " are free");
  }

  /// Makes room for n tokens after the checks of check_grow have passed: copies a shared last
  /// page (copy on write) and takes new pages. Returns the old length; the new tokens go to
  /// positions [old, old + n), each at slot(id, position).
  // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): internal; the id is a SequenceId
  Index grow(SequenceId id, Index n, const char* op) {
    Sequence& s = mutable_sequence(id, op);
    if (n == 0) return s.length;
    if (s.length % page_size_ != 0) own_page(s, static_cast<Index>(s.pages.size()) - 1);
    while (static_cast<Index>(s.pages.size()) < pages_for(s.length + n)) s.pages.push_back(take());
    const Index old = s.length;
    s.length += n;
    return old;
  }

  /// (page, row) of position p of a sequence (a held position).
  std::pair<Index, Index> slot(const Sequence& s, Index position) const {
    return {s.pages[static_cast<std::size_t>(position / page_size_)], position % page_size_};
  }

  /// The fraction of the rows of the pages in use that hold no token (a page holds as many
  /// tokens as the longest of the sequences that share it has in it). 0 when no page is used.
  double fragmentation() const {
    if (pages_in_use() == 0) return 0.0;
    std::vector<Index> filled(refs_.size(), 0);
    for (const auto& [id, s] : sequences_) {
      for (Index i = s.first_page; i < static_cast<Index>(s.pages.size()); ++i) {
        const Index rows = std::min<Index>(page_size_, s.length - i * page_size_);
        Index& f = filled[static_cast<std::size_t>(s.pages[static_cast<std::size_t>(i)])];
        f = std::max(f, rows);
      }
    }
    Index used = 0;
    for (const Index f : filled) used += f;
    return 1.0 - static_cast<double>(used) / static_cast<double>(pages_in_use() * page_size_);
  }

 private:
  /// A pool: its elements, [H, pages, page_size, width] (head-major), and that shape.
  struct Plane {
    CacheBuffer<Storage> elements;  ///< zeroed at construction
    HeadsShape shape;               ///< [H, pages, page_size, width], in elements
  };

  Index pages_for(Index tokens) const { return pages_holding(tokens, page_size_); }

  /// Elements of Storage in a row of `values` values.
  static Index elements(Index values) { return KvFormat<Storage>::elements(values); }

  /// Page `to` of every pool = page `from`, element by element as stored (blocks as they are):
  /// each head's page is page_size·width consecutive elements.
  void copy_page(Index from, Index to) {
    for (std::size_t i = 0; i < planes_.size(); ++i) {
      const HeadsView<Storage> pool = plane(i);
      for (Index h = 0; h < pool.heads(); ++h) {
        std::copy_n(row_data(pool, from, h, 0), pool.seq() * pool.dim(), row_data(pool, to, h, 0));
      }
    }
  }

  /// Makes page i of `s` its own: a copy when another sequence holds it too (copy on write).
  void own_page(Sequence& s, Index i) {
    Index& page = s.pages[static_cast<std::size_t>(i)];
    if (references(page) == 1) return;
    const Index copy = take();
    copy_page(page, copy);
    release(page);
    page = copy;
  }

  /// Row `to` (page, row) of every head of every pool = row `from`, as stored.
  void copy_row(const std::pair<Index, Index>& from, const std::pair<Index, Index>& to) {
    for (std::size_t i = 0; i < planes_.size(); ++i) {
      const HeadsView<Storage> pool = plane(i);
      for (Index h = 0; h < pool.heads(); ++h) {
        std::copy_n(row_data(pool, from.first, h, from.second), pool.dim(),
                    row_data(pool, to.first, h, to.second));
      }
    }
  }

  /// A head-major pool [H, pages, P, width] viewed as [pages, H, P, width].
  template <class T>
  static HeadsView<T> pages_first(T* data, const HeadsShape& stored) {
    const Index page = stored.seq * stored.dim;
    return HeadsView<T>(data, {stored.heads, stored.batch, stored.seq, stored.dim},
                        {page, stored.heads * page, stored.dim});
  }

  /// The pages a sequence still holds.
  static std::vector<Index> held(const Sequence& s) {
    return {s.pages.begin() + s.first_page, s.pages.end()};
  }

  Sequence& mutable_sequence(SequenceId id, const char* op) {
    sequence(id, op);
    return sequences_.find(id)->second;
  }

  Index take() {
    const Index page = free_.back();
    free_.pop_back();
    refs_[static_cast<std::size_t>(page)] = 1;
    return page;
  }

  void release(Index page) {
    APEX_ASSERT(page >= 0 && refs_[static_cast<std::size_t>(page)] > 0);
    if (--refs_[static_cast<std::size_t>(page)] == 0) free_.push_back(page);
  }

  std::vector<Plane> planes_;  // a moved-from vector is empty
  ResetOnMove<Index> page_size_;
  std::vector<Index> refs_;  // references of every page
  std::vector<Index> free_;  // pages with no reference, the next one taken last
  std::map<SequenceId, Sequence> sequences_;
  Index next_id_ = 0;
};

}  // namespace detail

/// The sequences and pages of a paged cache, shared by PagedKvCache and PagedLatentCache: the
/// live sequences with their block tables, and the pool's memory figures. A default-constructed
/// or moved-from one has no pages and no sequences, and every add throws.
template <class Storage>
class PagedSequences {
 public:
  /// Tokens per page.
  Index page_size() const { return pool_.page_size(); }
  /// Pages of the pool.
  Index num_pages() const { return pool_.num_pages(); }
  /// Pages no sequence holds.
  Index free_pages() const { return pool_.free_pages(); }
  /// Pages some sequence holds (a shared page counts once).
  Index pages_in_use() const { return pool_.pages_in_use(); }
  /// How many sequences hold page p (0 <= p < num_pages()).
  Index references(Index page) const { return pool_.references(page); }
  /// Exact bytes of the pools, whatever is in use.
  std::int64_t bytes() const { return pool_.bytes(); }
  /// The fraction of the rows of the pages in use that hold no token.
  double fragmentation() const { return pool_.fragmentation(); }
  /// Number of live sequences.
  Index sequences() const { return static_cast<Index>(pool_.sequences().size()); }
  /// Whether id names a live sequence (added, and not freed).
  bool contains(SequenceId id) const { return pool_.contains(id); }
  /// Tokens of sequence id (positions [0, length)); throws unless it is live.
  Index length(SequenceId id) const { return pool_.sequence(id, op_).length; }
  /// Absolute position of the first token still held (0 unless forget_before released pages).
  Index first_position(SequenceId id) const {
    return pool_.sequence(id, op_).first_page * page_size();
  }
  /// The block table of sequence id: the page of positions [i·page, (i + 1)·page), or -1 for a
  /// page forgotten by forget_before. Valid until the sequence changes.
  const std::vector<Index>& block_table(SequenceId id) const {
    return pool_.sequence(id, op_).pages;
  }

  /// Adds an empty sequence and returns its id. Throws on an empty cache.
  SequenceId add() { return pool_.add(op_); }
  /// Adds a sequence holding the tokens of `id` in the same pages (copy on write; see the top
  /// of this header) and returns its id. Throws unless `id` is live.
  SequenceId fork(SequenceId id) { return pool_.fork(id, op_); }
  /// Frees sequence `id` (its id is then invalid). Throws unless it is live.
  void free(SequenceId id) { pool_.free(id, op_); }
  /// Keeps the first new_length tokens of `id`, first_position(id) <= new_length <= length(id).
  void truncate(SequenceId id, Index new_length) { pool_.truncate(id, new_length, op_); }
  /// Speculative decoding's accept: of the tokens after the first `first` (a draft appended and
  /// verified), keeps those at first + rows[k] at positions first + k, in order, and drops the
  /// others; the length becomes first + rows.size(). rows are strictly increasing, each in
  /// [0, length(id) − first) (the accepted path of a DraftTree, tree_mask.hpp, root first; empty
  /// rejects the whole draft). A page that another sequence holds too is copied before a row moves
  /// into it (copy on write), and pages left holding no token go back to the pool. Throws unless
  /// `id` is live, first_position(id) <= first <= length(id), the rows are as said and the pool
  /// has a free page for each copy; a failed call changes nothing. Allocates nothing.
  void keep_tokens(SequenceId id, Index first, const std::vector<Index>& rows) {
    pool_.keep_tokens(id, first, rows, op_);
  }
  /// The checks of keep_tokens(id, first, rows) but for the pool's room (`op` names the call in
  /// the messages; the cache's own name by default); returns the pages it would copy.
  Index keep_copies(SequenceId id, Index first, const std::vector<Index>& rows,
                    const char* op = nullptr) const {
    return pool_.keep_copies(id, first, rows, op ? op : op_);
  }
  /// Throws unless `copies` pages are free (`what` says for what; `op` as above).
  void check_room(Index copies, const char* what, const char* op = nullptr) const {
    pool_.check_room(copies, what, op ? op : op_);
  }
  /// Releases the pages of `id` that hold only positions before `position` (0 <= position <=
  /// length(id)): for a sliding window of W, position = length − W + 1 before the next token
  /// (no later query sees them).
  void forget_before(SequenceId id, Index position) { pool_.forget_before(id, position, op_); }
  /// Throws unless n tokens can be appended to sequence id for every (id, n) of `appends` in one
  /// step (distinct live ids): the pages they need together fit in the free pages.
  /// `op` names the operation in the messages (the cache's own name by default).
  void check_appends(const std::vector<std::pair<SequenceId, Index>>& appends,
                     const char* op = nullptr) const {
    pool_.check_grow_all(appends, op ? op : op_);
  }
  /// Throws unless `out` shares no memory with the pools or a block table: the alias check of
  /// the calls that write `out` while they read this cache (`op` names the call and `what` the
  /// output in the message).
  template <class T>
  void check_not_aliased(const HeadsView<T>& out, const char* op, const char* what) const {
    APEX_CHECK(!pool_.overlaps(detail::byte_range(out)),
               "[" << op << "] " << what << " must not share memory with the cache's pages");
  }

 protected:
  /// No pages, no sequences.
  PagedSequences() = default;
  /// The pools of detail::PagePool; `op` (a literal) prefixes every message.
  PagedSequences(Index page_size, Index num_pages,
                 const std::vector<std::pair<Index, Index>>& planes, const char* op)
      : pool_(page_size, num_pages, planes, op), op_(op) {}

  /// Grows sequence id by n tokens (positions [length, length + n), checked by the caller: see
  /// check_grow) and calls write(t, page, row) for t in [0, n), the slot of the t-th new token.
  template <class Write>
  void append_tokens(SequenceId id, Index n, const Write& write) {
    const Index first = pool_.grow(id, n, op_);
    const auto& s = pool_.sequence(id, op_);
    for (Index t = 0; t < n; ++t) {
      const auto [page, row] = pool_.slot(s, first + t);
      write(t, page, row);
    }
  }

  /// The held tokens of sequence id as a paged key segment of the kernel, keys read from pool
  /// view k and values from v; valid until the sequence changes.
  detail::KeySegment<Storage, Storage> held_segment(SequenceId id,
                                                    const HeadsView<const Storage>& k,
                                                    const HeadsView<const Storage>& v) const {
    const auto& s = pool_.sequence(id, op_);
    const Index first = s.first_page * page_size();
    return detail::paged_segment(k, v, first, s.pages.data() + s.first_page, s.length - first);
  }

  /// The pages, their reference counts, the pools and the sequences' block tables.
  detail::PagePool<Storage> pool_;
  /// The name that prefixes every message of the cache.
  const char* op_ = "paged_cache";
};

/// The paged K/V cache of one multi-head or grouped-query attention layer (§7.4, §8.3) for many
/// sequences: pools of K and V pages, [num_pages, H_kv, page_size, d_h] each, shared by every
/// sequence through its block table (see the top of this header). Scalar is the type of the
/// appended tokens, Storage the format held (kv_format.hpp: Eigen::half or Eigen::bfloat16 halve
/// the bytes, each element rounded once as it is written; a block format of kv_quant.hpp stores
/// each row of d_h values quantized alone, d_h a whole number of its blocks). Memory:
/// 2·num_pages·H_kv·page_size·d_h values in Storage's format, allocated (zeroed) at construction,
/// plus a block table per sequence.
template <class Scalar, class Storage = Scalar>
class PagedKvCache : public PagedSequences<Storage> {
  using Base = PagedSequences<Storage>;
  using Base::pool_;

 public:
  /// The type of the appended tokens, and of the attention computed over them.
  using ScalarType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// An empty cache: no pages (every add throws).
  PagedKvCache() = default;
  /// Allocates the pools. Throws unless every extent is >= 1, head_dim is a whole number of
  /// Storage's blocks and the bytes fit in 64 bits.
  explicit PagedKvCache(const PagedKvCacheShape& shape)
      : Base(shape.page_size, shape.num_pages, planes(shape), kOp) {
    detail::require_supported_scalar<Scalar>();
  }

  /// H_kv.
  Index num_kv_heads() const { return pool_.num_pages() == 0 ? 0 : pool_.plane(0).heads(); }
  /// d_h, the width of keys and values in values (the pools' rows hold d_h / kValuesPerElement
  /// elements of Storage).
  Index head_dim() const { return pool_.num_pages() == 0 ? 0 : row_values(pool_.plane(0)); }
  /// Width of a key as attention reads it: d_h.
  Index key_dim() const { return head_dim(); }
  /// Width of a value as attention reads it: d_h.
  Index value_dim() const { return head_dim(); }
  /// Appends n tokens to sequence id, at positions [length, length + n): k, v [1, H_kv, n, d_h]
  /// views of any layout, each row stored through Storage's format alone. Checks everything
  /// first (a live id, the shapes, room in the pool) and changes nothing when one fails; k and v
  /// must not overlap the pools. Allocates only the block table's growth.
  void append(SequenceId id, const ConstHeadsView<Scalar>& k, const ConstHeadsView<Scalar>& v) {
    check_append(id, k, v);
    this->append_tokens(id, k.seq(), [&](Index t, Index page, Index row) {
      for (Index h = 0; h < k.heads(); ++h) {
        KvFormat<Storage>::store_row(detail::row_data(k, 0, h, t), head_dim(),
                                     detail::row_data(pool_.plane(0), page, h, row));
        KvFormat<Storage>::store_row(detail::row_data(v, 0, h, t), head_dim(),
                                     detail::row_data(pool_.plane(1), page, h, row));
      }
    });
  }

  /// Everything append checks, without appending.
  void check_append(SequenceId id, const ConstHeadsView<Scalar>& k,
                    const ConstHeadsView<Scalar>& v) const {
    const char* op = kOp;
    pool_.sequence(id, op);
    const HeadsShape want{1, num_kv_heads(), k.seq(), head_dim()};
    APEX_CHECK(k.shape() == want && v.shape() == want,
               "[" << op << "] k and v must be [1, H_kv, n, d_h] = [1, " << num_kv_heads() << ", "
                   << k.seq() << ", " << head_dim() << "]; got k [" << k.batch() << ", "
                   << k.heads() << ", " << k.seq() << ", " << k.dim() << "], v [" << v.batch()
                   << ", " << v.heads() << ", " << v.seq() << ", " << v.dim() << "]");
    for (std::size_t p = 0; p < 2; ++p) {
      const auto pool = detail::byte_range(pool_.plane(p));
      APEX_CHECK(!pool.overlaps(detail::byte_range(k)) && !pool.overlaps(detail::byte_range(v)),
                 "[" << op << "] k and v must not overlap the cache");
    }
    pool_.check_grow(id, k.seq(), op);
  }

  /// The keys of sequence id as a paged key segment of the kernel (its held positions), valid
  /// until the sequence changes.
  detail::KeySegment<Storage, Storage> segment(SequenceId id) const {
    return this->held_segment(id, pool_.plane(0), pool_.plane(1));
  }

 private:
  static constexpr const char* kOp = "paged_kv_cache";

  /// The K and V pools, {H_kv, d_h} each, once d_h is checked to be whole blocks.
  static std::vector<std::pair<Index, Index>> planes(const PagedKvCacheShape& shape) {
    detail::check_row_values<Storage>(shape.head_dim, kOp, "head_dim");
    return {{shape.num_kv_heads, shape.head_dim}, {shape.num_kv_heads, shape.head_dim}};
  }
};

/// The paged cache of one multi-head latent attention layer (§9.4) for many sequences: per
/// token one row [c_kv ‖ K_rope] of d_kv + H_kr·d_r values (LatentCache's row), in a pool
/// [num_pages, 1, page_size, d_kv + H_kr·d_r] shared through block tables. Attention reads it as
/// absorbed MLA does (mla.hpp): the keys are whole rows, the values their first d_kv columns, one
/// key/value head. Scalar and Storage as for PagedKvCache; a block format stores the c_kv and
/// K_rope parts of a row each quantized alone, as LatentCache does (d_kv and d_r whole blocks, so
/// that no block straddles them), and a whole-row format (FlashMlaFp8Row) stores each row as one
/// element, its values then being the whole rows (value_dim(); absorbed MLA drops the K_rope
/// columns of the output, as over a LatentCache of it). Memory: num_pages·page_size·(d_kv +
/// H_kr·d_r) values in Storage's format, allocated (zeroed) at construction, plus a block table per
/// sequence.
template <class Scalar, class Storage = Scalar>
class PagedLatentCache : public PagedSequences<Storage> {
  using Base = PagedSequences<Storage>;
  using Base::pool_;

 public:
  /// The type of the appended rows, and of the attention computed over them.
  using ScalarType = Scalar;
  /// The type of the cached elements.
  using StorageType = Storage;

  /// An empty cache: no pages (every add throws).
  PagedLatentCache() = default;
  /// Allocates the pool. Throws unless every extent is >= 1, rope_dim is even, latent_dim and
  /// rope_dim are whole numbers of Storage's blocks and the bytes fit in 64 bits.
  explicit PagedLatentCache(const PagedLatentCacheShape& shape)
      : Base(shape.page_size, shape.num_pages, {{1, row_width(shape)}}, "paged_latent_cache"),
        latent_dim_(shape.latent_dim) {
    detail::require_supported_scalar<Scalar>();
  }

  /// d_kv: the first d_kv values of every row, and the width of a value.
  Index latent_dim() const { return latent_dim_; }
  /// d_kv + H_kr·d_r: the values cached per token, and the width of a key.
  Index row_dim() const { return pool_.num_pages() == 0 ? 0 : row_values(pool_.plane(0)); }
  /// One key/value head (the latent is shared by every query head).
  Index num_kv_heads() const { return pool_.num_pages() == 0 ? 0 : 1; }
  /// Width of a key as attention reads it: d_kv + H_kr·d_r.
  Index key_dim() const { return row_dim(); }
  /// Width of a value as attention reads it: d_kv, or d_kv + H_kr·d_r for a whole-row format.
  Index value_dim() const { return is_latent_row_format_v<Storage> ? row_dim() : latent_dim(); }
  /// Appends n tokens from their rows [n, d_kv + H_kr·d_r] = [c_kv ‖ K_rope] (the layout of
  /// LatentCache::rows()), the c_kv and K_rope parts of each stored through Storage's format
  /// alone (or the whole row, for a whole-row format). Checks everything first and changes
  /// nothing when one fails.
  void append(SequenceId id, const ConstRowRef<Scalar>& rows) {
    pool_.sequence(id, kOp);
    APEX_CHECK(rows.cols() == row_dim(),
               "[" << kOp << "] rows have " << rows.cols()
                   << " columns; expected d_kv + H_kr·d_r = " << row_dim());
    pool_.check_grow(id, rows.rows(), kOp);
    // NOLINTNEXTLINE(bugprone-easily-swappable-parameters): append_tokens's (token, page, row)
    this->append_tokens(id, rows.rows(), [&](Index t, Index page, Index row) {
      store(rows.row(t).data(), detail::row_data(pool_.plane(0), page, 0, row));
    });
  }

  /// The rows of sequence id as a paged key segment of the kernel: keys the whole rows, values
  /// their first d_kv columns (the whole rows for a whole-row format). Valid until the sequence
  /// changes.
  detail::KeySegment<Storage, Storage> segment(SequenceId id) const {
    const HeadsView<const Storage> rows = pool_.plane(0);
    if constexpr (is_latent_row_format_v<Storage>) return this->held_segment(id, rows, rows);
    HeadsShape latent = rows.shape();
    latent.dim = KvFormat<Storage>::elements(latent_dim_);
    return this->held_segment(id, rows,
                              HeadsView<const Storage>(rows.data(), latent, rows.strides()));
  }

 private:
  static constexpr const char* kOp = "paged_latent_cache";

  /// Stores one row [c_kv ‖ K_rope] (row_dim() values) at `to` (detail::store_latent_row).
  void store(const Scalar* from, Storage* to) const {
    detail::store_latent_row(from, latent_dim(), from + latent_dim(), row_dim() - latent_dim(), to);
  }

  static Index row_width(const PagedLatentCacheShape& shape) {
    APEX_CHECK(shape.latent_dim >= 1 && shape.rope_heads >= 1 && shape.rope_dim >= 1 &&
                   shape.rope_dim % 2 == 0,
               "[" << kOp << "] latent_dim (" << shape.latent_dim << ") and rope_heads ("
                   << shape.rope_heads << ") must be >= 1 and rope_dim (" << shape.rope_dim
                   << ") even and >= 2");
    const Index width = detail::checked_sum(
        shape.latent_dim,
        detail::checked_product(shape.rope_heads, shape.rope_dim, kOp, "H_kr·d_r"), kOp,
        "d_kv + H_kr·d_r");
    detail::check_latent_parts<Storage>(shape, kOp);
    return width;
  }

  detail::ResetOnMove<Index> latent_dim_;
};

/// K and V of many sequences in pages of a pool that the caller owns (vLLM's layout): sequence i
/// holds lengths[i] tokens, token t in row t mod P of page block_tables[i][t / P], P the pools'
/// page size. TK and TV are K/V formats (kv_format.hpp): the pools' widths count their elements,
/// d_qk / kValuesPerElement of them for a block format. Views, not copies: the pools and the
/// tables must outlive the call.
template <class TK, class TV>
struct BlockTables {
  HeadsView<const TK> k_pages;                   ///< [num_pages, H_kv, P, d_qk in elements]
  HeadsView<const TV> v_pages;                   ///< [num_pages, H_kv, P, d_v in elements]
  std::vector<std::vector<Index>> block_tables;  ///< per sequence, >= ⌈lengths[i] / P⌉ pages
  std::vector<Index> lengths;                    ///< per sequence, tokens held
};

}  // namespace apex
