"""The per-table words of a listed embedding call, checked and written into a launch's
records: by the C++ writer (_rocmoe_records, bindings/table_records.cpp) where it was
built against this torch, else by the Python writer here, which checks the same things.

Why two: a listed call with tens of tables spent about 1 us a table in Python's checks and
writes (36-48 us a call at 16-26 tables on the H100's host, issue 14's goal is 20 us); the
C++ writer reads the tensor behind each Python object instead. It is built against one
torch (CMake asks the configuring Python for torch's headers); a build without torch, or a
torch upgraded since the build, loads the Python writer, so a call never fails for it.

Both take (weights, indices, offsets, records, stride, fields, device, batch, most) and
return WRITTEN, DECLINE or MOVED (rocmoe/ops/gpu/embedding_launch.py says what each means
to TableEmbeddingLaunch.prepare).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

WRITTEN, DECLINE, MOVED = 0, 1, 2

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_I64 = torch.int64
_SEQUENCES = (list, tuple)


def write_lookups_python(weights, indices, offsets, records, stride: int, fields: tuple,
                         device: int, batch: int, most: int) -> int:
    """The Python writer. `records`: an int64 memoryview of the launch's records (the C++
    writer takes their address instead); `fields`: the word offsets of (weights, indices,
    offsets, num_indices) in a table's record. For each table: its indices (at most `most`)
    and offsets (exactly `batch`) plain int64 1-D unit-stride tensors on `device`, its
    weight the tensor whose address the weight word holds."""
    if (type(weights) not in _SEQUENCES or type(indices) not in _SEQUENCES
            or type(offsets) not in _SEQUENCES or len(indices) != len(weights)
            or len(offsets) != len(weights)):
        return DECLINE
    f_w, f_idx, f_off, f_num = fields
    at = 0
    plain = (_TENSOR, _PARAMETER)
    for w, idx, off in zip(weights, indices, offsets):
        if not (type(idx) in plain and type(off) in plain and idx.dtype is _I64
                and off.dtype is _I64 and idx.get_device() == device
                and off.get_device() == device and idx.dim() == 1 and off.dim() == 1
                and idx.is_contiguous() and off.is_contiguous()):
            return DECLINE
        n = idx.numel()
        if off.numel() != batch or n > most:
            return DECLINE
        if type(w) not in plain:
            return DECLINE
        if w.data_ptr() != records[at + f_w]:
            return MOVED
        records[at + f_idx] = idx.data_ptr()
        records[at + f_off] = off.data_ptr()
        records[at + f_num] = n
        at += stride
    return WRITTEN


_native: Optional[Callable] = None
_native_problem: Optional[str] = None
_loaded = False


def native_writer() -> Optional[Callable]:
    """The C++ writer, or None (why: `native_problem()`)."""
    global _native, _native_problem, _loaded
    if not _loaded:
        _loaded = True
        try:
            from ... import _rocmoe_records as mod
            if (mod.WRITTEN, mod.DECLINE, mod.MOVED) != (WRITTEN, DECLINE, MOVED):
                raise ImportError("its return codes differ from rocmoe's")
            _native = mod.write_lookups
        except (ImportError, OSError) as exc:  # not built, or built for another torch
            _native_problem = f"{type(exc).__name__}: {exc}"
    return _native


def native_problem() -> Optional[str]:
    """Why the C++ writer is not in use (None when it is, or has not been asked for)."""
    native_writer()
    return _native_problem


def lookup_writer(records_address: int, records_view) -> tuple:
    """(writer, its records argument) for one launch's records: the C++ writer takes their
    address, the Python writer their int64 view."""
    native = native_writer()
    if native is not None:
        return native, records_address
    return write_lookups_python, records_view
