"""Gradient checkpointing on a parallelized model is refused with an error that names the fix:
``torch.utils.checkpoint`` reaches the backend as one higher-order op per block, inside which no
collective can be placed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9]])


def _train_with_checkpointing(rank: int, world: int, folder: str) -> str:
    import autotp

    model = autotp.parallelize_model(folder, tp_size=world)
    model.gradient_checkpointing_enable()
    model.train()
    try:
        model(input_ids=IDS, labels=IDS).loss.backward()
    except autotp.AutoTPError as e:
        return str(e)
    return "ran"


def test_gradient_checkpointing_is_refused_with_the_fix_named(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", seed=0, num_hidden_layers=1)
    for message in run_ranks(_train_with_checkpointing, 2, str(folder)):
        assert "activation checkpointing" in message and "gradient_checkpointing_disable()" in message
