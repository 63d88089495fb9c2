// rocmoe_workspace_layout_init: the one definition of a fused-op handle's workspace
// (rocmoe/workspace.h describes the regions).
#include <cinttypes>

#include "internal.hpp"
#include "rocmoe/schedule.h"
#include "rocmoe/workspace.h"

namespace {

uint64_t align_up(uint64_t v) { return rocmoe::sched::align_up(v, rocmoe::ws::kAlign); }

int elem_bytes(int dtype) {
    switch (dtype) {
        case ROCMOE_DTYPE_F32: return 4;
        case ROCMOE_DTYPE_BF16:
        case ROCMOE_DTYPE_F16: return 2;
        default: return 0;
    }
}

// bytes a size may reach before uint64 offsets could overflow: far above any heap
constexpr uint64_t kMaxBytes = 1ull << 56;

}  // namespace

extern "C" size_t rocmoe_workspace_layout_size(void) { return sizeof(rocmoe_workspace_layout); }

extern "C" int rocmoe_workspace_layout_init(int op, int world, int dtype, int64_t a, int64_t b,
                                            int64_t c, rocmoe_workspace_layout *out) {
    using rocmoe::fail;
    if (out == nullptr) return fail(ROCMOE_ERR_INVALID, "workspace layout: out is NULL");
    if (world < 1 || world > (1 << 20))
        return fail(ROCMOE_ERR_INVALID, "workspace layout: world size %d", world);
    const int eb = elem_bytes(dtype);
    if (eb == 0) return fail(ROCMOE_ERR_INVALID, "workspace layout: dtype code %d", dtype);
    rocmoe_workspace_layout l{};
    l.op = op;
    l.world = world;
    l.dtype = dtype;
    l.elem_bytes = eb;
    const uint64_t w = uint64_t(world);
    uint64_t parity = 0;
    switch (op) {
        case ROCMOE_OP_EMBEDDING_A2A: {
            // a: max global batch, b: total tables, c: dim; buffer = [batch/world, T, D]
            if (a < 1 || a % world != 0 || b < 1 || c < 1)
                return fail(ROCMOE_ERR_INVALID,
                            "embedding workspace: max batch %" PRId64 " (a positive multiple of "
                            "the %d ranks), %" PRId64 " tables and dim %" PRId64 " must be > 0",
                            a, world, b, c);
            l.capacity = a;
            l.width = b * c;
            l.aux = c;
            parity = uint64_t(a / world) * uint64_t(b) * uint64_t(c) * uint64_t(eb);
            break;
        }
        case ROCMOE_OP_GEMV_ALLREDUCE: {
            // a: N; buffer = fp32 partials [world][N], then y [N] (rocmoe/schedule.h)
            if (a < 1) return fail(ROCMOE_ERR_INVALID, "gemv workspace: N %" PRId64, a);
            l.capacity = a;
            l.width = 1;
            l.gather_offset = rocmoe::sched::gemv_result_offset(a, world);
            parity = l.gather_offset + uint64_t(a) * uint64_t(eb);
            break;
        }
        case ROCMOE_OP_GEMM_A2A: {
            // a: max rows a source sends one destination, b: N; one region per source
            if (a < 1 || b < 1)
                return fail(ROCMOE_ERR_INVALID, "gemm workspace: max rows %" PRId64 " and N %"
                            PRId64 " must be > 0", a, b);
            l.capacity = a;
            l.width = b;
            l.source_bytes = align_up(uint64_t(a) * uint64_t(b) * uint64_t(eb));
            parity = l.source_bytes * w;
            break;
        }
        default:
            return fail(ROCMOE_ERR_INVALID, "workspace layout: op code %d is unknown", op);
    }
    if (parity > kMaxBytes)
        return fail(ROCMOE_ERR_INVALID, "workspace layout: %" PRIu64 " bytes per buffer", parity);
    l.counter_words = rocmoe::ws::counter_words(world);
    l.status_words = rocmoe::ws::status_words(world);
    uint64_t at = 0;
    l.data_signals = at;
    at += 8 * w;
    l.acks = at;
    at += 8 * w;
    l.phase2_signals = at;
    at += 8 * w;
    l.counts = at;
    at += 16 * w;
    at = align_up(at);
    l.local = at;
    l.counters = at + 8;
    at = align_up(at + 8 + 4 * l.counter_words);
    l.recv = at;
    l.parity_bytes = align_up(parity);
    at += 2 * l.parity_bytes;
    l.total_bytes = align_up(at);
    *out = l;
    return ROCMOE_OK;
}
