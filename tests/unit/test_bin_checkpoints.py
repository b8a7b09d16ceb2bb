"""PyTorch ``.bin`` checkpoints: read through ``torch.load(mmap=True, weights_only=True)``, sliced
like safetensors, fetched from the Hub only when a repo has no safetensors.

Tolerances: exact (``torch.equal``). Reads move bytes without arithmetic and bf16 -> fp32 is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from autotp import parallelize_model
from autotp.errors import CheckpointError
from autotp.weights import Checkpoint, chunk_range, resolve_checkpoint
from tests._tiny import make_hf_cache, offline_hub, save_tiny, save_tiny_bin, tiny_model

DOWN = "model.layers.0.mlp.down_proj.weight"  # (64, 128)


@pytest.fixture(scope="module")
def bin_single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bin("llama", tmp_path_factory.mktemp("bin_single"))


@pytest.fixture(scope="module")
def bin_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bin("llama", tmp_path_factory.mktemp("bin_sharded"), shards=3)


@pytest.fixture(scope="module")
def safetensors_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("st"))


def test_a_single_and_a_sharded_bin_hold_the_same_tensors_as_safetensors(bin_single, bin_sharded, safetensors_dir):
    assert sorted(p.name for p in bin_sharded.glob("*.bin")) == [
        f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    with Checkpoint(bin_single) as single, Checkpoint(bin_sharded) as sharded, Checkpoint(safetensors_dir) as ref:
        assert single.files == ["pytorch_model.bin"]
        assert len(sharded.files) == 3
        assert sorted(single.keys()) == sorted(sharded.keys()) == sorted(ref.keys())
        for key in ref.keys():
            assert single.shape(key) == sharded.shape(key) == ref.shape(key)
            assert torch.equal(sharded.read(key), ref.read(key))


@pytest.mark.parametrize("dim", [0, 1])
def test_a_bin_slice_is_the_torch_chunk_and_owns_only_its_bytes(bin_sharded, dim):
    with Checkpoint(bin_sharded) as ck:
        full = ck.read(DOWN)
        ck.bytes_read = 0
        for rank in range(2):
            start, stop = chunk_range(full.shape[dim], rank, 2)
            out = ck.read_slice(DOWN, dim, start, stop)
            assert torch.equal(out, torch.chunk(full, 2, dim)[rank])
            assert out.is_contiguous() and out.untyped_storage().nbytes() == full.numel() * 4 // 2
        assert ck.bytes_read == full.numel() * 4


def test_a_bf16_bin_converts_per_slice_to_fp32(tmp_path):
    folder = save_tiny_bin("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    with Checkpoint(folder) as ck:
        assert ck.dtype(DOWN) == torch.bfloat16
        full = ck.read(DOWN)
        out = ck.read_slice(DOWN, 1, 64, 128, dtype=torch.float32)
        assert out.dtype == torch.float32
        assert torch.equal(out, full[:, 64:].float())


def test_parallelize_model_loads_a_sharded_bin_and_gives_the_eager_logits(bin_sharded):
    model = parallelize_model(bin_sharded, tp_size=1, progress=False)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        expected = tiny_model("llama")(input_ids=ids).logits
    assert torch.equal(got, expected)  # one process, same kernels: bit-identical


def test_a_corrupt_bin_is_named_with_the_fix(tmp_path, bin_single):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((bin_single / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes((bin_single / "pytorch_model.bin").read_bytes()[:2000])
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is not a readable PyTorch checkpoint.*save_pretrained"):
        Checkpoint(folder)


def test_a_bin_holding_code_is_refused_by_weights_only(tmp_path, bin_single):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((bin_single / "config.json").read_text())
    torch.save({"w": torch.ones(2), "f": Path("x")}, folder / "pytorch_model.bin")  # not a tensor: refused
    with pytest.raises(CheckpointError, match="weights_only"):
        Checkpoint(folder)


def test_a_hub_repo_with_only_bin_weights_fetches_exactly_the_bin_shards(tmp_path, bin_sharded, monkeypatch):
    import huggingface_hub

    offline_hub(monkeypatch)
    snapshot = make_hf_cache(tmp_path / "hub", "tiny-org/bin-llama", bin_sharded)
    calls: list[list[str]] = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        calls.append(kwargs["allow_patterns"])
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    assert resolve_checkpoint("tiny-org/bin-llama", cache_dir=tmp_path / "hub") == snapshot
    index = json.loads((bin_sharded / "pytorch_model.bin.index.json").read_text())
    assert calls[1:] == [
        ["*.safetensors"],
        ["pytorch_model.bin.index.json", "pytorch_model.bin"],
        sorted(set(index["weight_map"].values())),
    ]


def test_an_fp32_checkpoint_reads_as_bf16_one_slice_at_a_time(safetensors_dir):
    """dtype= converts each slice after reading only that slice (bytes_read counts stored fp32 bytes
    of the slice, never the full tensor); the result is the bf16 cast of the fp32 chunk."""
    with Checkpoint(safetensors_dir) as ck:
        full = ck.read(DOWN)
        ck.bytes_read = 0
        out = ck.read_slice(DOWN, 0, 32, 64, dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, full[32:].to(torch.bfloat16))
        assert ck.bytes_read == 32 * 128 * 4


def test_parallelize_model_runs_an_fp32_checkpoint_in_bf16(safetensors_dir):
    model = parallelize_model(safetensors_dir, dtype="bf16", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        # transformers' own bf16 load keeps rotary inv_freq in fp32, as autotp does
        reference = LlamaForCausalLM.from_pretrained(safetensors_dir, dtype=torch.bfloat16).eval()
        expected = reference(input_ids=ids).logits
    assert torch.equal(got, expected)  # one process, same bf16 kernels: bit-identical
