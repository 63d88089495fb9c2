"""The functional fused ops (rocmoe.ops.embedding_all_to_all, gemv_all_reduce,
gemm_all_to_all): validate, agree on the host, then call a cached handle.

The functional path keeps the ops' original contract: exact-shape outputs and bad input
raising on every rank before anything is sent. For that it agrees on every call's shapes
(and, for the GEMM, on every rank's send counts) with one bounded host all-gather, which
also tells every rank which cached handle (rocmoe/ops/handles/) to use and when to make
a bigger one: the decision comes from the agreed table, so it is the same on every rank.
The handles are the fast path: no host collective at all per call.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import torch

from .. import errors
from .._triton import pow2_at_least as _round_up
from ._common import (CODE_DTYPES, DTYPE_CODES, INDEX_DTYPES, MODES, agree, check_device,
                      check_float_dtype, check_index_dtype)
from .handles import EmbeddingAllToAll, GemmAllToAll, GemvAllReduce, rows_handle
from .handles.base import _on_gpu, _take_output
from .products import split_groups

# stands for send_counts that were not integers at all (the custom op's schema needs ints)
BAD_COUNTS = (-(2 ** 62),)

# context -> {key: handle}; a key is made only of agreed values, identical on every rank
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# handles kept per context and kind; the least recently used one beyond this is closed
_KEEP = 4


def _cached(ctx, key, fits, make):
    """The cached handle for `key` if it `fits`, else a new one from `make()` (collective:
    keys and `fits` come from agreed values, so every rank decides alike). Least recently
    used first in each context's dict."""
    per_ctx = _CACHE.setdefault(ctx, {})
    handle = per_ctx.pop(key, None)
    if handle is not None and (handle.workspace is None or handle.broken is not None
                               or not fits(handle)):
        if handle.workspace is not None:
            handle.close()
        handle = None
    if handle is None:
        handle = make()
    per_ctx[key] = handle
    same_kind = [k for k in per_ctx if k[0] == key[0]]
    for old in same_kind[:max(0, len(same_kind) - _KEEP)]:
        victim = per_ctx.pop(old)
        if victim.workspace is not None:
            victim.close()
    return handle


def _usable_cached(ctx, kind: str):
    """ctx's cached `kind` handles that are open and not broken."""
    return [handle for key, handle in _CACHE.get(ctx, {}).items()
            if key[0] == kind and handle.workspace is not None and handle.broken is None]


def _recorded_error(ctx, kind: str) -> Optional[Exception]:
    """What the device recorded for ctx's cached `kind` handles (bad input found by a
    kernel of an earlier call), as the exception to raise; None if nothing. No sync."""
    for handle in _usable_cached(ctx, kind):
        try:
            handle.check()
        except errors.RocmoeError as exc:
            return exc
    return None


def _forget_recorded(ctx, kind: str) -> None:
    """Wait for ctx's cached `kind` handles and drop the bad input they recorded (a peer
    reported it); a timed-out wait is still raised."""
    for handle in _usable_cached(ctx, kind):
        try:
            handle.synchronize()
        except errors.InvalidArgumentError:
            pass


def release_handles(ctx) -> None:
    """Collective: close every cached handle of `ctx` (they are made again on next use)."""
    for last in (_EMBEDDING_LAST, _GEMV_LAST, _GEMM_LAST):
        last.pop(ctx, None)
    for handle in _CACHE.pop(ctx, {}).values():
        handle.close()
    from .handles import release_rows_handles
    release_rows_handles(ctx)


_CALLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _next_call(ctx, op: str) -> int:
    """This rank's call number of `op` on `ctx`: the agreement checks that every rank is in
    the same call."""
    per_ctx = _CALLS.setdefault(ctx, {})
    per_ctx[op] = per_ctx.get(op, 0) + 1
    return per_ctx[op]


# ---- embedding bag + all-to-all ------------------------------------------------------------
def embedding_reject(ctx, exc: Exception) -> None:
    """For a caller of embedding_all_to_all whose own input is bad (a model's dense features,
    checked before its lookup): take part in this rank's next call's agreement with `exc`
    instead of making the call, so that every rank raises (the others InvalidArgumentError
    naming this rank) and none waits for it. Raises `exc`."""
    op = "embedding_all_to_all"
    agree(ctx, op, _next_call(ctx, op), exc, [0, -1, -1, -1, -1, 0, 0, 0])
    raise exc  # (agree raised it already; this line is for the type checker)


def _check_embedding(ctx, weights, indices, offsets, mode, psw):
    """Local validation; returns (num_tables, batch, dim, dtype_code), -1 where unknown.
    The values of indices and offsets are checked here on the host backend only: on a GPU
    the handle's kernel checks them on the device (bad input is raised on every rank at the
    handle's next call, synchronize() or ctx.barrier(), like a handle call), since reading a
    device reduction here would make every call wait for the GPU (3.5 ms per call at 8
    tables on an H200)."""
    op = "embedding_all_to_all"
    values_on_host = not _on_gpu(ctx)
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
    bounds = []  # per table: values that must all be <= 0 (read together: one sync on GPUs)
    device = ctx.device
    for t, (w, idx, off) in enumerate(zip(weights, indices, offsets)):
        # the checks' messages are formatted only for a table that fails one (a message
        # formatted for every table cost about a microsecond a table: 26 a DLRM step)
        if (w.dtype not in DTYPE_CODES or idx.dtype not in INDEX_DTYPES
                or off.dtype not in INDEX_DTYPES):
            check_float_dtype(w, f"{op}: table {t}")
            check_index_dtype(idx, f"{op}: indices of table {t}")
            check_index_dtype(off, f"{op}: offsets of table {t}")
        if w.device != device or idx.device != device or off.device != device:
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
        if batch > 0 and values_on_host:
            o = off.to(torch.int64)
            first, last = o[0], o[-1]
            bounds.append(torch.stack([first, -first, (o[1:] < o[:-1]).any().to(torch.int64),
                                       last - n]))
        if n > 0 and values_on_host:
            bounds.append(torch.stack([-idx.min().to(torch.int64),
                                       idx.max().to(torch.int64) - (w.shape[0] - 1)]))
        if psw is not None:
            p = psw[t]
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() != n:
                raise errors.InvalidArgumentError(
                    f"{op}: per_sample_weights of table {t} must be 1-D with one weight per index "
                    f"({n})")
            if not p.is_floating_point():
                raise errors.DTypeError(f"{op}: per_sample_weights of table {t} must be floating")
            check_device(ctx, p, f"{op}: per_sample_weights of table {t}")
    _check_bounds(op, weights, indices, offsets, bounds, batch)
    return nt, batch, dim, DTYPE_CODES[dtype]


def _check_bounds(op, weights, indices, offsets, bounds, batch) -> None:
    """Offsets start at 0, ascend and stay within the indices; indices within their table.
    Every table's checks are reduced on the device and read back together."""
    if not bounds:
        return
    if max(float(v.max()) for v in [torch.cat([b.reshape(-1) for b in bounds])]) <= 0:
        return
    for t, (w, idx, off) in enumerate(zip(weights, indices, offsets)):  # name the culprit
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


# context -> (handle, mode, batch, layout) of its last functional embedding call that the
# general path below ran at world size 1 on a GPU: what _embedding_repeat may run again
_EMBEDDING_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# The repeat paths below, on by default; ROCMOE_REPEAT_CALLS=0 turns them off (read once,
# like the kernels' knobs). tests/ops_gpu/public_ops_script.py checks them (its 1-rank run
# passed on an H100, twenty-fifth session); the A/B is benchmarks/probe_functional_host.py
# with the knob 0 and 1 (same H100: GEMM 70.2 -> 30.4 us of host time a call, GEMV 24.2 ->
# 14.2, the 26-table embedding 155.9 -> 83.0)
_REPEAT = os.environ.get("ROCMOE_REPEAT_CALLS", "1") != "0"


def _embedding_repeat(ctx, weights, indices, offsets, mode):
    """A functional call at world size 1 on a GPU that repeats the last one's tables (the
    same tensors, or ones of their shapes and dtype), mode and batch, run by its handle's
    per-table launch writer (gpu.TableEmbeddingLaunch, the EmbeddingAllToAll handle's own
    fast path), which checks every table's tensors as it writes their records: (output,
    layout), or None when anything differs or any cached embedding handle holds a recorded
    error, and then the general path checks, agrees and names what is wrong.

    Why: with 26 tables the general path's host time was 262-343 us a call on the H200's
    host (checks, agreement, signature, the general writer; results/
    fused_gpu_h200_twentythird_session.jsonl), against 51-77 us for the handle. At world
    size 1 there is nothing to agree with, and a repeat needs nothing the handle's writer
    does not check; a new batch, mode or table shape goes through the general path once,
    which records the layout torch.compile traces with. The output comes from a ring of
    the handle's (rocmoe/ops/outputs.py: one the caller dropped, never one anything still
    refers to), as the handle's own calls' do, which saves an allocation's host time."""
    last = _EMBEDDING_LAST.get(ctx)
    if last is None:
        return None
    handle, last_mode, batch, layout = last
    if (mode != last_mode or not handle._clean()
            or not all(h._clean() for h in _usable_cached(ctx, "embedding"))):
        return None
    launch = handle._table_launch
    if launch is None:
        from . import gpu
        launch = handle._table_launch = gpu.TableEmbeddingLaunch(handle)
    if launch.prepare(weights, indices, offsets, None) != batch:
        return None
    handle.epoch += 1
    out = _take_output(handle, "repeat", (batch, handle.total_tables, handle.dim))
    launch.fire(batch, out)
    return out, layout


def embedding_repeat(ctx, weights, indices, offsets, mode):
    """_embedding_repeat where it applies (repeat paths on, world size 1), else None: for
    embedding_forward, and for a direct call (rocmoe.ops._direct: no autograd, no tracer,
    no mode) whose lookups are stacked, before they are split into rows."""
    if (not _REPEAT or ctx.world_size != 1 or type(weights) is not list
            or type(indices) not in _SEQUENCES or type(offsets) not in _SEQUENCES):
        return None  # (what is not a sequence the general path names)
    return _embedding_repeat(ctx, weights, indices, offsets, mode)


_SEQUENCES = (list, torch.Tensor)  # per-table lookups: listed, or stacked in one tensor


def embedding_forward(ctx, weights, indices, offsets, mode="sum", psw=None,
                      expect: Optional[Sequence[int]] = None,
                      offer_repeat: bool = True) -> torch.Tensor:
    """(output, agreed layout). `offer_repeat=False`: the caller offered these lookups to
    the repeat path already and it declined."""
    op = "embedding_all_to_all"
    if offer_repeat and psw is None and expect is None:
        repeat = embedding_repeat(ctx, weights, indices, offsets, mode)
        if repeat is not None:
            return repeat
    problem, info = None, (0, -1, -1, -1)
    try:
        info = _check_embedding(ctx, weights, indices, offsets, mode, psw)
    except errors.RocmoeError as exc:
        problem = exc
    device_checked = _on_gpu(ctx)
    if problem is None and device_checked:
        problem = _recorded_error(ctx, "embedding")
    expect_hash = layout_hash(expect) if expect else 0
    rows_hash = layout_hash([int(w.shape[0]) for w in weights] or [0]) if problem is None else 0
    most = max([int(i.numel()) for i in indices] or [0]) if problem is None else 0
    try:
        table = agree(ctx, op, _next_call(ctx, op), problem,
                      list(info) + [MODES.get(mode, -1), expect_hash, rows_hash, most])
    except errors.RocmoeError:
        if device_checked and problem is None:
            # a peer raised what the device recorded for an earlier call; this rank's status
            # words hold the same failure (maybe not visible yet): it is reported now, so
            # wait for those calls and drop it rather than raise it again at the next one
            _forget_recorded(ctx, "embedding")
        raise
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
    # one handle per agreed table split (every rank's table count), dim and dtype, big
    # enough for this batch; the tables' sizes and the mode are the call's business
    counts_key = tuple(int(v) for v in table[:, 0])
    nmax = int(table[:, 7].max())

    def make():
        return EmbeddingAllToAll(
            ctx, [int(w.shape[0]) for w in weights], dim,
            _round_up(max(batch, 1) // ctx.world_size) * ctx.world_size, _round_up(nmax),
            mode, CODE_DTYPES[dcode])

    handle = _cached(ctx, ("embedding", counts_key, dim, dcode),
                     lambda h: h.max_batch >= batch and h.max_lookups >= nmax, make)
    out = handle._lookup(weights, indices, offsets, psw, batch, mode) if batch else torch.empty(
        (0, total, dim), dtype=CODE_DTYPES[dcode], device=ctx.device)
    if (_REPEAT and ctx.world_size == 1 and psw is None and expect is None and batch
            and problem is None and handle.mode == mode and _on_gpu(ctx)):
        _EMBEDDING_LAST[ctx] = (handle, mode, batch, layout)
    return out, layout


# ---- GEMV + all-reduce -------------------------------------------------------------------------
# context -> the GemvAllReduce handle of its last functional call at world size 1 on a GPU
_GEMV_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _gemv_repeat(ctx, w_local, x_local) -> Optional[torch.Tensor]:
    """A functional GEMV at world size 1 on a GPU with the shapes, dtype and device of the
    last one, run by its handle after the handle's own quick checks (identity and integer
    comparisons), without the general path's checks, agreement and lookup (about 20 of
    37 us of host time a call on an H100's host, benchmarks/probe_functional_host.py);
    None for anything else, which the general path then checks. The output comes from the
    handle's ring (rocmoe/ops/outputs.py: one the caller dropped, never one anything still
    refers to), as the handle's own calls' do: a torch.empty costs 7-8 us of host time on
    an H200's host (outputs.py)."""
    handle = _GEMV_LAST.get(ctx)
    if (handle is None or not isinstance(w_local, torch.Tensor)
            or not isinstance(x_local, torch.Tensor)):
        return None
    dtype, index = handle.dtype, handle._device_index
    if (w_local.dtype is dtype and x_local.dtype is dtype and index >= 0
            and w_local.get_device() == index and x_local.get_device() == index
            and w_local.shape == handle._w_shape and x_local.shape == handle._x_shape
            and handle._clean()):
        return handle._reduce(w_local, x_local, reuse=True)
    return None


def gemv_forward(ctx, w_local: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
    op = "gemv_all_reduce"
    if _REPEAT and ctx.world_size == 1:
        y = _gemv_repeat(ctx, w_local, x_local)
        if y is not None:
            return y
    problem, n, k, dcode = None, -1, -1, -1
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
        n, k, dcode = int(w_local.shape[0]), int(w_local.shape[1]), DTYPE_CODES[w_local.dtype]
    except errors.RocmoeError as exc:
        problem = exc
    table = agree(ctx, op, _next_call(ctx, op), problem, [n, dcode, k])
    if (table[:, 0] != table[0, 0]).any() or (table[:, 1] != table[0, 1]).any():
        got = ", ".join(f"rank {r}: N={int(a)} {CODE_DTYPES[int(b)]}" for r, (a, b, _) in
                        enumerate(table))
        raise errors.InvalidArgumentError(
            f"{op}: ranks disagree on N or the dtype ({got}); y has the same shape everywhere")
    if n == 0:
        return torch.empty(0, dtype=w_local.dtype, device=ctx.device)
    handle = _cached(ctx, ("gemv", n, dcode), lambda h: True,
                     lambda: GemvAllReduce(ctx, n, k, w_local.dtype))
    if _REPEAT and ctx.world_size == 1 and _on_gpu(ctx):
        _GEMV_LAST[ctx] = handle
    return handle._reduce(w_local, x_local)


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


# context -> the GemmAllToAll handle of its last functional call with one W at world size 1
# on a GPU
_GEMM_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def gemm_repeat(ctx, x, w, send_counts):
    """A functional GEMM at world size 1 on a GPU whose X, W and counts the last call's
    handle's lean call (gpu.lean_gemm_call: dtype, device, K, W's shape, X's layout, the
    count against max_rows) takes, and whose one count is X's rows: (rows, [rows]) without
    the general path's checks, agreement and lookup (about 25 of 53 us of host time a call
    on an H100's host, benchmarks/probe_functional_host.py); None for anything else, which
    the general path then checks."""
    if not _REPEAT:
        return None
    handle = _GEMM_LAST.get(ctx)
    if (handle is None or handle.workspace is None or type(send_counts) is not list
            or len(send_counts) != 1 or not isinstance(x, torch.Tensor) or x.dim() != 2):
        return None
    rows = x.shape[0]
    if send_counts[0] != rows:
        return None
    lean = handle.__dict__.get("_lean")
    taken = lean(x, w, send_counts, True) if lean is not None else None
    if taken is None:
        return None
    out = taken[0]
    # the whole output when it has exactly the rows (a slice is a dispatcher call: ~1 us)
    return (out if out.shape[0] == rows else out[:rows]), [rows]


def rows_exchange(ctx, op: str, x: torch.Tensor, w: Optional[torch.Tensor], send_counts,
                  repeat: bool = True) -> tuple[torch.Tensor, list[int]]:
    """Y = x @ w (or Y = x when w is None), rows split by `send_counts`, delivered like
    all_to_all_single. Returns (received rows, rows received from each source).
    `repeat=False`: the caller offered these counts to gemm_repeat already, which declined.

    Grouped products: with w [G, K, N], send_counts holds world x G counts (rank-major): the
    rows for destination d are G consecutive segments, segment (d, g) multiplied by w[g]."""
    world = ctx.world_size
    if repeat and world == 1 and w is not None:  # (gemm_repeat checks ROCMOE_REPEAT_CALLS)
        repeated = gemm_repeat(ctx, x, w, send_counts)
        if repeated is not None:
            return repeated
    problem, n, dcode, counts, group_counts, groups = None, -1, -1, [0] * world, None, 0
    try:
        for name, t in (("X", x), ("W", w)):
            if not isinstance(t, torch.Tensor) and (t is not None or name == "X"):
                raise errors.InvalidArgumentError(f"{op}: {name} must be a tensor")
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
    k_in = int(x.shape[1]) if problem is None and w is not None else -1
    table = agree(ctx, op, _next_call(ctx, op), problem,
                  [n, dcode, groups if problem is None else -1, k_in] + counts)
    if (table[:, 0] != table[0, 0]).any() or (table[:, 1] != table[0, 1]).any():
        got = ", ".join(f"rank {r}: N={int(a)} {CODE_DTYPES[int(b)]}" for r, (a, b) in
                        enumerate(table[:, :2]))
        raise errors.InvalidArgumentError(
            f"{op}: ranks disagree on the row width N or the dtype ({got})")
    matrix = table[:, 4:]                      # [source, destination] row counts
    recv_counts = [int(v) for v in matrix[:, ctx.rank]]
    recv_rows = sum(recv_counts)
    most = max(int(matrix.max()) if matrix.size else 0, 1)
    dtype = CODE_DTYPES[dcode]
    if w is None:
        handle = rows_handle(ctx, most, n, dtype)
    else:
        # the workspace depends on the capacity, N and the dtype only; K and the groups are
        # the call's business
        handle = _cached(ctx, ("gemm", n, dcode), lambda h: h.max_rows >= most,
                         lambda: GemmAllToAll(ctx, _round_up(most), int(x.shape[1]), n, dtype,
                                              groups=max(groups, 1)))
    if groups == 1:  # one group is the plain product
        w, groups, group_counts = w[0], 0, None
    if _REPEAT and world == 1 and w is not None and not groups and _on_gpu(ctx):
        _GEMM_LAST[ctx] = handle
    flat = [c for row in group_counts for c in row] if group_counts is not None else counts
    # a GPU handle's lean call (rocmoe/ops/gpu/gemm_plans.py: lean_gemm_call) once it has one: the
    # checks above already passed, and it launches without the general path's layers; it
    # declines (None) what it does not take (grouped products, another K, grad), which then
    # takes the general path
    lean = handle.__dict__.get("_lean") if w is not None and not groups else None
    taken = lean(x, w, flat, True) if lean is not None else None
    out = taken[0] if taken is not None else handle._exchange(x, w, flat, None, groups)[0]
    return (out if out.shape[0] == recv_rows else out[:recv_rows]), recv_counts
