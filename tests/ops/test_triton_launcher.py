"""The fused GEMM's Triton launcher reuses a compiled kernel only for arguments the JIT would
specialise the same way. A kernel compiled for N = 48 (divisible by 16) assumes aligned rows;
reused for N = 40 it stores at the wrong places (found on the H200: a second handle in the
same process got another handle's kernel). Runs without a GPU: the kernel is a stand-in that
records whether a launch compiled or reused."""

import types

import pytest
import torch

from rocmoe_testing import require_module

require_module("triton", "the launcher specialises arguments the way Triton's JIT does")

from rocmoe.ops.gpu import gemm_plans, team, triton_launcher  # noqa: E402
from rocmoe.ops import triton_gemm_a2a as tk  # noqa: E402


class _StandInKernel:
    """A jitted kernel's surface: kernel[grid](*args, **constexprs) compiles (recorded) and
    returns the compiled kernel, whose compiled[grid](*args, *constexprs) launches."""

    def __init__(self):
        self.compiles, self.reuses = [], []
        param = types.SimpleNamespace(is_constexpr=False, is_const=False,
                                      do_not_specialize=False,
                                      do_not_specialize_on_alignment=False)
        self.params = [param] * 3 + [types.SimpleNamespace(
            is_constexpr=True, is_const=False, do_not_specialize=False,
            do_not_specialize_on_alignment=False)]
        self.arg_names = ["x_ptr", "n", "stride", "BLOCK"]

    def __getitem__(self, grid):
        def jit(*args, **constexprs):
            self.compiles.append(args)
            return _Compiled(self.reuses)
        return jit


class _Compiled:
    def __init__(self, reuses):
        self.reuses = reuses

    def __getitem__(self, grid):
        assert len(grid) == 3, grid  # the compiled launcher reads three grid dimensions
        return lambda *args: self.reuses.append(args)


@pytest.fixture
def launch(monkeypatch):
    kernel = _StandInKernel()
    monkeypatch.setattr(tk, "get", lambda name: kernel)
    monkeypatch.setattr(triton_launcher, "_interpreting", lambda: False)
    launcher = triton_launcher._Launcher("stand_in")

    def run(*args):
        launcher((1,), args, {"BLOCK": 16}, {}, ("plan",))
    return kernel, run


def test_the_same_specialisation_reuses_the_compiled_kernel(launch):
    kernel, run = launch
    x = torch.zeros(64, 48)
    run(x, 48, 48)
    run(torch.zeros(64, 48), 48, 48)
    assert len(kernel.compiles) == 1 and len(kernel.reuses) == 1


@pytest.mark.parametrize("first, second", [
    ((torch.float32, 48), (torch.float32, 40)),    # divisible by 16, then not
    ((torch.float32, 48), (torch.bfloat16, 48)),   # another pointer dtype
    ((torch.float32, 1), (torch.float32, 2)),      # 1 is a constant to the JIT
    ((torch.float32, 48), (torch.float32, 2**33)),  # a 64-bit integer
])
def test_a_differently_specialised_argument_compiles_anew(launch, first, second):
    kernel, run = launch
    for dtype, n in (first, second):
        run(torch.zeros(64, 64, dtype=dtype), n, 64)
    assert len(kernel.compiles) == 2 and not kernel.reuses


def test_a_misaligned_pointer_compiles_anew(launch):
    kernel, run = launch
    base = torch.zeros(128)
    run(base, 48, 48)
    run(base[1:], 48, 48)  # 4 bytes past a 16-byte boundary
    assert len(kernel.compiles) == 2 and not kernel.reuses


def test_arguments_a_caller_declares_fixed_are_not_specialised_per_call(monkeypatch):
    # the GEMM plan specialises its fixed arguments once and names only the dynamic ones;
    # the fixed part is then the caller's key
    kernel = _StandInKernel()
    monkeypatch.setattr(tk, "get", lambda name: kernel)
    monkeypatch.setattr(triton_launcher, "_interpreting", lambda: False)
    launcher = triton_launcher._Launcher("stand_in")
    x = torch.zeros(64, 48)
    fixed = launcher.specialize((x, 48, 48), (1, 2))
    assert fixed == launcher.specialize((x, 48, 48), (1, 2))
    assert fixed != launcher.specialize((x, 40, 48), (1, 2))
    launcher((1,), (x, 48, 48), {"BLOCK": 16}, {}, ("plan", fixed), dynamic=(0,))
    launcher((1,), (x, 48, 48), {"BLOCK": 16}, {}, ("plan", fixed), dynamic=(0,))
    assert len(kernel.compiles) == 1 and len(kernel.reuses) == 1


def test_the_gemm_plan_names_every_argument_fixed_or_dynamic():
    fn = tk.get("gemm_a2a_kernel")
    positional = [p for p in fn.params if not p.is_constexpr]
    assert sorted(gemm_plans._GEMM_FIXED + gemm_plans._GEMM_DYNAMIC) == list(range(len(positional)))
    names = [fn.arg_names[i] for i in gemm_plans._GEMM_DYNAMIC]
    assert names == ["x_ptr", "w_ptr", "out_ptr", "counts_ptr", "order_ptr", "peer_bases_ptr",
                     "recv_ptr", "M", "stride_xm", "stride_xk", "stride_wg", "stride_wk",
                     "stride_wn"]


def test_a_gemm_plans_first_launch_waits_the_first_call_timeout(monkeypatch):
    # the peers of a first call may still be compiling and tuning: its waits are bounded by
    # ROCMOE_FIRST_CALL_TIMEOUT_S (microseconds of the device clock), later ones by the
    # context's timeout
    monkeypatch.setattr(team, "_interpreting", lambda: False)
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "300")
    assert team._wait_budget(3.0) == 3_000_000
    assert team._first_call_budget(3.0) == 300_000_000
    assert team._first_call_budget(400.0) == 400_000_000  # never below the plain timeout


def test_a_gemm_plan_rewrites_its_native_launches_budget_after_the_first_launch():
    # a native launch keeps the fixed arguments of the call it was made on, the first's
    # long budget among them: without the rewrite every later call waited
    # ROCMOE_FIRST_CALL_TIMEOUT_S for a dead peer (300 s on the H200, where the missing-peer
    # test hung)
    assert tk.get("gemm_a2a_kernel").arg_names[gemm_plans._GEMM_BUDGET] == "wait_budget"
    assert gemm_plans._GEMM_BUDGET in gemm_plans._GEMM_FIXED
    written = []
    native = types.SimpleNamespace(set_fixed=lambda pos, v: written.append((pos, v)))
    plan = gemm_plans._GemmLaunch.__new__(gemm_plans._GemmLaunch)
    plan.native, plan.wait_budget, plan.launched = {True: native, False: None}, 3_000_000, False
    plan._first_launch_done()
    assert plan.launched and written == [(gemm_plans._GEMM_BUDGET, 3_000_000)]


def test_the_first_call_budget_specialises_the_kernel_like_the_plain_one(monkeypatch):
    # the plan specialises its fixed arguments once, at the first launch: the two budgets
    # must key the same compiled kernel (multiples of 16, 32-bit)
    monkeypatch.setattr(triton_launcher, "_interpreting", lambda: False)
    launcher = triton_launcher._Launcher("gemm_a2a_kernel")
    budgets = [team._wait_budget(t) for t in (0.001, 2.5, 3.3, 60)]
    budgets += [team._first_call_budget(t) for t in (0.001, 60)]
    specs = {launcher.specialize((b,), (0,)) for b in budgets}
    assert len(specs) == 1, specs
