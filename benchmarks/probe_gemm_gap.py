"""Where does the GEMM's last 5 % go? A probe for issue 14's two shapes still under 0.95 of
torch.matmul on an H200 (2048^3 and 512 x 4096^2, bf16).

gemm_a2a_kernel at world size 1 runs in MODE_LOCAL: TMA loads, tl.dot, a masked pointer
store. This probe times, against torch.matmul in the same process, a bare Triton matmul
written for the purpose (no plan, no counts, no protocol) in variants that isolate one
choice each:

* the store: masked pointer store (as gemm_a2a_kernel) or a TMA store through a descriptor;
* the grid: one program per tile, or persistent (one per SM, looping over tiles);
* the K loop: plain, or tl.range(..., warp_specialize=True) where this Triton allows it;
* the tile: BLOCK_M x BLOCK_N x BLOCK_K, warps, stages.

If the bare kernel with a pointer store is as slow as ours, the gap is Triton's code (not
our plan); if the TMA store closes it, MODE_LOCAL should store that way.

Each time is GPU time per call: 20 calls queued behind a 2 ms sleep (best of 5 rounds),
and 20 calls replayed from a CUDA graph (best of 5). JSON lines to --output.

    python benchmarks/probe_gemm_gap.py --output probe_gemm_gap.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl


@triton.jit
def bare_matmul(a_desc, b_desc, c_desc, c_ptr, M, N, K, num_programs,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, TMA_STORE: tl.constexpr, WARP_SPEC: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    total = tiles_m * tiles_n
    for tile in range(tl.program_id(0), total, num_programs):
        in_group = GROUP_M * tiles_n
        first_m = (tile // in_group) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pm = first_m + (tile % in_group) % rows_in_group
        pn = (tile % in_group) // rows_in_group
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPEC):
            a = a_desc.load([pm * BLOCK_M, k])
            b = b_desc.load([k, pn * BLOCK_N])
            acc = tl.dot(a, b, acc)
        if TMA_STORE:
            c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(tl.bfloat16))
        else:
            base = c_ptr + (pm * BLOCK_M).to(tl.int64) * N + pn * BLOCK_N
            r = tl.arange(0, BLOCK_M)
            c = tl.arange(0, BLOCK_N)
            tl.store(base + r[:, None].to(tl.int64) * N + c[None, :], acc.to(tl.bfloat16),
                     mask=(r[:, None] < M - pm * BLOCK_M) & (c[None, :] < N - pn * BLOCK_N))


def queued_ms(fn, calls=20, rounds=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / calls)
    return best


def graph_ms(fn, calls=20, rounds=5):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / calls)
    return best


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    p = argparse.ArgumentParser()
    p.add_argument("--output", default="probe_gemm_gap.jsonl")
    p.add_argument("--shapes", default="2048x2048x2048,512x4096x4096,4096x4096x4096")
    p.add_argument("--tiles", default="",
                   help="comma list of BMxBNxBKwWARPSsSTAGES, e.g. 64x128x64w4s8 "
                        "(default: the built-in list)")
    p.add_argument("--all-variants", action="store_true",
                   help="every tile with and without persistence and warp specialisation")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = open(args.output, "w")
    tiles = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4),
             (128, 128, 64, 4, 4), (128, 128, 64, 8, 5), (256, 128, 64, 8, 3),
             (128, 256, 128, 8, 2), (64, 128, 64, 4, 8)]
    if args.tiles:
        tiles = []
        for t in args.tiles.split(","):
            dims, rest = t.split("w")
            warps, stages = rest.split("s")
            tiles.append(tuple(int(v) for v in dims.split("x")) + (int(warps), int(stages)))
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        torch.manual_seed(0)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) / k ** 0.5
        ref = a @ b
        c_t = torch.empty_like(ref)
        base = dict(shape=dict(m=m, k=k, n=n), device=torch.cuda.get_device_name(),
                    triton=triton.__version__, torch=torch.__version__)
        t_q = queued_ms(lambda: torch.matmul(a, b, out=c_t))
        t_g = graph_ms(lambda: torch.matmul(a, b, out=c_t))
        out.write(json.dumps(dict(base, variant="torch.matmul", queued_ms=round(t_q, 5),
                                  graph_ms=round(t_g, 5))) + "\n")
        out.flush()
        print(f"{shape} torch {t_q * 1e3:.1f} / {t_g * 1e3:.1f} us", flush=True)
        for bm, bn, bk, warps, stages in tiles:
            default_tile = (bm, bn, bk) == (128, 256, 64) and stages == 3
            for tma_store in (False, True):
                every = default_tile or args.all_variants
                for persistent in ((False, True) if every or bm * bn == 128 * 128
                                   else (False,)):
                    for ws in ((False, True) if every else (False,)):
                        c = torch.empty_like(ref)
                        a_d = TensorDescriptor.from_tensor(a, [bm, bk])
                        b_d = TensorDescriptor.from_tensor(b, [bk, bn])
                        c_d = TensorDescriptor.from_tensor(c, [bm, bn])
                        total = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                        progs = min(total, sms) if persistent else total

                        def run():
                            bare_matmul[(progs,)](a_d, b_d, c_d, c, m, n, k, progs,
                                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                                  TMA_STORE=tma_store, WARP_SPEC=ws,
                                                  num_warps=warps, num_stages=stages)
                        row = dict(base, variant="bare", tile=[bm, bn, bk], num_warps=warps,
                                   num_stages=stages, tma_store=tma_store,
                                   persistent=persistent, warp_specialize=ws)
                        t0 = time.perf_counter()
                        try:
                            q = queued_ms(run)
                            g = graph_ms(run)
                            err = ((c.float() - ref.float()).abs().max() /
                                   ref.float().abs().max()).item()
                            row.update(queued_ms=round(q, 5), graph_ms=round(g, 5),
                                       ratio_queued=round(t_q / q, 4),
                                       ratio_graph=round(t_g / g, 4), rel_err=err)
                            msg = f"{q * 1e3:.1f} / {g * 1e3:.1f} us ({t_g / g:.3f})"
                        except Exception as exc:  # noqa: BLE001 - a variant this Triton refuses
                            row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                            msg = row["error"][:120]
                        row["seconds"] = round(time.perf_counter() - t0, 1)
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(f"{shape} {bm}x{bn}x{bk} w{warps} s{stages} tma_store={tma_store}"
                              f" persistent={persistent} ws={ws}: {msg}", flush=True)


if __name__ == "__main__":
    main()
