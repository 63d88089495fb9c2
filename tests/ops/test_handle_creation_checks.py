"""A handle's creation refuses sizes that are not integers with a RocmoeError naming them,
and the heap keeps what it had (converting them with int() raised a TypeError on that rank
alone, or took K=4.5 as 4, while the other ranks waited in the creation's exchange). One
host rank; tests/ops/handles_script.py makes one rank of several pass them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rocmoe import errors, ops


@pytest.mark.parametrize("make", [
    lambda ctx: ops.GemmAllToAll(ctx, max_rows=8, K=4.5, N=5, dtype=torch.float32),
    lambda ctx: ops.GemmAllToAll(ctx, max_rows=None, K=4, N=5, dtype=torch.float32),
    lambda ctx: ops.AllToAllRows(ctx, "8", 5, torch.float32),
    lambda ctx: ops.GemvAllReduce(ctx, 6, None, torch.float32),
], ids=["GEMM K=4.5", "GEMM max_rows=None", "rows max_rows='8'", "GEMV K_local=None"])
def test_a_handle_size_that_is_not_an_integer_is_named(ctx, make):
    free = ctx.heap.free_bytes
    with pytest.raises(errors.InvalidArgumentError, match="must be an integer, got"):
        make(ctx)
    assert ctx.heap.free_bytes == free


def test_handle_sizes_may_be_numpy_or_torch_integers(ctx):
    h = ops.GemmAllToAll(ctx, max_rows=np.int64(8), K=torch.tensor(4), N=np.int32(5),
                         dtype=torch.float32)
    assert (h.max_rows, h.K, h.N) == (8, 4, 5) and all(
        type(v) is int for v in (h.max_rows, h.K, h.N))
    h.close()


@pytest.mark.parametrize("table_rows", [5, None, [5, "a"], [5, 2.5]],
                         ids=["an int", "None", "a string row", "a float row"])
def test_table_rows_that_are_not_a_list_of_integers_are_named(ctx, table_rows):
    free = ctx.heap.free_bytes
    with pytest.raises(errors.InvalidArgumentError, match="table_rows.* must be a"):
        ops.EmbeddingAllToAll(ctx, table_rows, dim=4, max_batch=4, max_lookups=4)
    assert ctx.heap.free_bytes == free
