"""rocmoe.ops' functions take the custom op (torch.ops.rocmoe.*) only where autograd or a
tracer needs it. An eager call with grad mode off runs the op's implementation itself
(rocmoe.ops._kernels; the custom op's dispatch cost 23-44 us of host time a call on the CI
host), with the same result and the same errors; with grad mode on, under a torch-dispatch
mode or inside a torch.func transform, the call takes the custom op as before. The GEMM's
implementation launches through its cached handle's lean call where the handle has one (GPU
handles after their first call), and through the general path where that declines. One
host rank (world size 1)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rocmoe import errors, ops
from rocmoe.ops import _kernels

OPS = ("gemm_all_to_all", "gemv_all_reduce", "embedding_all_to_all")


@pytest.fixture
def dispatched(monkeypatch):
    """How often each torch.ops.rocmoe.<op> was called (the op still runs)."""
    counts = dict.fromkeys(OPS, 0)
    for name in OPS:
        op = getattr(torch.ops.rocmoe, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            counts[_name] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(torch.ops.rocmoe, name, counted)
    return counts


def _call(name: str):
    """One call of the function `name` and what torch computes for it."""
    g = torch.Generator().manual_seed(3)
    if name == "gemm_all_to_all":
        x, w = torch.randn(6, 8, generator=g), torch.randn(8, 5, generator=g)
        return ops.gemm_all_to_all(x, w, [6]), x @ w
    if name == "gemv_all_reduce":
        w, x = torch.randn(7, 4, generator=g), torch.randn(4, generator=g)
        return ops.gemv_all_reduce(w, x), w @ x
    tables = [torch.randn(9, 4, generator=g), torch.randn(5, 4, generator=g)]
    idx = [torch.tensor([0, 3, 8, 1]), torch.tensor([4, 2, 2])]
    off = [torch.tensor([0, 2]), torch.tensor([0, 1])]
    want = torch.stack([torch.nn.functional.embedding_bag(i, t, o, mode="sum")
                        for t, i, o in zip(tables, idx, off)], dim=1)
    return ops.embedding_all_to_all(tables, idx, off), want


class _Recorder(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", OPS)
def test_a_no_grad_call_runs_the_implementation_without_the_custom_op(ctx, dispatched, name):
    with torch.no_grad():
        got, want = _call(name)
    assert dispatched[name] == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_a_call_with_grad_mode_on_takes_the_custom_op(ctx, dispatched, name):
    _call(name)
    assert dispatched[name] == 1


@pytest.mark.parametrize("name", OPS)
def test_a_no_grad_call_under_a_dispatch_mode_takes_the_custom_op(ctx, name):
    mode = _Recorder()
    with torch.no_grad(), mode:
        got, want = _call(name)
    assert f"rocmoe::{name}" in mode.seen, mode.seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_a_no_grad_call_gives_what_the_custom_op_gives(ctx, name):
    with torch.no_grad():
        direct, _ = _call(name)
    through_op, _ = _call(name)
    assert torch.equal(direct, through_op.detach())


def test_bad_input_raises_the_same_error_with_grad_mode_on_or_off(ctx):
    x, w = torch.randn(6, 8), torch.randn(8, 5)
    with pytest.raises(errors.InvalidArgumentError, match="sum to 7"):
        ops.gemm_all_to_all(x, w, [7])
    with torch.no_grad(), pytest.raises(errors.InvalidArgumentError, match="sum to 7"):
        ops.gemm_all_to_all(x, w, [7])
    with torch.no_grad():  # and the next call is right
        torch.testing.assert_close(ops.gemm_all_to_all(x, w, [6]), x @ w)


def _gemm_handle(ctx):
    (handle,) = [h for key, h in _kernels._CACHE[ctx].items() if key[0] == "gemm"]
    return handle


def test_the_gemm_launches_through_its_handles_lean_call_when_it_has_one(ctx):
    x, w = torch.randn(6, 8), torch.randn(8, 5)
    with torch.no_grad():
        ops.gemm_all_to_all(x, w, [6])
        handle = _gemm_handle(ctx)
        rows = torch.arange(float(handle.capacity_rows * 5)).view(-1, 5)
        seen = []
        handle._lean = lambda *args: seen.append(args) or (rows, torch.tensor([6]))
        got = ops.gemm_all_to_all(x, w, [6])
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1] is w and seen[0][2] == [6]
    assert torch.equal(got, rows[:6])  # the lean call's rows, cut to the rows received


def test_the_gemm_takes_the_general_path_where_the_lean_call_declines(ctx):
    x, w = torch.randn(6, 8), torch.randn(8, 5)
    with torch.no_grad():
        ops.gemm_all_to_all(x, w, [6])
        declined = []
        _gemm_handle(ctx)._lean = lambda *args: declined.append(args)  # None: declined
        got = ops.gemm_all_to_all(x, w, [6])
    assert len(declined) == 1
    torch.testing.assert_close(got, x @ w)


def test_a_no_grad_call_inside_vmap_takes_the_custom_op(ctx, dispatched):
    # vmap's batched tensors are plain torch.Tensor objects: the transform, not the type,
    # says the call is not a plain eager one; the custom op runs through vmap's fallback (one
    # call a batch element), where the implementation itself could not read their storage
    x, w = torch.randn(2, 6, 8), torch.randn(8, 5)
    with torch.no_grad():
        got = torch.vmap(lambda xi: ops.gemm_all_to_all(xi, w, [6]))(x)
    assert dispatched["gemm_all_to_all"] == 1
    torch.testing.assert_close(got, x @ w)


def test_a_no_grad_call_with_parameters_runs_the_implementation_directly(ctx, dispatched):
    # a model's weights are nn.Parameters: under no_grad (inference) they take the direct path
    x = torch.randn(6, 8)
    w = torch.nn.Parameter(torch.randn(8, 5))
    with torch.no_grad():
        got = ops.gemm_all_to_all(x, w, [6])
    assert dispatched["gemm_all_to_all"] == 0
    torch.testing.assert_close(got, x @ w)


def test_a_no_grad_call_with_another_tensor_subclass_takes_the_custom_op(ctx, dispatched):
    # a subclass that turns __torch_function__ off (as __torch_dispatch__ subclasses such as
    # FakeTensor do) is not seen by has_torch_function: its type alone sends it to the op
    class Quiet(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl
    x, w = torch.randn(6, 8), torch.randn(8, 5).as_subclass(Quiet)
    with torch.no_grad():
        ops.gemm_all_to_all(x, w, [6])
    assert dispatched["gemm_all_to_all"] == 1


class _FunctionRecorder(torch.overrides.TorchFunctionMode):
    """A torch-function mode that lets every call through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", OPS)
def test_a_no_grad_call_under_a_torch_function_mode_takes_the_custom_op(ctx, dispatched,
                                                                        name):
    with torch.no_grad(), _FunctionRecorder():
        got, want = _call(name)
    assert dispatched[name] >= 1  # (the mode sees the op's call, and may call it itself)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _spy_embedding_repeat(monkeypatch, answer):
    """Replaces the functional embedding's repeat path (GPU-only, world size 1: its handle's
    writer checks every table's tensors) with a spy that records its arguments."""
    seen = []

    def spy(ctx_, weights, indices, offsets, mode):
        # who offered: rocmoe.ops' function itself, or the implementation after its checks
        # (spy <- _kernels.embedding_repeat <- the offering function)
        offerer = sys._getframe(2).f_code
        seen.append((weights, indices, offsets,
                     os.path.basename(offerer.co_filename), offerer.co_name))
        return answer
    monkeypatch.setattr(_kernels, "_embedding_repeat", spy)
    return seen


def _listed():
    g = torch.Generator().manual_seed(5)
    tables = [torch.randn(6, 4, generator=g) for _ in range(3)]
    idx = [torch.tensor([0, 5, 2]), torch.tensor([1]), torch.tensor([3, 3])]
    off = [torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 2])]
    return tables, idx, off


def test_listed_lookups_without_grad_go_to_the_repeat_path_with_every_tensor_as_given(
        ctx, monkeypatch):
    out = torch.zeros(1)
    seen = _spy_embedding_repeat(monkeypatch, (out, []))
    tables, idx, off = _listed()
    with torch.no_grad():
        assert ops.embedding_all_to_all(tables, idx, off) is out
    assert len(seen) == 1 and seen[0][3:] == ("__init__.py", "embedding_all_to_all")
    for given, handed in zip((tables, idx, off), seen[0][:3]):
        assert all(a is b for a, b in zip(given, handed)) and len(given) == len(handed)


def test_listed_lookups_the_repeat_path_declines_are_offered_once_and_computed(
        ctx, monkeypatch):
    tables, idx, off = _listed()
    want = ops.embedding_all_to_all(tables, idx, off).detach()
    seen = _spy_embedding_repeat(monkeypatch, None)
    with torch.no_grad():
        got = ops.embedding_all_to_all(tables, idx, off)
    assert len(seen) == 1
    assert torch.equal(got, want)


@pytest.mark.parametrize("form", ["listed", "stacked"])
@pytest.mark.parametrize("context", ["grad", "torch_function_mode"])
def test_lookups_are_not_offered_to_the_repeat_path_with_grad_or_under_a_mode(
        ctx, monkeypatch, context, form):
    seen = _spy_embedding_repeat(monkeypatch, None)
    tables, idx, off = _listed()
    if form == "stacked":  # (two lookups a table, dlrm's lS_i / lS_o)
        idx = torch.stack([i[:1].repeat(2) for i in idx])
        off = torch.stack([torch.tensor([0, 1])] * len(tables))
    if context == "grad":
        ops.embedding_all_to_all([t.requires_grad_() for t in tables], idx, off)
    else:
        with torch.no_grad(), _FunctionRecorder():
            ops.embedding_all_to_all(tables, idx, off)
    # the custom op's implementation (_kernels.embedding_forward) offers them after its own
    # checks (as rows, listed); the function itself, before them, must not
    assert [s[3:] for s in seen] == [("_kernels.py", "embedding_forward")]
