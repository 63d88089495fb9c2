"""Does the world-size-1 GEMV's ratio to torch.mv follow W's address? (GPU machine)

Why this exists: at 16384^2 bf16 the GemvAllReduce handle ran 0.962-0.966 of torch.mv in the
twenty-first session's `rocmoe bench fused_gpu` run but 0.986-1.003 in the same session's
three `benchmarks/gemv_variants.py` runs, with the same kernel, grid and inputs made the same
way; torch.mv took 122.0-122.6 us in all four processes and the handle 122.3-126.4 us. One
thing that differs between the processes is where W lies (the bench allocates it after the
GEMM cases' buffers). This probe keeps one process and one W (the same values) and moves it:

* `fresh`: copies of W in new allocations, all kept alive (each at another address);
* `slab+B`: views at byte offset B into one larger allocation (2 MiB apart and not);

and times the handle against torch.mv on each copy as benchmarks/gemv_variants.py does
(time_against_mv: interleaved, queued, replayed from CUDA graphs and as eager calls). Run it
once as it is and once with ROCMOE_GEMV_BALANCE=1 (the balanced split is a per-process
knob) to see whether the split changes what the address does.

    python3 benchmarks/probe_gemv_address.py [--shape 16384x16384] [--dtype bf16]
        [--fresh 4] [--offsets 0,4096,1048576,2097152,2101248] [--reps 20]
    python3 benchmarks/probe_gemv_address.py --device cpu --shape 64x32   # dry run

One JSON line per placement: W's address (and its offset within 2 MiB), rocmoe and torch.mv
ms replayed from graphs and queued, the ratios torch / rocmoe, TB/s, and the relative error
of the handle's y against float64; a summary line last (the ratios' spread)."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemv_variants import time_against_mv  # noqa: E402  (timed as the variants are)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def placements(w: torch.Tensor, fresh: int, offsets: list):
    """(name, a tensor equal to `w` at another address) in turn (`w` itself is 'first'). The
    slab's views overlap one another, so each is filled only when it is yielded: use one
    before asking for the next (filled all at once, every view but the last held parts of
    its neighbours' copies: rel_err 1.4 in the twenty-third session's H200 run)."""
    yield "first", w
    copies = [w.clone() for _ in range(fresh)]  # all alive at once: each at its own address
    for i, c in enumerate(copies):
        yield f"fresh{i}", c
    if offsets:
        nbytes = w.numel() * w.element_size()
        slab = torch.empty(nbytes + max(offsets), dtype=torch.uint8, device=w.device)
        for off in offsets:
            if off % w.element_size() or off % 16:
                raise SystemExit(f"offset {off}: the kernel's vector path needs 16-byte steps")
            view = slab[off:off + nbytes].view(w.dtype).view(w.shape)
            view.copy_(w)
            yield f"slab+{off}", view


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x16384")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--fresh", type=int, default=4)
    ap.add_argument("--offsets", default="0,4096,1048576,2097152,2101248")
    ap.add_argument("--reps", type=int, default=20, help="interleaved rounds (medians)")
    ap.add_argument("--calls", type=int, default=5, help="calls between two events")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run on the host backend")
    a = ap.parse_args(argv)
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.timing import captured
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    n, k = (int(v) for v in a.shape.split("x"))
    ctx = rocmoe.init(backend="ipc" if dev.type == "cuda" else "host", heap_size=256 << 20)
    g = torch.Generator(device=dev).manual_seed(11)
    w = torch.randn(n, k, device=dev, generator=g).to(dtype)
    x = torch.randn(k, device=dev, generator=g).to(dtype)
    want = w.double() @ x.double()
    h = ops.GemvAllReduce(ctx, n, k, dtype)
    offsets = [int(v) for v in a.offsets.split(",") if v != ""]
    nbytes = (n * k + k + n) * w.element_size()
    knobs = {key: val for key, val in os.environ.items() if key.startswith("ROCMOE_GEMV_")}
    ratios = {}
    with torch.no_grad():
        for name, wp in placements(w, a.fresh, offsets):
            y = h(wp, x)
            err = float((y.double() - want).norm() / want.norm())
            holder = []

            def ours(wp=wp):
                holder.append(h(wp, x))
                del holder[:-1]

            def theirs(wp=wp):
                return torch.mv(wp, x)

            replay_ours, replay_theirs = captured(ours), captured(theirs)
            for _ in range(3):
                ours()
                theirs()
            ptr = wp.data_ptr()
            rec = dict(probe="gemv_address", shape=dict(n=n, k=k), dtype=a.dtype,
                       placement=name, address=hex(ptr), offset_in_2mib=ptr % (2 << 20),
                       knobs=knobs, rel_err=err)
            rec.update(time_against_mv(ours, replay_ours, theirs, replay_theirs, a.reps,
                                       a.calls, nbytes))
            ratios[name] = rec["ratio_graph"]
            print(json.dumps(rec), flush=True)
            del replay_ours, replay_theirs, holder[:]
    h.close()
    print(json.dumps(dict(probe="gemv_address", summary=True, shape=dict(n=n, k=k),
                          dtype=a.dtype, knobs=knobs, placements=len(ratios),
                          ratio_graph_min=min(ratios.values()),
                          ratio_graph_max=max(ratios.values()))), flush=True)


if __name__ == "__main__":
    main()
