"""The native launch of compiled Triton kernels (rocmoe/ops/native_launch.py) without a GPU:
its parameter layout against the one the H200's driver reported for the GEMM kernel
(benchmarks/results/probe_gemm_host_h200.json, cuFuncGetParamInfo), its specialisation
tokens, and that it refuses where it cannot run. The launches themselves are checked on the
GPU (tests/ops_gpu/test_fused_gpu.py, "native")."""

import ast
import json
import os

import pytest
import torch

from rocmoe.ops import native_launch
from rocmoe_testing import REPO

PROBE = os.path.join(REPO, "benchmarks", "results", "probe_gemm_host_h200.json")


def _recorded():
    with open(PROBE) as f:
        return json.load(f)


@pytest.mark.parametrize("shape", ["4096x4096x4096", "128x4096x4096"])
def test_parameter_layout_of_the_gemm_kernel_is_the_h200_drivers(shape):
    rec = _recorded()[shape]
    meta = ast.literal_eval(rec["metadata"]["tensordesc_meta"])
    fields, owner = native_launch.parameter_fields(list(rec["signature"].values()), meta)
    driver = [size for _, size in rec["param_info"] if _ != "rc"]
    assert [f.size for f in fields] == driver
    # X's descriptor is its map, shape and strides; the two last are Triton's scratch pointers
    assert [f.kind for f in fields[:5]] == ["tma", "shape", "shape", "stride", "stride"]
    assert owner[:5] == [0] * 5 and owner[-2:] == [-1, -1]


def test_a_descriptor_not_lowered_to_tma_is_refused():
    with pytest.raises(native_launch.Unsupported):
        native_launch.parameter_fields(["tensordesc<bf16[64, 64]>", "i32"], [None])


def test_float_parameters_are_refused():
    with pytest.raises(native_launch.Unsupported):
        native_launch.parameter_fields(["*fp32", "fp32"], [])


def test_integer_tokens_separate_what_triton_specialises_on():
    tok = native_launch._int_token
    assert tok(1) != tok(17)          # == 1 becomes a constant
    assert tok(32) != tok(33)         # divisible by 16
    assert tok(300) == tok(257)       # neither: the same kernel
    assert tok(2**31) != tok(2**31 - 16)  # 64-bit integers are another signature


def test_no_native_launch_off_cuda():
    class Compiled:  # never reached: the device is checked first
        metadata = None
    assert native_launch.try_native(Compiled(), (), (), torch.device("cpu")) is None
    assert "CUDA only" in native_launch.last_refusal
