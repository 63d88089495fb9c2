"""Stand-ins for running a GemmAllToAll handle's lean call (rocmoe/ops/gpu/gemm_plans.py:
_LeanGemmLaunch, lean_gemm_call) without a GPU: a native launch that launches nothing, a
plan, and a one-rank handle of CPU tensors. The lean call's tests use them, and so does
benchmarks/probe_lean_call_cpu.py, which times the call's own Python against them (one
stand-in for both, so that what the probe times is what the tests specify)."""

from __future__ import annotations

import types

import numpy as np
import torch

# the argument positions of the output, the counts and the received counts: the pointers
# the lean launch writes itself (the rest are written by a launch through the plan)
POINTER_POSITIONS = (2, 3, 6)


class FakeNative:
    """Stands for a NativeLaunch: pointer cells, the generation counter, and launches made
    as written. `record`: keep what each step wrote and each launch's pointers (the tests);
    off, it only counts the launches (the probe: a list growing by a dict a call would be
    timed with the call)."""

    def __init__(self, record: bool = True):
        self.record = record
        self.generation, self.written = 0, False
        self.cells = {pos: [0] for pos in POINTER_POSITIONS}
        self.stepped, self.launched, self.launches = [], [], 0
        self.step_ok = True

    def step(self, pos):
        def write(a):
            if self.record:
                self.stepped.append((pos, a.data_ptr()))
            return self.step_ok
        return write

    def pointer_cell(self, pos):
        return self.cells[pos], True

    def launch_as_written(self, grid_x, stream):
        self.launches += 1
        if self.record:
            self.launched.append((grid_x, stream,
                                  dict((p, c[0]) for p, c in self.cells.items())))

    def full_launch(self):  # what the plan's launch does to the native launch
        self.generation += 1
        self.written = True


class FakePlan:
    nprog, local = 7, True
    split_sum = None  # or a callable (out, counts, M, stream): a SPLIT_SUM plan's sum


def lean_call_on_cpu(rows: int, k: int, n: int, capacity_rows: int, nl: FakeNative, patch):
    """(the lean call, X, W) for a one-rank handle of max_rows `rows` whose plan for X's
    rows class has a lean launch on `nl`, a launch through the plan having written every
    argument. `patch(obj, name, value)` (setattr, or pytest's monkeypatch.setattr) makes a
    CPU tensor's device index (-1) the current device and stream 0 the current stream."""
    from rocmoe import native_launch
    from rocmoe.ops.gpu import gemm_plans
    patch(torch.cuda, "current_device", lambda: -1)
    patch(native_launch, "stream_getter", lambda device: (lambda: 0))
    launch = gemm_plans._LeanGemmLaunch(FakePlan(), None, nl)
    x, w = torch.randn(rows, k), torch.randn(k, n)
    before = nl.generation
    nl.full_launch()
    launch.record(x, w, before)
    status = np.zeros(4, dtype=np.int32)
    handle = types.SimpleNamespace(
        dtype=torch.float32, K=k, N=n, groups=1, max_rows=rows, capacity_rows=capacity_rows,
        ctx=types.SimpleNamespace(device=torch.device("cpu"), finalized=False),
        _status=status, _status_clear=status.tobytes(), broken=None, _outputs={}, epoch=0)
    call = gemm_plans.lean_gemm_call(handle, {rows.bit_length(): (FakePlan(), launch)},
                                     types.SimpleNamespace(world=1))
    return call, x, w
