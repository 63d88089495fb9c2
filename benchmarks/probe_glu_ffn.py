"""Would the single-GPU layer's GLU experts run faster on the task-table grouped kernels?

Why this exists: the dropless layer computes a GLU FFN (Mixtral's SwiGLU) by composing the
block-sparse products (sdd for W1 and W3, the gate in torch, dsd for W2), and the one case
of the layer benchmark below 1.0 against the torch._grouped_mm layer is Mixtral-like at
4096 tokens (0.96-0.97 idle-start, 0.89-0.91 under graphs: kernel-bound;
results/moe_layer_h200_all24.jsonl). Since the twentieth session gpu.grouped_local (the
expert-parallel step's products) runs 4-10 % ahead of torch._grouped_mm on the step's rows
(results/probe_grouped_persistent_h200_twentieth_session.jsonl). This probe times, on the
same routed tokens, forward + backward of the experts and the weighted combine:

* ``block-sparse (the layer)``: DroplessMoE's own path (local_experts);
* ``grouped_local``: the same padded, expert-sorted rows (permute_pad), each expert's
  segment its padded rows (device counts: no host read), act(X W1) * (X W3) then W2 through
  gpu.grouped_local, dW through gpu.grouped_weight_grad, the same combine;
* ``torch._grouped_mm (the baseline layer)``: reference.grouped_gemm_moe.

    python3 benchmarks/probe_glu_ffn.py [--shapes T,H,F,E,K;...] [--reps 10]
    TRITON_INTERPRET=1 python3 benchmarks/probe_glu_ffn.py --device cpu  # dry run, fp32

One JSON line per shape and case: fwd+bwd ms idle-start and queued (interleaved medians),
the relative error of the output and dX against the baseline's.

What it found (H200, twentieth session, one run; results/probe_glu_ffn_h200_twentieth_session
.jsonl): no. Idle-start against the baseline layer, block-sparse / grouped_local: Mixtral-
like 4096 tokens 0.983 / 0.964, 16384 tokens 1.097 / 1.004, Qwen3-30B-A3B-like 4096 tokens
1.217 / 1.149 (queued 0.987 / 0.949, 1.023 / 0.938, 1.282 / 1.192). The layer keeps its
block-sparse products. (That run computed the dX error in float32 and printed 0.0 for both
Mixtral shapes, which an overflowed norm of the baseline's dX explains; the errors are
float64 since. The outputs agreed within 2.8e-3 of the baseline's.)"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = "4096,4096,14336,8,2;16384,4096,14336,8,2;4096,2048,768,128,8"


class _Products(torch.autograd.Function):
    """Y = grouped_local(X, W, counts [1, E]) with dX and dW by the grouped kernels."""

    @staticmethod
    def forward(ctx, x, w, counts, status):
        from rocmoe.ops import gpu
        ctx.save_for_backward(x, w, counts)
        ctx.status = status
        return gpu.grouped_local(x, w, counts, status.data_ptr())

    @staticmethod
    def backward(ctx, gy):
        from rocmoe.ops import gpu
        x, w, counts = ctx.saved_tensors
        gy = gy.contiguous()
        dx = gpu.grouped_local(gy, w.transpose(1, 2), counts, ctx.status.data_ptr())
        dw = gpu.grouped_weight_grad(x, gy, counts, w.shape[0], w.dtype)
        return dx, dw, None, None


def grouped_glu_experts(layer, x, expert_ids, weights, status):
    from rocmoe.moe.activations import ACTIVATIONS
    from rocmoe.moe.permute import permute_pad, unpermute_combine
    from rocmoe.moe.routing import route_and_permute
    with torch.no_grad():
        plan, topo, _ = route_and_permute(x, expert_ids, layer.w1.shape[0], layer.block_size,
                                          layer.w1.shape[2], copy_rows=False)
        b = layer.block_size
        counts = ((topo.expert_rows.to(torch.int64) + b - 1) // b * b).view(1, -1)
    rows = permute_pad(x, plan)
    h = ACTIVATIONS[layer.activation](_Products.apply(rows, layer.w1, counts, status))
    h = h * _Products.apply(rows, layer.w3, counts, status)
    y = _Products.apply(h, layer.w2, counts, status)
    return unpermute_combine(y, weights, plan)


def _rel(a, b) -> float:
    """|a - b| / |b| in float64 (a float32 norm of large gradients can overflow)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args(argv)
    from rocmoe.bench.timing import interleaved_ms
    from rocmoe.moe import DroplessMoE
    from rocmoe.moe.reference import grouped_gemm_moe
    dev, dtype = torch.device(a.device), torch.bfloat16
    if dev.type == "cpu":  # the interpreter's dry run: small, fp32
        dtype, a.shapes, a.reps = torch.float32, "64,32,48,4,2", 1
    status = torch.zeros(64, dtype=torch.int32, device=dev)
    for spec in a.shapes.split(";"):
        t, h, f, e, k = (int(v) for v in spec.split(","))
        torch.manual_seed(0)
        layer = DroplessMoE(h, f, e, k, activation="silu", glu=True).to(dev, dtype)
        x = torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)
        with torch.no_grad():
            ids, gate = layer.router.route(x)
        gate = gate.detach().requires_grad_(True)
        gy = torch.randn(t, h, device=dev, dtype=dtype)
        cases = {
            "block-sparse (the layer)": lambda: layer._local_experts(x, ids, gate),
            "grouped_local": lambda: grouped_glu_experts(layer, x, ids, gate, status),
            "torch._grouped_mm (the baseline layer)": lambda: grouped_gemm_moe(
                x, ids, gate, layer.w1, layer.w2, layer.w3, "silu"),
        }
        results = {}
        for name, fn in cases.items():
            out = fn()
            dx, = torch.autograd.grad(out, [x], gy)
            results[name] = (out.detach().float(), dx.float())

        def step(fn):
            out = fn()
            out.backward(gy)
        timed = {name: (lambda: None, lambda fn=fn: step(fn)) for name, fn in cases.items()}
        if dev.type == "cuda":
            for _ in range(2):
                for _, fn in timed.values():
                    fn()
            torch.cuda.synchronize()
            idle = interleaved_ms(timed, rounds=a.reps, calls=1)
            queued = interleaved_ms(timed, rounds=a.reps, calls=1, queued=True)
        else:  # the interpreter's dry run: one timed step a case, no queued timing
            idle = queued = interleaved_ms(timed, rounds=1, calls=1)
        base_out, base_dx = results["torch._grouped_mm (the baseline layer)"]
        base = "torch._grouped_mm (the baseline layer)"
        for name in cases:
            out, dx = results[name]
            print(json.dumps(dict(
                probe="glu_ffn", shape=dict(tokens=t, hidden=h, ffn=f, experts=e, top_k=k),
                case=name, fwd_bwd_ms=round(idle[name], 4), queued_ms=round(queued[name], 4),
                ratio_vs_baseline=round(idle[base] / idle[name], 3),
                queued_ratio_vs_baseline=round(queued[base] / queued[name], 3),
                rel_err_out=_rel(out, base_out), rel_err_dx=_rel(dx, base_dx))), flush=True)
        cases = timed = results = None  # (the next shape's tensors replace these)


if __name__ == "__main__":
    main()
