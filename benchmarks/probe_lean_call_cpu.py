"""Host time of a GemmAllToAll handle's lean call (rocmoe/ops/gpu/gemm_plans.py:
lean_gemm_call) on CPU: a stand-in handle and a stand-in native launch that records the
launch and launches nothing, so what is timed is the call's own Python (checks, device
counts, output ring, pointer writes) without the driver. On a GPU all of it runs before the
launch, and from an idle GPU every microsecond of it is a microsecond of the call
(results/probe_prelaunch_h100_thirtyfirst_session.jsonl: 6.9 us of it on an H100's host).

JSON lines on stdout, one per case (the capacity output; exact rows that repeat).

    python3 benchmarks/probe_lean_call_cpu.py [--calls 100000] [--rows 512] [--label NAME]
"""

import argparse
import json
import os
import sys
import timeit
import types

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class _Native:
    """A NativeLaunch's surface as the lean launch uses it; launches nothing."""

    def __init__(self):
        self.generation, self.written, self.launches = 0, False, 0
        self.cells = {pos: [0] for pos in (2, 3, 6)}

    def step(self, pos):
        return lambda a: True

    def pointer_cell(self, pos):
        return self.cells[pos], True

    def launch_as_written(self, grid_x, stream):
        self.launches += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--label", default="", help="a name for the tree measured")
    a = ap.parse_args(argv)
    torch.cuda.current_device = lambda: -1  # the index a CPU tensor reports
    from rocmoe import native_launch
    native_launch.stream_getter = lambda device: (lambda: 0)
    from rocmoe.ops.gpu import gemm_plans
    m, k, n = a.rows, 64, 64
    nl = _Native()
    plan = types.SimpleNamespace(nprog=1, local=True)
    launch = gemm_plans._LeanGemmLaunch(plan, None, nl)
    x, w = torch.randn(m, k), torch.randn(k, n)
    nl.generation, nl.written = 1, True  # a launch through the plan wrote every argument
    launch.record(x, w, 0)
    status = np.zeros(4, dtype=np.int32)
    handle = types.SimpleNamespace(
        dtype=torch.float32, K=k, N=n, groups=1, max_rows=m, capacity_rows=2 * m,
        ctx=types.SimpleNamespace(device=torch.device("cpu"), finalized=False),
        _status=status, _status_clear=status.tobytes(), broken=None, _outputs={}, epoch=0)
    call = gemm_plans.lean_gemm_call(handle, {m.bit_length(): (plan, launch)},
                                     types.SimpleNamespace(world=1))
    counts = [m]
    with torch.no_grad():
        for exact in (False, True):
            for _ in range(3):
                if call(x, w, counts, exact) is None:
                    raise SystemExit("probe_lean_call_cpu: the lean call declined")
            us = min(timeit.repeat(lambda: call(x, w, counts, exact), number=a.calls,
                                   repeat=5)) / a.calls * 1e6
            print(json.dumps(dict(probe="lean_call_cpu", label=a.label, rows=m, exact=exact,
                                  host_us=round(us, 3), launches=nl.launches)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
