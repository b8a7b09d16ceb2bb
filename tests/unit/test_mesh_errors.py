"""``data_parallel`` is checked first, in one process: an unknown engine, or an engine without a
device mesh, is an AutoTPError that names the fix before any file is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp import AutoTPError, parallelize_model


def test_an_unknown_data_parallel_engine_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(AutoTPError, match=r"data_parallel='zero' is not .*\['fsdp', 'ddp'\]"):
        parallelize_model(tmp_path / "never-read", data_parallel="zero")


def test_data_parallel_without_a_mesh_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(AutoTPError, match="init_device_mesh"):
        parallelize_model(tmp_path / "never-read", data_parallel="fsdp")


def test_a_mesh_that_is_not_a_device_mesh_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AutoTPError, match="must be a torch.distributed DeviceMesh"):
        parallelize_model(tmp_path / "never-read", mesh=(2, 2))
