"""GPU path of the fused ops on a real GPU (skipped on CPU-only machines): every op, every
dtype, 1, 2 and 4 ranks (ranks share the GPUs when there are fewer), both arenas: the
ipc backend's heap (rocmoe.init) when librocmoe has a GPU build, and device memory shared
through torch's IPC handles."""

import pytest
import torch

from gpu_testing import SCRIPT, librocmoe_has_gpu, require_gpu
from rocmoe_testing import mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

OPS = ["gemm", "gemm_grouped", "embedding", "gemv"]  # gemm_grouped: the MoE combine


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("arena", ["torchipc", "context"])
def test_fused_ops_match_reference_on_gpu(arena, ranks):
    require_gpu()
    if not librocmoe_has_gpu():
        pytest.skip("librocmoe was built without a GPU platform")
    if arena == "context" and "ipc" not in _native_backends():
        pytest.skip("librocmoe has no ipc backend")
    # every op and dtype in one job per (arena, ranks): start-up is paid once
    proc = run_mpi(SCRIPT, ranks, ",".join(OPS), arena, "--calls", "4",
                   "--dtype", "fp32,bf16,fp16", timeout=400, env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, f"{arena}:\n{proc.stdout}"
    for op in OPS:
        for dtype in ("fp32", "bf16", "fp16"):
            assert proc.stdout.count(f"OK {op} {dtype}") == ranks, f"{arena}:\n{proc.stdout}"


def _native_backends():
    from rocmoe import _native
    return _native.backends_compiled()


def test_missing_signal_times_out_on_gpu():
    require_gpu()
    proc = run_mpi(SCRIPT, 2, "gemm_timeout", "torchipc", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="3"))
    assert proc.returncode == 0, proc.stdout
    assert "RANK 0 TIMEOUT" in proc.stdout, proc.stdout
