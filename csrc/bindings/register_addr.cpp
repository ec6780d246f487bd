// Registration of the address paths: AddressTable (address_table.hpp), the fused plans (plans.hpp) and the
// one GIL-release threshold (gil_policy.hpp). Nothing else lives here.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "bindings/address_table.hpp"
#include "bindings/common.hpp"
#include "bindings/gil_policy.hpp"
#include "bindings/plans.hpp"
#include "kvaddr/staging.hpp"

namespace kvaddr::py_bindings {

void register_addr(py::module_& m) {
    m.attr("GIL_RELEASE_MIN_WORK_NS") = kGilReleaseMinWorkNs;
    m.def("gil_release_min_work_ns", []() { return gil_release_min_work_ns().load(); },
          "Estimated nanoseconds of work from which a native loop releases the GIL (docs/gil-policy.md).");
    m.def(
        "set_gil_release_min_work_ns",
        [](py::handle ns) { gil_release_min_work_ns().store(static_cast<int64_t>(as_size(ns.ptr(), "ns"))); },
        py::arg("ns"), "Sets that threshold for every native loop in the process (the tests set 0).");
    // Every method goes through checked()/constructed() (common.hpp): an instance made by __new__ without
    // __init__ raises TypeError instead of running on uninitialised memory. Int arguments are handles
    // converted with as_int64/as_size (TypeError for floats and other non-ints, OverflowError outside int64, a
    // caller's __index__ exception unchanged), never pybind11's int casters, which truncate floats through
    // __int__ and replace a raising __index__ with "incompatible function arguments".
    py::class_<AddressTable> table(m, "AddressTable",
                                   "Address/size matrix of one KV-cache group over the registered regions.");
    table.def(py::init([](py::handle block_size, py::handle hash_block_size, py::handle cache_bytes) {
                 const int64_t bs = as_int64(block_size.ptr(), "block_size");
                 const int64_t hbs = as_int64(hash_block_size.ptr(), "hash_block_size");
                 const std::size_t cache = as_size(cache_bytes.ptr(), "cache_bytes");
                 return std::make_unique<AddressTable>(bs, hbs, cache);
             }),
             py::arg("block_size"), py::arg("hash_block_size"), py::arg("cache_bytes"))
        .def("set_regions",
             [](py::handle self, py::object base, py::object block_len) {
                 constructed<AddressTable>(self).engine().set_region_sources(std::move(base), std::move(block_len));
             },
             py::arg("kv_caches_base_addr"), py::arg("block_len"))
        .def("prepare_values", checked(&AddressTable::prepare_values), py::arg("chunks"), py::arg("block_ids"))
        .def("prepare_values_array", checked(&AddressTable::prepare_values_array), py::arg("chunks"),
             py::arg("block_ids"))
        .def("prepare_value_for_block", checked(&AddressTable::prepare_value_for_block), py::arg("block_id"))
        .def("plan_load",
             [](py::handle self, py::handle prefix, py::handle hashes, py::handle hash_len, py::handle token_len,
                py::handle mask_num, py::handle load_mask, py::handle block_ids) {
                 return plan_load(constructed<AddressTable>(self), prefix, hashes, hash_len, token_len, mask_num,
                                  load_mask, block_ids);
             },
             py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"),
             py::arg("load_mask"), py::arg("block_ids"))
        .def("plan_load_arrays",
             [](py::handle self, py::handle prefix, py::handle hashes, py::handle hash_len, py::handle token_len,
                py::handle mask_num, py::handle load_mask, py::handle block_ids, py::handle slot_alignment) {
                 return plan_load_arrays(constructed<AddressTable>(self), prefix, hashes, hash_len, token_len,
                                         mask_num, load_mask, block_ids, slot_alignment);
             },
             py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"),
             py::arg("load_mask"), py::arg("block_ids"), py::arg("slot_alignment") = staging::kDefaultSlotAlignment)
        .def("plan_store",
             [](py::handle self, py::handle prefix, py::handle hashes, py::handle hash_len, py::handle token_len,
                py::handle mask_num, py::handle chunk_mask, py::handle put_step, py::handle put_step_rank,
                py::handle block_ids, py::handle skip_null) {
                 return plan_store(constructed<AddressTable>(self), prefix, hashes, hash_len, token_len, mask_num,
                                   chunk_mask, put_step, put_step_rank, block_ids, skip_null);
             },
             py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"),
             py::arg("chunk_mask"), py::arg("put_step"), py::arg("put_step_rank"), py::arg("block_ids"),
             py::arg("skip_null"))
        .def_property_readonly("block_size", checked(&AddressTable::block_size))
        .def_property_readonly("hash_block_size", checked(&AddressTable::hash_block_size));
    bind_engine_methods(table);
}

}  // namespace kvaddr::py_bindings
