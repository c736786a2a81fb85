// SPDX-License-Identifier: MIT
// The caches, the layers and the stack on numpy arrays: apex.KvCache, apex.LatentCache,
// apex.GroupedQueryAttention, apex.MultiHeadLatentAttention, apex.AttentionStack and
// apex.StackCache (kv_cache.hpp, gqa.hpp, mla.hpp, stack.hpp).
//
// Each Python class holds a std::variant of the C++ types it stands for, one alternative per
// storage format (AnyOf below) or compute type, and every method visits it. Formats compute in
// float, but float64, which computes in double: exactly the pairs whose attention kernels apex
// precompiles (detail/kernel_instances.hpp), so that this file compiles no kernel of its own.
// Weights are stored in the compute type (no 16-bit weights: each would double the layers'
// instantiations). Results are new numpy arrays; the GIL is released while apex computes.
#include "formats.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <type_traits>
#include <variant>

namespace apex::python {

namespace {

// ---------------------------------------------------------------------------------------------
// Arrays in and out
// ---------------------------------------------------------------------------------------------

/// The rows of a layer's input x: [B*S, d] (batch given, 1 by default) or [B, S, d], read in
/// place where the two leading axes merge into one of rows with whole-element strides.
template <class T>
struct TokenRows {
  py::array array;  ///< what `rows` points into
  Index batch = 1;
  Eigen::Map<const RowMatrix<T>, 0, Eigen::OuterStride<>> rows{nullptr, 0, 0,
                                                               Eigen::OuterStride<>(1)};
};

template <class T>
TokenRows<T> token_rows(const py::array& x, std::optional<Index> batch, const char* op,
                        const char* name) {
  check_dtype<T>(x, op, name, "the layer's (or cache's) dtype");
  check_rank(x, 2, 3, op, name, "2 ([B*S, d], with batch=B) or 3 ([B, S, d])");
  TokenRows<T> in;
  in.array = readable(x);
  const py::array& r = in.array;
  const bool three = r.ndim() == 3;
  if (three) {
    APEX_CHECK(!batch || *batch == r.shape(0), "[" << op << "] " << name << "'s first extent ("
                                                   << r.shape(0) << ") must equal the batch ("
                                                   << batch.value_or(0) << ")");
    // [B, S, d] is [B*S, d] in place when batch b's rows follow batch b − 1's.
    if (r.shape(0) > 1 && r.shape(1) > 1 && r.strides(0) != r.shape(1) * r.strides(1)) {
      in.array = contiguous_as<T>(r);
    }
  }
  const py::array& a = in.array;
  const Index rows =
      three ? static_cast<Index>(a.shape(0) * a.shape(1)) : static_cast<Index>(a.shape(0));
  const py::ssize_t row_axis = three && a.shape(1) > 1 ? 1 : 0;
  const Index stride = a.shape(a.ndim() - 1) == 0 ? 1 : element_stride(a, row_axis);
  in.batch = three ? static_cast<Index>(a.shape(0)) : batch.value_or(1);
  new (&in.rows) decltype(in.rows)(static_cast<const T*>(a.data()), rows,
                                   static_cast<Index>(a.shape(a.ndim() - 1)),
                                   Eigen::OuterStride<>(std::max<Index>(stride, 1)));
  return in;
}

/// `a` as a new row-major matrix of T (converted from any numeric dtype); rank 2 required.
template <class T>
RowMatrix<T> matrix_of(const py::handle& a, const char* op, const char* name) {
  const py::array c = contiguous_as<T>(a);
  check_rank(c, 2, 2, op, name, "2");
  return rows_of<T>(c, static_cast<Index>(c.shape(1)));
}

/// `a` as a new vector of T; rank 1 required.
template <class T>
Vector<T> vector_of(const py::handle& a, const char* op, const char* name) {
  const py::array c = contiguous_as<T>(a);
  check_rank(c, 1, 1, op, name, "1");
  return Eigen::Map<const Vector<T>>(static_cast<const T*>(c.data()), c.size());
}

/// A matrix as a new numpy array.
template <class T>
py::array array_of(const RowMatrix<T>& m) {
  py::array out = new_array<T>({m.rows(), m.cols()});
  Eigen::Map<RowMatrix<T>>(mutable_data<T>(out), m.rows(), m.cols()) = m;
  return out;
}

/// A vector as a new numpy array.
template <class T>
py::array array_of(const Vector<T>& v) {
  py::array out = new_array<T>({v.size()});
  Eigen::Map<Vector<T>>(mutable_data<T>(out), v.size()) = v;
  return out;
}

/// k and v of an append, of the cache's compute type.
template <class T>
std::pair<HeadsInput<T>, HeadsInput<T>> kv_inputs(const py::array& k, const py::array& v,
                                                  const char* op) {
  check_dtype<T>(k, op, "k", "the cache's dtype");
  check_dtype<T>(v, op, "v", "the cache's dtype");
  return {heads_input<T>(k, op, "k"), heads_input<T>(v, op, "v")};
}

// ---------------------------------------------------------------------------------------------
// KvCache
// ---------------------------------------------------------------------------------------------

using KvCacheBox = AnyOf<KvCache>;
struct PyKvCache {
  KvCacheBox any;
};

PyKvCache make_kv_cache(const KvCacheShape& shape, const std::string& format) {
  return {make_alternative<KvCacheBox>(format_index(format, "kv_cache"), [&](auto tag) {
    return typename decltype(tag)::type(shape);
  })};
}

template <class Cache>
void kv_append(Cache& cache, const py::array& k, const py::array& v,
               std::optional<Index> position) {
  using S = compute_t<Cache>;
  const auto [ki, vi] = kv_inputs<S>(k, v, "kv_cache");
  const py::gil_scoped_release release;
  cache.append(ki.view, vi.view, position.value_or(cache.next_position()));
}

template <class Cache>
py::object kv_attend(const Cache& cache, const py::array& q, const CallArgs& a, bool with_lse) {
  using S = compute_t<Cache>;
  const char* op = "kv_cache.attend";
  check_dtype<S>(q, op, "q", "the cache's dtype");
  const HeadsInput<S> qi = heads_input<S>(q, op, "q");
  AttentionMask<S> mask;
  mask.positions = a.rule();  // queries: the last S_q of the size() cached positions
  Outputs<S> r = heads_outputs<S>(q, qi.view.shape(), cache.head_dim(), with_lse);
  {
    const py::gil_scoped_release release;
    sdpa(qi.view, cache.keys(), cache.values(), mask, a.params(), r.out_view, r.lse_view);
  }
  return r.returned(with_lse);  // with the GIL: it makes Python objects
}

/// truncate (where the C++ class has it), reserve and clear of the Python cache class `name`
/// (a Box holding the C++ cache `cpp` of any format in `any`), defined once for every class.
template <class Box, bool kTruncate>
void def_upkeep(py::module_& m, const char* name, const std::string& cpp) {
  auto cls = py::reinterpret_borrow<py::class_<Box>>(m.attr(name));
  if constexpr (kTruncate) {
    cls.def(
        "truncate",
        [](Box& c, Index size) { std::visit([&](auto& x) { x.truncate(size); }, c.any); },
        py::arg("size"),
        ("Drops the tokens at positions >= size, 0 <= size <= the tokens held (" + cpp +
         "::truncate).")
            .c_str());
  }
  cls.def(
         "reserve",
         [](Box& c, Index capacity) { std::visit([&](auto& x) { x.reserve(capacity); }, c.any); },
         py::arg("capacity"),
         ("Grows the capacity to at least `capacity`, keeping the tokens (" + cpp +
          "::reserve: one copy; never shrinks).")
             .c_str())
      .def(
          "clear", [](Box& c) { std::visit([](auto& x) { x.clear(); }, c.any); },
          ("Forgets every token; the memory is kept (" + cpp + "::clear).").c_str());
}

void def_kv_cache(py::module_& m) {
  py::class_<PyKvCache>(m, "KvCache",
                        (std::string("K/V cache of one attention layer (apex::KvCache<Scalar, "
                                     "Storage>, kv_cache.hpp): K and V of B sequences, H_kv "
                                     "heads of d_h, up to `capacity` tokens, [B, H_kv, C, d_h] "
                                     "each, allocated (zeroed) at construction; never grows by "
                                     "itself (reserve grows it).\n\nformat: ") +
                         kFormatDoc)
                            .c_str())
      .def(py::init([](Index batch, Index num_kv_heads, Index head_dim, Index capacity,
                       const std::string& format) {
             return make_kv_cache({batch, num_kv_heads, head_dim, capacity}, format);
           }),
           py::arg("batch"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("capacity"),
           py::kw_only(), py::arg("format") = "float32",
           "Allocates K and V (KvCache(KvCacheShape{batch, num_kv_heads, head_dim, capacity})): "
           "2·B·H_kv·C·d_h values of the format. Raises ValueError unless every extent is >= 1 "
           "and head_dim is whole blocks of the format.")
      .def_property_readonly(
          "format", [](const PyKvCache& c) { return kFormats[c.any.index()]; },
          "The storage format's name.")
      .def_property_readonly(
          "dtype",
          [](const PyKvCache& c) {
            return std::visit([](const auto& x) { return numpy_name<compute_t<decltype(x)>>(); },
                              c.any);
          },
          "numpy dtype of what the cache takes and returns: 'float64' for format float64, else "
          "'float32'.")
      .def_property_readonly("batch", visiting<PyKvCache>([](const auto& x) { return x.batch(); }),
                             "B.")
      .def_property_readonly("num_kv_heads",
                             visiting<PyKvCache>([](const auto& x) { return x.num_kv_heads(); }),
                             "H_kv.")
      .def_property_readonly("head_dim",
                             visiting<PyKvCache>([](const auto& x) { return x.head_dim(); }),
                             "d_h (values).")
      .def_property_readonly("capacity",
                             visiting<PyKvCache>([](const auto& x) { return x.capacity(); }),
                             "C, the tokens that fit (KvCache::capacity).")
      .def_property_readonly("size", visiting<PyKvCache>([](const auto& x) { return x.size(); }),
                             "Tokens held, positions [0, size) (KvCache::size).")
      .def("__len__", visiting<PyKvCache>([](const auto& x) { return x.size(); }), "size.")
      .def_property_readonly("next_position",
                             visiting<PyKvCache>([](const auto& x) { return x.next_position(); }),
                             "Position of the next token (= size).")
      .def_property_readonly(
          "bytes", visiting<PyKvCache>([](const auto& x) { return x.bytes(); }),
          "Exact bytes of K and V (KvCache::bytes): 2·B·H_kv·C rows of d_h values in the format "
          "(4·d_h bytes a row in float32, 2·d_h in float16, 34·d_h/32 in q8_0, 18·d_h/32 in "
          "q4_0, 132·d_h/128 in fp8), whatever size is.")
      .def(
          "append",
          [](PyKvCache& c, const py::array& k, const py::array& v, std::optional<Index> position) {
            std::visit([&](auto& x) { kv_append(x, k, v, position); }, c.any);
          },
          py::arg("k"), py::arg("v"), py::kw_only(), py::arg("position") = py::none(),
          "Appends n tokens at positions [position, position + n) (KvCache::append).\n\n"
          "k, v: [B, H_kv, n, d_h] (or [H_kv, n, d_h], [n, d_h] when B = 1, H_kv = 1), of the "
          "cache's dtype, any strides (read in place when the last axis is contiguous). position "
          "(default: next_position) must equal next_position. Each value is stored through the "
          "format once (rounded or quantized). Raises ValueError (cache unchanged) on a bad "
          "shape, dtype or position, or past the capacity. Allocates nothing (a copy of k or v "
          "only when its layout needs one).")
      .def(
          "attend",
          [](const PyKvCache& c, const py::array& q, bool causal, std::optional<Index> window,
             Index prefix, std::optional<double> scale, double softcap, bool return_lse) {
            return std::visit(
                [&](const auto& x) {
                  return kv_attend(x, q, {causal, window, prefix, scale, softcap}, return_lse);
                },
                c.any);
          },
          py::arg("q"), py::kw_only(), APEX_CALL_ARGS, py::arg("return_lse") = false,
          "Attention of queries over the cached tokens: apex::sdpa(q, cache.keys(), "
          "cache.values(), mask, params), reading the cache in place (a 16-bit or block format "
          "is decoded as the kernel reads it).\n\n"
          "q: [B, H_q, S_q, d_h] (or [H_q, S_q, d_h], [S_q, d_h] when B = 1), the cache's dtype, "
          "H_q a multiple of H_kv. The S_q queries are the last S_q of the size cached positions "
          "(bottom-right alignment): out_i = softmax(scale·q_i·Kᵀ + rule) V over keys [0, size). "
          "causal, window, prefix: the position rule (apex.sdpa's); scale (default 1/√d_h), "
          "softcap. Returns out, a new array of q's shape (and lse, q's shape without its last "
          "axis, with return_lse=True). Does not change the cache. Raises ValueError on a bad "
          "shape or rule.")
      .def(
          "keys",
          [](const PyKvCache& c) {
            return std::visit(
                [](const auto& x) { return decoded<compute_t<decltype(x)>>(x.keys()); }, c.any);
          },
          "The cached keys decoded as attention reads them: a new [B, H_kv, size, d_h] array of "
          "the cache's dtype (KvCache::keys, widened through the format).")
      .def(
          "values",
          [](const PyKvCache& c) {
            return std::visit(
                [](const auto& x) { return decoded<compute_t<decltype(x)>>(x.values()); }, c.any);
          },
          "The cached values decoded, as keys(): a new [B, H_kv, size, d_h] array.");
  def_upkeep<PyKvCache, true>(m, "KvCache", "KvCache");
}

// ---------------------------------------------------------------------------------------------
// What the layers share: the compute type, RoPE, call parameters, caches of the right type
// ---------------------------------------------------------------------------------------------

/// Calls f(Tag<S>{}) with S the compute type named by a layer's dtype argument.
template <class F>
decltype(auto) with_compute(const std::string& dtype, const char* op, const F& f) {
  APEX_CHECK(dtype == "float32" || dtype == "float64",
             "[" << op << "] dtype ('" << dtype << "') must be 'float32' or 'float64'");
  if (dtype == "float64") return f(Tag<double>{});
  return f(Tag<float>{});
}

/// The RoPE table arguments of a layer: none when max_positions is 0.
struct RopeArgs {
  Index max_positions = 0;
  double theta = 10000.0;
  Index rotary_dim = 0;
  std::string pairing = "interleaved";
};

RopePairing pairing_of(const std::string& name, const char* op) {
  APEX_CHECK(name == "interleaved" || name == "half_split",
             "[" << op << "] rope_pairing ('" << name
                 << "') must be 'interleaved' (features 2i, 2i+1, §4.4) or 'half_split' (i, "
                    "i + d/2, HuggingFace's rotate_half)");
  return name == "interleaved" ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
}

/// The table of `a` for heads `head_dim` wide, or null for max_positions = 0. Shared: a layer
/// object and its copies (stack.layer) hold one table.
template <class S>
std::shared_ptr<const RopeTable<S>> rope_table(const RopeArgs& a, Index head_dim, const char* op) {
  if (a.max_positions == 0) return nullptr;
  return std::make_shared<const RopeTable<S>>(
      a.max_positions, head_dim, RopeParams{a.theta, a.rotary_dim, pairing_of(a.pairing, op)});
}

/// A layer's call parameters: RoPE, the first row's position and the score parameters.
template <class S>
AttentionLayerParams<S> layer_params(const std::shared_ptr<const RopeTable<S>>& rope,
                                     Index position_offset, const CallArgs& a) {
  AttentionLayerParams<S> p;
  p.attention = a.params();
  p.rope = rope.get();
  p.position_offset = position_offset;
  return p;
}

/// Calls f(layer, cache) for a layer and a cache that compute in one type, else throws: only
/// the matching pairs are instantiated.
template <class Layers, class Caches, class F>
py::object visit_matching(const Layers& layers, Caches& caches, const char* op, const F& f) {
  return std::visit(
      [&](const auto& layer, auto& cache) -> py::object {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        using C = compute_t<decltype(cache)>;
        check_same_compute<S, C>(op, kFormats[caches.index()]);
        if constexpr (std::is_same_v<S, C>) {
          return f(layer, cache);
        } else {
          return py::none();
        }
      },
      layers, caches);
}

/// Throws unless a layer computing in S may make a cache of `format` (float64 layers take
/// float64 caches, float32 layers every other format).
template <class S>
void check_format_for(const std::string& format, const char* op) {
  const bool wide = format == "float64";
  APEX_CHECK((wide == std::is_same_v<S, double>),
             "[" << op << "] format '" << format << "' does not suit a " << numpy_name<S>()
                 << " layer: float64 layers take format 'float64', float32 layers any other");
}

/// A layer's forward on the rows of x: out = run(rows, batch, out map), a new array of x's
/// shape with d_model last.
template <class S, class Run>
py::array run_rows(const py::array& x, std::optional<Index> batch, Index d_model, const char* op,
                   const Run& run) {
  const TokenRows<S> in = token_rows<S>(x, batch, op, "x");
  auto [out, rows] = rows_output<S>(x, in.rows.rows(), d_model);
  {
    const py::gil_scoped_release release;
    run(in, RowRef<S>(rows));
  }
  return out;
}

/// A dict of a config's fields, from (name, value) pairs.
template <class... Pairs>
py::dict dict_of(const Pairs&... pairs) {
  py::dict d;
  ((d[pairs.first] = pairs.second), ...);
  return d;
}

// ---------------------------------------------------------------------------------------------
// GroupedQueryAttention
// ---------------------------------------------------------------------------------------------

template <class S>
struct GqaOf {
  using Scalar = S;
  GroupedQueryAttention<S> layer;
  std::shared_ptr<const RopeTable<S>> rope;  ///< null: no RoPE
};
struct PyGqa {
  std::variant<GqaOf<float>, GqaOf<double>> any;
};

/// The weight arrays of a GQA layer, as given.
struct GqaArrays {
  py::object w_q, w_k, w_v, w_o;
  std::optional<std::vector<double>> sinks;
  std::optional<py::object> q_norm, k_norm;
  double qk_norm_eps = 1e-6;
};

template <class S>
GqaWeights<S> gqa_weights(const GqaArrays& a) {
  const char* op = "gqa";
  GqaWeights<S> w{matrix_of<S>(a.w_q, op, "w_q"),
                  matrix_of<S>(a.w_k, op, "w_k"),
                  matrix_of<S>(a.w_v, op, "w_v"),
                  matrix_of<S>(a.w_o, op, "w_o"),
                  {},
                  {}};
  if (a.sinks) w.sinks = *a.sinks;
  APEX_CHECK(a.q_norm.has_value() == a.k_norm.has_value(),
             "[gqa] q_norm and k_norm must be given together (QK-norm) or not at all");
  if (a.q_norm) {
    w.qk_norm = QkNorm<S>{vector_of<S>(*a.q_norm, op, "q_norm"),
                          vector_of<S>(*a.k_norm, op, "k_norm"), a.qk_norm_eps};
  }
  return w;
}

template <class S>
py::dict gqa_weight_arrays(const GqaWeights<S>& w) {
  py::dict d = dict_of(std::pair{"w_q", array_of(w.w_q)}, std::pair{"w_k", array_of(w.w_k)},
                       std::pair{"w_v", array_of(w.w_v)}, std::pair{"w_o", array_of(w.w_o)});
  d["sinks"] = w.sinks;
  d["q_norm"] = w.qk_norm ? py::object(array_of(w.qk_norm->q_gamma)) : py::none();
  d["k_norm"] = w.qk_norm ? py::object(array_of(w.qk_norm->k_gamma)) : py::none();
  d["qk_norm_eps"] = w.qk_norm ? w.qk_norm->eps : 0.0;
  return d;
}

py::dict gqa_config_dict(const GqaConfig& c) {
  return dict_of(std::pair{"d_model", c.d_model}, std::pair{"num_q_heads", c.num_q_heads},
                 std::pair{"num_kv_heads", c.num_kv_heads}, std::pair{"head_dim", c.head_dim});
}

/// The forward pass of a layer (GqaOf or MlaOf) over whole sequences, each attending within
/// itself: the `forward` of both Python layer classes.
template <class Layer>
py::array layer_forward(const Layer& g, const py::array& x, std::optional<Index> batch,
                        const CallArgs& a, Index position_offset, const char* op) {
  using S = typename Layer::Scalar;
  AttentionMask<S> mask;
  mask.positions = a.rule();
  const AttentionLayerParams<S> params = layer_params(g.rope, position_offset, a);
  return run_rows<S>(x, batch, g.layer.config().d_model, op,
                     [&](const TokenRows<S>& in, RowRef<S> out) {
                       g.layer.forward(in.rows, in.batch, mask, params, out);
                     });
}

/// What the docstrings of the two layer classes say differently.
struct LayerDocs {
  const char* config;
  const char* dtype;
  const char* weights;
  const char* parameter_count;
  std::string forward;
};

/// The properties and the forward pass that GroupedQueryAttention and MultiHeadLatentAttention
/// share: config(layer config) and weights(layer weights) make their dicts.
template <class Box, class Config, class Weights>
void def_layer_common(py::class_<Box>& c, const char* op, Config config, Weights weights,
                      const LayerDocs& docs) {
  c.def_property_readonly(
       "config", visiting<Box>([config](const auto& g) { return config(g.layer.config()); }),
       docs.config)
      .def_property_readonly("dtype", visiting<Box>([](const auto& g) {
                               return numpy_name<typename std::decay_t<decltype(g)>::Scalar>();
                             }),
                             docs.dtype)
      .def_property_readonly(
          "weights", visiting<Box>([weights](const auto& g) { return weights(g.layer.weights()); }),
          docs.weights)
      .def_property_readonly("parameter_count",
                             visiting<Box>([](const auto& g) { return g.layer.parameter_count(); }),
                             docs.parameter_count)
      .def(
          "forward",
          [op](const Box& g, const py::array& x, std::optional<Index> batch, bool causal,
               std::optional<Index> window, Index prefix, std::optional<double> scale,
               double softcap, Index position_offset) {
            const CallArgs a{causal, window, prefix, scale, softcap};
            return std::visit(
                [&](const auto& layer) {
                  return layer_forward(layer, x, batch, a, position_offset, op);
                },
                g.any);
          },
          py::arg("x"), py::kw_only(), py::arg("batch") = py::none(), APEX_CALL_ARGS,
          py::arg("position_offset") = 0, docs.forward.c_str());
}

template <class S, class Cache>
py::array gqa_cached(const GqaOf<S>& g, Cache& cache, const py::array& x, const CallArgs& a) {
  const AttentionLayerParams<S> params = layer_params(g.rope, cache.next_position(), a);
  const PositionMask rule = a.rule();
  return run_rows<S>(x, cache.batch(), g.layer.config().d_model, "gqa",
                     [&](const TokenRows<S>& in, RowRef<S> out) {
                       g.layer.forward_cached(in.rows, rule, params, cache, out);
                     });
}

const char* const kCallDoc =
    "causal, window, prefix: the position rule (apex.sdpa's: causal attention, a sliding "
    "window of W positions, a bidirectional prefix [0, P)); scale (default 1/√d_qk) and "
    "softcap (c·tanh(s/c), 0: none).";

void def_gqa(py::module_& m) {
  py::class_<PyGqa> cls(
      m, "GroupedQueryAttention",
      "Grouped-query attention layer (apex::GroupedQueryAttention<Scalar>, gqa.hpp, "
      "§7-§8) that owns W_Q, W_K, W_V, W_O: x [B*S, d] → Q = RoPE(norm(x·W_Q)), "
      "K = RoPE(norm(x·W_K)), V = x·W_V; head_i = softmax(scale·Q_i K_gᵀ + mask) V_g "
      "with g = ⌊i / (H_q/H_kv)⌋; out = Concat(head_0 … head_{H_q−1})·W_O. H_kv = H_q "
      "is multi-head, H_kv = 1 multi-query attention. norm is the optional QK-norm "
      "(an RMSNorm of each head over its d_h features, one γ for queries and one for "
      "keys); RoPE applies when max_positions > 0 (a table [max_positions, d_h] built "
      "with the layer, base rope_theta, the first rotary_dim features of each head, "
      "0: all).");
  cls.def(py::init([](Index d_model, Index num_q_heads, Index num_kv_heads, Index head_dim,
                      py::object w_q, py::object w_k, py::object w_v, py::object w_o,
                      std::optional<std::vector<double>> sinks, std::optional<py::object> q_norm,
                      std::optional<py::object> k_norm, double qk_norm_eps, Index max_positions,
                      double rope_theta, Index rotary_dim, const std::string& rope_pairing,
                      const std::string& dtype) {
            const GqaConfig config{d_model, num_q_heads, num_kv_heads, head_dim};
            const GqaArrays arrays{std::move(w_q),    std::move(w_k),   std::move(w_v),
                                   std::move(w_o),    std::move(sinks), std::move(q_norm),
                                   std::move(k_norm), qk_norm_eps};
            const RopeArgs rope{max_positions, rope_theta, rotary_dim, rope_pairing};
            return with_compute(dtype, "gqa", [&](auto tag) {
              using S = typename decltype(tag)::type;
              GroupedQueryAttention<S> layer(config, gqa_weights<S>(arrays));
              return PyGqa{GqaOf<S>{std::move(layer), rope_table<S>(rope, head_dim, "gqa")}};
            });
          }),
          py::arg("d_model"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
          py::kw_only(), py::arg("w_q"), py::arg("w_k"), py::arg("w_v"), py::arg("w_o"),
          py::arg("sinks") = py::none(), py::arg("q_norm") = py::none(),
          py::arg("k_norm") = py::none(), py::arg("qk_norm_eps") = 1e-6,
          py::arg("max_positions") = 0, py::arg("rope_theta") = 10000.0, py::arg("rotary_dim") = 0,
          py::arg("rope_pairing") = "interleaved", py::arg("dtype") = "float32",
          "A layer of config GqaConfig{d_model, num_q_heads, num_kv_heads, head_dim} and the "
          "given weights (GroupedQueryAttention(config, GqaWeights), copied, converted to "
          "dtype), applied as x·W (x on the left), row-major:\n"
          "  w_q [d, H_q·d_h], w_k and w_v [d, H_kv·d_h] (head h in columns [h·d_h, (h+1)·d_h)), "
          "w_o [H_q·d_h, d];\n"
          "  sinks: H_q logits (gpt-oss attention sinks) or None; q_norm, k_norm: [d_h] γ of the "
          "QK-norm (both or neither), with qk_norm_eps.\n"
          "RoPE: max_positions (0: none), rope_theta, rotary_dim, rope_pairing ('interleaved' "
          "or 'half_split'). dtype: 'float32' or 'float64'. Raises ValueError with apex's "
          "message on a bad config or weight shape.")
      .def_static(
          "random",
          [](Index d_model, Index num_q_heads, Index num_kv_heads, Index head_dim,
             std::uint64_t seed, Index max_positions, double rope_theta, Index rotary_dim,
             const std::string& rope_pairing, const std::string& dtype) {
            const GqaConfig config{d_model, num_q_heads, num_kv_heads, head_dim};
            const RopeArgs rope{max_positions, rope_theta, rotary_dim, rope_pairing};
            return with_compute(dtype, "gqa", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return PyGqa{GqaOf<S>{GroupedQueryAttention<S>::random(config, seed),
                                    rope_table<S>(rope, head_dim, "gqa")}};
            });
          },
          py::arg("d_model"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
          py::kw_only(), py::arg("seed"), py::arg("max_positions") = 0,
          py::arg("rope_theta") = 10000.0, py::arg("rotary_dim") = 0,
          py::arg("rope_pairing") = "interleaved", py::arg("dtype") = "float32",
          "A layer with random weights (GroupedQueryAttention::random(config, seed)): each entry "
          "of a [rows, cols] weight N(0, 1/rows), drawn in the order W_Q, W_K, W_V, W_O from "
          "std::mt19937_64(seed); no sinks, no QK-norm. RoPE and dtype as the constructor.");
  def_layer_common(
      cls, "gqa", [](const GqaConfig& config) { return gqa_config_dict(config); },
      [](const auto& w) { return gqa_weight_arrays(w); },
      {"The config as a dict: d_model, num_q_heads, num_kv_heads, head_dim.",
       "'float32' or 'float64': what x, the weights and the results are.",
       "The weights as a dict of new arrays (shapes as the constructor takes them): w_q, w_k, "
       "w_v, w_o, sinks (a list), q_norm and k_norm (None without a QK-norm), qk_norm_eps.",
       "d·d_h·(2·H_q + 2·H_kv) (GroupedQueryAttention::parameter_count).",
       (std::string("The forward pass over whole sequences (GroupedQueryAttention::forward), "
                    "each attending within itself.\n\nx: [B, S, d], or [B*S, d] with batch=B "
                    "(default 1), of the layer's dtype (read in place when the rows are "
                    "evenly strided with a contiguous last axis). Row s of each sequence is at "
                    "position position_offset + s for RoPE. ") +
        kCallDoc +
        " Returns a new array of x's shape. Allocates Q, K, V and the [B*S, H_q·d_h] "
        "concatenation besides the result.")});
  cls.def_property_readonly("weight_bytes",
                            visiting<PyGqa>([](const auto& g) { return g.layer.weight_bytes(); }),
                            "Bytes of the four matrices (parameter_count·itemsize).")
      .def(
          "make_cache",
          [](const PyGqa& g, Index batch, Index capacity, const std::string& format) {
            return std::visit(
                [&](const auto& layer) {
                  using S = typename std::decay_t<decltype(layer)>::Scalar;
                  check_format_for<S>(format, "gqa");
                  const GqaConfig& c = layer.layer.config();
                  return make_kv_cache({batch, c.num_kv_heads, c.head_dim, capacity}, format);
                },
                g.any);
          },
          py::arg("batch"), py::arg("capacity"), py::kw_only(), py::arg("format") = "float32",
          "An empty apex.KvCache for this layer (GroupedQueryAttention::make_cache<Storage>): B "
          "sequences of up to `capacity` tokens, H_kv heads of d_h, in `format` (float32 layers: "
          "any format but float64; float64 layers: float64). Allocates it.")
      .def(
          "forward_cached",
          [](const PyGqa& g, const py::array& x, PyKvCache& cache, bool causal,
             std::optional<Index> window, Index prefix, std::optional<double> scale,
             double softcap) {
            const CallArgs a{causal, window, prefix, scale, softcap};
            return visit_matching(g.any, cache.any, "gqa", [&](const auto& layer, auto& kv) {
              return gqa_cached(layer, kv, x, a);
            });
          },
          py::arg("x"), py::arg("cache"), py::kw_only(), APEX_CALL_ARGS,
          (std::string("Decoding with a cache (GroupedQueryAttention::forward_cached): n new "
                       "tokens of each of the cache's B sequences, at positions [p, p + n), "
                       "p = cache.next_position. Projects them (RoPE at their positions), "
                       "appends their K and V to the cache, and attends over keys [0, p + n); "
                       "fed a sequence in any chunks it computes what forward computes on the "
                       "whole sequence (to the cache format's rounding).\n\nx: [B, n, d], or "
                       "[B*n, d] (B = cache.batch), the layer's dtype; cache: an apex.KvCache "
                       "with the layer's H_kv and d_h and room for n tokens. ") +
           kCallDoc +
           " The rule's positions are the cache's (a prefix must lie in the first chunk). "
           "Returns a new array of x's shape. Raises ValueError, with the cache and everything "
           "else unchanged, on a bad shape, rule or full cache. Allocates the projections and "
           "the concatenation.")
              .c_str());
}

// ---------------------------------------------------------------------------------------------
// LatentCache and MultiHeadLatentAttention
// ---------------------------------------------------------------------------------------------

struct PyLatentCache {
  AnyOf<LatentCache> any;
};

PyLatentCache make_latent_cache(const LatentCacheShape& shape, const std::string& format) {
  return {make_alternative<AnyOf<LatentCache>>(format_index(format, "latent_cache"), [&](auto tag) {
    return typename decltype(tag)::type(shape);
  })};
}

template <class Cache>
void latent_append(Cache& cache, const py::array& c_kv, const py::array& k_rope) {
  using S = compute_t<Cache>;
  const char* op = "latent_cache";
  const TokenRows<S> c = token_rows<S>(c_kv, cache.batch(), op, "c_kv");
  const TokenRows<S> r = token_rows<S>(k_rope, cache.batch(), op, "k_rope");
  const py::gil_scoped_release release;
  cache.append(c.rows, r.rows, cache.next_position());
}

/// The rows [c_kv ‖ K_rope] decoded: a new [B, size, d_kv + H_kr·d_r] array.
template <class Cache>
py::array latent_rows(const Cache& cache) {
  const py::array rows = decoded<compute_t<Cache>>(cache.rows());  // [B, 1, size, width]
  return rows.attr("reshape")(cache.batch(), cache.size(), cache.row_width());
}

void def_latent_cache(py::module_& m) {
  py::class_<PyLatentCache>(
      m, "LatentCache",
      (std::string("The cache of a multi-head latent attention layer (apex::LatentCache, "
                   "kv_cache.hpp, §9.4): per token the row [c_kv ‖ K_rope], d_kv + H_kr·d_r "
                   "values, [B, C, d_kv + H_kr·d_r] in all, allocated at construction. A block "
                   "format stores c_kv and K_rope each as whole blocks (d_kv and d_r multiples of "
                   "the block).\n\nformat: ") +
       kFormatDoc)
          .c_str())
      .def(py::init([](Index batch, Index latent_dim, Index rope_heads, Index rope_dim,
                       Index capacity, const std::string& format) {
             return make_latent_cache({batch, latent_dim, rope_heads, rope_dim, capacity}, format);
           }),
           py::arg("batch"), py::arg("latent_dim"), py::arg("rope_heads"), py::arg("rope_dim"),
           py::arg("capacity"), py::kw_only(), py::arg("format") = "float32",
           "Allocates the rows (LatentCache(LatentCacheShape{batch, latent_dim, rope_heads, "
           "rope_dim, capacity})). Raises ValueError unless every extent is >= 1, rope_dim is "
           "even and the parts are whole blocks of the format.")
      .def_property_readonly(
          "format", [](const PyLatentCache& c) { return kFormats[c.any.index()]; },
          "The storage format's name.")
      .def_property_readonly("dtype", visiting<PyLatentCache>([](const auto& x) {
                               return numpy_name<compute_t<decltype(x)>>();
                             }),
                             "'float64' for format float64, else 'float32'.")
      .def_property_readonly("batch",
                             visiting<PyLatentCache>([](const auto& x) { return x.batch(); }), "B.")
      .def_property_readonly("latent_dim",
                             visiting<PyLatentCache>([](const auto& x) { return x.latent_dim(); }),
                             "d_kv.")
      .def_property_readonly("rope_heads",
                             visiting<PyLatentCache>([](const auto& x) { return x.rope_heads(); }),
                             "H_kr.")
      .def_property_readonly(
          "rope_dim", visiting<PyLatentCache>([](const auto& x) { return x.rope_dim(); }), "d_r.")
      .def_property_readonly("row_width",
                             visiting<PyLatentCache>([](const auto& x) { return x.row_width(); }),
                             "d_kv + H_kr·d_r, the values cached per token.")
      .def_property_readonly(
          "capacity", visiting<PyLatentCache>([](const auto& x) { return x.capacity(); }), "C.")
      .def_property_readonly(
          "size", visiting<PyLatentCache>([](const auto& x) { return x.size(); }), "Tokens held.")
      .def("__len__", visiting<PyLatentCache>([](const auto& x) { return x.size(); }), "size.")
      .def_property_readonly(
          "next_position", visiting<PyLatentCache>([](const auto& x) { return x.next_position(); }),
          "Position of the next token (= size).")
      .def_property_readonly(
          "bytes", visiting<PyLatentCache>([](const auto& x) { return x.bytes(); }),
          "Exact bytes (LatentCache::bytes): B·C rows of d_kv + H_kr·d_r values in the format.")
      .def(
          "append",
          [](PyLatentCache& c, const py::array& c_kv, const py::array& k_rope) {
            std::visit([&](auto& x) { latent_append(x, c_kv, k_rope); }, c.any);
          },
          py::arg("c_kv"), py::arg("k_rope"),
          "Appends n tokens at next_position (LatentCache::append): c_kv [B, n, d_kv] or "
          "[B*n, d_kv], k_rope [B, n, H_kr·d_r] or [B*n, H_kr·d_r] (already rotated), the "
          "cache's dtype. Raises ValueError (cache unchanged) on a bad shape or past the "
          "capacity. Allocates nothing (but a copy of an input whose layout needs one).")
      .def("rows", visiting<PyLatentCache>([](const auto& x) { return latent_rows(x); }),
           "The cached rows [c_kv ‖ K_rope] decoded as attention reads them: a new "
           "[B, size, d_kv + H_kr·d_r] array of the cache's dtype (LatentCache::rows, widened).");
  def_upkeep<PyLatentCache, true>(m, "LatentCache", "LatentCache");
}

template <class S>
struct MlaOf {
  using Scalar = S;
  MultiHeadLatentAttention<S> layer;
  MlaAbsorbedWeights<S> absorbed;            ///< absorb_mla_weights(layer), folded once
  std::shared_ptr<const RopeTable<S>> rope;  ///< [max_positions, d_r]
};
struct PyMla {
  std::variant<MlaOf<float>, MlaOf<double>> any;
};

/// The names of the eight weights, in mla_parameter_table's order (detail::mla_matrices).
constexpr const char* kMlaWeights[] = {"w_dkv", "w_uk", "w_uv", "w_dq",
                                       "w_uq",  "w_qr", "w_kr", "w_o"};

template <class S>
MlaOf<S> mla_of(MultiHeadLatentAttention<S> layer, const RopeArgs& rope) {
  MlaAbsorbedWeights<S> absorbed = absorb_mla_weights(layer);
  auto table = rope_table<S>(rope, layer.config().rope_dim, "mla");
  return {std::move(layer), std::move(absorbed), std::move(table)};
}

template <class S>
MlaWeights<S> mla_weights(const py::dict& arrays, std::optional<std::vector<double>> sinks) {
  MlaWeights<S> w;
  const auto matrices = detail::mla_matrices(w);
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    APEX_CHECK(arrays.contains(kMlaWeights[i]), "[mla] weight " << kMlaWeights[i] << " missing");
    *matrices[i] = matrix_of<S>(arrays[kMlaWeights[i]], "mla", kMlaWeights[i]);
  }
  if (sinks) w.sinks = std::move(*sinks);
  return w;
}

template <class S>
py::dict mla_weight_arrays(const MlaWeights<S>& w) {
  py::dict d;
  const auto matrices = detail::mla_matrices(w);
  for (std::size_t i = 0; i < matrices.size(); ++i) d[kMlaWeights[i]] = array_of(*matrices[i]);
  d["sinks"] = w.sinks;
  return d;
}

py::dict mla_config_dict(const MlaConfig& c) {
  return dict_of(std::pair{"d_model", c.d_model}, std::pair{"d_q", c.d_q},
                 std::pair{"d_kv", c.d_kv}, std::pair{"num_q_heads", c.num_q_heads},
                 std::pair{"num_kv_heads", c.num_kv_heads}, std::pair{"head_dim", c.head_dim},
                 std::pair{"rope_dim", c.rope_dim},
                 std::pair{"num_rope_key_heads", c.rope_key_heads()});
}

template <class S, class Cache>
py::array mla_cached(const MlaOf<S>& g, Cache& cache, const py::array& x, const CallArgs& a,
                     bool absorbed) {
  const AttentionLayerParams<S> params = layer_params(g.rope, cache.next_position(), a);
  const PositionMask rule = a.rule();
  return run_rows<S>(x, cache.batch(), g.layer.config().d_model, "mla",
                     [&](const TokenRows<S>& in, RowRef<S> out) {
                       if (absorbed) {
                         g.layer.forward_absorbed(in.rows, rule, params, g.absorbed, cache, out);
                       } else {
                         g.layer.forward_cached(in.rows, rule, params, cache, out);
                       }
                     });
}

void def_mla(py::module_& m) {
  py::class_<PyMla> cls(
      m, "MultiHeadLatentAttention",
      "Multi-head latent attention layer (apex::MultiHeadLatentAttention<Scalar>, mla.hpp, §9) "
      "that owns its eight matrices, applied as x·W:\n"
      "  c_kv = x·W_DKV [d_kv], K = c_kv·W_UK, V = c_kv·W_UV [H_kv·d_h]; c_q = x·W_DQ [d_q], "
      "Q = c_q·W_UQ [H_q·d_h];\n"
      "  Q_rope = RoPE(x·W_QR) [H_q·d_r], K_rope = RoPE(x·W_KR) [H_kr·d_r] (the decoupled RoPE, "
      "a table [max_positions, d_r] built with the layer);\n"
      "  head h: softmax([Q_h ‖ Q_rope,h]·[K_g ‖ K_rope,g']ᵀ / √(d_h + d_r) + mask)·V_g, "
      "g = ⌊h / (H_q/H_kv)⌋, g' = g (H_kr = H_kv) or 0 (H_kr = 1); out = Concat·W_O.\n"
      "A decoder caches [c_kv ‖ K_rope] per token (apex.LatentCache).");
  cls.def(py::init([](Index d_model, Index d_q, Index d_kv, Index num_q_heads, Index num_kv_heads,
                      Index head_dim, Index rope_dim, Index num_rope_key_heads,
                      const py::dict& weights, std::optional<std::vector<double>> sinks,
                      Index max_positions, double rope_theta, const std::string& rope_pairing,
                      const std::string& dtype) {
            const MlaConfig config{d_model,      d_q,      d_kv,     num_q_heads,
                                   num_kv_heads, head_dim, rope_dim, num_rope_key_heads};
            const RopeArgs rope{max_positions, rope_theta, 0, rope_pairing};
            return with_compute(dtype, "mla", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return PyMla{mla_of<S>(
                  MultiHeadLatentAttention<S>(config, mla_weights<S>(weights, sinks)), rope)};
            });
          }),
          py::arg("d_model"), py::arg("d_q"), py::arg("d_kv"), py::arg("num_q_heads"),
          py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rope_dim"), py::kw_only(),
          py::arg("num_rope_key_heads") = 0, py::arg("weights"), py::arg("sinks") = py::none(),
          py::arg("max_positions"), py::arg("rope_theta") = 10000.0,
          py::arg("rope_pairing") = "interleaved", py::arg("dtype") = "float32",
          "A layer of config MlaConfig{d_model, d_q, d_kv, num_q_heads, num_kv_heads, head_dim, "
          "rope_dim, num_rope_key_heads (H_kr: 0 = H_kv, or 1)} and the given weights "
          "(MultiHeadLatentAttention(config, MlaWeights), copied, converted to dtype). weights: "
          "a dict of row-major matrices applied as x·W, head h in columns [h·w, (h+1)·w):\n"
          "  w_dkv [d, d_kv], w_uk [d_kv, H_kv·d_h], w_uv [d_kv, H_kv·d_h], w_dq [d, d_q], "
          "w_uq [d_q, H_q·d_h], w_qr [d, H_q·d_r], w_kr [d, H_kr·d_r], w_o [H_q·d_h, d].\n"
          "sinks: H_q logits or None. RoPE (required, §9.3): max_positions >= 1, rope_theta, "
          "rope_pairing. The absorbed weights (absorb_mla_weights) are folded at construction. "
          "dtype: 'float32' or 'float64'. Raises ValueError with apex's message on a bad config "
          "or weight shape.")
      .def_static(
          "random",
          [](Index d_model, Index d_q, Index d_kv, Index num_q_heads, Index num_kv_heads,
             Index head_dim, Index rope_dim, Index num_rope_key_heads, std::uint64_t seed,
             Index max_positions, double rope_theta, const std::string& rope_pairing,
             const std::string& dtype) {
            const MlaConfig config{d_model,      d_q,      d_kv,     num_q_heads,
                                   num_kv_heads, head_dim, rope_dim, num_rope_key_heads};
            const RopeArgs rope{max_positions, rope_theta, 0, rope_pairing};
            return with_compute(dtype, "mla", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return PyMla{mla_of<S>(MultiHeadLatentAttention<S>::random(config, seed), rope)};
            });
          },
          py::arg("d_model"), py::arg("d_q"), py::arg("d_kv"), py::arg("num_q_heads"),
          py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rope_dim"), py::kw_only(),
          py::arg("num_rope_key_heads") = 0, py::arg("seed"), py::arg("max_positions"),
          py::arg("rope_theta") = 10000.0, py::arg("rope_pairing") = "interleaved",
          py::arg("dtype") = "float32",
          "A layer with random weights (MultiHeadLatentAttention::random(config, seed)): each "
          "entry of a [rows, cols] weight N(0, 1/rows), in the order of the weights listed for "
          "the constructor, from std::mt19937_64(seed). RoPE and dtype as the constructor.");
  def_layer_common(
      cls, "mla", [](const MlaConfig& config) { return mla_config_dict(config); },
      [](const auto& w) { return mla_weight_arrays(w); },
      {"The config as a dict (num_rope_key_heads resolved: H_kv or 1).", "'float32' or 'float64'.",
       "The weights as a dict of new arrays, named and shaped as the constructor takes them, "
       "and sinks (a list).",
       "The §9.5 total (mla_parameter_count).",
       (std::string("The forward pass over whole sequences (MultiHeadLatentAttention::"
                    "forward, decompressing K and V).\n\nx: [B, S, d] or [B*S, d] with "
                    "batch=B, the layer's dtype; row s at position position_offset + s. ") +
        kCallDoc + " (scale default 1/√(d_h + d_r).) Returns a new array of x's shape.")});
  cls.def(
         "make_cache",
         [](const PyMla& g, Index batch, Index capacity, const std::string& format) {
           return std::visit(
               [&](const auto& layer) {
                 using S = typename std::decay_t<decltype(layer)>::Scalar;
                 check_format_for<S>(format, "mla");
                 const MlaConfig& c = layer.layer.config();
                 return make_latent_cache({batch, c.d_kv, c.rope_key_heads(), c.rope_dim, capacity},
                                          format);
               },
               g.any);
         },
         py::arg("batch"), py::arg("capacity"), py::kw_only(), py::arg("format") = "float32",
         "An empty apex.LatentCache for this layer (MultiHeadLatentAttention::make_cache"
         "<Storage>), formats as for GroupedQueryAttention.make_cache. Allocates it.")
      .def(
          "forward_cached",
          [](const PyMla& g, const py::array& x, PyLatentCache& cache, bool absorbed, bool causal,
             std::optional<Index> window, Index prefix, std::optional<double> scale,
             double softcap) {
            const CallArgs a{causal, window, prefix, scale, softcap};
            return visit_matching(g.any, cache.any, "mla", [&](const auto& layer, auto& latent) {
              return mla_cached(layer, latent, x, a, absorbed);
            });
          },
          py::arg("x"), py::arg("cache"), py::kw_only(), py::arg("absorbed") = false,
          APEX_CALL_ARGS,
          (std::string("Decoding with a latent cache: n new tokens of each of the cache's B "
                       "sequences at positions [p, p + n), p = cache.next_position. Appends "
                       "their [c_kv ‖ K_rope] to the cache and attends over keys [0, p + n). "
                       "absorbed=False: MultiHeadLatentAttention::forward_cached (decompresses "
                       "K and V of the whole cache); absorbed=True: forward_absorbed (W_UK and "
                       "W_UV folded, attends to the cached rows directly). Both equal forward on "
                       "the whole sequence to rounding.\n\nx: [B, n, d] or [B*n, d], the "
                       "layer's dtype. ") +
           kCallDoc +
           " Returns a new array of x's shape. Raises ValueError, cache unchanged, on a bad "
           "shape, rule or full cache.")
              .c_str());
}

// ---------------------------------------------------------------------------------------------
// AttentionStack and StackCache
// ---------------------------------------------------------------------------------------------

template <class S, class St>
using StackCacheOf = StackCache<S, St, St>;
/// The local layers' storage format of a StackCache.
template <class Cache>
struct StorageOf;
template <class S, class St, class G>
struct StorageOf<StackCache<S, St, G>> {
  using type = St;
};

struct PyStackCache {
  AnyOf<StackCacheOf> any;
};

template <class S>
struct StackOf {
  using Scalar = S;
  AttentionStack<S> stack;
};
struct PyStack {
  std::variant<StackOf<float>, StackOf<double>> any;
};

/// The keyword arguments of a StackConfig: one field each, the local (GQA) layers' prefixed
/// local_, the global (MLA) layers' global_; d_model is every layer's.
struct IndexField {
  const char* name;
  Index& (*field)(StackConfig&);
};
// clang-format off
const IndexField kIndexFields[] = {
    {"vocab_size", [](StackConfig& c) -> Index& { return c.vocab_size; }},
    {"d_model", [](StackConfig& c) -> Index& { return c.d_model; }},
    {"num_layers", [](StackConfig& c) -> Index& { return c.num_layers; }},
    {"window", [](StackConfig& c) -> Index& { return c.window; }},
    {"global_every", [](StackConfig& c) -> Index& { return c.global_every; }},
    {"max_positions", [](StackConfig& c) -> Index& { return c.max_positions; }},
    {"rotary_dim", [](StackConfig& c) -> Index& { return c.rope.rotary_dim; }},
    {"local_num_q_heads", [](StackConfig& c) -> Index& { return c.local.num_q_heads; }},
    {"local_num_kv_heads", [](StackConfig& c) -> Index& { return c.local.num_kv_heads; }},
    {"local_head_dim", [](StackConfig& c) -> Index& { return c.local.head_dim; }},
    {"global_d_q", [](StackConfig& c) -> Index& { return c.global.d_q; }},
    {"global_d_kv", [](StackConfig& c) -> Index& { return c.global.d_kv; }},
    {"global_num_q_heads", [](StackConfig& c) -> Index& { return c.global.num_q_heads; }},
    {"global_num_kv_heads", [](StackConfig& c) -> Index& { return c.global.num_kv_heads; }},
    {"global_head_dim", [](StackConfig& c) -> Index& { return c.global.head_dim; }},
    {"global_rope_dim", [](StackConfig& c) -> Index& { return c.global.rope_dim; }},
    {"global_num_rope_key_heads",
     [](StackConfig& c) -> Index& { return c.global.num_rope_key_heads; }},
};
// clang-format on

/// A StackConfig from keyword arguments (the fields above, rope_theta, norm_eps, rope_pairing);
/// an unknown name throws. Unset fields keep StackConfig's defaults, which apex then checks.
StackConfig stack_config(const py::kwargs& kwargs) {
  StackConfig c;
  for (const auto& [key, value] : kwargs) {
    const auto name = key.cast<std::string>();
    bool known = true;
    if (name == "rope_theta") {
      c.rope.base = value.cast<double>();
    } else if (name == "norm_eps") {
      c.norm_eps = value.cast<double>();
    } else if (name == "rope_pairing") {
      c.rope.pairing = pairing_of(value.cast<std::string>(), "stack");
    } else {
      known = false;
      for (const IndexField& f : kIndexFields) {
        if (name == f.name) {
          f.field(c) = value.cast<Index>();
          known = true;
        }
      }
    }
    APEX_CHECK(known, "[stack] unknown config field '" << name << "'");
  }
  c.local.d_model = c.global.d_model = c.d_model;
  return c;
}

py::dict stack_config_dict(StackConfig c) {
  py::dict d;
  for (const IndexField& f : kIndexFields) d[f.name] = f.field(c);
  d["global_num_rope_key_heads"] = c.global.rope_key_heads();
  d["rope_theta"] = c.rope.base;
  d["norm_eps"] = c.norm_eps;
  d["rope_pairing"] = c.rope.pairing == RopePairing::kInterleaved ? "interleaved" : "half_split";
  return d;
}

/// Token ids: [B, S] (or [S] for B = 1) of an integer dtype, as int64.
struct Tokens {
  py::array array;
  bool one_sequence = false;  ///< given as [S]
  Eigen::Map<const TokenMatrix> ids{nullptr, 0, 0};
};

Tokens tokens_of(const py::handle& t, const char* op) {
  const auto raw = py::module_::import("numpy").attr("asarray")(t).cast<py::array>();
  const char kind = raw.dtype().kind();
  APEX_CHECK(kind == 'i' || kind == 'u' || raw.size() == 0,
             "[" << op << "] tokens dtype (" << dtype_of(raw) << ") must be an integer dtype");
  check_rank(raw, 1, 2, op, "tokens", "1 ([S]) or 2 ([B, S])");
  Tokens in;
  in.array = contiguous_as<std::int64_t>(raw);
  in.one_sequence = raw.ndim() == 1;
  const auto b_n = in.one_sequence ? Index{1} : static_cast<Index>(in.array.shape(0));
  const auto s_n = static_cast<Index>(in.array.shape(in.array.ndim() - 1));
  new (&in.ids)
      Eigen::Map<const TokenMatrix>(static_cast<const std::int64_t*>(in.array.data()), b_n, s_n);
  return in;
}

/// Logits [B*n, V] (row b*n + s) as a new array [B, n, V] ([n, V] for tokens given as [S]), or
/// [B, V] for the last token's only.
template <class S>
py::array logits_array(const RowMatrix<S>& logits, Index batch, bool one_sequence, bool last_only) {
  const Index v = logits.cols();
  const Index n = last_only ? 1 : logits.rows() / std::max<Index>(batch, 1);
  std::vector<py::ssize_t> shape{batch, n, v};
  if (last_only) shape.erase(shape.begin() + 1);
  if (one_sequence && !last_only) shape.erase(shape.begin());
  py::array out = new_array<S>(shape);
  Eigen::Map<RowMatrix<S>>(mutable_data<S>(out), logits.rows(), v) = logits;
  return out;
}

MlaPath mla_path_of(const std::string& name) {
  APEX_CHECK(name == "auto" || name == "naive" || name == "absorbed",
             "[stack] mla_path ('" << name << "') must be 'auto', 'naive' or 'absorbed'");
  if (name == "naive") return MlaPath::kNaive;
  return name == "absorbed" ? MlaPath::kAbsorbed : MlaPath::kAuto;
}

DecodeOptions decode_options(bool last_only, const std::string& mla_path) {
  DecodeOptions o;
  o.logits = last_only ? LogitRows::kLast : LogitRows::kAll;
  o.mla = mla_path_of(mla_path);
  return o;
}

/// The layers of a stack from Python layer objects of compute type S (copied).
template <class S>
std::vector<typename AttentionStack<S>::Layer> stack_layers(const py::list& layers) {
  std::vector<typename AttentionStack<S>::Layer> out;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const py::handle item = layers[l];
    if (py::isinstance<PyGqa>(item)) {
      const auto* g = std::get_if<GqaOf<S>>(&item.cast<const PyGqa&>().any);
      APEX_CHECK(g != nullptr,
                 "[stack] layers[" << l << "] is not a " << numpy_name<S>() << " layer");
      out.emplace_back(g->layer);
    } else if (py::isinstance<PyMla>(item)) {
      const auto* g = std::get_if<MlaOf<S>>(&item.cast<const PyMla&>().any);
      APEX_CHECK(g != nullptr,
                 "[stack] layers[" << l << "] is not a " << numpy_name<S>() << " layer");
      out.emplace_back(g->layer);
    } else {
      APEX_CHECK(false, "[stack] layers[" << l
                                          << "] must be a GroupedQueryAttention or a "
                                             "MultiHeadLatentAttention");
    }
  }
  return out;
}

template <class S>
AttentionStack<S> stack_from_arrays(const StackConfig& config, const py::handle& embedding,
                                    const py::list& norm_gammas, const py::handle& final_gamma,
                                    const py::list& layers) {
  std::vector<Vector<S>> gammas;
  for (const py::handle g : norm_gammas)
    gammas.push_back(vector_of<S>(g, "stack", "norm_gammas[l]"));
  return AttentionStack<S>(config, matrix_of<S>(embedding, "stack", "embedding"), std::move(gammas),
                           vector_of<S>(final_gamma, "stack", "final_gamma"),
                           stack_layers<S>(layers));
}

/// Layer l of a stack as a Python layer object with the stack's RoPE table of its kind.
template <class S>
py::object stack_layer(const AttentionStack<S>& s, Index l) {
  APEX_CHECK(l >= 0 && l < s.config().num_layers,
             "[stack] layer (" << l << ") must lie in [0, " << s.config().num_layers << ")");
  const StackConfig& c = s.config();
  const auto& layer = s.layer(l);
  const bool global = std::holds_alternative<MultiHeadLatentAttention<S>>(layer);
  auto table = std::make_shared<const RopeTable<S>>(
      layer_rope_table<S>(detail::stack_layer_rope(c, global), c.max_positions,
                          global ? c.global.rope_dim : c.local.head_dim));
  if (global) {
    return py::cast(PyMla{MlaOf<S>{std::get<MultiHeadLatentAttention<S>>(layer),
                                   s.absorbed_weights(l), std::move(table)}});
  }
  return py::cast(PyGqa{GqaOf<S>{std::get<GroupedQueryAttention<S>>(layer), std::move(table)}});
}

PyStackCache make_stack_cache(const PyStack& s, Index batch, Index capacity,
                              const std::string& format) {
  return std::visit(
      [&](const auto& st) {
        using S = typename std::decay_t<decltype(st)>::Scalar;
        check_format_for<S>(format, "stack");
        return PyStackCache{
            make_alternative<AnyOf<StackCacheOf>>(format_index(format, "stack"), [&](auto tag) {
              using Cache = typename decltype(tag)::type;
              if constexpr (std::is_same_v<compute_t<Cache>, S>) {
                return st.stack.template make_cache<typename StorageOf<Cache>::type>(batch,
                                                                                     capacity);
              } else {
                return Cache();  // not reached: check_format_for threw
              }
            })};
      },
      s.any);
}

py::dict memory_dict(const StackCacheMemory& m) {
  return dict_of(std::pair{"local_layers", std::int64_t{m.local_layers}},
                 std::pair{"global_layers", std::int64_t{m.global_layers}},
                 std::pair{"local_bytes_per_token", m.local_bytes_per_token},
                 std::pair{"global_bytes_per_token", m.global_bytes_per_token},
                 std::pair{"local_bytes_per_layer", m.local_bytes_per_layer},
                 std::pair{"global_bytes_per_layer", m.global_bytes_per_layer},
                 std::pair{"total_bytes", m.total_bytes});
}

/// Greedy generation: prefill, then argmax and decode_step, `count` new tokens a sequence.
template <class S, class Cache>
py::array generate_with(const AttentionStack<S>& stack, Cache& cache, const TokenMatrix& prompt,
                        Index count, Index prefix) {
  TokenMatrix out(prompt.rows(), count);
  {
    const py::gil_scoped_release release;
    DecodeOptions last;
    last.logits = LogitRows::kLast;
    RowMatrix<S> logits = stack.prefill(prompt, prefix, last, cache);
    std::vector<std::int64_t> next(static_cast<std::size_t>(prompt.rows()));
    for (Index t = 0; t < count; ++t) {
      for (Index b = 0; b < prompt.rows(); ++b) {
        Index best = 0;
        logits.row(b).maxCoeff(&best);  // the first of equal maxima, as numpy.argmax
        out(b, t) = next[static_cast<std::size_t>(b)] = best;
      }
      if (t + 1 < count) logits = stack.decode_step(next, last, cache);
    }
  }
  py::array result = new_array<std::int64_t>({out.rows(), out.cols()});
  Eigen::Map<TokenMatrix>(mutable_data<std::int64_t>(result), out.rows(), out.cols()) = out;
  return result;
}

const char* const kStackConfigDoc =
    "Config (keyword arguments, StackConfig): vocab_size V, d_model d, num_layers L, window W "
    "(of the local layers), global_every F_g (default 6: layer l is global when l mod F_g = "
    "F_g − 1), max_positions, rope_theta (10000), rope_pairing ('interleaved'), rotary_dim (of "
    "the local layers, 0: all), norm_eps (1e-6); local (GQA) layers: local_num_q_heads, "
    "local_num_kv_heads, local_head_dim; global (MLA) layers: global_d_q, global_d_kv, "
    "global_num_q_heads, global_num_kv_heads, global_head_dim, global_rope_dim, "
    "global_num_rope_key_heads (0: H_kv). Unset fields take StackConfig's defaults (0 for most, "
    "which apex rejects when the field is needed).";

/// A stack method on a StackCache: f(stack, cache) for matching compute types.
template <class F>
py::object on_cache(const PyStack& s, PyStackCache& cache, const F& f) {
  return visit_matching(s.any, cache.any, "stack",
                        [&](const auto& st, auto& c) { return f(st.stack, c); });
}

void def_stack_cache(py::module_& m) {
  py::class_<PyStackCache>(m, "StackCache",
                           "The decoding state of one AttentionStack (apex::StackCache): a "
                           "sliding-window cache of W tokens per local layer and a latent cache "
                           "of `capacity` tokens per global layer, in one format. Made by "
                           "AttentionStack.make_cache, advanced by its prefill, extend and "
                           "decode_step only.")
      .def_property_readonly(
          "format", [](const PyStackCache& c) { return kFormats[c.any.index()]; },
          "The storage format's name.")
      .def_property_readonly("batch",
                             visiting<PyStackCache>([](const auto& x) { return x.batch(); }), "B.")
      .def_property_readonly("capacity",
                             visiting<PyStackCache>([](const auto& x) { return x.capacity(); }),
                             "Tokens the global layers hold.")
      .def_property_readonly(
          "num_layers", visiting<PyStackCache>([](const auto& x) { return x.num_layers(); }), "L.")
      .def_property_readonly(
          "next_position", visiting<PyStackCache>([](const auto& x) { return x.next_position(); }),
          "Position of the next token (= tokens processed per sequence).")
      .def_property_readonly("prefix",
                             visiting<PyStackCache>([](const auto& x) { return x.prefix(); }),
                             "P of the sequence, set by prefill.")
      .def_property_readonly("bytes",
                             visiting<PyStackCache>([](const auto& x) { return x.bytes(); }),
                             "Exact bytes of every layer's cache (StackCache::bytes).")
      .def_property_readonly(
          "local_bytes", visiting<PyStackCache>([](const auto& x) { return x.local_bytes(); }),
          "Bytes of the local layers' rings: B·W·2·H_kv·d_h values a layer, constant.")
      .def_property_readonly(
          "global_bytes", visiting<PyStackCache>([](const auto& x) { return x.global_bytes(); }),
          "Bytes of the global layers' latent caches: B·C·(d_kv + H_kr·d_r) values a layer.");
  def_upkeep<PyStackCache, false>(m, "StackCache", "StackCache");
}

void def_stack(py::module_& m) {
  py::class_<PyStack>(
      m, "AttentionStack",
      (std::string("The APEX-1 attention stack (apex::AttentionStack<Scalar>, stack.hpp): token "
                   "ids in, logits out.\n  x_0 = Embed(tokens)·√d;  x_{l+1} = x_l + "
                   "Attention_l(RMSNorm(x_l; γ_l); mask_l);  logits = RMSNorm(x_L; γ_final)·"
                   "W_Eᵀ\nwith global layers (l mod F_g = F_g − 1) multi-head latent attention "
                   "under a causal mask and the others grouped-query attention under a causal "
                   "window of W, every layer with the bidirectional prefix [0, P). RMSNorm(x; γ) "
                   "= x / √(mean(x²) + norm_eps)·γ. RoPE tables of the stack: [max_positions, "
                   "local_head_dim] (the local layers) and [max_positions, global_rope_dim].\n\n") +
       kStackConfigDoc)
          .c_str())
      .def(py::init([](const py::object& embedding, const py::list& norm_gammas,
                       const py::object& final_gamma, const py::list& layers,
                       const std::string& dtype, const py::kwargs& config) {
             const StackConfig c = stack_config(config);
             return with_compute(dtype, "stack", [&](auto tag) {
               using S = typename decltype(tag)::type;
               return PyStack{StackOf<S>{
                   stack_from_arrays<S>(c, embedding, norm_gammas, final_gamma, layers)}};
             });
           }),
           py::kw_only(), py::arg("embedding"), py::arg("norm_gammas"), py::arg("final_gamma"),
           py::arg("layers"), py::arg("dtype") = "float32",
           "A stack of the config (keyword arguments, see the class) and the given weights "
           "(AttentionStack(config, embedding, norm_gammas, final_gamma, layers), copied): "
           "embedding [V, d] (W_E, also the tied LM head), norm_gammas: L arrays [d] (γ_l), "
           "final_gamma [d], layers: L layer objects, apex.MultiHeadLatentAttention for the "
           "global layers and apex.GroupedQueryAttention for the others, of the config's shapes "
           "and of dtype (their RoPE tables are not used: the stack builds its own). Raises "
           "ValueError with apex's message on an inconsistent config or weight.")
      .def_static(
          "random",
          [](std::uint64_t seed, const std::string& dtype, const py::kwargs& config) {
            const StackConfig c = stack_config(config);
            return with_compute(dtype, "stack", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return PyStack{StackOf<S>{AttentionStack<S>::random(c, seed)}};
            });
          },
          py::kw_only(), py::arg("seed"), py::arg("dtype") = "float32",
          "A stack with random weights (AttentionStack::random(config, seed)): embedding "
          "entries N(0, 0.02²), every γ = 1, each layer from its own random() with a seed "
          "derived from `seed`. Config as keyword arguments (see the class).")
      .def_property_readonly("config", visiting<PyStack>([](const auto& s) {
                               return stack_config_dict(s.stack.config());
                             }),
                             "The config as a dict of the keyword arguments' names.")
      .def_property_readonly("dtype", visiting<PyStack>([](const auto& s) {
                               return numpy_name<typename std::decay_t<decltype(s)>::Scalar>();
                             }),
                             "'float32' or 'float64'.")
      .def_property_readonly(
          "weight_bytes", visiting<PyStack>([](const auto& s) { return s.stack.weight_bytes(); }),
          "Bytes of the weights (AttentionStack::weight_bytes: the table, every layer's matrices "
          "and absorbed products, the γ).")
      .def_property_readonly("embedding", visiting<PyStack>([](const auto& s) {
                               return array_of(s.stack.embedding());
                             }),
                             "W_E, a new [V, d] array.")
      .def_property_readonly(
          "norm_gammas", visiting<PyStack>([](const auto& s) {
            py::list gammas;
            for (Index l = 0; l < s.stack.config().num_layers; ++l) {
              gammas.append(array_of(s.stack.norm_gamma(l)));
            }
            return gammas;
          }),
          "γ_l of the RMSNorm before each layer (AttentionStack::norm_gamma): L new arrays [d].")
      .def_property_readonly(
          "final_gamma",
          visiting<PyStack>([](const auto& s) { return array_of(s.stack.final_gamma()); }),
          "γ of the final RMSNorm (AttentionStack::final_gamma), a new array [d].")
      .def(
          "layer",
          [](const PyStack& s, Index l) {
            return std::visit([&](const auto& st) { return stack_layer(st.stack, l); }, s.any);
          },
          py::arg("l"),
          "Layer l as a new apex.MultiHeadLatentAttention (global) or apex.GroupedQueryAttention "
          "(local) object (AttentionStack::layer, copied), holding the stack's RoPE table of its "
          "kind: its forward is the stack's attention of block l.")
      .def(
          "is_global",
          [](const PyStack& s, Index l) {
            return std::visit(
                [&](const auto& st) {
                  return std::holds_alternative<typename std::decay_t<decltype(st.stack)>::Mla>(
                      st.stack.layer(l));
                },
                s.any);
          },
          py::arg("l"), "Whether layer l is a global (MLA) layer.")
      .def(
          "forward",
          [](const PyStack& s, const py::object& tokens, Index prefix) {
            const Tokens t = tokens_of(tokens, "stack");
            return std::visit(
                [&](const auto& st) {
                  using S = typename std::decay_t<decltype(st)>::Scalar;
                  RowMatrix<S> logits;
                  {
                    const py::gil_scoped_release release;
                    logits = st.stack.forward(t.ids, prefix);
                  }
                  return logits_array(logits, t.ids.rows(), t.one_sequence, false);
                },
                s.any);
          },
          py::arg("tokens"), py::kw_only(), py::arg("prefix") = 0,
          "The forward pass over whole sequences (AttentionStack::forward), no cache.\n\n"
          "tokens: [B, S] (or [S]) integer ids in [0, V), S <= max_positions; the first `prefix` "
          "positions are bidirectional. Returns new logits [B, S, V] (or [S, V]), the stack's "
          "dtype. Allocates the residual stream and each layer's intermediates.")
      .def(
          "make_cache",
          [](const PyStack& s, Index batch, Index capacity, const std::string& format) {
            return make_stack_cache(s, batch, capacity, format);
          },
          py::arg("batch"), py::arg("capacity"), py::kw_only(), py::arg("format") = "float32",
          (std::string("An empty apex.StackCache (AttentionStack::make_cache<Storage>): B "
                       "sequences of up to `capacity` tokens (1 <= capacity <= max_positions), "
                       "every layer's cache in `format` (float64 stacks: 'float64'; float32 "
                       "stacks any other). Allocates cache_memory(batch, capacity, format)"
                       "['total_bytes'].\n\nformat: ") +
           kFormatDoc)
              .c_str())
      .def(
          "cache_memory",
          [](const PyStack& s, Index batch, Index context, const std::string& format) {
            return std::visit(
                [&](const auto& st) {
                  using S = typename std::decay_t<decltype(st)>::Scalar;
                  check_format_for<S>(format, "stack");
                  return on_alternative<AnyOf<StackCacheOf>>(
                      format_index(format, "stack"), [&](auto tag) {
                        using St = typename StorageOf<typename decltype(tag)::type>::type;
                        return memory_dict(
                            stack_cache_memory<St>(st.stack.config(), batch, context));
                      });
                },
                s.any);
          },
          py::arg("batch"), py::arg("context"), py::kw_only(), py::arg("format") = "float32",
          "The cache memory at a context (stack_cache_memory<Storage>): a dict of local_layers, "
          "global_layers, local/global_bytes_per_token, local/global_bytes_per_layer, "
          "total_bytes. Allocates nothing else.")
      .def(
          "prefill",
          [](const PyStack& s, const py::object& tokens, PyStackCache& cache, Index prefix,
             bool last_only, const std::string& mla_path) {
            const Tokens t = tokens_of(tokens, "stack");
            const DecodeOptions options = decode_options(last_only, mla_path);
            return on_cache(s, cache, [&](const auto& stack, auto& c) {
              const py::gil_scoped_release release;
              auto logits = stack.prefill(t.ids, prefix, options, c);
              const py::gil_scoped_acquire acquire;
              return logits_array(logits, t.ids.rows(), t.one_sequence, last_only);
            });
          },
          py::arg("tokens"), py::arg("cache"), py::kw_only(), py::arg("prefix") = 0,
          py::arg("last_only") = false, py::arg("mla_path") = "auto",
          "Prefill (AttentionStack::prefill): runs a prompt through the stack and fills the "
          "empty cache.\n\ntokens: [B, S] (or [S]) ids, B = cache.batch, S <= capacity; the "
          "first `prefix` positions are bidirectional. Returns new logits [B, S, V] (or [S, V]), "
          "equal to forward's, or with last_only=True the last token's [B, V] "
          "(LogitRows::kLast). mla_path: 'auto', 'naive' or 'absorbed' (DecodeOptions::mla). "
          "Raises ValueError (cache unchanged) on a non-empty cache, a bad id or shape.")
      .def(
          "extend",
          [](const PyStack& s, const py::object& tokens, PyStackCache& cache, bool last_only,
             const std::string& mla_path) {
            const Tokens t = tokens_of(tokens, "stack");
            const DecodeOptions options = decode_options(last_only, mla_path);
            return on_cache(s, cache, [&](const auto& stack, auto& c) {
              const py::gil_scoped_release release;
              auto logits = stack.extend(t.ids, options, c);
              const py::gil_scoped_acquire acquire;
              return logits_array(logits, t.ids.rows(), t.one_sequence, last_only);
            });
          },
          py::arg("tokens"), py::arg("cache"), py::kw_only(), py::arg("last_only") = false,
          py::arg("mla_path") = "auto",
          "Extend (AttentionStack::extend): n more tokens of each sequence at positions "
          "[p, p + n), p = cache.next_position (chunked prefill). tokens: [B, n] (or [n]). "
          "Returns new logits as prefill. Raises ValueError (cache unchanged) past the capacity "
          "or on a bad id.")
      .def(
          "decode_step",
          [](const PyStack& s, const std::vector<std::int64_t>& tokens, PyStackCache& cache,
             const std::string& mla_path) {
            const DecodeOptions options = decode_options(false, mla_path);
            return on_cache(s, cache, [&](const auto& stack, auto& c) {
              const py::gil_scoped_release release;
              auto logits = stack.decode_step(tokens, options, c);
              const py::gil_scoped_acquire acquire;
              return logits_array(logits, logits.rows(), false, true);
            });
          },
          py::arg("tokens"), py::arg("cache"), py::kw_only(), py::arg("mla_path") = "auto",
          "Decode step (AttentionStack::decode_step): one token a sequence (tokens: B ints), at "
          "position cache.next_position. Returns new logits [B, V]. Raises ValueError (cache "
          "unchanged) on a batch mismatch, a bad id or a full cache.")
      .def(
          "generate",
          [](const PyStack& s, const py::object& prompt, Index max_new_tokens, Index prefix,
             const std::string& format) {
            const Tokens t = tokens_of(prompt, "stack");
            APEX_CHECK(max_new_tokens >= 1,
                       "[stack] max_new_tokens (" << max_new_tokens << ") must be >= 1");
            // The last token generated is not fed back: S + max_new − 1 positions are cached.
            PyStackCache cache =
                make_stack_cache(s, t.ids.rows(), t.ids.cols() + max_new_tokens - 1, format);
            py::array out = on_cache(s, cache, [&](const auto& stack, auto& c) {
              return generate_with(stack, c, t.ids, max_new_tokens, prefix);
            });
            if (t.one_sequence) return out.attr("reshape")(max_new_tokens).cast<py::array>();
            return out;
          },
          py::arg("prompt"), py::arg("max_new_tokens"), py::kw_only(), py::arg("prefix") = 0,
          py::arg("format") = "float32",
          "Greedy generation: prefill(prompt) into a new cache of `format` (capacity S + "
          "max_new_tokens − 1), then max_new_tokens times: the argmax of each sequence's last "
          "logits (the first of equal maxima) is the next token, fed back by decode_step. "
          "prompt: [B, S] (or [S]) ids. Returns the new tokens, int64 [B, max_new_tokens] (or "
          "[max_new_tokens]). Allocates the cache for the call's duration.");
}

}  // namespace

void def_models(py::module_& m) {
  def_kv_cache(m);
  def_gqa(m);
  def_latent_cache(m);
  def_mla(m);
  def_stack_cache(m);
  def_stack(m);
}

}  // namespace apex::python
