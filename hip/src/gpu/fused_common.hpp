// Device helpers shared by the fused-op kernels (fused_*.hip). Private to librocmoe.
//
// Element types travel as raw storage (float, or the 16-bit pattern of bf16 / fp16) and are
// converted to float for arithmetic, so the same kernels compile with hipcc and nvcc
// without the two platforms' different bf16 class headers; accumulation is always fp32.
#pragma once

#include "rocmoe/platform.h"
#include "rocmoe/rocmoe.h"
#include "rocmoe/schedule.h"
#include "rocmoe/shmem.h"

#if defined(ROCMOE_PLATFORM_AMD)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace rocmoe {
namespace fused {

constexpr int kThreads = 256;          // threads of a workgroup
constexpr int kWaves = kThreads / ROCMOE_WAVE_SIZE;

enum Status : int { kOk = 0, kTimedOut = 1 };

// --- element types ------------------------------------------------------------------
struct F32 {
    using storage = float;
    __device__ static float load(storage v) { return v; }
    __device__ static storage store(float f) { return f; }
};
struct BF16 {
    using storage = uint16_t;
    __device__ static float load(storage v) { return __uint_as_float(uint32_t(v) << 16); }
    __device__ static storage store(float f) {
        uint32_t u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(0x7fc0);  // NaN stays NaN
        u += 0x7fffu + ((u >> 16) & 1u);                                  // round to nearest even
        return uint16_t(u >> 16);
    }
};
struct F16 {
    using storage = uint16_t;
    __device__ static float load(storage v) { return __half2float(__ushort_as_half(v)); }
    __device__ static storage store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

// elements of T in one 16-byte vector
template <class T>
ROCMOE_HD constexpr int vec_elems() { return 16 / int(sizeof(typename T::storage)); }

// unpack a 16-byte vector into floats
template <class T>
__device__ __forceinline__ void unpack(const uint4 &v, float *out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    if constexpr (sizeof(typename T::storage) == 4) {
        for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
    } else {
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = T::load(uint16_t(w[i] & 0xffffu));
            out[2 * i + 1] = T::load(uint16_t(w[i] >> 16));
        }
    }
}

template <class T>
__device__ __forceinline__ uint4 pack(const float *in) {
    uint32_t w[4];
    if constexpr (sizeof(typename T::storage) == 4) {
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(in[i]);
    } else {
        for (int i = 0; i < 4; ++i)
            w[i] = uint32_t(T::store(in[2 * i])) | (uint32_t(T::store(in[2 * i + 1])) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// --- wave-level reduction -------------------------------------------------------------
__device__ __forceinline__ float shfl_down(float v, int offset) {
#if defined(ROCMOE_PLATFORM_AMD)
    return __shfl_down(v, offset);
#else
    return __shfl_down_sync(0xffffffffu, v, offset);
#endif
}

__device__ __forceinline__ float wave_sum(float v) {
    for (int off = ROCMOE_WAVE_SIZE / 2; off > 0; off >>= 1) v += shfl_down(v, off);
    return v;
}

// --- what every fused kernel gets ---------------------------------------------------
struct Common {
    shmem::Team team;
    sched::Topology topo;
    uint64_t epoch;
    uint64_t *slots;          // this rank's [3 * world] int64 slots (heap)
    uint32_t *counters;       // [2 + world]: next_task, exited, slice_done[world]
    int *status;              // [3 * world]
    uint64_t timeout_ns;
    int signal_enabled;

    ROCMOE_HD uint64_t *data_signal(int source) const { return slots + source; }
    ROCMOE_HD uint64_t *ack(int dest) const { return slots + topo.world + dest; }
    ROCMOE_HD uint64_t *phase2_signal(int owner) const { return slots + 2 * topo.world + owner; }
    ROCMOE_HD sched::Counters sched_counters() const {
        return sched::Counters{counters, counters + 1, counters + 2};
    }
};

// Per-workgroup record of destinations whose receive buffer is known free for this call
// (acknowledged call epoch - 2): checked once per destination, not once per task.
struct AckCache {
    uint64_t ready_mask;  // bit d: destination d (d < 64) already confirmed
};

// One thread (thread 0) calls: true when `dest` may be written in this call; false when the
// wait for its acknowledgement timed out (status recorded, nothing may be written).
__device__ __forceinline__ bool wait_dest_free(const Common &c, AckCache &cache, int dest) {
    if (!c.signal_enabled || c.epoch <= 2) return true;
    const uint64_t bit = dest < 64 ? (1ull << dest) : 0ull;
    if (bit && (cache.ready_mask & bit)) return true;
    uint64_t seen = 0;
    const int rc = shmem::wait_until(c.team, c.ack(dest), shmem::kCmpGe, c.epoch - 2,
                                     c.timeout_ns, &seen);
    if (rc != shmem::kWaitOk) {
        atomicExch(c.status + dest, int(kTimedOut));
        return false;
    }
    cache.ready_mask |= bit;
    return true;
}

// Consumer side: one thread per source waits until its slot reaches the epoch.
__global__ void wait_slots_kernel(shmem::Team team, uint64_t *slots, int count, uint64_t epoch,
                                  uint64_t timeout_ns, int *status);

// Launch the consumer wait on `stream` (count threads, one per slot).
int launch_wait(const Common &c, uint64_t *slots, int count, int *status, hipStream_t stream);

// Zero this call's status words ([3 * world] ints) on `stream`, right before the kernels:
// clearing them from Python left the host's remaining launch work between the memset and
// the first kernel, and the GPU idled through it.
int clear_status(const Common &c, hipStream_t stream);

// Persistent grid size: enough workgroups to keep every compute unit busy, not more than
// there are tasks (each surplus workgroup would only claim past the end and exit).
int persistent_workgroups(int requested, uint32_t total_tasks, int per_cu);

// Validate the team / fused arguments and fill `c`; returns ROCMOE_OK or a fail() code.
int make_common(const rocmoe_gpu_team &team, const rocmoe_gpu_fused &fused, const char *op,
                Common *c);

}  // namespace fused
}  // namespace rocmoe
