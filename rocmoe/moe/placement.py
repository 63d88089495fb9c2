"""vExpert placement: which logical expert sits in which slot of which rank (FlexMoE).

Each rank has ``slots_per_rank`` expert slots (its memory budget for expert weights and
their optimizer state). A *vExpert* is one replica of a logical expert in one slot. An
expert's tokens are split over its vExperts in equal shares; vExperts of one expert on
one rank share one weight copy (the lowest such slot: its *weight slot*), so two of them
give that rank a double share. Copies on different ranks are kept identical by summing
their gradients (replica_sync.py). Every expert keeps at least one vExpert.

A :class:`Placement` is an immutable table ``slot_expert[rank, slot]`` (expert id, or -1
for a free slot), the same on every rank. The primitives return a new table:
``expanded(e, rank)`` puts a vExpert of e into a free slot of ``rank``, ``shrunk(e, rank)``
frees one (no data moves), ``migrated(a, b)`` swaps two slots' experts. What data an
applied change has to move is :func:`copies_needed`.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

from ..errors import PlacementError

FREE = -1


class Placement:
    def __init__(self, slot_expert, num_experts: int):
        table = np.array(slot_expert, dtype=np.int64, copy=True)
        if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise PlacementError(
                f"a placement is a [ranks, slots] table, got shape {table.shape}")
        self.num_experts = int(num_experts)
        self.world_size, self.slots_per_rank = (int(v) for v in table.shape)
        bad = (table < FREE) | (table >= self.num_experts)
        if bad.any():
            r, s = (int(v) for v in np.argwhere(bad)[0])
            raise PlacementError(
                f"slot {s} of rank {r} holds expert {int(table[r, s])}, outside "
                f"[0, {self.num_experts}) (or -1 for a free slot)")
        missing = sorted(set(range(self.num_experts)) - set(table[table >= 0].tolist()))
        if missing:
            raise PlacementError(
                f"experts {missing} have no vExpert: every expert needs at least one slot")
        table.setflags(write=False)
        self.slot_expert = table
        self._replicas = None       # derived tables, computed once (the table is immutable)
        self._weight_slots = None

    # -- construction ---------------------------------------------------------------
    @classmethod
    def static(cls, num_experts: int, world_size: int, slots_per_rank: int) -> "Placement":
        """The static layout (expert e on rank e // E_local, slot e % E_local), extra slots free."""
        check_slot_budget(num_experts, world_size, slots_per_rank)
        per_rank = num_experts // world_size
        table = np.full((world_size, slots_per_rank), FREE, dtype=np.int64)
        for r in range(world_size):
            table[r, :per_rank] = np.arange(r * per_rank, (r + 1) * per_rank)
        return cls(table, num_experts)

    # -- views ----------------------------------------------------------------------
    def replicas(self) -> np.ndarray:
        """[E, world] int64: vExperts of each expert on each rank."""
        if self._replicas is None:
            out = np.zeros((self.num_experts, self.world_size), dtype=np.int64)
            ranks = np.broadcast_to(np.arange(self.world_size)[:, None], self.slot_expert.shape)
            used = self.slot_expert >= 0
            np.add.at(out, (self.slot_expert[used], ranks[used]), 1)
            self._replicas = out
        return self._replicas.copy()

    def weight_slots(self) -> np.ndarray:
        """[E, world] int64: the slot holding each expert's weight copy on each rank, -1."""
        if self._weight_slots is None:
            out = np.full((self.num_experts, self.world_size), FREE, dtype=np.int64)
            for s in range(self.slots_per_rank - 1, -1, -1):  # the lowest slot wins
                experts = self.slot_expert[:, s]
                used = experts >= 0
                out[experts[used], np.flatnonzero(used)] = s
            self._weight_slots = out
        return self._weight_slots.copy()

    def holders(self, expert: int) -> list[int]:
        """Ranks that hold a copy of `expert`, ascending."""
        return [int(r) for r in np.flatnonzero(self.replicas()[expert])]

    def free_slots(self, rank: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.slot_expert[rank] == FREE)]

    def rank_loads(self, expert_loads: Sequence[float]) -> np.ndarray:
        """[world] load of each rank when each expert's load splits equally over its vExperts."""
        loads = np.asarray(expert_loads, dtype=np.float64)
        reps = self.replicas()
        return (loads[:, None] * reps / reps.sum(axis=1, keepdims=True)).sum(axis=0)

    def fingerprint(self) -> int:
        """A 63-bit digest of the table, to check cheaply that every rank holds the same one."""
        digest = hashlib.blake2b(self.slot_expert.tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def to_list(self) -> list[list[int]]:
        return self.slot_expert.tolist()

    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and other.num_experts == self.num_experts
                and np.array_equal(other.slot_expert, self.slot_expert))

    def __hash__(self) -> int:
        return self.fingerprint()

    def __repr__(self) -> str:
        return f"Placement({self.to_list()}, num_experts={self.num_experts})"

    # -- primitives (each returns a new placement) ----------------------------------------
    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise PlacementError(f"rank {rank!r} is out of range [0, {self.world_size})")
        return int(rank)

    def _check_expert(self, expert: int) -> int:
        if not isinstance(expert, (int, np.integer)) or not 0 <= expert < self.num_experts:
            raise PlacementError(f"expert {expert!r} is out of range [0, {self.num_experts})")
        return int(expert)

    def expanded(self, expert: int, rank: int) -> "Placement":
        """Expand: one more vExpert of `expert` in the lowest free slot of `rank`."""
        expert, rank = self._check_expert(expert), self._check_rank(rank)
        free = self.free_slots(rank)
        if not free:
            raise PlacementError(
                f"Expand(expert {expert}, rank {rank}): rank {rank} has no free slot (its "
                f"{self.slots_per_rank} slots hold experts {self.slot_expert[rank].tolist()}); "
                f"Shrink one of them first or raise slots_per_rank")
        table = self.slot_expert.copy()
        table[rank, free[0]] = expert
        return Placement(table, self.num_experts)

    def shrunk(self, expert: int, rank: int) -> "Placement":
        """Shrink: free the highest slot of `rank` holding a vExpert of `expert` (the weight
        slot goes last, so the copy stays where it is while other vExperts remain)."""
        expert, rank = self._check_expert(expert), self._check_rank(rank)
        slots = np.flatnonzero(self.slot_expert[rank] == expert)
        if slots.size == 0:
            raise PlacementError(f"Shrink(expert {expert}, rank {rank}): rank {rank} holds no "
                                 f"vExpert of expert {expert}")
        if int((self.slot_expert == expert).sum()) == 1:
            raise PlacementError(f"Shrink(expert {expert}, rank {rank}): that is the expert's "
                                 f"last vExpert; every expert keeps at least one")
        table = self.slot_expert.copy()
        table[rank, slots[-1]] = FREE
        return Placement(table, self.num_experts)

    def migrated(self, a: tuple[int, int], b: tuple[int, int]) -> "Placement":
        """Migrate: swap the contents of slot a = (rank, slot) and slot b (either may be free)."""
        (ra, sa), (rb, sb) = a, b
        ra, rb = self._check_rank(ra), self._check_rank(rb)
        for s in (sa, sb):
            if not isinstance(s, (int, np.integer)) or not 0 <= s < self.slots_per_rank:
                raise PlacementError(f"slot {s!r} is out of range [0, {self.slots_per_rank})")
        table = self.slot_expert.copy()
        table[ra, sa], table[rb, sb] = self.slot_expert[rb, sb], self.slot_expert[ra, sa]
        return Placement(table, self.num_experts)


def check_slot_budget(num_experts: int, world_size: int, slots_per_rank: int) -> None:
    per_rank = -(-num_experts // world_size)
    if not isinstance(slots_per_rank, int) or isinstance(slots_per_rank, bool) \
            or slots_per_rank < per_rank:
        raise PlacementError(
            f"slots_per_rank={slots_per_rank!r} is too small: {num_experts} experts over "
            f"{world_size} ranks need at least {per_rank} slots per rank (one vExpert per "
            f"expert), and replicas need more")


def default_slots_per_rank(num_experts: int, world_size: int) -> int:
    """The slot budget when none is given: the static layout's E / world slots and half as
    many again for replicas (at least one)."""
    per_rank = -(-num_experts // world_size)
    return per_rank + max(1, per_rank // 2)


def balance_ratio(rank_loads: Iterable[float]) -> float:
    """max rank load / mean rank load (1.0 is perfect balance; 1.0 for no load at all)."""
    loads = np.asarray(list(rank_loads), dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def copies_needed(old: Placement, new: Placement) -> list[tuple[int, int, int, int, int]]:
    """The weight copies that turning `old` into `new` needs, as (expert, src_rank, src_slot,
    dst_rank, dst_slot): one for every (expert, rank) whose weight slot in `new` held
    something else in `old` (a new copy, or a copy that moved to another slot). The source
    is the expert's weight slot on the lowest rank holding it in `old`."""
    if old.slot_expert.shape != new.slot_expert.shape or old.num_experts != new.num_experts:
        raise PlacementError("the two placements are for different layers")
    old_ws, new_ws = old.weight_slots(), new.weight_slots()
    ranks = np.arange(new.world_size)
    # what each new weight slot held before; a copy wherever that is another expert
    before = np.where(new_ws >= 0, old.slot_expert[ranks[None, :], new_ws.clip(min=0)], FREE)
    needs = (new_ws >= 0) & (before != np.arange(new.num_experts)[:, None])
    out = []
    for e, r in zip(*np.nonzero(needs)):
        e, r = int(e), int(r)
        if old_ws[e, r] >= 0:  # the rank had the weights in another slot: copy locally
            src_rank, src_slot = r, int(old_ws[e, r])
        else:
            src_rank = old.holders(e)[0]
            src_slot = int(old_ws[e, src_rank])
        out.append((e, src_rank, src_slot, r, int(new_ws[e, r])))
    return out


def parse_placement(data, num_experts: int, world_size: Optional[int] = None,
                    slots_per_rank: Optional[int] = None) -> Placement:
    """A placement from its table (lists), checked against the layer's shape."""
    placement = Placement(data, num_experts)
    if world_size is not None and placement.world_size != world_size:
        raise PlacementError(f"the placement is for {placement.world_size} ranks, the layer "
                             f"runs on {world_size}")
    if slots_per_rank is not None and placement.slots_per_rank != slots_per_rank:
        raise PlacementError(f"the placement has {placement.slots_per_rank} slots per rank, "
                             f"the layer {slots_per_rank}")
    return placement


__all__ = ["Placement", "FREE", "balance_ratio", "copies_needed", "check_slot_budget",
           "default_slots_per_rank", "parse_placement"]
