"""Does a per-call tile table and a flattened persistent loop close the grouped GEMM's gap to
torch._grouped_mm? (the expert-parallel step's local products, on one GPU)

Why this exists: on the rows one rank of the 2-GPU Zipf step receives, the project's grouped
kernel (gpu.grouped_local, then gemm_a2a_kernel in local mode) ran its products 4-21 % behind
torch._grouped_mm on the same group-major rows (results/probe_ep_ffn_h200_eighteenth_session_
dw.jsonl: 0.509 against 0.420 ms at K 1024, N 4096; 0.613 / 0.561 at K 4096, N 1408). The gap
fits a fixed cost of about 3 us a tile that nothing overlaps: every task of that kernel
first finds its segment with a dozen reductions over the counts (the plan), then waits for
its first loads, and stores its tile before the next task's loads start. CUTLASS's
persistent kernels overlap all three. This probe times, on the same rows:

* ``grouped_local``: the shipped kernel, with its output made inside and with it given;
* ``table``: grouped_local under ``ROCMOE_GROUPED_CONFIG`` tile configs, not flattened: a
  tiny plan kernel writes each task's (first row, rows, group, column tile) into a device
  table (no host sync: the count of tasks stays on the device), and the GEMM's persistent
  programs read one record a task;
* ``table flat``: the same with the task loop flattened into the K loop
  (``tl.range(..., flatten=True)``, with TMA loads only), so the next tile's loads are
  issued while this one's epilogue runs (Triton's own persistent matmul does this on
  Hopper);
* ``torch._grouped_mm`` (group-major rows only: it takes no source-major segments).

The nineteenth session's first results file (``..._nineteenth_session.jsonl``) was made
when ``grouped_local`` was still gemm_a2a_kernel in local mode and ``table`` / ``table
flat`` were this probe's own copies of the kernels; those became grouped_plan_kernel and
grouped_tiles_kernel (same sm_90 code), which the table cases time since.

Rows come group-major (one source: what torch._grouped_mm takes) and source-major from two
sources (what the step's dispatch delivers: each expert's rows split between the sources,
so twice the segments and twice the ragged last tiles).

    python3 benchmarks/probe_grouped_persistent.py [--shapes T,H,F,E;...] [--reps 10]
    TRITON_INTERPRET=1 python3 benchmarks/probe_grouped_persistent.py --device cpu  # dry run

One JSON line per shape, product and case: ms (median of interleaved rounds, each from an
idle GPU: the host's work before the first kernel counts), queued_ms (behind an untimed
call), host_us (a call's host time with the GPU kept busy), TFLOP/s and the relative error
against torch's product of the same rows."""

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from probe_ep_ffn import SHAPES, rank0_counts  # noqa: E402  (benchmarks/ is on sys.path)


def reference(x, w, counts, trans_w=False):
    """The products by segment in fp32 (counts [sources, G], rows source-major)."""
    out = torch.empty(x.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=torch.float32,
                      device=x.device)
    at = 0
    for s, gi in itertools.product(range(counts.shape[0]), range(counts.shape[1])):
        c = int(counts[s, gi])
        b = w[gi].float().t() if trans_w else w[gi].float()
        out[at:at + c] = x[at:at + c].float() @ b
        at += c
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--configs", default="128,256,64,8,3;128,256,64,8,4;128,128,64,4,4",
                    help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages;...")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    configs = [dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
                        map(int, c.split(",")))) for c in a.configs.split(";")]
    dtype = torch.bfloat16
    if dev.type == "cpu":
        configs = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)]
        dtype = torch.float16  # Triton 3.9's interpreter misreads bf16 through descriptors
    from rocmoe.ops import gpu  # grouped_local needs no rocmoe context
    from rocmoe.bench.timing import interleaved_ms
    for spec in a.shapes.split(";"):
        t, h, f, e = (int(v) for v in spec.split(","))
        counts = rank0_counts(t, e, a.world)
        local, rows = counts.numel(), int(counts.sum())
        gen = torch.Generator(device=dev).manual_seed(0)
        dt = dtype
        x = (torch.randn(rows, h, device=dev, generator=gen) * 0.5).to(dt)
        hm = (torch.randn(rows, f, device=dev, generator=gen) * 0.5).to(dt)
        w1 = (torch.randn(local, h, f, device=dev, generator=gen) / h ** 0.5).to(dt)
        w2 = (torch.randn(local, f, h, device=dev, generator=gen) / f ** 0.5).to(dt)
        layouts = {"group-major": counts.view(1, -1),
                   "source-major x2": torch.stack([counts // 2, counts - counts // 2])}
        # (product, X, W, transposed): the forward's two and the backward's two dX
        products = [("W1", x, w1, False), ("W2", hm, w2, False),
                    ("dX through W2^T", x, w2, True), ("dX through W1^T", hm, w1, True)]
        status = torch.zeros(64, dtype=torch.int32, device=dev)
        for (pname, xin, w, tr), (lname, cts) in itertools.product(products, layouts.items()):
            cts_dev = cts.to(dev).contiguous()
            want = reference(xin, w, cts, tr)
            wt = w.transpose(1, 2) if tr else w
            def shipped(xin=xin, wt=wt, c=cts_dev, override=None, out=None):
                if override is None:
                    os.environ.pop("ROCMOE_GROUPED_CONFIG", None)
                else:
                    os.environ["ROCMOE_GROUPED_CONFIG"] = override
                return gpu.grouped_local(xin, wt, c, status.data_ptr(), out=out)
            given = torch.empty(xin.shape[0], wt.shape[2], dtype=xin.dtype, device=dev)
            cases = {"grouped_local": shipped,
                     "grouped_local, out given": lambda shipped=shipped, o=given: shipped(out=o)}
            for cfg, flat in itertools.product(configs, (False, True)):
                # no ragged column tile, as grouped_local (gpu.even_block_n)
                cfg = dict(cfg, BLOCK_N=gpu.even_block_n(wt.shape[2], cfg["BLOCK_N"]),
                           FLATTEN=flat)
                label = ("table flat " if flat else "table ") + "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} " \
                    "w{num_warps} s{num_stages}".format(**cfg)
                cases[label] = lambda shipped=shipped, o=json.dumps(cfg): shipped(override=o)
            if lname == "group-major" and dev.type == "cuda":
                offs = torch.cumsum(counts.to(dev), 0).to(torch.int32)
                cases["torch._grouped_mm"] = lambda xin=xin, wt=wt, offs=offs: \
                    torch._grouped_mm(xin, wt, offs=offs)
            errs = {}
            for k2, fn in list(cases.items()):
                try:
                    got = fn().float()
                    errs[k2] = float((got - want).norm() / want.norm())
                except Exception as exc:  # noqa: BLE001 - a case that fails is a result
                    errs[k2] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    del cases[k2]
            ms, queued, host_us = {}, {}, {}
            if dev.type == "cuda":
                torch.cuda.synchronize()
                with torch.no_grad():
                    timed = {k2: (lambda: None, fn) for k2, fn in cases.items()}
                    ms = interleaved_ms(timed, rounds=a.reps, calls=2)
                    queued = interleaved_ms(timed, rounds=a.reps, calls=2, queued=True)
                    for k2, fn in cases.items():  # host time a call, the GPU kept busy
                        fn()
                        t0 = time.perf_counter()
                        for _ in range(10):
                            fn()
                        host_us[k2] = (time.perf_counter() - t0) * 1e5
                        torch.cuda.synchronize()
            flops = 2 * rows * xin.shape[1] * wt.shape[2]
            for k2, err in errs.items():
                rec = dict(probe="grouped_persistent", shape=dict(tokens_per_rank=t, hidden=h,
                                                                  ffn=f, experts=e),
                           product=pname, rows=lname, case=k2, rel_err=err)
                if k2 in ms:
                    rec.update(ms=round(ms[k2], 4), tflops=round(flops / ms[k2] / 1e9, 1),
                               queued_ms=round(queued[k2], 4), host_us=round(host_us[k2], 1))
                print(json.dumps(rec), flush=True)
    os.environ.pop("ROCMOE_GROUPED_CONFIG", None)


if __name__ == "__main__":
    main()
