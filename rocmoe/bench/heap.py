"""Host-backend symmetric heap: put bandwidth against memcpy, and signal round-trip latency.

    rocmoe bench heap [--quick] [--sizes 1K,1M,...] [--iters N] [--output FILE]

Runs on 2 ranks (re-launches itself under `mpiexec -n 2 --oversubscribe` when started from a
shell). Rank 0 prints JSON lines:

* `heap_put`: for each size, rank 0 copies a private buffer into rank 1's symmetric heap with
  `ctx.put` and, in the same trials, copies the same source into a private buffer with
  `numpy.copyto` (the baseline: a single-threaded memcpy between two process-private
  buffers). `ratio = put_gbps / baseline_gbps`; the goal is >= 0.8 from 1 MiB up.
  Two diagnostic columns separate the costs: `raw_put_gbps` calls the C ABI `rocmoe_put`
  directly (no Python checks: the difference to `put_gbps` is per-call Python overhead) and
  `own_heap_copy_gbps` is numpy.copyto into this rank's own shm heap (the same kind of pages
  as the peer's: the difference to the baseline is the page type, not rocmoe).
* `signal_pingpong`: round trips rank 0 -> rank 1 -> rank 0 with `ctx.signal_set` and
  `ctx.wait_until` on epoch values; median and p99 over `--round-trips` trips, against the
  same ping-pong with mpi4py `Send`/`Recv` of one int64 (baseline). `raw_*` columns: the same
  protocol through the C ABI directly (the Python cost per round trip is the difference);
  `poll_*`: C ABI signal_set, but waiting by polling `rocmoe_signal_read` without back-off
  (the cost of wait_until's yield/sleep back-off is the difference to `raw_*`).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import socket
import sys
import time
from typing import Optional

from ..env import parse_size, parse_sizes
from . import emit, inside_mpi_job, progress, relaunch_under_mpiexec

GOAL_RATIO = 0.8
GOAL_FROM_BYTES = 1 << 20
DEFAULT_SIZES = [1 << (10 + 2 * i) for i in range(10)]       # 1 KiB, 4 KiB, ..., 256 MiB
QUICK_SIZES = [1 << 10, 1 << 16, 1 << 20]
BASELINE_NAME = ("numpy.copyto(private_dst, private_src): single-threaded memcpy between two "
                 "process-private buffers on rank 0, same sizes, interleaved with the puts")
PINGPONG_BASELINE = "mpi4py Comm.Send/Recv of one int64 between the same two ranks"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rocmoe bench heap", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", help="comma-separated message sizes (K/M/G suffixes); default "
                                   "1K..256M in powers of 4")
    p.add_argument("--iters", type=int, default=2000,
                   help="most copies per timed trial (small sizes); default 2000")
    p.add_argument("--trials", type=int, default=7, help="timed trials per size (median is "
                                                          "reported); default 7")
    p.add_argument("--trial-bytes", default="256M",
                   help="bytes copied per trial (sets the copy count for large sizes)")
    p.add_argument("--round-trips", type=int, default=10000, help="signal ping-pong round trips")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, few trials, 300 round trips (for tests)")
    p.add_argument("--output", help="also write the JSON lines to this file (rank 0)")
    p.add_argument("--ranks", type=int, default=2,
                   help="ranks to launch when started without MPI (only 0 and 1 take part)")
    return p


def _median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def _environment_record(args, world: int, sizes: list[int]) -> dict:
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None
    import numpy
    import torch
    from .. import __version__
    return {
        "bench": "heap_env", "host": socket.gethostname(), "cpus": os.cpu_count(),
        "machine": platform.machine(), "python": platform.python_version(),
        "rocmoe": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
        "ranks": world, "sizes": sizes, "quick": bool(args.quick),
        # Other processes on the node skew every number here: keep the load with the result.
        "loadavg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        # Private buffers may get transparent huge pages, /dev/shm pages usually do not: this
        # is what the own_heap_copy column isolates.
        "thp_anon": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "command": "rocmoe bench heap " + " ".join(sys.argv[1:]),
    }


def _bandwidth(ctx, sizes: list[int], args, out) -> list[dict]:
    import numpy as np
    import torch
    from .._native import ffi, lib

    rank = ctx.rank
    largest = max(sizes)
    target = ctx.empty((largest,), torch.uint8)  # symmetric: rank 1's copy is written
    records = []
    if rank == 0:
        src_np = np.empty(largest, dtype=np.uint8)
        dst_np = np.empty(largest, dtype=np.uint8)
        # Touch every page now: first-touch faults (private and shm alike) are not bandwidth.
        src_np[:] = np.arange(largest, dtype=np.uint64).astype(np.uint8)
        dst_np[:] = 0
        src = torch.from_numpy(src_np)
        own = target.numpy()
        own[:] = 0
        ctx.put(target, src, peer=1)     # faults rank 1's pages into this process's mapping
        handle = ctx._handle             # raw C ABI, to separate Python overhead from the copy
        dst_offset = ctx.heap.offset_of(target)
        src_ptr = ffi.cast("void *", src.data_ptr())
        trial_bytes = _trial_bytes(args)

    bar = progress(sizes, rank=rank, desc="heap put", unit="size")
    for size in bar:
        if rank == 0:
            count = max(2, min(args.iters, trial_bytes // size))
            src_view = src[:size]
            s_np, d_np, o_np = src_np[:size], dst_np[:size], own[:size]

            def put():
                for _ in range(count):
                    ctx.put(target, src_view, 1)

            def raw_put():
                for _ in range(count):
                    lib.rocmoe_put(handle, 1, dst_offset, src_ptr, size)

            def memcpy():
                for _ in range(count):
                    np.copyto(d_np, s_np)

            def own_heap():
                for _ in range(count):
                    np.copyto(o_np, s_np)

            methods = {"put": put, "raw_put": raw_put, "baseline": memcpy, "own_heap_copy": own_heap}
            for fn in methods.values():  # warm-up: caches, TLB, branch predictors
                fn()
            rates = {name: [] for name in methods}
            for _ in range(args.trials):
                # Interleaved, so that a noisy moment hits every method alike.
                for name, fn in methods.items():
                    t0 = time.perf_counter()
                    fn()
                    rates[name].append(count * size / (time.perf_counter() - t0) / 1e9)
            # The data really arrived: rank 1's bytes equal the source (checked here, through
            # the peer mapping, to keep rank 1 idle while rank 0 measures).
            peer_view = ctx.peer(target, 1)
            if not torch.equal(peer_view[:size], src_view):
                raise AssertionError(f"put of {size} bytes did not deliver the source bytes")
            gbps = {name: _median(v) for name, v in rates.items()}
            # Paired ratios: put and memcpy of the same trial ran back to back, so a noisy
            # moment (other processes on the node) hits both; the median of the pairs is the
            # reported ratio.
            paired = [p / b for p, b in zip(rates["put"], rates["baseline"])]
            # reported to 4 significant digits, and the goal is judged on what is reported:
            # judged unrounded, a ratio of 0.7996 read 0.8 and "misses the 0.8 goal"
            ratio = float(f"{_median(paired):.4g}")
            record = {
                "bench": "heap_put", "size_bytes": size, "copies_per_trial": count,
                "trials": args.trials, "put_gbps": round(gbps["put"], 3),
                "raw_put_gbps": round(gbps["raw_put"], 3),
                "baseline": BASELINE_NAME, "baseline_gbps": round(gbps["baseline"], 3),
                "own_heap_copy_gbps": round(gbps["own_heap_copy"], 3),
                "ratio": ratio,
                "ratio_definition": "median over trials of put_gbps / baseline_gbps in the same "
                                    "trial (> 1: put is faster)",
                "ratio_trials": [round(r, 3) for r in paired],
                "raw_ratio": round(_median([r / b for r, b in zip(rates["raw_put"],
                                                                  rates["baseline"])]), 3),
                "best_put_gbps": round(max(rates["put"]), 3),
                "best_baseline_gbps": round(max(rates["baseline"]), 3),
                "goal": GOAL_RATIO,
                "meets_goal": (ratio >= GOAL_RATIO) if size >= GOAL_FROM_BYTES else None,
                "put_us_per_call": round(1e6 * size / (gbps["put"] * 1e9), 3),
                "raw_put_us_per_call": round(1e6 * size / (gbps["raw_put"] * 1e9), 3),
            }
            records.append(record)
            bar.write(f"  {size:>10} B  put {gbps['put']:7.2f} GB/s  memcpy "
                      f"{gbps['baseline']:7.2f} GB/s  ratio {ratio:5.2f}", file=sys.stderr)
            emit(record, out)
        # One barrier per size keeps every wait of rank 1 well under ROCMOE_TIMEOUT_S.
        ctx.barrier()
    bar.close()
    ctx.free(target)
    return records


def _trial_bytes(args) -> int:
    return parse_size(args.trial_bytes)


def _pingpong(ctx, args, out) -> Optional[dict]:
    import numpy as np
    import torch
    from .._native import ffi, lib
    rank, trips = ctx.rank, args.round_trips
    warmup = max(10, trips // 20)
    flags = ctx.zeros((3,), torch.int64)  # one slot per variant: ctx API, raw C ABI, polling
    peer = 1 - rank if rank in (0, 1) else -1

    def api_round(epoch):
        if rank == 0:
            ctx.signal_set(flags, 0, epoch, peer)
            ctx.wait_until(flags, 0, epoch, ">=", peer=peer)
        else:
            ctx.wait_until(flags, 0, epoch, ">=", peer=peer)
            ctx.signal_set(flags, 0, epoch, peer)

    # The same protocol through the C ABI with pre-computed arguments: the difference to the
    # ctx loop is what the Python checks of signal_set/wait_until cost per round trip.
    handle = ctx._handle
    slot = ctx.heap.offset_of(flags) + 8
    seen = ffi.new("uint64_t *")
    ge = lib.ROCMOE_CMP_GE

    def raw_round(epoch):
        if rank == 0:
            lib.rocmoe_signal_set(handle, peer, slot, epoch)
            if lib.rocmoe_signal_wait_until(handle, slot, ge, epoch, 0.0, peer, seen):
                ctx.wait_until(flags, 1, epoch, ">=", peer=peer)  # raises the mapped error
        else:
            if lib.rocmoe_signal_wait_until(handle, slot, ge, epoch, 0.0, peer, seen):
                ctx.wait_until(flags, 1, epoch, ">=", peer=peer)
            lib.rocmoe_signal_set(handle, peer, slot, epoch)

    # Diagnostic: the same protocol, waiting by polling rocmoe_signal_read with no back-off.
    # If this is much faster than `raw`, the time goes into wait_until's yield/sleep back-off,
    # not into the signal itself.
    poll_slot = ctx.heap.offset_of(flags) + 16
    value = ffi.new("uint64_t *")

    def poll_wait(epoch):
        deadline = time.monotonic() + ctx.timeout_s
        spins = 0
        while True:
            lib.rocmoe_signal_read(handle, poll_slot, value)
            if value[0] >= epoch:
                return
            spins += 1
            if spins % 4096 == 0 and time.monotonic() > deadline:
                from ..errors import CommTimeoutError
                raise CommTimeoutError(f"bench heap: rank {rank} polled {ctx.timeout_s} s for "
                                       f"epoch {epoch} from rank {peer}")

    def poll_round(epoch):
        if rank == 0:
            lib.rocmoe_signal_set(handle, peer, poll_slot, epoch)
            poll_wait(epoch)
        else:
            poll_wait(epoch)
            lib.rocmoe_signal_set(handle, peer, poll_slot, epoch)

    results = {}
    for name, one_round in (("api", api_round), ("raw", raw_round), ("poll", poll_round)):
        times_ns = np.zeros(trips, dtype=np.int64)
        # rare updates: a rank 0 that pauses pushes rank 1's wait into its sleeping back-off
        report_every = max(1, trips // 4)
        bar = progress(total=trips, rank=rank, desc=f"signal ping-pong ({name})", unit="trip")
        if rank in (0, 1):
            for i in range(warmup + trips):
                t0 = time.perf_counter_ns()
                one_round(i + 1)  # epochs: every round trip raises the flag value
                t1 = time.perf_counter_ns()
                if i >= warmup:
                    times_ns[i - warmup] = t1 - t0
                    if rank == 0 and (i - warmup + 1) % report_every == 0:
                        bar.update(report_every)
        bar.close()
        ctx.barrier()
        results[name] = times_ns / 1e3
    mpi_us = _mpi_pingpong(ctx, warmup, trips) / 1e3
    ctx.free(flags)
    if rank != 0:
        return None
    us, raw_us = results["api"], results["raw"]
    median, base_median = float(np.median(us)), float(np.median(mpi_us))
    record = {
        "bench": "signal_pingpong", "round_trips": trips, "warmup": warmup,
        "median_us": round(median, 3), "p99_us": round(float(np.percentile(us, 99)), 3),
        "mean_us": round(float(us.mean()), 3), "min_us": round(float(us.min()), 3),
        "raw_median_us": round(float(np.median(raw_us)), 3),
        "raw_p99_us": round(float(np.percentile(raw_us, 99)), 3),
        "poll_median_us": round(float(np.median(results["poll"])), 3),
        "poll_p99_us": round(float(np.percentile(results["poll"], 99)), 3),
        "baseline": PINGPONG_BASELINE, "baseline_median_us": round(base_median, 3),
        "baseline_p99_us": round(float(np.percentile(mpi_us, 99)), 3),
        # (4 significant digits: a starved run's ratio can be far below 0.001)
        "ratio": float(f"{base_median / median:.4g}"),
        "ratio_definition": "baseline median / rocmoe median (> 1: the signal path is faster)",
    }
    emit(record, out)
    return record


def _mpi_pingpong(ctx, warmup: int, trips: int):
    import numpy as np
    comm = ctx.comm
    buf = np.zeros(1, dtype=np.int64)
    times_ns = np.zeros(trips, dtype=np.int64)
    if ctx.rank in (0, 1):
        peer = 1 - ctx.rank
        for i in range(warmup + trips):
            if ctx.rank == 0:
                buf[0] = i
                t0 = time.perf_counter_ns()
                comm.Send(buf, dest=peer, tag=7)
                comm.Recv(buf, source=peer, tag=7)
                if i >= warmup:
                    times_ns[i - warmup] = time.perf_counter_ns() - t0
            else:
                comm.Recv(buf, source=peer, tag=7)
                comm.Send(buf, dest=peer, tag=7)
    ctx.barrier()
    return times_ns


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from ..errors import InvalidArgumentError
    if args.quick:
        args.trials = min(args.trials, 3)
        args.round_trips = min(args.round_trips, 300)
        args.trial_bytes = "8M"
    if args.sizes:
        sizes = parse_sizes(args.sizes)
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    if args.iters < 1 or args.trials < 1 or args.round_trips < 1:
        raise InvalidArgumentError("--iters, --trials and --round-trips must be >= 1")

    if not inside_mpi_job():
        forwarded = list(argv if argv is not None else sys.argv[1:])
        return relaunch_under_mpiexec("rocmoe.bench.heap", forwarded, max(2, args.ranks))

    import torch
    import rocmoe
    # One thread per rank: the put is one memcpy on one core, and so must be its baseline.
    torch.set_num_threads(1)
    heap_size = max(sizes) + (1 << 20)  # the target buffer plus signal slots and alignment
    heap_size = int(math.ceil(heap_size / 4096) * 4096)
    ctx = rocmoe.init(backend="host", heap_size=heap_size)
    try:
        if ctx.world_size < 2:
            raise InvalidArgumentError(
                "rocmoe bench heap needs 2 ranks; run it from a shell (it starts mpiexec itself) "
                "or with `mpiexec -n 2`")
        out = open(args.output, "w") if (args.output and ctx.rank == 0) else None
        try:
            if ctx.rank == 0:
                emit(_environment_record(args, ctx.world_size, sizes), out)
            records = _bandwidth(ctx, sizes, args, out)
            _pingpong(ctx, args, out)
            if ctx.rank == 0:
                judged = [r for r in records if r["meets_goal"] is not None]
                emit({"bench": "heap_summary", "goal": f"put >= {GOAL_RATIO} x memcpy from "
                                                        f"{GOAL_FROM_BYTES} bytes up",
                      "sizes_judged": [r["size_bytes"] for r in judged],
                      "meets_goal": all(r["meets_goal"] for r in judged) if judged else None,
                      "min_ratio_judged": min((r["ratio"] for r in judged), default=None)}, out)
        finally:
            if out is not None:
                out.close()
        ctx.finalize()
    except BaseException:
        ctx._release()  # the other rank may not reach a collective: release locally only
        raise
    return 0


if __name__ == "__main__":
    from ..errors import RocmoeError
    try:
        sys.exit(main())
    except RocmoeError as exc:
        print(f"rocmoe bench heap: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
