"""The Triton kernels, run by Triton's CPU interpreter, equal the torch path (small shapes)."""

import os
import pathlib
import subprocess
import sys

import pytest

from rocmoe_testing import require_module

require_module("triton", "the Triton interpreter runs the MoE kernels on CPU")

pytestmark = pytest.mark.triton_interpret
SCRIPT = pathlib.Path(__file__).with_name("interpret_script.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("check", ["kernels_b16", "kernels_b32", "strided_operands",
                                   "layer_grads", "layer_grads_load", "routing", "combine",
                                   "padding_rows", "descriptors", "dstd_variants",
                                   "sdd_persistent", "tail_blocks", "inference",
                                   "grouped_order", "lean_layer", "compact_values",
                                   "router"])
def test_triton_kernel_under_interpreter_equals_torch_path(check):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), check], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and f"INTERPRET_OK {check}" in proc.stdout, \
        proc.stdout + proc.stderr
