"""What a run tells: JSON lines on stdout (and a file), a tqdm bar and text on stderr.

Only rank 0 speaks. stdout carries nothing but JSON objects, one per line, each with an
``"event"`` key (the schemas are in each example's docstring and README.md), so that
``python examples/moe_train.py | jq`` and ``rocmoe plot`` can read it; the progress bar and
human-readable lines go to stderr. ``jsonl`` also writes the records to a file, appending
when the run resumes from a checkpoint (the file then holds every attempt; a reader keeps
the last record of each step).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def _plain(value):
    """JSON-safe: NaN and infinities become null (json.dumps would write invalid JSON), paths
    their text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


class RunLog:
    def __init__(self, rank: int, example: str, jsonl=None, append: bool = False,
                 total: int | None = None, initial: int = 0, progress: bool = True,
                 unit: str = "step"):
        self.speaks = rank == 0
        self.example = example
        self._file = open(jsonl, "a" if append else "w") if (jsonl and self.speaks) else None
        self._bar = None
        if self.speaks and progress:
            try:
                from tqdm import tqdm
            except ImportError:  # a bare GPU machine: no bar, the records still come
                print("rocmoe: tqdm is not installed; no progress bar", file=sys.stderr)
            else:
                self._bar = tqdm(total=total, initial=initial, unit=unit, desc=example,
                                 file=sys.stderr, dynamic_ncols=True, leave=True)

    def record(self, event: str, **fields) -> None:
        if not self.speaks:
            return
        line = json.dumps(_plain({"event": event, "example": self.example, **fields}))
        print(line, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def text(self, line: str) -> None:
        if not self.speaks:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def advance(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


class StepTimer:
    """Wall time of the named parts of a step; on a GPU each part ends with a sync, so the
    time is the part's and not the launch queue's."""

    def __init__(self, device):
        import torch
        self._sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") \
            else (lambda: None)
        self.parts: dict[str, float] = {}
        self._t = None

    def start(self) -> None:
        self.parts = {}
        self._sync()
        self._t = time.perf_counter()

    def mark(self, part: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + (now - self._t)
        self._t = now

    @property
    def total(self) -> float:
        return sum(self.parts.values())
