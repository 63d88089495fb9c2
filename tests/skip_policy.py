"""Which tests may skip where every tool is installed (ROCMOE_REQUIRE_ALL=1, as in CI).

There a skip is a check that silently did not run. Only two kinds cannot run on CI's
machine and may skip: tests marked `gpu` (CI has no GPU) and the rocSHMEM compile, marked
`rocshmem` (its headers need ROCm >= 6.4, which CI cannot install). Every other skip, of a
test or of a whole file at collection, is turned into a failure that gives the skip's
reason, so a missing tool or module, or a new `pytest.skip`, cannot pass CI unseen.

tests/conftest.py registers these hooks; tests/test_skip_policy.py checks them.
"""

from __future__ import annotations

import os

import pytest

ALLOWED_SKIP_MARKERS = ("gpu", "rocshmem")


def _enforced() -> bool:
    # read at hook time, not import time: the policy's own tests start pytest with and
    # without the variable
    return os.environ.get("ROCMOE_REQUIRE_ALL") == "1"


def _reason(report) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _forbid(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped under ROCMOE_REQUIRE_ALL=1, where only tests marked "
                       f"{' or '.join(ALLOWED_SKIP_MARKERS)} may skip; the skip said: "
                       f"{_reason(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (_enforced() and report.skipped) or hasattr(report, "wasxfail"):
        return  # an expected failure is reported as a skip too: not ours to judge
    if any(item.get_closest_marker(name) for name in ALLOWED_SKIP_MARKERS):
        return
    _forbid(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _enforced() and report.skipped:
        # a file that skips itself while being imported has no markers to show yet
        _forbid(report, collector.nodeid or "collection")
