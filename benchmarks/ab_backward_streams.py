"""A/B of the fused expert FFN's backward on one stream and on two (KERNEL_CONFIG
"backward_streams"): fwd+bwd time of each, interleaved round by round, from an idle GPU,
queued behind an untimed call, and replayed from CUDA graphs. JSON lines.

    python3 benchmarks/ab_backward_streams.py [--shapes T,H,F,E;...] [--reps 9]
"""
import argparse
import json

import torch

from rocmoe.bench.moe import DEFAULT_SHAPES, expert_inputs, make_routing
from rocmoe.bench.timing import captured, interleaved_ms
from rocmoe.moe import blocksparse as bs
from rocmoe.moe import route_and_permute


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--routing", default="uniform")
    args = ap.parse_args()
    shapes = DEFAULT_SHAPES if not args.shapes else [
        tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    device, dtype = torch.device("cuda"), torch.bfloat16
    for shape in shapes:
        tokens, hidden, ffn, experts = shape
        gen, x, w1, w2 = expert_inputs(shape, device, dtype)
        ids, _ = make_routing(tokens, experts, 2, args.routing, device, dtype, gen)
        with torch.no_grad():
            _, topo, xp = route_and_permute(x, ids, experts, 128, ffn)
        xg = xp.detach().requires_grad_(True)
        gy = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)

        def fwdbwd():
            y = bs.fused_expert_ffn(xg, w1, w2, topo, "gelu")
            torch.autograd.grad(y, [xg, w1, w2], gy)

        def use(streams):
            return lambda: bs.set_kernel_config(backward_streams=streams)

        cases = {}
        for streams in (1, 2):
            use(streams)()
            fwdbwd()
            fwdbwd()
            cases[streams] = (use(streams), fwdbwd)
        idle = interleaved_ms(cases, rounds=args.reps, calls=1)
        queued = interleaved_ms(cases, rounds=args.reps, calls=1, queued=True)
        graphs = {}
        for streams in (1, 2):
            use(streams)()
            graphs[streams] = (use(streams), captured(fwdbwd))
        replayed = interleaved_ms(graphs, rounds=args.reps, calls=1, queued=True)
        bs.set_kernel_config(backward_streams=1)
        del graphs
        rec = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, routing=args.routing,
                   metric="ffn_fwdbwd_backward_streams", baseline="backward_streams=1",
                   device=torch.cuda.get_device_name())
        for name, t in (("idle", idle), ("queued", queued), ("graphs", replayed)):
            rec[f"one_stream_ms_{name}"] = round(t[1], 4)
            rec[f"two_streams_ms_{name}"] = round(t[2], 4)
            rec[f"speedup_{name}"] = round(t[1] / t[2], 4)
        print(json.dumps(rec), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
