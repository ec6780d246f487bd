// Bindings of the staging gather/scatter kernels (kvaddr/staging.hpp; SECURITY.md).
//
// Arguments are converted and checked with the GIL held: int64 C-contiguous numpy arrays only (the arrays
// prepare_values_array returns), so no Python object is created or read per slice. Validation and the copy
// then run without the GIL when gil_policy.hpp says the work is worth it.
//
// The gather/scatter entry points take a raw staging (pointer, length) and are private (leading underscore):
// mooncake_kvaddr.driver.staging only calls them with ranges inside a staging buffer the project allocated
// and still holds (SECURITY.md).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings/common.hpp"
#include "bindings/gil_policy.hpp"
#include "bindings/range_inputs.hpp"
#include "kvaddr/ranges.hpp"
#include "kvaddr/staging.hpp"

namespace kvaddr::py_bindings {

namespace {

namespace st = kvaddr::staging;

std::string shape_text(const py::array& arr) {
    std::string text = "(";
    for (py::ssize_t i = 0; i < arr.ndim(); ++i) {
        if (i > 0) text += ", ";
        text += std::to_string(arr.shape(i));
    }
    return text + (arr.ndim() == 1 ? ",)" : ")");
}

// `obj` as an int64 C-contiguous array of `ndim` dimensions. TypeError for non-arrays and other dtypes
// (no silent conversion: a cast copy of a 225,800-cell matrix would cost more than the checks it saves);
// ValueError for the wrong number of dimensions or a non-contiguous layout.
py::array int64_array(py::handle obj, const char* what, py::ssize_t ndim) {
    if (!py::isinstance<py::array>(obj)) {
        raise(PyExc_TypeError, std::string(what) + " must be a numpy int64 array, not " + type_name(obj.ptr()));
    }
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (!py::array_t<int64_t>::check_(arr)) {
        raise(PyExc_TypeError, std::string(what) + " must have dtype int64, not " +
                                   py::str(arr.dtype()).cast<std::string>());
    }
    if (arr.ndim() != ndim) {
        raise(PyExc_ValueError, std::string(what) + " must be " + std::to_string(ndim) + "-D, got shape " +
                                    shape_text(arr));
    }
    if (!(arr.flags() & py::array::c_style)) {
        raise(PyExc_ValueError, std::string(what) + " must be C-contiguous (use numpy.ascontiguousarray)");
    }
    return arr;
}

// The optional per-key selection: None, or a bool/uint8 C-contiguous vector of one flag per key.
std::optional<py::array> selection(py::handle obj, std::size_t keys) {
    if (obj.is_none()) return std::nullopt;
    if (!py::isinstance<py::array>(obj)) {
        raise(PyExc_TypeError, "select must be None or a numpy bool/uint8 array, not " + type_name(obj.ptr()));
    }
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (!py::array_t<bool>::check_(arr) && !py::array_t<uint8_t>::check_(arr)) {
        raise(PyExc_TypeError, "select must have dtype bool or uint8, not " + py::str(arr.dtype()).cast<std::string>());
    }
    if (arr.ndim() != 1 || static_cast<std::size_t>(arr.shape(0)) != keys) {
        raise(PyExc_ValueError, "select must have shape (" + std::to_string(keys) + ",) (one flag per key), got " +
                                    shape_text(arr));
    }
    if (!(arr.flags() & py::array::c_style)) {
        raise(PyExc_ValueError, "select must be C-contiguous (use numpy.ascontiguousarray)");
    }
    return arr;
}

// The shared body of gather and scatter. Returns the number of bytes copied.
int64_t run_job(st::Direction direction, py::handle addrs_obj, py::handle sizes_obj, int64_t staging_ptr,
                int64_t staging_len, py::handle offsets_obj, py::handle allowed_obj, py::handle select_obj,
                int64_t threads, bool streaming) {
    // These references keep every buffer alive while the GIL is released.
    const py::array addrs = int64_array(addrs_obj, "addrs", 2);
    const py::array sizes = int64_array(sizes_obj, "sizes", 2);
    if (addrs.shape(0) != sizes.shape(0) || addrs.shape(1) != sizes.shape(1)) {
        raise(PyExc_ValueError, "addrs " + shape_text(addrs) + " and sizes " + shape_text(sizes) +
                                    " must have the same (keys, regions) shape");
    }
    const auto keys = static_cast<std::size_t>(addrs.shape(0));
    const auto regions = static_cast<std::size_t>(addrs.shape(1));
    const py::array offsets = int64_array(offsets_obj, "offsets", 1);
    if (static_cast<std::size_t>(offsets.shape(0)) != keys) {
        raise(PyExc_ValueError, "offsets must have shape (" + std::to_string(keys) + ",) (one slot per key), got " +
                                    shape_text(offsets));
    }
    const std::optional<py::array> select = selection(select_obj, keys);
    std::optional<RangeSet> scratch;  // allowed_ranges converted, unless a MemoryRanges
    const RangeSet& allowed = ranges_of(allowed_obj, RangeForm::ptr_nbytes, scratch);
    if (threads < 0) raise(PyExc_ValueError, "threads must be >= 0 (0 = auto), got " + std::to_string(threads));
    const auto thread_count = static_cast<unsigned>(std::min<int64_t>(threads, st::kMaxThreads));

    st::Job job;
    job.direction = direction;
    job.addrs = static_cast<const int64_t*>(addrs.data());
    job.sizes = static_cast<const int64_t*>(sizes.data());
    job.offsets = static_cast<const int64_t*>(offsets.data());
    job.select = select ? static_cast<const uint8_t*>(select->data()) : nullptr;
    job.keys = keys;
    job.regions = regions;
    job.staging = staging_ptr;
    job.staging_len = staging_len;

    st::Validated validated;
    st::Problem problem;
    int64_t copied = 0;
    {
        // Safe without the GIL: the kernel touches only C++ objects of this frame and the arrays' buffers,
        // which the references above keep alive; it re-checks every slice as it copies, so a Python thread
        // writing the arrays meanwhile can garble bytes but never direct a write outside the allowed ranges.
        std::optional<py::gil_scoped_release> release;
        if (release_gil_for(work_ns(static_cast<uint64_t>(keys) * regions, kNsPerSliceCheck))) release.emplace();
        problem = st::validate(job, allowed, &validated);
        if (problem.ok()) {
            const int64_t copy_ns = validated.total_bytes / kBytesCopiedPerNs;
            if (!release && release_gil_for(copy_ns)) release.emplace();
            problem = st::copy(job, allowed, validated, thread_count, streaming, &copied);
        }
    }
    if (problem.fault == st::Fault::changed_during_copy) raise(PyExc_RuntimeError, st::describe(problem, job));
    if (!problem.ok()) raise(PyExc_ValueError, st::describe(problem, job));
    return copied;
}

py::tuple plan_slots(py::handle sizes_obj, py::handle alignment_obj) {
    const int64_t alignment = as_int64(alignment_obj.ptr(), "alignment");  // an exact int or __index__, never truncated
    if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
        raise(PyExc_ValueError, "alignment must be a positive power of two, got " + std::to_string(alignment));
    }
    const py::array sizes = int64_array(sizes_obj, "sizes", 2);
    const auto keys = static_cast<std::size_t>(sizes.shape(0));
    const auto regions = static_cast<std::size_t>(sizes.shape(1));
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(keys));
    py::array_t<int64_t> object_sizes(static_cast<py::ssize_t>(keys));
    int64_t total = 0;
    // K × R additions: microseconds even at the headline shape, so the GIL stays held.
    const st::PlanProblem problem =
        st::plan_slots(static_cast<const int64_t*>(sizes.data()), keys, regions, alignment,
                       offsets.mutable_data(), object_sizes.mutable_data(), &total);
    switch (problem.fault) {
        case st::PlanFault::none:
            break;
        case st::PlanFault::negative_size:
            raise(PyExc_ValueError, "key " + std::to_string(problem.key) + " region " +
                                        std::to_string(problem.region) + ": negative size " +
                                        std::to_string(problem.value));
        case st::PlanFault::object_overflow:
            raise(PyExc_OverflowError, "key " + std::to_string(problem.key) +
                                           ": object size (sum of its region sizes) overflows int64");
        case st::PlanFault::offset_overflow:
            raise(PyExc_OverflowError, "key " + std::to_string(problem.key) +
                                           ": staging offset overflows int64");
    }
    return py::make_tuple(std::move(offsets), std::move(object_sizes), total);
}

// Per cell of two same-shape int64 arrays (1-D or 2-D, C-contiguous): the slice obeys kvaddr/ranges.hpp's rule
// and lies inside one allowed range. The one range check of the Python layers (the vLLM guard, the driver's
// bounds); with a per-column hint, since column r of every key lives in the same buffer.
py::array_t<bool> slices_inside(py::handle addrs_obj, py::handle sizes_obj, py::handle allowed_obj) {
    const py::ssize_t ndim = py::isinstance<py::array>(addrs_obj) ? py::reinterpret_borrow<py::array>(addrs_obj).ndim() : 0;
    if (ndim != 1 && ndim != 2) {
        raise(PyExc_ValueError, "addrs must be a 1-D or 2-D numpy int64 array");
    }
    const py::array addrs = int64_array(addrs_obj, "addrs", ndim);
    const py::array sizes = int64_array(sizes_obj, "sizes", ndim);
    for (py::ssize_t d = 0; d < ndim; ++d) {
        if (addrs.shape(d) != sizes.shape(d)) {
            raise(PyExc_ValueError, "addrs and sizes must have the same shape, got " + shape_text(addrs) + " and " +
                                        shape_text(sizes));
        }
    }
    std::optional<RangeSet> scratch;  // allowed_ranges converted, unless a MemoryRanges
    const RangeSet& allowed = ranges_of(allowed_obj, RangeForm::ptr_nbytes, scratch);
    const auto rows = static_cast<std::size_t>(addrs.shape(0));
    const auto cols = ndim == 2 ? static_cast<std::size_t>(addrs.shape(1)) : std::size_t{1};
    py::array_t<bool> out(std::vector<py::ssize_t>(addrs.shape(), addrs.shape() + ndim));
    const auto* a = static_cast<const int64_t*>(addrs.data());
    const auto* s = static_cast<const int64_t*>(sizes.data());
    bool* ok = out.mutable_data();
    std::vector<std::size_t> hints(cols, RangeSet::npos);
    {
        // Safe without the GIL: only the two exported arrays (kept alive by `addrs`/`sizes`), the C++ range set
        // and `out` are read or written.
        std::optional<py::gil_scoped_release> release;
        if (release_gil_for(work_ns(static_cast<uint64_t>(rows) * cols, kNsPerSliceCheck))) release.emplace();
        for (std::size_t i = 0; i < rows; ++i) {
            for (std::size_t j = 0; j < cols; ++j) {
                const std::size_t k = i * cols + j;
                ok[k] = allowed.inside(static_cast<uint64_t>(a[k]), static_cast<uint64_t>(s[k]), true, true, &hints[j]);
            }
        }
    }
    return out;
}

// _staging_gather and _staging_scatter: one signature and one body (run_job), `direction` apart.
void def_staging_copy(py::module_& m, const char* name, st::Direction direction, const char* doc) {
    m.def(
        name,
        [direction](py::handle addrs, py::handle sizes, py::handle staging_ptr, py::handle staging_len,
                    py::handle offsets, py::handle allowed_ranges, py::handle select, py::handle threads,
                    py::handle streaming) {
            // Converted one statement each, in parameter order: the order of a call's arguments is unspecified,
            // and with several bad ones the first named must be the one reported, whatever the compiler.
            const int64_t ptr = as_int64(staging_ptr.ptr(), "staging_ptr");
            const int64_t len = as_int64(staging_len.ptr(), "staging_len");
            const int64_t n_threads = as_int64(threads.ptr(), "threads");
            const bool stream = as_flag(streaming);
            return run_job(direction, addrs, sizes, ptr, len, offsets, allowed_ranges, select, n_threads, stream);
        },
        py::arg("addrs"), py::arg("sizes"), py::arg("staging_ptr"), py::arg("staging_len"), py::arg("offsets"),
        py::arg("allowed_ranges"), py::kw_only(), py::arg("select") = py::none(), py::arg("threads") = 0,
        py::arg("streaming") = true, doc);
}

}  // namespace

void register_staging(py::module_& m) {
    m.attr("STAGING_SLOT_ALIGNMENT") = st::kDefaultSlotAlignment;
    m.attr("STAGING_STREAMING_STORES") = static_cast<bool>(KVADDR_STREAMING_STORES);
    m.def("staging_plan_slots", &plan_slots, py::arg("sizes"), py::arg("alignment") = py::int_(st::kDefaultSlotAlignment),
          "Slot offsets (each aligned), per-key object sizes and total staging bytes for a sizes matrix.");
    def_staging_copy(m, "_staging_gather", st::Direction::gather,
                     "Copy each selected key's slices, in region order, into its staging slot. Returns bytes copied.");
    def_staging_copy(m, "_staging_scatter", st::Direction::scatter,
                     "Copy each selected key's staging slot back out to its slices, in region order. Returns bytes "
                     "copied.");
    py::class_<MemoryRanges>(m, "MemoryRanges", py::is_final(),
                             "Memory ranges converted once (made by memory_ranges): taken as is by slices_inside, the "
                             "staging copies and the native client's ranges=.")
        .def("__len__", [](py::handle self) { return constructed<MemoryRanges>(self).set.size(); },
             "The number of non-empty ranges.");
    m.def(
        "memory_ranges",
        [](py::handle allowed_ranges) { return MemoryRanges{convert_ranges(allowed_ranges, RangeForm::ptr_nbytes)}; },
        py::arg("allowed_ranges"), "A sequence of (ptr, nbytes) pairs converted once into a MemoryRanges.");
    m.def("slices_inside", &slices_inside, py::arg("addrs"), py::arg("sizes"), py::arg("allowed_ranges"),
          "Per cell: the (address, size) slice is a valid slice inside one of the (ptr, nbytes) allowed ranges.");
}

}  // namespace kvaddr::py_bindings
