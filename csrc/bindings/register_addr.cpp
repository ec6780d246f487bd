// Registration of the one GIL-release threshold (gil_policy.hpp) that every native loop reads.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings/common.hpp"
#include "bindings/gil_policy.hpp"

namespace kvaddr::py_bindings {

void register_addr(py::module_& m) {
    m.attr("GIL_RELEASE_MIN_WORK_NS") = kGilReleaseMinWorkNs;
    m.def("gil_release_min_work_ns", []() { return gil_release_min_work_ns().load(); },
          "Estimated nanoseconds of work from which a native loop releases the GIL (docs/gil-policy.md).");
    m.def(
        "set_gil_release_min_work_ns",
        [](py::handle ns) { gil_release_min_work_ns().store(static_cast<int64_t>(as_size(ns.ptr(), "ns"))); },
        py::arg("ns"), "Sets that threshold for every native loop in the process (the tests set 0).");
}

}  // namespace kvaddr::py_bindings
