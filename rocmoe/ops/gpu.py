"""GPU path of the fused ops: workspaces on a symmetric arena, launches, waits, errors.

rocmoe.ops' public functions call these when their tensors are on a GPU:

* ``embedding_all_to_all(arena, weights, indices, offsets, mode, per_sample_weights)``
* ``gemv_all_reduce(arena, w_local, x_local)``
* ``gemm_all_to_all(arena, x, w, send_counts)``

``arena`` is where the receive buffers and signal slots live, symmetric over the ranks:
``ContextArena(ctx)`` (the ipc backend's device heap; also the host backend's shared
memory, which lets the Triton kernel run under ``TRITON_INTERPRET=1`` on CPU processes) or
``TorchIpcArena(comm)`` (device memory shared through CUDA/HIP IPC handles that torch
makes, for GPU machines where the ipc backend is not built).

Protocol of one call (DESIGN.md, "Signal protocol"), per op and arena:

1. epoch ``e`` = 1, 2, 3, ... ; the receive buffer used is ``e % 2`` (double buffering);
2. producer side: wait until every destination has acknowledged call ``e - 2`` (its buffer
   ``e % 2`` is free again; normally long true), run the persistent kernel: tiles stored
   straight into the destinations' buffers, each slice's completer stores ``e`` into the
   destination's signal slot for this rank (release, system scope);
3. consumer side: wait until every source's slot holds ``>= e``, copy the received data
   out of the heap, acknowledge ``e`` to every source.

Every wait is bounded (``timeout_s``, default the context's / ``ROCMOE_TIMEOUT_S``). A wait
that runs out records a status on the device; the call synchronises, reads it and raises
``CommTimeoutError`` naming the op, this rank, the peer and the slice.
"""

from __future__ import annotations

import abc
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .. import errors
from .._triton import interpreting as _interpreting
from .._triton import sm_count, tensor_descriptor, tma_capable

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
# Symmetric arenas
# ---------------------------------------------------------------------------------------


class Arena(abc.ABC):
    """Symmetric memory for the fused ops: same offsets on every rank, peers' bases known."""

    rank: int
    world: int
    ranks_per_node: int
    device: torch.device
    comm: object
    timeout_s: float
    peer_bases: torch.Tensor  # int64 [world] on `device`: each rank's base as seen here

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """(local view, heap offset) of `nbytes`, collectively: same offset on every rank."""

    def barrier(self) -> None:
        self.allgather([0], "fused ops barrier")

    def allgather(self, values, what: str = "fused op agreement") -> list:
        """Timed all-gather of a list of ints (same length on every rank): a rank that
        never arrives becomes CommTimeoutError, not a hang (rocmoe.collective)."""
        if self.world == 1:
            return [list(values)]
        channel = getattr(self, "_channel", None)
        if channel is None:
            from ..collective import ControlChannel
            channel = self._channel = ControlChannel(self.comm, self.timeout_s)
        table = channel.allgather(np.asarray(values, dtype=np.int64), what)
        return [[int(v) for v in row] for row in table]

    def base(self) -> int:
        return int(self.peer_bases_host[self.rank])

    def workspace(self, op: str) -> "Workspace":
        ws = self._workspaces.get(op)
        if ws is None:
            ws = Workspace(self, op)
            self._workspaces[op] = ws
        return ws


def _ranks_per_node(comm) -> int:
    try:
        from mpi4py import MPI
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        n = local.Get_size()
        local.Free()
        return n
    except Exception:  # pragma: no cover - comms without Split_type
        return comm.Get_size()


class ContextArena(Arena):
    """The rocmoe context's symmetric heap (ipc backend on GPUs; host backend on CPUs)."""

    def __init__(self, ctx):
        from .._native import ffi, lib, check
        self.ctx = ctx
        self.comm = ctx.comm
        self.rank, self.world = ctx.rank, ctx.world_size
        self.ranks_per_node = getattr(ctx, "local_size", 0) or self.world
        self.device = ctx.device
        self.timeout_s = ctx.timeout_s
        bases = []
        for r in range(self.world):
            out = ffi.new("void **")
            check(lib.rocmoe_peer_ptr(ctx._handle, r, 0, out), f"peer base of rank {r}")
            bases.append(int(ffi.cast("uintptr_t", out[0])))
        self.peer_bases_host = bases
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self._workspaces = {}
        self._owned = []

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int]:
        t = self.ctx.zeros((max(nbytes, ALIGN),), dtype=torch.uint8)
        self._owned.append(t)
        return t, self.ctx.heap.offset_of(t)


_arenas = None


def arena_for(ctx) -> "ContextArena":
    """The ContextArena of a rocmoe Context, made once per context (its workspaces and epochs
    must persist across calls). Creating it is collective (the first op call on every rank)."""
    global _arenas
    import weakref
    if _arenas is None:
        _arenas = weakref.WeakKeyDictionary()
    arena = _arenas.get(ctx)
    if arena is None:
        arena = _arenas[ctx] = ContextArena(ctx)
    return arena


class TorchIpcArena(Arena):
    """One device buffer per rank, shared with the ranks of this node through the IPC
    handles torch makes for CUDA/HIP storages; a deterministic bump allocator on top keeps
    offsets identical on every rank. For GPU machines without the ipc backend built."""

    def __init__(self, comm=None, nbytes: int = 256 << 20, device: Optional[torch.device] = None,
                 timeout_s: Optional[float] = None):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.ranks_per_node = _ranks_per_node(comm)
        if self.ranks_per_node != self.world:
            raise errors.ConfigurationError(
                "TorchIpcArena reaches peers through IPC handles, so all ranks must share one "
                f"node ({self.ranks_per_node} of {self.world} ranks do); use the rocshmem/nvshmem "
                "backend across nodes")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.timeout_s = float(timeout_s if timeout_s is not None
                               else os.environ.get("ROCMOE_TIMEOUT_S", 60))
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        handle = self.buffer.untyped_storage()._share_cuda_()
        offset_in_storage = 0
        handles = comm.allgather(handle)
        self._peer_storages = []
        bases = []
        for r, h in enumerate(handles):
            if r == self.rank:
                bases.append(self.buffer.data_ptr())
                continue
            storage = torch.UntypedStorage._new_shared_cuda(*h)
            self._peer_storages.append(storage)
            bases.append(storage.data_ptr() + offset_in_storage)
        self.peer_bases_host = bases
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self._next = 0
        self._workspaces = {}
        comm.Barrier()

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int]:
        nbytes = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        if self._next + nbytes > self.buffer.numel():
            raise errors.HeapExhaustedError(
                f"TorchIpcArena: {nbytes} bytes requested, {self.buffer.numel() - self._next} of "
                f"{self.buffer.numel()} left; create the arena with a larger nbytes")
        offset = self._next
        self._next += nbytes
        return self.buffer[offset:offset + nbytes], offset


class SingleRankArena(Arena):
    """World size 1 without MPI (benchmarks on one GPU): the "peer" is this rank."""

    class _Comm:
        def Barrier(self):
            pass

        def allgather(self, v):
            return [v]

        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

    def __init__(self, nbytes: int = 1 << 30, device=None, timeout_s: float = 60.0):
        self.comm = self._Comm()
        self.rank, self.world, self.ranks_per_node = 0, 1, 1
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.peer_bases_host = [self.buffer.data_ptr()]
        self.peer_bases = torch.tensor(self.peer_bases_host, dtype=torch.int64, device=self.device)
        self._next = 0
        self._workspaces = {}

    alloc = TorchIpcArena.alloc


# ---------------------------------------------------------------------------------------
# Per-op workspace: signal and ack slots, double-buffered receive space, counters, epoch
# ---------------------------------------------------------------------------------------


class Workspace:
    def __init__(self, arena: Arena, op: str):
        self.arena, self.op = arena, op
        w = arena.world
        # slots[0:w] data signals (by source), [w:2w] acks (by destination), [2w:3w] a
        # second signal set for two-phase ops (gemv_all_reduce's all-gather, by owner)
        self.slots, self.slot_offset = arena.alloc(3 * w * 8)
        self.slots = self.slots[:3 * w * 8].view(torch.int64)
        self.signal_offset = self.slot_offset
        self.ack_offset = self.slot_offset + w * 8
        self.recv_bytes = 0
        self.recv = []          # two local views
        self.recv_offsets = []  # their heap offsets
        self.epoch = 0
        self._ints = {}
        # next task, exited workers, two sets of per-slice done counters (the GEMV's two
        # phases), a phase-1 done count: rocmoe_gpu_fused.counters in rocmoe.h
        self.counters = torch.zeros(3 + 2 * w, dtype=torch.int32, device=arena.device)
        self.status = torch.zeros(3 * w, dtype=torch.int32, device=arena.device)
        arena.barrier()  # nobody signals into slots a peer has not zeroed yet

    def ensure_recv(self, nbytes: int) -> None:
        """Grow the receive buffers; collective: every rank passes the same (agreed) size."""
        if nbytes <= self.recv_bytes and self.recv:
            return
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        self.recv, self.recv_offsets = [], []
        for _ in range(2):
            t, off = self.arena.alloc(size)
            self.recv.append(t)
            self.recv_offsets.append(off)
        self.recv_bytes = size
        self.arena.barrier()

    def device_ints(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor of `values`, cached: a fresh host->device copy of a pageable list
        would synchronise the stream on every call, exposing the launch latency."""
        key = (dtype, tuple(int(v) for v in values))
        t = self._ints.pop(key, None)
        if t is None:
            t = torch.tensor(key[1], dtype=dtype, device=self.arena.device)
        self._ints[key] = t  # most recently used last
        while len(self._ints) > 32:
            self._ints.pop(next(iter(self._ints)))
        return t

    def next_epoch(self, signal: bool = True) -> int:
        """This call's epoch. A call with signalling off (benchmarks) raises no signals and
        sends no acks, so it must not advance the epoch either: the next signalled call would
        otherwise wait for an acknowledgement of a call nobody acknowledged."""
        if not signal:
            return self.epoch + 1
        self.epoch += 1
        return self.epoch

    def buffer(self, epoch: int) -> tuple[torch.Tensor, int]:
        return self.recv[epoch % 2], self.recv_offsets[epoch % 2]

    @property
    def signals(self) -> torch.Tensor:
        return self.slots[:self.arena.world]

    @property
    def acks(self) -> torch.Tensor:
        return self.slots[self.arena.world:2 * self.arena.world]


def _wait_budget(timeout_s: float) -> int:
    # Iterations of an acquire-polling loop (no device clock in Triton): a system-scope
    # atomic takes about a microsecond on a GPU; the interpreter needs milliseconds per poll.
    per_s = 300 if _interpreting() else 1e6
    return int(min(2**31 - 1, max(1, timeout_s * per_s)))


def _launch_ack(arena: Arena, ws: Workspace, epoch: int) -> None:
    from . import triton_gemm_a2a as tk
    tk.get("signal_peers_kernel")[(arena.world,)](arena.peer_bases, ws.ack_offset, arena.rank,
                                                  epoch)


def check_status(ws: Workspace, epoch: int, what: str) -> None:
    """Synchronise and turn a recorded wait timeout into CommTimeoutError."""
    status = ws.status.cpu().numpy()
    w = ws.arena.world
    late_acks = [int(d) for d in np.nonzero(status[:w])[0]]
    late_data = sorted({int(s) % w for s in np.nonzero(status[w:])[0]})
    if late_data:
        raise errors.CommTimeoutError(
            f"{what}: rank {ws.arena.rank} waited {ws.arena.timeout_s:g} s for slice(s) from "
            f"rank(s) {late_data} of call {epoch} (signal slot(s) {late_data}); a peer did not "
            "reach this call, died, or was given different arguments")
    if late_acks:
        raise errors.CommTimeoutError(
            f"{what}: rank {ws.arena.rank} waited {ws.arena.timeout_s:g} s for rank(s) "
            f"{late_acks} to release their receive buffer of call {epoch - 2} (ack slot(s) "
            f"{late_acks}); a peer stopped calling {what}")


# ---------------------------------------------------------------------------------------
# GEMM + All-to-All (Triton)
# ---------------------------------------------------------------------------------------

_PLATFORM = "hip" if getattr(torch.version, "hip", None) else "cuda"


def _num_programs(device: torch.device, total_tasks: int, per_sm: Optional[float] = None) -> int:
    """Grid of the GEMM: `per_sm` programs per SM/CU, 0 for one per task (the hardware then
    overlaps one tile's epilogue with another's main loop). None picks by tiles per SM, as
    measured on an H200 (bf16, 128x256 tiles; benchmarks/results/gemm_sweep_h200.json): with
    few (4096^3: 3.9) one program per tile ran at 0.78 of torch.matmul against 0.50
    persistent; with many (8192^3: 15.5) persistent won, 0.84 against 0.75."""
    if device.type == "cpu":
        return min(total_tasks, 4)
    sms = sm_count(device)
    if per_sm is None:
        per_sm = 0 if total_tasks <= 8 * sms else 1
    if per_sm <= 0:
        return max(1, total_tasks)
    return max(1, min(total_tasks, int(sms * per_sm)))


@dataclass
class GemmPlan:
    counts: np.ndarray           # [world, world]: rows s sends to d
    row_start: list
    dest_rows: list              # first row of this rank's part at each destination
    recv_rows: int
    recv_capacity_rows: int      # max over ranks (the symmetric buffer size)
    order: list
    prefix: list
    config: dict = field(default_factory=dict)
    # grouped products (W [G, K, N]): per destination, the tile numbers where each of its G
    # segments starts ([world * (G + 1)]), and each segment's first row of X, rows and first
    # row inside this rank's part of the destination's buffer ([world * G] each)
    groups: int = 0
    seg_prefix: list = field(default_factory=list)
    seg_row0: list = field(default_factory=list)
    seg_rows: list = field(default_factory=list)
    seg_out: list = field(default_factory=list)


def plan_gemm(arena: Arena, m: int, n: int, send_counts: Sequence[int], config: dict,
              group_counts: Optional[Sequence[Sequence[int]]] = None) -> GemmPlan:
    """Agree on every rank's counts (one host all-gather) and lay out this rank's tasks
    (`group_counts`: grouped products, see plan_gemm_agreed). Bad counts on any rank raise
    InvalidArgumentError on every rank, before any kernel."""
    w = arena.world
    counts_in = [int(c) for c in send_counts]
    # a wrong number of counts still sends a record of the agreed size (marked bad), so
    # every rank learns about it and raises instead of deadlocking in the all-gather
    record = [int(m), int(n)] + (counts_in if len(counts_in) == w else [-1] * w)
    rows = arena.allgather(record, "gemm_all_to_all (agreeing on send_counts)")
    bad = [s for s, rec in enumerate(rows) if any(c < 0 for c in rec[2:]) or sum(rec[2:]) != rec[0]]
    if bad or len({rec[1] for rec in rows}) != 1:
        raise errors.InvalidArgumentError(
            f"gemm_all_to_all: send_counts must have {w} entries >= 0 that sum to the rows of X, "
            f"and N must agree on every rank; ranks {bad or 'all'} disagree "
            f"(M, N, counts per rank: {rows})")
    return plan_gemm_agreed(arena, np.asarray([rec[2:] for rec in rows], dtype=np.int64), n,
                            config, group_counts=group_counts)


def plan_gemm_agreed(arena: Arena, counts: np.ndarray, n: int, config: dict,
                     group_counts: Optional[Sequence[Sequence[int]]] = None) -> GemmPlan:
    """The plan from a counts matrix every rank already agreed on ([world, world]: rows rank s
    sends to rank d), without communicating: for callers that validated and all-gathered the
    counts themselves (rocmoe.ops' public op does). `group_counts` ([world][G], this rank's
    rows per destination and group, summing to its row of `counts`): grouped products."""
    w, r = arena.world, arena.rank
    counts = np.asarray(counts, dtype=np.int64).reshape(w, w)
    row_start = [0] + list(np.cumsum(counts[r])[:-1])
    dest_rows = [int(counts[:r, d].sum()) for d in range(w)]
    recv = counts.sum(axis=0)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    n_tiles = math.ceil(n / bn) if n > 0 else 1
    extra = {}
    if group_counts is None:
        tasks = [max(1, math.ceil(int(c) / bm) * n_tiles) for c in counts[r]]
    else:
        gc = np.asarray(group_counts, dtype=np.int64).reshape(w, -1)
        groups = gc.shape[1]
        seg_tiles = -(-gc // bm) * n_tiles                         # [world, G]
        seg_prefix = np.concatenate([np.zeros((w, 1), np.int64), np.cumsum(seg_tiles, 1)], 1)
        seg_out = np.concatenate([np.zeros((w, 1), np.int64), np.cumsum(gc, 1)[:, :-1]], 1)
        seg_row0 = np.asarray(row_start, dtype=np.int64)[:, None] + seg_out
        tasks = [max(1, int(t)) for t in seg_prefix[:, -1]]
        extra = dict(groups=groups, seg_prefix=seg_prefix.reshape(-1).tolist(),
                     seg_row0=seg_row0.reshape(-1).tolist(), seg_rows=gc.reshape(-1).tolist(),
                     seg_out=seg_out.reshape(-1).tolist())
    order = slice_order(r, w, arena.ranks_per_node)
    return GemmPlan(counts, [int(v) for v in row_start], dest_rows, int(recv[r]), int(recv.max()),
                    order, task_prefix(order, tasks), config, **extra)


def gemm_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    from . import triton_gemm_a2a as tk
    if device.type == "cpu":  # interpreter: small tiles keep it quick
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    cfg = tk.default_config(_PLATFORM, dtype == torch.float32)
    # ROCMOE_GEMM_CONFIG='{"BLOCK_N": 128, "USE_TMA": true}' overrides entries (tuning)
    override = os.environ.get("ROCMOE_GEMM_CONFIG")
    if override:
        import json
        cfg.update(json.loads(override))
    return cfg


def gemm_operands(x: torch.Tensor, w: torch.Tensor, cfg: dict) -> tuple:
    """(X argument, W argument, USE_TMA) of the GEMM kernel: tensor descriptors for the
    copy engine where the config asks for them and the GPU (Hopper or later) and the
    operands' alignment allow; the tensors themselves otherwise. A grouped W [G, K, N] goes
    as one [G*K, N] descriptor, which needs W contiguous and K a multiple of BLOCK_K (a box
    must not reach into the next group)."""
    if not (cfg.get("USE_TMA") and tma_capable(x.device) and x.dtype != torch.float32
            and x.stride(1) == 1 and w.stride(-1) == 1):
        return x, w, False
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if w.dim() == 3 and not (w.is_contiguous() and w.shape[1] % bk == 0):
        return x, w, False
    x_desc = tensor_descriptor(x, x.shape[0], x.shape[1], x.stride(0), [bm, bk])
    w_desc = tensor_descriptor(w, w.shape[-2] * (w.shape[0] if w.dim() == 3 else 1),
                               w.shape[-1], w.stride(-2), [bk, bn])
    if x_desc is None or w_desc is None:
        return x, w, False
    return x_desc, w_desc, True


def gemm_all_to_all(arena: Arena, x: torch.Tensor, w: torch.Tensor, send_counts: Sequence[int], *,
                    signal: bool = True, check: bool = True, config: Optional[dict] = None,
                    plan: Optional[GemmPlan] = None, copy_out: bool = True,
                    group_counts: Optional[Sequence[Sequence[int]]] = None
                    ) -> Optional[torch.Tensor]:
    """Y = X @ W with Y's rows sent to the ranks by `send_counts` (all_to_all_single order).

    Grouped products: W [G, K, N] and `group_counts` [world][G] (summing to send_counts):
    the rows for destination d are G segments, segment (d, g) multiplied by W[g].

    `signal=False` runs the same kernel without done counters, signals, waits or acks (the
    benchmark's baseline for the cost of the fusion machinery; the result is then only
    right at world size 1). `copy_out=False` (benchmarks) skips copying the result out of
    the receive buffer and returns None."""
    from . import triton_gemm_a2a as tk
    grouped = w.dim() == 3
    if x.dim() != 2 or w.dim() not in (2, 3) or x.shape[1] != w.shape[-2] or (
            grouped != (group_counts is not None)):
        raise errors.InvalidArgumentError(
            f"gemm_all_to_all: expected X [M, K] and W [K, N] (or [G, K, N] with group "
            f"counts), got {tuple(x.shape)} and {tuple(w.shape)}")
    if grouped:
        gc = np.asarray(group_counts, dtype=np.int64)
        if gc.shape != (arena.world, w.shape[0]) or (gc < 0).any() or \
                list(gc.sum(axis=1)) != [int(c) for c in send_counts]:
            raise errors.InvalidArgumentError(
                f"gemm_all_to_all: group counts {gc.tolist()} must be [world={arena.world}, "
                f"G={w.shape[0]}], >= 0, and sum to send_counts {list(send_counts)}")
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise errors.DTypeError(
            f"gemm_all_to_all: X and W must share one of float32/bfloat16/float16, got "
            f"{x.dtype} and {w.dtype}")
    m, k = x.shape
    n = w.shape[-1]
    cfg = dict(config or gemm_config(x.device, x.dtype))
    if plan is None:
        plan = plan_gemm(arena, m, n, send_counts, cfg, group_counts=group_counts)
    if plan.groups != (w.shape[0] if grouped else 0) or (
            grouped and plan.seg_rows != [int(c) for row in group_counts for c in row]):
        raise errors.InvalidArgumentError(
            f"gemm_all_to_all: the plan has {plan.groups} groups (rows {plan.seg_rows}), W "
            f"{tuple(w.shape)}: a plan is only valid for the shapes and counts it was made for")
    if int(plan.counts[arena.rank].sum()) != m:
        raise errors.InvalidArgumentError(
            f"gemm_all_to_all: the plan's counts {list(plan.counts[arena.rank])} do not sum to "
            f"M={m}: a plan is only valid for the shapes it was made for")
    dev = x.device
    ws = arena.workspace("gemm_a2a")
    ws.ensure_recv(plan.recv_capacity_rows * n * x.element_size())
    epoch = ws.next_epoch(signal)
    recv, recv_offset = ws.buffer(epoch)
    world = arena.world

    def i64(v):
        return ws.device_ints(v, torch.int64)

    def i32(v):
        return ws.device_ints(v, torch.int32)

    # every argument is ready before the first launch, so the status clear, the ack wait
    # and the kernel reach the GPU back to back (host work between them idles the GPU)
    plan_args = (i64(plan.row_start), i64(list(plan.counts[arena.rank])), i64(plan.dest_rows),
                 i32(plan.order), i32(plan.prefix))
    if grouped:
        seg_args = (i32(plan.seg_prefix), i64(plan.seg_row0), i64(plan.seg_rows),
                    i64(plan.seg_out))
    else:  # (not read: GROUPS_P2 = 0 compiles the plain path)
        seg_args = (plan_args[4], plan_args[0], plan_args[0], plan_args[0])
    total = plan.prefix[-1]
    nprog = _num_programs(dev, total, cfg.get("PROGRAMS_PER_SM"))
    launch = {k2: cfg[k2] for k2 in ("num_warps", "num_stages") if k2 in cfg and dev.type != "cpu"}
    kernel = tk.get("gemm_a2a_kernel")
    x_arg, w_arg, use_tma = gemm_operands(x, w, cfg)
    budget = _wait_budget(arena.timeout_s)
    ws.status.zero_()
    # the kernel waits for the destinations' acks and, in its last program, for every
    # source's slice (no separate wait launches)
    groups = plan.groups
    kernel[(nprog,)](
        x_arg, w_arg, arena.peer_bases, *plan_args, ws.counters, ws.slots, ws.status,
        *seg_args, recv_offset, ws.signal_offset, epoch, arena.rank, world, total, nprog, n, k,
        max(groups, 1), x.stride(0), x.stride(1), w.stride(0) if grouped else 0,
        w.stride(-2), w.stride(-1), budget,
        WORLD_P2=max(2, 1 << (world - 1).bit_length()), BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], SIGNAL=signal,
        FP32_IEEE=x.dtype == torch.float32, EVEN_N=n % cfg["BLOCK_N"] == 0,
        EVEN_K=k % cfg["BLOCK_K"] == 0, USE_TMA=use_tma,
        GROUPS_P2=(1 << groups.bit_length()) if grouped else 0, **launch)
    nbytes = plan.recv_rows * n * x.element_size()
    out = recv[:nbytes].view(x.dtype).view(plan.recv_rows, n).clone() if copy_out else None
    if signal:
        _launch_ack(arena, ws, epoch)
    if check and signal:
        check_status(ws, epoch, "gemm_all_to_all")
    return out


# ---------------------------------------------------------------------------------------
# HIP kernels (librocmoe): Embedding + All-to-All, GEMV + AllReduce
# ---------------------------------------------------------------------------------------

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native():
    from .._native import ffi, lib
    return ffi, lib


def _stream_ptr(ffi, device):
    if torch.device(device).type != "cuda":
        return ffi.NULL
    return ffi.cast("void *", torch.cuda.current_stream(device).cuda_stream)


def _fill_team(ffi, arena: Arena):
    team = ffi.new("rocmoe_gpu_team *")
    team.peer_bases = ffi.cast("const void *", arena.peer_bases.data_ptr())
    team.rank, team.world, team.ranks_per_node = arena.rank, arena.world, arena.ranks_per_node
    return team


def _fill_fused(ffi, arena: Arena, ws: Workspace, epoch: int, signal: bool, device):
    common = ffi.new("rocmoe_gpu_fused *")
    recv, _ = ws.buffer(epoch)
    common.epoch = epoch
    common.slots = ffi.cast("void *", ws.slots.data_ptr())
    common.recv = ffi.cast("void *", recv.data_ptr())
    common.stage = ffi.NULL  # every peer of an ipc / IPC-handle arena is load/store reachable
    common.counters = ffi.cast("void *", ws.counters.data_ptr())
    common.status = ffi.cast("int *", ws.status.data_ptr())
    common.workgroups = int(os.environ.get("ROCMOE_GPU_WORKGROUPS", "0"))
    common.signal_enabled = 1 if signal else 0
    common.timeout_s = arena.timeout_s
    common.stream = _stream_ptr(ffi, device)
    return common


def embedding_all_to_all(arena: Arena, weights: Sequence[torch.Tensor],
                         indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
                         mode: str = "sum",
                         per_sample_weights: Optional[Sequence[torch.Tensor]] = None, *,
                         batch: Optional[int] = None, signal: bool = True, check: bool = True,
                         layout: Optional[tuple] = None) -> torch.Tensor:
    """This rank's tables' bags over the global batch -> [B / world, T_total, D] here.

    `layout` = (table counts of every rank, D, B[, dtype]) when the caller already agreed on
    it (the public op does); otherwise it is all-gathered here."""
    from .._native import check as native_check
    ffi, lib = _native()
    world, rank = arena.world, arena.rank
    t_local = len(weights)
    if mode not in ("sum", "mean"):
        raise errors.InvalidArgumentError(f"embedding_all_to_all: mode must be 'sum' or 'mean', got {mode!r}")
    if per_sample_weights is not None and mode != "sum":
        raise errors.InvalidArgumentError("embedding_all_to_all: per_sample_weights needs mode='sum'")
    if len(indices) != t_local or len(offsets) != t_local:
        raise errors.InvalidArgumentError(
            f"embedding_all_to_all: {t_local} tables but {len(indices)} index and "
            f"{len(offsets)} offset tensors")
    dim = int(weights[0].shape[1]) if t_local else None
    dtype = weights[0].dtype if t_local else None
    b_local = int(offsets[0].numel()) if t_local else batch
    if layout is None:
        codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
        record = [t_local, -1 if dim is None else dim, -1 if b_local is None else int(b_local),
                  codes.get(dtype, -2) if dtype is not None else -1]
        table = arena.allgather(record, "embedding_all_to_all (agreeing on the layout)")
        dims = {d for _, d, _, _ in table if d >= 0}
        batches = {b for _, _, b, _ in table if b >= 0}
        dtypes = {t for _, _, _, t in table if t != -1}
        if len(dims) != 1 or len(batches) != 1 or len(dtypes) != 1 or -2 in dtypes:
            raise errors.InvalidArgumentError(
                "embedding_all_to_all: ranks disagree on D / global batch / dtype, or the dtype "
                f"is not float32/bfloat16/float16 (tables, D, batch, dtype code per rank: {table})")
        counts = [c for c, _, _, _ in table]
        dim, b_global = dims.pop(), batches.pop()
        dtype = {v: k for k, v in codes.items()}[dtypes.pop()]
    else:
        # (table counts per rank, D, B[, dtype]): a rank without tables learns the dtype here
        counts, dim, b_global = layout[:3]
        if dtype is None and len(layout) > 3:
            dtype = layout[3]
    if b_global % world:
        raise errors.InvalidArgumentError(
            f"embedding_all_to_all: global batch {b_global} is not a multiple of the world "
            f"size {world}")
    t_total = sum(counts)
    table_base = sum(counts[:rank])
    b_loc = b_global // world
    elt = torch.empty((), dtype=dtype).element_size()
    ws = arena.workspace("embedding_a2a")
    ws.ensure_recv(b_loc * t_total * dim * elt)
    epoch = ws.next_epoch(signal)  # (the native op clears the status words itself)
    dev = arena.device
    for tname, group in (("weights", weights), ("indices", indices), ("offsets", offsets)):
        for i, t in enumerate(group):
            if t.device != dev:
                raise errors.DeviceMismatchError(
                    f"embedding_all_to_all: {tname}[{i}] is on {t.device}, expected {dev}")
    # 16-byte vector loads need 16-byte aligned rows: realign a table that is an odd view
    wts = [t.contiguous() if t.contiguous().data_ptr() % 16 == 0 else t.contiguous().clone()
           for t in weights]
    idx = [t.contiguous().to(torch.int64) for t in indices]
    offs = [t.contiguous().to(torch.int64) for t in offsets]
    psw = ([t.contiguous().to(torch.float32) for t in per_sample_weights]
           if per_sample_weights is not None else None)
    # per-table pointer arrays live on the device: the kernel indexes them by table
    ptr_table = ws.device_ints(
        [t.data_ptr() for t in wts] + [t.data_ptr() for t in idx] + [t.data_ptr() for t in offs]
        + ([t.data_ptr() for t in psw] if psw else [0] * t_local)
        + [int(t.shape[0]) for t in wts] + [int(t.numel()) for t in idx] or [0], torch.int64)
    args = ffi.new("rocmoe_gpu_embedding_args *")
    args.team = _fill_team(ffi, arena)[0]
    args.fused = _fill_fused(ffi, arena, ws, epoch, signal, dev)[0]
    args.dtype = _DTYPES[dtype]
    args.mode = 0 if mode == "sum" else 1
    args.num_tables = t_local
    args.total_tables = t_total
    args.table_base = table_base
    args.batch = b_global
    args.dim = dim
    args.tables = ffi.cast("const int64_t *", ptr_table.data_ptr())
    args.has_per_sample_weights = 1 if psw else 0
    native_check(lib.rocmoe_gpu_embedding_a2a(args), "embedding_all_to_all (GPU)")
    recv, _ = ws.buffer(epoch)
    # receive layout: source s's block [B/world, T_s, D] at table offset sum(T_<s)
    flat = recv[:b_loc * t_total * dim * elt].view(dtype)
    parts = []
    start = 0
    for c in counts:
        parts.append(flat[start:start + b_loc * c * dim].view(b_loc, c, dim))
        start += b_loc * c * dim
    out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()
    if signal:
        _launch_ack(arena, ws, epoch)
    # wts / idx / offs copies made above may be freed now: the caching allocator hands
    # their memory only to work ordered after the kernel on this stream
    if check and signal:
        check_status(ws, epoch, "embedding_all_to_all")
    return out


def gemv_all_reduce(arena: Arena, w_local: torch.Tensor, x_local: torch.Tensor, *,
                    signal: bool = True, check: bool = True, agreed: bool = False) -> torch.Tensor:
    """y = sum over ranks of W_r @ x_r ([N], identical on every rank).

    Unless `agreed` (the caller already all-gathered N and the dtype), every rank's N and
    dtype are compared first (one timed host all-gather): a mismatch raises on every rank
    before anything is written to a peer."""
    from .._native import check as native_check
    ffi, lib = _native()
    problem = None
    if w_local.dim() != 2 or x_local.dim() != 1 or w_local.shape[1] != x_local.shape[0]:
        problem = errors.InvalidArgumentError(
            f"gemv_all_reduce: expected W [N, K_r] and x [K_r], got {tuple(w_local.shape)} and "
            f"{tuple(x_local.shape)}")
    elif w_local.dtype != x_local.dtype or w_local.dtype not in _DTYPES:
        problem = errors.DTypeError(
            f"gemv_all_reduce: W and x must share one of float32/bfloat16/float16, got "
            f"{w_local.dtype} and {x_local.dtype}")
    if not agreed and arena.world > 1:
        mine = [-1, -1] if problem else [int(w_local.shape[0]), _DTYPES[w_local.dtype]]
        table = arena.allgather(mine, "gemv_all_reduce (agreeing on N and dtype)")
        if problem is None and any(row != table[0] or row[0] < 0 for row in table):
            problem = errors.InvalidArgumentError(
                f"gemv_all_reduce: every rank must pass the same N and dtype (N, dtype code per "
                f"rank: {table})")
    if problem is not None:
        raise problem
    n, k = w_local.shape
    world = arena.world
    elt = w_local.element_size()
    ws = arena.workspace("gemv_allreduce")
    # receive space: fp32 partials from every source for this rank's chunk, then the
    # all-gathered result [N] in the op's dtype
    chunk_max = -(-n // world)
    rs_bytes = (world * chunk_max * 4 + ALIGN - 1) // ALIGN * ALIGN
    ws.ensure_recv(rs_bytes + n * elt)
    epoch = ws.next_epoch(signal)  # (the native op clears the status words itself)
    args = ffi.new("rocmoe_gpu_gemv_args *")
    args.team = _fill_team(ffi, arena)[0]
    args.fused = _fill_fused(ffi, arena, ws, epoch, signal, w_local.device)[0]
    args.dtype = _DTYPES[w_local.dtype]
    args.n, args.k = n, k
    wc, xc = w_local.contiguous(), x_local.contiguous()
    args.w = ffi.cast("const void *", wc.data_ptr())
    args.x = ffi.cast("const void *", xc.data_ptr())
    args.gather_offset = rs_bytes
    # the op waits for y, copies it into `out` and acknowledges the peers itself (one
    # launch, not wait + copy + ack: the launches were most of the signalling overhead)
    out = torch.empty(n, dtype=w_local.dtype, device=w_local.device)
    args.out = ffi.cast("void *", out.data_ptr())
    native_check(lib.rocmoe_gpu_gemv_allreduce(args), "gemv_all_reduce (GPU)")
    if check and signal:
        check_status(ws, epoch, "gemv_all_reduce")
    return out
