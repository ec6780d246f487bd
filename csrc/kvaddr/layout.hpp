// The address arithmetic of every layout (docs/address-rows.md, docs/vllm.md "One engine for every layout").
// Pure C++ (no Python headers) so it can run with the GIL released.
//
// One key's value is a list of segments; segment s of a chunk whose first block is `block_id` covering
// `count` blocks lives at
//   addr[s] = base[s] + block_id * stride[s]        size[s] = size0[s] * (scales ? count : 1)
// The rank-local layout (and the seed-era database, which is one) has one template: the regions, with
// stride = size0 = block_len[r % L] and sizes scaling with the block count. A TP-shared layout has one
// template per store shard it owns (fixed sizes, one block per key).
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvaddr/checked.hpp"

namespace kvaddr::layout {

inline uint64_t magnitude(int64_t v) noexcept {
    return v < 0 ? uint64_t{0} - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
}

// The segments of one store object (one shard's template).
struct Segments {
    std::vector<int64_t> base;
    std::vector<int64_t> stride;
    std::vector<int64_t> size;
    bool size_scales = false;  // size × the chunk's block count (rank-local) or fixed (TP-shared)
    // |block_id| (|count|) up to which no cell can overflow: those rows take the plain, vectorisable loop.
    uint64_t unchecked_id_limit = 0;
    uint64_t unchecked_count_limit = 0;

    std::size_t count() const noexcept { return base.size(); }

    // Call once after filling the three vectors (equal lengths).
    void finalize() noexcept {
        uint64_t max_base = 0, max_stride = 1, max_size = 1;
        for (std::size_t s = 0; s < count(); ++s) {
            max_base = std::max(max_base, magnitude(base[s]));
            max_stride = std::max(max_stride, magnitude(stride[s]));
            max_size = std::max(max_size, magnitude(size[s]));
        }
        constexpr auto kMax = static_cast<uint64_t>(INT64_MAX);
        // |base + id * stride| <= max_base + |id| * max_stride <= INT64_MAX whenever |id| <= the limit.
        unchecked_id_limit = max_base >= kMax ? 0 : (kMax - max_base) / max_stride;
        unchecked_count_limit = kMax / max_size;
    }
};

// out[s] = base[s] + block_id * stride[s]; false if any cell overflows int64 (out is then garbage).
inline bool address_row(const Segments& t, int64_t block_id, int64_t* out) noexcept {
    const std::size_t n = t.count();
    const int64_t* base = t.base.data();
    const int64_t* stride = t.stride.data();
    if (magnitude(block_id) <= t.unchecked_id_limit) {
        for (std::size_t s = 0; s < n; ++s) out[s] = base[s] + block_id * stride[s];
        return true;
    }
    bool ok = true;
    for (std::size_t s = 0; s < n; ++s) {
        int64_t offset = 0;
        // Non-short-circuit '&': one flag for the whole row, no branch in the loop.
        ok &= mul_checked(block_id, stride[s], &offset) & add_checked(base[s], offset, &out[s]);
    }
    return ok;
}

// out[s] = size[s] * count (or size[s] when sizes do not scale); false on overflow.
inline bool size_row(const Segments& t, int64_t block_count, int64_t* out) noexcept {
    const std::size_t n = t.count();
    const int64_t* size = t.size.data();
    if (!t.size_scales) {
        std::copy(size, size + n, out);
        return true;
    }
    if (magnitude(block_count) <= t.unchecked_count_limit) {
        for (std::size_t s = 0; s < n; ++s) out[s] = size[s] * block_count;
        return true;
    }
    bool ok = true;
    for (std::size_t s = 0; s < n; ++s) ok &= mul_checked(size[s], block_count, &out[s]);
    return ok;
}

// One key's value after validation: the chunk's first block id, its block count, which local shard.
struct KeyPlan {
    int64_t block_id = 0;
    int64_t block_count = 1;
    std::size_t shard = 0;
};

// The whole matrix into caller-owned row-major buffers (keys × segments; every template has `width`
// segments). Returns the index of the first key whose row overflows, or plans.size().
inline std::size_t fill_rows(const std::vector<Segments>& templates, const std::vector<KeyPlan>& plans,
                             std::size_t width, int64_t* addrs, int64_t* sizes) noexcept {
    for (std::size_t k = 0; k < plans.size(); ++k) {
        const Segments& t = templates[plans[k].shard];
        if (!address_row(t, plans[k].block_id, addrs + k * width) ||
            !size_row(t, plans[k].block_count, sizes + k * width)) {
            return k;
        }
    }
    return plans.size();
}

// The first chunk of a walk under vLLM 0.32+'s rule: ceil(mask_num / block_size), at least 0.
inline int64_t first_chunk_ceil(int64_t mask_num, int64_t block_size) noexcept {
    return std::max<int64_t>(0, ceil_div(mask_num, block_size));
}

// Why a seed-era chunk span was rejected by check_span.
enum class SpanError { none, misaligned, overflow };

// A seed-era (start, end) span, validated with Python's floor semantics: (end - start) must be a multiple of
// hash_block_size; the block count is ceil(span / block_size). Both sizes are > 0 (checked at construction).
inline SpanError check_span(int64_t start, int64_t end, int64_t hash_block_size, int64_t block_size,
                            int64_t* block_count) noexcept {
    int64_t span = 0;
    if (__builtin_sub_overflow(end, start, &span)) return SpanError::overflow;
    // A remainder is zero under floor and truncating division alike, so C++'s % decides alignment.
    if (span % hash_block_size != 0) return SpanError::misaligned;
    *block_count = ceil_div(span, block_size);
    return SpanError::none;
}

}  // namespace kvaddr::layout
