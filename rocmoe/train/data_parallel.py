"""Data-parallel gradients for models whose parameters are partly replicated, partly per rank.

Each rank's loss is the mean over its own samples; the run minimises the mean of those over
ranks. So a replicated parameter (attention, norms, router, MLPs) gets the average of the
ranks' gradients, and a rank-local one (an expert's weights, a DLRM table) gets its gradient
divided by the world size: its backward already summed every rank's contribution (the
tokens or lookups of all ranks went through it). The result is the gradient of the
global-batch loss, whatever the number of ranks.

The replicated gradients travel as one flat buffer in one all-reduce per step. Open MPI's
reduction for a fixed world size and message size takes the same order every time, so a
run is reproducible bit for bit (checkpoint resume relies on that).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import ConfigurationError
from .group import ProcessGroup


def split_parameters(model: torch.nn.Module, local: list) -> tuple[list, list]:
    """(replicated, local) parameter lists of `model`, in registration order."""
    local_ids = {id(p) for p in local}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) not in local_ids], [p for p in params if id(p) in local_ids]


def tensor_digest(tensors) -> str:
    """sha256 of the tensors' bytes (in order): equal digests mean bitwise-equal values."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def digest_words(hexdigest: str) -> np.ndarray:
    """A sha256 hex digest as four int64 words (for an all-gather)."""
    return np.frombuffer(bytes.fromhex(hexdigest), dtype=np.int64).copy()


def group_digest(group: ProcessGroup, hexdigest: str, what: str) -> str:
    """One digest of every rank's digest, in rank order (the same on every rank)."""
    table = group.allgather(digest_words(hexdigest), what)
    return hashlib.sha256(table.tobytes()).hexdigest()


class GradientSync:
    """After backward: average the replicated gradients, scale the local ones by 1/world."""

    def __init__(self, replicated: list, local: list, group: ProcessGroup):
        self.replicated = list(replicated)
        self.local = list(local)
        self.group = group
        wide = any(p.dtype == torch.float64 for p in self.replicated)
        self.dtype = np.float64 if wide else np.float32
        self.numel = sum(p.numel() for p in self.replicated)

    def check_replicas_equal(self) -> None:
        """Raise on every rank unless the replicated parameters are bitwise equal everywhere
        (a model built from different seeds would train into different models)."""
        if self.group.world_size == 1:
            return
        mine = digest_words(tensor_digest(self.replicated))
        table = self.group.allgather(mine, "replicated-parameter check")
        differ = [r for r in range(self.group.world_size) if not np.array_equal(table[r], table[0])]
        if differ:
            raise ConfigurationError(
                f"the replicated (data-parallel) parameters of ranks {differ} differ from rank "
                "0's: build the model from the same seed on every rank")

    def __call__(self) -> None:
        world = self.group.world_size
        if world == 1:
            return
        flat = np.zeros(self.numel, dtype=self.dtype)
        start = 0
        for p in self.replicated:
            n = p.numel()
            if p.grad is not None:  # a parameter without gradient contributes zeros
                flat[start:start + n] = p.grad.detach().reshape(-1).to(
                    "cpu", torch.float64 if self.dtype == np.float64 else torch.float32).numpy()
            start += n
        self.group.allreduce_(flat, "data-parallel gradient all-reduce")
        flat /= world
        start = 0
        for p in self.replicated:
            n = p.numel()
            grad = torch.from_numpy(flat[start:start + n]).view(p.shape).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
            start += n
        for p in self.local:
            if p.grad is not None:
                p.grad.div_(world)
