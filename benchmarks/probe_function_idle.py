"""Why the 512 x 4096^2 GEMM function after a 4096-row call starts slower from an idle GPU
than a handle made for 512 rows, with the host time of both about torch's.

The thirtieth session's H100 (results/fused_gpu_h100_thirtieth_session_gemm_function.jsonl):
the function took 49.7 us idle-start against the 512-row handle's 43.4 (torch 39.5), with
14.2 / 12.7 us of host time and 28.0 / 27.5 us queued. What differs between the two: the
function's Python layers above its cached handle's lean call, and the cached handle itself
(capacity 4096 rows: its plan for the 512-row class runs 132 programs, the 512-row handle's
128). This probe times, interleaved in the same idle-start loop (rocmoe.bench.fused_gpu's
idle_ms) and queued, the calls that separate the two:

* `function`: rocmoe.ops.gemm_all_to_all(x, w, [512]) after a 4096-row call;
* `cached_lean`: that function's cached handle's lean call with exact rows;
* `handle_4096`: a handle made for 4096 rows, called with 512;
* `handle_512`: a handle made for 512 rows;
* `torch`: torch.matmul.

One JSON line per call kind (median ms idle-start and queued, host us a call with the GPU
busy, the plan's programs).

    python3 benchmarks/probe_function_idle.py [--reps 15] [--rows 512] [--first-rows 4096]
        [--order function,cached_lean,handle_4096,handle_512,torch]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--first-rows", type=int, default=4096)
    ap.add_argument("--kn", type=int, default=4096)
    ap.add_argument("--order", default="function,cached_lean,handle_4096,handle_512,torch",
                    help="the calls' order in each interleaved round (each follows the one "
                         "before it: does a call after cuBLAS start slower?)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_function_idle needs a GPU")
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.fused_gpu import _gemm_plan, idle_ms, random_gemm_inputs, stream_ms
    from rocmoe.bench.timing import host_us_median
    from rocmoe.ops import _kernels
    ctx = rocmoe.init(backend="ipc", heap_size=2 << 30)
    m, kn, dtype, dev = a.rows, a.kn, torch.bfloat16, ctx.device
    g = torch.Generator(device=dev).manual_seed(3)
    x, w = random_gemm_inputs(m, kn, kn, dev, g, dtype)
    counts = [m]
    with torch.no_grad():
        ops.gemm_all_to_all(torch.randn(a.first_rows, kn, device=dev).to(dtype), w,
                            [a.first_rows])
        for _ in range(3):
            ops.gemm_all_to_all(x, w, counts)
        cached = _kernels._GEMM_LAST[ctx]
        big = ops.GemmAllToAll(ctx, a.first_rows, kn, kn, dtype)
        small = ops.GemmAllToAll(ctx, m, kn, kn, dtype)
        lean = cached._lean
        calls = {
            "function": lambda: ops.gemm_all_to_all(x, w, counts),
            "cached_lean": lambda: lean(x, w, counts, True),
            "handle_4096": lambda: big(x, w, counts),
            "handle_512": lambda: small(x, w, counts),
            "torch": lambda: torch.matmul(x, w)}
        order = a.order.split(",")
        if sorted(order) != sorted(calls):
            raise SystemExit(f"--order: a permutation of {','.join(calls)}")
        calls = {k: calls[k] for k in order}
        for fn in calls.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        idle = idle_ms(calls, a.reps)
        queued = stream_ms(calls, a.reps)
        plans = {"function": cached, "cached_lean": cached, "handle_4096": big,
                 "handle_512": small}
        for name, fn in calls.items():
            plan = _gemm_plan(plans[name], m) if name in plans else None
            print(json.dumps(dict(
                probe="function_idle", call=name, shape=dict(m=m, k=kn, n=kn),
                first_rows=a.first_rows, order=order, idle_ms=round(idle[name], 5),
                queued_ms=round(queued[name], 5),
                ratio_idle=round(idle["torch"] / idle[name], 4),
                ratio_queued=round(queued["torch"] / queued[name], 4),
                host_us=round(host_us_median(fn, 100, 3), 2),
                programs=plan and plan["programs"], config=plan and plan["config"],
                device=torch.cuda.get_device_name())), flush=True)
        big.close()
        small.close()
    ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
