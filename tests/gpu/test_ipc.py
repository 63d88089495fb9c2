"""The ipc backend on a real GPU: heaps in device memory, IPC handles, peer table, the
store+signal and wait+verify kernels, errors and timeouts; 1, 2 and 4 ranks (which share
the GPU when there is only one). Skipped without a GPU visible to torch or a GPU build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rocmoe_testing import require_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "ipc_script.py"



def _compiled(backend: str) -> bool:
    try:
        from rocmoe import _native
    except Exception:  # the native module is missing: nothing GPU can run
        return False
    return backend in _native.backends_compiled()


def _ipc_compiled() -> bool:
    return _compiled("ipc")


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not _ipc_compiled(),
    reason="needs a GPU visible to torch and a GPU build of librocmoe (-DROCMOE_GPU=cuda|hip)")


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _mpirun(n: int, *cmd, timeout: float = 240) -> subprocess.CompletedProcess:
    # Local helper rather than conftest's run_mpi: this file must also run where only
    # tests/gpu is collected (the GPU machine), and it passes a module or a script.
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        pytest.skip("mpiexec is not installed")
    version = subprocess.run([mpiexec, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True).stdout
    oversubscribe = ["--oversubscribe"] if "Open MPI" in version else []
    full = [mpiexec, *oversubscribe, "-n", str(n), sys.executable, *map(str, cmd)]
    try:
        return subprocess.run(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env=_env(), cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(full)} hung for {timeout} s:\n{exc.stdout}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_device_count_matches_torch():
    from rocmoe import _native
    assert _native.gpu_device_count() == torch.cuda.device_count()
    assert _native.gpu_platform() in ("cuda", "hip")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ipc_backend_puts_signals_kernels_and_errors(ranks):
    proc = _mpirun(ranks, SCRIPT)
    assert proc.returncode == 0, proc.stdout
    for r in range(ranks):
        assert f"RANK {r} OK" in proc.stdout, proc.stdout


@pytest.mark.gpu
@needs_gpu
def test_ipc_bench_verifies_and_reports_a_ratio(tmp_path):
    out = tmp_path / "ipc.json"
    proc = _mpirun(2, "-m", "rocmoe.bench.ipc", "--sizes", "1M,8M", "--iters", "5",
                   "--trials", "2", "--output", out)
    assert proc.returncode == 0, proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 * 2
    for rec in records:
        assert rec["verified"] and rec["mismatches"] == 0, rec
        assert rec["baseline"] and rec["store_gbps"] > 0 and rec["baseline_gbps"] > 0
        assert rec["ratio"] == pytest.approx(rec["store_gbps"] / rec["baseline_gbps"], rel=0.01)


def test_host_backend_refuses_gpu_kernels():
    # runs everywhere: the ABI exists in every build, and only ipc implements it
    require_module("rocmoe._rocmoe_cffi", "the native library's cffi module")
    import rocmoe
    from rocmoe import errors
    from rocmoe._native import check, ffi, lib
    with rocmoe.init(backend="host", heap_size=1 << 20) as ctx:
        with pytest.raises(errors.BackendUnavailableError, match="ipc"):
            ctx.device_peer_table()
        with pytest.raises(errors.BackendUnavailableError):
            check(lib.rocmoe_ipc_store_signal(ctx._live(), 0, 0, ffi.NULL, 0, 64, 1, ffi.NULL))
