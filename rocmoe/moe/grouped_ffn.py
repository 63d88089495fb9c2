"""The local experts' FFN on rows that arrived from several sources, through torch._grouped_mm.

Expert parallelism receives its rows source-major: from source 0 its rows for local group 0,
1, ..., then source 1's, and so on (counts [sources, groups]). ``torch._grouped_mm`` wants
them group-major (one contiguous run per group, its end in ``offs``). ``source_major_ffn``
permutes them there with one gather, runs act(x W1[g]) (times x W3[g] with GLU) and W2[g] as
two (three) grouped products, and gathers the results back to the arrival order, all from
device counts: nothing is read on the host where ``torch._grouped_mm`` runs (CUTLASS on
sm90, bf16 / fp16). Elsewhere it loops ``torch.mm`` over the groups on host counts.

What it measured (DroplessMoE's ``combine="grouped_mm"``, taken only when asked for): on an
H200, on the rows rank 0 of a 2-GPU Zipf run received (28015 rows from two sources, 32 local
experts, bf16), forward + backward took 3.79 / 6.34 ms here against 3.43 / 4.75 ms through
the block-sparse FFN and 2.85 / 3.64 ms through the fused combine's grouped Triton kernels
(hidden 1024 / ffn 4096 and hidden 4096 / ffn 1408; the fused combine with the nineteenth
session's task-table kernel, gpu.grouped_local). torch._grouped_mm alone on group-major rows
took 2.73 / 3.48: the regrouping gathers cost the rest (benchmarks/probe_ep_ffn.py,
results/probe_ep_ffn_h200_nineteenth_session.jsonl). In the twentieth session, with the
grouped kernels launched natively, the fused combine's FFN took 2.65 / 3.42 and 2.74 / 3.45
ms in two runs, torch._grouped_mm 2.75 / 3.63 and 2.84 / 3.55, this module 3.74 / 6.48 and
3.87 / 6.41 (results/probe_ep_ffn_h200_twentieth_session{,_dw_native}.jsonl).

Rows past the arrivals (the handles' upper-bound buffers) keep their place; their results
are undefined and never read: the exchange back sends each source its counted rows only.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, device_index, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for this device and dtype
    (tried once on a tiny problem: support differs by torch version, GPU and dtype)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, device_index) if device_index is not None \
        else torch.device(device_type)
    try:
        x = torch.zeros(16, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.zeros(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
        return True
    except Exception:  # noqa: BLE001 - unsupported here: the mm loop is what a user has
        return False


def uses_grouped_mm(x: torch.Tensor) -> bool:
    return grouped_mm_runs(x.device.type, x.device.index, x.dtype)


def group_major_positions(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64: where each source-major row goes in group-major order, for counts
    [sources, groups] (device or host). Rows past sum(counts) stay where they are, so the
    result is a permutation of range(rows). The device-count form of
    rocmoe.ops.products.group_major (numpy, host counts), whose permutation is this one's
    inverse over the arrived rows."""
    counts = counts.to(torch.int64)
    sources, groups = counts.shape
    flat = counts.reshape(-1)                           # segments (s, g), source-major
    ends = torch.cumsum(flat, 0)
    starts = ends - flat
    by_group = counts.t().reshape(-1)                   # segments (g, s), group-major
    gm_starts = (torch.cumsum(by_group, 0) - by_group).view(groups, sources).t().reshape(-1)
    at = torch.arange(rows, device=counts.device)
    seg = torch.searchsorted(ends, at, right=True).clamp_(max=flat.numel() - 1)
    arrived = at < ends[-1]
    return torch.where(arrived, gm_starts[seg] + at - starts[seg], at)


def group_major_products(x: torch.Tensor, w: torch.Tensor, group_rows: torch.Tensor
                         ) -> torch.Tensor:
    """Group-major rows x [R, K] (group g's group_rows[g] rows in turn, then rows of no
    group) through w [G, K, N]; rows of no group: zeros on the mm loop, undefined through
    ``torch._grouped_mm``."""
    if uses_grouped_mm(x):
        offs = torch.cumsum(group_rows, 0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    sizes = [int(n) for n in group_rows.tolist()]   # the loop needs them on the host
    out = [x_g @ w[g] for g, x_g in enumerate(x[:sum(sizes)].split(sizes))]
    rest = x.new_zeros(x.shape[0] - sum(sizes), w.shape[-1])
    return torch.cat(out + [rest])


def source_major_ffn(received: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                     w2: torch.Tensor, w3, act) -> torch.Tensor:
    """act(x W1[g]) (* x W3[g]) W2[g] of every arrived row, in the arrival order (see the
    module): received [R, H], counts [sources, groups]; autograd through the gathers and the
    grouped products."""
    to_group = group_major_positions(counts, received.shape[0])
    from_group = torch.empty_like(to_group).scatter_(
        0, to_group, torch.arange(to_group.numel(), device=to_group.device))
    x = received.index_select(0, from_group)
    group_rows = counts.to(torch.int64).sum(dim=0)
    h = act(group_major_products(x, w1, group_rows))
    if w3 is not None:
        h = h * group_major_products(x, w3, group_rows)
    return group_major_products(h, w2, group_rows).index_select(0, to_group)


__all__ = ["grouped_mm_runs", "uses_grouped_mm", "group_major_positions",
           "group_major_products", "source_major_ffn"]
