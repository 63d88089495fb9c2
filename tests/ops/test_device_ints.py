"""DeviceInts (rocmoe/ops/gpu/team.py): device int64 tensors of host lists, cached, that the
GEMM handles pass to their kernels as counts; `of_ints`, the lean call's shortcut for a list
equal to the last one. On CPU the tensors live on the CPU; what is specified is the values
and which tensor comes back."""

import torch

from rocmoe.ops.gpu.team import DeviceInts


def test_a_call_gives_an_int64_tensor_of_the_values():
    ints = DeviceInts(torch.device("cpu"))
    t = ints([3, 0, 5])
    assert t.dtype == torch.int64 and t.tolist() == [3, 0, 5]


def test_equal_lists_get_the_cached_tensor():
    ints = DeviceInts(torch.device("cpu"))
    assert ints([4, 2]) is ints([4, 2])


def test_of_ints_gives_the_last_tensor_again_for_an_equal_list():
    ints = DeviceInts(torch.device("cpu"))
    first = ints.of_ints([7, 1])
    assert ints.of_ints([7, 1]) is first and first.tolist() == [7, 1]


def test_of_ints_sees_a_list_the_caller_changed_in_place():
    ints = DeviceInts(torch.device("cpu"))
    counts = [7, 1]
    ints.of_ints(counts)
    counts[0] = 6
    assert ints.of_ints(counts).tolist() == [6, 1]


def test_of_ints_alternating_lists_each_get_their_own_values():
    ints = DeviceInts(torch.device("cpu"))
    for _ in range(3):
        assert ints.of_ints([1, 2]).tolist() == [1, 2]
        assert ints.of_ints([2, 1]).tolist() == [2, 1]


def test_of_ints_last_tensor_stays_right_after_the_cache_dropped_it():
    ints = DeviceInts(torch.device("cpu"), keep=2)
    kept = ints.of_ints([9])
    ints([1])
    ints([2])
    ints([3])  # [9] has left the cache
    assert ints.of_ints([9]) is kept and kept.tolist() == [9]
