"""The two writers of a listed embedding call's per-table words (rocmoe/ops/gpu/records.py):
the C++ one (_rocmoe_records) and the Python one it falls back to must give the same code
and write the same words for every input, since which one runs depends on the build."""

import pytest
import torch

from rocmoe.ops.gpu import records

STRIDE, FIELDS = 6, (0, 1, 2, 5)
ROWS, DIM, BATCH, MOST = (5, 7, 9), 4, 4, 6


def _native():
    native = records.native_writer()
    if native is None:
        pytest.skip(f"_rocmoe_records is not built: {records.native_problem()}")
    return native


def _records(weights):
    rec = torch.zeros(len(ROWS) * STRIDE, dtype=torch.int64)
    for t, w in enumerate(weights):
        rec[t * STRIDE + FIELDS[0]] = w.data_ptr()
    return rec


def _inputs():
    weights = [torch.zeros(r, DIM) for r in ROWS]
    indices = [torch.arange(n, dtype=torch.int64) for n in (3, 0, MOST)]
    offsets = [torch.zeros(BATCH, dtype=torch.int64) for _ in ROWS]
    return weights, indices, offsets


def _both(weights, indices, offsets, rec_weights=None, device=-1, batch=BATCH, most=MOST):
    """(code, words) from the C++ writer and from the Python writer, on fresh records."""
    native = _native()
    results = []
    for write in ("native", "python"):
        rec = _records(rec_weights or weights)
        if write == "native":
            code = native(weights, indices, offsets, rec.data_ptr(), STRIDE, FIELDS, device,
                          batch, most)
        else:
            code = records.write_lookups_python(weights, indices, offsets,
                                                memoryview(rec.numpy()), STRIDE, FIELDS,
                                                device, batch, most)
        results.append((code, rec.tolist()))
    return results


def test_the_writers_return_the_same_codes():
    _native()
    from rocmoe import _rocmoe_records as native
    assert (native.WRITTEN, native.DECLINE, native.MOVED) == (
        records.WRITTEN, records.DECLINE, records.MOVED)


def test_both_writers_write_each_tables_addresses_and_count():
    weights, indices, offsets = _inputs()
    (code, words), python = _both(weights, indices, offsets)
    assert (code, words) == python
    assert code == records.WRITTEN
    for t, (w, i, o) in enumerate(zip(weights, indices, offsets)):
        assert words[t * STRIDE:(t + 1) * STRIDE] == [w.data_ptr(), i.data_ptr(), o.data_ptr(),
                                                      0, 0, i.numel()]


def _int32(x):
    return x.to(torch.int32)


@pytest.mark.parametrize("change, code", [
    (lambda w, i, o: i.__setitem__(1, _int32(i[1])), records.DECLINE),
    (lambda w, i, o: o.__setitem__(0, _int32(o[0])), records.DECLINE),
    (lambda w, i, o: o.__setitem__(2, torch.zeros(2 * BATCH, dtype=torch.int64)[::2]),
     records.DECLINE),
    (lambda w, i, o: i.__setitem__(0, torch.zeros(3, 1, dtype=torch.int64)), records.DECLINE),
    (lambda w, i, o: i.__setitem__(2, torch.zeros(MOST + 1, dtype=torch.int64)),
     records.DECLINE),
    (lambda w, i, o: o.__setitem__(1, torch.zeros(BATCH - 1, dtype=torch.int64)),
     records.DECLINE),
    (lambda w, i, o: i.__setitem__(1, [0, 1]), records.DECLINE),
    (lambda w, i, o: i.pop(), records.DECLINE),
    (lambda w, i, o: w.__setitem__(2, torch.zeros(ROWS[2], DIM)), records.MOVED),
], ids=["int32-indices", "int32-offsets", "strided-offsets", "2d-indices", "over-most",
        "short-offsets", "indices-not-a-tensor", "one-table-short", "moved-table"])
def test_both_writers_refuse_the_same_inputs_alike(change, code):
    weights, indices, offsets = _inputs()
    adopted = list(weights)
    change(weights, indices, offsets)
    native, python = _both(weights, indices, offsets, rec_weights=adopted)
    assert native[0] == python[0] == code


def test_a_sequence_other_than_a_list_or_tuple_is_declined():
    weights, indices, offsets = _inputs()
    native, python = _both(weights, iter(indices), offsets)
    assert native[0] == python[0] == records.DECLINE


def test_lookups_on_another_device_are_declined():
    weights, indices, offsets = _inputs()
    native, python = _both(weights, indices, offsets, device=0)
    assert native[0] == python[0] == records.DECLINE
