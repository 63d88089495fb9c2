"""Multi-rank checks of rocmoe.ops against rocmoe.ops.reference (launched by test_fused.py).

    mpiexec -n N python tests/ops/fused_script.py [GROUP ...]

GROUPS: forward backward repeat errors compile nograd (default: all). Prints one line per check
("ok ..." or "FAIL ..."), exits 1 if any check failed. Every rank runs every check; the
fused op and its reference run in the same process on the same inputs.
"""

from __future__ import annotations

import os
import random
import sys
import traceback

import torch

import rocmoe
import rocmoe.ops as ops
from rocmoe.ops import reference as ref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rank_report import RankReport  # noqa: E402

torch.set_num_threads(1)
ctx = rocmoe.init(backend="host", heap_size=256 << 20)
RANK, WORLD = ctx.rank, ctx.world_size
report = RankReport(f"rank {RANK}/{WORLD}")

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def close(a: torch.Tensor, b: torch.Tensor, dtype, scale: float = 1.0) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.numel() == 0:
        return True, ""
    rtol, atol = TOL[dtype]
    diff = (a.float() - b.float()).abs().max().item()
    ok = torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * scale)
    return ok, f"max diff {diff:.3g}"


def shared_rng(tag: int) -> random.Random:
    """Same stream on every rank (shapes every rank must agree on)."""
    return random.Random(1000 * tag + 7)


def local_gen(tag: int) -> torch.Generator:
    return torch.Generator().manual_seed(100000 * tag + 31 * RANK + 1)


# ---- input makers -------------------------------------------------------------------------
def embedding_case(tag: int, dtype, mode="sum", psw=False, empty_rank=None):
    rng = shared_rng(tag)
    g = local_gen(tag)
    tables = [rng.randint(0, 3) for _ in range(WORLD)]
    if empty_rank is not None:
        tables[empty_rank] = 0
    if sum(tables) == 0:
        tables[0] = 1
    dim = rng.choice([1, 3, 8, 16])
    batch = WORLD * rng.randint(0, 5)
    weights, indices, offsets, psws = [], [], [], []
    for t in range(tables[RANK]):
        rows = int(torch.randint(1, 30, (1,), generator=g))
        weights.append(torch.randn(rows, dim, generator=g).to(dtype))
        lengths = torch.randint(0, 5, (batch,), generator=g)
        if batch:
            lengths[0] = 0  # an empty bag in every table
        n = int(lengths.sum())
        offsets.append(torch.cumsum(lengths, 0) - lengths)
        indices.append(torch.randint(0, rows, (n,), generator=g))
        psws.append(torch.rand(n, generator=g))
    return weights, indices, offsets, (psws if psw else None), mode


def gemv_case(tag: int, dtype):
    rng = shared_rng(tag)
    g = local_gen(tag)
    n = rng.choice([0, 1, WORLD - 1 if WORLD > 1 else 1, 7, 33, 300])
    k = int(torch.randint(0, 40, (1,), generator=g))
    return torch.randn(n, k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype)


def gemm_case(tag: int, dtype):
    rng = shared_rng(tag)
    g = local_gen(tag)
    n = rng.choice([1, 5, 16, 33])
    k = rng.choice([1, 4, 17])
    m = int(torch.randint(0, 40, (1,), generator=g))
    # uneven split with empty slices: random cut points
    cuts = sorted(int(c) for c in torch.randint(0, m + 1, (WORLD - 1,), generator=g))
    counts = [b - a for a, b in zip([0] + cuts, cuts + [m])]
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(k, n, generator=g).to(dtype)
    return x, w, counts


def gemm_grouped_case(tag: int, dtype):
    """Grouped products: W [G, K, N] and counts [world][G] (some segments empty)."""
    rng = shared_rng(tag)
    g = local_gen(tag)
    groups, n, k = rng.choice([1, 2, 3]), rng.choice([1, 5, 16]), rng.choice([1, 4, 17])
    counts = torch.randint(0, 6, (WORLD, groups), generator=g)
    counts[torch.rand(WORLD, groups, generator=g) < 0.3] = 0
    x = torch.randn(int(counts.sum()), k, generator=g).to(dtype)
    w = torch.randn(groups, k, n, generator=g).to(dtype)
    return x, w, counts.tolist()


# ---- groups ----------------------------------------------------------------------------------
def check_forward():
    tag = 1
    for dtype in DTYPES:
        for mode, psw in (("sum", False), ("mean", False), ("sum", True)):
            for empty_rank, pooling in ((None, "kernel"), (WORLD - 1, "kernel"), (None, "torch")):
                tag += 1
                os.environ["ROCMOE_HOST_EMBEDDING"] = pooling
                w, i, o, p, m = embedding_case(tag, dtype, mode, psw, empty_rank)
                got = ops.embedding_all_to_all(w, i, o, mode=m, per_sample_weights=p)
                want = ref.embedding_all_to_all(w, i, o, mode=m, per_sample_weights=p)
                ok, d = close(got, want, dtype, 2.0)
                report(ok, f"embedding forward {dtype} {mode} psw={psw} ({pooling}) "
                           f"no-table-rank={empty_rank} shape={tuple(got.shape)}", d)
    os.environ.pop("ROCMOE_HOST_EMBEDDING", None)
    for dtype in DTYPES:
        for gemv_mode in ("torch", "kernel"):
            os.environ["ROCMOE_HOST_GEMV"] = gemv_mode
            for _ in range(2):
                tag += 1
                w, x = gemv_case(tag, dtype)
                ok, d = close(ops.gemv_all_reduce(w, x), ref.gemv_all_reduce(w, x), dtype, 4.0)
                report(ok, f"gemv forward {dtype} ({gemv_mode}) W{tuple(w.shape)}", d)
        os.environ.pop("ROCMOE_HOST_GEMV", None)
        for mode in ("torch", "kernel"):
            os.environ["ROCMOE_HOST_GEMM"] = mode
            for _ in range(3):
                tag += 1
                x, w, counts = gemm_case(tag, dtype)
                ok, d = close(ops.gemm_all_to_all(x, w, counts),
                              ref.gemm_all_to_all(x, w, counts), dtype, 4.0)
                report(ok, f"gemm forward {dtype} ({mode}) X{tuple(x.shape)} counts={counts}", d)
            for _ in range(2):
                tag += 1
                x, w, counts = gemm_grouped_case(tag, dtype)
                ok, d = close(ops.gemm_all_to_all(x, w, counts),
                              ref.gemm_all_to_all(x, w, counts), dtype, 4.0)
                report(ok, f"grouped gemm forward {dtype} ({mode}) W{tuple(w.shape)} "
                           f"counts={counts}", d)
    os.environ.pop("ROCMOE_HOST_GEMM", None)
    # the same y on every rank, bit for bit (the owner reduces once and broadcasts)
    w, x = gemv_case(99, torch.float32)
    y = ops.gemv_all_reduce(w, x)
    table = ctx.comm.allgather(y.numpy().tobytes()) if WORLD > 1 else [y.numpy().tobytes()]
    report(all(t == table[0] for t in table), "gemv result bitwise identical on all ranks")


def _grads(fn, tensors, upstream_gen):
    for t in tensors:
        t.grad = None
    out = fn()
    gy = torch.randn(out.shape, generator=upstream_gen).to(out.dtype)
    (out.float() * gy.float()).sum().backward()
    return out, [t.grad for t in tensors]


def check_backward():
    tag = 500
    for dtype in DTYPES:
        for mode, psw in (("sum", False), ("mean", False), ("sum", True)):
            tag += 1
            w, i, o, p, m = embedding_case(tag, dtype, mode, psw, WORLD - 1 if WORLD > 2 else None)
            leaves = [t.requires_grad_(True) for t in w] + ([t.requires_grad_(True) for t in p]
                                                            if p else [])
            _, g1 = _grads(lambda: ops.embedding_all_to_all(w, i, o, mode=m, per_sample_weights=p),
                           leaves, local_gen(tag))
            _, g2 = _grads(lambda: ref.embedding_all_to_all(w, i, o, mode=m, per_sample_weights=p),
                           leaves, local_gen(tag))
            oks = [close(a, b, dtype, 4.0) for a, b in zip(g1, g2)]
            report(all(ok for ok, _ in oks) and len(g1) == len(leaves),
                   f"embedding backward {dtype} {mode} psw={psw} ({len(leaves)} leaves)",
                   "; ".join(d for _, d in oks))
        tag += 1
        w, x = gemv_case(tag, dtype)
        w.requires_grad_(True)
        x.requires_grad_(True)
        # gy must be the same on every rank (replicated y): a shared-seed generator
        _, g1 = _grads(lambda: ops.gemv_all_reduce(w, x), [w, x], torch.Generator().manual_seed(tag))
        _, g2 = _grads(lambda: ref.gemv_all_reduce(w, x), [w, x], torch.Generator().manual_seed(tag))
        oks = [close(a, b, dtype, 4.0) for a, b in zip(g1, g2)]
        report(all(ok for ok, _ in oks), f"gemv backward {dtype}", "; ".join(d for _, d in oks))
        for what, case in (("gemm", gemm_case), ("grouped gemm", gemm_grouped_case)):
            tag += 1
            x, w, counts = case(tag, dtype)
            x.requires_grad_(True)
            w.requires_grad_(True)
            _, g1 = _grads(lambda: ops.gemm_all_to_all(x, w, counts), [x, w], local_gen(tag))
            _, g2 = _grads(lambda: ref.gemm_all_to_all(x, w, counts), [x, w], local_gen(tag))
            oks = [close(a, b, dtype, 8.0) for a, b in zip(g1, g2)]
            report(all(ok for ok, _ in oks) and all(a is not None for a in g1),
                   f"{what} backward {dtype} W{tuple(w.shape)} counts={counts}",
                   "; ".join(d for _, d in oks))


def check_repeat():
    """100 calls per op, sizes changing every call, signals never re-zeroed."""
    bad = []
    for it in range(100):
        tag = 2000 + it
        x, w, counts = gemm_case(tag, torch.float32)
        ok, d = close(ops.gemm_all_to_all(x, w, counts), ref.gemm_all_to_all(x, w, counts),
                      torch.float32, 4.0)
        if not ok:
            bad.append(f"gemm call {it}: {d}")
        wv, xv = gemv_case(tag, torch.float32)
        ok, d = close(ops.gemv_all_reduce(wv, xv), ref.gemv_all_reduce(wv, xv), torch.float32, 4.0)
        if not ok:
            bad.append(f"gemv call {it}: {d}")
        e = embedding_case(tag, torch.float32)
        ok, d = close(ops.embedding_all_to_all(*e[:3], mode=e[4]),
                      ref.embedding_all_to_all(*e[:3], mode=e[4]), torch.float32)
        if not ok:
            bad.append(f"embedding call {it}: {d}")
    report(not bad, "100 functional calls of each op, sizes changing every call",
           "; ".join(bad[:3]))
    check_handle_repeat()


def check_handle_repeat():
    """100 calls of one handle per op, rows / batch changing every call, signals never
    re-zeroed: every result equals the reference and the epoch is exactly the call count."""
    bad = []
    gemm = ops.GemmAllToAll(ctx, max_rows=40, K=4, N=5, dtype=torch.float32)
    gemv = ops.GemvAllReduce(ctx, 33, 6, torch.float32)
    emb = ops.EmbeddingAllToAll(ctx, [7, 11], dim=3, max_batch=8 * WORLD, max_lookups=64)
    for it in range(100):
        g = local_gen(3000 + it)
        m = int(torch.randint(0, 40, (1,), generator=g))
        cuts = sorted(int(c) for c in torch.randint(0, m + 1, (WORLD - 1,), generator=g))
        counts = [b - a for a, b in zip([0] + cuts, cuts + [m])]
        x, w = torch.randn(m, 4, generator=g), torch.randn(4, 5, generator=g)
        out, recv = gemm(x, w, counts)
        ok, d = close(out[:int(recv.sum())], ref.gemm_all_to_all(x, w, counts), torch.float32,
                      4.0)
        if not ok:
            bad.append(f"GemmAllToAll call {it}: {d}")
        wv, xv = torch.randn(33, 6, generator=g), torch.randn(6, generator=g)
        ok, d = close(gemv(wv, xv), ref.gemv_all_reduce(wv, xv), torch.float32, 4.0)
        if not ok:
            bad.append(f"GemvAllReduce call {it}: {d}")
        batch = WORLD * int(shared_rng(3000 + it).randint(0, 8))
        tables = [torch.randn(7, 3, generator=g), torch.randn(11, 3, generator=g)]
        lookups = [torch.randint(0, 3, (batch,), generator=g) for _ in tables]
        offsets = [torch.cumsum(n, 0) - n for n in lookups]
        indices = [torch.randint(0, len(tab), (int(n.sum()),), generator=g)
                   for tab, n in zip(tables, lookups)]
        ok, d = close(emb(tables, indices, offsets, batch=batch),
                      ref.embedding_all_to_all(tables, indices, offsets), torch.float32)
        if not ok:
            bad.append(f"EmbeddingAllToAll call {it}: {d}")
    epochs = [gemm.epoch, gemv.epoch, emb.epoch]
    report(not bad and epochs == [100, 100, 100],
           f"100 calls of each handle without re-zeroing signals, epochs {epochs}",
           "; ".join(bad[:3]))
    for h in (gemm, gemv, emb):
        h.close()


def _heap_state():
    h = ctx.heap
    return h.free_bytes, h.largest_free_block, h.live_allocations


def _snapshot(op):
    """The heap's state, and every fused-op handle of the context: its epoch and its whole
    symmetric workspace."""
    return (_heap_state(), [(h.epoch, h.workspace.clone()) for h in
                            sorted(ctx._handles, key=lambda h: h.workspace_offset)
                            if h.workspace is not None])


def _same_handles(a, b):
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b))


def _same(a, b):
    return a[0] == b[0] and _same_handles(a[1], b[1])


def _changes(a, b):
    what = []
    if a[0] != b[0]:
        what.append(f"heap (free, largest free block, live) {a[0]} -> {b[0]}")
    if [e for e, _ in a[1]] != [e for e, _ in b[1]]:
        what.append(f"epochs {[e for e, _ in a[1]]} -> {[e for e, _ in b[1]]}")
    if not _same_handles(a[1], b[1]):
        what.append("workspace contents changed")
    return "; ".join(what)


def expect_error(what: str, op: str, call, bad_rank: int, then):
    """`call(bad)` on every rank (bad is True on `bad_rank` only) must raise a RocmoeError on
    every rank, leave every workspace untouched (nothing was put to any peer) and the heap as
    it was (free bytes, largest free block, allocations), and a valid call (`then`) must work
    afterwards."""
    then()  # workspaces exist and hold a previous call's data
    # every rank has finished that call, and so has acknowledged it into its sources'
    # workspaces: from here on only the bad call itself could change a workspace
    ctx.barrier()
    before = _snapshot(op)
    try:
        call(RANK == bad_rank)
    except rocmoe.RocmoeError as exc:
        text = str(exc).splitlines()[0][:150]
        after = _snapshot(op)
        # every rank checks its own workspace: together that is "nothing reached any peer"
        report(_same(before, after), f"error {what}: {type(exc).__name__}: {text}",
               _changes(before, after))
    except Exception as exc:  # noqa: BLE001 - must be a RocmoeError
        report(False, f"error {what}", f"raised {type(exc).__name__}: {exc}")
    else:
        report(False, f"error {what}", "no error raised")
    try:
        then()
        report(True, f"usable after {what}")
    except Exception as exc:  # noqa: BLE001
        report(False, f"usable after {what}", repr(exc))


def check_errors():
    bad_rank = WORLD - 1
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 4, generator=g)
    x = torch.randn(4, generator=g)
    good_gemv = lambda: ops.gemv_all_reduce(w, x)  # noqa: E731
    expect_error("gemv x of the wrong length", "gemv_all_reduce",
                 lambda bad: ops.gemv_all_reduce(w, torch.randn(5) if bad else x), bad_rank, good_gemv)
    expect_error("gemv dtype mismatch", "gemv_all_reduce",
                 lambda bad: ops.gemv_all_reduce(w, x.half() if bad else x), bad_rank, good_gemv)
    expect_error("gemv integer dtype", "gemv_all_reduce",
                 lambda bad: ops.gemv_all_reduce(w.long() if bad else w, x.long() if bad else x),
                 bad_rank, good_gemv)
    expect_error("gemv device mismatch", "gemv_all_reduce",
                 lambda bad: ops.gemv_all_reduce(w, x.to("meta") if bad else x), bad_rank, good_gemv)
    expect_error("gemv W that is not a tensor", "gemv_all_reduce",
                 lambda bad: ops.gemv_all_reduce(w.tolist() if bad else w, x), bad_rank, good_gemv)
    if WORLD > 1:  # a cross-rank disagreement needs two ranks
        expect_error("gemv N differs across ranks", "gemv_all_reduce",
                     lambda bad: ops.gemv_all_reduce(torch.randn(7, 4) if bad else w, x),
                     bad_rank, good_gemv)

    X = torch.randn(10, 3, generator=g)
    Wm = torch.randn(3, 5, generator=g)
    counts = [10 // WORLD] * WORLD
    counts[0] += 10 - sum(counts)
    good_gemm = lambda: ops.gemm_all_to_all(X, Wm, counts)  # noqa: E731
    wrong_sum = list(counts)
    wrong_sum[-1] += 1
    expect_error("gemm send_counts not summing to M", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, Wm, wrong_sum if bad else counts), bad_rank,
                 good_gemm)
    expect_error("gemm send_counts of the wrong length", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, Wm, counts + [0] if bad else counts), bad_rank,
                 good_gemm)
    expect_error("gemm negative send count", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(
                     X, Wm, ([-1] + [0] * (WORLD - 2) + [11]) if bad and WORLD > 1 else
                     ([-1] if bad else counts)), bad_rank, good_gemm)
    expect_error("gemm float send_counts tensor", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(
                     X, Wm, torch.tensor(counts, dtype=torch.float32) if bad else
                     torch.tensor(counts)), bad_rank, good_gemm)
    expect_error("gemm X that is not a tensor", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X.tolist() if bad else X, Wm, counts), bad_rank,
                 good_gemm)
    expect_error("gemm inner dimension mismatch", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, torch.randn(4, 5) if bad else Wm, counts),
                 bad_rank, good_gemm)
    if WORLD > 1:
        expect_error("gemm N differs across ranks", "gemm_all_to_all",
                     lambda bad: ops.gemm_all_to_all(X, torch.randn(3, 6) if bad else Wm, counts),
                     bad_rank, good_gemm)
    # grouped products: counts [world][G] must match W's G groups and X's rows
    Wg = torch.randn(2, 3, 5, generator=g)
    gcounts = [[c // 2, c - c // 2] for c in counts]
    good_grouped = lambda: ops.gemm_all_to_all(X, Wg, gcounts)  # noqa: E731
    expect_error("grouped gemm counts for the wrong number of groups", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, Wg, [row + [0] for row in gcounts]
                                                 if bad else gcounts), bad_rank, good_grouped)
    expect_error("grouped gemm counts not summing to M", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(
                     X, Wg, [[a + 1, b] for a, b in gcounts] if bad else gcounts),
                 bad_rank, good_grouped)
    expect_error("grouped gemm flat send_counts", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, Wg, counts if bad else gcounts), bad_rank,
                 good_grouped)
    expect_error("grouped gemm without groups", "gemm_all_to_all",
                 lambda bad: ops.gemm_all_to_all(X, Wg[:0] if bad else Wg,
                                                 [[] for _ in gcounts] if bad else gcounts),
                 bad_rank, good_grouped)

    e = embedding_case(77, torch.float32, empty_rank=None)
    ew, ei, eo = e[0], e[1], e[2]
    good_emb = lambda: ops.embedding_all_to_all(ew, ei, eo)  # noqa: E731
    # give the bad rank a table of its own for these cases, shaped like the others'
    table_dims = ctx.comm.allgather(ew[0].shape[1] if ew else -1) if WORLD > 1 else \
        [ew[0].shape[1] if ew else -1]
    dim = max(table_dims)
    batch_all = ctx.comm.allgather(eo[0].numel() if eo else -1) if WORLD > 1 else \
        [eo[0].numel() if eo else -1]
    batch = max(batch_all)

    def emb_with(bad, index_shift=0, offset_fix=None, table_dtype=torch.float32, mode="sum",
                 psw=None, table_rows=5):
        if not bad:
            return ops.embedding_all_to_all(ew, ei, eo)
        wt = list(ew) + [torch.randn(table_rows, dim).to(table_dtype)]
        it = list(ei) + [torch.zeros(batch, dtype=torch.int64) + index_shift]
        ot = list(eo) + [offset_fix if offset_fix is not None else torch.arange(batch)]
        return ops.embedding_all_to_all(wt, it, ot, mode=mode, per_sample_weights=psw)

    if batch > 1:
        expect_error("embedding index >= table rows", "embedding_all_to_all",
                     lambda bad: emb_with(bad, index_shift=5), bad_rank, good_emb)
        expect_error("embedding negative index", "embedding_all_to_all",
                     lambda bad: emb_with(bad, index_shift=-1), bad_rank, good_emb)
        expect_error("embedding offsets out of range", "embedding_all_to_all",
                     lambda bad: emb_with(bad, offset_fix=torch.arange(batch) * 3), bad_rank,
                     good_emb)
        expect_error("embedding offsets decreasing", "embedding_all_to_all",
                     lambda bad: emb_with(bad, offset_fix=torch.arange(batch).flip(0)), bad_rank,
                     good_emb)
        expect_error("embedding wrong number of offsets", "embedding_all_to_all",
                     lambda bad: emb_with(bad, offset_fix=torch.arange(batch - 1)), bad_rank,
                     good_emb)
        expect_error("embedding integer table", "embedding_all_to_all",
                     lambda bad: emb_with(bad, table_dtype=torch.int64), bad_rank, good_emb)
        expect_error("embedding per-sample weights with mean", "embedding_all_to_all",
                     lambda bad: emb_with(bad, mode="mean", psw=[torch.ones(t.numel()) for t in
                                                                 ei] + [torch.ones(batch)]),
                     bad_rank, good_emb)
        expect_error("embedding unsupported mode", "embedding_all_to_all",
                     lambda bad: emb_with(bad, mode="max"), bad_rank, good_emb)
        expect_error("embedding indices that are not tensors", "embedding_all_to_all",
                     lambda bad: ops.embedding_all_to_all(
                         ew + [torch.randn(5, dim)], ei + [list(range(batch))],
                         eo + [torch.arange(batch)]) if bad else good_emb(), bad_rank, good_emb)
        if WORLD > 1:
            expect_error("embedding modes differ across ranks", "embedding_all_to_all",
                         lambda bad: emb_with(bad, mode="mean"), bad_rank, good_emb)
        expect_error("embedding indices on another device", "embedding_all_to_all",
                     lambda bad: ops.embedding_all_to_all(
                         ew + [torch.randn(5, dim)], ei + [torch.zeros(batch, dtype=torch.int64,
                                                                       device="meta")],
                         eo + [torch.arange(batch)]) if bad else good_emb(), bad_rank, good_emb)
    else:
        report(False, "embedding error cases", f"test case has batch {batch}; need > 1")


def check_compile():
    import torch._dynamo
    torch._dynamo.config.capture_scalar_outputs = True
    g = torch.Generator().manual_seed(11 + RANK)
    w = torch.randn(9, 5, generator=g, requires_grad=True)
    x = torch.randn(5, generator=g, requires_grad=True)
    X = torch.randn(7, 5, generator=g, requires_grad=True)
    counts = [7 // WORLD] * WORLD
    counts[-1] += 7 - sum(counts)

    # grouped products too: two groups, rows split between them
    group_counts = [[c // 2, c - c // 2] for c in counts]

    def f(w, x, X):
        y = torch.ops.rocmoe.gemv_all_reduce(w, x, ops._common.context_id(ctx))
        z = ops.gemm_all_to_all(X, w.t(), counts)
        zg = ops.gemm_all_to_all(X, torch.stack([w.t(), 2 * w.t()]), group_counts)
        return y.sum() + (z * 2).sum() + (zg * 3).sum()

    eager = f(w, x, X)
    eager.backward()
    ge = [t.grad.clone() for t in (w, x, X)]
    for t in (w, x, X):
        t.grad = None
    compiled = torch.compile(f, backend="aot_eager")
    out = compiled(w, x, X)
    out.backward()
    gc = [t.grad for t in (w, x, X)]
    ok = torch.allclose(out, eager, rtol=1e-5, atol=1e-4) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(ge, gc))
    report(ok, "torch.compile(aot_eager) forward+backward of gemv_all_reduce and gemm_all_to_all"
               " (plain and grouped)")
    e = embedding_case(4242, torch.float32)
    ew = [t.requires_grad_(True) for t in e[0]]
    emb_eager = ops.embedding_all_to_all(ew, e[1], e[2])
    emb_comp = torch.compile(lambda: ops.embedding_all_to_all(ew, e[1], e[2]) * 3,
                             backend="aot_eager")()
    emb_comp.sum().backward()
    report(torch.allclose(emb_comp, emb_eager * 3) and all(t.grad is not None for t in ew),
           "torch.compile(aot_eager) embedding_all_to_all forward+backward")


def check_nograd():
    """forward and errors again with grad mode off, where the functions run their
    implementation without the custom op (rocmoe/ops/__init__.py: _direct): the same
    results, and bad input on one rank raising on every rank."""
    with torch.no_grad():
        check_forward()
        check_errors()


GROUPS = {"forward": check_forward, "backward": check_backward, "repeat": check_repeat,
          "errors": check_errors, "compile": check_compile, "nograd": check_nograd}


def main() -> int:
    names = sys.argv[1:] or list(GROUPS)
    for name in names:
        try:
            GROUPS[name]()
        except Exception:  # noqa: BLE001 - report and keep the ranks in step as far as possible
            report(False, f"group {name} crashed", traceback.format_exc().replace("\n", " | "))
            ctx._release()
            sys.stdout.flush()
            os._exit(1)
    ctx.finalize()
    report.summary()
    return report.status()


if __name__ == "__main__":
    sys.exit(main())
