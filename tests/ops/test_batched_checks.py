"""EmbeddingAllToAll.batched (the packed tables) names what is wrong with its arguments
before anything is sent, and the handle keeps working after. One host rank, two tables of
5 rows; the same refusals on one bad rank of several raise on every rank
(tests/ops/handles_script.py)."""

from __future__ import annotations

import pytest
import torch

from rocmoe import errors, ops

BATCH = 4


@pytest.fixture
def emb(ctx):
    h = ops.EmbeddingAllToAll(ctx, [5, 5], dim=4, max_batch=BATCH, max_lookups=4)
    yield h
    h.close()


def _packed():
    """weight [10, 4]; one index a bag in each table; offsets [2 * BATCH + 1]."""
    weight = torch.randn(10, 4)
    indices = torch.tensor([0, 1, 2, 3, 4, 3, 2, 1])
    offsets = torch.arange(2 * BATCH + 1)
    return weight, indices, offsets


def test_float_indices_are_named(emb):
    weight, indices, offsets = _packed()
    with pytest.raises(errors.DTypeError, match="indices are torch.float32; use int32 or int64"):
        emb.batched(weight, indices.float(), offsets)


def test_more_indices_than_the_tables_take_are_counted(emb):
    weight, _, _ = _packed()
    indices = torch.zeros(9, dtype=torch.int64)
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 9])
    with pytest.raises(errors.InvalidArgumentError, match="9 indices; the handle takes at most"):
        emb.batched(weight, indices, offsets)


def test_a_batch_other_than_the_offsets_hold_is_named(emb):
    with pytest.raises(errors.InvalidArgumentError,
                       match="batch=2, but the offsets hold 4 bags per table"):
        emb.batched(*_packed(), batch=2)


def test_per_sample_weights_of_the_wrong_length_are_refused(emb):
    weight, indices, offsets = _packed()
    with pytest.raises(errors.InvalidArgumentError, match="one floating-point weight per index"):
        emb.batched(weight, indices, offsets, per_sample_weights=torch.ones(7))


def test_integer_per_sample_weights_are_refused(emb):
    weight, indices, offsets = _packed()
    with pytest.raises(errors.InvalidArgumentError, match="one floating-point weight per index"):
        emb.batched(weight, indices, offsets,
                    per_sample_weights=torch.ones(8, dtype=torch.int64))


def test_offsets_that_decrease_are_refused(emb):
    weight, indices, _ = _packed()
    offsets = torch.tensor([0, 1, 2, 4, 3, 5, 6, 7, 8])
    with pytest.raises(errors.InvalidArgumentError, match="not decrease"):
        emb.batched(weight, indices, offsets)


def test_offsets_past_the_indices_are_refused(emb):
    weight, indices, offsets = _packed()
    with pytest.raises(errors.InvalidArgumentError, match="stay within the 8 indices"):
        emb.batched(weight, indices, offsets + 1)


def test_the_handle_works_after_refusing_a_call(emb):
    weight, indices, offsets = _packed()
    with pytest.raises(errors.InvalidArgumentError):
        emb.batched(weight, indices, offsets + 1)
    got = emb.batched(weight, indices, offsets)
    # one index a bag: bag b of table t is row indices[t * BATCH + b] of table t
    want = torch.stack([weight[indices[:BATCH]], weight[5 + indices[BATCH:]]], dim=1)
    torch.testing.assert_close(got, want)

