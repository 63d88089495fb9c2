"""The four block-sparse products against dense matmuls over the same topology (torch path)."""

import pytest
import torch

from rocmoe.errors import DTypeError, InvalidArgumentError
from rocmoe.moe import blocksparse as bs
from rocmoe.moe.activations import activation_grad
from rocmoe.moe.backend import triton_available, use_triton
from rocmoe.moe import build_topology, plan_routing


@pytest.fixture(autouse=True)
def torch_backend():
    bs.set_backend("torch")
    yield
    bs.set_backend("auto")


def _setup(block=16, ffn=40, e=4, t=23, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    topo = build_topology(plan_routing(ids, e, block), ffn)
    return topo, g


def _mask(topo):
    """Dense [P, E*F] 0/1 mask of the topology's blocks (logical ffn columns only)."""
    dense = bs.to_dense(torch.ones(topo.nnz, topo.block_size, topo.block_size,
                                   dtype=torch.float64), topo)
    keep = (torch.arange(topo.num_experts * topo.ffn_padded) % topo.ffn_padded) < topo.ffn_size
    return dense[:, keep]


def _cat(w):  # [E, K, F] -> [K, E*F]
    return w.permute(1, 0, 2).reshape(w.shape[1], -1)


def _to_logical(s, topo):
    dense = bs.to_dense(s, topo)
    keep = (torch.arange(topo.num_experts * topo.ffn_padded) % topo.ffn_padded) < topo.ffn_size
    return dense[:, keep]


def test_sdd_equals_dense_product_masked_by_the_topology():
    topo, g = _setup()
    a = torch.randn(topo.num_rows, 12, generator=g, dtype=torch.float64)
    w = torch.randn(4, 12, 40, generator=g, dtype=torch.float64)
    s = bs.sdd(a, w, topo)
    torch.testing.assert_close(_to_logical(s, topo), (a @ _cat(w)) * _mask(topo))


def test_sdd_leaves_the_ffn_padding_columns_zero():
    topo, g = _setup(ffn=40)
    s = bs.sdd(torch.randn(topo.num_rows, 12, generator=g),
               torch.randn(4, 12, 40, generator=g), topo)
    dense = bs.to_dense(s, topo).view(topo.num_rows, 4, topo.ffn_padded)
    assert torch.count_nonzero(dense[:, :, 40:]) == 0


def test_dsd_equals_dense_product():
    topo, g = _setup()
    s = bs.sdd(torch.randn(topo.num_rows, 12, generator=g, dtype=torch.float64),
               torch.randn(4, 12, 40, generator=g, dtype=torch.float64), topo)
    w = torch.randn(4, 40, 9, generator=g, dtype=torch.float64)
    torch.testing.assert_close(bs.dsd(s, w, topo), _to_logical(s, topo) @ w.reshape(-1, 9))


def test_dstd_equals_dense_transposed_product():
    topo, g = _setup()
    s = bs.sdd(torch.randn(topo.num_rows, 12, generator=g, dtype=torch.float64),
               torch.randn(4, 12, 40, generator=g, dtype=torch.float64), topo)
    b = torch.randn(topo.num_rows, 7, generator=g, dtype=torch.float64)
    expect = (_to_logical(s, topo).t() @ b).view(4, 40, 7)
    torch.testing.assert_close(bs.dstd(s, b, topo), expect)


def test_ddst_equals_dense_times_transposed_sparse():
    topo, g = _setup()
    s = bs.sdd(torch.randn(topo.num_rows, 12, generator=g, dtype=torch.float64),
               torch.randn(4, 12, 40, generator=g, dtype=torch.float64), topo)
    w = torch.randn(4, 5, 40, generator=g, dtype=torch.float64)
    torch.testing.assert_close(bs.ddst(w, s, topo), _cat(w) @ _to_logical(s, topo).t())


@pytest.mark.parametrize("op", ["sdd", "dsd", "dstd", "ddst"])
def test_gradients_pass_gradcheck(op):
    topo, g = _setup(block=16, ffn=20, e=3, t=9)
    d = dict(generator=g, dtype=torch.float64)
    s = bs.sdd(torch.randn(topo.num_rows, 6, **d), torch.randn(3, 6, 20, **d), topo).detach()
    if op == "sdd":
        args = (torch.randn(topo.num_rows, 6, **d), torch.randn(3, 6, 20, **d))
        fn = lambda a, w: bs.sdd(a, w, topo)
    elif op == "dsd":
        args = (s, torch.randn(3, 20, 5, **d))
        fn = lambda s_, w: bs.dsd(s_, w, topo)
    elif op == "dstd":
        args = (s, torch.randn(topo.num_rows, 5, **d))
        fn = lambda s_, b: bs.dstd(s_, b, topo)
    else:
        args = (torch.randn(3, 5, 20, **d), s)
        fn = lambda w, s_: bs.ddst(w, s_, topo)
    args = tuple(a.clone().requires_grad_(True) for a in args)
    # Compare on the topology's support only: values outside it are not part of the matrix.
    def restricted(*xs):
        out = fn(*xs)
        return out * _support_mask(out, topo)
    assert torch.autograd.gradcheck(restricted, args, eps=1e-6, atol=1e-6, fast_mode=True)


def _support_mask(out, topo):
    if out.dim() == 3 and out.shape[1:] == (topo.block_size, topo.block_size):
        m = torch.ones_like(out)
        m[~topo.block_valid()] = 0
        return m
    return torch.ones_like(out)


def test_mixed_dtypes_are_rejected():
    topo, g = _setup()
    with pytest.raises(DTypeError, match="share one dtype"):
        bs.sdd(torch.randn(topo.num_rows, 12), torch.randn(4, 12, 40, dtype=torch.float64), topo)


def test_wrong_sparse_shape_is_rejected():
    topo, g = _setup()
    with pytest.raises(InvalidArgumentError, match="sparse values must have shape"):
        bs.dsd(torch.randn(3, 16, 16), torch.randn(4, 40, 9), topo)


@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "none"])
def test_fused_ffn_without_gradients_equals_the_training_forward(act):
    # with no input requiring grad, the forward takes the act-only epilogue and saves nothing
    topo, g = _setup()
    x = torch.randn(topo.num_rows, 12, generator=g, dtype=torch.float64)
    w1 = torch.randn(topo.num_experts, 12, topo.ffn_size, generator=g, dtype=torch.float64)
    w2 = torch.randn(topo.num_experts, topo.ffn_size, 10, generator=g, dtype=torch.float64)
    w1.requires_grad_(True)
    with torch.no_grad():  # (the weights still require grad, as in a model's eval step)
        inference = bs.fused_expert_ffn(x, w1, w2, topo, act)
    training = bs.fused_expert_ffn(x, w1, w2, topo, act)
    assert training.requires_grad and not inference.requires_grad
    torch.testing.assert_close(inference, training.detach())


def test_fused_ffn_under_no_grad_writes_only_the_activation(monkeypatch):
    topo, g = _setup()
    x = torch.randn(topo.num_rows, 12, generator=g)
    w1 = torch.randn(topo.num_experts, 12, topo.ffn_size, generator=g, requires_grad=True)
    w2 = torch.randn(topo.num_experts, topo.ffn_size, 10, generator=g, requires_grad=True)
    seen = []
    real_sdd = bs._sdd
    monkeypatch.setattr(bs, "_sdd", lambda *a, **kw: seen.append(kw) or real_sdd(*a, **kw))
    with torch.no_grad():
        bs.fused_expert_ffn(x, w1, w2, topo, "gelu")
    assert [kw.get("act_only") for kw in seen] == [True]
    seen.clear()
    bs.fused_expert_ffn(x, w1, w2, topo, "gelu")
    assert [kw.get("act_only", False) for kw in seen] == [False]


@pytest.mark.parametrize("bad", [dict(blockn=64), dict(act_fusion="both"),
                                 dict(dsd=dict(block_m=64)), dict(dstd=128),
                                 dict(group_m=0), dict(sdd_long=dict(group_m=2.5)),
                                 dict(backward_streams=3), dict(gather_rows="yes")])
def test_bad_kernel_config_is_rejected_and_changes_nothing(bad):
    from rocmoe.errors import ConfigurationError
    before = dict(bs.KERNEL_CONFIG)
    with pytest.raises(ConfigurationError):
        bs.set_kernel_config(**bad)
    assert bs.KERNEL_CONFIG == before


def test_per_kernel_overrides_apply_to_their_kernel_only():
    before = dict(bs.KERNEL_CONFIG)
    try:
        bs.set_kernel_config(dstd=dict(block_n=32, tma=False))
        assert bs.op_config("dstd")["block_n"] == 32 and not bs.op_config("dstd")["tma"]
        assert bs.op_config("sdd")["block_n"] == before["block_n"]
    finally:
        bs.set_kernel_config(**before)


def test_long_experts_take_the_long_overrides():
    # experts averaging LONG_EXPERT_ROWS rows or more: each kernel's "_long" entry applies
    # (grouped tile order, DSᵀD a program per tile); shorter ones keep the plain entry
    from rocmoe.moe import build_topology, plan_routing
    ids = torch.arange(4, dtype=torch.int32).repeat_interleave(bs.LONG_EXPERT_ROWS).view(-1, 1)
    long_topo = build_topology(plan_routing(ids, 4, 128), 256)
    short_topo = build_topology(plan_routing(ids[::2], 4, 128), 256)
    assert bs.long_experts(long_topo) and not bs.long_experts(short_topo)
    for op in ("sdd", "dsd", "dsd_wt", "dstd"):
        assert bs.op_config(op, long_topo) == {**{k: bs.KERNEL_CONFIG[k] for k in bs.TILE_KEYS},
                                               **bs.KERNEL_CONFIG[op + "_long"]}
        assert bs.op_config(op, short_topo) == bs.op_config(op)
    assert bs.op_config("sdd", long_topo)["group_m"] > 1
    assert bs.op_config("sdd", short_topo)["group_m"] == 1
    # SDD with a deep K over long experts: "sdd_deep"; over short experts K changes nothing
    assert bs.op_config("sdd", long_topo, bs.DEEP_K) == bs.op_config("sdd_deep")
    assert bs.op_config("sdd", long_topo, bs.DEEP_K - 1) == bs.op_config("sdd_long")
    assert bs.op_config("sdd", short_topo, bs.DEEP_K) == bs.op_config("sdd")


def test_auto_backend_keeps_float64_gpu_tensors_off_the_triton_kernels():
    # (the kernels accumulate in fp32; float64 takes the exact torch path on a GPU too)
    import types
    bs.set_backend("auto")
    gpu64 = types.SimpleNamespace(is_cuda=True, dtype=torch.float64)
    gpu32 = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert not use_triton(gpu64)
    assert use_triton(gpu32) == triton_available()


@pytest.mark.parametrize("act", ["gelu", "silu", "relu"])
def test_float64_activation_gradient_is_computed_in_float64(act):
    # act'(h) of the torch path (the fused FFN's backward) equals autograd's in float64
    import torch.nn.functional as F
    fn = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "relu": F.relu}[act]
    h = torch.randn(1000, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad(fn(h).sum(), h)
    got = activation_grad(h.detach(), act)
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-14
