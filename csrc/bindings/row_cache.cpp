// The address-row cache (row_cache.hpp).
#include "bindings/row_cache.hpp"

#include <algorithm>
#include <utility>

namespace kvaddr::py_bindings {

IntRow::IntRow(const int64_t* values, std::size_t count) {
    items_.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
        PyObject* item = PyLong_FromLongLong(values[i]);  // ints are not GC-tracked: no collection, no Python code
        if (item == nullptr) throw py::error_already_set();
        items_.push_back(item);
    }
}

IntRow::~IntRow() {
    Py_XDECREF(tuple_);
    for (PyObject* item : items_) Py_DECREF(item);
}

PyObject* IntRow::new_list() const { return new_int_list(items_.data(), items_.size()); }

PyObject* IntRow::tuple_ref() const {
    if (tuple_ == nullptr) {
        PyObject* tuple = new_int_list(items_.data(), items_.size(), true);  // may run a GC pass
        if (tuple_ == nullptr) {
            tuple_ = tuple;
        } else {
            Py_DECREF(tuple);  // a call made during that GC pass built one first: keep one tuple per row
        }
    }
    Py_INCREF(tuple_);
    return tuple_;
}

namespace {

// A fresh list (or, `as_tuple`, tuple) of `count` items, item i a new reference from `item(i)` (null: an error
// is set), untracked by the cyclic GC once filled.
template <typename Item>
PyObject* new_row(std::size_t count, bool as_tuple, Item item) {
    const auto n = static_cast<Py_ssize_t>(count);
    PyObject* row = as_tuple ? PyTuple_New(n) : PyList_New(n);
    if (row == nullptr) throw py::error_already_set();
    PyObject** slots = PySequence_Fast_ITEMS(row);  // a list's or a tuple's own item array
    for (std::size_t i = 0; i < count; ++i) {
        slots[i] = item(i);
        if (slots[i] == nullptr) {
            Py_DECREF(row);
            throw py::error_already_set();
        }
    }
    if (!as_tuple || count > 0) PyObject_GC_UnTrack(row);  // the empty tuple is a shared singleton
    return row;
}

}  // namespace

PyObject* new_int_list(PyObject* const* items, std::size_t count, bool as_tuple) {
    return new_row(count, as_tuple, [items](std::size_t i) {
        Py_INCREF(items[i]);
        return items[i];
    });
}

PyObject* new_int_row(const int64_t* values, std::size_t count, bool as_tuple) {
    // Ints are not GC-tracked: making them runs no collection, no Python code.
    return new_row(count, as_tuple, [values](std::size_t i) { return PyLong_FromLongLong(values[i]); });
}

void RowCache::clear(std::vector<RowRef>* graveyard) {
    ++generation_;
    for (auto& entry : rows_) graveyard->push_back(std::move(entry.second));
    for (auto& entry : size_rows_) graveyard->push_back(std::move(entry.second));
    rows_.clear();
    sightings_.clear();
    size_rows_.clear();
    order_.clear();
    bytes_ = 0;
}

RowRef RowCache::find_address(RowKey key, uint64_t generation) {
    if (generation != generation_) return nullptr;
    auto hit = rows_.find(key);
    if (hit == rows_.end()) {
        ++misses_;
        return nullptr;
    }
    ++hits_;
    return hit->second;
}

bool RowCache::admit(RowKey key, uint64_t generation) {
    if (generation != generation_ || row_cost_ > capacity_) return false;
    if (sightings_.empty()) {
        std::size_t bits = kMinSightingBits;
        const std::size_t wanted = std::min(kMaxSightingBits, 16 * (capacity_ / row_cost_));
        while (bits < wanted) bits *= 2;
        sightings_.assign(bits / 64, 0);
        sightings_set_ = 0;
    }
    // Fibonacci hashing: consecutive block ids (of every shard) spread over the bitmap.
    const uint64_t mixed = (static_cast<uint64_t>(key.value) ^ (static_cast<uint64_t>(key.shard) << 48)) *
                           UINT64_C(0x9E3779B97F4A7C15);
    const std::size_t bit = static_cast<std::size_t>(mixed >> 32) & (sightings_.size() * 64 - 1);
    uint64_t& word = sightings_[bit / 64];
    const uint64_t mask = uint64_t{1} << (bit % 64);
    if ((word & mask) != 0) return true;
    if (sightings_set_ >= sightings_.size() * 4) {  // a sixteenth of the bits
        std::fill(sightings_.begin(), sightings_.end(), 0);
        sightings_set_ = 0;
    }
    word |= mask;
    ++sightings_set_;
    return false;
}

void RowCache::insert_address(RowKey key, RowRef row, uint64_t generation, std::vector<RowRef>* graveyard) {
    if (generation != generation_ || row_cost_ > capacity_ || rows_.count(key) != 0) return;
    while (bytes_ + row_cost_ > capacity_) evict_oldest(graveyard);
    rows_.emplace(key, std::move(row));
    order_.push_back(key);
    bytes_ += row_cost_;
}

RowRef RowCache::find_size(RowKey shard_and_count, uint64_t generation) const {
    if (generation != generation_) return nullptr;
    auto hit = size_rows_.find(shard_and_count);
    return hit == size_rows_.end() ? nullptr : hit->second;
}

void RowCache::insert_size(RowKey shard_and_count, RowRef row, uint64_t generation) {
    if (generation != generation_ || size_rows_.size() >= kMaxSizeRows) return;
    size_rows_.emplace(shard_and_count, std::move(row));
}

void RowCache::set_capacity(std::size_t bytes, std::vector<RowRef>* graveyard) {
    capacity_ = bytes;
    sightings_.clear();
    while (bytes_ > capacity_) evict_oldest(graveyard);
}

void RowCache::evict_oldest(std::vector<RowRef>* graveyard) {
    const RowKey key = order_.front();
    order_.pop_front();
    auto it = rows_.find(key);
    graveyard->push_back(std::move(it->second));
    rows_.erase(it);
    bytes_ -= row_cost_;
}

py::dict RowCache::info() const {
    py::dict info;
    info["entries"] = rows_.size();
    info["bytes"] = bytes_;
    info["capacity_bytes"] = capacity_;
    info["hits"] = hits_;
    info["misses"] = misses_;
    info["generation"] = generation_;
    return info;
}

}  // namespace kvaddr::py_bindings
