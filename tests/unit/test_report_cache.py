"""``autotp plan`` keeps its report (``autotp/report_cache.py``): the same question again is a
file read, a different one is planned. Compared with ``PlanReport.plan_json`` (the report less
timings, solver cost and how it was computed); tolerances: none, exact fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.planner import plan_model
from tests._tiny import tiny_config


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_same_plan_again_is_read_from_the_report_cache(cache_dir: Path) -> None:
    planned = plan_model(tiny_config("llama"), 2, report_cache=True)
    again = plan_model(tiny_config("llama"), 2, report_cache=True)

    assert len(list((cache_dir / "reports").glob("*.json"))) == 1
    assert "read from the report cache" not in planned.depth
    assert again.depth.endswith("; read from the report cache (autotp/report_cache.py)")
    assert again.plan_json() == planned.plan_json()
    assert again.record is None and "trace_s" not in again.timings


def test_another_tp_or_a_corrupt_entry_is_planned_again(cache_dir: Path) -> None:
    plan_model(tiny_config("llama"), 2, report_cache=True)
    other = plan_model(tiny_config("llama"), 4, report_cache=True)
    assert "read from the report cache" not in other.depth

    for entry in (cache_dir / "reports").glob("*.json"):
        entry.write_text(entry.read_text().replace('"all_reduce":', '"all_gather":'))
    replanned = plan_model(tiny_config("llama"), 4, report_cache=True)
    assert "read from the report cache" not in replanned.depth
    assert replanned.plan_json() == other.plan_json()


def test_plans_with_explanations_do_not_use_the_report_cache(cache_dir: Path) -> None:
    plan_model(tiny_config("llama"), 2, report_cache=True)
    explained = plan_model(tiny_config("llama"), 2, report_cache=True, explain_names=["lm_head"])
    assert explained.record is not None
