"""Block-sparse products over a :class:`Topology`, with autograd.

Sparse operands are ``[nnz, B, B]`` value tensors over a topology. Dense weights are
grouped by expert: ``[E, K, F]`` where ``F`` is the logical ffn width (the padding up to
``nb * B`` is implicit: read as zero, never written).

=======  ==========================================  =====================
op       meaning                                      shapes
=======  ==========================================  =====================
SDD      S = (A @ W) restricted to the topology       A [P, K], W [E, K, F]
DSD      D = S @ W                                    W [E, F, N] -> [P, N]
DSᵀD     D = Sᵀ @ B                                   B [P, N] -> [E, F, N]
DDSᵀ     D = W @ Sᵀ                                   W [E, M, F] -> [M, P]
=======  ==========================================  =====================

On CUDA/ROCm tensors the Triton kernels run; elsewhere a torch implementation that walks
the same topology indices (COO rows, BCSR columns, CSC transpose) gives the reference.

Padding rows, the rows of a row block past its real tokens (``Topology.block_rows``, set on
every topology the routing builds), must be zero in the operands: the kernels skip them
where that saves work (config key ``tail``), so other values there give unspecified results.
The layer's permuted tokens, activations and gradients always have them zero.
"""

from __future__ import annotations

import contextlib

import functools
import os
import types

import torch
import torch.nn.functional as F_

from .._triton import interpreting as _interpreting
from .._triton import sm_count, tensor_descriptor, tma_capable
from ..errors import ConfigurationError, DTypeError, InvalidArgumentError
from .activations import activate, activation_grad, widened
# (set_backend, get_backend, TRITON_DTYPES: re-exported, the public names of the products)
from .backend import TRITON_DTYPES, get_backend, set_backend, use_triton  # noqa: F401
from .permute import sum_pair_rows
from .topology import Topology

def _check_same_dtype(*tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise DTypeError("block-sparse operands must share one dtype, got "
                         f"{sorted(map(str, dtypes))}")
    if not tensors[0].is_floating_point():
        raise DTypeError(f"block-sparse operands must be floating point, got {tensors[0].dtype}")


# ---------------------------------------------------------------------------- torch path
def _grouped_col_blocks(w: torch.Tensor, topo: Topology) -> torch.Tensor:
    """[E, K, F] -> [E * nb, K, B]: the column blocks of every expert, zero-padded."""
    e, k, f = w.shape
    w = F_.pad(w, (0, topo.ffn_padded - f))
    return w.view(e, k, topo.blocks_per_expert, topo.block_size).permute(0, 2, 1, 3) \
            .reshape(e * topo.blocks_per_expert, k, topo.block_size)


def _grouped_row_blocks(w: torch.Tensor, topo: Topology) -> torch.Tensor:
    """[E, F, N] -> [E * nb, B, N]: the row blocks of every expert, zero-padded."""
    e, f, n = w.shape
    w = F_.pad(w, (0, 0, 0, topo.ffn_padded - f))
    return w.reshape(e * topo.blocks_per_expert, topo.block_size, n)


def _compact_rows(topo: Topology) -> torch.Tensor:
    """For each padded row of a compact topology, its row in the values (num_pairs for a
    padding row: a sink past the end); int64 [num_rows]."""
    b = topo.block_size
    rows = torch.arange(topo.num_rows, device=topo.block_rows.device)
    block, within = rows // b, rows % b
    real = within < topo.block_rows.long()[block]
    return torch.where(real, topo.block_first_row.long()[block] + within,
                       torch.full_like(rows, topo.num_pairs))


def _blocks_to_values(blocks: torch.Tensor, topo: Topology) -> torch.Tensor:
    """[nnz, B, B] blocks -> the topology's values (the blocks themselves, or compact)."""
    if not topo.compact:
        return blocks
    b, nb = topo.block_size, topo.blocks_per_expert
    rows = blocks.reshape(topo.num_row_blocks, nb, b, b).permute(0, 2, 1, 3) \
        .reshape(topo.num_rows, nb * b)
    out = rows.new_zeros(topo.num_pairs + 1, nb * b)  # (+1: the padding rows' sink)
    return out.index_copy_(0, _compact_rows(topo), rows)[:topo.num_pairs]


def _values_to_blocks(values: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The topology's values -> [nnz, B, B] blocks (padding rows zero)."""
    if not topo.compact:
        return values
    b, nb = topo.block_size, topo.blocks_per_expert
    padded = torch.cat([values, values.new_zeros(1, nb * b)])
    rows = padded.index_select(0, _compact_rows(topo))
    return rows.reshape(topo.num_row_blocks, b, nb, b).permute(0, 2, 1, 3) \
        .reshape(topo.nnz, b, b)


def _sdd_torch(a, w, topo):
    b = topo.block_size
    valid = topo.block_valid()
    cols = topo.column_indices.clamp(min=0).long()
    a_blocks = a.reshape(topo.num_row_blocks, b, a.shape[1])[topo.row_indices.long()]
    out = torch.bmm(a_blocks, _grouped_col_blocks(w, topo)[cols])
    return out * valid.view(-1, 1, 1).to(out.dtype)


def _dsd_torch(s, w, topo):
    valid = topo.block_valid()
    cols = topo.column_indices.clamp(min=0).long()
    prod = torch.bmm(s, _grouped_row_blocks(w, topo)[cols]) * valid.view(-1, 1, 1).to(s.dtype)
    out = prod.new_zeros(topo.num_row_blocks, topo.block_size, w.shape[2])
    out.index_add_(0, topo.row_indices.long(), prod)
    return out.view(topo.num_rows, w.shape[2])


def _dstd_torch(s, b, topo):
    # Walk blocks in transpose (CSC) order, as the GPU kernel does.
    order = topo.transpose_blocks.long()
    cols = topo.column_indices[order]
    valid = (cols >= 0).view(-1, 1, 1).to(s.dtype)
    rows = topo.row_indices[order].long()
    n = b.shape[1]
    b_blocks = b.reshape(topo.num_row_blocks, topo.block_size, n)[rows]
    prod = torch.bmm(s[order].transpose(1, 2), b_blocks) * valid
    out = prod.new_zeros(topo.num_column_blocks, topo.block_size, n)
    out.index_add_(0, cols.clamp(min=0).long(), prod)
    return out.view(topo.num_experts, topo.ffn_padded, n)[:, :topo.ffn_size]


# --------------------------------------------------------------------------- triton path
# Tile configuration of the Triton kernels. BLOCK_M is the topology's block size; these are
# the rest. Override with ROCMOE_MOE_KERNEL_CONFIG='{"block_n": 256, ...}' or set_kernel_config.
# act_fusion (what the fused FFN keeps for its backward; see its block comment below):
# "recompute" (the default) keeps h alone and has the backward SDD recompute act(h) and
# act'(h) from it in its epilogue, so DSD and DSᵀD still run without an activation; "store"
# keeps act(h) and act'(h) (one [rows, ffn] tensor more); "load" keeps h and applies the
# activation as DSD/DSᵀD load it, which an H200 pays for (benchmarks/results/
# moe_kernels_h200.jsonl: DSᵀD for dW2 at 651 TFLOP/s plain against 184 with GELU on load,
# the activation's exp/rcp on every reload competing with the matrix units); "checkpoint"
# keeps nothing [rows, ffn] and recomputes h first.
# gather_rows: SDD and dW1's DSᵀD read the tokens' rows through the routing plan's row map
# (no permuted [rows, H] copy of the tokens; "backward": the forward's SDD reads a copy by
# TMA, which dies with the forward, and dW1 gathers); compact_values: the [rows, ffn] tensors keep
# no padding rows (Topology). Both are the default; the layer then needs at most the memory
# of a grouped-GEMM layer (tests/moe/test_memory.py, rocmoe.bench.moe_memory).
#
# Tiles: the H200 sweep with interleaved timing (benchmarks/results/moe_kernels_h200_sweep3.jsonl,
# `rocmoe bench moe_kernels`) found 128x128 tiles, 4 warps, 3 stages best for most kernels
# on the six benchmark shapes (+3 to +22 % over 128x256 / 8 warps, harmonic over the six
# kernels): two such programs fit on an SM, so one's epilogue overlaps the other's products,
# which matters where K is short (SDD's K is the hidden size; DSᵀD's the rows per expert).
# DSD with W as stored (the forward's W2) keeps 128x256 / 8 warps / 4 stages (+8 % there);
# DSD with transposed W (the backward's W1ᵀ, "dsd_wt") does better with the narrow tile.
# DSᵀD (K = an expert's rows) runs persistent, two programs per SM ("persistent": 2): on the
# 8192-token shapes (2-3 k steps per tile) +6 to +17 % over a program per tile, within noise
# elsewhere (benchmarks/results/moe_kernels_h200_dstd_variants.jsonl). Over experts of 2048
# rows or more on average ("dstd_long") a program per tile with 2 stages does best (three
# programs fit on an SM): +3 to +7 % over 3 stages there, ahead of 128x256 / 8 warps.
# Over such long experts SDD and DSD also order their tiles by groups of row blocks
# ("group_m" in "sdd_long" / "dsd_long" / "dsd_wt_long"): the row blocks running side by
# side then share each weight tile. On the 4-expert shape (32 row blocks per expert, K 4096)
# the backward SDD gained 13 %, DSD with Wᵀ 5 %; on the 8192-token shapes (2 row blocks per
# expert, which run side by side anyway) grouping lost 1-5 %
# (benchmarks/results/moe_kernels_h200_group_m.jsonl). Over long experts DSD with Wᵀ also
# does better with 128x256 / 8 warps / 3 stages (+10 to +17 % on the 2048- and 4096-row
# shapes), and so does SDD where its K is DEEP_K or more ("sdd_deep": +10 % for both SDDs
# on the 4-expert shape, whose K is 4096), while with K 512-1024 the wide tile lost 6-9 %:
# there the two narrow programs per SM hide each other's epilogue, which a 64-step K loop
# amortises alone (benchmarks/results/moe_kernels_h200_long_experts.jsonl).
# act_fusion's values (see the fused expert FFN's block comment)
FUSIONS = ("recompute", "store", "load", "checkpoint")
KERNEL_CONFIG = dict(block_n=128, block_k=64, num_warps=4, num_stages=3,
                     act_fusion="recompute", gather_rows=True, compact_values=True,
                     backward_streams=1,
                     tma=True, fast_act=True, preload_scale=True, tma_store=False,
                     persistent=0, tail=True, group_m=1, sdd={},
                     dsd=dict(block_n=256, num_warps=8, num_stages=4), dsd_wt={},
                     dstd=dict(persistent=2), sdd_long=dict(group_m=16),
                     sdd_deep=dict(block_n=256, num_warps=8, group_m=16),
                     dsd_long=dict(block_n=256, num_warps=8, num_stages=4, group_m=16),
                     dsd_wt_long=dict(block_n=256, num_warps=8, num_stages=3, group_m=8),
                     dstd_long=dict(num_stages=2))
LONG_EXPERT_ROWS = 2048
DEEP_K = 2048
# CDNA has 64 KiB of LDS per CU: a 128x256 tile with 3 stages (144 KiB) cannot launch.
# (Untested on MI-series hardware so far: a starting point, not a tuned choice. Its kernels
# build for gfx942 and gfx90a with no spill to scratch: tests/moe/test_aot_compile.py.)
CDNA_OVERRIDES = dict(block_n=128, num_warps=8, num_stages=2, dsd={}, dstd_long={},
                      dsd_long=dict(group_m=16), dsd_wt_long=dict(group_m=8),
                      sdd_deep=dict(group_m=16))
if torch.version.hip:
    KERNEL_CONFIG.update(CDNA_OVERRIDES)
# "tma": load tiles with the Tensor Memory Accelerator through tensor descriptors where the
# GPU has one (Hopper and later) and the operands' layout allows (16-byte aligned rows, K and
# ffn multiples of the tile); elsewhere, and always on AMD, the kernels use pointer loads.
# "fast_act" (NVIDIA, 16-bit types): the SDD epilogue's sigmoids use tanh.approx (+10 % for
# the forward SDD that writes GELU and GELU' on the 65536x1024x4096 shape).
# "preload_scale": the backward SDD loads its act'(h) tile before the K loop, not after.
# "sdd" / "dsd" / "dsd_wt" / "dstd": per-kernel overrides of the tile keys, e.g.
# {"dstd": {"block_n": 256, "num_warps": 8}}; each overrides the global keys on its own.
# "sdd_long" / "dsd_long" / "dsd_wt_long" / "dstd_long": the same kernel's overrides, used
# instead where the experts average LONG_EXPERT_ROWS rows or more (long_experts); for SDD
# over long experts with a K of DEEP_K or more, "sdd_deep".
# "tma_store" (DSᵀD, with TMA loads): the output tile goes out through a tensor descriptor.
# "persistent" (SDD and DSᵀD, with TMA loads): 0 launches a program per output tile; k > 0
# launches k programs per SM that loop over the tiles in one flat, software-pipelined loop.
# "backward_streams": 2 runs the backward's weight gradients (DSᵀD) on a side stream, dW2
# beside dh and dW1 beside dx. On an H200 that gained nothing: fwd+bwd 0.998-1.024x queued,
# 1.00-1.02x under CUDA graphs, 0.94-1.00x from an idle GPU (extra host work), six shapes
# (benchmarks/results/ab_backward_streams_h200.jsonl): each kernel's grid already fills the
# GPU. It stays an option (1 by default) to measure where that is not so (CDNA, small grids).
# "tail": skip padding rows where the topology knows the real ones: SDD and DSD compute
# only the top half of a row block with at most B/2 real rows; DSᵀD reduces over an
# expert's real rows (rounded up to block_k), not its whole last block.
# "group_m" (SDD and DSD): launch order of the output tiles; 1 walks a row block's column
# tiles before the next row block's, g > 1 lets g row blocks take each column tile in turn
# (they then share the weight tile in L2: see kernels._grouped_tile).
TILE_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "tma", "fast_act", "preload_scale",
             "tma_store", "persistent", "tail", "group_m")
OPS = ("sdd", "dsd", "dsd_wt", "dstd", "sdd_long", "sdd_deep", "dsd_long", "dsd_wt_long",
       "dstd_long")


def set_kernel_config(**kw) -> None:
    known = set(KERNEL_CONFIG)
    unknown = set(kw) - known
    if unknown:
        raise ConfigurationError(f"unknown kernel config keys {sorted(unknown)}; "
                                 f"known: {sorted(known)}")
    if kw.get("backward_streams", 1) not in (1, 2):
        raise ConfigurationError(f"backward_streams must be 1 or 2, got {kw['backward_streams']!r}")
    if kw.get("gather_rows", True) not in (True, False, "backward"):
        raise ConfigurationError(
            f"gather_rows must be True, False or 'backward', got {kw['gather_rows']!r}")
    if not isinstance(kw.get("compact_values", False), bool):
        raise ConfigurationError(
            f"compact_values must be True or False, got {kw['compact_values']!r}")
    if kw.get("act_fusion", "load") not in FUSIONS:
        raise ConfigurationError(f"act_fusion must be one of {FUSIONS}, got {kw['act_fusion']!r}")
    for op in OPS:
        if op in kw:
            if not isinstance(kw[op], dict) or set(kw[op]) - set(TILE_KEYS):
                raise ConfigurationError(f"kernel config {op!r} must be a dict of "
                                         f"{list(TILE_KEYS)}, got {kw[op]!r}")
    for g in [kw.get("group_m", 1)] + [kw[op].get("group_m", 1) for op in OPS if op in kw]:
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ConfigurationError(f"kernel config group_m must be an int >= 1, got {g!r}")
    KERNEL_CONFIG.update(kw)
    _OP_CONFIGS.clear()
    _PLANS.clear()


# op_config's results, per entry name, until the config changes: the launchers ask at every
# call, and a small layer is bound by their host time.
_OP_CONFIGS: dict = {}
# The launchers' plans (see "launch plans" below), also until the config changes.
_PLANS: dict = {}
_MAX_PLANS = 512
PLAN_CACHE = True  # False: every call decides afresh (what the tests compare plans with)


def op_config(op: str, topo=None, k: int = 0):
    """The tile keys for one kernel (read-only): the global ones with that kernel's
    overrides on top (its "_long" overrides where `topo`'s experts are long; "sdd_deep" for
    SDD there when its reduction length `k` is DEEP_K or more)."""
    if topo is not None and long_experts(topo):
        op = "sdd_deep" if op == "sdd" and k >= DEEP_K else op + "_long"
    cfg = _OP_CONFIGS.get(op)
    if cfg is None:
        merged = {key: KERNEL_CONFIG[key] for key in TILE_KEYS}
        merged.update(KERNEL_CONFIG.get(op) or {})
        cfg = _OP_CONFIGS[op] = types.MappingProxyType(merged)
    return cfg


def long_experts(topo) -> bool:
    """Whether the experts average LONG_EXPERT_ROWS rows or more (from the static padded
    row count: no device read)."""
    return topo.num_rows >= LONG_EXPERT_ROWS * max(topo.num_experts, 1)


if os.environ.get("ROCMOE_MOE_KERNEL_CONFIG"):
    import json as _json
    set_kernel_config(**_json.loads(os.environ["ROCMOE_MOE_KERNEL_CONFIG"]))

ACT_CODES = {"none": 0, "gelu": 1, "relu": 2, "silu": 3}


def _tile_n(n: int, cfg: dict) -> int:
    want = cfg["block_n"]
    return want if n >= want else max(16, 1 << (max(n, 1) - 1).bit_length())


def _block_k(b: int, cfg: dict) -> int:
    return min(b, cfg["block_k"])


_SMEM_LIMIT = {}


def _smem_limit(device) -> int:
    """Shared memory (LDS) one program may use on this device, in bytes."""
    if device.type != "cuda":
        return 232448  # the interpreter has no limit; use Hopper's for consistency
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM_LIMIT:
        props = torch.cuda.get_device_properties(idx)
        default = 65536 if torch.version.hip else 232448
        _SMEM_LIMIT[idx] = int(getattr(props, "shared_memory_per_block_optin", 0) or default)
    return _SMEM_LIMIT[idx]


def _fit(device, b: int, bn: int, bk: int, elsize: int, min_bn: int,
         cfg=None) -> tuple[int, int]:
    """(N tile, pipeline stages) whose stages of A [b, bk] + B [bk, bn] tiles fit in shared
    memory (fp32 operands or a small LDS need fewer stages or narrower tiles)."""
    limit = _smem_limit(device) - 8192  # room for the epilogue's layout conversions
    return _fit_tiles(limit, b, bn, bk, elsize, min_bn, (cfg or KERNEL_CONFIG)["num_stages"])


@functools.lru_cache(maxsize=1024)
def _fit_tiles(limit: int, b: int, bn: int, bk: int, elsize: int, min_bn: int,
               stages: int) -> tuple[int, int]:
    while True:
        per_stage = (b * bk + bk * bn) * elsize
        fit = limit // per_stage
        if fit >= min(stages, 2) or bn <= min_bn:
            return bn, max(1, min(stages, fit))
        bn //= 2


def _launch(b: int, stages: int, cfg: dict) -> dict:
    if _interpreting():
        return {}
    return dict(num_warps=cfg["num_warps"] if b >= 64 else 4, num_stages=stages)


def _nvidia_compiled(t: torch.Tensor) -> bool:
    """Whether kernels for `t` are compiled for an NVIDIA GPU (PTX inline assembly allowed)."""
    return t.is_cuda and torch.version.hip is None and not _interpreting()


# ------------------------------------------------------------------ TMA tensor descriptors
# Tests set this to run the descriptor variants under the CPU interpreter.
TMA_IN_INTERPRETER = False


def _tma_device(t: torch.Tensor, cfg: dict) -> bool:
    """Whether the kernels may take tensor descriptors for operands like `t`."""
    if not cfg.get("tma") or t.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _interpreting():
        return TMA_IN_INTERPRETER
    return tma_capable(t.device)


def _grouped_desc(w: torch.Tensor, block_rows: int, block_cols: int):
    """Descriptor of grouped weights W [E, R, C] as a 2-D [E*R, C] matrix (W_T False), or,
    when W is the transpose of a contiguous-row [E, C, R] tensor, of that tensor as [E*C, R]
    (W_T True, boxes transposed); None when neither layout fits TMA."""
    e, r, c = w.shape
    if w.stride(2) == 1 and w.stride(0) == r * w.stride(1):
        d = tensor_descriptor(w, e * r, c, w.stride(1), [block_rows, block_cols])
        return (d, False) if d is not None else None
    if w.stride(1) == 1 and w.stride(0) == c * w.stride(2):
        d = tensor_descriptor(w, e * c, r, w.stride(2), [block_cols, block_rows])
        return (d, True) if d is not None else None
    return None


def _tail(topo, cfg: dict) -> bool:
    """Whether the kernels may skip padding rows: the topology knows its real rows, the
    config allows it, and a half block still feeds the matrix units (at least 16 rows)."""
    return bool(cfg["tail"]) and topo.block_rows is not None and topo.block_size >= 32


@functools.lru_cache(maxsize=1)
def _kernels():
    # (imported on first launch, and once: triton is only needed by the GPU path)
    from . import kernels
    return kernels


def _sdd_split(b: int, nb: int, cfg: dict) -> int:
    """Consecutive blocks of a row per SDD program: a B x SPLIT*B tile up to block_n wide."""
    split = max(1, cfg["block_n"] // b)
    return max(1, min(split, 1 << (max(nb, 1) - 1).bit_length()))


# ---------------------------------------------------------------------------- launch plans
# What a launcher decides (kernel, tiles, stages, constexprs, launch options, grid, which
# operands go as tensor descriptors with what shape, strides and box) depends only on static
# properties of its operands: the topology's sizes (_topo_key), the operands' shapes,
# strides, dtypes and device, their addresses modulo 16 (tensor_descriptor refuses an
# unaligned base; a meta tensor's address reads 0), the epilogue's options, KERNEL_CONFIG
# and the module settings LONG_EXPERT_ROWS, DEEP_K and TMA_IN_INTERPRETER. Deciding it all
# at every call cost more host time than the launch itself (benchmarks/probe_moe_glue.py),
# so each launcher keeps its decisions as a _Plan under such a key: a call then allocates
# its output, fills in its tensors (descriptors from the plan's fields) and launches.
# A plan holds no tensor (a descriptor is kept as its fields without the base), and at
# most _MAX_PLANS are kept (the oldest goes first). set_kernel_config clears them
# (KERNEL_CONFIG must change through it, as op_config's cache already requires); the
# module settings are part of the key; TRITON_INTERPRET is read at every call, as before
# (once per call now), and is part of the key too. tests/moe/test_launch_plans.py checks
# that the plans launch what deciding afresh launches. (_PLANS is defined next to
# _OP_CONFIGS, which set_kernel_config clears alike.)


class _Plan:
    """One launcher's decisions for one key (see above). name: the kernel (None: nothing to
    launch); ints: its integer arguments after the tensors (and before the output's strides);
    tail: TAIL (_layout_args); d0, d1: the first and second operand's descriptor fields (None:
    the tensor itself); flag: SDD's REWRITE_ACT, DSᵀD's reading of the experts' real rows;
    store: DSᵀD's (block, N tile) where the output goes out by descriptor where it fits."""
    __slots__ = ("name", "out_shape", "grid", "kwargs", "ints", "tail", "d0", "d1",
                 "persistent", "flag", "store")

    def __init__(self, out_shape, name=None, **kw):
        self.out_shape, self.name = out_shape, name
        self.grid = self.kwargs = self.d0 = self.d1 = self.store = None
        self.ints, self.tail, self.persistent, self.flag = (), False, False, False
        for k, v in kw.items():
            setattr(self, k, v)


def _keep(key, plan: _Plan) -> _Plan:
    if PLAN_CACHE:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))  # (the oldest)
        _PLANS[key] = plan
    return plan


def _topo_key(topo) -> tuple:
    """What of a topology the launchers' decisions depend on (its sizes, and which of its
    optional index tensors it has)."""
    return (topo.block_size, topo.num_experts, topo.ffn_size, topo.blocks_per_expert,
            topo.num_row_blocks, topo.num_pairs, topo.block_rows is None,
            topo.expert_rows is None, topo.block_first_row is None)


def _desc_fields(d):
    """(class, fields without the base) of a descriptor made by tensor_descriptor, for a
    plan; None for None."""
    if d is None:
        return None
    fields = dict(vars(d))
    del fields["base"]
    return type(d), fields


def _desc(kept, base):
    """The descriptor of `base` with a plan's fields: what tensor_descriptor made for the
    call the plan was made for, whose base had the same dtype, strides and alignment (so
    what the constructor checks holds again and is not checked again)."""
    cls, fields = kept
    d = object.__new__(cls)
    d.__dict__ = {"base": base, **fields}
    return d


def _sdd_plan(a, w, topo, act_grad_of, act, act_out, scale_by, act_only, keep_product,
              rewrite_act, a_rows) -> _Plan:
    cfg = op_config("sdd", topo, a.shape[1])
    b = topo.block_size
    if topo.nnz == 0:
        return _Plan(topo.values_shape())
    k = a.shape[1]
    f = w.shape[2]
    bk = _block_k(b, cfg)
    nb = topo.blocks_per_expert
    tile_n, stages = _fit(a.device, b, _sdd_split(b, nb, cfg) * b, bk, a.element_size(), b, cfg)
    split = tile_n // b
    num_n = -(-nb // split)
    even_k = k % bk == 0
    even_f = f % (b * split) == 0 and nb % split == 0
    a_desc = w_desc = None
    tma = w_t = False
    tail = _tail(topo, cfg)
    if even_k and even_f and a.stride(1) == 1 and _tma_device(a, cfg):
        # (gathered rows come by pointer: a descriptor cannot gather on Hopper)
        a_d = tensor_descriptor(a, a.shape[0], k, a.stride(0), [b, bk]) \
            if a_rows is None else a
        w_d = _grouped_desc(w, bk, tile_n)
        if a_d is not None and w_d is not None:
            a_desc = _desc_fields(a_d) if a_rows is None else None
            w_desc, w_t, tma = _desc_fields(w_d[0]), w_d[1], True
    epilogue = dict(
        EPILOGUE_ACT_GRAD=ACT_CODES[act] if act_grad_of is not None else 0,
        EPILOGUE_STORE_ACT=ACT_CODES[act] if act_out is not None else 0,
        EPILOGUE_SCALE=scale_by is not None, W_T=w_t,
        FAST_ACT=bool(cfg["fast_act"]) and _nvidia_compiled(a) and a.element_size() == 2,
        PRELOAD_SCALE=bool(cfg["preload_scale"]) and scale_by is not None,
        EPILOGUE_ACT=ACT_CODES[act] if act_only else 0,
        STORE_PRE=keep_product and act_out is not None,
        REWRITE_ACT=rewrite_act and act_grad_of is not None)
    num_tiles = topo.num_row_blocks * num_n
    epilogue["COMPACT"] = topo.compact
    plan = _Plan(topo.values_shape(), tail=tail, d0=a_desc, d1=w_desc,
                 flag=epilogue["REWRITE_ACT"])
    if tma and cfg["persistent"] > 0 and a_rows is None:
        plan.name, plan.persistent = "sdd_persistent_kernel", True
        plan.grid = (max(1, min(num_tiles, sm_count(a.device) * int(cfg["persistent"]))),)
        epilogue.pop("PRELOAD_SCALE")  # (the persistent kernel reads the scale late)
        plan.ints = (k, f, nb, num_n, num_tiles)
        plan.kwargs = dict(BLOCK=b, SPLIT=split, BLOCK_K=bk, GROUP_M=cfg["group_m"],
                           **epilogue, **_launch(b, stages, cfg))
        return plan
    plan.name, plan.grid = "sdd_kernel", (num_tiles,)
    plan.ints = (k, f, nb, num_n, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
                 w.stride(2))
    plan.kwargs = dict(BLOCK=b, SPLIT=split, BLOCK_K=bk, EVEN_K=even_k, EVEN_F=even_f,
                       USE_TMA=tma, TAIL=tail, GROUP_M=cfg["group_m"],
                       GATHER_A=a_rows is not None, **epilogue, **_launch(b, stages, cfg))
    return plan


def _sdd_triton(a, w, topo, act_grad_of=None, act="none", act_out=None, scale_by=None,
                act_only=False, keep_product=False, rewrite_act=False, a_rows=None):
    interp = _interpreting()
    key = (_topo_key(topo), a.shape, a.stride(), a.dtype, a.device, w.shape, w.stride(),
           w.dtype, a.data_ptr() & 15, w.data_ptr() & 15, act,
           act_grad_of is None, act_out is None, scale_by is None, act_only, keep_product,
           rewrite_act, a_rows is None, interp, TMA_IN_INTERPRETER, LONG_EXPERT_ROWS, DEEP_K)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _keep(key, _sdd_plan(a, w, topo, act_grad_of, act, act_out, scale_by,
                                    act_only, keep_product, rewrite_act, a_rows))
    out = torch.empty(plan.out_shape, device=a.device, dtype=a.dtype)
    if plan.name is None:
        return out
    h = act_grad_of if act_grad_of is not None else scale_by if scale_by is not None else out
    # (rewrite_act: act(h) goes back into h itself)
    act_out = act_grad_of if plan.flag else out if act_out is None else act_out
    block_rows, first_row = _layout_args(topo, plan.tail)
    a_arg = a if plan.d0 is None else _desc(plan.d0, a)
    w_arg = w if plan.d1 is None else _desc(plan.d1, w)
    cols = topo.column_indices
    if plan.persistent:
        _kernels().launch(plan.name)[plan.grid](
            a_arg, w_arg, out, h, act_out, cols, block_rows, first_row, *plan.ints,
            **plan.kwargs)
    else:
        _kernels().launch(plan.name)[plan.grid](
            a_arg, a, w_arg, out, h, act_out, cols, block_rows,
            cols if a_rows is None else a_rows, first_row, *plan.ints, **plan.kwargs)
    return out


def _layout_args(topo, tail: bool):
    """(block_rows, block_first_row) kernel arguments: the real rows per row block where
    the kernel reads them (TAIL, compact values), the compact rows' first row (compact);
    column_indices stands in for what a kernel does not read."""
    return (topo.block_rows if tail or topo.compact else topo.column_indices,
            topo.block_first_row if topo.compact else topo.column_indices)


def _values_desc(s, topo, box):
    """A descriptor of the sparse values in `box` boxes: [nnz*B, B] blocks, or the compact
    [pairs, nb*B] rows."""
    if topo.compact:
        return tensor_descriptor(s, topo.num_pairs, topo.ffn_padded, topo.ffn_padded, box)
    b = topo.block_size
    return tensor_descriptor(s, topo.nnz * b, b, b, box)


def _dsd_plan(s, w, topo, act) -> _Plan:
    # W read transposed (unit stride along F: the backward's W1ᵀ) has its own tiles
    cfg = op_config("dsd_wt" if w.stride(1) == 1 and w.stride(2) != 1 else "dsd", topo)
    b = topo.block_size
    n = w.shape[2]
    if topo.num_row_blocks == 0 or n == 0:
        return _Plan((topo.num_rows, n))
    bk = _block_k(b, cfg)
    bn, stages = _fit(s.device, b, _tile_n(n, cfg), bk, s.element_size(), 16, cfg)
    num_n = -(-n // bn)
    f = w.shape[1]
    s_desc = w_desc = None
    tma = w_t = False
    tail = _tail(topo, cfg)
    if f % b == 0 and s.is_contiguous() and _tma_device(s, cfg):
        s_d = _values_desc(s, topo, [b, bk])
        w_d = _grouped_desc(w, bk, bn)
        if s_d is not None and w_d is not None:
            s_desc, w_desc, w_t, tma = _desc_fields(s_d), _desc_fields(w_d[0]), w_d[1], True
    return _Plan(
        (topo.num_rows, n), "dsd_kernel", grid=(topo.num_row_blocks * num_n,), tail=tail,
        d0=s_desc, d1=w_desc,
        ints=(n, f, topo.blocks_per_expert, num_n, w.stride(0), w.stride(1), w.stride(2)),
        kwargs=dict(BLOCK=b, BLOCK_N=bn, BLOCK_K=bk, EVEN_F=f % b == 0,
                    EVEN_N=n % bn == 0, ACT=ACT_CODES[act], USE_TMA=tma, W_T=w_t, TAIL=tail,
                    GROUP_M=cfg["group_m"], COMPACT=topo.compact, **_launch(b, stages, cfg)))


def _dsd_triton(s, w, topo, act="none"):
    interp = _interpreting()
    key = (_topo_key(topo), s.shape, s.stride(), s.dtype, s.device, w.shape, w.stride(),
           w.dtype, s.data_ptr() & 15, w.data_ptr() & 15, act, interp,
           TMA_IN_INTERPRETER, LONG_EXPERT_ROWS)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _keep(key, _dsd_plan(s, w, topo, act))
    out = torch.empty(plan.out_shape, device=s.device, dtype=s.dtype)
    if plan.name is None:
        return out
    s_arg = s if plan.d0 is None else _desc(plan.d0, s)
    w_arg = w if plan.d1 is None else _desc(plan.d1, w)
    _kernels().launch(plan.name)[plan.grid](
        s_arg, s, w_arg, out, topo.column_indices, *_layout_args(topo, plan.tail),
        *plan.ints, out.stride(0), out.stride(1), **plan.kwargs)
    return out


def _dstd_plan(s, b_dense, topo, act, out_shape, b_rows) -> _Plan:
    cfg = op_config("dstd", topo)
    b = topo.block_size
    n = b_dense.shape[1]
    if topo.num_column_blocks == 0 or n == 0:
        return _Plan(out_shape)
    bk = _block_k(b, cfg)
    bn, stages = _fit(s.device, b, _tile_n(n, cfg), bk, s.element_size(), 16, cfg)
    num_n = -(-n // bn)
    s_desc = b_desc = None
    tma = False
    if s.is_contiguous() and b_dense.stride(1) == 1 and _tma_device(s, cfg):
        s_d = _values_desc(s, topo, [bk, b])
        # (gathered rows come by pointer)
        b_d = tensor_descriptor(b_dense, b_dense.shape[0], n, b_dense.stride(0), [bk, bn]) \
            if b_rows is None else b_dense
        if s_d is not None and b_d is not None:
            s_desc, tma = _desc_fields(s_d), True
            b_desc = _desc_fields(b_d) if b_rows is None else None
    num_tiles = topo.num_column_blocks * num_n
    # TRIM_K: reduce over an expert's real rows only (rounded up to BLOCK_K)
    trim = bool(cfg["tail"]) and topo.expert_rows is not None
    plan = _Plan(out_shape, d0=s_desc, d1=b_desc, flag=trim or topo.compact,
                 # (the output's descriptor, when there is one, is made at each call: its
                 # fit depends on the output tensor, which the call may pass)
                 store=(b, bn) if tma and cfg["tma_store"] else None)
    # (TMA_STORE and OUT_T: placeholders the call sets, in this order)
    if tma and cfg["persistent"] > 0:
        plan.name, plan.persistent = "dstd_persistent_kernel", True
        plan.grid = (max(1, min(num_tiles, sm_count(s.device) * int(cfg["persistent"]))),)
        plan.ints = (n, topo.ffn_size, topo.blocks_per_expert, num_n, num_tiles,
                     b_dense.stride(0), b_dense.stride(1))
        plan.kwargs = dict(BLOCK=b, BLOCK_N=bn, BLOCK_K=bk, ACT=ACT_CODES[act],
                           TMA_STORE=False, OUT_T=False, TRIM_K=trim,
                           GATHER_B=b_rows is not None, COMPACT=topo.compact,
                           **_launch(b, stages, cfg))
        return plan
    plan.name, plan.grid = "dstd_kernel", (num_tiles,)
    plan.ints = (n, topo.ffn_size, topo.blocks_per_expert, num_n, b_dense.stride(0),
                 b_dense.stride(1))
    plan.kwargs = dict(BLOCK=b, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=n % bn == 0,
                       ACT=ACT_CODES[act], USE_TMA=tma, TMA_STORE=False, OUT_T=False,
                       TRIM_K=trim, GATHER_B=b_rows is not None, COMPACT=topo.compact,
                       **_launch(b, stages, cfg))
    return plan


def _dstd_triton(s, b_dense, topo, act="none", out=None, b_rows=None):
    interp = _interpreting()
    key = (_topo_key(topo), s.shape, s.stride(), s.dtype, s.device, b_dense.shape,
           b_dense.stride(), b_dense.dtype, s.data_ptr() & 15,
           b_dense.data_ptr() & 15, act, b_rows is None, interp,
           TMA_IN_INTERPRETER, LONG_EXPERT_ROWS)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _keep(key, _dstd_plan(s, b_dense, topo, act,
                                     (topo.num_experts, topo.ffn_size, b_dense.shape[1]),
                                     b_rows))
    if out is None:
        out = torch.empty(plan.out_shape, device=s.device, dtype=s.dtype)
    if plan.name is None:
        return out
    s_arg = _desc(plan.d0, s) if plan.d0 is not None else s
    b_arg = _desc(plan.d1, b_dense) if plan.d1 is not None else b_dense
    kwargs = plan.kwargs
    out_arg = out
    if plan.store is not None:
        out_arg, out_t = _dstd_out_desc(out, topo, *plan.store)
        kwargs = dict(kwargs, TMA_STORE=out_arg is not out, OUT_T=out_t)
    cols = topo.column_offsets
    # (trim or compact: the kernel reads the experts' real rows)
    expert_rows = topo.expert_rows if plan.flag else cols
    rows_arg = cols if b_rows is None else b_rows
    first_row = _layout_args(topo, False)[1]
    _kernels().launch(plan.name)[plan.grid](
        s_arg, b_arg, out_arg, cols, expert_rows, rows_arg, first_row, *plan.ints,
        *out.stride(), **kwargs)
    return out


def _dstd_out_desc(out: torch.Tensor, topo, b: int, bn: int):
    """(descriptor, OUT_T) for DSᵀD's [E, F, N] output, or (out, False) when a box could
    cross into the next expert's rows (TMA clips only at the tensor's edge) or the layout
    does not fit: [E*F, N] when rows are contiguous (F a multiple of the block), or, for the
    transpose of a contiguous [E, N, F] (dW1), that tensor as [E*N, F] (N a multiple of
    the N tile)."""
    e, f, n = out.shape
    if out.stride(2) == 1 and out.stride(0) == f * out.stride(1) and f % b == 0:
        d = tensor_descriptor(out, e * f, n, out.stride(1), [b, bn])
        return (d, False) if d is not None else (out, False)
    if out.stride(1) == 1 and out.stride(0) == n * out.stride(2) and n % bn == 0:
        d = tensor_descriptor(out, e * n, f, out.stride(2), [bn, b])
        return (d, True) if d is not None else (out, False)
    return out, False


# ------------------------------------------------------------------------ raw dispatch
def _gathered(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The padded rows [len(rows), N] of t [T, N]: row p is t[rows[p]], zeros where
    rows[p] < 0 (what the kernels read when they gather the rows themselves)."""
    padded = torch.cat([t, t.new_zeros(1, t.shape[1])])
    return padded.index_select(0, torch.where(rows < 0, t.shape[0], rows).long())


def _sdd(a, w, topo, act_grad_of=None, act="none", act_out=None, scale_by=None,
         act_only=False, keep_product=False, rewrite_act=False, a_rows=None):
    # (values in and out are in the topology's layout; the torch path computes blocks)
    """SDD S; epilogue options: times act'(act_grad_of) (rewrite_act: rounded to the storage
    type, and act_grad_of overwritten with act(act_grad_of)); times scale_by; (act_out)
    write act(S) to act_out and return act'(S) instead of S (keep_product: S itself); or
    (act_only) return act(S). a_rows: A is [T, K], its padded rows gathered (_gathered)."""
    if use_triton(a):
        return _sdd_triton(a, w, topo, act_grad_of, act, act_out, scale_by, act_only,
                           keep_product, rewrite_act, a_rows)
    out = _blocks_to_values(_sdd_torch(a if a_rows is None else _gathered(a, a_rows), w, topo),
                            topo)
    if act_only:
        return activate(out, act)
    if act_grad_of is not None:
        grad = activation_grad(act_grad_of, act)
        if rewrite_act:
            grad = widened(grad.to(out.dtype))
            act_grad_of.copy_(activate(act_grad_of, act))
        out = (widened(out) * grad).to(out.dtype)
    if scale_by is not None:
        out = (widened(out) * widened(scale_by)).to(out.dtype)
    if act_out is not None:
        act_out.copy_(activate(out, act))
        if not keep_product:
            out = activation_grad(out, act).to(out.dtype)
    return out


def _dsd(s, w, topo, act="none"):
    if use_triton(s):
        return _dsd_triton(s, w, topo, act)
    return _dsd_torch(_values_to_blocks(activate(s, act), topo), w, topo)


def _dstd(s, b, topo, act="none", out=None, b_rows=None):
    if use_triton(s):
        return _dstd_triton(s, b, topo, act, out, b_rows)
    res = _dstd_torch(_values_to_blocks(activate(s, act), topo),
                      b if b_rows is None else _gathered(b, b_rows), topo)
    if out is not None:
        out.copy_(res)
        return out
    return res


# ------------------------------------------------------------------- the fused expert FFN
# y = act(x W1) W2 over the topology, as two autograd nodes so that each backward frees what
# it was given as soon as it returns (a single node keeps every saved tensor and the
# incoming gradient alive until its whole backward is done, which put three [rows, ffn]
# tensors next to both weight gradients at the step's peak):
#
#   up    x -> h = SDD(x, W1)                       backward: dx = DSD(dh, W1ᵀ), dW1 = DSᵀD(dh, x)ᵀ
#   down  h -> y = DSD(act(h), W2)                  backward: dh = SDD(dy, W2ᵀ) * act'(h),
#                                                             dW2 = DSᵀD(act(h), dy)
#
# "h" is what flows between them: its gradient is dL/dh. What the forward keeps of it is the
# activation fusion (KERNEL_CONFIG["act_fusion"]):
#   "recompute"  the forward SDD writes h and act(h); DSD reads act(h), which is then freed:
#                only h is kept. The backward SDD's epilogue computes act'(h) and act(h) from
#                h, scales dh by the first and writes the second over h, where DSᵀD reads it.
#                One [rows, ffn] tensor kept, products as plain as "store".
#   "store"      the forward SDD writes act(h) and act'(h) (which it returns as "h"); both
#                are kept, the backward multiplies by act'(h) and runs DSᵀD on act(h).
#   "load"       only h is written and kept; DSD and DSᵀD apply act as they load h (exp/rcp
#                next to the matrix units: slow on an H200) and the backward SDD's epilogue
#                multiplies by act'(h).
#   "checkpoint" as "recompute", but nothing [rows, ffn] is kept: the backward first
#                recomputes h = SDD(x, W1) (one product more, a sixth of the FFN's work).
#                The step's peak does not fall (dh and dW1, dW2 are what it holds), what a
#                model keeps across its layers for the backward does.


class _ExpertUp(torch.autograd.Function):
    """h = SDD(x, W1) (plus act(h), a side output the down node reads and drops, for
    "recompute" and "store"; "store" returns act'(h) as h).

    Without a routing plan, x holds the padded rows and gets the gradient. With one (the
    layer), x is the tokens [T, H] and `rows` their permuted copy, made by the routing
    without autograd, or None: then SDD and DSᵀD read the rows from x themselves, through
    plan.row_token (keep_rows=False: the forward reads the copy, dW1 the tokens, and the
    copy dies with the forward). The gradient goes to x: the backward sums each token's k
    rows of dx itself, and frees that [rows, H] gradient before it allocates dW1."""

    @staticmethod
    def forward(ctx, x, rows, w1, plan, topo, act, fusion, keep_rows):
        ctx.topo, ctx.plan = topo, plan
        # what DSᵀD reads for dW1: the rows, or x and the map into it (also when the copy
        # is not kept: then it dies with the forward)
        ctx.gathered = plan is not None and (rows is None or not keep_rows)
        ctx.save_for_backward(x if ctx.gathered or rows is None else rows, w1)
        # (the side output a gets no gradient: without this autograd would hand the
        # backward a [rows, ffn] tensor of zeros for it)
        ctx.set_materialize_grads(False)
        a_rows = plan.row_token if rows is None and plan is not None else None
        src = x if rows is None else rows
        if fusion == "load":
            return _sdd(src, w1, topo, a_rows=a_rows), None
        a = torch.empty(topo.values_shape(), device=x.device, dtype=x.dtype)
        h = _sdd(src, w1, topo, act=act, act_out=a, keep_product=fusion != "store",
                 a_rows=a_rows)
        ctx.mark_non_differentiable(a)
        return h, a

    @staticmethod
    def backward(ctx, grad_h, _grad_a):
        if grad_h is None:  # h did not reach what was differentiated
            return (None,) * 8
        src, w1 = ctx.saved_tensors
        topo, plan = ctx.topo, ctx.plan
        b_rows = plan.row_token if ctx.gathered else None
        grad_h = grad_h.contiguous()
        side = _backward_side_stream(grad_h)
        grad_w1 = None

        def weight_gradient():
            out = torch.empty_like(w1, memory_format=torch.contiguous_format)
            with _after_caller_on(side):
                _dstd(grad_h, src, topo, out=out.transpose(1, 2), b_rows=b_rows)
            return out

        if ctx.needs_input_grad[2] and side is not None:  # dW1 on the side stream, beside dx
            grad_w1 = weight_gradient()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _dsd(grad_h, w1.transpose(1, 2), topo)
            if plan is not None:
                grad_x = sum_pair_rows(grad_x, plan.dest_row)
        if ctx.needs_input_grad[2] and grad_w1 is None:  # (after the [rows, H] dx is gone)
            grad_w1 = weight_gradient()
        _join(side if grad_w1 is not None else None)  # joined only when forked (see below)
        return grad_x, None, grad_w1, None, None, None, None, None


class _ExpertDown(torch.autograd.Function):
    """y = DSD(act(h), W2); its backward returns dL/dh (see the block comment above)."""

    @staticmethod
    def forward(ctx, h, a, w2, topo, act, fusion, src, w1, a_rows):
        # (src, w1, a_rows: up's SDD inputs, which "checkpoint" recomputes h from)
        ctx.topo, ctx.act, ctx.fusion, ctx.a_rows = topo, act, fusion, a_rows
        if fusion == "load":
            y = _dsd(h, w2, topo, act)
            ctx.save_for_backward(h, w2)
        elif fusion == "checkpoint":
            y = _dsd(a, w2, topo)
            ctx.save_for_backward(src, w1, w2)
        else:
            y = _dsd(a, w2, topo)
            ctx.save_for_backward(h, a if fusion == "store" else None, w2)
        ctx.consumed = False
        return y

    @staticmethod
    def backward(ctx, grad_y):
        topo, act, fusion = ctx.topo, ctx.act, ctx.fusion
        if fusion == "recompute":
            if ctx.consumed:
                raise ConfigurationError(
                    "the expert FFN's backward ran twice on one graph (retain_graph=True): "
                    "with act_fusion='recompute' the first backward overwrites the kept h "
                    "with act(h); use set_kernel_config(act_fusion='store') for a graph "
                    "that is differentiated more than once")
            ctx.consumed = True
        saved = ctx.saved_tensors
        h, w2 = saved[0], saved[-1]
        if fusion == "checkpoint":  # h again, as the forward's SDD made it
            h = _sdd(saved[0], saved[1], topo, a_rows=ctx.a_rows)
        grad_y = grad_y.contiguous()
        w2_t = w2.transpose(1, 2)
        side = _backward_side_stream(grad_y)
        forked = None  # the side stream once work went to it (only then is it joined)
        grad_w2 = None
        if ctx.needs_input_grad[2]:
            grad_w2 = torch.empty_like(w2, memory_format=torch.contiguous_format)
        if fusion in ("recompute", "checkpoint"):
            # h becomes act(h) here, which DSᵀD then reads: dW2 must follow, not overlap
            grad_h = _sdd(grad_y, w2_t, topo, act_grad_of=h, act=act, rewrite_act=True)
            if grad_w2 is not None:
                _dstd(h, grad_y, topo, out=grad_w2)
        else:
            if grad_w2 is not None:
                forked = side
                with _after_caller_on(side):  # dW2 beside dh
                    if fusion == "store":
                        _dstd(saved[1], grad_y, topo, out=grad_w2)
                    else:
                        _dstd(h, grad_y, topo, act, out=grad_w2)
            if fusion == "store":
                grad_h = _sdd(grad_y, w2_t, topo, scale_by=h)
            else:
                grad_h = _sdd(grad_y, w2_t, topo, act_grad_of=h, act=act)
        # joining a side stream nothing was forked to would, inside a CUDA graph capture,
        # make the capture depend on uncaptured work (cudaErrorStreamCaptureIsolation)
        _join(forked)
        return grad_h, None, grad_w2, None, None, None, None, None, None


_SIDE_STREAMS: dict = {}


def _backward_side_stream(t: torch.Tensor):
    """The side stream of the fused FFN's backward on t's GPU, or None (one stream: the
    config says so, or t is not on a GPU)."""
    if KERNEL_CONFIG["backward_streams"] != 2 or t.device.type != "cuda":
        return None
    stream = _SIDE_STREAMS.get(t.device)
    if stream is None:
        stream = _SIDE_STREAMS[t.device] = torch.cuda.Stream(t.device)
    return stream


@contextlib.contextmanager
def _after_caller_on(side):
    """Run the block on `side` once everything the caller's stream has queued is done (or
    on the caller's stream itself when side is None)."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _join(side) -> None:
    """The caller's stream waits for the side stream (when there is one)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def fused_expert_ffn(x, w1, w2, topo, act="gelu", plan=None, rows=None, keep_rows=True):
    """act(x @ W1) @ W2 on the topology's blocks (act: gelu (tanh form), relu, silu, none).

    x: the padded, expert-sorted rows [num_rows, H]. With `plan` (the routing plan of
    x's tokens: the layer's path), x is the tokens [T, H] and the gradient goes to them;
    `rows` is their permuted copy when the routing made one, else (None) the kernels read
    the rows from x themselves (plan.row_token). keep_rows=False: the forward reads the
    copy, the backward the tokens (the copy is not kept for it)."""
    if act not in ACT_CODES:
        raise ConfigurationError(
            f"fused activation must be one of {sorted(ACT_CODES)}, got {act!r}")
    _check_same_dtype(x, w1, w2)
    if plan is None and rows is not None:
        raise InvalidArgumentError("fused_expert_ffn: rows (a permuted copy) needs its plan")
    a_rows = plan.row_token if plan is not None and rows is None else None
    if not (torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad
                                         or w2.requires_grad)):
        # no backward will follow (inference, torch.no_grad): only act(x W1) is needed
        src = x if rows is None else rows
        return _dsd(_sdd(src, w1, topo, act=act, act_only=True, a_rows=a_rows), w2, topo)
    fusion = KERNEL_CONFIG["act_fusion"]
    h, a = _ExpertUp.apply(x, rows, w1, plan, topo, act, fusion, keep_rows)
    if rows is not None and not keep_rows:  # "checkpoint" recomputes h from the tokens too
        rows, a_rows = None, plan.row_token
    return _ExpertDown.apply(h, a, w2, topo, act, fusion, x if rows is None else rows, w1,
                             a_rows)


# ---------------------------------------------------------------------------- autograd
class _SDD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, topo):
        ctx.topo = topo
        ctx.save_for_backward(a, w)
        return _sdd(a, w, topo)

    @staticmethod
    def backward(ctx, grad_s):
        a, w = ctx.saved_tensors
        topo = ctx.topo
        grad_s = grad_s.contiguous()
        grad_a = _dsd(grad_s, w.transpose(1, 2), topo) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(w, memory_format=torch.contiguous_format)
            _dstd(grad_s, a, topo, out=grad_w.transpose(1, 2))
        return grad_a, grad_w, None


class _DSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, w, topo):
        ctx.topo = topo
        ctx.save_for_backward(s, w)
        return _dsd(s, w, topo)

    @staticmethod
    def backward(ctx, grad_d):
        s, w = ctx.saved_tensors
        topo = ctx.topo
        grad_s = _sdd(grad_d, w.transpose(1, 2), topo) if ctx.needs_input_grad[0] else None
        grad_w = _dstd(s, grad_d, topo) if ctx.needs_input_grad[1] else None
        return grad_s, grad_w, None


class _DSTD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, b, topo):
        ctx.topo = topo
        ctx.save_for_backward(s, b)
        return _dstd(s, b, topo)

    @staticmethod
    def backward(ctx, grad_d):
        s, b = ctx.saved_tensors
        topo = ctx.topo
        grad_s = _sdd(b, grad_d.transpose(1, 2), topo) if ctx.needs_input_grad[0] else None
        grad_b = _dsd(s, grad_d, topo) if ctx.needs_input_grad[1] else None
        return grad_s, grad_b, None


def _check_sparse(s: torch.Tensor, topo: Topology) -> None:
    want = topo.values_shape()
    if tuple(s.shape) != want:
        raise InvalidArgumentError(f"sparse values must have shape {want} for this topology, "
                                   f"got {tuple(s.shape)}")


def sdd(a: torch.Tensor, w: torch.Tensor, topo: Topology) -> torch.Tensor:
    """S = A @ W on the topology's blocks. A [P, K], W [E, K, F] -> values [nnz, B, B]
    (compact topologies: [pairs, nb * B], see Topology)."""
    _check_same_dtype(a, w)
    if a.dim() != 2 or a.shape[0] != topo.num_rows or w.dim() != 3 \
            or w.shape[0] != topo.num_experts or w.shape[1] != a.shape[1] \
            or w.shape[2] != topo.ffn_size:
        raise InvalidArgumentError(
            f"sdd expects A [{topo.num_rows}, K] and W [{topo.num_experts}, K, "
            f"{topo.ffn_size}], got {tuple(a.shape)} and {tuple(w.shape)}")
    return _SDD.apply(a, w, topo)


def dsd(s: torch.Tensor, w: torch.Tensor, topo: Topology) -> torch.Tensor:
    """D = S @ W. values [nnz, B, B], W [E, F, N] -> [P, N]."""
    _check_same_dtype(s, w)
    _check_sparse(s, topo)
    if w.dim() != 3 or w.shape[0] != topo.num_experts or w.shape[1] != topo.ffn_size:
        raise InvalidArgumentError(f"dsd expects W [{topo.num_experts}, {topo.ffn_size}, N], "
                                   f"got {tuple(w.shape)}")
    return _DSD.apply(s, w, topo)


def dstd(s: torch.Tensor, b: torch.Tensor, topo: Topology) -> torch.Tensor:
    """DSᵀD: D = Sᵀ @ B. values [nnz, B, B], B [P, N] -> [E, F, N]."""
    _check_same_dtype(s, b)
    _check_sparse(s, topo)
    if b.dim() != 2 or b.shape[0] != topo.num_rows:
        raise InvalidArgumentError(f"dstd expects B [{topo.num_rows}, N], got {tuple(b.shape)}")
    return _DSTD.apply(s, b, topo)


def ddst(w: torch.Tensor, s: torch.Tensor, topo: Topology) -> torch.Tensor:
    """DDSᵀ: D = W @ Sᵀ with W [E, M, F] read as [M, E*F] -> [M, P].

    (W Sᵀ)ᵀ = S Wᵀ, so this is DSD on transposed views: the kernels take strides, no copy.
    """
    return dsd(s, w.transpose(1, 2), topo).t()


def to_dense(s: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Dense [P, E * F_padded] view of sparse values (for tests and debugging)."""
    s = _values_to_blocks(s, topo)
    rows, cols = topo.dense_shape()
    out = s.new_zeros(topo.num_row_blocks, topo.num_column_blocks, topo.block_size,
                      topo.block_size)
    valid = topo.block_valid()
    out[topo.row_indices.long()[valid], topo.column_indices.long()[valid]] = s[valid]
    return out.permute(0, 2, 1, 3).reshape(rows, cols)
