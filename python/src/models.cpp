// SPDX-License-Identifier: MIT
// The caches, the layers and the stack on numpy arrays.
#include "arrays.hpp"

namespace apex::python {

void def_models(py::module_& m) { (void)m; }

}  // namespace apex::python
