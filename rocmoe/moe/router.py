"""Top-k softmax router with load-balancing and z-loss.

Everything here is tensor arithmetic on the input's device: no value is read back to the
host, so the router adds no synchronisation to a layer's forward or backward. On a GPU the
softmax, top-k, histogram and aux losses (forward and backward) are three Triton launches
(router_fused.py); `route_reference` is the same router in torch ops.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigurationError, DeviceMismatchError, DTypeError, InvalidArgumentError
from . import router_fused
from .backend import TRITON_DTYPES, use_triton


def _check_config(hidden_size: int, num_experts: int, top_k: int) -> None:
    for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ConfigurationError(
            f"top_k={top_k} is larger than num_experts={num_experts}: each token picks k "
            f"distinct experts, so use top_k <= num_experts")


def check_tokens(x: torch.Tensor, hidden_size: int, what: str = "input",
                 like: Optional[torch.Tensor] = None) -> None:
    """Raise a clear error for an input the layer cannot route (checks metadata only).
    `like`: a parameter of the layer, whose dtype and device the input must have (the
    experts' block-sparse products take one dtype; checked here, before any exchange, a
    rank's mismatch is reported to its peers instead of raised inside the dispatch)."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise DTypeError(f"{what} must be a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise InvalidArgumentError(
            f"{what} must have shape [tokens, {hidden_size}] (or [batch, seq, {hidden_size}]), "
            f"got {tuple(x.shape)}")
    if like is not None:
        if x.dtype != like.dtype:
            raise DTypeError(f"{what} is {x.dtype}, the layer's parameters {like.dtype}; cast "
                             "one to the other")
        if x.device != like.device:
            raise DeviceMismatchError(f"{what} is on {x.device}, the layer's parameters on "
                                      f"{like.device}")


class Router(nn.Module):
    """Linear gate + softmax + top-k.

    ``route(x)`` returns ``(expert_ids [T, k] int32, weights [T, k])`` with weights in
    ``x.dtype``. After each call ``aux_loss`` holds ``lb_coef * load_balancing_loss +
    z_coef * z_loss`` (a scalar tensor with autograd) and ``tokens_per_expert`` the
    device-side histogram of the routing.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 renormalize: bool = True, jitter_eps: float = 0.0,
                 load_balancing_coef: float = 1e-2, z_loss_coef: float = 1e-3,
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_config(hidden_size, num_experts, top_k)
        if jitter_eps < 0 or jitter_eps >= 1:
            raise ConfigurationError(f"jitter_eps must be in [0, 1), got {jitter_eps}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.jitter_eps = jitter_eps
        self.load_balancing_coef = load_balancing_coef
        self.z_loss_coef = z_loss_coef
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device,
                                               dtype=dtype))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(hidden_size))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def _jittered(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_eps > 0:
            # Multiplicative jitter (Switch Transformer): explores routing early in training.
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self._jittered(x)
        # Gating decides which expert gets a token; do it in (at least) fp32 so bf16 rounding
        # cannot flip near-ties differently from the fp32 reference.
        dtype = torch.promote_types(x.dtype, torch.float32)
        return x.to(dtype) @ self.weight.to(dtype).t()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_tokens(x, self.hidden_size)
        if use_triton(x) and self.weight.dtype in TRITON_DTYPES and \
                router_fused.supported(x.shape[0], self.num_experts):
            ids, weights, aux, counts = router_fused.fused_route(
                self._jittered(x), self.weight, self.top_k, self.renormalize, self.load_balancing_coef,
                self.z_loss_coef)
            self.tokens_per_expert, self.aux_loss = counts, aux
            return ids, weights
        return self.route_reference(x)

    def route_reference(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` in torch ops (what runs on CPU tensors; on the GPU `route` runs the same
        maths as three Triton launches, rocmoe/moe/router_fused.py, with the same logits
        and picks)."""
        check_tokens(x, self.hidden_size)
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        expert_ids = top_ids.to(torch.int32)
        counts = expert_histogram(expert_ids, self.num_experts)
        self.tokens_per_expert = counts
        self.aux_loss = (self.load_balancing_coef * load_balancing_loss(probs, counts, self.top_k)
                         + self.z_loss_coef * z_loss(logits))
        return expert_ids, top_w.to(x.dtype)

    forward = route


def expert_histogram(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert as an int32 device tensor.

    ``torch.bincount`` reads the maximum back to the host on GPU to size its output; a
    scatter-add into a buffer of static size ``num_experts`` does not.
    """
    flat = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=expert_ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                        top_k: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss: ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of routed (token, slot) pairs sent to expert e (no gradient) and
    ``P_e`` the mean router probability of e. It equals 1 for perfectly uniform routing.
    """
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    fraction = tokens_per_expert.to(probs.dtype) / float(num_tokens * top_k)
    mean_prob = probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean of logsumexp(logits)^2, keeps gate logits small."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
