"""EmbeddingAllToAll takes a table's lookups stacked: `indices` [num_tables, L] and `offsets`
[num_tables, B] whose row t is table t's (dlrm's lS_i and lS_o for Criteo data), with the
result, and the gradient, of the same rows passed as lists. One host rank; the GPU's one-pass
writer for stacked lookups is checked in test_table_embedding_launch.py."""

from __future__ import annotations

import pytest
import torch

from rocmoe import errors, ops

ROWS, DIM, BATCH, LOOKUPS = (10, 7, 12), 4, 4, 6


def _lookups(seed=0):
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randn(r, DIM, generator=g) for r in ROWS]
    indices = torch.stack([torch.randint(0, r, (LOOKUPS,), generator=g) for r in ROWS])
    offsets = torch.tensor([0, 1, 1, 4]).repeat(len(ROWS), 1)  # an empty bag in each table
    return tables, indices, offsets


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_handle_gives_stacked_lookups_the_result_of_their_rows_as_lists(ctx, mode):
    tables, indices, offsets = _lookups()
    handle = ops.EmbeddingAllToAll(ctx, ROWS, DIM, BATCH, LOOKUPS, mode)
    with torch.no_grad():
        listed = handle(tables, list(indices), list(offsets)).clone()
        stacked = handle(tables, indices, offsets).clone()
    handle.close()
    assert stacked.shape == (BATCH, len(ROWS), DIM)
    assert torch.equal(stacked, listed)


def test_the_gradient_of_stacked_lookups_is_the_gradient_of_their_rows_as_lists(ctx):
    tables, indices, offsets = _lookups(1)
    handle = ops.EmbeddingAllToAll(ctx, ROWS, DIM, BATCH, LOOKUPS, "sum")
    grads = []
    for idx, off in ((list(indices), list(offsets)), (indices, offsets)):
        leaves = [t.clone().requires_grad_() for t in tables]
        out = handle(leaves, idx, off)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    handle.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert any(g.abs().sum() > 0 for g in grads[1])


def test_the_functional_op_takes_stacked_lookups(ctx):
    tables, indices, offsets = _lookups(2)
    listed = ops.embedding_all_to_all(tables, list(indices), list(offsets))
    assert torch.equal(ops.embedding_all_to_all(tables, indices, offsets), listed)


@pytest.mark.parametrize("what", ["indices", "offsets"])
def test_lookups_in_a_one_dimensional_tensor_are_named(ctx, what):
    tables, indices, offsets = _lookups()
    handle = ops.EmbeddingAllToAll(ctx, ROWS, DIM, BATCH, LOOKUPS, "sum")
    args = {"indices": indices, "offsets": offsets}
    args[what] = args[what].reshape(-1)
    with pytest.raises(errors.InvalidArgumentError, match=f"{what} is a 1-D tensor"):
        handle(tables, args["indices"], args["offsets"])
    # the handle is still usable after the rejected call
    assert handle(tables, indices, offsets).shape == (BATCH, len(ROWS), DIM)
    handle.close()


def test_stacked_lookups_of_the_wrong_number_of_tables_are_named(ctx):
    tables, indices, offsets = _lookups()
    handle = ops.EmbeddingAllToAll(ctx, ROWS, DIM, BATCH, LOOKUPS, "sum")
    with pytest.raises(errors.InvalidArgumentError, match="3 tables here; got 3 tables, 2 index"):
        handle(tables, indices[:2], offsets)
    handle.close()


def _spy_repeat(monkeypatch, answer):
    """Replaces the functional op's repeat path (a GPU-only path at world size 1) with a spy
    that records what it was handed and returns `answer`."""
    from rocmoe.ops import _kernels
    seen = []

    def spy(ctx_, weights, indices, offsets, mode):
        seen.append((indices, offsets))
        return answer
    monkeypatch.setattr(_kernels, "_embedding_repeat", spy)
    return seen


def test_the_functional_op_hands_stacked_lookups_to_its_repeat_path_unsplit(ctx, monkeypatch):
    out = torch.zeros(1)
    seen = _spy_repeat(monkeypatch, (out, []))
    tables, indices, offsets = _lookups()
    with torch.no_grad():
        assert ops.embedding_all_to_all(tables, indices, offsets) is out
    assert len(seen) == 1 and seen[0][0] is indices and seen[0][1] is offsets


def test_stacked_lookups_the_repeat_path_declines_take_the_general_path_as_rows(ctx,
                                                                                 monkeypatch):
    tables, indices, offsets = _lookups(3)
    want = ops.embedding_all_to_all(tables, list(indices), list(offsets))
    seen = _spy_repeat(monkeypatch, None)
    with torch.no_grad():
        got = ops.embedding_all_to_all(tables, indices, offsets)
    assert torch.equal(got, want)
    assert seen[0][0] is indices  # offered stacked first, then as rows
    assert all(isinstance(x, list) for x in seen[1])
