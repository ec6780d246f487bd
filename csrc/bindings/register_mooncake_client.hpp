// Registration of the native Mooncake client binding (register_mooncake_client.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace kvaddr::py_bindings {

void register_mooncake_client(pybind11::module_& m);

}  // namespace kvaddr::py_bindings
