// The per-(shard, block id) cache of address rows behind the list output (docs/address-rows.md has the rules).
//
// A cached row is an array of Python ints that the cache created itself: every list result gets a fresh list
// built from it (the items, immutable ints, are shared), and the immutable-rows output hands out one tuple of
// them (it can never change). So an earlier result never changes, and dropping a cached row only frees ints
// (and its tuple), which runs no Python code: evicting cannot call back into the database. A row is cached on
// its block id's second sighting (admit): a stream of never-seen block ids then costs no cache work and no
// evictions, and a block id used again is cached from its second use on. Rows are looked up and inserted
// under a generation number; the database bumps it whenever the regions change, and a call only uses or
// inserts rows of the generation its region snapshot belongs to. Every method needs the GIL and runs no
// Python code, so each one is atomic for Python threads.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

namespace kvaddr::py_bindings {

namespace py = pybind11;

// R Python ints, owned, and (once asked for) a tuple of them. Destroy with the GIL held.
class IntRow {
public:
    IntRow(const int64_t* values, std::size_t count);  // MemoryError → py::error_already_set
    IntRow(const IntRow&) = delete;
    IntRow& operator=(const IntRow&) = delete;
    ~IntRow();

    std::size_t size() const noexcept { return items_.size(); }
    // A new list holding the row's ints (not tracked by the cyclic GC: see new_int_list).
    PyObject* new_list() const;
    // A new reference to the row's tuple (the immutable-rows output), built on first use. Building it
    // allocates a GC-tracked object, which may run Python code: call it only where that is allowed.
    PyObject* tuple_ref() const;

private:
    std::vector<PyObject*> items_;
    mutable PyObject* tuple_ = nullptr;  // the only state that changes after construction (GIL held)
};
using RowRef = std::shared_ptr<const IntRow>;

// A fresh list (or, `as_tuple`, tuple) of `count` existing objects (new references taken), untracked by the
// cyclic GC: rows hold only ints, and scanning hundreds of thousands of row items on every collection cost more
// than building them (docs/address-rows.md). A caller that puts a reference cycle into a returned row leaks it.
PyObject* new_int_list(PyObject* const* items, std::size_t count, bool as_tuple = false);
// A fresh list (or, `as_tuple`, tuple) of new ints made from `values`, untracked by the cyclic GC.
PyObject* new_int_row(const int64_t* values, std::size_t count, bool as_tuple);

// A cached row's key: the layout's template index (0 for rank-local; the local shard for a TP-shared layout,
// or chunk_index * n_shards + local shard under vLLM 0.34's store chunks) and the block id (or, for size rows,
// the block count). Everything else a row depends on (bases, strides, sizes, which rules) belongs to the
// snapshot, whose change starts a new generation.
struct RowKey {
    std::size_t shard;
    int64_t value;
    bool operator==(const RowKey& other) const noexcept { return shard == other.shard && value == other.value; }
};
struct RowKeyHash {
    std::size_t operator()(const RowKey& k) const noexcept {
        return std::hash<int64_t>()(k.value) ^ (k.shard * std::size_t{0x9E3779B97F4A7C15ULL});
    }
};

class RowCache {
public:
    explicit RowCache(std::size_t capacity_bytes) : capacity_(capacity_bytes) {}
    RowCache(const RowCache&) = delete;
    RowCache& operator=(const RowCache&) = delete;

    uint64_t generation() const noexcept { return generation_; }

    // Drops every row and starts a new generation. Dropped rows are moved to `graveyard`, freed by the caller.
    void clear(std::vector<RowRef>* graveyard);
    // Called when the region count changes: the byte cost of one row.
    void set_row_width(std::size_t regions) noexcept {
        row_cost_ = row_cost(regions);
        sightings_.clear();
    }

    RowRef find_address(RowKey key, uint64_t generation);
    // After a miss: whether the row should be cached now (its block id's second sighting). Sightings are
    // bits in a hashed bitmap of 16 bits per row the cache can hold (1 Ki to 16 Mi bits), cleared once a
    // sixteenth of it is set: a block id is cached on its second sighting at the latest (one clearing in
    // between delays that by a sighting), and a colliding never-seen id is cached early (at most ~1 in 16).
    // Either way only when a row gets cached changes, never a result.
    bool admit(RowKey key, uint64_t generation);
    void insert_address(RowKey key, RowRef row, uint64_t generation, std::vector<RowRef>* graveyard);
    RowRef find_size(RowKey shard_and_count, uint64_t generation) const;
    void insert_size(RowKey shard_and_count, RowRef row, uint64_t generation);

    std::size_t capacity() const noexcept { return capacity_; }
    void set_capacity(std::size_t bytes, std::vector<RowRef>* graveyard);
    py::dict info() const;

private:
    // Approximate bytes one cached row keeps alive: the item pointers and their int objects.
    static std::size_t row_cost(std::size_t regions) noexcept { return 64 + regions * (8 + 32); }
    void evict_oldest(std::vector<RowRef>* graveyard);

    static constexpr std::size_t kMinSightingBits = std::size_t{1} << 10;
    static constexpr std::size_t kMaxSightingBits = std::size_t{1} << 24;

    // Distinct block counts whose size rows are kept (production chunks all have count 1).
    static constexpr std::size_t kMaxSizeRows = 64;

    uint64_t generation_ = 0;
    std::size_t capacity_;
    std::size_t row_cost_ = row_cost(0);
    std::size_t bytes_ = 0;
    uint64_t hits_ = 0;
    uint64_t misses_ = 0;
    std::unordered_map<RowKey, RowRef, RowKeyHash> rows_;
    std::vector<uint64_t> sightings_;  // the sighting bitmap; sized lazily by admit
    std::size_t sightings_set_ = 0;    // bits set since it was last cleared
    std::deque<RowKey> order_;  // insertion order of rows_ (FIFO eviction)
    std::unordered_map<RowKey, RowRef, RowKeyHash> size_rows_;
};

}  // namespace kvaddr::py_bindings
