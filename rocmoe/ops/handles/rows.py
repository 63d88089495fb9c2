"""The row exchange (AllToAllRows) and GEMM + all-to-all (GemmAllToAll), with the
GEMM's autograd and the context's shared reverse-exchange handles (rows_handle).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ... import errors
from ..._native import ffi, lib
from .._common import DTYPE_CODES
from .base import FusedHandle, _anchor, _dtype_problem, _integer_sizes, _on_gpu, host_mode


class _RowsHandle(FusedHandle):
    """Rows (optionally times W) to the ranks by send counts, like all_to_all_single, over
    a workspace with one region of `max_rows` rows per source."""

    op = "gemm_all_to_all"

    def __init__(self, ctx, max_rows: int, N: int, dtype: torch.dtype, problem=None):  # noqa: N803
        sizes, not_integer = _integer_sizes(type(self).__name__, max_rows=max_rows, N=N)
        max_rows, N = sizes["max_rows"], sizes["N"]  # noqa: N806
        problem = problem or not_integer or _dtype_problem(dtype)
        if problem is None and (max_rows < 1 or N < 1):
            problem = errors.InvalidArgumentError(
                f"{type(self).__name__}: max_rows ({max_rows}) and N ({N}) must be positive")
        fields = dict(max_rows=max_rows, N=N, dtype=DTYPE_CODES.get(dtype, -1))
        super().__init__(ctx, fields, problem, (max_rows, N, 0), dtype)
        self.max_rows, self.N = max_rows, N
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
            from .. import gpu
            recv = gpu.rows_exchange(self, x, w, host_counts, dev_counts, groups, out)
            return out, recv
        return out, self._host_exchange(x, w, host_counts, groups, out)

    def _host_exchange(self, x, w, flat, groups, out):
        from ..products import grouped_products, split_groups
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
        from ..products import grouped_products, grouped_weight_grad, split_groups
        if ctx.groups:
            if ctx.host_counts is not None:
                gc = split_groups(ctx.host_counts, ctx.groups)
                n_rows = sum(ctx.host_counts)
                dx = torch.zeros_like(x)
                dx[:n_rows] = grouped_products(gy[:n_rows], w.transpose(1, 2), gc)
                dw = grouped_weight_grad(x[:n_rows], gy[:n_rows], gc).to(w.dtype)
            else:
                from .. import gpu
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
        sizes, problem = _integer_sizes("GemmAllToAll", K=K, groups=groups)
        K, groups = sizes["K"], sizes["groups"]  # noqa: N806
        if problem is None and (K < 1 or groups < 1):
            problem = errors.InvalidArgumentError(
                f"GemmAllToAll: K ({K}) and groups ({groups}) must be positive")
        super().__init__(ctx, max_rows, N, dtype, problem)
        self.K, self.groups = K, groups
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
