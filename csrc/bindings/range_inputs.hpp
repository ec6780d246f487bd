// Python ranges -> kvaddr::RangeSet (kvaddr/ranges.hpp): the one converter of the bindings, used by the staging
// copies and slices_inside (register_staging.cpp) and the native client's guard (client_inputs.hpp). A
// _native.MemoryRanges holds a set converted once, when its Python owner's registrations change; every caller
// takes one as is, with no conversion or sort per call. Needs the GIL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "bindings/common.hpp"
#include "kvaddr/ranges.hpp"

namespace kvaddr::py_bindings {

// The set behind a _native.MemoryRanges. Made only by _native.memory_ranges and never changed afterwards (the
// class has no __init__ to call again), so a call may read it without the GIL while its argument holds it.
struct MemoryRanges {
    RangeSet set;
};

// How a caller spells ranges when it does not pass a MemoryRanges. Each keeps its own value rule (both are
// pinned by tests: an empty (ptr, 0) pair is a valid entry, an empty [start, start) pair is refused).
enum class RangeForm {
    ptr_nbytes,  // any sequence of (ptr, nbytes) pairs: 0 <= ptr, 0 <= nbytes, end within int64; empty ignored
    start_end,   // an (n, 2) int64 array of [start, end) pairs (the native client's ranges=): 0 < start < end
};

// `obj` as a range set; TypeError for another container, ValueError naming the bad entry.
inline RangeSet convert_ranges(py::handle obj, RangeForm form) {
    RangeSet set;
    if (form == RangeForm::start_end) {
        Export view;
        if (!view.acquire(obj.ptr()) || view.view().ndim != 2 || int64_kind(view.view()) != 1 ||
            view.view().shape[1] != 2) {
            raise(PyExc_TypeError, "ranges must be a (n, 2) int64 array of [start, end) pairs");
        }
        const auto* data = static_cast<const int64_t*>(view.view().buf);
        for (Py_ssize_t i = 0; i < view.view().shape[0]; ++i) {
            const int64_t start = data[2 * i];
            const int64_t end = data[2 * i + 1];
            if (start <= 0 || end <= start) raise(PyExc_ValueError, "ranges must hold 0 < start < end pairs");
            set.add(start, end - start);
        }
    } else {
        FastSequence items(obj.ptr(), "allowed_ranges");
        // The length is read once (append_int64s' rule): a pair's __index__ that grows the list is not followed,
        // one that shrinks it makes items.at raise.
        const Py_ssize_t n = items.size();
        for (Py_ssize_t i = 0; i < n; ++i) {
            const std::string what = "allowed_ranges[" + std::to_string(i) + "]";
            FastSequence pair(items.at(i).ptr(), what.c_str());
            if (pair.size() != 2) {
                raise(PyExc_ValueError, what + " must be a (ptr, nbytes) pair, got " + std::to_string(pair.size()) +
                                            " items");
            }
            const int64_t ptr = as_int64(pair.at(0).ptr(), (what + " ptr").c_str());
            const int64_t nbytes = as_int64(pair.at(1).ptr(), (what + " nbytes").c_str());
            if (!set.add(ptr, nbytes)) {
                raise(PyExc_ValueError, what + " = (" + std::to_string(ptr) + ", " + std::to_string(nbytes) +
                                            ") is not a valid memory range (negative, or its end overflows int64)");
            }
        }
    }
    set.finalize();
    return set;
}

// The range set of a call's argument: a MemoryRanges' own (the caller's reference keeps it alive for the call;
// TypeError for one made without its factory), else `obj` converted in `form` into `scratch`.
inline const RangeSet& ranges_of(py::handle obj, RangeForm form, std::optional<RangeSet>& scratch) {
    static py::detail::type_info* const info = py::detail::get_type_info(typeid(MemoryRanges));
    if (info != nullptr && PyObject_TypeCheck(obj.ptr(), info->type)) return constructed<MemoryRanges>(obj).set;
    scratch = convert_ranges(obj, form);
    return *scratch;
}

}  // namespace kvaddr::py_bindings
