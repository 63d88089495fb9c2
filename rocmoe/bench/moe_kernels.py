"""Block-sparse kernel sweep: each kernel of the fused expert FFN alone, per tile config.

    python -m rocmoe.bench.moe_kernels [--shapes T,H,F,E;...] [--configs JSON] [--dump DIR]

Tuning tool behind ``blocksparse.KERNEL_CONFIG``: for every shape (uniform top-2 routing) and
every candidate config it prints one JSON line per kernel with its time and useful TFLOP/s
(2 * pairs * hidden * ffn per product), next to ``torch.matmul`` at the same FLOPs measured
in the same run. Both activation fusions are timed: "load" (DSD/DSᵀD apply GELU to the
sparse operand as they load it) and "store" (the forward SDD also writes GELU(h); the
products then run plain). ``--dump DIR`` writes the compiled Triton IR / assembly of every
kernel variant (what the pipeliner did) for offline reading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .moe import expert_inputs, kernel_calls, make_routing, sweep_config
from .timing import interleaved_ms

DEFAULT_CONFIGS = [
    # the shipped default (128x128 tiles, 4 warps, 3 stages; DSD with W as stored 128x256)
    dict(dsd=dict(block_n=256, num_warps=8, num_stages=4)),
    # the previous default: 128x256 tiles, 8 warps, pointer loads, exp/rcp epilogue
    dict(block_n=256, num_warps=8, num_stages=3, tma=False, fast_act=False,
         preload_scale=False),
    dict(block_n=256, num_warps=8, num_stages=4),
    dict(block_n=256, num_warps=8, num_stages=3),
    dict(block_n=128, num_warps=8, num_stages=3),
    dict(block_n=128, num_warps=4, num_stages=3, tma=False),
]


def dump_compiled(directory: str) -> int:
    """Write the IR and assembly of every compiled MoE kernel variant; returns how many."""
    from rocmoe.moe import kernels as K
    os.makedirs(directory, exist_ok=True)
    count = 0
    for name in K.names():
        fn = K.get(name)
        caches = []
        for per_device in getattr(fn, "device_caches", {}).values():
            caches.append(per_device[0] if isinstance(per_device, tuple) else per_device)
        if hasattr(fn, "cache"):
            caches.extend(fn.cache.values())
        for cache in caches:
            for i, compiled in enumerate(getattr(cache, "values", lambda: [])()):
                meta = getattr(compiled, "metadata", None)
                tag = f"{name}.{count}"
                for kind, text in getattr(compiled, "asm", {}).items():
                    if isinstance(text, str):
                        with open(os.path.join(directory, f"{tag}.{kind}"), "w") as f:
                            f.write(text)
                with open(os.path.join(directory, f"{tag}.meta.json"), "w") as f:
                    json.dump({k: (v if isinstance(v, (int, float, str, bool, type(None)))
                                   else str(v))
                               for k, v in (meta._asdict() if hasattr(meta, "_asdict")
                                            else vars(meta) if meta is not None else {}).items()},
                              f, indent=1)
                count += 1
    return count


def emit(out, rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        out.write(line + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="65536,1024,4096,64;8192,4096,1408,64")
    ap.add_argument("--configs", default=None,
                    help="JSON list of KERNEL_CONFIG overrides, each applied to the startup "
                         "config with its per-kernel overrides (sdd, dsd, dsd_wt, dstd) "
                         "cleared unless the entry sets them")
    ap.add_argument("--kernels", default=None,
                    help="comma list of kernel names to time (default: all of kernel_calls)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15, help="rounds of the interleaved timing")
    ap.add_argument("--dump", default=None, help="directory for the compiled kernels' IR")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"metric": "moe_kernels", "error": "needs a CUDA/ROCm device"}))
        return 2
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe import route_and_permute
    configs = json.loads(args.configs) if args.configs else DEFAULT_CONFIGS
    start = dict(bs.KERNEL_CONFIG)
    out = open(args.output, "a") if args.output else None
    device, dtype = torch.device("cuda"), torch.bfloat16
    for spec in args.shapes.split(";"):
        shape = tuple(int(v) for v in spec.split(","))
        tokens, hidden, ffn, experts = shape
        gen, x, w1, w2 = expert_inputs(shape, device, dtype)
        ids, _ = make_routing(tokens, experts, 2, "uniform", device, dtype, gen)
        plan, topo, x_perm = route_and_permute(x, ids, experts, args.block_size, ffn)
        grad = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)
        flops = 2.0 * tokens * 2 * hidden * ffn
        xd = torch.randn(tokens * 2, hidden, device=device, dtype=dtype, generator=gen)
        wd = torch.randn(hidden, ffn, device=device, dtype=dtype, generator=gen)
        wanted = args.kernels.split(",") if args.kernels else None
        # every (config, kernel) of this shape is compiled and warmed up first, then all are
        # timed round-robin with the matmul baseline (interleaved_ms): clock drift during the
        # sweep then cannot rank configurations
        cases = {"matmul": (lambda: None, lambda: xd @ wd)}
        keep = []  # the inputs each config's calls close over
        with torch.no_grad():
            for ci, cfg in enumerate(configs):
                def select(cfg=cfg):
                    bs.set_kernel_config(**sweep_config(start, cfg, bs.OPS))
                select()
                try:
                    # with the tokens and their plan: also the kernels the layer runs by
                    # default, which gather the tokens' rows ("*_gathered", gather_rows)
                    calls = kernel_calls(bs, topo, x_perm, w1.detach(), w2.detach(), grad,
                                         x, plan)
                    for name, fn in calls.items():
                        if wanted and name not in wanted:
                            continue
                        fn()
                        cases[(ci, name)] = (select, fn)
                    keep.append(calls)
                except Exception as exc:  # noqa: BLE001 - a config that cannot launch
                    emit(out, dict(metric="moe_kernel", shape=list(shape), config=cfg,
                                   error=repr(exc)[:300]))
                torch.cuda.synchronize()
            cases["matmul"][1]()
            ms = interleaved_ms(cases, rounds=args.reps)
        mm_ms = ms.pop("matmul")
        for (ci, name), t in ms.items():
            emit(out, dict(metric="moe_kernel", shape=list(shape), config=configs[ci],
                           kernel=name, ms=round(t, 4), tflops=round(flops / t / 1e9, 1),
                           baseline="torch.matmul [pairs, H] @ [H, F], same run, interleaved",
                           baseline_tflops=round(flops / mm_ms / 1e9, 1),
                           ratio=round(mm_ms / t, 4)))
        del keep, cases
    if args.dump:
        print(json.dumps(dict(metric="dump", kernels=dump_compiled(args.dump))), flush=True)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
