"""Checkpoint resolution, sliced reads and ParameterMeta (autotp/weights.py).

Tolerances: every comparison here is exact (``torch.equal``). Slicing and concatenation move bytes
without arithmetic, and bf16 -> fp32 conversion is exact, so any difference is a bug.
No network: Hub ids resolve through a cache folder the test lays out, with offline mode on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from autotp import weight_files
from autotp.checkpoint_keys import Concatenated, Stored
from autotp.errors import AutoTPError, CheckpointError, ShardingError
from autotp.placement import P, R, Shard, StridedShard
from autotp.weights import (
    Checkpoint,
    ParameterMeta,
    build_meta_model,
    checkpoint_key,
    chunk_range,
    parameter_metas,
    resolve_checkpoint,
    tied_groups,
)
from tests._tiny import make_hf_cache, offline_hub, save_tiny, tiny_config, tiny_model

# ------------------------------------------------------------------------------------------------
# fixtures: saved once per module (saving is cheap; building the first model pays the imports)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"), seed=0)


@pytest.fixture(scope="module")
def llama_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama_sharded"), seed=0, shards=3)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama_bf16"), seed=0, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def awkward_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors whose sizes do not divide by 2 or 4 (torch.chunk gives short or missing chunks)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "even": torch.randn(128, 64, generator=g),
        "awkward": torch.randn(10, 7, generator=g),
        "five": torch.randn(5, 3, generator=g),
        "vector": torch.randn(13, generator=g),
    }
    folder = tmp_path_factory.mktemp("awkward")
    save_file(tensors, os.fspath(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tensors


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` (dirs too) with size and mtime in ns."""
    out = {".": (0, folder.stat().st_mtime_ns)}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        out[p.relative_to(folder).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------------------------------------
# resolution
# ------------------------------------------------------------------------------------------------


def test_hub_id_resolves_offline_through_a_laid_out_cache(tmp_path, llama_sharded, monkeypatch):
    """With HF_HUB_OFFLINE=1, 'org/name' resolves to the snapshot folder of a cache the test built,
    through huggingface_hub's own lookup (branch ref, then pinned commit); the index's shards come
    along and read back exactly."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    offline_hub(monkeypatch)
    cache = tmp_path / "hub"
    snapshot = make_hf_cache(cache, "tiny-org/tiny-llama", llama_sharded)
    assert (cache / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == snapshot.name
    # The layout is the one huggingface_hub itself reads.
    assert try_to_load_from_cache("tiny-org/tiny-llama", "config.json", cache_dir=cache) == os.fspath(
        snapshot / "config.json"
    )
    assert scan_cache_dir(cache).warnings == []

    folder = resolve_checkpoint("tiny-org/tiny-llama", cache_dir=cache)
    assert folder == snapshot
    assert resolve_checkpoint("tiny-org/tiny-llama", cache_dir=cache, revision=snapshot.name) == snapshot
    with Checkpoint(folder) as ck, Checkpoint(llama_sharded) as ref:
        assert len(ck.files) == 3
        for key in ref.keys():
            assert torch.equal(ck.read(key), ref.read(key))


def test_hub_id_resolves_with_local_files_only_without_offline_env(tmp_path, llama_dir, monkeypatch):
    """local_files_only=True is enough on its own (single-file checkpoint, no index)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # safety net: never reach the network
    snapshot = make_hf_cache(tmp_path / "hub", "tiny-org/single", llama_dir)
    assert (
        resolve_checkpoint("tiny-org/single", cache_dir=tmp_path / "hub", local_files_only=True) == snapshot
    )


def test_hub_download_fetches_small_files_then_exactly_the_indexed_shards(
    tmp_path, llama_sharded, monkeypatch
):
    """Step one asks for configs, tokenizer files, the index and model.safetensors; step two for the
    shards the index names, pinned to the commit step one resolved (so a second copy of the weights
    in another layout, e.g. consolidated.safetensors, is never fetched)."""
    import huggingface_hub

    offline_hub(monkeypatch)
    snapshot = make_hf_cache(tmp_path / "hub", "tiny-org/tiny-llama", llama_sharded)
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        calls.append(kwargs)
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    assert resolve_checkpoint("tiny-org/tiny-llama", cache_dir=tmp_path / "hub") == snapshot
    first, second = calls
    assert first["revision"] is None
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(
        first["allow_patterns"]
    )
    assert not any("*" in p for p in first["allow_patterns"])
    assert second["revision"] == snapshot.name
    assert second["allow_patterns"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_hub_repo_without_loadable_weights_suggests_a_conversion(tmp_path, llama_dir, monkeypatch):
    """A repo with neither safetensors nor pytorch_model*.bin (here a .pt file) gets the hint;
    .bin-only repos load (tests/unit/test_bin_checkpoints.py)."""
    offline_hub(monkeypatch)
    source = tmp_path / "pt_only"
    source.mkdir()
    shutil.copy(llama_dir / "config.json", source / "config.json")
    (source / "weights.pt").write_bytes(b"pickle")
    make_hf_cache(tmp_path / "hub", "tiny-org/pt-only", source)
    with pytest.raises(
        CheckpointError, match=r"no safetensors files \(nor pytorch_model\*\.bin\) in Hub repo 'tiny-org/pt-only'.*refs/pr/1"
    ):
        resolve_checkpoint("tiny-org/pt-only", cache_dir=tmp_path / "hub")


def test_hub_id_missing_from_offline_cache_names_repo_and_fix(tmp_path, monkeypatch):
    offline_hub(monkeypatch)
    with pytest.raises(CheckpointError, match=r"'tiny-org/absent'.*HF_HUB_OFFLINE=1.*hf download"):
        resolve_checkpoint("tiny-org/absent", cache_dir=tmp_path / "empty-hub")


def test_local_folder_checks(tmp_path, llama_dir):
    """A folder is returned as is; config-only folders need require_weights=False (the planner's; the
    error points users to `autotp plan`, not to that private option); folders with
    only other formats (.pt) get a conversion hint; non-existent paths are named."""
    assert resolve_checkpoint(llama_dir) == llama_dir.resolve()

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(llama_dir / "config.json", config_only / "config.json")
    assert resolve_checkpoint(config_only, require_weights=False) == config_only.resolve()
    with pytest.raises(CheckpointError, match=r"no safetensors files \(nor pytorch_model\*\.bin\) in folder "
                                              ".*to plan from the config alone, without weights, run `autotp plan "):
        resolve_checkpoint(config_only)

    (config_only / "weights.pt").write_bytes(b"not really")
    with pytest.raises(CheckpointError, match=r"weights\.pt instead.*save_pretrained"):
        resolve_checkpoint(os.fspath(config_only))
    (config_only / "pytorch_model.bin").write_bytes(b"not really")
    assert resolve_checkpoint(config_only) == config_only.resolve()  # .bin weights are loadable
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is not a readable PyTorch checkpoint"):
        Checkpoint(config_only)

    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint(tmp_path / "empty")


def test_users_folder_is_never_written_into(llama_sharded):
    """Resolving, opening, reading every shard of every rank and closing leaves the listing, sizes
    and mtimes of the user's folder unchanged."""
    before = _listing(llama_sharded)
    folder = resolve_checkpoint(llama_sharded)
    model = build_meta_model(tiny_config("llama"))
    with Checkpoint(folder) as ck:
        metas = parameter_metas(model, ck)
        for meta in metas.values():
            meta.placement = Shard(0)
            for rank in range(2):
                meta.load_local(rank, 2)
    assert _listing(llama_sharded) == before


# ------------------------------------------------------------------------------------------------
# Checkpoint
# ------------------------------------------------------------------------------------------------


def test_sharded_index_maps_keys_to_the_right_files(llama_sharded, llama_dir):
    index = json.loads((llama_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    with Checkpoint(llama_sharded) as ck, Checkpoint(llama_dir) as single:
        assert ck.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        assert sorted(ck.keys()) == sorted(single.keys()) == sorted(index)
        for key, fname in index.items():
            assert ck.file_of(key) == llama_sharded.resolve() / fname
            with safe_open(os.fspath(llama_sharded / fname), framework="pt") as f:
                assert key in f.keys()
            assert ck.shape(key) == single.shape(key)
            assert torch.equal(ck.read(key), single.read(key))  # same seed -> same bytes


@pytest.mark.parametrize("block_bytes", [weight_files.BLOCK_BYTES, 1], ids=["short-runs-in-one-block", "a-block-per-run"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("name", ["even", "awkward", "five"])
def test_read_slice_is_exactly_torch_chunk_and_reads_only_its_bytes(awkward_file, name, dim, world_size, block_bytes,
                                                                     monkeypatch):
    monkeypatch.setattr(weight_files, "BLOCK_BYTES", block_bytes)  # dim 1's short runs: blocks of rows
    folder, tensors = awkward_file
    full = tensors[name]
    chunks = torch.chunk(full, world_size, dim)
    for rank in range(world_size):
        with Checkpoint(folder) as ck:  # one Checkpoint per rank, as on a real rank
            start, stop = chunk_range(full.shape[dim], rank, world_size)
            out = ck.read_slice(name, dim, start, stop)
            expected = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
            assert torch.equal(out, expected)
            assert out.is_contiguous()
            # Only the slice was requested, and the result owns exactly those bytes (a copy, not a
            # view keeping the whole tensor's memory map alive).
            assert ck.bytes_read == expected.numel() * 4 < full.numel() * 4
            assert out.untyped_storage().nbytes() == expected.numel() * 4
            assert ck.reads == [(name, dim, start, stop)]


def test_read_full_and_vector(awkward_file):
    folder, tensors = awkward_file
    with Checkpoint(folder) as ck:
        assert ck.shape("vector") == (13,) and ck.dtype("vector") == torch.float32
        assert ck.bytes_read == 0  # headers only so far
        assert torch.equal(ck.read("vector"), tensors["vector"])
        assert torch.equal(ck.read_slice("vector", 0, 8, 13), tensors["vector"][8:13])
        assert ck.reads == [("vector", None, 0, 0), ("vector", 0, 8, 13)]
        assert ck.bytes_read == (13 + 5) * 4
        with pytest.raises(ValueError, match="out of range"):
            ck.read_slice("vector", 0, 8, 14)


def test_dtype_conversion_per_slice_bf16_checkpoint_to_fp32(llama_bf16):
    """bf16 -> fp32 is exact, so the converted slice equals the bf16 chunk upcast; bytes_read counts
    the stored bf16 bytes."""
    name = "model.layers.0.mlp.down_proj.weight"
    with Checkpoint(llama_bf16) as ck:
        assert ck.dtype(name) == torch.bfloat16
        full = ck.read(name)
        assert full.dtype == torch.bfloat16
        ck.bytes_read = 0
        for rank in range(4):
            start, stop = chunk_range(ck.shape(name)[1], rank, 4)
            out = ck.read_slice(name, 1, start, stop, dtype=torch.float32)
            assert out.dtype == torch.float32
            assert torch.equal(out, torch.chunk(full, 4, 1)[rank].float())
        assert ck.bytes_read == full.numel() * 2


def test_missing_key_lists_close_matches_and_files(llama_dir, llama_sharded):
    with Checkpoint(llama_dir) as ck:
        with pytest.raises(CheckpointError, match=r"q_proj\.weigth.*model\.safetensors.*q_proj\.weight"):
            ck.read("model.layers.0.self_attn.q_proj.weigth")
    # A model with a layer the checkpoint lacks: parameter_metas names the missing parameters.
    model = build_meta_model(tiny_config("llama", num_hidden_layers=3))
    with Checkpoint(llama_sharded) as ck:
        with pytest.raises(
            CheckpointError, match=r"parameters have no tensor.*model\.layers\.2\..*model-0000"
        ):
            parameter_metas(model, ck)


def test_truncated_or_missing_files_name_the_file_and_the_fix(tmp_path, llama_dir, llama_sharded):
    single = Path(shutil.copytree(llama_dir, tmp_path / "single"))
    weights = single / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors .*truncated or corrupt.*force_download"):
        Checkpoint(single)

    # Sharded: files open lazily, so the error comes with the first read from the broken shard.
    sharded = Path(shutil.copytree(llama_sharded, tmp_path / "sharded"))
    broken = sharded / "model-00002-of-00003.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    ck = Checkpoint(sharded)
    key = next(k for k in ck.keys() if ck.file_of(k) == broken.resolve())
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors .*force_download"):
        ck.read(key)

    broken.unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*incomplete"):
        Checkpoint(sharded)


# ------------------------------------------------------------------------------------------------
# names, ties, ParameterMeta
# ------------------------------------------------------------------------------------------------


def test_checkpoint_key_exact_then_without_then_with_prefix():
    keys = {"model.embed_tokens.weight", "lm_head.weight", "norm.weight"}
    assert checkpoint_key("lm_head.weight", keys, "model") == "lm_head.weight"
    assert checkpoint_key("embed_tokens.weight", keys, "model") == "model.embed_tokens.weight"
    assert checkpoint_key("model.norm.weight", keys, "model") == "norm.weight"
    assert checkpoint_key("model.layers.0.mlp.up_proj.weight", keys, "model") is None
    assert checkpoint_key("embed_tokens.weight", keys, "") is None


def test_tied_groups_on_meta_llama_with_tied_embeddings(tmp_path):
    model = build_meta_model(tiny_config("llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tied_groups(model) == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert tied_groups(build_meta_model(tiny_config("llama"))) == []

    # Built directly under init_empty_weights, accelerate re-wraps the parameters and the identity
    # is gone; the declared transformers mapping still groups them.
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        raw = transformers.LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=True))
    assert tied_groups(raw) == [["lm_head.weight", "model.embed_tokens.weight"]]

    # A real model whose user untied the weights is not regrouped by its config's declaration.
    eager = tiny_model("llama", tie_word_embeddings=True)
    assert tied_groups(eager) == [["lm_head.weight", "model.embed_tokens.weight"]]
    eager.lm_head.weight = torch.nn.Parameter(eager.lm_head.weight.detach().clone())
    assert tied_groups(eager) == []

    # Plain modules: grouping by identity.
    lin = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    lin[1].weight = lin[0].weight
    assert tied_groups(lin) == [["0.weight", "1.weight"]]

    # The lm_head, absent from a tied checkpoint, takes the embedding's key through its group.
    tied_dir = save_tiny("llama", tmp_path / "tied", tie_word_embeddings=True)
    with Checkpoint(tied_dir) as ck:
        assert "lm_head.weight" not in ck
        metas = parameter_metas(model, ck)
        assert metas["lm_head.weight"] is metas["model.embed_tokens.weight"]
        assert metas["lm_head.weight"].checkpoint_key == "model.embed_tokens.weight"
        assert metas["lm_head.weight"].tied == ("lm_head.weight", "model.embed_tokens.weight")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_meta_model_gives_meta_parameters_and_real_buffers(arch):
    model = build_meta_model(tiny_config(arch))
    eager = tiny_model(arch)
    assert not model.training
    assert all(p.device.type == "meta" for p in model.parameters())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())
    for name, b in eager.named_buffers():
        assert torch.equal(buffers[name], b), name  # inv_freq computed exactly as in eager

    bf16 = build_meta_model(tiny_config(arch), dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32  # transformers keeps rope in fp32
    assert torch.get_default_dtype() == torch.float32  # the default dtype is restored


def test_unknown_architecture_and_remote_code_raise_with_a_fix():
    config = tiny_config("llama")
    config.architectures = ["LlamaForCausalLMX"]
    with pytest.raises(AutoTPError, match=r"no architecture 'LlamaForCausalLMX'.*LlamaForCausalLM.*Upgrade"):
        build_meta_model(config)
    config.auto_map = {"AutoModelForCausalLM": "modeling_x.LlamaForCausalLMX"}
    with pytest.raises(AutoTPError, match="remote code.*trust_remote_code=True"):
        build_meta_model(config)


def test_chunk_range_matches_torch_chunk_including_empty_ranks():
    for size in range(0, 14):
        for world_size in (1, 2, 3, 4, 8):
            chunks = torch.chunk(torch.arange(size), world_size) if size else ()
            got = [torch.arange(size)[slice(*chunk_range(size, r, world_size))] for r in range(world_size)]
            for r in range(world_size):
                expected = chunks[r] if r < len(chunks) else torch.arange(0)
                assert torch.equal(got[r], expected), (size, world_size, r)
    with pytest.raises(ValueError):
        chunk_range(8, 2, 2)


@pytest.mark.parametrize(
    ("name", "placement", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", Shard(0), 0),  # colwise
        ("model.layers.0.self_attn.o_proj.weight", Shard(1), 1),  # rowwise
        ("model.embed_tokens.weight", Shard(0), 0),  # vocab
        ("model.norm.weight", R, None),  # replicate
    ],
)
def test_load_local_and_shard_from_cut_the_same_chunks(llama_dir, name, placement, dim):
    world_size = 4
    with Checkpoint(llama_dir) as ck:
        full = ck.read(name)
        meta = ParameterMeta(name, ck.shape(name), torch.float32, name, ck, placement=placement)
        ck.bytes_read = 0
        shards = [meta.load_local(r, world_size) for r in range(world_size)]
        for r, shard in enumerate(shards):
            assert tuple(shard.shape) == meta.local_shape(world_size, r)
            copy = meta.shard_from(full, r, world_size)
            assert torch.equal(copy, shard)
            assert (
                copy.is_contiguous()
                and copy.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
            )
        if dim is None:
            assert meta.index_range(0, world_size) is None
            assert all(torch.equal(s, full) for s in shards)
            assert ck.bytes_read == world_size * full.numel() * 4
        else:
            assert torch.equal(torch.cat(shards, dim), full)
            assert ck.bytes_read == full.numel() * 4  # the ranks together read the tensor once
        copy = meta.shard_from(full, 0, world_size)
        copy.zero_()
        assert torch.equal(full, ck.read(name))  # shard_from copies; the source is untouched


@pytest.mark.parametrize("folder", ["llama_dir", "llama_bf16"])
def test_a_shard_read_into_rows_of_a_buffer_equals_the_shard_read_alone(folder, request):
    """What materialize does for a group the fuse pass will fuse: a shard read into its rows of an
    fp32 buffer (the fp32 checkpoint straight from the file, the bf16 one converted per slice)
    equals the shard read on its own, for a colwise, a rowwise and a fused q|k|v (strided) shard,
    and each shard's bytes are read once. Exact (bf16 -> fp32 is exact)."""
    folder = request.getfixturevalue(folder)
    world_size, rank, before = 2, 1, 3
    layer = "model.layers.0."
    with Checkpoint(folder) as ck:
        ck.add_conversions({"qkv": Concatenated(0, tuple(Stored(f"{layer}self_attn.{p}_proj.weight") for p in "qkv"))})
        q, k = ck.shape(layer + "self_attn.q_proj.weight"), ck.shape(layer + "self_attn.k_proj.weight")
        metas = [
            ParameterMeta("q", q, torch.float32, layer + "self_attn.q_proj.weight", ck, placement=Shard(0)),
            ParameterMeta("o", q, torch.float32, layer + "self_attn.o_proj.weight", ck, placement=Shard(1)),
            ParameterMeta("qkv", (q[0] + 2 * k[0], q[1]), torch.float32, "qkv", ck,
                          placement=StridedShard(0, (q[0], k[0], k[0]))),
        ]
        itemsize = ck.dtype(layer + "self_attn.q_proj.weight").itemsize
        for meta in metas:
            alone = meta.load_local(rank, world_size, dtype=torch.float32)
            rows, width = meta.local_shape(world_size, rank)
            buffer = torch.zeros(before + rows, width)  # (rows of an earlier sibling + this shard's, in-features)
            ck.bytes_read = 0
            got = meta.load_local(rank, world_size, out=buffer.narrow(0, before, rows))
            assert got.data_ptr() == buffer[before].data_ptr(), meta.fqn
            assert torch.equal(buffer[before:], alone) and not buffer[:before].any(), meta.fqn
            assert ck.bytes_read == alone.numel() * itemsize, meta.fqn
        norm = layer + "input_layernorm.weight"  # replicated: the whole tensor lands in out
        meta = ParameterMeta("norm", ck.shape(norm), torch.float32, norm, ck, placement=R)
        out = torch.zeros(ck.shape(norm))
        assert meta.load_local(rank, world_size, out=out) is out
        assert torch.equal(out, meta.load_local(rank, world_size, dtype=torch.float32))


def test_shape_mismatch_names_both_shapes_and_the_config_field(llama_dir):
    model = build_meta_model(tiny_config("llama", vocab_size=256))
    with Checkpoint(llama_dir) as ck:
        metas = parameter_metas(model, ck)
        with pytest.raises(CheckpointError, match=r"\(256, 64\).*\(128, 64\).*vocab_size"):
            metas["model.embed_tokens.weight"].load_local(0, 2)


def test_partial_parameter_placement_is_refused():
    meta = ParameterMeta("w", (4, 4), torch.float32, placement=P)
    with pytest.raises(ShardingError, match="Replicate or Shard"):
        meta.index_range(0, 2)
    with pytest.raises(CheckpointError, match="no checkpoint key"):
        ParameterMeta("w", (4, 4), torch.float32).load_local(0, 1)
