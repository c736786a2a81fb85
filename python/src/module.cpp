// SPDX-License-Identifier: MIT
// The extension apex._core: apex's operations on numpy arrays. The package python/apex/
// re-exports it as `import apex`.
#include "arrays.hpp"

#include <sstream>

PYBIND11_MODULE(_core, m) {
  m.doc() = "apex, the APEX-1 attention math library, on numpy arrays";
  std::ostringstream version;
  version << APEX_VERSION_MAJOR << '.' << APEX_VERSION_MINOR << '.' << APEX_VERSION_PATCH;
  m.attr("__version__") = version.str();
  apex::python::def_attention(m);
  apex::python::def_tables(m);
  apex::python::def_models(m);
  apex::python::def_paged(m);
}
