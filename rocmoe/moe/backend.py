"""Which implementation the MoE products and glue run: the Triton kernels or torch ops.

Every module of the layer asks here (``use_triton``), so this sits below all of them:
blocksparse, permute and routing each import it, and none of them imports another for it.
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigurationError

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("ROCMOE_MOE_BACKEND", "auto")

# dtypes the Triton kernels are built for (fp32 accumulators); "auto" runs float64 through
# the torch path, on the GPU too (exact; a float64 tile would not match its fp32 accumulator)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def set_backend(name: str) -> None:
    """``auto`` (Triton on GPU tensors of 16- and 32-bit floats, torch otherwise), ``torch``
    or ``triton``."""
    global _backend
    if name not in BACKENDS:
        raise ConfigurationError(f"MoE backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def use_triton(t: torch.Tensor) -> bool:
    """Whether the kernels run for operands like `t` under the current backend."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        return True
    return t.is_cuda and t.dtype in TRITON_DTYPES and triton_available()


_TRITON_OK = None


def triton_available() -> bool:
    """Whether the Triton kernels import (cached: the launchers ask at every call)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            from . import kernels  # noqa: F401
            _TRITON_OK = True
        except Exception:  # triton missing or broken: the torch path still works
            _TRITON_OK = False
    return _TRITON_OK
