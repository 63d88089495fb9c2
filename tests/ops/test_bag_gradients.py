"""The EmbeddingBag gradient of the fused embedding's backward (rocmoe.ops.products), packed
(FBGEMM's table-batched layout: EmbeddingAllToAll.batched) and per table, against torch's
own autograd of F.embedding_bag. One process, no communication."""

import pytest
import torch
import torch.nn.functional as F

from rocmoe.ops import products
from rocmoe.ops.products import bag_gradients, packed_bag_gradients

ROWS = [7, 3, 5]  # three tables, stacked into one 15-row weight
BATCH, DIM = 4, 6


def _packed_case(seed: int):
    """weight [15, 6], table-local indices, offsets [3 * 4 + 1] (with empty bags), per-sample
    weights, the bags' gradient [12, 6] and the device table starts."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(sum(ROWS), DIM, generator=g)
    lengths = torch.randint(0, 4, (len(ROWS) * BATCH,), generator=g)
    lengths[1] = 0
    table_of_bag = torch.arange(len(ROWS)).repeat_interleave(BATCH)
    idx = torch.cat([torch.randint(0, ROWS[t], (int(n),), generator=g)
                     for t, n in zip(table_of_bag.tolist(), lengths.tolist())])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    psw = torch.rand(idx.numel(), generator=g)
    g_bags = torch.randn(len(ROWS) * BATCH, DIM, generator=g)
    row_base = torch.tensor([0] + torch.tensor(ROWS).cumsum(0).tolist())
    return weight, idx, offsets, psw, g_bags, row_base, table_of_bag


def _torch_grads(weight, idx, offsets, psw, g_bags, row_base, table_of_bag, mode):
    """Autograd of one F.embedding_bag over global row numbers (the stacked tables)."""
    bag = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())
    global_idx = idx + row_base[table_of_bag[bag]]
    w = weight.clone().requires_grad_(True)
    p = psw.clone().requires_grad_(True) if mode == "psw" else None
    out = F.embedding_bag(global_idx, w, offsets, mode="mean" if mode == "mean" else "sum",
                          per_sample_weights=p, include_last_offset=True)
    out.backward(g_bags)
    return w.grad, None if p is None else p.grad


@pytest.mark.parametrize("mode", ["sum", "mean", "psw"])
def test_packed_bag_gradients_equal_torch_autograd_of_the_stacked_tables(mode):
    weight, idx, offsets, psw, g_bags, row_base, tob = _packed_case(1)
    want_w, want_p = _torch_grads(weight, idx, offsets, psw, g_bags, row_base, tob, mode)
    got_w, got_p = packed_bag_gradients(
        weight.shape, weight.dtype, row_base, idx, offsets, psw if mode == "psw" else None,
        weight, g_bags, "mean" if mode == "mean" else "sum", BATCH)
    torch.testing.assert_close(got_w, want_w)
    if mode == "psw":
        torch.testing.assert_close(got_p, want_p)


def test_packed_bag_gradients_in_pieces_equal_one_piece(monkeypatch):
    weight, idx, offsets, psw, g_bags, row_base, _ = _packed_case(2)
    whole = packed_bag_gradients(weight.shape, weight.dtype, row_base, idx, offsets, psw,
                                 weight, g_bags, "sum", BATCH)
    monkeypatch.setattr(products, "_GRAD_PIECE", 5)  # bags straddle the pieces
    pieces = packed_bag_gradients(weight.shape, weight.dtype, row_base, idx, offsets, psw,
                                  weight, g_bags, "sum", BATCH)
    torch.testing.assert_close(pieces[0], whole[0])
    torch.testing.assert_close(pieces[1], whole[1])


def test_an_index_outside_its_table_adds_nothing_instead_of_faulting():
    weight, idx, offsets, _, g_bags, row_base, tob = _packed_case(3)
    want, _ = _torch_grads(weight, idx, offsets, None, g_bags, row_base, tob, "sum")
    bad = idx.clone()
    last_bag = len(offsets) - 2  # table 2's last bag; its index points past table 2
    bad[int(offsets[last_bag])] = ROWS[2]
    got, _ = packed_bag_gradients(weight.shape, weight.dtype, row_base, bad, offsets, None,
                                  weight, g_bags, "sum", BATCH)
    row = int(row_base[2] + idx[int(offsets[last_bag])])
    want[row] -= g_bags[last_bag]  # the good lookup's contribution, dropped
    torch.testing.assert_close(got, want)


def test_per_table_bag_gradients_equal_the_packed_ones_of_the_same_lookups():
    weight, idx, offsets, psw, g_bags, row_base, _ = _packed_case(4)
    tables = list(weight.split(ROWS))
    cuts = offsets[::BATCH].tolist()
    per_idx = [idx[cuts[t]:cuts[t + 1]] for t in range(len(ROWS))]
    per_off = [offsets[t * BATCH:(t + 1) * BATCH] - cuts[t] for t in range(len(ROWS))]
    per_psw = [psw[cuts[t]:cuts[t + 1]] for t in range(len(ROWS))]
    shapes = [(tuple(t.shape), t.dtype) for t in tables]
    w_grads, p_grads = bag_gradients(shapes, per_idx, per_off, per_psw, tables,
                                     g_bags.reshape(len(ROWS), BATCH, DIM), "sum")
    want_w, want_p = packed_bag_gradients(weight.shape, weight.dtype, row_base, idx, offsets,
                                          psw, weight, g_bags, "sum", BATCH)
    torch.testing.assert_close(torch.cat(w_grads), want_w)
    torch.testing.assert_close(torch.cat(p_grads), want_p)
