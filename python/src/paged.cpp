// SPDX-License-Identifier: MIT
// apex.PagedKvCache: the paged K/V cache of one layer for many sequences (page_pool.hpp) in any
// storage format, with its bookkeeping (add, append, fork, free, truncate, keep_tokens) and the
// attention over it (sdpa_paged, and sdpa_cascade, which reads pages that forked sequences share
// once for all of them; paged_attention.hpp, cascade_attention.hpp).
//
// Layouts: tokens are token-major as vLLM and FlashAttention's varlen calls take them, k and v
// [n, H_kv, d_h] for one sequence, q [total_q, H_q, d_h] for the packed queries of many.
#include "formats.hpp"

namespace apex::python {

namespace {

using PagedBox = AnyOf<PagedKvCache>;

/// A Python apex.PagedKvCache: one C++ cache of any format.
struct PyPagedCache {
  PagedBox any;

  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), any);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), any);
  }
};

PyPagedCache make_paged_cache(const PagedKvCacheShape& shape, const std::string& format) {
  return {make_alternative<PagedBox>(format_index(format, "paged_kv_cache"), [&](auto tag) {
    return typename decltype(tag)::type(shape);
  })};
}

/// Sequence ids as the C++ names them.
std::vector<SequenceId> sequence_ids(const std::vector<Index>& ids) {
  std::vector<SequenceId> out;
  out.reserve(ids.size());
  for (const Index id : ids) out.push_back(SequenceId{id});
  return out;
}

template <class Cache>
void paged_append(Cache& cache, Index id, const py::array& k, const py::array& v) {
  using S = compute_t<Cache>;
  const char* op = "paged_kv_cache";
  check_dtype<S>(k, op, "k", "the cache's dtype");
  check_dtype<S>(v, op, "v", "the cache's dtype");
  const HeadsInput<S> ki = packed_input<S>(k, op, "k");
  const HeadsInput<S> vi = packed_input<S>(v, op, "v");
  const py::gil_scoped_release release;
  cache.append(SequenceId{id}, ki.view, vi.view);
}

/// The keyword arguments of attend: those of the layers' calls, and more of apex.sdpa's.
struct AttendArgs {
  CallArgs call;
  std::optional<Index> chunk;
  std::optional<std::vector<double>> sinks, alibi_slopes;
  bool cascade = false;
  bool return_lse = false;

  PositionMask rule() const {
    PositionMask m = call.rule();
    m.chunk = chunk;
    return m;
  }
  SdpaParams params() const {
    SdpaParams p = call.params();
    if (sinks) p.sinks = *sinks;
    if (alibi_slopes) p.alibi_slopes = *alibi_slopes;
    return p;
  }
};

template <class Cache>
py::object paged_attend(const Cache& cache, const py::array& q, const std::vector<Index>& ids,
                        const py::array& cu_seqlens_q, const AttendArgs& a) {
  using S = compute_t<Cache>;
  const char* op = a.cascade ? "sdpa_cascade" : "sdpa_paged";
  check_dtype<S>(q, op, "q", "the cache's dtype");
  const HeadsInput<S> qi = packed_input<S>(q, op, "q");
  const std::vector<Index> offsets = index_list(cu_seqlens_q);
  const std::vector<SequenceId> sequences = sequence_ids(ids);
  const PositionMask rule = a.rule();
  const SdpaParams params = a.params();
  Outputs<S> r = packed_outputs<S>(qi.view.seq(), qi.view.heads(), cache.value_dim(), a.return_lse);
  {
    const py::gil_scoped_release release;
    if (a.cascade) {
      sdpa_cascade(qi.view, offsets, cache, sequences, {rule}, params, r.out_view, r.lse_view);
    } else {
      sdpa_paged(qi.view, offsets, cache, sequences, {rule}, params, r.out_view, r.lse_view);
    }
  }
  return r.returned(a.return_lse);
}

/// A read-only property of the cache: get(cache) whichever format it holds.
template <class Get>
auto property(Get get) {
  return [get](const PyPagedCache& c) { return c.visit(get); };
}

void def_pages(py::class_<PyPagedCache>& c) {
  c.def_property_readonly(
       "format", [](const PyPagedCache& p) { return kFormats[p.any.index()]; },
       "The storage format's name.")
      .def_property_readonly(
          "dtype", property([](const auto& x) { return numpy_name<compute_t<decltype(x)>>(); }),
          "numpy dtype of what the cache takes and returns: 'float64' for format float64, else "
          "'float32'.")
      .def_property_readonly("num_kv_heads",
                             property([](const auto& x) { return x.num_kv_heads(); }), "H_kv.")
      .def_property_readonly("head_dim", property([](const auto& x) { return x.head_dim(); }),
                             "d_h (values).")
      .def_property_readonly("page_size", property([](const auto& x) { return x.page_size(); }),
                             "Tokens per page.")
      .def_property_readonly("num_pages", property([](const auto& x) { return x.num_pages(); }),
                             "Pages in the pool.")
      .def_property_readonly("free_pages", property([](const auto& x) { return x.free_pages(); }),
                             "Pages no sequence holds.")
      .def_property_readonly("pages_in_use",
                             property([](const auto& x) { return x.pages_in_use(); }),
                             "num_pages − free_pages.")
      .def_property_readonly(
          "bytes", property([](const auto& x) { return x.bytes(); }),
          "Exact bytes of the K and V pools: 2·num_pages·H_kv·page_size rows of d_h values in "
          "the format, whatever the sequences hold.")
      .def_property_readonly(
          "fragmentation", property([](const auto& x) { return x.fragmentation(); }),
          "The share of the held pages' slots that hold no token (PagedKvCache::fragmentation).")
      .def("__len__", property([](const auto& x) { return x.sequences(); }),
           "Number of live sequences.")
      .def(
          "__contains__",
          [](const PyPagedCache& p, Index id) {
            return p.visit([&](const auto& x) { return x.contains(SequenceId{id}); });
          },
          py::arg("id"), "Whether sequence id is live.")
      .def(
          "references",
          [](const PyPagedCache& p, Index page) {
            return p.visit([&](const auto& x) {
              APEX_CHECK(page >= 0 && page < x.num_pages(), "[paged_kv_cache] page ("
                                                                << page << ") must be in [0, "
                                                                << x.num_pages() << ")");
              return x.references(page);
            });
          },
          py::arg("page"), "How many sequences hold page `page` (shared by forks while > 1).");
}

void def_sequences(py::class_<PyPagedCache>& c) {
  c.def(
       "add", [](PyPagedCache& p) { return p.visit([](auto& x) { return x.add().value; }); },
       "Adds an empty sequence; returns its id (an int, never reused).")
      .def(
          "fork",
          [](PyPagedCache& p, Index id) {
            return p.visit([&](auto& x) { return x.fork(SequenceId{id}).value; });
          },
          py::arg("id"),
          "Adds a sequence holding the tokens of `id` in the same pages (copy on write: a shared "
          "page is copied when either appends into it); returns its id.")
      .def(
          "free",
          [](PyPagedCache& p, Index id) { p.visit([&](auto& x) { x.free(SequenceId{id}); }); },
          py::arg("id"), "Frees sequence `id`; pages no other sequence holds return to the pool.")
      .def(
          "length",
          [](const PyPagedCache& p, Index id) {
            return p.visit([&](const auto& x) { return x.length(SequenceId{id}); });
          },
          py::arg("id"), "Tokens sequence `id` holds, positions [0, length).")
      .def(
          "block_table",
          [](const PyPagedCache& p, Index id) {
            return p.visit([&](const auto& x) { return x.block_table(SequenceId{id}); });
          },
          py::arg("id"),
          "The pages of sequence `id` in order: page i holds positions [i·page_size, (i + 1)·"
          "page_size). A new list.")
      .def(
          "truncate",
          [](PyPagedCache& p, Index id, Index length) {
            p.visit([&](auto& x) { x.truncate(SequenceId{id}, length); });
          },
          py::arg("id"), py::arg("length"), "Keeps the first `length` tokens of sequence `id`.")
      .def(
          "keep_tokens",
          [](PyPagedCache& p, Index id, Index first, const std::vector<Index>& rows) {
            p.visit([&](auto& x) { x.keep_tokens(SequenceId{id}, first, rows); });
          },
          py::arg("id"), py::arg("first"), py::arg("rows"),
          "Speculative decoding's accept (PagedKvCache::keep_tokens): of the tokens after the "
          "first `first`, keeps those at first + rows[k] at positions first + k, in order, and "
          "drops the others. rows strictly increasing. A failed call changes nothing.")
      .def(
          "append",
          [](PyPagedCache& p, Index id, const ArrayLike& k, const ArrayLike& v) {
            p.visit([&](auto& x) { paged_append(x, id, k, v); });
          },
          py::arg("id"), py::arg("k"), py::arg("v"),
          "Appends n tokens to sequence `id` (PagedKvCache::append): k, v [n, H_kv, d_h] of the "
          "cache's dtype (read in place when their last axis is contiguous), each row stored "
          "through the format once. Takes free pages as needed, copying a shared last page "
          "first. Raises ValueError (nothing changed) for a dead id, a bad shape or dtype, or a "
          "pool without room.");
}

void def_attend(py::class_<PyPagedCache>& c) {
  c.def(
      "attend",
      [](const PyPagedCache& p, const ArrayLike& q, const std::vector<Index>& ids,
         const ArrayLike& cu_seqlens_q, bool causal, std::optional<Index> window,
         std::optional<Index> chunk, Index prefix, std::optional<double> scale, double softcap,
         std::optional<std::vector<double>> sinks, std::optional<std::vector<double>> alibi,
         bool cascade, bool return_lse) {
        const CallArgs call{causal, window, prefix, scale, softcap};
        const AttendArgs a{call, chunk, std::move(sinks), std::move(alibi), cascade, return_lse};
        return p.visit([&](const auto& x) { return paged_attend(x, q, ids, cu_seqlens_q, a); });
      },
      py::arg("q"), py::arg("ids"), py::arg("cu_seqlens_q"), py::kw_only(),
      py::arg("causal") = false, py::arg("window") = py::none(), py::arg("chunk") = py::none(),
      py::arg("prefix") = 0, py::arg("scale") = py::none(), py::arg("softcap") = 0.0,
      py::arg("sinks") = py::none(), py::arg("alibi_slopes") = py::none(),
      py::arg("cascade") = false, py::arg("return_lse") = false,
      R"doc(Attention of many sequences over their own cached tokens (apex::sdpa_paged).

q: [total_q, H_q, d_h] of the cache's dtype, the queries of sequence ids[i] being rows
[cu_seqlens_q[i], cu_seqlens_q[i + 1]), and the last tokens of that sequence, already appended
(a decoding step: append each sequence's token, then one attend over all). Returns out
[total_q, H_q, d_h] (and lse [total_q, H_q] with return_lse=True). Equals apex.sdpa over the same
tokens stored contiguously, bit for bit (over the values a 16-bit or block format decodes to).
The rule (causal, window, chunk, prefix) is applied on each sequence's own positions; scale,
softcap, sinks, alibi_slopes as apex.sdpa. cascade=True runs apex::sdpa_cascade instead: pages
that several of the named sequences hold (forks of one prompt) are read once for all of them and
the parts merged exactly, equal to the plain call within attention's rounding rather than bit
for bit. Raises ValueError on a dead id or a bad shape; the cache never changes.)doc");
}

}  // namespace

void def_paged(py::module_& m) {
  py::class_<PyPagedCache> c(
      m, "PagedKvCache",
      (std::string("Paged K/V cache of one attention layer for many sequences (vLLM's "
                   "PagedAttention; apex::PagedKvCache<Scalar, Storage>, page_pool.hpp): pools "
                   "of K and V pages, [num_pages, H_kv, page_size, d_h] each, allocated (zeroed) "
                   "at construction, shared by the sequences through their block tables; fork "
                   "shares a sequence's pages until one of the two appends into a shared page "
                   "(copy on write).\n\nformat: ") +
       kFormatDoc)
          .c_str());
  c.def(py::init([](Index num_kv_heads, Index head_dim, Index page_size, Index num_pages,
                    const std::string& format) {
          return make_paged_cache({num_kv_heads, head_dim, page_size, num_pages}, format);
        }),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"), py::arg("num_pages"),
        py::kw_only(), py::arg("format") = "float32",
        "Allocates the pools: 2·num_pages·H_kv·page_size·d_h values of the format. Raises "
        "ValueError unless every extent is >= 1 and head_dim is whole blocks of the format.");
  def_pages(c);
  def_sequences(c);
  def_attend(c);
}

}  // namespace apex::python
