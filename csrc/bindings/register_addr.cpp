// Bindings of the address/size matrix (SPEC.md §2): AddressTable backs ChunkedTokenDatabase.
//
// Arguments are parsed and validated with the GIL held, in the reference's error order (empty → span
// alignment → block index); the arithmetic is kvaddr/address.hpp. The list output is dominated by creating
// Python objects (PERF.md), so it shares size rows, caches address rows per block id, and untracks rows from
// the cyclic GC. The array output creates no per-element objects and releases the GIL around the pure loop.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings/buffer_pool.hpp"
#include "bindings/common.hpp"
#include "bindings/keys.hpp"
#include "kvaddr/address.hpp"

namespace kvaddr::py_bindings {

namespace {

// Below this many matrix cells the array output keeps the GIL. Re-acquiring it after a release waits up to a
// whole switch interval (5 ms) when another Python thread is busy (PERF.md point 5); beside a spinning thread
// the headline request (225,800 cells, ~0.2 ms of work) took ~5.5 ms per call with the release and ~0.3 ms
// without. So release only for work that is itself of the order of a switch interval (~4M cells, ~3 ms).
// Settable for experiments (set_gil_release_min_cells).
std::size_t g_gil_release_min_cells = std::size_t{1} << 22;
// Distinct block counts whose size rows are kept across calls (production chunks all have count 1).
constexpr std::size_t kMaxSharedSizeRows = 64;

// A list of Python ints, untracked by the cyclic GC: it holds only ints, so it cannot be part of a cycle
// unless a caller mutates it, and rows are documented read-only. Untracking spares the collector from
// re-scanning hundreds of thousands of row items on every collection (PERF.md point 2).
PyObject* new_int_row(const int64_t* values, std::size_t count) {
    PyObject* row = PyList_New(static_cast<Py_ssize_t>(count));
    if (row == nullptr) throw py::error_already_set();
    for (std::size_t i = 0; i < count; ++i) {
        PyObject* item = PyLong_FromLongLong(values[i]);
        if (item == nullptr) {
            Py_DECREF(row);
            throw py::error_already_set();
        }
        PyList_SET_ITEM(row, static_cast<Py_ssize_t>(i), item);
    }
    PyObject_GC_UnTrack(row);
    return row;
}

// The (start, end) pair of one chunk: tuples and lists directly, anything indexable through __getitem__.
std::pair<int64_t, int64_t> chunk_bounds(PyObject* chunk, Py_ssize_t index) {
    const std::string what = "chunk " + std::to_string(index);
    if ((PyTuple_CheckExact(chunk) || PyList_CheckExact(chunk)) && PySequence_Fast_GET_SIZE(chunk) >= 2) {
        return {as_int64(PySequence_Fast_GET_ITEM(chunk, 0), (what + " start").c_str()),
                as_int64(PySequence_Fast_GET_ITEM(chunk, 1), (what + " end").c_str())};
    }
    py::object start = py::reinterpret_steal<py::object>(PySequence_GetItem(chunk, 0));
    if (!start) throw py::error_already_set();
    py::object end = py::reinterpret_steal<py::object>(PySequence_GetItem(chunk, 1));
    if (!end) throw py::error_already_set();
    return {as_int64(start.ptr(), (what + " start").c_str()), as_int64(end.ptr(), (what + " end").c_str())};
}

// Read access to block_ids: an int64 numpy vector directly, any other sequence through PySequence_Fast.
class BlockIds {
public:
    explicit BlockIds(py::handle obj) {
        if (py::isinstance<py::array>(obj)) {
            py::array arr = py::reinterpret_borrow<py::array>(obj);
            if (arr.ndim() == 1 && arr.dtype().is(py::dtype::of<int64_t>())) {
                array_ = py::array_t<int64_t>::ensure(arr);
                is_array_ = static_cast<bool>(array_);
            }
        }
        if (!is_array_) {
            seq_ = std::make_unique<FastSequence>(obj.ptr(), "block_ids");
        }
    }

    Py_ssize_t size() const { return is_array_ ? static_cast<Py_ssize_t>(array_.shape(0)) : seq_->size(); }

    // The id at a validated index; `object` receives the item when it is an exact int (reusable as output
    // without allocating), else stays empty.
    int64_t at(Py_ssize_t index, py::object* object) const {
        if (is_array_) return array_.at(index);
        py::object item = seq_->at(index);
        const int64_t id = as_int64(item.ptr(), "block id");
        if (PyLong_CheckExact(item.ptr())) *object = std::move(item);
        return id;
    }

private:
    bool is_array_ = false;
    py::array_t<int64_t> array_;
    std::unique_ptr<FastSequence> seq_;
};

class AddressTable {
public:
    AddressTable(int64_t block_size, int64_t hash_block_size, std::size_t cache_bytes)
        : block_size_(block_size), hash_block_size_(hash_block_size), cache_capacity_(cache_bytes) {
        if (block_size <= 0) throw py::value_error("block_size must be positive, got " + std::to_string(block_size));
        if (hash_block_size <= 0 || block_size % hash_block_size != 0) {
            throw py::value_error("block_size " + std::to_string(block_size) +
                                  " must be a positive multiple of hash_block_size " +
                                  std::to_string(hash_block_size));
        }
        regions_ = std::make_shared<const Regions>();
        base_source_ = py::list();
        block_len_source_ = py::list();
    }

    AddressTable(const AddressTable&) = delete;
    AddressTable& operator=(const AddressTable&) = delete;
    ~AddressTable() { clear_cache(); }

    // Keeps references to the caller's lists (the reference stores them by reference too); contents are
    // read, validated and snapshotted lazily by the next call that needs them.
    void set_regions(py::object base, py::object block_len) {
        base_source_ = std::move(base);
        block_len_source_ = std::move(block_len);
    }

    py::tuple prepare_values(py::handle chunks, py::handle block_ids) {
        FastSequence chunk_seq(chunks.ptr(), "chunks");
        if (chunk_seq.size() == 0) return py::make_tuple(py::list(), py::list(), py::list());

        // Regions first, then every span, then block ids: the reference's error order.
        std::shared_ptr<const Regions> regions = sync_regions();
        std::vector<int64_t> starts;
        std::vector<ChunkPlan> plans;
        parse_chunks(chunk_seq, &starts, &plans);
        return materialize(std::move(regions), starts, std::move(plans), block_ids);
    }

    // The receive thread's whole per-group preparation in one call (SPEC.md §3.3): walk the chunks of
    // [mask_num, token_len) kept by the absolute `load_mask`, build their keys, and their address rows,
    // size rows and block ids. Returns (keys, addr_rows, size_rows, block_ids), index-aligned.
    py::tuple plan_load(py::handle prefix, py::handle hashes, py::handle hash_len, int64_t token_len,
                        int64_t mask_num, py::handle load_mask, py::handle block_ids) {
        KeyWriter writer(prefix);
        HashSource source(hashes, hash_len);
        WalkParams params{token_len, block_size_, hash_block_size_, mask_num, 1, 0};
        const std::vector<WalkedChunk> chunks = walk(params, source.size(), load_mask, true);
        std::vector<int64_t> starts, hash_indices;
        std::vector<ChunkPlan> plans;
        for (const WalkedChunk& c : chunks) {
            starts.push_back(c.start);
            hash_indices.push_back(c.hash_index);
            plans.push_back(ChunkPlan{0, ceil_div(c.end - c.start, block_size_)});
        }
        py::list keys = build_key_list(writer, source, hash_indices);
        if (chunks.empty()) return py::make_tuple(std::move(keys), py::list(), py::list(), py::list());
        py::tuple rows = materialize(sync_regions(), starts, std::move(plans), block_ids);
        return py::make_tuple(std::move(keys), rows[0], rows[1], rows[2]);
    }

    // The send thread's candidates for one group (SPEC.md §3.2 step 4): the walk with the relative store
    // mask and this rank's put stripe, minus chunks past `block_ids` (and NULL block 0 when `skip_null`).
    // Returns (keys, chunks as (start, end) tuples, block ids); rows come later, for the missing ones only.
    py::tuple plan_store(py::handle prefix, py::handle hashes, py::handle hash_len, int64_t token_len,
                         int64_t mask_num, py::handle chunk_mask, int64_t put_step, int64_t put_step_rank,
                         py::handle block_ids, bool skip_null) {
        KeyWriter writer(prefix);
        HashSource source(hashes, hash_len);
        WalkParams params{token_len, block_size_, hash_block_size_, mask_num, put_step, put_step_rank};
        const std::vector<WalkedChunk> walked = walk(params, source.size(), chunk_mask, false);
        BlockIds ids(block_ids);
        std::vector<int64_t> hash_indices;
        py::list spans, kept_ids;
        for (const WalkedChunk& c : walked) {
            const int64_t block_index = c.start / block_size_;
            if (block_index >= ids.size()) continue;
            py::object id_object;
            const int64_t id = ids.at(static_cast<Py_ssize_t>(block_index), &id_object);
            if (skip_null && id == 0) continue;
            hash_indices.push_back(c.hash_index);
            spans.append(py::make_tuple(c.start, c.end));
            kept_ids.append(id_object ? id_object : py::int_(id));
        }
        py::list keys = build_key_list(writer, source, hash_indices);
        return py::make_tuple(std::move(keys), std::move(spans), std::move(kept_ids));
    }

private:
    // Rows of already validated chunks (plans hold block counts; block ids are resolved here).
    py::tuple materialize(std::shared_ptr<const Regions> regions, const std::vector<int64_t>& starts,
                          std::vector<ChunkPlan> plans, py::handle block_ids) {
        // `regions` is a local owner: building rows allocates, a GC pass may run Python code that lets
        // another thread re-register regions; this call keeps computing on the snapshot it validated against.
        const auto n = static_cast<Py_ssize_t>(plans.size());
        std::vector<py::object> id_objects;
        resolve_block_ids(block_ids, starts, &plans, &id_objects);

        const std::size_t n_regions = regions->size();
        const uint64_t generation = generation_;
        py::list addr_rows(n), size_rows(n), chunk_ids(n);
        std::vector<int64_t> scratch(n_regions);
        for (Py_ssize_t c = 0; c < n; ++c) {
            const ChunkPlan& plan = plans[static_cast<std::size_t>(c)];
            PyList_SET_ITEM(addr_rows.ptr(), c, address_row_object(*regions, generation, plan.block_id, scratch, c));
            PyList_SET_ITEM(size_rows.ptr(), c, size_row_object(*regions, generation, plan.block_count, scratch, c));
            PyObject* id = id_objects[static_cast<std::size_t>(c)].release().ptr();
            if (id == nullptr) {
                id = PyLong_FromLongLong(plan.block_id);
                if (id == nullptr) throw py::error_already_set();
            }
            PyList_SET_ITEM(chunk_ids.ptr(), c, id);
        }
        return py::make_tuple(std::move(addr_rows), std::move(size_rows), std::move(chunk_ids));
    }

public:

    py::tuple prepare_values_array(py::handle chunks, py::handle block_ids) {
        const Py_ssize_t length = PyObject_Length(chunks.ptr());
        if (length < 0) throw py::error_already_set();
        std::shared_ptr<const Regions> regions =
            length == 0 ? std::make_shared<const Regions>() : sync_regions();
        std::vector<int64_t> starts;
        std::vector<ChunkPlan> plans;
        parse_chunk_input(chunks, &starts, &plans);
        const std::size_t n = plans.size();
        if (n != 0) {
            std::vector<py::object> id_objects;
            resolve_block_ids(block_ids, starts, &plans, &id_objects);
        }
        const std::size_t n_regions = n == 0 ? 0 : regions->size();
        BufferPool& pool = BufferPool::instance();
        const auto rows = static_cast<py::ssize_t>(n);
        const auto cols = static_cast<py::ssize_t>(n_regions);
        py::array_t<int64_t> addrs = pool.new_array({rows, cols});
        py::array_t<int64_t> sizes = pool.new_array({rows, cols});
        py::array_t<int64_t> ids = pool.new_array({rows});
        int64_t* addr_out = addrs.mutable_data();
        int64_t* size_out = sizes.mutable_data();
        int64_t* id_out = ids.mutable_data();
        std::size_t failed = n;
        {
            // Safe without the GIL: only C++ data is touched — `regions` is an immutable snapshot kept alive by
            // this shared_ptr, `plans` is local, and the output arrays are not yet visible to Python.
            std::unique_ptr<py::gil_scoped_release> release;
            if (n * n_regions >= g_gil_release_min_cells) release = std::make_unique<py::gil_scoped_release>();
            for (std::size_t c = 0; c < n; ++c) id_out[c] = plans[c].block_id;
            failed = fill_matrix(*regions, plans, addr_out, size_out);
        }
        if (failed != n) raise_overflow(failed, plans[failed].block_id);
        return py::make_tuple(std::move(addrs), std::move(sizes), std::move(ids));
    }

    py::tuple prepare_value_for_block(py::handle block_id) {
        const int64_t id = as_int64(block_id.ptr(), "block_id");
        std::shared_ptr<const Regions> regions = sync_regions();
        std::vector<int64_t> values(regions->size());
        if (!address_row(*regions, id, values.data())) raise_overflow(0, id);
        py::object addrs = py::reinterpret_steal<py::object>(new_int_row(values.data(), values.size()));
        py::object sizes = py::reinterpret_steal<py::object>(new_int_row(regions->blen.data(), regions->size()));
        return py::make_tuple(std::move(addrs), std::move(sizes));
    }

    std::size_t cache_capacity() const { return cache_capacity_; }
    void set_cache_capacity(std::size_t bytes) {
        cache_capacity_ = bytes;
        while (cache_bytes_ > cache_capacity_) evict_oldest();
    }

    py::dict cache_info() const {
        py::dict info;
        info["entries"] = cached_rows_.size();
        info["bytes"] = cache_bytes_;
        info["capacity_bytes"] = cache_capacity_;
        info["hits"] = cache_hits_;
        info["misses"] = cache_misses_;
        return info;
    }

    void clear_cache() {
        ++generation_;
        // Detach before releasing: a DECREF cannot run Python code for int rows, but keep the maps
        // consistent even if it did.
        auto rows = std::move(cached_rows_);
        auto size_rows = std::move(shared_size_rows_);
        cached_rows_.clear();
        shared_size_rows_.clear();
        cache_order_.clear();
        cache_bytes_ = 0;
        for (auto& entry : rows) Py_DECREF(entry.second);
        for (auto& entry : size_rows) Py_DECREF(entry.second);
    }

    int64_t block_size() const { return block_size_; }
    int64_t hash_block_size() const { return hash_block_size_; }

private:
    // Pass 1 over every chunk, before any block id is looked up (the reference's error order).
    void parse_chunks(const FastSequence& chunks, std::vector<int64_t>* starts, std::vector<ChunkPlan>* plans) {
        const Py_ssize_t n = chunks.size();
        starts->resize(static_cast<std::size_t>(n));
        plans->resize(static_cast<std::size_t>(n));
        for (Py_ssize_t c = 0; c < n; ++c) {
            py::object chunk = chunks.at(c);
            const auto [start, end] = chunk_bounds(chunk.ptr(), c);
            add_plan(c, start, end, starts, plans);
        }
    }

    // The array output also takes an (n, 2) integer ndarray of (start, end) without per-chunk objects.
    void parse_chunk_input(py::handle chunks, std::vector<int64_t>* starts, std::vector<ChunkPlan>* plans) {
        if (py::isinstance<py::array>(chunks)) {
            py::array arr = py::reinterpret_borrow<py::array>(chunks);
            const char kind = arr.dtype().kind();
            const bool fits_int64 = kind == 'i' || (kind == 'u' && arr.itemsize() < 8);
            if (arr.ndim() == 2 && arr.shape(1) >= 2 && fits_int64) {
                auto view = py::array_t<int64_t, py::array::forcecast>::ensure(arr);
                if (!view) throw py::error_already_set();
                auto cells = view.unchecked<2>();
                const py::ssize_t n = cells.shape(0);
                starts->resize(static_cast<std::size_t>(n));
                plans->resize(static_cast<std::size_t>(n));
                for (py::ssize_t c = 0; c < n; ++c) add_plan(c, cells(c, 0), cells(c, 1), starts, plans);
                return;
            }
        }
        parse_chunks(FastSequence(chunks.ptr(), "chunks"), starts, plans);
    }

    void add_plan(Py_ssize_t c, int64_t start, int64_t end, std::vector<int64_t>* starts,
                  std::vector<ChunkPlan>* plans) const {
        int64_t count = 0;
        switch (check_span(start, end, hash_block_size_, block_size_, &count)) {
            case ChunkError::misaligned:
                raise(errors().chunk_alignment,
                      "chunk " + std::to_string(c) + " (" + std::to_string(start) + ", " + std::to_string(end) +
                          "): span " + std::to_string(end - start) + " is not a multiple of hash_block_size " +
                          std::to_string(hash_block_size_));
            case ChunkError::overflow:
                raise(PyExc_OverflowError, "chunk " + std::to_string(c) + ": end - start overflows int64");
            case ChunkError::none:
                break;
        }
        (*starts)[static_cast<std::size_t>(c)] = start;
        (*plans)[static_cast<std::size_t>(c)] = ChunkPlan{0, count};
    }

    // block_ids[start // block_size] with Python list indexing (negative wraps, out of range → IndexError).
    void resolve_block_ids(py::handle block_ids, const std::vector<int64_t>& starts, std::vector<ChunkPlan>* plans,
                           std::vector<py::object>* id_objects) const {
        BlockIds ids(block_ids);
        const Py_ssize_t available = ids.size();
        id_objects->resize(starts.size());
        for (std::size_t c = 0; c < starts.size(); ++c) {
            const int64_t block_index = floor_div(starts[c], block_size_);
            int64_t index = block_index < 0 ? block_index + available : block_index;
            if (index < 0 || index >= available) {
                raise(PyExc_IndexError, "chunk " + std::to_string(c) + " starts at token " +
                                            std::to_string(starts[c]) + ": block index " +
                                            std::to_string(block_index) + " is out of range for " +
                                            std::to_string(available) + " block ids");
            }
            (*plans)[c].block_id = ids.at(static_cast<Py_ssize_t>(index), &(*id_objects)[c]);
        }
    }

    // Re-reads the caller's region lists and, when their contents changed (also in place), rebuilds the
    // snapshot and drops every cached row. O(R + L) int reads per call: ~1 µs at R = 100.
    std::shared_ptr<const Regions> sync_regions() {
        FastSequence base(base_source_.ptr(), "kv_caches_base_addr");
        FastSequence block_len(block_len_source_.ptr(), "block_len");
        if (!regions_changed(base, block_len)) return regions_;

        const Py_ssize_t n_regions = base.size();
        const Py_ssize_t n_lens = block_len.size();
        if (n_regions > 0 && n_lens == 0) {
            raise(errors().block_len, "block_len is empty but " + std::to_string(n_regions) +
                                          " KV-cache regions are registered: call set_block_len first");
        }
        auto fresh = std::make_shared<Regions>();
        std::vector<int64_t> seen_lens(static_cast<std::size_t>(n_lens));
        for (Py_ssize_t i = 0; i < n_lens; ++i) {
            seen_lens[static_cast<std::size_t>(i)] = as_int64(block_len.at(i).ptr(), "block_len item");
        }
        fresh->base.resize(static_cast<std::size_t>(n_regions));
        fresh->blen.resize(static_cast<std::size_t>(n_regions));
        for (Py_ssize_t r = 0; r < n_regions; ++r) {
            fresh->base[static_cast<std::size_t>(r)] = as_int64(base.at(r).ptr(), "kv_caches_base_addr item");
            fresh->blen[static_cast<std::size_t>(r)] = seen_lens[static_cast<std::size_t>(r % n_lens)];
        }
        fresh->finalize();
        synced_ = true;
        clear_cache();
        seen_lens_ = std::move(seen_lens);
        regions_ = std::move(fresh);
        row_cost_ = row_cost(regions_->size());
        return regions_;
    }

    bool regions_changed(const FastSequence& base, const FastSequence& block_len) const {
        if (!synced_) return true;
        const Regions& current = *regions_;
        if (static_cast<std::size_t>(base.size()) != current.size() ||
            static_cast<std::size_t>(block_len.size()) != seen_lens_.size()) {
            return true;
        }
        for (Py_ssize_t r = 0; r < base.size(); ++r) {
            if (as_int64(base.at(r).ptr(), "kv_caches_base_addr item") != current.base[static_cast<std::size_t>(r)]) return true;
        }
        for (Py_ssize_t i = 0; i < block_len.size(); ++i) {
            if (as_int64(block_len.at(i).ptr(), "block_len item") != seen_lens_[static_cast<std::size_t>(i)]) return true;
        }
        return false;
    }

    // New reference to the address row of `block_id`, from the cache or freshly built (and then cached).
    PyObject* address_row_object(const Regions& regions, uint64_t generation, int64_t block_id,
                                 std::vector<int64_t>& scratch, Py_ssize_t chunk) {
        auto hit = cached_rows_.find(block_id);
        if (hit != cached_rows_.end()) {
            ++cache_hits_;
            Py_INCREF(hit->second);
            return hit->second;
        }
        ++cache_misses_;
        if (!address_row(regions, block_id, scratch.data())) raise_overflow(static_cast<std::size_t>(chunk), block_id);
        PyObject* row = new_int_row(scratch.data(), scratch.size());
        // Building the row may have let another thread re-register regions: never cache a stale row.
        if (generation == generation_) remember_row(block_id, row);
        return row;
    }

    // New reference to the size row for `block_count` blocks; every chunk of a count shares one row.
    PyObject* size_row_object(const Regions& regions, uint64_t generation, int64_t block_count,
                              std::vector<int64_t>& scratch, Py_ssize_t chunk) {
        auto hit = shared_size_rows_.find(block_count);
        if (hit != shared_size_rows_.end()) {
            Py_INCREF(hit->second);
            return hit->second;
        }
        if (!size_row(regions, block_count, scratch.data())) {
            raise(PyExc_OverflowError, "chunk " + std::to_string(chunk) + ": block_len * " +
                                           std::to_string(block_count) + " blocks overflows int64");
        }
        PyObject* row = new_int_row(scratch.data(), scratch.size());
        if (generation == generation_ && shared_size_rows_.size() < kMaxSharedSizeRows) {
            Py_INCREF(row);
            shared_size_rows_.emplace(block_count, row);
        }
        return row;
    }

    // Approximate bytes one cached row keeps alive: the list (header + item pointers) and its int objects.
    static std::size_t row_cost(std::size_t n_regions) { return 72 + n_regions * (8 + 32); }

    void remember_row(int64_t block_id, PyObject* row) {
        const std::size_t cost = row_cost_;
        if (cost > cache_capacity_ || cached_rows_.count(block_id) != 0) return;
        while (cache_bytes_ + cost > cache_capacity_) evict_oldest();
        Py_INCREF(row);
        cached_rows_.emplace(block_id, row);
        cache_order_.push_back(block_id);
        cache_bytes_ += cost;
    }

    void evict_oldest() {
        const int64_t block_id = cache_order_.front();
        cache_order_.pop_front();
        auto it = cached_rows_.find(block_id);
        Py_DECREF(it->second);
        cached_rows_.erase(it);
        cache_bytes_ -= row_cost_;
    }

    [[noreturn]] void raise_overflow(std::size_t chunk, int64_t block_id) const {
        raise(PyExc_OverflowError, "chunk " + std::to_string(chunk) + ": base + block_id * block_len overflows "
                                   "int64 for block id " + std::to_string(block_id));
    }

    int64_t block_size_;
    int64_t hash_block_size_;
    py::object base_source_;
    py::object block_len_source_;
    std::shared_ptr<const Regions> regions_;
    std::vector<int64_t> seen_lens_;
    bool synced_ = false;  // regions_ reflects a successful read of the caller's lists
    uint64_t generation_ = 0;  // bumped whenever cached rows are dropped
    std::size_t row_cost_ = row_cost(0);

    std::unordered_map<int64_t, PyObject*> cached_rows_;
    std::deque<int64_t> cache_order_;
    std::size_t cache_bytes_ = 0;
    std::size_t cache_capacity_;
    uint64_t cache_hits_ = 0;
    uint64_t cache_misses_ = 0;
    std::unordered_map<int64_t, PyObject*> shared_size_rows_;
};

}  // namespace

void register_addr(py::module_& m) {
    m.def("gil_release_min_cells", []() { return g_gil_release_min_cells; },
          "Matrix cells from which prepare_values_array releases the GIL.");
    m.def("set_gil_release_min_cells", [](std::size_t cells) { g_gil_release_min_cells = cells; },
          py::arg("cells"), "Change the threshold (benchmarks and experiments).");
    py::class_<AddressTable>(m, "AddressTable",
                             "Address/size matrix of one KV-cache group over the registered regions.")
        .def(py::init<int64_t, int64_t, std::size_t>(), py::arg("block_size"), py::arg("hash_block_size"),
             py::arg("cache_bytes"))
        .def("set_regions", &AddressTable::set_regions, py::arg("kv_caches_base_addr"), py::arg("block_len"))
        .def("prepare_values", &AddressTable::prepare_values, py::arg("chunks"), py::arg("block_ids"))
        .def("prepare_values_array", &AddressTable::prepare_values_array, py::arg("chunks"), py::arg("block_ids"))
        .def("prepare_value_for_block", &AddressTable::prepare_value_for_block, py::arg("block_id"))
        .def("plan_load", &AddressTable::plan_load, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"),
             py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"), py::arg("block_ids"))
        .def("plan_store", &AddressTable::plan_store, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"),
             py::arg("token_len"), py::arg("mask_num"), py::arg("chunk_mask"), py::arg("put_step"),
             py::arg("put_step_rank"), py::arg("block_ids"), py::arg("skip_null"))
        .def_property("cache_capacity", &AddressTable::cache_capacity, &AddressTable::set_cache_capacity)
        .def("cache_info", &AddressTable::cache_info)
        .def("clear_cache", &AddressTable::clear_cache)
        .def_property_readonly("block_size", &AddressTable::block_size)
        .def_property_readonly("hash_block_size", &AddressTable::hash_block_size);
}

}  // namespace kvaddr::py_bindings
