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

* ``grouped_local``: the shipped kernel (in the nineteenth session's results file
  gemm_a2a_kernel in local mode; since then grouped_tiles_kernel, this probe's ``table
  flat`` case at the platform's tile, made the default from these results);
* ``table``: a tiny plan kernel writes each task's (first row, rows, group, column tile)
  into a device table (no host sync: the count of tasks stays on the device), and the
  GEMM's persistent programs read one record a task;
* ``table flat``: the same with the task loop flattened into the K loop
  (``tl.range(..., flatten=True)``), so the next tile's loads are issued while this one's
  epilogue runs (Triton's own persistent matmul does this on Hopper);
* ``torch._grouped_mm`` (group-major rows only: it takes no source-major segments).

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
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from probe_ep_ffn import SHAPES, rank0_counts  # noqa: E402  (benchmarks/ is on sys.path)


@triton.jit
def plan_kernel(counts_ptr, table_ptr, total_ptr, max_tasks, segments, groups, n_tiles,
                SEGS_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                GROUP_M: tl.constexpr):
    # counts [segments] int64, segment s = source * groups + group, rows in that order.
    # Task t's record: (first row of X, rows of the tile that are the segment's, group,
    # column tile); tasks in segment order, inside a segment GROUP_M row tiles a column
    segs = tl.arange(0, SEGS_P2)
    c = tl.load(counts_ptr + segs, mask=segs < segments, other=0).to(tl.int32)
    tiles = tl.cdiv(c, BLOCK_M) * n_tiles
    tile_end = tl.cumsum(tiles, 0)
    row_first = tl.cumsum(c, 0) - c
    total = tl.minimum(tl.sum(tiles, 0), max_tasks)
    if tl.program_id(0) == 0:
        tl.store(total_ptr, total)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    seg = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
    hot = seg[:, None] == segs[None, :]
    first_tile = tl.sum(tl.where(hot, (tile_end - tiles)[None, :], 0), axis=1)
    rows = tl.sum(tl.where(hot, c[None, :], 0), axis=1)
    row0 = tl.sum(tl.where(hot, row_first[None, :], 0), axis=1)
    in_seg = t - first_tile
    m_tiles = tl.cdiv(rows, BLOCK_M)
    in_group = GROUP_M * n_tiles
    group_first = (in_seg // in_group) * GROUP_M
    group_rows = tl.maximum(tl.minimum(m_tiles - group_first, GROUP_M), 1)
    m_tile = group_first + (in_seg % in_group) % group_rows
    n_tile = (in_seg % in_group) // group_rows
    ok = t < total
    rec = table_ptr + t.to(tl.int64) * 4
    tl.store(rec, row0 + m_tile * BLOCK_M, mask=ok)
    tl.store(rec + 1, tl.minimum(rows - m_tile * BLOCK_M, BLOCK_M), mask=ok)
    tl.store(rec + 2, seg % groups, mask=ok)
    tl.store(rec + 3, n_tile, mask=ok)


@triton.jit
def table_gemm_kernel(x_desc, w_desc, out_ptr, table_ptr, total_ptr, N, K, W_ROWS, nprog,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      FLATTEN: tl.constexpr, TRANS_W: tl.constexpr, EVEN_N: tl.constexpr):
    # out[rows of task] = X[rows] @ B[g], B[g] = W[g] ([K, N] as W_ROWS = K rows of the
    # [G * K, N] descriptor) or, TRANS_W, W[g]^T (W [G, N, K] as a [G * N, K] descriptor,
    # boxes [BLOCK_N, BLOCK_K] turned in registers). Rows past the tile's own are computed
    # from whatever X holds there and never stored
    total = tl.load(total_ptr)
    k_tiles = tl.cdiv(K, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    for task in tl.range(tl.program_id(0), total, nprog, flatten=FLATTEN):
        rec = table_ptr + task * 4  # under 2^31 words
        row0 = tl.load(rec)
        rows = tl.load(rec + 1)
        g = tl.load(rec + 2)
        n_tile = tl.load(rec + 3)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([row0, ki * BLOCK_K])
            if TRANS_W:
                b = w_desc.load([g * W_ROWS + n_tile * BLOCK_N, ki * BLOCK_K]).T
            else:
                b = w_desc.load([g * W_ROWS + ki * BLOCK_K, n_tile * BLOCK_N])
            acc = tl.dot(a, b, acc)
        out = out_ptr + (row0.to(tl.int64) + rm[:, None]) * N + n_tile * BLOCK_N + rn[None, :]
        if EVEN_N:
            mask = rm[:, None] < rows
        else:  # a box past N reads zeros or (TRANS_W) the next group's rows: not stored
            mask = (rm[:, None] < rows) & (rn[None, :] < N - n_tile * BLOCK_N)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def table_gemm(x, w, counts, cfg, flatten, trans_w=False, table=None, out=None):
    """X [M, K] times W [G, K, N] (trans_w: W [G, N, K], used transposed) per segment of
    `counts` [sources, G] (source-major rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    g = w.shape[0]
    n = w.shape[1] if trans_w else w.shape[2]
    k = x.shape[1]
    segments = counts.numel()
    n_tiles = math.ceil(n / bn)
    max_tasks = (math.ceil(x.shape[0] / bm) + segments) * n_tiles
    dev = x.device
    if table is None:
        table = torch.empty(max_tasks * 4 + 4, dtype=torch.int32, device=dev)
    total = table[-1:]
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=dev)
    block_t = 128
    plan_kernel[(math.ceil(max_tasks / block_t),)](
        counts, table, total, max_tasks, segments, g, n_tiles,
        SEGS_P2=max(2, 1 << (segments - 1).bit_length()), BLOCK_T=block_t, BLOCK_M=bm,
        GROUP_M=cfg.get("GROUP_M", 8))
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk])
    w2 = w.reshape(-1, w.shape[-1])
    w_desc = TensorDescriptor(w2, list(w2.shape), list(w2.stride()),
                              [bn, bk] if trans_w else [bk, bn])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    nprog = min(max_tasks, sms * cfg.get("PER_SM", 1))
    opts = {} if dev.type == "cpu" else dict(num_warps=cfg["num_warps"],
                                              num_stages=cfg["num_stages"])
    table_gemm_kernel[(nprog,)](x_desc, w_desc, out, table, total, n, k, w.shape[1], nprog,
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FLATTEN=flatten,
                                TRANS_W=trans_w, EVEN_N=n % bn == 0, **opts)
    return out


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
    import rocmoe
    from rocmoe.ops import gpu
    from rocmoe.bench.timing import interleaved_ms
    ctx = rocmoe.init(backend="ipc" if dev.type == "cuda" else "host", heap_size=1 << 28)
    team = gpu.team_for(ctx) if dev.type == "cuda" else None
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
            # (the CPU dry run has no team: grouped_local reads none for 2-D counts)
            cases = {"grouped_local": lambda xin=xin, wt=wt, c=cts_dev: gpu.grouped_local(
                team, xin, wt, c, wt.shape[0], xin.shape[0], status.data_ptr())}
            given = torch.empty(xin.shape[0], wt.shape[2], dtype=xin.dtype, device=dev)
            cases["grouped_local, out given"] = \
                lambda xin=xin, wt=wt, c=cts_dev, o=given: gpu.grouped_local(
                    team, xin, wt, c, wt.shape[0], xin.shape[0], status.data_ptr(), out=o)
            for cfg, flat in itertools.product(configs, (False, True)):
                # no ragged column tile, as grouped_local (gpu.even_block_n)
                cfg = dict(cfg, BLOCK_N=gpu.even_block_n(wt.shape[2], cfg["BLOCK_N"]))
                label = ("table flat " if flat else "table ") + "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} " \
                    "w{num_warps} s{num_stages}".format(**cfg)
                table = torch.empty((math.ceil(rows / cfg["BLOCK_M"]) + cts.numel())
                                    * math.ceil(wt.shape[2] / cfg["BLOCK_N"]) * 4 + 4,
                                    dtype=torch.int32, device=dev)
                cases[label] = (lambda xin=xin, w=w, c=cts_dev, cfg=cfg, flat=flat, tr=tr,
                                table=table: table_gemm(xin, w, c, cfg, flat, tr, table))
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


if __name__ == "__main__":
    main()
