"""The HIP kernels of EmbeddingAllToAll and GemvAllReduce wait ROCMOE_FIRST_CALL_TIMEOUT_S for
their peers on a handle's first call (a peer may still be in the JIT of another handle or of
torch when it reaches it) and the context's timeout on every later call, as the GEMM plans
do (test_triton_launcher). Checked on CPU: the real _fill writes the struct, the launch is
replaced by a function that reads fused.timeout_s back."""

import types

import pytest
import torch

from rocmoe.ops import gpu
from rocmoe.ops.gpu import embedding_launch, gemv_launch, team
from rocmoe.ops.layout import make_layout


@pytest.fixture
def first_call_300(monkeypatch):
    monkeypatch.setattr(team, "_interpreting", lambda: False)
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "300")
    stand_in = types.SimpleNamespace(peer_bases=torch.zeros(2, dtype=torch.int64), rank=0,
                                 world=2, ranks_per_node=2)
    for module in (embedding_launch, gemv_launch):
        monkeypatch.setattr(module, "team_for", lambda ctx: stand_in)
    monkeypatch.setattr(gpu.native_launch, "stream_getter", lambda device: (lambda: 0))


def _handle(op, **fields):
    layout = make_layout(op, 2, 0, 8, 4, 4)
    ctx = types.SimpleNamespace(device=torch.device("cpu"), timeout_s=3.0)
    return types.SimpleNamespace(ctx=ctx, layout=layout, workspace=torch.zeros(64),
                                 status_address=0, **fields)


def _waits(launch, call, times=3):
    seen = []
    launch.fn = lambda args, abort: seen.append(args.fused.timeout_s) or 0
    for _ in range(times):
        call()
    return seen


def test_a_gemv_handles_first_call_waits_the_first_call_timeout_and_later_ones_the_timeout(
        first_call_300):
    launch = gpu.GemvLaunch(_handle("gemv_all_reduce", N=6, K_local=4))
    seen = _waits(launch, lambda: launch(torch.zeros(6, 4), torch.zeros(4), torch.zeros(6)))
    assert seen == [300.0, 3.0, 3.0]


def test_a_packed_embedding_handles_first_call_waits_the_first_call_timeout(first_call_300):
    handle = _handle("embedding_all_to_all", mode="sum", num_tables=1, total_tables=2,
                     table_base=0, dim=4, _row_base_t=torch.tensor([0, 5]))
    launch = gpu.PackedEmbeddingLaunch(handle)
    seen = _waits(launch, lambda: launch(torch.zeros(5, 4), torch.zeros(3, dtype=torch.int64),
                                         torch.arange(3), None, 2, torch.zeros(2, 2, 4)))
    assert seen == [300.0, 3.0, 3.0]


def test_the_first_call_timeout_is_never_below_the_contexts(first_call_300):
    assert gpu.first_call_timeout_s(3.0) == 300.0
    assert gpu.first_call_timeout_s(400.0) == 400.0


def test_a_per_table_embedding_handles_first_call_waits_the_first_call_timeout(
        first_call_300, monkeypatch):
    from rocmoe import _native
    seen = []
    monkeypatch.setattr(_native, "lib", types.SimpleNamespace(
        ROCMOE_OK=_native.lib.ROCMOE_OK,
        rocmoe_gpu_embedding_inline_tables=lambda: 8,  # the records inline, no device copy
        rocmoe_gpu_embedding_a2a=lambda args, abort: seen.append(args.fused.timeout_s) or 0))
    handle = _handle("embedding_all_to_all", total_tables=2, table_base=0, dim=4)
    table = torch.zeros(5, 4)
    for _ in range(3):
        gpu.embedding(handle, [table], [torch.zeros(3, dtype=torch.int64)], [torch.arange(2)],
                      None, 2, "sum", torch.zeros(1, 2, 4))
    assert seen == [300.0, 3.0, 3.0]


def test_a_bad_first_call_timeout_is_a_clear_error(first_call_300, monkeypatch):
    from rocmoe import errors
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "soon")
    with pytest.raises(errors.InvalidArgumentError, match="ROCMOE_FIRST_CALL_TIMEOUT_S"):
        gpu.first_call_timeout_s(3.0)
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "0")  # allowed: the plain timeout
    assert gpu.first_call_timeout_s(3.0) == 3.0


def test_a_per_table_embedding_handles_fast_path_waits_the_first_call_timeout_once(
        first_call_300, monkeypatch):
    # the launch EmbeddingAllToAll's no-grad per-table calls take (TableEmbeddingLaunch)
    monkeypatch.setattr(embedding_launch, "inline_tables", lambda: 8)
    handle = _handle("embedding_all_to_all", mode="sum", num_tables=1, total_tables=2,
                     table_base=0, dim=4, dtype=torch.float32, world=2, max_batch=4,
                     max_lookups=8, table_rows=[5], _device_index=0)
    launch = gpu.TableEmbeddingLaunch(handle)
    launch.index = -1  # CPU tensors stand for the GPU's
    table = torch.zeros(5, 4)

    def call():
        batch = launch.prepare([table], [torch.zeros(3, dtype=torch.int64)],
                               [torch.arange(2)], None)
        launch.fire(batch, torch.zeros(1, 2, 4))
    assert _waits(launch, call) == [300.0, 3.0, 3.0]
