"""GEMV+AllReduce kernel variants at world size 1 against torch.mv (GPU machine).

    source benchmarks/device_env.sh && build_cuda $OUT/build.log &&
    python3 benchmarks/gemv_variants.py --out $OUT/gemv.jsonl

Each variant is a set of ROCMOE_GEMV_* knobs (hip/src/gpu/fused_gemv.hip reads them once per
process), so each runs in a subprocess of its own. There, through the public handle
(rocmoe.ops.GemvAllReduce at world size 1), for every shape and dtype:

* correctness against float64 (W and x as the dtype holds them, multiplied in float64) on
  fresh random inputs: the eager call's output (its buffer poisoned with NaN first, when the
  caching allocator hands the same block back: ``poisoned``) and the CUDA graph's output
  (its static buffer filled with NaN before a replay); rel err < 1e-5 fp32, < 1e-2 bf16;
  and, untimed, small edge shapes in bf16, fp32 and fp16 (< 5e-3): K not a multiple of a
  16-byte vector, x not 16-byte aligned, fewer rows than a group, ...;
* time against torch.mv on the same inputs, interleaved (rocmoe.bench.timing): replayed
  from CUDA graphs and queued eager calls between events; ratio = torch_ms / rocmoe_ms.

One JSON line per (variant, shape, dtype) goes to stdout and --out; a table follows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _registers(rows: int, unroll: int, load: int) -> dict:
    """The knobs of the register kernel at world size 1 (no cp.async ring) with `rows` rows
    a wave, `unroll` 16-byte loads in flight and W's load flavour `load` (0 ld.global.nc,
    1 + L1::no_allocate, 2 + L2::256B prefetch)."""
    return {"ROCMOE_GEMV_STAGES": "0", "ROCMOE_GEMV_ROWS_PER_WARP": str(rows),
            "ROCMOE_GEMV_UNROLL": str(unroll), "ROCMOE_GEMV_LOAD": str(load)}


# name -> knobs (every other ROCMOE_GEMV_* is removed from the child's environment); the
# first is the built-in default (since the H200 sweep of 2026-12-02 the register kernel, one
# row a wave, 4 loads in flight; its loads ld.global.nc, what reg_r1_u4_l0 names, except on
# an H100, where since the thirty-third session they skip L1: reg_r1_u4_l1), the second the
# kernel as it was (one wave per row, the persistent protocol kernel at world size 1, 32-row
# tasks, L1-cached loads). The last eight run only when named (or with --variants all).
VARIANTS = {
    "default": {},
    "legacy": {"ROCMOE_GEMV_DIRECT": "0", "ROCMOE_GEMV_ROWS_PER_WARP": "1",
               "ROCMOE_GEMV_UNROLL": "4", "ROCMOE_GEMV_ROWS": "32"},
    "async_r1_s6": {"ROCMOE_GEMV_ROWS_PER_WARP": "1", "ROCMOE_GEMV_STAGES": "6"},
    "async_r2_s3": {"ROCMOE_GEMV_ROWS_PER_WARP": "2", "ROCMOE_GEMV_STAGES": "3"},
    "async_r2_s4_cu3": {"ROCMOE_GEMV_ROWS_PER_WARP": "2", "ROCMOE_GEMV_STAGES": "4",
                        "ROCMOE_GEMV_PER_CU": "3"},
    "reg_r2_u4_l2": _registers(2, 4, 2),
    "reg_r4_u2_l2": _registers(4, 2, 2),
    "reg_r2_u4_l0": _registers(2, 4, 0),
    "reg_r1_u4_l0": _registers(1, 4, 0),
    "protocol_r2_u4": {"ROCMOE_GEMV_DIRECT": "0", "ROCMOE_GEMV_ROWS_PER_WARP": "2",
                       "ROCMOE_GEMV_UNROLL": "4"},
    # on request only
    "async_r1_s4": {"ROCMOE_GEMV_ROWS_PER_WARP": "1", "ROCMOE_GEMV_STAGES": "4"},
    "reg_r2_u2_l2": _registers(2, 2, 2),
    "reg_r2_u4_l1": _registers(2, 4, 1),
    "protocol_r2_u2": {"ROCMOE_GEMV_DIRECT": "0", "ROCMOE_GEMV_ROWS_PER_WARP": "2",
                       "ROCMOE_GEMV_UNROLL": "2"},
    # the default kernel's neighbours, first swept on an H100 in the thirty-third session:
    # eight loads in flight, and W's loads without L1 allocation, with and without an L2
    # prefetch
    "reg_r1_u8_l0": _registers(1, 8, 0),
    "reg_r1_u4_l1": _registers(1, 4, 1),
    "reg_r1_u4_l2": _registers(1, 4, 2),
    # the default kernel with W's chunks split evenly over the waves instead of its rows
    # (hip/src/gpu/fused_gemv.hip: walk_chunks); it applies where the rows outnumber the
    # resident grid's waves (4,224 on an H200), elsewhere it is the default
    "balance": {"ROCMOE_GEMV_BALANCE": "1"},
}
SWEEP = list(VARIANTS)[:10]
SHAPES = [(8192, 8192), (28672, 8192), (16384, 16384), (4096, 4096), (8192, 28672)]
DTYPES = ("bf16", "fp32")
# checked, not timed: groups and rows of one, K of one vector or less (lanes past the row's
# end), K not a multiple of a 16-byte vector (element path), x not 16-byte aligned, and more
# rows than an H200's 4,224 resident waves with a row's last chunk short (the balanced
# split's cut rows)
EDGE = [(229, 16, 0), (37, 24, 0), (5, 8, 0), (3, 20, 0), (777, 1001, 0), (4097, 1000, 0),
        (1, 4096, 0), (512, 512, 1), (4801, 1000, 0), (9000, 4104, 0)]
EDGE_DTYPES = ("bf16", "fp32", "fp16")
TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 5e-3}


def rel_err(got, want) -> float:
    import torch
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


def time_against_mv(ours, replay_ours, theirs, replay_theirs, reps: int, calls: int,
                    nbytes: int) -> dict:
    """The record's timing fields: the handle (`ours`) against torch.mv (`theirs`), both
    warmed up, timed interleaved and queued (rocmoe.bench.timing.interleaved_ms), replayed
    from their CUDA graphs and as eager calls; ratio = torch ms / rocmoe ms; TB/s of
    `nbytes` (W, x and y) under graphs."""
    from rocmoe.bench.timing import interleaved_ms
    nothing = (lambda: None)
    graph = interleaved_ms({"rocmoe": (nothing, replay_ours), "torch": (nothing, replay_theirs)},
                           rounds=reps, calls=calls, queued=True)
    eager = interleaved_ms({"rocmoe": (nothing, ours), "torch": (nothing, theirs)},
                           rounds=reps, calls=calls, queued=True)
    return dict(rocmoe_graph_ms=round(graph["rocmoe"], 5),
                torch_graph_ms=round(graph["torch"], 5),
                ratio_graph=round(graph["torch"] / graph["rocmoe"], 4),
                rocmoe_queued_ms=round(eager["rocmoe"], 5),
                torch_queued_ms=round(eager["torch"], 5),
                ratio_queued=round(eager["torch"] / eager["rocmoe"], 4),
                tbps_graph=round(nbytes / (graph["rocmoe"] * 1e-3) / 1e12, 3),
                torch_tbps_graph=round(nbytes / (graph["torch"] * 1e-3) / 1e12, 3))


def child(args) -> int:
    import torch

    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.timing import captured

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    ctx = rocmoe.init(heap_size=256 << 20)
    dev = ctx.device
    on_gpu = dev.type == "cuda"
    if not on_gpu and not args.host_smoke:
        print(json.dumps({"error": f"needs a GPU backend, got {ctx.backend}"}), flush=True)
        return 2
    if on_gpu:
        print(json.dumps(dict(bench="gemv_variants", kind="device",
                              device=torch.cuda.get_device_name(), torch=torch.__version__)),
              flush=True)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()
    seed = int(args.seed)

    def inputs(n, k, dname, offset=0):
        nonlocal seed
        seed += 1
        g = torch.Generator(device=dev).manual_seed(seed)
        w = torch.randn(n, k, device=dev, generator=g).to(dtypes[dname])
        xbuf = torch.randn(k + offset, device=dev, generator=g).to(dtypes[dname])
        return w, xbuf[offset:]

    def eager_poisoned(h, w, x, n, dtype):
        """h(w, x), its output block filled with NaN before when the allocator reuses it."""
        y = None
        for _ in range(4):
            bait = torch.full((n,), float("nan"), dtype=dtype, device=dev)
            ptr = bait.data_ptr()
            del bait
            y = h(w, x)
            if y.data_ptr() == ptr:
                return y, True
        return y, False

    def check(n, k, dname, offset=0):
        w, x = inputs(n, k, dname, offset)
        want = w.double() @ x.double()
        h = ops.GemvAllReduce(ctx, n, k, dtypes[dname])
        with torch.no_grad():
            y, poisoned = eager_poisoned(h, w, x, n, dtypes[dname])
            err = rel_err(y, want)
            torch_err = rel_err(torch.mv(w, x), want)
        return w, x, want, h, dict(rel_err=err, poisoned=poisoned, torch_rel_err=torch_err)

    for n, k, offset in EDGE if not args.no_edge else []:
        for dname in EDGE_DTYPES:
            rec = dict(bench="gemv_variants", kind="edge", n=n, k=k, x_offset=offset,
                       dtype=dname)
            try:
                w, x, want, h, got = check(n, k, dname, offset)
                rec.update(got)
                rec["ok"] = got["rel_err"] < TOL[dname]
                h.close()
            except Exception as exc:  # noqa: BLE001 - reported as the record
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for n, k in shapes:
        for dname in args.dtypes.split(","):
            rec = dict(bench="gemv_variants", kind="timed", n=n, k=k, dtype=dname,
                       baseline="torch.mv")
            try:
                w, x, want, h, got = check(n, k, dname)
                rec.update(got)
                holder = []

                def ours():
                    holder.append(h(w, x))
                    del holder[:-1]

                def theirs():
                    return torch.mv(w, x)

                with torch.no_grad():
                    # the graph's static output: poisoned, replayed, compared (without a GPU,
                    # for --host-smoke, "replay" is a call with an output of its own)
                    ours()
                    replay_ours = captured(ours)
                    graph_out = holder[-1]  # on a GPU: the captured call's output

                    def replayed():
                        graph_out.fill_(float("nan"))
                        replay_ours()
                        sync()
                        return graph_out if on_gpu else holder[-1]

                    rec["graph_rel_err"] = rel_err(replayed(), want)
                    replay_theirs = captured(theirs)
                    for _ in range(3):
                        ours()
                        theirs()
                    nbytes = (n * k + k + n) * w.element_size()
                    rec.update(time_against_mv(ours, replay_ours, theirs, replay_theirs,
                                               args.reps, args.calls, nbytes))
                    # still right after the timed replays
                    rec["graph_rel_err_after"] = rel_err(replayed(), want)
                errs = (rec["rel_err"], rec["graph_rel_err"], rec["graph_rel_err_after"])
                rec["ok"] = all(e < TOL[dname] for e in errs)
                del replay_ours, replay_theirs, replayed, graph_out, holder[:]
                h.close()
            except Exception as exc:  # noqa: BLE001 - reported as the record
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)
            w = x = want = None
            if on_gpu:
                torch.cuda.empty_cache()
    ctx.finalize()
    return 0


def table(records, variants, out=sys.stdout) -> None:
    cases = []
    for r in records:
        key = (r.get("n"), r.get("k"), r.get("dtype"))
        if r.get("kind") == "timed" and key not in cases:
            cases.append(key)
    by = {(r["variant"], r.get("n"), r.get("k"), r.get("dtype")): r for r in records
          if r.get("kind") == "timed"}
    edge_bad = {}
    for r in records:
        if r.get("kind") == "edge" and not r.get("ok"):
            edge_bad.setdefault(r["variant"], []).append(f"{r['n']}x{r['k']}/{r['dtype']}")
    head = f"{'variant':18s}" + "".join(f"{f'{n}x{k} {d}':>17s}" for n, k, d in cases)
    print("\nratio = torch.mv ms / rocmoe ms, CUDA-graph replay (queued eager in brackets)",
          file=out)
    print(head, file=out)
    for v in variants:
        cells = []
        for n, k, d in cases:
            r = by.get((v, n, k, d))
            if r is None or "ratio_graph" not in r:
                cells.append(f"{'-':>17s}")
                continue
            mark = "" if r.get("ok") else "!"
            cells.append(f"{mark}{r['ratio_graph']:.3f} ({r['ratio_queued']:.2f})".rjust(17))
        line = f"{v:18s}" + "".join(cells)
        if v in edge_bad:
            line += "  edge FAIL: " + " ".join(edge_bad[v][:4])
        print(line, file=out)
    print("best per case (correct ones only):", file=out)
    for n, k, d in cases:
        good = [(by[(v, n, k, d)]["ratio_graph"], v) for v in variants
                if (v, n, k, d) in by and by[(v, n, k, d)].get("ok")
                and "ratio_graph" in by[(v, n, k, d)]]
        if good:
            ratio, v = max(good)
            r = by[(v, n, k, d)]
            print(f"  {n}x{k} {d}: {v} {ratio:.3f} ({r['rocmoe_graph_ms'] * 1e3:.1f} us vs "
                  f"{r['torch_graph_ms'] * 1e3:.1f} us, {r['tbps_graph']} TB/s)", file=out)
    print("'!': a correctness check failed (see the JSON line)", file=out)


def parent(args) -> int:
    names = {"sweep": SWEEP, "all": list(VARIANTS)}.get(args.variants)
    names = names or args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    out = open(args.out, "a") if args.out else None
    t0 = time.monotonic()
    records = []
    failed = False
    for v in names:
        left = args.budget_s - (time.monotonic() - t0)
        if left < 10:
            rec = dict(bench="gemv_variants", variant=v,
                       skipped=f"time budget {args.budget_s}s spent")
            print(json.dumps(rec), flush=True)
            continue
        env = {k: val for k, val in os.environ.items() if not k.startswith("ROCMOE_GEMV_")}
        env.update(VARIANTS[v])
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", args.shapes,
               "--dtypes", args.dtypes, "--reps", str(args.reps), "--calls", str(args.calls),
               "--seed", str(1000 * (names.index(v) + 1))]
        if args.no_edge:
            cmd.append("--no-edge")
        if args.host_smoke:
            cmd.append("--host-smoke")
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=min(args.child_timeout_s, left))
            output, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc = "timeout"
        for line in output.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rec.update(variant=v, env=VARIANTS[v])
            records.append(rec)
            failed |= rec.get("ok") is False
            line = json.dumps(rec)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
        status = dict(bench="gemv_variants", variant=v, child_rc=rc,
                      seconds=round(time.monotonic() - started, 1))
        if rc != 0:
            failed = True
            status["tail"] = output[-1500:]
        print(json.dumps(status), flush=True)
        if out:
            out.write(json.dumps(status) + "\n")
    table(records, names)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON lines appended here too")
    ap.add_argument("--variants", default="sweep",
                    help=f"'sweep' (the first ten), 'all', or a comma list of {list(VARIANTS)}")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--reps", type=int, default=10, help="interleaved rounds (medians)")
    ap.add_argument("--calls", type=int, default=5, help="calls between two events")
    ap.add_argument("--budget-s", type=float, default=130.0,
                    help="no variant is started after this many seconds")
    ap.add_argument("--child-timeout-s", type=float, default=60.0)
    ap.add_argument("--no-edge", action="store_true", help="skip the untimed edge shapes")
    ap.add_argument("--host-smoke", action="store_true",
                    help="let the children run on the host backend (checks this script only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", default="1", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
