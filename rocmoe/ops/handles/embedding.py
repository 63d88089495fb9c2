"""Table-wise Embedding + all-to-all (EmbeddingAllToAll): per-table, stacked and packed
lookups, their packing (pack_lookups, pack_tables) and their autograd.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ... import errors
from ..._native import ffi, lib
from .._common import DTYPE_CODES, INDEX_DTYPES, MODES, PLAIN_TENSORS, resolve_context
from .base import (FusedHandle, _anchor, _cuda_index, _dtype_problem, _integer_sizes, _on_gpu,
                   _take_output, host_mode)
from .rows import AllToAllRows, rows_handle


def _per_table(x, what: str) -> list:
    """A per-table argument of EmbeddingAllToAll as a list of tensors: a sequence of 1-D
    tensors, one a table, or one 2-D tensor whose row t is table t's (stacked, like dlrm's
    lS_i [num_tables, L] and lS_o [num_tables, B] for Criteo data)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise errors.InvalidArgumentError(
                f"EmbeddingAllToAll: {what} is a {x.dim()}-D tensor; pass one 1-D tensor a "
                f"table, or a 2-D tensor [num_tables, n] whose row t is table t's")
        return list(x.unbind(0))
    return _listed(x, what)


def _listed(x, what: str) -> list:
    """`x` as a list; a clear error for what is not a sequence (None, a number), which the
    handle then reports to its peers instead of leaving them waiting."""
    try:
        return list(x)
    except TypeError:
        raise errors.InvalidArgumentError(
            f"EmbeddingAllToAll: {what} must be a sequence of tensors, one a table (got "
            f"{type(x).__name__})") from None


class EmbeddingAllToAll(FusedHandle):
    """Table-wise model-parallel EmbeddingBag + all-to-all, as a persistent handle.

    `table_rows`: the rows of each of this rank's tables (a contiguous range of the global
    tables, in rank order; an empty list is fine); `dim`: the embedding width (every table);
    `max_batch`: the largest global batch a call may have (a multiple of the world size);
    `max_lookups`: the most indices one table may have in one call."""

    op = "embedding_all_to_all"

    def __init__(self, ctx, table_rows: Sequence[int], dim: int, max_batch: int,
                 max_lookups: int, mode: str = "sum", dtype: torch.dtype = torch.float32):
        ctx = resolve_context(ctx)
        name = "EmbeddingAllToAll"
        sizes, problem = _integer_sizes(name, dim=dim, max_batch=max_batch,
                                        max_lookups=max_lookups)
        dim, max_batch, max_lookups = sizes["dim"], sizes["max_batch"], sizes["max_lookups"]
        try:
            rows = list(table_rows)
        except TypeError:
            rows = []
            problem = problem or errors.InvalidArgumentError(
                f"{name}: table_rows must be a list of integers, got {table_rows!r}")
        row_sizes, not_integer = _integer_sizes(
            name, **{f"table_rows[{t}]": r for t, r in enumerate(rows)})
        rows = list(row_sizes.values())
        problem = problem or not_integer or _dtype_problem(dtype)
        if problem is None:
            if mode not in MODES:
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: mode {mode!r}; use 'sum' or 'mean'")
            elif dim < 1 or max_lookups < 0 or any(r < 1 for r in rows):
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: dim {dim}, max_lookups {max_lookups} and table rows "
                    f"{rows} must be positive")
            elif max_batch < 1 or max_batch % ctx.world_size:
                problem = errors.InvalidArgumentError(
                    f"EmbeddingAllToAll: max_batch {max_batch} must be a positive multiple of "
                    f"the {ctx.world_size} ranks")
        tables = ctx.allgather_ints([len(rows), int(problem is None)])
        counts = [int(v) for v in tables[:, 0]]
        self.num_tables = len(rows)
        self.total_tables = max(sum(counts), 1)
        self.table_base = sum(counts[:ctx.rank])
        self.table_counts = counts
        if problem is None and sum(counts) == 0:
            problem = errors.InvalidArgumentError("EmbeddingAllToAll: no rank has any table")
        fields = dict(dim=dim, max_batch=max_batch, mode=MODES.get(mode, -1),
                      dtype=DTYPE_CODES.get(dtype, -1), total_tables=self.total_tables)
        super().__init__(ctx, fields, problem, (max_batch, self.total_tables, dim), dtype)
        self.table_rows, self.dim = rows, dim
        self.max_batch, self.max_lookups, self.mode = max_batch, max_lookups, mode
        # the backward's reverse exchange: owner r gets [its tables x this rank's bags]
        self._reverse_rows = max(counts) * (self.max_batch // self.world)
        self.reverse_handle()
        # batched()'s table starts, on the device once (a call copies nothing from the host)
        self._row_base_t = torch.tensor(self.table_row_base, dtype=torch.int64,
                                        device=ctx.device)
        self._packed_shape = torch.Size((self.table_row_base[-1], self.dim))
        self._packed_lookups = self.num_tables * self.max_lookups
        self._device_index = _cuda_index(ctx)
        self._table_launch = None  # made at the first per-table GPU call outside autograd

    def reverse_handle(self) -> AllToAllRows:
        return rows_handle(self.ctx, self._reverse_rows, self.dim, self.dtype)

    def close(self) -> None:
        self._table_launch = None  # it holds the tables of the last call
        super().close()

    def __call__(self, weights: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor],
                 per_sample_weights: Optional[Sequence[torch.Tensor]] = None,
                 batch: Optional[int] = None) -> torch.Tensor:
        """Returns [B // world, total_tables, dim]: this rank's bags of every table in global
        order. B is the number of offsets of each table (every table looks up the same
        global batch; a rank without tables passes `batch=B`).

        `indices` and `offsets` (and `per_sample_weights`) are a list of 1-D tensors, one a
        table, or stacked: one 2-D tensor whose row t is table t's ([num_tables, L] indices
        when every table has L lookups, [num_tables, B] table-local offsets: dlrm's lS_i and
        lS_o for Criteo data). On a GPU with grad off, stacked int64 lookups cost the host
        the same for one table or thirty: two tensors are checked instead of two a table."""
        # the common GPU call (int64 indices and offsets, listed or stacked, no per-sample
        # weights, no autograd): checked and written in one pass by the handle's
        # TableEmbeddingLaunch; anything it declines takes the general path below, which
        # names what is wrong
        if (self._device_index >= 0 and per_sample_weights is None and self._clean()
                and not torch.is_grad_enabled()):
            launch = self._table_launch
            if launch is None:
                from .. import gpu
                launch = self._table_launch = gpu.TableEmbeddingLaunch(self)
            b = launch.prepare(weights, indices, offsets, batch)
            if b is not None:
                self.epoch += 1
                out = _take_output(self, "embedding", (b // self.world, self.total_tables,
                                                       self.dim))
                launch.fire(b, out)
                return out
        self.check()
        try:
            weights = _listed(weights, "weights")
            indices = _per_table(indices, "indices")
            offsets = _per_table(offsets, "offsets")
            psw = None if per_sample_weights is None else _per_table(per_sample_weights,
                                                                    "per_sample_weights")
            batch = self._validate(weights, indices, offsets, psw, batch)
        except errors.RocmoeError as exc:
            self._reject(exc)
        anchor = _anchor(self.ctx.device) if torch.is_grad_enabled() else None
        if anchor is not None:
            return _EmbeddingFunction.apply(self, batch, psw is not None, anchor, *weights,
                                            *indices, *offsets, *(psw or []))
        return self._lookup(weights, indices, offsets, psw, batch, reuse=True)

    def batched(self, weight: Optional[torch.Tensor], indices: Optional[torch.Tensor],
                offsets: Optional[torch.Tensor],
                per_sample_weights: Optional[torch.Tensor] = None,
                batch: Optional[int] = None) -> torch.Tensor:
        """The same lookup with this rank's tables packed (FBGEMM's table-batched layout):

        * `weight` [sum(table_rows), dim]: the tables stacked in order (table t is rows
          table_row_base[t] .. table_row_base[t + 1]);
        * `indices` 1-D int64 (int32 is widened, one extra kernel): table-local row numbers,
          table 0's lookups, then table 1's, ...;
        * `offsets` [num_tables * B + 1]: bag b of table t is indices[offsets[t * B + b] :
          offsets[t * B + b + 1]]; offsets[0] is 0;
        * `per_sample_weights` [indices.numel()] (mode 'sum').

        Returns what __call__ returns on the split tables. On a GPU the host's work per call
        is the same for one table or a hundred: three tensors are checked and one kernel is
        launched. A rank without tables passes None for all three and batch=B."""
        # the common GPU call (int64 indices and offsets on the handle's GPU, no per-sample
        # weights, no autograd), checked by identity and integer comparisons alone; anything
        # else takes the general path below, which names what is wrong
        index, nt = self._device_index, self.num_tables
        if (index >= 0 and nt and per_sample_weights is None and type(weight) in PLAIN_TENSORS
                and type(indices) is torch.Tensor and type(offsets) is torch.Tensor
                and weight.dtype is self.dtype and indices.dtype is _I64
                and offsets.dtype is _I64 and weight.shape == self._packed_shape
                and indices.dim() == 1 and offsets.dim() == 1
                and weight.get_device() == index and indices.get_device() == index
                and offsets.get_device() == index
                and indices.numel() <= self._packed_lookups and self._clean()
                and not torch.is_grad_enabled()):
            bags = offsets.numel() - 1
            b = bags // nt
            if (bags == b * nt and 0 <= b <= self.max_batch and b % self.world == 0
                    and (batch is None or batch == b)):
                return self._lookup_packed(weight, indices, offsets, None, b, reuse=True)
        self.check()
        try:
            batch = self._validate_packed(weight, indices, offsets, per_sample_weights, batch)
        except errors.RocmoeError as exc:
            self._reject(exc)
        if self.num_tables == 0:
            return self([], [], [], batch=batch)
        if not _on_gpu(self.ctx):
            # the host backend runs the per-table protocol on the split tables (autograd
            # reaches `weight` through the split's views)
            return self(*_split_packed(self.table_rows, weight, indices, offsets,
                                       per_sample_weights, batch), batch=batch)
        if torch.is_grad_enabled():
            return _PackedEmbeddingFunction.apply(self, batch, _anchor(self.ctx.device),
                                                  weight, indices, offsets, per_sample_weights)
        return self._lookup_packed(weight, indices, offsets, per_sample_weights, batch,
                                   reuse=True)

    @property
    def table_row_base(self) -> list:
        """Where each table starts in the packed weight (num_tables + 1 entries)."""
        return [0] + np.cumsum(self.table_rows, dtype=np.int64).tolist()

    def _validate_packed(self, weight, indices, offsets, psw, batch) -> int:
        name, nt = "EmbeddingAllToAll.batched", self.num_tables
        if nt == 0:
            if weight is not None or indices is not None or offsets is not None:
                raise errors.InvalidArgumentError(
                    f"{name}: this rank has no tables; pass None for weight, indices and offsets")
            if batch is None:
                raise errors.InvalidArgumentError(
                    f"{name}: this rank has no tables; pass batch=<global batch>")
            return self._checked_batch(name, batch)
        self._check_tensor(weight, "weight", self.dtype, 2)
        if weight.shape != self._packed_shape:
            raise errors.InvalidArgumentError(
                f"{name}: weight is {tuple(weight.shape)}; the handle's {nt} tables stack to "
                f"{list(self._packed_shape)}")
        for what, x in (("indices", indices), ("offsets", offsets)):
            self._check_tensor(x, what, None, 1)
            if x.dtype not in INDEX_DTYPES:
                raise errors.DTypeError(f"{name}: {what} are {x.dtype}; use int32 or int64")
        if indices.numel() > self._packed_lookups:
            raise errors.InvalidArgumentError(
                f"{name}: {indices.numel()} indices; the handle takes at most max_lookups="
                f"{self.max_lookups} per table ({nt * self.max_lookups} in all)")
        if offsets.numel() < 1 or (offsets.numel() - 1) % nt:
            raise errors.InvalidArgumentError(
                f"{name}: {offsets.numel()} offsets; expected num_tables * B + 1 with "
                f"num_tables={nt}")
        packed_batch = (offsets.numel() - 1) // nt
        if batch is not None and int(batch) != packed_batch:
            raise errors.InvalidArgumentError(
                f"{name}: batch={batch}, but the offsets hold {packed_batch} bags per table")
        if psw is not None:
            self._check_tensor(psw, "per_sample_weights", None, 1)
            if (self.mode != "sum" or psw.numel() != indices.numel()
                    or not psw.is_floating_point()):
                raise errors.InvalidArgumentError(
                    f"{name}: per_sample_weights need mode='sum' and one floating-point weight "
                    f"per index ({indices.numel()})")
        if not _on_gpu(self.ctx):
            off = offsets.to(torch.int64)
            if (int(off[0]) != 0 or bool((off[1:] < off[:-1]).any())
                    or int(off[-1]) > indices.numel()):
                raise errors.InvalidArgumentError(
                    f"{name}: offsets must start at 0, not decrease and stay within the "
                    f"{indices.numel()} indices")
        return self._checked_batch(name, packed_batch)

    def _checked_batch(self, name: str, batch) -> int:
        batch = int(batch)
        if batch < 0 or batch > self.max_batch or batch % self.world:
            raise errors.InvalidArgumentError(
                f"{name}: global batch {batch}; the handle takes multiples of {self.world} up "
                f"to max_batch={self.max_batch}")
        return batch

    def _lookup_packed(self, weight, indices, offsets, psw, batch: int,
                       reuse: bool = False) -> torch.Tensor:
        """One GPU call of batched() after validation."""
        self.epoch += 1
        shape = (batch // self.world, self.total_tables, self.dim)
        if reuse:
            out = _take_output(self, "embedding", shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.ctx.device)
        launch = self.__dict__.get("_packed_launch")
        if launch is None:
            from .. import gpu
            launch = self._packed_launch = gpu.PackedEmbeddingLaunch(self)
        launch(weight, indices, offsets, psw, batch, out)
        return out

    def _validate(self, weights, indices, offsets, psw, batch) -> int:
        quick = self._validate_quick(weights, indices, offsets, psw, batch)
        return quick if quick is not None else self._validate_all(weights, indices, offsets,
                                                                  psw, batch)

    def _validate_quick(self, weights, indices, offsets, psw, batch) -> Optional[int]:
        """The batch, when a GPU call passes every check of _validate_all by cheap reads
        (tables of the handle's shape and dtype, 1-D int32/int64 indices and offsets within
        its bounds, all on its GPU); None when in any doubt, and then _validate_all checks
        everything and names what is wrong. Host time per table is what a DLRM step with
        tens of tables pays; index ranges are checked on the device either way."""
        nt, dev_index = self.num_tables, self.ctx.device.index
        if (not _on_gpu(self.ctx) or dev_index is None or psw is not None or len(weights) != nt
                or len(indices) != nt or len(offsets) != nt):
            return None
        shapes = self.__dict__.get("_table_shapes")
        if shapes is None:
            shapes = self._table_shapes = [torch.Size((r, self.dim)) for r in self.table_rows]
        dtype, ok, most = self.dtype, INDEX_DTYPES, self.max_lookups
        if batch is None:
            batch = offsets[0].numel() if nt and isinstance(offsets[0], torch.Tensor) else None
        for w, idx, off, shape in zip(weights, indices, offsets, shapes):
            if not (isinstance(w, torch.Tensor) and isinstance(idx, torch.Tensor)
                    and isinstance(off, torch.Tensor) and w.get_device() == dev_index
                    and idx.get_device() == dev_index and off.get_device() == dev_index
                    and w.dtype == dtype and w.shape == shape and idx.dim() == 1
                    and off.dim() == 1 and idx.dtype in ok and off.dtype in ok
                    and idx.numel() <= most and off.numel() == batch):
                return None
        if batch is None or batch < 0 or batch > self.max_batch or batch % self.world:
            return None
        return int(batch)

    def _validate_all(self, weights, indices, offsets, psw, batch) -> int:
        name, nt = "EmbeddingAllToAll", self.num_tables
        if len(weights) != nt or len(indices) != nt or len(offsets) != nt:
            raise errors.InvalidArgumentError(
                f"{name}: the handle has {nt} tables here; got {len(weights)} tables, "
                f"{len(indices)} index and {len(offsets)} offset tensors")
        if psw is not None and (self.mode != "sum" or len(psw) != nt):
            raise errors.InvalidArgumentError(
                f"{name}: per_sample_weights need mode='sum' and one tensor per table ({nt})")
        for t in range(nt):
            w, idx, off = weights[t], indices[t], offsets[t]
            self._check_tensor(w, f"table {t}", self.dtype, 2)
            self._check_tensor(idx, f"indices of table {t}", None, 1)
            self._check_tensor(off, f"offsets of table {t}", None, 1)
            if tuple(w.shape) != (self.table_rows[t], self.dim):
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} is {tuple(w.shape)}; the handle was made for "
                    f"[{self.table_rows[t]}, {self.dim}]")
            for what, x in (("indices", idx), ("offsets", off)):
                if x.dtype not in INDEX_DTYPES:
                    raise errors.DTypeError(f"{name}: {what} of table {t} are {x.dtype}; use "
                                            "int32 or int64")
            if idx.numel() > self.max_lookups:
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} has {idx.numel()} indices; the handle takes at most "
                    f"max_lookups={self.max_lookups}")
            if batch is None:
                batch = off.numel()
            if off.numel() != batch:
                raise errors.InvalidArgumentError(
                    f"{name}: table {t} has {off.numel()} offsets, expected {batch} (one per bag "
                    "of the global batch, the same for every table)")
            if psw is not None:
                self._check_tensor(psw[t], f"per_sample_weights of table {t}", None, 1)
                if psw[t].numel() != idx.numel() or not psw[t].is_floating_point():
                    raise errors.InvalidArgumentError(
                        f"{name}: per_sample_weights of table {t} must be floating point with "
                        f"one weight per index ({idx.numel()})")
            if not _on_gpu(self.ctx):
                _check_lookups_host(name, t, w.shape[0], idx, off)
        if batch is None:
            raise errors.InvalidArgumentError(
                f"{name}: this rank has no tables; pass batch=<global batch>")
        return self._checked_batch(name, batch)

    def _lookup(self, weights, indices, offsets, psw, batch, mode: Optional[str] = None,
                reuse: bool = False) -> torch.Tensor:
        """One call after validation (`mode`: the functional path's, else the handle's;
        `reuse`: a call outside autograd, whose output may come from the handle's ring on a
        GPU, one ring for the batch of the last such call)."""
        mode = mode or self.mode
        self.epoch += 1
        shape = (batch // self.world, self.total_tables, self.dim)
        if reuse and _on_gpu(self.ctx):
            out = _take_output(self, "embedding", shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.ctx.device)
        if _on_gpu(self.ctx):
            from .. import gpu
            gpu.embedding(self, weights, indices, offsets, psw, batch, mode, out)
            return out
        common, _ = self._host_common()
        args = ffi.new("rocmoe_embedding_a2a_args *")
        args.common = common[0]
        nt = self.num_tables
        args.mode, args.num_tables = MODES[mode], nt
        args.total_tables, args.table_base = self.total_tables, self.table_base
        args.batch, args.dim = batch, self.dim
        keep = []
        args.bags = ffi.NULL
        args.weights = args.rows = args.indices = args.num_indices = ffi.NULL
        args.offsets = args.per_sample_weights = ffi.NULL
        if nt and host_mode("embedding") == "torch":
            # torch pools (fp32 accumulation, no copy of the tables); the kernel moves slices
            bags = torch.stack([torch.nn.functional.embedding_bag(
                i.to(torch.int64), w, o.to(torch.int64), mode=mode,
                per_sample_weights=None if psw is None else p.to(w.dtype))
                for w, i, o, p in zip(weights, indices, offsets, psw or [None] * nt)],
                dim=1).contiguous()
            keep.append(bags)
            args.bags = ffi.cast("void *", bags.data_ptr())
        elif nt:
            def arr(ctype, tensors):
                keep.extend(tensors)
                a = ffi.new(f"{ctype}[]", [ffi.cast(ctype, x.data_ptr()) for x in tensors])
                keep.append(a)  # a struct field does not own what it points to
                return a
            args.weights = arr("void *", [w.contiguous() for w in weights])
            args.indices = arr("int64_t *", [i.to(torch.int64).contiguous() for i in indices])
            args.offsets = arr("int64_t *", [o.to(torch.int64).contiguous() for o in offsets])
            if psw is not None:
                args.per_sample_weights = arr("float *", [p.to(torch.float32).contiguous()
                                                          for p in psw])
            sizes = [ffi.new("int64_t[]", [w.shape[0] for w in weights]),
                     ffi.new("int64_t[]", [i.numel() for i in indices])]
            keep.extend(sizes)
            args.rows, args.num_indices = sizes
        args.out = ffi.cast("void *", out.data_ptr())
        self._host_run(lib.rocmoe_host_embedding_a2a, args, "EmbeddingAllToAll")
        return out


_I64 = torch.int64


def pack_lookups(indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]):
    """Per-table lookups (each table's indices and [B] bag starts, as EmbeddingAllToAll's
    call takes them, listed or stacked) -> the packed (indices, offsets) of
    EmbeddingAllToAll.batched, on the indices' device: the indices one after the other, and
    [T * B + 1] offsets into them. (None, None) for no tables. Reads no device value: the
    counts are the tensors' sizes."""
    if isinstance(indices, torch.Tensor) and isinstance(offsets, torch.Tensor):
        return _pack_stacked_lookups(indices, offsets)
    if not indices:
        return None, None
    device = indices[0].device
    sizes = [i.numel() for i in indices]
    starts = np.cumsum([0] + sizes).tolist()
    batch = offsets[0].numel() if len(offsets) == len(indices) else -1
    if batch > 0 and all(o.dim() == 1 and o.numel() == batch and o.device == device
                         for o in offsets):
        # every table has B bag starts (EmbeddingAllToAll's call): table t's shifted by its
        # start in one broadcast add, so five launches whatever the tables, where a shift a
        # table took one launch each (26 launches at 26 tables filled the launch queue behind
        # a busy GPU: 2.1 ms a call, benchmarks/probe_stacked_lookups.py)
        flat = torch.cat([o.to(_I64) for o in offsets]).view(len(offsets), batch)
        return torch.cat(list(indices)), _absolute_offsets(flat, _lookup_starts(device, starts))
    # any other offsets (the handle's call names what is wrong with them): a shift a table,
    # added as a host scalar (a tensor of the starts copied to the GPU from pageable memory
    # was a blocking copy that waited for the work queued before it)
    end = torch.full((1,), starts[-1], dtype=_I64, device=device)
    packed_offsets = torch.cat([o.to(_I64) + s for o, s in zip(offsets, starts[:-1])]
                               + [end])
    return torch.cat(list(indices)), packed_offsets


# device -> the device copies of recent lookup starts (pack_lookups; a GPU only)
_STARTS: dict = {}


def _lookup_starts(device: torch.device, starts: list) -> torch.Tensor:
    """`starts` as an int64 tensor on `device`: on a GPU the copy of the last few sets of
    starts, kept (the same tables and lookups per bag give the same starts every step), a
    new set through pinned memory without waiting for the GPU."""
    if device.type != "cuda":
        return torch.tensor(starts, dtype=_I64, device=device)
    ints = _STARTS.get(device)
    if ints is None:
        from ..gpu.team import DeviceInts
        ints = _STARTS[device] = DeviceInts(device, keep=8)
    return ints(starts)


def _pack_stacked_lookups(indices: torch.Tensor, offsets: torch.Tensor):
    """pack_lookups of stacked lookups, [T, L] indices and [T, B] offsets (row t is table
    t's): the indices as they lie (a copy only when their rows are not contiguous), table
    t's offsets shifted by t * L, and the end. Four launches whatever T, where the lists'
    way takes one a table."""
    if indices.dim() != 2 or offsets.dim() != 2 or indices.shape[0] != offsets.shape[0]:
        raise errors.InvalidArgumentError(
            f"pack_lookups: stacked lookups are [tables, L] indices and [tables, B] offsets; "
            f"got {tuple(indices.shape)} and {tuple(offsets.shape)}")
    tables, lookups = indices.shape
    if tables == 0:
        return None, None
    starts = torch.arange(0, (tables + 1) * lookups, lookups, dtype=torch.int64,
                          device=indices.device)
    return indices.reshape(-1), _absolute_offsets(
        offsets.to(device=indices.device, dtype=_I64), starts)


def _absolute_offsets(offsets: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[T, B] table-local bag starts and the tables' [T + 1] starts in the packed indices ->
    the packed [T * B + 1] offsets: row t shifted by starts[t], then the end."""
    return torch.cat([(offsets + starts[:-1, None]).reshape(-1), starts[-1:]])


def pack_tables(tables: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                offsets: Sequence[torch.Tensor],
                per_sample_weights: Optional[Sequence[torch.Tensor]] = None):
    """Per-table lookups (EmbeddingAllToAll's call: each table's indices and [B] bag starts)
    -> the packed (weight, indices, offsets, per_sample_weights) of
    EmbeddingAllToAll.batched, on the tensors' device; all None for no tables. A copy of the
    tables: pack once, then keep the packed weight as the parameter."""
    if not tables:
        return None, None, None, None
    packed_indices, packed_offsets = pack_lookups(indices, offsets)
    psw = None if per_sample_weights is None else torch.cat(list(per_sample_weights))
    return torch.cat(list(tables)), packed_indices, packed_offsets, psw


def _split_packed(table_rows, weight, indices, offsets, psw, batch: int):
    """Packed tables -> per-table lists (views of the packed tensors; host reads of the
    offsets, which are free on CPU tensors)."""
    nt = len(table_rows)
    off = offsets.to(torch.int64)
    cuts = off[::batch].tolist() if batch else [0] * (nt + 1)
    weights = list(weight.split(list(table_rows)))
    idx = [indices[cuts[t]:cuts[t + 1]] for t in range(nt)]
    offs = [off[t * batch:(t + 1) * batch] - cuts[t] for t in range(nt)]
    ps = None if psw is None else [psw[cuts[t]:cuts[t + 1]] for t in range(nt)]
    return weights, idx, offs, ps


def _check_lookups_host(name, t, rows, idx, off) -> None:
    """Index and offset ranges, read on the host: free on CPU tensors (on a GPU the kernel
    checks them and reports through the status words instead)."""
    n = idx.numel()
    if off.numel():
        o = off.to(torch.int64)
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n:
            raise errors.InvalidArgumentError(
                f"{name}: offsets of table {t} must start at 0, not decrease and stay within "
                f"its {n} indices")
    if n:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= rows:
            raise errors.InvalidArgumentError(
                f"{name}: table {t}: index {lo if lo < 0 else hi} is outside its {rows} rows")


class _EmbeddingFunction(torch.autograd.Function):
    """Autograd of an EmbeddingAllToAll call: the output gradient goes back to the table
    owners by the reverse row exchange, then accumulates into dense table gradients."""

    @staticmethod
    def forward(ctx, handle, batch, has_psw, anchor, *tensors):
        nt = handle.num_tables
        weights, indices, offsets = tensors[:nt], tensors[nt:2 * nt], tensors[2 * nt:3 * nt]
        psw = tensors[3 * nt:4 * nt] if has_psw else None
        out = handle._lookup(list(weights), list(indices), list(offsets),
                             list(psw) if psw else None, batch)
        ctx.handle, ctx.batch, ctx.has_psw = handle, batch, has_psw
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        nt = h.num_tables
        saved = ctx.saved_tensors
        weights, indices, offsets = saved[:nt], saved[nt:2 * nt], saved[2 * nt:3 * nt]
        psw = saved[3 * nt:4 * nt] if ctx.has_psw else None
        g_tables = _owners_bag_gradients(h, grad, ctx.batch)
        from ..products import bag_gradients
        shapes = [(tuple(w.shape), w.dtype) for w in weights]
        w_grads, psw_grads = bag_gradients(shapes, indices, offsets, psw, weights, g_tables,
                                           h.mode)
        return (None, None, None, grad.new_zeros(0), *w_grads, *([None] * (2 * nt)),
                *(psw_grads if psw is not None else []))


def _owners_bag_gradients(h: EmbeddingAllToAll, grad: torch.Tensor, batch: int) -> torch.Tensor:
    """The output gradient [B / world, T_total, D] of every rank -> the gradients of this
    rank's tables' bags [T_local, B, D], by the reverse row exchange (collective)."""
    nt, world, local = h.num_tables, h.world, batch // h.world
    # owner r gets its tables' columns: [T_r x local, D]
    g = grad.permute(1, 0, 2).reshape(h.total_tables * local, h.dim).contiguous()
    got, _ = h.reverse_handle()(g, [c * local for c in h.table_counts])
    got = got[:world * nt * local]
    return got.reshape(world, nt, local, h.dim).permute(1, 0, 2, 3).reshape(nt, batch, h.dim)


class _PackedEmbeddingFunction(torch.autograd.Function):
    """Autograd of a GPU EmbeddingAllToAll.batched call (the packed tables' gradient comes
    back packed)."""

    @staticmethod
    def forward(ctx, handle, batch, anchor, weight, indices, offsets, psw):
        out = handle._lookup_packed(weight, indices, offsets, psw, batch)
        ctx.handle, ctx.batch = handle, batch
        ctx.save_for_backward(weight, indices, offsets, psw)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        weight, indices, offsets, psw = ctx.saved_tensors
        g_bags = _owners_bag_gradients(h, grad, ctx.batch).reshape(-1, h.dim)
        from ..products import packed_bag_gradients
        w_grad, psw_grad = packed_bag_gradients(
            weight.shape, weight.dtype, h._row_base_t, indices, offsets, psw, weight, g_bags,
            h.mode, ctx.batch)
        return None, None, grad.new_zeros(0), w_grad, None, None, psw_grad
