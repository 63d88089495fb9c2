"""Memory of the MoE layer's forward + backward, counted without a GPU (the meta device).

    python -m rocmoe.bench.moe_memory [--shapes T,H,F,E,k;...] [--output FILE]

The GPU code path runs on meta tensors with every kernel launch skipped: the launchers
allocate exactly what they allocate on a GPU, nothing is computed (a layer's sizes never
depend on the routing, so none of them needs the data), and ``rocmoe.bench.memory`` counts
every storage. One JSON line per shape and fused-FFN variant (``moe_layer.VARIANTS``:
``KERNEL_CONFIG``'s act_fusion, gather_rows, compact_values) gives, for DroplessMoE and for the grouped-GEMM layer on the same router (its torch ops, ``Router.route_reference``)
(``rocmoe.moe.reference``), the bytes saved for the backward, alive after the forward and
at the step's peak, with the ratios (rocmoe / baseline: below 1 rocmoe needs less). On a GPU
``rocmoe bench moe --layer`` measures the peak with the caching allocator instead.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional

import torch

from . import emit
from .memory import StepMemory, step_memory
from .moe_layer import DEFAULT_SHAPES, VARIANT_KEYS, VARIANTS, parse_shapes, shape_name


class _SkippedLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launches_skipped():
    """Run the MoE launchers for the GPU with no kernel launched (for meta tensors)."""
    from rocmoe.moe import backend, kernels
    # the layer launches through kernels.launch (FastKernel on a GPU, which after a real run
    # holds native launches that would take the meta tensors' null pointers); get is what
    # the AOT builds and the interpreter take
    real_get, real_launch, real_backend = kernels.get, kernels.launch, backend.get_backend()
    kernels.get = kernels.launch = lambda name: _SkippedLaunch()
    backend.set_backend("triton")
    try:
        yield
    finally:
        kernels.get, kernels.launch = real_get, real_launch
        backend.set_backend(real_backend)


def layer_memory(shape, variant, dtype=torch.bfloat16,
                 device="meta") -> tuple[StepMemory, StepMemory]:
    """(DroplessMoE, grouped-GEMM layer) memory of one forward + backward of `shape`
    (T, H, F, E, k) under the fused FFN `variant` (values of moe_layer.VARIANT_KEYS)."""
    from rocmoe.moe import DroplessMoE
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe.reference import grouped_gemm_moe
    tokens, hidden, ffn, experts, top_k = shape
    with torch.device(device):
        layer = DroplessMoE(hidden, ffn, experts, top_k, dtype=dtype)
        x = torch.empty(tokens, hidden, dtype=dtype).requires_grad_(True)
        gy = torch.empty(tokens, hidden, dtype=dtype)
    params = [x, layer.router.weight, layer.w1, layer.w2]

    def backward(y):
        torch.autograd.grad(y, params, gy)

    def baseline():
        ids, weights = layer.router.route_reference(x)
        return grouped_gemm_moe(x, ids, weights, layer.w1, layer.w2, grouped=True)

    before = {k: bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS}
    bs.set_kernel_config(**dict(zip(VARIANT_KEYS, variant)))
    try:
        with launches_skipped() if device == "meta" else contextlib.nullcontext():
            ours = step_memory(lambda: layer(x), backward)
        theirs = step_memory(baseline, backward)
    finally:
        bs.set_kernel_config(**before)
    return ours, theirs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rocmoe.bench.moe_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="T,H,F,E[,k];... (default: rocmoe bench moe --layer's)")
    p.add_argument("--output", help="also append the JSON lines to this file")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from rocmoe.moe import blocksparse as bs
    out = open(args.output, "a") if args.output else None
    try:
        for shape in parse_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES:
            for variant in VARIANTS:
                ours, theirs = layer_memory(shape, variant)
                rec = dict(metric="layer_memory_accounting", device="meta (GPU path, no launch)",
                           tokens=shape[0], hidden=shape[1], ffn=shape[2], experts=shape[3],
                           top_k=shape[4], model=shape_name(shape),
                           **dict(zip(VARIANT_KEYS, variant)),
                           default=variant == tuple(bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS),
                           baseline="torch._grouped_mm layer, the same router in torch ops (route_reference)",
                           **ours.as_dict("ours_"), **theirs.as_dict("baseline_"),
                           saved_ratio=round(ours.saved / theirs.saved, 4),
                           after_forward_ratio=round(ours.after_forward
                                                     / theirs.after_forward, 4),
                           peak_ratio=round(ours.peak / theirs.peak, 4))
                emit(rec, out)
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
