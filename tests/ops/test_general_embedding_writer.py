"""The general GPU embedding writer (rocmoe.ops.gpu.embedding: the functions' general path and
autograd's) keeps a handle's table records between calls and rewrites a table's pointer and
rows only when they changed. It holds no reference to the last call's tables, so a new table
can sit at a freed table's address: its own rows must still reach the kernel, which checks
the indices against them (an H100 run of tests/ops_gpu/public_ops_script.py found the old rows
kept: wrong results, then "the device found bad input"). Checked on CPU with the native call
replaced by a function that reads the struct back through cffi."""

import types

import torch

import rocmoe._native as native
from rocmoe._native import ffi
from rocmoe.ops import gpu
from rocmoe.ops.gpu import embedding_launch

DIM, BATCH = 8, 4


def _writer(monkeypatch):
    """A handle for gpu.embedding and the list each call's table records land in."""
    monkeypatch.setattr(embedding_launch, "_fill", lambda ffi_, args, team, handle: None)
    monkeypatch.setattr(embedding_launch, "team_for", lambda ctx: None)
    monkeypatch.setattr(embedding_launch, "inline_tables", lambda: 32)
    monkeypatch.setattr(embedding_launch, "_stream_ptr", lambda ffi_, device: ffi.NULL)
    monkeypatch.setattr(embedding_launch, "_launched", lambda args, handle: None)
    seen = []

    def launch(args, abort):
        seen.append([dict(weights=int(ffi.cast("intptr_t", t.weights)), rows=t.rows)
                     for t in (args.tables[i] for i in range(args.num_tables))])
        return 0

    monkeypatch.setattr(native, "lib", types.SimpleNamespace(rocmoe_gpu_embedding_a2a=launch))
    monkeypatch.setattr(native, "check", lambda rc, what: None)
    handle = types.SimpleNamespace(ctx=types.SimpleNamespace(device=torch.device("cpu")),
                                   total_tables=2, table_base=0, dim=DIM)
    return handle, seen


def _call(handle, tables):
    indices = [torch.zeros(3, dtype=torch.int64) for _ in tables]
    offsets = [torch.zeros(BATCH, dtype=torch.int64) for _ in tables]
    out = torch.empty(BATCH, len(tables), DIM)
    gpu.embedding(handle, tables, indices, offsets, None, BATCH, "sum", out)


def test_a_table_of_other_rows_at_the_last_tables_address_gets_its_own_rows(monkeypatch):
    handle, seen = _writer(monkeypatch)
    storage = torch.zeros(31, DIM)
    other = torch.zeros(20, DIM)
    _call(handle, [storage[:30], other])
    _call(handle, [storage[:31], other])  # the same pointers, one more row in table 0
    assert [[t["rows"] for t in call] for call in seen] == [[30, 20], [31, 20]]
    assert seen[1][0]["weights"] == storage.data_ptr()


def test_tables_at_new_addresses_get_their_pointers_and_rows(monkeypatch):
    handle, seen = _writer(monkeypatch)
    first = [torch.zeros(30, DIM), torch.zeros(20, DIM)]
    second = [torch.zeros(12, DIM), torch.zeros(20, DIM)]
    _call(handle, first)
    _call(handle, second)
    assert seen[1] == [dict(weights=t.data_ptr(), rows=t.shape[0]) for t in second]
