"""Placement policies: FlexMoE's greedy policy maker (Alg. 2) and an EPLB-style comparison.

Both are pure functions of (placement, pair counts [world, E], cost model) on the host and
return a new placement; every rank runs them on the same inputs and gets the same answer.

* :func:`greedy_policy` (FlexMoE): first Shrink the vExperts of experts that cooled (each
  carrying less than the threshold's margin of a rank's load) where the model predicts no
  longer step, so that their slots serve again. Then, while the balance ratio is above the
  threshold, take the straggler's hottest experts (most pairs per vExpert) and simulate
  Expand(hot) into a free slot of a rank, or Expand(hot) + Shrink(coldest) to make the
  room, on every candidate rank, each also followed by handing the receiving rank's other
  vExperts on to ranks with room when it became the straggler itself; keep the best if
  the cost model predicts a shorter step. Then Migrate: swap two slots when that shrinks
  replica groups (fewer ranks to all-reduce over) and the model predicts no longer step.
  Changes that need weight copies are limited per destination rank.
* :func:`eplb_policy` (DeepSeek EPLB's idea, rewritten): start over every time: give each
  expert replicas greedily by load per replica until every slot is used, then pack the
  replicas onto ranks heaviest first, each onto the least loaded rank with a free slot
  (preferring one that has no copy of that expert yet). It ignores the current placement
  and so may move many experts at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_model import CostModel
from .placement import FREE, Placement, balance_ratio


# Once started (balance ratio above the threshold), the policy keeps improving until the
# ratio is this far into the threshold's margin: the next step's load is not the averaged
# one it plans for, and stopping right at the threshold leaves the next step above it.
TARGET_FRACTION = 0.5


@dataclass
class PolicyResult:
    placement: Placement
    predicted_ms: float
    baseline_ms: float
    expands: int = 0
    shrinks: int = 0
    migrates: int = 0


def _copies_per_rank(old: Placement, new: Placement) -> np.ndarray:
    """[world] weight copies from another rank that turning `old` into `new` needs per
    destination: one for each expert a rank holds in `new` and did not in `old` (the
    cross-rank entries of copies_needed; a copy within a rank is not limited)."""
    return ((new.replicas() > 0) & (old.replicas() == 0)).sum(axis=0)


def greedy_policy(placement: Placement, counts, model: CostModel, threshold: float = 1.05,
                  max_copies_per_rank: int = 2, max_moves: int = 64) -> PolicyResult:
    counts = np.asarray(counts, dtype=np.float64)
    loads = counts.sum(axis=0)
    start = placement
    current = placement
    current_ms = model.predict_ms(current, counts)
    base_ms = current_ms
    result = PolicyResult(placement, current_ms, base_ms)
    current, current_ms, result.shrinks = _reclaim(
        current, loads, counts, model, current_ms,
        below=(threshold - 1.0) * loads.sum() / current.world_size)
    for _ in range(max_moves):
        rank_loads = current.rank_loads(loads)
        if balance_ratio(rank_loads) <= 1.0 + (threshold - 1.0) * TARGET_FRACTION:
            break
        reps = current.replicas().sum(axis=1)
        per_vexpert = loads / reps
        straggler = int(np.argmax(rank_loads))
        # the hottest vExperts of the most loaded rank: giving one of them another vExpert
        # elsewhere (or moving one away) is what shortens the step
        hot_here = sorted({int(e) for e in current.slot_expert[straggler] if e >= 0},
                          key=lambda e: (-per_vexpert[e], e))[:3]
        best = None
        for hot in hot_here:
            for rank in np.argsort(rank_loads, kind="stable"):
                rank = int(rank)
                if rank == straggler:
                    continue
                for kind, cand in _candidates(current, hot, rank, straggler, reps, per_vexpert):
                    options = [(kind, cand)]
                    if kind != "move":
                        handed = _hand_on(start, cand, rank, hot, loads, max_copies_per_rank)
                        if handed != cand:
                            options.append((kind, handed))
                    for kind, cand in options:
                        if (_copies_per_rank(start, cand) > max_copies_per_rank).any():
                            continue
                        ms = model.predict_ms(cand, counts)
                        if best is None or ms < best[0] - 1e-12:
                            best = (ms, kind, cand)
        if best is None or best[0] >= current_ms * (1 - 1e-6):
            break
        current_ms, kind, current = best
        result.expands += kind in ("expand", "swap", "evict")
        result.shrinks += kind in ("swap", "move")
        result.migrates += kind in ("move", "evict")
    current, current_ms, migrates = _migrate(start, current, counts, model, current_ms,
                                             max_copies_per_rank)
    result.placement, result.predicted_ms = current, current_ms
    result.migrates += migrates
    return result


def _reclaim(current: Placement, loads, counts, model: CostModel, current_ms: float,
             below: float) -> tuple[Placement, float, int]:
    """Shrink vExperts that carry fewer than `below` pairs each, coldest first, where the
    model predicts no longer step. An expert that was hot keeps its vExperts after it cools
    until something frees them; without this they pile up (on a drifting Zipf load at 64
    experts over 8 ranks one cold expert held 11 slots) and the policy finds no room left
    for the experts that are hot now."""
    freed = 0
    reps = current.replicas().sum(axis=1)
    options = sorted((loads[e] / reps[e], e, r) for r in range(current.world_size)
                     for e in current.slot_expert[r].tolist()
                     if e >= 0 and reps[e] > 1 and loads[e] / reps[e] < below)
    for _, e, r in options:
        left = int((current.slot_expert == e).sum())
        if left < 2 or loads[e] / (left - 1) >= below:   # what the others would carry
            continue
        cand = current.shrunk(e, r)
        ms = model.predict_ms(cand, counts)
        if ms <= current_ms * (1 + 1e-9):
            current, current_ms = cand, ms
            freed += 1
    return current, current_ms, freed


def _hand_on(start: Placement, cand: Placement, rank: int, hot: int, loads,
             max_copies_per_rank: int) -> Placement:
    """`cand` gave `rank` a vExpert of `hot`; when that made `rank` the most loaded, move
    its other vExperts, one at a time, to ranks with a free slot (the least loaded, so
    often the ones whose share of `hot` just shrank), each where the larger of the two
    loads ends up smallest, while that is below `rank`'s load. A hot expert whose vExperts
    each carry more than the gap to the mean can only gain one this way: on its own the
    Expand makes the receiving rank the straggler."""
    held_before = start.replicas() > 0                                     # [E, W]
    world = cand.world_size
    for _ in range(cand.slots_per_rank):
        reps = cand.replicas()
        total = reps.sum(axis=1)
        rank_loads = (loads[:, None] * reps / total[:, None]).sum(axis=0)
        if rank_loads[rank] <= np.delete(rank_loads, rank).max():
            break
        experts = np.unique(cand.slot_expert[rank])
        experts = experts[(experts >= 0) & (experts != hot)]
        room = np.array([q for q in range(world)
                         if q != rank and (cand.slot_expert[q] == FREE).any()], dtype=np.int64)
        if not experts.size or not room.size:
            break
        share = loads[experts] / total[experts]                           # one vExpert's
        worst = np.maximum(rank_loads[rank] - share[:, None],
                           rank_loads[room][None, :] + share[:, None])
        copies = ((reps > 0) & ~held_before).sum(axis=0)
        new_copy = ~held_before[np.ix_(experts, room)] & (reps[np.ix_(experts, room)] == 0)
        worst[new_copy & (copies[room] >= max_copies_per_rank)[None, :]] = np.inf
        i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[i, j] < rank_loads[rank] * (1 - 1e-9):
            break
        e, q = int(experts[i]), int(room[j])
        cand = cand.expanded(e, q).shrunk(e, rank)
    return cand


def _candidates(current: Placement, hot: int, rank: int, straggler: int, reps, per_vexpert):
    """Changes that give rank `rank` a vExpert of `hot`: into a free slot (Expand); in place
    of the coldest vExpert there whose expert has others (Expand + Shrink); in the slot of
    the coldest vExpert there after moving it to a rank with room (Migrate + Expand); or
    taken from the straggler (a vExpert move, when `hot` has another vExpert left)."""
    out = []
    if current.free_slots(rank):
        out.append(("expand", current.expanded(hot, rank)))
    else:
        on_rank = [int(e) for e in current.slot_expert[rank] if e >= 0 and e != hot
                   and reps[e] > 1]
        if on_rank:
            cold = min(on_rank, key=lambda e: (per_vexpert[e], e))
            out.append(("swap", current.shrunk(cold, rank).expanded(hot, rank)))
        # or move the coldest vExpert there to a rank with room, and take its slot
        alone = [int(e) for e in current.slot_expert[rank] if e >= 0 and e != hot]
        room = [q for q in range(current.world_size) if q != rank and current.free_slots(q)]
        if alone and room:
            cold = min(alone, key=lambda e: (per_vexpert[e], e))
            q = min(room, key=lambda q: (cold not in current.slot_expert[q], q))
            out.append(("evict", current.expanded(cold, q).shrunk(cold, rank)
                        .expanded(hot, rank)))
    if reps[hot] > 1:
        moved = current.shrunk(hot, straggler)
        if moved.free_slots(rank):
            out.append(("move", moved.expanded(hot, rank)))
    return out


def _migrate(start: Placement, current: Placement, counts, model: CostModel, current_ms: float,
             max_copies_per_rank: int) -> tuple[Placement, float, int]:
    """Swap slot pairs (rank a holds x, rank b holds y; x also lives on b, y also on a) that
    shrink the replica groups of x and y, while the model predicts no slower step."""
    migrates = 0
    improved = True
    while improved:
        improved = False
        table = current.slot_expert
        for ra in range(current.world_size):
            for rb in range(ra + 1, current.world_size):
                for sa in range(current.slots_per_rank):
                    x = int(table[ra, sa])
                    if x < 0 or not (table[rb] == x).any():
                        continue
                    for sb in range(current.slots_per_rank):
                        y = int(table[rb, sb])
                        if y < 0 or y == x or not (table[ra] == y).any():
                            continue
                        cand = current.migrated((ra, sa), (rb, sb))
                        groups = sum(len(cand.holders(e)) for e in (x, y))
                        if groups >= sum(len(current.holders(e)) for e in (x, y)):
                            continue
                        if (_copies_per_rank(start, cand) > max_copies_per_rank).any():
                            continue
                        ms = model.predict_ms(cand, counts)
                        if ms <= current_ms * (1 + 1e-9):
                            current, current_ms = cand, ms
                            migrates += 1
                            improved = True
                            break
                    if improved:
                        break
                if improved:
                    break
            if improved:
                break
    return current, current_ms, migrates


def eplb_policy(placement: Placement, counts, model: CostModel | None = None,
                **_ignored) -> PolicyResult:
    counts = np.asarray(counts, dtype=np.float64)
    loads = counts.sum(axis=0)
    num_experts, world, slots = placement.num_experts, placement.world_size, \
        placement.slots_per_rank
    replicas = np.ones(num_experts, dtype=np.int64)
    for _ in range(world * slots - num_experts):
        e = int(np.argmax(loads / replicas))
        replicas[e] += 1
    items = [(loads[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])]
    items.sort(key=lambda it: (-it[0], it[1]))
    table = np.full((world, slots), FREE, dtype=np.int64)
    filled = np.zeros(world, dtype=np.int64)
    rank_load = np.zeros(world)
    for load, e in items:
        open_ranks = [r for r in range(world) if filled[r] < slots]
        fresh = [r for r in open_ranks if not (table[r, :filled[r]] == e).any()]
        r = min(fresh or open_ranks, key=lambda q: (rank_load[q], q))
        table[r, filled[r]] = e
        filled[r] += 1
        rank_load[r] += load
    new = Placement(table, num_experts)
    base = model.predict_ms(placement, counts) if model is not None else 0.0
    ms = model.predict_ms(new, counts) if model is not None else 0.0
    return PolicyResult(new, ms, base, expands=int(replicas.sum() - num_experts))


POLICIES = {"greedy": greedy_policy, "eplb": eplb_policy}

__all__ = ["greedy_policy", "eplb_policy", "PolicyResult", "POLICIES"]
