"""Where a DroplessMoE step's host time goes, stage by stage, next to the grouped-GEMM
layer's (GPU machine). Each stage's host wall time is summed over steps run while the GPU
is kept busy by a long sleep queued first (so the host never waits for it): the Python,
checks and launches alone. Then the host cost of single operations the step is made of: a
FastKernel launch, torch.empty, a Triton TensorDescriptor, the interpreter check.

    python3 benchmarks/probe_layer_host.py [T,H,F,E] [--steps N]

Prints one JSON line per shape: us per step for each stage, and the micro costs in us.
"""

import argparse
import gc
import json
import time

import torch

from rocmoe.bench.fused_gpu import host_us as fused_host_us
from rocmoe.bench.draws import router_inputs
from rocmoe.moe import DroplessMoE
from rocmoe.moe import blocksparse as bs
from rocmoe.moe.layer import expert_ffn, route_and_permute, unpermute_combine
from rocmoe.moe.reference import grouped_gemm_moe


def _busy(ms: float) -> None:
    torch.cuda._sleep(int(ms * 2e6))  # ~2 cycles a ns on an H200: a rough, long sleep


def staged(step, steps: int, batch: int = 8) -> dict:
    """us per step of each stage `step(mark)` marks, the GPU busy all along."""
    totals: dict = {}
    done = 0
    while done < steps:
        torch.cuda.synchronize()
        _busy(60.0)
        for _ in range(min(batch, steps - done)):
            last = [time.perf_counter()]

            def mark(name):
                now = time.perf_counter()
                totals[name] = totals.get(name, 0.0) + now - last[0]
                last[0] = now
            step(mark)
            done += 1
    torch.cuda.synchronize()
    return {k: round(v * 1e6 / steps, 1) for k, v in totals.items()}


def host_us(fn, calls: int = 200, launches: int = 1) -> float:
    """Host us a call of `fn` (`launches` GPU launches each) with the GPU kept busy (the
    fused-op bench's measure). The calls are capped at 500 launches, half the driver's
    queue of pending launches (~1000): past it the host waits for the busy GPU,
    and the time measured is the GPU's (200 calls of the 5-launch router forward read 528
    us a call on the H200, ~0.1 s of busy kernel over 200 calls). launches=0: no cap."""
    return round(fused_host_us(fn, min(calls, 500 // launches) if launches else calls), 2)


def probe(shape, steps: int) -> dict:
    tokens, hidden, ffn, experts = shape
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    layer = DroplessMoE(hidden, ffn, experts, 2, device=dev, dtype=dtype)
    gen = torch.Generator(device=dev).manual_seed(1)
    x, _ = router_inputs(layer.router.weight, tokens, 2, "uniform", gen)
    x.requires_grad_(True)
    gy = torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=gen)
    params = [x, layer.router.weight, layer.w1, layer.w2]
    gather = bs.KERNEL_CONFIG["gather_rows"]

    def ours(mark):
        ids, weights = layer.router.route(x)
        mark("router")
        with torch.no_grad():
            plan, topo, x_perm = route_and_permute(
                x, ids, experts, layer.block_size, ffn, copy_rows=gather is not True,
                compact_values=bs.KERNEL_CONFIG["compact_values"])
        mark("route_and_permute")
        y_perm = expert_ffn(x, layer.w1, layer.w2, None, topo, layer.activation, plan=plan,
                            rows=x_perm, keep_rows=gather is False)
        mark("ffn_forward")
        y = unpermute_combine(y_perm, weights, plan)
        mark("combine")
        torch.autograd.grad(y, params, gy)
        mark("backward")
        layer.router.aux_loss = None

    def base(mark):
        ids, weights = layer.router.route_reference(x)
        mark("router")
        y = grouped_gemm_moe(x, ids, weights, layer.w1, layer.w2)
        mark("layer_forward")
        torch.autograd.grad(y, params, gy)
        mark("backward")
        layer.router.aux_loss = None

    for fn in (ours, base):  # compile, warm up
        for _ in range(3):
            fn(lambda name: None)
    rec = dict(shape=list(shape), ours_us=staged(ours, steps), base_us=staged(base, steps))
    # the same steps with Python's garbage collector off: whether a stage's host time is
    # collections that the allocations of the steps before it triggered
    gc.collect()
    gc.disable()
    try:
        rec["ours_us_gc_off"] = staged(ours, steps)
    finally:
        gc.enable()
    rec["ours_router_parts_us"] = staged(router_parts_step(layer, x, ours), steps)
    rec["ours_total_us"] = round(sum(rec["ours_us"].values()), 1)
    rec["base_total_us"] = round(sum(rec["base_us"].values()), 1)
    return rec


def router_parts_step(layer, x, step):
    """`step` with its router stage split the way Router.route runs it (the check, the
    jitter, the fused autograd node, keeping the counts and the aux loss): inside the
    layer's step the router's forward took 329-351 us of host on the H200 against 118 us
    called alone, and this says which part the difference sits in."""
    from rocmoe.moe.router import check_tokens
    from rocmoe.moe.router_fused import fused_route
    r = layer.router

    def routed(mark):
        check_tokens(x, r.hidden_size)
        mark("router_check")
        xj = r._jittered(x)
        mark("router_jitter")
        ids, weights, aux, counts = fused_route(xj, r.weight, r.top_k, r.renormalize,
                                                r.load_balancing_coef, r.z_loss_coef)
        mark("router_fused_apply")
        r.tokens_per_expert, r.aux_loss = counts, aux
        mark("router_store")
        return ids, weights

    def parts(mark):
        r.route = lambda _x: routed(mark)
        try:
            step(mark)
        finally:
            del r.route  # the class's method again
    return parts


def micro() -> dict:
    from rocmoe._triton import interpreting, tensor_descriptor
    from rocmoe.moe import kernels
    dev = torch.device("cuda")
    t, h = 4096, 1024
    rows = torch.randn(t * 2, h, device=dev, dtype=torch.bfloat16)
    dest = torch.randint(0, t * 2, (t, 2), device=dev)
    out = torch.empty(t, h, device=dev, dtype=torch.bfloat16)
    launcher = kernels.launch("combine_kernel")

    def combine():
        launcher[(t // 32, h // 128)](rows, rows, dest, out, t, h, 2, rows.stride(0),
                                      out.stride(0), BLOCK_T=32, BLOCK_H=128, WEIGHTED=False)
    combine()
    jit = kernels.get("combine_kernel")

    def combine_jit():
        jit[(t // 32, h // 128)](rows, rows, dest, out, t, h, 2, rows.stride(0),
                                 out.stride(0), BLOCK_T=32, BLOCK_H=128, WEIGHTED=False)
    a = torch.randn(h, h, device=dev, dtype=torch.bfloat16)
    return dict(
        fast_launch_combine=host_us(combine), jit_launch_combine=host_us(combine_jit),
        torch_add=host_us(lambda: torch.add(a, a)),
        torch_empty=host_us(lambda: torch.empty(t, h, device=dev, dtype=torch.bfloat16),
                            launches=0),
        tensor_descriptor=host_us(lambda: tensor_descriptor(a, h, h, h, [64, 64]), launches=0),
        interpreting=host_us(interpreting, 2000, launches=0),
        kernels_launch_lookup=host_us(lambda: kernels.launch("combine_kernel"), 2000,
                                      launches=0),
        **router_micro(dev))


def router_micro(dev) -> dict:
    """Host us of the fused router's forward and of its parts (8192 tokens, 1024 wide, 64
    experts, top-2, bf16), and of the torch router's forward."""
    from rocmoe.moe import Router
    from rocmoe.moe.router_fused import fused_route
    r = Router(1024, 64, 2).to(dev, torch.bfloat16)
    x = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = r.weight
    return dict(
        router_route=host_us(lambda: r.route(x), launches=6),
        router_reference=host_us(lambda: r.route_reference(x), launches=30),
        router_apply=host_us(lambda: fused_route(x, w, 2, True, 0.01, 0.001), launches=6),
        router_gate_matmul=host_us(lambda: x.float() @ w.float().t(), launches=3),
        empty_small=host_us(lambda: torch.empty(8192, 2, dtype=torch.int32, device=dev),
                            launches=0),
        **router_forward_parts(x, w))


def router_forward_parts(x, w) -> dict:
    """Host us of each step of the fused router's forward (router_fused._FusedRoute), run
    alone without autograd: where its time goes."""
    from rocmoe.moe import kernels
    from rocmoe.moe.router_fused import _plan
    t, e, dev = x.shape[0], w.shape[0], x.device
    plan = _plan(t, e, 2, True, 0.01, 0.001, dev)
    with torch.no_grad():
        logits = x.float() @ w.float().t()
        ids = torch.empty(t, 2, dtype=torch.int32, device=dev)
        wts = torch.empty(t, 2, dtype=x.dtype, device=dev)
        lse = torch.empty(t, dtype=torch.float32, device=dev)
        part_counts = torch.empty(plan.nprog, plan.e_pow2, dtype=torch.int32, device=dev)
        part = torch.empty(plan.nprog, plan.e_pow2 + 1, dtype=torch.float32, device=dev)
        counts = torch.empty(e, dtype=torch.int32, device=dev)
        aux = torch.empty((), dtype=torch.float32, device=dev)
        topk = kernels.launch("router_topk_kernel")
        aux_k = kernels.launch("router_aux_kernel")

        def launch_topk():
            topk[(plan.nprog,)](logits, ids, wts, lse, part_counts, part, t, e,
                                logits.stride(0), plan.nprog, **plan.consts)

        def launch_aux():
            aux_k[(1,)](part_counts, part, counts, aux, t, e, plan.nprog, **plan.aux_consts)
        from rocmoe import native_launch
        launch_topk()
        launch_aux()
        before = dict(native_launch.stats)
        parts = dict(
            part_plan=host_us(lambda: _plan(t, e, 2, True, 0.01, 0.001, dev), launches=0),
            part_x_float=host_us(lambda: x.float()),
            part_matmul=host_us(lambda: x.float() @ w.float().t(), launches=3),
            part_empties=host_us(lambda: [torch.empty(t, 2, dtype=torch.int32, device=dev)
                                          for _ in range(7)], launches=0),
            part_launch_topk=host_us(launch_topk),
            part_launch_aux=host_us(launch_aux))
        parts["part_launches"] = {k: native_launch.stats[k] - before[k] for k in before}
        parts["part_refusal"] = native_launch.last_refusal
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="?", default="8192,1024,4096,64;4096,2048,1408,64")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    for s in args.shapes.split(";"):
        print(json.dumps(probe(tuple(int(v) for v in s.split(",")), args.steps)), flush=True)
    print(json.dumps(dict(micro_us=micro())), flush=True)


if __name__ == "__main__":
    main()
