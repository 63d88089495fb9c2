"""Host time of the Python around each block-sparse kernel launch, without a GPU: the GPU
code path's launchers (tile choice, shared-memory fit, constexpr dicts, descriptors where
the device takes them) run on CPU tensors with every launch skipped
(rocmoe.bench.moe_memory.launches_skipped), so what is timed is the glue alone, plus one
output allocation where the launcher makes one.

    python3 benchmarks/probe_moe_glue.py [T,H,F,E] [--calls N]

Prints one JSON line: us per call of _sdd_triton, _dsd_triton, _dstd_triton and of a
torch.empty of the values for scale. On a GPU host the figures are smaller (the H200's host
ran torch.empty of a CUDA tensor in 2.6 us); their ratio to the launch itself (about 12 us
natively, benchmarks/probe_layer_host.py) is the point.
"""

import argparse
import json
import time

import torch

from rocmoe.bench.moe_memory import launches_skipped
from rocmoe.moe import blocksparse as bs
from rocmoe.moe.routing import route_and_permute


def us_per_call(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - t0) * 1e6 / calls, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8192,1024,4096,64")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    t, h, f, e = (int(v) for v in args.shape.split(","))
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, 2))
    _, topo, xp = route_and_permute(x, ids, e, 128, f, copy_rows=True)
    w1 = torch.randn(e, h, f, dtype=torch.bfloat16)
    w2 = torch.randn(e, f, h, dtype=torch.bfloat16)
    with launches_skipped():
        a = torch.empty(topo.values_shape(), dtype=torch.bfloat16)
        rec = dict(
            shape=[t, h, f, e], host="this machine's CPU, launches skipped",
            sdd_us=us_per_call(lambda: bs._sdd_triton(xp, w1, topo, act="gelu", act_out=a),
                               args.calls),
            dsd_us=us_per_call(lambda: bs._dsd_triton(a, w2, topo), args.calls),
            dstd_us=us_per_call(lambda: bs._dstd_triton(a, xp, topo), args.calls),
            empty_values_us=us_per_call(
                lambda: torch.empty(topo.values_shape(), dtype=torch.bfloat16), args.calls))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
