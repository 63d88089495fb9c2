// Fused GEMV + AllReduce: y = sum_r W_r x_r, two-phase direct all-reduce.
//
// World size 1 (ROCMOE_GEMV_DIRECT=1, the default) runs a plain GEMV with no protocol at all:
// no task counter, no barrier, no signal. The rows are cut in groups of kRows; the groups
// are split statically and evenly over every wave of a grid that is resident all at once
// (wave_groups), so every compute unit streams the same share of W and the waves finish
// together; each wave writes y of its groups straight into `out`. Block 0 only advances the
// epoch word, as the protocol kernel would. Two kernels do this:
//   gemv_async_kernel   (NVIDIA, the default there) each lane copies its 16-byte vectors of
//                       W (kRows rows) and x with cp.async into its own slots of a
//                       kStages-deep ring in shared memory and computes the step that landed
//                       kStages - 1 steps ago (stream_steps): the bytes in flight are not
//                       bounded by registers, and the pipeline runs on across row groups
//   gemv_direct_kernel  (AMD; NVIDIA when ROCMOE_GEMV_STAGES=0 or the rows are not 16-byte
//                       vectors) kUnroll 16-byte loads per row in flight in registers
// Both compute kRows rows at a time, so that each vector of x serves kRows rows: one wave per
// row loaded x once per row, as many x loads as W loads (for bf16 a 16-byte load is only 8
// elements).
//
// World size > 1: gemv_one_shot_kernel (below, with its comment), one hop across GPUs: every
// rank stores its fp32 partial of every row into every rank's buffer and sums what arrived.
// With ROCMOE_GEMV_ONE_SHOT=0 (every rank alike) or above 64 ranks, and at world size 1 with
// ROCMOE_GEMV_DIRECT=0:
// gemv_all_reduce_kernel, one persistent kernel for the three phases (one launch:
// separate phase-2, wait, copy and ack launches cost ~25 us on a 0.14 ms GEMV on an H200,
// most of the gap to torch's matvec).
//   Phase 1 (reduce-scatter by stores), on the schedule:
//     slice  owner o: rows [split_begin(N, world, o), split_begin(N, world, o + 1)) of the
//            partial product W_r x_r; they are stored as fp32 straight into o's receive
//            buffer at partials[r][row - chunk begin]
//     task   rows_per_tile rows (ROCMOE_GEMV_ROWS; by default about N / workgroups, so that
//            each workgroup claims about once); its waves take groups of kRows rows in turn
//   Phase 2 (all-gather by stores), the task numbers after phase 1's:
//     each workgroup first waits (bounded) for every rank's phase-1 signal of this rank's
//     chunk, then for each destination d and tile of kReduceTile rows sums the partials in
//     rank order (so every rank gets bit-identical y) and stores the tile, converted to the
//     op's dtype, into d's receive buffer at gather_offset; the slice completer signals d.
//   Phase 3 (the last workgroup out): wait for every owner's phase-2 signal; when the caller
//     passes `out`, copy y out of the receive buffer into it and acknowledge every peer (its
//     next-but-one call may reuse this buffer).
//   The handle protocol (rocmoe.h): the epoch comes from the workspace (the last workgroup
//   out advances it), phase-1 deliveries carry a count (N; a rank that rejected its input
//   sends ROCMOE_COUNT_ABORTED instead), and writes into a destination wait for its
//   acknowledgement of call epoch - 2. At world size 1 (ROCMOE_GEMV_DIRECT=0) phase 1 writes
//   y itself.
//
// Accumulation is fp32 everywhere. Knobs, read once per process (benchmarks/gemv_variants.py
// sweeps them; the defaults are the H200 sweep's best, see kDefaultRows):
//   ROCMOE_GEMV_ROWS_PER_WARP  kRows: rows a wave computes at once (default 1 at world
//                              size 1, 2 in the protocol kernel)
//   ROCMOE_GEMV_STAGES         NVIDIA, world size 1: cp.async ring depth (0: registers);
//                              (rows, stages) built: 1x4 1x6 2x3 2x4, others the default 2x4
//   ROCMOE_GEMV_UNROLL         register kernels: 16-byte loads in flight per row and lane;
//                              (rows, unroll) built: 1x4 1x8 2x2 2x4 4x1 4x2, others 2x4
//   ROCMOE_GEMV_LOAD           NVIDIA, register kernel at world size 1: W's loads are
//                              0 ld.global.nc, 1 + L1::no_allocate, 2 + L2::256B prefetch
//                              (unset: 1 on an H100 or H200, else 0; see kNoL1Devices)
//   ROCMOE_GEMV_PER_CU         workgroups per compute unit (at most what fits)
//   ROCMOE_GEMV_DIRECT         0: world size 1 runs the protocol kernel too
//   ROCMOE_GEMV_ROWS           rows per phase-1 task of the protocol kernel (0: automatic)
//   ROCMOE_GEMV_ONE_SHOT       0: world size > 1 runs the two-phase protocol kernel
//   ROCMOE_GEMV_BALANCE        1: the register kernel at world size 1 with one row a wave and
//                              the default unroll splits W's chunks evenly over the waves
//                              (gemv_balanced_kernel, walk_chunks) instead of its rows;
//                              off by default (it lost on three of four H200 shapes)
// Four workgroups of kThreads fit on a compute unit (64 registers on sm_90, 48 KiB of shared
// memory at most): the H200 sweep ran the old GEMV at 0.58 of copy bandwidth with three
// resident, 0.74-0.78 with four.
//
// ROCMOE_GEMV_SCHEDULE_ONLY (tests/ops/test_gemv_schedule.py): only the schedule helpers,
// no kernels launched, so a host program can include this file and run them on the CPU.
#include "fused_common.hpp"

#include "../internal.hpp"

#include <cstdlib>
#include <cstring>

namespace rocmoe {
namespace fused {
namespace {

constexpr int kReduceTile = 2048;
constexpr int kGemvMinBlocks = 4;

// Defaults from the H200 sweep of 2026-12-02 (benchmarks/results/gemv_variants_h200.jsonl,
// CUDA-graph replay against torch.mv): at world size 1 the register kernel with one row a
// wave, four 16-byte loads in flight and plain ld.global.nc loads was the fastest or within
// 0.03 of it on every shape and dtype (bf16 8192^2 1.02, 28672 x 8192 0.99, 16384^2 0.96;
// fp32 1.06-1.42), ahead of the cp.async ring (0.90-0.94 on bf16); the protocol kernel
// (world size > 1) keeps two rows a wave, its best at world size 1 (0.80 against the old
// kernel's 0.73 on bf16 8192^2).
constexpr int kDefaultRows = 1;
constexpr int kDefaultUnroll = 4;
constexpr int kDefaultStages = 0;
constexpr int kDefaultLoad = 0;
// ...except on an H100 or H200, where W's loads skip L1 (kLoadNoL1). Streaming W through
// L1 evicts x, which every wave of the workgroup reads again. The sweeps (one row a wave,
// four loads in flight, CUDA-graph replay against torch.mv):
// - H100, thirty-third session (benchmarks/results/gemv_variants_h100_*thirtythird_session
//   .jsonl): L1::no_allocate ahead of plain ld.global.nc on all six cases of the first
//   (+0.2 to +1.4 %; two children with the plain loads agreed within 0.4 %), with or
//   without the L2 prefetch, and on eight of ten of the second (+0.3 to +1.6 %; 4096^2 fp32
//   +4 %), tied at 8192 x 28672 fp32, behind at 4096^2 bf16 (an 8.5 us call: 1.29 against
//   1.39);
// - H200, thirty-seventh session (results/gemv_variants_h200_l1_thirtyseventh_session*.txt,
//   two runs of the same variants): ahead of both children with plain loads on all ten
//   cases, by 0.1-2.4 % of the replayed time (28672 x 8192 and 16384^2 bf16 0.5-1.1 %,
//   8192^2 bf16 1.9-2.4 %).
// A model is matched after a space, so that the GH200 (not measured) keeps the plain loads.
// ROCMOE_GEMV_LOAD overrides both.
constexpr const char *kNoL1Devices[] = {" H100", " H200"};
// the balanced split (walk_chunks) stays off: timed against the row split on the H200
// (twenty-third session, benchmarks/gpu_host_time.sh gemv_ab, results/
// gemv_balance_ab_h200_twentythird_session.jsonl; torch.mv / rocmoe under CUDA graphs, bf16)
// it ran 1.012 against 0.997 at 16384^2 but lost at 28672 x 8192 (1.056 against 1.074),
// 8192^2 (0.969 against 1.015) and 8192 x 28672 (0.994 against 1.059). At 16384^2 the row
// split ranges 0.980-1.029 over ten placements of W in one process, the balanced split
// 0.991-1.021 (probe_gemv_address_h200_twentythird_session.jsonl): the shape's misses
// follow W's address more than the schedule.
constexpr int kDefaultBalance = 0;
constexpr int kProtocolRows = 2;
constexpr int kProtocolUnroll = 4;

enum WeightLoad : int { kLoadCached = 0, kLoadNoL1 = 1, kLoadNoL1Prefetch = 2 };

// W's load flavour on a device of this name where ROCMOE_GEMV_LOAD is unset: kLoadNoL1 on the
// models of kNoL1Devices, else kDefaultLoad. Host code (default_load asks the driver for the
// name once; tests/ops/test_gemv_schedule.py runs it on the CPU).
inline int load_for_device(const char *name) {
    if (name != nullptr)
        for (const char *model : kNoL1Devices)
            if (std::strstr(name, model) != nullptr) return int(kLoadNoL1);
    return kDefaultLoad;
}

struct GemvParams {
    const void *w;
    const void *x;
    int64_t n, k;
    int64_t chunk_stride;     // ceil(n / world): floats per source in the partials area
    uint64_t gather_offset;   // bytes
    uint64_t rows_per_tile;   // rows of a phase-1 task
    int vec;                  // 16-byte loads: K a multiple of a vector, W and x aligned
};

// --- schedule (host and device: tests/ops/test_gemv_schedule.py runs it on the CPU) -----

// Row groups [begin, end) of wave q when `groups` groups are split over `waves` waves: the
// counts differ by one at most.
struct GroupRange {
    int64_t begin, end;
};

ROCMOE_HD inline GroupRange wave_groups(int64_t groups, int32_t waves, int32_t q) {
    return GroupRange{sched::split_begin(groups, waves, q),
                      sched::split_begin(groups, waves, q + 1)};
}

// The balanced split (ROCMOE_GEMV_BALANCE=1, world size 1, one row a wave). The row split
// above hands out whole rows, so the waves' shares differ by a row: at 16384 rows over 4,224
// waves, 3,712 waves take 4 rows and 512 take 3, and an eighth of the waves idle through the
// last row while the rest still stream. The balanced split cuts every row into chunks (one
// wave-wide step: `wave` 16-byte vectors; a row's last chunk may be short), numbers the
// chunks row after row, and gives every wave the same count of consecutive chunks, to within
// one. A row cut between two waves is summed through a slot: slot q holds the row that
// straddles the start of wave q's chunks. Each of its two waves exchanges its part into the
// slot; the second one in adds the two parts, stores y and clears the slot for the next call
// (a + b is b + a, so y does not depend on which wave came second).
ROCMOE_HD inline int64_t chunks_per_row(int64_t nvec, int wave) { return (nvec + wave - 1) / wave; }

// Whether the balanced split applies: every wave has at least a row's chunks, so no row is
// cut more than once (a wave whose chunks lay inside one row would make a third part).
ROCMOE_HD inline bool balanced_split_fits(int64_t rows, int64_t per_row, int32_t waves) {
    return rows > 0 && per_row > 0 && waves > 0 && (rows * per_row) / waves >= per_row;
}

// Wave q's chunks, row by row: ops.segment(row, from, to) accumulates chunks [from, to) of
// the row; then ops.store(row) when the row was whole in this wave, else
// ops.share(row, slot) with the row's slot (1 .. waves - 1). Needs balanced_split_fits.
template <class Ops>
ROCMOE_HD inline void walk_chunks(Ops &ops, int64_t rows, int64_t per_row, int32_t waves,
                                  int32_t q) {
    const int64_t total = rows * per_row;
    const int64_t end = sched::split_begin(total, waves, q + 1);
    for (int64_t c = sched::split_begin(total, waves, q); c < end;) {
        const int64_t row = c / per_row;
        const int64_t row_begin = row * per_row, row_end = row_begin + per_row;
        const int64_t stop = end < row_end ? end : row_end;
        ops.segment(row, c - row_begin, stop - row_begin);
        if (c == row_begin && stop == row_end)
            ops.store(row);
        else  // begun by wave q - 1 (slot q), or carried on by wave q + 1 (slot q + 1)
            ops.share(row, c > row_begin ? q : q + 1);
        c = stop;
    }
}

// One wave's software pipeline over its row groups: each group is `steps` steps (a step:
// one 16-byte vector per lane of each of the group's rows, and of x), taken in order
// across the groups, so the pipeline never drains between two groups. Step t goes into
// slot t % kStages; kStages - 1 steps are in flight while one is computed. `ops`:
//   issue(slot, group, step)  start copying a step into a slot
//   commit()                  close the copies issued since the last commit into one group
//                             (also when none was issued, so that the count stays exact)
//   wait()                    until at most kStages - 2 committed groups are incomplete
//   consume(slot)             accumulate the step in the slot
//   finish(group)             the group's steps are all consumed: reduce and store it
// The slot a step is issued into was consumed one iteration earlier (by this same thread,
// which alone reads and writes its slots), so no barrier is needed.
template <int kStages, class Ops>
ROCMOE_HD inline void stream_steps(Ops &ops, GroupRange groups, int32_t steps) {
    static_assert(kStages >= 2, "a pipeline has two stages at least");
    if (steps <= 0) {  // K == 0: y = 0
        for (int64_t g = groups.begin; g < groups.end; ++g) ops.finish(g);
        return;
    }
    int64_t issue_group = groups.begin;
    int32_t issue_step = 0;
    int issue_slot = 0;
    for (int s = 0; s < kStages - 1; ++s) {
        if (issue_group < groups.end) {
            ops.issue(issue_slot, issue_group, issue_step);
            if (++issue_step == steps) {
                issue_step = 0;
                ++issue_group;
            }
        }
        ops.commit();
        issue_slot = issue_slot + 1 == kStages ? 0 : issue_slot + 1;
    }
    int slot = 0;
    int32_t step = 0;
    for (int64_t g = groups.begin; g < groups.end;) {
        ops.wait();
        if (issue_group < groups.end) {
            ops.issue(issue_slot, issue_group, issue_step);
            if (++issue_step == steps) {
                issue_step = 0;
                ++issue_group;
            }
        }
        ops.commit();
        issue_slot = issue_slot + 1 == kStages ? 0 : issue_slot + 1;
        ops.consume(slot);
        slot = slot + 1 == kStages ? 0 : slot + 1;
        if (++step == steps) {
            step = 0;
            ops.finish(g);
            ++g;
        }
    }
}

#if !defined(ROCMOE_GEMV_SCHEDULE_ONLY)
// --- loads --------------------------------------------------------------------------------

// W: read once and not written while the kernel runs, so the non-coherent path
// (ld.global.nc) may serve it; kLoad says whether it allocates in L1 and whether the L2
// fetches 256 bytes at a time. AMD: a plain load.
template <int kLoad>
__device__ __forceinline__ uint4 load_weights(const uint4 *p) {
#if defined(ROCMOE_PLATFORM_NVIDIA)
    if constexpr (kLoad == kLoadCached) {
        return __ldg(p);
    } else {
        uint4 v;
        if constexpr (kLoad == kLoadNoL1)
            asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                : "l"(p));
        else
            asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                : "l"(p));
        return v;
    }
#else
    return *p;
#endif
}

// x: read by every wave, kept in L1
__device__ __forceinline__ uint4 load_x(const uint4 *p) {
#if defined(ROCMOE_PLATFORM_NVIDIA)
    return __ldg(p);
#else
    return *p;
#endif
}

__device__ __forceinline__ int64_t chunk_begin(const GemvParams &p, int world, int o) {
    return sched::split_begin(p.n, world, o);
}

// even + odd += the dot product of the 16-byte vector wv with fx (two chains of FMAs)
template <class T>
__device__ __forceinline__ void dot_vector(const uint4 &wv, const float *fx, float &even,
                                           float &odd) {
    constexpr int V = vec_elems<T>();
    float fw[V];
    unpack<T>(wv, fw);
#pragma unroll
    for (int e = 0; e < V; e += 2) {
        even = fmaf(fw[e], fx[e], even);
        odd = fmaf(fw[e + 1], fx[e + 1], odd);
    }
}

// One wave: the dot products of kRows rows of W (row j at row0 + j * k; rows at and past
// `valid` repeat row valid - 1, so the loads need no branch, and only valid rows are
// stored) with x, kUnroll 16-byte loads per row in flight. acc[j]: this lane's share.
template <class T, int kRows, int kUnroll, int kLoad>
__device__ __forceinline__ void rows_dot(const typename T::storage *row0, int valid,
                                         const typename T::storage *x, int64_t k, bool vec,
                                         int lane, float (&acc)[kRows]) {
    using S = typename T::storage;
    float even[kRows], odd[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) even[j] = odd[j] = 0.f;
    if (vec) {
        constexpr int V = vec_elems<T>();
        const int64_t nvec = k / V;
        const uint4 *w[kRows];
#pragma unroll
        for (int j = 0; j < kRows; ++j)
            w[j] = reinterpret_cast<const uint4 *>(row0 + int64_t(j < valid ? j : valid - 1) * k);
        const uint4 *xv = reinterpret_cast<const uint4 *>(x);
        int64_t i = lane;
        for (; i + (kUnroll - 1) * ROCMOE_WAVE_SIZE < nvec; i += kUnroll * ROCMOE_WAVE_SIZE) {
            uint4 a[kRows][kUnroll];
#pragma unroll
            for (int j = 0; j < kRows; ++j)
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    a[j][u] = load_weights<kLoad>(w[j] + i + u * ROCMOE_WAVE_SIZE);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                float fx[V];
                unpack<T>(load_x(xv + i + u * ROCMOE_WAVE_SIZE), fx);
#pragma unroll
                for (int j = 0; j < kRows; ++j) dot_vector<T>(a[j][u], fx, even[j], odd[j]);
            }
        }
        for (; i < nvec; i += ROCMOE_WAVE_SIZE) {
            uint4 a[kRows];
#pragma unroll
            for (int j = 0; j < kRows; ++j) a[j] = load_weights<kLoad>(w[j] + i);
            float fx[V];
            unpack<T>(load_x(xv + i), fx);
#pragma unroll
            for (int j = 0; j < kRows; ++j) dot_vector<T>(a[j], fx, even[j], odd[j]);
        }
    } else {
        // K not a multiple of a vector, or W / x not 16-byte aligned: element by element
        for (int64_t i = lane; i < k; i += ROCMOE_WAVE_SIZE) {
            const float xf = T::load(x[i]);
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
                const S *row = row0 + int64_t(j < valid ? j : valid - 1) * k;
                even[j] = fmaf(T::load(row[i]), xf, even[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) acc[j] = even[j] + odd[j];
}

// the handle's call count, advanced as the protocol kernel does (nothing at world size 1
// waits on it; the abort kernel and the next call read it)
__device__ __forceinline__ void advance_epoch(uint64_t *epoch_word) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        volatile uint64_t *e = epoch_word;
        *e = *e + 1;
    }
}

// World size 1, registers: wave q of the grid computes its wave_groups, kRows rows at a time.
template <class T, int kRows, int kUnroll, int kLoad>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks)
    gemv_direct_kernel(const typename T::storage *W, const typename T::storage *x,
                       typename T::storage *y, int64_t n, int64_t k, int vec,
                       uint64_t *epoch_word) {
    advance_epoch(epoch_word);
    const int lane = threadIdx.x % ROCMOE_WAVE_SIZE;
    const int32_t q = int32_t(blockIdx.x) * kWaves + int32_t(threadIdx.x / ROCMOE_WAVE_SIZE);
    const GroupRange mine = wave_groups((n + kRows - 1) / kRows, int32_t(gridDim.x) * kWaves, q);
    for (int64_t g = mine.begin; g < mine.end; ++g) {
        const int64_t r0 = g * kRows;
        const int valid = int(n - r0 < kRows ? n - r0 : kRows);
        float acc[kRows];
        rows_dot<T, kRows, kUnroll, kLoad>(W + r0 * k, valid, x, k, vec != 0, lane, acc);
#pragma unroll
        for (int j = 0; j < kRows; ++j) acc[j] = wave_sum(acc[j]);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < kRows; ++j)
                if (j < valid) y[r0 + j] = T::store(acc[j]);
        }
    }
}

// walk_chunks' operations for one lane of gemv_balanced_kernel: chunk c of a row is its
// vectors [c * wave, (c + 1) * wave), of which this lane loads the one at c * wave + lane
// (kUnroll chunks in flight, as rows_dot's kUnroll loads)
template <class T, int kUnroll, int kLoad>
struct ChunkLane {
    using S = typename T::storage;
    const uint4 *w;    // W as vectors
    const uint4 *x;
    S *y;
    unsigned long long *slots;  // the workspace's slots, one a wave (walk_chunks)
    int64_t nvec;      // vectors a row
    int64_t whole;     // chunks of a row whose `wave` vectors all exist
    int lane;
    float even, odd;

    __device__ __forceinline__ void segment(int64_t row, int64_t from, int64_t to) {
        const uint4 *wr = w + row * nvec + lane;
        const uint4 *xl = x + lane;
        int64_t c = from;
        const int64_t bulk = to < whole ? to : whole;
        for (; c + kUnroll <= bulk; c += kUnroll) {
            uint4 a[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                a[u] = load_weights<kLoad>(wr + (c + u) * ROCMOE_WAVE_SIZE);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                float fx[vec_elems<T>()];
                unpack<T>(load_x(xl + (c + u) * ROCMOE_WAVE_SIZE), fx);
                dot_vector<T>(a[u], fx, even, odd);
            }
        }
        for (; c < to; ++c) {  // fewer than kUnroll chunks left, or the row's short last one
            if (c * ROCMOE_WAVE_SIZE + lane < nvec) {
                const uint4 a = load_weights<kLoad>(wr + c * ROCMOE_WAVE_SIZE);
                float fx[vec_elems<T>()];
                unpack<T>(load_x(xl + c * ROCMOE_WAVE_SIZE), fx);
                dot_vector<T>(a, fx, even, odd);
            }
        }
    }
    __device__ __forceinline__ float take_sum() {
        const float v = wave_sum(even + odd);
        even = odd = 0.f;
        return v;
    }
    __device__ __forceinline__ void store(int64_t row) {
        const float v = take_sum();
        if (lane == 0) y[row] = T::store(v);
    }
    // the part travels in the slot's low word, "a part is in" in its high word: one atomic
    // exchange both deposits this part and collects the other wave's, if it came first
    __device__ __forceinline__ void share(int64_t row, int32_t slot) {
        const float v = take_sum();
        if (lane == 0) {
            const unsigned long long mine = (1ull << 32) | __float_as_uint(v);
            const unsigned long long other = atomicExch(slots + slot, mine);
            if (other >> 32) {
                y[row] = T::store(v + __uint_as_float(uint32_t(other)));
                slots[slot] = 0ull;  // both parts taken: no wave touches the slot again
            }
        }
    }
};

// World size 1, balanced split (walk_chunks): every wave streams the same count of W's
// chunks. Needs 16-byte vectors, K > 0, balanced_split_fits and a zeroed slot per wave.
template <class T, int kUnroll, int kLoad>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks)
    gemv_balanced_kernel(const typename T::storage *W, const typename T::storage *x,
                         typename T::storage *y, int64_t n, int64_t k,
                         unsigned long long *slots, uint64_t *epoch_word) {
    advance_epoch(epoch_word);
    ChunkLane<T, kUnroll, kLoad> ops;
    ops.w = reinterpret_cast<const uint4 *>(W);
    ops.x = reinterpret_cast<const uint4 *>(x);
    ops.y = y;
    ops.slots = slots;
    ops.nvec = k / vec_elems<T>();
    ops.whole = ops.nvec / ROCMOE_WAVE_SIZE;
    ops.lane = int(threadIdx.x % ROCMOE_WAVE_SIZE);
    ops.even = ops.odd = 0.f;
    const int32_t q = int32_t(blockIdx.x) * kWaves + int32_t(threadIdx.x / ROCMOE_WAVE_SIZE);
    walk_chunks(ops, n, chunks_per_row(ops.nvec, ROCMOE_WAVE_SIZE), int32_t(gridDim.x) * kWaves,
                q);
}

#if defined(ROCMOE_PLATFORM_NVIDIA)
// --- cp.async pipeline (sm_80 and later) ----------------------------------------------

// 16 bytes from global to shared memory, asynchronously; src_bytes 0 writes zeros and reads
// nothing. W: L2 only (it is read once), fetched 256 bytes at a time; x: through L1 (every
// wave reads it).
__device__ __forceinline__ void copy_weights_async(uint4 *dst, const uint4 *src, int src_bytes) {
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(to), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void copy_x_async(uint4 *dst, const uint4 *src, int src_bytes) {
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

template <int kPending>
__device__ __forceinline__ void wait_async() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

constexpr int kSharedLimit = 48 << 10;  // dynamic shared memory without an opt-in

// Shared memory of gemv_async_kernel: per thread, kStages slots of kRows + 1 vectors (the
// rows, then x), laid out [slot][vector][thread] so a wave's 16-byte accesses are contiguous.
template <int kRows, int kStages>
constexpr int async_shared_bytes() {
    return kStages * (kRows + 1) * kThreads * 16;
}

// stream_steps' operations for one lane of gemv_async_kernel
template <class T, int kRows, int kStages>
struct AsyncLane {
    using S = typename T::storage;
    const uint4 *w;   // W as vectors
    const uint4 *x;
    S *y;
    int64_t n;        // rows
    int64_t nvec;     // vectors per row
    uint4 *slots;     // this thread's first vector
    int lane;
    // the issue side: this lane's next vector of the group's first row and of x, how many
    // vectors of a row are left from there, and the group's rows inside W
    const uint4 *next_w, *next_x;
    int64_t left;
    int valid;
    float even[kRows], odd[kRows];

    __device__ __forceinline__ uint4 *slot(int s, int v) const {
        return slots + (s * (kRows + 1) + v) * kThreads;
    }
    __device__ __forceinline__ void issue(int s, int64_t group, int32_t step) {
        if (step == 0) {
            const int64_t r0 = group * kRows;
            next_w = w + r0 * nvec + lane;
            next_x = x + lane;
            left = nvec - lane;
            valid = int(n - r0 < kRows ? n - r0 : kRows);
        }
        const bool in_row = left > 0;  // past the row's end: zeros, nothing read
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            const bool ok = in_row && j < valid;
            copy_weights_async(slot(s, j), ok ? next_w + j * nvec : w, ok ? 16 : 0);
        }
        copy_x_async(slot(s, kRows), in_row ? next_x : x, in_row ? 16 : 0);
        next_w += ROCMOE_WAVE_SIZE;
        next_x += ROCMOE_WAVE_SIZE;
        left -= ROCMOE_WAVE_SIZE;
    }
    __device__ __forceinline__ void commit() {
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    __device__ __forceinline__ void wait() { wait_async<kStages - 2>(); }
    __device__ __forceinline__ void consume(int s) {
        float fx[vec_elems<T>()];
        unpack<T>(*slot(s, kRows), fx);
#pragma unroll
        for (int j = 0; j < kRows; ++j) dot_vector<T>(*slot(s, j), fx, even[j], odd[j]);
    }
    __device__ __forceinline__ void finish(int64_t group) {
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            const float v = wave_sum(even[j] + odd[j]);
            const int64_t r = group * kRows + j;
            if (lane == 0 && r < n) y[r] = T::store(v);
            even[j] = odd[j] = 0.f;
        }
    }
};

// World size 1, cp.async: wave q of the grid computes its wave_groups through stream_steps.
// Needs 16-byte vectors (K a multiple of one, W and x aligned).
template <class T, int kRows, int kStages>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks)
    gemv_async_kernel(const typename T::storage *W, const typename T::storage *x,
                      typename T::storage *y, int64_t n, int64_t k, uint64_t *epoch_word) {
    extern __shared__ __align__(16) uint4 gemv_stages[];
    advance_epoch(epoch_word);
    const int lane = threadIdx.x % ROCMOE_WAVE_SIZE;
    const int32_t q = int32_t(blockIdx.x) * kWaves + int32_t(threadIdx.x / ROCMOE_WAVE_SIZE);
    const GroupRange mine = wave_groups((n + kRows - 1) / kRows, int32_t(gridDim.x) * kWaves, q);
    AsyncLane<T, kRows, kStages> ops;
    ops.w = reinterpret_cast<const uint4 *>(W);
    ops.x = reinterpret_cast<const uint4 *>(x);
    ops.y = y;
    ops.n = n;
    ops.nvec = k / vec_elems<T>();
    ops.slots = gemv_stages + threadIdx.x;
    ops.lane = lane;
    ops.next_w = ops.w;  // set by the first issue (step 0 of a group)
    ops.next_x = ops.x;
    ops.left = 0;
    ops.valid = 0;
#pragma unroll
    for (int j = 0; j < kRows; ++j) ops.even[j] = ops.odd[j] = 0.f;
    const int32_t steps = int32_t((ops.nvec + ROCMOE_WAVE_SIZE - 1) / ROCMOE_WAVE_SIZE);
    stream_steps<kStages>(ops, mine, steps);
}
#endif  // ROCMOE_PLATFORM_NVIDIA

template <int kRows>
__device__ __forceinline__ void wave_sums(float (&acc)[kRows]) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) acc[j] = wave_sum(acc[j]);
}

// W's loads in the protocol kernel: the plain read-only path, as before the world-size-1
// kernels (what the others would do there has not been measured with peers)
constexpr int kProtocolLoad = kLoadCached;

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
template <class T, int kRows, int kUnroll>
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
            // the tile's rows in groups of kRows, taken by the waves in turn
            const uint64_t groups = (last - first + kRows - 1) / kRows;
            if (alone) {
                // y itself, in the op's dtype, straight into the output
                S *y = static_cast<S *>(out) + cb;
                for (uint64_t g = wave; g < groups; g += kWaves) {
                    const uint64_t r0 = first + g * kRows;
                    const int valid = int(last - r0 < kRows ? last - r0 : kRows);
                    float acc[kRows];
                    rows_dot<T, kRows, kUnroll, kProtocolLoad>(W + (cb + int64_t(r0)) * p.k, valid,
                                                               x, p.k, p.vec != 0, lane, acc);
                    wave_sums(acc);
                    if (lane == 0) {
#pragma unroll
                        for (int j = 0; j < kRows; ++j)
                            if (j < valid) y[r0 + j] = T::store(acc[j]);
                    }
                }
                continue;
            }
            float *partials = static_cast<float *>(shmem::peer_ptr(c.team, recv, task.dest));
            if (free_to_write && partials != nullptr) {
                float *dst = partials + int64_t(me) * p.chunk_stride;
                for (uint64_t g = wave; g < groups; g += kWaves) {
                    const uint64_t r0 = first + g * kRows;
                    const int valid = int(last - r0 < kRows ? last - r0 : kRows);
                    float acc[kRows];
                    rows_dot<T, kRows, kUnroll, kProtocolLoad>(W + (cb + int64_t(r0)) * p.k, valid,
                                                               x, p.k, p.vec != 0, lane, acc);
                    wave_sums(acc);
                    if (lane == 0) {
#pragma unroll
                        for (int j = 0; j < kRows; ++j)
                            if (j < valid) dst[r0 + j] = acc[j];
                    }
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

// Loads of what peers stored into this rank's receive buffer during this call: past L1,
// which may still hold the lines of the call before last (same buffer parity).
__device__ __forceinline__ float load_arrived(const float *p) {
#if defined(ROCMOE_PLATFORM_NVIDIA)
    return __ldcg(p);
#else
    return __builtin_nontemporal_load(p);
#endif
}

// World size > 1 (ROCMOE_GEMV_ONE_SHOT=1, the default there): a one-shot all-reduce by
// stores, one persistent kernel. Task numbers, claimed in order:
//   [0, workers)           range i: the rows of waves [i kWaves, (i + 1) kWaves) of the
//                          world-size-1 split (wave_groups over workers x kWaves waves); each
//                          row's fp32 partial W_r x_r goes into every rank's receive buffer
//                          at partials[r][row]. The task that completes the last range
//                          delivers (count N, then the signal) to every rank.
//   [workers, + slices)    kSumRows rows of y: once (per workgroup) every source's delivery
//                          has arrived (bounded wait), sum its partials in rank order, so
//                          every rank gets bit-identical y, into `out`.
// A workgroup that waits for deliveries has claimed a task past every range, so every range
// is held by a running workgroup that waits for nothing: no deadlock whatever the residency.
// The last workgroup out advances the epoch word and acknowledges every peer. One hop across
// GPUs where gemv_all_reduce_kernel has two (reduce-scatter, then all-gather, each a system
// fence and a signal on the critical path), for world x N x 4 bytes of stores instead of
// 2 N x 4: the vectors of a GEMV are small.
constexpr int kOneShotMaxWorld = 64;
constexpr int kSumRows = 1024;

template <class T, int kRows, int kUnroll>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks)
    gemv_one_shot_kernel(Common c, GemvParams p, void *out, uint32_t workers) {
    using S = typename T::storage;
    __shared__ float *s_part[kOneShotMaxWorld];  // where this rank's partials go, per rank
    __shared__ uint64_t s_epoch;
    __shared__ uint32_t s_id;
    __shared__ int s_last;
    const int world = c.topo.world;
    const int me = c.topo.rank;
    const int tid = threadIdx.x;
    const int lane = tid % ROCMOE_WAVE_SIZE;
    if (tid == 0) {
        const uint64_t epoch = c.next_epoch();
        char *recv = c.recv(epoch);
        AckCache cache{0};
        for (int d = 0; d < world; ++d) {
            float *part = nullptr;
            // d's buffer of this parity is free once d has read call epoch - 2
            if (wait_dest_free(c, cache, d, epoch)) {
                part = static_cast<float *>(shmem::peer_ptr(c.team, recv, d));
                if (part == nullptr)  // 4-byte scattered stores need load/store reach
                    c.record(ws::status_data(world, d), ROCMOE_STATUS_TIMEOUT, epoch);
                else
                    part += int64_t(me) * p.n;
            }
            s_part[d] = part;
        }
        s_epoch = epoch;
    }
    __syncthreads();
    const uint64_t epoch = s_epoch;
    const sched::Counters counters = c.sched_counters(0);
    const S *W = static_cast<const S *>(p.w);
    const S *x = static_cast<const S *>(p.x);
    const float *partials = reinterpret_cast<const float *>(c.recv(epoch));
    S *y = static_cast<S *>(out);
    const int64_t groups = (p.n + kRows - 1) / kRows;
    const int32_t waves = int32_t(workers) * kWaves;
    const uint32_t slices = uint32_t((p.n + kSumRows - 1) / kSumRows);
    bool arrived = false;  // thread 0's view: every source's delivery is in
    for (;;) {
        if (tid == 0) {
            const uint32_t id = sched::claim(counters);
            if (id >= workers && id - workers < slices && !arrived) {
                // a source that sent nothing usable leaves y wrong, reported by its status
                for (int src = 0; src < world; ++src)
                    receive(c, src, epoch, c.layout.capacity, p.n);
                arrived = true;
            }
            s_id = id;
        }
        __syncthreads();
        const uint32_t id = s_id;
        __syncthreads();
        if (id < workers) {
            const int32_t q = int32_t(id) * kWaves + int32_t(tid / ROCMOE_WAVE_SIZE);
            const GroupRange mine = wave_groups(groups, waves, q);
            for (int64_t g = mine.begin; g < mine.end; ++g) {
                const int64_t r0 = g * kRows;
                const int valid = int(p.n - r0 < kRows ? p.n - r0 : kRows);
                float acc[kRows];
                rows_dot<T, kRows, kUnroll, kProtocolLoad>(W + r0 * p.k, valid, x, p.k,
                                                           p.vec != 0, lane, acc);
                wave_sums(acc);
                if (lane == 0) {
                    for (int d = 0; d < world; ++d) {
                        float *part = s_part[d];
                        if (part == nullptr) continue;
#pragma unroll
                        for (int j = 0; j < kRows; ++j)
                            if (j < valid) part[r0 + j] = acc[j];
                    }
                }
            }
            // every thread's stores visible system-wide before the range counts as done
            __threadfence_system();
            __syncthreads();
            if (tid == 0 && sched::complete(counters, sched::Task{0, 0, id, workers})) {
                for (int d = 0; d < world; ++d)
                    if (s_part[d] != nullptr) deliver(c, d, epoch, p.n);
            }
        } else if (id - workers < slices) {
            const int64_t first = int64_t(id - workers) * kSumRows;
            const int64_t last = first + kSumRows < p.n ? first + kSumRows : p.n;
            for (int64_t i = first + tid; i < last; i += kThreads) {
                float sum = 0.f;
                for (int src = 0; src < world; ++src)
                    sum += load_arrived(partials + int64_t(src) * p.n + i);
                y[i] = T::store(sum);
            }
        } else {
            break;
        }
    }
    if (tid == 0) s_last = sched::exit_worker(counters, workers) ? 1 : 0;
    __syncthreads();
    if (!s_last) return;
    // the last workgroup out: every other one has finished its stores and reads
    __threadfence();
    if (tid == 0) *c.epoch_word() = epoch;
    // every read of this rank's receive buffer is done: peers may reuse it
    for (int d = tid; d < world; d += kThreads) shmem::signal_set(c.team, c.ack(me), epoch, d);
}

// The knobs (see the top of this file), read once per process.
struct Tuning {
    int rows;           // ROCMOE_GEMV_ROWS_PER_WARP
    int unroll;         // ROCMOE_GEMV_UNROLL
    int stages;         // ROCMOE_GEMV_STAGES
    int load;           // ROCMOE_GEMV_LOAD
    int per_cu;         // ROCMOE_GEMV_PER_CU
    int direct;         // ROCMOE_GEMV_DIRECT
    int rows_per_task;  // ROCMOE_GEMV_ROWS (<= 0: automatic)
    int one_shot;       // ROCMOE_GEMV_ONE_SHOT
    int balance;        // ROCMOE_GEMV_BALANCE
};

// W's load flavour where ROCMOE_GEMV_LOAD is unset: per model of the current device
// (kNoL1Devices). tuning() asks once per process, with the other knobs.
int default_load() {
#if defined(ROCMOE_PLATFORM_NVIDIA)
    int device = 0;
    cudaDeviceProp prop;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, device) != cudaSuccess)
        return kDefaultLoad;
    return load_for_device(prop.name);
#else
    return kDefaultLoad;
#endif
}

const Tuning &tuning() {
    static const Tuning t = {env_int("ROCMOE_GEMV_ROWS_PER_WARP", 0),
                             env_int("ROCMOE_GEMV_UNROLL", 0),
                             env_int("ROCMOE_GEMV_STAGES", kDefaultStages),
                             env_int("ROCMOE_GEMV_LOAD", default_load()),
                             env_int("ROCMOE_GEMV_PER_CU", kGemvMinBlocks),
                             env_int("ROCMOE_GEMV_DIRECT", 1),
                             env_int("ROCMOE_GEMV_ROWS", 0),
                             env_int("ROCMOE_GEMV_ONE_SHOT", 1),
                             env_int("ROCMOE_GEMV_BALANCE", kDefaultBalance)};
    return t;
}

int launched() {
    const hipError_t e = hipGetLastError();
    if (e != hipSuccess)
        return fail(ROCMOE_ERR_SYSTEM, "gemv_all_reduce: kernel launch failed: %s",
                    hipGetErrorString(e));
    return ROCMOE_OK;
}

// World-size-1 grid: what fits (at most ROCMOE_GEMV_PER_CU a compute unit), and no more
// workgroups than there are row groups for their waves.
int direct_workgroups(const GemvParams &p, int rows, int requested, int fits) {
    const int per_cu = tuning().per_cu > 0 && tuning().per_cu < fits ? tuning().per_cu : fits;
    const uint64_t groups = (uint64_t(p.n) + uint64_t(rows) - 1) / uint64_t(rows);
    const uint64_t wanted = (groups + kWaves - 1) / kWaves;
    return persistent_workgroups(requested, uint32_t(wanted < 0x7fffffffu ? wanted : 0x7fffffffu),
                                 per_cu);
}

uint64_t *epoch_word_of(const Common &c) {
    return reinterpret_cast<uint64_t *>(c.ws + ws::epoch_word(c.layout));
}

// The balanced split's launch (gemv_balanced_kernel) on the register kernel's grid, or false
// (nothing launched) where it does not apply: its slots, one uint64 a wave, live in the
// receive buffers, which nothing else uses at world size 1 (zeroed with the workspace;
// every call leaves them zero again).
template <class T, int kUnroll, int kLoad>
bool launch_balanced(const Common &c, const GemvParams &p, int requested, void *out,
                     hipStream_t stream, int *rc) {
    using S = typename T::storage;
    if (tuning().balance == 0 || !p.vec || p.k <= 0 || c.topo.world != 1) return false;
    static const int fits =
        resident_per_cu(gemv_balanced_kernel<T, kUnroll, kLoad>, 0, kGemvMinBlocks);
    const int workers = direct_workgroups(p, 1, requested, fits);
    const int64_t waves = int64_t(workers) * kWaves;
    const int64_t per_row = chunks_per_row(p.k / vec_elems<T>(), ROCMOE_WAVE_SIZE);
    if (waves > 0x7fffffff || !balanced_split_fits(p.n, per_row, int32_t(waves)) ||
        uint64_t(waves) * 8u > 2u * c.layout.parity_bytes)
        return false;
    auto *slots = reinterpret_cast<unsigned long long *>(c.ws + c.layout.recv);
    hipLaunchKernelGGL((gemv_balanced_kernel<T, kUnroll, kLoad>), dim3(workers), dim3(kThreads),
                       0, stream, static_cast<const S *>(p.w), static_cast<const S *>(p.x),
                       static_cast<S *>(out), p.n, p.k, slots, epoch_word_of(c));
    *rc = launched();
    return true;
}

template <class T, int kRows, int kUnroll, int kLoad>
int launch_direct(const Common &c, const GemvParams &p, int requested, void *out,
                  hipStream_t stream) {
    using S = typename T::storage;
    if constexpr (kRows == 1 && kUnroll == kDefaultUnroll) {
        int rc = ROCMOE_OK;
        if (launch_balanced<T, kUnroll, kLoad>(c, p, requested, out, stream, &rc)) return rc;
    }
    static const int fits =
        resident_per_cu(gemv_direct_kernel<T, kRows, kUnroll, kLoad>, 0, kGemvMinBlocks);
    const int workers = direct_workgroups(p, kRows, requested, fits);
    hipLaunchKernelGGL((gemv_direct_kernel<T, kRows, kUnroll, kLoad>), dim3(workers),
                       dim3(kThreads), 0, stream, static_cast<const S *>(p.w),
                       static_cast<const S *>(p.x), static_cast<S *>(out), p.n, p.k, p.vec,
                       epoch_word_of(c));
    return launched();
}

#if defined(ROCMOE_PLATFORM_NVIDIA)
template <class T, int kRows, int kStages>
int launch_async(const Common &c, const GemvParams &p, int requested, void *out,
                 hipStream_t stream) {
    using S = typename T::storage;
    constexpr int shared = async_shared_bytes<kRows, kStages>();
    static_assert(shared <= kSharedLimit, "the ring must fit without a shared-memory opt-in");
    static const int fits =
        resident_per_cu(gemv_async_kernel<T, kRows, kStages>, shared, kGemvMinBlocks);
    const int workers = direct_workgroups(p, kRows, requested, fits);
    hipLaunchKernelGGL((gemv_async_kernel<T, kRows, kStages>), dim3(workers), dim3(kThreads),
                       shared, stream, static_cast<const S *>(p.w), static_cast<const S *>(p.x),
                       static_cast<S *>(out), p.n, p.k, epoch_word_of(c));
    return launched();
}
#endif

template <class T, int kRows, int kUnroll>
int launch_protocol(const Common &c, GemvParams p, int requested, void *out, hipStream_t stream) {
    const int world = c.topo.world;
    const size_t smem = sizeof(uint32_t) * 2 * (2 * size_t(world) + 1);  // two plans
    const int per_cu = tuning().per_cu > 0 ? tuning().per_cu : kGemvMinBlocks;
    if (tuning().rows_per_task > 0) {
        p.rows_per_tile = uint64_t(tuning().rows_per_task);
    } else {
        // about one phase-1 task per workgroup: the claim, the barriers and the fence of a
        // task are paid about once per workgroup, and no workgroup is left without one
        const uint64_t most = uint64_t(persistent_workgroups(requested, 0x7fffffffu, per_cu));
        uint64_t tile = (uint64_t(p.n) + most - 1) / (most > 0 ? most : 1);
        tile = (tile + kRows - 1) / kRows * kRows;
        const uint64_t least = uint64_t(kWaves) * kRows;  // a group for every wave
        p.rows_per_tile = tile > least ? tile : least;
    }
    uint32_t total1 = 0;
    for (int o = 0; o < world; ++o) {
        const int64_t rows = sched::split_begin(p.n, world, o + 1) - sched::split_begin(p.n, world, o);
        total1 += sched::tasks_for_rows(uint64_t(rows), p.rows_per_tile);
    }
    const int64_t mine = sched::split_begin(p.n, world, c.topo.rank + 1) -
                         sched::split_begin(p.n, world, c.topo.rank);
    const uint32_t total2 = uint32_t(world) * sched::tasks_for_rows(uint64_t(mine), kReduceTile);
    const int workers = persistent_workgroups(requested, total1 + total2, per_cu);
    hipLaunchKernelGGL((gemv_all_reduce_kernel<T, kRows, kUnroll>), dim3(workers),
                       dim3(kThreads), smem, stream, c, p, out, uint32_t(workers));
    return launched();
}

// World size > 1 with the one-shot kernel: the world-size-1 grid (what is resident, no more
// workgroups than the row groups' waves need): the ranges are the direct kernel's split
template <class T, int kRows, int kUnroll>
int launch_one_shot(const Common &c, const GemvParams &p, int requested, void *out,
                    hipStream_t stream) {
    static const int fits =
        resident_per_cu(gemv_one_shot_kernel<T, kRows, kUnroll>, 0, kGemvMinBlocks);
    const int workers = direct_workgroups(p, kRows, requested, fits);
    hipLaunchKernelGGL((gemv_one_shot_kernel<T, kRows, kUnroll>), dim3(workers), dim3(kThreads),
                       0, stream, c, p, out, uint32_t(workers));
    return launched();
}

// whether this call runs gemv_one_shot_kernel (else, at world size > 1, gemv_all_reduce_kernel)
bool one_shot(const Common &c) {
    return c.topo.world > 1 && c.topo.world <= kOneShotMaxWorld && tuning().one_shot != 0;
}

// register kernels: the world-size-1 one (with W's load flavour), the one-shot kernel or the
// protocol kernel
template <class T, int kRows, int kUnroll>
int launch_registers(const Common &c, const GemvParams &p, int requested, void *out,
                     hipStream_t stream) {
    if (one_shot(c)) return launch_one_shot<T, kRows, kUnroll>(c, p, requested, out, stream);
    if (c.topo.world > 1 || tuning().direct == 0)
        return launch_protocol<T, kRows, kUnroll>(c, p, requested, out, stream);
#if defined(ROCMOE_PLATFORM_NVIDIA)
    if (tuning().load == kLoadCached)
        return launch_direct<T, kRows, kUnroll, kLoadCached>(c, p, requested, out, stream);
    if (tuning().load == kLoadNoL1)
        return launch_direct<T, kRows, kUnroll, kLoadNoL1>(c, p, requested, out, stream);
    return launch_direct<T, kRows, kUnroll, kLoadNoL1Prefetch>(c, p, requested, out, stream);
#else
    return launch_direct<T, kRows, kUnroll, kLoadCached>(c, p, requested, out, stream);
#endif
}

template <class T>
int launch(const Common &c, const GemvParams &p, int requested, void *out, hipStream_t stream) {
    const Tuning &t = tuning();
    // the one-shot kernel splits rows as the world-size-1 kernel does: its defaults
    const bool shot = one_shot(c);
    const bool protocol = !shot && (c.topo.world > 1 || t.direct == 0);
    // rows a wave and loads in flight: the knobs where set, else the path's own defaults
    const int rows = t.rows > 0 ? t.rows : protocol ? kProtocolRows : kDefaultRows;
    const int unroll = t.unroll > 0 ? t.unroll : protocol ? kProtocolUnroll : kDefaultUnroll;
#if defined(ROCMOE_PLATFORM_NVIDIA)
    if (!protocol && !shot && t.stages > 0 && p.vec) {
        switch (rows * 100 + t.stages) {
            case 104: return launch_async<T, 1, 4>(c, p, requested, out, stream);
            case 106: return launch_async<T, 1, 6>(c, p, requested, out, stream);
            case 203: return launch_async<T, 2, 3>(c, p, requested, out, stream);
            default: return launch_async<T, 2, 4>(c, p, requested, out, stream);
        }
    }
#endif
    switch (rows * 100 + unroll) {
        case 104: return launch_registers<T, 1, 4>(c, p, requested, out, stream);
        case 108: return launch_registers<T, 1, 8>(c, p, requested, out, stream);
        case 202: return launch_registers<T, 2, 2>(c, p, requested, out, stream);
        case 401: return launch_registers<T, 4, 1>(c, p, requested, out, stream);
        case 402: return launch_registers<T, 4, 2>(c, p, requested, out, stream);
        default: return launch_registers<T, 2, 4>(c, p, requested, out, stream);
    }
}

#endif  // !ROCMOE_GEMV_SCHEDULE_ONLY

}  // namespace
}  // namespace fused
}  // namespace rocmoe

#if !defined(ROCMOE_GEMV_SCHEDULE_ONLY)
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
    p.rows_per_tile = 0;  // launch_protocol chooses it
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(p.w) | reinterpret_cast<uintptr_t>(p.x)) & 15u) == 0;
    switch (l.dtype) {
        case ROCMOE_DTYPE_F32:
            p.vec = aligned && p.k % vec_elems<F32>() == 0;
            rc = launch<F32>(c, p, args->fused.workgroups, args->out, stream);
            break;
        case ROCMOE_DTYPE_BF16:
            p.vec = aligned && p.k % vec_elems<BF16>() == 0;
            rc = launch<BF16>(c, p, args->fused.workgroups, args->out, stream);
            break;
        case ROCMOE_DTYPE_F16:
            p.vec = aligned && p.k % vec_elems<F16>() == 0;
            rc = launch<F16>(c, p, args->fused.workgroups, args->out, stream);
            break;
        default:
            return rocmoe::fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: dtype %d unknown", l.dtype);
    }
    return rc;
}
#endif  // !ROCMOE_GEMV_SCHEDULE_ONLY
