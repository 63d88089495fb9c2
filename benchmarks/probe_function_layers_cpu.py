"""Host time of the GEMM function's Python layers above its handle's lean call, on CPU, with
a stand-in lean call that returns a kept output at once (nothing is launched): what the
layers themselves cost, apart from the launch, so that a GPU run of
benchmarks/probe_function_layers.py can be split into the two. Two cases: the cached
handle's output has exactly the call's rows (returned whole), or more (a 4096-row capacity:
the function returns a slice of it, as after a larger call; since the thirtieth session
only for rows that change from call to call, rows that repeat get outputs of their own
size: rocmoe/ops/gpu/gemm_plans.py, lean_gemm_call's `exact`).

Why this exists: on the twenty-ninth session's H100 host the 512 x 4096^2 function after a
4096-row call took 35.8 us a call against its 512-row handle's 24.7
(results/fused_gpu_h100_twentyninth_session_gemm_function.jsonl). JSON lines on stdout.

    python3 benchmarks/probe_function_layers_cpu.py [--calls 20000]
"""

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args(argv)
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.timing import host_us_median
    from rocmoe.ops import _kernels
    ctx = rocmoe.init(backend="host")
    rows, k, n = 512, 64, 64
    x, w, counts = torch.randn(rows, k), torch.randn(k, n), [rows]
    try:
        for capacity in (rows, 4096):
            kept = (torch.empty(capacity, n), torch.empty(1, dtype=torch.int64))
            # (the real lean call's `exact` makes exact-rows outputs for rows that repeat: the
            # stand-in ignores it, so the 4096 case is the slice that rows changing every
            # call still take)
            handle = types.SimpleNamespace(workspace=1,
                                           _lean=lambda x_, w_, c_, exact=False: kept)
            _kernels._GEMM_LAST[ctx] = handle
            layers = {
                "lean": lambda: handle._lean(x, w, counts),
                "repeat": lambda: _kernels.gemm_repeat(ctx, x, w, counts),
                "rows_exchange": lambda: _kernels.rows_exchange(ctx, "gemm_all_to_all", x, w,
                                                                counts),
                "function": lambda: ops.gemm_all_to_all(x, w, counts)}
            with torch.no_grad():
                assert ops.gemm_all_to_all(x, w, counts).shape == (rows, n)
                for name, fn in layers.items():
                    print(json.dumps(dict(probe="function_layers_cpu", rows=rows,
                                          capacity=capacity, layer=name,
                                          host_us=round(host_us_median(fn, a.calls), 3))), flush=True)
    finally:
        _kernels._GEMM_LAST.pop(ctx, None)
        ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
