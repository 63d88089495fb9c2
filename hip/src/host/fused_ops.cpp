// Host backend of the three fused ops: a persistent "kernel" of worker threads per rank
// (one thread = one simulated workgroup) running the schedule of rocmoe/schedule.h. A worker
// computes a tile into private staging, puts it by memcpy into the destination's mapping of
// the symmetric heap, and the worker that completes a slice raises the slice's epoch signal
// with a release store. The calling thread then waits (bounded) for every source's signal
// and copies the received data out, so the receive buffer is free again when the op returns.
//
// Inputs were validated on every rank by rocmoe.ops before any of this runs; the checks here
// only guard memory (ranges of the workspace, indices) so that a misuse from C cannot write
// outside the heap.
#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../internal.hpp"
#include "rocmoe/schedule.h"

namespace rocmoe {
namespace {

namespace sc = rocmoe::sched;

// ---- dtype conversion (fp32 accumulation everywhere) -----------------------------------
inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: shift the leading one up to the implicit bit
            int e = -1;
            do {
                ++e;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;   // NaN
    if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
    if (u < 0x38800000u) {                        // below 2^-14: subnormal half or zero
        if (u < 0x33000000u) return sign;         // below 2^-25 rounds to zero
        const uint32_t e = u >> 23;
        const uint32_t man = (u & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;          // value in units of 2^-24
        uint32_t r = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return static_cast<uint16_t>(sign | r);
    }
    u += 0x0fffu + ((u >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((u - 0x38000000u) >> 13));
}

template <int DT> struct Elem;
template <> struct Elem<ROCMOE_DTYPE_F32> {
    using T = float;
    static float load(T v) { return v; }
    static T store(float v) { return v; }
};
template <> struct Elem<ROCMOE_DTYPE_BF16> {
    using T = uint16_t;
    static float load(T v) { return bf16_to_f32(v); }
    static T store(float v) { return f32_to_bf16(v); }
};
template <> struct Elem<ROCMOE_DTYPE_F16> {
    using T = uint16_t;
    static float load(T v) { return f16_to_f32(v); }
    static T store(float v) { return f32_to_f16(v); }
};

int dtype_size(int dtype) { return dtype == ROCMOE_DTYPE_F32 ? 4 : 2; }

template <int DT>
void to_dtype(const float *src, void *dst, int64_t count) {
    auto *d = static_cast<typename Elem<DT>::T *>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = Elem<DT>::store(src[i]);
}

template <int DT>
void to_f32(const void *src, float *dst, int64_t count) {
    auto *s = static_cast<const typename Elem<DT>::T *>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = Elem<DT>::load(s[i]);
}

// ---- worker pool: threads stay parked between calls, so a call costs a wake-up, not a
// thread creation. Worker 0 is the calling thread. ---------------------------------------
class WorkerPool {
public:
    ~WorkerPool() {
        {
            std::lock_guard<std::mutex> lock(m_);
            stop_ = true;
        }
        start_.notify_all();
        for (auto &t : threads_) t.join();
    }

    void run(int workers, const std::function<void(int)> &job) {
        std::lock_guard<std::mutex> serial(run_mutex_);
        while (static_cast<int>(threads_.size()) < workers - 1) {
            const int index = static_cast<int>(threads_.size()) + 1;
            threads_.emplace_back([this, index] { loop(index); });
        }
        {
            std::lock_guard<std::mutex> lock(m_);
            job_ = &job;
            active_ = workers;
            remaining_ = workers - 1;
            ++generation_;
        }
        start_.notify_all();
        job(0);
        std::unique_lock<std::mutex> lock(m_);
        done_.wait(lock, [this] { return remaining_ == 0; });
        job_ = nullptr;
    }

private:
    void loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)> *job;
            {
                std::unique_lock<std::mutex> lock(m_);
                start_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
                if (index >= active_) continue;
                job = job_;
            }
            (*job)(index);
            {
                std::lock_guard<std::mutex> lock(m_);
                --remaining_;
            }
            done_.notify_one();
        }
    }

    std::mutex run_mutex_, m_;
    std::condition_variable start_, done_;
    std::vector<std::thread> threads_;
    const std::function<void(int)> *job_ = nullptr;
    uint64_t generation_ = 0;
    int active_ = 0, remaining_ = 0;
    bool stop_ = false;
};

WorkerPool &pool() {
    static WorkerPool p;
    return p;
}

int default_workers() {
    if (const char *env = std::getenv("ROCMOE_HOST_WORKERS")) {
        const int v = std::atoi(env);
        if (v > 0) return std::min(v, 256);
    }
    const unsigned cores = std::thread::hardware_concurrency();
    return static_cast<int>(std::min(4u, cores == 0 ? 1u : cores));
}

// First error of any worker, re-raised on the calling thread (last-error text is per thread).
struct CallState {
    std::atomic<int> abort{0};
    std::mutex m;
    int rc = ROCMOE_OK;
    std::string message;

    void record(int code) {
        std::lock_guard<std::mutex> lock(m);
        if (rc == ROCMOE_OK) {
            rc = code;
            message = rocmoe_last_error();
        }
        abort.store(1);
    }
    int result() {
        if (rc != ROCMOE_OK) return fail(rc, "%s", message.c_str());
        return ROCMOE_OK;
    }
};

// One op call: the context, the shared workspace and the schedule's per-call counters.
struct Kernel {
    rocmoe_ctx *ctx;
    const rocmoe_fused_common *common;
    const char *op;
    int rank, world, workers;
    double timeout_s;

    char *local_heap() const { return static_cast<char *>(ctx->backend->base()); }

    int put(int peer, uint64_t offset, const void *src, uint64_t bytes) const {
        if (bytes == 0) return ROCMOE_OK;
        return ctx->backend->put(peer, common->recv_offset + offset, src, bytes);
    }
    int signal(int peer, uint64_t slot) const {
        return ctx->backend->signal_store(peer, common->signal_offset + 8 * slot,
                                          sc::signal_value(common->epoch), false);
    }
    // bounded wait for this rank's slot `slot`, written by rank `from`
    int wait(uint64_t slot, int from, const char *what) const {
        uint64_t seen = 0;
        int rc = rocmoe_signal_wait_until(ctx, common->signal_offset + 8 * slot, ROCMOE_CMP_GE,
                                          sc::signal_value(common->epoch), timeout_s, from, &seen);
        if (rc == ROCMOE_OK) return rc;
        const std::string inner = rocmoe_last_error();
        return fail(rc, "%s (call %" PRIu64 "): rank %d waiting for %s of rank %d: %s", op,
                    common->epoch, rank, what, from, inner.c_str());
    }
    sc::Topology topology() const {
        return sc::Topology{rank, world, common->ranks_per_node > 0 ? common->ranks_per_node : world};
    }
};

int start_kernel(rocmoe_ctx *ctx, const rocmoe_fused_common *common, const char *op,
                 uint64_t need_bytes, uint64_t need_slots, Kernel *k) {
    if (ctx == nullptr || common == nullptr) return fail(ROCMOE_ERR_INVALID, "%s: NULL argument", op);
    if (ctx->finalized || !ctx->connected)
        return fail(ROCMOE_ERR_STATE, "%s: the context is not connected", op);
    if (ctx->args.backend != ROCMOE_BACKEND_HOST)
        return fail(ROCMOE_ERR_BACKEND,
                    "%s: the host persistent kernel runs on the host backend only; GPU backends "
                    "use the kernels of hip/src/gpu",
                    op);
    if (common->epoch == 0) return fail(ROCMOE_ERR_INVALID, "%s: epoch must start at 1", op);
    const uint64_t heap = ctx->heap->size();
    if (common->recv_bytes < need_bytes)
        return fail(ROCMOE_ERR_INVALID, "%s: receive buffer of %" PRIu64 " bytes, %" PRIu64
                    " needed", op, common->recv_bytes, need_bytes);
    if (common->recv_offset > heap || common->recv_bytes > heap - common->recv_offset ||
        common->signal_offset % 8 != 0 || common->signal_offset > heap ||
        need_slots * 8 > heap - common->signal_offset)
        return fail(ROCMOE_ERR_INVALID, "%s: workspace outside the heap of %" PRIu64 " bytes", op,
                    heap);
    k->ctx = ctx;
    k->common = common;
    k->op = op;
    k->rank = ctx->args.rank;
    k->world = ctx->args.world_size;
    k->workers = common->workers > 0 ? std::min(common->workers, 256) : default_workers();
    k->timeout_s = common->timeout_s > 0 ? common->timeout_s : ctx->args.timeout_s;
    return ROCMOE_OK;
}

// Runs `phases` one after another on every worker; each phase is (plan, compute, finish).
struct Phase {
    sc::Plan plan;
    std::function<int(const sc::Task &, int worker)> compute;
    std::function<int(const sc::Task &)> finish;
};

// Waking a parked worker costs a scheduler round trip (milliseconds on an oversubscribed
// node), so a call brings in one worker per 4 MiB of work it touches, at least
// the calling thread, at most the configured number.
// ROCMOE_HOST_WORK_PER_WORKER overrides it (tests set 1 to run every call on all workers).
uint64_t work_per_worker() {
    static const uint64_t value = [] {
        const char *env = std::getenv("ROCMOE_HOST_WORK_PER_WORKER");
        const long long v = env ? std::atoll(env) : 0;
        return v > 0 ? static_cast<uint64_t>(v) : (4ull << 20);
    }();
    return value;
}

int run_phases(const Kernel &k, std::vector<Phase> &phases, uint64_t work_bytes) {
    CallState state;
    const uint64_t useful = std::max<uint64_t>(1, work_bytes / work_per_worker());
    const int active = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(k.workers), useful));
    const uint32_t workers = static_cast<uint32_t>(active);
    // Per-call counters: the schedule re-zeroes them itself, fresh ones keep a failed call
    // from leaking state into the next.
    std::vector<uint32_t> counters(phases.size() * (2 + k.world), 0u);
    pool().run(active, [&](int worker) {
        for (size_t p = 0; p < phases.size(); ++p) {
            uint32_t *base = counters.data() + p * (2 + k.world);
            sc::Counters c{base, base + 1, base + 2};
            sc::run_worker(
                phases[p].plan, c, workers,
                [&](const sc::Task &t) {
                    const int rc = phases[p].compute(t, worker);
                    if (rc != ROCMOE_OK) state.record(rc);
                    return rc == ROCMOE_OK && !state.abort.load(std::memory_order_relaxed);
                },
                [&](const sc::Task &t) {
                    const int rc = phases[p].finish(t);
                    if (rc != ROCMOE_OK) state.record(rc);
                    return rc == ROCMOE_OK;
                },
                reinterpret_cast<const volatile int *>(&state.abort));
            if (state.abort.load()) return;
        }
    });
    return state.result();
}

sc::Plan make_plan(const Kernel &k, const std::vector<uint32_t> &tasks_per_dest,
                   std::vector<uint32_t> &prefix) {
    prefix.assign(k.world + 1, 0);
    const sc::Topology topo = k.topology();
    const uint32_t total = sc::build_task_prefix(topo, tasks_per_dest.data(), prefix.data());
    return sc::Plan{topo, total, prefix.data()};
}

// per-worker scratch, reused across calls
thread_local std::vector<float> t_stage;
thread_local std::vector<float> t_stage2;
thread_local std::vector<unsigned char> t_bytes;

float *stage(std::vector<float> &v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}
unsigned char *stage_bytes(size_t n) {
    if (t_bytes.size() < n) t_bytes.resize(n);
    return t_bytes.data();
}

// ---- embedding bag + all-to-all ----------------------------------------------------------
// Lookups are latency-bound gathers of random rows: the tile walks one table at a time over
// its bags (the tile's indices are then contiguous) and prefetches the rows kPrefetch
// lookups ahead, so several misses are in flight instead of one.
constexpr int64_t kPrefetch = 8;

template <int DT>
int embedding_tile(const rocmoe_embedding_a2a_args &a, int64_t bag0, int64_t bags, float *acc) {
    using T = typename Elem<DT>::T;
    const int64_t dim = a.dim;
    const int nt = a.num_tables;
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
    for (int t = 0; t < nt; ++t) {
        const int64_t *off = a.offsets[t];
        const int64_t *idx = a.indices[t];
        const T *w = static_cast<const T *>(a.weights[t]);
        const float *psw = a.per_sample_weights ? a.per_sample_weights[t] : nullptr;
        const int64_t rows = a.rows[t], count = a.num_indices[t];
        const int64_t first = off[bag0];
        const int64_t last = bag0 + bags < a.batch ? off[bag0 + bags] : count;
        if (first < 0 || last < first || last > count)
            return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: table %d bags [%" PRId64
                        ", %" PRId64 ") span indices [%" PRId64 ", %" PRId64 ") outside its %"
                        PRId64, a.table_base + t, bag0, bag0 + bags, first, last, count);
        for (int64_t j = first; j < std::min(last, first + kPrefetch); ++j)
            if (idx[j] >= 0 && idx[j] < rows)
                for (int64_t bte = 0; bte < row_bytes; bte += 64)
                    __builtin_prefetch(reinterpret_cast<const char *>(w + idx[j] * dim) + bte);
        for (int64_t b = 0; b < bags; ++b) {
            const int64_t g = bag0 + b;
            float *out = acc + (b * nt + t) * dim;
            std::fill(out, out + dim, 0.0f);
            const int64_t start = off[g];
            const int64_t end = g + 1 < a.batch ? off[g + 1] : count;
            if (start < first || end < start || end > last)
                return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: table %d: offsets of bag %"
                            PRId64 " are not ascending", a.table_base + t, g);
            for (int64_t j = start; j < end; ++j) {
                const int64_t row = idx[j];
                if (row < 0 || row >= rows)
                    return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: index %" PRId64
                                " outside table %d of %" PRId64 " rows", row, a.table_base + t, rows);
                if (j + kPrefetch < last) {
                    const int64_t ahead = idx[j + kPrefetch];
                    if (ahead >= 0 && ahead < rows)
                        for (int64_t bte = 0; bte < row_bytes; bte += 64)
                            __builtin_prefetch(reinterpret_cast<const char *>(w + ahead * dim) + bte);
                }
                const T *src = w + row * dim;
                const float sc = psw ? psw[j] : 1.0f;
                for (int64_t c = 0; c < dim; ++c) out[c] += sc * Elem<DT>::load(src[c]);
            }
            if (a.mode == ROCMOE_BAG_MEAN && end > start) {
                const float inv = 1.0f / static_cast<float>(end - start);
                for (int64_t c = 0; c < dim; ++c) out[c] *= inv;
            }
        }
    }
    return ROCMOE_OK;
}

template <int DT>
int embedding_a2a(const Kernel &k, const rocmoe_embedding_a2a_args &a) {
    const int64_t bl = a.batch / k.world;
    const int nt = a.num_tables;
    const int64_t esize = dtype_size(a.dtype);
    const int64_t block = static_cast<int64_t>(nt) * a.dim;  // this rank's columns of one bag
    const uint64_t bag_stride = static_cast<uint64_t>(a.total_tables) * a.dim * esize;
    // ~16K fp32 of staging per tile, and several tiles per worker when the batch allows
    int64_t tile = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, block));
    tile = std::min<int64_t>(tile, std::max<int64_t>(1, (bl * k.world) / (4 * k.workers)));

    std::vector<uint32_t> tasks(k.world), prefix;
    for (int d = 0; d < k.world; ++d) tasks[d] = nt == 0 ? 1u : sc::tasks_for_rows(bl, tile);
    std::vector<Phase> phases(1);
    phases[0].plan = make_plan(k, tasks, prefix);
    phases[0].compute = [&](const sc::Task &t, int) -> int {
        if (nt == 0) return ROCMOE_OK;  // signal-only slice
        const int64_t b0 = sc::tile_begin(t.tile, tile, bl), b1 = sc::tile_end(t.tile, tile, bl);
        if (b1 <= b0) return ROCMOE_OK;
        const unsigned char *bytes;
        int rc;
        if (a.bags != nullptr) {  // pooled already: this task only moves its bags
            bytes = static_cast<const unsigned char *>(a.bags) +
                    (static_cast<int64_t>(t.dest) * bl + b0) * block * esize;
        } else {
            float *acc = stage(t_stage, (b1 - b0) * block);
            rc = embedding_tile<DT>(a, static_cast<int64_t>(t.dest) * bl + b0, b1 - b0, acc);
            if (rc != ROCMOE_OK) return rc;
            unsigned char *converted = stage_bytes((b1 - b0) * block * esize);
            to_dtype<DT>(acc, converted, (b1 - b0) * block);
            bytes = converted;
        }
        for (int64_t b = b0; b < b1; ++b) {
            const uint64_t dst = b * bag_stride + static_cast<uint64_t>(a.table_base) * a.dim * esize;
            rc = k.put(t.dest, dst, bytes + (b - b0) * block * esize, block * esize);
            if (rc != ROCMOE_OK) return rc;
        }
        return ROCMOE_OK;
    };
    phases[0].finish = [&](const sc::Task &t) { return k.signal(t.dest, k.rank); };
    uint64_t work = static_cast<uint64_t>(a.batch) * block * esize;  // bytes put
    if (a.bags == nullptr)
        for (int t = 0; t < nt; ++t) work += static_cast<uint64_t>(a.num_indices[t]) * a.dim * esize;
    int rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    for (int s = 0; s < k.world; ++s) {
        rc = k.wait(s, s, "its embedding columns");
        if (rc != ROCMOE_OK) return rc;
    }
    if (bl * bag_stride != 0) std::memcpy(a.out, k.local_heap() + k.common->recv_offset, bl * bag_stride);
    return ROCMOE_OK;
}

// ---- GEMV + two-phase all-reduce -----------------------------------------------------------
template <int DT>
int gemv_allreduce(const Kernel &k, const rocmoe_gemv_allreduce_args &a) {
    using T = typename Elem<DT>::T;
    const int64_t n = a.n, kk = a.k;
    const int64_t chunk_max = sc::gemv_chunk_max(n, k.world);
    const uint64_t result_off = sc::gemv_result_offset(n, k.world);
    const int64_t esize = dtype_size(a.dtype);
    std::vector<float> x(a.partial != nullptr ? 0 : kk);
    if (a.partial == nullptr) to_f32<DT>(a.x, x.data(), kk);
    const T *w = static_cast<const T *>(a.w);

    // phase 1 (reduce-scatter): partial dot products of chunk d go to d's partials[rank]
    const int64_t tile1 = std::max<int64_t>(8, std::min<int64_t>(256, 65536 / std::max<int64_t>(1, kk)));
    std::vector<uint32_t> tasks1(k.world), prefix1, tasks2(k.world), prefix2;
    for (int d = 0; d < k.world; ++d) {
        const int64_t len = sc::split_begin(n, k.world, d + 1) - sc::split_begin(n, k.world, d);
        tasks1[d] = sc::tasks_for_rows(len, tile1);
    }
    // phase 2 (all-gather): this rank reduces its own chunk and stores it into every rank
    const int64_t c0 = sc::split_begin(n, k.world, k.rank), c1 = sc::split_begin(n, k.world, k.rank + 1);
    const int64_t tile2 = 4096;
    for (int d = 0; d < k.world; ++d) tasks2[d] = sc::tasks_for_rows(c1 - c0, tile2);
    std::atomic<int> partials_in{0};

    std::vector<Phase> phases(2);
    phases[0].plan = make_plan(k, tasks1, prefix1);
    phases[0].compute = [&](const sc::Task &t, int) -> int {
        const int64_t d0 = sc::split_begin(n, k.world, t.dest);
        const int64_t len = sc::split_begin(n, k.world, t.dest + 1) - d0;
        const int64_t r0 = sc::tile_begin(t.tile, tile1, len), r1 = sc::tile_end(t.tile, tile1, len);
        if (r1 <= r0) return ROCMOE_OK;
        if (a.partial != nullptr)  // W x computed already: this task only moves its rows
            return k.put(t.dest, (static_cast<uint64_t>(k.rank) * chunk_max + r0) * 4,
                         a.partial + d0 + r0, (r1 - r0) * 4);
        float *part = stage(t_stage, r1 - r0);
        for (int64_t r = r0; r < r1; ++r) {
            const T *row = w + (d0 + r) * kk;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains: vectorizes, shorter latency
            int64_t c = 0;
            for (; c + 4 <= kk; c += 4) {
                s0 += Elem<DT>::load(row[c]) * x[c];
                s1 += Elem<DT>::load(row[c + 1]) * x[c + 1];
                s2 += Elem<DT>::load(row[c + 2]) * x[c + 2];
                s3 += Elem<DT>::load(row[c + 3]) * x[c + 3];
            }
            for (; c < kk; ++c) s0 += Elem<DT>::load(row[c]) * x[c];
            part[r - r0] = (s0 + s1) + (s2 + s3);
        }
        return k.put(t.dest, (static_cast<uint64_t>(k.rank) * chunk_max + r0) * 4, part, (r1 - r0) * 4);
    };
    phases[0].finish = [&](const sc::Task &t) { return k.signal(t.dest, k.rank); };

    phases[1].plan = make_plan(k, tasks2, prefix2);
    phases[1].compute = [&](const sc::Task &t, int) -> int {
        if (partials_in.load(std::memory_order_acquire) == 0) {
            for (int s = 0; s < k.world; ++s) {
                const int rc = k.wait(s, s, "its partial sums");
                if (rc != ROCMOE_OK) return rc;
            }
            partials_in.store(1, std::memory_order_release);
        }
        const int64_t r0 = sc::tile_begin(t.tile, tile2, c1 - c0), r1 = sc::tile_end(t.tile, tile2, c1 - c0);
        if (r1 <= r0) return ROCMOE_OK;
        const float *parts = reinterpret_cast<const float *>(k.local_heap() + k.common->recv_offset);
        float *sum = stage(t_stage, r1 - r0);
        // sources in rank order: every rank's copy of y is bitwise the same
        for (int64_t r = r0; r < r1; ++r) sum[r - r0] = parts[r];
        for (int s = 1; s < k.world; ++s)
            for (int64_t r = r0; r < r1; ++r) sum[r - r0] += parts[s * chunk_max + r];
        unsigned char *bytes = stage_bytes((r1 - r0) * esize);
        to_dtype<DT>(sum, bytes, r1 - r0);
        return k.put(t.dest, result_off + (c0 + r0) * esize, bytes, (r1 - r0) * esize);
    };
    phases[1].finish = [&](const sc::Task &t) { return k.signal(t.dest, k.world + k.rank); };

    const uint64_t work = a.partial != nullptr ? static_cast<uint64_t>(n) * 4 * 2
                                               : static_cast<uint64_t>(n) * kk * esize;
    int rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    for (int s = 0; s < k.world; ++s) {
        rc = k.wait(k.world + s, s, "its reduced chunk");
        if (rc != ROCMOE_OK) return rc;
    }
    if (n > 0) std::memcpy(a.out, k.local_heap() + k.common->recv_offset + result_off, n * esize);
    return ROCMOE_OK;
}

// ---- GEMM + all-to-all ------------------------------------------------------------------
// c[rows, n] = a[rows, k] @ w[k, n] in fp32. W is packed once per call into panels of 16
// columns ([panel][k][16], zero-padded), so the k loop streams one contiguous panel instead
// of striding through W by whole rows (that stride costs a TLB miss per step); a 4 x 16
// register tile (8 vectors of 8 floats) accumulates across the whole k loop.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROCMOE_GEMM_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define ROCMOE_GEMM_CLONES
#endif

constexpr int64_t kPanel = 16;
typedef float vec8 __attribute__((vector_size(32)));

std::vector<float> pack_panels(const float *w, int64_t k, int64_t n) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
    std::vector<float> packed(static_cast<size_t>(panels * k * kPanel), 0.0f);
    for (int64_t jb = 0; jb < panels; ++jb) {
        const int64_t cols = std::min<int64_t>(kPanel, n - jb * kPanel);
        float *dst = packed.data() + jb * k * kPanel;
        for (int64_t q = 0; q < k; ++q) std::memcpy(dst + q * kPanel, w + q * n + jb * kPanel, cols * 4);
    }
    return packed;
}

// memcpy to and from vectors (not helper functions: a helper compiled for the default
// target would not be inlined into the AVX2 clone)
ROCMOE_GEMM_CLONES
void gemm_packed(const float *a, int64_t rows, int64_t k, const float *panels, int64_t n, float *c) {
    const int64_t count = (n + kPanel - 1) / kPanel;
    for (int64_t i = 0; i < rows; i += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - i);
        const float *a0 = a + i * k;
        const float *a1 = a + (i + (mr > 1 ? 1 : 0)) * k;  // short blocks repeat row i
        const float *a2 = a + (i + (mr > 2 ? 2 : 0)) * k;
        const float *a3 = a + (i + (mr > 3 ? 3 : 0)) * k;
        for (int64_t jb = 0; jb < count; ++jb) {
            vec8 c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {};
            const float *p = panels + jb * k * kPanel;
            for (int64_t q = 0; q < k; ++q, p += kPanel) {
                vec8 w0, w1, b;
                std::memcpy(&w0, p, 32);
                std::memcpy(&w1, p + 8, 32);
                b = vec8{} + a0[q]; c00 += b * w0; c01 += b * w1;
                b = vec8{} + a1[q]; c10 += b * w0; c11 += b * w1;
                b = vec8{} + a2[q]; c20 += b * w0; c21 += b * w1;
                b = vec8{} + a3[q]; c30 += b * w0; c31 += b * w1;
            }
            float out[4][kPanel];
            std::memcpy(out[0], &c00, 32); std::memcpy(out[0] + 8, &c01, 32);
            std::memcpy(out[1], &c10, 32); std::memcpy(out[1] + 8, &c11, 32);
            std::memcpy(out[2], &c20, 32); std::memcpy(out[2] + 8, &c21, 32);
            std::memcpy(out[3], &c30, 32); std::memcpy(out[3] + 8, &c31, 32);
            const int64_t cols = std::min<int64_t>(kPanel, n - jb * kPanel);
            for (int64_t r = 0; r < mr; ++r) std::memcpy(c + (i + r) * n + jb * kPanel, out[r], cols * 4);
        }
    }
}

template <int DT>
int gemm_a2a(const Kernel &k, const rocmoe_gemm_a2a_args &a) {
    const int64_t n = a.n, esize = dtype_size(a.dtype);
    const uint64_t row_bytes = static_cast<uint64_t>(n) * esize;
    std::vector<int64_t> row_start(k.world + 1, 0);
    for (int d = 0; d < k.world; ++d) row_start[d + 1] = row_start[d] + a.send_counts[d];
    if (row_start[k.world] != a.m)
        return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: send counts sum to %" PRId64
                    ", not to the %" PRId64 " rows", row_start[k.world], a.m);
    // grouped products: segment (d, g) of destination d's rows is multiplied by W[g]
    const int64_t groups = a.groups > 0 ? a.groups : 1;
    std::vector<int64_t> seg_start(static_cast<size_t>(k.world) * (groups + 1), 0);
    for (int d = 0; d < k.world; ++d) {
        int64_t *st = seg_start.data() + static_cast<size_t>(d) * (groups + 1);
        for (int64_t g = 0; g < groups; ++g) {
            // (checked by rocmoe_host_gemm_a2a before the kernel started)
            st[g + 1] = st[g] + (a.groups > 0 ? a.group_counts[d * groups + g] : a.send_counts[d]);
        }
    }
    // an empty Y may come as NULL: with no rows there is nothing to compute either way
    const bool compute = a.y == nullptr && a.m > 0;
    // computing: 16-row tiles (4 register tiles); moving: ~256 KiB per put
    const int64_t tile = compute ? 16 : std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, row_bytes));
    std::vector<float> panels;
    const size_t panel_floats = static_cast<size_t>((n + kPanel - 1) / kPanel) * a.k * kPanel;
    if (compute) {
        panels.reserve(panel_floats * groups);
        for (int64_t g = 0; g < groups; ++g) {
            std::vector<float> p = pack_panels(a.w + g * a.k * n, a.k, n);
            panels.insert(panels.end(), p.begin(), p.end());
        }
    }
    std::vector<uint32_t> tasks(k.world), prefix;
    for (int d = 0; d < k.world; ++d) tasks[d] = sc::tasks_for_rows(a.send_counts[d], tile);
    std::vector<Phase> phases(1);
    phases[0].plan = make_plan(k, tasks, prefix);
    phases[0].compute = [&](const sc::Task &t, int) -> int {
        const int64_t cnt = a.send_counts[t.dest];
        const int64_t r0 = sc::tile_begin(t.tile, tile, cnt), r1 = sc::tile_end(t.tile, tile, cnt);
        if (r1 <= r0) return ROCMOE_OK;
        const int64_t g0 = row_start[t.dest] + r0;  // first row of Y
        const uint64_t dst = static_cast<uint64_t>(a.dest_row_offsets[t.dest] + r0) * row_bytes;
        if (!compute)
            return k.put(t.dest, dst, static_cast<const char *>(a.y) + g0 * row_bytes, (r1 - r0) * row_bytes);
        const int64_t rows = r1 - r0;
        const float *xa;
        if (DT == ROCMOE_DTYPE_F32) {
            xa = static_cast<const float *>(a.x) + g0 * a.k;
        } else {
            float *xs = stage(t_stage2, rows * a.k);
            to_f32<DT>(static_cast<const typename Elem<DT>::T *>(a.x) + g0 * a.k, xs, rows * a.k);
            xa = xs;
        }
        float *acc = stage(t_stage, rows * n);
        // the tile's rows, cut at the group boundaries of this destination
        const int64_t *st = seg_start.data() + static_cast<size_t>(t.dest) * (groups + 1);
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t p0 = std::max(r0, st[g]), p1 = std::min(r1, st[g + 1]);
            if (p1 > p0)
                gemm_packed(xa + (p0 - r0) * a.k, p1 - p0, a.k, panels.data() + g * panel_floats,
                            n, acc + (p0 - r0) * n);
        }
        if (DT == ROCMOE_DTYPE_F32) return k.put(t.dest, dst, acc, rows * row_bytes);
        unsigned char *bytes = stage_bytes(rows * row_bytes);
        to_dtype<DT>(acc, bytes, rows * n);
        return k.put(t.dest, dst, bytes, rows * row_bytes);
    };
    phases[0].finish = [&](const sc::Task &t) { return k.signal(t.dest, k.rank); };
    // computing: count the multiply-adds as bytes touched (one float each)
    const uint64_t work = compute ? static_cast<uint64_t>(a.m) * a.k * n * 4 / 16
                                  : static_cast<uint64_t>(a.m) * row_bytes;
    int rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    for (int s = 0; s < k.world; ++s) {
        rc = k.wait(s, s, "its rows");
        if (rc != ROCMOE_OK) return rc;
    }
    if (a.recv_rows * row_bytes != 0)
        std::memcpy(a.out, k.local_heap() + k.common->recv_offset, a.recv_rows * row_bytes);
    return ROCMOE_OK;
}

int check_dtype(int dtype, const char *op) {
    if (dtype != ROCMOE_DTYPE_F32 && dtype != ROCMOE_DTYPE_BF16 && dtype != ROCMOE_DTYPE_F16)
        return fail(ROCMOE_ERR_INVALID, "%s: dtype code %d is not f32, bf16 or f16", op, dtype);
    return ROCMOE_OK;
}

template <template <int> class F, class... Args>
int dispatch(int dtype, Args &&...args) {
    switch (dtype) {
        case ROCMOE_DTYPE_F32: return F<ROCMOE_DTYPE_F32>::run(args...);
        case ROCMOE_DTYPE_BF16: return F<ROCMOE_DTYPE_BF16>::run(args...);
        default: return F<ROCMOE_DTYPE_F16>::run(args...);
    }
}
template <int DT> struct EmbeddingOp {
    static int run(const Kernel &k, const rocmoe_embedding_a2a_args &a) { return embedding_a2a<DT>(k, a); }
};
template <int DT> struct GemvOp {
    static int run(const Kernel &k, const rocmoe_gemv_allreduce_args &a) { return gemv_allreduce<DT>(k, a); }
};
template <int DT> struct GemmOp {
    static int run(const Kernel &k, const rocmoe_gemm_a2a_args &a) { return gemm_a2a<DT>(k, a); }
};

}  // namespace
}  // namespace rocmoe

using rocmoe::fail;

extern "C" {

int rocmoe_host_default_workers(void) { return rocmoe::default_workers(); }

int rocmoe_embedding_a2a_workspace(int world, int64_t batch, int total_tables, int64_t dim,
                                   int dtype, uint64_t *recv_bytes, uint64_t *signal_slots) {
    if (world < 1 || batch < 0 || batch % world != 0 || total_tables < 0 || dim < 0 ||
        recv_bytes == nullptr || signal_slots == nullptr)
        return fail(ROCMOE_ERR_INVALID, "embedding workspace: bad sizes (world %d, batch %" PRId64
                    ", tables %d, dim %" PRId64 ")", world, batch, total_tables, dim);
    int rc = rocmoe::check_dtype(dtype, "embedding_all_to_all");
    if (rc != ROCMOE_OK) return rc;
    *recv_bytes = static_cast<uint64_t>(batch / world) * total_tables * dim * rocmoe::dtype_size(dtype);
    *signal_slots = world;
    return ROCMOE_OK;
}

int rocmoe_gemv_allreduce_workspace(int world, int64_t n, int dtype, uint64_t *recv_bytes,
                                    uint64_t *signal_slots) {
    if (world < 1 || n < 0 || recv_bytes == nullptr || signal_slots == nullptr)
        return fail(ROCMOE_ERR_INVALID, "gemv workspace: bad sizes (world %d, n %" PRId64 ")", world, n);
    int rc = rocmoe::check_dtype(dtype, "gemv_all_reduce");
    if (rc != ROCMOE_OK) return rc;
    *recv_bytes = rocmoe::sched::gemv_result_offset(n, world) +
                  static_cast<uint64_t>(n) * rocmoe::dtype_size(dtype);
    *signal_slots = 2 * static_cast<uint64_t>(world);
    return ROCMOE_OK;
}

int rocmoe_gemm_a2a_workspace(int world, int64_t recv_rows, int64_t n, int dtype,
                              uint64_t *recv_bytes, uint64_t *signal_slots) {
    if (world < 1 || recv_rows < 0 || n < 0 || recv_bytes == nullptr || signal_slots == nullptr)
        return fail(ROCMOE_ERR_INVALID, "gemm workspace: bad sizes (world %d, rows %" PRId64
                    ", n %" PRId64 ")", world, recv_rows, n);
    int rc = rocmoe::check_dtype(dtype, "gemm_all_to_all");
    if (rc != ROCMOE_OK) return rc;
    *recv_bytes = static_cast<uint64_t>(recv_rows) * n * rocmoe::dtype_size(dtype);
    *signal_slots = world;
    return ROCMOE_OK;
}

int rocmoe_host_embedding_a2a(rocmoe_ctx *ctx, const rocmoe_embedding_a2a_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: args is NULL");
    if (ctx == nullptr) return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: context is NULL");
    const int world = ctx->args.world_size;
    uint64_t need = 0, slots = 0;
    int rc = rocmoe_embedding_a2a_workspace(world, a->batch, a->total_tables, a->dim, a->dtype,
                                            &need, &slots);
    if (rc != ROCMOE_OK) return rc;
    if (a->num_tables < 0 || a->table_base < 0 || a->table_base + a->num_tables > a->total_tables ||
        (a->mode != ROCMOE_BAG_SUM && a->mode != ROCMOE_BAG_MEAN) ||
        (a->out == nullptr && need > 0) ||
        (a->num_tables > 0 && a->bags == nullptr &&
         (a->weights == nullptr || a->rows == nullptr || a->indices == nullptr ||
          a->num_indices == nullptr || a->offsets == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: inconsistent arguments (tables "
                    "%d at %d of %d, mode %d)", a->num_tables, a->table_base, a->total_tables, a->mode);
    rocmoe::Kernel k;
    rc = rocmoe::start_kernel(ctx, &a->common, "embedding_all_to_all", need, slots, &k);
    if (rc != ROCMOE_OK) return rc;
    return rocmoe::dispatch<rocmoe::EmbeddingOp>(a->dtype, k, *a);
}

int rocmoe_host_gemv_allreduce(rocmoe_ctx *ctx, const rocmoe_gemv_allreduce_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: args is NULL");
    if (ctx == nullptr) return fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: context is NULL");
    uint64_t need = 0, slots = 0;
    int rc = rocmoe_gemv_allreduce_workspace(ctx->args.world_size, a->n, a->dtype, &need, &slots);
    if (rc != ROCMOE_OK) return rc;
    if (a->k < 0 || (a->out == nullptr && a->n > 0) ||
        (a->partial == nullptr && a->n * a->k > 0 && (a->w == nullptr || a->x == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: NULL tensor or negative size");
    rocmoe::Kernel k;
    rc = rocmoe::start_kernel(ctx, &a->common, "gemv_all_reduce", need, slots, &k);
    if (rc != ROCMOE_OK) return rc;
    return rocmoe::dispatch<rocmoe::GemvOp>(a->dtype, k, *a);
}

int rocmoe_host_gemm_a2a(rocmoe_ctx *ctx, const rocmoe_gemm_a2a_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: args is NULL");
    if (ctx == nullptr) return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: context is NULL");
    const int world = ctx->args.world_size;
    uint64_t need = 0, slots = 0;
    int rc = rocmoe_gemm_a2a_workspace(world, a->recv_rows, a->n, a->dtype, &need, &slots);
    if (rc != ROCMOE_OK) return rc;
    if (a->m < 0 || a->k < 0 || a->send_counts == nullptr || a->dest_row_offsets == nullptr ||
        (a->recv_rows > 0 && a->out == nullptr) ||
        (a->y == nullptr && a->m * a->n > 0 && (a->x == nullptr || a->w == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: NULL tensor or negative size");
    for (int d = 0; d < world; ++d) {
        // the part for d must fit d's buffer; d's recv_rows is not known here, so check the
        // destination range against this rank's (identical) capacity
        if (a->send_counts[d] < 0 || a->dest_row_offsets[d] < 0 ||
            static_cast<uint64_t>(a->dest_row_offsets[d] + a->send_counts[d]) * a->n *
                    rocmoe::dtype_size(a->dtype) > a->common.recv_bytes)
            return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: rows [%" PRId64 ", %" PRId64
                        ") for rank %d do not fit its receive buffer of %" PRIu64 " bytes",
                        a->dest_row_offsets[d], a->dest_row_offsets[d] + a->send_counts[d], d,
                        a->common.recv_bytes);
    }
    if (a->groups < 0 || (a->groups > 0 && a->group_counts == nullptr))
        return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: %" PRId64 " groups without group counts",
                    a->groups);
    for (int d = 0; a->groups > 0 && d < world; ++d) {
        int64_t sum = 0;
        for (int64_t g = 0; g < a->groups; ++g) {
            if (a->group_counts[d * a->groups + g] < 0)
                return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: negative group count");
            sum += a->group_counts[d * a->groups + g];
        }
        if (sum != a->send_counts[d])
            return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: the group counts for rank %d sum "
                        "to %" PRId64 ", not to its %" PRId64 " rows", d, sum, a->send_counts[d]);
    }
    rocmoe::Kernel k;
    rc = rocmoe::start_kernel(ctx, &a->common, "gemm_all_to_all", need, slots, &k);
    if (rc != ROCMOE_OK) return rc;
    return rocmoe::dispatch<rocmoe::GemmOp>(a->dtype, k, *a);
}

}  // extern "C"
