"""Smoke test of a rocmoe job: every rank puts a rank-stamped vector into its right
neighbour's symmetric heap with put_signal, waits for its left neighbour's, and checks it.

    mpiexec -n 2 python3 slurm/ring_check.py [--backend host] [--elements N]

Rank 0 prints one summary line, `RING OK world=<n> ...` or `RING FAILED ...`, and the exit
status is non-zero on any failure: the Slurm templates' default program and tests/test_slurm.py
read that line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=os.environ.get("ROCMOE_BACKEND", "auto"))
    parser.add_argument("--elements", type=int, default=1 << 16)
    args = parser.parse_args(argv)

    import torch
    import rocmoe

    with rocmoe.init(backend=args.backend, heap_size=max(1 << 22, 16 * args.elements)) as ctx:
        world, rank = ctx.world_size, ctx.rank
        right, left = (rank + 1) % world, (rank - 1) % world
        inbox = ctx.zeros((args.elements,), torch.float32)
        flags = ctx.zeros((1,), torch.int64)
        # Values that differ per rank and per element: a misplaced or partial copy shows.
        mine = (torch.arange(args.elements, dtype=torch.float32, device=ctx.device) % 1000
                + 1000 * rank)
        ctx.put_signal(inbox, mine, flags, 0, 1, peer=right)
        ctx.wait_until(flags, 0, 1, ">=", peer=left)
        expect = torch.arange(args.elements, dtype=torch.float32, device=ctx.device) % 1000 + 1000 * left
        good = bool(torch.equal(inbox, expect))
        table = ctx.allgather_ints([int(good), ctx.local_rank])
        hosts = ctx.comm.allgather(socket.gethostname()) if world > 1 else [socket.gethostname()]
        ctx.free(flags)
        ctx.free(inbox)
        if rank == 0:
            ok = bool(table[:, 0].all())
            job = os.environ.get("SLURM_JOB_ID", "-")
            word = "OK" if ok else "FAILED"
            bad = [r for r in range(world) if not table[r, 0]]
            print(f"RING {word} world={world} backend={ctx.backend} elements={args.elements} "
                  f"slurm_job={job} hosts={','.join(sorted(set(hosts)))}"
                  + (f" bad_ranks={bad}" if bad else ""), flush=True)
        all_good = bool(table[:, 0].all())
    return 0 if all_good else 1


if __name__ == "__main__":
    sys.exit(main())
