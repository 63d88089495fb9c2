"""Host microseconds per launch of the MoE kernels, split by layer (GPU machine, Triton 3.x).

    python benchmarks/launch_overhead.py [T,H,F,E] [--calls N]

For each kernel launch of the FFN's forward and backward (captured once), times N calls
back to back (the GPU runs behind, so this is host work only) of:
  wrapper   rocmoe's launcher (bs._sdd / _dsd / _dstd): config, descriptors, Triton launch
  jit       the captured kernel[grid](*args) alone: Triton's JIT dispatch and launcher
  binder    Triton's argument binding and specialization alone (part of jit)
  launcher  the compiled kernel's launcher alone (descriptor encoding, cuLaunchKernelEx)
"""

import argparse

import torch

from profile_moe_host import print_host_profile  # (benchmarks/, this script's folder)
from rocmoe.bench.moe import expert_inputs, make_routing
from rocmoe.bench.timing import host_ms_per_call
from rocmoe.moe import blocksparse as bs
from rocmoe.moe import kernels, route_and_permute


def per_call_us(fn, calls):
    fn()
    return host_ms_per_call(fn, calls) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8192,4096,1408,64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", default=None,
                    help="a launch name: also print its wrapper's host functions (cProfile)")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, _ = make_routing(shape[0], shape[3], 2, "uniform", device, dtype, gen)
    _, topo, xp = route_and_permute(x, ids, shape[3], 128, shape[2])
    w1, w2 = w1.detach(), w2.detach()
    grad = torch.randn(topo.num_rows, shape[1], device=device, dtype=dtype, generator=gen)
    a = torch.empty(topo.nnz, 128, 128, device=device, dtype=dtype)
    h = bs._sdd(xp, w1, topo, act="gelu", act_out=a)
    gh = bs._sdd(grad, w2.transpose(1, 2), topo, scale_by=h)
    gw1 = torch.empty_like(w1)
    wrappers = {
        "sdd_fwd": lambda: bs._sdd(xp, w1, topo, act="gelu", act_out=a),
        "dsd_fwd": lambda: bs._dsd(a, w2, topo),
        "sdd_bwd": lambda: bs._sdd(grad, w2.transpose(1, 2), topo, scale_by=h),
        "dstd_dw2": lambda: bs._dstd(a, grad, topo),
        "dsd_dx": lambda: bs._dsd(gh, w1.transpose(1, 2), topo),
        "dstd_dw1": lambda: bs._dstd(gh, xp, topo, out=gw1.transpose(1, 2)),
    }
    real_get, real_launch = kernels.get, kernels.launch
    for name, wrapper in wrappers.items():
        captured = {}

        def capturing_get(kname):
            fn = real_get(kname)

            class Proxy:
                def __getitem__(self, grid):
                    def launch(*a_, **kw):
                        captured.update(fn=fn, grid=grid, args=a_, kwargs=kw)
                        captured["kernel"] = fn[grid](*a_, **kw)
                    return launch
            return Proxy()

        kernels.launch = capturing_get  # (the layer launches through kernels.launch)
        wrapper()
        kernels.launch = real_launch
        fn, grid, a_, kw, compiled = (captured[k] for k in ("fn", "grid", "args", "kwargs",
                                                            "kernel"))
        dev = torch.cuda.current_device()
        binder = fn.device_caches[dev][4]
        bound, _, _ = binder(*a_, **kw)
        vals = list(bound.values())
        stream = torch.cuda.current_stream().cuda_stream
        g = tuple(grid) + (1,) * (3 - len(grid))
        meta = compiled.launch_metadata(grid, stream, *vals)

        def launcher():
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                         meta, None, None, *vals)

        row = {"wrapper": per_call_us(wrapper, args.calls),
               "jit": per_call_us(lambda: fn[grid](*a_, **kw), args.calls),
               "binder": per_call_us(lambda: binder(*a_, **kw), args.calls),
               "launcher": per_call_us(launcher, args.calls)}
        print(f"{name:9s} " + "  ".join(f"{k} {v:6.1f} us" for k, v in row.items()), flush=True)
        if name == args.profile:
            print_host_profile(wrapper, args.calls, 22)


if __name__ == "__main__":
    main()
