"""Eager implementations of the fused ops: validate, agree, run the persistent kernel.

The persistent kernel is the host backend's (librocmoe, hip/src/host/fused_ops.cpp) on a host
context; GPU backends plug their launchers into `LAUNCHERS` with the same argument structs
(the GPU kernels run the same schedule.h and workspace layout).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

from .. import errors
from .._native import check, ffi, lib
from ._common import (CODE_DTYPES, DTYPE_CODES, agree, check_device, check_float_dtype,
                      check_index_dtype, i64_array, ptr, workspace, workspace_sizes)

# op -> backend name -> callable(handle, args) -> status. GPU launchers register here.
LAUNCHERS: dict[str, dict[str, object]] = {
    "embedding_all_to_all": {"host": lambda h, a: lib.rocmoe_host_embedding_a2a(h, a)},
    "gemv_all_reduce": {"host": lambda h, a: lib.rocmoe_host_gemv_allreduce(h, a)},
    "gemm_all_to_all": {"host": lambda h, a: lib.rocmoe_host_gemm_a2a(h, a)},
}

# stands for send_counts that were not integers at all (the custom op's schema needs ints)
BAD_COUNTS = (-(2 ** 62),)

MODES = {"sum": lib.ROCMOE_BAG_SUM, "mean": lib.ROCMOE_BAG_MEAN}


def _launch(ctx, op: str, args, what: str) -> None:
    launcher = LAUNCHERS[op].get(ctx.backend)
    if launcher is None:
        raise errors.BackendUnavailableError(
            f"{what}: no fused kernel for the {ctx.backend!r} backend in this build "
            f"(available: {sorted(LAUNCHERS[op])}); use rocmoe.ops.reference.{op} meanwhile")
    check(launcher(ctx._live(), args), what)


def host_embedding_mode() -> str:
    """How the host persistent kernel gets the pooled bags: "kernel" (gathered by the worker
    threads, with prefetching) or "torch" (torch's EmbeddingBag pools every bag first, the
    kernel then only puts its slices and signals)."""
    mode = os.environ.get("ROCMOE_HOST_EMBEDDING", "torch").strip().lower()
    if mode not in ("kernel", "torch"):
        raise errors.ConfigurationError(
            f"ROCMOE_HOST_EMBEDDING={mode!r}: use 'kernel' or 'torch'")
    return mode


def host_gemv_mode() -> str:
    """How the host persistent kernel gets the partial products W_r x_r: "kernel" (dot
    products by the worker threads) or "torch" (one torch matmul first; the kernel then does
    the reduce-scatter and all-gather: puts, the reduction, signals)."""
    mode = os.environ.get("ROCMOE_HOST_GEMV", "torch").strip().lower()
    if mode not in ("kernel", "torch"):
        raise errors.ConfigurationError(f"ROCMOE_HOST_GEMV={mode!r}: use 'kernel' or 'torch'")
    return mode


def host_gemm_mode() -> str:
    """How the host persistent kernel gets Y = X @ W: "kernel" (tiles computed by the worker
    threads, fp32 register-tiled C++) or "torch" (one torch matmul first, the kernel then only
    puts and signals)."""
    mode = os.environ.get("ROCMOE_HOST_GEMM", "torch").strip().lower()
    if mode not in ("kernel", "torch"):
        raise errors.ConfigurationError(f"ROCMOE_HOST_GEMM={mode!r}: use 'kernel' or 'torch'")
    return mode


# ---- embedding bag + all-to-all ------------------------------------------------------------
def _check_embedding(ctx, weights, indices, offsets, mode, psw):
    """Local validation; returns (num_tables, batch, dim, dtype_code), -1 where unknown."""
    op = "embedding_all_to_all"
    if mode not in MODES:
        raise errors.InvalidArgumentError(
            f"{op}: mode {mode!r} is not supported; use 'sum' or 'mean'")
    for name, seq in (("weights", weights), ("indices", indices), ("offsets", offsets)):
        if not isinstance(seq, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in seq):
            raise errors.InvalidArgumentError(f"{op}: {name} must be a list of tensors")
    nt = len(weights)
    if len(indices) != nt or len(offsets) != nt:
        raise errors.InvalidArgumentError(
            f"{op}: {nt} tables but {len(indices)} index and {len(offsets)} offset tensors; "
            "give one of each per table")
    if psw is not None:
        if mode != "sum":
            raise errors.InvalidArgumentError(
                f"{op}: per_sample_weights only work with mode='sum' (got {mode!r})")
        if not isinstance(psw, (list, tuple)) or len(psw) != nt:
            raise errors.InvalidArgumentError(
                f"{op}: per_sample_weights must be a list with one tensor per table ({nt})")
    if nt == 0:
        return 0, -1, -1, -1
    batch = dim = dtype = None
    for t, (w, idx, off) in enumerate(zip(weights, indices, offsets)):
        check_float_dtype(w, f"{op}: table {t}")
        check_index_dtype(idx, f"{op}: indices of table {t}")
        check_index_dtype(off, f"{op}: offsets of table {t}")
        for what, x in (("table", w), ("indices", idx), ("offsets", off)):
            check_device(ctx, x, f"{op}: {what} of table {t}")
        if w.dim() != 2:
            raise errors.InvalidArgumentError(
                f"{op}: table {t} has shape {tuple(w.shape)}; tables are [rows, dim]")
        if idx.dim() != 1 or off.dim() != 1:
            raise errors.InvalidArgumentError(
                f"{op}: table {t}: indices and offsets are 1-D (got {idx.dim()}-D and "
                f"{off.dim()}-D)")
        if dim is None:
            batch, dim, dtype = off.numel(), w.shape[1], w.dtype
        if w.shape[1] != dim or w.dtype != dtype:
            raise errors.InvalidArgumentError(
                f"{op}: table {t} is [{w.shape[0]}, {w.shape[1]}] {w.dtype}, table 0 has dim "
                f"{dim} and {dtype}: all tables need the same dim and dtype")
        if off.numel() != batch:
            raise errors.InvalidArgumentError(
                f"{op}: table {t} has {off.numel()} offsets, table 0 has {batch}: every table "
                "looks up the same global batch")
        n = idx.numel()
        if batch > 0:
            o = off.to(torch.int64)
            if int(o[0]) != 0:
                raise errors.InvalidArgumentError(
                    f"{op}: table {t}: offsets[0] is {int(o[0])}; the first bag starts at 0")
            if batch > 1 and bool((o[1:] < o[:-1]).any()):
                raise errors.InvalidArgumentError(
                    f"{op}: table {t}: offsets decrease; they are the bags' start positions")
            if int(o[-1]) > n:
                raise errors.InvalidArgumentError(
                    f"{op}: table {t}: offset {int(o[-1])} is past the {n} indices")
        if n > 0:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= w.shape[0]:
                bad = lo if lo < 0 else hi
                raise errors.InvalidArgumentError(
                    f"{op}: table {t}: index {bad} is outside the table's {w.shape[0]} rows")
        if psw is not None:
            p = psw[t]
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() != n:
                raise errors.InvalidArgumentError(
                    f"{op}: per_sample_weights of table {t} must be 1-D with one weight per index "
                    f"({n})")
            if not p.is_floating_point():
                raise errors.DTypeError(f"{op}: per_sample_weights of table {t} must be floating")
            check_device(ctx, p, f"{op}: per_sample_weights of table {t}")
    return nt, batch, dim, DTYPE_CODES[dtype]


def embedding_layout(table: "object", rank: int, world: int, op: str):
    """From the agreed [world, (nt, batch, dim, dtype, mode)] table: (total, base, batch, dim,
    dtype_code). Every rank sees the same table, so every rank raises the same errors."""
    nts = [int(v) for v in table[:, 0]]
    known = [r for r in range(world) if nts[r] > 0]
    if not known:
        raise errors.InvalidArgumentError(f"{op}: no rank has any table")
    modes = set(int(v) for v in table[:, 4])
    if len(modes) != 1:
        raise errors.InvalidArgumentError(f"{op}: ranks passed different modes")
    for col, name in ((1, "global batch"), (2, "dim"), (3, "dtype")):
        vals = {int(table[r, col]) for r in known}
        if len(vals) != 1:
            got = ", ".join(f"rank {r}: {int(table[r, col])}" for r in known)
            raise errors.InvalidArgumentError(
                f"{op}: ranks disagree on the {name} ({got}); it must be the same everywhere")
    batch, dim, dtype = (int(table[known[0], c]) for c in (1, 2, 3))
    if batch % world != 0:
        raise errors.InvalidArgumentError(
            f"{op}: global batch {batch} is not a multiple of the {world} ranks")
    return [sum(nts), sum(nts[:rank]), batch, dim, dtype] + nts


def layout_hash(layout) -> int:
    """Deterministic across processes (unlike hash() of some types), never 0 (= none given)."""
    h = 1469598103934665603
    for v in layout:
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h or 1


# (context id, this rank's table signature) -> the layout agreed in the last eager call; used
# to trace the op under torch.compile (the fake kernel needs the global shape)
recorded_layouts: dict = {}


def table_signature(weights, offsets, mode, psw):
    return (len(weights), tuple((tuple(w.shape), w.dtype) for w in weights),
            tuple(o.shape[0] if o.dim() == 1 else -1 for o in offsets), mode, psw is None)


def embedding_forward(ctx, weights, indices, offsets, mode="sum", psw=None,
                      expect: Optional[Sequence[int]] = None) -> torch.Tensor:
    op = "embedding_all_to_all"
    ws = workspace(ctx, op)
    problem, info = None, (0, -1, -1, -1)
    try:
        info = _check_embedding(ctx, weights, indices, offsets, mode, psw)
    except errors.RocmoeError as exc:
        problem = exc
    expect_hash = layout_hash(expect) if expect else 0
    table = agree(ctx, op, ws.epoch + 1, problem,
                  list(info) + [MODES.get(mode, -1), expect_hash])
    layout = embedding_layout(table, ctx.rank, ctx.world_size, op)
    total, base, batch, dim, dcode = layout[:5]
    # A rank that was traced with a layout (torch.compile) must get exactly that one; every
    # rank checks every rank's expectation from the table, so all raise together.
    stale = [r for r in range(ctx.world_size) if table[r, 5] and table[r, 5] != layout_hash(
        embedding_layout(table, r, ctx.world_size, op))]
    if stale:
        raise errors.InvalidArgumentError(
            f"{op}: rank(s) {stale} run a graph traced for another table layout (batch, dims "
            "or table counts changed since); call the op eagerly once with the new shapes")
    if problem is None:
        recorded_layouts[(id(ctx), table_signature(weights, offsets, mode, psw))] = layout
    if ctx.backend != "host":  # GPU backends: the persistent HIP kernel (rocmoe/ops/gpu.py)
        from . import gpu
        counts = [int(c) for c in layout[5:5 + ctx.world_size]]
        out = gpu.embedding_all_to_all(gpu.arena_for(ctx), weights, indices, offsets, mode, psw,
                                       batch=batch,
                                       layout=(counts, dim, batch, CODE_DTYPES[dcode]))
        return out, layout
    ws.epoch += 1
    ws.prepare(*workspace_sizes(lib.rocmoe_embedding_a2a_workspace, ctx.world_size, batch,
                                total, dim, dcode))
    dtype = CODE_DTYPES[dcode]
    out = torch.empty((batch // ctx.world_size, total, dim), dtype=dtype, device=ctx.device)
    nt = len(weights)
    keep = []  # keeps the contiguous copies alive during the call

    def arr(ctype, tensors):
        keep.extend(tensors)
        array = ffi.new(f"{ctype}[]", [ffi.cast(ctype, t.data_ptr()) for t in tensors] or [ffi.NULL])
        keep.append(array)  # a struct field does not own what it points to
        return array

    ws_w = [w.contiguous() for w in weights]
    ws_i = [i.to(torch.int64).contiguous() for i in indices]
    ws_o = [o.to(torch.int64).contiguous() for o in offsets]
    args = ffi.new("rocmoe_embedding_a2a_args *")
    ws.common(args.common)
    args.dtype, args.mode = dcode, MODES[mode]
    args.num_tables, args.total_tables, args.table_base = nt, total, base
    args.batch, args.dim = batch, dim
    args.weights = arr("void *", ws_w)
    rows = i64_array([w.shape[0] for w in weights])
    nidx = i64_array([i.numel() for i in indices])
    args.rows, args.num_indices = rows, nidx
    args.indices = arr("int64_t *", ws_i)
    args.offsets = arr("int64_t *", ws_o)
    args.per_sample_weights = (arr("float *", [p.to(torch.float32).contiguous() for p in psw])
                               if psw is not None else ffi.NULL)
    args.out = ptr(out)
    args.bags = ffi.NULL
    if nt and ctx.backend == "host" and host_embedding_mode() == "torch":
        # torch pools in the table dtype with an fp32 accumulator (no copy of the tables)
        bags = torch.stack([torch.nn.functional.embedding_bag(
            i, w, o, mode=mode, per_sample_weights=None if psw is None else p.to(w.dtype))
            for w, i, o, p in zip(ws_w, ws_i, ws_o, psw or [None] * nt)], dim=1).contiguous()
        keep.append(bags)
        args.bags = ptr(bags)
    _launch(ctx, op, args, op)
    return out, layout


# ---- GEMV + all-reduce -------------------------------------------------------------------------
def gemv_forward(ctx, w_local: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
    op = "gemv_all_reduce"
    ws = workspace(ctx, op)
    problem, n, dcode = None, -1, -1
    try:
        for name, t in (("W_local", w_local), ("x_local", x_local)):
            if not isinstance(t, torch.Tensor):
                raise errors.InvalidArgumentError(f"{op}: {name} must be a tensor")
            check_float_dtype(t, f"{op}: {name}")
            check_device(ctx, t, f"{op}: {name}")
        if w_local.dim() != 2 or x_local.dim() != 1 or w_local.shape[1] != x_local.shape[0]:
            raise errors.InvalidArgumentError(
                f"{op}: W_local {tuple(w_local.shape)} and x_local {tuple(x_local.shape)} do not "
                "fit; expected [N, K_r] and [K_r]")
        if w_local.dtype != x_local.dtype:
            raise errors.DTypeError(
                f"{op}: W_local is {w_local.dtype} but x_local is {x_local.dtype}")
        n, dcode = int(w_local.shape[0]), DTYPE_CODES[w_local.dtype]
    except errors.RocmoeError as exc:
        problem = exc
    table = agree(ctx, op, ws.epoch + 1, problem, [n, dcode])
    if (table[:, 0] != table[0, 0]).any() or (table[:, 1] != table[0, 1]).any():
        got = ", ".join(f"rank {r}: N={int(a)} {CODE_DTYPES[int(b)]}" for r, (a, b) in
                        enumerate(table))
        raise errors.InvalidArgumentError(
            f"{op}: ranks disagree on N or the dtype ({got}); y has the same shape everywhere")
    if ctx.backend != "host":  # GPU backends: the persistent HIP kernel (rocmoe/ops/gpu.py)
        from . import gpu
        return gpu.gemv_all_reduce(gpu.arena_for(ctx), w_local, x_local, agreed=True)
    ws.epoch += 1
    ws.prepare(*workspace_sizes(lib.rocmoe_gemv_allreduce_workspace, ctx.world_size, n, dcode))
    w_c, x_c = w_local.contiguous(), x_local.contiguous()
    out = torch.empty((n,), dtype=w_local.dtype, device=ctx.device)
    args = ffi.new("rocmoe_gemv_allreduce_args *")
    ws.common(args.common)
    args.dtype, args.n, args.k = dcode, n, int(w_local.shape[1])
    args.w, args.x, args.out = ptr(w_c), ptr(x_c), ptr(out)
    args.partial = ffi.NULL
    if ctx.backend == "host" and host_gemv_mode() == "torch" and n:
        partial = (w_c.float() @ x_c.float()) if w_c.dtype != torch.float32 else w_c @ x_c
        partial = partial.contiguous()
        args.partial = ffi.cast("float *", partial.data_ptr())
    _launch(ctx, op, args, op)
    return out


# ---- GEMM + all-to-all (and the plain row all-to-all of the backward passes) ---------------
def _counts_list(send_counts, world: int, op: str, groups: int = 0) -> list[int]:
    """send_counts as a flat list of ints: one per rank, or with `groups` (grouped products)
    one per (rank, group), rank-major."""
    per_rank = max(groups, 1)
    what = ("a [world, groups] integer tensor or list of lists" if groups
            else "a 1-D integer tensor or a list of ints")
    if isinstance(send_counts, torch.Tensor):
        if (send_counts.dim() != (2 if groups else 1) or send_counts.is_floating_point()
                or send_counts.is_complex()):
            raise errors.InvalidArgumentError(f"{op}: send_counts must be {what}")
        send_counts = send_counts.reshape(-1).tolist()
    try:
        counts = [int(c) for c in send_counts]
    except (TypeError, ValueError):
        counts = list(BAD_COUNTS)
    if tuple(counts) == BAD_COUNTS:
        raise errors.InvalidArgumentError(f"{op}: send_counts must be {what}")
    if len(counts) != world * per_rank:
        raise errors.InvalidArgumentError(
            f"{op}: send_counts has {len(counts)} entries; give one per rank ({world})"
            if not groups else
            f"{op}: send_counts has {len(counts)} entries; give one per rank and group of W: "
            f"{world} x {groups}")
    if any(c < 0 for c in counts):
        raise errors.InvalidArgumentError(f"{op}: send_counts {counts} has a negative count")
    return counts


def split_groups(flat_counts: list[int], groups: int) -> list[list[int]]:
    """Flat rank-major counts of grouped products -> [world][groups]."""
    return [list(flat_counts[d:d + groups]) for d in range(0, len(flat_counts), groups)]


def group_major(group_counts) -> tuple[np.ndarray, list[int]]:
    """Rows ordered by (destination, group) -> the permutation that orders them group-major
    (each group's rows together, destinations in order inside it) and the rows per group."""
    counts = np.asarray(group_counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    pieces = [np.arange(starts[d, g], starts[d, g] + counts[d, g])
              for g in range(counts.shape[1]) for d in range(counts.shape[0])]
    perm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return perm, [int(v) for v in counts.sum(axis=0)]


def grouped_products(x: torch.Tensor, w: torch.Tensor, group_counts) -> torch.Tensor:
    """Y [M, N] with Y's rows of segment (d, g) = those rows of x @ w[g] (x's rows ordered by
    (destination, group), w [G, K, N]); products in fp32, Y in x's dtype."""
    perm, sizes = group_major(group_counts)
    index = torch.from_numpy(perm).to(x.device)
    xs = x.index_select(0, index)
    parts = [(xg.float() @ w[g].float()) for g, xg in enumerate(xs.split(sizes))]
    y = torch.empty(x.shape[0], w.shape[-1], dtype=x.dtype, device=x.device)
    if parts:
        y[index] = torch.cat(parts).to(x.dtype)
    return y


def grouped_weight_grad(x: torch.Tensor, gy: torch.Tensor, group_counts) -> torch.Tensor:
    """dW [G, K, N] of grouped_products: dW[g] = (x's rows of group g)^T (gy's), fp32."""
    perm, sizes = group_major(group_counts)
    index = torch.from_numpy(perm).to(x.device)
    xs, gs = x.index_select(0, index).float(), gy.index_select(0, index).float()
    return torch.stack([xg.t() @ gg for xg, gg in zip(xs.split(sizes), gs.split(sizes))])


def rows_exchange(ctx, op: str, x: torch.Tensor, w: Optional[torch.Tensor], send_counts,
                  ) -> tuple[torch.Tensor, list[int]]:
    """Y = x @ w (or Y = x when w is None), rows split by `send_counts`, delivered like
    all_to_all_single. Returns (received rows, rows received from each source).

    Grouped products: with w [G, K, N], send_counts holds world x G counts (rank-major): the
    rows for destination d are G consecutive segments, segment (d, g) multiplied by w[g]."""
    world = ctx.world_size
    ws = workspace(ctx, op)
    problem, n, dcode, counts, group_counts = None, -1, -1, [0] * world, None
    try:
        check_float_dtype(x, f"{op}: X")
        check_device(ctx, x, f"{op}: X")
        if x.dim() != 2:
            raise errors.InvalidArgumentError(f"{op}: X has shape {tuple(x.shape)}; expected [M, K]")
        groups = 0
        if w is not None:
            check_float_dtype(w, f"{op}: W")
            check_device(ctx, w, f"{op}: W")
            if w.dim() not in (2, 3) or w.shape[-2] != x.shape[1] or (w.dim() == 3
                                                                      and w.shape[0] == 0):
                raise errors.InvalidArgumentError(
                    f"{op}: X {tuple(x.shape)} and W {tuple(w.shape)} do not fit; expected "
                    "[M, K] and [K, N], or [G, K, N] with G >= 1 for grouped products")
            if w.dtype != x.dtype:
                raise errors.DTypeError(f"{op}: X is {x.dtype} but W is {w.dtype}")
            groups = int(w.shape[0]) if w.dim() == 3 else 0
        counts = _counts_list(send_counts, world, op, groups)
        if groups:
            group_counts = split_groups(counts, groups)
            counts = [sum(row) for row in group_counts]
        if sum(counts) != x.shape[0]:
            raise errors.InvalidArgumentError(
                f"{op}: send_counts {counts} sum to {sum(counts)}, but X has {x.shape[0]} rows")
        n = int(w.shape[-1]) if w is not None else int(x.shape[1])
        dcode = DTYPE_CODES[x.dtype]
    except errors.RocmoeError as exc:
        problem, counts, group_counts = exc, [0] * world, None
    table = agree(ctx, op, ws.epoch + 1, problem, [n, dcode] + counts)
    if (table[:, 0] != table[0, 0]).any() or (table[:, 1] != table[0, 1]).any():
        got = ", ".join(f"rank {r}: N={int(a)} {CODE_DTYPES[int(b)]}" for r, (a, b) in
                        enumerate(table[:, :2]))
        raise errors.InvalidArgumentError(
            f"{op}: ranks disagree on the row width N or the dtype ({got})")
    matrix = table[:, 2:]                      # [source, destination] row counts
    recv_counts = [int(v) for v in matrix[:, ctx.rank]]
    recv_rows = sum(recv_counts)
    dest_offsets = [int(matrix[:ctx.rank, d].sum()) for d in range(world)]
    most = int(matrix.sum(axis=0).max()) if world else 0  # the same buffer size everywhere
    if ctx.backend != "host":  # GPU backends: the persistent Triton kernel (rocmoe/ops/gpu.py)
        from . import gpu
        arena = gpu.arena_for(ctx)
        # the backward's plain row exchange runs the same kernel with an identity W (exact in
        # every dtype); a copy-only GPU kernel would halve its cost
        w_gpu = w if w is not None else torch.eye(n, dtype=x.dtype, device=x.device)
        plan = gpu.plan_gemm_agreed(arena, matrix, n, gpu.gemm_config(x.device, x.dtype),
                                    group_counts=group_counts)
        return gpu.gemm_all_to_all(arena, x, w_gpu, counts, plan=plan,
                                   group_counts=group_counts), recv_counts
    ws.epoch += 1
    ws.prepare(*workspace_sizes(lib.rocmoe_gemm_a2a_workspace, world, most, n, dcode))
    out = torch.empty((recv_rows, n), dtype=x.dtype, device=ctx.device)
    x_c = x.contiguous()
    keep = [x_c]
    args = ffi.new("rocmoe_gemm_a2a_args *")
    ws.common(args.common)
    args.dtype, args.m, args.k, args.n = dcode, int(x.shape[0]), int(x.shape[1]), n
    if w is None:
        args.x, args.w, args.y = ffi.NULL, ffi.NULL, ptr(x_c)
    elif ctx.backend == "host" and host_gemm_mode() == "torch":
        if group_counts is not None:
            y = grouped_products(x_c, w, group_counts)
        else:
            y = (x_c.float() @ w.float()).to(x.dtype) if x.dtype != torch.float32 else x_c @ w
        keep.append(y)
        args.x, args.w, args.y = ffi.NULL, ffi.NULL, ptr(y)
    else:
        w32 = w.to(torch.float32).contiguous()
        keep.append(w32)
        args.x, args.w, args.y = ptr(x_c), ffi.cast("float *", w32.data_ptr()), ffi.NULL
        if group_counts is not None:
            gc = i64_array([c for row in group_counts for c in row])
            keep.append(gc)
            args.groups, args.group_counts = len(group_counts[0]), gc
    sc, do = i64_array(counts), i64_array(dest_offsets)
    args.send_counts, args.dest_row_offsets = sc, do
    args.recv_rows = recv_rows
    args.out = ptr(out) if recv_rows else ffi.NULL
    _launch(ctx, "gemm_all_to_all", args, op)
    return out, recv_counts
