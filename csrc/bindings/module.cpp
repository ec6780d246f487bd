// The _native extension module: one registration function per concern (see register_*.cpp).
#include <pybind11/pybind11.h>

#include "bindings/common.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() = "Native kernels of mooncake_kvaddr (address matrix, keys, lookup). Use the mooncake_kvaddr "
              "package, not this module, directly.";
    kvaddr::py_bindings::register_errors(m);
    kvaddr::py_bindings::register_addr(m);
    kvaddr::py_bindings::register_keys(m);
    kvaddr::py_bindings::register_staging(m);
    kvaddr::py_bindings::register_layout(m);
    kvaddr::py_bindings::register_rows(m);
    kvaddr::py_bindings::register_mooncake_client(m);
}
