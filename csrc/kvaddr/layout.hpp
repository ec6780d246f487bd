// The address arithmetic of every layout (docs/address-rows.md, docs/vllm.md "One engine for every layout").
// Pure C++ (no Python headers) so it can run with the GIL released.
//
// One key's value is a list of segments; segment s of a chunk whose first block is `block_id` covering
// `count` blocks lives at
//   addr[s] = base[s] + block_id * stride[s]
//   size[s] = size0[s] + (count - 1) * stride[s]   when the sizes scale, else size0[s]
// i.e. a multi-block chunk runs from its first block's start to the end of its last block's size0 bytes.
// The rank-local layout (and the seed-era database, which is one) has one template: the regions. Under
// vLLM 0.33's rules stride = size0 = block_len[r % L], so the size is block_len * count; under vLLM 0.34's
// stride = block_stride[r % L] and size0 = block_len[r % L] (L = len(block_stride)), so a chunk also covers
// the padding between its blocks. A TP-shared layout has one template per store shard it owns (0.33), or per
// (store chunk of a block, owned shard) (0.34): fixed sizes, one block per key.
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
    bool size_scales = false;  // size grows with the chunk's block count (rank-local) or is fixed (TP-shared)
    // |block_id| up to which, and |count| below which, no cell can overflow: those rows take the plain,
    // vectorisable loop.
    uint64_t unchecked_id_limit = 0;
    uint64_t unchecked_count_bound = 0;

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
        // |size0 + (count - 1) * stride| <= max_size + (|count| + 1) * max_stride <= INT64_MAX whenever
        // |count| < the bound (so count - 1 cannot overflow either).
        unchecked_count_bound = max_size >= kMax ? 0 : (kMax - max_size) / max_stride;
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

// The one size rule: out[s] = size0[s] + (count - 1) * stride[s] when the sizes scale, else size0[s]; false
// when a cell does not fit in int64. The checked path computes exactly (128-bit) and only then checks the
// range, so with stride == size0 (vLLM 0.33) it overflows exactly where size0 * count does.
inline bool size_row(const Segments& t, int64_t block_count, int64_t* out) noexcept {
    const std::size_t n = t.count();
    const int64_t* size = t.size.data();
    const int64_t* stride = t.stride.data();
    if (!t.size_scales) {
        std::copy(size, size + n, out);
        return true;
    }
    if (magnitude(block_count) < t.unchecked_count_bound) {
        const int64_t steps = block_count - 1;
        for (std::size_t s = 0; s < n; ++s) out[s] = size[s] + steps * stride[s];
        return true;
    }
    __extension__ typedef __int128 wide;  // |size0| + (2^63 + 1) * 2^63 < 2^127: no intermediate overflow
    const wide steps = static_cast<wide>(block_count) - 1;
    bool ok = true;
    for (std::size_t s = 0; s < n; ++s) {
        const wide value = static_cast<wide>(size[s]) + steps * static_cast<wide>(stride[s]);
        const bool fits = value >= static_cast<wide>(INT64_MIN) && value <= static_cast<wide>(INT64_MAX);
        out[s] = fits ? static_cast<int64_t>(value) : 0;
        ok &= fits;
    }
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
