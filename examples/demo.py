"""`make demo`: the main job on the embedded default (host backend, 4 local ranks).

1. Runtime: every rank allocates symmetric tensors, then passes a block around the ring by
   puts and epoch-valued signals (world_size hops, so each block visits every rank and comes
   home), checking what it holds after every hop. Rank 0 prints the verified result as JSON.
2. DLRM: one epoch over a generated Criteo-format click log (rank 0 writes it; a few lines
   malformed and skipped) with the fused Embedding+All-to-All (examples/dlrm_train.py).
3. GPT-MoE: --moe-steps steps on the standard library's bytes, expert-parallel
   (examples/moe_train.py).
Both write their JSON lines to --out (default build/demo), for `rocmoe plot`. The job exits
non-zero if any part fails to verify or to learn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import rocmoe

ELEMENTS = 1 << 16
parser = argparse.ArgumentParser(description="rocmoe's demo job")
parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "build" / "demo"))
parser.add_argument("--moe-steps", type=int, default=200)
parser.add_argument("--criteo-lines", type=int, default=8000)
demo = parser.parse_args()
out = Path(demo.out)
clicks = out / "clicks.tsv"

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
    if rank == 0:
        from rocmoe.data.criteo import write_synthetic_criteo
        out.mkdir(parents=True, exist_ok=True)
        write_synthetic_criteo(clicks, demo.criteo_lines, seed=1, bad_lines=(5, 17, 300))
    ctx.barrier()  # the file is complete before any rank reads it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dlrm_train  # noqa: E402  (the examples beside this file)
import moe_train  # noqa: E402

status = dlrm_train.main([
    "--data-generation", "dataset", "--raw-data-file", str(clicks), "--max-ind-range", "1000",
    "--arch-sparse-feature-size", "8", "--arch-mlp-bot", "13-32-8", "--arch-mlp-top", "32-1",
    "--loss-function", "bce", "--optimizer", "adagrad", "--learning-rate", "0.05",
    "--mini-batch-size", "64", "--print-freq", "20", "--test-freq", "50", "--skip-bad-lines",
    "--jsonl", str(out / "dlrm_train.jsonl")])
status = status or moe_train.main(["--steps", str(demo.moe_steps), "--eval-every", "50",
                                   "--jsonl", str(out / "moe_train.jsonl")])
raise SystemExit(status)
