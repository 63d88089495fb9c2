"""Where the expert-parallel step's local FFN time goes, on one GPU.

Why this exists: on 2 x H200 the whole expert-parallel DroplessMoE step on the fused-op handles
ran at 0.77 and 0.44 of the same layer moving tokens with all_to_all_single around its
block-sparse FFN (results/multi_gpu_h200x2_seventeenth_session_moe_zipf.jsonl). The handle
step computes its experts with the project's grouped GEMM kernels (gpu.grouped_local: since
the nineteenth session grouped_tiles_kernel from a device task table, before it the
GemmAllToAll kernel in local mode; and gpu.grouped_weight_grad), the baseline with the
block-sparse kernels. This times the three ways to compute the same rows, forward +
backward, on the rows one rank of that run received: the grouped kernels as the handle step
calls them (grid bounded by the step's worst-case row count), the block-sparse FFN
(`local_experts`, one expert a row, weight 1), and torch._grouped_mm on the same rows.

    python3 benchmarks/probe_ep_ffn.py [--shapes T,H,F,E;...] [--world 2] [--reps 10]
                                       [--products] [--weight-grad]
    python3 benchmarks/probe_ep_ffn.py --device cpu --shapes 64,32,48,8 --reps 2   # dry run

T tokens a rank, E experts in all (E / world on a rank), top-2, Zipf(1.0) routing: rank 0's
experts get their expected share of the world x T x 2 pairs. One JSON line per shape and
path: fwd and fwd+bwd ms (CUDA events, median), and the ratio to the block-sparse FFN."""

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rocmoe.bench.timing import interleaved_ms  # noqa: E402
from rocmoe.moe.activations import ACTIVATIONS  # noqa: E402

SHAPES = [(8192, 1024, 4096, 64), (8192, 4096, 1408, 64)]


def rank0_counts(tokens, experts, world, top_k=2):
    """Rows each of rank 0's experts gets: the expected Zipf(1.0) share of all pairs."""
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    p = p / p.sum()
    local = experts // world
    pairs = world * tokens * top_k
    counts = torch.floor(p[:local] * pairs).to(torch.int64)
    return counts


def products(a, x, w1, w2, counts, to_gm, act, t, h, f, e):
    """Each of the two products alone, forward: the grouped kernel (gpu.grouped_local) under
    tile configs (ROCMOE_GROUPED_CONFIG), torch._grouped_mm on group-major rows, and
    torch._grouped_mm behind the permutation the handle step would need (its rows arrive
    source-major from two sources, each expert's rows split between them: `to_gm`, their
    group-major positions, as main() makes them)."""
    from rocmoe.ops import gpu
    status = torch.zeros(64, dtype=torch.int32, device=x.device)
    dev_counts = counts.to(x.device).view(1, -1)
    offs = torch.cumsum(counts.to(x.device), 0).to(torch.int32)
    hmid = act(torch._grouped_mm(x, w1, offs=offs))
    x_sm = x.index_select(0, to_gm)  # x laid out source-major

    def permuted(xin, w):
        xg = torch.empty_like(xin).index_copy_(0, to_gm, xin)
        y = torch._grouped_mm(xg, w, offs=offs)
        return y.index_select(0, to_gm)

    cases = {}
    # (label, ROCMOE_GROUPED_CONFIG): the default is the platform's grouped tile
    # (triton_gemm_a2a.grouped_config) with the widest N tile that divides N, TMA loads and
    # the task loop flattened; an override without BLOCK_N keeps the narrowed width
    for label, override in (("default", None),
                            ("default no TMA", '{"USE_TMA": false}'),
                            ("not flattened", '{"FLATTEN": false}'),
                            ("128x256x64 s3", '{"BLOCK_N": 256, "num_stages": 3}')):
        def gl(xin, w, override=override):
            if override is None:
                os.environ.pop("ROCMOE_GROUPED_CONFIG", None)
            else:
                os.environ["ROCMOE_GROUPED_CONFIG"] = override
            return gpu.grouped_local(xin, w, dev_counts, status.data_ptr())
        cases[f"grouped_local {label} W1"] = lambda gl=gl: gl(x, w1)
        cases[f"grouped_local {label} W2"] = lambda gl=gl: gl(hmid, w2)
        if label in ("default", "not flattened"):
            # the backward's dX products, W transposed (since the nineteenth session a
            # descriptor of W's stored transpose, TRANS_W, where TMA is used; the
            # eighteenth session's files ran them by pointers)
            cases[f"grouped_local {label} dX through W1^T"] = \
                lambda gl=gl: gl(hmid, w1.transpose(1, 2))
            cases[f"grouped_local {label} dX through W2^T"] = \
                lambda gl=gl: gl(x, w2.transpose(1, 2))
    cases["_grouped_mm W1"] = lambda: torch._grouped_mm(x, w1, offs=offs)
    cases["_grouped_mm W2"] = lambda: torch._grouped_mm(hmid, w2, offs=offs)
    cases["permute + _grouped_mm + unpermute W1"] = lambda: permuted(x_sm, w1)
    cases["permute + _grouped_mm + unpermute W2"] = lambda: permuted(hmid, w2)
    with torch.no_grad():
        for fn in cases.values():
            fn()
        torch.cuda.synchronize()
        ms = interleaved_ms({k: (lambda: None, fn) for k, fn in cases.items()}, rounds=a.reps,
                            calls=2)
    os.environ.pop("ROCMOE_GROUPED_CONFIG", None)
    flops = 2 * int(counts.sum()) * h * f
    for k, v in ms.items():
        print(json.dumps(dict(probe="ep_ffn_product", shape=dict(tokens_per_rank=t, hidden=h,
                                                                 ffn=f, experts=e), case=k,
                              ms=round(v, 4), tflops=round(flops / v / 1e9, 1))), flush=True)


# grouped_weight_grad configs (ROCMOE_DW_CONFIG), the first the built-in default (since the
# eighteenth session 128 x 128 x 64, 4 warps, 3 stages, tiles first)
def _dw_config(block_k, block_n, block_m, warps, stages=None, tiles_first=True):
    """(label, ROCMOE_DW_CONFIG entries) of one weight-gradient tile config."""
    label = (f"{block_k}x{block_n}x{block_m} w{warps}" + (f" s{stages}" if stages else "")
             + (" tiles first" if tiles_first else " groups first"))
    cfg = dict(BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_M=block_m, TILES_FIRST=tiles_first,
               num_warps=warps)
    if stages:
        cfg["num_stages"] = stages
    return label, cfg


DW_CONFIGS = {"default": None, **dict(_dw_config(*c, **kw) for c, kw in (
    ((64, 64, 64, 4), dict(tiles_first=False)),
    ((64, 64, 64, 4), {}),
    ((128, 128, 64, 8, 3), {}),
    ((128, 128, 32, 8, 4), {}),
    ((128, 128, 64, 4, 4), {}),
    ((128, 128, 32, 4, 4), {}),
    ((128, 256, 64, 4, 3), {}),
    ((128, 256, 64, 8, 3), {}),
    ((256, 128, 64, 8, 3), {}),
    ((128, 128, 64, 8, 3), dict(tiles_first=False))))}


def weight_grads(a, x, w1, counts, to_gm, t, h, f, e):
    """dW of the first product (X^T dH, [E, H, F]) alone: gpu.grouped_weight_grad under
    tile configs, on rows source-major from a.world sources (each expert's rows split
    between them, as the handle step receives them), against torch._grouped_mm's
    weight-gradient form (X^T dH with offsets along the rows) on the same rows group-major,
    the form torch's own autograd of _grouped_mm runs."""
    import json
    from rocmoe.ops import gpu
    dev = x.device
    g = torch.Generator(device=dev).manual_seed(1)
    gh = torch.randn(x.shape[0], f, device=dev, generator=g).to(torch.bfloat16)
    two = torch.stack([counts // 2, counts - counts // 2]).to(dev)
    x_sm, gh_sm = x.index_select(0, to_gm), gh.index_select(0, to_gm)
    offs = torch.cumsum(counts.to(dev), 0).to(torch.int32)
    want = torch._grouped_mm(x.t(), gh, offs=offs).float()
    cases, errs = {}, {}
    for label, cfg in DW_CONFIGS.items():
        def run(cfg=cfg):
            if cfg is None:
                os.environ.pop("ROCMOE_DW_CONFIG", None)
            else:
                os.environ["ROCMOE_DW_CONFIG"] = json.dumps(cfg)
            return gpu.grouped_weight_grad(x_sm, gh_sm, two, w1.shape[0], torch.bfloat16)
        try:
            got = run().float()
            errs[label] = float((got - want).norm() / want.norm())
            cases[label] = run
        except Exception as exc:  # noqa: BLE001 - a config that does not build is a result
            errs[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
    cases["torch._grouped_mm weight-grad form (group-major rows)"] = \
        lambda: torch._grouped_mm(x.t(), gh, offs=offs)
    errs["torch._grouped_mm weight-grad form (group-major rows)"] = 0.0
    with torch.no_grad():
        torch.cuda.synchronize()
        ms = interleaved_ms({k: (lambda: None, fn) for k, fn in cases.items()}, rounds=a.reps,
                            calls=2)
    os.environ.pop("ROCMOE_DW_CONFIG", None)
    flops = 2 * int(counts.sum()) * h * f
    for k in errs:
        rec = dict(probe="ep_ffn_weight_grad", shape=dict(tokens_per_rank=t, hidden=h, ffn=f,
                                                          experts=e, world=a.world),
                   case=k, rel_err_vs_grouped_mm=errs[k])
        if k in ms:
            rec.update(ms=round(ms[k], 4), tflops=round(flops / ms[k] / 1e9, 1))
        print(json.dumps(rec), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--products", action="store_true",
                    help="also time each product alone under a few tile configs")
    ap.add_argument("--weight-grad", action="store_true",
                    help="also time the weight gradient alone under a few tile configs")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of the script on the host backend (tiny shapes)")
    a = ap.parse_args(argv)
    import rocmoe
    from rocmoe.moe.handle_transport import grouped_products
    from rocmoe.moe import grouped_ffn as gf
    from rocmoe.moe.layer import local_experts
    dev = torch.device(a.device)
    ctx = rocmoe.init(backend="ipc" if a.device == "cuda" else "host", heap_size=1 << 30)
    transport = types.SimpleNamespace(ctx=ctx)  # what grouped_products reads of a transport
    act = ACTIVATIONS["gelu"]
    for spec in a.shapes.split(";"):
        t, h, f, e = (int(v) for v in spec.split(","))
        counts = rank0_counts(t, e, a.world)
        local = counts.numel()
        rows = int(counts.sum())
        capacity = a.world * t * 2  # the most rows a rank can receive in the step
        g = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(rows, h, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        w1 = (torch.randn(local, h, f, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(local, f, h, device=dev, generator=g) / f ** 0.5).to(torch.bfloat16)
        gy = torch.randn(rows, h, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.repeat_interleave(torch.arange(local, device=dev, dtype=torch.int32),
                                      counts.to(dev)).view(-1, 1)
        ones = torch.ones(rows, 1, device=dev, dtype=torch.bfloat16)
        dev_counts = counts.to(dev).view(1, local)
        offs = torch.cumsum(counts.to(dev), 0).to(torch.int32)
        xr = x.clone().requires_grad_(True)
        p1, p2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)

        def grouped_kernels():
            hmid = act(grouped_products(xr, p1, dev_counts, transport))
            return grouped_products(hmid, p2, dev_counts, transport)

        def block_sparse():
            return local_experts(xr, ids, ones, p1, p2, None, 128, "gelu")

        def grouped_mm():
            return torch._grouped_mm(act(torch._grouped_mm(xr, p1, offs=offs)), p2, offs=offs)

        # the grouped_mm combine's FFN: arrivals source-major from two sources (each expert's
        # rows split between them), regrouped, torch._grouped_mm, back to arrival order
        two = torch.stack([counts // 2, counts - counts // 2]).to(dev)
        to_gm = gf.group_major_positions(two, rows)
        xs = x.index_select(0, to_gm).clone().requires_grad_(True)

        def grouped_mm_combine():
            return gf.source_major_ffn(xs, two, p1, p2, None, act)

        paths = {"grouped_kernels (handle step)": grouped_kernels,
                 "source_major_ffn (grouped_mm combine)": grouped_mm_combine,
                 "block_sparse (baseline step)": block_sparse,
                 "torch._grouped_mm": grouped_mm}
        ref = block_sparse()
        for q in (xr, p1, p2):
            q.grad = None
        ref.backward(gy)
        ref_grads = [q.grad.float().clone() for q in (xr, p1, p2)]
        ref = ref.detach().float()
        fwd, both, errs, grad_errs = {}, {}, {}, {}
        for name, fn in paths.items():
            try:
                y = fn()
                want = ref.index_select(0, to_gm) if fn is grouped_mm_combine else ref
                errs[name] = float((y.detach().float() - want).norm() / want.norm())
                for p in (xr, xs, p1, p2):
                    p.grad = None
                y.backward(gy.index_select(0, to_gm) if fn is grouped_mm_combine else gy)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                # gradients against the block-sparse FFN's (dX back in group-major order)
                dx = (torch.empty_like(xs.grad).index_copy_(0, to_gm, xs.grad)
                      if fn is grouped_mm_combine else xr.grad)
                grad_errs[name] = [round(float((got.float() - want).norm() / want.norm()), 6)
                                   for got, want in zip((dx, p1.grad, p2.grad), ref_grads)]

                def step(fn=fn):
                    for p in (xr, xs, p1, p2):
                        p.grad = None
                    fn().backward(gy)

                def forward(fn=fn):
                    with torch.no_grad():
                        fn()
                fwd[name] = (lambda: None, forward)
                both[name] = (lambda: None, step)
            except Exception as exc:  # noqa: BLE001 - a path that does not run is a result
                errs[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if a.products and dev.type == "cuda":
            products(a, x, w1, w2, counts, to_gm, act, t, h, f, e)
        if a.weight_grad and dev.type == "cuda":
            weight_grads(a, x, w1, counts, to_gm, t, h, f, e)
        f_ms = interleaved_ms(fwd, rounds=a.reps, calls=2)
        b_ms = interleaved_ms(both, rounds=a.reps, calls=2)
        base = "block_sparse (baseline step)"
        flops = 2 * rows * h * f * 2
        for name in paths:
            rec = dict(probe="ep_ffn", shape=dict(tokens_per_rank=t, hidden=h, ffn=f, experts=e,
                                                  world=a.world), rows=rows, local_experts=local,
                       largest_expert_rows=int(counts.max()), capacity=capacity, path=name,
                       rel_err_vs_block_sparse=errs.get(name),
                       grad_rel_err_vs_block_sparse=dict(zip(("x", "w1", "w2"),
                                                             grad_errs.get(name, []))))
            if name in b_ms:
                rec.update(fwd_ms=round(f_ms[name], 4), fwd_bwd_ms=round(b_ms[name], 4),
                           fwd_tflops=round(flops / f_ms[name] / 1e9, 1),
                           fwd_ratio_vs_block_sparse=round(f_ms[base] / f_ms[name], 3),
                           fwd_bwd_ratio_vs_block_sparse=round(b_ms[base] / b_ms[name], 3))
            print(json.dumps(rec), flush=True)
    ctx.finalize()


if __name__ == "__main__":
    main()
