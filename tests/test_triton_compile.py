"""The fused GEMM + All-to-All Triton kernels build ahead of time for CDNA3, CDNA2 and Hopper.

No GPU needed: ``triton.compile`` with an explicit ``GPUTarget`` runs the whole compiler.
The GEMM must use the matrix units (``v_mfma`` on AMD, ``wgmma`` on sm_90), and the
signalling must be there: a system-scope release store (or exchange) in the assembly; on
gfx942 and gfx90a the whole release sequence before each flag store (tests/amd_isa.py).
"""

import re

import pytest

import amd_isa
from rocmoe_testing import require_module

triton = require_module("triton", "ahead-of-time builds of the GEMM+All-to-All kernel")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rocmoe.ops import gpu as gpu_ops  # noqa: E402
from rocmoe.ops import triton_aot as aot  # noqa: E402
from rocmoe.ops import triton_gemm_a2a as kernels  # noqa: E402

TARGETS = {
    "gfx942": (GPUTarget("hip", "gfx942", 64), "amdgcn", "v_mfma", "hip"),
    "gfx90a": (GPUTarget("hip", "gfx90a", 64), "amdgcn", "v_mfma", "hip"),
    "sm90": (GPUTarget("cuda", 90, 32), "ptx", "wgmma", "cuda"),
}


@pytest.fixture(autouse=True)
def compiled_not_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _compile(name, target_key, dtype="bf16", exchange=True, groups_p2=1, split_k=1):
    target, _, _, platform = TARGETS[target_key]
    if name == "gemm_a2a_kernel":
        build = aot.gemm_source(platform, dtype, "exchange" if exchange else "local",
                                {"SPLIT_K": split_k}, groups_p2=groups_p2)
        return triton.compile(build.source, target=target, options=build.options)
    signature = kernels.aot_signatures(dtype)[name]
    options = {}
    constexprs = {}
    if name == "collect_kernel":
        constexprs = dict(WORLD_P2=8, ROWS=64, BLOCK_N=128)
    elif name == "abort_kernel":
        constexprs = dict(WORLD_P2=8, CLOCK=kernels.device_clock(platform))
    elif name == "grouped_weight_grad_kernel":
        constexprs = dict(WORLD_P2=8, GROUPS_P2=8, BLOCK_K=64, BLOCK_N=64, BLOCK_M=64,
                          TILES_FIRST=False)
    src = ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options=options)


@pytest.mark.parametrize("target_key", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gemm_a2a_uses_matrix_instructions(target_key, dtype):
    _, asm_key, instruction, _ = TARGETS[target_key]
    compiled = _compile("gemm_a2a_kernel", target_key, dtype)
    assert instruction in compiled.asm[asm_key], f"no {instruction} for {target_key}"


@pytest.mark.parametrize("target_key", sorted(TARGETS))
def test_grouped_gemm_a2a_uses_matrix_instructions(target_key):
    # grouped products (W [G, K, N], the MoE combine's local experts): the same kernel with
    # the segment lookup compiled in
    _, asm_key, instruction, _ = TARGETS[target_key]
    compiled = _compile("gemm_a2a_kernel", target_key, "bf16", groups_p2=8)
    assert instruction in compiled.asm[asm_key], f"no {instruction} for {target_key}"


@pytest.mark.parametrize("target_key", sorted(TARGETS))
def test_split_k_gemm_a2a_builds_with_matrix_instructions(target_key):
    # skinny X: each tile's K split over tasks that meet at a semaphore (the tuner's split
    # candidates), local and exchange modes
    _, asm_key, instruction, _ = TARGETS[target_key]
    for exchange in (False, True):
        compiled = _compile("gemm_a2a_kernel", target_key, "bf16", exchange=exchange,
                            split_k=2)
        assert instruction in compiled.asm[asm_key], f"no {instruction} for {target_key}"


# the tuner's split-and-sum tile (gpu.gemm_plans: SPLIT_SUM)
_SPLIT_SUM_TILE = next(c for c in gpu_ops.tune_candidates("cuda", rows=16) if c.get("SPLIT_SUM"))


def test_split_sum_product_lets_its_dependent_launch_start_on_sm90():
    # the product of a SPLIT_SUM tile (direct path) signals griddepcontrol.launch_dependents,
    # so that the sum's programs, launched for PDL, start while it runs
    build = aot.gemm_source("cuda", "bf16", "direct", _SPLIT_SUM_TILE, tma=True, even=True,
                            world_p2=2)
    assert build.constexprs["SPLIT_SUM"] and build.constexprs["PDL"]
    ptx = triton.compile(build.source, target=TARGETS["sm90"][0], options=build.options).asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ptx and "mma.sync" in ptx


def test_split_sum_waits_for_the_product_on_sm90():
    build = aot.split_sum_source("cuda", "bf16", _SPLIT_SUM_TILE)
    assert build.options.get("launch_pdl") is True
    compiled = triton.compile(build.source, target=TARGETS["sm90"][0], options=build.options)
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert compiled.metadata.launch_pdl


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_split_sum_builds_without_pdl_on_amd(arch):
    # CDNA has no programmatic dependent launch: the sum follows the product in stream order
    build = aot.split_sum_source("hip", "bf16", _SPLIT_SUM_TILE)
    assert build.constexprs["PDL"] is False and "launch_pdl" not in build.options
    compiled = triton.compile(build.source, target=TARGETS[arch][0], options=build.options)
    assert "global_load" in compiled.asm["amdgcn"] or "buffer_load" in compiled.asm["amdgcn"]


def test_gemm_a2a_signal_is_system_scope_release_on_sm90():
    ptx = _compile("gemm_a2a_kernel", "sm90").asm["ptx"]
    assert re.search(r"atom(\.global)?\.sys\.release\.exch", ptx), "no sys-scope release"


# the epoch signal is a 64-bit exchange into the peer's slot (tl.atomic_xchg of an int64)
SIGNAL_STORE = r"^(global|flat)_atomic_swap_x2 "


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
@pytest.mark.parametrize("groups_p2", [1, 8])
def test_gemm_a2a_signal_is_a_system_scope_release_on_amd(arch, groups_p2):
    # the tiles are in the peer's heap before its flag says so: L2 written back to system
    # scope and waited for, right before the flag store (tests/amd_isa.py)
    asm = _compile("gemm_a2a_kernel", arch, groups_p2=groups_p2).asm["amdgcn"]
    problems = amd_isa.release_problems(asm, arch, SIGNAL_STORE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
@pytest.mark.parametrize("name", ["collect_kernel", "abort_kernel"])
def test_protocol_kernel_signal_is_a_system_scope_release_on_amd(arch, name):
    asm = _compile(name, arch).asm["amdgcn"]
    problems = amd_isa.release_problems(asm, arch, SIGNAL_STORE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_gemm_a2a_local_mode_writes_back_nothing_at_system_scope_on_amd(arch):
    # world size 1 (no protocol): no flag, so no system-scope write-back either (the check
    # above would otherwise pass on a kernel that writes back everywhere)
    code = amd_isa.instructions(_compile("gemm_a2a_kernel", arch, exchange=False).asm["amdgcn"])
    assert amd_isa.SYSTEM_WRITEBACK[arch] not in code
    assert not amd_isa.flag_stores("\n".join(code), SIGNAL_STORE)


# what each target's real-time clock compiles to (Triton's globaltimer / memrealtime)
CLOCK_READ = {"sm90": "%globaltimer", "gfx942": "s_memrealtime", "gfx90a": "s_memrealtime"}


@pytest.mark.parametrize("target_key", sorted(TARGETS))
@pytest.mark.parametrize("name", ["gemm_a2a_kernel", "abort_kernel"])
def test_protocol_waits_are_bounded_by_the_device_clock(name, target_key):
    # a wait's budget is time, not a count of polls: two ranks sharing one H200 once timed
    # out at "30 s" (results/fused_gpu_h200_tenth_session_run3_nosync2rank_fail.log)
    _, asm_key, _, _ = TARGETS[target_key]
    assert CLOCK_READ[target_key] in _compile(name, target_key).asm[asm_key]


def test_gemm_a2a_local_mode_reads_no_clock_on_sm90():
    # no protocol, no wait: the clock of the waits must not cost the world-size-1 kernel
    ptx = _compile("gemm_a2a_kernel", "sm90", exchange=False).asm["ptx"]
    assert CLOCK_READ["sm90"] not in ptx


def test_gemm_a2a_local_mode_has_no_system_scope_atomic_on_sm90():
    # world size 1 (and the backward's grouped dX): no protocol, no cross-GPU memory order
    ptx = _compile("gemm_a2a_kernel", "sm90", exchange=False).asm["ptx"]
    assert ".sys" not in ptx


def test_gemm_a2a_main_loop_is_pipelined_on_sm90():
    # with divisible shapes (EVEN_N / EVEN_K, what the JIT specialises for 16-divisible
    # arguments) the K loop must become asynchronous copies into shared memory feeding
    # wgmma; without them the kernel ran at 11% of torch.matmul on an H200
    target = TARGETS["sm90"][0]
    sig = dict(kernels.aot_signatures("bf16")["gemm_a2a_kernel"], stride_xk="constexpr",
               stride_wn="constexpr")
    names = list(sig)
    aligned = ["x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wk", "ws_offset",
               "recv_off", "parity_bytes", "source_bytes"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    cfg = kernels.default_config("cuda")
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    cfg.pop("USE_TMA", None)
    constexprs = dict(cfg, WORLD_P2=8, GROUPS_P2=1, MODE=kernels.MODE_EXCHANGE, COPY=False,
                      FP32_IEEE=False, EVEN_N=True, EVEN_K=True, stride_xk=1, stride_wn=1,
                      USE_TMA=False, SPLIT_K=1, CLOCK=kernels.CLOCK_CUDA)
    src = ASTSource(fn=kernels.get("gemm_a2a_kernel"), signature=sig, constexprs=constexprs,
                    attrs=attrs)
    compiled = triton.compile(src, target=target, options=options)
    ptx = compiled.asm["ptx"]
    assert "cp.async" in ptx and "wgmma.mma_async" in ptx
    # the tile leaves as 16-byte stores into the peer's heap (2-byte ones cost 8x the
    # instructions in a non-overlapped epilogue)
    assert "st.global.v4" in ptx and "st.global.b16" not in ptx


def _tma_default_tile(mode, groups_p2=None):
    """(source, options) of gemm_a2a_kernel at the CUDA default tile with TMA loads (X and W
    as tensor descriptors) and divisible shapes, in one of triton_aot.GEMM_MODES."""
    build = aot.gemm_source("cuda", "bf16", mode, tma=True, even=True, groups_p2=groups_p2)
    return build.source, build.options


@pytest.mark.parametrize("mode", ["direct", "local", "exchange"])
def test_gemm_a2a_default_tile_does_not_spill_registers_on_sm90(mode, monkeypatch, tmp_path,
                                                               capsys):
    # the default tile (128 x 256, 8 warps, TMA loads) at world size 1 (direct), in local
    # mode with a plan and above: ptxas must keep the kernel in registers. With the
    # epilogue's rows, columns and mask made before the K loop it spilled 580-640 bytes a
    # thread (ptxas' log, Triton 3.6 and 3.9)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cached build runs no ptxas
    monkeypatch.setenv("TRITON_DUMP_PTXAS_LOG", "1")
    src, options = _tma_default_tile(mode)
    capsys.readouterr()
    triton.compile(src, target=TARGETS["sm90"][0], options=options)
    log = capsys.readouterr().out
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    assert spills, f"no ptxas log:\n{log}"
    assert all(int(b) == 0 for b in spills), log


@pytest.mark.parametrize("target_key", sorted(TARGETS))
@pytest.mark.parametrize("name", ["collect_kernel", "abort_kernel", "grouped_weight_grad_kernel"])
def test_protocol_kernel_compiles(name, target_key):
    compiled = _compile(name, target_key)
    _, asm_key, _, _ = TARGETS[target_key]
    assert compiled.asm[asm_key]


@pytest.mark.parametrize("target_key", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_weight_gradient_default_tiles_build_with_matrix_instructions(target_key, dtype):
    # the expert-parallel step's dW runs the platform's default tiles
    # (triton_gemm_a2a.weight_grad_config); each must build, bf16 with matrix instructions.
    # (No spill check: on sm_90 the measured-fastest 128 x 128 tile at 4 warps spills, see
    # weight_grad_config)
    target, asm_key, instruction, platform = TARGETS[target_key]
    build = aot.weight_grad_source(platform, dtype)
    compiled = triton.compile(build.source, target=target, options=build.options)
    if dtype == "bf16":
        assert instruction in compiled.asm[asm_key], f"no {instruction} for {target_key}"


def _grouped_tiles_source(platform, dtype, block_n=0, tma=False, trans_w=False):
    """(source, options) of grouped_tiles_kernel at the platform's default grouped tile
    (triton_gemm_a2a.grouped_config), pointer loads or (tma) tensor descriptors."""
    build = aot.grouped_tiles_source(platform, dtype, block_n, tma=tma, trans_w=trans_w)
    return build.source, build.options


@pytest.mark.parametrize("target_key", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_grouped_products_default_tiles_build_with_matrix_instructions(target_key, dtype):
    # gpu.grouped_local's kernels at each platform's default grouped tile, pointer loads
    # (CDNA, float32, operands TMA cannot address), wide and 128-wide column tiles
    target, asm_key, instruction, platform = TARGETS[target_key]
    for block_n in (0, 128):
        src, options = _grouped_tiles_source(platform, dtype, block_n)
        compiled = triton.compile(src, target=target, options=options)
        if dtype == "bf16":
            assert instruction in compiled.asm[asm_key], f"no {instruction} for {target_key}"
    plan = ASTSource(fn=kernels.get("grouped_plan_kernel"),
                     signature=kernels.aot_signatures(dtype)["grouped_plan_kernel"],
                     constexprs=dict(SEGS_P2=64, BLOCK_T=128, BLOCK_M=128, GROUP_M=8,
                                     ZERO_ROWS=64, ZERO_COLS=256))
    assert triton.compile(plan, target=target).asm[asm_key]


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("block_n", [0, 128])
def test_grouped_products_load_by_the_copy_engine_on_sm90(trans_w, block_n):
    # Hopper: X and W (as stored, or the backward's W^T from W's own storage, boxes turned
    # in registers) come by bulk tensor copies feeding wgmma, in the flattened task loop
    src, options = _grouped_tiles_source("cuda", "bf16", block_n, tma=True, trans_w=trans_w)
    ptx = triton.compile(src, target=TARGETS["sm90"][0], options=options).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("groups_p2", [1, 8])
def test_gemm_a2a_tma_variant_loads_tiles_with_the_copy_engine_on_sm90(groups_p2):
    # USE_TMA: X and W arrive as tensor descriptors; the K loop must fetch them with bulk
    # tensor copies (TMA) feeding wgmma, and the epilogue still stores into the peer's heap
    src, options = _tma_default_tile("exchange", groups_p2)
    ptx = triton.compile(src, target=TARGETS["sm90"][0], options=options).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert re.search(r"atom(\.global)?\.sys\.release\.exch", ptx), "no sys-scope release"


def _tile_id(extra):
    c = dict(kernels.default_config("cuda"), **extra)
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}/split{c.get('SPLIT_K', 1)}"


def _local_tma_source(extra, divisible=()):
    """(source, options) of gemm_a2a_kernel in local mode with TMA loads and divisible
    shapes, at the CUDA default tile updated by `extra`, as the tuner runs it: the direct
    path unless K is split. `divisible`: arguments marked divisible by 16, as the JIT
    specialises a 16-byte aligned pointer or an integer multiple of 16."""
    build = aot.gemm_source("cuda", "bf16", "direct", extra, tma=True, even=True, world_p2=2,
                            divisible=divisible)
    return build.source, build.options


@pytest.mark.parametrize("extra", [c for c in gpu_ops.tune_candidates("cuda", rows=1)
                                   if "BLOCK_M" in c or "SPLIT_K" in c], ids=_tile_id)
def test_every_tuning_tile_builds_the_tma_kernel_with_tensor_cores_on_sm90(extra):
    # the first call of a GemmAllToAll shape times these tiles on the GPU; each must build
    # for Hopper with its TMA loads and matrix instructions (local mode, as the tuner runs:
    # the direct path unless K is split): wgmma from 64 rows a tile, mma.sync below (a warp
    # group's wgmma takes 64 rows: the tiny-X tiles of 16 and 32 rows)
    src, options = _local_tma_source(extra)
    ptx = triton.compile(src, target=TARGETS["sm90"][0], options=options).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx
    if extra.get("BLOCK_M", 128) >= 64:
        assert "wgmma.mma_async" in ptx
    else:
        assert "mma.sync" in ptx


# the most shared memory a block may take on an H100 or H200 (227 KiB)
HOPPER_SHARED_BYTES = 232448


@pytest.mark.parametrize("extra", [c for c in gpu_ops.tune_candidates("cuda", rows=1)
                                   if "BLOCK_M" in c or "num_stages" in c], ids=_tile_id)
def test_every_tuning_tile_fits_hoppers_shared_memory_in_bf16(extra):
    # a bf16 candidate that cannot run on Hopper would only cost every first call of a shape
    # its compile time (the tuner skips it there); its pipeline's stages are its shared
    # memory: 128 x 128 x 64 at 6 stages takes 192 KiB, 8 would not fit
    src, options = _local_tma_source(extra)
    compiled = triton.compile(src, target=TARGETS["sm90"][0], options=options)
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED_BYTES, compiled.metadata.shared


@pytest.mark.parametrize("extra", [c for c in gpu_ops.tune_candidates("cuda", rows=1, fp32=True)
                                   if "BLOCK_M" in c or "num_stages" in c], ids=_tile_id)
def test_every_fp32_tuning_tile_fits_hoppers_shared_memory(extra):
    # float32 tiles take twice the bytes a stage: the deep 16-bit rings (328-344 KiB in
    # float32) are not float32 candidates; the rest must fit as the tuner runs them (the
    # float32 default has no TMA loads)
    build = aot.gemm_source("cuda", "fp32", "direct", extra, even=True, world_p2=2)
    compiled = triton.compile(build.source, target=TARGETS["sm90"][0], options=build.options)
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED_BYTES, compiled.metadata.shared


@pytest.mark.parametrize("tile", [{}, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                           num_stages=8)], ids=["default", "64x128"])
def test_direct_path_reads_the_count_after_its_k_loop_on_sm90(tile):
    # world size 1: the count only masks the store, so it is read after the K loop. Read at
    # the top, ptxas made every program wait for that global load before its first TMA
    # load: 6-11 % of the time at 256-512 x 4096^2 on an H200 (probe_skinny_gemm_h200.jsonl)
    src, options = _local_tma_source(tile)
    ir = triton.compile(src, target=TARGETS["sm90"][0], options=options).asm["ttgir"]
    # (the structured IR keeps the program's order; PTX places blocks in another)
    k_loop = ir.index("scf.for")
    count_loads = [m.start() for m in re.finditer(r"tt\.load %counts_ptr", ir)]
    assert count_loads, "no count load at all"
    assert min(count_loads) > k_loop, "the count is read before the K loop"


@pytest.mark.parametrize("tile", [{}, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                           num_stages=4)], ids=["default", "128x128"])
def test_direct_path_stores_its_tile_in_16_byte_vectors_on_sm90(tile):
    # with the output 16-byte aligned and N a multiple of 16 (what the JIT specialises for
    # every shape the bench runs), a bf16 tile goes out 8 elements a store; a mask that
    # varied along a row would make every element its own 2-byte store (128 a thread at
    # 128 x 256, each behind its own predicate)
    src, options = _local_tma_source(tile, divisible=("out_ptr", "N"))
    ptx = triton.compile(src, target=TARGETS["sm90"][0], options=options).asm["ptx"]
    stores = re.findall(r"st\.global[.\w]*", ptx)
    assert stores.count("st.global.v4.b32") >= 16, stores
    assert not [s for s in stores if s.endswith(".b16")], stores


# --- CDNA: what a kernel holds of a compute unit ------------------------------------------
# On CDNA a workgroup of 8 waves puts two waves on each SIMD, so a wave has 256 VGPRs and no
# AGPRs; what does not fit goes to scratch memory, through the vector memory path, inside
# the K loop. The tiles the GEMM runs on AMD GPUs (its default and every tuner candidate)
# must build for gfx942 and gfx90a without spilling, in every mode a handle runs them:
# world size 1 (the direct path; a grouped W plans its tiles), and the exchange epilogue
# (one W, grouped). The 256 x 256 tile these replaced spilled 85-194 VGPRs a lane.
CDNA = ["gfx942", "gfx90a"]
CDNA_LDS = 64 * 1024  # a CU's local data share


def _cdna_gemm(arch, extra, mode, dtype):
    """gemm_a2a_kernel built for `arch` at CDNA's default tile updated by `extra` (a tuner
    candidate), compiled with the options the handle's launch passes (gpu.launch_options),
    with the edge masks on (N and K not multiples of the tile)."""
    build = aot.gemm_source("hip", dtype, mode, extra)
    return triton.compile(build.source, target=TARGETS[arch][0], options=build.options)


def _cdna_problems(compiled, what) -> list[str]:
    """What of a CDNA build breaks the rule above: a spill, scratch, LDS past a CU's, or no
    MFMA instruction (float32 too: CDNA's v_mfma_f32_*_f32, IEEE products)."""
    asm = compiled.asm["amdgcn"]
    r = amd_isa.resources(asm)
    problems = []
    if r["vgpr_spills"] or r["scratch_bytes"]:
        problems.append(f"{what}: {r['vgpr_spills']} VGPRs spilled, {r['scratch_bytes']} bytes "
                        f"of scratch a lane ({r})")
    if compiled.metadata.shared > CDNA_LDS:
        problems.append(f"{what}: {compiled.metadata.shared} bytes of LDS")
    if "v_mfma" not in asm:
        problems.append(f"{what}: no v_mfma")
    return problems


@pytest.mark.parametrize("arch", CDNA)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("mode", aot.UNSPLIT_MODES)
def test_gemm_a2a_cdna_default_tile_keeps_to_registers_and_lds(arch, dtype, mode):
    problems = _cdna_problems(_cdna_gemm(arch, {}, mode, dtype), f"{dtype} default tile")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", CDNA)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("mode", aot.UNSPLIT_MODES)
def test_every_cdna_tuning_tile_keeps_to_registers_and_lds(arch, dtype, mode):
    # the first call of a GemmAllToAll shape on an AMD GPU times these (skinny X: all of
    # them), and the handle then runs the fastest in every call, also at world size > 1
    problems = []
    for extra in gpu_ops.tune_candidates("hip", rows=1, fp32=dtype == "fp32"):
        if extra:
            problems += _cdna_problems(_cdna_gemm(arch, extra, mode, dtype),
                                       f"{dtype} {extra}")
    assert not problems, "\n".join(problems)


def test_cdna_tuning_tiles_pass_amd_options_to_the_compiler():
    # a candidate's HIP options (16 x 16 MFMA) go to Triton as options, not constexprs: the
    # build must change (a key the compiler ignored would time the default twice)
    extra = next(c for c in gpu_ops.tune_candidates("hip", rows=1) if "matrix_instr_nonkdim" in c)
    assert gpu_ops.launch_options(dict(kernels.default_config("hip"), **extra))[
        "matrix_instr_nonkdim"] == 16
    default = _cdna_gemm("gfx942", {}, "direct", "bf16").asm["amdgcn"]
    narrow = _cdna_gemm("gfx942", extra, "direct", "bf16").asm["amdgcn"]
    assert "v_mfma_f32_32x32" in default and "v_mfma_f32_32x32" not in narrow
    assert "v_mfma_f32_16x16" in narrow


@pytest.mark.parametrize("arch", CDNA)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_grouped_products_cdna_default_tile_keeps_to_registers_and_lds(arch, dtype):
    src, options = _grouped_tiles_source("hip", dtype)
    compiled = triton.compile(src, target=TARGETS[arch][0], options=options)
    problems = _cdna_problems(compiled, f"grouped {dtype}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", CDNA)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_weight_gradient_cdna_default_tile_keeps_to_registers_and_lds(arch, dtype):
    build = aot.weight_grad_source("hip", dtype)
    compiled = triton.compile(build.source, target=TARGETS[arch][0], options=build.options)
    problems = _cdna_problems(compiled, f"weight gradient {dtype}")
    assert not problems, "\n".join(problems)

