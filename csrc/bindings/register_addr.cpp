// Registration of the address paths: AddressTable (address_table.hpp), the fused plans (plans.hpp). Nothing
// else lives here.
#include <pybind11/pybind11.h>

#include "bindings/address_table.hpp"
#include "bindings/common.hpp"
#include "bindings/gil_policy.hpp"
#include "bindings/plans.hpp"
#include "kvaddr/staging.hpp"

namespace kvaddr::py_bindings {

void register_addr(py::module_& m) {
    m.attr("GIL_RELEASE_MIN_WORK_NS") = kGilReleaseMinWorkNs;
    py::class_<AddressTable>(m, "AddressTable",
                             "Address/size matrix of one KV-cache group over the registered regions.")
        .def(py::init<int64_t, int64_t, std::size_t>(), py::arg("block_size"), py::arg("hash_block_size"),
             py::arg("cache_bytes"))
        .def("set_regions", &AddressTable::set_regions, py::arg("kv_caches_base_addr"), py::arg("block_len"))
        .def("prepare_values", &AddressTable::prepare_values, py::arg("chunks"), py::arg("block_ids"))
        .def("prepare_values_array", &AddressTable::prepare_values_array, py::arg("chunks"), py::arg("block_ids"))
        .def("prepare_value_for_block", &AddressTable::prepare_value_for_block, py::arg("block_id"))
        .def("plan_load", &plan_load, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"), py::arg("token_len"),
             py::arg("mask_num"), py::arg("load_mask"), py::arg("block_ids"))
        .def("plan_load_arrays", &plan_load_arrays, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"),
             py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"), py::arg("block_ids"),
             py::arg("slot_alignment") = staging::kDefaultSlotAlignment)
        .def("plan_store", &plan_store, py::arg("prefix"), py::arg("hashes"), py::arg("hash_len"),
             py::arg("token_len"), py::arg("mask_num"), py::arg("chunk_mask"), py::arg("put_step"),
             py::arg("put_step_rank"), py::arg("block_ids"), py::arg("skip_null"))
        .def_property("cache_capacity", &AddressTable::cache_capacity, &AddressTable::set_cache_capacity)
        .def_property("immutable_rows", &AddressTable::immutable_rows, &AddressTable::set_immutable_rows,
                      "Rows as tuples shared with the row cache (no per-call copy) instead of fresh lists.")
        .def("cache_info", &AddressTable::cache_info)
        .def("clear_cache", &AddressTable::clear_cache)
        .def("pin_regions", &AddressTable::pin_regions, py::arg("kv_caches_base_addr"), py::arg("block_len"))
        .def("unpin_regions", &AddressTable::unpin_regions)
        .def_property_readonly("region_pins", &AddressTable::region_pins)
        .def_property_readonly("block_size", &AddressTable::block_size)
        .def_property_readonly("hash_block_size", &AddressTable::hash_block_size);
}

}  // namespace kvaddr::py_bindings
