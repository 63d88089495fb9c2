"""The fused-op handles on a real GPU (skipped on CPU-only machines), how they launch and how
they fail: the GEMM's native driver launch and its lean calls (the function's exact-rows
outputs at world size 1 among them), forward and backward without a host sync, and the
protocol's failure cases (bad device counts, a rank that rejects its input, a missing peer,
a peer late for a first call). Results against the references and graph replays:
test_fused_gpu.py."""

import pytest

from gpu_testing import SCRIPT, require_gpu_build, run_checks
from rocmoe_testing import mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("ranks", [1, 2])
def test_gemm_handle_launches_natively_through_the_driver_with_the_jits_results(ranks):
    require_gpu_build()
    run_checks(ranks, ["native"], ["bf16", "fp32"], ROCMOE_TIMEOUT_S="60")


@pytest.mark.parametrize("ranks", [1, 2])
def test_gemm_handle_lean_calls_leave_bad_input_and_autograd_to_the_checked_path(ranks):
    require_gpu_build()
    proc = run_checks(ranks, ["lean"], ["bf16", "fp32"], ROCMOE_TIMEOUT_S="30")
    assert proc.stdout.count("REJECTED") == 4 * ranks, proc.stdout


def test_the_functional_gemm_at_world_size_1_returns_exactly_x_rows_from_a_ring():
    require_gpu_build()
    run_checks(1, ["function_rows"], ["bf16", "fp32"], ROCMOE_TIMEOUT_S="30")


@pytest.mark.parametrize("ranks", [1, 2])
def test_forward_and_backward_of_every_handle_make_no_host_sync(ranks):
    require_gpu_build()
    run_checks(ranks, ["nosync"], ["bf16"], ROCMOE_TIMEOUT_S="60")


def test_bad_device_counts_and_a_rejected_input_raise_on_every_rank_on_gpu():
    require_gpu_build()
    proc = run_mpi(SCRIPT, 2, "bad_counts,abort,gemv_abort,gemv_mismatch,embedding_bad_index",
                   "--dtype", "bf16", timeout=300, env=mpi_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 10, proc.stdout


def test_missing_peer_times_out_on_gpu():
    require_gpu_build()
    proc = run_mpi(SCRIPT, 2, "gemm_timeout", "--dtype", "bf16", timeout=300,
                   env=mpi_env(ROCMOE_TIMEOUT_S="3"))
    assert "RANK 0 TIMEOUT" in proc.stdout and "rank(s) [1]" in proc.stdout, proc.stdout


def test_a_peer_late_for_a_first_call_by_twice_the_timeout_does_not_time_it_out_on_gpu():
    # as a rank still compiling and tuning would be: the first launch of a GEMM plan waits
    # ROCMOE_FIRST_CALL_TIMEOUT_S; with it at 0 the same job times out (the check can fail)
    require_gpu_build()
    run_checks(2, ["first_call_drift"], ["bf16"], timeout=200, ROCMOE_TIMEOUT_S="3")
