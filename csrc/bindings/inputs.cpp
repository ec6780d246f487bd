// Input conversion of the address paths (inputs.hpp).
#include "bindings/inputs.hpp"

#include <pybind11/numpy.h>

#include <cstring>
#include <string>
#include <utility>

namespace kvaddr::py_bindings {

namespace {

// Items 0 and 1 of a chunk, each held by a strong reference before either is converted: converting the
// start may run __index__, which may empty the chunk's own list (the bounds stay alive through our refs).
// Exact tuples and lists of two or more items are read directly; anything else through c[0] and c[1], its
// own __getitem__ (a subclass, say a named tuple, may override it), as the reference reads it.
std::pair<py::object, py::object> first_two(PyObject* chunk) {
    if ((PyTuple_CheckExact(chunk) || PyList_CheckExact(chunk)) && PySequence_Fast_GET_SIZE(chunk) >= 2) {
        return {py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(chunk, 0)),
                py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(chunk, 1))};
    }
    py::object start = py::reinterpret_steal<py::object>(PySequence_GetItem(chunk, 0));
    if (!start) throw py::error_already_set();
    py::object end = py::reinterpret_steal<py::object>(PySequence_GetItem(chunk, 1));
    if (!end) throw py::error_already_set();
    return {std::move(start), std::move(end)};
}

void add_span(Py_ssize_t c, int64_t start, int64_t end, int64_t block_size, int64_t hash_block_size,
              ChunkSpans* out) {
    int64_t count = 0;
    switch (layout::check_span(start, end, hash_block_size, block_size, &count)) {
        case layout::SpanError::misaligned:
            raise(errors().chunk_alignment,
                  "chunk " + std::to_string(c) + " (" + std::to_string(start) + ", " + std::to_string(end) +
                      "): span " + std::to_string(end - start) + " is not a multiple of hash_block_size " +
                      std::to_string(hash_block_size));
        case layout::SpanError::overflow:
            raise(PyExc_OverflowError, "chunk " + std::to_string(c) + ": end - start overflows int64");
        case layout::SpanError::none:
            break;
    }
    out->starts.push_back(start);
    out->plans.push_back(layout::KeyPlan{0, count, 0});
}

}  // namespace

bool is_exact_ndarray(py::handle obj) {
    return Py_TYPE(obj.ptr()) == py::detail::npy_api::get().PyArray_Type_;
}

ChunkSpans parse_chunks(py::handle chunks, int64_t block_size, int64_t hash_block_size, bool allow_array) {
    ChunkSpans out;
    if (allow_array && is_exact_ndarray(chunks)) {
        auto arr = py::reinterpret_borrow<py::array>(chunks);
        const char kind = arr.dtype().kind();
        // uint64 is not converted by a cast (values near 2**64 would wrap): it goes through the int path below.
        const bool fits_int64 = kind == 'i' || (kind == 'u' && arr.itemsize() < 8);
        if (arr.ndim() == 2 && arr.shape(1) >= 2 && fits_int64) {
            auto view = py::array_t<int64_t, py::array::forcecast>::ensure(arr);
            if (!view) throw py::error_already_set();
            auto cells = view.unchecked<2>();
            const py::ssize_t n = cells.shape(0);
            out.starts.reserve(static_cast<std::size_t>(n));
            out.plans.reserve(static_cast<std::size_t>(n));
            for (py::ssize_t c = 0; c < n; ++c) add_span(c, cells(c, 0), cells(c, 1), block_size, hash_block_size, &out);
            return out;
        }
    }
    return parse_chunk_items(*chunk_sequence(chunks), block_size, hash_block_size);
}

std::unique_ptr<FastSequence> chunk_sequence(py::handle chunks) {
    if (refused_container(chunks.ptr())) {
        raise(PyExc_TypeError, "chunks must be a sequence of (start, end) pairs, not " + type_name(chunks.ptr()));
    }
    return std::make_unique<FastSequence>(chunks.ptr(), "chunks");
}

ChunkSpans parse_chunk_items(const FastSequence& seq, int64_t block_size, int64_t hash_block_size) {
    ChunkSpans out;
    const Py_ssize_t n = seq.size();  // fixed: a list a callback shrinks raises, one it grows is not followed
    out.starts.reserve(static_cast<std::size_t>(n));
    out.plans.reserve(static_cast<std::size_t>(n));
    for (Py_ssize_t c = 0; c < n; ++c) {
        py::object chunk = seq.at(c);
        // Both bounds of the chunk (any (start, end, ...) sequence but a refused_container).
        const std::string what = "chunk " + std::to_string(c);
        if (refused_container(chunk.ptr())) {  // never an exact tuple or list
            raise(PyExc_TypeError, what + " must be a (start, end) sequence, not " + type_name(chunk.ptr()));
        }
        const auto [start, end] = first_two(chunk.ptr());
        const int64_t s = as_int64(start.ptr(), (what + " start").c_str());
        const int64_t e = as_int64(end.ptr(), (what + " end").c_str());
        add_span(c, s, e, block_size, hash_block_size, &out);
    }
    return out;
}

BlockIdSource::BlockIdSource(py::handle obj) : obj_(py::reinterpret_borrow<py::object>(obj)) {
    PyObject* o = obj.ptr();
    // Exact lists and tuples are read directly; a subclass is a generic sequence, read by index through its
    // own __getitem__ as the reference's block_ids[i] does (an override must not be bypassed).
    if (PyList_CheckExact(o)) {
        kind_ = Kind::list;
        return;
    }
    if (PyTuple_CheckExact(o)) {
        kind_ = Kind::tuple;
        length_ = PyTuple_GET_SIZE(o);
        return;
    }
    if (is_exact_ndarray(obj)) {
        auto arr = py::reinterpret_borrow<py::array>(obj);
        const char kind = arr.dtype().kind();
        if ((kind == 'i' || kind == 'u') && !arr.dtype().attr("isnative").cast<bool>()) {
            // Items are read below as native-endian integers: a byte-swapped array (dtype '>i8' on this
            // machine) is converted to the same type in native order first (numpy's C code, no user code), and
            // that copy is what we hold and read.
            py::object copy = arr.attr("astype")(arr.dtype().attr("newbyteorder")("="));
            if (!is_exact_ndarray(copy)) raise(PyExc_TypeError, "block_ids: a byte-swapped array did not convert");
            arr = py::reinterpret_borrow<py::array>(copy);
            obj_ = arr;
        }
        if (kind != 'i' && kind != 'u') {
            raise(PyExc_TypeError, "block_ids must hold integers, not numpy dtype " +
                                       py::str(arr.dtype()).cast<std::string>());
        }
        if (arr.ndim() != 1) {
            raise(PyExc_TypeError, "block_ids must be a 1-D array, got " + std::to_string(arr.ndim()) + " dimensions");
        }
        kind_ = Kind::array;
        length_ = static_cast<Py_ssize_t>(arr.shape(0));
        data_ = static_cast<const char*>(arr.data());
        stride_ = static_cast<Py_ssize_t>(arr.strides(0));
        dtype_kind_ = kind;
        itemsize_ = static_cast<Py_ssize_t>(arr.itemsize());
        if (itemsize_ != 1 && itemsize_ != 2 && itemsize_ != 4 && itemsize_ != 8) {
            raise(PyExc_TypeError, "block_ids has an unsupported integer size of " + std::to_string(itemsize_));
        }
        return;
    }
    require_int_sequence(obj, "block_ids");
    kind_ = Kind::sequence;
    length_ = PyObject_Length(o);  // user code: its exceptions propagate unchanged
    if (length_ < 0) throw py::error_already_set();
}

Py_ssize_t BlockIdSource::size() const {
    return kind_ == Kind::list ? PyList_GET_SIZE(obj_.ptr()) : length_;
}

int64_t BlockIdSource::at(Py_ssize_t index, py::object* object) const {
    if (index < 0 || index >= size()) {
        // Only reachable when a callback shrank a list after the index was checked.
        raise(PyExc_RuntimeError, "block_ids changed size during the call");
    }
    py::object item;
    switch (kind_) {
        case Kind::list:
            item = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(obj_.ptr(), index));
            break;
        case Kind::tuple:
            item = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(obj_.ptr(), index));
            break;
        case Kind::array: {
            const char* p = data_ + index * stride_;
            if (dtype_kind_ == 'i') {
                switch (itemsize_) {
                    case 1: return *reinterpret_cast<const int8_t*>(p);
                    case 2: { int16_t v; std::memcpy(&v, p, 2); return v; }
                    case 4: { int32_t v; std::memcpy(&v, p, 4); return v; }
                    default: { int64_t v; std::memcpy(&v, p, 8); return v; }
                }
            }
            uint64_t v = 0;
            switch (itemsize_) {
                case 1: v = *reinterpret_cast<const uint8_t*>(p); break;
                case 2: { uint16_t w; std::memcpy(&w, p, 2); v = w; break; }
                case 4: { uint32_t w; std::memcpy(&w, p, 4); v = w; break; }
                default: std::memcpy(&v, p, 8); break;
            }
            if (v > static_cast<uint64_t>(INT64_MAX)) {
                raise(PyExc_OverflowError, "block id does not fit in a signed 64-bit integer");
            }
            return static_cast<int64_t>(v);
        }
        case Kind::sequence: {
            item = py::reinterpret_steal<py::object>(PySequence_GetItem(obj_.ptr(), index));
            if (!item) {
                if (PyErr_ExceptionMatches(PyExc_IndexError)) {
                    PyErr_Clear();
                    raise(PyExc_ValueError, "block_ids reported " + std::to_string(length_) +
                                                " items (__len__) but block_ids[" + std::to_string(index) +
                                                "] raised IndexError: its __len__ does not match its items");
                }
                throw py::error_already_set();
            }
            break;
        }
    }
    const int64_t id = as_int64(item.ptr(), "block id");
    if (PyLong_CheckExact(item.ptr())) *object = std::move(item);
    return id;
}

void resolve_block_ids(const BlockIdSource& ids, const std::vector<int64_t>& starts, int64_t block_size,
                       std::vector<layout::KeyPlan>* plans, std::vector<py::object>* id_objects) {
    id_objects->resize(starts.size());
    for (std::size_t c = 0; c < starts.size(); ++c) {
        const Py_ssize_t available = ids.size();
        const int64_t block_index = floor_div(starts[c], block_size);
        const int64_t index = block_index < 0 ? block_index + available : block_index;
        if (index < 0 || index >= available) {
            raise(PyExc_IndexError, "chunk " + std::to_string(c) + " starts at token " + std::to_string(starts[c]) +
                                        ": block index " + std::to_string(block_index) + " is out of range for " +
                                        std::to_string(available) + " block ids");
        }
        (*plans)[c].block_id = ids.at(static_cast<Py_ssize_t>(index), &(*id_objects)[c]);
    }
}

// vLLM 0.33's store layouts (LayoutEngine): lists, tuples and integer arrays.

// Only lists, tuples and integer arrays (an ndarray subclass is read through its own methods, see
// is_exact_ndarray): a dict, set or str is a caller bug, not a sequence of ids.
void require_id_container(PyObject* obj, const char* what) {
    if (PyList_Check(obj) || PyTuple_Check(obj) || py::isinstance<py::array>(obj)) return;
    raise(PyExc_TypeError, std::string(what) + " must be a list, tuple or 1-D integer array, not " + type_name(obj));
}

// An integer ndarray of 1 dimension as int64 values (uint64 beyond int64 → OverflowError); empty optional
// when `obj` is not an ndarray. TypeError for other dtypes or shapes.
bool int64_array_values(py::handle obj, const char* what, std::vector<int64_t>* out) {
    if (!is_exact_ndarray(obj)) return false;
    py::array arr = py::reinterpret_borrow<py::array>(obj);
    const char kind = arr.dtype().kind();
    if (arr.ndim() != 1 || (kind != 'i' && kind != 'u')) {
        raise(PyExc_TypeError, std::string(what) + " must be a 1-D integer array");
    }
    const auto n = static_cast<std::size_t>(arr.shape(0));
    out->resize(n);
    if (kind == 'u' && arr.itemsize() == 8) {
        auto view = py::array_t<uint64_t, py::array::forcecast>::ensure(arr);
        if (!view) throw py::error_already_set();
        auto cells = view.unchecked<1>();
        for (std::size_t i = 0; i < n; ++i) {
            const uint64_t v = cells(static_cast<py::ssize_t>(i));
            if (v > static_cast<uint64_t>(INT64_MAX)) {
                raise(PyExc_OverflowError, std::string(what) + " item does not fit in a signed 64-bit integer");
            }
            (*out)[i] = static_cast<int64_t>(v);
        }
        return true;
    }
    auto view = py::array_t<int64_t, py::array::forcecast>::ensure(arr);
    if (!view) throw py::error_already_set();
    auto cells = view.unchecked<1>();
    for (std::size_t i = 0; i < n; ++i) (*out)[i] = cells(static_cast<py::ssize_t>(i));
    return true;
}

// All items of a list/tuple/integer array as int64 (TypeError for other containers and non-int items).
std::vector<int64_t> int64_values(py::handle obj, const char* what) {
    std::vector<int64_t> values;
    if (int64_array_values(obj, what, &values)) return values;
    require_id_container(obj.ptr(), what);
    // The length is read once (append_int64s): the same rule everywhere below.
    append_int64s(FastSequence(obj.ptr(), what), what, &values);
    return values;
}

// (start, end) of every chunk: a list/tuple of tuples/lists (only items 0 and 1 are read, as vLLM does), or
// an (n, 2) integer array. `exact_pairs` (vLLM 0.34's TP-shared rule, which unpacks each chunk) refuses a
// chunk of more than two items, or an array of more than two columns, with ValueError.
void chunk_pairs(py::handle chunks, std::vector<int64_t>* starts, std::vector<int64_t>* ends, bool exact_pairs) {
    if (is_exact_ndarray(chunks)) {
        py::array arr = py::reinterpret_borrow<py::array>(chunks);
        const char kind = arr.dtype().kind();
        if (arr.ndim() != 2 || arr.shape(1) < 2 || !(kind == 'i' || (kind == 'u' && arr.itemsize() < 8))) {
            raise(PyExc_TypeError, "chunks must be an (n, 2) signed integer array");
        }
        if (exact_pairs && arr.shape(1) != 2) raise(PyExc_ValueError, "chunks must be an (n, 2) array");
        auto view = py::array_t<int64_t, py::array::forcecast>::ensure(arr);
        if (!view) throw py::error_already_set();
        auto cells = view.unchecked<2>();
        for (py::ssize_t c = 0; c < cells.shape(0); ++c) {
            starts->push_back(cells(c, 0));
            ends->push_back(cells(c, 1));
        }
        return;
    }
    require_id_container(chunks.ptr(), "chunks");
    FastSequence seq(chunks.ptr(), "chunks");
    const Py_ssize_t n = seq.size();  // as vLLM's np.fromiter(count=len(chunks)): growth is not followed
    for (Py_ssize_t c = 0; c < n; ++c) {
        py::object chunk = seq.at(c);
        PyObject* p = chunk.ptr();
        if (!(PyTuple_Check(p) || PyList_Check(p))) {
            raise(PyExc_TypeError, "chunk " + std::to_string(c) + " must be a (start, end) tuple, not " + type_name(p));
        }
        if (exact_pairs) {
            const Py_ssize_t items = PySequence_Size(p);
            if (items < 0) throw py::error_already_set();
            if (items > 2) raise(PyExc_ValueError, "chunk " + std::to_string(c) + " has more than (start, end)");
        }
        if ((PyTuple_CheckExact(p) || PyList_CheckExact(p)) && PySequence_Fast_GET_SIZE(p) < 2) {
            raise(PyExc_TypeError, "chunk " + std::to_string(c) + " must be a (start, end) tuple");
        }
        // Both items held (first_two): converting the first can run __index__, which may shrink a list chunk.
        const auto [start, end] = first_two(p);
        starts->push_back(as_int64(start.ptr(), "chunk start"));
        ends->push_back(as_int64(end.ptr(), "chunk end"));
    }
}

// Python list indexing of `ids` at `index` (negative wraps; IndexError outside).
int64_t python_index(int64_t index, std::size_t available, std::size_t key) {
    const auto n = static_cast<int64_t>(available);
    const int64_t at = index < 0 ? index + n : index;
    if (at < 0 || at >= n) {
        raise(PyExc_IndexError, "key " + std::to_string(key) + ": block index " + std::to_string(index) +
                                    " is out of range for " + std::to_string(available) + " block ids");
    }
    return at;
}

FastSequence checked_sequence(py::handle obj, const char* what) {
    if (refused_container(obj.ptr())) {
        raise(PyExc_TypeError, std::string(what) + " must be a sequence, not " + type_name(obj.ptr()));
    }
    return FastSequence(obj.ptr(), what);
}

void require_int_sequence(py::handle obj, const char* what) {
    // An iterator or generator would be consumed by its first read and read as empty by every later one.
    if (refused_container(obj.ptr()) || !PySequence_Check(obj.ptr())) {
        raise(PyExc_TypeError, std::string(what) + " must be a sequence of ints (list, tuple or integer array), not " +
                                   type_name(obj.ptr()));
    }
}

}  // namespace kvaddr::py_bindings
