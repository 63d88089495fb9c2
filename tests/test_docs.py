"""The measurement docs point at files that exist: every `results/...` a reader is sent to
from the README, benchmarks/README.md or benchmarks/RESULTS.md is in benchmarks/results/
(a claim whose raw JSON lines were renamed or never committed cannot be checked)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "benchmarks/README.md", "benchmarks/RESULTS.md")
# a results file as the docs name it: results/<name>.<ext>, perhaps with a * for a family
_RESULT_REF = re.compile(r"results/([A-Za-z0-9_.*\-]+\.(?:jsonl|json|log|txt|csv|png))")


def result_refs(text: str) -> set:
    """The results/ file names (glob patterns where they hold a *) a document names."""
    return set(_RESULT_REF.findall(text))


def missing_results(text: str, results_dir: str) -> list:
    """The names of `result_refs(text)` that match no file in `results_dir`."""
    return sorted(r for r in result_refs(text) if not glob.glob(os.path.join(results_dir, r)))


@pytest.mark.parametrize("doc", DOCS)
def test_every_results_file_a_measurement_doc_names_exists(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    assert result_refs(text), f"{doc} names no results file: the pattern no longer matches"
    assert missing_results(text, os.path.join(ROOT, "benchmarks", "results")) == []


def test_a_named_results_file_that_is_not_there_is_reported(tmp_path):
    (tmp_path / "kept.jsonl").write_text("{}\n")
    text = ("see `results/kept.jsonl` and `results/gone_h100.jsonl`, and the family "
            "`results/kep*.jsonl`")
    assert missing_results(text, str(tmp_path)) == ["gone_h100.jsonl"]
