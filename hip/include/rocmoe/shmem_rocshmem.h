/* shmem facade, rocSHMEM variant (AMD, multi-node). Include rocmoe/shmem.h, not this.
 *
 * Written against rocSHMEM's public headers (<rocshmem/rocshmem.hpp>, namespace rocshmem,
 * ROCm >= 6.4): rocshmem_putmem_nbi_wg, rocshmem_putmem_signal_nbi_wg,
 * rocshmem_uint64_atomic_set/_add, rocshmem_signal_fetch, rocshmem_uint64_test,
 * rocshmem_fence, rocshmem_quiet. Build with -fgpu-rdc and link with --hip-link: rocSHMEM
 * is a static device library. rocSHMEM has no device-side rocshmem_ptr, so peer_ptr uses
 * the Team's table when the host filled it (rocshmem_ptr on the host) and is nullptr
 * otherwise. */
#ifndef ROCMOE_SHMEM_ROCSHMEM_H
#define ROCMOE_SHMEM_ROCSHMEM_H

#if !defined(ROCMOE_SHMEM_H)
#error "include rocmoe/shmem.h instead of rocmoe/shmem_rocshmem.h"
#endif
#if !defined(ROCMOE_PLATFORM_AMD)
#error "the rocSHMEM facade needs an AMD build (hipcc)"
#endif

#include <rocshmem/rocshmem.hpp>

#define ROCMOE_SHMEM_VARIANT_ROCSHMEM 1

#if defined(__HIP__)
namespace rocmoe {
namespace shmem {

static_assert(static_cast<int>(rocshmem::ROCSHMEM_CMP_EQ) == kCmpEq &&
                  static_cast<int>(rocshmem::ROCSHMEM_CMP_GE) == kCmpGe &&
                  static_cast<int>(rocshmem::ROCSHMEM_CMP_LE) == kCmpLe,
              "rocmoe's comparison numbering must match rocSHMEM's");

__device__ __forceinline__ unsigned wg_thread_id() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ void *peer_ptr(const Team &team, const void *local_sym, int pe) {
    if (team.peer_bases == nullptr || team.peer_bases[pe] == nullptr) return nullptr;
    const char *my_base = static_cast<const char *>(team.peer_bases[team.rank]);
    const size_t offset = static_cast<size_t>(static_cast<const char *>(local_sym) - my_base);
    return static_cast<char *>(team.peer_bases[pe]) + offset;
}

__device__ __forceinline__ void put_nbi_wg(const Team &, void *dst, const void *src, size_t n,
                                           int pe) {
    rocshmem::rocshmem_putmem_nbi_wg(dst, src, n, pe);
}

__device__ __forceinline__ void put_u64(const Team &, uint64_t *dst, uint64_t value, int pe) {
    rocshmem::rocshmem_ulonglong_p(reinterpret_cast<unsigned long long *>(dst),
                                   static_cast<unsigned long long>(value), pe);
}

__device__ __forceinline__ void fence(const Team &) { rocshmem::rocshmem_fence(); }
__device__ __forceinline__ void quiet(const Team &) { rocshmem::rocshmem_quiet(); }

__device__ __forceinline__ void signal_set(const Team &, uint64_t *sig, uint64_t value, int pe) {
    rocshmem::rocshmem_fence();
    rocshmem::rocshmem_uint64_atomic_set(sig, value, pe);
}

__device__ __forceinline__ void signal_add(const Team &, uint64_t *sig, uint64_t value, int pe) {
    rocshmem::rocshmem_fence();
    rocshmem::rocshmem_uint64_atomic_add(sig, value, pe);
}

__device__ __forceinline__ void put_signal_nbi_wg(const Team &, void *dst, const void *src, size_t n,
                                                  uint64_t *sig, uint64_t value, int pe) {
    rocshmem::rocshmem_putmem_signal_nbi_wg(dst, src, n, sig, value, rocshmem::ROCSHMEM_SIGNAL_SET,
                                            pe);
}

__device__ __forceinline__ uint64_t signal_fetch(const Team &, uint64_t *sig) {
    return rocshmem::rocshmem_signal_fetch(sig);
}

/* rocshmem_uint64_wait_until has no timeout; poll rocshmem_uint64_test against the clock. */
__device__ __forceinline__ int wait_until(const Team &team, uint64_t *sig, int cmp, uint64_t value,
                                          uint64_t timeout_ns, uint64_t *observed) {
    const uint64_t start = platform::device_time_ns();
    for (uint32_t spin = 0;; ++spin) {
        if (rocshmem::rocshmem_uint64_test(sig, cmp, value)) {
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

#endif /* ROCMOE_SHMEM_ROCSHMEM_H */
