"""FlexMoE's cost model of an expert-parallel layer step: ``T_step = T_comp + T_a2a + T_sync``.

Each term is the slowest rank's (the exchanges and the all-reduces make every rank wait
for the slowest), for a placement and the step's pair counts ``C [world, E]`` routed as
vexpert_routing does (equal shares per vExpert, locality first):

* ``T_comp``: the expert FFN forward + backward, ``fixed * active groups + per_row * rows``
  on the rank, fitted to timings of this machine's FFN at several row counts;
* ``T_a2a``: the four row exchanges of a step (dispatch and combine, forward and backward),
  ``latency + bytes / bandwidth`` for the bytes a rank sends or receives (the larger) per
  link class (``intra`` node, ``inter`` node: ranks are numbered node by node, ``ranks_per_node``
  to a node), measured with the layer's transport (on one node only ``intra`` exists);
* ``T_sync``: the replica gradient sums a rank takes part in, ``alpha + beta * bytes`` per
  group size, measured with the scheduler's own reducer (torch.distributed, MPI or the heap:
  replica_sync.py) on groups of 2..world ranks;

plus ``fixed_ms``, the rest of the layer step (router, sorts, count exchange), timed at
start. :func:`profile` measures all of it collectively and every rank adopts the ranks'
mean, so that every rank's policy makes the same decisions.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from .placement import Placement


@dataclass
class CostModel:
    ffn_fixed_ms: float = 0.0          # per weight group with rows, fwd + bwd
    ffn_ms_per_row: float = 1e-3       # fwd + bwd
    a2a_latency_ms: float = 0.0        # per exchange
    a2a_ms_per_byte: dict = field(default_factory=lambda: {"intra": 0.0, "inter": 0.0})
    allreduce: dict = field(default_factory=dict)  # group size -> [alpha_ms, ms_per_byte]
    fixed_ms: float = 0.0
    row_bytes: int = 0                 # one token row (hidden x element size)
    expert_grad_bytes: int = 0         # one expert's gradient as summed (fp32 / fp64)
    ranks_per_node: int = 0            # 0: every rank on one node
    measured: bool = False

    # -- the terms ------------------------------------------------------------------------
    def rank_terms(self, placement: Placement, counts) -> dict:
        """{'comp', 'a2a', 'sync'}: [world] ms of each rank for `placement` and counts [W, E]."""
        counts = np.asarray(counts, dtype=np.float64)
        world = placement.world_size
        reps = placement.replicas().astype(np.float64)                    # [E, W]
        loads = counts.sum(axis=0)                                        # [E]
        share = reps / reps.sum(axis=1, keepdims=True)
        quota = loads[:, None] * share                                    # [E, W]
        holds = (reps > 0).T                                              # [W, E]
        kept = np.where(holds, np.minimum(counts, quota.T), 0.0)          # [W, E]
        rows = quota.sum(axis=0)
        groups = ((quota > 0) & holds.T).sum(axis=0)     # a rank's vExperts share a copy
        comp = self.ffn_fixed_ms * groups + self.ffn_ms_per_row * rows
        nodes = (np.arange(world) // self.ranks_per_node if self.ranks_per_node
                 else np.zeros(world, dtype=np.int64))
        cross = nodes[:, None] != nodes[None, :]
        rates = {kind: self.a2a_ms_per_byte.get(kind, self.a2a_ms_per_byte.get("intra", 0.0))
                 for kind in ("intra", "inter")}
        a2a = np.full(world, self.a2a_latency_ms)
        if any(rates.values()):
            # pairs that leave their rank, spread over the expert's other holders by their
            # spare room (the routing fills exactly that room): flows [src, E, dst]
            rest = counts - kept
            spare = np.clip(quota - kept.T, 0.0, None)                    # [E, W]
            other = 1.0 - np.eye(world)
            weight = spare[None, :, :] * other[:, None, :]
            norm = weight.sum(axis=2, keepdims=True)
            flows = rest[:, :, None] * np.divide(weight, norm, out=np.zeros_like(weight),
                                                 where=norm > 0)
            per_pair = flows.sum(axis=1)                                  # [src, dst]
            for kind, mask in (("intra", ~cross), ("inter", cross)):
                pairs = per_pair * mask
                moved = np.maximum(pairs.sum(axis=1), pairs.sum(axis=0))  # sent, received
                a2a = a2a + rates[kind] * self.row_bytes * moved
        a2a = 4 * a2a
        return {"comp": comp, "a2a": a2a, "sync": self.rank_sync_ms(placement)}

    def rank_sync_ms(self, placement: Placement) -> np.ndarray:
        """[world] ms of the replica gradient sums each rank takes part in (no counts
        needed: every replicated expert's group sums once a step)."""
        holds_e = placement.replicas() > 0                                # [E, W]
        members = holds_e.sum(axis=1)
        sync = np.zeros(placement.world_size)
        for m in np.unique(members[members > 1]).tolist():
            ms = self.allreduce_ms(int(m), self.expert_grad_bytes)
            sync = sync + ms * holds_e[members == m].sum(axis=0)
        return sync

    def allreduce_ms(self, group_size: int, nbytes: int) -> float:
        if not self.allreduce:
            return 0.0
        sizes = sorted(int(k) for k in self.allreduce)
        size = min(sizes, key=lambda s: (abs(s - group_size), s))
        alpha, beta = self.allreduce[size] if size in self.allreduce else self.allreduce[str(size)]
        return float(alpha + beta * nbytes)

    def predict_ms(self, placement: Placement, counts) -> float:
        """Predicted layer step (fwd + bwd + replica sync) in ms."""
        terms = self.rank_terms(placement, counts)
        return float(self.fixed_ms + terms["comp"].max() + terms["a2a"].max()
                     + terms["sync"].max())

    def breakdown(self, placement: Placement, counts) -> dict:
        terms = self.rank_terms(placement, counts)
        return {"fixed_ms": self.fixed_ms, "comp_ms": float(terms["comp"].max()),
                "a2a_ms": float(terms["a2a"].max()), "sync_ms": float(terms["sync"].max())}

    def scaled(self, compute: float = 1.0, sync: float = 1.0) -> "CostModel":
        """This model with the layer's forward + backward terms (fixed, FFN, exchanges)
        times `compute` and the replica sums times `sync` (cost_calibration.py)."""
        return replace(
            self, ffn_fixed_ms=self.ffn_fixed_ms * compute,
            ffn_ms_per_row=self.ffn_ms_per_row * compute,
            a2a_latency_ms=self.a2a_latency_ms * compute,
            a2a_ms_per_byte={k: v * compute for k, v in self.a2a_ms_per_byte.items()},
            fixed_ms=self.fixed_ms * compute,
            allreduce={g: [v[0] * sync, v[1] * sync] for g, v in self.allreduce.items()})

    def to_dict(self) -> dict:
        out = asdict(self)
        out["allreduce"] = {str(k): list(v) for k, v in self.allreduce.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        data = dict(data)
        data["allreduce"] = {int(k): list(v) for k, v in data.get("allreduce", {}).items()}
        return cls(**data)


# -- profiling ------------------------------------------------------------------------------
def _median_ms(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(samples))


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares (intercept, slope), the intercept kept >= 0."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    slope, intercept = np.polyfit(xs, ys, 1) if len(set(xs.tolist())) > 1 else (0.0, ys.mean())
    if intercept < 0:
        slope, intercept = float((xs * ys).sum() / max((xs * xs).sum(), 1e-30)), 0.0
    return float(intercept), float(max(slope, 0.0))


def _fit_ffn(samples) -> tuple[float, float, list]:
    """t = fixed * g + per_row * r: least squares over the (rows, groups, ms) samples."""
    a = np.array([[g, r] for r, g, _ in samples], dtype=np.float64)
    t = np.array([s[2] for s in samples])
    (fixed, per_row), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(max(fixed, 0.0)), float(max(per_row, 0.0)), samples


def _ffn_samples(rows: int, world: int, slots: int) -> list[tuple[int, int]]:
    """(rows, groups) to time: from half a rank's share to every rank's pairs on one rank
    (the worst skew), so that the fit holds where the policy asks it, not only around the
    balanced load; and one sample over several groups for the per-group cost."""
    most = rows * max(world, 2)
    return [(max(rows // 2, 8), 1), (rows, 1), (most, 1), (rows, min(4, max(slots, 1)))]


def profile_handle_ffn(layer, rows: int, reps: int = 3) -> tuple[float, float, list]:
    """Collective. (fixed_ms per group, ms_per_row) of the expert FFN fwd + bwd exactly as
    the layer's step on the fused-op handles runs it (handle_transport.py): the grouped
    products on device counts for W1 (and W3), the activation over the upper-bound buffer,
    the grouped GemmAllToAll for W2 and their backward, at the layer's capacity (the rows
    spread over the sources as under skew). One rank is timed at a time while the others
    join the collective calls with no rows, so ranks that share a device do not slow each
    other's timings. Its own transport: the layer's handles keep their sizes."""
    from .activations import ACTIVATIONS
    from .handle_transport import HandleTransport, grouped_products
    ctx = layer.ctx
    world, rank = int(ctx.world_size), int(ctx.rank)
    device, dtype = layer.w1.device, layer.w1.dtype
    act = ACTIVATIONS[layer.activation]
    weights = [p for p in (layer.w1, layer.w2, layer.w3) if p is not None]
    slots = layer.w1.shape[0]
    transport = HandleTransport(ctx)
    capacity = transport.begin_step(rows)   # the layer's: round_up(its pairs a rank)
    gen = torch.Generator().manual_seed(0)
    samples = []
    try:
        for r, g in _ffn_samples(rows, world, slots):
            per_source = -(-r // world)
            x = torch.zeros(world * capacity, layer.hidden_size, dtype=dtype, device=device)
            x[:r] = torch.randn(r, layer.hidden_size, generator=gen).to(device, dtype)
            busy = torch.zeros(world, slots, dtype=torch.int64)
            left = r
            for s in range(world):          # each source's rows over the g groups
                n = min(per_source, left)
                left -= n
                for i in range(g):
                    busy[s, i] = n // g + (1 if i < n % g else 0)
            busy, idle = busy.to(device), torch.zeros(world, slots, dtype=torch.int64,
                                                      device=device)
            times = []
            for timed in range(world):
                counts = busy if rank == timed else idle

                def step():
                    h = act(grouped_products(x, layer.w1, counts, transport))
                    if layer.w3 is not None:
                        h = h * grouped_products(x, layer.w3, counts, transport)
                    back = transport.combine(h, layer.w2, counts)
                    torch.autograd.grad(back.float().sum(), weights)
                times.append(_median_ms(step, reps))
            samples.append((r, g, times[rank]))
    finally:
        transport.close()
    return _fit_ffn(samples)


def profile_ffn(layer, rows: int, reps: int = 3) -> tuple[float, float, list]:
    """(fixed_ms per group, ms_per_row) of the layer's local expert FFN, fwd + bwd, on the
    path its expert-parallel step takes over a transport that reads the counts on the host
    (per-group products for the fused combine, the block-sparse FFN otherwise; for the
    fused-op handles' path see profile_handle_ffn)."""
    from .activations import ACTIVATIONS
    from .layer import expert_ffn
    from .parallel import combine_kind
    from .permute import unpermute_combine
    from .routing import route_and_permute
    device, dtype = layer.w1.device, layer.w1.dtype
    fused = layer.world_size > 1 and combine_kind(layer) == "gemm_all_to_all"
    act = ACTIVATIONS[layer.activation]
    weights = [p for p in (layer.w1, layer.w2, layer.w3) if p is not None]
    samples = []
    gen = torch.Generator().manual_seed(0)
    for r, g in _ffn_samples(rows, layer.world_size, layer.w1.shape[0]):
        x = torch.randn(r, layer.hidden_size, generator=gen).to(device, dtype)
        ids = (torch.arange(r, device=device) % g).to(torch.int32).view(-1, 1)
        ones = torch.ones(r, 1, dtype=dtype, device=device)

        def step():
            if fused:
                outs = []
                for i, xg in enumerate(x.chunk(g)):
                    h = act(xg @ layer.w1[i])
                    if layer.w3 is not None:
                        h = h * (xg @ layer.w3[i])
                    outs.append(h @ layer.w2[i])
                y = torch.cat(outs)
            else:   # what the layer's block-sparse path runs on the rows that arrived
                plan, topo, x_perm = route_and_permute(x, ids, g, layer.block_size,
                                                       layer.ffn_hidden_size)
                y = unpermute_combine(expert_ffn(x_perm, layer.w1[:g], layer.w2[:g],
                                                 None if layer.w3 is None else layer.w3[:g],
                                                 topo, layer.activation), ones, plan)
            torch.autograd.grad(y.float().sum(), weights)
        samples.append((r, g, _median_ms(step, reps)))
    return _fit_ffn(samples)


def profile_fixed(layer, tokens: int, reps: int = 3) -> float:
    """Router forward + backward and the pair sorts on `tokens` tokens: the step's part that
    does not depend on the placement."""
    device, dtype = layer.w1.device, layer.w1.dtype
    x = torch.randn(tokens, layer.hidden_size, device=device, dtype=dtype)

    def step():
        ids, w = layer.router.route(x)
        flat = ids.reshape(-1).long()
        torch.sort(flat, stable=True)
        torch.sort(flat * 3, stable=True)
        torch.autograd.grad(w.float().sum(), [layer.router.weight])
    return _median_ms(step, reps)


def profile_links(transport, row_bytes: int, rows: int, device, partner=None,
                  reps: int = 3) -> tuple[float, float]:
    """(latency_ms, ms_per_byte) of one row exchange through the transport (collective):
    every rank sends to every other (partner None), or rank r only to partner[r] (a
    permutation of the ranks: one link class)."""
    world, rank = transport.world_size, transport.rank
    width = max(row_bytes // 4, 1)
    times, moved = [], []
    for n in (max(rows // 8, 1), max(rows, 2)):
        if partner is not None:
            send = [n if d == partner[rank] else 0 for d in range(world)]
            recv = [n if partner[s] == rank else 0 for s in range(world)]
            moved.append(n * width * 4)
        else:
            send = recv = [n] * world
            moved.append(n * (world - 1) * width * 4)
        block = torch.zeros(sum(send), width, dtype=torch.float32, device=device)
        times.append(_median_ms(lambda: transport.all_to_all(block, send, recv), reps))
    return fit_line(moved, times)


def profile_replica_sums(reducer, nbytes: int, device, dtype=torch.float32,
                         reps: int = 3) -> dict:
    """{group size: [alpha_ms, ms_per_byte]} of the scheduler's replica gradient sum
    (`reducer`, replica_sync.py) for groups of the first g ranks, at two sizes (collective).
    Ranks outside a group report NaN for it, which the ranks' mean leaves out."""
    from .replica_sync import ReplicaGroup
    world, rank = int(reducer.ctx.world_size), int(reducer.ctx.rank)
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = {}
    for g in range(2, world + 1):
        members = tuple(range(g))
        sizes = (max(nbytes // 16, 64), max(nbytes, 128))
        times = []
        for n in sizes:
            group = ReplicaGroup(("cost model", n, members), members, n // itemsize, dtype)
            mine = ({group.key: torch.zeros(group.numel, dtype=dtype, device=device)}
                    if rank < g else {})
            times.append(_median_ms(lambda: reducer.sum_([group], mine), reps))
        out[g] = list(fit_line(sizes, times)) if rank < g else [float("nan")] * 2
    return out


def profile(layer, transport, reducer, tokens: int, ranks_per_node: int = 0,
            exchange=None) -> CostModel:
    """Collective: measure every term on this machine and agree on the ranks' mean.

    reducer: the scheduler's replica gradient sum (replica_sync.py), timed as it runs;
    exchange(list of floats) -> [world, n] all-gathers floats (the scheduler passes one)."""
    from .parallel import combine_kind
    rows = max(tokens * layer.top_k, 16)
    if getattr(transport, "device_counts", False) and layer.world_size > 1 \
            and combine_kind(layer) == "gemm_all_to_all":
        fixed_g, per_row, _ = profile_handle_ffn(layer, rows)
    else:
        fixed_g, per_row, _ = profile_ffn(layer, rows)
    fixed = profile_fixed(layer, tokens)
    row_bytes = layer.hidden_size * layer.w1.element_size()
    device = layer.w1.device
    per_node = ranks_per_node if 0 < ranks_per_node < layer.world_size else 0
    if per_node:   # two link classes: a neighbour on the node, the same rank one node over
        world = layer.world_size
        inter = [(r + per_node) % world for r in range(world)]
        intra = [(r // per_node) * per_node + (r % per_node + 1) % per_node for r in range(world)]
        latency, per_byte_inter = profile_links(transport, row_bytes, rows, device, inter)
        if per_node > 1:
            latency, per_byte = profile_links(transport, row_bytes, rows, device, intra)
        else:      # one rank per node: no link stays on a node
            per_byte = per_byte_inter
    else:          # one node: the exchange the layer runs, every rank to every rank
        latency, per_byte = profile_links(transport, row_bytes, rows, device)
        per_byte_inter = per_byte
    grad_elems = sum(p[0].numel() for p in (layer.w1, layer.w2, layer.w3) if p is not None)
    sum_dtype = torch.float64 if layer.w1.dtype == torch.float64 else torch.float32
    grad_bytes = grad_elems * (8 if sum_dtype == torch.float64 else 4)
    allreduce = profile_replica_sums(reducer, grad_bytes, device, sum_dtype)
    values = [fixed_g, per_row, latency, per_byte, fixed, per_byte_inter]
    for g in sorted(allreduce):
        values += allreduce[g]
    if exchange is not None:
        values = np.nanmean(np.asarray(exchange(values), dtype=np.float64), axis=0).tolist()
    model = CostModel(ffn_fixed_ms=values[0], ffn_ms_per_row=values[1],
                      a2a_latency_ms=values[2],
                      a2a_ms_per_byte={"intra": values[3], "inter": values[5]},
                      fixed_ms=values[4], row_bytes=row_bytes,
                      expert_grad_bytes=grad_bytes, ranks_per_node=ranks_per_node,
                      measured=True)
    rest = values[6:]
    model.allreduce = {g: [rest[2 * i], rest[2 * i + 1]] for i, g in enumerate(sorted(allreduce))}
    return model


def prediction_error(predicted_ms, measured_ms) -> dict:
    """Per step |predicted - measured| / measured (mean and max), and the same for the
    medians over the steps (what a noisy machine's typical step is)."""
    p = np.asarray(predicted_ms, dtype=np.float64)
    m = np.asarray(measured_ms, dtype=np.float64)
    rel = np.abs(p - m) / np.maximum(m, 1e-12)
    if not rel.size:
        return {"mean_abs_error": None, "max_abs_error": None, "median_error": None, "steps": 0}
    return {"mean_abs_error": float(rel.mean()), "max_abs_error": float(rel.max()),
            "median_error": float(abs(np.median(p) - np.median(m)) / max(np.median(m), 1e-12)),
            "steps": int(rel.size)}


def noise_floor(measured_ms) -> dict:
    """What no model of the step can beat on these steps: the mean |error| of predicting
    every step by the median of all of them (a constant that knows the future), and of
    predicting each step by the one before it (one that follows drift perfectly). On a
    quiet GPU both are near 0; on the 2-core VM a fixed single-threaded workload varies by
    5-10 % from step to step, which is above the host goal, so the bench reports both next
    to the model's error."""
    m = np.asarray(measured_ms, dtype=np.float64)
    if not m.size:
        return {"constant_at_median": None, "previous_step": None}
    med = float(np.median(m))
    prev = (float(np.mean(np.abs(m[1:] - m[:-1]) / np.maximum(m[1:], 1e-12)))
            if m.size > 1 else None)
    return {"constant_at_median": float(np.mean(np.abs(m - med) / np.maximum(m, 1e-12))),
            "previous_step": prev}


__all__ = ["CostModel", "profile", "prediction_error", "noise_floor", "fit_line"]
