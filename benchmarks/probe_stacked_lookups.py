"""Host time of per-table embedding lookups listed (a tensor a table) against stacked
([tables, L] indices, [tables, B] offsets: dlrm's layout for Criteo data), at world size 1.

On a GPU (the default when one is visible): the EmbeddingAllToAll handle's public no-grad
call, its per-table writer alone (TableEmbeddingLaunch.prepare) and pack_lookups, each timed
with the GPU kept busy (rocmoe.bench.fused_gpu.host_us, medians of 5 samples of 50 calls).
Without one (--device cpu): the writer alone, on a stand-in of the handle whose tensors are
the CPU's (tests/ops/test_table_embedding_launch.py's stand-in; no launch), and pack_lookups
on CPU tensors (their arithmetic included: small lookups by default, 64 bags of 2). JSON
lines on stdout.

    python benchmarks/probe_stacked_lookups.py [--device cpu|cuda] [--tables 8,26]
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch


def _cpu_writer(nt: int, dim: int):
    """A TableEmbeddingLaunch on a stand-in handle whose tensors are the CPU's (nothing is
    launched: only prepare is timed)."""
    from rocmoe.ops.gpu import embedding_launch
    embedding_launch._fill = lambda ffi_, args, team, handle: None
    embedding_launch.team_for = lambda ctx: None
    embedding_launch.inline_tables = lambda: 32
    handle = types.SimpleNamespace(
        ctx=types.SimpleNamespace(device=torch.device("cuda", 0), timeout_s=30.0),
        mode="sum", num_tables=nt, total_tables=nt, table_base=0, dim=dim, dtype=torch.float32,
        world=1, max_batch=1 << 20, max_lookups=1 << 24, table_rows=[1000] * nt,
        _device_index=0)
    launch = embedding_launch.TableEmbeddingLaunch(handle)
    launch.index = -1
    return launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tables", default="8,26")
    ap.add_argument("--batch", type=int, default=None, help="8192 on a GPU, 64 on CPU")
    ap.add_argument("--lookups", type=int, default=None, help="8 on a GPU, 2 on CPU")
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args(argv)
    from rocmoe import ops
    gpu = a.device == "cuda"
    ctx = None
    if gpu:
        import rocmoe
        from rocmoe.bench.fused_gpu import host_us_samples
        ctx = rocmoe.init(heap_size=1 << 30)
        dev = ctx.device

        def timed(fn):
            return statistics.median(host_us_samples(fn))
    else:
        dev = torch.device("cpu")
        from rocmoe.bench.timing import host_us_median

        def timed(fn):
            return host_us_median(fn, 200)
    for nt in (int(t) for t in a.tables.split(",")):
        rows = 1000
        b = a.batch or (8192 if gpu else 64)
        lk = a.lookups or (8 if gpu else 2)
        g = torch.Generator(device=dev).manual_seed(nt)
        tables = [torch.randn(rows, a.dim, device=dev, generator=g) for _ in range(nt)]
        idx = torch.randint(0, rows, (nt, b * lk), device=dev, generator=g)
        off = torch.arange(0, b * lk, lk, device=dev).repeat(nt, 1)
        listed = ([r.clone() for r in idx], [r.clone() for r in off])
        rec = dict(probe="stacked_lookups", device=torch.cuda.get_device_name() if gpu else "cpu",
                   tables=nt, batch=b, lookups=lk, dim=a.dim)
        if gpu:
            h = ops.EmbeddingAllToAll(ctx, [rows] * nt, a.dim, b, b * lk, "sum")
            with torch.no_grad():
                got, want = h(tables, idx, off).clone(), h(tables, *listed)
                rec["equal"] = bool(torch.equal(got, want))
                rec["call_us"] = {"listed": timed(lambda: h(tables, *listed)),
                                  "stacked": timed(lambda: h(tables, idx, off))}
            writer = h._table_launch
        else:
            writer = _cpu_writer(nt, a.dim)
        rec["writer_us"] = {"listed": timed(lambda: writer.prepare(tables, *listed, None)),
                            "stacked": timed(lambda: writer.prepare(tables, idx, off, None))}
        rec["pack_lookups_us"] = {"listed": timed(lambda: ops.pack_lookups(*listed)),
                                  "stacked": timed(lambda: ops.pack_lookups(idx, off))}
        print(json.dumps(rec), flush=True)
        if gpu:
            h.close()
    if ctx is not None:
        ctx.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
