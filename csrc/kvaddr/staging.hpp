// Staged transfers (SECURITY.md, docs/gil-policy.md): copy each chunk's region slices into one contiguous staging slot per key before
// a put (gather), and a slot back out to the slices after a get (scatter). A Mooncake object is the
// concatenation of its regions in order, so a staged object is byte-identical to a multi-buffer one.
//
// Inputs are the address/size matrix of layout.hpp (keys × regions, row-major int64), one slot offset per
// key into the staging buffer, and the memory ranges slices may touch (the registered KV-cache buffers).
// validate() checks every slice and slot before a byte moves (all-or-nothing); copy() then moves the bytes,
// optionally on several threads, with streaming stores. Pure C++ (no Python headers): both run with the GIL
// released.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "kvaddr/checked.hpp"
#include "kvaddr/ranges.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#define KVADDR_STREAMING_STORES 1
#else
#define KVADDR_STREAMING_STORES 0
#endif

namespace kvaddr::staging {

// ---------------------------------------------------------------------------------------------------------
// Slot planning

// Default slot alignment: a cache line. Mooncake's own copy into 8-byte-misaligned slots ran 3× slower, and
// a slot that starts on a line boundary never shares a line with its neighbour's tail.
constexpr int64_t kDefaultSlotAlignment = 64;

enum class PlanFault { none, negative_size, object_overflow, offset_overflow };

struct PlanProblem {
    PlanFault fault = PlanFault::none;
    std::size_t key = 0;
    std::size_t region = 0;
    int64_t value = 0;  // the offending size (negative_size)
};

// One slot per key, in key order: offsets[k] is the running end rounded up to `alignment` (a power of two),
// object_sizes[k] the sum of the key's sizes (the exact size Mooncake must be given: -800 if the destination
// is larger, -600 if smaller). *total is the end of the last slot (unpadded): the staging bytes needed.
inline PlanProblem plan_slots(const int64_t* sizes, std::size_t keys, std::size_t regions, int64_t alignment,
                              int64_t* offsets, int64_t* object_sizes, int64_t* total) noexcept {
    const int64_t mask = alignment - 1;
    int64_t end = 0;
    for (std::size_t k = 0; k < keys; ++k) {
        const int64_t* row = sizes + k * regions;
        int64_t object = 0;
        for (std::size_t r = 0; r < regions; ++r) {
            if (row[r] < 0) return {PlanFault::negative_size, k, r, row[r]};
            if (!add_checked(object, row[r], &object)) return {PlanFault::object_overflow, k, 0, 0};
        }
        int64_t padded = 0;
        int64_t slot_end = 0;
        if (!add_checked(end, mask, &padded)) return {PlanFault::offset_overflow, k, 0, 0};
        padded &= ~mask;
        if (!add_checked(padded, object, &slot_end)) return {PlanFault::offset_overflow, k, 0, 0};
        offsets[k] = padded;
        object_sizes[k] = object;
        end = slot_end;
    }
    *total = end;
    return {};
}

// ---------------------------------------------------------------------------------------------------------
// Jobs and their validation

enum class Direction { gather, scatter };

// One gather or scatter. All pointers are borrowed; addresses are plain integers until the copy itself.
struct Job {
    Direction direction = Direction::gather;
    const int64_t* addrs = nullptr;    // keys × regions, row-major: where each slice lives
    const int64_t* sizes = nullptr;    // keys × regions: bytes of each slice
    const int64_t* offsets = nullptr;  // keys: byte offset of each key's slot in the staging buffer
    const uint8_t* select = nullptr;   // keys: nonzero = copy this key; nullptr = every key
    std::size_t keys = 0;
    std::size_t regions = 0;
    int64_t staging = 0;      // address of the staging buffer
    int64_t staging_len = 0;  // its length in bytes

    bool selected(std::size_t k) const noexcept { return select == nullptr || select[k] != 0; }
};

enum class Fault {
    none,
    bad_staging,             // staging address/length negative or overflowing
    negative_size,           // a slice with size < 0
    slice_outside,           // a slice not inside any allowed range (or its end overflows)
    slice_overlaps_staging,  // a slice overlapping the staging buffer (memcpy would alias)
    object_overflow,         // the sum of a key's sizes overflows int64
    slot_outside,            // a slot [offset, offset + object size) not inside the staging buffer
    slot_overlap,            // gather: two slots written overlap (key and other_key)
    changed_during_copy,     // the inputs changed between validation and copy (a concurrent writer)
};

struct Problem {
    Fault fault = Fault::none;
    std::size_t key = 0;
    std::size_t region = 0;
    std::size_t other_key = 0;
    int64_t addr = 0;    // the slice's address, or the slot's offset
    int64_t size = 0;    // the slice's size, or the slot's object size
    bool ok() const noexcept { return fault == Fault::none; }
};

// What validate() learned, for copy(): the bytes each selected key moves (0 for unselected keys).
struct Validated {
    std::vector<int64_t> key_bytes;
    int64_t total_bytes = 0;
    std::size_t selected_keys = 0;
};

namespace detail {

inline bool ranges_overlap(int64_t a_begin, int64_t a_end, int64_t b_begin, int64_t b_end) noexcept {
    return a_begin < b_end && b_begin < a_end;
}

// Gather writes the slots: two non-empty slots must not overlap, or two threads (or two slices) would write
// the same bytes. Offsets from plan_slots are increasing, which the first loop confirms in O(keys); only
// hand-made layouts pay for the sort.
inline Problem check_slots_disjoint(const Job& job, const Validated& v) {
    std::vector<std::pair<int64_t, std::size_t>> order;
    int64_t previous_end = INT64_MIN;
    bool sorted = true;
    for (std::size_t k = 0; k < job.keys; ++k) {
        if (v.key_bytes[k] == 0) continue;
        const int64_t begin = job.offsets[k];
        if (begin < previous_end) sorted = false;
        if (sorted) previous_end = begin + v.key_bytes[k];  // inside the staging length: cannot overflow
        order.emplace_back(begin, k);
    }
    if (sorted) return {};
    std::sort(order.begin(), order.end());
    for (std::size_t i = 1; i < order.size(); ++i) {
        const std::size_t a = order[i - 1].second;
        const std::size_t b = order[i].second;
        if (order[i - 1].first + v.key_bytes[a] > order[i].first) {
            Problem p{Fault::slot_overlap, std::min(a, b), 0, std::max(a, b), 0, 0};
            p.addr = job.offsets[p.key];
            p.size = v.key_bytes[p.key];
            return p;
        }
    }
    return {};
}

}  // namespace detail

// Checks every selected key before anything is copied: each non-empty slice lies inside one allowed range
// and not in the staging buffer, sizes are >= 0, and each slot lies inside the staging buffer (and, for a
// gather, slots do not overlap). Unselected keys are not read. Empty slices are never dereferenced, so their
// address is not checked. Returns the first fault in key-major order; on success fills *out.
inline Problem validate(const Job& job, const RangeSet& allowed, Validated* out) {
    int64_t staging_end = 0;
    if (job.staging < 0 || job.staging_len < 0 || !add_checked(job.staging, job.staging_len, &staging_end)) {
        return {Fault::bad_staging, 0, 0, 0, job.staging, job.staging_len};
    }
    out->key_bytes.assign(job.keys, 0);
    out->total_bytes = 0;
    out->selected_keys = 0;
    std::vector<std::size_t> hints(job.regions, RangeSet::npos);
    for (std::size_t k = 0; k < job.keys; ++k) {
        if (!job.selected(k)) continue;
        const int64_t* addr_row = job.addrs + k * job.regions;
        const int64_t* size_row = job.sizes + k * job.regions;
        int64_t object = 0;
        for (std::size_t r = 0; r < job.regions; ++r) {
            const int64_t addr = addr_row[r];
            const int64_t size = size_row[r];
            if (size < 0) return {Fault::negative_size, k, r, 0, addr, size};
            if (size == 0) continue;
            int64_t end = 0;
            if (!add_checked(addr, size, &end)) return {Fault::slice_outside, k, r, 0, addr, size};
            const std::size_t found = allowed.find(addr, end, hints[r]);
            if (found == RangeSet::npos) return {Fault::slice_outside, k, r, 0, addr, size};
            hints[r] = found;
            if (detail::ranges_overlap(addr, end, job.staging, staging_end)) {
                return {Fault::slice_overlaps_staging, k, r, 0, addr, size};
            }
            if (!add_checked(object, size, &object)) return {Fault::object_overflow, k, r, 0, addr, size};
        }
        const int64_t offset = job.offsets[k];
        if (offset < 0 || offset > job.staging_len || object > job.staging_len - offset) {
            return {Fault::slot_outside, k, 0, 0, offset, object};
        }
        out->key_bytes[k] = object;
        ++out->selected_keys;
        // Every slot is inside the staging buffer, so the running total of disjoint gathers cannot overflow;
        // overlapping scatter slots can, hence the check.
        if (!add_checked(out->total_bytes, object, &out->total_bytes)) {
            return {Fault::object_overflow, k, 0, 0, offset, object};
        }
    }
    if (job.direction == Direction::gather) return detail::check_slots_disjoint(job, *out);
    return {};
}

namespace detail {

// Addresses read best in hex (as in /proc/self/maps and debuggers); negative values keep their sign.
inline std::string hex_address(int64_t value) {
    static constexpr char kDigits[] = "0123456789abcdef";
    uint64_t magnitude = value < 0 ? uint64_t{0} - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
    std::string digits;
    do {
        digits.insert(digits.begin(), kDigits[magnitude & 15]);
        magnitude >>= 4;
    } while (magnitude != 0);
    return (value < 0 ? "-0x" : "0x") + digits;
}

}  // namespace detail

// A caller-facing description of a fault, naming the key and region.
inline std::string describe(const Problem& p, const Job& job) {
    const std::string where = "key " + std::to_string(p.key) + " region " + std::to_string(p.region);
    const std::string slice = "slice [" + detail::hex_address(p.addr) + ", +" + std::to_string(p.size) + ")";
    const std::string slot = "slot [" + std::to_string(p.addr) + ", +" + std::to_string(p.size) + ")";
    const std::string staging_len = std::to_string(job.staging_len);
    switch (p.fault) {
        case Fault::none:
            return "no fault";
        case Fault::bad_staging:
            return "staging buffer (address " + detail::hex_address(p.addr) + ", " + std::to_string(p.size) +
                   " bytes) is not a valid memory range";
        case Fault::negative_size:
            return where + ": negative size " + std::to_string(p.size);
        case Fault::slice_outside:
            return where + ": " + slice + " is not inside any allowed memory range (registered KV-cache buffer)";
        case Fault::slice_overlaps_staging:
            return where + ": " + slice + " overlaps the staging buffer";
        case Fault::object_overflow:
            return "key " + std::to_string(p.key) + ": object size (sum of its region sizes) overflows int64";
        case Fault::slot_outside:
            return "key " + std::to_string(p.key) + ": " + slot + " does not fit in the " + staging_len +
                   "-byte staging buffer";
        case Fault::slot_overlap:
            return "key " + std::to_string(p.key) + ": " + slot + " overlaps the slot of key " +
                   std::to_string(p.other_key) + " (gather slots must be disjoint)";
        case Fault::changed_during_copy:
            return where + ": the address/size/offset/select arrays changed while they were being copied (another "
                           "thread wrote them); the slices after this point were not copied";
    }
    return "unknown fault";
}

// ---------------------------------------------------------------------------------------------------------
// The copy

// Streaming stores only pay off beyond a few cache lines: below this a slice is one plain memcpy.
constexpr std::size_t kStreamMinBytes = 256;
// Below this many bytes in total an "auto" job runs on the calling thread: starting and joining a thread
// cost ~60–100 µs on a busy 2-core box, and 2 threads only beat 1 from ~6 MiB (2 KiB slices, measured
// interleaved: 3.1 MiB 359 vs 419 µs, 6.3 MiB 642 vs 592 µs, 12.5 MiB 1.85 vs 1.33 ms for a gather).
constexpr int64_t kParallelMinBytes = int64_t{8} << 20;
// Threads used when the caller asks for "auto" (0): two saturate a socket's store bandwidth for this
// pattern on the machines we measured, more only add start-up cost.
constexpr unsigned kAutoThreads = 2;
constexpr unsigned kMaxThreads = 64;

#if KVADDR_STREAMING_STORES
// dst ← src with non-temporal stores: the destination bypasses the cache, so scattering into thousands of
// 2 KiB KV blocks does not read every destination line first (read-for-ownership) or evict the source.
// The unaligned head (to a 16-byte boundary) and the sub-16-byte tail are plain copies. n >= 16.
inline void stream_copy(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept {
    const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    for (; n >= 16; n -= 16, dst += 16, src += 16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    }
#if defined(__x86_64__)
    if (n >= 8) {
        long long word = 0;
        std::memcpy(&word, src, sizeof word);
        _mm_stream_si64(reinterpret_cast<long long*>(dst), word);
        dst += 8;
        src += 8;
        n -= 8;
    }
#endif
    std::memcpy(dst, src, n);
}
#endif

inline void copy_bytes(unsigned char* dst, const unsigned char* src, std::size_t n, bool streaming) noexcept {
#if KVADDR_STREAMING_STORES
    if (streaming && n >= kStreamMinBytes) {
        stream_copy(dst, src, n);
        return;
    }
#else
    (void)streaming;
#endif
    std::memcpy(dst, src, n);
}

// Streaming stores are weakly ordered: fence them before the thread reports completion, so whoever reads
// the destination next (Mooncake, another thread after join) sees every byte.
inline void store_fence() noexcept {
#if KVADDR_STREAMING_STORES
    _mm_sfence();
#endif
}

// Gather reads thousands of scattered 2 KiB slices: the hardware prefetcher only ramps up inside a slice.
// Touching the first lines of the next slice while copying this one raised a streaming gather from ~5.0 to
// ~7.4 GB/s on one thread (2258 × 100 × 2 KiB; 256–1024 bytes measured alike, 2048 worse). A prefetch of an
// unchecked address cannot fault, so the next slice needs no validation first.
constexpr int64_t kPrefetchBytes = 512;

inline void prefetch_source(int64_t address, int64_t size) noexcept {
#if KVADDR_STREAMING_STORES
    const int64_t n = std::min<int64_t>(size, kPrefetchBytes);
    // Unsigned: the address is unchecked and may sit at the top of the int64 range.
    const auto first = static_cast<std::uintptr_t>(address);
    for (int64_t i = 0; i < n; i += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(first + static_cast<std::uintptr_t>(i)), _MM_HINT_T0);
    }
#else
    (void)address;
    (void)size;
#endif
}

inline unsigned char* as_pointer(int64_t address) noexcept {
    return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(address));
}

namespace detail {

// Copies keys [first, last). Every slice and slot is checked again as it is copied (a few comparisons, with
// the hint): validation ran on the same arrays, but a caller thread may write them while the GIL is
// released, and a changed entry must never turn into a write outside the validated memory. Stops at the
// first inconsistency and reports it.
inline Problem copy_keys(const Job& job, const RangeSet& allowed, std::size_t first, std::size_t last,
                         bool streaming, int64_t* copied) noexcept {
    const int64_t staging_end = job.staging + job.staging_len;  // validated: no overflow
    std::vector<std::size_t> hints;
    try {
        hints.assign(job.regions, RangeSet::npos);
    } catch (...) {
        // Out of memory for R hints: run without them (every lookup is a binary search).
    }
    int64_t moved = 0;
    Problem problem;
    for (std::size_t k = first; k < last && problem.ok(); ++k) {
        if (!job.selected(k)) continue;
        const int64_t offset = job.offsets[k];
        if (offset < 0 || offset > job.staging_len) {
            problem = {Fault::changed_during_copy, k, 0, 0, offset, 0};
            break;
        }
        int64_t room = job.staging_len - offset;
        unsigned char* slot = as_pointer(job.staging + offset);
        const int64_t* addr_row = job.addrs + k * job.regions;
        const int64_t* size_row = job.sizes + k * job.regions;
        for (std::size_t r = 0; r < job.regions; ++r) {
            const int64_t addr = addr_row[r];
            const int64_t size = size_row[r];
            if (size == 0) continue;
            int64_t end = 0;
            std::size_t found = RangeSet::npos;
            if (size > 0 && size <= room && add_checked(addr, size, &end)) {
                found = allowed.find(addr, end, hints.empty() ? RangeSet::npos : hints[r]);
            }
            if (found == RangeSet::npos || ranges_overlap(addr, end, job.staging, staging_end)) {
                problem = {Fault::changed_during_copy, k, r, 0, addr, size};
                break;
            }
            if (!hints.empty()) hints[r] = found;
            const auto n = static_cast<std::size_t>(size);
            if (job.direction == Direction::gather) {
                if (r + 1 < job.regions) prefetch_source(addr_row[r + 1], size_row[r + 1]);
                copy_bytes(slot, as_pointer(addr), n, streaming);
            } else {
                copy_bytes(as_pointer(addr), slot, n, streaming);
            }
            slot += n;
            room -= size;
            moved += size;
        }
    }
    if (streaming) store_fence();
    *copied = moved;
    return problem;
}

// Splits keys into `parts` contiguous runs carrying about equal bytes; bounds has parts + 1 entries.
inline std::vector<std::size_t> split_keys(const Validated& v, std::size_t parts) {
    std::vector<std::size_t> bounds(parts + 1, v.key_bytes.size());
    bounds[0] = 0;
    int64_t running = 0;
    std::size_t part = 1;
    const auto n = static_cast<int64_t>(parts);
    // floor(total * part / parts) without the overflowing product: q * part + rem * part / parts.
    const auto share = [&](std::size_t part) {
        const auto p = static_cast<int64_t>(part);
        return v.total_bytes / n * p + v.total_bytes % n * p / n;
    };
    for (std::size_t k = 0; k < v.key_bytes.size() && part < parts; ++k) {
        running += v.key_bytes[k];
        while (part < parts && running >= share(part)) bounds[part++] = k + 1;
    }
    return bounds;
}

}  // namespace detail

// Threads a job of `total_bytes` over `selected_keys` keys would run on, for a requested count (0 = auto).
inline unsigned thread_count(unsigned requested, int64_t total_bytes, std::size_t selected_keys) noexcept {
    unsigned n = requested;
    if (n == 0) {
        const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
        n = total_bytes >= kParallelMinBytes ? std::min(kAutoThreads, hardware) : 1;
    }
    n = std::min(n, kMaxThreads);
    if (selected_keys < n) n = static_cast<unsigned>(std::max<std::size_t>(selected_keys, 1));
    return n;
}

// Copies a validated job on `threads` threads (the caller's included). Returns a changed_during_copy fault
// if a concurrent writer altered the inputs (the bytes copied so far stay copied); *copied = bytes moved.
inline Problem copy(const Job& job, const RangeSet& allowed, const Validated& v, unsigned threads,
                    bool streaming, int64_t* copied) {
    const std::size_t parts = thread_count(threads, v.total_bytes, v.selected_keys);
    if (parts <= 1) return detail::copy_keys(job, allowed, 0, job.keys, streaming, copied);

    const std::vector<std::size_t> bounds = detail::split_keys(v, parts);
    std::vector<Problem> problems(parts);
    std::vector<int64_t> moved(parts, 0);
    std::vector<std::thread> workers;
    workers.reserve(parts - 1);
    std::size_t inline_from = parts - 1;  // parts [inline_from, parts) run on this thread
    for (std::size_t i = 0; i + 1 < parts; ++i) {
        try {
            workers.emplace_back([&, i] {
                problems[i] = detail::copy_keys(job, allowed, bounds[i], bounds[i + 1], streaming, &moved[i]);
            });
        } catch (const std::system_error&) {
            inline_from = i;  // no more threads available: do the rest here
            break;
        }
    }
    for (std::size_t i = inline_from; i < parts; ++i) {
        problems[i] = detail::copy_keys(job, allowed, bounds[i], bounds[i + 1], streaming, &moved[i]);
    }
    for (std::thread& worker : workers) worker.join();
    int64_t total = 0;
    for (int64_t m : moved) total += m;
    *copied = total;
    for (const Problem& p : problems) {
        if (!p.ok()) return p;
    }
    return {};
}

}  // namespace kvaddr::staging
