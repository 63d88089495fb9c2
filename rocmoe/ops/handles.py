"""Persistent fused-op handles: create once (collective, checked), call many times.

    gemm = rocmoe.ops.GemmAllToAll(ctx, max_rows=4096, K=1024, N=1024, dtype=torch.bfloat16)
    out, recv_counts = gemm(X, W, send_counts)       # no MPI, no host sync, graph-capturable

The DeepEP `Buffer` / MORI `EpDispatchCombineOp` pattern (DESIGN.md, "Two paths for every
fused op"). Creating a handle agrees on everything that shapes the symmetric workspace
(capacities, widths, dtype, layout) across the ranks, once, and allocates the workspace at
its upper bound. A call then runs the protocol of rocmoe.h ("fused ops: one protocol for
every backend"): the epoch and every count travel on the device with the data, and results
come back as the upper-bound buffer plus a device tensor of counts (DeepEP's
`num_worst_tokens`).

Errors without a sync per call:

* an input this rank can reject on its own (shape, dtype or device against the handle, a
  count above the capacity) raises here before anything is launched, after this rank has
  taken part in the call without data (the op's abort: its peers' count slots say so, and
  they raise InvalidArgumentError naming it at their next call or `synchronize()`);
* what only the device can see (a timed-out wait, an index out of range, counts that exceed
  the rows) is recorded in the handle's status words, host-mapped memory the host reads
  without a copy, and raised at the next call, at `handle.synchronize()` or at
  `ctx.barrier()`.

On the host backend a call is synchronous, so everything raises at once.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from .. import errors
from .._native import check, ffi, lib
from ..collective import KIND_HANDLE
from ._common import DTYPE_CODES, INDEX_DTYPES, MODES, PLAIN_TENSORS, resolve_context
from .layout import Layout, OP_CODES, make_layout
from .outputs import OutputRing, capturing

__all__ = ["GemmAllToAll", "AllToAllRows", "EmbeddingAllToAll", "GemvAllReduce", "pack_tables",
           "pack_lookups"]

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
                from . import gpu
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
        from ..native_launch import stream_getter
        get = handle._stream_of_device = stream_getter(handle.ctx.device)
    return get()


def _dtype_problem(dtype) -> Optional[Exception]:
    if dtype not in DTYPE_CODES:
        return errors.DTypeError(f"fused-op handles take float32, bfloat16 or float16, not {dtype}")
    return None


# ---------------------------------------------------------------------------------------
# GEMM + all-to-all, and the plain row exchange
# ---------------------------------------------------------------------------------------


class _RowsHandle(FusedHandle):
    """Rows (optionally times W) to the ranks by send counts, like all_to_all_single, over
    a workspace with one region of `max_rows` rows per source."""

    op = "gemm_all_to_all"

    def __init__(self, ctx, max_rows: int, N: int, dtype: torch.dtype, problem=None):  # noqa: N803
        if problem is None:
            problem = _dtype_problem(dtype)
        if problem is None and (int(max_rows) < 1 or int(N) < 1):
            problem = errors.InvalidArgumentError(
                f"{type(self).__name__}: max_rows ({max_rows}) and N ({N}) must be positive")
        fields = dict(max_rows=int(max_rows), N=int(N), dtype=DTYPE_CODES.get(dtype, -1))
        super().__init__(ctx, fields, problem, (int(max_rows), int(N), 0), dtype)
        self.max_rows, self.N = int(max_rows), int(N)
        self.capacity_rows = self.world * self.max_rows

    def _counts(self, send_counts, rows: int, groups: int):
        """Validates send counts this rank can check alone. Returns (host list or None,
        device tensor or None), flat, rank-major [world * max(groups, 1)]."""
        per = max(groups, 1)
        name = type(self).__name__
        if isinstance(send_counts, torch.Tensor):
            want = (self.world, groups) if groups else (self.world,)
            if tuple(send_counts.shape) != want or send_counts.is_floating_point() or \
                    send_counts.is_complex() or send_counts.dtype == torch.bool:
                raise errors.InvalidArgumentError(
                    f"{name}: send_counts is {send_counts.dtype} {tuple(send_counts.shape)}; "
                    f"expected an integer tensor of shape {want}")
            if not self._device_kernels():
                return self._counts(send_counts.tolist(), rows, groups)  # host memory: free
            if send_counts.device != self.ctx.device:
                raise errors.DeviceMismatchError(
                    f"{name}: send_counts is on {send_counts.device}; pass a list or a tensor "
                    f"on {self.ctx.device}")
            # values are checked on the device (status words), never read here
            return None, send_counts.reshape(-1).to(torch.int64)
        try:
            flat = ([int(c) for row in send_counts for c in row] if groups
                    else [int(c) for c in send_counts])
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(
                f"{name}: send_counts must be " + ("a [world][groups] list of ints"
                                                   if groups else "a list of ints")) from None
        if len(flat) != self.world * per:
            raise errors.InvalidArgumentError(
                f"{name}: send_counts has {len(flat)} entries; give one per rank"
                + (f" and group ({self.world} x {groups})" if groups else f" ({self.world})"))
        if any(c < 0 for c in flat):
            raise errors.InvalidArgumentError(f"{name}: send_counts {flat} has a negative count")
        per_dest = [sum(flat[d * per:(d + 1) * per]) for d in range(self.world)]
        if max(per_dest) > self.max_rows:
            raise errors.InvalidArgumentError(
                f"{name}: {max(per_dest)} rows for one rank; the handle was made for at most "
                f"max_rows={self.max_rows} per destination")
        if sum(per_dest) > rows:
            raise errors.InvalidArgumentError(
                f"{name}: send_counts sum to {sum(per_dest)}, but there are {rows} rows")
        return flat, None

    def _device_kernels(self) -> bool:
        """Whether calls run the device kernels (GPU backends; on the host backend too when a
        test sets _engine = "triton" to run them under TRITON_INTERPRET=1)."""
        return _on_gpu(self.ctx) or getattr(self, "_engine", None) == "triton"

    def _exchange(self, x: torch.Tensor, w: Optional[torch.Tensor], host_counts, dev_counts,
                  groups: int):
        """One call (after validation): returns (out [world * max_rows, N], recv_counts)."""
        self.epoch += 1
        out = torch.empty((self.capacity_rows, self.N), dtype=self.dtype, device=x.device)
        if self._device_kernels():
            from . import gpu
            recv = gpu.rows_exchange(self, x, w, host_counts, dev_counts, groups, out)
            return out, recv
        return out, self._host_exchange(x, w, host_counts, groups, out)

    def _host_exchange(self, x, w, flat, groups, out):
        from .products import grouped_products, split_groups
        per = max(groups, 1)
        counts = [sum(flat[d * per:(d + 1) * per]) for d in range(self.world)]
        rows = sum(counts)
        common, recv = self._host_common()
        args = ffi.new("rocmoe_gemm_a2a_args *")
        args.common = common[0]
        x_c = x[:rows].contiguous()
        keep = [x_c]
        args.m, args.k, args.n = rows, int(x.shape[1]), self.N
        args.groups, args.group_counts = 0, ffi.NULL
        if w is None:
            args.x, args.w, args.y = ffi.NULL, ffi.NULL, ffi.cast("void *", x_c.data_ptr())
        elif host_mode("gemm") == "kernel":
            w32 = w.to(torch.float32).contiguous()
            keep.append(w32)
            args.x, args.y = ffi.cast("void *", x_c.data_ptr()), ffi.NULL
            args.w = ffi.cast("float *", w32.data_ptr())
            if groups:
                gc = ffi.new("int64_t[]", flat)
                keep.append(gc)
                args.groups, args.group_counts = groups, gc
        else:
            if groups:
                y = grouped_products(x_c, w, split_groups(flat, groups))
            elif x.dtype == torch.float32:
                y = x_c @ w
            else:
                y = (x_c.float() @ w.float()).to(x.dtype)
            keep.append(y)
            args.x, args.w, args.y = ffi.NULL, ffi.NULL, ffi.cast("void *", y.data_ptr())
        sc = ffi.new("int64_t[]", counts)
        args.send_counts = sc
        args.out = ffi.cast("void *", out.data_ptr())
        self._host_run(lib.rocmoe_host_gemm_a2a, args, type(self).__name__)
        return torch.from_numpy(recv.copy())


class _GemmFunction(torch.autograd.Function):
    """Autograd of a GemmAllToAll / AllToAllRows call: the incoming gradient of the rows that
    arrived goes back to their sources by the reverse exchange (the rows handle of the same
    width); then dX = dY W^T and dW = X^T dY (per group with grouped weights)."""

    @staticmethod
    def forward(ctx, x, w, counts_t, anchor, handle, host_counts, groups):
        dev_counts = None if host_counts is not None else counts_t
        out, recv = handle._exchange(x, w, host_counts, dev_counts, groups)
        ctx.handle, ctx.groups, ctx.host_counts = handle, groups, host_counts
        ctx.rows = x.shape[0]
        ctx.has_w = w is not None
        ctx.save_for_backward(x, w if w is not None else x.new_empty(0), counts_t, recv)
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad_out, _grad_recv):
        x, w, counts_t, recv = ctx.saved_tensors
        handle = ctx.handle
        back = handle.reverse_handle()
        # the rows that came from source s go back to s; there they land in the order they
        # were sent, i.e. X's row order
        recv_host = recv.tolist() if recv.device.type == "cpu" else None
        g_back, _ = back(grad_out.contiguous(), recv_host if recv_host is not None else recv)
        # rows past the ones sent come back as whatever the buffer held: their gradient is 0
        if ctx.host_counts is not None:
            gy = g_back[:ctx.rows].clone()
            gy[sum(ctx.host_counts):] = 0
        else:
            sent = torch.arange(ctx.rows, device=g_back.device) < counts_t.sum()
            gy = torch.where(sent[:, None], g_back[:ctx.rows], g_back.new_zeros(()))
        if not ctx.has_w:
            return gy.to(x.dtype), None, None, grad_out.new_zeros(0), None, None, None
        from .products import grouped_products, grouped_weight_grad, split_groups
        if ctx.groups:
            if ctx.host_counts is not None:
                gc = split_groups(ctx.host_counts, ctx.groups)
                n_rows = sum(ctx.host_counts)
                dx = torch.zeros_like(x)
                dx[:n_rows] = grouped_products(gy[:n_rows], w.transpose(1, 2), gc)
                dw = grouped_weight_grad(x[:n_rows], gy[:n_rows], gc).to(w.dtype)
            else:
                from . import gpu
                dx, dw = gpu.grouped_backward(handle, x, w, gy, counts_t, ctx.groups)
        else:
            dx = (gy.float() @ w.float().t()).to(x.dtype) if x.dtype != torch.float32 \
                else gy @ w.t()
            dw = (x.float().t() @ gy.float()).to(w.dtype) if x.dtype != torch.float32 \
                else x.t() @ gy
        return dx, dw, None, grad_out.new_zeros(0), None, None, None


class AllToAllRows(_RowsHandle):
    """all_to_all_single of rows as a persistent handle: `max_rows` is the most rows one call
    sends to any one destination; rows are `width` wide."""

    def __init__(self, ctx, max_rows: int, width: int, dtype: torch.dtype):
        super().__init__(ctx, max_rows, width, dtype)
        self.width = self.N

    def reverse_handle(self) -> "AllToAllRows":
        return self

    def __call__(self, rows: torch.Tensor, send_counts):
        """rows [M, width]; send_counts [world] (a list, or an integer tensor on the handle's
        device). Returns (out [world * max_rows, width], recv_counts [world] int64): the rows
        from source 0 first, packed; recv_counts[s] of them came from s."""
        self.check()
        try:
            self._check_tensor(rows, "rows", self.dtype, 2)
            if rows.shape[1] != self.width:
                raise errors.InvalidArgumentError(
                    f"AllToAllRows: rows are {rows.shape[1]} wide, the handle {self.width}")
            host_counts, dev_counts = self._counts(send_counts, rows.shape[0], 0)
        except errors.RocmoeError as exc:
            self._reject(exc)
        if torch.is_grad_enabled() and (self.world > 1 or rows.requires_grad):
            return _GemmFunction.apply(rows, None, _counts_tensor(dev_counts),
                                       _anchor(rows.device), self, host_counts, 0)
        return self._exchange(rows, None, host_counts, dev_counts, 0)


def _counts_tensor(dev_counts: Optional[torch.Tensor]) -> torch.Tensor:
    """What the autograd node saves for the counts: the device tensor, or an empty stand-in
    when they came as a host list (made only on the autograd path: a tensor costs host time)."""
    return dev_counts if dev_counts is not None else torch.empty(0, dtype=torch.int64)


_ROWS_HANDLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def release_rows_handles(ctx) -> None:
    """Collective: close the context's shared row-exchange handles."""
    for h in _ROWS_HANDLES.pop(ctx, {}).values():
        h.close()


def rows_handle(ctx, max_rows: int, width: int, dtype: torch.dtype) -> AllToAllRows:
    """The context's shared AllToAllRows of at least `max_rows` for this width and dtype
    (collective when it has to be made: every rank asks for the same in the same order). The
    backward passes of all handles of one width share it."""
    per_ctx = _ROWS_HANDLES.setdefault(ctx, {})
    key = (int(width), dtype)
    h = per_ctx.get(key)
    if h is None or h.max_rows < max_rows or h.workspace is None:
        if h is not None and h.workspace is not None:
            h.close()
        # round up: a slowly growing batch should not re-create it every step
        size = 1 << max(int(max_rows) - 1, 0).bit_length()
        h = per_ctx[key] = AllToAllRows(ctx, size, width, dtype)
    return h


class GemmAllToAll(_RowsHandle):
    """Y = X @ W with Y's rows sent to the ranks by send counts, as a persistent handle.

    `max_rows`: the most rows one call sends to any one destination (so the output holds up
    to world * max_rows rows); `K`, `N`: W's shape; `groups` > 1: W is [groups, K, N] and
    send_counts is [world, groups] (segment (d, g) of the rows is multiplied by W[g])."""

    def __init__(self, ctx, max_rows: int, K: int, N: int, dtype: torch.dtype,  # noqa: N803
                 groups: int = 1):
        problem = None
        if int(K) < 1 or int(groups) < 1:
            problem = errors.InvalidArgumentError(
                f"GemmAllToAll: K ({K}) and groups ({groups}) must be positive")
        super().__init__(ctx, max_rows, N, dtype, problem)
        self.K, self.groups = int(K), int(groups)
        self.reverse_handle()  # made now (collective), not inside a backward being captured

    def reverse_handle(self) -> AllToAllRows:
        """The shared row exchange of this width that carries the backward's gradients."""
        return rows_handle(self.ctx, self.max_rows, self.N, self.dtype)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, send_counts):
        """x [M, K], w [K, N] ([groups, K, N]); send_counts [world] ([world, groups]): a list,
        or an integer tensor on the handle's device. Returns (out [world * max_rows, N],
        recv_counts [world] int64): rows from source 0 first, packed."""
        lean = self.__dict__.get("_lean")
        # GPU, after the first call (rocmoe/ops/gpu/gemm_plans.py: lean_gemm_call)
        if lean is not None:
            result = lean(x, w, send_counts)
            if result is not None:
                return result
        self.check()
        grouped = self.groups > 1
        try:
            self._check_tensor(x, "X", self.dtype, 2)
            self._check_tensor(w, "W", self.dtype, 3 if grouped else 2)
            want = (self.groups, self.K, self.N) if grouped else (self.K, self.N)
            if tuple(w.shape) != want or x.shape[1] != self.K:
                raise errors.InvalidArgumentError(
                    f"GemmAllToAll: X {tuple(x.shape)} and W {tuple(w.shape)} do not fit the "
                    f"handle's [M, {self.K}] and {list(want)}")
            host_counts, dev_counts = self._counts(send_counts, x.shape[0],
                                                   self.groups if grouped else 0)
        except errors.RocmoeError as exc:
            self._reject(exc)
        groups = self.groups if grouped else 0
        # (with grad enabled every rank records the collective backward, also one whose own
        # inputs need none: the anchor; alone, a call that needs no gradient records nothing)
        if torch.is_grad_enabled() and (self.world > 1 or x.requires_grad or w.requires_grad):
            return _GemmFunction.apply(x, w, _counts_tensor(dev_counts), _anchor(x.device),
                                       self, host_counts, groups)
        return self._exchange(x, w, host_counts, dev_counts, groups)


# ---------------------------------------------------------------------------------------
# Embedding + all-to-all
# ---------------------------------------------------------------------------------------


def _per_table(x, what: str) -> list:
    """A per-table argument of EmbeddingAllToAll as a list of tensors: a sequence of 1-D
    tensors, one a table, or one 2-D tensor whose row t is table t's (stacked, like dlrm's
    lS_i [num_tables, L] and lS_o [num_tables, B] for Criteo data)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise errors.InvalidArgumentError(
                f"EmbeddingAllToAll: {what} is a {x.dim()}-D tensor; pass one 1-D tensor a "
                f"table, or a 2-D tensor [num_tables, n] whose row t is table t's")
        return list(x.unbind(0))
    return list(x)


class EmbeddingAllToAll(FusedHandle):
    """Table-wise model-parallel EmbeddingBag + all-to-all, as a persistent handle.

    `table_rows`: the rows of each of this rank's tables (a contiguous range of the global
    tables, in rank order; an empty list is fine); `dim`: the embedding width (every table);
    `max_batch`: the largest global batch a call may have (a multiple of the world size);
    `max_lookups`: the most indices one table may have in one call."""

    op = "embedding_all_to_all"

    def __init__(self, ctx, table_rows: Sequence[int], dim: int, max_batch: int,
                 max_lookups: int, mode: str = "sum", dtype: torch.dtype = torch.float32):
        ctx = resolve_context(ctx)
        problem = _dtype_problem(dtype)
        rows = [int(r) for r in table_rows]
        if problem is None:
            if mode not in MODES:
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: mode {mode!r}; use 'sum' or 'mean'")
            elif int(dim) < 1 or int(max_lookups) < 0 or any(r < 1 for r in rows):
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: dim {dim}, max_lookups {max_lookups} and table rows "
                    f"{rows} must be positive")
            elif int(max_batch) < 1 or int(max_batch) % ctx.world_size:
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: max_batch {max_batch} must be a positive multiple of "
                    f"the {ctx.world_size} ranks")
        tables = ctx.allgather_ints([len(rows), int(problem is None)])
        counts = [int(v) for v in tables[:, 0]]
        self.num_tables = len(rows)
        self.total_tables = max(sum(counts), 1)
        self.table_base = sum(counts[:ctx.rank])
        self.table_counts = counts
        if problem is None and sum(counts) == 0:
            problem = errors.InvalidArgumentError("EmbeddingAllToAll: no rank has any table")
        fields = dict(dim=int(dim), max_batch=int(max_batch), mode=MODES.get(mode, -1),
                      dtype=DTYPE_CODES.get(dtype, -1), total_tables=self.total_tables)
        super().__init__(ctx, fields, problem, (int(max_batch), self.total_tables, int(dim)),
                         dtype)
        self.table_rows, self.dim = rows, int(dim)
        self.max_batch, self.max_lookups, self.mode = int(max_batch), int(max_lookups), mode
        # the backward's reverse exchange: owner r gets [its tables x this rank's bags]
        self._reverse_rows = max(counts) * (self.max_batch // self.world)
        self.reverse_handle()
        # batched()'s table starts, on the device once (a call copies nothing from the host)
        self._row_base_t = torch.tensor(self.table_row_base, dtype=torch.int64,
                                        device=ctx.device)
        self._packed_shape = torch.Size((self.table_row_base[-1], self.dim))
        self._packed_lookups = self.num_tables * self.max_lookups
        self._device_index = _cuda_index(ctx)
        self._table_launch = None  # made at the first per-table GPU call outside autograd

    def reverse_handle(self) -> AllToAllRows:
        return rows_handle(self.ctx, self._reverse_rows, self.dim, self.dtype)

    def close(self) -> None:
        self._table_launch = None  # it holds the tables of the last call
        super().close()

    def __call__(self, weights: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor],
                 per_sample_weights: Optional[Sequence[torch.Tensor]] = None,
                 batch: Optional[int] = None) -> torch.Tensor:
        """Returns [B // world, total_tables, dim]: this rank's bags of every table in global
        order. B is the number of offsets of each table (every table looks up the same
        global batch; a rank without tables passes `batch=B`).

        `indices` and `offsets` (and `per_sample_weights`) are a list of 1-D tensors, one a
        table, or stacked: one 2-D tensor whose row t is table t's ([num_tables, L] indices
        when every table has L lookups, [num_tables, B] table-local offsets: dlrm's lS_i and
        lS_o for Criteo data). On a GPU with grad off, stacked int64 lookups cost the host
        the same for one table or thirty: two tensors are checked instead of two a table."""
        # the common GPU call (int64 indices and offsets, listed or stacked, no per-sample
        # weights, no autograd): checked and written in one pass by the handle's
        # TableEmbeddingLaunch; anything it declines takes the general path below, which
        # names what is wrong
        if (self._device_index >= 0 and per_sample_weights is None and self._clean()
                and not torch.is_grad_enabled()):
            launch = self._table_launch
            if launch is None:
                from . import gpu
                launch = self._table_launch = gpu.TableEmbeddingLaunch(self)
            b = launch.prepare(weights, indices, offsets, batch)
            if b is not None:
                self.epoch += 1
                out = _take_output(self, "embedding", (b // self.world, self.total_tables,
                                                       self.dim))
                launch.fire(b, out)
                return out
        self.check()
        try:
            weights = list(weights)
            indices = _per_table(indices, "indices")
            offsets = _per_table(offsets, "offsets")
            psw = None if per_sample_weights is None else _per_table(per_sample_weights,
                                                                    "per_sample_weights")
            batch = self._validate(weights, indices, offsets, psw, batch)
        except errors.RocmoeError as exc:
            self._reject(exc)
        anchor = _anchor(self.ctx.device) if torch.is_grad_enabled() else None
        if anchor is not None:
            return _EmbeddingFunction.apply(self, batch, psw is not None, anchor, *weights,
                                            *indices, *offsets, *(psw or []))
        return self._lookup(weights, indices, offsets, psw, batch, reuse=True)

    def batched(self, weight: Optional[torch.Tensor], indices: Optional[torch.Tensor],
                offsets: Optional[torch.Tensor],
                per_sample_weights: Optional[torch.Tensor] = None,
                batch: Optional[int] = None) -> torch.Tensor:
        """The same lookup with this rank's tables packed (FBGEMM's table-batched layout):

        * `weight` [sum(table_rows), dim]: the tables stacked in order (table t is rows
          table_row_base[t] .. table_row_base[t + 1]);
        * `indices` 1-D int64 (int32 is widened, one extra kernel): table-local row numbers,
          table 0's lookups, then table 1's, ...;
        * `offsets` [num_tables * B + 1]: bag b of table t is indices[offsets[t * B + b] :
          offsets[t * B + b + 1]]; offsets[0] is 0;
        * `per_sample_weights` [indices.numel()] (mode 'sum').

        Returns what __call__ returns on the split tables. On a GPU the host's work per call
        is the same for one table or a hundred: three tensors are checked and one kernel is
        launched. A rank without tables passes None for all three and batch=B."""
        # the common GPU call (int64 indices and offsets on the handle's GPU, no per-sample
        # weights, no autograd), checked by identity and integer comparisons alone; anything
        # else takes the general path below, which names what is wrong
        index, nt = self._device_index, self.num_tables
        if (index >= 0 and nt and per_sample_weights is None and type(weight) in PLAIN_TENSORS
                and type(indices) is torch.Tensor and type(offsets) is torch.Tensor
                and weight.dtype is self.dtype and indices.dtype is _I64
                and offsets.dtype is _I64 and weight.shape == self._packed_shape
                and indices.dim() == 1 and offsets.dim() == 1
                and weight.get_device() == index and indices.get_device() == index
                and offsets.get_device() == index
                and indices.numel() <= self._packed_lookups and self._clean()
                and not torch.is_grad_enabled()):
            bags = offsets.numel() - 1
            b = bags // nt
            if (bags == b * nt and 0 <= b <= self.max_batch and b % self.world == 0
                    and (batch is None or batch == b)):
                return self._lookup_packed(weight, indices, offsets, None, b, reuse=True)
        self.check()
        try:
            batch = self._validate_packed(weight, indices, offsets, per_sample_weights, batch)
        except errors.RocmoeError as exc:
            self._reject(exc)
        if self.num_tables == 0:
            return self([], [], [], batch=batch)
        if not _on_gpu(self.ctx):
            # the host backend runs the per-table protocol on the split tables (autograd
            # reaches `weight` through the split's views)
            return self(*_split_packed(self.table_rows, weight, indices, offsets,
                                       per_sample_weights, batch), batch=batch)
        if torch.is_grad_enabled():
            return _PackedEmbeddingFunction.apply(self, batch, _anchor(self.ctx.device),
                                                  weight, indices, offsets, per_sample_weights)
        return self._lookup_packed(weight, indices, offsets, per_sample_weights, batch,
                                   reuse=True)

    @property
    def table_row_base(self) -> list:
        """Where each table starts in the packed weight (num_tables + 1 entries)."""
        return [0] + np.cumsum(self.table_rows, dtype=np.int64).tolist()

    def _validate_packed(self, weight, indices, offsets, psw, batch) -> int:
        name, nt = "EmbeddingAllToAll.batched", self.num_tables
        if nt == 0:
            if weight is not None or indices is not None or offsets is not None:
                raise errors.InvalidArgumentError(
                    f"{name}: this rank has no tables; pass None for weight, indices and offsets")
            if batch is None:
                raise errors.InvalidArgumentError(
                    f"{name}: this rank has no tables; pass batch=<global batch>")
            return self._checked_batch(name, batch)
        self._check_tensor(weight, "weight", self.dtype, 2)
        if weight.shape != self._packed_shape:
            raise errors.InvalidArgumentError(
                f"{name}: weight is {tuple(weight.shape)}; the handle's {nt} tables stack to "
                f"{list(self._packed_shape)}")
        for what, x in (("indices", indices), ("offsets", offsets)):
            self._check_tensor(x, what, None, 1)
            if x.dtype not in INDEX_DTYPES:
                raise errors.DTypeError(f"{name}: {what} are {x.dtype}; use int32 or int64")
        if indices.numel() > self._packed_lookups:
            raise errors.InvalidArgumentError(
                f"{name}: {indices.numel()} indices; the handle takes at most max_lookups="
                f"{self.max_lookups} per table ({nt * self.max_lookups} in all)")
        if offsets.numel() < 1 or (offsets.numel() - 1) % nt:
            raise errors.InvalidArgumentError(
                f"{name}: {offsets.numel()} offsets; expected num_tables * B + 1 with "
                f"num_tables={nt}")
        packed_batch = (offsets.numel() - 1) // nt
        if batch is not None and int(batch) != packed_batch:
            raise errors.InvalidArgumentError(
                f"{name}: batch={batch}, but the offsets hold {packed_batch} bags per table")
        if psw is not None:
            self._check_tensor(psw, "per_sample_weights", None, 1)
            if (self.mode != "sum" or psw.numel() != indices.numel()
                    or not psw.is_floating_point()):
                raise errors.InvalidArgumentError(
                    f"{name}: per_sample_weights need mode='sum' and one floating-point weight "
                    f"per index ({indices.numel()})")
        if not _on_gpu(self.ctx):
            off = offsets.to(torch.int64)
            if (int(off[0]) != 0 or bool((off[1:] < off[:-1]).any())
                    or int(off[-1]) > indices.numel()):
                raise errors.InvalidArgumentError(
                    f"{name}: offsets must start at 0, not decrease and stay within the "
                    f"{indices.numel()} indices")
        return self._checked_batch(name, packed_batch)

    def _checked_batch(self, name: str, batch) -> int:
        batch = int(batch)
        if batch < 0 or batch > self.max_batch or batch % self.world:
            raise errors.InvalidArgumentError(
                f"{name}: global batch {batch}; the handle takes multiples of {self.world} up "
                f"to max_batch={self.max_batch}")
        return batch

    def _lookup_packed(self, weight, indices, offsets, psw, batch: int,
                       reuse: bool = False) -> torch.Tensor:
        """One GPU call of batched() after validation."""
        self.epoch += 1
        shape = (batch // self.world, self.total_tables, self.dim)
        if reuse:
            out = _take_output(self, "embedding", shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.ctx.device)
        launch = self.__dict__.get("_packed_launch")
        if launch is None:
            from . import gpu
            launch = self._packed_launch = gpu.PackedEmbeddingLaunch(self)
        launch(weight, indices, offsets, psw, batch, out)
        return out

    def _validate(self, weights, indices, offsets, psw, batch) -> int:
        quick = self._validate_quick(weights, indices, offsets, psw, batch)
        return quick if quick is not None else self._validate_all(weights, indices, offsets,
                                                                  psw, batch)

    def _validate_quick(self, weights, indices, offsets, psw, batch) -> Optional[int]:
        """The batch, when a GPU call passes every check of _validate_all by cheap reads
        (tables of the handle's shape and dtype, 1-D int32/int64 indices and offsets within
        its bounds, all on its GPU); None when in any doubt, and then _validate_all checks
        everything and names what is wrong. Host time per table is what a DLRM step with
        tens of tables pays; index ranges are checked on the device either way."""
        nt, dev_index = self.num_tables, self.ctx.device.index
        if (not _on_gpu(self.ctx) or dev_index is None or psw is not None or len(weights) != nt
                or len(indices) != nt or len(offsets) != nt):
            return None
        shapes = self.__dict__.get("_table_shapes")
        if shapes is None:
            shapes = self._table_shapes = [torch.Size((r, self.dim)) for r in self.table_rows]
        dtype, ok, most = self.dtype, INDEX_DTYPES, self.max_lookups
        if batch is None:
            batch = offsets[0].numel() if nt and isinstance(offsets[0], torch.Tensor) else None
        for w, idx, off, shape in zip(weights, indices, offsets, shapes):
            if not (isinstance(w, torch.Tensor) and isinstance(idx, torch.Tensor)
                    and isinstance(off, torch.Tensor) and w.get_device() == dev_index
                    and idx.get_device() == dev_index and off.get_device() == dev_index
                    and w.dtype == dtype and w.shape == shape and idx.dim() == 1
                    and off.dim() == 1 and idx.dtype in ok and off.dtype in ok
                    and idx.numel() <= most and off.numel() == batch):
                return None
        if batch is None or batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        return int(batch)

    def _validate_all(self, weights, indices, offsets, psw, batch) -> int:
        name, nt = "EmbeddingAllToAll", self.num_tables
        if len(weights) != nt or len(indices) != nt or len(offsets) != nt:
            raise errors.InvalidArgumentError(
                f"{name}: the handle has {nt} tables here; got {len(weights)} tables, "
                f"{len(indices)} index and {len(offsets)} offset tensors")
        if psw is not None and (self.mode != "sum" or len(psw) != nt):
            raise errors.InvalidArgumentError(
                f"{name}: per_sample_weights need mode='sum' and one tensor per table ({nt})")
        for t in range(nt):
            w, idx, off = weights[t], indices[t], offsets[t]
            self._check_tensor(w, f"table {t}", self.dtype, 2)
            self._check_tensor(idx, f"indices of table {t}", None, 1)
            self._check_tensor(off, f"offsets of table {t}", None, 1)
            if tuple(w.shape) != (self.table_rows[t], self.dim):
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} is {tuple(w.shape)}; the handle was made for "
                    f"[{self.table_rows[t]}, {self.dim}]")
            for what, x in (("indices", idx), ("offsets", off)):
                if x.dtype not in INDEX_DTYPES:
                    raise errors.DTypeError(f"{name}: {what} of table {t} are {x.dtype}; use "
                                            "int32 or int64")
            if idx.numel() > self.max_lookups:
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} has {idx.numel()} indices; the handle takes at most "
                    f"max_lookups={self.max_lookups}")
            if batch is None:
                batch = off.numel()
            if off.numel() != batch:
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} has {off.numel()} offsets, expected {batch} (one per bag "
                    "of the global batch, the same for every table)")
            if psw is not None:
                self._check_tensor(psw[t], f"per_sample_weights of table {t}", None, 1)
                if psw[t].numel() != idx.numel() or not psw[t].is_floating_point():
                    raise errors.InvalidArgumentError(
                        f"{name}: per_sample_weights of table {t} must be floating point with "
                        f"one weight per index ({idx.numel()})")
            if not _on_gpu(self.ctx):
                _check_lookups_host(name, t, w.shape[0], idx, off)
        if batch is None:
            raise errors.InvalidArgumentError(
                f"{name}: this rank has no tables; pass batch=<global batch>")
        return self._checked_batch(name, batch)

    def _lookup(self, weights, indices, offsets, psw, batch, mode: Optional[str] = None,
                reuse: bool = False) -> torch.Tensor:
        """One call after validation (`mode`: the functional path's, else the handle's;
        `reuse`: a call outside autograd, whose output may come from the handle's ring on a
        GPU, one ring for the batch of the last such call)."""
        mode = mode or self.mode
        self.epoch += 1
        shape = (batch // self.world, self.total_tables, self.dim)
        if reuse and _on_gpu(self.ctx):
            out = _take_output(self, "embedding", shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.ctx.device)
        if _on_gpu(self.ctx):
            from . import gpu
            gpu.embedding(self, weights, indices, offsets, psw, batch, mode, out)
            return out
        common, _ = self._host_common()
        args = ffi.new("rocmoe_embedding_a2a_args *")
        args.common = common[0]
        nt = self.num_tables
        args.mode, args.num_tables = MODES[mode], nt
        args.total_tables, args.table_base = self.total_tables, self.table_base
        args.batch, args.dim = batch, self.dim
        keep = []
        args.bags = ffi.NULL
        args.weights = args.rows = args.indices = args.num_indices = ffi.NULL
        args.offsets = args.per_sample_weights = ffi.NULL
        if nt and host_mode("embedding") == "torch":
            # torch pools (fp32 accumulation, no copy of the tables); the kernel moves slices
            bags = torch.stack([torch.nn.functional.embedding_bag(
                i.to(torch.int64), w, o.to(torch.int64), mode=mode,
                per_sample_weights=None if psw is None else p.to(w.dtype))
                for w, i, o, p in zip(weights, indices, offsets, psw or [None] * nt)],
                dim=1).contiguous()
            keep.append(bags)
            args.bags = ffi.cast("void *", bags.data_ptr())
        elif nt:
            def arr(ctype, tensors):
                keep.extend(tensors)
                a = ffi.new(f"{ctype}[]", [ffi.cast(ctype, x.data_ptr()) for x in tensors])
                keep.append(a)  # a struct field does not own what it points to
                return a
            args.weights = arr("void *", [w.contiguous() for w in weights])
            args.indices = arr("int64_t *", [i.to(torch.int64).contiguous() for i in indices])
            args.offsets = arr("int64_t *", [o.to(torch.int64).contiguous() for o in offsets])
            if psw is not None:
                args.per_sample_weights = arr("float *", [p.to(torch.float32).contiguous()
                                                          for p in psw])
            sizes = [ffi.new("int64_t[]", [w.shape[0] for w in weights]),
                     ffi.new("int64_t[]", [i.numel() for i in indices])]
            keep.extend(sizes)
            args.rows, args.num_indices = sizes
        args.out = ffi.cast("void *", out.data_ptr())
        self._host_run(lib.rocmoe_host_embedding_a2a, args, "EmbeddingAllToAll")
        return out


_I64 = torch.int64


def pack_lookups(indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]):
    """Per-table lookups (each table's indices and [B] bag starts, as EmbeddingAllToAll's
    call takes them, listed or stacked) -> the packed (indices, offsets) of
    EmbeddingAllToAll.batched, on the indices' device: the indices one after the other, and
    [T * B + 1] offsets into them. (None, None) for no tables. Reads no device value: the
    counts are the tensors' sizes."""
    if isinstance(indices, torch.Tensor) and isinstance(offsets, torch.Tensor):
        return _pack_stacked_lookups(indices, offsets)
    if not indices:
        return None, None
    device = indices[0].device
    counts = torch.tensor([0] + [i.numel() for i in indices], dtype=torch.int64)
    starts = torch.cumsum(counts, 0).to(device)
    packed_offsets = torch.cat([o.to(torch.int64) + s for o, s in zip(offsets, starts[:-1])]
                               + [starts[-1:]])
    return torch.cat(list(indices)), packed_offsets


def _pack_stacked_lookups(indices: torch.Tensor, offsets: torch.Tensor):
    """pack_lookups of stacked lookups, [T, L] indices and [T, B] offsets (row t is table
    t's): the indices as they lie (a copy only when their rows are not contiguous), table
    t's offsets shifted by t * L, and the end. Four launches whatever T, where the lists'
    way takes one a table."""
    if indices.dim() != 2 or offsets.dim() != 2 or indices.shape[0] != offsets.shape[0]:
        raise errors.InvalidArgumentError(
            f"pack_lookups: stacked lookups are [tables, L] indices and [tables, B] offsets; "
            f"got {tuple(indices.shape)} and {tuple(offsets.shape)}")
    tables, lookups = indices.shape
    if tables == 0:
        return None, None
    starts = torch.arange(0, (tables + 1) * lookups, lookups, dtype=torch.int64,
                          device=indices.device)
    shifted = offsets.to(device=indices.device, dtype=torch.int64) + starts[:-1, None]
    return indices.reshape(-1), torch.cat([shifted.reshape(-1), starts[-1:]])


def pack_tables(tables: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                offsets: Sequence[torch.Tensor],
                per_sample_weights: Optional[Sequence[torch.Tensor]] = None):
    """Per-table lookups (EmbeddingAllToAll's call: each table's indices and [B] bag starts)
    -> the packed (weight, indices, offsets, per_sample_weights) of
    EmbeddingAllToAll.batched, on the tensors' device; all None for no tables. A copy of the
    tables: pack once, then keep the packed weight as the parameter."""
    if not tables:
        return None, None, None, None
    packed_indices, packed_offsets = pack_lookups(indices, offsets)
    psw = None if per_sample_weights is None else torch.cat(list(per_sample_weights))
    return torch.cat(list(tables)), packed_indices, packed_offsets, psw


def _split_packed(table_rows, weight, indices, offsets, psw, batch: int):
    """Packed tables -> per-table lists (views of the packed tensors; host reads of the
    offsets, which are free on CPU tensors)."""
    nt = len(table_rows)
    off = offsets.to(torch.int64)
    cuts = off[::batch].tolist() if batch else [0] * (nt + 1)
    weights = list(weight.split(list(table_rows)))
    idx = [indices[cuts[t]:cuts[t + 1]] for t in range(nt)]
    offs = [off[t * batch:(t + 1) * batch] - cuts[t] for t in range(nt)]
    ps = None if psw is None else [psw[cuts[t]:cuts[t + 1]] for t in range(nt)]
    return weights, idx, offs, ps


def _check_lookups_host(name, t, rows, idx, off) -> None:
    """Index and offset ranges, read on the host: free on CPU tensors (on a GPU the kernel
    checks them and reports through the status words instead)."""
    n = idx.numel()
    if off.numel():
        o = off.to(torch.int64)
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n:
            raise errors.InvalidArgumentError(
                f"{name}: offsets of table {t} must start at 0, not decrease and stay within "
                f"its {n} indices")
    if n:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= rows:
            raise errors.InvalidArgumentError(
                f"{name}: table {t}: index {lo if lo < 0 else hi} is outside its {rows} rows")


class _EmbeddingFunction(torch.autograd.Function):
    """Autograd of an EmbeddingAllToAll call: the output gradient goes back to the table
    owners by the reverse row exchange, then accumulates into dense table gradients."""

    @staticmethod
    def forward(ctx, handle, batch, has_psw, anchor, *tensors):
        nt = handle.num_tables
        weights, indices, offsets = tensors[:nt], tensors[nt:2 * nt], tensors[2 * nt:3 * nt]
        psw = tensors[3 * nt:4 * nt] if has_psw else None
        out = handle._lookup(list(weights), list(indices), list(offsets),
                             list(psw) if psw else None, batch)
        ctx.handle, ctx.batch, ctx.has_psw = handle, batch, has_psw
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        nt = h.num_tables
        saved = ctx.saved_tensors
        weights, indices, offsets = saved[:nt], saved[nt:2 * nt], saved[2 * nt:3 * nt]
        psw = saved[3 * nt:4 * nt] if ctx.has_psw else None
        g_tables = _owners_bag_gradients(h, grad, ctx.batch)
        from .products import bag_gradients
        shapes = [(tuple(w.shape), w.dtype) for w in weights]
        w_grads, psw_grads = bag_gradients(shapes, indices, offsets, psw, weights, g_tables,
                                           h.mode)
        return (None, None, None, grad.new_zeros(0), *w_grads, *([None] * (2 * nt)),
                *(psw_grads if psw is not None else []))


def _owners_bag_gradients(h: EmbeddingAllToAll, grad: torch.Tensor, batch: int) -> torch.Tensor:
    """The output gradient [B / world, T_total, D] of every rank -> the gradients of this
    rank's tables' bags [T_local, B, D], by the reverse row exchange (collective)."""
    nt, world, local = h.num_tables, h.world, batch // h.world
    # owner r gets its tables' columns: [T_r x local, D]
    g = grad.permute(1, 0, 2).reshape(h.total_tables * local, h.dim).contiguous()
    got, _ = h.reverse_handle()(g, [c * local for c in h.table_counts])
    got = got[:world * nt * local]
    return got.reshape(world, nt, local, h.dim).permute(1, 0, 2, 3).reshape(nt, batch, h.dim)


class _PackedEmbeddingFunction(torch.autograd.Function):
    """Autograd of a GPU EmbeddingAllToAll.batched call (the packed tables' gradient comes
    back packed)."""

    @staticmethod
    def forward(ctx, handle, batch, anchor, weight, indices, offsets, psw):
        out = handle._lookup_packed(weight, indices, offsets, psw, batch)
        ctx.handle, ctx.batch = handle, batch
        ctx.save_for_backward(weight, indices, offsets, psw)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        weight, indices, offsets, psw = ctx.saved_tensors
        g_bags = _owners_bag_gradients(h, grad, ctx.batch).reshape(-1, h.dim)
        from .products import packed_bag_gradients
        w_grad, psw_grad = packed_bag_gradients(
            weight.shape, weight.dtype, h._row_base_t, indices, offsets, psw, weight, g_bags,
            h.mode, ctx.batch)
        return None, None, grad.new_zeros(0), w_grad, None, None, psw_grad


# ---------------------------------------------------------------------------------------
# GEMV + all-reduce
# ---------------------------------------------------------------------------------------


class GemvAllReduce(FusedHandle):
    """y = sum over ranks r of W_r @ x_r ([N], identical on every rank), as a persistent
    handle. W_r is [N, K_local] (K_local may differ per rank)."""

    op = "gemv_all_reduce"

    def __init__(self, ctx, N: int, K_local: int, dtype: torch.dtype):  # noqa: N803
        problem = _dtype_problem(dtype)
        if problem is None and (int(N) < 1 or int(K_local) < 0):
            problem = errors.InvalidArgumentError(
                f"GemvAllReduce: N ({N}) must be positive and K_local ({K_local}) >= 0")
        fields = dict(N=int(N), dtype=DTYPE_CODES.get(dtype, -1))
        super().__init__(ctx, fields, problem, (int(N), 0, 0), dtype)
        self.N, self.K_local = int(N), int(K_local)
        self._w_shape, self._x_shape = (self.N, self.K_local), (self.K_local,)
        self._device_index = _cuda_index(self.ctx)

    def __call__(self, w_local: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
        # the common GPU call, checked by identity and integer comparisons alone (a tenth
        # of the general checks' host time); anything else takes the general path below
        dtype, index = self.dtype, self._device_index
        if (index >= 0 and type(w_local) in PLAIN_TENSORS and type(x_local) in PLAIN_TENSORS
                and w_local.dtype is dtype and x_local.dtype is dtype
                and w_local.get_device() == index and x_local.get_device() == index
                and w_local.shape == self._w_shape and x_local.shape == self._x_shape
                and self._clean()
                and not (torch.is_grad_enabled()
                         and (w_local.requires_grad or x_local.requires_grad))):
            return self._reduce(w_local, x_local, reuse=True)
        self.check()
        try:
            self._check_tensor(w_local, "W_local", self.dtype, 2)
            self._check_tensor(x_local, "x_local", self.dtype, 1)
            if tuple(w_local.shape) != (self.N, self.K_local) or x_local.shape[0] != self.K_local:
                raise errors.InvalidArgumentError(
                    f"GemvAllReduce: W_local {tuple(w_local.shape)} and x_local "
                    f"{tuple(x_local.shape)}; the handle takes [{self.N}, {self.K_local}] and "
                    f"[{self.K_local}]")
        except errors.RocmoeError as exc:
            self._reject(exc)
        if torch.is_grad_enabled() and (w_local.requires_grad or x_local.requires_grad):
            return _GemvFunction.apply(w_local, x_local, self)
        return self._reduce(w_local, x_local)

    def _reduce(self, w_local, x_local, reuse: bool = False) -> torch.Tensor:
        """One call after validation. `reuse`: a GPU call outside autograd, whose output may
        come from the handle's ring (rocmoe/ops/outputs.py)."""
        self.epoch += 1
        if reuse:
            out = _take_output(self, "gemv", (self.N,))
        else:
            out = torch.empty(self.N, dtype=self.dtype, device=self.ctx.device)
        launch = self.__dict__.get("_gemv_launch")  # a GPU's, made by its first call
        if launch is not None:  # (no import statement and context test a call: ~1 us)
            launch(w_local, x_local, out)
            return out
        if _on_gpu(self.ctx):
            from . import gpu
            gpu.gemv(self, w_local, x_local, out)
            return out
        common, _ = self._host_common()
        args = ffi.new("rocmoe_gemv_allreduce_args *")
        args.common = common[0]
        args.n, args.k = self.N, int(w_local.shape[1])
        w_c, x_c = w_local.contiguous(), x_local.contiguous()
        args.w, args.x = ffi.cast("void *", w_c.data_ptr()), ffi.cast("void *", x_c.data_ptr())
        args.partial = ffi.NULL
        if host_mode("gemv") == "torch":
            partial = (w_c.float() @ x_c.float()) if w_c.dtype != torch.float32 else w_c @ x_c
            partial = partial.contiguous()
            args.partial = ffi.cast("float *", partial.data_ptr())
        args.out = ffi.cast("void *", out.data_ptr())
        self._host_run(lib.rocmoe_host_gemv_allreduce, args, "GemvAllReduce")
        return out


class _GemvFunction(torch.autograd.Function):
    """y is replicated, so the incoming gradient is taken to be the same on every rank (it is
    when every rank computes the same loss from y): dW_r = outer(gy, x_r), dx_r = W_r^T gy,
    with no communication."""

    @staticmethod
    def forward(ctx, w_local, x_local, handle):
        ctx.save_for_backward(w_local, x_local)
        return handle._reduce(w_local, x_local)

    @staticmethod
    def backward(ctx, gy):
        w_local, x_local = ctx.saved_tensors
        g = gy.float()
        return (torch.outer(g, x_local.float()).to(w_local.dtype),
                (w_local.float().t() @ g).to(x_local.dtype), None)

