// Binding that turns Mooncake multi-buffer arguments (lists of per-key address and size rows, as vLLM's
// worker passes them) into the int64 matrices the staging kernels take (docs/vllm-plugin.md, "Staged
// transport"). One pass with the GIL held, no numpy per-element conversion.
//
// Safety: every row is snapshotted into a tuple (PySequence_Tuple: a tuple is returned as is, a list is
// copied) and held by a strong reference before any item is converted, so an item's __index__ that mutates
// the caller's list cannot invalidate what is read. Rows shorter than the widest one are padded with
// (address 0, size 0): empty slices, which the staging kernels neither read nor write.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings/common.hpp"

namespace kvaddr::py_bindings {

void register_rows(py::module_& m);

namespace {

// Snapshot of one row: a strong reference to a tuple of its items.
py::tuple row_snapshot(PyObject* row, const char* what, Py_ssize_t key) {
    // str/bytes/bytearray iterate as characters or byte values, dict/set as keys: never rows of ints.
    if (PyUnicode_Check(row) || PyBytes_Check(row) || PyByteArray_Check(row) || PyDict_Check(row) ||
        PyAnySet_Check(row)) {
        raise(PyExc_TypeError, std::string(what) + (key < 0 ? std::string(" rows") : " row " + std::to_string(key)) +
                                   " must be a sequence of ints, not " + type_name(row));
    }
    PyObject* tuple = PySequence_Tuple(row);
    if (tuple == nullptr) {
        // Only "not iterable" is ours to word; an exception raised by the caller's own __iter__/__next__ comes
        // out unchanged.
        if (!PyErr_ExceptionMatches(PyExc_TypeError) || Py_TYPE(row)->tp_iter != nullptr || PySequence_Check(row)) {
            throw py::error_already_set();
        }
        PyErr_Clear();
        raise(PyExc_TypeError, std::string(what) + (key < 0 ? std::string(" rows") : " row " + std::to_string(key)) +
                                   " must be a sequence of ints, not " + type_name(row));
    }
    return py::reinterpret_steal<py::tuple>(tuple);
}

py::tuple multi_buffer_arrays(py::handle addr_rows, py::handle size_rows) {
    // Outer snapshots first: the per-key rows are fixed before any conversion runs Python code.
    py::tuple addr_outer = row_snapshot(addr_rows.ptr(), "addresses", -1);
    py::tuple size_outer = row_snapshot(size_rows.ptr(), "sizes", -1);
    const Py_ssize_t keys = PyTuple_GET_SIZE(addr_outer.ptr());
    if (PyTuple_GET_SIZE(size_outer.ptr()) != keys) {
        raise(PyExc_ValueError, "addresses and sizes must have one row per key (" + std::to_string(keys) + " vs " +
                                    std::to_string(PyTuple_GET_SIZE(size_outer.ptr())) + ")");
    }
    std::vector<py::tuple> addr_snap;
    std::vector<py::tuple> size_snap;
    addr_snap.reserve(static_cast<std::size_t>(keys));
    size_snap.reserve(static_cast<std::size_t>(keys));
    Py_ssize_t width = 0;
    for (Py_ssize_t k = 0; k < keys; ++k) {
        addr_snap.push_back(row_snapshot(PyTuple_GET_ITEM(addr_outer.ptr(), k), "addresses", k));
        size_snap.push_back(row_snapshot(PyTuple_GET_ITEM(size_outer.ptr(), k), "sizes", k));
        const Py_ssize_t n = PyTuple_GET_SIZE(addr_snap.back().ptr());
        if (PyTuple_GET_SIZE(size_snap.back().ptr()) != n) {
            raise(PyExc_ValueError, "key " + std::to_string(k) + ": " + std::to_string(n) + " addresses but " +
                                        std::to_string(PyTuple_GET_SIZE(size_snap.back().ptr())) + " sizes");
        }
        if (n > width) width = n;
    }
    // keys * width cells; both are Py_ssize_t counts of existing objects, so the product of the row lengths
    // fits (each row's items exist in memory), but check anyway.
    if (width > 0 && keys > PY_SSIZE_T_MAX / width) raise(PyExc_OverflowError, "address matrix too large");
    py::array_t<int64_t> addrs({static_cast<py::ssize_t>(keys), static_cast<py::ssize_t>(width)});
    py::array_t<int64_t> sizes({static_cast<py::ssize_t>(keys), static_cast<py::ssize_t>(width)});
    // Fill through raw pointers re-fetched after every conversion would be needed only if the arrays could
    // move; they are owned here and never exposed before return, so one pointer each is stable.
    int64_t* a = addrs.mutable_data();
    int64_t* s = sizes.mutable_data();
    for (Py_ssize_t k = 0; k < keys; ++k) {
        PyObject* arow = addr_snap[static_cast<std::size_t>(k)].ptr();
        PyObject* srow = size_snap[static_cast<std::size_t>(k)].ptr();
        const Py_ssize_t n = PyTuple_GET_SIZE(arow);
        int64_t* arow_out = a + k * width;
        int64_t* srow_out = s + k * width;
        for (Py_ssize_t r = 0; r < n; ++r) {
            arow_out[r] = as_int64(PyTuple_GET_ITEM(arow, r), "address");
            const int64_t size = as_int64(PyTuple_GET_ITEM(srow, r), "size");
            if (size < 0) {
                raise(PyExc_ValueError, "key " + std::to_string(k) + " region " + std::to_string(r) +
                                            ": negative size " + std::to_string(size));
            }
            srow_out[r] = size;
        }
        for (Py_ssize_t r = n; r < width; ++r) {
            arow_out[r] = 0;
            srow_out[r] = 0;
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
