// Fused GEMV + AllReduce: y = sum_r W_r x_r, two-phase direct all-reduce.
//
// One persistent kernel runs the three phases (one launch: separate phase-2, wait, copy and
// ack launches cost ~25 us on a 0.14 ms GEMV on an H200, most of the gap to torch's matvec).
// Phase 1 (reduce-scatter by stores), on the schedule:
//   slice  owner o: rows [split_begin(N, world, o), split_begin(N, world, o + 1)) of the
//          partial product W_r x_r; they are stored as fp32 straight into o's receive
//          buffer at partials[r][row - chunk begin]
//   task   rows_per_tile rows (32 by default); one wave computes one row's dot product at a time
// Phase 2 (all-gather by stores), the task numbers after phase 1's:
//   each workgroup first waits (bounded) for every rank's phase-1 signal of this rank's
//   chunk, then for each destination d and tile of kReduceTile rows sums the partials in
//   rank order (so every rank gets bit-identical y) and stores the tile, converted to the
//   op's dtype, into d's receive buffer at gather_offset; the slice completer signals d.
// Phase 3 (the last workgroup out): wait for every owner's phase-2 signal; when the caller
//   passes `out`, copy y out of the receive buffer into it and acknowledge every peer (its
//   next-but-one call may reuse this buffer).
//
// The handle protocol (rocmoe.h): the epoch comes from the workspace (the last workgroup out
// advances it), phase-1 deliveries carry a count (N; a rank that rejected its input sends
// ROCMOE_COUNT_ABORTED instead), and writes into a destination wait for its acknowledgement
// of call epoch - 2. At world size 1 there is no one to reduce with: phase 1 writes y itself.
//
// Bandwidth: phase 1 reads W once with read-only 16-byte loads, kUnroll in flight per lane;
// x (K_r elements) stays in the caches. Phase 2 moves N * world floats, negligible next to W.
#include "fused_common.hpp"

#include "../internal.hpp"

#include <cstdlib>

namespace rocmoe {
namespace fused {
namespace {

constexpr int kDefaultRowsPerTile = 32;
constexpr int kReduceTile = 2048;

struct GemvParams {
    const void *w;
    const void *x;
    int64_t n, k;
    int64_t chunk_stride;     // ceil(n / world): floats per source in the partials area
    uint64_t gather_offset;   // bytes
    uint64_t rows_per_tile;   // rows of a phase-1 task
};

// Read-only loads: W and x are not written while the kernel runs, so the non-coherent
// path (ld.global.nc on NVIDIA) may serve them.
__device__ __forceinline__ uint4 load_ro(const uint4 *p) {
#if defined(ROCMOE_PLATFORM_IS_CUDA)
    return __ldg(p);
#else
    return *p;
#endif
}

__device__ __forceinline__ int64_t chunk_begin(const GemvParams &p, int world, int o) {
    return sched::split_begin(p.n, world, o);
}

template <class T, bool kVec, int kUnroll>
__device__ __forceinline__ float row_dot(const typename T::storage *row,
                                         const typename T::storage *x, int64_t K, int lane) {
    float acc = 0.f;
    if constexpr (kVec) {
        constexpr int V = vec_elems<T>();
        const uint4 *rv = reinterpret_cast<const uint4 *>(row);
        const uint4 *xv = reinterpret_cast<const uint4 *>(x);
        const int64_t nvec = K / V;
        int64_t i = lane;
        // one accumulator per load in flight: a single one made every FMA of an iteration
        // wait for the previous (V * kUnroll dependent FMAs per 16-byte load group)
        float part[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) part[u] = 0.f;
        for (; i + (kUnroll - 1) * ROCMOE_WAVE_SIZE < nvec; i += kUnroll * ROCMOE_WAVE_SIZE) {
            uint4 a[kUnroll], b[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) a[u] = load_ro(rv + i + u * ROCMOE_WAVE_SIZE);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) b[u] = load_ro(xv + i + u * ROCMOE_WAVE_SIZE);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                float fa[V], fb[V];
                unpack<T>(a[u], fa);
                unpack<T>(b[u], fb);
                for (int e = 0; e < V; ++e) part[u] += fa[e] * fb[e];
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) acc += part[u];
        for (; i < nvec; i += ROCMOE_WAVE_SIZE) {
            float fa[V], fb[V];
            unpack<T>(load_ro(rv + i), fa);
            unpack<T>(load_ro(xv + i), fb);
            for (int e = 0; e < V; ++e) acc += fa[e] * fb[e];
        }
    } else {
        for (int64_t i = lane; i < K; i += ROCMOE_WAVE_SIZE) acc += T::load(row[i]) * T::load(x[i]);
    }
    return wave_sum(acc);
}

// builds tasks_per_dest / prefix in shared memory from per-destination row counts
template <class RowsOf>
__device__ __forceinline__ sched::Plan shared_plan(const Common &c, uint32_t *smem,
                                                   uint64_t tile_rows, RowsOf rows_of) {
    const int world = c.topo.world;
    if (threadIdx.x == 0) {
        for (int d = 0; d < world; ++d) smem[d] = sched::tasks_for_rows(rows_of(d), tile_rows);
        sched::build_task_prefix(c.topo, smem, smem + world);
    }
    __syncthreads();
    return sched::Plan{c.topo, smem[2 * world], smem + world};
}

// The whole op in one persistent kernel: task numbers [0, total1) are phase-1 tasks,
// [total1, total1 + total2) phase-2 tasks, and the last workgroup out runs phase 3. Phase-2
// tasks are claimed only after every phase-1 task has been claimed by a running workgroup,
// so a workgroup waiting for phase-1 results never holds back the work it waits for.
// Four workgroups per compute unit must fit (64 registers on sm_90): the H200 sweep ran the
// GEMV at 0.58 of copy bandwidth with three resident, 0.74-0.78 with four.
constexpr int kGemvMinBlocks = 4;

template <class T, bool kVec, int kUnroll>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks)
    gemv_all_reduce_kernel(Common c, GemvParams p, void *out, uint32_t workers) {
    using S = typename T::storage;
    extern __shared__ uint32_t plan_smem[];
    __shared__ sched::Task s_task;
    __shared__ int s_phase, s_free, s_last;
    __shared__ uint64_t s_epoch;
    const int world = c.topo.world;
    const int me = c.topo.rank;
    const bool alone = world == 1;
    if (threadIdx.x == 0) s_epoch = c.next_epoch();
    const int64_t my_begin = chunk_begin(p, world, me);
    const int64_t mine = chunk_begin(p, world, me + 1) - my_begin;
    const sched::Plan plan1 = shared_plan(c, plan_smem, p.rows_per_tile, [&](int o) {
        return uint64_t(chunk_begin(p, world, o + 1) - chunk_begin(p, world, o));
    });
    const sched::Plan plan2 = shared_plan(c, plan_smem + 2 * world + 1, kReduceTile,
                                          [&](int) { return uint64_t(alone ? 0 : mine); });
    const uint64_t epoch = s_epoch;
    const uint32_t total1 = plan1.total_tasks;
    const uint32_t total2 = alone ? 0u : plan2.total_tasks;
    const sched::Counters counters1 = c.sched_counters(0);
    const sched::Counters counters2 = c.sched_counters(1);
    AckCache cache{0};
    bool partials_ready = false;  // thread 0's view
    const int tid = threadIdx.x;
    const int wave = tid / ROCMOE_WAVE_SIZE;
    const int lane = tid % ROCMOE_WAVE_SIZE;
    const S *W = static_cast<const S *>(p.w);
    const S *x = static_cast<const S *>(p.x);
    char *recv = c.recv(epoch);
    const float *partials_here = reinterpret_cast<const float *>(recv);

    for (;;) {
        if (tid == 0) {
            sched::Task task;
            const uint32_t id = sched::claim(counters1);
            int phase = 0, ok = 0;
            if (id < total1) {
                phase = sched::locate(plan1, id, &task) ? 1 : 0;
                ok = phase;
            } else if (id - total1 < total2 && sched::locate(plan2, id - total1, &task)) {
                phase = 2;
                ok = 1;
                if (!partials_ready) {
                    // every rank's partials of this rank's chunk (phase-1 deliveries, by
                    // source); one that sent none leaves y wrong, reported by its status
                    for (int src = 0; src < world; ++src)
                        receive(c, src, epoch, c.layout.capacity, p.n);
                    partials_ready = true;
                }
            }
            s_free = ok ? (alone || wait_dest_free(c, cache, task.dest, epoch) ? 1 : 0) : 0;
            s_phase = phase;
            s_task = task;
        }
        __syncthreads();
        const sched::Task task = s_task;
        const int phase = s_phase, free_to_write = s_free;
        __syncthreads();
        if (phase == 0) break;

        if (phase == 1) {
            const int64_t cb = chunk_begin(p, world, task.dest);
            const int64_t rows = chunk_begin(p, world, task.dest + 1) - cb;
            const uint64_t first = sched::tile_begin(task.tile, p.rows_per_tile, rows);
            const uint64_t last = sched::tile_end(task.tile, p.rows_per_tile, rows);
            if (alone) {
                // y itself, in the op's dtype, straight into the output
                S *y = static_cast<S *>(out);
                for (uint64_t r = first + wave; r < last; r += kWaves) {
                    const float v =
                        row_dot<T, kVec, kUnroll>(W + (cb + int64_t(r)) * p.k, x, p.k, lane);
                    if (lane == 0) y[cb + int64_t(r)] = T::store(v);
                }
                continue;
            }
            float *partials = static_cast<float *>(shmem::peer_ptr(c.team, recv, task.dest));
            if (free_to_write && partials != nullptr) {
                float *dst = partials + int64_t(me) * p.chunk_stride;
                for (uint64_t r = first + wave; r < last; r += kWaves) {
                    const float v =
                        row_dot<T, kVec, kUnroll>(W + (cb + int64_t(r)) * p.k, x, p.k, lane);
                    if (lane == 0) dst[r] = v;
                }
            } else if (free_to_write && tid == 0) {
                // the partials are 4-byte scattered stores: this kernel needs load/store reach
                c.record(ws::status_data(world, task.dest), ROCMOE_STATUS_TIMEOUT, epoch);
            }
            if (free_to_write && partials != nullptr) {
                __threadfence_system();
                __syncthreads();
                if (tid == 0 && sched::complete(counters1, task)) deliver(c, task.dest, epoch, p.n);
            }
        } else {
            const uint64_t first = sched::tile_begin(task.tile, kReduceTile, uint64_t(mine));
            const uint64_t last = sched::tile_end(task.tile, kReduceTile, uint64_t(mine));
            S *y = static_cast<S *>(shmem::peer_ptr(c.team, recv + p.gather_offset, task.dest));
            if (free_to_write && y != nullptr) {
                for (uint64_t i = first + tid; i < last; i += kThreads) {
                    float sum = 0.f;
                    for (int src = 0; src < world; ++src)
                        sum += partials_here[int64_t(src) * p.chunk_stride + i];
                    y[my_begin + int64_t(i)] = T::store(sum);
                }
            } else if (free_to_write && tid == 0) {
                c.record(ws::status_phase2(world, task.dest), ROCMOE_STATUS_TIMEOUT, epoch);
            }
            if (free_to_write && y != nullptr) {
                __threadfence_system();
                __syncthreads();
                if (tid == 0 && sched::complete(counters2, task))
                    deliver(c, task.dest, epoch, 0, true);
            }
        }
    }
    if (tid == 0) s_last = sched::exit_worker(counters1, workers) ? 1 : 0;
    __syncthreads();
    if (!s_last) return;
    // Phase 3, by the last workgroup out (every other one has finished its stores and reads)
    __threadfence();
    if (tid == 0) *c.epoch_word() = epoch;
    if (alone) return;
    for (int o = tid; o < world; o += kThreads) receive(c, o, epoch, 0, -1, true);
    __syncthreads();
    const uint64_t bytes = uint64_t(p.n) * sizeof(S);
    const char *src = recv + p.gather_offset;
    char *dst = static_cast<char *>(out);
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | bytes) & 15u) == 0) {
        for (uint64_t i = tid; i < bytes / 16; i += kThreads)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
    } else {
        for (uint64_t i = tid; i < bytes; i += kThreads) dst[i] = src[i];
    }
    // every read of this rank's receive buffer is done: peers may reuse it
    __threadfence();
    __syncthreads();
    for (int d = tid; d < world; d += kThreads) shmem::signal_set(c.team, c.ack(me), epoch, d);
}

// Tuning knobs read once (benchmarks sweep them): loads in flight per lane (4 or 8) and rows
// per phase-1 task.
int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return (v != nullptr && *v != '\0') ? atoi(v) : fallback;
}

template <class T, int kUnroll>
void launch_kernel(bool vec, int workers, size_t smem, hipStream_t stream, const Common &c,
                   const GemvParams &p, void *out) {
    if (vec)
        hipLaunchKernelGGL((gemv_all_reduce_kernel<T, true, kUnroll>), dim3(workers),
                           dim3(kThreads), smem, stream, c, p, out, uint32_t(workers));
    else
        hipLaunchKernelGGL((gemv_all_reduce_kernel<T, false, kUnroll>), dim3(workers),
                           dim3(kThreads), smem, stream, c, p, out, uint32_t(workers));
}

template <class T>
int launch(const Common &c, const GemvParams &p, int requested, void *out, hipStream_t stream) {
    const int world = c.topo.world;
    const size_t smem = sizeof(uint32_t) * 2 * (2 * size_t(world) + 1);  // two plans
    uint32_t total1 = 0;
    for (int o = 0; o < world; ++o) {
        const int64_t rows = sched::split_begin(p.n, world, o + 1) - sched::split_begin(p.n, world, o);
        total1 += sched::tasks_for_rows(uint64_t(rows), p.rows_per_tile);
    }
    const int64_t mine = sched::split_begin(p.n, world, c.topo.rank + 1) -
                         sched::split_begin(p.n, world, c.topo.rank);
    const uint32_t total2 = uint32_t(world) * sched::tasks_for_rows(uint64_t(mine), kReduceTile);
    static const int per_cu = env_int("ROCMOE_GEMV_PER_CU", 4);
    const int workers = persistent_workgroups(requested, total1 + total2, per_cu);
    const bool vec = p.k % vec_elems<T>() == 0 &&
                     ((reinterpret_cast<uintptr_t>(p.w) | reinterpret_cast<uintptr_t>(p.x)) & 15u) == 0;
    static const int unroll = env_int("ROCMOE_GEMV_UNROLL", 4);
    if (unroll >= 8)
        launch_kernel<T, 8>(vec, workers, smem, stream, c, p, out);
    else
        launch_kernel<T, 4>(vec, workers, smem, stream, c, p, out);
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "gemv_all_reduce: kernel launch failed: %s",
                    hipGetErrorString(e));
    return ROCMOE_OK;
}

}  // namespace
}  // namespace fused
}  // namespace rocmoe

extern "C" int rocmoe_gpu_gemv_allreduce(const rocmoe_gpu_gemv_args *args, int abort) {
    using namespace rocmoe::fused;
    if (args == nullptr) return rocmoe::fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: args is NULL");
    Common c;
    int rc = make_common(args->team, args->fused, ROCMOE_OP_GEMV_ALLREDUCE, "gemv_all_reduce", &c);
    if (rc != ROCMOE_OK) return rc;
    hipStream_t stream = static_cast<hipStream_t>(args->fused.stream);
    if (abort) return launch_abort(c, 1, stream);
    const int world = args->team.world;
    const rocmoe_workspace_layout &l = args->fused.layout;
    if (args->n != l.capacity || args->k < 0 || args->out == nullptr ||
        (args->k > 0 && (args->w == nullptr || args->x == nullptr)))
        return rocmoe::fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: W [%lld, %lld] / x / out not "
                            "valid for the handle's N %lld", (long long)args->n,
                            (long long)args->k, (long long)l.capacity);
    GemvParams p;
    p.w = args->w;
    p.x = args->x;
    p.n = args->n;
    p.k = args->k;
    p.chunk_stride = (args->n + world - 1) / world;
    p.gather_offset = l.gather_offset;
    {
        static const int rows = env_int("ROCMOE_GEMV_ROWS", kDefaultRowsPerTile);
        p.rows_per_tile = uint64_t(rows > 0 ? rows : kDefaultRowsPerTile);
    }
    switch (l.dtype) {
        case ROCMOE_DTYPE_F32: rc = launch<F32>(c, p, args->fused.workgroups, args->out, stream); break;
        case ROCMOE_DTYPE_BF16: rc = launch<BF16>(c, p, args->fused.workgroups, args->out, stream); break;
        case ROCMOE_DTYPE_F16: rc = launch<F16>(c, p, args->fused.workgroups, args->out, stream); break;
        default:
            return rocmoe::fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: dtype %d unknown", l.dtype);
    }
    return rc;
}
