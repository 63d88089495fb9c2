"""vExpert scheduling benchmark: balance under a drifting Zipf load, measured host steps.

    rocmoe bench vexpert [--part sim,measured] [--output F] [--png F] [--steps N] ...

Every JSON line names its baseline (the static placement, measured in the same run):

* ``balance_ratio_drifting_zipf`` (``--part sim``, counts only, in process): per step every
  rank draws ``--pairs`` (token, slot) pairs from Zipf(1.2) over the experts, whose ranking
  drifts (a few experts swap places every ``--period`` steps, blended in linearly), and
  the pairs are routed by the real vExpert routing (``vexpert_routing.assignment``) under
  the placement that the policy (``greedy`` = FlexMoE Alg. 2, ``eplb``) chose, with the
  same delays as the scheduler: a change that moves weights is used two steps after the
  counts it was decided on, one without copies one step after. ``ratio`` = static's mean
  balance ratio over the policy's. The policies predict with a counts-only cost model
  (time = the busiest rank's rows).
* ``host_step_time`` (``--part measured``, 2 ranks under mpiexec, OMP_NUM_THREADS=1, glibc
  malloc keeping freed memory unless ``--malloc default``): a
  training step (forward, backward, optimizer step with the replica gradient sum, and for
  vExpert ``scheduler.step()``) of a static and a vExpert DroplessMoE layer with the same
  weights and data, alternated step by step, under a router that sends (almost) every
  token to rank 0's experts. ``ratio`` = static's median step time over vExpert's, steps
  after ``--warmup``.
* ``cost_model_error``: the scheduler's cost model (profiled at its first step, scaled by
  the median of its last steps' measured / predicted times: cost_calibration.py) predicts
  each timed step's layer part (forward + backward + replica sync) from that step's
  placement and counts, with the calibration as it was before the step; the record has the
  mean and max relative error. ``vexpert``: the scheduler's own calibration; ``static``:
  the same mechanism on the static layer's steps (its forward + backward timed by the same
  hooks, vexpert_clock.py); ``static_by_vexpert_calibration``: the static steps predicted
  by the vExpert layer's calibrated model (another placement than the one it learnt on);
  ``*_uncalibrated``: the profiled model alone.
* ``scheduler_share``: the scheduler's own time (statistics, policy, agreeing, installing
  copies; not the gradient sum, which is training work) over the vExpert step time.
* ``png``: tokens per rank over steps, static against vExpert (simulation and measured).
"""

from __future__ import annotations

import argparse
import json
from collections import deque
import os
import sys
import time
from typing import Optional

import numpy as np

from . import emit, inside_mpi_job, relaunch_under_mpiexec

SIM_CONFIGS = ((8, 2), (16, 4), (32, 4), (64, 8))
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


# -- the simulation ------------------------------------------------------------------------
class DriftingZipf:
    """Zipf(s) over experts whose ranking drifts: every `period` steps a few experts swap
    ranks, and the probabilities blend linearly from the old ranking to the new one."""

    def __init__(self, experts: int, period: int, rng, s: float = 1.2):
        self.experts, self.period, self.rng, self.s = experts, period, rng, s
        self.old = rng.permutation(experts)
        self.new = self._shuffled(self.old)

    def _shuffled(self, perm):
        perm = perm.copy()
        picked = self.rng.choice(self.experts, size=max(2, self.experts // 8), replace=False)
        perm[picked] = perm[self.rng.permutation(picked)]
        return perm

    def _probs(self, perm):
        p = np.empty(self.experts)
        p[perm] = 1.0 / (np.arange(self.experts) + 1.0) ** self.s
        return p / p.sum()

    def probs(self, step: int) -> np.ndarray:
        if step and step % self.period == 0:
            self.old, self.new = self.new, self._shuffled(self.new)
        blend = (step % self.period) / self.period
        return (1 - blend) * self._probs(self.old) + blend * self._probs(self.new)


def simulate(policy: str, experts: int, world: int, steps: int = 100, seed: int = 0,
             slots: Optional[int] = None, pairs: int = 4096, period: int = 20,
             threshold: float = 1.05, max_copies_per_rank: int = 2, load_decay: float = 0.5,
             load_trend: float = 0.5) -> dict:
    """Counts-only run of `policy` ("static", "greedy", "eplb"): per step the balance ratio,
    tokens per rank, whether every pair was routed, and the weight copies started."""
    import torch
    from ..moe.cost_model import CostModel
    from ..moe.load_forecast import LoadForecast
    from ..moe.placement import Placement, balance_ratio, copies_needed, default_slots_per_rank
    from ..moe.policy import POLICIES
    from ..moe.vexpert_routing import assignment
    slots = slots or default_slots_per_rank(experts, world)
    rng = np.random.default_rng(seed)
    load = DriftingZipf(experts, period, rng)
    placement = Placement.static(experts, world, slots)
    model = CostModel()
    pending = None   # (placement, first step it is used)
    forecast = LoadForecast(1.0 - load_decay, load_trend, 2.0)  # as VExpertScheduler plans
    out = {"balance_ratio": [], "tokens_per_rank": [], "routed_every_pair": [], "copies": [],
           "policy": policy, "experts": experts, "ranks": world, "slots_per_rank": slots}
    for step in range(steps):
        if pending is not None and pending[1] == step:
            placement, pending = pending[0], None
        p = load.probs(step)
        counts = np.stack([rng.multinomial(pairs, p) for _ in range(world)])
        a = assignment(torch.from_numpy(counts), torch.from_numpy(placement.replicas()))
        per_rank = a.sum(dim=(0, 1)).tolist()
        out["balance_ratio"].append(balance_ratio(per_rank))
        out["tokens_per_rank"].append(per_rank)
        out["routed_every_pair"].append(bool(torch.equal(a.sum(dim=2),
                                                         torch.from_numpy(counts))))
        forecast.update(counts)
        copies = 0
        # as the scheduler: due when this step or the forecast at the step a change would
        # take effect is above the threshold
        due = max(out["balance_ratio"][-1],
                  balance_ratio(placement.rank_loads(forecast.forecast().sum(axis=0))))
        if policy != "static" and pending is None and due > threshold:
            new = POLICIES[policy](placement, forecast.forecast(), model, threshold=threshold,
                                   max_copies_per_rank=max_copies_per_rank).placement
            if new != placement:
                copies = sum(1 for c in copies_needed(placement, new) if c[1] != c[3])
                pending = (new, step + (2 if copies_needed(placement, new) else 1))
        out["copies"].append(copies)
    return out


def sim_records(args) -> list[dict]:
    records, runs = [], {}
    for experts, world in SIM_CONFIGS:
        static = simulate("static", experts, world, args.steps, args.seed, pairs=args.pairs,
                          period=args.period)
        runs[(experts, world, "static")] = static
        base = float(np.mean(static["balance_ratio"][args.skip:]))
        for policy in ("greedy", "eplb"):
            t0 = time.perf_counter()
            run = simulate(policy, experts, world, args.steps, args.seed, pairs=args.pairs,
                           period=args.period, max_copies_per_rank=args.max_copies,
                           load_trend=args.load_trend)
            runs[(experts, world, policy)] = run
            ratios = np.asarray(run["balance_ratio"][args.skip:])
            mean = float(ratios.mean())
            records.append({
                "bench": "vexpert", "metric": "balance_ratio_drifting_zipf", "policy": policy,
                "name": "vExpert greedy (FlexMoE Alg. 2)" if policy == "greedy"
                else "EPLB-style (replicate, then pack)",
                "experts": experts, "ranks": world, "slots_per_rank": run["slots_per_rank"],
                "steps": args.steps, "skipped_first_steps": args.skip, "zipf_s": 1.2,
                "pairs_per_rank": args.pairs, "drift_period": args.period,
                "seed": args.seed, "load_trend": args.load_trend,
                "mean_balance_ratio": round(mean, 4),
                "p95_balance_ratio": round(float(np.percentile(ratios, 95)), 4),
                "max_balance_ratio": round(float(ratios.max()), 4),
                "baseline": "static placement", "baseline_mean_balance_ratio": round(base, 4),
                "ratio": round(base / mean, 4),
                "weight_copies_per_step": round(float(np.mean(run["copies"])), 3),
                "every_pair_routed": all(run["routed_every_pair"]),
                "goal": "mean <= 1.05 where static >= 2",
                "meets_goal": bool(mean <= 1.05) if base >= 2 else None,
                "policy_ms_per_step": round((time.perf_counter() - t0) * 1e3 / args.steps, 2),
            })
    return records, runs


# -- the measured run (2 ranks) -----------------------------------------------------------
def skewed_router(layer, ranks_experts: int, strength: float = 4.0) -> None:
    """Router weights that send (nearly) every token to experts [0, ranks_experts): the
    inputs carry an offset along the first feature, and only those experts' rows see it."""
    import torch
    w = torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(1))
    w *= 0.05
    w[:, 0] = -strength
    w[:ranks_experts, 0] = strength
    with torch.no_grad():
        layer.router.weight.copy_(w)


def measured(args) -> list[dict]:
    import torch
    from mpi4py import MPI
    import rocmoe
    from ..moe import DroplessMoE, VExpertScheduler
    from ..moe.cost_calibration import RatioWindow, split_prediction
    from ..moe.cost_model import noise_floor, prediction_error
    from ..moe.placement import Placement
    from ..moe.vexpert_clock import LayerClock
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if args.device == "cuda":   # the ranks share GPU 0 (ipc heap)
        # 4 GiB a rank: the exchanges' upper-bound buffers grow with tokens x hidden (a
        # GPU-sized layer, 8192 tokens of 1024 in fp32 at 2 ranks, took 512 MiB of heap in
        # one forward and backward on the host backend, before the scheduler's inboxes)
        ctx = rocmoe.init(backend="ipc", heap_size=4 << 30, device=0)
    else:
        ctx = rocmoe.init(backend="host", heap_size=256 << 20)
    device = ctx.device
    rank, world = ctx.rank, ctx.world_size

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    e_local = args.experts // world
    torch.manual_seed(0)
    static = DroplessMoE(args.hidden, args.ffn, args.experts, args.top_k, ctx=ctx,
                         block_size=64)
    torch.manual_seed(0)
    vex = DroplessMoE(args.hidden, args.ffn, args.experts, args.top_k, ctx=ctx, block_size=64,
                      placement="vexpert", slots_per_rank=args.slots or None,
                      rebalance_every=1, balance_threshold=args.threshold)
    static.to(device)
    vex.to(device)
    for layer in (static, vex):
        skewed_router(layer, e_local)
    opt_s = torch.optim.SGD(static.parameters(), lr=1e-3)
    opt_v = torch.optim.SGD(vex.parameters(), lr=1e-3)
    sched = VExpertScheduler([vex], opt_v)
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    x[:, 0] += 3.0
    target = torch.randn(args.tokens, args.hidden, generator=gen).to(device)
    x = x.to(device)
    static_placement = Placement.static(args.experts, world, e_local)
    rows = {"static": [], "vexpert": []}
    # the static layer's steps calibrate a model as the scheduler's do its layer's: the
    # same hooks, the slowest rank's time, the median of the last ratios
    static_clock = LayerClock(static)
    static_window = RatioWindow(sched.calibration_window or 1)
    static_counts = deque(maxlen=2)

    def timed(layer, opt, scheduler):
        sync()
        ctx.barrier()
        placement = layer.dispatcher.placement if scheduler else static_placement
        sync0 = sched.timings["sync_ms"] if scheduler else 0.0
        # the models that predict this step, as they are before it
        model = sched.calibrated_model(vex)
        calibration = {"vexpert": model, "raw": sched.cost_model,
                       "static": None if sched.cost_model is None else
                       sched.cost_model.scaled(static_window.factor())}
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = ((layer(x) - target) ** 2).mean()
        loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync_ms = (sched.timings["sync_ms"] - sync0) if scheduler else 0.0
        if scheduler:
            counts = layer.dispatcher.last_counts.cpu().numpy().copy()
            scheduler.step()
        else:
            counts = np.stack(comm.allgather(layer.tokens_per_expert.cpu().numpy()))
            static_counts.append(counts)
            static_clock.close_step()
            # the clock's timed step: this one on the host, the one before on a GPU
            timed_ms = (static_clock.last_step() or (None, float("nan")))[1]
            timed_ms = comm.allreduce(timed_ms, op=MPI.MAX)
            lag = 2 if static_clock.cuda else 1
            if sched.cost_model is not None and len(static_counts) >= lag:
                raw = split_prediction(sched.cost_model, placement, static_counts[-lag])[0]
                static_window.observe(raw, timed_ms)
        sync()
        t2 = time.perf_counter()
        # the step ends when the slowest rank is done (the exchanges keep them in step)
        layer_ms = comm.allreduce((t1 - t0) * 1e3 + sync_ms, op=MPI.MAX)
        step_ms = comm.allreduce((t2 - t0) * 1e3, op=MPI.MAX)
        return {"layer_ms": layer_ms, "step_ms": step_ms, "placement": placement,
                "counts": counts, "loss": float(loss.detach()), "models": calibration}

    decide0 = None
    for step in range(args.measured_steps):
        rows["static"].append(timed(static, opt_s, None))
        if step == args.warmup:
            decide0 = dict(sched.timings)
        rows["vexpert"].append(timed(vex, opt_v, sched))
    records = []
    if rank == 0:
        keep = slice(args.warmup, None)
        med = {k: float(np.median([r["step_ms"] for r in v[keep]])) for k, v in rows.items()}
        records.append({
            "bench": "vexpert", "metric": "host_step_time", "ranks": world,
            "experts": args.experts, "slots_per_rank": vex.slots_per_rank,
            "tokens_per_rank": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
            "top_k": args.top_k, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "device": str(device),
            "steps_timed": len(rows["vexpert"][keep]), "warmup_steps": args.warmup,
            "routing": f"all tokens to rank 0's experts (router skew)",
            "ours": "vExpert (greedy, scheduler overhead included)", "ours_ms": round(med["vexpert"], 2),
            "baseline": "static placement", "baseline_ms": round(med["static"], 2),
            "ratio": round(med["static"] / med["vexpert"], 4),
            "static_rank_loads": static_placement.rank_loads(
                rows["static"][-1]["counts"].sum(axis=0)).tolist(),
            "vexpert_rank_loads": vex.dispatcher.placement.rank_loads(
                rows["vexpert"][-1]["counts"].sum(axis=0)).tolist(),
            "vexpert_placement": vex.dispatcher.placement.to_list(),
            "vexpert_balance_ratio_last": float(vex.dispatcher.balance_ratio),
            "goal": ">= 1.3 under strong skew", "meets_goal": med["static"] / med["vexpert"] >= 1.3,
            "dropped_changes": sched.dropped_changes,
            "malloc": {k: os.environ.get(k) for k in MALLOC_KEEP},
        })
        series_models = (("vexpert", "vexpert", "vexpert"), ("static", "static", "static"),
                         ("static_by_vexpert_calibration", "static", "vexpert"),
                         ("vexpert_uncalibrated", "vexpert", "raw"),
                         ("static_uncalibrated", "static", "raw"))
        for name, layer_name, which in series_models:
            series = rows[layer_name][keep]
            pred = [r["models"][which].predict_ms(r["placement"], r["counts"]) for r in series]
            meas = [r["layer_ms"] for r in series]
            err = prediction_error(pred, meas)
            last = series[-1]["models"][which]
            records.append({
                "bench": "vexpert", "metric": "cost_model_error", "layer": name,
                "what": "layer forward + backward + replica sync, slowest rank",
                "predicted_by": {"vexpert": "the scheduler's model, calibrated on the vExpert "
                                            "layer's steps before this one",
                                 "static": "the profiled model calibrated on the static "
                                           "layer's steps before this one",
                                 "raw": "the profiled model, uncalibrated"}[which],
                "predicted_ms_median": round(float(np.median(pred)), 2),
                "measured_ms_median": round(float(np.median(meas)), 2),
                "mean_abs_error": round(err["mean_abs_error"], 4),
                "max_abs_error": round(err["max_abs_error"], 4),
                "median_error": round(err["median_error"], 4), "steps": err["steps"],
                "noise_floor": {k: None if v is None else round(v, 4)
                                for k, v in noise_floor(meas).items()},
                "predicted_ms_steps": [round(v, 2) for v in pred],
                "measured_ms_steps": [round(v, 2) for v in meas],
                "predicted_terms_last_step_ms": {
                    k: round(v, 3) for k, v in last.breakdown(series[-1]["placement"],
                                                              series[-1]["counts"]).items()},
                "baseline": "measured step",
                "goal": "<= 0.03 on the H200" if device.type == "cuda" else "<= 0.05 on host ranks",
                "meets_goal": err["mean_abs_error"] <= (0.03 if device.type == "cuda" else 0.05),
                "loadavg_1m": round(os.getloadavg()[0], 2),
                "model": last.to_dict(),
            })
        spent = {k: sched.timings[k] - decide0[k] for k in sched.timings}
        total = sum(r["step_ms"] for r in rows["vexpert"][keep])
        records.append({
            "bench": "vexpert", "metric": "scheduler_share", "ranks": world,
            "scheduler_ms_per_step": round((spent["decide_ms"] + spent["commit_ms"]) /
                                           max(len(rows["vexpert"][keep]), 1), 3),
            "replica_sync_ms_per_step": round(spent["sync_ms"] / max(len(rows["vexpert"][keep]), 1), 3),
            "share": round((spent["decide_ms"] + spent["commit_ms"]) / total, 5),
            "baseline": "vExpert step time", "goal": "<= 0.02", "meets_goal":
                (spent["decide_ms"] + spent["commit_ms"]) / total <= 0.02,
        })
        records.append({
            "bench": "vexpert", "metric": "tokens_per_rank_measured",
            "static": [static_placement.rank_loads(r["counts"].sum(axis=0)).tolist()
                       for r in rows["static"]],
            "vexpert": [r["placement"].rank_loads(r["counts"].sum(axis=0)).tolist()
                        for r in rows["vexpert"]],
            "losses_static": [r["loss"] for r in rows["static"]],
            "losses_vexpert": [r["loss"] for r in rows["vexpert"]],
        })
    static_clock.remove()
    sched.close()
    ctx.finalize()
    return records


# -- the figure ------------------------------------------------------------------------------
def write_png(path: str, sim_runs: dict, measured: Optional[dict]) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("simulation, 16 experts / 4 ranks: static", sim_runs.get((16, 4, "static"))),
              ("simulation: vExpert (greedy)", sim_runs.get((16, 4, "greedy")))]
    if measured:
        panels += [("measured, 2 host ranks: static", {"tokens_per_rank": measured["static"]}),
                   ("measured: vExpert", {"tokens_per_rank": measured["vexpert"]})]
    panels = [p for p in panels if p[1] is not None]
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(11, 3.2 * (len(panels) // 2)),
                             squeeze=False)
    for ax, (title, run) in zip(axes.reshape(-1), panels):
        tokens = np.asarray(run["tokens_per_rank"], dtype=np.float64)
        for r in range(tokens.shape[1]):
            ax.plot(tokens[:, r], label=f"rank {r}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("pairs computed")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rocmoe bench vexpert", description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="sim,measured", help="sim, measured or both")
    ap.add_argument("--output", default=None, help="append the JSON lines to this file")
    ap.add_argument("--png", default=None, help="write the tokens-per-rank figure here")
    ap.add_argument("--steps", type=int, default=120, help="simulated steps")
    ap.add_argument("--skip", type=int, default=5, help="simulated steps left out of means")
    ap.add_argument("--pairs", type=int, default=4096, help="simulated pairs per rank and step")
    ap.add_argument("--period", type=int, default=20, help="steps between drift targets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-copies", type=int, default=2)
    ap.add_argument("--load-trend", type=float, default=0.5,
                    help="the forecast's trend weight (0: plan for the averaged counts)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank (measured)")
    ap.add_argument("--slots", type=int, default=0, help="slots per rank (0: the default)")
    ap.add_argument("--threshold", type=float, default=1.05)
    ap.add_argument("--measured-steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="measured part: keep: the ranks' glibc malloc keeps freed memory "
                         "(MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB) so that "
                         "steps do not page-fault it in again by chance; default: glibc's")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="measured part: host ranks, or ranks sharing GPU 0 (ipc heap)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    parts = set(args.part.split(","))
    out = open(args.output, "a") if args.output else None
    if inside_mpi_job():
        for r in measured(args):
            if r["metric"] != "tokens_per_rank_measured":
                emit(r, out)
            elif out is not None:   # the per-step series: for the figure, not the screen
                out.write(json.dumps(r) + "\n")
        if out is not None:
            out.close()
        return 0
    sim_runs, measured_series = {}, None
    if "sim" in parts:
        records, sim_runs = sim_records(args)
        for r in records:
            emit(r, out)
    if out is not None:
        out.close()
    if "measured" in parts:
        os.environ["OMP_NUM_THREADS"] = "1"   # one core per rank: imbalance makes stragglers
        os.environ["MKL_NUM_THREADS"] = "1"
        if args.malloc == "keep":
            # glibc hands freed blocks of a step back to the kernel and faults them in again
            # the next step, a different amount each time: on the 2-core VM 0-24,000 page
            # faults a step, steps of the same work 185-316 ms (mean deviation 0.14 of the
            # median); keeping them (blocks up to 32 MiB from the heap, no trimming): 0.04
            for name, value in MALLOC_KEEP.items():
                os.environ.setdefault(name, value)
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        series_file = args.output or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"rocmoe_vexpert_{os.getpid()}.jsonl")
        if not args.output:
            forwarded += ["--output", series_file]
        rc = relaunch_under_mpiexec("rocmoe.bench.vexpert", forwarded, 2, timeout_s=1800)
        if rc != 0:
            return rc
        if os.path.exists(series_file):
            with open(series_file) as f:
                for line in f:
                    rec = json.loads(line)
                    if rec.get("metric") == "tokens_per_rank_measured":
                        measured_series = rec
            if not args.output:
                os.unlink(series_file)
    if args.png:
        written = write_png(args.png, sim_runs, measured_series)
        emit({"bench": "vexpert", "metric": "png", "path": written,
              "note": None if written else "matplotlib is not installed (pip install "
                                           "matplotlib): no figure"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
