"""EmbeddingAllToAll.batched's GPU argument writer (rocmoe.ops.gpu.PackedEmbeddingLaunch)
writes each call's words through an int64 view of rocmoe_gpu_embedding_args: every word must
land in the field of rocmoe.h it stands for. Checked on CPU with the launch replaced by a
function that reads the struct back through cffi."""

import types

import torch

from rocmoe._native import ffi
from rocmoe.ops import gpu
from rocmoe.ops._common import MODES
from rocmoe.ops.gpu import embedding_launch


def _launch(monkeypatch):
    monkeypatch.setattr(embedding_launch, "_fill", lambda ffi_, args, team, handle: None)
    monkeypatch.setattr(embedding_launch, "team_for", lambda ctx: None)
    monkeypatch.setattr(gpu.native_launch, "stream_getter",
                        lambda device: (lambda: 0x7000 + device.index))
    handle = types.SimpleNamespace(ctx=types.SimpleNamespace(device=torch.device("cuda", 2),
                                                         timeout_s=30.0),
                                   mode="mean", num_tables=3, total_tables=5,
                                   table_base=1, dim=8,
                                   _row_base_t=torch.tensor([0, 4, 9, 15]))
    launch = gpu.PackedEmbeddingLaunch(handle)
    seen = {}

    def fake(args, abort):
        p = args.packed
        seen.update(stream=int(ffi.cast("intptr_t", args.fused.stream)), batch=args.batch,
                    out=int(ffi.cast("intptr_t", args.out)),
                    weights=int(ffi.cast("intptr_t", p.weights)),
                    indices=int(ffi.cast("intptr_t", p.indices)),
                    offsets=int(ffi.cast("intptr_t", p.offsets)),
                    psw=int(ffi.cast("intptr_t", p.per_sample_weights)),
                    num_indices=p.num_indices,
                    row_base=int(ffi.cast("intptr_t", p.row_base)), mode=args.mode,
                    tables=(args.num_tables, args.total_tables, args.table_base, args.dim),
                    abort=abort)
        return 0

    launch.fn = fake
    return launch, handle, seen


def test_each_call_word_lands_in_its_field_of_the_c_struct(monkeypatch):
    launch, handle, seen = _launch(monkeypatch)
    weight, out = torch.zeros(15, 8), torch.zeros(4, 5, 8)
    idx, off = torch.zeros(11, dtype=torch.int64), torch.arange(13, dtype=torch.int64)
    psw = torch.ones(11)
    launch(weight, idx, off, psw, 4, out)
    assert seen == dict(stream=0x7002, batch=4, out=out.data_ptr(), weights=weight.data_ptr(),
                        indices=idx.data_ptr(), offsets=off.data_ptr(), psw=psw.data_ptr(),
                        num_indices=11, row_base=handle._row_base_t.data_ptr(),
                        mode=MODES["mean"], tables=(3, 5, 1, 8), abort=0)


def test_a_call_without_per_sample_weights_passes_null(monkeypatch):
    launch, _, seen = _launch(monkeypatch)
    weight, out = torch.zeros(15, 8), torch.zeros(4, 5, 8)
    launch(weight, torch.zeros(3, dtype=torch.int64), torch.arange(13), torch.ones(3), 4, out)
    launch(weight, torch.zeros(3, dtype=torch.int64), torch.arange(13), None, 4, out)
    assert seen["psw"] == 0 and seen["num_indices"] == 3


def test_int32_indices_and_offsets_are_widened_before_the_launch(monkeypatch):
    launch, _, seen = _launch(monkeypatch)
    idx32 = torch.zeros(5, dtype=torch.int32)
    launch(torch.zeros(15, 8), idx32, torch.arange(13, dtype=torch.int32), None, 4,
           torch.zeros(4, 5, 8))
    assert seen["indices"] != idx32.data_ptr() and seen["num_indices"] == 5


def test_each_call_lands_its_own_words_whichever_changed_since_the_last(monkeypatch):
    launch, _, seen = _launch(monkeypatch)
    weight, out, out2 = torch.zeros(15, 8), torch.zeros(4, 5, 8), torch.zeros(2, 5, 8)
    idx, off = torch.zeros(11, dtype=torch.int64), torch.arange(13, dtype=torch.int64)
    idx2 = torch.zeros(7, dtype=torch.int64)
    calls = [(idx, 4, out), (idx, 4, out), (idx2, 4, out), (idx2, 2, out2), (idx, 4, out)]
    for i, batch, o in calls:
        launch(weight, i, off, None, batch, o)
        assert (seen["indices"], seen["num_indices"], seen["batch"], seen["out"]) == \
            (i.data_ptr(), i.numel(), batch, o.data_ptr())
