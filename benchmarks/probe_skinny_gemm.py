"""Why is GemmAllToAll at 256 x 4096 x 4096 (bf16, world size 1) slower than torch.matmul,
and why does splitting K, which should cut its L2 traffic, make it slower still?

At 256 rows the tuner keeps 64 x 128 tiles: 128 tiles, one wave on an H200's 132 SMs. Each
tile reads its 64 rows of X and a 4096 x 128 slice of W, so W is read from L2 four times
and X 32 times: 192 MiB in ~17 us, about 11 TB/s. 128 x 128 tiles with K split in two keep
one wave but read 128 MiB; the tuner timed them at 0.031 ms against 0.017
(benchmarks/results/fused_gpu_h200_thirteenth_session_tma_store_gemm.jsonl).

This probe runs the handle with each tile config forced (ROCMOE_GEMM_CONFIG, no tuning) and
torch.matmul, in one process: GPU time per call from a CUDA graph of 20 calls (median of 7
replays), then, with --calls N, N more eager calls of each for a profiler (Nsight Compute:
its kernel name, grid, cluster shape, L2 and DRAM bytes say what cuBLAS does differently).
JSON lines to --output.

    python benchmarks/probe_skinny_gemm.py --shape 256,4096,4096 --output probe.jsonl
    ncu --clock-control none --kernel-name regex:'gemm|nvjet|xmma|cutlass' \\
        --section SpeedOfLight --metrics lts__t_bytes.sum,dram__bytes_read.sum \\
        python benchmarks/probe_skinny_gemm.py --calls 2 --no-time
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from rocmoe.bench.timing import captured, time_ms

CONFIGS = {
    "64x128 s8": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=8),
    "64x64 s6": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=6),
    "128x128 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    "128x128 s4 split2": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                              num_stages=4, SPLIT_K=2),
    "64x128 s4 split2": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4,
                             SPLIT_K=2),
    "128x128 w8 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    # cuBLAS's choice at 256 x 4096^2 on an H200 (nvjet_sm90_tst_128x64_64x8_1x2: 128 x 64
    # tiles, BLOCK_K 64, 8 stages, 2 x 1 clusters)
    "128x64 s8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=8),
    "128x64 w8 s8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=8),
    "128x64 s6": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=6),
    "128x128 w8 s4 split2": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                 num_stages=4, SPLIT_K=2),
    "128x128 s5": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5),
    "128x128x128 s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    "128x256 w8 s3": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    # square shapes (2048^3): cuBLAS's nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA there is
    # 256 x 128 tiles, two warpgroups on M; and the default tile with half the k steps
    "256x128 w8 s3": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "256x128 w8 s4": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "128x256x128 w8 s2": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8,
                              num_stages=2),
}


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """GPU ms per call of `fn`: `calls` calls captured in one CUDA graph, median of
    `replays` timed replays."""
    def many():
        for _ in range(calls):
            fn()
    return time_ms(captured(many), reps=replays) / calls


def _bare(x, w, cfg):
    """The tile as benchmarks/probe_gemm_gap.py's bare Triton matmul (TMA loads, masked
    pointer store, one program per tile): the same code without the handle's plan."""
    import sys
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_gemm_gap import bare_matmul
    m, k = x.shape
    n = w.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    c = torch.empty(m, n, dtype=x.dtype, device=x.device)
    a_d = TensorDescriptor.from_tensor(x, [bm, bk])
    b_d = TensorDescriptor.from_tensor(w, [bk, bn])
    c_d = TensorDescriptor.from_tensor(c, [bm, bn])
    progs = triton.cdiv(m, bm) * triton.cdiv(n, bn)

    def run():
        bare_matmul[(progs,)](a_d, b_d, c_d, c, m, n, k, progs, BLOCK_M=bm, BLOCK_N=bn,
                              BLOCK_K=bk, GROUP_M=8, TMA_STORE=False, WARP_SPEC=False,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return c
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="256,4096,4096")
    ap.add_argument("--only", default="", help="comma list of CONFIGS keys (default: all)")
    ap.add_argument("--calls", type=int, default=0, help="eager calls of each afterwards")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--output", default="")
    ap.add_argument("--bare", action="store_true",
                    help="also each tile as a bare Triton matmul (benchmarks/probe_gemm_gap.py)")
    ap.add_argument("--jit", action="store_true",
                    help="also each tile through Triton's launcher (ROCMOE_NATIVE_LAUNCH=0)")
    a = ap.parse_args()
    import rocmoe
    from rocmoe import ops
    m, k, n = (int(v) for v in a.shape.split(","))
    ctx = rocmoe.init(heap_size=256 << 20)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    ref = torch.matmul(x, w)
    names = [s for s in a.only.split(",") if s] or list(CONFIGS)
    out = open(a.output, "a") if a.output else None
    cases = {"torch.matmul": lambda: torch.matmul(x, w)}
    handles = []
    for name in names:
        for launch in ("native", "jit") if a.jit else ("native",):
            os.environ["ROCMOE_GEMM_CONFIG"] = json.dumps(CONFIGS[name])
            os.environ["ROCMOE_NATIVE_LAUNCH"] = "0" if launch == "jit" else "1"
            h = ops.GemmAllToAll(ctx, m, k, n, torch.bfloat16)
            handles.append(h)
            with torch.no_grad():
                y = h(x, w, [m])[0][:m]  # the first call makes the launch (native or not)
            err = float((y.float() - ref.float()).norm() / ref.float().norm())
            key = name if launch == "native" else f"{name} jit"
            cases[key] = (lambda h=h: h(x, w, [m])[0])
            print(f"{key}: rel_err {err:.1e}", flush=True)
        if a.bare:
            cases[f"{name} bare"] = _bare(x, w, CONFIGS[name])
    os.environ.pop("ROCMOE_GEMM_CONFIG", None)
    os.environ.pop("ROCMOE_NATIVE_LAUNCH", None)
    with torch.no_grad():
        if not a.no_time:
            base = None
            for name, fn in cases.items():
                ms = graph_ms(fn)
                base = base or ms
                rec = dict(probe="skinny_gemm", shape=dict(m=m, k=k, n=n), case=name,
                           config=CONFIGS.get(name.replace(" bare", "").replace(" jit", "")),
                           graph_ms=round(ms, 5),
                           ratio_vs_torch=round(base / ms, 4),
                           device=torch.cuda.get_device_name())
                print(json.dumps(rec), flush=True)
                if out:
                    out.write(json.dumps(rec) + "\n")
        for name, fn in cases.items():
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
    for h in handles:
        h.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
