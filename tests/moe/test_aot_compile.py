"""Every Triton kernel builds ahead of time for CDNA3, CDNA2 and Hopper, with matrix units."""

import os

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rocmoe.moe import kernels  # noqa: E402

TARGETS = [
    (GPUTarget("hip", "gfx942", 64), "amdgcn", "v_mfma"),
    (GPUTarget("hip", "gfx90a", 64), "amdgcn", "v_mfma"),
    (GPUTarget("cuda", 90, 32), "ptx", "wgmma"),
]


@pytest.fixture(autouse=True)
def compiled_not_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("target,asm_key,instruction", TARGETS,
                         ids=["gfx942", "gfx90a", "sm90"])
@pytest.mark.parametrize("name,fused", [("sdd_kernel", False), ("sdd_kernel", True),
                                        ("dsd_kernel", False), ("dsd_kernel", True),
                                        ("dstd_kernel", True)])
def test_kernel_compiles_with_matrix_instructions(name, fused, target, asm_key, instruction):
    signature = kernels.aot_signatures("bf16")[name]
    # fused: the GELU prologue (DSD, DSᵀD) or the act' epilogue (SDD) must not cost the MMAs
    act = dict(ACT=kernels.ACT_GELU_TANH, EPILOGUE_ACT_GRAD=kernels.ACT_GELU_TANH) if fused else {}
    constexprs = kernels.aot_constexprs(name, **act)
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    assert instruction in compiled.asm[asm_key], f"{name} for {target} has no {instruction}"


@pytest.mark.parametrize("target", [t for t, _, _ in TARGETS], ids=["gfx942", "gfx90a", "sm90"])
@pytest.mark.parametrize("name", sorted(kernels.aot_routing_signatures()))
def test_routing_kernel_compiles(name, target):
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_routing_signatures()[name],
                    constexprs=kernels.ROUTING_AOT_CONSTEXPRS[name])
    compiled = triton.compile(src, target=target, options={"num_warps": 4})
    assert compiled.asm.get("amdgcn") or compiled.asm.get("ptx")


def test_every_kernel_is_covered_by_an_aot_test():
    covered = set(kernels.aot_signatures()) | set(kernels.aot_routing_signatures())
    assert set(kernels.names()) == covered
