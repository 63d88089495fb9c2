"""The fused-op kernels compile against the scale-out facade too (NVSHMEM: a slice that is
not load/store reachable is staged and sent with nvshmemx_putmem_nbi_block + a signal).
The ipc variant and the HIP targets are compiled by tests/test_compile.py; this adds the
NVSHMEM variant of hip/src/gpu/fused_*.hip (relocatable device code, as CMake builds it)."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from rocmoe_testing import REQUIRE_ALL, require_tool

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO / "hip/src/gpu").glob("fused_*.hip"))


def _nvshmem_include():
    home = os.environ.get("NVSHMEM_HOME")
    if home and (Path(home) / "include/nvshmem.h").exists():
        return Path(home) / "include"
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        inc = Path(root) / "nvshmem/include"
        if (inc / "nvshmem.h").exists():
            return inc
    return None


def test_fused_kernels_compile_with_nvshmem_facade(tmp_path):
    nvcc = require_tool("nvcc")
    include = _nvshmem_include()
    if include is None:
        if REQUIRE_ALL:
            pytest.fail("NVSHMEM headers not found (pip install nvidia-nvshmem-cu13)")
        pytest.skip("NVSHMEM headers not found (pip install nvidia-nvshmem-cu13)")
    # all sources at once: CI has two cores and nvcc is single-threaded
    procs = {}
    for source in SOURCES:
        cmd = [nvcc, "-std=c++17", "-x", "cu", "-rdc=true", "-arch=sm_90", "-O1",
               f"-I{REPO / 'hip/include'}", f"-I{REPO / 'hip/src'}", f"-I{include}",
               "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_CUDA", "-DROCMOE_SHMEM_NVSHMEM",
               "-c", str(source), "-o", str(tmp_path / (source.stem + ".o"))]
        procs[source.name] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True))
    failures = []
    for name, (cmd, proc) in procs.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failures.append(f"{name}: {' '.join(cmd)}\n{out}")
    assert len(procs) >= 3 and not failures, "\n".join(failures)
