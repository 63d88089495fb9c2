"""The fused-op handles' device kernels on a real GPU (skipped on CPU-only machines): every
op and dtype at 1, 2 and 4 ranks (ranks share the GPU when there are fewer), the protocol's
failure cases (a missing peer, bad device counts, a rank that rejects its input), and
several calls of each handle captured in a CUDA graph and replayed."""

import pytest

from gpu_testing import SCRIPT, librocmoe_has_gpu, require_gpu
from rocmoe_testing import mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

OPS = ["gemm", "gemm_grouped", "rows", "embedding", "gemv"]


def _require_gpu_build():
    require_gpu()
    if not librocmoe_has_gpu():
        pytest.fail("librocmoe was built without a GPU platform on a machine with a GPU")


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_handles_match_reference_on_gpu(ranks):
    _require_gpu_build()
    # every op and dtype in one job per rank count: start-up is paid once
    proc = run_mpi(SCRIPT, ranks, ",".join(OPS), "--calls", "4", "--dtype", "fp32,bf16,fp16",
                   timeout=500, env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    for op in OPS:
        for dtype in ("fp32", "bf16", "fp16"):
            assert proc.stdout.count(f"OK {op} {dtype}") == ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_split_k_gemm_matches_reference_and_replays_from_graphs_on_gpu(ranks):
    _require_gpu_build()
    # the tuner's split-K tiles, forced: a skinny product, the small handles, graph replay
    split = '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 4}'
    proc = run_mpi(SCRIPT, ranks, "split,gemm,gemm_grouped,graph", "--calls", "3",
                   "--dtype", "bf16,fp32", timeout=400,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60", ROCMOE_GEMM_CONFIG=split))
    assert proc.returncode == 0, proc.stdout
    for op in ("split", "gemm", "gemm_grouped", "graph"):
        assert proc.stdout.count(f"OK {op} ") == 2 * ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_gemm_handle_launches_natively_through_the_driver_with_the_jits_results(ranks):
    _require_gpu_build()
    proc = run_mpi(SCRIPT, ranks, "native", "--dtype", "bf16,fp32", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK native") == 2 * ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_gemm_handle_lean_calls_leave_bad_input_and_autograd_to_the_checked_path(ranks):
    _require_gpu_build()
    proc = run_mpi(SCRIPT, ranks, "lean", "--dtype", "bf16,fp32", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK lean") == 2 * ranks, proc.stdout
    assert proc.stdout.count("REJECTED") == 4 * ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_handles_replay_from_cuda_graphs_equal_to_eager(ranks):
    _require_gpu_build()
    proc = run_mpi(SCRIPT, ranks, "graph", "--dtype", "bf16,fp32", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK graph") == 2 * ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_forward_and_backward_of_every_handle_make_no_host_sync(ranks):
    _require_gpu_build()
    proc = run_mpi(SCRIPT, ranks, "nosync", "--dtype", "bf16", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK nosync") == ranks, proc.stdout


def test_bad_device_counts_and_a_rejected_input_raise_on_every_rank_on_gpu():
    _require_gpu_build()
    proc = run_mpi(SCRIPT, 2, "bad_counts,abort,gemv_abort,gemv_mismatch,embedding_bad_index",
                   "--dtype", "bf16", timeout=300, env=mpi_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 10, proc.stdout


def test_missing_peer_times_out_on_gpu():
    _require_gpu_build()
    proc = run_mpi(SCRIPT, 2, "gemm_timeout", "--dtype", "bf16", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="3"))
    assert "RANK 0 TIMEOUT" in proc.stdout and "rank(s) [1]" in proc.stdout, proc.stdout


def test_a_peer_late_for_a_first_call_by_twice_the_timeout_does_not_time_it_out_on_gpu():
    # as a rank still compiling and tuning would be: the first launch of a GEMM plan waits
    # ROCMOE_FIRST_CALL_TIMEOUT_S; with it at 0 the same job times out (the check can fail)
    _require_gpu_build()
    proc = run_mpi(SCRIPT, 2, "first_call_drift", "--dtype", "bf16", timeout=200,
                   env=mpi_env(ROCMOE_TIMEOUT_S="3"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK first_call_drift") == 2, proc.stdout
