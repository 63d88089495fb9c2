"""A streaming reader of the Criteo Kaggle / Terabyte click-log format (TSV).

Each line: a label (0 or 1), 13 integer features, 26 categorical features written as
hexadecimal strings, separated by tabs; any feature may be empty (missing). As in
facebookresearch/dlrm's preprocessing, a missing value reads as 0, negative integers are
clamped to 0, the dense features become ``log(x + 1)``, and a category is its hexadecimal
value modulo the table size (dlrm's ``--max-ind-range`` hashing; no dictionary pass, so the
file is read once, in order, never held in memory).

Train and test come from the same file: line n (from 1) is a test line when
``n % test_every == 0`` (default 7: one line in seven, the share of dlrm's Kaggle split,
where the last of seven days is held out). dlrm holds out a contiguous day; a streaming
reader cannot know where the last seventh begins without a pass, so this one interleaves.

A malformed line (wrong number of fields, a label other than 0/1, a non-integer or
non-hexadecimal value) raises DataFormatError naming the file and line, or with
``skip_bad=True`` is skipped and counted (``bad_lines``). Batches carry the position after
their last line, so a run resumes exactly where its checkpoint was taken.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigurationError, DataFormatError

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE


@dataclass
class Position:
    """Where a reader stands: the byte offset of the next line and counters up to it."""
    offset: int = 0
    line: int = 0          # lines read so far (the next line is line + 1)
    bad_lines: int = 0     # malformed lines skipped so far

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ClickBatch:
    """A global batch: dense [B, 13] float32 (log(x+1)), sparse [26, B] int64 (already
    hashed into each table), labels [B] float32, and the reader's position after it."""
    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    position: Position

    def __len__(self) -> int:
        return int(self.labels.numel())

    def lookups(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, offsets) of table `table`: one lookup per sample (bags of size 1)."""
        return self.sparse[table], torch.arange(len(self), dtype=torch.int64)

    def stacked_lookups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every table's lookups stacked, as dlrm's collate makes them for Criteo data:
        (indices [26, B], offsets [26, B]); row t is table t's `lookups(t)`."""
        offsets = torch.arange(len(self), dtype=torch.int64)
        return self.sparse, offsets.expand(self.sparse.shape[0], len(self))


def parse_line(fields: list, table_sizes, where: str):
    """(label, dense[13] ints, sparse[26] hashed ints) of one split line; DataFormatError."""
    if len(fields) != NUM_FIELDS:
        raise DataFormatError(
            f"{where}: expected {NUM_FIELDS} tab-separated fields (label, {NUM_DENSE} integers, "
            f"{NUM_SPARSE} hexadecimal categories), got {len(fields)}")
    label = fields[0]
    if label not in (b"0", b"1"):
        raise DataFormatError(f"{where}: the label must be 0 or 1, got {label[:20]!r}")
    try:
        dense = [max(int(f), 0) if f else 0 for f in fields[1:1 + NUM_DENSE]]
    except ValueError:
        bad = next(f for f in fields[1:1 + NUM_DENSE] if f and not _is_int(f))
        raise DataFormatError(f"{where}: integer feature {bad[:20]!r} is not an integer") from None
    try:
        sparse = [(int(f, 16) if f else 0) % size
                  for f, size in zip(fields[1 + NUM_DENSE:], table_sizes)]
    except ValueError:
        bad = next(f for f in fields[1 + NUM_DENSE:] if f and not _is_hex(f))
        raise DataFormatError(
            f"{where}: categorical feature {bad[:20]!r} is not hexadecimal") from None
    return int(label), dense, sparse


def _is_int(text: bytes) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _is_hex(text: bytes) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


def count_lines(path) -> int:
    """Lines in the file (a last line without a newline counts), read in 1 MiB chunks."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


class CriteoTSV:
    """Batches of one split ("train" or "test") of a Criteo-format TSV file."""

    def __init__(self, path, table_sizes, split: str = "train", test_every: int = 7,
                 skip_bad: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigurationError(f"--raw-data-file {self.path} does not exist")
        self.table_sizes = [int(s) for s in table_sizes]
        if len(self.table_sizes) != NUM_SPARSE or min(self.table_sizes) < 1:
            raise ConfigurationError(
                f"the Criteo format has {NUM_SPARSE} categorical features: give {NUM_SPARSE} "
                f"positive table sizes (or --max-ind-range), got {table_sizes}")
        if split not in ("train", "test"):
            raise ConfigurationError(f"split must be 'train' or 'test', got {split!r}")
        if test_every < 2:
            raise ConfigurationError(f"test_every must be >= 2, got {test_every}")
        self.split, self.test_every, self.skip_bad = split, test_every, skip_bad
        self.bad_lines = 0

    def _mine(self, line_number: int) -> bool:
        return (line_number % self.test_every == 0) == (self.split == "test")

    def samples_in_file(self) -> int:
        """This split's share of the file's lines (malformed lines included)."""
        n = count_lines(self.path)
        test = n // self.test_every
        return test if self.split == "test" else n - test

    def batches(self, batch_size: int, start: Position | None = None, drop_last: bool = False):
        """Yield ClickBatch of `batch_size` samples from `start` (default: the beginning) to
        the end of the file; the last one may be shorter unless `drop_last`."""
        if batch_size < 1:
            raise ConfigurationError(f"batch size must be positive, got {batch_size}")
        pos = Position(**(start.to_dict() if start else {}))
        self.bad_lines = pos.bad_lines
        labels, dense, sparse = [], [], []
        with open(self.path, "rb") as f:
            f.seek(pos.offset)
            while True:
                raw = f.readline()
                if not raw:
                    break
                pos.line += 1
                pos.offset = f.tell()
                if not self._mine(pos.line):
                    continue
                try:
                    label, d, s = parse_line(raw.rstrip(b"\r\n").split(b"\t"), self.table_sizes,
                                             f"{self.path}:{pos.line}")
                except DataFormatError:
                    if not self.skip_bad:
                        raise
                    pos.bad_lines += 1
                    self.bad_lines = pos.bad_lines
                    continue
                labels.append(label)
                dense.append(d)
                sparse.append(s)
                if len(labels) == batch_size:
                    yield self._batch(labels, dense, sparse, pos)
                    labels, dense, sparse = [], [], []
        if labels and not drop_last:
            yield self._batch(labels, dense, sparse, pos)

    @staticmethod
    def _batch(labels, dense, sparse, pos: Position) -> ClickBatch:
        d = torch.log(torch.tensor(dense, dtype=torch.float32) + 1)
        s = torch.tensor(sparse, dtype=torch.int64).t().contiguous()
        return ClickBatch(d, s, torch.tensor(labels, dtype=torch.float32), Position(**pos.to_dict()))


def write_synthetic_criteo(path, lines: int, seed: int = 0, bad_lines=(), missing: float = 0.05,
                           cardinality: int = 100) -> Path:
    """A Criteo-format file whose label depends on its features, so that a model can learn
    it: the click log-odds are a sum of per-value effects of the first four categorical
    features (uniform over `cardinality` values) and of log(1 + x) of two integer features;
    the other features are noise (Poisson counts, Zipf-distributed categories). A few
    values are missing or negative, as in the real logs. `bad_lines`: 1-based line numbers
    written malformed, in turn: too few fields, a label of 2, a non-integer count, a
    non-hexadecimal category. For tests and the demo; real data: the Criteo click logs."""
    rng = np.random.default_rng(seed)
    effects = rng.normal(0.0, 1.0, size=(4, cardinality))
    hashes = rng.integers(1 << 28, 1 << 32, size=(NUM_SPARSE, cardinality))
    means = np.array([3, 10, 1, 30, 2, 7, 1, 4, 20, 1, 2, 5, 9])
    bad = {int(n): i for i, n in enumerate(sorted(bad_lines))}
    path = Path(path)
    with open(path, "w") as f:
        for n in range(1, lines + 1):
            counts = rng.poisson(means)
            counts[rng.random(NUM_DENSE) < 0.02] = -1
            cats = np.concatenate([rng.integers(0, cardinality, size=4),
                                   rng.zipf(1.5, size=NUM_SPARSE - 4) % cardinality])
            logit = (sum(effects[k, cats[k]] for k in range(4))
                     + 1.5 * (math.log1p(max(counts[0], 0)) - 1.3)
                     - 1.0 * (math.log1p(max(counts[4], 0)) - 0.9))
            label = int(rng.random() < 1.0 / (1.0 + math.exp(-logit)))
            dense = ["" if rng.random() < missing else str(v) for v in counts]
            sparse = ["" if rng.random() < missing else format(int(hashes[t, c]), "08x")
                      for t, c in enumerate(cats)]
            fields = [str(label)] + dense + sparse
            if n in bad:
                kind = bad[n] % 4
                if kind == 0:
                    fields = fields[:20]
                elif kind == 1:
                    fields[0] = "2"
                elif kind == 2:
                    fields[3] = "12x"
                else:
                    fields[20] = "zz!"
            f.write("\t".join(fields) + "\n")
    return path
