"""tools/demo_report.py: the `make demo` table names the library versions it was measured with
(its figures move with them), and results.json keeps them and every installed distribution's."""

from __future__ import annotations

import importlib.metadata
import json

import pytest


@pytest.fixture(scope="module")
def report(tool):
    tool("demo_task")
    tool("demo_steps")
    return tool("demo_report")


def _results(report):
    from demo_steps import EvalResult

    before = EvalResult(greedy=0.5, sampled=0.4, greedy_carry=0.0, greedy_no_carry=1.0, answers={})
    after = EvalResult(greedy=0.75, sampled=0.5, greedy_carry=1.0, greedy_no_carry=0.5, answers={})
    return before, after


def test_the_table_names_the_versions_it_ran_with(report):
    from rich.console import Console

    found = report.versions()
    assert found["torch"] == importlib.metadata.version("torch")
    assert found["tokenizers"] == importlib.metadata.version("tokenizers")
    assert report.versions([("no-such-dist-x", "numpy")])["numpy"] == importlib.metadata.version("numpy")
    assert report.versions(["no-such-dist-x"])["no-such-dist-x"] == "not installed"
    console = Console(width=400, record=True)
    console.print(report.results_table(*_results(report), eval_size=500))
    text = console.export_text()
    assert "50.0%" in text and "75.0%" in text and "+25.0 pts" in text
    assert f"measured with python {found['python']}, torch {found['torch']}, transformers {found['transformers']}" in text


def test_results_json_keeps_the_versions(report, tmp_path):
    before, after = _results(report)
    report.write_results(tmp_path / "results.json", before=before, after=after, extra={"seed": 0})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["versions"] == report.versions() and data["improved"] is True and data["seed"] == 0
    assert data["installed"]["torch"] == importlib.metadata.version("torch") and "rich" in data["installed"]
