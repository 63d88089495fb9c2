"""DroplessMoE: every token goes through its k experts; no capacity factor, no drops."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigurationError, RocmoeError
from . import blocksparse as bs
from .activations import ACTIVATIONS, FUSABLE
from .permute import check_block_size, permute_pad, unpermute_combine
from .router import Router, _check_config, check_tokens
from .routing import route_and_permute

def expert_ffn(x, w1, w2, w3, topo, activation, plan=None, rows=None, keep_rows=True):
    """SDD -> act -> DSD on the padded, expert-sorted rows (plus a GLU gate with w3).

    Without GLU the activation is fused into the block-sparse kernels (one pass fewer over
    the [rows, ffn] activations each way); GLU and exact-erf GELU compose the ops instead.
    x: the padded rows; or with the routing `plan`, the tokens themselves (and `rows` their
    permuted copy, if the routing made one): see blocksparse.fused_expert_ffn.
    """
    if w3 is None and activation in FUSABLE:
        return bs.fused_expert_ffn(x, w1, w2, topo, activation, plan, rows, keep_rows)
    if plan is not None:  # the composed products read a permuted copy, with autograd
        x = permute_pad(x, plan)
    act = ACTIVATIONS[activation]
    h = act(bs.sdd(x, w1, topo))
    if w3 is not None:
        h = h * bs.sdd(x, w3, topo)
    return bs.dsd(h, w2, topo)


def local_experts(x, expert_ids, weights, w1, w2, w3, block_size, activation):
    """sum_j weights[t, j] * FFN_{expert_ids[t, j]}(x[t]) over experts w1 [E, H, F],
    w2 [E, F, H] (w3: GLU gate) on this rank: routing, block-sparse FFN, combine."""
    # The fused FFN reads the tokens' rows through the plan (gather_rows) or from a copy the
    # routing makes without autograd ("backward": for the forward only); either way the
    # gradient goes to x directly, so no [rows, H] gradient outlives the FFN's backward.
    gather = bs.KERNEL_CONFIG["gather_rows"]
    with torch.no_grad():
        plan, topo, x_perm = route_and_permute(
            x, expert_ids, w1.shape[0], block_size, w1.shape[2], copy_rows=gather is not True,
            compact_values=bs.KERNEL_CONFIG["compact_values"])
    y_perm = expert_ffn(x, w1, w2, w3, topo, activation, plan=plan, rows=x_perm,
                        keep_rows=gather is False)
    del x_perm  # ("backward": the copy dies with the forward)
    return unpermute_combine(y_perm, weights, plan)


class DroplessMoE(nn.Module):
    """Dropless block-sparse mixture of experts (MegaBlocks-style, zero host syncs).

    Parameters: ``router.weight [E, hidden]``, ``w1 [E, hidden, ffn]``, ``w2 [E, ffn, hidden]``
    and ``w3 [E, hidden, ffn]`` when ``glu``. With a multi-rank ``ctx`` the experts are split
    over ranks (rank r owns a contiguous range of ``E / world`` experts and only their
    weights); tokens travel to the owner of their expert and back.

    ``combine`` (expert parallelism): how expert outputs return to their tokens' ranks.
    ``"gemm_all_to_all"`` fuses each local expert's last GEMM with the return trip
    (``rocmoe.ops.gemm_all_to_all``: needs a rocmoe Context and float32/bfloat16/float16
    weights); ``"all_to_all"`` runs the block-sparse FFN, then an all-to-all; ``"auto"`` (the
    default) takes the fused one where it can.

    After a forward, ``aux_loss`` is the router's auxiliary loss (scalar) and
    ``tokens_per_expert`` the device-side histogram of this rank's routing.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 activation: str = "gelu", glu: bool = False, block_size: int = 128,
                 ctx=None, *, renormalize: bool = True, jitter_eps: float = 0.0,
                 load_balancing_coef: float = 1e-2, z_loss_coef: float = 1e-3,
                 combine: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        _check_config(hidden_size, num_experts, top_k)
        if not isinstance(ffn_hidden_size, int) or ffn_hidden_size < 1:
            raise ConfigurationError(
                f"ffn_hidden_size must be a positive int, got {ffn_hidden_size!r}")
        if activation not in ACTIVATIONS:
            raise ConfigurationError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                                     f"got {activation!r}")
        check_block_size(block_size)
        from .parallel import check_combine
        check_combine(combine, ctx)
        world = 1 if ctx is None else int(ctx.world_size)
        rank = 0 if ctx is None else int(ctx.rank)
        if num_experts % world != 0:
            raise ConfigurationError(
                f"num_experts={num_experts} must be divisible by the number of ranks "
                f"({world}) for expert parallelism; pick a multiple of {world}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.glu = glu
        self.block_size = block_size
        self.ctx = ctx
        self.combine = combine
        self.world_size = world
        self.rank = rank
        self.num_local_experts = num_experts // world
        self.router = Router(hidden_size, num_experts, top_k, renormalize=renormalize,
                             jitter_eps=jitter_eps, load_balancing_coef=load_balancing_coef,
                             z_loss_coef=z_loss_coef, device=device, dtype=dtype)
        e_local = self.num_local_experts
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(e_local, hidden_size, ffn_hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(e_local, ffn_hidden_size, hidden_size, **kw))
        self.w3 = (nn.Parameter(torch.empty(e_local, hidden_size, ffn_hidden_size, **kw))
                   if glu else None)
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=1.0 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.ffn_hidden_size))
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=1.0 / math.sqrt(self.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() == 3:
            x = x.reshape(-1, shape[-1])
        try:
            check_tokens(x, self.hidden_size)
        except RocmoeError as exc:
            if self.world_size > 1:  # the peers must learn of it, or they wait for rows
                from .parallel import reject_input
                reject_input(self, exc)
            raise
        expert_ids, weights = self.router.route(x)
        self.aux_loss = self.router.aux_loss
        self.tokens_per_expert = self.router.tokens_per_expert
        if self.world_size == 1:
            y = self._local_experts(x, expert_ids, weights)
        else:
            from .parallel import expert_parallel_forward
            y = expert_parallel_forward(self, x, expert_ids, weights)
        return y.reshape(shape)

    def _local_experts(self, x, expert_ids, weights):
        return local_experts(x, expert_ids, weights, self.w1, self.w2, self.w3,
                             self.block_size, self.activation)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
                f"experts={self.num_experts} ({self.num_local_experts} local), "
                f"top_k={self.top_k}, block={self.block_size}, act={self.activation}, "
                f"glu={self.glu}")
