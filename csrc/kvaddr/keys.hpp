// Key bytes (docs/address-rows.md, "Keys"): a pool key is PREFIX + '@' + lowercase hex of the chunk hash. Pure C++.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvaddr {

// Two lowercase hex digits per byte value, so encoding costs one table load per byte.
struct HexTable {
    char pairs[256][2];
    constexpr HexTable() : pairs() {
        constexpr char digits[] = "0123456789abcdef";
        for (int v = 0; v < 256; ++v) {
            pairs[v][0] = digits[v >> 4];
            pairs[v][1] = digits[v & 0x0F];
        }
    }
};
inline constexpr HexTable kHex{};

// Writes 2 * n lowercase hex digits of `bytes` to `out` (as Python's bytes.hex()). `Char` is the code unit
// of the destination string (1, 2 or 4 bytes), so keys can be written straight into any str kind.
template <typename Char>
inline void write_hex(const uint8_t* bytes, std::size_t n, Char* out) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
        const char* pair = kHex.pairs[bytes[i]];
        out[2 * i] = static_cast<Char>(pair[0]);
        out[2 * i + 1] = static_cast<Char>(pair[1]);
    }
}

}  // namespace kvaddr
