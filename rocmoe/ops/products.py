"""The local algebra of the fused ops' host paths and backward passes: grouped products over
(destination, group) segments, and the EmbeddingBag gradient. Shared by the functional ops
(rocmoe/ops/_ops.py) and the handles (rocmoe/ops/handles.py)."""

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


def bag_gradients(shapes, indices, offsets, psw, weights, g_tables: torch.Tensor, mode: str):
    """Dense table gradients, and with `psw` the per-sample-weight gradients (which need the
    looked-up rows: `weights`), of EmbeddingBag lookups from each table's bag gradients
    g_tables [T, batch, D]; `shapes`: each table's ((rows, D), dtype). All on the tensors'
    device, no host reads (searchsorted keeps shapes static for torch.compile)."""
    w_grads, psw_grads = [], []
    for t, ((shape, dtype), idx, off) in enumerate(zip(shapes, indices, offsets)):
        idx, off = idx.to(torch.int64), off.to(torch.int64)
        n = idx.numel()
        lengths = torch.diff(off, append=torch.full((1,), n, dtype=torch.int64, device=off.device))
        bag = torch.searchsorted(off, torch.arange(n, device=off.device), right=True) - 1
        per_index = g_tables[t].float()[bag]                       # [n, dim]
        if mode == "mean":
            contrib = per_index * (1.0 / lengths.clamp(min=1).float())[bag][:, None]
        elif psw is not None:
            contrib = per_index * psw[t].float()[:, None]
        else:
            contrib = per_index
        gw = torch.zeros(tuple(shape), dtype=torch.float32, device=g_tables.device)
        gw.index_add_(0, idx, contrib)
        w_grads.append(gw.to(dtype))
        if psw is not None:
            psw_grads.append((weights[t].float()[idx] * per_index).sum(-1).to(psw[t].dtype))
    return w_grads, psw_grads
