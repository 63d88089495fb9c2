"""Multi-rank checks of the GPU path of the fused ops (run by tests/ops_gpu/*.py via mpiexec).

usage: fused_gpu_script.py OPS ARENA [--calls N] [--dtype D[,D...]]
  OPS    comma list of gemm | gemm_grouped | embedding | gemv | gemm_timeout | bad_counts
  ARENA  context (rocmoe.init(): ipc heap on GPUs, host heap on CPUs, where the Triton kernel
         runs under TRITON_INTERPRET=1) | torchipc (device memory shared by IPC handles)
Every rank checks its result against a float64 reference computed from inputs that every
rank can regenerate (seeded per call), prints "RANK r OK <op>" and exits 0, or raises.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from mpi4py import MPI  # noqa: E402

from rocmoe import errors  # noqa: E402
from rocmoe.ops import gpu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_err(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return float((out - ref).norm() / max(ref.norm(), 1e-30))


def make_arena(kind, comm):
    if kind == "context":
        import rocmoe
        ctx = rocmoe.init(comm=comm, heap_size=64 << 20, timeout_s=float(
            os.environ.get("ROCMOE_TIMEOUT_S", 30)))
        return gpu.ContextArena(ctx), ctx.device
    torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else comm.Get_rank())
    return gpu.TorchIpcArena(comm, nbytes=256 << 20), torch.device("cuda", torch.cuda.current_device())


def check_gemm(arena, device, dtype, calls, rank, world):
    for call in range(calls):
        g = torch.Generator().manual_seed(1000 + call)
        k, n = 24 + call, 40
        counts = torch.randint(0, 20, (world, world), generator=g)
        if world > 1:
            counts[0, world - 1] = 0  # an empty slice is always present
        xs = [torch.randn(int(counts[s].sum()), k, generator=g) for s in range(world)]
        ws = [torch.randn(k, n, generator=g) for _ in range(world)]
        x = xs[rank].to(device, dtype)
        w = ws[rank].to(device, dtype)
        out = torch.full((1,), float("nan"))
        out = gpu.gemm_all_to_all(arena, x, w, counts[rank].tolist())
        # reference: every source's rows for this rank, in source order
        parts = []
        for s in range(world):
            start = int(counts[s, :rank].sum())
            y = xs[s].to(dtype).double() @ ws[s].to(dtype).double()
            parts.append(y[start:start + int(counts[s, rank])])
        ref = torch.cat(parts)
        print(f"rank {rank} call {call} done", flush=True) if os.environ.get("DEBUG") else None
        assert out.shape == ref.shape, (out.shape, ref.shape)
        if ref.numel():
            e = rel_err(out, ref)
            assert e < TOL[dtype], f"rank {rank} call {call}: relative error {e}"


def check_gemm_grouped(arena, device, dtype, calls, rank, world):
    # grouped products: W [G, K, N], segment (d, g) of the rows multiplied by W[g]; empty
    # segments, and an empty destination, among them
    for call in range(calls):
        g = torch.Generator().manual_seed(2000 + call)
        groups, k, n = 3, 16 + 8 * call, 40
        counts = torch.randint(0, 9, (world, world, groups), generator=g)  # [src, dst, group]
        counts[:, :, 1] = 0  # a group with no rows anywhere
        if world > 1:
            counts[0, world - 1] = 0
        xs = [torch.randn(int(counts[s].sum()), k, generator=g) for s in range(world)]
        ws = [torch.randn(groups, k, n, generator=g) for _ in range(world)]
        out = gpu.gemm_all_to_all(arena, xs[rank].to(device, dtype), ws[rank].to(device, dtype),
                                  counts[rank].sum(1).tolist(),
                                  group_counts=counts[rank].tolist())
        parts = []
        for s in range(world):
            at = int(counts[s, :rank].sum())
            for grp in range(groups):
                rows = int(counts[s, rank, grp])
                x_seg = xs[s][at:at + rows].to(dtype).double()
                parts.append(x_seg @ ws[s][grp].to(dtype).double())
                at += rows
        ref = torch.cat(parts)
        assert out.shape == ref.shape, (out.shape, ref.shape)
        if ref.numel():
            e = rel_err(out, ref)
            assert e < TOL[dtype], f"rank {rank} call {call}: relative error {e}"


def check_embedding(arena, device, dtype, calls, rank, world):
    for call in range(calls):
        g = torch.Generator().manual_seed(2000 + call)
        dim = 16 + 8 * (call % 2)
        counts = [1 + (s + call) % 3 for s in range(world)]
        counts[world - 1] = 0 if world > 1 and call % 2 else counts[world - 1]  # a rank with no tables
        b = 4 * world
        mode = "mean" if call % 3 == 2 else "sum"
        use_psw = mode == "sum" and call % 2 == 1
        tables, idxs, offs, psws = [], [], [], []
        for s in range(world):
            for t in range(counts[s]):
                rows = 50 + 7 * t
                lens = torch.randint(0, 5, (b,), generator=g)
                lens[0] = 0  # an empty bag
                tables.append(torch.randn(rows, dim, generator=g))
                idxs.append(torch.randint(0, rows, (int(lens.sum()),), generator=g))
                offs.append(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]]))
                psws.append(torch.rand(int(lens.sum()), generator=g))
        base = sum(counts[:rank])
        mine = range(base, base + counts[rank])
        out = gpu.embedding_all_to_all(
            arena, [tables[i].to(device, dtype) for i in mine],
            [idxs[i].to(device) for i in mine], [offs[i].to(device) for i in mine], mode,
            [psws[i].to(device) for i in mine] if use_psw else None, batch=b)
        bl = b // world
        ref = torch.zeros(bl, sum(counts), dim, dtype=torch.float64)
        for t in range(sum(counts)):
            bag = torch.nn.functional.embedding_bag(
                idxs[t], tables[t].to(dtype).double(), offs[t], mode=mode,
                per_sample_weights=psws[t].double() if use_psw else None)
            ref[:, t] = bag[rank * bl:(rank + 1) * bl]
        assert out.shape == ref.shape, (out.shape, ref.shape)
        e = rel_err(out, ref)
        assert e < TOL[dtype], f"rank {rank} call {call}: relative error {e}"


def check_gemv(arena, device, dtype, calls, rank, world):
    for call in range(calls):
        g = torch.Generator().manual_seed(3000 + call)
        n = 37 + 64 * call
        ks = [16 + 8 * s for s in range(world)]
        wsx = [(torch.randn(n, k, generator=g), torch.randn(k, generator=g)) for k in ks]
        w, x = wsx[rank]
        out = gpu.gemv_all_reduce(arena, w.to(device, dtype), x.to(device, dtype))
        ref = sum(a.to(dtype).double() @ v.to(dtype).double() for a, v in wsx)
        e = rel_err(out, ref)
        assert e < TOL[dtype], f"rank {rank} call {call}: relative error {e}"


def check_gemm_timeout(arena, device, dtype, calls, rank, world):
    # rank 0 calls once more than the others: its wait for their slices must time out
    x = torch.randn(world * 2, 8).to(device, dtype)
    w = torch.randn(8, 8).to(device, dtype)
    plan = gpu.plan_gemm(arena, x.shape[0], 8, [2] * world, gpu.gemm_config(device))
    gpu.gemm_all_to_all(arena, x, w, [2] * world, plan=plan)
    if rank == 0:
        try:  # with the plan given, no host collective: the device-side wait must time out
            gpu.gemm_all_to_all(arena, x, w, [2] * world, plan=plan)
        except errors.CommTimeoutError as exc:
            print(f"RANK {rank} TIMEOUT {exc}", flush=True)
            return
        raise AssertionError("rank 0 did not time out")
    # The others reach the closing barrier at once; bounded by the same timeout as rank 0's
    # wait, it would expire just as rank 0 arrives (on a loaded machine, first). Let rank 0's
    # wait run out before they start theirs.
    time.sleep(float(os.environ.get("ROCMOE_TIMEOUT_S", 30)))


def check_bad_counts(arena, device, dtype, calls, rank, world):
    # rank 1's counts do not add up to its rows: every rank must raise, none may hang
    x = torch.randn(world * 2, 8).to(device, dtype)
    w = torch.randn(8, 8).to(device, dtype)
    counts = [2] * world
    if rank == 1:
        counts[0] = 3
    try:
        gpu.gemm_all_to_all(arena, x, w, counts)
    except errors.InvalidArgumentError as exc:
        print(f"RANK {rank} REJECTED {exc}", flush=True)
        return
    raise AssertionError("bad counts were accepted")


def check_gemv_mismatch(arena, device, dtype, calls, rank, world):
    # rank 0 passes a different N: every rank must raise before any kernel runs
    n = 8 + (1 if rank == 0 else 0)
    try:
        gpu.gemv_all_reduce(arena, torch.randn(n, 4).to(device, dtype), torch.randn(4).to(device, dtype))
    except errors.InvalidArgumentError as exc:
        print(f"RANK {rank} REJECTED {exc}", flush=True)
        return
    raise AssertionError("mismatched N was accepted")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("arena")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dtype", default="fp32")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    arena, device = make_arena(a.arena, comm)
    checks = {"gemm": check_gemm, "gemm_grouped": check_gemm_grouped,
              "embedding": check_embedding, "gemv": check_gemv,
              "gemm_timeout": check_gemm_timeout, "bad_counts": check_bad_counts,
              "gemv_mismatch": check_gemv_mismatch}
    # several ops / dtypes in one process: a GPU job pays MPI + CUDA start-up once
    # a failing op / dtype is reported and the next one still runs: one GPU job shows every
    # problem at once (the exit status still says that something failed)
    failed = 0
    for op in a.op.split(","):
        for dname in a.dtype.split(","):
            try:
                checks[op](arena, device, DTYPES[dname], a.calls, rank, world)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception:
                import traceback
                failed += 1
                print(f"RANK {rank} FAIL {op} {dname}:\n{traceback.format_exc()}", flush=True)
                continue
            print(f"RANK {rank} OK {op} {dname}", flush=True)
    arena.barrier()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
