"""GPT-MoE: the structure the issue asks for, causality, the tied head, and a model that is
the same model whatever the number of ranks it is split over."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rocmoe.errors import ConfigurationError
from rocmoe.models.gpt_moe import DenseFFN, GPTMoE, GPTMoEConfig
from rocmoe.moe import DroplessMoE

SMALL = dict(seq_len=16, layers=4, hidden=32, heads=4, ffn_hidden=48, experts=4, top_k=2)


def test_moe_ffn_every_nth_layer_and_dense_ffn_in_the_others():
    model = GPTMoE(GPTMoEConfig(**SMALL, moe_every=2))
    kinds = [type(b.ffn) for b in model.blocks]
    assert kinds == [DenseFFN, DroplessMoE, DenseFFN, DroplessMoE]
    assert all(type(b.ffn) is DenseFFN for b in GPTMoE(GPTMoEConfig(**SMALL, moe_every=0)).blocks)


def test_droplessmoe_keyword_options_reach_every_moe_layer():
    model = GPTMoE(GPTMoEConfig(**SMALL, moe_every=1,
                                moe_options={"block_size": 32, "activation": "silu", "glu": True}))
    for layer in model.moe_layers():
        assert (layer.block_size, layer.activation, layer.glu) == (32, "silu", True)
        assert layer.w3 is not None
    with pytest.raises(TypeError, match="no_such_option"):
        GPTMoE(GPTMoEConfig(**SMALL, moe_options={"no_such_option": 1}))


def test_language_model_head_is_the_token_embedding():
    model = GPTMoE(GPTMoEConfig(**SMALL))
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        model.tok_emb.weight[7].mul_(3.0)  # changing one embedding row changes that logit
        logits = model(tokens)
        hidden = model.ln_f(_hidden_states(model, tokens))
    torch.testing.assert_close(logits, hidden @ model.tok_emb.weight.t())
    assert not any(n.startswith("head") for n, _ in model.named_parameters())


def _hidden_states(model, tokens):
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(tokens.shape[1]))
    for block in model.blocks:
        x = block(x)
    return x


def test_attention_is_causal_a_later_token_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = GPTMoE(GPTMoEConfig(**SMALL, moe_every=0)).eval()
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_loss_is_cross_entropy_and_aux_loss_sums_the_moe_layers():
    model = GPTMoE(GPTMoEConfig(**SMALL, moe_every=1))
    tokens = torch.randint(0, 256, (2, 16))
    logits, loss = model(tokens, tokens.roll(-1, 1))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(
        logits.reshape(-1, 256), tokens.roll(-1, 1).reshape(-1)))
    torch.testing.assert_close(model.aux_loss, sum(l.aux_loss for l in model.moe_layers()))


def test_a_model_split_over_two_ranks_is_the_one_rank_model():
    """Replicated parameters are equal on every rank and rank r's experts are experts
    [r * E/world, ...) of the one-rank model: the init depends on the seed alone."""
    whole = GPTMoE(GPTMoEConfig(**SMALL), seed=3)
    # a stand-in rank of two whose peer makes the same layers (the configuration agreement
    # of DroplessMoE sees the same record from both)
    def rank_of_two(r):
        return SimpleNamespace(rank=r, world_size=2,
                               allgather_ints=lambda values: [list(values), list(values)])
    halves = [GPTMoE(GPTMoEConfig(**SMALL), ctx=rank_of_two(r), seed=3) for r in (0, 1)]
    experts = {id(p) for p in whole.expert_parameters()}
    for name, p in whole.named_parameters():
        parts = [dict(h.named_parameters())[name] for h in halves]
        if id(p) in experts:
            assert torch.equal(torch.cat(parts), p), name
        else:
            assert torch.equal(parts[0], p) and torch.equal(parts[1], p), name
    assert len(halves[1].expert_parameters()) == len(whole.expert_parameters())


def test_bad_configurations_are_refused_with_a_rocmoe_error():
    with pytest.raises(ConfigurationError, match="divisible by heads"):
        GPTMoEConfig(hidden=30, heads=4)
    with pytest.raises(ConfigurationError, match="layers"):
        GPTMoEConfig(layers=0)
    model = GPTMoE(GPTMoEConfig(**SMALL))
    with pytest.raises(ConfigurationError, match="longer than the model's seq_len"):
        model(torch.zeros(1, 17, dtype=torch.int64))
