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

/* ---- fused ops: one protocol for every backend (DESIGN.md, "Signal protocol") ----
 *
 * A fused op runs through a handle (rocmoe.ops.GemmAllToAll, EmbeddingAllToAll,
 * GemvAllReduce): created collectively once, it owns one symmetric workspace whose layout is
 * rocmoe_workspace_layout below (the same offsets on every rank; rocmoe/workspace.h has the
 * __host__ __device__ accessors). A call of the handle touches no host collective:
 *
 *   epoch     calls are numbered 1, 2, 3, ... per handle; on GPUs the number lives in the
 *             workspace's local area and is advanced by the kernel itself (CUDA/HIP graphs
 *             replay correctly); receive buffer e % 2 is used by call e (double buffering)
 *   producer  before writing into destination d's buffer e % 2, wait until d acknowledged
 *             call e - 2 (acks[d] >= e - 2); write the data, then this rank's count for d
 *             into d's count slot (parity e % 2, source me), then release-store e into d's
 *             data signal for me, at system scope
 *   consumer  wait until every source's data signal is >= e, read its count (rows, or the
 *             global batch for the embedding; negative: the source sent no data, see
 *             ROCMOE_COUNT_*), copy the data out, then store e into every source's ack slot
 *   abort     a rank that rejects its own input calls the op's abort entry point instead:
 *             it writes ROCMOE_COUNT_ABORTED into every destination's count slot, signals,
 *             and acknowledges, so its peers finish the call and report it, and every
 *             rank's epoch stays the same
 *
 * Every wait is bounded (timeout_s). On the host backend a call returns an error code at
 * once (ROCMOE_ERR_TIMEOUT, ROCMOE_ERR_INVALID naming the aborting rank). GPU kernels record
 * status words (ROCMOE_STATUS_*) in host-mapped memory instead; rocmoe.ops raises them at
 * the handle's next call, at handle.synchronize() or at ctx.barrier(). */
enum {
    ROCMOE_DTYPE_F32 = 0,
    ROCMOE_DTYPE_BF16 = 1,
    ROCMOE_DTYPE_F16 = 2
};

enum {
    ROCMOE_BAG_SUM = 0,
    ROCMOE_BAG_MEAN = 1
};

enum {
    ROCMOE_OP_EMBEDDING_A2A = 1,     /* capacity: max global batch; width: total tables x dim */
    ROCMOE_OP_GEMV_ALLREDUCE = 2,    /* capacity: N */
    ROCMOE_OP_GEMM_A2A = 3           /* capacity: max rows one source sends one destination;
                                        width: N (also the plain row exchange: N = row width) */
};

/* count-slot values below zero: the source sent no data in this call */
enum {
    ROCMOE_COUNT_ABORTED = -1,       /* it rejected its own input (before any write) */
    ROCMOE_COUNT_BAD_INPUT = -2      /* its kernel found bad input (an index out of range) */
};

/* status words (int32, host-readable; one set per handle): 0 is fine */
enum {
    ROCMOE_STATUS_OK = 0,
    ROCMOE_STATUS_TIMEOUT = 1,       /* a bounded wait ran out */
    ROCMOE_STATUS_PEER_ABORTED = 2,  /* the peer rejected its input (its count slot said so) */
    ROCMOE_STATUS_PEER_BAD_INPUT = 3,/* the peer's kernel found bad input */
    ROCMOE_STATUS_BAD_COUNT = 4,     /* the peer's count exceeds the handle's capacity */
    ROCMOE_STATUS_MISMATCH = 5,      /* the peer's count differs from ours (embedding batch) */
    ROCMOE_STATUS_BAD_INPUT = 6      /* this rank's input was bad (found on the device) */
};

/* Where everything of one handle's workspace is: byte offsets from the workspace's start
 * (its heap offset is the same on every rank). Filled by rocmoe_workspace_layout_init; read
 * by the host backend, the HIP kernels and (through cffi) the Triton launchers. */
typedef struct rocmoe_workspace_layout {
    int32_t op;                /* ROCMOE_OP_* */
    int32_t world;
    int32_t dtype;             /* ROCMOE_DTYPE_* of the data */
    int32_t elem_bytes;
    int64_t capacity;          /* see ROCMOE_OP_* */
    int64_t width;             /* elements per row (embedding: total_tables * dim) */
    int64_t aux;               /* embedding: dim; others 0 */
    uint64_t data_signals;     /* uint64 [world], by source: epoch of its last delivery */
    uint64_t acks;             /* uint64 [world], by destination: epoch it finished reading */
    uint64_t phase2_signals;   /* uint64 [world], by owner (GEMV's all-gather) */
    uint64_t counts;           /* int64 [2][world], by parity and source */
    uint64_t local;            /* this rank's own state: uint64 epoch, then uint32 counters */
    uint64_t counters;         /* uint32 [counter_words], inside local (workspace.h) */
    uint64_t recv;             /* receive buffers, buffer p at recv + p * parity_bytes */
    uint64_t parity_bytes;
    uint64_t source_bytes;     /* GEMM: one source's region inside a buffer (fixed stride) */
    uint64_t gather_offset;    /* GEMV: where y [N] starts inside a buffer (after partials) */
    uint64_t total_bytes;      /* the whole workspace, 256-byte aligned */
    uint64_t counter_words;    /* uint32 counters at `counters` */
    uint64_t status_words;     /* int32 status words of the handle (not in the heap) */
} rocmoe_workspace_layout;

/* op-specific sizes: embedding (max_batch, total_tables, dim), GEMV (n, 0, 0),
 * GEMM (max_rows_per_source, n, 0) */
int rocmoe_workspace_layout_init(int op, int world, int dtype, int64_t a, int64_t b, int64_t c,
                                 rocmoe_workspace_layout *out);
/* sizeof(rocmoe_workspace_layout) as compiled into librocmoe (checked by rocmoe.ops) */
size_t rocmoe_workspace_layout_size(void);

/* What every host-backend call of a handle passes. */
typedef struct rocmoe_fused_common {
    const rocmoe_workspace_layout *layout;
    uint64_t workspace;      /* heap offset of the handle's workspace */
    uint64_t epoch;          /* this call's number, 1, 2, 3, ... */
    int workers;             /* worker threads; <= 0: ROCMOE_HOST_WORKERS or min(4, cores) */
    int ranks_per_node;      /* for the remote-first order; <= 0: one node */
    double timeout_s;        /* bound of every wait; <= 0: the context's */
    int64_t *recv_counts;    /* [world] out: each source's count (rows / global batch) */
} rocmoe_fused_common;

typedef struct rocmoe_embedding_a2a_args {
    rocmoe_fused_common common;
    int mode;                        /* ROCMOE_BAG_* */
    int num_tables;                  /* this rank's tables (0 allowed) */
    int total_tables;                /* over all ranks */
    int table_base;                  /* global index of this rank's first table */
    int64_t batch;                   /* global batch of this call, <= the layout's capacity */
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
    int64_t n, k;
    const void *w;                   /* [n, k] row-major, contiguous */
    const void *x;                   /* [k] */
    void *out;                       /* [n], identical on every rank */
    const float *partial;            /* NULL: compute W x here; else [n] fp32 = W x already */
} rocmoe_gemv_allreduce_args;

typedef struct rocmoe_gemm_a2a_args {
    rocmoe_fused_common common;
    int64_t m, k, n;
    const void *x;                   /* [m, k], dtype; NULL when y is given */
    const float *w;                  /* [k, n] fp32 (accumulation is fp32) */
    const void *y;                   /* NULL: compute x @ w here; else [m, n] rows to send */
    const int64_t *send_counts;      /* world: rows for each destination, in row order */
    void *out;                       /* [world * capacity, n]: rows from source 0 first,
                                        packed; common.recv_counts says how many from each */
    /* Grouped products (0: one W). With groups = G > 0, w is [G, k, n] fp32 and each
     * destination's rows are G consecutive segments, group_counts[d * G + g] rows for group
     * g (summing to send_counts[d]); segment (d, g) is multiplied by W[g]. */
    int64_t groups;
    const int64_t *group_counts;     /* [world * groups] */
} rocmoe_gemm_a2a_args;

int rocmoe_host_embedding_a2a(rocmoe_ctx *ctx, const rocmoe_embedding_a2a_args *args);
int rocmoe_host_gemv_allreduce(rocmoe_ctx *ctx, const rocmoe_gemv_allreduce_args *args);
int rocmoe_host_gemm_a2a(rocmoe_ctx *ctx, const rocmoe_gemm_a2a_args *args);
/* this rank rejected its input: take part in the call without data (see "abort" above) */
int rocmoe_host_fused_abort(rocmoe_ctx *ctx, const rocmoe_fused_common *common);
/* worker threads a fused op uses when common.workers <= 0 */
int rocmoe_host_default_workers(void);

/* ---- fused ops (GPU): persistent kernels, hip/src/gpu/fused_*.hip ----
 * Called by rocmoe/ops/gpu.py. Each call enqueues on `fused.stream` (hipStream_t /
 * cudaStream_t; NULL = the default stream) and returns at once: no host synchronisation, so
 * a call can be captured in a CUDA/HIP graph. The kernels read and advance the epoch in the
 * workspace's local area, run the schedule (remote-first slices, atomic task counter,
 * per-slice done counters; the completer of a slice writes the count and signals), wait
 * (bounded) for every source, copy the result out and acknowledge. Problems become status
 * words in `status` (host-mapped memory: the host reads them without a copy). Peers are
 * reached through team.peer_bases and the shmem facade (rocmoe/shmem.h). */
typedef struct rocmoe_gpu_team {
    const void *peer_bases;  /* device array [world] of heap bases as seen by this process */
    int rank;
    int world;
    int ranks_per_node;      /* remote-first order; <= 0: one node */
} rocmoe_gpu_team;

typedef struct rocmoe_gpu_fused {
    rocmoe_workspace_layout layout;
    void *workspace;         /* this rank's address of the handle's workspace (heap) */
    void *stage;             /* device scratch for scale-out puts (rows this rank sends, by
                                destination); NULL when every peer is load/store reachable */
    int *status;             /* device address of the handle's host-mapped status words */
    int workgroups;          /* <= 0: per compute unit count */
    double timeout_s;        /* bound of every wait */
    void *stream;
} rocmoe_gpu_fused;

typedef struct rocmoe_gpu_table {
    const void *weights;     /* [rows, dim] */
    const int64_t *indices;  /* [num_indices] */
    const int64_t *offsets;  /* [batch] bag starts */
    const float *per_sample_weights;  /* [num_indices] or NULL */
    int64_t rows;
    int64_t num_indices;
} rocmoe_gpu_table;

/* All of a rank's tables in one call's worth of device arrays: table t is rows
 * [row_base[t], row_base[t + 1]) of `weights`, its indices are table-local row numbers, and
 * bag b of table t is indices [offsets[t * batch + b], offsets[t * batch + b + 1]) */
typedef struct rocmoe_gpu_packed_tables {
    const void *weights;             /* [row_base[num_tables], dim] */
    const int64_t *row_base;         /* device [num_tables + 1], row_base[0] = 0 */
    const int64_t *indices;          /* [num_indices] */
    const int64_t *offsets;          /* [num_tables * batch + 1], offsets[0] = 0 */
    const float *per_sample_weights; /* [num_indices] or NULL */
    int64_t num_indices;
} rocmoe_gpu_packed_tables;

typedef struct rocmoe_gpu_embedding_args {
    rocmoe_gpu_team team;
    rocmoe_gpu_fused fused;
    int mode;                /* ROCMOE_BAG_* */
    int num_tables;          /* this rank's tables (0 allowed: signals only) */
    int total_tables;
    int table_base;          /* global index of this rank's first table */
    int64_t batch;           /* global batch of this call, a multiple of world */
    int64_t dim;
    /* the tables: up to rocmoe_gpu_embedding_inline_tables() travel inside the launch's
     * arguments (from this host array, nothing to copy per call); more are read from
     * `device_tables`, a device array of the same records */
    const rocmoe_gpu_table *tables;
    const rocmoe_gpu_table *device_tables;
    void *out;               /* [batch / world, total_tables, dim] of the layout's dtype */
    /* the packed layout (FBGEMM's table-batched one), used instead of the table records when
     * packed.weights is not NULL: one call's host work no longer grows with the tables */
    rocmoe_gpu_packed_tables packed;
} rocmoe_gpu_embedding_args;

typedef struct rocmoe_gpu_gemv_args {
    rocmoe_gpu_team team;
    rocmoe_gpu_fused fused;
    int64_t n, k;            /* W [n, k] row-major, x [k] */
    const void *w;
    const void *x;
    void *out;               /* y [n] of the layout's dtype */
} rocmoe_gpu_gemv_args;

/* enqueue the op (abort = 1: this rank rejected its input; only `team` and `fused` are read) */
int rocmoe_gpu_embedding_a2a(const rocmoe_gpu_embedding_args *args, int abort);
int rocmoe_gpu_gemv_allreduce(const rocmoe_gpu_gemv_args *args, int abort);
int rocmoe_gpu_embedding_inline_tables(void);

/* ---- CUDA driver entry points (hip/src/cuda_driver.cpp) ----
 * What rocmoe/native_launch.py launches compiled Triton kernels with: libcuda.so.1 is
 * opened on first use (every build has these; without an NVIDIA driver they return
 * ROCMOE_ERR_BACKEND). `function` is a CUfunction, `stream` a CUstream, `params` the
 * kernel's argument pointers, `map` 64-byte aligned room for a CUtensorMap (128 bytes). */
int rocmoe_cu_available(void);
int rocmoe_cu_launch(uint64_t function, uint32_t grid_x, uint32_t grid_y, uint32_t grid_z,
                     uint32_t block_x, uint32_t shared_bytes, uint64_t stream, void **params);
/* the same launch with programmatic dependent launch (Hopper's PDL: the kernel may start
 * before the one ahead of it on the stream ends, and waits for it at griddepcontrol.wait);
 * rocmoe_cu_pdl_available says whether the driver has cuLaunchKernelEx */
int rocmoe_cu_pdl_available(void);
int rocmoe_cu_launch_pdl(uint64_t function, uint32_t grid_x, uint32_t grid_y, uint32_t grid_z,
                         uint32_t block_x, uint32_t shared_bytes, uint64_t stream,
                         void **params);
int rocmoe_cu_param_info(uint64_t function, uint64_t index, uint64_t *offset, uint64_t *size);
int rocmoe_cu_encode_tiled(void *map, int data_type, uint32_t rank, uint64_t address,
                           const uint64_t *dims, const uint64_t *byte_strides,
                           const uint32_t *box, const uint32_t *element_strides,
                           int interleave, int swizzle, int l2_promotion, int oob_fill);

/* ROCMOE_CDEF_END */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROCMOE_ROCMOE_H */
