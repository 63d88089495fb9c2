"""Why a fused call started from an idle GPU takes longer than its host time plus its kernel
(issue 14). At 128 x 4096^2 bf16 the bench measured GemmAllToAll at 61 us idle-start against
torch.matmul's 32, with 28 / 18 us of host time (GPU busy) and 15 / 13.5 us of kernel
(graph replay): about 20 us of ours are neither. This probe times each call idle-start, its
host time in that same idle state, and, under torch.profiler (CUPTI), where every iteration's
time goes: host before the launch, the launch call, launch to kernel start, the kernel.
Variants peel the call's layers off one at a time (the whole handle call, the plan's launch
with preallocated outputs, the native driver launch alone), so the layer that costs the gap
shows; both calls replayed from CUDA graphs (idle-start too) separate the kernel's own
start from the host's work before the launch. Prints and writes $OUT/probe_idle_gap.json."""
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import rocmoe
from rocmoe import ops
from rocmoe.bench.fused_gpu import host_us
from rocmoe.bench.timing import captured
from rocmoe.ops import gpu

OUT = os.environ.get("OUT", ".")
REPS = int(os.environ.get("PROBE_REPS", "25"))
# the GEMM shapes (M, K, N): PROBE_SHAPES="MxKxN,..." (default the three that missed 0.95
# idle-start in some run of the thirteenth session or before)
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "PROBE_SHAPES", "128x4096x4096,512x4096x4096,2048x2048x2048").split(",")]
_LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch")


def idle(fn, reps=REPS):
    """(median event ms x 1000, median host us of the call) over calls from an idle GPU."""
    ev, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        e.record()
        torch.cuda.synchronize()
        ev.append(s.elapsed_time(e) * 1e3)
        host.append((t1 - t0) * 1e6)
    return round(statistics.median(ev), 2), round(statistics.median(host), 2)


def traced(fns, reps=12):
    """Per iteration from a CUPTI trace (medians, us): host from the start event's record to
    the first launch call, that call's length, launch call to first GPU op start, GPU ops'
    total time, first op start to last op end, GPU ops per iteration (names). `fns`: one
    callable, or a dict of them run in turn within each of the `reps` rounds (each call
    then follows the previous one's kernels: benchmarks/probe_prelaunch.py --trace); a dict
    gets a dict of results by name."""
    named = fns if isinstance(fns, dict) else {"call": fns}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            for name, fn in named.items():
                torch.cuda.synchronize()
                with record_function(f"probe_iter_{i}:{name}"):
                    s = torch.cuda.Event()
                    s.record()
                    fn()
                torch.cuda.synchronize()
    path = os.path.join(OUT, "_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    results = trace_results(events, list(named))
    return results if isinstance(fns, dict) else results["call"]


def trace_results(events, names) -> dict:
    """`traced`'s medians by name from a Chrome trace's events: each name's iterations are
    the `probe_iter_<round>:<name>` ranges, the first two rounds left out (they warm the
    profiler up)."""
    xs = [e for e in events if e.get("ph") == "X"]
    apis = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu_ops = {}
    for e in xs:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_ops.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    results = {}
    for name in names:
        iters = sorted((e for e in xs if str(e.get("name", "")).startswith("probe_iter_")
                        and str(e["name"]).partition(":")[2] == name), key=lambda e: e["ts"])
        results[name] = _traced_rows(iters[2:], apis, gpu_ops)
    return results


def _traced_rows(iters, apis, gpu_ops) -> dict:
    """`traced`'s medians over the iterations `iters` of one callable."""
    rows = []
    names = set()
    for it in iters:
        lo, hi = it["ts"], it["ts"] + it["dur"]
        mine = sorted((a for a in apis if lo <= a["ts"] <= hi), key=lambda a: a["ts"])
        # (the start event: cudaEventRecordWithFlags in the traces of torch 2.5 and later)
        rec = [a for a in mine if a["name"].startswith("cudaEventRecord")]
        launches = [a for a in mine if a["name"] in _LAUNCH_APIS]
        ops_ = sorted((g for a in launches for g in gpu_ops.get(a.get("args", {}).get(
            "correlation"), [])), key=lambda g: g["ts"])
        if not launches or not ops_:
            continue
        names.update(g["name"][:60] for g in ops_)
        t_rec = rec[0]["ts"] if rec else lo
        rows.append(dict(
            host_to_launch=launches[0]["ts"] - t_rec,
            launch_call=launches[0]["dur"],
            launch_to_gpu=ops_[0]["ts"] - launches[0]["ts"],
            gpu_busy=sum(g["dur"] for g in ops_),
            gpu_span=ops_[-1]["ts"] + ops_[-1]["dur"] - ops_[0]["ts"],
            gpu_ops=len(ops_), apis=len(mine),
            iteration=it["dur"]))
    if not rows:
        return {"error": "no launches traced"}
    out = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    out["samples"] = len(rows)
    out["ops"] = sorted(names)
    out["api_names"] = sorted({a["name"] for a in apis})
    return out


def profiled(fn, calls=300, lines=22):
    """cProfile of `calls` calls behind a busy GPU, by own time (the host time by function)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(lines)
    return s.getvalue()[-4500:]


def measure(name, fn, res):
    with torch.no_grad():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        ev, host = idle(fn)
        r = dict(idle_event_us=ev, idle_host_us=host, busy_host_us=round(host_us(fn), 2))
        try:
            r["trace"] = traced(fn)
        except Exception as exc:  # noqa: BLE001 - reported
            r["trace"] = f"{type(exc).__name__}: {exc}"[:300]
    res[name] = r
    print(name, json.dumps(r), flush=True)


def main():
    ctx = rocmoe.init(heap_size=2 << 30)
    dev = ctx.device
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    team = gpu.team_for(ctx)
    measure("empty_sync_only", lambda: None, res)
    for m, k, n in SHAPES:
        tag = f"gemm_{m}x{k}x{n}"
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        w = (torch.randn(k, n, device=dev) / k ** 0.5).to(torch.bfloat16)
        h = ops.GemmAllToAll(ctx, m, k, n, torch.bfloat16)
        counts_t = torch.tensor([m], device=dev)
        with torch.no_grad():
            for _ in range(3):
                h(x, w, [m])
        torch.cuda.synchronize()
        plan = next(iter(h._launches.values()))
        out = torch.empty((h.capacity_rows, n), dtype=x.dtype, device=dev)
        recv = torch.empty(1, dtype=torch.int64, device=dev)
        desc = h._w_descriptors
        native = plan.native.get(True) or plan.native.get(False)
        strides_w = (0, w.stride(-2), w.stride(-1))
        raw = plan._raw_args(h, team, x, w, strides_w, counts_t, out, recv)
        measure(f"{tag}_torch_matmul", lambda: torch.matmul(x, w), res)
        # each replayed from a CUDA graph, from an idle GPU: the same launch (one graph
        # launch) for both, so what differs between the two is the kernel's own start and
        # run, not the host's work before its launch
        with torch.no_grad():
            replay_torch, replay_ours = captured(lambda: torch.matmul(x, w)), \
                captured(lambda: h(x, w, [m]))
        measure(f"{tag}_torch_matmul_graph", replay_torch, res)
        measure(f"{tag}_handle_graph", replay_ours, res)
        measure(f"{tag}_handle_list", lambda: h(x, w, [m]), res)
        measure(f"{tag}_handle_device_counts", lambda: h(x, w, counts_t), res)
        lean = h.__dict__.get("_lean")
        if lean is not None:
            measure(f"{tag}_lean_closure", lambda: lean(x, w, [m]), res)
        with torch.no_grad():
            res[f"{tag}_handle_profile"] = profiled(lambda: h(x, w, [m]))
        print(res[f"{tag}_handle_profile"], flush=True)
        measure(f"{tag}_plan_launch", lambda: plan.launch(h, team, x, w, counts_t, out, recv,
                                                          desc), res)
        if native is not None:
            measure(f"{tag}_native_launch_only", lambda: native.launch((plan.nprog,), raw), res)
        measure(f"{tag}_torch_matmul_again", lambda: torch.matmul(x, w), res)
        measure(f"{tag}_two_empties", lambda: (torch.empty((h.capacity_rows, n), dtype=x.dtype,
                                                           device=dev),
                                               torch.empty(1, dtype=torch.int64, device=dev)),
                res)
        h.close()
    wv = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    xv = torch.randn(8192, device=dev).to(torch.bfloat16)
    hv = ops.GemvAllReduce(ctx, 8192, 8192, torch.bfloat16)
    yv = torch.empty(8192, dtype=torch.bfloat16, device=dev)
    measure("gemv_8192_bf16_torch_mv", lambda: torch.mv(wv, xv), res)
    measure("gemv_8192_bf16_handle", lambda: hv(wv, xv), res)
    with torch.no_grad():
        res["gemv_handle_profile"] = profiled(lambda: hv(wv, xv))
    print(res["gemv_handle_profile"], flush=True)
    measure("gemv_8192_bf16_gpu_gemv", lambda: gpu.gemv(hv, wv, xv, yv), res)
    hv.close()
    nt, rows, dim, batch = 2, 10_000_000, 64, 2048
    g = torch.Generator(device=dev).manual_seed(1)
    tables = [torch.randn(rows, dim, device=dev, generator=g) for _ in range(nt)]
    idx = [torch.randint(0, rows, (batch,), device=dev, generator=g) for _ in range(nt)]
    off = [torch.arange(0, batch, device=dev) for _ in range(nt)]
    he = ops.EmbeddingAllToAll(ctx, [rows] * nt, dim, batch, batch, "sum", torch.float32)
    measure("embedding_2x10M_torch", lambda: [F.embedding_bag(i, t, o, mode="sum")
                                              for t, i, o in zip(tables, idx, off)], res)
    measure("embedding_2x10M_handle", lambda: he(tables, idx, off), res)
    he.close()
    with open(os.path.join(OUT, "probe_idle_gap.json"), "w") as f:
        json.dump(res, f, indent=1)
    ctx.finalize()


if __name__ == "__main__":
    main()
