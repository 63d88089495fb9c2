"""GPT-MoE with expert parallelism, inputs one rank gets wrong (launched by
test_gpt_moe_inputs.py):

    mpiexec -n N python tests/models/gpt_moe_script.py

For each kind of bad tokens or targets the last rank alone passes, every rank raises a
RocmoeError (the others naming that rank) instead of waiting for it in the first MoE layer's
exchange (or, for targets, in the backward), and the next step, forward and backward, works.
A vExpert model's first step is a bad one too (the peers' first forward call agrees on the
placement before its exchange). Every rank prints "rank r ok <what>" or "rank r FAIL
<what>: ..." and exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys

import torch

import rocmoe
from rocmoe.models.gpt_moe import GPTMoE, GPTMoEConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rank_report import RankReport  # noqa: E402

torch.set_num_threads(1)
ctx = rocmoe.init(backend="host", heap_size=64 << 20)
RANK, WORLD = ctx.rank, ctx.world_size
LAST = RANK == WORLD - 1
report = RankReport(f"rank {RANK}")
SMALL = dict(seq_len=16, layers=2, hidden=32, heads=4, ffn_hidden=48, experts=4, top_k=2,
             moe_every=1)

g = torch.Generator().manual_seed(RANK)
tokens = torch.randint(0, 256, (2, 12), generator=g)
targets = tokens.roll(-1, 1)


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    (loss + model.aux_loss).backward()


def bad_step_raises_everywhere(model, what, x, y):
    report.raises_everywhere(
        lambda: step(model, x, y) if LAST else step(model, tokens, targets),
        lambda text: LAST or f"[{WORLD - 1}]" in text or f"rank {WORLD - 1}" in text,
        f"{what} raise on every rank",
        lambda: step(model, tokens, targets), f"a step after {what}")


beyond = tokens.clone()
beyond[0, 3] = 256
bad = {"tokens longer than seq_len": (torch.zeros(2, 17, dtype=torch.int64), None),
       "float tokens": (tokens.float(), None),
       "a token beyond the vocabulary": (beyond, None),
       "targets of another shape": (tokens, targets[:, :-1]),
       "int32 targets": (tokens, targets.int()),
       "a target beyond the vocabulary": (tokens, beyond)}
vexpert = GPTMoE(GPTMoEConfig(**SMALL, moe_options={"placement": "vexpert"}), ctx=ctx, seed=1)
bad_step_raises_everywhere(vexpert, "bad tokens in a vExpert model's first step",
                           tokens.float(), targets)
model = GPTMoE(GPTMoEConfig(**SMALL), ctx=ctx, seed=1)
step(model, tokens, targets)
report(True, "a good step")
for what, (x, y) in bad.items():
    bad_step_raises_everywhere(model, what, x, targets if y is None else y)
ctx.barrier()
ctx.finalize()
report.summary()
sys.exit(report.status())
