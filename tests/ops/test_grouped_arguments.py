"""The grouped products (gpu.grouped_local, gpu.grouped_weight_grad) refuse operands their
kernels would misread, on the host and before any launch, with a RocmoeError that names the
operand: counts of the wrong width or dtype, a W whose K is not X's, an out that is not
[rows, N] contiguous, a dtype or a device that differs from X's. (Their results, on CPU
under Triton's interpreter: tests/ops_gpu/test_grouped_*_interpret.py.)"""

import pytest
import torch

from rocmoe import errors
from rocmoe.ops import gpu

ROWS, K, N, GROUPS = 12, 8, 6, 3


def _operands(dtype=torch.float32):
    x = torch.zeros(ROWS, K, dtype=dtype)
    w = torch.zeros(GROUPS, K, N, dtype=dtype)
    counts = torch.tensor([[2, 3, 1], [0, 4, 2]], dtype=torch.int64)
    return x, w, counts


def test_grouped_local_refuses_counts_with_a_column_count_other_than_the_groups():
    x, w, counts = _operands()
    with pytest.raises(errors.InvalidArgumentError, match=r"counts must be \[sources, 3\]"):
        gpu.grouped_local(x, w, counts[:, :2].contiguous(), 0)


def test_grouped_local_refuses_counts_that_are_not_int64():
    x, w, counts = _operands()
    with pytest.raises(errors.DTypeError, match="counts must be int64"):
        gpu.grouped_local(x, w, counts.int(), 0)


def test_grouped_local_refuses_a_w_whose_k_is_not_xs():
    x, w, counts = _operands()
    with pytest.raises(errors.InvalidArgumentError, match="W must be"):
        gpu.grouped_local(x, torch.zeros(GROUPS, K + 1, N), counts, 0)


def test_grouped_local_refuses_a_strided_out():
    x, w, counts = _operands()
    out = torch.zeros(ROWS, 2 * N)[:, :N]
    with pytest.raises(errors.InvalidArgumentError, match="out must be a contiguous"):
        gpu.grouped_local(x, w, counts, 0, out=out)


def test_grouped_local_refuses_a_w_of_another_dtype():
    x, w, counts = _operands()
    with pytest.raises(errors.DTypeError, match="W is torch.float16"):
        gpu.grouped_local(x, w.half(), counts, 0)


def test_grouped_local_refuses_a_w_on_another_device():
    x, w, counts = _operands()
    with pytest.raises(errors.DeviceMismatchError, match="W is on meta"):
        gpu.grouped_local(x, w.to("meta"), counts, 0)


def test_grouped_weight_grad_refuses_counts_with_a_column_count_other_than_the_groups():
    x, _, counts = _operands()
    with pytest.raises(errors.InvalidArgumentError, match=r"counts must be \[sources, 2\]"):
        gpu.grouped_weight_grad(x, torch.zeros(ROWS, N), counts, 2, torch.float32)


def test_grouped_weight_grad_refuses_a_dy_of_another_dtype():
    x, _, counts = _operands()
    with pytest.raises(errors.DTypeError, match="dY is torch.float16"):
        gpu.grouped_weight_grad(x, torch.zeros(ROWS, N, dtype=torch.float16), counts, GROUPS,
                                torch.float32)
