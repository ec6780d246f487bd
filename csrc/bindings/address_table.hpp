// AddressTable: the native state of one ChunkedTokenDatabase (docs/address-rows.md) — the block sizes, the
// caller's region lists, the last region snapshot and the row cache — and the two outputs of the matrix
// (fresh lists, fresh int64 arrays). The fused per-request plans built on it live in plans.cpp.
//
// Thread safety: one table may be used by any number of Python threads at once (vLLM shares one database
// between its send thread and every receive thread). Each call first converts all of its inputs to C++
// values, then takes a region snapshot and the cache generation together (Snapshot), computes on that
// snapshot only, and touches the cache only in steps that run no Python code. Results never alias the cache
// or each other. Needs the GIL except inside the documented release (gil_policy.hpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/inputs.hpp"
#include "bindings/region_pin.hpp"
#include "bindings/row_cache.hpp"
#include "kvaddr/address.hpp"

namespace kvaddr::py_bindings {

// Regions and the cache generation they were installed under, taken together.
struct Snapshot {
    std::shared_ptr<const Regions> regions;
    uint64_t generation = 0;
};

class AddressTable {
public:
    AddressTable(int64_t block_size, int64_t hash_block_size, std::size_t cache_bytes);
    AddressTable(const AddressTable&) = delete;
    AddressTable& operator=(const AddressTable&) = delete;

    // Keeps references to the caller's lists (the reference stores them by reference too); their contents
    // are re-read by every call that needs them, so in-place edits are seen.
    void set_regions(py::object base, py::object block_len);

    // Reads the caller's lists (may run Python code), then — with no Python code in between — compares them
    // with the current snapshot and installs a new one (dropping the cache) if they changed.
    Snapshot sync_regions();

    // A transfer's registered regions (region_pin.hpp): while pinned, a call whose lists hold other values
    // raises ValueError inside the call instead of computing addresses from them.
    void pin_regions(py::handle bases, py::handle block_len) { pin_.pin(bases, block_len); }
    void unpin_regions() { pin_.unpin(); }
    std::size_t region_pins() const { return pin_.count(); }

    // Rows of validated chunks whose block ids are resolved: (addr_rows, size_rows, ids), each row a fresh
    // list, or with immutable_rows a tuple (a cached row's own: shared between results, never changed).
    py::tuple rows_as_lists(const Snapshot& snapshot, const std::vector<ChunkPlan>& plans,
                            std::vector<py::object>& id_objects);
    // The same as fresh int64 arrays (addrs (n, R), sizes (n, R), ids (n,)).
    py::tuple rows_as_arrays(const Snapshot& snapshot, const std::vector<ChunkPlan>& plans);

    py::tuple prepare_values(py::handle chunks, py::handle block_ids);
    py::tuple prepare_values_array(py::handle chunks, py::handle block_ids);
    py::tuple prepare_value_for_block(py::handle block_id);

    std::size_t cache_capacity() const { return cache_.capacity(); }
    void set_cache_capacity(std::size_t bytes);
    py::dict cache_info() const { return cache_.info(); }
    void clear_cache();

    bool immutable_rows() const { return immutable_rows_; }
    void set_immutable_rows(bool value) { immutable_rows_ = value; }

    int64_t block_size() const { return block_size_; }
    int64_t hash_block_size() const { return hash_block_size_; }

private:
    [[noreturn]] static void raise_overflow(std::size_t chunk, int64_t block_id);

    int64_t block_size_;
    int64_t hash_block_size_;
    py::object base_source_;
    py::object block_len_source_;
    std::shared_ptr<const Regions> regions_;
    std::vector<int64_t> seen_lens_;
    bool synced_ = false;  // regions_ reflects a successful read of the caller's lists
    bool immutable_rows_ = false;  // rows as tuples (no per-call copy) instead of fresh lists
    RowCache cache_;
    RegionPin pin_;
};

}  // namespace kvaddr::py_bindings
