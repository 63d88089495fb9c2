"""What the process's environment says to rocmoe, read without loading the native library:
the timeouts every bounded wait uses, the symmetric heap's size and whether an MPI launcher
started this process.

The runtime (rocmoe.runtime), the training loop's process group (rocmoe.train.group) and
``rocmoe info``, which must not need librocmoe, read them from here, so all parse
ROCMOE_TIMEOUT_S and ROCMOE_HEAP_SIZE alike and agree on what counts as "started by mpiexec
or srun"."""

from __future__ import annotations

import math
import os

from .errors import InvalidArgumentError

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_FIRST_CALL_TIMEOUT_S = 300.0
DEFAULT_HEAP_SIZE = 1 << 30

# environment variables that MPI launchers (mpiexec, srun) set in every rank
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_NUM_TASKS",
                 "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    return any(name in os.environ for name in LAUNCHER_VARS)


def checked_seconds(value, what: str, zero_ok: bool = False) -> float:
    """`value` as a number of seconds that bounds a wait: finite, and positive (or 0 where
    `zero_ok`). Anything else (text that is no number, nan, inf, a negative) is an
    InvalidArgumentError naming `what` and the value: an infinite bound is no bound."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not ((seconds >= 0 if zero_ok else seconds > 0) and seconds < math.inf):
        kind = "a non-negative" if zero_ok else "a positive"
        raise InvalidArgumentError(f"{what} must be {kind}, finite number of seconds, "
                                   f"got {value!r}")
    return seconds


def seconds_from_env(name: str, default: float, zero_ok: bool) -> float:
    """A number of seconds from environment variable `name` (`default` when unset or
    empty); see checked_seconds."""
    text = os.environ.get(name)
    return checked_seconds(text, name, zero_ok) if text else default


def timeout_from_env() -> float:
    """ROCMOE_TIMEOUT_S: the bound of every wait (host collectives, device signals)."""
    return seconds_from_env("ROCMOE_TIMEOUT_S", DEFAULT_TIMEOUT_S, zero_ok=False)


def first_call_timeout_from_env() -> float:
    """ROCMOE_FIRST_CALL_TIMEOUT_S: the bound of a handle's first device waits (0: no more
    than ROCMOE_TIMEOUT_S; see rocmoe.ops.gpu.first_call_timeout_s)."""
    return seconds_from_env("ROCMOE_FIRST_CALL_TIMEOUT_S", DEFAULT_FIRST_CALL_TIMEOUT_S,
                            zero_ok=True)


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from "123", "512M", "1.5G", "64KiB", ... (an InvalidArgumentError naming `what`
    and the text otherwise)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise InvalidArgumentError(
            f"cannot read {what} {text!r}: use bytes or a K/M/G/T suffix, e.g. 512M") from None


def heap_size_from_env() -> int:
    """ROCMOE_HEAP_SIZE: the symmetric heap's bytes per rank (default 1 GiB)."""
    text = os.environ.get("ROCMOE_HEAP_SIZE")
    return parse_size(text, "ROCMOE_HEAP_SIZE") if text else DEFAULT_HEAP_SIZE


def parse_sizes(text: str, option: str = "--sizes", example: str = "1K,64K,1M") -> list[int]:
    """Positive byte counts from a comma list of parse_size's forms (a command-line option
    `option`; an InvalidArgumentError naming it otherwise)."""
    sizes = [parse_size(part, option) for part in text.split(",") if part.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise InvalidArgumentError(f"{option} {text!r}: give positive sizes, e.g. {example}")
    return sizes
