// Bindings of the key builders, the lookup reduction and the chunk walk (docs/address-rows.md).
#include "bindings/keys.hpp"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "kvaddr/keys.hpp"
#include "bindings/inputs.hpp"
#include "kvaddr/checked.hpp"
#include "kvaddr/walk.hpp"

namespace kvaddr::py_bindings {

HashSource::HashSource(py::handle hashes, py::handle hash_len, HashItems items) : items_kind_(items) {
    if (!hash_len.is_none()) {
        const int64_t n = as_int64(hash_len.ptr(), "hash_len");
        if (n <= 0) raise(PyExc_ValueError, "hash_len must be positive, got " + std::to_string(n));
        hash_len_ = static_cast<std::size_t>(n);
    }
    if (PyBytes_Check(hashes.ptr()) || PyByteArray_Check(hashes.ptr()) || PyMemoryView_Check(hashes.ptr())) {
        if (hash_len_ == 0) raise(PyExc_ValueError, "hash_len is required when hashes is one flat blob");
        blob_owner_ = py::reinterpret_borrow<py::object>(hashes);
        blob_.acquire(blob_owner_.ptr(), "hashes");  // a member: released even if the check below raises
        is_blob_ = true;
        const std::size_t bytes = blob_.size();
        if (bytes % hash_len_ != 0) {
            raise(PyExc_ValueError, "hash blob of " + std::to_string(bytes) + " bytes is not a multiple of hash_len " +
                                        std::to_string(hash_len_));
        }
        count_ = static_cast<Py_ssize_t>(bytes / hash_len_);
        return;
    }
    if (refused_container(hashes.ptr())) {  // bytes and bytearray are blobs (above)
        raise(PyExc_TypeError, "hashes must be a sequence of bytes-like items or one blob, not " +
                                   type_name(hashes.ptr()));
    }
    items_ = std::make_unique<FastSequence>(hashes.ptr(), "hashes");
    count_ = items_->size();
}

const uint8_t* HashSource::at(Py_ssize_t i, std::size_t* length) {
    if (i < 0 || i >= count_) {
        raise(PyExc_IndexError, "hash index " + std::to_string(i) + " is out of range for " +
                                    std::to_string(count_) + " hashes");
    }
    if (is_blob_) {
        *length = hash_len_;
        return blob_.data() + static_cast<std::size_t>(i) * hash_len_;
    }
    item_view_.release();
    item_ = items_->at(i);
    PyObject* item = item_.ptr();
    const uint8_t* data = nullptr;
    if (PyBytes_CheckExact(item)) {  // the common case, without a buffer view
        *length = static_cast<std::size_t>(PyBytes_GET_SIZE(item));
        data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(item));
    } else {
        if (items_kind_ == HashItems::block_hash && !PyMemoryView_Check(item)) {
            raise(PyExc_TypeError, "hash " + std::to_string(i) + " is a " + type_name(item) +
                                       ": only bytes and memoryview hashes are keyed here (vLLM keys a hash by "
                                       "its own .hex())");
        }
        item_view_.acquire(item, "hash " + std::to_string(i));
        *length = item_view_.size();
        data = item_view_.data();
    }
    if (hash_len_ != 0 && *length != hash_len_) {
        raise(PyExc_ValueError, "hash " + std::to_string(i) + " has " + std::to_string(*length) +
                                    " bytes, expected hash_len " + std::to_string(hash_len_));
    }
    return data;
}

KeyWriter::KeyWriter(py::handle prefix) {
    if (!PyUnicode_Check(prefix.ptr())) raise(PyExc_TypeError, "prefix must be str, not " + type_name(prefix.ptr()));
    prefix_ = py::reinterpret_borrow<py::object>(prefix);
    prefix_len_ = PyUnicode_GET_LENGTH(prefix.ptr());
    kind_ = PyUnicode_KIND(prefix.ptr());
    // '@' and hex digits are ASCII: the key needs exactly the prefix's widest character, and at least ASCII.
    max_char_ = std::max<Py_UCS4>(127, PyUnicode_MAX_CHAR_VALUE(prefix.ptr()));
    prefix_data_ = PyUnicode_DATA(prefix.ptr());
}

PyObject* KeyWriter::make(const uint8_t* hash, std::size_t length) const {
    // 2 * length + the prefix and '@' must fit in Py_ssize_t (a buffer claiming 2**62 bytes, e.g. a numpy
    // view made with as_strided, would otherwise overflow the size computation).
    if (length > static_cast<std::size_t>((PY_SSIZE_T_MAX - prefix_len_ - 1) / 2)) {
        raise(PyExc_OverflowError, "a hash of " + std::to_string(length) + " bytes makes a key too long");
    }
    const Py_ssize_t size = prefix_len_ + 1 + 2 * static_cast<Py_ssize_t>(length);
    PyObject* key = PyUnicode_New(size, max_char_);
    if (key == nullptr) throw py::error_already_set();
    void* data = PyUnicode_DATA(key);
    std::memcpy(data, prefix_data_, static_cast<std::size_t>(prefix_len_) * static_cast<std::size_t>(kind_));
    // '@' and the hex digits after the prefix, written in the code units `units` of the key's kind.
    const auto finish = [&](auto* units) {
        auto* out = units + prefix_len_;
        *out = '@';
        write_hex(hash, length, out + 1);
        return key;
    };
    switch (kind_) {
        case PyUnicode_1BYTE_KIND: return finish(static_cast<Py_UCS1*>(data));
        case PyUnicode_2BYTE_KIND: return finish(static_cast<Py_UCS2*>(data));
        default: return finish(static_cast<Py_UCS4*>(data));
    }
}

py::list build_key_list(const std::vector<KeyWriter>& writers, HashSource& hashes, const std::vector<int64_t>& indices) {
    py::list keys(static_cast<Py_ssize_t>(indices.size()));
    std::size_t w = 0;  // i % writers.size(), without a division per key (the lookup's hot loop)
    for (std::size_t i = 0; i < indices.size(); ++i) {
        std::size_t length = 0;
        const uint8_t* hash = hashes.at(static_cast<Py_ssize_t>(indices[i]), &length);
        PyList_SET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i), writers[w].make(hash, length));
        if (++w == writers.size()) w = 0;
    }
    return keys;
}

namespace {

// The seed-era database's keys_for and the driver's build_keys: any buffer is a hash. Its own loop, one key per
// hash in order: through build_key_list (an index vector, a writer per entry) it took 1.15x as long (bench keys).
py::list build_keys(py::handle prefix, py::handle hashes, py::handle hash_len) {
    KeyWriter writer(prefix);
    HashSource source(hashes, hash_len, HashItems::any_buffer);
    py::list keys(source.size());
    for (Py_ssize_t i = 0; i < source.size(); ++i) {
        std::size_t length = 0;
        const uint8_t* hash = source.at(i, &length);
        PyList_SET_ITEM(keys.ptr(), i, writer.make(hash, length));
    }
    return keys;
}

py::str build_key(py::handle prefix, py::handle hash) {
    KeyWriter writer(prefix);
    py::object owner = py::reinterpret_borrow<py::object>(hash);
    if (PyBytes_CheckExact(owner.ptr())) {
        return py::reinterpret_steal<py::str>(writer.make(
            reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(owner.ptr())),
            static_cast<std::size_t>(PyBytes_GET_SIZE(owner.ptr()))));
    }
    BufferView view;
    view.acquire(owner.ptr(), "chunk hash");
    return py::reinterpret_steal<py::str>(writer.make(view.data(), view.size()));
}

// Hash-major, then prefix in the given order (docs/address-rows.md, "Keys"): hex is written once per hash per prefix.
// `any_buffer`: the driver's lookup (any buffer is a hash); without it, vLLM's rule (HashItems::block_hash).
py::list build_lookup_keys(py::handle prefixes, py::handle hashes, py::handle hash_len, py::handle any_buffer_arg) {
    const bool any_buffer = as_flag(any_buffer_arg);
    if (PyUnicode_Check(prefixes.ptr())) raise(PyExc_TypeError, "prefixes must be a sequence of str, not one str");
    // A set's order is arbitrary and a dict would be read by its keys: the key order must be the caller's.
    FastSequence prefix_seq = checked_sequence(prefixes, "prefixes");
    std::vector<KeyWriter> writers;
    writers.reserve(static_cast<std::size_t>(prefix_seq.size()));
    const Py_ssize_t n_prefixes = prefix_seq.size();
    for (Py_ssize_t p = 0; p < n_prefixes; ++p) writers.emplace_back(prefix_seq.at(p));
    HashSource source(hashes, hash_len, any_buffer ? HashItems::any_buffer : HashItems::block_hash);
    const Py_ssize_t width = static_cast<Py_ssize_t>(writers.size());
    Py_ssize_t total = 0;
    if (__builtin_mul_overflow(source.size(), width, &total)) raise(PyExc_OverflowError, "too many lookup keys");
    py::list keys(total);
    for (Py_ssize_t i = 0; i < source.size(); ++i) {
        std::size_t length = 0;
        const uint8_t* hash = source.at(i, &length);
        for (Py_ssize_t p = 0; p < width; ++p) {
            PyList_SET_ITEM(keys.ptr(), i * width + p, writers[static_cast<std::size_t>(p)].make(hash, length));
        }
    }
    return keys;
}

// Lookup keys (hash-major, then the prefixes in order, as build_lookup_keys) as ONE UTF-8 blob cut at n + 1
// int64 offsets: what the native client's batch_is_exist takes (docs/lookup.md, "Native lookup"), so a
// lookup builds no Python str per key. The bytes are what Mooncake's binding would make of each key str.
py::tuple lookup_key_blob(py::handle prefixes, py::handle hashes, py::handle hash_len) {
    if (PyUnicode_Check(prefixes.ptr())) raise(PyExc_TypeError, "prefixes must be a sequence of str, not one str");
    FastSequence prefix_seq = checked_sequence(prefixes, "prefixes");
    std::vector<std::string> heads;  // each prefix's UTF-8 bytes and the '@'
    heads.reserve(static_cast<std::size_t>(prefix_seq.size()));
    for (Py_ssize_t p = 0; p < prefix_seq.size(); ++p) {
        py::object prefix = prefix_seq.at(p);
        if (!PyUnicode_Check(prefix.ptr())) raise(PyExc_TypeError, "prefix must be str, not " + type_name(prefix.ptr()));
        Py_ssize_t size = 0;
        const char* utf8 = PyUnicode_AsUTF8AndSize(prefix.ptr(), &size);  // a lone surrogate: UnicodeEncodeError
        if (utf8 == nullptr) throw py::error_already_set();
        heads.emplace_back(utf8, static_cast<std::size_t>(size));
        heads.back().push_back('@');
    }
    HashSource source(hashes, hash_len);
    const auto n_hashes = static_cast<std::size_t>(source.size());
    // The hashes' bytes, copied once (a sequence item's view lasts only until the next `at`).
    std::vector<uint8_t> hash_bytes;
    std::vector<std::size_t> hash_ends(n_hashes);
    for (std::size_t i = 0; i < n_hashes; ++i) {
        std::size_t length = 0;
        const uint8_t* hash = source.at(static_cast<Py_ssize_t>(i), &length);
        hash_bytes.insert(hash_bytes.end(), hash, hash + length);
        hash_ends[i] = hash_bytes.size();
    }
    std::size_t n_keys = 0;
    if (__builtin_mul_overflow(n_hashes, heads.size(), &n_keys)) raise(PyExc_OverflowError, "too many lookup keys");
    std::size_t total = 0;
    for (const auto& head : heads) {
        std::size_t part = 0;  // this prefix's bytes over every hash: n * len(head) + 2 * all hash bytes
        if (__builtin_mul_overflow(n_hashes, head.size(), &part) || __builtin_add_overflow(total, part, &total) ||
            __builtin_add_overflow(total, hash_bytes.size(), &total) ||
            __builtin_add_overflow(total, hash_bytes.size(), &total) ||
            total > static_cast<std::size_t>(PY_SSIZE_T_MAX)) {
            raise(PyExc_OverflowError, "the lookup keys do not fit in one blob");
        }
    }
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(n_keys + 1));
    auto* cut = offsets.mutable_data();
    py::bytes blob = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total)));
    if (!blob) throw py::error_already_set();
    char* out = PyBytes_AS_STRING(blob.ptr());
    std::size_t at = 0, key = 0;
    cut[0] = 0;
    for (std::size_t i = 0; i < n_hashes; ++i) {
        const std::size_t begin = i == 0 ? 0 : hash_ends[i - 1];
        const std::size_t length = hash_ends[i] - begin;
        for (const auto& head : heads) {
            std::memcpy(out + at, head.data(), head.size());
            at += head.size();
            write_hex(hash_bytes.data() + begin, length, out + at);
            at += 2 * length;
            cut[++key] = static_cast<int64_t>(at);
        }
    }
    return py::make_tuple(std::move(blob), std::move(offsets));
}

// Which units are present: unit u covers widths[u] consecutive results (an int width means every unit).
py::list reduce_exists(py::handle results, py::handle widths) {
    // The exist results as int64 values; values that do not fit (never 1) read as 0, i.e. absent.
    FastSequence items = checked_sequence(results, "results");
    const Py_ssize_t n = items.size();  // fixed: a callback that grows the list cannot extend the loop
    std::vector<int64_t> values(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        py::object item = items.at(i);
        // An __index__ object (a numpy integer) is read like an int: a value outside int64 is absent, not an
        // OverflowError (the same result as the int 2**64 - 1 gives).
        if (!PyLong_Check(item.ptr())) item = index_of(item.ptr(), "exist result");
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
        if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
        values[static_cast<std::size_t>(i)] = overflow != 0 ? 0 : static_cast<int64_t>(v);
    }
    std::vector<int64_t> unit_widths;
    // One int for every unit: an int, or an __index__ object that is not a sequence (a numpy integer). The
    // results are C++ values already, so the __index__ call cannot change them.
    if (PyLong_Check(widths.ptr()) || (PyIndex_Check(widths.ptr()) && !PySequence_Check(widths.ptr()))) {
        const int64_t w = as_int64(widths.ptr(), "width");
        if (w <= 0) raise(PyExc_ValueError, "width must be positive, got " + std::to_string(w));
        if (values.size() % static_cast<std::size_t>(w) != 0) {
            raise(PyExc_ValueError, std::to_string(values.size()) + " results are not a multiple of width " +
                                        std::to_string(w));
        }
        unit_widths.assign(values.size() / static_cast<std::size_t>(w), w);
    } else {
        FastSequence seq = checked_sequence(widths, "widths");
        const Py_ssize_t n_units = seq.size();
        unit_widths.resize(static_cast<std::size_t>(n_units));
        int64_t total = 0;
        for (Py_ssize_t u = 0; u < n_units; ++u) {
            const int64_t w = as_int64(seq.at(u).ptr(), "width");
            if (w < 0) raise(PyExc_ValueError, "widths must be non-negative");
            unit_widths[static_cast<std::size_t>(u)] = w;
            if (!add_checked(total, w, &total)) {
                raise(PyExc_ValueError, "widths add up to more than 2**63 - 1 results");
            }
        }
        if (total != static_cast<int64_t>(values.size())) {
            raise(PyExc_ValueError, "widths cover " + std::to_string(total) + " results, got " +
                                        std::to_string(values.size()));
        }
    }
    py::list present(unit_widths.size());
    std::size_t cursor = 0;
    for (std::size_t u = 0; u < unit_widths.size(); ++u) {
        const auto w = static_cast<std::size_t>(unit_widths[u]);
        const bool yes = unit_present(values.data() + cursor, w);
        cursor += w;
        PyList_SET_ITEM(present.ptr(), static_cast<Py_ssize_t>(u), py::bool_(yes).release().ptr());
    }
    return present;
}

}  // namespace

// 16 Mi chunks (268M tokens at block_size 16, far beyond any context): one walk's positions and keys stay a
// few GiB at most even when a lying __len__ (chunk_walk's n_hashes) makes the walk as long as it may be.
// process_tokens walks in windows (core/walk.py), so only one call over a longer walk is refused.
constexpr int64_t kMaxWalkChunks = int64_t{1} << 24;

// Shared by process_tokens and the fused plans: validates like the reference's asserts (AssertionError
// subclass), then walks. `mask` is a relative chunk mask (absolute=false) or an absolute one (load path).
// Every flag the walk needs is converted before the walk (a flag's __bool__ may run Python code); every
// position is computed with checked arithmetic, and every hash index is inside [0, n_hashes).
std::vector<WalkedChunk> walk(const WalkParams& p, int64_t n_hashes, py::handle mask, bool absolute_mask) {
    std::vector<WalkedChunk> out;
    if (p.put_step <= 0) raise(errors().chunk_alignment, "put_step must be positive, got " + std::to_string(p.put_step));
    if (n_hashes < 0) raise(PyExc_ValueError, "n_hashes must be >= 0, got " + std::to_string(n_hashes));
    if (n_hashes == 0) return out;
    if (p.token_len % p.hash_block_size != 0) {
        raise(errors().chunk_alignment, "token_len " + std::to_string(p.token_len) +
                                            " is not a multiple of hash_block_size " + std::to_string(p.hash_block_size));
    }
    if (floor_div(p.token_len, p.hash_block_size) > n_hashes) {
        raise(errors().chunk_alignment, "token_len " + std::to_string(p.token_len) + " needs " +
                                            std::to_string(floor_div(p.token_len, p.hash_block_size)) +
                                            " hashes, got " + std::to_string(n_hashes));
    }
    // Positions are int64 with room for one block past the end (docs/errors.md): a walk whose end + block_size
    // would not fit is refused instead of computed with wrapped arithmetic.
    int64_t room = 0;
    if (!add_checked(p.token_len, p.block_size, &room)) {
        raise(PyExc_OverflowError, "token_len " + std::to_string(p.token_len) + " + block_size " +
                                       std::to_string(p.block_size) + " overflows int64");
    }
    const int64_t first = walk_first_chunk(p);
    int64_t stop = walk_stop_chunk(p);
    // An empty walk, noticed before stop - first is computed: the two may be more than 2**63 apart (a large
    // mask_num with a very negative token_len), and the wrapped difference made the walk raise.
    if (stop <= first) return out;
    // Every walked chunk names a distinct hash, so a walk longer than the hashes is refused up front (a lying
    // n_hashes or __len__ must not make us loop for 2**62 chunks).
    if (stop - first > n_hashes) stop = first + n_hashes;
    if (stop - first > kMaxWalkChunks) {
        raise(PyExc_ValueError, "a walk of " + std::to_string(stop - first) + " chunks exceeds the limit of " +
                                    std::to_string(kMaxWalkChunks));
    }
    std::vector<bool> keep;
    int64_t offset = 0;
    if (!mask.is_none()) {
        FastSequence flags = checked_sequence(mask, "chunk mask");
        offset = absolute_mask ? 0 : first;
        int64_t mask_end = 0;
        if (!add_checked(offset, static_cast<int64_t>(flags.size()), &mask_end)) mask_end = INT64_MAX;
        stop = std::min(stop, mask_end);
        for (int64_t chunk_id = first; chunk_id < stop; ++chunk_id) {
            keep.push_back(as_flag(flags.at(static_cast<Py_ssize_t>(chunk_id - offset))));
        }
    }
    const bool ok = walk_chunks(p, first, stop, n_hashes, [&](int64_t chunk_id) {
        return mask.is_none() || keep[static_cast<std::size_t>(chunk_id - first)];
    }, &out);
    if (!ok) raise(PyExc_OverflowError, "the chunk walk overflows int64 (block_size or token_len too large)");
    return out;
}

namespace {

// Ints are handles converted with as_int64 (not pybind11's casters, which truncate floats through __int__ and
// replace an __index__ exception), in argument order.
py::tuple chunk_walk(py::handle token_len_arg, py::handle n_hashes_arg, py::handle block_size_arg,
                     py::handle hash_block_size_arg, py::handle mask_num_arg, py::handle chunk_mask,
                     py::handle put_step_arg, py::handle put_step_rank_arg, bool absolute_mask) {
    const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
    const int64_t n_hashes = as_int64(n_hashes_arg.ptr(), "n_hashes");
    const int64_t block_size = as_int64(block_size_arg.ptr(), "block_size");
    const int64_t hash_block_size = as_int64(hash_block_size_arg.ptr(), "hash_block_size");
    const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
    const int64_t put_step = as_int64(put_step_arg.ptr(), "put_step");
    const int64_t put_step_rank = as_int64(put_step_rank_arg.ptr(), "put_step_rank");
    if (block_size <= 0 || hash_block_size <= 0) raise(PyExc_ValueError, "block sizes must be positive");
    WalkParams p{token_len, block_size, hash_block_size, mask_num, put_step, put_step_rank};
    const std::vector<WalkedChunk> chunks = walk(p, n_hashes, chunk_mask, absolute_mask);
    py::list starts(chunks.size()), ends(chunks.size()), hash_indices(chunks.size());
    for (std::size_t i = 0; i < chunks.size(); ++i) {
        const auto at = static_cast<Py_ssize_t>(i);
        PyList_SET_ITEM(starts.ptr(), at, py::int_(chunks[i].start).release().ptr());
        PyList_SET_ITEM(ends.ptr(), at, py::int_(chunks[i].end).release().ptr());
        PyList_SET_ITEM(hash_indices.ptr(), at, py::int_(chunks[i].hash_index).release().ptr());
    }
    return py::make_tuple(std::move(starts), std::move(ends), std::move(hash_indices));
}

}  // namespace

void register_keys(py::module_& m) {
    m.def("build_key", &build_key, py::arg("prefix"), py::arg("chunk_hash"));
    m.def("build_keys", &build_keys, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len") = py::none());
    m.def("build_lookup_keys", &build_lookup_keys, py::arg("prefixes"), py::arg("hashes"),
          py::arg("hash_len") = py::none(), py::kw_only(), py::arg("any_buffer") = false,
          "Lookup keys, hash-major. Without any_buffer, a hash that is not bytes or a memoryview is a TypeError "
          "(vLLM's rule: the plugin's lookup then runs vLLM's own).");
    m.def("lookup_key_blob", &lookup_key_blob, py::arg("prefixes"), py::arg("hashes"), py::arg("hash_len") = py::none(),
          "(blob, offsets): build_lookup_keys' keys as one UTF-8 bytes blob cut at n + 1 int64 offsets.");
    m.def("reduce_exists", &reduce_exists, py::arg("results"), py::arg("widths"));
    m.def("chunk_walk", &chunk_walk, py::arg("token_len"), py::arg("n_hashes"), py::arg("block_size"),
          py::arg("hash_block_size"), py::arg("mask_num"), py::arg("chunk_mask"), py::arg("put_step"),
          py::arg("put_step_rank"), py::arg("absolute_mask") = false,
          "(starts, ends, hash indices) of the chunks process_tokens yields; with absolute_mask the mask is "
          "indexed by absolute chunk id and ends the walk at its end (the load path's rule).");
}

}  // namespace kvaddr::py_bindings
