"""Where one GPU gemm_all_to_all call's time goes (one rank, SingleRankArena): host time of
each step of rocmoe.ops.gpu.gemm_all_to_all under cProfile, and the GPU kernels of one call
from an idle GPU (torch profiler), for the grouped form on a small and a large shape.

    python3 benchmarks/profile_gemm_a2a_call.py [G,R,K,N ...]
"""
import cProfile
import pstats
import sys
import time

import torch

from rocmoe.bench.timing import time_ms
from rocmoe.ops import gpu


def main() -> None:
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]] or [
        (8, 256, 4096, 1024), (8, 2048, 4096, 1024)]
    arena = gpu.SingleRankArena(nbytes=1 << 30, timeout_s=10.0)
    for groups, rows, k, n in shapes:
        x = torch.randn(groups * rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(groups, k, n, device="cuda", dtype=torch.bfloat16)
        gc = [[rows] * groups]
        cfg = gpu.gemm_config(x.device, x.dtype)
        plan = gpu.plan_gemm_agreed(arena, [[groups * rows]], n, cfg, group_counts=gc)

        def call():
            return gpu.gemm_all_to_all(arena, x, w, [groups * rows], config=cfg, plan=plan,
                                       group_counts=gc)

        def kernel_only():
            return gpu.gemm_all_to_all(arena, x, w, [groups * rows], config=cfg, plan=plan,
                                       group_counts=gc, check=False, copy_out=False)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        reps = 50
        for name, fn in (("whole call", call), ("no status check, no copy-out", kernel_only)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / reps
            events = time_ms(fn, reps=1, warmup=0, calls=reps)
            print(f"G={groups} rows={rows} K={k} N={n} {name}: wall ms per call {wall:.3f}, "
                  f"events {events:.3f}")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
            if e.device_time_total > 0:
                print(f"   GPU {e.device_time_total / 10 / 1e3:8.4f} ms per call  {e.key[:70]}")
        stats = cProfile.Profile()
        stats.enable()
        for _ in range(reps):
            call()
        stats.disable()
        pstats.Stats(stats).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
