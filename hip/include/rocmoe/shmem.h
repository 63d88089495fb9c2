/* rocmoe device communication facade: what every fused GPU kernel uses to reach peers.
 *
 * One API, three implementations, chosen at compile time:
 *   ROCMOE_SHMEM_IPC       (default) direct loads/stores through a device-side table of
 *                          peer heap bases (GPUs of one node: IPC-mapped device memory)
 *   ROCMOE_SHMEM_ROCSHMEM  rocSHMEM (AMD, multi-node): rocshmem_putmem_nbi_wg, ...
 *   ROCMOE_SHMEM_NVSHMEM   NVSHMEM (NVIDIA, multi-node): nvshmemx_putmem_nbi_block, ...
 *
 * Addresses follow the SHMEM convention: `dst` and signal addresses are *this rank's*
 * address of a symmetric object (its own heap); the facade finds the peer's copy.
 *
 * API (namespace rocmoe::shmem; `team` is a Team passed to the kernel by value):
 *   void *peer_ptr(team, local_sym, pe)   pe's address of local_sym for direct loads and
 *                                         stores, nullptr if pe is not directly reachable
 *   put_nbi_wg(team, dst, src, n, pe)     workgroup-collective copy of n bytes into pe's
 *                                         dst (every thread calls with the same arguments)
 *   put_u64(team, dst, v, pe)             one thread: a 64-bit value into pe's dst (ordered
 *                                         before a later signal_set by its fence)
 *   fence(team)                           orders this thread's earlier puts before later ones
 *   quiet(team)                           completes this thread's earlier puts
 *   signal_set(team, sig, v, pe)          one thread: fence, then a system-scope release
 *                                         store of v into pe's sig
 *   signal_add(team, sig, v, pe)          likewise, atomic add
 *   put_signal_nbi_wg(team, dst, src, n, sig, v, pe)
 *                                         workgroup-collective put, then (after every
 *                                         thread's stores are ordered) one signal_set
 *   wait_until(team, sig, cmp, v, timeout_ns, &observed)
 *                                         one thread: acquire-polls this rank's sig until
 *                                         `sig cmp v` holds; returns kWaitOk, or
 *                                         kWaitTimeout after timeout_ns of device time
 *                                         (the kernel reports it; nothing hangs)
 */
#ifndef ROCMOE_SHMEM_H
#define ROCMOE_SHMEM_H

#include "rocmoe/platform.h"

namespace rocmoe {
namespace shmem {

/* Same numbering as ROCMOE_CMP_* in rocmoe.h and as the SHMEM libraries' CMP enums. */
enum Cmp : int { kCmpEq = 0, kCmpNe = 1, kCmpGt = 2, kCmpGe = 3, kCmpLt = 4, kCmpLe = 5 };
enum WaitStatus : int { kWaitOk = 0, kWaitTimeout = 1 };

/* What a kernel needs to address peers; trivially copyable, passed by value. */
struct Team {
    void *const *peer_bases;  /* ipc: device table, [world] heap bases (own rank included);
                                 the SHMEM libraries translate addresses themselves */
    int rank;
    int world;
};

#if defined(__HIP__) || defined(__CUDACC__)
__device__ __forceinline__ bool compare(uint64_t a, int cmp, uint64_t b) {
    switch (cmp) {
        case kCmpEq: return a == b;
        case kCmpNe: return a != b;
        case kCmpGt: return a > b;
        case kCmpGe: return a >= b;
        case kCmpLt: return a < b;
        case kCmpLe: return a <= b;
        default: return false;
    }
}
#endif

}  // namespace shmem
}  // namespace rocmoe

/* ROCMOE_SHMEM_IPC wins over the build-wide choice: the ipc backend's own kernels always
 * store directly, whatever facade the fused ops of the same build use. */
#if defined(ROCMOE_SHMEM_IPC)
#include "rocmoe/shmem_ipc.h"
#elif defined(ROCMOE_SHMEM_NVSHMEM)
#include "rocmoe/shmem_nvshmem.h"
#elif defined(ROCMOE_SHMEM_ROCSHMEM)
#include "rocmoe/shmem_rocshmem.h"
#else
#include "rocmoe/shmem_ipc.h"
#endif

#endif /* ROCMOE_SHMEM_H */
