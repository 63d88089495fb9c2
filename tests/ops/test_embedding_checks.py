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


def test_indices_that_are_not_tensors_are_named(ctx):
    tables, indices, offsets = _lookups()
    indices[1] = [1, 2, 3, 4]
    with pytest.raises(errors.InvalidArgumentError, match="indices must be a list of tensors"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_tables_that_are_not_a_sequence_are_named(ctx):
    _, indices, offsets = _lookups()
    with pytest.raises(errors.InvalidArgumentError, match="weights must be a list of tensors"):
        ops.embedding_all_to_all(None, indices, offsets)


def test_fewer_index_tensors_than_tables_are_counted(ctx):
    tables, indices, offsets = _lookups()
    with pytest.raises(errors.InvalidArgumentError, match="3 tables but 2 index and 3 offset"):
        ops.embedding_all_to_all(tables, indices[:2], offsets)


def test_a_table_that_is_not_2d_is_named(ctx):
    tables, indices, offsets = _lookups()
    tables[0] = torch.randn(10)
    with pytest.raises(errors.InvalidArgumentError, match=r"table 0 has shape \(10,\)"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_2d_indices_in_a_list_are_named(ctx):
    tables, indices, offsets = _lookups()
    indices[0] = indices[0].reshape(2, 2)
    with pytest.raises(errors.InvalidArgumentError, match="table 0: indices and offsets are 1-D"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_tables_of_different_dims_are_named(ctx):
    tables, indices, offsets = _lookups()
    tables[2] = torch.randn(10, 5)
    with pytest.raises(errors.InvalidArgumentError, match="table 2 is .10, 5.*same dim"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_offsets_that_decrease_after_starting_at_zero_are_named(ctx):
    tables, indices, _ = _lookups()
    offsets = [torch.tensor([0, 3, 2])] * 3
    with pytest.raises(errors.InvalidArgumentError, match="table 0: offsets decrease"):
        ops.embedding_all_to_all(tables, indices, offsets)


def test_per_sample_weights_not_one_a_table_are_counted(ctx):
    tables, indices, offsets = _lookups()
    with pytest.raises(errors.InvalidArgumentError, match="one tensor per table .3."):
        ops.embedding_all_to_all(tables, indices, offsets, per_sample_weights=[torch.ones(4)])


def test_per_sample_weights_of_the_wrong_length_are_named(ctx):
    tables, indices, offsets = _lookups()
    psw = [torch.ones(4), torch.ones(3), torch.ones(4)]
    with pytest.raises(errors.InvalidArgumentError, match="per_sample_weights of table 1 must"):
        ops.embedding_all_to_all(tables, indices, offsets, per_sample_weights=psw)


def test_integer_per_sample_weights_are_named(ctx):
    tables, indices, offsets = _lookups()
    psw = [torch.ones(4, dtype=torch.int64)] * 3
    with pytest.raises(errors.DTypeError, match="per_sample_weights of table 0 must be floating"):
        ops.embedding_all_to_all(tables, indices, offsets, per_sample_weights=psw)


def test_a_call_without_any_table_is_refused(ctx):
    with pytest.raises(errors.InvalidArgumentError, match="no rank has any table"):
        ops.embedding_all_to_all([], [], [])
