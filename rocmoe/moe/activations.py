"""The expert FFN's activations in torch: the layer's choices, and act' for the torch path.

The layer, the block-sparse products' torch path, the reference layers and expert
parallelism (the fused combine applies the activation itself) all use these, so they live
below every one of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

ACTIVATIONS = {
    "gelu": lambda t: F_.gelu(t, approximate="tanh"),
    "gelu_exact": F_.gelu,
    "relu": F_.relu,
    "silu": F_.silu,
}

# the activations the block-sparse kernels compute themselves (in their epilogues / loads)
FUSABLE = ("gelu", "relu", "silu")


def activate(t: torch.Tensor, act: str) -> torch.Tensor:
    """act(t) for a fusable activation name, or t itself for "none"."""
    return t if act == "none" else ACTIVATIONS[act](t)


def widened(t: torch.Tensor) -> torch.Tensor:
    """t in at least fp32 (16-bit inputs are computed in fp32, as the kernels do; float64
    stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def activation_grad(h: torch.Tensor, act: str) -> torch.Tensor:
    """act'(h) in at least fp32, by the same formulas the kernels use."""
    h = widened(h)
    if act == "gelu":
        c = 1.5957691216057308
        sig = torch.sigmoid(c * (h + 0.044715 * h ** 3))
        return sig + h * sig * (1 - sig) * c * (1 + 0.134145 * h * h)
    if act == "relu":
        return (h > 0).to(h.dtype)
    if act == "silu":
        sig = torch.sigmoid(h)
        return sig * (1 + h * (1 - sig))
    return torch.ones_like(h)
