// The seed-era face (address_table.hpp).
#include "bindings/address_table.hpp"

#include <string>
#include <utility>
#include <vector>

#include "bindings/inputs.hpp"

namespace kvaddr::py_bindings {

AddressTable::AddressTable(int64_t block_size, int64_t hash_block_size, std::size_t cache_bytes)
    : block_size_(block_size), hash_block_size_(hash_block_size), engine_(false, 1, cache_bytes, {true, "chunk"}) {
    if (block_size <= 0) throw py::value_error("block_size must be positive, got " + std::to_string(block_size));
    if (hash_block_size <= 0 || block_size % hash_block_size != 0) {
        throw py::value_error("block_size " + std::to_string(block_size) +
                              " must be a positive multiple of hash_block_size " + std::to_string(hash_block_size));
    }
}

py::tuple AddressTable::prepare_values(py::handle chunks, py::handle block_ids) {
    // The reference's error order: regions, then every span, then block ids.
    const std::unique_ptr<FastSequence> items = chunk_sequence(chunks);
    if (items->size() == 0) return py::make_tuple(py::list(), py::list(), py::list());
    const Snapshot snapshot = engine_.snapshot();
    ChunkSpans spans = parse_chunk_items(*items, block_size_, hash_block_size_);
    if (spans.plans.empty()) return py::make_tuple(py::list(), py::list(), py::list());  // a callback emptied it
    BlockIdSource ids(block_ids);
    std::vector<py::object> id_objects;
    resolve_block_ids(ids, spans.starts, block_size_, &spans.plans, &id_objects);
    return engine_.rows_as_lists(snapshot, spans.plans, id_objects);
}

py::tuple AddressTable::prepare_values_array(py::handle chunks, py::handle block_ids) {
    ChunkSpans spans = parse_chunks(chunks, block_size_, hash_block_size_, true);
    Snapshot snapshot{std::make_shared<const Templates>(), 0};
    if (!spans.plans.empty()) {
        snapshot = engine_.snapshot();
        BlockIdSource ids(block_ids);
        std::vector<py::object> unused;
        resolve_block_ids(ids, spans.starts, block_size_, &spans.plans, &unused);
    }
    return engine_.rows_as_arrays(snapshot, spans.plans);
}

py::tuple AddressTable::prepare_value_for_block(py::handle block_id) {
    py::object id_object = py::reinterpret_borrow<py::object>(block_id);
    const int64_t id = as_int64(id_object.ptr(), "block_id");  // the reference converts the id first
    return engine_.value_for_block(engine_.snapshot(), id);
}

}  // namespace kvaddr::py_bindings
