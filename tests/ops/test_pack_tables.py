"""rocmoe.ops.pack_tables: per-table EmbeddingBag inputs -> EmbeddingAllToAll.batched's packed
layout, and the host backend's split back (handles._split_packed) as its inverse."""

import torch

from rocmoe.ops import pack_tables
from rocmoe.ops.handles import _split_packed


def _inputs():
    tables = [torch.randn(4, 3), torch.randn(2, 3)]
    indices = [torch.tensor([0, 3, 1]), torch.tensor([1, 0, 0, 1])]
    offsets = [torch.tensor([0, 0, 2]), torch.tensor([0, 1, 3])]  # B = 3, empty bags too
    psw = [torch.rand(3), torch.rand(4)]
    return tables, indices, offsets, psw


def test_pack_tables_stacks_tables_and_makes_offsets_absolute_with_the_end():
    tables, indices, offsets, psw = _inputs()
    weight, idx, off, p = pack_tables(tables, indices, offsets, psw)
    assert torch.equal(weight, torch.cat(tables))
    assert idx.tolist() == [0, 3, 1, 1, 0, 0, 1]           # table-local, table after table
    assert off.tolist() == [0, 0, 2, 3, 4, 6, 7]            # [T * B + 1], absolute
    assert torch.equal(p, torch.cat(psw))


def test_split_packed_gives_back_what_pack_tables_packed():
    tables, indices, offsets, psw = _inputs()
    weights, idx, off, p = _split_packed([4, 2], *pack_tables(tables, indices, offsets, psw), 3)
    for got, want in zip((weights, idx, off, p), (tables, indices, offsets, psw)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def test_no_tables_pack_to_nothing():
    assert pack_tables([], [], []) == (None, None, None, None)
