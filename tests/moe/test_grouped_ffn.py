"""The expert-parallel FFN on torch._grouped_mm (rocmoe/moe/grouped_ffn.py): the regrouping of
source-major arrivals, and the FFN against a row-by-row reference, values and gradients."""

import pytest
import torch

from rocmoe.moe import grouped_ffn as gf
from rocmoe.moe.activations import ACTIVATIONS


def _segments(counts):
    """(source, group) of every arrived row, source-major."""
    return [(s, g) for s in range(counts.shape[0]) for g in range(counts.shape[1])
            for _ in range(int(counts[s, g]))]


def test_group_major_positions_sort_the_arrivals_by_group_then_source():
    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])
    pos = gf.group_major_positions(counts, rows=13)  # 10 arrived, 3 past them
    assert sorted(pos.tolist()) == list(range(13))
    seg = _segments(counts)
    by_position = sorted(range(10), key=lambda i: pos[i].item())
    # group-major order, and within a group the sources in turn, each in arrival order
    assert [(seg[i][1], seg[i][0]) for i in by_position] == sorted((g, s) for s, g in seg)
    assert by_position == sorted(range(10), key=lambda i: (seg[i][1], seg[i][0], i))
    assert pos[10:].tolist() == [10, 11, 12]
    # the host form's permutation (group-major position -> source-major row) is its inverse
    from rocmoe.ops.products import group_major
    perm, sizes = group_major(counts.tolist())
    assert [pos[int(i)].item() for i in perm] == list(range(10)) and sizes == [3, 4, 3]


def test_group_major_positions_with_no_arrivals_is_the_identity():
    assert gf.group_major_positions(torch.zeros(2, 3, dtype=torch.int64), 4).tolist() == \
        [0, 1, 2, 3]


@pytest.mark.parametrize("glu", [False, True])
def test_source_major_ffn_equals_each_row_through_its_groups_ffn(glu):
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([[3, 0, 2, 1], [0, 2, 2, 0], [1, 1, 0, 3]])
    arrived, rows, hidden, ffn = int(counts.sum()), int(counts.sum()) + 5, 8, 16
    x = torch.randn(rows, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    w1 = torch.randn(4, hidden, ffn, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(4, ffn, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    w3 = torch.randn(4, hidden, ffn, dtype=torch.float64, generator=g,
                     requires_grad=True) if glu else None
    act = ACTIVATIONS["gelu"]
    y = gf.source_major_ffn(x, counts, w1, w2, w3, act)
    groups = [grp for _, grp in _segments(counts)]
    ref = []
    for i, grp in enumerate(groups):
        h = act(x[i] @ w1[grp])
        if glu:
            h = h * (x[i] @ w3[grp])
        ref.append(h @ w2[grp])
    ref = torch.stack(ref)
    assert torch.allclose(y[:arrived], ref, atol=1e-12, rtol=1e-12)
    gy = torch.randn(rows, hidden, dtype=torch.float64, generator=g)
    gy[arrived:] = 0  # what the exchange back does with the rows past the arrivals
    params = [x, w1, w2] + ([w3] if glu else [])
    got = torch.autograd.grad((y * gy).sum(), params)
    want = torch.autograd.grad((ref * gy[:arrived]).sum(), params)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-12)


def test_group_major_products_loop_leaves_rows_of_no_group_zero():
    x = torch.ones(5, 4, dtype=torch.float64)
    w = torch.ones(2, 4, 3, dtype=torch.float64)
    y = gf.group_major_products(x, w, torch.tensor([1, 2]))
    if not gf.uses_grouped_mm(x):
        assert y[3:].abs().sum() == 0
    assert torch.equal(y[:3], torch.full((3, 3), 4.0, dtype=torch.float64))
