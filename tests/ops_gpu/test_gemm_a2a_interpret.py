"""The Triton GEMM+All-to-All kernel and its signal protocol, run by the Triton interpreter
on CPU processes whose "peers" are the host backend's shared-memory heap: the same kernel
source, the same schedule, stores through peer base pointers, epoch signals, acks, and
bounded waits as on a GPU (no GPU needed, runs in CI)."""

import pytest

from gpu_testing import SCRIPT
from rocmoe_testing import mpi_env, require_module, run_mpi

require_module("triton", "the Triton interpreter runs the GEMM+All-to-All kernel on CPU")

pytestmark = [pytest.mark.triton_interpret, pytest.mark.mpi]


def _env(**extra):
    return mpi_env(TRITON_INTERPRET="1", **extra)


@pytest.mark.parametrize("ranks", [1, 3])
def test_gemm_all_to_all_matches_reference_over_repeated_calls(ranks):
    # fp32 and fp16 only: Triton 3.9's interpreter computes tl.dot of bfloat16 operands
    # wrongly (reinterprets the bits; a 16x16 product is off by 1e10), compiled code is fine
    proc = run_mpi(SCRIPT, ranks, "gemm", "context", "--calls", "3", "--dtype", "fp32,fp16",
                   timeout=300, env=_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm") == 2 * ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 3])
def test_grouped_gemm_all_to_all_matches_reference(ranks):
    # W [G, K, N]: each destination's rows are G segments, each through its own W[g]
    proc = run_mpi(SCRIPT, ranks, "gemm_grouped", "context", "--calls", "2", "--dtype",
                   "fp32,fp16", timeout=300, env=_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm_grouped") == 2 * ranks, proc.stdout


def test_missing_peer_signal_times_out_with_comm_timeout_error():
    proc = run_mpi(SCRIPT, 2, "gemm_timeout", "context", timeout=240,
                   env=_env(ROCMOE_TIMEOUT_S="2"))
    assert proc.returncode == 0, proc.stdout
    assert "RANK 0 TIMEOUT" in proc.stdout and "rank(s) [1]" in proc.stdout, proc.stdout


def test_inconsistent_send_counts_rejected_on_every_rank():
    proc = run_mpi(SCRIPT, 2, "bad_counts", "context", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 2, proc.stdout


def test_gemv_with_different_n_rejected_on_every_rank():
    # the agreement runs before any launch, so it is checked here on the host backend too
    proc = run_mpi(SCRIPT, 2, "gemv_mismatch", "context", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 2, proc.stdout
