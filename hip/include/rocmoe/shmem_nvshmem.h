/* shmem facade, NVSHMEM variant (NVIDIA, multi-node). Include rocmoe/shmem.h, not this.
 *
 * Build: nvcc -rdc=true with NVSHMEM's include dir, link libnvshmem_device.a (static,
 * device code) and libnvshmem_host.so. NVSHMEM's init is inline in its headers, so it must
 * be initialised from C++ compiled this way (never from Python directly); kernels that use
 * this variant must be launched with nvshmemx_collective_launch when they synchronise
 * across PEs inside one launch. Name mapping from rocSHMEM: _wg -> _block,
 * _wave -> _warp, rocshmem_uint64_wait_until -> nvshmem_signal_wait_until. */
#ifndef ROCMOE_SHMEM_NVSHMEM_H
#define ROCMOE_SHMEM_NVSHMEM_H

#if !defined(ROCMOE_SHMEM_H)
#error "include rocmoe/shmem.h instead of rocmoe/shmem_nvshmem.h"
#endif
#if !defined(ROCMOE_PLATFORM_NVIDIA)
#error "the NVSHMEM facade needs an NVIDIA build (nvcc)"
#endif

#include <nvshmem.h>
#include <nvshmemx.h>

#define ROCMOE_SHMEM_VARIANT_NVSHMEM 1

#if defined(__CUDACC__)
namespace rocmoe {
namespace shmem {

/* NVSHMEM numbers its comparisons EQ, NE, GT, LE, LT, GE (not OpenSHMEM's order). */
__device__ __forceinline__ int nvshmem_cmp(int cmp) {
    switch (cmp) {
        case kCmpEq: return NVSHMEM_CMP_EQ;
        case kCmpNe: return NVSHMEM_CMP_NE;
        case kCmpGt: return NVSHMEM_CMP_GT;
        case kCmpGe: return NVSHMEM_CMP_GE;
        case kCmpLt: return NVSHMEM_CMP_LT;
        default: return NVSHMEM_CMP_LE;
    }
}

__device__ __forceinline__ unsigned wg_thread_id() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

/* NVSHMEM returns nullptr when pe's memory is not load/store reachable (another node). */
__device__ __forceinline__ void *peer_ptr(const Team &, const void *local_sym, int pe) {
    return nvshmem_ptr(local_sym, pe);
}

__device__ __forceinline__ void put_nbi_wg(const Team &, void *dst, const void *src, size_t n,
                                           int pe) {
    nvshmemx_putmem_nbi_block(dst, src, n, pe);
}

__device__ __forceinline__ void put_u64(const Team &, uint64_t *dst, uint64_t value, int pe) {
    nvshmem_uint64_p(dst, value, pe);
}

__device__ __forceinline__ void fence(const Team &) { nvshmem_fence(); }
__device__ __forceinline__ void quiet(const Team &) { nvshmem_quiet(); }

__device__ __forceinline__ void signal_set(const Team &, uint64_t *sig, uint64_t value, int pe) {
    nvshmem_fence();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
}

__device__ __forceinline__ void signal_add(const Team &, uint64_t *sig, uint64_t value, int pe) {
    nvshmem_fence();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_ADD, pe);
}

/* NVSHMEM's fused put-with-signal orders the data before the signal for the whole block. */
__device__ __forceinline__ void put_signal_nbi_wg(const Team &, void *dst, const void *src, size_t n,
                                                  uint64_t *sig, uint64_t value, int pe) {
    nvshmemx_putmem_signal_nbi_block(dst, src, n, sig, value, NVSHMEM_SIGNAL_SET, pe);
}

__device__ __forceinline__ uint64_t signal_fetch(const Team &, uint64_t *sig) {
    return nvshmem_signal_fetch(sig);
}

/* nvshmem_signal_wait_until has no timeout; poll nvshmem_uint64_test against the clock so
 * a missing signal becomes a reported status instead of a hung kernel. */
__device__ __forceinline__ int wait_until(const Team &team, uint64_t *sig, int cmp, uint64_t value,
                                          uint64_t timeout_ns, uint64_t *observed) {
    const uint64_t start = platform::device_time_ns();
    for (uint32_t spin = 0;; ++spin) {
        if (nvshmem_uint64_test(sig, nvshmem_cmp(cmp), value)) {
            if (observed) *observed = signal_fetch(team, sig);
            return kWaitOk;
        }
        if ((spin & 63u) == 63u && platform::device_time_ns() - start >= timeout_ns) {
            if (observed) *observed = signal_fetch(team, sig);
            return kWaitTimeout;
        }
        platform::relax();
    }
}

}  // namespace shmem
}  // namespace rocmoe
#endif

#endif /* ROCMOE_SHMEM_NVSHMEM_H */
