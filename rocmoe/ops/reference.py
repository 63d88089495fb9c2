"""Unfused references of the fused ops: compute with torch, then communicate with MPI
(`Alltoallv` / `Allreduce` of mpi4py on the context's communicator). Same signatures and
results as rocmoe.ops (fp32 accumulation, outputs in the input dtype), with autograd.

They are the baselines of `rocmoe bench fused` and the oracle of tests/ops. They move bytes
with MPI.BYTE so that bfloat16 (which numpy lacks) travels unchanged. They assume valid input
(the tests check the fused ops' validation, not these).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._common import resolve_context

_GRAD_ANCHOR = torch.empty(0, requires_grad=True)


def _comm(ctx):
    return ctx.comm


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.view(torch.uint8).reshape(-1).numpy() if t.numel() else np.empty(0, np.uint8)


def alltoallv_rows(ctx, rows: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """MPI all_to_all_single of a [M, ...] tensor: send_counts[d] leading rows go to rank d.
    Returns (received rows, rows from each source)."""
    world = ctx.world_size
    tail = tuple(rows.shape[1:])
    row_bytes = int(np.prod(tail, dtype=np.int64)) * rows.element_size()
    if world == 1:
        return rows.clone(), [int(rows.shape[0])]
    from mpi4py import MPI
    comm = _comm(ctx)
    recv_counts = comm.alltoall([int(c) for c in send_counts])
    send = _bytes(rows)
    out = torch.empty((sum(recv_counts),) + tail, dtype=rows.dtype)
    recv = _bytes(out) if out.numel() else np.empty(0, np.uint8)
    sc = np.array(send_counts, dtype=np.int64) * row_bytes
    rc = np.array(recv_counts, dtype=np.int64) * row_bytes
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
    comm.Alltoallv([send, (sc.tolist(), sd.tolist()), MPI.BYTE],
                   [recv, (rc.tolist(), rd.tolist()), MPI.BYTE])
    if out.numel():
        out = torch.from_numpy(recv).view(rows.dtype).reshape(out.shape)
    return out, list(recv_counts)


# ---- embedding ---------------------------------------------------------------------------------
def _bags(weights, indices, offsets, mode, psw):
    """[B, t_r, D] fp32 of this rank's tables (torch's EmbeddingBag)."""
    cols = []
    for t, w in enumerate(weights):
        cols.append(F.embedding_bag(indices[t].to(torch.int64), w.float(),
                                    offsets[t].to(torch.int64), mode=mode,
                                    per_sample_weights=None if psw is None else psw[t].float()))
    return torch.stack(cols, dim=1) if cols else None


class _EmbeddingA2A(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, mode, n_tables, psw_given, anchor, *tensors):
        weights = list(tensors[:n_tables])
        indices = list(tensors[n_tables:2 * n_tables])
        offsets = list(tensors[2 * n_tables:3 * n_tables])
        psw = list(tensors[3 * n_tables:4 * n_tables]) if psw_given else None
        world = ctx.world_size
        counts = _comm(ctx).allgather((n_tables, offsets[0].numel() if n_tables else -1,
                                       weights[0].shape[1] if n_tables else -1,
                                       str(weights[0].dtype) if n_tables else "")) \
            if world > 1 else [(n_tables, offsets[0].numel(), weights[0].shape[1],
                                str(weights[0].dtype))]
        known = next(c for c in counts if c[0] > 0)
        batch, dim = known[1], known[2]
        dtype = getattr(torch, known[3].split(".")[-1])
        local = batch // world
        total = sum(c[0] for c in counts)
        if n_tables:
            cols = _bags(weights, indices, offsets, mode, psw).to(dtype)  # [B, t_r, D]
            send = cols.reshape(world, local, n_tables, dim).reshape(world * local * n_tables, dim)
        else:
            send = torch.empty((0, dim), dtype=dtype)
        got, _ = alltoallv_rows(ctx, send, [local * n_tables] * world)
        parts, at = [], 0
        for s in range(world):
            rows = local * counts[s][0]
            parts.append(got[at:at + rows].reshape(local, counts[s][0], dim))
            at += rows
        out = torch.cat(parts, dim=1) if total else torch.empty((local, 0, dim), dtype=dtype)
        fctx.ctx, fctx.mode, fctx.counts, fctx.local = ctx, mode, counts, local
        fctx.n_tables, fctx.psw_given = n_tables, psw_given
        fctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(fctx, grad):
        ctx, counts, local, nt = fctx.ctx, fctx.counts, fctx.local, fctx.n_tables
        world, dim = ctx.world_size, grad.shape[2]
        tensors = fctx.saved_tensors
        # back to the owners: owner r gets [local, t_r, D] of this rank's bags
        pieces, start = [], 0
        for s in range(world):
            pieces.append(grad[:, start:start + counts[s][0]].reshape(-1, dim))
            start += counts[s][0]
        send = torch.cat(pieces) if pieces else grad.new_empty((0, dim))
        got, _ = alltoallv_rows(ctx, send.contiguous(), [local * counts[s][0] for s in range(world)])
        grads = [None] * len(tensors)
        if nt:
            g = got.reshape(world, local, nt, dim).reshape(world * local, nt, dim)  # [B, t_r, D]
            weights = [t.detach().float().requires_grad_(True) for t in tensors[:nt]]
            psw = ([t.detach().float().requires_grad_(True) for t in tensors[3 * nt:4 * nt]]
                   if fctx.psw_given else None)
            with torch.enable_grad():
                bags = _bags(weights, tensors[nt:2 * nt], tensors[2 * nt:3 * nt], fctx.mode, psw)
                inputs = weights + (psw or [])
                res = torch.autograd.grad(bags, inputs, g.float(), allow_unused=True)
            for t in range(nt):
                grads[t] = res[t].to(tensors[t].dtype)
            if psw is not None:
                for t in range(nt):
                    grads[3 * nt + t] = res[nt + t].to(tensors[3 * nt + t].dtype)
        return (None, None, None, None, None, *grads)


def embedding_all_to_all(weights: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                         offsets: Sequence[torch.Tensor], mode: str = "sum",
                         per_sample_weights: Optional[Sequence[torch.Tensor]] = None,
                         ctx=None) -> torch.Tensor:
    """EmbeddingBag per table, then MPI Alltoallv of the bags to their ranks."""
    ctx = resolve_context(ctx)
    nt = len(weights)
    tensors = list(weights) + list(indices) + list(offsets) + list(per_sample_weights or [])
    # the backward is collective: an anchor that requires grad makes every rank run it, also
    # one without tables (same convention as rocmoe.ops)
    anchor = _GRAD_ANCHOR if torch.is_grad_enabled() else torch.empty(0)
    return _EmbeddingA2A.apply(ctx, mode, nt, per_sample_weights is not None, anchor, *tensors)


# ---- gemv ----------------------------------------------------------------------------------------
class _GemvAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, w, x):
        y = (w.float() @ x.float()).contiguous()
        if ctx.world_size > 1:
            from mpi4py import MPI
            buf = y.numpy()
            _comm(ctx).Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        fctx.save_for_backward(w, x)
        return y.to(w.dtype)

    @staticmethod
    def backward(fctx, gy):
        w, x = fctx.saved_tensors
        g = gy.float()
        return None, torch.outer(g, x.float()).to(w.dtype), (w.float().t() @ g).to(x.dtype)


def gemv_all_reduce(W_local: torch.Tensor, x_local: torch.Tensor, ctx=None) -> torch.Tensor:  # noqa: N803
    """matmul, then MPI Allreduce (fp32)."""
    return _GemvAllReduce.apply(resolve_context(ctx), W_local, x_local)


# ---- gemm ----------------------------------------------------------------------------------------
class _RowsAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, y, send_counts):
        out, recv = alltoallv_rows(ctx, y, send_counts)
        fctx.ctx, fctx.recv = ctx, recv
        return out

    @staticmethod
    def backward(fctx, gy):
        g, _ = alltoallv_rows(fctx.ctx, gy.contiguous(), fctx.recv)
        return None, g, None


def gemm_all_to_all(X: torch.Tensor, W: torch.Tensor, send_counts, ctx=None) -> torch.Tensor:  # noqa: N803
    """matmul (fp32), then MPI Alltoallv of the rows (after an alltoall of the counts); autograd
    differentiates the matmul, the exchange's backward is the reverse exchange. Grouped
    (W [G, K, N], send_counts [world, G]): each segment's own matmul, then the same."""
    ctx = resolve_context(ctx)
    if W.dim() == 3:
        counts = torch.as_tensor(send_counts, dtype=torch.int64).reshape(-1, W.shape[0])
        pieces, at = [], 0
        for row in counts.tolist():
            for g, rows in enumerate(row):
                pieces.append((X[at:at + rows].float() @ W[g].float()).to(X.dtype))
                at += rows
        y = torch.cat(pieces) if pieces else X.new_zeros((0, W.shape[-1]))
        return _RowsAllToAll.apply(ctx, y, [int(v) for v in counts.sum(1)])
    counts = send_counts.tolist() if isinstance(send_counts, torch.Tensor) else list(send_counts)
    y = (X.float() @ W.float()).to(X.dtype)
    return _RowsAllToAll.apply(ctx, y, [int(c) for c in counts])
