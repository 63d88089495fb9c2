"""gpu.grouped_weight_grad (the expert-parallel step's dW, Triton) under Triton's CPU
interpreter: dW[g] = the sum over sources of X[(s, g)]^T dY[(s, g)] for rows laid out
source-major, then group, in either grid order (a group's tiles consecutive, or groups
first), with empty segments and a K and N that are not multiples of the tile; counts that
cannot be meant (more rows than X and dY hold, a negative one) give dW = 0 instead of reading
past the rows."""

import json
import os
import subprocess
import sys

import pytest

from rocmoe_testing import REPO, require_module

require_module("triton", "the Triton interpreter runs the weight-gradient kernel on CPU")

pytestmark = pytest.mark.triton_interpret

SCRIPT = r"""
import sys
import torch
from rocmoe.ops import gpu

counts = torch.tensor([[5, 0, 9], [7, 3, 2]], dtype=torch.int64)  # [sources, groups]
world, groups = counts.shape
k, n = 40, 24                                                        # tiles of 16: ragged
g = torch.Generator().manual_seed(0)
x = torch.randn(int(counts.sum()), k, generator=g)
gy = torch.randn(int(counts.sum()), n, generator=g)
want = torch.zeros(groups, k, n, dtype=torch.float64)
row = 0
for s in range(world):
    for e in range(groups):
        c = int(counts[s, e])
        want[e] += x[row:row + c].double().t() @ gy[row:row + c].double()
        row += c
if sys.argv[2] != "good":
    bad = counts.clone()
    bad[1, 2] = 1000 if sys.argv[2] == "too many" else -1
    got = gpu.grouped_weight_grad(x, gy, bad, groups, torch.float32)
    assert bool((got == 0).all()), "bad counts gave a nonzero dW"
    print("DW_OK")
    sys.exit(0)
got = gpu.grouped_weight_grad(x, gy, counts, groups, torch.float32)
err = float((got.double() - want).abs().max())
print("max abs error", err, "tiles first", sys.argv[1])
assert err < 1e-4, err
print("DW_OK")
"""


@pytest.mark.parametrize("tiles_first", [False, True])
def test_grouped_weight_grad_sums_each_groups_segments_from_every_source(tiles_first):
    _run(tiles_first, "good")


@pytest.mark.parametrize("bad", ["too many", "negative"])
def test_grouped_weight_grad_of_counts_that_cannot_be_meant_is_zero(bad):
    _run(True, bad)


def _run(tiles_first, case):
    env = dict(os.environ, TRITON_INTERPRET="1",
               ROCMOE_DW_CONFIG=json.dumps({"TILES_FIRST": tiles_first}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiles_first), case], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "DW_OK" in proc.stdout, proc.stdout + proc.stderr
