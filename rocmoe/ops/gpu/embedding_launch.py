"""EmbeddingAllToAll's launches: the general writer (embedding), and the handle's
one-pass writers for packed (PackedEmbeddingLaunch) and per-table calls
(TableEmbeddingLaunch), listed or stacked.
"""

from __future__ import annotations

from operator import is_
from typing import Optional

import torch

from ... import errors
from .._common import MODES, PLAIN_TENSORS
from . import records
from .hip_args import _StructLaunch, _fill, _launched, _stream_ptr, _word_view
from .team import team_for


def embedding(handle, weights, indices, offsets, psw, batch: int, mode: str,
              out: torch.Tensor) -> None:
    """Enqueue one EmbeddingAllToAll call (indices and offsets are checked on the device)."""
    from ..._native import check, ffi, lib
    team = team_for(handle.ctx)
    nt = len(weights)
    # 16-byte vector loads need 16-byte aligned rows: realign a table that is an odd view;
    # int32 indices and offsets are widened (the kernel reads int64)
    wts = [t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous().clone()
           for t in weights]
    i64 = torch.int64
    idx = [t if t.dtype == i64 and t.is_contiguous() else t.contiguous().to(i64)
           for t in indices]
    offs = [t if t.dtype == i64 and t.is_contiguous() else t.contiguous().to(i64)
            for t in offsets]
    ps = ([t if t.dtype == torch.float32 and t.is_contiguous() else t.contiguous().float()
           for t in psw] if psw is not None else None)
    args = getattr(handle, "_gpu_args", None)
    if args is None:
        args = handle._gpu_args = ffi.new("rocmoe_gpu_embedding_args *")
        handle._gpu_tables = ffi.new("rocmoe_gpu_table[]", max(nt, 1))
        handle._gpu_records = _table_records(ffi, handle._gpu_tables, max(nt, 1))
        handle._gpu_weights = handle._gpu_rows = None
        _fill(ffi, args, team, handle)
    args.fused.stream = _stream_ptr(ffi, handle.ctx.device)
    tables = handle._gpu_tables
    if nt:
        # the records as int64 columns (one numpy write per column, not per table); the
        # tables' pointers and rows are rewritten only when either changed. The rows count
        # too: nothing here holds the last call's tables, so a new table of other rows can
        # land at a freed one's address (the caching allocator rounds to 512 bytes: 30 and
        # 31 rows of 24 floats share a block), and the kernel then bounds-checked its
        # indices against the old table's rows (tests/ops_gpu/public_ops_script.py,
        # embedding_repeat/other_rows, failed so at 2 and 4 ranks on an H100)
        rec = handle._gpu_records
        ptrs = [t.data_ptr() for t in wts]
        rows = [t.shape[0] for t in wts]
        if ptrs != handle._gpu_weights or rows != handle._gpu_rows:
            rec[:nt, _REC["weights"]] = ptrs
            rec[:nt, _REC["rows"]] = rows
            handle._gpu_weights, handle._gpu_rows = ptrs, rows
        rec[:nt, _REC["indices"]] = [t.data_ptr() for t in idx]
        rec[:nt, _REC["offsets"]] = [t.data_ptr() for t in offs]
        rec[:nt, _REC["num_indices"]] = [t.numel() for t in idx]
        rec[:nt, _REC["per_sample_weights"]] = [t.data_ptr() for t in ps] if ps is not None else 0
    args.mode = MODES[mode]
    args.num_tables, args.total_tables, args.table_base = nt, handle.total_tables, handle.table_base
    args.batch, args.dim = batch, handle.dim
    args.tables = tables
    args.device_tables = ffi.NULL
    keep = None
    if nt > inline_tables():
        # too many for the launch's arguments: a device copy of the records, through pinned
        # memory (no synchronisation; the caching allocator keeps it until the copy ran)
        raw = torch.frombuffer(ffi.buffer(tables, ffi.sizeof("rocmoe_gpu_table") * nt),
                               dtype=torch.uint8).clone().pin_memory()
        keep = raw.to(handle.ctx.device, non_blocking=True)
        args.device_tables = ffi.cast("const rocmoe_gpu_table *", keep.data_ptr())
    args.out = ffi.cast("void *", out.data_ptr())
    check(lib.rocmoe_gpu_embedding_a2a(args, 0), "EmbeddingAllToAll (GPU)")
    if not getattr(handle, "_gpu_launched", False):
        _launched(args, handle)
        handle._gpu_launched = True
    del keep, wts, idx, offs, ps  # freed into stream order: reused only after the kernel


def _embedding_args(ffi, handle):
    """A new rocmoe_gpu_embedding_args with what a handle fixes for all its calls: the team,
    workspace and waits (_fill), the mode, the tables' count and place, the width. The
    per-call writers below add their table layout (packed or per-table records)."""
    args = ffi.new("rocmoe_gpu_embedding_args *")
    _fill(ffi, args, team_for(handle.ctx), handle)
    args.mode = MODES[handle.mode]
    args.num_tables, args.total_tables = handle.num_tables, handle.total_tables
    args.table_base, args.dim = handle.table_base, handle.dim
    return args


class PackedEmbeddingLaunch(_StructLaunch):
    """A handle's rocmoe_gpu_embedding_args for packed calls (EmbeddingAllToAll.batched),
    written once; a call writes its eight per-call words (stream, batch, output, weight,
    indices, offsets, per-sample weights, index count) through an int64 view of the struct
    (see _word_view; each cffi cast and field write cost a few hundred ns: the probe measured
    8 us of argument writing around a 6 us launch)."""

    def __init__(self, handle):
        from ..._native import ffi, lib
        args = _embedding_args(ffi, handle)
        args.tables = args.device_tables = ffi.NULL
        args.packed.row_base = ffi.cast("const int64_t *", handle._row_base_t.data_ptr())
        fields = {"stream": ("fused", "stream"), "batch": ("batch",), "out": ("out",)}
        for field in ("weights", "indices", "offsets", "per_sample_weights", "num_indices"):
            fields[field] = ("packed", field)
        view, at = _word_view(ffi, args, "rocmoe_gpu_embedding_args", fields)
        super().__init__(handle, args, lib.rocmoe_gpu_embedding_a2a)
        self._per_call_words(view, at, ("stream", "batch", "out", "weights", "indices",
                                        "offsets", "per_sample_weights", "num_indices"))

    def __call__(self, weight, indices, offsets, psw, batch: int, out: torch.Tensor) -> None:
        # 16-byte vector loads need 16-byte aligned rows; the kernel reads int64 and fp32
        w = weight if weight.is_contiguous() and weight.data_ptr() % 16 == 0 else \
            weight.contiguous().clone()
        i64 = torch.int64
        idx = indices if indices.dtype == i64 and indices.is_contiguous() else \
            indices.contiguous().to(i64)
        off = offsets if offsets.dtype == i64 and offsets.is_contiguous() else \
            offsets.contiguous().to(i64)
        ps = None if psw is None else (psw if psw.dtype == torch.float32 and psw.is_contiguous()
                                       else psw.contiguous().float())
        self._write_words((self.stream(), batch, out.data_ptr(), w.data_ptr(), idx.data_ptr(),
                           off.data_ptr(), 0 if ps is None else ps.data_ptr(), idx.numel()))
        self._launch("EmbeddingAllToAll.batched (GPU)")
        del w, idx, off, ps  # freed into stream order: reused only after the kernel


def inline_tables() -> int:
    """How many per-table records travel inside an embedding launch's arguments (more go
    through a device copy; 0 in a build without GPU kernels)."""
    from ..._native import lib
    return lib.rocmoe_gpu_embedding_inline_tables()


class TableEmbeddingLaunch(_StructLaunch):
    """A handle's rocmoe_gpu_embedding_args for per-table calls outside autograd
    (EmbeddingAllToAll.__call__), written once, with its own table records. A call checks and
    writes each table's three per-call words (indices, offsets, index count) in one pass,
    and each table's weight pointer only when the tables are not the ones it adopted last
    (identity, then data_ptr: a `.data =` swap keeps the object but moves the storage). The
    per-table pass runs in C++ where _rocmoe_records was built (records.py): about 0.05 us a
    table on CI's host, against 1.1 us for the same pass in Python (and 2 us a table, 67 us
    a call at 26 tables on the H200's host, for the first version, which checked every
    table in one pass and wrote the records in another).

    `prepare` returns the call's global batch with the records written, or None when any
    table needs what the general path does (int32 or strided indices, per-sample weights,
    an unaligned or foreign table, a tensor on another device, more tables than travel
    inline): that path then checks everything and names what is wrong. Nothing is launched
    and no epoch is taken before `fire`."""

    def __init__(self, handle):
        from ..._native import ffi, lib
        nt = handle.num_tables
        self.usable = 0 < nt <= inline_tables()
        args = _embedding_args(ffi, handle)
        tables = ffi.new("rocmoe_gpu_table[]", max(nt, 1))
        _table_records(ffi, tables, max(nt, 1))  # checks the record layout against _REC
        args.tables, args.device_tables = tables, ffi.NULL
        args.packed.weights = ffi.NULL  # the per-table records, not the packed layout
        view, at = _word_view(ffi, args, "rocmoe_gpu_embedding_args", {
            "stream": ("fused", "stream"), "batch": ("batch",), "out": ("out",)})
        # the records as flat int64 words: table t's field f is word t * len(_REC) + f
        self.records = memoryview(ffi.buffer(tables)).cast("B").cast("q")
        self.tables = tables  # args.tables points into it and does not own it
        # each table's per-call words, checked and written in C++ where that was built
        # (records.py: about 10 ns a table, against 0.9 us in Python)
        self._write, self._records_arg = records.lookup_writer(
            int(ffi.cast("intptr_t", tables)), self.records)
        super().__init__(handle, args, lib.rocmoe_gpu_embedding_a2a)
        self._per_call_words(view, at, ("stream", "batch", "out"))
        self.index = handle._device_index  # what get_device() says of the handle's tensors
        self.num_tables, self.world, self.max_batch = nt, handle.world, handle.max_batch
        self.most = handle.max_lookups
        self.shapes = [torch.Size((r, handle.dim)) for r in handle.table_rows]
        # the tables adopted last (held: compared by identity; None matches no tensor)
        self.weights: tuple = (None,) * nt
        self.weight_ptrs: list = []   # and their data pointers then
        # what the stacked lookups' words in the records were made from (the two tensors'
        # addresses and row steps, the lookups a bag), None after a listed call wrote them:
        # a stacked call that repeats it (the same batch tensors, or new ones the caching
        # allocator put at the same addresses) has its records written already
        self.stacked_words: Optional[tuple] = None

    def _adopt(self, weights) -> bool:
        """Take `weights` as the handle's tables when each is a contiguous, 16-byte aligned
        tensor of its table's shape and the handle's dtype on its GPU (the kernel's vector
        loads need the alignment); writes their pointers and rows into the records."""
        dtype, index, rec, stride = self.handle.dtype, self.index, self.records, len(_REC)
        for w, shape in zip(weights, self.shapes):
            # (plain tensors and Parameters only: a subclass may override what a tensor
            # does, so it goes to the general path; the functional op's stacked lookups
            # rely on this in place of a type check of their own)
            if not (type(w) in PLAIN_TENSORS and w.get_device() == index
                    and w.dtype is dtype and w.shape == shape and w.is_contiguous()
                    and w.data_ptr() % 16 == 0):
                return False
        ptrs = [w.data_ptr() for w in weights]
        for t, (ptr, shape) in enumerate(zip(ptrs, self.shapes)):
            rec[t * stride + _REC["weights"]] = ptr
            rec[t * stride + _REC["rows"]] = shape[0]
        self.weights, self.weight_ptrs = tuple(weights), ptrs
        return True

    def prepare(self, weights, indices, offsets, batch) -> Optional[int]:
        nt = self.num_tables
        try:  # (free in CPython 3.11 while nothing raises)
            if type(indices) is _TENSOR:
                return self._prepare_stacked(weights, indices, offsets, batch)
            if (not self.usable or len(weights) != nt or len(indices) != nt
                    or len(offsets) != nt):
                return None
        except TypeError:  # an argument without a length: the general path names it
            return None
        if not all(map(is_, weights, self.weights)) and not self._adopt(weights):
            return None
        if batch is None:
            first = offsets[0]
            if type(first) is not _TENSOR:
                return None
            batch = first.numel()
        elif type(batch) is not int:
            return None
        if batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        self.stacked_words = None  # the records get this call's words, whatever comes
        if type(weights) not in _SEQUENCES:
            weights = list(weights)
        code = self._write(weights, indices, offsets, self._records_arg, _STRIDE, _FIELDS,
                           self.index, batch, self.most)
        if code == records.WRITTEN:
            return batch
        if code == records.MOVED:  # a table moved: adopt the tables again, then start over
            return self.prepare(weights, indices, offsets, batch) \
                if self._adopt(weights) else None
        return None

    def _prepare_stacked(self, weights, indices, offsets, batch) -> Optional[int]:
        """`prepare` for stacked lookups: `indices` [num_tables, L] and `offsets`
        [num_tables, B], table t's in row t (dlrm's lS_i and lS_o for Criteo data). Two
        tensors are checked whatever the number of tables, and table t's words are the rows'
        addresses, so the host's work per table is three integer writes (iterating the rows
        as tensors instead made a view of each: twice the host time of a list). None for what
        the list form would decline, and for rows that are not unit-stride."""
        nt, index = self.num_tables, self.index
        if not (self.usable and type(offsets) is _TENSOR and len(weights) == nt
                and indices.dtype is _I64 and offsets.dtype is _I64
                and indices.get_device() == index and offsets.get_device() == index
                and indices.dim() == 2 and offsets.dim() == 2):
            return None
        (rows_i, lookups), (rows_o, bags) = indices.shape, offsets.shape
        (step_i, unit_i), (step_o, unit_o) = indices.stride(), offsets.stride()
        if (rows_i != nt or rows_o != nt or unit_i != 1 or unit_o != 1
                or lookups > self.most):
            return None
        if batch is None:
            batch = bags
        elif type(batch) is not int or batch != bags:
            return None
        if batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        if not all(map(is_, weights, self.weights)) or \
                list(map(_DATA_PTR, weights)) != self.weight_ptrs:
            if not self._adopt(weights):  # new tables, or one whose storage moved
                return None
        at_i, at_o = indices.data_ptr(), offsets.data_ptr()
        step_i, step_o = step_i * 8, step_o * 8  # int64 rows
        words = (at_i, step_i, at_o, step_o, lookups)
        if words == self.stacked_words:
            return batch  # the records hold these words (three a table) already
        self.stacked_words = None  # (until the loop below has written them all)
        rec, stride = self.records, len(_REC)
        f_idx, f_off, f_num = _REC["indices"], _REC["offsets"], _REC["num_indices"]
        for at in range(0, nt * stride, stride):
            rec[at + f_idx] = at_i
            rec[at + f_off] = at_o
            rec[at + f_num] = lookups
            at_i += step_i
            at_o += step_o
        self.stacked_words = words
        return batch

    def fire(self, batch: int, out: torch.Tensor) -> None:
        """Launch the call `prepare` wrote, into `out` [batch / world, total_tables, dim]."""
        self._write_words((self.stream(), batch, out.data_ptr()))
        self._launch("EmbeddingAllToAll (GPU)")


_TENSOR = torch.Tensor


_SEQUENCES = (list, tuple)


_I64 = torch.int64


_DATA_PTR = torch.Tensor.data_ptr


# rocmoe_gpu_table's fields as int64 columns (checked against the C layout at first use)
_REC = {"weights": 0, "indices": 1, "offsets": 2, "per_sample_weights": 3, "rows": 4,
        "num_indices": 5}
# a table's record in int64 words, and the words of it a listed call checks and writes
_STRIDE = len(_REC)
_FIELDS = tuple(_REC[f] for f in ("weights", "indices", "offsets", "num_indices"))


def _table_records(ffi, tables, n: int):
    """A [n, 6] int64 numpy view of a rocmoe_gpu_table array (pointers and sizes alike are
    8 bytes: the struct has no padding)."""
    import numpy as np
    size = ffi.sizeof("rocmoe_gpu_table")
    layout = {name: ffi.offsetof("rocmoe_gpu_table", name) // 8 for name in _REC}
    if size != 8 * len(_REC) or layout != _REC:
        raise errors.NativeLibraryError(
            f"rocmoe_gpu_table is {size} bytes with fields at {layout}; this build of rocmoe "
            "expects six 8-byte fields in the order of rocmoe.h")
    return np.frombuffer(ffi.buffer(tables, size * n), dtype=np.int64).reshape(n, len(_REC))
