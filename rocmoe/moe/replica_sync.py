"""Gradient sync of replicated experts: each expert's gradient summed over the ranks holding it.

Replicas of an expert on several ranks each see only their share of its tokens; summing
their gradients gives every copy the gradient of all the expert's tokens, the same maths
as one copy without replicas, so the copies stay identical under the same optimizer step.
A step's work is a list of :class:`ReplicaGroup` (the same list, in the same order, on every
rank: every rank knows the whole placement); a reducer sums each group's buffers in place.

* :class:`HeapReplicaReducer`: through the symmetric heap, on the device. Each
  rank stages its groups' buffers in its own *outbox* on the heap and raises a ``ready``
  signal at every rank it shares a group with; each member then reads the other members'
  slices (``ctx.get``: a device-to-device copy inside a node) and adds them in ascending
  rank order, so every member computes the same sum bit for bit; a ``done`` signal tells the
  owner its outbox may be overwritten at the next step. At most ROCMOE_REPLICA_SUM_BYTES of
  outbox: more goes in rounds. One host sync a round (the staged buffers must be in memory
  before the ``ready`` signal); no host copy of the gradients. A home-made all-reduce, used
  where no library one runs.
* :class:`TorchDistReducer`: ``torch.distributed.all_reduce`` on the buffers where they are
  (NCCL on GPUs, gloo on CPUs: the process group the user initialized), one subgroup per set
  of member ranks (``new_group``, cached LRU); with NCCL nothing waits on the host.
* :class:`MpiReplicaReducer`: mpi4py ``Iallreduce`` (SUM) on host buffers, one
  sub-communicator per group (``Comm.Create_group``, cached LRU by (layer, expert, member
  ranks)), polled with a deadline. GPU gradients are staged through host memory: one
  device-to-host and one host-to-device copy per replicated expert and step. On an H200
  (2 ranks sharing it) an expert of 1024 x 4096 (w1 + w2, fp32) took 25 ms this way, so the
  cost model rightly refused every replica (2026-12-02); through the heap it moves at the
  transport's copy rate.

Sums are taken in float32 for float32/bfloat16/float16 gradients (rounded once on the way
back) and in float64 for float64.

``replica_sync="auto"`` (the scheduler's default, :func:`auto_reducer`) uses the libraries'
all-reduce where there is one: torch.distributed when the user initialized it for these
ranks (NCCL for GPU layers, gloo for CPU ones), else MPI for CPU layers; GPU layers without
a process group (e.g. ranks sharing one GPU, which NCCL refuses) sum through the heap.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..errors import CommTimeoutError, ConfigurationError


class GroupCache:
    """LRU cache of sub-communicators, one per (group key, member ranks)."""

    def __init__(self, comm, capacity: int = 64):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.capacity = int(capacity)
        self._entries: "OrderedDict[tuple, object]" = OrderedDict()
        self.created = 0
        self._serial = 0

    def communicators(self, groups: list[tuple[tuple, tuple]], barrier=None) -> dict:
        """The communicators of `groups` (each (key, member ranks); the same list on every
        rank, in the same order, which is the order of creation). Returns {key: comm} for
        the groups this rank belongs to. `barrier` (a timed collective) runs before any
        creation, so that a missing rank raises instead of leaving the members blocked in
        Create_group."""
        entries = [(key, tuple(members)) for key, members in groups]
        new = [e for e in entries if e not in self._entries]
        if new and barrier is not None:
            barrier()
        for entry in new:
            ranks = entry[1]
            comm = None
            self._serial += 1   # the same on every rank (every rank sees every new group)
            if self.rank in ranks:
                group = self.comm.Get_group().Incl(list(ranks))
                comm = self.comm.Create_group(group, tag=self._serial & 0x7FFF)
                group.Free()
                self.created += 1
            self._entries[entry] = comm
        for entry in entries:
            self._entries.move_to_end(entry)
        while len(self._entries) > max(self.capacity, len(entries)):
            _, comm = self._entries.popitem(last=False)
            if comm is not None:
                comm.Free()
        return {e[0]: self._entries[e] for e in entries if self._entries[e] is not None}

    def close(self) -> None:
        while self._entries:
            _, comm = self._entries.popitem(last=False)
            if comm is not None:
                comm.Free()


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


class ReplicaGroup(NamedTuple):
    """One replicated expert's sum: `key` names it (the MPI reducer caches a communicator per
    key), `members` are its ranks in ascending order, `numel` and `dtype` the buffer's (every
    rank knows them, also the ranks outside the group: they size the heap alike)."""
    key: tuple
    members: tuple
    numel: int
    dtype: torch.dtype = torch.float32


class MpiReplicaReducer:
    """Sums over MPI sub-communicators, on host buffers (see the module's docstring)."""

    name = "mpi"

    def __init__(self, ctx, timeout_s: float, cache_size: int = 64):
        self.ctx = ctx
        self.timeout_s = float(timeout_s)
        self.groups = GroupCache(ctx.comm, cache_size)

    def sum_(self, groups: list[ReplicaGroup], mine: dict) -> None:
        """Collective (every rank, the same `groups`): mine[key] (this rank's buffer of each
        group it belongs to) becomes the sum over the group's members."""
        if not groups:
            return
        comms = self.groups.communicators([(g.key, g.members) for g in groups],
                                          barrier=self.ctx.barrier)
        staged = [(g.key, mine[g.key].detach().to("cpu").numpy().copy())
                  for g in groups if g.key in mine]
        allreduce_sum([(comms[key], buf) for key, buf in staged if key in comms],
                      self.timeout_s)
        for key, buf in staged:
            mine[key].copy_(torch.from_numpy(buf))

    def close(self) -> None:
        self.groups.close()


class HeapReplicaReducer:
    """Sums through the symmetric heap (see the module's docstring). Collective methods:
    every rank calls them in the same order with the same groups.

    The outbox holds at most `max_bytes` (default ROCMOE_REPLICA_SUM_BYTES, 256 MiB): a
    step whose groups need more is summed in rounds, a group larger than that in pieces,
    so the heap it takes is bounded whatever the model's experts weigh."""

    name = "heap"
    ALIGN = 256   # bytes: every piece starts on the heap's alignment
    DEFAULT_MAX_BYTES = 256 << 20

    def __init__(self, ctx, timeout_s: float, max_bytes: Optional[int] = None):
        self.ctx = ctx
        self.timeout_s = float(timeout_s)
        self.rank, self.world = int(ctx.rank), int(ctx.world_size)
        if max_bytes is None:
            max_bytes = int(os.environ.get("ROCMOE_REPLICA_SUM_BYTES", self.DEFAULT_MAX_BYTES))
        if max_bytes < self.ALIGN:
            raise ConfigurationError(f"the replica sums' outbox needs at least {self.ALIGN} "
                                     f"bytes, got {max_bytes} (ROCMOE_REPLICA_SUM_BYTES)")
        self.max_bytes = int(max_bytes) // self.ALIGN * self.ALIGN
        self.epoch = 0
        self.rounds = 0        # rounds summed so far (a step takes one or more)
        self._outbox = None    # symmetric uint8 [capacity]: this rank's staged pieces
        self._signals = None   # symmetric int64 [2, world]: ready[src], done[reader]
        self._capacity = 0
        self._readers: tuple = ()   # the ranks that read this rank's outbox last epoch

    def _rounds(self, groups: list[ReplicaGroup]) -> list[list[tuple]]:
        """The step's pieces, (group index, first element, elements), cut to fit the outbox,
        in rounds whose pieces fit every member's outbox together (the same on every rank)."""
        rounds, current, used = [], [], [0] * self.world
        for i, g in enumerate(groups):
            itemsize = _itemsize(g.dtype)
            step = max(self.max_bytes // itemsize, 1)
            for start in range(0, g.numel, step):
                n = min(step, g.numel - start)
                nbytes = -(-n * itemsize // self.ALIGN) * self.ALIGN
                if current and any(used[r] + nbytes > self.max_bytes for r in g.members):
                    rounds.append(current)
                    current, used = [], [0] * self.world
                current.append((i, start, n))
                for r in g.members:
                    used[r] += nbytes
        if current:
            rounds.append(current)
        return rounds

    def _layout(self, groups, pieces) -> tuple[dict, int]:
        """{(piece index, rank): byte offset in that rank's outbox}, and the largest outbox."""
        used = [0] * self.world
        offsets = {}
        for j, (i, _, n) in enumerate(pieces):
            itemsize = _itemsize(groups[i].dtype)
            for r in groups[i].members:
                offsets[(j, r)] = used[r]
                used[r] += -(-n * itemsize // self.ALIGN) * self.ALIGN
        return offsets, max(used)

    def _ensure(self, capacity: int) -> None:
        """Collective: an outbox of at least `capacity` bytes (every rank asks the same)."""
        if self._signals is None:
            self._signals = self.ctx.zeros((2, self.world), torch.int64)
        if capacity <= self._capacity:
            return
        self._wait_readers()   # nobody may still be reading the outbox that goes away
        if self._outbox is not None:
            self.ctx.free(self._outbox)
            self._outbox, self._capacity = None, 0
        self._outbox = self.ctx.empty((capacity,), torch.uint8)
        self._capacity = capacity

    def _wait_readers(self) -> None:
        for q in self._readers:
            self.ctx.wait_until(self._signals, self.world + q, self.epoch, ">=",
                                timeout_s=self.timeout_s, peer=q)
        self._readers = ()

    def sum_(self, groups: list[ReplicaGroup], mine: dict) -> None:
        """Collective (every rank, the same `groups`): mine[key] (this rank's buffer of each
        group it belongs to, of the group's dtype) becomes the sum over the group's members,
        added in member order."""
        for g in groups:
            if self.rank not in g.members:
                continue
            buf = mine[g.key]
            if buf.dtype != g.dtype or buf.numel() != g.numel or not buf.is_contiguous():
                raise ConfigurationError(
                    f"replica sum {g.key}: this rank's buffer ({buf.dtype}, {buf.numel()} "
                    f"elements{'' if buf.is_contiguous() else ', not contiguous'}) is not the "
                    f"group's ({g.dtype}, {g.numel} elements, contiguous)")
        for pieces in self._rounds(groups):
            self._sum_round(groups, pieces, mine)

    def _sum_round(self, groups, pieces, mine) -> None:
        offsets, capacity = self._layout(groups, pieces)
        self._ensure(capacity)
        self._wait_readers()
        self.epoch += 1
        self.rounds += 1
        me = self.rank
        box = self._outbox

        def view(j, r):
            i, _, n = pieces[j]
            dtype = groups[i].dtype
            offset = offsets[(j, r)]
            return box[offset:offset + n * _itemsize(dtype)].view(dtype)

        def own(j):
            i, start, n = pieces[j]
            return mine[groups[i].key].reshape(-1)[start:start + n]
        peers = set()
        with torch.no_grad():
            for j, (i, _, _) in enumerate(pieces):
                if me in groups[i].members:
                    view(j, me).copy_(own(j))
                    peers.update(r for r in groups[i].members if r != me)
        if box.is_cuda:   # staged in memory before a peer may read it
            torch.cuda.current_stream(box.device).synchronize()
        for q in sorted(peers):
            self.ctx.signal_set(self._signals, me, self.epoch, q)
        for q in sorted(peers):
            self.ctx.wait_until(self._signals, q, self.epoch, ">=", timeout_s=self.timeout_s,
                                peer=q)
        with torch.no_grad():
            for j, (i, _, n) in enumerate(pieces):
                g = groups[i]
                if me not in g.members:
                    continue
                total = None
                for r in g.members:   # ascending: every member adds in the same order
                    if r == me:
                        part = view(j, me)
                    else:
                        part = torch.empty(n, dtype=g.dtype, device=box.device)
                        self.ctx.get(part, view(j, r), r)
                    total = part.clone() if total is None else total.add_(part)
                own(j).copy_(total)
        for q in sorted(peers):
            self.ctx.signal_set(self._signals, self.world + me, self.epoch, q)
        self._readers = tuple(sorted(peers))

    def close(self) -> None:
        """Collective: release the outbox and signals (after the last readers are done)."""
        if self._signals is not None:
            self._wait_readers()
            self.ctx.barrier()   # every rank's reads of every outbox are finished
        for t in (self._outbox, self._signals):
            if t is not None:
                self.ctx.free(t)
        self._outbox = self._signals = None
        self._capacity = 0


class TorchDistReducer:
    """Sums with torch.distributed's all-reduce on the user's process group (see the module's
    docstring): a subgroup per set of member ranks, created collectively in the step's group
    order and cached LRU. Gloo waits are bounded by `timeout_s` (CommTimeoutError); NCCL's
    are the stream's, bounded by the process group's own timeout."""

    name = "torch"

    def __init__(self, ctx, timeout_s: float, cache_size: int = 64):
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError("replica_sync='torch' needs torch.distributed initialized "
                                     "(torch.distributed.init_process_group) on every rank")
        if dist.get_world_size() != int(ctx.world_size) or dist.get_rank() != int(ctx.rank):
            raise ConfigurationError(
                f"replica_sync='torch': the process group's rank {dist.get_rank()} of "
                f"{dist.get_world_size()} is not the rocmoe Context's rank {ctx.rank} of "
                f"{ctx.world_size}")
        self.ctx = ctx
        self.dist = dist
        self.timeout_s = float(timeout_s)
        self.capacity = int(cache_size)
        self.rank = int(ctx.rank)
        self._groups: "OrderedDict[tuple, object]" = OrderedDict()
        self.created = 0

    def _subgroups(self, member_sets: list[tuple]) -> None:
        """Collective: a subgroup for each member set (the same list on every rank)."""
        for members in member_sets:
            if members not in self._groups:
                # new_group is collective over the whole process group, members or not
                self._groups[members] = self.dist.new_group(list(members))
                self.created += 1
            self._groups.move_to_end(members)
        while len(self._groups) > max(self.capacity, len(member_sets)):
            members, group = self._groups.popitem(last=False)
            if self.rank in members:
                self.dist.destroy_process_group(group)

    def sum_(self, groups: list[ReplicaGroup], mine: dict) -> None:
        """Collective (every rank, the same `groups`): mine[key] becomes the sum over the
        group's members (in place, on its device)."""
        if not groups:
            return
        from datetime import timedelta
        self._subgroups(list(dict.fromkeys(g.members for g in groups)))
        works = [self.dist.all_reduce(mine[g.key], op=self.dist.ReduceOp.SUM,
                                      group=self._groups[g.members], async_op=True)
                 for g in groups if self.rank in g.members]
        for work in works:
            if self.dist.get_backend() == "nccl":
                work.wait()   # the current stream waits, the host does not
                continue
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise CommTimeoutError(
                    f"replica gradient sum: a torch.distributed all-reduce did not complete "
                    f"within {self.timeout_s:g} s (a rank holding a replica never joined): "
                    f"{exc}") from exc

    def close(self) -> None:
        while self._groups:
            members, group = self._groups.popitem(last=False)
            if self.rank in members:
                self.dist.destroy_process_group(group)


def auto_reducer(ctx, device) -> str:
    """The reducer "auto" means for layers on `device` (see the module's docstring)."""
    import torch.distributed as dist
    device = torch.device(device)
    if dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() == int(ctx.world_size) \
            and dist.get_rank() == int(ctx.rank):
        backend = str(dist.get_backend())
        if (device.type == "cuda" and backend == "nccl") or \
                (device.type == "cpu" and backend == "gloo"):
            return "torch"
    return "mpi" if device.type == "cpu" else "heap"


REDUCERS = {"heap": HeapReplicaReducer, "mpi": MpiReplicaReducer, "torch": TorchDistReducer}


__all__ = ["GroupCache", "allreduce_sum", "reduce_dtype", "ReplicaGroup",
           "HeapReplicaReducer", "MpiReplicaReducer", "TorchDistReducer", "REDUCERS",
           "auto_reducer"]
