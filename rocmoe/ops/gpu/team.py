"""What a context's kernels share: the peer table and the remote-first slice order (a
mirror of hip/include/rocmoe/schedule.h; tests compare the two), the wait budgets of the
kernels' bounded waits, the device clock's constexpr and the device copies of small
integer lists.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch

from ..._triton import interpreting as _interpreting
from ...env import first_call_timeout_from_env
from .triton_launcher import _PLATFORM


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


class Team:
    """Every rank's heap base as this process sees it (a device int64 tensor) and this
    rank's remote-first slice order; made once per context."""

    def __init__(self, ctx):
        from ..._native import check, ffi, lib
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
    from .. import triton_gemm_a2a as tk
    return tk.device_clock(_PLATFORM, _interpreting())


class DeviceInts:
    """Device int64 tensors of host lists, cached (most recent last): a fresh copy from
    pageable memory would synchronise; a new list goes through pinned memory without one."""

    def __init__(self, device: torch.device, keep: int = 32):
        self.device, self.keep, self._cache = device, keep, {}
        self._last_values: Optional[list] = None  # of_ints: the last list and its tensor
        self._last: Optional[torch.Tensor] = None

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

    def of_ints(self, values: list) -> torch.Tensor:
        """The same as a call, for a list of plain ints (the caller checked): a list equal
        to the last one's gets the last tensor at once, without the key's tuple or the
        cache's reordering (the lean GEMM call's counts, before its launch: 1.4 us of the
        H100 host's 6.9 of pre-launch work with the lookup,
        results/probe_prelaunch_h100_thirtyfirst_session.jsonl). The tensors are never
        written, so one that left the cache since is still right."""
        if values == self._last_values:
            return self._last
        t = self(values)
        self._last_values, self._last = list(values), t
        return t


def _device_ints(handle) -> DeviceInts:
    ints = getattr(handle, "_device_ints", None)
    if ints is None:
        ints = handle._device_ints = DeviceInts(handle.ctx.device)
    return ints
