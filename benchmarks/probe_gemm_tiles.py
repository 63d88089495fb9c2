"""Tile configs the GEMM tuner does not try, against the one it keeps and torch.matmul.

Why: the thirty-second session's CUPTI traces (results/probe_prelaunch_trace_h100_
thirtysecond_session.jsonl) put the handles' remaining idle-start gap in the kernel itself:
at 512 x 4096^2 ours ran 26.1-26.6 us against cuBLAS's 22.9-23.0, whose kernel
(nvjet_sm90_tst_128x128_64x6_2x1) is a 128 x 128 tile with BLOCK_K 64 and 6 stages; the
tuner's 128 x 128 candidate has 4 stages and one warp group (gpu/gemm_plans.py,
_TUNE_CANDIDATES). At 2048^3 cuBLAS ran a 256 x 128 tile (nvjet_sm90_tst_256x128_64x4),
ours 128 x 256 (24.5 against 23.6 us).

For each shape, the tuned handle and then each config (ROCMOE_GEMM_CONFIG, which the
handle's plan reads when it is made and which skips the tuner) is timed idle-start, queued
and graph-replayed against torch.matmul (rocmoe.bench.fused_gpu.compare), its result
checked against torch's. One JSON line per (shape, config); a config that fails to build
or run gets its error instead.

    python3 benchmarks/probe_gemm_tiles.py [--shapes 512x4096x4096,2048x2048x2048]
        [--reps 9] [--configs JSON_LIST]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# per rows class: what cuBLAS ran and its neighbours (the 128 x 128 tile of up to 6 stages
# with one or two warp groups, a K step of 128); the 256 x 128 tile for the square shapes
SKINNY = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=6),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=6),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
]
SQUARE = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=16),
]


# what a line keeps of fused_gpu.compare's record
_KEPT = ("rocmoe_idle_ms", "baseline_idle_ms", "ratio_idle", "rocmoe_queued_ms",
         "baseline_queued_ms", "ratio_queued", "rocmoe_graph_ms", "baseline_graph_ms",
         "ratio_graph", "graph_error")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x4096x4096,2048x2048x2048")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--configs", default="", help="a JSON list of configs for every shape "
                    "(default: the 128 x 128 family up to 1024 rows, else the square family)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_gemm_tiles needs a GPU")
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.fused_gpu import compare, random_gemm_inputs
    ctx = rocmoe.init(backend="ipc", heap_size=2 << 30)
    dtype, dev = torch.bfloat16, ctx.device
    g = torch.Generator(device=dev).manual_seed(11)
    for shape in a.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x, w = random_gemm_inputs(m, k, n, dev, g, dtype)
        want = torch.matmul(x, w).float()
        configs = json.loads(a.configs) if a.configs else (SKINNY if m <= 1024 else SQUARE)
        for cfg in [None] + configs:
            rec = dict(probe="gemm_tiles", shape=dict(m=m, k=k, n=n),
                       device=torch.cuda.get_device_name(),
                       config="tuned" if cfg is None else cfg)
            os.environ.pop("ROCMOE_GEMM_CONFIG", None)
            if cfg is not None:
                os.environ["ROCMOE_GEMM_CONFIG"] = json.dumps(cfg)
            h = None
            try:
                h = ops.GemmAllToAll(ctx, m, k, n, dtype)
                with torch.no_grad():
                    out = h(x, w, [m])[0][:m].float()
                    rec["rel_err"] = float((out - want).norm() / want.norm())
                    if cfg is None:
                        rec["kept"] = (h.__dict__.get("_tuned") or {}).get("config")
                    ours = lambda: h(x, w, [m])  # noqa: E731
                    timed = compare(ours, lambda: torch.matmul(x, w), a.reps)
                rec.update({key: timed[key] for key in _KEPT if key in timed})
            except Exception as exc:  # noqa: BLE001 - a config that does not build is a result
                rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
            finally:
                if h is not None:
                    h.close()
                os.environ.pop("ROCMOE_GEMM_CONFIG", None)
            print(json.dumps(rec), flush=True)
    ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
