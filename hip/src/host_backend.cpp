// host backend: the symmetric heap is one POSIX shared-memory segment per rank, mapped
// by every rank of the node. A put is a memcpy into the peer's mapping; signals are
// 64-bit atomics in the heap with release/acquire order.
//
// Segment lifetime: created O_EXCL (a stale segment with the same name is never reused),
// mode 0600, named "/rocmoe.<job_tag>.<rank>", and unlinked by its owner as soon as every
// rank has mapped it (rocmoe_seal), so a job that dies later leaves nothing in /dev/shm.
// A job that dies during bootstrap leaves segments whose header names a dead pid:
// `rocmoe doctor --clean` removes those.
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "internal.hpp"

namespace rocmoe {
namespace {

constexpr uint64_t kHeaderBytes = 4096;  // keeps the heap page-aligned
constexpr char kMagic[8] = {'R', 'O', 'C', 'M', 'O', 'E', 'S', 'G'};

struct SegmentHeader {
    char magic[8];
    uint32_t version;
    int32_t pid;
    int32_t rank;
    int32_t world_size;
    uint64_t heap_size;
    char job_tag[128];
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "header must fit its page");

bool pid_alive(int pid) {
    if (pid <= 0) return false;
    return kill(pid, 0) == 0 || errno == EPERM;
}

struct Mapping {
    void *addr = nullptr;
    uint64_t length = 0;
    int pid = 0;
};

class HostBackend final : public Backend {
public:
    ~HostBackend() override { finalize(); }

    int init(const rocmoe_init_args &args) override {
        args_ = args;
        if (args.local_size != args.world_size)
            return fail(ROCMOE_ERR_BACKEND,
                        "the host backend needs every rank on one node (world size %d, %d ranks on "
                        "this node); use a GPU backend (ipc/rocshmem/nvshmem) across nodes",
                        args.world_size, args.local_size);
        if (args.job_tag == nullptr || args.job_tag[0] == '\0' ||
            std::strlen(args.job_tag) >= sizeof(SegmentHeader::job_tag) ||
            std::strchr(args.job_tag, '/') != nullptr)
            return fail(ROCMOE_ERR_INVALID, "job tag must be 1..127 characters without '/'");
        name_ = std::string("/rocmoe.") + args.job_tag + "." + std::to_string(args.rank);
        length_ = kHeaderBytes + args.heap_size;

        struct statvfs vfs;
        if (statvfs("/dev/shm", &vfs) == 0) {
            const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
            // Each rank's segment is sparse, but touching pages past the tmpfs limit would
            // kill the process with SIGBUS: refuse up front, with numbers.
            const uint64_t need = length_ * static_cast<uint64_t>(args.local_size);
            if (avail < need)
                return fail(ROCMOE_ERR_NOMEM,
                            "/dev/shm has %" PRIu64 " bytes free but %d ranks x %" PRIu64
                            " bytes of heap need %" PRIu64
                            "; lower ROCMOE_HEAP_SIZE or run `rocmoe doctor --clean`",
                            avail, args.local_size, length_, need);
        }

        int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return fail(errno == EEXIST ? ROCMOE_ERR_STATE : ROCMOE_ERR_SYSTEM,
                        "shm_open(%s) failed: %s%s", name_.c_str(), std::strerror(errno),
                        errno == EEXIST ? " (a segment of that name exists: a leftover of a "
                                          "crashed job? run `rocmoe doctor --clean`)"
                                        : "");
        created_ = true;
        if (ftruncate(fd, static_cast<off_t>(length_)) != 0) {
            int e = errno;
            close(fd);
            return fail(ROCMOE_ERR_SYSTEM, "ftruncate(%s, %" PRIu64 ") failed: %s", name_.c_str(),
                        length_, std::strerror(e));
        }
        void *addr = mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (addr == MAP_FAILED)
            return fail(ROCMOE_ERR_SYSTEM, "mmap(%s) failed: %s", name_.c_str(), std::strerror(errno));
        auto *hdr = static_cast<SegmentHeader *>(addr);
        hdr->version = 1;
        hdr->pid = static_cast<int32_t>(getpid());
        hdr->rank = args.rank;
        hdr->world_size = args.world_size;
        hdr->heap_size = args.heap_size;
        std::strncpy(hdr->job_tag, args.job_tag, sizeof hdr->job_tag - 1);
        // Magic last: a reader that sees it sees a complete header.
        std::atomic_thread_fence(std::memory_order_release);
        std::memcpy(hdr->magic, kMagic, sizeof kMagic);
        maps_.assign(args.world_size, Mapping{});
        maps_[args.rank] = Mapping{addr, length_, hdr->pid};
        return ROCMOE_OK;
    }

    int bootstrap_blob(void *blob) override {
        std::strncpy(static_cast<char *>(blob), name_.c_str(), kBlobSize - 1);
        return ROCMOE_OK;
    }

    int connect(const void *all_blobs) override {
        const char *blobs = static_cast<const char *>(all_blobs);
        for (int peer = 0; peer < args_.world_size; ++peer) {
            if (peer == args_.rank) continue;
            const char *raw = blobs + static_cast<size_t>(peer) * kBlobSize;
            std::string peer_name(raw, strnlen(raw, kBlobSize));
            const std::string expect = std::string("/rocmoe.") + args_.job_tag + "." +
                                       std::to_string(peer);
            if (peer_name != expect)
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d announced segment '%s', expected '%s': ranks disagree on "
                            "the job tag",
                            peer, peer_name.c_str(), expect.c_str());
            int fd = shm_open(peer_name.c_str(), O_RDWR, 0);
            if (fd < 0)
                return fail(ROCMOE_ERR_SYSTEM,
                            "cannot open rank %d's segment %s: %s (is that rank on another node? "
                            "the host backend needs one node)",
                            peer, peer_name.c_str(), std::strerror(errno));
            struct stat st;
            if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != length_) {
                close(fd);
                return fail(ROCMOE_ERR_INVALID,
                            "rank %d's segment is %lld bytes, this rank's is %" PRIu64
                            ": every rank must use the same ROCMOE_HEAP_SIZE",
                            peer, static_cast<long long>(st.st_size), length_);
            }
            void *addr = mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (addr == MAP_FAILED)
                return fail(ROCMOE_ERR_SYSTEM, "mmap of rank %d's segment failed: %s", peer,
                            std::strerror(errno));
            auto *hdr = static_cast<SegmentHeader *>(addr);
            if (std::memcmp(hdr->magic, kMagic, sizeof kMagic) != 0 || hdr->rank != peer ||
                hdr->heap_size != args_.heap_size) {
                munmap(addr, length_);
                return fail(ROCMOE_ERR_INVALID, "rank %d's segment header is not a rocmoe heap of "
                                                "this job", peer);
            }
            maps_[peer] = Mapping{addr, length_, hdr->pid};
        }
        return ROCMOE_OK;
    }

    int seal() override {
        if (created_ && !unlinked_) {
            shm_unlink(name_.c_str());
            unlinked_ = true;
        }
        return ROCMOE_OK;
    }

    int finalize() override {
        seal();
        for (auto &m : maps_) {
            if (m.addr) munmap(m.addr, m.length);
            m = Mapping{};
        }
        return ROCMOE_OK;
    }

    void *base() const override {
        auto *addr = static_cast<char *>(maps_[args_.rank].addr);
        return addr ? addr + kHeaderBytes : nullptr;
    }

    int peer_ptr(int peer, uint64_t offset, void **out) const override {
        *out = heap_of(peer) + offset;
        return ROCMOE_OK;
    }

    int put(int peer, uint64_t dst, const void *src, uint64_t n) override {
        std::memcpy(heap_of(peer) + dst, src, n);
        return ROCMOE_OK;
    }

    int get(int peer, uint64_t src, void *dst, uint64_t n) override {
        std::memcpy(dst, heap_of(peer) + src, n);
        return ROCMOE_OK;
    }

    // memcpy completes before it returns; the release store of the next signal orders it.
    int quiet() override {
        std::atomic_thread_fence(std::memory_order_seq_cst);
        return ROCMOE_OK;
    }

    int signal_store(int peer, uint64_t offset, uint64_t value, bool add) override {
        auto *slot = reinterpret_cast<std::atomic<uint64_t> *>(heap_of(peer) + offset);
        if (add) slot->fetch_add(value, std::memory_order_acq_rel);
        else slot->store(value, std::memory_order_release);
        return ROCMOE_OK;
    }

    int signal_load(uint64_t offset, uint64_t *value) override {
        auto *slot = reinterpret_cast<std::atomic<uint64_t> *>(heap_of(args_.rank) + offset);
        *value = slot->load(std::memory_order_acquire);
        return ROCMOE_OK;
    }

    bool peer_alive(int peer) const override { return pid_alive(maps_[peer].pid); }

private:
    char *heap_of(int peer) const { return static_cast<char *>(maps_[peer].addr) + kHeaderBytes; }

    rocmoe_init_args args_{};
    std::string name_;
    uint64_t length_ = 0;
    bool created_ = false, unlinked_ = false;
    std::vector<Mapping> maps_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace rocmoe

extern "C" int rocmoe_host_segment_owner(const char *name, int *pid, int *alive) {
    using rocmoe::fail;
    if (name == nullptr || pid == nullptr || alive == nullptr)
        return fail(ROCMOE_ERR_INVALID, "NULL argument");
    std::string path = name[0] == '/' ? name : std::string("/") + name;
    int fd = shm_open(path.c_str(), O_RDONLY, 0);
    if (fd < 0) return fail(ROCMOE_ERR_SYSTEM, "shm_open(%s): %s", path.c_str(), std::strerror(errno));
    rocmoe::SegmentHeader hdr{};
    ssize_t got = pread(fd, &hdr, sizeof hdr, 0);
    close(fd);
    if (got != static_cast<ssize_t>(sizeof hdr) ||
        std::memcmp(hdr.magic, rocmoe::kMagic, sizeof rocmoe::kMagic) != 0) {
        // A segment still being created (or not ours): report no owner, treat as not alive
        // only if the caller also finds it old.
        *pid = 0;
        *alive = 0;
        return ROCMOE_OK;
    }
    *pid = hdr.pid;
    *alive = rocmoe::pid_alive(hdr.pid) ? 1 : 0;
    return ROCMOE_OK;
}
