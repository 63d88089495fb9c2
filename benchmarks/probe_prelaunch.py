"""Where a GemmAllToAll handle's host time goes before its kernel is launched, from a busy
and from an idle GPU, against torch.matmul's whole call.

Why: at 2048^3 the handle and torch.matmul take the same time queued (27.98 / 27.86 us) and
about the same host time a call (20.8 / 21.5 us), yet from an idle GPU the handle takes
51.1 us against 45.7 (results/fused_gpu_h100_thirtyfirst_session_gemm_function.jsonl). A
call started from an idle GPU waits for everything the host does before the launch; torch
does part of its host work after its launch, the lean call (rocmoe/ops/gpu/gemm_plans.py,
lean_gemm_call) does all of it before. This probe times, on the handle's lean call:

* `pre_launch_us` / `post_launch_us`: from the call's start to the native launch's entry,
  and from there to the call's return (the launch included), by wrapping the plan's
  NativeLaunch.launch_as_written; medians of calls made back to back with the GPU busy
  (`busy`) and of calls each made after a synchronize (`idle`: caches as a model's first
  kernel after a host sync finds them);
* the pieces of the pre-launch work, each alone with the GPU busy: the status word's read,
  the stream getter, the capture check, the device counts, the output ring's take, the lean
  launch (pointer writes and the launch) and the launch alone;
* torch.matmul's and torch.empty's host time, busy and idle, and the idle-start time of the
  handle and of torch.matmul (rocmoe.bench.fused_gpu.idle_ms), interleaved and each alone.

The thirty-first session's H100 (results/probe_prelaunch_h100_thirtyfirst_session.jsonl,
before the `alone` figures): 6.7-7.2 us before the launch, busy or idle, and a whole call
shorter than torch's, yet 4.5-5.7 us slower from an idle GPU: the gap is on the GPU.

One JSON line per shape. Needs a GPU.

    python3 benchmarks/probe_prelaunch.py [--shapes 2048x2048x2048,512x4096x4096] [--calls 200]
        [--gemv 8192x8192:bf16,8192x8192:fp32] [--trace ROUNDS]

`--trace ROUNDS` adds CUPTI traces of the idle-start calls (launch to kernel start, the
kernel's time), interleaved and alone: the thirty-second session's H100 showed the
handle's idle-start gap only interleaved (2048^3: 41.0 against torch's 38.7, alone 36.1
against 36.4).

A GemvAllReduce handle gets the same split (`prelaunch_gemv` lines): the host time before
and after its C launch function, and idle-start against torch.mv.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (probe_idle_gap, --trace)


def _busy_us(fn, calls: int) -> float:
    """Median host us of one call of `fn`, made back to back behind ~0.1 s of GPU sleep."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def _idle_us(fn, calls: int) -> float:
    """Median host us of one call of `fn`, each made after a synchronize."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def _against_torch(call, theirs, a) -> dict:
    """Host us of the handle's call and of torch's op, busy and idle, and their idle-start
    us interleaved and each alone (no other kernel between its samples: a gap that only the
    interleaved loop shows comes from following the other kernel, its shared-memory
    configuration or its code in the instruction caches, not from our launch), and the
    handle's interleaved with a one-block kernel instead of torch's op."""
    from rocmoe.bench.fused_gpu import idle_ms
    idle = idle_ms({"handle": call, "torch": theirs}, a.reps)
    word = torch.zeros(1, device="cuda")
    tiny = lambda: word.add_(1)  # noqa: E731 - a one-block kernel of torch's
    after_tiny = idle_ms({"handle": call, "tiny": tiny}, a.reps)
    return dict(
        handle_host_busy_us=round(_busy_us(call, a.calls), 3),
        handle_host_idle_us=round(_idle_us(call, a.calls), 3),
        torch_host_busy_us=round(_busy_us(theirs, a.calls), 3),
        torch_host_idle_us=round(_idle_us(theirs, a.calls), 3),
        handle_idle_start_us=round(idle["handle"] * 1e3, 2),
        torch_idle_start_us=round(idle["torch"] * 1e3, 2),
        handle_idle_start_alone_us=round(idle_ms({"h": call}, a.reps)["h"] * 1e3, 2),
        torch_idle_start_alone_us=round(idle_ms({"t": theirs}, a.reps)["t"] * 1e3, 2),
        handle_idle_start_after_tiny_us=round(after_tiny["handle"] * 1e3, 2),
        **(_traces(call, theirs, tiny, a.trace) if a.trace else {}))


def _traces(call, theirs, tiny, rounds: int) -> dict:
    """CUPTI's view of the idle-start calls (benchmarks/probe_idle_gap.py: traced), the two
    calls interleaved and each alone: from the launch call to the kernel's start on the GPU,
    and the kernel's own time. Which of the two grows when a call follows the other's
    kernel says whether an interleaved gap is the launch's or the kernel's."""
    from probe_idle_gap import traced
    keep = ("host_to_launch", "launch_call", "launch_to_gpu", "gpu_busy", "gpu_ops",
            "samples", "ops", "error")

    def brief(r):
        return {k: v for k, v in r.items() if k in keep}
    try:
        both = traced({"handle": call, "torch": theirs}, rounds)
        # after a one-block kernel (`tiny`) instead: is it any other kernel before ours, or
        # the GEMM's (its L2 lines, its shared-memory carve-out)?
        after_tiny = traced({"handle": call, "tiny": tiny}, rounds)
        return dict(trace_interleaved={k: brief(v) for k, v in both.items()},
                    trace_after_tiny=brief(after_tiny["handle"]),
                    trace_alone={"handle": brief(traced(call, rounds)),
                                 "torch": brief(traced(theirs, rounds))})
    except Exception as exc:  # noqa: BLE001 - the untraced figures stand on their own
        return dict(trace_error=f"{type(exc).__name__}: {exc}"[:300])


def _split(lean, x, w, counts, nl, calls: int, idle: bool) -> tuple:
    """(median us before the launch, median us from the launch's entry to the return)."""
    marks = []
    original = nl.launch_as_written

    def marked(grid_x, stream):
        marks.append(time.perf_counter_ns())
        return original(grid_x, stream)

    nl.launch_as_written = marked
    pre, post = [], []
    try:
        torch.cuda.synchronize()
        if not idle:
            torch.cuda._sleep(200_000_000)
        for _ in range(calls):
            if idle:
                torch.cuda.synchronize()
            del marks[:]
            t0 = time.perf_counter_ns()
            taken = lean(x, w, counts)
            t1 = time.perf_counter_ns()
            if taken is None or len(marks) != 1:
                raise SystemExit("probe_prelaunch: the lean call did not take the native "
                                 f"launch once (taken: {taken is not None}, {len(marks)})")
            pre.append(marks[0] - t0)
            post.append(t1 - marks[0])
            del taken
        torch.cuda.synchronize()
    finally:
        del nl.launch_as_written  # the class's method again
    return statistics.median(pre) / 1e3, statistics.median(post) / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048x2048,512x4096x4096")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemv", default="8192x8192:bf16,8192x8192:fp32",
                    help="GemvAllReduce shapes NxK:dtype (empty: none)")
    ap.add_argument("--trace", type=int, default=0, metavar="ROUNDS",
                    help="also trace ROUNDS idle-start calls of each under CUPTI, "
                         "interleaved and alone (trace_* fields)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_prelaunch needs a GPU")
    import rocmoe
    from rocmoe import ops
    from rocmoe.bench.fused_gpu import random_gemm_inputs
    from rocmoe.ops.outputs import capturing
    ctx = rocmoe.init(backend="ipc", heap_size=2 << 30)
    dtype, dev = torch.bfloat16, ctx.device
    g = torch.Generator(device=dev).manual_seed(5)
    for shape in a.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x, w = random_gemm_inputs(m, k, n, dev, g, dtype)
        counts = [m]
        h = ops.GemmAllToAll(ctx, m, k, n, dtype)
        with torch.no_grad():
            for _ in range(5):
                h(x, w, counts)
            torch.cuda.synchronize()
            lean = h.__dict__["_lean"]
            cells = dict(zip(lean.__code__.co_freevars,
                             (c.cell_contents for c in lean.__closure__)))
            take, stream, ints_of, plan_of = (cells["take"], cells["stream"],
                                              cells["ints_of"], cells["plan_of"])
            status, clear = cells["status"], cells["clear"]
            plan, fast = plan_of(m.bit_length() if m > 1 else 1)
            if fast is None:
                raise SystemExit(f"probe_prelaunch: no lean launch for {shape}")
            nl, s = fast.nl, stream()
            counts_t = ints_of(counts)
            out, recv = take(capturing(), s)  # held: the pieces below launch into it
            if fast(x, w, counts_t, out, recv, s) is not True:
                raise SystemExit(f"probe_prelaunch: the lean launch declined {shape}")
            pieces = {
                "status_read": lambda: status.tobytes() != clear,
                "stream": stream,
                "capturing": capturing,
                "device_counts": lambda: ints_of(counts),
                "ring_take": lambda: take(capturing(), s),
                "lean_launch": lambda: fast(x, w, counts_t, out, recv, s),
                "launch_alone": lambda: nl.launch_as_written(plan.nprog, s),
                "torch_empty": lambda: torch.empty((m, n), dtype=dtype, device=dev),
            }
            rec = dict(probe="prelaunch", shape=dict(m=m, k=k, n=n),
                       device=torch.cuda.get_device_name(), calls=a.calls)
            rec["pieces_busy_us"] = {name: round(_busy_us(fn, a.calls), 3)
                                     for name, fn in pieces.items()}
            out = recv = None  # (the lean calls below may take them from the ring again)
            for mode in ("busy", "idle"):
                pre, post = _split(lean, x, w, counts, nl, a.calls, mode == "idle")
                rec[f"lean_pre_launch_{mode}_us"] = round(pre, 3)
                rec[f"lean_post_launch_{mode}_us"] = round(post, 3)
            call = lambda: h(x, w, counts)  # noqa: E731
            mm = lambda: torch.matmul(x, w)  # noqa: E731
            rec.update(_against_torch(call, mm, a))
            print(json.dumps(rec), flush=True)
        h.close()
    for shape in filter(None, a.gemv.split(",")):
        try:
            print(json.dumps(_gemv_record(ctx, shape, a)), flush=True)
        except Exception as exc:  # noqa: BLE001 - the GEMM lines above stand on their own
            print(json.dumps(dict(probe="prelaunch_gemv", shape=shape,
                                  error=f"{type(exc).__name__}: {exc}")), flush=True)
    ctx.finalize()
    return 0


def _gemv_record(ctx, shape: str, a) -> dict:
    """The same split for a GemvAllReduce handle (`NxK:dtype`) against torch.mv: host time
    before the C launch function (GemvLaunch.fn, wrapped) and after, busy and idle, and
    idle-start interleaved and alone."""
    from rocmoe import ops
    dims, _, dname = shape.partition(":")
    n, k = (int(v) for v in dims.split("x"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname or "bf16"]
    dev = ctx.device
    w = torch.randn(n, k, device=dev).to(dtype)
    x = torch.randn(k, device=dev).to(dtype)
    h = ops.GemvAllReduce(ctx, n, k, dtype)
    rec = dict(probe="prelaunch_gemv", shape=dict(n=n, k=k), dtype=dname or "bf16",
               device=torch.cuda.get_device_name(), calls=a.calls)
    try:
        with torch.no_grad():
            for _ in range(5):
                h(w, x)
            torch.cuda.synchronize()
            launch = h.__dict__["_gemv_launch"]
            original, marks = launch.fn, []

            def marked(args, abort):
                marks.append(time.perf_counter_ns())
                return original(args, abort)

            call = lambda: h(w, x)  # noqa: E731
            mv = lambda: torch.mv(w, x)  # noqa: E731
            launch.fn = marked
            try:
                for mode in ("busy", "idle"):
                    pre, post = [], []
                    torch.cuda.synchronize()
                    if mode == "busy":
                        torch.cuda._sleep(200_000_000)
                    for _ in range(a.calls):
                        if mode == "idle":
                            torch.cuda.synchronize()
                        del marks[:]
                        t0 = time.perf_counter_ns()
                        call()
                        t1 = time.perf_counter_ns()
                        pre.append(marks[0] - t0)
                        post.append(t1 - marks[0])
                    torch.cuda.synchronize()
                    rec[f"pre_launch_{mode}_us"] = round(statistics.median(pre) / 1e3, 3)
                    rec[f"post_launch_{mode}_us"] = round(statistics.median(post) / 1e3, 3)
            finally:
                launch.fn = original
            rec.update(_against_torch(call, mv, a))
    finally:
        h.close()
    return rec


if __name__ == "__main__":
    sys.exit(main())
