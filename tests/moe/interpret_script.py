"""Checks of the Triton kernels under Triton's CPU interpreter (run by test_triton_interpret.py).

TRITON_INTERPRET must be set before triton is imported (triton.language's own helpers are
wrapped at import time), so these run in a fresh process: ``python interpret_script.py NAME``.
"""

import contextlib
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rocmoe.moe import DroplessMoE, build_topology, plan_routing  # noqa: E402
from rocmoe.moe import blocksparse as bs  # noqa: E402
from rocmoe.moe.kernels import _grouped_tile  # noqa: E402


def _topo(block, ffn, e=3, t=21, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    return build_topology(plan_routing(ids, e, block), ffn), g


def _real(t, topo):
    """t [num_rows, X] with the padding rows (past each row block's real rows) zeroed: the
    operands the layer passes look like this, and the kernels may skip those rows."""
    rows = torch.arange(topo.block_size).view(1, -1) < topo.block_rows.view(-1, 1).long()
    return t * rows.reshape(-1, 1).to(t.dtype)


def _real_blocks(s, topo):
    """Block values [nnz, B, B] with the padding rows of every block zeroed."""
    rows = torch.arange(topo.block_size).view(1, -1) < topo.block_rows.view(-1, 1).long()
    return s * rows[topo.row_indices.long()].unsqueeze(-1).to(s.dtype)


@contextlib.contextmanager
def _with_descriptors(config_keys):
    """Run with the descriptor (TMA) kernel variants under the interpreter, record the names
    of the kernels launched (the yielded list), and restore the kernel config keys after."""
    from rocmoe.moe import kernels
    bs.TMA_IN_INTERPRETER = True
    launched = []
    real_get = kernels.get

    def recording_get(name):
        launched.append(name)
        return real_get(name)

    kernels.get = recording_get
    before = {k: bs.KERNEL_CONFIG[k] for k in config_keys}
    try:
        yield launched
    finally:
        kernels.get = real_get
        bs.TMA_IN_INTERPRETER = False
        bs.set_kernel_config(**before)


def _both(fn):
    bs.set_backend("torch")
    ref = fn()
    bs.set_backend("triton")
    got = fn()
    return ref, got


def kernels_equal_torch_path(block, ffn):
    topo, g = _topo(block, ffn)
    a = _real(torch.randn(topo.num_rows, 24, generator=g), topo)
    w1 = torch.randn(3, 24, ffn, generator=g)
    w2 = torch.randn(3, ffn, 20, generator=g)
    b = _real(torch.randn(topo.num_rows, 20, generator=g), topo)
    s_ref, s_got = _both(lambda: bs._sdd(a, w1, topo))
    torch.testing.assert_close(s_got, s_ref, rtol=1e-4, atol=1e-4)
    d_ref, d_got = _both(lambda: bs._dsd(s_ref, w2, topo))
    torch.testing.assert_close(d_got, d_ref, rtol=1e-4, atol=1e-3)
    t_ref, t_got = _both(lambda: bs._dstd(s_ref, b, topo))
    torch.testing.assert_close(t_got, t_ref, rtol=1e-4, atol=1e-3)


def kernels_take_transposed_operands_by_stride():
    # The backward passes feed transposed weight views; the kernels must honour the strides.
    topo, g = _topo(16, 24)
    w_kf = torch.randn(3, 24, 18, generator=g).transpose(1, 2)  # [E, K=18, F=24], strided
    w_fn = torch.randn(3, 20, 24, generator=g).transpose(1, 2)  # [E, F=24, N=20], strided
    a = _real(torch.randn(topo.num_rows, 18, generator=g), topo)
    s_ref, s_got = _both(lambda: bs._sdd(a, w_kf, topo))
    torch.testing.assert_close(s_got, s_ref, rtol=1e-4, atol=1e-4)
    d_ref, d_got = _both(lambda: bs._dsd(s_ref, w_fn, topo))
    torch.testing.assert_close(d_got, d_ref, rtol=1e-4, atol=1e-3)


def layer_gradients_through_kernels_equal_torch_path():
    torch.manual_seed(0)
    layer = DroplessMoE(16, 24, 4, 2, block_size=16)
    x = torch.randn(13, 16, requires_grad=True)
    g = torch.randn(13, 16)
    results = []
    for backend in ("torch", "triton"):
        bs.set_backend(backend)
        y = layer(x)
        results.append((y,) + torch.autograd.grad(y, [x, layer.w1, layer.w2], g))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


CHECKS = {
    "kernels_b16": lambda: kernels_equal_torch_path(16, 40),
    "kernels_b32": lambda: kernels_equal_torch_path(32, 32),
    "strided_operands": kernels_take_transposed_operands_by_stride,
    "layer_grads": layer_gradients_through_kernels_equal_torch_path,
}


def routing_kernels_equal_torch_ops():
    from rocmoe.moe import route_and_permute
    cases = [  # (tokens, k, experts, block, ffn, how)
        (37, 2, 6, 16, 40, "random"), (50, 1, 4, 32, 32, "one_expert"),
        (1, 3, 5, 128, 24, "random"), (300, 2, 8, 16, 48, "skewed"), (20, 2, 3, 64, 64, "random"),
        # 64 experts, more row blocks and blocks than one step of the scan's tiles
        (2000, 2, 64, 16, 64, "random")]
    for t, k, e, b, f, how in cases:
        g = torch.Generator().manual_seed(t)
        if how == "one_expert":
            ids = torch.full((t, k), 2, dtype=torch.int32)
        elif how == "skewed":  # experts 0 and 5 idle
            ids = torch.stack([torch.tensor([1, 3, 7, 4, 2, 6])[torch.randperm(6, generator=g)[:k]]
                               for _ in range(t)]).to(torch.int32)
        else:
            ids = torch.stack([torch.randperm(e, generator=g)[:k]
                               for _ in range(t)]).to(torch.int32)
        # 72 columns: the copy splits them over programs (small cases) or loops (2000 tokens)
        x = torch.randn(t, 72, generator=g, requires_grad=True)
        bs.set_backend("torch")
        ref = route_and_permute(x, ids, e, b, f)
        bs.set_backend("triton")
        got = route_and_permute(x, ids, e, b, f)
        bs.set_backend("auto")
        # without the copy: the same plan (row_token too), and no rows
        bs.set_backend("triton")
        plain = route_and_permute(x, ids, e, b, f, copy_rows=False)
        bs.set_backend("auto")
        assert plain[2] is None
        for name in ("tokens_per_expert", "dest_row", "block_expert", "num_valid_blocks",
                     "block_rows", "row_token"):
            a, c = getattr(ref[0], name), getattr(got[0], name)
            assert torch.equal(a.long(), c.long()), (how, name, a, c)
            assert torch.equal(a.long(), getattr(plain[0], name).long()), (how, name)
        for name in ("row_offsets", "column_indices", "row_indices", "column_offsets",
                     "transpose_blocks"):
            a, c = getattr(ref[1], name), getattr(got[1], name)
            assert a.dtype == c.dtype == torch.int32, name
            assert torch.equal(a, c), (how, name, a, c)
        assert torch.equal(ref[2], got[2])
        w = torch.randn(ref[2].shape, generator=g)
        ga, = torch.autograd.grad((ref[2] * w).sum(), x)
        gb, = torch.autograd.grad((got[2] * w).sum(), x)
        torch.testing.assert_close(ga, gb)


CHECKS["routing"] = routing_kernels_equal_torch_ops



def combine_kernels_equal_torch_ops():
    from rocmoe.moe import plan_routing, unpermute_combine
    g = torch.Generator().manual_seed(3)
    for t, k, e, hdim in [(37, 2, 5, 40), (9, 3, 4, 200), (1, 1, 2, 16)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        plan = plan_routing(ids, e, 16)
        y = torch.randn(plan.num_rows, hdim, generator=g, requires_grad=True)
        w = torch.rand(t, k, generator=g, requires_grad=True)
        gout = torch.randn(t, hdim, generator=g)
        results = []
        for backend in ("torch", "triton"):
            bs.set_backend(backend)
            out = unpermute_combine(y, w, plan)
            results.append((out,) + torch.autograd.grad(out, [y, w], gout))
        bs.set_backend("auto")
        for a, c in zip(*results):
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


CHECKS["combine"] = combine_kernels_equal_torch_ops


def padding_rows_and_gather_sum_kernels():
    # The scatter kernel (permuted tokens) and the combine backward (row gradients) zero
    # exactly the rows no pair maps to (tails of experts' last blocks, whole blocks past the
    # count, an idle expert) in buffers that start as garbage, and leave the pairs' rows
    # alone; gather_sum_rows (the permutation's backward) sums each token's k rows.
    from rocmoe.moe import plan_routing, route_and_permute, unpermute_combine
    from rocmoe.moe.permute import gather_sum_rows
    real_new_empty, real_empty_like = torch.Tensor.new_empty, torch.empty_like

    def nan_new_empty(self, *a, **k):
        t = real_new_empty(self, *a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*a, **k):
        t = real_empty_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.Tensor.new_empty, torch.empty_like = nan_new_empty, nan_empty_like
    g = torch.Generator().manual_seed(5)
    try:
        bs.set_backend("triton")
        for t, k, e, block, hdim in [(37, 2, 5, 16, 40), (70, 3, 6, 32, 300), (1, 1, 3, 16, 8)]:
            ids = torch.stack([torch.randperm(e, generator=g)[:k]
                               for _ in range(t)]).to(torch.int32)
            ids[ids == 1] = 0  # expert 1 idle
            x = torch.randn(t, hdim, generator=g)
            plan, _, xp = route_and_permute(x, ids, e, block, 2 * block)
            used = torch.zeros(plan.num_rows, dtype=torch.bool)
            used[plan.dest_row.reshape(-1)] = True
            assert (xp[~used] == 0).all() and not torch.isnan(xp).any(), (t, k, e)
            y = torch.randn(plan.num_rows, hdim, generator=g, requires_grad=True)
            w = torch.rand(t, k, generator=g)
            gy, = torch.autograd.grad(unpermute_combine(y, w, plan), y,
                                      torch.randn(t, hdim, generator=g))
            assert (gy[~used] == 0).all() and not torch.isnan(gy).any(), (t, k, e)
            rows = torch.randn(plan.num_rows, hdim, generator=g)
            expect = sum(rows[plan.dest_row[:, j]] for j in range(k))
            torch.testing.assert_close(gather_sum_rows(rows, plan.dest_row), expect)
            assert plan_routing(ids, e, block).num_rows == plan.num_rows
    finally:
        torch.Tensor.new_empty, torch.empty_like = real_new_empty, real_empty_like
        bs.set_backend("auto")


CHECKS["padding_rows"] = padding_rows_and_gather_sum_kernels


def layer_gradients_load_fusion():
    # the default is act_fusion="store"; this runs the activation-on-load kernels
    before = bs.KERNEL_CONFIG["act_fusion"]
    bs.set_kernel_config(act_fusion="load")
    try:
        layer_gradients_through_kernels_equal_torch_path()
    finally:
        bs.set_kernel_config(act_fusion=before)


CHECKS["layer_grads_load"] = layer_gradients_load_fusion


def descriptor_kernels_equal_torch_path():
    # The TMA variants (tensor-descriptor operands, Hopper) index tiles differently from the
    # pointer path: run them under the interpreter (fp16; its numpy has no bf16), with the
    # weights in both layouts (W and the backward's transposed views) and an N that is not
    # a multiple of the tile (the transposed-weight boxes then reach into the next expert).
    bs.TMA_IN_INTERPRETER = True
    used = []
    real_desc = bs.tensor_descriptor

    def counting_desc(*args, **kw):
        d = real_desc(*args, **kw)
        used.append(d is not None)
        return d

    bs.tensor_descriptor = counting_desc
    before = {k: bs.KERNEL_CONFIG[k] for k in ("block_n", "block_k") + bs.OPS}
    bs.set_kernel_config(block_n=32, block_k=16, **{op: {} for op in bs.OPS})
    try:
        topo, g = _topo(16, 32)
        dt = torch.float16
        a = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        w1 = torch.randn(3, 32, 32, generator=g).to(dt)
        w2 = torch.randn(3, 32, 48, generator=g).to(dt)
        b = _real(torch.randn(topo.num_rows, 48, generator=g), topo).to(dt)
        tol = dict(rtol=2e-2, atol=5e-2)
        s_ref, s_got = _both(lambda: bs._sdd(a, w1, topo))
        torch.testing.assert_close(s_got.float(), s_ref.float(), **tol)
        t_ref, t_got = _both(lambda: bs._sdd(b, w2.transpose(1, 2), topo))
        torch.testing.assert_close(t_got.float(), t_ref.float(), **tol)
        for w in (w2, w1.transpose(1, 2)):
            d_ref, d_got = _both(lambda: bs._dsd(s_ref, w, topo))
            torch.testing.assert_close(d_got.float(), d_ref.float(), **tol)
        e_ref, e_got = _both(lambda: bs._dstd(s_ref, b, topo))
        torch.testing.assert_close(e_got.float(), e_ref.float(), **tol)
        assert used and all(used), used  # every operand went through a descriptor
    finally:
        bs.tensor_descriptor = real_desc
        bs.TMA_IN_INTERPRETER = False
        bs.set_kernel_config(**before)


CHECKS["descriptors"] = descriptor_kernels_equal_torch_path


def dstd_store_and_persistent_variants_equal_torch_path():
    # DSᵀD's TMA output store (both output layouts: dW2 as [E*F, N], dW1 written through a
    # transposed view as [E*N, F]) and its persistent flat loop (several tiles per program,
    # a variable number of k steps per tile, an expert with no tokens whose tile must still
    # be written as zeros), under the interpreter with descriptors.
    with _with_descriptors(("block_n", "block_k") + bs.OPS) as launched:
        g = torch.Generator().manual_seed(3)
        # expert 1 gets no tokens; expert 0 gets three row blocks, expert 2 one
        ids = torch.tensor([[0, 2]] * 9 + [[0, 3]] * 30 + [[3, 2]] * 4, dtype=torch.int32)
        topo = build_topology(plan_routing(ids, 4, 16), 32)
        dt = torch.float16
        s = _real_blocks(torch.randn(topo.nnz, 16, 16, generator=g), topo).to(dt)
        b = _real(torch.randn(topo.num_rows, 64, generator=g), topo).to(dt)
        tol = dict(rtol=2e-2, atol=5e-2)
        for variant in (dict(tma_store=True), dict(persistent=1), dict(persistent=2),
                        dict(persistent=1, tma_store=True)):
            bs.set_kernel_config(block_n=32, block_k=16,
                                 **{op: ({} if op != "dstd" else variant) for op in bs.OPS})
            ref, got = _both(lambda: bs._dstd(s, b, topo))
            torch.testing.assert_close(got.float(), ref.float(), **tol)
            assert got[1].abs().max() == 0  # the idle expert's gradient is written as zeros
            # dW1's layout: the output is the transpose of a contiguous [E, N, F]
            outs = [torch.full((4, 64, 32), float("nan"), dtype=dt) for _ in range(2)]
            bs.set_backend("torch")
            bs._dstd(s, b, topo, out=outs[0].transpose(1, 2))
            bs.set_backend("triton")
            bs._dstd(s, b, topo, out=outs[1].transpose(1, 2))
            bs.set_backend("auto")
            torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
        assert "dstd_persistent_kernel" in launched and "dstd_kernel" in launched


CHECKS["dstd_variants"] = dstd_store_and_persistent_variants_equal_torch_path


def sdd_persistent_equals_torch_path():
    # The persistent SDD (descriptors, several tiles per program, padding row blocks that
    # must come out as zeros) with every epilogue: plain, the forward's act/act' store, the
    # backward's act'(h) scale, act' from h, act alone; W as stored and
    # transposed (W_T).
    with _with_descriptors(("block_n", "block_k", "preload_scale") + bs.OPS) as launched:
        topo, g = _topo(16, 32, e=4, t=29)
        assert int(topo.num_valid_blocks) < topo.num_row_blocks  # padding row blocks
        dt = torch.float16
        a = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        w = torch.randn(4, 32, 32, generator=g).to(dt)
        w_t = torch.randn(4, 32, 32, generator=g).to(dt).transpose(1, 2)
        h = (torch.rand(topo.nnz, 16, 16, generator=g) + 0.5).to(dt)
        tol = dict(rtol=2e-2, atol=5e-2)
        for persistent, preload in ((2, True), (1, False)):
            bs.set_kernel_config(block_n=32, block_k=16, preload_scale=preload,
                                 **{op: ({} if op != "sdd" else dict(persistent=persistent))
                                    for op in bs.OPS})
            for weight in (w, w_t):
                runs = [lambda: bs._sdd(a, weight, topo),
                        lambda: bs._sdd(a, weight, topo, scale_by=h),
                        lambda: bs._sdd(a, weight, topo, act_grad_of=h, act="gelu"),
                        lambda: bs._sdd(a, weight, topo, act="silu", act_only=True)]
                for run in runs:
                    ref, got = _both(run)
                    torch.testing.assert_close(got.float(), ref.float(), **tol)
                acts = [torch.full((topo.nnz, 16, 16), float("nan"), dtype=dt) for _ in range(2)]
                bs.set_backend("torch")
                ref = bs._sdd(a, weight, topo, act="gelu", act_out=acts[0])
                bs.set_backend("triton")
                got = bs._sdd(a, weight, topo, act="gelu", act_out=acts[1])
                bs.set_backend("auto")
                torch.testing.assert_close(got.float(), ref.float(), **tol)
                torch.testing.assert_close(acts[1].float(), acts[0].float(), **tol)
        assert "sdd_persistent_kernel" in launched and "sdd_kernel" not in launched


CHECKS["sdd_persistent"] = sdd_persistent_equals_torch_path


def _ffn_equals_torch_path(topo, x, w1, w2, gy, tol):
    """The forward SDD's two outputs (padding rows included: they start as NaN), and the
    fused FFN's output and gradients, equal on the torch path and the Triton kernels."""
    results = []
    for backend in ("torch", "triton"):
        bs.set_backend(backend)
        acts = torch.full(topo.values_shape(), float("nan"), dtype=x.dtype)
        grads = bs._sdd(x, w1, topo, act="gelu", act_out=acts)
        xg, w1g, w2g = (t.clone().requires_grad_(True) for t in (x, w1, w2))
        y = bs.fused_expert_ffn(xg, w1g, w2g, topo, "gelu")
        results.append((grads, acts, y) + torch.autograd.grad(y, [xg, w1g, w2g], gy))
    bs.set_backend("auto")
    for ref, got in zip(*results):
        torch.testing.assert_close(got.float(), ref.float(), **tol)


def tail_blocks_equal_torch_path():
    # Row blocks with at most B/2 real rows run as half blocks in SDD and DSD (zeros, or
    # act'(0) for the forward's act' output, below), and DSᵀD reduces over real rows only:
    # the fused FFN's output and gradients, and the forward SDD's two outputs including
    # their padding rows, equal the torch path. Blocks 32 and 64; pointer loads (fp32) and
    # descriptors (fp16, with the half-height boxes).
    g = torch.Generator().manual_seed(11)
    for block, dt, tma in ((32, torch.float32, False), (64, torch.float32, False),
                           (32, torch.float16, True)):
        bs.TMA_IN_INTERPRETER = tma
        # expert 0: 3 blocks (last one 8 rows: half); expert 1: 1 block of block/2 + 1 rows
        # (full); expert 2: block/2 rows (half); expert 3 idle
        counts = [2 * block + 8, block // 2 + 1, block // 2, 0]
        ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(torch.int32)
        ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
        topo = build_topology(plan_routing(ids, 4, block), 2 * block)
        half = (topo.block_rows > 0) & (topo.block_rows <= block // 2)
        assert int(half.sum()) == 2 and int((topo.block_rows > block // 2).sum()) == 3
        x = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        w1 = (torch.randn(4, 32, 2 * block, generator=g) / 6).to(dt)
        w2 = (torch.randn(4, 2 * block, 32, generator=g) / 8).to(dt)
        gy = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        _ffn_equals_torch_path(topo, x, w1, w2, gy, tol)
        bs.TMA_IN_INTERPRETER = False


CHECKS["tail_blocks"] = tail_blocks_equal_torch_path


@triton.jit
def _grouped_order_kernel(out_ptr, num_n, GROUP_M: tl.constexpr):
    # each program writes the tile index kernels._grouped_tile gives it
    row, n = _grouped_tile(tl.program_id(0), tl.num_programs(0) // num_n, num_n, GROUP_M)
    tl.store(out_ptr + tl.program_id(0), row * num_n + n)


def grouped_order_equals_torch_path():
    # group_m > 1 reorders SDD's and DSD's output tiles (several row blocks take each column
    # tile in turn): the order visits every tile exactly once, also when the row blocks are
    # not a multiple of the group, and the products, fused FFN and gradients are unchanged,
    # with pointer loads and with descriptors (plain and persistent SDD).
    for rows, num_n, group in ((7, 3, 2), (7, 3, 3), (5, 4, 8), (12, 1, 4)):
        seen = torch.full((rows * num_n,), -1, dtype=torch.int32)
        _grouped_order_kernel[(rows * num_n,)](seen, num_n, GROUP_M=group)
        assert sorted(seen.tolist()) == list(range(rows * num_n)), (rows, num_n, group)
        assert seen.tolist() != list(range(rows * num_n)) or num_n == 1

    g = torch.Generator().manual_seed(5)
    # five row blocks for expert 0, two for expert 1, one for expert 2, expert 3 idle
    counts = [70, 20, 9, 0]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(torch.int32)
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    topo = build_topology(plan_routing(ids, 4, 16), 48)
    for tma, dt in ((False, torch.float32), (True, torch.float16)):
        x = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        w1 = (torch.randn(4, 32, 48, generator=g) / 6).to(dt)
        w2 = (torch.randn(4, 48, 32, generator=g) / 8).to(dt)
        gy = _real(torch.randn(topo.num_rows, 32, generator=g), topo).to(dt)
        tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        variants = [dict(group_m=3), dict(group_m=2, sdd=dict(block_n=32))]
        if tma:
            variants.append(dict(group_m=3, sdd=dict(persistent=2)))
        for variant in variants:
            with _with_descriptors(("block_n", "block_k", "group_m") + bs.OPS) as launched:
                bs.TMA_IN_INTERPRETER = tma
                bs.set_kernel_config(block_n=16, block_k=16,
                                     **{op: variant.get(op, {}) for op in bs.OPS},
                                     group_m=variant["group_m"])
                _ffn_equals_torch_path(topo, x, w1, w2, gy, tol)
                want = "sdd_persistent_kernel" if "persistent" in variant.get("sdd", {}) \
                    else "sdd_kernel"
                assert want in launched and "dsd_kernel" in launched


CHECKS["grouped_order"] = grouped_order_equals_torch_path


def inference_forward_equals_torch_path():
    # no gradient needed: the SDD epilogue writes act(x W1) alone (EPILOGUE_ACT)
    topo, g = _topo(16, 24)
    x = _real(torch.randn(topo.num_rows, 20, generator=g), topo)
    w1 = torch.randn(3, 20, 24, generator=g)
    w2 = torch.randn(3, 24, 18, generator=g)
    for act in ("gelu", "silu", "relu"):
        with torch.no_grad():
            ref, got = _both(lambda: bs.fused_expert_ffn(x, w1, w2, topo, act))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


CHECKS["inference"] = inference_forward_equals_torch_path


def lean_layer_variants_equal_torch_path_and_each_other():
    # The memory-lean layer: act_fusion="recompute" (only h kept; the backward SDD turns h
    # into act(h) in place) and gather_rows (SDD and DSᵀD read the tokens through
    # plan.row_token: no permuted copy). Each of the four (fusion, gather) combinations
    # through the kernels equals the torch path, and all four give bitwise the same output
    # and gradients on the kernels (the same products on the same values, act' rounded
    # alike): pointer loads in fp32 and descriptors in fp16 (where A and dW1's B operand
    # are gathered by pointer beside descriptor loads), the inference forward too.
    torch.manual_seed(0)
    for tma, dt in ((False, torch.float32), (True, torch.float16)):
        layer = DroplessMoE(32, 48, 4, 2, block_size=16, dtype=dt)
        x = torch.randn(23, 32).to(dt)
        g = torch.randn(23, 32).to(dt)
        tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        keys = ("block_n", "block_k", "act_fusion", "gather_rows", "compact_values") + bs.OPS
        kernel_results = {}
        # the previous layer, the lean default, and each of the default's keys flipped
        for fusion, gather, compact in (("store", False, False), ("recompute", True, True),
                                        ("store", True, True), ("recompute", False, True),
                                        ("recompute", True, False), ("checkpoint", True, True),
                                        ("recompute", "backward", True)):
                with _with_descriptors(keys) as launched:
                    bs.TMA_IN_INTERPRETER = tma
                    bs.set_kernel_config(block_n=16, block_k=16, act_fusion=fusion,
                                         gather_rows=gather, compact_values=compact,
                                         **{op: {} for op in bs.OPS if op != "dstd"},
                                         dstd=dict(persistent=2))
                    runs = []
                    for backend in ("torch", "triton"):
                        bs.set_backend(backend)
                        xg = x.clone().requires_grad_(True)
                        y = layer(xg)
                        grads = torch.autograd.grad(y, [xg, layer.w1, layer.w2], g)
                        with torch.no_grad():
                            runs.append((y, layer(x)) + grads)
                    bs.set_backend("auto")
                    assert ("dstd_persistent_kernel" in launched) == tma, launched
                for ref, got in zip(*runs):
                    torch.testing.assert_close(got.float(), ref.float(), **tol)
                kernel_results[(fusion, gather, compact)] = runs[1]
        base = kernel_results[("store", False, False)]
        for variant, got in kernel_results.items():
            for a, c in zip(base, got):
                assert torch.equal(a, c), (tma, variant)


CHECKS["lean_layer"] = lean_layer_variants_equal_torch_path_and_each_other


def compact_values_equal_block_values():
    # Compact topologies keep the values without padding rows ([pairs, nb * B]): every
    # product on them (SDD with the forward's act/act' store, DSD with half blocks and
    # tiles whose boxes reach into the next expert, DSᵀD with an idle expert, the fused
    # FFN's gradients) equals the torch path, and equals the block layout bitwise once
    # converted; pointer loads (fp32), descriptors (fp16), the persistent SDD and DSᵀD.
    g = torch.Generator().manual_seed(13)
    block = 32
    counts = [2 * block + 8, block // 2 + 1, block // 2, 0]  # half blocks, an idle expert
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(torch.int32)
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    plan = plan_routing(ids, 4, block)
    topo_c = build_topology(plan, 2 * block, compact=True)
    topo_b = build_topology(plan, 2 * block)
    assert topo_c.values_shape() == (ids.numel(), 2 * block)
    for tma, dt, persistent in ((False, torch.float32, 0), (True, torch.float16, 0),
                                (True, torch.float16, 2)):
        x = _real(torch.randn(topo_c.num_rows, 32, generator=g), topo_c).to(dt)
        w1 = (torch.randn(4, 32, 2 * block, generator=g) / 6).to(dt)
        w2 = (torch.randn(4, 2 * block, 32, generator=g) / 8).to(dt)
        gy = _real(torch.randn(topo_c.num_rows, 32, generator=g), topo_c).to(dt)
        tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        with _with_descriptors(("block_n", "block_k") + bs.OPS) as launched:
            bs.TMA_IN_INTERPRETER = tma
            bs.set_kernel_config(block_n=32, block_k=16,
                                 **{op: (dict(persistent=persistent)
                                         if op in ("sdd", "dstd") else {}) for op in bs.OPS})
            _ffn_equals_torch_path(topo_c, x, w1, w2, gy, tol)
            bs.set_backend("triton")
            outs = []
            for topo in (topo_c, topo_b):
                acts = torch.full(topo.values_shape(), float("nan"), dtype=dt)
                grads = bs._sdd(x, w1, topo, act="gelu", act_out=acts)
                xg, w1g, w2g = (t.clone().requires_grad_(True) for t in (x, w1, w2))
                y = bs.fused_expert_ffn(xg, w1g, w2g, topo, "gelu")
                # (the values' real rows: block values also hold act'(0) in padding rows)
                outs.append([_real_blocks(bs._values_to_blocks(v, topo), topo)
                             for v in (grads, acts)]
                            + [y] + list(torch.autograd.grad(y, [xg, w1g, w2g], gy)))
            bs.set_backend("auto")
            for a, c in zip(*outs):
                assert torch.equal(a, c), (tma, persistent)
            if persistent:
                assert {"sdd_persistent_kernel", "dstd_persistent_kernel"} <= set(launched)
        bs.TMA_IN_INTERPRETER = False
    # more experts than pairs: every row block is used and idle experts come after the
    # last one (their columns point one row block past the end)
    ids = torch.tensor([[1], [0]], dtype=torch.int32)
    plan = plan_routing(ids, 4, 16)
    topo = build_topology(plan, 32, compact=True)
    assert int(topo.num_valid_blocks) == topo.num_row_blocks
    x = _real(torch.randn(topo.num_rows, 16, generator=g), topo)
    w1, w2 = torch.randn(4, 16, 32, generator=g), torch.randn(4, 32, 16, generator=g)
    gy = _real(torch.randn(topo.num_rows, 16, generator=g), topo)
    _ffn_equals_torch_path(topo, x, w1, w2, gy, dict(rtol=1e-4, atol=1e-4))


CHECKS["compact_values"] = compact_values_equal_block_values


def router_kernels_equal_torch_ops():
    # the fused router (rocmoe/moe/router_fused.py) against Router.route_reference: the same
    # picks, weights, tokens per expert and aux loss, and the same gradients of x and the
    # gate through the weights and the aux loss; shapes with one token, padded expert
    # counts, top-1 without renormalisation, and more rows than one program's block
    from rocmoe.moe import Router
    for t, e, k, renorm, dtype in [(37, 6, 2, True, torch.float32), (1, 4, 1, False, torch.float32),
                                   (300, 8, 2, True, torch.float32),
                                   (20, 128, 8, False, torch.float32),
                                   (50, 64, 6, True, torch.bfloat16)]:
        torch.manual_seed(0)
        r = Router(16, e, k, renormalize=renorm).to(dtype)
        x = torch.randn(t, 16, dtype=dtype, requires_grad=True)
        g_w = torch.randn(t, k)
        got = []
        for backend in ("torch", "triton"):
            bs.set_backend(backend)
            ids, w = r.route(x)
            loss = (w.float() * g_w).sum() + 3.0 * r.aux_loss
            got.append((ids, w, r.tokens_per_expert, r.aux_loss)
                       + torch.autograd.grad(loss, [x, r.weight]))
        (ids0, w0, c0, a0, gx0, gw0), (ids1, w1, c1, a1, gx1, gw1) = got
        assert ids1.dtype == torch.int32 and c1.dtype == torch.int32 and w1.dtype == dtype
        assert torch.equal(ids1, ids0), (t, e, k)
        assert torch.equal(c1, c0), (t, e, k)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(w1, w0, **tol)
        torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gw1, gw0, rtol=1e-4, atol=1e-5)
    # equal logits (a zero gate): the lowest expert indices, in order, for every token
    r = Router(16, 8, 3)
    with torch.no_grad():
        r.weight.zero_()
    bs.set_backend("triton")
    ids, w = r.route(torch.randn(5, 16))
    assert torch.equal(ids, torch.tensor([[0, 1, 2]] * 5, dtype=torch.int32)), ids
    torch.testing.assert_close(w, torch.full((5, 3), 1 / 3))


CHECKS["router"] = router_kernels_equal_torch_ops


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print("INTERPRET_OK", sys.argv[1])
