"""Ahead-of-time sources of the fused GEMM's Triton kernels, built as a GemmAllToAll handle
launches them (gpu.gemm_plans._GemmLaunch, gpu.grouped_local, the weight gradient): the
constexprs a tile config gives the kernel and the compile options it gives Triton.

Why one module: the compile tests (tests/test_triton_compile.py) and the resource tools
(benchmarks/amdgcn_resources.py, benchmarks/ptxas_spills.py) build these kernels without a
GPU to check what a launch would run (matrix instructions, no spill, no scratch, shared
memory). Each of them had its own copy of this setup, and a copy that drifts from the
launch checks a kernel nobody runs. Needs Triton (imported here, not by rocmoe.ops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from triton.compiler import ASTSource

from . import triton_gemm_a2a as kernels
from .gpu import launch_options
from .gpu.gemm_plans import SPLIT_SUM_BLOCK, split_sum_modes, split_sum_options

# the modes a GemmAllToAll handle runs a tile in: (kernel MODE, the DIRECT path, GROUPS_P2)
# - direct: world size 1, one W (X's own tiles, no plan; K split or not)
# - local / local_grouped: world size 1 with a plan (W [G, K, N]; "local", one W with a
#   plan, is what a handle ran split K in before the direct path split K too)
# - exchange / exchange_grouped: world size > 1, tiles stored into the peers' heaps
GEMM_MODES = {"direct": (kernels.MODE_LOCAL, True, 1),
              "local": (kernels.MODE_LOCAL, False, 1),
              "local_grouped": (kernels.MODE_LOCAL, False, 8),
              "exchange": (kernels.MODE_EXCHANGE, False, 1),
              "exchange_grouped": (kernels.MODE_EXCHANGE, False, 8)}
# every mode a tile that does not split K runs in (a split K runs direct, or in the plain
# local mode built for it by earlier releases)
UNSPLIT_MODES = ("direct", "local_grouped", "exchange", "exchange_grouped")


@dataclass
class AotBuild:
    """One kernel build: `triton.compile(build.source, target=..., options=build.options)`.
    `constexprs` and `cfg` (the tile config it came from) say what was built."""
    source: ASTSource
    options: dict
    constexprs: dict
    cfg: dict

    def tile(self) -> str:
        return f"{self.cfg['BLOCK_M']}x{self.cfg['BLOCK_N']}x{self.cfg['BLOCK_K']}"


def _source(name: str, signature: dict, constexprs: dict,
            divisible: Sequence[str] = ()) -> ASTSource:
    """`divisible`: arguments marked divisible by 16, as the JIT specialises a 16-byte
    aligned pointer or an integer multiple of 16."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    return ASTSource(fn=kernels.get(name), signature=signature, constexprs=constexprs,
                     attrs=attrs)


def gemm_source(platform: str, dtype: str = "bf16", mode: str = "exchange",
                extra: Optional[dict] = None, *, tma: bool = False, even: bool = False,
                world_p2: int = 8, groups_p2: Optional[int] = None,
                divisible: Sequence[str] = ()) -> AotBuild:
    """gemm_a2a_kernel at `platform`'s default tile ("cuda" or "hip",
    triton_gemm_a2a.default_config) updated by `extra` (a tuner candidate,
    gpu.tune_candidates), in one of GEMM_MODES. `even`: N and K multiples of the tile (the
    edge masks compiled out, as for every bench shape); `tma`: X and W loaded by tensor
    descriptors (Hopper; the launch's choice for aligned operands)."""
    fp32 = dtype == "fp32"
    cfg = dict(kernels.default_config(platform, fp32), **(extra or {}))
    kmode, direct, mode_groups = GEMM_MODES[mode]
    split_k = int(cfg.get("SPLIT_K", 1))
    # a split summed by split_sum_kernel, a second launch: the direct path only, for
    # programmatic dependent launch on CUDA (gpu.gemm_plans.split_sum_modes)
    split_sum, pdl = split_sum_modes(cfg, direct, platform)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # as gpu.gemm_plans._GemmLaunch makes them (PROGRAMS_PER_SM and USE_TMA in a config are
    # the grid's and the launch's, not constexprs of their own)
    constexprs = dict(WORLD_P2=world_p2, GROUPS_P2=groups_p2 or mode_groups, BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], MODE=kmode, COPY=False,
                      FP32_IEEE=fp32, EVEN_N=even, EVEN_K=even, USE_TMA=tma, SPLIT_K=split_k,
                      DIRECT=direct, CLOCK=kernels.device_clock(platform),
                      SPLIT_SUM=split_sum, PDL=pdl)
    signature = dict(kernels.aot_signatures(dtype)["gemm_a2a_kernel"])
    if tma:
        signature.update(x_ptr=f"tensordesc<{dtype}[{bm}, {bk}]>",
                         w_ptr=f"tensordesc<{dtype}[{bk}, {bn}]>")
    return AotBuild(_source("gemm_a2a_kernel", signature, constexprs, divisible),
                    launch_options(cfg), constexprs, cfg)


def split_sum_source(platform: str, dtype: str = "bf16", extra: Optional[dict] = None
                     ) -> AotBuild:
    """split_sum_kernel, the second launch of a SPLIT_SUM tile config (`extra` over the
    platform's default, as gemm_source takes it), with the constexprs and launch options
    gpu.gemm_plans gives it (launched for PDL on CUDA)."""
    cfg = dict(kernels.default_config(platform, dtype == "fp32"), **(extra or {}))
    _, pdl = split_sum_modes(cfg, True, platform)
    constexprs = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      SPLIT_K=int(cfg.get("SPLIT_K", 1)), BLOCK=SPLIT_SUM_BLOCK, PDL=pdl)
    return AotBuild(_source("split_sum_kernel", kernels.aot_signatures(dtype)["split_sum_kernel"],
                            constexprs), split_sum_options(pdl), constexprs, cfg)


def grouped_tiles_source(platform: str, dtype: str = "bf16", block_n: int = 0, *,
                         tma: bool = False, trans_w: bool = False) -> AotBuild:
    """grouped_tiles_kernel (gpu.grouped_local's products) at the platform's default grouped
    tile (triton_gemm_a2a.grouped_config), pointer loads or (tma) tensor descriptors, edge
    masks on; `block_n` as grouped_config takes it."""
    cfg = kernels.grouped_config(platform, dtype == "fp32", block_n)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    signature = dict(kernels.aot_signatures(dtype)["grouped_tiles_kernel"])
    if tma:
        signature.update(x_ptr=f"tensordesc<{dtype}[{bm}, {bk}]>",
                         w_ptr=f"tensordesc<{dtype}[{bn}, {bk}]>" if trans_w
                         else f"tensordesc<{dtype}[{bk}, {bn}]>")
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_TMA=tma, TRANS_W=trans_w,
                      EVEN_N=False, EVEN_K=False, FP32_IEEE=dtype == "fp32",
                      FLATTEN=cfg["FLATTEN"])
    return AotBuild(_source("grouped_tiles_kernel", signature, constexprs),
                    launch_options(cfg), constexprs, cfg)


def weight_grad_source(platform: str, dtype: str = "bf16", world_p2: int = 2,
                       groups_p2: int = 32) -> AotBuild:
    """grouped_weight_grad_kernel (the grouped GEMM's dW) at the platform's tile
    (triton_gemm_a2a.weight_grad_config)."""
    cfg = kernels.weight_grad_config(platform, dtype == "fp32")
    options = launch_options(cfg)
    constexprs = dict({k: v for k, v in cfg.items() if k not in options},
                      WORLD_P2=world_p2, GROUPS_P2=groups_p2)
    return AotBuild(_source("grouped_weight_grad_kernel",
                            kernels.aot_signatures(dtype)["grouped_weight_grad_kernel"],
                            constexprs), options, constexprs, cfg)
