"""The second launch of a SPLIT_SUM GEMM plan (rocmoe/ops/gpu/gemm_plans.py: _SplitSum)
without a GPU: after a launch that wrote every argument, a call of the same M writes only
the out and counts addresses that moved and launches the parameter buffer as it stands;
anything else (another M, another launch of the kernel in between, an address of another
alignment than the compiled one) writes every argument again."""

import types

import torch

from rocmoe.ops.gpu.gemm_plans import _SplitSum

STREAM = 1234


class FakeSumNative:
    """Stands for split_sum_kernel's NativeLaunch: the cells of out (0) and counts (1), the
    generation counter, launches as written."""

    def __init__(self):
        self.generation = 0
        self.cells = {0: [0], 1: [0]}
        self.launched = []
        self.pdl = []  # each launch's PDL attribute

    def pointer_cell(self, pos):
        return self.cells[pos], True  # compiled for 16-byte aligned addresses

    def launch_as_written(self, grid_x, stream, pdl=True):
        self.launched.append((grid_x, stream, self.cells[0][0], self.cells[1][0]))
        self.pdl.append(pdl)


class FakeKernel:
    """Stands for the _HelperLaunch: a launch writes every argument, natively."""

    def __init__(self):
        self.native = FakeSumNative()
        self.full = []

    def __call__(self, args, device):
        nl = self.native
        nl.generation += 1
        nl.cells[0][0], nl.cells[1][0] = args[0].data_ptr(), args[1].data_ptr()
        self.full.append(args[:3])
        return True


def _split_sum():
    plan = types.SimpleNamespace(split_tiles=8, n_tiles=2, bm=16, capacity=64,
                                 split_scratch=torch.zeros(4), cfg={"BLOCK_N": 16})
    s = _SplitSum(plan, n=32, split_k=4, pdl=False, dev=torch.device("cpu"))
    s.kernel = FakeKernel()
    return s


def _aligned(rows=16, n=32):
    return torch.empty(rows, n), torch.zeros(1, dtype=torch.int64)


def test_the_first_sum_writes_every_argument():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    assert len(s.kernel.full) == 1 and s.kernel.native.launched == []


def test_a_sum_of_the_same_m_writes_only_the_moved_out_address():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    out2 = torch.empty(16, 32)  # as an output ring's next buffer
    s(out2, counts, 16, STREAM)
    assert len(s.kernel.full) == 1
    assert s.kernel.native.launched == [(s.grid, STREAM, out2.data_ptr(), counts.data_ptr())]


def test_a_sum_of_the_same_m_writes_moved_counts():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    counts2 = torch.zeros(1, dtype=torch.int64)
    s(out, counts2, 16, STREAM)
    assert len(s.kernel.full) == 1
    assert s.kernel.native.launched == [(s.grid, STREAM, out.data_ptr(), counts2.data_ptr())]


def test_a_sum_of_another_m_writes_every_argument():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    s(out, counts, 9, STREAM)
    assert [a[2] for a in s.kernel.full] == [16, 9] and s.kernel.native.launched == []


def test_a_sum_after_another_launch_of_its_kernel_writes_every_argument():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    s.kernel.native.generation += 1  # a launch of another plan's sum on the same kernel
    s(out, counts, 16, STREAM)
    assert len(s.kernel.full) == 2 and s.kernel.native.launched == []


def test_an_output_of_another_alignment_writes_every_argument():
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    odd = torch.empty(16 * 32 + 1)[1:].view(16, 32)  # 4 bytes past an aligned address
    s(odd, counts, 16, STREAM)
    assert len(s.kernel.full) == 2 and s.kernel.native.launched == []


def test_the_sum_drops_its_pdl_attribute_only_in_eager_calls_with_eager_pdl_off(monkeypatch):
    s = _split_sum()
    out, counts = _aligned()
    s(out, counts, 16, STREAM)
    s(out, counts, 16, STREAM)
    monkeypatch.setattr(_SplitSum, "EAGER_PDL", False)
    s(out, counts, 16, STREAM)
    # under graph capture the attribute stays, EAGER_PDL or not
    monkeypatch.setattr("rocmoe.ops.gpu.gemm_plans.capturing", lambda: True)
    s(out, counts, 16, STREAM)
    assert s.kernel.native.pdl == [True, False, True]
