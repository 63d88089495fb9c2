// ipc backend: the symmetric heap is one device allocation per rank (fine-grained on AMD,
// so system-scope atomics and peer stores are coherent; plain cudaMalloc on NVIDIA). Its IPC
// handle is the bootstrap blob; connect opens every peer's handle, so every heap of the
// node is addressable from every rank's kernels through a device-side table of bases.
//
// Several ranks may share one GPU (each its own process): opening an IPC handle exported by
// another process on the same device is allowed. A handle of this very process can't be
// opened (the driver refuses); the owner's address is used directly instead.
//
// Host-initiated operations run on two streams of their own:
//   stream_       blocking (it waits for the legacy default stream, where torch puts its
//                 work by default), so a put sees the data that torch just produced; puts,
//                 gets and host signal stores are ordered on it.
//   poll_stream_  non-blocking, used only to read signal slots: a host wait must see the
//                 slot change while a kernel of this process still runs on another stream.
#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

// This backend's kernels store through IPC mappings whatever facade the build selected.
#define ROCMOE_SHMEM_IPC 1

#include "gpu/gpu_kernels.hpp"
#include "internal.hpp"
#include "rocmoe/platform.h"
#include "rocmoe/shmem.h"

namespace rocmoe {
namespace {

constexpr char kMagic[8] = {'R', 'O', 'C', 'M', 'O', 'E', 'I', 'P'};
constexpr uint32_t kBlobVersion = 1;
struct IpcBlob {
    char magic[8];
    uint32_t version;
    int32_t rank;
    int32_t pid;
    int32_t device;
    uint64_t heap_size;
    uint64_t base;        // the heap's address in its owner's process
    char host[64];        // IPC handles only open on the node that made them
    hipIpcMemHandle_t handle;
};
static_assert(sizeof(IpcBlob) <= kBlobSize, "the ipc bootstrap blob must fit kBlobSize");

bool pid_alive(int pid) {
    if (pid <= 0) return false;
    return kill(pid, 0) == 0 || errno == EPERM;
}

std::string host_name() {
    char name[64] = {};
    if (gethostname(name, sizeof name - 1) != 0) return "?";
    return name;
}

// ---------------------------------------------------------------------------------------
// backend
// ---------------------------------------------------------------------------------------

class IpcBackend final : public Backend {
public:
    ~IpcBackend() override { finalize(); }

    int init(const rocmoe_init_args &args) override {
        args_ = args;
        if (args.local_size != args.world_size)
            return fail(ROCMOE_ERR_BACKEND,
                        "the ipc backend needs every rank on one node (world size %d, %d ranks on "
                        "this node); use rocshmem (AMD) or nvshmem (NVIDIA) across nodes",
                        args.world_size, args.local_size);
        int count = 0;
        if (hipGetDeviceCount(&count) != hipSuccess) count = 0;
        if (args.device < 0 || args.device >= count)
            return fail(ROCMOE_ERR_INVALID,
                        "GPU %d does not exist: this process sees %d GPU(s) (check "
                        "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES)",
                        args.device, count);
        ROCMOE_GPU_TRY(hipSetDevice(args.device));
        int rc = launcher_.init(args.device);
        if (rc != ROCMOE_OK) return rc;

        unsigned flags = hipDeviceMallocFinegrained;
        if (const char *env = std::getenv("ROCMOE_HIP_FINEGRAINED"); env && env[0] == '0')
            flags = hipDeviceMallocDefault;  // coarse-grained: faster, but not coherent
        void *heap = nullptr;
        hipError_t err = hipExtMallocWithFlags(&heap, args.heap_size, flags);
        if (err != hipSuccess)
            return fail(err == hipErrorOutOfMemory ? ROCMOE_ERR_NOMEM : ROCMOE_ERR_SYSTEM,
                        "allocating the %" PRIu64 "-byte symmetric heap on GPU %d failed: %s; "
                        "lower ROCMOE_HEAP_SIZE (ranks sharing a GPU each need their own heap)",
                        args.heap_size, args.device, hipGetErrorString(err));
        heap_ = static_cast<char *>(heap);
        // Signal slots must start at 0 on every rank (epochs count up from 1).
        ROCMOE_GPU_TRY(hipMemset(heap_, 0, args.heap_size));
        ROCMOE_GPU_TRY(hipStreamCreateWithFlags(&stream_, hipStreamDefault));
        ROCMOE_GPU_TRY(hipStreamCreateWithFlags(&poll_stream_, hipStreamNonBlocking));
        void *table = nullptr;
        ROCMOE_GPU_TRY(hipMalloc(&table, sizeof(void *) * args.world_size));
        table_ = static_cast<void **>(table);
        bases_.assign(args.world_size, nullptr);
        pids_.assign(args.world_size, 0);
        opened_.assign(args.world_size, false);
        bases_[args.rank] = heap_;
        pids_[args.rank] = getpid();
        ROCMOE_GPU_TRY(hipMemcpy(table_, bases_.data(), sizeof(void *) * args.world_size,
                                 hipMemcpyHostToDevice));
        return ROCMOE_OK;
    }

    int bootstrap_blob(void *out) override {
        IpcBlob blob{};
        std::memcpy(blob.magic, kMagic, sizeof kMagic);
        blob.version = kBlobVersion;
        blob.rank = args_.rank;
        blob.pid = getpid();
        blob.device = args_.device;
        blob.heap_size = args_.heap_size;
        blob.base = reinterpret_cast<uint64_t>(heap_);
        std::strncpy(blob.host, host_name().c_str(), sizeof blob.host - 1);
        // A world of one never exports: nothing would open the handle.
        if (args_.world_size > 1)
            ROCMOE_GPU_TRY(hipIpcGetMemHandle(&blob.handle, heap_),
                           "the GPU driver refused to export the heap for IPC");
        std::memcpy(out, &blob, sizeof blob);
        return ROCMOE_OK;
    }

    int connect(const void *all_blobs) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        const char *raw = static_cast<const char *>(all_blobs);
        const std::string me = host_name();
        for (int peer = 0; peer < args_.world_size; ++peer) {
            if (peer == args_.rank) continue;
            IpcBlob blob;
            std::memcpy(&blob, raw + static_cast<size_t>(peer) * kBlobSize, sizeof blob);
            if (std::memcmp(blob.magic, kMagic, sizeof kMagic) != 0 || blob.version != kBlobVersion ||
                blob.rank != peer)
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d's bootstrap blob is not an ipc handle of this librocmoe "
                            "version: every rank must run the same build and backend",
                            peer);
            if (blob.heap_size != args_.heap_size)
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d's heap is %" PRIu64 " bytes, this rank's is %" PRIu64
                            ": every rank must use the same ROCMOE_HEAP_SIZE",
                            peer, blob.heap_size, args_.heap_size);
            blob.host[sizeof blob.host - 1] = '\0';
            if (me != blob.host)
                return fail(ROCMOE_ERR_UNREACHABLE,
                            "rank %d runs on host '%s', this rank on '%s': IPC handles only open "
                            "on one node; use rocshmem/nvshmem across nodes",
                            peer, blob.host, me.c_str());
            pids_[peer] = blob.pid;
            if (blob.pid == getpid()) {
                // Same process (e.g. two contexts of one program): same address space.
                bases_[peer] = reinterpret_cast<void *>(blob.base);
                continue;
            }
            void *mapped = nullptr;
            hipError_t err = hipIpcOpenMemHandle(&mapped, blob.handle, hipIpcMemLazyEnablePeerAccess);
            if (err != hipSuccess)
                return fail(ROCMOE_ERR_UNREACHABLE,
                            "opening rank %d's heap (GPU %d, pid %d) from GPU %d failed: %s; "
                            "are both GPUs peers of each other (hipDeviceCanAccessPeer)?",
                            peer, blob.device, blob.pid, args_.device, hipGetErrorString(err));
            bases_[peer] = mapped;
            opened_[peer] = true;
        }
        ROCMOE_GPU_TRY(hipMemcpy(table_, bases_.data(), sizeof(void *) * args_.world_size,
                                 hipMemcpyHostToDevice));
        return ROCMOE_OK;
    }

    int finalize() override {
        if (heap_ == nullptr && table_ == nullptr) return ROCMOE_OK;
        int rc = ROCMOE_OK;
        auto keep_first = [&rc](hipError_t err, const char *what) {
            if (err != hipSuccess && rc == ROCMOE_OK) rc = gpu_fail(err, what);
        };
        keep_first(hipSetDevice(args_.device), "hipSetDevice");
        // Nothing of ours may still be writing into a heap that is about to go away.
        if (stream_) keep_first(hipStreamSynchronize(stream_), "hipStreamSynchronize");
        for (int peer = 0; peer < static_cast<int>(bases_.size()); ++peer)
            if (opened_[peer]) keep_first(hipIpcCloseMemHandle(bases_[peer]), "hipIpcCloseMemHandle");
        if (int released = launcher_.release(); released != ROCMOE_OK && rc == ROCMOE_OK)
            rc = released;
        if (table_) keep_first(hipFree(table_), "hipFree(peer table)");
        if (heap_) keep_first(hipFree(heap_), "hipFree(heap)");
        if (stream_) keep_first(hipStreamDestroy(stream_), "hipStreamDestroy");
        if (poll_stream_) keep_first(hipStreamDestroy(poll_stream_), "hipStreamDestroy");
        heap_ = nullptr;
        table_ = nullptr;
        stream_ = poll_stream_ = nullptr;
        bases_.clear();
        opened_.clear();
        return rc;
    }

    void *base() const override { return heap_; }

    int peer_ptr(int peer, uint64_t offset, void **out) const override {
        *out = static_cast<char *>(bases_[peer]) + offset;
        return ROCMOE_OK;
    }

    int put(int peer, uint64_t dst, const void *src, uint64_t n) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        ROCMOE_GPU_TRY(hipMemcpyAsync(static_cast<char *>(bases_[peer]) + dst, src, n,
                                      hipMemcpyDefault, stream_));
        // The host API promises that src may be reused on return.
        ROCMOE_GPU_TRY(hipStreamSynchronize(stream_));
        return ROCMOE_OK;
    }

    int get(int peer, uint64_t src, void *dst, uint64_t n) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        ROCMOE_GPU_TRY(hipMemcpyAsync(dst, static_cast<char *>(bases_[peer]) + src, n,
                                      hipMemcpyDefault, stream_));
        ROCMOE_GPU_TRY(hipStreamSynchronize(stream_));
        return ROCMOE_OK;
    }

    // Everything this rank issued on the device (its kernels' stores included) is complete.
    int quiet() override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        ROCMOE_GPU_TRY(hipDeviceSynchronize());
        return ROCMOE_OK;
    }

    int signal_store(int peer, uint64_t offset, uint64_t value, bool add) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        return launcher_.signal(team(), reinterpret_cast<uint64_t *>(heap_ + offset), value, peer,
                                add, stream_);
    }

    int signal_load(uint64_t offset, uint64_t *value) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        ROCMOE_GPU_TRY(hipMemcpyAsync(value, heap_ + offset, sizeof(uint64_t), hipMemcpyDeviceToHost,
                                      poll_stream_));
        ROCMOE_GPU_TRY(hipStreamSynchronize(poll_stream_));
        return ROCMOE_OK;
    }

    bool peer_alive(int peer) const override {
        return peer == args_.rank || pids_[peer] == 0 || pid_alive(pids_[peer]);
    }

    // -- device-side access ---------------------------------------------------------------
    int device_peer_table(void **out) override {
        *out = table_;
        return ROCMOE_OK;
    }

    int device_store_signal(int peer, uint64_t dst, const void *src, uint64_t n, uint64_t sig,
                            uint64_t value, void *stream) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        return launcher_.store_signal(team(), heap_ + dst, src, n,
                                      reinterpret_cast<uint64_t *>(heap_ + sig), value, peer,
                                      static_cast<hipStream_t>(stream));
    }

    int device_wait_verify(uint64_t sig, uint64_t value, double timeout_s, uint64_t offset,
                           const void *expected, uint64_t n, void *stream,
                           uint64_t *mismatches) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        return launcher_.wait_verify(team(), reinterpret_cast<uint64_t *>(heap_ + sig), value,
                                     timeout_s, heap_ + offset, expected, n,
                                     static_cast<hipStream_t>(stream), mismatches);
    }

private:
    sh::Team team() const { return sh::Team{table_, args_.rank, args_.world_size}; }

    rocmoe_init_args args_{};
    KernelLauncher launcher_;
    char *heap_ = nullptr;
    void **table_ = nullptr;
    hipStream_t stream_ = nullptr;
    hipStream_t poll_stream_ = nullptr;
    std::vector<void *> bases_;
    std::vector<int> pids_;
    std::vector<bool> opened_;
};

}  // namespace

std::unique_ptr<Backend> make_ipc_backend() { return std::make_unique<IpcBackend>(); }

int gpu_device_count(int *count) {
    int n = 0;
    // No driver or no device is not an error here: the answer is "0 GPUs".
    if (hipGetDeviceCount(&n) != hipSuccess) {
        (void)hipGetLastError();
        n = 0;
    }
    *count = n;
    return ROCMOE_OK;
}

}  // namespace rocmoe
