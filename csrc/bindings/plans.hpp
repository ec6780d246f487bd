// The fused per-request plans (docs/address-rows.md): the chunk walk, the keys and the rows of one KV-cache
// group in one native call, built on an AddressTable.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings/address_table.hpp"

namespace kvaddr::py_bindings {

// Receive thread, list output: (keys, addr_rows, size_rows, block_ids), index-aligned.
// Every int argument is a py::handle converted with as_int64 (TypeError for floats, OverflowError outside int64,
// the caller's own __index__ exceptions unchanged), before anything else is read.
py::tuple plan_load(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                    py::handle token_len, py::handle mask_num, py::handle load_mask, py::handle block_ids);

// Receive thread, array output for a staged load: (keys, addrs (n, R), sizes (n, R), block_ids (n,),
// slot offsets (n,), object sizes (n,), total staging bytes), all int64 arrays but the keys list and the
// total. Slots are laid out as staging_plan_slots does with `slot_alignment`.
py::tuple plan_load_arrays(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                           py::handle token_len, py::handle mask_num, py::handle load_mask, py::handle block_ids,
                           py::handle slot_alignment);

// Send thread: (keys, chunks as (start, end) tuples, block ids) of this rank's stripe, without chunks past
// block_ids and (skip_null) those on block 0.
py::tuple plan_store(AddressTable& table, py::handle prefix, py::handle hashes, py::handle hash_len,
                     py::handle token_len, py::handle mask_num, py::handle chunk_mask, py::handle put_step,
                     py::handle put_step_rank, py::handle block_ids, py::handle skip_null);

}  // namespace kvaddr::py_bindings
