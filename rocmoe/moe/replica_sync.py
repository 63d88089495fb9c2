"""Gradient sync of replicated experts: one MPI sub-communicator per logical expert's copies.

Replicas of an expert on several ranks each see only their share of its tokens; summing
their gradients gives every copy the gradient of all the expert's tokens, the same maths
as one copy without replicas, so the copies stay identical under the same optimizer step.

Groups are keyed by (layer, logical expert id, member ranks), so a group keeps its
communicator while the expert's replicas stay on the same ranks, whatever slots they
move between. Communicators are created with ``Comm.Create_group`` (collective over the
members only) in one global order, and cached LRU. Every rank updates the cache for every
group of a step, also those it is not a member of (it knows the whole placement), so all
members evict a communicator at the same call and free it together.

The sums are MPI ``Iallreduce`` (SUM) on host buffers, polled with a deadline: float32 for
float32/bfloat16/float16 gradients (bf16 has no MPI type; the sum is taken in fp32 and
rounded once), float64 for float64. GPU gradients are staged through host memory: one
device-to-host and one host-to-device copy per replicated expert and step, and a host sync.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from ..errors import CommTimeoutError


class GroupCache:
    """LRU cache of sub-communicators, keyed by (layer key, expert, ranks)."""

    def __init__(self, comm, capacity: int = 64):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.capacity = int(capacity)
        self._entries: "OrderedDict[tuple, object]" = OrderedDict()
        self.created = 0

    def communicators(self, keys: list[tuple], barrier=None) -> dict:
        """The communicators of `keys` (each (layer, expert, ranks); the same list on every
        rank, in the same order). Returns {key: comm} for the keys this rank belongs to.
        `barrier` (a timed collective) runs before any creation, so that a missing rank
        raises instead of leaving the members blocked in Create_group."""
        new = [k for k in keys if k not in self._entries]
        if new and barrier is not None:
            barrier()
        for key in sorted(new, key=lambda k: (k[0], k[1], k[2])):
            ranks = key[2]
            comm = None
            if self.rank in ranks:
                group = self.comm.Get_group().Incl(list(ranks))
                comm = self.comm.Create_group(group, tag=(hash(key) & 0x7FFF))
                group.Free()
                self.created += 1
            self._entries[key] = comm
        for key in keys:
            self._entries.move_to_end(key)
        while len(self._entries) > max(self.capacity, len(keys)):
            _, comm = self._entries.popitem(last=False)
            if comm is not None:
                comm.Free()
        return {k: self._entries[k] for k in keys if self._entries[k] is not None}

    def close(self) -> None:
        while self._entries:
            _, comm = self._entries.popitem(last=False)
            if comm is not None:
                comm.Free()


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def allreduce_sum(buffers: list[tuple[object, np.ndarray]], timeout_s: float,
                  what: str = "replica gradient sync") -> None:
    """In-place SUM of each numpy buffer over its communicator; all outstanding at once,
    completed within `timeout_s` or CommTimeoutError."""
    from mpi4py import MPI
    requests = [comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM) for comm, buf in buffers]
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"{what}: {len(requests)} all-reduces did not complete within {timeout_s:g} s "
                f"(a rank holding a replica never joined); raise ROCMOE_TIMEOUT_S if it is "
                f"only slow")
        time.sleep(pause)
        pause = min(pause * 2 + 1e-5, 1e-3)


def pack(tensors: list[Optional[torch.Tensor]], numels: list[int], dtype: torch.dtype
         ) -> np.ndarray:
    """One contiguous host buffer of the tensors (None: zeros of that size)."""
    parts = [torch.zeros(n, dtype=dtype) if t is None else
             t.detach().reshape(-1).to("cpu", dtype) for t, n in zip(tensors, numels)]
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def unpack(buffer: np.ndarray, targets: list[torch.Tensor]) -> None:
    flat = torch.from_numpy(buffer)
    start = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[start:start + n].view(t.shape).to(t.device, t.dtype))
        start += n


__all__ = ["GroupCache", "allreduce_sum", "pack", "unpack", "reduce_dtype"]
