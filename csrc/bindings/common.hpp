// Shared helpers of the bindings layer: Python-int conversion with clear errors, the error classes, and a
// small owning handle for CPython's "fast sequence" protocol. Everything here needs the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace kvaddr::py_bindings {

namespace py = pybind11;

// Error classes shared with Python (created in register_errors, re-exported by mooncake_kvaddr.errors).
struct Errors {
    PyObject* chunk_alignment = nullptr;  // (ValueError, AssertionError): span not a multiple of hbs
    PyObject* block_len = nullptr;        // (ValueError, ZeroDivisionError): block_len empty, regions set
};
Errors& errors();

void register_errors(py::module_& m);
void register_addr(py::module_& m);
void register_keys(py::module_& m);
void register_staging(py::module_& m);

// Raise `type` with `message` as a C++ exception pybind11 turns back into that Python exception.
[[noreturn]] inline void raise(PyObject* type, const std::string& message) {
    PyErr_SetString(type, message.c_str());
    throw py::error_already_set();
}

inline std::string type_name(PyObject* obj) { return Py_TYPE(obj)->tp_name; }

// A Python int (or any object with __index__, e.g. numpy integers; bool too, as in the reference) as int64.
// TypeError for floats, strings, None...; OverflowError outside int64. `what` names the argument.
inline int64_t as_int64(PyObject* obj, const char* what) {
    if (!PyLong_Check(obj)) {
        if (!PyIndex_Check(obj)) {
            raise(PyExc_TypeError, std::string(what) + " must be an int, not " + type_name(obj));
        }
        py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
        if (!index) throw py::error_already_set();
        return as_int64(index.ptr(), what);
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) {
        raise(PyExc_OverflowError, std::string(what) + " does not fit in a signed 64-bit integer");
    }
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(value);
}

// Owning wrapper over PySequence_Fast: O(1) indexing for lists and tuples, one copy for other sequences.
class FastSequence {
public:
    FastSequence(PyObject* obj, const char* what) {
        seq_ = PySequence_Fast(obj, "");
        if (seq_ == nullptr) {
            PyErr_Clear();
            raise(PyExc_TypeError, std::string(what) + " must be a sequence, not " + type_name(obj));
        }
    }
    FastSequence(const FastSequence&) = delete;
    FastSequence& operator=(const FastSequence&) = delete;
    ~FastSequence() { Py_XDECREF(seq_); }

    Py_ssize_t size() const noexcept { return PySequence_Fast_GET_SIZE(seq_); }

    // New reference to item i. The size is re-checked on every access: converting an earlier item can run
    // Python code (__index__, a GC finalizer) that shrinks a list another thread still holds.
    py::object at(Py_ssize_t i) const {
        if (i >= size()) raise(PyExc_RuntimeError, "sequence changed size during the call");
        return py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(seq_, i));
    }

private:
    PyObject* seq_ = nullptr;
};

}  // namespace kvaddr::py_bindings
