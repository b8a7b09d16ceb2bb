"""The README's tables are what ``python -m benchmarks.tables --write`` makes from the result files:
no number in them is typed by hand, and each performance row names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import tables

README = Path(tables.ROOT, "README.md").read_text()


def region(name: str) -> str:
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", README, re.S)
    assert match, f"README.md has no {name} region"
    return match.group(1)


def test_the_performance_table_is_generated_from_the_result_files() -> None:
    assert region("performance") == tables.performance_table()


def test_the_coverage_table_is_generated_from_the_saved_rows() -> None:
    assert region("coverage") == tables.coverage_table()


def test_every_performance_row_names_a_result_file_that_exists() -> None:
    rows = region("performance").splitlines()[2:]
    assert rows
    for row in rows:
        name = re.search(r"`([\w.]+\.json)` \|$", row)
        assert name and (tables.RESULTS / name.group(1)).is_file(), row


def test_replacing_a_region_keeps_the_rest_of_the_text() -> None:
    text = "a\n<!-- x:begin -->\nold\n<!-- x:end -->\nb\n"
    assert tables.replace_region(text, "x", "new") == "a\n<!-- x:begin -->\nnew\n<!-- x:end -->\nb\n"
