"""Why do tiny-X GEMMs (16 or 64 rows times 4096 x 4096) lose to cuBLAS only when replayed
from a CUDA graph? A probe for issue 14's last skinny-GEMM misses.

The thirty-ninth session's bench (results/fused_gpu_h100_thirtyninth_session_full.jsonl)
had the handle at 16 x 4096^2 ahead of torch.matmul idle-start (1.053) and queued (1.158)
but behind it under graph replay (0.784: 13.1 against 10.3 us), and the same pattern at 64
rows (1.08 queued, 0.91 graph), while at 16 x 8192^2 the two tie in every mode. Each
graph replay there is one captured call, launched back to back.

This probe separates three suspects, per shape:

* what a replay runs: every GPU op of one captured call (torch.profiler, CUPTI), its
  duration, and the period from one replay's first op to the next one's;
* the L2: W is 32 MB at 4096^2 (it fits the H100's 50 MB L2, at 8192^2 it does not), so
  back-to-back replays may find part of W still cached. The same call is traced with a
  128 MB fill before it in the graph (W evicted), its kernel's duration reported apart;
* the kernel's shape: bare Triton kernels (no plan, no protocol) in the handle's
  orientation (X tile times W tile, mma of 16 rows) and swapped (W tile^T times X tile^T,
  so W's columns are the wgmma's 64-row side), with BLOCK_N from 32 (64 contiguous bytes of
  each W row per program) up to 256 and split K to keep every SM busy.

    python3 benchmarks/probe_tiny_graph.py [--shapes 16x4096x4096,...] [--variants ...]
        --output probe.jsonl

A variant is o|s (orientation, swapped), then BMxBNxBK, then w<warps>s<stages>k<splits>,
e.g. o16x32x256w4s4k1 or s16x128x128w4s4k4; `oc...` stores the rows of a count read from
memory after the K loop (as the handle's direct path does), `oe...` the same count read
before the loop (orientation o only); a `z` there (`oz...`, `ocz...`) starts each
program's K loop at its own step, so that the programs do not all read one slice of X at
once (H100, forty-sixth session: 15.86 us a replay against 10.75 for the plain loop at
64 x 4096^2, results/probe_tiny_graph_rot64_h100_fortysixth_session.jsonl; a loss). Split
K > 1: fp32 partial tiles, summed by
torch after the kernel (its own op in the trace). A last letter sums them in a Triton kernel
of this file instead: `r` launched plainly, `p` with programmatic dependent launch (PDL:
the sum's programs start while the product's run, the product's programs let them launch
at their start, and the sum waits at griddepcontrol.wait for the product's stores), as
cuBLAS's split-K GEMM runs its reduce after its main kernel. Each case also records
`host_us`, the host's wall time a call with the GPU busy (as rocmoe.bench.fused_gpu's): the
bare variants' include Triton's Python launcher, so compare them with each other (`p`
against `r`: the host's cost of a PDL launch), not with the handle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import triton
import triton.language as tl
try:  # Triton's grid dependency control (Hopper's programmatic dependent launch)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the `p` variants fail to build, reported per case
    gdc_launch_dependents = gdc_wait = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rocmoe.bench.timing import captured, interleaved_ms  # noqa: E402


@triton.jit
def tiny_kernel(x_desc, w_desc, c_ptr, part_ptr, count_ptr, M, N, K, tiles_n, k_per_split,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SWAP: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                PDL: tl.constexpr = False, COUNT: tl.constexpr = 0, ROT: tl.constexpr = False):
    # COUNT 1: the rows stored are a count read from memory after the K loop (as the
    # handle's DIRECT path reads its count), 2: the same count read before the loop
    if PDL:
        # let the sum's programs launch now; they wait for this grid's stores
        gdc_launch_dependents()
    rows = M
    if COUNT == 2:
        rows = tl.minimum(tl.load(count_ptr), M)
    pid = tl.program_id(0)
    split = pid % SPLIT
    tile = pid // SPLIT
    pn = tile % tiles_n
    pm = tile // tiles_n
    k_lo = split * k_per_split
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(k_lo, k_lo + k_per_split, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([pm * BLOCK_M, k])
            b = w_desc.load([k, pn * BLOCK_N])
            acc = tl.dot(b.T, a.T, acc)
        offs = rm[None, :].to(tl.int64) * N + rn[:, None]
        mask = rm[None, :] < M
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ROT:
            # each program starts its K loop at its own step (pn mod steps), so the 128
            # programs read 16 different slices of X at a time, not one slice all at once
            steps = k_per_split // BLOCK_K
            for i in tl.range(0, steps, num_stages=STAGES):
                k = k_lo + ((i + pn) % steps) * BLOCK_K
                a = x_desc.load([pm * BLOCK_M, k])
                b = w_desc.load([k, pn * BLOCK_N])
                acc = tl.dot(a, b, acc)
        else:
            for k in tl.range(k_lo, k_lo + k_per_split, BLOCK_K, num_stages=STAGES):
                a = x_desc.load([pm * BLOCK_M, k])
                b = w_desc.load([k, pn * BLOCK_N])
                acc = tl.dot(a, b, acc)
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        if COUNT == 1:
            rows = tl.minimum(tl.load(count_ptr), M)
        mask = rm[:, None] < rows
    if SPLIT == 1:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split.to(tl.int64) * M * N + offs, acc, mask=mask)


@triton.jit
def split_sum_kernel(part_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    # c = sum of the SPLIT fp32 partials [SPLIT, M, N], in split order, as c's dtype
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, cache_modifier=".cg")
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def parse_variant(text: str) -> dict:
    reduce = text[-1] if text[-1] in "rp" else ""
    text_all = text
    text = text[:-1] if reduce else text
    kind, rest = text[0], text[1:]
    count = {"c": 1, "e": 2}.get(rest[0], 0)  # the stored rows read from memory (tiny_kernel)
    rest = rest[1:] if count else rest
    rot = rest[0] == "z"  # each program's K loop starts at its own step (orientation o)
    rest = rest[1:] if rot else rest
    dims, rest = rest.split("w")
    warps, rest = rest.split("s")
    stages, splits = rest.split("k")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    return dict(name=text_all, reduce=reduce, count=count, rot=rot, swap=kind == "s", BM=bm, BN=bn, BK=bk, warps=int(warps),
                stages=int(stages), split=int(splits))


def bare_call(v: dict, x: torch.Tensor, w: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = x.shape
    n = w.shape[1]
    x_desc = TensorDescriptor.from_tensor(x, [v["BM"], v["BK"]])
    w_desc = TensorDescriptor.from_tensor(w, [v["BK"], v["BN"]])
    c = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(v["split"], m, n, device=x.device, dtype=torch.float32) \
        if v["split"] > 1 else c
    tiles_n = triton.cdiv(n, v["BN"])
    grid = (triton.cdiv(m, v["BM"]) * tiles_n * v["split"],)
    k_per = k // v["split"]

    pdl = v.get("reduce") == "p"
    count = torch.full((1,), m, dtype=torch.int64, device=x.device)
    sum_block = 512
    sum_grid = (triton.cdiv(m * n, sum_block),)

    def call():
        tiny_kernel[grid](x_desc, w_desc, c, parts, count, m, n, k, tiles_n, k_per,
                          BLOCK_M=v["BM"], BLOCK_N=v["BN"], BLOCK_K=v["BK"], SWAP=v["swap"],
                          SPLIT=v["split"], STAGES=v["stages"], PDL=pdl,
                          COUNT=v.get("count", 0), ROT=v.get("rot", False),
                          num_warps=v["warps"])
        if v["split"] > 1:
            if v.get("reduce"):
                split_sum_kernel[sum_grid](parts, c, m * n, SPLIT=v["split"], BLOCK=sum_block,
                                           PDL=pdl, num_warps=4,
                                           **(dict(launch_pdl=True) if pdl else {}))
            else:
                torch.sum(parts, 0, out=c)
        return c
    return call


def replay_us(replay, replays: int = 20, rounds: int = 7) -> float:
    """Median us per replay of `replays` back-to-back replays behind an untimed one (the
    GPU busy when the first timed replay is launched)."""
    return interleaved_ms({0: (lambda: None, replay)}, rounds=rounds, calls=replays,
                          queued=True)[0] * 1e3


def traced(replay, replays: int = 30) -> list:
    """The GPU ops of `replays` back-to-back replays (behind a sleep): (name, start, dur) in
    us, in start order, from a CUPTI trace."""
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(2_000_000)
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    ops = [(e["name"], e["ts"], e["dur"]) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops.sort(key=lambda o: o[1])
    # leave out the sleep (first op)
    return [o for o in ops if "sleep" not in o[0].lower()]


def summarize(ops: list, per_replay: int, skip_names=()) -> dict:
    """Per op name: median duration; the median period between the starts of consecutive
    replays (per_replay ops each); the median gap from one op's end to the next's start."""
    by_name = {}
    for name, _, dur in ops:
        by_name.setdefault(name[:90], []).append(dur)
    starts = [ops[i][1] for i in range(0, len(ops), per_replay)]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    gaps = [ops[i + 1][1] - (ops[i][1] + ops[i][2]) for i in range(len(ops) - 1)]
    return dict(
        ops_per_replay=per_replay,
        op_us={n: round(statistics.median(d), 2) for n, d in by_name.items()
               if not any(s in n for s in skip_names)},
        period_us=round(statistics.median(periods), 2) if periods else None,
        gap_us=round(statistics.median(gaps), 2) if gaps else None)


def study(name: str, fn, flush, replays: int) -> dict:
    rec = dict(case=name)
    try:
        # stream-ordered launches, back to back behind an untimed one (as the tuner times)
        rec["queued_us"] = round(replay_us(fn), 2)
        # host wall time a call with the GPU busy (the bench's host_us): a `p` variant
        # against its `r` twin is what launching the sum for PDL costs the host
        from rocmoe.bench.fused_gpu import host_us_samples
        rec["host_us"] = round(statistics.median(host_us_samples(fn)), 2)
        ops = traced(fn, replays)
        rec["eager"] = summarize(ops, max(1, len(ops) // replays))
        warm = captured(fn)
        rec["graph_us"] = round(replay_us(warm), 2)
        ops = traced(warm, replays)
        per = max(1, len(ops) // replays)
        rec["warm"] = summarize(ops, per)
        cold = captured(lambda: (flush(), fn()))
        rec["flushed_graph_us"] = round(replay_us(cold), 2)
        ops = traced(cold, replays)
        per = max(1, len(ops) // replays)
        rec["flushed"] = summarize(ops, per)
    except Exception as exc:  # noqa: BLE001 - reported
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return rec


DEFAULT_VARIANTS = ("o16x32x256w4s4k1,o16x32x128w4s6k1,o16x64x128w4s4k1,o16x128x128w4s4k4,"
                    "o16x256x128w4s3k8,s16x64x128w4s4k2,s16x128x128w4s4k4,s16x128x256w4s3k4,"
                    "s16x256x128w8s3k8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x4096x4096,64x4096x4096,16x8192x8192")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.fused_gpu import random_gemm_inputs
    dev = torch.device("cuda")
    ctx = rocmoe.init(heap_size=1 << 30)
    flush_buf = torch.empty(128 << 20, dtype=torch.uint8, device=dev)

    def flush():
        flush_buf.zero_()
    out = open(args.output, "w")
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x, w = random_gemm_inputs(m, k, n, dev, torch.Generator(device=dev).manual_seed(3))
        ref = (x.double() @ w.double())
        base = dict(probe="tiny_graph", shape=dict(m=m, k=k, n=n),
                    device=torch.cuda.get_device_name(), triton=triton.__version__)
        cases = [("torch.matmul", lambda: torch.matmul(x, w))]
        h = ops.GemmAllToAll(ctx, m, k, n, torch.bfloat16)
        cases.append(("rocmoe handle", lambda: h(x, w, [m])[0]))
        for text in args.variants.split(","):
            if not text:
                continue
            v = parse_variant(text)
            # one tile of rows up to 64 (as the tuner's tiny tiles), never W read twice
            v["BM"] = max(v["BM"], min(m, 64))
            label = text if v["BM"] == parse_variant(text)["BM"] else f"{text}(BM{v['BM']})"
            try:
                cases.append((label, bare_call(v, x, w)))
            except Exception as exc:  # noqa: BLE001
                out.write(json.dumps(dict(base, case=text, error=str(exc)[:300])) + "\n")
        with torch.no_grad():
            for name, fn in cases:
                try:
                    got = fn()[:m].double()
                    err = float((got - ref).norm() / ref.norm())
                except Exception as exc:  # noqa: BLE001
                    out.write(json.dumps(dict(base, case=name,
                                              error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                              + "\n")
                    out.flush()
                    continue
                rec = dict(base, **study(name, fn, flush, args.replays), rel_err=err)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(name, shape, rec.get("queued_us"), rec.get("host_us"), rec.get("graph_us"),
                      rec.get("flushed_graph_us"),
                      rec.get("warm", {}).get("op_us"), rec.get("error", ""), flush=True)
        h.close()
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
