"""The native launch of compiled Triton kernels (rocmoe/native_launch.py) without a GPU:
its parameter layout against the one the H200's driver reported for the GEMM kernel
(benchmarks/results/probe_gemm_host_h200.json, cuFuncGetParamInfo), its specialisation
tokens, and that it refuses where it cannot run. The launches themselves are checked on the
GPU (tests/ops_gpu/test_fused_launch_and_failures_gpu.py, "native")."""

import ast
import json
import os

import pytest
import torch

from rocmoe import native_launch
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


def test_a_constant_argument_token_tells_none_from_a_tensor_and_one_from_two():
    tok = native_launch._constant_token
    assert tok(None) != tok(torch.zeros(1))
    assert tok(1) != tok(2) and tok(1) != tok(True)
    assert tok(None) == tok(None)


# -- FastKernel: which launches go through the JIT and which straight to the driver -------

class _FakeJit:
    """Stands for a JITFunction: records its launches, returns a 'compiled kernel'."""

    def __init__(self):
        self.calls = []
        self.arg_names = ["a", "b"]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return ("compiled", len(self.calls))
        return run


class _FakeNative:
    """Stands for a NativeLaunch: launches while the first argument is what it was made for."""

    def __init__(self, compiled, args):
        self.compiled, self.want = compiled, args[0]
        self.launched = []

    def launch(self, grid, args):
        if args[0] != self.want:
            return False
        self.launched.append((grid, args))
        return True


@pytest.fixture
def fake_natives(monkeypatch):
    made = []

    def fake_try_native(compiled, args, dynamic, device):
        assert list(dynamic) == list(range(len(args)))  # every argument may change
        made.append(_FakeNative(compiled, args))
        return made[-1]
    monkeypatch.setattr(native_launch, "try_native", fake_try_native)
    monkeypatch.setattr(native_launch, "_on_cuda", lambda args: True)
    monkeypatch.setattr(native_launch, "_current_device_getter", lambda: (lambda: 0))
    return made


def test_fast_kernel_runs_the_first_call_through_the_jit_and_later_ones_natively(fake_natives):
    jit = _FakeJit()
    fast = native_launch.FastKernel(jit)
    fast[(4,)](1, 2, BLOCK=64)
    fast[(8,)](1, 3, BLOCK=64)
    fast[(8,)](1, 4, BLOCK=64)
    assert len(jit.calls) == 1 and len(fake_natives) == 1
    assert fake_natives[0].launched == [((8,), (1, 3)), ((8,), (1, 4))]


def test_fast_kernel_sends_a_call_no_specialisation_fits_to_the_jit_and_keeps_it(fake_natives):
    jit = _FakeJit()
    fast = native_launch.FastKernel(jit)
    fast[(1,)](1, 0, BLOCK=64)
    fast[(1,)](16, 0, BLOCK=64)  # another specialisation: the JIT, then a second native
    fast[(1,)](16, 5, BLOCK=64)
    fast[(1,)](1, 5, BLOCK=64)
    assert len(jit.calls) == 2 and len(fake_natives) == 2
    assert [len(n.launched) for n in fake_natives] == [1, 1]


def test_fast_kernel_keeps_other_constexprs_apart(fake_natives):
    jit = _FakeJit()
    fast = native_launch.FastKernel(jit)
    fast[(1,)](1, 0, BLOCK=64)
    fast[(1,)](1, 0, BLOCK=128)  # another kernel: the JIT compiles it
    assert len(jit.calls) == 2 and len(fake_natives) == 2
    fast[(1,)](1, 0, BLOCK=128)
    assert len(jit.calls) == 2 and fake_natives[1].launched


def test_fast_kernel_keeps_a_refused_kernel_on_the_jit_without_asking_again(monkeypatch):
    asked = []
    monkeypatch.setattr(native_launch, "try_native",
                        lambda *a: asked.append(1) or None)
    monkeypatch.setattr(native_launch, "_on_cuda", lambda args: True)
    monkeypatch.setattr(native_launch, "_current_device_getter", lambda: (lambda: 0))
    jit = _FakeJit()
    fast = native_launch.FastKernel(jit)
    for _ in range(3):
        fast[(1,)](1, 0, BLOCK=64)
    assert len(jit.calls) == 3 and len(asked) == 1


def test_fast_kernel_off_cuda_launches_through_the_jit_only(monkeypatch):
    monkeypatch.setattr(native_launch, "try_native",
                        lambda *a: pytest.fail("no native launch for CPU tensors"))
    jit = _FakeJit()
    fast = native_launch.FastKernel(jit)
    for _ in range(2):
        fast[(1,)](torch.zeros(2), 0, BLOCK=64)
    assert len(jit.calls) == 2
    assert fast.arg_names == ["a", "b"]  # the JITFunction's attributes show through


class _FakeTensor:
    """What a native launch reads of a tensor argument."""

    def __init__(self, ptr, dtype=torch.bfloat16, is_cuda=True):
        self.ptr, self.dtype, self.is_cuda = ptr, dtype, is_cuda

    def data_ptr(self):
        return self.ptr


def _launch_without_gpu(args, kinds):
    """A NativeLaunch's argument writing, made without a kernel: `kinds` per position
    ("ptr", "int" or None for a constant the JIT folded)."""
    from rocmoe._native import ffi
    nl = native_launch.NativeLaunch.__new__(native_launch.NativeLaunch)
    nl._by_pos = {}
    for pos, kind in enumerate(kinds):
        if kind is not None:
            f = native_launch._Field(kind, 8)
            f.cell = ffi.new("int64_t[1]")
            nl._by_pos[pos] = [f]
    dynamic = range(len(args))
    tokens = [nl._token(pos, args[pos]) for pos in dynamic]
    nl._steps = [(pos, nl._step(pos, tok)) for pos, tok in zip(dynamic, tokens)]
    return nl, nl._generated(dynamic, tokens)


def test_generated_argument_writer_agrees_with_the_steps():
    # the arguments the kernel was made for, then each one changed alone to every
    # alternative: the generated writer must accept and reject exactly what the steps do
    kinds = ["ptr", "int", None, "ptr", "int", "int"]
    made = (_FakeTensor(4096), 48, None, _FakeTensor(8192, torch.float32), 1, 2**33)
    nl, write = _launch_without_gpu(made, kinds)
    ints = [1, 16, 32, 17, 3, -16, 2**31, 2**33, 2**33 + 16]
    alternatives = {
        0: [_FakeTensor(p, d, c) for p in (4096, 4104, 0) for d in (torch.bfloat16,
                                                                     torch.float32)
            for c in (True, False)],
        1: ints, 2: [None, 0, 1], 3: [_FakeTensor(8200, torch.float32),
                                      _FakeTensor(8192, torch.bfloat16)],
        4: ints, 5: ints}
    assert write(made)
    outcomes = set()
    for pos, values in alternatives.items():
        for v in values:
            args = made[:pos] + (v,) + made[pos + 1:]
            by_steps = all(step(args[q]) for q, step in nl._steps)
            assert write(args) == by_steps, (pos, v)
            outcomes.add(by_steps)
            if by_steps:
                assert nl._by_pos[0][0].cell[0] == args[0].ptr
                assert nl._by_pos[5][0].cell[0] == args[5]
    assert outcomes == {True, False}


def test_a_fixed_integer_argument_can_be_rewritten_for_later_launches():
    # a GEMM plan's wait budget: the first launch's (ROCMOE_FIRST_CALL_TIMEOUT_S) is written
    # when the native launch is made, the later calls' afterwards
    nl, _ = _launch_without_gpu((_FakeTensor(4096), 300_000_000), ["ptr", "int"])
    nl._write(1, 300_000_000)
    nl.set_fixed(1, 3_000_000)
    assert nl._by_pos[1][0].cell[0] == 3_000_000


def test_a_fixed_argument_keeps_its_specialisation():
    nl, _ = _launch_without_gpu((_FakeTensor(4096), 48), ["ptr", "int"])
    nl._write(1, 48)
    with pytest.raises(native_launch.Unsupported):
        nl.set_fixed(1, 47)  # 48 was specialised as divisible by 16
    with pytest.raises(native_launch.Unsupported):
        nl.set_fixed(0, 16)  # a pointer
    assert nl._by_pos[1][0].cell[0] == 48


def _descriptor_step(want_ptrs):
    """A NativeLaunch with one descriptor argument, made without a kernel: its step, and
    the base addresses its specialisation check and its map writer were called with (the
    check passes for `want_ptrs`)."""
    nl = native_launch.NativeLaunch.__new__(native_launch.NativeLaunch)
    f = native_launch._Field("tma", 128)
    f.desc = (None, 2)
    nl._by_pos = {0: [f]}
    checked, written = [], []
    nl._token = lambda pos, a: checked.append(a.base.ptr) or a.base.ptr in want_ptrs
    nl._write = lambda pos, a: written.append(a.base.ptr)
    return nl._step(0, True), checked, written


def _descriptor(ptr):
    import types
    return types.SimpleNamespace(base=_FakeTensor(ptr), shape=(64, 32), strides=(32, 1),
                                 block_shape=[64, 32])


def test_a_descriptor_step_checks_each_tensor_once_when_tensors_take_turns():
    # X of a layer takes turns among a few addresses: each one's map is written whenever
    # it comes back, its specialisation checked only the first time
    step, checked, written = _descriptor_step({4096, 8192})
    a, b = _descriptor(4096), _descriptor(8192)
    assert all(step(d) for d in (a, b, a, b, a, a))
    assert checked == [4096, 8192]
    assert written == [4096, 8192, 4096, 8192, 4096]  # the last call: its map is in place


def test_a_descriptor_step_never_remembers_a_refusal():
    step, checked, written = _descriptor_step({4096})
    bad = _descriptor(4104)
    assert not step(bad) and not step(bad)
    assert checked == [4104, 4104] and written == []


def test_a_pdl_kernel_launched_as_written_without_pdl_goes_through_the_plain_driver_call():
    nl = native_launch.NativeLaunch.__new__(native_launch.NativeLaunch)
    calls = []
    nl._launch = lambda *a: calls.append(("pdl", a[1])) or 0
    nl._launch_plain = lambda *a: calls.append(("plain", a[1])) or 0
    nl.function, nl.block, nl.shared, nl._params = 7, 128, 0, None
    nl.launch_as_written(3, 99)
    nl.launch_as_written(5, 99, pdl=False)
    assert calls == [("pdl", 3), ("plain", 5)]
