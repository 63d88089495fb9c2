"""`make demo`: the main job on the embedded default (host backend, 4 local ranks).

1. Runtime: every rank allocates symmetric tensors, then passes a block around the ring by
   puts and epoch-valued signals (world_size hops, so each block visits every rank and comes
   home), checking what it holds after every hop. Rank 0 prints the verified result as JSON.
2. DLRM: a few training steps with the fused Embedding+All-to-All (examples/dlrm_train.py).
3. MoE: a few training steps of the expert-parallel dropless MoE (examples/moe_train.py).
The job exits non-zero if any part fails to verify or to learn.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import rocmoe

ELEMENTS = 1 << 16

with rocmoe.init() as ctx:
    rank, world = ctx.rank, ctx.world_size
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # two receive buffers, so a hop never overwrites the block its reader is still copying
    inbox = ctx.zeros((2, ELEMENTS), torch.float32)
    arrived = ctx.zeros((2,), torch.int64)   # epoch of the last block in each buffer
    freed = ctx.zeros((2,), torch.int64)     # epoch up to which the reader is done

    def block_of(r: int) -> torch.Tensor:
        return torch.arange(ELEMENTS, dtype=torch.float32) * (r + 1)

    block = block_of(rank)
    wrong_hops = []
    start = time.perf_counter()
    for hop in range(1, world + 1):
        slot = hop % 2
        if hop > 2:  # credit: the next rank has copied the block it got two hops ago
            ctx.wait_until(freed, slot, hop - 2, peer=nxt)
        ctx.put_signal(inbox[slot], block, arrived, slot, hop, peer=nxt)
        ctx.wait_until(arrived, slot, hop, peer=prv)
        block = inbox[slot].clone()
        ctx.signal_set(freed, slot, hop, peer=prv)
        # after `hop` hops this rank holds the block that started `hop` ranks back
        if not torch.equal(block, block_of((rank - hop) % world)):
            wrong_hops.append(hop)
    elapsed = time.perf_counter() - start
    # verified from the data: every hop delivered the right block, and after world hops the
    # block this rank holds is its own again
    verified = not wrong_hops and torch.equal(block, block_of(rank))
    if not verified:
        print(f"rank {rank}: wrong data after hops {wrong_hops or [world]}", file=sys.stderr)
    results = ctx.allgather_ints([int(verified)])
    if rank == 0:
        print(json.dumps({
            "demo": "ring exchange over the symmetric heap",
            "backend": ctx.backend, "ranks": world, "hops": world,
            "bytes_per_hop": ELEMENTS * 4, "seconds": round(elapsed, 4),
            "verified_on_every_rank": bool(results.all()),
        }))
    if not results.all():
        raise SystemExit(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dlrm_train  # noqa: E402  (the examples beside this file)
import moe_train  # noqa: E402

status = dlrm_train.main(["--steps", "20"]) or moe_train.main(["--steps", "25"])
raise SystemExit(status)
