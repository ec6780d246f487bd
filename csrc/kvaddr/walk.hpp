// The chunk walk (SPEC.md §2.3) and the lookup reduction (SPEC.md §1.4, §3.5). Pure C++.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvaddr/checked.hpp"

namespace kvaddr {

// One chunk the walk yields: tokens [start, end) keyed by hash index `hash_index`.
struct WalkedChunk {
    int64_t chunk_id;
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
template <typename Keep>
inline void walk_chunks(const WalkParams& p, int64_t first, int64_t stop, Keep keep,
                        std::vector<WalkedChunk>* out) {
    for (int64_t chunk_id = first; chunk_id < stop; ++chunk_id) {
        if (!keep(chunk_id)) continue;
        // Python's %: for non-negative chunk ids and a positive step it equals C++'s.
        if (chunk_id % p.put_step != p.put_step_rank) continue;
        const int64_t start = chunk_id * p.block_size;
        const int64_t end = std::min(start + p.block_size, p.token_len);
        out->push_back(WalkedChunk{chunk_id, start, end, end / p.hash_block_size - 1});
    }
}

// A lookup unit is present iff every one of its `width` consecutive exist results is exactly 1.
inline bool unit_present(const int64_t* results, std::size_t width) noexcept {
    for (std::size_t i = 0; i < width; ++i) {
        if (results[i] != 1) return false;
    }
    return true;
}

}  // namespace kvaddr
