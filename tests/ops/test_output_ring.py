"""OutputRing (rocmoe/ops/outputs.py): a handle's outputs are handed out again only when
nothing outside the ring refers to them. CPU tensors: the ring's bookkeeping does not
depend on the device."""

import torch

from rocmoe.ops.outputs import OutputRing


def _ring(slots=2):
    return OutputRing(lambda: (torch.empty(4, 3), torch.empty(2, dtype=torch.int64)), slots)


def _ptr(outputs):
    return outputs[0].data_ptr()


def test_an_output_the_caller_dropped_is_handed_out_again():
    ring = _ring()
    first = _ptr(ring.take(False))
    assert _ptr(ring.take(False)) == first
    assert ring.made == 1 and ring.reused == 1


def test_an_output_the_caller_holds_is_never_handed_out_again():
    ring = _ring()
    held = ring.take(False)
    other = ring.take(False)
    assert _ptr(other) != _ptr(held)


def test_holding_one_tensor_of_the_group_keeps_the_whole_group():
    ring = _ring(slots=1)
    out, recv = ring.take(False)
    del out
    assert ring.take(False)[1].data_ptr() != recv.data_ptr()


def _kept_while_held(hold):
    """An output the caller dropped while `hold(out)` still refers to it is not handed out
    again; once that holder is gone, it is."""
    ring = _ring(slots=1)
    outputs = ring.take(False)
    holder, ptr = hold(outputs[0]), _ptr(outputs)
    del outputs
    assert _ptr(ring.take(False)) != ptr
    del holder
    assert _ptr(ring.take(False)) == ptr


def test_a_view_of_a_dropped_output_keeps_it():
    _kept_while_held(lambda out: out[1:])


def test_a_detached_alias_of_a_dropped_output_keeps_it():
    _kept_while_held(lambda out: out.detach())


def test_an_output_autograd_saved_is_kept_until_the_graph_is_dropped():
    w = torch.ones(3, requires_grad=True)
    _kept_while_held(lambda out: (out * w).sum())  # mul saves out for dw


def test_an_output_resized_in_place_is_not_handed_out_again():
    ring = _ring(slots=1)
    outputs = ring.take(False)
    ptr = _ptr(outputs)
    outputs[0].resize_(2, 3)
    del outputs
    again = ring.take(False)
    assert _ptr(again) != ptr and tuple(again[0].shape) == (4, 3)


def test_an_output_made_to_require_grad_is_not_handed_out_again():
    ring = _ring(slots=1)
    outputs = ring.take(False)
    ptr = _ptr(outputs)
    outputs[0].requires_grad_(True)
    del outputs
    assert _ptr(ring.take(False)) != ptr


def test_a_capturing_call_gets_a_new_output_and_the_ring_does_not_keep_it():
    ring = _ring()
    captured = ring.take(True)
    assert ring.made == 0
    del captured
    assert ring.take(True) is not None and ring.made == 0


def test_an_output_goes_back_out_only_on_the_stream_it_was_last_used_on():
    ring = _ring()
    ptr = _ptr(ring.take(False, stream=1))
    assert _ptr(ring.take(False, stream=2)) != ptr
    assert _ptr(ring.take(False, stream=1)) == ptr


def test_the_ring_keeps_at_most_its_slots_and_clear_frees_them():
    ring = _ring(slots=2)
    held = [ring.take(False) for _ in range(4)]
    assert ring.made == 2 and len(ring._entries) == 2
    ring.clear()
    del held
    assert ring._entries == []
