"""Locality-first, capacity-proportional routing of tokens to vExperts (FlexMoE Alg. 3).

Every rank all-gathers the per-expert pair counts of the step (``C [world, E]``, one count
exchange through the transport), so every rank can compute the same assignment
``A [src, expert, dst]`` of pair counts, in integer arithmetic on the device:

1. *quota*: expert e's ``L_e`` pairs of the step split over its vExperts in equal shares;
   the ranks' quotas are ``q[e, d] = floor(L_e * cumR[e, d] / R_e)`` differenced over the
   ranks (exact: they sum to ``L_e``; R[e, d] is e's vExperts on rank d);
2. *locality first*: a rank that holds e keeps its own pairs of e, up to its quota;
3. the rest (pairs of ranks without e, and overflow beyond a local quota) fill the
   replicas' *spare capacity* (quota less what they kept locally): source s's remaining
   pairs and replica d's spare capacity are intervals on one line per expert, and
   ``A[s, e, d]`` is their overlap. Each replica ends exactly at its quota, nothing is
   dropped, and nothing leaves a rank whose copy still has room.

A pair's destination then follows from its index among this rank's pairs of its expert
(stable, token order): the first ``A[me, e, me]`` stay, the next ``A[me, e, 0]`` go to rank
0, and so on. The group on the destination is e's weight slot there. What every rank
receives is known from ``A`` too, so no second count exchange is needed. No value is read
back to the host here: deterministic for a given placement and routing, CUDA-graph safe.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..collective import USER_INTS_MOST
from ..errors import PlacementError
from .dispatch import DispatchPlan
from .placement import Placement, parse_placement
from .router import expert_histogram


def quotas(expert_loads: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """[E, world] int64: each rank's share of each expert's pairs (equal per vExpert)."""
    loads = expert_loads.long()
    reps = replicas.long()
    total = reps.sum(dim=1, keepdim=True).clamp(min=1)
    cum = (loads.unsqueeze(1) * torch.cumsum(reps, dim=1)) // total
    return torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1]))


def assignment(counts: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """A [src, E, dst] int64: pairs of expert e that rank src sends to rank dst.

    counts [world, E]: pairs per (source rank, expert); replicas [E, world]: vExperts per
    (expert, rank), at least one per expert."""
    counts = counts.long()
    world = counts.shape[0]
    quota = quotas(counts.sum(dim=0), replicas)                  # [E, dst]
    holds = replicas.t() > 0                                     # [src, E]
    kept = torch.where(holds, torch.minimum(counts, quota.t()), torch.zeros_like(counts))
    rest = counts - kept                                         # [src, E]
    spare = quota - kept.t()                                     # [E, dst]
    rest_hi = torch.cumsum(rest, dim=0)                          # [src, E]
    rest_lo = rest_hi - rest
    spare_hi = torch.cumsum(spare, dim=1)                        # [E, dst]
    spare_lo = spare_hi - spare
    overlap = (torch.minimum(rest_hi.unsqueeze(2), spare_hi.unsqueeze(0))
               - torch.maximum(rest_lo.unsqueeze(2), spare_lo.unsqueeze(0))).clamp(min=0)
    eye = torch.eye(world, dtype=torch.bool, device=counts.device)
    return overlap + torch.where(eye.unsqueeze(1), kept.unsqueeze(2),
                                 torch.zeros_like(overlap))


def rank_loads(assign: torch.Tensor) -> torch.Tensor:
    """[world] pairs each rank computes under assignment A."""
    return assign.sum(dim=(0, 1))


def balance_ratio_of(loads: torch.Tensor) -> torch.Tensor:
    """max / mean of the ranks' loads as a device scalar (1.0 without load)."""
    loads = loads.double()
    mean = loads.mean()
    return torch.where(mean > 0, loads.max() / mean.clamp(min=1e-30), torch.ones_like(mean))


def pair_destinations(expert_ids: torch.Tensor, assign_row: torch.Tensor, rank: int
                      ) -> torch.Tensor:
    """[T*k] int64 destination rank of each of this rank's pairs.

    assign_row [E, world]: A[rank]. Pairs of expert e, in token order, go first to this
    rank (its kept share), then to ranks 0, 1, ... (their shares)."""
    flat = expert_ids.reshape(-1).long()
    num_experts, world = assign_row.shape
    counts = expert_histogram(expert_ids, num_experts).long()
    order = torch.sort(flat, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    index_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    index = torch.empty_like(index_sorted).scatter_(0, order, index_sorted)
    own = assign_row[:, rank:rank + 1]
    remote = assign_row.clone()
    remote[:, rank] = 0
    bounds = torch.cumsum(torch.cat([own, remote], dim=1), dim=1)   # [E, world + 1]
    step = (index.unsqueeze(1) >= bounds[flat]).sum(dim=1)          # 0: stays; j: rank j-1
    step = step.clamp(max=world)  # defensive: bounds[-1] equals the expert's count
    return torch.where(step == 0, torch.full_like(step, rank), step - 1)


def scatter_counts(assign: torch.Tensor, weight_slots: torch.Tensor, num_groups: int,
                   rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(send [world, G], recv [world, G]) of this rank from A: pairs to (dst rank, slot) and
    from (src rank, slot here)."""
    world = assign.shape[0]
    slots = weight_slots.long()                                      # [E, world]
    valid = slots >= 0
    safe = slots.clamp(min=0)
    # send: A[rank, e, d] -> (d, slot of e on d)
    mine = torch.where(valid, assign[rank], torch.zeros_like(assign[rank]))
    dst = torch.arange(world, device=assign.device).unsqueeze(0).expand_as(safe)
    send = torch.zeros(world * num_groups, dtype=torch.int64, device=assign.device)
    send.scatter_add_(0, (dst * num_groups + safe).reshape(-1), mine.reshape(-1))
    # recv: A[s, e, rank] -> (s, slot of e here)
    here = assign[:, :, rank]                                        # [src, E]
    here = torch.where(valid[:, rank].unsqueeze(0), here, torch.zeros_like(here))
    src = torch.arange(world, device=assign.device).unsqueeze(1).expand_as(here)
    recv = torch.zeros(world * num_groups, dtype=torch.int64, device=assign.device)
    recv.scatter_add_(0, (src * num_groups + safe[:, rank].unsqueeze(0)).reshape(-1),
                      here.reshape(-1))
    return send.view(world, num_groups), recv.view(world, num_groups)


class VExpertDispatcher(nn.Module):
    """The dispatcher of a ``placement="vexpert"`` layer (see parallel.py, dispatch.py).

    Holds the placement (host table, and its replica and weight-slot tables on the layer's
    device as buffers that follow ``.to()``) and, after each forward, the step's device
    statistics: ``last_counts`` ([world, E] pairs per source rank and expert),
    ``rank_loads`` ([world]) and ``balance_ratio`` (scalar). The placement is part of the
    layer's ``state_dict()`` (extra state)."""

    def __init__(self, num_experts: int, world_size: int, rank: int, slots_per_rank: int,
                 device=None):
        super().__init__()
        self.num_experts = num_experts
        self.world_size = world_size
        self.rank = rank
        self.num_groups = slots_per_rank
        self.exchange_width = num_experts  # the step's one count exchange: every expert
        placement = Placement.static(num_experts, world_size, slots_per_rank)
        self.register_buffer("replicas", torch.zeros(num_experts, world_size, dtype=torch.int64,
                                                     device=device), persistent=False)
        self.register_buffer("weight_slots", torch.zeros(num_experts, world_size,
                                                         dtype=torch.int64, device=device),
                             persistent=False)
        self._staging = None
        self.placement = placement
        self.set_placement(placement)
        self.agreed = world_size == 1  # checked across ranks at the first forward
        self.last_counts = None
        self.rank_loads = None
        self.balance_ratio = None

    def set_placement(self, placement: Placement) -> None:
        """Install `placement` for the next forward (host table and device tables)."""
        if (placement.num_experts, placement.world_size, placement.slots_per_rank) != \
                (self.num_experts, self.world_size, self.num_groups):
            raise PlacementError(
                f"a placement of {placement.num_experts} experts on {placement.world_size} x "
                f"{placement.slots_per_rank} slots does not fit this layer ({self.num_experts} "
                f"experts, {self.world_size} ranks x {self.num_groups} slots)")
        tables = torch.from_numpy(np.stack([placement.replicas(), placement.weight_slots()]))
        if self.replicas.is_cuda:
            # pinned and asynchronous: the layer's step never waits for the host; the pinned
            # copy stays referenced until the next change
            self._staging = tables.pin_memory()
            self.replicas.copy_(self._staging[0], non_blocking=True)
            self.weight_slots.copy_(self._staging[1], non_blocking=True)
        else:
            self.replicas.copy_(tables[0])
            self.weight_slots.copy_(tables[1])
        self.placement = placement

    # -- the plan ---------------------------------------------------------------------
    def local_groups(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Single rank: the weight slot of each pair's expert ([T, k] int32); the step's
        statistics as plan() keeps them."""
        counts = expert_histogram(expert_ids, self.num_experts).long()
        self.last_counts = counts.unsqueeze(0)
        self.rank_loads = counts.sum().reshape(1)
        self.balance_ratio = balance_ratio_of(self.rank_loads)
        return self.weight_slots[:, 0][expert_ids.long()].to(torch.int32)

    def plan(self, expert_ids: torch.Tensor, transport) -> DispatchPlan:
        world = self.world_size
        counts = expert_histogram(expert_ids, self.num_experts).long()
        # the all-gather: every destination gets this rank's whole histogram
        gathered = transport.exchange_counts(counts.unsqueeze(0).expand(world, -1).contiguous())
        gathered = gathered.to(counts.device, torch.int64)
        rejected = (gathered < 0).any(dim=1, keepdim=True)   # a peer's reject_input
        counts_all = gathered.clamp(min=0)
        assign = assignment(counts_all, self.replicas)
        dest = pair_destinations(expert_ids, assign[self.rank], self.rank)
        flat = expert_ids.reshape(-1).long()
        group = self.weight_slots[flat, dest]
        send, recv = scatter_counts(assign, self.weight_slots, self.num_groups, self.rank)
        recv = torch.where(rejected, torch.full_like(recv, -1), recv)
        loads = rank_loads(assign)
        self.last_counts = counts_all
        self.rank_loads = loads
        self.balance_ratio = balance_ratio_of(loads)
        return DispatchPlan(rank=dest, group=group, num_groups=self.num_groups,
                            send_counts=send, recv_counts=recv)

    # -- agreement and checkpoints -----------------------------------------------------
    def agree(self, exchange_ints) -> None:
        """Collective: raise PlacementError on every rank unless all hold the same table.

        exchange_ints(values) all-gathers up to 13 ints per rank (ctx.allgather_ints)."""
        prints = exchange_ints([self.placement.fingerprint() & ((1 << 62) - 1)])[:, 0]
        if (prints == prints[0]).all():
            self.agreed = True
            return
        # find the first slot where the tables differ: all ranks know they differ, so all
        # take part in the same rounds (as many slots as one all-gather carries)
        flat = self.placement.slot_expert.reshape(-1)
        for start in range(0, flat.size, USER_INTS_MOST):
            chunk = flat[start:start + USER_INTS_MOST].tolist()
            table = exchange_ints(chunk)
            differs = np.flatnonzero((table != table[0]).any(axis=0))
            if differs.size:
                where = start + int(differs[0])
                r, s = divmod(where, self.num_groups)
                values = ", ".join(f"rank {q}: {int(table[q, differs[0]])}"
                                   for q in range(table.shape[0]))
                raise PlacementError(
                    f"the ranks hold different vExpert placements: placement[rank {r}][slot "
                    f"{s}] is {values} (expert id, -1 free); every rank must load the same "
                    f"checkpoint / make the same scheduler calls")
        raise PlacementError("the ranks hold different vExpert placements (fingerprints "
                             f"{prints.tolist()})")

    def get_extra_state(self):
        return {"version": 1, "placement": self.placement.to_list(),
                "num_experts": self.num_experts}

    def set_extra_state(self, state) -> None:
        if not isinstance(state, dict) or "placement" not in state:
            raise PlacementError(f"not a vExpert placement state: {state!r:.200}")
        placement = parse_placement(state["placement"], self.num_experts, self.world_size,
                                    self.num_groups)
        self.set_placement(placement)
        self.agreed = self.world_size == 1


__all__ = ["VExpertDispatcher", "assignment", "quotas", "pair_destinations", "scatter_counts",
           "rank_loads", "balance_ratio_of"]
