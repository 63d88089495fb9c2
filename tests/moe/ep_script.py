"""Run under mpiexec: expert-parallel DroplessMoE equals the one-rank layer with the same weights.

Every rank builds the one-rank reference layer from the same seed and the whole global batch
(each rank's tokens come from a seed of their own), so each rank can check its own outputs,
input gradients and its experts' weight gradients without gathering anything.

Prints ``EP_OK rank=<r> ...`` on success; exits non-zero with the largest error otherwise.
"""

from __future__ import annotations

import argparse
import sys
import types

import torch
from mpi4py import MPI

from rocmoe.moe import DroplessMoE
from rocmoe.moe.parallel import combine_kind, transport_for


def make_context(kind: str, device: str):
    if kind == "runtime":
        import rocmoe
        if device == "cuda":  # the GPU heap; several ranks may share one GPU
            return rocmoe.init(backend="ipc", heap_size=64 << 20, device=0)
        return rocmoe.init(backend="host", heap_size=1 << 22)
    # The communicator-only context: what the MPI transport needs (rank, world, comm).
    comm = MPI.COMM_WORLD
    return types.SimpleNamespace(comm=comm, rank=comm.Get_rank(), world_size=comm.Get_size())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", choices=("runtime", "comm"), default="comm")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=24)
    ap.add_argument("--ffn", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=29)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--glu", action="store_true")
    ap.add_argument("--dtype", choices=("float64", "float32", "bfloat16"), default="float64",
                    help="float32: the fused gemm_all_to_all combine can run (it takes no "
                         "float64); bfloat16 on a GPU: torch._grouped_mm runs ('auto' picks "
                         "the grouped_mm combine)")
    ap.add_argument("--combine", default="auto")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: a GPU context (ipc heap) and the Triton kernels; the ranks "
                         "may share one GPU")
    ap.add_argument("--sync-debug", action="store_true",
                    help="cuda: after a warm-up step, run the checked step under "
                         "torch.cuda.set_sync_debug_mode('error'): a host sync fails it")
    ap.add_argument("--bad-rank", type=int, default=None,
                    help="this rank passes an input the layer rejects (--bad says how); every "
                         "rank must raise a RocmoeError, none may hang")
    ap.add_argument("--bad", choices=("width", "dtype", "other_float", "list", "combine"),
                    default="width",
                    help="dtype: int64 tokens; other_float: tokens of another float dtype than the "
                         "layer's; list: tokens as nested lists; combine: that rank's layer asks "
                         "for the fused combine with float64 weights")
    args = ap.parse_args(argv)

    ctx = make_context(args.ctx, args.device)
    dev = torch.device(args.device)
    rank, world = ctx.rank, ctx.world_size
    comm = MPI.COMM_WORLD
    # float64 is exact enough that any routing or indexing bug shows up; float32 (the fused
    # combine) is held to 1e-5 of the outputs' and gradients' scale (errors of one ulp
    # times the reduction lengths; a misplaced row is off by its whole value)
    dtype = getattr(torch, args.dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    if args.device == "cuda" and dtype != torch.float64:
        tol = 5e-3  # the one-rank reference's Triton kernels multiply fp32 in TF32
    if dtype == torch.bfloat16:
        tol = 3e-2  # bf16 rows between the products: a few ulps (2^-8) of the values

    torch.manual_seed(1234)
    ref = DroplessMoE(args.hidden, args.ffn, args.experts, args.top_k, glu=args.glu,
                      block_size=args.block_size).to(dev, dtype)
    ep = DroplessMoE(args.hidden, args.ffn, args.experts, args.top_k, glu=args.glu,
                     block_size=args.block_size, ctx=ctx, combine=args.combine).to(dev, dtype)
    e_local = args.experts // world
    mine = slice(rank * e_local, (rank + 1) * e_local)
    with torch.no_grad():
        ep.router.weight.copy_(ref.router.weight)
        ep.w1.copy_(ref.w1[mine])
        ep.w2.copy_(ref.w2[mine])
        if args.glu:
            ep.w3.copy_(ref.w3[mine])

    # Uneven token counts per rank (rank r has tokens + r) exercise unequal splits.
    xs, gs = [], []
    for r in range(world):
        gen = torch.Generator().manual_seed(100 + r)
        n = args.tokens + r
        xs.append(torch.randn(n, args.hidden, generator=gen, dtype=dtype).to(dev))
        gs.append(torch.randn(n, args.hidden, generator=gen, dtype=dtype).to(dev))

    x_ref = torch.cat(xs).requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * torch.cat(gs)).sum().backward()

    if args.bad_rank is not None:
        return reject(ep, xs[rank], rank, world, args, ctx)

    if args.sync_debug:
        # the first step makes the handles and tunes the kernels (that synchronises); then
        # a whole step, forward and backward, must not
        warm = xs[rank].clone().requires_grad_(True)
        (ep(warm) * gs[rank]).sum().backward()
        ep.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    (y * gs[rank]).sum().backward()
    if args.sync_debug:
        torch.cuda.set_sync_debug_mode("default")
        print(f"EP_NO_SYNC rank={rank}", flush=True)

    start = sum(t.shape[0] for t in xs[:rank])
    stop = start + xs[rank].shape[0]
    # numpy has no bfloat16: a 16-bit router's gradient is summed in float32
    grad = ep.router.weight.grad
    grad_dtype = grad.dtype
    router_grad = (grad if grad.dtype in (torch.float32, torch.float64) else grad.float()) \
        .cpu().clone()
    comm.Allreduce(MPI.IN_PLACE, router_grad.numpy(), op=MPI.SUM)  # data-parallel router
    router_grad = router_grad.to(dev, grad_dtype)
    checks = {
        "y": (y, y_ref[start:stop]),
        "dx": (x.grad, x_ref.grad[start:stop]),
        "dw1": (ep.w1.grad, ref.w1.grad[mine]),
        "dw2": (ep.w2.grad, ref.w2.grad[mine]),
        "drouter": (router_grad, ref.router.weight.grad),
    }
    if args.glu:
        checks["dw3"] = (ep.w3.grad, ref.w3.grad[mine])
    errors = {k: ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
              for k, (a, b) in checks.items()}
    bad = {k: v for k, v in errors.items() if not v < tol}
    worst = comm.allreduce(len(bad), op=MPI.SUM)
    if bad:
        print(f"EP_FAIL rank={rank} world={world} errors={bad}", flush=True)
    else:
        print(f"EP_OK rank={rank} world={world} ctx={args.ctx} "
              f"transport={type(transport_for(ctx)).__name__} combine={combine_kind(ep)} "
              f"local_tokens_per_expert={ep.tokens_per_expert.tolist()} "
              f"idle_experts_here={int((ref.tokens_per_expert[mine] == 0).sum())} "
              f"max_err={max(errors.values()):.2e}", flush=True)
    if args.ctx == "runtime":
        ctx.finalize()
    return 1 if worst else 0


def reject(ep, x, rank, world, args, ctx) -> int:
    from rocmoe.errors import RocmoeError
    if rank == args.bad_rank:
        if args.bad == "combine":
            ep.combine = "gemm_all_to_all"
        else:
            x = {"width": lambda: x[:, :-1], "dtype": lambda: x.to(torch.int64),
                 "other_float": lambda: x.to(torch.float32 if x.dtype == torch.float64
                                           else torch.float64),
                 "list": x.tolist}[args.bad]()
    try:
        ep(x)
    except RocmoeError as exc:
        print(f"EP_REJECTED rank={rank} world={world} error={type(exc).__name__}: {exc}",
              flush=True)
        if args.ctx == "runtime":
            ctx.finalize()
        return 0
    print(f"EP_FAIL rank={rank}: no error", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
