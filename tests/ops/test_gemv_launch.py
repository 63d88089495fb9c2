"""GemvAllReduce's GPU argument writer (rocmoe.ops.gpu.GemvLaunch) writes each call's words
through an int64 view of rocmoe_gpu_gemv_args: every word must land in the field of rocmoe.h
it stands for, and K must be the call's (the functional op's cached handle serves every K of
an N). Checked on CPU with the launch replaced by a function that reads the struct back
through cffi."""

import types

import torch

from rocmoe._native import ffi
from rocmoe.ops import gpu
from rocmoe.ops.gpu import gemv_launch


def _launch(monkeypatch, n=6, k_local=4):
    monkeypatch.setattr(gemv_launch, "_fill", lambda ffi_, args, team, handle: None)
    monkeypatch.setattr(gemv_launch, "team_for", lambda ctx: None)
    monkeypatch.setattr(gpu.native_launch, "stream_getter",
                        lambda device: (lambda: 0x9000 + device.index))
    handle = types.SimpleNamespace(ctx=types.SimpleNamespace(device=torch.device("cuda", 1),
                                                         timeout_s=30.0),
                                   N=n, K_local=k_local)
    launch = gpu.GemvLaunch(handle)
    seen = []

    def fake(args, abort):
        seen.append(dict(stream=int(ffi.cast("intptr_t", args.fused.stream)), n=args.n,
                         k=args.k, w=int(ffi.cast("intptr_t", args.w)),
                         x=int(ffi.cast("intptr_t", args.x)),
                         out=int(ffi.cast("intptr_t", args.out)), abort=abort))
        return 0

    launch.fn = fake
    return launch, seen


def test_each_call_word_lands_in_its_field_of_the_c_struct(monkeypatch):
    launch, seen = _launch(monkeypatch)
    w, x, y = torch.zeros(6, 4), torch.zeros(4), torch.zeros(6)
    launch(w, x, y)
    assert seen == [dict(stream=0x9001, n=6, k=4, w=w.data_ptr(), x=x.data_ptr(),
                         out=y.data_ptr(), abort=0)]


def test_k_is_the_calls_not_the_handles(monkeypatch):
    launch, seen = _launch(monkeypatch, n=6, k_local=4)
    launch(torch.zeros(6, 9), torch.zeros(9), torch.zeros(6))
    assert (seen[-1]["n"], seen[-1]["k"]) == (6, 9)


def test_a_non_contiguous_w_is_passed_as_a_contiguous_copy(monkeypatch):
    launch, seen = _launch(monkeypatch)
    w_t = torch.arange(24.).reshape(4, 6).t()  # [6, 4], column-major
    launch(w_t, torch.zeros(4), torch.zeros(6))
    assert seen[-1]["w"] != w_t.data_ptr() and seen[-1]["k"] == 4


def test_each_call_lands_its_own_words_whichever_changed_since_the_last(monkeypatch):
    launch, seen = _launch(monkeypatch)
    w, x, y = torch.zeros(6, 4), torch.zeros(4), torch.zeros(6)
    w2, x2, y2 = torch.zeros(6, 5), torch.zeros(5), torch.zeros(6)
    calls = [(w, x, y), (w, x, y), (w, x, y2), (w2, x2, y2), (w, x, y)]
    for args in calls:
        launch(*args)
    assert [(s["k"], s["w"], s["x"], s["out"]) for s in seen] == [
        (a.shape[1], a.data_ptr(), b.data_ptr(), c.data_ptr()) for a, b, c in calls]
