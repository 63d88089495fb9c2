"""GPU ipc backend: a kernel stores a slice into a peer's heap and signals; the peer verifies.

    rocmoe bench ipc [--ranks N] [--sizes 1M,16M,256M] [--iters N] [--output FILE]

Needs a GPU build (`-DROCMOE_GPU=cuda|hip`) and a GPU; ranks may share one GPU (rank r uses
GPU local_rank % device_count). Started from a shell it re-launches itself under
`mpiexec -n N --oversubscribe`. Rank 0 prints one JSON line per (rank, size):

* correctness, all ranks at once: rank r's kernel (`rocmoe_ipc_store_signal`) stores a
  pattern into rank r+1's heap and raises rank r+1's signal with a system-scope release; rank
  r+1's kernel (`rocmoe_ipc_wait_verify`) waits for the signal on the GPU (bounded) and
  counts bytes that differ from the pattern it expects. `verified` is true only when every
  wait succeeded and no byte differed, also after the timed runs.
* bandwidth, one rank at a time (so ranks sharing a GPU do not share its time): the same
  store+signal kernel, `iters` launches back to back on one stream, timed with GPU events;
  in the same trials, the baseline: `torch.Tensor.copy_` of the same bytes between two
  private device buffers on the same GPU (a device-to-device cudaMemcpy / hipMemcpy).
  The launches of a trial are queued behind a GPU sleep, so the events measure kernel time,
  not the host's launch rate. `store_gbps` and `baseline_gbps` count the bytes once
  (payload / time); `ratio = store_gbps / baseline_gbps`. The best of `--trials` trials is
  kept for each. `store_call_us` / `baseline_call_us` are the per-call times a Python
  caller sees for back-to-back calls (host launch cost included).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional

from ..env import parse_sizes
from . import emit, inside_mpi_job, relaunch_under_mpiexec

DEFAULT_SIZES = "1M,16M,256M"
BASELINE_NAME = ("torch.Tensor.copy_ between two private device buffers on the same GPU "
                 "(device-to-device memcpy of the same bytes), same process, same run")


def _pattern(torch, rank: int, nbytes: int, device):
    """Bytes that differ per rank and per position, so a wrong source or offset shows."""
    idx = torch.arange(nbytes, device=device, dtype=torch.int32)
    return ((idx * 131 + (rank * 17 + 5)) & 255).to(torch.uint8)


def _stream_ptr(torch, device):
    from .._native import ffi
    return ffi.cast("void *", torch.cuda.current_stream(device).cuda_stream)


def run(args) -> int:
    import torch

    import rocmoe
    from .. import _native
    from .._native import check, ffi, lib

    sizes = parse_sizes(args.sizes, example="1M,16M")
    heap = max(sizes) + (1 << 20)
    ctx = rocmoe.init(backend="ipc", heap_size=heap, timeout_s=args.timeout)
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    peer, left = (rank + 1) % world, (rank - 1) % world
    handle = ctx._live()
    gpus = torch.cuda.device_count()
    records = []
    ok_all = True
    try:
        for nbytes in sizes:
            recv = ctx.zeros((nbytes,), torch.uint8)
            signals = ctx.zeros((1,), torch.int64)
            recv_off, sig_off = ctx.heap.offset_of(recv), ctx.heap.offset_of(signals)
            src = _pattern(torch, rank, nbytes, dev)
            expected = _pattern(torch, left, nbytes, dev)
            torch.cuda.synchronize(dev)
            epoch = 0

            def store(value):
                check(lib.rocmoe_ipc_store_signal(handle, peer, recv_off, ffi.cast("void *", src.data_ptr()),
                                                  nbytes, sig_off, value, _stream_ptr(torch, dev)),
                      "rocmoe_ipc_store_signal")

            def verify(value) -> int:
                bad = ffi.new("uint64_t *")
                check(lib.rocmoe_ipc_wait_verify(handle, sig_off, value, args.timeout, recv_off,
                                                 ffi.cast("void *", expected.data_ptr()), nbytes,
                                                 _stream_ptr(torch, dev), bad),
                      "rocmoe_ipc_wait_verify")
                return int(bad[0])

            # correctness: every rank stores and verifies at the same time
            epoch += 1
            store(epoch)
            mismatches = verify(epoch)
            ctx.barrier()

            # bandwidth: one rank at a time
            store_s, copy_s = math.inf, math.inf
            store_call_s, copy_call_s = math.inf, math.inf
            sleep_cycles = 100_000 * args.iters  # > the host's time to queue `iters` launches
            private = torch.empty_like(src)
            for turn in range(world):
                if rank == turn:
                    for _ in range(args.warmup):
                        epoch += 1
                        store(epoch)
                        private.copy_(src)
                    torch.cuda.synchronize(dev)
                    for _ in range(args.trials):
                        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                        # GPU time: the launches wait behind a GPU sleep until all are
                        # queued, so the events time the kernels, not the host's launch rate.
                        torch.cuda._sleep(sleep_cycles)
                        ev[0].record()
                        for _ in range(args.iters):
                            epoch += 1
                            store(epoch)
                        ev[1].record()
                        torch.cuda._sleep(sleep_cycles)
                        ev[2].record()
                        for _ in range(args.iters):
                            private.copy_(src)
                        ev[3].record()
                        ev[3].synchronize()
                        store_s = min(store_s, ev[0].elapsed_time(ev[1]) / 1e3 / args.iters)
                        copy_s = min(copy_s, ev[2].elapsed_time(ev[3]) / 1e3 / args.iters)
                        # Per call as a Python caller sees it: host launch cost included.
                        t0 = time.perf_counter()
                        for _ in range(args.iters):
                            epoch += 1
                            store(epoch)
                        torch.cuda.synchronize(dev)
                        t1 = time.perf_counter()
                        for _ in range(args.iters):
                            private.copy_(src)
                        torch.cuda.synchronize(dev)
                        t2 = time.perf_counter()
                        store_call_s = min(store_call_s, (t1 - t0) / args.iters)
                        copy_call_s = min(copy_call_s, (t2 - t1) / args.iters)
                ctx.barrier()
            # Every rank made the same number of stores: the left neighbour's last epoch is ours.
            mismatches += verify(epoch)
            ctx.barrier()
            verified = mismatches == 0
            ok_all &= verified
            store_gbps = nbytes / store_s / 1e9
            copy_gbps = nbytes / copy_s / 1e9
            records.append({
                "bench": "ipc_store_signal", "backend": "ipc", "platform": _native.gpu_platform(),
                "device": torch.cuda.get_device_name(dev), "ranks": world,
                "ranks_per_gpu": math.ceil(world / gpus), "rank": rank, "peer": peer,
                "same_gpu": (peer % gpus) == (rank % gpus) if world > 1 else True,
                "bytes": nbytes, "iters": args.iters, "trials": args.trials,
                "store_us": round(store_s * 1e6, 3), "store_gbps": round(store_gbps, 2),
                "baseline": BASELINE_NAME, "baseline_us": round(copy_s * 1e6, 3),
                "baseline_gbps": round(copy_gbps, 2), "ratio": round(store_gbps / copy_gbps, 3),
                "timing": "GPU events around launches queued behind a GPU sleep (kernel time)",
                "store_call_us": round(store_call_s * 1e6, 3),
                "baseline_call_us": round(copy_call_s * 1e6, 3),
                "verified": verified, "mismatches": mismatches,
            })
            del private, src, expected
            ctx.free(signals)
            ctx.free(recv)
    finally:
        ctx.finalize()

    gathered = ctx.comm.gather(records, root=0) if world > 1 else [records]
    if rank == 0:
        out = open(args.output, "a") if args.output else None
        try:
            for per_rank in gathered:
                for record in per_rank:
                    emit(record, out)
        finally:
            if out:
                out.close()
    ok = ctx.comm.allreduce(ok_all, op=_land()) if world > 1 else ok_all
    return 0 if ok else 1


def _land():
    from mpi4py import MPI
    return MPI.LAND


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="rocmoe bench ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks when started from a shell")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per slice, e.g. 1M,16M,256M")
    p.add_argument("--iters", type=int, default=20, help="launches per timed trial")
    p.add_argument("--trials", type=int, default=3, help="timed trials (best kept)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=30.0, help="bound of every wait, seconds")
    p.add_argument("--output", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if not inside_mpi_job() and args.ranks > 1:
        return relaunch_under_mpiexec("rocmoe.bench.ipc", argv, args.ranks)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
