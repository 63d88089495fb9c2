"""DLRM (facebookresearch/dlrm's architecture) with table-wise model-parallel embeddings.

bottom MLP (dense features) -> interaction with the embedding bags -> top MLP -> sigmoid.
Rank r holds a contiguous range of the embedding tables, stacked into one parameter
(``packed_tables``, FBGEMM's table-batched layout), and looks them up for the whole global
batch; the fused lookup + all-to-all returns this rank's samples with every table. Given
``max_batch`` and ``max_lookups`` the model makes one ``EmbeddingAllToAll`` handle and calls
its ``batched`` entry (one launch a step however many tables, no host round trip); without
them it calls the functional ``rocmoe.ops.embedding_all_to_all`` on the tables' views. The
MLPs are replicated (data-parallel).

Sizes follow dlrm's flags: ``bottom_mlp`` includes its input width ("13-512-256-64-16"),
``top_mlp`` does not: its input is the interaction's width, computed here as dlrm does
(``dot``: the dense vector plus the strictly lower triangle of the pairwise dot products of
[dense, table 0, table 1, ...], the diagonal too with ``interaction_itself``; ``cat``: the
concatenation of all). ReLU after every layer, sigmoid after the top MLP's last.

Initialisation as dlrm's (weights N(0, sqrt(2 / (in + out))), biases N(0, sqrt(1 / out)),
tables U(-sqrt(1 / rows), sqrt(1 / rows))), each drawn from a generator keyed by the seed and
the layer or global table number: the model is the same on any number of ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import (ConfigurationError, DeviceMismatchError, DTypeError, InvalidArgumentError,
                      RocmoeError)


def table_range(rank: int, world: int, num_tables: int) -> range:
    """Rank `rank`'s tables: contiguous ranges, the first ``num_tables % world`` ranks one
    more."""
    base, extra = divmod(num_tables, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def interaction_width(op: str, num_tables: int, dim: int, itself: bool = False) -> int:
    features = num_tables + 1
    if op == "dot":
        pairs = features * (features + 1) // 2 if itself else features * (features - 1) // 2
        return pairs + dim
    if op == "cat":
        return features * dim
    raise ConfigurationError(f"--arch-interaction-op must be dot or cat, got {op!r}")


def check_architecture(sparse_feature_size: int, bottom_mlp, top_mlp, num_tables: int) -> None:
    """dlrm's consistency checks, as RocmoeErrors."""
    if len(bottom_mlp) < 2 or len(top_mlp) < 1 or min(list(bottom_mlp) + list(top_mlp)) < 1:
        raise ConfigurationError(
            f"--arch-mlp-bot needs at least input-output widths and --arch-mlp-top at least one "
            f"width, all positive; got {bottom_mlp} and {top_mlp}")
    if sparse_feature_size != bottom_mlp[-1]:
        raise ConfigurationError(
            f"--arch-sparse-feature-size {sparse_feature_size} does not match the last width of "
            f"--arch-mlp-bot ({bottom_mlp[-1]}): the dense vector and the embeddings interact")
    if num_tables < 1:
        raise ConfigurationError("DLRM needs at least one embedding table")


def _mlp(widths, seed: int, salt: int, sigmoid_last: bool) -> nn.Sequential:
    layers = []
    for i, (n, m) in enumerate(zip(widths[:-1], widths[1:])):
        linear = nn.Linear(n, m)
        g = torch.Generator().manual_seed(int(seed) * 7919 + salt * 1000 + i)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(m, n, generator=g) * math.sqrt(2.0 / (m + n)))
            linear.bias.copy_(torch.randn(m, generator=g) * math.sqrt(1.0 / m))
        last = i == len(widths) - 2
        layers += [linear, nn.Sigmoid() if (last and sigmoid_last) else nn.ReLU()]
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, sparse_feature_size: int, embedding_sizes, bottom_mlp, top_mlp,
                 interaction: str = "dot", interaction_itself: bool = False, ctx=None,
                 rank: int = 0, world_size: int = 1, seed: int = 0,
                 max_batch: int | None = None, max_lookups: int | None = None):
        """`max_batch`: the largest global batch a step looks up; `max_lookups`: the most
        indices one table gets in one step (max_batch times the lookups per sample). With
        both and a `ctx` the tables are looked up through a persistent handle made here
        (collective)."""
        super().__init__()
        num_tables = len(embedding_sizes)
        check_architecture(sparse_feature_size, bottom_mlp, top_mlp, num_tables)
        self.interaction, self.itself = interaction, interaction_itself
        self.ctx = ctx
        self.embedding_sizes = [int(n) for n in embedding_sizes]
        self.my_tables = table_range(rank, world_size, num_tables)
        width = interaction_width(interaction, num_tables, sparse_feature_size, interaction_itself)
        self.bottom = _mlp(list(bottom_mlp), seed, 1, sigmoid_last=False)
        self.top = _mlp([width] + list(top_mlp), seed, 2, sigmoid_last=True)
        tables = []
        for t in self.my_tables:
            rows = self.embedding_sizes[t]
            g = torch.Generator().manual_seed(int(seed) * 104_729 + t + 1)
            bound = math.sqrt(1.0 / rows)
            tables.append((torch.rand(rows, sparse_feature_size, generator=g) * 2 - 1) * bound)
        self.table_rows = [self.embedding_sizes[t] for t in self.my_tables]
        self.world_size = int(world_size)
        # this rank's tables stacked: one parameter, one gradient, one lookup launch a step
        self.packed_tables = nn.Parameter(
            torch.cat(tables) if tables else torch.zeros(0, sparse_feature_size))
        self.lookup = None
        if ctx is not None and max_batch is not None:
            from .. import ops  # (collective: every rank makes the model together)
            self.lookup = ops.EmbeddingAllToAll(
                ctx, self.table_rows, sparse_feature_size, int(max_batch),
                int(max_lookups if max_lookups is not None else max_batch), "sum",
                torch.float32)
        pairs = num_tables + 1
        offset = 1 if interaction_itself else 0
        # dlrm's order: for i, for j < i (+ the diagonal with `itself`)
        li = [i for i in range(pairs) for _ in range(i + offset)]
        lj = [j for i in range(pairs) for j in range(i + offset)]
        self.register_buffer("pair_i", torch.tensor(li, dtype=torch.int64), persistent=False)
        self.register_buffer("pair_j", torch.tensor(lj, dtype=torch.int64), persistent=False)

    @property
    def tables(self) -> list[torch.Tensor]:
        """This rank's tables, as views of ``packed_tables``."""
        return list(self.packed_tables.split(self.table_rows)) if self.table_rows else []

    def table_parameters(self) -> list[nn.Parameter]:
        """The rank-local parameters (this rank's tables); the MLPs are replicated."""
        return [self.packed_tables]

    def interact(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """x [b, D], embedded [b, T, D] -> the top MLP's input."""
        if self.interaction == "cat":
            return torch.cat([x, embedded.reshape(x.shape[0], -1)], 1)
        feats = torch.cat([x.unsqueeze(1), embedded], 1)           # [b, 1 + T, D]
        dots = torch.bmm(feats, feats.transpose(1, 2))
        return torch.cat([x, dots[:, self.pair_i, self.pair_j]], 1)

    def _dense_problem(self, dense: torch.Tensor):
        """What is wrong with a step's dense features for the bottom MLP, or None."""
        first = self.bottom[0]
        width, dtype, device = first.in_features, first.weight.dtype, first.weight.device
        if not isinstance(dense, torch.Tensor):
            return InvalidArgumentError(f"DLRM: dense features must be a tensor, got "
                                        f"{type(dense).__name__}")
        if dense.dim() != 2 or dense.shape[1] != width:
            return InvalidArgumentError(f"DLRM: dense features are {tuple(dense.shape)}; the "
                                        f"bottom MLP takes [samples, {width}]")
        if dense.dtype != dtype:
            return DTypeError(f"DLRM: dense features are {dense.dtype}, the bottom MLP {dtype}")
        if dense.device != device:
            return DeviceMismatchError(f"DLRM: dense features are on {dense.device}, the model "
                                       f"on {device}")
        return None

    def forward(self, dense_local: torch.Tensor, indices, offsets) -> torch.Tensor:
        """dense_local: this rank's samples [b, F]; indices / offsets: this rank's tables'
        lookups over the whole global batch, a tensor a table or stacked ([tables, L] and
        [tables, B], row t table t's: one copy to the device and a few launches a step,
        where lists take one of each a table). Returns click probabilities [b]."""
        from .. import ops
        problem = self._dense_problem(dense_local)
        packed = None
        if problem is None and self.lookup is not None:
            # packed before the lookup too: lookups pack_lookups cannot take (stacked rows
            # that disagree, an entry that is not a tensor) raised on this rank alone, and its
            # peers waited in the batched call
            try:
                packed = ops.pack_lookups(indices, offsets)
            except RocmoeError as exc:
                problem = exc
            except Exception as exc:  # noqa: BLE001 - torch's or Python's own words say what
                problem = InvalidArgumentError(
                    f"DLRM: this rank's lookups cannot be packed for its tables: {exc!r}")
        if problem is not None:
            # before the lookup, whose peers would otherwise wait for this rank: they raise
            # too, naming it
            if self.lookup is not None:
                self.lookup._reject(problem)
            if self.ctx is not None and self.ctx.world_size > 1:
                from ..ops._kernels import embedding_reject
                embedding_reject(self.ctx, problem)
            raise problem
        x = self.bottom(dense_local)
        if self.lookup is None:
            embedded = ops.embedding_all_to_all(self.tables, indices, offsets, ctx=self.ctx)
        else:
            # (a rank without tables passes None for all three: it still takes its samples
            # of everyone's tables)
            packed_indices, packed_offsets = packed
            embedded = self.lookup.batched(self.packed_tables if self.table_rows else None,
                                           packed_indices, packed_offsets,
                                           batch=dense_local.shape[0] * self.world_size)
        return self.top(self.interact(x, embedded)).squeeze(1)
