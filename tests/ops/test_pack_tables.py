"""rocmoe.ops.pack_tables: per-table EmbeddingBag inputs -> EmbeddingAllToAll.batched's packed
layout, and the host backend's split back (handles._split_packed) as its inverse."""

import pytest
import torch

from rocmoe import errors
from rocmoe.ops import pack_lookups, pack_tables
from rocmoe.ops.handles.embedding import _split_packed


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


def _stacked_lookups():
    indices = torch.tensor([[0, 3, 1, 2], [1, 0, 0, 1], [5, 5, 4, 0]])   # [T=3, L=4]
    offsets = torch.tensor([[0, 0, 2], [0, 1, 3], [0, 2, 2]])           # [T, B=3]
    return indices, offsets


def test_pack_lookups_packs_stacked_lookups_as_it_packs_their_rows():
    indices, offsets = _stacked_lookups()
    got = pack_lookups(indices, offsets)
    want = pack_lookups(list(indices), list(offsets))
    assert got[1].tolist() == [0, 0, 2, 4, 5, 7, 8, 10, 10, 12]       # t * L added, the end
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_pack_lookups_of_row_strided_stacked_indices_equals_their_rows():
    indices, offsets = _stacked_lookups()
    wide = torch.cat([indices, torch.full((3, 2), 9)], 1)[:, :4]       # rows 6 apart
    got = pack_lookups(wide, offsets)
    want = pack_lookups(list(indices), list(offsets))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_pack_lookups_of_no_stacked_tables_is_nothing():
    assert pack_lookups(torch.zeros(0, 4, dtype=torch.long),
                        torch.zeros(0, 3, dtype=torch.long)) == (None, None)


def test_stacked_lookups_of_unequal_tables_are_named():
    indices, offsets = _stacked_lookups()
    with pytest.raises(errors.InvalidArgumentError, match=r"\[tables, L\] indices"):
        pack_lookups(indices[:2], offsets)


def _aten_ops_of(fn) -> int:
    """How many aten ops (on a GPU: launches or copies) a call of fn runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def test_pack_lookups_of_listed_tables_runs_as_many_ops_for_26_tables_as_for_2():
    def listed(tables):
        g = torch.Generator().manual_seed(tables)
        indices = [torch.randint(0, 9, (int(n),), generator=g)
                   for n in torch.randint(1, 7, (tables,), generator=g)]
        offsets = [torch.tensor([0, i.numel() // 2, i.numel()]) for i in indices]
        return indices, offsets

    two, many = listed(2), listed(26)
    assert _aten_ops_of(lambda: pack_lookups(*many)) == _aten_ops_of(lambda: pack_lookups(*two))


def test_pack_lookups_of_offsets_of_unequal_lengths_shifts_each_table_by_its_start():
    indices = [torch.tensor([0, 3, 1]), torch.tensor([1, 0])]
    offsets = [torch.tensor([0, 2]), torch.tensor([0, 1, 1], dtype=torch.int32)]
    idx, off = pack_lookups(indices, offsets)
    assert idx.tolist() == [0, 3, 1, 1, 0]
    assert off.tolist() == [0, 2, 3, 4, 4, 5]
