"""rocmoe.ops.gemm_all_to_all's repeat path at world size 1 (rocmoe.ops._kernels.gemm_repeat):
a call outside autograd whose counts are a list goes straight to the cached handle's lean
call; counts the lean call declines (not plain ints) reach it again converted; a call that
autograd takes part in is recorded by the custom op, whose forward takes the repeat. On a
GPU the cached handle is a real GemmAllToAll (its lean call: tests/ops_gpu/
fused_gpu_script.py, check_lean and check_function_rows); here a stand-in takes its place,
so what is specified is the dispatch, not the product."""

import types

import numpy as np
import pytest
import torch

from rocmoe import ops
from rocmoe.ops import _kernels

ROWS, K, N = 6, 4, 3


@pytest.fixture
def lean_calls(ctx):
    """The counts of every call of a stand-in lean call, which takes plain int counts only
    (as gpu.lean_gemm_call does) and returns a kept [ROWS, N] output."""
    calls, kept = [], (torch.full((ROWS, N), 7.0), torch.tensor([ROWS]))

    def lean(x, w, counts, exact=False):
        calls.append(list(counts))
        if any(type(c) is not int for c in counts):
            return None
        return kept

    _kernels._GEMM_LAST[ctx] = types.SimpleNamespace(workspace=1, _lean=lean)
    try:
        yield calls
    finally:
        _kernels._GEMM_LAST.pop(ctx, None)


def test_a_list_count_call_without_grad_returns_the_lean_calls_output(ctx, lean_calls):
    x, w = torch.randn(ROWS, K), torch.randn(K, N)
    with torch.no_grad():
        y = ops.gemm_all_to_all(x, w, [ROWS], ctx=ctx)
    assert lean_calls == [[ROWS]]
    assert torch.equal(y, torch.full((ROWS, N), 7.0))


def test_counts_the_lean_call_declines_reach_it_again_as_plain_ints(ctx, lean_calls):
    x, w = torch.randn(ROWS, K), torch.randn(K, N)
    with torch.no_grad():
        y = ops.gemm_all_to_all(x, w, [np.int64(ROWS)], ctx=ctx)
    assert len(lean_calls) == 2 and all(type(c) is int for c in lean_calls[1]), lean_calls
    assert torch.equal(y, torch.full((ROWS, N), 7.0))


def test_a_call_autograd_takes_part_in_is_recorded_by_the_custom_op_around_the_repeat(
        ctx, lean_calls):
    # the op's forward runs without grad inside the custom op, and takes the repeat there;
    # autograd records the op itself, and the backward computes dX from dY and W
    x, w = torch.randn(ROWS, K, requires_grad=True), torch.randn(K, N)
    y = ops.gemm_all_to_all(x, w, [ROWS], ctx=ctx)
    assert lean_calls == [[ROWS]] and y.grad_fn is not None
    assert torch.equal(y.detach(), torch.full((ROWS, N), 7.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(ROWS, N) @ w.t())


def test_plain_int_counts_the_lean_call_declines_are_offered_to_it_once(ctx):
    # a lean call that takes nothing (another shape than its handle's, say): the general
    # path computes the call, and the same plain ints are not offered a second time
    calls = []

    def declining(x, w, counts, exact=False):
        calls.append(list(counts))
        return None

    _kernels._GEMM_LAST[ctx] = types.SimpleNamespace(workspace=1, _lean=declining)
    try:
        x, w = torch.randn(ROWS, K), torch.randn(K, N)
        with torch.no_grad():
            y = ops.gemm_all_to_all(x, w, [ROWS], ctx=ctx)
    finally:
        _kernels._GEMM_LAST.pop(ctx, None)
    assert calls == [[ROWS]]
    torch.testing.assert_close(y, x @ w)
