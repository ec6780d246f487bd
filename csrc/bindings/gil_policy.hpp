// The one GIL-release policy of the native module (docs/gil-policy.md).
//
// A native loop releases the GIL only when its estimated work is at least kGilReleaseMinWorkNs. Releasing
// is free; getting the GIL back is not: when another Python thread is busy, re-acquiring waits for that
// thread's switch interval (5 ms by default). Measured beside a spinning thread, the headline array output
// (225,800 cells, ~0.2 ms of work) took ~5.5 ms per call with a release and ~0.3 ms without. So release only
// for work that is itself a sizeable fraction of a switch interval: then the other threads gain about as
// much as the caller may lose. Work is estimated from measured per-item costs on this project's reference
// machine (below); callers add up what they will do, in nanoseconds, and ask release_gil_for(). Nothing that
// runs while the GIL is released may touch a Python object: only C++ values and buffers kept alive by
// references taken beforehand.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvaddr::py_bindings {

// 1 ms: a fifth of the default switch interval (the default of the one process-wide threshold below).
constexpr int64_t kGilReleaseMinWorkNs = 1'000'000;

// The threshold every native loop asks (_native.set_gil_release_min_work_ns sets it; the tests set 0 to run
// the released paths on small inputs).
inline std::atomic<int64_t>& gil_release_min_work_ns() noexcept {
    static std::atomic<int64_t> threshold{kGilReleaseMinWorkNs};
    return threshold;
}

// Measured costs (ns per item, rounded up).
constexpr int64_t kNsPerMatrixCell = 1;      // one address + one size cell of the array output
constexpr int64_t kNsPerSliceCheck = 1;      // validating one staging slice against the allowed ranges
constexpr int64_t kBytesCopiedPerNs = 4;     // staging copies run at ~4-8 GB/s on one thread

// Saturating estimate: items * ns, clamped so that huge inputs cannot overflow.
constexpr int64_t work_ns(uint64_t items, int64_t ns_per_item) noexcept {
    return items > static_cast<uint64_t>(INT64_MAX / ns_per_item) ? INT64_MAX
                                                                  : static_cast<int64_t>(items) * ns_per_item;
}

inline bool release_gil_for(int64_t estimated_ns) noexcept {
    return estimated_ns >= gil_release_min_work_ns().load(std::memory_order_relaxed);
}

}  // namespace kvaddr::py_bindings
