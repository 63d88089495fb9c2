"""Random expert draws the MoE benchmarks share (below both rocmoe.bench.moe and moe_layer)."""

from __future__ import annotations

import torch


def expert_probabilities(kind: str, experts: int, device) -> torch.Tensor:
    """Unnormalised draw probabilities of the experts: uniform, or Zipf(1.0) (p_e ~ 1/(e+1))."""
    if kind == "uniform":
        return torch.ones(experts, device=device)
    if kind == "zipf":
        return 1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32)
    raise ValueError(f"routing must be uniform or zipf, got {kind!r}")
