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

#include "bindings/client_inputs.hpp"
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

// The pointer inside `capsule` when it is a capsule named `name` (PyCapsule_GetName refuses anything else); null,
// with no error set, otherwise.
void* capsule_pointer(py::handle capsule, const char* name) {
    const char* held_name = PyCapsule_GetName(capsule.ptr());
    if (held_name == nullptr || std::strcmp(held_name, name) != 0) {
        PyErr_Clear();
        return nullptr;
    }
    void* pointer = PyCapsule_GetPointer(capsule.ptr(), name);
    if (pointer == nullptr) PyErr_Clear();
    return pointer;
}

// The client held by `capsule` (store._get_pyclient_capsule()), or null.
std::shared_ptr<mooncake::PyClient>* capsule_client(py::handle capsule) {
    return static_cast<std::shared_ptr<mooncake::PyClient>*>(capsule_pointer(capsule, kCapsuleName));
}

// Keys the calling thread's last guarded call refused (not sent to Mooncake; -600 in their slots).
thread_local uint64_t t_refused = 0;

using namespace client_inputs;  // this file is the one user of its header

// ------------------------------------------------------------------------------------------ the client

class MooncakeClient {
public:
    MooncakeClient(py::capsule capsule, const std::string& library_path, py::object default_config,
                   py::object symbol_overrides, py::object key_blob) {
        if (!key_blob.is_none() && !PyType_Check(key_blob.ptr())) {
            raise(PyExc_TypeError, "key_blob must be a type (or None), not " + type_name(key_blob.ptr()));
        }
        key_blob_ = std::move(key_blob);
        auto* held = capsule_client(capsule);
        if (held == nullptr) raise(PyExc_RuntimeError, std::string("expected a capsule named '") + kCapsuleName + "'");
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
        // pybind11 spellings of this platform's ABI (gcc/libstdc++, Itanium C++ ABI, C++11 strings): pybind11 3.x
        // writes ours, 2.x wrote "_gcc_libstdcpp_cxxabi<__GXX_ABI_VERSION>". They name the same platform ABI;
        // the conduit only hands us a pointer that we pass straight back to Mooncake, never read.
        std::vector<std::string> abi_ids{PYBIND11_PLATFORM_ABI_ID};
        for (int version = 1011; version <= 1020; ++version) abi_ids.push_back("_gcc_libstdcpp_cxxabi" + std::to_string(version));
        for (const std::string& id : abi_ids) {
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
    // with the GIL released, Mooncake's vectors are built, checked, passed, and freed again (call_released).
    // Safe without the GIL: KeySource and Rows keep every object read alive (exported arrays cannot be
    // resized), and nothing in the released scope touches a Python object.
    py::list get_multi(py::handle keys, py::handle addrs, py::handle sizes, bool prefer_same_node, py::handle ranges) {
        t_refused = 0;
        const KeySource source = key_source(keys);
        std::optional<RangeSet> scratch;
        Rows rows(addrs, sizes, source.size(), guard_of(ranges, scratch));
        return call_released(source, "batch_get_into_multi_buffers", [&](void* client, mc::Keys& k, Problem& problem) {
            mc::PtrRows ptrs;
            mc::SizeRows sz;
            rows.materialise(ptrs, sz, problem);
            if (problem.found()) return std::vector<int>();
            return call_kept(rows.keep(), k, ptrs, sz, [&] {
                return fns_.get_multi(client, k, ptrs, sz, prefer_same_node);
            });
        });
    }

    py::list put_multi(py::handle keys, py::handle addrs, py::handle sizes, py::object config, py::handle ranges) {
        t_refused = 0;
        const KeySource source = key_source(keys);
        std::optional<RangeSet> scratch;
        Rows rows(addrs, sizes, source.size(), guard_of(ranges, scratch));
        // `held_config` keeps the ReplicateConfig alive; Mooncake's binding reads it without the GIL too.
        const py::object held_config = config.is_none() ? default_config_ : config;
        const void* cfg = config_pointer(held_config);
        py::object kept_config;  // the kept keys' config when the guard refused some (freed with the GIL held)
        return call_released(source, "batch_put_from_multi_buffers", [&](void* client, mc::Keys& k, Problem& problem) {
            mc::PtrRows ptrs;
            mc::SizeRows sz;
            rows.materialise(ptrs, sz, problem);
            if (problem.found()) return std::vector<int>();
            if (partly_kept(rows.keep())) {
                py::gil_scoped_acquire gil;  // only when the guard refused some keys, not all
                kept_config = config_for_kept(held_config, rows.keep());
                cfg = config_pointer(kept_config);
            }
            return call_kept(rows.keep(), k, ptrs, sz, [&] { return fns_.put_multi(client, k, ptrs, sz, cfg); });
        });
    }

    py::list get_into(py::handle keys, py::handle ptrs, py::handle sizes, py::handle ranges) {
        t_refused = 0;
        const KeySource source = key_source(keys);
        std::optional<RangeSet> scratch;
        std::vector<char> keep(source.size(), 1);
        mc::Ptrs p;
        mc::Sizes s;
        convert_flat(ptrs, sizes, source.size(), p, s, guard_of(ranges, scratch), &keep);
        return call_released(source, "batch_get_into", [&](void* client, mc::Keys& k, Problem&) {
            return call_kept(keep, k, p, s, [&] { return fns_.get_into(client, k, p, s); });
        });
    }

    py::list put_from(py::handle keys, py::handle ptrs, py::handle sizes, py::object config, py::handle ranges) {
        t_refused = 0;
        const KeySource source = key_source(keys);
        std::optional<RangeSet> scratch;
        std::vector<char> keep(source.size(), 1);
        mc::Ptrs p;
        mc::Sizes s;
        convert_flat(ptrs, sizes, source.size(), p, s, guard_of(ranges, scratch), &keep);
        py::object held_config = config.is_none() ? default_config_ : config;
        const void* cfg = config_pointer(held_config);
        if (partly_kept(keep)) {  // the guard refused some keys: the others go on with their own config
            held_config = config_for_kept(held_config, keep);
            cfg = config_pointer(held_config);
        }
        return call_released(source, "batch_put_from", [&](void* client, mc::Keys& k, Problem&) {
            return call_kept(keep, k, p, s, [&] { return fns_.put_from(client, k, p, s, cfg); });
        });
    }

    py::list is_exist(py::handle keys) {
        const KeySource source = key_source(keys);
        return call_released(source, "batchIsExist", [&](void* client, const mc::Keys& k, Problem&) {
            g_calls.fetch_add(1, std::memory_order_relaxed);
            return fns_.is_exist(client, k);
        });
    }

    // True if `capsule` (a fresh store._get_pyclient_capsule()) holds the client this object calls.
    bool same_client(py::handle capsule) const {
        if (capsule.is_none() || !client_) return false;
        auto* held = capsule_client(capsule);
        return held != nullptr && held->get() == client_.get();
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
    // The keys argument as a KeySource: an instance of our own key-blob type (the `key_blob` given at
    // construction, mooncake_kvaddr.driver.native_client.KeyBlob) is its bytes cut at its offsets; anything
    // else is a sequence of keys (offsets None). Decided by type, never by looking for attributes.
    KeySource key_source(py::handle keys) const {
        if (!key_blob_.is_none()) {
            const int is_blob = PyObject_IsInstance(keys.ptr(), key_blob_.ptr());
            if (is_blob < 0) throw py::error_already_set();
            if (is_blob == 1) {
                const py::object data = keys.attr("data");  // the blob: KeySource holds it
                const py::object offsets = keys.attr("offsets");
                return KeySource(data, offsets);
            }
        }
        return KeySource(keys, py::none());
    }

    // The registered-range guard's set (docs/vllm-plugin.md, "Registered-range guard"): null without `ranges`;
    // a _native.MemoryRanges as is, or an (n, 2) int64 array of [start, end) pairs converted into `scratch`.
    static const RangeSet* guard_of(py::handle ranges, std::optional<RangeSet>& scratch) {
        return ranges.is_none() ? nullptr : &ranges_of(ranges, RangeForm::start_end, scratch);
    }

    // True when the guard refused some keys but not all: the call goes on with the others.
    static bool partly_kept(const std::vector<char>& keep) {
        const auto kept = static_cast<std::size_t>(std::count(keep.begin(), keep.end(), 1));
        return kept > 0 && kept < keep.size();
    }

    // The ReplicateConfig of the keys `keep` marks (docs/native-client.md, "Per-key config fields"): the one
    // routine that cuts every split put's config builds it (mooncake_kvaddr.driver.per_key.config_for: a copy
    // whose per-key fields, such as group ids, hold the kept keys' values; `config` itself when none is set),
    // so that a filtered put is not refused by Mooncake for group ids that no longer match its keys. Needs the
    // GIL; its errors are raised.
    static py::object config_for_kept(const py::object& config, const std::vector<char>& keep) {
        py::list picks;
        for (std::size_t i = 0; i < keep.size(); ++i) {
            if (keep[i]) picks.append(i);
        }
        return py::module_::import("mooncake_kvaddr.driver.per_key").attr("config_for")(config, picks, keep.size());
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

    // The shared end of every call: nothing for no key; else, on the live client and with the GIL released
    // (TimedRelease), Mooncake's key vector is built and `fn(client, keys, problem)` (no Python API) returns
    // Mooncake's codes, then a `problem` it found is raised (ValueError) and the codes become a list (to_list
    // names `method`). Declared first, `release` is destroyed last: every vector is freed before the GIL is
    // taken back.
    template <typename Fn>
    py::list call_released(const KeySource& source, const char* method, Fn&& fn) {
        const std::size_t n = source.size();
        if (n == 0) return py::list();
        if (!client_) raise(PyExc_RuntimeError, "this native Mooncake client is closed");
        auto client = client_;  // a copy: close() in another thread cannot free the client under a running call
        Problem problem;
        decltype(fn(client.get(), std::declval<mc::Keys&>(), problem)) codes;
        {
            TimedRelease release;
            mc::Keys k = source.build();
            codes = fn(client.get(), k, problem);
        }
        if (problem.found()) raise(PyExc_ValueError, problem.message);
        return to_list(codes, n, method);
    }

    // Address of the C++ ReplicateConfig inside `config` (exactly a mooncake.store.ReplicateConfig), or null.
    const void* try_config_pointer(py::handle config) const {
        if (reinterpret_cast<PyObject*>(Py_TYPE(config.ptr())) != config_type_.ptr()) return nullptr;
        static const NamedTypeInfo replicate_config_type(kReplicateConfigName);
        py::capsule type_capsule(const_cast<void*>(static_cast<const void*>(&replicate_config_type)),
                                 typeid(std::type_info).name());
        py::object result = config.attr("_pybind11_conduit_v1_")(py::bytes(abi_id_), type_capsule,
                                                                  py::bytes("raw_pointer_ephemeral"));
        return capsule_pointer(result, kReplicateConfigName);
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
    py::object key_blob_ = py::none();
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
        .def(py::init<py::capsule, const std::string&, py::object, py::object, py::object>(), py::arg("capsule"),
             py::arg("library_path"), py::arg("default_config"), py::arg("symbol_overrides") = py::none(),
             py::arg("key_blob") = py::none())
        // The signatures of NativeClient's methods (driver/native_client.py hands these bound methods out).
        .def("batch_get_into_multi_buffers", checked(&MooncakeClient::get_multi), py::arg("keys"), py::arg("addrs"),
             py::arg("sizes"), py::arg("prefer_alloc_in_same_node") = false, py::kw_only(),
             py::arg("ranges") = py::none())
        .def("batch_put_from_multi_buffers", checked(&MooncakeClient::put_multi), py::arg("keys"), py::arg("addrs"),
             py::arg("sizes"), py::arg("config") = py::none(), py::kw_only(), py::arg("ranges") = py::none())
        .def("batch_get_into", checked(&MooncakeClient::get_into), py::arg("keys"), py::arg("ptrs"), py::arg("sizes"),
             py::kw_only(), py::arg("ranges") = py::none())
        .def("batch_put_from", checked(&MooncakeClient::put_from), py::arg("keys"), py::arg("ptrs"), py::arg("sizes"),
             py::arg("config") = py::none(), py::kw_only(), py::arg("ranges") = py::none())
        .def("batch_is_exist", checked(&MooncakeClient::is_exist), py::arg("keys"))
        .def("same_client", checked(&MooncakeClient::same_client), py::arg("capsule"))
        .def("close", checked(&MooncakeClient::close))
        .def_property_readonly("closed", checked(&MooncakeClient::closed))
        .def_property_readonly("library", checked(&MooncakeClient::library))
        .def_property_readonly("slots", checked(&MooncakeClient::slots))
        .def_property_readonly("abi_id", checked(&MooncakeClient::abi_id));
}

}  // namespace kvaddr::py_bindings
