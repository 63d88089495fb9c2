/* The symmetric workspace of one fused-op handle: accessors of rocmoe_workspace_layout.
 *
 * The layout itself is a C struct of rocmoe.h (so cffi sees it and Python reads offsets from
 * librocmoe instead of recomputing them); rocmoe_workspace_layout_init (hip/src/workspace.cpp)
 * fills it. These __host__ __device__ helpers are what the host backend and the HIP kernels
 * use to find a slot; the Triton launchers pass the same offsets as kernel arguments.
 *
 *   offset (bytes from the workspace's start; every rank allocates the workspace with the
 *   same heap offset, so a peer's copy of anything is at the same offset in its heap)
 *   data_signals    uint64 [world]       by source s: the epoch s's data of that call is in
 *   acks            uint64 [world]       by destination d: the epoch d finished reading
 *   phase2_signals  uint64 [world]       by owner o (GEMV all-gather): o's chunk of y is in
 *   counts          int64 [2][world]     by parity p and source s: what s sent in the call
 *                                        of parity p (rows / global batch / ROCMOE_COUNT_*)
 *   local           uint64 epoch, then uint32 counters [counter_words] (never read by peers)
 *   recv            2 x parity_bytes     receive buffers, call e uses buffer e % 2
 *
 * Counters (uint32, self-resetting like schedule.h's): [0] next task, [1] workers exited,
 * [2, 2 + world) slice done (phase 1), [2 + world, 2 + 2 world) slice done (phase 2),
 * [2 + 2 world] phase-1 tasks done (GEMV), [3 + 2 world, 3 + 3 world) bad-input flag of the
 * slice for each destination.
 *
 * Status words (int32 [status_words], host-mapped on GPUs): [0, world) the data from source
 * s, [world, 2 world) the acknowledgement of destination d, [2 world, 3 world) phase 2 from
 * owner o, [3 world] this rank's own input (ROCMOE_STATUS_BAD_INPUT), [3 world + 1] the
 * epoch of the first problem (low 31 bits). Values are ROCMOE_STATUS_*.
 */
#ifndef ROCMOE_WORKSPACE_H
#define ROCMOE_WORKSPACE_H

#include <stdint.h>

#include "rocmoe/rocmoe.h"
#include "rocmoe/schedule.h" /* ROCMOE_HD */

namespace rocmoe {
namespace ws {

constexpr uint64_t kAlign = 256;

ROCMOE_HD inline uint64_t counter_words(int32_t world) { return 3u + 3u * uint64_t(world); }
ROCMOE_HD inline uint64_t status_words(int32_t world) { return 3u * uint64_t(world) + 2u; }

/* byte offsets from the workspace's start */
ROCMOE_HD inline uint64_t data_signal(const rocmoe_workspace_layout &l, int32_t source) {
    return l.data_signals + 8u * uint64_t(source);
}
ROCMOE_HD inline uint64_t ack(const rocmoe_workspace_layout &l, int32_t dest) {
    return l.acks + 8u * uint64_t(dest);
}
ROCMOE_HD inline uint64_t phase2_signal(const rocmoe_workspace_layout &l, int32_t owner) {
    return l.phase2_signals + 8u * uint64_t(owner);
}
ROCMOE_HD inline uint32_t parity(uint64_t epoch) { return uint32_t(epoch & 1u); }
ROCMOE_HD inline uint64_t count_slot(const rocmoe_workspace_layout &l, uint64_t epoch,
                                     int32_t source) {
    return l.counts + 8u * (uint64_t(parity(epoch)) * uint64_t(l.world) + uint64_t(source));
}
ROCMOE_HD inline uint64_t epoch_word(const rocmoe_workspace_layout &l) { return l.local; }
ROCMOE_HD inline uint64_t recv_buffer(const rocmoe_workspace_layout &l, uint64_t epoch) {
    return l.recv + uint64_t(parity(epoch)) * l.parity_bytes;
}
/* GEMM: source s's rows inside buffer e % 2 (fixed stride: s writes without knowing what
 * the other sources send) */
ROCMOE_HD inline uint64_t source_region(const rocmoe_workspace_layout &l, uint64_t epoch,
                                        int32_t source) {
    return recv_buffer(l, epoch) + uint64_t(source) * l.source_bytes;
}

/* counters, as indices into the uint32 array at l.counters */
ROCMOE_HD inline uint32_t next_task_counter() { return 0; }
ROCMOE_HD inline uint32_t exited_counter() { return 1; }
ROCMOE_HD inline uint32_t slice_done_counter(int32_t world, int32_t phase, int32_t dest) {
    return 2u + uint32_t(phase) * uint32_t(world) + uint32_t(dest);
}
ROCMOE_HD inline uint32_t phase1_done_counter(int32_t world) { return 2u + 2u * uint32_t(world); }
ROCMOE_HD inline uint32_t bad_input_counter(int32_t world, int32_t dest) {
    return 3u + 2u * uint32_t(world) + uint32_t(dest);
}

/* status words */
ROCMOE_HD inline uint32_t status_data(int32_t, int32_t source) { return uint32_t(source); }
ROCMOE_HD inline uint32_t status_ack(int32_t world, int32_t dest) { return uint32_t(world + dest); }
ROCMOE_HD inline uint32_t status_phase2(int32_t world, int32_t owner) {
    return uint32_t(2 * world + owner);
}
ROCMOE_HD inline uint32_t status_own(int32_t world) { return uint32_t(3 * world); }
ROCMOE_HD inline uint32_t status_epoch(int32_t world) { return uint32_t(3 * world + 1); }

/* what a consumer records for a source's count (ROCMOE_STATUS_*) */
ROCMOE_HD inline int32_t count_status(int64_t count, int64_t capacity) {
    if (count == ROCMOE_COUNT_ABORTED) return ROCMOE_STATUS_PEER_ABORTED;
    if (count == ROCMOE_COUNT_BAD_INPUT) return ROCMOE_STATUS_PEER_BAD_INPUT;
    if (count < 0 || count > capacity) return ROCMOE_STATUS_BAD_COUNT;
    return ROCMOE_STATUS_OK;
}

}  // namespace ws
}  // namespace rocmoe

#ifdef __cplusplus
static_assert(sizeof(rocmoe_workspace_layout) == 144, "rocmoe_workspace_layout changed size: "
              "update rocmoe/ops/_common.py's check and the Triton launchers");
#endif

#endif /* ROCMOE_WORKSPACE_H */
