"""The GPU scripts fail when a check fails (run here with stand-ins for the GPU machine's
tools: python3, mpirun, nvidia-smi, cmake exit with the status a test asks for).

tests/gpu_suite.sh is the one command that runs every GPU test (`pytest -m gpu`);
tests/ops_gpu/device_run.sh and benchmarks/gpu_sweep.sh run GPU checks beside benchmarks."""

from __future__ import annotations

import os
import subprocess

import pytest

from rocmoe_testing import REPO

# each stand-in logs its arguments and exits with $FAKE_RC_<NAME> (0 by default); python3
# answers `-c ...` (device_env.sh's cffi probe, the build's platform print) with 0
FAKE = """#!/bin/bash
echo "{name} $*" >> "$FAKE_LOG"
if [ "{name}" = mpirun ]; then echo "  in $PWD" >> "$FAKE_LOG"; fi
if [ "{name}" = python3 ] && [ "$1" = -c ]; then exit 0; fi
if [ "{name}" = python3 ] && [ "$1 $2" = "-m pytest" ]; then exit ${{FAKE_RC_PYTEST:-0}}; fi
exit ${{FAKE_RC_{upper}:-0}}
"""
TOOLS = ("python3", "mpirun", "nvidia-smi", "cmake")


@pytest.fixture
def machine(tmp_path):
    """Runs a script from the repo root with the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in TOOLS:
        tool = bin_dir / name
        tool.write_text(FAKE.format(name=name, upper=name.upper().replace("-", "_")))
        tool.chmod(0o755)
    log = tmp_path / "calls.log"
    # what the nvshmem build (the cmake stand-in builds nothing) leaves for the suite to stage
    nvshmem_build = tmp_path / "build_nvshmem"
    nvshmem_build.mkdir()
    for name in ("librocmoe.so", "_rocmoe_cffi.abi3.so"):
        (nvshmem_build / name).write_text("")

    def run(script, *args, env_vars=None, **rcs):
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                   FAKE_LOG=str(log), OUT=str(tmp_path / "out"),
                   NVSHMEM_BUILD=str(nvshmem_build), NVSHMEM_PACKAGE=str(tmp_path / "nvpkg"))
        env.update({f"FAKE_RC_{k.upper()}": str(v) for k, v in rcs.items()})
        env.update(env_vars or {})
        proc = subprocess.run(["bash", script, *args], cwd=str(REPO), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        calls = log.read_text() if log.exists() else ""
        log.unlink(missing_ok=True)
        return proc, calls
    return run


def test_gpu_suite_runs_pytest_on_the_gpu_tests_after_the_cuda_build(machine):
    proc, calls = machine("tests/gpu_suite.sh")
    assert proc.returncode == 0, proc.stdout
    assert "cmake -S . -B build/cuda" in calls and "-DROCMOE_GPU=cuda" in calls
    assert "python3 -m pytest -m gpu -rs" in calls and " tests" in calls, calls


def test_gpu_suite_fails_when_a_gpu_test_fails(machine):
    proc, _ = machine("tests/gpu_suite.sh", pytest=1)
    assert proc.returncode != 0, proc.stdout


def test_gpu_suite_builds_and_stages_the_nvshmem_facade_for_its_tests(machine, tmp_path):
    proc, calls = machine("tests/gpu_suite.sh", env_vars={"GPU_SUITE_PART": "6"})
    assert proc.returncode == 0, proc.stdout
    assert "-DROCMOE_SHMEM=nvshmem" in calls and "tests/gpu/test_nvshmem.py" in calls, calls
    assert (tmp_path / "nvpkg" / "rocmoe" / "librocmoe.so").exists()
    assert (tmp_path / "nvpkg" / "rocmoe" / "__init__.py").exists()


def test_gpu_suite_fails_when_the_nvshmem_build_fails_and_runs_no_test(machine, tmp_path):
    (tmp_path / "build_nvshmem" / "librocmoe.so").unlink()
    proc, calls = machine("tests/gpu_suite.sh", env_vars={"GPU_SUITE_PART": "6"})
    assert proc.returncode == 5, proc.stdout
    assert "-m pytest" not in calls


def test_gpu_suite_fails_when_the_build_fails_and_runs_no_test(machine):
    proc, calls = machine("tests/gpu_suite.sh", cmake=2)
    assert proc.returncode == 4, proc.stdout
    assert "-m pytest" not in calls


@pytest.mark.parametrize("stage", ["check1", "multi"])
def test_device_run_fails_when_a_multi_rank_check_fails(machine, stage):
    proc, _ = machine("tests/ops_gpu/device_run.sh", stage, mpirun=1)
    assert proc.returncode == 1, proc.stdout
    assert "FAILED: " in proc.stdout


def test_device_run_passes_when_its_checks_pass(machine):
    proc, _ = machine("tests/ops_gpu/device_run.sh", "check1,pytest")
    assert proc.returncode == 0, proc.stdout


def test_device_run_fails_when_the_timeout_check_sees_no_timeout(machine):
    # the missing-signal check passes only if rank 0 reports the timeout it must hit
    proc, _ = machine("tests/ops_gpu/device_run.sh", "multi")
    assert proc.returncode == 1 and "FAILED: timeout check: rank 0" in proc.stdout, proc.stdout


def test_device_run_fails_when_pytest_fails(machine):
    proc, _ = machine("tests/ops_gpu/device_run.sh", "pytest", pytest=1)
    assert proc.returncode == 1 and "FAILED: pytest" in proc.stdout, proc.stdout


@pytest.mark.parametrize("stage,rcs", [("check", {"mpirun": 1}), ("moetest", {"pytest": 1}),
                                       ("ep", {"mpirun": 1})])
def test_gpu_sweep_fails_when_a_check_stage_fails(machine, stage, rcs):
    proc, _ = machine("benchmarks/gpu_sweep.sh", stage, **rcs)
    assert proc.returncode == 1 and "FAILED: " in proc.stdout, proc.stdout


def _gpu_test_files(paths):
    """The files holding `-m gpu` tests under paths, as pytest collects them."""
    proc = subprocess.run(
        ["python3", "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
         *paths], cwd=str(REPO), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=300)
    assert proc.returncode == 0, proc.stdout
    return sorted({line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line})


def test_gpu_suite_parts_cover_every_gpu_test_file_once(machine):
    parts = []
    for part in ("1", "2", "3", "4", "5", "6"):
        proc, calls = machine("tests/gpu_suite.sh", env_vars={"GPU_SUITE_PART": part})
        assert proc.returncode == 0, proc.stdout
        line = next(c for c in calls.splitlines() if "-m pytest -m gpu" in c)
        parts.append([a for a in line.split() if a.startswith("tests")])
    files = [f for paths in parts for f in _gpu_test_files(paths)]
    assert len(files) == len(set(files)), parts            # no file runs in two parts
    assert sorted(files) == _gpu_test_files(["tests"])     # and none is left out


def test_gpu_suite_refuses_an_unknown_part(machine):
    proc, calls = machine("tests/gpu_suite.sh", env_vars={"GPU_SUITE_PART": "7"})
    assert proc.returncode == 2 and "GPU_SUITE_PART" in proc.stdout
    assert "-m pytest" not in calls


def test_host_time_session_fails_when_a_gpu_test_fails_and_still_runs_the_benches(machine):
    proc, calls = machine("benchmarks/gpu_host_time.sh", pytest=1)
    assert proc.returncode == 1, proc.stdout
    assert "-m rocmoe.bench.fused_gpu" in calls and "-m rocmoe.bench.moe --layer" in calls


def test_host_time_session_stops_when_the_build_fails(machine):
    proc, calls = machine("benchmarks/gpu_host_time.sh", cmake=1)
    assert proc.returncode == 4, proc.stdout
    assert "pytest" not in calls


def test_host_time_session_passes_when_every_stage_passes(machine):
    proc, _ = machine("benchmarks/gpu_host_time.sh")
    assert proc.returncode == 0, proc.stdout


def test_host_time_gemv_ab_stage_times_both_splits_and_probes_w_addresses_twice(machine):
    proc, calls = machine("benchmarks/gpu_host_time.sh", "build,gemv_ab")
    assert proc.returncode == 0, proc.stdout
    variants = [c for c in calls.splitlines() if "gemv_variants.py" in c]
    assert len(variants) == 1 and "--variants default,balance" in variants[0], calls
    assert calls.count("probe_gemv_address.py") == 2, calls  # row split, then balanced


def test_host_time_gemv_ab_stage_fails_when_its_steps_fail(machine):
    proc, _ = machine("benchmarks/gpu_host_time.sh", "build,gemv_ab", python3=1)
    assert proc.returncode == 1, proc.stdout


def test_gemv_protocol_sweep_stops_when_the_build_fails(machine):
    proc, calls = machine("benchmarks/gpu_gemv_protocol.sh", cmake=1)
    assert proc.returncode == 4, proc.stdout
    assert "mpirun" not in calls


def test_gemv_protocol_sweep_runs_each_variant_at_the_ranks_and_each_solo_one_at_one(machine):
    proc, calls = machine("benchmarks/gpu_gemv_protocol.sh", env_vars={
        "RANKS": "3", "VARIANTS": "default ROCMOE_GEMV_ONE_SHOT=0",
        "SOLO_VARIANTS": "ROCMOE_GEMV_DIRECT=0"})
    assert proc.returncode == 0, proc.stdout
    runs = [line for line in calls.splitlines() if line.startswith("mpirun")]
    assert [r.split(" -n ")[1].split()[0] for r in runs] == ["3", "3", "1"], runs
    assert all("rocmoe.bench.multi_gpu" in r and "--ops gemv" in r for r in runs), runs
    assert "=== ranks=3 ROCMOE_GEMV_ONE_SHOT=0" in proc.stdout


def test_multi_gpu_session_builds_and_runs_only_the_backends_asked_for(machine):
    proc, calls = machine("benchmarks/gpu_multi.sh", env_vars={
        "BACKENDS": "ipc", "DEADLINE_S": "200", "DTYPES": "bfloat16 float32",
        "MOE_OPS": "moe,moe_handles"})
    assert proc.returncode == 0, proc.stdout
    assert "-B build/cuda" in calls and "-DROCMOE_SHMEM=nvshmem" not in calls
    runs = [line for line in calls.splitlines() if line.startswith("mpirun -n")]
    assert len(runs) == 2, runs
    assert "--dtype bfloat16,float32" in runs[0] and "--ops moe,moe_handles" in runs[1], runs
    assert "nvshmem: not in BACKENDS" in proc.stdout


def test_multi_gpu_session_runs_the_nvshmem_stages_from_the_staged_package(machine, tmp_path):
    proc, calls = machine("benchmarks/gpu_multi.sh", env_vars={"DEADLINE_S": "200"})
    assert proc.returncode == 0, proc.stdout
    assert "-B build/cuda" in calls and "-DROCMOE_SHMEM=nvshmem" in calls, calls
    package = tmp_path / "nvpkg"
    assert (package / "rocmoe" / "librocmoe.so").exists()
    lines = calls.splitlines()
    places = [lines[i + 1].strip() for i, line in enumerate(lines) if line.startswith("mpirun -n")]
    assert places == [f"in {REPO}"] * 2 + [f"in {package}"] * 2, places


def test_multi_gpu_session_records_a_failed_nvshmem_build_and_still_runs_ipc(machine, tmp_path):
    (tmp_path / "build_nvshmem" / "librocmoe.so").unlink()  # the staging finds no library
    proc, calls = machine("benchmarks/gpu_multi.sh", env_vars={"DEADLINE_S": "200"})
    assert proc.returncode == 0, proc.stdout
    runs = [line for line in calls.splitlines() if line.startswith("mpirun -n")]
    assert len(runs) == 2 and all("--backend ipc" in r for r in runs), runs
    records = (tmp_path / "out" / "multi_gpu.jsonl").read_text()
    assert '"stage": "nvshmem", "error": "nvshmem build failed' in records, records
