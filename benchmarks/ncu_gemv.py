"""The world-size-1 GEMV kernel next to torch.mv at the same shapes, for a profiler.

Why this exists: at 16384^2 and 28672 x 8192 bf16 our GEMV streams W at 4.23 TB/s against
torch.mv's 4.41, while at fp32 it reaches 4.42 TB/s on the same bytes
(results/fused_gpu_h200_sixteenth_session.jsonl). The bf16 loop issues 3.8x the
instructions a byte of the fp32 one (115 against 30 a warp's 2 KB of W, local sm_90 SASS:
64 of them unpack W and x), yet the two-rows-a-wave variant, which halves the x unpacks, was
not faster, and neither were 8 loads in flight. The warp-state and scheduler counters say
which it is: stalls on memory (long scoreboard) or issue (no eligible warp, math pipe).

    ncu --clock-control none --profile-from-start off --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct \\
        python3 benchmarks/ncu_gemv.py > gemv_ncu.csv
    python3 benchmarks/ncu_gemv.py --summarize gemv_ncu.csv

The ROCMOE_GEMV_* knobs (hip/src/gpu/fused_gemv.hip) are read once per process: profile a
variant with them set on the ncu command. Builds every shape's W and x, calls each op twice
to warm up, then runs each once between cudaProfilerStart/Stop and prints the launch order,
one label per profiled kernel, so the profiler's rows (in launch order) can be named.
Without a profiler it is a plain run (useful to check it works)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_ffn import profile_in_order, summarize  # noqa: E402  (the same run and reader)

# (N, K, dtype): the two bf16 shapes below torch.mv, and the fp32 control on the same bytes
SHAPES = [(16384, 16384, "bf16"), (28672, 8192, "bf16"), (28672, 8192, "fp32")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

FIELDS = [("Duration", "us", 1e-3), ("dram__bytes_read.sum", "DRAM rd MB", 1e-6),
          ("DRAM Throughput", "DRAM %", 1), ("Achieved Occupancy", "occup %", 1),
          ("Registers Per Thread", "regs", 1), ("Issue Slots Busy", "issue %", 1),
          ("No Eligible", "no elig %", 1), ("Eligible Warps Per Scheduler", "elig/sch", 1),
          ("Warp Cycles Per Issued Instruction", "cyc/instr", 1),
          ("Grid Size", "grid", 1), ("Block Size", "block", 1)]


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        for path in sys.argv[2:]:
            summarize(path, FIELDS)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}x{d}" for n, k, d in SHAPES),
                    help="comma list of NxKxDTYPE")
    args = ap.parse_args()
    import rocmoe
    from rocmoe import ops
    ctx = rocmoe.init(heap_size=1 << 30)
    if ctx.device.type != "cuda":
        sys.exit(f"ncu_gemv needs a GPU backend (got {ctx.backend})")
    order = []
    handles = []
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    for spec in args.shapes.split(","):
        n, k, dname = spec.split("x")
        n, k, dtype = int(n), int(k), DTYPES[dname]
        w = torch.randn(n, k, device=ctx.device, generator=gen).to(dtype)
        x = torch.randn(k, device=ctx.device, generator=gen).to(dtype)
        h = ops.GemvAllReduce(ctx, n, k, dtype)
        handles.append(h)
        order.append((f"rocmoe {n}x{k} {dname}", lambda h=h, w=w, x=x: h(w, x)))
        order.append((f"torch.mv {n}x{k} {dname}", lambda w=w, x=x: torch.mv(w, x)))
    knobs = {k: v for k, v in os.environ.items() if k.startswith("ROCMOE_GEMV_")}
    with torch.no_grad():
        profile_in_order(order, f"shapes {args.shapes}; knobs {knobs}")
    for h in handles:
        h.close()
    ctx.finalize()


if __name__ == "__main__":
    main()
