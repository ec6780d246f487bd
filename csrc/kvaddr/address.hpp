// The address/size matrix (docs/address-rows.md): for chunk c and region r,
//   addr[c][r] = base[r] + block_id(c) * blen[r]      size[c][r] = blen[r] * block_count(c)
// with blen[r] = block_len[r % L]. Pure C++ (no Python headers) so it can run with the GIL released.
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvaddr/checked.hpp"

namespace kvaddr {

// The registered KV-cache regions, with block lengths already cycled to one per region.
struct Regions {
    std::vector<int64_t> base;  // R region base addresses
    std::vector<int64_t> blen;  // R per-region block lengths (block_len[r % L])
    // |block_id| (and block count) up to which no row can overflow: rows inside it take the plain,
    // vectorisable loop; only rows outside it pay for per-cell overflow checks. Set by finalize().
    uint64_t unchecked_id_limit = 0;
    uint64_t unchecked_count_limit = 0;

    std::size_t size() const noexcept { return base.size(); }

    // Call once after filling base and blen.
    void finalize() noexcept {
        uint64_t max_base = 0;
        uint64_t max_blen = 1;
        for (std::size_t r = 0; r < size(); ++r) {
            max_base = std::max(max_base, magnitude(base[r]));
            max_blen = std::max(max_blen, magnitude(blen[r]));
        }
        constexpr uint64_t kMax = static_cast<uint64_t>(INT64_MAX);
        // |base + id * blen| <= max_base + |id| * max_blen <= INT64_MAX whenever |id| <= the limit.
        unchecked_id_limit = max_base >= kMax ? 0 : (kMax - max_base) / max_blen;
        unchecked_count_limit = kMax / max_blen;
    }

    static uint64_t magnitude(int64_t v) noexcept {
        return v < 0 ? uint64_t{0} - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
    }
};

// A chunk after validation: the first block's id and how many blocks the span covers.
struct ChunkPlan {
    int64_t block_id;
    int64_t block_count;
};

// One chunk's address row: out[r] = base[r] + block_id * blen[r]. False if any entry overflows int64
// (then out holds garbage and must not be used).
inline bool address_row(const Regions& regions, int64_t block_id, int64_t* out) noexcept {
    const std::size_t n = regions.size();
    const int64_t* base = regions.base.data();
    const int64_t* blen = regions.blen.data();
    if (Regions::magnitude(block_id) <= regions.unchecked_id_limit) {
        for (std::size_t r = 0; r < n; ++r) out[r] = base[r] + block_id * blen[r];
        return true;
    }
    bool ok = true;
    for (std::size_t r = 0; r < n; ++r) {
        int64_t offset = 0;
        // Non-short-circuit '&' keeps the loop branch-free so it vectorises; one flag for the whole row.
        ok &= mul_checked(block_id, blen[r], &offset) & add_checked(base[r], offset, &out[r]);
    }
    return ok;
}

// One chunk's size row: out[r] = blen[r] * block_count. False on overflow.
inline bool size_row(const Regions& regions, int64_t block_count, int64_t* out) noexcept {
    const std::size_t n = regions.size();
    const int64_t* blen = regions.blen.data();
    if (Regions::magnitude(block_count) <= regions.unchecked_count_limit) {
        for (std::size_t r = 0; r < n; ++r) out[r] = blen[r] * block_count;
        return true;
    }
    bool ok = true;
    for (std::size_t r = 0; r < n; ++r) {
        ok &= mul_checked(blen[r], block_count, &out[r]);
    }
    return ok;
}

// The whole matrix, row-major (chunks × regions), into caller-owned buffers. Returns the index of the first
// chunk whose row overflows, or plans.size() when every row fits.
inline std::size_t fill_matrix(const Regions& regions, const std::vector<ChunkPlan>& plans, int64_t* addrs,
                               int64_t* sizes) noexcept {
    const std::size_t n_regions = regions.size();
    for (std::size_t c = 0; c < plans.size(); ++c) {
        if (!address_row(regions, plans[c].block_id, addrs + c * n_regions) ||
            !size_row(regions, plans[c].block_count, sizes + c * n_regions)) {
            return c;
        }
    }
    return plans.size();
}

}  // namespace kvaddr

namespace kvaddr {

// Why a chunk was rejected by plan_chunk.
enum class ChunkError { none, misaligned, overflow };

// Validates one (start, end) span the way the reference does, with Python's floor semantics:
// (end - start) must be a multiple of hash_block_size; the block count is ceil(span / block_size).
// Both sizes are > 0 (checked by the caller once, at construction).
inline ChunkError check_span(int64_t start, int64_t end, int64_t hash_block_size, int64_t block_size,
                             int64_t* block_count) noexcept {
    int64_t span = 0;
    if (__builtin_sub_overflow(end, start, &span)) return ChunkError::overflow;
    // A remainder is zero under floor and truncating division alike, so C++'s % decides alignment.
    if (span % hash_block_size != 0) return ChunkError::misaligned;
    *block_count = ceil_div(span, block_size);
    return ChunkError::none;
}

}  // namespace kvaddr
