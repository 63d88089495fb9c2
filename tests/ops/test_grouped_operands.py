"""What gpu.grouped_operands gives grouped_tiles_kernel on a GPU with TMA (checked on CPU
with tma_capable forced): W as stored goes as gemm_operands' one [G * K, N] descriptor with
[BLOCK_K, BLOCK_N] boxes; the backward's W^T (a view of a contiguous [G, N, K]) as a
descriptor of W's own storage [G * N, K] with [BLOCK_N, BLOCK_K] boxes; operands TMA
cannot load (float32) go as the tensors themselves."""

import pytest
import torch

from rocmoe_testing import require_module

require_module("triton", "Triton's tensor descriptors are what grouped_operands makes")
from rocmoe.ops import gpu  # noqa: E402
from rocmoe.ops.gpu import gemm_plans  # noqa: E402

CFG = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, USE_TMA=True)
G, K, N = 3, 48, 40


@pytest.fixture(autouse=True)
def tma(monkeypatch):
    monkeypatch.setattr(gemm_plans, "tma_capable", lambda device: True)


def test_stored_weights_go_as_one_descriptor_of_all_groups():
    x = torch.zeros(100, K, dtype=torch.bfloat16)
    w = torch.zeros(G, K, N, dtype=torch.bfloat16)
    xd, wd, use_tma = gpu.grouped_operands(x, w, CFG, trans_w=False)
    assert use_tma
    assert list(xd.shape) == [100, K] and list(xd.block_shape) == [64, 16]
    assert list(wd.shape) == [G * K, N] and list(wd.strides) == [N, 1]
    assert list(wd.block_shape) == [16, 32]


def test_transposed_weights_go_as_a_descriptor_of_their_own_storage():
    x = torch.zeros(100, K, dtype=torch.bfloat16)
    stored = torch.zeros(G, N, K, dtype=torch.bfloat16)
    xd, wd, use_tma = gpu.grouped_operands(x, stored.transpose(1, 2), CFG, trans_w=True)
    assert use_tma
    assert wd.base.data_ptr() == stored.data_ptr()
    assert list(wd.shape) == [G * N, K] and list(wd.strides) == [K, 1]
    assert list(wd.block_shape) == [32, 16]


def test_float32_operands_go_as_the_tensors_themselves():
    x = torch.zeros(100, K)
    stored = torch.zeros(G, N, K)
    for w, trans in ((torch.zeros(G, K, N), False), (stored.transpose(1, 2), True)):
        xa, wa, use_tma = gpu.grouped_operands(x, w, CFG, trans_w=trans)
        assert not use_tma and xa is x and wa is w
