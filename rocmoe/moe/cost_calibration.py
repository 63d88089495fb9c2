"""Online correction of the vExpert cost model from the steps it predicted.

The cost model (cost_model.py) is profiled once, at the scheduler's first step, and its
absolute times drift from what the steps then take: on the 2-core host bench the expert FFN
was profiled at 0.065 ms a row while the timed steps ran at 0.054 (allocator and caches still
cold at the profile), so every prediction was 20 % high. What a step takes is measured
anyway (vexpert_clock.py), so the model is scaled by what its recent predictions missed:

* ``compute``: measured / predicted of the layer's forward + backward (the model's fixed,
  FFN and exchange terms), one per layer;
* ``sync``: measured / predicted of the replica gradient sum, shared by the layers (the
  optimizer pre-hook sums all of them at once).

Each is the median of the last ``window`` ratios, so one slow step (another process on the
core) moves it little, and a drift is followed within a few steps. A prediction is scaled by
the ratios of the steps before it only: the error the scheduler and the bench report is
the error of a prediction made before the step it predicts.

What the model misses depends on the placement (on the H200, 2 ranks sharing it: measured /
predicted 0.94 on the static placement, 1.06 once balanced), so ``compute``'s ratios are
tagged with the placement their step ran on, and the first ratio of a new placement drops
those of the others: until then the old ones are the best guess, after it they are a bias
(with a window mixing both, the vExpert steps' prediction took 4 steps to come within 1 %).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import numpy as np


class RatioWindow:
    """The last `window` ratios measured / predicted; factor() is their median (1 before
    the first). A ratio may carry a tag (what its step ran on, compared with ==): the first
    ratio of a tag other than the last one's drops every ratio before it. Untagged ratios
    (and those loaded from a state dict) are dropped by no tag."""

    def __init__(self, window: int = 8):
        if int(window) < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.ratios: "deque[float]" = deque(maxlen=int(window))
        self._tag = None   # the tag of the ratios kept (None: untagged, or not known)

    def factor(self) -> float:
        return float(np.median(self.ratios)) if self.ratios else 1.0

    def observe(self, predicted_ms: float, measured_ms: float, tag=None) -> bool:
        """Add measured / predicted; a sample without a positive finite pair is left out
        (nothing predicted, or the step was not timed). True when it was added."""
        if not (math.isfinite(predicted_ms) and math.isfinite(measured_ms)) \
                or predicted_ms <= 0 or measured_ms <= 0:
            return False
        if tag is not None:
            if self._tag is not None and not (tag == self._tag):
                self.ratios.clear()
            self._tag = tag
        self.ratios.append(float(measured_ms) / float(predicted_ms))
        return True

    def state_dict(self) -> list:
        return list(self.ratios)

    def load_state_dict(self, ratios: Optional[list]) -> None:
        self.ratios.clear()
        self._tag = None
        for r in ratios or ():   # a state from before the calibration: start without one
            self.ratios.append(float(r))


def split_prediction(model, placement, counts) -> tuple[float, float]:
    """(compute, sync) ms the uncalibrated model predicts: the layer's forward + backward
    (fixed, FFN, exchanges) and its replica gradient sums."""
    parts = model.breakdown(placement, counts)
    return parts["fixed_ms"] + parts["comp_ms"] + parts["a2a_ms"], parts["sync_ms"]


def sync_prediction(model, placements) -> float:
    """ms the uncalibrated model predicts for the replica sums of these layers' placements
    (one optimizer pre-hook sums them all)."""
    return float(sum(model.rank_sync_ms(p) for p in placements).max())


__all__ = ["RatioWindow", "split_prediction", "sync_prediction"]
