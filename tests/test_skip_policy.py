"""The skip policy of CI (tests/skip_policy.py): under ROCMOE_REQUIRE_ALL=1 a skip fails
unless the test is a GPU test or the rocSHMEM compile; `make test` lists every skip with its
reason; a missing tool or optional module skips only outside CI.

Each policy test runs a small pytest session in a subprocess with the suite's conftest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from xml.etree import ElementTree

import pytest

import rocmoe_testing
from rocmoe_testing import REPO, TESTS

SAMPLE = '''
import pytest
from rocmoe_testing import require_module

def test_plain_skip():
    pytest.skip("no frobnicator here")

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("no GPU")

@pytest.mark.rocshmem
def test_rocshmem_skip():
    pytest.skip("no rocSHMEM headers")

@pytest.mark.skipif(True, reason="decided at collection")
def test_skipif_marker():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_missing_module():
    require_module("rocmoe_no_such_module_i18", "for the sample")

def test_passes():
    pass
'''

SKIPPING_FILE = '''
import pytest
pytest.skip("this whole file skips itself", allow_module_level=True)

def test_never_collected():
    pass
'''

def _session(tmp_path, require_all: bool, *files: tuple[str, str]) -> dict[str, str]:
    """Outcome ('passed', 'failed', 'error', 'skipped', 'xfailed') of each test by name, read
    from the session's JUnit XML; '_output' is its terminal output."""
    # the suite's own conftest: what registers the policy is under test too
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: GPU\n    rocshmem: r\n")
    for name, text in files:
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    env.pop("ROCMOE_REQUIRE_ALL", None)
    if require_all:
        env["ROCMOE_REQUIRE_ALL"] = "1"
    xml = tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", str(tmp_path)], cwd=str(tmp_path), env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=120)
    outcomes = {"_output": proc.stdout}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        outcomes[case.get("name")] = outcome
    return outcomes


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return _session(tmp_path_factory.mktemp("local"), False, ("test_sample.py", SAMPLE))


@pytest.fixture(scope="module")
def ci(tmp_path_factory):
    return _session(tmp_path_factory.mktemp("ci"), True, ("test_sample.py", SAMPLE))


def test_outside_ci_every_skip_stays_a_skip(local):
    got = local
    for name in ("test_plain_skip", "test_gpu_skip", "test_rocshmem_skip", "test_skipif_marker",
                 "test_missing_module"):
        assert got.get(name) == "skipped", (name, got["_output"])
    assert got.get("test_passes") == "passed", got["_output"]


def test_under_require_all_a_plain_skip_fails_with_its_reason(ci):
    got = ci
    for name in ("test_plain_skip", "test_skipif_marker"):  # a skipif fails in its setup
        assert got.get(name) in ("failed", "error"), (name, got["_output"])
    assert "only tests marked gpu or rocshmem may skip; the skip said: no frobnicator here" \
        in got["_output"]


def test_under_require_all_gpu_and_rocshmem_tests_may_still_skip(ci):
    got = ci
    assert got.get("test_gpu_skip") == "skipped", got["_output"]
    assert got.get("test_rocshmem_skip") == "skipped", got["_output"]
    assert got.get("test_expected_failure") == "xfailed", got["_output"]
    assert got.get("test_passes") == "passed", got["_output"]


def test_under_require_all_a_missing_module_fails(ci):
    got = ci
    assert got.get("test_missing_module") == "failed", got["_output"]
    assert "rocmoe_no_such_module_i18 cannot be imported" in got["_output"]


def test_under_require_all_a_file_that_skips_itself_fails(tmp_path):
    got = _session(tmp_path, True, ("test_skipping.py", SKIPPING_FILE))
    assert "this whole file skips itself" in got["_output"], got["_output"]
    assert re.search(r"^(ERROR|FAILED) .*test_skipping\.py", got["_output"], re.M), \
        got["_output"]
    assert not re.search(r"^SKIPPED .*test_skipping", got["_output"], re.M), got["_output"]


def test_require_module_returns_the_module_when_it_imports():
    assert rocmoe_testing.require_module("json").dumps([1]) == "[1]"


def test_make_test_lists_every_skip_with_its_reason():
    # CI runs the README's `make test`: its pytest command must report skips (-rs or -ra)
    proc = subprocess.run(["make", "-n", "-s", "test"], cwd=str(REPO), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    pytest_lines = [ln for ln in proc.stdout.splitlines() if "-m pytest" in ln]
    assert pytest_lines, proc.stdout
    assert all(re.search(r"\s-r[a-zA-Z]*[sa]", ln) for ln in pytest_lines), pytest_lines


def test_no_test_skips_a_missing_module_past_ci():
    # pytest.importorskip skips even under ROCMOE_REQUIRE_ALL=1, and a module-level
    # pytest.skip hides a whole file: both go through rocmoe_testing.require_module instead
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "test_skip_policy.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "importorskip(" in line or "allow_module_level=True" in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    allowed = [o for o in offenders if o.startswith("tests/rocmoe_testing.py:")]
    assert offenders == allowed, offenders
