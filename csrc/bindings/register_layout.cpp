// LayoutEngine: vLLM 0.32+'s store layouts' face over the one address engine (engine.hpp; docs/vllm.md).
// It converts vLLM's arguments (chunks, block ids, shard ids, the fused load plan's walk) to C++ values in
// vLLM's error order, before any Python object is created (docs/vllm.md, "Rules"), and hands validated key
// plans to the engine, whose rows never alias each other or its cache.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings/common.hpp"
#include "bindings/engine.hpp"
#include "bindings/inputs.hpp"
#include "bindings/keys.hpp"
#include "kvaddr/layout.hpp"

namespace kvaddr::py_bindings {

namespace {

using layout::Segments;

// The engine's shard count after the face's checks (its constructor runs before LayoutEngine's body).
std::size_t checked_shards(int64_t block_size, int64_t hash_block_size, bool tp_shared, int64_t first_shard,
                           int64_t n_shards) {
    if (block_size <= 0 || hash_block_size <= 0) {
        throw py::value_error("block_size and hash_block_size must be positive");
    }
    if (n_shards < 0 || (!tp_shared && (n_shards != 1 || first_shard != 0))) {
        throw py::value_error("a rank-local layout has the one shard 0; a TP-shared one n_shards >= 0");
    }
    int64_t end_shard = 0;  // shard ids first_shard + k (k < n_shards) must be int64s: no wrap in plan_load
    if (first_shard < 0 || !add_checked(first_shard, n_shards, &end_shard)) {
        throw py::value_error("first_shard must be >= 0 and first_shard + n_shards must fit in int64");
    }
    return static_cast<std::size_t>(n_shards);
}

class LayoutEngine {
public:
    LayoutEngine(int64_t block_size, int64_t hash_block_size, bool tp_shared, int64_t first_shard,
                 int64_t n_shards, std::size_t cache_bytes)
        : block_size_(block_size),
          hash_block_size_(hash_block_size),
          tp_shared_(tp_shared),
          first_shard_(first_shard),
          engine_(tp_shared, checked_shards(block_size, hash_block_size, tp_shared, first_shard, n_shards), cache_bytes,
                  {false, "key"}) {}
    RowEngine& engine() noexcept { return engine_; }

    // Rank-local: the caller's region lists, re-read (and compared) on every call, as vLLM reads them.
    void set_region_sources(py::object base, py::object block_len) {
        require_rank_local("set_region_sources");
        engine_.set_region_sources(std::move(base), std::move(block_len));
    }

    // TP-shared: one (bases, strides, sizes) triple per local shard, all of one width.
    void set_templates(py::handle templates) {
        if (!tp_shared_) raise(PyExc_RuntimeError, "set_templates is for TP-shared layouts");
        FastSequence seq(templates.ptr(), "templates");
        auto fresh = std::make_shared<Templates>();
        if (static_cast<std::size_t>(seq.size()) != engine_.shards()) {
            raise(PyExc_ValueError, "expected " + std::to_string(engine_.shards()) + " shard templates, got " +
                                        std::to_string(seq.size()));
        }
        const Py_ssize_t n_templates = seq.size();
        for (Py_ssize_t k = 0; k < n_templates; ++k) {
            py::object triple = seq.at(k);
            FastSequence parts(triple.ptr(), "template");
            if (parts.size() != 3) raise(PyExc_ValueError, "a template is (bases, strides, sizes)");
            Segments t;
            t.base = int64_values(parts.at(0), "template base");
            t.stride = int64_values(parts.at(1), "template stride");
            t.size = int64_values(parts.at(2), "template size");
            if (t.base.size() != t.stride.size() || t.base.size() != t.size.size()) {
                raise(PyExc_ValueError, "template bases, strides and sizes must have one length");
            }
            if (!fresh->empty() && fresh->front().count() != t.count()) {
                raise(PyExc_ValueError, "every shard template must have the same number of segments");
            }
            t.size_scales = false;
            t.finalize();
            fresh->push_back(std::move(t));
        }
        engine_.set_templates(std::move(fresh));
    }

    // vLLM's prepare_values: (addr rows, size rows, block ids) as lists of fresh lists of ints.
    py::tuple prepare_values(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        const Py_ssize_t n = PyObject_Length(chunks.ptr());
        if (n < 0) throw py::error_already_set();
        if (n == 0) return py::make_tuple(py::list(), py::list(), py::list());
        Parsed parsed = parse(chunks, block_ids, shard_ids);
        return engine_.rows_as_lists(parsed.snapshot, parsed.plans, parsed.id_objects);
    }

    // The same values as int64 arrays (keys × segments, keys × segments, keys); GIL released for big ones.
    py::tuple prepare_values_array(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        const Py_ssize_t n = PyObject_Length(chunks.ptr());
        if (n < 0) throw py::error_already_set();
        if (n == 0) return engine_.rows_as_arrays(engine_.snapshot(), {});
        const Parsed parsed = parse(chunks, block_ids, shard_ids);
        return engine_.rows_as_arrays(parsed.snapshot, parsed.plans);
    }

    // Rank-local boundary puts: (addresses, sizes) of one block in every region.
    py::tuple prepare_value_for_block(py::handle block_id) {
        require_rank_local("prepare_value_for_block");
        const Snapshot snapshot = engine_.snapshot();  // vLLM reads the regions before the id
        return engine_.value_for_block(snapshot, as_int64(block_id.ptr(), "block_id"));
    }

    // The receive thread's per-group work in one call (docs/vllm.md, "Fused plan"): walk
    // [mask_num, token_len) with the 0.32+ start rule, keep chunks the absolute `load_mask` keeps, key the
    // chunk ending at token_len by the tail-key boundary's hash when `tail_tokens` is given, expand each kept
    // chunk to one key per local shard (keyed under `shard_prefixes[k]`), then its descriptors.
    // Returns (keys, addr rows, size rows, block ids), index-aligned; int64 arrays for the rows when `arrays`.
    py::tuple plan_load(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, py::handle token_len_arg,
                        py::handle mask_num_arg, py::handle load_mask, py::handle tail_tokens, py::handle block_ids,
                        py::handle arrays_arg) {
        const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
        const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
        const bool arrays = as_flag(arrays_arg);
        refuse_non_sequence(shard_prefixes, "shard_prefixes");
        FastSequence prefix_seq(shard_prefixes.ptr(), "shard_prefixes");
        if (static_cast<std::size_t>(prefix_seq.size()) != engine_.shards()) {
            raise(PyExc_ValueError,
                  "expected one key prefix per local shard (" + std::to_string(engine_.shards()) + ")");
        }
        std::vector<KeyWriter> writers;
        writers.reserve(engine_.shards());
        for (Py_ssize_t k = 0; k < prefix_seq.size(); ++k) writers.emplace_back(prefix_seq.at(k));
        const bool has_tail = !tail_tokens.is_none();
        const int64_t tail = has_tail ? as_int64(tail_tokens.ptr(), "tail_tokens") : 0;
        HashSource source(hashes, hash_len);

        // vLLM 0.32+ starts at ceil(mask_num / block_size): the walk takes a block-aligned mask_num.
        // When first * block_size does not fit, the walk is empty in vLLM (the first chunk lies past every
        // chunk of token_len): the largest block multiple in int64 gives the same empty walk (walk() needs
        // token_len + block_size to fit, so its last chunk starts below it) after the same asserts.
        int64_t aligned_mask = 0;
        if (!mul_checked(layout::first_chunk_ceil(mask_num, block_size_), block_size_, &aligned_mask)) {
            aligned_mask = INT64_MAX / block_size_ * block_size_;
        }
        WalkParams params{token_len, block_size_, hash_block_size_, aligned_mask, 1, 0};
        const std::vector<WalkedChunk> walked = walk(params, source.size(), load_mask, true);

        Parsed parsed;
        std::vector<int64_t> hash_indices;
        for (const WalkedChunk& c : walked) {
            int64_t hash_index = c.hash_index;
            if (has_tail && c.end == token_len) {
                // vLLM's block_hashes[tail // hash_block_size - 1], Python indexing; the - 1 is checked (a
                // tail_tokens of -2**63 with hash_block_size 1 would wrap).
                int64_t tail_index = 0;
                if (!add_checked(floor_div(tail, hash_block_size_), -1, &tail_index)) {
                    raise(PyExc_IndexError, "tail_tokens " + std::to_string(tail) + " names no block hash");
                }
                hash_index = python_index(tail_index, static_cast<std::size_t>(source.size()), parsed.starts.size());
            }
            for (std::size_t k = 0; k < engine_.shards(); ++k) {
                parsed.starts.push_back(c.start);
                parsed.ends.push_back(c.end);
                parsed.shards.push_back(first_shard_ + static_cast<int64_t>(k));
                hash_indices.push_back(hash_index);
            }
        }
        if (parsed.starts.empty()) {
            py::tuple r = arrays ? engine_.rows_as_arrays(engine_.snapshot(), {})
                                 : py::make_tuple(py::list(), py::list(), py::list());
            return py::make_tuple(py::list(), r[0], r[1], r[2]);
        }
        parsed.snapshot = engine_.snapshot();  // vLLM's prepare_values reads the regions after the walk
        validate(parsed);
        resolve(parsed, block_ids);
        // Keys last among the inputs: the hashes are read after every other argument was converted.
        py::list keys(static_cast<Py_ssize_t>(hash_indices.size()));
        for (std::size_t i = 0; i < hash_indices.size(); ++i) {
            std::size_t length = 0;
            const uint8_t* bytes = source.at(static_cast<Py_ssize_t>(hash_indices[i]), &length);
            PyList_SET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i),
                            writers[static_cast<std::size_t>(parsed.plans[i].shard)].make(bytes, length));
        }
        py::tuple rows = arrays ? engine_.rows_as_arrays(parsed.snapshot, parsed.plans)
                                : engine_.rows_as_lists(parsed.snapshot, parsed.plans, parsed.id_objects);
        return py::make_tuple(std::move(keys), rows[0], rows[1], rows[2]);
    }

    int64_t segment_count() {
        const Snapshot snapshot = engine_.snapshot();
        return snapshot.templates->empty() ? 0 : static_cast<int64_t>(snapshot.templates->front().count());
    }

private:
    // One call's inputs as C++ values. The snapshot is the templates and cache generation the call computes
    // on: a callback that re-registers the layout later in the call cannot make it read rows of the new
    // regions, nor leave rows of the old ones cached under the new generation (engine.hpp).
    struct Parsed {
        std::vector<int64_t> starts, ends, shards;
        std::vector<KeyPlan> plans;
        std::vector<py::object> id_objects;  // exact-int block ids reusable as output (empty otherwise)
        Snapshot snapshot;
    };

    void require_rank_local(const char* what) const {
        if (tp_shared_) raise(PyExc_RuntimeError, std::string(what) + " is for the rank-local layout");
    }

    // Every input to C++ values, in vLLM 0.33's error order.
    Parsed parse(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        Parsed p;
        std::vector<int64_t> shards = int64_values(shard_ids, "shard_ids");
        const Py_ssize_t n_chunks = PyObject_Length(chunks.ptr());
        if (n_chunks < 0) throw py::error_already_set();
        if (static_cast<std::size_t>(n_chunks) != shards.size()) {
            if (tp_shared_) raise(PyExc_ValueError, "Each Store chunk must have one shard ID");
            raise(PyExc_AssertionError, "rank-local layout: one shard id per chunk, all 0");
        }
        if (!tp_shared_) {
            for (int64_t s : shards) {
                if (s != 0) raise(PyExc_AssertionError, "rank-local layout: shard id " + std::to_string(s) + " is not 0");
            }
        }
        p.snapshot = engine_.snapshot();
        chunk_pairs(chunks, &p.starts, &p.ends);
        if (p.starts.size() != shards.size()) {
            if (PyList_CheckExact(chunks.ptr())) raise(PyExc_RuntimeError, "chunks changed size during the call");
            // Not an exact list: nothing but its own __len__ can disagree with its items.
            raise(PyExc_ValueError, "chunks reported " + std::to_string(n_chunks) + " items (__len__) but gave " +
                                        std::to_string(p.starts.size()) + ": its __len__ does not match its items");
        }
        p.shards = std::move(shards);
        validate(p);
        resolve(p, block_ids);
        return p;
    }

    // Span rules and shard ownership → plans (block ids not yet resolved).
    void validate(Parsed& p) const {
        const std::size_t n = p.starts.size();
        p.plans.assign(n, KeyPlan{0, 1, 0});
        for (std::size_t k = 0; k < n; ++k) {
            int64_t span = 0;
            if (__builtin_sub_overflow(p.ends[k], p.starts[k], &span)) {
                raise(PyExc_OverflowError, "key " + std::to_string(k) + ": end - start overflows int64");
            }
            if (tp_shared_) {
                if (span != block_size_) raise(PyExc_ValueError, "TP-shared Mooncake store requires full KV blocks");
            } else {
                if (span % hash_block_size_ != 0) {
                    raise(errors().chunk_alignment, "chunk " + std::to_string(k) + " (" + std::to_string(p.starts[k]) +
                                                        ", " + std::to_string(p.ends[k]) + "): span is not a multiple "
                                                        "of hash_block_size " + std::to_string(hash_block_size_));
                }
                p.plans[k].block_count = ceil_div(span, block_size_);
            }
        }
        if (tp_shared_) {
            // vLLM reads its first shard id here: a rank that owns none (store TP < local TP) fails as it does.
            if (engine_.shards() == 0) raise(PyExc_IndexError, "this TP rank owns no store shard (store TP < local TP)");
            const auto owned = static_cast<int64_t>(engine_.shards());
            for (std::size_t k = 0; k < n; ++k) {
                // Compare before subtracting: a caller's shard id may be any int64 (first_shard_ >= 0, so
                // shards[k] - first_shard_ cannot overflow once shards[k] >= first_shard_).
                if (p.shards[k] < first_shard_ || p.shards[k] - first_shard_ >= owned) {
                    raise(PyExc_ValueError, "Store shard is not owned by this TP rank");
                }
                p.plans[k].shard = static_cast<std::size_t>(p.shards[k] - first_shard_);
            }
        }
    }

    // block_ids[start // block_size] for every key (Python indexing), as C++ values.
    void resolve(Parsed& p, py::handle block_ids) const {
        const std::size_t n = p.plans.size();
        p.id_objects.resize(n);
        std::vector<int64_t> from_array;
        if (int64_array_values(block_ids, "block_ids", &from_array)) {
            for (std::size_t k = 0; k < n; ++k) {
                p.plans[k].block_id = from_array[static_cast<std::size_t>(
                    python_index(floor_div(p.starts[k], block_size_), from_array.size(), k))];
                check_block_id(p.plans[k].block_id);
            }
            return;
        }
        require_id_container(block_ids.ptr(), "block_ids");
        if (!PyList_CheckExact(block_ids.ptr()) && !PyTuple_CheckExact(block_ids.ptr())) {
            // A list, tuple or ndarray subclass: its own __len__/__getitem__, as vLLM's block_ids[i].
            resolve_by_index(p, block_ids);
            return;
        }
        FastSequence ids(block_ids.ptr(), "block_ids");
        for (std::size_t k = 0; k < n; ++k) {
            const int64_t at = python_index(floor_div(p.starts[k], block_size_), static_cast<std::size_t>(ids.size()), k);
            py::object item = ids.at(static_cast<Py_ssize_t>(at));
            p.plans[k].block_id = as_int64(item.ptr(), "block id");
            check_block_id(p.plans[k].block_id);
            if (PyLong_CheckExact(item.ptr())) p.id_objects[k] = std::move(item);
        }
    }

    // resolve() for a list or tuple subclass: len() and block_ids[i] through the object's own methods.
    void resolve_by_index(Parsed& p, py::handle block_ids) const {
        const Py_ssize_t length = PyObject_Length(block_ids.ptr());
        if (length < 0) throw py::error_already_set();
        for (std::size_t k = 0; k < p.plans.size(); ++k) {
            const int64_t at = python_index(floor_div(p.starts[k], block_size_), static_cast<std::size_t>(length), k);
            py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(block_ids.ptr(), at));
            if (!item) throw py::error_already_set();
            p.plans[k].block_id = as_int64(item.ptr(), "block id");
            check_block_id(p.plans[k].block_id);
            if (PyLong_CheckExact(item.ptr())) p.id_objects[k] = std::move(item);
        }
    }

    // TP-shared layouts compute in uint64 in vLLM, which rejects negative block ids.
    void check_block_id(int64_t id) const {
        if (tp_shared_ && id < 0) raise(PyExc_OverflowError, "block id " + std::to_string(id) + " is negative");
    }

    int64_t block_size_;
    int64_t hash_block_size_;
    bool tp_shared_;
    int64_t first_shard_;
    RowEngine engine_;
};

}  // namespace

void register_layout(py::module_& m) {
    // Every method goes through checked()/constructed() (common.hpp): an instance made by __new__ without
    // __init__ raises TypeError. Ints are converted with as_int64/as_size, never pybind11's int casters.
    py::class_<LayoutEngine> layout(m, "LayoutEngine", "Segment templates of one store layout → Mooncake descriptors.");
    layout.def(py::init([](py::handle block_size, py::handle hash_block_size, bool tp_shared, py::handle first_shard,
                         py::handle n_shards, py::handle cache_bytes) {
                 const int64_t bs = as_int64(block_size.ptr(), "block_size");
                 const int64_t hbs = as_int64(hash_block_size.ptr(), "hash_block_size");
                 const int64_t first = as_int64(first_shard.ptr(), "first_shard");
                 const int64_t count = as_int64(n_shards.ptr(), "n_shards");
                 const std::size_t cache = as_size(cache_bytes.ptr(), "cache_bytes");
                 return std::make_unique<LayoutEngine>(bs, hbs, tp_shared, first, count, cache);
             }),
             py::arg("block_size"), py::arg("hash_block_size"), py::arg("tp_shared"), py::arg("first_shard"),
             py::arg("n_shards"), py::arg("cache_bytes"))
        .def("set_region_sources", checked(&LayoutEngine::set_region_sources), py::arg("kv_caches_base_addr"),
             py::arg("block_len"))
        .def("set_templates", checked(&LayoutEngine::set_templates), py::arg("templates"))
        .def("prepare_values", checked(&LayoutEngine::prepare_values), py::arg("chunks"), py::arg("block_ids"),
             py::arg("shard_ids"))
        .def("prepare_values_array", checked(&LayoutEngine::prepare_values_array), py::arg("chunks"),
             py::arg("block_ids"), py::arg("shard_ids"))
        .def("prepare_value_for_block", checked(&LayoutEngine::prepare_value_for_block), py::arg("block_id"))
        .def("plan_load", checked(&LayoutEngine::plan_load), py::arg("shard_prefixes"), py::arg("hashes"),
             py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"),
             py::arg("tail_tokens"), py::arg("block_ids"), py::arg("arrays") = false)
        .def_property_readonly("segment_count", checked(&LayoutEngine::segment_count));
    bind_engine_methods(layout);
}

}  // namespace kvaddr::py_bindings
