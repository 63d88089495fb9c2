"""A GemmAllToAll handle's lean call (rocmoe/ops/gpu/gemm_plans.py: lean_gemm_call) without a
GPU: the stand-in handle and native launch of lean_gemm_standins.py (CPU tensors, the
device index a CPU tensor reports, stream 0). What is specified is which calls
it takes and launches, which it leaves to the general path (None, nothing launched), and the
outputs it hands out; the product itself is the GPU tests' (tests/ops_gpu/
fused_gpu_script.py: check_lean, check_function_rows)."""

import pytest
import torch

from lean_gemm_standins import FakeNative, lean_call_on_cpu

M, K, N = 64, 16, 8
CAPACITY = 2 * M


@pytest.fixture
def lean(monkeypatch):
    """(the lean call, its stand-in native launch, X, W) for a one-rank handle of max_rows M
    whose plan for X's rows class has a lean launch."""
    nl = FakeNative()
    call, x, w = lean_call_on_cpu(M, K, N, CAPACITY, nl, monkeypatch.setattr)
    with torch.no_grad():
        yield call, nl, x, w


def test_the_common_call_is_launched_once_into_capacity_rows(lean):
    call, nl, x, w = lean
    out, recv = call(x, w, [M])
    assert out.shape == (CAPACITY, N) and recv.shape == (1,)
    assert len(nl.launched) == 1 and nl.launched[0][2][2] == out.data_ptr()


def test_an_exact_call_whose_rows_repeat_gets_an_output_of_those_rows(lean):
    call, nl, x, w = lean
    call(x, w, [M], True)  # the first time: the capacity ring
    out, _ = call(x, w, [M], True)
    assert out.shape == (M, N) and nl.launched[-1][2][2] == out.data_ptr()


def test_an_output_the_caller_holds_is_not_handed_out_again(lean):
    call, nl, x, w = lean
    first, _ = call(x, w, [M])
    second, _ = call(x, w, [M])
    assert first.data_ptr() != second.data_ptr()
    assert nl.launched[-1][2][2] == second.data_ptr()


def test_an_output_the_caller_dropped_is_handed_out_again(lean):
    call, nl, x, w = lean
    address = call(x, w, [M])[0].data_ptr()
    assert call(x, w, [M])[0].data_ptr() == address
    assert len(nl.launched) == 2


@pytest.mark.parametrize("why, args", [
    ("another K", lambda x, w: (torch.randn(M, K + 1), w, [M])),
    ("X column-strided", lambda x, w: (torch.randn(K, M).t(), w, [M])),
    ("X row-strided", lambda x, w: (torch.randn(M, 2 * K)[:, :K], w, [M])),
    ("X not 2-D", lambda x, w: (x.reshape(-1), w, [M])),
    ("another W shape", lambda x, w: (x, torch.randn(K, N + 1), [M])),
    ("another dtype", lambda x, w: (x.double(), w.double(), [M])),
    ("a count above max_rows", lambda x, w: (torch.randn(M + 1, K), w, [M + 1])),
    ("counts above X's rows", lambda x, w: (x, w, [M + 1])),
    ("a count not an int", lambda x, w: (x, w, [float(M)])),
    ("counts of another world size", lambda x, w: (x, w, [M, 0])),
    ("a rows class without a plan", lambda x, w: (x[:3], w, [3])),
])
def test_a_call_it_does_not_take_is_left_to_the_general_path(lean, why, args):
    call, nl, x, w = lean
    assert call(*args(x, w)) is None, why
    assert nl.launched == [], why


def test_a_handle_with_a_recorded_failure_leaves_every_call_to_the_general_path(lean):
    call, nl, x, w = lean
    status = call.__closure__[call.__code__.co_freevars.index("status")].cell_contents
    status[0] = 1  # a status word set by a kernel: the general path raises it
    assert call(x, w, [M]) is None and nl.launched == []


def test_the_closure_holds_what_probe_prelaunch_times_alone(lean):
    # benchmarks/probe_prelaunch.py times these pieces of the call by name on a GPU: a
    # rename here would break that probe only there
    call, _, _, _ = lean
    names = set(call.__code__.co_freevars)
    assert {"take", "stream", "ints_of", "plan_of", "status", "clear"} <= names, names
