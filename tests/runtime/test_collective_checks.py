"""A collective Context call (ctx.empty, ctx.allgather_ints) with an argument one rank gets
wrong raises on every rank (that rank its own error, the others InvalidArgumentError naming
it) instead of raising on that rank alone while the others wait in the call's agreement;
the heap is unchanged and the next collective pairs with the next (tests/runtime/
rank_checks.py bad_collectives)."""

from __future__ import annotations

import re

import pytest

from rocmoe_testing import TESTS, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = TESTS / "runtime" / "rank_checks.py"

EMPTY = {"empty_float_shape": "shape must be a tuple of ints, got (4.5,)",
         "empty_string_shape": "shape must be a tuple of ints, got ('12',)",
         "empty_beyond_64_bits": "bytes, more than any heap holds",
         "empty_unhashable_dtype": "cannot live on the symmetric heap"}
ALLGATHER = {"allgather_fourteen_values": "14 values, more than the 13 it carries",
             "allgather_a_string": "not a sequence of integers (got ['a'])",
             "allgather_a_float": "not a sequence of integers (got [1.5])",
             "allgather_beyond_int64": "does not fit an int64",
             "allgather_none": "not a sequence of integers (got None)"}


@pytest.fixture(scope="module")
def two_ranks():
    proc = run_mpi(SCRIPT, 2, "bad_collectives", timeout=180)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def _lines(output, name):
    lines = dict(re.findall(rf"^CHECK {name} (\d) OK ?(.*)$", output, re.M))
    assert sorted(lines) == ["0", "1"], output
    return lines


@pytest.mark.parametrize("name,own", sorted(EMPTY.items()))
def test_an_allocation_one_rank_gets_wrong_raises_on_every_rank(two_ranks, name, own):
    lines = _lines(two_ranks, name)
    assert own in lines["1"], lines["1"]
    assert "ranks [1] passed an invalid shape or dtype to ctx.empty()" in lines["0"], lines["0"]


@pytest.mark.parametrize("name,own", sorted(ALLGATHER.items()))
def test_allgather_values_one_rank_cannot_send_raise_on_every_rank(two_ranks, name, own):
    lines = _lines(two_ranks, name)
    assert own in lines["1"], lines["1"]
    assert "ranks [1] passed values allgather_ints cannot carry" in lines["0"], lines["0"]


@pytest.mark.parametrize("name", sorted(EMPTY) + sorted(ALLGATHER))
def test_the_heap_is_unchanged_and_the_next_collective_pairs_after_a_rejected_call(two_ranks,
                                                                                    name):
    _lines(two_ranks, f"heap_unchanged_after_{name}")
    _lines(two_ranks, f"next_collective_after_{name}")


def test_allgather_ints_carries_thirteen_values(two_ranks):
    _lines(two_ranks, "allgather_thirteen_values")
    assert len(re.findall(r"^DONE \d$", two_ranks, re.M)) == 2
