"""EmbeddingAllToAll's per-table GPU fast path (rocmoe.ops.gpu.TableEmbeddingLaunch) checks
and writes each table's words in one pass: every word must land in its table's record of
rocmoe.h, and any table the kernel cannot take as it is must send the call to the general
path (prepare returns None) before anything is launched. Checked on CPU with the launch
replaced by a function that reads the struct back through cffi; the launch's device index is
set to the CPU's (-1) so that CPU tensors stand for tensors on the handle's GPU."""

import types

import pytest
import torch

from rocmoe._native import ffi
from rocmoe.ops import gpu
from rocmoe.ops._common import MODES
from rocmoe.ops.gpu import embedding_launch, records

ROWS, DIM, BATCH, MOST = (5, 7, 9), 8, 4, 6


INLINE = 32  # hip/src/gpu/fused_embedding.hip's kInlineTables (0 in a build without GPU)


@pytest.fixture(autouse=True, params=["cpp-writer", "python-writer"])
def writer(request, monkeypatch):
    """Every test runs with each of the two writers of a listed call's words
    (rocmoe/ops/gpu/records.py): the C++ one (_rocmoe_records, built with torch's headers)
    and the Python one a build without it falls back to."""
    if request.param == "python-writer":
        monkeypatch.setattr(records, "native_writer", lambda: None)
    elif records.native_writer() is None:
        pytest.skip(f"_rocmoe_records is not built: {records.native_problem()}")
    return request.param


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(embedding_launch, "_fill", lambda ffi_, args, team, handle: None)
    monkeypatch.setattr(embedding_launch, "team_for", lambda ctx: None)
    monkeypatch.setattr(embedding_launch, "inline_tables", lambda: INLINE)
    monkeypatch.setattr(gpu.native_launch, "stream_getter",
                        lambda device: (lambda: 0x7000 + device.index))


def _launch(monkeypatch, world=1):
    _fake_gpu(monkeypatch)
    handle = types.SimpleNamespace(
        ctx=types.SimpleNamespace(device=torch.device("cuda", 2), timeout_s=30.0),
        mode="mean", num_tables=len(ROWS), total_tables=5, table_base=1, dim=DIM,
        dtype=torch.float32, world=world, max_batch=8, max_lookups=MOST, table_rows=ROWS,
        _device_index=2)
    launch = gpu.TableEmbeddingLaunch(handle)
    launch.index = -1  # CPU tensors stand for the GPU's
    seen = []

    def fake(args, abort):
        tables = [dict(weights=int(ffi.cast("intptr_t", t.weights)),
                       indices=int(ffi.cast("intptr_t", t.indices)),
                       offsets=int(ffi.cast("intptr_t", t.offsets)),
                       psw=int(ffi.cast("intptr_t", t.per_sample_weights)),
                       rows=t.rows, num_indices=t.num_indices)
                  for t in (args.tables[i] for i in range(args.num_tables))]
        seen.append(dict(stream=int(ffi.cast("intptr_t", args.fused.stream)), batch=args.batch,
                         out=int(ffi.cast("intptr_t", args.out)), tables=tables,
                         packed=int(ffi.cast("intptr_t", args.packed.weights)),
                         device_tables=int(ffi.cast("intptr_t", args.device_tables)),
                         mode=args.mode, abort=abort,
                         sizes=(args.num_tables, args.total_tables, args.table_base, args.dim)))
        return 0

    launch.fn = fake
    return launch, seen


def _inputs(lookups=(3, 0, 6)):
    weights = [torch.zeros(r, DIM) for r in ROWS]
    indices = [torch.zeros(n, dtype=torch.int64) for n in lookups]
    offsets = [torch.zeros(BATCH, dtype=torch.int64) for _ in ROWS]
    return weights, indices, offsets


def test_each_tables_words_land_in_its_record_of_the_c_struct(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    out = torch.zeros(BATCH, 5, DIM)
    assert launch.prepare(weights, indices, offsets, None) == BATCH
    launch.fire(BATCH, out)
    assert seen == [dict(
        stream=0x7002, batch=BATCH, out=out.data_ptr(), packed=0, device_tables=0,
        mode=MODES["mean"], abort=0, sizes=(3, 5, 1, DIM),
        tables=[dict(weights=w.data_ptr(), indices=i.data_ptr(), offsets=o.data_ptr(), psw=0,
                     rows=w.shape[0], num_indices=i.numel())
                for w, i, o in zip(weights, indices, offsets)])]


def _call(launch, weights, indices, offsets):
    """One call as EmbeddingAllToAll makes it: prepare, then fire when it was taken."""
    batch = launch.prepare(weights, indices, offsets, BATCH)
    if batch is not None:
        launch.fire(batch, torch.zeros(BATCH, 5, DIM))
    return batch


def test_a_second_call_rewrites_only_what_changed(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    _call(launch, weights, indices, offsets)
    _, indices2, offsets2 = _inputs(lookups=(1, 2, 4))
    _call(launch, list(weights), indices2, offsets2)  # a new list of the same tables
    assert [t["weights"] for t in seen[1]["tables"]] == [w.data_ptr() for w in weights]
    assert [t["indices"] for t in seen[1]["tables"]] == [i.data_ptr() for i in indices2]
    assert [t["num_indices"] for t in seen[1]["tables"]] == [1, 2, 4]


def test_a_table_whose_storage_was_swapped_is_adopted_again(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    _call(launch, weights, indices, offsets)
    weights[1].data = torch.ones(ROWS[1], DIM)  # same object, new storage
    assert _call(launch, weights, indices, offsets) == BATCH
    assert seen[1]["tables"][1]["weights"] == weights[1].data_ptr()


def _declined(monkeypatch, change):
    launch, seen = _launch(monkeypatch, world=2)
    weights, indices, offsets = _inputs()
    batch = change(weights, indices, offsets)
    return launch.prepare(weights, indices, offsets, batch) is None and not seen


@pytest.mark.parametrize("change", [
    lambda w, i, o: i.__setitem__(1, i[1].to(torch.int32)) or None,
    lambda w, i, o: o.__setitem__(0, o[0].to(torch.int32)) or None,
    lambda w, i, o: o.__setitem__(2, torch.zeros(2 * BATCH, dtype=torch.int64)[::2]) or None,
    lambda w, i, o: i.__setitem__(0, torch.zeros(3, 1, dtype=torch.int64)) or None,
    lambda w, i, o: i.__setitem__(2, torch.zeros(MOST + 1, dtype=torch.int64)) or None,
    lambda w, i, o: o.__setitem__(1, torch.zeros(BATCH - 2, dtype=torch.int64)) or None,
    lambda w, i, o: w.__setitem__(0, torch.zeros(ROWS[0] + 1, DIM)) or None,
    lambda w, i, o: w.__setitem__(2, torch.zeros(ROWS[2], DIM, dtype=torch.float16)) or None,
    lambda w, i, o: w.__setitem__(1, torch.zeros(ROWS[1] * DIM + 1)[1:].view(ROWS[1], DIM))
    or None,
    lambda w, i, o: w.__setitem__(0, torch.zeros(DIM, ROWS[0]).t()) or None,
    lambda w, i, o: (w.pop(), None)[1],
    lambda w, i, o: 3,          # not a multiple of the 2 ranks
    lambda w, i, o: 10,         # above max_batch (8)
    lambda w, i, o: 4.0,        # not an int
], ids=["int32-indices", "int32-offsets", "strided-offsets", "2d-indices", "over-max-lookups",
        "short-offsets", "wrong-rows", "wrong-dtype", "unaligned-table", "strided-table",
        "missing-table", "batch-not-a-multiple", "batch-above-max", "float-batch"])
def test_a_call_the_kernel_cannot_take_as_it_is_goes_to_the_general_path(monkeypatch, change):
    assert _declined(monkeypatch, change)


def test_more_tables_than_travel_inline_go_to_the_general_path(monkeypatch):
    _fake_gpu(monkeypatch)
    nt = INLINE + 1
    handle = types.SimpleNamespace(
        ctx=types.SimpleNamespace(device=torch.device("cuda", 0), timeout_s=30.0),
        mode="sum", num_tables=nt, total_tables=nt, table_base=0, dim=DIM, dtype=torch.float32,
        world=1, max_batch=8, max_lookups=MOST, table_rows=[4] * nt, _device_index=0)
    launch = gpu.TableEmbeddingLaunch(handle)
    launch.index = -1
    weights = [torch.zeros(4, DIM) for _ in range(nt)]
    indices = [torch.zeros(1, dtype=torch.int64) for _ in range(nt)]
    offsets = [torch.zeros(BATCH, dtype=torch.int64) for _ in range(nt)]
    assert launch.prepare(weights, indices, offsets, BATCH) is None


def _stacked(lookups=MOST, width=None):
    """Stacked lookups, [3, lookups] indices (rows of a [3, width] tensor when width is given:
    a row stride above the row's length) and [3, BATCH] offsets."""
    idx = torch.arange(3 * (width or lookups), dtype=torch.int64).view(3, width or lookups)
    off = torch.arange(3 * BATCH, dtype=torch.int64).view(3, BATCH)
    return idx[:, :lookups], off


@pytest.mark.parametrize("form", ["contiguous", "row-strided", "one-row-for-all"])
def test_stacked_lookups_write_the_words_their_rows_would_as_a_list(monkeypatch, form):
    weights, _, _ = _inputs()
    idx, off = _stacked(4, width=6 if form == "row-strided" else None)
    if form == "one-row-for-all":  # stride 0: every table reads the same row
        idx, off = idx[:1].expand(3, 4), off[:1].expand(3, BATCH)
    stacked, seen_stacked = _launch(monkeypatch)
    assert _call(stacked, weights, idx, off) == BATCH
    listed, seen_listed = _launch(monkeypatch)
    assert _call(listed, weights, list(idx), list(off)) == BATCH
    assert seen_stacked[0]["tables"] == seen_listed[0]["tables"]
    assert [t["indices"] for t in seen_stacked[0]["tables"]] == [r.data_ptr() for r in idx]
    assert [t["num_indices"] for t in seen_stacked[0]["tables"]] == [4, 4, 4]


def test_a_table_whose_storage_was_swapped_is_adopted_again_under_stacked_lookups(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, _, _ = _inputs()
    idx, off = _stacked()
    _call(launch, weights, idx, off)
    weights[2].data = torch.ones(ROWS[2], DIM)  # same object, new storage
    assert _call(launch, weights, idx, off) == BATCH
    assert seen[1]["tables"][2]["weights"] == weights[2].data_ptr()


@pytest.mark.parametrize("change", [
    lambda i, o: (i.int(), o, None),
    lambda i, o: (i, o.int(), None),
    lambda i, o: (i.t().contiguous().t(), o, None),
    lambda i, o: (i, o.t().contiguous().t(), None),
    lambda i, o: (i[:2], o, None),
    lambda i, o: (i, o[:2], None),
    lambda i, o: (torch.zeros(3, MOST + 1, dtype=torch.int64), o, None),
    lambda i, o: (i, list(o), None),
    lambda i, o: (i, o[0], None),
    lambda i, o: (i.view(-1), o, None),
    lambda i, o: (i, o, BATCH - 2),
    lambda i, o: (i, torch.zeros(3, 10, dtype=torch.int64), None),
    lambda i, o: (i, torch.zeros(3, 3, dtype=torch.int64), None),
], ids=["int32-indices", "int32-offsets", "column-major-indices", "column-major-offsets", "two-rows-of-indices",
        "two-rows-of-offsets", "over-max-lookups", "listed-offsets", "1d-offsets",
        "1d-indices", "batch-not-the-offsets", "batch-above-max", "batch-not-a-multiple"])
def test_stacked_lookups_the_kernel_cannot_take_as_they_are_go_to_the_general_path(
        monkeypatch, change):
    launch, seen = _launch(monkeypatch, world=2)
    weights, _, _ = _inputs()
    idx, off, batch = change(*_stacked())
    assert launch.prepare(weights, idx, off, batch) is None and not seen


def _stacked_records(seen):
    return [(t["indices"], t["offsets"], t["num_indices"]) for t in seen[-1]["tables"]]


def _rows_of(idx, off):
    return [(i.data_ptr(), o.data_ptr(), i.numel()) for i, o in zip(idx, off)]


def test_a_stacked_call_after_a_listed_one_writes_its_own_words_again(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    idx, off = _stacked(4)
    assert _call(launch, weights, idx, off) == BATCH
    assert _call(launch, weights, indices, offsets) == BATCH
    assert _call(launch, weights, idx, off) == BATCH  # the same stacked tensors as before
    assert _stacked_records(seen) == _rows_of(idx, off)


def test_stacked_calls_each_write_their_tensors_words(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, _, _ = _inputs()
    first, second = _stacked(4), _stacked(2, width=5)
    fewer = (first[0][:, :2], first[1])  # the same addresses and steps, fewer lookups
    for idx, off in (first, first, second, first, fewer, first):
        assert _call(launch, weights, idx, off) == BATCH
        assert _stacked_records(seen) == _rows_of(idx, off)


def test_each_fire_lands_its_own_batch_and_output(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    out, out2 = torch.zeros(BATCH, 5, DIM), torch.zeros(BATCH, 5, DIM)
    for o in (out, out, out2, out):
        assert launch.prepare(weights, indices, offsets, BATCH) == BATCH
        launch.fire(BATCH, o)
        assert (seen[-1]["batch"], seen[-1]["out"]) == (BATCH, o.data_ptr())


def test_a_listed_call_in_tuples_writes_the_same_words_as_in_lists(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    _call(launch, tuple(weights), tuple(indices), tuple(offsets))
    assert [t["indices"] for t in seen[0]["tables"]] == [i.data_ptr() for i in indices]
    assert [t["offsets"] for t in seen[0]["tables"]] == [o.data_ptr() for o in offsets]


def test_parameter_tables_are_taken_as_plain_tensors(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    params = [torch.nn.Parameter(w, requires_grad=False) for w in weights]
    assert _call(launch, params, indices, offsets) == BATCH
    assert [t["weights"] for t in seen[0]["tables"]] == [w.data_ptr() for w in weights]


class _Marked(torch.Tensor):
    """A tensor subclass: the fast path leaves it to the general path."""


def test_a_table_of_a_tensor_subclass_goes_to_the_general_path_at_once(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    weights[1] = weights[1].as_subclass(_Marked)
    adopted = []
    adopt = launch._adopt
    monkeypatch.setattr(launch, "_adopt", lambda w: adopted.append(1) or adopt(w))
    assert launch.prepare(weights, indices, offsets, BATCH) is None and not seen
    assert len(adopted) == 1  # adopted once, then declined: never adopted over and over


def test_lookups_on_another_device_go_to_the_general_path(monkeypatch):
    launch, seen = _launch(monkeypatch)
    weights, indices, offsets = _inputs()
    _call(launch, weights, indices, offsets)
    launch.index = 0  # the handle's GPU is device 0 now; the CPU lookups are elsewhere
    assert launch.prepare(weights, indices, offsets, BATCH) is None


def test_stacked_lookups_on_a_table_of_a_tensor_subclass_go_to_the_general_path(monkeypatch):
    # the stacked path has no writer check of the tables' types: the handle adopts only
    # plain tensors and Parameters (rocmoe.ops' functional op relies on it)
    launch, seen = _launch(monkeypatch)
    weights, _, _ = _inputs()
    weights[2] = weights[2].as_subclass(_Marked)
    idx, off = _stacked()
    assert launch.prepare(weights, idx, off, BATCH) is None and not seen
