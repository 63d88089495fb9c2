"""GPU launchers of the fused-op handles (rocmoe/ops/handles.py): Triton for the GEMM and the
row exchange, librocmoe's HIP kernels for the embedding and the GEMV.

A call enqueues its kernels on the current stream and returns: nothing is read back, nothing
synchronises, no host collective runs, so calls overlap with the work around them and can be
captured in a CUDA/HIP graph. What can go wrong on the device (a wait that runs out, a count
or an index out of range, a peer's abort) is written into the handle's status words
(host-mapped memory) and raised by the handle at its next call, at `synchronize()` or at
`ctx.barrier()`.

The peers are reached through the rocmoe context's symmetric heap: `peer_bases` is every
rank's heap base as seen by this process (ipc backend: IPC-mapped device memory; the host
backend's shared memory too, which lets the Triton kernels run under TRITON_INTERPRET=1 on
CPU processes in the tests).
"""

from __future__ import annotations

import math
import os
import weakref
from operator import is_
from typing import Optional, Sequence

import torch

from .. import errors
from .._triton import interpreting as _interpreting
from .._triton import pow2_at_least, sm_count, tensor_descriptor, tma_capable
from .. import native_launch
from ..env import first_call_timeout_from_env
from ._common import MODES, PLAIN_TENSORS
from .outputs import OutputRing, capturing

ALIGN = 256

# ---------------------------------------------------------------------------------------
# Schedule (mirror of hip/include/rocmoe/schedule.h; tests compare the two)
# ---------------------------------------------------------------------------------------


def _node_size(rank: int, world: int, per_node: int) -> tuple[int, int]:
    per = per_node if per_node > 0 else world
    begin = (rank // per) * per
    return begin, min(begin + per, world) - begin


def slice_at(rank: int, world: int, per_node: int, pos: int) -> int:
    """Destination at order position `pos`: other nodes, then node peers, then self."""
    begin, local = _node_size(rank, world, per_node)
    remote = world - local
    if pos < remote:
        return (begin + local + pos) % world
    if pos < world - 1:
        return begin + (rank - begin + 1 + pos - remote) % local
    return rank


def slice_order(rank: int, world: int, per_node: int = 0) -> list[int]:
    return [slice_at(rank, world, per_node, p) for p in range(world)]


def task_prefix(order: Sequence[int], tasks_per_dest: Sequence[int]) -> list[int]:
    prefix = [0]
    for dest in order:
        prefix.append(prefix[-1] + max(1, int(tasks_per_dest[dest])))
    return prefix


# ---------------------------------------------------------------------------------------
# What a context's kernels share: the peer table, the remote-first order
# ---------------------------------------------------------------------------------------


class Team:
    """Every rank's heap base as this process sees it (a device int64 tensor) and this
    rank's remote-first slice order; made once per context."""

    def __init__(self, ctx):
        from .._native import check, ffi, lib
        self.rank, self.world = ctx.rank, ctx.world_size
        self.ranks_per_node = getattr(ctx, "local_size", 0) or self.world
        self.device = ctx.device
        bases = []
        for r in range(self.world):
            out = ffi.new("void **")
            check(lib.rocmoe_peer_ptr(ctx._handle, r, 0, out), f"peer base of rank {r}")
            bases.append(int(ffi.cast("uintptr_t", out[0])))
        self.peer_bases_host = bases
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.order = torch.tensor(slice_order(self.rank, self.world, self.ranks_per_node),
                                  dtype=torch.int32, device=self.device)
        self.world_p2 = max(2, 1 << (self.world - 1).bit_length())


_TEAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def team_for(ctx) -> Team:
    team = _TEAMS.get(ctx)
    if team is None:
        team = _TEAMS[ctx] = Team(ctx)
    return team


def _wait_budget(timeout_s: float) -> int:
    # The kernels' wait bound: microseconds of the device's real-time clock (their CLOCK,
    # _clock below); the interpreter has no clock and counts polls, milliseconds each there.
    # A multiple of 16, so that every budget specialises the compiled kernel alike (Triton
    # keys integer arguments on their divisibility by 16).
    per_s = 300 if _interpreting() else 1e6
    return min(2**31 - 16, 16 * max(1, math.ceil(timeout_s * per_s / 16)))


def _first_call_budget(timeout_s: float) -> int:
    """The wait budget of a GEMM plan's first launch. The peers make the same call at the
    same time, but each first compiles and tunes its kernels (tens of seconds at fp32: 65 s
    for the first step of four handles on an H200), and ranks drift apart there: two ranks
    sharing a GPU once timed out at 30 s waiting for a peer still in the JIT
    (results/fused_gpu_h200_tenth_session_run3_nosync2rank_fail.log). So the first launch
    waits ROCMOE_FIRST_CALL_TIMEOUT_S (at least ROCMOE_TIMEOUT_S); the interpreter, which
    compiles nothing, waits the plain budget."""
    return _wait_budget(first_call_timeout_s(timeout_s))


def first_call_timeout_s(timeout_s: float) -> float:
    """Seconds the first launch of a handle's kernel (or of a GEMM plan) may wait for its
    peers: ROCMOE_FIRST_CALL_TIMEOUT_S, at least `timeout_s` (see _first_call_budget). The
    HIP kernels of EmbeddingAllToAll and GemvAllReduce compile nothing themselves, but a
    peer may still be in the JIT of another handle or of torch when it reaches them."""
    if _interpreting():
        return timeout_s
    return max(timeout_s, first_call_timeout_from_env())


def _clock() -> int:
    """CLOCK of the Triton kernels with waits (see triton_gemm_a2a.device_clock)."""
    from . import triton_gemm_a2a as tk
    return tk.device_clock(_PLATFORM, _interpreting())


class _DeviceInts:
    """Device int64 tensors of host lists, cached (most recent last): a fresh copy from
    pageable memory would synchronise; a new list goes through pinned memory without one."""

    def __init__(self, device: torch.device, keep: int = 32):
        self.device, self.keep, self._cache = device, keep, {}

    def __call__(self, values) -> torch.Tensor:
        key = tuple(int(v) for v in values)
        t = self._cache.pop(key, None)
        if t is None:
            host = torch.tensor(key or (0,), dtype=torch.int64)
            if self.device.type == "cuda":
                host = host.pin_memory()
            t = host.to(self.device, non_blocking=True)
        self._cache[key] = t
        while len(self._cache) > self.keep:
            self._cache.pop(next(iter(self._cache)))
        return t


def _device_ints(handle) -> _DeviceInts:
    ints = getattr(handle, "_device_ints", None)
    if ints is None:
        ints = handle._device_ints = _DeviceInts(handle.ctx.device)
    return ints


# ---------------------------------------------------------------------------------------
# Triton launches without the binder's per-call work
# ---------------------------------------------------------------------------------------

_PLATFORM = "hip" if getattr(torch.version, "hip", None) else "cuda"


class _Launcher:
    """Launches one Triton kernel of triton_gemm_a2a. The first launch of a configuration
    goes through the JIT (compiles and specialises); later ones call the compiled kernel
    directly, which skips the JIT's cache lookup, option parsing and launch hooks (most of
    the host time of a Triton launch).

    A compiled kernel is only valid for arguments the JIT would have specialised the same
    way: the same pointer dtypes and 16-byte alignments, integers equal to 1 (constants),
    divisible by 16 and of the same width, and on AMD the buffer-range flags of tensors.
    So every launch is keyed by Triton's own specialisation of its arguments (its native
    specialize function, with the kernel's backend), next to the constexprs in `key`. A
    caller may name the `dynamic` argument positions, those that can change from call to
    call; it then vouches that `key` holds the specialisation of every other argument
    (`specialize` computes it, once per plan)."""

    def __init__(self, name: str):
        self.name = name
        self._compiled: dict = {}
        self.fast = os.environ.get("ROCMOE_TRITON_FAST_LAUNCH", "1") != "0"
        self._spec = None  # (specialize function, per-parameter flags), made on first use

    def _specializer(self):
        if self._spec is None:
            from . import triton_gemm_a2a as tk
            self._spec = _make_specializer(tk.get(self.name))
        return self._spec

    def specialize(self, args: tuple, positions) -> tuple:
        """Triton's specialisation of args[i] for i in positions (a key part); nothing under
        the interpreter, which compiles nothing."""
        if _interpreting():
            return ()
        spec, flags = self._specializer()
        return tuple(spec(args[i], *flags[i]) for i in positions)

    def __call__(self, grid, args: tuple, constexprs: dict, options: dict, key,
                 dynamic=None):
        """Launch; returns the compiled kernel that ran (None under the interpreter)."""
        from . import triton_gemm_a2a as tk
        fn = tk.get(self.name)
        if _interpreting():
            fn[grid](*args, **constexprs, **options)
            return
        full_key = (key, self.specialize(args, range(len(args)) if dynamic is None else dynamic))
        compiled = self._compiled.get(full_key)
        if compiled is None:
            compiled = fn[grid](*args, **constexprs, **options)
            names = fn.arg_names
            self._compiled[full_key] = (compiled, [constexprs.get(n) for n in names[len(args):]])
            return compiled
        kernel, tail = compiled
        if self.fast:
            # The compiled kernel's launcher reads three grid dimensions (the JIT pads them).
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            try:
                kernel[grid3](*args, *tail)
                return kernel
            except TypeError:  # this Triton's compiled-kernel launch takes other arguments
                self.fast = False
        return fn[grid](*args, **constexprs, **options)


def _make_specializer(fn):
    """(specialize(arg, is_const, specialize, align) -> its JIT specialisation, the flags of
    each non-constexpr parameter), with the backend of the current GPU. Triton's native
    function where it has one; otherwise the properties it specialises on, from Python."""
    flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
             for p in fn.params if not p.is_constexpr]
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver
        backend = make_backend(driver.active.get_current_target())

        def spec(arg, is_const, specialize, align):
            return native_specialize_impl(backend, arg, is_const, specialize, align)
        spec(16, False, True, True)  # this Triton's native function takes these arguments
    except (ImportError, AttributeError, RuntimeError, TypeError):  # another Triton
        def spec(arg, is_const, specialize, align):
            if isinstance(arg, torch.Tensor):
                return (arg.dtype, align and arg.data_ptr() % 16 == 0)
            if isinstance(arg, bool) or not isinstance(arg, int):
                return (type(arg), getattr(arg, "dtype", None),
                        tuple(getattr(arg, "block_shape", ()) or ()))
            width = 32 if -2**31 <= arg < 2**31 else 64 if -2**63 <= arg < 2**63 else 65
            return (width, specialize and arg == 1, specialize and arg % 16 == 0)
    return spec, flags


_LAUNCHERS = {name: _Launcher(name) for name in
              ("gemm_a2a_kernel", "collect_kernel", "abort_kernel", "grouped_weight_grad_kernel",
               "grouped_plan_kernel", "grouped_tiles_kernel")}


# ---------------------------------------------------------------------------------------
# GEMM + all-to-all and the row exchange
# ---------------------------------------------------------------------------------------


_CPU_PROGRAMS = 4  # the most programs a GEMM runs on the interpreter (_num_programs)


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
    from . import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    else:
        cfg = tk.default_config(_PLATFORM, dtype == torch.float32)
    # ROCMOE_GEMM_CONFIG='{"BLOCK_N": 128, "USE_TMA": true}' overrides entries (tuning)
    return _overridden(cfg, "ROCMOE_GEMM_CONFIG")


def grouped_config(device: torch.device, dtype: torch.dtype, n: int) -> dict:
    """grouped_local's tiles for a product N wide: the platform's
    (triton_gemm_a2a.grouped_config), BLOCK_N the widest that divides N (even_block_n);
    ROCMOE_GROUPED_CONFIG='{"BLOCK_N": 128, "FLATTEN": false}' overrides entries (tuning)."""
    from . import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, FLATTEN=False)
    else:
        fp32 = dtype == torch.float32
        widest = tk.grouped_config(_PLATFORM, fp32)["BLOCK_N"]
        cfg = tk.grouped_config(_PLATFORM, fp32, even_block_n(n, widest))
    return _overridden(cfg, "ROCMOE_GROUPED_CONFIG")


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
    # 64 x 128 with a deeper ring (8 stages, 192 KiB: one program an SM): one wave of 128
    # tiles at 256 x 4096^2 with more loads in flight than the 4-stage 64 x 128 above
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=8),
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
    return _TUNE_CANDIDATES + (_TUNE_SKINNY if skinny else ())


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
        split_k, self.split_scratch = self._split_scratch(
            cfg, tiles if scratch_status is None else
            (math.ceil(max(1, x.shape[0]) / bm) + g) * self.n_tiles, dev)
        tasks = tiles * split_k  # a split tile is split_k tasks
        # world size 1, one W, K unsplit: the kernel's DIRECT path (no plan; X's own tiles)
        self.direct = self.local and g == 1 and split_k == 1
        if self.direct:
            tasks = direct_tasks(handle.max_rows, most_rows, bm, self.n_tiles,
                                 sm_count(dev) if dev.type != "cpu" else _CPU_PROGRAMS)
        if self.local and dev.type != "cpu":
            sms = sm_count(dev)
            per_sm = cfg.get("PROGRAMS_PER_SM")
            self.nprog = (min(tasks, int(sms * per_sm)) if per_sm
                          else (tasks if tasks <= 8 * sms else min(tasks, 4 * sms)))
        else:
            self.nprog = _num_programs(dev, tasks, cfg.get("PROGRAMS_PER_SM"))
        self.options = launch_options(cfg) if dev.type != "cpu" else {}
        self.use_tma_wanted = bool(cfg.get("USE_TMA")) and not self.copy
        self.fixed_spec = None
        # use_tma -> NativeLaunch (None: refused, see native_launch.last_refusal); made from
        # the kernel the JIT ran on the first call of each
        self.native: dict = {}
        self.collect_native = None  # NativeLaunch, False when refused
        self.constexprs = dict(
            WORLD_P2=team.world_p2, GROUPS_P2=max(1, 1 << (g - 1).bit_length()), BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
            MODE=0 if self.local else 1, COPY=self.copy, FP32_IEEE=x.dtype == torch.float32,
            EVEN_N=n % bn == 0, EVEN_K=(k % cfg["BLOCK_K"] == 0) or self.copy, USE_TMA=False,
            SPLIT_K=split_k, DIRECT=self.direct, CLOCK=_clock())
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
        if not self.local:
            rows = 64 if dev.type != "cpu" else 16
            self.collect_blocks = math.ceil(layout.capacity / rows)
            cn = min(256, max(16, 1 << (n - 1).bit_length())) if dev.type != "cpu" else 16
            self.collect_args = (handle.status_address, handle.workspace_offset, layout.acks,
                                 layout.counts, layout.local, layout.counters, layout.recv,
                                 layout.parity_bytes, layout.source_bytes, team.rank, world, n,
                                 layout.capacity, world * self.collect_blocks)
            self.collect_const = dict(WORLD_P2=team.world_p2, ROWS=rows, BLOCK_N=cn)
            self.collect_opts = {"num_warps": 4} if dev.type != "cpu" else {}
            self.collect_key = (rows, cn, self.collect_blocks)
            self.collect_spec = None

    def _split_scratch(self, cfg: dict, tiles: int, dev) -> tuple:
        """SPLIT_K of the kernel and its scratch (a semaphore and SPLIT_K fp32 partials for
        each of the `tiles` a call can have), or (1, None) when the config asks for no split
        or the scratch would pass _SPLIT_SCRATCH_MAX (a large handle: its calls have tiles
        enough without splitting K)."""
        split_k = int(cfg.get("SPLIT_K", 1))
        self.split_tiles = int(tiles)
        if split_k <= 1 or self.copy:
            return 1, None
        nbytes = (math.ceil(tiles * 4 / 256) * 256
                  + tiles * split_k * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4)
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
                self._launched(team, out, recv, x.device)
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
        self._launched(team, out, recv, x.device)

    def _launched(self, team, out, recv, device) -> None:
        """After the kernel of a call is enqueued: the first launch's budget goes, and at
        world size > 1 the receiving side follows."""
        if not self.launched:
            self._first_launch_done()
        if not self.local:
            self._collect(team, out, recv, device)

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
        c_args = (out, team.peer_bases, recv, *self.collect_args)
        cn = self.collect_native
        if not cn or not cn.launch((team.world, self.collect_blocks), c_args):
            collect = _LAUNCHERS["collect_kernel"]
            if self.collect_spec is None:
                self.collect_spec = collect.specialize(c_args, range(3, len(c_args)))
            compiled = collect((team.world, self.collect_blocks), c_args, self.collect_const,
                               self.collect_opts, (self.collect_key, self.collect_spec),
                               dynamic=(0, 1, 2))
            if self.collect_native is None and compiled is not None:
                self.collect_native = native_launch.try_native(compiled, c_args, (0, 1, 2),
                                                               device) or False


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
    map shape depend on), only the pointers can differ: out, counts and recv are written,
    X's and W's maps re-made only when their address moved. Anything else (another M, a
    strided W, a pointer of another alignment, a launch through the plan in between, which
    `NativeLaunch.generation` shows) goes through the plan, which rewrites every argument;
    `record` then takes that launch as the new base."""

    def __init__(self, plan: "_GemmLaunch", team: Team, native):
        self.plan, self.team, self.nl = plan, team, native
        self.x_step, self.w_step = native.step(0), native.step(1)
        self.out_cell, self.out_aligned = native.pointer_cell(2)
        self.counts_cell, self.counts_aligned = native.pointer_cell(3)
        self.recv_cell, self.recv_aligned = native.pointer_cell(6)
        self.gen, self.m, self.xp, self.wp = -1, -1, 0, 0

    def record(self, x: torch.Tensor, w: torch.Tensor, gen_before: int) -> None:
        """After a launch through the plan: the base of the next lean launches, when that
        launch wrote every argument of this kernel (and M > 1, W contiguous)."""
        nl = self.nl
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
        if ((p & 15) == 0) is not self.out_aligned:
            return False
        self.out_cell[0] = p
        p = counts.data_ptr()
        if ((p & 15) == 0) is not self.counts_aligned:
            return False
        self.counts_cell[0] = p
        p = recv.data_ptr()
        if ((p & 15) == 0) is not self.recv_aligned:
            return False
        self.recv_cell[0] = p
        plan = self.plan
        nl.launch_as_written(plan.nprog, stream)
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
    out_shape = (handle.capacity_rows, handle.N)
    ints = _device_ints(handle)
    descriptors = handle.__dict__.setdefault("_w_descriptors", {})
    is_grad_enabled, empty, int64, tensor_type = (torch.is_grad_enabled, torch.empty,
                                                  torch.int64, torch.Tensor)
    plain = PLAIN_TENSORS  # (W is a Parameter in a model: taken, outside autograd)
    # the rows and the received counts, reused once the caller dropped them (an allocation
    # costs as much host time as the launch: rocmoe/ops/outputs.py)
    ring = handle._outputs["gemm"] = OutputRing(lambda: (
        empty(out_shape, dtype=dtype, device=device), empty(world, dtype=int64, device=device)))
    take, stream = ring.take, native_launch.stream_getter(device)
    plan_of = plans.get

    def call(x, w, send_counts):
        if (type(x) not in plain or type(w) not in plain or x.dtype is not dtype
                or w.dtype is not dtype or handle.broken is not None
                or status.tobytes() != clear
                or ctx.finalized
                or x.get_device() != index or w.get_device() != index or x.dim() != 2
                or x.shape[1] != k or w.shape != want_w or x.stride(1) != 1
                or (is_grad_enabled() and (world > 1 or x.requires_grad or w.requires_grad))):
            return None
        rows = x.shape[0]
        if rows > 1 and x.stride(0) != k:
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
            counts = ints(send_counts)
        elif (type(send_counts) is tensor_type and send_counts.dtype is int64
              and send_counts.shape == want_counts and send_counts.get_device() == index):
            counts = send_counts.view(-1) if grouped else send_counts
        else:
            return None
        handle.epoch += 1
        current = stream()
        out, recv = take(capturing(), current)
        if fast is None or not fast(x, w, counts, out, recv, current):
            before = fast.nl.generation if fast is not None else 0
            plan.launch(handle, team, x, w, counts, out, recv, descriptors)
            if fast is not None:
                fast.record(x, w, before)
        return out, recv
    return call


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
    from . import triton_gemm_a2a as tk
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


# ---------------------------------------------------------------------------------------
# Abort: this rank rejected its input; the peers must finish the call without it
# ---------------------------------------------------------------------------------------


def abort(handle) -> None:
    """Take part in the handle's call without data (see rocmoe.h, "abort")."""
    if handle.op == "gemm_all_to_all":
        if handle.world == 1:
            return  # nobody waits for anything at world size 1 (no protocol)
        team = team_for(handle.ctx)
        layout = handle.layout
        args = (team.peer_bases, handle.status_address, handle.workspace_offset,
                layout.data_signals, layout.acks, layout.phase2_signals, layout.counts,
                layout.local, team.rank, team.world, _wait_budget(handle.ctx.timeout_s))
        _LAUNCHERS["abort_kernel"]((1,), args, dict(WORLD_P2=team.world_p2, CLOCK=_clock()), {},
                                   ("abort",))
        return
    from .._native import check, ffi, lib
    team = team_for(handle.ctx)
    if handle.op == "embedding_all_to_all":
        args = ffi.new("rocmoe_gpu_embedding_args *")
        _fill(ffi, args, team, handle, first_call=False)  # as the Triton abort: the timeout
        check(lib.rocmoe_gpu_embedding_a2a(args, 1), "EmbeddingAllToAll abort (GPU)")
    else:
        args = ffi.new("rocmoe_gpu_gemv_args *")
        _fill(ffi, args, team, handle, first_call=False)
        check(lib.rocmoe_gpu_gemv_allreduce(args, 1), "GemvAllReduce abort (GPU)")


# ---------------------------------------------------------------------------------------
# HIP kernels (librocmoe): Embedding + All-to-All, GEMV + AllReduce
# ---------------------------------------------------------------------------------------


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_ptr(ffi, device):
    """The current stream of `device` (torch's raw getter where it has one: the public one
    builds a Stream object, a few microseconds per call)."""
    if device.type != "cuda":
        return ffi.NULL
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return ffi.cast("void *", _RAW_STREAM(index))
    return ffi.cast("void *", torch.cuda.current_stream(index).cuda_stream)


def _fill(ffi, args, team: Team, handle, first_call: bool = True) -> None:
    """The team and fused parts of a HIP kernel's arguments (once per handle's struct). A
    struct for a first call waits first_call_timeout_s; its caller sets fused.timeout_s to
    the context's timeout once that call is launched (_launched)."""
    args.team.peer_bases = ffi.cast("const void *", team.peer_bases.data_ptr())
    args.team.rank, args.team.world = team.rank, team.world
    args.team.ranks_per_node = team.ranks_per_node
    args.fused.layout = handle.layout.cstruct[0]
    args.fused.workspace = ffi.cast("void *", handle.workspace.data_ptr())
    args.fused.stage = ffi.NULL  # every peer of an ipc heap is load/store reachable
    args.fused.status = ffi.cast("int *", handle.status_address)
    args.fused.workgroups = int(os.environ.get("ROCMOE_GPU_WORKGROUPS", "0"))
    args.fused.timeout_s = (first_call_timeout_s(handle.ctx.timeout_s) if first_call
                            else handle.ctx.timeout_s)
    args.fused.stream = _stream_ptr(ffi, handle.ctx.device)


def _launched(args, handle) -> None:
    """`args`' first call is launched: its later calls wait the context's timeout."""
    args.fused.timeout_s = handle.ctx.timeout_s


def embedding(handle, weights, indices, offsets, psw, batch: int, mode: str,
              out: torch.Tensor) -> None:
    """Enqueue one EmbeddingAllToAll call (indices and offsets are checked on the device)."""
    from .._native import check, ffi, lib
    team = team_for(handle.ctx)
    nt = len(weights)
    # 16-byte vector loads need 16-byte aligned rows: realign a table that is an odd view;
    # int32 indices and offsets are widened (the kernel reads int64)
    wts = [t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous().clone()
           for t in weights]
    i64 = torch.int64
    idx = [t if t.dtype == i64 and t.is_contiguous() else t.contiguous().to(i64)
           for t in indices]
    offs = [t if t.dtype == i64 and t.is_contiguous() else t.contiguous().to(i64)
            for t in offsets]
    ps = ([t if t.dtype == torch.float32 and t.is_contiguous() else t.contiguous().float()
           for t in psw] if psw is not None else None)
    args = getattr(handle, "_gpu_args", None)
    if args is None:
        args = handle._gpu_args = ffi.new("rocmoe_gpu_embedding_args *")
        handle._gpu_tables = ffi.new("rocmoe_gpu_table[]", max(nt, 1))
        handle._gpu_records = _table_records(ffi, handle._gpu_tables, max(nt, 1))
        handle._gpu_weights = handle._gpu_rows = None
        _fill(ffi, args, team, handle)
    args.fused.stream = _stream_ptr(ffi, handle.ctx.device)
    tables = handle._gpu_tables
    if nt:
        # the records as int64 columns (one numpy write per column, not per table); the
        # tables' pointers and rows are rewritten only when either changed. The rows count
        # too: nothing here holds the last call's tables, so a new table of other rows can
        # land at a freed one's address (the caching allocator rounds to 512 bytes: 30 and
        # 31 rows of 24 floats share a block), and the kernel then bounds-checked its
        # indices against the old table's rows (tests/ops_gpu/public_ops_script.py,
        # embedding_repeat/other_rows, failed so at 2 and 4 ranks on an H100)
        rec = handle._gpu_records
        ptrs = [t.data_ptr() for t in wts]
        rows = [t.shape[0] for t in wts]
        if ptrs != handle._gpu_weights or rows != handle._gpu_rows:
            rec[:nt, _REC["weights"]] = ptrs
            rec[:nt, _REC["rows"]] = rows
            handle._gpu_weights, handle._gpu_rows = ptrs, rows
        rec[:nt, _REC["indices"]] = [t.data_ptr() for t in idx]
        rec[:nt, _REC["offsets"]] = [t.data_ptr() for t in offs]
        rec[:nt, _REC["num_indices"]] = [t.numel() for t in idx]
        rec[:nt, _REC["per_sample_weights"]] = [t.data_ptr() for t in ps] if ps is not None else 0
    args.mode = MODES[mode]
    args.num_tables, args.total_tables, args.table_base = nt, handle.total_tables, handle.table_base
    args.batch, args.dim = batch, handle.dim
    args.tables = tables
    args.device_tables = ffi.NULL
    keep = None
    if nt > inline_tables():
        # too many for the launch's arguments: a device copy of the records, through pinned
        # memory (no synchronisation; the caching allocator keeps it until the copy ran)
        raw = torch.frombuffer(ffi.buffer(tables, ffi.sizeof("rocmoe_gpu_table") * nt),
                               dtype=torch.uint8).clone().pin_memory()
        keep = raw.to(handle.ctx.device, non_blocking=True)
        args.device_tables = ffi.cast("const rocmoe_gpu_table *", keep.data_ptr())
    args.out = ffi.cast("void *", out.data_ptr())
    check(lib.rocmoe_gpu_embedding_a2a(args, 0), "EmbeddingAllToAll (GPU)")
    if not getattr(handle, "_gpu_launched", False):
        _launched(args, handle)
        handle._gpu_launched = True
    del keep, wts, idx, offs, ps  # freed into stream order: reused only after the kernel


def _word_view(ffi, args, name: str, fields: dict) -> tuple:
    """(an int64 numpy view of the C struct `args` of type `name`, each of `fields`' word
    index in it): what a per-call writer sets pointers and sizes through, a numpy item write
    each instead of a cffi cast and field write (a few hundred ns each). `fields`: key ->
    the path of a field (("fused", "stream")). Every field must be an 8-byte word."""
    import numpy as np
    words = {key: ffi.offsetof(name, *path) for key, path in fields.items()}
    size = ffi.sizeof(name)
    if any(at % 8 for at in words.values()) or size % 8:
        raise errors.NativeLibraryError(
            f"{name} has fields at {words} of {size} bytes; this build of rocmoe expects "
            "them 8-byte aligned")
    return np.frombuffer(ffi.buffer(args, size), dtype=np.int64), \
        {k: v // 8 for k, v in words.items()}


class _StructLaunch:
    """What the per-handle argument writers below share: a C args struct written once, the
    C launch function that takes it, the current-stream getter, and the first call's longer
    wait (_fill), cut to the context's timeout once that call is launched."""

    def __init__(self, handle, args, fn):
        from .._native import check
        self.args, self.fn, self.check = args, fn, check
        self.handle, self.first = handle, True
        self.stream = native_launch.stream_getter(handle.ctx.device)

    def _launch(self, what: str) -> None:
        rc = self.fn(self.args, 0)
        if rc:
            self.check(rc, what)
        if self.first:
            _launched(self.args, self.handle)
            self.first = False


def _embedding_args(ffi, handle):
    """A new rocmoe_gpu_embedding_args with what a handle fixes for all its calls: the team,
    workspace and waits (_fill), the mode, the tables' count and place, the width. The
    per-call writers below add their table layout (packed or per-table records)."""
    args = ffi.new("rocmoe_gpu_embedding_args *")
    _fill(ffi, args, team_for(handle.ctx), handle)
    args.mode = MODES[handle.mode]
    args.num_tables, args.total_tables = handle.num_tables, handle.total_tables
    args.table_base, args.dim = handle.table_base, handle.dim
    return args


class PackedEmbeddingLaunch(_StructLaunch):
    """A handle's rocmoe_gpu_embedding_args for packed calls (EmbeddingAllToAll.batched),
    written once; a call writes its eight per-call words (stream, batch, output, weight,
    indices, offsets, per-sample weights, index count) through an int64 view of the struct
    (see _word_view; each cffi cast and field write cost a few hundred ns: the probe measured
    8 us of argument writing around a 6 us launch)."""

    def __init__(self, handle):
        from .._native import ffi, lib
        args = _embedding_args(ffi, handle)
        args.tables = args.device_tables = ffi.NULL
        args.packed.row_base = ffi.cast("const int64_t *", handle._row_base_t.data_ptr())
        fields = {"stream": ("fused", "stream"), "batch": ("batch",), "out": ("out",)}
        for field in ("weights", "indices", "offsets", "per_sample_weights", "num_indices"):
            fields[field] = ("packed", field)
        self.view, self.at = _word_view(ffi, args, "rocmoe_gpu_embedding_args", fields)
        super().__init__(handle, args, lib.rocmoe_gpu_embedding_a2a)

    def __call__(self, weight, indices, offsets, psw, batch: int, out: torch.Tensor) -> None:
        # 16-byte vector loads need 16-byte aligned rows; the kernel reads int64 and fp32
        w = weight if weight.is_contiguous() and weight.data_ptr() % 16 == 0 else \
            weight.contiguous().clone()
        i64 = torch.int64
        idx = indices if indices.dtype == i64 and indices.is_contiguous() else \
            indices.contiguous().to(i64)
        off = offsets if offsets.dtype == i64 and offsets.is_contiguous() else \
            offsets.contiguous().to(i64)
        ps = None if psw is None else (psw if psw.dtype == torch.float32 and psw.is_contiguous()
                                       else psw.contiguous().float())
        v, at = self.view, self.at
        v[at["stream"]] = self.stream()
        v[at["batch"]] = batch
        v[at["out"]] = out.data_ptr()
        v[at["weights"]] = w.data_ptr()
        v[at["indices"]] = idx.data_ptr()
        v[at["offsets"]] = off.data_ptr()
        v[at["per_sample_weights"]] = 0 if ps is None else ps.data_ptr()
        v[at["num_indices"]] = idx.numel()
        self._launch("EmbeddingAllToAll.batched (GPU)")
        del w, idx, off, ps  # freed into stream order: reused only after the kernel


def inline_tables() -> int:
    """How many per-table records travel inside an embedding launch's arguments (more go
    through a device copy; 0 in a build without GPU kernels)."""
    from .._native import lib
    return lib.rocmoe_gpu_embedding_inline_tables()


class TableEmbeddingLaunch(_StructLaunch):
    """A handle's rocmoe_gpu_embedding_args for per-table calls outside autograd
    (EmbeddingAllToAll.__call__), written once, with its own table records. A call checks and
    writes each table's three per-call words (indices, offsets, index count) in one pass,
    and each table's weight pointer only when the tables are not the ones it adopted last
    (identity, then data_ptr: a `.data =` swap keeps the object but moves the storage). Host
    time grows by well under a microsecond a table (the first version, which checked every
    table in one pass and wrote the records in another, spent about 2 us a table: 67 us a
    call at 26 tables on the H200's host).

    `prepare` returns the call's global batch with the records written, or None when any
    table needs what the general path does (int32 or strided indices, per-sample weights,
    an unaligned or foreign table, a tensor on another device, more tables than travel
    inline): that path then checks everything and names what is wrong. Nothing is launched
    and no epoch is taken before `fire`."""

    def __init__(self, handle):
        from .._native import ffi, lib
        nt = handle.num_tables
        self.usable = 0 < nt <= inline_tables()
        args = _embedding_args(ffi, handle)
        tables = ffi.new("rocmoe_gpu_table[]", max(nt, 1))
        _table_records(ffi, tables, max(nt, 1))  # checks the record layout against _REC
        args.tables, args.device_tables = tables, ffi.NULL
        args.packed.weights = ffi.NULL  # the per-table records, not the packed layout
        self.view, self.at = _word_view(ffi, args, "rocmoe_gpu_embedding_args", {
            "stream": ("fused", "stream"), "batch": ("batch",), "out": ("out",)})
        # the records as flat int64 words: table t's field f is word t * len(_REC) + f
        self.records = memoryview(ffi.buffer(tables)).cast("B").cast("q")
        self.tables = tables  # args.tables points into it and does not own it
        super().__init__(handle, args, lib.rocmoe_gpu_embedding_a2a)
        self.index = handle._device_index  # what get_device() says of the handle's tensors
        self.num_tables, self.world, self.max_batch = nt, handle.world, handle.max_batch
        self.most = handle.max_lookups
        self.shapes = [torch.Size((r, handle.dim)) for r in handle.table_rows]
        # the tables adopted last (held: compared by identity; None matches no tensor)
        self.weights: tuple = (None,) * nt
        self.weight_ptrs: list = []   # and their data pointers then

    def _adopt(self, weights) -> bool:
        """Take `weights` as the handle's tables when each is a contiguous, 16-byte aligned
        tensor of its table's shape and the handle's dtype on its GPU (the kernel's vector
        loads need the alignment); writes their pointers and rows into the records."""
        dtype, index, rec, stride = self.handle.dtype, self.index, self.records, len(_REC)
        for w, shape in zip(weights, self.shapes):
            if not (isinstance(w, torch.Tensor) and w.get_device() == index
                    and w.dtype is dtype and w.shape == shape and w.is_contiguous()
                    and w.data_ptr() % 16 == 0):
                return False
        ptrs = [w.data_ptr() for w in weights]
        for t, (ptr, shape) in enumerate(zip(ptrs, self.shapes)):
            rec[t * stride + _REC["weights"]] = ptr
            rec[t * stride + _REC["rows"]] = shape[0]
        self.weights, self.weight_ptrs = tuple(weights), ptrs
        return True

    def prepare(self, weights, indices, offsets, batch) -> Optional[int]:
        nt = self.num_tables
        if type(indices) is _TENSOR:
            return self._prepare_stacked(weights, indices, offsets, batch)
        if not self.usable or len(weights) != nt or len(indices) != nt or len(offsets) != nt:
            return None
        if not all(map(is_, weights, self.weights)) and not self._adopt(weights):
            return None
        if batch is None:
            first = offsets[0]
            if type(first) is not _TENSOR:
                return None
            batch = first.numel()
        elif type(batch) is not int:
            return None
        if batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        rec, index, most, i64, tensor = self.records, self.index, self.most, _I64, _TENSOR
        stride, f_idx, f_off, f_num = len(_REC), _REC["indices"], _REC["offsets"], \
            _REC["num_indices"]
        at = 0
        for w, idx, off, ptr in zip(weights, indices, offsets, self.weight_ptrs):
            if not (type(idx) is tensor and type(off) is tensor and idx.dtype is i64
                    and off.dtype is i64 and idx.get_device() == index
                    and off.get_device() == index and idx.dim() == 1 and off.dim() == 1
                    and idx.is_contiguous() and off.is_contiguous()
                    and off.numel() == batch):
                return None
            if w.data_ptr() != ptr:  # a table moved: adopt the tables again, then start over
                return self.prepare(weights, indices, offsets, batch) \
                    if self._adopt(weights) else None
            n = idx.numel()
            if n > most:
                return None
            rec[at + f_idx] = idx.data_ptr()
            rec[at + f_off] = off.data_ptr()
            rec[at + f_num] = n
            at += stride
        return batch

    def _prepare_stacked(self, weights, indices, offsets, batch) -> Optional[int]:
        """`prepare` for stacked lookups: `indices` [num_tables, L] and `offsets`
        [num_tables, B], table t's in row t (dlrm's lS_i and lS_o for Criteo data). Two
        tensors are checked whatever the number of tables, and table t's words are the rows'
        addresses, so the host's work per table is three integer writes (iterating the rows
        as tensors instead made a view of each: twice the host time of a list). None for what
        the list form would decline, and for rows that are not unit-stride."""
        nt, index = self.num_tables, self.index
        if not (self.usable and type(offsets) is _TENSOR and len(weights) == nt
                and indices.dtype is _I64 and offsets.dtype is _I64
                and indices.get_device() == index and offsets.get_device() == index
                and indices.dim() == 2 and offsets.dim() == 2):
            return None
        (rows_i, lookups), (rows_o, bags) = indices.shape, offsets.shape
        (step_i, unit_i), (step_o, unit_o) = indices.stride(), offsets.stride()
        if (rows_i != nt or rows_o != nt or unit_i != 1 or unit_o != 1
                or lookups > self.most):
            return None
        if batch is None:
            batch = bags
        elif type(batch) is not int or batch != bags:
            return None
        if batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        if not all(map(is_, weights, self.weights)) or \
                list(map(_DATA_PTR, weights)) != self.weight_ptrs:
            if not self._adopt(weights):  # new tables, or one whose storage moved
                return None
        rec, stride = self.records, len(_REC)
        f_idx, f_off, f_num = _REC["indices"], _REC["offsets"], _REC["num_indices"]
        at_i, at_o = indices.data_ptr(), offsets.data_ptr()
        step_i, step_o = step_i * 8, step_o * 8  # int64 rows
        for at in range(0, nt * stride, stride):
            rec[at + f_idx] = at_i
            rec[at + f_off] = at_o
            rec[at + f_num] = lookups
            at_i += step_i
            at_o += step_o
        return batch

    def fire(self, batch: int, out: torch.Tensor) -> None:
        """Launch the call `prepare` wrote, into `out` [batch / world, total_tables, dim]."""
        v, at = self.view, self.at
        v[at["stream"]] = self.stream()
        v[at["batch"]] = batch
        v[at["out"]] = out.data_ptr()
        self._launch("EmbeddingAllToAll (GPU)")


_TENSOR = torch.Tensor
_I64 = torch.int64
_DATA_PTR = torch.Tensor.data_ptr


# rocmoe_gpu_table's fields as int64 columns (checked against the C layout at first use)
_REC = {"weights": 0, "indices": 1, "offsets": 2, "per_sample_weights": 3, "rows": 4,
        "num_indices": 5}


def _table_records(ffi, tables, n: int):
    """A [n, 6] int64 numpy view of a rocmoe_gpu_table array (pointers and sizes alike are
    8 bytes: the struct has no padding)."""
    import numpy as np
    size = ffi.sizeof("rocmoe_gpu_table")
    layout = {name: ffi.offsetof("rocmoe_gpu_table", name) // 8 for name in _REC}
    if size != 8 * len(_REC) or layout != _REC:
        raise errors.NativeLibraryError(
            f"rocmoe_gpu_table is {size} bytes with fields at {layout}; this build of rocmoe "
            "expects six 8-byte fields in the order of rocmoe.h")
    return np.frombuffer(ffi.buffer(tables, size * n), dtype=np.int64).reshape(n, len(_REC))


class GemvLaunch(_StructLaunch):
    """A GemvAllReduce handle's rocmoe_gpu_gemv_args, written once; a call writes its five
    per-call words (stream, K, W, x, y) through an int64 view of the struct (see
    _word_view). The caller has checked W [N, K] and x [K] (K is the call's: the functional
    op's cached handle serves every K of an N); a non-contiguous W or x is made contiguous
    here (the kernel reads rows of W and x as plain arrays)."""

    def __init__(self, handle):
        from .._native import ffi, lib
        args = ffi.new("rocmoe_gpu_gemv_args *")
        _fill(ffi, args, team_for(handle.ctx), handle)
        args.n = handle.N
        self.view, self.at = _word_view(ffi, args, "rocmoe_gpu_gemv_args", {
            "stream": ("fused", "stream"), "k": ("k",), "w": ("w",), "x": ("x",),
            "out": ("out",)})
        super().__init__(handle, args, lib.rocmoe_gpu_gemv_allreduce)

    def __call__(self, w_local: torch.Tensor, x_local: torch.Tensor, out: torch.Tensor) -> None:
        wc = w_local if w_local.is_contiguous() else w_local.contiguous()
        xc = x_local if x_local.is_contiguous() else x_local.contiguous()
        v, at = self.view, self.at
        v[at["stream"]] = self.stream()
        v[at["k"]] = wc.shape[1]
        v[at["w"]] = wc.data_ptr()
        v[at["x"]] = xc.data_ptr()
        v[at["out"]] = out.data_ptr()
        self._launch("GemvAllReduce (GPU)")
        del wc, xc  # a copy made here is freed into stream order: reused after the kernel


def gemv(handle, w_local: torch.Tensor, x_local: torch.Tensor, out: torch.Tensor) -> None:
    """Enqueue one GemvAllReduce call (the handle's GemvLaunch, made on its first call)."""
    launch = handle.__dict__.get("_gemv_launch")
    if launch is None:
        launch = handle._gemv_launch = GemvLaunch(handle)
    launch(w_local, x_local, out)


__all__ = ["Team", "team_for", "rows_exchange", "grouped_backward", "abort", "embedding",
           "PackedEmbeddingLaunch", "TableEmbeddingLaunch", "GemvLaunch", "gemv", "gemm_config",
           "gemm_operands", "tma_operands_fit", "slice_order", "task_prefix", "errors"]
