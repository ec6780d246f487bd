// The address table (address_table.hpp).
#include "bindings/address_table.hpp"

#include <optional>
#include <utility>

#include "bindings/buffer_pool.hpp"
#include "bindings/gil_policy.hpp"

namespace kvaddr::py_bindings {

AddressTable::AddressTable(int64_t block_size, int64_t hash_block_size, std::size_t cache_bytes)
    : block_size_(block_size), hash_block_size_(hash_block_size), cache_(cache_bytes) {
    if (block_size <= 0) throw py::value_error("block_size must be positive, got " + std::to_string(block_size));
    if (hash_block_size <= 0 || block_size % hash_block_size != 0) {
        throw py::value_error("block_size " + std::to_string(block_size) +
                              " must be a positive multiple of hash_block_size " + std::to_string(hash_block_size));
    }
    regions_ = std::make_shared<const Regions>();
    base_source_ = py::list();
    block_len_source_ = py::list();
}

void AddressTable::set_regions(py::object base, py::object block_len) {
    require_region_sequence(base, "kv_caches_base_addr");
    require_region_sequence(block_len, "block_len");
    base_source_ = std::move(base);
    block_len_source_ = std::move(block_len);
}

Snapshot AddressTable::sync_regions() {
    // Local owners first: a callback below may call set_regions and replace the members.
    const py::object base_obj = base_source_;
    const py::object lens_obj = block_len_source_;
    std::vector<int64_t> bases, lens;
    {
        FastSequence base(base_obj.ptr(), "kv_caches_base_addr");
        FastSequence block_len(lens_obj.ptr(), "block_len");
        const Py_ssize_t n_lens = block_len.size();
        const Py_ssize_t n_regions = base.size();
        for (Py_ssize_t i = 0; i < n_lens; ++i) lens.push_back(as_int64(block_len.at(i), "block_len item"));
        for (Py_ssize_t r = 0; r < n_regions; ++r) {
            bases.push_back(as_int64(base.at(r), "kv_caches_base_addr item"));
        }
    }
    // From here to the return no Python code runs: the comparison and the install are atomic.
    pin_.check(bases, lens);  // the values this call computes from, against a transfer's registration
    if (synced_ && bases == regions_->base && lens == seen_lens_) return Snapshot{regions_, cache_.generation()};
    if (!bases.empty() && lens.empty()) {
        raise(errors().block_len, "block_len is empty but " + std::to_string(bases.size()) +
                                      " KV-cache regions are registered: call set_block_len first");
    }
    auto fresh = std::make_shared<Regions>();
    fresh->blen.resize(bases.size());
    for (std::size_t r = 0; r < bases.size(); ++r) fresh->blen[r] = lens[r % lens.size()];
    fresh->base = std::move(bases);
    fresh->finalize();
    std::vector<RowRef> graveyard;  // freed after the table is consistent again
    cache_.clear(&graveyard);
    cache_.set_row_width(fresh->size());
    seen_lens_ = std::move(lens);
    regions_ = std::move(fresh);
    synced_ = true;
    return Snapshot{regions_, cache_.generation()};
}

void AddressTable::raise_overflow(std::size_t chunk, int64_t block_id) {
    raise(PyExc_OverflowError, "chunk " + std::to_string(chunk) + ": base + block_id * block_len overflows int64 "
                               "for block id " + std::to_string(block_id));
}

py::tuple AddressTable::rows_as_lists(const Snapshot& snapshot, const std::vector<ChunkPlan>& plans,
                                      std::vector<py::object>& id_objects) {
    const Regions& regions = *snapshot.regions;
    const std::size_t n = plans.size();
    const std::size_t width = regions.size();
    std::vector<RowRef> addr(n), size(n);
    // Rows not cached (a block id's first sighting, or caching off): their values, built into fresh rows in
    // step 2. fresh_at[c] is the row's offset in `fresh`, or npos for a cached row.
    constexpr std::size_t npos = static_cast<std::size_t>(-1);
    std::vector<std::size_t> fresh_at(n, npos);
    std::vector<int64_t> fresh;
    std::vector<RowRef> graveyard;
    std::vector<int64_t> scratch(width);
    // Step 1, no Python code: rows from the cache, computed (checked) and cached under the snapshot's
    // generation when admitted, or computed into `fresh`. Our references keep every cached row alive whatever
    // later steps (or other threads) evict.
    for (std::size_t c = 0; c < n; ++c) {
        const ChunkPlan& plan = plans[c];
        addr[c] = cache_.find_address(plan.block_id, snapshot.generation);
        if (!addr[c]) {
            if (!address_row(regions, plan.block_id, scratch.data())) raise_overflow(c, plan.block_id);
            if (cache_.admit(plan.block_id, snapshot.generation)) {
                addr[c] = std::make_shared<const IntRow>(scratch.data(), width);
                cache_.insert_address(plan.block_id, addr[c], snapshot.generation, &graveyard);
            } else {
                fresh_at[c] = fresh.size();
                fresh.insert(fresh.end(), scratch.begin(), scratch.end());
            }
        }
        size[c] = cache_.find_size(plan.block_count, snapshot.generation);
        if (!size[c]) {
            if (!size_row(regions, plan.block_count, scratch.data())) {
                raise(PyExc_OverflowError, "chunk " + std::to_string(c) + ": block_len * " +
                                               std::to_string(plan.block_count) + " blocks overflows int64");
            }
            size[c] = std::make_shared<const IntRow>(scratch.data(), width);
            cache_.insert_size(plan.block_count, size[c], snapshot.generation);
        }
    }
    graveyard.clear();
    // Step 2: the result rows — fresh lists, or (immutable_rows) tuples, the cached rows' own. Allocating may
    // start a GC pass, i.e. run Python code; nothing shared is touched any more.
    const bool tuples = immutable_rows_;
    const auto count = static_cast<Py_ssize_t>(n);
    py::list addr_rows(count), size_rows(count), chunk_ids(count);
    for (std::size_t c = 0; c < n; ++c) {
        const auto at = static_cast<Py_ssize_t>(c);
        PyObject* row;
        if (fresh_at[c] != npos) {
            const int64_t* values = fresh.data() + fresh_at[c];
            row = tuples ? new_int_tuple(values, width) : new_int_list(values, width);
        } else {
            row = tuples ? addr[c]->tuple_ref() : addr[c]->new_list();
        }
        PyList_SET_ITEM(addr_rows.ptr(), at, row);
        PyList_SET_ITEM(size_rows.ptr(), at, tuples ? size[c]->tuple_ref() : size[c]->new_list());
        PyObject* id = id_objects[c].release().ptr();
        if (id == nullptr) {
            id = PyLong_FromLongLong(plans[c].block_id);
            if (id == nullptr) throw py::error_already_set();
        }
        PyList_SET_ITEM(chunk_ids.ptr(), at, id);
    }
    return py::make_tuple(std::move(addr_rows), std::move(size_rows), std::move(chunk_ids));
}

py::tuple AddressTable::rows_as_arrays(const Snapshot& snapshot, const std::vector<ChunkPlan>& plans) {
    const std::size_t n = plans.size();
    const std::size_t n_regions = n == 0 ? 0 : snapshot.regions->size();
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
        // Only C++ data here: the snapshot (immutable, kept alive by the shared_ptr), `plans` and the output
        // arrays, which no Python code has seen yet.
        std::optional<py::gil_scoped_release> release;
        if (release_gil_for(work_ns(static_cast<uint64_t>(n) * n_regions, kNsPerMatrixCell))) release.emplace();
        for (std::size_t c = 0; c < n; ++c) id_out[c] = plans[c].block_id;
        failed = fill_matrix(*snapshot.regions, plans, addr_out, size_out);
    }
    if (failed != n) {
        std::vector<int64_t> scratch(n_regions);
        if (!address_row(*snapshot.regions, plans[failed].block_id, scratch.data())) {
            raise_overflow(failed, plans[failed].block_id);
        }
        raise(PyExc_OverflowError, "chunk " + std::to_string(failed) + ": block_len * " +
                                       std::to_string(plans[failed].block_count) + " blocks overflows int64");
    }
    return py::make_tuple(std::move(addrs), std::move(sizes), std::move(ids));
}

py::tuple AddressTable::prepare_values(py::handle chunks, py::handle block_ids) {
    // The reference's error order: regions, then every span, then block ids.
    const std::unique_ptr<FastSequence> items = chunk_sequence(chunks);
    if (items->size() == 0) return py::make_tuple(py::list(), py::list(), py::list());
    const Snapshot snapshot = sync_regions();
    ChunkSpans spans = parse_chunk_items(*items, block_size_, hash_block_size_);
    if (spans.plans.empty()) return py::make_tuple(py::list(), py::list(), py::list());  // a callback emptied it
    BlockIdSource ids(block_ids);
    std::vector<py::object> id_objects;
    resolve_block_ids(ids, spans.starts, block_size_, &spans.plans, &id_objects);
    return rows_as_lists(snapshot, spans.plans, id_objects);
}

py::tuple AddressTable::prepare_values_array(py::handle chunks, py::handle block_ids) {
    ChunkSpans spans = parse_chunks(chunks, block_size_, hash_block_size_, true);
    Snapshot snapshot{std::make_shared<const Regions>(), 0};
    if (!spans.plans.empty()) {
        snapshot = sync_regions();
        BlockIdSource ids(block_ids);
        std::vector<py::object> unused;
        resolve_block_ids(ids, spans.starts, block_size_, &spans.plans, &unused);
    }
    return rows_as_arrays(snapshot, spans.plans);
}

py::tuple AddressTable::prepare_value_for_block(py::handle block_id) {
    py::object id_object = py::reinterpret_borrow<py::object>(block_id);
    const int64_t id = as_int64(id_object.ptr(), "block_id");
    const Snapshot snapshot = sync_regions();
    const Regions& regions = *snapshot.regions;
    std::vector<int64_t> values(regions.size());
    if (!address_row(regions, id, values.data())) raise_overflow(0, id);
    py::object addrs = py::reinterpret_steal<py::object>(new_int_list(values.data(), values.size()));
    py::object sizes = py::reinterpret_steal<py::object>(new_int_list(regions.blen.data(), regions.size()));
    return py::make_tuple(std::move(addrs), std::move(sizes));
}

void AddressTable::set_cache_capacity(std::size_t bytes) {
    std::vector<RowRef> graveyard;
    cache_.set_capacity(bytes, &graveyard);
}

void AddressTable::clear_cache() {
    std::vector<RowRef> graveyard;
    cache_.clear(&graveyard);
}

}  // namespace kvaddr::py_bindings
