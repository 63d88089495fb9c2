// Symmetric-heap allocator. It only hands out offsets; the memory belongs to the backend.
#include <algorithm>
#include <cinttypes>

#include "internal.hpp"

namespace rocmoe {

HeapAllocator::HeapAllocator(uint64_t size) : size_(size) {
    if (size_ > 0) free_[0] = size_;
}

int HeapAllocator::alloc(uint64_t nbytes, uint64_t align, uint64_t *offset) {
    if (align == 0 || (align & (align - 1)) != 0)
        return fail(ROCMOE_ERR_INVALID, "alignment %" PRIu64 " is not a power of two", align);
    // Zero-byte tensors still get a distinct offset, so that free() can find them.
    const uint64_t want = std::max<uint64_t>(nbytes, 1);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        const uint64_t start = it->first, len = it->second;
        const uint64_t aligned = (start + align - 1) & ~(align - 1);
        const uint64_t pad = aligned - start;
        if (pad > len || len - pad < want) continue;
        free_.erase(it);
        if (pad > 0) free_[start] = pad;
        const uint64_t tail = len - pad - want;
        if (tail > 0) free_[aligned + want] = tail;
        used_[aligned] = want;
        *offset = aligned;
        return ROCMOE_OK;
    }
    return fail(ROCMOE_ERR_NOMEM,
                "symmetric heap exhausted: requested %" PRIu64 " bytes (alignment %" PRIu64
                "), %" PRIu64 " bytes free of %" PRIu64 ", largest free block %" PRIu64
                " bytes; free tensors or raise ROCMOE_HEAP_SIZE",
                nbytes, align, free_bytes(), size_, largest_free());
}

int HeapAllocator::free(uint64_t offset) {
    auto it = used_.find(offset);
    if (it == used_.end())
        return fail(ROCMOE_ERR_INVALID, "offset %" PRIu64 " is not a live heap allocation", offset);
    uint64_t start = offset, len = it->second;
    used_.erase(it);
    // Coalesce with the neighbours so fragmentation does not grow over a long job.
    auto next = free_.lower_bound(start);
    if (next != free_.end() && start + len == next->first) {
        len += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == start) {
            start = prev->first;
            len += prev->second;
            free_.erase(prev);
        }
    }
    free_[start] = len;
    return ROCMOE_OK;
}

uint64_t HeapAllocator::free_bytes() const {
    uint64_t total = 0;
    for (const auto &kv : free_) total += kv.second;
    return total;
}

uint64_t HeapAllocator::largest_free() const {
    uint64_t best = 0;
    for (const auto &kv : free_) best = std::max(best, kv.second);
    return best;
}

}  // namespace rocmoe
