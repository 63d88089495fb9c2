"""pytest hooks for the whole suite. The helpers live in tests/rocmoe_testing.py, imported by
name (`from rocmoe_testing import run_mpi`): tests/moe/conftest.py also claims the module name
"conftest", so importing helpers from a conftest would depend on collection order."""

from __future__ import annotations

import pytest

from rocmoe_testing import run_mpi
# Under ROCMOE_REQUIRE_ALL=1 a skip fails unless the test is marked gpu or rocshmem.
from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401


@pytest.fixture
def mpi():
    """The run_mpi helper as a fixture."""
    return run_mpi
