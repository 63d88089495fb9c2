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

nvcc compiles the program (the kernel file includes the platform header, which needs a GPU
compiler); nothing runs on a GPU.
"""

from __future__ import annotations

import subprocess

import pytest

from rocmoe_testing import REPO, require_tool

pytestmark = pytest.mark.compile

PROGRAM = r"""
#include "gpu/fused_gemv.hip"

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <vector>

using rocmoe::fused::GroupRange;
using rocmoe::fused::stream_steps;
using rocmoe::fused::wave_groups;

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


def test_gemv_split_and_pipeline_schedule_on_the_cpu(tmp_path):
    nvcc = require_tool("nvcc", "compiles the GEMV kernel file's schedule into a host program")
    src = tmp_path / "gemv_schedule.cu"
    src.write_text(PROGRAM)
    exe = tmp_path / "gemv_schedule"
    build = subprocess.run(
        [nvcc, "-x", "cu", "-std=c++17", "-O1", "-arch=sm_90", "--expt-relaxed-constexpr",
         "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_CUDA", "-DROCMOE_GEMV_SCHEDULE_ONLY",
         f"-I{REPO / 'hip' / 'include'}", f"-I{REPO / 'hip' / 'src'}", str(src), "-o", str(exe)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert build.returncode == 0, build.stdout
    run = subprocess.run([str(exe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout
    assert "gemv schedule: all checks passed" in run.stdout, run.stdout
