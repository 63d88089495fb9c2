"""The lean GemmAllToAll call's launch (rocmoe/ops/gpu/gemm_plans.py: _LeanGemmLaunch)
without a GPU: against a stand-in for the plan's NativeLaunch it writes only the pointers
that changed and launches, and leaves every call whose other arguments may differ to the
plan."""

import torch

from rocmoe.ops.gpu.gemm_plans import _LeanGemmLaunch

from lean_gemm_standins import POINTER_POSITIONS, FakeNative, FakePlan

STREAM = 0x5EED  # a raw stream handle the launch must be given


def _setup(m=64):
    nl = FakeNative()
    lean = _LeanGemmLaunch(FakePlan(), None, nl)
    x, w = torch.randn(m, 16), torch.randn(16, 8)
    before = nl.generation
    nl.full_launch()
    lean.record(x, w, before)
    return nl, lean, x, w


def _outputs():
    return torch.empty(64, 8), torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64)


def test_same_shapes_launch_with_only_the_pointers_written():
    nl, lean, x, w = _setup()
    out, counts, recv = _outputs()
    assert lean(x, w, counts, out, recv, STREAM)
    (grid, stream, cells), = nl.launched
    assert grid == 7 and stream == STREAM
    assert cells == {2: out.data_ptr(), 3: counts.data_ptr(), 6: recv.data_ptr()}
    assert nl.stepped == []  # X and W did not move: their maps stay


def test_a_split_sum_plan_launches_its_sum_after_the_product():
    nl = FakeNative()
    plan = FakePlan()
    sums = []
    # the product is launched before its sum, and the sum gets the call's output, counts, M
    # and stream
    plan.split_sum = lambda out, counts, m, stream: sums.append(
        (len(nl.launched), out, counts, m, stream))
    lean = _LeanGemmLaunch(plan, None, nl)
    x, w = torch.randn(64, 16), torch.randn(16, 8)
    before = nl.generation
    nl.full_launch()
    lean.record(x, w, before)
    out, counts, recv = _outputs()
    assert lean(x, w, counts, out, recv, STREAM)
    (launched, s_out, s_counts, s_m, s_stream), = sums
    assert launched == 1 and s_out is out and s_counts is counts and s_m == 64
    assert s_stream == STREAM


def test_a_moved_x_is_written_through_its_step():
    nl, lean, x, w = _setup()
    x2 = x.clone()
    out, counts, recv = _outputs()
    assert lean(x2, w, counts, out, recv, STREAM)
    assert nl.stepped == [(0, x2.data_ptr())]


def test_an_x_the_kernel_was_not_compiled_for_goes_to_the_plan():
    nl, lean, x, w = _setup()
    nl.step_ok = False
    out, counts, recv = _outputs()
    assert not lean(x.clone(), w, counts, out, recv, STREAM)
    assert nl.launched == []


def test_another_m_goes_to_the_plan():
    nl, lean, x, w = _setup(m=64)
    out, counts, recv = _outputs()
    assert not lean(torch.randn(32, 16), w, counts, out, recv, STREAM)
    assert nl.launched == []


def test_a_strided_w_goes_to_the_plan():
    nl, lean, x, w = _setup()
    out, counts, recv = _outputs()
    strided = torch.randn(8, 16).t()
    assert not lean(x, strided, counts, out, recv, STREAM)


def test_a_launch_through_the_plan_in_between_goes_to_the_plan():
    nl, lean, x, w = _setup()
    nl.full_launch()  # someone else's arguments are in the buffer now
    out, counts, recv = _outputs()
    assert not lean(x, w, counts, out, recv, STREAM)


def test_a_misaligned_output_goes_to_the_plan():
    nl, lean, x, w = _setup()
    _, counts, recv = _outputs()
    out = torch.empty(64 * 8 + 1)[1:].view(64, 8)  # 4 bytes off a 16-byte boundary
    assert not lean(x, w, counts, out, recv, STREAM)
    assert nl.launched == []


def test_record_refuses_a_plan_launch_that_did_not_write_every_argument():
    nl = FakeNative()
    lean = _LeanGemmLaunch(FakePlan(), None, nl)
    x, w = torch.randn(64, 16), torch.randn(16, 8)
    lean.record(x, w, nl.generation)  # the plan went through the JIT: no generation moved
    out, counts, recv = _outputs()
    assert not lean(x, w, counts, out, recv, STREAM)


class CountingCell:
    """A pointer cell that counts its writes."""

    def __init__(self):
        self.value, self.writes = 0, 0

    def __getitem__(self, i):
        return self.value

    def __setitem__(self, i, v):
        self.value, self.writes = v, self.writes + 1


def _counting_setup():
    nl, lean, x, w = _setup()
    nl.cells = {pos: CountingCell() for pos in POINTER_POSITIONS}
    lean.out_slot.cell, lean.counts_slot.cell, lean.recv_slot.cell = (nl.cells[2], nl.cells[3],
                                                                      nl.cells[6])
    return nl, lean, x, w


def test_outputs_at_the_addresses_already_written_are_not_written_again():
    nl, lean, x, w = _counting_setup()
    out, counts, recv = _outputs()
    assert lean(x, w, counts, out, recv, STREAM)
    assert lean(x, w, counts, out, recv, STREAM)
    assert [nl.cells[p].writes for p in (2, 3, 6)] == [1, 1, 1]
    assert [c for _, _, c in nl.launched] == [
        {2: out.data_ptr(), 3: counts.data_ptr(), 6: recv.data_ptr()}] * 2


def test_an_output_at_another_address_is_written():
    nl, lean, x, w = _counting_setup()
    out, counts, recv = _outputs()
    assert lean(x, w, counts, out, recv, STREAM)
    out2 = torch.empty(64, 8)
    assert lean(x, w, counts, out2, recv, STREAM)
    assert nl.launched[-1][2] == {2: out2.data_ptr(), 3: counts.data_ptr(), 6: recv.data_ptr()}
    assert [nl.cells[p].writes for p in (2, 3, 6)] == [2, 1, 1]


def test_after_a_launch_through_the_plan_every_pointer_is_written_again():
    nl, lean, x, w = _counting_setup()
    out, counts, recv = _outputs()
    assert lean(x, w, counts, out, recv, STREAM)
    # the plan launches another call's arguments (its own outputs), then the lean launch
    # takes that launch as its base
    before = nl.generation
    nl.full_launch()
    for cell in nl.cells.values():
        cell[0] = 0xBAD0
    lean.record(x, w, before)
    assert lean(x, w, counts, out, recv, STREAM)
    assert nl.launched[-1][2] == {2: out.data_ptr(), 3: counts.data_ptr(), 6: recv.data_ptr()}
