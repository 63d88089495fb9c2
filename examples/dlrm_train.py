"""A small DLRM trained with table-wise model-parallel embeddings (rocmoe.ops.embedding_all_to_all).

Each rank owns a contiguous range of the embedding tables and looks them up for the whole
global batch; the fused op returns this rank's slice of the batch with every table, in
global table order. The dense MLPs are data-parallel: their gradients are averaged with an
MPI all-reduce. Prints one JSON line per step (rank 0) and a summary; exits non-zero if the
loss did not go down.

    mpiexec -n 4 --oversubscribe python examples/dlrm_train.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

import rocmoe
import rocmoe.ops


def tables_of(rank: int, world: int, num_tables: int) -> range:
    """Contiguous table ranges, the first `num_tables % world` ranks holding one more."""
    base, extra = divmod(num_tables, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def synthetic_batch(step: int, args) -> tuple:
    """The same global batch on every rank (seeded by the step): dense features, per-table
    bags of lookups, and a label that depends on both, so the model has something to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    B, T = args.global_batch, args.tables
    dense = torch.randn(B, args.dense_features, generator=g)
    bag_sizes = torch.randint(0, args.max_bag + 1, (T, B), generator=g)
    indices, offsets = [], []
    for t in range(T):
        sizes = bag_sizes[t]
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]]))
        # a skewed access pattern, as in real click logs
        hot = torch.randint(0, max(1, args.rows // 10), (int(sizes.sum()),), generator=g)
        cold = torch.randint(0, args.rows, (int(sizes.sum()),), generator=g)
        pick = torch.rand(int(sizes.sum()), generator=g) < 0.7
        indices.append(torch.where(pick, hot, cold))
    # share of "very hot" items in each sample's bags (empty bags count as none)
    very_hot = (torch.arange(args.rows) < args.rows // 20).float().unsqueeze(1)
    hot_share = torch.stack([nn.functional.embedding_bag(indices[t], very_hot, offsets[t],
                                                         mode="sum").squeeze(1)
                             for t in range(T)], 1) / args.max_bag
    label = ((dense[:, 0] + hot_share.mean(1) * 8 - 0.5) > 0).float()
    return dense, indices, offsets, label


class DLRM(nn.Module):
    def __init__(self, args, my_tables: range):
        super().__init__()
        D = args.dim
        self.bottom = nn.Sequential(nn.Linear(args.dense_features, 64), nn.ReLU(), nn.Linear(64, D))
        self.tables = nn.ParameterList(
            [nn.Parameter(torch.randn(args.rows, D) * 0.05) for _ in my_tables])
        pairs = (args.tables + 1) * args.tables // 2
        self.top = nn.Sequential(nn.Linear(D + pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense_local, indices, offsets, ctx):
        x = self.bottom(dense_local)                                   # [b, D]
        emb = rocmoe.ops.embedding_all_to_all(list(self.tables), indices, offsets, ctx=ctx)
        feats = torch.cat([x.unsqueeze(1), emb], 1)                    # [b, 1 + T, D]
        inter = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1)
        return self.top(torch.cat([x, inter[:, i, j]], 1)).squeeze(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dense-features", type=int, default=13)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--max-bag", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    with rocmoe.init() as ctx:
        rank, world = ctx.rank, ctx.world_size
        if args.global_batch % world:
            raise rocmoe.ConfigurationError(
                f"--global-batch {args.global_batch} must be divisible by {world} ranks")
        mine = tables_of(rank, world, args.tables)
        torch.manual_seed(1 + rank)  # tables differ per owner; dense layers are synced below
        model = DLRM(args, mine)
        dense_params = list(model.bottom.parameters()) + list(model.top.parameters())
        _average(ctx, [p.data for p in dense_params])  # same starting dense weights everywhere
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        per_rank = args.global_batch // world
        losses = []
        for step in range(args.steps):
            dense, indices, offsets, label = synthetic_batch(step, args)
            lo, hi = rank * per_rank, (rank + 1) * per_rank
            logits = model(dense[lo:hi], [indices[t] for t in mine], [offsets[t] for t in mine], ctx)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, label[lo:hi])
            opt.zero_grad()
            loss.backward()
            _average(ctx, [p.grad for p in dense_params])  # data-parallel dense layers
            opt.step()
            mean_loss = _average(ctx, [loss.detach().reshape(1)])[0].item()
            losses.append(mean_loss)
            if rank == 0:
                print(json.dumps({"step": step, "loss": round(mean_loss, 5)}), flush=True)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        if rank == 0:
            print(json.dumps({"example": "dlrm_train", "ranks": world, "backend": ctx.backend,
                              "tables": args.tables, "first_loss": round(first, 4),
                              "last_loss": round(last, 4), "learned": last < first}))
        return 0 if last < first else 1


def _average(ctx, tensors):
    """Average tensors over ranks in place (MPI all-reduce on the host, bounded by the job)."""
    if ctx.world_size == 1:
        return tensors
    from mpi4py import MPI
    for t in tensors:
        buf = t.detach().to(torch.float64).cpu().numpy()
        ctx.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t.copy_(torch.from_numpy(buf / ctx.world_size))
    return tensors


if __name__ == "__main__":
    sys.exit(main())
