"""The nvshmem backend (-DROCMOE_SHMEM=nvshmem) on a real GPU, at one PE: NVSHMEM wants a GPU
per PE, and the test machine has one GPU. The puts, signals, kernels and errors of the
backend (tests/gpu/ipc_script.py), then the fused-op handles on its device facade against the
references, replayed from CUDA graphs and free of host syncs (the handle protocol is one
protocol on every backend: issue 14, item 6).

The in-place build (build_cuda) has the ipc facade only, so these tests take a second build:
`GPU_SUITE_PART=6 bash tests/gpu_suite.sh` builds it (benchmarks/device_env.sh:
build_nvshmem) and stages it as a copy of the package named by ROCMOE_NVSHMEM_PACKAGE. They
skip without a GPU, and without such a build (the package's own build with nvshmem compiled
in serves too)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "ops_gpu"))  # gpu_testing (this folder may run alone)

from gpu_testing import SCRIPT as FUSED_SCRIPT  # noqa: E402
from rocmoe_testing import mpi_env, run_mpi  # noqa: E402

IPC_SCRIPT = Path(__file__).resolve().parent / "ipc_script.py"


def _package() -> str | None:
    """The folder to import rocmoe from with nvshmem compiled in, or None."""
    staged = os.environ.get("ROCMOE_NVSHMEM_PACKAGE")
    if staged:
        return staged
    try:
        from rocmoe import _native
    except Exception:  # the native module is missing: nothing GPU can run
        return None
    return str(REPO) if "nvshmem" in _native.backends_compiled() else None


pytestmark = [
    pytest.mark.gpu, pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available() or _package() is None,
                       reason="needs a GPU and a build with -DROCMOE_SHMEM=nvshmem "
                              "(GPU_SUITE_PART=6 bash tests/gpu_suite.sh makes one)")]


def _env(**extra) -> dict:
    # the staged package first; its copy of rocmoe must win over the checkout's
    path = os.pathsep.join(filter(None, [_package(), os.environ.get("PYTHONPATH")]))
    return mpi_env(PYTHONPATH=path, NVSHMEM_DISABLE_NVLS="1", **extra)


def test_the_staged_package_has_the_nvshmem_backend():
    import subprocess
    code = "from rocmoe import _native; print(_native.backends_compiled())"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=str(REPO / "tests"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    assert "nvshmem" in out, out


def test_nvshmem_backend_single_pe_puts_signals_kernels_and_errors():
    proc = run_mpi(IPC_SCRIPT, 1, "nvshmem", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert "RANK 0 OK" in proc.stdout, proc.stdout


def test_fused_handles_on_nvshmem_match_reference_replay_from_graphs_without_syncs():
    checks, dtypes = ["gemm", "gemm_grouped", "rows", "embedding", "gemv", "graph", "nosync"], \
        ["bf16", "fp32"]
    proc = run_mpi(FUSED_SCRIPT, 1, ",".join(checks), "--calls", 3, "--dtype", ",".join(dtypes),
                   "--backend", "nvshmem", timeout=500, env=_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    for check in checks:
        for dtype in dtypes:
            assert proc.stdout.count(f"OK {check} {dtype}") == 1, proc.stdout
