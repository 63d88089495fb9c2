"""The tiny-X GEMM handle next to torch.matmul, for a profiler: W cold and W warm in the L2.

Why this exists: under CUDA graphs the GemmAllToAll handle trails torch.matmul at 16 and 64
x 4096^2 (0.92-0.95 of it, results/fused_gpu_h100_fortysecond_session_full.jsonl), and only
where W (32 MB) stays in the H100's 50 MB L2 between replays
(results/probe_tiny_graph_h100_fortyfirst_session.jsonl). One suspect was the L2's
bandwidth: the handle's tiny-X tiles are 32 columns wide, so each of its 128 programs reads
all of X. These counters say what the L2 serves each kernel: bytes it sends to the SMs
(lts__t_sectors_srcunit_tex_op_read), all its read sectors, bytes read from DRAM, its busy
share, each kernel's duration, grid and cluster.

W cold (under ncu's default kernel replay every launch read all of W from DRAM, warm-up or
not; its save and restore of memory between passes is the likely cause):

    ncu --clock-control none --cache-control none --profile-from-start off --csv \\
        --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
    lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_op_read.sum,\\
    lts__t_sector_op_read_hit_rate.pct,lts__throughput.avg.pct_of_peak_sustained_elapsed,\\
    launch__grid_size,launch__cluster_dim_x \\
        python3 benchmarks/ncu_tiny_gemm.py > tiny_ncu.csv
    python3 benchmarks/ncu_tiny_gemm.py --summarize tiny_ncu.csv

W warm (the graph replays' case): the same with `--replay-mode application`, one shape a
run and its tile forced (ROCMOE_GEMM_CONFIG, the tuner's pick), so that every pass of the
program runs the same kernels; the second call of each pair finds W where the first left
it. Each op warms up, then runs twice between cudaProfilerStart/Stop (ncu_ffn.py's
profile_in_order, which prints the calls' labels in launch order). A profiled
call may run more than one kernel (cuBLAS's split-K GEMM runs a reduce after it): the
summary names each row by its call's label and the kernel's own name. Without a profiler
it is a plain run.

The forty-second session's H100 (results/ncu_tiny_gemm_h100_fortysecond_session.txt): with
W warm the handle's kernel took 39.3 MB from the L2 at 16 rows against cuBLAS's 34.6 (+ 0.5
for its reduce), 52.4 against 42.6 at 64, with the L2 42-55 % busy for both: not the L2's
bandwidth."""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(16, 4096, 4096), (64, 4096, 4096), (16, 8192, 8192)]
COLUMNS = [("gpu__time_duration.sum", "us"), ("dram__bytes_read.sum", "DRAM rd MB"),
           ("lts__t_sectors_srcunit_tex_op_read.sum", "L2->SM MB"),
           ("lts__t_sectors_op_read.sum", "L2 rd MB"),
           ("lts__t_sector_op_read_hit_rate.pct", "L2 hit %"),
           ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 busy %"),
           ("launch__grid_size", "grid"), ("launch__cluster_dim_x", "cluster")]
# a value in the unit ncu's units row gives, to the column's: times in us, bytes and 32-byte
# sectors in MB, anything else as it is
TO_COLUMN = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "sector": 32e-6}


def summarize(path: str) -> None:
    """A row per profiled kernel of the raw CSV, labelled from the "launch N: label" lines
    printed before it (kernels of one launch share its label)."""
    lines = open(path).read().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    labels = [line.split(": ", 1)[1] for line in lines[:head] if line.startswith("launch ")]
    rows = list(csv.DictReader(lines[head:]))
    units = next((r for r in rows if not r.get("ID", "").strip()), {})
    rows = [r for r in rows if r.get("ID", "").strip().isdigit()]
    print(f"{'launch':30}{'kernel':28}" + "".join(f"{t:>12}" for _, t in COLUMNS))
    label_at = -1
    for r in rows:
        # ncu's rows are the kernels in launch order; the one kernel that is not a launch
        # of its own is cuBLAS's split-K reduce, named by the launch that ran it
        name = r.get("Kernel Name", "?")
        if "splitKreduce" not in name:
            label_at += 1
        label = labels[label_at] if 0 <= label_at < len(labels) else "?"
        cells = []
        for metric, _ in COLUMNS:
            value = (r.get(metric) or "-").replace(",", "")
            try:
                cells.append(f"{float(value) * TO_COLUMN.get(units.get(metric, ''), 1.0):12.2f}")
            except ValueError:
                cells.append(f"{value[:11]:>12}")
        print(f"{label[:29]:30}{name[:27]:28}" + "".join(cells))


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        for path in sys.argv[2:]:
            summarize(path)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    args = ap.parse_args()
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.fused_gpu import random_gemm_inputs
    ctx = rocmoe.init(heap_size=1 << 30)
    from ncu_ffn import profile_in_order  # (benchmarks/, this script's folder)
    calls = []
    with torch.no_grad():
        for spec in args.shapes.split(","):
            m, k, n = (int(v) for v in spec.split("x"))
            x, w = random_gemm_inputs(m, k, n, ctx.device,
                                      torch.Generator(device=ctx.device).manual_seed(3))
            h = ops.GemmAllToAll(ctx, m, k, n, torch.bfloat16)
            h(x, w, [m])  # (tunes the rows class's tile)
            calls.append((f"handle {m}x{k}x{n}", lambda h=h, x=x, w=w, m=m: h(x, w, [m])))
            calls.append((f"torch {m}x{k}x{n}", lambda x=x, w=w: torch.matmul(x, w)))
        # each op twice in a row: the second call is the one whose W the first warmed
        profile_in_order([pair for label, fn in calls
                          for pair in ((f"{label} (first)", fn), (label, fn))],
                         f"shapes {args.shapes}")
    ctx.finalize()


if __name__ == "__main__":
    main()
