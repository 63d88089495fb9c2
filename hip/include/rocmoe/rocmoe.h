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

/* host segments left behind by crashed jobs (name prefix "rocmoe.") */
int rocmoe_host_segment_owner(const char *name, int *pid, int *alive);

/* ROCMOE_CDEF_END */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROCMOE_ROCMOE_H */
