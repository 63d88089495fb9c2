"""DroplessMoE on one rank: equals the per-token loop, for every routing and block size."""

import types

import pytest
import torch

from rocmoe.errors import (ConfigurationError, DeviceMismatchError, DTypeError, InvalidArgumentError,
                           RocmoeError)
from rocmoe.moe import DroplessMoE
from rocmoe.moe import blocksparse as bs
from rocmoe.moe.parallel import combine_kind


@pytest.fixture(autouse=True)
def torch_backend():
    bs.set_backend("torch")
    yield
    bs.set_backend("auto")


def _layer(hidden=24, ffn=40, experts=6, top_k=2, seed=0, **kw):
    torch.manual_seed(seed)
    return DroplessMoE(hidden, ffn, experts, top_k, **kw)


def _grads(layer, x, y, g):
    params = [x, layer.router.weight, layer.w1, layer.w2] + ([layer.w3] if layer.glu else [])
    return torch.autograd.grad(y, params, g)


def test_forward_equals_per_token_loop_fp32(reference):
    layer = _layer(block_size=16)
    x = torch.randn(41, 24)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)


def test_gradients_equal_per_token_loop_fp32(reference):
    layer = _layer(block_size=16)
    x = torch.randn(41, 24, requires_grad=True)
    g = torch.randn(41, 24)
    got = _grads(layer, x, layer(x), g)
    expect = _grads(layer, x, reference(layer, x), g)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_load_mode_activation_fusion_equals_per_token_loop(reference):
    # act_fusion="load" (the default is "store"): DSD/DSᵀD apply act to h as they load it.
    layer = _layer(block_size=16)
    x = torch.randn(29, 24, requires_grad=True)
    g = torch.randn(29, 24)
    before = bs.KERNEL_CONFIG["act_fusion"]
    bs.set_kernel_config(act_fusion="load")
    try:
        y = layer(x)
        got = _grads(layer, x, y, g)
    finally:
        bs.set_kernel_config(act_fusion=before)
    ref = reference(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, _grads(layer, x, ref, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_glu_layer_equals_per_token_loop(reference):
    layer = _layer(glu=True, activation="silu", block_size=16)
    x = torch.randn(19, 24, requires_grad=True)
    g = torch.randn(19, 24)
    y = layer(x)
    ref = reference(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(layer, x, y, g), _grads(layer, x, ref, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_results_do_not_depend_on_the_block_size():
    x = torch.randn(37, 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(37, 24, dtype=torch.float64)
    outs = []
    for block in (16, 32, 64, 128):
        layer = _layer(block_size=block).double()
        y = layer(x)
        outs.append((y,) + _grads(layer, x, y, g))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_batch_seq_hidden_input_keeps_its_shape(reference):
    layer = _layer(block_size=16)
    x = torch.randn(2, 5, 24)
    y = layer(x)
    assert y.shape == (2, 5, 24)
    torch.testing.assert_close(y.reshape(10, 24), reference(layer, x.reshape(10, 24)),
                               rtol=1e-5, atol=1e-5)


def test_all_tokens_routed_to_one_expert(reference):
    layer = _layer(top_k=1, block_size=16).double()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 1.0
    x = torch.rand(50, 24, dtype=torch.float64) + 0.1  # positive: expert 3 always wins
    y = layer(x)
    assert layer.tokens_per_expert.tolist() == [0, 0, 0, 50, 0, 0]
    torch.testing.assert_close(y, reference(layer, x))


def test_experts_without_tokens_get_zero_weight_gradients():
    layer = _layer(top_k=1, block_size=16).double()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[1] = 1.0
    x = torch.rand(9, 24, dtype=torch.float64) + 0.1
    layer(x).sum().backward()
    idle = [e for e in range(6) if e != 1]
    assert torch.count_nonzero(layer.w1.grad[idle]) == 0
    assert torch.count_nonzero(layer.w2.grad[idle]) == 0
    assert torch.count_nonzero(layer.w1.grad[1]) > 0


def test_a_single_token(reference):
    layer = _layer(top_k=3, block_size=128).double()
    x = torch.randn(1, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference(layer, x))


def test_zero_tokens_give_an_empty_output_and_gradient():
    layer = _layer(block_size=16)
    x = torch.randn(0, 24, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 24) and x.grad.shape == (0, 24)
    assert layer.tokens_per_expert.tolist() == [0] * 6


def test_aux_loss_and_tokens_per_expert_after_forward():
    layer = _layer()
    layer(torch.randn(30, 24))
    assert layer.aux_loss.dim() == 0 and layer.aux_loss.requires_grad
    assert int(layer.tokens_per_expert.sum()) == 60
    assert layer.tokens_per_expert.device == layer.w1.device


def test_parameters_have_the_documented_shapes():
    layer = _layer(glu=True)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"router.weight": (6, 24), "w1": (6, 24, 40), "w2": (6, 40, 24),
                      "w3": (6, 24, 40)}


def test_top_k_above_num_experts_raises_configuration_error():
    with pytest.raises(ConfigurationError, match="top_k=7 is larger than num_experts=6"):
        _layer(top_k=7)


def test_wrong_input_width_raises_invalid_argument():
    with pytest.raises(InvalidArgumentError, match=r"got \(4, 23\)"):
        _layer()(torch.randn(4, 23))


def test_input_of_another_float_dtype_than_the_layer_raises_dtype_error():
    # named before routing (at several ranks: before the exchange), not by the expert GEMMs
    with pytest.raises(DTypeError, match="input is torch.float64, the layer's parameters "
                                         "torch.float32"):
        _layer()(torch.randn(5, 24, dtype=torch.float64))


def test_input_on_another_device_than_the_layer_raises_device_mismatch():
    with pytest.raises(DeviceMismatchError, match="input is on meta"):
        _layer()(torch.randn(5, 24, device="meta"))


def test_input_that_is_not_a_tensor_raises_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="input must be a torch.Tensor, got list"):
        _layer()(torch.randn(5, 24).tolist())


def test_non_floating_input_raises_dtype_error():
    with pytest.raises(DTypeError):
        _layer()(torch.ones(4, 24, dtype=torch.int32))


@pytest.mark.parametrize("kw", [dict(block_size=24), dict(activation="tanhh"),
                                dict(ffn=0)])
def test_bad_configuration_is_a_rocmoe_error(kw):
    with pytest.raises(RocmoeError):
        _layer(**kw)


def test_unknown_combine_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="combine must be one of"):
        _layer(combine="alltoall")


def test_fused_combine_on_a_communicator_only_context_is_a_configuration_error():
    # gemm_all_to_all puts rows into the peers' symmetric heaps: it needs a rocmoe Context
    comm_ctx = types.SimpleNamespace(comm=None, rank=0, world_size=2)
    with pytest.raises(ConfigurationError, match="needs a rocmoe Context"):
        _layer(ctx=comm_ctx, combine="gemm_all_to_all")


def _combine_of(combine, dtype, runtime):
    # combine_kind reads the layer's setting, weight dtype and context kind only
    names = ("empty", "put", "quiet", "barrier", "free") if runtime else ("comm",)
    ctx = types.SimpleNamespace(**{n: None for n in names})
    return combine_kind(types.SimpleNamespace(combine=combine, ctx=ctx,
                                              w2=torch.empty(1, dtype=dtype)))


def test_auto_combine_fuses_on_a_context_with_16_or_32_bit_weights():
    assert _combine_of("auto", torch.bfloat16, runtime=True) == "gemm_all_to_all"
    assert _combine_of("auto", torch.float32, runtime=True) == "gemm_all_to_all"
    assert _combine_of("auto", torch.float64, runtime=True) == "all_to_all"
    assert _combine_of("auto", torch.float32, runtime=False) == "all_to_all"
    assert _combine_of("all_to_all", torch.float32, runtime=True) == "all_to_all"


def test_fused_combine_with_float64_weights_is_a_configuration_error():
    # raised before any exchange, on every rank alike (every rank has the same weights)
    with pytest.raises(ConfigurationError, match="float32, bfloat16 or float16 weights"):
        _combine_of("gemm_all_to_all", torch.float64, runtime=True)



@pytest.mark.parametrize("fusion,gather", [("recompute", True), ("recompute", False),
                                           ("store", True), ("load", True),
                                           ("checkpoint", True), ("recompute", "backward"),
                                           ("checkpoint", "backward")])
def test_memory_variants_equal_per_token_loop(reference, fusion, gather):
    # act_fusion "recompute" (only h kept for the backward) and gather_rows (no permuted
    # copy of the tokens): the layer and its gradients are the dropless contract still
    layer = _layer(block_size=16)
    x = torch.randn(29, 24, requires_grad=True)
    g = torch.randn(29, 24)
    before = {k: bs.KERNEL_CONFIG[k] for k in ("act_fusion", "gather_rows")}
    bs.set_kernel_config(act_fusion=fusion, gather_rows=gather)
    try:
        y = layer(x)
        got = _grads(layer, x, y, g)
    finally:
        bs.set_kernel_config(**before)
    ref = reference(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, _grads(layer, x, ref, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_recompute_fusion_refuses_a_second_backward_through_one_graph():
    # the first backward turns the kept h into act(h): a second one would be wrong silently
    layer = _layer(block_size=16)
    x = torch.randn(9, 24, requires_grad=True)
    before = bs.KERNEL_CONFIG["act_fusion"]
    bs.set_kernel_config(act_fusion="recompute")
    try:
        y = layer(x).sum()
        torch.autograd.grad(y, [x], retain_graph=True)
        with pytest.raises(ConfigurationError, match="retain_graph"):
            torch.autograd.grad(y, [x])
    finally:
        bs.set_kernel_config(act_fusion=before)
