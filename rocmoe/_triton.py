"""Lazy registry of Triton kernels shared by the MoE kernels and the fused GEMM+All-to-All.

Kernels are written as plain functions and jitted on first use, once per interpreter mode:
TRITON_INTERPRET=1 (the CPU interpreter the tests use) must get a fresh jit, since Triton reads
the variable when a kernel is decorated.
"""

from __future__ import annotations

import os


class KernelRegistry:
    def __init__(self) -> None:
        self._raw: dict = {}
        self._jitted: dict = {}

    def kernel(self, fn):
        """Decorator: register `fn` under its name (not jitted yet)."""
        self._raw[fn.__name__] = fn
        return fn

    def get(self, name: str):
        import triton

        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        key = (name, interpret)
        if key not in self._jitted:
            self._jitted[key] = triton.jit(self._raw[name])
        return self._jitted[key]

    def names(self) -> list[str]:
        return sorted(self._raw)
