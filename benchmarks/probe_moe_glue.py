"""Host time of the Python around each block-sparse kernel launch, without a GPU: the GPU
code path's launchers (tile choice, shared-memory fit, constexpr dicts, descriptors where
the device takes them) run on CPU tensors with every launch skipped
(rocmoe.bench.moe_memory.launches_skipped), so what is timed is the glue alone, plus one
output allocation where the launcher makes one.

    python3 benchmarks/probe_moe_glue.py [T,H,F,E] [--calls N] [--repeats R] [--tma]
                                         [--device meta]

Prints one JSON line: us per call of _sdd_triton, _dsd_triton, _dstd_triton and of a
torch.empty of the values for scale, each the best of R repeats of N calls (the VM is
noisy); dstd_out_us is DSᵀD into a given output (no allocation: the glue alone). --tma
makes the launchers take the descriptor (TMA) path as on an H200 (blocksparse.tma_capable
patched to True for the CPU tensors), so building the tensor descriptors is timed too.
--device meta: the operands and outputs are meta tensors (the topology stays on the CPU),
whose allocation costs about 2 us, like a CUDA tensor's from the caching allocator, where
a CPU tensor of these sizes costs 12-20 us here and varies the most.
On a GPU host the figures are smaller (the H200's host ran torch.empty of a CUDA tensor in
2.6 us); their ratio to the launch itself (about 12 us natively,
benchmarks/probe_layer_host.py) is the point.
"""

import argparse
import json
import time

import torch

from rocmoe.bench.moe_memory import launches_skipped
from rocmoe.moe import blocksparse as bs
from rocmoe.moe.routing import route_and_permute


def us_per_call(fn, calls: int, repeats: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6 / calls, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8192,1024,4096,64")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tma", action="store_true",
                    help="take the tensor-descriptor path, as on an H200")
    ap.add_argument("--device", default="cpu", choices=("cpu", "meta"),
                    help="where the operands and outputs are (meta: nearly free allocation)")
    args = ap.parse_args()
    if args.tma:
        bs.tma_capable = lambda device: True
    t, h, f, e = (int(v) for v in args.shape.split(","))
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, 2))
    _, topo, xp = route_and_permute(x, ids, e, 128, f, copy_rows=True)
    w1 = torch.randn(e, h, f, dtype=torch.bfloat16)
    w2 = torch.randn(e, f, h, dtype=torch.bfloat16)
    n, r, dev = args.calls, args.repeats, args.device
    xp, w1, w2 = (v.to(dev) for v in (xp, w1, w2))
    with launches_skipped():
        a = torch.empty(topo.values_shape(), dtype=torch.bfloat16, device=dev)
        dw = torch.empty(e, f, h, dtype=torch.bfloat16, device=dev)
        rec = dict(
            shape=[t, h, f, e], host="this machine's CPU, launches skipped", tma=args.tma,
            device=dev, calls=n, repeats=r,
            sdd_us=us_per_call(lambda: bs._sdd_triton(xp, w1, topo, act="gelu", act_out=a),
                               n, r),
            dsd_us=us_per_call(lambda: bs._dsd_triton(a, w2, topo), n, r),
            dstd_us=us_per_call(lambda: bs._dstd_triton(a, xp, topo), n, r),
            dstd_out_us=us_per_call(lambda: bs._dstd_triton(a, xp, topo, out=dw), n, r),
            empty_values_us=us_per_call(
                lambda: torch.empty(topo.values_shape(), dtype=torch.bfloat16, device=dev),
                n, r))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
