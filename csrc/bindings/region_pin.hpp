// The regions a transfer registered, checked inside every call that reads a database's region lists
// (SECURITY.md, "What is validated where").
//
// A database keeps references to the caller's region lists and re-reads them on every call (the reference
// does the same), so another thread can edit them between the transfer's own check of the lists and the
// call that computes addresses from them. While a transfer has pinned a table, each call compares the values
// it just read — the very values its rows are computed from — with the pinned ones, with no Python code in
// between, and refuses the call when they differ: no address outside the registered KV caches is ever
// computed for a transfer. Several transfers may pin the same values (a count); other values are refused.
//
// The strides are pinned too, since addresses are base + block_id * stride: a call compares its effective
// strides (vLLM 0.34's block_stride list when the engine reads one, else block_len, which is the stride under
// vLLM 0.33's rules) with the pinned ones (the block_stride given to pin, else the pinned block_len). So a
// pin taken without strides admits a 0.34 engine only while its strides equal the pinned block lengths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bindings/common.hpp"
#include "bindings/inputs.hpp"

namespace kvaddr::py_bindings {

class RegionPin {
public:
    // Pin the int sequences `bases` / `lens` and, unless None, `strides` (read once, here, in that order, into
    // values this pin owns).
    void pin(py::handle bases, py::handle lens, py::handle strides) {
        std::vector<int64_t> base_values = read(bases, "kv_caches_base_addr");
        std::vector<int64_t> len_values = read(lens, "block_len");
        std::vector<int64_t> stride_values = strides.is_none() ? len_values : read(strides, "block_stride");
        pin(std::move(base_values), std::move(len_values), std::move(stride_values));
    }

    // Pin `bases` / `lens` / effective `strides` (ValueError when pinned to other values by another transfer).
    void pin(std::vector<int64_t> bases, std::vector<int64_t> lens, std::vector<int64_t> strides) {
        if (count_ > 0 && (bases != bases_ || lens != lens_ || strides != strides_)) {
            raise(PyExc_ValueError, "the regions are pinned to other values by another transfer (one database may "
                                    "serve transfers over the same KV caches only)");
        }
        if (count_ == 0) {
            bases_ = std::move(bases);
            lens_ = std::move(lens);
            strides_ = std::move(strides);
        }
        ++count_;
    }

    // Drop one pin (a no-op when none is held).
    void unpin() {
        if (count_ > 0 && --count_ == 0) {
            bases_.clear();
            lens_.clear();
            strides_.clear();
        }
    }

    std::size_t count() const { return count_; }

    // ValueError when pinned and the lists just read hold other values than the pinned ones. `strides` is the
    // call's effective stride list: block_stride when the engine reads one, else `lens` itself.
    void check(const std::vector<int64_t>& bases, const std::vector<int64_t>& lens,
               const std::vector<int64_t>& strides) const {
        if (count_ > 0 && (bases != bases_ || lens != lens_ || strides != strides_)) {
            raise(PyExc_ValueError, "kv_caches_base_addr / block_len / block_stride changed after register_kv_caches: "
                                    "refusing to compute addresses outside the registered KV caches");
        }
    }

private:
    static std::vector<int64_t> read(py::handle obj, const char* what) {
        require_int_sequence(obj, what);  // dict/set/str/bytes/iterators refused, as for set_regions
        FastSequence seq(obj.ptr(), what);
        std::vector<int64_t> out;
        // At most the length it had at the start (an __index__ that keeps appending is not followed), and only
        // what is still there (one that empties the list ends the read).
        const Py_ssize_t n = seq.size();
        for (Py_ssize_t i = 0; i < n && i < seq.size(); ++i) out.push_back(as_int64(seq.at(i).ptr(), what));
        return out;
    }

    std::vector<int64_t> bases_, lens_, strides_;
    std::size_t count_ = 0;
};

}  // namespace kvaddr::py_bindings
