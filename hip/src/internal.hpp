// Internal declarations shared by librocmoe's translation units (not part of the ABI).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "rocmoe/rocmoe.h"

namespace rocmoe {

// Records the calling thread's last error and returns `code`, so call sites read
// `return fail(ROCMOE_ERR_INVALID, "peer %d out of range [0, %d)", p, n);`.
int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void clear_error();

// Deterministic first-fit allocator over [0, size): the same sequence of calls gives the
// same offsets on every rank, which is what makes the heap symmetric.
class HeapAllocator {
public:
    explicit HeapAllocator(uint64_t size);
    int alloc(uint64_t nbytes, uint64_t align, uint64_t *offset);
    int free(uint64_t offset);
    uint64_t size() const { return size_; }
    uint64_t free_bytes() const;
    uint64_t largest_free() const;

private:
    uint64_t size_;
    std::map<uint64_t, uint64_t> free_;  // offset -> length, coalesced
    std::map<uint64_t, uint64_t> used_;  // offset -> length
};

// A backend owns one rank's heap memory and the mappings of its peers'.
class Backend {
public:
    virtual ~Backend() = default;
    virtual int init(const rocmoe_init_args &args) = 0;
    virtual int bootstrap_blob(void *blob) = 0;               // kBlobSize bytes
    virtual int connect(const void *all_blobs) = 0;           // world * kBlobSize bytes
    virtual int seal() { return ROCMOE_OK; }
    virtual int finalize() = 0;
    virtual void *base() const = 0;                            // local heap base
    virtual int peer_ptr(int peer, uint64_t offset, void **out) const = 0;
    virtual int put(int peer, uint64_t dst, const void *src, uint64_t n) = 0;
    virtual int get(int peer, uint64_t src, void *dst, uint64_t n) = 0;
    virtual int quiet() = 0;
    virtual int signal_store(int peer, uint64_t offset, uint64_t value, bool add) = 0;
    virtual int signal_load(uint64_t offset, uint64_t *value) = 0;
    // false only when the peer is known to have exited
    virtual bool peer_alive(int /*peer*/) const { return true; }

    // GPU backends: device-side access for kernels (rocmoe_device_peer_table,
    // rocmoe_ipc_store_signal, rocmoe_ipc_wait_verify). Arguments are checked by the ABI.
    virtual int device_peer_table(void ** /*out*/) {
        return fail(ROCMOE_ERR_BACKEND, "this backend has no device-side peer table (use ipc)");
    }
    virtual int device_store_signal(int /*peer*/, uint64_t /*dst*/, const void * /*src*/,
                                    uint64_t /*n*/, uint64_t /*sig*/, uint64_t /*value*/,
                                    void * /*stream*/) {
        return fail(ROCMOE_ERR_BACKEND, "GPU store+signal kernels need the ipc backend");
    }
    virtual int device_wait_verify(uint64_t /*sig*/, uint64_t /*value*/, double /*timeout_s*/,
                                   uint64_t /*offset*/, const void * /*expected*/, uint64_t /*n*/,
                                   void * /*stream*/, uint64_t * /*mismatches*/) {
        return fail(ROCMOE_ERR_BACKEND, "GPU wait+verify kernels need the ipc backend");
    }
};

constexpr size_t kBlobSize = 256;

std::unique_ptr<Backend> make_host_backend();
#if defined(ROCMOE_HAVE_GPU)
std::unique_ptr<Backend> make_ipc_backend();
int gpu_device_count(int *count);
#endif
#if defined(ROCMOE_HAVE_NVSHMEM)
std::unique_ptr<Backend> make_nvshmem_backend();
#endif

}  // namespace rocmoe

struct rocmoe_ctx {
    rocmoe_init_args args{};
    std::string job_tag;
    std::unique_ptr<rocmoe::Backend> backend;
    std::unique_ptr<rocmoe::HeapAllocator> heap;
    bool connected = false;
    bool finalized = false;
};
