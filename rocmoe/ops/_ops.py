"""torch.ops.rocmoe.*: the fused ops as torch.library custom ops, with autograd and fake
kernels, so that they work in eager mode and inside torch.compile graphs.

Custom ops take plain values only, so the context travels as an int id (see _common) and
the embedding op takes its agreed layout (total tables, this rank's first table, batch, dim,
dtype) as ints: the fake kernel can then give the output shape without any communication.
Row counts that only the peers know (gemm_all_to_all's received rows) are unbacked symbolic
sizes under tracing.

Gradient conventions:
- embedding_all_to_all: the output gradient goes back to the table owners by the reverse
  exchange (all_to_all_rows), then accumulates into dense table gradients (index_add_).
- gemv_all_reduce: y is replicated, so the incoming gradient gy is taken to be identical on
  every rank (it is, when every rank computes the same loss from y, as in row-parallel
  layers); then dW_r = outer(gy, x_r) and dx_r = W_r^T gy, with no communication.
- gemm_all_to_all: the reverse all-to-all of dY gives dY_local [M, N]; dX = dY_local W^T,
  dW = X^T dY_local (grouped, W [G, K, N]: per group, over the rows of its segments).
Gradients are computed in fp32 and returned in the inputs' dtypes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _kernels
from ._common import CODE_DTYPES, context_by_id
from .products import bag_gradients, grouped_products, grouped_weight_grad, split_groups


# ---- all_to_all_rows: the exchange of the backward passes ----------------------------------
@torch.library.custom_op("rocmoe::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: Tensor, send_counts: list[int], recv_rows_hint: int,
                    ctx_id: int) -> tuple[Tensor, Tensor]:
    ctx = context_by_id(ctx_id)
    out, recv = _kernels.rows_exchange(ctx, "all_to_all_rows", x, None, send_counts)
    return out, torch.tensor(recv, dtype=torch.int64)


@all_to_all_rows.register_fake
def _(x, send_counts, recv_rows_hint, ctx_id):
    ctx = context_by_id(ctx_id)
    rows = recv_rows_hint if recv_rows_hint >= 0 else torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((rows, x.shape[1])),
            torch.empty((ctx.world_size,), dtype=torch.int64))


def _reverse_rows(grad: Tensor, counts: list[int], recv_rows_hint: int, ctx_id: int) -> Tensor:
    out, _ = torch.ops.rocmoe.all_to_all_rows(grad.contiguous(), counts, recv_rows_hint, ctx_id)
    return out


# ---- embedding_all_to_all ------------------------------------------------------------------
def format_layout(layout) -> str:
    return ",".join(str(int(v)) for v in layout)


def parse_layout(text: str) -> list[int]:
    return [int(v) for v in text.split(",")] if text else []


@torch.library.custom_op("rocmoe::embedding_all_to_all", mutates_args=())
def embedding_all_to_all(weights: list[Tensor], indices: list[Tensor], offsets: list[Tensor],
                         per_sample_weights: list[Tensor], use_psw: bool, mode: str,
                         layout: str, ctx_id: int, anchor: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (output, agreed layout as int64). `layout` is "" in eager calls (agreed inside),
    or the recorded layout when traced, as comma-separated ints (a string is one leaf for
    autograd's input structure, and the fake kernel can read it); per_sample_weights is [] when unused (the schema has
    no optional list). `anchor` is an empty tensor that requires grad whenever grad mode is on:
    the backward is collective (the reverse exchange), so it must run on every rank, also on
    one without tables or with frozen ones."""
    ctx = context_by_id(ctx_id)
    out, agreed = _kernels.embedding_forward(
        ctx, list(weights), list(indices), list(offsets), mode,
        list(per_sample_weights) if use_psw else None, expect=parse_layout(layout) or None)
    return out, torch.tensor(agreed, dtype=torch.int64)


@embedding_all_to_all.register_fake
def _(weights, indices, offsets, per_sample_weights, use_psw, mode, layout, ctx_id, anchor):
    ctx = context_by_id(ctx_id)
    layout = parse_layout(layout)
    if not layout:
        raise RuntimeError("rocmoe::embedding_all_to_all traced without a layout")
    total, _, batch, dim, dcode = layout[:5]
    return (torch.empty((batch // ctx.world_size, total, dim), dtype=CODE_DTYPES[dcode],
                        device=ctx.device),
            torch.empty((len(layout),), dtype=torch.int64))


def _embedding_setup(ctx, inputs, output):
    weights, indices, offsets, psw, use_psw, mode, layout, ctx_id, _ = inputs
    # traced: the layout is a constant input; eager: the op returned the agreed one
    ctx.meta = (mode, parse_layout(layout) if layout else output[1].tolist(), ctx_id)
    ctx.shapes = [(tuple(w.shape), w.dtype) for w in weights]
    ctx.has_psw = bool(use_psw)
    saved = list(indices) + list(offsets) + (list(psw) if use_psw else [])
    if use_psw:
        saved += list(weights)  # d out / d psw needs the looked-up rows
    ctx.save_for_backward(*saved)


def _embedding_backward(ctx, grad, _glayout):
    mode, layout, ctx_id = ctx.meta
    total, _, batch, dim, _ = layout[:5]
    nt = len(ctx.shapes)
    saved = ctx.saved_tensors
    indices, offsets = saved[:nt], saved[nt:2 * nt]
    psw = saved[2 * nt:3 * nt] if ctx.has_psw else None
    weights = saved[3 * nt:4 * nt] if ctx.has_psw else None
    world = context_by_id(ctx_id).world_size
    local = batch // world
    # grad is [local, total, dim]; owner r gets its tables' columns of this rank's bags, as
    # rows [its tables x local bags] of width dim
    owners = layout[5:5 + world]
    send = [c * local for c in owners]
    g = grad.permute(1, 0, 2).reshape(total * local, dim)
    got = _reverse_rows(g, send, nt * batch, ctx_id)
    # from each source s: [nt, local, dim] -> [nt, batch, dim] in global bag order
    g_tables = got.reshape(world, nt, local, dim).permute(1, 0, 2, 3).reshape(nt, batch, dim)
    w_grads, psw_grads = bag_gradients(ctx.shapes, indices, offsets, psw, weights, g_tables,
                                       mode)
    # list inputs take lists of gradients (None for the integer ones); psw is [] when unused
    none = [None] * nt
    # The anchor's (empty) gradient is made to depend on the exchange so that a graph compiler
    # never prunes the collective on a rank whose tables need no gradient.
    anchor_grad = got.float().sum().mul(0).reshape(1)[:0]
    return (w_grads, none, list(none), psw_grads if psw is not None else [], None, None,
            None, None, anchor_grad)


embedding_all_to_all.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# ---- gemv_all_reduce -----------------------------------------------------------------------
@torch.library.custom_op("rocmoe::gemv_all_reduce", mutates_args=())
def gemv_all_reduce(w_local: Tensor, x_local: Tensor, ctx_id: int) -> Tensor:
    return _kernels.gemv_forward(context_by_id(ctx_id), w_local, x_local)


@gemv_all_reduce.register_fake
def _(w_local, x_local, ctx_id):
    return w_local.new_empty((w_local.shape[0],))


def _gemv_setup(ctx, inputs, output):
    w_local, x_local, _ = inputs
    ctx.save_for_backward(w_local, x_local)


def _gemv_backward(ctx, gy):
    w_local, x_local = ctx.saved_tensors
    g = gy.float()
    dw = torch.outer(g, x_local.float()).to(w_local.dtype)
    dx = (w_local.float().t() @ g).to(x_local.dtype)
    return dw, dx, None


gemv_all_reduce.register_autograd(_gemv_backward, setup_context=_gemv_setup)


# ---- gemm_all_to_all -----------------------------------------------------------------------
@torch.library.custom_op("rocmoe::gemm_all_to_all", mutates_args=())
def gemm_all_to_all(x: Tensor, w: Tensor, send_counts: list[int], ctx_id: int,
                    anchor: Tensor) -> tuple[Tensor, Tensor]:
    """`anchor`: as for embedding_all_to_all, keeps the collective backward on every rank."""
    ctx = context_by_id(ctx_id)
    y, recv = _kernels.rows_exchange(ctx, "gemm_all_to_all", x, w, send_counts)
    return y, torch.tensor(recv, dtype=torch.int64)


@gemm_all_to_all.register_fake
def _(x, w, send_counts, ctx_id, anchor):
    ctx = context_by_id(ctx_id)
    rows = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((rows, w.shape[-1])),
            torch.empty((ctx.world_size,), dtype=torch.int64))


def _gemm_setup(ctx, inputs, output):
    x, w, send_counts, ctx_id, _ = inputs
    _, recv = output
    ctx.ctx_id = ctx_id
    ctx.rows = x.shape[0]
    ctx.send_counts = list(send_counts)
    ctx.save_for_backward(x, w, recv)
    ctx.set_materialize_grads(True)


def _gemm_backward(ctx, gy, _grecv):
    x, w, recv = ctx.saved_tensors
    # rows come back to their source in the order they were sent
    gy_local = _reverse_rows(gy, recv.tolist(), ctx.rows, ctx.ctx_id).float()
    if w.dim() == 3:  # grouped: segment (d, g) of the rows went through W[g]
        group_counts = split_groups(ctx.send_counts, w.shape[0])
        dx = grouped_products(gy_local, w.transpose(1, 2), group_counts).to(x.dtype)
        dw = grouped_weight_grad(x, gy_local, group_counts).to(w.dtype)
    else:
        dx = (gy_local @ w.float().t()).to(x.dtype)
        dw = (x.float().t() @ gy_local).to(w.dtype)
    return dx, dw, None, None, gy_local.sum().mul(0).reshape(1)[:0]


gemm_all_to_all.register_autograd(_gemm_backward, setup_context=_gemm_setup)
