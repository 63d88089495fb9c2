"""DLRM's two lookup paths on the host backend (launched by test_dlrm_lookup.py):

    mpiexec -n N python tests/models/dlrm_lookup_script.py [bad-dense]

The model made with a handle (max_batch / max_lookups: one batched call a step on the packed
tables) against the same model without (the functional per-table op on the tables' views):
forward outputs and every gradient bit for bit, over two steps. Three tables over three
ranks or more leaves a rank without tables. Every rank prints "rank r ok <what>" or
"rank r FAIL <what>: ..." and exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys

import torch

import rocmoe
from rocmoe.models.dlrm import DLRM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rank_report import RankReport  # noqa: E402

torch.set_num_threads(1)
ctx = rocmoe.init(backend="host", heap_size=64 << 20)
RANK, WORLD = ctx.rank, ctx.world_size
SIZES, DIM, PER_RANK = [50, 7, 30], 4, 4
report = RankReport(f"rank {RANK}")


def model(**bounds) -> DLRM:
    return DLRM(DIM, SIZES, [3, 8, DIM], [6, 1], ctx=ctx, rank=RANK, world_size=WORLD, seed=3,
                **bounds)


batch = PER_RANK * WORLD
handle_model = model(max_batch=batch, max_lookups=batch * 3)
plain_model = model()
report(handle_model.lookup is not None and plain_model.lookup is None, "paths")
report(handle_model.table_parameters() == [handle_model.packed_tables]
       and handle_model.packed_tables.shape == (sum(handle_model.table_rows), DIM), "packed")
for step in range(2):
    g = torch.Generator().manual_seed(10 + step)  # the same batch on every rank
    dense = torch.randn(batch, 3, generator=g)[RANK * PER_RANK:(RANK + 1) * PER_RANK]
    lookups = []
    for rows in SIZES:
        n = torch.randint(1, 4, (batch,), generator=g)
        idx = torch.randint(0, rows, (int(n.sum()),), generator=g)
        lookups.append((idx, torch.cumsum(n, 0) - n))
    mine = [lookups[t] for t in handle_model.my_tables]
    outs = []
    for m in (handle_model, plain_model):
        m.zero_grad(set_to_none=True)
        p = m(dense, [i for i, _ in mine], [o for _, o in mine])
        p.sum().backward()
        outs.append(p.detach())
    report(torch.equal(outs[0], outs[1]), f"step {step} forward")
    grads = [[q.grad for q in m.parameters()] for m in (handle_model, plain_model)]
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(*grads))
    report(same, f"step {step} gradients")
# stacked lookups ([tables, L], [tables, B]: dlrm's layout for Criteo data, two lookups a
# bag here) give both models what the same rows as lists give them, bit for bit
g = torch.Generator().manual_seed(20)
dense = torch.randn(batch, 3, generator=g)[RANK * PER_RANK:(RANK + 1) * PER_RANK]
idx = torch.stack([torch.randint(0, rows, (2 * batch,), generator=g) for rows in SIZES])
off = torch.arange(0, 2 * batch, 2).expand(len(SIZES), batch)
mine = slice(handle_model.my_tables.start, handle_model.my_tables.stop)
for name, m in (("handle", handle_model), ("plain", plain_model)):
    got = []
    for lookups in ((idx[mine], off[mine]), (list(idx[mine]), list(off[mine]))):
        m.zero_grad(set_to_none=True)
        p = m(dense, *lookups)
        p.sum().backward()
        got.append((p.detach(), [q.grad for q in m.parameters()]))
    same = torch.equal(got[0][0], got[1][0]) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(got[0][1], got[1][1]))
    report(same, f"stacked lookups, {name} model")
# with the argument "bad-dense": dense features the bottom MLP cannot take, on the last rank
# only: every rank raises a RocmoeError (the others naming that rank) instead of waiting for
# it in the lookup, and the next step works
good = torch.randn(PER_RANK, 3, generator=g)
lists = ([i for i in idx[mine]], [o for o in off[mine]])
for name, m in (("handle", handle_model), ("plain", plain_model)) if "bad-dense" in sys.argv \
        else ():
    bad = good[:, :2] if RANK == WORLD - 1 else good
    report.raises_everywhere(
        lambda: m(bad, *lists),
        lambda text: ("the bottom MLP takes [samples, 3]" in text if RANK == WORLD - 1
                      else f"[{WORLD - 1}] rejected" in text
                      or f"rank {WORLD - 1} rejected" in text),
        f"bad dense features raise on every rank, {name} model",
        lambda: m(good, *lists).sum().backward(),
        f"a step after bad dense features, {name} model")
# with the argument "bad-lookups": lookups the model cannot pack for its handle (stacked
# rows that disagree, an entry that is not a tensor), on the last rank only: every rank
# raises a RocmoeError (the others naming that rank) instead of waiting in the lookup, and
# the next step works
stacked = (idx[mine], off[mine])
bad_lookups = {"stacked rows that disagree": (idx[mine], off[mine][:-1]),
               "an entry that is not a tensor": ([None] * len(lists[0]), lists[1])}
for what, bad in bad_lookups.items() if "bad-lookups" in sys.argv else ():
    for name, m in (("handle", handle_model), ("plain", plain_model)):
        if not m.table_rows and RANK == WORLD - 1:
            continue
        report.raises_everywhere(
            lambda: m(good, *(bad if RANK == WORLD - 1 else stacked)),
            lambda text: (RANK == WORLD - 1 or f"[{WORLD - 1}] rejected" in text
                          or f"rank {WORLD - 1} rejected" in text
                          or f"ranks [{WORLD - 1}]" in text),
            f"{what} raise on every rank, {name} model",
            lambda: m(good, *stacked).sum().backward(),
            f"a step after {what}, {name} model")
ctx.barrier()
ctx.finalize()
sys.exit(report.status())
