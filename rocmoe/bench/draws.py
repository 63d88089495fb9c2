"""Random expert draws the MoE benchmarks share (below rocmoe.bench.moe, moe_layer and
multi_gpu): draw probabilities, and tokens that make a router pick a draw."""

from __future__ import annotations

import torch


def expert_probabilities(kind: str, experts: int, device) -> torch.Tensor:
    """Unnormalised draw probabilities of the experts: uniform, or Zipf(1.0) (p_e ~ 1/(e+1))."""
    if kind == "uniform":
        return torch.ones(experts, device=device)
    if kind == "zipf":
        return 1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32)
    raise ValueError(f"routing must be uniform or zipf, got {kind!r}")


def router_inputs(gate: torch.Tensor, tokens: int, top_k: int, kind,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [T, H] for which a router with gate rows `gate` [E, H] picks k distinct experts
    drawn per token with probabilities `kind`: "uniform", "zipf" (Zipf(1.0), p_e ~ 1/(e+1))
    or a tensor of E unnormalised probabilities. Returns them and the drawn ids [T, k].

    The routing is made by the tokens, not by changing the router, so every router path
    picks it alike: the fused Triton router on a GPU and ``route_reference`` in torch."""
    experts, hidden = gate.shape
    device = gate.device
    probs = (expert_probabilities(kind, experts, device) if isinstance(kind, str)
             else kind.to(device=device, dtype=torch.float32))
    if probs.shape != (experts,):
        raise ValueError(f"router_inputs: {tuple(probs.shape)} probabilities for {experts} experts")
    ids = torch.multinomial(probs.expand(tokens, experts).contiguous(), top_k,
                            replacement=False, generator=generator)
    g = gate.detach().float()
    # logit of expert e for x = sum_j c_j g_e' / |g_e'|^2 is c_j for the drawn e' = e (plus
    # cross terms of order 1/sqrt(H)): descending c_j keep the draw's order
    coef = torch.zeros(tokens, experts, device=device)
    coef.scatter_(1, ids, 4.0 + torch.arange(top_k, 0, -1, device=device,
                                             dtype=torch.float32).expand(tokens, top_k))
    x = coef @ (g / g.square().sum(1, keepdim=True))
    x = x + 0.02 * torch.randn(tokens, hidden, device=device, generator=generator)
    return x.to(gate.dtype), ids
