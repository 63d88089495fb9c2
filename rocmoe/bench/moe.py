"""Dropless MoE benchmark: block-sparse expert FFN and layer against named baselines.

    rocmoe bench moe [--shapes T,H,F,E;...] [--routing uniform,zipf] [--top-k 2] [--output F]

Every JSON line names its baseline and the ratio to it (baseline time / our time, so > 1
means rocmoe is faster), both measured in the same run on the same routing:

* ``ffn_fwd_vs_dense_matmul`` / ``ffn_fwdbwd_vs_dense_matmul``: the expert FFN (SDD, act,
  DSD; and the backward) against plain ``torch.matmul`` doing the same useful FLOPs
  (``4*T*k*H*F`` forward) on [T*k, H] rows: the ratio is our useful FLOP/s over dense FLOP/s.
* ``dense_parity_ceiling``: the same fwd+bwd on cuBLAS ``torch.bmm`` with every expert given
  exactly T*k/E rows (balanced, unpadded, no activation): ``ceiling_over_dense`` is the
  share of dense FLOP/s the data shape allows a per-expert GEMM at all (short experts make
  the weight gradients' K short), ``ours_over_ceiling`` how close rocmoe comes to it.
* ``ffn_fwd_vs_grouped_mm`` / ``ffn_fwdbwd_vs_grouped_mm``: against ``torch._grouped_mm``
  on the same expert-sorted rows (no padding) with a separate GELU.
* ``layer_fwdbwd_vs_capacity_padded``: whole layer (permute, FFN, combine; the router is the
  same for all and left out) against a capacity-factor-1.0 padded-bmm layer; the record
  says how many (token, slot) pairs that layer drops.
* ``layer_fwdbwd_vs_capacity_padded_cuda_graphs``: the same two layers, each replayed from
  a CUDA graph (no launch work: what launch-bound small shapes gain under graphs).
* ``layer_fwdbwd_vs_max_padded``: against padding every expert to the largest load (no drops).
* ``permute_topology_share``: time of sort + histogram + pad + topology + permute over the
  layer's fwd+bwd time.
* ``peak_memory_vs_capacity_padded``: peak allocated bytes of one fwd+bwd, ours over theirs.
* ``layer_host_time_share``: host (Python + launch) time per layer, measured while launching
  layers back to back, over the layer's time: near 1 means the layer is host-bound.

Times are medians of CUDA-event timings after warm-up. Each FFN record also carries
``ours_ms_queued`` / ``baseline_ms_queued`` / ``ratio_queued``: both sides timed again with
the GPU kept busy by an untimed call ahead of each sample (what a layer inside a model sees;
the plain figures start every sample from an idle GPU and so include one launch latency),
and ``ours_ms_graphs`` / ``baseline_ms_graphs`` / ``ratio_graphs``: both sides replayed from
CUDA graphs (device time alone, no host launch work; the ceiling record has the same as
``*_graphs``).
Needs a CUDA/ROCm device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F_

from . import emit as emit_line
from .memory import peak_bytes
from .draws import expert_probabilities
from .timing import captured, graph_time_ms, host_ms_per_call, interleaved_ms, time_ms

DEFAULT_SHAPES = [(65536, 512, 2048, 64), (32768, 768, 3072, 64), (8192, 1024, 4096, 64),
                  (8192, 4096, 16384, 4), (65536, 1024, 4096, 64), (8192, 4096, 1408, 64)]


def sweep_config(start: dict, cfg: dict, ops) -> dict:
    """A sweep entry as a whole kernel config: the startup config without its per-kernel
    overrides (`ops`), then the entry (which names any per-kernel overrides it wants).
    (Here, not in moe_kernels, which imports this module: no import cycle.)"""
    merged = dict(start)
    merged.update({op: {} for op in ops})
    merged.update(cfg)
    return merged


def _gelu(t):
    return F_.gelu(t, approximate="tanh")


# ----------------------------------------------------------------------------- routing
def make_routing(tokens: int, experts: int, top_k: int, kind: str, device, dtype,
                 generator: torch.Generator):
    """k distinct experts per token: uniform, or Zipf(1.0) over the experts (p_e ~ 1/(e+1))."""
    probs = expert_probabilities(kind, experts, device)
    ids = torch.multinomial(probs.expand(tokens, experts).contiguous(), top_k, replacement=False,
                            generator=generator).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=generator), -1)
    return ids, weights.to(dtype)


# --------------------------------------------------------------------------- baselines
def capacity_padded_layer(x, ids, weights, w1, w2, capacity: int):
    """Token-dropping MoE: each expert takes its first ``capacity`` pairs into an [E, C, H]
    buffer (bmm), later pairs are dropped (contribute zero). Device-side, like GShard."""
    tokens, top_k = ids.shape
    experts, hidden = w1.shape[0], x.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
    keep = rank < capacity
    slot = torch.where(keep, flat * capacity + rank, torch.full_like(rank, experts * capacity))
    buf = x.new_zeros(experts * capacity + 1, hidden)  # last row: sink for dropped pairs
    src = x.repeat_interleave(top_k, dim=0)
    buf = buf.index_copy(0, slot, src)
    h = torch.bmm(buf[:-1].view(experts, capacity, hidden), w1)
    y = torch.bmm(_gelu(h), w2).reshape(experts * capacity, hidden)
    y = torch.cat([y, y.new_zeros(1, hidden)])
    out = y.index_select(0, slot).view(tokens, top_k, hidden)
    return (out * weights.unsqueeze(-1)).sum(1), int(flat.numel()) - keep.sum()


def grouped_mm_ffn(x_sorted, offs, w1, w2):
    h = torch._grouped_mm(x_sorted, w1, offs=offs)
    return torch._grouped_mm(_gelu(h), w2, offs=offs)


# ------------------------------------------------------------------------------ runner
# The six products of the fused FFN under each activation fusion (names of kernel_calls).
FUSION_KERNELS = {
    "recompute": ("sdd_fwd_store_pre_gelu", "dsd_fwd", "sdd_bwd_rewrite_act", "dstd_dw2",
                  "dsd_dx", "dstd_dw1"),
    "store": ("sdd_fwd_store_gelu", "dsd_fwd", "sdd_bwd_scale", "dstd_dw2", "dsd_dx", "dstd_dw1"),
    "load": ("sdd_fwd", "dsd_fwd_gelu_on_load", "dstd_dw2_gelu_on_load", "sdd_bwd_act_grad",
             "dsd_dx", "dstd_dw1"),
}


def kernel_calls(bs, topo, x_perm, w1, w2, grad, tokens=None, plan=None):
    """name -> zero-argument call of one block-sparse kernel with the inputs it sees in the
    layer, for every activation fusion (bs: rocmoe.moe.blocksparse); with the tokens and
    their plan also the kernels that gather the rows (gather_rows, "*_gathered")."""
    h = bs._sdd(x_perm, w1, topo)
    a = torch.empty_like(h)
    bs._sdd(x_perm, w1, topo, act="gelu", act_out=a)
    gw1 = torch.empty_like(w1)
    h_kept = h.clone()  # rewritten with act(h) by each call of sdd_bwd_rewrite_act: its
    # later calls see other values, the same work
    gathered = {} if plan is None else {
        "sdd_fwd_gathered_store_pre_gelu": lambda: bs._sdd(
            tokens, w1, topo, act="gelu", act_out=a, keep_product=True, a_rows=plan.row_token),
        "dstd_dw1_gathered": lambda: bs._dstd(h, tokens, topo, out=gw1.transpose(1, 2),
                                              b_rows=plan.row_token),
    }
    return {
        **gathered,
        "sdd_fwd_store_pre_gelu": lambda: bs._sdd(x_perm, w1, topo, act="gelu", act_out=a,
                                                  keep_product=True),
        "sdd_bwd_rewrite_act": lambda: bs._sdd(grad, w2.transpose(1, 2), topo,
                                               act_grad_of=h_kept, act="gelu",
                                               rewrite_act=True),
        "sdd_fwd": lambda: bs._sdd(x_perm, w1, topo),
        "sdd_fwd_store_gelu": lambda: bs._sdd(x_perm, w1, topo, act="gelu", act_out=a),
        # the inference forward's SDD (no backward follows: GELU alone in the epilogue)
        "sdd_fwd_act_only": lambda: bs._sdd(x_perm, w1, topo, act="gelu", act_only=True),
        "dsd_fwd_gelu_on_load": lambda: bs._dsd(h, w2, topo, "gelu"),
        "dsd_fwd": lambda: bs._dsd(a, w2, topo),
        "sdd_bwd_act_grad": lambda: bs._sdd(grad, w2.transpose(1, 2), topo, act_grad_of=h,
                                            act="gelu"),
        "sdd_bwd_scale": lambda: bs._sdd(grad, w2.transpose(1, 2), topo, scale_by=h),
        "dstd_dw2_gelu_on_load": lambda: bs._dstd(h, grad, topo, "gelu"),
        "dstd_dw2": lambda: bs._dstd(a, grad, topo),
        "dsd_dx": lambda: bs._dsd(h, w1.transpose(1, 2), topo),
        "dstd_dw1": lambda: bs._dstd(h, x_perm, topo, out=gw1.transpose(1, 2)),
    }


def expert_inputs(shape, device, dtype):
    """Seeded tokens x [T, H] and expert weights w1 [E, H, F], w2 [E, F, H] (scaled, requiring
    grad) for one benchmark shape; returns the generator too, for the routing drawn next."""
    tokens, hidden, ffn, experts = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    w1 = (torch.randn(experts, hidden, ffn, device=device, dtype=dtype, generator=gen)
          / math.sqrt(hidden)).requires_grad_(True)
    w2 = (torch.randn(experts, ffn, hidden, device=device, dtype=dtype, generator=gen)
          / math.sqrt(ffn)).requires_grad_(True)
    return gen, x, w1, w2


def run_case(shape, routing: str, top_k: int, block: int, dtype, reps: int, device,
             emit: Callable[[dict], None], skip_max_padded_above_gib: float = 100.0,
             breakdown: bool = False) -> None:
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe import route_and_permute
    from rocmoe.moe.layer import local_experts

    tokens, hidden, ffn, experts = shape
    k = min(top_k, experts)
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, weights = make_routing(tokens, experts, k, routing, device, dtype, gen)
    pairs = tokens * k
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    max_load = int(counts.max())
    common = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=k,
                  routing=routing, block_size=block, dtype=str(dtype).replace("torch.", ""),
                  max_load=max_load, mean_load=pairs / experts,
                  device=torch.cuda.get_device_name() if x.is_cuda else "cpu")

    def record(name, baseline, ours_ms, base_ms, **extra):
        emit(dict(common, metric=name, baseline=baseline, ours_ms=round(ours_ms, 4),
                  baseline_ms=round(base_ms, 4), ratio=round(base_ms / ours_ms, 4), **extra))

    # --- ours: routing plan, topology, permuted rows (built once for the FFN timings)
    plan, topo, x_perm = route_and_permute(x, ids, experts, block, ffn)
    useful_fwd = 4.0 * pairs * hidden * ffn

    def ours_ffn_fwd():
        with torch.no_grad():
            return bs.fused_expert_ffn(x_perm, w1, w2, topo, "gelu")

    x_perm_g = x_perm.detach().requires_grad_(True)
    grad_ffn = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)

    def ours_ffn_fwdbwd():
        y = bs.fused_expert_ffn(x_perm_g, w1, w2, topo, "gelu")
        torch.autograd.grad(y, [x_perm_g, w1, w2], grad_ffn)

    if breakdown:
        # each kernel of the fused FFN alone, with its useful FLOPs (2*pairs*H*F each)
        # (the kernels the layer runs under the configured activation fusion)
        with torch.no_grad():
            calls = kernel_calls(bs, topo, x_perm, w1, w2, grad_ffn, x, plan)
            names = FUSION_KERNELS[bs.KERNEL_CONFIG["act_fusion"]]
            if bs.KERNEL_CONFIG["gather_rows"]:  # the layer's SDD and dW1 read the tokens
                names = [{"sdd_fwd_store_pre_gelu": "sdd_fwd_gathered_store_pre_gelu",
                          "dstd_dw1": "dstd_dw1_gathered"}.get(n, n) for n in names]
            parts = {name: calls[name] for name in names}
            for name, fn in parts.items():
                ms = time_ms(fn, reps)
                emit(dict(common, metric="kernel", kernel=name, ms=round(ms, 4),
                          useful_tflops=round(useful_fwd / 2 / ms / 1e9, 1)))
            del calls, parts

    # --- dense torch.matmul at the same useful FLOPs
    xd = torch.randn(pairs, hidden, device=device, dtype=dtype, generator=gen)
    a1 = w1[0].detach().clone()
    a2 = w2[0].detach().clone()
    xd_g = xd.clone().requires_grad_(True)
    a1_g, a2_g = a1.clone().requires_grad_(True), a2.clone().requires_grad_(True)
    gd = torch.randn(pairs, hidden, device=device, dtype=dtype, generator=gen)

    def dense_fwd():
        return torch.matmul(torch.matmul(xd, a1), a2)

    def dense_fwdbwd():
        y = torch.matmul(torch.matmul(xd_g, a1_g), a2_g)
        torch.autograd.grad(y, [xd_g, a1_g, a2_g], gd)

    # --- the ceiling: the same two products on cuBLAS bmm with perfectly balanced experts
    # (pairs/E rows each: no routing, no padding, no activation, E separate weights).
    # Dense over this is what the data shape itself costs any per-expert GEMM: with few rows
    # per expert the weight-gradient products have a short K (the expert's rows) and are
    # bound by writing the [H, F] gradients (benchmarks/expert_ceiling.py per product).
    rows = -(-pairs // experts)
    xb = torch.randn(experts, rows, hidden, device=device, dtype=dtype,
                     generator=gen).requires_grad_(True)
    b1, b2 = w1.detach().clone().requires_grad_(True), w2.detach().clone().requires_grad_(True)
    gb = torch.randn(experts, rows, hidden, device=device, dtype=dtype, generator=gen)

    def bmm_fwdbwd():
        y = torch.bmm(torch.bmm(xb, b1), b2)
        torch.autograd.grad(y, [xb, b1, b2], gb)

    # --- torch._grouped_mm on the same routing (sorted rows, no padding)
    order = torch.sort(ids.reshape(-1).long(), stable=True).indices
    xs = x.index_select(0, order // k)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs_g = xs.clone().requires_grad_(True)
    gs = torch.randn_like(xs)

    def gmm_fwd():
        with torch.no_grad():
            return grouped_mm_ffn(xs, offs, w1, w2)

    def gmm_fwdbwd():
        y = grouped_mm_ffn(xs_g, offs, w1, w2)
        torch.autograd.grad(y, [xs_g, w1, w2], gs)

    # Ours and every baseline are timed round-robin (interleaved_ms): each ratio compares
    # samples taken side by side, not minutes apart at different clocks.
    none = lambda: None  # noqa: E731
    cases = {"ours_fwd": (none, ours_ffn_fwd), "ours_fwdbwd": (none, ours_ffn_fwdbwd),
             "dense_fwd": (none, dense_fwd), "dense_fwdbwd": (none, dense_fwdbwd),
             "bmm_fwdbwd": (none, bmm_fwdbwd)}
    for name, fn in (("gmm_fwd", gmm_fwd), ("gmm_fwdbwd", gmm_fwdbwd)):
        try:
            if not hasattr(torch, "_grouped_mm"):
                raise RuntimeError("torch._grouped_mm missing")
            fn()
            cases[name] = (none, fn)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            metric = "ffn_fwd_vs_grouped_mm" if name == "gmm_fwd" else "ffn_fwdbwd_vs_grouped_mm"
            emit(dict(common, metric=metric, error=repr(exc)[:300]))
    for _, fn in cases.values():  # warm-up (compiles)
        fn()
        fn()
    t = interleaved_ms(cases, rounds=reps, calls=1)
    # The same cases again with the GPU kept busy (interleaved_ms's ``queued``): each sample
    # is enqueued behind an untimed call, as a layer's FFN is behind the routing kernels, so
    # the launch latency of an idle GPU's first kernel is left out. Reported next to the
    # idle-start ratio in the same record (``*_queued``), for ours and the baseline alike.
    tq = interleaved_ms(cases, rounds=reps, calls=1, queued=True)
    # And each case replayed from a CUDA graph (queued too): the kernels' device time with no
    # host launch work on either side, i.e. what the kernels themselves reach. The idle and
    # queued figures above stay the headline; this one says how much of a gap is launch work.
    tg = {}
    graphed = {}
    for name, (setup, fn) in cases.items():
        try:
            graphed[name] = (setup, captured(fn))
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            emit(dict(common, metric="ffn_cuda_graph_capture", case=name, error=repr(exc)[:300]))
    if graphed:
        tg = interleaved_ms(graphed, rounds=reps, calls=1, queued=True)
    del graphed

    def ffn_record(name, baseline, ours, base, flops=None):
        extra = dict(ours_ms_queued=round(tq[ours], 4), baseline_ms_queued=round(tq[base], 4),
                     ratio_queued=round(tq[base] / tq[ours], 4))
        if ours in tg and base in tg:
            extra.update(ours_ms_graphs=round(tg[ours], 4), baseline_ms_graphs=round(tg[base], 4),
                         ratio_graphs=round(tg[base] / tg[ours], 4))
        if flops is not None:
            extra.update(ours_tflops=round(flops / t[ours] / 1e9, 1),
                         baseline_tflops=round(flops / t[base] / 1e9, 1))
        record(name, baseline, t[ours], t[base], **extra)

    dense = "torch.matmul (same useful FLOPs)"
    ffn_record("ffn_fwd_vs_dense_matmul", dense, "ours_fwd", "dense_fwd", useful_fwd)
    ffn_record("ffn_fwdbwd_vs_dense_matmul", dense, "ours_fwdbwd", "dense_fwdbwd",
               3 * useful_fwd)
    # the ceiling, as FLOP rates (its rows are rounded up to a multiple of the experts)
    bmm_flops = 3 * 4.0 * experts * rows * hidden * ffn
    rate = dict(ours=3 * useful_fwd / t["ours_fwdbwd"], dense=3 * useful_fwd / t["dense_fwdbwd"],
                bmm=bmm_flops / t["bmm_fwdbwd"])
    emit(dict(common, metric="dense_parity_ceiling",
              baseline="torch.matmul (same useful FLOPs), fwd+bwd",
              ceiling="torch.bmm, every expert pairs/E rows (balanced, no padding), fwd+bwd",
              ceiling_ms=round(t["bmm_fwdbwd"], 4), baseline_ms=round(t["dense_fwdbwd"], 4),
              ceiling_tflops=round(rate["bmm"] / 1e9, 1),
              baseline_tflops=round(rate["dense"] / 1e9, 1),
              ceiling_over_dense=round(rate["bmm"] / rate["dense"], 4),
              ours_over_ceiling=round(rate["ours"] / rate["bmm"], 4),
              **({} if not {"ours_fwdbwd", "bmm_fwdbwd", "dense_fwdbwd"} <= set(tg) else dict(
                  ceiling_over_dense_graphs=round(tg["dense_fwdbwd"] * bmm_flops
                                                  / (3 * useful_fwd) / tg["bmm_fwdbwd"], 4),
                  ours_over_ceiling_graphs=round(tg["bmm_fwdbwd"] * 3 * useful_fwd
                                                 / bmm_flops / tg["ours_fwdbwd"], 4)))))
    if "gmm_fwd" in t:
        ffn_record("ffn_fwd_vs_grouped_mm", "torch._grouped_mm + gelu", "ours_fwd", "gmm_fwd")
    if "gmm_fwdbwd" in t:
        ffn_record("ffn_fwdbwd_vs_grouped_mm", "torch._grouped_mm + gelu", "ours_fwdbwd",
                   "gmm_fwdbwd")
    # (the dense and grouped inputs stay alive until the case ends: closures hold them)

    # --- whole layer fwd+bwd (router excluded: identical for every layer)
    x_g = x.clone().requires_grad_(True)
    gy = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)

    def ours_layer():  # DroplessMoE's local path (routing, FFN, combine) on these weights
        y = local_experts(x_g, ids, weights, w1, w2, None, block, "gelu")
        torch.autograd.grad(y, [x_g, w1, w2], gy)

    def ours_prepare():
        with torch.no_grad():
            return route_and_permute(x, ids, experts, block, ffn)

    capacity = math.ceil(pairs / experts * 1.0)
    dropped = {}

    def cf_layer():
        y, d = capacity_padded_layer(x_g, ids, weights, w1, w2, capacity)
        dropped["n"] = d
        torch.autograd.grad(y, [x_g, w1, w2], gy)

    for fn in (ours_layer, cf_layer, ours_prepare):
        fn()
    t = interleaved_ms({"layer": (none, ours_layer), "cf": (none, cf_layer),
                        "prepare": (none, ours_prepare)}, rounds=reps, calls=1)
    t_layer, t_cf, t_prep = t["layer"], t["cf"], t["prepare"]
    emit(dict(common, metric="permute_topology_share", baseline="layer fwd+bwd",
              ours_ms=round(t_prep, 4), baseline_ms=round(t_layer, 4),
              ratio=round(t_prep / t_layer, 4)))
    # The same step's device time alone: replayed from a CUDA graph, so the host's launch
    # work (which a layer overlaps with the GPU's previous kernels) is left out. Capturing
    # it also shows it has no host sync (capture fails on one).
    try:
        t_prep_gpu = graph_time_ms(ours_prepare, reps)
        emit(dict(common, metric="permute_topology_share_device_time",
                  baseline="layer fwd+bwd", ours_ms=round(t_prep_gpu, 4),
                  baseline_ms=round(t_layer, 4), ratio=round(t_prep_gpu / t_layer, 4)))
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        emit(dict(common, metric="permute_topology_share_device_time", error=repr(exc)[:300]))

    # Host work per layer: launching `calls` layers back to back, without waiting for the
    # GPU, against the layer's time. Below 1, the host runs ahead of the GPU (launch cost
    # hidden behind the kernels); near or above 1, the layer is host-bound.
    if x.is_cuda:
        host_ms = host_ms_per_call(ours_layer, 5)
        emit(dict(common, metric="layer_host_time_share", baseline="layer fwd+bwd",
                  ours_ms=round(host_ms, 4), baseline_ms=round(t_layer, 4),
                  ratio=round(host_ms / t_layer, 4)))

    n_drop = int(dropped["n"])
    record("layer_fwdbwd_vs_capacity_padded", "padded bmm, capacity factor 1.0", t_layer, t_cf,
           baseline_dropped_pairs=n_drop, baseline_dropped_fraction=round(n_drop / pairs, 4))
    # Both layers' fwd+bwd captured in CUDA graphs (possible because neither syncs with the
    # host): the launch work is gone, which is what small, launch-bound shapes gain from
    # running under graphs (torch.cuda.graph, make_graphed_callables, torch.compile).
    try:
        t = interleaved_ms({"layer": (none, captured(ours_layer)),
                            "cf": (none, captured(cf_layer))}, rounds=reps, calls=1)
        record("layer_fwdbwd_vs_capacity_padded_cuda_graphs",
               "padded bmm, capacity factor 1.0, both replayed from CUDA graphs",
               t["layer"], t["cf"])
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        emit(dict(common, metric="layer_fwdbwd_vs_capacity_padded_cuda_graphs",
                  error=repr(exc)[:300]))

    mem_ours = peak_bytes(ours_layer)
    mem_cf = peak_bytes(cf_layer)
    emit(dict(common, metric="peak_memory_vs_capacity_padded",
              baseline="padded bmm, capacity factor 1.0", ours_bytes=mem_ours,
              baseline_bytes=mem_cf, ratio=round(mem_ours / mem_cf, 4)))

    est_gib = experts * max_load * (4 * ffn + 4 * hidden) * 2 / 2**30
    if est_gib > skip_max_padded_above_gib:
        emit(dict(common, metric="layer_fwdbwd_vs_max_padded", skipped=True,
                  reason=f"baseline would need about {est_gib:.0f} GiB"))
    else:
        def max_layer():
            y, _ = capacity_padded_layer(x_g, ids, weights, w1, w2, max_load)
            torch.autograd.grad(y, [x_g, w1, w2], gy)

        t_max = time_ms(max_layer, max(3, reps // 3), warmup=1)
        record("layer_fwdbwd_vs_max_padded", "padded bmm, every expert padded to the max load",
               t_layer, t_max)


def tune(shape, block, dtype, device, emit, candidates) -> dict:
    """Time the FFN fwd+bwd under each kernel config; keep the fastest."""
    from rocmoe.moe import blocksparse as bs
    from rocmoe.moe import route_and_permute
    tokens, hidden, ffn, experts = shape
    gen, x, w1, w2 = expert_inputs(shape, device, dtype)
    ids, _ = make_routing(tokens, experts, 2, "uniform", device, dtype, gen)
    _, topo, xp = route_and_permute(x, ids, experts, block, ffn)
    xp = xp.detach().requires_grad_(True)
    g = torch.randn(topo.num_rows, hidden, device=device, dtype=dtype, generator=gen)
    best, best_ms = None, float("inf")
    start = dict(bs.KERNEL_CONFIG)
    candidates = [sweep_config(start, cand, bs.OPS) for cand in candidates]
    for cand in candidates:
        bs.set_kernel_config(**cand)
        try:
            def step():
                y = bs.fused_expert_ffn(xp, w1, w2, topo, "gelu")
                torch.autograd.grad(y, [xp, w1, w2], g)
            ms = time_ms(step, 5)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, skip
            emit(dict(metric="tune", config=cand, error=repr(exc)[:200]))
            continue
        emit(dict(metric="tune", shape=list(shape), config=cand, ffn_fwdbwd_ms=round(ms, 4)))
        if ms < best_ms:
            best, best_ms = cand, ms
    if best is not None:
        bs.set_kernel_config(**best)
    return best or {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rocmoe bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="T,H,F,E;T,H,F,E;... (default: the six of issue 4)")
    p.add_argument("--routing", default="uniform,zipf")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tune", action="store_true", help="pick kernel tiles on one shape first")
    p.add_argument("--output", help="also append the JSON lines to this file")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the code")
    p.add_argument("--layer", action="store_true",
                   help="the whole layer against the grouped-GEMM layer instead "
                        "(rocmoe bench moe --layer --help)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--layer" in argv:  # the whole layer against the grouped-GEMM layer (moe_layer.py)
        from . import moe_layer
        argv.remove("--layer")
        return moe_layer.main(argv)
    args = build_parser().parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps({"metric": "moe", "error": "no CUDA/ROCm device: the MoE benchmark "
                          "measures GPU kernels"}), flush=True)
        return 2
    shapes = DEFAULT_SHAPES if not args.shapes else [
        tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip()]
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    out = open(args.output, "a") if args.output else None

    def emit(rec):
        emit_line(rec, out)

    try:
        from rocmoe.moe import blocksparse as bs
        if args.tune:
            best = tune((65536, 1024, 4096, 64), args.block_size, dtype, device, emit, [
                dict(dsd=dict(block_n=256, num_warps=8, num_stages=4)),  # the default
                dict(block_n=256, num_warps=8, num_stages=3),
                dict(block_n=256, num_warps=8, num_stages=4),
                dict(block_n=128, num_warps=8, num_stages=3),
            ])
            emit(dict(metric="tune_choice", config=best))
        emit(dict(metric="kernel_config", config=dict(bs.KERNEL_CONFIG),
                  torch=torch.__version__, triton=_triton_version()))
        for shape in shapes:
            for routing in args.routing.split(","):
                t0 = time.time()
                try:
                    run_case(shape, routing, args.top_k, args.block_size, dtype, args.reps,
                             device, emit, breakdown=routing == "uniform")
                except torch.OutOfMemoryError as exc:
                    emit(dict(metric="case", shape=list(shape), routing=routing,
                              error=repr(exc)[:300]))
                torch.cuda.empty_cache()
                print(f"# {shape} {routing}: {time.time() - t0:.1f} s", file=sys.stderr,
                      flush=True)
    finally:
        if out is not None:
            out.close()
    return 0


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
