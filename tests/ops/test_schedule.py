"""The persistent-kernel schedule (hip/include/rocmoe/schedule.h) on its own.

tests/ops/schedule_test.cpp drives the header with real threads: every task runs once, slices
bound for other nodes come first, every slice is signalled exactly once per launch, and the
self-resetting counters survive 100 launches. The header must also compile as HIP and CUDA
device code, since the GPU kernels include the very same file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "hip" / "include"
SOURCE = REPO / "tests" / "ops" / "schedule_test.cpp"



def require_tool(name: str, why: str) -> str:
    """Path of `name`, or skip (fail under ROCMOE_REQUIRE_ALL=1), as tests/conftest.py does."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("ROCMOE_REQUIRE_ALL") == "1":
            pytest.fail(f"{name} is not installed ({why}) and ROCMOE_REQUIRE_ALL=1")
        pytest.skip(f"{name} is not installed ({why})")
    return path


DEVICE_USE = r"""
#include "rocmoe/schedule.h"
using namespace rocmoe::sched;
__global__ void persistent(Plan plan, Counters c, uint32_t workers, int *ran, int *finished) {
    __shared__ uint32_t id;
    for (;;) {
        if (threadIdx.x == 0) id = claim(c);
        __syncthreads();
        Task t;
        if (!locate(plan, id, &t)) break;
        if (threadIdx.x == 0) {
            atomicAdd(&ran[id], 1);
            if (complete(c, t)) atomicAdd(&finished[t.dest], 1);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) exit_worker(c, workers);
}
"""


def test_schedule_runs_every_task_once_remote_first_and_signals_every_slice_once(tmp_path):
    cxx = require_tool("c++", "a C++17 compiler for the schedule unit test")
    exe = tmp_path / "schedule_test"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
                    f"-I{INCLUDE}", str(SOURCE), "-o", str(exe)], check=True, timeout=120)
    proc = subprocess.run([str(exe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "schedule: all checks passed" in proc.stdout


@pytest.mark.compile
def test_schedule_header_compiles_as_hip_device_code(tmp_path):
    hipcc = require_tool("hipcc", "HIP device compile of schedule.h")
    src = tmp_path / "use.hip"
    src.write_text(DEVICE_USE)
    env = dict(os.environ, HIP_PLATFORM="amd")
    proc = subprocess.run([hipcc, "-std=c++17", "--offload-arch=gfx90a", f"-I{INCLUDE}", "-c",
                           str(src), "-o", str(tmp_path / "use.o")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.compile
def test_schedule_header_compiles_as_cuda_device_code(tmp_path):
    nvcc = require_tool("nvcc", "CUDA device compile of schedule.h")
    src = tmp_path / "use.cu"
    src.write_text(DEVICE_USE)
    proc = subprocess.run([nvcc, "-std=c++17", f"-I{INCLUDE}", "-c", str(src), "-o",
                           str(tmp_path / "use.o")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
