// Fused Embedding + All-to-All: one persistent kernel computes this rank's tables' bags
// (EmbeddingBag sum / mean, optional per-sample weights) for the whole global batch and
// stores each bag straight into the rank that owns its sample.
//
//   slice  destination d: bags [d * B/world, (d+1) * B/world) of every local table, which
//          land in d's receive buffer as one contiguous block [B/world, T_local, D] at
//          element offset B/world * table_base * D (source blocks in global table order)
//   task   kItemsPerTile consecutive (bag, table) items of a slice; an item is one output
//          row of D elements; consecutive items are consecutive rows at the destination
//
// Bandwidth: lanes of a wave split a row into 16-byte vectors (one group of lanes per
// item, several items per wave when D is small), and four gathered rows are loaded before
// any is accumulated, so each lane keeps several loads in flight.
#include "fused_common.hpp"

#include "../internal.hpp"

namespace rocmoe {
namespace fused {
namespace {

constexpr int kItemsPerTile = 64;

struct EmbeddingParams {
    const int64_t *tables;   // [6 * T]: weights, indices, offsets, psw, rows, num_indices
    char *recv;              // this rank's receive buffer (symmetric)
    char *stage;             // scale-out staging or nullptr
    int64_t batch, dim, batch_local;
    int num_tables, table_base, mode, has_psw;
    uint32_t items_per_slice;  // batch_local * num_tables
};

// lanes that cooperate on one row: enough 16-byte vectors to cover D, a power of two, at
// most a wave (then the row is walked in steps of a wave)
template <class T>
__device__ __forceinline__ int lanes_per_item(int64_t dim) {
    const int64_t vecs = (dim + vec_elems<T>() - 1) / vec_elems<T>();
    int g = 1;
    while (g < vecs && g < ROCMOE_WAVE_SIZE) g <<= 1;
    return g;
}

// One output row: bag `b` of local table `t`, written to `dst` (D elements of T).
template <class T, bool kVec>
__device__ __forceinline__ void bag_row(const EmbeddingParams &p, int t, int64_t b,
                                        typename T::storage *dst, int lane, int group) {
    using S = typename T::storage;
    const S *weights = reinterpret_cast<const S *>(p.tables[t]);
    const int64_t *indices = reinterpret_cast<const int64_t *>(p.tables[p.num_tables + t]);
    const int64_t *offsets = reinterpret_cast<const int64_t *>(p.tables[2 * p.num_tables + t]);
    const float *psw = reinterpret_cast<const float *>(p.tables[3 * p.num_tables + t]);
    const int64_t rows = p.tables[4 * p.num_tables + t];
    const int64_t nidx = p.tables[5 * p.num_tables + t];
    const int64_t begin = offsets[b];
    const int64_t end = b + 1 < p.batch ? offsets[b + 1] : nidx;
    const int64_t count = end > begin ? end - begin : 0;
    const float scale = (p.mode == ROCMOE_BAG_MEAN && count > 0) ? 1.0f / float(count) : 1.0f;
    const int64_t D = p.dim;

    if constexpr (kVec) {
        constexpr int V = vec_elems<T>();
        for (int64_t d0 = int64_t(lane) * V; d0 < D; d0 += int64_t(group) * V) {
            float acc[V];
            for (int i = 0; i < V; ++i) acc[i] = 0.f;
            int64_t j = begin;
            for (; j + 4 <= end; j += 4) {
                int64_t r[4];
                float s[4];
                uint4 v[4];
                for (int u = 0; u < 4; ++u) {
                    r[u] = indices[j + u];
                    s[u] = p.has_psw ? psw[j + u] : 1.0f;
                    // an out-of-range index was rejected by the caller; never read past a table
                    if (r[u] < 0 || r[u] >= rows) { r[u] = 0; s[u] = 0.f; }
                }
                for (int u = 0; u < 4; ++u)
                    v[u] = *reinterpret_cast<const uint4 *>(weights + r[u] * D + d0);
                for (int u = 0; u < 4; ++u) {
                    float f[V];
                    unpack<T>(v[u], f);
                    for (int i = 0; i < V; ++i) acc[i] += s[u] * f[i];
                }
            }
            for (; j < end; ++j) {
                int64_t r = indices[j];
                float s = p.has_psw ? psw[j] : 1.0f;
                if (r < 0 || r >= rows) { r = 0; s = 0.f; }
                float f[V];
                unpack<T>(*reinterpret_cast<const uint4 *>(weights + r * D + d0), f);
                for (int i = 0; i < V; ++i) acc[i] += s * f[i];
            }
            for (int i = 0; i < V; ++i) acc[i] *= scale;
            *reinterpret_cast<uint4 *>(dst + d0) = pack<T>(acc);
        }
    } else {
        for (int64_t d = lane; d < D; d += group) {
            float acc = 0.f;
            for (int64_t j = begin; j < end; ++j) {
                int64_t r = indices[j];
                float s = p.has_psw ? psw[j] : 1.0f;
                if (r < 0 || r >= rows) { r = 0; s = 0.f; }
                acc += s * T::load(weights[r * D + d]);
            }
            dst[d] = T::store(acc * scale);
        }
    }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) embedding_a2a_kernel(Common c, EmbeddingParams p,
                                                                uint32_t workers) {
    using S = typename T::storage;
    extern __shared__ uint32_t plan_smem[];  // tasks_per_dest[world], prefix[world + 1]
    __shared__ sched::Task s_task;
    __shared__ int s_valid, s_free;
    const int world = c.topo.world;
    uint32_t *tasks_per_dest = plan_smem;
    uint32_t *prefix = plan_smem + world;
    const int tid = threadIdx.x;
    if (tid == 0) {
        const uint32_t n = sched::tasks_for_rows(p.items_per_slice, kItemsPerTile);
        for (int d = 0; d < world; ++d) tasks_per_dest[d] = n;
        sched::build_task_prefix(c.topo, tasks_per_dest, prefix);
    }
    __syncthreads();
    const sched::Plan plan{c.topo, prefix[world], prefix};
    const sched::Counters counters = c.sched_counters();
    AckCache cache{0};

    const int group = lanes_per_item<T>(p.dim);
    const int lane = tid % group;
    const int slot = tid / group;
    const int concurrent = kThreads / group;
    const size_t row_bytes = size_t(p.dim) * sizeof(S);

    for (;;) {
        if (tid == 0) {
            sched::Task task;
            s_valid = sched::locate(plan, sched::claim(counters), &task) ? 1 : 0;
            s_free = s_valid ? (wait_dest_free(c, cache, task.dest) ? 1 : 0) : 0;
            s_task = task;
        }
        __syncthreads();
        const sched::Task task = s_task;
        const int valid = s_valid, free_to_write = s_free;
        __syncthreads();  // everyone has read the task before thread 0 claims the next
        if (!valid) break;

        const uint64_t first = sched::tile_begin(task.tile, kItemsPerTile, p.items_per_slice);
        const uint64_t last = sched::tile_end(task.tile, kItemsPerTile, p.items_per_slice);
        // this rank's block at the destination, and the tile's first row in it
        const size_t block_offset = size_t(p.batch_local) * p.table_base * row_bytes;
        S *direct = static_cast<S *>(shmem::peer_ptr(c.team, p.recv + block_offset, task.dest));
        S *stage = p.stage ? reinterpret_cast<S *>(
                                 p.stage + size_t(task.dest) * p.items_per_slice * row_bytes)
                           : nullptr;
        S *out = direct ? direct : stage;
        if (free_to_write && out != nullptr && first < last) {
            for (uint64_t item = first + slot; item < last; item += concurrent) {
                const int t = int(item % p.num_tables);
                const int64_t b = int64_t(task.dest) * p.batch_local + int64_t(item / p.num_tables);
                bag_row<T, kVec>(p, t, b, out + item * p.dim, lane, group);
            }
            if (direct == nullptr) {
                // scale-out: the tile's rows are contiguous at the destination, one put
                __syncthreads();
                shmem::put_nbi_wg(c.team, p.recv + block_offset + first * row_bytes,
                                  stage + first * p.dim, (last - first) * row_bytes, task.dest);
                shmem::quiet(c.team);
            }
        }
        if (free_to_write && out == nullptr && tid == 0)
            atomicExch(c.status + world + task.dest, int(kTimedOut));  // unreachable, no stage

        if (c.signal_enabled && free_to_write && out != nullptr) {
            // each thread makes its own stores visible system-wide before the one signal
            __threadfence_system();
            __syncthreads();
            if (tid == 0 && sched::complete(counters, task))
                shmem::signal_set(c.team, c.data_signal(c.topo.rank), c.epoch, task.dest);
        }
    }
    if (tid == 0) sched::exit_worker(counters, workers);
}

template <class T>
int launch(const Common &c, const EmbeddingParams &p, int requested, hipStream_t stream) {
    const uint32_t per_dest = sched::tasks_for_rows(p.items_per_slice, kItemsPerTile);
    const uint32_t total = per_dest * uint32_t(c.topo.world);
    const int workers = persistent_workgroups(requested, total, 4);
    const size_t smem = sizeof(uint32_t) * (2 * size_t(c.topo.world) + 1);
    const bool vec = p.dim % vec_elems<T>() == 0;
    if (vec)
        hipLaunchKernelGGL((embedding_a2a_kernel<T, true>), dim3(workers), dim3(kThreads), smem,
                           stream, c, p, uint32_t(workers));
    else
        hipLaunchKernelGGL((embedding_a2a_kernel<T, false>), dim3(workers), dim3(kThreads), smem,
                           stream, c, p, uint32_t(workers));
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "embedding_all_to_all: kernel launch failed: %s",
                    hipGetErrorString(e));
    return ROCMOE_OK;
}

}  // namespace
}  // namespace fused
}  // namespace rocmoe

extern "C" int rocmoe_gpu_embedding_a2a(const rocmoe_gpu_embedding_args *args) {
    using namespace rocmoe::fused;
    if (args == nullptr) return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: args is NULL");
    Common c;
    int rc = make_common(args->team, args->fused, "embedding_all_to_all", &c);
    if (rc != ROCMOE_OK) return rc;
    const int world = args->team.world;
    if (args->batch <= 0 || args->batch % world != 0)
        return rocmoe::fail(ROCMOE_ERR_INVALID,
                            "embedding_all_to_all: global batch %lld is not a positive multiple "
                            "of the world size %d", (long long)args->batch, world);
    if (args->dim <= 0 || args->num_tables < 0 || args->table_base < 0 ||
        args->table_base + args->num_tables > args->total_tables)
        return rocmoe::fail(ROCMOE_ERR_INVALID,
                            "embedding_all_to_all: dim %lld, tables [%d, %d) of %d are inconsistent",
                            (long long)args->dim, args->table_base,
                            args->table_base + args->num_tables, args->total_tables);
    if (args->num_tables > 0 && args->tables == nullptr)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: table array is NULL");
    if (args->mode != ROCMOE_BAG_SUM && args->mode != ROCMOE_BAG_MEAN)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: mode %d is not sum/mean",
                            args->mode);
    if (args->has_per_sample_weights && args->mode != ROCMOE_BAG_SUM)
        return rocmoe::fail(ROCMOE_ERR_INVALID,
                            "embedding_all_to_all: per_sample_weights need mode sum");
    const int64_t items = args->batch / world * args->num_tables;
    if (items > int64_t(UINT32_MAX) / 2)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: %lld rows per destination "
                            "exceed the kernel's 32-bit task numbering", (long long)items);

    EmbeddingParams p;
    p.tables = args->tables;
    p.recv = static_cast<char *>(args->fused.recv);
    p.stage = static_cast<char *>(args->fused.stage);
    p.batch = args->batch;
    p.dim = args->dim;
    p.batch_local = args->batch / world;
    p.num_tables = args->num_tables;
    p.table_base = args->table_base;
    p.mode = args->mode;
    p.has_psw = args->has_per_sample_weights;
    p.items_per_slice = uint32_t(items);
    hipStream_t stream = static_cast<hipStream_t>(args->fused.stream);
    rc = clear_status(c, stream);
    if (rc != ROCMOE_OK) return rc;

    switch (args->dtype) {
        case ROCMOE_DTYPE_F32: rc = launch<F32>(c, p, args->fused.workgroups, stream); break;
        case ROCMOE_DTYPE_BF16: rc = launch<BF16>(c, p, args->fused.workgroups, stream); break;
        case ROCMOE_DTYPE_F16: rc = launch<F16>(c, p, args->fused.workgroups, stream); break;
        default:
            return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: dtype %d unknown",
                                args->dtype);
    }
    if (rc != ROCMOE_OK || !c.signal_enabled) return rc;
    // consumer: every source's block of this call has arrived
    return launch_wait(c, c.slots, world, c.status + world, stream);
}
