"""rocmoe.ops.gpu's Python copy of the slice order (it feeds the Triton kernel) is the
closed form of hip/include/rocmoe/schedule.h: compare them on many topologies."""

import subprocess
import sys
from pathlib import Path

import pytest

from rocmoe.ops import gpu
from rocmoe_testing import require_tool

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = [(w, per) for w in (1, 2, 3, 4, 5, 8, 12) for per in (0, 1, 2, 3, 4, 8)]

PROGRAM = r"""
#include <cstdio>
#include "rocmoe/schedule.h"
int main() {
    int w, per;
    while (std::scanf("%d %d", &w, &per) == 2)
        for (int r = 0; r < w; ++r) {
            rocmoe::sched::Topology t{r, w, per > 0 ? per : w};
            std::printf("%d %d %d:", w, per, r);
            for (int p = 0; p < w; ++p) std::printf(" %d", rocmoe::sched::slice_at(t, p));
            std::printf("\n");
        }
}
"""


def test_python_slice_order_matches_schedule_h(tmp_path):
    cxx = require_tool("g++")
    src = tmp_path / "order.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "order"
    subprocess.run([cxx, "-std=c++17", "-I", str(REPO / "hip/include"), str(src), "-o", str(exe)],
                   check=True)
    stdin = "\n".join(f"{w} {per}" for w, per in TOPOLOGIES)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout
    expected = []
    for w, per in TOPOLOGIES:
        for r in range(w):
            order = gpu.slice_order(r, w, per)
            expected.append(f"{w} {per} {r}: " + " ".join(map(str, order)))
    assert out.split("\n")[:-1] == expected


def test_order_is_remote_first_and_self_last():
    order = gpu.slice_order(5, 8, 4)  # node 1 = ranks 4..7
    assert order[:4] == [0, 1, 2, 3]
    assert order[4:7] == [6, 7, 4] and order[-1] == 5
    assert gpu.task_prefix(order, [2, 0, 1, 1, 3, 1, 1, 1]) == [0, 2, 3, 4, 5, 6, 7, 10, 11]
