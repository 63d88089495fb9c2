"""The per-step forward + backward timing of a vExpert layer (rocmoe/moe/vexpert_clock.py),
in process on one rank."""

import time

import torch

from rocmoe.moe import DroplessMoE
from rocmoe.moe.vexpert_clock import LayerClock


def _layer():
    torch.manual_seed(0)
    return DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")


def test_a_step_is_timed_from_the_layers_forward_and_backward_only():
    layer = _layer()
    clock = LayerClock(layer)
    x = torch.randn(32, 8)
    t0 = time.perf_counter()
    y = layer(x)
    time.sleep(0.05)            # the rest of the model between forward and backward
    y.square().sum().backward()
    wall_ms = (time.perf_counter() - t0) * 1e3
    clock.close_step()
    placement, ms = clock.last_step()
    assert placement == layer.dispatcher.placement
    assert 0 < ms < wall_ms - 40


def test_a_step_without_a_backward_is_not_timed():
    layer = _layer()
    clock = LayerClock(layer)
    layer(torch.randn(32, 8))
    clock.close_step()
    assert clock.last_step() is None


def test_a_step_with_two_forwards_is_not_timed():
    layer = _layer()
    clock = LayerClock(layer)
    (layer(torch.randn(32, 8)).sum() + layer(torch.randn(32, 8)).sum()).backward()
    clock.close_step()
    assert clock.last_step() is None


def test_inference_does_not_disturb_the_step_being_timed():
    layer = _layer()
    clock = LayerClock(layer)
    y = layer(torch.randn(32, 8))
    with torch.no_grad():
        layer(torch.randn(32, 8))
    y.sum().backward()
    clock.close_step()
    assert clock.last_step() is not None


def test_a_removed_clock_times_nothing():
    layer = _layer()
    clock = LayerClock(layer)
    clock.remove()
    layer(torch.randn(32, 8)).sum().backward()
    clock.close_step()
    assert clock.last_step() is None
