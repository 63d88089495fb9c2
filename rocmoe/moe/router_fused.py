"""The router's softmax, top-k, renormalisation, histogram and aux losses as three Triton
launches (forward two, backward one) around the fp32 gate matmul.

What it computes is `Router.route_reference` exactly (the torch ops, kept as the reference
and for CPU tensors): the same fp32 logits (the same `x.float() @ W.float().t()`), the
k largest by logit, the lowest index first among equal logits (torch.topk leaves the order
of ties unspecified), weights renormalised in fp32 and stored in x's dtype, tokens per
expert, and `aux = lb_coef * load_balancing_loss + z_coef * z_loss`. It saves for the
backward what the torch ops' autograd does not need to keep: the logits, each token's
log-sum-exp and the picked ids, not the fp32 copy of x (T x H x 4 bytes) that the gate
matmul's autograd keeps; the backward converts x again.

Why: the torch router was ~30 small ops with autograd, about 0.7 ms of host time a forward
on an H200's host (benchmarks/probe_layer_host.py) where its GPU work is a few
microseconds, and a quarter of a small layer's step.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._triton import pow2_at_least, sm_count

# the largest expert count whose [rows, experts] logits tile one program keeps in registers
MAX_EXPERTS = 1024
_TILE = 4096  # elements of a program's [BLOCK_T, E_POW2] tile


def supported(num_tokens: int, num_experts: int) -> bool:
    """Whether the fused launches take this shape (the torch ops take every other)."""
    return num_tokens > 0 and num_experts <= MAX_EXPERTS


class _Plan:
    """The launch parameters of one (tokens, experts, top-k, coefficients, device)."""
    __slots__ = ("e_pow2", "k_pow2", "block_t", "nprog", "consts", "aux_consts", "bwd_consts",
                 "block_p")

    def __init__(self, t: int, e: int, k: int, renorm: bool, lb: float, z: float, device):
        self.e_pow2 = max(2, pow2_at_least(e))
        self.k_pow2 = max(2, pow2_at_least(k))
        self.block_t = max(2, min(128, _TILE // self.e_pow2))
        blocks = -(-t // self.block_t)
        # persistent: at most a few programs an SM, so the partial sums stay few
        self.nprog = max(1, min(blocks, 2 * sm_count(device)))
        self.block_p = max(2, min(64, pow2_at_least(self.nprog)))
        self.consts = dict(TOP_K=k, K_POW2=self.k_pow2, E_POW2=self.e_pow2,
                           BLOCK_T=self.block_t, RENORM=renorm)
        self.aux_consts = dict(TOP_K=k, E_POW2=self.e_pow2, BLOCK_P=self.block_p,
                               LB_COEF=float(lb), Z_COEF=float(z))
        self.bwd_consts = dict(self.consts, LB_COEF=float(lb), Z_COEF=float(z))


_PLANS: dict = {}


def _plan(t, e, k, renorm, lb, z, device) -> _Plan:
    key = (t, e, k, renorm, lb, z, device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(t, e, k, renorm, lb, z, device)
    return plan


class _FusedRoute(torch.autograd.Function):
    """(x, weight) -> (ids [T, k] int32, weights [T, k] x.dtype, aux loss [] fp32,
    tokens per expert [E] int32); ids and the counts carry no gradient."""

    @staticmethod
    def forward(ctx, x, weight, top_k, renorm, lb_coef, z_coef):
        from . import kernels
        t, e = x.shape[0], weight.shape[0]
        dev = x.device
        plan = _plan(t, e, top_k, renorm, lb_coef, z_coef, dev)
        logits = x.float() @ weight.float().t()
        ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
        w = torch.empty(t, top_k, dtype=x.dtype, device=dev)
        lse = torch.empty(t, dtype=torch.float32, device=dev)
        part_counts = torch.empty(plan.nprog, plan.e_pow2, dtype=torch.int32, device=dev)
        part = torch.empty(plan.nprog, plan.e_pow2 + 1, dtype=torch.float32, device=dev)
        counts = torch.empty(e, dtype=torch.int32, device=dev)
        aux = torch.empty((), dtype=torch.float32, device=dev)
        kernels.launch("router_topk_kernel")[(plan.nprog,)](
            logits, ids, w, lse, part_counts, part, t, e, logits.stride(0), plan.nprog,
            **plan.consts)
        kernels.launch("router_aux_kernel")[(1,)](
            part_counts, part, counts, aux, t, e, plan.nprog, **plan.aux_consts)
        ctx.save_for_backward(x, weight, logits, lse, ids, counts)
        ctx.plan = plan
        ctx.mark_non_differentiable(ids, counts)
        return ids, w, aux, counts

    @staticmethod
    @once_differentiable  # (a second derivative raises; the torch router's has one)
    def backward(ctx, _g_ids, g_w, g_aux, _g_counts):
        from . import kernels
        x, weight, logits, lse, ids, counts = ctx.saved_tensors
        plan = ctx.plan
        t, e = logits.shape
        dl = torch.empty_like(logits)
        g_w = g_w.contiguous()
        kernels.launch("router_backward_kernel")[(-(-t // plan.block_t),)](
            logits, lse, ids, g_w, g_aux, counts, dl, t, e, logits.stride(0), dl.stride(0),
            **plan.bwd_consts)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = (dl @ weight.float()).to(x.dtype) if need_x else None
        gw = (dl.t() @ x.float()).to(weight.dtype) if need_w else None
        return gx, gw, None, None, None, None


def fused_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                load_balancing_coef: float, z_loss_coef: float):
    """(ids, weights, aux_loss, tokens_per_expert) of the router on x (see the module)."""
    return _FusedRoute.apply(x, weight, top_k, renormalize, load_balancing_coef, z_loss_coef)
