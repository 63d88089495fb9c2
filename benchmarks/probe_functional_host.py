"""Host time of a functional fused op call (rocmoe.ops.gemm_all_to_all, gemv_all_reduce,
embedding_all_to_all) by the path it takes, in one process.

Why this exists: the functions run on cached handles after agreeing on every call's shapes,
and until the twenty-second session every call also went through the custom op
(torch.ops.rocmoe.*, for autograd and torch.compile), whose dispatch cost about 55 us of host
time a call on the CI host: more than the rest of a GEMV call. A call with grad mode off
now runs the op's implementation itself (rocmoe/ops/__init__.py: _direct). Three paths of
the same call on the same inputs:

* `function, grad off`: rocmoe.ops.<op>(...) under torch.no_grad() (the direct path);
* `custom op, grad off`: torch.ops.rocmoe.<op>(...) under torch.no_grad(), what the
  function called before;
* `function, grad on`: rocmoe.ops.<op>(...) with grad mode on (the custom op and its
  autograd node; no input requires grad).

    python3 benchmarks/probe_functional_host.py [--device cpu|cuda] [--calls 1000]
        [--rounds 5] [--embedding T,R,D,B,L] [--profile N]

On a GPU at world size 1, ROCMOE_REPEAT_CALLS=1 in the environment times the functions'
repeat paths (a call its last call's handle takes skips the general path; the default),
ROCMOE_REPEAT_CALLS=0 the general path: the A/B of that change.

On the CPU, two more lines: the embedding's local checks at 4 and 26 tables with the value
checks off, as on a GPU. One JSON line per op and path: host us a call (the median of
`rounds` rounds of `calls` calls back to back; on a GPU the GPU runs behind,
rocmoe.bench.timing.host_ms_per_call) and whether its result equals the first path's. On
the CPU (the host backend) a call's time includes the host backend's own compute, the same
in every path."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def cases(ctx, dev, embedding=(4, 40, 16, 8, 3)):
    """op -> (function call, custom-op call) on small inputs: host time is the point.
    `embedding`: the embedding case's (tables, rows, dim, global batch, lookups a bag)."""
    from rocmoe import ops
    from rocmoe.ops import _ops  # noqa: F401  (torch.ops.rocmoe.*)
    from rocmoe.ops._common import context_id
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g).to(dev), torch.randn(32, 48, generator=g).to(dev)
    wv, xv = torch.randn(96, 32, generator=g).to(dev), torch.randn(32, generator=g).to(dev)
    nt, rows, dim, batch, lookups = embedding
    tables = [torch.randn(rows, dim, generator=g).to(dev) for _ in range(nt)]
    idx = [torch.randint(0, rows, (batch * lookups,), generator=g).to(dev) for _ in range(nt)]
    off = [torch.arange(0, batch * lookups, lookups).to(dev) for _ in range(nt)]
    cid, anchor = context_id(ctx), torch.empty(0, device=dev)
    rocmoe_ops = torch.ops.rocmoe
    return {
        "gemm_all_to_all": (lambda: ops.gemm_all_to_all(x, w, [64]),
                            lambda: rocmoe_ops.gemm_all_to_all(x, w, [64], cid, anchor)[0]),
        "gemv_all_reduce": (lambda: ops.gemv_all_reduce(wv, xv),
                            lambda: rocmoe_ops.gemv_all_reduce(wv, xv, cid)),
        f"embedding_all_to_all ({nt} tables)": (
            lambda: ops.embedding_all_to_all(tables, idx, off),
            lambda: rocmoe_ops.embedding_all_to_all(tables, idx, off, [], False, "sum", "", cid,
                                                    anchor)[0]),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=None, help="(the probes' dry-run flag: rounds)")
    ap.add_argument("--embedding", default="4,40,16,8,3",
                    help="the embedding case: tables,rows,dim,global batch,lookups a bag")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also print cProfile's costliest functions over CALLS calls of each "
                         "op's function path with grad off (where the host time goes)")
    a = ap.parse_args(argv)
    embedding = tuple(int(v) for v in a.embedding.split(","))
    if len(embedding) != 5 or min(embedding) < 1:
        ap.error("--embedding takes five positive ints: tables,rows,dim,batch,lookups")
    rounds = a.reps or a.rounds
    import rocmoe
    from rocmoe.bench.timing import host_ms_per_call
    dev = torch.device(a.device)
    # the heap holds the embedding handle's reverse exchange at the --embedding shape too
    nt, _, dim, batch, _ = embedding
    from rocmoe._triton import pow2_at_least
    heap = max(256 << 20, 4 * pow2_at_least(nt * batch * dim * 4))
    ctx = rocmoe.init(backend="ipc" if dev.type == "cuda" else "host", heap_size=heap)
    for op, (function, custom_op) in cases(ctx, dev, embedding).items():
        paths = {"function, grad off": (False, function), "custom op, grad off": (False, custom_op),
                 "function, grad on": (True, function)}
        first = None
        for path, (grad, fn) in paths.items():
            with torch.set_grad_enabled(grad):
                got = fn().detach()
                for _ in range(min(a.calls, 100)):  # warm-up
                    fn()
                samples = sorted(host_ms_per_call(fn, a.calls) * 1e3 for _ in range(rounds))
            first = got if first is None else first
            print(json.dumps(dict(probe="functional_host", device=a.device, op=op, path=path,
                                  host_us=round(samples[len(samples) // 2], 2),
                                  host_us_samples=[round(s, 2) for s in samples],
                                  equal_to_first_path=bool(torch.equal(got, first)))),
                  flush=True)
        if a.profile:
            profile(op, function, a.profile)
    if dev.type == "cpu":
        checks_as_on_a_gpu(ctx, a.calls, rounds)
    ctx.finalize()


def profile(op: str, fn, calls: int) -> None:
    """cProfile over `calls` calls of fn with grad off, the 30 costliest functions by their
    own time and by their cumulative time (text, after the op's JSON lines; a GPU runs
    behind, as in the timing)."""
    import cProfile
    import io
    import pstats
    with torch.no_grad():
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
        print(f"# profile of {op}, function path, grad off, {calls} calls, by {order}",
              flush=True)
        print(text.getvalue(), flush=True)


def checks_as_on_a_gpu(ctx, calls: int, rounds: int) -> None:
    """The functional embedding's local checks (_kernels._check_embedding) at 4 and 26
    tables, with the value checks off as on a GPU (the host backend reads the indices'
    values on the host; a GPU's kernel checks them): the per-table part of a GPU call's host
    time that a CPU can measure. `_on_gpu` is replaced inside this process only."""
    import time

    from rocmoe.ops import _kernels
    g = torch.Generator().manual_seed(1)
    real = _kernels._on_gpu
    _kernels._on_gpu = lambda c: True
    try:
        for nt in (4, 26):
            tables = [torch.randn(40, 16, generator=g) for _ in range(nt)]
            idx = [torch.randint(0, 40, (24,), generator=g) for _ in range(nt)]
            off = [torch.arange(0, 24, 3) for _ in range(nt)]
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(calls):
                    _kernels._check_embedding(ctx, tables, idx, off, "sum", None)
                samples.append((time.perf_counter() - t0) / calls * 1e6)
            samples.sort()
            print(json.dumps(dict(probe="functional_host", device="cpu",
                                  op=f"embedding local checks, {nt} tables",
                                  path="value checks off (as on a GPU)",
                                  host_us=round(samples[len(samples) // 2], 2),
                                  host_us_samples=[round(s, 2) for s in samples],
                                  equal_to_first_path=True)), flush=True)
    finally:
        _kernels._on_gpu = real


if __name__ == "__main__":
    main()
