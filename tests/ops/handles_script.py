"""Multi-rank checks of the persistent fused-op handles on the host backend (launched by
test_handles.py).

    mpiexec -n N python tests/ops/handles_script.py GROUP [GROUP ...]

GROUPS: match backward create_mismatch abort timeout. Every rank prints "rank r ok <what>"
or "rank r FAIL <what>: ..." per check and exits 1 if any failed. The references are
rocmoe.ops.reference (compute with torch, move with MPI), on the same inputs.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

import rocmoe
import rocmoe.ops as ops
from rocmoe.ops import reference as ref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rank_report import RankReport  # noqa: E402

torch.set_num_threads(1)
ctx = rocmoe.init(backend="host", heap_size=128 << 20)
RANK, WORLD = ctx.rank, ctx.world_size
report = RankReport(f"rank {RANK}")


def close(a, b, tol=1e-4) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or torch.allclose(a.float(), b.float(),
                                                                    rtol=tol, atol=tol))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + RANK)


def heap_state():
    return ctx.heap.free_bytes, ctx.heap.largest_free_block \
        if hasattr(ctx.heap, "largest_free_block") else None, ctx.heap.live_allocations


def split(m: int, g: torch.Generator) -> list[int]:
    cuts = sorted(int(c) for c in torch.randint(0, m + 1, (WORLD - 1,), generator=g))
    return [b - a for a, b in zip([0] + cuts, cuts + [m])]


def check_match():
    gemm = ops.GemmAllToAll(ctx, max_rows=32, K=6, N=5, dtype=torch.float32)
    grouped = ops.GemmAllToAll(ctx, max_rows=32, K=6, N=5, dtype=torch.float32, groups=3)
    rows = ops.AllToAllRows(ctx, max_rows=32, width=7, dtype=torch.bfloat16)
    bad = []
    for call in range(6):
        g = gen(call)
        m = int(torch.randint(0, 30, (1,), generator=g))
        counts = split(m, g)
        x, w = torch.randn(m, 6, generator=g), torch.randn(6, 5, generator=g)
        # a list on even calls, a tensor on odd ones
        out, recv = gemm(x, w, counts if call % 2 == 0 else torch.tensor(counts))
        want = ref.gemm_all_to_all(x, w, counts)
        if not (close(out[:int(recv.sum())], want) and int(recv.sum()) == want.shape[0]):
            bad.append(f"GemmAllToAll call {call}")
        gc = [[int(c) for c in torch.randint(0, 4, (3,), generator=g)] for _ in range(WORLD)]
        xg, wg = torch.randn(sum(map(sum, gc)), 6, generator=g), torch.randn(3, 6, 5, generator=g)
        out, recv = grouped(xg, wg, gc)
        want = ref.gemm_all_to_all(xg, wg, gc)
        if not close(out[:int(recv.sum())], want):
            bad.append(f"grouped GemmAllToAll call {call}")
        r = torch.randn(m, 7, generator=g).to(torch.bfloat16)
        out, recv = rows(r, counts)
        want, _ = ref.alltoallv_rows(ctx, r, counts)
        if not torch.equal(out[:int(recv.sum())], want):
            bad.append(f"AllToAllRows call {call}")
    report(not bad and gemm.epoch == 6 and grouped.epoch == 6 and rows.epoch == 6,
           "GemmAllToAll (plain, grouped) and AllToAllRows equal the reference over 6 calls",
           "; ".join(bad))

    # embedding: a rank without tables on 2+ ranks, sum / mean / per-sample weights
    counts_t = [(2 if r % 2 == 0 else 1) for r in range(WORLD)]
    if WORLD > 1:
        counts_t[-1] = 0
    sizes = [11 + 3 * t for t in range(sum(counts_t))]
    base = sum(counts_t[:RANK])
    mine = sizes[base:base + counts_t[RANK]]
    bad = []
    for mode in ("sum", "mean"):
        emb = ops.EmbeddingAllToAll(ctx, mine, dim=4, max_batch=8 * WORLD, max_lookups=64,
                                    mode=mode)
        for call in range(3):
            g = torch.Generator().manual_seed(7 + call)  # shared: every rank's global batch
            batch = WORLD * (1 + call)
            tables, idx, off, psw = [], [], [], []
            for rows_t in mine:
                lengths = torch.randint(0, 4, (batch,), generator=g)
                tables.append(torch.randn(rows_t, 4, generator=g))
                idx.append(torch.randint(0, rows_t, (int(lengths.sum()),), generator=g))
                off.append(torch.cumsum(lengths, 0) - lengths)
                psw.append(torch.rand(int(lengths.sum()), generator=g))
            use_psw = mode == "sum" and call == 2
            got = emb(tables, idx, off, psw if use_psw else None, batch=batch)
            want = ref.embedding_all_to_all(tables, idx, off, mode=mode,
                                            per_sample_weights=psw if use_psw else None)
            if not close(got, want):
                bad.append(f"EmbeddingAllToAll {mode} call {call}")
            packed = ops.pack_tables(tables, idx, off, psw)
            got = emb.batched(*packed[:3], packed[3] if use_psw else None, batch=batch)
            if not close(got, want):
                bad.append(f"EmbeddingAllToAll.batched {mode} call {call}")
        emb.close()
    report(not bad, "EmbeddingAllToAll and its batched (packed) call (sum, mean, per-sample "
           "weights, a rank without tables) equal the reference", "; ".join(bad))

    ks = [3 + r for r in range(WORLD)]
    gemv = ops.GemvAllReduce(ctx, 9, ks[RANK], torch.float32)
    bad = []
    for call in range(3):
        g = gen(50 + call)
        wv, xv = torch.randn(9, ks[RANK], generator=g), torch.randn(ks[RANK], generator=g)
        if not close(gemv(wv, xv), ref.gemv_all_reduce(wv, xv)):
            bad.append(f"call {call}")
    report(not bad and gemv.epoch == 3, "GemvAllReduce equals the reference", "; ".join(bad))
    for h in (gemm, grouped, rows, gemv):
        h.close()


def check_backward():
    gemm = ops.GemmAllToAll(ctx, max_rows=32, K=6, N=5, dtype=torch.float32, groups=2)
    g = gen(90)
    gc = [[int(c) for c in torch.randint(0, 5, (2,), generator=g)] for _ in range(WORLD)]
    x = torch.randn(sum(map(sum, gc)), 6, generator=g, requires_grad=True)
    w = torch.randn(2, 6, 5, generator=g, requires_grad=True)
    out, recv = gemm(x, w, gc)
    n = int(recv.sum())
    gout = torch.randn(n, 5, generator=g)
    (out[:n] * gout).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (ref.gemm_all_to_all(x2, w2, gc) * gout).sum().backward()
    report(close(x.grad, x2.grad, 1e-3) and close(w.grad, w2.grad, 1e-3),
           "GemmAllToAll backward (grouped) equals the reference's")
    mine = [13, 17] if RANK == 0 else [5]
    emb = ops.EmbeddingAllToAll(ctx, mine, dim=4, max_batch=4 * WORLD, max_lookups=64)
    g = torch.Generator().manual_seed(91)
    batch = 4 * WORLD
    tables = [torch.randn(r, 4, generator=g).requires_grad_(True) for r in mine]
    lengths = [torch.randint(0, 4, (batch,), generator=g) for _ in mine]
    idx = [torch.randint(0, r, (int(n.sum()),), generator=g) for r, n in zip(mine, lengths)]
    off = [torch.cumsum(n, 0) - n for n in lengths]
    gsum = torch.randn(batch // WORLD, sum(2 if r == 0 else 1 for r in range(WORLD)), 4,
                       generator=gen(92))
    (emb(tables, idx, off) * gsum).sum().backward()
    tables2 = [t.detach().clone().requires_grad_(True) for t in tables]
    (ref.embedding_all_to_all(tables2, idx, off) * gsum).sum().backward()
    report(all(close(a.grad, b.grad, 1e-4) for a, b in zip(tables, tables2)),
           "EmbeddingAllToAll backward equals the reference's")
    weight, pidx, poff, _ = ops.pack_tables([t.detach() for t in tables], idx, off)
    weight.requires_grad_(True)
    (emb.batched(weight, pidx, poff) * gsum).sum().backward()
    report(close(weight.grad, torch.cat([t.grad for t in tables2]), 1e-4),
           "EmbeddingAllToAll.batched backward reaches the packed weight, equal to the "
           "reference's per-table gradients")
    gemm.close()
    emb.close()


def check_create_mismatch():
    before = heap_state()
    try:
        ops.GemmAllToAll(ctx, max_rows=8, K=4, N=5 + (RANK == WORLD - 1), dtype=torch.float32)
    except rocmoe.errors.InvalidArgumentError as exc:
        text = str(exc)
        named = "N" in text and all(f"rank {r}: {5 + (r == WORLD - 1)}" in text
                                    for r in range(WORLD))
        report(named and heap_state() == before,
               "a GemmAllToAll whose N differs across ranks raises on every rank, naming the "
               "field and each rank's value, with the heap as it was", text[:160])
    else:
        report(False, "a GemmAllToAll whose N differs across ranks was created")
    # a size that is not an integer on one rank: that rank names it, the others name the rank
    bad = RANK == WORLD - 1
    makers = {
        "GemmAllToAll with K=4.5": lambda: ops.GemmAllToAll(
            ctx, max_rows=8, K=4.5 if bad else 4, N=5, dtype=torch.float32),
        "GemvAllReduce with N=None": lambda: ops.GemvAllReduce(
            ctx, None if bad else 6, 3, torch.float32),
        "EmbeddingAllToAll with table_rows=5": lambda: ops.EmbeddingAllToAll(
            ctx, 5 if bad else [5], dim=4, max_batch=4 * WORLD, max_lookups=16),
    }
    for what, make in makers.items():
        before = heap_state()
        try:
            make()
        except rocmoe.errors.InvalidArgumentError as exc:
            text = str(exc)
            named = ("must be an integer" in text or "must be a list of integers" in text
                     if bad else f"rank(s) [{WORLD - 1}] rejected their arguments" in text)
            report(named and heap_state() == before,
                   f"a {what} on rank {WORLD - 1} raises on every rank, with the heap as it was",
                   text[:160])
        except Exception as exc:  # noqa: BLE001 - must be an InvalidArgumentError
            report(False, f"a {what} on rank {WORLD - 1}", f"raised {type(exc).__name__}: {exc}")
        else:
            report(False, f"a {what} on rank {WORLD - 1} was created")


def expect_abort(what: str, handle, call_bad, call_good, want_local):
    """call_bad() on every rank (bad on the last rank only): the last rank raises want_local,
    the others InvalidArgumentError naming it; the heap and the next call are fine."""
    before = heap_state()
    bad_rank = WORLD - 1
    try:
        call_bad(RANK == bad_rank)
    except rocmoe.RocmoeError as exc:
        if RANK == bad_rank:
            ok = isinstance(exc, want_local)
        else:
            ok = isinstance(exc, rocmoe.errors.InvalidArgumentError) and \
                f"rank {bad_rank} rejected its input" in str(exc)
        report(ok and heap_state() == before, f"{what}: {type(exc).__name__} on every rank",
               str(exc)[:160])
    else:
        report(WORLD == 1 and RANK != bad_rank, f"{what}: no error raised")
    try:
        call_good()
        report(True, f"usable after {what}")
    except Exception as exc:  # noqa: BLE001
        report(False, f"usable after {what}", repr(exc))


def check_abort():
    gemm = ops.GemmAllToAll(ctx, max_rows=8, K=4, N=5, dtype=torch.float32)
    x, w = torch.randn(2 * WORLD, 4), torch.randn(4, 5)
    counts = [2] * WORLD
    good = lambda: gemm(x, w, counts)  # noqa: E731
    good()
    expect_abort("GemmAllToAll X of the wrong width", gemm,
                 lambda bad: gemm(x[:, :3] if bad else x, w, counts), good,
                 rocmoe.errors.InvalidArgumentError)
    expect_abort("GemmAllToAll X of the wrong dtype", gemm,
                 lambda bad: gemm(x.double() if bad else x, w, counts), good,
                 rocmoe.errors.DTypeError)
    expect_abort("GemmAllToAll counts above max_rows", gemm,
                 lambda bad: gemm(torch.randn(20, 4) if bad else x, w,
                                  [20] + [0] * (WORLD - 1) if bad else counts), good,
                 rocmoe.errors.InvalidArgumentError)
    expect_abort("GemmAllToAll X that is not a tensor", gemm,
                 lambda bad: gemm(x.tolist() if bad else x, w, counts), good,
                 rocmoe.errors.InvalidArgumentError)
    expect_abort("GemmAllToAll counts beyond the rows", gemm,
                 lambda bad: gemm(x, w, [3] + [2] * (WORLD - 1) if bad else counts), good,
                 rocmoe.errors.InvalidArgumentError)
    gemv = ops.GemvAllReduce(ctx, 6, 3, torch.float32)
    wv, xv = torch.randn(6, 3), torch.randn(3)
    expect_abort("GemvAllReduce x of the wrong length", gemv,
                 lambda bad: gemv(wv, torch.randn(4) if bad else xv), lambda: gemv(wv, xv),
                 rocmoe.errors.InvalidArgumentError)
    emb = ops.EmbeddingAllToAll(ctx, [5], dim=4, max_batch=4 * WORLD, max_lookups=16)
    tab = [torch.randn(5, 4)]
    idx, off = [torch.tensor([0, 1, 4, 2] * WORLD)], [torch.arange(0, 4 * WORLD)]
    expect_abort("EmbeddingAllToAll index outside the table", emb,
                 lambda bad: emb(tab, [torch.tensor([0, 1, 5, 2] * WORLD)] if bad else idx, off),
                 lambda: emb(tab, idx, off), rocmoe.errors.InvalidArgumentError)
    expect_abort("EmbeddingAllToAll indices that are not a sequence", emb,
                 lambda bad: emb(tab, None if bad else idx, off),
                 lambda: emb(tab, idx, off), rocmoe.errors.InvalidArgumentError)
    expect_abort("EmbeddingAllToAll batch above max_batch", emb,
                 lambda bad: emb(tab, [torch.zeros(8 * WORLD, dtype=torch.long)] if bad else idx,
                                 [torch.arange(0, 8 * WORLD)] if bad else off),
                 lambda: emb(tab, idx, off), rocmoe.errors.InvalidArgumentError)
    poff = torch.arange(0, 4 * WORLD + 1)
    expect_abort("EmbeddingAllToAll.batched offsets not num_tables * B + 1", emb,
                 lambda bad: emb.batched(tab[0], idx[0], poff[:-1] if bad else poff),
                 lambda: emb.batched(tab[0], idx[0], poff), rocmoe.errors.InvalidArgumentError)
    expect_abort("EmbeddingAllToAll.batched index outside its table", emb,
                 lambda bad: emb.batched(tab[0], torch.tensor([0, 1, 5, 2] * WORLD)
                                         if bad else idx[0], poff),
                 lambda: emb.batched(tab[0], idx[0], poff), rocmoe.errors.InvalidArgumentError)
    expect_abort("EmbeddingAllToAll.batched weight of the wrong rows", emb,
                 lambda bad: emb.batched(torch.randn(6, 4) if bad else tab[0], idx[0], poff),
                 lambda: emb.batched(tab[0], idx[0], poff), rocmoe.errors.InvalidArgumentError)
    for h in (gemm, gemv, emb):
        h.close()


def check_timeout():
    # the last rank skips a call: every other rank's bounded wait ends in CommTimeoutError
    # naming it, within the bound; the handle is then unusable on those ranks
    gemm = ops.GemmAllToAll(ctx, max_rows=8, K=4, N=5, dtype=torch.float32)
    x, w = torch.randn(2 * WORLD, 4), torch.randn(4, 5)
    gemm(x, w, [2] * WORLD)
    if RANK == WORLD - 1:
        report(True, "the last rank skipped a call")
        # stay alive (a timeout, not a dead peer) until the others have timed out, then meet
        # them in finalize()'s barrier
        time.sleep(ctx.timeout_s + 0.5)
        _fresh_handle_works()
        return
    start = time.monotonic()
    try:
        gemm(x, w, [2] * WORLD)
    except rocmoe.errors.CommTimeoutError as exc:
        took = time.monotonic() - start
        report(f"rank {WORLD - 1}" in str(exc) and took < ctx.timeout_s + 5,
               f"a skipped call: CommTimeoutError naming the rank after {took:.1f} s",
               str(exc)[:160])
        try:
            gemm(x, w, [2] * WORLD)
            report(False, "a handle that timed out was still callable")
        except rocmoe.errors.ContextError:
            report(True, "a handle that timed out refuses further calls")
        _fresh_handle_works()
        return
    report(False, "a skipped call did not time out")


def _fresh_handle_works():
    # the context outlives a broken handle: its barrier (inside a new handle's collective
    # allocation) does not raise the old failure again, and the new handle computes
    gemm = ops.GemmAllToAll(ctx, max_rows=8, K=4, N=5, dtype=torch.float32)
    x, w = torch.full((2 * WORLD, 4), float(RANK + 1)), torch.ones(4, 5)
    out, recv = gemm(x, w, [2] * WORLD)
    gemm.synchronize()
    want = torch.cat([torch.full((2, 5), 4.0 * (s + 1)) for s in range(WORLD)])
    report(bool(torch.equal(out[:2 * WORLD], want)) and recv.tolist() == [2] * WORLD,
           "after a timeout, a new handle on the same context is created and computes")
    gemm.close()


GROUPS = {"match": check_match, "backward": check_backward,
          "create_mismatch": check_create_mismatch, "abort": check_abort,
          "timeout": check_timeout}


def main():
    for name in sys.argv[1:] or list(GROUPS):
        try:
            GROUPS[name]()
        except Exception:  # noqa: BLE001
            report(False, f"group {name} crashed", traceback.format_exc().replace("\n", " | "))
    report.summary()
    ctx.finalize()
    sys.exit(report.status())


if __name__ == "__main__":
    main()
