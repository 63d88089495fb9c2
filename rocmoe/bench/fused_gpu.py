"""GPU fused ops: bandwidth / matrix rate against baselines measured in the same run.

    python -m rocmoe.bench.fused_gpu [--quick] [--ranks N] [--output FILE]

World size 1 (default) measures the compute path and the fusion machinery on one GPU;
`--ranks N` re-launches under mpiexec with one GPU per rank (ranks > GPUs share GPUs:
numbers are then only a smoke test). JSON lines on rank 0, one per measurement:

* `copy_bandwidth`: torch device-to-device copy of a 2 GiB buffer, bytes read + written per
  second: the baseline of the bandwidth-bound ops.
* `embedding_a2a`: fused Embedding+A2A; bytes = indices + offsets read + gathered rows read
  + output rows written (the fewest any implementation moves); `ratio` = its bandwidth over
  copy_bandwidth (goal >= 0.7). `kernel_*`: the producer kernel + signal wait alone (no
  copy-out of the heap); `overhead` = fused / (same kernel with signalling off) - 1 (goal
  <= 0.05).
* `gemv_allreduce`: bytes = W + x read + y written; ratio over copy bandwidth (goal >= 0.8).
* `gemm_a2a`: Triton persistent GEMM+A2A kernel (stores into the receive heap, done
  counters, system-scope signals, consumer wait) against torch.matmul of the same bf16
  shapes (`ratio` = matmul time / fused time, goal >= 0.8 for M, N, K >= 4096); `overhead`
  against the same kernel with SIGNAL=False.
* `gemm_a2a_grouped`: the grouped form (W [G, K, N], an expert-parallel layer's combine:
  each local expert's rows through its W2[e]) in one call, against the same G products as G
  calls of the op (what the combine did before: one collective, one status check each) and
  against cuBLAS `torch.bmm` of the same balanced shapes (`ratio` = bmm time / grouped time).
Timings are medians of CUDA-event-timed repetitions (triton.testing.do_bench) after warm-up,
on random data, rotating nothing: every working set is several times the L2. do_bench times
each call alone after flushing the L2, so a call's host-side launch work shows whenever it
outlasts the flush; the `steady_*` fields time 25 back-to-back calls between two events
(the host runs ahead, as in a training loop), baselines likewise (`steady_copy_gbps`,
`steady_baseline_ms`): the device-side cost of each op and of its signalling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from . import emit, inside_mpi_job, relaunch_under_mpiexec
from .timing import time_ms


def _bench(fn, rep_ms=200, warmup_ms=50):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _bench_steady(fn, calls=25, repeats=7):
    """Steady-state time per call: `calls` back-to-back calls between two CUDA events (the
    host runs ahead, as in a training step), median over `repeats`. _bench's per-call timing
    (L2 flushed, each call alone) also counts host launch work the GPU waits for."""
    return time_ms(fn, reps=repeats, warmup=3, calls=calls)


def _device_name():
    return torch.cuda.get_device_name(torch.cuda.current_device())


def copy_bandwidth(quick):
    n = (512 << 20) if quick else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return dict(bench="copy_bandwidth", bytes=2 * n, ms=ms, gbps=2 * n / ms / 1e6,
                baseline="self (torch.Tensor.copy_ device-to-device, read+write bytes)")


def make_arena(ranks_mode):
    from ..ops import gpu
    if not ranks_mode:
        return gpu.SingleRankArena(nbytes=3 << 30, timeout_s=10.0)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    return gpu.TorchIpcArena(comm, nbytes=3 << 30)


def bench_embedding(arena, copy_gbps, quick, dtype, emit_fn):
    from ..ops import gpu
    world = arena.world
    tables, rows, dim, pool = (4, 200_000, 128, 32) if quick else (8, 1_000_000, 128, 32)
    batch = 16384 * world
    g = torch.Generator(device="cuda").manual_seed(arena.rank + 7)
    weights = [torch.randn(rows, dim, device="cuda", dtype=dtype, generator=g) for _ in range(tables)]
    indices = [torch.randint(0, rows, (batch * pool,), device="cuda", generator=g)
               for _ in range(tables)]
    offsets = [torch.arange(0, batch * pool, pool, device="cuda") for _ in range(tables)]
    layout = ([tables] * world, dim, batch)

    def fused(signal=True):
        return gpu.embedding_all_to_all(arena, weights, indices, offsets, "sum", batch=batch,
                                        signal=signal, check=False, layout=layout)
    out = fused()
    torch.cuda.synchronize()
    ws = arena.workspace("embedding_a2a")
    gpu.check_status(ws, ws.epoch, "embedding_all_to_all")
    # correctness of what is timed: one table against torch's EmbeddingBag
    if world == 1:
        ref = torch.nn.functional.embedding_bag(indices[0], weights[0].float(), offsets[0],
                                                mode="sum")
        err = float((out[:, 0].float() - ref).norm() / ref.norm())
    else:
        err = None
    elt = weights[0].element_size()
    b_local = batch // world
    moved = (tables * batch * pool * 8 + tables * batch * 8            # indices, offsets
             + tables * batch * pool * dim * elt                          # gathered rows
             + b_local * tables * world * dim * elt)                      # output rows
    ms = _bench(lambda: fused(True))
    ms_off = _bench(lambda: fused(False))
    st, st_off, st_copy = (_bench_steady(lambda: fused(True)), _bench_steady(lambda: fused(False)),
                           _steady_copy_gbps())
    rec = dict(bench="embedding_a2a", world=world, dtype=str(dtype).replace("torch.", ""),
               tables_per_rank=tables, rows=rows, dim=dim, pooling=pool, batch=batch,
               bytes=moved, ms=ms, gbps=moved / ms / 1e6,
               baseline="copy_bandwidth (torch device-to-device copy, same run)",
               baseline_gbps=copy_gbps, ratio=moved / ms / 1e6 / copy_gbps, goal_ratio=0.7,
               signal_off_ms=ms_off, overhead=ms / ms_off - 1.0, goal_overhead=0.05,
               rel_err_vs_torch=err, **_steady_fields(moved, st, st_off, st_copy))
    emit_fn(rec)
    return rec


def _steady_copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _bench_steady(lambda: dst.copy_(src), calls=10) / 1e6


def _steady_fields(moved, ms, ms_off, copy_gbps):
    return dict(steady_ms=ms, steady_copy_gbps=copy_gbps,
                steady_ratio=moved / ms / 1e6 / copy_gbps, steady_signal_off_ms=ms_off,
                steady_overhead=ms / ms_off - 1.0)


def bench_gemv(arena, copy_gbps, quick, dtype, emit_fn):
    from ..ops import gpu
    n, k = (8192, 8192) if quick else (16384, 16384)
    g = torch.Generator(device="cuda").manual_seed(arena.rank + 11)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g)
    x = torch.randn(k, device="cuda", dtype=dtype, generator=g)
    y = gpu.gemv_all_reduce(arena, w, x)
    err = None
    if arena.world == 1:
        ref = w.float() @ x.float()
        err = float((y.float() - ref).norm() / ref.norm())
    moved = n * k * w.element_size() + k * x.element_size() + n * w.element_size()
    ms = _bench(lambda: gpu.gemv_all_reduce(arena, w, x, check=False))
    ms_off = _bench(lambda: gpu.gemv_all_reduce(arena, w, x, signal=False, check=False))
    ms_torch = _bench(lambda: w @ x)
    st, st_off, st_copy = (_bench_steady(lambda: gpu.gemv_all_reduce(arena, w, x, check=False)),
                           _bench_steady(lambda: gpu.gemv_all_reduce(arena, w, x, signal=False,
                                                                     check=False)),
                           _steady_copy_gbps())
    torch.cuda.synchronize()
    rec = dict(bench="gemv_allreduce", world=arena.world, dtype=str(dtype).replace("torch.", ""),
               n=n, k_per_rank=k, bytes=moved, ms=ms, gbps=moved / ms / 1e6,
               baseline="copy_bandwidth (torch device-to-device copy, same run)",
               baseline_gbps=copy_gbps, ratio=moved / ms / 1e6 / copy_gbps, goal_ratio=0.8,
               signal_off_ms=ms_off, overhead=ms / ms_off - 1.0, goal_overhead=0.05,
               torch_matvec_ms=ms_torch, rel_err_vs_torch=err,
               **_steady_fields(moved, st, st_off, st_copy))
    emit_fn(rec)
    return rec


def bench_gemm(arena, size, quick, emit_fn, configs):
    from ..ops import gpu
    m = n = k = size
    dtype = torch.bfloat16
    world = arena.world
    g = torch.Generator(device="cuda").manual_seed(arena.rank + 13)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(k, n, device="cuda", dtype=dtype, generator=g)
    counts = [m // world] * world
    counts[-1] += m - sum(counts)
    ms_mm = _bench(lambda: x @ w)
    best = None
    for cfg in configs:
        plan = gpu.plan_gemm(arena, m, n, counts, cfg)
        try:
            y = gpu.gemm_all_to_all(arena, x, w, counts, config=cfg, plan=plan)
        except Exception as exc:  # a config that does not fit this GPU: say so, try the next
            emit_fn(dict(bench="gemm_a2a_config_failed", config=cfg, error=str(exc)[:300]))
            continue
        ms = _bench(lambda: gpu.gemm_all_to_all(arena, x, w, counts, check=False, config=cfg,
                                                plan=plan))
        # every candidate's whole-op time, so a sweep shows what each tile choice gives
        emit_fn(dict(bench="gemm_a2a_candidate", m=m, n=n, k=k, config=cfg, op_ms=ms,
                     op_tflops=2.0 * m * n * k / ms / 1e9, baseline_ms=ms_mm,
                     op_ratio=ms_mm / ms))
        if best is None or ms < best[0]:
            best = (ms, cfg, plan, y)
    ms_full, cfg, plan, y = best
    err = None
    if world == 1:
        ref = (x.float() @ w.float())
        err = float((y.float() - ref).norm() / ref.norm())
    # the kernel alone (with its in-kernel waits and the ack, no copy-out of the receive
    # buffer) vs SIGNAL off: the cost of the fusion machinery
    def kernel(signal):
        gpu.gemm_all_to_all(arena, x, w, counts, signal=signal, check=False, config=cfg,
                            plan=plan, copy_out=False)

    ms_sig = ms_nosig = st_sig = st_nosig = None
    if world == 1:  # without signals the peers' buffers are unguarded: one rank only
        ms_sig = _bench(lambda: kernel(True))
        ms_nosig = _bench(lambda: kernel(False))
        st_sig = _bench_steady(lambda: kernel(True))
        st_nosig = _bench_steady(lambda: kernel(False))
    st_mm = _bench_steady(lambda: x @ w)
    flops = 2.0 * m * n * k
    rec = dict(bench="gemm_a2a", world=world, dtype="bfloat16", m=m, n=n, k=k,
               config=cfg, kernel_ms=ms_sig, kernel_tflops=flops / ms_sig / 1e9 if ms_sig else None,
               op_ms=ms_full, op_tflops=flops / ms_full / 1e9,
               baseline="torch.matmul(X, W) bf16, same run", baseline_ms=ms_mm,
               baseline_tflops=flops / ms_mm / 1e9,
               ratio=(ms_mm / ms_sig) if ms_sig else ms_mm / ms_full, goal_ratio=0.8,
               op_ratio=ms_mm / ms_full,
               signal_off_ms=ms_nosig,
               overhead=(ms_sig / ms_nosig - 1.0) if ms_sig else None, goal_overhead=0.05,
               rel_err_vs_fp32=err, steady_baseline_ms=st_mm, steady_kernel_ms=st_sig,
               steady_ratio=(st_mm / st_sig) if st_sig else None,
               steady_signal_off_ms=st_nosig,
               steady_overhead=(st_sig / st_nosig - 1.0) if st_sig else None)
    emit_fn(rec)
    return rec


def bench_gemm_grouped(arena, shape, emit_fn):
    """G experts of R rows each: Y_e = X_e @ W[e] ([R, K] x [K, N]), rows split evenly over
    the ranks, as one grouped call, as G calls, and as torch.bmm."""
    from ..ops import gpu
    groups, rows, k, n = shape
    world = arena.world
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(arena.rank + 17)
    w = torch.randn(groups, k, n, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    # rows of expert e for destination d: an even split
    split = [rows // world] * world
    group_counts = [[split[d]] * groups for d in range(world)]
    send = [sum(r) for r in group_counts]
    if rows % world:
        raise ValueError(f"rows {rows} must split evenly over {world} ranks")
    x = torch.randn(rows * groups, k, device="cuda", dtype=dtype, generator=g)
    # the same rows expert by expert, for the per-expert calls and bmm
    xe = x.view(world, groups, -1, k).permute(1, 0, 2, 3).reshape(groups, rows, k).contiguous()
    cfg = gpu.gemm_config(x.device, dtype)
    plan = gpu.plan_gemm(arena, x.shape[0], n, send, cfg, group_counts=group_counts)
    plan_e = gpu.plan_gemm(arena, rows, n, split, cfg)

    def grouped():
        return gpu.gemm_all_to_all(arena, x, w, send, config=cfg, plan=plan,
                                   group_counts=group_counts)

    def per_expert():
        return [gpu.gemm_all_to_all(arena, xe[e], w[e], split, config=cfg, plan=plan_e)
                for e in range(groups)]

    def bmm():
        return torch.bmm(xe, w)

    err = None
    if world == 1:
        ref = torch.bmm(xe.float(), w.float()).reshape(-1, n)
        err = float((grouped().float() - ref).norm() / ref.norm())
    ms = {name: _bench(fn) for name, fn in (("grouped", grouped), ("per_expert", per_expert),
                                            ("bmm", bmm))}
    st = {name: _bench_steady(fn) for name, fn in (("grouped", grouped),
                                                   ("per_expert", per_expert), ("bmm", bmm))}
    flops = 2.0 * groups * rows * k * n
    emit_fn(dict(bench="gemm_a2a_grouped", world=world, dtype="bfloat16", groups=groups,
                 rows_per_group=rows, k=k, n=n, op_ms=ms["grouped"],
                 op_tflops=flops / ms["grouped"] / 1e9,
                 per_group_calls_ms=ms["per_expert"], baseline="torch.bmm, same shapes",
                 baseline_ms=ms["bmm"], baseline_tflops=flops / ms["bmm"] / 1e9,
                 ratio=ms["bmm"] / ms["grouped"],
                 speedup_vs_per_group_calls=ms["per_expert"] / ms["grouped"],
                 steady_op_ms=st["grouped"], steady_per_group_calls_ms=st["per_expert"],
                 steady_baseline_ms=st["bmm"], steady_ratio=st["bmm"] / st["grouped"],
                 steady_speedup_vs_per_group_calls=st["per_expert"] / st["grouped"],
                 rel_err_vs_fp32=err))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--output", default=None, help="also write the records (JSON) here")
    ap.add_argument("--only", default="embedding,gemv,gemm,gemm_grouped")
    ap.add_argument("--gemm-configs", default=None,
                    help="JSON list of GEMM+A2A tile configs to try (default: the platform's)")
    ap.add_argument("--sizes", default=None, help="GEMM sizes, comma-separated (default 4096,8192)")
    args = ap.parse_args(argv)
    if args.ranks > 1 and not inside_mpi_job():
        return relaunch_under_mpiexec("rocmoe.bench.fused_gpu", list(argv or sys.argv[1:]),
                                      args.ranks)
    if not torch.cuda.is_available():
        print("rocmoe.bench.fused_gpu needs a GPU", file=sys.stderr)
        return 2
    arena = make_arena(args.ranks > 1)
    root = arena.rank == 0
    records = []

    def out(rec):
        rec = dict(rec, device=_device_name())
        records.append(rec)
        if root:
            emit(rec)

    copy = copy_bandwidth(args.quick)
    out(copy)
    only = set(args.only.split(","))

    def guarded(name, fn, *a):
        # one failing measurement is reported as such; the others still run
        try:
            fn(*a)
        except Exception as exc:
            out(dict(bench=name, error=f"{type(exc).__name__}: {str(exc)[:400]}"))

    if "embedding" in only:
        for dt in (torch.float32, torch.bfloat16):
            guarded("embedding_a2a", bench_embedding, arena, copy["gbps"], args.quick, dt, out)
    if "gemv" in only:
        for dt in (torch.bfloat16, torch.float32):
            guarded("gemv_allreduce", bench_gemv, arena, copy["gbps"], args.quick, dt, out)
    if "gemm" in only:
        from ..ops import triton_gemm_a2a as tk
        configs = [tk.default_config("hip" if torch.version.hip else "cuda")]
        if args.gemm_configs:
            configs = json.loads(args.gemm_configs)
        sizes = (4096,) if args.quick else (4096, 8192)
        if args.sizes:
            sizes = tuple(int(v) for v in args.sizes.split(","))
        for size in sizes:
            guarded("gemm_a2a", bench_gemm, arena, size, args.quick, out, configs)
    if "gemm_grouped" in only:
        # (local experts, rows each, ffn, hidden): the combine of 64 experts over 8 GPUs at
        # 65536 and at 8192 tokens (top-2), and of 4 experts on 1 GPU
        shapes = [(8, 2048, 4096, 1024), (8, 256, 4096, 1024), (4, 4096, 16384, 4096)]
        if args.quick:
            shapes = shapes[1:2]
        for shape in shapes:
            guarded("gemm_a2a_grouped", bench_gemm_grouped, arena, shape, out)
    if root and args.output:
        with open(args.output, "w") as f:
            json.dump(dict(command="python -m rocmoe.bench.fused_gpu " + " ".join(argv or sys.argv[1:]),
                           when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           records=records), f, indent=1)
    arena.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
