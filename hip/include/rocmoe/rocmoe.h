/* rocmoe C ABI: the only entry point into librocmoe.
 *
 * Every function returns an integer status (ROCMOE_OK == 0, or a negative
 * ROCMOE_ERR_* code); the text of the last error of the calling thread is in
 * rocmoe_last_error(). Bootstrap data is exchanged by the caller (Python, over
 * MPI): librocmoe never talks to MPI itself, which keeps it launcher-agnostic.
 *
 * bindings/build_cffi.py feeds the text between the ROCMOE_CDEF markers to
 * cffi, so that section holds plain C declarations only: no macros, no
 * preprocessor lines, no inline code.
 */
#ifndef ROCMOE_ROCMOE_H
#define ROCMOE_ROCMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ROCMOE_CDEF_BEGIN */

/* status codes */
enum {
    ROCMOE_OK = 0,
    ROCMOE_ERR_INVALID = -1,        /* bad argument */
    ROCMOE_ERR_NOMEM = -2,          /* heap or host memory exhausted */
    ROCMOE_ERR_TIMEOUT = -3,        /* a bounded wait ran out */
    ROCMOE_ERR_PEER_DEAD = -4,      /* a peer process exited */
    ROCMOE_ERR_BACKEND = -5,        /* backend not compiled in or failed */
    ROCMOE_ERR_SYSTEM = -6,         /* an OS / driver call failed */
    ROCMOE_ERR_STATE = -7,          /* wrong lifecycle state (finalized, not connected) */
    ROCMOE_ERR_UNREACHABLE = -8     /* peer memory not directly addressable */
};

/* backends (bit positions in rocmoe_backends_compiled()) */
enum {
    ROCMOE_BACKEND_HOST = 0,
    ROCMOE_BACKEND_IPC = 1,
    ROCMOE_BACKEND_ROCSHMEM = 2,
    ROCMOE_BACKEND_NVSHMEM = 3
};

/* GPU platforms */
enum {
    ROCMOE_PLATFORM_NONE = 0,
    ROCMOE_PLATFORM_HIP = 1,
    ROCMOE_PLATFORM_CUDA = 2
};

/* comparison operators for waits */
enum {
    ROCMOE_CMP_EQ = 0,
    ROCMOE_CMP_NE = 1,
    ROCMOE_CMP_GT = 2,
    ROCMOE_CMP_GE = 3,
    ROCMOE_CMP_LT = 4,
    ROCMOE_CMP_LE = 5
};

typedef struct rocmoe_ctx rocmoe_ctx;

typedef struct rocmoe_init_args {
    int backend;              /* ROCMOE_BACKEND_* */
    int rank;
    int world_size;
    int local_rank;
    int local_size;
    int device;               /* GPU ordinal for GPU backends, -1 on host */
    uint64_t heap_size;       /* bytes of symmetric heap per rank */
    double timeout_s;         /* bound for every wait */
    const char *job_tag;      /* unique per job: names host segments */
} rocmoe_init_args;

const char *rocmoe_version(void);
const char *rocmoe_last_error(void);
unsigned rocmoe_backends_compiled(void);   /* bit mask of 1 << ROCMOE_BACKEND_* */
int rocmoe_gpu_platform(void);             /* ROCMOE_PLATFORM_* librocmoe was built for */
int rocmoe_gpu_device_count(int *count);   /* 0 devices when no GPU runtime */

/* Bootstrap, in three steps because the caller owns the transport:
 *   rocmoe_init          create this rank's heap
 *   rocmoe_bootstrap_blob  this rank's opaque handle (segment name / IPC handle)
 *   (caller all-gathers the blobs, rank order, each blob_size bytes)
 *   rocmoe_connect       map / open every peer's heap                       */
int rocmoe_init(const rocmoe_init_args *args, rocmoe_ctx **out);
size_t rocmoe_bootstrap_blob_size(void);
int rocmoe_bootstrap_blob(rocmoe_ctx *ctx, void *blob);
int rocmoe_connect(rocmoe_ctx *ctx, const void *all_blobs);
/* after every rank connected (caller's barrier): drop names that let others
 * attach, so nothing is left behind if the job dies later */
int rocmoe_seal(rocmoe_ctx *ctx);
int rocmoe_finalize(rocmoe_ctx *ctx);

int rocmoe_rank(const rocmoe_ctx *ctx);
int rocmoe_world_size(const rocmoe_ctx *ctx);
int rocmoe_backend(const rocmoe_ctx *ctx);
int rocmoe_device(const rocmoe_ctx *ctx);

/* symmetric heap: offsets are identical on every rank for the same call
 * sequence (deterministic first-fit allocator) */
uint64_t rocmoe_heap_size(const rocmoe_ctx *ctx);
uint64_t rocmoe_heap_free_bytes(const rocmoe_ctx *ctx);
uint64_t rocmoe_heap_largest_free(const rocmoe_ctx *ctx);
int rocmoe_heap_alloc(rocmoe_ctx *ctx, uint64_t nbytes, uint64_t align, uint64_t *offset);
int rocmoe_heap_free(rocmoe_ctx *ctx, uint64_t offset);
void *rocmoe_heap_base(const rocmoe_ctx *ctx);
/* rank `peer`'s address of `offset`, usable from this process (host backend:
 * CPU address; ipc: device address). ROCMOE_ERR_UNREACHABLE otherwise. */
int rocmoe_peer_ptr(const rocmoe_ctx *ctx, int peer, uint64_t offset, void **out);

/* one-sided data movement (host-initiated) */
int rocmoe_put(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src, uint64_t nbytes);
int rocmoe_get(rocmoe_ctx *ctx, int peer, uint64_t src_offset, void *dst, uint64_t nbytes);
int rocmoe_quiet(rocmoe_ctx *ctx);

/* signals: 64-bit slots at 8-byte aligned heap offsets. set = fence, then a
 * release store at system scope into `peer`'s slot; wait = acquire loads
 * until the comparison holds, bounded by timeout_s (<= 0: the context's).
 * `peer_hint` is the rank expected to write the slot (-1: unknown); it names
 * the peer in timeout errors and is checked for liveness while waiting. */
int rocmoe_signal_set(rocmoe_ctx *ctx, int peer, uint64_t offset, uint64_t value);
int rocmoe_signal_add(rocmoe_ctx *ctx, int peer, uint64_t offset, uint64_t value);
int rocmoe_signal_read(rocmoe_ctx *ctx, uint64_t offset, uint64_t *value);
int rocmoe_signal_wait_until(rocmoe_ctx *ctx, uint64_t offset, int cmp, uint64_t value,
                             double timeout_s, int peer_hint, uint64_t *observed);
int rocmoe_put_signal(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src,
                      uint64_t nbytes, uint64_t sig_offset, uint64_t sig_value);

/* ---- GPU device-side access (ipc backend; ROCMOE_ERR_BACKEND elsewhere) ----
 * rocmoe_device_peer_table: device address of an array [world] of heap bases as this
 * process sees them (own rank included), for kernels (rocmoe/shmem.h Team.peer_bases),
 * Triton and torch. Valid until rocmoe_finalize.
 * rocmoe_ipc_store_signal: launches on `stream` (a hipStream_t / cudaStream_t; NULL: the
 * default stream) a kernel that stores nbytes of device memory `src` into `peer`'s heap at
 * dst_offset, then sets `peer`'s slot sig_offset to sig_value (system-scope release). Returns
 * at once; the stream orders it.
 * rocmoe_ipc_wait_verify: launches on `stream` a kernel that waits (on the GPU, bounded by
 * timeout_s, <= 0: the context's) until this rank's slot sig_offset is >= value, then counts
 * the bytes of this rank's heap at heap_offset that differ from device memory `expected`;
 * synchronises the stream and returns ROCMOE_ERR_TIMEOUT or the count in *mismatches. */
int rocmoe_device_peer_table(const rocmoe_ctx *ctx, void **out);
int rocmoe_ipc_store_signal(rocmoe_ctx *ctx, int peer, uint64_t dst_offset, const void *src,
                            uint64_t nbytes, uint64_t sig_offset, uint64_t sig_value,
                            void *stream);
int rocmoe_ipc_wait_verify(rocmoe_ctx *ctx, uint64_t sig_offset, uint64_t value, double timeout_s,
                           uint64_t heap_offset, const void *expected, uint64_t nbytes,
                           void *stream, uint64_t *mismatches);

/* host segments left behind by crashed jobs (name prefix "rocmoe.") */
int rocmoe_host_segment_owner(const char *name, int *pid, int *alive);

/* ---- fused ops (issue 3): host persistent kernels, hip/src/host/fused_ops.cpp ----
 * Each call runs the schedule of rocmoe/schedule.h on worker threads of this rank and puts
 * its slices into the peers' receive buffers (memcpy into their mappings), then waits for
 * every source's slice and copies the received data to `out`. The caller (rocmoe.ops) has
 * validated the inputs on every rank and agreed on the sizes before calling: these entry
 * points recheck only what could corrupt memory. Workspace sizes and the slot layout are
 * given by the *_workspace functions (same on every rank for the same arguments). */
enum {
    ROCMOE_DTYPE_F32 = 0,
    ROCMOE_DTYPE_BF16 = 1,
    ROCMOE_DTYPE_F16 = 2
};

enum {
    ROCMOE_BAG_SUM = 0,
    ROCMOE_BAG_MEAN = 1
};

typedef struct rocmoe_fused_common {
    uint64_t epoch;          /* this call's number for the op, 1, 2, 3, ... (signals never reset) */
    uint64_t signal_offset;  /* heap offset of the op's uint64 signal slots */
    uint64_t recv_offset;    /* heap offset of the op's receive buffer (same on every rank) */
    uint64_t recv_bytes;     /* its capacity in bytes */
    int workers;             /* worker threads; <= 0: ROCMOE_HOST_WORKERS or min(4, cores) */
    int ranks_per_node;      /* for the remote-first order; <= 0: one node */
    double timeout_s;        /* bound of every wait; <= 0: the context's */
} rocmoe_fused_common;

typedef struct rocmoe_embedding_a2a_args {
    rocmoe_fused_common common;
    int dtype;                       /* of the tables and of out */
    int mode;                        /* ROCMOE_BAG_* */
    int num_tables;                  /* this rank's tables (0 allowed) */
    int total_tables;                /* over all ranks */
    int table_base;                  /* global index of this rank's first table */
    int64_t batch;                   /* global batch, a multiple of the world size */
    int64_t dim;
    const void *const *weights;      /* num_tables x [rows, dim], contiguous */
    const int64_t *rows;             /* num_tables */
    const int64_t *const *indices;   /* num_tables x [num_indices] */
    const int64_t *num_indices;      /* num_tables */
    const int64_t *const *offsets;   /* num_tables x [batch] bag starts */
    const float *const *per_sample_weights;  /* NULL, or num_tables x [num_indices] */
    void *out;                       /* [batch / world, total_tables, dim] */
    const void *bags;                /* NULL: look up here; else [batch, num_tables, dim] of
                                        dtype already pooled (the kernel only moves them) */
} rocmoe_embedding_a2a_args;

typedef struct rocmoe_gemv_allreduce_args {
    rocmoe_fused_common common;
    int dtype;                       /* of w, x and out */
    int64_t n, k;
    const void *w;                   /* [n, k] row-major, contiguous */
    const void *x;                   /* [k] */
    void *out;                       /* [n], identical on every rank */
    const float *partial;            /* NULL: compute W x here; else [n] fp32 = W x already */
} rocmoe_gemv_allreduce_args;

typedef struct rocmoe_gemm_a2a_args {
    rocmoe_fused_common common;
    int dtype;                       /* of x, y and out */
    int64_t m, k, n;
    const void *x;                   /* [m, k], dtype; NULL when y is given */
    const float *w;                  /* [k, n] fp32 (accumulation is fp32) */
    const void *y;                   /* NULL: compute x @ w here; else [m, n] rows to send */
    const int64_t *send_counts;      /* world: rows for each destination, in row order */
    const int64_t *dest_row_offsets; /* world: first row of this rank's part in each dest */
    int64_t recv_rows;               /* rows this rank receives in all */
    void *out;                       /* [recv_rows, n] */
    /* Grouped products (0: one W). With groups = G > 0, w is [G, k, n] fp32 and each
     * destination's rows are G consecutive segments, group_counts[d * G + g] rows for group
     * g (summing to send_counts[d]); segment (d, g) is multiplied by W[g]. */
    int64_t groups;
    const int64_t *group_counts;     /* [world * groups] */
} rocmoe_gemm_a2a_args;

/* bytes of receive buffer and number of signal slots each op needs */
int rocmoe_embedding_a2a_workspace(int world, int64_t batch, int total_tables, int64_t dim,
                                   int dtype, uint64_t *recv_bytes, uint64_t *signal_slots);
int rocmoe_gemv_allreduce_workspace(int world, int64_t n, int dtype, uint64_t *recv_bytes,
                                    uint64_t *signal_slots);
int rocmoe_gemm_a2a_workspace(int world, int64_t recv_rows, int64_t n, int dtype,
                              uint64_t *recv_bytes, uint64_t *signal_slots);

int rocmoe_host_embedding_a2a(rocmoe_ctx *ctx, const rocmoe_embedding_a2a_args *args);
int rocmoe_host_gemv_allreduce(rocmoe_ctx *ctx, const rocmoe_gemv_allreduce_args *args);
int rocmoe_host_gemm_a2a(rocmoe_ctx *ctx, const rocmoe_gemm_a2a_args *args);
/* worker threads a fused op uses when common.workers <= 0 */
int rocmoe_host_default_workers(void);

/* ---- fused ops (GPU): persistent kernels, hip/src/gpu/fused_*.hip ----
 * Called by rocmoe/ops/gpu.py. Each call enqueues on `fused.stream` (hipStream_t /
 * cudaStream_t; NULL = the default stream) and returns: the producer kernel (schedule.h:
 * remote-first slices, atomic task counter, per-slice done counters; tiles stored straight
 * into the destinations' heaps; the completer of a slice stores the epoch into the
 * destination's slot with release semantics at system scope), then the consumer's bounded
 * wait. Timeouts are recorded in `status` (read it after the stream ran), never hang.
 * Addresses are this rank's view of symmetric objects; peers are reached through
 * team.peer_bases. `slots` holds 3 * world int64: data signals by source, acks by
 * destination (receive buffer free again), second-phase signals by owner. */
typedef struct rocmoe_gpu_team {
    const void *peer_bases;  /* device array [world] of heap bases as seen by this process */
    int rank;
    int world;
    int ranks_per_node;      /* remote-first order; <= 0: one node */
} rocmoe_gpu_team;

typedef struct rocmoe_gpu_fused {
    uint64_t epoch;          /* 1, 2, 3, ... per op; receive buffer = epoch parity's */
    void *slots;             /* heap: int64 [3 * world] */
    void *recv;              /* heap: this call's receive buffer */
    void *stage;             /* device scratch for scale-out puts (rows this rank sends, by
                                destination); NULL when every peer is load/store reachable */
    void *counters;          /* device uint32 [3 + 2 * world], zero before the first call */
    int *status;             /* device int32 [3 * world]: 0 ok, 1 wait timed out */
    int workgroups;          /* <= 0: per compute unit count */
    int signal_enabled;      /* 0: no acks, done counters, signals or waits (benchmarks) */
    double timeout_s;        /* bound of every wait */
    void *stream;
} rocmoe_gpu_fused;

typedef struct rocmoe_gpu_embedding_args {
    rocmoe_gpu_team team;
    rocmoe_gpu_fused fused;
    int dtype;               /* ROCMOE_DTYPE_* of the tables and the output */
    int mode;                /* ROCMOE_BAG_* */
    int num_tables;          /* this rank's tables (0 allowed: signals only) */
    int total_tables;
    int table_base;          /* global index of this rank's first table */
    int has_per_sample_weights;
    int64_t batch;           /* global batch, a multiple of world */
    int64_t dim;
    /* device int64 [6 * num_tables]: weight, index, offset, per-sample-weight (fp32) base
     * addresses, then rows and number of indices of each table */
    const int64_t *tables;
} rocmoe_gpu_embedding_args;

typedef struct rocmoe_gpu_gemv_args {
    rocmoe_gpu_team team;
    rocmoe_gpu_fused fused;
    int dtype;
    int64_t n, k;            /* W [n, k] row-major, x [k] */
    const void *w;
    const void *x;
    uint64_t gather_offset;  /* bytes into recv where the all-gathered y [n] lands; recv
                                starts with fp32 partials [world][ceil(n / world)] */
    void *out;               /* optional y [n] of the op's dtype: when set, the op itself
                                waits, copies y there and acknowledges the peers (the
                                caller launches no wait, copy or ack); NULL: y stays in recv */
} rocmoe_gpu_gemv_args;

int rocmoe_gpu_embedding_a2a(const rocmoe_gpu_embedding_args *args);
int rocmoe_gpu_gemv_allreduce(const rocmoe_gpu_gemv_args *args);

/* ROCMOE_CDEF_END */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROCMOE_ROCMOE_H */
