"""The public rocmoe.ops functions on a GPU context (ipc heap), forward and backward, against
rocmoe.ops.reference on CPU copies, at 1, 2 and 4 ranks (sharing the GPU when there is one):
tests/ops_gpu/public_ops_script.py. Skipped without a GPU."""

import pytest

from gpu_testing import librocmoe_has_gpu, require_gpu
from rocmoe_testing import TESTS, mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SCRIPT = TESTS / "ops_gpu" / "public_ops_script.py"
CHECKS = ["gemv/fwd", "gemv/dW", "gemv/dx", "gemm/fwd", "gemm/dX", "gemm/dW",
          "gemm_grouped/fwd", "gemm_grouped/dX", "gemm_grouped/dW", "embedding/fwd",
          "embedding/dtables"]
DTYPES = ["fp32", "bf16"]
REPEAT_CHECKS = ["first", "same_shapes_new_tensors", "int32_indices", "int64_again",
                 "other_rows", "other_rows_again", "first_rows_again", "more_lookups",
                 "more_lookups_again", "mode_mean", "mode_mean_again", "bf16", "bf16_again",
                 "fewer_tables", "fewer_tables_again", "stacked", "stacked_int32",
                 "stacked_again", "bad_index_raises_at_the_next_call",
                 "after_the_bad_index_it_computes"]
CALLS = 3


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_public_ops_forward_and_backward_on_gpu_equal_the_reference(ranks):
    require_gpu()
    if not librocmoe_has_gpu():
        pytest.skip("librocmoe was built without a GPU platform (benchmarks/device_env.sh: "
                    "build_cuda)")
    proc = run_mpi(SCRIPT, ranks, ",".join(DTYPES), timeout=500,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    out = proc.stdout
    assert proc.returncode == 0, out
    assert " FAIL" not in out, out
    for rank in range(ranks):
        assert f"RANK {rank} DONE failures=0" in out, out
        for dtype in DTYPES:
            for check in CHECKS:
                for call in range(CALLS):
                    assert f"RANK {rank} {dtype}/{check}#{call} OK" in out, \
                        f"rank {rank} did not report {dtype}/{check}#{call}:\n{out}"
        # grad mode off: the functions without the custom op, the GEMM's lean launches
        for dtype in DTYPES:
            for check in ("gemm", "gemv", "embedding"):
                for call in range(4):
                    assert f"RANK {rank} {dtype}/nograd/{check}#{call} OK" in out, out
        # the functional embedding's repeat path and what makes it step aside
        for check in REPEAT_CHECKS:
            assert f"RANK {rank} embedding_repeat/{check} OK" in out, out
        for check in ("same", "other_k", "other_k_again", "fp32", "fp32_again", "other_n",
                      "other_n_again"):
            assert f"RANK {rank} gemv_repeat/{check} OK" in out, out
        for check in ("same", "other_rows", "other_rows_class", "other_rows_class_again",
                      "other_k", "other_k_again", "fp32", "fp32_again", "other_n",
                      "other_n_again", "parameter_w"):
            assert f"RANK {rank} gemm_repeat/{check} OK" in out, out
        # outputs the caller holds keep their values over later calls (the handles' rings)
        for k in range(3):
            for check in ("gemv", "gemm", "embedding"):
                assert f"RANK {rank} held_outputs/{check}_round{k} OK" in out, out
        # at world size 1, the functions captured in a CUDA graph replay what eager calls
        # compute, on the inputs copied in before each replay
        if ranks == 1:
            for check in ("gemv", "gemm", "embedding_listed", "embedding_stacked"):
                assert f"RANK {rank} functions_graph/{check} OK" in out, out
        # bad input on the last rank only: every rank raised, none hung
        assert f"RANK {rank} bad_counts_raise_everywhere OK" in out, out
        assert f"RANK {rank} bad_index_raises_everywhere_at_the_next_call OK" in out, out
        assert f"RANK {rank} after_a_bad_index_the_next_call_computes OK" in out, out
