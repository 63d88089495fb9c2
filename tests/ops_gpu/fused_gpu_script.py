"""Multi-rank checks of the device kernels of the fused-op handles (run by tests/ops_gpu/*.py
via mpiexec).

usage: fused_gpu_script.py OPS [--calls N] [--dtype D[,D...]] [--backend B]
  OPS    comma list of gemm | gemm_grouped | rows | embedding | gemv | gemv_tall |
         gemm_timeout | tiny |
         bad_counts | abort | gemv_abort | gemv_mismatch | graph | native | lean |
         first_call_drift
On a GPU the handles run their CUDA/HIP kernels (ipc backend); on a CPU-only machine the
host backend's heap stands in and the Triton kernels (gemm, gemm_grouped, rows, the
protocol cases) run under TRITON_INTERPRET=1. Every rank checks its result against a float64
reference computed from inputs every rank can regenerate (seeded per call), prints
"RANK r OK <op> <dtype>", and the script exits 1 if any check failed.
"""

import argparse
import importlib.util
import json
import os
import sys
import traceback
import time

import torch

if importlib.util.find_spec("rocmoe") is None:  # else PYTHONPATH's (a staged nvshmem build)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import rocmoe  # noqa: E402
from rocmoe import errors  # noqa: E402
from rocmoe import ops  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_err(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return float((out - ref).norm() / max(ref.norm(), 1e-30))


def device_kernels(handle):
    """On the host backend, run the handle's Triton kernels (under the interpreter)."""
    if handle.ctx.backend == "host":
        handle._engine = "triton"
        ops.handles.rows_handle(handle.ctx, handle.max_rows, handle.N, handle.dtype)._engine = "triton"
    return handle


def gemm_case(call, world, k, n, groups, seed):
    g = torch.Generator().manual_seed(seed + call)
    # [src, dst, group]; GEMM_COUNT_MAX (at most 64 // groups) makes segments of several
    # 16-row tiles for the interpreter's grouped cases
    most = int(os.environ.get("GEMM_COUNT_MAX", "8"))
    counts = torch.randint(0, most + 1, (world, world, groups), generator=g)
    if groups > 1:
        counts[:, :, 1] = 0  # a group with no rows anywhere
    if world > 1:
        counts[0, world - 1] = 0  # an empty slice is always present
    xs = [torch.randn(int(counts[s].sum()) + 3, k, generator=g) for s in range(world)]  # +3: spare rows
    ws = [torch.randn(groups, k, n, generator=g) for _ in range(world)]
    return counts, xs, ws


def gemm_reference(counts, xs, ws, rank, world, dtype):
    parts = []
    for s in range(world):
        at = int(counts[s, :rank].sum())
        for grp in range(counts.shape[2]):
            rows = int(counts[s, rank, grp])
            parts.append(xs[s][at:at + rows].to(dtype).double() @ ws[s][grp].to(dtype).double())
            at += rows
    return torch.cat(parts)


def _errors_by_source(out, ref, rows_from) -> list:
    """Relative error of each source's rows (where a wrong GEMM output came from)."""
    errs, at = [], 0
    for rows in rows_from.tolist():
        errs.append(round(rel_err(out[at:at + rows], ref[at:at + rows]), 4) if rows else None)
        at += rows
    return errs


def check_gemm(ctx, dtype, calls, groups=1):
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    k, n = 32, 48
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=64, K=k, N=n, dtype=dtype, groups=groups))
    for call in range(calls):
        counts, xs, ws = gemm_case(call, world, k, n, groups, 1000 * groups)
        x = xs[rank].to(dev, dtype)
        w = (ws[rank] if groups > 1 else ws[rank][0]).to(dev, dtype)
        # counts as a device tensor (the fast path) on odd calls, a list on even ones
        mine = counts[rank] if groups > 1 else counts[rank, :, 0]
        sent = mine.to(dev) if call % 2 else mine.tolist()
        with torch.no_grad():
            out, recv = h(x, w, sent)
        h.synchronize()
        ref = gemm_reference(counts, xs, ws, rank, world, dtype)
        got = recv.cpu().tolist()
        assert got == counts[:, rank].sum(1).tolist(), (got, counts[:, rank].sum(1).tolist())
        if ref.numel():
            e = rel_err(out[:ref.shape[0]], ref)
            assert e < TOL[dtype], (f"rank {rank} call {call}: relative error {e}; by source: "
                                    f"{_errors_by_source(out, ref, counts[:, rank].sum(1))}; "
                                    f"tuned {getattr(h, '_tuned', None)}")
    assert h.epoch == calls, h.epoch


def _check_even_split(ctx, h, xs, w, wd, dtype, what: str, on_device: bool = False):
    """One call of GEMM handle `h`: this rank's X (xs[rank], every rank's X regenerable)
    times w, its rows split evenly over the ranks (the last takes the remainder; counts as a
    device tensor when `on_device`), checked against a float64 reference."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    m = xs[rank].shape[0]
    counts = [m // world] * world
    counts[-1] += m - sum(counts)
    with torch.no_grad():
        out, recv = h(xs[rank].to(dev, dtype), wd,
                      torch.tensor(counts, device=dev) if on_device else counts)
    h.synchronize()
    first = sum(counts[:rank])
    ref = torch.cat([xs[s][first:first + counts[rank]].to(dtype).double()
                     @ w.to(dtype).double() for s in range(world)])
    assert recv.cpu().tolist() == [counts[rank]] * world
    e = rel_err(out[:ref.shape[0]], ref)
    assert e < TOL[dtype], f"rank {rank} {what}: relative error {e}"


def check_split(ctx, dtype, calls):
    # a skinny product whose config (ROCMOE_GEMM_CONFIG, set by the test) splits K: every
    # tile's partials meet at its semaphore; sources send their rows to every rank
    world, dev = ctx.world_size, ctx.device
    m, k, n = (256, 4096, 1024) if dev.type == "cuda" else (32, 64, 48)
    want_split = json.loads(os.environ.get("ROCMOE_GEMM_CONFIG", "{}")).get("SPLIT_K", 1)
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=m, K=k, N=n, dtype=dtype))
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(70 + s)) for s in range(world)]
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(69)) / 64
    wd = w.to(dev, dtype)
    for call in range(calls):
        _check_even_split(ctx, h, xs, w, wd, dtype, f"call {call}", on_device=call % 2 == 1)
    if ctx.device.type == "cuda" and "ROCMOE_GEMM_CONFIG" in os.environ:
        # (without a config the tuner picks, split or not: the results above are checked)
        plans = list(h._launches.values())
        got = [p.constexprs["SPLIT_K"] for p in plans]
        assert got == [want_split], f"the plan runs SPLIT_K {got}, the config asks {want_split}"
    h.close()


def check_tiny(ctx, dtype, calls):
    # X of a few rows (a decode step's batch, an expert's few tokens) through the tile that
    # ROCMOE_GEMM_CONFIG forces (the test sets one of the tuner's tiny-X tiles): 1 to 64
    # rows, so full and masked row tiles, each rank's rows split over every rank
    world, dev = ctx.world_size, ctx.device
    k, n = (4096, 4096) if dev.type == "cuda" else (64, 96)
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=64, K=k, N=n, dtype=dtype))
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(71)) / 64
    wd = w.to(dev, dtype)
    for call in range(calls):
        m = (16, 64, 1, 33)[call % 4]
        xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(80 + 7 * call + s))
              for s in range(world)]
        _check_even_split(ctx, h, xs, w, wd, dtype, f"call {call} ({m} rows)")
    if dev.type == "cuda" and "ROCMOE_GEMM_CONFIG" in os.environ:
        want = json.loads(os.environ["ROCMOE_GEMM_CONFIG"])
        for plan in h._launches.values():
            got = {key: plan.cfg.get(key) for key in want}
            assert got == want, f"a plan runs {got}, the config asks {want}"
    h.close()


def check_gemm_grouped(ctx, dtype, calls):
    check_gemm(ctx, dtype, calls, groups=3)


def check_rows(ctx, dtype, calls):
    # the plain row exchange (the backward's): rows arrive packed, from rank 0 first
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    h = device_kernels(ops.AllToAllRows(ctx, max_rows=32, width=40, dtype=dtype))
    for call in range(calls):
        g = torch.Generator().manual_seed(5000 + call)
        counts = torch.randint(0, 20, (world, world), generator=g)
        rows = [torch.randn(int(counts[s].sum()), 40, generator=g) for s in range(world)]
        with torch.no_grad():
            out, recv = h(rows[rank].to(dev, dtype), counts[rank].to(dev))
        h.synchronize()
        ref = torch.cat([rows[s][int(counts[s, :rank].sum()):][:int(counts[s, rank])]
                         for s in range(world)])
        assert recv.cpu().tolist() == counts[:, rank].tolist()
        assert torch.equal(out[:ref.shape[0]].cpu(), ref.to(dtype)), "rows differ"


def check_embedding(ctx, dtype, calls):
    # D 16 with a few bags: one 64-item tile a slice; D 64 with up to 256 bags a rank: the
    # kernel's small-call tiles (16 items for fp32, 32 for bf16 / fp16: one item a lane
    # group), several a slice, over more workgroups
    for dim, bags in ((16, 8), (64, 256)):
        _check_embedding(ctx, dtype, calls, dim, bags)


def _check_embedding(ctx, dtype, calls, dim, bags):
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    b_max = bags * world
    counts = [1 + s % 3 for s in range(world)]
    if world > 1:
        counts[world - 1] = 0  # a rank with no tables
    rows = [50 + 7 * t for t in range(sum(counts))]
    base = sum(counts[:rank])
    mine = list(range(base, base + counts[rank]))
    for mode in ("sum", "mean"):
        h = ops.EmbeddingAllToAll(ctx, [rows[i] for i in mine], dim, b_max, 512 * bags // 8,
                                  mode, dtype)
        for call in range(calls):
            g = torch.Generator().manual_seed(2000 + call)
            b = world * (1 + call % 8) * (bags // 8)
            use_psw = mode == "sum" and call % 2 == 1
            tables, idxs, offs, psws = [], [], [], []
            for t in range(sum(counts)):
                lens = torch.randint(0, 5, (b,), generator=g)
                lens[0] = 0  # an empty bag
                tables.append(torch.randn(rows[t], dim, generator=g))
                idxs.append(torch.randint(0, rows[t], (int(lens.sum()),), generator=g))
                offs.append(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]]))
                psws.append(torch.rand(int(lens.sum()), generator=g))
            with torch.no_grad():
                out = h([tables[i].to(dev, dtype) for i in mine], [idxs[i].to(dev) for i in mine],
                        [offs[i].to(dev) for i in mine],
                        [psws[i].to(dev) for i in mine] if use_psw else None, batch=b)
            h.synchronize()
            bl = b // world
            ref = torch.zeros(bl, sum(counts), dim, dtype=torch.float64)
            for t in range(sum(counts)):
                bag = torch.nn.functional.embedding_bag(
                    idxs[t], tables[t].to(dtype).double(), offs[t], mode=mode,
                    per_sample_weights=psws[t].double() if use_psw else None)
                ref[:, t] = bag[rank * bl:(rank + 1) * bl]
            assert out.shape == ref.shape, (out.shape, ref.shape)
            e = rel_err(out, ref)
            assert e < TOL[dtype], f"rank {rank} D {dim} {mode} call {call}: relative error {e}"
            # the packed (table-batched) call: the same kernel on the same lookups, so the
            # same bits
            packed = ops.pack_tables([tables[i].to(dev, dtype) for i in mine],
                                     [idxs[i].to(dev) for i in mine],
                                     [offs[i].to(dev) for i in mine],
                                     [psws[i].to(dev) for i in mine])
            with torch.no_grad():
                if mine:
                    got = h.batched(*packed[:3], packed[3] if use_psw else None)
                else:
                    got = h.batched(None, None, None, batch=b)
            h.synchronize()
            assert torch.equal(got, out), f"rank {rank} D {dim} {mode} call {call}: batched " \
                f"differs from per-table by {(got.float() - out.float()).abs().max()}"
            _check_stacked(h, [tables[i] for i in mine], [rows[i] for i in mine], b, call,
                           f"rank {rank} D {dim} {mode} call {call}")
        h.close()


def _check_stacked(h, tables, rows, b, call, what):
    """Stacked lookups ([tables, L] indices, [tables, B] offsets: every bag `lookups` long)
    give the bits of the same rows passed as lists and the reference's values; odd calls
    take the indices as rows of a wider tensor (a row stride above L)."""
    world, dev, dtype = h.world, h.ctx.device, h.dtype
    lookups = 3
    g = torch.Generator().manual_seed(3000 + call)
    wide = lookups * b + (5 if call % 2 else 0)
    idx = torch.stack([torch.randint(0, r, (wide,), generator=g) for r in rows]) if rows \
        else torch.zeros(0, wide, dtype=torch.long)
    idx = idx.to(dev)[:, :lookups * b]
    off = torch.arange(0, lookups * b, lookups).repeat(len(rows), 1).to(dev)
    weights = [t.to(dev, dtype) for t in tables]
    with torch.no_grad():
        stacked = h(weights, idx, off, batch=b)
        listed = h(weights, list(idx), list(off), batch=b)
    h.synchronize()
    assert torch.equal(stacked, listed), f"{what}: stacked lookups differ from their rows " \
        f"as lists by {(stacked.float() - listed.float()).abs().max()}"
    if world > 1:  # the other ranks' columns come from lookups this rank did not draw
        return
    for t, table in enumerate(tables):
        bag = torch.nn.functional.embedding_bag(idx[t].cpu(), table.to(dtype).double(),
                                                off[t].cpu(), mode=h.mode)
        e = rel_err(stacked[:, t], bag)
        assert e < TOL[dtype], f"{what}: table {t}'s stacked lookups' relative error {e}"


def check_embedding_bad_index(ctx, dtype, calls):
    # an index outside its table in a packed call on the last rank: found on the device,
    # raised there and named by every other rank; no rank waits, the next call is right
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    h = ops.EmbeddingAllToAll(ctx, [30, 20], 8, 4 * world, 64, "sum", dtype)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(50, 8, generator=g).to(dev, dtype)
    b = 4 * world
    idx = torch.randint(0, 20, (2 * b,), generator=g).to(dev)
    offsets = torch.arange(0, 2 * b + 1, device=dev)
    bad = idx.clone()
    if rank == world - 1:
        bad[-1] = 20  # past table 1's 20 rows, yet inside the packed weight's 50
    expect_invalid_everywhere(h, lambda: h.batched(weight, bad, offsets), f"rank {world - 1}",
                              "an index outside its table was accepted")
    with torch.no_grad():
        got = h.batched(weight, idx, offsets)
    h.synchronize()
    w64 = weight.double().cpu()
    i, bl = idx.cpu(), b // world
    want = torch.stack([w64[:30][i[:b]], w64[30:][i[b:]]], dim=1)  # [b, 2, 8], one per bag
    want = torch.cat([want] * world, dim=1)[rank * bl:(rank + 1) * bl]
    e = rel_err(got, want)
    assert e < TOL[dtype], f"rank {rank}: relative error {e} after the bad call"
    # an empty global batch still runs the protocol (every rank signals and waits)
    with torch.no_grad():
        empty = h.batched(weight, idx[:0], offsets[:1])
    h.synchronize()
    assert empty.shape == (0, 2 * world, 8), empty.shape


def _gemv_inputs(n, ks, seed):
    """Every rank's (W_r, x_r) of one call, regenerated alike on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g), torch.randn(k, generator=g)) for k in ks]


def _gemv_reference(wsx, dtype):
    return sum(a.to(dtype).double() @ v.to(dtype).double() for a, v in wsx)


def check_gemv(ctx, dtype, calls):
    # N below one summing slice of the one-shot kernel (1024 rows) and across three with a
    # ragged end; K in 16-byte vectors, and (2500) a K that is not on one rank
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    for n, ks in ((37 + 64 * 3, [16 + 8 * s for s in range(world)]),
                  (2500, [40 + 3 * s for s in range(world)])):
        h = ops.GemvAllReduce(ctx, n, ks[rank], dtype)
        for call in range(calls):
            wsx = _gemv_inputs(n, ks, 3000 + call)
            w, x = wsx[rank]
            with torch.no_grad():
                out = h(w.to(dev, dtype), x.to(dev, dtype))
            h.synchronize()
            e = rel_err(out, _gemv_reference(wsx, dtype))
            assert e < TOL[dtype], f"rank {rank} N {n} call {call}: relative error {e}"


def check_gemv_tall(ctx, dtype, calls):
    # more rows than a resident grid has waves, so that ROCMOE_GEMV_BALANCE=1 cuts rows
    # between waves (K of 1000 and 4104: a row's last chunk is short); `calls` calls back to
    # back without a sync (a slot left full would spoil the next call's cut rows), then the
    # same calls replayed from a CUDA graph, equal to eager
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    n = 16411
    for k in (1000, 4104):
        h = ops.GemvAllReduce(ctx, n, k, dtype)
        inputs = []
        for call in range(calls):  # every rank alike: y = world * W x
            g = torch.Generator(device=dev).manual_seed(5000 + 100 * call)
            inputs.append((torch.randn(n, k, generator=g, device=dev).to(dtype),
                           torch.randn(k, generator=g, device=dev).to(dtype)))
        with torch.no_grad():
            eager = [h(w, x).clone() for w, x in inputs]
            refs = [world * (w.double() @ x.double()) for w, x in inputs]
            for call, (out, ref) in enumerate(zip(eager, refs)):
                e = rel_err(out, ref)
                assert e < TOL[dtype], f"rank {rank} N {n} K {k} call {call}: relative error {e}"
            if dev.type != "cuda":
                continue
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                [h(w, x) for w, x in inputs]  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            ctx.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = [h(w, x) for w, x in inputs]
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                for call, (a, b_) in enumerate(zip(eager, captured)):
                    assert torch.equal(a, b_), f"K {k} call {call}: a replay differs from eager"
        h.synchronize()


def check_gemv_abort(ctx, dtype, calls):
    # rank world-1 passes x of the wrong length: it raises at once, the others raise
    # InvalidArgumentError naming it at synchronize(), and the next call is right everywhere
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    n, ks = 1500, [24] * world
    h = ops.GemvAllReduce(ctx, n, ks[rank], dtype)
    wsx = _gemv_inputs(n, ks, 4000)
    w, x = (t.to(dev, dtype) for t in wsx[rank])
    bad = x[:8] if rank == world - 1 else x
    expect_invalid_everywhere(h, lambda: h(w, bad), f"rank {world - 1} rejected",
                              "the bad input was accepted")
    for call in range(calls):
        with torch.no_grad():
            out = h(w, x)
        h.synchronize()
        e = rel_err(out, _gemv_reference(wsx, dtype))
        assert e < TOL[dtype], f"rank {rank} call {call} after the abort: relative error {e}"


def check_gemm_timeout(ctx, dtype, calls):
    # rank 0 calls once more than the others: its device-side wait for their slices must
    # time out and become CommTimeoutError naming them (no host collective is involved)
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    g = torch.Generator().manual_seed(11)  # the same X and W on every rank
    x, w = torch.randn(2 * world, 16, generator=g), torch.randn(16, 16, generator=g)
    x, w = x.to(dev, dtype), w.to(dev, dtype)
    # compile and tune first, on a handle with a long timeout: a rank still in the JIT for
    # its first call must not look like a missing peer (ranks sharing one GPU once drifted
    # more than the 3 s apart there, and call 1 timed out instead of call 2)
    short, ctx.timeout_s = ctx.timeout_s, max(ctx.timeout_s, 120.0)
    warm = device_kernels(ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype))
    with torch.no_grad():
        warm(x, w, [2] * world)
    warm.synchronize()
    warm.close()
    ctx.timeout_s = short
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype))
    ctx.barrier()
    start = time.monotonic()
    with torch.no_grad():
        h(x, w, [2] * world)
        if rank == 0:
            h(x, w, [2] * world)
    try:
        h.synchronize()
    except errors.CommTimeoutError as exc:
        waited = time.monotonic() - start
        print(f"RANK {rank} TIMEOUT after {waited:.2f} s: {exc}", flush=True)
        # on a GPU the budget is time on the device's clock: it cannot run out before the
        # timeout (a count of polls could, when a poll took less than the microsecond it
        # assumed; the interpreter still counts polls)
        if dev.type == "cuda":
            assert waited >= 0.9 * short, f"timed out after {waited:.2f} s of a {short} s budget"
        # and it is the timeout, not ROCMOE_FIRST_CALL_TIMEOUT_S: call 2 is not a first call
        # (a native launch once kept the first call's budget: this wait took 300 s)
        assert waited < short + 30, f"timed out after {waited:.2f} s of a {short} s budget"
        return
    if rank == 0:
        raise AssertionError("rank 0 did not time out")
    # The others reach the closing barrier at once; bounded by the same timeout as rank 0's
    # wait, it would expire just as rank 0 arrives (on a loaded machine, first). Let rank 0's
    # wait run out before they start theirs.
    time.sleep(float(os.environ.get("ROCMOE_TIMEOUT_S", 30)))


def check_first_call_drift(ctx, dtype, calls):
    # rank 0 reaches a handle's first call twice the timeout after the others, as a rank
    # still in the JIT and the tuner would: the others' first launch waits
    # ROCMOE_FIRST_CALL_TIMEOUT_S, not the timeout, so the call completes everywhere (it
    # timed out at 30 s on two ranks sharing an H200 before); the next call is bounded by
    # the timeout again (gemm_timeout checks that)
    rank, world = ctx.rank, ctx.world_size
    dev = ctx.device
    x, w, ref = _shared_gemm_case(ctx, dtype)
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype))
    ctx.barrier()
    if rank == 0:
        time.sleep(2 * ctx.timeout_s)
    with torch.no_grad():
        for _ in range(2):
            y, recv = h(x, w, [2] * world)
            h.synchronize()
            assert recv.tolist() == [2] * world, recv
            e = rel_err(y[:2 * world], ref)
            assert e < TOL[dtype], f"first_call_drift: relative error {e}"
    h.close()
    # the HIP kernels of GemvAllReduce and EmbeddingAllToAll likewise (a peer may reach
    # their first call late from another handle's JIT)
    g = torch.Generator().manual_seed(12)
    wv, xv = torch.randn(40, 8, generator=g), torch.randn(8, generator=g)
    gv = ops.GemvAllReduce(ctx, 40, 8, dtype)
    table = torch.randn(30, 16, generator=g)  # every rank's one table: the same
    batch = 3 * world
    lens = torch.arange(batch) % 3  # bags of 0, 1 and 2 lookups
    idx = torch.randint(0, 30, (int(lens.sum()),), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    bags = torch.nn.functional.embedding_bag(idx, table.to(dtype).double(), offs, mode="sum")
    emb_ref = bags[3 * rank:3 * rank + 3, None].expand(3, world, 16)  # [bags, tables, D]
    emb = ops.EmbeddingAllToAll(ctx, [30], 16, batch, int(lens.sum()), "sum", dtype)
    for what in ("gemv", "embedding"):
        ctx.barrier()
        if rank == 0:
            time.sleep(2 * ctx.timeout_s)
        with torch.no_grad():
            for _ in range(2):
                if what == "gemv":
                    out = gv(wv.to(dev, dtype), xv.to(dev, dtype))
                    gv.synchronize()
                    want = world * (wv.to(dtype).double() @ xv.to(dtype).double())
                else:
                    out = emb([table.to(dev, dtype)], [idx.to(dev)], [offs.to(dev)],
                              batch=batch)
                    emb.synchronize()
                    want = emb_ref
                e = rel_err(out, want)
                assert e < TOL[dtype], f"first_call_drift {what}: relative error {e}"
    gv.close()
    emb.close()


def _shared_gemm_case(ctx, dtype):
    """(x [2 * world, 16], w [16, 16]) equal on every rank, and the float64 reference of a
    call sending 2 rows to every rank."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    g = torch.Generator().manual_seed(11)  # the same X and W on every rank
    x, w = torch.randn(2 * world, 16, generator=g), torch.randn(16, 16, generator=g)
    ref = gemm_reference(torch.full((world, world, 1), 2), [x] * world, [w[None]] * world,
                         rank, world, dtype)
    return x.to(dev, dtype), w.to(dev, dtype), ref


def expect_bad_device_counts(h, x, w, what):
    """Rank world-1's device counts ask for more rows than it has (2 * world + 5 of
    2 * world): only the kernel sees it; it must report bad input there, and every other
    rank must raise naming it. Its X is NaN, so that a row of the rejected call stored on any
    rank (the direct path's own output at world size 1) shows as NaN."""
    rank, world = h.rank, h.world
    counts = torch.full((world,), 2, dtype=torch.int64)
    if rank == world - 1:
        counts[0] = 7
        x = torch.full_like(x, float("nan"))
    out = None
    try:
        with torch.no_grad():
            out, _ = h(x, w, counts.to(x.device))
        h.synchronize()
    except errors.InvalidArgumentError as exc:
        print(f"RANK {rank} REJECTED {exc}", flush=True)
    else:
        raise AssertionError(f"bad counts were accepted{what}")
    if out is not None:
        assert not out.isnan().any(), f"rank {rank}: the rejected call stored rows{what}"


def expect_invalid_everywhere(h, call, naming, accepted):
    """`call()` is a call of `h` in which rank world-1 passes bad input: InvalidArgumentError
    on every rank by h.synchronize(), the other ranks' naming rank world-1 (`naming`, the
    words they must contain); `accepted`: the failure's message when nothing raised."""
    rank, world = h.rank, h.world
    try:
        with torch.no_grad():
            call()
        h.synchronize()
    except errors.InvalidArgumentError as exc:
        assert rank == world - 1 or naming in str(exc), str(exc)
        print(f"RANK {rank} REJECTED {exc}", flush=True)
    else:
        raise AssertionError(accepted)


def expect_rejected_input(h, x, w, what):
    """Rank world-1 passes X of the wrong width: it raises at once, the others raise
    InvalidArgumentError naming it at synchronize()."""
    world = h.world
    bad = x[:, :8] if h.rank == world - 1 else x
    expect_invalid_everywhere(h, lambda: h(bad, w, [2] * world), f"rank {world - 1} rejected",
                              f"the bad input was accepted{what}")


def check_bad_counts(ctx, dtype, calls):
    # bad device counts on one rank are reported by every rank, and the handle stays usable
    world = ctx.world_size
    # (and the rows after it are right: with a split-K config, ROCMOE_GEMM_CONFIG, every
    # tile's semaphore was re-zeroed by the bad call's last task)
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype))
    x, w, ref = _shared_gemm_case(ctx, dtype)
    expect_bad_device_counts(h, x, w, "")
    with torch.no_grad():
        out, recv = h(x, w, [2] * world)
    h.synchronize()
    assert recv.cpu().tolist() == [2] * world
    e = rel_err(out[:2 * world], ref)
    assert e < TOL[dtype], f"rank {ctx.rank}: relative error {e} after the bad counts"


def check_abort(ctx, dtype, calls):
    # a rank that rejects its input aborts the call on every rank, and the next call works
    # everywhere
    rank, world = ctx.rank, ctx.world_size
    h = device_kernels(ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype))
    x, w, ref = _shared_gemm_case(ctx, dtype)
    expect_rejected_input(h, x, w, "")
    with torch.no_grad():
        out, recv = h(x, w, [2] * world)
    h.synchronize()
    e = rel_err(out[:2 * world], ref)
    assert e < TOL[dtype], f"rank {rank}: relative error {e} after the abort"


def check_gemv_mismatch(ctx, dtype, calls):
    # rank 0 asks for a different N: handle creation raises on every rank
    n = 8 + (1 if ctx.rank == 0 else 0)
    try:
        ops.GemvAllReduce(ctx, n, 4, dtype)
    except errors.InvalidArgumentError as exc:
        assert "N" in str(exc)
        print(f"RANK {ctx.rank} REJECTED {exc}", flush=True)
        return
    raise AssertionError("mismatched N was accepted")


def check_graph(ctx, dtype, calls):
    # several calls of each handle captured in one CUDA graph, replayed: equal to eager
    assert ctx.device.type == "cuda", "CUDA graphs need a GPU"
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    gemm = ops.GemmAllToAll(ctx, max_rows=64, K=32, N=48, dtype=dtype)
    gemv = ops.GemvAllReduce(ctx, 96, 32, dtype)
    emb = ops.EmbeddingAllToAll(ctx, [40, 50], 16, 8 * world, 256, "sum", dtype)
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(60, 32, generator=g).to(dev, dtype)
    w = torch.randn(32, 48, generator=g).to(dev, dtype)
    counts = torch.full((world,), 60 // world, dtype=torch.int64).to(dev)
    wv, xv = torch.randn(96, 32, generator=g).to(dev, dtype), torch.randn(32, generator=g).to(dev, dtype)
    tabs = [torch.randn(40, 16, generator=g).to(dev, dtype), torch.randn(50, 16, generator=g).to(dev, dtype)]
    b = 8 * world
    idx = [torch.randint(0, n, (3 * b,), generator=g).to(dev) for n in (40, 50)]
    off = [torch.arange(0, 3 * b, 3, device=dev) for _ in tabs]
    packed = (torch.cat(tabs), torch.cat(idx), torch.arange(0, 6 * b + 1, 3, device=dev))

    def step():
        outs = []
        for _ in range(3):
            o, r = gemm(x, w, counts)
            outs += [o[:int(60 // world * world)].clone(), r.clone()]
            outs.append(gemv(wv, xv).clone())
            outs.append(emb(tabs, idx, off).clone())
            outs.append(emb.batched(*packed).clone())
        return outs

    with torch.no_grad():
        eager = step()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        ctx.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(4):
            graph.replay()
            torch.cuda.synchronize()
            for a, b_ in zip(eager, captured):
                assert torch.equal(a, b_), "a replayed call differs from eager"
    for h in (gemm, gemv, emb):
        h.synchronize()
    # the host counts Python calls (3 eager, 3 warm-up, 3 captured); the device advanced its
    # own epoch by 3 per replay too, and the replays stayed equal: no stale signal was taken
    assert gemm.epoch == 9 and gemv.epoch == 9, (gemm.epoch, gemv.epoch)


def check_nosync(ctx, dtype, calls):
    # after a warm-up call, the forward and backward of every handle under sync-debug
    # "error": any host synchronisation raises
    assert ctx.device.type == "cuda", "needs a GPU"
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    g = torch.Generator().manual_seed(99 + rank)
    gemm = ops.GemmAllToAll(ctx, max_rows=64, K=32, N=48, dtype=dtype, groups=2)
    gemv = ops.GemvAllReduce(ctx, 96, 32, dtype)
    emb = ops.EmbeddingAllToAll(ctx, [40, 50], 16, 8 * world, 256, "sum", dtype)
    x = torch.randn(60, 32, generator=g).to(dev, dtype).requires_grad_(True)
    w = torch.randn(2, 32, 48, generator=g).to(dev, dtype).requires_grad_(True)
    counts = torch.full((world, 2), 30 // world, dtype=torch.int64).to(dev)
    wv = torch.randn(96, 32, generator=g).to(dev, dtype).requires_grad_(True)
    xv = torch.randn(32, generator=g).to(dev, dtype).requires_grad_(True)
    tabs = [torch.randn(n, 16, generator=g).to(dev, dtype).requires_grad_(True) for n in (40, 50)]
    b = 8 * world
    idx = [torch.randint(0, n, (3 * b,), generator=g).to(dev) for n in (40, 50)]
    off = [torch.arange(0, 3 * b, 3, device=dev) for _ in tabs]
    weight = torch.randn(90, 16, generator=g).to(dev, dtype).requires_grad_(True)
    packed_idx, packed_off = torch.cat(idx), torch.arange(0, 6 * b + 1, 3, device=dev)
    psw = torch.rand(6 * b, generator=g).to(dev).requires_grad_(True)

    def step():
        out, recv = gemm(x, w, counts)  # rows past the arrivals get a zero gradient
        valid = (torch.arange(out.shape[0], device=dev) < recv.sum())[:, None]
        loss = torch.where(valid, out, out.new_zeros(())).float().square().mean()
        loss = loss + gemv(wv, xv).float().square().mean()
        loss = loss + emb(tabs, idx, off).float().square().mean()
        loss = loss + emb.batched(weight, packed_idx, packed_off, psw).float().square().mean()
        loss.backward()

    start = time.monotonic()
    step()  # warm-up: compiles, tunes, makes the backward's row handles
    torch.cuda.synchronize()
    # (ranks sharing a GPU can drift apart here by the JIT; the peers' waits must outlast it)
    print(f"RANK {rank} nosync warm-up step {time.monotonic() - start:.1f} s, GEMM tuning "
          f"{(gemm.__dict__.get('_tuned') or {}).get('candidates')}", flush=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for h in (gemm, gemv, emb):
        h.synchronize()
    assert all(t.grad is not None for t in (x, w, wv, xv, *tabs, weight, psw))


def check_native(ctx, dtype, calls):
    # after its first call, a GemmAllToAll launches straight through the driver (CUDA): the
    # same bits as the JIT's launch of the same call, right for other rows and pointers, and
    # back through the JIT when an argument's specialisation changes inside a rows class
    # (M = 320, a multiple of 16, in the class of 300 rows, twice: each return to it from
    # M = 300 changes the specialisation again); M = 64 and M = 1 are classes of their own,
    # each tuned on its first call (gpu.rows_class)
    from rocmoe import native_launch
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    k, n = 256, 192
    h = ops.GemmAllToAll(ctx, max_rows=512, K=k, N=n, dtype=dtype)
    g = torch.Generator().manual_seed(5 + rank)
    w = torch.randn(k, n, generator=g).to(dev, dtype)
    before = dict(native_launch.stats)

    def call(x):
        counts = [0] * world
        counts[rank] = x.shape[0]  # every row to this rank: the reference is local
        with torch.no_grad():
            out, recv = h(x, w, counts)
        h.synchronize()
        assert recv.cpu().tolist() == counts, recv
        return out[:x.shape[0]].clone()

    x = torch.randn(300, k, generator=g).to(dev, dtype)
    first = call(x)   # the JIT compiles (and tunes) it
    again = call(x)   # the driver launches it
    assert torch.equal(first, again), "the native launch differs from the JIT's"
    for m in (257, 320, 64, 1, 300, 320):
        x = torch.randn(m, k, generator=g).to(dev, dtype)
        e = rel_err(call(x), x.double() @ w.double())
        assert e < TOL[dtype], (m, e)
    native = native_launch.stats["native"] - before["native"]
    fallback = native_launch.stats["fallback"] - before["fallback"]
    if not getattr(torch.version, "hip", None):
        assert native >= 3 and fallback >= 2, (native, fallback, native_launch.last_refusal)
    print(f"RANK {rank} native launches {native}, through the JIT {fallback}", flush=True)
    h.close()


def _general_path_entered(handle, call):
    """(call()'s result, whether it entered `handle`'s general path), told by a spy on
    check(), with which the general path starts; the spy is gone before anything else can
    call check() (synchronize() does)."""
    general, entered = handle.check, []
    handle.check = lambda: entered.append(1) or general()
    try:
        return call(), bool(entered)
    finally:
        del handle.check


def check_lean(ctx, dtype, calls):
    # after its first call a GemmAllToAll takes the common call through its lean path
    # (rocmoe/ops/gpu/gemm_plans.py: lean_gemm_call); whatever that path does not take must
    # still get the general path's checks and results: a rejected input (every rank raises), bad
    # device counts (found by the kernel), a column-major X, and autograd (with grad
    # enabled every rank records the collective backward, also one whose X needs none)
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    h = ops.GemmAllToAll(ctx, max_rows=8, K=16, N=16, dtype=dtype)
    x, w, ref = _shared_gemm_case(ctx, dtype)

    def good(xin, counts, lean=None, wt=None):
        # lean True / False: the call must (not) be the lean call's
        weight = w if wt is None else wt
        with torch.no_grad():
            (out, recv), general = _general_path_entered(h, lambda: h(xin, weight, counts))
        h.synchronize()
        if lean is not None:
            assert general != lean, \
                f"rank {rank}: taken by the lean call: {not general}, expected {lean}"
        assert recv.cpu().tolist() == [2] * world, recv
        e = rel_err(out[:2 * world], ref)
        assert e < TOL[dtype], f"rank {rank}: relative error {e}"

    good(x, [2] * world, lean=False)
    assert h.__dict__.get("_lean") is not None, "no lean path after the first call"
    lean_epoch = h.epoch
    good(x, torch.full((world,), 2, dtype=torch.int64, device=dev), lean=True)
    assert h.epoch == lean_epoch + 1
    expect_rejected_input(h, x, w, " after the lean path was made")
    expect_bad_device_counts(h, x, w, " after the lean path was made")
    # column-major X: the general path copies it
    good(x.t().contiguous().t(), [2] * world, lean=False)
    xg = x.clone().requires_grad_(rank == 0)
    out, recv = h(xg, w, [2] * world)
    assert out.grad_fn is not None or (world == 1 and rank != 0), "no autograd node"
    if out.grad_fn is not None:
        out[:2 * world].float().sum().backward()
    h.synchronize()
    if rank == 0:
        want = torch.ones(2 * world, 16, dtype=torch.float64) @ w.cpu().double().t()
        e = rel_err(xg.grad, want)
        assert e < TOL[dtype], f"dX relative error {e}"
    good(x, [2] * world)
    # the lean path's outputs come from the handle's ring (rocmoe/ops/outputs.py): one the
    # caller still holds is never written again, one it dropped is handed out again
    ring = h._outputs["gemm"]
    with torch.no_grad():
        held, held_recv = h(x, w, [2] * world)
        kept = held[:2 * world].clone()
        reused = ring.reused
        for _ in range(3):
            out, recv = h(x * 2, w, [2] * world)
            assert out.data_ptr() != held.data_ptr() and recv.data_ptr() != held_recv.data_ptr()
            del out, recv
        h.synchronize()
        assert torch.equal(held[:2 * world], kept), "a held output was written again"
        assert ring.reused >= reused + 2, (ring.reused, reused)
    # X of another rows class (gpu.rows_class: 8 * world rows where the calls above had
    # 2 * world): its first call goes through the general path, which tunes that class's
    # plan and gives it to the lean call; the lean call takes the next one (the epoch counts
    # both calls, the results equal the reference)
    from rocmoe.ops import gpu
    classes = set(h._lean_plans)
    x_more = torch.cat([x, x, x, x])  # the first 2 * world rows are x's
    assert gpu.rows_class(x_more.shape[0]) not in classes, (x_more.shape, classes)
    good(x_more, [2] * world, lean=False)
    good(x_more, [2] * world, lean=True)
    assert set(h._lean_plans) == classes | {gpu.rows_class(x_more.shape[0])}, h._lean_plans
    lean_epoch = h.epoch
    good(x, [2] * world, lean=True)  # back to the first class: still the lean call's
    assert h.epoch == lean_epoch + 1
    # a Parameter W (a model's weight) outside autograd takes the lean call too
    good(x, [2] * world, lean=True, wt=torch.nn.Parameter(w.clone()))
    # GemvAllReduce's and EmbeddingAllToAll's no-grad calls the same way
    gv = ops.GemvAllReduce(ctx, 32, 16, dtype)
    wv, xv = torch.randn(32, 16, device=dev).to(dtype), torch.randn(16, device=dev).to(dtype)
    with torch.no_grad():
        y1 = gv(wv, xv)
        y1_kept = y1.clone()
        y2 = gv(wv, 2 * xv)
        assert y2.data_ptr() != y1.data_ptr()
        del y2
        y3 = gv(wv, 3 * xv)
        gv.synchronize()
        assert torch.equal(y1, y1_kept), "a held GEMV output was written again"
        assert gv._outputs["gemv"].reused >= 1 and y3.data_ptr() != y1.data_ptr()
        # a Parameter W outside autograd: the handle's quick path, not check()
        y4, general = _general_path_entered(gv, lambda: gv(torch.nn.Parameter(wv.clone()), xv))
        gv.synchronize()
        assert not general, "a Parameter W_local went through the GEMV's general path"
        e = rel_err(y4.float(), gv(wv, xv).float())
        assert e < TOL[dtype], f"a Parameter W_local computed another y: relative error {e}"
    gv.close()
    # EmbeddingAllToAll's no-grad calls, listed and stacked lookups alike, are written by
    # its per-table launch (gpu.TableEmbeddingLaunch), never by the general path
    emb = ops.EmbeddingAllToAll(ctx, [40, 50], 16, 8 * world, 64, "sum", dtype)
    tabs = [torch.randn(r, 16, device=dev).to(dtype) for r in (40, 50)]
    idx = torch.randint(0, 40, (2, 16 * world), device=dev)
    off = torch.arange(0, 16 * world, 2, device=dev).repeat(2, 1)
    with torch.no_grad():
        for form, lookups in (("listed", (list(idx), list(off))), ("stacked", (idx, off))):
            _, general = _general_path_entered(emb, lambda: emb(tabs, *lookups))
            assert not general, f"rank {rank}: {form} lookups took the embedding's general path"
    # a GPU build with torch importable has the C++ writer of the listed calls' words
    # (rocmoe/ops/gpu/records.py), and the handle's launch uses it
    from rocmoe.ops import reference
    from rocmoe.ops.gpu import records
    assert records.native_writer() is not None, records.native_problem()
    assert emb._table_launch._write is records.native_writer()
    if world == 1:  # (at more ranks the output holds the peers' tables too)
        with torch.no_grad():
            got = emb(tabs, list(idx), list(off))
            want = reference._bags(tabs, idx, off, "sum", None)
        e = rel_err(got.float(), want)
        assert e < TOL[dtype], f"listed lookups through the C++ writer: relative error {e}"
    emb.synchronize()
    emb.close()
    h.close()


def check_function_rows(ctx, dtype, calls):
    # at world size 1 the functional GEMM returns exactly X's rows (not a slice of its cached
    # handle's capacity-row output) once the same rows came twice running: from a ring of
    # its own, never writing an output the caller still holds, with the product's values;
    # the handle's own call still returns its capacity rows (rocmoe/ops/gpu/gemm_plans.py:
    # lean_gemm_call's `exact`)
    from rocmoe.ops import _kernels
    assert ctx.world_size == 1, "the exact-rows outputs are a world-size-1 path"
    dev = ctx.device
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 48, generator=g) / 8).to(dev, dtype)
    big = torch.randn(256, 64, generator=g).to(dev, dtype)
    x = torch.randn(96, 64, generator=g).to(dev, dtype)
    ref = x.double() @ w.double()
    with torch.no_grad():
        ops.gemm_all_to_all(big, w, [256], ctx=ctx)   # the cached handle holds 256 rows
        handle = _kernels._GEMM_LAST[ctx]
        assert handle.capacity_rows >= 256, handle.capacity_rows
        for _ in range(3):  # the general path (tunes the rows class), then two lean calls
            y = ops.gemm_all_to_all(x, w, [96], ctx=ctx)
        assert tuple(y.shape) == (96, 48), y.shape
        ring = handle._outputs.get("gemm_exact")
        assert ring is not None and ring.key == 96, ring and ring.key
        assert y._base is None and y.untyped_storage().nbytes() == 96 * 48 * y.element_size(), \
            "the function's output is a view of a larger one"
        held, kept = y, y.clone()
        reused = ring.reused
        for i in range(3):
            y2 = ops.gemm_all_to_all(x * (i + 2), w, [96], ctx=ctx)
            assert y2.data_ptr() != held.data_ptr()
            e = rel_err(y2, ref * (i + 2))
            assert e < TOL[dtype], f"relative error {e} of an exact-rows output"
            del y2
        torch.cuda.synchronize()
        assert torch.equal(held, kept), "a held output was written again"
        assert ring.reused >= reused + 2, (ring.reused, reused)
        # rows that change every call take slices of the capacity ring: no ring of their own
        for rows in (40, 72, 88):
            y3 = ops.gemm_all_to_all(x[:rows], w, [rows], ctx=ctx)
            assert tuple(y3.shape) == (rows, 48)
            e = rel_err(y3, ref[:rows])
            assert e < TOL[dtype], f"relative error {e} at {rows} rows"
        assert handle._outputs["gemm_exact"] is ring and ring.key == 96
        out, recv = handle(x, w, [96])
        assert out.shape[0] == handle.capacity_rows, (out.shape, handle.capacity_rows)
        assert int(recv[0]) == 96


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args()
    ctx = rocmoe.init(backend=a.backend, heap_size=256 << 20,
                      timeout_s=float(os.environ.get("ROCMOE_TIMEOUT_S", 30)))
    checks = {"gemm": check_gemm, "gemm_grouped": check_gemm_grouped, "rows": check_rows,
              "embedding": check_embedding, "gemv": check_gemv, "gemv_tall": check_gemv_tall,
              "gemm_timeout": check_gemm_timeout, "bad_counts": check_bad_counts,
              "abort": check_abort, "gemv_abort": check_gemv_abort,
              "gemv_mismatch": check_gemv_mismatch, "graph": check_graph,
              "nosync": check_nosync, "native": check_native, "lean": check_lean,
              "split": check_split, "tiny": check_tiny, "embedding_bad_index": check_embedding_bad_index,
              "first_call_drift": check_first_call_drift,
              "function_rows": check_function_rows}
    # several ops / dtypes in one process: a GPU job pays MPI + CUDA start-up once; a failing
    # op / dtype is reported and the next one still runs (the exit status says it failed)
    failed = 0
    for op in a.op.split(","):
        for dname in a.dtype.split(","):
            try:
                checks[op](ctx, DTYPES[dname], a.calls)
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception:
                failed += 1
                print(f"RANK {ctx.rank} FAIL {op} {dname}:\n{traceback.format_exc()}", flush=True)
                if op == "gemm_timeout":
                    break  # the handles of this context are broken now
                continue
            print(f"RANK {ctx.rank} OK {op} {dname}", flush=True)
    if "gemm_timeout" not in a.op:
        ctx.barrier()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
