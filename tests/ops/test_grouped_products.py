"""The local algebra of grouped gemm_all_to_all (rocmoe.ops.products): rows ordered by
(destination, group), segment (d, g) multiplied by W[g]. No communication: these run in one
process and pin down what the host path and the backward compute."""

import torch

from rocmoe.ops.products import group_major, grouped_products, grouped_weight_grad

COUNTS = [[2, 0, 3], [1, 4, 0]]  # [destination][group]: 10 rows, one empty segment each


def _segments():
    """(first row, rows, group) of every segment, in row order."""
    out, at = [], 0
    for row in COUNTS:
        for g, n in enumerate(row):
            out.append((at, n, g))
            at += n
    return out


def test_group_major_lists_each_groups_rows_destination_by_destination():
    perm, sizes = group_major(COUNTS)
    assert sizes == [3, 4, 3]
    # group 0: rows 0-1 (dest 0) then row 5 (dest 1); group 1: rows 6-9; group 2: rows 2-4
    assert perm.tolist() == [0, 1, 5, 6, 7, 8, 9, 2, 3, 4]


def test_grouped_products_multiply_each_segment_by_its_groups_weight():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=g)
    w = torch.randn(3, 4, 5, generator=g)
    y = grouped_products(x, w, COUNTS)
    for first, n, grp in _segments():
        torch.testing.assert_close(y[first:first + n], x[first:first + n] @ w[grp])


def test_grouped_products_keep_the_input_dtype_and_accumulate_in_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 64, 8, generator=g).to(torch.bfloat16)
    y = grouped_products(x, w, COUNTS)
    assert y.dtype == torch.bfloat16
    for first, n, grp in _segments():
        want = (x[first:first + n].float() @ w[grp].float()).to(torch.bfloat16)
        assert torch.equal(y[first:first + n], want)


def test_grouped_weight_grad_equals_autograd_of_the_segment_products():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 4, generator=g)
    w = torch.randn(3, 4, 5, generator=g, requires_grad=True)
    gy = torch.randn(10, 5, generator=g)
    y = torch.cat([x[first:first + n] @ w[grp] for first, n, grp in _segments()])
    (y * gy).sum().backward()
    torch.testing.assert_close(grouped_weight_grad(x, gy, COUNTS), w.grad)


def test_a_group_without_rows_gets_a_zero_weight_gradient():
    x = torch.randn(5, 4)
    gy = torch.randn(5, 6)
    dw = grouped_weight_grad(x, gy, [[5, 0]])
    assert dw.shape == (2, 4, 6) and not dw[1].any()
