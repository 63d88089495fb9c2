// Shared pieces of the fused-op kernels: abort, copy-out and acknowledgement, grid sizing,
// argument checks.
#include "fused_common.hpp"

#include "../internal.hpp"

namespace rocmoe {
namespace fused {

__global__ void abort_kernel(Common c, int phase2) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t epoch = c.next_epoch();
    AckCache cache{0};
    for (int d = 0; d < c.topo.world; ++d) {
        // the count slot of this parity at d is free once d read call epoch - 2
        if (!wait_dest_free(c, cache, d, epoch)) continue;
        deliver(c, d, epoch, ROCMOE_COUNT_ABORTED);
        if (phase2) deliver(c, d, epoch, 0, true);
    }
    *c.epoch_word() = epoch;
    // nothing of this call will be read here: every source may reuse this buffer at once
    for (int s = 0; s < c.topo.world; ++s) shmem::signal_set(c.team, c.ack(c.topo.rank), epoch, s);
}

__global__ void copy_out_kernel(Common c, void *out, uint64_t bytes, uint64_t src_offset,
                                uint32_t workers) {
    __shared__ int s_last;
    // the producer kernel of this call advanced the epoch word already
    const uint64_t epoch = *reinterpret_cast<const volatile uint64_t *>(c.epoch_word());
    const char *src = c.recv(epoch) + src_offset;
    char *dst = static_cast<char *>(out);
    const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | bytes) & 15u) == 0) {
        for (uint64_t i = tid; i < bytes / 16; i += stride)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
    } else {
        for (uint64_t i = tid; i < bytes; i += stride) dst[i] = src[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const sched::Counters counters = c.sched_counters(0);
        s_last = sched::exit_worker(counters, workers) ? 1 : 0;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int s = threadIdx.x; s < c.topo.world; s += blockDim.x)
        shmem::signal_set(c.team, c.ack(c.topo.rank), epoch, s);
}

int launch_abort(const Common &c, int phase2, hipStream_t stream) {
    hipLaunchKernelGGL(abort_kernel, dim3(1), dim3(64), 0, stream, c, phase2);
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "launching the abort kernel: %s", hipGetErrorString(e));
    return ROCMOE_OK;
}

int launch_copy_out(const Common &c, void *out, uint64_t bytes, uint64_t src_offset,
                    hipStream_t stream) {
    const uint64_t per_block = uint64_t(kThreads) * 16 * 4;
    const int blocks = persistent_workgroups(0, uint32_t((bytes + per_block - 1) / per_block), 2);
    const int grid = blocks > 0 ? blocks : 1;
    hipLaunchKernelGGL(copy_out_kernel, dim3(grid), dim3(kThreads), 0, stream, c, out, bytes,
                       src_offset, uint32_t(grid));
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "launching the copy-out: %s", hipGetErrorString(e));
    return ROCMOE_OK;
}

int compute_units() {
    static int cus = [] {
        int device = 0, n = 0;
        if (hipGetDevice(&device) != hipSuccess ||
            hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess ||
            n <= 0)
            n = 80;
        return n;
    }();
    return cus;
}

int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return (v != nullptr && *v != '\0') ? atoi(v) : fallback;
}

int persistent_workgroups(int requested, uint32_t total_tasks, int per_cu) {
    if (requested > 0) return int(requested < int(total_tasks) ? requested : int(total_tasks));
    const long want = long(compute_units()) * per_cu;
    return int(want < long(total_tasks) ? want : long(total_tasks));
}

int make_common(const rocmoe_gpu_team &team, const rocmoe_gpu_fused &fused, int op_code,
                const char *op, Common *c) {
    if (team.world < 1 || team.rank < 0 || team.rank >= team.world)
        return fail(ROCMOE_ERR_INVALID, "%s: rank %d / world %d is not a valid team", op,
                    team.rank, team.world);
    if (team.peer_bases == nullptr || fused.workspace == nullptr || fused.status == nullptr)
        return fail(ROCMOE_ERR_INVALID, "%s: peer table, workspace and status must be set", op);
    if (fused.layout.op != op_code || fused.layout.world != team.world)
        return fail(ROCMOE_ERR_INVALID, "%s: the workspace layout is for op %d of %d ranks", op,
                    fused.layout.op, fused.layout.world);
    if ((reinterpret_cast<uintptr_t>(fused.workspace) & 255u) != 0)
        return fail(ROCMOE_ERR_INVALID, "%s: the workspace must be 256-byte aligned", op);
    c->team.peer_bases = static_cast<void *const *>(team.peer_bases);
    c->team.rank = team.rank;
    c->team.world = team.world;
    c->topo.rank = team.rank;
    c->topo.world = team.world;
    c->topo.ranks_per_node = team.ranks_per_node > 0 ? team.ranks_per_node : team.world;
    c->layout = fused.layout;
    c->ws = static_cast<char *>(fused.workspace);
    c->stage = static_cast<char *>(fused.stage);
    c->status = fused.status;
    const double t = fused.timeout_s > 0 ? fused.timeout_s : 60.0;
    c->timeout_ns = uint64_t(t * 1e9);
    return ROCMOE_OK;
}

}  // namespace fused
}  // namespace rocmoe
