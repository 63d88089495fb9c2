"""Checkpoints of a multi-rank run: one shard per rank, atomic files, the manifest last.

Layout of a checkpoint directory (``--checkpoint-dir``)::

    step-00000040/
        rank-00000.pt     rank 0's shard (torch.save of a dict: model, optimizer, RNG, data)
        rank-00001.pt
        manifest.json     written last, by rank 0, once every rank's shard is in place

Every file is written to a temporary name, fsynced and renamed, and the directory is
fsynced after the rename, so a crash leaves either the old file or the new one, never half
of one. A step directory without a manifest is an unfinished save and is never loaded.

Loading is all-or-nothing and collective: every rank checks the manifest (format, world
size, run configuration) and its own shard (present, size, sha256) before anything is
loaded, the ranks compare verdicts, and if any rank cannot load, every rank raises
CheckpointError naming the ranks and the reasons. Nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from .group import ProcessGroup

FORMAT = "rocmoe-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")

# why a rank cannot load (codes travel in an all-gather; each rank has its own text)
_OK, _NO_MANIFEST, _BAD_MANIFEST, _WORLD, _CONFIG, _NO_SHARD, _BAD_SHARD = range(7)
_REASONS = {_NO_MANIFEST: "no manifest (an unfinished save)", _BAD_MANIFEST: "unreadable manifest",
            _WORLD: "written by another world size", _CONFIG: "another run configuration",
            _NO_SHARD: "its shard is missing", _BAD_SHARD: "its shard is damaged"}


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"step-{int(step):08d}"


def shard_name(rank: int) -> str:
    return f"rank-{int(rank):05d}.pt"


# -- atomic files ----------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# -- RNG state -------------------------------------------------------------------------------
def rng_state() -> dict:
    """Every generator a training step may draw from (torch CPU and GPU, numpy, random)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- finding ---------------------------------------------------------------------------------
def list_checkpoints(directory) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) for every step directory, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry, (entry / MANIFEST).is_file()))
    return sorted(found)


def latest_checkpoint(directory) -> Path | None:
    """The newest complete checkpoint (one with a manifest), or None."""
    complete = [path for _, path, ok in list_checkpoints(directory) if ok]
    return complete[-1] if complete else None


# -- saving ----------------------------------------------------------------------------------
def save_checkpoint(directory, step: int, shard: dict, group: ProcessGroup, config: dict,
                    keep: int = 2) -> Path:
    """Collective: write this rank's `shard`, then (rank 0) the manifest; returns the step
    directory. `config` is what a resume must match (JSON-serialisable). Keeps the newest
    `keep` complete checkpoints (0: all)."""
    path = step_dir(directory, step)
    problem = None
    if group.rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            # a manifest left from an earlier save of this step would vouch for shards that
            # are about to be replaced: take it away first
            (path / MANIFEST).unlink(missing_ok=True)
        except OSError as exc:
            problem = exc
    # (an agreement, not a barrier: rank 0 failing here used to raise on rank 0 alone while
    # the others waited in the barrier until their timeout)
    _agree(group, problem, "checkpoint save (directory)",
           f"checkpoint {path}: rank 0 could not create the directory")
    data = b""
    try:
        buffer = io.BytesIO()
        torch.save(dict(shard, step=int(step), rank=group.rank, world_size=group.world_size),
                   buffer)
        data = buffer.getvalue()
    except Exception as exc:  # noqa: BLE001 - the pickler's own error says what it met
        # (it used to escape on this rank alone; the others waited in the all-gather below)
        problem = CheckpointError(f"rank {group.rank}'s shard cannot be saved: {exc}")
    if problem is None:
        try:
            # loads read shards with weights_only=True (no code runs from a checkpoint): a
            # shard holding anything but tensors and plain values would save fine and never
            # load
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - the unpickler's own error says what it met
            problem = CheckpointError(f"rank {group.rank}'s shard holds something other than "
                                      f"tensors and plain Python values: {exc}")
    if problem is None:
        try:
            write_atomic(path / shard_name(group.rank), data)
        except OSError as exc:
            problem = exc
    digest = hashlib.sha256(data).hexdigest()
    words = np.concatenate([[0 if problem is None else 1, len(data)],
                            np.frombuffer(bytes.fromhex(digest), np.int64)]).astype(np.int64)
    table = group.allgather(words, "checkpoint save (shards)")
    failed = [r for r in range(group.world_size) if table[r, 0]]
    if failed:
        raise CheckpointError(f"checkpoint {path}: ranks {failed} could not write their shard"
                              + (f" (here: {problem})" if problem else "") + "; no manifest "
                              "was written, so this checkpoint will not be loaded")
    if group.rank == 0:
        manifest = {"format": FORMAT, "step": int(step), "world_size": group.world_size,
                    "config": config,
                    "shards": [{"rank": r, "file": shard_name(r), "bytes": int(table[r, 1]),
                                "sha256": table[r, 2:].tobytes().hex()}
                               for r in range(group.world_size)]}
        try:
            text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
            write_atomic(path / MANIFEST, text.encode())
        except (OSError, TypeError, ValueError) as exc:
            # a full disk, or a config that is not JSON: rank 0 used to raise alone while the
            # others waited in the barrier that stood here
            problem = exc
        if problem is None and keep > 0:
            _prune(directory, step, keep)
    _agree(group, problem, "checkpoint save (manifest)",
           f"checkpoint {path}: rank 0 could not write the manifest, so this checkpoint will "
           "not be loaded")
    return path


def _agree(group: ProcessGroup, problem, what: str, failed: str) -> None:
    """Collective: every rank raises CheckpointError (`failed`, with this rank's own
    `problem` when it has one) if any rank has a problem."""
    group.raise_together(problem, what, failed, CheckpointError)


def _prune(directory, newest: int, keep: int) -> None:
    entries = list_checkpoints(directory)
    complete = [s for s, _, ok in entries if ok]
    keep_steps = set(complete[-keep:])
    for step, path, ok in entries:
        # unfinished saves older than the newest checkpoint are dead; newer ones cannot exist
        if step < newest and (step not in keep_steps or not ok):
            shutil.rmtree(path, ignore_errors=True)


# -- a training run's shard -------------------------------------------------------------------
def training_shard(model, optimizer, data: dict) -> dict:
    """What a rank saves: its module's state_dict (anything a layer keeps there, e.g. an
    expert placement, comes along), its optimizer state, every RNG and the data position."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": rng_state(), "data": data}


def resume_training(directory, resume: str, group: ProcessGroup, config: dict, model,
                    optimizer):
    """Collective, for ``--resume``: "auto" (the newest complete checkpoint in `directory`,
    a fresh start when there is none), "never", or a step directory. Restores the model,
    the optimizer and the RNGs; returns (the saved data position, the path), or (None, None)
    for a fresh start."""
    if resume == "never":
        return None, None
    if resume == "auto":
        path = latest_checkpoint(directory) if directory else None
        if path is None:
            return None, None
    else:
        path = Path(resume)
    shard = load_checkpoint(path, group, config)
    problem = None
    try:
        model.load_state_dict(shard["model"])
        optimizer.load_state_dict(shard["optimizer"])
        set_rng_state(shard["rng"])
        data = shard["data"]
    except Exception as exc:  # noqa: BLE001 - torch's own message says which key or size
        # a shard this rank's model or optimizer cannot take: every rank stops (this one
        # used to raise alone, and the others went on to wait in their first step)
        problem = exc
    _agree(group, problem, "checkpoint resume (restore)",
           f"checkpoint {path}: a rank could not restore its model, optimizer or RNG state "
           "from its shard; restart without --resume or with the run's own settings")
    return data, path


# -- loading ---------------------------------------------------------------------------------
def _config_differences(saved: dict, config: dict) -> list[str]:
    keys = sorted(set(saved) | set(config))
    return [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}"
            for k in keys if saved.get(k) != config.get(k)]


def _check(path: Path, rank: int, world: int, config: dict):
    """(code, text, shard bytes) of this rank's view of the checkpoint at `path`."""
    try:
        return _check_files(path, rank, world, config)
    except (AttributeError, KeyError, TypeError) as exc:
        # a manifest of the right format whose entries are not what a save writes (an
        # error on each rank, but not a CheckpointError, and not agreed)
        return _BAD_MANIFEST, f"{path / MANIFEST} has entries a save does not write: {exc!r}", None


def _check_files(path: Path, rank: int, world: int, config: dict):
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return _NO_MANIFEST, f"{path} has no {MANIFEST}: the save did not finish", None
    except (OSError, ValueError) as exc:
        return _BAD_MANIFEST, f"{path / MANIFEST} cannot be read: {exc}", None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("shards"), list):
        return _BAD_MANIFEST, f"{path / MANIFEST} is not a {FORMAT} manifest", None
    if manifest.get("world_size") != world:
        return _WORLD, (f"{path} was written by {manifest.get('world_size')} ranks, this run has "
                        f"{world}: resume with the same number of ranks"), None
    differences = _config_differences(manifest.get("config") or {}, config)
    if differences:
        return _CONFIG, (f"{path} is from another run configuration ("
                         + "; ".join(differences) + ")"), None
    entry = next((s for s in manifest["shards"] if s.get("rank") == rank), None)
    shard_path = path / (entry["file"] if entry else shard_name(rank))
    try:
        data = shard_path.read_bytes()
    except FileNotFoundError:
        return _NO_SHARD, f"{shard_path} is missing", None
    except OSError as exc:
        return _BAD_SHARD, f"{shard_path} cannot be read: {exc}", None
    if entry is None or len(data) != entry.get("bytes") or \
            hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return _BAD_SHARD, (f"{shard_path} does not match the manifest (size or sha256): it was "
                            "changed or truncated after the save"), None
    return _OK, "", data


def load_checkpoint(path, group: ProcessGroup, config: dict) -> dict:
    """Collective: this rank's shard of the checkpoint at `path`, after every rank has checked
    its part; CheckpointError on every rank if any cannot load."""
    path = Path(path)
    code, text, data = _check(path, group.rank, group.world_size, config)
    shard = None
    if code == _OK:
        try:
            shard = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad shard
            code, text = _BAD_SHARD, f"{path / shard_name(group.rank)} cannot be unpickled: {exc}"
    codes = group.allgather(np.array([code], np.int64), "checkpoint load (verdicts)")[:, 0]
    bad = [(r, int(c)) for r, c in enumerate(codes) if c != _OK]
    if bad:
        summary = ", ".join(f"rank {r}: {_REASONS[c]}" for r, c in bad)
        here = f" Here (rank {group.rank}): {text}." if text else ""
        raise CheckpointError(f"refusing checkpoint {path} ({summary}); nothing was loaded.{here}")
    return shard
