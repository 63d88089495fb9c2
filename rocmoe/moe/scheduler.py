"""VExpertScheduler: watches the vExpert layers' loads and changes their placement.

    scheduler = VExpertScheduler(model, optimizer)   # the model's placement="vexpert" layers
    for batch in data:
        loss = task_loss(model(batch)); loss.backward()
        optimizer.step()      # a pre-hook first sums the replicas' gradients
        scheduler.step()      # statistics, policy, Expand / Shrink / Migrate

Timeline of a change decided by ``scheduler.step()`` after step t:

* no weights to move (Shrink; Expand onto a rank that has the expert's weights): it is the
  placement of step t+1;
* otherwise the copies (weights + optimizer state, one-sided puts, expert_copy.py) run in
  the background during step t+1, which still uses the old placement. At the optimizer
  pre-hook of step t+1 the ranks agree (one timed all-gather) whether every copy landed:
  if so the replicas' gradients are summed over old and new holders, the copies are
  installed and step t+1's optimizer step updates them like their sources, and step t+2
  runs on the new placement. If not, the change is dropped (nothing waits); the policy
  may propose it again.

The gradient sum of replicated experts (replica_sync.py) happens in the pre-hook every
step. The policy (policy.py) runs every ``rebalance_every`` steps of a layer while its
balance ratio, or the one forecast for the step a change would take effect, is above
``balance_threshold`` (backing off, up to 16 intervals, after runs that changed nothing:
PolicyBackoff), on the forecast of the pair counts every rank has seen
(load_forecast.py), with the cost model (cost_model.py) profiled at the first step and
scaled by what its predictions of the last steps missed (cost_calibration.py: the layer's
forward + backward timed by hooks, vexpert_clock.py, and the replica sum; the slowest
rank's times, agreed by one all-gather at the steps where a policy run is due). Every rank
computes the same decision; the new placement's fingerprint is compared across ranks
before it is used. On a GPU the statistics are one step older (their copy to the host runs
in the background), so ``step()`` never waits for the device.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Optional

import numpy as np
import torch

from ..collective import USER_INTS_MOST
from ..env import checked_seconds
from ..errors import ConfigurationError, InvalidArgumentError, PlacementError, RocmoeError
from .cost_calibration import RatioWindow, split_prediction, sync_prediction
from .cost_model import CostModel, profile
from .expert_copy import Copy, ExpertMover
from .load_forecast import LoadForecast
from .placement import Placement, balance_ratio, copies_needed
from .policy import POLICIES
from .rank_agreement import agree_on_fields, allgather_ints
from .replica_sync import REDUCERS, ReplicaGroup, auto_reducer, reduce_dtype
from .vexpert_clock import LayerClock
from .vexpert_routing import VExpertDispatcher


def _vexpert_layers(layers) -> list:
    if isinstance(layers, torch.nn.Module):
        layers = [m for m in layers.modules()
                  if isinstance(getattr(m, "dispatcher", None), VExpertDispatcher)]
    layers = list(layers)
    for layer in layers:
        if not isinstance(getattr(layer, "dispatcher", None), VExpertDispatcher):
            raise ConfigurationError(
                f"VExpertScheduler takes DroplessMoE layers built with placement='vexpert'; "
                f"got {type(layer).__name__} with placement="
                f"{getattr(layer, 'placement', None)!r}")
    return layers


class PolicyBackoff:
    """When the policy may run again after it found nothing to change.

    A policy run that keeps the placement (the cost model sees no shorter step: the load
    cannot be spread further, or moving it costs more than it saves) would most likely say
    the same next step, and each run costs host time (on an H200 at 8 experts, with the
    policy run and changing nothing every step, the scheduler took 1.35 ms a step, 0.085
    of the step). So after k such verdicts in a row the next run
    waits 2^min(k, MAX_DOUBLINGS) rebalance intervals, unless the balance ratio grew by
    more than WORSENED since the last verdict; a change resets it. Every rank sees the same
    counts and verdicts, so every rank decides alike."""

    MAX_DOUBLINGS = 4
    WORSENED = 1.05

    def __init__(self):
        self.quiet = 0             # no-change verdicts in a row
        self.next_step = 0         # the first layer step the policy may run at
        self.quiet_ratio = None    # the balance ratio at the last no-change verdict

    def due(self, step: int, ratio: float) -> bool:
        if self.quiet_ratio is not None and ratio > self.quiet_ratio * self.WORSENED:
            return True
        return step >= self.next_step

    def verdict(self, step: int, every: int, ratio: float, changed: bool) -> None:
        if changed:
            self.quiet, self.next_step, self.quiet_ratio = 0, 0, None
            return
        self.quiet += 1
        self.next_step = step + every * 2 ** min(self.quiet, self.MAX_DOUBLINGS)
        self.quiet_ratio = ratio

    def state_dict(self) -> dict:
        return {"quiet": self.quiet, "next_step": self.next_step,
                "quiet_ratio": self.quiet_ratio}

    def load_state_dict(self, state: Optional[dict]) -> None:
        state = state or {}  # a checkpoint from before the backoff: start without one
        self.quiet = int(state.get("quiet", 0))
        self.next_step = int(state.get("next_step", 0))
        ratio = state.get("quiet_ratio")
        self.quiet_ratio = None if ratio is None else float(ratio)


def _ppm(value: float) -> int:
    """`value` in millionths, for an agreement (-1 where it is not finite: rejected anyway)."""
    return round(value * 1e6) if math.isfinite(value) else -1


class _LayerState:
    def __init__(self, layer, mover, load: LoadForecast, window: int):
        self.layer = layer
        self.mover = mover
        self.pending: Optional[Placement] = None
        self.load = load
        self.staged = None   # GPU: (pinned counts, event) of the previous step
        self.steps = 0
        self.backoff = PolicyBackoff()
        self.compute = RatioWindow(max(window, 1))   # measured / predicted forward + backward
        self.clock: Optional[LayerClock] = None      # attached once the ranks agreed
        # timed steps whose slowest-rank time the ranks have not agreed on yet:
        # [placement, counts, this rank's ms, the calibration factor before it, log entry]
        self.unagreed: "deque[list]" = deque(maxlen=max(window, 1))


class VExpertScheduler:
    """Placement changes for the vExpert layers of ``layers`` (a module or a list).

    policy: "greedy" (FlexMoE Alg. 2) or "eplb"; cost_model: a CostModel, or None to
    profile one at the first step; max_copies_per_rank: weight copies into one rank per
    change (its inbox room); load_decay: weight of the past in the averaged counts;
    load_trend: weight of the newest change in the counts' trend (load_forecast.py: the
    policy plans for the counts forecast at the step its change takes effect; 0 plans for
    the averaged counts);
    replica_sync: how replicated experts' gradients are summed (replica_sync.py): "auto"
    (torch.distributed where the user initialized it, else MPI for CPU layers and the
    symmetric heap for GPU ones), "torch", "mpi" or "heap";
    calibration_window: the cost model is scaled by the median of this many last steps'
    measured / predicted times (cost_calibration.py); 0 keeps the profiled model as it is."""

    def __init__(self, layers, optimizer, *, policy: str = "greedy",
                 cost_model: Optional[CostModel] = None, max_copies_per_rank: int = 2,
                 group_cache_size: int = 64, load_decay: float = 0.5, load_trend: float = 0.5,
                 timeout_s: Optional[float] = None, log_steps: int = 1000,
                 replica_sync: str = "auto", calibration_window: int = 8):
        self.layers = _vexpert_layers(layers)
        if not self.layers:
            raise ConfigurationError("VExpertScheduler found no DroplessMoE layer with "
                                     "placement='vexpert'")
        ctxs = {id(layer.ctx) for layer in self.layers}
        if len(ctxs) != 1:
            raise ConfigurationError("the scheduler's layers must share one rocmoe Context")
        self.ctx = self.layers[0].ctx
        self.world_size = self.layers[0].world_size
        self.optimizer = optimizer
        self.policy = policy
        self.cost_model = cost_model
        # the arguments a rank can get wrong alone are checked here and raised after the
        # agreement below, on every rank (raised here, they left the others waiting in it)
        policy_ok = isinstance(policy, str) and policy in POLICIES
        try:
            self.max_copies_per_rank = int(max_copies_per_rank)
            self.load_decay, self.load_trend = float(load_decay), float(load_trend)
            numbers_ok = True
        except (TypeError, ValueError, OverflowError):
            self.max_copies_per_rank, self.load_decay, self.load_trend = 2, 0.5, 0.5
            numbers_ok = False
        load_ok = numbers_ok and 0.0 <= self.load_decay < 1.0 and 0.0 <= self.load_trend <= 1.0
        window_ok = isinstance(calibration_window, int) and not isinstance(
            calibration_window, bool) and calibration_window >= 0
        self.calibration_window = int(calibration_window) if window_ok else 0
        default_timeout = getattr(self.ctx, "timeout_s", 60.0) if self.ctx is not None else 60.0
        if timeout_s is None:
            timeout_s = default_timeout
        try:  # (the rule of every wait's bound: env.checked_seconds)
            self.timeout_s, timeout_problem = checked_seconds(timeout_s, "timeout_s"), None
        except InvalidArgumentError as exc:
            self.timeout_s, timeout_problem = default_timeout, ConfigurationError(str(exc))
        multi = self.world_size > 1
        # a change takes effect at the next step, or one later when it copies weights
        self.states = [_LayerState(layer, ExpertMover(self.ctx, layer, optimizer, self.timeout_s)
                                   if multi else None,
                                   LoadForecast(1.0 - self.load_decay, self.load_trend, 2.0)
                                   if load_ok else LoadForecast(), self.calibration_window)
                       for layer in self.layers]
        self.sync = RatioWindow(max(self.calibration_window, 1))  # the replica sums'
        self._sync_ms = float("nan")   # the last pre-hook's replica sum, this rank
        self._sync_unagreed: "deque[list]" = deque(maxlen=max(self.calibration_window, 1))
        problem = None if replica_sync in REDUCERS or replica_sync == "auto" else \
            ConfigurationError(f"replica_sync must be 'auto' or one of {sorted(REDUCERS)}, "
                               f"got {replica_sync!r}")
        if problem is None and not policy_ok:
            problem = ConfigurationError(f"policy must be one of {sorted(POLICIES)}, got "
                                         f"{policy!r}")
        if problem is None and not numbers_ok:
            problem = ConfigurationError(
                f"max_copies_per_rank, load_decay and load_trend must be numbers, got "
                f"{max_copies_per_rank!r}, {load_decay!r} and {load_trend!r}")
        if problem is None and not load_ok:  # raised on every rank, after the agreement
            problem = ConfigurationError(f"load_decay must be in [0, 1) and load_trend in "
                                         f"[0, 1], got {load_decay} and {load_trend}")
        if problem is None:
            problem = timeout_problem
        if problem is None and not window_ok:
            problem = ConfigurationError(f"calibration_window must be an int >= 0 (0: no "
                                         f"calibration), got {calibration_window!r}")
        self.replica_sync, self.reducer = None, None
        if problem is not None and not multi:
            raise problem
        if multi:
            if replica_sync == "auto":
                replica_sync = auto_reducer(self.ctx, self.layers[0].w1.device)
            # a rank that chose another reducer would wait in another collective
            choices = sorted(REDUCERS)
            policies = sorted(POLICIES)
            agree_on_fields(self.ctx, {"replica_sync": choices.index(replica_sync)
                                       if problem is None else -1,
                                       "calibration_window": self.calibration_window,
                                       "policy": policies.index(policy) if policy_ok else -1,
                                       "layers": len(self.layers),
                                       "max_copies_per_rank": self.max_copies_per_rank,
                                       "load_decay_ppm": _ppm(self.load_decay),
                                       "load_trend_ppm": _ppm(self.load_trend)},
                            "VExpertScheduler", problem,
                            labels={"replica_sync": choices, "policy": policies})
            self.replica_sync = replica_sync
            options = {} if replica_sync == "heap" else {"cache_size": group_cache_size}
            self.reducer = REDUCERS[replica_sync](self.ctx, self.timeout_s, **options)
            if self.calibration_window:
                for st in self.states:
                    st.clock = LayerClock(st.layer)
        self.steps = 0
        # one record per step (statistics, decisions), the most recent ones
        self.log: "deque[dict]" = deque(maxlen=log_steps)
        self.timings = {"decide_ms": 0.0, "sync_ms": 0.0, "commit_ms": 0.0}
        self.dropped_changes = 0
        self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) \
            if optimizer is not None else None

    # -- helpers ------------------------------------------------------------------------
    def _allgather(self, values, what):
        return allgather_ints(self.ctx, values, what)

    def _allgather_floats(self, values) -> np.ndarray:
        """[world, n] float64, through the timed int all-gather (bit patterns)."""
        values = np.asarray(values, dtype=np.float64)
        # in all-gathers of what one carries (chunks of 14 failed: a model of two vExpert
        # layers under calibration met 16 at its first policy run after the start)
        most = USER_INTS_MOST
        chunks = [self._allgather(values[i:i + most].view(np.int64).tolist(), "cost model")
                  for i in range(0, values.size, most)]
        table = np.concatenate(chunks, axis=1) if chunks else np.zeros((self.world_size, 0))
        return np.ascontiguousarray(table, dtype=np.int64).view(np.float64)

    def _state(self, layer) -> _LayerState:
        for st in self.states:
            if st.layer is layer:
                return st
        raise ConfigurationError("that layer is not one of this scheduler's layers")

    # -- the optimizer pre-hook: commit landed copies, sum replica gradients ---------------
    def _before_optimizer_step(self, optimizer=None, args=None, kwargs=None) -> None:
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        pending = [st for st in self.states if st.pending is not None]
        commit = set()
        if pending:
            failure = None
            try:
                ready = all(st.mover.landed() for st in pending)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                ready, failure = False, exc
            table = self._allgather([int(ready), int(failure is not None)],
                                    "vExpert change: copies landed")
            if table[:, 1].any():
                failed = [r for r in range(self.world_size) if table[r, 1]]
                raise PlacementError(
                    f"an expert copy failed on rank(s) {failed}"
                    + (f": {type(failure).__name__}: {failure}" if failure else
                       " (see the error there)")) from failure
            if table[:, 0].all():
                commit = {id(st) for st in pending}
            else:
                for st in pending:
                    st.pending = None
                    st.mover.discard()
                self.dropped_changes += len(pending)
        t1 = time.perf_counter()
        self._sum_replica_gradients(commit)
        t2 = time.perf_counter()
        self._sync_ms = (t2 - t1) * 1e3
        for st in self.states:
            if id(st) in commit:
                st.mover.install()
                self._set_placement(st, st.pending)
                st.pending = None
        t3 = time.perf_counter()
        self.timings["sync_ms"] += (t2 - t1) * 1e3
        self.timings["commit_ms"] += ((t1 - t0) + (t3 - t2)) * 1e3

    def sync_gradients(self) -> None:
        """Collective: sum the replicated experts' gradients now (the optimizer pre-hook does
        this, with any landed change, before every optimizer step)."""
        if self.world_size > 1:
            self._sum_replica_gradients(set())

    def _set_placement(self, st: _LayerState, placement: Placement) -> None:
        st.layer.dispatcher.set_placement(placement)
        st.layer.dispatcher.agreed = True  # checked when it was decided

    def _sum_replica_gradients(self, commit: set) -> None:
        """Sum each replicated expert's gradients over its holders (old and new ones for a
        committing change), from its old weight slot into its new one."""
        work = []   # (key, members, layer, old slot, new slot)
        for index, st in enumerate(self.states):
            old = st.layer.dispatcher.placement
            new = st.pending if id(st) in commit else old
            old_ws, new_ws = old.weight_slots(), new.weight_slots()
            for e in range(old.num_experts):
                members = tuple(sorted(set(old.holders(e)) | set(new.holders(e))))
                r = st.layer.rank
                moved = old_ws[e, r] != new_ws[e, r]
                if len(members) < 2 and not moved:
                    continue
                work.append(((index, e, members), st.layer, int(old_ws[e, r]), int(new_ws[e, r])))
        if not work:
            return
        groups, mine, targets = [], {}, []
        for key, layer, old_slot, new_slot in work:
            params = [p for p in (layer.w1, layer.w2, layer.w3) if p is not None]
            numels = [p[0].numel() for p in params]
            dtype = reduce_dtype(params[0].dtype)
            if len(key[2]) > 1:
                groups.append(ReplicaGroup(key, key[2], sum(numels), dtype))
            if layer.rank not in key[2]:
                continue
            device = params[0].device
            # this rank's gradient of the expert (zeros where it has none: a new holder)
            buf = torch.cat([torch.zeros(n, dtype=dtype, device=device)
                             if (old_slot < 0 or p.grad is None) else
                             p.grad[old_slot].detach().reshape(-1).to(dtype)
                             for p, n in zip(params, numels)])
            if len(key[2]) > 1:
                mine[key] = buf
            targets.append((buf, params, new_slot, old_slot))
        self.reducer.sum_(groups, mine)
        with torch.no_grad():
            # every buffer was packed above, so slots may be cleared and refilled in any
            # order (a swap's old slot is the other expert's new one)
            for buf, params, new_slot, old_slot in targets:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                if old_slot >= 0 and old_slot != new_slot:
                    for p in params:
                        p.grad[old_slot].zero_()
            for buf, params, new_slot, old_slot in targets:
                if new_slot >= 0:
                    start = 0
                    for p in params:
                        n = p[0].numel()
                        p.grad[new_slot].copy_(buf[start:start + n].view(p[0].shape))
                        start += n

    # -- after the optimizer step: statistics and decisions ---------------------------------
    def step(self) -> None:
        """Collective (every rank, after optimizer.step()): read the last step's loads and
        times, calibrate the cost model where a policy run is due, run the policy, start the
        changes it decides."""
        t0 = time.perf_counter()
        self.steps += 1
        record = {"step": self.steps, "layers": []}
        work = []
        for st in self.states:
            if st.clock is not None:
                st.clock.close_step()
            counts = self._read_counts(st)
            if counts is None:
                record["layers"].append(None)
                continue
            st.load.update(counts)
            st.steps += 1
            if self.cost_model is None and self.world_size > 1:
                self.cost_model = self._profile(st.layer, counts)  # once, at the start
            placement = st.layer.dispatcher.placement
            loads = placement.rank_loads(counts.sum(axis=0))
            entry = {"balance_ratio": balance_ratio(loads), "rank_loads": loads.tolist(),
                     "decision": None}
            record["layers"].append(entry)
            self._note_time(st, counts, entry)
            work.append((st, entry))
        self._note_sync_time(record)
        # the policy decides with the model calibrated up to here: agree on the times
        # (one all-gather) only where it may run
        if any(st.steps % st.layer.rebalance_every == 0 for st, _ in work):
            self._agree_on_times()
        for st, entry in work:
            placement = st.layer.dispatcher.placement
            forecast = st.load.forecast()
            # the change would take effect when the forecast is for: act on a rise before
            # the rank that takes it is the straggler
            ahead = balance_ratio(placement.rank_loads(forecast.sum(axis=0)))
            entry["forecast_balance_ratio"] = ahead
            due = max(entry["balance_ratio"], ahead)
            every = st.layer.rebalance_every
            if self.world_size > 1 and st.pending is None and st.steps % every == 0 \
                    and due > st.layer.balance_threshold:
                if not st.backoff.due(st.steps, due):
                    entry["decision"] = {"skipped": "backoff", "next_step":
                                         st.backoff.next_step}
                    continue
                result = POLICIES[self.policy](
                    placement, forecast, self.calibrated_model(st.layer),
                    threshold=st.layer.balance_threshold,
                    max_copies_per_rank=self.max_copies_per_rank)
                st.backoff.verdict(st.steps, every, due, result.placement != placement)
                if result.placement != placement:
                    entry["decision"] = self._change(st, result.placement)
                    entry["decision"].update(expands=result.expands, shrinks=result.shrinks,
                                             migrates=result.migrates,
                                             predicted_ms=result.predicted_ms,
                                             baseline_ms=result.baseline_ms)
        self._sync_ms = float("nan")
        self.log.append(record)
        self.timings["decide_ms"] += (time.perf_counter() - t0) * 1e3

    # -- the cost model's calibration -----------------------------------------------------
    def calibrated_model(self, layer) -> Optional[CostModel]:
        """The cost model scaled by what it missed on the steps the ranks last agreed on
        (cost_calibration.py): what the policy decides with, and the next step's
        prediction. None before the profile."""
        if self.cost_model is None:
            return None
        return self.cost_model.scaled(self._state(layer).compute.factor(), self.sync.factor())

    def _note_time(self, st: _LayerState, counts, entry: dict) -> None:
        """Keep this rank's time of the layer's timed step (the last one on the host, the
        one before on a GPU, as the counts) until the ranks agree on the slowest."""
        if st.clock is None:
            return
        timed = st.clock.last_step()
        placement, ms = timed if timed is not None else (None, float("nan"))
        st.unagreed.append([placement, counts, ms, st.compute.factor(), entry])

    def _note_sync_time(self, record: dict) -> None:
        """The same for this step's replica sums (every layer's in one pre-hook), when the
        placements the step ran on replicate anything."""
        if not self.calibration_window or self.world_size == 1 \
                or not math.isfinite(self._sync_ms):
            return
        placements = [st.clock.current_placement() for st in self.states]
        if any(p is None or (p.replicas() > 0).sum(axis=1).max() > 1 for p in placements):
            self._sync_unagreed.append([placements, self._sync_ms, self.sync.factor(),
                                        record])

    def _agree_on_times(self) -> None:
        """Collective: the slowest rank's time of every step noted since the last agreement
        (NaN where a rank did not time it: then no rank uses that step), compared with what
        the model, as calibrated before that step, predicted; then its ratio calibrates the
        model. One all-gather of these floats."""
        noted = [(st, n) for st in self.states for n in st.unagreed]
        values = [n[2] for _, n in noted] + [n[1] for n in self._sync_unagreed]
        if not values:
            return
        slowest = self._allgather_floats(values).max(axis=0)
        for (st, (placement, counts, _, factor, entry)), ms in zip(noted, slowest):
            if placement is None or not math.isfinite(ms) or self.cost_model is None:
                continue
            raw, _ = split_prediction(self.cost_model, placement, counts)
            entry["cost_model"] = {"predicted_ms": raw * factor, "measured_ms": float(ms),
                                   "uncalibrated_ms": raw}
            st.compute.observe(raw, float(ms), tag=placement)
        for (placements, _, factor, record), ms in zip(self._sync_unagreed,
                                                        slowest[len(noted):]):
            if None in placements or not math.isfinite(ms) or self.cost_model is None:
                continue
            raw = sync_prediction(self.cost_model, placements)
            if raw <= 1e-6:
                continue
            record["replica_sum"] = {"predicted_ms": raw * factor, "measured_ms": float(ms),
                                     "uncalibrated_ms": raw}
            self.sync.observe(raw, float(ms))
        for st in self.states:
            st.unagreed.clear()
        self._sync_unagreed.clear()

    def _read_counts(self, st: _LayerState) -> Optional[np.ndarray]:
        """The last forward's [world, E] pair counts on the host. On a GPU without waiting
        for it: this step's counts are copied into pinned memory in the background and the
        previous step's copy (long finished) is what the statistics use."""
        latest = st.layer.dispatcher.last_counts
        if latest is None:
            return None
        if not latest.is_cuda:
            return latest.detach().numpy().astype(np.float64)
        staged = torch.empty(latest.shape, dtype=latest.dtype, pin_memory=True)
        staged.copy_(latest.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, st.staged = st.staged, (staged, done)
        if previous is None:
            return None
        previous[1].synchronize()
        return previous[0].numpy().astype(np.float64)

    def _profile(self, layer, counts) -> CostModel:
        from .parallel import transport_for
        tokens = int(counts.sum() / max(self.world_size, 1) / layer.top_k)
        local = getattr(self.ctx, "local_size", self.world_size)
        return profile(layer, transport_for(self.ctx), self.reducer, max(tokens, 8),
                       ranks_per_node=0 if local >= self.world_size else local,
                       exchange=self._allgather_floats)

    def _change(self, st: _LayerState, new: Optional[Placement],
                problem: Optional[Exception] = None) -> dict:
        """Collective: check every rank decided `new`, then start it (or apply it at once).
        `problem` (and `new` None): this rank refuses the change; every rank raises."""
        old = st.layer.dispatcher.placement
        refused = -1  # (fingerprints are 63-bit, never negative)
        prints = self._allgather([refused if new is None else new.fingerprint()],
                                 "vExpert change")[:, 0]
        if problem is not None:
            raise problem
        if (prints == refused).any():
            ranks = [r for r, p in enumerate(prints) if p == refused]
            raise PlacementError(f"rank(s) {ranks} refused the vExpert change (see their "
                                 "errors); no rank changed its placement")
        if (prints != prints[0]).any():
            raise PlacementError(
                f"the ranks decided different vExpert placements for a layer (fingerprints "
                f"{prints.tolist()}): their statistics or cost models differ")
        copies = [Copy(*c) for c in copies_needed(old, new)]
        if not copies:
            self._set_placement(st, new)
            return {"copies": 0, "applied": "now"}
        st.mover.issue(copies)
        st.pending = new
        return {"copies": len(copies), "applied": "after the copies land"}

    # -- the primitives, by hand (collective: every rank, the same arguments) -----------------
    def _request(self, layer, make) -> dict:
        st = self._state(layer)
        if st.pending is not None:
            raise PlacementError("a placement change of this layer is still in flight; call "
                                 "scheduler.step() after the next optimizer step first")
        # a rank whose own request is impossible (no free slot, no such expert) still takes
        # part in the change's agreement, so that the others raise too instead of waiting
        try:
            new, problem = make(layer.dispatcher.placement), None
        except RocmoeError as exc:
            new, problem = None, exc
        if self.world_size == 1:
            if problem is not None:
                raise problem
            self._set_placement(st, new)
            return {"copies": 0, "applied": "now"}
        return self._change(st, new, problem)

    def expand(self, layer, expert: int, rank: int) -> dict:
        """Expand(expert, rank): a vExpert of `expert` in a free slot of `rank`."""
        return self._request(layer, lambda p: p.expanded(expert, rank))

    def shrink(self, layer, expert: int, rank: int) -> dict:
        """Shrink(expert, rank): free one of `rank`'s vExperts of `expert` (no data moves)."""
        return self._request(layer, lambda p: p.shrunk(expert, rank))

    def migrate(self, layer, a: tuple[int, int], b: tuple[int, int]) -> dict:
        """Migrate: swap the experts of slots a = (rank, slot) and b."""
        return self._request(layer, lambda p: p.migrated(a, b))

    def pending(self, layer) -> Optional[Placement]:
        return self._state(layer).pending

    # -- checkpoints and shutdown ----------------------------------------------------------
    def state_dict(self) -> dict:
        """The scheduler's own state (each layer's placement is in the layer's state_dict)."""
        return {"version": 1, "steps": self.steps, "policy": self.policy,
                "cost_model": None if self.cost_model is None else self.cost_model.to_dict(),
                "sync_calibration": self.sync.state_dict(),
                "layers": [{"steps": st.steps, "load": st.load.state_dict(),
                            "backoff": st.backoff.state_dict(),
                            "calibration": st.compute.state_dict()}
                           for st in self.states]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1 \
                or len(state.get("layers", [])) != len(self.states):
            raise ConfigurationError("not a VExpertScheduler state for these layers")
        self.steps = int(state["steps"])
        self.policy = state["policy"]
        model = state.get("cost_model")
        self.cost_model = None if model is None else CostModel.from_dict(model)
        # a state from before the calibration: the profiled model as it was
        self.sync.load_state_dict(state.get("sync_calibration"))
        for st, saved in zip(self.states, state["layers"]):
            st.steps = int(saved["steps"])
            # a state from before the forecast has the averaged counts alone: no trend yet
            st.load.load_state_dict(saved["load"] if "load" in saved
                                    else {"level": saved.get("counts_ema")})
            st.backoff.load_state_dict(saved.get("backoff"))
            st.compute.load_state_dict(saved.get("calibration"))
            st.pending = None

    def close(self) -> None:
        """Collective: remove the optimizer hook, free the inboxes and communicators."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for st in self.states:
            if st.clock is not None:
                st.clock.remove()
                st.clock = None
            if st.mover is not None:
                st.mover.free()
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None


__all__ = ["VExpertScheduler"]
