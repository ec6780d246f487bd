// Recycled backing memory for the int64 arrays the array output returns.
//
// A fresh 1.8 MB numpy array is a fresh mmap: writing it page-faults ~450 times, which costs ten times the
// arithmetic (measured: mostly page faults on fresh arrays). Arrays returned here own a pooled buffer through
// a capsule; when Python frees the array the buffer goes back to the pool, so steady-state requests of the same
// shape write into memory that is already mapped.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace kvaddr::py_bindings {

namespace py = pybind11;

class BufferPool {
public:
    static BufferPool& instance() {
        // Leaked on purpose: capsules may release buffers during interpreter shutdown, after static
        // destructors would have run.
        static BufferPool* pool = new BufferPool();
        return *pool;
    }

    // A new int64 array of `shape` whose memory comes from the pool (uninitialised: callers fill every cell).
    py::array_t<int64_t> new_array(const std::vector<py::ssize_t>& shape) {
        std::size_t cells = 1;
        for (py::ssize_t extent : shape) cells *= static_cast<std::size_t>(extent);
        const std::size_t bytes = cells == 0 ? sizeof(int64_t) : cells * sizeof(int64_t);
        void* memory = acquire(bytes);
        auto* block = new Block{memory, bytes};
        py::capsule owner(block, [](void* p) {
            auto* b = static_cast<Block*>(p);
            BufferPool::instance().release(b->memory, b->bytes);
            delete b;
        });
        return py::array_t<int64_t>(shape, static_cast<int64_t*>(memory), owner);
    }

private:
    struct Block {
        void* memory;
        std::size_t bytes;
    };

    // Bytes of free buffers kept for reuse; beyond it buffers go back to the allocator.
    static constexpr std::size_t kMaxRetainedBytes = std::size_t{64} << 20;

    void* acquire(std::size_t bytes) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (std::size_t i = 0; i < free_.size(); ++i) {
                if (free_[i].bytes == bytes) {
                    void* memory = free_[i].memory;
                    free_[i] = free_.back();
                    free_.pop_back();
                    retained_ -= bytes;
                    return memory;
                }
            }
        }
        void* memory = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (memory == nullptr) throw std::bad_alloc();
        return memory;
    }

    void release(void* memory, std::size_t bytes) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (retained_ + bytes <= kMaxRetainedBytes) {
                free_.push_back(Block{memory, bytes});
                retained_ += bytes;
                return;
            }
        }
        std::free(memory);
    }

    std::mutex mutex_;
    std::vector<Block> free_;
    std::size_t retained_ = 0;
};

}  // namespace kvaddr::py_bindings
