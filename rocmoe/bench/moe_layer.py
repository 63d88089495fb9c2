"""Whole-layer MoE benchmark: DroplessMoE against the grouped-GEMM layer a torch user writes.

    rocmoe bench moe --layer [--shapes T,H,F,E,k;...] [--routing uniform,zipf] [--reps 7]
                             [--variants auto|all|none] [--budget-s 300] [--output FILE]
                             [--device cuda|cpu]

Both sides run the whole layer, router included, on identical routing: the same ``Router``
module's weights and maths (fp32 gate, softmax, top-k, aux loss) pick the experts, rocmoe's
through ``Router.route`` (on a GPU the fused router, three Triton launches), the baseline's
through ``Router.route_reference`` (the same router in torch ops, as a torch user writes it:
the same logits, so the same picks); then rocmoe's ``DroplessMoE`` (block-sparse kernels) or ``rocmoe.moe.reference.grouped_gemm_moe`` (argsort by expert,
gather, ``torch._grouped_mm``, tanh-GELU, ``torch._grouped_mm``, weighted ``index_add_``; on
a GPU where ``torch._grouped_mm`` does not run, a loop of ``torch.mm`` over the experts, with
its host sync) computes the experts. Each record names that baseline and gives the ratio
(baseline time / rocmoe time: above 1 rocmoe is faster; for memory rocmoe's bytes / the
baseline's: below 1 rocmoe needs less), all measured in the same run:

* ``layer_fwdbwd_vs_grouped_mm``: forward + backward (gradients of the input, the gate and
  the expert weights), timed from an idle GPU (``ratio``), queued behind an untimed call as
  inside a model (``ratio_queued``) and replayed from CUDA graphs (``ratio_graphs``: device
  time alone, no launch work).
* ``layer_fwd_vs_grouped_mm``: the forward alone under ``torch.no_grad`` (inference).
* ``layer_peak_memory_vs_grouped_mm``: peak bytes allocated by one forward + backward above
  what was allocated before (``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``).
* ``layer_host``: host (Python + launch) ms per step, launched back to back, and kernel
  launches per step, for both (GPU only): what the small, launch-bound shapes pay.
* ``layer_kernels``: rocmoe's step by kernel (GPU time per kernel from the profiler).
* ``layer_variant``: the fused FFN's other memory variants (``VARIANTS``: ``KERNEL_CONFIG``'s
  act_fusion, gather_rows, compact_values) against the same baseline, queued time and peak
  memory, so that one run says which default to keep: ``--variants auto`` (the default) on
  the six shapes with uniform routing (each variant compiles kernels of its own: on every
  case they would take most of the four minutes), ``all`` on every case, ``none``.

The tokens are drawn so that the router picks the routing asked for: token t is a little
noise plus the gate rows of the k experts drawn for it (uniformly, or Zipf(1.0) over the
experts); ``routing_match`` says for how many tokens the router's top-k is that draw.
Each case's repetitions adapt to its step time (at most ``--reps``, at least 3) so that the
default run (24 cases) takes about four minutes on an H200; past ``--budget-s`` seconds no
further case starts (a ``layer_case`` record lists the ones left out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

import torch

from . import emit as emit_line
from .draws import router_inputs
from .memory import peak_bytes
from .timing import captured, host_ms_per_call, interleaved_ms

SIX_SHAPES = [(65536, 512, 2048, 64, 2), (32768, 768, 3072, 64, 2), (8192, 1024, 4096, 64, 2),
              (8192, 4096, 16384, 4, 2), (65536, 1024, 4096, 64, 2), (8192, 4096, 1408, 64, 2)]
# (hidden, ffn, experts, top_k) of models users run
MODEL_SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "deepseek-v2-lite": (2048, 1408, 64, 6),
                "qwen3-30b-a3b": (2048, 768, 128, 8)}
MODEL_TOKENS = (4096, 65536)
DEFAULT_SHAPES = SIX_SHAPES + [(t,) + shape for shape in MODEL_SHAPES.values()
                               for t in MODEL_TOKENS]
# The fused FFN's memory variants, as KERNEL_CONFIG keys: the lean default, the layer
# before it, and each of the default's keys flipped alone.
VARIANT_KEYS = ("act_fusion", "gather_rows", "compact_values")
VARIANTS = [("recompute", True, True), ("store", False, False), ("store", True, True),
            ("recompute", False, True), ("recompute", "backward", True),
            ("recompute", True, False), ("checkpoint", True, True)]
BASELINE = ("torch._grouped_mm layer: argsort, gather, _grouped_mm, tanh-GELU, _grouped_mm, "
            "weighted index_add_ (the same router in torch ops, same routing)")
LOOP_BASELINE = ("torch.mm loop layer: argsort, gather, torch.mm per expert (host sync for "
                 "the split sizes), tanh-GELU, weighted index_add_ (the same router in torch ops, "
                 "same routing)")
TARGET_TIMED_S = 2.5  # seconds of timed calls per case, which sets its repetitions


def shape_name(shape) -> str:
    hidden, ffn, experts, top_k = shape[1:]
    for name, model in MODEL_SHAPES.items():
        if model == (hidden, ffn, experts, top_k):
            return name
    return "issue-4 six"


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _Config:
    """Runs the block below with some kernel config keys set, then restores them."""

    def __init__(self, **keys) -> None:
        self.keys = keys

    def __enter__(self):
        from rocmoe.moe import blocksparse as bs
        self.before = {k: bs.KERNEL_CONFIG[k] for k in self.keys}
        bs.set_kernel_config(**self.keys)

    def __exit__(self, *exc):
        from rocmoe.moe import blocksparse as bs
        bs.set_kernel_config(**self.before)


def kernel_launches(step: Callable[[], object]) -> tuple[int, dict]:
    """(kernels launched by one call of step, GPU ms per kernel name) from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    launches, per_kernel = 0, {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches += 1
            ms = event.device_time_total / 1e3 if hasattr(event, "device_time_total") \
                else event.cuda_time_total / 1e3
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + ms
    return launches, per_kernel


def run_case(shape, routing: str, reps: int, dtype, device, emit, variants: bool) -> None:
    """Time and measure one case (see the module docstring), with the memory variants when
    `variants`."""
    from rocmoe.moe import DroplessMoE
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe.reference import grouped_gemm_moe, uses_grouped_mm

    tokens, hidden, ffn, experts, top_k = shape
    torch.manual_seed(0)
    layer = DroplessMoE(hidden, ffn, experts, top_k, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    x, drawn = router_inputs(layer.router.weight, tokens, top_k, routing, gen)
    x.requires_grad_(True)
    gy = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    params = [x, layer.router.weight, layer.w1, layer.w2]
    grouped = uses_grouped_mm(x)

    def ours_fwd():
        return layer(x)

    def base_fwd():
        ids, weights = layer.router.route_reference(x)
        return grouped_gemm_moe(x, ids, weights, layer.w1, layer.w2, grouped=grouped)

    def forget_aux_loss():
        # the router keeps the step's aux loss, and with it the autograd nodes of x and the
        # gate; kept past the step, they tie the next step's backward to the stream they were
        # made on, which a CUDA graph capture on another stream cannot depend on
        layer.aux_loss = layer.router.aux_loss = None

    def ours():
        torch.autograd.grad(ours_fwd(), params, gy)
        forget_aux_loss()

    def base():
        torch.autograd.grad(base_fwd(), params, gy)
        forget_aux_loss()

    def inference(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    with torch.no_grad():
        ids, _ = layer.router.route(x)
        match = float((ids.sort(1).values == drawn.sort(1).values).all(1).float().mean())
        counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
        check = _rel_diff(ours_fwd(), base_fwd())
    common = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                  model=shape_name(shape), routing=routing, routing_match=round(match, 4),
                  max_load=int(counts.max()), mean_load=tokens * top_k / experts,
                  block_size=layer.block_size, dtype=str(dtype).replace("torch.", ""),
                  **{k: bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS},
                  output_rel_diff_vs_baseline=round(check, 5),
                  device=torch.cuda.get_device_name() if x.is_cuda else "cpu")
    baseline = BASELINE if grouped else LOOP_BASELINE
    none = lambda: None  # noqa: E731
    cases = {"ours": (none, ours), "base": (none, base),
             "ours_fwd": (none, inference(ours_fwd)), "base_fwd": (none, inference(base_fwd))}
    # the other variants are timed queued only (what a layer inside a model sees), beside
    # the default and the baseline
    chosen = tuple(bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS)
    others = {("variant",) + v: (none, _with_config(dict(zip(VARIANT_KEYS, v)), ours))
              for v in (VARIANTS if variants else []) if v != chosen}
    for _, fn in cases.values():  # warm-up (compiles)
        fn()
        fn()
    for _, fn in others.values():
        fn()
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours()
    base()
    if x.is_cuda:
        torch.cuda.synchronize()
    pair_s = time.perf_counter() - t0
    # a round times every case once idle, then queued (two calls each), with the variants
    per_round = pair_s * (3 * len(cases) + 2 * len(others)) / 2
    case_reps = max(min(3, reps), min(reps, int(TARGET_TIMED_S / max(per_round, 1e-9))))
    idle = interleaved_ms(cases, rounds=case_reps, calls=1)
    queued = interleaved_ms({**cases, **others}, rounds=case_reps, calls=1, queued=True)
    graphs, graph_error = {}, None
    try:
        graphed = {name: (none, captured(cases[name][1]))
                   for name in ("ours", "base", "ours_fwd", "base_fwd")}
        graphs = interleaved_ms(graphed, rounds=case_reps, calls=1, queued=True)
        del graphed
    except Exception as exc:  # noqa: BLE001 - reported (the mm loop syncs: no capture)
        graph_error = repr(exc)[:300]
    common["reps"] = case_reps

    def timed(metric, ours_key, base_key):
        rec = dict(common, metric=metric, baseline=baseline,
                   ours_ms=round(idle[ours_key], 4), baseline_ms=round(idle[base_key], 4),
                   ratio=round(idle[base_key] / idle[ours_key], 4),
                   ours_ms_queued=round(queued[ours_key], 4),
                   baseline_ms_queued=round(queued[base_key], 4),
                   ratio_queued=round(queued[base_key] / queued[ours_key], 4))
        if ours_key in graphs and base_key in graphs:
            rec.update(ours_ms_graphs=round(graphs[ours_key], 4),
                       baseline_ms_graphs=round(graphs[base_key], 4),
                       ratio_graphs=round(graphs[base_key] / graphs[ours_key], 4))
        elif graph_error:
            rec["graphs_error"] = graph_error
        emit(rec)

    timed("layer_fwdbwd_vs_grouped_mm", "ours", "base")
    timed("layer_fwd_vs_grouped_mm", "ours_fwd", "base_fwd")
    mem_base = peak_bytes(base)
    mem_ours = peak_bytes(ours)
    emit(dict(common, metric="layer_peak_memory_vs_grouped_mm", baseline=baseline,
              ours_bytes=mem_ours, baseline_bytes=mem_base,
              ratio=round(mem_ours / max(mem_base, 1), 4)))
    for name, (_, fn) in others.items():
        mem = peak_bytes(fn)
        emit(dict(common, metric="layer_variant", baseline=baseline,
                  **dict(zip(VARIANT_KEYS, name[1:])),
                  ours_ms_queued=round(queued[name], 4),
                  baseline_ms_queued=round(queued["base"], 4),
                  ratio_queued=round(queued["base"] / queued[name], 4),
                  ours_bytes=mem, baseline_bytes=mem_base,
                  memory_ratio=round(mem / max(mem_base, 1), 4)))
    if x.is_cuda:
        host_ours, host_base = host_ms_per_call(ours, 5), host_ms_per_call(base, 5)
        launches_ours, per_kernel = kernel_launches(ours)
        launches_base, _ = kernel_launches(base)
        emit(dict(common, metric="layer_host", baseline=baseline,
                  ours_host_ms=round(host_ours, 4), baseline_host_ms=round(host_base, 4),
                  ours_ms_queued=round(queued["ours"], 4),
                  baseline_ms_queued=round(queued["base"], 4),
                  ours_host_share=round(host_ours / queued["ours"], 4),
                  baseline_host_share=round(host_base / queued["base"], 4),
                  ours_launches=launches_ours, baseline_launches=launches_base))
        if routing == "uniform":
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:16]
            emit(dict(common, metric="layer_kernels", baseline="the layer's own step",
                      kernels_ms={name[:80]: round(ms, 4) for name, ms in top},
                      kernels_total_ms=round(sum(per_kernel.values()), 4)))


def _with_config(keys: dict, fn):
    def run():
        with _Config(**keys):
            fn()
    return run


def parse_shapes(text: Optional[str]):
    if not text:
        return DEFAULT_SHAPES
    shapes = []
    for item in text.split(";"):
        if item.strip():
            values = tuple(int(v) for v in item.split(","))
            if len(values) == 4:
                values += (2,)
            if len(values) != 5:
                raise SystemExit(f"--shapes: T,H,F,E[,k] expected, got {item!r}")
            shapes.append(values)
    return shapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rocmoe bench moe --layer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="T,H,F,E[,k];... (default: the six top-2 shapes, then "
                                    "Mixtral-, DeepSeek-V2-Lite- and Qwen3-30B-A3B-like "
                                    "at 4096 and 65536 tokens)")
    p.add_argument("--routing", default="uniform,zipf")
    p.add_argument("--reps", type=int, default=7, help="most repetitions per case")
    p.add_argument("--variants", default="auto", choices=("auto", "all", "none"),
                   help="where the other memory variants are timed too (auto: the six "
                        "shapes, uniform routing)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no case after this many seconds")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--output", help="also append the JSON lines to this file")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the code")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps({"metric": "moe_layer", "error": "no CUDA/ROCm device: the layer "
                          "benchmark measures GPU kernels (--device cpu for a dry run)"}),
              flush=True)
        return 2
    out = open(args.output, "a") if args.output else None

    def emit(rec):
        emit_line(rec, out)

    from rocmoe.moe import blocksparse as bs
    emit(dict(metric="layer_config", config=dict(bs.KERNEL_CONFIG), torch=torch.__version__,
              command="rocmoe bench moe --layer " + " ".join(argv or sys.argv[1:])))
    t_start = time.time()
    left_out = []
    try:
        for shape in parse_shapes(args.shapes):
            for routing in args.routing.split(","):
                if time.time() - t_start > args.budget_s:
                    left_out.append(dict(shape=list(shape), routing=routing))
                    continue
                variants = args.variants == "all" or (
                    args.variants == "auto" and routing == "uniform"
                    and tuple(shape) in SIX_SHAPES)
                t0 = time.time()
                try:
                    run_case(shape, routing, args.reps, getattr(torch, args.dtype),
                             torch.device(args.device), emit, variants)
                except torch.OutOfMemoryError as exc:
                    emit(dict(metric="layer_case", shape=list(shape), routing=routing,
                              error=repr(exc)[:300]))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"# {shape} {routing}: {time.time() - t0:.1f} s "
                      f"(total {time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
        if left_out:
            emit(dict(metric="layer_case", error=f"over the {args.budget_s:.0f} s budget: "
                      "these cases did not run", cases=left_out))
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
