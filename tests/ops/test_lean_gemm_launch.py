"""The lean GemmAllToAll call's launch (rocmoe/ops/gpu/gemm_plans.py: _LeanGemmLaunch)
without a GPU: against a stand-in for the plan's NativeLaunch it writes only the pointers
that changed and launches, and leaves every call whose other arguments may differ to the
plan."""

import torch

from rocmoe.ops.gpu.gemm_plans import _LeanGemmLaunch


class FakeNative:
    """Stands for a NativeLaunch: steps that record what they wrote, pointer cells, the
    generation counter and the launches made as written."""

    def __init__(self):
        self.generation, self.written = 0, False
        self.cells = {pos: [0] for pos in (2, 3, 6)}
        self.stepped, self.launched = [], []
        self.step_ok = True

    def step(self, pos):
        def write(a):
            self.stepped.append((pos, a.data_ptr()))
            return self.step_ok
        return write

    def pointer_cell(self, pos):
        return self.cells[pos], True

    def launch_as_written(self, grid_x, stream):
        self.launched.append((grid_x, stream, dict((p, c[0]) for p, c in self.cells.items())))

    def full_launch(self):  # what the plan's launch does to the native launch
        self.generation += 1
        self.written = True


STREAM = 0x5EED  # a raw stream handle the launch must be given


class FakePlan:
    nprog, local = 7, True


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
