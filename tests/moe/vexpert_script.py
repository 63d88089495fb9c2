"""Run under mpiexec: vExpert placement (replicas, primitives, scheduler) on host ranks.

    vexpert_script.py CHECK[,CHECK...] [--dtype float64|float32]

Checks (each prints ``VX_OK <check> rank=<r> ...`` or ``VX_FAIL <check> ...``):

* ``equal``: a layer with replicated experts (every rank's placement has replicas) gives the
  outputs and gradients of the one-rank static layer with the same weights; after the
  scheduler's gradient sum every replica holds its expert's whole gradient;
* ``primitives``: Expand, Migrate and Shrink by hand during Adam training: after each one
  takes effect every copy's weights and optimizer state are bitwise equal to the source's
  (and stay equal over further steps);
* ``train``: N training steps of a vExpert layer under its scheduler (skewed routing) and
  of the static layer from one seed give the same losses; the balance ratio drops;
* ``bad``: a placement that differs on one rank, an expand into a full rank and a slot
  budget below one slot per expert raise on every rank, and the layer works after;
* ``config``: one rank builds the layer with another num_experts: ConfigurationError on
  every rank naming the field and each rank's value;
* ``reducer_sums``: the heap reducer's sums are the float64 sums in member order, the same
  bits on every member, and equal to the MPI reducer's;
* ``reducer_timeout``: a member that never joins a heap sum makes the waiting members raise
  CommTimeoutError within the timeout, and a new reducer works after;
* ``forecast_trigger``: a load rising on rank 0 whose last step is still under the
  threshold but whose forecast is above it makes the policy run;
* ``calibration``: training steps under a scheduler with a one-step calibration window:
  each step's logged prediction is the uncalibrated one times the step before's measured /
  uncalibrated ratio (made before the step it predicts), the same on every rank; the
  calibration travels in the scheduler's state_dict;
* ``calibration_layers``: three layers under one scheduler: the step times the ranks
  exchange at a policy run (more than one all-gather carries) arrive, and every layer's
  every step gets its prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import rocmoe
from rocmoe.errors import CommTimeoutError, ConfigurationError, PlacementError, RocmoeError
from rocmoe.moe import CostModel, DroplessMoE, VExpertScheduler
from rocmoe.moe.placement import Placement
from rocmoe.moe.replica_sync import (HeapReplicaReducer, MpiReplicaReducer, ReplicaGroup,
                                     TorchDistReducer)

COMM = MPI.COMM_WORLD
H, F, E, K, BLOCK = 16, 24, 8, 2, 16
DEVICE = torch.device("cpu")   # --device cuda: ranks share the GPU (ipc heap)
REPLICA_SYNC = "auto"          # --replica-sync: the schedulers' gradient sum


def init_gloo():
    """torch.distributed over gloo on these MPI ranks (rank 0's free port, broadcast)."""
    import socket
    from datetime import timedelta
    import torch.distributed as dist
    if dist.is_initialized():
        return
    address = None
    if COMM.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    dist.init_process_group("gloo", init_method=COMM.bcast(address), rank=COMM.Get_rank(),
                            world_size=COMM.Get_size(), timeout=timedelta(seconds=60))


def report(check, ok, rank, detail=""):
    print(f"VX_{'OK' if ok else 'FAIL'} {check} rank={rank} {detail}", flush=True)
    return ok


def replicated_placement(world, slots):
    """Expert 0 on every rank, expert `world` (rank 1's first) on rank 0 twice: replicas across
    ranks and a double share on one rank."""
    p = Placement.static(E, world, slots)
    for r in range(1, world):
        p = p.expanded(0, r)
    return p.expanded(E // world, 0).expanded(E // world, 0)


def load_weights(layer, ref, placement, rank):
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        for s, e in enumerate(placement.slot_expert[rank]):
            if e >= 0:
                layer.w1[s].copy_(ref.w1[e])
                layer.w2[s].copy_(ref.w2[e])


def batches(world, dtype, tokens=23, seed=100, skew=0.0):
    xs = []
    for r in range(world):
        gen = torch.Generator().manual_seed(seed + r)
        x = torch.randn(tokens + r, H, generator=gen, dtype=dtype)
        x[:, 0] += skew  # a shared offset: the router sends most tokens to a few experts
        xs.append(x.to(DEVICE))
    return xs


def check_equal(ctx, dtype, tol):
    rank, world = ctx.rank, ctx.world_size
    slots = E // world + 3
    torch.manual_seed(7)
    ref = DroplessMoE(H, F, E, K, block_size=BLOCK).to(DEVICE, dtype)
    layer = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                        slots_per_rank=slots).to(DEVICE, dtype)
    placement = replicated_placement(world, slots)
    layer.dispatcher.set_placement(placement)
    load_weights(layer, ref, placement, rank)
    sched = VExpertScheduler([layer], None, cost_model=CostModel(),
                             replica_sync=REPLICA_SYNC)
    xs = batches(world, dtype)
    gs = [torch.randn_like(x) for x in xs]
    x_ref = torch.cat(xs).requires_grad_(True)
    (ref(x_ref) * torch.cat(gs)).sum().backward()
    x = xs[rank].clone().requires_grad_(True)
    y = layer(x)
    (y * gs[rank]).sum().backward()
    sched.sync_gradients()
    start = sum(t.shape[0] for t in xs[:rank])
    stop = start + xs[rank].shape[0]
    y_ref = ref(torch.cat(xs)).detach()
    def rel(a, b):  # relative to the values' scale (at least 1)
        return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
    errs = {"y": rel(y, y_ref[start:stop]), "dx": rel(x.grad, x_ref.grad[start:stop])}
    ws = placement.weight_slots()
    for e in range(E):
        s = ws[e, rank]
        if s >= 0:
            errs[f"dw1[{e}]"] = rel(layer.w1.grad[s], ref.w1.grad[e])
            errs[f"dw2[{e}]"] = rel(layer.w2.grad[s], ref.w2.grad[e])
    worst = max(errs.values())
    remote = int(layer.dispatcher.last_counts.sum()) - int(x.shape[0] * K)
    ok = worst < tol
    sched.close()
    return report("equal", ok, rank, f"max_err={worst:.2e} holders_of_0="
                  f"{placement.holders(0)} pairs_all_ranks={remote + x.shape[0] * K}"
                  + ("" if ok else f" errors={ {k: v for k, v in errs.items() if v >= tol} }"))


def gather_slot_state(layer, opt, slot):
    """This rank's slot as one float64 vector: weights, then each optimizer state tensor."""
    parts = []
    for p in (layer.w1, layer.w2):
        parts.append(p.data[slot].reshape(-1))
        for name in sorted(opt.state[p]):
            v = opt.state[p][name]
            if v.shape == p.shape:
                parts.append(v[slot].reshape(-1))
    return torch.cat(parts).to("cpu", torch.float64).numpy()


def copies_bitwise_equal(layer, opt, expert):
    """Collective: every holder's weight slot of `expert` equals the lowest holder's, bit
    for bit (weights and optimizer state)."""
    placement = layer.dispatcher.placement
    slot = placement.weight_slots()[expert, layer.rank]
    mine = gather_slot_state(layer, opt, slot) if slot >= 0 else None
    everyone = COMM.allgather(mine)
    held = [v for v in everyone if v is not None]
    return all(np.array_equal(held[0].view(np.int64), v.view(np.int64)) for v in held), \
        len(held)


def train_step(layer, opt, sched, x, target):
    opt.zero_grad()
    loss = ((layer(x) - target) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def full_expert_weights(static):
    """Collective: the static layer's [E, ...] expert weights, gathered from every rank."""
    return [torch.cat([torch.from_numpy(a) for a in COMM.allgather(p.detach().cpu().numpy())])
            for p in (static.w1, static.w2)]


def check_primitives(ctx, dtype, tol):
    rank, world = ctx.rank, ctx.world_size
    local = E // world
    torch.manual_seed(3)
    static = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx).to(DEVICE, dtype)
    torch.manual_seed(3)
    layer = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                        slots_per_rank=local + 2, rebalance_every=10 ** 6).to(DEVICE, dtype)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    opt_s = torch.optim.Adam(static.parameters(), lr=1e-2)
    sched = VExpertScheduler([layer], opt, cost_model=CostModel(),
                             replica_sync=REPLICA_SYNC)

    class NoScheduler:
        def step(self):
            pass
    xs = batches(world, dtype, seed=11)
    x, target = xs[rank], torch.roll(xs[rank], 1, dims=1)

    def both_steps():
        train_step(static, opt_s, NoScheduler(), x, target)
        train_step(layer, opt, sched, x, target)
    both_steps()   # Adam has state now
    last = world - 1
    # Expand expert 0 onto the last rank (a copy); Migrate: swap rank 0's expert 1 with that
    # copy (expert 1 moves to the last rank, expert 0 is back on rank 0 alone, twice);
    # Shrink one of rank 0's two vExperts of expert 0 (no data moves)
    steps = [("expand", lambda: sched.expand(layer, 0, last)),
             ("migrate", lambda: sched.migrate(layer, (0, 1), (last, local))),
             ("shrink", lambda: sched.shrink(layer, 0, 0))]
    results = []
    for name, action in steps:
        info = action()
        wait_for_copies(sched, layer)
        both_steps()    # the copies have landed: installed before this step's update
        pending = sched.pending(layer) is not None
        both_steps()
        equal = all(copies_bitwise_equal(layer, opt, e)[0] for e in range(E))
        # every copy also equals the static layer's expert (the same training, no replicas)
        w1, w2 = full_expert_weights(static)
        placement = layer.dispatcher.placement
        err = max([0.0] + [max((layer.w1[s].cpu() - w1[e]).abs().max().item(),
                               (layer.w2[s].cpu() - w2[e]).abs().max().item())
                           for e in range(E)
                           for s in [placement.weight_slots()[e, rank]] if s >= 0])
        results.append((name, equal and not pending and err < tol, info["copies"],
                        f"{err:.1e}"))
    ok = all(r[1] for r in results)
    final = layer.dispatcher.placement.to_list()
    sched.close()
    return report("primitives", ok, rank, f"results={results} placement={final} "
                  f"dropped={sched.dropped_changes}")


def wait_for_copies(sched, layer, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until this rank's part of the layer's change in flight has landed. An
    optimizer step whose copies have not landed on every rank drops the change (no rank waits
    for a copy, by design); the checks that make a change by hand need it made, and under CI
    load a copy once took longer than the step after it (the expand into a full rank then
    found a free slot: 2026-12-04)."""
    state = sched._state(layer)
    deadline = time.monotonic() + timeout_s
    while state.pending is not None and not state.mover.landed():
        if time.monotonic() > deadline:
            raise AssertionError(f"an expert copy did not land in {timeout_s:g} s")
        time.sleep(0.005)


def check_train(ctx, dtype, tol, steps=8):
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    static = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx).to(DEVICE, dtype)
    torch.manual_seed(5)
    vex = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                      slots_per_rank=E // world + 2, rebalance_every=1,
                      balance_threshold=1.05).to(DEVICE, dtype)
    # the same start (the vExpert layer starts in the static layout, same draws)
    same = all(torch.equal(a, b[:a.shape[0]]) for a, b in
               ((static.w1, vex.w1), (static.w2, vex.w2), (static.router.weight,
                                                            vex.router.weight)))
    opt_s = torch.optim.SGD(static.parameters(), lr=0.05)
    opt_v = torch.optim.SGD(vex.parameters(), lr=0.05)
    sched = VExpertScheduler([vex], opt_v, cost_model=CostModel(),
                             replica_sync=REPLICA_SYNC)

    class NoScheduler:
        def step(self):
            pass
    xs = batches(world, dtype, seed=21, skew=3.0)
    x, target = xs[rank], torch.tanh(xs[rank])
    losses_s, losses_v, ratios = [], [], []
    for _ in range(steps):
        losses_s.append(train_step(static, opt_s, NoScheduler(), x, target).item())
        losses_v.append(train_step(vex, opt_v, sched, x, target).item())
        ratios.append(float(vex.dispatcher.balance_ratio))
    diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(losses_s, losses_v))
    changes = sum(1 for r in sched.log for e in r["layers"] if e and e["decision"])
    ok = same and diff < tol and ratios[-1] < ratios[0] and changes > 0
    sched.close()
    return report("train", ok, rank, f"loss_rel_diff={diff:.2e} same_start={same} "
                  f"balance_first={ratios[0]:.3f} balance_last={ratios[-1]:.3f} "
                  f"changes={changes} placement={vex.dispatcher.placement.to_list()}")


def expect_error(fn, kind, needle=""):
    try:
        fn()
    except kind as exc:
        return needle in str(exc), f"{type(exc).__name__}: {exc}"
    except RocmoeError as exc:
        return False, f"wrong error {type(exc).__name__}: {exc}"
    return False, "no error"


def check_profile(ctx, dtype, tol, steps=3):
    """The scheduler's first step profiles its cost model collectively (the FFN on the
    layer's own path, the transport, the scheduler's replica sum on groups of 2..world
    ranks): every rank adopts the same measured model, with positive terms."""
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    vex = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                      slots_per_rank=E // world + 2, rebalance_every=1).to(DEVICE, dtype)
    opt = torch.optim.SGD(vex.parameters(), lr=0.05)
    sched = VExpertScheduler([vex], opt, replica_sync=REPLICA_SYNC)
    xs = batches(world, dtype, seed=21, skew=3.0)
    for _ in range(steps):
        train_step(vex, opt, sched, xs[rank], torch.tanh(xs[rank]))
    model = sched.cost_model
    problems = []
    if model is None or not model.measured:
        problems.append("no measured cost model")
    else:
        values = model.to_dict()
        everyone = COMM.allgather(json.dumps(values, sort_keys=True))
        if len(set(everyone)) != 1:
            problems.append("the ranks adopted different models")
        if not (model.ffn_ms_per_row > 0 and model.a2a_latency_ms >= 0):
            problems.append(f"ffn_ms_per_row={model.ffn_ms_per_row} "
                            f"a2a_latency_ms={model.a2a_latency_ms}")
        sizes = sorted(int(k) for k in model.allreduce)
        if sizes != list(range(2, world + 1)) or not all(
                np.isfinite(v).all() and v[0] + v[1] > 0
                for v in map(np.asarray, model.allreduce.values())):
            problems.append(f"replica-sum profile {model.allreduce}")
    ok = not problems
    used = sched.replica_sync
    sched.close()
    return report("profile", ok, rank, f"replica_sync={used} ffn_ms_per_row="
                  f"{getattr(model, 'ffn_ms_per_row', None)}"
                  + ("" if ok else f" problems={problems}"))


def check_bad(ctx, dtype, tol):
    rank, world = ctx.rank, ctx.world_size
    slots = E // world + 1
    torch.manual_seed(9)
    # the policy never runs here (rebalance_every far away): the checks below place every
    # vExpert themselves, and a policy change between the expand into rank 0 and the check
    # that rank 0 is full would free the slot (on the H200 it shrank that fresh replica)
    layer = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                        slots_per_rank=slots, rebalance_every=10**6).to(DEVICE, dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)   # steps that change no weight
    sched = VExpertScheduler([layer], opt, cost_model=CostModel(),
                             replica_sync=REPLICA_SYNC)
    x = batches(world, dtype, seed=31)[rank]
    y0 = layer(x).detach()
    outcomes = {}
    # 1. one rank loads a different placement: the first forward after it fails everywhere
    state = layer.state_dict()
    if rank == 0:
        moved = layer.dispatcher.placement.expanded(1, world - 1)
        state["dispatcher._extra_state"] = {"version": 1, "placement": moved.to_list(),
                                            "num_experts": E}
    layer.load_state_dict(state)
    outcomes["mismatch"] = expect_error(lambda: layer(x), PlacementError,
                                        f"placement[rank {world - 1}][slot {slots - 1}] is "
                                        f"rank 0: 1, rank 1: -1")
    # every rank goes back to one placement
    layer.load_state_dict({**state, "dispatcher._extra_state": {
        "version": 1, "placement": Placement.static(E, world, slots).to_list(),
        "num_experts": E}})
    # 2. expand into a full rank: rank 0 first gets its last free slot filled
    sched.expand(layer, E - 1, 0)     # a copy, lands in the background
    wait_for_copies(sched, layer)
    layer(x).sum().backward()
    opt.step()      # the copy is installed here
    sched.step()
    outcomes["full"] = expect_error(lambda: sched.expand(layer, 1, 0), PlacementError,
                                    "rank 0 has no free slot")
    # only rank 0 asks for the impossible (the others expand into the last rank's free
    # slot): every rank raises, the others naming rank 0, and no rank changes its placement
    before = layer.dispatcher.placement
    outcomes["one_refuses"] = expect_error(
        lambda: sched.expand(layer, 1, 0 if rank == 0 else world - 1), PlacementError,
        "rank 0 has no free slot" if rank == 0 else "rank(s) [0] refused the vExpert change")
    if layer.dispatcher.placement != before or sched.pending(layer) is not None:
        outcomes["one_refuses"] = (False, "a rank changed its placement")
    # 3. a slot budget below one slot per expert
    outcomes["budget"] = expect_error(
        lambda: DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                            slots_per_rank=E // world - 1), ConfigurationError,
        "is too small")
    # the layer and the heap still work: the same output as before (same weights, and the
    # copy of expert E-1 on rank 0 is identical)
    y1 = layer(x).detach()
    outcomes["after"] = (torch.allclose(y0, y1, rtol=0, atol=tol), f"max diff "
                         f"{(y0 - y1).abs().max().item():.2e} placement "
                         f"{layer.dispatcher.placement.to_list()}")
    sched.close()
    ok = all(v[0] for v in outcomes.values())
    return report("bad", ok, rank, " | ".join(f"{k}: {v[1]}" for k, v in outcomes.items()))


def check_config(ctx, dtype, tol):
    rank = ctx.rank
    experts = 2 * E if rank == 1 else E
    ok, msg = expect_error(lambda: DroplessMoE(H, F, experts, K, ctx=ctx, placement="vexpert"),
                           ConfigurationError,
                           f"num_experts: rank 0 = {E}, rank 1 = {2 * E}")
    if not ok:
        return report("config", ok, rank, msg)
    # a replica sum that differs across ranks: every rank raises, naming each rank's choice
    layer = DroplessMoE(H, F, E, K, ctx=ctx, placement="vexpert").to(DEVICE, dtype)
    ok, msg2 = expect_error(
        lambda: VExpertScheduler([layer], None, replica_sync="heap" if rank == 1 else "mpi"),
        ConfigurationError,
        "VExpertScheduler differs across ranks: replica_sync: rank 0 = 'mpi', rank 1 = 'heap'")
    if not ok:
        return report("config", ok, rank, f"{msg}; {msg2}")
    # a name no reducer has, on rank 1 only: its own error there, and the peers hear of it
    needle = ("replica_sync must be 'auto' or one of" if rank == 1 else
              "VExpertScheduler: rank(s) [1] rejected their arguments")
    ok, msg3 = expect_error(
        lambda: VExpertScheduler([layer], None, replica_sync="nccl" if rank == 1 else "mpi"),
        ConfigurationError, needle)
    if not ok:
        return report("config", ok, rank, f"{msg}; {msg2}; {msg3}")
    # the scheduler's other arguments, wrong on rank 1 only (these raised there before the
    # agreement, and rank 0 waited in it), or differing across ranks
    rejected = "VExpertScheduler: rank(s) [1] rejected their arguments"
    cases = [(dict(policy="nope"), "policy must be one of"),
             (dict(load_decay="x"), "must be numbers"),
             (dict(timeout_s=-1.0), "timeout_s must be a positive, finite number"),
             (dict(policy="eplb"), "policy: rank 0 = 'greedy', rank 1 = 'eplb'"),
             (dict(max_copies_per_rank=3), "max_copies_per_rank: rank 0 = 2, rank 1 = 3")]
    msgs = []
    for kw, own in cases:
        needle = own if rank == 1 or "rank 0 =" in own else rejected
        ok, m = expect_error(lambda: VExpertScheduler([layer], None, replica_sync="mpi",
                                                      **(kw if rank == 1 else {})),
                             ConfigurationError, needle)
        msgs.append(m)
        if not ok:
            return report("config", ok, rank, f"{kw}: {m}")
    VExpertScheduler([layer], None, replica_sync="mpi").close()  # a good one still works
    return report("config", ok, rank, "; ".join([msg, msg2, msg3] + msgs))


def count_syncs(fn) -> int:
    """Host syncs torch reports while fn() runs (sync debug mode 'warn'; only torch's own
    sync warning counts: the bench's counter)."""
    from rocmoe.bench.fused_gpu import syncs_per_call
    return int(syncs_per_call(fn, calls=1)[0])


def check_syncs(ctx, dtype, tol, steps=12):
    """GPU: the vExpert layer's forward + backward makes no host sync beyond the static
    layer's (those are the transport's: it reads the split sizes on the host), and the
    scheduler's share of the step time."""
    import time
    rank, world = ctx.rank, ctx.world_size
    if DEVICE.type != "cuda":
        return report("syncs", False, rank, "needs --device cuda")
    # a layer of realistic width: the share is of a real step, not of launch overhead
    hidden, ffn, tokens = 512, 2048, 4096
    torch.manual_seed(5)
    static = DroplessMoE(hidden, ffn, E, K, block_size=64, ctx=ctx).to(DEVICE, dtype)
    torch.manual_seed(5)
    vex = DroplessMoE(hidden, ffn, E, K, block_size=64, ctx=ctx, placement="vexpert",
                      slots_per_rank=E // world + 2, rebalance_every=1).to(DEVICE, dtype)
    opt = torch.optim.Adam(vex.parameters(), lr=1e-3)
    sched = VExpertScheduler([vex], opt, cost_model=CostModel(),
                             replica_sync=REPLICA_SYNC)
    gen = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    x[:, 0] += 3.0
    x = x.to(DEVICE)

    def fwd_bwd(layer):
        def run():
            layer(x).float().sum().backward()
        return run
    for _ in range(2):   # warm-up: Triton compiles, the scheduler replicates
        for layer in (static, vex):
            fwd_bwd(layer)()
        opt.step()
        sched.step()
    syncs = {"static": count_syncs(fwd_bwd(static)), "vexpert": count_syncs(fwd_bwd(vex))}
    opt.zero_grad()
    base = dict(sched.timings)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        vex(x).float().sum().backward()
        opt.step()
        sched.step()
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) * 1e3
    spent = sum(sched.timings[k] - base[k] for k in ("decide_ms", "commit_ms"))
    share = spent / total
    ok = syncs["vexpert"] <= syncs["static"]
    sched.close()
    return report("syncs", ok, rank, f"host_syncs_per_step={syncs} scheduler_share="
                  f"{share:.4f} step_ms={total / steps:.2f} scheduler_ms="
                  f"{spent / steps:.3f} (goal share <= 0.02)")


def check_reducer_sums(ctx, dtype, tol):
    rank, world = ctx.rank, ctx.world_size
    # groups: every rank; ranks 0 and 1; the upper half of the ranks (one rank at world 2)
    f64 = torch.float64
    groups = [ReplicaGroup(("all",), tuple(range(world)), 1000, f64),
              ReplicaGroup(("pair",), (0, 1), 37, f64),
              ReplicaGroup(("upper",), tuple(range(world // 2, world)), 5, f64)]
    groups = [g for g in groups if len(g.members) > 1]

    def values(key, r, n):   # rank r's buffer of group `key`, the same draw on every rank
        seed = 1000 * len(key[0]) + r
        return torch.randn(n, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64)
    problems = []
    results = {}
    rounds = {}
    for name, make in (("heap", lambda: HeapReplicaReducer(ctx, 30.0)),
                       # a 1 KiB outbox: the 8000-byte group goes in pieces, over rounds
                       ("heap_1k", lambda: HeapReplicaReducer(ctx, 30.0, max_bytes=1024)),
                       ("mpi", lambda: MpiReplicaReducer(ctx, 30.0)),
                       ("torch", lambda: (init_gloo(), TorchDistReducer(ctx, 30.0))[1])):
        reducer = make()
        mine = {g.key: values(g.key, rank, g.numel).to(DEVICE) for g in groups
                if rank in g.members}
        for _ in range(3):   # three steps on one reducer: the outbox is reused
            bufs = {k: v.clone() for k, v in mine.items()}
            reducer.sum_(groups, bufs)
        results[name] = {k: v.cpu() for k, v in bufs.items()}
        rounds[name] = getattr(reducer, "rounds", None)
        reducer.close()
    for g in groups:
        if rank not in g.members:
            continue
        exact = values(g.key, g.members[0], g.numel)
        for r in g.members[1:]:
            exact = exact + values(g.key, r, g.numel)
        if not torch.equal(results["heap"][g.key], exact):
            problems.append(f"heap {g.key} differs from the member-order sum")
        if not torch.equal(results["heap_1k"][g.key], exact):
            problems.append(f"heap in 1 KiB rounds {g.key} differs from the member-order sum")
        for name in ("mpi", "torch"):   # the libraries' own order of addition
            if not torch.allclose(results[name][g.key], exact, rtol=1e-12, atol=1e-12):
                problems.append(f"{name} {g.key} differs from the sum")
    # the same bits on every member
    mine_bits = {g.key[0]: results["heap"][g.key].numpy().tobytes() for g in groups
                 if rank in g.members}
    for key in [g.key[0] for g in groups]:
        seen = [b.get(key) for b in COMM.allgather(mine_bits)]
        if len({b for b in seen if b is not None}) != 1:
            problems.append(f"heap {key}: members hold different bits")
    # a step whose only group leaves some ranks out (at 4 ranks: 2 and 3 hold no float64
    # buffer of their own): every rank still sizes the outbox alike, from the groups
    pair = [g for g in groups if g.key == ("pair",)]
    reducer = HeapReplicaReducer(ctx, 30.0)
    bufs = {g.key: values(g.key, rank, g.numel).to(DEVICE) for g in pair if rank in g.members}
    reducer.sum_(pair, bufs)
    reducer.close()
    if rank in pair[0].members and not torch.equal(
            bufs[("pair",)].cpu(), values(("pair",), 0, 37) + values(("pair",), 1, 37)):
        problems.append("a step with ranks outside its only group summed wrongly")
    # three steps: one round a step, and in 1 KiB the 8000-byte group alone takes 8 a step
    if rounds["heap"] != 3 or not rounds["heap_1k"] > 3 * 8:
        problems.append(f"rounds {rounds}: one a step expected, and more than 8 a step "
                        f"in 1 KiB")
    ok = not problems
    return report("reducer_sums", ok, rank, f"groups={len(groups)} rounds={rounds}"
                  + ("" if ok else f" problems={problems}"))


def check_reducer_timeout(ctx, dtype, tol):
    rank, world = ctx.rank, ctx.world_size
    problems = []
    # rank 1 never joins the second step: the others wait for it, then raise
    reducer = HeapReplicaReducer(ctx, 1.0)
    pair = [ReplicaGroup(("pair",), tuple(range(world)), 8, torch.float64)]
    buf = {pair[0].key: torch.ones(8, dtype=torch.float64, device=DEVICE)}
    reducer.sum_(pair, buf)
    raised = "skipped"
    if rank != 1:
        import time
        t0 = time.monotonic()
        try:
            reducer.sum_(pair, buf)
            raised = "nothing"
        except CommTimeoutError:
            raised = f"CommTimeoutError after {time.monotonic() - t0:.1f} s"
            if time.monotonic() - t0 > 10:
                problems.append(f"the timeout took {time.monotonic() - t0:.1f} s")
        if raised == "nothing":
            problems.append("a missing member raised nothing")
    reducer.close()
    again = HeapReplicaReducer(ctx, 30.0)
    buf = {pair[0].key: torch.full((8,), float(rank), dtype=torch.float64, device=DEVICE)}
    again.sum_(pair, buf)
    if not torch.equal(buf[pair[0].key].cpu(), torch.full((8,), float(sum(range(world))),
                                                          dtype=torch.float64)):
        problems.append("the new reducer after a timeout summed wrongly")
    again.close()
    ok = not problems
    return report("reducer_timeout", ok, rank, f"missing_member={raised}"
                  + ("" if ok else f" problems={problems}"))


def check_forecast_trigger(ctx, dtype, tol):
    """Counts set by hand: expert 0 (rank 0's) rises by 5 pairs from each source a step.
    The policy must run at the first step whose forecast is above the threshold even
    though that step's own balance ratio is not."""
    rank, world = ctx.rank, ctx.world_size
    layer = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                        slots_per_rank=E // world + 2, rebalance_every=1,
                        balance_threshold=1.05).to(DEVICE, dtype)
    sched = VExpertScheduler([layer], None, cost_model=CostModel(), replica_sync=REPLICA_SYNC)
    ran_early, steps = None, []
    for t in range(8):
        counts = torch.full((world, E), 40, dtype=torch.int64)
        counts[:, 0] += 5 * t
        layer.dispatcher.last_counts = counts
        sched.step()
        entry = sched.log[-1]["layers"][0]
        steps.append((round(entry["balance_ratio"], 4),
                      round(entry["forecast_balance_ratio"], 4), entry["decision"] is not None))
        if entry["balance_ratio"] <= 1.05 < entry["forecast_balance_ratio"]:
            ran_early = entry["decision"] is not None
            break
    sched.close()
    return report("forecast_trigger", bool(ran_early), rank, f"steps={steps}")


def check_calibration(ctx, dtype, tol, steps=6):
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    # a threshold no step reaches: the policy keeps the placement (and its replica) as set
    vex = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                      slots_per_rank=E // world + 2, rebalance_every=1,
                      balance_threshold=100.0).to(DEVICE, dtype)
    opt = torch.optim.SGD(vex.parameters(), lr=0.05)
    model = CostModel(ffn_ms_per_row=1e-3, fixed_ms=0.1, allreduce={2: [0.5, 0.0]})
    sched = VExpertScheduler([vex], opt, cost_model=model, replica_sync=REPLICA_SYNC,
                             calibration_window=1)
    xs = batches(world, dtype, seed=21, skew=3.0)
    sched.expand(vex, 0, world - 1)   # a replica: the steps after it sum its gradients
    for _ in range(steps):
        train_step(vex, opt, sched, xs[rank], torch.tanh(xs[rank]))
    timed = [r["layers"][0]["cost_model"] for r in sched.log
             if r["layers"][0] and r["layers"][0].get("cost_model")]
    sums = [r["replica_sum"] for r in sched.log if r.get("replica_sum")]
    problems = []
    if len(timed) != steps:
        problems.append(f"{len(timed)} of {steps} steps timed")
    if len(sums) < steps - 2:
        problems.append(f"{len(sums)} replica sums timed")
    for series in (timed, sums):
        for before, now in zip(series, series[1:]):
            expected = (now["uncalibrated_ms"] * before["measured_ms"]
                        / before["uncalibrated_ms"])
            if not abs(now["predicted_ms"] - expected) <= 1e-9 * expected:
                problems.append(f"predicted {now['predicted_ms']} != {expected}")
    if not all(t["measured_ms"] > 0 for t in timed):
        problems.append("a step without a positive time")
    everyone = COMM.allgather(json.dumps([timed, sums]))
    if len(set(everyone)) != 1:
        problems.append("the ranks logged different predictions")
    state = sched.state_dict()
    ratios = state["layers"][0]["calibration"]
    if len(ratios) != 1 or abs(ratios[0] - timed[-1]["measured_ms"]
                               / timed[-1]["uncalibrated_ms"]) > 1e-12 * ratios[0]:
        problems.append(f"state_dict calibration {ratios}")
    calibrated = sched.calibrated_model(vex).ffn_ms_per_row
    sched.close()
    return report("calibration", not problems, rank,
                  f"timed={len(timed)} ffn_ms_per_row={calibrated:.3g}"
                  + (f" problems={problems}" if problems else ""))


def check_calibration_batched(ctx, dtype, tol, steps=6):
    """rebalance_every=3: the ranks exchange their times at steps 3 and 6 only (where the
    policy may run); every step still gets its prediction, steps 4-6 all with the median
    ratio of steps 1-3."""
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    vex = DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                      slots_per_rank=E // world + 2, rebalance_every=3).to(DEVICE, dtype)
    opt = torch.optim.SGD(vex.parameters(), lr=0.05)
    sched = VExpertScheduler([vex], opt, cost_model=CostModel(ffn_ms_per_row=1e-3,
                                                              fixed_ms=0.1),
                             replica_sync=REPLICA_SYNC, calibration_window=8)
    exchanges = []
    gather = sched._allgather_floats
    sched._allgather_floats = lambda values: (exchanges.append(sched.steps), gather(values))[1]
    xs = batches(world, dtype, seed=21, skew=3.0)
    for _ in range(steps):
        train_step(vex, opt, sched, xs[rank], torch.tanh(xs[rank]))
    timed = [r["layers"][0].get("cost_model") for r in sched.log]
    problems = []
    if exchanges != [3, 6]:
        problems.append(f"times exchanged at steps {exchanges}")
    if None in timed:
        problems.append("a step without its prediction")
    else:
        ratios = [t["measured_ms"] / t["uncalibrated_ms"] for t in timed[:3]]
        for t in timed[3:]:
            factor = t["predicted_ms"] / t["uncalibrated_ms"]
            if abs(factor - float(np.median(ratios))) > 1e-9 * factor:
                problems.append(f"factor {factor} != median {np.median(ratios)}")
    sched.close()
    return report("calibration_batched", not problems, rank,
                  f"exchanges={exchanges}" + (f" problems={problems}" if problems else ""))


def check_calibration_layers(ctx, dtype, tol, steps=8):
    """Three vExpert layers, a replica in each, under one scheduler with an 8-step window and
    rebalance_every=8: the ranks' exchange at step 8 carries 24 layer times and the replica
    sums' (more than one all-gather carries: in chunks of 14 it raised InvalidArgumentError on
    every rank there); every step of every layer gets its prediction, the same on every
    rank."""
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    layers = [DroplessMoE(H, F, E, K, block_size=BLOCK, ctx=ctx, placement="vexpert",
                          slots_per_rank=E // world + 2, rebalance_every=8,
                          balance_threshold=100.0).to(DEVICE, dtype) for _ in range(3)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = VExpertScheduler(layers, opt, cost_model=CostModel(
        ffn_ms_per_row=1e-3, fixed_ms=0.1, allreduce={2: [0.5, 0.0]}),
        replica_sync=REPLICA_SYNC, calibration_window=8)
    sizes = []
    gather = sched._allgather_floats
    sched._allgather_floats = lambda values: (sizes.append(len(values)), gather(values))[1]
    for layer in layers:
        sched.expand(layer, 0, world - 1)
    xs = batches(world, dtype, seed=21, skew=3.0)
    problems = []
    try:
        for _ in range(steps):
            train_step(model, opt, sched, xs[rank], torch.tanh(xs[rank]))
    except RocmoeError as exc:
        problems.append(f"{type(exc).__name__}: {exc}"[:300])
    timed = [[entry.get("cost_model") for entry in r["layers"]] for r in sched.log]
    if not sizes or max(sizes) <= 13:
        problems.append(f"the exchanges carried {sizes} floats: none more than one all-gather")
    if len(timed) != steps or any(t is None for row in timed for t in row):
        problems.append(f"{sum(t is not None for row in timed for t in row)} of "
                        f"{steps * len(layers)} layer steps predicted")
    if len(set(COMM.allgather(json.dumps(timed)))) != 1:
        problems.append("the ranks logged different predictions")
    sched.close()
    return report("calibration_layers", not problems, rank,
                  f"floats={sizes}" + (f" problems={problems}" if problems else ""))


CHECKS = {"equal": check_equal, "syncs": check_syncs, "primitives": check_primitives, "train": check_train,
          "bad": check_bad, "config": check_config, "reducer_sums": check_reducer_sums,
          "reducer_timeout": check_reducer_timeout,
          "profile": check_profile, "forecast_trigger": check_forecast_trigger,
          "calibration": check_calibration, "calibration_batched": check_calibration_batched,
          "calibration_layers": check_calibration_layers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--replica-sync", choices=("auto", "heap", "mpi", "torch"), default="auto")
    args = ap.parse_args(argv)
    global DEVICE, REPLICA_SYNC
    REPLICA_SYNC = args.replica_sync
    if REPLICA_SYNC == "torch":
        init_gloo()
    dtype = getattr(torch, args.dtype)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    if args.device == "cuda":
        # 512 MiB: the sync check's layer (4096 tokens of 512) has upper-bound exchange
        # buffers of 64 MiB per row handle
        ctx = rocmoe.init(backend="ipc", heap_size=512 << 20, device=0)
        DEVICE = ctx.device
        if dtype == torch.float32:
            tol = 5e-3  # the one-rank reference's Triton kernels multiply fp32 in TF32
    else:
        ctx = rocmoe.init(backend="host", heap_size=1 << 23)
    failed = 0
    for name in args.checks.split(","):
        failed += not CHECKS[name](ctx, dtype, tol)
    failed = COMM.allreduce(failed)
    ctx.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
