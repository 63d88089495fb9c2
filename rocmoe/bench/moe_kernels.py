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

from .moe import expert_inputs, kernel_calls, make_routing, time_ms

DEFAULT_CONFIGS = [
    dict(block_n=256, block_k=64, num_warps=8, num_stages=3),
    dict(block_n=256, block_k=64, num_warps=8, num_stages=4),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4),
    dict(block_n=128, block_k=64, num_warps=8, num_stages=4),
    dict(block_n=256, block_k=32, num_warps=8, num_stages=5),
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="65536,1024,4096,64;8192,4096,1408,64")
    ap.add_argument("--configs", default=None, help="JSON list of KERNEL_CONFIG overrides")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dump", default=None, help="directory for the compiled kernels' IR")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"metric": "moe_kernels", "error": "needs a CUDA/ROCm device"}))
        return 2
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe import route_and_permute
    configs = json.loads(args.configs) if args.configs else DEFAULT_CONFIGS
    out = open(args.output, "a") if args.output else None
    device, dtype = torch.device("cuda"), torch.bfloat16
    for spec in args.shapes.split(";"):
        shape = tuple(int(v) for v in spec.split(","))
        tokens, hidden, ffn, experts = shape
        gen, x, w1, w2 = expert_inputs(shape, device, dtype)
        ids, _ = make_routing(tokens, experts, 2, "uniform", device, dtype, gen)
        _, topo, x_perm = route_and_permute(x, ids, experts, args.block_size, ffn)
        grad = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)
        flops = 2.0 * tokens * 2 * hidden * ffn
        xd = torch.randn(tokens * 2, hidden, device=device, dtype=dtype, generator=gen)
        wd = torch.randn(hidden, ffn, device=device, dtype=dtype, generator=gen)
        mm_ms = time_ms(lambda: xd @ wd, args.reps)
        with torch.no_grad():
            for cfg in configs:
                bs.set_kernel_config(**cfg)
                try:
                    calls = kernel_calls(bs, topo, x_perm, w1.detach(), w2.detach(), grad)
                    for name, fn in calls.items():
                        ms = time_ms(fn, args.reps)
                        rec = dict(metric="moe_kernel", shape=list(shape), config=cfg,
                                   kernel=name, ms=round(ms, 4),
                                   tflops=round(flops / ms / 1e9, 1),
                                   baseline="torch.matmul [pairs, H] @ [H, F], same run",
                                   baseline_tflops=round(flops / mm_ms / 1e9, 1),
                                   ratio=round(mm_ms / ms, 4))
                        line = json.dumps(rec)
                        print(line, flush=True)
                        if out:
                            out.write(line + "\n")
                except Exception as exc:  # noqa: BLE001 - a config that cannot launch
                    print(json.dumps(dict(metric="moe_kernel", shape=list(shape), config=cfg,
                                          error=repr(exc)[:300])), flush=True)
                torch.cuda.synchronize()
    if args.dump:
        print(json.dumps(dict(metric="dump", kernels=dump_compiled(args.dump))), flush=True)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
