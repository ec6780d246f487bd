// The one address engine behind every layout (docs/address-rows.md; docs/vllm.md, "One engine for every
// layout"): the segment templates (kvaddr/layout.hpp) — read from the caller's region lists for a rank-local
// layout (vLLM 0.33's two lists, or 0.34's three with block_stride), installed per owned shard (and, for
// vLLM 0.34's store chunks, per chunk of a block) for a TP-shared one — with the row cache, the region pin
// and the two outputs (fresh lists, fresh int64 arrays). LayoutEngine (register_layout.cpp: vLLM's store layouts,
// and the seed-era database under its seed rules) is the face over it that converts inputs.
//
// Thread safety: one engine may be used by any number of Python threads at once (vLLM shares one database
// between its send thread and every receive thread). Each call first converts all of its inputs to C++
// values, then takes a template snapshot and the cache generation together (Snapshot), computes on that
// snapshot only, and touches the cache only in steps that run no Python code. Results never alias the cache
// or each other. Needs the GIL except inside the documented release (gil_policy.hpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "bindings/common.hpp"
#include "bindings/region_pin.hpp"
#include "bindings/row_cache.hpp"
#include "kvaddr/layout.hpp"

namespace kvaddr::py_bindings {

using Templates = std::vector<layout::Segments>;
using layout::KeyPlan;

// Templates and the cache generation they were installed under, taken together.
struct Snapshot {
    std::shared_ptr<const Templates> templates;
    uint64_t generation = 0;
};

// How a face reads and names things: the order in which its reference reads the region lists (the seed-era
// database reads block_len first; vLLM 0.33 reads the bases first, block_len only when there are regions),
// and the word its errors use for one row ("chunk" or "key").
struct EngineWords {
    bool lens_first;
    const char* row;
};

class RowEngine {
public:
    // Rank-local: one template, from the caller's region lists. TP-shared: n_templates templates (one per
    // owned shard, or per store chunk and owned shard), all empty until set_templates.
    RowEngine(bool tp_shared, std::size_t n_templates, std::size_t cache_bytes, EngineWords words);
    RowEngine(const RowEngine&) = delete;
    RowEngine& operator=(const RowEngine&) = delete;

    std::size_t template_count() const noexcept { return templates_count_; }

    // Rank-local: keeps references to the caller's lists (the reference stores them by reference too); their
    // contents are re-read by every call, so in-place edits are seen. `block_stride` None: vLLM 0.33's rules
    // (stride = size0 = block_len[r % len(block_len)]); a sequence: vLLM 0.34's (stride = block_stride[r % L],
    // size0 = block_len[r % L], L = len(block_stride)).
    void set_region_sources(py::object base, py::object block_len, py::object block_stride = py::none());
    // Installs new templates and drops the cache: TP-shared, the face's (one per owned shard, one width, checked
    // TP-shared by the face); rank-local, snapshot()'s.
    void set_templates(std::shared_ptr<const Templates> templates);

    // The templates to compute on. Rank-local: reads the caller's lists (may run Python code; the bases first,
    // then, when there are regions, block_stride and block_len, each face in its reference's order), then —
    // with no Python code in between — compares them (and which rules apply) with the current snapshot and
    // installs a new one (dropping the cache) if anything changed.
    Snapshot snapshot();

    // A transfer's registered regions (region_pin.hpp; the faces' pin_regions, unpin_regions, region_pins):
    // while pinned, a call whose lists hold other values (strides included) raises ValueError inside the call
    // instead of computing addresses from them.
    RegionPin& region_pin() noexcept { return pin_; }

    // Rows of validated keys whose block ids are resolved: (addr_rows, size_rows, ids), each row a fresh list,
    // or with immutable_rows a tuple (a cached row's own: shared between results, never changed).
    // `id_objects[k]`, when set, is returned as key k's id (an exact int of the caller's).
    py::tuple rows_as_lists(const Snapshot& snapshot, const std::vector<KeyPlan>& plans,
                            std::vector<py::object>& id_objects);
    // The same as fresh int64 arrays (addrs (n, S), sizes (n, S), ids (n,)); the GIL is released for big ones.
    py::tuple rows_as_arrays(const Snapshot& snapshot, const std::vector<KeyPlan>& plans);
    // Rank-local (checked by the face): (addresses, sizes) of one block in every region of `snapshot`, as fresh
    // lists.
    py::tuple value_for_block(const Snapshot& snapshot, int64_t block_id);

    std::size_t cache_capacity() const { return cache_.capacity(); }
    void set_cache_capacity(std::size_t bytes);
    py::dict cache_info() const { return cache_.info(); }
    void clear_cache();

    bool immutable_rows() const { return immutable_rows_; }
    void set_immutable_rows(bool value) { immutable_rows_ = value; }

private:
    [[noreturn]] void raise_address_overflow(std::size_t row, int64_t block_id) const;
    // The message names block_stride only where `t` has a stride other than its block_len (vLLM 0.34).
    [[noreturn]] void raise_size_overflow(std::size_t row, int64_t block_count, const layout::Segments& t) const;

    bool tp_shared_;
    std::size_t templates_count_;
    EngineWords words_;
    py::object base_source_;
    py::object block_len_source_;
    py::object block_stride_source_;  // None: vLLM 0.33's rules
    std::shared_ptr<const Templates> templates_;
    std::vector<int64_t> seen_lens_, seen_strides_;
    bool seen_with_strides_ = false;  // the installed template follows vLLM 0.34's rules
    bool synced_ = false;          // rank-local: templates_ reflects a successful read of the caller's lists
    bool immutable_rows_ = false;  // rows as tuples (no per-call copy) instead of fresh lists
    RowCache cache_;
    RegionPin pin_;
};

// The engine's methods on a face's Python class (every face has an engine() accessor): the row cache, the
// row form and the region pin, each through constructed() (common.hpp).
template <class Face>
void bind_engine_methods(py::class_<Face>& cls) {
    const auto engine = [](py::handle self) -> RowEngine& { return constructed<Face>(self).engine(); };
    cls.def_property(
           "cache_capacity", [engine](py::handle self) { return engine(self).cache_capacity(); },
           [engine](py::handle self, py::handle bytes) {
               engine(self).set_cache_capacity(as_size(bytes.ptr(), "cache_capacity"));
           })
        .def_property(
            "immutable_rows", [engine](py::handle self) { return engine(self).immutable_rows(); },
            [engine](py::handle self, bool value) { engine(self).set_immutable_rows(value); },
            "Rows as tuples shared with the row cache (no per-call copy) instead of fresh lists.")
        .def("cache_info", [engine](py::handle self) { return engine(self).cache_info(); })
        .def("clear_cache", [engine](py::handle self) { engine(self).clear_cache(); })
        .def("pin_regions",
             [engine](py::handle self, py::handle bases, py::handle block_len, py::handle block_stride) {
                 engine(self).region_pin().pin(bases, block_len, block_stride);
             },
             py::arg("kv_caches_base_addr"), py::arg("block_len"), py::arg("block_stride") = py::none())
        .def("unpin_regions", [engine](py::handle self) { engine(self).region_pin().unpin(); })
        .def_property_readonly("region_pins", [engine](py::handle self) { return engine(self).region_pin().count(); });
}

}  // namespace kvaddr::py_bindings
