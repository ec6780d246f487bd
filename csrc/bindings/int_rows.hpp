// Rows of ints -> int64: the one converter of per-key address/size rows given as Python sequences (the staged
// transport's multi_buffer_arrays in register_rows.cpp, the native client's multi-buffer calls in
// client_inputs.hpp). Each caller keeps its own rules on the values (padding, refusals); the snapshot and the
// int rule are this file's. Needs the GIL.
//
// Snapshot: the outer sequence and every row are fixed (a row copied into a tuple held here, or a 1-D int64
// buffer copied as values) before any item is converted, so an item's __index__ that mutates the caller's
// lists cannot change what is read (the re-entrancy rule in common.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bindings/common.hpp"

namespace kvaddr::py_bindings {

class IntRows {
public:
    // Snapshot of the outer sequence only (rows are snapshotted by snapshot(k)); `what` names the argument in
    // errors ("<what> rows must be a sequence of ints", "<what> row 3 ...").
    IntRows(py::handle rows, const char* what) : what_(what), outer_(tuple_of(rows.ptr(), what, -1)) {
        rows_.resize(static_cast<std::size_t>(PyTuple_GET_SIZE(outer_.ptr())));
    }

    std::size_t size() const noexcept { return rows_.size(); }

    // Fix row k (before any row is converted); returns its length.
    std::size_t snapshot(std::size_t k) {
        Row& row = rows_[k];
        PyObject* obj = PyTuple_GET_ITEM(outer_.ptr(), static_cast<Py_ssize_t>(k));
        Export view;
        if (!refused_container(obj) && view.acquire(obj) && view.view().ndim == 1 && int64_kind(view.view()) == 1) {
            const auto* data = static_cast<const int64_t*>(view.view().buf);
            row.values.assign(data, data + view.view().shape[0]);
            row.copied = true;
        } else {
            row.items = tuple_of(obj, what_, static_cast<Py_ssize_t>(k));
        }
        return width(k);
    }

    // Length of snapshotted row k.
    std::size_t width(std::size_t k) const noexcept {
        const Row& row = rows_[k];
        return row.copied ? row.values.size() : static_cast<std::size_t>(PyTuple_GET_SIZE(row.items.ptr()));
    }

    // Item j of snapshotted row k as int64: TypeError/OverflowError (as_int64) naming `item`.
    int64_t at(std::size_t k, std::size_t j, const char* item) const {
        const Row& row = rows_[k];
        return row.copied ? row.values[j] : as_int64(PyTuple_GET_ITEM(row.items.ptr(), static_cast<Py_ssize_t>(j)), item);
    }

    // All of row k, in order.
    std::vector<int64_t> values(std::size_t k, const char* item) const {
        if (rows_[k].copied) return rows_[k].values;
        std::vector<int64_t> out(width(k));
        for (std::size_t j = 0; j < out.size(); ++j) out[j] = at(k, j, item);
        return out;
    }

private:
    struct Row {
        py::tuple items;              // the row's items, held (not copied)
        std::vector<int64_t> values;  // or its values, copied from a 1-D int64 buffer
        bool copied = false;
    };

    // A strong reference to a tuple of `obj`'s items (a tuple as is, anything iterable copied).
    static py::tuple tuple_of(PyObject* obj, const char* what, Py_ssize_t key) {
        const auto refuse = [&] {
            raise(PyExc_TypeError, std::string(what) + (key < 0 ? std::string(" rows") : " row " + std::to_string(key)) +
                                       " must be a sequence of ints, not " + type_name(obj));
        };
        if (refused_container(obj)) refuse();
        PyObject* tuple = PySequence_Tuple(obj);
        if (tuple == nullptr) {
            // Only "not iterable" is ours to word; an exception raised by the caller's own __iter__/__next__
            // comes out unchanged.
            if (!PyErr_ExceptionMatches(PyExc_TypeError) || Py_TYPE(obj)->tp_iter != nullptr || PySequence_Check(obj)) {
                throw py::error_already_set();
            }
            PyErr_Clear();
            refuse();
        }
        return py::reinterpret_steal<py::tuple>(tuple);
    }

    const char* what_;
    py::tuple outer_;
    std::vector<Row> rows_;
};

}  // namespace kvaddr::py_bindings
