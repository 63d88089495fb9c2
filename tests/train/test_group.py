"""The training loop's collectives on 2 MPI ranks (tests/train/group_script.py): gradient
averaging, the replica check, the stop vote, and bounded waits."""

from __future__ import annotations

import pytest

from rocmoe_testing import TESTS, mpi_env, run_mpi

TIMEOUT_S = 2


@pytest.fixture(scope="module")
def checks():
    proc = run_mpi(TESTS / "train" / "group_script.py", 2, TIMEOUT_S, timeout=120,
                   env=mpi_env(ROCMOE_TIMEOUT_S=TIMEOUT_S))
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, status = line.split(" ", 2)
            found[name] = status
    return found, proc


@pytest.mark.mpi
@pytest.mark.parametrize("name", [
    "replicated_gradients_are_averaged",
    "local_gradients_are_divided_by_world",
    "differing_replicas_are_refused_everywhere",
    "a_problem_on_one_rank_raises_on_every_rank",
    "no_problem_raises_nothing",
    "differing_values_raise_on_every_rank",
    "no_stop_without_a_request",
    "a_stop_on_one_rank_stops_every_rank",
    "a_missing_rank_times_out",
])
def test_group_behaviour(checks, name):
    found, proc = checks
    assert found.get(name) == "ok", proc.stdout[-3000:]


@pytest.mark.mpi
def test_a_timed_out_collective_aborts_the_job_instead_of_hanging_at_exit(checks):
    _, proc = checks
    assert proc.returncode != 0  # the atexit abort: MPI_Finalize could wait forever
