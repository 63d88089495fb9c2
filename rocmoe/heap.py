"""Symmetric tensors: torch tensors whose storage is this rank's part of the symmetric heap.

Allocation and free are collective (DESIGN.md, "Symmetric heap contract"): each call is
checked across ranks before any memory changes hands, so a rank that asks for a different
size, dtype or order gets HeapMismatchError on every rank and the heap stays as it was.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from . import errors
from ._native import check, ffi, lib
from .collective import INT64_MAX, KIND_ALLOC, KIND_FREE, ControlChannel

ALIGNMENT = 256  # bytes; enough for 16-byte vector loads and GPU cache lines

_DTYPE_CODES = {dtype: code for code, dtype in enumerate([
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
], start=1)}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclass
class Allocation:
    offset: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype


def _shape_tuple(shape) -> tuple:
    """`shape` as a tuple of ints: an int, or a sequence of integers (Python, numpy or
    one-element torch integers, through operator.index: 4.5 is not taken as 4, nor the
    string "12" as (1, 2))."""
    if isinstance(shape, str) or not hasattr(shape, "__iter__"):
        shape = (shape,)
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise errors.InvalidArgumentError(f"shape must be a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise errors.InvalidArgumentError(f"shape {shape} has a negative dimension")
    return shape


class SymmetricHeap:
    """The allocator view of one rank's heap; owned by a Context."""

    def __init__(self, handle, channel: ControlChannel, device: torch.device):
        self._handle = handle
        self._channel = channel
        self.device = device
        self.base = int(ffi.cast("uintptr_t", lib.rocmoe_heap_base(handle)))
        self.size = int(lib.rocmoe_heap_size(handle))
        self._live: dict[int, Allocation] = {}   # data_ptr -> allocation

    # -- queries -------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return int(lib.rocmoe_heap_free_bytes(self._handle))

    @property
    def largest_free_block(self) -> int:
        """Bytes of the largest free block: the most one allocation can still get."""
        return int(lib.rocmoe_heap_largest_free(self._handle))

    @property
    def live_allocations(self) -> int:
        return len(self._live)

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of `tensor`'s first element in the heap (views are fine)."""
        if not isinstance(tensor, torch.Tensor):
            raise errors.InvalidArgumentError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        ptr = address_of(tensor)
        if tensor.device != self.device or not (self.base <= ptr < self.base + self.size):
            raise errors.NotOnHeapError(
                f"tensor at {ptr:#x} on {tensor.device} is not on this rank's symmetric heap "
                f"([{self.base:#x}, {self.base + self.size:#x}) on {self.device}); allocate it "
                "with ctx.empty()/ctx.zeros()")
        return ptr - self.base

    # -- collective allocation -----------------------------------------------------
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape_ok, problem = True, ""
        nbytes = 0
        try:
            shape = _shape_tuple(shape)
            if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_CODES:
                raise errors.DTypeError(
                    f"dtype {dtype!r} cannot live on the symmetric heap; use one of "
                    f"{sorted(str(d) for d in _DTYPE_CODES)}")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            # (the agreement carries the size as an int64: a larger request used to raise
            # OverflowError on its rank alone, before the agreement, and the others waited)
            if nbytes > INT64_MAX:
                raise errors.InvalidArgumentError(
                    f"shape {shape} of {dtype} is {nbytes} bytes, more than any heap holds")
        except errors.RocmoeError as exc:
            shape_ok, problem = False, exc
            shape, nbytes = (), 0

        # Allocate locally first, then agree: every rank has the same allocator history, so
        # all succeed or all fail; a rank that differs rolls back before anyone uses memory.
        offset, status = -1, 0
        if shape_ok:
            out = ffi.new("uint64_t *")
            status = lib.rocmoe_heap_alloc(self._handle, nbytes, ALIGNMENT, out)
            offset = int(out[0]) if status == lib.ROCMOE_OK else -1
            local_error = None if status == lib.ROCMOE_OK else _native_message()
        shape_key = hash(shape) & 0x7FFFFFFFFFFFFFFF

        def rollback():
            if offset >= 0:
                check(lib.rocmoe_heap_free(self._handle, offset), "rolling back an allocation")

        try:
            table = self._channel.exchange(
                KIND_ALLOC,
                [int(shape_ok), status, nbytes, _DTYPE_CODES.get(dtype, 0) if shape_ok else 0,
                 len(shape), shape_key, offset],
                "symmetric allocation", mismatch_error=errors.HeapMismatchError)
        except errors.RocmoeError:
            rollback()  # the other ranks made a different call: they allocated nothing
            raise
        oks, statuses, sizes, dcodes, _, keys, offsets = (table[:, i] for i in range(7))

        if not oks.all():
            rollback()
            if not shape_ok:
                raise problem
            bad = [r for r, ok in enumerate(oks) if not ok]
            raise errors.InvalidArgumentError(
                f"ranks {bad} passed an invalid shape or dtype to ctx.empty(); no rank allocated")
        if (sizes != sizes[0]).any() or (dcodes != dcodes[0]).any() or (keys != keys[0]).any():
            rollback()
            asked = "; ".join(
                f"rank {r}: {int(sizes[r])} bytes of {_CODE_DTYPES.get(int(dcodes[r]), '?')}"
                for r in range(len(sizes)))
            raise errors.HeapMismatchError(
                f"symmetric allocation #{self._channel.seq - 1} differs across ranks ({asked}); "
                "every rank must call ctx.empty() with the same shape and dtype in the same order")
        if (statuses != lib.ROCMOE_OK).any():
            rollback()
            raise errors.HeapExhaustedError(
                local_error if status != lib.ROCMOE_OK else
                f"symmetric heap exhausted on another rank while allocating {nbytes} bytes")
        if (offsets != offsets[0]).any():  # same history must give the same offset
            rollback()
            raise errors.HeapMismatchError(
                f"heap offsets diverged across ranks ({list(map(int, offsets))}): an earlier "
                "allocation or free differed; the heap is no longer symmetric")

        tensor = self.tensor_at(self.base + offset, shape, dtype, nbytes)
        self._live[self.base + offset] = Allocation(offset, nbytes, shape, dtype)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        ptr = address_of(tensor) if isinstance(tensor, torch.Tensor) else -1
        alloc = self._live.get(ptr)
        table = self._channel.exchange(
            KIND_FREE, [int(alloc is not None), alloc.offset if alloc else -1],
            "symmetric free", mismatch_error=errors.HeapMismatchError)
        oks, offsets = table[:, 0], table[:, 1]
        if alloc is None:
            raise errors.NotOnHeapError(
                "ctx.free() takes a tensor returned by ctx.empty()/ctx.zeros() of this context "
                "(not a view into one, not a tensor already freed)")
        if not oks.all():
            bad = [r for r, ok in enumerate(oks) if not ok]
            raise errors.HeapMismatchError(
                f"ranks {bad} passed a tensor that is not a live heap allocation to ctx.free(); "
                "nothing was freed")
        if (offsets != offsets[0]).any():
            raise errors.HeapMismatchError(
                f"ranks freed different allocations (offsets {list(map(int, offsets))}); every "
                "rank must free the same tensors in the same order; nothing was freed")
        check(lib.rocmoe_heap_free(self._handle, alloc.offset), "ctx.free")
        del self._live[ptr]

    # -- tensor views of raw heap memory --------------------------------------------
    def tensor_at(self, address: int, shape: tuple, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """A tensor aliasing `nbytes` at `address` (this process's view of some heap)."""
        if self.device.type == "cpu":
            raw = torch.frombuffer(ffi.buffer(ffi.cast("char *", address), max(nbytes, 1)),
                                   dtype=torch.uint8)[:nbytes]
        else:
            raw = torch.as_tensor(_DeviceBuffer(address, nbytes), device=self.device)
        return raw.view(dtype).reshape(shape)


def address_of(tensor: torch.Tensor) -> int:
    """Address of a tensor's first element; unlike data_ptr() also right for empty tensors,
    whose data_ptr() torch reports as 0."""
    return tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()


def _native_message() -> str:
    from ._native import last_error
    return last_error()


class _DeviceBuffer:
    """Exposes device memory to torch through __cuda_array_interface__ (also used on ROCm)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None,
        }
