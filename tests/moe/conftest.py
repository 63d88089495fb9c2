"""Shared fixtures of the MoE tests: the per-token loop reference the layer must equal."""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "triton_interpret: Triton kernels run by the CPU interpreter (small shapes)")
    config.addinivalue_line("markers", "gpu: needs a CUDA/ROCm device")


def per_token_reference(layer, x):
    """Each token through its k experts, one at a time, weighted sum: the dropless contract.

    Uses the layer's own router output (ids, weights) and its activation, and the full
    [E, ...] weights of a one-rank layer.
    """
    from rocmoe.moe.activations import ACTIVATIONS
    act = ACTIVATIONS[layer.activation]
    ids, weights = layer.router.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(layer.top_k):
            e = int(ids[t, j])
            h = act(x[t] @ layer.w1[e])
            if layer.w3 is not None:
                h = h * (x[t] @ layer.w3[e])
            acc = acc + weights[t, j] * (h @ layer.w2[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


@pytest.fixture
def reference():
    return per_token_reference
