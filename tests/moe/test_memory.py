"""Memory of the MoE layer: the accounting counts exactly, and the layer keeps no more than
the grouped-GEMM layer a torch user writes, for the same routing, on every benchmark shape.

The layer's GPU code path runs on meta tensors with its kernel launches skipped
(rocmoe.bench.moe_memory): its launchers allocate what they allocate on a GPU, and the
tracker counts every storage, so the real shapes cost milliseconds and no GPU.
"""

import pytest
import torch

from rocmoe.bench.memory import saved_for_backward, step_memory, track_memory
from rocmoe.bench.moe_layer import DEFAULT_SHAPES, VARIANT_KEYS
from rocmoe.bench.moe_memory import layer_memory
from rocmoe.moe import blocksparse as bs


def test_tracker_counts_live_storages_and_the_peak_in_allocator_blocks():
    kept = torch.empty(10)  # created before: not counted
    with track_memory() as trace:
        a = torch.empty(1000)       # 4000 bytes: a 4096-byte block
        b = torch.empty(100)        # 400 bytes: a 512-byte block
        view = b.view(10, 10)       # a view allocates nothing
        b.add_(1)                   # neither does an in-place op
        kept.mul_(2)
        del a
        live_then = trace.live
    assert trace.peak == 4096 + 512 and live_then == 512 and trace.created == 2
    del b, view


def test_saved_for_backward_counts_what_the_graph_keeps_of_the_forward_only():
    w = torch.randn(256, requires_grad=True)  # a weight: the caller's, not counted
    with track_memory() as trace, saved_for_backward(trace) as saved:
        h = w * 2        # a scalar product keeps nothing
        y = h.exp()      # exp keeps its output: 1024 bytes
        z = y * w        # keeps y (counted once) and w (not created here)
    assert saved["bytes"] == 1024 and saved["tensors"] == 1
    del z


def test_step_memory_separates_what_the_forward_keeps_from_the_backward_peak():
    w = torch.randn(1024, requires_grad=True)
    mem = step_memory(lambda: (w * w).exp().sum(), lambda y: torch.autograd.grad(y, [w]))
    # the forward keeps exp's output (4 KiB, saved) and returns the scalar (one block); the
    # square is freed; the backward's gradients of 4 KiB come on top
    assert mem.saved == 4096 and mem.after_forward == 4096 + 512
    assert mem.peak >= mem.after_forward + 2 * 4096


@pytest.mark.parametrize("shape", DEFAULT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_keeps_no_more_than_the_grouped_gemm_layer(shape):
    # the default variant: saved for the backward, alive after the forward, and the peak
    ours, theirs = layer_memory(shape, tuple(bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS))
    assert ours.saved <= theirs.saved, (ours, theirs)
    assert ours.after_forward <= theirs.after_forward, (ours, theirs)
    assert ours.peak <= theirs.peak, (ours.peak / theirs.peak, ours, theirs)
