// Overflow-checked 64-bit integer helpers with Python's floor semantics.
//
// Every address and size this library hands to Mooncake goes through these: numpy wraps int64 silently, we
// report the overflow instead. Pure C++, no Python headers.
#pragma once

#include <cstdint>

namespace kvaddr {

// a + b, false on signed 64-bit overflow.
inline bool add_checked(int64_t a, int64_t b, int64_t* out) noexcept {
    return !__builtin_add_overflow(a, b, out);
}

// a * b, false on signed 64-bit overflow.
inline bool mul_checked(int64_t a, int64_t b, int64_t* out) noexcept {
    return !__builtin_mul_overflow(a, b, out);
}

// Python's a // b for b > 0 (rounds towards negative infinity, unlike C++ division).
inline int64_t floor_div(int64_t a, int64_t b) noexcept {
    int64_t q = a / b;
    if ((a % b != 0) && (a < 0)) --q;
    return q;
}

// ceil(a / b) for b > 0, exactly Python's (a + b - 1) // b but without the intermediate overflow.
inline int64_t ceil_div(int64_t a, int64_t b) noexcept {
    int64_t q = a / b;
    if ((a % b != 0) && (a > 0)) ++q;
    return q;
}

}  // namespace kvaddr
