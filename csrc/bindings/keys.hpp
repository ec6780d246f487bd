// Key building shared by every key path (key_for, build_keys, build_lookup_keys, the fused plans).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "bindings/common.hpp"
#include "kvaddr/walk.hpp"

namespace kvaddr::py_bindings {

// Which items of a hash sequence are read (docs/keys.md, "Which hash objects are read"). vLLM keys a hash by
// its own `.hex()`, so its drop-in paths read natively only the types whose `.hex()` is their bytes' hex and
// that vLLM's block hashes are (exact `bytes`, `memoryview`) and refuse any other with TypeError, which makes
// the caller hand the call to vLLM's own function (a numpy array, a bytes subclass with its own `.hex()`).
// The seed-era database and the driver read any buffer.
enum class HashItems { block_hash, any_buffer };

// The hashes of a request: either one flat bytes-like blob of n × hash_len bytes (the zero-copy lookup wire
// format) or a sequence of hashes (`items` says which are read). Lengths always count bytes, whatever the
// buffer's item format (a memoryview of 'I' items is read as its bytes). Every buffer export is released by
// a destructor, on error paths too. Use with the GIL held.
class HashSource {
public:
    // `hash_len` is None or an int; required for a blob, a length check for a sequence.
    HashSource(py::handle hashes, py::handle hash_len, HashItems items = HashItems::block_hash);
    HashSource(const HashSource&) = delete;
    HashSource& operator=(const HashSource&) = delete;

    Py_ssize_t size() const noexcept { return count_; }

    // Hash i's bytes (0 <= i < size(), else IndexError), valid until the next call of `at` (a sequence
    // item's view is released then).
    const uint8_t* at(Py_ssize_t i, std::size_t* length);

private:
    Py_ssize_t count_ = 0;
    std::size_t hash_len_ = 0;  // 0: variable (sequence without hash_len)
    bool is_blob_ = false;
    HashItems items_kind_ = HashItems::block_hash;
    py::object blob_owner_;
    BufferView blob_;
    std::unique_ptr<FastSequence> items_;
    py::object item_;  // keeps the current item alive while its view is used
    BufferView item_view_;
};

// Builds key strings PREFIX + '@' + hex in the prefix's own str kind, so non-ASCII model names come out
// exactly as Python's f-strings make them.
class KeyWriter {
public:
    explicit KeyWriter(py::handle prefix);

    // New reference.
    PyObject* make(const uint8_t* hash, std::size_t length) const;

private:
    py::object prefix_;
    Py_ssize_t prefix_len_;
    int kind_;
    Py_UCS4 max_char_;
    const void* prefix_data_;
};

// The chunk walk of process_tokens with the reference's asserts (raised as ChunkAlignmentError, an
// AssertionError). `mask` is None, a chunk mask relative to the first chunk (store path), or, with
// `absolute_mask`, one indexed by absolute chunk id whose end also ends the walk (load path).
std::vector<WalkedChunk> walk(const WalkParams& p, int64_t n_hashes, py::handle mask, bool absolute_mask);

// Keys for hashes[indices[i]], key i under writers[i % writers.size()] (entries expanded writer by writer:
// build_keys' one prefix, the layouts' load walk and store plan, one writer per local shard).
py::list build_key_list(const std::vector<KeyWriter>& writers, HashSource& hashes, const std::vector<int64_t>& indices);

}  // namespace kvaddr::py_bindings
