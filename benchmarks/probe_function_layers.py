"""Where a functional fused op call's host time goes, layer by layer, on a GPU at world size
1: the same call entered at each layer of the function path, from the handle's lean call up
to rocmoe.ops.<op>(...), each timed against the torch op it replaces.

Why this exists: with the repeat paths on (the twenty-fifth session), the functions still
lost from an idle GPU where the handles did not: GEMM bf16 4096^3 on an H100, handle
idle-start 0.979 of torch.matmul, function 0.904; host 20.2 us a call against 38.4
(benchmarks/results/fused_gpu_h100_twentysixth_session.jsonl). From an idle GPU, every
microsecond of host work before the launch is a microsecond of the call's time. The layers
(each calls the next):

* GEMM: `lean` (the function's cached handle's lean call, gpu.lean_gemm_call), `handle`
  (its __call__), `repeat` (_kernels.gemm_repeat), `rows_exchange`, `function(ctx=ctx)`,
  `function` (the context looked up);
* GEMV: `reduce` (GemvAllReduce._reduce with the output ring), `handle`, `repeat`
  (_kernels._gemv_repeat), `gemv_forward`, `function(ctx=ctx)`, `function`.

One JSON line per op, shape and layer: host us a call (GPU busy; median of --rounds rounds
of --calls calls), idle-start and queued ms of the layer and of the torch op interleaved
(rocmoe.bench.fused_gpu's timers), and `to_launch_us`: idle-start minus queued ms, the
host's time before the GPU starts (about, as the GPU's clocks also ramp from idle).

    python3 benchmarks/probe_function_layers.py [--reps 9] [--calls 200] [--rounds 5]
        [--quick]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GEMM = [(4096, 4096, 4096), (512, 4096, 4096)]
GEMV = [(8192, 8192, "bf16"), (8192, 8192, "fp32")]
QUICK_GEMM, QUICK_GEMV = [(512, 512, 512)], [(2048, 2048, "bf16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gemm_layers(ctx, m, k, n):
    from rocmoe import ops
    from rocmoe.ops import _kernels
    g = torch.Generator(device=ctx.device).manual_seed(3)
    x = torch.randn(m, k, device=ctx.device, generator=g).to(torch.bfloat16)
    w = (torch.randn(k, n, device=ctx.device, generator=g) / k ** 0.5).to(torch.bfloat16)
    counts = [m]
    with torch.no_grad():
        ops.gemm_all_to_all(x, w, counts)      # caches the handle, then takes the repeat path
        ops.gemm_all_to_all(x, w, counts)
    handle = _kernels._GEMM_LAST.get(ctx)
    if handle is None or handle.__dict__.get("_lean") is None:
        raise SystemExit("the GEMM function left no repeat handle: ROCMOE_REPEAT_CALLS=0?")
    lean = handle._lean
    return dict(shape=dict(m=m, k=k, n=n), dtype="bf16", baseline=lambda: torch.matmul(x, w),
                layers={
                    "lean": lambda: lean(x, w, counts)[0],
                    "handle": lambda: handle(x, w, counts)[0],
                    "repeat": lambda: _kernels.gemm_repeat(ctx, x, w, counts)[0],
                    "rows_exchange": lambda: _kernels.rows_exchange(
                        ctx, "gemm_all_to_all", x, w, counts)[0],
                    "function(ctx=ctx)": lambda: ops.gemm_all_to_all(x, w, counts, ctx=ctx),
                    "function": lambda: ops.gemm_all_to_all(x, w, counts)})


def gemv_layers(ctx, n, k, dtype):
    from rocmoe import ops
    from rocmoe.ops import _kernels
    g = torch.Generator(device=ctx.device).manual_seed(4)
    dt = DTYPES[dtype]
    w = (torch.randn(n, k, device=ctx.device, generator=g) / k ** 0.5).to(dt)
    x = torch.randn(k, device=ctx.device, generator=g).to(dt)
    with torch.no_grad():
        ops.gemv_all_reduce(w, x)
    handle = _kernels._GEMV_LAST.get(ctx)
    if handle is None:
        raise SystemExit("the GEMV function left no repeat handle: ROCMOE_REPEAT_CALLS=0?")
    return dict(shape=dict(n=n, k=k), dtype=dtype, baseline=lambda: torch.mv(w, x),
                layers={
                    "reduce": lambda: handle._reduce(w, x, reuse=True),
                    "handle": lambda: handle(w, x),
                    "repeat": lambda: _kernels._gemv_repeat(ctx, w, x),
                    "gemv_forward": lambda: _kernels.gemv_forward(ctx, w, x),
                    "function(ctx=ctx)": lambda: ops.gemv_all_reduce(w, x, ctx=ctx),
                    "function": lambda: ops.gemv_all_reduce(w, x)})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--label", default="", help="a tag for every line (an A/B's side)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_function_layers needs a GPU (the layers it times run there)")
    import rocmoe
    from rocmoe.bench.fused_gpu import idle_ms, stream_ms
    from rocmoe.bench.timing import host_us_median
    ctx = rocmoe.init(backend="ipc", heap_size=1 << 30)
    gemm, gemv = (QUICK_GEMM, QUICK_GEMV) if a.quick else (GEMM, GEMV)
    cases = ([("gemm_all_to_all", gemm_layers, s) for s in gemm]
             + [("gemv_all_reduce", gemv_layers, s) for s in gemv])
    for op, make, shape in cases:
        case = make(ctx, *shape)
        with torch.no_grad():
            for name, fn in case["layers"].items():
                fns = {"rocmoe": fn, "baseline": case["baseline"]}
                for _ in range(5):
                    fn(), case["baseline"]()
                torch.cuda.synchronize()
                idle = idle_ms(fns, a.reps)
                queued = stream_ms(fns, a.reps)
                host = host_us_median(fn, a.calls, a.rounds)
                base_host = host_us_median(case["baseline"], a.calls, a.rounds)
                print(json.dumps(dict(
                    probe="function_layers", label=a.label, op=op, shape=case["shape"],
                    dtype=case["dtype"], layer=name,
                    host_us=round(host, 2),
                    baseline_host_us=round(base_host, 2),
                    idle_ms=round(idle["rocmoe"], 5), baseline_idle_ms=round(idle["baseline"], 5),
                    ratio_idle=round(idle["baseline"] / idle["rocmoe"], 4),
                    queued_ms=round(queued["rocmoe"], 5),
                    baseline_queued_ms=round(queued["baseline"], 5),
                    to_launch_us=round((idle["rocmoe"] - queued["rocmoe"]) * 1e3, 1),
                    baseline_to_launch_us=round((idle["baseline"] - queued["baseline"]) * 1e3, 1),
                    device=torch.cuda.get_device_name())), flush=True)
    ctx.finalize()


if __name__ == "__main__":
    main()
