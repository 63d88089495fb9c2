import pytest
import torch

from rocmoe.errors import ConfigurationError, DTypeError, InvalidArgumentError, RocmoeError
from rocmoe.moe import Router, load_balancing_loss, z_loss


def _router(**kw):
    torch.manual_seed(0)
    return Router(16, 6, 2, **kw)


def test_route_returns_int32_ids_of_the_k_largest_probabilities():
    r = _router(renormalize=False)
    x = torch.randn(50, 16)
    ids, w = r.route(x)
    assert ids.dtype == torch.int32 and ids.shape == (50, 2)
    probs = torch.softmax(x @ r.weight.t(), dim=-1)
    expect_w, expect_ids = probs.topk(2, dim=-1)
    assert torch.equal(ids.long(), expect_ids)
    torch.testing.assert_close(w, expect_w)


def test_renormalized_weights_sum_to_one_per_token():
    ids, w = _router(renormalize=True).route(torch.randn(40, 16))
    torch.testing.assert_close(w.sum(-1), torch.ones(40))


def test_weights_keep_the_input_dtype():
    r = _router().to(torch.bfloat16)
    _, w = r.route(torch.randn(8, 16, dtype=torch.bfloat16))
    assert w.dtype == torch.bfloat16


def test_tokens_per_expert_counts_every_slot():
    r = _router()
    ids, _ = r.route(torch.randn(33, 16))
    assert r.tokens_per_expert.dtype == torch.int32
    expect = torch.bincount(ids.reshape(-1).long(), minlength=6)
    assert torch.equal(r.tokens_per_expert.long(), expect)


def test_load_balancing_loss_is_one_for_perfectly_uniform_routing():
    probs = torch.full((12, 4), 0.25)
    counts = torch.tensor([6, 6, 6, 6], dtype=torch.int32)  # 12 tokens * k=2
    torch.testing.assert_close(load_balancing_loss(probs, counts, 2), torch.tensor(1.0))


def test_load_balancing_loss_grows_when_routing_collapses_on_one_expert():
    probs = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).repeat(8, 1)
    counts = torch.tensor([8, 0, 0, 0], dtype=torch.int32)
    assert load_balancing_loss(probs, counts, 1) > 3.5


def test_z_loss_is_mean_squared_logsumexp():
    logits = torch.randn(10, 5)
    torch.testing.assert_close(z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())


def test_aux_loss_has_gradient_to_the_router_weight():
    r = _router()
    r.route(torch.randn(20, 16))
    r.aux_loss.backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_jitter_changes_routing_inputs_only_in_training():
    r = _router(jitter_eps=0.5)
    x = torch.randn(64, 16)
    r.eval()
    torch.testing.assert_close(r.logits(x), x @ r.weight.t())
    r.train()
    torch.manual_seed(1)
    assert not torch.allclose(r.logits(x), x @ r.weight.t())


def test_top_k_larger_than_experts_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="top_k=5 is larger than num_experts=4"):
        Router(8, 4, 5)


def test_wrong_input_width_is_an_invalid_argument():
    with pytest.raises(InvalidArgumentError, match=r"\[tokens, 16\]"):
        _router().route(torch.randn(4, 15))


def test_integer_input_is_a_dtype_error():
    with pytest.raises(DTypeError, match="floating-point"):
        _router().route(torch.ones(4, 16, dtype=torch.int64))
    assert issubclass(DTypeError, RocmoeError)
