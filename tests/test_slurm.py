"""Slurm: the local template runs a 2-rank rocmoe ring under a real Slurm, failures propagate,
a training job requeued mid-run finishes as if it had never stopped, and rocmoe-launch binds
each local rank to its GPU.

The cluster tests need a running Slurm (CI: `slurm/local-cluster.sh start`); they skip when
there is none, unless ROCMOE_REQUIRE_ALL=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# tests/moe/conftest.py is also imported as module "conftest" when the whole suite is
# collected, so `from conftest import ...` can get the wrong one: load tests/conftest.py by path.
import importlib.util as _ilu
from pathlib import Path as _Path
import rocmoe_testing as _helpers  # noqa: E402  (tests/ is on pytest's pythonpath)
REPO, REQUIRE_ALL, mpi_env = _helpers.REPO, _helpers.REQUIRE_ALL, _helpers.mpi_env
run_mpi = _helpers.run_mpi

SLURM = REPO / "slurm"
JOB_TIMEOUT_S = 300


def _unavailable(message: str):
    if REQUIRE_ALL:
        pytest.fail(message + " and ROCMOE_REQUIRE_ALL=1")
    pytest.skip(message)


@pytest.fixture(scope="module")
def slurm_env() -> dict:
    """Environment for sbatch/sinfo, pointing at the local cluster when no other config is."""
    if shutil.which("sbatch") is None:
        _unavailable("Slurm is not installed (apt-get install slurm-wlm munge)")
    env = mpi_env()
    local_conf = Path(os.environ.get("ROCMOE_SLURM_DIR", "/tmp/rocmoe-slurm")) / "slurm.conf"
    if "SLURM_CONF" not in env and not Path("/etc/slurm/slurm.conf").exists() and local_conf.exists():
        env["SLURM_CONF"] = str(local_conf)
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%a %T"], env=env, capture_output=True,
                              text=True, timeout=20)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0 or not proc.stdout.strip():
        why = proc.stderr.strip() if proc is not None else "sinfo timed out"
        _unavailable(f"no Slurm is running ({why}); start one with slurm/local-cluster.sh start")
    if not any(state in proc.stdout for state in ("idle", "mixed")):
        _unavailable(f"no Slurm node can take a job: {proc.stdout.strip()!r}")
    return env


def submit_and_wait(env: dict, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """sbatch --wait local.sbatch args; returns (exit status, job id, job output)."""
    out = tmp_path / "job-%j.out"
    proc = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", f"--output={out}", f"--chdir={REPO}",
         str(SLURM / "local.sbatch"), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        job = stdout.strip().split(";")[0]
        if job:
            subprocess.run(["scancel", job], env=env, timeout=30)
        pytest.fail(f"Slurm job {job or '?'} did not finish within {JOB_TIMEOUT_S} s")
    job = stdout.strip().splitlines()[0].split(";")[0] if stdout.strip() else ""
    assert job.isdigit(), f"sbatch did not submit: {stdout} {stderr}"
    text = Path(str(out).replace("%j", job)).read_text()
    return proc.returncode, job, text


@pytest.mark.slurm
def test_local_template_runs_a_two_rank_ring_under_slurm(slurm_env, tmp_path):
    rc, job, text = submit_and_wait(slurm_env, tmp_path)
    assert rc == 0, text
    assert f"rocmoe job {job}: 1 node(s)" in text
    assert f"RING OK world=2 backend=host elements=65536 slurm_job={job}" in text, text


@pytest.mark.slurm
def test_local_template_starts_ranks_with_srun_pmix(slurm_env, tmp_path):
    env = dict(slurm_env, ROCMOE_LAUNCHER="srun")
    rc, job, text = submit_and_wait(env, tmp_path)
    if rc != 0 and "can not load PMIx library" in text:
        _unavailable("Slurm's mpi/pmix plugin cannot load libpmix (apt-get install libpmix2; ln -s "
                     "libpmix.so.2 /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so; then restart "
                     "slurmd: slurm/local-cluster.sh stop && slurm/local-cluster.sh start)")
    assert rc == 0, text
    assert f"RING OK world=2 backend=host elements=65536 slurm_job={job}" in text, text


@pytest.mark.slurm
def test_local_template_passes_program_and_arguments_and_fails_with_the_program(slurm_env, tmp_path):
    rc, job, text = submit_and_wait(
        slurm_env, tmp_path, "python3", "-c",
        # the barrier: no rank exits (and gets its peer killed) before every rank printed
        "import os, sys; from mpi4py import MPI; "
        "print('rank', MPI.COMM_WORLD.Get_rank(), 'arg', sys.argv[1], flush=True); "
        "MPI.COMM_WORLD.Barrier(); sys.exit(3)", "two words")
    assert rc != 0, text  # a failing rank fails the job, so CI notices
    assert sorted(line for line in text.splitlines() if line.startswith("rank ")) == [
        "rank 0 arg two words", "rank 1 arg two words"]


# -- requeue ---------------------------------------------------------------------------------
MOE_ARGS = ["--layers", "2", "--steps", "80", "--checkpoint-every", "5", "--eval-every", "40",
            "--max-files", "300", "--threads", "1", "--no-progress"]


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_fields(env: dict, job: str) -> dict:
    proc = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True, timeout=30)
    fields = {}
    for word in proc.stdout.split():
        key, _, value = word.partition("=")
        fields.setdefault(key, value)
    return fields


def wait_for(what: str, condition, env: dict, job: str, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(env, job)
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
            # a requeued job waits out Slurm's credential lifetime (120 s) first: not here.
            # Two seconds on, not now: slurmd refuses a credential made in the second its
            # predecessor's was revoked ("Killing non-startable batch job: Job credential
            # revoked", seen once in CI), which ends the job FAILED
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"],
                           env=env, timeout=30)
        if condition(fields):
            return fields
        if fields.get("JobState") in FINAL_STATES:
            pytest.fail(f"Slurm job {job} ended ({fields.get('JobState')}) before {what}")
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, timeout=30)
    pytest.fail(f"Slurm job {job}: {what} did not happen within {timeout} s (last: {fields})")


def newest_checkpoint_step(directory: Path) -> int:
    steps = [int(p.parent.name.split("-")[1]) for p in directory.glob("step-*/manifest.json")]
    return max(steps, default=0)


def last_per_step(path: Path, event: str) -> dict:
    found = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["event"] == event:
            found[record["step"]] = record
    return found


@pytest.mark.slurm
@pytest.mark.mpi
def test_a_training_job_requeued_twice_mid_run_finishes_as_the_uninterrupted_run(slurm_env,
                                                                                 tmp_path):
    program = [sys.executable, str(REPO / "examples" / "moe_train.py"), *MOE_ARGS]
    reference = run_mpi(REPO / "examples" / "moe_train.py", 2, *MOE_ARGS, "--jsonl",
                        tmp_path / "reference.jsonl", timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:]
    ckpt, run = tmp_path / "ckpt", tmp_path / "run.jsonl"
    env = dict(slurm_env, PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                slurm_env.get("PATH", "")]))
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path / 'job-%j.out'}", f"--chdir={REPO}",
         str(SLURM / "local.sbatch"), *program, "--checkpoint-dir", str(ckpt), "--jsonl", str(run)],
        env=env, capture_output=True, text=True, timeout=60)
    job = submitted.stdout.strip().split(";")[0]
    assert job.isdigit(), submitted.stderr
    try:
        # 1. the time-limit warning (--signal=B:USR1@N): the batch shell forwards it, the ranks
        #    checkpoint and exit 75, the template requeues the job itself
        wait_for("a first checkpoint", lambda f: f.get("JobState") == "RUNNING"
                 and newest_checkpoint_step(ckpt) >= 5, env, job)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True,
                       timeout=30)
        wait_for("the self-requeue", lambda f: f.get("Restarts") == "1", env, job)
        first_stop = newest_checkpoint_step(ckpt)
        # 2. a requeue from outside (preemption, an operator): Slurm kills the job; it resumes
        #    from its newest complete checkpoint
        wait_for("progress after the resume", lambda f: f.get("JobState") == "RUNNING"
                 and newest_checkpoint_step(ckpt) > first_stop, env, job)
        subprocess.run(["scontrol", "requeue", job], env=env, check=True, timeout=30)
        wait_for("the requeue", lambda f: f.get("Restarts") == "2", env, job)
        done = wait_for("the end of the job", lambda f: f.get("JobState") in FINAL_STATES, env,
                        job, timeout=300)
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    text = (tmp_path / f"job-{job}.out").read_text()
    assert done["JobState"] == "COMPLETED", text[-3000:]
    assert "stopped for a requeue (exit 75)" in text
    events = [json.loads(line) for line in run.read_text().splitlines()]
    assert [e["signal"] for e in events if e["event"] == "stopped"] == ["SIGUSR1"]
    resumes = [e["step"] for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and resumes[0] == first_stop < resumes[1] < 80
    want = last_per_step(tmp_path / "reference.jsonl", "train")
    got = last_per_step(run, "train")
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in want.items()}
    summary = lambda path: next(json.loads(l) for l in path.read_text().splitlines()  # noqa: E731
                                if '"summary"' in l)
    assert summary(run)["params_sha256"] == summary(tmp_path / "reference.jsonl")["params_sha256"]


# -- rocmoe-launch (no Slurm needed: it only reads the environment) ---------------------------
def launch(extra: dict, *program: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("VISIBLE_DEVICES") and not k.startswith(("SLURM_", "OMPI_", "ROCMOE_"))}
    env.update(extra)
    return subprocess.run([str(SLURM / "rocmoe-launch"), *program], env=env, capture_output=True,
                          text=True, timeout=30)


def visible(extra: dict) -> str:
    proc = launch(extra, "sh", "-c", "echo ${ROCR_VISIBLE_DEVICES-unset}/${HIP_VISIBLE_DEVICES-unset}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_launch_binds_local_rank_through_the_gpu_map_into_slurms_device_list():
    devices = {"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "ROCMOE_GPU_MAP": "4,5,2,3,6,7,0,1",
               "HIP_VISIBLE_DEVICES": "3"}
    got = [visible({**devices, "SLURM_LOCALID": str(r)}) for r in range(8)]
    # HIP_VISIBLE_DEVICES would index ROCR's list a second time: it must be gone
    assert got == [f"{g}/unset" for g in (4, 5, 2, 3, 6, 7, 0, 1)]
    # map entries index what Slurm made visible, not physical numbers
    assert visible({"ROCR_VISIBLE_DEVICES": "8,9,10,11", "SLURM_LOCALID": "2"}) == "10/unset"


def test_launch_keeps_a_single_gpu_that_slurm_already_bound():
    assert visible({"ROCR_VISIBLE_DEVICES": "6", "SLURM_LOCALID": "3"}) == "6/unset"


def test_launch_uses_the_mpi_local_rank_without_slurm():
    assert visible({"ROCR_VISIBLE_DEVICES": "0,1,2,3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == "1/unset"


def test_launch_refuses_a_rank_without_a_gpu():
    proc = launch({"ROCR_VISIBLE_DEVICES": "0,1", "SLURM_LOCALID": "5"}, "true")
    assert proc.returncode == 2 and "only 2 are visible" in proc.stderr


def test_launch_sets_threads_from_cpus_per_task_and_execs_the_program():
    proc = launch({"SLURM_CPUS_PER_TASK": "7"}, "sh", "-c", "echo $OMP_NUM_THREADS; exit 5")
    assert proc.returncode == 5 and proc.stdout.strip() == "7"


@pytest.mark.parametrize("template,needles", [
    ("mi250x-frontier.sbatch", ["--gpus-per-node=8", "--ntasks-per-node=8",
                                "MPICH_GPU_SUPPORT_ENABLED=1", "ROCMOE_GPU_MAP"]),
    ("mi300x.sbatch", ["--gpus-per-node=8", "--ntasks-per-node=8"]),
    ("lumi-g.sbatch", ["--partition=standard-g", "--gpus-per-node=8", "mask_cpu:",
                       "MPICH_GPU_SUPPORT_ENABLED=1"]),
    ("local.sbatch", ["--ntasks=2", "mpiexec"]),
])
def test_templates_are_valid_bash_with_their_platform_settings(template, needles):
    path = SLURM / template
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    for needle in needles + ["#SBATCH --requeue", "#SBATCH --signal=B:USR1@",
                             "#SBATCH --open-mode=append", "rocmoe_run_requeueable "]:
        assert needle in text, (template, needle)



def test_gpu_templates_refuse_to_run_without_a_program(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROCMOE_", "SLURM_"))}
    env.update(ROCMOE_HOME=str(REPO), ROCMOE_MODULES="")
    proc = subprocess.run(["bash", str(SLURM / "mi300x.sbatch")], env=env, capture_output=True,
                          text=True, timeout=30, cwd=str(tmp_path))
    assert proc.returncode == 2 and "no program" in proc.stderr
