"""Which files of a checkpoint folder hold weights, by name alone (no torch import: ``autotp plan``
asks before torch loads whether a folder is config-only)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["bin_files", "holds_weights", "safetensors_files"]


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def bin_files(folder: Path) -> list[Path]:
    """PyTorch pickles transformers names (``pytorch_model.bin`` or its shards)."""
    return sorted(p for p in folder.glob("pytorch_model*.bin") if p.is_file())


def holds_weights(folder: Path) -> bool:
    return bool(safetensors_files(folder) or bin_files(folder))
