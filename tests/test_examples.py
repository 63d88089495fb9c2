"""The examples a user runs first: they must train (loss goes down) on the host backend."""

from __future__ import annotations

import json

from rocmoe_testing import REPO, run_mpi

EXAMPLES = REPO / "examples"


def last_json(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, output
    return json.loads(lines[-1])


def test_dlrm_example_learns_on_two_ranks():
    proc = run_mpi(EXAMPLES / "dlrm_train.py", 2, "--steps", "20", timeout=240)
    assert proc.returncode == 0, proc.stdout
    summary = last_json(proc.stdout)
    assert summary["example"] == "dlrm_train" and summary["ranks"] == 2
    assert summary["last_loss"] < summary["first_loss"]


def test_moe_example_learns_with_expert_parallelism_on_two_ranks():
    proc = run_mpi(EXAMPLES / "moe_train.py", 2, "--steps", "25", timeout=240)
    assert proc.returncode == 0, proc.stdout
    summary = last_json(proc.stdout)
    assert summary["experts_per_rank"] == summary["experts"] // 2
    assert summary["combine"] == "gemm_all_to_all"  # float32 on a rocmoe Context
    assert summary["last_loss"] < summary["first_loss"]


def test_demo_verifies_the_ring_and_trains_both_models():
    proc = run_mpi(EXAMPLES / "demo.py", 2, timeout=300)
    assert proc.returncode == 0, proc.stdout
    ring = next(json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"demo"'))
    assert ring["verified_on_every_rank"] is True
    assert '"example": "dlrm_train"' in proc.stdout and '"example": "moe_train"' in proc.stdout
