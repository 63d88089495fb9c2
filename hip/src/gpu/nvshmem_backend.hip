// nvshmem backend (NVIDIA; one node or several): the symmetric heap is one nvshmem_malloc
// allocation, so the same offset names the same object on every PE and NVSHMEM moves the
// data (NVLink/P2P loads and stores inside a node, its network transports across nodes).
//
// Built only with -DROCMOE_GPU=cuda -DROCMOE_SHMEM=nvshmem (ROCMOE_HAVE_NVSHMEM). NVSHMEM's
// init is inline in its headers and its device state lives in libnvshmem_device.a, so it is
// initialised here, in code compiled by nvcc -rdc=true and device-linked with that library,
// never from Python (DESIGN.md, Backends).
//
// Bootstrap over rocmoe's three steps: rank 0 draws an NVSHMEM unique id in init and puts it
// into its blob; connect takes rank 0's id from the gathered blobs and runs the collective
// nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) and nvshmem_malloc on every rank. MPI
// stays the caller's business: librocmoe never talks to MPI itself.
//
// NVSHMEM's rules apply: nvshmem_free / nvshmem_finalize (our finalize) are collective, and
// NVSHMEM needs one GPU per PE unless its multi-PE-per-GPU support is set up.
#if defined(ROCMOE_HAVE_NVSHMEM)

#ifndef ROCMOE_SHMEM_NVSHMEM
#define ROCMOE_SHMEM_NVSHMEM 1
#endif

#include <cinttypes>
#include <cstring>
#include <vector>

#include <unistd.h>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "gpu/gpu_kernels.hpp"
#include "internal.hpp"

namespace rocmoe {
namespace {

constexpr char kMagic[8] = {'R', 'O', 'C', 'M', 'O', 'E', 'N', 'V'};
constexpr uint32_t kBlobVersion = 1;

struct NvshmemBlob {
    char magic[8];
    uint32_t version;
    int32_t rank;
    uint64_t heap_size;
    nvshmemx_uniqueid_t uid;  // meaningful in rank 0's blob only
};
static_assert(sizeof(NvshmemBlob) <= kBlobSize, "the nvshmem bootstrap blob must fit kBlobSize");

class NvshmemBackend final : public Backend {
public:
    ~NvshmemBackend() override { finalize(); }

    int init(const rocmoe_init_args &args) override {
        args_ = args;
        int count = 0;
        if (hipGetDeviceCount(&count) != hipSuccess) count = 0;
        if (args.device < 0 || args.device >= count)
            return fail(ROCMOE_ERR_INVALID,
                        "GPU %d does not exist: this process sees %d GPU(s) (check "
                        "CUDA_VISIBLE_DEVICES)",
                        args.device, count);
        ROCMOE_GPU_TRY(hipSetDevice(args.device));
        int rc = launcher_.init(args.device);
        if (rc != ROCMOE_OK) return rc;
        ROCMOE_GPU_TRY(hipStreamCreateWithFlags(&stream_, hipStreamDefault));
        ROCMOE_GPU_TRY(hipStreamCreateWithFlags(&poll_stream_, hipStreamNonBlocking));
        if (args.rank == 0) {
            uid_ = NVSHMEMX_UNIQUEID_INITIALIZER;
            if (nvshmemx_get_uniqueid(&uid_) != 0)
                return fail(ROCMOE_ERR_BACKEND,
                            "nvshmemx_get_uniqueid failed: NVSHMEM could not load its bootstrap "
                            "(nvshmem_bootstrap_uid.so.3 next to libnvshmem_host.so.3?)");
        }
        return ROCMOE_OK;
    }

    int bootstrap_blob(void *out) override {
        NvshmemBlob blob{};
        std::memcpy(blob.magic, kMagic, sizeof kMagic);
        blob.version = kBlobVersion;
        blob.rank = args_.rank;
        blob.heap_size = args_.heap_size;
        blob.uid = uid_;
        std::memcpy(out, &blob, sizeof blob);
        return ROCMOE_OK;
    }

    int connect(const void *all_blobs) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        const char *raw = static_cast<const char *>(all_blobs);
        NvshmemBlob root{};
        for (int peer = 0; peer < args_.world_size; ++peer) {
            NvshmemBlob blob;
            std::memcpy(&blob, raw + static_cast<size_t>(peer) * kBlobSize, sizeof blob);
            if (std::memcmp(blob.magic, kMagic, sizeof kMagic) != 0 || blob.version != kBlobVersion ||
                blob.rank != peer)
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d's bootstrap blob is not an nvshmem blob of this librocmoe "
                            "version: every rank must run the same build and backend",
                            peer);
            if (blob.heap_size != args_.heap_size)
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d's heap is %" PRIu64 " bytes, this rank's is %" PRIu64
                            ": every rank must use the same ROCMOE_HEAP_SIZE",
                            peer, blob.heap_size, args_.heap_size);
            if (peer == 0) root = blob;
        }
        nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
        if (nvshmemx_set_attr_uniqueid_args(args_.rank, args_.world_size, &root.uid, &attr) != 0)
            return fail(ROCMOE_ERR_BACKEND, "nvshmemx_set_attr_uniqueid_args failed");
        // Collective over all ranks; NVSHMEM aborts the process itself if this fails.
        if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
            return fail(ROCMOE_ERR_BACKEND, "nvshmemx_init_attr failed");
        initialized_ = true;
        if (nvshmem_my_pe() != args_.rank || nvshmem_n_pes() != args_.world_size)
            return fail(ROCMOE_ERR_STATE,
                        "NVSHMEM numbered this rank PE %d of %d, rocmoe has rank %d of %d",
                        nvshmem_my_pe(), nvshmem_n_pes(), args_.rank, args_.world_size);
        heap_ = static_cast<char *>(nvshmem_malloc(args_.heap_size));  // collective
        if (heap_ == nullptr)
            return fail(ROCMOE_ERR_NOMEM,
                        "nvshmem_malloc(%" PRIu64 ") failed: raise NVSHMEM_SYMMETRIC_SIZE above "
                        "ROCMOE_HEAP_SIZE or lower the heap size",
                        args_.heap_size);
        // Signal slots must start at 0 everywhere before anyone can signal.
        ROCMOE_GPU_TRY(hipMemset(heap_, 0, args_.heap_size));
        ROCMOE_GPU_TRY(hipDeviceSynchronize());
        nvshmem_barrier_all();

        std::vector<void *> bases(args_.world_size, nullptr);
        for (int pe = 0; pe < args_.world_size; ++pe) bases[pe] = nvshmem_ptr(heap_, pe);
        bases[args_.rank] = heap_;
        void *table = nullptr;
        ROCMOE_GPU_TRY(hipMalloc(&table, sizeof(void *) * args_.world_size));
        table_ = static_cast<void **>(table);
        ROCMOE_GPU_TRY(hipMemcpy(table_, bases.data(), sizeof(void *) * args_.world_size,
                                 hipMemcpyHostToDevice));
        return ROCMOE_OK;
    }

    int finalize() override {
        if (!initialized_ && stream_ == nullptr && table_ == nullptr) return ROCMOE_OK;
        int rc = ROCMOE_OK;
        auto keep_first = [&rc](hipError_t err, const char *what) {
            if (err != hipSuccess && rc == ROCMOE_OK) rc = gpu_fail(err, what);
        };
        keep_first(hipSetDevice(args_.device), "hipSetDevice");
        if (stream_) keep_first(hipStreamSynchronize(stream_), "hipStreamSynchronize");
        if (int released = launcher_.release(); released != ROCMOE_OK && rc == ROCMOE_OK)
            rc = released;
        if (table_) keep_first(hipFree(table_), "hipFree(peer table)");
        if (initialized_) {
            if (heap_) nvshmem_free(heap_);  // collective, like NVSHMEM's finalize
            nvshmem_finalize();
        }
        if (stream_) keep_first(hipStreamDestroy(stream_), "hipStreamDestroy");
        if (poll_stream_) keep_first(hipStreamDestroy(poll_stream_), "hipStreamDestroy");
        heap_ = nullptr;
        table_ = nullptr;
        stream_ = poll_stream_ = nullptr;
        initialized_ = false;
        return rc;
    }

    void *base() const override { return heap_; }

    int peer_ptr(int peer, uint64_t offset, void **out) const override {
        void *p = nvshmem_ptr(heap_ + offset, peer);
        if (p == nullptr)
            return fail(ROCMOE_ERR_UNREACHABLE,
                        "rank %d's heap is not load/store reachable from rank %d (another node?): "
                        "use put/get",
                        peer, args_.rank);
        *out = p;
        return ROCMOE_OK;
    }

    int put(int peer, uint64_t dst, const void *src, uint64_t n) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        nvshmemx_putmem_on_stream(heap_ + dst, src, n, peer, stream_);
        // The host API promises that src may be reused on return.
        ROCMOE_GPU_TRY(hipStreamSynchronize(stream_));
        return ROCMOE_OK;
    }

    int get(int peer, uint64_t src, void *dst, uint64_t n) override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        nvshmemx_getmem_on_stream(dst, heap_ + src, n, peer, stream_);
        ROCMOE_GPU_TRY(hipStreamSynchronize(stream_));
        return ROCMOE_OK;
    }

    int quiet() override {
        ROCMOE_GPU_TRY(hipSetDevice(args_.device));
        nvshmemx_quiet_on_stream(stream_);
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
    nvshmemx_uniqueid_t uid_{};
    bool initialized_ = false;
    char *heap_ = nullptr;
    void **table_ = nullptr;
    hipStream_t stream_ = nullptr;
    hipStream_t poll_stream_ = nullptr;
    KernelLauncher launcher_;
};

}  // namespace

std::unique_ptr<Backend> make_nvshmem_backend() { return std::make_unique<NvshmemBackend>(); }

}  // namespace rocmoe

#endif  // ROCMOE_HAVE_NVSHMEM
