// The C ABI: argument checks, lifecycle state, and dispatch to the backend.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>

#include "internal.hpp"

#ifndef ROCMOE_VERSION_STRING
#define ROCMOE_VERSION_STRING "0.0.0"
#endif

namespace rocmoe {

static thread_local char g_last_error[1024] = "";

int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return code;
}

void clear_error() { g_last_error[0] = '\0'; }

}  // namespace rocmoe

using rocmoe::fail;

namespace {

int check_live(const rocmoe_ctx *ctx) {
    if (ctx == nullptr) return fail(ROCMOE_ERR_INVALID, "context is NULL");
    if (ctx->finalized) return fail(ROCMOE_ERR_STATE, "context was finalized");
    return ROCMOE_OK;
}

int check_connected(const rocmoe_ctx *ctx) {
    int rc = check_live(ctx);
    if (rc != ROCMOE_OK) return rc;
    if (!ctx->connected)
        return fail(ROCMOE_ERR_STATE, "context is not connected: call rocmoe_connect first");
    return ROCMOE_OK;
}

int check_peer(const rocmoe_ctx *ctx, int peer) {
    if (peer < 0 || peer >= ctx->args.world_size)
        return fail(ROCMOE_ERR_INVALID, "peer rank %d out of range [0, %d)", peer,
                    ctx->args.world_size);
    return ROCMOE_OK;
}

int check_range(const rocmoe_ctx *ctx, uint64_t offset, uint64_t nbytes) {
    const uint64_t size = ctx->heap->size();
    if (offset > size || nbytes > size - offset)
        return fail(ROCMOE_ERR_INVALID,
                    "heap range [%" PRIu64 ", %" PRIu64 ") exceeds the heap of %" PRIu64 " bytes",
                    offset, offset + nbytes, size);
    return ROCMOE_OK;
}

int check_slot(const rocmoe_ctx *ctx, uint64_t offset) {
    if (offset % 8 != 0)
        return fail(ROCMOE_ERR_INVALID, "signal offset %" PRIu64 " is not 8-byte aligned", offset);
    return check_range(ctx, offset, 8);
}

bool compare(uint64_t a, int cmp, uint64_t b) {
    switch (cmp) {
        case ROCMOE_CMP_EQ: return a == b;
        case ROCMOE_CMP_NE: return a != b;
        case ROCMOE_CMP_GT: return a > b;
        case ROCMOE_CMP_GE: return a >= b;
        case ROCMOE_CMP_LT: return a < b;
        case ROCMOE_CMP_LE: return a <= b;
        default: return false;
    }
}

const char *cmp_name(int cmp) {
    static const char *names[] = {"==", "!=", ">", ">=", "<", "<="};
    return (cmp >= 0 && cmp <= 5) ? names[cmp] : "?";
}

}  // namespace

extern "C" {

const char *rocmoe_version(void) { return ROCMOE_VERSION_STRING; }
const char *rocmoe_last_error(void) { return rocmoe::g_last_error; }

unsigned rocmoe_backends_compiled(void) {
    unsigned mask = 1u << ROCMOE_BACKEND_HOST;
#if defined(ROCMOE_HAVE_GPU)
    mask |= 1u << ROCMOE_BACKEND_IPC;
#endif
#if defined(ROCMOE_HAVE_ROCSHMEM)
    mask |= 1u << ROCMOE_BACKEND_ROCSHMEM;
#endif
#if defined(ROCMOE_HAVE_NVSHMEM)
    mask |= 1u << ROCMOE_BACKEND_NVSHMEM;
#endif
    return mask;
}

int rocmoe_gpu_platform(void) {
#if defined(ROCMOE_PLATFORM_IS_HIP)
    return ROCMOE_PLATFORM_HIP;
#elif defined(ROCMOE_PLATFORM_IS_CUDA)
    return ROCMOE_PLATFORM_CUDA;
#else
    return ROCMOE_PLATFORM_NONE;
#endif
}

int rocmoe_gpu_device_count(int *count) {
    if (count == nullptr) return fail(ROCMOE_ERR_INVALID, "count is NULL");
#if defined(ROCMOE_HAVE_GPU)
    return rocmoe::gpu_device_count(count);
#else
    *count = 0;
    return ROCMOE_OK;
#endif
}

int rocmoe_init(const rocmoe_init_args *args, rocmoe_ctx **out) {
    rocmoe::clear_error();
    if (args == nullptr || out == nullptr) return fail(ROCMOE_ERR_INVALID, "args or out is NULL");
    *out = nullptr;
    if (args->world_size < 1 || args->rank < 0 || args->rank >= args->world_size)
        return fail(ROCMOE_ERR_INVALID, "rank %d / world size %d is not a valid pair", args->rank,
                    args->world_size);
    if (args->local_size < 1 || args->local_rank < 0 || args->local_rank >= args->local_size)
        return fail(ROCMOE_ERR_INVALID, "local rank %d / local size %d is not a valid pair",
                    args->local_rank, args->local_size);
    if (args->heap_size < 4096)
        return fail(ROCMOE_ERR_INVALID, "heap size %" PRIu64 " is below the 4096-byte minimum",
                    args->heap_size);
    if (!(args->timeout_s > 0))
        return fail(ROCMOE_ERR_INVALID, "timeout %g s must be positive", args->timeout_s);
    if (!(rocmoe_backends_compiled() & (1u << args->backend)))
        return fail(ROCMOE_ERR_BACKEND,
                    "backend %d is not compiled into this librocmoe (mask 0x%x); rebuild with the "
                    "matching ROCMOE_GPU / ROCMOE_SHMEM CMake options",
                    args->backend, rocmoe_backends_compiled());

    auto ctx = std::make_unique<rocmoe_ctx>();
    ctx->args = *args;
    ctx->job_tag = args->job_tag ? args->job_tag : "";
    ctx->args.job_tag = ctx->job_tag.c_str();
    if (args->backend == ROCMOE_BACKEND_HOST) ctx->backend = rocmoe::make_host_backend();
#if defined(ROCMOE_HAVE_GPU)
    else if (args->backend == ROCMOE_BACKEND_IPC) ctx->backend = rocmoe::make_ipc_backend();
#endif
#if defined(ROCMOE_HAVE_NVSHMEM)
    else if (args->backend == ROCMOE_BACKEND_NVSHMEM) ctx->backend = rocmoe::make_nvshmem_backend();
#endif
    else return fail(ROCMOE_ERR_BACKEND, "backend %d has no implementation here", args->backend);

    int rc = ctx->backend->init(ctx->args);
    if (rc != ROCMOE_OK) return rc;
    ctx->heap = std::make_unique<rocmoe::HeapAllocator>(args->heap_size);
    *out = ctx.release();
    return ROCMOE_OK;
}

size_t rocmoe_bootstrap_blob_size(void) { return rocmoe::kBlobSize; }

int rocmoe_bootstrap_blob(rocmoe_ctx *ctx, void *blob) {
    int rc = check_live(ctx);
    if (rc != ROCMOE_OK) return rc;
    if (blob == nullptr) return fail(ROCMOE_ERR_INVALID, "blob is NULL");
    std::memset(blob, 0, rocmoe::kBlobSize);
    return ctx->backend->bootstrap_blob(blob);
}

int rocmoe_connect(rocmoe_ctx *ctx, const void *all_blobs) {
    int rc = check_live(ctx);
    if (rc != ROCMOE_OK) return rc;
    if (all_blobs == nullptr) return fail(ROCMOE_ERR_INVALID, "all_blobs is NULL");
    if (ctx->connected) return fail(ROCMOE_ERR_STATE, "context is already connected");
    rc = ctx->backend->connect(all_blobs);
    if (rc == ROCMOE_OK) ctx->connected = true;
    return rc;
}

int rocmoe_seal(rocmoe_ctx *ctx) {
    int rc = check_connected(ctx);
    return rc != ROCMOE_OK ? rc : ctx->backend->seal();
}

int rocmoe_finalize(rocmoe_ctx *ctx) {
    if (ctx == nullptr) return fail(ROCMOE_ERR_INVALID, "context is NULL");
    int rc = ROCMOE_OK;
    if (!ctx->finalized) rc = ctx->backend->finalize();
    delete ctx;
    return rc;
}

int rocmoe_rank(const rocmoe_ctx *ctx) { return ctx ? ctx->args.rank : -1; }
int rocmoe_world_size(const rocmoe_ctx *ctx) { return ctx ? ctx->args.world_size : -1; }
int rocmoe_backend(const rocmoe_ctx *ctx) { return ctx ? ctx->args.backend : -1; }
int rocmoe_device(const rocmoe_ctx *ctx) { return ctx ? ctx->args.device : -1; }

uint64_t rocmoe_heap_size(const rocmoe_ctx *ctx) { return ctx && ctx->heap ? ctx->heap->size() : 0; }
uint64_t rocmoe_heap_free_bytes(const rocmoe_ctx *ctx) {
    return ctx && ctx->heap ? ctx->heap->free_bytes() : 0;
}
uint64_t rocmoe_heap_largest_free(const rocmoe_ctx *ctx) {
    return ctx && ctx->heap ? ctx->heap->largest_free() : 0;
}

int rocmoe_heap_alloc(rocmoe_ctx *ctx, uint64_t nbytes, uint64_t align, uint64_t *offset) {
    int rc = check_live(ctx);
    if (rc != ROCMOE_OK) return rc;
    if (offset == nullptr) return fail(ROCMOE_ERR_INVALID, "offset is NULL");
    return ctx->heap->alloc(nbytes, align, offset);
}

int rocmoe_heap_free(rocmoe_ctx *ctx, uint64_t offset) {
    int rc = check_live(ctx);
    return rc != ROCMOE_OK ? rc : ctx->heap->free(offset);
}

void *rocmoe_heap_base(const rocmoe_ctx *ctx) {
    return (ctx && !ctx->finalized) ? ctx->backend->base() : nullptr;
}

int rocmoe_peer_ptr(const rocmoe_ctx *ctx, int peer, uint64_t offset, void **out) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_range(ctx, offset, 0);
    if (rc != ROCMOE_OK) return rc;
    if (out == nullptr) return fail(ROCMOE_ERR_INVALID, "out is NULL");
    return ctx->backend->peer_ptr(peer, offset, out);
}

int rocmoe_put(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src, uint64_t nbytes) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_range(ctx, dst_offset, nbytes);
    if (rc != ROCMOE_OK) return rc;
    if (nbytes == 0) return ROCMOE_OK;
    if (src == nullptr) return fail(ROCMOE_ERR_INVALID, "src is NULL");
    return ctx->backend->put(peer, dst_offset, src, nbytes);
}

int rocmoe_get(rocmoe_ctx *ctx, int peer, uint64_t src_offset, void *dst, uint64_t nbytes) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_range(ctx, src_offset, nbytes);
    if (rc != ROCMOE_OK) return rc;
    if (nbytes == 0) return ROCMOE_OK;
    if (dst == nullptr) return fail(ROCMOE_ERR_INVALID, "dst is NULL");
    return ctx->backend->get(peer, src_offset, dst, nbytes);
}

int rocmoe_quiet(rocmoe_ctx *ctx) {
    int rc = check_connected(ctx);
    return rc != ROCMOE_OK ? rc : ctx->backend->quiet();
}

int rocmoe_signal_set(rocmoe_ctx *ctx, int peer, uint64_t offset, uint64_t value) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, offset);
    return rc != ROCMOE_OK ? rc : ctx->backend->signal_store(peer, offset, value, false);
}

int rocmoe_signal_add(rocmoe_ctx *ctx, int peer, uint64_t offset, uint64_t value) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, offset);
    return rc != ROCMOE_OK ? rc : ctx->backend->signal_store(peer, offset, value, true);
}

int rocmoe_signal_read(rocmoe_ctx *ctx, uint64_t offset, uint64_t *value) {
    int rc = check_live(ctx);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, offset);
    if (rc != ROCMOE_OK) return rc;
    if (value == nullptr) return fail(ROCMOE_ERR_INVALID, "value is NULL");
    return ctx->backend->signal_load(offset, value);
}

int rocmoe_signal_wait_until(rocmoe_ctx *ctx, uint64_t offset, int cmp, uint64_t value,
                             double timeout_s, int peer_hint, uint64_t *observed) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, offset);
    if (rc != ROCMOE_OK) return rc;
    if (cmp < ROCMOE_CMP_EQ || cmp > ROCMOE_CMP_LE)
        return fail(ROCMOE_ERR_INVALID, "comparison %d is not a ROCMOE_CMP_* value", cmp);
    if (peer_hint >= ctx->args.world_size)
        return fail(ROCMOE_ERR_INVALID, "peer hint %d out of range [0, %d)", peer_hint,
                    ctx->args.world_size);
    if (!(timeout_s > 0)) timeout_s = ctx->args.timeout_s;

    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration<double>(timeout_s);
    auto next_liveness = start + std::chrono::milliseconds(100);
    uint64_t seen = 0;
    // Phases by elapsed time, not by loop count (a load costs ns on host, us on a GPU heap):
    // spin for 5 us (a put is usually already on its way), then yield until 2 ms (ranks
    // often share cores: yielding lets the peer that will set the flag run), then sleep with
    // a back-off capped at 1 ms, so a long wait does not burn a core.
    const auto spin_until = start + std::chrono::microseconds(5);
    const auto yield_until = start + std::chrono::milliseconds(2);
    auto pause = std::chrono::microseconds(20);
    for (uint64_t iter = 0;; ++iter) {
        rc = ctx->backend->signal_load(offset, &seen);
        if (rc != ROCMOE_OK) return rc;
        if (compare(seen, cmp, value)) {
            if (observed) *observed = seen;
            return ROCMOE_OK;
        }
        if (iter % 64 != 63) continue;  // read the clock only now and then while spinning
        const auto now = clock::now();
        if (now >= deadline) break;
        if (now < spin_until) continue;
        if (peer_hint >= 0 && now >= next_liveness) {
            if (!ctx->backend->peer_alive(peer_hint))
                return fail(ROCMOE_ERR_PEER_DEAD,
                            "rank %d waited on signal slot at offset %" PRIu64
                            " for rank %d, which has exited (slot holds %" PRIu64
                            ", waited for %s %" PRIu64 ")",
                            ctx->args.rank, offset, peer_hint, seen, cmp_name(cmp), value);
            next_liveness = now + std::chrono::milliseconds(100);
        }
        if (now < yield_until) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(pause);
            pause = std::min(pause * 2, std::chrono::microseconds(1000));
        }
    }
    if (observed) *observed = seen;
    char peer_text[32];
    if (peer_hint >= 0) std::snprintf(peer_text, sizeof peer_text, "rank %d", peer_hint);
    else std::snprintf(peer_text, sizeof peer_text, "an unknown peer");
    return fail(ROCMOE_ERR_TIMEOUT,
                "rank %d timed out after %.3g s waiting for %s to set signal slot at offset %" PRIu64
                " to %s %" PRIu64 " (it holds %" PRIu64
                "); is the peer alive and making the same calls? raise ROCMOE_TIMEOUT_S if it is "
                "only slow",
                ctx->args.rank, timeout_s, peer_text, offset, cmp_name(cmp), value, seen);
}

int rocmoe_put_signal(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src,
                      uint64_t nbytes, uint64_t sig_offset, uint64_t sig_value) {
    // Validate the signal slot before any byte moves: bad input must leave peers untouched.
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, sig_offset);
    if (rc == ROCMOE_OK) rc = rocmoe_put(ctx, peer, dst_offset, src, nbytes);
    if (rc != ROCMOE_OK) return rc;
    // put is ordered before the signal by the release store in signal_store
    return rocmoe_signal_set(ctx, peer, sig_offset, sig_value);
}

/* ---- GPU device-side access (ipc backend) ---- */

int rocmoe_device_peer_table(const rocmoe_ctx *ctx, void **out) {
    int rc = check_connected(ctx);
    if (rc != ROCMOE_OK) return rc;
    if (out == nullptr) return fail(ROCMOE_ERR_INVALID, "out is NULL");
    return ctx->backend->device_peer_table(out);
}

int rocmoe_ipc_store_signal(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src,
                            uint64_t nbytes, uint64_t sig_offset, uint64_t sig_value,
                            void *stream) {
    // Everything is checked before the launch: bad input must leave peers untouched.
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_peer(ctx, peer);
    if (rc == ROCMOE_OK) rc = check_range(ctx, dst_offset, nbytes);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, sig_offset);
    if (rc != ROCMOE_OK) return rc;
    if (nbytes > 0 && src == nullptr) return fail(ROCMOE_ERR_INVALID, "src is NULL");
    if (sig_offset + 8 > dst_offset && sig_offset < dst_offset + nbytes)
        return fail(ROCMOE_ERR_INVALID,
                    "signal slot at offset %" PRIu64 " lies inside the destination range [%" PRIu64
                    ", %" PRIu64 ")",
                    sig_offset, dst_offset, dst_offset + nbytes);
    return ctx->backend->device_store_signal(peer, dst_offset, src, nbytes, sig_offset, sig_value,
                                             stream);
}

int rocmoe_ipc_wait_verify(rocmoe_ctx *ctx, uint64_t sig_offset, uint64_t value, double timeout_s,
                           uint64_t heap_offset, const void *expected, uint64_t nbytes,
                           void *stream, uint64_t *mismatches) {
    int rc = check_connected(ctx);
    if (rc == ROCMOE_OK) rc = check_slot(ctx, sig_offset);
    if (rc == ROCMOE_OK) rc = check_range(ctx, heap_offset, nbytes);
    if (rc != ROCMOE_OK) return rc;
    if (mismatches == nullptr) return fail(ROCMOE_ERR_INVALID, "mismatches is NULL");
    if (nbytes > 0 && expected == nullptr) return fail(ROCMOE_ERR_INVALID, "expected is NULL");
    if (!(timeout_s > 0)) timeout_s = ctx->args.timeout_s;
    return ctx->backend->device_wait_verify(sig_offset, value, timeout_s, heap_offset, expected,
                                            nbytes, stream, mismatches);
}

}  // extern "C"
