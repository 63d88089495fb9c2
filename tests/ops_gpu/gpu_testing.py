"""Helpers of the GPU fused-op tests (the shared ones live in tests/rocmoe_testing.py)."""

import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "fused_gpu_script.py")


def require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU: the GPU path of the fused ops runs on the device machine")


def librocmoe_has_gpu() -> bool:
    try:
        from rocmoe import _native
    except Exception:  # pragma: no cover - broken install
        return False
    return _native.gpu_platform() != "none"


def require_gpu_build():
    """Skip without a GPU; fail where there is one but librocmoe was built without it."""
    require_gpu()
    if not librocmoe_has_gpu():
        pytest.fail("librocmoe was built without a GPU platform on a machine with a GPU")
