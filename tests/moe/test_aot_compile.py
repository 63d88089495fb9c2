"""Every Triton kernel builds ahead of time for CDNA3, CDNA2 and Hopper, with matrix units."""

import os

import pytest

from rocmoe_testing import require_module

triton = require_module("triton", "ahead-of-time builds of the MoE kernels")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import amd_isa  # noqa: E402
from rocmoe.moe import blocksparse, kernels  # noqa: E402

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
                                        ("dstd_kernel", True), ("dstd_persistent_kernel", False),
                                        ("sdd_persistent_kernel", False),
                                        ("sdd_persistent_kernel", True)])
def test_kernel_compiles_with_matrix_instructions(name, fused, target, asm_key, instruction):
    signature = kernels.aot_signatures("bf16")[name]
    # fused: the GELU prologue (DSD, DSᵀD) or the act' epilogue (SDD) must not cost the MMAs
    act = dict(ACT=kernels.ACT_GELU_TANH, EPILOGUE_ACT_GRAD=kernels.ACT_GELU_TANH,
               EPILOGUE_STORE_ACT=kernels.ACT_GELU_TANH) if fused else {}
    constexprs = kernels.aot_constexprs(name, **act)
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    assert instruction in compiled.asm[asm_key], f"{name} for {target} has no {instruction}"


@pytest.mark.parametrize("target", [t for t, _, _ in TARGETS[:2]], ids=["gfx942", "gfx90a"])
@pytest.mark.parametrize("name", ["sdd_kernel", "dsd_kernel", "dstd_kernel"])
def test_kernel_keeps_to_registers_at_the_cdna_config(name, target):
    # what the layer launches on AMD GPUs (pointer loads; blocksparse.CDNA_OVERRIDES' waves
    # and stages, plain and with the activation fused): with 8 waves a workgroup a wave has
    # 256 VGPRs, and a spill would go to scratch memory inside the K loop
    gelu = kernels.ACT_GELU_TANH
    options = {k: blocksparse.CDNA_OVERRIDES[k] for k in ("num_warps", "num_stages")}
    for act in ({}, dict(ACT=gelu, EPILOGUE_ACT_GRAD=gelu, EPILOGUE_STORE_ACT=gelu)):
        src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                        constexprs=kernels.aot_constexprs(name, **act))
        compiled = triton.compile(src, target=target, options=options)
        r = amd_isa.resources(compiled.asm["amdgcn"])
        assert r["vgpr_spills"] == 0 and r["scratch_bytes"] == 0, (act, r)
        assert compiled.metadata.shared <= 64 * 1024, (act, compiled.metadata.shared)


@pytest.mark.parametrize("target,asm_key,instruction", TARGETS,
                         ids=["gfx942", "gfx90a", "sm90"])
@pytest.mark.parametrize("name", ["sdd_kernel", "dsd_kernel", "sdd_persistent_kernel"])
def test_grouped_tile_order_compiles_with_matrix_instructions(name, target, asm_key,
                                                               instruction):
    # group_m > 1 (row blocks sharing each weight tile) only changes which tile a program
    # takes: it must build with the matrix units on every target too
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=kernels.aot_constexprs(name, GROUP_M=8))
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    assert instruction in compiled.asm[asm_key], f"{name} for {target} has no {instruction}"


@pytest.mark.parametrize("target", [TARGETS[0][0], TARGETS[2][0]], ids=["gfx942", "sm90"])
@pytest.mark.parametrize("name", sorted(kernels.aot_routing_signatures()))
def test_routing_kernel_compiles(name, target):
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_routing_signatures()[name],
                    constexprs=kernels.ROUTING_AOT_CONSTEXPRS[name])
    compiled = triton.compile(src, target=target, options={"num_warps": 4})
    assert compiled.asm.get("amdgcn") or compiled.asm.get("ptx")


def test_every_kernel_is_covered_by_an_aot_test():
    covered = set(kernels.aot_signatures()) | set(kernels.aot_routing_signatures())
    assert set(kernels.names()) == covered


# kernels whose operands may be plain pointers (the persistent DSᵀD takes descriptors only)
POINTER_KERNELS = ["dsd_kernel", "dstd_kernel", "sdd_kernel"]


@pytest.mark.parametrize("dtype,elsize", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("name", POINTER_KERNELS)
def test_chosen_tiles_fit_hopper_shared_memory(name, dtype, elsize):
    # The launcher picks the N tile and the stages from the operand size; compile that choice
    # with the same alignment/unit-stride specialisation a JIT launch gets, and check the
    # shared memory it needs (a 128x256 fp32 tile with 3 stages needed 288 KiB: a GPU failure).
    import torch
    from rocmoe.moe import blocksparse as bs
    unit = {"sdd_kernel": ["stride_ak", "stride_wf"], "dsd_kernel": ["stride_wn", "stride_on"],
            "dstd_kernel": ["stride_bn", "stride_on"]}[name]
    cpu = torch.device("cpu")  # _fit uses Hopper's 227 KiB for non-GPU devices
    want = 256 if name != "sdd_kernel" else 2 * 128
    tile, stages = bs._fit(cpu, 128, want, 64, elsize, 16 if name != "sdd_kernel" else 128)
    signature = dict(kernels.aot_signatures(dtype)[name])
    constexprs = kernels.aot_constexprs(name, SPLIT=tile // 128, BLOCK_N=tile)
    for u in unit:
        signature[u] = "constexpr"
        constexprs[u] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
             if t != "constexpr" and n != "nb"}
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs,
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": stages})
    assert compiled.metadata.shared <= 232448, (tile, stages, compiled.metadata.shared)


@pytest.mark.parametrize("name", POINTER_KERNELS)
def test_operands_load_as_16_byte_async_copies_on_sm90(name):
    # With the alignment a JIT launch sees, no operand may fall back to 2-byte scalar loads:
    # on the H200's Triton 3.6 DSD's sparse operand did (its offset came from a pointer
    # bumped inside the loop), which kept it out of the pipeline at ~40% of SDD's speed.
    unit = {"sdd_kernel": ["stride_ak", "stride_wf"], "dsd_kernel": ["stride_wn", "stride_on"],
            "dstd_kernel": ["stride_bn", "stride_on"]}[name]
    signature = dict(kernels.aot_signatures("bf16")[name])
    constexprs = kernels.aot_constexprs(name)
    for u in unit:
        signature[u] = "constexpr"
        constexprs[u] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
             if t != "constexpr" and n not in ("nb", "num_n")}
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs,
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    assert "cp.async" in ptx and "ld.global.b16" not in ptx


# Tensor-descriptor (TMA) operands of each kernel: argument -> box shape, for B=128,
# BLOCK_K=64 and a 256-wide N tile (SDD: SPLIT=2). W_T: the weight arrives transposed.
TMA_VARIANTS = {
    ("sdd_kernel", False): dict(a_ptr=[128, 64], w_ptr=[64, 256]),
    ("sdd_kernel", True): dict(a_ptr=[128, 64], w_ptr=[256, 64]),
    ("dsd_kernel", False): dict(s_ptr=[128, 64], w_ptr=[64, 256]),
    ("dsd_kernel", True): dict(s_ptr=[128, 64], w_ptr=[256, 64]),
    ("dstd_kernel", False): dict(s_ptr=[64, 128], b_ptr=[64, 256]),
    ("dstd_persistent_kernel", False): dict(s_ptr=[64, 128], b_ptr=[64, 256]),
    ("sdd_persistent_kernel", False): dict(a_ptr=[128, 64], w_ptr=[64, 256]),
    ("sdd_persistent_kernel", True): dict(a_ptr=[128, 64], w_ptr=[256, 64]),
}


@pytest.mark.parametrize("name,w_t", sorted(TMA_VARIANTS), ids=lambda v: str(v))
def test_tma_variant_loads_tiles_with_the_copy_engine_on_sm90(name, w_t):
    # USE_TMA: the K loop must fetch every operand with bulk tensor copies feeding wgmma
    # (no pointer loads of the operands left), and shared memory must still fit Hopper.
    signature = dict(kernels.aot_signatures("bf16")[name])
    for arg, box in TMA_VARIANTS[(name, w_t)].items():
        signature[arg] = f"tensordesc<bf16[{box[0]}, {box[1]}]>"
    constexprs = kernels.aot_constexprs(name, W_T=w_t, BLOCK_N=256,
                                        **({"USE_TMA": True} if "USE_TMA" in signature else {}))
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    # (the pointer variant's pipelined loads are cp.async.cg copies: none may be left)
    assert "cp.async.cg" not in ptx
    assert compiled.metadata.shared <= 232448


@pytest.mark.parametrize("epilogue", ["EPILOGUE_STORE_ACT", "EPILOGUE_ACT"])
def test_fast_activation_epilogue_uses_one_special_function_per_element_on_sm90(epilogue):
    # FAST_ACT: GELU and GELU' of the forward SDD's tile share one tanh.approx per element
    # (exp + reciprocal per element made the epilogue a third of the kernel on an H200);
    # the inference epilogue (GELU alone) needs one as well
    name = "sdd_kernel"
    constexprs = kernels.aot_constexprs(name, FAST_ACT=True,
                                        **{epilogue: kernels.ACT_GELU_TANH})
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    assert ptx.count("tanh.approx.f32") == 128  # 128 x 256 tile over 256 threads
    assert "ex2.approx" not in ptx and "div.full.f32" not in ptx and "rcp." not in ptx


@pytest.mark.parametrize("preload", [False, True])
def test_preloaded_scale_is_read_before_the_k_loop_on_sm90(preload):
    # PRELOAD_SCALE: the backward SDD's act'(h) tile is read before the products, so no
    # global load is left after the first wgmma (without it, the epilogue reads it)
    name = "sdd_kernel"
    constexprs = kernels.aot_constexprs(name, EPILOGUE_SCALE=True, PRELOAD_SCALE=preload)
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    after_first_mma = ptx[ptx.index("wgmma.mma_async"):]
    assert ("ld.global" in after_first_mma) != preload
    assert ".local" not in ptx  # the preloaded tile must not spill


@pytest.mark.parametrize("out_t", [False, True], ids=["dW2_layout", "dW1_layout"])
@pytest.mark.parametrize("name", ["dstd_kernel", "dstd_persistent_kernel"])
def test_tma_store_writes_the_output_tile_with_the_copy_engine_on_sm90(name, out_t):
    # TMA_STORE: DSᵀD's tile leaves through one bulk tensor store (in both output layouts),
    # with no per-thread global stores left
    signature = dict(kernels.aot_signatures("bf16")[name])
    signature.update(s_ptr="tensordesc<bf16[64, 128]>", b_ptr="tensordesc<bf16[64, 128]>",
                     out_ptr="tensordesc<bf16[128, 128]>")
    extra = {"USE_TMA": True} if "USE_TMA" in signature else {}
    constexprs = kernels.aot_constexprs(name, BLOCK_N=128, TMA_STORE=True, OUT_T=out_t, **extra)
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx
    assert "st.global" not in ptx


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["dstd_persistent_kernel", "sdd_persistent_kernel"])
def test_persistent_kernel_is_one_software_pipelined_loop_on_sm90(name, stages):
    # The flat loop over all of a program's k steps is pipelined as one loop: its prologue
    # issues the first stages - 1 steps' two operand copies and the loop body one step's, so
    # loads run ahead across tile boundaries. (A nested tile/k loop would leave each tile's
    # first loads exposed; Triton's own flatten cannot fuse it, its inner trip count being
    # loaded.) The SDD variant here carries the forward's act/act' epilogue.
    extra = dict(EPILOGUE_STORE_ACT=kernels.ACT_GELU_TANH, FAST_ACT=True, SPLIT=1) \
        if name == "sdd_persistent_kernel" else dict(BLOCK_N=128)
    signature = dict(kernels.aot_signatures("bf16")[name])
    if name == "sdd_persistent_kernel":
        signature["w_ptr"] = "tensordesc<bf16[64, 128]>"
    src = ASTSource(fn=kernels.get(name), signature=signature,
                    constexprs=kernels.aot_constexprs(name, **extra))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": stages})
    ttgir = compiled.asm["ttgir"]
    assert ttgir.count("async_tma_copy_global_to_local") == 2 * stages
    assert ttgir.count("warp_group_dot ") >= 1
    assert ".local" not in compiled.asm["ptx"]  # nothing spills
    # two programs fit on an SM (228 KiB of shared memory)
    assert compiled.metadata.shared <= 228 * 1024 // 2 - 1024


TAIL_BOXES = {
    "sdd_kernel": dict(a_ptr=[128, 64], w_ptr=[64, 128]),
    "dsd_kernel": dict(s_ptr=[128, 64], w_ptr=[64, 128]),
}


@pytest.mark.parametrize("name", sorted(TAIL_BOXES))
def test_tail_variant_adds_a_half_height_loop_in_the_same_shared_memory_on_sm90(name):
    # TAIL: a row block with at most B/2 real rows runs a 64-row K loop of its own (its
    # sparse or token operand by pointer, cp.async: no third descriptor to encode per
    # launch). Both loops are pipelined, and the shared memory (whose size decides how
    # many programs share an SM) stays that of the full-height loop alone.
    def build(tail):
        signature = dict(kernels.aot_signatures("bf16")[name])
        for arg, box in TAIL_BOXES[name].items():
            signature[arg] = f"tensordesc<bf16[{box[0]}, {box[1]}]>"
        constexprs = kernels.aot_constexprs(name, USE_TMA=True, TAIL=tail, SPLIT=1,
                                            BLOCK_N=128)
        # the alignment a JIT launch sees (16-byte pointers and strides; unit inner strides)
        for u in ("stride_ak", "stride_wf", "stride_wn", "stride_on"):
            if u in signature:
                signature[u], constexprs[u] = "constexpr", 1
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
                 if t[0] in "*i" and n not in ("nb", "num_n")}
        src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs,
                        attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    full, tail = build(False), build(True)
    copies = full.asm["ttgir"].count("async_tma_copy_global_to_local")
    # the half loop: the weight by descriptor as in the full loop, the other by cp.async
    assert tail.asm["ttgir"].count("async_tma_copy_global_to_local") == copies * 3 // 2
    assert "cp.async.cg" in tail.asm["ptx"] and "cp.async.cg" not in full.asm["ptx"]
    assert tail.metadata.shared <= full.metadata.shared
    assert ".local" not in tail.asm["ptx"]


@pytest.mark.parametrize("target", [TARGETS[0][0], TARGETS[2][0]], ids=["gfx942", "sm90"])
@pytest.mark.parametrize("name", ["dsd_kernel", "sdd_kernel"])
def test_tail_variant_compiles_with_pointer_loads(name, target):
    # the pointer-load build (AMD, and NVIDIA without TMA) with the half-block path
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=kernels.aot_constexprs(name, TAIL=True))
    compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 2})
    asm = compiled.asm.get("amdgcn") or compiled.asm["ptx"]
    assert "v_mfma" in asm or "wgmma" in asm


@pytest.mark.parametrize("target,asm_key,instruction", TARGETS,
                         ids=["gfx942", "gfx90a", "sm90"])
@pytest.mark.parametrize("name,flag", [("sdd_kernel", "GATHER_A"), ("dstd_kernel", "GATHER_B")])
def test_gathered_operand_compiles_with_matrix_instructions(name, flag, target, asm_key,
                                                            instruction):
    # gather_rows: SDD's token operand and dW1's DSᵀD operand read through the row map
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=kernels.aot_constexprs(name, **{flag: True}))
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    assert instruction in compiled.asm[asm_key], f"{name} for {target} has no {instruction}"


@pytest.mark.parametrize("name", ["sdd_kernel", "dstd_kernel", "dstd_persistent_kernel"])
def test_gathered_operand_beside_descriptors_is_pipelined_on_sm90(name):
    # On Hopper the gathered rows come by cp.async (16-byte copies, pipelined) while the
    # other operand keeps its tensor descriptor; nothing spills, shared memory still fits.
    signature = dict(kernels.aot_signatures("bf16")[name])
    if name == "sdd_kernel":
        signature["w_ptr"] = "tensordesc<bf16[64, 256]>"
        extra = dict(USE_TMA=True, GATHER_A=True, BLOCK_N=256)
        unit = ["stride_ak"]
    else:
        signature["s_ptr"] = "tensordesc<bf16[64, 128]>"
        signature["b_ptr"] = "*bf16"
        extra = dict(GATHER_B=True, BLOCK_N=128, **({"USE_TMA": True}
                                                     if name == "dstd_kernel" else {}))
        unit = ["stride_bn"]
    constexprs = kernels.aot_constexprs(name, **extra)
    for u in unit:
        signature[u], constexprs[u] = "constexpr", 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
             if t[0] in "*i" and n not in ("nb", "num_n", "num_tiles")}
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs,
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4 if "dstd" in name else 8,
                                       "num_stages": 3})
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    assert "cp.async.cg" in ptx and "ld.global.b16" not in ptx
    assert "async_tma_copy_global_to_local" in ttgir and "wgmma.mma_async" in ptx
    assert ".local" not in ptx
    assert compiled.metadata.shared <= 232448


@pytest.mark.parametrize("target", [TARGETS[0][0], TARGETS[2][0]], ids=["gfx942", "sm90"])
@pytest.mark.parametrize("epilogue", ["STORE_PRE", "REWRITE_ACT"])
def test_recompute_epilogues_compile_with_matrix_instructions(epilogue, target):
    # act_fusion="recompute": the forward SDD stores h and act(h) (STORE_PRE), the backward
    # SDD scales by act'(h) and writes act(h) over h (REWRITE_ACT)
    act = dict(EPILOGUE_STORE_ACT=kernels.ACT_GELU_TANH) if epilogue == "STORE_PRE" \
        else dict(EPILOGUE_ACT_GRAD=kernels.ACT_GELU_TANH)
    src = ASTSource(fn=kernels.get("sdd_kernel"), signature=kernels.aot_signatures()["sdd_kernel"],
                    constexprs=kernels.aot_constexprs("sdd_kernel", **{epilogue: True}, **act))
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    asm = compiled.asm.get("amdgcn") or compiled.asm["ptx"]
    assert "v_mfma" in asm or "wgmma" in asm


def test_backward_epilogue_of_recompute_takes_one_special_function_per_element_on_sm90():
    # REWRITE_ACT computes act(h) and act'(h) from one sigmoid (tanh.approx with FAST_ACT):
    # the backward pays what the forward of act_fusion="store" paid, no more
    constexprs = kernels.aot_constexprs("sdd_kernel", FAST_ACT=True, REWRITE_ACT=True,
                                        EPILOGUE_ACT_GRAD=kernels.ACT_GELU_TANH)
    src = ASTSource(fn=kernels.get("sdd_kernel"), signature=kernels.aot_signatures()["sdd_kernel"],
                    constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    assert ptx.count("tanh.approx.f32") == 128  # 128 x 256 tile over 256 threads
    assert "ex2.approx" not in ptx


@pytest.mark.parametrize("target,asm_key,instruction", TARGETS,
                         ids=["gfx942", "gfx90a", "sm90"])
@pytest.mark.parametrize("name", ["sdd_kernel", "dsd_kernel", "dstd_kernel"])
def test_compact_values_compile_with_matrix_instructions(name, target, asm_key, instruction):
    # compact_values: the sparse values as [pairs, nb * B] rows (pointer loads and stores)
    src = ASTSource(fn=kernels.get(name), signature=kernels.aot_signatures("bf16")[name],
                    constexprs=kernels.aot_constexprs(name, COMPACT=True, TAIL=True))
    compiled = triton.compile(src, target=target, options={"num_warps": 8, "num_stages": 3})
    assert instruction in compiled.asm[asm_key], f"{name} for {target} has no {instruction}"


COMPACT_TMA = {
    "dsd_kernel": dict(s_ptr=[128, 64], w_ptr=[64, 256]),
    "dstd_kernel": dict(s_ptr=[64, 128], b_ptr=[64, 256]),
    "dstd_persistent_kernel": dict(s_ptr=[64, 128], b_ptr=[64, 256]),
    "sdd_persistent_kernel": dict(a_ptr=[128, 64], w_ptr=[64, 256]),
}


@pytest.mark.parametrize("name", sorted(COMPACT_TMA))
def test_compact_values_load_by_descriptor_on_sm90(name):
    # On Hopper the compact values' tiles come by bulk tensor copies, as the blocks' do,
    # feeding wgmma, with no pointer copies of the operands left and no spills
    signature = dict(kernels.aot_signatures("bf16")[name])
    for arg, box in COMPACT_TMA[name].items():
        signature[arg] = f"tensordesc<bf16[{box[0]}, {box[1]}]>"
    extra = {"USE_TMA": True} if "USE_TMA" in signature else {}
    constexprs = kernels.aot_constexprs(name, COMPACT=True, BLOCK_N=256, **extra)
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "cp.async.cg" not in ptx and ".local" not in ptx
    assert compiled.metadata.shared <= 232448
