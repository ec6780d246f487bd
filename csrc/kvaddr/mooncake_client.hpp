// Calling Mooncake's C++ client (mooncake::RealClient, inside the wheel's store.so) without its headers.
//
// store.so exports the class's vtable and its methods as dynamic symbols with mangled names; a mangled name
// encodes every parameter type, so looking a method up by that name pins its signature. This file:
//   * opens the already loaded store.so (RTLD_NOLOAD: never loads a second copy),
//   * checks that an object is a complete mooncake::RealClient of that very library (its vtable pointer is
//     the exported vtable's address point, offset-to-top 0, RTTI = the exported typeinfo),
//   * resolves each method by mangled name, checks that the symbol really lives in store.so and that it sits
//     in RealClient's vtable (so it is the method Mooncake's own binding dispatches to),
//   * calls it through a function pointer: on x86-64 SysV a member function returning a class by value takes
//     the hidden return slot first, then `this`, then its parameters - exactly a free function
//     `R f(void* self, ...)`. A `const T&` parameter is passed as a pointer.
// Anything that does not match leaves the client unresolved with one reason (docs/native-client.md).
// Pure C++ (POSIX dl*), no Python headers.
#pragma once

#if defined(__linux__)
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1  // dladdr1
#endif
#include <dlfcn.h>
#include <link.h>
#define KVADDR_MOONCAKE_CLIENT_DL 1
#endif

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace kvaddr::mooncake_client {

// Why this build cannot use the path at all ("" = it can). The call convention and the std::vector /
// std::string layouts are only known for x86-64 Linux with libstdc++'s C++11 ABI (store.so's symbols carry
// std::__cxx11, so it was built with that ABI too).
inline const char* platform_unsupported_reason() noexcept {
#if !defined(__x86_64__) || !defined(__linux__)
    return "the native Mooncake client is implemented for x86-64 Linux only";
#elif !defined(__GLIBCXX__) || !defined(_GLIBCXX_USE_CXX11_ABI) || _GLIBCXX_USE_CXX11_ABI != 1
    return "the native Mooncake client needs libstdc++ with the C++11 ABI (as store.so uses)";
#else
    return "";
#endif
}

using Keys = std::vector<std::string>;
using PtrRows = std::vector<std::vector<void*>>;
using SizeRows = std::vector<std::vector<std::size_t>>;
using Ptrs = std::vector<void*>;
using Sizes = std::vector<std::size_t>;

// The methods used, as the free-function types they are called through (see the header comment). The return
// types are those of Mooncake's PyClient interface; they are not part of a mangled name, so every call also
// checks that the result has exactly one element per key.
using GetMultiFn = std::vector<int> (*)(void* self, const Keys&, const PtrRows&, const SizeRows&, bool);
using PutMultiFn = std::vector<int> (*)(void* self, const Keys&, const PtrRows&, const SizeRows&, const void* config);
using GetIntoFn = std::vector<int64_t> (*)(void* self, const Keys&, const Ptrs&, const Sizes&);
using PutFromFn = std::vector<int> (*)(void* self, const Keys&, const Ptrs&, const Sizes&, const void* config);
using IsExistFn = std::vector<int> (*)(void* self, const Keys&);

// The names looked up (mangled; c++filt shows the full signature). Overridable for tests only.
struct SymbolNames {
    std::string vtable = "_ZTVN8mooncake10RealClientE";
    std::string typeinfo = "_ZTIN8mooncake10RealClientE";
    // RealClient::batch_get_into_multi_buffers(vector<string> const&, vector<vector<void*>> const&,
    //                                          vector<vector<unsigned long>> const&, bool)
    std::string get_multi =
        "_ZN8mooncake10RealClient28batch_get_into_multi_buffersERKSt6vectorINSt7__cxx1112basic_stringIcSt11char_"
        "traitsIcESaIcEEESaIS7_EERKS1_IS1_IPvSaISC_EESaISE_EERKS1_IS1_ImSaImEESaISK_EEb";
    // RealClient::batch_put_from_multi_buffers(vector<string> const&, vector<vector<void*>> const&,
    //                                          vector<vector<unsigned long>> const&, ReplicateConfig const&)
    std::string put_multi =
        "_ZN8mooncake10RealClient28batch_put_from_multi_buffersERKSt6vectorINSt7__cxx1112basic_stringIcSt11char_"
        "traitsIcESaIcEEESaIS7_EERKS1_IS1_IPvSaISC_EESaISE_EERKS1_IS1_ImSaImEESaISK_EERKNS_15ReplicateConfigE";
    // RealClient::batch_get_into(vector<string> const&, vector<void*> const&, vector<unsigned long> const&)
    std::string get_into =
        "_ZN8mooncake10RealClient14batch_get_intoERKSt6vectorINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES"
        "aIS7_EERKS1_IPvSaISC_EERKS1_ImSaImEE";
    // RealClient::batch_put_from(vector<string> const&, vector<void*> const&, vector<unsigned long> const&,
    //                            ReplicateConfig const&)
    std::string put_from =
        "_ZN8mooncake10RealClient14batch_put_fromERKSt6vectorINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES"
        "aIS7_EERKS1_IPvSaISC_EERKS1_ImSaImEERKNS_15ReplicateConfigE";
    // RealClient::batchIsExist(vector<string> const&)
    std::string is_exist =
        "_ZN8mooncake10RealClient12batchIsExistERKSt6vectorINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES"
        "aIS7_EE";
};

// The resolved entry points and where they were found (for diagnostics: slot numbers are reported, never used).
struct Resolved {
    GetMultiFn get_multi = nullptr;
    PutMultiFn put_multi = nullptr;
    GetIntoFn get_into = nullptr;
    PutFromFn put_from = nullptr;
    IsExistFn is_exist = nullptr;
    std::string library;                 // path of store.so as the dynamic loader knows it
    std::map<std::string, long> slots;   // method -> index in RealClient's vtable
};

#if defined(KVADDR_MOONCAKE_CLIENT_DL)
namespace detail {

// Owns one dlopen reference. RTLD_NOLOAD: a handle only if the library is already in the process.
class Library {
public:
    explicit Library(const std::string& path) : handle_(dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD)) {}
    Library(const Library&) = delete;
    Library& operator=(const Library&) = delete;
    ~Library() {
        if (handle_ != nullptr) dlclose(handle_);
    }
    void* get() const noexcept { return handle_; }
    // Keep the reference for good: the resolved function pointers must outlive any client using them.
    void keep() noexcept { handle_ = nullptr; }

private:
    void* handle_;
};

inline std::string hex(const void* p) {
    char buffer[2 + 2 * sizeof(void*) + 1];
    std::snprintf(buffer, sizeof buffer, "0x%zx", reinterpret_cast<std::size_t>(p));
    return buffer;
}

}  // namespace detail

// Resolve everything for the object `self` (the RealClient pointer a MooncakeDistributedStore holds), looked
// up in the already loaded library `library_path`. Returns "" and fills `out`, or the reason it refused. No
// function of the library is called here: only the dynamic loader is asked and memory it maps is read.
inline std::string resolve(const void* self, const std::string& library_path, const SymbolNames& names,
                           Resolved& out) {
    const char* platform = platform_unsupported_reason();
    if (*platform != '\0') return platform;
    if (self == nullptr) return "the store has no client object (not set up, or closed)";

    detail::Library library(library_path);
    if (library.get() == nullptr) return "Mooncake's store library is not loaded in this process: " + library_path;

    // The library's own load base: every symbol used must come from it, not from one of its dependencies.
    Dl_info vt_info{};
    const ElfW(Sym)* vt_sym = nullptr;
    dlerror();
    void* vtable = dlsym(library.get(), names.vtable.c_str());
    if (vtable == nullptr) return "symbol " + names.vtable + " (vtable for mooncake::RealClient) not found in " + library_path;
    if (dladdr1(vtable, &vt_info, reinterpret_cast<void**>(const_cast<ElfW(Sym)**>(&vt_sym)), RTLD_DL_SYMENT) == 0 || vt_sym == nullptr ||
        vt_info.dli_sname == nullptr || names.vtable != vt_info.dli_sname) {
        return "the dynamic loader does not map " + names.vtable + " back to its own name";
    }
    const void* base = vt_info.dli_fbase;
    out.library = vt_info.dli_fname != nullptr ? vt_info.dli_fname : library_path;

    // The object: its vtable pointer must be RealClient's address point (2 words into the vtable: offset-to-top,
    // then RTTI), i.e. its dynamic type is exactly mooncake::RealClient of this library.
    const auto* const* words = static_cast<const void* const*>(vtable);
    const void* vptr = *static_cast<const void* const*>(self);
    if (vptr != static_cast<const void*>(words + 2)) {
        Dl_info obj_info{};
        std::string where = "an unknown address";
        if (dladdr(vptr, &obj_info) != 0 && obj_info.dli_sname != nullptr) where = obj_info.dli_sname;
        return "the store's client object is not a mooncake::RealClient of " + out.library + " (its vtable pointer " +
               detail::hex(vptr) + " is " + where + ", expected " + detail::hex(words + 2) + ")";
    }
    if (words[0] != nullptr) return "RealClient's vtable has a non-zero offset-to-top: unexpected class layout";
    void* typeinfo = dlsym(library.get(), names.typeinfo.c_str());
    if (typeinfo == nullptr || words[1] != typeinfo) {
        return "RealClient's vtable does not point at the exported typeinfo " + names.typeinfo;
    }
    const std::size_t vtable_words = static_cast<std::size_t>(vt_sym->st_size) / sizeof(void*);
    if (vtable_words < 3) return "the size of RealClient's vtable symbol is unknown";

    // Each method: by mangled name, from this library, and present in the vtable (the slot it occupies is
    // only reported, never assumed).
    auto find = [&](const std::string& label, const std::string& name, void** fn) -> std::string {
        void* address = dlsym(library.get(), name.c_str());
        if (address == nullptr) return "symbol " + name + " (RealClient::" + label + ") not found in " + out.library;
        Dl_info info{};
        if (dladdr(address, &info) == 0 || info.dli_fbase != base || info.dli_sname == nullptr ||
            name != info.dli_sname) {
            return "symbol " + name + " resolves outside " + out.library;
        }
        for (std::size_t i = 2; i < vtable_words; ++i) {
            if (words[i] == address) {
                out.slots[label] = static_cast<long>(i - 2);
                *fn = address;
                return "";
            }
        }
        return "RealClient::" + label + " (" + name + ") is not a virtual method of RealClient in " + out.library;
    };
    void* fns[5] = {};
    for (const auto& [label, name, slot] :
         {std::tuple<const char*, const std::string*, void**>{"batch_get_into_multi_buffers", &names.get_multi, &fns[0]},
          {"batch_put_from_multi_buffers", &names.put_multi, &fns[1]},
          {"batch_get_into", &names.get_into, &fns[2]},
          {"batch_put_from", &names.put_from, &fns[3]},
          {"batchIsExist", &names.is_exist, &fns[4]}}) {
        std::string reason = find(label, *name, slot);
        if (!reason.empty()) return reason;
    }
    // POSIX guarantees a dlsym result converts to a function pointer.
    out.get_multi = reinterpret_cast<GetMultiFn>(fns[0]);
    out.put_multi = reinterpret_cast<PutMultiFn>(fns[1]);
    out.get_into = reinterpret_cast<GetIntoFn>(fns[2]);
    out.put_from = reinterpret_cast<PutFromFn>(fns[3]);
    out.is_exist = reinterpret_cast<IsExistFn>(fns[4]);
    library.keep();
    return "";
}

#else
inline std::string resolve(const void*, const std::string&, const SymbolNames&, Resolved&) {
    return platform_unsupported_reason();
}
#endif

}  // namespace kvaddr::mooncake_client
