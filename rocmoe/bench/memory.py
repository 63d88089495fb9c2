"""Memory accounting of a forward + backward: what autograd saves, what stays alive, the peak.

On a GPU, ``peak_bytes`` reads the caching allocator (``max_memory_allocated`` after
``reset_peak_memory_stats``). Without one, ``track_memory`` counts the same thing exactly:
a torch dispatch mode sees every tensor an op creates, and a finalizer on each new storage
sees it freed, so ``peak`` is the largest sum of live storages created inside the block. It
works on ``meta`` tensors too, where nothing is computed: the layers' sizes are static (no
shape depends on the routing), so a meta run gives the allocations of the real shapes in
milliseconds. Sizes are rounded up to 512 bytes, as the CUDA caching allocator rounds
every block, and storages that existed before the block (inputs, weights) are not counted.

``saved_for_backward`` adds up what autograd's saved-tensor hooks see packed in a forward:
the tensors the graph keeps for the backward, each storage once, those created in the
forward only (the weights and the layer input are the caller's). Tensors a custom
``autograd.Function`` keeps as ``ctx`` attributes are not packed, which is why the tracker's
``live`` after the forward is reported next to it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ALLOCATOR_ROUNDING = 512


def allocator_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request of nbytes (0 stays 0)."""
    return -(-nbytes // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING


@dataclass
class MemoryTrace:
    live: int = 0      # bytes of the storages created in the block that are alive now
    peak: int = 0      # the largest `live` seen
    created: int = 0   # storages created
    _sizes: dict = field(default_factory=dict)    # live storage -> bytes
    _serials: dict = field(default_factory=dict)  # live storage -> creation number

    def identity(self, t: torch.Tensor):
        """A key for t's storage that no later storage reuses (the storage's address can
        be handed out again once it is freed), or None if the storage was not created
        inside the tracked block."""
        key = t.untyped_storage()._cdata
        serial = self._serials.get(key)
        return None if serial is None else (key, serial)


class _Tracker(TorchDispatchMode):
    def __init__(self, trace: MemoryTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # storages the op was given: an output on one of them (in place, a view) is no
        # new allocation
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in given and key not in self.trace._sizes:
                    self._add(storage, key)
        return out

    def _add(self, storage, key) -> None:
        trace = self.trace
        size = allocator_bytes(storage.nbytes())
        trace._sizes[key] = size
        trace._serials[key] = trace.created
        trace.live += size
        trace.created += 1
        trace.peak = max(trace.peak, trace.live)
        # (fires when the storage itself dies: PyTorch keeps its Python object alive as
        # long as any tensor or autograd node holds the storage)
        weakref.finalize(storage, _release, trace, key)


def _release(trace: MemoryTrace, key) -> None:
    trace.live -= trace._sizes.pop(key, 0)
    trace._serials.pop(key, None)


@contextmanager
def track_memory():
    """Count the bytes of every storage created in the block (see the module docstring)."""
    trace = MemoryTrace()
    with _Tracker(trace):
        yield trace


@contextmanager
def saved_for_backward(trace: MemoryTrace):
    """Add up the bytes autograd saves for the backward inside the block: yields a dict
    whose ``bytes`` grows as tensors are packed (each storage once, only storages created
    inside `trace`'s block: no weights, no inputs)."""
    seen: set = set()
    result = {"bytes": 0, "tensors": 0}

    def pack(t):
        ident = trace.identity(t)
        if ident is not None and ident not in seen:
            seen.add(ident)
            result["bytes"] += trace._sizes[ident[0]]
            result["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result


@dataclass
class StepMemory:
    """One forward + backward's memory: bytes saved for the backward, alive after the
    forward (saved tensors, ctx attributes and the output), and the peak of the step."""
    saved: int
    after_forward: int
    peak: int

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}saved_bytes": self.saved,
                f"{prefix}after_forward_bytes": self.after_forward,
                f"{prefix}peak_bytes": self.peak}


def step_memory(forward: Callable[[], torch.Tensor],
                backward: Callable[[torch.Tensor], object]) -> StepMemory:
    """Run ``backward(forward())`` under the tracker (CPU or meta tensors) and account it."""
    with track_memory() as trace:
        with saved_for_backward(trace) as saved:
            out = forward()
        after = trace.live
        backward(out)
        del out
    return StepMemory(saved=saved["bytes"], after_forward=after, peak=trace.peak)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before: the CUDA
    caching allocator's count on a GPU, the tracker's elsewhere."""
    if not torch.cuda.is_available():
        with track_memory() as trace:
            fn()
        return trace.peak
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
