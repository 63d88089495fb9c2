"""Helpers of the GPU fused-op tests (the shared ones live in tests/rocmoe_testing.py)."""

import os
from typing import Optional

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "fused_gpu_script.py")


def require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU: the GPU path of the fused ops runs on the device machine")


def librocmoe_has_gpu() -> bool:
    try:
        from rocmoe import _native
    except Exception:  # pragma: no cover - broken install
        return False
    return _native.gpu_platform() != "none"


def require_gpu_build():
    """Skip without a GPU; fail where there is one but librocmoe was built without it."""
    require_gpu()
    if not librocmoe_has_gpu():
        pytest.fail("librocmoe was built without a GPU platform on a machine with a GPU")


def run_checks(ranks: int, checks: list, dtypes: list, timeout: float = 300,
               calls: Optional[int] = None, **env):
    """fused_gpu_script.py's `checks` for each of `dtypes` in one job of `ranks` ranks (the
    job's start-up paid once), with `env` set for it (ROCMOE_TIMEOUT_S and the like):
    asserts that the job exited 0 and that every rank reported every check and dtype OK.
    Returns the finished process, for whatever else its output must show."""
    from rocmoe_testing import mpi_env, run_mpi
    args = [",".join(checks)] + (["--calls", calls] if calls is not None else [])
    proc = run_mpi(SCRIPT, ranks, *args, "--dtype", ",".join(dtypes), timeout=timeout,
                   env=mpi_env(**env))
    assert proc.returncode == 0, proc.stdout
    for check in checks:
        for dtype in dtypes:
            assert proc.stdout.count(f"OK {check} {dtype}") == ranks, proc.stdout
    return proc
