"""Triton plumbing shared by the MoE kernels and the fused GEMM+All-to-All.

Kernels are written as plain functions and jitted on first use, once per interpreter mode:
TRITON_INTERPRET=1 (the CPU interpreter the tests use) must get a fresh jit, since Triton reads
the variable when a kernel is decorated. The launchers decide alike whether a GPU takes
tensor descriptors (TMA) and build them with the same alignment checks.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels on its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TMA_CAPABLE: dict = {}


def tma_capable(device: torch.device) -> bool:
    """Whether kernels compiled for `device` can load tiles through tensor descriptors: an
    NVIDIA GPU of compute capability 9 (Hopper) or later, not the interpreter. Cached per
    device (launchers ask at every call)."""
    if device.type != "cuda" or torch.version.hip or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _TMA_CAPABLE:
        _TMA_CAPABLE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _TMA_CAPABLE[idx]


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block sizes must be one."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on AMD) of `device`, cached; 4 for the CPU
    interpreter, so persistent grids still take several tiles per program there."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def tensor_descriptor(base: torch.Tensor, rows: int, cols: int, row_stride: int,
                      block: list[int]):
    """A 2-D descriptor of `base`'s memory as [rows, cols] with unit column stride, or None
    when TMA cannot address it (16-byte aligned start and rows; non-empty)."""
    elsize = base.element_size()
    if rows <= 0 or cols <= 0 or base.data_ptr() % 16 or (row_stride * elsize) % 16:
        return None
    return _descriptor_class()(base, [rows, cols], [row_stride, 1], block)


@functools.lru_cache(maxsize=1)
def _descriptor_class():
    # (imported once: an import statement per launch costs host time)
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor


class KernelRegistry:
    def __init__(self) -> None:
        self._raw: dict = {}
        self._options: dict = {}
        self._jitted: dict = {}

    def kernel(self, fn=None, *, do_not_specialize=()):
        """Decorator: register `fn` under its name (not jitted yet). `do_not_specialize`:
        integer arguments that change from call to call (the JIT would otherwise compile
        and key on whether they are 1 or multiples of 16)."""
        def register(f):
            self._raw[f.__name__] = f
            self._options[f.__name__] = dict(do_not_specialize=list(do_not_specialize))
            return f
        return register(fn) if fn is not None else register

    def get(self, name: str):
        key = (name, interpreting())
        fn = self._jitted.get(key)
        if fn is None:
            import triton
            options = {k: v for k, v in self._options.get(name, {}).items() if v}
            fn = self._jitted[key] = triton.jit(self._raw[name], **options)
        return fn

    def names(self) -> list[str]:
        return sorted(self._raw)
