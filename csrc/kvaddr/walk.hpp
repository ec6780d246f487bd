// The chunk walk (docs/address-rows.md) and the lookup reduction (docs/address-rows.md, "Lookup"). Pure C++.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvaddr/checked.hpp"

namespace kvaddr {

// One chunk the walk yields: tokens [start, end) keyed by hash index `hash_index`.
struct WalkedChunk {
    int64_t start;
    int64_t end;
    int64_t hash_index;
};

struct WalkParams {
    int64_t token_len = 0;
    int64_t block_size = 1;
    int64_t hash_block_size = 1;
    int64_t mask_num = 0;
    int64_t put_step = 1;
    int64_t put_step_rank = 0;
};

// Chunk ids [first, stop) of a walk, before masks and striding: first = max(0, mask_num // block_size)
// (floor, as the canonical fork), stop = ceil(token_len / block_size). The caller checks the asserts.
inline int64_t walk_first_chunk(const WalkParams& p) noexcept {
    return std::max<int64_t>(0, floor_div(p.mask_num, p.block_size));
}
inline int64_t walk_stop_chunk(const WalkParams& p) noexcept { return ceil_div(p.token_len, p.block_size); }

// Appends the chunks of [first, stop) that `keep(chunk_id)` accepts and that fall on this rank's stripe.
// Positions use checked arithmetic and every hash index must fall in [0, n_hashes): false (the walk is
// abandoned) when one does not, so a wrapped position can never name a hash outside the caller's hashes.
template <typename Keep>
inline bool walk_chunks(const WalkParams& p, int64_t first, int64_t stop, int64_t n_hashes, Keep keep,
                        std::vector<WalkedChunk>* out) {
    for (int64_t chunk_id = first; chunk_id < stop; ++chunk_id) {
        if (!keep(chunk_id)) continue;
        // Python's %: for non-negative chunk ids and a positive step it equals C++'s.
        if (chunk_id % p.put_step != p.put_step_rank) continue;
        int64_t start = 0;
        if (!mul_checked(chunk_id, p.block_size, &start) || start < 0 || start >= p.token_len) return false;
        // end = min(start + block_size, token_len) without computing an overflowing start + block_size.
        const int64_t end = (p.token_len - start <= p.block_size) ? p.token_len : start + p.block_size;
        const int64_t hash_index = end / p.hash_block_size - 1;
        if (hash_index < 0 || hash_index >= n_hashes) return false;
        out->push_back(WalkedChunk{start, end, hash_index});
    }
    return true;
}

// A lookup unit is present iff every one of its `width` consecutive exist results is exactly 1.
inline bool unit_present(const int64_t* results, std::size_t width) noexcept {
    for (std::size_t i = 0; i < width; ++i) {
        if (results[i] != 1) return false;
    }
    return true;
}

}  // namespace kvaddr
