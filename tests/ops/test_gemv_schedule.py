"""The world-size-1 GEMV kernels' schedule (hip/src/gpu/fused_gemv.hip), run on the CPU.

The kernels split the row groups statically over every wave of the grid (`wave_groups`), and
the cp.async kernel streams each wave's groups through a ring of shared-memory slots
(`stream_steps`). Both are __host__ __device__ templates of the kernel's own file, which a
host program includes (with ROCMOE_GEMV_SCHEDULE_ONLY: no kernels) and drives here:

* the split covers every group exactly once, in order, and no two waves differ by more than
  one group (so every compute unit gets the same share of W);
* the pipeline, with the copies modelled as cp.async does them (a copy lands in its slot
  only when a later wait completes its commit group), consumes every step of every group
  exactly once and in order, only after its copy landed, never has a copy overwrite a slot
  whose step is still to be consumed, keeps kStages - 1 steps in flight, and finishes each
  group right after its last step, also for K == 0 (no steps) and for waves without groups.

The balanced split (ROCMOE_GEMV_BALANCE=1: `walk_chunks`, one row a wave) is driven the same
way, with every wave's operations modelled on the host (a chunk's value stands for its
vectors' dot product; a slot is a map entry):

* where it applies (`balanced_split_fits`), the waves' chunk counts differ by one at most and
  each is a row's chunks at least; every chunk of every row is accumulated exactly once,
  each wave's chunks in order;
* every row's y is stored exactly once and equals the sum of its chunks, whichever of a cut
  row's two waves comes second (the waves run in order and in reverse order), every slot
  named is one of 1 .. waves - 1, is shared by the two waves of one row, and is empty again
  after the call; the slots fit in the world-size-1 receive buffers.

nvcc compiles the programs (the kernel file includes the platform header, which needs a GPU
compiler); nothing runs on a GPU.
"""

from __future__ import annotations

import subprocess

import pytest

from rocmoe_testing import REPO, require_tool

pytestmark = pytest.mark.compile

# what both programs start with: the kernel file's schedule and a CHECK that counts failures
PRELUDE = r"""
#include "gpu/fused_gemv.hip"

#include <cstdio>

static int failures = 0;
#define CHECK(cond, ...)                                 \
    do {                                                 \
        if (!(cond)) {                                   \
            if (++failures < 20) {                       \
                std::printf("FAIL %s: ", #cond);         \
                std::printf(__VA_ARGS__);                \
                std::printf("\n");                       \
            }                                            \
        }                                                \
    } while (0)
"""

PROGRAM = PRELUDE + r"""
#include <cstdlib>
#include <deque>
#include <vector>

using rocmoe::fused::GroupRange;
using rocmoe::fused::stream_steps;
using rocmoe::fused::wave_groups;

static void check_split(long long groups, int waves) {
    long long next = 0, least = -1, most = 0;
    for (int q = 0; q < waves; ++q) {
        const GroupRange r = wave_groups(groups, waves, q);
        CHECK(r.begin == next, "groups %lld waves %d: wave %d starts at %lld, not %lld",
              groups, waves, q, (long long)r.begin, next);
        CHECK(r.end >= r.begin, "groups %lld waves %d: wave %d ends before it starts", groups,
              waves, q);
        const long long n = r.end - r.begin;
        least = least < 0 || n < least ? n : least;
        most = n > most ? n : most;
        next = r.end;
    }
    CHECK(next == groups, "groups %lld waves %d: the waves cover %lld", groups, waves, next);
    CHECK(most - least <= 1, "groups %lld waves %d: %lld to %lld groups a wave", groups, waves,
          least, most);
}

// cp.async as the model: copies issued since the last commit form one group; a group's
// copies land in their slots when a wait completes it (oldest first).
template <int kStages>
struct ModelOps {
    struct Copy { int slot; long long group; int step; };
    struct Slot { long long group = -1; int step = -1; bool consumed = true; };
    std::vector<Copy> open;
    std::deque<std::vector<Copy>> pending;
    Slot slots[kStages];
    long long begin, end;
    int steps;
    long long expect_group;
    int expect_step = 0;
    long long consumed = 0, finished = 0;
    size_t most_pending = 0;

    void issue(int slot, long long group, int step) {
        CHECK(slot >= 0 && slot < kStages, "slot %d", slot);
        // the slot's previous step must have been consumed (it is the copy's destination),
        // and no copy still in flight may target it either
        CHECK(slots[slot].consumed, "issue of (%lld, %d) over slot %d, whose step (%lld, %d) "
              "is not consumed", group, step, slot, slots[slot].group, slots[slot].step);
        for (const auto &g : pending)
            for (const Copy &c : g)
                CHECK(c.slot != slot, "issue into slot %d while a copy to it is in flight", slot);
        for (const Copy &c : open)
            CHECK(c.slot != slot, "two copies into slot %d in one commit group", slot);
        CHECK(group >= begin && group < end && step >= 0 && step < steps,
              "issue of step (%lld, %d) outside [%lld, %lld) x %d", group, step, begin, end,
              steps);
        open.push_back(Copy{slot, group, step});
    }
    void commit() {
        pending.push_back(open);
        open.clear();
        size_t in_flight = 0;
        for (const auto &g : pending) in_flight += g.size();
        most_pending = in_flight > most_pending ? in_flight : most_pending;
    }
    void wait() {
        CHECK(open.empty(), "a wait with uncommitted copies");
        while (pending.size() > size_t(kStages - 2)) {
            for (const Copy &c : pending.front()) slots[c.slot] = Slot{c.group, c.step, false};
            pending.pop_front();
        }
    }
    void consume(int slot) {
        const Slot &s = slots[slot];
        CHECK(!s.consumed && s.group == expect_group && s.step == expect_step,
              "consume of slot %d holding (%lld, %d, consumed %d), expected (%lld, %d)", slot,
              s.group, s.step, int(s.consumed), expect_group, expect_step);
        slots[slot].consumed = true;
        ++consumed;
        if (++expect_step == steps) {
            expect_step = 0;
            ++expect_group;
        }
    }
    void finish(long long group) {
        CHECK(group == begin + finished, "finish of group %lld, expected %lld", group,
              begin + finished);
        // every step of the group consumed before it is finished
        CHECK(steps == 0 || expect_group == group + 1, "finish of group %lld before its last "
              "step (next expected (%lld, %d))", group, expect_group, expect_step);
        ++finished;
    }
};

template <int kStages>
static void check_pipeline(long long begin, long long end, int steps) {
    ModelOps<kStages> ops;
    ops.begin = begin;
    ops.end = end;
    ops.steps = steps;
    ops.expect_group = begin;
    stream_steps<kStages>(ops, GroupRange{begin, end}, steps);
    const long long groups = end - begin;
    CHECK(ops.consumed == groups * steps, "stages %d groups %lld steps %d: %lld steps consumed",
          kStages, groups, steps, ops.consumed);
    CHECK(ops.finished == groups, "stages %d groups %lld steps %d: %lld groups finished",
          kStages, groups, steps, ops.finished);
    const long long total = groups * steps;
    const long long want = total < kStages - 1 ? total : kStages - 1;
    CHECK((long long)ops.most_pending == want, "stages %d groups %lld steps %d: %zu steps in "
          "flight at most, expected %lld", kStages, groups, steps, ops.most_pending, want);
    size_t left = ops.open.size();
    for (const auto &g : ops.pending) left += g.size();
    CHECK(left == 0, "stages %d: %zu copies issued and never consumed", kStages, left);
}

template <int kStages>
static void check_pipelines() {
    const int steps_list[] = {0, 1, 2, 3, 5, 32, 64};
    const long long groups_list[][2] = {{0, 0}, {7, 7}, {0, 1}, {3, 4}, {0, 2}, {5, 9}, {10, 27}};
    for (int steps : steps_list)
        for (const auto &g : groups_list) check_pipeline<kStages>(g[0], g[1], steps);
}

int main() {
    const long long groups_list[] = {0, 1, 7, 100, 1024, 4096, 4097, 14336, 1 << 22};
    const int waves_list[] = {1, 3, 8, 528, 1056, 4224};
    for (long long g : groups_list)
        for (int w : waves_list) check_split(g, w);
    check_pipelines<2>();
    check_pipelines<3>();
    check_pipelines<4>();
    check_pipelines<6>();
    if (failures) {
        std::printf("%d failures\n", failures);
        return 1;
    }
    std::printf("gemv schedule: all checks passed\n");
    return 0;
}
"""


BALANCED_PROGRAM = PRELUDE + r"""
#include <cmath>
#include <map>
#include <random>
#include <utility>
#include <vector>

using rocmoe::fused::balanced_split_fits;
using rocmoe::fused::chunks_per_row;
using rocmoe::fused::walk_chunks;
using rocmoe::sched::gemv_result_offset;


// One call's state: the chunks' values, what the waves did, the slots
struct Call {
    long long rows, per_row;
    int waves;
    std::vector<double> value;            // [rows * per_row]
    std::vector<int> hits;                // [rows * per_row]
    std::vector<int> stores;              // [rows]
    std::vector<double> y;                // [rows]
    std::map<int, std::pair<long long, double>> slots;  // slot -> (row, part)
};

// walk_chunks' operations for wave q (the model of gemv_balanced_kernel's ChunkLane)
struct WaveModel {
    Call *call;
    int q;
    double acc = 0;
    long long chunks = 0, next = -1;
    void segment(long long row, long long from, long long to) {
        const long long at = row * call->per_row + from;
        CHECK(row >= 0 && row < call->rows && from >= 0 && from < to && to <= call->per_row,
              "wave %d: segment (%lld, %lld, %lld)", q, row, from, to);
        CHECK(next < 0 || at == next, "wave %d: chunk %lld after %lld", q, at, next);
        for (long long c = from; c < to; ++c) {
            ++call->hits[row * call->per_row + c];
            acc += call->value[row * call->per_row + c];
        }
        chunks += to - from;
        next = row * call->per_row + to;
    }
    void store(long long row) {
        ++call->stores[row];
        call->y[row] = acc;
        acc = 0;
    }
    void share(long long row, int slot) {
        CHECK(slot >= 1 && slot < call->waves, "wave %d: slot %d of %d waves", q, slot,
              call->waves);
        auto it = call->slots.find(slot);
        if (it == call->slots.end()) {
            call->slots[slot] = std::make_pair(row, acc);
        } else {
            CHECK(it->second.first == row, "slot %d: rows %lld and %lld", slot, it->second.first,
                  row);
            ++call->stores[row];
            call->y[row] = acc + it->second.second;
            call->slots.erase(it);
        }
        acc = 0;
    }
};

static void check_call(long long rows, long long nvec, int wave, int waves, bool reverse,
                       std::mt19937_64 &rng) {
    const long long per_row = chunks_per_row(nvec, wave);
    CHECK(per_row == (nvec + wave - 1) / wave && per_row * wave >= nvec &&
              (per_row - 1) * wave < nvec,
          "nvec %lld wave %d: %lld chunks a row", nvec, wave, per_row);
    const long long total = rows * per_row;
    const bool fits = balanced_split_fits(rows, per_row, waves);
    CHECK(fits == (total / waves >= per_row), "rows %lld per_row %lld waves %d: fits %d", rows,
          per_row, waves, int(fits));
    if (!fits) return;
    // the slots (one uint64 a wave) fit in the world-size-1 receive buffers (two parities of
    // fp32 partials then y; bf16 / fp16 y is the smallest)
    CHECK(8ull * waves <= 2 * (gemv_result_offset(rows, 1) + 2ull * rows),
          "rows %lld: %d slots do not fit", rows, waves);
    Call call{rows, per_row, waves};
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    call.value.resize(total);
    for (double &v : call.value) v = u(rng);
    call.hits.assign(total, 0);
    call.stores.assign(rows, 0);
    call.y.assign(rows, 0.0);
    long long least = -1, most = 0;
    for (int i = 0; i < waves; ++i) {
        const int q = reverse ? waves - 1 - i : i;
        WaveModel m{&call, q};
        walk_chunks(m, rows, per_row, waves, q);
        CHECK(m.acc == 0, "wave %d: a part left unstored", q);
        least = least < 0 || m.chunks < least ? m.chunks : least;
        most = m.chunks > most ? m.chunks : most;
    }
    CHECK(most - least <= 1 && least >= per_row, "rows %lld per_row %lld waves %d: %lld to %lld "
          "chunks a wave", rows, per_row, waves, least, most);
    for (long long c = 0; c < total; ++c)
        CHECK(call.hits[c] == 1, "rows %lld per_row %lld waves %d: chunk %lld taken %d times",
              rows, per_row, waves, c, call.hits[c]);
    for (long long r = 0; r < rows; ++r) {
        double want = 0;
        for (long long c = 0; c < per_row; ++c) want += call.value[r * per_row + c];
        CHECK(call.stores[r] == 1 && std::fabs(call.y[r] - want) <= 1e-9 * (1 + std::fabs(want)),
              "rows %lld per_row %lld waves %d: row %lld stored %d times, %g against %g", rows,
              per_row, waves, r, call.stores[r], call.y[r], want);
    }
    CHECK(call.slots.empty(), "rows %lld per_row %lld waves %d: %zu slots left full", rows,
          per_row, waves, call.slots.size());
}

int main() {
    std::mt19937_64 rng(7);
    const long long rows_list[] = {1, 2, 7, 37, 229, 4096, 4097, 16384};
    const long long nvec_list[] = {1, 2, 31, 32, 33, 64, 1000, 2048};
    const int waves_list[] = {1, 2, 3, 8, 528, 4224};
    long long applied = 0;
    for (long long rows : rows_list)
        for (long long nvec : nvec_list)
            for (int wave : {32, 64})
                for (int waves : waves_list)
                    for (bool reverse : {false, true}) {
                        if (rows * nvec > (1ll << 24)) continue;
                        check_call(rows, nvec, wave, waves, reverse, rng);
                        applied += balanced_split_fits(rows, chunks_per_row(nvec, wave), waves);
                    }
    // the H200 shapes (16384^2 bf16: 2048 vectors a row; 4,224 waves) take the balanced split
    CHECK(balanced_split_fits(16384, chunks_per_row(2048, 32), 4224), "16384^2 bf16");
    CHECK(applied > 100, "only %lld cases applied the split", applied);
    if (failures) {
        std::printf("%d failures\n", failures);
        return 1;
    }
    std::printf("gemv balanced split: all checks passed (%lld cases)\n", applied);
    return 0;
}
"""


LOAD_PROGRAM = PRELUDE + r"""
using rocmoe::fused::kLoadCached;
using rocmoe::fused::kLoadNoL1;
using rocmoe::fused::load_for_device;

int main() {
    // the names the driver gives (cudaDeviceProp::name)
    const char *no_l1[] = {"NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                           "NVIDIA H200", "NVIDIA H200 NVL"};
    const char *cached[] = {"NVIDIA GH200 480GB", "NVIDIA H800",
                            "NVIDIA A100-SXM4-80GB", "", nullptr};
    for (const char *name : no_l1)
        CHECK(load_for_device(name) == kLoadNoL1, "%s: load %d", name, load_for_device(name));
    for (const char *name : cached)
        CHECK(load_for_device(name) == kLoadCached, "%s: load %d", name ? name : "(null)",
              load_for_device(name));
    if (failures) {
        std::printf("%d failures\n", failures);
        return 1;
    }
    std::printf("gemv load flavour: all checks passed\n");
    return 0;
}
"""


def _build_and_run(tmp_path, program: str, name: str) -> str:
    """Compile `program` (a host program including the kernel file's schedule) and run it."""
    nvcc = require_tool("nvcc", "compiles the GEMV kernel file's schedule into a host program")
    src = tmp_path / f"{name}.cu"
    src.write_text(program)
    exe = tmp_path / name
    build = subprocess.run(
        [nvcc, "-x", "cu", "-std=c++17", "-O1", "-arch=sm_90", "--expt-relaxed-constexpr",
         "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_CUDA", "-DROCMOE_GEMV_SCHEDULE_ONLY",
         f"-I{REPO / 'hip' / 'include'}", f"-I{REPO / 'hip' / 'src'}", str(src), "-o", str(exe)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert build.returncode == 0, build.stdout
    run = subprocess.run([str(exe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout
    return run.stdout


def test_gemv_split_and_pipeline_schedule_on_the_cpu(tmp_path):
    out = _build_and_run(tmp_path, PROGRAM, "gemv_schedule")
    assert "gemv schedule: all checks passed" in out, out


def test_gemv_balanced_split_takes_every_chunk_once_and_stores_every_row_once(tmp_path):
    out = _build_and_run(tmp_path, BALANCED_PROGRAM, "gemv_balanced")
    assert "gemv balanced split: all checks passed" in out, out


def test_gemv_loads_skip_l1_by_default_on_an_h100_or_h200_only(tmp_path):
    """The default load flavour per device name (kNoL1Devices): L1::no_allocate on every H100
    and H200 (two sweeps on each, the thirty-third and thirty-seventh sessions), plain loads
    elsewhere (the GH200 and others: no sweep there has compared the two)."""
    out = _build_and_run(tmp_path, LOAD_PROGRAM, "gemv_load")
    assert "gemv load flavour: all checks passed" in out, out
