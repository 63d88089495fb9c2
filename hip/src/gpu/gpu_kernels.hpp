// Kernels shared by the GPU backends (ipc, nvshmem), and their launcher: host-initiated
// signals, the store+signal slice kernel and the wait+verify kernel. They are written against
// the device facade (rocmoe/shmem.h); the including backend picks the facade variant before
// including this file, and the anonymous namespace keeps each backend's copy its own.
#pragma once

#include <cinttypes>
#include <map>
#include <mutex>

#include "internal.hpp"
#include "rocmoe/platform.h"
#include "rocmoe/shmem.h"

namespace rocmoe {
namespace {

namespace sh = rocmoe::shmem;

#define ROCMOE_GPU_TRY(call, ...)                                                          \
    do {                                                                                   \
        hipError_t rocmoe_err_ = (call);                                                   \
        if (rocmoe_err_ != hipSuccess) return gpu_fail(rocmoe_err_, #call, ##__VA_ARGS__); \
    } while (0)

inline int gpu_fail(hipError_t err, const char *call, const char *context = nullptr) {
    return fail(err == hipErrorOutOfMemory ? ROCMOE_ERR_NOMEM : ROCMOE_ERR_SYSTEM,
                "%s failed: %s (%s)%s%s", call, hipGetErrorName(err), hipGetErrorString(err),
                context ? "; " : "", context ? context : "");
}

// Kernels read `src` / `expected` directly: a host pointer there would fault the GPU and
// poison the whole context, so it is refused up front. HIP and CUDA both report a
// device-accessible address in devicePointer (HIP fails the query for plain host memory,
// CUDA returns a null devicePointer).
inline int check_device_accessible(const void *p, const char *what) {
    hipPointerAttribute_t attr{};
    hipError_t err = hipPointerGetAttributes(&attr, p);
    if (err != hipSuccess || attr.devicePointer == nullptr) {
        (void)hipGetLastError();  // the failed query must not stick to later calls
        return fail(ROCMOE_ERR_INVALID,
                    "%s (%p) is not memory the GPU can read: pass a device tensor's data_ptr()",
                    what, p);
    }
    return ROCMOE_OK;
}

constexpr int kStoreThreads = 512;
constexpr int kVerifyThreads = 256;

// Host-initiated signal: one thread; signal_set fences first, so the puts that this stream
// already completed are visible before the flag.
__global__ void signal_kernel(sh::Team team, uint64_t *sig, uint64_t value, int pe, int add) {
    if (add) sh::signal_add(team, sig, value, pe);
    else sh::signal_set(team, sig, value, pe);
}

// A slice of `n` bytes into rank `pe`'s heap, then one signal for the whole slice.
// Each workgroup copies its chunk; the last workgroup to finish (counted in `arrivals`,
// which it resets for the next launch on the same stream) raises the signal. Every thread
// orders its own stores (fence) before its workgroup is counted, so the signal publishes
// them all.
__global__ void store_signal_kernel(sh::Team team, char *dst, const char *src, uint64_t n,
                                    uint64_t chunk, uint64_t *sig, uint64_t value, int pe,
                                    unsigned int *arrivals) {
    const uint64_t begin = static_cast<uint64_t>(blockIdx.x) * chunk;
    if (begin < n) {
        const uint64_t len = (n - begin < chunk) ? n - begin : chunk;
        sh::put_nbi_wg(team, dst + begin, src + begin, len, pe);
    }
    sh::quiet(team);
    __syncthreads();
    if (sh::wg_thread_id() == 0) {
        const unsigned int done = atomicAdd(arrivals, 1u);
        if (done == gridDim.x - 1) {
            atomicExch(arrivals, 0u);
            sh::signal_set(team, sig, value, pe);
        }
    }
}

struct VerifyResult {
    unsigned long long status;      // sh::WaitStatus, max over workgroups
    unsigned long long observed;    // the slot's value when the wait ended
    unsigned long long mismatches;  // bytes that differ from `expected`
};

// Wait (bounded, on the device) until this rank's slot reaches `value`, then compare
// `nbytes` of the local heap at `got` with `expected`. Every workgroup waits for itself,
// so no workgroup reads its chunk before the signal was seen.
__global__ void wait_verify_kernel(sh::Team team, uint64_t *sig, uint64_t value,
                                   uint64_t timeout_ns, const unsigned char *got,
                                   const unsigned char *expected, uint64_t n, uint64_t chunk,
                                   VerifyResult *result) {
    __shared__ int status;
    if (sh::wg_thread_id() == 0) {
        uint64_t observed = 0;
        status = sh::wait_until(team, sig, sh::kCmpGe, value, timeout_ns, &observed);
        if (blockIdx.x == 0) result->observed = observed;
        if (status != sh::kWaitOk) atomicMax(&result->status, static_cast<unsigned long long>(status));
    }
    __syncthreads();
    if (status != sh::kWaitOk) return;
    const uint64_t begin = static_cast<uint64_t>(blockIdx.x) * chunk;
    if (begin >= n) return;
    const uint64_t len = (n - begin < chunk) ? n - begin : chunk;
    unsigned long long bad = 0;
    for (uint64_t i = sh::wg_thread_id(); i < len; i += blockDim.x * blockDim.y * blockDim.z)
        bad += got[begin + i] != expected[begin + i];
    if (bad) atomicAdd(&result->mismatches, bad);
}

// Launches the kernels above for one rank. Addresses are this rank's symmetric addresses
// (the facade finds the peer's copy); `team` comes from the backend.
class KernelLauncher {
public:
    int init(int device) {
        device_ = device;
        ROCMOE_GPU_TRY(hipDeviceGetAttribute(&sm_count_, hipDeviceAttributeMultiprocessorCount,
                                             device));
        // Grids of exactly one resident wave: a second, partial wave of copy workgroups
        // would leave most multiprocessors idle while it runs.
        ROCMOE_GPU_TRY(hipOccupancyMaxActiveBlocksPerMultiprocessor(&store_per_sm_, store_signal_kernel,
                                                                    kStoreThreads, 0));
        ROCMOE_GPU_TRY(hipOccupancyMaxActiveBlocksPerMultiprocessor(&verify_per_sm_, wait_verify_kernel,
                                                                    kVerifyThreads, 0));
        return ROCMOE_OK;
    }

    int release() {
        int rc = ROCMOE_OK;
        for (auto &entry : scratch_) {
            hipError_t err = hipFree(entry.second);
            if (err != hipSuccess && rc == ROCMOE_OK) rc = gpu_fail(err, "hipFree(scratch)");
        }
        scratch_.clear();
        return rc;
    }

    // Host-initiated signal; returns once it is visible.
    int signal(const sh::Team &team, uint64_t *sig, uint64_t value, int pe, bool add,
               hipStream_t s) {
        hipLaunchKernelGGL(signal_kernel, dim3(1), dim3(1), 0, s, team, sig, value, pe, add ? 1 : 0);
        ROCMOE_GPU_TRY(hipGetLastError(), "launching the signal kernel");
        ROCMOE_GPU_TRY(hipStreamSynchronize(s));
        return ROCMOE_OK;
    }

    int store_signal(const sh::Team &team, char *dst, const void *src, uint64_t n, uint64_t *sig,
                     uint64_t value, int pe, hipStream_t s) {
        if (n > 0) {
            int bad = check_device_accessible(src, "the source");
            if (bad != ROCMOE_OK) return bad;
        }
        void *arrivals = nullptr;
        int rc = scratch_for(s, &arrivals);
        if (rc != ROCMOE_OK) return rc;
        uint64_t chunk = 0;
        const unsigned blocks = grid_for(n, kStoreThreads * 16ull * 4, store_per_sm_, &chunk);
        hipLaunchKernelGGL(store_signal_kernel, dim3(blocks), dim3(kStoreThreads), 0, s, team, dst,
                           static_cast<const char *>(src), n, chunk, sig, value, pe,
                           static_cast<unsigned int *>(arrivals));
        ROCMOE_GPU_TRY(hipGetLastError(), "launching the store+signal kernel");
        return ROCMOE_OK;
    }

    int wait_verify(const sh::Team &team, uint64_t *sig, uint64_t value, double timeout_s,
                    const char *got, const void *expected, uint64_t n, hipStream_t s,
                    uint64_t *mismatches) {
        if (n > 0) {
            int bad = check_device_accessible(expected, "the expected data");
            if (bad != ROCMOE_OK) return bad;
        }
        void *scratch = nullptr;
        int rc = scratch_for(s, &scratch);
        if (rc != ROCMOE_OK) return rc;
        // The result lives after the arrivals counter in the same per-stream scratch block.
        auto *result = reinterpret_cast<VerifyResult *>(static_cast<char *>(scratch) + 64);
        ROCMOE_GPU_TRY(hipMemsetAsync(result, 0, sizeof(VerifyResult), s));
        uint64_t chunk = 0;
        const unsigned blocks = grid_for(n, kVerifyThreads * 64ull, verify_per_sm_, &chunk);
        const uint64_t timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
        hipLaunchKernelGGL(wait_verify_kernel, dim3(blocks), dim3(kVerifyThreads), 0, s, team, sig,
                           value, timeout_ns, reinterpret_cast<const unsigned char *>(got),
                           static_cast<const unsigned char *>(expected), n, chunk, result);
        ROCMOE_GPU_TRY(hipGetLastError(), "launching the wait+verify kernel");
        VerifyResult host{};
        ROCMOE_GPU_TRY(hipMemcpyAsync(&host, result, sizeof host, hipMemcpyDeviceToHost, s));
        ROCMOE_GPU_TRY(hipStreamSynchronize(s));
        if (host.status != sh::kWaitOk)
            return fail(ROCMOE_ERR_TIMEOUT,
                        "rank %d timed out after %.3g s waiting on the GPU for its signal slot at "
                        "%p to reach >= %" PRIu64 " (it holds %llu); is the peer alive and making "
                        "the same calls?",
                        team.rank, timeout_s, static_cast<void *>(sig), value, host.observed);
        *mismatches = host.mismatches;
        return ROCMOE_OK;
    }

private:
    // One chunk per workgroup, a multiple of 16 bytes (vector copies), at least `min_chunk`
    // bytes, and no more workgroups than fit on the GPU at once. An empty slice still
    // launches one workgroup: its signal must be raised (DESIGN.md, signal protocol).
    unsigned grid_for(uint64_t n, uint64_t min_chunk, int per_sm, uint64_t *chunk) const {
        const uint64_t max_blocks = static_cast<uint64_t>(sm_count_ > 0 ? sm_count_ : 1) *
                                    static_cast<uint64_t>(per_sm > 0 ? per_sm : 1);
        uint64_t blocks = (n + min_chunk - 1) / min_chunk;
        if (blocks < 1) blocks = 1;
        if (blocks > max_blocks) blocks = max_blocks;
        uint64_t c = (n + blocks - 1) / blocks;
        c = (c + 15) & ~uint64_t(15);
        if (c == 0) c = 16;
        *chunk = c;
        const uint64_t used = (n + c - 1) / c;
        return static_cast<unsigned>(used > 0 ? used : 1);
    }

    // Per-stream device scratch (the arrivals counter, then a VerifyResult): launches on
    // one stream are ordered, so they can share it; launches on two streams cannot.
    int scratch_for(hipStream_t s, void **out) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = scratch_.find(s);
        if (it != scratch_.end()) {
            *out = it->second;
            return ROCMOE_OK;
        }
        void *p = nullptr;
        ROCMOE_GPU_TRY(hipMalloc(&p, 256));
        ROCMOE_GPU_TRY(hipMemset(p, 0, 256));
        scratch_[s] = p;
        *out = p;
        return ROCMOE_OK;
    }

    int device_ = -1;
    int sm_count_ = 0;
    int store_per_sm_ = 1;  // resident workgroups per multiprocessor, per kernel
    int verify_per_sm_ = 1;
    std::mutex mutex_;
    std::map<hipStream_t, void *> scratch_;
};

}  // namespace
}  // namespace rocmoe
