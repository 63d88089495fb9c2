"""The functional GEMM's and GEMV's local checks name what fails them with a RocmoeError,
also for arguments that are not tensors at all (which the dispatcher would otherwise reject
with a RuntimeError on that rank alone while its peers wait). One host rank; the same
inputs on one bad rank of several raise on every rank (tests/ops/fused_script.py)."""

from __future__ import annotations

import pytest
import torch

from rocmoe import errors, ops


def test_gemm_x_that_is_not_a_tensor_is_named(ctx):
    with pytest.raises(errors.InvalidArgumentError, match="gemm_all_to_all: X must be a tensor"):
        ops.gemm_all_to_all([[1.0] * 4] * 6, torch.randn(4, 5), [6])


def test_gemm_w_that_is_not_a_tensor_is_named(ctx):
    with pytest.raises(errors.InvalidArgumentError, match="gemm_all_to_all: W must be a tensor"):
        ops.gemm_all_to_all(torch.randn(6, 4), [[1.0] * 5] * 4, [6])


def test_gemm_x_of_three_dims_is_named(ctx):
    with pytest.raises(errors.InvalidArgumentError, match=r"X has shape \(2, 3, 4\)"):
        ops.gemm_all_to_all(torch.randn(2, 3, 4), torch.randn(4, 5), [6])


def test_gemm_x_and_w_of_different_float_dtypes_are_named(ctx):
    with pytest.raises(errors.DTypeError, match="X is torch.float32 but W is torch.float16"):
        ops.gemm_all_to_all(torch.randn(6, 4), torch.randn(4, 5).half(), [6])


@pytest.mark.parametrize("counts", [None, ["a"], torch.tensor([[6]])],
                         ids=["none", "strings", "a 2-D tensor"])
def test_gemm_send_counts_that_are_not_integers_one_a_rank_are_refused(ctx, counts):
    with pytest.raises(errors.InvalidArgumentError,
                       match="send_counts must be a 1-D integer tensor or a list of ints"):
        ops.gemm_all_to_all(torch.randn(6, 4), torch.randn(4, 5), counts)


def test_gemv_w_that_is_not_a_tensor_is_named(ctx):
    with pytest.raises(errors.InvalidArgumentError, match="W_local must be a tensor"):
        ops.gemv_all_reduce([[1.0, 2.0]] * 3, torch.randn(2))


def test_gemv_x_that_is_not_a_tensor_is_named(ctx):
    with pytest.raises(errors.InvalidArgumentError, match="x_local must be a tensor"):
        ops.gemv_all_reduce(torch.randn(3, 2), [1.0, 2.0])


def test_the_ops_work_after_refusing_bad_arguments(ctx):
    x, w = torch.randn(6, 4), torch.randn(4, 5)
    with pytest.raises(errors.InvalidArgumentError):
        ops.gemm_all_to_all(x.tolist(), w, [6])
    with pytest.raises(errors.InvalidArgumentError):
        ops.gemv_all_reduce(w.t().tolist(), x[0])
    torch.testing.assert_close(ops.gemm_all_to_all(x, w, [6]), x @ w)
    torch.testing.assert_close(ops.gemv_all_reduce(w.t().contiguous(), x[0]), w.t() @ x[0])

