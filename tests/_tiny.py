"""Tiny, seeded transformers models for tests: configs, saved checkpoints, offline Hub caches.

Every test in the project builds its models here, never from the Hub. The models are real
transformers architectures (nobody here wrote their modeling code), just small:

* ``tiny_config("llama" | "mistral" | "qwen2", **overrides)`` - hidden 64, 8 heads, 4 kv heads
  (head_dim 8), 2 layers, vocab 128, intermediate 128, untied embeddings. qwen2 carries q/k/v biases.
* ``tiny_model(arch, seed=0, dtype=..., **overrides)`` - that model, initialized under ``seed``.
* ``tiny_plan(arch, tp=2, dtype=None, overrides=None, **config_overrides)`` - its forward plan
  (``autotp.planner.plan_model``, meta device), planned once per session for the same arguments.
* ``save_tiny(arch, folder, seed=0, shards=1, dtype=..., **overrides)`` - ``save_pretrained`` output
  (config.json, generation_config.json, model.safetensors), or ``shards`` files
  ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
* ``through_regions(model)`` - whether each layer of a parallelized model's layer stack runs through
  its layer region (``autotp/regions.py``): multi-rank tests that pass ``layer_regions=True`` at 2
  layers (the path of every model of 4 layers or more) assert it.
* ``make_hf_cache(cache_dir, repo_id, source_folder, revision="main")`` - a Hugging Face cache entry
  (``models--org--name/{blobs,snapshots/<commit>,refs/<revision>}``) that
  ``snapshot_download(repo_id, cache_dir=..., local_files_only=True)`` resolves offline.

Note for offline tests: ``huggingface_hub.constants.HF_HUB_OFFLINE`` is read at import time, so a
test must patch that constant as well as the ``HF_HUB_OFFLINE`` environment variable
(:func:`offline_hub` does both).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["ARCHS", "make_hf_cache", "offline_hub", "save_tiny", "through_regions", "tiny_config", "tiny_model",
           "tiny_plan"]

#: Common sizes: small, but with kv heads != heads and head_dim > 1 so GQA and rotary are exercised.
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=2,
    vocab_size=128,
    intermediate_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

#: arch -> (config class, model class, arch-specific overrides) in the ``transformers`` namespace.
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v projections carry biases in Qwen2
    # OLMo-2: RMSNorms over all q heads and all k heads (q_norm / k_norm), norms after each sublayer
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"bos_token_id": 1, "eos_token_id": 2}),
}


def _classes(arch: str) -> tuple[Any, Any, dict[str, Any]]:
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(ARCHS)}")
    cfg_name, model_name, extra = ARCHS[arch]
    return getattr(transformers, cfg_name), getattr(transformers, model_name), extra


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A tiny transformers config for ``arch``; ``overrides`` win (e.g. ``tie_word_embeddings=True``,
    ``pad_token_id=100``). ``architectures`` is set, as in a saved config.json."""
    cfg_cls, model_cls, extra = _classes(arch)
    kwargs = {**({} if arch in OWN_SIZES else _COMMON), **extra, **overrides}
    config = cfg_cls(**kwargs)
    if not getattr(config, "architectures", None):
        config.architectures = [model_cls.__name__]
    return config


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The tiny model, initialized by transformers' own init under ``torch.manual_seed(seed)``, in
    eval mode and ``dtype``."""
    _, model_cls, _ = _classes(arch)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.to(dtype).eval()


#: tiny_plan's reports, by their arguments (one pytest session)
_PLANS: dict[str, Any] = {}


def tiny_plan(arch: str, tp: int = 2, *, dtype: str | None = None, overrides: dict[str, str] | None = None,
              **config_overrides: Any) -> Any:
    """``plan_model(tiny_config(arch, **config_overrides), tp, dtype=dtype, decode=False,
    overrides=overrides)``: the tiny model's forward plan, in this process on the meta device.

    Planned once per session for the same arguments: several test files assert different facts of
    the same plan (the matrix's per-block counts, the MoE placements, the exported ``tp_plan``), and
    each plan traces, decomposes and solves the model again. The report is shared: read it, never
    change it. Tests about planning itself (errors, timings, options) call ``plan_model``."""
    key = json.dumps([arch, tp, dtype, overrides, config_overrides], sort_keys=True, default=str)
    if key not in _PLANS:
        from autotp.planner import plan_model

        _PLANS[key] = plan_model(tiny_config(arch, **config_overrides), tp, dtype=dtype, decode=False,
                                 overrides=overrides)
    return _PLANS[key]


def one_process_reference(folder: Path, prompt: list[list[int]], new_tokens: int,
                          pad_token_id: int) -> tuple[torch.Tensor, list[int]]:
    """What one plain transformers process gives for ``prompt`` from the checkpoint in ``folder``:
    its logits and the greedy tokens of ``generate`` (the reference the ranks are compared with)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(prompt)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    return logits, tokens[0].tolist()


def through_regions(model: torch.nn.Module) -> list[bool]:
    """For each layer of ``model``'s layer stack that takes a KV cache (``regions.regional_layers``):
    is it swapped to its region class (``Regional<Name>_<digest>``)? Empty where there is no such
    stack (encoder-decoders)."""
    from autotp.regions import regional_layers

    return [type(layer).__name__.startswith("Regional") for layer in regional_layers(model)]


def save_tiny(
    arch: str,
    folder: str | os.PathLike[str],
    *,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Save the tiny model to ``folder`` with ``save_pretrained`` and return the folder.

    ``shards > 1`` splits the weights into exactly that many files (contiguous runs of keys, balanced
    by bytes) and writes ``model.safetensors.index.json`` as save_pretrained would.
    """
    folder = Path(folder)
    model = tiny_model(arch, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(folder)
    if shards > 1:
        _reshard(folder, shards)
    return folder


def _reshard(folder: Path, shards: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    single = folder / "model.safetensors"
    with safe_open(os.fspath(single), framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    keys = list(tensors)
    if shards > len(keys):
        raise ValueError(f"cannot split {len(keys)} tensors into {shards} non-empty shards")
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in keys]
    total = sum(sizes)
    # Cut points balanced by bytes; every shard keeps at least one tensor.
    cumulative = [sum(sizes[: i + 1]) for i in range(len(keys))]
    cuts = [0]
    for j in range(1, shards):
        ideal = next(i + 1 for i, c in enumerate(cumulative) if c * shards >= j * total)
        cuts.append(min(max(ideal, cuts[-1] + 1), len(keys) - (shards - j)))
    cuts.append(len(keys))
    groups = [keys[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    weight_map: dict[str, str] = {}
    for j, group in enumerate(groups):
        name = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in group}, os.fspath(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()


_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def make_hf_cache(
    cache_dir: str | os.PathLike[str],
    repo_id: str,
    source_folder: str | os.PathLike[str],
    revision: str = "main",
) -> Path:
    """Lay out ``source_folder`` as Hub repo ``repo_id`` in the Hugging Face cache ``cache_dir``.

    The layout is huggingface_hub's (folder name from ``huggingface_hub.file_download.
    repo_folder_name``)::

        models--org--name/blobs/<sha256 of the file>
        models--org--name/snapshots/<commit>/<path>  -> ../../blobs/<sha256>  (relative symlink)
        models--org--name/refs/<revision>            (the commit, no newline)

    ``revision`` is a branch/tag name (a ``refs`` file is written; the commit is a hash of the
    content) or a 40-hex commit (no ``refs`` file). Where symlinks are unavailable files are
    copied, as huggingface_hub does. Returns the snapshot folder.
    """
    from huggingface_hub.file_download import repo_folder_name

    source = Path(source_folder)
    storage = Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    if _COMMIT_RE.match(revision):
        commit = revision
    else:
        h = hashlib.sha1(repo_id.encode())
        for p in files:
            h.update(f"{p.relative_to(source).as_posix()}\0{digests[p]}\n".encode())
        commit = h.hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for p in files:
        rel = p.relative_to(source)
        blob = storage / "blobs" / digests[p]
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))
        except OSError:
            shutil.copyfile(blob, link)
    if not _COMMIT_RE.match(revision):
        ref = storage / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snapshot


def offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn huggingface_hub's offline mode on for one test (env var and the import-time constant)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# --------------------------------------------------------------------------------------------------
# More architectures (issue 3: any transformers architecture, no per-model code). Each spells its
# own sizes in its config's field names (hidden 64, 8 heads of 8, 2 layers, vocab 128, MLP 128):
# the Llama-family ``_COMMON`` fields mean nothing, or something else, to these configs.
# --------------------------------------------------------------------------------------------------

#: archs whose overrides carry their full sizes (``_COMMON`` is not merged in)
OWN_SIZES: set[str] = set()


def _add_arch(arch: str, config_cls: str, model_cls: str, **sizes: Any) -> None:
    ARCHS[arch] = (config_cls, model_cls, sizes)
    OWN_SIZES.add(arch)


# GPT-2: Conv1D weights stored (in, out), fused c_attn (q|k|v along the output), tied lm_head
_add_arch("gpt2", "GPT2Config", "GPT2LMHeadModel", n_embd=64, n_head=8, n_layer=2, n_inner=128,
          vocab_size=128, n_positions=256, bos_token_id=1, eos_token_id=2)
# OPT: biased projections, learned positions offset by 2, ReLU MLP (fc1/fc2)
_add_arch("opt", "OPTConfig", "OPTForCausalLM", hidden_size=64, num_attention_heads=8, num_hidden_layers=2,
          ffn_dim=128, vocab_size=128, max_position_embeddings=256, word_embed_proj_dim=64)
# BERT encoder (bidirectional), biased row-parallel output dense layers, post-LayerNorm
_add_arch("bert", "BertConfig", "BertModel", hidden_size=64, num_attention_heads=8, num_hidden_layers=2,
          intermediate_size=128, vocab_size=128, max_position_embeddings=256)
# RoBERTa masked LM: positions counted from padding_idx + 1, so max positions > pad id + length
_add_arch("roberta", "RobertaConfig", "RobertaForMaskedLM", hidden_size=64, num_attention_heads=8,
          num_hidden_layers=2, intermediate_size=128, vocab_size=128, max_position_embeddings=256)
# GPT-NeoX: fused query_key_value interleaved per head, (H, 3, D); partial rotary; parallel residual
_add_arch("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=64, num_attention_heads=8,
          num_hidden_layers=2, intermediate_size=128, vocab_size=128, max_position_embeddings=256,
          tie_word_embeddings=False)
# Phi-3: fused qkv_proj (q | k | v with GQA sizes) and gate_up_proj (gate | up)
_add_arch("phi3", "Phi3Config", "Phi3ForCausalLM", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
          num_hidden_layers=2, intermediate_size=128, vocab_size=128, max_position_embeddings=256,
          original_max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Falcon (7B layout): multi-query attention (one kv head), fused query_key_value, parallel attn/MLP
_add_arch("falcon", "FalconConfig", "FalconForCausalLM", hidden_size=64, num_attention_heads=8,
          num_hidden_layers=2, vocab_size=128, multi_query=True, new_decoder_architecture=False,
          alibi=False, parallel_attn=True, bias=False, max_position_embeddings=256)
# Gemma-2: logit soft-capping (attention and final), alternating sliding-window layers, tied head
_add_arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", hidden_size=64, num_attention_heads=8,
          num_key_value_heads=4, head_dim=8, num_hidden_layers=2, intermediate_size=128, vocab_size=128,
          max_position_embeddings=256, sliding_window=4, attn_logit_softcapping=50.0,
          final_logit_softcapping=30.0)
# BLOOM: alibi position bias (per-head slopes), fused query_key_value interleaved per head
_add_arch("bloom", "BloomConfig", "BloomForCausalLM", hidden_size=64, n_head=8, n_layer=2, vocab_size=128)
# T5: encoder-decoder, relative position bias table (buckets, heads), tied and rescaled lm_head
_add_arch("t5", "T5Config", "T5ForConditionalGeneration", d_model=64, d_kv=8, d_ff=128, num_layers=2,
          num_decoder_layers=2, num_heads=8, vocab_size=128, relative_attention_num_buckets=8)
# Mixtral: sparse MoE (4 experts, top-2), expert weights stacked in one parameter per projection
_add_arch("mixtral", "MixtralConfig", "MixtralForCausalLM", hidden_size=64, num_attention_heads=8,
          num_key_value_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=128,
          max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


# --------------------------------------------------------------------------------------------------
# PyTorch ``.bin`` checkpoints (issue 6): the layout transformers wrote before safetensors.
# --------------------------------------------------------------------------------------------------


def save_tiny_bin(
    arch: str,
    folder: str | os.PathLike[str],
    *,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """``save_tiny`` with PyTorch pickles instead of safetensors: ``pytorch_model.bin``, or
    ``shards`` files ``pytorch_model-0000i-of-0000N.bin`` plus ``pytorch_model.bin.index.json``
    (``torch.save`` zip format, plain tensors only, as ``save_pretrained(safe_serialization=False)``
    wrote them). Same seed, same values as :func:`save_tiny`."""
    folder = Path(save_tiny(arch, folder, seed=seed, shards=shards, dtype=dtype, **overrides))
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    weight_map: dict[str, str] = {}
    for j, path in enumerate(files):
        tensors = {k: v.clone() for k, v in load_file(os.fspath(path)).items()}
        name = "pytorch_model.bin" if shards == 1 else f"pytorch_model-{j + 1:05d}-of-{shards:05d}.bin"
        torch.save(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
        path.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    if shards > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder
