"""GEMV + all-reduce (GemvAllReduce) and its autograd.
"""

from __future__ import annotations

import torch

from ... import errors
from ..._native import ffi, lib
from .._common import DTYPE_CODES, PLAIN_TENSORS
from .base import (FusedHandle, _cuda_index, _dtype_problem, _integer_sizes, _on_gpu,
                   _take_output, host_mode)


class GemvAllReduce(FusedHandle):
    """y = sum over ranks r of W_r @ x_r ([N], identical on every rank), as a persistent
    handle. W_r is [N, K_local] (K_local may differ per rank)."""

    op = "gemv_all_reduce"

    def __init__(self, ctx, N: int, K_local: int, dtype: torch.dtype):  # noqa: N803
        sizes, problem = _integer_sizes("GemvAllReduce", N=N, K_local=K_local)
        N, K_local = sizes["N"], sizes["K_local"]  # noqa: N806
        problem = problem or _dtype_problem(dtype)
        if problem is None and (N < 1 or K_local < 0):
            problem = errors.InvalidArgumentError(
                f"GemvAllReduce: N ({N}) must be positive and K_local ({K_local}) >= 0")
        fields = dict(N=N, dtype=DTYPE_CODES.get(dtype, -1))
        super().__init__(ctx, fields, problem, (N, 0, 0), dtype)
        self.N, self.K_local = N, K_local
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
            from .. import gpu
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
