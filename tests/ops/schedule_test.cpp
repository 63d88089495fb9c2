// Unit test of hip/include/rocmoe/schedule.h on the host (tests/ops/test_schedule.py
// compiles and runs it). Prints one line per check group; exits non-zero on the first failure.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "rocmoe/schedule.h"

using namespace rocmoe::sched;

static int g_failures = 0;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (!(cond)) {                                                       \
            std::printf("FAIL %s:%d: ", __FILE__, __LINE__);                \
            std::printf(__VA_ARGS__);                                        \
            std::printf("\n");                                               \
            if (++g_failures > 20) std::exit(1);                             \
        }                                                                    \
    } while (0)

// slice_at is a permutation, position_of its inverse, and classes never go back from
// remote to local along the order: other nodes, then same node, then self (last).
static void check_order() {
    int cases = 0;
    for (int world = 1; world <= 12; ++world)
        for (int per = 1; per <= world + 1; ++per)
            for (int rank = 0; rank < world; ++rank) {
                Topology t{rank, world, per};
                std::vector<int> seen(world, 0);
                int last_class = -1;
                for (int p = 0; p < world; ++p) {
                    const int d = slice_at(t, p);
                    CHECK(d >= 0 && d < world, "world %d per %d rank %d: slice_at(%d) = %d", world,
                          per, rank, p, d);
                    if (d < 0 || d >= world) continue;
                    ++seen[d];
                    CHECK(position_of(t, d) == p, "position_of(slice_at(%d)) = %d (world %d per %d "
                          "rank %d)", p, position_of(t, d), world, per, rank);
                    const int c = slice_class(t, d);
                    CHECK(c >= last_class, "world %d per %d rank %d: class %d after %d at %d", world,
                          per, rank, c, last_class, p);
                    last_class = c;
                    const bool same = d / per == rank / per;
                    CHECK((c == kOtherNode) == !same, "class of %d wrong", d);
                }
                for (int d = 0; d < world; ++d)
                    CHECK(seen[d] == 1, "world %d per %d rank %d: dest %d appears %d times", world,
                          per, rank, d, seen[d]);
                CHECK(slice_at(t, world - 1) == rank, "self is not last");
                ++cases;
            }
    std::printf("ok order: %d topologies, permutation + inverse + remote-first classes\n", cases);
}

// Rotation: with one node, position 0 of rank r is r+1, so ranks start on different peers.
static void check_rotation() {
    for (int world = 2; world <= 8; ++world)
        for (int rank = 0; rank < world; ++rank) {
            Topology t{rank, world, world};
            CHECK(slice_at(t, 0) == (rank + 1) % world, "rank %d first dest %d", rank,
                  slice_at(t, 0));
        }
    std::printf("ok rotation: first destination is the next rank\n");
}

static void check_split() {
    for (int64_t n : {0, 1, 5, 7, 64, 1000, 4097})
        for (int parts = 1; parts <= 9; ++parts) {
            CHECK(split_begin(n, parts, 0) == 0, "split start");
            CHECK(split_begin(n, parts, parts) == n, "split end %lld", (long long)n);
            for (int i = 0; i < parts; ++i) {
                const int64_t len = split_begin(n, parts, i + 1) - split_begin(n, parts, i);
                CHECK(len == n / parts || len == n / parts + 1, "unbalanced split");
            }
        }
    std::printf("ok split: balanced chunks cover [0, n)\n");
}

// Concurrent workers: every task runs once, each slice is finished exactly once and only
// after all its tiles, task ids are claimed remote-first, and the counters end at zero so
// that the next launch (100 of them here) needs no re-zeroing.
static void check_run(std::mt19937 &rng) {
    int runs = 0;
    for (int world : {1, 2, 3, 4, 7, 8})
        for (int per : {1, 2, 4, 8})
            for (int workers : {1, 2, 3, 8}) {
                const int rank = static_cast<int>(rng() % world);
                Topology topo{rank, world, per};
                uint32_t next = 0, exited = 0;
                std::vector<uint32_t> done(world, 0);
                Counters c{&next, &exited, done.data()};
                std::vector<uint64_t> signals(world, 0);  // one slot per destination
                for (uint64_t epoch = 1; epoch <= 100; ++epoch) {
                    std::vector<uint32_t> tasks(world);
                    for (int d = 0; d < world; ++d)
                        tasks[d] = tasks_for_rows(rng() % 4 == 0 ? 0 : rng() % 50, 1 + rng() % 8);
                    std::vector<uint32_t> prefix(world + 1);
                    const uint32_t total = build_task_prefix(topo, tasks.data(), prefix.data());
                    Plan plan{topo, total, prefix.data()};
                    std::vector<std::atomic<int>> ran(total);
                    std::vector<std::atomic<int>> tiles_done(world), finished(world);
                    for (auto &x : ran) x = 0;
                    for (int d = 0; d < world; ++d) tiles_done[d] = finished[d] = 0;
                    std::atomic<int> order_ok{1};
                    auto body = [&](int /*w*/) {
                        int last_position = -1;  // a worker's own claims are increasing
                        run_worker(
                            plan, c, workers,
                            [&](const Task &t) {
                                const uint32_t id = prefix[t.position] + t.tile;
                                ran[id].fetch_add(1);
                                if (t.position < last_position) order_ok = 0;
                                last_position = t.position;
                                if (t.tiles != tasks[t.dest]) order_ok = 0;
                                tiles_done[t.dest].fetch_add(1);
                                return true;
                            },
                            [&](const Task &t) {
                                if (tiles_done[t.dest].load() != static_cast<int>(t.tiles))
                                    order_ok = 0;  // finished before all its tiles
                                finished[t.dest].fetch_add(1);
                                __atomic_store_n(&signals[t.dest], signal_value(epoch),
                                                 __ATOMIC_RELEASE);
                                return true;
                            });
                    };
                    std::vector<std::thread> pool;
                    for (int w = 1; w < workers; ++w) pool.emplace_back(body, w);
                    body(0);
                    for (auto &th : pool) th.join();
                    for (uint32_t id = 0; id < total; ++id)
                        CHECK(ran[id] == 1, "task %u ran %d times (world %d workers %d)", id,
                              ran[id].load(), world, workers);
                    for (int d = 0; d < world; ++d) {
                        CHECK(finished[d] == 1, "slice %d finished %d times", d, finished[d].load());
                        CHECK(signal_ready(signals[d], epoch), "slice %d not signalled", d);
                        CHECK(!signal_ready(signals[d], epoch + 1), "signal ahead of epoch");
                        CHECK(done[d] == 0, "slice counter %d left at %u", d, done[d]);
                    }
                    CHECK(order_ok.load() == 1, "claim order or completion order broken");
                    CHECK(next == 0 && exited == 0, "task/exit counters not reset (%u, %u)", next,
                          exited);
                }
                ++runs;
            }
    std::printf("ok run: %d configs x 100 launches, every task once, every slice signalled once\n",
                runs);
}

// With a single worker the execution order is the claim order: every task bound for another
// node runs before any same-node task, and those before the local slice.
static void check_remote_first_execution() {
    Topology t{5, 8, 2};  // 4 nodes of 2; rank 5's node holds 4 and 5
    std::vector<uint32_t> tasks = {3, 1, 2, 2, 4, 5, 1, 2};
    std::vector<uint32_t> prefix(9);
    const uint32_t total = build_task_prefix(t, tasks.data(), prefix.data());
    Plan plan{t, total, prefix.data()};
    uint32_t next = 0, exited = 0;
    std::vector<uint32_t> done(8, 0);
    Counters c{&next, &exited, done.data()};
    std::vector<int> classes;
    run_worker(plan, c, 1, [&](const Task &task) {
        classes.push_back(slice_class(t, task.dest));
        return true;
    }, [](const Task &) { return true; });
    CHECK(static_cast<uint32_t>(classes.size()) == total, "ran %zu of %u", classes.size(), total);
    for (size_t i = 1; i < classes.size(); ++i)
        CHECK(classes[i] >= classes[i - 1], "class went from %d to %d", classes[i - 1], classes[i]);
    CHECK(classes.front() == kOtherNode && classes.back() == kSelf, "ends of the order");
    std::printf("ok remote-first: other-node tasks, then same-node, then local\n");
}

int main() {
    std::mt19937 rng(1234);
    check_order();
    check_rotation();
    check_split();
    check_remote_first_execution();
    check_run(rng);
    if (g_failures) {
        std::printf("%d failures\n", g_failures);
        return 1;
    }
    std::printf("schedule: all checks passed\n");
    return 0;
}
