// Input conversion of the address paths: every Python argument becomes C++ values here, before any cache or
// snapshot is touched (the re-entrancy rule in common.hpp). Needs the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/common.hpp"
#include "kvaddr/layout.hpp"

namespace kvaddr::py_bindings {

// The (start, end) spans of the chunks, validated like the reference (ChunkAlignmentError for a span that is
// not a multiple of hash_block_size), with their block counts. `chunks` is any iterable of (start, end, ...)
// items, or (array output) an (n, >=2) integer ndarray.
struct ChunkSpans {
    std::vector<int64_t> starts;
    std::vector<layout::KeyPlan> plans;  // block_id filled later by resolve_block_ids
};
ChunkSpans parse_chunks(py::handle chunks, int64_t block_size, int64_t hash_block_size, bool allow_array);
// The same over an already materialised sequence of chunk items.
ChunkSpans parse_chunk_items(const FastSequence& items, int64_t block_size, int64_t hash_block_size);
// `chunks` as a FastSequence (TypeError for dict, set, str, bytes and non-iterables).
std::unique_ptr<FastSequence> chunk_sequence(py::handle chunks);

// The block ids of a request: a list, a tuple, a 1-D integer ndarray or another sequence with __len__ and
// __getitem__ (read by index, like the reference; an ndarray subclass is such a sequence). dict, set, str, bytes and bytearray are refused with
// TypeError. Only the entries a call needs are read. Holds a strong reference to the container.
class BlockIdSource {
public:
    explicit BlockIdSource(py::handle obj);

    // The container's length (re-read for lists, whose length a callback may change).
    Py_ssize_t size() const;

    // block_ids[index] for 0 <= index < size() as int64; `object` receives the item when it is an exact int
    // (reused in the output without allocating), else stays empty.
    int64_t at(Py_ssize_t index, py::object* object) const;

private:
    enum class Kind { list, tuple, array, sequence };
    Kind kind_ = Kind::sequence;
    py::object obj_;
    Py_ssize_t length_ = 0;  // tuple, array and generic sequence: fixed at construction
    const char* data_ = nullptr;
    Py_ssize_t stride_ = 0;
    char dtype_kind_ = 'i';
    Py_ssize_t itemsize_ = 8;
};

// plans[c].block_id = block_ids[floor(starts[c] / block_size)] with Python list indexing (negative wraps,
// out of range → IndexError). `id_objects[c]` receives the item when it can be returned as is.
void resolve_block_ids(const BlockIdSource& ids, const std::vector<int64_t>& starts, int64_t block_size,
                       std::vector<layout::KeyPlan>* plans, std::vector<py::object>* id_objects);

// True for a numpy.ndarray itself, false for a subclass: only the exact type's memory is read directly. A
// subclass (np.memmap, a masked array, a user class overriding __getitem__/__len__/astype) is read through
// its own methods, as the reference's block_ids[i] reads it, and no method of it is ever called to convert it.
bool is_exact_ndarray(py::handle obj);

// The forms vLLM 0.33's store layouts take (LayoutEngine), read in vLLM's order:
// TypeError unless `obj` is a list, tuple or integer ndarray (a dict, set or str is a caller bug).
void require_id_container(PyObject* obj, const char* what);
// A 1-D integer ndarray as int64 values (uint64 beyond int64 → OverflowError); false when `obj` is not an
// exact ndarray. TypeError for other dtypes or shapes.
bool int64_array_values(py::handle obj, const char* what, std::vector<int64_t>* out);
// Every item of a list, tuple or integer array as int64.
std::vector<int64_t> int64_values(py::handle obj, const char* what);
// (start, end) of every chunk: a list/tuple of tuples/lists (items 0 and 1, as vLLM reads them) or an (n, 2)
// signed integer array.
void chunk_pairs(py::handle chunks, std::vector<int64_t>* starts, std::vector<int64_t>* ends,
                 bool exact_pairs = false);
// Python list indexing of `available` items at `index` (negative wraps; IndexError naming key `key` outside).
int64_t python_index(int64_t index, std::size_t available, std::size_t key);

// `obj` read as a sequence of flags or ints: TypeError for a dict, set, str or bytes, else a FastSequence.
FastSequence checked_sequence(py::handle obj, const char* what);

// TypeError unless `obj` may be kept as a region list that every call re-reads, or read by index as block ids:
// a sequence (dict, set, str, bytes, iterators and generators are refused).
void require_int_sequence(py::handle obj, const char* what);

}  // namespace kvaddr::py_bindings
