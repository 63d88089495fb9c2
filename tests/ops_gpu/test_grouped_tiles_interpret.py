"""gpu.grouped_local (the expert-parallel step's grouped products: grouped_plan_kernel's
task table, then grouped_tiles_kernel) under Triton's CPU interpreter: each segment of rows
(source-major, then group) times its group's W, stored at the rows' own positions, for W as
stored and for the backward's transposed view, with empty segments, segments of several
row tiles, and a K and N that are not multiples of the tile; rows outside every segment keep
are set to zero (past the segments, also where `out` has more rows than X); counts that
cannot be meant compute nothing (all zeros) and set the status word; a shape's second call,
through the launch the first one kept, computes its own counts."""

import os
import subprocess
import sys

import pytest

from rocmoe_testing import REPO, require_module

require_module("triton", "the Triton interpreter runs the grouped products on CPU")

pytestmark = pytest.mark.triton_interpret

SCRIPT = r"""
import sys
import torch
from rocmoe.ops import gpu
from rocmoe.ops.gpu import grouped

case = sys.argv[1]
counts = torch.tensor([[37, 0, 9], [7, 21, 2]], dtype=torch.int64)  # [sources, groups]
sources, groups = counts.shape
k, n = 40, 24                        # tiles of 16 on CPU: ragged K and N
rows = int(counts.sum())
g = torch.Generator().manual_seed(0)
x = torch.randn(rows + 5, k, generator=g)          # 5 rows past every segment
stored = torch.randn(groups, n, k, generator=g) if case == "transposed" else \
    torch.randn(groups, k, n, generator=g)
w = stored.transpose(1, 2) if case == "transposed" else stored   # [G, K, N] either way
status = torch.zeros(16, dtype=torch.int32)
out = torch.full((rows + 9, n), 7.0)              # and 4 more in out: all 9 zeroed
if case == "bad":
    counts[1, 1] = -1
gpu.grouped_local(x, w, counts, status.data_ptr(), out=out)
if case == "bad":
    assert bool((out == 0).all()), "a bad count stored rows"
    assert int(status[3 * sources]) == 6, status.tolist()   # ROCMOE_STATUS_BAD_INPUT
    print("GROUPED_OK")
    sys.exit(0)
if case == "again":  # the same shape, other counts (fewer rows): the kept launch's call
    counts = torch.tensor([[0, 30, 10], [20, 5, 1]], dtype=torch.int64)
    out.fill_(7.0)
    gpu.grouped_local(x, w, counts, status.data_ptr(), out=out)
    assert len(grouped._GROUPED_LAUNCHES) == 1, list(grouped._GROUPED_LAUNCHES)
assert int(status.abs().sum()) == 0, status.tolist()
want = torch.zeros_like(out)
row = 0
for s in range(sources):
    for e in range(groups):
        c = int(counts[s, e])
        want[row:row + c] = (x[row:row + c].double() @ w[e].double()).float()
        row += c
err = float((out - want).abs().max())
print("max abs error", err, case)
assert err < 1e-4, err
print("GROUPED_OK")
"""


@pytest.mark.parametrize("case", ["stored", "transposed"])
def test_grouped_products_multiply_each_segment_in_place_and_zero_the_rows_past_them(case):
    _run(case)


def test_a_second_call_of_a_shape_computes_the_products_of_its_own_counts():
    _run("again")


def test_grouped_products_with_a_bad_count_store_only_zeros_and_record_bad_input():
    _run("bad")


def _run(case):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, case], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GROUPED_OK" in proc.stdout, proc.stdout + proc.stderr
