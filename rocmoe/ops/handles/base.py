"""What every fused-op handle shares (FusedHandle): creation agreed across the ranks, the
symmetric workspace at its upper bound, the epoch, the status words read without a copy,
the abort of a call this rank rejects, the output ring.
"""

from __future__ import annotations

import operator
import os
from typing import Optional

import numpy as np
import torch

from ... import errors
from ..._native import check, ffi, lib
from ...collective import KIND_HANDLE
from .._common import DTYPE_CODES, resolve_context
from ..layout import Layout, OP_CODES, make_layout
from ..outputs import OutputRing, capturing


_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


# status values (ROCMOE_STATUS_* of rocmoe.h)
_TIMEOUT = lib.ROCMOE_STATUS_TIMEOUT


_PEER_TEXT = {
    lib.ROCMOE_STATUS_PEER_ABORTED: "rejected its input (see the error there) and sent nothing",
    lib.ROCMOE_STATUS_PEER_BAD_INPUT: "found bad input on its device (an index out of range, "
                                      "or counts that exceed its rows) and sent nothing",
    lib.ROCMOE_STATUS_BAD_COUNT: "sent a count above the handle's capacity",
    lib.ROCMOE_STATUS_MISMATCH: "called with a different global batch than this rank",
}


# An empty leaf that requires grad: passed to every handle call made with grad enabled, so
# every rank records the op's (collective) backward, also a rank whose own inputs need none.
_GRAD_ANCHORS: dict = {}


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _GRAD_ANCHORS.get(device)
    if anchor is None:
        anchor = _GRAD_ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return anchor


def _on_gpu(ctx) -> bool:
    return ctx.backend != "host"


def _cuda_index(ctx) -> int:
    """The index of the CUDA device the handle's kernels run on (what Tensor.get_device()
    returns for its tensors); -1 where they do not run on CUDA (a fast-path check then
    never matches)."""
    device = ctx.device
    if not _on_gpu(ctx) or device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def host_mode(op: str) -> str:
    """How the host backend's persistent kernel gets its local results: "torch" (torch
    computes the lookups / W x / X W first; the kernel moves slices, reduces and signals) or
    "kernel" (the worker threads compute them too). ROCMOE_HOST_EMBEDDING, ROCMOE_HOST_GEMV,
    ROCMOE_HOST_GEMM; default "torch"."""
    var = {"embedding": "ROCMOE_HOST_EMBEDDING", "gemv": "ROCMOE_HOST_GEMV",
           "gemm": "ROCMOE_HOST_GEMM"}[op]
    mode = os.environ.get(var, "torch").strip().lower()
    if mode not in ("kernel", "torch"):
        raise errors.ConfigurationError(f"{var}={mode!r}: use 'kernel' or 'torch'")
    return mode


class FusedHandle:
    """What every handle shares: the collective creation, the workspace, the status words,
    the epoch, abort, `synchronize()` and `close()`."""

    op = ""

    def __init__(self, ctx, fields: dict, problem: Optional[Exception],
                 sizes: tuple, dtype: torch.dtype):
        """Collective. `fields`: name -> int that must be equal on every rank (what shapes the
        symmetric workspace); `problem`: this rank's own objection to its arguments (every
        rank then raises); `sizes`: rocmoe_workspace_layout_init's (a, b, c)."""
        self.ctx = ctx = resolve_context(ctx)
        self.rank, self.world = ctx.rank, ctx.world_size
        self.epoch = 0              # calls made (the device keeps its own count on GPUs)
        self.broken: Optional[str] = None
        self.workspace = None
        self.dtype = dtype
        names = list(fields)
        record = [OP_CODES[self.op], int(problem is None)] + [int(fields[k]) for k in names]
        table = ctx.channel.exchange(KIND_HANDLE, record, f"{type(self).__name__} creation",
                                     mismatch_error=errors.CollectiveMismatchError)
        if (table[:, 0] != table[0, 0]).any():
            raise errors.CollectiveMismatchError(
                f"{type(self).__name__}: ranks are creating different handles (op codes "
                f"{table[:, 0].tolist()}); create the same handles in the same order")
        if problem is not None:
            raise problem
        bad = [r for r in range(self.world) if not table[r, 1]]
        if bad:
            raise errors.InvalidArgumentError(
                f"{type(self).__name__}: rank(s) {bad} rejected their arguments (see their "
                "errors); no handle was created")
        for i, name in enumerate(names):
            column = table[:, 2 + i]
            if (column != column[0]).any():
                got = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
                raise errors.InvalidArgumentError(
                    f"{type(self).__name__}: ranks disagree on {name} ({got}); it must be the "
                    "same on every rank")
        self.layout: Layout = make_layout(self.op, self.world, DTYPE_CODES[dtype], *sizes)
        # collective and checked (HeapExhaustedError on every rank when one has no room);
        # zeroed with a barrier, so no peer signals into slots not yet cleared
        self.workspace = ctx.zeros((self.layout.total_bytes,), torch.uint8)
        self.workspace_offset = ctx.heap.offset_of(self.workspace)
        # status words: host memory; pinned (so device-accessible) when kernels write them
        pin = _on_gpu(ctx) and torch.cuda.is_available()
        self._status_t = torch.zeros(self.layout.status_words, dtype=torch.int32,
                                     pin_memory=pin)
        self._status = self._status_t.numpy()
        # what the status words read as bytes when nothing is recorded: a call compares
        # status.tobytes() with it (a twentieth of numpy's any() on an H200's host)
        self._status_clear = bytes(self._status.nbytes)
        self.status_address = self._status_t.data_ptr()
        self._outputs: dict = {}  # name -> OutputRing of the handle's no-grad GPU calls
        self._recv_counts_host = np.zeros(self.world, dtype=np.int64)
        ctx.register_handle(self)

    # -- errors ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise what the device recorded so far (non-blocking: no copy, no sync)."""
        if self.broken is not None:
            raise errors.ContextError(
                f"{type(self).__name__} is unusable after an earlier failure ({self.broken}); "
                "create a new handle")
        if self.workspace is None:
            raise errors.ContextError(f"{type(self).__name__} was closed")
        if self.ctx.finalized:
            raise errors.ContextError(f"{type(self).__name__}: its context was finalized; "
                                      "make the context and the handle again")
        status = self._status
        if status.tobytes() != self._status_clear:
            exc = self._status_error(status.copy())
            status[:] = 0
            raise exc

    def _clean(self) -> bool:
        """What check() passes, by cheap reads alone (the fast paths of the calls): not
        broken, not closed, the context live and nothing recorded in the status words."""
        return (self.broken is None and self._status.tobytes() == self._status_clear
                and self.workspace is not None and not self.ctx.finalized)

    def _status_error(self, status: np.ndarray) -> Exception:
        w, name = self.world, type(self).__name__
        epoch = int(status[self.layout.status_epoch()])
        call = f"call {epoch}" if epoch else "a recent call"
        if status[self.layout.status_own()]:
            return errors.InvalidArgumentError(
                f"{name} on rank {self.rank}, {call}: the device found bad input (an index "
                "outside its table, offsets out of order, or counts that exceed the rows of X "
                "or the handle's capacity); the peers were told and raise too: this call's "
                "results are not to be used")
        late = [int(s) for s in np.nonzero(status[:w] == _TIMEOUT)[0]]
        late_acks = [int(d) for d in np.nonzero(status[w:2 * w] == _TIMEOUT)[0]]
        late_phase2 = [int(o) for o in np.nonzero(status[2 * w:3 * w] == _TIMEOUT)[0]]
        if late or late_acks or late_phase2:
            self.broken = "a wait timed out"
            parts = []
            if late:
                parts.append(f"the data of rank(s) {late}")
            if late_phase2:
                parts.append(f"the reduced chunks of rank(s) {late_phase2}")
            if late_acks:
                parts.append(f"rank(s) {late_acks} to release their receive buffer")
            return errors.CommTimeoutError(
                f"{name} on rank {self.rank}, {call}: waited {self.ctx.timeout_s:g} s for "
                f"{' and '.join(parts)}; a peer died, stopped calling this handle, or called "
                "it a different number of times")
        peers = [(s, int(v)) for s, v in enumerate(status[:w]) if v]
        reasons = "; ".join(f"rank {s} {_PEER_TEXT.get(v, f'reported status {v}')}"
                            for s, v in peers)
        return errors.InvalidArgumentError(f"{name} on rank {self.rank}, {call}: {reasons}")

    def synchronize(self) -> None:
        """Wait for this handle's work on the current stream, then raise what it recorded."""
        if self.workspace is not None and self.workspace.is_cuda:
            torch.cuda.current_stream(self.workspace.device).synchronize()
        self.check()

    def _reject(self, exc: Exception):
        """This rank's input is bad: take part in the call without data, then raise."""
        self.epoch += 1
        try:
            if _on_gpu(self.ctx) or getattr(self, "_engine", None) == "triton":
                from .. import gpu
                gpu.abort(self)
            else:
                common = self._host_common()
                check(lib.rocmoe_host_fused_abort(self.ctx._live(), common[0]),
                      f"{type(self).__name__} abort")
        except errors.RocmoeError:
            self.broken = "an abort could not be delivered"
        raise exc

    def _host_common(self):
        """rocmoe_fused_common of the next host-backend call (self.epoch already advanced)."""
        common = ffi.new("rocmoe_fused_common *")
        common.layout = self.layout.cstruct
        common.workspace = self.workspace_offset
        common.epoch = self.epoch
        common.workers = 0
        common.ranks_per_node = self.ctx.local_size
        common.timeout_s = self.ctx.timeout_s
        common.recv_counts = ffi.cast("int64_t *", self._recv_counts_host.ctypes.data)
        return common, self._recv_counts_host

    def _host_run(self, fn, args, what: str) -> None:
        try:
            check(fn(self.ctx._live(), args), what)
        except errors.CommTimeoutError as exc:
            self.broken = str(exc)
            raise
        except errors.PeerDeadError as exc:
            self.broken = str(exc)
            raise

    def close(self) -> None:
        """Collective: free the workspace. The handle cannot be called afterwards."""
        self.__dict__.pop("_lean", None)
        self.__dict__.pop("_lean_plans", None)
        for ring in self.__dict__.get("_outputs", {}).values():
            ring.clear()
        if self.workspace is not None:
            if self.workspace.is_cuda:
                torch.cuda.current_stream(self.workspace.device).synchronize()
            self.ctx.free(self.workspace)
            self.workspace = None

    def _check_tensor(self, t, what: str, dtype: Optional[torch.dtype] = None, dim: int = -1):
        if not isinstance(t, torch.Tensor):
            raise errors.InvalidArgumentError(f"{type(self).__name__}: {what} must be a tensor")
        if t.device != self.ctx.device:
            raise errors.DeviceMismatchError(
                f"{type(self).__name__}: {what} is on {t.device}; the handle computes on "
                f"{self.ctx.device}")
        if dtype is not None and t.dtype != dtype:
            raise errors.DTypeError(
                f"{type(self).__name__}: {what} is {t.dtype}; the handle was made for {dtype}")
        if dim >= 0 and t.dim() != dim:
            raise errors.InvalidArgumentError(
                f"{type(self).__name__}: {what} has shape {tuple(t.shape)}; expected {dim}-D")


def _take_output(handle: FusedHandle, name: str, shape: tuple) -> torch.Tensor:
    """An output of `shape` (the handle's dtype, on its device) from the handle's ring
    `name`, which is made again when the shape changes."""
    ring = handle._outputs.get(name)
    if ring is None or ring.key != shape:
        ring = handle._outputs[name] = OutputRing(lambda: (
            torch.empty(shape, dtype=handle.dtype, device=handle.ctx.device),), key=shape)
    return ring.take(capturing(), _current_stream(handle))[0]


def _current_stream(handle: FusedHandle) -> int:
    """The raw handle of the current stream of the handle's GPU."""
    get = handle.__dict__.get("_stream_of_device")
    if get is None:
        from ...native_launch import stream_getter
        get = handle._stream_of_device = stream_getter(handle.ctx.device)
    return get()


def _dtype_problem(dtype) -> Optional[Exception]:
    if dtype not in DTYPE_CODES:
        return errors.DTypeError(f"fused-op handles take float32, bfloat16 or float16, not {dtype}")
    return None


def _integer_sizes(owner: str, **sizes) -> tuple[dict, Optional[Exception]]:
    """A handle's size arguments as ints (Python, numpy or one-element torch integers), and
    the problem with the first that is not one (a float, a string, None), for the creation to
    raise on every rank: converting it with int() instead raised on this rank alone, or took
    4.5 as 4, while the other ranks waited in the creation's exchange. What is not an
    integer reads as 0 in the returned sizes."""
    out, problem = {}, None
    for name, value in sizes.items():
        try:
            out[name] = int(operator.index(value))
        except TypeError:
            out[name] = 0
            if problem is None:
                problem = errors.InvalidArgumentError(
                    f"{owner}: {name} must be an integer, got {value!r}")
    return out, problem
