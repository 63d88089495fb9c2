"""The local algebra of the fused ops' host paths and backward passes: grouped products over
(destination, group) segments, and the EmbeddingBag gradient. Shared by the functional ops
(rocmoe/ops/_ops.py) and the handles (rocmoe/ops/handles/)."""

from __future__ import annotations

import numpy as np
import torch


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


# indices per piece of an EmbeddingBag gradient: bounds the [piece, D] fp32 rows it gathers
# (26 DLRM tables of 65536 lookups at D 128 would be 870 MB at once)
_GRAD_PIECE = 1 << 20


def packed_bag_gradients(weight_shape, dtype, row_base: torch.Tensor, indices, offsets, psw,
                         weight, g_bags: torch.Tensor, mode: str, batch: int):
    """The table gradient [sum rows, D] of packed EmbeddingBag lookups (FBGEMM's
    table-batched layout: table t is rows [row_base[t], row_base[t + 1]) of one weight, bag b
    of table t is indices [offsets[t * batch + b], offsets[t * batch + b + 1])) from the bags'
    gradients g_bags [tables * batch, D], and with `psw` the per-sample-weight gradient
    (which needs the looked-up rows: `weight`). No host reads: an index outside its table
    (which the forward reported) contributes nothing instead of faulting."""
    device = g_bags.device
    idx, off = indices.to(torch.int64), offsets.to(torch.int64)
    starts = off[:-1]
    lengths = off[1:] - starts
    g = g_bags.float()
    if mode == "mean":
        g = g * (1.0 / lengths.clamp(min=1).float())[:, None]
    gw = torch.zeros(tuple(weight_shape), dtype=torch.float32, device=device)
    psw_grads = []
    for j0 in range(0, idx.numel(), _GRAD_PIECE):
        j1 = min(j0 + _GRAD_PIECE, idx.numel())
        # the bag of each index: the last bag starting at or before it
        bag = torch.searchsorted(starts, torch.arange(j0, j1, device=device), right=True) - 1
        bag = bag.clamp(min=0)
        table = torch.div(bag, batch, rounding_mode="floor")
        local = idx[j0:j1]
        inside = (local >= 0) & (local < row_base[table + 1] - row_base[table])
        rows = torch.where(inside, local + row_base[table], 0)
        contrib = g[bag] * inside[:, None]
        if psw is not None:
            psw_grads.append((weight.float()[rows] * contrib).sum(-1))
            contrib = contrib * psw[j0:j1].float()[:, None]
        gw.index_add_(0, rows, contrib)
    psw_grad = None
    if psw is not None:
        psw_grad = (torch.cat(psw_grads) if psw_grads else psw.new_zeros(0).float()).to(psw.dtype)
    return gw.to(dtype), psw_grad


def bag_gradients(shapes, indices, offsets, psw, weights, g_tables: torch.Tensor, mode: str):
    """Dense table gradients, and with `psw` the per-sample-weight gradients (which need the
    looked-up rows: `weights`), of EmbeddingBag lookups from each table's bag gradients
    g_tables [T, batch, D]; `shapes`: each table's ((rows, D), dtype); `offsets`: each
    table's bag starts. Each table is a packed lookup of one table (packed_bag_gradients)."""
    w_grads, psw_grads = [], []
    device = g_tables.device
    for t, ((shape, dtype), idx, off) in enumerate(zip(shapes, indices, offsets)):
        n = idx.numel()
        ends = torch.cat([off.to(torch.int64),
                          torch.full((1,), n, dtype=torch.int64, device=device)])
        # [0, rows] made on the device (no copy from the host; a table may have 0 rows)
        row_base = torch.arange(2, dtype=torch.int64, device=device) * shape[0]
        gw, gp = packed_bag_gradients(shape, dtype, row_base, idx, ends,
                                      None if psw is None else psw[t],
                                      None if weights is None else weights[t], g_tables[t],
                                      mode, g_tables.shape[1])
        w_grads.append(gw)
        if psw is not None:
            psw_grads.append(gp)
    return w_grads, psw_grads
