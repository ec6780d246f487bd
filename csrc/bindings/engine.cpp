// The address engine (engine.hpp).
#include "bindings/engine.hpp"

#include <optional>
#include <string>
#include <utility>

#include "bindings/buffer_pool.hpp"
#include "bindings/common.hpp"
#include "bindings/gil_policy.hpp"
#include "bindings/inputs.hpp"

namespace kvaddr::py_bindings {

RowEngine::RowEngine(bool tp_shared, std::size_t n_templates, std::size_t cache_bytes, EngineWords words)
    : tp_shared_(tp_shared), templates_count_(tp_shared ? n_templates : 1), words_(words), cache_(cache_bytes) {
    auto empty = std::make_shared<Templates>(templates_count_);
    for (layout::Segments& t : *empty) {
        t.size_scales = !tp_shared;
        t.finalize();
    }
    templates_ = std::move(empty);
    base_source_ = py::list();
    block_len_source_ = py::list();
    block_stride_source_ = py::none();
}

void RowEngine::set_region_sources(py::object base, py::object block_len, py::object block_stride) {
    require_int_sequence(base, "kv_caches_base_addr");
    require_int_sequence(block_len, "block_len");
    if (!block_stride.is_none()) require_int_sequence(block_stride, "block_stride");
    // The next snapshot compares values (and rules): equal ones keep the cache.
    base_source_ = std::move(base);
    block_len_source_ = std::move(block_len);
    block_stride_source_ = std::move(block_stride);
}

void RowEngine::set_templates(std::shared_ptr<const Templates> templates) {
    std::vector<RowRef> graveyard;  // freed after the engine is consistent again
    cache_.clear(&graveyard);
    cache_.set_row_width(templates->empty() ? 0 : templates->front().count());
    templates_ = std::move(templates);
}

Snapshot RowEngine::snapshot() {
    if (tp_shared_) return Snapshot{templates_, cache_.generation()};
    // Local owners first: a callback below may call set_region_sources and replace the members.
    const py::object base_obj = base_source_;
    const py::object lens_obj = block_len_source_;
    const py::object strides_obj = block_stride_source_;
    const bool with_strides = !strides_obj.is_none();
    std::vector<int64_t> bases, lens, strides;
    {
        FastSequence base(base_obj.ptr(), "kv_caches_base_addr");
        FastSequence block_len(lens_obj.ptr(), "block_len");
        if (words_.lens_first) append_int64s(block_len, "block_len item", &lens);
        append_int64s(base, "kv_caches_base_addr item", &bases);
        if (!words_.lens_first && !bases.empty()) {
            // vLLM 0.34 reads block_stride before block_len.
            if (with_strides) append_int64s(FastSequence(strides_obj.ptr(), "block_stride"), "block_stride item", &strides);
            append_int64s(block_len, "block_len item", &lens);
        }
    }
    // From here to the return no Python code runs: the comparison and the install are atomic.
    pin_.check(bases, lens, with_strides ? strides : lens);  // the values this call computes from
    if (synced_ && with_strides == seen_with_strides_ && bases == templates_->front().base && lens == seen_lens_ &&
        strides == seen_strides_) {
        return Snapshot{templates_, cache_.generation()};
    }
    // Region r's stride and size0 (vLLM 0.33: both block_len[r % len(block_len)]; vLLM 0.34: block_stride and
    // block_len, both at r % len(block_stride)). The errors are the references' (a % 0, a short block_len).
    const std::vector<int64_t>& cycle = with_strides ? strides : lens;
    if (!bases.empty() && cycle.empty()) {
        const char* list = with_strides ? "block_stride" : "block_len";
        raise(errors().block_len, std::string(list) + " is empty but " + std::to_string(bases.size()) +
                                      " KV-cache regions are registered: call set_block_len first");
    }
    auto fresh = std::make_shared<Templates>(1);
    layout::Segments& t = fresh->front();
    t.size_scales = true;
    t.stride.resize(bases.size());
    t.size.resize(bases.size());
    for (std::size_t r = 0; r < bases.size(); ++r) {
        const std::size_t at = r % cycle.size();
        if (at >= lens.size()) {
            raise(PyExc_IndexError, "block_len has " + std::to_string(lens.size()) + " items but region " +
                                        std::to_string(r) + " reads block_len[" + std::to_string(at) +
                                        "] (block_stride has " + std::to_string(cycle.size()) + ")");
        }
        t.stride[r] = cycle[at];
        t.size[r] = lens[at];
    }
    t.base = std::move(bases);
    t.finalize();
    set_templates(std::move(fresh));
    seen_lens_ = std::move(lens);
    seen_strides_ = std::move(strides);
    seen_with_strides_ = with_strides;
    synced_ = true;
    return Snapshot{templates_, cache_.generation()};
}

void RowEngine::raise_address_overflow(std::size_t row, int64_t block_id) const {
    raise(PyExc_OverflowError, std::string(words_.row) + " " + std::to_string(row) +
                                   ": base + block_id * block_len overflows int64 for block id " +
                                   std::to_string(block_id));
}

void RowEngine::raise_size_overflow(std::size_t row, int64_t block_count, const layout::Segments& t) const {
    const std::string head = std::string(words_.row) + " " + std::to_string(row) + ": ";
    // No stride apart from its block_len (vLLM 0.33, the seed-era database): the size is block_len * blocks.
    if (t.stride == t.size) {
        raise(PyExc_OverflowError, head + "block_len * " + std::to_string(block_count) + " blocks overflows int64");
    }
    raise(PyExc_OverflowError, head + "the size of " + std::to_string(block_count) +
                                   " blocks (block_len + (blocks - 1) * block_stride) overflows int64");
}

py::tuple RowEngine::rows_as_lists(const Snapshot& snapshot, const std::vector<KeyPlan>& plans,
                                   std::vector<py::object>& id_objects) {
    const Templates& templates = *snapshot.templates;
    const std::size_t n = plans.size();
    const std::size_t width = templates.empty() ? 0 : templates.front().count();
    std::vector<RowRef> addr(n), size(n);
    // Rows not cached (a block id's first sighting, or caching off): their values, built into fresh rows in
    // step 2. fresh_at[k] is the row's offset in `fresh`, or npos for a cached row.
    constexpr std::size_t npos = static_cast<std::size_t>(-1);
    std::vector<std::size_t> fresh_at(n, npos);
    std::vector<int64_t> fresh;
    std::vector<RowRef> graveyard;
    std::vector<int64_t> scratch(width);
    // Step 1, no Python code: rows from the cache, computed (checked) and cached under the snapshot's
    // generation when admitted, or computed into `fresh`. Our references keep every cached row alive whatever
    // later steps (or other threads) evict.
    for (std::size_t k = 0; k < n; ++k) {
        const KeyPlan& plan = plans[k];
        const layout::Segments& t = templates[plan.shard];
        const RowKey key{plan.shard, plan.block_id};
        addr[k] = cache_.find_address(key, snapshot.generation);
        if (!addr[k]) {
            if (!layout::address_row(t, plan.block_id, scratch.data())) raise_address_overflow(k, plan.block_id);
            if (cache_.admit(key, snapshot.generation)) {
                addr[k] = std::make_shared<const IntRow>(scratch.data(), width);
                cache_.insert_address(key, addr[k], snapshot.generation, &graveyard);
            } else {
                fresh_at[k] = fresh.size();
                fresh.insert(fresh.end(), scratch.begin(), scratch.end());
            }
        }
        const int64_t count = t.size_scales ? plan.block_count : 1;
        size[k] = cache_.find_size(RowKey{plan.shard, count}, snapshot.generation);
        if (!size[k]) {
            if (!layout::size_row(t, count, scratch.data())) raise_size_overflow(k, count, t);
            size[k] = std::make_shared<const IntRow>(scratch.data(), width);
            cache_.insert_size(RowKey{plan.shard, count}, size[k], snapshot.generation);
        }
    }
    graveyard.clear();
    // Step 2: the result rows — fresh lists, or (immutable_rows) tuples, the cached rows' own. Allocating may
    // start a GC pass, i.e. run Python code; nothing shared is touched any more.
    const bool tuples = immutable_rows_;
    const auto count = static_cast<Py_ssize_t>(n);
    py::list addr_rows(count), size_rows(count), ids(count);
    for (std::size_t k = 0; k < n; ++k) {
        const auto at = static_cast<Py_ssize_t>(k);
        PyObject* row;
        if (fresh_at[k] != npos) {
            const int64_t* values = fresh.data() + fresh_at[k];
            row = new_int_row(values, width, tuples);
        } else {
            row = tuples ? addr[k]->tuple_ref() : addr[k]->new_list();
        }
        PyList_SET_ITEM(addr_rows.ptr(), at, row);
        PyList_SET_ITEM(size_rows.ptr(), at, tuples ? size[k]->tuple_ref() : size[k]->new_list());
        PyObject* id = k < id_objects.size() ? id_objects[k].release().ptr() : nullptr;
        if (id == nullptr) {
            id = PyLong_FromLongLong(plans[k].block_id);
            if (id == nullptr) throw py::error_already_set();
        }
        PyList_SET_ITEM(ids.ptr(), at, id);
    }
    return py::make_tuple(std::move(addr_rows), std::move(size_rows), std::move(ids));
}

py::tuple RowEngine::rows_as_arrays(const Snapshot& snapshot, const std::vector<KeyPlan>& plans) {
    const Templates& templates = *snapshot.templates;
    const std::size_t n = plans.size();
    const std::size_t width = n == 0 || templates.empty() ? 0 : templates.front().count();
    BufferPool& pool = BufferPool::instance();
    const auto rows = static_cast<py::ssize_t>(n);
    const auto cols = static_cast<py::ssize_t>(width);
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
        if (release_gil_for(work_ns(static_cast<uint64_t>(n) * width, kNsPerMatrixCell))) release.emplace();
        for (std::size_t k = 0; k < n; ++k) id_out[k] = plans[k].block_id;
        failed = layout::fill_rows(templates, plans, width, addr_out, size_out);
    }
    if (failed != n) {
        const KeyPlan& plan = plans[failed];
        std::vector<int64_t> scratch(width);
        if (!layout::address_row(templates[plan.shard], plan.block_id, scratch.data())) {
            raise_address_overflow(failed, plan.block_id);
        }
        raise_size_overflow(failed, plan.block_count, templates[plan.shard]);
    }
    return py::make_tuple(std::move(addrs), std::move(sizes), std::move(ids));
}

py::tuple RowEngine::value_for_block(const Snapshot& snapshot, int64_t block_id) {
    const layout::Segments& t = snapshot.templates->front();
    std::vector<int64_t> values(t.count());
    if (!layout::address_row(t, block_id, values.data())) raise_address_overflow(0, block_id);
    py::object addrs = py::reinterpret_steal<py::object>(new_int_row(values.data(), values.size(), false));
    py::object sizes = py::reinterpret_steal<py::object>(new_int_row(t.size.data(), t.count(), false));
    return py::make_tuple(std::move(addrs), std::move(sizes));
}

void RowEngine::set_cache_capacity(std::size_t bytes) {
    std::vector<RowRef> graveyard;
    cache_.set_capacity(bytes, &graveyard);
}

void RowEngine::clear_cache() {
    std::vector<RowRef> graveyard;
    cache_.clear(&graveyard);
}

}  // namespace kvaddr::py_bindings
