"""The grouped products of expert parallelism: the local grouped GEMM (grouped_local),
its tiles, and its backward (grouped_backward, grouped_weight_grad).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ... import errors, native_launch
from ..._triton import pow2_at_least, tensor_descriptor
from .gemm_plans import (_num_programs, _overridden, gemm_operands, launch_options,
                         tma_operands_fit)
from .team import team_for
from .triton_launcher import _LAUNCHERS, _PLATFORM


def grouped_config(device: torch.device, dtype: torch.dtype, n: int) -> dict:
    """grouped_local's tiles for a product N wide: the platform's
    (triton_gemm_a2a.grouped_config), BLOCK_N the widest that divides N (even_block_n);
    ROCMOE_GROUPED_CONFIG='{"BLOCK_N": 128, "FLATTEN": false}' overrides entries (tuning)."""
    from .. import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, FLATTEN=False)
    else:
        fp32 = dtype == torch.float32
        widest = tk.grouped_config(_PLATFORM, fp32)["BLOCK_N"]
        cfg = tk.grouped_config(_PLATFORM, fp32, even_block_n(n, widest))
    return _overridden(cfg, "ROCMOE_GROUPED_CONFIG")


def even_block_n(n: int, block_n: int, least: int = 64) -> int:
    """The widest tile of `block_n`, `block_n` / 2, ... (down to `least`) that divides N, or
    `block_n` when none does. The untuned grouped products run the default 128 x 256 tile:
    at N = 1408 (5.5 tiles, the masked path on every tile) it ran 37 TFLOP/s on an H200
    against 393 with 128-wide tiles (the FFN's first product at hidden 4096, ffn 1408;
    benchmarks/probe_ep_ffn.py --products, results/probe_ep_ffn_h200_seventeenth_session_
    products.jsonl)."""
    b, least = block_n, min(least, block_n)
    while b >= least:
        if n % b == 0:
            return b
        b //= 2
    return block_n


def grouped_local(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, status_address: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y = grouped products of X's rows with device counts [sources, groups] (rows source-
    major, then group): segment (s, g) through w[g] ([G, K, N], any strides), stored at the
    rows' own positions; the rows of `out` (made here when None) past the segments are set
    to zero. No protocol, no host read. Counts that cannot be meant (negative, more rows
    than X or `out` has) compute nothing (`out` all zeros) and record STATUS_BAD_INPUT in
    status word 3 * sources at `status_address`. The task table is sized by X's rows.

    Two launches: grouped_plan_kernel writes the tiles' table and zeroes the rows past the
    segments, then grouped_tiles_kernel's persistent programs (one an SM) compute the
    tiles. What a shape fixes (tiles, grids, constexprs, the native launches) is a
    _GroupedLaunch, made on the first call of the shape and kept (_GROUPED_LAUNCHES)."""
    if out is None:
        out = torch.empty(x.shape[0], w.shape[-1], dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not counts.is_contiguous():
        counts = counts.contiguous()
    # everything a launch fixes or the checks below read is in the key: a call of a known
    # shape was checked when its launch was made
    key = (x.device, x.dtype, x.shape, x.stride(0), w.device, w.dtype, w.shape, w.stride(),
           counts.device, counts.dtype, counts.shape, out.device, out.dtype, out.shape,
           out.stride(), os.environ.get("ROCMOE_GROUPED_CONFIG"))
    launch = _GROUPED_LAUNCHES.get(key)
    if launch is None:
        _check_grouped("grouped_local", x, w.shape[0], counts, w=w, out=out)
        launch = _keep_launch(key, _GroupedLaunch(x, w, counts, out))
    launch(x, w, counts, status_address, out)
    return out


def _check_grouped(what: str, x: torch.Tensor, groups: int, counts: torch.Tensor,
                   w: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   gy: Optional[torch.Tensor] = None) -> None:
    """InvalidArgumentError (DTypeError, DeviceMismatchError) for operands the grouped
    kernels would misread: X [M, K]; counts [sources, groups] int64; W [groups, K, N] and out
    [rows, N] (grouped_local), or dY [M', N] (grouped_weight_grad); one dtype, one GPU.
    Shapes only: the counts' values are checked on the device (the kernels' bad-count
    path), never read here."""
    def bad(message):
        raise errors.InvalidArgumentError(f"{what}: {message}")
    if x.dim() != 2:
        bad(f"X must be [rows, K], got shape {tuple(x.shape)}")
    if counts.dim() != 2 or counts.shape[1] != groups or counts.shape[0] < 1:
        bad(f"counts must be [sources, {groups}] (one column a group), got shape "
            f"{tuple(counts.shape)}")
    if counts.dtype != torch.int64:
        raise errors.DTypeError(f"{what}: counts must be int64, got {counts.dtype}")
    others = {"counts": counts}
    if w is not None:
        if w.dim() != 3 or w.shape[1] != x.shape[1]:
            bad(f"W must be [groups, K = {x.shape[1]}, N], got shape {tuple(w.shape)}")
        if out.dim() != 2 or out.shape[1] != w.shape[2] or out.stride(1) != 1 \
                or out.stride(0) != out.shape[1]:
            bad(f"out must be a contiguous [rows, N = {w.shape[2]}], got shape "
                f"{tuple(out.shape)} with strides {tuple(out.stride())}")
        others.update(W=w, out=out)
    if gy is not None:
        if gy.dim() != 2:
            bad(f"dY must be [rows, N], got shape {tuple(gy.shape)}")
        others["dY"] = gy
    for name, t in others.items():
        if name != "counts" and t.dtype != x.dtype:
            raise errors.DTypeError(f"{what}: {name} is {t.dtype}, X is {x.dtype}")
        if t.device != x.device:
            raise errors.DeviceMismatchError(f"{what}: {name} is on {t.device}, X on {x.device}")


class _GroupedLaunch:
    """grouped_local's two launches for one shape (X's rows and row stride, W's shape and
    strides, the sources, out's rows, dtype, GPU): everything but the tensors' addresses
    and the status word is computed once here.

    A call launches each kernel through its NativeLaunch (native_launch: one cuLaunchKernel,
    X's and W's TMA maps re-encoded only when their address moves) once the JIT has
    compiled it on the first call; a call whose pointers would get another specialisation
    (16-byte alignment, dtype), and every call on AMD and under the interpreter, goes
    through the JIT launcher. On an H200's host the JIT path took 116-205 us a call
    (results/probe_grouped_persistent_h200_nineteenth_session.jsonl), this one 27-48
    (torch._grouped_mm 24-34; ..._twentieth_session.jsonl), and the products went from
    slower than torch._grouped_mm to faster on 8 of 8 when each call starts from an idle
    GPU."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                 out: torch.Tensor):
        dev, g, sources = x.device, int(w.shape[0]), int(counts.shape[0])
        k_in, n_out = int(x.shape[1]), int(w.shape[-1])
        self.device = dev
        self.cfg = cfg = grouped_config(dev, x.dtype, n_out)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        rows_bound = min(int(x.shape[0]), int(out.shape[0]))
        segments = sources * g
        n_tiles = math.ceil(n_out / bn)
        max_tasks = max(1, (math.ceil(rows_bound / bm) + segments) * n_tiles)
        self.table_words = 4 * max_tasks + 1
        self.status_offset = 4 * 3 * sources
        segs_p2 = max(2, 1 << (segments - 1).bit_length())
        block_t = max(2, min(128, 8192 // segs_p2))  # [BLOCK_T, SEGS_P2] masks stay small
        zero_rows = 16 if dev.type == "cpu" else 64
        self.plan_const = dict(SEGS_P2=segs_p2, BLOCK_T=block_t, BLOCK_M=bm,
                               GROUP_M=cfg["GROUP_M"], ZERO_ROWS=zero_rows,
                               ZERO_COLS=min(256, max(16, pow2_at_least(n_out))))
        self.plan_fixed = (rows_bound, int(out.shape[0]), n_out, max_tasks, segments, g,
                           n_tiles)
        self.plan_grid = (max(math.ceil(max_tasks / block_t),
                              math.ceil(out.shape[0] / zero_rows), 1),)
        self.plan_key = ("plan", tuple(self.plan_const.items()))
        # the backward's W^T: a view of a contiguous [G, N, K]
        self.trans_w = w.transpose(1, 2).is_contiguous() and not w.is_contiguous()
        self.nprog = _num_programs(dev, max_tasks, cfg.get("PROGRAMS_PER_SM", 1))
        self.constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=n_out % bn == 0,
                               EVEN_K=k_in % bk == 0, FP32_IEEE=x.dtype == torch.float32)
        self.options = launch_options(cfg) if dev.type != "cpu" else {}
        self.tiles_fixed = (max_tasks, n_out, k_in, self.nprog, x.stride(0), *w.stride())
        # NativeLaunch of each kernel: None until the JIT compiled it, False when refused
        self.plan_native = None
        self.tiles_native = None

    def __call__(self, x, w, counts, status_address: int, out) -> None:
        table = torch.empty(self.table_words, dtype=torch.int32, device=self.device)
        plan_args = (counts, table, out, status_address + self.status_offset,
                     *self.plan_fixed)
        _kept_launch(self, "plan_native", "grouped_plan_kernel", self.plan_grid, plan_args,
                     (0, 1, 2, 3), self.plan_const, {}, self.plan_key)
        # a descriptor's place takes the tensor it describes (native_launch._desc_view):
        # X [M, K]; W [G, K, N] as [G * K, N], or for W^T its storage [G, N, K] as [G * N, K]
        w_storage = w.transpose(1, 2) if self.trans_w else w
        raw = (x, w_storage, out, table, *self.tiles_fixed)
        native = self.tiles_native
        if native and native.launch((self.nprog,), raw):
            return
        x_arg, w_arg, use_tma = grouped_operands(x, w, self.cfg, self.trans_w)
        constexprs = dict(self.constexprs, USE_TMA=use_tma, TRANS_W=self.trans_w and use_tma,
                          FLATTEN=bool(self.cfg.get("FLATTEN")) and use_tma)
        if not use_tma:
            raw = (x, w) + raw[2:]
        key = ("grouped", tuple(sorted(constexprs.items())), tuple(sorted(self.options.items())))
        compiled = _LAUNCHERS["grouped_tiles_kernel"]((self.nprog,), (x_arg, w_arg) + raw[2:],
                                                      constexprs, self.options, key)
        if native is None and compiled is not None:
            self.tiles_native = native_launch.try_native(compiled, raw, (0, 1, 2, 3),
                                                         self.device) or False


# grouped_local's and grouped_weight_grad's launches by shape; a layer's products are a
# handful of shapes, so the oldest goes only past this many (a run whose rows change from
# step to step)
_GROUPED_LAUNCHES: dict = {}


_MAX_GROUPED_LAUNCHES = 64


def _keep_launch(key, launch):
    """Keep `launch` for calls of `key`'s shape (the oldest kept one goes past
    _MAX_GROUPED_LAUNCHES); returns it."""
    if len(_GROUPED_LAUNCHES) >= _MAX_GROUPED_LAUNCHES:
        _GROUPED_LAUNCHES.pop(next(iter(_GROUPED_LAUNCHES)))
    _GROUPED_LAUNCHES[key] = launch
    return launch


def grouped_operands(x: torch.Tensor, w: torch.Tensor, cfg: dict, trans_w: bool) -> tuple:
    """(X argument, W argument, USE_TMA) of grouped_tiles_kernel: for W [G, K, N] as stored,
    gemm_operands' (one [G * K, N] descriptor, K a multiple of BLOCK_K); for the backward's
    W^T (trans_w: a view of a contiguous [G, N, K]), a descriptor of W's own storage
    [G * N, K] with [BLOCK_N, BLOCK_K] boxes, which the kernel turns. The tensors
    themselves where TMA cannot load them (tma_operands_fit)."""
    if not trans_w:
        return gemm_operands(x, w, cfg)
    storage = w.transpose(1, 2).reshape(-1, w.shape[1])  # [G * N, K], a view
    if not tma_operands_fit(x, storage, cfg):
        return x, w, False
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = tensor_descriptor(x, x.shape[0], x.shape[1], x.stride(0), [bm, bk])
    w_desc = tensor_descriptor(storage, storage.shape[0], storage.shape[1], storage.stride(0),
                               [bn, bk])
    if x_desc is None or w_desc is None:
        return x, w, False
    return x_desc, w_desc, True


def grouped_weight_grad(x: torch.Tensor, gy: torch.Tensor, counts: torch.Tensor, groups: int,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """dW [G, K, N] of grouped_local: dW[g] = sum over sources s of X[(s, g)]^T dY[(s, g)],
    fp32 accumulation, from device counts [sources, groups]. Counts that cannot be meant
    (negative, more rows than X or dY has) give dW = 0 and read nothing. What a shape fixes
    is kept (_WeightGradLaunch, _GROUPED_LAUNCHES); after its first call the kernel launches
    through the driver (native_launch)."""
    x, gy = x.contiguous(), gy.contiguous()
    if not counts.is_contiguous():
        counts = counts.contiguous()
    key = ("dw", x.device, x.dtype, x.shape, gy.device, gy.dtype, gy.shape, counts.device,
           counts.dtype, counts.shape, groups, out_dtype, os.environ.get("ROCMOE_DW_CONFIG"))
    launch = _GROUPED_LAUNCHES.get(key)
    if launch is None:
        _check_grouped("grouped_weight_grad", x, groups, counts, gy=gy)
        launch = _keep_launch(key, _WeightGradLaunch(x, gy, counts, groups))
    dw = torch.empty(groups, x.shape[1], gy.shape[1], dtype=out_dtype, device=x.device)
    launch(x, gy, counts, dw)
    return dw


class _WeightGradLaunch:
    """grouped_weight_grad's launch for one shape: grid, constexprs and the integer
    arguments computed once; the kernel through its NativeLaunch after the JIT's first
    launch (_kept_launch)."""

    def __init__(self, x: torch.Tensor, gy: torch.Tensor, counts: torch.Tensor, groups: int):
        dev, world, g = x.device, int(counts.shape[0]), groups
        k_out, n_in = int(x.shape[1]), int(gy.shape[1])
        cfg = weight_grad_config(dev, x.dtype)
        bk, bn, tiles_first = cfg["BLOCK_K"], cfg["BLOCK_N"], bool(cfg.get("TILES_FIRST"))
        tiles = (math.ceil(k_out / bk), math.ceil(n_in / bn))
        self.grid = (tiles[0] * tiles[1], g) if tiles_first else (g, *tiles)
        self.const = dict(WORLD_P2=max(2, 1 << (world - 1).bit_length()),
                          GROUPS_P2=max(1, 1 << (g - 1).bit_length()), BLOCK_K=bk, BLOCK_N=bn,
                          BLOCK_M=cfg["BLOCK_M"], TILES_FIRST=tiles_first)
        self.options = launch_options(cfg)
        self.key = ("dw", tuple(sorted(self.const.items())), tuple(sorted(self.options.items())))
        self.fixed = (world, g, k_out, n_in, k_out, n_in, min(int(x.shape[0]), int(gy.shape[0])))
        self.device = dev
        self.native = None  # NativeLaunch once the JIT compiled the kernel; False: refused

    def __call__(self, x, gy, counts, dw) -> None:
        _kept_launch(self, "native", "grouped_weight_grad_kernel", self.grid,
                     (x, gy, dw, counts, *self.fixed), (0, 1, 2, 3), self.const, self.options,
                     self.key)


def _kept_launch(owner, attr: str, name: str, grid: tuple, args: tuple, dynamic: tuple,
                 constexprs: dict, options: dict, key) -> None:
    """Launch kernel `name` through `getattr(owner, attr)`, the NativeLaunch made from the
    JIT's first compile of it (the `dynamic` argument positions may change from call to
    call; the others are fixed for the owner): through the JIT launcher when there is none
    yet, none can be made (AMD, the interpreter: it stays False) or a call's arguments
    would get another specialisation."""
    native = getattr(owner, attr)
    if native and native.launch(grid, args):
        return
    compiled = _LAUNCHERS[name](grid, args, constexprs, options, key)
    if native is None and compiled is not None:
        setattr(owner, attr, native_launch.try_native(compiled, args, dynamic, owner.device)
                or False)


def weight_grad_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles of grouped_weight_grad (triton_gemm_a2a.weight_grad_config: the platform's,
    measured); ROCMOE_DW_CONFIG='{"BLOCK_K": 128, ...}' overrides entries (tuning)."""
    from .. import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_K=16, BLOCK_N=16, BLOCK_M=16, TILES_FIRST=True)
    else:
        cfg = tk.weight_grad_config(_PLATFORM, dtype == torch.float32)
    return _overridden(cfg, "ROCMOE_DW_CONFIG")


def grouped_backward(handle, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor,
                     counts: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dX and dW of a grouped GemmAllToAll call with device counts [world, groups]: dX by the
    GEMM kernel in local mode with W^T, dW by the grouped weight-gradient kernel. No host
    read of the counts."""
    team = team_for(handle.ctx)
    counts = counts.reshape(team.world, groups)
    dx = grouped_local(gy, w.transpose(1, 2), counts, handle.status_address,
                       out=torch.empty_like(x))
    dw = grouped_weight_grad(x, gy[:x.shape[0]], counts, groups, w.dtype)
    return dx, dw
