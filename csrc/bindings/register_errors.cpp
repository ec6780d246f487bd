// Error classes that keep drop-in compatibility with the reference's exception types while being precise.
#include "bindings/common.hpp"

namespace kvaddr::py_bindings {

Errors& errors() {
    static Errors instance;
    return instance;
}

namespace {

PyObject* make_error(py::module_& m, const char* name, PyObject* base1, PyObject* base2, const char* doc) {
    py::tuple bases = py::make_tuple(py::handle(base1), py::handle(base2));
    const std::string qualified = std::string("mooncake_kvaddr._native.") + name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
    if (cls == nullptr) throw py::error_already_set();
    // The module attribute keeps the class alive for the life of the interpreter.
    m.attr(name) = py::reinterpret_steal<py::object>(cls);
    return cls;
}

}  // namespace

void register_errors(py::module_& m) {
    Errors& e = errors();
    e.chunk_alignment = make_error(
        m, "ChunkAlignmentError", PyExc_ValueError, PyExc_AssertionError,
        "A chunk's span (end - start) is not a multiple of hash_block_size. Derives from AssertionError "
        "because the reference asserts.");
    e.block_len = make_error(
        m, "BlockLenError", PyExc_ValueError, PyExc_ZeroDivisionError,
        "block_len is empty while KV-cache regions are registered. Derives from ZeroDivisionError because "
        "the reference divides by len(block_len).");
}

}  // namespace kvaddr::py_bindings
