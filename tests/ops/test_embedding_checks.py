"""The functional embedding's local checks (rocmoe.ops._kernels._check_embedding) name the
table and the tensor that fails them. The per-table loop compares dtypes and devices first
and formats a message only for a table that fails (a message for every table cost about a
microsecond a table), so these pin the messages. One host rank."""

from __future__ import annotations

import pytest
import torch

from rocmoe import errors, ops


def _lookups(n_tables=3):
    tables = [torch.randn(10, 4) for _ in range(n_tables)]
    indices = [torch.tensor([1, 2, 3, 4]) for _ in range(n_tables)]
    offsets = [torch.tensor([0, 2]) for _ in range(n_tables)]
    return tables, indices, offsets


def test_a_table_of_an_integer_dtype_is_named(ctx):
    tables, indices, offsets = _lookups()
    tables[1] = tables[1].long()
    with pytest.raises(errors.DTypeError, match="table 1 has dtype torch.int64"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_float_offsets_are_named(ctx):
    tables, indices, offsets = _lookups()
    offsets[2] = offsets[2].float()
    with pytest.raises(errors.DTypeError, match="offsets of table 2 has dtype torch.float32"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_indices_on_another_device_are_named(ctx):
    tables, indices, offsets = _lookups()
    indices[0] = indices[0].to("meta")
    with pytest.raises(errors.DeviceMismatchError, match="indices of table 0 is on meta"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_int32_indices_and_offsets_pass_the_checks(ctx):
    tables, indices, offsets = _lookups()
    want = ops.embedding_all_to_all(tables, indices, offsets)
    got = ops.embedding_all_to_all(tables, [i.int() for i in indices],
                                   [o.int() for o in offsets])
    assert torch.equal(got, want)
