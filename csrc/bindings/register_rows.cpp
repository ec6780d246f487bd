// Binding that turns Mooncake multi-buffer arguments (lists of per-key address and size rows, as vLLM's
// worker passes them) into the int64 matrices the staging kernels take (docs/vllm-plugin.md, "Staged
// transport"). One pass with the GIL held, no numpy per-element conversion.
//
// Safety: the rows are read through int_rows.hpp's snapshot (every row fixed before any item is converted).
// Rows shorter than the widest one are padded with (address 0, size 0): empty slices, which the staging
// kernels neither read nor write.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bindings/common.hpp"
#include "bindings/int_rows.hpp"

namespace kvaddr::py_bindings {

namespace {

py::tuple multi_buffer_arrays(py::handle addr_rows, py::handle size_rows) {
    // Outer snapshots first, then every row: all fixed before any conversion runs Python code.
    IntRows addr(addr_rows, "addresses");
    IntRows size(size_rows, "sizes");
    const auto keys = static_cast<Py_ssize_t>(addr.size());
    if (size.size() != addr.size()) {
        raise(PyExc_ValueError, "addresses and sizes must have one row per key (" + std::to_string(keys) + " vs " +
                                    std::to_string(size.size()) + ")");
    }
    Py_ssize_t width = 0;
    for (std::size_t k = 0; k < addr.size(); ++k) {
        const std::size_t n = addr.snapshot(k);
        if (size.snapshot(k) != n) {
            raise(PyExc_ValueError, "key " + std::to_string(k) + ": " + std::to_string(n) + " addresses but " +
                                        std::to_string(size.width(k)) + " sizes");
        }
        width = std::max(width, static_cast<Py_ssize_t>(n));
    }
    // keys * width cells; both are Py_ssize_t counts of existing objects, so the product of the row lengths
    // fits (each row's items exist in memory), but check anyway.
    if (width > 0 && keys > PY_SSIZE_T_MAX / width) raise(PyExc_OverflowError, "address matrix too large");
    py::array_t<int64_t> addrs({keys, width});
    py::array_t<int64_t> sizes({keys, width});
    // Zero-filled first: short rows are padded with (address 0, size 0). The arrays are owned here and never
    // exposed before return, so one pointer each is stable.
    int64_t* a = addrs.mutable_data();
    int64_t* s = sizes.mutable_data();
    std::fill(a, a + keys * width, 0);
    std::fill(s, s + keys * width, 0);
    for (std::size_t k = 0; k < addr.size(); ++k) {
        int64_t* arow = a + static_cast<Py_ssize_t>(k) * width;
        int64_t* srow = s + static_cast<Py_ssize_t>(k) * width;
        for (std::size_t r = 0; r < addr.width(k); ++r) {
            arow[r] = addr.at(k, r, "address");
            srow[r] = size.at(k, r, "size");
            if (srow[r] < 0) {
                raise(PyExc_ValueError, "key " + std::to_string(k) + " region " + std::to_string(r) +
                                            ": negative size " + std::to_string(srow[r]));
            }
        }
    }
    return py::make_tuple(std::move(addrs), std::move(sizes));
}

}  // namespace

void register_rows(py::module_& m) {
    m.def("multi_buffer_arrays", &multi_buffer_arrays, py::arg("addr_rows"), py::arg("size_rows"),
          "(keys x width) int64 address and size matrices of Mooncake multi-buffer rows, short rows padded "
          "with empty slices; TypeError/OverflowError/ValueError for non-int, out-of-int64, negative sizes or "
          "mismatched rows.");
}

}  // namespace kvaddr::py_bindings
