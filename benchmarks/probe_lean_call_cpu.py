"""Host time of a GemmAllToAll handle's lean call (rocmoe/ops/gpu/gemm_plans.py:
lean_gemm_call) on CPU: the stand-in handle and native launch of its tests
(tests/ops/lean_gemm_standins.py), which count the launch and launch nothing, so what is
timed is the call's own Python (checks, device counts, output ring, pointer writes) without
the driver. On a GPU all of it runs before the
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

import torch

_REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _REPO)
# the lean call's stand-ins, shared with its tests (tests/ops/lean_gemm_standins.py)
sys.path.insert(0, os.path.join(_REPO, "tests", "ops"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--label", default="", help="a name for the tree measured")
    a = ap.parse_args(argv)
    from lean_gemm_standins import FakeNative, lean_call_on_cpu
    m, k, n = a.rows, 64, 64
    nl = FakeNative(record=False)
    call, x, w = lean_call_on_cpu(m, k, n, 2 * m, nl, setattr)
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
