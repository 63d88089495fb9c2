"""Runtime checks run on every rank of an mpiexec job; prints `CHECK <name> <rank> OK|FAIL ...`.

`suite` runs every check that leaves the job usable, in order, each inside its own try so
one failure does not hide the others; the other scenarios end the job on purpose.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import rocmoe

scenario = sys.argv[1] if len(sys.argv) > 1 else "suite"


def report(name, ok, detail=""):
    print(f"CHECK {name} {rank} {'OK' if ok else 'FAIL'} {detail}".rstrip(), flush=True)


def expect_error(name, cls, fn):
    try:
        fn()
    except cls as exc:
        report(name, True, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any other outcome is a failure to report
        report(name, False, f"wrong error {type(exc).__name__}: {exc}")
    else:
        report(name, False, "no error raised")


def check(name, fn):
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    report(name, ok, detail)


if scenario == "suite":
    ctx = rocmoe.init(heap_size=1 << 22)
    rank, world = ctx.rank, ctx.world_size
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def ring_exchange():
        data = ctx.zeros((1000,), torch.float64)
        flags = ctx.zeros((1,), torch.int64)
        ctx.put_signal(data, torch.arange(1000, dtype=torch.float64) + 1000 * rank, flags, 0, 1,
                       peer=nxt)
        ctx.wait_until(flags, 0, 1, peer=prv)
        want = torch.arange(1000, dtype=torch.float64) + 1000 * prv
        ok = torch.equal(data, want)
        ctx.barrier()
        ctx.free(flags)
        ctx.free(data)
        return ok, f"received from rank {prv}"

    check("ring_exchange", ring_exchange)

    def peer_view_aliases_peer_memory():
        t = ctx.zeros((8,), torch.int32)
        t.fill_(rank)
        ctx.barrier()
        ok = torch.equal(ctx.peer(t, nxt), torch.full((8,), nxt, dtype=torch.int32))
        ctx.barrier()
        ctx.free(t)
        return ok, ""

    check("peer_view", peer_view_aliases_peer_memory)

    def get_reads_peer():
        t = ctx.zeros((16,), torch.bfloat16)
        t.fill_(rank + 0.5)
        ctx.barrier()
        out = torch.empty(16, dtype=torch.bfloat16)
        ctx.get(out, t, prv)
        ctx.barrier()
        ctx.free(t)
        return torch.equal(out, torch.full((16,), prv + 0.5, dtype=torch.bfloat16)), ""

    check("get", get_reads_peer)

    def offsets_symmetric():
        tensors = [ctx.empty((n,), torch.float32) for n in (1, 300, 0, 4096)]
        offs = [ctx.heap.offset_of(t) for t in tensors]
        table = ctx.allgather_ints(offs)
        for t in reversed(tensors):
            ctx.free(t)
        return bool((table == table[0]).all()), str(offs)

    check("offsets_symmetric", offsets_symmetric)

    def free_reuses_memory():
        before = ctx.heap.free_bytes
        for _ in range(50):
            ctx.free(ctx.empty((1 << 18,), torch.uint8))
        return ctx.heap.free_bytes == before, f"{before} -> {ctx.heap.free_bytes}"

    check("free_reuses_memory", free_reuses_memory)

    def expect_mismatch(name, fn):
        if world == 1:
            fn()  # one rank cannot disagree with itself: the call must simply work
            report(name, True, "single rank: nothing to mismatch")
        else:
            expect_error(name, rocmoe.HeapMismatchError, fn)

    expect_mismatch("size_mismatch", lambda: ctx.empty((10 + rank,), torch.float32))
    expect_mismatch("dtype_mismatch",
                    lambda: ctx.empty((4,), torch.float32 if rank == 0 else torch.int32))

    def order_mismatch():
        # rank 0 frees while the others allocate: the same collective slot, different calls
        t = ctx.empty((4,), torch.float32)
        if rank == 0:
            ctx.free(t)
        else:
            ctx.empty((4,), torch.float32)
    expect_mismatch("order_mismatch", order_mismatch)

    def heap_intact_after_errors():
        # after every error above, allocation still works and stays symmetric
        t = ctx.zeros((64,), torch.float32)
        off = ctx.allgather_ints([ctx.heap.offset_of(t)])
        ctx.free(t)
        return bool((off == off[0]).all()), ""

    check("heap_intact_after_errors", heap_intact_after_errors)

    expect_error("heap_exhausted", rocmoe.HeapExhaustedError,
                 lambda: ctx.empty((1 << 23,), torch.float32))

    def _wait_never_signalled():
        flags = ctx.zeros((1,), torch.int64)
        try:
            ctx.wait_until(flags, 0, 1, peer=prv, timeout_s=0.2)
        finally:
            ctx.free(flags)

    expect_error("wait_timeout", rocmoe.CommTimeoutError, _wait_never_signalled)

    expect_error("peer_out_of_range", rocmoe.InvalidArgumentError,
                 lambda: ctx.peer(torch.zeros(1), world))
    expect_error("free_not_on_heap", rocmoe.NotOnHeapError, lambda: ctx.free(torch.zeros(4)))

    def _put_too_large():
        t = ctx.zeros((4,), torch.float32)
        try:
            ctx.put(t, torch.zeros(8), nxt)
        finally:
            ctx.free(t)

    expect_error("put_too_large", rocmoe.InvalidArgumentError, _put_too_large)

    expect_error("bad_dtype", rocmoe.DTypeError, lambda: ctx.empty((4,), "float"))

    ctx.finalize()
    expect_error("use_after_finalize", rocmoe.ContextError, lambda: ctx.empty((4,), torch.float32))
    expect_error("barrier_after_finalize", rocmoe.ContextError, ctx.barrier)
    print(f"DONE {rank}", flush=True)

elif scenario == "dead_rank":
    # rank 1 dies while rank 0 waits for its signal; the launcher is told to let rank 0 run
    # on, so rank 0's own error is what ends its wait: PeerDeadError from the liveness check,
    # long before the wait's bound (WAIT_S) would give CommTimeoutError.
    ctx = rocmoe.init(heap_size=1 << 20, timeout_s=float(os.environ.get("WAIT_S", "10")))
    rank = ctx.rank
    flags = ctx.zeros((1,), torch.int64)
    if rank == 1:
        os._exit(17)  # dies without a word, never signalling
    start = time.monotonic()
    try:
        ctx.wait_until(flags, 0, 1, peer=1)
        report("dead_rank", False, "wait returned")
    except rocmoe.RocmoeError as exc:
        report("dead_rank", True,
               f"{type(exc).__name__} after {time.monotonic() - start:.2f}s: {exc}")
    ctx._release()  # no finalize: its barrier would wait for the dead rank
    sys.stdout.flush()
    os._exit(5)

elif scenario == "absent_rank":
    # rank 1 never joins the barrier (stuck elsewhere): the others time out, no hang
    ctx = rocmoe.init(heap_size=1 << 20, timeout_s=2.0)
    rank = ctx.rank
    if rank == 1:
        time.sleep(30)
    else:
        try:
            ctx.barrier()
            report("absent_rank", False, "barrier returned")
        except rocmoe.CommTimeoutError as exc:
            report("absent_rank", True, str(exc))
            raise SystemExit(6)
else:
    raise SystemExit(f"unknown scenario {scenario}")
