"""Reading a checkpoint's ``config.json`` with transformers, refusals turned into one-line errors.

Every entry point (``parallelize_model``, ``autotp plan``, ``autotp generate``'s launching
process) reads the config through :func:`read_config`, so an unknown ``model_type`` or a config
that needs remote code fails the same way everywhere: one :class:`~autotp.errors.AutoTPError` that
names the file, the cause and the fix, whole (never cut mid-word), instead of transformers'
paragraph or a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotp.errors import AutoTPError

__all__ = ["check_sizes", "read_config", "short_reason"]

#: longest part of a third-party message quoted in an error (cut at a sentence or word boundary)
_QUOTED = 240


def short_reason(text: str, limit: int = _QUOTED) -> str:
    """``text``'s first sentence or line, at most about ``limit`` characters, cut only between words."""
    first = text.strip().split("\n", 1)[0].strip()
    end = first.find(". ")
    if 0 < end < limit:
        return first[: end + 1]
    if len(first) <= limit:
        return first
    cut = first.rfind(" ", 0, limit)
    return first[: cut if cut > 0 else limit].rstrip(" ,;:") + " ..."


def _config_field(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / "config.json").read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None


def read_config(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """``AutoConfig.from_pretrained(folder)``; transformers' refusals become AutoTPErrors."""
    from transformers import AutoConfig
    from transformers import __version__ as transformers_version

    folder = Path(folder)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers validates configs with many error types
        text = str(e)
        if "trust_remote_code" in text:
            raise AutoTPError(
                f"{folder / 'config.json'} needs custom code from the checkpoint (config.auto_map). Read "
                "that code, then pass trust_remote_code=True."
            ) from e
        model_type = _config_field(folder, "model_type")
        if "does not recognize this architecture" in text or isinstance(e, KeyError):
            raise AutoTPError(
                f"{folder / 'config.json'} has model_type {model_type!r}, which transformers "
                f"{transformers_version} does not know: upgrade transformers (pip install --upgrade "
                "transformers) if the architecture is newer, or fix model_type in config.json."
            ) from e
        reason = " ".join(line.strip() for line in text.splitlines() if line.strip())  # nested validation errors
        raise AutoTPError(
            f"transformers cannot read {folder / 'config.json'} (model_type {model_type!r}): "
            f"{type(e).__name__}: {short_reason(reason)} Fix config.json, or upgrade transformers "
            "if the architecture is newer than this version."
        ) from e
    check_sizes(config, folder / "config.json")
    return config


#: size fields that must be positive wherever a config has them (the model's own names)
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "head_dim", "n_embd", "n_head", "n_layer", "d_model",
               "num_heads", "num_layers", "d_ff", "d_kv")


def check_sizes(config: Any, where: Any = "config.json") -> None:
    """Refuse sizes no model can have, before anything is built: a size field that is not a
    positive integer, or more key/value heads than attention heads / a head count they do not
    divide (grouped-query attention shares each kv head among a whole number of query heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    bad = []
    for name in SIZE_FIELDS:
        value = getattr(text, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 1:
            bad.append(f"{name}={value}")
    if bad:
        raise AutoTPError(f"{where}: {', '.join(bad)}; every size must be a positive integer. Fix config.json "
                          "(it does not describe a model that can exist).")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and not isinstance(kv, bool) and heads % kv:
        raise AutoTPError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
                          "(each key/value head serves a whole number of query heads). Fix config.json.")
