"""librocmoe's HIP kernels (Embedding + All-to-All, GEMV + AllReduce): the team and
fused parts of their argument structs, and the struct a handle writes once and a call
rewrites a few words of (_StructLaunch, _word_view).
"""

from __future__ import annotations

import os

import torch

from ... import errors, native_launch
from .team import Team, first_call_timeout_s


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_ptr(ffi, device):
    """The current stream of `device` (torch's raw getter where it has one: the public one
    builds a Stream object, a few microseconds per call)."""
    if device.type != "cuda":
        return ffi.NULL
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return ffi.cast("void *", _RAW_STREAM(index))
    return ffi.cast("void *", torch.cuda.current_stream(index).cuda_stream)


def _fill(ffi, args, team: Team, handle, first_call: bool = True) -> None:
    """The team and fused parts of a HIP kernel's arguments (once per handle's struct). A
    struct for a first call waits first_call_timeout_s; its caller sets fused.timeout_s to
    the context's timeout once that call is launched (_launched)."""
    args.team.peer_bases = ffi.cast("const void *", team.peer_bases.data_ptr())
    args.team.rank, args.team.world = team.rank, team.world
    args.team.ranks_per_node = team.ranks_per_node
    args.fused.layout = handle.layout.cstruct[0]
    args.fused.workspace = ffi.cast("void *", handle.workspace.data_ptr())
    args.fused.stage = ffi.NULL  # every peer of an ipc heap is load/store reachable
    args.fused.status = ffi.cast("int *", handle.status_address)
    args.fused.workgroups = int(os.environ.get("ROCMOE_GPU_WORKGROUPS", "0"))
    args.fused.timeout_s = (first_call_timeout_s(handle.ctx.timeout_s) if first_call
                            else handle.ctx.timeout_s)
    args.fused.stream = _stream_ptr(ffi, handle.ctx.device)


def _launched(args, handle) -> None:
    """`args`' first call is launched: its later calls wait the context's timeout."""
    args.fused.timeout_s = handle.ctx.timeout_s


def _word_view(ffi, args, name: str, fields: dict) -> tuple:
    """(an int64 numpy view of the C struct `args` of type `name`, each of `fields`' word
    index in it): what a per-call writer sets pointers and sizes through, a numpy item write
    each instead of a cffi cast and field write (a few hundred ns each). `fields`: key ->
    the path of a field (("fused", "stream")). Every field must be an 8-byte word."""
    import numpy as np
    words = {key: ffi.offsetof(name, *path) for key, path in fields.items()}
    size = ffi.sizeof(name)
    if any(at % 8 for at in words.values()) or size % 8:
        raise errors.NativeLibraryError(
            f"{name} has fields at {words} of {size} bytes; this build of rocmoe expects "
            "them 8-byte aligned")
    return np.frombuffer(ffi.buffer(args, size), dtype=np.int64), \
        {k: v // 8 for k, v in words.items()}


class _StructLaunch:
    """What the per-handle argument writers below share: a C args struct written once, the
    C launch function that takes it, the current-stream getter, the first call's longer
    wait (_fill), cut to the context's timeout once that call is launched, and the per-call
    words (_per_call_words, _write_words)."""

    def __init__(self, handle, args, fn):
        from ..._native import check
        self.args, self.fn, self.check = args, fn, check
        self.handle, self.first = handle, True
        self.stream = native_launch.stream_getter(handle.ctx.device)
        self.view, self.word_at, self.last_words = None, (), ()

    def _per_call_words(self, view, at: dict, names: tuple) -> None:
        """The words a call writes: `names`' indices in `view` (_word_view's), in the order
        _write_words takes their values."""
        self.view, self.word_at, self.last_words = view, tuple(at[n] for n in names), ()

    def _write_words(self, words: tuple) -> None:
        """Write a call's words, unless they are the last call's: an output ring, a model's
        fixed tensors and the caching allocator give the same addresses call after call, and
        each numpy word write is host time before the launch. The C launch functions take
        the struct as const, so what was written stays."""
        if words != self.last_words:
            view = self.view
            for at, value in zip(self.word_at, words):
                view[at] = value
            self.last_words = words

    def _launch(self, what: str) -> None:
        rc = self.fn(self.args, 0)
        if rc:
            self.check(rc, what)
        if self.first:
            _launched(self.args, self.handle)
            self.first = False
