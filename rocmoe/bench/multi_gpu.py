"""Fused ops and expert-parallel MoE on several GPUs of one node against torch.distributed + NCCL.

    mpirun -n 2 python -m rocmoe.bench.multi_gpu --backend ipc --output multi.json
    python -m rocmoe.bench.multi_gpu --ranks 2 --device cpu --small     # CPU dry run (gloo)

One rank per GPU. For each fused op, the fused rocmoe op against the unfused baseline: the
same torch compute, then the collective through torch.distributed (NCCL on GPUs, gloo on
CPU), initialised from the MPI rank and size (MASTER_ADDR=127.0.0.1, a port chosen by rank 0):

* ``embedding_all_to_all``: per-table ``F.embedding_bag`` over the global batch, stacked, then
  ``all_to_all_single`` of each destination's bags, and the received blocks concatenated in
  table order (the fused op's [B / world, T_total, D]);
* ``gemv_all_reduce``: ``W_r @ x_r`` then ``all_reduce`` (sum);
* ``gemm_all_to_all``: ``X @ W`` then ``all_to_all_single`` with the send counts.

Shapes are those of ``rocmoe bench fused --large`` (``--small``: its default ones).

``moe``: one forward + backward step of an expert-parallel ``DroplessMoE`` (experts split over
the ranks), moving tokens with rocmoe's transport (``transport_for(ctx)``: one-sided puts on the
symmetric heap) and combining through ``gemm_all_to_all`` (the layer's ``combine="auto"``)
against the same layer, same weights, same routing, moving them both ways with
``torch.distributed.all_to_all_single`` (``DistTransport`` below, plugged in through
``ctx.moe_transport``) around the block-sparse FFN (``combine="all_to_all"``). Routing
follows Zipf(1.0) over the experts (p_e ~ 1 / (e + 1)): the tokens are made so that the
layer's own router (the fused Triton one on a GPU) picks k distinct experts drawn with those
probabilities (``draws.router_inputs``; ``routing_match`` says for how many tokens it did),
so rank 0, which owns the first experts, gets most of the work. ``moe_handles``: the step
on the fused-op handles (every count on the device) against the
same step, same fused combine, on ``HeapTransport`` (split sizes read on the host).
``moe_combine``: the same rocmoe step against the same layer on the
same heap transport with ``combine="all_to_all"``: the fused path (per-expert GEMMs, the last
one in ``gemm_all_to_all``) against the block-sparse FFN followed by an all-to-all, with the
dispatch identical.

The fused ops are timed as their persistent handles (``rocmoe.ops.GemmAllToAll``,
``EmbeddingAllToAll``, ``GemvAllReduce``: created once, then called with no host collective and
no synchronisation), exactly as a user calls them; every call's status is checked at the
handle's next call, inside the timing.

Latency of one call = the slowest rank's wall time from a barrier to its device being idle
again; ``*_loop_ms`` = the same over ``--iters`` back-to-back calls, divided by ``--iters``
(launches overlap there: queued behind each other); ``*_graph_ms`` = ``--iters`` calls captured
in one CUDA graph, the replay timed the same way, divided by ``--iters`` (GPU only; no host
launch work; a failed capture is reported in ``graph_error``). Medians over ``--reps``;
fused and baseline alternate, so drift hits both alike. Every line: {"bench": "multi_gpu",
"op", "backend", "ranks", "dtype", "shape",
"fused_ms", "baseline", "baseline_ms", "speedup" (baseline / fused), "latency_reduction"
(1 - fused / baseline), "goal_reduction", "goal_ranks", "rel_err_vs_baseline", ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from typing import Callable, Optional

from ..env import parse_size
from . import emit, inside_mpi_job, relaunch_under_mpiexec
from .draws import router_inputs
from .fused import DLRM_LARGE, DLRM_SMALL, GEMV_LARGE, GEMV_SMALL, MOE_LARGE, MOE_SMALL

OPS = ("embedding", "gemv", "gemm", "moe", "moe_combine", "moe_handles")
TORCH_DIST_OPS = {"embedding", "gemv", "gemm", "moe"}  # their baselines are NCCL (gloo) calls
OP_NAMES = {"embedding": "embedding_all_to_all", "gemv": "gemv_all_reduce",
            "gemm": "gemm_all_to_all", "moe": "dropless_moe_step",
            "moe_combine": "dropless_moe_step_fused_combine",
            "moe_handles": "dropless_moe_step_on_handles"}
BASELINES = {
    "embedding": "F.embedding_bag per table + torch.distributed.all_to_all_single",
    "gemv": "torch.mv + torch.distributed.all_reduce",
    "gemm": "torch.matmul + torch.distributed.all_to_all_single",
    "moe": "same DroplessMoE, tokens moved by torch.distributed.all_to_all_single",
    "moe_handles": "same DroplessMoE, same fused combine, on HeapTransport (split sizes read "
                   "on the host every step)",
    "moe_combine": "same DroplessMoE on the same heap transport, combine='all_to_all' "
                   "(block-sparse FFN, then all-to-all back)",
}
# Issue 5's goals: (lowest latency reduction over the baseline, world size it is stated for;
# None = every world size)
GOALS = {"embedding": (0.25, 8), "gemv": (0.15, 4), "gemm": (0.15, None), "moe": (None, None),
         "moe_combine": (None, None), "moe_handles": (None, None)}
# expert-parallel layer shapes: tokens per rank, hidden, ffn, experts (issue 4's bench shapes)
MOE_EP_LARGE = [(8192, 1024, 4096, 64), (8192, 4096, 1408, 64)]
MOE_EP_SMALL = [(256, 64, 128, 8)]


def parse_moe_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'T,H,F,E;T,H,F,E' -> [(T, H, F, E), ...] (T = tokens per rank)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        values = [int(v) for v in part.split(",")]
        if len(values) != 4 or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"MoE shape {part!r}: expected four positive ints T,H,F,E")
        shapes.append(tuple(values))
    return shapes


def parse_args(argv):
    p = argparse.ArgumentParser(prog="rocmoe bench multi_gpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", help="rocmoe backend: ipc, nvshmem, host, auto")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: host backend + gloo (a dry run of the code, no GPU)")
    p.add_argument("--ops", default=",".join(OPS), help="subset of " + ",".join(OPS))
    p.add_argument("--small", action="store_true", help="rocmoe bench fused's default shapes "
                   "instead of its --large sweep, and a tiny MoE layer")
    p.add_argument("--dtype", default="float32",
                   help="comma list of float32, bfloat16, float16 for the fused ops")
    p.add_argument("--moe-shapes", type=parse_moe_shapes, default=None,
                   help="T,H,F,E;... (T tokens per rank; default two of issue 4's shapes)")
    p.add_argument("--moe-dtype", default=None, help="default bfloat16 on GPUs, float32 on CPU")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the MoE routing")
    p.add_argument("--iters", type=int, default=10, help="calls per back-to-back loop")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--heap", type=parse_size, default=None, help="symmetric heap per rank")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="skip the CUDA-graph replay timing of the fused ops (GPU only)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="stop starting new cases after this many seconds (0: no limit)")
    p.add_argument("--ranks", type=int, default=0,
                   help="from a shell: launch this many ranks with mpiexec")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad:
        p.error(f"unknown dtype(s) {bad}")
    if args.moe_shapes is None:
        args.moe_shapes = MOE_EP_SMALL if args.small else MOE_EP_LARGE
    if args.moe_dtype is None:
        args.moe_dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.iters < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--iters and --reps must be >= 1, --warmup >= 0")
    return args


def fused_cases(args, world: int) -> list[tuple[str, dict, str]]:
    """(op, shape, dtype) of every fused-op measurement at this world size, in run order
    (within an op small shapes first: the symmetric receive buffers only ever grow)."""
    cases = []
    # GEMV and GEMM first: their goals can be judged at small world sizes, the embedding's
    # only at 8 ranks, so a run that is cut short loses the embedding sweep first
    for dtype in args.dtypes:
        if "gemv" in args.ops:
            cases += [("gemv", dict(s), dtype) for s in (GEMV_SMALL if args.small else GEMV_LARGE)
                      if s["k"] >= world]
        if "gemm" in args.ops:
            shapes = sorted(MOE_SMALL if args.small else MOE_LARGE,
                            key=lambda s: s["tokens"] * s["hidden"])
            cases += [("gemm", dict(s), dtype) for s in shapes if s["tokens"] >= world]
        if "embedding" in args.ops:
            shapes = DLRM_SMALL if args.small else DLRM_LARGE
            shapes = sorted(shapes, key=lambda s: s["batch"] * s["pooling"] * s["dim"])
            cases += [("embedding", dict(s), dtype) for s in shapes
                      if s["batch"] % world == 0 and s["tables"] >= 1]
    return cases


def make_record(op: str, backend: str, world: int, dtype: str, shape: dict,
                fused: Optional[dict], base: Optional[dict], **extra) -> dict:
    """One JSON line: times in ms (3 decimals kept as measured), ratios against the baseline."""
    goal, goal_world = GOALS[op]
    rec = dict(bench="multi_gpu", op=OP_NAMES[op], backend=backend, ranks=world, dtype=dtype,
               shape=shape, baseline=BASELINES[op])
    if fused is not None and base is not None:
        f, b = fused["ms"], base["ms"]
        rec.update(fused_ms=round(f, 4), baseline_ms=round(b, 4),
                   speedup=round(b / f, 3) if f > 0 else None,
                   latency_reduction=round(1.0 - f / b, 3) if b > 0 else None)
        if "loop_ms" in fused and "loop_ms" in base:
            fl, bl = fused["loop_ms"], base["loop_ms"]
            rec.update(fused_loop_ms=round(fl, 4), baseline_loop_ms=round(bl, 4),
                       loop_speedup=round(bl / fl, 3) if fl > 0 else None,
                       loop_latency_reduction=round(1.0 - fl / bl, 3) if bl > 0 else None)
        fg, bg = fused.get("graph_ms"), base.get("graph_ms")
        if isinstance(fg, float) and isinstance(bg, float):
            rec.update(fused_graph_ms=round(fg, 4), baseline_graph_ms=round(bg, 4),
                       graph_speedup=round(bg / fg, 3) if fg > 0 else None,
                       graph_latency_reduction=round(1.0 - fg / bg, 3) if bg > 0 else None)
        elif fg is not None or bg is not None:  # a capture failed: say which and why
            rec.update(graph_error={"fused": fg, "baseline": bg})
    if goal is not None:
        rec.update(goal_reduction=goal, goal_ranks=goal_world)
        applies = goal_world is None or goal_world == world
        red = rec.get("latency_reduction")
        rec["meets_goal"] = (red >= goal) if (applies and red is not None) else None
    rec.update(extra)
    return rec


def summary_table(records: list[dict]) -> str:
    """Plain-text table of the records (the device log's last lines)."""
    lines = [f"{'op':22s} {'backend':8s} {'n':>2s} {'dtype':9s} {'shape':44s} {'fused':>9s} "
             f"{'base':>9s} {'speedup':>7s} {'reduct':>7s} {'loopF':>9s} {'loopB':>9s} "
             f"{'graphF':>9s} {'graphB':>9s}  note"]
    for r in records:
        if r.get("bench") != "multi_gpu" or "op" not in r:
            continue
        shape = ",".join(f"{k}={v}" for k, v in (r.get("shape") or {}).items())

        def num(key, fmt="{:.4f}"):
            v = r.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        note = r.get("error") or r.get("skipped") or ""
        lines.append(f"{r['op']:22s} {r['backend']:8s} {r['ranks']:2d} {r['dtype']:9s} "
                     f"{shape[:44]:44s} {num('fused_ms'):>9s} {num('baseline_ms'):>9s} "
                     f"{num('speedup', '{:.3f}'):>7s} {num('latency_reduction', '{:.3f}'):>7s} "
                     f"{num('fused_loop_ms'):>9s} {num('baseline_loop_ms'):>9s} "
                     f"{num('fused_graph_ms'):>9s} {num('baseline_graph_ms'):>9s}  {note[:80]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# torch.distributed side
# ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_torch_distributed(comm, device):
    """NCCL (GPU) or gloo (CPU) process group over the MPI ranks; rank 0 picks the port."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return dist
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    kw = {}
    if device.type == "cuda":
        kw["device_id"] = torch.device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), **kw)
    return dist


class DistTransport:
    """ExpertTransport (rocmoe.moe.parallel) over torch.distributed.all_to_all_single: the
    baseline that the layer's own transport is measured against. Counts and rows travel in
    the process group's collectives; the split sizes are host lists, as the interface says."""

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank, self.world_size, self.group = rank, world_size, group

    def exchange_counts(self, send_counts):
        import torch
        import torch.distributed as dist
        send = send_counts.contiguous()
        # gloo's all_to_all has no int32 on every build: move int64, return the caller's dtype
        send = send.to(torch.int64) if send.device.type == "cpu" else send
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.to(send_counts.dtype)

    def all_to_all(self, rows, send_splits, recv_splits):
        import torch.distributed as dist
        src = rows.contiguous()
        out = src.new_empty((sum(recv_splits), src.shape[1]))
        dist.all_to_all_single(out, src, list(recv_splits), list(send_splits), group=self.group)
        return out


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
class Clock:
    """Wall time of collective calls as the slowest rank sees it."""

    def __init__(self, comm, device):
        import torch
        self.comm = comm
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" \
            else (lambda: None)

    def _max(self, values: list[float]) -> list[float]:
        import numpy as np
        from mpi4py import MPI
        mine = np.asarray(values, dtype=np.float64)
        out = np.empty_like(mine)
        self.comm.Allreduce(mine, out, op=MPI.MAX)
        return out.tolist()

    def _once(self, fn, iters: int) -> float:
        self.sync()
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters

    def compare(self, fns: dict, warmup: int, reps: int, iters: int) -> dict:
        """{name: fn} -> {name: {"ms", "loop_ms"}}; calls of the names alternate."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        self.sync()
        single = {k: [] for k in fns}
        loop = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                single[k].append(self._once(fn, 1))
            if iters > 1:
                for k, fn in fns.items():
                    loop[k].append(self._once(fn, iters))
        names = list(fns)
        flat = [v for k in names for v in single[k]] + [v for k in names for v in loop[k]]
        flat = self._max(flat)
        out, pos = {}, 0
        for k in names:
            out[k] = {"ms": statistics.median(flat[pos:pos + reps]) * 1e3}
            pos += reps
        if iters > 1:
            for k in names:
                out[k]["loop_ms"] = statistics.median(flat[pos:pos + reps]) * 1e3
                pos += reps
        return out

    def compare_graphs(self, fns: dict, reps: int, iters: int) -> dict:
        """{name: fn} -> {name: graph_ms}: ``iters`` calls of each captured in one CUDA graph
        (after a warm-up on the capturing stream), then the replay timed like ``_once``: from a
        barrier until the slowest rank's device is idle, divided by ``iters``; medians over
        ``reps``, the names alternating. A name whose capture fails gets its error string
        instead (NCCL or the handle refusing capture is a result, not a crash). GPU only."""
        import torch
        graphs, failed = {}, {}
        for k, fn in fns.items():
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                self.sync()
                self.comm.Barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    for _ in range(iters):
                        fn()
                graphs[k] = graph
            except Exception as exc:  # every rank fails alike: same code, same shapes
                failed[k] = f"{type(exc).__name__}: {str(exc)[:200]}"
        # ranks agree on which graphs exist before any replay waits on a peer
        ok = self.comm.allreduce(len(failed) == 0, op=_mpi_land())
        if not ok:
            return {k: failed.get(k, "capture failed on another rank") for k in fns}
        samples = {k: [] for k in graphs}
        for k, graph in graphs.items():  # one untimed replay each: first replays upload
            graph.replay()
        for _ in range(reps):
            for k, graph in graphs.items():
                samples[k].append(self._once(graph.replay, 1) / iters)
        names = list(graphs)
        flat = self._max([v for k in names for v in samples[k]])
        return {k: statistics.median(flat[i * reps:(i + 1) * reps]) * 1e3
                for i, k in enumerate(names)}


def _mpi_land():
    from mpi4py import MPI
    return MPI.LAND


def rel_err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom > 0 else float((a - b).norm())


# ---------------------------------------------------------------------------------------
# the fused ops: rocmoe vs torch + torch.distributed
# ---------------------------------------------------------------------------------------
class Env:
    def __init__(self, ctx, dist, clock, args):
        import torch
        self.ctx, self.dist, self.clock, self.args = ctx, dist, clock, args
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device
        self.gpu = ctx.device.type == "cuda"
        self.fused_path = "rocmoe.ops handles (" + ("GPU kernels" if self.gpu
                                                    else "host backend kernels") + ")"
        self.torch = torch
        self.handles = []  # this case's fused-op handles, closed (collectively) after it

    def handle(self, h):
        """Keep `h` to close after the case: a handle holds its heap workspace until closed,
        so a sweep that only dropped them ran out of heap (8 GB) on its largest shapes."""
        self.handles.append(h)
        return h

    def close_handles(self):
        while self.handles:
            self.handles.pop().close()

    def generator(self, salt: int):
        g = self.torch.Generator(device=self.device)
        g.manual_seed(1000 * salt + self.rank)
        return g


def case_embedding(env: Env, shape: dict, dtype):
    import torch
    import torch.nn.functional as F
    world, rank, dev = env.world, env.rank, env.device
    tables, dim, batch = shape["tables"], shape["dim"], shape["batch"]
    pooling, rows = shape["pooling"], shape["rows"]
    counts = [tables * (r + 1) // world - tables * r // world for r in range(world)]
    t_local, t_total, local = counts[rank], tables, batch // world
    g = env.generator(1)
    weights = [torch.randn(rows, dim, device=dev, generator=g).to(dtype) for _ in range(t_local)]
    indices = [torch.randint(0, rows, (batch * pooling,), device=dev, generator=g)
               for _ in range(t_local)]
    offsets = [torch.arange(0, batch * pooling, pooling, device=dev) for _ in range(t_local)]
    send_splits = [local * t_local] * world
    recv_splits = [local * c for c in counts]

    def baseline():
        if t_local:
            bags = torch.stack([F.embedding_bag(i, w, o, mode="sum")
                                for w, i, o in zip(weights, indices, offsets)], dim=1)
        else:
            bags = torch.empty(batch, 0, dim, device=dev, dtype=dtype)
        send = bags.reshape(batch * t_local, dim)   # destination d's bags are rows d*local*t..
        recv = send.new_empty((local * t_total, dim))
        env.dist.all_to_all_single(recv, send, recv_splits, send_splits)
        parts, start = [], 0
        for c in counts:
            parts.append(recv[start:start + local * c].view(local, c, dim))
            start += local * c
        return torch.cat(parts, dim=1)

    from .. import ops
    handle = env.handle(ops.EmbeddingAllToAll(env.ctx, [rows] * t_local, dim, batch,
                                              batch * pooling, "sum", dtype))

    def fused():
        return handle(weights, indices, offsets, batch=batch)
    first = fused()
    handle.synchronize()
    err = rel_err(first, baseline())
    return fused, baseline, err


def case_gemv(env: Env, shape: dict, dtype):
    import torch
    world, rank, dev = env.world, env.rank, env.device
    n, k = shape["n"], shape["k"]
    k_r = k * (rank + 1) // world - k * rank // world
    g = env.generator(2)
    w = torch.randn(n, k_r, device=dev, generator=g).to(dtype)
    x = torch.randn(k_r, device=dev, generator=g).to(dtype)

    def baseline():
        y = torch.mv(w, x)
        env.dist.all_reduce(y)
        return y

    from .. import ops
    handle = env.handle(ops.GemvAllReduce(env.ctx, n, k_r, dtype))

    def fused():
        return handle(w, x)
    first = fused()
    handle.synchronize()
    err = rel_err(first, baseline())
    return fused, baseline, err


def case_gemm(env: Env, shape: dict, dtype):
    import torch
    world, rank, dev = env.world, env.rank, env.device
    m, h = shape["tokens"] // world, shape["hidden"]
    g = env.generator(3)
    x = torch.randn(m, h, device=dev, generator=g).to(dtype)
    w = (torch.randn(h, h, device=dev, generator=g) / h ** 0.5).to(dtype)
    counts = [m * (d + 1) // world - m * d // world for d in range(world)]
    # every rank has m rows split the same way, so each receives counts[rank] from each
    recv_splits = [counts[rank]] * world

    def baseline():
        y = x @ w
        out = y.new_empty((sum(recv_splits), h))
        env.dist.all_to_all_single(out, y, recv_splits, counts)
        return out

    extra = {}
    from .. import ops
    handle = env.handle(ops.GemmAllToAll(env.ctx, max(counts), h, h, dtype))
    total = sum(recv_splits)

    def fused():
        return handle(x, w, counts)[0][:total]
    first = fused()
    handle.synchronize()
    err = rel_err(first, baseline())
    return fused, baseline, err, extra


# ---------------------------------------------------------------------------------------
# expert-parallel DroplessMoE
# ---------------------------------------------------------------------------------------
def zipf_probabilities(experts: int, exponent: float = 1.0):
    import torch
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    return p / p.sum()


def case_moe(env: Env, shape, dtype, baseline: str = "dist"):
    """(rocmoe step, baseline step, check dict): the same layer, same weights and routing.
    rocmoe: heap transport, combine="auto" (gemm_all_to_all). Baseline "dist": tokens moved
    by all_to_all_single both ways; "heap": the same heap transport with combine="all_to_all"
    (what the fused combine alone is worth)."""
    import torch
    from ..moe import DroplessMoE
    from ..moe.parallel import combine_kind, transport_for
    tokens, hidden, ffn, experts = shape
    ctx, dev = env.ctx, env.device
    torch.manual_seed(1234 + env.rank)  # this rank's experts; the router is set below
    layer = DroplessMoE(hidden, ffn, experts, env.args.top_k, ctx=ctx, device=dev, dtype=dtype)
    with torch.no_grad():  # the router is replicated: every rank must hold the same one
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape,
                                              generator=torch.Generator().manual_seed(7))
                                  .to(dev, dtype) / hidden ** 0.5)
    g = env.generator(4)
    # tokens the router (the fused one on a GPU, torch ops on CPU) routes Zipf: the routing
    # comes from the inputs, so both steps route alike through the layer's own router
    x, drawn = router_inputs(layer.router.weight, tokens, env.args.top_k,
                             zipf_probabilities(experts, env.args.zipf), g)
    with torch.no_grad():
        picked, _ = layer.router.route(x)
    routing_match = float((picked.long().sort(1).values == drawn.sort(1).values)
                          .all(1).float().mean())
    ctx.moe_transport = None
    heap = transport_for(ctx)
    nccl = DistTransport(env.rank, env.world)

    def step_with(transport, combine):
        def step():
            ctx.moe_transport = transport
            layer.combine = combine
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            loss = y.float().square().mean() + layer.aux_loss
            loss.backward()
            return y
        return step

    # rocmoe's step combines through gemm_all_to_all where the layer can ("auto", the
    # layer's default); the baseline moves rows back by all-to-all after the block-sparse FFN
    heap_combine = combine_kind(layer)
    heap_step = step_with(heap, "auto")
    if baseline == "heap_transport":  # the earlier transport, same fused combine
        from ..moe.parallel import HeapTransport
        dist_step = step_with(HeapTransport(ctx), "auto")
    else:
        dist_step = step_with(nccl if baseline == "dist" else heap, "all_to_all")
    y_heap = heap_step().detach()
    g_heap = layer.w1.grad.detach().clone()
    y_dist = dist_step().detach()
    g_dist = layer.w1.grad.detach().clone()
    counts = layer.tokens_per_expert.detach().to(torch.float64).cpu()
    # every rank's routed pairs per owner rank -> share of all pairs each rank's experts get
    per_rank = counts.view(env.world, -1).sum(dim=1)
    import numpy as np
    from mpi4py import MPI
    tot = np.zeros(env.world)
    env.ctx.comm.Allreduce(per_rank.numpy().copy(), tot, op=MPI.SUM)
    check = dict(rel_err_vs_baseline=rel_err(y_heap, y_dist),
                 grad_w1_rel_err_vs_baseline=rel_err(g_heap, g_dist),
                 rank_load_fraction=[round(float(v) / float(tot.sum()), 4) for v in tot],
                 zipf_mass_per_rank=[
                     round(float(v), 4) for v in zipf_probabilities(experts, env.args.zipf)
                     .view(env.world, -1).sum(dim=1)],
                 routing_match=round(routing_match, 4),
                 top_k=env.args.top_k, zipf_exponent=env.args.zipf, heap_transport=type(heap).__name__,
                 combine=heap_combine,
                 baseline_combine=heap_combine if baseline == "heap_transport" else "all_to_all")
    return heap_step, dist_step, check


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def _device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def run(args) -> int:
    import torch
    from mpi4py import MPI

    import rocmoe
    comm = MPI.COMM_WORLD
    t_start = time.time()
    if args.device == "cpu":
        backend = "host"
    else:
        backend = args.backend
        if not torch.cuda.is_available():
            print("rocmoe.bench.multi_gpu: no GPU visible (use --device cpu for a dry run)",
                  file=sys.stderr)
            return 2
    ctx = rocmoe.init(comm=comm, backend=backend, heap_size=args.heap)
    # torch.distributed only where a baseline uses it: NCCL refuses two ranks on one GPU,
    # and the moe_combine and moe_handles steps, whose baselines run on rocmoe's heap, are
    # also measured with several ranks sharing one
    dist = init_torch_distributed(comm, ctx.device) if set(args.ops) & TORCH_DIST_OPS else None
    clock = Clock(comm, ctx.device)
    env = Env(ctx, dist, clock, args)
    root = ctx.rank == 0
    out_file = open(args.output, "a") if (root and args.output) else None
    records = []
    device_name = _device_name(ctx.device)

    def put(rec):
        rec = dict(rec, device=device_name, fused_path=env.fused_path,
                   torch_distributed=dist is not None,
                   nccl_env={k: os.environ.get(k) for k in
                             ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
                              "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
        records.append(rec)
        if root:
            emit(rec, out_file)

    def over_budget() -> bool:
        late = args.time_budget_s > 0 and time.time() - t_start > args.time_budget_s
        return bool(comm.bcast(late if root else None, root=0))  # every rank decides alike

    def guarded(op, shape, dtype_name, body: Callable[[], dict]):
        if over_budget():
            put(make_record(op, ctx.backend, env.world, dtype_name, shape, None, None,
                            skipped=f"time budget of {args.time_budget_s:g} s spent"))
            return
        try:
            rec = body()
        except Exception as exc:  # one failing case is reported; the next still runs
            rec = make_record(op, ctx.backend, env.world, dtype_name, shape, None, None,
                              error=f"{type(exc).__name__}: {str(exc)[:400]}")
        finally:
            env.close_handles()
        put(rec)

    for op, shape, dtype_name in fused_cases(args, env.world):
        dtype = getattr(torch, dtype_name)

        def body(op=op, shape=shape, dtype=dtype, dtype_name=dtype_name):
            with torch.no_grad():
                made = {"embedding": case_embedding, "gemv": case_gemv,
                        "gemm": case_gemm}[op](env, shape, dtype)
            fused, baseline, err = made[:3]
            extra = made[3] if len(made) > 3 else {}
            with torch.no_grad():
                times = clock.compare({"fused": fused, "baseline": baseline}, args.warmup,
                                      args.reps, args.iters)
                if args.graph and env.gpu:
                    graphs = clock.compare_graphs({"fused": fused, "baseline": baseline},
                                                  args.reps, args.iters)
                    for k, v in graphs.items():
                        times[k]["graph_ms"] = v
            return make_record(op, ctx.backend, env.world, dtype_name, shape, times["fused"],
                               times["baseline"], rel_err_vs_baseline=err, iters=args.iters,
                               reps=args.reps, **extra)
        guarded(op, shape, dtype_name, body)

    for op, baseline in (("moe", "dist"), ("moe_combine", "heap"),
                         ("moe_handles", "heap_transport")):
        if op not in args.ops:
            continue
        dtype = getattr(torch, args.moe_dtype)
        for shp in args.moe_shapes:
            shape = dict(tokens_per_rank=shp[0], hidden=shp[1], ffn=shp[2], experts=shp[3])

            def body(shp=shp, shape=shape, dtype=dtype, op=op, baseline=baseline):
                heap_step, base_step, check = case_moe(env, shp, dtype, baseline)
                # each step synchronises the host (split sizes): time single steps only
                times = clock.compare({"fused": heap_step, "baseline": base_step},
                                      args.warmup, args.reps, 1)
                return make_record(op, ctx.backend, env.world, args.moe_dtype, shape,
                                   times["fused"], times["baseline"], reps=args.reps,
                                   step="forward + backward", **check)
            guarded(op, shape, args.moe_dtype, body)
            ctx.moe_transport = None

    if root:
        print(summary_table(records), file=sys.stderr, flush=True)
        if out_file:
            out_file.close()
    comm.Barrier()
    try:
        if dist is not None:
            dist.destroy_process_group()
        ctx.moe_transport = None
        ctx.finalize()  # collective; the nvshmem backend's heap is freed by every PE together
    except Exception as exc:  # the records are out already: report, do not fail the run
        print(f"rank {ctx.rank}: shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ranks and not inside_mpi_job():
        rest = [a for i, a in enumerate(argv)
                if not (a == "--ranks" or a.startswith("--ranks=")
                        or (i > 0 and argv[i - 1] == "--ranks"))]
        return relaunch_under_mpiexec("rocmoe.bench.multi_gpu", rest, args.ranks)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
