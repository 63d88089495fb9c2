"""The GEMV + AllReduce workspace holds what the one-shot kernel writes: every source's fp32
partial of every row ([world][N] floats) before the result, in each receive buffer (the
kernel stores at partials[source * N + row] of every rank's buffer: a smaller region would
overrun into the result and the other buffer)."""

import pytest
import torch

from rocmoe.ops._common import DTYPE_CODES
from rocmoe.ops.layout import make_layout


@pytest.mark.parametrize("world,n", [(1, 1), (2, 229), (3, 2500), (8, 16384), (64, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_receive_buffer_holds_every_sources_partials_then_the_result(world, n, dtype):
    layout = make_layout("gemv_all_reduce", world, DTYPE_CODES[dtype], n)
    assert layout.gather_offset >= world * n * 4
    assert layout.parity_bytes >= layout.gather_offset + n * dtype.itemsize
