"""Where the MoE layer's time goes (GPU machine): host launches, or GPU time per kernel.

    python benchmarks/profile_moe_host.py [T,H,F,E] [--calls N] [--kernels]

Launches N layer steps back to back (the GPU runs behind) under cProfile and prints the
functions with the most cumulative and own host time, plus host ms per layer next to the
layer's GPU time. A layer whose host time approaches its GPU time is launch-bound.
With --kernels it instead runs them under torch.profiler and prints the GPU time of every
kernel per layer step (routing, the block-sparse products, combine, the optimizer-free rest).
"""

import argparse
import cProfile
import pstats
import time

import torch

from rocmoe.bench.moe import expert_inputs, make_routing
from rocmoe.bench.timing import host_ms_per_call, time_ms
from rocmoe.moe import blocksparse as bs
from rocmoe.moe import route_and_permute, unpermute_combine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8192,1024,4096,64")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--kernels", action="store_true", help="GPU time per kernel instead")
    ap.add_argument("--ffn", action="store_true",
                    help="host and GPU ms of the expert FFN alone (forward, forward+backward)")
    ap.add_argument("--trace", action="store_true",
                    help="with --ffn: when each kernel is launched and runs, from an idle GPU, "
                         "and the FFN forward's host functions under cProfile")
    args = ap.parse_args()
    tokens, hidden, ffn, experts = (int(v) for v in args.shape.split(","))
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen, x, w1, w2 = expert_inputs((tokens, hidden, ffn, experts), device, dtype)
    ids, weights = make_routing(tokens, experts, 2, "uniform", device, dtype, gen)
    x_g = x.clone().requires_grad_(True)
    gy = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)

    def layer():
        p, t, xp = route_and_permute(x_g, ids, experts, 128, ffn)
        y = unpermute_combine(bs.fused_expert_ffn(xp, w1, w2, t, "gelu"), weights, p)
        torch.autograd.grad(y, [x_g, w1, w2], gy)

    gpu_ms = time_ms(layer, 7)
    torch.cuda.synchronize()
    if args.ffn:
        _ffn_host_times(tokens, hidden, ffn, experts, x, w1, w2, ids, gen, args.calls,
                        args.trace)
        return
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as kprof:
            for _ in range(args.calls):
                layer()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / args.calls / 1e3, e.count // args.calls)
                for e in kprof.key_averages() if e.device_time_total > 0]
        print(f"layer time {gpu_ms:.3f} ms; GPU ms per layer step by kernel:")
        for name, ms, n in sorted(rows, key=lambda r: -r[1])[:30]:
            print(f"{ms:9.4f} ms  x{n:<3d} {name[:110]}")
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.calls):
        layer()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.calls
    torch.cuda.synchronize()
    print(f"host ms per layer (under cProfile) {host_ms:.3f}; layer time {gpu_ms:.3f} ms")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(35)
    stats.sort_stats("tottime").print_stats(25)


def _ffn_host_times(tokens, hidden, ffn, experts, x, w1, w2, ids, gen, calls, trace=False):
    """Host ms per call of the fused expert FFN launched back to back (the GPU runs behind,
    so this is the Python + launch work alone), the host ms until the call returns on an
    idle GPU, and the GPU ms per call (events around back-to-back calls)."""
    _, topo, xp = route_and_permute(x, ids, experts, 128, ffn)
    xg = xp.detach().requires_grad_(True)
    g = torch.randn(topo.num_rows, hidden, device=x.device, dtype=x.dtype, generator=gen)

    def fwd():
        with torch.no_grad():
            bs.fused_expert_ffn(xp, w1, w2, topo, "gelu")

    def fwdbwd():
        torch.autograd.grad(bs.fused_expert_ffn(xg, w1, w2, topo, "gelu"), [xg, w1, w2], g)

    for name, fn in (("ffn_fwd", fwd), ("ffn_fwdbwd", fwdbwd)):
        fn()
        torch.cuda.synchronize()
        idle = []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            idle.append((time.perf_counter() - t0) * 1e3)
        host = host_ms_per_call(fn, calls)
        gpu_ms = time_ms(fn, reps=1, warmup=0, calls=calls)
        print(f"{name}: host ms per call {host:.3f} (back to back), "
              f"{sorted(idle)[len(idle) // 2]:.3f} (from an idle GPU); "
              f"GPU ms per call {gpu_ms:.3f}")
        if trace:
            _trace_one_call(name, fn, calls)
    # the backward alone (forwards recorded first), and the autograd engine's own cost: a
    # trivial autograd.Function on the same device, forward and backward
    ys = [bs.fused_expert_ffn(xg, w1, w2, topo, "gelu") for _ in range(calls)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for y in ys:
        torch.autograd.grad(y, [xg, w1, w2], g)
    bwd = (time.perf_counter() - t0) * 1e3 / calls
    del ys
    torch.cuda.synchronize()

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, gt):
            return gt

    small = torch.ones(4, device=x.device, requires_grad=True)
    engine = host_ms_per_call(
        lambda: torch.autograd.grad(Identity.apply(small), [small], torch.ones_like(small)),
        calls)
    print(f"ffn backward alone: host ms per call {bwd:.3f}; "
          f"trivial autograd.Function fwd+bwd: {engine:.3f}")


def _trace_one_call(name, fn, calls):
    """Launch and run times (us from the call's start) of every kernel of one call of `fn` on
    an idle GPU, then the host functions of `calls` calls under cProfile."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type is not None]
    t0 = min(e.time_range.start for e in events)
    print(f"--- {name}: one call from an idle GPU (us from the first recorded event)")
    for e in sorted(events, key=lambda e: e.time_range.start):
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu or "Launch" in e.name or "launch" in e.name:
            print(f"{'GPU ' if on_gpu else 'host'} {e.time_range.start - t0:9.1f} "
                  f"+{e.time_range.end - e.time_range.start:8.1f}  {e.name[:90]}")
    print_host_profile(fn, calls, 18)


def print_host_profile(fn, calls, top):
    """The `top` host functions by own time over `calls` calls of `fn` (cProfile)."""
    stats = cProfile.Profile()
    stats.enable()
    for _ in range(calls):
        fn()
    stats.disable()
    torch.cuda.synchronize()
    pstats.Stats(stats).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
