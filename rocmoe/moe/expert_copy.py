"""Expand / Migrate data movement: one expert's weights and optimizer state, slot to slot.

An expert in slot s of a layer is the slices ``[s]`` of its parameters (w1, w2, w3) and of
every optimizer state tensor shaped like them (Adam's exp_avg / exp_avg_sq, SGD's momentum
buffer...). Scalar state (Adam's step) is per parameter tensor and the same on every rank,
so it needs no copy. A copy is one-sided: the source rank puts those slices into an
*inbox* on the destination's symmetric heap and raises an epoch signal there. It runs in
a background thread (``ctx.put`` releases the GIL; on a GPU it first waits for an event
recorded after the optimizer step, so it reads finished weights), while the next step runs
on the old placement, which does not touch the destination slot. The scheduler installs
the inbox into the slot when every rank's copies have landed (:meth:`landed`), before
the optimizer step that follows. The inbox has two halves by epoch parity, so a dropped
change's late puts never land in the inbox of the next change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import CommTimeoutError, PlacementError


@dataclass(frozen=True)
class Copy:
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def slot_tensors(layer, optimizer) -> list[torch.Tensor]:
    """The tensors whose slice [slot] is an expert's state, in a fixed order: each expert
    parameter, then its optimizer state tensors of the same shape (sorted by name)."""
    out = []
    for p in (layer.w1, layer.w2, layer.w3):
        if p is None:
            continue
        out.append(p.data)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for name in sorted(state):
            value = state[name]
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                out.append(value)
            elif isinstance(value, torch.Tensor) and value.numel() > 1:
                raise PlacementError(
                    f"optimizer state {name!r} of shape {tuple(value.shape)} cannot be split "
                    f"per expert slot (the parameter is {tuple(p.shape)}): vExpert placement "
                    f"needs element-wise optimizer state (SGD, Adam, AdamW, ...)")
    return out


def slot_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors)


class ExpertMover:
    """Inbox, signals and background puts for one layer's copies (collective methods are
    marked; every rank calls them in the same order)."""

    def __init__(self, ctx, layer, optimizer, timeout_s: float):
        self.ctx = ctx
        self.layer = layer
        self.optimizer = optimizer
        self.timeout_s = float(timeout_s)
        self.rank = int(ctx.rank)
        self._inbox = None      # symmetric uint8 [2, capacity, slot_bytes]
        self._signals = None    # symmetric int64 [2, capacity]
        self._capacity = 0
        self._slot_bytes = 0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.copies: list[Copy] = []
        self.epoch = 0

    # -- collective ---------------------------------------------------------------------
    def issue(self, copies: list[Copy]) -> None:
        """Collective: start this rank's puts of `copies` (the same list on every rank)."""
        self._join()
        tensors = slot_tensors(self.layer, self.optimizer)
        incoming = [sum(1 for c in copies if c.dst_rank == r) for r in range(self.ctx.world_size)]
        need, nbytes = max(incoming), slot_bytes(tensors)
        if need > self._capacity or nbytes != self._slot_bytes:
            self.free()
            self._capacity, self._slot_bytes = max(need, 1), nbytes
            self._inbox = self.ctx.empty((2, self._capacity, nbytes), torch.uint8)
            self._signals = self.ctx.zeros((2, self._capacity), torch.int64)
        self.epoch += 1
        self.copies = list(copies)
        parity = self.epoch % 2
        outgoing = []
        for c in copies:
            if c.src_rank == self.rank:
                index = [d for d in copies if d.dst_rank == c.dst_rank].index(c)
                outgoing.append((c, index))
        event = None
        if tensors and tensors[0].is_cuda:
            event = torch.cuda.Event()
            event.record()  # after the optimizer step that produced these weights
        self._error = None
        self._thread = threading.Thread(target=self._send, name="rocmoe-expert-copy",
                                        args=(outgoing, tensors, parity, self.epoch, event),
                                        daemon=True)
        self._thread.start()

    def free(self) -> None:
        """Collective: release the inbox."""
        self._join()
        for t in (self._inbox, self._signals):
            if t is not None:
                self.ctx.free(t)
        self._inbox = self._signals = None
        self._capacity = 0

    # -- local --------------------------------------------------------------------------
    def _send(self, outgoing, tensors, parity, epoch, event) -> None:
        try:
            if event is not None:
                event.synchronize()
            for c, index in outgoing:
                offset = 0
                box = self._inbox[parity, index]
                for t in tensors:
                    piece = t[c.src_slot].reshape(-1).view(torch.uint8)
                    self.ctx.put(box[offset:offset + piece.numel()], piece, c.dst_rank)
                    offset += piece.numel()
                self.ctx.quiet()
                self.ctx.signal_set(self._signals, parity * self._capacity + index, epoch,
                                    c.dst_rank)
        except BaseException as exc:  # noqa: BLE001 - reported by landed()
            self._error = exc

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise CommTimeoutError(f"rank {self.rank}: an expert copy did not finish "
                                       f"within {self.timeout_s:g} s")
            self._thread = None

    def _incoming(self) -> list[tuple[Copy, int]]:
        mine = [c for c in self.copies if c.dst_rank == self.rank]
        return [(c, i) for i, c in enumerate(mine)]

    def landed(self) -> bool:
        """This rank's part is done: its puts finished and every copy into it arrived."""
        if self._error is not None:
            raise self._error
        if self._thread is not None and self._thread.is_alive():
            return False
        parity = self.epoch % 2
        for _, index in self._incoming():
            # a wait that is already true returns the slot's value at once (acquire load)
            seen = self.ctx.wait_until(self._signals, parity * self._capacity + index, 0, ">=")
            if seen < self.epoch:
                return False
        return True

    def install(self) -> list[Copy]:
        """Write every landed copy into its slot (weights and optimizer state). Local."""
        tensors = slot_tensors(self.layer, self.optimizer)
        if slot_bytes(tensors) != self._slot_bytes:
            raise PlacementError("the optimizer state changed shape while an expert copy was "
                                 "in flight")
        parity = self.epoch % 2
        done = []
        with torch.no_grad():
            for c, index in self._incoming():
                box = self._inbox[parity, index]
                offset = 0
                for t in tensors:
                    dst = t[c.dst_slot]
                    n = dst.numel() * dst.element_size()
                    dst.copy_(box[offset:offset + n].view(t.dtype).view(dst.shape))
                    offset += n
                done.append(c)
        self.copies = []
        return done

    def discard(self) -> None:
        self.copies = []


__all__ = ["Copy", "ExpertMover", "slot_tensors", "slot_bytes"]
