// Input conversion of the native Mooncake client (register_mooncake_client.cpp, docs/native-client.md): keys,
// address/size rows (int64/uint64 arrays, or rows read by int_rows.hpp) and flat pointer/size lists into the
// vectors Mooncake takes, every slice checked (sign, overflow, the registered-range guard of range_inputs.hpp)
// before Mooncake sees it. Included by that one file only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/common.hpp"
#include "bindings/int_rows.hpp"
#include "bindings/range_inputs.hpp"
#include "kvaddr/mooncake_client.hpp"
#include "kvaddr/ranges.hpp"

namespace kvaddr::py_bindings::client_inputs {

namespace mc = kvaddr::mooncake_client;

// The keys of a call. Under the GIL only their bytes are located (str -> its cached UTF-8, bytes as is, or a
// flat blob cut at int64 offsets - n + 1 of them) and every key object is kept alive; the std::strings
// Mooncake takes are built later by build(), which uses no Python API and so runs without the GIL.
class KeySource {
public:
    KeySource(py::handle keys, py::handle offsets) {
        if (!offsets.is_none()) {
            cut_blob(keys, offsets);
            return;
        }
        if (PyUnicode_Check(keys.ptr()) || PyBytes_Check(keys.ptr())) {
            raise(PyExc_TypeError, "keys must be a sequence of str or bytes, not a single " + type_name(keys.ptr()));
        }
        FastSequence seq(keys.ptr(), "keys");
        const auto n = static_cast<std::size_t>(seq.size());
        refs_.reserve(n);
        views_.reserve(n);
        for (Py_ssize_t i = 0; i < seq.size(); ++i) {
            py::object item = seq.at(i);
            if (PyUnicode_Check(item.ptr())) {
                Py_ssize_t size = 0;
                // Valid as long as the str lives: it is cached inside the (immutable) str object.
                const char* utf8 = PyUnicode_AsUTF8AndSize(item.ptr(), &size);
                if (utf8 == nullptr) throw py::error_already_set();
                views_.emplace_back(utf8, static_cast<std::size_t>(size));
            } else if (PyBytes_Check(item.ptr())) {
                views_.emplace_back(PyBytes_AS_STRING(item.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(item.ptr())));
            } else {
                raise(PyExc_TypeError,
                      "keys[" + std::to_string(i) + "] must be str or bytes, not " + type_name(item.ptr()));
            }
            refs_.push_back(std::move(item));
        }
    }

    std::size_t size() const noexcept { return views_.size(); }

    // Mooncake's key vector. Needs no GIL: it only reads memory this object keeps alive.
    mc::Keys build() const {
        mc::Keys out;
        out.reserve(views_.size());
        for (const auto& [data, size] : views_) out.emplace_back(data, size);
        return out;
    }

private:
    void cut_blob(py::handle keys, py::handle offsets) {
        const char* data = nullptr;
        Py_ssize_t length = 0;
        if (PyBytes_Check(keys.ptr())) {
            data = PyBytes_AS_STRING(keys.ptr());
            length = PyBytes_GET_SIZE(keys.ptr());
        } else if (blob_.acquire(keys.ptr())) {  // exported: cannot be resized or freed until released
            data = static_cast<const char*>(blob_.view().buf);
            length = blob_.view().len;
        } else {
            raise(PyExc_TypeError, "with key_offsets, keys must be one bytes-like blob, not " + type_name(keys.ptr()));
        }
        refs_.push_back(py::reinterpret_borrow<py::object>(keys));
        Export cuts;
        if (!cuts.acquire(offsets.ptr()) || cuts.view().ndim != 1 || int64_kind(cuts.view()) != 1) {
            raise(PyExc_TypeError, "key_offsets must be a 1-D int64 array");
        }
        const auto* cut = static_cast<const int64_t*>(cuts.view().buf);
        const Py_ssize_t count = cuts.view().shape[0];
        if (count < 1) raise(PyExc_ValueError, "key_offsets needs n + 1 entries (at least [0])");
        if (cut[0] != 0) raise(PyExc_ValueError, "key_offsets[0] must be 0");
        views_.reserve(static_cast<std::size_t>(count - 1));
        for (Py_ssize_t i = 1; i < count; ++i) {
            if (cut[i] < cut[i - 1] || cut[i] > length) {
                raise(PyExc_ValueError, "key_offsets must be non-decreasing and within the blob (entry " +
                                            std::to_string(i) + ")");
            }
            views_.emplace_back(data + cut[i - 1], static_cast<std::size_t>(cut[i] - cut[i - 1]));
        }
        if (cut[count - 1] != length) raise(PyExc_ValueError, "key_offsets[-1] must equal the blob's length");
    }

    std::vector<py::object> refs_;                                // key objects (or the blob), kept alive
    std::vector<std::pair<const char*, std::size_t>> views_;      // each key's bytes inside them
    Export blob_;                                                 // a non-bytes blob, exported
};

// A value range problem found while copying (possibly without the GIL); raised as ValueError afterwards.
struct Problem {
    std::string message;
    bool found() const noexcept { return !message.empty(); }
};

// Address/size of one region, raw bits read as the caller's integer type said: kvaddr/ranges.hpp's rule (a
// null address would crash Mooncake's copy; negative as signed and >= 2**63 as unsigned are refused alike).
inline bool check_region(uint64_t address, uint64_t size, bool address_signed, bool size_signed, Problem& problem,
                         const char* where, std::size_t row, std::size_t col) {
    const SliceFault fault = slice_fault(address, size, address_signed, size_signed);
    if (fault == SliceFault::none) return true;
    problem.message = std::string(describe(fault)) + " in " + where + " [" + std::to_string(row) + "][" +
                      std::to_string(col) + "]";
    return false;
}

// Sum of one key's sizes must fit in int64 (Mooncake adds them up as size_t).
inline bool add_size(uint64_t& total, uint64_t size, Problem& problem, std::size_t row) {
    if (__builtin_add_overflow(total, size, &total) || total > static_cast<uint64_t>(INT64_MAX)) {
        problem.message = "the sizes of key " + std::to_string(row) + " add up to more than 2**63 - 1";
        return false;
    }
    return true;
}

constexpr int kInvalidParams = -600;  // Mooncake's INVALID_PARAMS (docs/configuration.md)

// The refused keys' slots filled in and the rest of Mooncake's answer put back in order: `codes` holds one
// result per key of `keep` (the keys sent), `n` keys in all.
template <typename T>
std::vector<T> merge_refused(std::vector<T> codes, const std::vector<char>& keep, std::size_t n) {
    if (codes.size() != static_cast<std::size_t>(std::count(keep.begin(), keep.end(), 1))) return codes;  // to_list raises
    std::vector<T> out(n, static_cast<T>(kInvalidParams));
    std::size_t next = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (keep[i]) out[i] = codes[next++];
    }
    return out;
}

// Drop the entries of `v` whose key is not kept (moves; no Python API).
template <typename V>
void keep_only(V& v, const std::vector<char>& keep) {
    std::size_t next = 0;
    for (std::size_t i = 0; i < keep.size() && i < v.size(); ++i) {
        if (keep[i]) {
            if (next != i) v[next] = std::move(v[i]);
            ++next;
        }
    }
    v.resize(next);
}

// The address and size rows of a multi-buffer call. Two 2-D int64/uint64 C-contiguous arrays of one shape
// are only exported here (copied later, GIL released); anything else is a sequence of rows (each a 1-D
// int64 array or a sequence of ints), converted now, under the GIL.
class Rows {
public:
    // `ranges` (may be null): the registered-range guard; a key with a slice outside it (or any other bad value
    // of an int slice: negative, zero address, wrapping, a row whose address and size counts differ) is then
    // marked refused instead of failing the call.
    Rows(py::handle addrs, py::handle sizes, std::size_t keys, const RangeSet* ranges = nullptr)
        : keys_(keys), ranges_(ranges), keep_(keys, 1) {
        for (const auto& [obj, what] : {std::pair<py::handle, const char*>{addrs, "addrs"}, {sizes, "sizes"}}) {
            if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr())) {
                raise(PyExc_TypeError, std::string(what) + " must be a 2-D int64 array or a sequence of rows, not " +
                                           type_name(obj.ptr()));
            }
        }
        if (addrs_.acquire(addrs.ptr()) && sizes_.acquire(sizes.ptr()) && addrs_.view().ndim == 2 &&
            sizes_.view().ndim == 2 && int64_kind(addrs_.view()) != 0 && int64_kind(sizes_.view()) != 0) {
            const auto& a = addrs_.view();
            const auto& s = sizes_.view();
            if (a.shape[0] != s.shape[0] || a.shape[1] != s.shape[1]) {
                raise(PyExc_ValueError, "addrs and sizes must have the same shape, got (" + std::to_string(a.shape[0]) +
                                            ", " + std::to_string(a.shape[1]) + ") and (" + std::to_string(s.shape[0]) +
                                            ", " + std::to_string(s.shape[1]) + ")");
            }
            if (static_cast<std::size_t>(a.shape[0]) != keys) {
                raise(PyExc_ValueError, "addrs has " + std::to_string(a.shape[0]) + " rows for " + std::to_string(keys) +
                                            " keys");
            }
            matrix_ = true;
            return;
        }
        convert_sequences(addrs, sizes);
    }

    // Which keys may go to Mooncake (all, without a guard), final after materialise().
    const std::vector<char>& keep() const noexcept { return keep_; }

    // Build Mooncake's vectors (from the exported arrays: safe without the GIL, no Python API is used).
    void materialise(mc::PtrRows& ptrs, mc::SizeRows& sizes, Problem& problem) {
        if (!matrix_) {
            ptrs = std::move(ptr_rows_);
            sizes = std::move(size_rows_);
            if (ranges_ != nullptr) {
                for (std::size_t i = 0; i < keys_ && i < ptrs.size(); ++i) {
                    if (!keep_[i]) continue;
                    for (std::size_t j = 0; j < ptrs[i].size(); ++j) {
                        if (!ranges_->inside(reinterpret_cast<uintptr_t>(ptrs[i][j]), sizes[i][j], false, false)) {
                            keep_[i] = 0;
                            break;
                        }
                    }
                }
            }
            return;
        }
        const auto& a = addrs_.view();
        const auto& s = sizes_.view();
        const bool a_signed = int64_kind(a) == 1;
        const bool s_signed = int64_kind(s) == 1;
        const auto cols = static_cast<std::size_t>(a.shape[1]);
        const auto* av = static_cast<const uint64_t*>(a.buf);
        const auto* sv = static_cast<const uint64_t*>(s.buf);
        ptrs.resize(keys_);
        sizes.resize(keys_);
        for (std::size_t i = 0; i < keys_; ++i) {
            auto& prow = ptrs[i];
            auto& srow = sizes[i];
            prow.resize(cols);
            srow.resize(cols);
            uint64_t total = 0;
            for (std::size_t j = 0; j < cols; ++j) {
                const uint64_t address = av[i * cols + j];
                const uint64_t size = sv[i * cols + j];
                if (ranges_ != nullptr) {
                    Problem ignored;
                    if (!ranges_->inside(address, size, a_signed, s_signed) || !add_size(total, size, ignored, i)) {
                        keep_[i] = 0;  // refused: its rows are never read by Mooncake (dropped before the call)
                        break;
                    }
                } else if (!check_region(address, size, a_signed, s_signed, problem, "addrs/sizes", i, j) ||
                           !add_size(total, size, problem, i)) {
                    return;
                }
                prow[j] = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
                srow[j] = static_cast<std::size_t>(size);
            }
        }
    }

private:
    // Rows of ints through int_rows.hpp (every row fixed before any item is read), then checked per key.
    void convert_sequences(py::handle addrs, py::handle sizes) {
        IntRows arows(addrs, "addrs");
        IntRows srows(sizes, "sizes");
        if (arows.size() != keys_ || srows.size() != keys_) {
            raise(PyExc_ValueError, "addrs and sizes need one row per key: " + std::to_string(keys_) + " keys, " +
                                        std::to_string(arows.size()) + " address rows, " +
                                        std::to_string(srows.size()) + " size rows");
        }
        for (std::size_t i = 0; i < keys_; ++i) {
            arows.snapshot(i);
            srows.snapshot(i);
        }
        ptr_rows_.resize(keys_);
        size_rows_.resize(keys_);
        Problem problem;
        for (std::size_t i = 0; i < keys_; ++i) {
            const std::vector<int64_t> a = arows.values(i, "address");
            const std::vector<int64_t> s = srows.values(i, "size");
            if (a.size() != s.size()) {
                if (ranges_ != nullptr) {
                    keep_[i] = 0;
                    continue;
                }
                raise(PyExc_ValueError, "key " + std::to_string(i) + " has " + std::to_string(a.size()) +
                                            " addresses but " + std::to_string(s.size()) + " sizes");
            }
            auto& prow = ptr_rows_[i];
            auto& srow = size_rows_[i];
            prow.resize(a.size());
            srow.resize(a.size());
            uint64_t total = 0;
            for (std::size_t j = 0; j < a.size(); ++j) {
                const auto address = static_cast<uint64_t>(a[j]);
                const auto size = static_cast<uint64_t>(s[j]);
                if (!check_region(address, size, true, true, problem, "addrs/sizes", i, j) ||
                    !add_size(total, size, problem, i)) {
                    if (ranges_ == nullptr) raise(PyExc_ValueError, problem.message);
                    keep_[i] = 0;
                    problem.message.clear();
                    prow.clear();
                    srow.clear();
                    break;
                }
                prow[j] = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
                srow[j] = static_cast<std::size_t>(size);
            }
        }
    }

    std::size_t keys_;
    const RangeSet* ranges_;
    std::vector<char> keep_;
    Export addrs_;
    Export sizes_;
    bool matrix_ = false;
    mc::PtrRows ptr_rows_;
    mc::SizeRows size_rows_;
};

// One pointer and one size per key (the staged / contiguous calls): 1-D int64 arrays or sequences of ints.
// `ranges`/`keep` (the guard, may be null): a key whose slice is outside is marked refused instead of failing.
void convert_flat(py::handle ptrs, py::handle sizes, std::size_t keys, mc::Ptrs& out_ptrs, mc::Sizes& out_sizes,
                  const RangeSet* ranges = nullptr, std::vector<char>* keep = nullptr) {
    auto read = [keys](py::handle obj, const char* what) {
        std::vector<int64_t> values;
        Export view;
        if (view.acquire(obj.ptr()) && view.view().ndim == 1 && int64_kind(view.view()) != 0) {
            const auto* data = static_cast<const int64_t*>(view.view().buf);
            values.assign(data, data + view.view().shape[0]);
            // A uint64 above INT64_MAX reads as a negative int64.
            if (int64_kind(view.view()) == 2 &&
                std::any_of(values.begin(), values.end(), [](int64_t v) { return v < 0; })) {
                raise(PyExc_OverflowError, std::string(what) + " value does not fit in int64");
            }
        } else {
            // The length is read once (append_int64s): an item's __index__ that grows the list is not followed
            // (the rows stay the size they were made), one that shrinks it makes seq.at raise.
            append_int64s(FastSequence(obj.ptr(), what), what, &values);
        }
        if (values.size() != keys) {
            raise(PyExc_ValueError, std::string(what) + " has " + std::to_string(values.size()) + " entries for " +
                                        std::to_string(keys) + " keys");
        }
        return values;
    };
    const std::vector<int64_t> p = read(ptrs, "ptrs");
    const std::vector<int64_t> s = read(sizes, "sizes");
    out_ptrs.resize(keys);
    out_sizes.resize(keys);
    Problem problem;
    for (std::size_t i = 0; i < keys; ++i) {
        if (ranges != nullptr && keep != nullptr) {
            if (!ranges->inside(p[i], s[i], true, true)) (*keep)[i] = 0;
        } else if (!check_region(p[i], s[i], true, true, problem, "ptrs/sizes", i, 0)) {
            raise(PyExc_ValueError, problem.message);
        }
        out_ptrs[i] = reinterpret_cast<void*>(static_cast<uintptr_t>(p[i]));
        out_sizes[i] = static_cast<std::size_t>(s[i]);
    }
}

// Mooncake's per-key results as a list of ints; a result of another length means the return type is not what
// the call assumed, which must never pass silently.
template <typename T>
py::list to_list(const std::vector<T>& codes, std::size_t keys, const char* method) {
    if (codes.size() != keys) {
        raise(PyExc_RuntimeError, std::string("Mooncake's ") + method + " returned " + std::to_string(codes.size()) +
                                      " results for " + std::to_string(keys) +
                                      " keys: the native client does not match this Mooncake build; set "
                                      "MOONCAKE_KVADDR_NATIVE_CLIENT=0");
    }
    py::list out(codes.size());
    for (std::size_t i = 0; i < codes.size(); ++i) {
        PyObject* value = PyLong_FromLongLong(static_cast<long long>(codes[i]));
        if (value == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), value);
    }
    return out;
}

}  // namespace kvaddr::py_bindings::client_inputs
