"""The expert FFN's kernels next to cuBLAS bmm doing the same products, for a profiler.

    ncu --clock-control none --profile-from-start off --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,\\
lts__t_sector_hit_rate.pct python3 benchmarks/ncu_ffn.py 8192,1024,4096,64

Builds one shape's FFN inputs (top-2, uniform routing), warms every kernel up, then runs each
once between cudaProfilerStart/Stop: first rocmoe's six fused-FFN kernels (the layer's
act_fusion="store" path) plus the plain forward SDD (one store, no activation: the
epilogue's cost by difference), then the six cuBLAS bmm products of the same FFN with every
expert given exactly T*k/E rows (the ceiling of ``rocmoe bench moe``). It prints the launch
order, one label per profiled kernel, so the profiler's rows (in launch order) can be named.
Without a profiler it is a plain run (useful to check it works).

    python3 benchmarks/ncu_ffn.py --summarize NCU.csv [NCU.csv ...]

prints one row per profiled kernel (named from the launch order the run printed above the
CSV) with the counters that place it: duration, DRAM bytes, L2 hit rate and throughput, SM
throughput, occupancy, registers, grid, block and cluster size.
"""

import argparse
import csv
import sys

import torch

from rocmoe.bench.moe import expert_inputs, kernel_calls, make_routing
from rocmoe.moe import blocksparse as bs
from rocmoe.moe import route_and_permute

OURS = ("sdd_fwd", "sdd_fwd_store_gelu", "dsd_fwd", "sdd_bwd_scale", "dstd_dw2", "dsd_dx",
        "dstd_dw1")


SUMMARY = [("Duration", "us", 1e-3), ("dram__bytes_read.sum", "DRAM rd MB", 1e-6),
           ("dram__bytes_write.sum", "DRAM wr MB", 1e-6), ("lts__t_sector_hit_rate.pct", "L2 hit %", 1),
           ("L2 Cache Throughput", "L2 thr %", 1), ("Compute (SM) Throughput", "SM thr %", 1),
           ("Achieved Occupancy", "occup %", 1), ("Registers Per Thread", "regs", 1),
           ("Grid Size", "grid", 1), ("Block Size", "block", 1), ("Cluster Size", "cluster", 1)]


def summarize(path: str, fields=SUMMARY) -> None:
    """One row per profiled kernel of an ncu CSV (--page details), named from the "launch N:
    label" lines printed above it; `fields`: (metric, column title, scale) triples."""
    lines = open(path).read().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    labels = [line.split(": ", 1)[1] for line in lines[:head] if line.startswith("launch ")]
    print(next((line for line in lines[:head] if line.startswith("shape")), path))
    kernels: dict = {}
    for row in csv.DictReader(lines[head:]):
        kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})[row["Metric Name"]] = \
            row["Metric Value"]
    print(f"{'kernel':36}" + "".join(f"{title:>12}" for _, title, _ in fields))
    for i, metrics in enumerate(kernels.values()):
        label = labels[i] if i < len(labels) else "?"
        cells = []
        for metric, _, scale in fields:
            value = metrics.get(metric, "-").replace(",", "")
            try:
                cells.append(f"{float(value) * scale:12.1f}" if scale != 1 or "." in value
                             else f"{value:>12}")
            except ValueError:
                cells.append(f"{value[:11]:>12}")
        print(f"{label[:20] + ' ' + metrics['name'][:15]:36}" + "".join(cells))
    print()


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        for path in sys.argv[2:]:
            summarize(path)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8192,1024,4096,64")
    ap.add_argument("--top-k", type=int, default=2)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    tokens, hidden, ffn, experts = shape
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, _ = make_routing(tokens, experts, args.top_k, "uniform", device, dtype, gen)
    with torch.no_grad():
        _, topo, x_perm = route_and_permute(x, ids, experts, 128, ffn)
        grad = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)
        calls = kernel_calls(bs, topo, x_perm, w1, w2, grad)
        rows = -(-tokens * args.top_k // experts)
        xb = torch.randn(experts, rows, hidden, device=device, dtype=dtype, generator=gen)
        hb = torch.randn(experts, rows, ffn, device=device, dtype=dtype, generator=gen)
        gb = torch.randn(experts, rows, hidden, device=device, dtype=dtype, generator=gen)
        w1d, w2d = w1.detach(), w2.detach()
        bmm = {
            "bmm_fwd1 (x W1)": lambda: torch.bmm(xb, w1d),
            "bmm_fwd2 (h W2)": lambda: torch.bmm(hb, w2d),
            "bmm_bwd_dh (g W2^T)": lambda: torch.bmm(gb, w2d.transpose(1, 2)),
            "bmm_dw2 (h^T g)": lambda: torch.bmm(hb.transpose(1, 2), gb),
            "bmm_dx (dh W1^T)": lambda: torch.bmm(hb, w1d.transpose(1, 2)),
            "bmm_dw1 (x^T dh)": lambda: torch.bmm(xb.transpose(1, 2), hb),
        }
        order = [(name, calls[name]) for name in OURS] + list(bmm.items())
        profile_in_order(order, f"shape {shape} top_k {args.top_k} rows {topo.num_rows} "
                                f"(balanced bmm: {rows} per expert)")


def profile_in_order(order, header: str) -> None:
    """Warm every (label, fn) of `order` up (two calls each), print `header` (summarize's
    title line), then run each once between cudaProfilerStart/Stop, printing "launch N:
    label" in launch order: the profiler's rows, in that order, are named from these lines."""
    for _, fn in order:  # compile and warm up
        fn()
        fn()
    torch.cuda.synchronize()
    print(header)
    torch.cuda.profiler.start()
    for i, (name, fn) in enumerate(order):
        fn()
        print(f"launch {i}: {name}")
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
