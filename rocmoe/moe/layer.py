"""DroplessMoE: every token goes through its k experts; no capacity factor, no drops."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigurationError, RocmoeError
from . import blocksparse as bs
from .activations import ACTIVATIONS, FUSABLE
from .dispatch import StaticDispatcher
from .parallel import COMBINES, check_combine, expert_parallel_forward, is_runtime_context, \
    reject_input
from .placement import check_slot_budget, default_slots_per_rank
from .vexpert_routing import VExpertDispatcher
from .permute import check_block_size, permute_pad, unpermute_combine
from .router import Router, _check_config, check_tokens
from .routing import route_and_permute

PLACEMENTS = ("static", "vexpert")


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
    weights); ``"grouped_mm"`` runs the local FFN through ``torch._grouped_mm`` on the
    arrivals regrouped by expert (grouped_ffn.py), then an all-to-all; ``"all_to_all"`` runs
    the block-sparse FFN, then an all-to-all; ``"auto"`` (the default) takes the fused one
    where it can.

    ``placement``: ``"static"`` (the above) or ``"vexpert"`` (FlexMoE): each rank has
    ``slots_per_rank`` expert slots (default E / world and half as many again) and hot experts
    get replicas in free slots, moved by a ``VExpertScheduler`` every ``rebalance_every``
    steps while the balance ratio (max / mean rank load), measured or forecast for the step
    a change takes effect, is above ``balance_threshold``.
    ``w1``/``w2``/``w3`` then have one entry per slot. It starts in the static layout.

    After a forward, ``aux_loss`` is the router's auxiliary loss (scalar) and
    ``tokens_per_expert`` the device-side histogram of this rank's routing.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 activation: str = "gelu", glu: bool = False, block_size: int = 128,
                 ctx=None, *, renormalize: bool = True, jitter_eps: float = 0.0,
                 load_balancing_coef: float = 1e-2, z_loss_coef: float = 1e-3,
                 combine: str = "auto", placement: str = "static",
                 slots_per_rank: Optional[int] = None, rebalance_every: int = 10,
                 balance_threshold: float = 1.05, device=None, dtype=None) -> None:
        super().__init__()
        world = 1 if ctx is None else int(ctx.world_size)
        rank = 0 if ctx is None else int(ctx.rank)
        # Every rank checks its own arguments, then (several ranks) all compare them: a bad
        # or differing argument fails every rank here, not later inside an exchange.
        problem = None
        try:
            slots_per_rank = self._check_arguments(
                hidden_size, ffn_hidden_size, num_experts, top_k, activation, block_size,
                ctx, combine, world, placement, slots_per_rank, rebalance_every,
                balance_threshold)
        except RocmoeError as exc:
            problem = exc
        if world > 1:
            from .rank_agreement import agree_on_fields
            agree_on_fields(ctx, {
                "num_experts": num_experts, "top_k": top_k, "hidden_size": hidden_size,
                "ffn_hidden_size": ffn_hidden_size, "glu": bool(glu), "block_size": block_size,
                "activation": sorted(ACTIVATIONS).index(activation)
                if activation in ACTIVATIONS else -1,
                "combine": COMBINES.index(combine) if combine in COMBINES else -1,
                "placement": PLACEMENTS.index(placement) if placement in PLACEMENTS else -1,
                "slots_per_rank": slots_per_rank or 0,
                "rebalance_every": rebalance_every,
                "balance_threshold_ppm": round(balance_threshold * 1e6)
                if isinstance(balance_threshold, (int, float)) else -1,
            }, "DroplessMoE configuration", problem)
        elif problem is not None:
            raise problem
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
        self.placement = placement
        self.rebalance_every = rebalance_every
        self.balance_threshold = float(balance_threshold)
        self.router = Router(hidden_size, num_experts, top_k, renormalize=renormalize,
                             jitter_eps=jitter_eps, load_balancing_coef=load_balancing_coef,
                             z_loss_coef=z_loss_coef, device=device, dtype=dtype)
        if placement == "vexpert":
            # one weight copy per slot; num_local_experts counts the weight groups here
            self.slots_per_rank = slots_per_rank
            self.num_local_experts = slots_per_rank
            self.dispatcher = VExpertDispatcher(num_experts, world, rank, slots_per_rank,
                                                device=device)
        else:
            self.slots_per_rank = num_experts // world
            self.num_local_experts = num_experts // world
            self.dispatcher = StaticDispatcher(num_experts, world)
        e_local = self.num_local_experts
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(e_local, hidden_size, ffn_hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(e_local, ffn_hidden_size, hidden_size, **kw))
        self.w3 = (nn.Parameter(torch.empty(e_local, hidden_size, ffn_hidden_size, **kw))
                   if glu else None)
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    @staticmethod
    def _check_arguments(hidden_size, ffn_hidden_size, num_experts, top_k, activation,
                         block_size, ctx, combine, world, placement, slots_per_rank,
                         rebalance_every, balance_threshold) -> Optional[int]:
        """Raise for arguments this rank cannot build a layer from; the slot budget (vExpert)."""
        _check_config(hidden_size, num_experts, top_k)
        if not isinstance(ffn_hidden_size, int) or ffn_hidden_size < 1:
            raise ConfigurationError(
                f"ffn_hidden_size must be a positive int, got {ffn_hidden_size!r}")
        if activation not in ACTIVATIONS:
            raise ConfigurationError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                                     f"got {activation!r}")
        check_block_size(block_size)
        check_combine(combine, ctx)
        if num_experts % world != 0:
            raise ConfigurationError(
                f"num_experts={num_experts} must be divisible by the number of ranks "
                f"({world}) for expert parallelism; pick a multiple of {world}")
        if placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {list(PLACEMENTS)}, got "
                                     f"{placement!r}")
        if placement == "static":
            if slots_per_rank is not None:
                raise ConfigurationError("slots_per_rank is for placement='vexpert'; the "
                                         "static placement has num_experts / world slots")
            return None
        if world > 1 and not is_runtime_context(ctx):
            raise ConfigurationError(
                "placement='vexpert' needs a rocmoe Context (rocmoe.init()): replicas are "
                "copied with one-sided puts into the peers' symmetric heaps")
        if not isinstance(rebalance_every, int) or isinstance(rebalance_every, bool) \
                or rebalance_every < 1:
            raise ConfigurationError(
                f"rebalance_every must be a positive int (steps), got {rebalance_every!r}")
        if not isinstance(balance_threshold, (int, float)) or not balance_threshold >= 1.0:
            raise ConfigurationError(
                f"balance_threshold must be a number >= 1.0 (max / mean rank load), got "
                f"{balance_threshold!r}")
        if slots_per_rank is None:
            slots_per_rank = default_slots_per_rank(num_experts, world)
        check_slot_budget(num_experts, world, slots_per_rank)
        return slots_per_rank

    def reset_parameters(self) -> None:
        # vExpert layers start in the static layout: its slots get the very values a static
        # layer draws from the same seed, the free slots zeros
        used = self.num_experts // self.world_size
        for w, fan_in in ((self.w1, self.hidden_size), (self.w2, self.ffn_hidden_size),
                          (self.w3, self.hidden_size)):
            if w is None:
                continue
            with torch.no_grad():
                w[used:].zero_()
            nn.init.normal_(w[:used], std=1.0 / math.sqrt(fan_in))

    def _agree_on_placement(self) -> None:
        if isinstance(self.dispatcher, VExpertDispatcher) and not self.dispatcher.agreed:
            # first step, or after load_state_dict
            from .rank_agreement import allgather_ints
            self.dispatcher.agree(lambda v: allgather_ints(self.ctx, v, "vExpert placement"))

    def reject(self, error: Exception) -> None:
        """Collective, in place of this step's forward call: this rank cannot run the step
        (`error`, raised here). With expert parallelism the peers, inside their forward
        call, raise InvalidArgumentError naming this rank instead of waiting for its rows.
        A model whose input fails before its first MoE layer calls it on that layer."""
        if self.world_size > 1:
            self._agree_on_placement()  # where the peers' forward call begins
            reject_input(self, error)
        raise error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vexpert = isinstance(self.dispatcher, VExpertDispatcher)
        self._agree_on_placement()
        shape = getattr(x, "shape", None)
        try:
            if isinstance(x, torch.Tensor) and x.dim() == 3:
                x = x.reshape(-1, shape[-1])
            check_tokens(x, self.hidden_size, like=self.w1)
        except RocmoeError as exc:
            self.reject(exc)  # the peers must learn of it, or they wait for rows
        expert_ids, weights = self.router.route(x)
        self.aux_loss = self.router.aux_loss
        self.tokens_per_expert = self.router.tokens_per_expert
        if self.world_size == 1:
            groups = self.dispatcher.local_groups(expert_ids) if vexpert else expert_ids
            y = self._local_experts(x, groups, weights)
        else:
            y = expert_parallel_forward(self, x, expert_ids, weights)
        return y.reshape(shape)

    def _local_experts(self, x, expert_ids, weights):
        return local_experts(x, expert_ids, weights, self.w1, self.w2, self.w3,
                             self.block_size, self.activation)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
                f"experts={self.num_experts} ({self.num_local_experts} local), "
                f"top_k={self.top_k}, block={self.block_size}, act={self.activation}, "
                f"glu={self.glu}, placement={self.placement}"
                + (f" ({self.slots_per_rank} slots per rank)" if self.placement == "vexpert"
                   else ""))
