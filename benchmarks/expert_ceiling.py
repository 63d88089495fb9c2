"""How close can any per-expert GEMM come to one dense GEMM on these shapes?

    python3 benchmarks/expert_ceiling.py [--shapes T,H,F,E;...] [--reps 11] [--output F.jsonl]

For each MoE shape (top-2), the six products of an expert FFN's forward and backward are
timed three ways, round-robin in the same run:

* ``dense``: ``torch.matmul`` on [T*k, .] rows against one shared weight (the baseline of
  ``ffn_*_vs_dense_matmul`` in ``rocmoe bench moe``);
* ``bmm``: cuBLAS ``torch.bmm`` with every expert given exactly T*k/E rows: perfectly
  balanced, no padding, no routing, no activation: the vendor's best case for E separate
  weights, i.e. the ceiling the data shape allows a per-expert GEMM;
* ``ours``: the rocmoe block-sparse kernel that computes the product in the layer (uniform
  routing, so its rows are padded to the block size where loads are uneven).

A record per product gives the three times and TFLOP/s (useful FLOPs 2*T*k*H*F each); a
``total`` record sums them. ``bmm`` over ``dense`` is what the shape itself costs; ``ours``
over ``bmm`` is what the kernels leave on the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from rocmoe.bench import emit as bench_emit
from rocmoe.bench.moe import DEFAULT_SHAPES, expert_inputs, kernel_calls, make_routing
from rocmoe.bench.timing import interleaved_ms


def products(pairs, hidden, ffn, experts, device, dtype, gen):
    """name -> (dense call, balanced bmm call) for the six products of one FFN step."""
    rows = pairs // experts
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=gen)  # noqa: E731
    xd, ad, gd, hd = r(pairs, hidden), r(pairs, ffn), r(pairs, hidden), r(pairs, ffn)
    w1d, w2d = r(hidden, ffn), r(ffn, hidden)
    xb, ab = r(experts, rows, hidden), r(experts, rows, ffn)
    gb, hb = r(experts, rows, hidden), r(experts, rows, ffn)
    w1b, w2b = r(experts, hidden, ffn), r(experts, ffn, hidden)
    return {
        # forward: h = x W1 (SDD), y = a W2 (DSD)
        "fwd_xw1": (lambda: xd @ w1d, lambda: torch.bmm(xb, w1b)),
        "fwd_aw2": (lambda: ad @ w2d, lambda: torch.bmm(ab, w2b)),
        # backward: da = g W2^T (SDD), dW2 = a^T g (DS^TD), dx = dh W1^T (DSD), dW1 = x^T dh
        "bwd_gw2t": (lambda: gd @ w2d.t(), lambda: torch.bmm(gb, w2b.transpose(1, 2))),
        "bwd_dw2": (lambda: ad.t() @ gd, lambda: torch.bmm(ab.transpose(1, 2), gb)),
        "bwd_dx": (lambda: hd @ w1d.t(), lambda: torch.bmm(hb, w1b.transpose(1, 2))),
        "bwd_dw1": (lambda: xd.t() @ hd, lambda: torch.bmm(xb.transpose(1, 2), hb)),
    }


# our kernel for each product under the "store" activation fusion (the shipped default)
OURS = {"fwd_xw1": "sdd_fwd_store_gelu", "fwd_aw2": "dsd_fwd", "bwd_gw2t": "sdd_bwd_scale",
        "bwd_dw2": "dstd_dw2", "bwd_dx": "dsd_dx", "bwd_dw1": "dstd_dw1"}


def run_shape(shape, reps, emit, top_k=2, block=128, device="cuda"):
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe import route_and_permute
    tokens, hidden, ffn, experts = shape
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, _ = make_routing(tokens, experts, top_k, "uniform", device, dtype, gen)
    pairs = tokens * top_k
    _, topo, x_perm = route_and_permute(x, ids, experts, block, ffn)
    grad = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)
    with torch.no_grad():
        ours = kernel_calls(bs, topo, x_perm, w1, w2, grad)
        cases = {}
        for name, (dense, bmm) in products(pairs, hidden, ffn, experts, device, dtype,
                                           gen).items():
            cases[f"{name}/dense"] = (lambda: None, dense)
            cases[f"{name}/bmm"] = (lambda: None, bmm)
            cases[f"{name}/ours"] = (lambda: None, ours[OURS[name]])
        for _, fn in cases.values():
            fn()
        t = interleaved_ms(cases, rounds=reps, calls=3, queued=True)
    flops = 2.0 * pairs * hidden * ffn
    total = dict(dense=0.0, bmm=0.0, ours=0.0)
    common = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                  rows_per_expert=pairs // experts,
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    for name in OURS:
        rec = dict(common, metric="expert_ceiling", product=name, kernel=OURS[name])
        for who in total:
            ms = t[f"{name}/{who}"]
            total[who] += ms
            rec[f"{who}_ms"] = round(ms, 4)
            rec[f"{who}_tflops"] = round(flops / ms / 1e9, 1)
        rec["bmm_over_dense"] = round(t[f"{name}/dense"] / t[f"{name}/bmm"], 3)
        rec["ours_over_bmm"] = round(t[f"{name}/bmm"] / t[f"{name}/ours"], 3)
        emit(rec)
    rec = dict(common, metric="expert_ceiling", product="total (fwd+bwd, no activation)")
    for who, ms in total.items():
        rec[f"{who}_ms"] = round(ms, 4)
        rec[f"{who}_tflops"] = round(6 * flops / ms / 1e9, 1)
    rec["bmm_over_dense"] = round(total["dense"] / total["bmm"], 3)
    rec["ours_over_bmm"] = round(total["bmm"] / total["ours"], 3)
    rec["ours_over_dense"] = round(total["dense"] / total["ours"], 3)
    emit(rec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="T,H,F,E;... (default: the six of rocmoe bench moe)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (fp32) for a dry run")
    p.add_argument("--output")
    args = p.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps({"metric": "expert_ceiling", "error": "needs a CUDA/ROCm device"}))
        return 2
    shapes = DEFAULT_SHAPES if not args.shapes else [
        tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip()]
    out = open(args.output, "a") if args.output else None
    emit = functools.partial(bench_emit, also_to=out)

    for shape in shapes:
        run_shape(shape, args.reps, emit, block=args.block_size, device=args.device)
        if args.device != "cpu":
            torch.cuda.empty_cache()
        print(f"# {shape} done", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
