"""Output tensors a handle hands out call after call, without an allocation per call.

On an H200's host a `torch.empty` on the GPU costs about 7-8 us of Python and allocator
work (benchmarks/results/probe_idle_gap_h200.json), as much as the driver's launch itself,
and a GemmAllToAll call made two of them (the rows and the received counts). An
`OutputRing` keeps a few outputs of the handle's one shape and hands one out again only
when nothing but the ring refers to it any more: no Python reference, no other tensor on
its storage (a view, a `.detach()`, autograd's saved copy), no C++ holder of the tensor
itself (autograd's saved original, DLPack). Whatever the caller still holds is never
written again; an output the caller dropped is reused, as the caching allocator would
reuse its memory, in stream order on the same stream.

Never under CUDA graph capture: an output a graph writes at every replay must not be handed
to anyone else, so a capturing call allocates normally (from the graph's pool) and leaves
the ring alone. The ring holds at most `slots` outputs for the handle's lifetime
(`clear()`, called by the handle's `close()`, frees them)."""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

_storage_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count",
                                                             None)


# whether the current CUDA stream is being captured: torch's own check without its Python
# wrapper (a host-time matter on every call that takes from a ring)
def _capture_check() -> Callable[[], bool]:
    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if check is None or not torch.cuda.is_available():  # a CPU build: nothing captures
        return lambda: False
    return check


capturing: Callable[[], bool] = _capture_check()



def _refs_of_free_slot() -> int:
    """sys.getrefcount of a tensor only the ring's list holds, seen from a loop of the same
    shape as OutputRing.take's (the list, the loop variable, the argument): measured,
    not assumed, as the interpreter's counting differs between versions."""
    tensors = [torch.empty(0)]
    for t in tensors:
        return sys.getrefcount(t)
    raise AssertionError("unreachable")


class OutputRing:
    """Up to `slots` groups of tensors made by `make()` (same shapes every call), each handed
    out again once every tensor of the group is free (see the module's docstring)."""

    def __init__(self, make: Callable[[], tuple], slots: int = 2, key=None):
        self.make = make
        self.slots = int(slots)
        self.key = key  # what the outputs were made for, where the owner needs to know
        # [tensors (a list: the tuple handed out is always a new one, so a caller's tuple
        # counts as a reference to each tensor), storage marks]
        self._entries: list = []
        self.enabled = (_storage_use_count is not None
                        and hasattr(torch.Tensor, "_use_count") and self.slots > 0)
        self._free_refs = _refs_of_free_slot() if self.enabled else 0
        self.reused = 0   # calls served from the ring (for tests and benchmarks)
        self.made = 0     # outputs made for the ring

    def take(self, capturing: bool, stream: int = 0) -> tuple:
        """A tuple of outputs no one else refers to: one the ring made before, or a new one
        (kept while the ring has room). `capturing`: the call is being captured in a CUDA
        graph (then always a new one, never kept). `stream`: the stream the outputs will be
        written on; an output goes back out only on the stream it was last handed out for
        (work another stream queued on it may still be running, as the caching allocator
        also assumes)."""
        if capturing or not self.enabled:
            return self.make()
        # (the check in line, no method call: this is host time before a launch, 2.1 us of
        # the lean GEMM call's 6.9 on an H100's host,
        # results/probe_prelaunch_h100_thirtyfirst_session.jsonl; the loop over the tensors
        # has the shape of _refs_of_free_slot's)
        refs, getrefcount = self._free_refs, sys.getrefcount
        for tensors, marks, where in self._entries:
            if where != stream:
                continue
            for t in tensors:
                if getrefcount(t) != refs:  # the caller (or anyone) still holds it
                    break
            else:
                for t, (_, cdata, count, shape) in zip(tensors, marks):
                    # no C++ holder of the tensor (autograd's saved original, DLPack), no
                    # other tensor on its storage (a view, .detach(), a saved copy; a tensor
                    # re-pointed by set_() has left it), not reshaped in place, not made to
                    # require grad
                    if (t._use_count() != 1 or _storage_use_count(cdata) != count
                            or t.shape != shape or t.requires_grad):
                        break
                else:
                    self.reused += 1
                    return tuple(tensors)
        made = self.make()
        if len(self._entries) < self.slots:
            storages = [t.untyped_storage() for t in made]
            # each storage's use count now, with only its tensor and the ring's storage
            # object on it: the count of a free output (the storage is kept for its
            # address, which _cdata gives)
            marks = [(s, s._cdata, _storage_use_count(s._cdata), t.shape)
                     for s, t in zip(storages, made)]
            self._entries.append([list(made), marks, stream])
            self.made += 1
        return made

    def clear(self) -> None:
        self._entries.clear()
