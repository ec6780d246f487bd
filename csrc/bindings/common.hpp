// Shared helpers of the bindings layer: Python-int conversion with clear errors, the error classes, an owning
// handle for CPython's "fast sequence" protocol and owning buffer views. Everything here needs the GIL.
//
// The re-entrancy rule every binding follows (docs/errors.md, SECURITY.md): any call that can run Python code
// (__index__, __len__, __getitem__, __bool__, a buffer exporter, a GC pass that runs a __del__) may mutate
// or free whatever the caller passed, and may re-enter this module from this thread or let another thread in.
// So an item is always held by a strong reference while it is converted, a container's size is re-read after
// every conversion, and nothing native (a cache, a snapshot) is left half-updated across such a call.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace kvaddr::py_bindings {

namespace py = pybind11;

// Error classes shared with Python (created in register_errors, re-exported by mooncake_kvaddr.errors).
struct Errors {
    PyObject* chunk_alignment = nullptr;  // (ValueError, AssertionError): span not a multiple of hbs
    PyObject* block_len = nullptr;        // (ValueError, ZeroDivisionError): block_len empty, regions set
};
Errors& errors();

// One registration function per register_*.cpp, called by module.cpp.
void register_errors(py::module_& m);
void register_addr(py::module_& m);
void register_keys(py::module_& m);
void register_staging(py::module_& m);
void register_layout(py::module_& m);
void register_rows(py::module_& m);
void register_mooncake_client(py::module_& m);

// Raise `type` with `message` as a C++ exception pybind11 turns back into that Python exception.
[[noreturn]] inline void raise(PyObject* type, const std::string& message) {
    PyErr_SetString(type, message.c_str());
    throw py::error_already_set();
}

inline std::string type_name(PyObject* obj) { return Py_TYPE(obj)->tp_name; }

// str/bytes/bytearray iterate as characters or byte values, dict/set as keys: never a sequence of ints, of
// chunks or of rows, so refused (TypeError) wherever one is expected.
inline bool refused_container(PyObject* obj) {
    return PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj) || PyDict_Check(obj) ||
           PyAnySet_Check(obj);
}

// The int that `obj`, not an int itself, stands for through __index__ (numpy integers): TypeError naming
// `what` for floats, strings, None... The caller must own a reference to `obj`: __index__ runs Python code.
inline py::object index_of(PyObject* obj, const char* what) {
    if (!PyIndex_Check(obj)) {
        raise(PyExc_TypeError, std::string(what) + " must be an int, not " + type_name(obj));
    }
    py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
    if (!index) throw py::error_already_set();
    return index;
}

// A Python int (or any object with __index__, e.g. numpy integers; bool too, as in the reference) as int64.
// TypeError for floats, strings, None...; OverflowError outside int64 (both signs). `what` names the argument.
// The caller must own a reference to `obj`: __index__ runs Python code.
inline int64_t as_int64(PyObject* obj, const char* what) {
    if (!PyLong_Check(obj)) return as_int64(index_of(obj, what).ptr(), what);
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) {
        raise(PyExc_OverflowError, std::string(what) + " does not fit in a signed 64-bit integer");
    }
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(value);
}

// A non-negative int (or __index__ object) as a size in bytes or cells: as_int64, then ValueError below 0.
inline std::size_t as_size(PyObject* obj, const char* what) {
    const int64_t value = as_int64(obj, what);
    if (value < 0) raise(PyExc_ValueError, std::string(what) + " must be >= 0, got " + std::to_string(value));
    return static_cast<std::size_t>(value);
}

// The C++ object of a bound class C behind `self`. An instance made by C.__new__(C) (or a base's __new__)
// without __init__ has no constructed C: pybind11 would hand a method raw, uninitialised memory, so every
// method of our classes goes through this check (TypeError instead).
template <typename C>
C& constructed(py::handle self) {
    static py::detail::type_info* const info = py::detail::get_type_info(typeid(C));
    if (info == nullptr || !PyObject_TypeCheck(self.ptr(), info->type)) {
        raise(PyExc_TypeError, "this method needs a " + std::string(info ? info->type->tp_name : "bound") +
                                   " instance, not " + type_name(self.ptr()));
    }
    auto* inst = reinterpret_cast<py::detail::instance*>(self.ptr());
    py::detail::value_and_holder vh = inst->get_value_and_holder(info, false);
    if (!vh || !vh.holder_constructed() || vh.template value_ptr<C>() == nullptr) {
        raise(PyExc_TypeError, std::string(info->type->tp_name) +
                                   " object is not initialised (made by __new__ without __init__)");
    }
    return *vh.template value_ptr<C>();
}

// Method adapters for .def: the bound callable takes `self` as a handle and checks it with constructed<C>.
template <typename C, typename R, typename... A>
auto checked(R (C::*f)(A...)) {
    return [f](py::handle self, A... args) -> R { return (constructed<C>(self).*f)(std::forward<A>(args)...); };
}
template <typename C, typename R, typename... A>
auto checked(R (C::*f)(A...) const) {
    return [f](py::handle self, A... args) -> R { return (constructed<C>(self).*f)(std::forward<A>(args)...); };
}

// Owning wrapper over PySequence_Fast: O(1) indexing for lists and tuples, one copy for other iterables.
class FastSequence {
public:
    FastSequence(PyObject* obj, const char* what) {
        if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
            Py_INCREF(obj);
            seq_ = obj;
            return;
        }
        // PySequence_Fast by hand: it rewords every TypeError of the object's own __iter__ as its message.
        // Ours to word only when `obj` cannot be iterated at all; an exception of its own __iter__ or __next__
        // (a TypeError too) comes out unchanged.
        if (Py_TYPE(obj)->tp_iter == nullptr && !PySequence_Check(obj)) {
            raise(PyExc_TypeError, std::string(what) + " must be a sequence, not " + type_name(obj));
        }
        PyObject* it = PyObject_GetIter(obj);
        if (it == nullptr) throw py::error_already_set();
        seq_ = PySequence_List(it);
        Py_DECREF(it);
        if (seq_ == nullptr) throw py::error_already_set();
    }
    FastSequence(const FastSequence&) = delete;
    FastSequence& operator=(const FastSequence&) = delete;
    ~FastSequence() { Py_XDECREF(seq_); }

    Py_ssize_t size() const noexcept { return PySequence_Fast_GET_SIZE(seq_); }

    // New reference to item i. The size is re-checked on every access: converting an earlier item can run
    // Python code (__index__, a GC finalizer) that shrinks a list another thread still holds.
    py::object at(Py_ssize_t i) const {
        if (i < 0 || i >= size()) raise(PyExc_RuntimeError, "sequence changed size during the call");
        return py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(seq_, i));
    }

private:
    PyObject* seq_ = nullptr;
};

// Every item of `seq` as int64 (as_int64 naming `what`), appended to `out`. The length is read once: a callback
// (__index__) that grows the list is not followed, one that shrinks it makes seq.at raise.
inline void append_int64s(const FastSequence& seq, const char* what, std::vector<int64_t>* out) {
    const Py_ssize_t n = seq.size();
    out->reserve(out->size() + static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) out->push_back(as_int64(seq.at(i).ptr(), what));
}

// An owned buffer export, released by the destructor on every path (errors included): a bytearray stays
// resizable once the call returns or raises. Move-only.
//
// A C-contiguous buffer is read in place (and locked while held). A strided one (a memoryview slice with a
// step, a transposed array) is copied once, in logical C order: its bytes as bytes(obj) and obj.hex() read
// them, so a key built from it equals the reference's instead of raising BufferError.
class BufferView {
public:
    BufferView() = default;
    BufferView(const BufferView&) = delete;
    BufferView& operator=(const BufferView&) = delete;
    ~BufferView() { release(); }

    // Exports `obj` as bytes (any format: lengths count bytes); TypeError naming `what`.
    void acquire(PyObject* obj, const std::string& what) {
        release();
        if (PyUnicode_Check(obj) || !PyObject_CheckBuffer(obj)) {
            raise(PyExc_TypeError, what + " must be bytes-like, not " + type_name(obj));
        }
        if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS) == 0) {
            held_ = true;
            return;
        }
        // CPython's exporters refuse a contiguous request with BufferError, numpy's with ValueError; then a
        // strided request is made, and its own error (if any) is the one raised.
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError)) {
            throw py::error_already_set();
        }
        PyErr_Clear();
        Py_buffer strided{};
        if (PyObject_GetBuffer(obj, &strided, PyBUF_RECORDS_RO) != 0) throw py::error_already_set();
        if (strided.len > kMaxStridedCopy) {  // a broadcast view may claim far more bytes than exist
            const Py_ssize_t len = strided.len;
            PyBuffer_Release(&strided);
            raise(PyExc_BufferError, what + " is a non-contiguous buffer of " + std::to_string(len) +
                                         " bytes: only up to 256 MiB are copied (pass a contiguous buffer)");
        }
        copy_.resize(static_cast<std::size_t>(strided.len));
        const int rc = PyBuffer_ToContiguous(copy_.data(), &strided, strided.len, 'C');
        PyBuffer_Release(&strided);
        if (rc != 0) {
            copy_.clear();
            throw py::error_already_set();
        }
        copied_ = true;
    }
    void release() noexcept {
        if (held_) {
            held_ = false;
            PyBuffer_Release(&view_);
        }
        if (copied_) {
            copied_ = false;
            copy_.clear();
        }
    }
    const uint8_t* data() const noexcept {
        return copied_ ? copy_.data() : static_cast<const uint8_t*>(view_.buf);
    }
    std::size_t size() const noexcept { return copied_ ? copy_.size() : static_cast<std::size_t>(view_.len); }

private:
    static constexpr Py_ssize_t kMaxStridedCopy = Py_ssize_t{1} << 28;

    Py_buffer view_{};
    bool held_ = false;
    bool copied_ = false;
    std::vector<uint8_t> copy_;
};

// One exported C-contiguous Py_buffer with its format (the int64 array paths), released on every path.
class Export {
public:
    Export() = default;
    Export(const Export&) = delete;
    Export& operator=(const Export&) = delete;
    ~Export() {
        if (held_) PyBuffer_Release(&view_);
    }
    // Export `obj` as C-contiguous with its format; false (error cleared) if it does not support that.
    bool acquire(PyObject* obj) {
        if (PyUnicode_Check(obj) || PyBytes_Check(obj) || !PyObject_CheckBuffer(obj)) return false;
        if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
            PyErr_Clear();
            return false;
        }
        held_ = true;
        return true;
    }
    const Py_buffer& view() const noexcept { return view_; }

private:
    Py_buffer view_{};
    bool held_ = false;
};

// 0 = not a 64-bit integer buffer, 1 = int64, 2 = uint64.
inline int int64_kind(const Py_buffer& view) {
    if (view.itemsize != 8 || view.format == nullptr) return 0;
    const char* f = view.format;
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (std::strcmp(f, "q") == 0 || std::strcmp(f, "l") == 0) return 1;
    if (std::strcmp(f, "Q") == 0 || std::strcmp(f, "L") == 0) return 2;
    return 0;
}

// A flag argument the reference tests with `if flag`: its truth value, the caller's __bool__/__len__ exception
// unchanged (pybind11's bool caster would replace it with "incompatible function arguments").
inline bool as_flag(py::handle obj) {
    const int truth = PyObject_IsTrue(obj.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth == 1;
}

}  // namespace kvaddr::py_bindings
