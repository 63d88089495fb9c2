/* shmem facade, ipc variant: peers' heaps are mapped into this process (IPC handles), so
 * a put is a plain workgroup-cooperative copy through a peer pointer and a signal is a
 * system-scope release store. Include rocmoe/shmem.h, not this file. */
#ifndef ROCMOE_SHMEM_IPC_H
#define ROCMOE_SHMEM_IPC_H

#if !defined(ROCMOE_SHMEM_H)
#error "include rocmoe/shmem.h instead of rocmoe/shmem_ipc.h"
#endif

#define ROCMOE_SHMEM_VARIANT_IPC 1

#if defined(__HIP__) || defined(__CUDACC__)
namespace rocmoe {
namespace shmem {

__device__ __forceinline__ unsigned wg_thread_id() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ unsigned wg_size() { return blockDim.x * blockDim.y * blockDim.z; }

/* The peer table holds every rank's heap base as seen from this process, own rank
 * included, so translation is one subtraction and one addition. */
__device__ __forceinline__ void *peer_ptr(const Team &team, const void *local_sym, int pe) {
    const char *my_base = static_cast<const char *>(team.peer_bases[team.rank]);
    const size_t offset = static_cast<size_t>(static_cast<const char *>(local_sym) - my_base);
    return static_cast<char *>(team.peer_bases[pe]) + offset;
}

/* Cooperative copy by every thread of the workgroup: 16-byte vectors when both ends
 * allow it, four in flight per thread to cover the latency of remote stores. */
__device__ __forceinline__ void copy_wg(void *dst, const void *src, size_t n) {
    const size_t tid = wg_thread_id();
    const size_t nthreads = wg_size();
    char *d = static_cast<char *>(dst);
    const char *s = static_cast<const char *>(src);
    if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15u) == 0) {
        uint4 *dv = reinterpret_cast<uint4 *>(d);
        const uint4 *sv = reinterpret_cast<const uint4 *>(s);
        const size_t nvec = n / 16;
        size_t i = tid;
        for (; i + 3 * nthreads < nvec; i += 4 * nthreads) {
            const uint4 a = sv[i];
            const uint4 b = sv[i + nthreads];
            const uint4 c = sv[i + 2 * nthreads];
            const uint4 e = sv[i + 3 * nthreads];
            dv[i] = a;
            dv[i + nthreads] = b;
            dv[i + 2 * nthreads] = c;
            dv[i + 3 * nthreads] = e;
        }
        for (; i < nvec; i += nthreads) dv[i] = sv[i];
        d += nvec * 16;
        s += nvec * 16;
        n -= nvec * 16;
    }
    for (size_t i = tid; i < n; i += nthreads) d[i] = s[i];
}

__device__ __forceinline__ void put_nbi_wg(const Team &team, void *dst, const void *src, size_t n,
                                           int pe) {
    copy_wg(peer_ptr(team, dst, pe), src, n);
}

/* One thread: a 64-bit value into pe's dst (a count that travels with the data; the
 * signal_set that follows orders it before the signal). */
__device__ __forceinline__ void put_u64(const Team &team, uint64_t *dst, uint64_t value, int pe) {
    *static_cast<volatile uint64_t *>(peer_ptr(team, dst, pe)) = value;
}

/* Direct stores complete in program order once made visible system-wide; one system
 * fence does both jobs. */
__device__ __forceinline__ void fence(const Team &) { __threadfence_system(); }
__device__ __forceinline__ void quiet(const Team &) { __threadfence_system(); }

__device__ __forceinline__ void signal_set(const Team &team, uint64_t *sig, uint64_t value, int pe) {
    __threadfence_system();
    platform::store_release_system(static_cast<uint64_t *>(peer_ptr(team, sig, pe)), value);
}

__device__ __forceinline__ void signal_add(const Team &team, uint64_t *sig, uint64_t value, int pe) {
    __threadfence_system();
    platform::fetch_add_release_system(static_cast<uint64_t *>(peer_ptr(team, sig, pe)), value);
}

/* Every thread fences its own stores before the barrier, so the one release store after
 * it publishes the whole workgroup's data, not just thread 0's. */
__device__ __forceinline__ void put_signal_nbi_wg(const Team &team, void *dst, const void *src,
                                                  size_t n, uint64_t *sig, uint64_t value, int pe) {
    put_nbi_wg(team, dst, src, n, pe);
    __threadfence_system();
    __syncthreads();
    if (wg_thread_id() == 0)
        platform::store_release_system(static_cast<uint64_t *>(peer_ptr(team, sig, pe)), value);
}

__device__ __forceinline__ uint64_t signal_fetch(const Team &, uint64_t *sig) {
    return platform::load_acquire_system(sig);
}

__device__ __forceinline__ int wait_until(const Team &team, uint64_t *sig, int cmp, uint64_t value,
                                          uint64_t timeout_ns, uint64_t *observed) {
    const uint64_t start = platform::device_time_ns();
    for (uint32_t spin = 0;; ++spin) {
        const uint64_t seen = signal_fetch(team, sig);
        if (compare(seen, cmp, value)) {
            if (observed) *observed = seen;
            return kWaitOk;
        }
        // Reading the clock is not free: check it every 64 polls.
        if ((spin & 63u) == 63u && platform::device_time_ns() - start >= timeout_ns) {
            if (observed) *observed = seen;
            return kWaitTimeout;
        }
        platform::relax();
    }
}

}  // namespace shmem
}  // namespace rocmoe
#endif

#endif /* ROCMOE_SHMEM_IPC_H */
