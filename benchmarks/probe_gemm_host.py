"""Where the host time of a GemmAllToAll call goes on a GPU (issue 14): the whole call, each
stage of it timed alone, a cProfile of many calls, and what the compiled Triton kernel's
launch needs (its signature, metadata and the driver's parameter table), for a launcher
that skips Triton's Python layers. Prints and writes $OUT/probe_gemm_host.json."""
import cProfile
import ctypes
import io
import json
import os
import pstats
import time

import torch

import rocmoe
from rocmoe import ops
from rocmoe.ops import gpu
from rocmoe.ops.gpu import gemm_plans, triton_launcher

OUT = os.environ.get("OUT", ".")


def per_call_us(fn, calls=200):
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return round(us, 2)


def main():
    ctx = rocmoe.init(heap_size=2 << 30)
    res = {}
    dev = ctx.device
    for m, k, n in ((4096, 4096, 4096), (128, 4096, 4096)):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        w = torch.randn(k, n, device=dev).to(torch.bfloat16)
        h = ops.GemmAllToAll(ctx, m, k, n, torch.bfloat16)
        counts_t = torch.tensor([m], device=dev)
        with torch.no_grad():
            for _ in range(5):
                h(x, w, [m])
            torch.cuda.synchronize()
            r = {}
            r["call_list_counts"] = per_call_us(lambda: h(x, w, [m]))
            r["call_device_counts"] = per_call_us(lambda: h(x, w, counts_t))
            r["torch_matmul"] = per_call_us(lambda: torch.matmul(x, w))
            r["empty_out"] = per_call_us(lambda: torch.empty((m, n), dtype=x.dtype, device=dev))
            r["check"] = per_call_us(h.check)
            r["counts_list"] = per_call_us(lambda: h._counts([m], m, 0))
            plan = next(iter(h._launches.values()))
            r["config"] = {kk: v for kk, v in plan.cfg.items()}
            r["operands"] = per_call_us(lambda: gpu.gemm_operands(x, w, plan.cfg, h._w_descriptors))
            out = torch.empty((m, n), dtype=x.dtype, device=dev)
            recv = torch.empty(1, dtype=torch.int64, device=dev)
            team = gpu.team_for(ctx)
            r["plan_launch"] = per_call_us(lambda: plan.launch(h, team, x, w, counts_t, out, recv,
                                                               h._w_descriptors))
            launcher = triton_launcher._LAUNCHERS["gemm_a2a_kernel"]
            (kernel, tail), = [v for kk, v in launcher._compiled.items()][-1:]
            x_arg, w_arg, use_tma = gpu.gemm_operands(x, w, plan.cfg, h._w_descriptors)
            strides_w = (0, w.stride(-2), w.stride(-1))
            args = (x_arg, w_arg, out, counts_t, team.order, team.peer_bases, recv, *plan.tail_args,
                    m, n, k, plan.per, plan.capacity, plan.nprog, x.stride(0), x.stride(1),
                    *strides_w, plan.wait_budget)
            r["specialize_dynamic"] = per_call_us(lambda: launcher.specialize(args, gemm_plans._GEMM_DYNAMIC))
            r["compiled_launch"] = per_call_us(lambda: kernel[(plan.nprog, 1, 1)](*args, *tail))
            r["use_tma"] = use_tma
            # what a native launch needs
            kernel._init_handles()
            md = kernel.metadata
            r["metadata"] = {a: repr(getattr(md, a, None)) for a in (
                "num_warps", "num_ctas", "shared", "global_scratch_size", "profile_scratch_size",
                "launch_pdl", "launch_cooperative_grid", "tensordesc_meta", "cluster_dims")}
            r["signature"] = {str(kk): str(v) for kk, v in kernel.src.signature.items()}
            r["constants"] = {str(kk): repr(v) for kk, v in getattr(kernel.src, "constants", {}).items()}
            r["function"] = int(kernel.function)
            r["run_type"] = type(kernel.run).__name__
            r["run_launch"] = repr(getattr(kernel.run, "launch", None))
            try:
                cuda = ctypes.CDLL("libcuda.so.1")
                f = cuda.cuFuncGetParamInfo
                params = []
                for i in range(80):
                    off, size = ctypes.c_size_t(), ctypes.c_size_t()
                    rc = f(ctypes.c_void_p(int(kernel.function)), ctypes.c_size_t(i),
                           ctypes.byref(off), ctypes.byref(size))
                    if rc != 0:
                        params.append(("rc", rc))
                        break
                    params.append((off.value, size.value))
                r["param_info"] = params
            except Exception as exc:  # noqa: BLE001
                r["param_info"] = f"{type(exc).__name__}: {exc}"
            prof = cProfile.Profile()
            torch.cuda._sleep(400_000_000)
            prof.enable()
            for _ in range(300):
                h(x, w, [m])
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
            r["profile_tottime"] = s.getvalue()[-6000:]
        h.close()
        res[f"{m}x{k}x{n}"] = r
        print(json.dumps({kk: v for kk, v in r.items() if kk != "profile_tottime"}, indent=1))
        print(r["profile_tottime"])
    # the embedding (26 DLRM tables) and the GEMV, profiled the same way
    g = torch.Generator(device=dev).manual_seed(1)
    nt, rows, dim, batch, lookups = 26, 100000, 128, 8192, 8
    tables = [torch.randn(rows, dim, device=dev, generator=g) for _ in range(nt)]
    indices = [torch.randint(0, rows, (batch * lookups,), device=dev, generator=g) for _ in range(nt)]
    offsets = [torch.arange(0, batch * lookups, lookups, device=dev) for _ in range(nt)]
    he = ops.EmbeddingAllToAll(ctx, [rows] * nt, dim, batch, batch * lookups, "sum", torch.float32)
    hv = ops.GemvAllReduce(ctx, 8192, 8192, torch.bfloat16)
    wv = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    xv = torch.randn(8192, device=dev).to(torch.bfloat16)
    for name, fn in (("embedding26", lambda: he(tables, indices, offsets)),
                     ("gemv8192", lambda: hv(wv, xv))):
        with torch.no_grad():
            for _ in range(5):
                fn()
            r = {"call": per_call_us(fn)}
            prof = cProfile.Profile()
            torch.cuda._sleep(400_000_000)
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
            r["profile_tottime"] = s.getvalue()[-5000:]
        res[name] = r
        print(name, r["call"])
        print(r["profile_tottime"])
    with open(os.path.join(OUT, "probe_gemm_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    ctx.finalize()


if __name__ == "__main__":
    main()
