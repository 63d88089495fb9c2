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
#include "rocmoe/workspace.h"

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
// The handle's workspace (rocmoe/workspace.h) seen from this rank, the team, the status words.
struct Common {
    shmem::Team team;
    sched::Topology topo;
    rocmoe_workspace_layout layout;
    char *ws;                 // this rank's address of the workspace (heap)
    char *stage;              // scale-out staging (a receive buffer's layout per destination)
    int *status;              // host-mapped status words [layout.status_words]
    uint64_t timeout_ns;

    // this rank's address of a slot or buffer (the facade finds a peer's copy)
    __device__ uint64_t *word(uint64_t offset) const {
        return reinterpret_cast<uint64_t *>(ws + offset);
    }
    __device__ uint64_t *data_signal(int source) const { return word(ws::data_signal(layout, source)); }
    __device__ uint64_t *ack(int dest) const { return word(ws::ack(layout, dest)); }
    __device__ uint64_t *phase2_signal(int owner) const {
        return word(ws::phase2_signal(layout, owner));
    }
    __device__ uint64_t *count_slot(uint64_t epoch, int source) const {
        return word(ws::count_slot(layout, epoch, source));
    }
    __device__ char *recv(uint64_t epoch) const { return ws + ws::recv_buffer(layout, epoch); }
    __device__ uint64_t *epoch_word() const { return word(ws::epoch_word(layout)); }
    __device__ uint32_t *counters() const {
        return reinterpret_cast<uint32_t *>(ws + layout.counters);
    }
    __device__ sched::Counters sched_counters(int phase) const {
        uint32_t *c = counters();
        return sched::Counters{c + ws::next_task_counter(), c + ws::exited_counter(),
                               c + ws::slice_done_counter(topo.world, phase, 0)};
    }
    // this call's epoch: the last one stored, plus one (the kernel that starts a call)
    __device__ uint64_t next_epoch() const {
        return *reinterpret_cast<const volatile uint64_t *>(epoch_word()) + 1;
    }
    __device__ void record(uint32_t index, int code, uint64_t epoch) const {
        status[index] = code;
        status[ws::status_epoch(topo.world)] = int(epoch & 0x7fffffffu);
    }
};

// Per-workgroup record of destinations whose receive buffer is known free for this call
// (acknowledged call epoch - 2): checked once per destination, not once per task.
struct AckCache {
    uint64_t ready_mask;  // bit d: destination d (d < 64) already confirmed
};

// One thread (thread 0) calls: true when `dest` may be written in this call; false when the
// wait for its acknowledgement timed out (status recorded, nothing may be written).
__device__ __forceinline__ bool wait_dest_free(const Common &c, AckCache &cache, int dest,
                                               uint64_t epoch) {
    if (epoch <= 2) return true;
    const uint64_t bit = dest < 64 ? (1ull << dest) : 0ull;
    if (bit && (cache.ready_mask & bit)) return true;
    uint64_t seen = 0;
    const int rc = shmem::wait_until(c.team, c.ack(dest), shmem::kCmpGe, epoch - 2,
                                     c.timeout_ns, &seen);
    if (rc != shmem::kWaitOk) {
        c.record(ws::status_ack(c.topo.world, dest), ROCMOE_STATUS_TIMEOUT, epoch);
        return false;
    }
    cache.ready_mask |= bit;
    return true;
}

// One thread: the count that travels with the data, then the slice's signal (release at
// system scope, ordered after the count by the facade's fence).
__device__ __forceinline__ void deliver(const Common &c, int dest, uint64_t epoch, int64_t count,
                                        bool phase2 = false) {
    if (!phase2)
        shmem::put_u64(c.team, c.count_slot(epoch, c.topo.rank), uint64_t(count), dest);
    shmem::signal_set(c.team, phase2 ? c.phase2_signal(c.topo.rank) : c.data_signal(c.topo.rank),
                      epoch, dest);
}

// One thread: wait for source `s`'s delivery of this call and check its count; false (and
// a status word) when it timed out or says the source sent nothing usable.
__device__ __forceinline__ bool receive(const Common &c, int s, uint64_t epoch, int64_t capacity,
                                        int64_t expect, bool phase2 = false) {
    uint64_t seen = 0;
    uint64_t *slot = phase2 ? c.phase2_signal(s) : c.data_signal(s);
    const uint32_t where = phase2 ? ws::status_phase2(c.topo.world, s)
                                  : ws::status_data(c.topo.world, s);
    if (shmem::wait_until(c.team, slot, shmem::kCmpGe, epoch, c.timeout_ns, &seen) !=
        shmem::kWaitOk) {
        c.record(where, ROCMOE_STATUS_TIMEOUT, epoch);
        return false;
    }
    if (phase2) return true;
    const int64_t count = *reinterpret_cast<const volatile int64_t *>(c.count_slot(epoch, s));
    int status = ws::count_status(count, capacity);
    if (status == ROCMOE_STATUS_OK && expect >= 0 && count != expect) status = ROCMOE_STATUS_MISMATCH;
    if (status != ROCMOE_STATUS_OK) {
        c.record(where, status, epoch);
        return false;
    }
    return true;
}

// The call of a rank that rejected its input (rocmoe.h, "abort"): one thread.
__global__ void abort_kernel(Common c, int phase2);

// Copies `bytes` of this call's receive buffer to `out` (every workgroup a part), then the
// last workgroup out acknowledges every source: their next-but-one call may write again.
__global__ void copy_out_kernel(Common c, void *out, uint64_t bytes, uint64_t src_offset,
                                uint32_t workers);

// Launch the abort / copy-out kernels on `stream`.
int launch_abort(const Common &c, int phase2, hipStream_t stream);
int launch_copy_out(const Common &c, void *out, uint64_t bytes, uint64_t src_offset,
                    hipStream_t stream);

// Persistent grid size: enough workgroups to keep every compute unit busy, not more than
// there are tasks (each surplus workgroup would only claim past the end and exit).
int persistent_workgroups(int requested, uint32_t total_tasks, int per_cu);

// CUs (SMs) of the current device (80 when it cannot be read), looked up once
int compute_units();

// Workgroups of kThreads of `kernel` that fit on a compute unit together (`fallback` when the
// runtime cannot say). A grid-stride or statically split kernel is balanced only when its
// whole grid is resident at once: a grid of more leaves a second, partial round of
// workgroups running at a fraction of the occupancy.
template <class K>
int resident_per_cu(K kernel, size_t shared_bytes, int fallback) {
    int blocks = 0;
    if (hipOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, shared_bytes) !=
            hipSuccess ||
        blocks <= 0) {
        (void)hipGetLastError();  // not this call's error to report
        blocks = fallback;
    }
    return blocks;
}

// An integer tuning knob from the environment (`fallback` when unset or empty)
int env_int(const char *name, int fallback);

// Validate the team / fused arguments and fill `c`; returns ROCMOE_OK or a fail() code.
int make_common(const rocmoe_gpu_team &team, const rocmoe_gpu_fused &fused, int op_code,
                const char *op, Common *c);

}  // namespace fused
}  // namespace rocmoe
