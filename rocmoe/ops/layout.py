"""A handle's workspace layout, read from librocmoe (rocmoe_workspace_layout in rocmoe.h).

Python never recomputes where a signal, count or buffer lives: it asks the C ABI once per
handle and passes these offsets to the host backend (the struct itself), the HIP kernels
(the struct by value) and the Triton kernels (as scalar arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import errors
from .._native import check, ffi, lib

OP_CODES = {"embedding_all_to_all": lib.ROCMOE_OP_EMBEDDING_A2A,
            "gemv_all_reduce": lib.ROCMOE_OP_GEMV_ALLREDUCE,
            "gemm_all_to_all": lib.ROCMOE_OP_GEMM_A2A}

_FIELDS = ("op", "world", "dtype", "elem_bytes", "capacity", "width", "aux", "data_signals",
           "acks", "phase2_signals", "counts", "local", "counters", "recv", "parity_bytes",
           "source_bytes", "gather_offset", "total_bytes", "counter_words", "status_words")


@dataclass(frozen=True)
class Layout:
    """Byte offsets from the workspace's start, and its sizes (see rocmoe/workspace.h)."""

    op: int
    world: int
    dtype: int
    elem_bytes: int
    capacity: int
    width: int
    aux: int
    data_signals: int
    acks: int
    phase2_signals: int
    counts: int
    local: int
    counters: int
    recv: int
    parity_bytes: int
    source_bytes: int
    gather_offset: int
    total_bytes: int
    counter_words: int
    status_words: int
    cstruct: object = None  # the rocmoe_workspace_layout * it was read from (kept alive)

    # status words (rocmoe/workspace.h): [0, w) data by source, [w, 2w) acks by destination,
    # [2w, 3w) phase 2 by owner, [3w] this rank's own input, [3w + 1] first failing epoch
    def status_own(self) -> int:
        return 3 * self.world

    def status_epoch(self) -> int:
        return 3 * self.world + 1


def make_layout(op: str, world: int, dtype_code: int, a: int, b: int = 0, c: int = 0) -> Layout:
    """The layout of `op`'s workspace (sizes as rocmoe_workspace_layout_init takes them)."""
    if ffi.sizeof("rocmoe_workspace_layout") != lib.rocmoe_workspace_layout_size():
        raise errors.NativeLibraryError(
            "rocmoe's cffi module and librocmoe disagree on rocmoe_workspace_layout's size: "
            "rebuild (pip install -e .)")
    out = ffi.new("rocmoe_workspace_layout *")
    check(lib.rocmoe_workspace_layout_init(OP_CODES[op], int(world), int(dtype_code), int(a),
                                           int(b), int(c), out), f"{op} workspace layout")
    return Layout(**{name: int(getattr(out, name)) for name in _FIELDS}, cstruct=out)
