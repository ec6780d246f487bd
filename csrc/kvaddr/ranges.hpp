// The one range set (docs/architecture.md): "is this slice inside memory we registered?", and the rule every
// address/size pair obeys before Mooncake or a native copy sees it (SECURITY.md, "Input forms").
//
// Values arrive as the raw 64 bits of a signed or an unsigned integer. Only 0 < address and 0 <= size with
// address + size <= 2**63 - 1 are slices: a negative value read as signed and a value >= 2**63 read as
// unsigned are the same bit pattern and are refused alike, so no integer form can smuggle a wild pointer past
// a check written for another form. Pure C++ (no Python headers).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvaddr/checked.hpp"

namespace kvaddr {

enum class SliceFault { none, null_address, negative_address, huge_address, negative_size, huge_size, overflow };

// Why (address, size) - raw bits, each read as signed or unsigned - is not a slice; SliceFault::none if it is.
inline SliceFault slice_fault(uint64_t address, uint64_t size, bool address_signed, bool size_signed) noexcept {
    constexpr uint64_t kTop = static_cast<uint64_t>(INT64_MAX);
    if (address == 0) return SliceFault::null_address;
    if (address > kTop) return address_signed ? SliceFault::negative_address : SliceFault::huge_address;
    if (size > kTop) return size_signed ? SliceFault::negative_size : SliceFault::huge_size;
    if (address + size > kTop) return SliceFault::overflow;  // both <= 2**63 - 1: the sum cannot wrap
    return SliceFault::none;
}

inline const char* describe(SliceFault fault) noexcept {
    switch (fault) {
        case SliceFault::none: return "no fault";
        case SliceFault::null_address: return "address 0";
        case SliceFault::negative_address: return "negative address";
        case SliceFault::huge_address: return "address >= 2**63";
        case SliceFault::negative_size: return "negative size";
        case SliceFault::huge_size: return "size >= 2**63";
        case SliceFault::overflow: return "address + size overflows int64";
    }
    return "unknown fault";
}

// A set of [begin, end) ranges, possibly overlapping. find() answers "which range contains this slice" in
// O(log n), with a per-caller hint that makes the common case (region r of every key lives in the same buffer)
// two comparisons. Exact for overlapping ranges without merging them: a slice spanning two adjacent buffers is
// still outside (each buffer is registered with Mooncake on its own).
class RangeSet {
public:
    static constexpr std::size_t npos = static_cast<std::size_t>(-1);

    // False (nothing added) when begin or nbytes is negative or begin + nbytes overflows int64. Empty ranges
    // are accepted and ignored.
    bool add(int64_t begin, int64_t nbytes) {
        int64_t end = 0;
        if (begin < 0 || nbytes < 0 || !add_checked(begin, nbytes, &end)) return false;
        if (nbytes > 0) ranges_.push_back({begin, end});
        return true;
    }

    // Call once after the last add(): sorts by begin and records, for every prefix, the range reaching
    // furthest, so [b, e) is inside some range iff the furthest-reaching range among those with begin <= b
    // ends at or after e.
    void finalize() {
        std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
        furthest_.resize(ranges_.size());
        for (std::size_t i = 0; i < ranges_.size(); ++i) {
            furthest_[i] = (i > 0 && ranges_[furthest_[i - 1]].end >= ranges_[i].end) ? furthest_[i - 1] : i;
        }
    }

    std::size_t size() const noexcept { return ranges_.size(); }

    // Index of a range containing [begin, end) (begin <= end), or npos. `hint` is tried first.
    std::size_t find(int64_t begin, int64_t end, std::size_t hint = npos) const noexcept {
        if (hint < ranges_.size() && ranges_[hint].begin <= begin && end <= ranges_[hint].end) return hint;
        auto after = std::upper_bound(ranges_.begin(), ranges_.end(), begin,
                                      [](int64_t value, const Range& r) { return value < r.begin; });
        if (after == ranges_.begin()) return npos;
        const std::size_t best = furthest_[static_cast<std::size_t>(after - ranges_.begin()) - 1];
        return ranges_[best].end >= end ? best : npos;
    }

    // The slice (raw bits, read as signed or unsigned) obeys slice_fault's rule and lies inside one range.
    // `hint` (may be null): find's hint, set to the range found when there is one.
    bool inside(uint64_t address, uint64_t size, bool address_signed, bool size_signed,
                std::size_t* hint = nullptr) const noexcept {
        if (slice_fault(address, size, address_signed, size_signed) != SliceFault::none) return false;
        const auto begin = static_cast<int64_t>(address);
        const std::size_t found = find(begin, begin + static_cast<int64_t>(size), hint != nullptr ? *hint : npos);
        if (found == npos) return false;
        if (hint != nullptr) *hint = found;
        return true;
    }

private:
    struct Range {
        int64_t begin;
        int64_t end;
    };
    std::vector<Range> ranges_;
    std::vector<std::size_t> furthest_;
};

}  // namespace kvaddr
