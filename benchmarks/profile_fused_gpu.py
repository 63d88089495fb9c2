"""Where a fused op's time goes on one GPU: per-kernel device time (torch.profiler / CUPTI).

    python benchmarks/profile_fused_gpu.py [--ops gemv,gemm] [--calls 20]

For each op it runs `calls` calls of the fused op (world size 1, signalling on) and of its
torch baseline, and prints every kernel's mean device time and the wall time per call, so
launch gaps and host overhead show as the difference between the two.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def profile(label, fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / calls * 1e6
    print(f"== {label}: {wall_us:.1f} us wall per call (profiled)")
    for evt in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if evt.device_time_total <= 0:
            continue
        print(f"   {evt.device_time_total / calls:9.1f} us/call  x{evt.count / calls:4.1f}  "
              f"{evt.key[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gemv,gemm")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    from rocmoe.bench.fused_gpu import make_arena
    from rocmoe.ops import gpu
    arena = make_arena(False)
    ops = args.ops.split(",")
    if "gemv" in ops:
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(16384, 16384, device="cuda", dtype=dtype)
            x = torch.randn(16384, device="cuda", dtype=dtype)
            profile(f"gemv_all_reduce {dtype}", lambda: gpu.gemv_all_reduce(arena, w, x, check=False),
                    args.calls)
            profile(f"torch matvec {dtype}", lambda: w @ x, args.calls)
            del w, x
    if "gemm" in ops:
        for size in (4096, 8192):
            x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            plan = gpu.plan_gemm(arena, size, size, [size], gpu.gemm_config(x.device, x.dtype))
            profile(f"gemm_all_to_all {size}", lambda: gpu.gemm_all_to_all(
                arena, x, w, [size], check=False, plan=plan), args.calls)
            profile(f"torch.matmul {size}", lambda: x @ w, args.calls)
    arena.barrier()


if __name__ == "__main__":
    main()
