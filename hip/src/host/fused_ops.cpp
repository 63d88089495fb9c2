// Host backend of the three fused ops: a persistent "kernel" of worker threads per rank
// (one thread = one simulated workgroup) running the schedule of rocmoe/schedule.h over the
// handle protocol of rocmoe.h ("fused ops: one protocol for every backend"): a worker
// computes a tile into private staging and puts it by memcpy into the destination's mapping
// of its receive buffer (parity epoch % 2, after the destination acknowledged call epoch - 2);
// the worker that completes a slice writes this rank's count into the destination's count
// slot and raises the data signal with a release store. The calling thread then waits
// (bounded) for every source, reads the counts that came with the data, copies the result
// out and acknowledges every source, so its buffer of this parity may be written again.
//
// Inputs were validated by rocmoe.ops before any of this runs; the checks here only guard
// memory (ranges of the workspace, indices) so that a misuse from C cannot write outside the
// heap. A rank whose own input was rejected calls rocmoe_host_fused_abort instead: its peers
// then see ROCMOE_COUNT_ABORTED and fail the call naming it, with every epoch still in step.
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
#include "rocmoe/workspace.h"

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

// One op call: the context, the handle's workspace and this call's epoch.
struct Kernel {
    rocmoe_ctx *ctx;
    const rocmoe_fused_common *common;
    const rocmoe_workspace_layout *layout;
    const char *op;
    int rank, world, workers;
    double timeout_s;
    uint64_t epoch;

    char *local_heap() const { return static_cast<char *>(ctx->backend->base()); }
    uint64_t at(uint64_t offset) const { return common->workspace + offset; }
    // this rank's receive buffer of this call
    const char *recv() const { return local_heap() + at(ws::recv_buffer(*layout, epoch)); }

    // data into `dest`'s receive buffer of this call, `offset` bytes into it
    int put(int dest, uint64_t offset, const void *src, uint64_t bytes) const {
        if (bytes == 0) return ROCMOE_OK;
        return ctx->backend->put(dest, at(ws::recv_buffer(*layout, epoch)) + offset, src, bytes);
    }
    // bounded wait until this rank's slot at workspace offset `slot` (written by `from`) is
    // >= value
    int wait(uint64_t slot, uint64_t value, int from, const char *what) const {
        uint64_t seen = 0;
        int rc = rocmoe_signal_wait_until(ctx, at(slot), ROCMOE_CMP_GE, value, timeout_s, from,
                                          &seen);
        if (rc == ROCMOE_OK) return rc;
        const std::string inner = rocmoe_last_error();
        return fail(rc, "%s (call %" PRIu64 "): rank %d waiting for %s of rank %d: %s", op, epoch,
                    rank, what, from, inner.c_str());
    }
    // producer side: `dest` has finished reading its buffer of this parity (call epoch - 2)
    int wait_dest_free(int dest) const {
        if (epoch <= 2) return ROCMOE_OK;
        return wait(ws::ack(*layout, dest), epoch - 2, dest, "the acknowledgement of call e-2");
    }
    // after the data: this rank's count for `dest`, then the signal (release, ordered after
    // both). `phase2`: the GEMV's all-gather signal, which carries no count.
    int deliver(int dest, int64_t count, bool phase2 = false) const {
        if (!phase2) {
            int rc = ctx->backend->put(dest, at(ws::count_slot(*layout, epoch, rank)), &count, 8);
            if (rc != ROCMOE_OK) return rc;
        }
        const uint64_t slot = phase2 ? ws::phase2_signal(*layout, rank) : ws::data_signal(*layout, rank);
        return ctx->backend->signal_store(dest, at(slot), sc::signal_value(epoch), false);
    }
    // the count source `s` sent with this call's data (valid after its signal)
    int64_t count_from(int s) const {
        int64_t v = 0;
        std::memcpy(&v, local_heap() + at(ws::count_slot(*layout, epoch, s)), 8);
        return v;
    }
    // consumer side, after the copy-out: every source may write this buffer again
    int ack_all() const {
        for (int s = 0; s < world; ++s) {
            int rc = ctx->backend->signal_store(s, at(ws::ack(*layout, rank)), epoch, false);
            if (rc != ROCMOE_OK) return rc;
        }
        return ROCMOE_OK;
    }
    // Waits for every source's data of this call and checks the counts it sent against
    // `capacity` (and against `expect` when >= 0); counts go to common->recv_counts. A problem
    // (a peer that aborted, found bad input or sent a wrong count) is reported after the
    // caller has finished the call: *problem holds the error code, `text` the reasons.
    int collect(uint64_t (*slot_of)(const rocmoe_workspace_layout &, int32_t), const char *what,
                int64_t capacity, int64_t expect, int *problem, std::string *text) const {
        for (int s = 0; s < world; ++s) {
            int rc = wait(slot_of(*layout, s), epoch, s, what);
            if (rc != ROCMOE_OK) return rc;
            const int64_t c = count_from(s);
            if (common->recv_counts != nullptr) common->recv_counts[s] = c;
            int status = ws::count_status(c, capacity);
            if (status == ROCMOE_STATUS_OK && expect >= 0 && c != expect) status = ROCMOE_STATUS_MISMATCH;
            if (status == ROCMOE_STATUS_OK) continue;
            char line[200];
            if (status == ROCMOE_STATUS_PEER_ABORTED)
                std::snprintf(line, sizeof line, "rank %d rejected its input (see the error "
                              "there) and sent nothing", s);
            else if (status == ROCMOE_STATUS_PEER_BAD_INPUT)
                std::snprintf(line, sizeof line, "rank %d found bad input in its kernel and "
                              "sent nothing", s);
            else if (status == ROCMOE_STATUS_MISMATCH)
                std::snprintf(line, sizeof line, "rank %d called with %" PRId64 " where this "
                              "rank has %" PRId64, s, c, expect);
            else
                std::snprintf(line, sizeof line, "rank %d sent a count of %" PRId64 " (capacity %"
                              PRId64 ")", s, c, capacity);
            if (!text->empty()) *text += "; ";
            *text += line;
            *problem = ROCMOE_ERR_INVALID;
        }
        return ROCMOE_OK;
    }
    int finish(int problem, const std::string &text) const {
        int rc = ack_all();
        if (rc != ROCMOE_OK) return rc;
        if (problem != ROCMOE_OK)
            return fail(problem, "%s (call %" PRIu64 ") on rank %d: %s", op, epoch, rank, text.c_str());
        return ROCMOE_OK;
    }
    sc::Topology topology() const {
        return sc::Topology{rank, world, common->ranks_per_node > 0 ? common->ranks_per_node : world};
    }
};

int start_kernel(rocmoe_ctx *ctx, const rocmoe_fused_common *common, int op_code, const char *op,
                 Kernel *k) {
    if (ctx == nullptr || common == nullptr || common->layout == nullptr)
        return fail(ROCMOE_ERR_INVALID, "%s: NULL argument", op);
    if (ctx->finalized || !ctx->connected)
        return fail(ROCMOE_ERR_STATE, "%s: the context is not connected", op);
    if (ctx->args.backend != ROCMOE_BACKEND_HOST)
        return fail(ROCMOE_ERR_BACKEND,
                    "%s: the host persistent kernel runs on the host backend only; GPU backends "
                    "use the kernels of hip/src/gpu",
                    op);
    const rocmoe_workspace_layout &l = *common->layout;
    if (common->epoch == 0) return fail(ROCMOE_ERR_INVALID, "%s: epoch must start at 1", op);
    if (l.op != op_code || l.world != ctx->args.world_size)
        return fail(ROCMOE_ERR_INVALID, "%s: the workspace layout is for op %d of %d ranks", op,
                    l.op, l.world);
    const uint64_t heap = ctx->heap->size();
    if (common->workspace % 8 != 0 || common->workspace > heap || l.total_bytes > heap - common->workspace)
        return fail(ROCMOE_ERR_INVALID, "%s: workspace of %" PRIu64 " bytes at %" PRIu64
                    " outside the heap of %" PRIu64 " bytes", op, l.total_bytes, common->workspace, heap);
    k->ctx = ctx;
    k->common = common;
    k->layout = common->layout;
    k->op = op;
    k->rank = ctx->args.rank;
    k->world = ctx->args.world_size;
    k->workers = common->workers > 0 ? std::min(common->workers, 256) : default_workers();
    k->timeout_s = common->timeout_s > 0 ? common->timeout_s : ctx->args.timeout_s;
    k->epoch = common->epoch;
    return ROCMOE_OK;
}

// Before any put: every destination has finished reading its buffer of this parity.
int wait_all_free(const Kernel &k) {
    for (int d = 0; d < k.world; ++d) {
        const int rc = k.wait_dest_free(d);
        if (rc != ROCMOE_OK) return rc;
    }
    return ROCMOE_OK;
}

// Runs `phases` one after another on every worker; each phase is (plan, compute, finish).
struct Phase {
    sc::Plan plan;
    std::function<int(const sc::Task &, int worker)> compute;
    std::function<int(const sc::Task &)> finish;  // the slice's delivery (count + signal)
    bool phase2 = false;                           // GEMV all-gather: signals without counts
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

// Runs the phases on the workers. When a task fails (bad input the caller's checks missed,
// a failed put), the destinations whose slices were not delivered yet still get their signal,
// with ROCMOE_COUNT_BAD_INPUT in the count slot, and every source is acknowledged: the peers
// finish the call and report this rank instead of timing out, and the epochs stay in step.
// Returns the first error (ROCMOE_OK when every phase ran).
int run_phases(const Kernel &k, std::vector<Phase> &phases, uint64_t work_bytes) {
    CallState state;
    const uint64_t useful = std::max<uint64_t>(1, work_bytes / work_per_worker());
    const int active = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(k.workers), useful));
    const uint32_t workers = static_cast<uint32_t>(active);
    // Per-call counters: the schedule re-zeroes them itself, fresh ones keep a failed call
    // from leaking state into the next.
    std::vector<uint32_t> counters(phases.size() * (2 + k.world), 0u);
    std::vector<char> delivered(phases.size() * k.world, 0);
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
                    else delivered[p * k.world + t.dest] = 1;  // one worker per slice
                    return rc == ROCMOE_OK;
                },
                reinterpret_cast<const volatile int *>(&state.abort));
            if (state.abort.load()) return;
        }
    });
    const int rc = state.result();
    if (rc == ROCMOE_OK) return rc;
    const std::string message = rocmoe_last_error();
    for (size_t p = 0; p < phases.size(); ++p)
        for (int d = 0; d < k.world; ++d)
            if (!delivered[p * k.world + d]) k.deliver(d, ROCMOE_COUNT_BAD_INPUT, phases[p].phase2);
    k.ack_all();
    return fail(rc, "%s", message.c_str());
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
    const int64_t esize = dtype_size(DT);
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
    phases[0].finish = [&](const sc::Task &t) { return k.deliver(t.dest, a.batch); };
    uint64_t work = static_cast<uint64_t>(a.batch) * block * esize;  // bytes put
    if (a.bags == nullptr && a.num_indices != nullptr)
        for (int t = 0; t < nt; ++t) work += static_cast<uint64_t>(a.num_indices[t]) * a.dim * esize;
    int rc = wait_all_free(k);
    if (rc != ROCMOE_OK) return rc;
    rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    int problem = ROCMOE_OK;
    std::string why;
    // every source must have looked up the same global batch (its count)
    rc = k.collect(ws::data_signal, "its embedding columns", k.layout->capacity, a.batch,
                   &problem, &why);
    if (rc != ROCMOE_OK) return rc;
    if (problem == ROCMOE_OK && bl * bag_stride != 0) std::memcpy(a.out, k.recv(), bl * bag_stride);
    return k.finish(problem, why);
}

// ---- GEMV + two-phase all-reduce -----------------------------------------------------------
template <int DT>
int gemv_allreduce(const Kernel &k, const rocmoe_gemv_allreduce_args &a) {
    using T = typename Elem<DT>::T;
    const int64_t n = a.n, kk = a.k;
    const int64_t chunk_max = sc::gemv_chunk_max(n, k.world);
    const uint64_t result_off = k.layout->gather_offset;
    const int64_t esize = dtype_size(k.layout->dtype);
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
    // phase 2 may start once every source's partials are in; a source that sent none
    // (aborted, bad input) makes y wrong, so the call reports it after finishing the protocol
    std::atomic<int> partials_in{0};
    int problem = ROCMOE_OK;
    std::string why;
    std::mutex partials_mutex;

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
    phases[0].finish = [&](const sc::Task &t) { return k.deliver(t.dest, n); };

    phases[1].plan = make_plan(k, tasks2, prefix2);
    phases[1].phase2 = true;
    phases[1].compute = [&](const sc::Task &t, int) -> int {
        if (partials_in.load(std::memory_order_acquire) == 0) {
            std::lock_guard<std::mutex> lock(partials_mutex);
            if (partials_in.load(std::memory_order_relaxed) == 0) {
                const int rc = k.collect(ws::data_signal, "its partial sums", k.layout->capacity,
                                         n, &problem, &why);
                if (rc != ROCMOE_OK) return rc;
                partials_in.store(1, std::memory_order_release);
            }
        }
        const int64_t r0 = sc::tile_begin(t.tile, tile2, c1 - c0), r1 = sc::tile_end(t.tile, tile2, c1 - c0);
        if (r1 <= r0) return ROCMOE_OK;
        const float *parts = reinterpret_cast<const float *>(k.recv());
        float *sum = stage(t_stage, r1 - r0);
        // sources in rank order: every rank's copy of y is bitwise the same
        for (int64_t r = r0; r < r1; ++r) sum[r - r0] = parts[r];
        for (int s = 1; s < k.world; ++s)
            for (int64_t r = r0; r < r1; ++r) sum[r - r0] += parts[s * chunk_max + r];
        unsigned char *bytes = stage_bytes((r1 - r0) * esize);
        to_dtype<DT>(sum, bytes, r1 - r0);
        return k.put(t.dest, result_off + (c0 + r0) * esize, bytes, (r1 - r0) * esize);
    };
    phases[1].finish = [&](const sc::Task &t) { return k.deliver(t.dest, 0, true); };

    const uint64_t work = a.partial != nullptr ? static_cast<uint64_t>(n) * 4 * 2
                                               : static_cast<uint64_t>(n) * kk * esize;
    int rc = wait_all_free(k);
    if (rc != ROCMOE_OK) return rc;
    rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    for (int s = 0; s < k.world; ++s) {
        rc = k.wait(ws::phase2_signal(*k.layout, s), k.epoch, s, "its reduced chunk");
        if (rc != ROCMOE_OK) return rc;
    }
    if (problem == ROCMOE_OK && n > 0) std::memcpy(a.out, k.recv() + result_off, n * esize);
    return k.finish(problem, why);
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
    const int64_t n = a.n, esize = dtype_size(DT);
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
        // this rank's region of the destination's buffer (fixed stride: no need to know what
        // the other sources send there)
        const uint64_t dst = k.layout->source_bytes * static_cast<uint64_t>(k.rank) +
                             static_cast<uint64_t>(r0) * row_bytes;
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
    phases[0].finish = [&](const sc::Task &t) { return k.deliver(t.dest, a.send_counts[t.dest]); };
    // computing: count the multiply-adds as bytes touched (one float each)
    const uint64_t work = compute ? static_cast<uint64_t>(a.m) * a.k * n * 4 / 16
                                  : static_cast<uint64_t>(a.m) * row_bytes;
    int rc = wait_all_free(k);
    if (rc != ROCMOE_OK) return rc;
    rc = run_phases(k, phases, work);
    if (rc != ROCMOE_OK) return rc;
    int problem = ROCMOE_OK;
    std::string why;
    rc = k.collect(ws::data_signal, "its rows", k.layout->capacity, -1, &problem, &why);
    if (rc != ROCMOE_OK) return rc;
    if (problem == ROCMOE_OK) {
        // packed, sources in rank order (all_to_all_single's layout)
        char *out = static_cast<char *>(a.out);
        for (int s = 0; s < k.world; ++s) {
            const uint64_t bytes = static_cast<uint64_t>(k.common->recv_counts[s]) * row_bytes;
            if (bytes) std::memcpy(out, k.recv() + k.layout->source_bytes * s, bytes);
            out += bytes;
        }
    }
    return k.finish(problem, why);
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

int rocmoe_host_embedding_a2a(rocmoe_ctx *ctx, const rocmoe_embedding_a2a_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: args is NULL");
    rocmoe::Kernel k;
    int rc = rocmoe::start_kernel(ctx, &a->common, ROCMOE_OP_EMBEDDING_A2A, "embedding_all_to_all", &k);
    if (rc != ROCMOE_OK) return rc;
    const rocmoe_workspace_layout &l = *a->common.layout;
    if (a->num_tables < 0 || a->table_base < 0 || a->table_base + a->num_tables > a->total_tables ||
        int64_t(a->total_tables) * a->dim != l.width || a->dim != l.aux ||
        a->batch < 0 || a->batch > l.capacity || a->batch % k.world != 0 ||
        (a->mode != ROCMOE_BAG_SUM && a->mode != ROCMOE_BAG_MEAN) ||
        (a->out == nullptr && a->batch > 0) || a->common.recv_counts == nullptr ||
        (a->num_tables > 0 && a->batch > 0 && a->bags == nullptr &&
         (a->weights == nullptr || a->rows == nullptr || a->indices == nullptr ||
          a->num_indices == nullptr || a->offsets == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "embedding_all_to_all: inconsistent arguments (tables "
                    "%d at %d of %d, dim %" PRId64 ", batch %" PRId64 " of at most %" PRId64
                    ", mode %d)", a->num_tables, a->table_base, a->total_tables, a->dim, a->batch,
                    l.capacity, a->mode);
    return rocmoe::dispatch<rocmoe::EmbeddingOp>(l.dtype, k, *a);
}

int rocmoe_host_gemv_allreduce(rocmoe_ctx *ctx, const rocmoe_gemv_allreduce_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: args is NULL");
    rocmoe::Kernel k;
    int rc = rocmoe::start_kernel(ctx, &a->common, ROCMOE_OP_GEMV_ALLREDUCE, "gemv_all_reduce", &k);
    if (rc != ROCMOE_OK) return rc;
    const rocmoe_workspace_layout &l = *a->common.layout;
    if (a->n != l.capacity || a->k < 0 || a->out == nullptr || a->common.recv_counts == nullptr ||
        (a->partial == nullptr && a->k > 0 && (a->w == nullptr || a->x == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "gemv_all_reduce: N %" PRId64 " (the handle's is %" PRId64
                    "), NULL tensor or negative size", a->n, l.capacity);
    return rocmoe::dispatch<rocmoe::GemvOp>(l.dtype, k, *a);
}

int rocmoe_host_gemm_a2a(rocmoe_ctx *ctx, const rocmoe_gemm_a2a_args *a) {
    rocmoe::clear_error();
    if (a == nullptr) return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: args is NULL");
    rocmoe::Kernel k;
    int rc = rocmoe::start_kernel(ctx, &a->common, ROCMOE_OP_GEMM_A2A, "gemm_all_to_all", &k);
    if (rc != ROCMOE_OK) return rc;
    const rocmoe_workspace_layout &l = *a->common.layout;
    const int world = k.world;
    if (a->m < 0 || a->k < 0 || a->n != l.width || a->send_counts == nullptr ||
        a->out == nullptr || a->common.recv_counts == nullptr ||
        (a->y == nullptr && a->m * a->n > 0 && (a->x == nullptr || a->w == nullptr)))
        return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: N %" PRId64 " (the handle's is %" PRId64
                    "), NULL tensor or negative size", a->n, l.width);
    int64_t total = 0;
    for (int d = 0; d < world; ++d) {
        // the rows for d must fit this rank's region of d's buffer
        if (a->send_counts[d] < 0 || a->send_counts[d] > l.capacity)
            return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: %" PRId64 " rows for rank %d; the "
                        "handle takes 0 to %" PRId64 " per destination", a->send_counts[d], d,
                        l.capacity);
        total += a->send_counts[d];
    }
    if (total != a->m)
        return fail(ROCMOE_ERR_INVALID, "gemm_all_to_all: send counts sum to %" PRId64 ", not to "
                    "the %" PRId64 " rows", total, a->m);
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
    return rocmoe::dispatch<rocmoe::GemmOp>(l.dtype, k, *a);
}

int rocmoe_host_fused_abort(rocmoe_ctx *ctx, const rocmoe_fused_common *common) {
    rocmoe::clear_error();
    rocmoe::Kernel k;
    if (common == nullptr || common->layout == nullptr)
        return fail(ROCMOE_ERR_INVALID, "fused-op abort: NULL argument");
    int rc = rocmoe::start_kernel(ctx, common, common->layout->op, "fused-op abort", &k);
    if (rc != ROCMOE_OK) return rc;
    // the count slots of this parity may be rewritten once each destination read call e-2
    rc = rocmoe::wait_all_free(k);
    if (rc != ROCMOE_OK) return rc;
    for (int d = 0; d < k.world; ++d) {
        rc = k.deliver(d, ROCMOE_COUNT_ABORTED);
        if (rc == ROCMOE_OK && common->layout->op == ROCMOE_OP_GEMV_ALLREDUCE)
            rc = k.deliver(d, 0, true);
        if (rc != ROCMOE_OK) return rc;
    }
    // nothing of this call will be read here: the sources may reuse this buffer at once
    return k.ack_all();
}

}  // extern "C"
