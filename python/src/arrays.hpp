// SPDX-License-Identifier: MIT
// numpy arrays as apex's views: the storage types, reading an array in place where its layout
// allows (a copy otherwise), and new result arrays. Shared by every source of the module.
//
// Storage types: numpy float32, float64 and float16 are float, double and Eigen::half (IEEE
// binary16, the same bits); bfloat16 is held in uint16 arrays and named by a dtype argument,
// numpy having no bfloat16 of its own.
//
// In place: apex's views (HeadsView, Eigen's maps with an outer stride) take any stride in
// elements on every axis but the last, whose elements must be adjacent. An array whose byte
// strides are multiples of its item size and whose last axis is contiguous is read where it is;
// any other is copied once, contiguously (numpy.ascontiguousarray), before apex reads it.
#pragma once

#include <apex/apex.hpp>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace apex::python {

namespace py = pybind11;

/// An array argument: a numpy array as it is, anything else numpy.asarray accepts (a list, a
/// scalar, an object with __array__) converted first.
class ArrayLike : public py::array {
 public:
  ArrayLike() = default;
  explicit ArrayLike(py::array a) : py::array(std::move(a)) {}
};

/// The storage type of an array.
enum class Dtype { kFloat32, kFloat64, kFloat16, kBfloat16 };

/// A type as a value, for dispatching on Dtype.
template <class T>
struct Tag {
  using type = T;
};

/// numpy's name of the dtype that holds T (bfloat16: uint16).
template <class T>
const char* numpy_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, double>) return "float64";
  if constexpr (std::is_same_v<T, Eigen::half>) return "float16";
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return "uint16";
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_same_v<T, std::int64_t>) return "int64";
}

/// numpy's type number of the dtype that holds T: compared and made without the dtype's name,
/// which costs a microsecond a call.
template <class T>
int numpy_num() {
  using api = py::detail::npy_api;
  constexpr int kHalf = 23;  // NPY_HALF, which pybind11 does not name
  if constexpr (std::is_same_v<T, float>) return api::NPY_FLOAT_;
  if constexpr (std::is_same_v<T, double>) return api::NPY_DOUBLE_;
  if constexpr (std::is_same_v<T, Eigen::half>) return kHalf;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return api::NPY_UINT16_;
  if constexpr (std::is_same_v<T, bool>) return api::NPY_BOOL_;
  if constexpr (std::is_same_v<T, std::int64_t>) return api::NPY_INT64_;
}

/// The type number of an array's dtype.
inline int num_of(const py::array& a) {
  return py::detail::array_descriptor_proxy(py::detail::array_proxy(a.ptr())->descr)->type_num;
}

/// The name of a storage type as the module's dtype arguments spell it.
inline const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::kFloat32:
      return "float32";
    case Dtype::kFloat64:
      return "float64";
    case Dtype::kFloat16:
      return "float16";
    case Dtype::kBfloat16:
      return "bfloat16";
  }
  return "?";
}

/// The numpy dtype's name of an array (for messages).
inline std::string dtype_of(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

/// The storage type of array `a` (argument `name` of `op`): its own float dtype, or bfloat16 when
/// `dtype` is "bfloat16" (then `a` must be uint16); another dtype argument must name `a`'s own.
/// Throws for any other dtype.
inline Dtype storage_of(const py::array& a, const std::optional<std::string>& dtype, const char* op,
                        const char* name) {
  const int num = num_of(a);
  if (dtype && *dtype == "bfloat16") {
    APEX_CHECK(num == numpy_num<Eigen::bfloat16>(),
               "[" << op << "] " << name << " dtype (" << dtype_of(a)
                   << ") must be uint16 holding bfloat16 bits for dtype='bfloat16' "
                      "(apex.to_bfloat16 converts)");
    return Dtype::kBfloat16;
  }
  Dtype d = Dtype::kFloat32;
  if (num == numpy_num<double>()) {
    d = Dtype::kFloat64;
  } else if (num == numpy_num<Eigen::half>()) {
    d = Dtype::kFloat16;
  } else {
    APEX_CHECK(num == numpy_num<float>(),
               "[" << op << "] " << name << " dtype (" << dtype_of(a)
                   << ") must be float32, float64, float16, or uint16 with dtype='bfloat16'");
  }
  APEX_CHECK(!dtype || *dtype == dtype_name(d), "[" << op << "] " << name << " dtype ("
                                                    << dtype_name(d) << ") does not match dtype='"
                                                    << *dtype << "'");
  return d;
}

/// Calls f(Tag<T>{}) with the storage type T of `d`.
template <class F>
decltype(auto) with_storage(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kFloat64:
      return f(Tag<double>{});
    case Dtype::kFloat16:
      return f(Tag<Eigen::half>{});
    case Dtype::kBfloat16:
      return f(Tag<Eigen::bfloat16>{});
    case Dtype::kFloat32:
      break;
  }
  return f(Tag<float>{});
}

/// Throws unless `a` holds T (numpy_name<T>()).
template <class T>
void check_dtype(const py::array& a, const char* op, const char* name, const char* expected_from) {
  APEX_CHECK(num_of(a) == numpy_num<T>(), "[" << op << "] " << name << " dtype (" << dtype_of(a)
                                              << ") must be " << numpy_name<T>() << ", "
                                              << expected_from);
}

/// numpy's function `name`, looked up once (the module lives as long as the interpreter).
/// Called with the GIL held; the objects are never destroyed, since the interpreter may be gone
/// when static destructors run.
inline const py::object& numpy_function(const char* name) {
  static auto* functions = new std::map<std::string, py::object>();
  auto found = functions->find(name);
  if (found == functions->end()) {
    found = functions->emplace(name, py::module_::import("numpy").attr(name)).first;
  }
  return found->second;
}

/// Whether apex can read `a` where it is: byte strides that are whole elements, and a last axis
/// whose elements are adjacent (or that has at most one).
inline bool readable_in_place(const py::array& a) {
  const auto item = a.itemsize();
  for (py::ssize_t axis = 0; axis < a.ndim(); ++axis) {
    if (a.strides(axis) % item != 0) return false;
  }
  const py::ssize_t last = a.ndim() - 1;
  return a.ndim() == 0 || a.shape(last) <= 1 || a.strides(last) == item;
}

/// `a` itself when apex can read it in place, else a contiguous copy of it.
inline py::array readable(const py::array& a) {
  if (readable_in_place(a)) return a;
  return numpy_function("ascontiguousarray")(a).cast<py::array>();
}

/// Throws unless `a` has a rank in [low, high].
inline void check_rank(const py::array& a, py::ssize_t low, py::ssize_t high, const char* op,
                       const char* name, const char* layout) {
  APEX_CHECK(a.ndim() >= low && a.ndim() <= high,
             "[" << op << "] " << name << " rank (" << a.ndim() << ") must be " << layout);
}

/// The stride of `axis` in elements.
inline Index element_stride(const py::array& a, py::ssize_t axis) {
  return static_cast<Index>(a.strides(axis) / a.itemsize());
}

/// An array read by apex: the array it reads (the argument or its copy, kept alive) and a view.
template <class T>
struct HeadsInput {
  py::array array;          ///< what the view points into
  HeadsView<const T> view;  ///< [B, H, S, D]
};

/// An array of rank 2 ([S, D]), 3 ([H, S, D]) or 4 ([B, H, S, D]) that apex can read in place
/// as the [B, H, S, D] view at `data` (T const or not).
template <class T>
HeadsView<T> heads_view_of(const py::array& r, T* data) {
  const py::ssize_t n = r.ndim();
  const auto extent = [&](py::ssize_t from_end) {
    return from_end <= n ? static_cast<Index>(r.shape(n - from_end)) : Index{1};
  };
  const auto stride = [&](py::ssize_t from_end) {
    return from_end <= n ? element_stride(r, n - from_end) : Index{0};
  };
  return HeadsView<T>(data, {extent(4), extent(3), extent(2), extent(1)},
                      {stride(4), stride(3), stride(2)});
}

/// `a` of rank 2 ([S, D]), 3 ([H, S, D]) or 4 ([B, H, S, D]) and dtype T as a [B, H, S, D] view,
/// in place when its layout allows.
template <class T>
HeadsInput<T> heads_input(const py::array& a, const char* op, const char* name) {
  check_rank(a, 2, 4, op, name, "2 ([S, D]), 3 ([H, S, D]) or 4 ([B, H, S, D])");
  HeadsInput<T> in{readable(a), {}};
  in.view = heads_view_of(in.array, static_cast<const T*>(in.array.data()));
  return in;
}

/// A token-major array [tokens, H, D] (FlashAttention's packed layout) of dtype T as the view
/// [1, H, tokens, D], in place when its layout allows.
template <class T>
HeadsInput<T> packed_input(const py::array& a, const char* op, const char* name) {
  check_rank(a, 3, 3, op, name, "3: [tokens, H, D]");
  HeadsInput<T> in{readable(a), {}};
  const py::array& r = in.array;
  in.view = HeadsView<const T>(static_cast<const T*>(r.data()),
                               {1, static_cast<Index>(r.shape(1)), static_cast<Index>(r.shape(0)),
                                static_cast<Index>(r.shape(2))},
                               {0, element_stride(r, 1), element_stride(r, 0)});
  return in;
}

/// A new C-contiguous array of T with the given shape.
template <class T>
py::array new_array(const std::vector<py::ssize_t>& shape) {
  return py::array(py::dtype(numpy_num<T>()), shape);
}

/// The data of an array apex writes.
template <class T>
T* mutable_data(py::array& a) {
  return static_cast<T*>(a.mutable_data());
}

/// The outputs of an attention call on q [..., S_q, d]: out of q's shape with d_v last, and lse
/// without the last axis when asked for.
template <class T>
struct Outputs {
  py::array out, lse;
  HeadsView<T> out_view, lse_view;

  py::object returned(bool with_lse) const {
    if (with_lse) return py::make_tuple(out, lse);
    return out;
  }
};

/// Outputs for heads-first q ([B, H, S, D] or fewer leading axes): out new, or the caller's
/// array `into` when given (of q's shape with d_v last and dtype T, writeable, whole-element
/// strides with a contiguous last axis: apex writes it in place); lse new.
template <class T>
Outputs<T> heads_outputs(const py::array& q, HeadsShape shape, Index d_v, bool with_lse,
                         const std::optional<py::array>& into = std::nullopt,
                         const char* op = "sdpa") {
  std::vector<py::ssize_t> dims(q.shape(), q.shape() + q.ndim());
  dims.back() = static_cast<py::ssize_t>(d_v);
  Outputs<T> r;
  shape.dim = d_v;
  if (into) {
    check_dtype<T>(*into, op, "out", "the dtype of q");
    APEX_CHECK(std::vector<py::ssize_t>(into->shape(), into->shape() + into->ndim()) == dims,
               "[" << op << "] out must have q's shape with d_v (" << d_v << ") last");
    APEX_CHECK(into->writeable() && readable_in_place(*into),
               "[" << op
                   << "] out must be writeable, with whole-element strides and a "
                      "contiguous last axis: apex writes it in place");
    r.out = *into;
    r.out_view = heads_view_of(r.out, mutable_data<T>(r.out));
  } else {
    r.out = new_array<T>(dims);
    r.out_view = HeadsView<T>::contiguous(mutable_data<T>(r.out), shape);
  }
  if (with_lse) {
    dims.pop_back();
    r.lse = new_array<T>(dims);
    shape.dim = 1;
    r.lse_view = HeadsView<T>::contiguous(mutable_data<T>(r.lse), shape);
  }
  return r;
}

/// Outputs for token-major q [total, H, d].
template <class T>
Outputs<T> packed_outputs(Index total, Index heads, Index d_v, bool with_lse) {
  Outputs<T> r;
  r.out = new_array<T>({total, heads, d_v});
  r.out_view = HeadsView<T>::token_major(mutable_data<T>(r.out), {1, heads, total, d_v});
  if (with_lse) {
    r.lse = new_array<T>({total, heads});
    r.lse_view = HeadsView<T>::token_major(mutable_data<T>(r.lse), {1, heads, total, 1});
  }
  return r;
}

/// A contiguous [rows, cols] view of a C-contiguous array whose last axis has `cols` elements.
template <class T>
Eigen::Map<const RowMatrix<T>> rows_of(const py::array& a, Index cols) {
  return {static_cast<const T*>(a.data()), cols == 0 ? 0 : static_cast<Index>(a.size()) / cols,
          cols};
}

/// `a` as a C-contiguous array of T: itself when it is one, else a converted copy.
template <class T>
py::array contiguous_as(const py::handle& a) {
  if (py::isinstance<py::array>(a)) {
    const auto array = py::reinterpret_borrow<py::array>(a);
    if (num_of(array) == numpy_num<T>() && (array.flags() & py::array::c_style) != 0) return array;
  }
  return numpy_function("ascontiguousarray")(a, py::dtype(numpy_num<T>()))
      .template cast<py::array>();
}

/// A new array of x's shape with `width` last, and the [rows, width] map apex writes it by.
template <class T>
std::pair<py::array, Eigen::Map<RowMatrix<T>>> rows_output(const py::array& x, Index rows,
                                                           Index width) {
  std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
  shape.back() = static_cast<py::ssize_t>(width);
  py::array out = new_array<T>(shape);
  return {out, Eigen::Map<RowMatrix<T>>(mutable_data<T>(out), rows, width)};
}

/// Integers (cu_seqlens, lengths) as apex's Index list.
inline std::vector<Index> index_list(const py::handle& values) {
  const py::array c = contiguous_as<std::int64_t>(values);
  const auto* p = static_cast<const std::int64_t*>(c.data());
  return {p, p + c.size()};
}

/// The registration of each source of the module.
void def_attention(py::module_& m);
void def_tables(py::module_& m);
void def_models(py::module_& m);
void def_paged(py::module_& m);

}  // namespace apex::python

namespace pybind11::detail {

/// Loads apex::python::ArrayLike: an ndarray as it is, another object through numpy.asarray
/// (an object numpy cannot convert does not match, and the call raises TypeError).
template <>
struct type_caster<apex::python::ArrayLike> {
  PYBIND11_TYPE_CASTER(apex::python::ArrayLike, const_name("numpy.ndarray"));

  bool load(handle src, bool convert) {
    if (npy_api::get().PyArray_Check_(src.ptr())) {
      value = apex::python::ArrayLike(reinterpret_borrow<array>(src));
      return true;
    }
    if (!convert || src.is_none()) return false;
    try {
      value = apex::python::ArrayLike(apex::python::numpy_function("asarray")(src).cast<array>());
      return true;
    } catch (const error_already_set&) {
      return false;
    }
  }
  static handle cast(const apex::python::ArrayLike& a, return_value_policy /*policy*/,
                     handle /*parent*/) {
    return a.inc_ref();
  }
};

}  // namespace pybind11::detail
