"""One shared benchmark checkpoint: a ~150M-parameter Llama-family model with seeded random weights.

``make_checkpoint(folder, dtype)`` writes it once (``save_pretrained`` layout: ``config.json``,
``generation_config.json``, ``model.safetensors``) into ``folder/<name>`` and returns that path;
later calls (from this or any other benchmark) find it there and return at once. The write goes to
a temporary sibling folder that is renamed into place, so an interrupted run never leaves a
half-written checkpoint that a later run would trust.

Sizes (``CONFIG``, ``SIZES["150m"]``): hidden 768, 14 layers, 12 heads over 4 key/value heads
(head_dim 64), MLP 2560, vocabulary 32000, untied embeddings: 153.8M parameters, 615 MB in fp32.
Every split size is divisible by 4, so tp 2 and 4 are valid. ``SIZES`` adds two larger members of
the same family for measurements that need several checkpoint sizes (``load_memory.py --sizes``);
they keep the 14 layers, head_dim 64 and vocabulary, so the traced graph has the same nodes and only
the tensors grow: ``"300m"`` (hidden 1024, 16 heads over 8, MLP 4608: 307.8M parameters, 1231 MB in
fp32, 2.00x), ``"600m"`` (hidden 1536, 24 heads over 8, MLP 6656: 615.8M parameters, 2463 MB in
fp32, 4.00x) and ``"2b"`` (hidden 3072, 48 heads over 8, MLP 11264: ~1.96B parameters, ~7.8 GB in
fp32, ~12.7x; writing it takes ~8 GB of memory and disk).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CONFIG", "MODELS", "SEED", "checkpoint_bytes", "make_checkpoint", "make_model_checkpoint"]

#: LlamaConfig fields of the benchmark model.
CONFIG: dict[str, Any] = dict(
    hidden_size=768,
    num_hidden_layers=14,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2560,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SEED = 0

#: ``size`` -> LlamaConfig fields: the benchmark model, two larger ones of the same family (same
#: layers, head_dim and vocabulary; 2x and 4x the bytes), and a small one for smoke runs of the
#: scripts (hidden 256, 2 layers, vocabulary 4096: 6.3M parameters) that proves nothing about speed.
SIZES: dict[str, dict[str, Any]] = {
    "150m": CONFIG,
    "300m": {**CONFIG, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 4608},
    "600m": {**CONFIG, "hidden_size": 1536, "num_attention_heads": 24, "num_key_value_heads": 8,
             "intermediate_size": 6656},
    "2b": {**CONFIG, "hidden_size": 3072, "num_attention_heads": 48, "num_key_value_heads": 8,
           "intermediate_size": 11264},
    "small": {**CONFIG, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 4096},
}


def _name(dtype: torch.dtype, size: str = "150m") -> str:
    return f"llama-{size}-{str(dtype).removeprefix('torch.')}-seed{SEED}"


def make_checkpoint(folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32, size: str = "150m") -> Path:
    """The benchmark checkpoint (``size``, a key of :data:`SIZES`) in ``dtype`` under ``folder``
    (written on first use); its path."""
    return make_model_checkpoint(folder, _name(dtype, size), "Llama", SIZES[size], dtype)


#: other architectures at real widths, for measurements of how autotp meets their layers
#: (``benchmarks/layer_regions.py``): name -> (transformers model family, config fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # GPT-2 124M's own config: its blocks take the KV cache by position
    "gpt2-124m": ("GPT2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    # the benchmark model's widths as a Mistral with Mistral-7B-v0.1's sliding window of 4096
    "mistral-150m-window4096": ("Mistral", {**CONFIG, "sliding_window": 4096}),
}


def make_model_checkpoint(folder: str | os.PathLike[str], name: str, family: str, fields: dict[str, Any],
                          dtype: torch.dtype = torch.float32) -> Path:
    """A seeded ``<family>ForCausalLM`` (``GPT2``: ``GPT2LMHeadModel``) of ``fields`` in ``dtype``,
    saved as ``folder/name`` on first use; its path."""
    import transformers

    root = Path(folder).expanduser()
    target = root / name
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    model_class = "GPT2LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM"
    config = getattr(transformers, f"{family}Config")(**fields, architectures=[model_class])
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(config).to(dtype).eval()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        model.save_pretrained(tmp)
        del model
        if target.exists():  # a concurrent writer finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of tensor data in the folder's safetensors files (headers excluded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(os.fspath(f), framework="pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                n = 1
                for s in sl.get_shape():
                    n *= int(s)
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
    return total
