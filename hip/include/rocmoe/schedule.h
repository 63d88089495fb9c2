/* rocmoe persistent-kernel schedule, shared by the GPU kernels and the host backend.
 *
 * One fused op = one persistent "kernel": a fixed set of workers (GPU workgroups, or host
 * worker threads) that pull tasks from an atomic counter until none are left.
 *
 *   slice  the unit that is *sent*: this rank's part of the output bound for one
 *          destination rank. There is exactly one slice per destination (world slices),
 *          also when it holds no rows: an empty slice still gets one task, so its signal is
 *          still raised and the receiver never waits for data that will not come.
 *   task   the unit a worker computes: one tile of one slice (what a tile is, is the op's
 *          business; the schedule only numbers them 0..tiles-1 inside the slice).
 *
 * Order: slices are laid out remote-first (ranks on other nodes, then other ranks of this
 * node, then this rank itself), and task numbers follow that layout, so the atomic counter
 * hands out the work whose data has the longest way to travel first. Inside each class the
 * order is rotated to start just after this rank, so that the ranks do not all target the
 * same destination at the same moment.
 *
 * Completion: every finished task increments its slice's done counter; the worker whose
 * increment completes the slice (old + 1 == tiles) is the one that issues the slice's put
 * (scale-out) and its signal (always). Exactly one worker completes each slice.
 *
 * Signals: uint64 epochs. Every call of an op increments the op's epoch (1, 2, 3, ...);
 * the producer stores `signal_value(epoch)` with release semantics at system scope after
 * the data; the consumer waits until `signal_ready(observed, epoch)`. Slots are never
 * re-zeroed: a value left over from call e-1 is < e and so is simply not ready.
 *
 * Counters (next_task, workers_exited, slice_done[]) are self-resetting: the worker that
 * completes a slice zeroes that slice's counter, and the last worker to exit zeroes the
 * task counter and the exit counter. A GPU kernel can therefore keep them in device memory
 * across launches without a memset (kernel boundaries order the resets before the next
 * launch); the host backend simply keeps fresh ones per call.
 *
 * Everything here is `__host__ __device__` (ROCMOE_HD) and header-only; it compiles as
 * plain C++17 (g++/clang), as HIP (hipcc) and as CUDA (nvcc).
 */
#ifndef ROCMOE_SCHEDULE_H
#define ROCMOE_SCHEDULE_H

#include <stdint.h>

#if defined(__HIPCC__) && !defined(__CUDACC__)
#include <hip/hip_runtime.h> /* atomicAdd, __threadfence in device code */
#endif

#if defined(__HIPCC__) || defined(__CUDACC__)
#define ROCMOE_HD __host__ __device__
#else
#define ROCMOE_HD
#endif

/* true while compiling device code (either platform) */
#if defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__)
#define ROCMOE_DEVICE_PASS 1
#else
#define ROCMOE_DEVICE_PASS 0
#endif

namespace rocmoe {
namespace sched {

/* ---------------------------------------------------------------------------------------
 * Topology: which destinations are on another node. Ranks are placed in node blocks
 * (ranks [n*ranks_per_node, (n+1)*ranks_per_node) share node n), which is what mpiexec and
 * srun do by default; the last node may hold fewer ranks.
 * ------------------------------------------------------------------------------------- */
struct Topology {
    int32_t rank;
    int32_t world;
    int32_t ranks_per_node;  /* >= 1; world (or more) means "one node" */
};

enum SliceClass : int32_t {
    kOtherNode = 0,   /* scale-out: leaves the node */
    kSameNode = 1,    /* scale-up: another GPU / process of this node */
    kSelf = 2         /* this rank's own part */
};

ROCMOE_HD inline int32_t node_of(const Topology &t, int32_t r) {
    return t.ranks_per_node > 0 ? r / t.ranks_per_node : 0;
}

ROCMOE_HD inline int32_t node_begin(const Topology &t) {
    return node_of(t, t.rank) * (t.ranks_per_node > 0 ? t.ranks_per_node : t.world);
}

/* number of ranks on this rank's node (the last node may be partial) */
ROCMOE_HD inline int32_t node_size(const Topology &t) {
    const int32_t begin = node_begin(t);
    const int32_t per = t.ranks_per_node > 0 ? t.ranks_per_node : t.world;
    const int32_t end = begin + per < t.world ? begin + per : t.world;
    return end - begin;
}

ROCMOE_HD inline SliceClass slice_class(const Topology &t, int32_t dest) {
    if (dest == t.rank) return kSelf;
    return node_of(t, dest) == node_of(t, t.rank) ? kSameNode : kOtherNode;
}

/* The destination rank at order position `pos` (0 .. world-1). Closed form, O(1), so a GPU
 * thread can compute it without a table:
 *   [0, world - node_size)        other nodes, starting at the node after this one
 *   [world - node_size, world-1)  same-node peers, starting at rank + 1
 *   world - 1                     this rank                                              */
ROCMOE_HD inline int32_t slice_at(const Topology &t, int32_t pos) {
    const int32_t local = node_size(t);
    const int32_t begin = node_begin(t);
    const int32_t remote = t.world - local;
    if (pos < remote) return (begin + local + pos) % t.world;  /* skips this node's block */
    if (pos < t.world - 1) {
        const int32_t j = pos - remote;
        return begin + (t.rank - begin + 1 + j) % local;
    }
    return t.rank;
}

/* inverse of slice_at */
ROCMOE_HD inline int32_t position_of(const Topology &t, int32_t dest) {
    const int32_t local = node_size(t);
    const int32_t begin = node_begin(t);
    const int32_t remote = t.world - local;
    if (dest == t.rank) return t.world - 1;
    if (dest >= begin && dest < begin + local)
        return remote + (dest - t.rank - 1 + 2 * local) % local;
    return (dest - (begin + local) + 2 * t.world) % t.world;
}

/* ---------------------------------------------------------------------------------------
 * Plan: how many tasks each slice has, laid out in order positions.
 * ------------------------------------------------------------------------------------- */

/* tiles of `rows` rows, `tile_rows` each; an empty slice still has one (signal-only) task */
ROCMOE_HD inline uint32_t tasks_for_rows(uint64_t rows, uint64_t tile_rows) {
    if (tile_rows == 0) tile_rows = 1;
    const uint64_t n = (rows + tile_rows - 1) / tile_rows;
    return n == 0 ? 1u : static_cast<uint32_t>(n);
}

/* task_prefix[p] = first task number of the slice at order position p; task_prefix[world] =
 * total number of tasks. tasks_per_dest is indexed by destination rank (each entry >= 1;
 * 0 is treated as 1). Returns the total. */
ROCMOE_HD inline uint32_t build_task_prefix(const Topology &t, const uint32_t *tasks_per_dest,
                                            uint32_t *task_prefix) {
    uint32_t total = 0;
    for (int32_t p = 0; p < t.world; ++p) {
        task_prefix[p] = total;
        const uint32_t n = tasks_per_dest[slice_at(t, p)];
        total += n == 0 ? 1u : n;
    }
    task_prefix[t.world] = total;
    return total;
}

struct Plan {
    Topology topo;
    uint32_t total_tasks;
    const uint32_t *task_prefix;  /* world + 1 entries, by order position */
};

struct Task {
    int32_t dest;      /* destination rank of the slice */
    int32_t position;  /* order position of the slice */
    uint32_t tile;     /* tile index inside the slice, 0 .. tiles-1 */
    uint32_t tiles;    /* tasks of this slice */
};

/* Task number -> (slice, tile). False when `id` is past the end (the worker is done). */
ROCMOE_HD inline bool locate(const Plan &plan, uint32_t id, Task *out) {
    if (id >= plan.total_tasks) return false;
    int32_t lo = 0, hi = plan.topo.world - 1;  /* last p with prefix[p] <= id */
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (plan.task_prefix[mid] <= id) lo = mid;
        else hi = mid - 1;
    }
    out->position = lo;
    out->dest = slice_at(plan.topo, lo);
    out->tile = id - plan.task_prefix[lo];
    out->tiles = plan.task_prefix[lo + 1] - plan.task_prefix[lo];
    return true;
}

/* row range [begin, end) of `tile` when a slice of `rows` rows is cut in `tile_rows` tiles */
ROCMOE_HD inline uint64_t tile_begin(uint64_t tile, uint64_t tile_rows, uint64_t rows) {
    const uint64_t b = tile * tile_rows;
    return b < rows ? b : rows;
}
ROCMOE_HD inline uint64_t tile_end(uint64_t tile, uint64_t tile_rows, uint64_t rows) {
    return tile_begin(tile + 1, tile_rows, rows);
}

/* ---------------------------------------------------------------------------------------
 * Atomics and fences at the scope the schedule needs (device scope on GPUs, process on
 * the host). Cross-rank visibility of data and signals is the facade's job (shmem.h on
 * GPUs, the host backend's release store) — these only order workers of one rank.
 * ------------------------------------------------------------------------------------- */
ROCMOE_HD inline uint32_t atomic_add_u32(uint32_t *p, uint32_t v) {
#if ROCMOE_DEVICE_PASS
    return atomicAdd(p, v);
#else
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

ROCMOE_HD inline void atomic_store_u32(uint32_t *p, uint32_t v) {
#if ROCMOE_DEVICE_PASS
    atomicExch(p, v);
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/* orders this worker's tile stores before its done-counter increment (release side) and
 * the completer's reads of other workers' tiles after it (acquire side) */
ROCMOE_HD inline void worker_fence() {
#if ROCMOE_DEVICE_PASS
    __threadfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Per-kernel counters; all start at zero and are left at zero by the schedule itself. */
struct Counters {
    uint32_t *next_task;       /* 1 slot */
    uint32_t *workers_exited;  /* 1 slot */
    uint32_t *slice_done;      /* world slots, indexed by destination rank */
};

/* next task number for this worker (one thread of a workgroup calls it and broadcasts) */
ROCMOE_HD inline uint32_t claim(const Counters &c) { return atomic_add_u32(c.next_task, 1u); }

/* Call after the task's tile is written (and, for per-tile puts, issued). True for exactly
 * one task of each slice: that worker must now issue the slice's put (if the op puts whole
 * slices) and its signal. The slice counter is re-zeroed here for the next launch. */
ROCMOE_HD inline bool complete(const Counters &c, const Task &task) {
    worker_fence();
    const uint32_t before = atomic_add_u32(&c.slice_done[task.dest], 1u);
    if (before + 1 != task.tiles) return false;
    worker_fence();
    atomic_store_u32(&c.slice_done[task.dest], 0u);
    return true;
}

/* Call once per worker after claim() returned a number past the end. True for the last of
 * `workers` workers, which has re-zeroed the task and exit counters. */
ROCMOE_HD inline bool exit_worker(const Counters &c, uint32_t workers) {
    const uint32_t before = atomic_add_u32(c.workers_exited, 1u);
    if (before + 1 != workers) return false;
    atomic_store_u32(c.next_task, 0u);
    atomic_store_u32(c.workers_exited, 0u);
    return true;
}

/* ---------------------------------------------------------------------------------------
 * Epoch signals
 * ------------------------------------------------------------------------------------- */
ROCMOE_HD inline uint64_t signal_value(uint64_t epoch) { return epoch; }
ROCMOE_HD inline bool signal_ready(uint64_t observed, uint64_t epoch) { return observed >= epoch; }

/* ---------------------------------------------------------------------------------------
 * The worker loop, for a worker that is a single thread (host backend, unit tests). A GPU
 * kernel runs the same steps with claim/complete done by one lane and the task broadcast
 * through shared memory:
 *
 *   for (;;) { id = claim(c); if (!locate(plan, id, &t)) break;
 *              compute(t); if (complete(c, t)) finish_slice(t); }
 *   exit_worker(c, workers);
 *
 * `compute(task)` returns false to abandon the kernel (an error was recorded): the worker
 * then stops claiming; the op reports the error and does not signal the unfinished slices.
 * ------------------------------------------------------------------------------------- */
template <class Compute, class FinishSlice>
ROCMOE_HD inline void run_worker(const Plan &plan, const Counters &c, uint32_t workers,
                                 Compute &&compute, FinishSlice &&finish_slice,
                                 const volatile int *abort_flag = nullptr) {
    Task task;
    for (;;) {
        if (abort_flag != nullptr && *abort_flag) break;
        if (!locate(plan, claim(c), &task)) break;
        if (!compute(task)) break;
        if (complete(c, task) && !finish_slice(task)) break;
    }
    exit_worker(c, workers);
}

/* Balanced split of `n` items over `parts` owners: owner i gets [split_begin(i), split_begin(i+1)).
 * gemv_all_reduce uses it for the reduce-scatter chunks. */
ROCMOE_HD inline int64_t split_begin(int64_t n, int32_t parts, int32_t i) {
    /* floor(n * i / parts) without the overflow of n * i */
    return (n / parts) * i + ((n % parts) * i) / parts;
}

/* ---------------------------------------------------------------------------------------
 * Workspace layouts of the three fused ops. Every rank allocates the same symmetric receive
 * buffer and signal array (rocmoe.ops keeps one per context and op, grown collectively), so
 * the GPU kernels and the host backend must agree on where things are. Signal slots hold
 * epochs and are indexed by the rank that writes them.
 *
 *   embedding_all_to_all  recv: [batch/world, total_tables, dim] of dtype (the output)
 *                         slots: [world] "source s has delivered its tables' columns"
 *   gemv_all_reduce       recv: partials [world][n] fp32 at 0 (source s's partial of every
 *                         row; the two-phase kernel and the host backend use the first
 *                         chunk_max of each: this rank's chunk), then result [n] of dtype at
 *                         gemv_result_offset; at world size 1 the direct kernels write y
 *                         straight to the caller's output and the balanced split
 *                         (fused_gemv.hip, ROCMOE_GEMV_BALANCE=1) keeps one uint64 slot a
 *                         wave at the start of recv (zeroed with the workspace and left
 *                         zero by every call; at most n slots: 8n bytes of the 12n or more
 *                         that the two receive buffers hold)
 *                         slots: [0, world) partial from source s is in;
 *                                [world, 2 world) owner s's reduced chunk is in
 *   gemm_all_to_all       recv: [recv_rows, n] of dtype, sources in rank order
 *                         slots: [world] "source s has delivered its rows"
 * ------------------------------------------------------------------------------------- */
constexpr uint64_t kWorkspaceAlign = 256;

ROCMOE_HD inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

ROCMOE_HD inline int64_t gemv_chunk_max(int64_t n, int32_t world) {
    return (n + world - 1) / world;
}

ROCMOE_HD inline uint64_t gemv_result_offset(int64_t n, int32_t world) {
    // room for the one-shot kernel's full partials from every source (fused_gemv.hip)
    return align_up(static_cast<uint64_t>(world) * static_cast<uint64_t>(n) * 4u, kWorkspaceAlign);
}

}  // namespace sched
}  // namespace rocmoe

#endif /* ROCMOE_SCHEDULE_H */
