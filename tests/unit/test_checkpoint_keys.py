"""Checkpoint keys through transformers' own conversion mapping (autotp/checkpoint_keys.py).

The reference is transformers itself: ``from_pretrained`` of the same tiny checkpoint. Every
comparison is exact (``torch.equal``): stacking, concatenating and slicing move bytes without
arithmetic, so any difference is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autotp.checkpoint_keys import Concatenated, Converted, Stacked, Stored, converted_sources
from autotp.placement import Shard, StridedShard
from autotp.weights import Checkpoint, build_meta_model, parameter_metas
from tests._tiny import save_tiny, tiny_config


def _loaded(arch: str, folder: Path) -> dict[str, torch.Tensor]:
    import transformers

    from tests._tiny import ARCHS

    model = getattr(transformers, ARCHS[arch][1]).from_pretrained(folder)
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.mark.parametrize("arch", ["mixtral", "gpt_neox"])
def test_every_parameter_reads_as_transformers_loads_it(tmp_path: Path, arch: str) -> None:
    folder = save_tiny(arch, tmp_path / arch)
    expected = _loaded(arch, folder)
    with Checkpoint(folder) as ckpt:
        metas = parameter_metas(build_meta_model(tiny_config(arch)), ckpt)
        for name, tensor in expected.items():
            assert torch.equal(metas[name].load_local(0, 1), tensor), name


def test_a_renamed_head_reads_the_stored_tensor(tmp_path: Path) -> None:
    folder = save_tiny("gpt_neox", tmp_path / "neox")
    with Checkpoint(folder) as ckpt:
        assert "lm_head.weight" not in ckpt
        ckpt.add_conversions_for(build_meta_model(tiny_config("gpt_neox")))
        assert ckpt._converted["lm_head.weight"] == Stored("embed_out.weight")
        assert ckpt.shape("lm_head.weight") == ckpt.shape("embed_out.weight")


def test_stacked_experts_are_built_as_transformers_builds_them(mixtral_dir: Path) -> None:
    with Checkpoint(mixtral_dir) as ckpt:
        sources = converted_sources(build_meta_model(tiny_config("mixtral")), ckpt.keys())
    prefix = "model.layers.0.block_sparse_moe.experts"
    gate_up = sources["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up == Concatenated(1, (
        Stacked(0, tuple(Stored(f"{prefix}.{e}.w1.weight") for e in range(4))),
        Stacked(0, tuple(Stored(f"{prefix}.{e}.w3.weight") for e in range(4))),
    ))
    assert sources["model.layers.0.mlp.experts.down_proj"] == Stacked(
        0, tuple(Stored(f"{prefix}.{e}.w2.weight") for e in range(4)))


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_only_its_rows_of_every_expert(mixtral_dir: Path, world: int) -> None:
    """gate_up sharded strided on the intermediate dim (gate | up), down_proj on its input dim and
    on the expert dim: each rank's shard equals the chunk of transformers' tensor, and the bytes
    read are exactly the shard's."""
    expected = _loaded("mixtral", mixtral_dir)
    intermediate = 128
    cases = [("model.layers.1.mlp.experts.gate_up_proj", StridedShard(1, (intermediate, intermediate))),
             ("model.layers.1.mlp.experts.down_proj", Shard(2)),
             ("model.layers.1.mlp.experts.down_proj", Shard(0))]
    with Checkpoint(mixtral_dir) as ckpt:
        metas = parameter_metas(build_meta_model(tiny_config("mixtral")), ckpt)
        for name, placement in cases:
            meta = metas[name]
            meta.placement = placement
            full = expected[name]
            for rank in range(world):
                before = ckpt.bytes_read
                local = meta.load_local(rank, world)
                if isinstance(placement, StridedShard):
                    want = torch.cat([seg.chunk(world, 1)[rank] for seg in full.split(intermediate, 1)], 1)
                else:
                    want = full.chunk(world, placement.dim)[rank]
                assert torch.equal(local, want), (name, placement, rank)
                assert ckpt.bytes_read - before == want.numel() * want.element_size()


def test_other_conversions_run_transformers_operations_then_slice(tmp_path: Path) -> None:
    """A converter with an operation that is not a stack or a concatenation (here ``Chunk``: a
    fused gate|up stored as one tensor) runs transformers' own operations on the full tensors."""
    from transformers.core_model_loading import Chunk, WeightConverter

    folder = save_tiny("llama", tmp_path / "llama")
    tensors = load_file(folder / "model.safetensors")
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        tensors[f"{mlp}.gate_up.weight"] = torch.cat(
            [tensors.pop(f"{mlp}.gate_proj.weight"), tensors.pop(f"{mlp}.up_proj.weight")], 0)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    fused = WeightConverter("mlp.gate_up.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)])
    model = build_meta_model(tiny_config("llama"))
    with Checkpoint(folder) as ckpt:
        sources = converted_sources(model, ckpt.keys(), transforms=[fused])
        assert isinstance(sources["model.layers.1.mlp.up_proj.weight"], Converted)
        ckpt.add_conversions(sources)
        metas = parameter_metas(model, ckpt)
        up = metas["model.layers.1.mlp.up_proj.weight"]
        up.placement = Shard(0)
        stored = tensors["model.layers.1.mlp.gate_up.weight"]
        assert ckpt.shape(up.checkpoint_key) == (128, 64)
        assert torch.equal(up.load_local(1, 2), stored[128:].chunk(2, 0)[1])
