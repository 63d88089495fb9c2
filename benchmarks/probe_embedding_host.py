"""Where the host time of an EmbeddingAllToAll.batched call goes (issue 14's <= 20 us a call).
Each layer of the call is timed alone with the GPU kept busy (rocmoe.bench.fused_gpu.host_us),
peeling one layer off at a time: the public call; _lookup_packed (no checks); the output
ring's take; the handle's PackedEmbeddingLaunch (argument writing + the C launch); the C
launch alone on arguments written once; and a cProfile of the public call. Prints and writes
$OUT/probe_embedding_host.json.

    python benchmarks/probe_embedding_host.py [TABLES ROWS DIM BATCH LOOKUPS]
"""
import cProfile
import io
import json
import os
import pstats
import sys

import torch

import rocmoe
from rocmoe import ops
from rocmoe.bench.fused_gpu import host_us
from rocmoe.ops.handles.base import _take_output


def main(argv) -> None:
    nt, rows, dim, batch, lookups = (int(v) for v in (argv or [2, 10_000_000, 64, 2048, 1]))
    ctx = rocmoe.init(heap_size=1 << 30)
    dev = ctx.device
    weight = torch.randn(nt * rows, dim, device=dev)
    idx = torch.randint(0, rows, (nt * batch * lookups,), device=dev)
    off = torch.arange(0, nt * batch * lookups + 1, lookups, device=dev)
    h = ops.EmbeddingAllToAll(ctx, [rows] * nt, dim, batch, batch * lookups, "sum")
    shape = (batch, nt, dim)
    out = torch.empty(shape, device=dev)
    from rocmoe._native import lib
    res = {"shape": dict(tables=nt, rows=rows, dim=dim, batch=batch, lookups=lookups)}
    with torch.no_grad():
        h.batched(weight, idx, off)
        torch.cuda.synchronize()
        args = h._packed_launch.args
        layers = {
            "public call h.batched": lambda: h.batched(weight, idx, off),
            "_lookup_packed (no checks)": lambda: h._lookup_packed(weight, idx, off, None, batch,
                                                                   reuse=True),
            "output ring take": lambda: _take_output(h, "embedding", shape),
            "PackedEmbeddingLaunch (args + C launch)": lambda: h._packed_launch(
                weight, idx, off, None, batch, out),
            "C launch alone (args written once)": lambda: lib.rocmoe_gpu_embedding_a2a(args, 0),
            "torch.empty of the output": lambda: torch.empty(shape, device=dev),
            "F.embedding_bag, one call (reference)": lambda: torch.nn.functional.embedding_bag(
                idx, weight, off, include_last_offset=True),
        }
        for name, fn in layers.items():
            res[name] = [round(host_us(fn, 200), 2) for _ in range(3)]
            print(f"{name:45s} {res[name]} us", flush=True)
        prof = cProfile.Profile()
        torch.cuda._sleep(200_000_000)
        prof.enable()
        for _ in range(200):
            h.batched(weight, idx, off)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        res["cprofile_200_calls"] = text.getvalue()
        print(text.getvalue())
    h.synchronize()
    h.close()
    with open(os.path.join(os.environ.get("OUT", "."), "probe_embedding_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    ctx.finalize()


if __name__ == "__main__":
    main(sys.argv[1:])
