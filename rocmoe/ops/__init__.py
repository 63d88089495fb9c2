"""Fused communication-computation ops (DESIGN.md, "Fused ops").

    import rocmoe, rocmoe.ops
    ctx = rocmoe.init()
    emb = rocmoe.ops.embedding_all_to_all(tables, indices, offsets)      # [B/world, T, D]
    y = rocmoe.ops.gemv_all_reduce(W_local, x_local)                     # [N], on every rank
    y = rocmoe.ops.gemm_all_to_all(X, W, send_counts)                    # like all_to_all_single

Each is also `torch.ops.rocmoe.<name>` (autograd, fake kernels, torch.compile). Every call is
collective: all ranks call the same ops in the same order. Bad input on any rank raises a
RocmoeError on every rank before anything is sent. The unfused baselines (compute, then MPI
Alltoallv / Allreduce) are `rocmoe.ops.reference.*`.

The fast path is the persistent handles (rocmoe/ops/handles/): `GemmAllToAll`,
`AllToAllRows`, `EmbeddingAllToAll`, `GemvAllReduce`, created once and then called with no
host collective, no host synchronisation, and capturable in CUDA/HIP graphs. The functions
above run on cached handles after agreeing on every call's shapes on the host; a call that
neither autograd nor a tracer takes part in skips the custom op's dispatch (`_direct`). At
world size 1 on a GPU such a call, when its last call's handle takes it, goes straight to
that handle (the repeat path: no agreement, no sync), so it can be captured in a CUDA graph
too, once a first call of its shapes ran outside the capture.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.overrides import has_torch_function

from .. import errors
from . import _kernels, _ops  # noqa: F401  (registers torch.ops.rocmoe.*)
from . import reference  # noqa: F401  (mpi4py is imported only when a reference runs)
from ._common import PLAIN_TENSORS, context_id, resolve_context
from ._kernels import BAD_COUNTS
from .handles import (AllToAllRows, EmbeddingAllToAll, GemmAllToAll, GemvAllReduce, pack_lookups,
                      pack_tables)

__all__ = ["embedding_all_to_all", "gemv_all_reduce", "gemm_all_to_all", "release_workspaces",
           "GemmAllToAll", "AllToAllRows", "EmbeddingAllToAll", "GemvAllReduce", "pack_tables",
           "pack_lookups",
           "reference"]


def release_workspaces(ctx=None) -> None:
    """Collective: free the symmetric workspaces of the functional ops' cached handles (they
    are made again on next use), e.g. before ctx.finalize() to reuse the heap."""
    _kernels.release_handles(resolve_context(ctx))

# Empty leaves passed to the ops whose backward is collective (embedding, GEMM): one that
# requires grad makes every rank record the op's backward, also a rank without tables or with
# frozen inputs. A module-level leaf (not one made per call) is what torch.compile traces as
# a graph input that requires grad. The anchor lives on the context's device: autograd wants
# its (empty) gradient there, and that gradient is computed from the exchanged rows.
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)
_NO_GRAD_ANCHOR = torch.empty(0)
_GRAD_ANCHORS = {torch.device("cpu"): _GRAD_ANCHOR}


def _anchor(ctx) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return _NO_GRAD_ANCHOR
    anchor = _GRAD_ANCHORS.get(ctx.device)
    if anchor is None:
        anchor = _GRAD_ANCHORS[ctx.device] = torch.empty(0, device=ctx.device, requires_grad=True)
    return anchor


# how many torch-dispatch modes are active, and whether a torch.func transform (vmap, grad,
# ...) is (None where torch does not say: then every call goes through the dispatcher)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
# whether a torch-function mode is active (has_torch_function says so only for a sequence
# that holds a tensor; `_direct_call` asks before looking at any tensor)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _direct_call() -> bool:
    """The call-wide half of `_direct`: grad mode off, not compiling, no torch-function or
    torch-dispatch mode and no torch.func transform active."""
    return not (torch.is_grad_enabled() or _dispatch_modes is None or _transforms_active is None
                or _function_modes is None or torch.compiler.is_compiling()
                or _dispatch_modes() or _transforms_active() or _function_modes())


def _direct(tensors) -> bool:
    """An eager call that neither autograd nor a tracer takes part in: grad mode off, not
    compiling, plain tensors or Parameters, no torch-function or torch-dispatch mode and no
    torch.func transform active. Such a call runs the op's eager implementation
    (rocmoe.ops._kernels) itself: going through the custom op (torch.library's autograd wrapper and the
    dispatcher) cost 23-44 us of host time a call on this project's CI host
    (benchmarks/probe_functional_host.py), half a GEMV call. Every other call takes the
    custom op, so autograd, torch.compile, torch.func, fake tensors and modes see the op as
    before."""
    if not _direct_call():
        return False
    # (a loop, not all() over a generator: this runs before every direct call's launch)
    for t in tensors:
        if type(t) not in PLAIN_TENSORS:  # (the tensor types a direct call takes)
            return False
    return not has_torch_function(tensors)


def _checked_eagerly(ctx, tensors) -> bool:
    """A real (not traced) call with an argument that is not a tensor, or a tensor off the
    context's device. Such a call must not go through the dispatcher: it would raise its own
    RuntimeError for a list where it wants a tensor, and a meta tensor would select the fake
    kernel, on this rank alone, while the other ranks wait in vain; the eager path validates
    it and raises a RocmoeError on every rank instead."""
    if torch.compiler.is_compiling():
        return False
    device = ctx.device
    return any(not isinstance(t, torch.Tensor) or t.device != device for t in tensors)


def _as_list(seq):
    """A per-table argument as a list (a list, tuple, generator or a stacked tensor's rows);
    anything that is not iterable as it is, for the checks to name on every rank."""
    try:
        return list(seq)
    except TypeError:
        return seq


def embedding_all_to_all(weights: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                         offsets: Sequence[torch.Tensor], mode: str = "sum",
                         per_sample_weights: Optional[Sequence[torch.Tensor]] = None,
                         ctx=None) -> torch.Tensor:
    """Table-wise model-parallel EmbeddingBag + all-to-all.

    weights: this rank's tables (a contiguous range of the global tables), each [rows_t, D];
    indices / offsets: their lookups over the whole global batch (offsets = bag starts, one
    per bag; an empty bag gives zeros), a 1-D tensor a table or stacked, a 2-D tensor whose
    row t is table t's; per_sample_weights: with mode="sum" only.
    Returns [B_global // world, T_total, D]: this rank's bags, all tables in global order."""
    ctx = resolve_context(ctx)
    weights = _as_list(weights)
    # a repeat of the last call at world size 1 may go to its handle before any per-tensor
    # check: the handle takes only tables it adopted (plain tensors or Parameters,
    # gpu.TableEmbeddingLaunch._adopt), and its writer checks each table's lookups as it
    # writes their words (rocmoe/ops/gpu/records.py); what it declines is checked below.
    # (`_direct`'s loop over every tensor cost about 2.8 of this prologue's 6.5 us at 26
    # listed tables on the CI host)
    direct = per_sample_weights is None and type(weights) is list and _direct_call()
    if direct and type(indices) is torch.Tensor and type(offsets) is torch.Tensor:
        # stacked lookups: written from the two tensors as they are (iterating their rows
        # as tensors would make a view of each: the host time of two tensors a table)
        repeat = _kernels.embedding_repeat(ctx, weights, indices, offsets, mode)
        if repeat is not None:
            return repeat[0]
    indices, offsets = _as_list(indices), _as_list(offsets)
    # (offered and declined: embedding_forward need not offer these lists again)
    offered = direct and type(indices) is list and type(offsets) is list
    if offered:
        repeat = _kernels.embedding_repeat(ctx, weights, indices, offsets, mode)
        if repeat is not None:
            return repeat[0]
    psw = None if per_sample_weights is None else _as_list(per_sample_weights)
    if not (type(weights) is list and type(indices) is list and type(offsets) is list
            and (psw is None or type(psw) is list)):
        # an argument that is not a sequence: the eager path names it on every rank
        return _kernels.embedding_forward(ctx, weights, indices, offsets, mode, psw)[0]
    tensors = weights + indices + offsets + (psw or [])
    if _direct(tensors) or _checked_eagerly(ctx, tensors):
        return _kernels.embedding_forward(ctx, weights, indices, offsets, mode, psw,
                                          offer_repeat=not offered)[0]
    layout = ""
    if torch.compiler.is_compiling():
        # the fake kernel needs the global shape: use the layout agreed in an eager call with
        # the same local shapes; the op re-checks it against all ranks at run time
        key = (context_id(ctx), _kernels.table_signature(weights, offsets, mode, psw))
        layout = _ops.format_layout(_kernels.recorded_layouts.get(key, []))
        if not layout:
            raise errors.ConfigurationError(
                "embedding_all_to_all under torch.compile needs one eager call with the same "
                "table shapes first (the output's global shape comes from the other ranks)")
    anchor = _anchor(ctx)
    out, _ = torch.ops.rocmoe.embedding_all_to_all(weights, indices, offsets, psw or [],
                                                   psw is not None, mode, layout,
                                                   context_id(ctx), anchor)
    return out


def gemv_all_reduce(W_local: torch.Tensor, x_local: torch.Tensor, ctx=None) -> torch.Tensor:  # noqa: N803
    """y = sum over ranks r of W_r @ x_r ([N]), identical on every rank. W_local is [N, K_r],
    x_local [K_r]. Two-phase direct all-reduce: reduce-scatter by stores into each chunk's
    owner, then all-gather by stores."""
    ctx = resolve_context(ctx)
    if _direct((W_local, x_local)) or _checked_eagerly(ctx, (W_local, x_local)):
        return _kernels.gemv_forward(ctx, W_local, x_local)
    return torch.ops.rocmoe.gemv_all_reduce(W_local, x_local, context_id(ctx))


def gemm_all_to_all(X: torch.Tensor, W: torch.Tensor, send_counts, ctx=None) -> torch.Tensor:  # noqa: N803
    """Y = X @ W; rows of Y go to the ranks in order, send_counts[d] rows to rank d (a list of
    ints or a 1-D integer tensor summing to M). Returns the rows received, from rank 0 first,
    like all_to_all_single: [sum of what every rank sends here, N].

    Grouped products (one collective for several weights, e.g. a rank's local experts): W is
    [G, K, N] and send_counts is [world, G] (a list of lists or a 2-D integer tensor): the
    rows for rank d are G consecutive segments, send_counts[d][g] rows multiplied by W[g].
    What arrives is unchanged: from each source in rank order, its rows for this rank (in
    its group order)."""
    ctx = resolve_context(ctx)
    direct = _direct((X, W))
    declined = False  # the repeat declined these counts, already plain ints
    if direct and type(send_counts) is list:
        # a repeat of the last call at world size 1 on a GPU, counts as given (the lean call
        # takes only ints): straight to the cached handle, before the conversions below
        # (about 1 us of the function's host time, benchmarks/probe_function_layers_cpu.py)
        repeat = _kernels.gemm_repeat(ctx, X, W, send_counts)
        if repeat is not None:
            return repeat[0]
        # (the conversion below leaves plain ints as they are: no second offer of them)
        declined = all(type(c) is int for c in send_counts)
    grouped = isinstance(W, torch.Tensor) and W.dim() == 3
    if isinstance(send_counts, torch.Tensor):
        if send_counts.dim() != (2 if grouped else 1) or send_counts.is_floating_point():
            # the op reports this on every rank (raising here would leave the others waiting)
            send_counts = list(BAD_COUNTS)
        else:
            send_counts = [int(c) for c in send_counts.reshape(-1).tolist()]
    else:
        try:
            if grouped:
                send_counts = [int(c) for row in send_counts for c in row]
            else:
                send_counts = [int(c) for c in send_counts]
        except (TypeError, ValueError):
            send_counts = list(BAD_COUNTS)
    if direct or _checked_eagerly(ctx, (X, W)):
        return _kernels.rows_exchange(ctx, "gemm_all_to_all", X, W, send_counts,
                                      repeat=not declined)[0]
    anchor = _anchor(ctx)
    y, _ = torch.ops.rocmoe.gemm_all_to_all(X, W, send_counts, context_id(ctx), anchor)
    return y
