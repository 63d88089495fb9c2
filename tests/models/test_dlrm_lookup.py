"""DLRM looks its tables up through a persistent handle's batched call on the packed tables,
and gets what the functional per-table op gets (tests/models/dlrm_lookup_script.py)."""

import re

import pytest

from rocmoe_testing import TESTS, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = TESTS / "models" / "dlrm_lookup_script.py"


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_handle_lookup_equals_the_functional_one_bit_for_bit(ranks):
    proc = run_mpi(SCRIPT, ranks, timeout=240, env=mpi_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout
    for what in ("paths", "packed", "step 0 forward", "step 0 gradients", "step 1 forward",
                 "step 1 gradients", "stacked lookups, handle model",
                 "stacked lookups, plain model"):
        assert proc.stdout.count(f"ok {what}\n") == ranks, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_bad_dense_features_on_one_rank_raise_on_every_rank_and_the_next_step_works(ranks):
    proc = run_mpi(SCRIPT, ranks, "bad-dense", timeout=240, env=mpi_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout
    for model in ("handle", "plain"):
        # (a line may go on with ": <the error it saw>")
        for what in (f"bad dense features raise on every rank, {model} model",
                     f"a step after bad dense features, {model} model"):
            assert len(re.findall(f"ok {re.escape(what)}[:\n]", proc.stdout)) == ranks, \
                proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_lookups_one_rank_cannot_pack_raise_on_every_rank_and_the_next_step_works(ranks):
    proc = run_mpi(SCRIPT, ranks, "bad-lookups", timeout=240,
                   env=mpi_env(OMP_NUM_THREADS="1", ROCMOE_TIMEOUT_S="20"))
    assert proc.returncode == 0, proc.stdout
    for bad in ("stacked rows that disagree", "an entry that is not a tensor"):
        for model in ("handle", "plain"):
            for what in (f"{bad} raise on every rank, {model} model",
                         f"a step after {bad}, {model} model"):
                assert len(re.findall(f"ok {re.escape(what)}[:\n]", proc.stdout)) == ranks, \
                    proc.stdout
