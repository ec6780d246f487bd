// The fused per-request plans (plans.hpp). Each converts all of its inputs (walk flags, hashes, block ids)
// before it takes the region snapshot it computes on.
#include "bindings/plans.hpp"

#include <pybind11/numpy.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings/buffer_pool.hpp"
#include "bindings/keys.hpp"
#include "kvaddr/staging.hpp"

namespace kvaddr::py_bindings {

namespace {

// The walked chunks of a load and their keys (the shared first half of both load plans).
struct LoadChunks {
    py::list keys;
    ChunkSpans spans;
};

LoadChunks walk_load(const AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                     int64_t token_len, int64_t mask_num, py::handle load_mask) {
    KeyWriter writer(prefix);
    HashSource source(hashes, hash_len, HashItems::any_buffer);  // the seed-era database
    const WalkParams params{token_len, table.block_size(), table.hash_block_size(), mask_num, 1, 0};
    const std::vector<WalkedChunk> chunks = walk(params, source.size(), load_mask, true);
    LoadChunks out;
    std::vector<int64_t> hash_indices;
    hash_indices.reserve(chunks.size());
    for (const WalkedChunk& c : chunks) {
        out.spans.starts.push_back(c.start);
        out.spans.plans.push_back(KeyPlan{0, ceil_div(c.end - c.start, table.block_size()), 0});
        hash_indices.push_back(c.hash_index);
    }
    out.keys = build_key_list(writer, source, hash_indices);
    return out;
}

}  // namespace

py::tuple plan_load(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                    py::handle token_len_arg, py::handle mask_num_arg, py::handle load_mask, py::handle block_ids) {
    const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
    const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
    LoadChunks load = walk_load(table, prefix, hashes, hash_len, token_len, mask_num, load_mask);
    if (load.spans.plans.empty()) return py::make_tuple(std::move(load.keys), py::list(), py::list(), py::list());
    const Snapshot snapshot = table.engine().snapshot();
    BlockIdSource ids(block_ids);
    std::vector<py::object> id_objects;
    resolve_block_ids(ids, load.spans.starts, table.block_size(), &load.spans.plans, &id_objects);
    py::tuple rows = table.engine().rows_as_lists(snapshot, load.spans.plans, id_objects);
    return py::make_tuple(std::move(load.keys), rows[0], rows[1], rows[2]);
}

py::tuple plan_load_arrays(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                           py::handle token_len_arg, py::handle mask_num_arg, py::handle load_mask, py::handle block_ids,
                           py::handle slot_alignment_arg) {
    const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
    const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
    const int64_t slot_alignment = as_int64(slot_alignment_arg.ptr(), "slot_alignment");
    if (slot_alignment <= 0 || (slot_alignment & (slot_alignment - 1)) != 0) {
        raise(PyExc_ValueError, "slot_alignment must be a positive power of two, got " + std::to_string(slot_alignment));
    }
    LoadChunks load = walk_load(table, prefix, hashes, hash_len, token_len, mask_num, load_mask);
    Snapshot snapshot{std::make_shared<const Templates>(), 0};
    if (!load.spans.plans.empty()) {
        snapshot = table.engine().snapshot();
        BlockIdSource ids(block_ids);
        std::vector<py::object> unused;
        resolve_block_ids(ids, load.spans.starts, table.block_size(), &load.spans.plans, &unused);
    }
    py::tuple rows = table.engine().rows_as_arrays(snapshot, load.spans.plans);
    // Slot layout of the staging buffer, from the sizes just computed (microseconds: the GIL stays held).
    auto sizes = rows[1].cast<py::array_t<int64_t>>();
    const auto keys = static_cast<std::size_t>(sizes.shape(0));
    const auto regions = static_cast<std::size_t>(sizes.ndim() == 2 ? sizes.shape(1) : 0);
    BufferPool& pool = BufferPool::instance();
    py::array_t<int64_t> offsets = pool.new_array({static_cast<py::ssize_t>(keys)});
    py::array_t<int64_t> object_sizes = pool.new_array({static_cast<py::ssize_t>(keys)});
    int64_t total = 0;
    const staging::PlanProblem problem =
        staging::plan_slots(sizes.data(), keys, regions, slot_alignment, offsets.mutable_data(),
                            object_sizes.mutable_data(), &total);
    if (problem.fault != staging::PlanFault::none) {
        // Sizes are block_len * count: only a negative block_len or a huge layout gets here.
        raise(PyExc_OverflowError, "key " + std::to_string(problem.key) +
                                       ": the staging layout does not fit in int64 (or a block_len is negative)");
    }
    return py::make_tuple(std::move(load.keys), rows[0], rows[1], rows[2], std::move(offsets), std::move(object_sizes),
                          total);
}

py::tuple plan_store(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                     py::handle token_len_arg, py::handle mask_num_arg, py::handle chunk_mask, py::handle put_step_arg,
                     py::handle put_step_rank_arg, py::handle block_ids, py::handle skip_null_arg) {
    const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
    const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
    const int64_t put_step = as_int64(put_step_arg.ptr(), "put_step");
    const int64_t put_step_rank = as_int64(put_step_rank_arg.ptr(), "put_step_rank");
    const bool skip_null = as_flag(skip_null_arg);
    KeyWriter writer(prefix);
    HashSource source(hashes, hash_len, HashItems::any_buffer);  // the seed-era database
    const WalkParams params{token_len, table.block_size(), table.hash_block_size(), mask_num, put_step, put_step_rank};
    const std::vector<WalkedChunk> walked = walk(params, source.size(), chunk_mask, false);
    BlockIdSource ids(block_ids);
    std::vector<int64_t> hash_indices;
    std::vector<std::pair<int64_t, int64_t>> spans;
    std::vector<py::object> kept_objects;
    std::vector<int64_t> kept_ids;
    for (const WalkedChunk& c : walked) {
        const int64_t block_index = c.start / table.block_size();
        if (block_index >= ids.size()) continue;
        py::object id_object;
        const int64_t id = ids.at(static_cast<Py_ssize_t>(block_index), &id_object);
        if (skip_null && id == 0) continue;
        hash_indices.push_back(c.hash_index);
        spans.emplace_back(c.start, c.end);
        kept_ids.push_back(id);
        kept_objects.push_back(std::move(id_object));
    }
    py::list keys = build_key_list(writer, source, hash_indices);
    py::list chunk_list(static_cast<Py_ssize_t>(spans.size()));
    py::list id_list(static_cast<Py_ssize_t>(spans.size()));
    for (std::size_t i = 0; i < spans.size(); ++i) {
        const auto at = static_cast<Py_ssize_t>(i);
        PyList_SET_ITEM(chunk_list.ptr(), at, py::make_tuple(spans[i].first, spans[i].second).release().ptr());
        PyObject* id = kept_objects[i] ? kept_objects[i].release().ptr() : PyLong_FromLongLong(kept_ids[i]);
        if (id == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(id_list.ptr(), at, id);
    }
    return py::make_tuple(std::move(keys), std::move(chunk_list), std::move(id_list));
}

}  // namespace kvaddr::py_bindings
