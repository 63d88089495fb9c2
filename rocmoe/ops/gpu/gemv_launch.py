"""GemvAllReduce's launch: the handle's struct, written once, five words a call.
"""

from __future__ import annotations

import torch

from .hip_args import _StructLaunch, _fill, _word_view
from .team import team_for


class GemvLaunch(_StructLaunch):
    """A GemvAllReduce handle's rocmoe_gpu_gemv_args, written once; a call writes its five
    per-call words (stream, K, W, x, y) through an int64 view of the struct (see
    _word_view) when they differ from the last call's. The caller has checked W [N, K] and
    x [K] (K is the call's: the functional op's cached handle serves every K of an N); a
    non-contiguous W or x is made contiguous here (the kernel reads rows of W and x as plain
    arrays)."""

    def __init__(self, handle):
        from ..._native import ffi, lib
        args = ffi.new("rocmoe_gpu_gemv_args *")
        _fill(ffi, args, team_for(handle.ctx), handle)
        args.n = handle.N
        view, at = _word_view(ffi, args, "rocmoe_gpu_gemv_args", {
            "stream": ("fused", "stream"), "k": ("k",), "w": ("w",), "x": ("x",),
            "out": ("out",)})
        super().__init__(handle, args, lib.rocmoe_gpu_gemv_allreduce)
        self._per_call_words(view, at, ("stream", "k", "w", "x", "out"))

    def __call__(self, w_local: torch.Tensor, x_local: torch.Tensor, out: torch.Tensor) -> None:
        wc = w_local if w_local.is_contiguous() else w_local.contiguous()
        xc = x_local if x_local.is_contiguous() else x_local.contiguous()
        self._write_words((self.stream(), wc.shape[1], wc.data_ptr(), xc.data_ptr(),
                           out.data_ptr()))
        self._launch("GemvAllReduce (GPU)")
        del wc, xc  # a copy made here is freed into stream order: reused after the kernel


def gemv(handle, w_local: torch.Tensor, x_local: torch.Tensor, out: torch.Tensor) -> None:
    """Enqueue one GemvAllReduce call (the handle's GemvLaunch, made on its first call)."""
    launch = handle.__dict__.get("_gemv_launch")
    if launch is None:
        launch = handle._gemv_launch = GemvLaunch(handle)
    launch(w_local, x_local, out)
