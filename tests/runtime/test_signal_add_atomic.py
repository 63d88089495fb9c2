"""signal_add on the host backend is atomic: tight loops of adds from several threads into
one slot at once sum exactly (tests/runtime/signal_add_stress.cpp, built against the
installed librocmoe). The multi-rank Python check of the same sum (rank_checks.py,
signal_add_sums) meets too few adds at once on a loaded machine to catch a lost update."""

from __future__ import annotations

import subprocess
from pathlib import Path

import rocmoe._native  # noqa: F401  (loads librocmoe into this process)
from rocmoe_testing import REPO, require_tool

SOURCE = Path(__file__).with_name("signal_add_stress.cpp")


def _librocmoe() -> Path:
    # the very library the Python package loaded, wherever the install put it
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.rstrip().endswith("librocmoe.so"):
            return Path(line.split()[-1])
    raise AssertionError("librocmoe.so is not mapped into this process")


def test_signal_adds_from_four_threads_at_once_sum_exactly(tmp_path):
    cxx = require_tool("c++", "a C++17 compiler for the signal_add stress test")
    lib = _librocmoe()
    exe = tmp_path / "signal_add_stress"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
                    f"-I{REPO / 'hip' / 'include'}", str(SOURCE), f"-L{lib.parent}", "-lrocmoe",
                    f"-Wl,-rpath,{lib.parent}", "-o", str(exe)], check=True, timeout=120)
    proc = subprocess.run([str(exe), "4", "0.2"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0 and "signal_add_stress: OK" in proc.stdout, proc.stdout
