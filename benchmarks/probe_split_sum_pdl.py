"""Does launching the split-K sum for programmatic dependent launch (PDL) cost the host
time of the 16-row GEMM call? Paired, in one process: the handle's host time a call
(rocmoe.bench.fused_gpu.host_us: the GPU kept busy, so the host never waits) with the sum
launched with its PDL attribute and without (_SplitSum.EAGER_PDL), twelve samples each,
alternated, at 16 and 32 x 4096 x 4096 bf16; then each way's result against torch.matmul
and both timed queued (stream_ms) against it.

    python3 benchmarks/probe_split_sum_pdl.py OUT.jsonl

At 32 rows the tuner keeps an unsplit tile, so the switch changes nothing there: its two
columns measure the host's noise. H100, forty-sixth session
(results/probe_split_sum_pdl_h100_fortysixth_session.jsonl): 18.92 us with PDL against
19.71 without at 16 rows, 18.24 against 18.81 at 32, so PDL costs the host nothing
measurable; the sum's second launch is about 0.7 us (16 rows against 32).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rocmoe  # noqa: E402
from rocmoe import ops  # noqa: E402
from rocmoe.bench.fused_gpu import host_us, random_gemm_inputs, rel_err, stream_ms  # noqa: E402
from rocmoe.ops.gpu.gemm_plans import _SplitSum  # noqa: E402

ROWS, K, N = (16, 32), 4096, 4096
SAMPLES = 12


def measure(ctx, m: int) -> dict:
    """The record of one row count: host time and queued time each way, and each way's
    relative error against torch.matmul."""
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    x, w = random_gemm_inputs(m, K, N, ctx.device, gen)
    h = ops.GemmAllToAll(ctx, m, K, N, torch.bfloat16)
    ref = torch.matmul(x, w)

    def call():
        return h(x, w, [m])

    try:
        with torch.no_grad():
            for _ in range(3):  # the tuner, the JIT and the native launches first
                call()
            torch.cuda.synchronize()
            host = {True: [], False: []}
            for _ in range(SAMPLES):  # alternated, so that the host's drift hits both
                for pdl in (True, False):
                    _SplitSum.EAGER_PDL = pdl
                    host[pdl].append(host_us(call))
            err, queued = {}, {}
            for pdl in (True, False):
                _SplitSum.EAGER_PDL = pdl
                err[pdl] = rel_err(call()[0][:m], ref)
                queued[pdl] = stream_ms({"h": call, "t": lambda: torch.matmul(x, w)}, 15)
    finally:
        _SplitSum.EAGER_PDL = True
    tuned = getattr(h, "_tuned", None)
    h.close()
    return dict(m=m, k=K, n=N, config=tuned and tuned.get("config"),
                host_us_pdl=round(statistics.median(host[True]), 2),
                host_us_plain=round(statistics.median(host[False]), 2),
                samples_pdl=[round(v, 2) for v in host[True]],
                samples_plain=[round(v, 2) for v in host[False]],
                rel_err_pdl=err[True], rel_err_plain=err[False],
                queued_ms_pdl=queued[True], queued_ms_plain=queued[False])


def main() -> None:
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python3 benchmarks/probe_split_sum_pdl.py OUT.jsonl (a CUDA GPU)")
    ctx = rocmoe.init(heap_size=1 << 30)
    with open(sys.argv[1], "w") as out:
        for m in ROWS:
            rec = measure(ctx, m)
            out.write(json.dumps(rec) + "\n")
            print(json.dumps({k: rec[k] for k in ("m", "host_us_pdl", "host_us_plain",
                                                   "rel_err_pdl", "rel_err_plain")}))


if __name__ == "__main__":
    main()
