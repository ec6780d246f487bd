// LayoutEngine: vLLM 0.32+'s store layouts' face over the one address engine (engine.hpp; docs/vllm.md).
// It converts vLLM's arguments (chunks, block ids, shard ids, the fused load plan's walk) to C++ values in
// vLLM's error order, before any Python object is created (docs/vllm.md, "Rules"), and hands validated key
// plans to the engine, whose rows never alias each other or its cache. One engine serves vLLM 0.33's rules
// and 0.34's (docs/vllm.md, "vLLM 0.34 rules"): a rank-local engine given block_stride, and a TP-shared one
// built with store_chunk_size, whose templates are per (store chunk of a block, owned shard). The seed-era
// ChunkedTokenDatabase (core/database.py) is a rank-local engine built with seed_rules: its walk starts at
// floor(mask_num / block_size), it reads any hash buffer and (start, end, ...) chunks, its errors name chunks,
// and it adds the send plan (plan_store); docs/address-rows.md.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/buffer_pool.hpp"
#include "bindings/common.hpp"
#include "bindings/engine.hpp"
#include "bindings/inputs.hpp"
#include "bindings/keys.hpp"
#include "kvaddr/layout.hpp"
#include "kvaddr/staging.hpp"

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

// The store chunks per block of vLLM 0.34's TP-shared layouts (0: the engine follows vLLM 0.33's rules).
int64_t checked_chunks_per_block(int64_t block_size, bool tp_shared, int64_t store_chunk_size) {
    if (store_chunk_size == 0) return 0;
    if (!tp_shared) throw py::value_error("store_chunk_size is for TP-shared layouts");
    if (store_chunk_size < 0 || block_size % store_chunk_size != 0) {
        throw py::value_error("Store chunk size must divide the local block size");
    }
    return block_size / store_chunk_size;
}

// The seed-era rules are rank-local, with a block_size that is a multiple of hash_block_size.
bool checked_seed(bool seed_rules, int64_t block_size, int64_t hash_block_size, bool tp_shared,
                  int64_t store_chunk_size) {
    if (!seed_rules) return false;
    if (tp_shared || store_chunk_size != 0) throw py::value_error("the seed-era rules are rank-local");
    if (block_size % hash_block_size != 0) {
        throw py::value_error("block_size " + std::to_string(block_size) +
                              " must be a positive multiple of hash_block_size " + std::to_string(hash_block_size));
    }
    return true;
}

// How many templates the engine holds: one per owned shard, times the store chunks per block under 0.34.
std::size_t template_count(std::size_t n_shards, int64_t chunks_per_block) {
    std::size_t total = n_shards;
    if (chunks_per_block > 0 &&
        __builtin_mul_overflow(n_shards, static_cast<std::size_t>(chunks_per_block), &total)) {
        throw py::value_error("n_shards * (block_size // store_chunk_size) is too large");
    }
    return total;
}

// One read of a call's block ids, in the forms LayoutEngine takes: an exact integer ndarray (its values, read
// once), an exact list or tuple (read by index, its length re-read), or a list/tuple/ndarray subclass (its own
// __len__, once, and __getitem__, as vLLM's block_ids[i]).
class BlockIds {
public:
    explicit BlockIds(py::handle block_ids) {
        if (int64_array_values(block_ids, "block_ids", &array_)) {
            kind_ = Kind::array;
            return;
        }
        require_id_container(block_ids.ptr(), "block_ids");
        if (PyList_CheckExact(block_ids.ptr()) || PyTuple_CheckExact(block_ids.ptr())) {
            kind_ = Kind::fast;
            fast_.emplace(block_ids.ptr(), "block_ids");
            return;
        }
        kind_ = Kind::by_index;
        object_ = py::reinterpret_borrow<py::object>(block_ids);
        length_ = PyObject_Length(block_ids.ptr());
        if (length_ < 0) throw py::error_already_set();
    }

    std::size_t size() const {
        switch (kind_) {
            case Kind::array: return array_.size();
            case Kind::fast: return static_cast<std::size_t>(fast_->size());
            case Kind::by_index: break;
        }
        return static_cast<std::size_t>(length_);
    }

    // block_ids[at] for 0 <= at < size(); `exact` receives the item when it is an exact int (reused as output).
    int64_t at(int64_t at, py::object* exact) const {
        if (kind_ == Kind::array) return array_[static_cast<std::size_t>(at)];
        py::object item;
        if (kind_ == Kind::fast) {
            item = fast_->at(static_cast<Py_ssize_t>(at));
        } else {
            item = py::reinterpret_steal<py::object>(PySequence_GetItem(object_.ptr(), static_cast<Py_ssize_t>(at)));
            if (!item) throw py::error_already_set();
        }
        const int64_t id = as_int64(item.ptr(), "block id");
        if (PyLong_CheckExact(item.ptr())) *exact = std::move(item);
        return id;
    }

private:
    enum class Kind { array, fast, by_index };
    Kind kind_ = Kind::array;
    std::vector<int64_t> array_;
    std::optional<FastSequence> fast_;
    py::object object_;
    Py_ssize_t length_ = 0;
};

class LayoutEngine {
public:
    // store_chunk_size 0: vLLM 0.33's rules; > 0 (TP-shared only): vLLM 0.34's store chunks. seed_rules: the
    // seed-era database's (rank-local).
    LayoutEngine(int64_t block_size, int64_t hash_block_size, bool tp_shared, int64_t first_shard,
                 int64_t n_shards, std::size_t cache_bytes, int64_t store_chunk_size, bool seed_rules)
        : block_size_(block_size),
          hash_block_size_(hash_block_size),
          tp_shared_(tp_shared),
          first_shard_(first_shard),
          n_shards_(checked_shards(block_size, hash_block_size, tp_shared, first_shard, n_shards)),
          store_chunk_size_(store_chunk_size),
          chunks_per_block_(checked_chunks_per_block(block_size, tp_shared, store_chunk_size)),
          seed_(checked_seed(seed_rules, block_size, hash_block_size, tp_shared, store_chunk_size)),
          engine_(tp_shared, template_count(n_shards_, chunks_per_block_), cache_bytes,
                  {seed_rules, seed_rules ? "chunk" : "key"}) {}
    RowEngine& engine() noexcept { return engine_; }

    // Rank-local: the caller's region lists, re-read (and compared) on every call, as vLLM reads them;
    // block_stride None for vLLM 0.33's rules, a list for 0.34's.
    void set_region_sources(py::object base, py::object block_len, py::object block_stride) {
        require_rank_local("set_region_sources");
        engine_.set_region_sources(std::move(base), std::move(block_len), std::move(block_stride));
    }

    // TP-shared, vLLM 0.33: one (bases, strides, sizes) triple per local shard. vLLM 0.34 (store chunks):
    // templates[chunk_index][local_shard] = (bases, strides, sizes). Every triple of one width.
    void set_templates(py::handle templates) {
        if (!tp_shared_) raise(PyExc_RuntimeError, "set_templates is for TP-shared layouts");
        auto fresh = std::make_shared<Templates>();
        fresh->reserve(engine_.template_count());
        if (chunks_per_block_ == 0) {
            read_shard_templates(templates, "shard templates", fresh.get());
        } else {
            FastSequence chunks(templates.ptr(), "templates");
            if (static_cast<uint64_t>(chunks.size()) != static_cast<uint64_t>(chunks_per_block_)) {
                raise(PyExc_ValueError, "expected " + std::to_string(chunks_per_block_) +
                                            " store chunk templates (block_size // store_chunk_size), got " +
                                            std::to_string(chunks.size()));
            }
            const Py_ssize_t n_chunks = chunks.size();
            for (Py_ssize_t c = 0; c < n_chunks; ++c) {
                read_shard_templates(chunks.at(c), "shard templates of a store chunk", fresh.get());
            }
        }
        engine_.set_templates(std::move(fresh));
    }

    // vLLM's prepare_values (`arrays` false): (addr rows, size rows, block ids) as lists of fresh lists of
    // ints; prepare_values_array (`arrays` true): the same values as int64 arrays (keys × segments, keys ×
    // segments, keys), GIL released for big ones. One body, `arrays` apart.
    template <bool arrays>
    py::tuple values(py::handle chunks, py::handle block_ids, py::handle shard_ids) {
        if (seed_) return seed_values(chunks, block_ids, shard_ids, arrays);
        const Py_ssize_t n = PyObject_Length(chunks.ptr());
        if (n < 0) throw py::error_already_set();
        if (n == 0) return no_rows(arrays, true);
        Parsed parsed = parse(chunks, block_ids, shard_ids);
        return rows_of(parsed, arrays);
    }

    // Rank-local boundary puts: (addresses, sizes) of one block in every region.
    py::tuple prepare_value_for_block(py::handle block_id) {
        require_rank_local("prepare_value_for_block");
        // The seed-era database converts the id before it reads the regions; vLLM reads the regions first.
        int64_t id = seed_ ? as_int64(block_id.ptr(), "block_id") : 0;
        const Snapshot snapshot = engine_.snapshot();
        if (!seed_) id = as_int64(block_id.ptr(), "block_id");
        return engine_.value_for_block(snapshot, id);
    }

    // The receive thread's per-group work in one call (docs/vllm.md, "Fused plan"): walk_keys' walk, then the
    // descriptors of every key. Returns (keys, addr rows, size rows, block ids), index-aligned; int64 arrays
    // for the rows when `arrays`. A `slot_alignment` (a power of two) implies arrays and appends the staging
    // slot layout of the sizes (docs/transfer-modes.md): (..., slot offsets (n,), object sizes (n,), total
    // bytes), as staging_plan_slots lays it out.
    py::tuple plan_load(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, py::handle token_len_arg,
                        py::handle mask_num_arg, py::handle load_mask, py::handle tail_tokens, py::handle block_ids,
                        py::handle arrays_arg, py::handle slot_alignment_arg) {
        const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
        const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
        bool arrays = as_flag(arrays_arg);
        const bool slots = !slot_alignment_arg.is_none();
        const int64_t slot_alignment = slots ? as_int64(slot_alignment_arg.ptr(), "slot_alignment") : 0;
        if (slots && (slot_alignment <= 0 || (slot_alignment & (slot_alignment - 1)) != 0)) {
            raise(PyExc_ValueError, "slot_alignment must be a positive power of two, got " + std::to_string(slot_alignment));
        }
        arrays = arrays || slots;
        LoadWalk w = walk_keys(shard_prefixes, hashes, hash_len, token_len, mask_num, load_mask, tail_tokens);
        // Keys: vLLM's layouts read the hashes after every other argument; the seed-era database right after
        // the walk (its reference keys each chunk before it computes rows).
        py::list keys = seed_ ? build_key_list(w.writers, *w.source, w.hash_indices) : py::list();
        Parsed& parsed = w.parsed;
        if (parsed.starts.empty()) {
            // The seed-era arrays of nothing read no region; vLLM's layouts read them.
            return with_slots(std::move(keys), no_rows(arrays, !seed_), slots, slot_alignment);
        }
        parsed.snapshot = engine_.snapshot();  // vLLM's prepare_values reads the regions after the walk
        make_plans(parsed, block_ids);
        if (!seed_) keys = build_key_list(w.writers, *w.source, w.hash_indices);
        return with_slots(std::move(keys), rows_of(parsed, arrays), slots, slot_alignment);
    }

    // walk_keys without rows: (keys, chunks) with chunks an (n, 3) int64 array of (start, end, shard id), in
    // plan_load's order.
    py::tuple walk_load(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, py::handle token_len_arg,
                        py::handle mask_num_arg, py::handle load_mask, py::handle tail_tokens) {
        const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
        const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
        LoadWalk w = walk_keys(shard_prefixes, hashes, hash_len, token_len, mask_num, load_mask, tail_tokens);
        py::list keys = build_key_list(w.writers, *w.source, w.hash_indices);
        const std::size_t n = w.parsed.starts.size();
        py::array_t<int64_t> chunks({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(3)});
        int64_t* out = chunks.mutable_data();
        for (std::size_t i = 0; i < n; ++i, out += 3) {
            out[0] = w.parsed.starts[i];
            out[1] = w.parsed.ends[i];
            out[2] = w.parsed.shards[i];
        }
        return py::make_tuple(std::move(keys), std::move(chunks));
    }

    // plan_load's result: (keys, addr rows, size rows, block ids) from `keys` and `rows`, with, when `slots`
    // (rows of arrays), the staging layout of the sizes appended (microseconds: the GIL stays held).
    static py::tuple with_slots(py::list keys, py::tuple rows, bool slots, int64_t alignment) {
        if (!slots) return py::make_tuple(std::move(keys), rows[0], rows[1], rows[2]);
        auto sizes = rows[1].cast<py::array_t<int64_t>>();
        const auto n_keys = static_cast<std::size_t>(sizes.shape(0));
        const auto regions = static_cast<std::size_t>(sizes.ndim() == 2 ? sizes.shape(1) : 0);
        BufferPool& pool = BufferPool::instance();
        py::array_t<int64_t> offsets = pool.new_array({static_cast<py::ssize_t>(n_keys)});
        py::array_t<int64_t> object_sizes = pool.new_array({static_cast<py::ssize_t>(n_keys)});
        int64_t total = 0;
        const staging::PlanProblem problem = staging::plan_slots(sizes.data(), n_keys, regions, alignment,
                                                                 offsets.mutable_data(), object_sizes.mutable_data(), &total);
        if (problem.fault != staging::PlanFault::none) {
            // Sizes are block_len * count: only a negative block_len or a huge layout gets here.
            raise(PyExc_OverflowError, "key " + std::to_string(problem.key) +
                                           ": the staging layout does not fit in int64 (or a block_len is negative)");
        }
        return py::make_tuple(std::move(keys), py::object(rows[0]), py::object(rows[1]), py::object(rows[2]),
                              std::move(offsets), std::move(object_sizes), total);
    }

    // A send thread's candidates: (keys, chunks, block ids) of this rank's stripe of the walk (the relative
    // chunk_mask), without chunks past block_ids and (skip_null) those on block 0, each expanded to one entry
    // per local shard. Chunks are (start, end, shard id) tuples — the seed-era rules' (start, end) pairs,
    // whose walk starts at floor(mask_num / block_size) where vLLM's starts at the ceiling. Not for vLLM
    // 0.34's store chunks.
    py::tuple plan_store(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, py::handle token_len_arg,
                         py::handle mask_num_arg, py::handle chunk_mask, py::handle put_step_arg,
                         py::handle put_step_rank_arg, py::handle block_ids, py::handle skip_null_arg) {
        if (chunks_per_block_ != 0) raise(PyExc_RuntimeError, "plan_store does not walk store chunks");
        const int64_t token_len = as_int64(token_len_arg.ptr(), "token_len");
        const int64_t mask_num = as_int64(mask_num_arg.ptr(), "mask_num");
        const int64_t put_step = as_int64(put_step_arg.ptr(), "put_step");
        const int64_t put_step_rank = as_int64(put_step_rank_arg.ptr(), "put_step_rank");
        const bool skip_null = as_flag(skip_null_arg);
        const std::vector<KeyWriter> writers = key_writers(shard_prefixes);
        HashSource source(hashes, hash_len, seed_ ? HashItems::any_buffer : HashItems::block_hash);
        const WalkParams params{token_len, block_size_, hash_block_size_, walk_start(mask_num, block_size_),
                                put_step, put_step_rank};
        const std::vector<WalkedChunk> walked = walk(params, source.size(), chunk_mask, false);
        BlockIdSource ids(block_ids);
        std::vector<int64_t> hash_indices;
        py::list chunk_list;
        py::list id_list;
        for (const WalkedChunk& c : walked) {
            const int64_t block_index = c.start / block_size_;
            if (block_index >= ids.size()) continue;
            py::object id_object;
            const int64_t id = ids.at(static_cast<Py_ssize_t>(block_index), &id_object);
            if (skip_null && id == 0) continue;
            py::object id_out = id_object ? std::move(id_object) : py::int_(id);
            for (std::size_t k = 0; k < n_shards_; ++k) {
                hash_indices.push_back(c.hash_index);
                chunk_list.append(seed_ ? py::tuple(py::make_tuple(c.start, c.end))
                                        : py::tuple(py::make_tuple(c.start, c.end, first_shard_ + static_cast<int64_t>(k))));
                id_list.append(id_out);
            }
        }
        return py::make_tuple(build_key_list(writers, source, hash_indices), std::move(chunk_list), std::move(id_list));
    }

    int64_t segment_count() {
        const Snapshot snapshot = engine_.snapshot();
        return snapshot.templates->empty() ? 0 : static_cast<int64_t>(snapshot.templates->front().count());
    }

    // The store chunk size (vLLM 0.34's TP-shared rules), or None (vLLM 0.33's rules).
    py::object store_chunk_size() const {
        return store_chunk_size_ == 0 ? py::object(py::none()) : py::object(py::int_(store_chunk_size_));
    }
    int64_t chunks_per_block() const { return chunks_per_block_; }

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

    // A walk's start for mask_num: vLLM 0.32+ starts at ceil(mask_num / step) (a partly masked chunk is
    // skipped), which the walk takes as a step-aligned mask_num; the seed-era rules at the floor, which the
    // walk applies itself. When the ceiling's first token does not fit, the walk is empty in vLLM (the first
    // chunk lies past every chunk of token_len): the largest step multiple in int64 gives the same empty walk
    // (walk() needs token_len + step to fit, so its last chunk starts below it) after the same asserts.
    int64_t walk_start(int64_t mask_num, int64_t step) const {
        int64_t aligned = mask_num;
        if (!seed_ && !mul_checked(layout::first_chunk_ceil(mask_num, step), step, &aligned)) {
            aligned = INT64_MAX / step * step;
        }
        return aligned;
    }

    // One key writer per local shard, from the caller's prefixes.
    std::vector<KeyWriter> key_writers(py::handle shard_prefixes) const {
        FastSequence prefix_seq = checked_sequence(shard_prefixes, "shard_prefixes");
        if (static_cast<std::size_t>(prefix_seq.size()) != n_shards_) {
            raise(PyExc_ValueError, "expected one key prefix per local shard (" + std::to_string(n_shards_) + ")");
        }
        std::vector<KeyWriter> writers;
        writers.reserve(n_shards_);
        for (Py_ssize_t k = 0; k < prefix_seq.size(); ++k) writers.emplace_back(prefix_seq.at(k));
        return writers;
    }

    // A load's walked keys before any row: per kept chunk and local shard, its span and shard (parsed) and
    // the index of the hash it is keyed by.
    struct LoadWalk {
        std::vector<KeyWriter> writers;
        std::unique_ptr<HashSource> source;
        Parsed parsed;
        std::vector<int64_t> hash_indices;
    };

    // The load walk of plan_load and walk_load (docs/vllm.md, "Fused plan"): walk [mask_num, token_len) from
    // walk_start (by store chunks when the engine has them), keep chunks the absolute `load_mask` keeps (per
    // chunk, which is a block; per block with store chunks), key the chunk ending at token_len by the
    // tail-key boundary's hash when `tail_tokens` is given, and expand each kept chunk to one entry per local
    // shard (keyed under `shard_prefixes[k]`).
    LoadWalk walk_keys(py::handle shard_prefixes, py::handle hashes, py::handle hash_len, int64_t token_len,
                       int64_t mask_num, py::handle load_mask, py::handle tail_tokens) {
        LoadWalk w;
        w.writers = key_writers(shard_prefixes);
        const bool has_tail = !tail_tokens.is_none();
        const int64_t tail = has_tail ? as_int64(tail_tokens.ptr(), "tail_tokens") : 0;
        w.source = std::make_unique<HashSource>(hashes, hash_len, seed_ ? HashItems::any_buffer : HashItems::block_hash);
        // With store chunks (vLLM 0.34) the walk steps by the store chunk and the mask is read per physical
        // block (start // block_size), after the walk; without, a chunk is a block and the walk applies it.
        const int64_t step = chunks_per_block_ != 0 ? store_chunk_size_ : block_size_;
        const WalkParams params{token_len, step, hash_block_size_, walk_start(mask_num, step), 1, 0};
        std::vector<WalkedChunk> walked =
            walk(params, w.source->size(), chunks_per_block_ != 0 ? py::none() : load_mask, true);
        if (chunks_per_block_ != 0 && !load_mask.is_none()) {
            // vLLM 0.34's receive rule: a walked chunk is kept when mask[start // block_size] is true (an index
            // past the mask drops it); the mask is read in walk order (remove_if's), as vLLM reads it.
            FastSequence flags = checked_sequence(load_mask, "load mask");
            const auto dropped = [&](const WalkedChunk& c) {
                const int64_t block = floor_div(c.start, block_size_);
                if (block < 0 || block >= static_cast<int64_t>(flags.size())) return true;
                return !as_flag(flags.at(static_cast<Py_ssize_t>(block)));
            };
            walked.erase(std::remove_if(walked.begin(), walked.end(), dropped), walked.end());
        }
        for (const WalkedChunk& c : walked) {
            int64_t hash_index = c.hash_index;
            if (has_tail && c.end == token_len) {
                // vLLM's block_hashes[tail // hash_block_size - 1], Python indexing; the - 1 is checked (a
                // tail_tokens of -2**63 with hash_block_size 1 would wrap).
                int64_t tail_index = 0;
                const int64_t n_hashes = w.source->size();
                if (!add_checked(floor_div(tail, hash_block_size_), -1, &tail_index)) {
                    raise(PyExc_IndexError, "tail_tokens " + std::to_string(tail) + " names no block hash");
                }
                if (tail_index >= n_hashes || tail_index < -n_hashes) {  // Python indexing: negative wraps once
                    raise(PyExc_IndexError, "tail boundary: num_tokens " + std::to_string(tail) + " needs hash " +
                                                std::to_string(tail_index) + ", only " + std::to_string(n_hashes) +
                                                " given");
                }
                hash_index = tail_index < 0 ? tail_index + n_hashes : tail_index;
            }
            for (std::size_t k = 0; k < n_shards_; ++k) {
                w.parsed.starts.push_back(c.start);
                w.parsed.ends.push_back(c.end);
                w.parsed.shards.push_back(first_shard_ + static_cast<int64_t>(k));
                w.hash_indices.push_back(hash_index);
            }
        }
        return w;
    }

    void require_rank_local(const char* what) const {
        if (tp_shared_) raise(PyExc_RuntimeError, std::string(what) + " is for the rank-local layout");
    }

    // Every input to C++ values, in vLLM 0.33's error order, or with store chunks in vLLM 0.34's (its
    // TPShardedStoreLayout.prepare_values, docs/vllm.md, "vLLM 0.34 rules": validate_store_chunks).
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
        // vLLM 0.34 reads its first shard id next: a rank that owns none (store TP < local TP) fails as it does.
        if (chunks_per_block_ != 0 && n_shards_ == 0) {
            raise(PyExc_IndexError, "this TP rank owns no store shard (store TP < local TP)");
        }
        // The snapshot, then every chunk's (start, end) as C++ values, with the shard ids already read.
        p.snapshot = engine_.snapshot();
        chunk_pairs(chunks, &p.starts, &p.ends, chunks_per_block_ != 0);
        if (p.starts.size() != shards.size()) {
            if (PyList_CheckExact(chunks.ptr())) raise(PyExc_RuntimeError, "chunks changed size during the call");
            // Not an exact list: nothing but its own __len__ can disagree with its items.
            raise(PyExc_ValueError, "chunks reported " + std::to_string(n_chunks) + " items (__len__) but gave " +
                                        std::to_string(p.starts.size()) + ": its __len__ does not match its items");
        }
        p.shards = std::move(shards);
        make_plans(p, block_ids);
        return p;
    }

    // The plans, block ids resolved, of the chunks read into `p`: by vLLM 0.34's store-chunk rules when the
    // engine has store chunks, else by vLLM 0.33's (and the seed-era) span rules.
    void make_plans(Parsed& p, py::handle block_ids) const {
        if (chunks_per_block_ != 0) {
            validate_store_chunks(p, block_ids);
        } else {
            validate(p);
            resolve(p, block_ids);
        }
    }

    // vLLM 0.34's rules on chunks already read (p.starts, p.ends, p.shards): plans with block ids. Each chunk
    // lies in one store chunk of one block: start a multiple of store_chunk_size, 0 < end - start <=
    // store_chunk_size; its key's template is (start's store chunk within its block, local shard). vLLM checks
    // up to 16 chunks one by one (boundary, shard, block index, block id) and more in phases (every boundary,
    // every shard, every block index, then the block ids in order); the same order here, so the same error
    // comes first.
    void validate_store_chunks(Parsed& p, py::handle block_ids) const {
        const std::size_t n = p.starts.size();
        p.plans.assign(n, KeyPlan{0, 1, 0});
        p.id_objects.resize(n);
        std::vector<int64_t> block_index(n);
        const auto boundary = [&](std::size_t k) {
            int64_t span = 0;
            // An end - start outside int64 is far outside (0, store_chunk_size]: the same error.
            if (p.starts[k] % store_chunk_size_ != 0 || __builtin_sub_overflow(p.ends[k], p.starts[k], &span) ||
                span <= 0 || span > store_chunk_size_) {
                raise(PyExc_ValueError, "Invalid Store chunk boundary");
            }
            // divmod(start, block_size) with Python's floor (start - index * block_size could overflow).
            block_index[k] = floor_div(p.starts[k], block_size_);
            int64_t offset = p.starts[k] % block_size_;
            if (offset < 0) offset += block_size_;
            p.plans[k].shard = static_cast<std::size_t>(offset / store_chunk_size_) * n_shards_;
        };
        const auto owned = [&](std::size_t k) { p.plans[k].shard += owned_shard(p.shards[k]); };
        std::optional<BlockIds> ids;  // read where vLLM first calls len(block_ids)
        const auto has_block = [&](std::size_t k) {
            if (!ids) ids.emplace(block_ids);
            if (block_index[k] >= 0 && static_cast<uint64_t>(block_index[k]) >= ids->size()) {
                raise(PyExc_ValueError, "Store chunk has no local cache block");
            }
        };
        const auto block_id = [&](std::size_t k) { resolve_one(p, *ids, k, block_index[k]); };
        if (n > 16) {
            for (std::size_t k = 0; k < n; ++k) boundary(k);
            for (std::size_t k = 0; k < n; ++k) owned(k);
            for (std::size_t k = 0; k < n; ++k) has_block(k);
            for (std::size_t k = 0; k < n; ++k) block_id(k);
        } else {
            for (std::size_t k = 0; k < n; ++k) {
                boundary(k);
                owned(k);
                has_block(k);
                block_id(k);
            }
        }
    }

    // One (bases, strides, sizes) triple per local shard from `shard_templates`, appended to `out`; every
    // template of `out` has one width.
    void read_shard_templates(py::handle shard_templates, const char* what, Templates* out) const {
        FastSequence seq(shard_templates.ptr(), what);
        if (static_cast<std::size_t>(seq.size()) != n_shards_) {
            raise(PyExc_ValueError, "expected " + std::to_string(n_shards_) + " " + what + ", got " +
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
            if (!out->empty() && out->front().count() != t.count()) {
                raise(PyExc_ValueError, "every shard template must have the same number of segments");
            }
            t.size_scales = false;
            t.finalize();
            out->push_back(std::move(t));
        }
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
            if (n_shards_ == 0) raise(PyExc_IndexError, "this TP rank owns no store shard (store TP < local TP)");
            for (std::size_t k = 0; k < n; ++k) p.plans[k].shard = owned_shard(p.shards[k]);
        }
    }

    // block_ids[start // block_size] for every key (Python indexing), as C++ values; the seed-era rules read
    // any sequence of ints (BlockIdSource), vLLM's a list, tuple or integer array.
    void resolve(Parsed& p, py::handle block_ids) const {
        if (seed_) {
            resolve_block_ids(BlockIdSource(block_ids), p.starts, block_size_, &p.plans, &p.id_objects);
            return;
        }
        const BlockIds ids(block_ids);
        const std::size_t n = p.plans.size();
        p.id_objects.resize(n);
        for (std::size_t k = 0; k < n; ++k) resolve_one(p, ids, k, floor_div(p.starts[k], block_size_));
    }

    // Key k's block id: block_ids[block_index] (Python indexing). TP-shared layouts compute in uint64 in vLLM,
    // which rejects negative block ids.
    void resolve_one(Parsed& p, const BlockIds& ids, std::size_t k, int64_t block_index) const {
        const int64_t at = python_index(block_index, ids.size(), k);
        const int64_t id = ids.at(at, &p.id_objects[k]);
        if (tp_shared_ && id < 0) raise(PyExc_OverflowError, "block id " + std::to_string(id) + " is negative");
        p.plans[k].block_id = id;
    }

    // The rows of `p`'s plans: int64 arrays, or lists (with p's exact-int block ids reused).
    py::tuple rows_of(Parsed& p, bool arrays) {
        return arrays ? engine_.rows_as_arrays(p.snapshot, p.plans)
                      : engine_.rows_as_lists(p.snapshot, p.plans, p.id_objects);
    }

    // The rows of no key: three empty lists, or arrays of no row, which read the regions (engine_.snapshot())
    // only when `read_regions`.
    py::tuple no_rows(bool arrays, bool read_regions) {
        if (!arrays) return py::make_tuple(py::list(), py::list(), py::list());
        Snapshot snapshot{std::make_shared<const Templates>(), 0};
        if (read_regions) snapshot = engine_.snapshot();
        return engine_.rows_as_arrays(snapshot, {});
    }

    // The seed-era prepare_values (arrays: prepare_values_array), in its reference's error order: regions,
    // then every span (any (start, end, ...) item, or an (n, >=2) integer array for arrays), then block ids.
    py::tuple seed_values(py::handle chunks, py::handle block_ids, py::handle shard_ids, bool arrays) {
        if (!shard_ids.is_none()) raise(PyExc_TypeError, "shard_ids: the seed-era rules have no shards (pass None)");
        Parsed p;
        std::unique_ptr<FastSequence> items;
        if (!arrays) {
            items = chunk_sequence(chunks);
            if (items->size() == 0) return no_rows(false, false);
            p.snapshot = engine_.snapshot();
        }
        ChunkSpans spans = arrays ? parse_chunks(chunks, block_size_, hash_block_size_, true)
                                  : parse_chunk_items(*items, block_size_, hash_block_size_);
        p.starts = std::move(spans.starts);
        p.plans = std::move(spans.plans);
        // No chunk (or a callback emptied the list): arrays of nothing read no region.
        if (p.plans.empty()) return no_rows(arrays, false);
        if (arrays) p.snapshot = engine_.snapshot();
        resolve(p, block_ids);
        return rows_of(p, arrays);
    }

    // The local index of a caller's shard id; ValueError unless this rank owns it. Compared before subtracting:
    // a caller's shard id may be any int64 (first_shard_ >= 0, so shard - first_shard_ cannot overflow once
    // shard >= first_shard_).
    std::size_t owned_shard(int64_t shard) const {
        if (shard < first_shard_ || shard - first_shard_ >= static_cast<int64_t>(n_shards_)) {
            raise(PyExc_ValueError, "Store shard is not owned by this TP rank");
        }
        return static_cast<std::size_t>(shard - first_shard_);
    }

    int64_t block_size_;
    int64_t hash_block_size_;
    bool tp_shared_;
    int64_t first_shard_;
    std::size_t n_shards_;        // owned store shards (1 for rank-local)
    int64_t store_chunk_size_;    // 0: vLLM 0.33's rules
    int64_t chunks_per_block_;    // block_size / store_chunk_size, or 0
    bool seed_;                   // the seed-era database's rules
    RowEngine engine_;
};

}  // namespace

void register_layout(py::module_& m) {
    // Every method goes through checked()/constructed() (common.hpp): an instance made by __new__ without
    // __init__ raises TypeError. Ints are converted with as_int64/as_size, never pybind11's int casters.
    py::class_<LayoutEngine> layout(m, "LayoutEngine", "Segment templates of one store layout → Mooncake descriptors.");
    layout.def(py::init([](py::handle block_size, py::handle hash_block_size, bool tp_shared, py::handle first_shard,
                         py::handle n_shards, py::handle cache_bytes, py::handle store_chunk_size, bool seed_rules) {
                 const int64_t bs = as_int64(block_size.ptr(), "block_size");
                 const int64_t hbs = as_int64(hash_block_size.ptr(), "hash_block_size");
                 const int64_t first = as_int64(first_shard.ptr(), "first_shard");
                 const int64_t count = as_int64(n_shards.ptr(), "n_shards");
                 const std::size_t cache = as_size(cache_bytes.ptr(), "cache_bytes");
                 int64_t chunk = 0;  // None: vLLM 0.33's rules
                 if (!store_chunk_size.is_none()) {
                     chunk = as_int64(store_chunk_size.ptr(), "store_chunk_size");
                     if (chunk <= 0) throw py::value_error("Store chunk size must divide the local block size");
                 }
                 return std::make_unique<LayoutEngine>(bs, hbs, tp_shared, first, count, cache, chunk, seed_rules);
             }),
             py::arg("block_size"), py::arg("hash_block_size"), py::arg("tp_shared"), py::arg("first_shard"),
             py::arg("n_shards"), py::arg("cache_bytes"), py::arg("store_chunk_size") = py::none(), py::kw_only(),
             py::arg("seed_rules") = false)
        .def("set_region_sources", checked(&LayoutEngine::set_region_sources), py::arg("kv_caches_base_addr"),
             py::arg("block_len"), py::arg("block_stride") = py::none())
        .def("set_templates", checked(&LayoutEngine::set_templates), py::arg("templates"))
        .def("prepare_values", checked(&LayoutEngine::values<false>), py::arg("chunks"), py::arg("block_ids"),
             py::arg("shard_ids") = py::none())
        .def("prepare_values_array", checked(&LayoutEngine::values<true>), py::arg("chunks"),
             py::arg("block_ids"), py::arg("shard_ids") = py::none())
        .def("prepare_value_for_block", checked(&LayoutEngine::prepare_value_for_block), py::arg("block_id"))
        .def("plan_load", checked(&LayoutEngine::plan_load), py::arg("shard_prefixes"), py::arg("hashes"),
             py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"),
             py::arg("tail_tokens"), py::arg("block_ids"), py::arg("arrays") = false,
             py::arg("slot_alignment") = py::none())
        .def("walk_load", checked(&LayoutEngine::walk_load), py::arg("shard_prefixes"), py::arg("hashes"),
             py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"), py::arg("load_mask"),
             py::arg("tail_tokens"))
        .def("plan_store", checked(&LayoutEngine::plan_store), py::arg("shard_prefixes"), py::arg("hashes"),
             py::arg("hash_len"), py::arg("token_len"), py::arg("mask_num"), py::arg("chunk_mask"),
             py::arg("put_step"), py::arg("put_step_rank"), py::arg("block_ids"), py::arg("skip_null"))
        .def_property_readonly("segment_count", checked(&LayoutEngine::segment_count))
        .def_property_readonly("store_chunk_size", checked(&LayoutEngine::store_chunk_size),
                               "The store chunk size (vLLM 0.34's TP-shared rules), or None (vLLM 0.33's rules).")
        .def_property_readonly("chunks_per_block", checked(&LayoutEngine::chunks_per_block));
    bind_engine_methods(layout);
}

}  // namespace kvaddr::py_bindings
