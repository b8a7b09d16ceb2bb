"""``autotp plan`` keeps its report (``autotp/report_cache.py``): the same question again is a
file read, served before torch is imported, and prints what the run that planned it printed (all
but the timings line); a different question, or an entry that does not check out, is planned
again. Tolerances: none, exact text and fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autotp.cli import main
from autotp.report_cache import ReportCache, config_file
from tests._tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def config_only(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    tiny_config("llama").save_pretrained(folder)
    return folder


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def _entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "reports").glob("*.json"))


def _read_from_cache(text: str) -> bool:
    return "timings: read from the report cache" in text


def _without_timings(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("timings")]


def test_the_same_plan_again_prints_the_same_report_from_the_cache(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planned = _plan(capsys, str(config_only), "--tp", "2")
    again = _plan(capsys, str(config_only), "--tp", "2")

    assert len(_entries(cache_dir)) == 1
    assert not _read_from_cache(planned) and _read_from_cache(again)
    assert _without_timings(again) == _without_timings(planned)  # the parameter table in its order too


def test_the_json_from_the_cache_equals_the_planned_json_but_for_the_timings(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planned = json.loads(_plan(capsys, str(config_only), "--tp", "2", "--json", "--no-decode"))
    again = json.loads(_plan(capsys, str(config_only), "--tp", "2", "--json", "--no-decode"))

    assert "trace_s" in planned.pop("timings") and list(again.pop("timings")) == ["report_cache_read_s"]
    assert json.dumps(again) == json.dumps(planned)  # same fields, same order


def test_a_cache_hit_imports_neither_torch_nor_transformers(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planned = _plan(capsys, str(config_only), "--tp", "2")
    script = (
        "import sys; from autotp.cli import main; code = main(['plan', sys.argv[1], '--tp', '2']); "
        "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script, str(config_only)], capture_output=True, text=True,
                         env=env, timeout=300)

    assert run.returncode == 0, run.stderr
    assert _read_from_cache(run.stdout) and "heavy: []" in run.stdout
    assert _without_timings(run.stdout.replace("heavy: []\n", "")) == _without_timings(planned)


def test_another_question_is_planned_again(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plan(capsys, str(config_only), "--tp", "2", "--no-decode")
    for argv in (["--tp", "4", "--no-decode"], ["--tp", "2"], ["--tp", "2", "--no-decode", "--override",
                                                                "lm_head=replicate"]):
        assert not _read_from_cache(_plan(capsys, str(config_only), *argv))
    assert len(_entries(cache_dir)) == 4

    tiny_config("llama", intermediate_size=64).save_pretrained(config_only)  # the config changed
    assert not _read_from_cache(_plan(capsys, str(config_only), "--tp", "2", "--no-decode"))


@pytest.mark.parametrize("damage", ["edited", "truncated", "another version", "another key's entry"])
def test_an_entry_that_does_not_check_out_is_ignored_and_rewritten(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    planned = _plan(capsys, str(config_only), "--tp", "2", "--no-decode")
    (entry,) = _entries(cache_dir)
    text = entry.read_text()
    if damage == "edited":  # a changed count, the checksum no longer matches
        entry.write_text(text.replace('"all_reduce":', '"all_gather":'))
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "another version":  # as if written under another torch: it carries another key
        data = json.loads(text)
        data["key"]["versions"]["torch"] = "0.0.1"
        entry.write_text(json.dumps(data))
    else:  # the entry of tp=4 stored under this question's name
        _plan(capsys, str(config_only), "--tp", "4", "--no-decode")
        other = next(p for p in _entries(cache_dir) if p != entry)
        entry.write_text(other.read_text())

    replanned = _plan(capsys, str(config_only), "--tp", "2", "--no-decode")
    assert not _read_from_cache(replanned)
    assert _without_timings(replanned) == _without_timings(planned)
    assert _read_from_cache(_plan(capsys, str(config_only), "--tp", "2", "--no-decode"))  # rewritten


def test_explanations_and_folders_with_weights_are_not_cached(
    cache_dir: Path, config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):
        assert "lm_head.weight" in _plan(capsys, str(config_only), "--tp", "2", "--no-decode", "--explain",
                                         "lm_head")
    assert _entries(cache_dir) == []

    (config_only / "model.safetensors").write_bytes(b"")
    assert config_file(str(config_only)) is None  # checked against the config on every plan


def test_two_writers_of_one_entry_both_succeed(tmp_path: Path, config_only: Path) -> None:
    cache = ReportCache(tmp_path / "cache")
    key = cache.key(str(config_only), config_only / "config.json", {"tp": 2})
    reports = [{"writer": i, "rows": list(range(2000))} for i in range(8)]
    threads = [threading.Thread(target=cache.store, args=(key, r)) for r in reports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert cache.load(key) in reports
    assert [p.name for p in (tmp_path / "cache" / "reports").iterdir()] == [_entries(tmp_path / "cache")[0].name]


def test_without_a_cache_nothing_is_read_or_written(
    tmp_path: Path, config_only: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTP_CACHE", "0")
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path / "cache"))
    for _ in range(2):
        assert not _read_from_cache(_plan(capsys, str(config_only), "--tp", "2", "--no-decode"))
    assert not (tmp_path / "cache").exists()
