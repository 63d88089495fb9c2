"""rocmoe.init with an argument one rank gets wrong raises InvalidArgumentError on every rank
(that rank its own, the others naming it) instead of leaving the others in the bootstrap;
a good init works after (tests/runtime/rank_checks.py bad_init)."""

from __future__ import annotations

import re

import pytest

from rocmoe_testing import TESTS, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = TESTS / "runtime" / "rank_checks.py"


@pytest.fixture(scope="module")
def two_ranks():
    proc = run_mpi(SCRIPT, 2, "bad_init", timeout=120)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


@pytest.mark.parametrize("name,own", [
    ("heap_size_not_a_number", "heap_size must be a number"),
    ("timeout_not_a_number", "timeout_s must be a positive, finite number of seconds, got 'x'"),
    ("heap_below_the_minimum", "below the 4096-byte minimum"),
    ("heap_beyond_64_bits", "more than a 64-bit size holds"),
    ("heap_infinite", "heap_size must be a number of bytes, got inf"),
    ("timeout_negative", "timeout_s must be a positive, finite number of seconds, got -1"),
    ("timeout_nan", "timeout_s must be a positive, finite number of seconds, got nan"),
    ("timeout_infinite", "timeout_s must be a positive, finite number of seconds, got inf"),
    ("backend_not_a_name", "backend must be a name (a str), got list"),
    ("device_not_an_index", "device must be a GPU index (an int) or None, got '0'")])
def test_an_init_argument_one_rank_gets_wrong_raises_on_every_rank(two_ranks, name, own):
    lines = dict(re.findall(rf"^CHECK bad_init_{name} (\d) OK (.*)$", two_ranks, re.M))
    assert sorted(lines) == ["0", "1"], two_ranks
    assert own in lines["1"], lines["1"]
    assert "rocmoe.init failed on ranks [1]" in lines["0"], lines["0"]


def test_a_good_init_works_after_the_bad_ones(two_ranks):
    assert len(re.findall(r"^CHECK init_after_bad_inits \d OK", two_ranks, re.M)) == 2
    assert len(re.findall(r"^DONE \d$", two_ranks, re.M)) == 2


def test_a_gpu_index_torch_does_not_see_is_rejected_before_the_agreement(monkeypatch):
    from rocmoe import runtime
    from rocmoe.errors import InvalidArgumentError
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 2)
    runtime._check_device(1, "ipc")
    runtime._check_device(7, "host")  # the host backend uses no GPU: any index will do
    with pytest.raises(InvalidArgumentError, match="device 2 is not one of the 2 GPUs"):
        runtime._check_device(2, "ipc")
    with pytest.raises(InvalidArgumentError, match="device -1 is not one of the 2 GPUs"):
        runtime._check_device(-1, "nvshmem")
