"""GemmAllToAll on the GPU: the tile configs and their tuner, a plan per rows class of X
(rows_class), the row exchange (rows_exchange) and the lean call that launches a plan with
a few identity and integer checks (lean_gemm_call).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ... import native_launch
from ..._triton import sm_count, tensor_descriptor, tma_capable
from .._common import PLAIN_TENSORS
from ..outputs import OutputRing, capturing
from .team import Team, _clock, _device_ints, _first_call_budget, _wait_budget, team_for
from .triton_launcher import _LAUNCHERS, _PLATFORM


_CPU_PROGRAMS = 4  # the most programs a GEMM runs on the interpreter (_num_programs)

# split_sum_kernel's elements a program (a 16 x 4096 output is 128 programs)
SPLIT_SUM_BLOCK = 512


def split_sum_modes(cfg: dict, direct: bool, platform: str, pdl_capable: bool = True) -> tuple:
    """(SPLIT_SUM, PDL) of a tile config: its SPLIT_SUM holds on the DIRECT path with K
    split (anywhere else a split tile joins in the kernel, _split_join); PDL, the sum
    launched for programmatic dependent launch, on CUDA where the device has it (Hopper, not
    the interpreter: tma_capable)."""
    split_sum = bool(cfg.get("SPLIT_SUM")) and direct and int(cfg.get("SPLIT_K", 1)) > 1
    return split_sum, split_sum and platform == "cuda" and pdl_capable


def split_sum_options(pdl: bool) -> dict:
    """split_sum_kernel's launch options."""
    return dict(num_warps=4, **({"launch_pdl": True} if pdl else {}))


def direct_tasks(max_rows: int, most_rows: Optional[int], bm: int, n_tiles: int,
                 sms: int) -> int:
    """The tiles the DIRECT path's grid is sized for (the grid is then this many programs,
    or fewer, persistent, when there are many): the tiles of the rows class's fewest rows
    (`most_rows` // 2 + 1, a power of two), but no fewer than the GPU has SMs while its
    most rows (`most_rows`, at most the handle's `max_rows`) have tiles for them. Its
    programs loop over the tiles X's rows make, so the grid sets how many run at once, never
    which rows are computed. Sized by the handle's capacity alone, a call of 512 rows on a
    handle of 4096 launched 4 x the programs it had tiles for, the rest scheduled only to
    exit; sized by the class's most rows (1023), twice (512 x 4096^2 on an H100: 0.909 of
    torch.matmul queued against 0.956 for a handle of 512 rows, whose grid this rule gives
    within 4 programs; the rule itself has not been timed on a GPU)."""
    if most_rows is None:
        return math.ceil(max(max_rows, 1) / bm) * n_tiles
    most = math.ceil(max(min(max_rows, most_rows), 1) / bm) * n_tiles
    fewest = math.ceil(max(min(max_rows, most_rows // 2 + 1), 1) / bm) * n_tiles
    return min(most, max(fewest, sms))


def _num_programs(device: torch.device, total_tasks: int, per_sm: Optional[float] = None) -> int:
    """Grid of the GEMM: `per_sm` programs per SM/CU, 0 for one per task (the hardware then
    overlaps one tile's epilogue with another's main loop). None picks by tiles per SM, as
    measured on an H200 (bf16, 128x256 tiles; benchmarks/results/gemm_sweep_h200.json): with
    few (4096^3: 3.9) one program per tile ran at 0.78 of torch.matmul against 0.50
    persistent; with many (8192^3: 15.5) persistent won, 0.84 against 0.75."""
    if device.type == "cpu":
        return max(1, min(total_tasks, 4))
    sms = sm_count(device)
    if per_sm is None:
        per_sm = 0 if total_tasks <= 8 * sms else 1
    if per_sm <= 0:
        return max(1, total_tasks)
    return max(1, min(total_tasks, int(sms * per_sm)))


def gemm_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The GEMM kernel's tile and launch options."""
    from .. import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    else:
        cfg = tk.default_config(_PLATFORM, dtype == torch.float32)
    # ROCMOE_GEMM_CONFIG='{"BLOCK_N": 128, "USE_TMA": true}' overrides entries (tuning)
    return _overridden(cfg, "ROCMOE_GEMM_CONFIG")


def _overridden(cfg: dict, variable: str) -> dict:
    """`cfg` with the entries of the JSON object in environment variable `variable`."""
    override = os.environ.get(variable)
    if override:
        import json
        cfg.update(json.loads(override))
    return cfg


def copy_config(device: torch.device, width: int) -> dict:
    """Tiles of the row exchange (no W): wide rows of a few rows each."""
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=1)
    bn = min(256, max(16, 1 << (max(width, 1) - 1).bit_length()))
    return dict(BLOCK_M=32, BLOCK_N=bn, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=1)


def tma_operands_fit(x: torch.Tensor, w: Optional[torch.Tensor], cfg: dict) -> bool:
    """Whether the GEMM loads X and W through tensor descriptors: the config asks for it,
    the GPU (Hopper or later) has TMA, and the operands' alignment allows it (16-byte
    aligned bases and rows, unit inner strides, rows present). A grouped W [G, K, N] goes
    as one [G*K, N] descriptor, which needs W contiguous and K a multiple of BLOCK_K (a box
    must not reach into the next group)."""
    if w is None or not (cfg.get("USE_TMA") and x.dtype != torch.float32 and x.shape[0] > 0
                         and x.stride(1) == 1 and w.stride(-1) == 1 and tma_capable(x.device)):
        return False
    if w.dim() == 3 and not (w.is_contiguous() and w.shape[1] % cfg["BLOCK_K"] == 0):
        return False
    es = x.element_size()
    return (x.data_ptr() % 16 == 0 and (x.stride(0) * es) % 16 == 0 and x.shape[1] > 0
            and w.data_ptr() % 16 == 0 and (w.stride(-2) * es) % 16 == 0 and w.shape[-1] > 0)


def gemm_operands(x: torch.Tensor, w: Optional[torch.Tensor], cfg: dict, descriptors=None) -> tuple:
    """(X argument, W argument, USE_TMA) of the GEMM kernel: tensor descriptors where
    tma_operands_fit, the tensors themselves otherwise. `descriptors`: a per-handle cache of
    W's descriptor."""
    if not tma_operands_fit(x, w, cfg):
        return x, w, False
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = tensor_descriptor(x, x.shape[0], x.shape[1], x.stride(0), [bm, bk])
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), bk, bn)
    w_desc = descriptors.get(key) if descriptors is not None else None
    if w_desc is None:
        w_desc = tensor_descriptor(w, w.shape[-2] * (w.shape[0] if w.dim() == 3 else 1),
                                   w.shape[-1], w.stride(-2), [bk, bn])
        if descriptors is not None and w_desc is not None:
            descriptors.clear()  # one W at a time per handle: weights rarely move
            descriptors[key] = w_desc
    if x_desc is None or w_desc is None:
        return x, w, False
    return x_desc, w_desc, True


def _offsets_gemm(layout) -> tuple:
    # the layout offsets of gemm_a2a_kernel's signature, after ws_offset
    return (layout.data_signals, layout.acks, layout.counts, layout.local, layout.counters,
            layout.recv, layout.parity_bytes, layout.source_bytes)


# tile configurations the GEMM tries on its first call with a shape (the fastest on this GPU
# is kept for the handle; tune_candidates picks the platform's): the default, a narrower
# tile for skinny inputs and fewer tiles, and the default run persistent (one program per
# SM). Hopper's first:
_TUNE_CANDIDATES = (
    {},
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(PROGRAMS_PER_SM=1),
    # the default with a fourth stage in flight (a config that passes the GPU's shared
    # memory fails to compile and is skipped)
    dict(num_stages=4),
)


# and for skinny X (at most _SKINNY_ROWS rows in the tuning call): 64 x 64 tiles, so that
# 128 x 4096 times 4096 x 4096 is 128 tiles, about one per SM of an H200, where the
# default's 128 x 256 tiles made 16 (0.76 of torch.matmul under CUDA graphs)
_SKINNY_ROWS = 1024


_TUNE_SKINNY = (
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=6),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
)


# deep rings sized for 16-bit types: in float32 their stages take 328-344 KiB, more than a
# Hopper SM has (227 KiB), and each cost the tuner a compile (2-8 s on this project's CI
# host) of a kernel that cannot load (tests/test_triton_compile.py checks both types' fit)
_TUNE_SKINNY_16BIT = (
    # 64 x 128 with a deeper ring (8 stages, 192 KiB: one program an SM): one wave of 128
    # tiles at 256 x 4096^2 with more loads in flight than the 4-stage 64 x 128 above
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=8),
    # 128 x 128 with 6 stages (192 KiB), the tile and depth of cuBLAS's kernel at 512 x
    # 4096^2 (nvjet_sm90_tst_128x128_64x6_2x1): on an H100 it took that shape from 0.960 /
    # 0.959 / 0.902 of torch.matmul (idle-start / queued / graph, the 4-stage tile the
    # tuner kept) to 1.019 / 0.991 / 0.972 (5 stages: 1.004 / 1.011 / 0.972; two warp
    # groups or a K step of 128 no better; results/probe_gemm_tiles_h100_thirtysecond_
    # session.jsonl)
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=6),
)


# and for tiny X (at most _TINY_ROWS rows: decode steps, an expert's few tokens), 16-bit:
# the skinny tiles leave most SMs idle there (16 x 4096 times 4096 x 4096 makes 64 tiles of
# 64 x 64 on an H100's 132 SMs), and the product is W's stream. Narrow N tiles make one
# tile an SM or more; under 64 rows Triton uses mma.sync (wgmma takes 64 rows a warp
# group), so a 16- or 32-row tile wastes no tensor-core rows on padding. On an H100
# (thirty-ninth session: results/fused_gpu_h100_thirtyninth_session_full.jsonl, "candidates",
# and results/probe_gemm_tiles_tiny_h100_thirtyninth_session.jsonl) the tuner's time fell
# from the best older tile's 17.8 to 12.8 us at 16 x 4096^2, 13.9 to 11.1 at 64 x 4096^2 and
# 52.7 to 47.9 at 16 x 8192^2. Graph-replayed, cuBLAS stays ahead at 4096^2: 10.3-10.6 us
# against 13.1-14.4 for the kept 16 x 32 x 128 tile and 11.5-12.0 for the K step of 256
# (added after those runs, so not yet tuned by the bench), and 9.9-10.7 against 10.9-11.6 at
# 64 rows. N 16, split K 2, 8 stages, two warps and cp.async loads instead of TMA were no
# faster in the probes. Split K on the direct path (forty-first session: bare Triton kernels
# of 16 x 128 x 128 split 4 and 16 x 64 x 128 split 2 ran 7.0-7.2 us with W warm where the
# kept tile ran 9.3, results/probe_tiny_graph_h100_fortyfirst_session.jsonl) lost the
# tuner's timing once joined at the tiles' semaphores: 12.06 and 11.39 us against 11.27 for
# the kept 16 x 32 x 256 at 16 x 4096^2, 31.6 / 27.6 against 11.7 at 64 rows, 53.2 / 50.1
# against 47.7 at 16 x 8192^2 (results/fused_gpu_h100_fortyfirst_session_full.jsonl,
# "candidates"), so they are not candidates; the direct path keeps its split for a config
# that asks for one (ROCMOE_GEMM_CONFIG). Deeper pipelines (6-8 stages, K steps of 512) and
# swapped operands (W's columns as the MMA's rows) were within 0.45 us of the kept tile in
# bare kernels (results/probe_tiny_graph_stages_h100_fortyfirst_session.jsonl).
#
# Split K with the partials summed by a second launch (SPLIT_SUM: split_sum_kernel, launched
# for programmatic dependent launch on Hopper) is what cuBLAS runs at 16 x 4096^2 (its
# nvjet ..._splitK kernel, then cublasLt::splitKreduce_kernel). Bare, on an H100 (forty-third
# session, results/probe_tiny_graph_pdl_h100_fortythird_session.jsonl), 16 x 128 x 128
# split 4 graph-replayed in 9.15 us with the PDL sum (10.12 with the sum launched plainly),
# against 10.91 for the handle's kept tile and 9.58 for torch.matmul; at 64 x 4096^2 and 16
# x 8192^2 the split-and-sum variants lost to the unsplit tiles (11.4-13.0 against 10.2;
# 51.2-52.4 against 49.7), which the tuner times too. In the handle (forty-fourth session,
# results/fused_gpu_h100_fortyfourth_session_gemm*.jsonl) the tuner kept this tile at 16 x
# 4096^2 in three runs out of three, graph-replayed at 1.044-1.101 x torch.matmul. At 64 rows
# no split tile is a candidate: 64 x 64-128 tiles split 2 or 4 ways replayed in 11.6-15.9 us
# against the unsplit 64 x 32 x 256's 10.4-11.0
# (results/probe_tiny_graph_split64_h100_fortyfourth_session.jsonl).
# Nor is a K loop rotated per column tile (each starting at its own step, so that the 128
# tiles of 64 x 4096^2 read 16 slices of X at once, not all the same one): graph-replayed,
# 15.86 us bare against 10.75 (results/probe_tiny_graph_rot64_h100_fortysixth_session.jsonl)
# and 0.643-0.647 x torch.matmul in the handle against 0.937-0.944 unrotated
# (results/probe_rot_handle_h100_fortysixth_session.jsonl, the kernel option of 5a26149,
# reverted): the X lines the tiles share are not what holds 64 rows back under graphs.
_TINY_ROWS = 64
_TUNE_TINY_16BIT = (
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=6),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=6),
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=6),
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=4,
         SPLIT_SUM=True),
)


# (tried and dropped, 2026-12-02: 128 x 64 tiles, BLOCK_K 64 / 5 stages and 128 / 3, for
# one wave of 128 tiles at 256 x 4096^2; the tuner kept 64 x 64 on 128-512 rows every time,
# results/fused_gpu_h200_gemm_tiles.jsonl)
# (also dropped, 2026-12-04: split-K tiles, 128 x 128 and 64 x 128 split 2 or 4 and the
# default split 2 or 4. Split K never won in 63 tunings on the H200, 2026-12-02 to 12-04:
# 1.5-2.0 x the kept tile's time at 128-512 x 4096^2, within 1 % at 512 x 8192^2
# (benchmarks/results/fused_gpu_h200_*.jsonl, "candidates"); the path stays, for a config
# that asks for it through ROCMOE_GEMM_CONFIG, and its tests with it)
# CDNA's (gfx942, gfx90a; none timed on AMD hardware yet): the default 128 x 128 tile
# (triton_gemm_a2a.default_config) with 16 x 16 MFMA instructions instead of the compiler's
# 32 x 32, with a third stage, as 64 x 128 tiles (twice the tiles: 4096^3 makes 2048, about
# 7 a CU of an MI300X's 304), persistent, and 128 x 256 at 4 waves (one wave a SIMD, so a
# wave has 512 registers and keeps its accumulator in AGPRs: the largest tile that does not
# spill; at 8 waves it spills 26-69 VGPRs); for skinny X 64 x 64 and 32 x 64 tiles (512 x
# 4096 times 4096 x 4096 makes 512 and 1024 tiles where the default makes 128, fewer than
# the CUs). float32 keeps the default's K step of 16 (LDS is 64 KiB a CU). Every one builds
# for gfx942 and gfx90a with no spill to scratch in every mode the handle runs
# (tests/test_triton_compile.py); the 256 x 256 tile, which spills at 4 waves as at 8, is
# not a candidate (see default_config).
_TUNE_CANDIDATES_CDNA = (
    {},
    dict(matrix_instr_nonkdim=16),
    dict(num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128),
    dict(PROGRAMS_PER_SM=1),
    dict(BLOCK_M=128, BLOCK_N=256, num_warps=4),
)


_TUNE_SKINNY_CDNA = (
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4),
)


_TUNE_SKINNY_CDNA_FP32 = (
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4),
)


# the kernel options a tile config may set (CDNA's waves_per_eu and matrix_instr_nonkdim are
# Triton's HIP backend options; the CUDA backend takes the first two only)
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim")


def launch_options(cfg: dict) -> dict:
    """The compile options of a tile config (the rest of it is the kernel's constexprs)."""
    return {k: cfg[k] for k in _LAUNCH_OPTIONS if k in cfg}


def tune_candidates(platform: str, rows: int, fp32: bool = False) -> tuple:
    """The tile configs (overrides of the platform's default) the GEMM tuner times for X
    with `rows` rows."""
    skinny = rows <= _SKINNY_ROWS
    if platform == "hip":
        return _TUNE_CANDIDATES_CDNA + ((_TUNE_SKINNY_CDNA_FP32 if fp32 else _TUNE_SKINNY_CDNA)
                                        if skinny else ())
    if not skinny:
        return _TUNE_CANDIDATES
    if fp32:
        return _TUNE_CANDIDATES + _TUNE_SKINNY
    return (_TUNE_CANDIDATES + _TUNE_SKINNY + _TUNE_SKINNY_16BIT
            + (_TUNE_TINY_16BIT if rows <= _TINY_ROWS else ()))


class _GemmLaunch:
    """Everything of a handle's GEMM launch that stays fixed for a shape (K, groups, whether
    the counts are known on the host): the tile config, the grid, the constexprs and the
    launcher key; made once, so a call only fills in its tensors."""

    def __init__(self, handle, team: Team, x: torch.Tensor, w: Optional[torch.Tensor],
                 groups: int, cfg: dict, scratch_status: Optional[int] = None,
                 most_rows: Optional[int] = None):
        # scratch_status: the tuner's runs (all of this rank's rows as one local destination,
        # so more rows than one destination's capacity) record into scratch status words,
        # never into the handle's, and have no capacity bound. most_rows: the most rows of X
        # the plan's calls have (its rows class, rows_class), which sizes the DIRECT path's
        # grid; the handle's capacity when None
        dev = x.device
        world = team.world
        self.copy = w is None
        self.local = world == 1
        self.cfg = cfg
        # made with another rows class's config, untimed (rows_exchange: under graph capture,
        # or at world size > 1 after the product's first plan); untuned: to be tuned at the
        # next call outside a capture (world size 1)
        self.borrowed = self.untuned = False
        n, k = handle.N, int(x.shape[1])
        g = max(groups, 1)
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        self.bm, self.n_tiles = bm, math.ceil(n / bn)
        self.per = g
        # the most tasks the counts could ask for (device counts are never read here)
        tiles = world * (math.ceil(handle.max_rows / bm) + g) * self.n_tiles
        split_tiles = tiles
        if scratch_status is not None:
            split_tiles = (math.ceil(max(1, x.shape[0]) / bm) + g) * self.n_tiles
        elif self.local and g == 1 and most_rows is not None:
            # the direct path splits the tiles of its rows class's calls (a call of more
            # rows, which the class never has, would run unsplit): a 16-row class of a
            # 4096-row handle gets scratch for 16 rows, not for 4096
            split_tiles = math.ceil(max(1, min(handle.max_rows, most_rows)) / bm) * self.n_tiles
        split_k, self.split_scratch = self._split_scratch(cfg, split_tiles, dev)
        tasks = tiles * split_k  # a split tile is split_k tasks
        # world size 1, one W: the kernel's DIRECT path (no plan; X's own tiles, K split or
        # not)
        self.direct = self.local and g == 1
        if self.direct:
            tasks = split_k * direct_tasks(handle.max_rows, most_rows, bm, self.n_tiles,
                                           sm_count(dev) if dev.type != "cpu" else _CPU_PROGRAMS)
        if self.local and dev.type != "cpu":
            sms = sm_count(dev)
            per_sm = cfg.get("PROGRAMS_PER_SM")
            self.nprog = (min(tasks, int(sms * per_sm)) if per_sm
                          else (tasks if tasks <= 8 * sms else min(tasks, 4 * sms)))
        else:
            self.nprog = _num_programs(dev, tasks, cfg.get("PROGRAMS_PER_SM"))
        # SPLIT_SUM: the split tiles' partials summed by a second launch (_SplitSum, made
        # below once the capacity is known)
        split_sum, pdl = split_sum_modes(dict(cfg, SPLIT_K=split_k), self.direct, _PLATFORM,
                                         tma_capable(dev))
        self.options = launch_options(cfg) if dev.type != "cpu" else {}
        self.use_tma_wanted = bool(cfg.get("USE_TMA")) and not self.copy
        self.fixed_spec = None
        # use_tma -> NativeLaunch (None: refused, see native_launch.last_refusal); made from
        # the kernel the JIT ran on the first call of each
        self.native: dict = {}
        self.constexprs = dict(
            WORLD_P2=team.world_p2, GROUPS_P2=max(1, 1 << (g - 1).bit_length()), BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
            MODE=0 if self.local else 1, COPY=self.copy, FP32_IEEE=x.dtype == torch.float32,
            EVEN_N=n % bn == 0, EVEN_K=(k % cfg["BLOCK_K"] == 0) or self.copy, USE_TMA=False,
            SPLIT_K=split_k, DIRECT=self.direct, CLOCK=_clock(), SPLIT_SUM=split_sum,
            PDL=pdl)
        self.key = (tuple(sorted(self.constexprs.items())), tuple(sorted(self.options.items())),
                    self.nprog)
        layout = handle.layout
        status = handle.status_address if scratch_status is None else scratch_status
        self.tail_args = (status, handle.workspace_offset, *_offsets_gemm(layout), team.rank,
                          world)
        self.wait_budget = _wait_budget(handle.ctx.timeout_s)
        self.first_budget = _first_call_budget(handle.ctx.timeout_s)
        self.launched = False  # the first launch waits first_budget (the peers' JIT)
        self.split_args = ((self.split_scratch.data_ptr(), self.split_tiles)
                           if self.split_scratch is not None else (0, 0))
        self.capacity = layout.capacity if scratch_status is None else 1 << 62
        self.split_sum = _SplitSum(self, n, split_k, pdl, dev) if split_sum else None
        if not self.local:
            rows = 64 if dev.type != "cpu" else 16
            self.collect_blocks = math.ceil(layout.capacity / rows)
            cn = min(256, max(16, 1 << (n - 1).bit_length())) if dev.type != "cpu" else 16
            self.collect_args = (handle.status_address, handle.workspace_offset, layout.acks,
                                 layout.counts, layout.local, layout.counters, layout.recv,
                                 layout.parity_bytes, layout.source_bytes, team.rank, world, n,
                                 layout.capacity, world * self.collect_blocks)
            self.collect = _HelperLaunch(
                "collect_kernel", (world, self.collect_blocks),
                dict(WORLD_P2=team.world_p2, ROWS=rows, BLOCK_N=cn),
                {"num_warps": 4} if dev.type != "cpu" else {}, (rows, cn, self.collect_blocks))

    def _split_scratch(self, cfg: dict, tiles: int, dev) -> tuple:
        """SPLIT_K of the kernel and its scratch (a semaphore and SPLIT_K fp32 partials for
        each of the `tiles` a call can have), or (1, None) when the config asks for no split
        or the scratch would pass _SPLIT_SCRATCH_MAX (a large handle: its calls have tiles
        enough without splitting K)."""
        split_k = int(cfg.get("SPLIT_K", 1))
        self.split_tiles = int(tiles)
        if split_k <= 1 or self.copy:
            return 1, None
        # (+ one block of split_sum_kernel for a SPLIT_SUM config: its last program loads a
        # whole block past the last part's rows, unmasked)
        nbytes = (math.ceil(tiles * 4 / 256) * 256
                  + tiles * split_k * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4
                  + (SPLIT_SUM_BLOCK * 4 if cfg.get("SPLIT_SUM") else 0))
        if nbytes > _SPLIT_SCRATCH_MAX or tiles >= 1 << 31:
            return 1, None
        return split_k, torch.zeros(nbytes, dtype=torch.uint8, device=dev)

    def _raw_args(self, handle, team, x, w_raw, strides_w, counts, out, recv) -> tuple:
        """The kernel's arguments with X and W as tensors: what a native launch takes (it
        keeps the TMA maps itself), and what the JIT takes where the kernel does not use
        TMA."""
        return (x, w_raw, out, counts, team.order, team.peer_bases, recv, *self.tail_args,
                x.shape[0], handle.N, x.shape[1], self.per, self.capacity, self.nprog,
                x.stride(0), x.stride(1), *strides_w,
                self.wait_budget if self.launched else self.first_budget, *self.split_args)

    def launch(self, handle, team, x, w, counts, out, recv, descriptors) -> None:
        strides_w = (0, 0, 0) if self.copy else \
            (w.stride(0) if w.dim() == 3 else 0, w.stride(-2), w.stride(-1))
        # the kernel made for TMA loads first: its launch checks every operand it loads by
        # a map (base and row alignment by its tokens, unit inner stride and non-empty
        # shape by the driver's encode), so only a grouped W's contiguity, which a map of
        # [G*K, N] assumes, is left to check here
        tma_native, tried = self.native.get(True), None
        if tma_native is not None and (w.dim() == 2 or w.is_contiguous()):
            raw = self._raw_args(handle, team, x, w, strides_w, counts, out, recv)
            tried = tma_native
            if tma_native.launch((self.nprog,), raw):
                self._launched(team, out, recv, x, counts)
                return
        if self.copy:
            w_raw, use_tma = x, False
        else:
            w_raw = w
            use_tma = self.use_tma_wanted and tma_operands_fit(x, w, self.cfg)
        raw = self._raw_args(handle, team, x, w_raw, strides_w, counts, out, recv)
        native = self.native.get(use_tma)
        # (not the TMA kernel's native launch again when it refused this call above)
        if native is None or native is tried or not native.launch((self.nprog,), raw):
            if use_tma:
                x_arg, w_arg, use_tma = gemm_operands(x, w, self.cfg, descriptors)
                args = (x_arg, w_arg) + raw[2:]
            else:
                args = raw
            constexprs = self.constexprs if not use_tma else dict(self.constexprs, USE_TMA=True)
            launcher = _LAUNCHERS["gemm_a2a_kernel"]
            if self.fixed_spec is None:  # the arguments a call cannot change, specialised once
                assert len(args) == len(_GEMM_FIXED) + len(_GEMM_DYNAMIC), len(args)
                self.fixed_spec = launcher.specialize(args, _GEMM_FIXED)
            compiled = launcher((self.nprog,), args, constexprs, self.options,
                                (self.key, use_tma, self.fixed_spec), dynamic=_GEMM_DYNAMIC)
            if use_tma not in self.native and compiled is not None:
                self.native[use_tma] = native_launch.try_native(compiled, raw, _GEMM_DYNAMIC,
                                                                x.device)
        self._launched(team, out, recv, x, counts)

    def _launched(self, team, out, recv, x, counts) -> None:
        """After the kernel of a call is enqueued: the split tiles' sum (SPLIT_SUM), the
        first launch's budget goes, and at world size > 1 the receiving side follows."""
        if self.split_sum is not None:
            self.split_sum(out, counts, x.shape[0])
        if not self.launched:
            self._first_launch_done()
        if not self.local:
            self._collect(team, out, recv, x.device)

    def _first_launch_done(self) -> None:
        """The plan's first launch is enqueued: later ones wait the context's timeout. A
        native launch keeps the arguments of the call it was made on except the ones a call
        changes, and the budget is not one of those: rewrite it there too (without this,
        every later call of the plan waited ROCMOE_FIRST_CALL_TIMEOUT_S for a dead peer)."""
        self.launched = True
        for native in self.native.values():
            if native:
                native.set_fixed(_GEMM_BUDGET, self.wait_budget)

    def _collect(self, team, out, recv, device) -> None:
        """The receiving side of a call at world size > 1: wait for every source, copy what
        arrived into `out`, acknowledge."""
        self.collect((out, team.peer_bases, recv, *self.collect_args), device)


class _HelperLaunch:
    """One of a plan's helper kernels (the collect, the split sum), launched as the plan
    launches its product: the first call through the JIT, specialised once on the arguments
    a call cannot change (all but the first three: the tensors and M), later calls natively
    where native_launch takes the compiled kernel."""

    DYNAMIC = (0, 1, 2)

    def __init__(self, name: str, grid: tuple, constexprs: dict, options: dict, key):
        self.name, self.grid = name, grid
        self.constexprs, self.options, self.key = constexprs, options, key
        self.spec = None
        self.native = None  # NativeLaunch; False once refused

    def __call__(self, args: tuple, device) -> bool:
        """Launch; True when the launch was native."""
        nl = self.native
        if nl and nl.launch(self.grid, args):
            return True
        launcher = _LAUNCHERS[self.name]
        if self.spec is None:
            self.spec = launcher.specialize(args, range(len(self.DYNAMIC), len(args)))
        compiled = launcher(self.grid, args, self.constexprs, self.options,
                            (self.key, self.spec), dynamic=self.DYNAMIC)
        if nl is None and compiled is not None:
            self.native = native_launch.try_native(compiled, args, self.DYNAMIC,
                                                   device) or False
        return False


class _PointerSlot:
    """A pointer argument in a NativeLaunch's parameter buffer that a caller rewrites in
    place (native_launch's pointer_cell): the address written last (-1: not known), so that
    an address already there costs neither its alignment check nor its write (a cffi
    store). An output ring and the device counts give the same tensors call after call."""

    __slots__ = ("cell", "aligned", "p")

    def __init__(self, native, pos: int):
        self.cell, self.aligned = native.pointer_cell(pos)
        self.p = -1

    def put(self, p: int) -> bool:
        """Write address `p` (not already there); False, with nothing written, when its
        16-byte alignment is not the one the kernel was compiled for."""
        if ((p & 15) == 0) is not self.aligned:
            return False
        self.cell[0] = self.p = p
        return True


class _SplitSum:
    """The second launch of a SPLIT_SUM plan: split_sum_kernel over the plan's split
    scratch, into the call's output (a _HelperLaunch: natively after the first call, with
    the PDL attribute where the plan has PDL). After a native launch, a call of the same M
    writes only the out and counts addresses that moved (as _LeanGemmLaunch does: an output
    ring hands out a few buffers in turn) and launches the parameter buffer as it stands.
    (The second launch costs the host little: 18.9 us a call at 16 x 4096^2 against 18.2 for
    the one-launch 32-row call, paired in one process on an H100; the 25.1 and 28.2 us of two
    earlier bench runs were a noisy host, 15.8 in the forty-sixth session's.)"""

    # whether an eager call (not under graph capture) launches the sum with its PDL
    # attribute. Plainly launched it saved the host nothing (19.71 against 18.92 us a call,
    # twelve samples each way, alternated) and cost the GPU 0.7 us a call queued (18.46
    # against 17.80): benchmarks/probe_split_sum_pdl.py,
    # results/probe_split_sum_pdl_h100_fortysixth_session.jsonl
    EAGER_PDL = True

    def __init__(self, plan: "_GemmLaunch", n: int, split_k: int, pdl: bool, dev):
        rows = (plan.split_tiles // plan.n_tiles) * plan.bm  # the scratch's rows
        self.grid = max(1, math.ceil(rows * n / SPLIT_SUM_BLOCK))
        self.fixed = (plan.split_scratch.data_ptr(), plan.split_tiles, n, plan.capacity)
        constexprs = dict(BLOCK_M=plan.bm, BLOCK_N=plan.cfg["BLOCK_N"], SPLIT_K=split_k,
                          BLOCK=SPLIT_SUM_BLOCK, PDL=pdl)
        options = split_sum_options(pdl) if dev.type != "cpu" else {}
        key = (tuple(sorted(constexprs.items())), tuple(sorted(options.items())), self.grid)
        self.kernel = _HelperLaunch("split_sum_kernel", (self.grid,), constexprs, options, key)
        self.stream = native_launch.stream_getter(dev) if dev.type == "cuda" else None
        # the native kernel's generation and M at its last full write (-1: none); its out
        # and counts slots, made at the first native launch
        self.generation, self.m = -1, -1
        self.out_slot = self.counts_slot = None

    def __call__(self, out: torch.Tensor, counts: torch.Tensor, m: int,
                 stream: Optional[int] = None) -> None:
        """Launch after the product; `stream`: the current stream's raw handle, when the
        caller has it."""
        nl = self.kernel.native
        if nl and nl.generation == self.generation and m == self.m:
            p, q = out.data_ptr(), counts.data_ptr()
            if (p == self.out_slot.p or self.out_slot.put(p)) and \
                    (q == self.counts_slot.p or self.counts_slot.put(q)):
                nl.launch_as_written(self.grid, self.stream() if stream is None else stream,
                                     self.EAGER_PDL or capturing())
                return
        if self.kernel((out, counts, m) + self.fixed, out.device):
            nl = self.kernel.native
            if self.out_slot is None:
                self.out_slot, self.counts_slot = _PointerSlot(nl, 0), _PointerSlot(nl, 1)
            self.generation, self.m = nl.generation, m
            self.out_slot.p, self.counts_slot.p = out.data_ptr(), counts.data_ptr()
        else:
            self.generation = -1


# gemm_a2a_kernel's arguments as _GemmLaunch passes them: the tensors, M and the strides of
# X and W change from call to call; the rest (workspace offsets, rank, N, K, groups,
# capacity, grid, wait budget) is fixed for a plan
_GEMM_DYNAMIC = (0, 1, 2, 3, 4, 5, 6, 19, 25, 26, 27, 28, 29)


_GEMM_FIXED = tuple(i for i in range(33) if i not in _GEMM_DYNAMIC)


_GEMM_BUDGET = 30  # wait_budget: fixed, but the first launch's is longer (_first_launch_done)


# the most split-K scratch a plan allocates (about 20 MiB at 512 x 4096 x 4096, SPLIT_K 2)
_SPLIT_SCRATCH_MAX = 64 << 20


# the tuner's timing: launches queued behind a GPU sleep, so that the events bracket kernels
# alone. Timed back to back from an idle GPU instead, a small shape's five launches included
# the host's launch time: at 256 x 4096^2 the kept config was timed at 25.0 us and ran 18.9
# under graphs. (Timed as kernels, the H200 kept the same config there: 19.9 us, the other
# candidates 21.0-54.1; results/fused_gpu_h200_ninth_session_run1.jsonl)
_TUNE_CALLS, _TUNE_ROUNDS, _TUNE_SLEEP_CYCLES = 5, 3, 4_000_000  # the sleep: about 2 ms


def _kernel_ms(run, calls: int = _TUNE_CALLS, rounds: int = _TUNE_ROUNDS) -> float:
    """GPU ms of one run() (the fastest of `rounds` means of `calls` back-to-back runs, each
    round queued behind a sleep long enough for the host to enqueue all of it); two runs
    first, untimed, for the JIT and the native launch."""
    run()
    run()
    best = float("inf")
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_TUNE_SLEEP_CYCLES)
        start.record()
        for _ in range(calls):
            run()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / calls)
    return best


def _tuned_launch(handle, team, x, w, groups, counts, out,
                  most_rows: Optional[int] = None) -> "_GemmLaunch":
    """The fastest of the platform's tile configs (tune_candidates) for this shape, timed in
    local mode (no protocol: the compute alone) on scratch outputs; on CUDA and ROCm GPUs,
    ROCMOE_GEMM_TUNE=0 turns it off. `most_rows`: the plan's (_GemmLaunch)."""
    base = gemm_config(x.device, x.dtype)
    if (w is None or x.device.type != "cuda"
            or os.environ.get("ROCMOE_GEMM_TUNE", "1") == "0" or os.environ.get("ROCMOE_GEMM_CONFIG")):
        return _GemmLaunch(handle, team, x, w, groups, base, most_rows=most_rows)
    scratch_team = _LocalTeam(team)
    scratch_out = torch.empty((max(1, x.shape[0]), handle.N), dtype=out.dtype, device=out.device)
    scratch_status = torch.zeros(3 * team.world + 2, dtype=torch.int32, device=x.device)
    scratch_recv = torch.empty(1, dtype=torch.int64, device=x.device)
    best, best_ms, timed = None, float("inf"), []
    candidates = tune_candidates(_PLATFORM, x.shape[0], x.dtype == torch.float32)
    if team.world > 1 or groups > 1:
        # the plan itself will not be DIRECT, where a SPLIT_SUM config would join its split
        # in the kernel instead (split_sum_modes): not the kernel the tuner would time here
        candidates = tuple(c for c in candidates if not c.get("SPLIT_SUM"))
    local_counts = counts.reshape(team.world, -1).sum(0) if counts.numel() else counts
    for extra in candidates:
        cfg = dict(base, **extra)
        plan = _GemmLaunch(handle, scratch_team, x, w, groups, cfg,
                           scratch_status=scratch_status.data_ptr(), most_rows=most_rows)
        try:
            def run():
                plan.launch(handle, scratch_team, x, w, local_counts, scratch_out, scratch_recv,
                            {})
            ms = _kernel_ms(run)
        except Exception:  # noqa: BLE001 - a candidate that does not compile here is skipped
            continue
        timed.append((extra, round(ms, 5)))
        if ms < best_ms:
            best, best_ms = cfg, ms
    handle._tuned = {"config": best, "ms": best_ms, "candidates": timed, "rows": int(x.shape[0])}
    return _GemmLaunch(handle, team, x, w, groups, best or base, most_rows=most_rows)


class _LocalTeam:
    """A team of one (this rank alone): what the tuner runs the kernel with."""

    def __init__(self, team: Team):
        self.rank, self.world, self.world_p2 = 0, 1, 2
        self.order = team.order[:1] * 0
        self.peer_bases = team.peer_bases[team.rank:team.rank + 1]


def rows_class(rows: int) -> int:
    """The class of X's row count a GEMM plan is tuned for: rows in [2**(c-1), 2**c - 1] are
    class c (0 and 1 rows are class 1). A plan's tile config is timed on the first call of
    its class: at 512 x 4096^2 the tile tuned for 4096 rows (128 x 256: 64 tiles on an
    H100's 132 SMs) ran at 0.6-0.7 of torch.matmul against 0.9 for the skinny tile the tuner
    picks at 512 rows (benchmarks/probe_function_layers.py: the function's cached handle,
    first called with 4096 rows, twenty-sixth session)."""
    return max(int(rows), 1).bit_length()


def class_rows(cls: int) -> int:
    """The most rows of rows class `cls`."""
    return (1 << cls) - 1


def rows_exchange(handle, x: torch.Tensor, w: Optional[torch.Tensor], host_counts,
                  dev_counts: Optional[torch.Tensor], groups: int, out: torch.Tensor
                  ) -> torch.Tensor:
    """One call of a GemmAllToAll / AllToAllRows handle: Y = X @ W (X itself without W),
    rows to their destinations by the counts, what arrives packed into `out`. Returns the
    device int64 tensor of rows received from each source."""
    team = team_for(handle.ctx)
    dev = x.device
    counts = dev_counts if dev_counts is not None else _device_ints(handle)(host_counts)
    if not (x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) == x.shape[1])):
        x = x.contiguous()
    recv = torch.empty(team.world, dtype=torch.int64, device=dev)
    launches = handle.__dict__.setdefault("_launches", {})
    # a product's plan per rows class (its tile is tuned on the class's first call); the
    # row exchange has no tile to tune
    cls = rows_class(x.shape[0]) if w is not None else 0
    key = (int(x.shape[1]), w is None, groups, x.dtype, cls)
    plan = launches.get(key)
    if plan is None or (plan.untuned and not capturing()):
        if w is None:
            plan = _GemmLaunch(handle, team, x, w, groups, copy_config(dev, handle.N))
        else:
            nearest = _nearest_config(launches, key)  # None: the product's first plan
            if capturing() or (team.world > 1 and nearest is not None):
                # no tuning under CUDA graph capture (the tuner times with events and waits
                # for them): the config of the handle's plan for the nearest rows class, or
                # the default, and at world size 1 the next call outside a capture tunes the
                # class. Nor at world size > 1 once the product has a plan: the rows class is
                # the one thing of a call the ranks do not agree on, so a rank may meet a new
                # class while its peers run plans they have, and wait for its rows with the
                # context's budget (ROCMOE_TIMEOUT_S) while it compiles and times the
                # candidates (tens of seconds on a fresh Triton cache: the 2-rank no-sync
                # check's warm-up step, every op's first call, took 21-67 s on an H100). A
                # product's first plan is tuned: every rank makes it in the same call, each
                # in its plan's first launch, whose waits have the first call's budget
                cfg = nearest if nearest is not None else gemm_config(dev, x.dtype)
                plan = _GemmLaunch(handle, team, x, w, groups, cfg, most_rows=class_rows(cls))
                plan.borrowed, plan.untuned = True, team.world == 1
            else:
                plan = _tuned_launch(handle, team, x, w, groups, counts, out, class_rows(cls))
        launches[key] = plan
    plan.launch(handle, team, x, w, counts, out, recv,
                handle.__dict__.setdefault("_w_descriptors", {}))
    if w is not None and x.device.type == "cuda":
        lean_plans = handle.__dict__.get("_lean_plans")
        if lean_plans is None:
            lean_plans = handle._lean_plans = {}
            handle._lean = lean_gemm_call(handle, lean_plans, team)
        # the lean call takes the handle's own K, dtype and grouping: a plan for those is
        # its plan for this rows class (the function's cached handle also runs other
        # products through the general path)
        if (key[0] == handle.K and x.dtype == handle.dtype and not plan.untuned
                and groups == (handle.groups if handle.groups > 1 else 0)
                and (cls not in lean_plans or lean_plans[cls][0] is not plan)):
            lean_plans[cls] = (plan, _lean_launch(plan, team))
    return recv


def _nearest_config(launches: dict, key: tuple) -> Optional[dict]:
    """The tile config of the plan in `launches` for the same product (K, W or not,
    groups, dtype) whose rows class is nearest key's; None when the product has none."""
    same = [(abs(other[-1] - key[-1]), plan.cfg) for other, plan in launches.items()
            if other[:-1] == key[:-1]]
    return min(same, key=lambda e: e[0])[1] if same else None


class _LeanGemmLaunch:
    """The lean call's launch: the plan's native kernel with only what changed since the
    last launch written into its parameter buffer. A lean call has already checked X
    row-major [M, K] and W of the handle's shape, dtype and GPU; with M and W's
    contiguity as in the last launch through the plan (the fields M, the strides and X's
    map shape depend on), only the pointers can differ: out, counts and recv are written
    when their address moved, X's and W's maps re-made only when theirs did. Anything else
    (another M, a strided W, a pointer of another alignment, a launch through the plan in
    between, which `NativeLaunch.generation` shows) goes through the plan, which rewrites
    every argument; `record` then takes that launch as the new base."""

    def __init__(self, plan: "_GemmLaunch", team: Team, native):
        self.plan, self.team, self.nl = plan, team, native
        self.x_step, self.w_step = native.step(0), native.step(1)
        # out, counts and recv: rewritten in place when their address moved
        self.out_slot, self.counts_slot, self.recv_slot = (
            _PointerSlot(native, pos) for pos in (2, 3, 6))
        self.gen, self.m, self.xp, self.wp = -1, -1, 0, 0

    def record(self, x: torch.Tensor, w: torch.Tensor, gen_before: int) -> None:
        """After a launch through the plan: the base of the next lean launches, when that
        launch wrote every argument of this kernel (and M > 1, W contiguous)."""
        nl = self.nl
        # the plan wrote every argument: no address is known to be in the buffer
        self.out_slot.p = self.counts_slot.p = self.recv_slot.p = -1
        if nl.generation > gen_before and nl.written and x.shape[0] > 1 and w.is_contiguous():
            self.gen, self.m = nl.generation, x.shape[0]
            self.xp, self.wp = x.data_ptr(), w.data_ptr()
        else:
            self.gen = -1

    def __call__(self, x, w, counts, out, recv, stream: int) -> bool:
        """Launch on `stream` (the current one's raw handle); False (perhaps with pointers
        written, never launched) when the plan must."""
        nl = self.nl
        if nl.generation != self.gen or x.shape[0] != self.m or not w.is_contiguous():
            return False
        xp, wp = x.data_ptr(), w.data_ptr()
        if xp != self.xp:
            if not self.x_step(x):
                return False
            self.xp = xp
        if wp != self.wp:
            if not self.w_step(w):
                return False
            self.wp = wp
        p = out.data_ptr()
        if p != self.out_slot.p and not self.out_slot.put(p):
            return False
        p = counts.data_ptr()
        if p != self.counts_slot.p and not self.counts_slot.put(p):
            return False
        p = recv.data_ptr()
        if p != self.recv_slot.p and not self.recv_slot.put(p):
            return False
        plan = self.plan
        nl.launch_as_written(plan.nprog, stream)
        if plan.split_sum is not None:
            plan.split_sum(out, counts, self.m, stream)
        if not plan.local:
            plan._collect(self.team, out, recv, x.device)
        return True


def _lean_launch(plan: "_GemmLaunch", team: Team) -> Optional[_LeanGemmLaunch]:
    native = plan.native.get(True) or plan.native.get(False)
    if not native:
        return None
    try:
        return _LeanGemmLaunch(plan, team, native)
    except (native_launch.Unsupported, KeyError):
        return None


def lean_gemm_call(handle, plans: dict, team: Team):
    """A GemmAllToAll call as a closure over everything its handle fixed: the common call
    (no autograd, counts as a list of ints or a device integer tensor, X row-major) checked
    with a few identity and integer comparisons and launched through the plan of X's rows
    class, without the general path's layers (~40 us of host time on an H200's host).
    `plans`: rows class -> (plan, its lean launch or None), filled by the general path
    (rows_exchange) as it makes them. Returns None, having done nothing, for any call it
    does not take (a rows class without a plan yet among them): the general path then
    checks it and raises what is wrong, or runs it."""
    dtype, k, world = handle.dtype, handle.K, team.world
    grouped = handle.groups > 1
    want_w = (handle.groups, k, handle.N) if grouped else (k, handle.N)
    want_counts = (world, handle.groups) if grouped else (world,)
    ctx = handle.ctx
    device = ctx.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    status, clear = handle._status, handle._status_clear
    max_rows = handle.max_rows
    ints_of = _device_ints(handle).of_ints
    descriptors = handle.__dict__.setdefault("_w_descriptors", {})
    is_grad_enabled, empty, int64, tensor_type = (torch.is_grad_enabled, torch.empty,
                                                  torch.int64, torch.Tensor)
    plain = PLAIN_TENSORS  # (W is a Parameter in a model: taken, outside autograd)
    n_cols = handle.N

    def outputs_of(rows):
        """What makes a call's outputs: `rows` rows of Y and the received counts."""
        return lambda: (empty((rows, n_cols), dtype=dtype, device=device),
                        empty(world, dtype=int64, device=device))

    # the rows and the received counts, reused once the caller dropped them (an allocation
    # costs as much host time as the launch: rocmoe/ops/outputs.py)
    ring = handle._outputs["gemm"] = OutputRing(outputs_of(handle.capacity_rows))
    take, stream = ring.take, native_launch.stream_getter(device)
    plan_of = plans.get
    # `exact` (the functional op's calls; a handle's own call returns its capacity rows): at
    # world size 1 a call that sends all of X's rows receives exactly them, and an output
    # of that many rows spares the caller the slice of the capacity-row output (a
    # dispatcher call, 1-2.5 us of host time). Its ring is made when the same rows come
    # twice running, so calls whose rows change every time (a model's routed tokens) keep
    # the capacity ring and make no output of their own.
    capacity_rows, outputs = handle.capacity_rows, handle._outputs
    last_whole_rows = -1  # the rows of the last call that sent all of X's rows

    def exact_take(rows, current):
        nonlocal last_whole_rows
        ring = outputs.get("gemm_exact")
        if ring is None or ring.key != rows:
            repeated, last_whole_rows = last_whole_rows == rows, rows
            if not repeated:
                return None
            ring = outputs["gemm_exact"] = OutputRing(outputs_of(rows), key=rows)
        return ring.take(capturing(), current)

    def call(x, w, send_counts, exact=False):
        if (type(x) not in plain or type(w) not in plain or x.dtype is not dtype
                or w.dtype is not dtype or handle.broken is not None
                or status.tobytes() != clear
                or ctx.finalized
                or x.get_device() != index or w.get_device() != index or x.dim() != 2
                or w.shape != want_w
                or (is_grad_enabled() and (world > 1 or x.requires_grad or w.requires_grad))):
            return None
        # (X's shape and strides read once each: 0.3 us less than a call per field on this
        # project's CPU, host time before the launch)
        rows, cols = x.shape
        row_step, col_step = x.stride()
        if cols != k or col_step != 1 or (rows > 1 and row_step != k):
            return None
        entry = plan_of(rows.bit_length() if rows > 1 else 1)  # (rows_class, inlined)
        if entry is None:
            return None
        plan, fast = entry
        if type(send_counts) is list and not grouped:
            if len(send_counts) != world:
                return None
            total = 0
            for c in send_counts:
                if type(c) is not int or c < 0 or c > max_rows:
                    return None
                total += c
            if total > rows:
                return None
            counts = ints_of(send_counts)  # (plain ints: checked just above)
            whole = exact and world == 1 and total == rows and rows < capacity_rows
        elif (type(send_counts) is tensor_type and send_counts.dtype is int64
              and send_counts.shape == want_counts and send_counts.get_device() == index):
            counts = send_counts.view(-1) if grouped else send_counts
            whole = False
        else:
            return None
        handle.epoch += 1
        current = stream()
        taken = exact_take(rows, current) if whole else None
        out, recv = taken if taken is not None else take(capturing(), current)
        if fast is None or not fast(x, w, counts, out, recv, current):
            before = fast.nl.generation if fast is not None else 0
            plan.launch(handle, team, x, w, counts, out, recv, descriptors)
            if fast is not None:
                fast.record(x, w, before)
        return out, recv
    return call
