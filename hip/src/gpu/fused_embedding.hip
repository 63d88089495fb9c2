// Fused Embedding + All-to-All: one persistent kernel computes this rank's tables' bags
// (EmbeddingBag sum / mean, optional per-sample weights) for the whole global batch and
// stores each bag straight into the rank that owns its sample.
//
//   slice  destination d: bags [d * B/world, (d+1) * B/world) of every local table, which
//          land in d's receive buffer (parity epoch % 2) as one contiguous block
//          [B/world, T_local, D] at element offset B/world * table_base * D
//   task   items_per_tile consecutive (bag, table) items of a slice (kItemsPerTile, or
//          fewer for a small call: see tile_items); an item is one output row of D
//          elements; consecutive items are consecutive rows at the destination
//
// The handle protocol (rocmoe.h): the kernel takes this call's epoch from the workspace,
// waits (bounded) for each destination's acknowledgement of call epoch - 2 before writing
// into its buffer. An index outside its table or offsets out of order are checked here, per
// bag, and any one marks the whole call bad. The last workgroup out delivers to every
// destination: the global batch (or ROCMOE_COUNT_BAD_INPUT when the call was bad, and then
// this rank's own status word is set) into its count slot, then the signal. So a bad index
// anywhere is raised by every rank, also those whose bags it did not touch (the first
// version signalled each slice as it completed, and only the owner of the bad bag learned:
// a peer went on while this rank raised, and its next call timed out). Receivers copy out
// only after every source anyway, so signalling at the end costs no overlap. The last
// workgroup then advances the epoch and waits for every source; a copy-out kernel moves the
// block into the output and acknowledges the sources. At world size 1 there is nobody to
// talk to: embedding_direct_kernel writes the output itself, with no heap, no signal, no
// copy and no epoch (ROCMOE_EMBEDDING_DIRECT=0: this kernel, which then does the same
// through its task counter and last workgroup).
//
// Bandwidth: lanes of a wave split a row into 16-byte vectors (one group of lanes per
// item, several items per wave when D is small), and four gathered rows are loaded before
// any is accumulated, so each lane keeps several loads in flight.
//
// Tables: per-table records (up to kInlineTables inside the launch's arguments, more from a
// device array), or packed (FBGEMM's table-batched layout, rocmoe_gpu_packed_tables): one
// weight tensor, one index array and one offset array for all of a rank's tables, so that
// a call's host work is a few pointers however many tables there are.
#include "fused_common.hpp"

#include "../internal.hpp"

namespace rocmoe {
namespace fused {
namespace {

constexpr int kItemsPerTile = 64;
// a call with fewer tasks than this many a CU gets smaller tiles (down to one item a lane
// group), so that more workgroups share it
constexpr int kMinTasksPerCu = 2;
// tables that travel inside the launch's arguments (more: a device array)
constexpr int kInlineTables = 32;

struct EmbeddingParams {
    rocmoe_gpu_table inline_tables[kInlineTables];
    const rocmoe_gpu_table *device_tables;  // nullptr: the inline ones
    rocmoe_gpu_packed_tables packed;         // packed.weights != nullptr: these instead
    char *out;                               // world size 1: the output, written directly
    int64_t batch, dim, batch_local;
    int num_tables, table_base, total_tables, mode;
    uint32_t items_per_slice;  // batch_local * num_tables
    uint32_t items_per_tile;   // items a task covers (tile_items)
};

// Where bag `b` of local table `t` reads: its table's rows and its range of indices, from
// the per-table records or from the packed arrays. `ok` is false when the offsets are out of
// order or out of range (the bag is then empty).
template <class S>
struct BagSpan {
    const S *weights;
    const int64_t *indices;
    const float *psw;
    int64_t rows, begin, end;
    bool ok;
};

template <class S>
__device__ __forceinline__ void table_span(const rocmoe_gpu_table &tab, int64_t b, int64_t batch,
                                           BagSpan<S> &s, int64_t &nidx) {
    s.weights = static_cast<const S *>(tab.weights);
    s.rows = tab.rows;
    s.indices = tab.indices;
    s.psw = tab.per_sample_weights;
    nidx = tab.num_indices;
    s.begin = tab.offsets[b];
    s.end = b + 1 < batch ? tab.offsets[b + 1] : nidx;
}

template <class S>
__device__ __forceinline__ BagSpan<S> bag_span(const EmbeddingParams &p, int t, int64_t b) {
    BagSpan<S> s;
    int64_t nidx;
    bool first;
    if (p.packed.weights != nullptr) {
        const rocmoe_gpu_packed_tables &k = p.packed;
        const int64_t base = k.row_base[t];
        s.weights = static_cast<const S *>(k.weights) + base * p.dim;
        s.rows = k.row_base[t + 1] - base;
        s.indices = k.indices;
        s.psw = k.per_sample_weights;
        nidx = k.num_indices;
        const int64_t at = int64_t(t) * p.batch + b;
        s.begin = k.offsets[at];
        s.end = k.offsets[at + 1];
        first = at == 0;
    } else {
        // On AMD each source is read in its own branch: a pointer that may point into `p` (the
        // inline records) or to device memory makes the AMDGPU compiler copy all of `p` into
        // scratch memory, 1.6 KB a lane, before the kernel does anything
        // (tests/test_compile.py::test_hip_kernels_use_no_scratch_memory_on_cdna). NVIDIA
        // makes no such copy, but the two forms schedule differently: on an H200, the two
        // branches against one reference, alternated in one session (results/
        // embedding_record_reads_ab_h200_twentythird_session.log), ran float32 9-10 % faster
        // and bf16 6-10 % slower, so there each element size keeps its faster form.
#if defined(ROCMOE_PLATFORM_NVIDIA)
        constexpr bool kBranches = sizeof(S) == 4;
#else
        constexpr bool kBranches = true;
#endif
        if (kBranches) {
            if (p.device_tables != nullptr)
                table_span(p.device_tables[t], b, p.batch, s, nidx);
            else
                table_span(p.inline_tables[t], b, p.batch, s, nidx);
        } else {
            const rocmoe_gpu_table &tab =
                p.device_tables != nullptr ? p.device_tables[t] : p.inline_tables[t];
            table_span(tab, b, p.batch, s, nidx);
        }
        first = b == 0;
    }
    s.ok = !(s.begin < 0 || s.end < s.begin || s.end > nidx || (first && s.begin != 0));
    if (!s.ok) s.begin = s.end = 0;
    return s;
}

// lanes that cooperate on one row: enough 16-byte vectors to cover D, a power of two, at
// most a wave (then the row is walked in steps of a wave)
template <class T>
ROCMOE_HD inline int lanes_per_item(int64_t dim) {
    const int64_t vecs = (dim + vec_elems<T>() - 1) / vec_elems<T>();
    int g = 1;
    while (g < vecs && g < ROCMOE_WAVE_SIZE) g <<= 1;
    return g;
}

// One output row: bag `b` of local table `t`, written to `dst` (D elements of T). Returns
// false when the bag's offsets or one of its indices are out of range (those contribute
// nothing; the caller reports the slice as bad input).
template <class T, bool kVec>
__device__ __forceinline__ bool bag_row(const EmbeddingParams &p, int t, int64_t b,
                                        typename T::storage *dst, int lane, int group) {
    using S = typename T::storage;
    const BagSpan<S> span = bag_span<S>(p, t, b);
    const S *weights = span.weights;
    const int64_t *indices = span.indices;
    const float *psw = span.psw;
    const int64_t rows = span.rows;
    const int64_t begin = span.begin, end = span.end;
    bool ok = span.ok;
    const int64_t count = end - begin;
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
                    s[u] = psw != nullptr ? psw[j + u] : 1.0f;
                    // never read past a table: an index out of range contributes nothing
                    if (r[u] < 0 || r[u] >= rows) { r[u] = 0; s[u] = 0.f; ok = false; }
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
                float s = psw != nullptr ? psw[j] : 1.0f;
                if (r < 0 || r >= rows) { r = 0; s = 0.f; ok = false; }
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
                float s = psw != nullptr ? psw[j] : 1.0f;
                if (r < 0 || r >= rows) { r = 0; s = 0.f; ok = false; }
                acc += s * T::load(weights[r * D + d]);
            }
            dst[d] = T::store(acc * scale);
        }
    }
    return ok;
}

// Four workgroups an SM for the vector path (at most 64 registers a thread on sm_90): left
// to itself nvcc gave it 80-98, so three were resident, against the direct kernel's four
// to five at 46-63 registers, and that kernel gathered 17-42 % faster at world size 1
// (results/fused_gpu_h200_fifteenth_session_embedding_{direct,protocol}.jsonl; more
// workgroups asked for did not help: _protocol_wg*.jsonl). Bounded, the vector variants
// build at 63-64 registers with no spill (tests/test_compile.py holds it) and gather 7-25 %
// faster than before on the H200 (ROCMOE_EMBEDDING_DIRECT=0 at world size 1, under CUDA
// graphs: 26 x 100k x 128 fp32 343 -> 278 us, 8 x 1M x 64 268 -> 201, 4 x 10k x 256 bf16
// 433 -> 354; results/fused_gpu_h200_sixteenth_session_embedding_protocol.jsonl), within
// 0-23 % of the direct kernel and ahead of it on 8 x 1M x 64. The element path (D not a
// multiple of a 16-byte vector) keeps three, at 80: bounded to four it spilled.
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads, kVec ? 4 : 3)
    embedding_a2a_kernel(Common c, EmbeddingParams p, uint32_t workers) {
    using S = typename T::storage;
    extern __shared__ uint32_t plan_smem[];  // tasks_per_dest[world], prefix[world + 1]
    __shared__ sched::Task s_task;
    __shared__ int s_valid, s_free, s_last;
    __shared__ uint64_t s_epoch;
    const int world = c.topo.world;
    const bool alone = world == 1;
    uint32_t *tasks_per_dest = plan_smem;
    uint32_t *prefix = plan_smem + world;
    const int tid = threadIdx.x;
    if (tid == 0) {
        s_epoch = c.next_epoch();
        const uint32_t n = sched::tasks_for_rows(p.items_per_slice, p.items_per_tile);
        for (int d = 0; d < world; ++d) tasks_per_dest[d] = n;
        sched::build_task_prefix(c.topo, tasks_per_dest, prefix);
    }
    __syncthreads();
    const uint64_t epoch = s_epoch;
    const sched::Plan plan{c.topo, prefix[world], prefix};
    const sched::Counters counters = c.sched_counters(0);
    bool first_round = true;  // (thread 0's)
    // one flag for the whole call (the counter of destination 0): any bad bag spoils it
    uint32_t *bad_flag = c.counters() + ws::bad_input_counter(world, 0);
    AckCache cache{0};

    const int group = lanes_per_item<T>(p.dim);
    const int lane = tid % group;
    const int slot = tid / group;
    const int concurrent = kThreads / group;
    const size_t row_bytes = size_t(p.dim) * sizeof(S);

    for (;;) {
        if (tid == 0) {
            sched::Task task;
            // the first task of workgroup i is task i; later ones come from the counter,
            // past the first round (a small call, one task a workgroup, claims nothing)
            const uint32_t id = first_round ? blockIdx.x
                                : plan.total_tasks <= workers ? plan.total_tasks
                                : workers + sched::claim(counters);
            first_round = false;
            s_valid = sched::locate(plan, id, &task) ? 1 : 0;
            s_free = s_valid ? (alone || wait_dest_free(c, cache, task.dest, epoch) ? 1 : 0) : 0;
            s_task = task;
        }
        __syncthreads();
        const sched::Task task = s_task;
        const int valid = s_valid, free_to_write = s_free;
        __syncthreads();  // everyone has read the task before thread 0 claims the next
        if (!valid) break;

        const uint64_t first = sched::tile_begin(task.tile, p.items_per_tile, p.items_per_slice);
        const uint64_t last = sched::tile_end(task.tile, p.items_per_tile, p.items_per_slice);
        // item i of a slice is bag i / T_local, local table i % T_local; its row lands in the
        // destination's [batch_local, T_total, D] buffer (the output's layout) at column
        // table_base + t. Scale-out (a peer not load/store reachable): the rows go to this
        // rank's stage (the same layout, per destination) and are put bag by bag.
        S *out;
        S *stage = nullptr;
        if (alone) {
            out = reinterpret_cast<S *>(p.out);
        } else {
            out = static_cast<S *>(shmem::peer_ptr(c.team, c.recv(epoch), task.dest));
            if (out == nullptr && c.stage != nullptr) {
                stage = reinterpret_cast<S *>(c.stage + size_t(task.dest) * c.layout.parity_bytes);
                out = stage;
            }
        }
        bool ok = true;
        if (free_to_write && out != nullptr && first < last) {
            for (uint64_t item = first + slot; item < last; item += concurrent) {
                const int t = int(item % p.num_tables);
                const int64_t bag = int64_t(item / p.num_tables);
                const int64_t b = int64_t(task.dest) * p.batch_local + bag;
                S *row = out + (bag * p.total_tables + p.table_base + t) * p.dim;
                ok = bag_row<T, kVec>(p, t, b, row, lane, group) && ok;
            }
            if (stage != nullptr) {
                // this rank's columns of one bag are contiguous at the destination
                __syncthreads();
                const int64_t nt = p.num_tables;
                for (int64_t bag = int64_t(first) / nt; bag * nt < int64_t(last); ++bag) {
                    const int64_t i0 = bag * nt > int64_t(first) ? bag * nt : int64_t(first);
                    const int64_t i1 = (bag + 1) * nt < int64_t(last) ? (bag + 1) * nt : int64_t(last);
                    const size_t at = size_t(bag * p.total_tables + p.table_base + (i0 - bag * nt)) *
                                      row_bytes;
                    shmem::put_nbi_wg(c.team, c.recv(epoch) + at,
                                      reinterpret_cast<const char *>(stage) + at,
                                      size_t(i1 - i0) * row_bytes, task.dest);
                }
                shmem::quiet(c.team);
            }
        }
        if (!ok) atomicOr(bad_flag, 1u);
        // unreachable and no stage to put from (an empty call has nothing to put: at world
        // size 1 its output may well be NULL)
        if (free_to_write && out == nullptr && first < last && tid == 0)
            c.record(ws::status_data(world, task.dest), ROCMOE_STATUS_TIMEOUT, epoch);

        // each thread makes its own stores visible system-wide before the signals of the
        // last workgroup out, which counts this one out after the loop's barriers (at world
        // size 1 there is no signal: the kernel's end publishes the output)
        if (free_to_write && out != nullptr && !alone) __threadfence_system();
    }
    if (tid == 0) {
        __threadfence();  // this workgroup's bad-input flag before its exit count
        s_last = sched::exit_worker(counters, workers) ? 1 : 0;
    }
    __syncthreads();
    if (!s_last || tid != 0) return;
    // the last workgroup out: every task's rows are stored and fenced
    __threadfence_system();
    const bool bad = atomicExch(bad_flag, 0u) != 0;
    if (bad) c.record(ws::status_own(world), ROCMOE_STATUS_BAD_INPUT, epoch);
    if (!alone) {
        for (int d = 0; d < world; ++d) {
            // a destination whose acknowledgement timed out got nothing (its status says so)
            const volatile int *status = c.status;
            if (status[ws::status_ack(world, d)] == ROCMOE_STATUS_TIMEOUT) continue;
            if (wait_dest_free(c, cache, d, epoch))
                deliver(c, d, epoch, bad ? ROCMOE_COUNT_BAD_INPUT : p.batch);
        }
    }
    // this call is this epoch now; every source's block must be in before the copy-out
    // kernel that follows on the stream
    __threadfence();
    *c.epoch_word() = epoch;
    if (alone) return;
    for (int s = 0; s < world; ++s) receive(c, s, epoch, c.layout.capacity, p.batch);
}

// World size 1 (ROCMOE_EMBEDDING_DIRECT=1, the default): the bags go straight into the
// output with no protocol at all, like the GEMV's direct kernel. Lane group g of workgroup w
// takes items w * slots + g, then every grid's worth after it (consecutive groups:
// consecutive output rows). No epoch is read or advanced, no task counter is claimed and no
// last workgroup is waited for: the protocol kernel's small calls spent those round trips
// after their gathers (2 tables x 2048 bags of one lookup: 7.5 us under CUDA graphs against
// F.embedding_bag's 5.8 on the stacked tables). A bad index or bad offsets set this rank's
// own status word (epoch 0: "a recent call"); nothing else reads the status at world size 1.
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) embedding_direct_kernel(EmbeddingParams p,
                                                                   int *status) {
    using S = typename T::storage;
    const int group = lanes_per_item<T>(p.dim);
    const int lane = threadIdx.x % group;
    const uint32_t slots = kThreads / group;
    const uint64_t step = uint64_t(gridDim.x) * slots;
    S *out = reinterpret_cast<S *>(p.out);
    bool ok = true;
    for (uint64_t item = uint64_t(blockIdx.x) * slots + threadIdx.x / group;
         item < p.items_per_slice; item += step) {
        const int t = int(item % p.num_tables);
        const int64_t bag = int64_t(item / p.num_tables);
        S *row = out + (bag * p.total_tables + p.table_base + t) * p.dim;
        ok = bag_row<T, kVec>(p, t, bag, row, lane, group) && ok;
    }
    if (!ok) {
        status[ws::status_own(1)] = ROCMOE_STATUS_BAD_INPUT;
        status[ws::status_epoch(1)] = 0;
    }
}

// Items a task covers. kItemsPerTile, halved while the call would have fewer than
// kMinTasksPerCu tasks a CU and a tile still gives each lane group of a workgroup an item:
// with 64-item tiles a small call (2 tables x 2048 bags of one lookup) ran as 64 workgroups,
// each walking its items four deep in series, every item a chain of dependent loads
// (offsets, index, row); smaller tiles spread the same items over more workgroups.
template <class T>
uint32_t tile_items(const EmbeddingParams &p, int world, int cus) {
    const uint32_t slots = uint32_t(kThreads / lanes_per_item<T>(p.dim));
    uint32_t tile = kItemsPerTile;
    while (tile / 2 >= slots &&
           uint64_t(sched::tasks_for_rows(p.items_per_slice, tile)) * uint64_t(world) <
               uint64_t(cus) * kMinTasksPerCu)
        tile /= 2;
    return tile;
}

// ROCMOE_OK, or the error of the kernel launch just made
int launched() {
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "embedding_all_to_all: kernel launch failed: %s",
                    hipGetErrorString(e));
    return ROCMOE_OK;
}

// Workgroups of the direct kernel: one item a lane group, at most as many as are resident on
// every CU at once (the rest by grid stride; `requested` > 0: ROCMOE_GPU_WORKGROUPS). The
// first version asked for eight a CU, of which four or five were resident at 46-63
// registers, the rest running as a partial second round; on the H200 both grids timed the
// same (within 1.5 %, results/fused_gpu_h200_sixteenth_session_embedding_direct_*.jsonl).
constexpr int kDirectFallbackPerCu = 4;

template <class T, bool kVec>
int launch_direct_as(const Common &c, const EmbeddingParams &p, int requested,
                     hipStream_t stream) {
    static const int fits = resident_per_cu(embedding_direct_kernel<T, kVec>, 0,
                                            kDirectFallbackPerCu);
    const uint32_t slots = uint32_t(kThreads / lanes_per_item<T>(p.dim));
    const uint64_t need = (uint64_t(p.items_per_slice) + slots - 1) / slots;
    const uint64_t most = requested > 0 ? uint64_t(requested) : uint64_t(compute_units()) * fits;
    const int workers = int(need < most ? need : most);
    hipLaunchKernelGGL((embedding_direct_kernel<T, kVec>), dim3(workers), dim3(kThreads), 0,
                       stream, p, c.status);
    return launched();
}

template <class T>
int launch_direct(const Common &c, const EmbeddingParams &p, int requested, hipStream_t stream) {
    if (p.items_per_slice == 0) return ROCMOE_OK;  // an empty call writes nothing
    return p.dim % vec_elems<T>() == 0 ? launch_direct_as<T, true>(c, p, requested, stream)
                                       : launch_direct_as<T, false>(c, p, requested, stream);
}

// The protocol kernel's persistent grid: the workgroups resident at once on every CU (its
// launch bound asks for four on the vector path, three on the element path), no more than
// there are tasks.
template <class T, bool kVec>
int launch_protocol_as(const Common &c, const EmbeddingParams &p, uint32_t total, int requested,
                       hipStream_t stream) {
    const size_t smem = sizeof(uint32_t) * (2 * size_t(c.topo.world) + 1);
    // (the plan's few words of shared memory never change what fits: looked up once)
    static const int fits = resident_per_cu(embedding_a2a_kernel<T, kVec>, smem, kVec ? 4 : 3);
    const int workers = persistent_workgroups(requested, total, fits);  // (a slice is >= 1 task)
    hipLaunchKernelGGL((embedding_a2a_kernel<T, kVec>), dim3(workers), dim3(kThreads), smem,
                       stream, c, p, uint32_t(workers));
    return launched();
}

template <class T>
int launch(const Common &c, EmbeddingParams p, int requested, hipStream_t stream) {
    static const bool direct = env_int("ROCMOE_EMBEDDING_DIRECT", 1) != 0;
    if (c.topo.world == 1 && direct) return launch_direct<T>(c, p, requested, stream);
    p.items_per_tile = tile_items<T>(p, c.topo.world, compute_units());
    const uint32_t per_dest = sched::tasks_for_rows(p.items_per_slice, p.items_per_tile);
    const uint32_t total = per_dest * uint32_t(c.topo.world);
    return p.dim % vec_elems<T>() == 0
               ? launch_protocol_as<T, true>(c, p, total, requested, stream)
               : launch_protocol_as<T, false>(c, p, total, requested, stream);
}

}  // namespace
}  // namespace fused
}  // namespace rocmoe

extern "C" int rocmoe_gpu_embedding_inline_tables(void) { return rocmoe::fused::kInlineTables; }

extern "C" int rocmoe_gpu_embedding_a2a(const rocmoe_gpu_embedding_args *args, int abort) {
    using namespace rocmoe::fused;
    if (args == nullptr) return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: args is NULL");
    Common c;
    int rc = make_common(args->team, args->fused, ROCMOE_OP_EMBEDDING_A2A, "embedding_all_to_all", &c);
    if (rc != ROCMOE_OK) return rc;
    hipStream_t stream = static_cast<hipStream_t>(args->fused.stream);
    if (abort) return launch_abort(c, 0, stream);
    const int world = args->team.world;
    const rocmoe_workspace_layout &l = args->fused.layout;
    if (args->batch < 0 || args->batch % world != 0 || args->batch > l.capacity)
        return rocmoe::fail(ROCMOE_ERR_INVALID,
                            "embedding_all_to_all: global batch %lld is not a multiple of the "
                            "world size %d up to the handle's %lld", (long long)args->batch, world,
                            (long long)l.capacity);
    if (args->dim != l.aux || args->num_tables < 0 || args->table_base < 0 ||
        args->table_base + args->num_tables > args->total_tables ||
        int64_t(args->total_tables) * args->dim != l.width)
        return rocmoe::fail(ROCMOE_ERR_INVALID,
                            "embedding_all_to_all: dim %lld, tables [%d, %d) of %d do not fit the "
                            "handle", (long long)args->dim, args->table_base,
                            args->table_base + args->num_tables, args->total_tables);
    const bool packed = args->packed.weights != nullptr;
    if (packed && args->num_tables > 0 &&
        (args->packed.row_base == nullptr || args->packed.offsets == nullptr ||
         args->packed.num_indices < 0 ||
         (args->packed.indices == nullptr && args->packed.num_indices > 0)))
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: packed tables need "
                            "row_base, offsets and (with indices) an index array");
    if (!packed && args->num_tables > 0 && args->tables == nullptr && args->device_tables == nullptr)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: table array is NULL");
    if (!packed && args->num_tables > kInlineTables && args->device_tables == nullptr)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: %d tables need a device "
                            "table array (at most %d travel inline)", args->num_tables, kInlineTables);
    if (args->mode != ROCMOE_BAG_SUM && args->mode != ROCMOE_BAG_MEAN)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: mode %d is not sum/mean",
                            args->mode);
    if (world == 1 && args->out == nullptr && args->batch > 0)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: out is NULL");
    const int64_t items = args->batch / world * args->num_tables;
    if (items > int64_t(UINT32_MAX) / 2)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: %lld rows per destination "
                            "exceed the kernel's 32-bit task numbering", (long long)items);

    EmbeddingParams p{};
    p.packed = args->packed;
    if (packed) {
        p.device_tables = nullptr;
    } else if (args->num_tables <= kInlineTables) {
        for (int t = 0; t < args->num_tables; ++t) p.inline_tables[t] = args->tables[t];
        p.device_tables = nullptr;
    } else {
        p.device_tables = args->device_tables;
    }
    p.out = static_cast<char *>(args->out);
    p.batch = args->batch;
    p.dim = args->dim;
    p.batch_local = args->batch / world;
    p.num_tables = args->num_tables;
    p.table_base = args->table_base;
    p.total_tables = args->total_tables;
    p.mode = args->mode;
    p.items_per_slice = uint32_t(items);

    switch (l.dtype) {
        case ROCMOE_DTYPE_F32: rc = launch<F32>(c, p, args->fused.workgroups, stream); break;
        case ROCMOE_DTYPE_BF16: rc = launch<BF16>(c, p, args->fused.workgroups, stream); break;
        case ROCMOE_DTYPE_F16: rc = launch<F16>(c, p, args->fused.workgroups, stream); break;
        default:
            return rocmoe::fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: dtype %d unknown", l.dtype);
    }
    if (rc != ROCMOE_OK || world == 1) return rc;
    // every source's block of this call is in (the kernel's last workgroup waited): copy it
    // out and acknowledge
    const uint64_t bytes = uint64_t(p.batch_local) * uint64_t(l.width) * uint64_t(l.elem_bytes);
    return launch_copy_out(c, args->out, bytes, 0, stream);
}
