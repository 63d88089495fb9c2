"""The expert-parallel combine's product on one GPU: the grouped GemmAllToAll handle against
torch._grouped_mm and gpu.grouped_local on the same rows, and (at a9f822f only) the same
kernel reading a device task table.

Why this exists: the fused combine of the expert-parallel step is one grouped GemmAllToAll
call a layer: Y = H @ W2[g] for each local expert's rows, each tile stored straight into
the rank its rows came from. Its kernel (gemm_a2a_kernel) finds each tile's segment from
the [world, G] counts with a dozen reductions per tile. The twentieth session left open
whether that per-tile plan costs what it cost the local grouped products (9-13 % against a
table read, results/probe_grouped_persistent_h200_nineteenth_session.jsonl). The twenty-
first session tried the table (exchange_plan_kernel wrote every tile's record on the device
before the kernel, which loaded one record a tile) and timed it with this probe at a9f822f
(then benchmarks/probe_exchange_table.py, with `ROCMOE_GEMM_TABLE` on and off;
results/probe_exchange_table_h200_twentyfirst_session.jsonl): against the per-tile plan
the table ran 2.3-6.3 % slower idle-start, -0.4 to +3.3 % queued and +0.6 to +2.6 % replayed
from graphs on the four products (a record is a dependent global load ahead of each tile's
first TMA load, and the table one more launch; the plan is register arithmetic on counts
loaded once), so it was reverted. On one GPU the handle runs in local mode (world size 1:
no exchange, the same tiles and plan), on the rows one rank of the 2-GPU Zipf step receives
(benchmarks/probe_ep_ffn.py's rank0_counts).

    python3 benchmarks/probe_combine_product.py [--shapes T,H,F,E;...] [--reps 10]
    python3 benchmarks/probe_combine_product.py --device cpu --shapes 64,32,48,8  # dry run

One JSON line per shape, product and case: ms (median of interleaved rounds, each from an
idle GPU), queued_ms (behind an untimed call), graph_ms (replayed from a CUDA graph),
host_us (a call's host time: rocmoe.bench.timing.host_ms_per_call), TFLOP/s and the relative error against
the segment products in fp32. The products: W2 (the combine's, K = ffn, N = hidden) and W1
(K = hidden, N = ffn)."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (benchmarks/ is on sys.path; probe_ep_ffn puts the repository there too)
from probe_ep_ffn import SHAPES, rank0_counts  # noqa: E402
from probe_grouped_persistent import reference  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--world", type=int, default=2, help="the step's ranks (the rows' share)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run on the host backend (Triton's interpreter)")
    a = ap.parse_args(argv)
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.timing import captured, host_ms_per_call, interleaved_ms, time_ms
    from rocmoe.ops import gpu
    dev = torch.device(a.device)
    # bf16 on the GPU; the interpreter computes bf16 dots wrongly (Triton 3.9), so fp32
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx = rocmoe.init(backend="ipc" if dev.type == "cuda" else "host", heap_size=1 << 31)
    status = torch.zeros(64, dtype=torch.int32, device=dev)
    for spec in a.shapes.split(";"):
        t, h, f, e = (int(v) for v in spec.split(","))
        counts = rank0_counts(t, e, a.world)
        groups, rows = counts.numel(), int(counts.sum())
        gen = torch.Generator(device=dev).manual_seed(0)
        for pname, k, n in (("W2", f, h), ("W1", h, f)):
            x = (torch.randn(rows, k, device=dev, generator=gen) * 0.5).to(dtype)
            w = (torch.randn(groups, k, n, device=dev, generator=gen) / k ** 0.5).to(dtype)
            dev_counts = counts.to(dev).view(1, groups)
            want = reference(x, w, counts.view(1, groups))
            handle = ops.GemmAllToAll(ctx, max_rows=rows, K=k, N=n, dtype=dtype, groups=groups)
            if dev.type == "cpu":
                handle._engine = "triton"
            cases = {"GemmAllToAll handle": lambda: handle(x, w, dev_counts)[0][:rows]}
            cases["gpu.grouped_local"] = lambda: gpu.grouped_local(x, w, dev_counts,
                                                                   status.data_ptr())
            if dev.type == "cuda":
                offs = torch.cumsum(counts.to(dev), 0).to(torch.int32)
                cases["torch._grouped_mm"] = lambda offs=offs: torch._grouped_mm(x, w, offs=offs)
            errs = {}
            with torch.no_grad():
                for label, fn in cases.items():
                    got = fn().float()
                    errs[label] = float((got - want).norm() / want.norm())
                ms, queued, graph, host_us = {}, {}, {}, {}
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    timed = {label: (lambda: None, fn) for label, fn in cases.items()}
                    ms = interleaved_ms(timed, rounds=a.reps, calls=2)
                    queued = interleaved_ms(timed, rounds=a.reps, calls=2, queued=True)
                    for label, fn in cases.items():
                        graph[label] = time_ms(captured(fn), reps=a.reps)
                        host_us[label] = host_ms_per_call(fn) * 1e3
            flops = 2 * rows * k * n
            for label, err in errs.items():
                rec = dict(probe="combine_product", shape=dict(tokens_per_rank=t, hidden=h, ffn=f,
                                                              experts=e, local_experts=groups,
                                                              rows=rows),
                           product=pname, case=label, rel_err=err)
                if label in ms:
                    rec.update(ms=round(ms[label], 4), queued_ms=round(queued[label], 4),
                               graph_ms=round(graph[label], 4), host_us=round(host_us[label], 1),
                               tflops=round(flops / ms[label] / 1e9, 1))
                print(json.dumps(rec), flush=True)
            handle.close()


if __name__ == "__main__":
    main()
