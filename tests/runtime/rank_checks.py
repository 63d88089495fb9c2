"""Runtime checks run on every rank of an mpiexec job; prints `CHECK <name> <rank> OK|FAIL ...`.

`suite` runs every check that leaves the job usable, in order, each inside its own try so
one failure does not hide the others; the other scenarios end the job on purpose.
"""

from __future__ import annotations

import glob
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


if scenario == "bad_collectives":
    # an argument of a collective Context call that the last rank alone gets wrong: every
    # rank raises InvalidArgumentError (or the rank with it a DTypeError), none waits in the
    # call's agreement until its timeout, and the next collective pairs with the next
    from mpi4py import MPI
    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    last = rank == world - 1
    ctx = rocmoe.init(backend="host", heap_size=1 << 20, timeout_s=10)

    def heap_state():
        return (ctx.heap.free_bytes, ctx.heap.largest_free_block, ctx.heap.live_allocations)

    def expect_rejected(name, cls, fn):
        before = heap_state()
        expect_error(name, cls if last else rocmoe.errors.InvalidArgumentError, fn)
        report(f"heap_unchanged_after_{name}", heap_state() == before)
        table = ctx.allgather_ints([rank, 7])  # the next collective pairs with the next
        report(f"next_collective_after_{name}",
               table.tolist() == [[r, 7] for r in range(world)], str(table.tolist()))

    for name, shape, dtype in (("empty_float_shape", (4.5,), torch.float32),
                               ("empty_string_shape", "12", torch.float32),
                               ("empty_beyond_64_bits", (1 << 62,), torch.float32),
                               ("empty_unhashable_dtype", (4,), [torch.float32])):
        cls = rocmoe.errors.DTypeError if name.endswith("dtype") else \
            rocmoe.errors.InvalidArgumentError
        expect_rejected(name, cls, lambda: ctx.empty(shape if last else (4,),
                                                     dtype if last else torch.float32))
    for name, values in (("allgather_fourteen_values", list(range(14))),
                         ("allgather_a_string", ["a"]),
                         ("allgather_a_float", [1.5]),
                         ("allgather_beyond_int64", [1 << 64]),
                         ("allgather_none", None)):
        expect_rejected(name, rocmoe.errors.InvalidArgumentError,
                        lambda: ctx.allgather_ints(values if last else [1]))
    table = ctx.allgather_ints(list(range(13)))  # the most it carries
    report("allgather_thirteen_values", table.shape == (world, 13), str(table.shape))
    ctx.finalize()
    print(f"DONE {rank}", flush=True)
    sys.exit(0)

if scenario == "bad_init":
    # an argument of rocmoe.init that the last rank alone gets wrong: every rank raises
    # InvalidArgumentError (the others naming that rank), none waits in the bootstrap
    from mpi4py import MPI
    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for name, kw in (("heap_size_not_a_number", dict(heap_size="x")),
                     ("timeout_not_a_number", dict(timeout_s="x")),
                     ("heap_below_the_minimum", dict(heap_size=100)),
                     ("heap_beyond_64_bits", dict(heap_size=1 << 70)),
                     ("heap_infinite", dict(heap_size=float("inf"))),
                     ("timeout_negative", dict(timeout_s=-1)),
                     ("timeout_nan", dict(timeout_s=float("nan"))),
                     ("timeout_infinite", dict(timeout_s=float("inf"))),
                     ("backend_not_a_name", dict(backend=["host"])),
                     ("device_not_an_index", dict(device="0"))):
        args = dict(backend="host", heap_size=1 << 20)
        if rank == world - 1:
            args.update(kw)
        expect_error(f"bad_init_{name}", rocmoe.errors.InvalidArgumentError,
                     lambda: rocmoe.init(**args))
    with rocmoe.init(backend="host", heap_size=1 << 20) as ctx:  # a good init still works
        ctx.barrier()
    report("init_after_bad_inits", True)
    print(f"DONE {rank}", flush=True)
    sys.exit(0)

if scenario == "suite":
    ctx = rocmoe.init(heap_size=1 << 22)
    rank, world = ctx.rank, ctx.world_size
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def segments_unlinked_after_init():
        ctx.barrier()  # every rank is past rocmoe.init, i.e. has unlinked its own segment
        left = sorted(glob.glob(f"/dev/shm/rocmoe.{ctx.job_tag}.*"))
        return not left, f"left in /dev/shm: {left}"

    check("segments_unlinked_after_init", segments_unlinked_after_init)

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

    def signal_adds_from_every_rank_sum_exactly():
        # every rank adds to one slot (rank 0's) for the same 0.3 s: the sum must be exact
        # across processes. How many adds fit depends on the machine, so the ranks count
        # theirs. (A lost update needs two adds at the same instant, which Python's pace
        # makes rare: test_signal_add_atomic.py checks atomicity with tight C loops.)
        slots = ctx.zeros((1,), torch.int64)
        done = 0
        stop = time.monotonic() + 0.3
        while time.monotonic() < stop:
            ctx.signal_add(slots, 0, rank + 1, peer=0)
            done += 1
        adds = ctx.allgather_ints([done])[:, 0]
        want = int(sum((r + 1) * int(n) for r, n in enumerate(adds)))
        seen = ctx.wait_until(slots, 0, want, ">=", timeout_s=5) if rank == 0 else None
        ctx.barrier()
        final = int(ctx.peer(slots, 0)[0])
        ctx.barrier()
        ctx.free(slots)
        return final == want, (f"{int(adds.sum())} adds into rank 0's slot; want {want}, "
                               f"wait saw {seen}, slot holds {final}")

    check("signal_add_sums", signal_adds_from_every_rank_sum_exactly)

    # for each comparison against 10: a value that must keep the wait waiting, and a value
    # that must release it, both at the boundary
    COMPARISON_CASES = {"==": ("eq", 9, 10), "!=": ("ne", 10, 11), ">": ("gt", 10, 11),
                        ">=": ("ge", 9, 10), "<": ("lt", 10, 9), "<=": ("le", 11, 10)}

    def comparison_waits_then_releases(cmp, hold, release):
        slots = ctx.zeros((1,), torch.int64)
        ctx.signal_set(slots, 0, hold, peer=rank)
        try:
            ctx.wait_until(slots, 0, 10, cmp, timeout_s=0.05, peer=prv)
            waited = f"returned although the slot held {hold}"
        except rocmoe.CommTimeoutError:
            waited = ""
        ctx.barrier()  # every rank has seen its wait hold before anyone releases
        ctx.signal_set(slots, 0, release, peer=nxt)
        try:
            seen = ctx.wait_until(slots, 0, 10, cmp, timeout_s=20, peer=prv)
        except rocmoe.CommTimeoutError as exc:
            seen = f"not released: {exc}"
        ctx.barrier()
        ctx.free(slots)
        ok = not waited and seen == release
        return ok, waited or f"slot {hold}: waited; slot {release}: released, saw {seen}"

    for cmp, (label, hold, release) in COMPARISON_CASES.items():
        check(f"wait_until_{label}", lambda: comparison_waits_then_releases(cmp, hold, release))

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

    # A fragmented heap (a hole between two live blocks), so that the free bytes and the
    # largest free block differ: a failed call that kept or freed the wrong block shows in
    # one of them.
    fragments = [ctx.empty((n,), torch.float32) for n in (5000, 3000, 7000)]
    ctx.free(fragments.pop(1))

    def heap_state():
        h = ctx.heap
        return (h.free_bytes, h.largest_free_block, h.live_allocations)

    def leaves_heap_as_it_was(name, cls, fn):
        """fn() raises `cls` on this rank, and afterwards the heap is exactly as before:
        reported as the check `name` and the check `heap_unchanged_after_<name>`."""
        before = heap_state()
        expect_error(name, cls, fn)
        after = heap_state()
        report(f"heap_unchanged_after_{name}", after == before,
               f"(free, largest free block, live) {before} -> {after}")

    def expect_mismatch(name, fn):
        if world == 1:
            allocated = fn()  # one rank cannot disagree with itself: the call must simply work
            for t in allocated:
                ctx.free(t)
            report(name, True, "single rank: nothing to mismatch")
            report(f"heap_unchanged_after_{name}", True, "single rank: nothing to roll back")
        else:
            leaves_heap_as_it_was(name, rocmoe.HeapMismatchError, fn)

    expect_mismatch("size_mismatch", lambda: [ctx.empty((10 + rank,), torch.float32)])
    expect_mismatch("dtype_mismatch",
                    lambda: [ctx.empty((4,), torch.float32 if rank == 0 else torch.int32)])

    held = ctx.empty((4,), torch.float32)

    def order_mismatch():
        # rank 0 frees while the others allocate: the same collective slot, different calls;
        # nobody may free `held` or keep the new block
        if rank == 0:
            ctx.free(held)
            return []
        return [ctx.empty((4,), torch.float32)]
    expect_mismatch("order_mismatch", order_mismatch)
    if world > 1:
        ctx.free(held)  # on one rank the free above already did it

    other = [ctx.empty((64,), torch.float32), ctx.empty((64,), torch.float32)]

    def free_mismatch():
        ctx.free(other[rank % 2])  # ranks free different allocations: nothing is freed
        return []
    expect_mismatch("free_mismatch", free_mismatch)
    for t in other[1:] if world == 1 else other:  # one rank alone freed other[0] above
        ctx.free(t)

    def shape_invalid_on_one_rank():
        # the last rank's shape is invalid: it raises its own error, the others (which had
        # already allocated locally) roll back and raise InvalidArgumentError naming it
        return ctx.empty((-1,) if rank == world - 1 else (16,), torch.float32)
    leaves_heap_as_it_was("shape_invalid_on_one_rank", rocmoe.InvalidArgumentError,
                          shape_invalid_on_one_rank)

    def heap_intact_after_errors():
        # after every error above, allocation still works and stays symmetric
        t = ctx.zeros((64,), torch.float32)
        off = ctx.allgather_ints([ctx.heap.offset_of(t)])
        ctx.free(t)
        return bool((off == off[0]).all()), ""

    check("heap_intact_after_errors", heap_intact_after_errors)

    leaves_heap_as_it_was("heap_exhausted", rocmoe.HeapExhaustedError,
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

    leaves_heap_as_it_was("bad_dtype", rocmoe.DTypeError, lambda: ctx.empty((4,), "float"))
    for t in fragments:
        ctx.free(t)

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
