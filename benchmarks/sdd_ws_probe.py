"""Probe: does Hopper warp specialization hide the forward SDD's epilogue?

    python3 benchmarks/sdd_ws_probe.py [--shapes T,H,F,E;...] [--reps 11] [--output F.jsonl]

The forward SDD writes GELU(h) and GELU'(h) in its epilogue; without one it runs 25-35 %
faster (results/moe_kernels_h200_sdd_variants.jsonl), and cuBLAS's balanced bmm runs the same
product 1.4-1.7x faster (results/expert_ceiling_h200.jsonl). A warp-specialized persistent
kernel (a producer warp loading tiles, consumer warp groups computing and storing) lets one
tile's epilogue run while the next tile's loads are in flight. This probe runs such a kernel
(``tl.range(..., warp_specialize=True)``: Triton's automatic warp specialization) next to the
shipped SDD, checks it computes the same tensors, and times both round-robin, with the
compiled kernel's registers, shared memory and whether it was specialized at all.

A variant can hang (the first full run on the H200 never returned): run each under its own
``timeout`` with ``--variants NAME``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl

from rocmoe.bench import emit as bench_emit
from rocmoe.bench.moe import expert_inputs, make_routing
from rocmoe.bench.timing import interleaved_ms
from rocmoe.moe import blocksparse as bs
from rocmoe.moe import route_and_permute
from rocmoe.moe.kernels import _grouped_tile, _sdd_finish, _sdd_offsets, _sdd_tile
from rocmoe._triton import tensor_descriptor


@triton.jit
def sdd_ws_kernel(a_desc, w_desc, out_ptr, h_ptr, act_out_ptr, col_idx_ptr, K, F, nb, num_n,
                  num_tiles, BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                  EPILOGUE_STORE_ACT: tl.constexpr, FAST_ACT: tl.constexpr,
                  GROUP_M: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    for tile in tl.range(pid, num_tiles, grid, flatten=FLATTEN, warp_specialize=WS):
        row_block, n_idx = _grouped_tile(tile, num_tiles // num_n, num_n, GROUP_M)
        first, end, valid, expert, f0 = _sdd_tile(row_block, n_idx, col_idx_ptr, nb, BLOCK,
                                                  SPLIT)
        k_end = tl.where(valid, K, 0)
        acc = tl.zeros((BLOCK, SPLIT * BLOCK), dtype=tl.float32)
        for k in range(0, k_end, BLOCK_K):
            a = a_desc.load([row_block * BLOCK, k])
            w = w_desc.load([expert * K + k, f0])
            acc = tl.dot(a, w, acc)
        offs, in_row = _sdd_offsets(first, end, BLOCK, SPLIT, BLOCK, 0)
        _sdd_finish(acc, 0.0, offs, in_row, out_ptr, h_ptr, act_out_ptr, 0,
                    EPILOGUE_STORE_ACT, False, FAST_ACT, False, 0)


def launch_ws(x_perm, w1, topo, act_out, split, warps, stages, per_sm, ws, flatten, group_m):
    b = topo.block_size
    k = x_perm.shape[1]
    f = w1.shape[2]
    nb = topo.blocks_per_expert
    bk = 64
    out = torch.empty(topo.nnz, b, b, device=x_perm.device, dtype=x_perm.dtype)
    a_desc = tensor_descriptor(x_perm, x_perm.shape[0], k, x_perm.stride(0), [b, bk])
    w_desc = tensor_descriptor(w1, w1.shape[0] * k, f, w1.stride(1), [bk, split * b])
    num_n = -(-nb // split)
    num_tiles = topo.num_row_blocks * num_n
    sms = torch.cuda.get_device_properties(x_perm.device).multi_processor_count
    grid = max(1, min(num_tiles, sms * per_sm))
    ck = sdd_ws_kernel[(grid,)](
        a_desc, w_desc, out, out, act_out, topo.column_indices, k, f, nb, num_n, num_tiles,
        BLOCK=b, SPLIT=split, BLOCK_K=bk, EPILOGUE_STORE_ACT=1, FAST_ACT=True,
        GROUP_M=group_m, WS=ws, FLATTEN=flatten, num_warps=warps, num_stages=stages)
    return out, ck


VARIANTS = [  # (name, split, warps, stages, programs per SM, ws, flatten)
    ("persist_128x128_w4_s3_p2", 1, 4, 3, 2, False, False),
    ("persist_128x256_w8_s3_p1", 2, 8, 3, 1, False, False),
    ("ws_128x128_w8_s3_p1", 1, 8, 3, 1, True, False),
    ("ws_128x128_w8_s4_p1", 1, 8, 4, 1, True, False),
    ("ws_128x256_w8_s2_p1", 2, 8, 2, 1, True, False),
    ("ws_128x256_w8_s3_p1", 2, 8, 3, 1, True, False),
    ("ws_128x256_w8_s4_p1", 2, 8, 4, 1, True, False),
    ("ws_128x128_w4_s3_p1", 1, 4, 3, 1, True, False),
]


def run_shape(shape, reps, emit, only=None):
    tokens, hidden, ffn, experts = shape
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, _ = make_routing(tokens, experts, 2, "uniform", device, dtype, gen)
    _, topo, x_perm = route_and_permute(x, ids, experts, 128, ffn)
    w1 = w1.detach()
    group_m = bs.op_config("sdd", topo, hidden)["group_m"]
    common = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts)
    flops = 2.0 * tokens * 2 * hidden * ffn
    with torch.no_grad():
        ref_act = torch.empty(topo.nnz, 128, 128, device=device, dtype=dtype)
        ref = bs._sdd(x_perm, w1, topo, act="gelu", act_out=ref_act)
        cases = {"shipped_sdd_store_gelu": (lambda: None, lambda: bs._sdd(
            x_perm, w1, topo, act="gelu", act_out=ref_act))}
        info = {}
        for name, split, warps, stages, per_sm, ws, flatten in VARIANTS:
            if only and name not in only:
                continue
            print(f"# {shape} {name}: compile and check", file=sys.stderr, flush=True)
            act = torch.empty_like(ref_act)
            try:
                out, ck = launch_ws(x_perm, w1, topo, act, split, warps, stages, per_sm, ws,
                                    flatten, group_m)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a variant that does not build is data
                emit(dict(common, metric="sdd_ws_probe", variant=name, error=repr(exc)[:400]))
                continue
            ttgir = ck.asm.get("ttgir", "")
            ptx = ck.asm.get("ptx", "")
            info[name] = dict(
                n_regs=ck.n_regs, n_spills=ck.n_spills, shared=ck.metadata.shared,
                specialized="ttg.warp_specialize" in ttgir or "setmaxnreg" in ptx,
                max_err_out=float((out.float() - ref.float()).abs().max()),
                max_err_act=float((act.float() - ref_act.float()).abs().max()))
            cases[name] = (lambda: None, (lambda a=(x_perm, w1, topo, act, split, warps, stages,
                                                    per_sm, ws, flatten, group_m):
                                          launch_ws(*a)))
        for _, fn in cases.values():
            fn()
        torch.cuda.synchronize()
        print(f"# {shape}: timing {len(cases)} cases", file=sys.stderr, flush=True)
        t = interleaved_ms(cases, rounds=reps, calls=3, queued=True)
    base = t["shipped_sdd_store_gelu"]
    for name, ms in t.items():
        emit(dict(common, metric="sdd_ws_probe", variant=name, ms=round(ms, 4),
                  tflops=round(flops / ms / 1e9, 1), vs_shipped=round(base / ms, 3),
                  **info.get(name, {})))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="65536,1024,4096,64;8192,1024,4096,64;65536,512,2048,64;"
                   "8192,4096,1408,64")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--variants", help="comma list of VARIANTS names (default: all)")
    p.add_argument("--output")
    args = p.parse_args(argv)
    only = set(args.variants.split(",")) if args.variants else None
    out = open(args.output, "a") if args.output else None
    emit = functools.partial(bench_emit, also_to=out)

    emit(dict(metric="sdd_ws_probe_env", triton=triton.__version__, torch=torch.__version__))
    for s in args.shapes.split(";"):
        run_shape(tuple(int(v) for v in s.split(",")), args.reps, emit, only)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
