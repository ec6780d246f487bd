// Bindings of the layout engine (docs/vllm.md): one native engine behind every vLLM 0.32+ store layout.
//
// A LayoutEngine holds one segment template per local store shard (kvaddr/layout.hpp) and turns
// (chunk, block ids, shard ids) into Mooncake multi-buffer descriptors. Hardening (docs/vllm.md, "Rules"):
// every argument is converted to C++ values first, in vLLM's error order, before any Python object is created
// (object creation can run the garbage collector and so arbitrary Python code); the arithmetic runs on an
// immutable snapshot of the templates; every returned row is a fresh list, so no result aliases another or
// the row cache (the cache holds immutable tuples whose int objects the fresh lists share).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bindings/buffer_pool.hpp"
#include "bindings/common.hpp"
#include "bindings/inputs.hpp"
#include "bindings/keys.hpp"
#include "bindings/region_pin.hpp"
#include "bindings/row_cache.hpp"
#include "kvaddr/layout.hpp"

namespace kvaddr::py_bindings {

namespace {

using layout::KeyPlan;
using layout::Segments;
using Templates = std::vector<Segments>;

// Array outputs with at least this many cells release the GIL around the arithmetic (see docs/vllm.md:
// re-acquiring the GIL beside a busy thread can cost a switch interval, so only long loops pay).
std::size_t g_layout_gil_release_min_cells = std::size_t{1} << 22;
constexpr std::size_t kMaxSizeRows = 64;

// The row builders are row_cache.hpp's (new_int_list, new_int_tuple): ints only, untracked by the cyclic GC.

// A tuple of new Python ints (the cached, immutable form of a row), owned.
py::object int_tuple(const int64_t* values, std::size_t count) {
    return py::reinterpret_steal<py::object>(new_int_tuple(values, count));
}

// A fresh list holding the items of `row` (a tuple of ints).
PyObject* list_from_tuple(PyObject* row) {
    const auto count = static_cast<std::size_t>(PyTuple_GET_SIZE(row));
    return new_int_list(reinterpret_cast<PyTupleObject*>(row)->ob_item, count);
}

// Only lists, tuples and integer arrays (an ndarray subclass is read through its own methods, see
// is_exact_ndarray): a dict, set or str is a caller bug, not a sequence of ids.
void check_id_container(PyObject* obj, const char* what) {
    if (PyList_Check(obj) || PyTuple_Check(obj) || py::isinstance<py::array>(obj)) return;
    raise(PyExc_TypeError, std::string(what) + " must be a list, tuple or 1-D integer array, not " + type_name(obj));
}

// An integer ndarray of 1 dimension as int64 values (uint64 beyond int64 → OverflowError); empty optional
// when `obj` is not an ndarray. TypeError for other dtypes or shapes.
bool array_values(py::handle obj, const char* what, std::vector<int64_t>* out) {
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
std::vector<int64_t> int_values(py::handle obj, const char* what) {
    std::vector<int64_t> values;
    if (array_values(obj, what, &values)) return values;
    check_id_container(obj.ptr(), what);
    FastSequence seq(obj.ptr(), what);
    // The length is read once: a callback (__index__) that grows the list is not followed, one that shrinks it
    // makes seq.at raise (the same rule everywhere below).
    const Py_ssize_t n = seq.size();
    values.reserve(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) values.push_back(as_int64(seq.at(i).ptr(), what));
    return values;
}

// (start, end) of every chunk: a list/tuple of tuples/lists (only items 0 and 1 are read, as vLLM does), or
// an (n, 2) integer array.
void chunk_bounds(py::handle chunks, std::vector<int64_t>* starts, std::vector<int64_t>* ends) {
    if (is_exact_ndarray(chunks)) {
        py::array arr = py::reinterpret_borrow<py::array>(chunks);
        const char kind = arr.dtype().kind();
        if (arr.ndim() != 2 || arr.shape(1) < 2 || !(kind == 'i' || (kind == 'u' && arr.itemsize() < 8))) {
            raise(PyExc_TypeError, "chunks must be an (n, 2) signed integer array");
        }
        auto view = py::array_t<int64_t, py::array::forcecast>::ensure(arr);
        if (!view) throw py::error_already_set();
        auto cells = view.unchecked<2>();
        for (py::ssize_t c = 0; c < cells.shape(0); ++c) {
            starts->push_back(cells(c, 0));
            ends->push_back(cells(c, 1));
        }
        return;
    }
    check_id_container(chunks.ptr(), "chunks");
    FastSequence seq(chunks.ptr(), "chunks");
    const Py_ssize_t n = seq.size();  // as vLLM's np.fromiter(count=len(chunks)): growth is not followed
    for (Py_ssize_t c = 0; c < n; ++c) {
        py::object chunk = seq.at(c);
        PyObject* p = chunk.ptr();
        if (!(PyTuple_Check(p) || PyList_Check(p))) {
            raise(PyExc_TypeError, "chunk " + std::to_string(c) + " must be a (start, end) tuple, not " + type_name(p));
        }
        // Hold both items: converting the first can run __index__, which may shrink a list chunk. A subclass
        // (say a named tuple with its own __getitem__) is read through c[0] and c[1], as vLLM reads it.
        py::object start, end;
        if (PyTuple_CheckExact(p) || PyList_CheckExact(p)) {
            if (PySequence_Fast_GET_SIZE(p) < 2) {
                raise(PyExc_TypeError, "chunk " + std::to_string(c) + " must be a (start, end) tuple");
            }
            start = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(p, 0));
            end = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(p, 1));
        } else {
            start = py::reinterpret_steal<py::object>(PySequence_GetItem(p, 0));
            if (!start) throw py::error_already_set();
            end = py::reinterpret_steal<py::object>(PySequence_GetItem(p, 1));
            if (!end) throw py::error_already_set();
        }
        starts->push_back(as_int64(start.ptr(), "chunk start"));
        ends->push_back(as_int64(end.ptr(), "chunk end"));
    }
}

// Python list indexing of `ids` at `index` (negative wraps; IndexError outside).
int64_t wrap_index(int64_t index, std::size_t available, std::size_t key) {
    const auto n = static_cast<int64_t>(available);
    const int64_t at = index < 0 ? index + n : index;
    if (at < 0 || at >= n) {
        raise(PyExc_IndexError, "key " + std::to_string(key) + ": block index " + std::to_string(index) +
                                    " is out of range for " + std::to_string(available) + " block ids");
    }
    return at;
}

class LayoutEngine {
public:
    LayoutEngine(int64_t block_size, int64_t hash_block_size, bool tp_shared, int64_t first_shard,
                 int64_t n_shards, std::size_t cache_bytes)
        : block_size_(block_size),
          hash_block_size_(hash_block_size),
          tp_shared_(tp_shared),
          first_shard_(first_shard),
          cache_capacity_(cache_bytes) {
        if (block_size <= 0 || hash_block_size <= 0) {
            throw py::value_error("block_size and hash_block_size must be positive");
        }
        if (n_shards < 0 || (!tp_shared && (n_shards != 1 || first_shard != 0))) {
            throw py::value_error("a rank-local layout has the one shard 0; a TP-shared one n_shards >= 0");
        }
        int64_t end_shard = 0;  // shard ids first_shard + k (k < n_shards) must be int64s: no wrap in plan_load
        if (first_shard < 0 || !add_checked(first_shard, n_shards, &end_shard)) {
            throw py::value_error("first_shard must be >= 0 and first_shard + n_shards must fit in int64");
        }
        auto empty = std::make_shared<Templates>(static_cast<std::size_t>(n_shards));
        for (Segments& t : *empty) {
            t.size_scales = !tp_shared;
            t.finalize();
        }
        templates_ = std::move(empty);
        rows_.resize(static_cast<std::size_t>(n_shards));
        base_source_ = py::list();
        block_len_source_ = py::list();
    }
    LayoutEngine(const LayoutEngine&) = delete;
    LayoutEngine& operator=(const LayoutEngine&) = delete;
    ~LayoutEngine() { clear_cache(); }

    // Rank-local: the caller's region lists, re-read (and compared) on every call, as vLLM reads them.
    void set_region_sources(py::object base, py::object block_len) {
        require_rank_local("set_region_sources");
        require_region_sequence(base, "kv_caches_base_addr");
        require_region_sequence(block_len, "block_len");
        base_source_ = std::move(base);
        block_len_source_ = std::move(block_len);
        synced_ = false;
    }

    // TP-shared: one (bases, strides, sizes) triple per local shard, all of one width.
    void set_templates(py::handle templates) {
        if (!tp_shared_) raise(PyExc_RuntimeError, "set_templates is for TP-shared layouts");
        FastSequence seq(templates.ptr(), "templates");
        auto fresh = std::make_shared<Templates>();
        if (static_cast<std::size_t>(seq.size()) != rows_.size()) {
            raise(PyExc_ValueError, "expected " + std::to_string(rows_.size()) + " shard templates, got " +
                                        std::to_string(seq.size()));
        }
        const Py_ssize_t n_templates = seq.size();
        for (Py_ssize_t k = 0; k < n_templates; ++k) {
            py::object triple = seq.at(k);
            FastSequence parts(triple.ptr(), "template");
            if (parts.size() != 3) raise(PyExc_ValueError, "a template is (bases, strides, sizes)");
            Segments t;
            t.base = int_values(parts.at(0), "template base");
            t.stride = int_values(parts.at(1), "template stride");
            t.size = int_values(parts.at(2), "template size");
            if (t.base.size() != t.stride.size() || t.base.size() != t.size.size()) {
                raise(PyExc_ValueError, "template bases, strides and sizes must have one length");
            }
            if (!fresh->empty() && fresh->front().count() != t.count()) {
                raise(PyExc_ValueError, "every shard template must have the same number of segments");
            }
            t.size_scales = false;
            t.finalize();
            fresh->push_back(std::move(t));
        }
        clear_cache();
        templates_ = std::move(fresh);
    }

    // vLLM's prepare_values: (addr rows, size rows, block ids) as lists of fresh lists of ints.
    py::tuple prepare_values(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        const Py_ssize_t n = PyObject_Length(chunks.ptr());
        if (n < 0) throw py::error_already_set();
        if (n == 0) return py::make_tuple(py::list(), py::list(), py::list());
        Parsed parsed = parse(chunks, block_ids, shard_ids);
        return materialize_lists(parsed);
    }

    // The same values as int64 arrays (keys × segments, keys × segments, keys); GIL released for big ones.
    py::tuple prepare_values_array(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        const Py_ssize_t n = PyObject_Length(chunks.ptr());
        if (n < 0) throw py::error_already_set();
        if (n == 0) {
            Parsed none;
            none.templates = templates_;
            return materialize_arrays(none);
        }
        return materialize_arrays(parse(chunks, block_ids, shard_ids));
    }

    // Rank-local boundary puts: (addresses, sizes) of one block in every region.
    py::tuple prepare_value_for_block(py::handle block_id) {
        require_rank_local("prepare_value_for_block");
        std::shared_ptr<const Templates> templates = sync_regions();
        const int64_t id = as_int64(block_id.ptr(), "block_id");
        const Segments& t = (*templates)[0];
        std::vector<int64_t> addrs(t.count()), sizes(t.count());
        if (!layout::address_row(t, id, addrs.data())) raise_overflow(0, id);
        layout::size_row(t, 1, sizes.data());
        py::object a = py::reinterpret_steal<py::object>(new_int_list(addrs.data(), addrs.size()));
        py::object s = py::reinterpret_steal<py::object>(new_int_list(sizes.data(), sizes.size()));
        return py::make_tuple(std::move(a), std::move(s));
    }

    // The receive thread's per-group work in one call (docs/vllm.md, "Fused plan"): walk
    // [mask_num, token_len) with the 0.32+ start rule, keep chunks the absolute `load_mask` keeps, key the
    // chunk ending at token_len by the tail-key boundary's hash when `tail_tokens` is given, expand each kept
    // chunk to one key per local shard (keyed under `shard_prefixes[k]`), then its descriptors.
    // Returns (keys, addr rows, size rows, block ids), index-aligned; int64 arrays for the rows when `arrays`.
    py::tuple plan_load(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, py::handle token_len_arg,
                        py::handle mask_num_arg, py::handle load_mask, py::handle tail_tokens, py::handle block_ids,
                        py::handle arrays_arg) {
        const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
        const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
        const bool arrays = as_flag(arrays_arg);
        refuse_non_sequence(shard_prefixes, "shard_prefixes");
        FastSequence prefix_seq(shard_prefixes.ptr(), "shard_prefixes");
        if (static_cast<std::size_t>(prefix_seq.size()) != rows_.size()) {
            raise(PyExc_ValueError, "expected one key prefix per local shard (" + std::to_string(rows_.size()) + ")");
        }
        std::vector<KeyWriter> writers;
        writers.reserve(rows_.size());
        for (Py_ssize_t k = 0; k < prefix_seq.size(); ++k) writers.emplace_back(prefix_seq.at(k));
        const bool has_tail = !tail_tokens.is_none();
        const int64_t tail = has_tail ? as_int64(tail_tokens.ptr(), "tail_tokens") : 0;
        HashSource source(hashes, hash_len);

        // vLLM 0.32+ starts at ceil(mask_num / block_size): the walk takes a block-aligned mask_num.
        // When first * block_size does not fit, the walk is empty in vLLM (the first chunk lies past every
        // chunk of token_len): the largest block multiple in int64 gives the same empty walk (walk() needs
        // token_len + block_size to fit, so its last chunk starts below it) after the same asserts.
        int64_t aligned_mask = 0;
        if (!mul_checked(layout::first_chunk_ceil(mask_num, block_size_), block_size_, &aligned_mask)) {
            aligned_mask = INT64_MAX / block_size_ * block_size_;
        }
        WalkParams params{token_len, block_size_, hash_block_size_, aligned_mask, 1, 0};
        const std::vector<WalkedChunk> walked = walk(params, source.size(), load_mask, true);

        Parsed parsed;
        std::vector<int64_t> hash_indices;
        for (const WalkedChunk& c : walked) {
            int64_t hash_index = c.hash_index;
            if (has_tail && c.end == token_len) {
                // vLLM's block_hashes[tail // hash_block_size - 1], Python indexing; the - 1 is checked (a
                // tail_tokens of -2**63 with hash_block_size 1 would wrap).
                int64_t tail_index = 0;
                if (!add_checked(floor_div(tail, hash_block_size_), -1, &tail_index)) {
                    raise(PyExc_IndexError, "tail_tokens " + std::to_string(tail) + " names no block hash");
                }
                hash_index = wrap_index(tail_index, static_cast<std::size_t>(source.size()), parsed.starts.size());
            }
            for (std::size_t k = 0; k < rows_.size(); ++k) {
                parsed.starts.push_back(c.start);
                parsed.ends.push_back(c.end);
                parsed.shards.push_back(first_shard_ + static_cast<int64_t>(k));
                hash_indices.push_back(hash_index);
            }
        }
        if (parsed.starts.empty()) {
            py::object rows = arrays ? py::object(materialize_arrays(with_templates(std::move(parsed))))
                                     : py::object(py::make_tuple(py::list(), py::list(), py::list()));
            py::tuple r = rows;
            return py::make_tuple(py::list(), r[0], r[1], r[2]);
        }
        take_snapshot(parsed);  // vLLM's prepare_values reads the regions after the walk
        validate(parsed);
        resolve(parsed, block_ids);
        // Keys last among the inputs: the hashes are read after every other argument was converted.
        py::list keys(static_cast<Py_ssize_t>(hash_indices.size()));
        for (std::size_t i = 0; i < hash_indices.size(); ++i) {
            std::size_t length = 0;
            const uint8_t* bytes = source.at(static_cast<Py_ssize_t>(hash_indices[i]), &length);
            PyList_SET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i),
                            writers[static_cast<std::size_t>(parsed.plans[i].shard)].make(bytes, length));
        }
        py::tuple rows = arrays ? materialize_arrays(parsed) : materialize_lists(parsed);
        return py::make_tuple(std::move(keys), rows[0], rows[1], rows[2]);
    }

    std::size_t cache_capacity() const { return cache_capacity_; }
    void set_cache_capacity(std::size_t bytes) {
        cache_capacity_ = bytes;
        while (cache_bytes_ > cache_capacity_) evict_oldest();
    }

    py::dict cache_info() const {
        py::dict info;
        std::size_t entries = 0;
        for (const auto& shard : rows_) entries += shard.size();
        info["entries"] = entries;
        info["bytes"] = cache_bytes_;
        info["capacity_bytes"] = cache_capacity_;
        info["hits"] = hits_;
        info["misses"] = misses_;
        return info;
    }

    // A transfer's registered regions (region_pin.hpp); rank-local only (TP-shared rows come from the
    // installed templates, checked by the transfer's layout adapter).
    void pin_regions(py::handle bases, py::handle block_len) { pin_.pin(bases, block_len); }
    void unpin_regions() { pin_.unpin(); }
    std::size_t region_pins() const { return pin_.count(); }

    void clear_cache() {
        ++generation_;
        // Detach first, release after: the maps stay consistent whatever a DECREF runs.
        std::vector<std::unordered_map<int64_t, PyObject*>> rows(rows_.size());
        rows.swap(rows_);
        auto size_rows = std::move(size_rows_);
        size_rows_.clear();
        order_.clear();
        seen_.clear();
        cache_bytes_ = 0;
        for (auto& shard : rows) {
            for (auto& entry : shard) Py_DECREF(entry.second);
        }
        for (auto& entry : size_rows) Py_DECREF(entry.second);
    }

    int64_t segment_count() {
        const std::shared_ptr<const Templates> templates = current_templates();
        return templates->empty() ? 0 : static_cast<int64_t>(templates->front().count());
    }

private:
    struct Parsed {
        std::vector<int64_t> starts, ends, shards;
        std::vector<KeyPlan> plans;
        std::vector<py::object> id_objects;  // exact-int block ids reusable as output (empty otherwise)
        std::shared_ptr<const Templates> templates;
        uint64_t generation = 0;  // the cache generation `templates` belongs to
    };

    Parsed with_templates(Parsed p) {
        take_snapshot(p);
        return p;
    }

    // The template snapshot and the cache generation it belongs to, taken together (no Python code runs
    // between the install in sync_regions and the read of generation_). Rows computed from this snapshot are
    // only looked up in, and inserted into, the cache of that generation: a callback that re-registers the
    // layout later in the call (and a nested call that syncs the new regions) cannot make this call read rows
    // of the new regions, nor leave rows of the old ones cached under the new generation.
    void take_snapshot(Parsed& p) {
        p.templates = current_templates();
        p.generation = generation_;
    }

    std::shared_ptr<const Templates> current_templates() { return tp_shared_ ? templates_ : sync_regions(); }

    void require_rank_local(const char* what) const {
        if (tp_shared_) raise(PyExc_RuntimeError, std::string(what) + " is for the rank-local layout");
    }

    // Every input to C++ values, in vLLM 0.33's error order.
    Parsed parse(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        Parsed p;
        std::vector<int64_t> shards = int_values(shard_ids, "shard_ids");
        const Py_ssize_t n_chunks = PyObject_Length(chunks.ptr());
        if (n_chunks < 0) throw py::error_already_set();
        if (static_cast<std::size_t>(n_chunks) != shards.size()) {
            if (tp_shared_) raise(PyExc_ValueError, "Each Store chunk must have one shard ID");
            raise(PyExc_AssertionError, "rank-local layout: one shard id per chunk, all 0");
        }
        if (!tp_shared_) {
            for (int64_t s : shards) {
                if (s != 0) raise(PyExc_AssertionError, "rank-local layout: shard id " + std::to_string(s) + " is not 0");
            }
        }
        take_snapshot(p);
        chunk_bounds(chunks, &p.starts, &p.ends);
        if (p.starts.size() != shards.size()) {
            if (PyList_CheckExact(chunks.ptr())) raise(PyExc_RuntimeError, "chunks changed size during the call");
            // Not an exact list: nothing but its own __len__ can disagree with its items.
            raise(PyExc_ValueError, "chunks reported " + std::to_string(n_chunks) + " items (__len__) but gave " +
                                        std::to_string(p.starts.size()) + ": its __len__ does not match its items");
        }
        p.shards = std::move(shards);
        validate(p);
        resolve(p, block_ids);
        return p;
    }

    // Span rules and shard ownership → plans (block ids not yet resolved).
    void validate(Parsed& p) const {
        const std::size_t n = p.starts.size();
        p.plans.assign(n, KeyPlan{0, 0, 1});
        for (std::size_t k = 0; k < n; ++k) {
            int64_t span = 0;
            if (__builtin_sub_overflow(p.ends[k], p.starts[k], &span)) {
                raise(PyExc_OverflowError, "key " + std::to_string(k) + ": end - start overflows int64");
            }
            if (tp_shared_) {
                if (span != block_size_) raise(PyExc_ValueError, "TP-shared Mooncake store requires full KV blocks");
            } else {
                if (span % hash_block_size_ != 0) {
                    raise(errors().chunk_alignment, "chunk " + std::to_string(k) + " (" + std::to_string(p.starts[k]) +
                                                        ", " + std::to_string(p.ends[k]) + "): span is not a multiple "
                                                        "of hash_block_size " + std::to_string(hash_block_size_));
                }
                p.plans[k].block_count = ceil_div(span, block_size_);
            }
        }
        if (tp_shared_) {
            // vLLM reads its first shard id here: a rank that owns none (store TP < local TP) fails as it does.
            if (rows_.empty()) raise(PyExc_IndexError, "this TP rank owns no store shard (store TP < local TP)");
            const auto owned = static_cast<int64_t>(rows_.size());
            for (std::size_t k = 0; k < n; ++k) {
                // Compare before subtracting: a caller's shard id may be any int64 (first_shard_ >= 0, so
                // shards[k] - first_shard_ cannot overflow once shards[k] >= first_shard_).
                if (p.shards[k] < first_shard_ || p.shards[k] - first_shard_ >= owned) {
                    raise(PyExc_ValueError, "Store shard is not owned by this TP rank");
                }
                p.plans[k].shard = static_cast<std::size_t>(p.shards[k] - first_shard_);
            }
        }
    }

    // block_ids[start // block_size] for every key (Python indexing), as C++ values.
    void resolve(Parsed& p, py::handle block_ids) const {
        const std::size_t n = p.plans.size();
        p.id_objects.resize(n);
        std::vector<int64_t> from_array;
        if (array_values(block_ids, "block_ids", &from_array)) {
            for (std::size_t k = 0; k < n; ++k) {
                p.plans[k].block_id = from_array[static_cast<std::size_t>(
                    wrap_index(floor_div(p.starts[k], block_size_), from_array.size(), k))];
                check_block_id(p.plans[k].block_id);
            }
            return;
        }
        check_id_container(block_ids.ptr(), "block_ids");
        if (!PyList_CheckExact(block_ids.ptr()) && !PyTuple_CheckExact(block_ids.ptr())) {
            // A list, tuple or ndarray subclass: its own __len__/__getitem__, as vLLM's block_ids[i].
            resolve_by_index(p, block_ids);
            return;
        }
        FastSequence ids(block_ids.ptr(), "block_ids");
        for (std::size_t k = 0; k < n; ++k) {
            const int64_t at = wrap_index(floor_div(p.starts[k], block_size_), static_cast<std::size_t>(ids.size()), k);
            py::object item = ids.at(static_cast<Py_ssize_t>(at));
            p.plans[k].block_id = as_int64(item.ptr(), "block id");
            check_block_id(p.plans[k].block_id);
            if (PyLong_CheckExact(item.ptr())) p.id_objects[k] = std::move(item);
        }
    }

    // resolve() for a list or tuple subclass: len() and block_ids[i] through the object's own methods.
    void resolve_by_index(Parsed& p, py::handle block_ids) const {
        const Py_ssize_t length = PyObject_Length(block_ids.ptr());
        if (length < 0) throw py::error_already_set();
        for (std::size_t k = 0; k < p.plans.size(); ++k) {
            const int64_t at = wrap_index(floor_div(p.starts[k], block_size_), static_cast<std::size_t>(length), k);
            py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(block_ids.ptr(), at));
            if (!item) throw py::error_already_set();
            p.plans[k].block_id = as_int64(item.ptr(), "block id");
            check_block_id(p.plans[k].block_id);
            if (PyLong_CheckExact(item.ptr())) p.id_objects[k] = std::move(item);
        }
    }

    // TP-shared layouts compute in uint64 in vLLM, which rejects negative block ids.
    void check_block_id(int64_t id) const {
        if (tp_shared_ && id < 0) raise(PyExc_OverflowError, "block id " + std::to_string(id) + " is negative");
    }

    py::tuple materialize_lists(Parsed& p) {
        const std::shared_ptr<const Templates> templates = p.templates;  // keeps the snapshot alive
        const uint64_t generation = p.generation;  // the snapshot's, not the current one (see take_snapshot)
        const auto n = static_cast<Py_ssize_t>(p.plans.size());
        py::list addr_rows(n), size_rows(n), ids(n);
        std::vector<int64_t> scratch;
        for (Py_ssize_t k = 0; k < n; ++k) {
            const KeyPlan& plan = p.plans[static_cast<std::size_t>(k)];
            const Segments& t = (*templates)[plan.shard];
            py::object size = size_tuple(t, plan, generation, scratch, k);
            if (immutable_rows_) {
                PyList_SET_ITEM(addr_rows.ptr(), k, address_tuple(t, plan, generation, scratch, k).release().ptr());
                PyList_SET_ITEM(size_rows.ptr(), k, size.release().ptr());
            } else {
                PyList_SET_ITEM(addr_rows.ptr(), k, address_list(t, plan, generation, scratch, k));
                PyList_SET_ITEM(size_rows.ptr(), k, list_from_tuple(size.ptr()));
            }
            py::object id = std::move(p.id_objects[static_cast<std::size_t>(k)]);
            if (!id) id = py::int_(plan.block_id);
            PyList_SET_ITEM(ids.ptr(), k, id.release().ptr());
        }
        return py::make_tuple(std::move(addr_rows), std::move(size_rows), std::move(ids));
    }

    py::tuple materialize_arrays(const Parsed& p) {
        const std::shared_ptr<const Templates> templates = p.templates ? p.templates : current_templates();
        const std::size_t n = p.plans.size();
        const std::size_t width = n == 0 || templates->empty() ? 0 : (*templates)[0].count();
        BufferPool& pool = BufferPool::instance();
        py::array_t<int64_t> addrs = pool.new_array({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(width)});
        py::array_t<int64_t> sizes = pool.new_array({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(width)});
        py::array_t<int64_t> ids = pool.new_array({static_cast<py::ssize_t>(n)});
        int64_t* addr_out = addrs.mutable_data();
        int64_t* size_out = sizes.mutable_data();
        int64_t* id_out = ids.mutable_data();
        std::size_t failed = n;
        {
            // Safe without the GIL: only C++ values are read (the immutable template snapshot, held by
            // `templates`; the local plans), and the arrays are not yet visible to Python.
            std::unique_ptr<py::gil_scoped_release> release;
            if (n * width >= g_layout_gil_release_min_cells) release = std::make_unique<py::gil_scoped_release>();
            for (std::size_t k = 0; k < n; ++k) id_out[k] = p.plans[k].block_id;
            failed = layout::fill_rows(*templates, p.plans, width, addr_out, size_out);
        }
        if (failed != n) raise_overflow(failed, p.plans[failed].block_id);
        return py::make_tuple(std::move(addrs), std::move(sizes), std::move(ids));
    }

    // A fresh list with the address row of (shard, block id): from the cache, or built (and cached when this
    // is the id's second sighting: never-seen ids — the cold path — pay no caching cost).
    PyObject* address_list(const Segments& t, const KeyPlan& plan, uint64_t generation, std::vector<int64_t>& scratch,
                           Py_ssize_t key) {
        auto& shard = rows_[plan.shard];
        auto hit = generation == generation_ ? shard.find(plan.block_id) : shard.end();
        if (hit != shard.end()) {
            ++hits_;
            // Own a reference: building the list allocates, and a GC pass may clear the cache meanwhile.
            py::object row = py::reinterpret_borrow<py::object>(hit->second);
            return list_from_tuple(row.ptr());
        }
        ++misses_;
        scratch.resize(t.count());
        if (!layout::address_row(t, plan.block_id, scratch.data())) raise_overflow(static_cast<std::size_t>(key), plan.block_id);
        if (!admit(plan.shard, plan.block_id, t.count())) return new_int_list(scratch.data(), scratch.size());
        py::object row = int_tuple(scratch.data(), scratch.size());
        // Creating the ints may have run Python code that re-registered the layout: never cache a stale row.
        if (generation == generation_) remember(plan.shard, plan.block_id, row.ptr(), t.count());
        return list_from_tuple(row.ptr());
    }

    // The immutable form: the cached tuple itself (shared by every call that asks for it, which is safe because
    // a tuple of ints never changes), or a fresh tuple.
    py::object address_tuple(const Segments& t, const KeyPlan& plan, uint64_t generation,
                             std::vector<int64_t>& scratch, Py_ssize_t key) {
        auto& shard = rows_[plan.shard];
        auto hit = generation == generation_ ? shard.find(plan.block_id) : shard.end();
        if (hit != shard.end()) {
            ++hits_;
            return py::reinterpret_borrow<py::object>(hit->second);
        }
        ++misses_;
        scratch.resize(t.count());
        if (!layout::address_row(t, plan.block_id, scratch.data())) raise_overflow(static_cast<std::size_t>(key), plan.block_id);
        py::object row = int_tuple(scratch.data(), scratch.size());
        if (admit(plan.shard, plan.block_id, t.count()) && generation == generation_) {
            remember(plan.shard, plan.block_id, row.ptr(), t.count());
        }
        return row;
    }

    // Whether a missed row should be cached: on its block id's second sighting. The sightings set is bounded
    // (cleared when it outgrows the number of rows the cache can hold, times four).
    bool admit(std::size_t shard, int64_t block_id, std::size_t width) {
        const std::size_t cost = row_cost(width);
        if (cost > cache_capacity_) return false;
        const uint64_t id = (static_cast<uint64_t>(shard) << 48) ^ static_cast<uint64_t>(block_id);
        if (seen_.erase(id) != 0) return true;
        if (seen_.size() >= 4 * (cache_capacity_ / cost) + 64) seen_.clear();
        seen_.insert(id);
        return false;
    }

    py::object size_tuple(const Segments& t, const KeyPlan& plan, uint64_t generation, std::vector<int64_t>& scratch,
                          Py_ssize_t key) {
        const int64_t count = t.size_scales ? plan.block_count : 1;
        const std::pair<std::size_t, int64_t> id{plan.shard, count};
        if (generation == generation_) {
            for (const auto& entry : size_rows_) {
                if (entry.first == id) return py::reinterpret_borrow<py::object>(entry.second);
            }
        }
        scratch.resize(t.count());
        if (!layout::size_row(t, count, scratch.data())) {
            raise(PyExc_OverflowError, "key " + std::to_string(key) + ": segment size * " + std::to_string(count) +
                                           " blocks overflows int64");
        }
        py::object row = int_tuple(scratch.data(), scratch.size());
        if (generation == generation_ && size_rows_.size() < kMaxSizeRows && !has_size_row(id)) {
            size_rows_.emplace_back(id, row.inc_ref().ptr());
        }
        return row;
    }

    // Approximate bytes a cached row keeps alive: the tuple and its int objects.
    static std::size_t row_cost(std::size_t width) { return 64 + width * (8 + 32); }

    bool has_size_row(const std::pair<std::size_t, int64_t>& id) const {
        for (const auto& entry : size_rows_) {
            if (entry.first == id) return true;
        }
        return false;
    }

    // Caches `row` unless the (shard, block id) is cached already: building the row allocated, and a GC pass
    // there may have run a finalizer whose nested call cached the same row (a second entry would leak a
    // reference and leave an order_ entry whose eviction finds nothing).
    void remember(std::size_t shard, int64_t block_id, PyObject* row, std::size_t width) {
        const std::size_t cost = row_cost(width);
        if (cost > cache_capacity_ || rows_[shard].count(block_id) != 0) return;
        while (cache_bytes_ + cost > cache_capacity_) evict_oldest();
        Py_INCREF(row);
        rows_[shard].emplace(block_id, row);
        order_.push_back({shard, block_id, cost});
        cache_bytes_ += cost;
    }

    void evict_oldest() {
        const Entry e = order_.front();
        order_.pop_front();
        auto& shard = rows_[e.shard];
        auto it = shard.find(e.block_id);
        PyObject* row = it->second;
        shard.erase(it);
        cache_bytes_ -= e.cost;
        Py_DECREF(row);
    }

    // Re-reads the caller's region lists; rebuilds the snapshot (dropping cached rows) when they changed.
    std::shared_ptr<const Templates> sync_regions() {
        if (tp_shared_) return templates_;
        FastSequence base(base_source_.ptr(), "kv_caches_base_addr");
        FastSequence block_len(block_len_source_.ptr(), "block_len");
        std::vector<int64_t> bases, lens;
        const Py_ssize_t n_regions = base.size();
        bases.reserve(static_cast<std::size_t>(n_regions));
        for (Py_ssize_t r = 0; r < n_regions; ++r) {
            bases.push_back(as_int64(base.at(r).ptr(), "kv_caches_base_addr item"));
        }
        const bool needs_lens = !bases.empty();
        if (needs_lens) {
            const Py_ssize_t n_lens = block_len.size();
            for (Py_ssize_t i = 0; i < n_lens; ++i) lens.push_back(as_int64(block_len.at(i).ptr(), "block_len item"));
        }
        pin_.check(bases, lens);  // the values this call computes from, against a transfer's registration
        if (synced_ && bases == seen_bases_ && lens == seen_lens_) return templates_;
        if (needs_lens && lens.empty()) {
            raise(errors().block_len, "block_len is empty but " + std::to_string(bases.size()) +
                                          " KV-cache regions are registered: call set_block_len first");
        }
        auto fresh = std::make_shared<Templates>(1);
        Segments& t = fresh->front();
        t.size_scales = true;
        t.base = bases;
        t.stride.resize(bases.size());
        for (std::size_t r = 0; r < bases.size(); ++r) t.stride[r] = lens[r % lens.size()];
        t.size = t.stride;
        t.finalize();
        clear_cache();
        seen_bases_ = std::move(bases);
        seen_lens_ = std::move(lens);
        templates_ = std::move(fresh);
        synced_ = true;
        return templates_;
    }

    [[noreturn]] void raise_overflow(std::size_t key, int64_t block_id) const {
        raise(PyExc_OverflowError, "key " + std::to_string(key) + ": base + block_id * stride overflows int64 for "
                                   "block id " + std::to_string(block_id));
    }

    struct Entry {
        std::size_t shard;
        int64_t block_id;
        std::size_t cost;
    };

    int64_t block_size_;
    int64_t hash_block_size_;
    bool tp_shared_;
    int64_t first_shard_;
    std::shared_ptr<const Templates> templates_;
    py::object base_source_, block_len_source_;
    std::vector<int64_t> seen_bases_, seen_lens_;
    RegionPin pin_;
    bool synced_ = false;
    uint64_t generation_ = 0;
    std::vector<std::unordered_map<int64_t, PyObject*>> rows_;  // per local shard: block id → address tuple
    std::deque<Entry> order_;
    std::unordered_set<uint64_t> seen_;  // (shard, block id) seen once, not yet cached (a hint only)
    std::vector<std::pair<std::pair<std::size_t, int64_t>, PyObject*>> size_rows_;
    std::size_t cache_bytes_ = 0;
    std::size_t cache_capacity_;
    uint64_t hits_ = 0, misses_ = 0;

public:
    bool immutable_rows_ = false;  // rows as shared tuples instead of fresh lists
};

}  // namespace

void register_layout(py::module_& m) {
    m.def("layout_gil_release_min_cells", []() { return g_layout_gil_release_min_cells; },
          "Cells from which LayoutEngine array outputs release the GIL.");
    m.def("set_layout_gil_release_min_cells",
          [](py::handle cells) { g_layout_gil_release_min_cells = as_size(cells.ptr(), "cells"); }, py::arg("cells"));
    // Every method goes through checked()/constructed() (common.hpp): an instance made by __new__ without
    // __init__ raises TypeError. Ints are converted with as_int64/as_size, never pybind11's int casters.
    py::class_<LayoutEngine>(m, "LayoutEngine", "Segment templates of one store layout → Mooncake descriptors.")
        .def(py::init([](py::handle block_size, py::handle hash_block_size, bool tp_shared, py::handle first_shard,
                         py::handle n_shards, py::handle cache_bytes) {
                 const int64_t bs = as_int64(block_size.ptr(), "block_size");
                 const int64_t hbs = as_int64(hash_block_size.ptr(), "hash_block_size");
                 const int64_t first = as_int64(first_shard.ptr(), "first_shard");
                 const int64_t count = as_int64(n_shards.ptr(), "n_shards");
                 const std::size_t cache = as_size(cache_bytes.ptr(), "cache_bytes");
                 return std::make_unique<LayoutEngine>(bs, hbs, tp_shared, first, count, cache);
             }),
             py::arg("block_size"), py::arg("hash_block_size"), py::arg("tp_shared"), py::arg("first_shard"),
             py::arg("n_shards"), py::arg("cache_bytes"))
        .def("set_region_sources", checked(&LayoutEngine::set_region_sources), py::arg("kv_caches_base_addr"),
             py::arg("block_len"))
        .def("set_templates", checked(&LayoutEngine::set_templates), py::arg("templates"))
        .def("prepare_values", checked(&LayoutEngine::prepare_values), py::arg("chunks"), py::arg("block_ids"),
             py::arg("shard_ids"))
        .def("prepare_values_array", checked(&LayoutEngine::prepare_values_array), py::arg("chunks"),
             py::arg("block_ids"), py::arg("shard_ids"))
        .def("prepare_value_for_block", checked(&LayoutEngine::prepare_value_for_block), py::arg("block_id"))
        .def("plan_load", checked(&LayoutEngine::plan_load), py::arg("shard_prefixes"), py::arg("hashes"),
             py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"),
             py::arg("tail_tokens"), py::arg("block_ids"), py::arg("arrays") = false)
        .def_property(
            "cache_capacity", checked(&LayoutEngine::cache_capacity),
            [](py::handle self, py::handle bytes) {
                constructed<LayoutEngine>(self).set_cache_capacity(as_size(bytes.ptr(), "cache_capacity"));
            })
        .def_property(
            "immutable_rows", [](py::handle self) { return constructed<LayoutEngine>(self).immutable_rows_; },
            [](py::handle self, bool value) { constructed<LayoutEngine>(self).immutable_rows_ = value; },
            "Rows as shared immutable tuples (no per-call copy) instead of fresh lists.")
        .def("cache_info", checked(&LayoutEngine::cache_info))
        .def("clear_cache", checked(&LayoutEngine::clear_cache))
        .def("pin_regions", checked(&LayoutEngine::pin_regions), py::arg("kv_caches_base_addr"), py::arg("block_len"))
        .def("unpin_regions", checked(&LayoutEngine::unpin_regions))
        .def_property_readonly("region_pins", checked(&LayoutEngine::region_pins))
        .def_property_readonly("segment_count", checked(&LayoutEngine::segment_count));
}

}  // namespace kvaddr::py_bindings
