// MooncakeClient: Mooncake's C++ client called directly (docs/native-client.md).
//
// Mooncake's bound methods convert Python lists element by element with the GIL held (~17 ms per 225,800
// regions). Here the keys are copied under the GIL (microseconds), the int64 address/size arrays are only
// *exported* under the GIL, and everything else - copying them into the std::vectors Mooncake takes,
// validating every value, and the call itself - runs with the GIL released. Python lists of rows are accepted
// too (converted once, under the GIL). The object and every method are checked before any call
// (kvaddr/mooncake_client.hpp); inputs are validated so that Mooncake never sees mismatched vectors.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "bindings/register_mooncake_client.hpp"

#include "bindings/common.hpp"
#include "kvaddr/mooncake_client.hpp"
#include "kvaddr/ranges.hpp"

// The type Mooncake's capsule holds a std::shared_ptr to. Only ever used through that shared_ptr (copied and
// destroyed, never dereferenced as a PyClient): the shared_ptr layout does not depend on the pointee.
namespace mooncake {
class PyClient;
}

namespace kvaddr::py_bindings {

namespace {

namespace mc = kvaddr::mooncake_client;

constexpr const char* kCapsuleName = "mooncake.PyClient.shared_ptr";
constexpr const char* kReplicateConfigName = "N8mooncake15ReplicateConfigE";  // typeid(...).name() in store.so

// Calls made into Mooncake by any MooncakeClient (tests check that refused set-ups call nothing).
std::atomic<uint64_t> g_calls{0};

// Nanoseconds the calling thread's last call did not hold the GIL: from the release until it held the GIL
// again, waiting to re-acquire it included (for the benchmark: the rest of the call's wall time is GIL-held
// work).
thread_local uint64_t t_released_ns = 0;

// gil_scoped_release that also records how long the calling thread was without the GIL.
class TimedRelease {
public:
    TimedRelease() : start_(std::chrono::steady_clock::now()) { release_.emplace(); }
    TimedRelease(const TimedRelease&) = delete;
    TimedRelease& operator=(const TimedRelease&) = delete;
    ~TimedRelease() {
        release_.reset();  // re-acquire first, so the wait for the GIL counts as released time
        t_released_ns = static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count());
    }

private:
    std::chrono::steady_clock::time_point start_;
    std::optional<py::gil_scoped_release> release_;
};

// A std::type_info that names mooncake::ReplicateConfig, for pybind11's cross-module "conduit" protocol:
// Mooncake's own pybind11 looks the type up by name and hands back the address of the C++ object inside a
// Python ReplicateConfig. libstdc++ compares type_info by name, and type_info's named constructor is
// protected for exactly this kind of derivation.
class NamedTypeInfo final : public std::type_info {
public:
    explicit NamedTypeInfo(const char* name) : std::type_info(name) {}
};

const NamedTypeInfo& replicate_config_type() {
    static const NamedTypeInfo info(kReplicateConfigName);
    return info;
}

// pybind11 spellings of this platform's ABI (gcc/libstdc++, Itanium C++ ABI, C++11 strings): pybind11 3.x
// writes ours, 2.x wrote "_gcc_libstdcpp_cxxabi<__GXX_ABI_VERSION>". They name the same platform ABI; the
// conduit only hands us a pointer that we pass straight back to Mooncake, never read.
std::vector<std::string> platform_abi_ids() {
    std::vector<std::string> ids{PYBIND11_PLATFORM_ABI_ID};
    for (int version = 1011; version <= 1020; ++version) ids.push_back("_gcc_libstdcpp_cxxabi" + std::to_string(version));
    return ids;
}

// ------------------------------------------------------------------------------------------ input conversion

// One exported Py_buffer, released on every path.
class Export {
public:
    Export() = default;
    Export(const Export&) = delete;
    Export& operator=(const Export&) = delete;
    ~Export() {
        if (held_) PyBuffer_Release(&view_);
    }
    // Export `obj` as C-contiguous with its format; false (error cleared) if it does not support that.
    bool acquire(PyObject* obj) {
        if (PyUnicode_Check(obj) || PyBytes_Check(obj) || !PyObject_CheckBuffer(obj)) return false;
        if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
            PyErr_Clear();
            return false;
        }
        held_ = true;
        return true;
    }
    const Py_buffer& view() const noexcept { return view_; }

private:
    Py_buffer view_{};
    bool held_ = false;
};

// 0 = not a 64-bit integer buffer, 1 = int64, 2 = uint64.
int int64_kind(const Py_buffer& view) {
    if (view.itemsize != 8 || view.format == nullptr) return 0;
    const char* f = view.format;
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (std::strcmp(f, "q") == 0 || std::strcmp(f, "l") == 0) return 1;
    if (std::strcmp(f, "Q") == 0 || std::strcmp(f, "L") == 0) return 2;
    return 0;
}

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

int64_t row_int(py::handle item, const char* what) { return as_int64(item.ptr(), what); }

// Keys the calling thread's last guarded call refused (not sent to Mooncake; -600 in their slots).
thread_local uint64_t t_refused = 0;
constexpr int kInvalidParams = -600;  // Mooncake's INVALID_PARAMS (docs/configuration.md)

// The registered-range guard's table (docs/vllm-plugin.md, "Registered-range guard"): kvaddr/ranges.hpp's range
// set, copied from a (m, 2) int64 array of [start, end) pairs under the GIL and read without it.
RangeSet guard_ranges(py::handle ranges) {
    Export view;
    if (!view.acquire(ranges.ptr()) || view.view().ndim != 2 || int64_kind(view.view()) != 1 ||
        view.view().shape[1] != 2) {
        raise(PyExc_TypeError, "ranges must be a (n, 2) int64 array of [start, end) pairs");
    }
    const auto* data = static_cast<const int64_t*>(view.view().buf);
    const auto m = static_cast<std::size_t>(view.view().shape[0]);
    RangeSet set;
    for (std::size_t i = 0; i < m; ++i) {
        const int64_t start = data[2 * i];
        const int64_t end = data[2 * i + 1];
        if (start <= 0 || end <= start) raise(PyExc_ValueError, "ranges must hold 0 < start < end pairs");
        set.add(start, end - start);
    }
    set.finalize();
    return set;
}

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
    void convert_sequences(py::handle addrs, py::handle sizes) {
        FastSequence arows(addrs.ptr(), "addrs");
        FastSequence srows(sizes.ptr(), "sizes");
        if (static_cast<std::size_t>(arows.size()) != keys_ || static_cast<std::size_t>(srows.size()) != keys_) {
            raise(PyExc_ValueError, "addrs and sizes need one row per key: " + std::to_string(keys_) + " keys, " +
                                        std::to_string(arows.size()) + " address rows, " +
                                        std::to_string(srows.size()) + " size rows");
        }
        ptr_rows_.resize(keys_);
        size_rows_.resize(keys_);
        Problem problem;
        for (std::size_t i = 0; i < keys_; ++i) {
            std::vector<int64_t> a = row(arows.at(static_cast<Py_ssize_t>(i)), "addrs row", "address");
            std::vector<int64_t> s = row(srows.at(static_cast<Py_ssize_t>(i)), "sizes row", "size");
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

    // One row: a 1-D int64 array (copied) or a sequence of ints.
    static std::vector<int64_t> row(py::object obj, const char* what, const char* item) {
        Export view;
        if (view.acquire(obj.ptr())) {
            if (view.view().ndim == 1 && int64_kind(view.view()) == 1) {
                const auto* data = static_cast<const int64_t*>(view.view().buf);
                return std::vector<int64_t>(data, data + view.view().shape[0]);
            }
        }
        if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr())) {
            raise(PyExc_TypeError, std::string(what) + " must be a sequence of ints, not " + type_name(obj.ptr()));
        }
        FastSequence seq(obj.ptr(), what);
        std::vector<int64_t> out(static_cast<std::size_t>(seq.size()));
        for (Py_ssize_t j = 0; j < seq.size(); ++j) out[static_cast<std::size_t>(j)] = row_int(seq.at(j), item);
        return out;
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
        std::vector<uint64_t> values;
        Export view;
        if (view.acquire(obj.ptr()) && view.view().ndim == 1 && int64_kind(view.view()) != 0) {
            const auto* data = static_cast<const uint64_t*>(view.view().buf);
            values.assign(data, data + view.view().shape[0]);
            if (int64_kind(view.view()) == 2) {
                for (uint64_t& v : values) {
                    if (v > static_cast<uint64_t>(INT64_MAX)) {
                        raise(PyExc_OverflowError, std::string(what) + " value does not fit in int64");
                    }
                }
            }
        } else {
            FastSequence seq(obj.ptr(), what);
            values.resize(static_cast<std::size_t>(seq.size()));
            for (Py_ssize_t i = 0; i < seq.size(); ++i) {
                values[static_cast<std::size_t>(i)] = static_cast<uint64_t>(row_int(seq.at(i), what));
            }
        }
        if (values.size() != keys) {
            raise(PyExc_ValueError, std::string(what) + " has " + std::to_string(values.size()) + " entries for " +
                                        std::to_string(keys) + " keys");
        }
        return values;
    };
    const std::vector<uint64_t> p = read(ptrs, "ptrs");
    const std::vector<uint64_t> s = read(sizes, "sizes");
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

// ------------------------------------------------------------------------------------------ the client

class MooncakeClient {
public:
    MooncakeClient(py::capsule capsule, const std::string& library_path, py::object default_config,
                   py::object symbol_overrides) {
        const char* name = PyCapsule_GetName(capsule.ptr());
        if (name == nullptr || std::strcmp(name, kCapsuleName) != 0) {
            PyErr_Clear();
            raise(PyExc_RuntimeError, std::string("expected a capsule named '") + kCapsuleName + "'");
        }
        auto* held = static_cast<std::shared_ptr<mooncake::PyClient>*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
        if (held == nullptr) throw py::error_already_set();
        client_ = *held;  // our own reference: the client lives as long as this object (or close())

        mc::SymbolNames names;
        if (!symbol_overrides.is_none()) {
            for (auto item : py::dict(symbol_overrides)) {
                const std::string key = py::str(item.first);
                const std::string value = py::str(item.second);
                std::string* slot = key == "vtable"                         ? &names.vtable
                                    : key == "typeinfo"                     ? &names.typeinfo
                                    : key == "batch_get_into_multi_buffers" ? &names.get_multi
                                    : key == "batch_put_from_multi_buffers" ? &names.put_multi
                                    : key == "batch_get_into"               ? &names.get_into
                                    : key == "batch_put_from"               ? &names.put_from
                                    : key == "batch_is_exist"               ? &names.is_exist
                                                                            : nullptr;
                if (slot == nullptr) raise(PyExc_ValueError, "unknown symbol override '" + key + "'");
                *slot = value;
            }
        }
        const std::string reason = mc::resolve(client_.get(), library_path, names, fns_);
        if (!reason.empty()) {
            client_.reset();
            raise(PyExc_RuntimeError, reason);
        }
        // The C++ ReplicateConfig behind a Python one, through pybind11's conduit; find the spelling of this
        // platform's ABI id that Mooncake's pybind11 accepts, once, on the default config.
        config_type_ = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(default_config.ptr())));
        for (const std::string& id : platform_abi_ids()) {
            abi_id_ = id;
            if (try_config_pointer(default_config) != nullptr) break;
            abi_id_.clear();
        }
        if (abi_id_.empty()) {
            client_.reset();
            raise(PyExc_RuntimeError, "cannot reach the C++ ReplicateConfig inside a Python mooncake.store."
                                      "ReplicateConfig (pybind11 conduit refused every platform ABI id)");
        }
        default_config_ = std::move(default_config);
    }

    // Each call: keys located, arrays exported (or lists converted) and the config resolved under the GIL; then,
    // with the GIL released, Mooncake's vectors are built, checked, passed, and freed again. Safe without the
    // GIL: KeySource and Rows keep every object read alive (exported arrays cannot be resized), and nothing in
    // the released scope touches a Python object. Declared first, `release` is destroyed last: the vectors
    // are freed before the GIL is taken back.
    py::list get_multi(py::handle keys, py::handle addrs, py::handle sizes, bool prefer_same_node, py::handle offsets,
                       py::handle ranges) {
        t_refused = 0;
        const KeySource source(keys, offsets);
        const std::size_t n = source.size();
        const std::optional<RangeSet> guard = guard_of(ranges);
        Rows rows(addrs, sizes, n, guard ? &*guard : nullptr);
        if (n == 0) return py::list();
        auto client = live();
        Problem problem;
        std::vector<int> codes;
        {
            TimedRelease release;
            mc::Keys k = source.build();
            mc::PtrRows ptrs;
            mc::SizeRows sz;
            rows.materialise(ptrs, sz, problem);
            if (!problem.found()) codes = call_kept(rows.keep(), k, ptrs, sz, [&] {
                return fns_.get_multi(client.get(), k, ptrs, sz, prefer_same_node);
            });
        }
        if (problem.found()) raise(PyExc_ValueError, problem.message);
        return to_list(codes, n, "batch_get_into_multi_buffers");
    }

    py::list put_multi(py::handle keys, py::handle addrs, py::handle sizes, py::object config, py::handle offsets,
                       py::handle ranges) {
        t_refused = 0;
        const KeySource source(keys, offsets);
        const std::size_t n = source.size();
        const std::optional<RangeSet> guard = guard_of(ranges);
        Rows rows(addrs, sizes, n, guard ? &*guard : nullptr);
        // `held_config` keeps the ReplicateConfig alive; Mooncake's binding reads it without the GIL too.
        const py::object held_config = config.is_none() ? default_config_ : config;
        const void* cfg = config_pointer(held_config);
        if (n == 0) return py::list();
        auto client = live();
        Problem problem;
        std::vector<int> codes;
        {
            TimedRelease release;
            mc::Keys k = source.build();
            mc::PtrRows ptrs;
            mc::SizeRows sz;
            rows.materialise(ptrs, sz, problem);
            if (!problem.found()) codes = call_kept(rows.keep(), k, ptrs, sz, [&] {
                return fns_.put_multi(client.get(), k, ptrs, sz, cfg);
            });
        }
        if (problem.found()) raise(PyExc_ValueError, problem.message);
        return to_list(codes, n, "batch_put_from_multi_buffers");
    }

    py::list get_into(py::handle keys, py::handle ptrs, py::handle sizes, py::handle offsets, py::handle ranges) {
        t_refused = 0;
        const KeySource source(keys, offsets);
        const std::size_t n = source.size();
        const std::optional<RangeSet> guard = guard_of(ranges);
        std::vector<char> keep(n, 1);
        mc::Ptrs p;
        mc::Sizes s;
        convert_flat(ptrs, sizes, n, p, s, guard ? &*guard : nullptr, &keep);
        if (n == 0) return py::list();
        auto client = live();
        std::vector<int64_t> codes;
        {
            TimedRelease release;
            mc::Keys k = source.build();
            codes = call_kept(keep, k, p, s, [&] { return fns_.get_into(client.get(), k, p, s); });
        }
        return to_list(codes, n, "batch_get_into");
    }

    py::list put_from(py::handle keys, py::handle ptrs, py::handle sizes, py::object config, py::handle offsets,
                      py::handle ranges) {
        t_refused = 0;
        const KeySource source(keys, offsets);
        const std::size_t n = source.size();
        const std::optional<RangeSet> guard = guard_of(ranges);
        std::vector<char> keep(n, 1);
        mc::Ptrs p;
        mc::Sizes s;
        convert_flat(ptrs, sizes, n, p, s, guard ? &*guard : nullptr, &keep);
        const py::object held_config = config.is_none() ? default_config_ : config;
        const void* cfg = config_pointer(held_config);
        if (n == 0) return py::list();
        auto client = live();
        std::vector<int> codes;
        {
            TimedRelease release;
            mc::Keys k = source.build();
            codes = call_kept(keep, k, p, s, [&] { return fns_.put_from(client.get(), k, p, s, cfg); });
        }
        return to_list(codes, n, "batch_put_from");
    }

    py::list is_exist(py::handle keys, py::handle offsets) {
        const KeySource source(keys, offsets);
        const std::size_t n = source.size();
        if (n == 0) return py::list();
        auto client = live();
        std::vector<int> codes;
        {
            TimedRelease release;
            const mc::Keys k = source.build();
            g_calls.fetch_add(1, std::memory_order_relaxed);
            codes = fns_.is_exist(client.get(), k);
        }
        return to_list(codes, n, "batchIsExist");
    }

    // True if `capsule` (a fresh store._get_pyclient_capsule()) holds the client this object calls.
    bool same_client(py::handle capsule) const {
        if (capsule.is_none() || !client_) return false;
        const char* name = PyCapsule_GetName(capsule.ptr());
        if (name == nullptr || std::strcmp(name, kCapsuleName) != 0) {
            PyErr_Clear();
            return false;
        }
        auto* held = static_cast<std::shared_ptr<mooncake::PyClient>*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
        if (held == nullptr) {
            PyErr_Clear();
            return false;
        }
        return held->get() == client_.get();
    }

    void close() { client_.reset(); }
    bool closed() const noexcept { return !client_; }
    const std::string& library() const noexcept { return fns_.library; }
    py::dict slots() const {
        py::dict out;
        for (const auto& [name, slot] : fns_.slots) out[py::str(name)] = slot;
        return out;
    }
    const std::string& abi_id() const noexcept { return abi_id_; }

private:
    static std::optional<RangeSet> guard_of(py::handle ranges) {
        if (ranges.is_none()) return std::nullopt;
        return guard_ranges(ranges);
    }

    // Mooncake's call `fn` on the kept keys only (no Python API: runs without the GIL). Refused keys are dropped
    // from `k`, `a` and `b` before the call (Mooncake never sees their slices), get -600, and are counted in
    // t_refused; with every key kept this is just `fn()`.
    template <typename A, typename B, typename Fn>
    static auto call_kept(const std::vector<char>& keep, mc::Keys& k, A& a, B& b, Fn&& fn) -> decltype(fn()) {
        const auto kept = static_cast<std::size_t>(std::count(keep.begin(), keep.end(), 1));
        const std::size_t n = keep.size();
        t_refused = n - kept;
        if (kept == n) {
            g_calls.fetch_add(1, std::memory_order_relaxed);
            return fn();
        }
        keep_only(k, keep);
        keep_only(a, keep);
        keep_only(b, keep);
        decltype(fn()) codes;
        if (kept > 0) {
            g_calls.fetch_add(1, std::memory_order_relaxed);
            codes = fn();
        }
        if (codes.size() != kept) return codes;  // to_list reports the mismatch
        return merge_refused(std::move(codes), keep, n);
    }

    std::shared_ptr<mooncake::PyClient> live() const {
        if (!client_) raise(PyExc_RuntimeError, "this native Mooncake client is closed");
        return client_;  // a copy: close() in another thread cannot free the client under a running call
    }

    // Address of the C++ ReplicateConfig inside `config` (exactly a mooncake.store.ReplicateConfig), or null.
    const void* try_config_pointer(py::handle config) const {
        if (reinterpret_cast<PyObject*>(Py_TYPE(config.ptr())) != config_type_.ptr()) return nullptr;
        py::capsule type_capsule(const_cast<void*>(static_cast<const void*>(&replicate_config_type())),
                                 typeid(std::type_info).name());
        py::object result = config.attr("_pybind11_conduit_v1_")(py::bytes(abi_id_), type_capsule,
                                                                  py::bytes("raw_pointer_ephemeral"));
        if (!PyCapsule_CheckExact(result.ptr())) return nullptr;
        const char* name = PyCapsule_GetName(result.ptr());
        if (name == nullptr || std::strcmp(name, kReplicateConfigName) != 0) {
            PyErr_Clear();
            return nullptr;
        }
        void* pointer = PyCapsule_GetPointer(result.ptr(), name);
        if (pointer == nullptr) PyErr_Clear();
        return pointer;
    }

    const void* config_pointer(py::handle config) const {
        const void* pointer = try_config_pointer(config);
        if (pointer == nullptr) {
            raise(PyExc_TypeError, "config must be a mooncake.store.ReplicateConfig (or None for the default), not " +
                                       type_name(config.ptr()));
        }
        return pointer;
    }

    std::shared_ptr<mooncake::PyClient> client_;
    mc::Resolved fns_;
    std::string abi_id_;
    py::object config_type_;
    py::object default_config_;
};

}  // namespace

void register_mooncake_client(py::module_& m) {
    m.def(
        "mooncake_client_platform_reason", [] { return std::string(mc::platform_unsupported_reason()); },
        "Why this build cannot call Mooncake's client natively ('' if it can).");
    m.def(
        "mooncake_client_last_release_ns", [] { return t_released_ns; },
        "Nanoseconds this thread's last native Mooncake call went without the GIL: released until re-acquired "
        "(for benchmarks).");
    m.def(
        "mooncake_client_last_refused", [] { return t_refused; },
        "Keys this thread's last native Mooncake call refused (ranges given: a slice outside them; -600, not sent).");
    m.def(
        "mooncake_client_call_count", [] { return g_calls.load(std::memory_order_relaxed); },
        "Calls made into Mooncake by native clients in this process (for tests).");
    py::class_<MooncakeClient>(m, "MooncakeClient",
                               "Mooncake's RealClient called directly; use mooncake_kvaddr.driver.native_client.")
        .def(py::init<py::capsule, const std::string&, py::object, py::object>(), py::arg("capsule"),
             py::arg("library_path"), py::arg("default_config"), py::arg("symbol_overrides") = py::none())
        .def("batch_get_into_multi_buffers", checked(&MooncakeClient::get_multi), py::arg("keys"), py::arg("addrs"),
             py::arg("sizes"), py::arg("prefer_alloc_in_same_node") = false, py::arg("key_offsets") = py::none(),
             py::arg("ranges") = py::none())
        .def("batch_put_from_multi_buffers", checked(&MooncakeClient::put_multi), py::arg("keys"), py::arg("addrs"),
             py::arg("sizes"), py::arg("config") = py::none(), py::arg("key_offsets") = py::none(),
             py::arg("ranges") = py::none())
        .def("batch_get_into", checked(&MooncakeClient::get_into), py::arg("keys"), py::arg("ptrs"), py::arg("sizes"),
             py::arg("key_offsets") = py::none(), py::arg("ranges") = py::none())
        .def("batch_put_from", checked(&MooncakeClient::put_from), py::arg("keys"), py::arg("ptrs"), py::arg("sizes"),
             py::arg("config") = py::none(), py::arg("key_offsets") = py::none(), py::arg("ranges") = py::none())
        .def("batch_is_exist", checked(&MooncakeClient::is_exist), py::arg("keys"), py::arg("key_offsets") = py::none())
        .def("same_client", checked(&MooncakeClient::same_client), py::arg("capsule"))
        .def("close", checked(&MooncakeClient::close))
        .def_property_readonly("closed", checked(&MooncakeClient::closed))
        .def_property_readonly("library", checked(&MooncakeClient::library))
        .def_property_readonly("slots", checked(&MooncakeClient::slots))
        .def_property_readonly("abi_id", checked(&MooncakeClient::abi_id));
}

}  // namespace kvaddr::py_bindings
