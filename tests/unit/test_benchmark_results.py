"""Every result the README or the docs cite says how it was made: which code (the commit, and
whether the tree had uncommitted changes), when, by which command, with which libraries, and on
which machine under which load (``benchmarks/_record.py: Provenance``). A figure without that
record cannot be checked, so a result file or coverage row without it fails here."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
COVERAGE = ROOT / "benchmarks" / "coverage.jsonl"
DOCS = (ROOT / "docs" / "benchmarks.md").read_text()


def provenance_problems(provenance: Any) -> list[str]:
    """What a provenance record lacks (empty: it is complete)."""
    if not isinstance(provenance, dict):
        return ["no provenance"]
    problems = []
    if not re.fullmatch(r"[0-9a-f]{40}", str(provenance.get("commit") or "")):
        problems.append(f"commit {provenance.get('commit')!r} is not a git commit")
    if not isinstance(provenance.get("dirty"), bool):
        problems.append("does not say whether the tree had uncommitted changes")
    try:
        datetime.datetime.fromisoformat(str(provenance.get("date")))
    except ValueError:
        problems.append(f"date {provenance.get('date')!r} is not ISO 8601")
    if not str(provenance.get("command") or "").startswith("python benchmarks/"):
        problems.append(f"command {provenance.get('command')!r} is not a benchmarks/ script's command line")
    versions = provenance.get("versions") or {}
    problems += [f"no {name} version" for name in ("python", "torch", "transformers") if not versions.get(name)]
    machine = provenance.get("machine") or {}
    if not machine.get("cores"):
        problems.append("no core count")
    load = machine.get("load_average") or {}
    if not (len(load.get("start") or ()) == 3 and len(load.get("end") or ()) == 3):
        problems.append("no load averages at the start and the end")
    return problems


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_file_records_its_commit_date_command_versions_and_machine_load(path: Path) -> None:
    assert provenance_problems(json.loads(path.read_text()).get("provenance")) == []


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_docs_list_the_command_that_makes_every_result_file(path: Path) -> None:
    assert re.search(rf"^\| `{re.escape(path.name)}` \| `python ", DOCS, re.M), \
        f"docs/benchmarks.md has no row for {path.name} with its command"


def test_every_coverage_row_records_how_it_was_made() -> None:
    rows = [json.loads(line) for line in COVERAGE.read_text().splitlines() if line.strip()]
    assert rows
    problems = {f"{row['case']} tp={row['tp']}": provenance_problems(row.get("provenance")) for row in rows}
    assert {key: found for key, found in problems.items() if found} == {}


def test_a_record_without_a_commit_or_load_is_refused() -> None:
    complete = {"commit": "0" * 40, "dirty": False, "date": "2026-11-26T04:00:00+00:00",
                "command": "python benchmarks/startup.py --tp 2", "versions": {"python": "3.11", "torch": "2.13.0",
                                                                               "transformers": "5.24.0"},
                "machine": {"cores": 2, "load_average": {"start": [0, 0, 0], "end": [0, 0, 0]}}}
    assert provenance_problems(complete) == []
    assert provenance_problems({**complete, "commit": None}) == ["commit None is not a git commit"]
    assert provenance_problems({**complete, "machine": {"cores": 2}}) == ["no load averages at the start and the end"]
    assert provenance_problems(None) == ["no provenance"]
