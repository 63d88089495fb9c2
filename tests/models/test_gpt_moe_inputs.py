"""GPT-MoE with expert parallelism: tokens or targets one rank gets wrong raise on every rank
(that rank its own error, the others naming it) before any exchange, and the next step
works (tests/models/gpt_moe_script.py)."""

import re

import pytest

from rocmoe_testing import TESTS, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = TESTS / "models" / "gpt_moe_script.py"

OWN = {"tokens longer than seq_len": "longer than the model's seq_len=16",
       "float tokens": "tokens must be an int64 or int32 tensor [batch, seq_len], got "
                       "torch.float32",
       "a token beyond the vocabulary": "token ids must be in [0, 256), got [",
       "targets of another shape": "targets must be an int64 tensor of the tokens' shape "
                                   "(2, 12), got torch.int64 (2, 11)",
       "int32 targets": "got torch.int32 (2, 12)",
       "a target beyond the vocabulary": "targets must be in [0, 256) or -100 (ignored)",
       "bad tokens in a vExpert model's first step": "got torch.float32"}


@pytest.fixture(scope="module")
def two_ranks():
    proc = run_mpi(SCRIPT, 2, timeout=240,
                   env=mpi_env(OMP_NUM_THREADS="1", ROCMOE_TIMEOUT_S="20"))
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


@pytest.mark.parametrize("what", sorted(OWN))
def test_a_bad_input_on_one_rank_raises_on_every_rank(two_ranks, what):
    lines = dict(re.findall(rf"^rank (\d) ok {re.escape(what)} raise on every rank: (.*)$",
                            two_ranks, re.M))
    assert sorted(lines) == ["0", "1"], two_ranks
    assert OWN[what] in lines["1"], lines["1"]
    assert "rank(s) [1] rejected their input" in lines["0"], lines["0"]


@pytest.mark.parametrize("what", sorted(OWN))
def test_the_next_step_works_after_a_bad_input(two_ranks, what):
    assert len(re.findall(rf"^rank \d ok a step after {re.escape(what)}$", two_ranks,
                          re.M)) == 2, two_ranks
