"""No host reads in the layer's step, checked on CPU by reading the code (tests/moe/host_reads.py):
the single-rank DroplessMoE's forward and backward never wait for the device. The GPU test
(test_gpu.py, sync-debug "error") proves the same at run time on a GPU; this covers every
code path of the layer's modules, also the GPU-only ones, on any machine.

The checker's own rules are specified below by small snippets: each kind of host read is
found, and the host-side look-alikes (shapes, None checks, config values) are not."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from host_reads import check_source
from rocmoe.moe import DroplessMoE, kernels
from rocmoe.moe.permute import RoutingPlan
from rocmoe.moe.topology import Topology

MOE = Path(__file__).resolve().parents[2] / "rocmoe" / "moe"
# the modules a single-rank layer's forward and backward run through (parallel.py, the
# expert-parallel exchange, reads per-rank row counts on the host by design: README)
LAYER_MODULES = ["router.py", "router_fused.py", "permute.py", "topology.py", "blocksparse.py", "layer.py",
                 "routing.py", "kernels.py", "backend.py", "activations.py", "dispatch.py"]
# Functions of those modules that are not part of a step, each with the reason (none today:
# to_dense and the AOT helpers read nothing back either).
NOT_IN_THE_STEP: dict[str, str] = {}
# modules the layer's modules import that are not in its single-rank step
OUTSIDE_THE_STEP = {
    "parallel": "expert parallelism (its handle transport keeps the counts on the device: "
                "checked on a GPU by tests/moe/test_expert_parallel_gpu.py)",
    "placement": "vExpert placement tables: built at construction and by the scheduler",
    "vexpert_routing": "vExpert routing: checked on a GPU by tests/moe/test_vexpert_gpu.py",
    "rank_agreement": "host agreement of the configuration, at construction (and of the "
                      "vExpert placement after loading one)",
}


def _tensor_attributes() -> set[str]:
    """Attribute names that hold tensors: the routing plan's and topology's tensor fields,
    and the layer's (and router's) parameters and tensor attributes after a step."""
    names = set()
    for cls in (RoutingPlan, Topology):
        hints = typing.get_type_hints(cls)
        names |= {f.name for f in dataclasses.fields(cls) if "Tensor" in str(hints[f.name])}
    layer = DroplessMoE(8, 8, 4, 2, glu=True)
    layer(torch.randn(5, 8))
    for module in layer.modules():
        names |= {n for n, _ in module.named_parameters(recurse=False)}
        names |= {n for n, v in vars(module).items() if isinstance(v, torch.Tensor)}
    return names


@pytest.mark.parametrize("name", LAYER_MODULES)
def test_layer_module_has_no_host_reads(name):
    skip = set(NOT_IN_THE_STEP) | set(kernels.names())  # Triton kernels are device code
    found = check_source((MOE / name).read_text(), name, _tensor_attributes(), skip)
    assert not found, "host reads in the layer's step:\n" + "\n".join(map(str, found))


def test_the_checked_modules_import_only_checked_modules():
    # the step's code is what LAYER_MODULES import from rocmoe.moe, transitively: a new
    # module the layer starts to use must be checked too (or listed as outside the step)
    checked = {m[:-3] for m in LAYER_MODULES}
    for name in LAYER_MODULES:
        tree = ast.parse((MOE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                used = [node.module] if node.module else [a.name for a in node.names]
                for module in used:
                    assert module in checked or module in OUTSIDE_THE_STEP, \
                        f"{name} imports rocmoe.moe.{module}, which the check does not read"


# -- the checker's rules ------------------------------------------------------------------

def _kinds(body: str, attrs=("tokens_per_expert",)) -> list[str]:
    return [f.kind for f in check_source(body, "snippet", attrs)]


@pytest.mark.parametrize("code,kind", [
    ("def f(x: torch.Tensor):\n    return x.sum().item()", ".item() reads device values"),
    ("def f(x):\n    return x.tolist()", ".tolist() reads device values"),
    ("def f(x):\n    return x.cpu()", ".cpu() reads device values"),
    ("def f(x: torch.Tensor):\n    return int(x.max())", "int() of a tensor reads its value"),
    ("def f(x: torch.Tensor):\n    return float(x[0])", "float() of a tensor reads its value"),
    ("def f(plan):\n    return bool(plan.tokens_per_expert.any())",
     "bool() of a tensor reads its value"),
    ("def f(x):\n    n = x.shape[0]\n    return range(x.sum())", "range() of a tensor reads its value"),
    ("def f(x: torch.Tensor):\n    if x.any():\n        return 1", "branch on a tensor's value"),
    ("def f(x: torch.Tensor):\n    while (x > 0).all():\n        x = x - 1",
     "branch on a tensor's value"),
    ("def f(x: torch.Tensor):\n    assert torch.isfinite(x).all()", "branch on a tensor's value"),
    ("def f(x: torch.Tensor):\n    return 1 if x.sum() > 0 else 2", "branch on a tensor's value"),
    ("def f(x: torch.Tensor, y):\n    return x.any() and y", "branch on a tensor's value"),
    ("def f(x: torch.Tensor):\n    y = torch.zeros(3)\n    if not y.eq(1).any():\n        return y",
     "branch on a tensor's value"),
    ("def f(x: torch.Tensor):\n    return torch.nonzero(x)",
     "torch.nonzero() sizes its output by device values"),
    ("def f(x: torch.Tensor):\n    return x.nonzero()", ".nonzero() reads device values"),
    ("def f(x: torch.Tensor):\n    return torch.where(x > 0)", "torch.where(condition) is a nonzero"),
    ("def f(x: torch.Tensor):\n    return torch.bincount(x)",
     "torch.bincount() sizes its output by device values"),
    ("def f(x: torch.Tensor, r: torch.Tensor):\n    return x.repeat_interleave(r)",
     "repeat_interleave by tensor repeats without output_size"),
    ("def f(x: torch.Tensor):\n    return x[x > 0]", "boolean-mask indexing"),
    ("def f(x: torch.Tensor):\n    keep = torch.isfinite(x)\n    return x[keep]",
     "boolean-mask indexing"),
    ("def f(x: torch.Tensor):\n    x[~(x < 0)] = 0", "boolean-mask indexing"),
    ("def f(x: torch.Tensor):\n    for v in x.sum(0):\n        pass", "iterating over a tensor's values"),
    ("def f(x):\n    y = x.view(-1)\n    if y.max() > 2:\n        pass", "branch on a tensor's value"),
])
def test_checker_finds_each_kind_of_host_read(code, kind):
    assert kind in _kinds(code), _kinds(code)


@pytest.mark.parametrize("code", [
    "def f(x: torch.Tensor):\n    if x.shape[0] > 3 and x.dim() == 2:\n        return x",
    "def f(x: torch.Tensor, w=None):\n    if w is None or x.numel() == 0:\n        return x",
    "def f(x: torch.Tensor, cfg):\n    return int(cfg['persistent']) + int(x.shape[1])",
    "def f(x: torch.Tensor):\n    if not x.is_floating_point() or x.requires_grad:\n        return x",
    "def f(x: torch.Tensor, idx: torch.Tensor):\n    return x[idx]",
    "def f(x: torch.Tensor):\n    return torch.where(x > 0, x, 0)",
    "def f(x: torch.Tensor, r: torch.Tensor):\n    return x.repeat_interleave(r, output_size=8)",
    "def f(n: int, block: int):\n    return bool(n) and range(-(-n // block))",
    "def f(x: torch.Tensor):\n    if x.dtype == torch.float32 and x.device.type == 'cuda':\n        pass",
    "@triton.jit\ndef k(x_ptr, N):\n    if N > 0:\n        pass",
    "def k(x_ptr, BLOCK: tl.constexpr):\n    v = tl.load(x_ptr)\n    if v > 0:\n        pass",
])
def test_checker_leaves_host_values_and_device_code_alone(code):
    assert _kinds(code) == []
