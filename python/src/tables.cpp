// SPDX-License-Identifier: MIT
// apex's per-token formulas on numpy arrays: RMSNorm and LayerNorm (rms_norm.hpp,
// layer_norm.hpp), RoPE and YaRN tables and their application (rope.hpp, yarn.hpp,
// rope_config.hpp), the embedding and the tied LM head (embedding.hpp), and bfloat16 conversion
// (storage.hpp).
#include "arrays.hpp"

#include <variant>

namespace apex::python {

namespace {

/// Whether the leading axes of `a` (all but the last) step through memory as one axis of rows,
/// each row after the previous one's features.
inline bool rows_evenly_spaced(const py::array& a) {
  const py::ssize_t n = a.ndim();
  for (py::ssize_t axis = n - 2; axis > 0; --axis) {
    if (a.shape(axis - 1) > 1 && a.strides(axis - 1) != a.strides(axis) * a.shape(axis)) {
      return false;
    }
  }
  return n < 2 || a.shape(n - 2) <= 1 || a.strides(n - 2) >= a.shape(n - 1) * a.itemsize();
}

/// x [..., d] as the rows of a [rows, d] matrix: in place when its rows are evenly spaced with
/// contiguous features, else a contiguous copy.
template <class T>
struct RowsInput {
  using Rows = Eigen::Map<const RowMatrix<T>, 0, Eigen::OuterStride<>>;
  py::array array;  ///< what the rows point into
  Index rows = 0, cols = 0, stride = 0;

  RowsInput(const py::array& x, const char* op, const char* name) {
    check_rank(x, 1, 32, op, name, "at least 1 ([..., d])");
    array = readable_in_place(x) && rows_evenly_spaced(x) ? x : contiguous_as<T>(x);
    const py::ssize_t n = array.ndim();
    cols = static_cast<Index>(array.shape(n - 1));
    rows = cols == 0 ? 0 : static_cast<Index>(array.size()) / cols;
    stride = n >= 2 && rows > 1 ? element_stride(array, n - 2) : cols;
  }
  Rows map() const {
    return Rows(static_cast<const T*>(array.data()), rows, cols, Eigen::OuterStride<>(stride));
  }
};

/// A norm's γ or β as float64 (exact for every float dtype; apex forms the output in double).
Vector<double> norm_vector(const py::array& v) {
  const py::array a = contiguous_as<double>(v);
  return Eigen::Map<const Vector<double>>(static_cast<const double*>(a.data()), a.size());
}

py::array rms_norm_py(const ArrayLike& x, const ArrayLike& gamma, double eps, bool one_plus_gamma,
                      const std::optional<std::string>& dtype) {
  const char* op = "rms_norm";
  const Vector<double> g = norm_vector(gamma);
  const RmsNormParams params{eps,
                             one_plus_gamma ? RmsNormGamma::kOnePlusGamma : RmsNormGamma::kGamma};
  return with_storage(storage_of(x, dtype, op, "x"), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const RowsInput<T> in(x, op, "x");
    auto [out, rows] = rows_output<T>(x, in.rows, in.cols);
    const py::gil_scoped_release release;
    rms_norm(in.map(), g, params, rows);
    return out;
  });
}

py::array layer_norm_py(const ArrayLike& x, const std::optional<ArrayLike>& gamma,
                        const std::optional<ArrayLike>& beta, double eps,
                        const std::optional<std::string>& dtype) {
  const char* op = "layer_norm";
  const Index d = x.ndim() >= 1 ? static_cast<Index>(x.shape(x.ndim() - 1)) : 0;
  const Vector<double> g = gamma ? norm_vector(*gamma) : Vector<double>::Ones(d).eval();
  const Vector<double> b = beta ? norm_vector(*beta) : Vector<double>::Zero(d).eval();
  return with_storage(storage_of(x, dtype, op, "x"), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const RowsInput<T> in(x, op, "x");
    auto [out, rows] = rows_output<T>(x, in.rows, in.cols);
    const py::gil_scoped_release release;
    layer_norm(in.map(), g, b, LayerNormParams{eps}, rows);
    return out;
  });
}

RopePairing parse_pairing(const std::string& name) {
  APEX_CHECK(name == "interleaved" || name == "half_split",
             "[rope] pairing ('" << name
                                 << "') must be 'interleaved' ((2i, 2i+1), §4.4) or "
                                    "'half_split' ((i, i + d_r/2), HuggingFace's rotate_half)");
  return name == "interleaved" ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
}

/// A RoPE table of float or double entries (the Python class RopeTable).
class PyRopeTable {
 public:
  using Table = std::variant<RopeTable<float>, RopeTable<double>>;

  PyRopeTable() = default;
  explicit PyRopeTable(Table t) : table_(std::move(t)) {}

  /// Builds a table of the scalar type named by `dtype` ("float32" or "float64").
  template <class Make>
  static PyRopeTable make(const std::string& dtype, const char* op, Make&& make) {
    APEX_CHECK(dtype == "float32" || dtype == "float64",
               "[" << op << "] dtype ('" << dtype << "') must be 'float32' or 'float64'");
    if (dtype == "float64") return PyRopeTable(Table(make(Tag<double>{})));
    return PyRopeTable(Table(make(Tag<float>{})));
  }

  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), table_);
  }

  /// cos() or sin() as a read-only array into the table, kept alive by `owner`.
  py::array entries(bool cos, const py::object& owner) const {
    return visit([&](const auto& t) {
      const auto& m = cos ? t.cos() : t.sin();
      using S = typename std::decay_t<decltype(m)>::Scalar;
      py::array a(py::dtype(numpy_num<S>()), {m.rows(), m.cols()},
                  {static_cast<py::ssize_t>(sizeof(S) * static_cast<std::size_t>(m.cols())),
                   static_cast<py::ssize_t>(sizeof(S))},
                  m.data(), owner);
      py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
      return a;
    });
  }

 private:
  Table table_;
};

YarnParams yarn_params(double scale, Index original_context, double beta_fast, double beta_slow,
                       double base, bool truncate, std::optional<double> mscale,
                       std::optional<double> mscale_all_dim,
                       std::optional<double> attention_factor) {
  YarnParams p;
  p.scale = scale;
  p.original_context = original_context;
  p.beta_fast = beta_fast;
  p.beta_slow = beta_slow;
  p.base = base;
  p.truncate = truncate;
  p.mscale = mscale;
  p.mscale_all_dim = mscale_all_dim;
  p.attention_factor = attention_factor;
  return p;
}

/// A value of `d[key]` cast to T, or unset when the key is absent or None.
template <class T>
std::optional<T> field(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return d[key].cast<T>();
}

/// A HuggingFace config (a dict as config.json holds it) as apex's RopeConfig: rope_theta,
/// head_dim (else hidden_size / num_attention_heads), partial_rotary_factor,
/// max_position_embeddings and original_max_position_embeddings from the top level, and the rope
/// type with its fields from rope_scaling (or rope_parameters). A rope_scaling key apex does not
/// know is an error, so that nothing the config says is ignored.
RopeConfig rope_config_of(const py::dict& config) {
  RopeConfig c;
  c.rope_theta = field<double>(config, "rope_theta").value_or(10000.0);
  if (auto hd = field<Index>(config, "head_dim")) {
    c.head_dim = *hd;
  } else if (auto hidden = field<Index>(config, "hidden_size")) {
    const Index heads = field<Index>(config, "num_attention_heads").value_or(0);
    APEX_CHECK(heads > 0, "[rope_config] num_attention_heads ("
                              << heads << ") must be > 0 to find head_dim from hidden_size");
    c.head_dim = *hidden / heads;
  }
  c.partial_rotary_factor = field<double>(config, "partial_rotary_factor").value_or(1.0);
  c.max_position_embeddings = field<Index>(config, "max_position_embeddings").value_or(0);
  c.original_max_position_embeddings = field<Index>(config, "original_max_position_embeddings");
  py::dict s;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (config.contains(key) && !config[key].is_none()) s = config[key].cast<py::dict>();
  }
  static const char* const known[] = {"rope_type",        "type",
                                      "factor",           "original_max_position_embeddings",
                                      "low_freq_factor",  "high_freq_factor",
                                      "beta_fast",        "beta_slow",
                                      "mscale",           "mscale_all_dim",
                                      "attention_factor", "truncate",
                                      "short_factor",     "long_factor",
                                      "mrope_section",    "mrope_interleaved",
                                      "rope_theta",       "partial_rotary_factor"};
  for (const auto& item : s) {
    const auto key = item.first.cast<std::string>();
    const bool is_known =
        std::any_of(std::begin(known), std::end(known), [&](const char* k) { return key == k; });
    APEX_CHECK(is_known, "[rope_config] rope_scaling key '" << key << "' is not one apex reads");
  }
  c.rope_type = field<std::string>(s, "rope_type")
                    .value_or(field<std::string>(s, "type").value_or("default"));
  if (auto theta = field<double>(s, "rope_theta")) c.rope_theta = *theta;
  if (auto prf = field<double>(s, "partial_rotary_factor")) c.partial_rotary_factor = *prf;
  c.factor = field<double>(s, "factor");
  if (auto o = field<Index>(s, "original_max_position_embeddings")) {
    c.original_max_position_embeddings = o;
  }
  c.low_freq_factor = field<double>(s, "low_freq_factor");
  c.high_freq_factor = field<double>(s, "high_freq_factor");
  c.beta_fast = field<double>(s, "beta_fast");
  c.beta_slow = field<double>(s, "beta_slow");
  c.mscale = field<double>(s, "mscale");
  c.mscale_all_dim = field<double>(s, "mscale_all_dim");
  c.attention_factor = field<double>(s, "attention_factor");
  c.truncate = field<bool>(s, "truncate");
  c.short_factor = field<std::vector<double>>(s, "short_factor").value_or(std::vector<double>{});
  c.long_factor = field<std::vector<double>>(s, "long_factor").value_or(std::vector<double>{});
  c.mrope_section = field<std::vector<Index>>(s, "mrope_section").value_or(std::vector<Index>{});
  c.mrope_interleaved = field<bool>(s, "mrope_interleaved").value_or(false);
  return c;
}

/// Calls f(slice) for each [S, W] slice of x [..., S, W], a Map over its memory.
template <class X, class F>
void for_each_slice(py::array& x, const F& f) {
  const py::ssize_t n = x.ndim();
  const Index rows = static_cast<Index>(x.shape(n - 2)), cols = static_cast<Index>(x.shape(n - 1));
  const Index row_stride = rows > 1 ? element_stride(x, n - 2) : cols;
  py::ssize_t slices = 1;
  for (py::ssize_t axis = 0; axis + 2 < n; ++axis) slices *= x.shape(axis);
  auto* base = static_cast<char*>(x.mutable_data());
  for (py::ssize_t s = 0; s < slices; ++s) {
    py::ssize_t rest = s, offset = 0;
    for (py::ssize_t axis = n - 3; axis >= 0; --axis) {
      offset += (rest % x.shape(axis)) * x.strides(axis);
      rest /= x.shape(axis);
    }
    using Slice = Eigen::Map<RowMatrix<X>, 0, Eigen::OuterStride<>>;
    Slice slice(reinterpret_cast<X*>(base + offset), rows, cols,
                Eigen::OuterStride<>(std::max<Index>(row_stride, cols)));
    f(RowRef<X>(slice));
  }
}

/// RoPE in place on x [..., S, W] (each [S, W] slice: S tokens, W = heads · head_dim).
py::array apply_rope_py(const PyRopeTable& table, py::array x, Index offset,
                        const std::optional<ArrayLike>& positions,
                        const std::optional<std::string>& dtype) {
  const char* op = "apply_rope";
  check_rank(x, 2, 32, op, "x", "at least 2 ([..., S, W])");
  APEX_CHECK(x.writeable(), "[" << op << "] x must be writeable: RoPE rotates it in place");
  APEX_CHECK(readable_in_place(x) && x.strides(x.ndim() - 2) >= 0,
             "[" << op
                 << "] x must have contiguous features and whole-element strides to be "
                    "rotated in place (numpy.ascontiguousarray gives such a copy)");
  py::array ids;
  if (positions) {
    ids = contiguous_as<std::int64_t>(*positions);
    APEX_CHECK(ids.ndim() == 1 && ids.shape(0) == x.shape(x.ndim() - 2),
               "[" << op << "] positions shape must be [S] with S = " << x.shape(x.ndim() - 2));
  }
  const Dtype storage = storage_of(x, dtype, op, "x");
  table.visit([&](const auto& t) {
    using Table = std::decay_t<decltype(t)>;
    using S = typename Table::ScalarType;
    with_storage(storage, [&](auto tag) {
      using X = typename decltype(tag)::type;
      if constexpr (std::is_same_v<X, S> || is_16bit_v<X>) {
        const Eigen::Map<const Vector<std::int64_t>> pos(
            positions ? static_cast<const std::int64_t*>(ids.data()) : nullptr,
            positions ? ids.size() : 0);
        const py::gil_scoped_release release;
        for_each_slice<X>(x, [&](RowRef<X> slice) {
          if (positions) {
            apply_rope(t, pos, slice);
          } else {
            apply_rope(t, offset, slice);
          }
        });
      } else {
        APEX_CHECK(false, "[" << op << "] x dtype (" << numpy_name<X>() << ") must be the table's ("
                              << numpy_name<S>() << "), float16 or bfloat16");
      }
    });
  });
  return x;
}

py::array embed_py(const ArrayLike& table, const ArrayLike& ids, std::optional<double> scale,
                   const std::optional<std::string>& dtype) {
  const char* op = "embed";
  check_rank(table, 2, 2, op, "table", "2 ([V, d])");
  const py::array tokens = contiguous_as<std::int64_t>(ids);
  const Eigen::Map<const TokenMatrix> id_rows(static_cast<const std::int64_t*>(tokens.data()), 1,
                                              static_cast<Index>(tokens.size()));
  std::vector<py::ssize_t> shape(tokens.shape(), tokens.shape() + tokens.ndim());
  shape.push_back(table.shape(1));
  return with_storage(storage_of(table, dtype, op, "table"), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const RowsInput<T> w(table, op, "table");
    py::array out = new_array<T>(shape);
    Eigen::Map<RowMatrix<T>> rows(mutable_data<T>(out), id_rows.cols(), w.cols);
    const py::gil_scoped_release release;
    embed(w.map(), id_rows, EmbeddingParams{scale}, rows);
    return out;
  });
}

py::array lm_head_py(const ArrayLike& h, const ArrayLike& table,
                     const std::optional<std::string>& dtype) {
  const char* op = "lm_head";
  check_rank(table, 2, 2, op, "table", "2 ([V, d])");
  const Dtype hd = storage_of(h, std::nullopt, op, "h");
  const Dtype td = storage_of(table, dtype, op, "table");
  APEX_CHECK(hd == Dtype::kFloat32 || hd == Dtype::kFloat64,
             "[" << op << "] h dtype (" << dtype_name(hd) << ") must be float32 or float64");
  APEX_CHECK(td == hd || (hd == Dtype::kFloat32 && td != Dtype::kFloat64),
             "[" << op << "] table dtype (" << dtype_name(td) << ") must be h's (" << dtype_name(hd)
                 << ") or, for float32 h, float16 or bfloat16");
  const auto run = [&](auto h_tag) {
    using H = typename decltype(h_tag)::type;
    const RowsInput<H> hr(h, op, "h");
    std::vector<py::ssize_t> shape(h.shape(), h.shape() + h.ndim());
    shape.back() = table.shape(0);
    py::array out = new_array<H>(shape);
    Eigen::Map<RowMatrix<H>> logits(mutable_data<H>(out), hr.rows, table.shape(0));
    with_storage(td, [&](auto t_tag) {
      using W = typename decltype(t_tag)::type;
      if constexpr (std::is_same_v<W, H> || (std::is_same_v<H, float> && is_16bit_v<W>)) {
        const RowsInput<W> w(table, op, "table");
        const py::gil_scoped_release release;
        lm_head(hr.map(), w.map(), RowRef<H>(logits));
      }
    });
    return out;
  };
  if (hd == Dtype::kFloat64) return run(Tag<double>{});
  return run(Tag<float>{});
}

py::array to_bfloat16_py(const ArrayLike& x) {
  const py::array a = contiguous_as<double>(x);
  py::array out = new_array<Eigen::bfloat16>({a.shape(), a.shape() + a.ndim()});
  const auto* in = static_cast<const double*>(a.data());
  auto* bits = static_cast<Eigen::bfloat16*>(out.mutable_data());
  for (py::ssize_t i = 0; i < a.size(); ++i) bits[i] = round_to<Eigen::bfloat16>(in[i]);
  return out;
}

py::array from_bfloat16_py(const ArrayLike& bits) {
  check_dtype<Eigen::bfloat16>(bits, "from_bfloat16", "bits", "bfloat16 bits");
  const py::array a = contiguous_as<Eigen::bfloat16>(bits);
  py::array out = new_array<float>({a.shape(), a.shape() + a.ndim()});
  const auto* in = static_cast<const Eigen::bfloat16*>(a.data());
  auto* f = mutable_data<float>(out);
  for (py::ssize_t i = 0; i < a.size(); ++i) f[i] = static_cast<float>(in[i]);
  return out;
}

void def_norms(py::module_& m) {
  m.def(
      "rms_norm", &rms_norm_py, py::arg("x"), py::arg("gamma"), py::kw_only(),
      py::arg("eps") = 1e-6, py::arg("one_plus_gamma") = false, py::arg("dtype") = py::none(),
      R"doc(RMSNorm over the last axis (apex::rms_norm, §3.2): x / sqrt(mean(x²) + eps) · γ, or · (1 + γ) with one_plus_gamma=True (Gemma).

x: [..., d] of float32, float64, float16 or bfloat16 (uint16 with dtype='bfloat16'); gamma: [d]
of any float dtype. Returns a new array of x's shape and dtype; squares are summed and the
output formed in double, rounded once. x is read in place when its rows are evenly spaced with
contiguous features, else copied once.)doc");
  m.def("layer_norm", &layer_norm_py, py::arg("x"), py::arg("gamma") = py::none(),
        py::arg("beta") = py::none(), py::kw_only(), py::arg("eps") = 1e-5,
        py::arg("dtype") = py::none(),
        R"doc(LayerNorm over the last axis (apex::layer_norm): (x − μ) / sqrt(σ² + eps) · γ + β.

x: [..., d] (dtypes as rms_norm); gamma, beta: [d] or None (1 and 0). Returns a new array of x's
shape and dtype, formed in double and rounded once.)doc");
}

void def_rope(py::module_& m) {
  py::class_<PyRopeTable>(m, "RopeTable",
                          R"doc(Precomputed RoPE cos/sin tables (apex::RopeTable, §4.7).

cos and sin are [max_positions, rotary_dim], laid out per the pairing: 'interleaved' pairs
features (2i, 2i+1) as §4.4 writes it, 'half_split' pairs (i, i + d_r/2) as HuggingFace's
rotate_half does. Each angle m·θ_i is formed in double; entries are float32 or float64.)doc")
      .def(py::init([](Index max_positions, Index head_dim, double base, Index rotary_dim,
                       const std::string& pairing, const std::string& dtype) {
             const RopeParams p{base, rotary_dim, parse_pairing(pairing)};
             return PyRopeTable::make(dtype, "rope", [&](auto tag) {
               using S = typename decltype(tag)::type;
               return RopeTable<S>(max_positions, head_dim, p);
             });
           }),
           py::arg("max_positions"), py::arg("head_dim"), py::kw_only(), py::arg("base") = 10000.0,
           py::arg("rotary_dim") = 0, py::arg("pairing") = "interleaved",
           py::arg("dtype") = "float32",
           "The plain table (§4.3): θ_i = base^(-2i/d_r); rotary_dim 0 rotates the whole head.")
      .def_static(
          "from_frequencies",
          [](const ArrayLike& theta, Index max_positions, Index head_dim,
             const std::string& pairing, double magnitude, const std::string& dtype) {
            const Vector<double> t = norm_vector(theta);
            return PyRopeTable::make(dtype, "rope", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return RopeTable<S>::from_frequencies(t, max_positions, head_dim,
                                                    parse_pairing(pairing), magnitude);
            });
          },
          py::arg("theta"), py::arg("max_positions"), py::arg("head_dim"), py::kw_only(),
          py::arg("pairing") = "interleaved", py::arg("magnitude") = 1.0,
          py::arg("dtype") = "float32",
          "A table of given frequencies θ [d_r/2], every entry times magnitude.")
      .def_static(
          "yarn",
          [](Index max_positions, Index head_dim, double scale, Index original_context,
             double beta_fast, double beta_slow, double base, bool truncate,
             std::optional<double> mscale, std::optional<double> mscale_all_dim,
             std::optional<double> attention_factor, Index rotary_dim, const std::string& pairing,
             const std::string& dtype) {
            const YarnParams p = yarn_params(scale, original_context, beta_fast, beta_slow, base,
                                             truncate, mscale, mscale_all_dim, attention_factor);
            return PyRopeTable::make(dtype, "yarn", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return yarn_table<S>(max_positions, head_dim, rotary_dim, parse_pairing(pairing), p);
            });
          },
          py::arg("max_positions"), py::arg("head_dim"), py::kw_only(), py::arg("scale"),
          py::arg("original_context"), py::arg("beta_fast") = 32.0, py::arg("beta_slow") = 1.0,
          py::arg("base") = 10000.0, py::arg("truncate") = true, py::arg("mscale") = py::none(),
          py::arg("mscale_all_dim") = py::none(), py::arg("attention_factor") = py::none(),
          py::arg("rotary_dim") = 0, py::arg("pairing") = "interleaved",
          py::arg("dtype") = "float32",
          "The YaRN table (apex::yarn_table, §5): YaRN's frequencies, its attention factor in the "
          "entries.")
      .def_static(
          "from_config",
          [](const py::dict& config, Index max_positions, const std::string& dtype) {
            const RopeConfig c = rope_config_of(config);
            return PyRopeTable::make(dtype, "rope_config", [&](auto tag) {
              using S = typename decltype(tag)::type;
              return rope_config_table<S>(c, max_positions);
            });
          },
          py::arg("config"), py::arg("max_positions"), py::kw_only(), py::arg("dtype") = "float32",
          R"doc(The table a HuggingFace config declares (apex::rope_config_table): a dict as config.json holds it, with rope_theta, head_dim (or hidden_size and num_attention_heads), partial_rotary_factor, max_position_embeddings and rope_scaling (default, linear, dynamic, yarn, llama3, longrope). A rope_scaling key apex does not read raises ValueError.)doc")
      .def_property_readonly("max_positions",
                             [](const PyRopeTable& t) {
                               return t.visit([](const auto& r) { return r.max_positions(); });
                             })
      .def_property_readonly(
          "head_dim",
          [](const PyRopeTable& t) { return t.visit([](const auto& r) { return r.head_dim(); }); })
      .def_property_readonly("rotary_dim",
                             [](const PyRopeTable& t) {
                               return t.visit([](const auto& r) { return r.rotary_dim(); });
                             })
      .def_property_readonly("pairing",
                             [](const PyRopeTable& t) {
                               return t.visit([](const auto& r) {
                                 return r.pairing() == RopePairing::kInterleaved ? "interleaved"
                                                                                 : "half_split";
                               });
                             })
      .def_property_readonly(
          "cos",
          [](const py::object& self) {
            return self.cast<const PyRopeTable&>().entries(true, self);
          },
          "[max_positions, rotary_dim], read-only, a view into the table (no copy).")
      .def_property_readonly(
          "sin",
          [](const py::object& self) {
            return self.cast<const PyRopeTable&>().entries(false, self);
          },
          "[max_positions, rotary_dim], read-only, a view into the table (no copy).");

  m.def("apply_rope", &apply_rope_py, py::arg("table"), py::arg("x"), py::kw_only(),
        py::arg("offset") = 0, py::arg("positions") = py::none(), py::arg("dtype") = py::none(),
        R"doc(RoPE in place (apex::apply_rope, §4.4): rotates x and returns it.

x: [..., S, W], each [S, W] slice S tokens of W = heads · head_dim features (heads side by side,
as a projection writes them; one head when W = head_dim), the first rotary_dim of every head
rotated. Token t is at position offset + t, or positions[t] (int [S]) when given. x's dtype is
the table's, float16 or bfloat16 (uint16 with dtype='bfloat16'; rotated in the table's type and
rounded once). x must be writeable with contiguous features; it is never copied.)doc");

  m.def(
      "yarn_attention_factor",
      [](double scale, std::optional<double> mscale, std::optional<double> mscale_all_dim,
         std::optional<double> attention_factor) {
        YarnParams p;
        p.scale = scale;
        p.original_context = 1;
        p.mscale = mscale;
        p.mscale_all_dim = mscale_all_dim;
        p.attention_factor = attention_factor;
        return yarn_attention_factor(p);
      },
      py::arg("scale"), py::kw_only(), py::arg("mscale") = py::none(),
      py::arg("mscale_all_dim") = py::none(), py::arg("attention_factor") = py::none(),
      "YaRN's attention factor (apex::yarn_attention_factor, §5.5): 0.1·ln(s) + 1 by default.");
}

void def_embedding(py::module_& m) {
  m.def("embed", &embed_py, py::arg("table"), py::arg("ids"), py::kw_only(),
        py::arg("scale") = py::none(), py::arg("dtype") = py::none(),
        R"doc(Embedding lookup scaled by √d (apex::embed, §2.2): table[ids] · scale.

table: [V, d] (float32, float64, float16, or uint16 with dtype='bfloat16'); ids: integers of any
shape, each in [0, V). Returns ids.shape + (d,) in the table's dtype. scale: default √d; 1 for a
plain lookup.)doc");
  m.def("lm_head", &lm_head_py, py::arg("h"), py::arg("table"), py::kw_only(),
        py::arg("dtype") = py::none(),
        R"doc(The weight-tied LM head (apex::lm_head, §2.5): logits = h · tableᵀ.

h: [..., d] float32 or float64; table: [V, d] of h's dtype, or float16 / bfloat16 (dtype names the
table's) for float32 h. Returns [..., V] in h's dtype.)doc");
  m.def("to_bfloat16", &to_bfloat16_py, py::arg("x"),
        "x rounded once to bfloat16 (nearest, ties to even), as uint16 bits of x's shape.");
  m.def("from_bfloat16", &from_bfloat16_py, py::arg("bits"),
        "bfloat16 bits (uint16) widened to float32 (exact).");
}

}  // namespace

void def_tables(py::module_& m) {
  def_norms(m);
  def_rope(m);
  def_embedding(m);
}

}  // namespace apex::python
