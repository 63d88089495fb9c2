"""Fixtures of the fused ops' tests."""

from __future__ import annotations

import pytest

import rocmoe
from rocmoe import ops


@pytest.fixture
def ctx():
    """A one-rank host-backend context with a 64 MiB heap; the functional ops' cached
    handles are released before it ends."""
    with rocmoe.init(backend="host", heap_size=64 << 20) as c:
        yield c
        ops.release_workspaces(c)
