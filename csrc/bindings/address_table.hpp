// AddressTable: the seed-era ChunkedTokenDatabase's face over the rank-local engine (engine.hpp,
// docs/address-rows.md). It holds the block sizes and converts the reference's inputs (chunk spans, block
// ids) in its error order; the snapshot, the row cache and both outputs are the engine's. The fused
// per-request plans built on it live in plans.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "bindings/engine.hpp"

namespace kvaddr::py_bindings {

class AddressTable {
public:
    AddressTable(int64_t block_size, int64_t hash_block_size, std::size_t cache_bytes);

    RowEngine& engine() noexcept { return engine_; }

    py::tuple prepare_values(py::handle chunks, py::handle block_ids);
    py::tuple prepare_values_array(py::handle chunks, py::handle block_ids);
    py::tuple prepare_value_for_block(py::handle block_id);

    int64_t block_size() const { return block_size_; }
    int64_t hash_block_size() const { return hash_block_size_; }

private:
    int64_t block_size_;
    int64_t hash_block_size_;
    RowEngine engine_;
};

}  // namespace kvaddr::py_bindings
