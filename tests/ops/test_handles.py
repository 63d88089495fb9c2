"""The persistent fused-op handles on the host backend: results equal the MPI references,
backward too; creation agreed across ranks; a rank that rejects its input aborts the call on
every rank without a hang, with the heap as it was and the handle still usable; a missing
rank ends every other rank's wait in CommTimeoutError naming it."""

import pytest

from rocmoe_testing import TESTS, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = TESTS / "ops" / "handles_script.py"


def _run(ranks, *groups, **env):
    proc = run_mpi(SCRIPT, ranks, *groups, timeout=240,
                   env=mpi_env(OMP_NUM_THREADS="1", ROCMOE_HOST_WORKERS="2", **env))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    return proc, "\n".join(lines)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_handles_equal_the_references_forward_and_backward(ranks):
    proc, text = _run(ranks, "match", "backward")
    assert proc.returncode == 0, proc.stdout
    assert text.count(" ok ") == 6 * ranks and "FAIL" not in text, text


@pytest.mark.parametrize("ranks", [2, 4])
def test_bad_input_on_one_rank_raises_on_every_rank_and_leaves_the_handle_usable(ranks):
    proc, text = _run(ranks, "create_mismatch", "abort")
    assert proc.returncode == 0, proc.stdout
    # 4 creation checks + 12 bad calls and 12 calls after them, on every rank
    assert text.count(" ok ") == 28 * ranks and "FAIL" not in text, text


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_missing_rank_ends_every_wait_in_comm_timeout_error_naming_it(ranks):
    proc, text = _run(ranks, "timeout", ROCMOE_TIMEOUT_S="3")
    assert proc.returncode == 0, proc.stdout
    assert text.count("CommTimeoutError naming the rank") == ranks - 1, text
    assert text.count("refuses further calls") == ranks - 1 and "FAIL" not in text, text
    assert text.count("a new handle on the same context is created") == ranks, text
