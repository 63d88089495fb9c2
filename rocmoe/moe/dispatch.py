"""Where each (token, slot) pair of an expert-parallel layer goes: a rank and a group there.

A *group* is one weight copy on the destination rank (one local expert under the static
placement, one slot under vExpert placement). Expert parallelism (parallel.py) only sees
this plan: it sorts the pairs by (rank, group), exchanges ``[world, G]`` counts, dispatches,
runs group g's rows through the rank's weights ``w*[g]`` and combines. Who decides the plan
is a *dispatcher*: :class:`StaticDispatcher` here (rank = e // E_local, group = e % E_local),
``vexpert_routing.VExpertDispatcher`` for replicated experts.

Everything in a plan is a device tensor: making one reads nothing back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .router import expert_histogram


@dataclass
class DispatchPlan:
    rank: torch.Tensor           # [T*k] int64: destination rank of each pair (pair order)
    group: torch.Tensor          # [T*k] int64: group (weight copy) on that rank
    num_groups: int              # G, the same on every rank
    send_counts: torch.Tensor    # [world, G] int64: pairs this rank sends to (rank, group)
    # [world, G] int64: pairs each source rank sends here, when the dispatcher already
    # knows them (it saw every rank's counts); None: parallel.py exchanges send_counts
    recv_counts: Optional[torch.Tensor] = None

    def sort_key(self) -> torch.Tensor:
        """(rank, group) as one integer: sorting by it groups the pairs as they are sent."""
        return self.rank * self.num_groups + self.group


class StaticDispatcher:
    """Rank r owns the global experts [r * E_local, (r + 1) * E_local), one weight copy each."""

    def __init__(self, num_experts: int, world_size: int):
        self.num_experts = num_experts
        self.world_size = world_size
        self.num_groups = num_experts // world_size
        # the width of the first count exchange of a step (reject_input must match it)
        self.exchange_width = self.num_groups

    def plan(self, expert_ids: torch.Tensor, transport=None) -> DispatchPlan:
        flat = expert_ids.reshape(-1).long()
        counts = expert_histogram(expert_ids, self.num_experts).long()
        return DispatchPlan(rank=flat // self.num_groups, group=flat % self.num_groups,
                            num_groups=self.num_groups,
                            send_counts=counts.view(self.world_size, self.num_groups))


__all__ = ["DispatchPlan", "StaticDispatcher"]
