"""Bad input to parallelize_model fails early with an AutoTPError that says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

import autotp.api
from autotp import AutoTPError, parallelize_model
from tests._tiny import save_tiny


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_weight_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_tiny("llama", tmp_path / "llama")  # 8 heads, 4 kv heads, hidden 64, intermediate 128

    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint was opened before the divisibility check")

    monkeypatch.setattr(autotp.api, "Checkpoint", no_reads)
    with pytest.raises(AutoTPError) as err:
        parallelize_model(folder, tp_size=3)
    message = str(err.value)
    assert "num_attention_heads=8" in message and "num_key_value_heads=4" in message
    assert "Valid tp sizes for this model: [1, 2, 4, 8]" in message  # 8: 2 ranks per kv head


def test_a_tp_size_other_than_the_world_size_says_how_to_launch(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    with pytest.raises(AutoTPError, match="torchrun --nproc-per-node 2"):
        parallelize_model(folder, tp_size=2)


def test_unknown_keyword_arguments_are_named(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    with pytest.raises(AutoTPError, match="tp_sise"):
        parallelize_model(folder, tp_sise=2)
