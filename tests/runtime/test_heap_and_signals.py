"""The symmetric heap and signal contract (DESIGN.md), on 1, 2 and 4 host ranks.

One mpiexec launch per world size runs every check of tests/runtime/rank_checks.py (mpiexec
and torch start-up dominate); each test below asserts one behaviour from that run on every rank.
"""

from __future__ import annotations

import re
import time

import pytest

from rocmoe_testing import KEEP_RUNNING_AFTER_A_RANK_DIES, TESTS, mpi_env, run_mpi

SCRIPT = TESTS / "runtime" / "rank_checks.py"
WORLDS = [1, 2, 4]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"{n}ranks")
def suite(request):
    n = request.param
    proc = run_mpi(SCRIPT, n, "suite", timeout=240)
    results = {}
    for name, rank, status, detail in re.findall(r"^CHECK (\S+) (\d+) (OK|FAIL) ?(.*)$",
                                                 proc.stdout, re.M):
        results.setdefault(name, {})[int(rank)] = (status, detail)
    return n, proc, results


def assert_on_every_rank(suite, name, detail_pattern=None):
    n, proc, results = suite
    got = results.get(name, {})
    assert sorted(got) == list(range(n)), f"{name} reported by ranks {sorted(got)}:\n{proc.stdout}"
    for rank, (status, detail) in got.items():
        assert status == "OK", f"rank {rank}: {name} failed: {detail}"
        if detail_pattern:
            assert re.search(detail_pattern, detail), f"rank {rank}: {detail!r}"


def test_job_finishes_cleanly(suite):
    n, proc, _ = suite
    assert proc.returncode == 0, proc.stdout
    assert len(re.findall(r"^DONE \d+$", proc.stdout, re.M)) == n


def test_no_host_segment_of_the_job_is_left_in_dev_shm_after_init(suite):
    assert_on_every_rank(suite, "segments_unlinked_after_init")


def test_ring_exchange_by_put_and_signal_delivers_data(suite):
    assert_on_every_rank(suite, "ring_exchange")


def test_signal_adds_from_every_rank_at_once_sum_exactly(suite):
    assert_on_every_rank(suite, "signal_add_sums")


@pytest.mark.parametrize("label", ["eq", "ne", "gt", "ge", "lt", "le"])
def test_every_wait_until_comparison_waits_while_false_and_releases_when_true(suite, label):
    assert_on_every_rank(suite, f"wait_until_{label}")


def test_peer_view_aliases_the_peers_memory(suite):
    assert_on_every_rank(suite, "peer_view")


def test_get_reads_the_peers_copy(suite):
    assert_on_every_rank(suite, "get")


def test_allocation_offsets_are_identical_on_every_rank(suite):
    assert_on_every_rank(suite, "offsets_symmetric")


def test_free_returns_memory_to_the_heap(suite):
    assert_on_every_rank(suite, "free_reuses_memory")


def test_size_mismatch_raises_heap_mismatch_on_every_rank(suite):
    pattern = r"HeapMismatchError: .*differs across ranks" if suite[0] > 1 else "single rank"
    assert_on_every_rank(suite, "size_mismatch", pattern)


def test_dtype_mismatch_raises_heap_mismatch_on_every_rank(suite):
    assert_on_every_rank(suite, "dtype_mismatch",
                         r"HeapMismatchError" if suite[0] > 1 else "single rank")


def test_order_mismatch_raises_heap_mismatch_on_every_rank(suite):
    assert_on_every_rank(suite, "order_mismatch",
                         r"HeapMismatchError" if suite[0] > 1 else "single rank")


def test_free_of_different_tensors_raises_heap_mismatch_on_every_rank(suite):
    assert_on_every_rank(suite, "free_mismatch",
                         r"HeapMismatchError: ranks freed different" if suite[0] > 1
                         else "single rank")


def test_invalid_shape_on_one_rank_raises_on_every_rank(suite):
    assert_on_every_rank(suite, "shape_invalid_on_one_rank", r"InvalidArgumentError")


FAILED_HEAP_CALLS = ["size_mismatch", "dtype_mismatch", "order_mismatch", "free_mismatch",
                     "shape_invalid_on_one_rank", "heap_exhausted", "bad_dtype"]


@pytest.mark.parametrize("name", FAILED_HEAP_CALLS)
def test_failed_heap_call_leaves_free_bytes_largest_block_and_allocations_unchanged(suite, name):
    # the rollback promise: a call that raised on any rank changed no rank's heap
    assert_on_every_rank(suite, f"heap_unchanged_after_{name}")


def test_heap_stays_symmetric_after_errors(suite):
    assert_on_every_rank(suite, "heap_intact_after_errors")


def test_exhaustion_names_requested_and_free_bytes(suite):
    assert_on_every_rank(suite, "heap_exhausted",
                         r"HeapExhaustedError: .*requested 33554432 bytes.*\d+ bytes free")


def test_wait_times_out_naming_rank_peer_and_slot(suite):
    assert_on_every_rank(suite, "wait_timeout",
                         r"CommTimeoutError: .*rank \d+ timed out .*waiting for rank \d+ .*slot at offset \d+")


def test_peer_out_of_range_is_rejected(suite):
    assert_on_every_rank(suite, "peer_out_of_range", r"out of range")


def test_free_of_a_tensor_not_from_the_heap_is_rejected(suite):
    assert_on_every_rank(suite, "free_not_on_heap", r"NotOnHeapError")


def test_put_larger_than_destination_is_rejected(suite):
    assert_on_every_rank(suite, "put_too_large", r"do not fit")


def test_unsupported_dtype_is_rejected(suite):
    assert_on_every_rank(suite, "bad_dtype", r"DTypeError")


def test_use_after_finalize_raises_context_error(suite):
    assert_on_every_rank(suite, "use_after_finalize", r"ContextError: .*finalized")
    assert_on_every_rank(suite, "barrier_after_finalize", r"ContextError")


def test_waiting_on_a_dead_rank_raises_peer_dead_error_naming_it_within_the_bound():
    # The launcher lets the survivor run on after rank 1 dies (else it would kill rank 0
    # before rocmoe noticed anything): rank 0's wait must end by rocmoe's liveness check,
    # with PeerDeadError naming rank 1, well inside the wait's 20 s bound.
    proc = run_mpi(SCRIPT, 2, "dead_rank", timeout=120, env=mpi_env(WAIT_S="20"),
                   launcher_args=KEEP_RUNNING_AFTER_A_RANK_DIES)
    found = re.search(r"^CHECK dead_rank 0 OK (\w+) after ([\d.]+)s: (.*)$", proc.stdout, re.M)
    assert found, proc.stdout
    error, seconds, message = found.group(1), float(found.group(2)), found.group(3)
    assert error == "PeerDeadError", proc.stdout
    assert "rank 0 waited on signal slot" in message and "for rank 1, which has exited" in message
    assert seconds < 5, f"the dead peer was noticed only after {seconds} s"


def test_rank_that_never_joins_a_barrier_gives_timeout_not_hang():
    start = time.monotonic()
    proc = run_mpi(SCRIPT, 2, "absent_rank", timeout=120)
    elapsed = time.monotonic() - start
    assert "CHECK absent_rank 0 OK" in proc.stdout, proc.stdout
    assert "barrier did not complete within 2 s" in proc.stdout
    assert proc.returncode != 0
    assert elapsed < 30, f"job took {elapsed:.0f}s to end after the timeout"
