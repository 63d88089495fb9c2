"""Train a dropless MoE layer with expert parallelism (rocmoe.moe.DroplessMoE, ctx=rocmoe.init()).

Each rank owns num_experts / world experts and feeds its own tokens; tokens travel to the
rank owning their expert and back. The router is replicated (its gradients are averaged over
ranks); each expert's gradient already holds every rank's tokens. The task: regress a target
made by a fixed random "teacher" MoE, so the loss must go down. Prints JSON lines on rank 0
and exits non-zero if the model did not learn.

    mpiexec -n 4 --oversubscribe python examples/moe_train.py --steps 40
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import rocmoe
from rocmoe.moe import DroplessMoE
from rocmoe.moe.parallel import combine_kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    with rocmoe.init() as ctx:
        rank, world = ctx.rank, ctx.world_size
        torch.manual_seed(0)  # the same router on every rank; experts are sliced by owner
        model = DroplessMoE(args.hidden, args.ffn, args.experts, args.top_k,
                            block_size=args.block_size, ctx=ctx)
        teacher = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh())
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        losses = []
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(args.tokens, args.hidden, generator=g)
            with torch.no_grad():
                target = teacher(x)
            y = model(x)
            loss = torch.nn.functional.mse_loss(y, target) + model.aux_loss
            opt.zero_grad()
            loss.backward()
            _average_router_grads(ctx, model)
            opt.step()
            mean = _mean_over_ranks(ctx, loss.item())
            losses.append(mean)
            if rank == 0:
                counts = model.tokens_per_expert.tolist()
                print(json.dumps({"step": step, "loss": round(mean, 5),
                                  "tokens_per_expert_rank0": counts}), flush=True)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        if rank == 0:
            print(json.dumps({"example": "moe_train", "ranks": world, "backend": ctx.backend,
                              "experts": args.experts, "experts_per_rank": args.experts // world,
                              "combine": combine_kind(model) if world > 1 else None,
                              "first_loss": round(first, 4), "last_loss": round(last, 4),
                              "learned": last < first}))
        return 0 if last < first else 1


def _average_router_grads(ctx, model) -> None:
    if ctx.world_size == 1:
        return
    from mpi4py import MPI
    for p in model.router.parameters():
        if p.grad is None:
            continue
        buf = p.grad.detach().to(torch.float64).numpy()
        ctx.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        p.grad.copy_(torch.from_numpy(buf / ctx.world_size))


def _mean_over_ranks(ctx, value: float) -> float:
    if ctx.world_size == 1:
        return value
    from mpi4py import MPI
    return ctx.comm.allreduce(value, op=MPI.SUM) / ctx.world_size


if __name__ == "__main__":
    sys.exit(main())
