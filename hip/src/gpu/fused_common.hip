// Shared pieces of the fused-op kernels: consumer waits, grid sizing, argument checks.
#include "fused_common.hpp"

#include "../internal.hpp"

namespace rocmoe {
namespace fused {

__global__ void wait_slots_kernel(shmem::Team team, uint64_t *slots, int count, uint64_t epoch,
                                  uint64_t timeout_ns, int *status) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    uint64_t seen = 0;
    if (shmem::wait_until(team, slots + i, shmem::kCmpGe, epoch, timeout_ns, &seen) !=
        shmem::kWaitOk)
        status[i] = kTimedOut;
}

int launch_wait(const Common &c, uint64_t *slots, int count, int *status, hipStream_t stream) {
    const int threads = 64;
    const int blocks = (count + threads - 1) / threads;
    hipLaunchKernelGGL(wait_slots_kernel, dim3(blocks), dim3(threads), 0, stream, c.team, slots,
                       count, c.epoch, c.timeout_ns, status);
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "launching the signal wait: %s", hipGetErrorString(e));
    return ROCMOE_OK;
}

int clear_status(const Common &c, hipStream_t stream) {
    const hipError_t e = hipMemsetAsync(c.status, 0, sizeof(int) * 3 * size_t(c.topo.world), stream);
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "clearing the status words: %s", hipGetErrorString(e));
    return ROCMOE_OK;
}

int persistent_workgroups(int requested, uint32_t total_tasks, int per_cu) {
    if (requested > 0) return int(requested < int(total_tasks) ? requested : int(total_tasks));
    int device = 0, cus = 0;
    if (hipGetDevice(&device) != hipSuccess ||
        hipDeviceGetAttribute(&cus, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess ||
        cus <= 0)
        cus = 80;
    const long want = long(cus) * per_cu;
    return int(want < long(total_tasks) ? want : long(total_tasks));
}

int make_common(const rocmoe_gpu_team &team, const rocmoe_gpu_fused &fused, const char *op,
                Common *c) {
    if (team.world < 1 || team.rank < 0 || team.rank >= team.world)
        return fail(ROCMOE_ERR_INVALID, "%s: rank %d / world %d is not a valid team", op,
                    team.rank, team.world);
    if (team.peer_bases == nullptr || fused.slots == nullptr || fused.recv == nullptr ||
        fused.counters == nullptr || fused.status == nullptr)
        return fail(ROCMOE_ERR_INVALID,
                    "%s: peer table, slots, receive buffer, counters and status must be set", op);
    if (fused.epoch == 0)
        return fail(ROCMOE_ERR_INVALID, "%s: epochs start at 1 (0 is what fresh slots hold)", op);
    if ((reinterpret_cast<uintptr_t>(fused.slots) & 7u) != 0)
        return fail(ROCMOE_ERR_INVALID, "%s: signal slots must be 8-byte aligned", op);
    c->team.peer_bases = static_cast<void *const *>(team.peer_bases);
    c->team.rank = team.rank;
    c->team.world = team.world;
    c->topo.rank = team.rank;
    c->topo.world = team.world;
    c->topo.ranks_per_node = team.ranks_per_node > 0 ? team.ranks_per_node : team.world;
    c->epoch = fused.epoch;
    c->slots = static_cast<uint64_t *>(fused.slots);
    c->counters = static_cast<uint32_t *>(fused.counters);
    c->status = fused.status;
    const double t = fused.timeout_s > 0 ? fused.timeout_s : 60.0;
    c->timeout_ns = uint64_t(t * 1e9);
    c->signal_enabled = fused.signal_enabled;
    return ROCMOE_OK;
}

}  // namespace fused
}  // namespace rocmoe
