"""How long a vExpert layer's forward and backward took, step by step, on this rank.

The scheduler calibrates its cost model with these times (cost_calibration.py). Hooks mark
the moments: the layer's forward pre-hook and forward hook, a hook on the output's
gradient (its backward starts) and post-accumulate hooks on its parameters (the last one
ends it). On the host the marks are wall-clock times; on a GPU they are CUDA events, read
one step later (as the scheduler reads the counts), so nothing waits for the device. The
time between the forward and the backward (the rest of the model, the loss) is not the
layer's and is left out.

A step is the span between two optimizer steps (``close_step``). A step with no backward
(inference), with more than one forward (gradient accumulation, activation
recomputation) or run while a CUDA graph is captured is not timed: the cost model
predicts one forward and backward.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class _Marks:
    placement: Any
    forwards: int = 0
    fwd_start: Any = None
    fwd_end: Any = None
    bwd_start: Any = None
    bwd_end: Any = None

    def complete(self) -> bool:
        return self.forwards == 1 and None not in (self.fwd_start, self.fwd_end,
                                                   self.bwd_start, self.bwd_end)


class LayerClock:
    def __init__(self, layer):
        self.layer = layer
        self.cuda = bool(layer.w1.is_cuda)
        self._open: Optional[_Marks] = None
        self._closed: "deque[Optional[_Marks]]" = deque(maxlen=2)
        self._handles = [layer.register_forward_pre_hook(self._before_forward),
                         layer.register_forward_hook(self._after_forward)]
        self._handles += [p.register_post_accumulate_grad_hook(self._after_grad)
                          for p in layer.parameters() if p.requires_grad]

    def _mark(self):
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():
                return None   # a graph being captured: that step is not timed
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # -- the hooks ---------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if self._open is None:   # a static layer's dispatcher has no placement table
            self._open = _Marks(placement=getattr(module.dispatcher, "placement", None))
        self._open.forwards += 1
        self._open.fwd_start = self._mark()

    def _after_forward(self, module, args, out) -> None:
        marks = self._open
        if marks is None or not torch.is_grad_enabled():
            return
        marks.fwd_end = self._mark()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)

    def _before_backward(self, grad) -> None:
        marks = self._open
        if marks is not None and marks.bwd_start is None:
            marks.bwd_start = self._mark()

    def _after_grad(self, param) -> None:
        marks = self._open
        if marks is not None and marks.bwd_start is not None:
            marks.bwd_end = self._mark()

    # -- the steps ---------------------------------------------------------------------------
    def close_step(self) -> None:
        """The step's backward is done (called at the optimizer step)."""
        self._closed.append(self._open)
        self._open = None

    def last_step(self):
        """(placement, forward + backward ms) of the last closed step on the host, of the one
        before it on a GPU (its events long done); None where that step was not timed."""
        lag = 2 if self.cuda else 1
        if len(self._closed) < lag:
            return None
        marks = self._closed[-lag]
        if marks is None or not marks.complete():
            return None
        if self.cuda:
            marks.bwd_end.synchronize()   # recorded a step ago: done by now
            ms = (marks.fwd_start.elapsed_time(marks.fwd_end)
                  + marks.bwd_start.elapsed_time(marks.bwd_end))
        else:
            ms = ((marks.fwd_end - marks.fwd_start) + (marks.bwd_end - marks.bwd_start)) * 1e3
        return marks.placement, float(ms)

    def current_placement(self):
        """The placement the last closed step ran on (None if it had no forward)."""
        marks = self._closed[-1] if self._closed else None
        return None if marks is None else marks.placement

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


__all__ = ["LayerClock"]
