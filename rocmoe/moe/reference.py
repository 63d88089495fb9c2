"""The dropless MoE layer a torch user writes today, on grouped GEMMs: rocmoe's baseline.

``grouped_gemm_moe`` takes the routing (expert ids and gate weights) as given, so that it and
``DroplessMoE`` can run on identical routing: sort the (token, slot) pairs by expert
(``argsort``), gather their tokens, ``torch._grouped_mm``, tanh-GELU, ``torch._grouped_mm``,
and add each pair's weighted row into its token with ``index_add_``. Nothing in it reads the
device on the host where ``torch._grouped_mm`` runs (CUTLASS on sm90). Where it does not
(AMD today, older GPUs), a user loops ``torch.mm`` over the experts, which needs each
expert's row count on the host: one device sync per call, and that is what runs here then.

The benchmark (``rocmoe bench moe --layer``) and the memory tests measure against it.
"""

from __future__ import annotations

import torch

from .activations import ACTIVATIONS
# where torch._grouped_mm runs: decided once, shared with the expert-parallel FFN
from .grouped_ffn import grouped_mm_runs, uses_grouped_mm  # noqa: F401
from .router import expert_histogram


def _expert_products(xs, counts, w1, w2, w3, act, grouped: bool):
    if grouped:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = act(torch._grouped_mm(xs, w1, offs=offs))
        if w3 is not None:
            h = h * torch._grouped_mm(xs, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)
    rows = []
    for e, x_e in enumerate(xs.split(counts.tolist())):  # the host sync of this path
        h = act(x_e @ w1[e])
        if w3 is not None:
            h = h * (x_e @ w3[e])
        rows.append(h @ w2[e])
    return torch.cat(rows)


def grouped_gemm_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None = None,
                     activation: str = "gelu", grouped: bool | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * FFN_{expert_ids[t, j]}(x[t]) for x [T, H],
    expert_ids [T, k], w1 [E, H, F], w2 [E, F, H] (and a GLU gate w3 [E, H, F]).

    ``grouped``: None takes ``torch._grouped_mm`` where it runs, else the loop of ``torch.mm``;
    True / False force one of them."""
    num_tokens, top_k = expert_ids.shape
    grouped = uses_grouped_mm(x) if grouped is None else grouped
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    token = order // top_k
    counts = expert_histogram(expert_ids, w1.shape[0])
    xs = x.index_select(0, token)
    ys = _expert_products(xs, counts, w1, w2, w3, ACTIVATIONS[activation], grouped)
    gates = weights.reshape(-1).index_select(0, order).to(ys.dtype)
    return x.new_zeros(num_tokens, ys.shape[1]).index_add_(0, token, ys * gates[:, None])
