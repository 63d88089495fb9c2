"""A real text corpus every Python carries: the bytes of its standard library's .py files.

Tokens are bytes (vocabulary 256). The split is by file and fixed: a file is validation when
the CRC-32 of its path relative to the library root falls in the first
``validation_percent`` of 100 buckets, so it does not depend on the order files are found in
and the same install always gives the same split.

Batches are windows of ``seq_len + 1`` bytes at random offsets of the training bytes. The
offsets of step s come from a generator seeded by (seed, s) for the whole global batch, and
rank r takes rows ``[r * B/world, (r + 1) * B/world)``: the global batch of a step is the same
for any world size, and the data position to checkpoint is just the step number.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigurationError, InvalidArgumentError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The standard library's directory (sysconfig's 'stdlib'; the os module's as fallback)."""
    root = sysconfig.get_paths().get("stdlib")
    if not root or not Path(root, "os.py").is_file():
        root = os.path.dirname(os.__file__)
    return Path(root)


def python_files(root) -> list[Path]:
    """The .py files under `root`, sorted, installed packages and caches left out."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_validation_file(relative: str, validation_percent: int) -> bool:
    return zlib.crc32(relative.encode()) % 100 < validation_percent


def unigram_entropy_bits(data: torch.Tensor) -> float:
    """Entropy of the byte histogram of `data`, in bits per byte: what a model that knows
    only byte frequencies (no context) achieves on it."""
    counts = torch.bincount(data.to(torch.int64), minlength=256).to(torch.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * torch.log2(p)).sum())


class ByteCorpus:
    """Training and validation bytes (uint8 tensors) of a set of files."""

    def __init__(self, root=None, validation_percent: int = 5, max_files: int | None = None):
        if not 0 < validation_percent < 100:
            raise ConfigurationError(f"validation_percent must be in 1..99, got {validation_percent}")
        self.root = Path(root) if root is not None else stdlib_root()
        files = python_files(self.root)
        if max_files is not None:
            files = files[:max_files]
        train, val = [], []
        for path in files:
            relative = path.relative_to(self.root).as_posix()
            (val if is_validation_file(relative, validation_percent) else train).append(path)
        if not train or not val:
            raise ConfigurationError(
                f"{self.root} has {len(train)} training and {len(val)} validation .py files; "
                "both need at least one (point the corpus at a larger tree)")
        self.train_files, self.validation_files = len(train), len(val)
        self.train = self._read(train)
        self.validation = self._read(val)

    @staticmethod
    def _read(paths) -> torch.Tensor:
        blob = b"".join(Path(p).read_bytes() for p in paths)
        return torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())

    def describe(self) -> dict:
        return {"root": str(self.root), "train_files": self.train_files,
                "validation_files": self.validation_files,
                "train_bytes": int(self.train.numel()),
                "validation_bytes": int(self.validation.numel())}

    @staticmethod
    def _windows(data: torch.Tensor, starts: np.ndarray, seq_len: int):
        index = torch.from_numpy(starts).unsqueeze(1) + torch.arange(seq_len + 1)
        rows = data[index].to(torch.int64)
        return rows[:, :-1], rows[:, 1:]

    @staticmethod
    def _starts(data: torch.Tensor, count: int, seq_len: int, seed_words) -> np.ndarray:
        room = data.numel() - seq_len - 1
        if room < 1:
            raise InvalidArgumentError(
                f"sequences of {seq_len} bytes do not fit into {data.numel()} bytes of text")
        rng = np.random.default_rng(np.random.SeedSequence(seed_words))
        return rng.integers(0, room, size=count, dtype=np.int64)

    @staticmethod
    def _my_rows(global_batch: int, rank: int, world: int) -> slice:
        if global_batch % world:
            raise ConfigurationError(
                f"the global batch of {global_batch} sequences must be divisible by {world} ranks")
        per = global_batch // world
        return slice(rank * per, (rank + 1) * per)

    def train_batch(self, step: int, global_batch: int, seq_len: int, rank: int = 0,
                    world: int = 1, seed: int = 0):
        """(inputs, targets), int64 [global_batch / world, seq_len]: this rank's rows of step
        `step`'s global batch."""
        starts = self._starts(self.train, global_batch, seq_len, [seed, 1, step])
        return self._windows(self.train, starts[self._my_rows(global_batch, rank, world)], seq_len)

    def validation_batches(self, batches: int, global_batch: int, seq_len: int, rank: int = 0,
                           world: int = 1, seed: int = 0):
        """A fixed list of `batches` validation batches (this rank's rows of each)."""
        starts = self._starts(self.validation, batches * global_batch, seq_len, [seed, 2])
        mine = self._my_rows(global_batch, rank, world)
        return [self._windows(self.validation,
                              starts[b * global_batch:(b + 1) * global_batch][mine], seq_len)
                for b in range(batches)]
