// signal_add from several threads at once into one host-backend slot sums exactly.
//
// The Python multi-rank check (rank_checks.py, signal_add_sums) spends microseconds per add
// in the interpreter, so on a loaded machine two adds rarely meet and a non-atomic add can
// pass it. Here each thread is a tight loop of rocmoe_signal_add calls for the same time
// span, so whenever two threads run at once they hit the slot together; then the waiting
// side (rocmoe_signal_wait_until) must see exactly the sum of every thread's adds.
//
//   signal_add_stress THREADS SECONDS      prints "signal_add_stress: OK ..." or exits 1
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include <unistd.h>

#include "rocmoe/rocmoe.h"

namespace {

int fail_with(const char *what, int rc) {
    std::printf("signal_add_stress: FAIL %s (rc %d): %s\n", what, rc, rocmoe_last_error());
    return 1;
}

}  // namespace

int main(int argc, char **argv) {
    const int threads = argc > 1 ? std::atoi(argv[1]) : 4;
    const double seconds = argc > 2 ? std::atof(argv[2]) : 0.2;
    char tag[64];
    std::snprintf(tag, sizeof tag, "signal-add-stress-%d", static_cast<int>(getpid()));

    rocmoe_init_args args{};
    args.backend = ROCMOE_BACKEND_HOST;
    args.rank = 0;
    args.world_size = 1;
    args.local_rank = 0;
    args.local_size = 1;
    args.device = -1;
    args.heap_size = 1 << 16;
    args.timeout_s = 10.0;
    args.job_tag = tag;
    rocmoe_ctx *ctx = nullptr;
    int rc = rocmoe_init(&args, &ctx);
    if (rc != ROCMOE_OK) return fail_with("rocmoe_init", rc);
    std::vector<char> blob(rocmoe_bootstrap_blob_size());
    if ((rc = rocmoe_bootstrap_blob(ctx, blob.data())) != ROCMOE_OK ||
        (rc = rocmoe_connect(ctx, blob.data())) != ROCMOE_OK || (rc = rocmoe_seal(ctx)) != ROCMOE_OK)
        return fail_with("bootstrap", rc);
    uint64_t slot = 0;
    if ((rc = rocmoe_heap_alloc(ctx, 8, 8, &slot)) != ROCMOE_OK) return fail_with("alloc", rc);
    if ((rc = rocmoe_signal_set(ctx, 0, slot, 0)) != ROCMOE_OK) return fail_with("set", rc);

    std::atomic<int> ready{0};
    std::vector<uint64_t> added(threads, 0);
    std::vector<int> errors(threads, ROCMOE_OK);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            // start together, stop together: the threads' adds overlap in time
            ready.fetch_add(1);
            while (ready.load() < threads) std::this_thread::yield();
            const auto stop = std::chrono::steady_clock::now() +
                              std::chrono::duration<double>(seconds);
            const uint64_t value = static_cast<uint64_t>(t) + 1;
            uint64_t n = 0;
            do {
                for (int i = 0; i < 256; ++i) {
                    int r = rocmoe_signal_add(ctx, 0, slot, value);
                    if (r != ROCMOE_OK) {
                        errors[t] = r;
                        return;
                    }
                }
                n += 256;
            } while (std::chrono::steady_clock::now() < stop);
            added[t] = n * value;
        });
    }
    for (auto &th : pool) th.join();
    uint64_t want = 0, calls = 0;
    for (int t = 0; t < threads; ++t) {
        if (errors[t] != ROCMOE_OK) return fail_with("signal_add", errors[t]);
        want += added[t];
        calls += added[t] / (static_cast<uint64_t>(t) + 1);
    }
    uint64_t seen = 0;
    rc = rocmoe_signal_wait_until(ctx, slot, ROCMOE_CMP_GE, want, 2.0, -1, &seen);
    uint64_t final_value = 0;
    rocmoe_signal_read(ctx, slot, &final_value);
    rocmoe_finalize(ctx);
    if (rc != ROCMOE_OK || final_value != want) {
        std::printf("signal_add_stress: FAIL %" PRIu64 " adds from %d threads: want %" PRIu64
                    ", slot holds %" PRIu64 " (%" PRId64 " lost)\n",
                    calls, threads, want, final_value,
                    static_cast<int64_t>(want) - static_cast<int64_t>(final_value));
        return 1;
    }
    std::printf("signal_add_stress: OK %" PRIu64 " adds from %d threads sum to %" PRIu64 "\n",
                calls, threads, want);
    return 0;
}
