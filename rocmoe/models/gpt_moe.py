"""GPT-MoE: a decoder-only transformer whose FFN is a dropless MoE every N layers.

Pre-norm blocks (LayerNorm, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, LayerNorm, FFN), learned positions,
a final LayerNorm and a language-model head tied to the token embedding.

Layer i (from 0) has a :class:`rocmoe.moe.DroplessMoE` FFN when ``(i + 1) % moe_every == 0``
(``moe_every=2``: every second layer; ``1``: all; ``0``: none) and a dense GELU MLP otherwise.
With a multi-rank rocmoe ``ctx`` the MoE layers are expert-parallel (each rank holds
``experts / world`` experts); everything else is replicated, for data parallelism
(:mod:`rocmoe.train.data_parallel`). ``moe_options`` go to every ``DroplessMoE`` unchanged
(``block_size``, ``activation``, ``glu``, ``combine``, a placement, ...), so options of the
layer this module does not know about reach it too.

Initialisation is a function of ``seed`` alone: the replicated parameters are the same on
every rank, and each expert's weights are drawn from a generator keyed by its layer and its
global expert id, so a model built on 1, 2 or 4 ranks is the same model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError, InvalidArgumentError
from ..moe import DroplessMoE

IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's default)

INIT_STD = 0.02


@dataclass
class GPTMoEConfig:
    vocab_size: int = 256
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn_hidden: int = 256
    experts: int = 8
    top_k: int = 2
    moe_every: int = 2
    dropout: float = 0.0
    moe_options: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "layers", "hidden", "heads", "ffn_hidden",
                     "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"GPTMoEConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigurationError(
                f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if not isinstance(self.moe_every, int) or self.moe_every < 0:
            raise ConfigurationError(f"moe_every must be an int >= 0, got {self.moe_every!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigurationError(f"dropout must be in [0, 1), got {self.dropout}")

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class DenseFFN(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTMoEConfig, moe: bool, ctx):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg.hidden, cfg.heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        if moe:
            self.ffn = DroplessMoE(cfg.hidden, cfg.ffn_hidden, cfg.experts, cfg.top_k, ctx=ctx,
                                   **cfg.moe_options)
        else:
            self.ffn = DenseFFN(cfg.hidden, cfg.ffn_hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ffn(self.ln2(x)))


class GPTMoE(nn.Module):
    """``model(tokens)`` -> logits [B, T, vocab]; ``model(tokens, targets)`` -> (logits, loss)
    with the mean cross-entropy (``aux_loss`` holds the MoE layers' auxiliary loss after it)."""

    def __init__(self, config: GPTMoEConfig, ctx=None, seed: int = 0):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_layer(i), ctx)
                                    for i in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.aux_loss: torch.Tensor | None = None
        self.init_parameters(seed)

    # -- structure ---------------------------------------------------------------------
    def moe_layers(self) -> list[DroplessMoE]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, DroplessMoE)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """The rank-local parameters (expert weights); every other parameter is replicated."""
        return [w for layer in self.moe_layers() for w in (layer.w1, layer.w2, layer.w3)
                if w is not None]

    # -- initialisation ----------------------------------------------------------------
    @torch.no_grad()
    def init_parameters(self, seed: int) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 layers)."""
        gen = torch.Generator().manual_seed(int(seed))
        residual_std = INIT_STD / math.sqrt(2 * self.config.layers)
        experts = {id(w) for w in self.expert_parameters()}
        for name, p in self.named_parameters():
            if id(p) in experts:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("attn.proj.weight", "fc2.weight")) else INIT_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for index, layer in enumerate(self.moe_layers()):
            if layer.w1.shape[0] != layer.num_local_experts:
                continue  # a placement with its own slot layout keeps the layer's initialisation
            for i in range(layer.num_local_experts):
                expert = layer.rank * layer.num_local_experts + i
                g = torch.Generator().manual_seed(int(seed) * 1_000_003 + index * 65_537 + expert + 1)
                layer.w1[i].copy_(torch.randn(layer.w1[i].shape, generator=g) * INIT_STD)
                layer.w2[i].copy_(torch.randn(layer.w2[i].shape, generator=g) * residual_std)
                if layer.w3 is not None:
                    layer.w3[i].copy_(torch.randn(layer.w3[i].shape, generator=g) * INIT_STD)

    # -- forward -------------------------------------------------------------------------
    def _input_problem(self, tokens, targets):
        """What is wrong with a step's tokens or targets, or None. Token and target values
        are checked where they are host tensors (free); on a GPU an index out of range
        is the device's own assertion."""
        vocab, integers = self.config.vocab_size, (torch.int64, torch.int32)
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2
                and tokens.dtype in integers):
            return InvalidArgumentError(
                "GPTMoE: tokens must be an int64 or int32 tensor [batch, seq_len], got "
                + (f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor)
                   else type(tokens).__name__))
        if tokens.shape[1] > self.config.seq_len:
            return ConfigurationError(
                f"sequence of {tokens.shape[1]} tokens is longer than the model's "
                f"seq_len={self.config.seq_len}")
        if tokens.device.type == "cpu" and tokens.numel() and \
                not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
            return InvalidArgumentError(f"GPTMoE: token ids must be in [0, {vocab}), got "
                                        f"[{int(tokens.min())}, {int(tokens.max())}]")
        if targets is None:
            return None
        if not (isinstance(targets, torch.Tensor) and targets.shape == tokens.shape
                and targets.dtype == torch.int64):
            return InvalidArgumentError(
                f"GPTMoE: targets must be an int64 tensor of the tokens' shape "
                f"{tuple(tokens.shape)}, got "
                + (f"{targets.dtype} {tuple(targets.shape)}"
                   if isinstance(targets, torch.Tensor) else type(targets).__name__))
        if targets.device.type == "cpu" and targets.numel():
            kept = targets[targets != IGNORE_INDEX]
            if kept.numel() and not 0 <= int(kept.min()) <= int(kept.max()) < vocab:
                return InvalidArgumentError(
                    f"GPTMoE: targets must be in [0, {vocab}) or {IGNORE_INDEX} (ignored), got "
                    f"[{int(kept.min())}, {int(kept.max())}]")
        return None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        problem = self._input_problem(tokens, targets)
        if problem is not None:
            # checked before any layer: with expert parallelism the peers wait in the first
            # MoE layer's exchange (and, for bad targets, in the backward's): they raise
            # there too, naming this rank
            moe = self.moe_layers()
            if moe:
                moe[0].reject(problem)
            raise problem
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)  # tied head
        moe = self.moe_layers()
        self.aux_loss = sum(layer.aux_loss for layer in moe) if moe else None
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return logits, loss
