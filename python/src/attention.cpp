// SPDX-License-Identifier: MIT
// apex.sdpa, apex.sdpa_varlen, apex.merge_attention and apex.alibi_slopes: the attention calls
// of sdpa.hpp, varlen.hpp and merge_attention.hpp on numpy arrays. Each reads its inputs in place
// where their layout allows (arrays.hpp), allocates its results, and releases the GIL while apex
// computes.
#include "arrays.hpp"

#include <chrono>
#include <limits>

namespace apex::python {

namespace {

/// The position rule of a call, with the document ids it points into.
struct Rule {
  PositionMask mask;
  py::array documents;  ///< keeps mask.documents' ids alive
};

/// The keyword arguments that form a PositionMask (mask.hpp).
struct RuleArgs {
  bool causal = false;
  std::optional<Index> window, chunk;
  Index prefix = 0;
  std::optional<py::array> documents;
  std::optional<Index> query_offset;
  Index key_offset = 0;
};

Rule position_rule(const RuleArgs& a) {
  Rule r;
  r.mask.causal = a.causal;
  r.mask.window = a.window;
  r.mask.chunk = a.chunk;
  r.mask.prefix = a.prefix;
  r.mask.query_offset = a.query_offset;
  r.mask.key_offset = a.key_offset;
  if (a.documents) {
    r.documents = contiguous_as<std::int64_t>(*a.documents);
    r.mask.documents = DocumentIds(static_cast<const Index*>(r.documents.data()),
                                   static_cast<Index>(r.documents.size()));
  }
  return r;
}

/// The keyword arguments that form SdpaParams (sdpa_params.hpp).
struct ScoreArgs {
  std::optional<double> scale;
  double softcap = 0.0;
  std::optional<std::vector<double>> sinks, alibi_slopes;
  bool allow_bf16_products = false;
};

SdpaParams score_params(const ScoreArgs& a) {
  SdpaParams p;
  p.scale = a.scale;
  p.softcap = a.softcap;
  if (a.sinks) p.sinks = *a.sinks;
  if (a.alibi_slopes) p.alibi_slopes = *a.alibi_slopes;
  p.allow_bf16_products = a.allow_bf16_products;
  return p;
}

/// The dense mask and bias of a call, read in place where they can be.
template <class T>
struct DenseMasks {
  HeadsInput<bool> allowed;
  HeadsInput<T> bias;

  DenseMasks(const std::optional<py::array>& mask, const std::optional<py::array>& bias_,
             const char* op) {
    if (mask) {
      check_dtype<bool>(*mask, op, "mask", "a boolean mask (True: may attend)");
      allowed = heads_input<bool>(*mask, op, "mask");
    }
    if (bias_) {
      check_dtype<T>(*bias_, op, "bias", "the dtype of q");
      bias = heads_input<T>(*bias_, op, "bias");
    }
  }
  AttentionMask<T> with(const PositionMask& rule) const { return {rule, allowed.view, bias.view}; }
};

/// Throws unless k and v have q's dtype and rank.
template <class T>
void check_like_q(const py::array& q, const py::array& k, const py::array& v, const char* op) {
  check_dtype<T>(k, op, "k", "the dtype of q");
  check_dtype<T>(v, op, "v", "the dtype of q");
  APEX_CHECK(k.ndim() == q.ndim() && v.ndim() == q.ndim(),
             "[" << op << "] k and v ranks (" << k.ndim() << ", " << v.ndim()
                 << ") must equal q's rank " << q.ndim());
}

/// The two attention calls of the same arguments: apex::sdpa, results in q's dtype, and
/// apex::reference::sdpa, the double-precision oracle, results in float64.
enum class Call { kKernel, kReference };

template <class T, class TO>
py::object sdpa_of(const py::array& q, const py::array& k, const py::array& v, const Rule& rule,
                   const DenseMasks<T>& masks, const SdpaParams& params, bool return_lse,
                   const std::optional<py::array>& out, const char* op) {
  const HeadsInput<T> qi = heads_input<T>(q, op, "q");
  check_like_q<T>(q, k, v, op);
  const HeadsInput<T> ki = heads_input<T>(k, op, "k");
  const HeadsInput<T> vi = heads_input<T>(v, op, "v");
  const AttentionMask<T> mask = masks.with(rule.mask);
  Outputs<TO> r = heads_outputs<TO>(q, qi.view.shape(), vi.view.dim(), return_lse, out, op);
  {
    const py::gil_scoped_release release;
    if constexpr (std::is_same_v<T, TO>) {
      sdpa(qi.view, ki.view, vi.view, mask, params, r.out_view, r.lse_view);
    } else {
      reference::sdpa(qi.view, ki.view, vi.view, mask, params, r.out_view, r.lse_view);
    }
  }
  return r.returned(return_lse);
}

template <Call kCall>
py::object sdpa_py(const ArrayLike& q, const ArrayLike& k, const ArrayLike& v,
                   const RuleArgs& rule_args, const std::optional<ArrayLike>& mask,
                   const std::optional<ArrayLike>& bias, const ScoreArgs& score_args,
                   bool return_lse, const std::optional<std::string>& dtype,
                   const std::optional<py::array>& out) {
  const char* op = kCall == Call::kKernel ? "sdpa" : "reference_sdpa";
  const Rule rule = position_rule(rule_args);
  const SdpaParams params = score_params(score_args);
  return with_storage(storage_of(q, dtype, op, "q"), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using TO = std::conditional_t<kCall == Call::kKernel, T, double>;
    return sdpa_of<T, TO>(q, k, v, rule, DenseMasks<T>(mask, bias, op), params, return_lse, out,
                          op);
  });
}

template <class T>
py::object varlen_of(const py::array& q, const py::array& k, const py::array& v,
                     const RaggedBatch& batch, const Rule& rule, const DenseMasks<T>& masks,
                     const SdpaParams& params, bool return_lse) {
  const char* op = "sdpa_varlen";
  const HeadsInput<T> qi = packed_input<T>(q, op, "q");
  check_like_q<T>(q, k, v, op);
  const HeadsInput<T> ki = packed_input<T>(k, op, "k");
  const HeadsInput<T> vi = packed_input<T>(v, op, "v");
  Outputs<T> r = packed_outputs<T>(qi.view.seq(), qi.view.heads(), vi.view.dim(), return_lse);
  const AttentionMask<T> mask = masks.with({});
  {
    const py::gil_scoped_release release;
    sdpa_varlen(qi.view, ki.view, vi.view, batch, {rule.mask}, mask, params, r.out_view,
                r.lse_view);
  }
  return r.returned(return_lse);
}

py::object varlen_py(const ArrayLike& q, const ArrayLike& k, const ArrayLike& v,
                     const ArrayLike& cu_seqlens_q, const ArrayLike& cu_seqlens_k,
                     const RuleArgs& rule_args, const std::optional<ArrayLike>& mask,
                     const std::optional<ArrayLike>& bias, const ScoreArgs& score_args,
                     bool return_lse, const std::optional<std::string>& dtype) {
  const char* op = "sdpa_varlen";
  APEX_CHECK(!rule_args.documents, "[" << op
                                       << "] documents are not taken: each sequence of "
                                          "the batch is its own document");
  if (mask) check_rank(*mask, 2, 3, op, "mask", "2 ([total_q, max_k]) or 3 ([H, total_q, max_k])");
  if (bias) check_rank(*bias, 2, 3, op, "bias", "2 ([total_q, max_k]) or 3 ([H, total_q, max_k])");
  RaggedBatch batch;
  batch.cu_seqlens_q = index_list(cu_seqlens_q);
  batch.cu_seqlens_k = index_list(cu_seqlens_k);
  const Rule rule = position_rule(rule_args);
  const SdpaParams params = score_params(score_args);
  return with_storage(storage_of(q, dtype, op, "q"), [&](auto tag) {
    using T = typename decltype(tag)::type;
    return varlen_of<T>(q, k, v, batch, rule, DenseMasks<T>(mask, bias, op), params, return_lse);
  });
}

/// Rows of [..., d] results and [...] lse as matrices, for merge_attention.
template <class T>
py::tuple merge_of(const py::array& out_a, const py::array& lse_a, const py::array& out_b,
                   const py::array& lse_b) {
  const char* op = "merge_attention";
  check_rank(out_a, 1, 32, op, "out_a", "at least 1");
  for (const auto& [a, name] : {std::pair{out_b, "out_b"}, {lse_a, "lse_a"}, {lse_b, "lse_b"}}) {
    check_dtype<T>(a, op, name, "the dtype of out_a");
  }
  const Index d = static_cast<Index>(out_a.shape(out_a.ndim() - 1));
  APEX_CHECK(out_b.ndim() == out_a.ndim() && lse_a.ndim() + 1 == out_a.ndim() &&
                 lse_b.ndim() + 1 == out_a.ndim(),
             "[" << op << "] ranks (out_a " << out_a.ndim() << ", out_b " << out_b.ndim()
                 << ", lse_a " << lse_a.ndim() << ", lse_b " << lse_b.ndim()
                 << ") must be [..., S, d] for the outputs and [..., S] for the lse");
  const py::array a = contiguous_as<T>(out_a), b = contiguous_as<T>(out_b);
  const py::array la = contiguous_as<T>(lse_a), lb = contiguous_as<T>(lse_b);
  py::array out = new_array<T>({a.shape(), a.shape() + a.ndim()});
  py::array lse = new_array<T>({la.shape(), la.shape() + la.ndim()});
  const auto ma = rows_of<T>(a, d), mb = rows_of<T>(b, d);
  const Eigen::Map<const Vector<T>> va(static_cast<const T*>(la.data()), la.size());
  const Eigen::Map<const Vector<T>> vb(static_cast<const T*>(lb.data()), lb.size());
  Eigen::Map<RowMatrix<T>> mo(mutable_data<T>(out), ma.rows(), d);
  Eigen::Map<Vector<T>> vo(mutable_data<T>(lse), lse.size());
  {
    const py::gil_scoped_release release;
    merge_attention(ma, va, mb, vb, RowRef<T>(mo), VectorRef<T>(vo));
  }
  return py::make_tuple(out, lse);
}

py::tuple merge_py(const ArrayLike& out_a, const ArrayLike& lse_a, const ArrayLike& out_b,
                   const ArrayLike& lse_b) {
  const int num = num_of(out_a);
  APEX_CHECK(
      num == numpy_num<float>() || num == numpy_num<double>(),
      "[merge_attention] out_a dtype (" << dtype_of(out_a) << ") must be float32 or float64");
  if (num == numpy_num<double>()) return merge_of<double>(out_a, lse_a, out_b, lse_b);
  return merge_of<float>(out_a, lse_a, out_b, lse_b);
}

/// The time of one apex::sdpa call made from C++ on float32 q, k, v (read as apex.sdpa reads
/// them, output allocated once): the best of five means over `repeats` calls. What apex.sdpa
/// adds to a call is its own time minus this (python/examples/overhead.py).
double sdpa_cpp_seconds(const ArrayLike& q, const ArrayLike& k, const ArrayLike& v, bool causal,
                        int repeats) {
  const char* op = "_sdpa_cpp_seconds";
  APEX_CHECK(repeats >= 1, "[" << op << "] repeats (" << repeats << ") must be >= 1");
  const HeadsInput<float> qi = heads_input<float>(q, op, "q");
  check_like_q<float>(q, k, v, op);
  const HeadsInput<float> ki = heads_input<float>(k, op, "k");
  const HeadsInput<float> vi = heads_input<float>(v, op, "v");
  Outputs<float> r = heads_outputs<float>(q, qi.view.shape(), vi.view.dim(), false);
  AttentionMask<float> mask;
  mask.positions.causal = causal;
  const py::gil_scoped_release release;
  sdpa(qi.view, ki.view, vi.view, mask, SdpaParams{}, r.out_view);
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i)
      sdpa(qi.view, ki.view, vi.view, mask, SdpaParams{}, r.out_view);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count() / repeats);
  }
  return best;
}

/// Registers an attention call taking apex.sdpa's arguments.
template <Call kCall>
void def_sdpa_call(py::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](const ArrayLike& q, const ArrayLike& k, const ArrayLike& v, bool causal,
         std::optional<Index> window, std::optional<Index> chunk, Index prefix,
         std::optional<ArrayLike> documents, std::optional<Index> query_offset, Index key_offset,
         const std::optional<ArrayLike>& mask, const std::optional<ArrayLike>& bias,
         std::optional<double> scale, double softcap, std::optional<std::vector<double>> sinks,
         std::optional<std::vector<double>> alibi_slopes, bool return_lse, bool allow_bf16_products,
         const std::optional<std::string>& dtype, const std::optional<py::array>& out) {
        return sdpa_py<kCall>(
            q, k, v,
            {causal, window, chunk, prefix, std::move(documents), query_offset, key_offset}, mask,
            bias, {scale, softcap, std::move(sinks), std::move(alibi_slopes), allow_bf16_products},
            return_lse, dtype, out);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), py::arg("causal") = false,
      py::arg("window") = py::none(), py::arg("chunk") = py::none(), py::arg("prefix") = 0,
      py::arg("documents") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("key_offset") = 0, py::arg("mask") = py::none(), py::arg("bias") = py::none(),
      py::arg("scale") = py::none(), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
      py::arg("alibi_slopes") = py::none(), py::arg("return_lse") = false,
      py::arg("allow_bf16_products") = false, py::arg("dtype") = py::none(),
      py::arg("out") = py::none(), doc);
}

/// apex.sdpa's docstring.
constexpr const char* kSdpaDoc =
    R"doc(Scaled dot-product attention (apex::sdpa, §6, §8): softmax(softcap(scale·q·kᵀ) + ALiBi + bias, forbidden → -inf) · v.

q: [B, H_q, S_q, d_qk], k: [B, H_kv, S_k, d_qk], v: [B, H_kv, S_k, d_v], or without B
([H, S, D]) or without B and H ([S, D]); all three of one rank and one dtype. H_q must be a
multiple of H_kv (grouped-query attention; H_kv = 1 is multi-query). Returns out, of q's shape
with d_v last, and with return_lse=True also lse, q's shape without its last axis (the natural
log-sum-exp of each row's scores). Results are new arrays of q's dtype.

dtype: float32 and float64 compute in their own type; float16, and bfloat16 (uint16 arrays with
dtype='bfloat16'), compute in float32 and round each result once.

Position rule (absolute positions; by default the S_q queries are the last S_q of the
key_offset + S_k positions, query_offset=0 aligns them top-left as PyTorch's is_causal does):
causal, window (W ≥ 1, the query counts; needs causal), chunk (C ≥ 1, chunked local attention;
needs causal), prefix (positions [0, P) attend to each other freely), documents (int ids, one per
position: attention stays inside a document), query_offset, key_offset.
mask: bool [B' , H', S_q, S_k] (or [H', S_q, S_k], [S_q, S_k]; B' in {1, B}, H' in {1, H_q}),
True = may attend. bias: additive, same shapes, q's dtype; -inf forbids.
scale (default 1/√d_qk), softcap (c > 0: c·tanh(x/c), Gemma 2), sinks (one logit per query
head, gpt-oss), alibi_slopes (one slope per query head; apex.alibi_slopes(H) gives the
standard ones), allow_bf16_products (bfloat16 factors in the products where the CPU has
AVX512-BF16 or AMX).

out: an array to write the result into instead of a new one (q's dtype and shape with d_v last,
writeable, whole-element strides with a contiguous last axis); it is returned. A call that fills
a large new array pays for the operating system's first touch of its pages; out avoids that.

A row with no allowed key is zeros (lse -inf). Arrays whose strides are whole elements with a
contiguous last axis are read in place; others are copied once. Raises ValueError (apex's
std::invalid_argument, same message) on a bad shape or parameter. Releases the GIL; threads
follow OMP_NUM_THREADS and the result is bit-identical for any number.)doc";

}  // namespace

void def_attention(py::module_& m) {
  def_sdpa_call<Call::kKernel>(m, "sdpa", kSdpaDoc);
  def_sdpa_call<Call::kReference>(
      m, "reference_sdpa",
      R"doc(The plain double-precision oracle apex's kernels are tested against (apex::reference::sdpa).

The arguments of apex.sdpa, the same rule and score terms, computed one row at a time in
double from the inputs as stored (q, k, v of any dtype apex.sdpa takes); returns float64 out
(and lse), and out= must be float64. allow_bf16_products is ignored (the oracle's products are
exact). Allocates O(S_k · (d_qk + d_v)) doubles per head; never S_q × S_k. Slow: for checking,
not for use.)doc");

  m.def(
      "sdpa_varlen",
      [](const ArrayLike& q, const ArrayLike& k, const ArrayLike& v, const ArrayLike& cu_seqlens_q,
         const ArrayLike& cu_seqlens_k, bool causal, std::optional<Index> window,
         std::optional<Index> chunk, Index prefix, std::optional<Index> query_offset,
         Index key_offset, const std::optional<ArrayLike>& mask,
         const std::optional<ArrayLike>& bias, std::optional<double> scale, double softcap,
         std::optional<std::vector<double>> sinks, std::optional<std::vector<double>> alibi_slopes,
         bool return_lse, bool allow_bf16_products, const std::optional<std::string>& dtype) {
        return varlen_py(
            q, k, v, cu_seqlens_q, cu_seqlens_k,
            {causal, window, chunk, prefix, std::nullopt, query_offset, key_offset}, mask, bias,
            {scale, softcap, std::move(sinks), std::move(alibi_slopes), allow_bf16_products},
            return_lse, dtype);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
      py::kw_only(), py::arg("causal") = false, py::arg("window") = py::none(),
      py::arg("chunk") = py::none(), py::arg("prefix") = 0, py::arg("query_offset") = py::none(),
      py::arg("key_offset") = 0, py::arg("mask") = py::none(), py::arg("bias") = py::none(),
      py::arg("scale") = py::none(), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
      py::arg("alibi_slopes") = py::none(), py::arg("return_lse") = false,
      py::arg("allow_bf16_products") = false, py::arg("dtype") = py::none(),
      R"doc(Attention of a ragged batch (apex::sdpa_varlen): sequence i's queries attend to its own keys only.

q: [total_q, H_q, d_qk], k: [total_k, H_kv, d_qk], v: [total_k, H_kv, d_v] (FlashAttention's
packed layout: the sequences one after another along the first axis), cu_seqlens_q and
cu_seqlens_k: N + 1 increasing offsets from 0 to total_q and total_k. Returns out
[total_q, H_q, d_v] and with return_lse=True also lse [total_q, H_q].

The position rule (causal, window, chunk, prefix, query_offset, key_offset) is each sequence's
own, counted from its start, exactly as one apex.sdpa call per sequence; the result equals those
calls bit for bit. mask (bool) and bias (q's dtype): [total_q, max_k] or [H', total_q, max_k]
(H' in {1, H_q}), row r the query row r, column j key j of that row's sequence. Other
parameters, dtypes, layouts, errors and threads as apex.sdpa.)doc");

  m.def(
      "merge_attention", &merge_py, py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"),
      py::arg("lse_b"),
      R"doc(Merges two attention results over disjoint key sets into the result over both (apex::merge_attention).

out_a, out_b: [..., S, d_v], lse_a, lse_b: [..., S] (as apex.sdpa returns them with
return_lse=True), float32 or float64, one dtype. Returns (out, lse): lse = log(e^lse_a + e^lse_b),
out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b, computed in double. A side whose lse is -inf
contributes nothing. Inputs are copied if not C-contiguous.)doc");

  m.def(
      "alibi_slopes", [](Index heads) { return alibi_slopes(heads); }, py::arg("heads"),
      R"doc(The standard ALiBi slopes of H heads (Press et al. 2022): 2^(−8(h+1)/H) for H a power of two, interleaved otherwise. A list of H floats.)doc");
  m.def("_sdpa_cpp_seconds", &sdpa_cpp_seconds, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("causal") = false, py::arg("repeats") = 1000,
        "Seconds per apex::sdpa call made from C++ on float32 q, k, v (best of five means of "
        "`repeats` calls): the yardstick of python/examples/overhead.py.");
}

}  // namespace apex::python
