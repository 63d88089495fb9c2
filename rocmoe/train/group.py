"""The ranks of a training run: bounded host collectives over MPI for the training loop.

The loop needs a few collectives of its own beside the fused ops: the data-parallel
gradient all-reduce, the per-step metrics, the "did any rank get a stop signal" vote and the
checkpoint agreement. They run on a duplicate of the job's communicator, so they can never
be matched against the runtime's own control collectives, and every one is non-blocking
MPI polled against a deadline (ROCMOE_TIMEOUT_S): a rank that dies or takes another code
path turns into CommTimeoutError on the others instead of a hang.

One process started without an MPI launcher needs neither MPI nor mpi4py: every collective
is then the identity. That is also how a single-GPU run works on a machine without mpi4py.
"""

from __future__ import annotations

import time

import numpy as np

from ..collective import abort_job_at_exit
from ..env import checked_seconds, launched_by_mpi, timeout_from_env
from ..errors import CommTimeoutError, ContextError, InvalidArgumentError


class ProcessGroup:
    """rank, world_size and bounded collectives over an mpi4py communicator (or none)."""

    def __init__(self, comm=None, timeout_s: float | None = None):
        self.timeout_s = (timeout_from_env() if timeout_s is None
                          else checked_seconds(timeout_s, "ProcessGroup timeout_s"))
        if comm is None or comm.Get_size() == 1:
            self.comm = None
            self.rank, self.world_size = 0, 1
        else:
            self.comm = comm.Dup()  # our own matching space: never crosses the runtime's
            self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.broken = False

    @classmethod
    def of_context(cls, ctx) -> "ProcessGroup":
        """The ranks of a rocmoe Context (its communicator, its timeout)."""
        comm = getattr(ctx, "comm", None)
        has_mpi = comm is not None and hasattr(comm, "Dup")
        return cls(comm if has_mpi else None, getattr(ctx, "timeout_s", None))

    @classmethod
    def world(cls) -> "ProcessGroup":
        """mpi4py's COMM_WORLD when started by a launcher, else a group of one process."""
        if not launched_by_mpi():
            return cls(None)
        from mpi4py import MPI
        return cls(MPI.COMM_WORLD)

    # -- collectives -------------------------------------------------------------------
    def _wait(self, request, what: str) -> None:
        if self.broken:
            raise ContextError("an earlier collective of this process group timed out; the "
                               "group can no longer be used (the job aborts at exit)")
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                self.broken = True
                abort_job_at_exit(self.comm)  # the pending request would hang MPI_Finalize
                raise CommTimeoutError(
                    f"rank {self.rank}: {what} did not complete within {self.timeout_s:g} s: "
                    f"at least one of the {self.world_size} ranks never joined (dead, stuck, "
                    "or on another code path); raise ROCMOE_TIMEOUT_S if it is only slow")
            time.sleep(pause)
            pause = min(pause * 2 + 1e-5, 1e-3)

    def allreduce_(self, array: np.ndarray, what: str, op: str = "sum") -> np.ndarray:
        """In place over every rank (`op`: sum or max); `array` must be contiguous."""
        if self.comm is None:
            return array
        from mpi4py import MPI
        if not array.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: allreduce_ needs a contiguous array")
        mpi_op = {"sum": MPI.SUM, "max": MPI.MAX}[op]
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=mpi_op), what)
        return array

    def allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """[world, *array.shape]: every rank's `array` (same shape and dtype on all ranks)."""
        array = np.ascontiguousarray(array)
        out = np.empty((self.world_size,) + array.shape, dtype=array.dtype)
        if self.comm is None:
            out[0] = array
            return out
        self._wait(self.comm.Iallgather(array, out), what)
        return out

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank when `flag` is true on at least one."""
        return bool(self.allreduce_(np.array([int(bool(flag))], np.int64), what, "max")[0])

    def raise_together(self, problem: Exception | None, what: str, failed: str,
                       error: type = ContextError) -> None:
        """Collective: when any rank has a `problem`, every rank raises `error`: `failed`,
        the ranks that failed and, on such a rank, its own problem. What one rank alone
        finds wrong (a file it cannot read, a shard it cannot write) then stops every rank
        at once, instead of leaving the others in their next collective until it times out."""
        flags = self.allgather(np.array([int(problem is not None)], np.int64), what)[:, 0]
        if flags.any():
            ranks = [r for r in range(self.world_size) if flags[r]]
            raise error(f"{failed} (ranks {ranks} failed"
                        + (f"; here: {problem}" if problem is not None else "") + ")")

    def same_everywhere(self, values, names, what: str, failed: str, error: type = ContextError,
                        hint: str = "") -> None:
        """Collective: when the ranks' integer `values` (one a name of `names`) differ, every
        rank raises `error`: `failed`, each rank's values, then `hint`."""
        seen = self.allgather(np.array([int(v) for v in values], np.int64), what)
        if (seen != seen[0]).any():
            per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{v} {n}" for v, n in zip(row, names))
                                 for r, row in enumerate(seen.tolist()))
            raise error(f"{failed} ({per_rank})" + (f": {hint}" if hint else ""))

    def barrier(self, what: str = "barrier") -> None:
        if self.comm is not None:
            self._wait(self.comm.Ibarrier(), what)

    def close(self) -> None:
        if self.comm is not None and not self.broken:
            self.comm.Free()
        self.comm = None
