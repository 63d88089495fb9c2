"""Host-side control collectives with a timeout and mismatch detection.

Every collective the runtime itself needs (bootstrap, allocation, free, barrier) is one
and the same MPI operation: a non-blocking all-gather of a fixed-size record, polled until
ROCMOE_TIMEOUT_S. Because every rank always enters the *same* MPI call, ranks that disagree
(one allocates while another frees, or asks for other sizes) never deadlock inside MPI:
each rank sees every record and all of them raise the same error. A rank that never arrives
(dead, stuck, or in a different code path) turns into CommTimeoutError instead of a hang.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import numpy as np

from . import errors

RECORD_WORDS = 16
INT64_MAX = (1 << 63) - 1  # the largest value a record's word carries
# the values one Context.allgather_ints carries a rank: a record's words, less the exchange's
# two (kind, sequence) and the count
USER_INTS_MOST = RECORD_WORDS - 3
# record layout: [kind, seq, status, payload...]
KIND_BOOTSTRAP, KIND_ALLOC, KIND_FREE, KIND_BARRIER, KIND_USER, KIND_HANDLE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {KIND_BOOTSTRAP: "init", KIND_ALLOC: "empty/zeros", KIND_FREE: "free",
              KIND_BARRIER: "barrier", KIND_USER: "exchange", KIND_HANDLE: "fused-op handle"}

_broken_comms: list = []


def _abort_broken_jobs() -> None:
    # A control collective that timed out leaves an MPI request pending on this rank and
    # possibly a peer stuck forever; MPI_Finalize could then hang. End the job instead.
    if _broken_comms:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _broken_comms[0].Abort(3)
        finally:
            os._exit(3)


atexit.register(_abort_broken_jobs)


def abort_job_at_exit(comm) -> None:
    """A collective on `comm` timed out: end the whole job (MPI Abort) when this process
    exits, instead of letting MPI_Finalize wait for the peer that never came."""
    _broken_comms.append(comm)


class SingleProcessComm:
    """Stands in for an MPI communicator when one process runs without mpiexec."""

    rank = 0
    size = 1

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Abort(self, code=1):  # noqa: N802 - mirrors mpi4py
        os._exit(code)


class ControlChannel:
    """Timed all-gathers of fixed-size int64 records over an mpi4py communicator."""

    def __init__(self, comm, timeout_s: float):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = float(timeout_s)
        self.seq = 0
        self.broken = False

    def allgather(self, record: np.ndarray, what: str) -> np.ndarray:
        """All-gather `record` (1-D int64) from every rank; returns [world, len]."""
        if self.broken:
            raise errors.ContextError(
                "an earlier control collective of this context timed out; the context can no "
                "longer be used (the job aborts at exit)")
        record = np.ascontiguousarray(record, dtype=np.int64)
        out = np.empty((self.size, record.size), dtype=np.int64)
        if self.size == 1:
            out[0] = record
            return out
        request = self.comm.Iallgather(record, out)
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                self.broken = True
                abort_job_at_exit(self.comm)
                raise errors.CommTimeoutError(
                    f"rank {self.rank}: {what} did not complete within {self.timeout_s:g} s: at "
                    f"least one of the {self.size} ranks never joined (dead, stuck, or taking a "
                    "different code path); raise ROCMOE_TIMEOUT_S if it is only slow")
            # spin first (collectives are usually quick), then back off to 1 ms
            time.sleep(pause)
            pause = min(pause * 2 + 1e-5, 1e-3)
        return out

    def exchange(self, kind: int, payload, what: str,
                 mismatch_error=errors.CollectiveMismatchError) -> np.ndarray:
        """Tag `payload` with (kind, seq), all-gather it, and raise CollectiveMismatchError on
        every rank when the ranks entered different collectives. Returns [world, payload]."""
        payload = list(payload)
        if len(payload) > RECORD_WORDS - 2:
            raise errors.InvalidArgumentError(f"control payload of {len(payload)} words is too long")
        record = np.zeros(RECORD_WORDS, dtype=np.int64)
        record[0], record[1] = kind, self.seq
        record[2:2 + len(payload)] = payload
        table = self.allgather(record, what)
        self.seq += 1  # every rank advances: state stays consistent after a mismatch too
        kinds, seqs = table[:, 0], table[:, 1]
        if (kinds != kind).any() or (seqs != seqs[0]).any():
            calls = ", ".join(f"rank {r}: {KIND_NAMES.get(int(k), k)} #{int(s)}"
                              for r, (k, s) in enumerate(zip(kinds, seqs)))
            raise mismatch_error(
                f"ranks entered different collectives ({calls}); every rank must make the same "
                "rocmoe calls in the same order")
        return table[:, 2:2 + len(payload)]
